"""A corpus folder as data/prepare.py writes it: whether it can be one (a folder, writable,
not a run's or another tool's), one prepare at a time per out-root, the check that what is
there is whole and of these inputs (reuse), what a replacement loses, and files moved into
place whole (meta.json last, see write_outputs in tokens.py).

Imports only the standard library, data.meta and data.corpus (whose `datasets` is imported
only where a corpus is read).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from data.corpus import PrepareError, sha256_text
from data.meta import file_sha256, holds_token_dtype, token_file_problem

OUTPUT_FILES = ("tokenizer.json", "train.bin", "val.bin")  # meta.json is written last


@contextlib.contextmanager
def one_at_a_time(root: Path) -> Iterator[None]:
    """One prepare at a time in an out-root: a second one (two `make train`s started together)
    waits, then finds the corpus whole and reuses it, instead of replacing its files, and
    removing its meta.json, under a run reading them. A lock on the folder itself, which must
    exist (prepare makes it, saying so when it cannot): no file."""
    fd = os.open(root, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another prepare in {root}/ to finish ...", file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a filesystem without locks: as before, unguarded
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


def remove_stale_temporaries(out_dir: Path, names: tuple[str, ...]) -> None:
    """The temporary files of an earlier run that was killed (SIGKILL, out of memory) before it
    could remove them: a whole corpus's size each time. Those of a process still running on
    this machine stay (a writer on another host sharing the folder would look dead here)."""
    for final in names:
        for path in out_dir.glob(f".{final}.*.tmp"):
            pid = path.name.removeprefix(f".{final}.").removesuffix(".tmp")
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                path.unlink(missing_ok=True)


SCRATCH = ".prepare-"  # then the pid of the prepare that made it


class ScratchFolder:
    """A temporary folder in `root` (made at once, as tempfile.TemporaryDirectory is), removed
    on exit; named for this process and locked while in use, so a later prepare can remove one
    that a killed prepare left (SIGKILL, out of memory; a whole corpus's size), never one in use
    (remove_stale_scratch)."""

    def __init__(self, root: Path) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix=f"{SCRATCH}{os.getpid()}-", dir=root)
        self.name = self._folder.name
        self._fd = os.open(self.name, os.O_RDONLY)
        with contextlib.suppress(OSError):  # a filesystem without locks: the pid alone tells
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def __enter__(self) -> str:
        return self.name

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)
        self._folder.cleanup()


def remove_stale_scratch(root: Path) -> None:
    """The scratch folders in `root` of prepares that are gone: their pid is not running here,
    and no process holds their lock (a prepare in another container or on another host sharing
    the folder has a pid that looks dead from here)."""
    for path in root.glob(f"{SCRATCH}*-*"):
        pid = path.name.removeprefix(SCRATCH).split("-", 1)[0]
        if not (pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid))):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:  # not a folder, or gone meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # in use
            continue
        except OSError:  # a filesystem without locks: the pid alone tells
            pass
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: no pid is that large
        return False
    except PermissionError:  # another user's process
        return True
    return True


# Settings that choose the documents whose text the digest covers
TEXT_CHOOSING = (
    "kind",
    "max_bytes",
    "encoding_errors",
    "hub",
    "hub_config",
    "split",
    "text_column",
)


def content_hash(settings: dict[str, Any], digest: str) -> str:
    """meta.json's content_sha256: the settings and the inputs' digest, together."""
    return sha256_text(json.dumps(settings, sort_keys=True) + "\n" + digest)


def say_what_is_replaced(out_dir: Path, settings: dict[str, Any], digest: str) -> None:
    """A corpus prepared there before with other settings or inputs is about to be replaced:
    say so, and what differs, since runs trained on it can no longer resume where the
    tokenizer changes (not all settings change it: --max-bytes past the corpus's size). They
    still sample: each run keeps its own tokenizer.json. Whether the inputs changed too: the
    old settings with these inputs' digest give the old hash, or not."""
    try:
        meta = json.loads((out_dir / "meta.json").read_text())
        if meta["content_sha256"] == content_hash(settings, digest):
            return  # the same corpus, its files damaged: rebuilt as it was
        before = dict(meta["settings"])
        same_inputs = meta["content_sha256"] == content_hash(before, digest)
    except (OSError, ValueError, TypeError, KeyError):
        return  # nothing whole there: nothing to lose
    differ_keys = [key for key, value in settings.items() if before.get(key) != value]
    differ = [f"{key} {before.get(key)!r} -> {settings[key]!r}" for key in differ_keys]
    # A setting that chooses which text is kept changes the digest by itself: then the text
    # may or may not have changed, and the setting is what is said
    if not same_inputs and not any(key in TEXT_CHOOSING for key in differ_keys):
        differ.append("and its source text changed" if differ else "its source text changed")
    print(
        f"replacing the corpus in {out_dir} ({', '.join(differ)}): "
        "runs trained on the one there now cannot resume if its tokenizer changes (they still "
        "sample, with their own copy of it)",
        file=sys.stderr,
    )


def is_complete(out_dir: Path, content_sha256: str) -> bool:
    """Whether out_dir already holds whole outputs for exactly these inputs and settings."""
    try:
        meta = json.loads((out_dir / "meta.json").read_text())
        if meta["content_sha256"] != content_sha256 or not holds_token_dtype(meta):
            return False
        for split in ("train", "val"):
            if token_file_problem(out_dir / f"{split}.bin", meta["splits"][split]["tokens"]):
                return False
        return file_sha256(out_dir / "tokenizer.json") == meta["tokenizer_sha256"]
    except (OSError, ValueError, KeyError, TypeError):  # missing or malformed: rebuild
        return False


def record_source(out_dir: Path, source: dict[str, Any], skipped: dict[str, Any]) -> None:
    """The same documents read from elsewhere (a folder copied or moved) are reused; meta.json
    then says where they are now, which a rebuild command is made from, and what was left out
    there (the digest covers the documents kept, not the empty rows or unread files beside
    them). A note: where it cannot be written (a read-only folder), the corpus is still
    reused, with a warning."""
    meta = json.loads((out_dir / "meta.json").read_text())
    if meta.get("source") == source and meta.get("skipped") == skipped:
        return
    try:
        write_json_atomic(out_dir / "meta.json", {**meta, "source": source, "skipped": skipped})
    except OSError as e:
        print(
            f"warning: could not update {out_dir / 'meta.json'} (where the documents are now, "
            f"what was left out there: {e.strerror}); the corpus is reused as it is",
            file=sys.stderr,
        )


def write_json_atomic(path: Path, obj: Any) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps(obj, indent=2) + "\n")
        sync(temporary)
        os.replace(temporary, path)
        sync(path.parent)
    finally:
        temporary.unlink(missing_ok=True)


def sync(path: Path) -> None:
    """fsync a file before it is renamed into place (so that a power cut cannot leave a
    renamed file whose data never reached the disk), or a folder after the renames in it."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def check_out_dir(out_dir: Path, inputs: Sequence[Path] = ()) -> None:
    """Fail before any work if out_dir cannot be a corpus folder: a corpus's (rebuilt in
    place), a new or empty one, or one that holds only the inputs (a file, or the folder
    they are in: --files data/shakespeare/input.txt --name shakespeare, as nanoGPT keeps
    them)."""
    for path in (out_dir, *out_dir.parents):
        if path.exists():
            if not path.is_dir():
                raise PrepareError(f"cannot write {out_dir}: {path} is a file, not a folder")
            if path != out_dir:  # one there already may be a read-only corpus to reuse
                check_writable(out_dir, path)
            break
    run_files = [n for n in ("ckpt.pt", "metrics.jsonl") if (out_dir / n).exists()]
    if run_files:
        # Its tokenizer.json is the one its checkpoint was trained with.
        raise PrepareError(
            f"{out_dir} holds a training run ({', '.join(run_files)}); give the corpus another "
            "--name or --out-root"
        )
    others = _not_a_corpus(out_dir, inputs)
    if others:
        listed = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        if any((out_dir / name).exists() for name in OUTPUT_FILES):
            raise PrepareError(
                f"{out_dir} holds files no prepare wrote ({listed}) beside token files, and no "
                "corpus's meta.json: they may be another tool's, and would be overwritten; give "
                "the corpus another --name or --out-root (or, if a prepare left them, delete "
                f"{', '.join(OUTPUT_FILES)} there)"
            )
        raise PrepareError(
            f"{out_dir} holds files no prepare wrote ({listed}): a corpus is written into a "
            "folder of its own (new, empty, or holding only its --files inputs); give it "
            "another --name or --out-root"
        )


def _not_a_corpus(out_dir: Path, inputs: Sequence[Path]) -> list[str]:
    """The names in out_dir that show it is someone else's folder (nanoGPT's train.bin and
    val.bin beside its meta.pkl; a project's own folder, --out-root . --name data): any but a
    prepare's own, hidden ones and the inputs (or folders holding them), where there is no
    meta.json of a corpus. A prepare stopped between its renames (its meta.json removed first)
    leaves only its own names, and is rebuilt."""
    try:
        json.loads((out_dir / "meta.json").read_text())["content_sha256"]
        return []  # a corpus: files added beside it are kept, never written
    except (OSError, ValueError, TypeError, KeyError):
        pass
    try:
        entries = [p for p in out_dir.iterdir() if not p.name.startswith(".")]
    except OSError:  # not there, or unreadable: the writes say so
        return []
    ours = {*OUTPUT_FILES, "meta.json"}  # a damaged meta.json is rebuilt, as before
    given = [Path(os.path.realpath(p)) for p in inputs]  # not resolve(): a link loop is no error
    return sorted(
        p.name
        for p in entries
        if p.name not in ours
        and not any(Path(os.path.realpath(p)) in (i, *i.parents) for i in given)
    )


def check_writable(out_dir: Path, folder: Path) -> None:
    """An error before any work where `folder` (out_dir, or the nearest folder above it that
    exists) cannot be written in."""
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PrepareError(
            f"cannot write {out_dir}: no permission to write in {folder}; give another --out-root"
        )


def cannot_write(out_dir: Path, e: OSError, then: str) -> PrepareError:
    """A failed write as one line: the folder, the OS's reason, and what is left (`then`)."""
    where = f": {e.filename}" if e.filename else ""
    return PrepareError(f"cannot write {out_dir} ({e.strerror or e}{where}); {then}")
