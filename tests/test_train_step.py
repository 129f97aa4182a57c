"""The optimizer, the schedule and the training step, by themselves."""

from __future__ import annotations

import copy
import itertools
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.utils.clip_grad as clip_grad

from data.loader import TokenBatches
from model import GPT, VARIANTS
from tiny_runs import ROOT, STEPS, TINY, load_ckpt, run, train_lines
from training import checkpoint, optim, step
from training.config import TrainConfig, load_config


def test_lr_warms_up_to_the_peak_once_then_decays_to_min_lr() -> None:
    tc = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=4, max_steps=20)
    lrs = [optim.lr_at(i, tc) for i in range(tc.max_steps + 1)]
    assert lrs[:4] == pytest.approx([2e-4, 4e-4, 6e-4, 8e-4])  # linear, from above zero
    assert lrs[4] == pytest.approx(1e-3) and lrs.count(max(lrs)) == 1
    assert all(a > b for a, b in itertools.pairwise(lrs[4:]))  # cosine: falls every step
    assert lrs[12] == pytest.approx((1e-3 + 1e-4) / 2)  # halfway through the decay
    assert lrs[20] == pytest.approx(1e-4) and min(lrs) >= 1e-4


@pytest.mark.usefixtures("sample_on_the_cpu")  # only where a run ends sampling
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


def test_every_param_group_follows_the_schedule(base_run: Path) -> None:
    tc = load_config(base_run / "config.toml").train
    groups = load_ckpt(base_run)["optimizer"]["param_groups"]
    assert len(groups) == 2
    assert all(g["lr"] == pytest.approx(optim.lr_at(STEPS - 1, tc)) for g in groups)
    for r in train_lines(base_run):  # the lr that step ran with: step s is lr_at(s - 1)
        assert r["lr"] == pytest.approx(optim.lr_at(r["step"] - 1, tc))


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
    """In eval mode (no dropout), over the same windows each time; the model's mode after as
    before."""
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
    model.eval()
    assert step.evaluate(model, batches, 5, None) == pytest.approx(expected, rel=1e-6)
    assert not model.training


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


def test_a_resume_on_another_rank_count_gives_each_rank_its_own_dropout_stream() -> None:
    """One rank saved, two resume: each takes a fresh seed of its own (alike, every rank would
    drop the same units), the same again for the same (seed, rank, step)."""
    saved = [{"torch": torch.get_rng_state()}]
    draws = []
    for rank in (0, 1, 0):
        assert checkpoint.restore_rng(saved, 7, 5, torch.device("cpu"), rank, world_size=2) == 1
        draws.append(torch.rand(8))
    assert not torch.equal(draws[0], draws[1])
    assert torch.equal(draws[0], draws[2])


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
    assert set(losses) == set(VARIANTS) - set(cuda_only)  # test_attention lists them by name
    assert len(set(losses.values())) == 1, losses
    assert stdout.count("skipped:") == len(cuda_only)
    assert f"{len(losses)} variants, one loss" in stdout
    assert "Traceback" not in err, err


@pytest.mark.usefixtures("sample_on_the_cpu")  # only where a run ends sampling
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
