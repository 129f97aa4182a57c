"""torchrun: several processes train as one, stop together on a signal, and say which rank failed."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
import timeit
from pathlib import Path
from typing import Any

import pytest
import torch

import train
from model import GPT
from tiny_runs import (
    ROOT,
    TINY,
    eval_lines,
    job_tokens_per_s,
    load_ckpt,
    read_metrics,
    run,
    run_argv,
    train_lines,
)
from training import checkpoint
from training.config import load_config

# tiny_runs.py's stand-in, for every test here.
pytestmark = pytest.mark.usefixtures("sample_on_the_cpu")


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
