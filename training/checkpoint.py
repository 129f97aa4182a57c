"""Checkpoints of a training run: written atomically, loaded as data, checked before resuming.

A checkpoint is one `ckpt.pt` in the run directory holding the model and optimizer state,
the step, the RNG and data-sampler state, the full config, the tokenizer's sha256 and what
wrote it (`provenance()`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import platform
import re
import shutil
import subprocess
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
from torch import Tensor

from data.meta import rebuild_command
from training.config import Config

CHECKPOINT = "ckpt.pt"
# What train.py writes and resuming needs (it also writes corpus_sha256, corpus and written_by,
# which a resume checks or reports, and val_loss, for the record).
KEYS = ("model", "optimizer", "step", "rng", "data", "config", "tokenizer_sha256")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or made for another model or tokenizer."""


def provenance() -> dict[str, str | None]:
    """What is writing a checkpoint: the torch and Python versions and this project's git
    commit ('-dirty' when tracked files have uncommitted changes; None outside a checkout of
    it, or without git)."""
    here = Path(__file__).resolve().parents[1]  # the project's root

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=here, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):  # no git, or it hung
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = None
    top = git("rev-parse", "--show-toplevel")
    if top is not None and Path(top).resolve() == here:  # not a repository this is copied into
        # --exclude='*': a bare commit hash, never a tag's name.
        commit = git("describe", "--always", "--dirty", "--abbrev=12", "--exclude=*")
    # str(): torch.__version__ is a TorchVersion, which weights_only loading refuses.
    return {"torch": str(torch.__version__), "python": platform.python_version(), "commit": commit}


class UnsyncedWrite(OSError):
    """The new file replaced the old one, but the rename could not be flushed to disk (an
    fsync of its folder failed): a power cut may still undo it."""


def write_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """`write` into a temporary file, flush it to disk, then rename it over `path`, keeping its
    mode (a file made private stays so): a crash mid-write leaves the old file whole; rename is
    atomic on POSIX. Only where the folder's fsync after the rename fails is the new file in
    place when this raises (UnsyncedWrite). One writer at a time: train.py holds the run
    directory's lock."""
    tmp = path.with_name(path.name + ".tmp")
    made = False
    try:
        # A leftover of a write killed before its rename goes; O_EXCL then makes sure the bytes
        # go into a new file of this folder, not through a link left at that name to another.
        if tmp.is_dir() and not tmp.is_symlink():
            raise IsADirectoryError(errno.EISDIR, "a folder is where it writes first", str(tmp))
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        made = True
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            shutil.copymode(path, tmp)
        os.replace(tmp, path)
        try:  # make the rename itself durable
            directory = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        except OSError as e:
            raise UnsyncedWrite(e.errno, e.strerror or str(e), str(path)) from e
    except OSError as e:
        # A failed write (a full disk) names no file, and a failed rename (onto a folder of
        # that name) names the temporary file first: the error names `path`.
        if e.filename is not None and e.filename2 is None:
            raise
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e
    finally:
        if made:
            tmp.unlink(missing_ok=True)


