"""A resume with settings the checkpoint's run did not have: what each changes, said in words."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import train
from tiny_runs import SHARED_OVERRIDES, STEPS, copy_run, eval_lines, load_ckpt, run, train_lines
from training import checkpoint, runtime
from training.config import TrainConfig, load_config
from training.cpu_linear import onednn_unavailable_reason

# tiny_runs.py's stand-in, for every test here.
pytestmark = pytest.mark.usefixtures("sample_on_the_cpu")


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
    from training.resume import say_the_batch_changed

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
    from training.resume import say_the_batch_changed

    before = {"batch_size": 4, "grad_accum": 2, "global_batch_size": 0, "eval_batches": 2}
    tc = TrainConfig(**{**before, **now})
    say_the_batch_changed({"config": {"train": before}}, tc, ranks_before, 1, dropout)
    err = capsys.readouterr().err
    assert "each step trains on the rows it would have drawn" in err, err
    assert said in err, err
    assert ("dropout" in err) == (dropout > 0), err


def test_a_resume_that_splits_the_rows_otherwise_trains_as_the_run_that_never_stopped(
    base_run: Path, data_root: Path, tmp_path: Path
) -> None:
    """What the message above says, done: stopped after 10 steps of 4 rows in one micro-batch,
    resumed as 2 micro-batches of 2 rows, the run trains on the same rows and, without
    dropout, reaches the losses of the run that never stopped, to rounding."""
    out = tmp_path / "split"
    assert run(data_root, out, *SHARED_OVERRIDES, "--stop-after", "10") == 0
    more = ("--train.batch_size=2", "--train.grad_accum=2")
    assert run(data_root, out, *SHARED_OVERRIDES, *more, "--resume") == 0
    whole, split = train_lines(base_run), train_lines(out)
    assert [r["step"] for r in split] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in split[:10]] == [r["loss"] for r in whole[:10]]
    assert [r["loss"] for r in split[10:]] == pytest.approx(
        [r["loss"] for r in whole[10:]], rel=1e-4
    )
    evals = {r["step"]: r["val_loss"] for r in eval_lines(out)}
    for r in eval_lines(base_run):
        assert evals[r["step"]] == pytest.approx(r["val_loss"], rel=1e-4)


def test_a_resume_with_the_same_split_in_other_fields_says_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """grad_accum 2, or a global batch of twice batch_size on one process: the same
    micro-batches, so the same run, dropout and all: nothing to say."""
    from training.resume import say_the_batch_changed

    before = {"batch_size": 8, "grad_accum": 2, "global_batch_size": 0, "eval_batches": 2}
    tc = TrainConfig(**{**before, "grad_accum": 1, "global_batch_size": 16})
    say_the_batch_changed({"config": {"train": before}}, tc, 1, 1, 0.1)
    assert capsys.readouterr().err == ""


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
    base_run: Path,
    data_root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fp32 to bf16 autocast: one line for the precision, with the Linear path that follows from
    it, not a line blaming train.cpu_linear for the path; and, on a CPU without bf16
    instructions, a warning that it trains far slower so."""
    out = copy_run(base_run, tmp_path / "run")
    capsys.readouterr()
    monkeypatch.setattr(runtime, "bf16_matmul_instructions", lambda: False)
    argv = [f"--train.max_steps={STEPS + 1}", "--train.dtype=bfloat16", "--resume"]
    assert run(data_root, out, *argv) == 0
    err = capsys.readouterr().err
    assert (
        "resuming in bfloat16 autocast (train.dtype=bfloat16, nn.Linear through PyTorch BLAS); "
        "the run trained in float32 so far: the same function, rounded differently" in err
    ), err
    assert "resuming with nn.Linear" not in err
    assert "warning: train.dtype='bfloat16': this CPU has no bfloat16 matmul instructions" in err
    assert load_ckpt(out)["written_by"]["precision"] == "bfloat16 autocast"
    # A checkpoint from before written_by recorded it: told by its config's train.dtype
    older = copy_run(base_run, tmp_path / "older")
    ckpt = load_ckpt(older)
    del ckpt["written_by"]["precision"]
    torch.save(ckpt, older / checkpoint.CHECKPOINT)
    assert run(data_root, older, *argv) == 0
    assert "the run trained in float32 so far" in capsys.readouterr().err


def test_resume_compiled_where_the_run_ran_eagerly_says_so(
    base_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """torch.compile fuses and reorders the same ops: a run resumed compiled (or eager after
    compiled) rounds differently from then on, said as another precision or variant is."""
    from training.resume import say_what_resuming_changes

    ckpt = load_ckpt(base_run)
    eager = load_config(base_run / "config.toml")
    assert not eager.train.compile and not ckpt["config"]["train"]["compile"]
    compiled = dataclasses.replace(eager, train=dataclasses.replace(eager.train, compile=True))
    how = (ckpt["written_by"]["linear"], ckpt["written_by"]["precision"])
    capsys.readouterr()
    say_what_resuming_changes(ckpt, compiled, *how)
    assert capsys.readouterr().err == (
        "resuming compiled (train.compile=true); the run trained eagerly so far (Inductor "
        "fuses and reorders the same ops: the same function, rounded differently, so the run "
        "will not match one that never stopped to the last bit)\n"
    )
    # With dropout, Inductor's masks come from its own generator: other masks too
    dropping = dataclasses.replace(compiled, model=dataclasses.replace(eager.model, dropout=0.1))
    say_what_resuming_changes(ckpt, dropping, *how)
    assert "to the last bit; and other dropout masks)\n" in capsys.readouterr().err
    ckpt["config"]["train"]["compile"] = True
    say_what_resuming_changes(ckpt, eager, *how)
    assert "resuming eagerly (train.compile=false); the run trained compiled so far" in (
        capsys.readouterr().err
    )
    say_what_resuming_changes(ckpt, compiled, *how)  # compiled as before: nothing to say
    assert capsys.readouterr().err == ""


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


def test_no_schedule_note_for_a_run_already_at_its_end(capsys) -> None:
    from training.config import TrainConfig
    from training.resume import SCHEDULE_FIELDS, say_the_schedule_changed

    tc = TrainConfig(max_steps=100, warmup_steps=10, lr=1e-3, min_lr=1e-4)
    before = {k: getattr(tc, k) for k in SCHEDULE_FIELDS} | {"min_lr": 2e-4}
    say_the_schedule_changed({"step": 100, "config": {"train": before}}, tc)
    assert capsys.readouterr().err == ""
    # one step before the end, it is said
    say_the_schedule_changed({"step": 99, "config": {"train": before}}, tc)
    assert "resuming with train.min_lr" in capsys.readouterr().err


def test_a_checkpoint_that_records_no_seed_resumes_with_any() -> None:
    from training.config import ConfigError
    from training.resume import check_seed

    check_seed({"config": {"train": {}}}, 7, Path("runs/x"))  # before train.seed was recorded
    check_seed({}, 7, Path("runs/x"))
    with pytest.raises(ConfigError, match="seeded with 3"):
        check_seed({"config": {"train": {"seed": 3}}}, 7, Path("runs/x"))
