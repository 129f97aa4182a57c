"""data/prepare.py rebuilds a corpus only when its inputs change, and never loses the one there:
concurrent runs, interrupts, full disks, bad input."""

import errno
import fcntl
import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from corpora import VOCAB, WORDS, Prepared, contents_of, document, mtimes, read_meta, write_corpus
from data import corpus as corpus_module
from data import prepare as prepare_module
from data import store as store_module
from data import tokens as tokens_module
from data.prepare import PrepareError, prepare


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
    first, before = read_meta(out), mtimes(out)
    capsys.readouterr()

    prepare("tiny", files=files, vocab_size=VOCAB, out_root=tmp_path)
    assert "reusing" in capsys.readouterr().out
    assert mtimes(out) == before

    # A damaged tokenizer.json (its hash is in meta.json): made again, not reused
    tokenizer = (out / "tokenizer.json").read_bytes()
    (out / "tokenizer.json").write_text('{"trunc')
    prepare("tiny", files=files, vocab_size=VOCAB, out_root=tmp_path)
    assert "reusing" not in capsys.readouterr().out
    assert (out / "tokenizer.json").read_bytes() == tokenizer  # the same, made again
    # A meta.json naming token files of another dtype, which the loader refuses: made again,
    # as that refusal's advice says
    (out / "meta.json").write_text(json.dumps(read_meta(out) | {"dtype": "uint32"}))
    prepare("tiny", files=files, vocab_size=VOCAB, out_root=tmp_path)
    assert "reusing" not in capsys.readouterr().out
    assert read_meta(out)["dtype"] == "uint16"
    before = mtimes(out)

    # The same documents from a copied folder: reused, and meta.json says where they are now.
    copied = Path(shutil.copytree(corpus, tmp_path / "copied"))
    prepare("tiny", files=[str(copied / "*.txt")], vocab_size=VOCAB, out_root=tmp_path)
    assert "reusing" in capsys.readouterr().out
    assert read_meta(out)["source"]["patterns"] == [str(copied / "*.txt")]
    assert {k: v for k, v in read_meta(out).items() if k != "source"} == {
        k: v for k, v in first.items() if k != "source"
    }
    meta = read_meta(out)  # one with no source at all (written by hand, say) gets it
    del meta["source"]
    (out / "meta.json").write_text(json.dumps(meta))
    prepare("tiny", files=files, vocab_size=VOCAB, out_root=tmp_path)
    assert read_meta(out)["source"]["patterns"] == files
    capsys.readouterr()

    (corpus / "fjord.txt").write_text(document("fjord") + "one more line\n")
    prepare("tiny", files=files, vocab_size=VOCAB, out_root=tmp_path)
    said = capsys.readouterr()
    assert "reusing" not in said.out
    assert f"replacing the corpus in {out} (its source text changed)" in said.err
    assert read_meta(out)["content_sha256"] != first["content_sha256"]

    changed = read_meta(out)["content_sha256"]
    prepare("tiny", files=files, vocab_size=VOCAB + 1, out_root=tmp_path)
    assert read_meta(out)["content_sha256"] != changed
    said = capsys.readouterr().err
    assert f"(vocab_size {VOCAB} -> {VOCAB + 1})" in said and "cannot resume" in said
    # A setting and the text at once: both said
    (corpus / "fjord.txt").write_text(document("fjord"))
    prepare("tiny", files=files, vocab_size=VOCAB, out_root=tmp_path)
    said = capsys.readouterr().err
    assert f"(vocab_size {VOCAB + 1} -> {VOCAB}, and its source text changed)" in said
    # --max-bytes chooses the text the digest covers: it is said, not a change of the files
    kept = sum(p.stat().st_size for p in corpus.glob("*.txt")) * 2 // 3  # not every file
    prepare("tiny", files=files, vocab_size=VOCAB, out_root=tmp_path, max_bytes=kept)
    said = capsys.readouterr().err
    assert f"(max_bytes None -> {kept})" in said and "source text" not in said

    # A corpus made by another tokenizers version (its hash covers the version) says that.
    meta = read_meta(out)
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
    kept = write_corpus(tmp_path / "texts" / "kept", {f"{w}.txt": document(w) for w in WORDS})
    extra = write_corpus(tmp_path / "texts" / "extra", {"late.txt": document("late")})
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
    assert sum(split["documents"] for split in read_meta(out)["splits"].values()) == len(WORDS) + 1


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
    real_write_tokens = tokens_module._write_tokens

    def interrupted(tokenizer: Tokenizer, documents: object, path: Path, split: str) -> dict:
        if split == "val":
            raise KeyboardInterrupt
        return real_write_tokens(tokenizer, documents, path, split)

    monkeypatch.setattr(tokens_module, "_write_tokens", interrupted)
    (corpus / "fjord.txt").write_text("changed\n")
    with pytest.raises(KeyboardInterrupt):
        prepare("tiny", files=files, vocab_size=VOCAB, out_root=tmp_path)
    assert contents_of(out) == before, "no temp files left"


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

    monkeypatch.setattr(prepare_module, "train_tokenizer", terminated)
    (corpus / "fjord.txt").write_text("changed\n")
    handler = signal.getsignal(signal.SIGTERM)
    argv = ["--name", "tiny", "--files", *files, "--vocab-size", str(VOCAB)]
    assert prepare_module.main([*argv, "--out-root", str(tmp_path)]) == 143
    assert "stopped by SIGTERM; the corpus there before is as it was" in capsys.readouterr().err
    assert not list(tmp_path.glob(".prepare-*"))
    assert contents_of(out) == before
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
    real_write_outputs = prepare_module.write_outputs

    def written_then_interrupted(*args: Any, **kwargs: Any) -> dict:
        real_write_outputs(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "write_outputs", written_then_interrupted)
    (corpus / "fjord.txt").write_text("changed\n")
    argv = ["--name", "tiny", "--files", *files, "--vocab-size", str(VOCAB)]
    assert prepare_module.main([*argv, "--out-root", str(tmp_path)]) == 130
    said = "interrupted; the new corpus was written whole (its meta.json is there)"
    assert said in capsys.readouterr().err
    assert contents_of(out) != before


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


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"files": ["{corpus}/*.nothing"]}, r"glob '.*\*\.nothing' matched no files"),
        ({"files": ["{corpus}/missing.txt"]}, r"file '.*missing\.txt' does not exist"),
        ({"files": ["{corpus}"]}, r"is a directory"),
        ({"files": ["/dev/null"]}, r"'/dev/null' is not a regular file"),
        ({"files": ["{corpus}/*.txt", "{corpus}/empty.md"]}, r"empty\.md is empty; every input"),
        (
            {"files": ["{corpus}/*.txt", "{corpus}/empty.md", "{corpus}/empty2.md"]},
            r"empty\.md is empty \(and 1 more of the \d+ matched\); .*: give patterns that leave",
        ),
        (
            {"files": ["{corpus}/quokka.txt"]},
            r"--files matched one file, .*quokka\.txt, and each file is one document.*"
            r"split -l 1000 .*quokka\.txt parts/part_`, then --files 'parts/\*'",
        ),
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
    assert contents_of(out) == before
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