def first_non_finite(model: torch.nn.Module) -> str | None:
    """The name of the first tensor of `model`'s state holding a NaN or an infinity, or None:
    weights no checkpoint may hold (train.py never saves them; sample.py refuses them)."""
    return next((name for name, t in model.state_dict().items() if not t.isfinite().all()), None)


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write the checkpoint atomically (write_atomically). A write that fails for want of space
    or access is a CheckpointError that says the previous checkpoint is untouched (or, where
    only the flush after the rename failed, that the new one is in place); any other failure
    is raised as it is."""
    try:
        write_atomically(path, lambda f: torch.save(state, f))
    except (OSError, RuntimeError) as e:  # torch.save reports a short write as RuntimeError
        cause = _os_error_behind(e)
        if cause is None:
            raise
        if isinstance(cause, UnsyncedWrite):
            fix = _WRITE_FIXES.get(cause.errno, "check the disk")
            raise CheckpointError(
                f"wrote {path}, but could not flush its folder to disk ({cause.strerror}): the "
                f"new checkpoint is in place, though a power cut may undo it; {fix}, then "
                "continue with --resume"
            ) from e
        where = f": {cause.filename}" if cause.filename not in (None, str(path)) else ""
        raise CheckpointError(
            f"could not write {path} ({cause.strerror or cause}{where}); the checkpoint there "
            "before, if any, is untouched: free space (or fix the folder) and continue with "
            "--resume"
        ) from e


# What a failed write needs, by its errno; other errors get no advice beyond their own words.
_WRITE_FIXES = {
    errno.ENOSPC: "free space",
    errno.EDQUOT: "free space",
    errno.EFBIG: "free space or raise the file-size limit (ulimit -f)",
    errno.EACCES: "fix the folder's permissions",
    errno.EPERM: "fix the folder's permissions",
    errno.EROFS: "write to a filesystem that is not read-only",
}


def describe_os_error(e: OSError) -> tuple[str, str | None]:
    """What went wrong, with the file where known, and what fixes it where the errno says."""
    where = f": {e.filename}" if e.filename else ""
    return f"{e.strerror or e or type(e).__name__}{where}", _WRITE_FIXES.get(e.errno)


def _os_error_behind(error: BaseException) -> OSError | None:
    """The OSError that `error` is or was raised from (an ENOSPC under torch's RuntimeError),
    following __cause__ and shown __context__; None if there is none."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        if current.__cause__ is not None:
            current = current.__cause__
        elif not current.__suppress_context__:
            current = current.__context__
        else:
            current = None
    return None


def no_checkpoint(path: Path) -> CheckpointError:
    if path.is_dir():  # not the file train.py writes, though a new run would call it one
        return CheckpointError(f"{path} is a folder, not a checkpoint; move it aside")
    return CheckpointError(f"no checkpoint at {path} (train first, or check --out)")


def _why_unreadable(path: Path, error: Exception) -> str:
    """In a few words: torch's own text is a bare byte value for some files ('101') and a
    paragraph for others."""
    if path.stat().st_size == 0:
        return "the file is empty"
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive, its index at the end
        return "not a whole zip archive, as torch.save writes (cut short, or another kind of file)"
    first = (str(error).strip().splitlines() or [""])[0]
    first = first if len(first) <= 160 else first[:157] + "..."
    return f"{type(error).__name__}" + (f": {first}" if first else "")


def _cut_short(path: Path) -> bool:
    """A file that can be read but is not a whole zip archive."""
    try:
        with path.open("rb") as f:
            f.read(1)
    except OSError:
        return False
    return not zipfile.is_zipfile(path)


def _failed_checksum(path: Path) -> str | None:
    """The first entry of the archive whose bytes fail their CRC-32, or None. torch.load does
    not check them, so bytes flipped inside a tensor load as other numbers (the check reads
    the file again: a fraction of a second a GB from the page cache). An archive saved without
    checksums (torch.utils.serialization.config.save.compute_crc32 = False) records 0 for
    each: nothing to check."""
    try:
        with zipfile.ZipFile(path) as archive:
            if not any(entry.CRC for entry in archive.infolist() if entry.file_size):
                return None
            return archive.testzip()
    except (zipfile.BadZipFile, OSError):  # torch read it whole: nothing more to tell
        return None


def load_checkpoint(path: Path, needs: tuple[str, ...] = KEYS) -> dict[str, Any]:
    """The checkpoint at `path`, holding at least `needs` (resuming needs all of KEYS)."""
    if not path.is_file():
        raise no_checkpoint(path)
    try:
        # weights_only: a checkpoint is data; never let loading it run code.
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except MemoryError:
        raise
    except OSError as e:  # no permission, a failing disk: the file may be whole
        if e.errno != errno.EINVAL or not _cut_short(path):
            raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
        # torch raises EINVAL for some archives cut short (a few KiB of a larger file)
        raise CheckpointError(
            f"checkpoint {path} is unreadable (truncated or corrupt?): {_why_unreadable(path, e)}"
        ) from None
    except Exception as e:  # truncated zip, wrong format, pickle error: all mean the same
        # weights_only names a pickled class it refused; other failures (a damaged file
        # among them, which it words alike) have no such name.
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if found:
            raise CheckpointError(
                f"checkpoint {path} holds objects other than tensors and plain data "
                f"({found[1]}), so it is not one this project's train.py wrote; it is not "
                "loaded, since loading it could run code"
            ) from None
        raise CheckpointError(
            f"checkpoint {path} is unreadable (truncated or corrupt?): {_why_unreadable(path, e)}"
        ) from None
    damaged = _failed_checksum(path)
    if damaged is not None:
        raise CheckpointError(
            f"checkpoint {path} is damaged: the bytes of its entry {damaged} do not match their "
            "checksum (a disk or copy error), so its weights or state would be wrong; it is not "
            "used: restore it from a copy, or start the run again"
        )
    # A file torch can read may still be another program's (a nanoGPT ckpt.pt, say).
    missing = [k for k in needs if k not in ckpt] if isinstance(ckpt, dict) else list(needs)
    if missing:
        raise CheckpointError(
            f"checkpoint {path} was not written by this project's train.py "
            f"(missing: {', '.join(missing)})"
        )
    # The plain entries are checked here, wherever present (an edited one would fail deep in
    # the resume); the model, optimizer, data and RNG states when they are restored (see
    # `restoring`).
    plain = {
        "step": lambda v: type(v) is int and v >= 0,
        "tokenizer_sha256": lambda v: isinstance(v, str),
        "config": lambda v: (
            _saved_model_config(ckpt) is not None
            and all(isinstance(section, dict) for section in v.values())
        ),
        "written_by": lambda v: isinstance(v, dict),
    }
    for entry, valid in plain.items():
        if isinstance(ckpt, dict) and entry in ckpt and not valid(ckpt[entry]):
            raise _not_ours(path, entry, repr(ckpt[entry])[:60])
    return ckpt


def _saved_model_config(ckpt: dict[str, Any]) -> dict[str, Any] | None:
    """The model section of the config the checkpoint was written with, if it holds one."""
    config = ckpt.get("config")
    model = config.get("model") if isinstance(config, dict) else None
    return model if isinstance(model, dict) else None


def _not_ours(path: Path, entry: str, detail: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path}: its '{entry}' entry is not what train.py writes ({detail})"
    )


