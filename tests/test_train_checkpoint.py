"""Checkpoints and run folders: written whole, locked, refused when damaged or foreign, never lost."""

from __future__ import annotations

import errno
import math
import os
import shutil
import stat
import struct
import zipfile
from pathlib import Path
from typing import Any
from unittest.mock import Mock, patch

import pytest
import torch

import sample
import train
from tiny_runs import SHARED_OVERRIDES, STEPS, copy_run, error_of, load_ckpt, run, train_lines
from training import checkpoint, loop, metrics, rundir
from training.config import load_config

# tiny_runs.py's stand-in, for every test here.
pytestmark = pytest.mark.usefixtures("sample_on_the_cpu")


def test_existing_checkpoint_without_resume_is_refused(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = copy_run(base_run, tmp_path / "run")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert run(data_root, out, *SHARED_OVERRIDES) == 2
    err = error_of(capsys.readouterr().err)
    assert str(out) in err and "--resume" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize(
    "damage", ["truncated", "cut to 5000 bytes", "garbage", "empty", "flipped byte"]
)
def test_unreadable_checkpoint_on_resume_is_an_error(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    out = copy_run(base_run, tmp_path / "run")
    ckpt = out / checkpoint.CHECKPOINT
    whole = ckpt.read_bytes()
    # torch stores data.pkl uncompressed: the byte after its PROTO opcode becomes one that
    # pickle does not know (weights_only's unpickler says "Weights only load failed" for it).
    flipped = bytearray(whole)
    flipped[whole.index(b"\x80\x02", whole.index(b"data.pkl")) + 2] = 0xFF
    broken = {
        "truncated": whole[: len(whole) // 2],
        "cut to 5000 bytes": whole[:5000],  # where torch raises OSError(EINVAL) instead
        "garbage": b"not a checkpoint" * 64,
        "empty": b"",
        "flipped byte": bytes(flipped),
    }
    ckpt.write_bytes(broken[damage])
    assert run(data_root, out, *SHARED_OVERRIDES, "--resume") == 2
    err = error_of(capsys.readouterr().err)
    reason = {
        "truncated": "not a whole zip archive, as torch.save writes",
        "cut to 5000 bytes": "not a whole zip archive, as torch.save writes",
        "garbage": "not a whole zip archive, as torch.save writes",
        "empty": "the file is empty",
        "flipped byte": "UnpicklingError: Weights only load failed",
    }[damage]
    assert f"{ckpt} is unreadable (truncated or corrupt?): {reason}" in err
    assert len(err) < 400, "a reason in a few words, not torch's paragraph"
    assert ckpt.read_bytes() == broken[damage]
    # Without config.toml the checkpoint's record would be the config: the same error.
    (out / "config.toml").unlink()
    assert train.main(["--out", str(out), "--resume"]) == 2
    assert f"{ckpt} is unreadable" in error_of(capsys.readouterr().err)


def test_a_checkpoint_with_flipped_tensor_bytes_is_refused(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """torch.load reads flipped bytes inside a tensor as other numbers; the archive's CRC-32
    finds them, so neither resume (which would save over it) nor sample.py uses them."""
    out = copy_run(base_run, tmp_path / "run")
    ckpt = out / checkpoint.CHECKPOINT
    with zipfile.ZipFile(ckpt) as archive:
        entry = max(archive.infolist(), key=lambda info: info.file_size)  # a weight's bytes
    damaged = bytearray(ckpt.read_bytes())
    header = entry.header_offset
    name_len, extra_len = struct.unpack("<HH", damaged[header + 26 : header + 30])
    start = header + 30 + name_len + extra_len
    damaged[start : start + 8] = bytes(b ^ 0xFF for b in damaged[start : start + 8])
    ckpt.write_bytes(damaged)
    assert torch.load(ckpt, weights_only=True)["step"] == STEPS, "torch itself reads it"
    assert run(data_root, out, *SHARED_OVERRIDES, "--resume") == 2
    said = f"{ckpt} is damaged: the bytes of its entry {entry.filename} do not match"
    assert said in error_of(capsys.readouterr().err)
    assert ckpt.read_bytes() == damaged
    assert sample.main(["--run", str(out), "--tokens", "2"]) == 2
    assert said in capsys.readouterr().err
    # One saved without checksums (torch's compute_crc32 = False) records 0 for each: loaded
    saved = torch.load(copy_run(base_run, tmp_path / "whole") / checkpoint.CHECKPOINT)
    serialization = torch.utils.serialization.config.save
    with patch.object(serialization, "compute_crc32", False):
        torch.save(saved, ckpt)
    with zipfile.ZipFile(ckpt) as archive:
        assert {info.CRC for info in archive.infolist()} == {0}
    assert checkpoint.load_checkpoint(ckpt)["step"] == STEPS


def test_a_checkpoint_that_cannot_be_read_is_not_called_corrupt(
    base_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No permission, a failing disk: the file may be whole, and the error says what failed."""
    denied = PermissionError(errno.EACCES, "Permission denied", str(base_run / "ckpt.pt"))
    monkeypatch.setattr(checkpoint.torch, "load", Mock(side_effect=denied))
    with pytest.raises(checkpoint.CheckpointError) as raised:
        checkpoint.load_checkpoint(base_run / checkpoint.CHECKPOINT)
    path = base_run / checkpoint.CHECKPOINT
    assert str(raised.value) == f"cannot read checkpoint {path}: Permission denied"
    # A failing disk can leave zipfile unable to read the file's end too: still a read error
    failing = OSError(errno.EIO, "Input/output error", str(path))
    monkeypatch.setattr(checkpoint.torch, "load", Mock(side_effect=failing))
    monkeypatch.setattr(checkpoint.zipfile, "is_zipfile", Mock(return_value=False))
    with pytest.raises(checkpoint.CheckpointError) as raised:
        checkpoint.load_checkpoint(path)
    assert str(raised.value) == f"cannot read checkpoint {path}: Input/output error"


@pytest.mark.parametrize("foreign", ["nanogpt", "tensor"])
def test_checkpoint_from_another_program_is_an_error_for_resume_and_sample(
    base_run: Path,
    data_root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    foreign: str,
) -> None:
    """torch reads it fine (weights_only), but it is not ours: say so, change nothing."""
    out = copy_run(base_run, tmp_path / "run")
    ckpt = out / checkpoint.CHECKPOINT
    torch.save({"model": {}, "iter_num": 3} if foreign == "nanogpt" else torch.zeros(3), ckpt)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert run(data_root, out, *SHARED_OVERRIDES, "--resume") == 2
    err = error_of(capsys.readouterr().err)
    assert str(ckpt) in err and "not written by this project" in err
    # Sampling needs only the weights: a 'model' entry of another shape is named as such.
    assert sample.main(["--run", str(out)]) == 2
    err = error_of(capsys.readouterr().err)
    expect = (
        "'model' entry is not what train.py writes" if foreign == "nanogpt" else "not written by"
    )
    assert str(ckpt) in err and expect in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_checkpoint_holding_objects_is_refused_not_loaded(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """weights_only refuses a pickled object: say what it was, without torch's page of advice."""
    out = copy_run(base_run, tmp_path / "run")
    ckpt = out / checkpoint.CHECKPOINT
    torch.save({"model": {}, "out_dir": Path("runs/x")}, ckpt)
    assert run(data_root, out, *SHARED_OVERRIDES, "--resume") == 2
    err = error_of(capsys.readouterr().err)
    assert str(ckpt) in err and "objects other than tensors and plain data" in err
    assert "pathlib" in err and "corrupt" not in err and "\x1b" not in err


def test_sample_with_another_tokenizer_json_is_an_error(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another corpus's tokenizer decodes the same ids into other text, without complaint."""
    out = copy_run(base_run, tmp_path / "run")
    shutil.copyfile(data_root / "other" / "tokenizer.json", out / "tokenizer.json")
    assert sample.main(["--run", str(out)]) == 2
    err = error_of(capsys.readouterr().err)
    assert f"{out / 'tokenizer.json'} is not the tokenizer" in err


@pytest.mark.parametrize("damage", ["NaN weights", "unreadable tokenizer", "sha256 not a string"])
def test_sample_from_a_damaged_run_is_an_error_naming_the_file(
    base_run: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    damage: str,
) -> None:
    out = copy_run(base_run, tmp_path / "run")
    ckpt = torch.load(out / checkpoint.CHECKPOINT, weights_only=True)
    match damage:
        case "NaN weights":
            ckpt["model"]["lm_head.weight"][0, 0] = math.nan
            named = f"{out / 'ckpt.pt'} holds NaN or infinite weights, in "
        case "unreadable tokenizer":  # as chmod 000 would, which root is not held to
            denied = PermissionError(errno.EACCES, "Permission denied")
            monkeypatch.setattr(sample, "file_sha256", Mock(side_effect=denied))
            named = f"cannot read {out / 'tokenizer.json'} (Permission denied)"
        case "sha256 not a string":
            ckpt["tokenizer_sha256"] = 7
            named = "its 'tokenizer_sha256' entry is not what train.py writes (7)"
    torch.save(ckpt, out / checkpoint.CHECKPOINT)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sample.main(["--run", str(out), "--tokens", "3"]) == 2
    assert named in error_of(capsys.readouterr().err)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_resume_from_nan_weights_is_an_error_naming_them(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a step trained on them and then 'loss is nan; the last good one is ckpt.pt'."""
    out = copy_run(base_run, tmp_path / "run")
    ckpt = torch.load(out / checkpoint.CHECKPOINT, weights_only=True)
    ckpt["model"]["lm_head.weight"][0, 0] = math.inf
    torch.save(ckpt, out / checkpoint.CHECKPOINT)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert run(data_root, out, f"--train.max_steps={STEPS + 2}", "--resume") == 2
    err = error_of(capsys.readouterr().err)
    # lm_head's weight is wte's (tied), which the state lists first
    assert f"{out / 'ckpt.pt'} holds NaN or infinite weights, in wte.weight" in err
    assert "nothing to resume" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # The same for AdamW's moments
    ckpt["model"]["lm_head.weight"][0, 0] = 0.0
    next(iter(ckpt["optimizer"]["state"].values()))["exp_avg_sq"][0] = math.nan
    torch.save(ckpt, out / checkpoint.CHECKPOINT)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert run(data_root, out, f"--train.max_steps={STEPS + 2}", "--resume") == 2
    err = error_of(capsys.readouterr().err)
    assert "NaN or infinite optimizer state" in err and "optimizer" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize(("edit", "named"), [("n_layer = 3", "n_layer"), ("n_head = 1", "n_head")])
def test_sample_with_a_config_toml_edited_after_training_is_an_error(
    base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: str, named: str
) -> None:
    """n_head = 1 still fits the weights, but computes another function."""
    out = copy_run(base_run, tmp_path / "run")
    toml = out / "config.toml"
    field = edit.split(" =")[0]
    text = toml.read_text()
    edited = "\n".join(
        edit if line.startswith(f"{field} =") else line for line in text.splitlines()
    )
    assert edited != text
    toml.write_text(edited + "\n")
    assert sample.main(["--run", str(out)]) == 2
    err = error_of(capsys.readouterr().err)
    assert "does not match" in err and f"{named}: " in err and "in config.toml" in err


def test_sample_takes_a_config_toml_whose_attention_differs_from_the_checkpoints(
    base_run: Path, tmp_path: Path
) -> None:
    """A resume that changed the variant and stopped before its first save leaves them so."""
    out = copy_run(base_run, tmp_path / "run")
    toml = out / "config.toml"
    toml.write_text(toml.read_text().replace('attention = "naive"', 'attention = "sdpa"'))
    assert load_config(toml).model.attention == "sdpa"
    assert sample.main(["--run", str(out), "--tokens", "4"]) == 0


@pytest.mark.parametrize(
    "damage",
    [
        "model",
        "optimizer",
        "optimizer.state",
        "optimizer.exp_avg",
        "data",
        "rng",
        "step",
        "tokenizer_sha256",
        "config.model",
        "config.train",
        "written_by",
    ],
)
def test_checkpoint_with_our_keys_but_other_contents_is_an_error(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    """Edited by hand, say: an error naming the checkpoint, not a traceback; nothing changes."""
    out = copy_run(base_run, tmp_path / "run")
    ckpt = load_ckpt(out)
    if damage == "step":
        ckpt["step"] = "5"
    elif damage == "config.model":
        ckpt["config"]["model"] = None
    elif damage == "config.train":
        ckpt["config"]["train"] = [1]
    elif damage == "written_by":
        ckpt["written_by"] = "x"
    elif damage == "tokenizer_sha256":
        ckpt["tokenizer_sha256"] = None
    elif damage == "optimizer.state":  # loads, but would restart AdamW's moments
        ckpt["optimizer"]["state"] = {}
    elif damage == "optimizer.exp_avg":  # loads, then fails in the first step
        del ckpt["optimizer"]["state"][0]["exp_avg"]
    else:
        ckpt[damage] = {}
    torch.save(ckpt, out / checkpoint.CHECKPOINT)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert run(data_root, out, f"--train.max_steps={STEPS + 1}", "--resume") == 2
    err = error_of(capsys.readouterr().err)
    assert str(out / checkpoint.CHECKPOINT) in err and damage.split(".")[0] in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_save_rewords_only_a_failed_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk under torch's RuntimeError is a CheckpointError naming it; any other error
    (a CUDA fault, say) is raised as it is, even one whose chain loops on itself."""
    path = tmp_path / "ckpt.pt"

    def full_disk(obj: Any, f: Any) -> None:
        try:
            raise OSError(28, "No space left on device")
        except OSError as e:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from e

    def cuda_fault(obj: Any, f: Any) -> None:
        error = RuntimeError("CUDA error: an illegal memory access was encountered")
        error.__cause__ = error
        raise error

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(
        checkpoint.CheckpointError, match=r"could not write .*\(No space left on device\)"
    ):
        checkpoint.save_checkpoint(path, {})
    monkeypatch.setattr(torch, "save", cuda_fault)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        checkpoint.save_checkpoint(path, {})
    assert not list(tmp_path.iterdir()), "no file left behind"


def test_a_rewritten_file_keeps_its_mode(tmp_path: Path) -> None:
    """A checkpoint or config.toml made private stays private when the next save replaces it
    (the new file is a temporary one renamed over it)."""
    path = tmp_path / "ckpt.pt"
    checkpoint.write_atomically(path, lambda f: f.write(b"one"))
    path.chmod(0o600)
    checkpoint.write_atomically(path, lambda f: f.write(b"two"))
    assert path.read_bytes() == b"two"
    assert path.stat().st_mode & 0o777 == 0o600

    def full_disk(f: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")  # a write names no file

    with pytest.raises(OSError) as raised:
        checkpoint.write_atomically(path, full_disk)
    assert raised.value.filename == str(path), "the error names the file it was writing"
    assert path.read_bytes() == b"two" and not list(tmp_path.glob("*.tmp"))
    # A folder where the file goes: named, not the temporary file renamed onto it
    folder = tmp_path / "config.toml"
    folder.mkdir()
    with pytest.raises(IsADirectoryError) as raised:
        checkpoint.write_atomically(folder, lambda f: f.write(b"x"))
    assert raised.value.filename == str(folder) and not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("name", ["config.toml", "metrics.jsonl.tmp", "ckpt.pt.tmp"])
def test_a_folder_where_the_run_writes_a_file_is_named_before_it_trains(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture, name: str
) -> None:
    """Found at the first save, it would cost the training before it; and config.toml there is
    not 'missing'."""
    out = tmp_path / "run"
    assert run(data_root, out, "--train.max_steps=2") == 0
    saved = (out / checkpoint.CHECKPOINT).read_bytes()
    (out / name).unlink(missing_ok=True)
    (out / name).mkdir()
    capsys.readouterr()
    assert run(data_root, out, "--train.max_steps=4", "--resume") == 2
    err = capsys.readouterr().err
    assert f"{out / name} is a folder, where the run writes a file" in error_of(err)
    assert "missing" not in err
    assert (out / checkpoint.CHECKPOINT).read_bytes() == saved


def test_a_leftover_at_the_temporary_name_is_replaced_not_written_through(
    tmp_path: Path,
) -> None:
    """A write killed before its rename leaves ckpt.pt.tmp: the next write replaces it. A link
    left at that name is replaced too, its target untouched; a folder there is named."""
    path = tmp_path / "ckpt.pt"
    (tmp_path / "ckpt.pt.tmp").write_bytes(b"half")
    checkpoint.write_atomically(path, lambda f: f.write(b"one"))
    assert path.read_bytes() == b"one" and not list(tmp_path.glob("*.tmp"))
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_bytes(b"precious")
    (tmp_path / "ckpt.pt.tmp").symlink_to(elsewhere)
    checkpoint.write_atomically(path, lambda f: f.write(b"two"))
    assert elsewhere.read_bytes() == b"precious"
    assert path.read_bytes() == b"two" and not path.is_symlink()
    (tmp_path / "ckpt.pt.tmp").mkdir()
    with pytest.raises(checkpoint.CheckpointError, match=r"ckpt\.pt\.tmp"):
        checkpoint.save_checkpoint(path, {})
    assert path.read_bytes() == b"two" and (tmp_path / "ckpt.pt.tmp").is_dir()


def test_a_second_process_on_a_run_in_progress_is_refused(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A --resume (or a second new run) into a directory another process is training in would
    interleave metrics.jsonl and overwrite ckpt.pt in turns: refused, nothing written."""
    out = tmp_path / "run"
    out.mkdir()
    one_step = ["--train.max_steps=1", "--train.eval_interval=0", "--train.eval_batches=1"]
    with rundir.run_lock(out):  # the other process (flock conflicts across open files)
        capsys.readouterr()
        assert run(data_root, out, *one_step) == 2
        err = error_of(capsys.readouterr().err)
        assert f"another process (pid {os.getpid()}) is training in {out}" in err
        assert sorted(p.name for p in out.iterdir()) == [".lock"], "nothing written"
    assert run(data_root, out, *one_step) == 0, "released when that run ends"
    # A --resume is refused before it reads the checkpoint the run going on will replace.
    read = []
    monkeypatch.setattr(rundir, "load_checkpoint", lambda *a, **k: read.append(a))
    with rundir.run_lock(out):
        assert run(data_root, out, "--train.max_steps=2", *one_step[1:], "--resume") == 2
    assert "another process" in capsys.readouterr().err and not read
    monkeypatch.undo()
    assert run(data_root, out, "--train.max_steps=2", *one_step[1:], "--resume") == 0
    assert load_ckpt(out)["step"] == 2


def test_resume_refuses_settings_read_before_another_resume_rewrote_them(
    base_run: Path, tmp_path: Path
) -> None:
    """main reads config.toml before the run's lock is taken: if another process resumed the
    run with other settings in between, this one's would undo them."""
    out = copy_run(base_run, tmp_path / "run")
    read = (out / "config.toml").read_bytes()
    config = load_config(out / "config.toml", [f"--train.max_steps={STEPS + 1}"])
    (out / "config.toml").write_bytes(read.replace(b"lr = ", b"lr =  "))  # the other's write
    with pytest.raises(loop.TrainError, match=r"config\.toml changed while this process waited"):
        train.train(config, out, resume=True, config_read=read)
    assert load_ckpt(out)["step"] == STEPS, "nothing resumed"
    assert train.train(config, out, resume=True, config_read=None).step == STEPS + 1


def test_a_refused_run_leaves_no_lock_or_directory_behind(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The run directory is made and locked before anything is read; a run refused before its
    first write takes both back."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert run(data_root, mine, "--resume") == 2  # no checkpoint there
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert run(data_root, tmp_path / "new" / "run", "--model.attention=sdpa-cudnn") == 2
    assert not (tmp_path / "new").exists(), "nor the folders made on the way"
    assert "cannot run on cpu" in capsys.readouterr().err


def test_a_run_dir_that_cannot_be_locked_trains_with_a_warning(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """NFS mounted nolock, some FUSE filesystems: flock fails with ENOLCK."""

    def no_locks(*args: Any) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(rundir.fcntl, "flock", no_locks)
    one_step = ["--train.max_steps=1", "--train.eval_interval=0", "--train.eval_batches=1"]
    assert run(data_root, tmp_path / "run", *one_step) == 0
    assert "warning: cannot lock" in capsys.readouterr().err


def test_interrupted_save_leaves_the_previous_checkpoint_whole(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    ckpt = out / checkpoint.CHECKPOINT
    real_save = torch.save
    saves: list[bytes] = []

    def save_that_dies_on_the_second_call(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if saves:  # the second save: half a file, then the disk "fills up"
            saves.append(ckpt.read_bytes())
            f.write(b"PK\x03\x04 half a zip")
            raise OSError(28, "No space left on device")
        real_save(obj, f, *args, **kwargs)
        saves.append(b"")

    monkeypatch.setattr(torch, "save", save_that_dies_on_the_second_call)
    capsys.readouterr()
    assert run(data_root, out, "--train.max_steps=4", "--train.eval_interval=2") == 2
    monkeypatch.undo()
    err = error_of(capsys.readouterr().err)
    assert f"could not write {ckpt} (No space left on device)" in err
    assert "untouched" in err and "--resume" in err

    assert len(saves) == 2
    assert ckpt.read_bytes() == saves[1], "the checkpoint changed during the failed save"
    assert sorted(p.name for p in out.iterdir() if ".tmp" in p.name) == [], "a half-written file"
    assert load_ckpt(out)["step"] == 2
    # Resuming reads ckpt.pt, not the half-written temporary: it continues from step 2.
    assert run(data_root, out, "--train.max_steps=4", "--train.eval_interval=2", "--resume") == 0
    assert load_ckpt(out)["step"] == 4
    assert [r["step"] for r in train_lines(out)] == [1, 2, 3, 4]


def test_a_log_that_cannot_be_written_is_an_error_naming_it(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A full disk while logging a line: the error names metrics.jsonl, the checkpoint stays."""
    out = tmp_path / "run"
    assert run(data_root, out, "--train.max_steps=2", "--train.eval_interval=2") == 0
    saved = (out / checkpoint.CHECKPOINT).read_bytes()
    real_open = open

    def full_disk(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real_open(path, mode, *args, **kwargs)
        if "a" in mode:
            f.write = Mock(side_effect=OSError(27, "File too large"))
        return f

    monkeypatch.setattr(metrics, "open", full_disk, raising=False)
    capsys.readouterr()
    assert run(data_root, out, "--train.max_steps=4", "--train.eval_interval=2", "--resume") == 2
    err = error_of(capsys.readouterr().err)
    assert (
        f"File too large: {out / 'metrics.jsonl'}; the last checkpoint saved, if any, is whole"
        in err
    )
    assert f"raise the file-size limit (ulimit -f), then continue with --resume --out {out}" in err
    assert (out / checkpoint.CHECKPOINT).read_bytes() == saved


def test_a_flush_that_fails_after_the_rename_says_the_new_checkpoint_is_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the folder's fsync failing: the old checkpoint is gone, so the error must not call
    it untouched."""
    path = tmp_path / "ckpt.pt"
    checkpoint.save_checkpoint(path, {"step": 1})
    real_fsync = os.fsync

    def folder_fsync_fails(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(checkpoint.os, "fsync", folder_fsync_fails)
    with pytest.raises(checkpoint.CheckpointError) as raised:
        checkpoint.save_checkpoint(path, {"step": 2})
    said = str(raised.value)
    assert said.startswith(f"wrote {path}, but could not flush its folder to disk (Input/output")
    assert "untouched" not in said and "the new checkpoint is in place" in said
    assert torch.load(path)["step"] == 2 and not list(tmp_path.glob("*.tmp"))
