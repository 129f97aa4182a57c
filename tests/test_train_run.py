"""A training run end to end on a tiny corpus: what it writes, where, and what it logs."""

from __future__ import annotations

import errno
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import sample
import train
from data.loader import TokenBatches
from model import GPT
from streams import ReaderTakesLines
from tiny_runs import (
    CPU_VARIANTS,
    EVAL_KEYS,
    ROOT,
    SHARED_OVERRIDES,
    STEPS,
    TINY,
    TRAIN_KEYS,
    error_of,
    eval_lines,
    job_tokens_per_s,
    load_ckpt,
    meta,
    misbehave_at,
    read_metrics,
    run,
    train_lines,
)
from training import checkpoint, loop, metrics, start, step
from training.config import load_config
from training.cpu_linear import wants_onednn

# tiny_runs.py's stand-in, for every test here.
pytestmark = pytest.mark.usefixtures("sample_on_the_cpu")


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
    monkeypatch.setattr(loop, "StepReadout", loop.StepReadout)  # the script sets its own
    status, out, err = run_script("readout_gain", *argv[2:])
    assert status == 0, err[-2000:]
    head, *modes = out.splitlines()
    assert head.startswith(f"config {TINY} --data.root=") and "steps 3..5, median of 1 runs" in head
    assert [m.split()[0] for m in modes] == ["lagged", "read"]
    assert all(float(m.split()[-3]) > 0 for m in modes), modes  # the median ms per step
    # Bad input: train.py's status (2, a user error) and its one-line reason, or the flag's
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


