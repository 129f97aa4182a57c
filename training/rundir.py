"""The run directory: where a run's files go (config.toml, metrics.jsonl, tokenizer.json,
ckpt.pt), the lock a run holds on it, the config a run resumes with, and the files beside the
checkpoint that a run writes before its first step; and a sweep's folder (profile_train.py):
made, the same kind of lock on it, which sample.py and --report read to know a folder is in
use, and the `latest` link to a default one.

train.py and its run's set-up (start.py) call these before its first step; errors name the
directory or file at fault (a RunDirError, or a ConfigError for the config a run resumes with).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shlex
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from tqdm import tqdm

from training.checkpoint import (
    CHECKPOINT,
    check_compatible,
    load_checkpoint,
    no_checkpoint,
    same_folder,
    write_atomically,
)
from training.config import (
    Config,
    ConfigError,
    build_config,
    config_diff,
    dump_toml,
    load_config,
    missing_fields,
    read_toml,
)
from training.metrics import start_metrics
from training.runtime import launched_ranks


class RunDirError(RuntimeError):
    """A run directory that cannot take this run; the message says why and what to do."""


# What a run writes into its directory; a new run goes only where nothing else is.
RUN_FILES = frozenset(
    {"config.toml", "metrics.jsonl", "tokenizer.json", CHECKPOINT, ".lock"}
    | {f"{name}.tmp" for name in ("config.toml", "metrics.jsonl", "tokenizer.json", CHECKPOINT)}
)


def check_out_dir(out_dir: Path, config: Config, resume: bool) -> None:
    """`out_dir` is a directory for a run, or can be made one; not a corpus folder, nor, for a
    new run, a folder of other files (`--out .` would write the run among a project's)."""
    if (broken := _broken_link(out_dir)) is not None:
        raise RunDirError(broken)
    _check_not_a_file(out_dir)
    if (out_dir / "meta.json").exists() or same_folder(out_dir, config.data.root):
        # Writing a run there would overwrite a corpus's tokenizer.json with this one's.
        raise RunDirError(f"--out {out_dir} holds prepared corpora; give the run its own directory")
    if resume or not out_dir.is_dir() or (out_dir / CHECKPOINT).exists():
        return  # a run's directory (open_run says to pass --resume)
    # Hidden files (an editor's, a file manager's) and lost+found are no one's work to lose.
    others = sorted(
        p.name
        for p in out_dir.iterdir()
        if p.name not in RUN_FILES and not p.name.startswith(".") and p.name != "lost+found"
    )
    if others:
        listed = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise RunDirError(
            f"--out {out_dir} holds files that are not a run's ({listed}); give a new run a new "
            "or empty directory"
        )


def check_run_files(out_dir: Path) -> None:
    """No folder stands where the run writes one of its files, or the temporary file it writes
    first: the run would stop at that write, after training it then could not keep."""
    for name in sorted(RUN_FILES - {CHECKPOINT, ".lock"}):  # open_run and the lock say theirs
        if (path := out_dir / name).is_dir() and not path.is_symlink():  # a link is replaced
            raise RunDirError(
                f"{path} is a folder, where the run writes a file; move it away, then run again"
            )


def _check_not_a_file(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        what = "a file" if out_dir.is_file() else "neither a file nor a folder"  # /dev/null
        raise RunDirError(f"--out {out_dir} is {what}; give a run directory")


MAKE_TRAIN_RUN = Path("runs/default")  # where `make train` trains (the Makefile's --out)


def resume_hint(out_dir: Path) -> str:
    """How to continue the run in out_dir, as the user started it: `make train` (which sets
    MAKE_TRAIN=1) takes the flags in ARGS."""
    flags = f"--resume --out {shlex.quote(str(out_dir))}"
    if os.environ.get("MAKE_TRAIN") != "1":
        return flags
    return f"make train ARGS={shlex.quote('--resume' if out_dir == MAKE_TRAIN_RUN else flags)}"


def open_run(
    out_dir: Path, config: Config, tokenizer_sha256: str, resume: bool
) -> tuple[Path, dict[str, Any] | None]:
    """Check that `out_dir` (checked and locked by lock_run_dir) can take this run, before
    anything is written. Returns the checkpoint's path and the checkpoint to resume from
    (checked against the config and corpus), or None for a new run."""
    ckpt_path = out_dir / CHECKPOINT
    if ckpt_path.is_dir():
        raise no_checkpoint(ckpt_path)
    if ckpt_path.exists() and not resume:
        raise RunDirError(
            f"{out_dir} already holds a checkpoint; continue it with {resume_hint(out_dir)}, or "
            f"give --out for a new run (or delete {out_dir} to start it over)"
        )
    if not resume:
        return ckpt_path, None
    if not ckpt_path.exists() and (out_dir / "config.toml").is_file():
        raise RunDirError(
            f"{out_dir} holds a run but no {CHECKPOINT} (it stopped before its first "
            "checkpoint, or the file was removed): there is nothing to resume; start it over "
            f"without --resume (with --config {out_dir / 'config.toml'} for the same settings)"
        )
    ckpt = load_checkpoint(ckpt_path)
    check_compatible(ckpt, config, tokenizer_sha256, ckpt_path)
    return ckpt_path, ckpt


@contextlib.contextmanager
def run_lock(out_dir: Path) -> Iterator[None]:
    """Hold DIR/.lock for the run: a second process training into the same directory (a
    --resume while the run goes on, two runs started at once) is refused, not let interleave
    its metrics and checkpoints with the first one's. Released when the run ends, however."""
    lock = out_dir / ".lock"
    try:
        f = open(lock, "a+")  # noqa: SIM115 (held open for the run: closed below)
    except OSError as e:  # a read-only directory, another user's lock file
        raise RunDirError(f"--out {out_dir}: cannot write there ({e.strerror})") from None
    with f:
        holder, unlocked = _take_lock(f)
        if holder is not None:
            raise RunDirError(
                f"another process (pid {holder}) is training in {out_dir}; let it finish (or "
                "stop it), or give this run another --out"
            )
        if unlocked is not None:
            print(
                f"warning: cannot lock {out_dir} ({unlocked}): nothing stops a second process "
                "from training into it meanwhile",
                file=sys.stderr,
            )
        yield


def _broken_link(out: Path) -> str | None:
    """What to say where --out, or a folder above it, is a link to nothing or into a loop of
    links: mkdir calls such a link existing (or another sweep's), and resolving a loop raises."""
    for path in (out, *out.parents):
        if not path.is_symlink():
            continue
        try:
            path.stat()
        except OSError as e:
            gone = e.errno == errno.ENOENT
            what = "which does not exist" if gone else f"which cannot be followed ({e.strerror})"
            where = "" if path == out else f": {path}"
            return f"--out {out}{where} is a link to {os.readlink(path)}, {what}"
    return None


def make_sweep_folder(out: Path, exclusive: bool) -> None:
    """A sweep's --out folder, made (`exclusive`: one that exists is another sweep's, an error),
    and checked writable before anything is measured."""
    if (broken := _broken_link(out)) is not None:
        raise ConfigError(broken)
    try:
        out.mkdir(parents=True, exist_ok=not exclusive)
    except FileExistsError:
        raise ConfigError(
            f"{out} was taken by another sweep started at the same time; run again"
        ) from None
    except OSError as e:  # a file on the path, no permission
        raise ConfigError(f"--out {out}: cannot make the folder ({e.strerror})") from None
    try:  # an empty folder that exists may still be read-only: know before measuring
        tempfile.TemporaryFile(dir=out).close()
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write there ({e.strerror})") from None


@contextlib.contextmanager
def sweep_lock(out: Path) -> Iterator[None]:
    """Hold `out`/.lock while a sweep writes there: a second sweep given the same --out is
    refused, and --report or --compare know that one is still running. Removed at the end."""
    lock = out / ".lock"
    with open(lock, "a+") as f:
        holder, _ = _take_lock(f)  # on a filesystem without locks, nothing to hold
        if holder is not None:
            raise ConfigError(
                f"--out {out}: another sweep (pid {holder}) is writing there; give this one "
                "another folder"
            )
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)


def point_latest(out: Path) -> None:
    """Point profiles/<config>/latest at out (best effort: where there are no symlinks, none).
    A `latest` that is not a link, a file or folder someone put there, is left as it is."""
    latest = out.parent / "latest"
    if latest.exists() and not latest.is_symlink():
        tqdm.write(
            f"warning: {latest} is not a link (a file or folder put there?): left as it is, "
            f"so it does not point at this sweep, {out.name}",
            file=sys.stderr,
        )
        return
    with contextlib.suppress(OSError):
        latest.unlink(missing_ok=True)
        latest.symlink_to(out.name)


def _take_lock(f: TextIO) -> tuple[str | None, str | None]:
    """Take the exclusive lock on the open lock file `f` and write this process's pid in it.
    Returns the pid of the process holding it instead, and why it cannot be locked at all (a
    filesystem without locks: NFS mounted nolock, some FUSE); both None once it is held."""
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        return f.read().strip() or "?", None
    except OSError as e:
        return None, e.strerror
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return None, None


def lock_holder(folder: Path) -> str | None:
    """The pid of a process holding `folder`/.lock now (training there, or a sweep writing
    its results), or None."""
    try:
        f = open(folder / ".lock")  # noqa: SIM115 (closed below)
    except OSError:  # no lock file: nothing has held it, or not this project's folder
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released as the file closes
        except BlockingIOError:
            return f.read().strip() or "?"
        except OSError:  # a filesystem without locks: cannot tell
            return None
    return None


def lock_run_dir(
    held: contextlib.ExitStack,
    out_dir: Path,
    config: Config,
    resume: bool,
    rank: int,
    world_size: int,
    device: torch.device,
) -> None:
    """Rank 0 makes `out_dir` if need be and locks it, before the run's state there is read (a
    --resume must not read a checkpoint the run going on is about to replace, a new run must
    not start over one that finished meanwhile); every rank learns the outcome, so a refusal
    is the same error on each. What this made is removed again if the run writes nothing."""
    refused = ""
    if rank == 0:
        try:
            check_out_dir(out_dir, config, resume)
            made_dirs = [d for d in (out_dir, *out_dir.parents) if not d.exists()]  # deepest first
            made_lock = not (out_dir / ".lock").exists()
            try:
                out_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:  # a file on the path, no permission
                raise RunDirError(
                    f"--out {out_dir}: cannot make the directory ({e.strerror})"
                ) from None
            held.callback(_tidy_unused, out_dir, made_dirs, made_lock)
            held.enter_context(run_lock(out_dir))
        except RunDirError as e:
            refused = str(e)
    if world_size > 1:
        flag = torch.tensor([float(bool(refused))], device=device)
        dist.broadcast(flag, src=0)
        if flag.item() and not refused:
            refused = f"rank 0 refused --out {out_dir}: see its message"
    if refused:
        raise RunDirError(refused)


def _tidy_unused(out_dir: Path, made_dirs: list[Path], made_lock: bool) -> None:
    """A run that stopped before its first write (config.toml) leaves no .lock or directories
    of its making behind."""
    if (out_dir / "config.toml").exists():
        return
    if made_lock:
        (out_dir / ".lock").unlink(missing_ok=True)
    for made in made_dirs:
        try:
            made.rmdir()
        except OSError:  # not empty after all: leave it, and those above it
            break


def run_config(out: Path, config_file: Path | None, overrides: list[str], resume: bool) -> Config:
    """The config to train with: on --resume, the run's own config.toml, whatever --config says
    (`make train ARGS=--resume` gives configs/default.toml: the run's overrides must not fall
    back to that file's values), with the overrides given now on top; otherwise --config's.
    Without config.toml, the config ckpt.pt records is the run's."""
    saved = out / "config.toml"
    check_run_files(out)
    if not resume:
        return load_config(config_file, overrides)
    _check_not_a_file(out)  # said as such, not as a missing out/ckpt.pt
    # Read before torchrun's process group exists: rank 0 alone says what it resumes with
    master = launched_ranks()[0] == 0
    recorded = _recorded_config(out / CHECKPOINT)  # None: no readable run here; open_run says
    raw = saved_config(out, recorded, to="resume")  # read once, compared, used
    if raw is None:
        if not (out / CHECKPOINT).is_file():  # no run here (a mistyped --out): say so first
            raise no_checkpoint(out / CHECKPOINT)
        if recorded is None:
            return load_config(config_file, overrides)
        if master:
            print(
                f"{saved} is missing; resuming with the config {out / CHECKPOINT} records",
                file=sys.stderr,
            )
        return build_config(recorded, overrides, source=f"the config {out / CHECKPOINT} records")
    config = build_config(raw, overrides, source=str(saved))
    stale = _stale_fields(raw, saved, recorded)
    own = f"{saved}, the run's own config"  # what the run resumes with, as said below
    if stale:
        own = f"the config {out / CHECKPOINT} records"
        if master:
            fields = ", ".join(
                f"{name} = {theirs!r} there, {ours!r} in the checkpoint"
                for name, ours, theirs in stale
            )
            print(
                f"{saved} differs from the config {out / CHECKPOINT} records ({fields}): the run "
                "stopped between writing the two, or the file was edited. Resuming with the "
                "checkpoint's, the settings its weights were trained with; to change a field, "
                "give --section.field=value",
                file=sys.stderr,
            )
        config = build_config(recorded, overrides, source=own)
    if config_file is not None and master:
        try:  # --config is read only to say how it differs: its errors do not stop the run
            differ = config_diff(config, load_config(config_file, overrides))
        except ConfigError as e:
            print(
                f"resuming with {own}, not compared with --config ({e})",
                file=sys.stderr,
            )
            differ = []
        if differ:
            fields = ", ".join(
                f"{name} = {ours!r} (there {theirs!r})" for name, ours, theirs in differ
            )
            print(
                f"resuming with {own}; {config_file} differs, and the "
                f"run keeps {fields}; to change a field now, give --section.field=value",
                file=sys.stderr,
            )
    return config


def saved_config(
    run_dir: Path, recorded: dict[str, Any] | None, *, to: str
) -> dict[str, Any] | None:
    """The fields of the run's config.toml, or None where it has none; `to` is what the caller
    does with them ("resume", "sample").

    train.py writes every field into config.toml, so one that lacks a field the checkpoint
    records is damaged (or cut by hand), and the defaults in its place would change the run
    without a word: an error. (A field newer than the run is in neither: its default holds.)
    Either error, and one that does not parse, says how to go on where the checkpoint records
    a config."""
    saved = run_dir / "config.toml"
    if not saved.is_file():
        return None
    remedy = (
        f"delete it to {to} with the config {run_dir / CHECKPOINT} records, or mend it"
        if recorded is not None
        else "mend it"
    )
    try:
        raw = read_toml(saved)
    except ConfigError as e:
        raise ConfigError(f"{e}; it is damaged or was edited: {remedy}") from None
    missing = missing_fields(raw, recorded or {})
    if missing:
        raise ConfigError(
            f"{saved} lacks {', '.join(missing)}, which train.py writes: it is damaged or was "
            f"cut; {remedy}"
        )
    return raw


def _stale_fields(
    raw: dict[str, Any], saved: Path, recorded: dict[str, Any] | None
) -> list[tuple[str, Any, Any]]:
    """The fields where config.toml and the checkpoint's config differ, as config_diff gives
    them (the checkpoint's value first). train.py writes the checkpoint before replacing
    config.toml with a resume's new settings, so the two differ only where a run stopped
    between those writes (or config.toml was edited by hand): the checkpoint's is the run's."""
    if recorded is None:
        return []
    try:  # a checkpoint from a newer train.py, with fields this one lacks: resuming says so
        return config_diff(build_config(recorded), build_config(raw, source=str(saved)))
    except ConfigError:
        return []


def _recorded_config(ckpt_path: Path) -> dict[str, Any] | None:
    """The config a checkpoint records, read without loading its tensors into memory; None
    where there is no checkpoint. A damaged one is its own error, as resuming words it."""
    if not ckpt_path.is_file():
        return None
    try:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # truncated, another program's, a format mmap cannot read
        ckpt = load_checkpoint(ckpt_path)  # raises the worded error, or reads it after all
    recorded = ckpt.get("config") if isinstance(ckpt, dict) else None
    return recorded if isinstance(recorded, dict) else None


def write_run_files(
    config: Config, out_dir: Path, data_dir: Path, resumed_at: int | None
) -> bytes | None:
    """Rank 0's files beside the checkpoint: config.toml, metrics.jsonl (on resume, cut back to
    the checkpoint's step) and the corpus's tokenizer. Returns the settings config.toml is to
    hold once this call saves its first checkpoint, where they differ from what it holds.

    config.toml is the config of the run's checkpoint: a new run's is written now; on resume,
    one with other settings replaces it only after the first checkpoint they make, so a
    resume that fails before (a NaN from a bad override) leaves the run as it was."""
    saved = out_dir / "config.toml"
    text = dump_toml(config).encode("utf-8")
    unsaved = None
    if resumed_at is None:
        write_atomically(saved, lambda f: f.write(text))
    elif not (saved.is_file() and saved.read_bytes() == text):
        unsaved = text
    start_metrics(out_dir / "metrics.jsonl", resumed_at)
    # Atomically, as every file of the run: sample.py may be reading it.
    tokenizer = (data_dir / "tokenizer.json").read_bytes()
    own = out_dir / "tokenizer.json"
    if resumed_at is not None and own.is_file() and own.read_bytes() != tokenizer:
        # The corpus's is the one the checkpoint was trained with (checked by open_run)
        print(
            f"note: {own} was not the tokenizer {out_dir / CHECKPOINT} was trained with "
            f"(edited or damaged); replaced with {data_dir / 'tokenizer.json'}",
            file=sys.stderr,
        )
    write_atomically(own, lambda f: f.write(tokenizer))
    return unsaved
