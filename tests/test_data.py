"""data/prepare.py on tiny corpora written into tmp_path: outputs, reuse, sources, bad input."""

import errno
import fcntl
import gzip
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple
from unittest.mock import Mock

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from data import corpus as corpus_module
from data import prepare as prepare_module
from data import store as store_module
from data.loader import TokenBatches
from data.meta import DataError
from data.prepare import EOT, EOT_ID, PrepareError, _content_key, prepare, split_documents
from data.store import is_complete

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 400  # small: fast to train, still room to merge every test word
META_KEYS = {"name", "source", "vocab_size", "eot_id", "content_sha256", "tokenizer_sha256"}
# Each document repeats its own word, so a merged token for the word shows which split trained on it.
WORDS = ["quokka", "zephyr", "bramble", "fjord", "walrus", "cobalt"]


def _document(word: str) -> str:
    return f"The {word} sat.\n" + f"{word} " * 40 + "\nCafé ☕ ünïcode, tabs\tand 'quotes'.\n"


def _write(folder: Path, documents: dict[str, str | bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in documents.items():
        data = content if isinstance(content, bytes) else content.encode("utf-8")
        (folder / name).write_bytes(data)
    return folder


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return _write(tmp_path / "corpus", {f"{word}.txt": _document(word) for word in WORDS})


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


class Prepared(NamedTuple):
    files: list[str]  # the globs it was prepared from
    out: Path
    before: dict[str, bytes]  # its files, by name


@pytest.fixture
def prepared(corpus: Path, tmp_path: Path) -> Prepared:
    """A corpus prepared in tmp_path/tiny, for tests of what a later prepare does to it."""
    files = [str(corpus / "*.txt")]
    out = prepare("tiny", files=files, vocab_size=VOCAB, out_root=tmp_path)
    return Prepared(files, out, _contents(out))


def _decode_split(out_dir: Path, split: str) -> list[str]:
    """The split's documents, read back the way train.py reads tokens."""
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    ids = np.memmap(out_dir / f"{split}.bin", dtype=np.uint16, mode="r")
    assert ids[-1] == EOT_ID, "every document, the last included, ends with EOT"
    ends = np.flatnonzero(ids == EOT_ID)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokenizer.decode(ids[s:e].tolist()) for s, e in zip(starts, ends, strict=True)]


def _meta(out_dir: Path) -> dict:
    return json.loads((out_dir / "meta.json").read_text())


def _mtimes(out_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(out_dir.iterdir()) if p.is_file()}


def test_files_glob_writes_uint16_tokens_split_by_document(corpus: Path, tmp_path: Path) -> None:
    out = prepare("tiny", files=[str(corpus / "*.txt")], vocab_size=VOCAB, out_root=tmp_path)
    assert out == tmp_path / "tiny"
    meta = _meta(out)
    assert meta.keys() >= META_KEYS
    assert meta["name"] == "tiny" and meta["source"]["kind"] == "files"
    assert meta["eot_id"] == EOT_ID
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.token_to_id(EOT) == EOT_ID
    assert meta["vocab_size"] == tokenizer.get_vocab_size() <= VOCAB
    digest = hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    assert meta["tokenizer_sha256"] == digest

    texts = {word: _document(word) for word in WORDS}
    decoded = {split: _decode_split(out, split) for split in ("train", "val")}
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


def test_a_vocabulary_the_text_cannot_fill_is_said(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """BPE stops where no pair is left to merge: a small corpus gets fewer tokens than asked."""
    out = prepare("small", files=[str(corpus / "*.txt")], vocab_size=60_000, out_root=tmp_path)
    tokens = _meta(out)["vocab_size"]
    assert tokens < 60_000
    assert f"note: the tokenizer has {tokens} tokens, fewer than --vocab-size 60000" in (
        capsys.readouterr().out
    )


def test_a_corpus_records_where_its_documents_are_from_anywhere(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relative --files patterns are recorded absolute: the rebuild command a damaged corpus's
    error gives is run from the project root, not from where prepare ran."""
    monkeypatch.chdir(corpus)
    out = prepare("tiny", files=["*.txt"], vocab_size=VOCAB, out_root=tmp_path)
    assert _meta(out)["source"]["patterns"] == [str(corpus / "*.txt")]
    monkeypatch.chdir(tmp_path)
    (out / "val.bin").write_bytes(b"")
    with pytest.raises(DataError, match=re.escape(f"--files '{corpus / '*.txt'}' ")):
        TokenBatches(out / "val.bin", 8, 2, 0, torch.device("cpu"))


def test_a_second_prepare_waits_for_the_first(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two prepares into one out-root (two `make train`s at once) run one after the other: the
    second waits for the first to finish, instead of replacing files a run may be reading."""
    holder = os.open(tmp_path, os.O_RDONLY)  # the first prepare, as the lock sees it
    fcntl.flock(holder, fcntl.LOCK_EX)
    files = [str(corpus / "*.txt")]
    kwargs = {"files": files, "vocab_size": VOCAB, "out_root": tmp_path}
    second = threading.Thread(target=prepare, args=("tiny",), kwargs=kwargs)
    second.start()
    said, deadline = "", time.monotonic() + 60  # it reads the inputs first: slow when loaded
    while "waiting for another prepare" not in said and time.monotonic() < deadline:
        time.sleep(0.05)
        said += capsys.readouterr().err
    assert "waiting for another prepare" in said
    assert second.is_alive() and not (tmp_path / "tiny").exists(), "it did not wait"
    os.close(holder)
    second.join(timeout=60)
    assert not second.is_alive() and (tmp_path / "tiny" / "meta.json").is_file()


def test_rerun_reuses_and_changes_rebuild(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = [str(corpus / "*.txt")]
    out = prepare("tiny", files=files, vocab_size=VOCAB, out_root=tmp_path)
    first, before = _meta(out), _mtimes(out)
    capsys.readouterr()

    prepare("tiny", files=files, vocab_size=VOCAB, out_root=tmp_path)
    assert "reusing" in capsys.readouterr().out
    assert _mtimes(out) == before

    # A damaged tokenizer.json (its hash is in meta.json): made again, not reused
    tokenizer = (out / "tokenizer.json").read_bytes()
    (out / "tokenizer.json").write_text('{"trunc')
    prepare("tiny", files=files, vocab_size=VOCAB, out_root=tmp_path)
    assert "reusing" not in capsys.readouterr().out
    assert (out / "tokenizer.json").read_bytes() == tokenizer  # the same, made again
    before = _mtimes(out)

    # The same documents from a copied folder: reused, and meta.json says where they are now.
    copied = Path(shutil.copytree(corpus, tmp_path / "copied"))
    prepare("tiny", files=[str(copied / "*.txt")], vocab_size=VOCAB, out_root=tmp_path)
    assert "reusing" in capsys.readouterr().out
    assert _meta(out)["source"]["patterns"] == [str(copied / "*.txt")]
    assert {k: v for k, v in _meta(out).items() if k != "source"} == {
        k: v for k, v in first.items() if k != "source"
    }
    meta = _meta(out)  # one with no source at all (written by hand, say) gets it
    del meta["source"]
    (out / "meta.json").write_text(json.dumps(meta))
    prepare("tiny", files=files, vocab_size=VOCAB, out_root=tmp_path)
    assert _meta(out)["source"]["patterns"] == files
    capsys.readouterr()

    (corpus / "fjord.txt").write_text(_document("fjord") + "one more line\n")
    prepare("tiny", files=files, vocab_size=VOCAB, out_root=tmp_path)
    said = capsys.readouterr()
    assert "reusing" not in said.out
    assert f"replacing the corpus in {out} (its source text changed)" in said.err
    assert _meta(out)["content_sha256"] != first["content_sha256"]

    changed = _meta(out)["content_sha256"]
    prepare("tiny", files=files, vocab_size=VOCAB + 1, out_root=tmp_path)
    assert _meta(out)["content_sha256"] != changed
    said = capsys.readouterr().err
    assert f"(vocab_size {VOCAB} -> {VOCAB + 1})" in said and "cannot resume" in said
    # A setting and the text at once: both said
    (corpus / "fjord.txt").write_text(_document("fjord"))
    prepare("tiny", files=files, vocab_size=VOCAB, out_root=tmp_path)
    said = capsys.readouterr().err
    assert f"(vocab_size {VOCAB + 1} -> {VOCAB}, and its source text changed)" in said
    # --max-bytes chooses the text the digest covers: it is said, not a change of the files
    kept = sum(p.stat().st_size for p in corpus.glob("*.txt")) * 2 // 3  # not every file
    prepare("tiny", files=files, vocab_size=VOCAB, out_root=tmp_path, max_bytes=kept)
    said = capsys.readouterr().err
    assert f"(max_bytes None -> {kept})" in said and "source text" not in said

    # A corpus made by another tokenizers version (its hash covers the version) says that.
    meta = _meta(out)
    meta["settings"]["tokenizers_version"] = "0.0.1"
    digest = corpus_module.files_corpus(files, "strict", kept).digest
    meta["content_sha256"] = store_module.content_hash(meta["settings"], digest)
    (out / "meta.json").write_text(json.dumps(meta))
    prepare("tiny", files=files, vocab_size=VOCAB, out_root=tmp_path, max_bytes=kept)
    said = capsys.readouterr().err
    assert "(tokenizers_version '0.0.1' -> " in said and "source text" not in said
    assert "max_bytes" not in said


def test_files_the_budget_leaves_out_do_not_change_the_corpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Names are hashed relative to the kept files' common folder: a folder of files that
    --max-bytes leaves out, added or dropped, is not a change of the documents kept."""
    kept = _write(tmp_path / "texts" / "kept", {f"{w}.txt": _document(w) for w in WORDS})
    extra = _write(tmp_path / "texts" / "extra", {"late.txt": _document("late")})
    budget = sum(p.stat().st_size for p in kept.iterdir())
    prepare(
        "capped", files=[str(kept / "*.txt")], vocab_size=VOCAB, out_root=tmp_path, max_bytes=budget
    )
    capsys.readouterr()
    both = [str(kept / "*.txt"), str(extra / "*.txt")]
    prepare("capped", files=both, vocab_size=VOCAB, out_root=tmp_path, max_bytes=budget)
    said = capsys.readouterr()
    assert "reusing" in said.out and "replacing" not in said.err
    # With the budget raised the extra file is kept: another corpus
    out = prepare("capped", files=both, vocab_size=VOCAB, out_root=tmp_path, max_bytes=2 * budget)
    assert f"(max_bytes {budget} -> {2 * budget})" in capsys.readouterr().err
    assert sum(split["documents"] for split in _meta(out)["splits"].values()) == len(WORDS) + 1


def test_truncated_output_is_rebuilt(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = prepare("tiny", files=[str(corpus / "*.txt")], vocab_size=VOCAB, out_root=tmp_path)
    tokens = (out / "train.bin").read_bytes()
    (out / "train.bin").write_bytes(tokens[:-2])
    capsys.readouterr()
    prepare("tiny", files=[str(corpus / "*.txt")], vocab_size=VOCAB, out_root=tmp_path)
    assert "replacing" not in capsys.readouterr().err  # the same corpus, made whole again
    assert (out / "train.bin").read_bytes() == tokens


def test_interrupted_rebuild_keeps_previous_outputs(
    prepared: Prepared, corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files, out, before = prepared
    real_write_tokens = prepare_module._write_tokens

    def interrupted(tokenizer: Tokenizer, documents: object, path: Path, split: str) -> dict:
        if split == "val":
            raise KeyboardInterrupt
        return real_write_tokens(tokenizer, documents, path, split)

    monkeypatch.setattr(prepare_module, "_write_tokens", interrupted)
    (corpus / "fjord.txt").write_text("changed\n")
    with pytest.raises(KeyboardInterrupt):
        prepare("tiny", files=files, vocab_size=VOCAB, out_root=tmp_path)
    assert _contents(out) == before, "no temp files left"


def test_sigterm_removes_the_scratch_folder_and_exits_143(
    prepared: Prepared,
    corpus: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`timeout` and job schedulers stop with SIGTERM: cleaned up as after Ctrl-C, the corpus
    there before kept, and the shell told it was stopped (128 + 15)."""
    files, out, before = prepared

    def terminated(*args: object) -> None:
        assert list(tmp_path.glob(".prepare-*")), "the scratch folder is there while it tokenizes"
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(prepare_module, "_train_tokenizer", terminated)
    (corpus / "fjord.txt").write_text("changed\n")
    handler = signal.getsignal(signal.SIGTERM)
    argv = ["--name", "tiny", "--files", *files, "--vocab-size", str(VOCAB)]
    assert prepare_module.main([*argv, "--out-root", str(tmp_path)]) == 143
    assert "stopped by SIGTERM; the corpus there before is as it was" in capsys.readouterr().err
    assert not list(tmp_path.glob(".prepare-*"))
    assert _contents(out) == before
    assert signal.getsignal(signal.SIGTERM) == handler
    # With no corpus there before, what it left is redone
    argv[1] = "other"
    assert prepare_module.main([*argv, "--out-root", str(tmp_path)]) == 143
    said = (
        "stopped by SIGTERM; no meta.json describes unfinished files, so the next run redoes them"
    )
    assert said in capsys.readouterr().err


def test_ctrl_c_after_the_new_meta_json_says_the_new_corpus_is_whole(
    prepared: Prepared,
    corpus: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Stopped while cleaning up, after the new meta.json was written: the corpus there is the
    new one, whole, not the one before."""
    files, out, before = prepared
    real_write_outputs = prepare_module._write_outputs

    def written_then_interrupted(*args: Any, **kwargs: Any) -> dict:
        real_write_outputs(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "_write_outputs", written_then_interrupted)
    (corpus / "fjord.txt").write_text("changed\n")
    argv = ["--name", "tiny", "--files", *files, "--vocab-size", str(VOCAB)]
    assert prepare_module.main([*argv, "--out-root", str(tmp_path)]) == 130
    said = "interrupted; the new corpus was written whole (its meta.json is there)"
    assert said in capsys.readouterr().err
    assert _contents(out) != before


def test_a_killed_runs_temporary_files_go_with_the_next_build(corpus: Path, tmp_path: Path) -> None:
    """SIGKILL leaves no chance to clean up: the next build removes what a dead process left,
    never what a live one is writing."""
    out = prepare("tiny", files=[str(corpus / "*.txt")], vocab_size=VOCAB, out_root=tmp_path)
    # No pid reaches 999999999 (Linux stops at 2**22); the parent process is alive.
    gone, live = out / ".train.bin.999999999.tmp", out / f".val.bin.{os.getppid()}.tmp"
    gone.write_bytes(b"half a corpus")
    live.write_bytes(b"another run's")
    # The scratch folders (a corpus's Arrow copy) by the out-root, too
    gone_scratch = tmp_path / ".prepare-999999999-abc"
    live_scratch = tmp_path / f".prepare-{os.getppid()}-abc"
    # A pid that looks dead here, of a prepare in another container sharing the folder: its
    # lock says it is in use
    elsewhere = store_module.ScratchFolder(tmp_path)
    foreign = tmp_path / ".prepare-999999998-abc"
    os.rename(elsewhere.name, foreign)
    for folder in (gone_scratch, live_scratch):
        (folder / "cache").mkdir(parents=True)
    (corpus / "fjord.txt").write_text("changed, so it rebuilds\n")
    prepare("tiny", files=[str(corpus / "*.txt")], vocab_size=VOCAB, out_root=tmp_path)
    assert not gone.exists() and live.exists()
    assert not gone_scratch.exists() and live_scratch.exists() and foreign.exists()
    os.rename(foreign, elsewhere.name)
    elsewhere.__exit__(None, None, None)
    # A prepare that reuses the corpus removes them too, and a killed meta.json write's file
    for name in ("train.bin", "meta.json"):
        (out / f".{name}.999999999.tmp").write_bytes(b"half a file")
    prepare("tiny", files=[str(corpus / "*.txt")], vocab_size=VOCAB, out_root=tmp_path)
    assert not list(out.glob(".*.999999999.tmp")) and live.exists()
    with pytest.raises(PrepareError, match=r"give a list of paths or globs, e\.g\. \["):
        prepare("tiny", files=str(corpus / "*.txt"), vocab_size=VOCAB, out_root=tmp_path)


def test_file_names_with_glob_characters_are_literal(tmp_path: Path) -> None:
    folder = _write(tmp_path / "corpus", {"a[1].txt": "first doc\n", "b*.txt": "second doc\n"})
    out = prepare(
        "odd",
        files=[str(folder / "a[1].txt"), str(folder / "b*.txt")],
        out_root=tmp_path,
        vocab_size=300,
    )
    documents = _decode_split(out, "train") + _decode_split(out, "val")
    assert sorted(documents) == ["first doc\n", "second doc\n"]


def test_hub_reads_local_parquet_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import datasets

    rows = {"body": [_document(w) for w in WORDS] + ["", None], "id": list(range(len(WORDS) + 2))}
    folder = tmp_path / "hub"
    folder.mkdir()
    datasets.Dataset.from_dict(rows).to_parquet(str(folder / "train-00000.parquet"))

    out = prepare("hubby", hub=str(folder), text_column="body", vocab_size=VOCAB, out_root=tmp_path)
    meta = _meta(out)
    assert meta["source"] | {"kind": "hub", "text_column": "body", "rows": 8} == meta["source"]
    assert meta["skipped"]["empty_documents"] == 2
    documents = _decode_split(out, "train") + _decode_split(out, "val")
    assert sorted(documents) == sorted(_document(w) for w in WORDS)
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
    assert _meta(out)["source"]["dataset"] == str(moved)
    folder = moved

    with pytest.raises(PrepareError, match=r"--text-column 'nope'.*columns: \['body', 'id'\]"):
        prepare("hubby", hub=str(folder), text_column="nope", out_root=tmp_path)
    with pytest.raises(PrepareError, match=r"--text-column 'id'.*not strings"):
        prepare("hubby", hub=str(folder), text_column="id", out_root=tmp_path)
    with pytest.raises(PrepareError, match=r"--hub .*cannot load split 'validation'"):
        prepare("hubby", hub=str(folder), split="validation", text_column="body", out_root=tmp_path)


def test_a_local_hub_corpus_is_reused_from_an_out_root_it_cannot_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Loading the folder to hash it needs a writable cache: where the out-root is read-only
    (a shared corpora folder) that is the system's temporary folder, so the corpus is reused,
    not refused."""
    import datasets

    folder = tmp_path / "hub"
    folder.mkdir()
    rows = {"text": [_document(w) for w in WORDS]}
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
        (folder / f"{word}.txt").write_text(_document(word), encoding="utf-8")

    out = prepare("texts", hub=str(folder), vocab_size=VOCAB, out_root=tmp_path / "out")
    assert _meta(out)["source"]["rows"] == len(WORDS)
    documents = _decode_split(out, "train") + _decode_split(out, "val")
    assert sorted(documents) == sorted(_document(w) for w in WORDS)

    (folder / "latin1.txt").write_bytes(b"caf\xe9 au lait\n")  # named as --files names it
    said = f"{folder / 'latin1.txt'} is not UTF-8 (first bad byte at offset 3); fix the file, or "
    with pytest.raises(PrepareError, match=re.escape(said)):
        prepare("texts", hub=str(folder), vocab_size=VOCAB, out_root=tmp_path / "out")
    assert sorted(_decode_split(out, "train") + _decode_split(out, "val")) == sorted(documents)


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

    texts = [_document(w) for w in WORDS]
    splits = datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"text": texts}),
        test=datasets.Dataset.from_dict({"text": texts[:2]}),
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    splits["train"].save_to_disk(str(tmp_path / "one"))
    for folder in ("dict", "one"):
        hub = str(tmp_path / folder)
        out = prepare(folder, hub=hub, vocab_size=VOCAB, out_root=tmp_path / "out")
        assert _meta(out)["source"]["rows"] == len(WORDS)
        documents = _decode_split(out, "train") + _decode_split(out, "val")
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
    first = _meta(prepare("std", out_root=tmp_path / "a", **kwargs))
    done = _run_cli(
        *("--name", "std", "--out-root", str(tmp_path / "b"), "--stdlib"),
        *("--max-bytes", "40000", "--vocab-size", "300"),
        env={"PYTHONHASHSEED": "12345"},
    )
    assert done.returncode == 0, done.stderr
    second = _meta(tmp_path / "b" / "std")
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
    root = _write(
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
    _write(root / "encodings", {"cp9.py": table})
    paths = sorted(root.rglob("*.py"))
    monkeypatch.setattr(corpus_module, "_stdlib_files", lambda: (root, paths))
    out = prepare("std", stdlib=True, vocab_size=300, out_root=tmp_path)
    meta = _meta(out)
    assert meta["skipped"]["non_utf8_files"] == ["b.py"]
    assert meta["skipped"]["empty_documents"] == 1
    assert meta["skipped"]["charmap_codec_tables"] == 1
    assert meta["source"]["files"] == 3
    documents = _decode_split(out, "train") + _decode_split(out, "val")
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
    folder = _write(
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
    assert _meta(out)["replaced_invalid_utf8_bytes"] == 4
    documents = _decode_split(out, "train") + _decode_split(out, "val")
    assert "abcde\ufffd\ufffdz \ufffd!\n" in documents

    # A bad file --max-bytes leaves out is neither an error nor counted as replaced.
    capped = _write(tmp_path / "capped", {"a.txt": "first doc\n", "b.txt": "second doc\n"})
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
        meta = _meta(out)
        assert meta["skipped"]["over_max_bytes"] == 1
        assert meta["replaced_invalid_utf8_bytes"] == 0


def test_a_compressed_file_is_its_bytes_not_what_it_unpacks_to(tmp_path: Path) -> None:
    """The documents are the bytes that were checked, counted and hashed: `datasets`' text
    builder would unpack a gzip file (by name or by content) and tokenize other text."""
    packed = gzip.compress(b"hidden text inside gzip\n", mtime=0)
    folder = _write(
        tmp_path / "corpus",
        {"a.txt": _document("fjord"), "b.txt.gz": packed, "c.txt": packed},
    )
    out = prepare(
        "packed",
        files=[str(folder / "*")],
        encoding_errors="replace",
        vocab_size=300,
        out_root=tmp_path,
    )
    documents = _decode_split(out, "train") + _decode_split(out, "val")
    assert not any("hidden text" in d for d in documents)
    assert documents.count(packed.decode("utf-8", errors="replace")) == 2
    assert _meta(out)["replaced_invalid_utf8_bytes"] > 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"files": ["{corpus}/*.nothing"]}, r"glob '.*\*\.nothing' matched no files"),
        ({"files": ["{corpus}/missing.txt"]}, r"file '.*missing\.txt' does not exist"),
        ({"files": ["{corpus}"]}, r"is a directory"),
        ({"files": ["{corpus}/*.txt", "{corpus}/empty.md"]}, r"empty\.md is empty; every input"),
        (
            {"files": ["{corpus}/*.txt", "{corpus}/empty.md", "{corpus}/empty2.md"]},
            r"empty\.md is empty \(and 1 more of the \d+ matched\); .*: give patterns that leave",
        ),
        ({"files": ["{corpus}/quokka.txt"]}, r"at least 2 non-empty documents"),
        ({"files": []}, r"--files needs at least one"),
        ({"files": [""]}, r"--files '': an empty path"),
        ({"files": None, "hub": ""}, r"--hub '': empty"),
        ({"vocab_size": 256}, r"--vocab-size 256 must be in \[257, 65536\]"),
        ({"vocab_size": 65537}, r"--vocab-size 65537"),
        ({"val_fraction": 0.0}, r"--val-fraction 0.0"),
        ({"val_fraction": 1.0}, r"--val-fraction 1.0"),
        ({"max_bytes": 10}, r"--max-bytes 10 is smaller than the first document"),
        ({"max_bytes": 0}, r"--max-bytes 0 must be positive"),
        ({"name": "../escape"}, r"--name '../escape'"),
        ({"stdlib": True}, r"exactly one source"),
        ({"hub_config": "x"}, r"--hub-config only applies to --hub"),
        ({"encoding_errors": "ignore"}, r"--encoding-errors 'ignore'"),
    ],
)
def test_bad_input_fails_clearly_and_keeps_prepared_data(
    corpus: Path, tmp_path: Path, change: dict, message: str, capsys: pytest.CaptureFixture
) -> None:
    (corpus / "empty.md").write_bytes(b"")
    (corpus / "empty2.md").write_bytes(b"")
    kwargs = {"files": [str(corpus / "*.txt")], "vocab_size": VOCAB, "out_root": tmp_path}
    out = prepare("tiny", **kwargs)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    change = {
        key: [v.format(corpus=corpus) for v in value] if key == "files" and value else value
        for key, value in change.items()
    }
    capsys.readouterr()
    with pytest.raises(PrepareError, match=message):
        prepare(**({"name": "tiny"} | kwargs | change))
    assert _contents(out) == before
    assert "replacing" not in capsys.readouterr().err, "not said of what is not replaced"


def test_a_run_directory_or_a_file_is_no_place_for_a_corpus(corpus: Path, tmp_path: Path) -> None:
    """A run's tokenizer.json is what its checkpoint was trained with: never overwritten."""
    files = [str(corpus / "*.txt")]
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "ckpt.pt").write_bytes(b"weights")
    (run_dir / "tokenizer.json").write_text("{}")
    with pytest.raises(PrepareError, match=r"r1 holds a training run \(ckpt\.pt\)"):
        prepare("r1", files=files, vocab_size=VOCAB, out_root=tmp_path / "runs")
    assert sorted(p.name for p in run_dir.iterdir()) == ["ckpt.pt", "tokenizer.json"]
    assert (run_dir / "tokenizer.json").read_text() == "{}"
    (tmp_path / "afile").write_text("x")
    with pytest.raises(PrepareError, match=r"afile is a file, not a folder"):
        prepare("c", files=files, vocab_size=VOCAB, out_root=tmp_path / "afile")


