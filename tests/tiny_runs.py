"""The trainer tests' shared parts: a tiny corpus built by the real pipeline (data/prepare.py),
a short run many tests read, and helpers to run, read and damage runs."""

from __future__ import annotations

import json
import math
import shutil
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import train
from model import VARIANTS
from training import checkpoint, loop, step
from training.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
STEPS = 30  # of the shared run: enough for the loss to fall clearly
HEAD_SIZE = 16  # tiny.toml: n_embd 32 / n_head 2
# As the registry has them (tests/test_attention.py checks that each runs where it says)
CPU_VARIANTS = [name for name, v in VARIANTS.items() if not v.cuda_only_reason]
CUDA_ONLY = [name for name in VARIANTS if name not in CPU_VARIANTS]
TRAIN_KEYS = {"step", "loss", "lr", "ms_per_step", "tokens_per_s", "tflops", "grad_norm"}
EVAL_KEYS = {"step", "val_loss", "val_bpb", "train_loss"}


def stdlib_documents(folder: Path, count: int = 40) -> list[str]:
    """Copies of `count` mid-sized stdlib modules: real Python text, ~300 KB in all."""
    source = Path(sysconfig.get_paths()["stdlib"])
    picked = sorted(p for p in source.glob("*.py") if 2_000 < p.stat().st_size < 20_000)[:count]
    assert len(picked) >= 2
    folder.mkdir(parents=True)
    for path in picked:
        shutil.copyfile(path, folder / path.name)
    return [str(folder / "*.py")]


@pytest.fixture
def sample_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling's --device auto picks the CPU here, on a GPU machine too, as tiny.toml's
    training does: the expected texts are the CPU's, in fp32 (a GPU samples in bf16)."""
    import sample  # here, as data.prepare below: both import tokenizers, which this module,
    # a plugin of every test file's, must not need (gpu_check.sh's machine may lack it)

    real = sample.pick_device
    monkeypatch.setattr(
        sample,
        "pick_device",
        lambda name, setting: real("cpu" if name == "auto" else name, setting),
    )


@pytest.fixture(scope="session")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """<root>/tiny: the main corpus (vocab 512); <root>/other: same text, another tokenizer."""
    from data.prepare import prepare

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


@pytest.fixture(scope="session")
def base_run(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted tiny run (log_interval 1, eval every 10 steps); read-only for tests."""
    out = tmp_path_factory.mktemp("runs") / "base"
    assert run(data_root, out, *SHARED_OVERRIDES) == 0
    return out


def job_tokens_per_s(run_dir: Path, line: dict, world_size: int = 1) -> float:
    """The tokens every rank's micro-batches held in a step, over the step's logged time."""
    config = load_config(run_dir / "config.toml")
    tc, block_size = config.train, config.model.block_size
    tokens = tc.batch_size * tc.micro_batches(world_size) * world_size * block_size
    return tokens / (line["ms_per_step"] / 1e3)
