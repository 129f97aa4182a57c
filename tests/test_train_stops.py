"""How a run stops: Ctrl-C, SIGTERM, a non-finite loss, a stdout or stderr that fails; saved where
it can be."""

from __future__ import annotations

import errno
import io
import itertools
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import train
from streams import FullDisk, ReaderTakesLines
from tiny_runs import (
    ROOT,
    error_of,
    eval_lines,
    load_ckpt,
    misbehave_at,
    run,
    run_argv,
    train_lines,
)
from training import checkpoint, loop, runtime, start, step

# tiny_runs.py's stand-in, for every test here.
pytestmark = pytest.mark.usefixtures("sample_on_the_cpu")


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


def test_a_sigterm_during_the_set_up_stops_at_once_and_says_so(
    data_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before the loop there is nothing to save: SIGTERM stops there as Ctrl-C does, saying so
    and with its own status, not in silence; the handlers are put back."""
    real_build = start.build_model

    def build_when_signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_build(*args, **kwargs)

    def outside(signum, frame):  # stands for SIGTERM's default action, which ends pytest too
        raise AssertionError("SIGTERM reached the handler train.py found")

    monkeypatch.setattr(start, "build_model", build_when_signalled)
    before = signal.signal(signal.SIGTERM, outside)
    try:
        status = run(data_root, tmp_path / "run", "--train.max_steps=2")
        assert signal.getsignal(signal.SIGTERM) is outside, "put back"
    finally:
        signal.signal(signal.SIGTERM, before)
    assert status == 128 + signal.SIGTERM
    assert "interrupted: stopped without saving" in capsys.readouterr().err
    assert not (tmp_path / "run" / checkpoint.CHECKPOINT).exists()


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