def test_files_expands_a_tilde_no_shell_expanded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--files=~/texts/*.txt reaches prepare as typed; the rebuild command holds the path."""
    monkeypatch.setenv("HOME", str(tmp_path))
    _write(tmp_path / "texts", {f"{w}.txt": _document(w) for w in WORDS})
    out = prepare("home", files=["~/texts/*.txt"], vocab_size=VOCAB, out_root=tmp_path)
    assert _meta(out)["source"]["patterns"] == [str(tmp_path / "texts" / "*.txt")]


def test_another_tools_token_files_are_not_overwritten(corpus: Path, tmp_path: Path) -> None:
    """Token files beside files no prepare wrote, without a corpus's meta.json (nanoGPT's
    train.bin, val.bin and meta.pkl), are refused; a folder with nothing to overwrite is
    written; one a prepare left without meta.json (stopped between its renames) or with a
    damaged one is rebuilt; beside a corpus, added files stay."""
    files = [str(corpus / "*.txt")]
    theirs = _write(tmp_path / "shake", {"meta.pkl": "vocab", "train.bin": "1", "val.bin": "2"})
    before = _contents(theirs)
    with pytest.raises(PrepareError, match=r"shake holds files no prepare wrote \(meta\.pkl\)"):
        prepare("shake", files=files, vocab_size=VOCAB, out_root=tmp_path)
    assert _contents(theirs) == before
    # Nothing there to overwrite (a folder of texts, a .DS_Store): written
    _write(tmp_path / "texts", {"d1.txt": "mine"})
    prepare("texts", files=files, vocab_size=VOCAB, out_root=tmp_path)
    assert (tmp_path / "texts" / "d1.txt").read_text() == "mine"
    out = prepare("ours", files=files, vocab_size=VOCAB, out_root=tmp_path)
    (out / "meta.json").unlink()
    (out / ".train.bin.123.tmp").write_bytes(b"")
    (out / ".DS_Store").write_bytes(b"")
    prepare("ours", files=files, vocab_size=VOCAB, out_root=tmp_path)
    assert (out / "meta.json").is_file()
    (out / "meta.json").write_text('{"cut')  # damaged: rebuilt, as before
    prepare("ours", files=files, vocab_size=VOCAB, out_root=tmp_path)
    assert "content_sha256" in _meta(out)
    (out / "NOTES.md").write_text("mine")
    prepare("ours", files=files, vocab_size=VOCAB + 1, out_root=tmp_path)
    assert (out / "NOTES.md").read_text() == "mine"


def test_an_out_root_that_cannot_be_written_says_so_before_any_work(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    denied = tmp_path / "denied"  # as a folder of another user's (root ignores permissions)
    denied.mkdir()
    monkeypatch.setattr(prepare_module.os, "access", lambda path, mode: Path(path) != denied)
    read = []
    monkeypatch.setattr(prepare_module, "files_corpus", lambda *a: read.append(a))
    argv = ["--name", "c", "--files", str(corpus / "*.txt"), "--out-root", str(denied / "x")]
    assert prepare_module.main(argv) == 2
    assert f"cannot write {denied / 'x' / 'c'}: no permission to write in {denied}; give " in (
        capsys.readouterr().err
    )
    assert not read and not any(denied.iterdir())


def test_a_read_only_corpus_is_reused_and_not_rebuilt(
    prepared: Prepared, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files, out, before = prepared
    monkeypatch.setattr(prepare_module.os, "access", lambda path, mode: Path(path) != out)
    assert prepare("tiny", files=files, vocab_size=VOCAB, out_root=tmp_path) == out
    trained = []
    monkeypatch.setattr(prepare_module, "_train_tokenizer", lambda *a: trained.append(a))
    with pytest.raises(PrepareError, match=f"no permission to write in {re.escape(str(out))};"):
        prepare("tiny", files=files, vocab_size=300, out_root=tmp_path)  # other settings
    assert not trained and _contents(out) == before


def test_each_file_reaches_the_disk_before_it_is_renamed_into_place(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A power cut after a rename must not leave a file whose data never reached the disk;
    the folder is synced after the renames, so that they last too."""
    events: list[tuple[str, str]] = []
    synced, renamed = store_module.sync, prepare_module.os.replace

    def sync(path: Path) -> None:
        events.append(("sync", Path(path).name))
        synced(path)

    def replace(source: Path, target: Path) -> None:
        events.append(("replace", Path(source).name))
        renamed(source, target)

    monkeypatch.setattr(store_module, "sync", sync)
    monkeypatch.setattr(prepare_module, "sync", sync)
    monkeypatch.setattr(prepare_module.os, "replace", replace)
    out = prepare("c", files=[str(corpus / "*.txt")], vocab_size=VOCAB, out_root=tmp_path)
    moved = [name for kind, name in events if kind == "replace"]
    assert len(moved) == 4, "three outputs, then meta.json"
    for name in moved:
        assert events.index(("sync", name)) < events.index(("replace", name))
    assert events[-1] == ("sync", out.name), "the folder, after every rename"


def test_a_full_disk_leaves_the_corpus_there_before_whole(
    prepared: Prepared,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    files, out, before = prepared

    def full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prepare_module, "_write_tokens", full)
    argv = ["--name", "tiny", "--files", *files, "--out-root", str(tmp_path), "--vocab-size", "300"]
    assert prepare_module.main(argv) == 2
    said = f"cannot write {out} (No space left on device); the corpus there before is as it was"
    assert said in capsys.readouterr().err
    assert _contents(out) == before
    assert prepare("tiny", files=files, vocab_size=VOCAB, out_root=tmp_path) == out  # reused

    # Full after the old meta.json went, during the renames: the next run redoes the corpus.
    monkeypatch.undo()
    monkeypatch.setattr(prepare_module.os, "replace", full)
    assert prepare_module.main(argv) == 2
    said = f"cannot write {out} (No space left on device); no meta.json describes unfinished"
    assert said in capsys.readouterr().err
    assert not (out / "meta.json").exists()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_token_files_on_a_full_disk_fail_with_the_errno(corpus: Path, tmp_path: Path) -> None:
    """numpy's tofile raised an OSError without one: '170540 requested and 124928 written'."""
    out = prepare("c", files=[str(corpus / "*.txt")], vocab_size=VOCAB, out_root=tmp_path)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    documents = corpus_module.load_text_files(
        corpus_module.files_corpus([str(corpus / "*.txt")], "strict", None), tmp_path / "arrow"
    )
    with pytest.raises(OSError) as raised:
        prepare_module._write_tokens(tokenizer, documents, Path("/dev/full"), "train")
    assert raised.value.errno == errno.ENOSPC


def test_a_full_disk_while_copying_the_inputs_changes_nothing(
    prepared: Prepared,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """The Arrow copy of the inputs is written by the output, not to /tmp (which may be a
    small tmpfs, here one that does not exist); a full disk there is said as such."""
    import datasets

    files, out, before = prepared
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-tmp"))

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(datasets.arrow_writer.ArrowWriter, "write", full)
    argv = ["--name", "tiny", "--files", *files, "--out-root", str(tmp_path), "--vocab-size", "300"]
    assert prepare_module.main(argv) == 2
    error = capsys.readouterr().err
    assert f"cannot write {tmp_path}{os.sep}.prepare-" in error
    assert "(No space left on device); nothing was changed" in error
    assert _contents(out) == before
    assert not list(tmp_path.glob(".prepare-*")), "the copy is removed"

    monkeypatch.undo()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-tmp"))
    prepare("tiny", files=files, vocab_size=300, out_root=tmp_path)
    assert _meta(out)["vocab_size"] == 300


def test_an_input_that_changes_while_it_is_prepared_is_an_error(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files are checked and hashed, then read again to tokenize: what meta.json's hash
    describes must be what was tokenized."""
    checked = prepare_module.files_corpus
    first: list[Path] = []

    def then(change: Callable[[Path], object]) -> Callable[..., object]:
        def files_corpus(*args: object) -> object:
            found = checked(*args)
            first[:] = found.paths[:1]
            change(found.paths[0])
            return found

        return files_corpus

    files = [str(corpus / "*.txt")]
    monkeypatch.setattr(prepare_module, "files_corpus", then(lambda p: p.write_text("edited\n")))
    with pytest.raises(PrepareError, match=f"under {re.escape(str(corpus))} changed while"):
        prepare("c", files=files, vocab_size=VOCAB, out_root=tmp_path)
    monkeypatch.setattr(prepare_module, "files_corpus", then(Path.unlink))
    with pytest.raises(PrepareError, match=f"cannot read {re.escape(str(first[0]))}: No such"):
        prepare("c", files=files, vocab_size=VOCAB, out_root=tmp_path)
    assert not (tmp_path / "c").exists()


def test_identical_documents_share_a_split_and_are_counted(tmp_path: Path) -> None:
    texts = {f"{i:02}.txt": f"document {i}\nsecond line\n" for i in range(12)}
    # Each copy has Windows line endings: the same document once read with universal newlines.
    copies = {f"copy-{name}": text.replace("\n", "\r\n") for name, text in texts.items()}
    folder = _write(tmp_path / "corpus", texts | copies)
    out = prepare(
        "dups", files=[str(folder / "*.txt")], val_fraction=0.5, vocab_size=300, out_root=tmp_path
    )
    train, val = _decode_split(out, "train"), _decode_split(out, "val")
    assert sorted(train + val) == sorted([*texts.values()] * 2)
    assert not set(train) & set(val), "val holds no copy of a train document"
    assert _meta(out)["duplicate_documents"] == 12


def test_adding_a_document_moves_no_other(tmp_path: Path) -> None:
    folder = _write(tmp_path / "corpus", {f"{i:02}.txt": f"document {i}\n" for i in range(20)})
    kwargs = {"files": [str(folder / "*.txt")], "val_fraction": 0.3, "vocab_size": 300}
    before = set(_decode_split(prepare("grow", out_root=tmp_path, **kwargs), "val"))
    _write(folder, {"00-new.txt": "a new document\n"})  # first in input order
    after = set(_decode_split(prepare("grow", out_root=tmp_path, **kwargs), "val"))
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
    # As the module docstring says: val gets the smallest hash, or train keeps the largest.
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
    folder = _write(tmp_path / "corpus", {f"{i}.txt": "same text\n" for i in range(3)})
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


def test_cli_prepares_and_reports_errors_without_traceback(corpus: Path, tmp_path: Path) -> None:
    common = ["--name", "cli", "--out-root", str(tmp_path), "--vocab-size", str(VOCAB)]
    done = _run_cli(*common, "--files", str(corpus / "*.txt"))
    assert done.returncode == 0, done.stderr
    assert _meta(tmp_path / "cli")["splits"]["val"]["documents"] >= 1

    failed = _run_cli(*common, "--files", str(corpus / "*.nothing"))
    assert failed.returncode == 2
    assert failed.stderr.startswith("error: glob ") and "*.nothing" in failed.stderr
    assert "Traceback" not in failed.stderr


def test_the_prepare_hint_asks_for_the_models_vocab_where_a_tokenizer_can_have_it() -> None:
    from data.meta import MIN_VOCAB_SIZE, prepare_command

    assert f"--vocab-size {MIN_VOCAB_SIZE}" in prepare_command(Path("data/x"), MIN_VOCAB_SIZE)
    assert "--vocab-size" not in prepare_command(Path("data/x"), MIN_VOCAB_SIZE - 1)
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
        assert _meta(folder)["splits"]["val"]["documents"] >= 1
        assert is_complete(folder, _meta(folder)["content_sha256"])