def test_out_that_is_a_file_or_holds_corpora_is_refused(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run written into a corpus would overwrite its tokenizer.json with the run's."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    dangling = tmp_path / "link"
    dangling.symlink_to(tmp_path / "gone")
    loop = tmp_path / "loop"
    loop.symlink_to(loop.name)  # resolving it raised RuntimeError, a traceback
    before = {p: p.read_bytes() for p in data_root.rglob("*") if p.is_file()}
    for out, named in [
        (a_file, "is a file"),
        (a_file / "run", "cannot make the directory"),
        (dangling, f"is a link to {tmp_path / 'gone'}, which does not exist"),
        (dangling / "run", f"run: {dangling} is a link to {tmp_path / 'gone'}, which does not"),
        (loop, "is a link to loop, which cannot be followed (Too many levels of symbolic links)"),
        (Path(os.fsdecode(bytes(tmp_path / "r") + b"\xff")), "not valid UTF-8; give another"),
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
    os.mkfifo(tmp_path / "pipe")  # as /dev/null
    assert run(data_root, tmp_path / "pipe") == 2
    assert "pipe is neither a file nor a folder; give a run directory" in capsys.readouterr().err
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
    written = ("config.toml", "metrics.jsonl", "tokenizer.json", "ckpt.pt")
    cut = [f"{name}.tmp" for name in written]  # a write killed before its rename
    for name in (*written[:3], *cut, ".lock", ".config.toml.swp"):
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
    out, err = capsys.readouterr()
    assert ("note: other processes used 50% of the CPUs" in err) == (share > 0), err
    assert "naive, step 1: median " in out and "compil" not in out
    if share:  # compiled, the run's own compile workers count among them, and it says so
        compiled: list[GPT] = []
        real = step.compile_blocks
        monkeypatch.setattr(step, "compile_blocks", lambda m: compiled.append(m) or real(m))
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        # At the profiler tests' block shape (B=2, T=32, C=32, 2 heads): kernels built once
        compiled_step = [*one_step, "--train.compile=true", "--train.batch_size=2"]
        assert run(data_root, tmp_path / "compiled", *compiled_step) == 0
        out, err = capsys.readouterr()
        assert "other processes (Inductor's compile workers among them) used 50%" in err
        # Its one step compiled: its time is no step time to compare runs by, and says so
        assert ", its compiling included (the call's only step)\n" in out
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
    data_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Neither an evaluating step nor the step after it logs the evaluation's time; the line
    that ends the run, this call's median step time to compare runs by, is theirs."""
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
    capsys.readouterr()
    assert run(data_root, out, *evals) == 0
    assert len(calls) == 6  # steps 0, 3 and 5 evaluate, two calls each
    ms = {r["step"]: r["ms_per_step"] for r in train_lines(out)}
    # Step 3 evaluates and 4 follows (not 1 or 2: a loaded machine's first steps are slow);
    # a step of this model takes milliseconds, an evaluation here 3 s.
    assert ms[3] < 1500 and ms[4] < 1500, ms
    median = statistics.median(ms.values())
    tokens = 4 * 32 / median * 1e3  # tiny.toml: batch_size 4, block_size 32
    said = f"naive, steps 1-5: median {median:.1f} ms/step, {tokens:,.0f} tokens/s\n"
    assert said in capsys.readouterr().out
    # Resumed, the line is of the steps this call took
    assert run(data_root, out, *evals, "--train.max_steps=6", "--resume") == 0
    assert "naive, step 6: median " in capsys.readouterr().out


def test_a_first_step_that_compiled_is_said_apart_from_the_median(
    data_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A compiled call's first step compiles (seconds, where a step takes milliseconds): it is
    left out of the median the closing line gives, and said apart with its time. Here a stand-in
    says the first step compiled two graphs."""
    graphs = iter([0, 2])  # before and after the call's first step; after that, no change

    monkeypatch.setattr(loop, "graphs_compiled", lambda: next(graphs, 2))
    out = tmp_path / "run"
    argv = ["--train.eval_interval=0", "--train.eval_batches=1", "--train.max_steps=5"]
    capsys.readouterr()
    assert run(data_root, out, *argv) == 0
    ms = {r["step"]: r["ms_per_step"] for r in train_lines(out)}
    median = statistics.median(ms[s] for s in range(2, 6))
    tokens = 4 * 32 / median * 1e3  # tiny.toml: batch_size 4, block_size 32
    said = (
        f"naive, steps 2-5: median {median:.1f} ms/step, {tokens:,.0f} tokens/s; step 1 "
        f"compiled ({ms[1]:.0f} ms), left out\n"
    )
    assert said in capsys.readouterr().out
    # A call whose first step compiled nothing: every step in the median
    assert run(data_root, out, *argv, "--train.max_steps=7", "--resume") == 0
    said = capsys.readouterr().out
    assert "naive, steps 6-7: median " in said and "compiled" not in said


def test_an_evaluation_reading_more_than_val_holds_is_said(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """eval_batches=100000 (a 0 too many) would evaluate for hours before the first step;
    past val.bin's size an evaluation reads its tokens again. Said at the start, with the
    numbers; up to val.bin's size, nothing."""
    held = meta(data_root)["splits"]["val"]["tokens"]
    per_step = 4 * 32  # tiny.toml: batch_size 4, block_size 32
    one_step = ["--train.max_steps=1", "--train.eval_interval=0"]
    fits = held // per_step
    assert run(data_root, tmp_path / "fits", *one_step, f"--train.eval_batches={fits}") == 0
    assert "an evaluation reads" not in capsys.readouterr().err
    over = fits + 1
    assert run(data_root, tmp_path / "over", *one_step, f"--train.eval_batches={over}") == 0
    assert (
        f"note: an evaluation reads train.eval_batches={over} x {per_step} tokens from each "
        f"split, {over * per_step / held:.1f} times what val.bin holds ({held:,} tokens;"
    ) in capsys.readouterr().err


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
        for k, b in start.token_batches(config, folder, meta(data_root), cpu, 0, 1).items()
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


def test_a_val_split_smaller_than_one_batch_is_read_not_refused(tmp_path: Path) -> None:
    """Only the train sampler needs a whole batch of distinct windows: a small val split is
    evaluated on windows that overlap, as the loader's docstring says."""
    config = load_config(ROOT / "configs" / "tiny.toml")  # 4 windows of 32 tokens
    rng = np.random.default_rng(0)
    for split, n in (("train", 5000), ("val", 100)):  # 100 tokens: 3 windows, not 4
        rng.integers(0, 64, n, dtype=np.uint16).tofile(tmp_path / f"{split}.bin")
    meta = {"splits": {"train": {"tokens": 5000}, "val": {"tokens": 100}}, "vocab_size": 64}
    batches = start.token_batches(config, tmp_path, meta, torch.device("cpu"), 0, 1)
    x, y = batches["val"].next()
    assert x.shape == y.shape == (4, 32)


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
