"""data/prepare.py on tiny corpora written into tmp_path: its outputs, its sources, the split, the
command line."""

import fcntl
import gzip
import hashlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from corpora import META_KEYS, ROOT, VOCAB, WORDS, decode_split, document, read_meta, write_corpus
from data import corpus as corpus_module
from data import prepare as prepare_module
from data.loader import TokenBatches
from data.meta import EOT, EOT_ID, DataError
from data.prepare import PrepareError, prepare
from data.store import is_complete
from data.tokens import _content_key, split_documents


def test_files_glob_writes_uint16_tokens_split_by_document(corpus: Path, tmp_path: Path) -> None:
    out = prepare("tiny", files=[str(corpus / "*.txt")], vocab_size=VOCAB, out_root=tmp_path)
    assert out == tmp_path / "tiny"
    meta = read_meta(out)
    assert meta.keys() >= META_KEYS
    assert meta["name"] == "tiny" and meta["source"]["kind"] == "files"
    assert meta["eot_id"] == EOT_ID
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.token_to_id(EOT) == EOT_ID
    assert meta["vocab_size"] == tokenizer.get_vocab_size() <= VOCAB
    digest = hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    assert meta["tokenizer_sha256"] == digest

    texts = {word: document(word) for word in WORDS}
    decoded = {split: decode_split(out, split) for split in ("train", "val")}
    # Whole documents, each in exactly one split, decoding back to the original text.
    assert sorted(decoded["train"] + decoded["val"]) == sorted(texts.values())
    originals = list(texts.values())
    expected = split_documents(originals, prepare_module.DEFAULT_VAL_FRACTION, seed=0)
    assert sorted(decoded["val"]) == sorted(originals[i] for i in expected.val)
    assert meta["duplicate_documents"] == 0
    for split, documents in decoded.items():
        counts = meta["splits"][split]
        size = (out / f"{split}.bin").stat().st_size
        assert counts["documents"] == len(documents)
        assert counts["bytes"] == sum(len(d.encode("utf-8")) for d in documents)
        assert counts["tokens"] * 2 == size
        assert np.fromfile(out / f"{split}.bin", dtype=np.uint16).max() < meta["vocab_size"]

    # The tokenizer saw only train documents: only their words became single tokens.
    for word in WORDS:
        in_train = texts[word] in decoded["train"]
        assert (tokenizer.token_to_id("Ġ" + word) is not None) == in_train, word


def test_a_literal_separator_in_a_document_is_text_not_a_boundary(tmp_path: Path) -> None:
    """A document that quotes "<|endoftext|>" keeps it as text: only prepare's own separators
    end documents, so none is split in two and each decodes back whole."""
    texts = {f"{w}.txt": document(w) for w in WORDS}
    texts["quokka.txt"] += f"a {EOT} b\n"
    folder = write_corpus(tmp_path / "corpus", texts)
    out = prepare("tiny", files=[str(folder / "*.txt")], vocab_size=VOCAB, out_root=tmp_path)
    assert sorted(decode_split(out, "train") + decode_split(out, "val")) == sorted(texts.values())
    meta = read_meta(out)
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == len(WORDS)


