"""The profiler tests' shared parts: a tiny sweep, rows to build reports from, and stand-ins
for what is slow to do for real (the matmul peak, the FLOP count, rendering PNGs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import profile_train
from model import VARIANTS
from profiling.measure import step_flops
from profiling.results import results_problem
from training.config import Config
from training.cpu_linear import onednn_unavailable_reason

TINY = [
    "--model.vocab_size=128",
    "--model.block_size=32",
    "--model.n_embd=32",
    "--model.n_head=2",
    "--train.batch_size=2",
    "--train.device=cpu",
    "--train.dtype=float32",
]

ROOT = Path(__file__).resolve().parents[1]


def sweep(tmp_path: Path, *args: str, name: str = "sweep") -> tuple[int, dict]:
    out = tmp_path / name
    rc = profile_train.main(
        [
            "--config",
            str(ROOT / "configs" / "profile.toml"),
            "--out",
            str(out),
            "--steps",
            "2",
            "--warmup",
            "1",
            "--peak-seconds",
            "0.02",
            *TINY,
            *args,
        ]
    )
    results = (
        json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    )
    # Whatever its cells did (failed, interrupted, run on another backend), what a sweep
    # writes, --report reads back
    assert not results or results_problem(results) is None, results_problem(results)
    return rc, results


@pytest.fixture
def quick_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sweeps here read the matmul peak from a stand-in: measured, even at --peak-seconds 0.02,
    it costs each sweep 2.5 s of 2048-square matmuls, ~40% of these tests' time. The session's
    naive_vs_inplace sweep is set up before this (a wider scope) and measures it for real, as
    test_cpu_linear measures each path."""
    import profiling.sweep

    def peaks(device: torch.device, dtype: torch.dtype, seconds: float) -> dict[str, float]:
        assert seconds > 0
        if device.type != "cpu":
            return {"torch.mm": 1e14}
        return {"torch.mm": 1e11} | (
            {"oneDNN": 2e11} if onednn_unavailable_reason() is None else {}
        )

    monkeypatch.setattr(profiling.sweep, "matmul_peaks", peaks)


_FLOPS: dict[tuple[str, int], tuple[int, int]] = {}  # (config, n_layer): step_flops' count
_NAIVE = VARIANTS["naive"]  # the registered variant step_flops counts on


@pytest.fixture
def flops_counted_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep counts each depth's FLOPs on the meta device (0.15 s each on a slow machine);
    the sweeps here share a few configs, so each (config, depth) is counted once, for real, and
    reused (64 counts were 9 s of these tests). A failed count (0, 0) is not kept, and a test
    that swaps naive out counts for itself."""
    import profiling.sweep

    def counted_once(config: Config, n_layer: int) -> tuple[int, int]:
        key = (repr(config), n_layer)
        if VARIANTS["naive"] is not _NAIVE:
            return step_flops(config, n_layer)
        if key not in _FLOPS:
            flops = step_flops(config, n_layer)
            if not flops[0]:
                return flops
            _FLOPS[key] = flops
        return _FLOPS[key]

    monkeypatch.setattr(profiling.sweep, "step_flops", counted_once)


@pytest.fixture
def plots_unrendered(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sweeps here draw their plots, every artist from the rows as a sweep does, but do not lay
    them out or rasterise them: a sweep's two PNGs cost 0.5 s on a slow 2-core machine, ~40 s
    over these tests. A stand-in file takes each PNG's place. The session's naive_vs_inplace sweep
    (a wider scope) renders for real, and so do tests marked `png`."""
    if "png" in request.keywords:
        return
    import matplotlib.figure

    def unrendered(fig: object, path: object, **kwargs: object) -> None:
        Path(str(path)).write_bytes(b"drawn, not rendered (tests/sweeps.py)")

    monkeypatch.setattr(matplotlib.figure.Figure, "tight_layout", lambda fig, **kwargs: None)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", unrendered)


@pytest.fixture(scope="session")
def naive_vs_inplace(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One real sweep (3 variants x 3 depths) that many tests read; none may change it."""
    rc, results = sweep(
        tmp_path_factory.mktemp("p"), "--variants", "naive,inplace,sdpa-math", "--layers", "1,2,3"
    )
    assert rc == 0
    return results


def timed_row(variant: str, n: int, ms: float, compiled: bool = False) -> dict:
    """A results.json row with only a step time: what fits and savings read."""
    return {
        "variant": variant,
        "compile": compiled,
        "n_layer": n,
        "status": "ok",
        "step_ms": {"median": ms, "p10": ms, "p90": ms, "n": 5},
        "mfu": None,
        "peak_mem_bytes": None,
        "ops_per_step": None,
    }


def split_row(variant: str, median: float, times: dict, **extra) -> dict:
    """A results.json row with a step time and the op time by category: what Where the time
    goes reads."""
    return {
        "variant": variant,
        "compile": False,
        "n_layer": 2,
        "status": "ok",
        "step_ms": {"median": median, "p10": median, "p90": median, "n": 3},
        "mfu": None,
        "cpu_ms_per_step": times,
        "time_split": None,
        **extra,
    }
