"""The trainer end to end on a tiny corpus built by the real pipeline (data/prepare.py).

Runs go through `train.main` in-process; only SIGTERM and torchrun need a subprocess.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import io
import itertools
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import sysconfig
import time
import timeit
import weakref
import zipfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any
from unittest.mock import Mock, patch

import numpy as np
import pytest
import torch
import torch.nn.utils.clip_grad as clip_grad
from tokenizers import Tokenizer

import checkpoint
import loop
import metrics
import optim
import resume
import rundir
import runtime
import sample
import step
import train
from config import TrainConfig, dump_toml, load_config
from cpu_linear import onednn_unavailable_reason, wants_onednn
from data import meta as data_meta
from data.loader import TokenBatches
from data.prepare import EOT, EOT_ID, prepare, split_documents
from model import GPT, VARIANTS
from probe import unavailable_reason
from streams import FullDisk, ReaderTakesLines

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
STEPS = 30  # of the shared run: enough for the loss to fall clearly
HEAD_SIZE = 16  # tiny.toml: n_embd 32 / n_head 2
# As the registry has them (tests/test_model.py checks that each runs where it says)
CPU_VARIANTS = [name for name, v in VARIANTS.items() if not v.cuda_only_reason]
CUDA_ONLY = [name for name in VARIANTS if name not in CPU_VARIANTS]
TRAIN_KEYS = {"step", "loss", "lr", "ms_per_step", "tokens_per_s", "tflops", "grad_norm"}
EVAL_KEYS = {"step", "val_loss", "val_bpb", "train_loss"}


# --- corpora and runs -----------------------------------------------------------------------------


def stdlib_documents(folder: Path, count: int = 40) -> list[str]:
    """Copies of `count` mid-sized stdlib modules: real Python text, ~300 KB in all."""
    source = Path(sysconfig.get_paths()["stdlib"])
    picked = sorted(p for p in source.glob("*.py") if 2_000 < p.stat().st_size < 20_000)[:count]
    assert len(picked) >= 2
    folder.mkdir(parents=True)
    for path in picked:
        shutil.copyfile(path, folder / path.name)
    return [str(folder / "*.py")]


@pytest.fixture(autouse=True)
def sample_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling's --device auto picks the CPU here, on a GPU machine too, as tiny.toml's
    training does: the expected texts are the CPU's, in fp32 (a GPU samples in bf16)."""
    real = sample.pick_device
    monkeypatch.setattr(
        sample,
        "pick_device",
        lambda name, setting: real("cpu" if name == "auto" else name, setting),
    )


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """<root>/tiny: the main corpus (vocab 512); <root>/other: same text, another tokenizer."""
    tmp = tmp_path_factory.mktemp("corpora")
    files = stdlib_documents(tmp / "docs")
    prepare("tiny", files=files, vocab_size=512, out_root=tmp / "root")
    prepare("other", files=files, vocab_size=400, out_root=tmp / "root")
    return tmp / "root"


def meta(data_root: Path, name: str = "tiny") -> dict[str, Any]:
    return json.loads((data_root / name / "meta.json").read_text())


def run_argv(data_root: Path, out: Path, *overrides: str) -> list[str]:
    return ["--config", str(TINY), f"--data.root={data_root}", "--out", str(out), *overrides]


def run(data_root: Path, out: Path, *overrides: str) -> int:
    return train.main(run_argv(data_root, out, *overrides))


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_lines(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir) if "loss" in r]


def eval_lines(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir) if "val_loss" in r]


def error_of(err: str) -> str:
    """The `error: ...` message train.py printed (a progress bar may precede it on stderr)."""
    assert "error: " in err, err
    assert "Traceback" not in err, err
    return err.split("error: ", 1)[1]


def load_ckpt(run_dir: Path) -> dict[str, Any]:
    return torch.load(run_dir / checkpoint.CHECKPOINT, map_location="cpu", weights_only=True)


def misbehave_at(
    monkeypatch: pytest.MonkeyPatch,
    call: int,
    before: Callable[[], None] | None = None,
    loss: float | None = None,
    grad_norm: float | None = None,
    spoil_weights: bool = False,
) -> list[int]:
    """Replace the loop's train_step with the real step that, at its `call`-th call, first runs
    `before` (raise, send a signal), then the step, and returns `loss` and/or `grad_norm`
    instead of its own, or makes a weight NaN after it (as non-finite gradients would, the
    loss, computed before the update, still finite). Returns the list of calls."""
    real_step = loop.train_step
    calls: list[int] = []

    def patched(model: torch.nn.Module, *args: Any, **kwargs: Any) -> step.StepResult:
        calls.append(1)
        if len(calls) != call:
            return real_step(model, *args, **kwargs)
        if before is not None:
            before()
        real = real_step(model, *args, **kwargs)
        if spoil_weights:
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = math.nan
        if loss is not None:
            real = real._replace(loss=torch.tensor(loss))
        if grad_norm is not None:
            real = real._replace(grad_norm=torch.tensor(grad_norm))
        return real

    monkeypatch.setattr(loop, "train_step", patched)
    return calls


def copy_run(run_dir: Path, to: Path) -> Path:
    """Tests that poke at a run work on a copy, so a bug cannot spoil the shared run."""
    return Path(shutil.copytree(run_dir, to))


def copy_run_trained_with(run_dir: Path, to: Path, section: str, key: str, value: str) -> Path:
    """A copy of a run whose checkpoint and config.toml both say it was trained with
    section.key = value (a run from another machine, say)."""
    out = copy_run(run_dir, to)
    ckpt = load_ckpt(out)
    was = ckpt["config"][section][key]
    ckpt["config"][section][key] = value
    torch.save(ckpt, out / checkpoint.CHECKPOINT)
    toml = out / "config.toml"
    text = toml.read_text()
    assert text.count(f'{key} = "{was}"') == 1, f"{key} is not a single string in {toml}"
    toml.write_text(text.replace(f'{key} = "{was}"', f'{key} = "{value}"'))
    return out


SHARED_OVERRIDES = (f"--train.max_steps={STEPS}",)