def test_a_vocabulary_the_text_cannot_fill_is_said(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """BPE stops where no pair is left to merge: a small corpus gets fewer tokens than asked."""
    out = prepare("small", files=[str(corpus / "*.txt")], vocab_size=60_000, out_root=tmp_path)
    tokens = read_meta(out)["vocab_size"]
    assert tokens < 60_000
    assert f"note: the tokenizer has {tokens} tokens, fewer than --vocab-size 60000" in (
        capsys.readouterr().out
    )


def test_a_file_matched_twice_is_read_once_and_said(
    corpus: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A file named twice, or by a name and a glob, is one document: the note says why fewer
    documents were read than named."""
    monkeypatch.chdir(corpus)
    files = ["quokka.txt", "*.txt", "quokka.txt", "zephyr.txt"]
    out = prepare("twice", files=files, vocab_size=VOCAB, out_root=tmp_path)
    counts = read_meta(out)["splits"]
    assert counts["train"]["documents"] + counts["val"]["documents"] == len(WORDS)
    assert read_meta(out)["duplicate_documents"] == 0
    said = capsys.readouterr().out
    note = "note: --files matched 2 files more than once (quokka.txt, zephyr.txt); each file"
    assert note in said
    # Distinct files, one match each: nothing to say.
    prepare("once", files=["*.txt"], vocab_size=VOCAB, out_root=tmp_path)
    assert "more than once" not in capsys.readouterr().out


def test_a_corpus_records_where_its_documents_are_from_anywhere(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relative --files patterns are recorded absolute: the rebuild command a damaged corpus's
    error gives is run from the project root, not from where prepare ran."""
    monkeypatch.chdir(corpus)
    out = prepare("tiny", files=["*.txt"], vocab_size=VOCAB, out_root=tmp_path)
    assert read_meta(out)["source"]["patterns"] == [str(corpus / "*.txt")]
    monkeypatch.chdir(tmp_path)
    (out / "val.bin").write_bytes(b"")
    with pytest.raises(DataError, match=re.escape(f"--files '{corpus / '*.txt'}' ")):
        TokenBatches(out / "val.bin", 8, 2, 0, torch.device("cpu"))


def test_file_names_with_glob_characters_are_literal(tmp_path: Path) -> None:
    folder = write_corpus(
        tmp_path / "corpus", {"a[1].txt": "first doc\n", "b*.txt": "second doc\n"}
    )
    out = prepare(
        "odd",
        files=[str(folder / "a[1].txt"), str(folder / "b*.txt")],
        out_root=tmp_path,
        vocab_size=300,
    )
    documents = decode_split(out, "train") + decode_split(out, "val")
    assert sorted(documents) == ["first doc\n", "second doc\n"]


def test_hub_reads_local_parquet_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import datasets

    rows = {"body": [document(w) for w in WORDS] + ["", None], "id": list(range(len(WORDS) + 2))}
    folder = tmp_path / "hub"
    folder.mkdir()
    datasets.Dataset.from_dict(rows).to_parquet(str(folder / "train-00000.parquet"))

    out = prepare("hubby", hub=str(folder), text_column="body", vocab_size=VOCAB, out_root=tmp_path)
    meta = read_meta(out)
    assert meta["source"] | {"kind": "hub", "text_column": "body", "rows": 8} == meta["source"]
    assert meta["skipped"]["empty_documents"] == 2
    documents = decode_split(out, "train") + decode_split(out, "val")
    assert sorted(documents) == sorted(document(w) for w in WORDS)
    # A local folder's Arrow copy is temporary: a kept one would go stale with each edit
    assert not (out / prepare_module.HF_CACHE_DIR).exists()
    assert not list(tmp_path.glob(".prepare-*")), "the copy made to hash the folder is removed"
    # --hub=~/hub, which no shell expands: the same folder, so the same corpus, reused
    monkeypatch.setenv("HOME", str(tmp_path))
    capsys.readouterr()
    prepare("hubby", hub="~/hub", text_column="body", vocab_size=VOCAB, out_root=tmp_path)
    assert "reusing" in capsys.readouterr().out
    # Moved, and typed with a trailing slash: the same documents, reused; meta.json follows it
    moved = folder.rename(tmp_path / "moved")
    prepare("hubby", hub=f"{moved}/", text_column="body", vocab_size=VOCAB, out_root=tmp_path)
    assert "reusing" in capsys.readouterr().out
    assert read_meta(out)["source"]["dataset"] == str(moved)
    folder = moved

    with pytest.raises(PrepareError, match=r"--text-column 'nope'.*columns: \['body', 'id'\]"):
        prepare("hubby", hub=str(folder), text_column="nope", out_root=tmp_path)
    with pytest.raises(PrepareError, match=r"--text-column 'id'.*not strings"):
        prepare("hubby", hub=str(folder), text_column="id", out_root=tmp_path)
    # --split on the command line reaches the loader
    argv = ["--name", "hubby", "--hub", str(folder), "--text-column", "body"]
    assert prepare_module.main([*argv, "--split", "validation", "--out-root", str(tmp_path)]) == 2
    assert "cannot load split 'validation'" in capsys.readouterr().err


def test_a_local_hub_corpus_is_reused_from_an_out_root_it_cannot_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Loading the folder to hash it needs a writable cache: where the out-root is read-only
    (a shared corpora folder) that is the system's temporary folder, so the corpus is reused,
    not refused."""
    import datasets

    folder = tmp_path / "hub"
    folder.mkdir()
    rows = {"text": [document(w) for w in WORDS]}
    datasets.Dataset.from_dict(rows).to_parquet(str(folder / "train-00000.parquet"))
    root = tmp_path / "shared"
    out = prepare("hubby", hub=str(folder), vocab_size=VOCAB, out_root=root)
    before = {p: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()

    real = tempfile.TemporaryDirectory
    made = []

    def read_only(*args: Any, **kwargs: Any) -> Any:
        if Path(kwargs.get("dir") or tempfile.gettempdir()).resolve() == root.resolve():
            raise PermissionError(13, "Permission denied", str(root))
        made.append(real(*args, **kwargs))
        return made[-1]

    load = corpus_module._load_dataset

    def cache_outside_root(datasets: Any, dataset: str, *args: Any) -> Any:
        if Path(args[-1]).resolve().is_relative_to(root.resolve()):  # its cache_dir
            raise PermissionError(13, "Permission denied", args[-1])
        return load(datasets, dataset, *args)

    monkeypatch.setattr(prepare_module.tempfile, "TemporaryDirectory", read_only)
    monkeypatch.setattr(corpus_module, "_load_dataset", cache_outside_root)
    assert prepare("hubby", hub=str(folder), vocab_size=VOCAB, out_root=root) == out
    assert "reusing" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in out.iterdir()} == before
    assert made and not Path(made[0].name).exists(), "the temporary copy is removed"


def test_hub_reads_a_folder_of_text_files_one_document_per_file(tmp_path: Path) -> None:
    """`datasets`' text builder would make each line a document: newlines lost, and one
    file's lines split between train and val. --hub reads a file whole, as --files does."""
    folder = tmp_path / "texts"
    folder.mkdir()
    for word in WORDS:
        (folder / f"{word}.txt").write_text(document(word), encoding="utf-8")

    out = prepare("texts", hub=str(folder), vocab_size=VOCAB, out_root=tmp_path / "out")
    assert read_meta(out)["source"]["rows"] == len(WORDS)
    documents = decode_split(out, "train") + decode_split(out, "val")
    assert sorted(documents) == sorted(document(w) for w in WORDS)

    (folder / "latin1.txt").write_bytes(b"caf\xe9 au lait\n")  # named as --files names it
    said = f"{folder / 'latin1.txt'} is not UTF-8 (first bad byte at offset 3); fix the file, or "
    with pytest.raises(PrepareError, match=re.escape(said)):
        prepare("texts", hub=str(folder), vocab_size=VOCAB, out_root=tmp_path / "out")
    assert sorted(decode_split(out, "train") + decode_split(out, "val")) == sorted(documents)


def test_hub_says_which_files_of_a_folder_datasets_does_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`datasets` takes splits from file names (train_*) and one format per folder, and
    leaves the other files out: named with why, on stdout and in meta.json, never dropped
    unseen. Its dataset card and what it skips itself (.hidden, __pycache__) are not named."""
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "__pycache__").mkdir()
    for name in ("train_a.txt", "train_b.txt", "test_c.txt", "loose.txt", "sub/deep.txt"):
        (folder / name).write_text(document(name), encoding="utf-8")
    (folder / "Readme.md").write_text("a dataset card\n", encoding="utf-8")
    for name in (".hidden.txt", "__pycache__/x.txt"):
        (folder / name).write_text(document("skipped"), encoding="utf-8")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "train_linked.txt").write_text(document("linked"), encoding="utf-8")
    (folder / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)

    out = prepare("split", hub=str(folder), vocab_size=VOCAB, out_root=tmp_path / "out")
    assert read_meta(out)["source"]["rows"] == 2  # train_a, train_b
    unread = [
        "linked/ (a linked folder)",
        "loose.txt (in no split)",
        "sub/deep.txt (in no split)",
        "test_c.txt (split test)",
    ]
    assert read_meta(out)["skipped"]["unread_files"] == unread
    said = capsys.readouterr().out
    assert f"does not read 4 of its files for split 'train': {', '.join(unread[:3])}, ...;" in said
    (folder / "linked").unlink()

    for i, name in enumerate(("loose.txt", "sub/deep.txt", "test_c.txt")):  # all read: no note
        (folder / name).rename(folder / f"train_{i}.txt")
    out = prepare("split", hub=str(folder), vocab_size=VOCAB, out_root=tmp_path / "out")
    assert read_meta(out)["source"]["rows"] == 5
    assert "unread_files" not in read_meta(out)["skipped"]
    assert "does not read" not in capsys.readouterr().out


def test_hub_given_a_file_or_a_missing_folder_says_so_without_the_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not "Couldn't find any data file" for a file that is there, nor half a minute of Hub
    retries for a mistyped folder."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("text\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(corpus_module, "_import_datasets", Mock(side_effect=AssertionError))
    for hub, said in [
        ("corpus/a.txt", r"--hub 'corpus/a.txt' is a file; --hub takes a folder"),
        ("./corpuz", r"--hub './corpuz': no such folder$"),
        ("corpus/sub/dir", r"--hub 'corpus/sub/dir': no such folder$"),
        ("corpus/typo", r"--hub 'corpus/typo': no such folder in corpus/ \(for a Hub dataset"),
    ]:
        with pytest.raises(PrepareError, match=said):
            prepare("x", hub=hub, out_root=tmp_path / "out")


def test_hub_reads_a_folder_save_to_disk_wrote(tmp_path: Path) -> None:
    """`load_dataset` refuses such a folder (and names `load_from_disk`); --hub takes it."""
    import datasets

    texts = [document(w) for w in WORDS]
    splits = datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"text": texts}),
        test=datasets.Dataset.from_dict({"text": texts[:2]}),
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    splits["train"].save_to_disk(str(tmp_path / "one"))
    for folder in ("dict", "one"):
        hub = str(tmp_path / folder)
        out = prepare(folder, hub=hub, vocab_size=VOCAB, out_root=tmp_path / "out")
        assert read_meta(out)["source"]["rows"] == len(WORDS)
        documents = decode_split(out, "train") + decode_split(out, "val")
        assert sorted(documents) == sorted(texts)
    with pytest.raises(PrepareError, match=r"cannot load split 'val'.*splits \['train', 'test'\]"):
        prepare("x", hub=str(tmp_path / "dict"), split="val", out_root=tmp_path / "out")
    with pytest.raises(PrepareError, match=r"one Dataset, not splits: leave --split out"):
        prepare("x", hub=str(tmp_path / "one"), split="test", out_root=tmp_path / "out")
    with pytest.raises(PrepareError, match=r"no configurations \(--hub-config\)"):
        prepare("x", hub=str(tmp_path / "dict"), hub_config="c", out_root=tmp_path / "out")


def test_stdlib_capped_is_deterministic(tmp_path: Path) -> None:
    """The same in another process, with another string-hash seed: nothing depends on it."""
    kwargs = {"stdlib": True, "max_bytes": 40_000, "vocab_size": 300}
    first = read_meta(prepare("std", out_root=tmp_path / "a", **kwargs))
    done = _run_cli(
        *("--name", "std", "--out-root", str(tmp_path / "b"), "--stdlib"),
        *("--max-bytes", "40000", "--vocab-size", "300"),
        env={"PYTHONHASHSEED": "12345"},
    )
    assert done.returncode == 0, done.stderr
    second = read_meta(tmp_path / "b" / "std")
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (tmp_path / "a" / "std" / name).read_bytes() == (
            tmp_path / "b" / "std" / name
        ).read_bytes(), name
    assert first["source"]["kind"] == "stdlib"
    assert first["source"]["file_list_sha256"] == second["source"]["file_list_sha256"]
    assert first["content_sha256"] == second["content_sha256"]
    assert first["tokenizer_sha256"] == second["tokenizer_sha256"]
    assert first["skipped"]["over_max_bytes"] > 0
    assert sum(split["bytes"] for split in first["splits"].values()) <= 40_000


def test_stdlib_skips_non_utf8_and_empty_files_and_codec_tables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = write_corpus(
        tmp_path / "lib",
        {
            "a.py": "x = 1\n",
            "b.py": b"s = '\xff'\n",
            "c.py": "",
            "d.py": "y = 2\n",
            "tables.py": '"""Not a codec."""\ndecoding_table = (1, 2)\n',
        },
    )
    table = '"""cp9, edited from cp8."""\nimport codecs\ndecoding_table = (\n    "\\x00"\n)\n'
    write_corpus(root / "encodings", {"cp9.py": table})
    paths = sorted(root.rglob("*.py"))
    monkeypatch.setattr(corpus_module, "_stdlib_files", lambda: (root, paths))
    out = prepare("std", stdlib=True, vocab_size=300, out_root=tmp_path)
    meta = read_meta(out)
    assert meta["skipped"]["non_utf8_files"] == ["b.py"]
    assert meta["skipped"]["empty_documents"] == 1
    assert meta["skipped"]["charmap_codec_tables"] == 1
    assert meta["source"]["files"] == 3
    documents = decode_split(out, "train") + decode_split(out, "val")
    assert not any("cp9" in d for d in documents) and any("Not a codec" in d for d in documents)


def test_stdlib_leaves_out_every_charmap_codec_table() -> None:
    """The real list: every table goes, whatever made it (cp720.py is genwincodec.py's), and
    the codecs written by hand (utf_8.py) stay."""
    root, _ = corpus_module._stdlib_files()
    corpus = corpus_module.stdlib_corpus(None)
    kept = {path.relative_to(root).as_posix() for path in corpus.paths}
    assert "encodings/utf_8.py" in kept and "encodings/aliases.py" in kept
    for name in ("encodings/cp437.py", "encodings/koi8_r.py", "encodings/cp720.py"):
        assert (root / name).is_file() and name not in kept, name
    tables = [
        p
        for p in kept
        if p.startswith("encodings/") and "decoding_table = (" in (root / p).read_text()
    ]
    assert not tables and corpus.skipped["charmap_codec_tables"] >= 65


def test_non_utf8_file_fails_by_default_and_replace_counts(tmp_path: Path) -> None:
    folder = write_corpus(
        tmp_path / "corpus", {"good.txt": "fine text\n", "bad.txt": b"abcde\xff\xfez \xe2\x82!\n"}
    )
    with pytest.raises(PrepareError, match=r"bad\.txt is not UTF-8 \(first bad byte at offset 5\)"):
        prepare("enc", files=[str(folder / "*.txt")], out_root=tmp_path)
    assert not (tmp_path / "enc").exists(), "nothing is written for bad input"

    out = prepare(
        "enc",
        files=[str(folder / "*.txt")],
        encoding_errors="replace",
        vocab_size=300,
        out_root=tmp_path,
    )
    # Four undecodable bytes; Python's "replace" gives one U+FFFD per invalid sequence.
    assert read_meta(out)["replaced_invalid_utf8_bytes"] == 4
    documents = decode_split(out, "train") + decode_split(out, "val")
    assert "abcde\ufffd\ufffdz \ufffd!\n" in documents

    # A bad file --max-bytes leaves out is neither an error nor counted as replaced.
    capped = write_corpus(tmp_path / "capped", {"a.txt": "first doc\n", "b.txt": "second doc\n"})
    (capped / "c.txt").write_bytes(b"abcde\xff\xff\n")
    for errors in ("strict", "replace"):
        out = prepare(
            f"capped-{errors}",
            files=[str(capped / "*.txt")],
            encoding_errors=errors,
            max_bytes=25,
            vocab_size=300,
            out_root=tmp_path,
        )
        meta = read_meta(out)
        assert meta["skipped"]["over_max_bytes"] == 1
        assert meta["replaced_invalid_utf8_bytes"] == 0


def test_a_compressed_file_is_its_bytes_not_what_it_unpacks_to(tmp_path: Path) -> None:
    """The documents are the bytes that were checked, counted and hashed: `datasets`' text
    builder would unpack a gzip file (by name or by content) and tokenize other text."""
    packed = gzip.compress(b"hidden text inside gzip\n", mtime=0)
    folder = write_corpus(
        tmp_path / "corpus",
        {"a.txt": document("fjord"), "b.txt.gz": packed, "c.txt": packed},
    )
    out = prepare(
        "packed",
        files=[str(folder / "*")],
        encoding_errors="replace",
        vocab_size=300,
        out_root=tmp_path,
    )
    documents = decode_split(out, "train") + decode_split(out, "val")
    assert not any("hidden text" in d for d in documents)
    assert documents.count(packed.decode("utf-8", errors="replace")) == 2
    assert read_meta(out)["replaced_invalid_utf8_bytes"] > 0


def test_files_expands_a_tilde_no_shell_expanded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--files=~/texts/*.txt reaches prepare as typed; the rebuild command holds the path."""
    monkeypatch.setenv("HOME", str(tmp_path))
    write_corpus(tmp_path / "texts", {f"{w}.txt": document(w) for w in WORDS})
    out = prepare("home", files=["~/texts/*.txt"], vocab_size=VOCAB, out_root=tmp_path)
    assert read_meta(out)["source"]["patterns"] == [str(tmp_path / "texts" / "*.txt")]


def test_identical_documents_share_a_split_and_are_counted(tmp_path: Path) -> None:
    texts = {f"{i:02}.txt": f"document {i}\nsecond line\n" for i in range(12)}
    # Each copy has Windows line endings: the same document once read with universal newlines.
    copies = {f"copy-{name}": text.replace("\n", "\r\n") for name, text in texts.items()}
    folder = write_corpus(tmp_path / "corpus", texts | copies)
    out = prepare(
        "dups", files=[str(folder / "*.txt")], val_fraction=0.5, vocab_size=300, out_root=tmp_path
    )
    train, val = decode_split(out, "train"), decode_split(out, "val")
    assert sorted(train + val) == sorted([*texts.values()] * 2)
    assert not set(train) & set(val), "val holds no copy of a train document"
    assert read_meta(out)["duplicate_documents"] == 12


def test_adding_a_document_moves_no_other(tmp_path: Path) -> None:
    folder = write_corpus(
        tmp_path / "corpus", {f"{i:02}.txt": f"document {i}\n" for i in range(20)}
    )
    kwargs = {"files": [str(folder / "*.txt")], "val_fraction": 0.3, "vocab_size": 300}
    before = set(decode_split(prepare("grow", out_root=tmp_path, **kwargs), "val"))
    write_corpus(folder, {"00-new.txt": "a new document\n"})  # first in input order
    after = set(decode_split(prepare("grow", out_root=tmp_path, **kwargs), "val"))
    assert after - {"a new document\n"} == before


@pytest.mark.parametrize("val_fraction", [0.001, 0.999])
@pytest.mark.parametrize(
    "texts", [["a", "b"], ["a", "b", "c"], ["a", "a", "b"], ["b", "a", "c", "a", "b"]]
)
def test_split_keeps_a_document_on_each_side(texts: list[str], val_fraction: float) -> None:
    split = split_documents(texts, val_fraction, seed=0)
    assert split.train and split.val
    assert sorted(split.train + split.val) == list(range(len(texts)))
    assert split.train == sorted(split.train) and split.val == sorted(split.val), "input order"
    train, val = {texts[i] for i in split.train}, {texts[i] for i in split.val}
    assert not train & val, "identical documents move together"
    assert len(val if val_fraction < 0.5 else train) == 1, "one text moves, with its copies"
    # As data/prepare.py's docstring says: val gets the smallest hash, or train keeps the largest.
    keys = {text: _content_key(text, 0) for text in texts}
    lone = min(keys, key=keys.get) if val_fraction < 0.5 else max(keys, key=keys.get)
    assert (val if val_fraction < 0.5 else train) == {lone}
    assert split.duplicates == len(texts) - len(set(texts))


@pytest.mark.parametrize("val_fraction", [0.1, 0.3])
def test_val_gets_about_val_fraction_of_the_documents(val_fraction: float) -> None:
    """Of 4000 distinct documents, about val_fraction go to val (within 0.03, over 4 sigma;
    the same every run, as the keys hash fixed texts)."""
    split = split_documents([f"document {i}\n" for i in range(4000)], val_fraction, seed=0)
    assert len(split.val) / 4000 == pytest.approx(val_fraction, abs=0.03)


def test_all_identical_documents_are_an_error(tmp_path: Path) -> None:
    folder = write_corpus(tmp_path / "corpus", {f"{i}.txt": "same text\n" for i in range(3)})
    with pytest.raises(PrepareError, match=r"all 3 documents are identical"):
        prepare("same", files=[str(folder / "*.txt")], vocab_size=300, out_root=tmp_path)
    assert not (tmp_path / "same").exists(), "nothing is written for bad input"


def test_split_follows_the_seed_not_the_input_order() -> None:
    texts = [f"document {i}\n" for i in range(40)]

    def val_texts(texts: list[str], seed: int) -> set[str]:
        return {texts[i] for i in split_documents(texts, 0.5, seed).val}

    assert val_texts(texts, seed=0) == val_texts(texts[::-1], seed=0)
    assert val_texts(texts, seed=0) != val_texts(texts, seed=1)


def _run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(ROOT / "data" / "prepare.py"), *args]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=None if env is None else os.environ | env,
    )


def test_cli_prepares_and_reports_errors_without_traceback(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process: test_a_stdout_that_fails_costs_its_lines_not_the_corpus runs the
    script itself, as a shell does (each process imports torch again, ~2 s)."""
    common = ["--name", "cli", "--out-root", str(tmp_path), "--vocab-size", str(VOCAB)]
    capsys.readouterr()
    assert prepare_module.main([*common, "--files", str(corpus / "*.txt")]) == 0
    out = capsys.readouterr().out
    assert read_meta(tmp_path / "cli")["splits"]["val"]["documents"] >= 1
    # Six words' documents merge into fewer tokens than asked: the summary says so
    got = read_meta(tmp_path / "cli")["vocab_size"]
    assert got < VOCAB
    assert f"vocab {got} (of {VOCAB} asked: the corpus had no more pairs to merge), " in out
    assert read_meta(tmp_path / "cli")["settings"]["seed"] == 0
    # --seed reaches the split: the same files, another split, recorded
    assert (
        prepare_module.main(
            [*common[2:], "--name", "seeded", "--seed", "7", "--files", str(corpus / "*.txt")]
        )
        == 0
    )
    capsys.readouterr()
    assert read_meta(tmp_path / "seeded")["settings"]["seed"] == 7
    assert decode_split(tmp_path / "seeded", "val") != decode_split(tmp_path / "cli", "val")

    assert prepare_module.main([*common, "--files", str(corpus / "*.nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: glob ") and "*.nothing" in err
    assert "Traceback" not in err


def test_the_prepare_hint_asks_for_the_models_vocab_where_a_tokenizer_can_have_it() -> None:
    from data.meta import MAX_VOCAB_SIZE, MIN_VOCAB_SIZE, prepare_command

    assert f"--vocab-size {MIN_VOCAB_SIZE}" in prepare_command(Path("data/x"), MIN_VOCAB_SIZE)
    assert "--vocab-size" not in prepare_command(Path("data/x"), MIN_VOCAB_SIZE - 1)
    # A model's vocabulary past what a uint16 id holds: the largest tokenizer, which it can use
    assert prepare_command(Path("data/x"), 70000).endswith(f"--vocab-size {MAX_VOCAB_SIZE}")
    assert prepare_command(Path("data/x")) == "python data/prepare.py --name x --stdlib"


@pytest.mark.skipif(
    not Path("/dev/full").exists() or not Path("/proc/locks").exists(),
    reason="needs Linux's /dev/full and /proc/locks",
)
def test_a_stdout_that_fails_costs_its_lines_not_the_corpus(corpus: Path, tmp_path: Path) -> None:
    """`> file` on a full disk: one error line and status 2; a reader that has gone (`| head`):
    the shell's SIGPIPE status, quietly; a stderr gone or full costs the progress bars, and
    the line that says it waits for another prepare. Every way the corpus is made, whole."""

    def command(name: str) -> list[str]:
        # Each in an out-root of its own: the five run at once (each imports torch and trains
        # a tokenizer, ~1.5 s on a slow machine), and an out-root takes one prepare at a time.
        argv = [sys.executable, str(ROOT / "data" / "prepare.py"), "--files", str(corpus / "*.txt")]
        return [
            *argv,
            "--out-root",
            str(tmp_path / name),
            "--name",
            name,
            "--vocab-size",
            str(VOCAB),
        ]

    with open("/dev/full", "w") as full:
        # `> file` on a full disk
        done = subprocess.Popen(command("full"), stdout=full, stderr=subprocess.PIPE)
        # stderr, where the progress bars go: `2>/dev/full`
        bars = subprocess.Popen(command("bars"), stdout=subprocess.PIPE, stderr=full)
    gone = subprocess.Popen(command("gone"), stdout=subprocess.PIPE)
    # stderr too: `2>&1 | head`
    both = subprocess.Popen(command("both"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    # ... where another prepare holds the out-root: "waiting for another prepare" cannot be said
    (tmp_path / "waits").mkdir()
    holder = os.open(tmp_path / "waits", os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    waits = subprocess.Popen(command("waits"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for proc in (gone, both, waits):
            assert proc.stdout is not None
            proc.stdout.close()  # before its first line
        deadline = time.monotonic() + 120  # it says it waits, then waits for the lock
        blocked = re.compile(rf"-> FLOCK +ADVISORY +WRITE +{waits.pid} ")
        while not blocked.search(Path("/proc/locks").read_text()):
            assert waits.poll() is None, f"it ended ({waits.returncode}) instead of waiting"
            assert time.monotonic() < deadline, "it did not wait for the lock"
            time.sleep(0.05)
        os.close(holder)
        holder = -1  # closed: the finally below must not close a number reused since
        err = done.communicate(timeout=120)[1].decode()
        assert done.returncode == 2 and "Traceback" not in err, err
        assert err.count("error: cannot write to stdout (No space left on device)") == 1, err
        assert gone.wait(timeout=120) == 128 + signal.SIGPIPE
        assert both.wait(timeout=120) == 128 + signal.SIGPIPE
        assert waits.wait(timeout=120) == 128 + signal.SIGPIPE
        out = bars.communicate(timeout=120)[0]
        assert bars.returncode == 0 and b"prepared " in out
    finally:  # a failure or time-out leaves none running into later tests
        if holder >= 0:
            os.close(holder)
        for proc in (done, bars, gone, both, waits):
            proc.kill()
            proc.wait()
    for name in ("full", "gone", "both", "waits", "bars"):
        folder = tmp_path / name / name
        assert read_meta(folder)["splits"]["val"]["documents"] >= 1
        assert is_complete(folder, read_meta(folder)["content_sha256"])


def test_max_bytes_equal_to_the_corpus_size_keeps_every_file(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "x.txt").write_text("hello")
    (tmp_path / "b" / "y.txt").write_text("world")
    corpus = corpus_module.files_corpus([str(tmp_path / "*" / "*.txt")], "strict", max_bytes=10)
    assert corpus.names == ["a/x.txt", "b/y.txt"]
    assert corpus.skipped["over_max_bytes"] == 0
    one = corpus_module.files_corpus([str(tmp_path / "a" / "x.txt")], "strict", max_bytes=5)
    assert one.names == ["x.txt"]


def test_hub_digest_tells_document_boundaries_apart(tmp_path: Path, monkeypatch) -> None:
    import datasets

    def digest(texts: list[str]) -> str:
        rows = datasets.Dataset.from_dict({"text": texts})
        monkeypatch.setattr(corpus_module, "_load_hub", lambda *a: (rows, []))
        return corpus_module.hub_corpus("x", None, "train", "text", None, tmp_path).digest

    assert digest(["ab", "c"]) != digest(["a", "bc"])


def test_load_text_files_turns_a_lone_cr_into_a_newline(tmp_path: Path) -> None:
    (tmp_path / "mac.txt").write_bytes(b"one\rtwo\r\nthree\n")
    corpus = corpus_module.files_corpus([str(tmp_path / "mac.txt")], "strict", None)
    documents = corpus_module.load_text_files(corpus, tmp_path / "cache")
    assert documents[0]["text"] == "one\ntwo\nthree\n"