# Model fields that hold no weights, so a checkpoint goes on (or samples) under another value:
# every attention variant computes the same function (a run trained with cuDNN's attention on a
# GPU goes on with `sdpa` on a CPU), and dropout's rate is a training choice, as in nanoGPT.
NO_WEIGHTS = ("attention", "dropout")


def model_config_diff(ckpt: dict[str, Any], current: dict[str, Any], now: str = "now") -> str:
    """The model fields whose values differ between the checkpoint and `current`, NO_WEIGHTS
    aside, or '' (also when the checkpoint records no config)."""
    saved = _saved_model_config(ckpt)
    if saved is None:
        return ""
    return "; ".join(
        f"{k}: {saved.get(k)!r} in checkpoint, {v!r} {now}"
        for k, v in current.items()
        if saved.get(k) != v and k not in NO_WEIGHTS
    )


def check_compatible(
    ckpt: dict[str, Any], config: Config, tokenizer_sha256: str, path: Path
) -> None:
    """Resuming needs the same model config (NO_WEIGHTS aside) and the same tokenizer as the
    checkpoint."""
    diff = model_config_diff(ckpt, asdict(config.model))
    if diff:
        raise CheckpointError(
            f"checkpoint {path} was made with another model config: {diff}. Its weights "
            "have that shape: of the model's fields only model.attention and model.dropout "
            "may change on resume; to train these settings, start another run (--out)"
        )
    if ckpt["tokenizer_sha256"] != tokenizer_sha256:
        data = ckpt.get("config", {}).get("data", {})
        trained, root = data.get("name"), data.get("root")
        data_dir = config.data.dir
        try:
            corpus = ckpt["corpus"]
            again = f": {rebuild_command(data_dir, corpus['source'], corpus['settings'])}"
        except (KeyError, TypeError, AttributeError):  # not recorded (older checkpoints)
            again = ", from the source and with the settings the run trained on"
        if isinstance(trained, str) and trained != config.data.name:
            hint = f"; it trained on corpus '{trained}' (--data.name={trained})"
        elif isinstance(root, str) and not same_folder(root, config.data.root):
            hint = (
                f"; it trained on the corpus in {Path(root) / config.data.name} (--data.root="
                f"{root}), or make the run's in {data_dir}{again}"
            )
        else:  # the corpus was prepared again since, with other settings or text
            hint = (
                f"; {data_dir} was prepared again since the run trained on it: to resume, "
                f"prepare it as the run's was made{again}"
            )
        raise CheckpointError(
            f"checkpoint {path} was made with another tokenizer (sha256 "
            f"{ckpt['tokenizer_sha256'][:12]}, corpus '{config.data.name}' has "
            f"{tokenizer_sha256[:12]}){hint}"
        )


def same_folder(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one folder (relative ones from here, ~ expanded)."""
    # realpath, not Path.resolve: that raises on a loop of links (Python 3.11)
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


@contextlib.contextmanager
def restoring(path: Path, entry: str) -> Iterator[None]:
    """Turns a failure to restore `entry` from a checkpoint that loaded into an error naming
    both: not what train.py writes (edited by hand, or another program's)."""
    try:
        yield
    except (CheckpointError, torch.OutOfMemoryError):
        raise  # already says what is wrong; or not the checkpoint's fault
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
        detail = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        raise _not_ours(path, entry, f"{type(e).__name__}: {detail[:300] or 'no detail'}") from None


def rng_states(device: torch.device, world_size: int) -> list[dict[str, Tensor]]:
    """Every rank's RNG state, by rank (a collective under DDP: call it on all ranks)."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    elif device.type == "mps":  # dropout on an Apple GPU draws from the MPS generator
        state["mps"] = torch.mps.get_rng_state()
    if world_size == 1:
        return [state]
    states: list[Any] = [None] * world_size
    dist.all_gather_object(states, state)
    return states


def restore_rng(
    states: list[dict[str, Tensor]] | dict[str, Tensor],
    seed: int,
    step: int,
    device: torch.device,
    rank: int,
    world_size: int,
) -> int | None:
    """This rank's saved RNG state; with another number of ranks than saved, a fresh seed.
    Returns the number of ranks that saved them (None: a checkpoint from before per-rank
    states, which kept rank 0's only, whatever the number)."""
    saved = None if isinstance(states, dict) else len(states)
    if isinstance(states, dict):
        states = [states]
    if len(states) != world_size:
        # Dropout masks then differ from an uninterrupted run; the data does only where the
        # rows per step changed (resume.say_the_batch_changed says which).
        torch.manual_seed(seed + rank + world_size * step)
        return saved
    torch.set_rng_state(states[rank]["torch"])
    if device.type == "cuda" and "cuda" in states[rank]:
        torch.cuda.set_rng_state(states[rank]["cuda"], device)
    elif device.type == "mps" and "mps" in states[rank]:
        torch.mps.set_rng_state(states[rank]["mps"])
    return saved