@pytest.fixture(scope="module")
def base_run(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted tiny run (log_interval 1, eval every 10 steps); read-only for tests."""
    out = tmp_path_factory.mktemp("runs") / "base"
    assert run(data_root, out, *SHARED_OVERRIDES) == 0
    return out


# --- a run end to end -----------------------------------------------------------------------------


def test_run_writes_checkpoint_config_tokenizer_and_metrics(
    base_run: Path, data_root: Path
) -> None:
    for name in ("ckpt.pt", "config.toml", "tokenizer.json", "metrics.jsonl"):
        assert (base_run / name).is_file(), name
    assert (base_run / "tokenizer.json").read_bytes() == (
        data_root / "tiny" / "tokenizer.json"
    ).read_bytes()


def test_config_toml_is_the_effective_config(base_run: Path, data_root: Path) -> None:
    expected = load_config(TINY, [f"--data.root={data_root}", *SHARED_OVERRIDES])
    saved = load_config(base_run / "config.toml")
    assert saved == expected
    assert saved.train.max_steps == STEPS  # the CLI override, not tiny.toml's value


def test_metrics_log_every_step_and_every_eval(base_run: Path, data_root: Path) -> None:
    lines = train_lines(base_run)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    for r in lines:
        # The allocator's peak is logged on CUDA only; tiny.toml trains on the CPU.
        assert "peak_mem_mib" not in r
        assert set(r) - {"peak_mem_mib"} == TRAIN_KEYS
        assert all(math.isfinite(r[k]) for k in TRAIN_KEYS)
        assert r["ms_per_step"] > 0 and r["tokens_per_s"] > 0 and r["lr"] > 0
        assert r["grad_norm"] > 0  # before clipping: it may exceed train.grad_clip
        flops_per_token = GPT(load_config(base_run / "config.toml").model).flops_per_token()
        assert r["tflops"] == pytest.approx(flops_per_token * r["tokens_per_s"] / 1e12)
    assert lines[0]["lr"] < lines[4]["lr"]  # warmup
    evals = eval_lines(base_run)
    assert [r["step"] for r in evals] == [0, 10, 20, 30]  # 0: before training, as nanoGPT
    vocab_size = load_config(base_run / "config.toml").model.vocab_size
    assert evals[0]["val_loss"] == pytest.approx(math.log(vocab_size), rel=0.05)  # untrained
    splits = meta(data_root)["splits"]["val"]
    for r in evals:
        assert set(r) == EVAL_KEYS
        bits_per_byte = r["val_loss"] * splits["tokens"] / splits["bytes"] / math.log(2)
        assert r["val_bpb"] == pytest.approx(bits_per_byte)
        assert math.isfinite(r["train_loss"]) and r["train_loss"] != r["val_loss"]
    assert evals[-1]["train_loss"] < evals[0]["train_loss"]
    assert len(read_metrics(base_run)) == len(lines) + len(evals)  # nothing else in the file


def job_tokens_per_s(run_dir: Path, line: dict, world_size: int = 1) -> float:
    """The tokens every rank's micro-batches held in a step, over the step's logged time."""
    config = load_config(run_dir / "config.toml")
    tc, block_size = config.train, config.model.block_size
    tokens = tc.batch_size * tc.micro_batches(world_size) * world_size * block_size
    return tokens / (line["ms_per_step"] / 1e3)


def test_mfu_against_a_given_peak_and_no_norm_without_clipping(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--train.max_steps=2", "--train.log_interval=1", "--train.grad_clip=0"]
    assert run(data_root, tmp_path / "r", *argv, "--train.peak_tflops=0.5") == 0
    for r in train_lines(tmp_path / "r"):
        assert "grad_norm" not in r  # clip_grad_norm_ is what computes it
        assert r["tokens_per_s"] == pytest.approx(job_tokens_per_s(tmp_path / "r", r))
        assert r["mfu"] == pytest.approx(r["tflops"] / 0.5)
    # Accumulated micro-batches are the step's tokens too.
    assert run(data_root, tmp_path / "acc", *argv, "--train.grad_accum=2") == 0
    for r in train_lines(tmp_path / "acc"):
        assert r["tokens_per_s"] == pytest.approx(job_tokens_per_s(tmp_path / "acc", r))
        assert load_config(tmp_path / "acc" / "config.toml").train.grad_accum == 2
    assert "above 1" not in capsys.readouterr().err
    # A peak below what the run reaches (a typo, or a peak for another dtype) is pointed out once.
    assert run(data_root, tmp_path / "s", *argv, "--train.peak_tflops=1e-9") == 0
    assert capsys.readouterr().err.count("warning: MFU") == 1


def test_loss_falls(base_run: Path) -> None:
    losses = [r["loss"] for r in train_lines(base_run)]
    assert losses[0] == pytest.approx(math.log(512), abs=0.5)  # an untrained model guesses
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2
    evals = [r["val_loss"] for r in eval_lines(base_run)]
    assert evals == sorted(evals, reverse=True)


def test_checkpoint_holds_the_run_state_and_loads_weights_only(
    base_run: Path, data_root: Path
) -> None:
    ckpt = load_ckpt(base_run)
    assert {"model", "optimizer", "step", "rng", "data", "config", "tokenizer_sha256"} <= set(ckpt)
    assert ckpt["step"] == STEPS
    assert ckpt["tokenizer_sha256"] == meta(data_root)["tokenizer_sha256"]
    config = load_config(base_run / "config.toml")
    assert ckpt["config"] == asdict(config)
    model = GPT(config.model)
    model.load_state_dict(ckpt["model"])  # strict: every parameter, nothing extra
    assert all(torch.isfinite(p).all() for p in ckpt["model"].values())
    assert ckpt["optimizer"]["state"], "the optimizer's moments are saved"
    assert [type(state["torch"]) for state in ckpt["rng"]] == [torch.Tensor]  # one per rank
    assert isinstance(ckpt["data"]["generator"], torch.Tensor)
    written_by = ckpt["written_by"]
    assert written_by["torch"] == torch.__version__
    assert written_by["python"] == platform.python_version()
    assert written_by["device"] == "cpu"
    cpu_linear = load_config(base_run / "config.toml").train.cpu_linear
    onednn = wants_onednn(cpu_linear, torch.device("cpu"), autocast=False)
    assert written_by["linear"] == ("onednn" if onednn else "torch")
    assert written_by["precision"] == "float32"
    if (ROOT / ".git").exists() and shutil.which("git"):  # a checkout: the commit it is at
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        assert written_by["commit"] and head.stdout.startswith(written_by["commit"][:12])


def test_readout_gain_script_times_both_modes(
    data_root: Path,
    run_script: Callable[..., tuple[int, str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """scripts/readout_gain.py runs train.py's loop in each mode and prints only its table on
    stdout (train.py's own lines go to stderr); a reader that goes ends it quietly."""
    argv = [sys.executable, str(ROOT / "scripts" / "readout_gain.py"), "--config", str(TINY)]
    argv += ["--steps", "6", "--skip", "2", "--rounds", "1", f"--data.root={data_root}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    head, *modes = done.stdout.splitlines()
    assert head.startswith(f"config {TINY} --data.root=") and "steps 3..5, median of 1 runs" in head
    assert [m.split()[0] for m in modes] == ["lagged", "read"]
    assert all(float(m.split()[-3]) > 0 for m in modes), modes  # the median ms per step
    # Bad input: train.py's status (2, a user error) and its one-line reason, or the flag's
    monkeypatch.setattr(loop, "StepReadout", loop.StepReadout)  # the script sets its own
    for bad, named in [(["--rounds", "0"], "--rounds=0: must be >= 1"), ([], "nowhere.toml")]:
        argv[3] = str(TINY) if bad else "nowhere.toml"
        status, _, err = run_script("readout_gain", *argv[2:], *bad)
        assert status == 2 and named in err and "Traceback" not in err
    # `| head -1`: the table's first line, then the shell's status for SIGPIPE, no traceback
    argv[3] = str(TINY)
    head = ReaderTakesLines(1, BrokenPipeError(errno.EPIPE, "Broken pipe"))
    monkeypatch.setattr(sys, "stdout", head)
    status, _, err = run_script("readout_gain", *argv[2:], "--steps", "4", "--skip", "1")
    assert status == 128 + signal.SIGPIPE and "Traceback" not in err, err
    assert head.getvalue().startswith(f"config {TINY} --data.root=")


# --- resume -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dropout", ["0.0", "0.1"])  # with dropout, the torch RNG state matters
def test_resume_reproduces_the_uninterrupted_run_exactly(
    base_run: Path,
    data_root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    dropout: str,
) -> None:
    overrides = (*SHARED_OVERRIDES, f"--model.dropout={dropout}")
    whole = base_run
    if dropout != "0.0":
        whole = tmp_path / "whole"
        assert run(data_root, whole, *overrides) == 0
    split = tmp_path / "split"
    capsys.readouterr()
    assert run(data_root, split, *overrides, "--stop-after", "7") == 0
    assert load_ckpt(split)["step"] == 7
    err = capsys.readouterr().err
    assert f"paused after step 7 of {STEPS}" in err and f"--resume --out {split}" in err
    assert run(data_root, split, *overrides, "--resume", "--stop-after", "6") == 0
    assert f"resuming {split} after step 7 of {STEPS}\n" in capsys.readouterr().out
    assert load_ckpt(split)["step"] == 13
    assert run(data_root, split, *overrides, "--resume") == 0

    a_lines, b_lines = train_lines(whole), train_lines(split)
    assert [r["step"] for r in b_lines] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in b_lines] == [r["loss"] for r in a_lines]  # exactly, not approx
    assert [r["lr"] for r in b_lines] == [r["lr"] for r in a_lines]
    a, b = load_ckpt(whole), load_ckpt(split)
    assert b["step"] == a["step"] == STEPS
    assert a["model"].keys() == b["model"].keys()
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    split_evals = {r["step"]: r["val_loss"] for r in eval_lines(split)}
    for r in eval_lines(whole):
        assert split_evals[r["step"]] == r["val_loss"]


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


def test_a_steps_metrics_line(tmp_path: Path) -> None:
    """What one step's line holds: per-step rates, MFU against the given peak on all devices,
    peak memory in MiB (2**20 bytes) where measured."""
    path = tmp_path / "metrics.jsonl"
    log = metrics.MetricsLog(
        path,
        enabled=True,
        log_interval=10,
        last_step=25,
        tokens_per_step=4096,
        flops_per_step=2 * 10**12,
        peak_tflops=4.0,
        devices=2,
        warn=print,
    )
    assert [s for s in range(1, 26) if log.wants(s)] == [10, 20, 25]
    log.step(10, loss=2.5, lr=1e-3, seconds=0.5, grad_norm=0.75, peak_mem=3 * 2**20)
    log.step(20, loss=2.0, lr=1e-3, seconds=0.25, grad_norm=None, peak_mem=None)
    first, second = map(json.loads, path.read_text().splitlines())
    assert first == {
        "step": 10,
        "loss": 2.5,
        "lr": 1e-3,
        "ms_per_step": 500.0,
        "tokens_per_s": 8192.0,
        "tflops": 4.0,
        "grad_norm": 0.75,
        "mfu": 0.5,  # 4 TFLOP/s over 2 devices of 4
        "peak_mem_mib": 3.0,
    }
    assert "grad_norm" not in second and "peak_mem_mib" not in second and second["mfu"] == 1.0


def test_resume_drops_a_metrics_line_cut_short(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A kill in the middle of a log write leaves half a line; resuming must still work. So
    must other damage: a line whose step is not a number, bytes that are not UTF-8. How many
    lines went is said (a note typed into the log would be among them)."""
    out = copy_run(base_run, tmp_path / "run")
    with open(out / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": "x", "loss": 1.0}\n{"step": 99, "loss": 1.0, "note": "\xff"}\n')
        f.write(b'{"step": true, "loss": 1.0}\n')  # JSON's true is no step, though bool is int
        f.write(b'{"step": 21, "loss": 5.7')
    capsys.readouterr()
    assert run(data_root, out, f"--train.max_steps={STEPS + 2}", "--resume") == 0
    assert [r["step"] for r in train_lines(out)] == list(range(1, STEPS + 3))
    assert not list(out.glob("*.tmp"))
    assert f"metrics.jsonl: 4 line(s) dropped, logged after step {STEPS}" in (
        capsys.readouterr().err
    )


def test_out_that_is_a_file_or_holds_corpora_is_refused(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run written into a corpus would overwrite its tokenizer.json with the run's."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    before = {p: p.read_bytes() for p in data_root.rglob("*") if p.is_file()}
    for out, named in [
        (a_file, "is a file"),
        (a_file / "run", "cannot make the directory"),
        (data_root / "tiny", "holds prepared corpora"),  # the corpus trained on
        (data_root / "other", "holds prepared corpora"),  # another one
        (data_root, "holds prepared corpora"),
    ]:
        assert run(data_root, out) == 2, out
        assert named in error_of(capsys.readouterr().err), out
    # On --resume too: a file, not a run without its ckpt.pt
    assert run(data_root, a_file, "--resume") == 2
    assert error_of(capsys.readouterr().err) == f"--out {a_file} is a file; give a run directory\n"
    assert a_file.read_text() == "mine"
    assert {p: p.read_bytes() for p in data_root.rglob("*") if p.is_file()} == before


def test_a_new_run_goes_only_where_nothing_else_is(
    data_root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--out .` in a project would write config.toml, metrics.jsonl and tokenizer.json among
    its files. A run's own files (one that stopped before its first checkpoint) are no bar."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "README.md").write_text("mine")
    (project / "src").mkdir()
    assert run(data_root, project) == 2
    err = error_of(capsys.readouterr().err)
    assert "holds files that are not a run's (README.md, src)" in err, err
    assert sorted(p.name for p in project.iterdir()) == ["README.md", "src"]
    for name in ("a.py", "b.py", "c.py"):  # five: three named, the rest counted
        (project / name).write_text("")
    assert run(data_root, project) == 2
    assert "(README.md, a.py, b.py and 2 more)" in error_of(capsys.readouterr().err)
    for name in ("a.py", "b.py", "c.py"):
        (project / name).unlink()

    unsaved = tmp_path / "unsaved"
    unsaved.mkdir()
    for name in ("config.toml", "metrics.jsonl", "tokenizer.json", ".lock", ".config.toml.swp"):
        (unsaved / name).write_text("")  # and hidden files: an editor's, no one's work
    one_step = ["--train.max_steps=1", "--train.eval_interval=0", "--train.eval_batches=1"]
    assert run(data_root, unsaved, *one_step) == 0
    # A finished run with a note beside it, run again without --resume: the advice is that.
    (unsaved / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert run(data_root, unsaved, *one_step) == 2
    err = error_of(capsys.readouterr().err)
    assert f"already holds a checkpoint; continue it with --resume --out {unsaved}, or" in err
    # Under `make train`, flags go in ARGS: the advice says how; any other make is no matter.
    shutil.copytree(unsaved, tmp_path / "cwd" / "runs" / "default")
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv("MAKELEVEL", "1")
    assert run(data_root, Path("runs/default"), *one_step) == 2
    assert "continue it with --resume --out runs/default, or" in error_of(capsys.readouterr().err)
    monkeypatch.setenv("MAKE_TRAIN", "1")
    assert run(data_root, Path("runs/default"), *one_step) == 2
    assert "continue it with make train ARGS=--resume, or" in error_of(capsys.readouterr().err)
    assert run(data_root, unsaved, *one_step) == 2  # make train ARGS="--out ..."
    err = error_of(capsys.readouterr().err)
    assert f"continue it with make train ARGS='--resume --out {unsaved}', or" in err


@pytest.mark.parametrize("share", [pytest.param(0.5, marks=pytest.mark.cxx), 0.0])
def test_a_cpu_run_says_when_other_processes_took_the_cpus(
    data_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    share: float,
) -> None:
    """A run that took four times as long as the README says because another job shared
    the CPUs says so, as the profiler does."""
    monkeypatch.setattr(loop.OtherLoad, "share", lambda self: share)
    one_step = ["--train.max_steps=1", "--train.eval_interval=0", "--train.eval_batches=1"]
    assert run(data_root, tmp_path / "run", *one_step) == 0
    err = capsys.readouterr().err
    assert ("note: other processes used 50% of the CPUs" in err) == (share > 0), err
    if share:  # compiled, the run's own compile workers count among them, and it says so
        compiled: list[GPT] = []
        real = step.compile_blocks
        monkeypatch.setattr(step, "compile_blocks", lambda m: compiled.append(m) or real(m))
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        # At the profiler tests' block shape (B=2, T=32, C=32, 2 heads): kernels built once
        compiled_step = [*one_step, "--train.compile=true", "--train.batch_size=2"]
        assert run(data_root, tmp_path / "compiled", *compiled_step) == 0
        assert "other processes (Inductor's compile workers among them) used 50%" in (
            capsys.readouterr().err
        )
        # train.compile=true compiles the blocks, and the step ran through the compiled graph
        assert len(compiled) == 1
        assert all(block._compiled_call_impl is not None for block in compiled[0].blocks)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > frames


def test_a_compile_that_fails_is_an_error_naming_the_setting(
    data_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """As where Inductor finds no C++ compiler: one line that says what failed and the way
    round it, not a traceback; out of memory while compiling is out of memory; and
    TORCHDYNAMO_VERBOSE=1, torch's knob for its traceback, gets the traceback."""
    raises: list[Exception] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        raise raises[-1]

    def compile_blocks(model: GPT) -> None:
        for block in model.blocks:
            block.compile(backend=backend)

    monkeypatch.setattr(step, "compile_blocks", compile_blocks)
    one_step = ["--train.max_steps=1", "--train.eval_interval=0", "--train.compile=true"]
    raises.append(RuntimeError("No working C++ compiler found"))
    assert run(data_root, tmp_path / "run", *one_step) == 2
    err = capsys.readouterr().err
    said = "error: train.compile=true, and torch.compile failed: RuntimeError: No working C++"
    assert said in err and "--train.compile=false" in err and "Traceback" not in err
    raises.append(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert run(data_root, tmp_path / "oom", *one_step) == 2
    err = capsys.readouterr().err
    assert "error: out of memory (CUDA out of memory. Tried to allocate 2.00 GiB)" in err
    assert "lower train.batch_size" in err
    monkeypatch.setenv("TORCHDYNAMO_VERBOSE", "1")
    raises.append(RuntimeError("an Inductor bug"))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="an Inductor bug"):
        run(data_root, tmp_path / "verbose", *one_step)


def test_path_flags_expand_a_tilde_no_shell_expanded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--out=~/x reaches the program as typed (a shell expands ~ only at a word's start): it
    is the home folder's x, not a folder named ~ in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert train.main(["--out=~/run", "--resume"]) == 2
    assert f"no checkpoint at {tmp_path / 'home' / 'run' / checkpoint.CHECKPOINT}" in (
        capsys.readouterr().err
    )
    assert sample.main(["--run=~/run"]) == 2
    assert str(tmp_path / "home" / "run") in capsys.readouterr().err
    assert not (tmp_path / "~").exists()
    # A ~user with no home here is left as typed, as a shell leaves it
    assert train.main(["--out=~nosuchuser/run", "--resume"]) == 2
    assert "no checkpoint at ~nosuchuser/run/" in capsys.readouterr().err
    # data.root too, on the command line or in a file: the prepare command it suggests makes
    # the corpus where the run then looks (it looked in ./~ before)
    (tmp_path / "roots.toml").write_text('[data]\nroot = "~/corpora"\n')
    for argv in (["--data.root=~/corpora"], ["--config", str(tmp_path / "roots.toml")]):
        assert train.main([*argv, "--out", str(tmp_path / "new")]) == 2
        err = capsys.readouterr().err
        assert f"no prepared corpus at {tmp_path / 'home' / 'corpora' / 'stdlib'}" in err, err


def test_a_folder_named_like_the_checkpoint_is_named_as_such(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not "holds a checkpoint, resume it" then "no checkpoint, train first": one answer."""
    (tmp_path / "run" / checkpoint.CHECKPOINT).mkdir(parents=True)
    said = f"{tmp_path / 'run' / checkpoint.CHECKPOINT} is a folder, not a checkpoint"
    for resuming in ([], ["--resume"]):
        assert run(data_root, tmp_path / "run", *resuming) == 2
        assert said in error_of(capsys.readouterr().err)


def test_resume_without_checkpoint_is_an_error(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(data_root, tmp_path / "fresh", "--resume") == 2
    assert str(tmp_path / "fresh" / checkpoint.CHECKPOINT) in capsys.readouterr().err
    # No run there, and no corpus either: the error is the run's, not "prepare a corpus".
    argv = ["--out", str(tmp_path / "typo"), "--resume", f"--data.root={tmp_path / 'none'}"]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert f"no checkpoint at {tmp_path / 'typo' / checkpoint.CHECKPOINT}" in err, err
    assert not (tmp_path / "typo").exists()
    # A run killed before its first checkpoint: not "train first", but start it over, and how.
    early = tmp_path / "early"
    early.mkdir()
    (early / "config.toml").write_text(dump_toml(load_config(TINY)))
    assert run(data_root, early, "--resume") == 2
    err = capsys.readouterr().err
    assert f"{early} holds a run but no ckpt.pt (it stopped before its first checkpoint" in err
    assert f"--config {early / 'config.toml'}" in err
    assert run(data_root, early, "--config", str(early / "config.toml"), "--train.max_steps=1") == 0


@pytest.mark.parametrize("name", ["../data/tiny", "", "-x", "tiny/"])
def test_a_corpus_name_that_is_not_a_plain_folder_name_is_refused(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """A path, or nothing, would read a corpus outside data.root (or the root itself), and
    the hints would suggest prepare commands that fail; nothing is written."""
    assert run(data_root, tmp_path / "run", f"--data.name={name}") == 2
    err = error_of(capsys.readouterr().err)
    assert f"data.name={name!r}: a corpus name must be a plain folder name" in err
    assert not (tmp_path / "run").exists()


def test_a_model_vocabulary_smaller_than_the_corpus_says_what_to_give(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = meta(data_root)["vocab_size"]
    assert run(data_root, tmp_path / "run", "--model.vocab_size=256") == 2
    err = error_of(capsys.readouterr().err)
    assert f"model.vocab_size=256 is smaller than the tokenizer of corpus 'tiny' ({tokens}" in err
    assert f"give --model.vocab_size={tokens} or more" in err
    # 256 is below a byte-level tokenizer's least: no prepare command that would be refused
    assert "--vocab-size 256" not in err and "has at least 257" in err
    assert not (tmp_path / "run").exists()
    assert run(data_root, tmp_path / "run", "--model.vocab_size=300") == 2
    assert "or prepare the corpus with --vocab-size 300" in capsys.readouterr().err


def test_resume_with_another_model_config_names_the_field(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = copy_run(base_run, tmp_path / "run")
    before = (out / checkpoint.CHECKPOINT).read_bytes(), (out / "config.toml").read_text()
    assert run(data_root, out, *SHARED_OVERRIDES, "--resume", "--model.n_layer=3") == 2
    err = error_of(capsys.readouterr().err)
    assert "n_layer" in err and "model config" in err
    assert (
        "only model.attention and model.dropout may change on resume; to train these "
        "settings, start another run (--out)" in err
    )
    assert "n_embd" not in err, "only the fields that differ are named"
    assert ((out / checkpoint.CHECKPOINT).read_bytes(), (out / "config.toml").read_text()) == before


def test_resume_with_another_seed_is_refused(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The random state comes back from the checkpoint: another seed would only move the
    evaluation windows (the val curve jumps), so it is refused, and nothing changes."""
    out = copy_run(base_run, tmp_path / "run")
    seed = load_config(out / "config.toml").train.seed
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert run(data_root, out, *SHARED_OVERRIDES, "--resume", f"--train.seed={seed + 1}") == 2
    err = error_of(capsys.readouterr().err)
    assert f"train.seed={seed + 1}: {out} was seeded with {seed}" in err
    assert f"resume with train.seed={seed}" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_resume_may_change_the_dropout_rate(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Dropout holds no weights: a run goes on with another rate, as nanoGPT allows, and says
    so; the run's config then records it."""
    out = copy_run(base_run, tmp_path / "run")
    before = load_ckpt(out)["config"]["model"]["dropout"]
    capsys.readouterr()
    args = (f"--train.max_steps={STEPS + 1}", "--model.dropout=0.2", "--resume")
    assert run(data_root, out, *args) == 0
    assert (
        f"resuming with model.dropout=0.2; the run trained with {before} so far"
        in capsys.readouterr().err
    )
    assert load_ckpt(out)["config"]["model"]["dropout"] == 0.2
    assert load_config(out / "config.toml").model.dropout == 0.2


def test_resume_may_change_the_attention_variant(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It holds no weights: a run trained with one variant (cuDNN's, say, on a GPU) goes on
    with another (sdpa on a CPU)."""
    out = copy_run(base_run, tmp_path / "run")
    capsys.readouterr()
    assert (
        run(data_root, out, f"--train.max_steps={STEPS + 1}", "--model.attention=sdpa", "--resume")
        == 0
    )
    assert (
        "resuming with attention sdpa; the run trained with naive so far" in capsys.readouterr().err
    )
    assert load_ckpt(out)["step"] == STEPS + 1
    assert load_ckpt(out)["config"]["model"]["attention"] == "sdpa"
    assert load_config(out / "config.toml").model.attention == "sdpa"
    # A GPU run's variant that cannot train here: the error says how the run goes on.
    gpu = copy_run_trained_with(base_run, tmp_path / "gpu", "model", "attention", "sdpa-cudnn")
    assert run(data_root, gpu, f"--train.max_steps={STEPS + 1}", "--resume") == 2
    err = capsys.readouterr().err
    assert "'sdpa-cudnn' cannot run on cpu" in err
    assert "; resume with another (attention holds no weights), e.g. --model.attention=sdpa " in err
    assert run(data_root, tmp_path / "new", "--model.attention=flex") == 2
    assert "; choose another, e.g. --model.attention=sdpa" in capsys.readouterr().err


def test_resume_with_another_batch_says_so(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Allowed (a larger batch late in a run is common), and said: the steps from the resume
    on draw other batches than an uninterrupted run's."""
    out = copy_run(base_run, tmp_path / "run")
    batch = load_config(out / "config.toml").train.batch_size
    capsys.readouterr()
    more = [f"--train.max_steps={STEPS + 1}", "--resume"]
    assert (
        run(data_root, out, *more, f"--train.batch_size={batch * 2}", "--train.grad_accum=2") == 0
    )
    err = capsys.readouterr().err
    assert (
        f"resuming with train.batch_size {batch} -> {batch * 2}, train.grad_accum 1 -> 2: " in err
    )
    assert "will not match one that never stopped" in err
    assert "val_loss and train_loss are evaluated on other windows" in err
    assert run(data_root, out, f"--train.max_steps={STEPS + 2}", "--resume") == 0
    assert "evaluated on other windows" not in capsys.readouterr().err  # the run's own now
    # Fewer eval batches train on the same batches, but evaluate on other windows: said.
    evals = load_config(out / "config.toml").train.eval_batches
    assert (
        run(
            data_root,
            out,
            f"--train.max_steps={STEPS + 3}",
            "--resume",
            f"--train.eval_batches={evals + 1}",
        )
        == 0
    )
    err = capsys.readouterr().err
    assert (
        f"resuming with train.eval_batches {evals} -> {evals + 1}: val_loss and train_loss are "
        in err
    )
    assert "never stopped" not in err


@pytest.mark.parametrize(
    ("saved", "now", "said", "not_said"),
    [
        # The same 8 rows a step, in two micro-batches: the same data and windows
        (
            {"batch_size": 8},
            {"batch_size": 4, "grad_accum": 2},
            "each step trains on the rows it would have drawn; the run matches one that never "
            "stopped to rounding, not exactly",
            "windows",
        ),
        # Half the rows, twice the eval batches: other data, the same windows
        (
            {"batch_size": 8, "eval_batches": 2},
            {"batch_size": 4, "eval_batches": 4},
            "a step takes 4 rows over all processes where it took 8",
            "windows",
        ),
        # A checkpoint older than global_batch_size: no field to compare, the rows said
        (
            {"batch_size": 8, "global_batch_size": None},
            {"batch_size": 8, "global_batch_size": 32},
            "resuming with 32 rows per step: a step takes 32 rows over all processes where it "
            "took 8, so the data differs from there on; val_loss and train_loss are evaluated",
            "rows it would have drawn",
        ),
    ],
)
def test_a_resume_says_what_another_batch_changes_by_the_rows_per_step(
    capsys: pytest.CaptureFixture[str], saved: dict, now: dict, said: str, not_said: str
) -> None:
    """The offsets come from one stream: rows per step decide the data, rows per step times
    eval_batches the evaluation's windows, whatever the split."""
    from resume import say_the_batch_changed

    train_fields = {"batch_size": 8, "grad_accum": 1, "global_batch_size": 0, "eval_batches": 2}
    before = {k: v for k, v in {**train_fields, **saved}.items() if v is not None}
    tc = TrainConfig(**{**train_fields, **now})
    say_the_batch_changed({"config": {"train": before}}, tc, 1, 1, 0.0)
    err = capsys.readouterr().err
    assert said in err and not_said not in err, err


@pytest.mark.parametrize(
    ("ranks_before", "now", "dropout", "said"),
    [
        # The same rows split otherwise (4 x 2 micro-batches a process before: 8 rows a step on
        # 1 process, now 8 x 1; 16 on 2, now 4 x 4 on 1): without dropout only the sums' order
        # differs
        (1, {"batch_size": 8, "grad_accum": 1}, 0.0, "the run matches one that never stopped "),
        (2, {"batch_size": 4, "grad_accum": 4}, 0.0, "the run matches one that never stopped "),
        # with dropout each micro-batch and process draws its own masks
        (
            1,
            {"batch_size": 8, "grad_accum": 1},
            0.1,
            "dropout draws other masks; the run will not match",
        ),
        (
            2,
            {"batch_size": 4, "grad_accum": 4},
            0.1,
            "dropout draws other masks; the run will not match",
        ),
    ],
)
def test_a_resume_that_splits_the_rows_otherwise_matches_only_without_dropout(
    capsys: pytest.CaptureFixture[str],
    ranks_before: int,
    now: dict,
    dropout: float,
    said: str,
) -> None:
    """The same rows a step give the same data, split among micro-batches or processes as
    they may; dropout's masks are drawn per micro-batch from each process's generator, so
    only a run without dropout matches the one that never stopped (to rounding)."""
    from resume import say_the_batch_changed

    before = {"batch_size": 4, "grad_accum": 2, "global_batch_size": 0, "eval_batches": 2}
    tc = TrainConfig(**{**before, **now})
    say_the_batch_changed({"config": {"train": before}}, tc, ranks_before, 1, dropout)
    err = capsys.readouterr().err
    assert "each step trains on the rows it would have drawn" in err, err
    assert said in err, err
    assert ("dropout" in err) == (dropout > 0), err


def test_a_resume_with_the_same_split_in_other_fields_says_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """grad_accum 2, or a global batch of twice batch_size on one process: the same
    micro-batches, so the same run, dropout and all: nothing to say."""
    from resume import say_the_batch_changed

    before = {"batch_size": 8, "grad_accum": 2, "global_batch_size": 0, "eval_batches": 2}
    tc = TrainConfig(**{**before, "grad_accum": 1, "global_batch_size": 16})
    say_the_batch_changed({"config": {"train": before}}, tc, 1, 1, 0.1)
    assert capsys.readouterr().err == ""


def test_onednn_linears_where_they_cannot_run_are_a_config_error(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """train.cpu_linear='onednn' insists: with bf16 autocast, which it cannot run, the run
    stops before writing, naming the field and the fix."""
    out = tmp_path / "run"
    assert run(data_root, out, "--train.cpu_linear=onednn", "--train.dtype=bfloat16") == 2
    err = error_of(capsys.readouterr().err)
    assert err.startswith("train.cpu_linear='onednn' runs fp32 only; set train.dtype=float32")
    assert not out.exists()


def test_resume_through_another_linear_path_says_so(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """train.cpu_linear=auto picks by CPU: a run resumed on another machine (here: told so)
    may take the other path, which rounds differently. Allowed, and said."""
    before = load_ckpt(base_run)["written_by"]["linear"]
    other = "torch" if before == "onednn" else "onednn"
    if other == "onednn" and onednn_unavailable_reason() is not None:
        pytest.skip(onednn_unavailable_reason())
    out = copy_run(base_run, tmp_path / "run")
    capsys.readouterr()
    argv = [f"--train.max_steps={STEPS + 1}", f"--train.cpu_linear={other}", "--resume"]
    assert run(data_root, out, *argv) == 0
    err = capsys.readouterr().err
    names = {"onednn": "oneDNN", "torch": "PyTorch BLAS"}
    assert f"resuming with nn.Linear through {names[other]} (train.cpu_linear={other}); " in err
    assert f"the run trained through {names[before]} so far" in err
    assert load_ckpt(out)["written_by"]["linear"] == other
    capsys.readouterr()
    # Resumed again, it goes on as it now trains (config.toml keeps the override): no note.
    assert run(data_root, out, f"--train.max_steps={STEPS + 2}", "--resume") == 0
    assert "nn.Linear through" not in capsys.readouterr().err


def test_resume_in_another_precision_says_so(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """fp32 to bf16 autocast: one line for the precision, with the Linear path that follows from
    it, not a line blaming train.cpu_linear for the path."""
    out = copy_run(base_run, tmp_path / "run")
    capsys.readouterr()
    argv = [f"--train.max_steps={STEPS + 1}", "--train.dtype=bfloat16", "--resume"]
    assert run(data_root, out, *argv) == 0
    err = capsys.readouterr().err
    assert (
        "resuming in bfloat16 autocast (train.dtype=bfloat16, nn.Linear through PyTorch BLAS); "
        "the run trained in float32 so far: the same function, rounded differently" in err
    ), err
    assert "resuming with nn.Linear" not in err
    assert load_ckpt(out)["written_by"]["precision"] == "bfloat16 autocast"
    # A checkpoint from before written_by recorded it: told by its config's train.dtype
    older = copy_run(base_run, tmp_path / "older")
    ckpt = load_ckpt(older)
    del ckpt["written_by"]["precision"]
    torch.save(ckpt, older / checkpoint.CHECKPOINT)
    assert run(data_root, older, *argv) == 0
    assert "the run trained in float32 so far" in capsys.readouterr().err


def test_resume_on_a_corpus_prepared_again_with_the_same_tokenizer_says_so(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The token ids mean the same, so it resumes; but on other documents, which is said."""
    assert load_ckpt(base_run)["corpus_sha256"] == meta(data_root)["content_sha256"]
    out = copy_run(base_run, tmp_path / "run")
    ckpt = load_ckpt(out)
    ckpt["corpus_sha256"] = "a" * 64  # as if it trained on the corpus before a re-prepare
    torch.save(ckpt, out / checkpoint.CHECKPOINT)
    capsys.readouterr()
    assert run(data_root, out, f"--train.max_steps={STEPS + 1}", "--resume") == 0
    said = "resuming on corpus 'tiny' as it is now: it was prepared again since the checkpoint"
    assert said in capsys.readouterr().err
    assert load_ckpt(out)["corpus_sha256"] == meta(data_root)["content_sha256"]
    assert run(data_root, out, f"--train.max_steps={STEPS + 2}", "--resume") == 0
    assert "resuming on corpus" not in capsys.readouterr().err


def test_resume_with_other_optimizer_settings_uses_them(
    base_run: Path, data_root: Path, tmp_path: Path
) -> None:
    """load_state_dict restores the checkpoint's decay and betas; the config's must win, as
    config.toml records them. It restores the path AdamW took on the device that wrote the
    checkpoint too: the resume takes the one built for its own device."""
    out = copy_run(base_run, tmp_path / "run")
    ckpt = load_ckpt(out)
    for group in ckpt["optimizer"]["param_groups"]:  # as written where there is no fused AdamW
        assert (group["fused"], group["foreach"]) == (True, None)
        group["fused"], group["foreach"] = None, True
    torch.save(ckpt, out / checkpoint.CHECKPOINT)
    changed = ["--train.weight_decay=0.5", "--train.beta1=0.8", "--train.beta2=0.9"]
    assert run(data_root, out, f"--train.max_steps={STEPS + 2}", *changed, "--resume") == 0
    groups = load_ckpt(out)["optimizer"]["param_groups"]
    assert [(g["weight_decay"], tuple(g["betas"]), g["fused"], g["foreach"]) for g in groups] == [
        (0.5, (0.8, 0.9), True, None),
        (0.0, (0.8, 0.9), True, None),
    ]
    assert load_config(out / "config.toml").train.weight_decay == 0.5


def test_extending_a_finished_run_says_the_learning_rate_climbs_again(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A larger max_steps recomputes the cosine over the longer run, so a run that had decayed
    to min_lr trains at a higher rate again: said, with both rates and the flag that keeps
    min_lr; the logged rate is the one said."""
    out = copy_run(base_run, tmp_path / "run")
    capsys.readouterr()
    assert run(data_root, out, f"--train.max_steps={STEPS + 10}", "--resume") == 0
    err = capsys.readouterr().err
    tc = load_config(out / "config.toml").train
    now = optim.lr_at(STEPS, tc)
    assert now > 2 * tc.min_lr  # the case this is about: well up the cosine again
    assert (
        f"resuming with train.max_steps {STEPS} -> {STEPS + 10}: the learning-rate schedule is "
        f"recomputed over the new settings, so step {STEPS + 1} trains at {now:.3g} where the "
        f"run's own schedule gives {tc.min_lr:.3g}; to go on at min_lr instead, also give "
        f"--train.lr={tc.min_lr:g}" in err
    ), err
    logged = train_lines(out)
    assert next(m["lr"] for m in logged if m["step"] == STEPS + 1) == pytest.approx(now)
    # The hint's flag: the rate stays at min_lr; a resume that keeps the schedule says nothing.
    again = copy_run(base_run, tmp_path / "again")
    argv = [f"--train.max_steps={STEPS + 2}", f"--train.lr={tc.min_lr:g}", "--resume"]
    assert run(data_root, again, *argv) == 0
    logged = train_lines(again)
    assert next(m["lr"] for m in logged if m["step"] == STEPS + 1) == pytest.approx(tc.min_lr)
    assert "learning-rate schedule" not in capsys.readouterr().err
    # A checkpoint lacking a schedule field says nothing rather than guess at it; a warm-up
    # raised past the resume step gets no min_lr hint (lr=min_lr would ramp up below it).
    fields = {k: getattr(tc, k) for k in optim.SCHEDULE_FIELDS} | {"max_steps": STEPS}
    for missing in optim.SCHEDULE_FIELDS:
        lacking = {k: v for k, v in fields.items() if k != missing}
        resume.say_the_schedule_changed({"step": STEPS, "config": {"train": lacking}}, tc)
        assert capsys.readouterr().err == "", missing
    warm = dataclasses.replace(tc, warmup_steps=STEPS + 5)
    resume.say_the_schedule_changed({"step": STEPS, "config": {"train": fields}}, warm)
    err = capsys.readouterr().err
    assert "learning-rate schedule is recomputed" in err and "min_lr instead" not in err
    split = tmp_path / "split"
    assert run(data_root, split, *SHARED_OVERRIDES, "--stop-after", "5") == 0
    assert run(data_root, split, "--resume", "--stop-after", "5") == 0
    assert "learning-rate schedule" not in capsys.readouterr().err


def test_a_resume_that_fails_before_saving_leaves_config_toml_as_it_was(
    base_run: Path, data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """config.toml is what a plain --resume goes on with: a resume's overrides replace it with
    the first checkpoint made under them, not before (a NaN from a bad override would have
    left the run resuming into it)."""
    out = copy_run(base_run, tmp_path / "run")
    before = (out / "config.toml").read_bytes()
    misbehave_at(monkeypatch, 2, loss=math.nan)
    argv = [f"--train.max_steps={STEPS + 4}", "--train.lr=0.5", "--resume"]
    assert run(data_root, out, *argv) == 2
    assert (out / "config.toml").read_bytes() == before
    assert load_ckpt(out)["step"] == STEPS
    monkeypatch.undo()
    # A save that fails (a full disk) leaves both as they were too.
    monkeypatch.setattr(loop, "save_checkpoint", Mock(side_effect=OSError(28, "No space")))
    config = load_config(out / "config.toml", argv[:2])
    with pytest.raises(OSError, match="No space"):
        train.train(config, out, resume=True)
    assert (out / "config.toml").read_bytes() == before
    monkeypatch.undo()
    assert run(data_root, out, *argv) == 0
    assert load_config(out / "config.toml").train.lr == 0.5
    assert load_ckpt(out)["config"]["train"]["lr"] == 0.5


def test_resume_after_a_stop_between_the_checkpoint_and_config_toml(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A resume's new settings reach config.toml just after the first checkpoint made under
    them: a run killed between the two writes leaves the old config.toml beside the new
    checkpoint. The next resume goes on with the checkpoint's settings, and says so."""
    out = copy_run(base_run, tmp_path / "run")
    before = (out / "config.toml").read_bytes()
    argv = [f"--train.max_steps={STEPS + 4}", "--resume", "--stop-after", "1"]
    assert run(data_root, out, *argv) == 0
    assert load_ckpt(out)["config"]["train"]["max_steps"] == STEPS + 4
    (out / "config.toml").write_bytes(before)  # killed between the two writes
    capsys.readouterr()
    assert run(data_root, out, "--resume") == 0
    err = capsys.readouterr().err
    assert "config.toml differs from the config" in err
    assert f"train.max_steps = {STEPS} there, {STEPS + 4} in the checkpoint" in err
    # run() gives --config too: how it differs names what the run resumes with, the checkpoint's
    assert f"resuming with the config {out / checkpoint.CHECKPOINT} records; " in err
    assert "the run's own config" not in err
    assert load_ckpt(out)["step"] == STEPS + 4, "the extension goes on"
    assert load_config(out / "config.toml").train.max_steps == STEPS + 4


def test_resume_with_another_tokenizer_is_an_error(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert meta(data_root, "other")["tokenizer_sha256"] != meta(data_root)["tokenizer_sha256"]
    out = copy_run(base_run, tmp_path / "run")
    assert run(data_root, out, *SHARED_OVERRIDES, "--resume", "--data.name=other") == 2
    err = error_of(capsys.readouterr().err)
    assert "tokenizer" in err


def test_resume_on_its_corpus_prepared_again_says_how_to_make_the_runs(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's corpus prepared again under its name, with a larger vocabulary: the advice is
    the command that makes the run's corpus again, not to grow model.vocab_size (the advice
    for a new run), which the checkpoint's weights refuse."""
    root = tmp_path / "root"
    prepare("tiny", files=stdlib_documents(tmp_path / "docs"), vocab_size=640, out_root=root)
    out = copy_run_trained_with(base_run, tmp_path / "run", "data", "root", str(root))
    assert run(root, out, *SHARED_OVERRIDES, "--resume") == 2
    err = error_of(capsys.readouterr().err)
    assert f"{root / 'tiny'} was prepared again since the run trained on it" in err, err
    assert "--vocab-size 512" in err and "model.vocab_size" not in err, err
    # Given another data.root than the run's: its own corpus is named first
    other = copy_run(base_run, tmp_path / "other")
    assert run(root, other, *SHARED_OVERRIDES, "--resume") == 2
    err = error_of(capsys.readouterr().err)
    assert f"it trained on the corpus in {data_root / 'tiny'} (--data.root={data_root})" in err
    assert f"or make the run's in {root / 'tiny'}: python data/prepare.py" in err, err


# --- failures while training ------------------------------------------------------------------------


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
    assert f"File too large: {out / 'metrics.jsonl'}; the last checkpoint, if any, is as it" in err
    assert f"raise the file-size limit (ulimit -f), then continue with --resume --out {out}" in err
    assert (out / checkpoint.CHECKPOINT).read_bytes() == saved


@pytest.mark.parametrize(
    ("bad", "at", "calls", "saved"),
    [(math.nan, 5, 6, 4), (math.inf, 5, 6, 4), (math.nan, 4, 4, None)],
)
def test_non_finite_loss_stops_the_run_without_saving(
    data_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    bad: float,
    at: int,
    calls: int,
    saved: int | None,
) -> None:
    """A step's loss is read once the next step is queued (so a GPU never waits for the
    host): step 6 runs, and the run stops there, not at the next evaluation (8). Step 4 is
    an evaluation step, read at once: its loss is checked before anything is saved."""
    made = misbehave_at(monkeypatch, at, loss=bad)
    out = tmp_path / "run"
    assert run(data_root, out, "--train.max_steps=8", "--train.eval_interval=4") == 2
    err = error_of(capsys.readouterr().err)
    assert f"step {at}" in err and str(bad) in err
    assert len(made) == calls, "the run went on after a non-finite loss"
    if saved is None:
        assert "none yet" in err and not (out / checkpoint.CHECKPOINT).exists()
    else:
        assert load_ckpt(out)["step"] == saved
    assert [r["step"] for r in train_lines(out)] == list(range(1, at))


@pytest.mark.parametrize("clip", ["on", "off"])
def test_non_finite_weights_never_overwrite_the_last_good_checkpoint(
    data_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    clip: str,
) -> None:
    """Infinite gradients make the weights NaN through the step's own update, while its loss,
    computed before, is finite. With clipping the step's gradient norm shows it at once;
    without, the evaluation before a save does. Either way step 2's checkpoint stays, also
    when the bad step is the last (where a run would otherwise end as if all were well)."""
    if clip == "on":
        misbehave_at(monkeypatch, 4, grad_norm=math.inf)
    else:
        misbehave_at(monkeypatch, 4, spoil_weights=True)
    out = tmp_path / "run"
    args = [
        "--train.max_steps=4",
        "--train.eval_interval=2",
        f"--train.grad_clip={1.0 * (clip == 'on')}",
    ]
    assert run(data_root, out, *args) == 2
    err = error_of(capsys.readouterr().err)
    expected = "gradient norm is inf at step 4" if clip == "on" else "val loss is nan at step 4"
    assert expected in err and "stopped without saving" in err and "last good one" in err
    ckpt = load_ckpt(out)
    assert ckpt["step"] == 2
    assert all(torch.isfinite(p).all() for p in ckpt["model"].values())
    assert all(math.isfinite(r["val_loss"]) for r in eval_lines(out))


@pytest.mark.slow
def test_sigterm_saves_and_the_run_resumes(data_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    overrides = ["--train.max_steps=100000", "--train.eval_interval=0", "--train.eval_batches=1"]
    overrides.append("--train.sample_tokens=5")
    log = tmp_path / "stderr.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "train.py", *run_argv(data_root, out, *overrides)],
            cwd=ROOT,
            stdout=stderr,  # one log: "stopped by" and any sample would both land here
            stderr=stderr,
            env=env | {"OMP_NUM_THREADS": "1"},
        )
        try:
            deadline = time.monotonic() + 60
            metrics = out / "metrics.jsonl"
            while not (metrics.is_file() and metrics.read_text().strip()):
                assert proc.poll() is None, f"train.py exited early:\n{log.read_text()}"
                assert time.monotonic() < deadline, "no step logged within 60 s"
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            # Saved but not finished: the shell's status for SIGTERM, so `train && ...` stops.
            assert proc.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    err = log.read_text()
    assert "stopped by SIGTERM" in err and "--resume" in err
    assert "--- sample" not in err, "a stopped run exits without sampling"
    stopped_at = load_ckpt(out)["step"]
    assert stopped_at >= 1
    assert train_lines(out)[-1]["step"] == stopped_at

    assert run(data_root, out, *overrides, "--resume", "--stop-after", "2") == 0
    assert load_ckpt(out)["step"] == stopped_at + 2
    assert [r["step"] for r in train_lines(out)] == list(range(1, stopped_at + 3))


def test_resume_of_a_finished_run_changes_nothing(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = copy_run(base_run, tmp_path / "done")
    before = {name: (out / name).read_bytes() for name in ("ckpt.pt", "metrics.jsonl")}
    assert run(data_root, out, *SHARED_OVERRIDES, "--resume") == 0
    assert "is complete" in capsys.readouterr().out
    assert {name: (out / name).read_bytes() for name in before} == before


def test_a_finished_run_resumed_with_new_settings_says_only_that_it_is_complete(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing trains, so nothing changes: no "resuming with attention sdpa" before it. Lines a
    killed continuation logged past the checkpoint go: no checkpoint has their steps."""
    out = copy_run(base_run, tmp_path / "done")
    kept = (out / "metrics.jsonl").read_text()
    past = json.dumps({"step": STEPS + 1, "loss": 1.0}) + "\n"
    (out / "metrics.jsonl").write_text(kept + past)
    changes = ["--model.attention=sdpa", "--train.batch_size=2", "--train.lr=0.01"]
    assert run(data_root, out, *SHARED_OVERRIDES, *changes, "--resume") == 0
    printed = capsys.readouterr()
    assert printed.out.strip() == f"{out} is complete (step {STEPS} of train.max_steps={STEPS})"
    assert "resuming" not in printed.err and "sdpa" not in printed.err, printed.err
    assert f"1 line(s) dropped, logged after step {STEPS} (no checkpoint kept them)" in printed.err
    assert (out / "metrics.jsonl").read_text() == kept
    # A lower train.max_steps than the checkpoint's step: said so
    assert run(data_root, out, *SHARED_OVERRIDES, "--train.max_steps=5", "--resume") == 0
    assert capsys.readouterr().out.strip() == (
        f"{out} is complete: its checkpoint is at step {STEPS}, past train.max_steps=5"
    )


def test_a_sample_is_printed_once_when_the_run_reaches_its_end(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not after a --stop-after split, not when a finished run is resumed: only on the step
    that ends the run, so a split-and-resumed run prints one sample, as an unbroken one does."""
    out = tmp_path / "run"
    argv = ["--train.max_steps=3", "--train.eval_interval=0", "--train.sample_tokens=3"]
    for extra, sampled in (
        (["--stop-after", "2"], False),
        (["--resume"], True),
        (["--resume"], False),
    ):
        assert run(data_root, out, *argv, *extra) == 0
        assert ("--- sample from" in capsys.readouterr().out) == sampled, extra
    assert load_ckpt(out)["step"] == 3


def test_resume_without_config_continues_with_the_runs_own_config(
    base_run: Path, tmp_path: Path
) -> None:
    out = copy_run(base_run, tmp_path / "more")
    assert train.main(["--out", str(out), "--resume", f"--train.max_steps={STEPS + 2}"]) == 0
    assert load_ckpt(out)["step"] == STEPS + 2
    assert load_config(out / "config.toml").model == load_config(base_run / "config.toml").model


def test_resume_with_a_damaged_or_missing_config_toml(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config.toml cut before [train] would resume on the defaults (lr, batch, intervals)
    without a word: an error naming the fields. Without config.toml, the checkpoint's record."""
    out = tmp_path / "run"
    started = ("--train.max_steps=8", "--train.lr=0.01", "--train.batch_size=2")
    assert run(data_root, out, *started, "--stop-after", "2") == 0
    text = (out / "config.toml").read_text()
    (out / "config.toml").write_text(text[: text.index("[train]")])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert train.main(["--out", str(out), "--resume"]) == 2
    err = error_of(capsys.readouterr().err)
    assert "config.toml lacks train.device" in err and "train.lr" in err and "delete it" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before, "nothing written"

    (out / "config.toml").unlink()
    assert train.main(["--out", str(out), "--resume", "--stop-after", "1"]) == 0
    assert "config.toml is missing; resuming with the config" in capsys.readouterr().err
    resumed = load_config(out / "config.toml").train
    assert (resumed.lr, resumed.batch_size, resumed.max_steps) == (0.01, 2, 8)
    assert load_ckpt(out)["step"] == 3


def test_resume_of_a_run_older_than_a_config_field(base_run: Path, tmp_path: Path) -> None:
    """A field added to the config after a run was made is in neither its config.toml nor its
    checkpoint: not damage; the field's default holds."""
    out = copy_run(base_run, tmp_path / "old")
    ckpt = load_ckpt(out)
    del ckpt["config"]["train"]["peak_tflops"]
    torch.save(ckpt, out / checkpoint.CHECKPOINT)
    text = (out / "config.toml").read_text()
    (out / "config.toml").write_text(
        "".join(line for line in text.splitlines(True) if not line.startswith("peak_tflops"))
    )
    assert train.main(["--out", str(out), "--resume", f"--train.max_steps={STEPS + 1}"]) == 0
    assert load_config(out / "config.toml").train.peak_tflops == 0.0


def test_resume_with_config_keeps_the_runs_own_settings_and_names_those_that_differ(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make train ARGS=--resume` gives configs/default.toml again: the settings the run was
    started with must not fall back to that file's, and a setting given now still applies."""
    out = tmp_path / "run"
    started = ("--train.max_steps=8", "--train.lr=0.01")  # tiny.toml: 20 and 0.003
    assert run(data_root, out, *started, "--stop-after", "2") == 0
    capsys.readouterr()
    assert run(data_root, out, "--resume", "--stop-after", "1") == 0
    err = capsys.readouterr().err
    assert "train.max_steps = 8 (there 20)" in err and "train.lr = 0.01 (there 0.003)" in err
    assert "model." not in err, "only the fields that differ are named"
    kept = load_config(out / "config.toml").train
    assert (kept.max_steps, kept.lr, load_ckpt(out)["step"]) == (8, 0.01, 3)
    assert train_lines(out)[-1]["lr"] == pytest.approx(optim.lr_at(2, kept))

    assert run(data_root, out, "--resume", "--train.max_steps=9") == 0
    assert load_ckpt(out)["step"] == 9
    assert load_config(out / "config.toml").train.lr == 0.01

    # --config is only compared: an error in it is said, and the run resumes all the same.
    broken = tmp_path / "broken.toml"
    broken.write_text("[train]\nmax_step = 5\n")
    capsys.readouterr()
    argv = ["--config", str(broken), f"--data.root={data_root}", "--out", str(out)]
    assert train.main([*argv, "--resume", "--train.max_steps=10"]) == 0
    err = capsys.readouterr().err
    assert f"not compared with --config ({broken}: unknown key train.max_step;" in err
    assert load_ckpt(out)["step"] == 10


def test_resume_does_not_keep_the_loaded_checkpoint_in_memory(
    base_run: Path, data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its weights are copied into the model: holding it too costs a model's size of host RAM."""
    out = copy_run(base_run, tmp_path / "run")
    real_open_run = train.open_run
    loaded: list[weakref.ref] = []

    def open_run(*args: Any) -> tuple[Path, dict[str, Any] | None]:
        path, ckpt = real_open_run(*args)
        loaded.extend(weakref.ref(t) for t in ckpt["model"].values())
        return path, ckpt

    monkeypatch.setattr(train, "open_run", open_run)
    held = []
    misbehave_at(monkeypatch, 1, before=lambda: held.extend(r for r in loaded if r() is not None))
    assert run(data_root, out, f"--train.max_steps={STEPS + 1}", "--resume") == 0
    assert loaded and not held


def test_resume_reads_a_checkpoint_with_the_older_single_rng_state(
    base_run: Path, tmp_path: Path
) -> None:
    out = copy_run(base_run, tmp_path / "old")
    ckpt = load_ckpt(out)
    ckpt["rng"] = ckpt["rng"][0]  # the format before per-rank states: one dict
    torch.save(ckpt, out / checkpoint.CHECKPOINT)
    assert train.main(["--out", str(out), "--resume", f"--train.max_steps={STEPS + 1}"]) == 0
    assert load_ckpt(out)["step"] == STEPS + 1


def test_without_out_the_run_goes_to_runs_named_for_its_config(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """runs/builtin without a config: not runs/default, where `make train` keeps the run of
    configs/default.toml."""
    monkeypatch.chdir(tmp_path)
    small = ["--model.block_size=32", "--model.n_layer=1", "--model.n_embd=32"]
    once = ["--train.max_steps=1", "--train.batch_size=2", "--train.eval_batches=1"]
    corpus = [f"--data.root={data_root}", "--data.name=tiny", "--train.sample_tokens=0"]
    assert train.main([*small, *once, *corpus]) == 0
    assert (tmp_path / "runs" / "builtin" / checkpoint.CHECKPOINT).is_file()
    assert not (tmp_path / "runs" / "default").exists()
    # With a config, runs/<its name>
    assert train.main(["--config", str(TINY), *once, *corpus]) == 0
    assert (tmp_path / "runs" / "tiny" / checkpoint.CHECKPOINT).is_file()


@pytest.mark.parametrize("n", ["0", "-2"])
def test_stop_after_must_be_positive(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], n: str
) -> None:
    assert run(data_root, tmp_path / "run", "--stop-after", n) == 2
    assert "--stop-after" in error_of(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_the_last_step_is_logged_whatever_the_interval(data_root: Path, tmp_path: Path) -> None:
    """log_interval 3 over 5 steps logs steps 3 and 5: the run's end, and a --stop-after pause,
    always get a line (default.toml logs every 10th step)."""
    every_3rd = ["--train.log_interval=3", "--train.max_steps=5", "--train.eval_interval=0"]
    assert run(data_root, tmp_path / "whole", *every_3rd) == 0
    assert [r["step"] for r in train_lines(tmp_path / "whole")] == [3, 5]
    assert run(data_root, tmp_path / "split", *every_3rd, "--stop-after", "4") == 0
    assert [r["step"] for r in train_lines(tmp_path / "split")] == [3, 4]
    assert run(data_root, tmp_path / "split", "--resume") == 0
    assert [r["step"] for r in train_lines(tmp_path / "split")] == [3, 4, 5]


def test_step_time_excludes_evaluation(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither an evaluating step nor the step after it logs the evaluation's time."""
    real = step.evaluate
    calls = []

    def slow_evaluate(*args: Any, **kwargs: Any) -> float:
        calls.append(None)
        if len(calls) in (3, 4):  # step 3's evaluation (val, train): 3 s, whatever the load
            time.sleep(1.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "evaluate", slow_evaluate)
    out = tmp_path / "run"
    evals = ["--train.eval_interval=3", "--train.eval_batches=1", "--train.max_steps=5"]
    assert run(data_root, out, *evals) == 0
    assert len(calls) == 6  # steps 0, 3 and 5 evaluate, two calls each
    ms = {r["step"]: r["ms_per_step"] for r in train_lines(out)}
    # Step 3 evaluates and 4 follows (not 1 or 2: a loaded machine's first steps are slow);
    # a step of this model takes milliseconds, an evaluation here 3 s.
    assert ms[3] < 1500 and ms[4] < 1500, ms


# --- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        ("val.bin one byte short", "val.bin is damaged"),
        ("val.bin empty", "val.bin is damaged"),
        ("train.bin deleted", "train.bin is missing"),
        ("meta.json cut short", "meta.json is damaged (JSONDecodeError"),
        ("meta.json without splits", "meta.json is damaged (KeyError"),
        ("tokenizer.json deleted", "has no tokenizer.json"),
        ("tokenizer.json cut short", "tokenizer.json is not the tokenizer meta.json records"),
        ("train.bin holding an id beyond the tokenizer", "is id 60000, beyond its tokenizer's"),
    ],
)
def test_a_damaged_corpus_is_an_error_naming_the_file(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str, named: str
) -> None:
    root = Path(shutil.copytree(data_root, tmp_path / "root"))
    corpus = root / "tiny"
    meta = corpus / "meta.json"
    match damage:
        case "val.bin one byte short":
            (corpus / "val.bin").write_bytes((corpus / "val.bin").read_bytes()[:-1])
        case "val.bin empty":
            (corpus / "val.bin").write_bytes(b"")
        case "train.bin deleted":
            (corpus / "train.bin").unlink()
        case "tokenizer.json deleted":
            (corpus / "tokenizer.json").unlink()
        case "tokenizer.json cut short":
            (corpus / "tokenizer.json").write_text('{"trunc')
        case "train.bin holding an id beyond the tokenizer":
            ids = np.fromfile(corpus / "train.bin", dtype=np.uint16)
            ids[::20] = 60000  # in every window: the right size, but damaged
            ids.tofile(corpus / "train.bin")
        case "meta.json cut short":
            meta.write_text(meta.read_text()[:40])
        case "meta.json without splits":
            meta.write_text(
                json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "splits"})
            )
    overrides = [f"--data.root={root}", "--train.max_steps=1"]
    assert train.main(["--config", str(TINY), "--out", str(tmp_path / "run"), *overrides]) == 2
    err = error_of(capsys.readouterr().err)
    assert named in err
    if damage == "meta.json cut short":  # nothing says how it was made: an example
        assert f"e.g. python data/prepare.py --name tiny --stdlib --out-root {root}" in err
    else:  # the command that made it, not a stdlib one that would make another corpus
        patterns = json.loads((data_root / "tiny" / "meta.json").read_text())["source"]["patterns"]
        assert (
            f"prepare the corpus again from its source: python data/prepare.py --name tiny "
            f"--files {' '.join(map(shlex.quote, patterns))} --vocab-size 512 --val-fraction 0.1 --seed 0 "
            f"--out-root {root}"
        ) in err
    # Found where a batch reads it (the file is not read whole before): no checkpoint saved.
    after_start = damage.startswith("train.bin holding")
    assert not (tmp_path / "run" / ("ckpt.pt" if after_start else "")).exists()


def test_a_resume_never_copies_a_damaged_tokenizer_over_the_runs_own(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = Path(shutil.copytree(data_root, tmp_path / "root"))
    (root / "tiny" / "tokenizer.json").write_text('{"trunc')
    out = copy_run(base_run, tmp_path / "run")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    argv = [f"--data.root={root}", f"--train.max_steps={STEPS + 2}", "--resume"]
    assert run(data_root, out, *argv) == 2
    assert "tokenizer.json is not the tokenizer meta.json records" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_missing_corpus_hints_at_prepare(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(data_root, tmp_path / "run", "--data.name=never-prepared") == 2
    err = error_of(capsys.readouterr().err)
    assert "never-prepared" in err and "data/prepare.py" in err
    # The hint prepares a corpus this model can read, where this run looks for it.
    assert "--vocab-size 512" in err and f"--out-root {data_root}" in err
    assert not (tmp_path / "run").exists()
    assert "to resume" not in err


def test_run_from_another_folder_the_hints_say_where_they_looked_and_what_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Relative paths are the working directory's: from outside the project, the errors say
    so, and the command they suggest runs from there."""
    monkeypatch.chdir(tmp_path)
    assert train.main(["--config", "configs/tiny.toml"]) == 2
    err = error_of(capsys.readouterr().err)
    assert f"relative to {tmp_path}; the project's is {ROOT / 'configs' / 'tiny.toml'}" in err
    assert train.main(["--config", str(TINY), "--train.max_steps=1"]) == 2
    err = error_of(capsys.readouterr().err)
    assert f"no prepared corpus at data/tiny/, relative to {tmp_path} (missing" in err
    assert f"e.g. python {ROOT / 'data' / 'prepare.py'} --name tiny --stdlib" in err
    assert list(tmp_path.iterdir()) == []


def test_resume_without_its_corpus_says_how_the_runs_was_made(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not the missing-corpus hint, a stdlib command, which makes a corpus but not
    necessarily the run's (another source, another vocabulary): the checkpoint's record."""
    out = copy_run(base_run, tmp_path / "moved")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    elsewhere = tmp_path / "elsewhere"
    gone = f"--data.root={elsewhere}"
    assert train.main(["--out", str(out), "--resume", gone]) == 2
    err = error_of(capsys.readouterr().err)
    made = meta(data_root)
    command = data_meta.rebuild_command(elsewhere / "tiny", made["source"], made["settings"])
    assert err.startswith(f"no prepared corpus at {elsewhere / 'tiny'}/; to resume {out}, ")
    assert "give --data.root=FOLDER where that corpus is now, or prepare it again as the " in err
    assert f"run's was made: {command} (its tokenizer must come out as " in err
    assert "e.g." not in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # A checkpoint from before the corpus was recorded: said in words.
    ckpt = load_ckpt(out)
    del ckpt["corpus"]
    torch.save(ckpt, out / checkpoint.CHECKPOINT)
    assert train.main(["--out", str(out), "--resume", gone]) == 2
    assert "or prepare it again from the source and with the settings the run trained on (" in (
        error_of(capsys.readouterr().err)
    )
    # Another corpus named on resume: the run's own is named, not a command to make this one
    assert train.main(["--out", str(out), "--resume", "--data.name=absent"]) == 2
    err = error_of(capsys.readouterr().err)
    assert f"{out} trained on corpus 'tiny' (data.name): resume it on that one" in err
    assert "prepare it" not in err and "data/prepare.py" not in err
    assert train.main(["--out", str(out), "--resume", "--data.name=other"]) == 2
    assert "; it trained on corpus 'tiny' (--data.name=tiny)" in error_of(capsys.readouterr().err)
    # No run there: nothing said about one.
    assert train.main(["--out", str(tmp_path / "none"), "--resume", gone]) == 2
    assert "to resume" not in error_of(capsys.readouterr().err)


@pytest.fixture(scope="module")
def short_val_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A corpus whose val split is one short document (< block_size + 1 tokens)."""
    tmp = tmp_path_factory.mktemp("short")
    docs = tmp / "docs"
    docs.mkdir()
    long_doc = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(200))
    # The split follows the text: take the first short document that prepare's defaults
    # (val_fraction 0.1, seed 0) put in val.
    shorts = (f"x = {i}\n" for i in itertools.count())
    short = next(t for t in shorts if split_documents([t, long_doc], 0.1, seed=0).val == [0])
    (docs / "a.py").write_text(short)
    (docs / "b.py").write_text(long_doc)
    prepare("short", files=[str(docs / "*.py")], vocab_size=300, out_root=tmp / "root")
    return tmp / "root"


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory"
        ),
        MemoryError(),  # NumPy, or the batch loader's Python lists
    ],
)
def test_out_of_memory_is_an_error_that_says_what_to_lower(
    data_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: Exception,
) -> None:
    def out_of_memory() -> None:
        raise error

    misbehave_at(monkeypatch, 1, before=out_of_memory)
    assert run(data_root, tmp_path / "run") == 2
    err = error_of(capsys.readouterr().err)
    assert "out of memory" in err and "train.batch_size" in err and "model.block_size" in err


def test_another_runtime_error_is_not_called_out_of_memory(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def breaks() -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    misbehave_at(monkeypatch, 1, before=breaks)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        run(data_root, tmp_path / "run")


def test_corpus_shorter_than_a_block_is_an_error(
    short_val_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert meta(short_val_root, "short")["splits"]["val"]["tokens"] < 33
    assert run(short_val_root, tmp_path / "run", "--data.name=short") == 2
    err = error_of(capsys.readouterr().err)
    assert "val.bin" in err and "block_size" in err


def test_a_batch_larger_than_the_corpus_is_an_error(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    """A typo'd batch_size (10^8) would gather its rows in host memory until it runs out.
    Told before a model is built: a typo'd block_size makes that model huge."""

    def build_model(*args, **kwargs):
        raise AssertionError("the model was built before the data was checked")

    monkeypatch.setattr(train, "build_model", build_model)
    assert run(data_root, tmp_path / "run", "--train.batch_size=100000000") == 2
    err = error_of(capsys.readouterr().err)
    assert "train.batch_size=100000000" in err and "lower train.batch_size" in err


def test_data_vocab_larger_than_the_model_is_an_error(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(data_root, tmp_path / "run", "--model.vocab_size=300") == 2
    err = error_of(capsys.readouterr().err)
    assert "vocab_size" in err and "512" in err


def test_cuda_only_variants_include_efficient_and_flex() -> None:
    assert {"sdpa-efficient", "flex"} <= set(CUDA_ONLY)


@pytest.mark.parametrize("variant", CUDA_ONLY)
def test_variant_that_cannot_run_on_cpu_is_refused(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], variant: str
) -> None:
    assert (
        run(data_root, tmp_path / "run", f"--model.attention={variant}", "--train.device=cpu") == 2
    )
    err = error_of(capsys.readouterr().err)
    reason = unavailable_reason(variant, "cpu", torch.float32, HEAD_SIZE)
    assert reason
    assert f"'{variant}'" in err and "cpu" in err and reason in err
    assert not (tmp_path / "run").exists(), "no silent fallback, and nothing written"


@pytest.mark.parametrize("variant", CPU_VARIANTS)
def test_every_cpu_variant_trains(data_root: Path, tmp_path: Path, variant: str) -> None:
    out = tmp_path / "run"
    overrides = ["--train.max_steps=3", "--train.eval_interval=0", "--train.eval_batches=1"]
    assert run(data_root, out, f"--model.attention={variant}", *overrides) == 0
    lines = train_lines(out)
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in lines)
    assert math.isfinite(eval_lines(out)[-1]["val_loss"])
    assert load_ckpt(out)["config"]["model"]["attention"] == variant


# Each of these once crashed mid-run with a traceback (a modulo or division by zero, an empty
# np.stack, torch.device's RuntimeError) or, for grad_accum=0, "trained" with loss 0 and no update.
@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("--train.log_interval=0", "train.log_interval"),
        ("--train.eval_batches=0", "train.eval_batches"),
        ("--train.batch_size=0", "train.batch_size"),
        ("--train.grad_accum=0", "train.grad_accum"),
        ("--train.device=bogus", "train.device"),
        ("--train.dtype=float16", "train.dtype"),
    ],
)
def test_bad_train_values_are_config_errors(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str, key: str
) -> None:
    out = tmp_path / "run"
    argv = run_argv(data_root, out, "--train.max_steps=2", "--train.eval_interval=0", override)
    assert train.main(argv) == 2
    assert key in error_of(capsys.readouterr().err)
    assert not out.exists(), "a config error must fail before writing anything"


def test_a_global_batch_size_is_that_many_micro_batches(data_root: Path, tmp_path: Path) -> None:
    """tiny.toml: batch_size 4, so a global batch of 8 on one process is 2 micro-batches: the
    same run as grad_accum=2, and its config.toml keeps grad_accum at 1 (any number of ranks
    can resume it)."""
    common = ["--train.max_steps=3", "--train.eval_interval=0", "--train.eval_batches=1"]
    by_global, by_accum = tmp_path / "global", tmp_path / "accum"
    assert run(data_root, by_global, *common, "--train.global_batch_size=8") == 0
    assert run(data_root, by_accum, *common, "--train.grad_accum=2") == 0
    for a, b in zip(train_lines(by_global), train_lines(by_accum), strict=True):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    saved = load_config(by_global / "config.toml").train
    assert (saved.global_batch_size, saved.grad_accum) == (8, 1)


def test_tf32_off_cuda_is_a_config_error(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """TF32 is a CUDA tensor-core mode: asked for on a CPU it is refused, not run as fp32."""
    out = tmp_path / "run"
    assert run(data_root, out, "--train.device=cpu", "--train.dtype=tf32") == 2
    error = error_of(capsys.readouterr().err)
    assert "train.dtype='tf32'" in error and "cpu" in error
    assert not out.exists(), "a config error must fail before writing anything"


# --- metrics and signals stay clean across runs --------------------------------------------------------


class Crash(Exception):
    pass


def test_resume_after_a_crash_logs_each_step_once(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash() -> None:
        raise Crash("stands in for a kill -9 or an OOM between checkpoints")

    out = tmp_path / "run"
    overrides = ["--train.max_steps=8", "--train.eval_interval=5"]
    misbehave_at(monkeypatch, 7, before=crash)
    with pytest.raises(Crash):
        run(data_root, out, *overrides)
    monkeypatch.undo()
    assert load_ckpt(out)["step"] == 5
    assert run(data_root, out, *overrides, "--resume") == 0
    assert [r["step"] for r in train_lines(out)] == list(range(1, 9))


def test_fresh_run_starts_a_fresh_metrics_file(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    misbehave_at(monkeypatch, 2, loss=math.nan)
    out = tmp_path / "run"
    overrides = ["--train.max_steps=3", "--train.eval_interval=0", "--train.eval_batches=1"]
    assert run(data_root, out, *overrides) == 2  # step 1 logged, dies at step 2: no checkpoint
    monkeypatch.undo()
    assert [r["step"] for r in train_lines(out)] == [1]
    assert not (out / checkpoint.CHECKPOINT).exists()
    assert run(data_root, out, *overrides) == 0
    assert [r["step"] for r in train_lines(out)] == [1, 2, 3]


@pytest.mark.parametrize(("signal_at", "status", "saved_at"), [(2, 130, 2), (4, 0, 4)])
def test_ctrl_c_saves_and_exits_130_unless_it_came_on_the_last_step(
    data_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    signal_at: int,
    status: int,
    saved_at: int,
) -> None:
    # SIGINT to this process: caught by train's handler, not pytest's.
    misbehave_at(monkeypatch, signal_at, before=lambda: os.kill(os.getpid(), signal.SIGINT))
    out = tmp_path / "run"
    overrides = ["--train.max_steps=4", "--train.eval_interval=0", "--train.sample_tokens=3"]
    assert run(data_root, out, *overrides) == status
    captured = capsys.readouterr()
    assert load_ckpt(out)["step"] == saved_at
    assert ("stopped by SIGINT" in captured.err) == (saved_at < 4)
    assert ("--- sample" in captured.out) == (saved_at == 4), "a sample only at the run's end"


@pytest.mark.parametrize("spoil_weights", [False, True])
def test_a_signal_saves_at_once_without_evaluating_but_never_non_finite_weights(
    data_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    spoil_weights: bool,
) -> None:
    """torchrun kills its workers 30 s after it forwards a signal: a stop saves before any
    evaluation could outlast that (eval_batches is large here). The weights are checked instead,
    so a step that made them NaN still leaves the last good checkpoint as it was."""
    evaluated: list[int] = []
    real_evaluate = step.evaluate
    monkeypatch.setattr(loop, "evaluate", lambda *a: evaluated.append(1) or real_evaluate(*a))
    misbehave_at(
        monkeypatch,
        3,
        before=lambda: os.kill(os.getpid(), signal.SIGINT),
        spoil_weights=spoil_weights,
    )
    out = tmp_path / "run"
    overrides = ["--train.max_steps=6", "--train.eval_interval=2", "--train.eval_batches=50"]
    assert run(data_root, out, *overrides) == (2 if spoil_weights else 130)
    captured = capsys.readouterr()
    err = captured.err
    assert len(evaluated) == 2 * 2  # val and train-eval at steps 0 and 2, none at the stop
    assert load_ckpt(out)["step"] == (2 if spoil_weights else 3)
    if spoil_weights:
        assert "the weights are not finite at step 3; stopped without saving" in err
    else:
        assert load_ckpt(out)["val_loss"] is None
        assert "step 3: not evaluated, to stop promptly; saved" in captured.out


def test_resume_says_it_replaced_a_run_tokenizer_that_was_not_the_checkpoints(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = copy_run(base_run, tmp_path / "run")
    (out / "tokenizer.json").write_text("{}")
    assert run(data_root, out, f"--train.max_steps={STEPS + 1}", "--resume") == 0
    assert f"note: {out / 'tokenizer.json'} was not the tokenizer" in capsys.readouterr().err
    assert (out / "tokenizer.json").read_bytes() == (
        data_root / "tiny" / "tokenizer.json"
    ).read_bytes()
    assert run(data_root, out, f"--train.max_steps={STEPS + 2}", "--resume") == 0
    assert "was not the tokenizer" not in capsys.readouterr().err  # said once, when it was


def test_a_signal_during_an_evaluation_stops_the_run_once_it_is_saved(
    data_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The evaluation under way finishes and its checkpoint is saved (the ranks evaluate
    together); the run then stops, with no step more (torchrun's ranks agree on it after the
    evaluation: test_a_signal_during_the_first_evaluation_under_torchrun_saves_nothing)."""
    real_evaluate = step.evaluate
    calls = itertools.count()

    def evaluate(*args: Any) -> float:
        if next(calls) == 2:  # val at step 2 (step 0's val and train-eval come first)
            os.kill(os.getpid(), signal.SIGINT)
        return real_evaluate(*args)

    monkeypatch.setattr(loop, "evaluate", evaluate)
    out = tmp_path / "run"
    assert run(data_root, out, "--train.max_steps=6", "--train.eval_interval=2") == 130
    assert [r["step"] for r in eval_lines(out)] == [0, 2]  # step 2's evaluation finished
    assert load_ckpt(out)["step"] == 2 and load_ckpt(out)["val_loss"] is not None
    assert [r["step"] for r in train_lines(out)] == [1, 2]
    # During step 0's, before training: stopped at once, nothing to save, and the same
    # command then starts the run
    calls = itertools.count(2)
    first = tmp_path / "first"
    assert run(data_root, first, "--train.max_steps=6", "--train.eval_interval=2") == 130
    assert "stopped by SIGINT before the first step" in capsys.readouterr().err
    assert not train_lines(first) and not (first / checkpoint.CHECKPOINT).exists()
    assert run(data_root, first, "--train.max_steps=6", "--train.eval_interval=2") == 0
    assert load_ckpt(first)["step"] == 6


def test_a_signal_during_a_step_is_in_that_steps_stop_flag(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks learn of each other's signals only through the flags all-reduced after each
    step: one that came during a step must be in that step's flags, or a torchrun job runs a
    step more before it stops (one process also stops at once, without the flags)."""
    flags: list[list[float]] = []
    real_finish = runtime.StepReadout.finish

    def finish(self: runtime.StepReadout, t: torch.Tensor) -> None:
        flags.append(t.tolist())
        real_finish(self, t)

    monkeypatch.setattr(runtime.StepReadout, "finish", finish)
    misbehave_at(monkeypatch, 2, before=lambda: os.kill(os.getpid(), signal.SIGINT))
    out = tmp_path / "run"
    assert run(data_root, out, "--train.max_steps=4", "--train.eval_interval=0") == 130
    assert [f[1] for f in flags] == [0.0, 1.0]  # (loss, stop, norm) of steps 1 and 2


def test_a_second_sigterm_stops_at_once_with_sigterms_status(
    data_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The first asks for a save after the step; the second does not wait for it."""

    def twice() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)

    misbehave_at(monkeypatch, 2, before=twice)
    out = tmp_path / "run"
    overrides = ["--train.max_steps=4", "--train.eval_interval=0"]
    assert run(data_root, out, *overrides) == 128 + signal.SIGTERM
    assert "interrupted: stopped without saving" in capsys.readouterr().err
    assert not (out / checkpoint.CHECKPOINT).exists()


@pytest.mark.parametrize("torchrun", [False, True])
def test_a_signal_torchrun_forwards_is_not_a_second_one(
    torchrun: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal sent to a whole torchrun job reaches each rank directly and again from
    torchrun a moment later: under torchrun that repeat still saves; a later one, or another
    signal, stops at once."""
    clock = [100.0]
    monkeypatch.setattr(runtime.time, "monotonic", lambda: clock[0])
    with runtime.StopSignal(torchrun=torchrun) as stop:
        stop._handle(signal.SIGTERM, None)
        clock[0] += 0.1
        if not torchrun:
            with pytest.raises(runtime.StopNow):
                stop._handle(signal.SIGTERM, None)
            return
        stop._handle(signal.SIGTERM, None)  # forwarded: the same request
        assert stop.received == "SIGTERM"
        with pytest.raises(runtime.StopNow):
            stop._handle(signal.SIGINT, None)  # another signal is a second request
    with runtime.StopSignal(torchrun=True) as stop:
        stop._handle(signal.SIGTERM, None)
        clock[0] += runtime.FORWARDED_WITHIN_S
        with pytest.raises(runtime.StopNow):
            stop._handle(signal.SIGTERM, None)  # too late to be torchrun's


def test_train_restores_the_signal_handlers(data_root: Path, tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    overrides = ["--train.max_steps=1", "--train.eval_interval=0", "--train.eval_batches=1"]
    assert run(data_root, tmp_path / "run", *overrides) == 0
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


# --- sampling ---------------------------------------------------------------------------------------------


def sample_text(capsys: pytest.CaptureFixture[str], run_dir: Path, *args: str) -> str:
    capsys.readouterr()
    assert sample.main(["--run", str(run_dir), "--prompt", "def ", "--tokens", "20", *args]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n")
    return out[:-1]


def test_a_prompt_longer_than_the_context_is_said_to_be_cut(
    base_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The model sees block_size tokens: a longer prompt conditions the text on its last
    block_size only, which a note says; it is still shown whole."""
    long = "def f(x):\n    return x + 1\n" * 20
    assert sample.main(["--run", str(base_run), "--prompt", long, "--tokens", "5"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(long)
    assert "and the model sees its last 32 (model.block_size)" in err, err
    assert sample.main(["--run", str(base_run), "--prompt", "def ", "--tokens", "5"]) == 0
    assert "model.block_size" not in capsys.readouterr().err


def test_sample_starts_with_the_prompt_and_is_seeded(
    base_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = sample_text(capsys, base_run, "--seed", "0")
    assert text.startswith("def ") and len(text) > len("def ")
    assert sample_text(capsys, base_run, "--seed", "0") == text
    assert sample_text(capsys, base_run, "--seed", "1") != text


def test_sample_generates_as_many_tokens_as_asked(
    base_run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[int] = []
    real = GPT.generate

    def counted(self: GPT, idx: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = real(self, idx, *args, **kwargs)
        made.append(out.size(1) - idx.size(1))
        return out

    monkeypatch.setattr(GPT, "generate", counted)
    sample_text(capsys, base_run, "--seed", "0")  # --tokens 20
    assert made == [20]


def test_sample_passes_its_sampling_flags_to_generate(
    base_run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--temperature (default 0.8), --top-k (default 50, 0 for none) and --top-p (default 1)
    reach the sampler."""
    asked: list[tuple[float, int | None, float | None]] = []
    real = GPT.generate

    def spied(self: GPT, idx: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        asked.append((kwargs["temperature"], kwargs["top_k"], kwargs["top_p"]))
        return real(self, idx, *args, **kwargs)

    monkeypatch.setattr(GPT, "generate", spied)
    sample_text(capsys, base_run)
    sample_text(capsys, base_run, "--temperature", "0.7", "--top-k", "7", "--top-p", "0.9")
    sample_text(capsys, base_run, "--top-k", "0")
    assert asked == [(0.8, 50, 1.0), (0.7, 7, 0.9), (0.8, None, 1.0)]


def test_sample_a_config_toml_cut_short_is_named_not_blamed_for_its_defaults(
    base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A field cut from config.toml would read as its default and be called a mismatch ("4 in
    config.toml", which the file never said): the missing field is named, as on resume."""
    out = copy_run(base_run, tmp_path / "cut")
    toml = out / "config.toml"
    toml.write_text(
        "".join(
            line for line in toml.read_text().splitlines(True) if not line.startswith("n_layer")
        )
    )
    assert sample.main(["--run", str(out), "--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{toml} lacks model.n_layer, which train.py writes" in err
    assert "delete it to sample with the config" in err


def test_sample_a_run_without_config_toml_uses_the_config_its_checkpoint_records(
    base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As resuming does: the same text as with config.toml."""
    out = copy_run(base_run, tmp_path / "no-config")
    (out / "config.toml").unlink()
    assert sample_text(capsys, out, "--seed", "0") == sample_text(capsys, base_run, "--seed", "0")


def test_sample_greedy_ignores_the_seed(base_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    greedy = sample_text(capsys, base_run, "--temperature", "0", "--seed", "0")
    assert greedy.startswith("def ")
    assert sample_text(capsys, base_run, "--temperature", "0", "--seed", "1") == greedy


def test_sample_top_p(base_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    greedy = sample_text(capsys, base_run, "--temperature", "0")
    assert sample_text(capsys, base_run, "--top-p", "1e-6", "--seed", "3") == greedy
    nucleus = sample_text(capsys, base_run, "--top-p", "0.9", "--seed", "3")
    assert nucleus.startswith("def ")
    assert nucleus != sample_text(capsys, base_run, "--top-p", "1", "--seed", "3")


def test_sample_stop_at_eot_ends_at_the_first_separator(
    base_run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A briefly trained model rarely samples the separator: generate() is replaced by one
    that does, after two tokens (its own stopping is tested in test_model.py)."""
    asked: list[int | None] = []

    def generate(self: GPT, idx: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        asked.append(kwargs.get("stop_id"))
        more = torch.tensor([[300, 301, EOT_ID, 302, EOT_ID]], device=idx.device)
        return torch.cat((idx, more), dim=1)

    monkeypatch.setattr(GPT, "generate", generate)
    text = sample_text(capsys, base_run)
    assert text.count(EOT) == 2, "without the flag, generation runs on past separators"
    assert sample_text(capsys, base_run, "--stop-at-eot") == text[: text.index(EOT)]
    assert asked == [None, EOT_ID]


def test_sample_heals_the_prompts_last_token(
    base_run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "def " ends in a lone space token, which training saw rarely before a word: generate()
    gets the prompt without it and draws first among the tokens that start with a space."""
    tokenizer = Tokenizer.from_file(str(base_run / "tokenizer.json"))
    ids = tokenizer.encode("def ").ids
    assert tokenizer.id_to_token(ids[-1]) == "Ġ", "the test needs a prompt ending mid-token"
    seen: list[tuple[list[int], torch.Tensor | None]] = []
    real = GPT.generate

    def spy(self: GPT, idx: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append((idx[0].tolist(), kwargs.get("first_allowed")))
        return real(self, idx, *args, **kwargs)

    monkeypatch.setattr(GPT, "generate", spy)
    for temperature in ("0", "1"):
        assert sample_text(capsys, base_run, "--temperature", temperature).startswith("def ")
    healed, allowed = seen[0]
    assert healed == ids[:-1] and allowed is not None
    spaced = {i for token, i in tokenizer.get_vocab().items() if token.startswith("Ġ")}
    assert set(allowed.nonzero().flatten().tolist()) == spaced
    sample_text(capsys, base_run, "--no-token-healing")
    assert seen[-1] == (ids, None)
    for unhealed in ("d", EOT, f"def{EOT}"):  # one token; ends in the separator
        prompt = tokenizer.encode(unhealed).ids
        assert sample.heal(tokenizer, prompt) == (prompt, None), unhealed
    # A prompt ending in "<", which the separator's text starts with: never the separator
    _, allowed = sample.heal(tokenizer, tokenizer.encode("x <").ids)
    assert allowed is not None and allowed.any() and not allowed[tokenizer.token_to_id(EOT)]
    # Nothing to sample: the prompt as given, not healed (its last token dropped)
    assert sample.sample_run(base_run, "def ", max_new_tokens=0) == "def "


def test_sample_with_another_attention_variant_gives_the_same_text(
    base_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Attention holds no weights: every variant that runs here computes the same function."""
    own = sample_text(capsys, base_run, "--temperature", "0")  # tiny.toml trains naive
    for variant in ("sdpa", "inplace"):
        assert sample_text(capsys, base_run, "--temperature", "0", "--attention", variant) == own


@pytest.mark.slow
@pytest.mark.cxx
def test_flex_samples_on_a_cpu_with_naives_logits(base_run: Path) -> None:
    """flex cannot train on a CPU, but its forward runs there (compiled, so slow the first time):
    the run's logits through it match naive's, at a prompt's length and at the full context."""
    cpu = torch.device("cpu")
    naive, _, config = sample.load_run(base_run, cpu)
    flex, _, _ = sample.load_run(base_run, cpu, attention="flex")
    assert flex.config.attention == "flex"
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for length in (7, 24, config.model.block_size):
            # One sequence, as sampling runs it: the kernel sampling compiles serves this too
            ids = torch.randint(config.model.vocab_size, (1, length), generator=generator)
            torch.testing.assert_close(flex(ids)[0], naive(ids)[0], rtol=1e-5, atol=1e-5)


def test_sample_a_run_whose_variant_cannot_run_here_names_it_and_the_way_out(
    base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GPU run trained with a CUDA-only kernel, sampled on a CPU."""
    out = copy_run_trained_with(base_run, tmp_path / "run", "model", "attention", "sdpa-efficient")
    capsys.readouterr()
    assert sample.main(["--run", str(out), "--device", "cpu"]) == 2
    err = error_of(capsys.readouterr().err)
    assert "'sdpa-efficient' cannot run on cpu" in err and "--attention sdpa" in err
    # No dtype makes a CUDA-only kernel run on a CPU: only another variant is offered.
    for given in ([], ["--attention", "sdpa-cudnn"]):
        argv = ["--run", str(out), "--device", "cpu", "--dtype", "float32", *given]
        assert sample.main(argv) == 2
        err = error_of(capsys.readouterr().err).rstrip()
        assert err.endswith("; sample with another variant, e.g. --attention sdpa"), err
    assert sample_text(capsys, out, "--device", "cpu", "--attention", "sdpa").startswith("def ")


def test_sample_a_tf32_run_off_cuda_in_ieee_fp32(
    base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GPU run trained with TF32, sampled on a CPU: fp32 as usual, not refused."""
    greedy = sample_text(capsys, base_run, "--temperature", "0")
    out = copy_run_trained_with(base_run, tmp_path / "run", "train", "dtype", "tf32")
    assert sample_text(capsys, out, "--temperature", "0", "--device", "cpu") == greedy
    assert torch.get_float32_matmul_precision() == "highest"


def test_sample_dtype_overrides_the_runs_precision(
    base_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--dtype picks the precision the forward runs in, whatever the run trained with: a
    bfloat16 run sampled in float32 runs without autocast, and float32 gives the fp32 run's
    own text; tf32 off CUDA is refused, naming the flag."""
    seen: list[torch.dtype | None] = []
    real = GPT.generate

    def recorded(self: GPT, *args: Any, **kwargs: Any) -> torch.Tensor:
        on = torch.is_autocast_enabled("cpu")
        seen.append(torch.get_autocast_dtype("cpu") if on else None)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GPT, "generate", recorded)
    greedy = sample_text(capsys, base_run, "--temperature", "0")
    assert sample_text(capsys, base_run, "--temperature", "0", "--dtype", "float32") == greedy
    sample_text(capsys, base_run, "--temperature", "0", "--dtype", "bfloat16")
    bf16_run = copy_run_trained_with(base_run, tmp_path / "run", "train", "dtype", "bfloat16")
    sample_text(capsys, bf16_run, "--temperature", "0")
    assert sample_text(capsys, bf16_run, "--temperature", "0", "--dtype", "float32") == greedy
    assert seen == [None, None, torch.bfloat16, torch.bfloat16, None]
    assert sample.main(["--run", str(base_run), "--dtype", "tf32"]) == 2
    assert "--dtype tf32: TF32 is a CUDA mode" in capsys.readouterr().err


def test_sample_longer_than_the_context(base_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = sample_text(capsys, base_run, "--tokens", "50")  # block_size is 32
    assert text.startswith("def ")


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--tokens", "-3"], "--tokens"),
        (["--top-k", "-5"], "--top-k"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--temperature", "-1"], "--temperature"),
        (["--temperature", "nan"], "--temperature"),
        (["--device", "cuda:x"], "--device"),
        (["--seed", str(2**64)], "--seed"),
        (
            ["--prompt", "ab\udcff"],
            "--prompt 'ab\\udcff' is not UTF-8 text",
        ),  # bytes a shell passed
    ],
)
def test_sample_bad_arguments_name_the_flag(
    base_run: Path, capsys: pytest.CaptureFixture[str], args: list[str], named: str
) -> None:
    assert sample.main(["--run", str(base_run), *args]) == 2
    assert named in error_of(capsys.readouterr().err)


@pytest.mark.cxx
def test_sampling_with_another_variant_is_not_refused_for_training_dropout(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """flex has no dropout, which only training applies: a run trained with dropout may still
    be sampled with it."""
    out = tmp_path / "run"
    one_step = ["--train.max_steps=1", "--train.eval_interval=0", "--train.eval_batches=1"]
    assert run(data_root, out, "--model.dropout=0.1", *one_step) == 0
    capsys.readouterr()
    assert sample.main(["--run", str(out), "--attention", "flex", "--tokens", "2"]) == 0
    model, _, _ = sample.load_run(out, torch.device("cpu"), attention="inplace")
    assert model.config.dropout == 0.0 and load_config(out / "config.toml").model.dropout == 0.1


def test_ctrl_c_while_sampling_keeps_the_text_so_far_and_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*args: object, stream: Callable[[str], None], **kwargs: object) -> str:
        stream("def f(")
        raise KeyboardInterrupt

    monkeypatch.setattr(sample, "sample_run", interrupted)
    assert sample.main(["--run", "runs/any", "--tokens", "3000"]) == 130
    captured = capsys.readouterr()
    assert captured.out == "def f(\n"
    assert captured.err == (
        "interrupted before the sample was complete (--tokens 3000); above, the text sampled "
        "so far\n"
    )


def test_sampled_text_streams_as_it_is_drawn(base_run: Path) -> None:
    """The pieces, the prompt first, make the text returned; a character whose bytes span
    two tokens comes out once whole, not as a replacement character."""
    for stop in (False, True):
        pieces: list[str] = []
        text = sample.sample_run(
            base_run, "def", 30, seed=2, stop_at_eot=stop, stream=pieces.append
        )
        assert "".join(pieces) == text and len(pieces) > 5 and text.startswith(pieces[0])
    tokenizer = Tokenizer.from_file(str(base_run / "tokenizer.json"))
    lead, tail = (tokenizer.token_to_id(c) for c in "Ã©")  # é's bytes, 0xC3 0xA9, byte-level
    pieces = []
    shown = sample.Shown(tokenizer, tokenizer.encode("a").ids, None, pieces.append)
    shown.add(torch.tensor([[lead]]))
    assert pieces == ["a"]  # half a character: not yet
    shown.add(torch.tensor([[tail]]))
    assert pieces == ["a", "é"]
    # A prompt cut in the middle of é (healing drops its last token): é once the byte comes.
    pieces = []
    shown = sample.Shown(tokenizer, [*tokenizer.encode("a").ids, lead], None, pieces.append)
    shown.add(torch.tensor([[tail]]))
    shown.finish("aé")
    assert pieces == ["a", "é"]
    # Given the whole prompt, as sample_run gives it: shown whole, first
    pieces = []
    shown = sample.Shown(tokenizer, [*tokenizer.encode("a").ids, lead], None, pieces.append, "aé")
    shown.add(torch.tensor([[tail]]))
    shown.add(torch.tensor([[tokenizer.token_to_id("b")]]))
    shown.finish("aéb")
    assert pieces == ["aé", "b"]


def test_sample_to_a_full_disk_or_a_stdout_that_cannot_encode_says_so(
    base_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An error naming stdout, not a traceback; and a stdout that cannot encode the text is
    named, not blamed on the input (the prompt is valid)."""
    monkeypatch.setattr(sys, "stdout", FullDisk())
    assert sample.main(["--run", str(base_run), "--tokens", "2"]) == 2
    assert capsys.readouterr().err == (
        "error: cannot write to stdout (No space left on device); the output is cut short\n"
    )
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="ascii"))
    assert sample.main(["--run", str(base_run), "--prompt", "é", "--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "error: stdout's encoding, ascii, cannot show the sampled text" in err
    assert "PYTHONIOENCODING=utf-8" in err


def test_a_healed_prompt_is_shown_whole_before_the_first_draw(base_run: Path) -> None:
    """Healing drops "x = "'s last token (a lone space) to draw it again among the tokens
    that start with it; what is shown first is still the prompt as typed, so a Ctrl-C before
    the first draw keeps it."""
    tokenizer = Tokenizer.from_file(str(base_run / "tokenizer.json"))
    healed, _ = sample.heal(tokenizer, tokenizer.encode("x = ").ids)
    assert tokenizer.decode(healed) == "x =", "the case this test is about"
    pieces: list[str] = []
    text = sample.sample_run(base_run, "x = ", 10, seed=0, stream=pieces.append)
    assert pieces[0] == "x = " and "".join(pieces) == text


def test_sampling_on_a_gpu_without_bf16_or_tf32_tensor_cores(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before Ampere: a run trained in bf16 or tf32 samples in fp32, said; asking for either
    with --dtype is an error naming the flag."""
    cuda = torch.device("cuda")  # only named, with a T4's compute capability: no GPU needed
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    for trained, cores in (("bfloat16", "bf16"), ("tf32", "TF32")):
        config = load_config(TINY, [f"--train.dtype={trained}"])
        assert sample.sampling_precision(config, cuda, None).train.dtype == "float32"
        assert (
            f"note: the run trained in {trained}, which needs {cores} tensor cores: this GPU "
            "(compute capability 7.5) has none" in capsys.readouterr().err
        )
        with pytest.raises(sample.SampleError, match=rf"--dtype {trained} needs {cores} tensor"):
            sample.sampling_precision(config, cuda, trained)
    float32 = load_config(TINY, ["--train.dtype=float32"])
    assert sample.sampling_precision(float32, cuda, "auto").train.dtype == "auto"
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert sample.sampling_precision(float32, cuda, "bfloat16").train.dtype == "bfloat16"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_sample_piped_into_a_reader_that_stops_ends_quietly(base_run: Path) -> None:
    """`sample.py | head`: once the reader has gone, sampling stops with the shell's status
    for SIGPIPE (128 + 13) and no traceback. Beside it, `> log 2>&1` on a full disk: status 2,
    though the error line cannot be written either (not 120, Python's for a flush that fails
    at exit)."""
    argv = [sys.executable, str(ROOT / "sample.py"), "--run", str(base_run), "--tokens", "3000"]
    with open("/dev/full", "w") as full:
        both = subprocess.Popen(argv, stdout=full, stderr=full)
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        try:
            assert proc.stdout is not None and proc.stderr is not None
            assert proc.stdout.read(1)  # the prompt, then the stream: the reader has its line
            proc.stdout.close()
            err = proc.stderr.read().decode()
            assert proc.wait(timeout=120) == 128 + signal.SIGPIPE, err
            assert both.wait(timeout=120) == 2
        finally:  # a failure or time-out leaves neither running
            both.kill()
            both.wait()
    assert "Traceback" not in err and "error" not in err, err


@pytest.mark.parametrize(
    ("error", "status", "said"),
    [
        (BrokenPipeError(errno.EPIPE, "Broken pipe"), 128 + signal.SIGPIPE, ""),
        (
            OSError(errno.ENOSPC, "No space left on device"),
            2,
            "error: cannot write to stdout (No space left on device); the output is cut short",
        ),
    ],
    ids=["reader gone", "disk full"],
)
def test_a_stdout_that_fails_stops_the_run_saved_as_sigpipe_would(
    data_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: OSError,
    status: int,
    said: str,
) -> None:
    """`train.py | head -3`: its fourth line, at step 10's evaluation, finds the reader gone.
    The run stops there, saved (resumable, not an error to fix), with the shell's status for
    SIGPIPE; a write that failed otherwise (a full disk) says why, with status 2."""
    out = tmp_path / "run"
    monkeypatch.setattr(sys, "stdout", ReaderTakesLines(3, error))
    assert run(data_root, out, "--train.max_steps=30", "--train.eval_interval=10") == status
    err = capsys.readouterr().err
    cause = "SIGPIPE (stdout's reader has gone, or writing to it failed)"
    assert f"stopped by {cause} after step 10; resume with " in err, err
    assert said in err and "Traceback" not in err, err
    assert load_ckpt(out)["step"] == 10 and train_lines(out)[-1]["step"] == 10
    printed = sys.stdout.getvalue().splitlines()
    assert len(printed) == 3 and printed[-1].startswith("step 0: val loss")


def test_train_piped_into_head_stops_saved_at_the_line_it_could_not_write(
    data_root: Path, tmp_path: Path
) -> None:
    """`python train.py ... | head -3`, stdout buffered as a pipe's is: each line goes out as
    it is printed (head has its three by step 0's evaluation), and the next evaluation's finds
    the reader gone. The run stops there, saved, with the shell's status for SIGPIPE, and
    nothing fails again at exit (Python's flush of what could not be written: status 120)."""
    out = tmp_path / "run"
    overrides = ["--train.max_steps=1000", "--train.eval_interval=10"]
    argv = [sys.executable, str(ROOT / "train.py"), *run_argv(data_root, out, *overrides)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        lines = [proc.stdout.readline() for _ in range(3)]
        proc.stdout.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == 128 + signal.SIGPIPE, err
    assert lines[2].startswith("step 0: val loss"), lines
    stopped = re.search(r"stopped by SIGPIPE \(stdout's reader has gone.*\) after step (\d+);", err)
    assert stopped and "Traceback" not in err and "Exception ignored" not in err, err
    step = int(stopped[1])  # 10, or a later evaluation's where the pipe took that line first
    assert step % 10 == 0 and step < 1000
    assert load_ckpt(out)["step"] == step and train_lines(out)[-1]["step"] == step


def test_a_line_stdouts_encoding_cannot_show_is_an_error_naming_it(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """An --out whose name stdout's encoding lacks (PYTHONIOENCODING=ascii): the evaluation's
    line fails after its save. That is not a reader gone: an error that says what to set."""
    out = tmp_path / "r\u00e9sum\u00e9"
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="ascii"))
    assert run(data_root, out, "--train.max_steps=30", "--train.eval_interval=10") == 2
    err = capsys.readouterr().err
    assert "error: stdout's encoding, ascii, cannot show a line of the run ('\u00e9')" in err, err
    assert "set PYTHONIOENCODING=utf-8, then continue with --resume --out" in err, err
    assert load_ckpt(out)["step"] == 10


def test_a_finished_run_samples_nothing_into_a_stdout_that_failed(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last evaluation's line finds the reader gone: the run is whole (the last step ends
    as planned), and the sample, which only stdout shows, is not drawn."""
    sampled = []
    monkeypatch.setattr(train, "_sample_at_end", lambda *a: sampled.append(a) or 0)
    monkeypatch.setattr(sys, "stdout", ReaderTakesLines(4, BrokenPipeError(errno.EPIPE, "")))
    overrides = ["--train.max_steps=12", "--train.eval_interval=10", "--train.sample_tokens=5"]
    assert run(data_root, tmp_path / "run", *overrides) == 128 + signal.SIGPIPE
    assert load_ckpt(tmp_path / "run")["step"] == 12 and sampled == []


def test_a_stdout_gone_before_training_stops_before_the_first_step(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`train.py | head -1`: the reader is gone by the end of the run's first lines; the
    evaluation of the untrained model ends the run, as a signal there does."""
    out = tmp_path / "run"
    monkeypatch.setattr(sys, "stdout", ReaderTakesLines(1, BrokenPipeError(errno.EPIPE, "")))
    assert run(data_root, out, "--train.max_steps=30", "--train.eval_interval=10") == 141
    assert "before the first step: nothing trained or saved" in capsys.readouterr().err
    assert not (out / checkpoint.CHECKPOINT).exists() and not train_lines(out)


def test_a_stderr_gone_costs_its_lines_not_the_run(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`2>/dev/full`, or stderr's reader gone: the progress bar and the notes are lost, the
    run is not."""
    out = tmp_path / "run"
    monkeypatch.setattr(sys, "stderr", FullDisk())
    # warmup_steps past the end: a warning on stderr before the first step
    assert run(data_root, out, "--train.max_steps=12", "--train.warmup_steps=20") == 0
    assert load_ckpt(out)["step"] == 12
    assert "step 12: val loss" in capsys.readouterr().out


def test_sample_from_a_missing_dir_or_a_file_says_so(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nope = tmp_path / "nope"
    assert sample.main(["--run", str(nope)]) == 2
    err = error_of(capsys.readouterr().err)
    assert f"does not exist; train it first (python train.py --out {nope})" in err
    # A run stopped before its first checkpoint: it has the tokenizer, not the weights
    started = tmp_path / "started"
    started.mkdir()
    shutil.copy(base_run / "tokenizer.json", started)
    assert sample.main(["--run", str(started)]) == 2
    err = error_of(capsys.readouterr().err)
    assert f"no checkpoint at {started / checkpoint.CHECKPOINT}; train it first" in err
    # With its config.toml, it starts over with the run's settings, not train.py's defaults
    shutil.copy(base_run / "config.toml", started)
    assert sample.main(["--run", str(started)]) == 2
    again = f"python train.py --config {started / 'config.toml'} --out {started}"
    assert f"train it first ({again})" in error_of(capsys.readouterr().err)
    # Still training, before its first save: not "train it first", which the lock refuses
    with rundir.run_lock(started):
        assert sample.main(["--run", str(started)]) == 2
    err = error_of(capsys.readouterr().err)
    assert f"yet: the run is training (pid {os.getpid()})" in err and "train it" not in err
    assert rundir.lock_holder(started) is None  # the lock went with the run
    # A corpus folder has a tokenizer.json too: not a run, and no command that trains there
    assert sample.main(["--run", str(data_root / "tiny")]) == 2
    err = error_of(capsys.readouterr().err)
    assert f"--run {data_root / 'tiny'} is a prepared corpus, not a run; give --run" in err
    assert "train.py --out" not in err
    ckpt = base_run / checkpoint.CHECKPOINT
    assert sample.main(["--run", str(ckpt)]) == 2  # the checkpoint itself
    assert f"is a file; give the run directory ({base_run})" in error_of(capsys.readouterr().err)


def test_sample_from_a_dir_without_checkpoint_exits_2(
    base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    no_ckpt = tmp_path / "no-ckpt"
    no_ckpt.mkdir()
    for name in ("config.toml", "tokenizer.json"):
        shutil.copyfile(base_run / name, no_ckpt / name)
    empty = tmp_path / "empty"
    empty.mkdir()
    for run_dir in (no_ckpt, empty):
        capsys.readouterr()
        assert sample.main(["--run", str(run_dir), "--prompt", "def "]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith("error: ") and str(run_dir) in captured.err
        assert captured.out == ""


# --- DDP ----------------------------------------------------------------------------------------------------


def torchrun_command(argv: list[str], **env: str) -> dict[str, Any]:
    """What runs train.py on 2 CPU ranks under torchrun: its command and environment (this
    process's, without the torchrun variables a test may have set), for subprocess."""
    outer = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone"]
    return {
        "args": [*launcher, "train.py", *argv],
        "cwd": ROOT,
        "env": outer | {"OMP_NUM_THREADS": "1"} | env,
        "text": True,
    }


# Each rank's share and what one process takes for the same step: one micro-batch of twice
# the rows; or one config whose global batch holds, its 2 micro-batches per rank derived (the
# ranks then run what an explicit --train.grad_accum=2 runs: test_config.py checks that each
# gives a rank its micro-batches).
SAME_STEP = {
    "grad_accum=1": (
        ["--train.batch_size=2"],
        ["--train.batch_size=4"],
        "128 tokens per step (2 ranks x 64)",
    ),
    "global_batch_size": (
        ["--train.batch_size=2", "--train.global_batch_size=8"],
        ["--train.batch_size=2", "--train.global_batch_size=8"],
        "256 tokens per step (2 ranks x 128), 2 micro-batches of 2 sequences per rank",
    ),
}


SAME_STEP_COMMON = ["--train.max_steps=3", "--train.eval_interval=0", "--train.eval_batches=1"]
SAME_STEP_COMMON += ["--train.peak_tflops=1"]


@pytest.fixture(scope="module")
def two_rank_runs(
    data_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, subprocess.CompletedProcess[str]]]:
    """Each SAME_STEP case's run on 2 ranks: its folder and process. The jobs run at once (each
    starts 3 processes that import torch, ~7 s alone on a slow machine)."""
    root = tmp_path_factory.mktemp("two_ranks")
    jobs = {
        case: (
            root / case,
            subprocess.Popen(
                **torchrun_command(run_argv(data_root, root / case, *SAME_STEP_COMMON, *per_rank)),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            ),
        )
        for case, (per_rank, _, _) in SAME_STEP.items()
    }
    try:
        runs = {}
        for case, (out, proc) in jobs.items():
            stdout, stderr = proc.communicate(timeout=180)
            runs[case] = (
                out,
                subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr),
            )
        return runs
    finally:  # a failure or time-out leaves none running into later tests
        for _, proc in jobs.values():
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "one_process", "announced"),
    [(case, one, said) for case, (_, one, said) in SAME_STEP.items()],
    ids=SAME_STEP,
)
def test_two_ranks_match_one_process_taking_the_same_rows(
    data_root: Path,
    tmp_path: Path,
    two_rank_runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]],
    case: str,
    one_process: list[str],
    announced: str,
) -> None:
    ddp, done = two_rank_runs[case]
    single = tmp_path / "single"
    assert done.returncode == 0, done.stderr[:6000]
    assert announced in done.stdout
    assert run(data_root, single, *SAME_STEP_COMMON, *one_process) == 0

    # Only rank 0 writes: one line per step and one for the final eval.
    assert [r["step"] for r in read_metrics(ddp)] == [1, 2, 3, 3]
    for a, b in zip(train_lines(ddp), train_lines(single), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)  # reduced, not summed
        # The whole job's tokens: both ranks' micro-batches.
        assert a["tokens_per_s"] == pytest.approx(job_tokens_per_s(ddp, a, world_size=2))
        assert a["mfu"] == pytest.approx(a["tflops"] / 2)  # the job's rate over 2 devices' peak
    # Evaluation reads a step's worth of windows per eval batch: the same ones either way.
    for a, b in zip(eval_lines(ddp), eval_lines(single), strict=True):
        assert a["val_loss"] == pytest.approx(b["val_loss"], abs=1e-5)
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-5)
    a, b = load_ckpt(ddp), load_ckpt(single)
    assert a["step"] == b["step"] == 3
    # Each rank seeds with seed + rank (its own dropout masks), and both states are kept.
    assert len(a["rng"]) == 2 and not torch.equal(a["rng"][0]["torch"], a["rng"][1]["torch"])
    for name, tensor in b["model"].items():
        torch.testing.assert_close(a["model"][name], tensor, atol=1e-5, rtol=0, msg=name)


def rank_pids(launcher: int) -> dict[int, int]:
    """{rank: pid} of torchrun's workers, from /proc."""
    ranks = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            env = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        rank = [e for e in env if e.startswith(b"RANK=")]
        if ppid == launcher and rank:
            ranks[int(rank[0][5:])] = int(stat.parent.name)
    return ranks


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks in /proc")
@pytest.mark.parametrize("whole_job", [False, True])
def test_sigterm_to_one_rank_stops_both_after_rank_0_saved(
    whole_job: bool, data_root: Path, tmp_path: Path
) -> None:
    """Rank 1 alone is signalled (rank 0 is the one that saves), or every process of the job
    is, as a scheduler stops a job (rank 0 then gets it twice: torchrun forwards its own): both
    ranks stop at the same step, rank 0 saves, and both exit with SIGTERM's status, which
    torchrun reports when it was not signalled itself."""
    out = tmp_path / "ddp"
    overrides = ["--train.max_steps=100000", "--train.eval_interval=0", "--train.eval_batches=1"]
    proc = subprocess.Popen(
        **torchrun_command(run_argv(data_root, out, *overrides)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 90
        metrics = out / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert proc.poll() is None, proc.communicate()[0][-6000:]
            assert time.monotonic() < deadline, "no step logged within 90 s"
            time.sleep(0.05)
        ranks = rank_pids(proc.pid)
        for pid in [proc.pid, *ranks.values()] if whole_job else [ranks[1]]:
            os.kill(pid, signal.SIGTERM)
        log = proc.communicate(timeout=90)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, "torchrun reports a stopped run as not finished"
    assert "stopped by SIGTERM" in log, log[-6000:]
    assert "interrupted: stopped without saving" not in log, log[-6000:]
    if not whole_job:  # signalled itself, torchrun stops with its own error instead
        assert log.count("exitcode  : 143") == 2, log[-6000:]  # torchrun's report, per rank
    stopped_at = load_ckpt(out)["step"]
    assert stopped_at >= 1
    assert train_lines(out)[-1]["step"] == stopped_at


def eval_batches_lasting(seconds: float) -> int:
    """train.eval_batches for an evaluation (val and train losses) of about `seconds` by a rank
    of tiny.toml's model, which computes on one thread: timed here, so it lasts as long on a
    slow machine as on a fast one."""
    config = load_config(TINY)
    model = GPT(config.model).eval()
    x = torch.randint(
        0, config.model.vocab_size, (config.train.batch_size, config.model.block_size)
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            model(x, x)
            # The fastest of 5 rounds: a round another process stalled would make the batch
            # seem slower, and the evaluation too short for the signal to land in it
            batch_s = min(timeit.repeat(lambda: model(x, x), number=10, repeat=5)) / 10
    finally:
        torch.set_num_threads(threads)
    return math.ceil(seconds / (2 * batch_s))


@pytest.mark.slow
def test_a_signal_during_the_first_evaluation_under_torchrun_saves_nothing(
    data_root: Path, tmp_path: Path
) -> None:
    """Ctrl-C to a torchrun job while it evaluates the untrained model: the ranks agree on it
    after the evaluation and stop there, nothing trained or saved, as one process does. They
    used to learn of it from the next step's flags, read a step late: two steps trained, and a
    checkpoint the same command then refused to start over."""
    out = tmp_path / "ddp"
    # An evaluation of seconds: the signal, a second after its first line, lands in it
    batches = eval_batches_lasting(3.0)
    overrides = [
        "--train.max_steps=20",
        "--train.eval_interval=10",
        f"--train.eval_batches={batches}",
    ]
    proc = subprocess.Popen(
        **torchrun_command(run_argv(data_root, out, *overrides), PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    log = []
    try:
        for line in proc.stdout:  # rank 0's first line comes just before the evaluation
            log.append(line)
            if "parameters (without position embeddings)" in line:
                break
        time.sleep(1.0)
        assert proc.poll() is None and not (out / "metrics.jsonl").read_text().strip()
        proc.send_signal(signal.SIGINT)
        log.append(proc.communicate(timeout=120)[0])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(log)
    assert text.count("stopped by SIGINT before the first step: nothing trained or saved") == 1
    assert not (out / checkpoint.CHECKPOINT).exists(), text[-6000:]
    assert not train_lines(out), text[-6000:]


def test_an_error_of_a_rank_other_than_0_is_marked_as_its_own(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under torchrun each rank says its error: ranks other than 0 mark theirs, as PyTorch's
    logs do, in one write, so that two ranks' lines do not run together into one."""
    torchrun_env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    for name, value in (torchrun_env | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}).items():
        monkeypatch.setenv(name, value)
    train._say_error("error: train.global_batch_size=12 does not split")
    assert capsys.readouterr().err == "[rank1]: error: train.global_batch_size=12 does not split\n"
    monkeypatch.setenv("RANK", "0")
    train._say_error("error: x")
    assert capsys.readouterr().err == "error: x\n"
    monkeypatch.setenv("WORLD_SIZE", "two")  # the environment is the error: said unmarked
    train._say_error("error: WORLD_SIZE='two' ...")
    assert capsys.readouterr().err == "error: WORLD_SIZE='two' ...\n"


def test_lr_warms_up_to_the_peak_once_then_decays_to_min_lr() -> None:
    tc = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=4, max_steps=20)
    lrs = [optim.lr_at(i, tc) for i in range(tc.max_steps + 1)]
    assert lrs[:4] == pytest.approx([2e-4, 4e-4, 6e-4, 8e-4])  # linear, from above zero
    assert lrs[4] == pytest.approx(1e-3) and lrs.count(max(lrs)) == 1
    assert all(a > b for a, b in itertools.pairwise(lrs[4:]))  # cosine: falls every step
    assert lrs[12] == pytest.approx((1e-3 + 1e-4) / 2)  # halfway through the decay
    assert lrs[20] == pytest.approx(1e-4) and min(lrs) >= 1e-4


def test_a_run_shorter_than_its_warmup_says_so(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tiny.toml warms up for 5 steps: a 3-step run never reaches train.lr, a 6-step one reaches
    it at its last step and never decays; a 7-step one decays."""
    one_eval = ["--train.eval_interval=0", "--train.eval_batches=1", "--train.lr=0.003"]
    assert run(data_root, tmp_path / "short", "--train.max_steps=3", *one_eval) == 0
    err = capsys.readouterr().err
    assert "train.warmup_steps=5 with train.max_steps=3" in err
    assert "to 0.0015 at the last step" in err  # lr x 3/6
    assert run(data_root, tmp_path / "peak", "--train.max_steps=6", *one_eval) == 0
    assert "to 0.003 at the last step" in capsys.readouterr().err
    assert run(data_root, tmp_path / "long", "--train.max_steps=7", *one_eval) == 0
    assert "warmup_steps" not in capsys.readouterr().err
    no_warmup = ["--train.max_steps=1", "--train.warmup_steps=0"]  # one step at the peak
    assert run(data_root, tmp_path / "one", *no_warmup, *one_eval) == 0
    assert "warmup_steps" not in capsys.readouterr().err


def test_the_last_evaluation_is_of_the_final_weights_on_each_split(
    base_run: Path, data_root: Path
) -> None:
    """val_loss on val.bin's fixed windows, train_loss on train.bin's own fixed windows."""
    config = load_config(base_run / "config.toml")
    model = GPT(config.model)
    model.load_state_dict(load_ckpt(base_run)["model"])
    cpu, folder = torch.device("cpu"), data_root / "tiny"
    seeds = {
        k: b.seed
        for k, b in train.token_batches(config, folder, meta(data_root), cpu, 0, 1).items()
    }
    assert len(set(seeds.values())) == 3, "each sampler draws its own windows"
    last = eval_lines(base_run)[-1]
    assert last["step"] == STEPS
    for key, split, sampler in (("val_loss", "val", "val"), ("train_loss", "train", "train_eval")):
        windows = TokenBatches(
            folder / f"{split}.bin",
            config.model.block_size,
            config.train.batch_size,
            seeds[sampler],
            cpu,
        )
        expected = step.evaluate(model, windows, config.train.eval_batches, None)
        assert last[key] == pytest.approx(expected, rel=1e-5), key


def test_every_param_group_follows_the_schedule(base_run: Path) -> None:
    tc = load_config(base_run / "config.toml").train
    groups = load_ckpt(base_run)["optimizer"]["param_groups"]
    assert len(groups) == 2
    assert all(g["lr"] == pytest.approx(optim.lr_at(STEPS - 1, tc)) for g in groups)
    for r in train_lines(base_run):  # the lr that step ran with: step s is lr_at(s - 1)
        assert r["lr"] == pytest.approx(optim.lr_at(r["step"] - 1, tc))


# --- the optimizer and the step, by themselves ------------------------------------------------------


def small_model(seed: int = 0, dropout: float = 0.0) -> GPT:
    torch.manual_seed(seed)
    return GPT(
        load_config(
            TINY, ["--model.vocab_size=64", "--model.block_size=16", f"--model.dropout={dropout}"]
        ).model
    )


def test_weight_decay_on_matrices_only() -> None:
    model = small_model()
    tc = TrainConfig(weight_decay=0.25, beta1=0.8, beta2=0.9)
    decayed, plain = optim.build_optimizer(model, tc, torch.device("cpu")).param_groups
    matrices = {id(p) for p in model.parameters() if p.dim() == 2}
    assert {id(p) for p in decayed["params"]} == matrices
    assert {id(p) for p in plain["params"]} == {id(p) for p in model.parameters()} - matrices
    assert (decayed["weight_decay"], plain["weight_decay"]) == (0.25, 0.0)
    assert decayed["betas"] == plain["betas"] == (0.8, 0.9)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_checkpoint_from_foreach_adamw_resumes_on_this_devices_fused_path(
    device: str, tmp_path: Path
) -> None:
    """Written where AdamW runs foreach (its step counts on the CPU), resumed where it is
    fused: the groups take this device's path, each step count lands on its parameter's
    device, where the fused kernel reads it, and a step runs."""
    tc = TrainConfig()
    model = small_model().to(device)
    x, y = (t.to(device) for t in batch(0, 2))
    groups = [
        {"params": g["params"]}
        for g in optim.build_optimizer(model, tc, torch.device(device)).param_groups
    ]
    written = torch.optim.AdamW(groups, foreach=True)
    model(x, y)[1].backward()
    written.step()
    torch.save(written.state_dict(), tmp_path / "optimizer.pt")
    state = torch.load(tmp_path / "optimizer.pt", map_location="cpu", weights_only=True)
    resumed = optim.build_optimizer(model, tc, torch.device(device))
    optim.load_optimizer_state(resumed, state, tc)
    assert all((g["fused"], g["foreach"]) == (True, None) for g in resumed.param_groups)
    assert all(resumed.state[p]["step"].device == p.device for p in model.parameters())
    model(x, y)[1].backward()
    resumed.step()
    assert all(resumed.state[p]["step"].item() == 2 for p in model.parameters())


def batch(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (rows, 17), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def sgd_step(model: GPT, micro: list[Any], clip: float) -> tuple[step.StepResult, torch.Tensor]:
    """train_step with SGD at lr 1: the parameters move by exactly the (clipped) gradient."""
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    result = step.train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), micro, clip)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    return result, before - after


def test_train_step_clips_the_update_and_reports_the_norm_before() -> None:
    model = small_model()
    x, y = batch(0, 4)
    model(x, y)[1].backward()
    norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    model.zero_grad()
    assert norm > 1e-2
    result, update = sgd_step(copy.deepcopy(model), [(x, y)], clip=1e-2)
    assert result.grad_norm == pytest.approx(norm.item(), rel=1e-5)
    assert update.norm().item() == pytest.approx(1e-2, rel=1e-4)
    # grad_clip=0 turns clipping off: the whole gradient, and no norm computed
    result, update = sgd_step(model, [(x, y)], clip=0.0)
    assert result.grad_norm is None
    assert update.norm().item() == pytest.approx(norm.item(), rel=1e-5)


def test_train_step_clips_where_the_device_has_no_multi_tensor_norm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As on MPS, where clip_grad_norm_(foreach=True) raises: the per-tensor loop, same norm."""
    x, y = batch(0, 4)
    expected, _ = sgd_step(small_model(), [(x, y)], clip=1e-2)
    monkeypatch.setattr(clip_grad, "_device_has_foreach_support", lambda device: False)
    monkeypatch.setattr(clip_grad, "_has_foreach_support", lambda tensors, device: False)
    result, update = sgd_step(small_model(), [(x, y)], clip=1e-2)
    assert result.grad_norm.item() == pytest.approx(expected.grad_norm.item(), rel=1e-6)
    assert update.norm().item() == pytest.approx(1e-2, rel=1e-4)


def test_gradient_accumulation_matches_one_batch_of_all_the_rows() -> None:
    x, y = batch(0, 4)
    one, update_one = sgd_step(small_model(), [(x, y)], clip=1e9)
    two, update_two = sgd_step(small_model(), [(x[:2], y[:2]), (x[2:], y[2:])], clip=1e9)
    assert two.loss.item() == pytest.approx(one.loss.item(), rel=1e-5)
    assert two.grad_norm.item() == pytest.approx(one.grad_norm.item(), rel=1e-5)
    torch.testing.assert_close(update_two, update_one, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_evaluate_is_the_mean_loss_over_its_fixed_windows(tmp_path: Path, dropout: float) -> None:
    """In eval mode (no dropout), over the same windows each time; training mode after."""
    model = small_model(dropout=dropout)
    tokens = tmp_path / "val.bin"
    np.random.default_rng(0).integers(0, 64, 2000, dtype=np.uint16).tofile(tokens)
    batches = TokenBatches(tokens, block_size=16, batch_size=4, seed=3, device=torch.device("cpu"))
    with torch.no_grad():
        model.eval()
        expected = sum(model(*batches.next())[1].item() for _ in range(5)) / 5
    model.train()
    assert step.evaluate(model, batches, 5, None) == pytest.approx(expected, rel=1e-6)
    assert step.evaluate(model, batches, 5, None) == pytest.approx(expected, rel=1e-6)
    assert model.training


@pytest.mark.parametrize("keeps_rows", ["", "global_batch_size", "grad_accum"])
def test_resuming_on_another_number_of_processes_says_what_changes(
    base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], keeps_rows: str
) -> None:
    """A run two ranks saved (one RNG state each), resumed by one process: with batch_size
    unchanged, each step takes half the rows and evaluates on other windows, unless a
    global_batch_size or twice the micro-batches keep the rows, and then (without dropout) it
    matches to rounding. Said in one line, as a changed attention variant or linear path is."""
    out = copy_run(base_run, tmp_path / "ranks")
    ckpt = load_ckpt(out)
    ckpt["rng"] = [ckpt["rng"][0], ckpt["rng"][0]]
    batch = ckpt["config"]["train"]["batch_size"]
    resume = ["--out", str(out), "--resume", f"--train.max_steps={STEPS + 1}"]
    if keeps_rows == "global_batch_size":
        ckpt["config"]["train"]["global_batch_size"] = 2 * batch
        resume.append(f"--train.global_batch_size={2 * batch}")
    elif keeps_rows == "grad_accum":
        resume.append("--train.grad_accum=2")
    torch.save(ckpt, out / checkpoint.CHECKPOINT)
    capsys.readouterr()
    assert train.main(resume) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "rows" in line or "windows" in line]
    assert len(said) == 1, said
    assert "1 process where it trained on 2: " in said[0]
    assert "dropout" not in said[0]  # the tiny config has none
    rows = f"a step takes {batch} rows over all processes where it took {2 * batch}"
    assert (rows in said[0]) != bool(keeps_rows)
    assert ("each step trains on the rows it would have drawn" in said[0]) == bool(keeps_rows)
    assert ("evaluated on other windows" in said[0]) != bool(keeps_rows)
    assert ("matches one that never stopped to rounding" in said[0]) == bool(keeps_rows)
    assert load_ckpt(out)["step"] == STEPS + 1


def test_a_steps_rows_do_not_depend_on_how_they_are_split(tmp_path: Path) -> None:
    """The offsets come from one stream: two micro-batches of 4 rows, or two ranks' 4 rows
    each, read what one micro-batch of 8 does, which a resume on other ranks relies on."""
    tokens = tmp_path / "train.bin"
    np.random.default_rng(0).integers(0, 64, 5000, dtype=np.uint16).tofile(tokens)
    cpu = torch.device("cpu")

    def rows(batch_size: int, micro: int, rank: int = 0, world: int = 1) -> torch.Tensor:
        batches = TokenBatches(tokens, 16, batch_size, 3, cpu, rank, world)
        return torch.cat([batches.next()[0] for _ in range(micro)])

    one = rows(8, 1)
    assert torch.equal(rows(4, 2), one)
    assert torch.equal(torch.cat([rows(4, 1, rank, 2) for rank in (0, 1)]), one)


def test_restore_rng_takes_this_ranks_state() -> None:
    states = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        states.append({"torch": torch.get_rng_state()})
    assert checkpoint.restore_rng(states, 0, 5, torch.device("cpu"), rank=1, world_size=2) == 2
    assert torch.equal(torch.get_rng_state(), states[1]["torch"])
    # The format before per-rank states kept rank 0's alone: how many ranks saved it is unknown.
    assert checkpoint.restore_rng(states[0], 0, 5, torch.device("cpu"), 0, world_size=2) is None


def test_an_apple_gpus_generator_is_saved_and_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropout on MPS draws from the MPS generator: resuming there continues its stream."""
    generator = {"state": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda: generator["state"].clone())
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda s: generator.update(state=s))
    mps = torch.device("mps")
    [saved] = checkpoint.rng_states(mps, world_size=1)
    generator["state"] = torch.tensor([9], dtype=torch.uint8)
    checkpoint.restore_rng([saved], 0, 5, mps, rank=0, world_size=1)
    assert torch.equal(generator["state"], torch.tensor([1, 2, 3], dtype=torch.uint8))


def test_the_demo_steps_every_variant_that_runs_here_to_one_loss() -> None:
    """make demo: every variant computes the same function, so the same first loss, on the
    same (seeded) batch; those that cannot run here say why."""
    argv = [sys.executable, str(ROOT / "scripts" / "demo.py"), "--device", "cpu"]
    # `make demo`, and `make demo | head -1` beside it (each process imports torch: ~2.5 s)
    with (
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as done,
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as head,
    ):
        try:
            assert head.stdout is not None and head.stderr is not None
            assert head.stdout.readline().startswith(b"one training step per variant")
            head.stdout.close()
            err = head.stderr.read().decode()
            # quiet, with the shell's status for SIGPIPE
            assert head.wait(timeout=120) == 128 + signal.SIGPIPE, err
            stdout, stderr = done.communicate(timeout=120)
        finally:  # a failure or time-out leaves neither running (the with waits for both)
            done.kill()
            head.kill()
    assert done.returncode == 0, stderr
    losses = {line.split()[0]: line.split()[2] for line in stdout.splitlines() if " loss " in line}
    cuda_only = [name for name, v in VARIANTS.items() if v.cuda_only_reason]
    assert set(losses) == set(VARIANTS) - set(cuda_only)  # test_model lists them by name
    assert len(set(losses.values())) == 1, losses
    assert stdout.count("skipped:") == len(cuda_only)
    assert f"{len(losses)} variants, one loss" in stdout
    assert "Traceback" not in err, err