def test_another_tools_token_files_are_not_overwritten(corpus: Path, tmp_path: Path) -> None:
    """Token files beside files no prepare wrote, without a corpus's meta.json (nanoGPT's
    train.bin, val.bin and meta.pkl), are refused; a folder with nothing to overwrite is
    written; one a prepare left without meta.json (stopped between its renames) or with a
    damaged one is rebuilt; beside a corpus, added files stay. A folder of other files (a
    project's own: --out-root . --name data) is refused, unless they are the --files inputs
    (nanoGPT's data/shakespeare/input.txt)."""
    files = [str(corpus / "*.txt")]
    theirs = write_corpus(
        tmp_path / "shake", {"meta.pkl": "vocab", "train.bin": "1", "val.bin": "2"}
    )
    before = contents_of(theirs)
    with pytest.raises(PrepareError, match=r"shake holds files no prepare wrote \(meta\.pkl\)"):
        prepare("shake", files=files, vocab_size=VOCAB, out_root=tmp_path)
    assert contents_of(theirs) == before
    # Nothing to overwrite, but a folder of someone else's: refused, nothing written there
    project = write_corpus(tmp_path / "data", {"__init__.py": "", "prepare.py": ""})
    (project / "raw").mkdir()
    before = sorted(project.iterdir())
    with pytest.raises(PrepareError) as refused:
        prepare("data", files=files, vocab_size=VOCAB, out_root=tmp_path)
    assert str(refused.value).startswith(
        f"{project} holds files no prepare wrote (__init__.py, prepare.py, raw): a corpus is "
        "written into a folder of its own"
    )
    assert sorted(project.iterdir()) == before
    # Its own inputs, in the folder or in one below it, and a .DS_Store: written beside them
    texts = write_corpus(tmp_path / "texts", {"d1.txt": document("one"), ".DS_Store": ""})
    write_corpus(texts / "raw", {"d2.txt": "mine"})
    inputs = [*files, str(texts / "d1.txt"), str(texts / "raw" / "*.txt")]
    prepare("texts", files=inputs, vocab_size=VOCAB, out_root=tmp_path)
    assert (texts / "raw" / "d2.txt").read_text() == "mine" and (texts / "meta.json").is_file()
    out = prepare("ours", files=files, vocab_size=VOCAB, out_root=tmp_path)
    (out / "meta.json").unlink()
    (out / ".train.bin.123.tmp").write_bytes(b"")
    (out / ".DS_Store").write_bytes(b"")
    prepare("ours", files=files, vocab_size=VOCAB, out_root=tmp_path)
    assert (out / "meta.json").is_file()
    (out / "meta.json").write_text('{"cut')  # damaged: rebuilt, as before
    prepare("ours", files=files, vocab_size=VOCAB, out_root=tmp_path)
    assert "content_sha256" in read_meta(out)
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
    monkeypatch.setattr(prepare_module, "train_tokenizer", lambda *a: trained.append(a))
    with pytest.raises(PrepareError, match=f"no permission to write in {re.escape(str(out))};"):
        prepare("tiny", files=files, vocab_size=300, out_root=tmp_path)  # other settings
    assert not trained and contents_of(out) == before


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
    monkeypatch.setattr(tokens_module, "sync", sync)
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

    monkeypatch.setattr(tokens_module, "_write_tokens", full)
    argv = ["--name", "tiny", "--files", *files, "--out-root", str(tmp_path), "--vocab-size", "300"]
    assert prepare_module.main(argv) == 2
    said = f"cannot write {out} (No space left on device); the corpus there before is as it was"
    assert said in capsys.readouterr().err
    assert contents_of(out) == before
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
        tokens_module._write_tokens(tokenizer, documents, Path("/dev/full"), "train")
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
    assert contents_of(out) == before
    assert not list(tmp_path.glob(".prepare-*")), "the copy is removed"

    monkeypatch.undo()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-tmp"))
    prepare("tiny", files=files, vocab_size=300, out_root=tmp_path)
    assert read_meta(out)["vocab_size"] == 300


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


def test_a_truncated_val_bin_is_not_complete(prepared: Prepared) -> None:
    """Every token file is checked, val.bin as well as train.bin, before a corpus is reused."""
    digest = read_meta(prepared.out)["content_sha256"]
    assert store_module.is_complete(prepared.out, digest)
    val = prepared.out / "val.bin"
    val.write_bytes(val.read_bytes()[:-2])
    assert not store_module.is_complete(prepared.out, digest)
