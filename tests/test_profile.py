"""profile_train.py: the measurements a user reads, on sweeps small enough for seconds."""

from __future__ import annotations

import contextlib
import copy
import csv
import dataclasses
import datetime as dt
import errno
import fcntl
import gc
import gzip
import itertools
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import weakref
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import numpy as np
import pytest
import torch
from torch.autograd import DeviceType

import probe
import profile_train
from config import Config, ConfigError, load_config
from cpu_linear import onednn_unavailable_reason
from host import OtherLoad
from model import GPT, VARIANTS, attention
from probe import BACKEND_OPS
from profiling.analysis import (
    fit_line,
    fits_by_label,
    median_interval,
    op_diff,
    paired_savings,
    savings,
)
from profiling.cells import Cell
from profiling.measure import count_flops, parse_events, step_flops, verify_backend
from profiling.results import results_problem
from profiling.sweep import KEPT_ON_WRONG_BACKEND, Sweep
from profiling.tables import headline_table, paired_deepest, paired_table
from streams import FullDisk, ReaderTakesLines

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


@pytest.fixture(autouse=True)
def quick_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sweeps here read the matmul peak from a stand-in: measured, even at --peak-seconds 0.02,
    it costs each sweep 2.5 s of 2048-square matmuls, ~40% of this file's time. The module's
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


@pytest.fixture(autouse=True)
def flops_counted_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep counts each depth's FLOPs on the meta device (0.15 s each on a slow machine);
    the sweeps here share a few configs, so each (config, depth) is counted once, for real, and
    reused (64 counts were 9 s of this file). A failed count (0, 0) is not kept, and a test
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


@pytest.fixture(autouse=True)
def plots_unrendered(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sweeps here draw their plots, every artist from the rows as a sweep does, but do not lay
    them out or rasterise them: a sweep's two PNGs cost 0.5 s on a slow 2-core machine, ~40 s
    over this file. A stand-in file takes each PNG's place. The module's naive_vs_inplace sweep
    (a wider scope) renders for real, and so do tests marked `png`."""
    if "png" in request.keywords:
        return
    import matplotlib.figure

    def unrendered(fig: object, path: object, **kwargs: object) -> None:
        Path(str(path)).write_bytes(b"drawn, not rendered (tests/test_profile.py)")

    monkeypatch.setattr(matplotlib.figure.Figure, "tight_layout", lambda fig, **kwargs: None)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", unrendered)


@pytest.fixture(scope="module")
def naive_vs_inplace(tmp_path_factory: pytest.TempPathFactory) -> dict:
    rc, results = sweep(
        tmp_path_factory.mktemp("p"), "--variants", "naive,inplace,sdpa-math", "--layers", "1,2,3"
    )
    assert rc == 0
    return results


def test_host_memory_release_grows_no_heap_and_says_so(tmp_path: Path) -> None:
    """--host-memory release: no heap reserved before the timed steps, and the report says
    freed memory went back to the OS (glibc's own setting; a process that kept it before,
    as this test process may have, cannot undo that, so only what the sweep did is checked)."""
    rc, results = sweep(
        tmp_path, "--variants", "inplace", "--layers", "1", "--host-memory", "release"
    )
    assert rc == 0 and results["rows"][0]["status"] == "ok"
    assert results["meta"]["host_memory"] == "release"
    assert results["meta"]["heap_reserve_bytes"] is None
    assert "returned to the OS" in (tmp_path / "sweep" / "report.md").read_text()


def test_hidden_copy_through_the_profiler(naive_vs_inplace: dict) -> None:
    """naive minus inplace = exactly n_layer aten::clone per step, in the forward region."""
    rows = {(r["variant"], r["n_layer"]): r for r in naive_vs_inplace["rows"]}
    for n_layer in (1, 2, 3):
        naive, inplace = rows[("naive", n_layer)], rows[("inplace", n_layer)]
        for region in ("forward", "backward", "optimizer"):
            extra = naive["ops_per_step"][region].get("aten::clone", 0) - inplace["ops_per_step"][
                region
            ].get("aten::clone", 0)
            assert extra == (n_layer if region == "forward" else 0), (region, n_layer)
    diff = op_diff(naive_vs_inplace["rows"], "inplace", "naive")
    assert {"region": "forward", "name": "aten::clone", "per_layer": -1.0} in diff
    assert {"region": "forward", "name": "aten::copy_", "per_layer": -1.0} in diff
    report = (Path(naive_vs_inplace["meta"]["out"]) / "report.md").read_text()
    assert "1 aten::clone fewer (forward)" in report
    assert "outside the operators" in report and "totals exceed the timed medians" not in report
    assert "predates these categories" not in report  # a new sweep stores the split it shows


def test_more_profiled_steps_count_the_same_per_step(
    naive_vs_inplace: dict, tmp_path: Path
) -> None:
    """--profile-steps N profiles N steps and divides by N: the counts per step are one step's,
    exactly the fixture's, which profiled one."""
    rc, results = sweep(tmp_path, "--variants", "naive", "--layers", "1", "--profile-steps", "3")
    assert rc == 0 and results["meta"]["profile_steps"] == 3
    (row,) = results["rows"]
    one = next(r for r in naive_vs_inplace["rows"] if (r["variant"], r["n_layer"]) == ("naive", 1))
    assert row["ops_per_step"] == one["ops_per_step"]


def test_data_sweeps_the_named_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--data NAME steps on batches of that corpus's train split, not random tokens."""
    import profiling.startup
    from data.prepare import prepare

    docs = tmp_path / "docs"
    docs.mkdir()
    for i, source in enumerate(sorted(Path(json.__file__).parent.glob("*.py"))):
        (docs / f"{i}.py").write_text(source.read_text(encoding="utf-8") * 20, encoding="utf-8")
    prepare("small", files=[str(docs / "*.py")], vocab_size=300, out_root=tmp_path / "root")
    opened: list[Path] = []

    class Recorded(profiling.startup.TokenBatches):
        def __init__(self, path: Path, *args: object, **kwargs: object) -> None:
            opened.append(Path(path))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(profiling.startup, "TokenBatches", Recorded)
    corpus = ["--data", "small", f"--data.root={tmp_path / 'root'}", "--model.vocab_size=300"]
    rc, results = sweep(tmp_path, "--variants", "naive", "--layers", "1", *corpus)
    assert rc == 0 and results["rows"][0]["status"] == "ok"
    assert results["meta"]["data"] == "small"
    assert opened == [tmp_path / "root" / "small" / "train.bin"]
    # A model whose vocabulary the corpus's ids overrun is refused before anything is measured.
    rc, _ = sweep(tmp_path, "--variants", "naive", "--layers", "1", *corpus[:3], name="small-vocab")
    assert rc == 2 and not (tmp_path / "small-vocab").exists()


def test_results_json_contract(naive_vs_inplace: dict) -> None:
    meta = naive_vs_inplace["meta"]
    for key in (
        "device",
        "device_name",
        "torch_version",
        "dtype",
        "config",
        "peak_flops",
        "started_at",
        "finished_at",  # written last, after the report and plots
    ):
        assert key in meta, key
    assert meta["peak_flops"] > 1e8
    # The MFU denominator is the fastest matmul path timed, and every path is reported.
    assert meta["peak_flops"] == pytest.approx(max(meta["peak_flops_by_path"].values()))
    assert meta["linear"] in ("oneDNN", "torch") and meta["host_memory"] in ("keep", "release")
    # Where memory is kept, the heap is grown before the timed steps (host.reserve_heap).
    assert meta["heap_reserve_bytes"] == (256 << 20 if meta["host_memory"] == "keep" else None)
    assert meta["cells_planned"] == 9  # 3 variants x 3 depths
    assert meta["other_cpu_share"] is None or 0 <= meta["other_cpu_share"] <= 1
    rows = naive_vs_inplace["rows"]
    assert len(rows) == 9
    config = load_config(ROOT / "configs" / "profile.toml", TINY)
    for row in rows:
        assert row["status"] == "ok", row["reason"]
        for key in (
            "variant",
            "n_layer",
            "compile",
            "status",
            "reason",
            "tokens_per_s",
            "mfu",
            "peak_mem_bytes",
            "compile_s",
            "ops_per_step",
            "kernels_per_step",
        ):
            assert key in row, key
        assert set(row["step_ms"]) == {"median", "p10", "p90", "n"} and row["step_ms"]["n"] == 2
        assert row["step_ms"]["p10"] <= row["step_ms"]["median"] <= row["step_ms"]["p90"]
        assert len(row["times_ms"]) == 2  # each timed step, in round order
        assert statistics.median(row["times_ms"]) == pytest.approx(row["step_ms"]["median"])
        assert set(row["ops_per_step"]) == {"forward", "backward", "optimizer"}
        assert row["kernels_per_step"] is None  # CPU
        # Counted FLOPs over the median step, against the peak (the higher of its two readings)
        seconds = row["step_ms"]["median"] / 1e3
        assert row["mfu"] == pytest.approx(row["flops_per_step"] / seconds / meta["peak_flops"])
        # fp32 parameters, AdamW's two moments and, during the step, the gradients: 4 x 4 bytes
        model = GPT(dataclasses.replace(config.model, n_layer=row["n_layer"]))
        assert row["peak_mem_bytes"] > 16 * sum(p.numel() for p in model.parameters())
        assert row["page_faults_per_step"] >= 0
        assert row["compiles_while_timed"] == 0
        assert row["allocator_calls_per_step"] is None and row["alloc_retries"] is None  # CPU
        # Attention's T x T products, forward (QK^T, PV) and backward (2 each): 12 B T^2 C per
        # layer, part of the step's count. (TINY: B=2, T=32, C=32.)
        assert row["attention_flops_per_step"] == 12 * 2 * 32**2 * 32 * row["n_layer"]
        assert row["attention_flops_per_step"] < row["flops_per_step"]
    fits = naive_vs_inplace["fits"]
    assert {"slope", "intercept", "r2"} <= set(fits["naive"]["step_ms"])
    # Ops grow exactly linearly with depth: one fit explains them fully.
    assert fits["naive"]["ops_per_step.forward"]["r2"] == pytest.approx(1.0)
    out = Path(meta["out"])
    for name in (
        "results.csv",
        "report.md",
        "summary.txt",
        "step_time_vs_layers.png",
        "memory_vs_layers.png",
    ):
        assert (out / name).stat().st_size > 0, name
    assert len(list((out / "traces").glob("*.json.gz"))) == 9
    # The profiled step (one) marked each layer's attention call, for the time split.
    events = json.loads(gzip.decompress((out / "traces" / "naive_L3.json.gz").read_bytes()))
    assert sum(e.get("name") == "attention" for e in events["traceEvents"]) == 3


def test_pinned_backend_is_verified(naive_vs_inplace: dict) -> None:
    math_rows = [r for r in naive_vs_inplace["rows"] if r["variant"] == "sdpa-math"]
    assert all(r["backend"] == "MATH" for r in math_rows)


def test_backend_mismatch_fails_the_cell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A variant that claims FLASH but runs MATH is caught from the trace, not trusted."""
    liar = attention.Variant(
        "sdpa-flash",
        attention.VARIANTS["sdpa-math"].fn,
        "liar",
        backend=attention.SDPBackend.FLASH_ATTENTION,
    )
    monkeypatch.setitem(attention.VARIANTS, "sdpa-flash", liar)
    rc, results = sweep(tmp_path, "--variants", "sdpa-flash", "--layers", "1")
    assert rc == 1  # its only cell failed
    [row] = results["rows"]
    assert row["status"] == "failed"
    assert (
        "FLASH_ATTENTION" in row["reason"] and "_scaled_dot_product_attention_math" in row["reason"]
    )
    # It was timed before the trace caught it; what was measured is another backend's, so a
    # failed cell reports no time, rate, MFU, memory or first step; what ran stays, to show why.
    measured = {
        "step_ms",
        "times_ms",
        "tokens_per_s",
        "mfu",
        "peak_mem_bytes",
        "first_step_ms",
        "page_faults_per_step",
        "gc_collections",
        "gc_longest_ms",
        "compiles_while_timed",
        "cpu_ms_per_step",
        "time_split",
    }
    assert not measured & KEPT_ON_WRONG_BACKEND
    for key in measured:
        assert row[key] is None, key
    assert row["backend"] == "MATH" and row["ops_per_step"]["forward"]
    report = (tmp_path / "sweep" / "report.md").read_text()
    assert "| sdpa-flash | 1 | failed | – |" in report
    # No exception, so no traceback: the log the report names holds the reason
    assert "Each failed cell's traceback is in `failures.log`." in report
    log = (tmp_path / "sweep" / "failures.log").read_text()
    assert log == f"--- sdpa-flash L1: {row['reason']}\n"


def test_compiled_cells_stopped_in_their_rounds_net_out_the_eager_excess() -> None:
    """A stop in the rounds keeps a compiled cell's times; its compile time still nets out
    what its eager twin's first step took beyond its median, as a whole depth's does."""
    sweep_ = Sweep.__new__(Sweep)
    sweep_.steps, sweep_.tokens_per_step, sweep_.rows = 4, 64, []
    eager = Cell("naive", 1, False, step=lambda: None, times=[0.1, 0.1], first_step_s=1.0)
    compiled = Cell("naive", 1, True, step=lambda: None, times=[0.05, 0.05], first_step_s=5.0)
    compiled.compile_cache = "cold"
    sweep_.timed = ([eager, compiled], (0, 0))
    sweep_._record_timed_only()
    rows = {r["compile"]: r for r in sweep_.rows}
    assert [r["status"] for r in sweep_.rows] == ["interrupted"] * 2
    assert rows[True]["eager_excess_s"] == pytest.approx(0.9)
    assert rows[True]["compile_s"] == pytest.approx(5.0 - 0.05 - 0.9)
    assert "2 of its 4 steps were timed" in rows[True]["reason"]


def test_a_report_that_cannot_be_drawn_between_cells_does_not_stop_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bug in the report's code, met between cells, is a warning (once): the cells are
    measured and results.json written; the end draws the report again."""
    from profiling.results import render_results

    def fails_between_cells(out: Path, results: dict, plots: bool = True) -> None:
        if not plots:
            raise ValueError("a row mix the tables did not expect")
        render_results(out, results, plots)

    monkeypatch.setattr("profiling.sweep.render_results", fails_between_cells)
    rc, results = sweep(tmp_path, "--variants", "naive,inplace", "--layers", "1,2")
    assert rc == 0
    assert [r["status"] for r in results["rows"]] == ["ok"] * 4
    err = capsys.readouterr().err
    assert err.count("warning: the report could not be drawn (ValueError: a row mix") == 1
    assert (tmp_path / "sweep" / "report.md").is_file()


def test_a_region_the_profiler_does_not_know_fails_the_cell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ops are counted by the regions step.train_step names: one renamed there fails the cell,
    named, rather than counting that region's ops as none."""
    import step

    real = step.record_function
    renamed = lambda name: real("optim" if name == "optimizer" else name)
    monkeypatch.setattr(step, "record_function", renamed)
    rc, results = sweep(tmp_path, "--variants", "naive", "--layers", "1")
    assert rc == 1
    [row] = results["rows"]
    assert row["status"] == "failed"
    assert "no ATen ops in the profiled steps' optimizer region" in row["reason"]


def test_a_failure_in_the_profiled_steps_keeps_the_timed_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The profiled steps come after the timed ones: a trace that cannot be written (a full
    disk) fails the cell, and its step times stay in the row."""
    import profiling.sweep

    @contextlib.contextmanager
    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")
        yield

    monkeypatch.setattr(profiling.sweep, "profiled_steps", full_disk)
    rc, results = sweep(tmp_path, "--variants", "naive", "--layers", "1")
    assert rc == 1  # its only cell failed
    [row] = results["rows"]
    assert row["status"] == "failed"
    assert row["reason"] == (
        "in the profiled steps, after the timed ones: OSError: [Errno 28] No space left on device"
    )
    assert row["step_ms"]["n"] == 2 and row["tokens_per_s"] > 0 and row["first_step_ms"] > 0
    assert row["mfu"] is row["ops_per_step"] is row["peak_mem_bytes"] is None
    summary = (tmp_path / "sweep" / "summary.txt").read_text()
    assert "- naive @L1: failed: in the profiled steps, after the timed ones: OSError" in summary


@pytest.mark.parametrize("n", range(3, 10))
def test_round_orders_are_balanced(n: int) -> None:
    """Every cell takes every position, and within a round directly follows every other,
    equally often; rounds run back to back, and no cell ever runs twice in a row."""
    from profiling.analysis import balanced_orders

    rows = balanced_orders(n)
    assert all(sorted(row) == list(range(n)) for row in rows)
    positions = Counter((c, i) for row in rows for i, c in enumerate(row))
    follows = Counter(pair for row in rows for pair in itertools.pairwise(row))
    assert len(positions) == n * n and len(set(positions.values())) == 1
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1
    back_to_back = [c for row in rows * 2 for c in row]  # the rows repeat
    assert all(a != b for a, b in itertools.pairwise(back_to_back))


def test_two_cells_cross_over() -> None:
    """A B, B A: alternating A B A B would time B one step after A in every round, so drift in
    the machine's speed would read as B's cost. Each cell follows itself as often as the other."""
    from profiling.analysis import balanced_orders

    rows = balanced_orders(2)
    assert rows == [[0, 1], [1, 0]] and balanced_orders(1) == [[0]]
    back_to_back = [c for row in rows * 2 for c in row] + rows[0][:1]  # the rows repeat
    follows = Counter(itertools.pairwise(back_to_back))
    assert follows[(0, 0)] == follows[(1, 1)] == 2 and follows[(0, 1)] == follows[(1, 0)] == 2


def test_the_sweep_times_rounds_in_balanced_orders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a step inherits from the one before it (page faults, caches) is shared by all."""
    import profiling.sweep

    ran: list[str] = []
    timing = [False]

    def timed(fn, device):
        timing[0] = True
        try:
            return real_timed(fn, device)
        finally:
            timing[0] = False

    def recording(name: str):
        fn = attention.VARIANTS[name].fn

        def attend(q, k, v, mask, dropout_p):
            if timing[0]:
                ran.append(name)
            return fn(q, k, v, mask, dropout_p)

        return attention.Variant(name, attend, "recorded")

    real_timed = profiling.sweep.timed
    monkeypatch.setattr(profiling.sweep, "timed", timed)
    for name in ("naive", "inplace", "sdpa"):
        monkeypatch.setitem(attention.VARIANTS, name, recording(name))
    rc, _ = sweep(tmp_path, "--variants", "naive,inplace,sdpa", "--layers", "1", "--steps", "6")
    assert rc == 0
    a, b, c = "naive", "inplace", "sdpa"
    rounds = [ran[i : i + 3] for i in range(len(ran) - 18, len(ran), 3)]  # after the warm-up
    assert rounds == [[a, b, c], [b, c, a], [c, a, b], [a, c, b], [c, b, a], [b, a, c]]
    assert "balance is not complete" not in (tmp_path / "sweep" / "report.md").read_text()
    assert "warning: --steps" not in capsys.readouterr().err
    # Five rounds of three: not every order ran, and the user hears so before and after.
    rc, _ = sweep(
        tmp_path, "--variants", "naive,inplace,sdpa", "--layers", "1", "--steps", "5", name="5"
    )
    assert rc == 0
    assert "--steps 5 is not a multiple of 6, the number of orders that balance 3 cells" in (
        capsys.readouterr().err
    )
    report = (tmp_path / "5" / "report.md").read_text()
    assert "here 5 rounds of 3 cells: not a whole number of the 6 orders that" in report
    # A variant that cannot run here takes no turn: the rounds order the two that do
    ran.clear()
    rc, results = sweep(
        tmp_path, "--variants", "naive,inplace,flex", "--layers", "1", "--steps", "4", name="4"
    )
    assert rc == 0 and results["meta"]["round_cells"] == {"1": 2}
    assert ran[-8:] == [a, b, b, a, a, b, b, a]  # two cells cross over: A B, B A
    assert "warning: --steps" not in capsys.readouterr().err
    report = (tmp_path / "4" / "report.md").read_text()
    assert "each round in one of the two orders A B and B A in turn" in report
    assert "Latin square" not in report and "balance is not complete" not in report
    rc, _ = sweep(
        tmp_path, "--variants", "naive,inplace,flex", "--layers", "1", "--steps", "3", name="3"
    )
    assert rc == 0 and "--steps 3 is not a multiple of 2" in capsys.readouterr().err
    assert "here 3 rounds of 2 cells: not a whole" in (tmp_path / "3" / "report.md").read_text()
    # Without --steps: at least the minimum, in whole sets of orders (here 4, rounded up to 6)
    monkeypatch.setattr(profiling.sweep, "MIN_TIMED_STEPS", 4)
    out = tmp_path / "default"
    argv = ["--config", str(ROOT / "configs" / "profile.toml"), "--out", str(out), *TINY]
    argv += ["--variants", "naive,inplace,sdpa", "--layers", "1", "--warmup", "1"]
    assert profile_train.main([*argv, "--peak-seconds", "0.02"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["steps"] == 6 and results["rows"][0]["step_ms"]["n"] == 6
    assert "warning: --steps" not in capsys.readouterr().err


TIMES_MS = [10, 20, 30, 40, 100]  # median 30 (the mean is 40), p10 14, p90 76


# Two micro-batches of B=2 a step, asked for either way (one process: no ranks to divide by)
@pytest.mark.parametrize("accumulation", ["--train.grad_accum=2", "--train.global_batch_size=4"])
def test_warm_up_is_left_out_and_the_timed_steps_summarised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, accumulation: str
) -> None:
    """Scripted step times: the first step (compilation, if any) and the warm-up steps read
    9 s, the timed ones 10, 20, 30, 40 and 100 ms. Only the timed ones may reach the row, its rate and MFU,
    and the CSV must say the same as results.json."""
    import profiling.sweep

    calls: dict[int, int] = {}

    def timed(fn, device):
        fn()
        i = calls[id(fn)] = calls.get(id(fn), -1) + 1
        return 9.0 if i < 3 else TIMES_MS[i - 3] / 1e3

    monkeypatch.setattr(profiling.sweep, "timed", timed)
    args = ("--variants", "naive,sdpa", "--layers", "1", "--warmup", "3", "--steps", "5")
    rc, results = sweep(tmp_path, *args, accumulation)
    assert rc == 0
    assert results["meta"]["config"]["train"]["grad_accum"] == 2  # what ran, also if derived
    assert sorted(calls.values()) == [7, 7]  # per cell: 1 first + 2 more warm-up + 5 timed
    peak = results["meta"]["peak_flops"]
    with open(tmp_path / "sweep" / "results.csv", newline="") as f:
        csv_rows = {r["variant"]: r for r in csv.DictReader(f)}
    for row in results["rows"]:
        assert row["step_ms"] == pytest.approx({"median": 30, "p10": 14, "p90": 76, "n": 5})
        assert row["tokens_per_s"] == pytest.approx(2 * 2 * 32 / 0.030)  # B x grad_accum x T
        assert row["mfu"] == pytest.approx(row["flops_per_step"] / 0.030 / peak)
        written = csv_rows[row["variant"]]
        for key in ("median", "p10", "p90"):
            assert float(written[f"step_ms_{key}"]) == pytest.approx(row["step_ms"][key])
        assert float(written["tokens_per_s"]) == pytest.approx(row["tokens_per_s"])
        assert float(written["mfu"]) == pytest.approx(row["mfu"])


def test_a_timed_step_that_compiled_is_counted_and_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recompile in the timed steps would put a compile in a step time: the sweep counts
    such steps and the report warns of them."""
    import profiling.sweep

    compiles = itertools.count()  # a stand-in: every reading finds something new compiled
    real_counters = profiling.sweep.compile_counters
    monkeypatch.setattr(
        profiling.sweep, "compile_counters", lambda: real_counters() | {"graphs": next(compiles)}
    )
    rc, results = sweep(tmp_path, "--variants", "naive", "--layers", "1")
    assert rc == 0
    [row] = results["rows"]
    assert row["compiles_while_timed"] == 2
    warning = "timed steps compiled something (a recompile: a guard failed, a shape was made"
    for name in ("report.md", "summary.txt"):
        text = (tmp_path / "sweep" / name).read_text()
        assert warning in text and "in naive L1 (2 of 2)" in text, name


def record_step_times(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[float]]:
    """Each cell's step times in seconds, by its step function, first (compiling) step first."""
    import profiling.sweep

    real_timed, seconds = profiling.sweep.timed, {}

    def timed(fn, device):
        t = real_timed(fn, device)
        seconds.setdefault(id(fn), []).append(t)
        return t

    monkeypatch.setattr(profiling.sweep, "timed", timed)
    return seconds


@pytest.mark.slow
@pytest.mark.cxx
def test_compile_time_nets_out_what_any_first_step_pays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AdamW's state and the allocator's set-up make an eager first step slow too: with
    --compile both, the eager twin's excess is taken off the compiled cell's."""
    seconds = record_step_times(monkeypatch)
    rc, results = sweep(tmp_path, "--variants", "naive", "--layers", "1", "--compile", "both")
    assert rc == 0
    (first_e, *eager), (first_c, *compiled) = seconds.values()  # warmed up in this order
    eager_row, compiled_row = results["rows"]
    assert not eager_row["compile"] and compiled_row["compile"]
    assert eager_row["compile_s"] is None and eager_row["first_step_ms"] > 0
    excess = first_e - statistics.median(eager)
    assert compiled_row["eager_excess_s"] == pytest.approx(excess)
    net = first_c - statistics.median(compiled) - max(0.0, excess)  # a negative one is noise
    assert compiled_row["compile_s"] == (pytest.approx(net) if net > 0 else None)
    assert results["meta"]["compile_time"] == "less eager"
    report = (tmp_path / "sweep" / "report.md").read_text()
    assert "less the same difference of the eager cell" in report
    # "cached" now means the C++ kernels too; the report says so only of sweeps that checked
    assert results["meta"]["compile_cache"] == "graphs and C++ kernels"
    assert "(and, on CPU, built none of their C++ kernels again)" in report


def test_compile_time_keeps_an_eager_first_steps_own_compile() -> None:
    """Eager flex compiles its kernel in its first step: that excess is compilation, so the
    compiled twin's is not netted by it. A twin whose single first step ran longer than the
    compiled cell's excess leaves no compile time to tell (None), not 0."""
    from profiling.cells import Cell, compile_seconds, eager_first_step_excess

    def cell(variant: str, compiled: bool, first: float, **kw: object) -> Cell:
        return Cell(variant, 1, compiled, times=[0.1, 0.1, 0.1], first_step_s=first, **kw)

    cells = [
        cell("naive", False, 0.4),
        cell("naive", True, 2.5),
        cell("flex", False, 3.1, first_step_compiled=True),
        cell("flex", True, 2.0),
        cell("sdpa", False, 0.9, status="failed"),
    ]
    assert eager_first_step_excess(cells) == pytest.approx({"naive": 0.3})
    assert compile_seconds(2.5, 0.1, 0.3) == pytest.approx(2.1)
    assert compile_seconds(2.0, 0.1, None) == pytest.approx(1.9)  # flex: nothing to take off
    assert compile_seconds(0.35, 0.1, 0.3) is None
    # A twin whose first step beat its median (noise) adds nothing to the compile time.
    assert compile_seconds(0.7, 0.1, -0.16) == pytest.approx(0.6)


@pytest.mark.slow
@pytest.mark.cxx
def test_every_depth_traces_its_own_graphs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Identical blocks would reuse the first depth's Dynamo graphs and compile nothing; each
    cell also says whether Inductor's on-disk cache supplied its compiled graphs."""
    import profiling.sweep

    seconds = record_step_times(monkeypatch)
    marked = []  # compiled blocks' attention calls stay unmarked: swapping would recompile them
    monkeypatch.setattr(profiling.sweep, "attention_calls_marked", marked.append)
    rc, results = sweep(tmp_path, "--variants", "naive", "--layers", "1,2", "--compile", "on")
    assert rc == 0 and marked == []
    assert len(seconds) == len(results["rows"]) == 2
    for row, (first, *steps) in zip(results["rows"], seconds.values(), strict=True):
        assert row["status"] == "ok"
        # The first step's time less a timed step's median (--warmup 1: no other warm-up);
        # no eager twin in this sweep to net out. On a loaded machine the median can exceed
        # the first step (a warm cache leaves little to compile): then None, not a negative.
        excess = first - statistics.median(steps)
        assert row["compile_s"] == (pytest.approx(excess) if excess > 0 else None)
        assert row["first_step_ms"] == pytest.approx(first * 1e3)
        assert row["eager_excess_s"] is None
        assert row["compile_cache"] in ("cold", "cached"), row["n_layer"]
        assert row["compiles_while_timed"] == 0  # compiled in its first step, not after
    # The compiler's start-up is paid apart, so it is not charged to the first compiled cell.
    assert results["meta"]["compiler_startup_s"] > 0
    assert results["meta"]["startup"] == "tiny model"  # a training step, not a toy function
    assert "one-time start-up" in (tmp_path / "sweep" / "report.md").read_text()


@pytest.mark.slow
@pytest.mark.cxx
def test_compiled_sdpa_measures_the_same_steps_beside_pinned_variants(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pinned variant breaks the compiled block's graph at its attention call; sdpa+compile
    must not run through that break (more graphs, more ops), so the pinned cells are left out
    of a sweep that compiles sdpa, saying how to run them."""
    args = ["--layers", "1", "--compile", "on", "--no-traces"]
    rc, alone = sweep(tmp_path, "--variants", "sdpa", *args, name="alone")
    assert rc == 0
    rc, beside = sweep(tmp_path, "--variants", "sdpa-math,sdpa,sdpa-flash", *args, name="beside")
    assert rc == 0
    rows = {r["variant"]: r for r in beside["rows"]}
    assert rows["sdpa"]["status"] == "ok"
    assert rows["sdpa"]["ops_per_step"] == alone["rows"][0]["ops_per_step"]
    for pinned in ("sdpa-math", "sdpa-flash"):  # one command for both: they share a sweep well
        assert rows[pinned]["status"] == "unsupported"
        assert "--variants naive,sdpa-math,sdpa-flash --compile on" in rows[pinned]["reason"]
    # Run so, each pinned cell runs its own backend; the second runs graphs compiled for the
    # first, all but those its attention's output strides change (flash's differ from math's).
    seconds = record_step_times(monkeypatch)
    rc, apart = sweep(tmp_path, "--variants", "sdpa-math,sdpa-flash", *args, name="apart")
    assert rc == 0
    math, flash = apart["rows"]
    assert (math["status"], math["backend"]) == ("ok", "MATH")
    assert (flash["status"], flash["backend"]) == ("ok", "FLASH_ATTENTION")
    assert flash["compile_cache"] == "partly shared"
    assert math["compiles_while_timed"] == flash["compiles_while_timed"] == 0
    # Both are given a compile time (a "shared" cell is not): first step less the timed median,
    # None where a loaded machine made a timed step the longer (compile_seconds: not 0).
    for row, (first, *steps) in zip(apart["rows"], seconds.values(), strict=True):
        net = first - statistics.median(steps)
        assert row["compile_s"] == (pytest.approx(net) if net > 0 else None), row["variant"]
    assert " (partly shared) |" in (tmp_path / "apart" / "report.md").read_text()


def test_what_a_compiled_first_step_compiled() -> None:
    """From the compiler's counters: Inductor's cache served it, Inductor compiled (a miss, a
    graph the cache passes by, or the cache off: graphs traced, no lookups), or nothing."""
    from profiling.cells import compile_cache

    zero = {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 0, "fxgraph_cache_bypass": 0}
    zero["graphs"] = 0
    step = lambda **new: compile_cache(zero, zero | new)
    assert step(fxgraph_cache_hit=2, graphs=1) == "cached"
    assert step(fxgraph_cache_hit=1, fxgraph_cache_miss=1, graphs=1) == "cold"
    assert step(fxgraph_cache_bypass=1, graphs=1) == "cold"
    assert step(graphs=1) == "cold"  # TORCHINDUCTOR_FX_GRAPH_CACHE=0
    assert step() == "none"
    # Graphs found in the cache, but C++ kernels built again behind them: no counter says so
    assert compile_cache(zero, zero | {"fxgraph_cache_hit": 2, "graphs": 1}, 3) == "cold"


def test_the_kernels_a_first_step_built_are_counted_by_their_libraries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built in this process or in Inductor's compile workers, a C++ kernel leaves a shared
    library in the cache folder: counted there, at any depth of it."""
    from profiling.cells import kernel_libraries

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert kernel_libraries() == 0  # made, empty, as Inductor makes it
    (tmp_path / "inductor" / "ab").mkdir()
    for name in ("ab/cab.so", "ab/cab.cpp", "x.so"):
        (tmp_path / "inductor" / name).write_text("")
    assert kernel_libraries() == 2


def test_a_first_step_that_compiled_nothing_reads_reused_only_without_a_time() -> None:
    """Sweeps before 'none' meant no compile time gave one all the same: no mark there."""
    from profiling.method import compile_mark

    assert compile_mark({"compile_cache": "none", "compile_s": None}) == " (reused)"
    assert compile_mark({"compile_cache": "none", "compile_s": 1.59}) == ""
    assert compile_mark({"compile_cache": "cached", "compile_s": 0.4}) == " (cached)"


@pytest.mark.filterwarnings("error:clamping frac")  # tqdm's word for a bar past its total
def test_the_progress_bar_moves_with_the_steps_and_ends_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A depth's cells all finish after its last round: the bar moves by steps, so it is not
    still at 0 then, never goes back, and ends full, a failed cell included. A deeper cell's
    step moves it further (its time left would otherwise read low from the first depth on),
    and its words count the cells recorded."""
    import profiling.progress

    seen: list[float] = []  # the bar's position
    said: dict[str, float] = {}  # the bar's words, and its position when they were said

    class Recorded(profiling.progress.tqdm):
        def update(self, n: float = 1) -> bool | None:
            out = super().update(n)
            seen.append(self.n / self.total)
            return out

        def refresh(self, *args: object, **kwargs: object) -> None:
            super().refresh(*args, **kwargs)
            seen.append(self.n / self.total)

        def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
            said[s] = self.n / self.total
            super().set_postfix_str(s, refresh)

    monkeypatch.setattr(profiling.progress, "tqdm", Recorded)
    rc, _ = sweep(tmp_path, "--variants", "naive,sdpa-efficient", "--layers", "1,2", "--no-traces")
    assert rc == 0
    assert seen == sorted(seen) and seen[-1] == 1  # 2 variants x 2 depths; one unsupported
    assert any(0 < n < 0.1 for n in seen)  # moving before the first cell is recorded
    # Two cells of n_layer 1 (weight 2), two of 2 (weight 3): the first depth is 2/5 of it.
    assert said["2/4 cells"] == pytest.approx(0.4) and said["4/4 cells"] == 1
    assert "0/4 cells, warm-up naive L1" in said
    # sdpa-efficient cannot run on a CPU: its share (0.2) is done once that is known, not after
    # the depth's rounds, which it takes no part in.
    assert said["0/4 cells, L1 round 1/2"] > 0.2


def test_a_sweep_that_measured_nothing_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Every cell failed: the report says no cell measured (not a negative degrees of freedom)
    and the command exits non-zero, for `make profile && ...`."""

    def broken(q, k, v, mask, dropout_p):
        if q.size(0) > 1:
            raise RuntimeError("kernel exploded")
        return attention.naive(q, k, v, mask, dropout_p)

    monkeypatch.setitem(attention.VARIANTS, "naive", attention.Variant("naive", broken, "x"))
    rc, results = sweep(tmp_path, "--variants", "naive", "--layers", "1", "--steps", "1")
    assert rc == 1
    assert [r["status"] for r in results["rows"]] == ["failed"]
    assert "no cell was measured" in capsys.readouterr().err
    report = (tmp_path / "sweep" / "report.md").read_text()
    assert "no cell measured, as here, fits no line" in report and "-2 with" not in report
    assert "(needs `naive` and another variant measured at two depths or more)" in report


def test_an_out_folder_that_cannot_be_written_is_refused_before_measuring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """An existing empty folder passes main's checks; a read-only one (a read-only mount, where
    root's writes fail too) is refused before the peak is measured, not after a depth."""
    import rundir

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(rundir.tempfile, "TemporaryFile", read_only)
    out = tmp_path / "ro"
    out.mkdir()
    assert profile_train.main(["--variants", "naive", "--layers", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: cannot write there (Read-only file system)" in err
    assert "matmul peak" not in err
    # A link to nothing: mkdir calls it existing, which is not another sweep's doing
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "gone")
    assert profile_train.main(["--variants", "naive", "--layers", "1", "--out", str(dangling)]) == 2
    err = capsys.readouterr().err
    assert f"--out {dangling} is a link to {tmp_path / 'gone'}, which does not exist" in err
    # A file is named as one; a name that is not UTF-8 (the report names the folder) refused
    (tmp_path / "afile").write_text("")
    assert (
        profile_train.main(
            ["--variants", "naive", "--layers", "1", "--out", str(tmp_path / "afile")]
        )
        == 2
    )
    assert f"--out {tmp_path / 'afile'} is a file; give a folder" in capsys.readouterr().err
    undecodable = os.fsdecode(bytes(tmp_path / "out") + b"\xff")
    assert profile_train.main(["--variants", "naive", "--layers", "1", "--out", undecodable]) == 2
    assert "not valid UTF-8; give another folder" in capsys.readouterr().err
    assert not Path(undecodable).exists()


@pytest.mark.png  # its plots, with a failed cell among the rows, rendered for real
def test_failing_cells_do_not_stop_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(q, k, v, mask, dropout_p):
        if q.size(0) > 1:  # the availability probe uses B=1 and passes; the sweep does not
            raise RuntimeError("kernel exploded")
        return attention.naive(q, k, v, mask, dropout_p)

    def too_big(q, k, v, mask, dropout_p):
        if q.size(0) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return attention.naive(q, k, v, mask, dropout_p)

    def too_big_for_the_host(q, k, v, mask, dropout_p):
        if q.size(0) > 1:  # what the CPU allocator raises: a plain RuntimeError
            raise RuntimeError(
                "[enforce fail at alloc_cpu.cpp:124] data. DefaultCPUAllocator: can't allocate "
                "memory: you tried to allocate 35184372088832 bytes. Error code 12"
            )
        return attention.naive(q, k, v, mask, dropout_p)

    monkeypatch.setitem(
        attention.VARIANTS, "inplace", attention.Variant("inplace", broken, "broken")
    )
    monkeypatch.setitem(
        attention.VARIANTS, "sdpa-math", attention.Variant("sdpa-math", too_big, "too big")
    )
    monkeypatch.setitem(
        attention.VARIANTS, "sdpa", attention.Variant("sdpa", too_big_for_the_host, "too big")
    )
    rc, results = sweep(
        tmp_path, "--variants", "naive,inplace,sdpa-efficient,sdpa-math,sdpa", "--layers", "1,2"
    )
    assert rc == 0
    status = {(r["variant"], r["n_layer"]): (r["status"], r["reason"]) for r in results["rows"]}
    assert status[("naive", 1)][0] == status[("naive", 2)][0] == "ok"
    assert status[("inplace", 2)] == ("failed", "RuntimeError: kernel exploded")
    # Out of memory beside the depth's other cells: the reason says so, and how to run it alone.
    oom, why = status[("sdpa-math", 2)]
    assert oom == "oom" and why.startswith("OutOfMemoryError: CUDA out of memory")
    assert "other cell(s) of n_layer=2 in memory" in why
    assert "--variants sdpa-math --layers 2 --compile off" in why
    oom, why = status[("sdpa", 1)]
    assert oom == "oom" and "DefaultCPUAllocator: can't allocate memory" in why
    assert status[("sdpa-efficient", 1)][0] == "unsupported"
    assert "only for CUDA" in status[("sdpa-efficient", 1)][1]
    report = (tmp_path / "sweep" / "report.md").read_text()
    assert "did not run" in report
    # One line in the row; where it failed, in the traceback kept beside it
    assert "Each failed cell's traceback is in `failures.log`." in report
    log = (tmp_path / "sweep" / "failures.log").read_text()
    assert "--- inplace L1: RuntimeError: kernel exploded" in log
    assert "--- inplace L2: RuntimeError: kernel exploded" in log
    assert 'in broken\n    raise RuntimeError("kernel exploded")' in log
    assert "--- sdpa" not in log, "out of memory, not a failure to trace"
    summary = (tmp_path / "sweep" / "summary.txt").read_text()  # what make profile prints
    assert "- inplace @L1,2: failed: RuntimeError: kernel exploded" in summary
    assert "- sdpa-efficient @L1,2: unsupported: sdpa-efficient cannot run on cpu" in summary


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])  # Ctrl-C; `timeout`
def test_interrupted_sweep_keeps_what_it_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: signal.Signals
) -> None:
    real_time = Sweep._time

    def time_then_interrupt(self, cells):
        if cells[0].n_layer == 2:
            os.kill(os.getpid(), stop)
            time.sleep(5)  # the handler raises at once; this is never finished
        return real_time(self, cells)

    monkeypatch.setattr(Sweep, "_time", time_then_interrupt)
    before = signal.getsignal(signal.SIGTERM)
    rc, results = sweep(tmp_path, "--variants", "naive", "--layers", "1,2")
    assert rc == 128 + stop
    assert signal.getsignal(signal.SIGTERM) == before, "the SIGTERM handler is put back"
    assert [(r["variant"], r["n_layer"], r["status"]) for r in results["rows"]] == [
        ("naive", 1, "ok")
    ]
    for name in ("report.md", "step_time_vs_layers.png", "memory_vs_layers.png"):
        assert (tmp_path / "sweep" / name).is_file(), f"{name} not written on Ctrl-C"


def test_a_sweep_stopped_while_profiling_keeps_the_depths_timed_cells(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A depth's cells are all timed, then profiled one by one: a Ctrl-C in between (or
    gpu_check.sh's timeout) keeps the step times of the cells not yet profiled, marked so."""
    real_profile = Sweep._profile

    def profile_then_interrupt(self, cell):
        if cell.n_layer == 2:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises at once; this is never finished
        return real_profile(self, cell)

    monkeypatch.setattr(Sweep, "_profile", profile_then_interrupt)
    rc, results = sweep(tmp_path, "--variants", "naive,inplace", "--layers", "1,2")
    assert rc == 130
    rows = {(r["variant"], r["n_layer"]): r for r in results["rows"]}
    assert [(v, n, r["status"]) for (v, n), r in rows.items()] == [
        ("naive", 1, "ok"),
        ("inplace", 1, "ok"),
        ("naive", 2, "interrupted"),
        ("inplace", 2, "interrupted"),
    ]
    for name in ("naive", "inplace"):
        kept = rows[(name, 2)]
        assert kept["step_ms"]["n"] == 2 and kept["tokens_per_s"] > 0
        assert kept["ops_per_step"] is None and kept["mfu"] is None, "not verified: not ok"
    report = (tmp_path / "sweep" / "report.md").read_text()
    assert "@L2: interrupted: the sweep was stopped before its profiled steps" in report
    assert "**Incomplete sweep**: 2 of 4 cells were measured before it stopped; 2 more" in report
    naive_line = next(line for line in report.splitlines() if line.startswith("| naive |"))
    median = format(rows[("naive", 2)]["step_ms"]["median"], ".1f")
    shown = naive_line.split(" | ")[2].replace("*", "")
    assert shown == f"{median} (interrupted)", "its step time in the table, marked"


def test_a_sweep_stopped_in_its_first_timed_rounds_keeps_the_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C in the middle of the first depth's rounds: the rounds timed so far are kept,
    marked, in a results.json that stays (a sweep with nothing measured would remove its
    folder)."""
    from profiling.measure import timed as real_timed

    calls: list[int] = []
    real_rounds = Sweep._timed_rounds

    def rounds(self, cells, gc_runs):
        calls.append(0)  # the warm-up steps before the rounds are not counted
        return real_rounds(self, cells, gc_runs)

    def timed_then_interrupt(step, device):
        if calls:
            calls.append(1)
            if len(calls) == 4:  # round 2's first step, 2 cells a round
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # the handler raises at once; this is never finished
        return real_timed(step, device)

    monkeypatch.setattr(Sweep, "_timed_rounds", rounds)
    monkeypatch.setattr("profiling.sweep.timed", timed_then_interrupt)
    rc, results = sweep(tmp_path, "--variants", "naive,inplace", "--layers", "1,2")
    assert rc == 130
    assert [(r["variant"], r["n_layer"], r["status"]) for r in results["rows"]] == [
        ("naive", 1, "interrupted"),
        ("inplace", 1, "interrupted"),
    ]
    for row in results["rows"]:
        assert row["step_ms"]["n"] == 1 and len(row["times_ms"]) == 1
        assert "stopped before its profiled steps: 1 of its 2 steps were timed" in row["reason"]
    assert (tmp_path / "sweep" / "report.md").is_file()


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_whose_exception_python_drops_still_stops_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: signal.Signals
) -> None:
    """A signal that lands in a weakref callback (Dynamo runs many): Python prints the
    handler's exception as 'Exception ignored' and goes on. The sweep stops at its next step."""
    real_time = Sweep._time

    def time_after_a_dropped_signal(self, cells):
        if cells[0].n_layer == 2:

            def callback(ref: weakref.ref) -> None:
                os.kill(os.getpid(), stop)
                for _ in range(10_000):  # the handler runs in here; its exception is dropped
                    pass

            referent = Sweep.__new__(Sweep)
            ref = weakref.ref(referent, callback)  # noqa: F841 (kept alive until the del)
            del referent
        return real_time(self, cells)

    dropped: list[type[BaseException]] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_type))
    monkeypatch.setattr(Sweep, "_time", time_after_a_dropped_signal)
    rc, results = sweep(tmp_path, "--variants", "naive", "--layers", "1,2")
    assert dropped and issubclass(dropped[0], KeyboardInterrupt), "the case under test happened"
    assert rc == 128 + stop
    assert [(r["variant"], r["n_layer"]) for r in results["rows"]] == [("naive", 1)]


def test_ctrl_c_during_the_closing_peak_reading_still_draws_the_plots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import profiling.sweep

    real_peaks = profiling.sweep.matmul_peaks
    readings = []

    def peaks_then_interrupt(*args, **kwargs):
        readings.append(1)
        if len(readings) == 2:  # the second reading, after the last cell
            raise KeyboardInterrupt
        return real_peaks(*args, **kwargs)

    monkeypatch.setattr(profiling.sweep, "matmul_peaks", peaks_then_interrupt)
    rc, results = sweep(tmp_path, "--variants", "naive", "--layers", "1")
    assert rc == 130 and len(results["rows"]) == 1
    assert "finished_at" not in results["meta"]  # what gpu_check.sh tells a whole sweep by
    report = (tmp_path / "sweep" / "report.md").read_text()
    assert "measured at the start only: the sweep stopped before the end reading" in report
    assert "every MFU here high" in report, "one reading, maybe low: said"
    summary = (tmp_path / "sweep" / "summary.txt").read_text()
    assert "matmul, measured on the spot at the start only (the sweep stopped first)" in summary
    for name in ("step_time_vs_layers.png", "memory_vs_layers.png"):
        assert (tmp_path / "sweep" / name).is_file(), name


@pytest.mark.parametrize("made_by_user", [False, True])
def test_ctrl_c_before_any_cell_leaves_no_half_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, made_by_user: bool
) -> None:
    """A folder the sweep made goes, with the folders it made above it; one the user made (it
    must be empty) stays, emptied."""

    def interrupt(self, cells):
        (self.out / "traces").mkdir()  # as if a trace had been written
        raise KeyboardInterrupt

    monkeypatch.setattr(Sweep, "_time", interrupt)
    (tmp_path / "runs").mkdir()
    out = tmp_path / "runs" / "new" / "nested" / "sweep"
    if made_by_user:
        out.mkdir(parents=True)
    rc = profile_train.main(
        ["--out", str(out), "--variants", "naive", "--layers", "1", "--peak-seconds", "0.05", *TINY]
    )
    assert rc == 130
    assert out.is_dir() == made_by_user
    assert not made_by_user or not any(out.iterdir())
    assert (tmp_path / "runs").is_dir(), "a folder that was there before stays"
    assert (tmp_path / "runs" / "new").exists() == made_by_user


@pytest.mark.parametrize("stopped_in", ["__init__", "make_sweep_folder"])
def test_ctrl_c_before_a_sweep_holds_its_out_leaves_another_sweeps_files_there(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    stopped_in: str,
) -> None:
    """Two sweeps given one new --out a moment apart: the second, interrupted while it sets up
    (probing its variants, or making the folder the first has just made), has written nothing
    there, so it removes nothing of the first's."""
    import profiling.sweep

    out = tmp_path / "sweep"
    held = []
    where = Sweep if stopped_in == "__init__" else profiling.sweep
    real = getattr(where, stopped_in)

    def first_sweep_then_interrupt(*args: object, **kwargs: object) -> None:
        real(*args, **kwargs)
        # Meanwhile the first sweep made the folder, holds it and wrote a trace
        (out / "traces").mkdir(parents=True)
        held.append(open(out / ".lock", "a+"))  # noqa: SIM115 (closed below)
        fcntl.flock(held[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
        raise KeyboardInterrupt

    monkeypatch.setattr(where, stopped_in, first_sweep_then_interrupt)
    try:
        rc = profile_train.main(["--out", str(out), "--variants", "naive", "--layers", "1", *TINY])
    finally:
        held[0].close()
    assert rc == 130
    assert (out / "traces").is_dir() and (out / ".lock").is_file()
    assert capsys.readouterr().err.splitlines()[-1] == "interrupted"


def test_a_sweep_that_ended_in_the_folder_meanwhile_is_not_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--out is checked empty before the sweep sets up; one that ran and ended there since
    (its lock released) keeps its files, and this sweep is refused."""
    import profiling.sweep

    out = tmp_path / "sweep"
    real = profiling.sweep.make_sweep_folder

    def another_sweep_ends_there(folder: Path, exclusive: bool) -> None:
        real(folder, exclusive)
        for name in ("results.json", "report.md"):
            (out / name).write_text("the other sweep's")

    monkeypatch.setattr(profiling.sweep, "make_sweep_folder", another_sweep_ends_there)
    argv = ["--out", str(out), "--variants", "naive", "--layers", "1", *TINY]
    assert profile_train.main(argv) == 2
    assert (
        f"--out {out}: another sweep wrote there since this one started (report.md, results.json)"
        in capsys.readouterr().err
    )
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "results.json"]
    assert (out / "results.json").read_text() == "the other sweep's"


def test_ctrl_c_before_any_cell_of_a_default_folder_sweep_leaves_no_profiles_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupt(self, cells):
        raise KeyboardInterrupt

    monkeypatch.setattr(Sweep, "_time", interrupt)
    monkeypatch.chdir(tmp_path)
    config = str(ROOT / "configs" / "profile.toml")
    argv = ["--config", config, "--variants", "naive", "--layers", "1", "--peak-seconds", "0.05"]
    assert profile_train.main([*argv, *TINY]) == 130
    assert list(tmp_path.iterdir()) == []


def test_a_plot_that_cannot_be_written_is_an_error_naming_it_and_the_cells_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import matplotlib.figure

    def full_disk(self: object, *args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    out = tmp_path / "s"
    argv = ["--variants", "naive", "--layers", "1", "--out", str(out), "--steps", "1"]
    assert profile_train.main([*argv, *TINY]) == 2
    err = capsys.readouterr().err
    png = out / "step_time_vs_layers.png"
    assert f"No space left on device: {png} (free space); the cells measured so far" in err
    assert [r["status"] for r in json.loads((out / "results.json").read_text())["rows"]] == ["ok"]


def test_a_report_file_that_cannot_be_written_is_named_and_the_old_one_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from profiling.report import replace_file

    path = tmp_path / "report.md"
    replace_file(path, "before")

    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")  # a flush names no file

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError) as raised:
        replace_file(path, "after")
    assert raised.value.filename == str(path)
    assert path.read_bytes() == b"before" and not list(tmp_path.glob("*.tmp"))


def test_the_report_warns_when_other_processes_took_over_a_tenth_of_the_cpus(
    naive_vs_inplace: dict, tmp_path: Path
) -> None:
    """Counted in the timed rounds; a sweep from before that counted it over its whole run
    (compiling, profiling) says so, and --compare does not hold such a share against it."""
    from profiling.compare import _slowed
    from profiling.report import write_report

    results = copy.deepcopy(naive_vs_inplace)
    meta = results["meta"]
    for share, warned in [(0.05, False), (0.1, False), (0.15, True), (0.5, True)]:
        meta["other_cpu_share"] = share
        write_report(tmp_path, results, plots=False)
        summary = (tmp_path / "summary.txt").read_text()
        said = f"**Warning**: other processes used {share:.0%} of the CPUs during the timed steps"
        assert (said in summary) == warned, share
        assert (said in (tmp_path / "report.md").read_text()) == warned, share
        assert _slowed(meta) == warned
    del meta["other_cpu_window"]  # an older sweep's share
    write_report(tmp_path, results, plots=False)
    assert (
        "other processes used 50% of the CPUs during this sweep"
        in (tmp_path / "summary.txt").read_text()
    )
    assert not _slowed(meta)


def test_damaged_results_json_is_an_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for text, expect in [
        ('{"meta": {', "not valid JSON"),
        ("[1, 2]", "no 'meta'"),
        ('{"meta": {}, "rows": []}', "no rows"),
        ('{"meta": {}, "rows": [{}]}', "results.json: meta has no 'device'; was it edited by"),
    ]:
        (tmp_path / "results.json").write_text(text)
        assert profile_train.main(["--report", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and expect in err and "results.json" in err, err
    # Not a folder at all: said so, not "no results.json there"
    results = tmp_path / "results.json"
    for flag, then in (("--report", []), ("--compare", [str(tmp_path)])):  # named first
        assert profile_train.main([flag, str(tmp_path / "gone"), *then]) == 2
        assert f"{tmp_path / 'gone'}: no such folder" in capsys.readouterr().err
        assert profile_train.main([flag, str(results), *then]) == 2
        err = capsys.readouterr().err
        assert f"{results}: a file, not a folder; give the sweep's folder ({tmp_path})" in err


@pytest.mark.parametrize(
    "edit, said",
    [
        (
            lambda r: r["rows"][3]["step_ms"].update(p90="12"),
            'rows[3] (naive L2): step_ms.p90 is "12", not a number',
        ),
        (lambda r: r["rows"][-1].update(mfu="x"), 'rows[8] (sdpa-math L3): mfu is "x", not a'),
        (lambda r: r["rows"][0].update(step_ms=None), "rows[0] (naive L1): status is 'ok' but"),
        (lambda r: r["rows"][2].pop("status"), "rows[2] (sdpa-math L1) has no 'status'"),
        (lambda r: r["rows"][2].update(compile="no"), 'rows[2]: compile is "no", not true or'),
        (lambda r: r["rows"][1].update(n_layer=0), "rows[1]: n_layer is 0, not a whole number"),
        (lambda r: r["rows"][4]["step_ms"].pop("n"), "rows[4] (inplace L2): step_ms.n is missing"),
        (
            lambda r: r["rows"][0]["ops_per_step"]["forward"].update({"aten::mm": None}),
            "rows[0] (naive L1): ops_per_step.forward.aten::mm is null, not a number",
        ),
        (lambda r: r["rows"].append(r["rows"][4]), "rows[4] and rows[9] (inplace L2) measure the"),
        (lambda r: r["rows"][5]["times_ms"].__setitem__(0, None), "times_ms[0] is null, not a"),
        (lambda r: r["meta"].pop("peak_flops"), "meta has no 'peak_flops'"),
        (lambda r: r["meta"].update(steps=2.5), "meta.steps is 2.5, not a whole number"),
        (
            lambda r: r["rows"][0].update(gc_collections=[1]),
            "rows[0] (naive L1): gc_collections is [1], not a list of 3 whole numbers",
        ),
        # Past the check: the report's own reading, whose failing line is named
        (lambda r: r["meta"].update(config={}), "lacks what the report reads (KeyError: 'model'"),
    ],
)
def test_a_report_that_cannot_be_rendered_leaves_the_sweeps_files_as_they_were(
    naive_vs_inplace: dict,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    edit: Callable[[dict], object],
    said: str,
) -> None:
    """A results.json edited by hand into what the report cannot read: the error names the row
    and field, and every file but results.json is left as it was."""
    out = Path(shutil.copytree(naive_vs_inplace["meta"]["out"], tmp_path / "sweep"))
    results = json.loads((out / "results.json").read_text())
    assert profile_train.main(["--report", str(out)]) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    edit(results)
    (out / "results.json").write_text(json.dumps(results))
    runs = [["--report", str(out)]]
    if "lacks" not in said:  # --diff reads no config: only the check stops it
        runs.append(["--report", str(out), "--diff", "naive,inplace"])
    for argv in runs:
        assert profile_train.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {out / 'results.json'}") and said in err, err
        if "lacks" in said:  # the line that failed: a bug here is not taken for damage
            assert re.search(r", at \w+\.py:\d+\): was it edited by hand\? If not, that", err)
        else:
            assert err.endswith("; was it edited by hand?\n"), err
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert {k: v for k, v in after.items() if k != "results.json"} == {
        k: v for k, v in before.items() if k != "results.json"
    }


def test_every_published_results_json_passes_the_check() -> None:
    """The check reads the sweeps written before its fields were added, as the report does."""
    published = sorted(Path(__file__).parent.parent.glob("docs/results/**/results.json"))
    assert len(published) >= 11
    for path in published:
        assert results_problem(json.loads(path.read_text())) is None, path


@pytest.mark.parametrize("flag", ["--variants=naive,sdpa,naive", "--layers=1,2,1"])
def test_a_variant_or_depth_given_twice_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    assert profile_train.main(["--out", str(tmp_path / "s"), flag, *TINY]) == 2
    err = capsys.readouterr().err
    assert flag.split("=")[0] in err and "more than once" in err
    assert not (tmp_path / "s").exists()


def test_unknown_variants_are_each_named_with_the_closest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--out", str(tmp_path / "s"), "--variants=sdpa_flash,naive,xyz", *TINY]
    assert profile_train.main(argv) == 2
    err = capsys.readouterr().err
    assert "--variants: unknown attention variants 'sdpa_flash' (did you mean 'sdpa-flash'?)" in err
    assert ", 'xyz'; valid choices: naive, inplace, sdpa," in err
    assert not (tmp_path / "s").exists()


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


VARIANTS_SLOPES = [("naive", 5, False), ("sdpa", 3, False), ("naive", 4, True), ("sdpa", 3, True)]


def test_median_interval_is_the_order_statistics_of_the_sign_test() -> None:
    """95% intervals for a median from n values: x(k), x(n+1-k), as in the standard tables."""
    for n, k in [(6, 1), (8, 1), (10, 2), (16, 4), (20, 6), (30, 10)]:
        assert median_interval(list(range(1, n + 1))) == (k, n + 1 - k), n
    assert median_interval([1.0] * 5) is None  # 5 values: even min to max covers only 94%
    # The coverage it promises, checked by simulation: skewed values, true median log(2).
    rng = np.random.default_rng(0)
    samples = rng.exponential(size=(4000, 20))
    hits = [low <= math.log(2) <= high for low, high in map(median_interval, samples.tolist())]
    assert np.mean(hits) >= 0.95


def test_paired_savings_use_the_rounds() -> None:
    """A disturbance that slows every cell of a round alike drops out of each pair: the
    saving and its interval are exact, however the disturbances spread the times."""
    drift = [0, 0, 9, 0, 0, 9, 9, 0]  # ms: rounds 3, 6 and 7 ran slow
    rows = []
    for n in (1, 2):
        for variant, compiled, cost in [
            ("naive", False, 10),
            ("inplace", False, 9.5),
            ("naive", True, 8),
            ("sdpa", True, 6),
        ]:
            row = timed_row(variant, n, 0.0, compiled)
            row["times_ms"] = [cost * n + d for d in drift]
            rows.append(row)
    rows.append(dict(timed_row("sdpa", 1, 0.0), times_ms=[1.0] * 7))  # no naive round to pair
    rows.append(dict(timed_row("sdpa", 2, 0.0), status="failed", times_ms=[1.0] * 8))
    paired = paired_savings(rows)
    assert set(paired) == {"inplace", "sdpa+compile"}  # each against its own naive
    for n in (1, 2):
        assert paired["inplace"][n]["median"] == pytest.approx(0.5 * n)
        assert paired["inplace"][n]["interval"] == pytest.approx((0.5 * n, 0.5 * n))
        assert paired["sdpa+compile"][n]["median"] == pytest.approx(2 * n)
        assert paired["inplace"][n]["n"] == 8
    table = "\n".join(paired_table(rows))
    assert "| inplace | +0.50 [+0.50, +0.50] | +1.00 [+1.00, +1.00] |" in table
    for row in rows:  # a saving of -0.001 ms is shown as none, not as -0.00
        if row["variant"] == "inplace" and row["times_ms"]:
            row["times_ms"] = [t + 0.001 for t in rows[0]["times_ms"]]
            break
    assert "| inplace | +0.00 [+0.00, +0.00] |" in "\n".join(paired_table(rows))
    # Savings that differ by round: their median, then the interval low to high (8 rounds:
    # the extremes)
    naive_l1 = next(
        r for r in rows if (r["variant"], r["compile"], r["n_layer"]) == ("naive", False, 1)
    )
    inplace_l1 = next(r for r in rows if (r["variant"], r["n_layer"]) == ("inplace", 1))
    inplace_l1["times_ms"] = [
        t - d
        for t, d in zip(naive_l1["times_ms"], [0.8, 0.1, 0.5, 0.3, 0.2, 0.7, 0.4, 0.6], strict=True)
    ]
    assert "| inplace | +0.45 [+0.10, +0.80] |" in "\n".join(paired_table(rows))


@pytest.mark.parametrize(
    ("cells", "steps", "whole"), [(3, 9, False), (3, 12, True), (4, 8, True), (2, 5, False)]
)
def test_the_report_says_when_the_rounds_are_not_whole_sets_of_orders(
    cells: int, steps: int, whole: bool
) -> None:
    """3 cells take 6 orders to balance (a Williams design for an odd count), 4 cells 4, 2 two."""
    from profiling.method import METHOD, balanced_orders, round_order_text

    assert len(balanced_orders(cells)) == {2: 2, 3: 6, 4: 4}[cells]
    meta = {**METHOD, "round_cells": {"1": cells}, "steps": steps}
    said = f"here {steps} rounds of {cells} cells: not a whole number of the"
    assert (said in round_order_text(meta, [])) != whole


def test_the_report_says_how_a_depth_of_two_cells_ran() -> None:
    """Sweeps before the crossover alternated two cells: their reports still say so, and a
    depth of two among depths of more is named, as its cells follow themselves."""
    from profiling.method import METHOD, round_order_text

    old = {"round_order": METHOD["round_order"], "round_cells": {"1": 2}, "steps": 5}
    assert round_order_text(old, []) == "the two cells alternating (A B A B …)"
    mixed = {**METHOD, "round_cells": {"1": 3, "8": 2}, "steps": 6}
    text = round_order_text(mixed, [])
    assert "Latin square" in text and "at a depth of two cells: A B and B A in turn" in text
    assert "not a whole number" not in text
    mixed_old = {**old, "round_cells": {"1": 3, "8": 2}, "steps": 6}
    assert "at a depth of two cells: alternating" in round_order_text(mixed_old, [])


def test_a_cell_whose_steps_varied_widely_is_marked() -> None:
    """p90 over 1.25 x p10: the spread between its fast and slow steps, whatever the median."""
    from profiling.tables import noisy

    assert noisy({"p10": 10.0, "median": 11.0, "p90": 13.0})  # 13 > 12.5
    assert not noisy({"p10": 10.0, "median": 12.0, "p90": 12.4})


def test_fits_recover_known_slopes() -> None:
    fit = fit_line([1, 2, 4, 8], [3 + 2 * x for x in (1, 2, 4, 8)])
    assert fit["slope"] == pytest.approx(2) and fit["intercept"] == pytest.approx(3)
    assert fit["r2"] == pytest.approx(1) and fit["slope_se"] == pytest.approx(0, abs=1e-12)
    # An exact line whose floats leave rounding in the residuals has no error to report: the
    # report would print it as 1e-16, not 0.
    assert fit_line([1, 2, 4, 8], [0.1 + 0.7 * x for x in (1, 2, 4, 8)])["slope_se"] == 0
    xs, ys = [1, 2, 3, 4], [1.1, 1.9, 3.2, 3.8]
    noisy = fit_line(xs, ys)
    slope, intercept = statistics.linear_regression(xs, ys)
    (_, cov) = np.polyfit(xs, ys, 1, cov=True)  # scaled by the residual variance, n - 2 dof
    assert noisy["slope"] == pytest.approx(slope) and noisy["intercept"] == pytest.approx(intercept)
    assert noisy["r2"] == pytest.approx(statistics.correlation(xs, ys) ** 2)
    assert noisy["slope_se"] == pytest.approx(math.sqrt(cov[0, 0]))
    assert fit_line([1, 2], [1, 2])["slope_se"] is None  # two points: no error estimate, not NaN
    assert fit_line([4, 4], [1, 2]) is None

    rows = [timed_row("naive", n, 10 + 5 * n) for n in (1, 2, 4)] + [
        timed_row("sdpa", n, 10 + 3 * n) for n in (1, 2, 4)
    ]
    fits = fits_by_label(rows)
    assert fits["sdpa"]["step_ms"]["slope"] == pytest.approx(3)
    saved = savings(rows)["sdpa"]
    assert saved["per_layer"] == pytest.approx(2)
    assert saved["projected"]["48"]["saving"] == pytest.approx(96)
    assert saved["projected"]["12"]["percent"] == pytest.approx(100 * 24 / 70)

    # A disturbance at one depth that hit both variants (they are timed interleaved) leaves
    # each fit noisy but cancels in their difference: the saving's error is the paired one.
    bump = {1: 0.0, 2: 4.0, 4: 0.0, 8: -1.0}
    rows = [timed_row("naive", n, 10 + 5 * n + bump[n]) for n in bump] + [
        timed_row("sdpa", n, 10 + 3 * n + bump[n]) for n in bump
    ]
    fits, saved = fits_by_label(rows), savings(rows)["sdpa"]
    assert fits["naive"]["step_ms"]["slope_se"] > 0.3 and fits["sdpa"]["step_ms"]["slope_se"] > 0.3
    assert saved["per_layer"] == pytest.approx(2)
    assert saved["per_layer_se"] == pytest.approx(0, abs=1e-9)
    # A step's cost bends a little with depth; a variant that lacks a depth (a sweep stopped
    # part-way, a failed cell) is compared over the depths both have, not slope against slope
    # over different ranges.
    bent = [
        timed_row(v, n, 10 + k * n + 0.2 * n * n)
        for v, k in (("naive", 5), ("sdpa", 3))
        for n in (1, 2, 4, 8)
    ]
    saved = savings(bent[:-1])["sdpa"]
    assert saved["depths"] == [1, 2, 4]
    assert saved["per_layer"] == pytest.approx(2) and saved["per_layer_se"] == pytest.approx(0)
    assert saved["projected"]["48"]["saving"] == pytest.approx(96)
    assert "sdpa" not in savings(bent[:2] + bent[4:5])  # one depth in common: no saving

    # Compiled variants are compared with compiled naive, like against like.
    rows = [timed_row(v, n, 10 + k * n, c) for v, k, c in VARIANTS_SLOPES for n in (1, 2, 4)]
    saved = savings(rows)
    assert saved["sdpa"]["per_layer"] == pytest.approx(2)  # 5 - 3
    assert saved["sdpa+compile"]["per_layer"] == pytest.approx(1)  # 4 - 3, not 5 - 3
    assert "naive+compile" not in saved
    no_compiled_naive = [r for r in rows if r["variant"] != "naive" or not r["compile"]]
    assert "sdpa+compile" not in savings(no_compiled_naive), "never against eager naive"


def test_the_tables_notes_say_only_what_the_sweep_has() -> None:
    """The like-against-like note needs a compiled naive and another compiled variant; the
    summary's paired line names compiled naive where it pairs compiled rows; one depth has no
    fit for a noisy cell to make less certain."""
    rows = [timed_row(v, n, 10 + k * n, c) for v, k, c in VARIANTS_SLOPES for n in (1, 2, 4)]
    for r in rows:
        r["times_ms"] = [r["step_ms"]["median"]] * 6
    like = "`+compile` rows are compared with `naive+compile`, like against like."
    assert like in headline_table({"rows": rows, "fits": fits_by_label(rows)})
    (paired,) = [line for line in paired_deepest(rows) if "paired by round" in line]
    assert paired.startswith("Saving per step at L4 against naive (+compile rows: naive+compile)")
    eager = [r for r in rows if not r["compile"]]
    assert "+compile" not in "\n".join(paired_deepest(eager))
    alone = [r for r in rows if r["variant"] == "sdpa"]  # no naive: nothing set against it
    table = headline_table({"rows": alone, "fits": fits_by_label(alone)})
    assert like not in table
    assert "No `naive` cell measured here: the savings are against it, so they read –." in table
    assert not any("No `naive`" in line for line in headline_table({"rows": rows, "fits": {}}))
    one = [timed_row("naive", 2, 10.0), timed_row("sdpa", 2, 8.0)]
    one[0]["step_ms"]["p90"] = 30.0  # noisy
    text = "\n".join(headline_table({"rows": one, "fits": fits_by_label(one)}))
    assert "their medians are less certain" in text and "fits through them" not in text


def test_a_report_of_one_depth_or_without_naive_speaks_of_no_fit_or_op_diff(
    naive_vs_inplace: dict, tmp_path: Path
) -> None:
    """One depth has no fits (said so, not an empty table) and no slope to read; without naive
    there are no findings for the last section to point to."""
    from profiling.report import write_report

    one = {**naive_vs_inplace, "rows": [r for r in naive_vs_inplace["rows"] if r["n_layer"] == 2]}
    one["fits"] = fits_by_label(one["rows"])
    write_report(tmp_path, one, plots=False)
    report = (tmp_path / "report.md").read_text()
    assert "## Fits: metric = intercept + slope × n_layer\n\n(none: a fit needs two" in report
    assert "The slope column" not in report and "the findings above say" in report
    rows = [r for r in naive_vs_inplace["rows"] if r["variant"] != "naive"]
    write_report(tmp_path, {**naive_vs_inplace, "rows": rows, "fits": fits_by_label(rows)}, False)
    report = (tmp_path / "report.md").read_text()
    assert "The slope column" in report and "findings above" not in report


def test_a_flat_or_exact_series_fits_exactly() -> None:
    """Rounding must not make r^2 of an exact or flat line a hair below 0 or above 1."""
    for ys in ([0.1, 0.1, 0.1], [0.1 + 0.2 * n for n in (1, 2, 4)], [7.0, 7.0, 7.0]):
        fit = fit_line([1, 2, 4], ys)
        assert fit["r2"] == 1.0 and fit["slope_se"] == 0.0, (ys, fit)
    assert 0.0 <= fit_line([1, 2, 4], [1.0, 3.0, 1.0])["r2"] < 1.0


def test_projected_savings_carry_their_standard_error() -> None:
    """The saving at 12/24/48 layers comes with the se of the fitted difference line there,
    s^2 [1 L] (X'X)^-1 [1 L]'; with two depths there is none, and the report says so."""
    from profiling.tables import projected

    depths, noise = [1, 2, 4, 8], [0.3, -0.5, 0.1, 0.2]
    rows = [timed_row("naive", n, 10 + 5 * n) for n in depths] + [
        timed_row("sdpa", n, 10 + 3 * n + e) for n, e in zip(depths, noise, strict=True)
    ]
    diffs = torch.tensor(
        [2.0 * n - e for n, e in zip(depths, noise, strict=True)], dtype=torch.float64
    )
    X = torch.tensor([[1.0, n] for n in depths], dtype=torch.float64)
    coef = torch.linalg.solve(X.T @ X, X.T @ diffs)
    s2 = ((diffs - X @ coef) ** 2).sum() / (len(depths) - 2)
    saved = savings(rows)["sdpa"]
    for layers in (12, 24, 48):
        x = torch.tensor([1.0, layers], dtype=torch.float64)
        expected = torch.sqrt(s2 * x @ torch.linalg.solve(X.T @ X, x)).item()
        p = saved["projected"][str(layers)]
        assert p["saving"] == pytest.approx((x @ coef).item())
        assert p["saving_se"] == pytest.approx(expected)
        assert p["percent_se"] == pytest.approx(100 * expected / (10 + 5 * layers))
    assert "±" in projected(saved["projected"]["48"])

    # Naive noisy too: the percent's se, by the delta method, takes its projected time's
    # variance and its covariance with the saving's, both lines fitted to the same depths.
    ref_ms = [10 + 5 * n + e / 2 for n, e in zip(depths, noise[::-1], strict=True)]
    sdpa_ms = [10 + 3 * n + e for n, e in zip(depths, noise, strict=True)]
    rows = [timed_row("naive", n, t) for n, t in zip(depths, ref_ms, strict=True)]
    rows += [timed_row("sdpa", n, t) for n, t in zip(depths, sdpa_ms, strict=True)]
    ref_ms, sdpa_ms = torch.tensor(ref_ms).double(), torch.tensor(sdpa_ms).double()
    hat = torch.linalg.solve(X.T @ X, X.T)
    residuals = torch.stack([ref_ms - sdpa_ms, ref_ms]) @ (torch.eye(4).double() - X @ hat).T
    cov = residuals @ residuals.T / (len(depths) - 2)  # of (saving, naive) per depth
    for layers in (12, 48):
        x = torch.tensor([1.0, layers], dtype=torch.float64)
        w2 = x @ torch.linalg.solve(X.T @ X, x)
        saving, ref = (x @ hat @ (ref_ms - sdpa_ms)).item(), (x @ hat @ ref_ms).item()
        gradient = torch.tensor([1 / ref, -saving / ref**2], dtype=torch.float64)  # of S/R
        expected = 100 * torch.sqrt(w2 * gradient @ cov @ gradient).item()
        p = savings(rows)["sdpa"]["projected"][str(layers)]
        assert p["percent"] == pytest.approx(100 * saving / ref)
        assert p["percent_se"] == pytest.approx(expected)
        assert p["percent_se"] != pytest.approx(100 * p["saving_se"] / ref, rel=1e-3)

    two = [r for r in rows if r["n_layer"] in (1, 2)]
    p = savings(two)["sdpa"]["projected"]["48"]
    assert p["saving_se"] is None and p["percent_se"] is None
    assert projected(p).endswith("2 depths: no se")


def test_the_headline_gives_the_saving_measured_at_the_deepest_depth() -> None:
    """Not a projection: naive's median less the variant's, where both measured deepest."""
    rows = [timed_row("naive", n, 10 + 5 * n) for n in (1, 2, 4, 8)]
    rows += [timed_row("sdpa", n, 10 + 3 * n) for n in (1, 2, 4, 8)]
    head, _, naive, sdpa = headline_table({"rows": rows, "fits": fits_by_label(rows)})[:4]
    column = head.split(" | ").index("saving @L8, measured")
    assert naive.split(" | ")[column] == "–"
    assert sdpa.split(" | ")[column] == "+16.0 ms (+32%)"  # 50 against 34 ms
    rows[-1] = {**rows[-1], "status": "oom", "step_ms": None}  # sdpa at 8 layers
    sdpa = headline_table({"rows": rows, "fits": fits_by_label(rows)})[3]
    assert sdpa.split(" | ")[column] == "+8.0 ms (+27%) @L4"
    # Timed, then failed in its profiled steps: its time shows, marked, as the fits skip it
    rows[-1] = {**timed_row("sdpa", 8, 34.0), "status": "failed"}
    table = headline_table({"rows": rows, "fits": fits_by_label(rows)})
    assert table[3].split(" | ")[4] == "34.0 (failed)"
    assert table[3].split(" | ")[column] == "+8.0 ms (+27%) @L4"
    assert "A time marked (failed) was measured before its cell stopped" in "\n".join(table)
    # sdpa's line over three depths, naive's over four: each with its own multiplier
    note = next(line for line in table if line.startswith("± is one standard error"))
    assert note.endswith("over 4 depths, ± 4.3 se; over 3 depths, ± 12.7 se.")
    rows[-1] = timed_row("sdpa", 8, 34.0)
    whole = "\n".join(headline_table({"rows": rows, "fits": fits_by_label(rows)}))
    assert "fitted over 4 depths: 2 degrees of freedom, so a 95% interval is ± 4.3 se." in whole


def test_what_compiling_buys_pairs_each_variant_with_its_eager_self() -> None:
    """Eager over compiled median at each depth both timed, and the steps whose savings pay
    for the compile; a variant compiled only, or a failed cell, has no line."""
    from profiling.tables import compile_gain

    rows = [
        timed_row("naive", 1, 20.0),
        timed_row("naive", 1, 16.0, compiled=True) | {"compile_s": 6.0},
        timed_row("sdpa", 1, 15.0),
        timed_row("sdpa", 1, 15.5, compiled=True) | {"compile_s": 3.0},
        timed_row("flex", 1, 18.0, compiled=True) | {"compile_s": 8.0},  # no eager twin
        timed_row("naive", 4, 80.0),
        timed_row("naive", 4, 40.0, compiled=True) | {"compile_s": 0.3, "compile_cache": "cached"},
        timed_row("sdpa", 4, 50.0) | {"status": "oom", "step_ms": None},
        timed_row("sdpa", 4, 45.0, compiled=True) | {"compile_s": 0.2},
    ]
    table = compile_gain(rows)
    assert table[2] == "| naive | 1 | 20.0 | 16.0 | 1.25× | 6.0 | 1,500 |"
    assert table[3] == "| naive | 4 | 80.0 | 40.0 | 2.00× | 0.3 (cached) | 8 |"
    assert table[4] == "| sdpa | 1 | 15.0 | 15.5 | 0.97× | 3.0 | never (no faster) |"
    assert not any(line.startswith(("| flex", "| sdpa | 4")) for line in table)
    assert table[-1].endswith("a cold compile takes longer, as in the cells without the mark.")
    assert compile_gain([r for r in rows if not r["compile"]]) == []


def test_a_standard_error_below_the_shown_precision_does_not_read_as_exact() -> None:
    from profiling.tables import _pm, projected

    assert _pm(8.22, 0.004) == "8.22 ± <0.01"
    assert _pm(8.22, 0.006) == "8.22 ± 0.01"
    assert _pm(3.0, 0.0) == "3.00 ± 0"  # an exact fit, as op counts have
    p = {"saving": 280.2, "saving_se": 0.04, "percent": 67.0, "percent_se": 0.01}
    assert projected(p) == "+280.2 ± <0.1 ms (+67.0 ± <0.1%)"


def test_a_projection_through_a_line_below_zero_is_not_a_saving() -> None:
    """Noisy fits over few depths can cross zero before 48 layers: no percentage of that."""
    from profiling.tables import projected

    rows = [timed_row("naive", n, 25 + 5 * n) for n in (1, 2, 4)] + [
        timed_row("sdpa", n, t) for n, t in ((1, 20.0), (2, 19.0), (4, 18.0))
    ]
    by_depth = savings(rows)["sdpa"]["projected"]
    assert by_depth["12"]["saving"] is not None  # naive's line is still above zero there
    p = by_depth["48"]  # sdpa's line: 20.5 - 0.64 n, below zero
    assert p["saving"] is None and p["percent"] is None
    assert p["why_none"].startswith("sdpa's fitted step_ms is -")
    assert projected(p).startswith("n/a: sdpa's fitted step_ms")


def test_causal_mfu_is_called_a_convention() -> None:
    """The causal-half MFU is a counting convention, not the work a causal kernel does."""
    from profiling.method import causal_note

    row = {
        "variant": "sdpa",
        "compile": False,
        "n_layer": 8,
        "status": "ok",
        "mfu": 0.45,
        "flops_per_step": 100,
        "attention_flops_per_step": 20,
    }
    note = causal_note([row])
    assert "would read 40.5% MFU instead of 45.0%" in note
    assert "convention" in note and "block sizes" in note and "about half" not in note


def test_bad_arguments_name_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc, _ = sweep(tmp_path, "--variants", "naive,flash9")
    assert rc == 2 and "flash9" in capsys.readouterr().err
    rc, _ = sweep(tmp_path, "--layers", "0,2")
    assert rc == 2 and "--layers" in capsys.readouterr().err
    rc, _ = sweep(tmp_path, "--model.n_heads=3")
    assert rc == 2 and "model.n_heads" in capsys.readouterr().err
    # Only variants that cannot run here: refused at once, with each one's reason.
    rc, _ = sweep(tmp_path, "--variants", "flex,sdpa-cudnn")
    err = capsys.readouterr().err
    assert rc == 2 and "--variants: none can run on cpu (float32)" in err
    assert "flex: PyTorch has no flex_attention backward" in err and "sdpa-cudnn: " in err
    bad = [
        ("--layers", "1,a"),
        ("--trace-layers", "1,x"),
        ("--trace-layers", "4"),  # not among --layers
        ("--steps", "0"),
        ("--peak-seconds", "nan"),
        ("--variants", ""),
        ("--variants", "naive,,sdpa"),
        ("--layers", "1,2,"),
        ("--diff", "inplace,naive"),  # needs --report
        ("--model.n_layer=3", None),  # the sweep sets n_layer itself
        ("--train.compile=true", None),  # --compile decides, per cell
        ("--data.name=stdlib", None),  # --data decides
        ("--data", "../data/tiny"),  # a path: outside data.root
        ("--data=", None),
    ]
    for flag, value in bad:
        rc, _ = sweep(tmp_path, "--layers", "1", flag, *([value] if value is not None else []))
        err = capsys.readouterr().err
        assert rc == 2 and flag.split("=")[0].split(".")[-1] in err, err
        assert "Traceback" not in err, err
    rc, _ = sweep(tmp_path, "--layers", "1,2", "--trace-layers", "2,4")
    assert "--trace-layers=2,4: 4 not among --layers=1,2" in capsys.readouterr().err
    for given in (["--trace-layers", "1"], ["--trace-stacks"]):
        rc, _ = sweep(tmp_path, "--layers", "1", "--no-traces", *given)
        err = capsys.readouterr().err
        assert rc == 2 and f"{given[0]} with --no-traces: no trace is written" in err, err
    rc, _ = sweep(tmp_path, "--layers", "1", "--data.name=stdlib")
    assert "--data synthetic or --data NAME" in capsys.readouterr().err
    assert not (tmp_path / "sweep").exists(), "bad input wrote nothing"
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "notes.txt").write_text("mine")
    rc, _ = sweep(tmp_path)
    assert rc == 2 and "not an empty folder" in capsys.readouterr().err


def test_compile_follows_the_config_unless_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A config that trains compiled (gpt2-small.toml) is profiled compiled; --compile wins, and
    what results.json records of the config is what the cells ran."""
    seen = []

    def run(self, variants, layers, compile_modes):
        seen.append((compile_modes, self.config.train.compile, self.meta["compile"]))
        self.out.mkdir()
        (self.out / "summary.txt").write_text("")
        self.rows.append({"status": "ok"})  # a cell measured: exit 0

    monkeypatch.setattr(profile_train.Sweep, "run", run)
    config = tmp_path / "compiled.toml"
    text = (ROOT / "configs" / "profile.toml").read_text()
    config.write_text(text.replace("[train]\n", "[train]\ncompile = true\n"))
    base = ["--config", str(config), "--variants", "naive", "--layers", "1", *TINY]
    for extra, out in [([], "a"), (["--compile", "off"], "b"), (["--compile", "both"], "c")]:
        assert profile_train.main([*base, *extra, "--out", str(tmp_path / out)]) == 0
        said = "compiled cells only, as " in capsys.readouterr().err
        assert said == (not extra), extra
    default = ["--variants", "naive", "--layers", "1", *TINY, "--out", str(tmp_path / "d")]
    assert profile_train.main(["--config", str(ROOT / "configs" / "profile.toml"), *default]) == 0
    assert seen == [
        ([True], True, "on"),
        ([False], False, "off"),
        ([False, True], True, "both"),
        ([False], False, "off"),
    ]


def test_bad_arguments_leave_no_default_output_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    config = str(ROOT / "configs" / "profile.toml")
    assert profile_train.main(["--config", config, "--layers", "0"]) == 2
    assert not (tmp_path / "profiles").exists()
    quick = ["--variants", "naive", "--layers", "1", "--steps", "1", "--warmup", "1", *TINY]
    assert profile_train.main(["--config", config, *quick, "--peak-seconds", "0.02"]) == 0
    assert (tmp_path / "profiles" / "profile" / "latest" / "results.json").is_file()
    # A `latest` that is not the tool's link (a file put there) is kept, and said so
    latest = tmp_path / "profiles" / "profile" / "latest"
    latest.unlink()
    latest.write_text("mine")
    capsys.readouterr()
    assert profile_train.main(["--config", config, *quick, "--peak-seconds", "0.02"]) == 0
    assert latest.read_text() == "mine"
    assert "warning: profiles/profile/latest is not a link" in capsys.readouterr().err


def test_sweeps_started_in_the_same_second_get_folders_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    config, now = Path("configs/profile.toml"), dt.datetime(2026, 11, 30, 12, 0, 0)
    first = profile_train._default_out(config, now)
    assert first == Path("profiles/profile/20261130-120000")
    first.mkdir(parents=True)
    assert profile_train._default_out(config, now) == first.with_name("20261130-120000-2")
    # Both chose the name before either made it: the second to make it stops, and writes nothing.
    monkeypatch.setattr(profile_train, "_default_out", lambda *args: first)
    argv = ["--config", str(ROOT / config), "--variants", "naive", "--layers", "1", *TINY]
    assert profile_train.main(argv) == 2
    assert "taken by another sweep started at the same time" in capsys.readouterr().err
    assert not any(first.iterdir())


def test_earlier_sweep_is_not_overwritten(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert sweep(tmp_path, "--variants", "naive", "--layers", "1", "--no-traces")[0] == 0
    before = (tmp_path / "sweep" / "results.json").read_bytes()
    rc, _ = sweep(tmp_path, "--variants", "inplace", "--layers", "1")
    assert rc == 2 and "earlier sweep" in capsys.readouterr().err
    assert (tmp_path / "sweep" / "results.json").read_bytes() == before


def test_a_gpu_report_says_its_step_times_are_serialised(naive_vs_inplace: dict) -> None:
    """Synchronising around each step takes away the launch overlap train.py's loop has."""
    from profiling.report import _report_md

    assert "cannot overlap" not in _report_md(naive_vs_inplace)
    on_gpu = {**naive_vs_inplace, "meta": {**naive_vs_inplace["meta"], "device": "cuda:0"}}
    assert "next step's launches cannot overlap this one's tail" in _report_md(on_gpu)


PUBLISHED = sorted(
    p.parent.relative_to(ROOT) for p in (ROOT / "docs" / "results").rglob("results.json")
)


@pytest.mark.parametrize("folder", PUBLISHED, ids=str)
def test_published_reports_are_what_the_report_code_writes(folder: Path, tmp_path: Path) -> None:
    """The README quotes the reports in docs/results: when the report's text changes, they
    are re-rendered from their results.json, so they say what the code now says."""
    copy = tmp_path / "copy"
    shutil.copytree(ROOT / folder, copy)
    assert profile_train.main(["--report", str(copy)]) == 0
    for name in ("report.md", "summary.txt", "results.csv"):
        assert (copy / name).read_text() == (ROOT / folder / name).read_text(), (
            f"{folder / name} is stale: python profile_train.py --report {folder}"
        )
    # The record of what was measured stays as it was: re-rendering leaves git's tree clean.
    assert (copy / "results.json").read_bytes() == (ROOT / folder / "results.json").read_bytes()


def rows_of(results: dict, variant: str, n_layer: int) -> dict:
    return next(
        r
        for r in results["rows"]
        if (r["variant"], r["n_layer"]) == (variant, n_layer) and not r["compile"]
    )


def test_a_stderr_that_fails_costs_its_lines_not_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`profile_train.py 2>/dev/full`: the progress bar and notes are lost, the sweep is not.
    (A failed write there used to stop the sweep as a full disk for its results does, and
    its error line then failed too: status 1, nothing written.)"""
    monkeypatch.setattr(sys, "stderr", FullDisk())
    rc, results = sweep(tmp_path, "--variants", "naive", "--layers", "1", "--no-traces")
    assert rc == 0 and [r["status"] for r in results["rows"]] == ["ok"]
    assert "report: " in capsys.readouterr().out


def test_a_report_piped_into_a_reader_that_has_gone_ends_quietly(tmp_path: Path) -> None:
    """`profile_train.py --report DIR | head -0`: the report is written, then printing to the
    closed pipe ends with the shell's status for SIGPIPE (128 + 13), no traceback or error."""
    copy = Path(shutil.copytree(ROOT / "docs/results/cpu-2core", tmp_path / "sweep"))
    argv = [sys.executable, str(ROOT / "profile_train.py"), "--report", str(copy)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # the reader is gone before anything is printed
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 128 + signal.SIGPIPE, err
    assert err == "", err
    assert (copy / "report.md").read_bytes() == (
        ROOT / "docs/results/cpu-2core/report.md"
    ).read_bytes()


def test_report_rerender_and_diff(
    naive_vs_inplace: dict, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = naive_vs_inplace["meta"]["out"]
    assert profile_train.main(["--report", out, "--diff", "inplace,naive"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed.index("    1 aten::clone fewer") > printed.index("  forward:")
    assert profile_train.main(["--report", out]) == 0
    capsys.readouterr()
    # The round-by-round savings, from each row's times_ms; 2 rounds: no interval.
    paired = (Path(out) / "report.md").read_text().split("paired by round")[1]
    saving = statistics.median(
        n - i
        for n, i in zip(
            *(rows_of(naive_vs_inplace, v, 3)["times_ms"] for v in ("naive", "inplace")),
            strict=True,
        )
    )
    shown = f"{round(saving, 2) or 0.0:+.2f}"  # +0.00 for a saving that rounds to nothing
    assert "| inplace | " in paired and f"{shown} (n=2) |" in paired
    # What make profile prints: the deepest depth's
    summary = (Path(out) / "summary.txt").read_text()
    assert "Saving per step at L3 against naive, paired by round" in summary
    assert f"  inplace: {shown} (n=2)\n" in summary
    # A label that was not measured is an error naming the valid ones, not "the same counts".
    assert profile_train.main(["--report", out, "--diff", "inplcae,naive"]) == 2
    err = capsys.readouterr().err
    assert "inplcae" in err and "naive, inplace" in err
    assert profile_train.main(["--report", out, "--diff", "naive"]) == 2
    assert profile_train.main(["--report", out, "--diff", ""]) == 2  # not a silent re-render
    # What a re-render cannot do is refused, not ignored: it would print all variants as measured.
    capsys.readouterr()
    assert profile_train.main(["--report", out, "--variants", "inplace", "--model.n_embd=64"]) == 2
    err = capsys.readouterr().err
    assert "only --diff, not --variants --model.n_embd=64" in err
    assert profile_train.main(["--report", out, "--no-traces"]) == 2
    assert "not --no-traces" in capsys.readouterr().err  # the flag as typed, not its dest
    # A folder the report cannot be written to: an error saying so, not a traceback.
    monkeypatch.setattr(
        profile_train, "render_results", Mock(side_effect=PermissionError(13, "Permission denied"))
    )
    assert profile_train.main(["--report", out]) == 2
    assert "cannot write the report there (Permission denied)" in capsys.readouterr().err


def test_report_says_what_the_timed_step_does(naive_vs_inplace: dict, tmp_path: Path) -> None:
    """The report's method names clipping and weight decay as the sweep's config had them."""
    results = copy.deepcopy(naive_vs_inplace)
    step_line = (
        "- **Step**: `step.train_step`, the step train.py runs, imported: forward, backward, "
    )
    for clip, decay, said in [
        (1.0, 0.1, "gradient clipping (norm 1) and a fused AdamW step over"),
        (0.0, 0.1, "backward, a fused AdamW step over"),
        (0.5, 0.0, "gradient clipping (norm 0.5) and a fused AdamW step without weight decay"),
    ]:
        results["meta"]["config"]["train"].update(grad_clip=clip, weight_decay=decay)
        (tmp_path / "results.json").write_text(json.dumps(results))
        assert profile_train.main(["--report", str(tmp_path)]) == 0
        line = next(
            x for x in (tmp_path / "report.md").read_text().splitlines() if x.startswith(step_line)
        )
        assert said in line and ("clipping" in line) == (clip > 0)


def test_compare_names_a_gpus_peak_in_tflops(
    naive_vs_inplace: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A GPU's matmul peak reads in TFLOP/s in --compare, as in the report; in the listing
    and in the refusal of two machines of different speed."""
    folders = []
    for i, peak in enumerate([7.0e14, 7.1e14]):
        results = copy.deepcopy(naive_vs_inplace)
        results["meta"].update(peak_flops=peak, peak_flops_end=peak)
        results["meta"]["other_cpu_share"] = 0.0  # not the load the fixture's sweep met here
        results["meta"]["started_at"] = f"2026-11-30T1{i}:00:00+00:00"
        folders.append(tmp_path / f"s{i}")
        folders[-1].mkdir()
        (folders[-1] / "results.json").write_text(json.dumps(results))
    assert profile_train.main(["--compare", *map(str, folders)]) == 0
    printed = capsys.readouterr().out
    assert ", matmul peak 700.0 TFLOP/s" in printed and "GFLOP/s" not in printed
    results["meta"].update(peak_flops=3.5e14)
    (folders[-1] / "results.json").write_text(json.dumps(results))
    assert profile_train.main(["--compare", *map(str, folders)]) == 2
    err = capsys.readouterr().err
    assert "differ in matmul peak" in err and "350.0 TFLOP/s" in err
    results["meta"].update(peak_flops=9.5e12, peak_flops_end=9.5e12)  # beside 700 TFLOP/s
    (folders[-1] / "results.json").write_text(json.dumps(results))
    assert profile_train.main(["--compare", *map(str, folders)]) == 2
    err = capsys.readouterr().err
    assert "9.5 TFLOP/s" in err and "GFLOP/s" not in err


def test_compare_reads_the_savings_of_several_sweeps(
    naive_vs_inplace: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Four sweeps whose inplace saves 1, 2, 3 and 4 ms a layer: each column, then the median,
    numpy's quartiles and the range across them, of each label's cost per layer and of its
    saving; a setup that differs is refused by name."""
    folders = []
    for i, per_layer in enumerate([1.0, 4.0, 2.0, 3.0]):
        results = copy.deepcopy(naive_vs_inplace)
        results["meta"]["started_at"] = f"2026-11-30T1{i}:00:00+00:00"
        results["meta"]["other_cpu_share"] = 0.0  # not the load the fixture's sweep met here
        for r in results["rows"]:
            cost = {"naive": 10.0, "inplace": 10.0 - per_layer}.get(r["variant"], 9.0)
            r["step_ms"]["median"] = 5.0 + cost * r["n_layer"] + (0.1 if r["n_layer"] == 2 else 0)
        folders.append(tmp_path / f"s{i}")
        folders[-1].mkdir()
        (folders[-1] / "results.json").write_text(json.dumps(results))
    assert profile_train.main(["--compare", *map(str, folders)]) == 0
    printed = capsys.readouterr().out
    step_times, costs, fitted, measured = printed.split("## ")[1:]
    # inplace at L2: 5 + (10 - s) * 2 + 0.1 with s = 1, 4, 2, 3: 23.1, 17.1, 21.1, 19.1
    assert "| inplace | 12.5 (11.0–14.0) | 20.1 (17.1–23.1) |" in step_times
    assert "| naive | 15.0 (15.0–15.0) | 25.1 (25.1–25.1) | 35.0 (35.0–35.0) |" in step_times
    # Cost per layer: naive's slope is 10 in every sweep, inplace's 10 - s; no sign, as a cost
    assert costs.startswith("Cost per layer, fitted (ms/layer ± se)")
    rows = {
        line.split("|")[1].strip(): line for line in costs.splitlines() if line.startswith("| ")
    }
    naive = [c.strip() for c in rows["naive"].strip("|").split("|")]
    assert all(c.startswith("10.00 ± ") for c in naive[1:5]) and naive[5:] == [
        "10.00",
        "10.00, 10.00",
        "10.00 to 10.00",
    ]
    cells = [c.strip() for c in rows["inplace"].strip("|").split("|")]
    assert [c.split(" ± ")[0] for c in cells[1:5]] == ["9.00", "6.00", "8.00", "7.00"]
    assert cells[5:] == ["7.50", "6.75, 8.25", "6.00 to 9.00"]
    inplace = next(line for line in fitted.splitlines() if line.startswith("| inplace |"))
    cells = [c.strip() for c in inplace.strip("|").split("|")]
    assert [c.split(" ± ")[0] for c in cells[1:5]] == ["+1.00", "+4.00", "+2.00", "+3.00"]
    assert all(" ± " in c for c in cells[1:5])  # three depths: each fit has its error
    assert cells[5:] == ["+2.50", "+1.75, +3.25", "+1.00 to +4.00"]
    assert np.percentile([1, 2, 3, 4], [25, 75]).tolist() == [1.75, 3.25]
    assert "n_layer=3, measured" in measured
    assert "| inplace | +3.00 | +12.00 | +6.00 | +9.00 | +7.50 |" in measured
    assert "| naive |" not in fitted + measured  # the reference saves nothing against itself
    assert "2026-11-30 10:00 UTC" in printed
    assert "§" not in printed
    # Other processes slowed the second sweep (its report warned): marked, not in the median
    busy = json.loads((folders[1] / "results.json").read_text())
    busy["meta"]["other_cpu_share"] = 0.28
    (folders[1] / "results.json").write_text(json.dumps(busy))
    assert profile_train.main(["--compare", *map(str, folders)]) == 0
    printed = capsys.readouterr().out
    assert f"`{folders[1]}`: " in printed and ", other processes 28% of the CPUs §" in printed
    inplace = next(line for line in printed.split("## ")[3].splitlines() if "| inplace |" in line)
    cells = [c.strip() for c in inplace.strip("|").split("|")]
    assert cells[2].startswith("+4.00 ± ") and cells[2].endswith(" §")
    assert cells[5:] == ["+2.00", "–", "+1.00 to +3.00"]  # the other three: 1, 2, 3
    inplace = next(line for line in printed.split("## ")[2].splitlines() if "| inplace |" in line)
    cells = [c.strip() for c in inplace.strip("|").split("|")]  # its cost: 6 marked, left out
    assert cells[2].startswith("6.00 ± ") and cells[2].endswith(" §")
    assert cells[5:] == ["8.00", "–", "7.00 to 9.00"]
    assert "§ Other processes used more than 10% of the CPUs" in printed
    # They slow the matmul peak too: a busy sweep's is not another machine's
    busy["meta"].update(peak_flops=busy["meta"]["peak_flops"] / 2)
    (folders[1] / "results.json").write_text(json.dumps(busy))
    assert profile_train.main(["--compare", *map(str, folders)]) == 0
    printed = capsys.readouterr().out
    inplace = next(line for line in printed.split("## ")[3].splitlines() if "| inplace |" in line)
    assert [c.strip() for c in inplace.strip("|").split("|")][5:] == [
        "+2.00",
        "–",
        "+1.00 to +3.00",
    ]
    # ...but not higher: a busy sweep twice as fast as the quiet ones is another machine
    busy["meta"].update(peak_flops=busy["meta"]["peak_flops"] * 4)
    (folders[1] / "results.json").write_text(json.dumps(busy))
    assert profile_train.main(["--compare", *map(str, folders)]) == 2
    assert "differ in matmul peak" in capsys.readouterr().err
    busy["meta"].update(other_cpu_share=0.02, peak_flops=busy["meta"]["peak_flops"] / 2)
    (folders[1] / "results.json").write_text(json.dumps(busy))
    # profiles/<config>/* takes `latest` too, a link to the newest sweep: counted once.
    # A sweep stopped before its first cell left a folder with no results.json: left out.
    (tmp_path / "latest").symlink_to(folders[-1].name)
    (tmp_path / "stopped").mkdir()
    also = [str(tmp_path / "latest"), str(tmp_path / "stopped"), str(folders[0])]
    assert profile_train.main(["--compare", *map(str, folders), *also]) == 0
    printed, err = capsys.readouterr()
    assert f"{tmp_path / 'latest'} is {folders[-1]}, counted once" in err
    assert f"{folders[0]} given twice, counted once" in err
    assert f"{tmp_path / 'stopped'} holds no results.json" in err
    assert printed.startswith("# 4 sweeps of one setup")

    # naive failed at n_layer=3 in the first: its inplace saving is fitted over L1,2 only,
    # another quantity, shown marked and left out of the median.
    first = json.loads((folders[0] / "results.json").read_text())
    for r in first["rows"]:
        if (r["variant"], r["n_layer"]) == ("naive", 3):
            r["status"] = "oom"
    (folders[0] / "results.json").write_text(json.dumps(first))
    assert profile_train.main(["--compare", *map(str, folders)]) == 0
    printed = capsys.readouterr().out
    assert "| inplace | +1.00 ‡ (L1,2) | +4.00 ± " in printed
    assert "| naive | 10.10 ‡ (L1,2) | 10.00 ± " in printed  # its cost, over those two as well
    assert "| +3.00 | – | +2.00 to +4.00 |" in printed and "‡ Fitted over fewer depths" in printed
    assert "| naive | 15.0 (15.0–15.0) | 25.1 (25.1–25.1) | 35.0 (35.0–35.0), 3 of 4 |" in printed

    for change, named in [
        (lambda m: m["config"]["model"].update(n_embd=256), "model"),
        (lambda m: m["config"]["train"].update(grad_accum=2), "micro-batches"),
        (lambda m: m.update(host_memory="release"), "host memory"),
        (lambda m: m.update(heap_reserve_bytes=1 << 30), "heap reserve"),
        (lambda m: m["config"]["train"].update(grad_clip=0.0), "the optimizer step"),
        (lambda m: m["config"]["train"].update(weight_decay=0.0), "the optimizer step"),
        (lambda m: m.update(data="stdlib"), "data"),
        # A VM of the same name with half the matmul peak: another machine
        (lambda m: m.update(peak_flops=m["peak_flops"] / 2), "matmul peak"),
    ]:
        changed = copy.deepcopy(results)
        change(changed["meta"])
        (folders[-1] / "results.json").write_text(json.dumps(changed))
        assert profile_train.main(["--compare", *map(str, folders)]) == 2
        err = capsys.readouterr().err
        assert f"differ in {named}" in err and str(folders[-1]) in err
    # Interrupted after two depths: compared where it measured, its saving fitted over those
    # two marked, and its deepest cells and the saving measured there left empty.
    cut = copy.deepcopy(results)
    planned = cut["meta"]["cells_planned"]
    cut["rows"] = [r for r in cut["rows"] if r["n_layer"] <= 2]
    (folders[-1] / "results.json").write_text(json.dumps(cut))
    assert profile_train.main(["--compare", *map(str, folders)]) == 0
    printed = capsys.readouterr().out
    assert f", stopped after {len(cut['rows'])} of {planned} cells" in printed
    # Stopped while profiling its deepest cells: those timed only do not make it whole.
    timed = copy.deepcopy(results)
    for r in timed["rows"]:
        if r["n_layer"] == 3:
            r["status"] = "interrupted"
    (folders[-1] / "results.json").write_text(json.dumps(timed))
    assert profile_train.main(["--compare", *map(str, folders)]) == 0
    done = sum(r["n_layer"] < 3 for r in timed["rows"])
    assert f", stopped after {done} of {planned} cells" in capsys.readouterr().out
    # Every sweep stopped so: compared at the depths they measured, 1 and 2
    saved = [(folder / "results.json").read_text() for folder in folders[:-1]]
    for i, folder in enumerate(folders[:-1]):
        again = copy.deepcopy(timed)
        again["meta"]["started_at"] = f"2026-12-01T0{i}:00:00+00:00"
        (folder / "results.json").write_text(json.dumps(again))
    assert profile_train.main(["--compare", *map(str, folders)]) == 0
    compared = capsys.readouterr().out
    assert "n_layer 1,2." in compared and "Saving at n_layer=2, measured" in compared
    for folder, text in zip(folders[:-1], saved, strict=True):
        (folder / "results.json").write_text(text)
    # naive at L3: failed in the first sweep (above), not reached in the last
    assert "| naive | 15.0 (15.0–15.0) | 25.1 (25.1–25.1) | 35.0 (35.0–35.0), 2 of 4 |" in printed
    assert "| +3.00 ‡ (L1,2) |" in printed and "(a cell failed, or the sweep stopped" in printed
    assert "| inplace | – | +12.00 | +6.00 | – |" in printed
    # A whole sweep of other depths is another setup; a stopped one is named as the likely cause.
    other = copy.deepcopy(results)
    other["rows"] += [dict(r, n_layer=4) for r in other["rows"] if r["n_layer"] == 1]
    other["meta"]["cells_planned"] = len(other["rows"])  # ran to the end, at 1, 2, 3 and 4
    (folders[-1] / "results.json").write_text(json.dumps(other))
    assert profile_train.main(["--compare", *map(str, folders)]) == 2
    err = capsys.readouterr().err
    assert "differ in n_layer" in err and "stopped before the end" not in err
    cut["rows"] = [r for r in other["rows"] if r["n_layer"] in (1, 4)]  # stopped, at 1 and 4
    cut["meta"]["cells_planned"] = len(other["rows"])
    (folders[-1] / "results.json").write_text(json.dumps(cut))
    assert profile_train.main(["--compare", *map(str, folders)]) == 2
    err = capsys.readouterr().err
    assert "differ in n_layer" in err
    assert f"stopped before the end: {folders[-1]}, {len(cut['rows'])} of " in err
    other_clip = copy.deepcopy(results)  # another clip norm is the same work
    other_clip["meta"]["config"]["train"]["grad_clip"] = 0.5
    (folders[-1] / "results.json").write_text(json.dumps(other_clip))
    assert profile_train.main(["--compare", *map(str, folders)]) == 0
    capsys.readouterr()

    # Sweeps of one depth: no line to fit, said so, not an empty table.
    for folder in folders[:2]:
        one = json.loads((folder / "results.json").read_text())
        one["rows"] = [r for r in one["rows"] if r["n_layer"] == 1]
        (folder / "results.json").write_text(json.dumps(one))
    assert profile_train.main(["--compare", *map(str, folders[:2])]) == 0
    printed = capsys.readouterr().out
    assert "(none: a fit needs two depths" in printed
    assert "Each sweep's ± is" not in printed, "no ± shown: none explained"
    for refused in (
        [str(folders[0])],  # one sweep has no spread
        [str(folders[0]), str(folders[0])],  # the same sweep twice
        [str(folders[0]), str(tmp_path)],  # no results.json
        [str(folders[0]), str(folders[1]), "--steps", "5"],  # a setting for a new sweep
    ):
        assert profile_train.main(["--compare", *refused]) == 2, refused
        assert "--compare" in capsys.readouterr().err
    # One edited by hand into what the comparison cannot read: that one is named
    edited = json.loads((folders[1] / "results.json").read_text())
    for edit in ("step_ms", "peak_flops"):  # read by the tables; by the check of the setups
        damaged = copy.deepcopy(edited)
        if edit == "step_ms":
            damaged["rows"][0]["step_ms"] = "fast"
        else:
            del damaged["meta"]["peak_flops"]
        (folders[1] / "results.json").write_text(json.dumps(damaged))
        assert profile_train.main(["--compare", *map(str, folders)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {folders[1] / 'results.json'}: "), err


def test_tf32_off_cuda_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, results = sweep(tmp_path, "--variants", "naive", "--layers", "1", "--train.dtype=tf32")
    assert rc == 2 and not results
    assert "train.dtype='tf32': TF32 tensor cores are a CUDA feature" in capsys.readouterr().err
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("linear", ["torch", "onednn"])
def test_meta_flop_count_equals_a_real_naive_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, linear: str
) -> None:
    """The count runs naive on the meta device only, and equals that of a real eager naive
    step on the CPU, the sweep's own cell (grad accumulation, clipping, AdamW, either Linear
    path), in total and in attention's part."""
    if linear == "onednn" and onednn_unavailable_reason() is not None:
        pytest.skip(onednn_unavailable_reason())
    ran_on: list[str] = []

    def recorded(q, k, v, mask, dropout_p):
        ran_on.append(q.device.type)
        return attention.naive(q, k, v, mask, dropout_p)

    monkeypatch.setitem(attention.VARIANTS, "naive", attention.Variant("naive", recorded, "rec"))
    config = ROOT / "configs" / "profile.toml"  # grad_clip = 1.0
    flags = [*TINY, "--train.grad_accum=2", f"--train.cpu_linear={linear}"]
    args, overrides = profile_train.parse_args(
        ["--config", str(config), "--out", str(tmp_path), *flags]
    )
    s = Sweep(load_config(args.config, overrides), profile_train.sweep_options(args))
    assert s.onednn == (linear == "onednn") and s.config.train.grad_accum == 2
    for n_layer in (1, 3):
        cell = Cell("naive", n_layer, False)
        s._build(cell)
        real = count_flops(cell.step)
        ran_on.clear()
        assert step_flops(s.config, n_layer) == (sum(real.values()), real["aten.bmm"])
        assert set(ran_on) == {"meta"}
        # Attention's T x T products: 12 B T^2 C per layer and micro-batch (B=2, T=32, C=32).
        assert real["aten.bmm"] == 2 * 12 * 2 * 32**2 * 32 * n_layer


def test_synthetic_batches_train_on_the_next_token(tmp_path: Path) -> None:
    """--data synthetic: random tokens, but each target is the next input token, as in a
    corpus's batches, with grad_accum micro-batches per step that differ."""
    flags = [*TINY, "--train.grad_accum=2"]
    args, overrides = profile_train.parse_args(
        ["--config", str(ROOT / "configs" / "profile.toml"), "--out", str(tmp_path), *flags]
    )
    s = Sweep(load_config(args.config, overrides), profile_train.sweep_options(args))
    assert all(len(step) == 2 for step in s.batches)
    (x, y), (x2, _) = s.batches[0]
    assert x.shape == y.shape == (2, 32) and not torch.equal(x, x2)
    assert torch.equal(x[:, 1:], y[:, :-1]) and not torch.equal(x, y)


def test_flops_do_not_need_naive_to_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, naive_vs_inplace: dict
) -> None:
    """Naive out of memory where another variant fits: that variant still gets its FLOPs and
    MFU, the same count as in a sweep where naive fits."""

    def too_big(q, k, v, mask, dropout_p):
        if q.size(0) > 1 and not q.is_meta:  # the availability probe (B=1) passes
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.15 GiB")
        return attention.naive(q, k, v, mask, dropout_p)

    monkeypatch.setitem(attention.VARIANTS, "naive", attention.Variant("naive", too_big, "big"))
    rc, results = sweep(tmp_path, "--variants", "naive,sdpa-math", "--layers", "1,2")
    assert rc == 0
    counted = {
        r["n_layer"]: (r["flops_per_step"], r["attention_flops_per_step"])
        for r in naive_vs_inplace["rows"]
        if r["variant"] == "sdpa-math"
    }
    rows = {(r["variant"], r["n_layer"]): r for r in results["rows"]}
    for n_layer in (1, 2):
        assert rows[("naive", n_layer)]["status"] == "oom"
        row = rows[("sdpa-math", n_layer)]
        assert row["status"] == "ok", row["reason"]
        assert (row["flops_per_step"], row["attention_flops_per_step"]) == counted[n_layer]
        assert 0 < row["mfu"] < 1
    assert results["meta"]["flop_count"] == "meta device"
    assert "on the meta device" in (tmp_path / "sweep" / "report.md").read_text()


@pytest.mark.cuda
def test_cuda_sweep_counts_kernels(tmp_path: Path) -> None:
    rc, results = sweep(
        tmp_path,
        "--variants",
        "naive,inplace,sdpa-flash",
        "--layers",
        "1,2",
        "--train.device=cuda",
        "--train.dtype=bfloat16",
    )
    assert rc == 0
    rows = {(r["variant"], r["n_layer"]): r for r in results["rows"]}
    for row in rows.values():
        assert row["status"] == "ok", row["reason"]
        # Every region launches kernels (the backward's from the autograd engine's own
        # thread), and every kernel is matched to the region of its launch.
        for region in ("forward", "backward", "optimizer"):
            assert sum(row["kernels_per_step"][region].values()) > 0, region
        assert not row["kernels_unattributed_per_step"], row["kernels_unattributed_per_step"]
        assert row["allocator_calls_per_step"] >= 0 and row["alloc_retries"] >= 0

    def forward_kernels(variant: str, n: int) -> float:
        return sum(rows[(variant, n)]["kernels_per_step"]["forward"].values())

    for n in (1, 2):  # the hidden copy is one more device copy per layer in the forward
        assert forward_kernels("naive", n) - forward_kernels("inplace", n) == n

    # Every eager kernel is launched inside an operator, which gives its category: naive's
    # matmuls, softmax and mask count as attention, and no GEMM is left unplaced.
    for (variant, _), row in rows.items():
        split = row["time_split"]
        assert set(split) == {"linear layers", "attention", "everything else"}, (variant, split)
        assert split["attention"] > 0 and split["linear layers"] > 0, (variant, split)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_every_op_of_a_training_step_is_in_a_region(grad_accum: int) -> None:
    """Ops and kernels are counted by region: work outside forward/backward/optimizer would be
    missing from the counts (and, on CUDA, reported as kernels with no region)."""
    from torch.profiler import profile

    from config import TrainConfig
    from model import GPT, GPTConfig
    from optim import build_optimizer
    from profiling.analysis import REGIONS
    from step import train_step

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    optimizer = build_optimizer(model, TrainConfig(), torch.device("cpu"))
    xy = torch.randint(64, (2, 17))
    micro = [(xy[:, :-1], xy[:, 1:])] * grad_accum
    with profile(acc_events=True) as prof:
        train_step(model, optimizer, micro, grad_clip=1.0)
    events = prof.profiler.kineto_results.events()
    regions = [(e.start_ns(), e.end_ns()) for e in events if e.name() in REGIONS]
    outside = [
        e.name()
        for e in events
        if e.name().startswith("aten::") and not any(a <= e.start_ns() <= b for a, b in regions)
    ]
    assert outside == []


def test_ops_autocast_wraps_count_once_per_call() -> None:
    """Autocast records an op it wraps twice, at its own dispatch key and again as it calls the
    op in the cast dtype: a bf16 step counts each call once, as the same fp32 step does."""
    from torch.profiler import profile

    from config import TrainConfig
    from model import GPT, GPTConfig
    from optim import build_optimizer
    from profiling.measure import parse_events
    from step import train_step

    def forward_ops(amp_dtype: torch.dtype | None) -> Counter:
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
        model = GPT(dataclasses.replace(config, attention="sdpa"))
        optimizer = build_optimizer(model, TrainConfig(), torch.device("cpu"))
        xy = torch.randint(64, (2, 17))
        with profile() as prof:
            train_step(model, optimizer, [(xy[:, :-1], xy[:, 1:])], 1.0, amp_dtype)
        events = prof.profiler.kineto_results.events()
        return parse_events(events, torch.device("cpu")).ops["forward"]

    fp32, bf16 = forward_ops(None), forward_ops(torch.bfloat16)
    # 4 linears a layer and the head; one attention call a layer, whatever the dtype
    assert fp32["aten::linear"] == bf16["aten::linear"] == 2 * 4 + 1, (fp32, bf16)
    assert bf16["aten::layer_norm"] == fp32["aten::layer_norm"] == 2 * 2 + 1
    assert bf16["aten::scaled_dot_product_attention"] == 2, bf16
    assert bf16["aten::_to_copy"] > 0  # autocast's casts are counted: they are real calls


class FakeEvent:
    """The parts of a kineto event that parse_events reads."""

    def __init__(
        self,
        name,
        kind,
        start,
        end=None,
        corr=0,
        annotation=False,
        thread=1,
        seq=-1,
        fwd=0,
        nbytes=0,
        python=False,
    ) -> None:
        self._name, self._kind, self._start, self._end = name, kind, start, end or start + 1
        self._python = python  # a Python frame, as --trace-stacks records them
        self._corr, self._annotation, self._thread = corr, annotation, thread
        self._seq, self._fwd = seq, fwd  # an autograd node's forward op: (fwd thread, seq)
        self._nbytes = nbytes  # a [memory] event's: negative where memory is freed

    def name(self) -> str:
        return self._name

    def device_type(self):
        return self._kind

    def start_ns(self) -> int:
        return self._start

    def end_ns(self) -> int:
        return self._end

    def duration_ns(self) -> int:
        return self._end - self._start

    def correlation_id(self) -> int:
        return self._corr

    def is_user_annotation(self) -> bool:
        return self._annotation

    def nbytes(self) -> int:
        return self._nbytes

    def start_thread_id(self) -> int:
        return self._thread

    def sequence_nr(self) -> int:
        return self._seq

    def fwd_thread_id(self) -> int:
        return self._fwd

    def is_python_function(self) -> bool:
        return self._python


def test_an_ops_self_time_is_the_same_with_python_stacks_recorded() -> None:
    """--trace-stacks records Python frames, some inside an op (the oneDNN linear's wrapper
    runs Python): they are not operators, and an op's self time does not lose theirs."""
    cpu = DeviceType.CPU
    with_stacks = [
        FakeEvent("forward", cpu, 0, 1000),
        FakeEvent("cpu_linear::linear", cpu, 100, 500),
        FakeEvent("cpu_linear.py(80): _linear", cpu, 110, 480, python=True),
        FakeEvent("mkldnn::_linear_pointwise", cpu, 200, 400),
    ]
    without = [e for e in with_stacks if not e.is_python_function()]
    for events in (with_stacks, without):
        seen = parse_events(events, torch.device("cpu"))
        assert seen.cpu_self_us["cpu_linear::linear"] == pytest.approx(0.2)  # 400 - 200 ns
        assert seen.cpu_self_us["mkldnn::_linear_pointwise"] == pytest.approx(0.2)


def test_cpu_peak_memory_is_the_most_live_at_once() -> None:
    """The profiler's [memory] events, in time order: allocations add, frees subtract; the peak
    is the most bytes live at one time above what was live before the step."""
    cpu = DeviceType.CPU
    sizes = [(50, 3), (100, 1), (-80, 5), (-100, 2), (30, 4)]  # (bytes, when), out of order
    events = [FakeEvent("[memory]", cpu, t, nbytes=n) for n, t in sizes]
    # Live in time order: 100, 0, 50, 80, 0
    assert parse_events(events, torch.device("cpu")).peak_transient_bytes == 100
    events.append(FakeEvent("[memory]", cpu, 6, nbytes=120))  # 0 live after t=5: peak 120
    assert parse_events(events, torch.device("cpu")).peak_transient_bytes == 120


def test_cuda_kernels_are_counted_in_the_region_that_launched_them() -> None:
    """Off a GPU, with made-up events: GPU timestamps lag the CPU's, so a kernel belongs to
    the region of its launch (any launch API, cuDNN's cuLaunchKernelEx included), and a
    kernel whose launch is not in the trace is kept aside, still seen by the backend check."""
    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    events = [
        FakeEvent("forward", cpu, 0, 100),
        FakeEvent("backward", cpu, 100, 200),
        FakeEvent("aten::_scaled_dot_product_cudnn_attention", cpu, 10),
        FakeEvent("cudaLaunchKernel", cpu, 20, corr=1),
        FakeEvent("cuLaunchKernelEx", cpu, 30, corr=2),
        FakeEvent("cudaMemcpyAsync", cpu, 150, corr=3),
        FakeEvent("ampere_sgemm_128x64_tn", gpu, 160, corr=1),  # runs in backward's time
        FakeEvent("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", gpu, 170, corr=2),
        FakeEvent("Memcpy DtoD (Device -> Device)", gpu, 180, corr=3),
        FakeEvent("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", gpu, 190, corr=9),
        FakeEvent("forward", gpu, 160, 175, annotation=True),
        FakeEvent("Event Sync", gpu, 195),
    ]
    seen = parse_events(events, torch.device("cuda")).per_step(1)
    assert seen["kernels"]["forward"] == {
        "ampere_sgemm_128x64_tn": 1,
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop": 1,
    }
    assert seen["kernels"]["backward"] == {"Memcpy DtoD (Device -> Device)": 1}
    assert seen["unattributed"] == {"cudnn_generated_fort_native_sdpa_sm90_flash_bprop": 1}
    assert len(seen["device_ms"]) == 4  # every kernel's time counts, attributed or not
    assert seen["ops"]["forward"] == {"aten::_scaled_dot_product_cudnn_attention": 1}

    only_unattributed = {"forward": {}, "unattributed": seen["unattributed"]}
    cuda = torch.device("cuda")
    assert verify_backend("CUDNN_ATTENTION", seen["ops"], only_unattributed, cuda) is None
    problem = verify_backend("CUDNN_ATTENTION", seen["ops"], {"forward": {}}, cuda)
    assert problem is not None and "/cudnn/" in problem


def test_kernel_time_counts_under_the_operator_that_launched_it() -> None:
    """Off a GPU, with made-up events: a kernel's name does not say who launched it, the ops
    around its launch do. Casts inside softmax and matmuls outside a linear are attention's; a
    GEMM inside aten::linear is the linear layers'; backward kernels go where the forward op
    of their autograd node does; a kernel no op launched (a compiled graph's) goes by its name."""
    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    node = "autograd::engine::evaluate_function: "
    # (thread, ops around the launch, outermost first, with their sequence numbers; kernel; us)
    launched = [
        (1, [("aten::linear", 0), ("aten::addmm", 0)], "nvjet_sm90_tst_h_bz_coopA_NNT", 8),
        (1, [("aten::linear", 1), ("aten::to", 1), ("aten::copy_", -1)], "bf16_copy_kernel", 1),
        (1, [("aten::matmul", 2), ("aten::bmm", 2)], "nvjet_sm90_tst_h_bz_NTN", 4),
        (1, [("aten::matmul", 3), ("aten::to", 3), ("aten::copy_", -1)], "bf16_copy_kernel", 2),
        (1, [("aten::softmax", 4), ("aten::to", 4), ("aten::copy_", -1)], "direct_copy", 3),
        (1, [("aten::masked_fill", 5), ("aten::clone", -1)], "Memcpy DtoD", 5),
        (1, [("aten::mul", 6)], "MulFunctor", 6),  # the scale: elementwise, shared
        (2, [(node + "AddmmBackward0", 0), ("aten::sum", -1)], "reduce_kernel", 7),
        (2, [(node + "ToCopyBackward0", 4), ("aten::to", -1)], "direct_copy", 9),
        (2, [(node + "MulBackward0", 6), ("aten::mul", -1)], "MulFunctor", 14),
        (1, [("Torch-Compiled Region: 0/0", -1)], "triton_per_fused__softmax_masked_fill_3", 10),
        (1, [("Torch-Compiled Region: 0/0", -1)], "triton_red_fused__log_softmax_2", 11),
        (1, [("Torch-Compiled Region: 0/0", -1)], "triton_tem_fused_mm_4", 12),
    ]
    events = [FakeEvent("forward", cpu, 0, 10_000)]
    for i, (thread, ops, kernel, us) in enumerate(launched):
        t = 100 * (i + 1)
        for depth, (op, seq) in enumerate(ops):
            fwd = 1 if op.startswith(node) else 0  # a node's forward op ran on thread 1
            end = t + 50 - depth
            events.append(FakeEvent(op, cpu, t + depth, end, thread=thread, seq=seq, fwd=fwd))
        events.append(FakeEvent("cudaLaunchKernel", cpu, t + 20, corr=i + 1, thread=thread))
        events.append(FakeEvent(kernel, gpu, 20_000 + 100 * i, 20_000 + 100 * i + us, corr=i + 1))

    seen = parse_events(events, torch.device("cuda")).per_step(1)
    total = sum(us for *_, us in launched)
    split = {k: round(v * total) for k, v in seen["time_split"].items()}
    assert split == {
        "linear layers": 8 + 1 + 7,
        "attention": 4 + 2 + 3 + 5 + 9 + 10,
        "matmul kernels (linear layers; attention's too unless fused)": 12,
        "everything else": 6 + 14 + 11,
    }


def test_backward_work_counts_where_its_forward_op_does() -> None:
    """With the profiler's own sequence numbers: under autocast, aten::matmul casts its fp32
    input, and the backward of that cast (ToCopyBackward0) is attention's, as the cast is; the
    backward of a cast made by hand, outside any attention op, is not."""
    from torch.profiler import profile

    from profiling.measure import _categorised

    x = torch.randn(4, 8, 8, requires_grad=True)
    with profile() as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.matmul(x, x.transpose(-1, -2))
        y.float().sum().backward()
    events = [e for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CPU]
    casts_back = Counter(c for e, c, _, _ in _categorised(events) if e.name() == "ToCopyBackward0")
    assert casts_back[None] == 1 and casts_back["attention"] >= 1, casts_back
    assert set(casts_back) == {None, "attention"}, casts_back


def test_operator_self_time_counts_under_the_operator_around_it() -> None:
    """On CPU each op's self time (its time less that of the ops inside it) counts under the
    outermost op around it that names a category: naive's hidden copy is attention's, and a
    matmul inside a linear layer is the linear layer's. Events nest as torch nests them: a
    parent first when both start together, and one that outlasts the op it starts in is not
    inside it."""
    cpu = DeviceType.CPU
    events = [
        FakeEvent("forward", cpu, 0, 1_000),
        FakeEvent("aten::clone", cpu, 10, 80),  # listed first, starts with its parent
        FakeEvent("aten::masked_fill", cpu, 10, 130),
        FakeEvent("aten::copy_", cpu, 30, 70),
        FakeEvent("aten::masked_fill_", cpu, 80, 100),
        FakeEvent("aten::mul", cpu, 200, 230),  # elementwise work outside attention's ops
        FakeEvent("aten::sub", cpu, 225, 245),  # outlasts mul: its sibling, not its child
        FakeEvent("aten::add_", cpu, 210, 220, thread=2),  # another thread's
        FakeEvent("aten::linear", cpu, 300, 400),
        FakeEvent("aten::matmul", cpu, 310, 370),
        FakeEvent("aten::mm", cpu, 320, 360),
    ]
    seen = parse_events(events, torch.device("cpu"))
    assert seen.cpu_self_us == pytest.approx(
        {
            "aten::masked_fill": 0.03,
            "aten::clone": 0.03,
            "aten::copy_": 0.04,
            "aten::masked_fill_": 0.02,
            "aten::mul": 0.03,
            "aten::sub": 0.02,
            "aten::add_": 0.01,
            "aten::linear": 0.04,
            "aten::matmul": 0.02,
            "aten::mm": 0.04,
        }
    )
    assert seen.per_step(1)["time_split"] == pytest.approx(
        {"attention": 120 / 280, "linear layers": 100 / 280, "everything else": 60 / 280}
    )


def test_a_marked_attention_call_is_attentions_forward_and_backward() -> None:
    """Inside the `attention` range an eager cell's profiled steps put around each call of the
    variant, every op is attention's, and so is its backward: naive's scale multiply, which no
    attention op encloses. The same op outside the range is not."""
    cpu = DeviceType.CPU
    events = [
        FakeEvent("forward", cpu, 0, 1000),
        FakeEvent("attention", cpu, 100, 300, annotation=True),
        FakeEvent("aten::bmm", cpu, 110, 150, seq=1),
        FakeEvent("aten::mul", cpu, 160, 190, seq=2),  # the scale
        FakeEvent("aten::mul", cpu, 400, 420, seq=3),  # elementwise work elsewhere
        FakeEvent("backward", cpu, 1000, 2000),
        FakeEvent("MulBackward0", cpu, 1100, 1200, seq=2, fwd=1),
        FakeEvent("aten::mul", cpu, 1110, 1150),
        FakeEvent("MulBackward0", cpu, 1300, 1400, seq=3, fwd=1),
        FakeEvent("aten::mul", cpu, 1310, 1360),
    ]
    seen = parse_events(events, torch.device("cpu"))
    assert seen.cpu_split_us == pytest.approx({"attention": 0.11, "everything else": 0.07})
    assert sum(seen.ops["forward"].values()) == 3  # the range itself is not an op


def test_marking_attention_calls_changes_no_count_and_is_undone() -> None:
    """A naive model's profiled training step with its attention calls marked: the ranges show,
    one per layer, the scale multiply and its backward count as attention, the op counts are
    those of an unmarked step, and afterwards each layer calls its variant directly again."""
    from torch.profiler import profile

    from config import TrainConfig
    from model import GPT, GPTConfig
    from optim import build_optimizer
    from profiling.measure import _categorised, attention_calls_marked
    from step import train_step

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16))
    optimizer = build_optimizer(model, TrainConfig(), torch.device("cpu"))
    xy = torch.randint(64, (2, 17))
    micro = [(xy[:, :-1], xy[:, 1:])]
    train_step(model, optimizer, micro, grad_clip=1.0)  # the first makes AdamW's state
    attends = [block.attn.attend for block in model.blocks]

    def profiled(marked: bool) -> list:
        mark = attention_calls_marked(model) if marked else contextlib.nullcontext()
        with mark, profile(acc_events=True) as prof:
            train_step(model, optimizer, micro, grad_clip=1.0)
        return [
            e for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CPU
        ]

    plain, marked = profiled(False), profiled(True)
    assert [block.attn.attend for block in model.blocks] == attends
    with pytest.raises(KeyboardInterrupt), attention_calls_marked(model):
        raise KeyboardInterrupt
    assert [block.attn.attend for block in model.blocks] == attends
    assert sum(e.name() == "attention" for e in marked) == 2
    assert sum(e.name() == "attention" for e in plain) == 0
    device = torch.device("cpu")
    assert parse_events(marked, device).ops == parse_events(plain, device).ops

    def scale_muls(events: list) -> Counter:  # the categories of each aten::mul and its backward
        names = ("aten::mul", "MulBackward0")
        return Counter((e.name(), c) for e, c, _, _ in _categorised(events) if e.name() in names)

    assert scale_muls(marked)[("aten::mul", "attention")] == 4  # per layer: the scale, its backward
    assert scale_muls(marked)[("MulBackward0", "attention")] == 2
    assert scale_muls(plain)[("MulBackward0", "attention")] == 0


def test_a_compiled_graphs_backward_is_its_own() -> None:
    """A compiled graph's autograd node is made by `CompiledFunction`, which has no op name,
    after an op inside attention saw the same sequence number: the graph's backward kernels
    go by their own names, not to attention."""
    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    node = "autograd::engine::evaluate_function: CompiledFunctionBackward"
    events = [
        FakeEvent("forward", cpu, 0, 1000),
        FakeEvent("aten::scaled_dot_product_attention", cpu, 10, 100, seq=5),
        FakeEvent("aten::to", cpu, 20, 30, seq=6),  # makes no node: the next one is 6
        FakeEvent("Torch-Compiled Region: 2/0", cpu, 110, 200),
        FakeEvent("CompiledFunction", cpu, 111, 199, seq=6),
        FakeEvent("backward", cpu, 1000, 2000),
        FakeEvent(node, cpu, 1100, 1200, thread=2, seq=6, fwd=1),
        FakeEvent("cuLaunchKernel", cpu, 1110, corr=1, thread=2),
        FakeEvent("triton_poi_fused_gelu_backward_0", gpu, 5000, 5010, corr=1),
    ]
    split = parse_events(events, torch.device("cuda")).per_step(1)["time_split"]
    assert split == {"everything else": 1.0}


def test_self_times_match_the_profilers_own() -> None:
    """The self time parse_events derives from a real step's events is torch's own
    (key_averages), op by op."""
    from torch.profiler import ProfilerActivity, profile

    from config import TrainConfig
    from model import GPT, GPTConfig
    from optim import build_optimizer
    from profiling.names import OP_NAMESPACES
    from step import train_step

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16))
    optimizer = build_optimizer(model, TrainConfig(), torch.device("cpu"))
    xy = torch.randint(64, (2, 17))
    train_step(model, optimizer, [(xy[:, :-1], xy[:, 1:])])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(model, optimizer, [(xy[:, :-1], xy[:, 1:])], grad_clip=1.0)
    seen = parse_events(prof.profiler.kineto_results.events(), torch.device("cpu"))
    own = {
        a.key: a.self_cpu_time_total for a in prof.key_averages() if a.key.startswith(OP_NAMESPACES)
    }
    assert set(seen.cpu_self_us) == set(own)
    for name, us in own.items():
        assert seen.cpu_self_us[name] == pytest.approx(us, abs=0.01), name
    assert sum(seen.cpu_split_us.values()) == pytest.approx(sum(own.values()), abs=0.1)


def _ops_row(variant: str, n: int, forward: dict, backward: dict | None = None) -> dict:
    ops = {"forward": forward, "backward": backward or {}, "optimizer": {}}
    return {"variant": variant, "compile": False, "n_layer": n, "status": "ok", "ops_per_step": ops}


def test_op_diff_when_one_variant_has_a_single_depth() -> None:
    """A sweep cut short leaves some variants at fewer depths: compare at a shared depth, say
    that the whole step's difference was divided by n_layer, and order by size as usual."""
    from profiling.analysis import describe_diff

    def row(variant: str, n: int, clones: int, adds: int, mm: int) -> dict:
        return _ops_row(variant, n, {"aten::add": adds, "aten::clone": clones, "aten::mm": mm})

    rows = [
        row("naive", 1, 5, 2, 4),
        row("naive", 2, 10, 4, 8),
        row("sdpa", 2, 4, 2, 8),
    ]
    diffs = op_diff(rows, "sdpa", "naive")
    assert diffs == [
        {"region": "forward", "name": "aten::clone", "per_layer": -3.0, "one_depth": 2},
        {"region": "forward", "name": "aten::add", "per_layer": -1.0, "one_depth": 2},
    ]
    text = describe_diff("sdpa", "naive", diffs)
    assert "one depth in common (n_layer=2): the whole step's difference divided by 2" in text
    assert "per layer per step" not in text
    full = describe_diff("sdpa", "naive", diffs, full=True)
    assert "one depth in common (n_layer=2)" in full
    # At one depth the counts are exact: one op more per step is shown however deep the model
    # (one outside the layers at n_layer=8 is 0.125 per layer, under the fits' threshold).
    deep = [_ops_row("naive", 8, {"aten::alias": 1}), _ops_row("sdpa", 8, {})]
    assert op_diff(deep, "sdpa", "naive") == [
        {"region": "forward", "name": "aten::alias", "per_layer": -0.12, "one_depth": 8}
    ]


def test_op_diff_fits_both_labels_over_the_depths_both_measured() -> None:
    """A cell that failed leaves its depth out of both sides: counts that are the same at every
    shared depth differ by nothing, however they grow with depth (the foreach optimizer's
    kernels do not grow linearly). A difference that is not a straight line in n_layer says
    so; labels with no depth in common get no per-layer diff."""
    from profiling.analysis import describe_diff
    from profiling.findings import diff_text, findings

    def row(variant: str, n: int, status: str = "ok") -> dict:
        chunks = {1: 3, 2: 3, 4: 4, 8: 7}[n]  # the same for both, not linear in n
        r = _ops_row(variant, n, {"aten::clone": n}, None)
        r["ops_per_step"]["optimizer"] = {"aten::_foreach_add_": chunks}
        return {**r, "status": status}

    rows = [row("naive", 1), row("naive", 2), row("naive", 8, "oom")]
    rows += [row("sdpa", n) for n in (1, 2, 8)]
    assert op_diff(rows, "sdpa", "naive") == []

    curved = [row("naive", n) for n in (1, 2, 4)] + [row("sdpa", n) for n in (1, 2, 4)]
    for r in curved:
        if r["variant"] == "sdpa":
            r["ops_per_step"]["forward"]["aten::clone"] = r["n_layer"] ** 2
    (diff,) = op_diff(curved, "sdpa", "naive")
    assert diff["name"] == "aten::clone" and diff["linear"] is False
    assert "(forward, on average: not the same at every depth)" in describe_diff(
        "sdpa", "naive", [diff]
    )
    for r in curved:
        if r["variant"] == "sdpa":
            r["ops_per_step"]["forward"]["aten::clone"] = 2 * r["n_layer"]
    assert op_diff(curved, "sdpa", "naive") == [
        {"region": "forward", "name": "aten::clone", "per_layer": 1.0}
    ]

    # Ops counted as one (kernels by their label) are summed before the fit: parts whose
    # split moves with depth, summing to a straight line, make a straight line.
    for r in curved:
        n, sdpa = r["n_layer"], r["variant"] == "sdpa"
        x, y = (n * n, 3 * n - n * n) if sdpa else (0, n)  # x + y: 3n against n
        r["ops_per_step"]["forward"] = {"aten::x": x, "aten::y": y}
    assert op_diff(curved, "sdpa", "naive", key_of=lambda name: "xy") == [
        {"region": "forward", "name": "xy", "per_layer": 2.0}
    ]

    apart = [row("naive", 1), row("naive", 2), row("sdpa", 4), row("sdpa", 8)]
    assert op_diff(apart, "sdpa", "naive") is None  # not [], which says they differ in nothing
    assert findings(apart) == ["- sdpa vs naive: not measured at a common n_layer, so no diff."]
    assert "not measured at a common n_layer" in diff_text(apart, "sdpa", "naive")


def test_diff_names_every_op_that_differs() -> None:
    """The report names a dozen, each region's largest in turn, and points to --diff; --diff
    shows them all, by region, views included, instead of the same cut list."""
    from profiling.analysis import describe_diff
    from profiling.findings import diff_text

    extra = {f"aten::op{i:02d}": i for i in range(1, 16)}  # 15 named ops, more per layer in b
    rows = []
    for n in (1, 2):
        rows.append(_ops_row("a", n, {"aten::view": 3 * n}, {"aten::bmm": n}))
        rows.append(_ops_row("b", n, {k: v * n for k, v in extra.items()}))
    short = describe_diff("a", "b", op_diff(rows, "a", "b"))
    # Each region's largest in turn: the one backward difference is not crowded out.
    assert short.count(" fewer (forward)") == 11 and "1 aten::bmm more (backward)" in short
    assert "4 more differences (`profile_train.py --report" in short
    full = diff_text(rows, "a", "b")
    assert "more differences" not in full
    lines = full.splitlines()
    assert lines[0] == "a vs b, per layer per step, every op that differs:"
    forward, backward = lines.index("  forward:"), lines.index("  backward:")
    assert lines[forward + 1] == "    15 aten::op15 fewer"  # largest first
    assert all(f"    {i} aten::op{i:02d} fewer" in lines[forward:backward] for i in extra.values())
    assert "    3 aten::view more" in lines[forward:backward]
    assert lines[backward + 1 :] == ["    1 aten::bmm more"]


def test_kernel_labels_name_the_operation_and_its_dtype() -> None:
    """Kernel names as an H200 run recorded them (tests/cuda_kernel_names.json, each with the
    label read off by hand): a PyTorch launcher goes by the operation it runs and its dtype,
    other C++ kernels by their unqualified name, plain names unchanged."""
    from profiling.names import kernel_label

    names = json.loads((Path(__file__).parent / "cuda_kernel_names.json").read_text())
    assert len(names) >= 16
    for name, expected in names.items():
        assert kernel_label(name) == expected, name[:120]


def test_the_backend_check_knows_each_fused_kernel_by_its_recorded_name() -> None:
    """On a GPU the backend check also wants the backend's kernel in the trace: each pattern
    finds the kernel an H200 run recorded for its backend, and not another backend's."""
    names = json.loads((Path(__file__).parent / "cuda_kernel_names.json").read_text())
    kernels = {
        backend: next(name for name in names if marker in name)
        for backend, marker in [
            ("FLASH_ATTENTION", "pytorch_flash::flash_fwd_kernel"),
            ("EFFICIENT_ATTENTION", "fmha_cutlassF"),
            ("CUDNN_ATTENTION", "cudnn_generated_fort_native_sdpa"),
        ]
    }
    cuda = torch.device("cuda")  # a device type only: nothing runs
    for backend, kernel in kernels.items():
        ops = {"forward": {BACKEND_OPS[backend][0]: 1}}
        assert verify_backend(backend, ops, {"forward": {kernel: 1}}, cuda) is None, backend
        for other, elsewhere in kernels.items():
            if other != backend:
                problem = verify_backend(backend, ops, {"forward": {elsewhere: 1}}, cuda)
                assert problem and problem.startswith("no kernel name matches"), (backend, other)


def test_renumbered_triton_kernels_are_no_difference() -> None:
    """Inductor numbers a graph's Triton kernels in order, so one fused kernel is `_13` in one
    variant's graph and `_8` in another's: the kernel diff counts them as the same kernel."""
    from profiling.findings import diff_text, findings

    def rows_with(kernels_of: dict[str, dict[str, int]]) -> list[dict]:
        rows = []
        for variant, kernels in kernels_of.items():
            for n in (1, 2):
                row = _ops_row(variant, n, {"aten::mm": n})
                row["kernels_per_step"] = {
                    "forward": {k: c * n for k, c in kernels.items()},
                    "backward": {},
                    "optimizer": {},
                }
                rows.append(row)
        return rows

    renumbered = rows_with(
        {
            "naive": {"triton_poi_fused_gelu_view_8": 2},
            "sdpa": {
                "triton_poi_fused_gelu_view_13": 2,
                "triton_per_fused__softmax_masked_fill_5": 1,
            },
        }
    )
    assert (
        "CUDA kernels: sdpa vs naive, per layer per step: 1 triton_per_fused__softmax_masked_fill "
        "more (forward)."
    ) in findings(renumbered)[1]
    assert "triton_poi_fused_gelu_view" not in diff_text(renumbered, "sdpa", "naive")


def _copy_kernel(vec: int, dtype: str = "c10::BFloat16") -> str:
    """A copy kernel's name as the profiler records it (shortened), launched `vec` wide."""
    return (
        f"void at::native::elementwise_kernel<128, {vec}, at::native::gpu_kernel_impl_nocast<"
        "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::"
        f"operator()() const::{{lambda()#12}}::operator()() const::{{lambda({dtype})#1}}>"
        "(at::TensorIteratorBase&)::{lambda(int)#1}>(int)"
    )


def test_kernel_findings_merge_launchers_of_one_operation() -> None:
    """One operation launched through two launchers (vectorized or not) is one label in the
    findings: counts add, a net zero drops out; --diff keeps every full name."""
    from profiling.analysis import describe_diff
    from profiling.findings import diff_text
    from profiling.names import kernel_label

    fill = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
    fill += "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)"
    rows = []
    for n in (1, 2):
        a = {_copy_kernel(2): 2 * n, "nvjet_x": n, _copy_kernel(2, "float"): n}
        b = {_copy_kernel(4): 1 * n, _copy_kernel(2): 3 * n, fill: n, _copy_kernel(4, "float"): n}
        for variant, kernels in (("a", a), ("b", b)):
            row = _ops_row(variant, n, {"aten::mm": n})
            row["kernels_per_step"] = {"forward": kernels, "backward": {}, "optimizer": {}}
            rows.append(row)
    kernels = op_diff(rows, "a", "b", kind="kernels_per_step", key_of=kernel_label)
    text = describe_diff("a", "b", kernels, unit="kernel")
    assert "2 direct_copy_kernel_cuda<BFloat16> fewer (forward)" in text
    assert "1 FillFunctor<float> fewer (forward)" in text and "1 nvjet_x more (forward)" in text
    assert "elementwise_kernel<128" not in text
    assert "direct_copy_kernel_cuda<float>" not in text  # a net zero
    full = diff_text(rows, "a", "b")
    assert (
        f"    1 {_copy_kernel(4)} fewer" in full.splitlines()
        and f"    1 {_copy_kernel(2)} fewer" in full
    )


def test_compare_of_sweeps_stopped_in_their_first_depth_says_so(
    naive_vs_inplace: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Sweeps stopped while their first depth was timed or profiled hold interrupted rows
    only: no depth to compare, said in one line, not an IndexError."""
    folders = []
    for i in range(2):
        results = copy.deepcopy(naive_vs_inplace)
        results["meta"]["started_at"] = f"2026-12-0{i + 1}T10:00:00+00:00"
        results["rows"] = [dict(r, status="interrupted") for r in results["rows"]]
        folders.append(tmp_path / f"s{i}")
        folders[-1].mkdir()
        (folders[-1] / "results.json").write_text(json.dumps(results))
    assert profile_train.main(["--compare", *map(str, folders)]) == 2
    assert "--compare: no depth to compare: every sweep stopped" in capsys.readouterr().err


def test_compare_of_sweeps_of_one_depth_fits_nothing_and_says_why(
    naive_vs_inplace: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Sweeps of one depth each: their step times side by side, and in place of each fitted
    table the reason it is empty, rather than a header with no rows."""
    folders = []
    for i in range(2):
        results = copy.deepcopy(naive_vs_inplace)
        results["meta"]["started_at"] = f"2026-12-0{i + 1}T10:00:00+00:00"
        results["meta"]["other_cpu_share"] = 0.0
        results["rows"] = [r for r in results["rows"] if r["n_layer"] == 1]
        results["meta"]["cells_planned"] = len(results["rows"])
        folders.append(tmp_path / f"s{i}")
        folders[-1].mkdir()
        (folders[-1] / "results.json").write_text(json.dumps(results))
    assert profile_train.main(["--compare", *map(str, folders)]) == 0
    _, step_times, costs, fitted, measured = capsys.readouterr().out.split("## ")
    assert "| naive | " in step_times and "n_layer=1" in measured
    assert costs.splitlines()[2] == "(none: a fit needs two depths)"
    assert fitted.splitlines()[2].startswith("(none: a fit needs two depths, and a saving naive")


def test_time_categories_compare_across_variants() -> None:
    """'Where the time goes' puts naive's batched matmuls and softmax in attention, as it does
    SDPA's fused kernel, and every linear-layer path (BLAS, the oneDNN custom op) in linear."""
    from profiling.names import time_category

    for name in ("aten::addmm", "aten::mm", "mkldnn::_linear_pointwise", "cpu_linear::linear"):
        assert time_category(name) == "linear layers", name
    for name in (
        "aten::bmm",
        "aten::baddbmm",
        "aten::_softmax",
        "aten::_softmax_backward_data",
        "aten::masked_fill_",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "flash_fwd_kernel",
    ):
        assert time_category(name) == "attention", name
    # A GEMM kernel's name does not say who launched it; the loss's log_softmax is not attention.
    assert time_category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n").startswith("matmul kernels")
    for name in ("aten::gelu", "aten::_log_softmax", "aten::copy_", "aten::matmul", "other"):
        assert time_category(name) == "everything else", name


def _timed_row(variant: str, median: float, times: dict, **extra) -> dict:
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


def test_where_the_time_goes_shows_the_time_outside_the_operators() -> None:
    """Operators' self time leaves out Python and the autograd engine: the report gives the
    remainder to the timed median, and says so plainly when the operators exceed it."""
    from profiling.findings import where_time_goes

    naive = {"mkldnn::_linear_pointwise": 40.0, "aten::bmm": 30.0, "aten::gelu": 20.0}
    sdpa = {"mkldnn::_linear_pointwise": 40.0, "aten::_scaled_dot_product_flash_attention": 30.0}
    rows = [
        _timed_row("naive", 100.0, naive),
        _timed_row("sdpa", 60.0, sdpa, compile=True),
    ]
    naive_line, sdpa_line, *note = where_time_goes(rows)
    assert "timed median 100.0 ms, the base of the percentages." in naive_line
    assert "90.0 ms: linear layers 40.0 ms (40%), attention 30.0 ms (30%), everything" in naive_line
    assert "outside the operators +10.0 ms (10%)" in naive_line and "exceeds" not in naive_line
    assert "attention 30.0 ms (50%)" in sdpa_line
    assert "outside the operators -10.0 ms (-17%)" in sdpa_line and "exceeds" in sdpa_line
    assert "Inductor's fused kernels are not ATen operators" in sdpa_line
    assert "Inductor" not in naive_line
    assert "predates these categories" in note[-1]  # no stored split in these rows
    naive_of_three, sdpa_of_three, *_ = where_time_goes(rows, profile_steps=3)
    assert "Operators' self time per profiled step 90.0 ms" in naive_of_three
    assert "the profiled steps ran slower than the timed ones" in sdpa_of_three

    # A stored split over every op is used as is, in ms of the listed total.
    stored = {"linear layers": 0.5, "attention": 0.25, "everything else": 0.25}
    [line] = where_time_goes([_timed_row("naive", 100.0, naive, time_split=stored)])
    assert "linear layers 45.0 ms (45%), attention 22.5 ms (22%)" in line


def test_the_time_split_says_how_many_profiled_steps_it_averages() -> None:
    """--profile-steps N: the ops' times are per step, averaged over the N profiled steps."""
    from profiling.method import METHOD, where_time_goes_intro

    for old in (None, "by enclosing op", METHOD["time_categories"]):
        (one, _, one_rest, *_), (three, _, three_rest, *_) = (
            where_time_goes_intro({"time_categories": old, "profile_steps": n}) for n in (1, 3)
        )
        assert "deepest cell, in one profiled step (not one of the timed" in one, old
        assert "deepest cell, per step, over its 3 profiled steps (none of them a timed" in three
        assert "when the profiled steps ran slower" in three_rest and "step ran" in one_rest
        assert "{profiled}" not in one + three


def test_where_the_time_goes_on_cuda_lists_kernels_by_label() -> None:
    """On CUDA the largest kernels go by their labels, one operation's launchers summed; the
    unlisted rest ('other') counts in the total but is not a kernel to list."""
    from profiling.findings import where_time_goes

    kernels = {"other": 20.0, "nvjet_sm90_tst": 6.0, _copy_kernel(2): 5.0, _copy_kernel(4): 3.0}
    split = {"everything else": 1.0}
    row = _timed_row("sdpa", 40.0, {"aten::mm": 1.0}, device_ms_per_step=kernels, time_split=split)
    [line] = where_time_goes([row])
    assert (
        "Kernel time in the profiled step 34.0 ms" in line and "no kernel running +6.0 ms" in line
    )
    assert line.endswith(
        "Largest (ms): `direct_copy_kernel_cuda<BFloat16>` 8.0, `nvjet_sm90_tst` 6.0."
    )


def test_findings_compare_compiled_variants_with_compiled_naive() -> None:
    from profiling.findings import findings

    def row(variant: str, compiled: bool, n: int) -> dict:
        ops = {"naive": {"aten::bmm": 2 * n}, "sdpa": {"aten::_flash": n}}[variant]
        if compiled:
            ops = {**ops, "aten::mm": 3 * n}  # what compiling changes, shared by both
        return {
            "variant": variant,
            "compile": compiled,
            "n_layer": n,
            "status": "ok",
            "ops_per_step": {"forward": ops, "backward": {}, "optimizer": {}},
            "kernels_per_step": None,
        }

    rows = [row(v, c, n) for v in ("naive", "sdpa") for c in (False, True) for n in (1, 2)]
    lines = findings(rows)
    assert [line.split(",")[0] for line in lines] == [
        "- sdpa vs naive",
        "- sdpa+compile vs naive+compile",
    ]
    assert "aten::mm" not in lines[1], "what compiling changes cancels against compiled naive"


@pytest.mark.parametrize("chosen", [["--variants", "naive,inplace"], []], ids=["named", "all"])
def test_each_variant_is_probed_once_per_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chosen: list[str]
) -> None:
    """Whether a variant can run is decided by running it (flex compiles on CUDA); the answer
    main gets, choosing the variants, holds for the sweep and every depth."""
    import profiling.sweep

    probed: list[str] = []
    real = probe.unavailable_reason

    def counted(name: str, *args: object, **kwargs: object) -> str | None:
        probed.append(name)
        return real(name, *args, **kwargs)

    # Every name it is called by: the sweep's, main's, and available_variants' own.
    for module in (profiling.sweep, profile_train, probe):
        monkeypatch.setattr(module, "unavailable_reason", counted)
    # Two depths where it matters (once for the sweep, not per depth); all variants at one.
    layers = ["1", "2"] if chosen else ["1"]
    rc, results = sweep(tmp_path, *chosen, "--layers", ",".join(layers), "--no-traces")
    ran = sorted({r["variant"] for r in results["rows"]})
    assert rc == 0 and [r["status"] for r in results["rows"]] == ["ok"] * len(layers) * len(ran)
    expected = ["naive", "inplace"] if chosen else list(attention.VARIANTS)
    assert sorted(probed) == sorted(expected)


def test_allocator_counts_read_device_calls_and_retries() -> None:
    from profiling.cells import allocator_counts

    stats = {"num_device_alloc": 5, "num_device_free": 2, "num_alloc_retries": 1}
    assert allocator_counts({**stats, "segment.all.allocated": 9}) == (7, 1)
    assert allocator_counts({}) == (0, 0)  # what memory_stats() gives before CUDA starts


def test_a_sweep_records_the_allocator_calls_and_page_faults_of_the_timed_steps_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The allocator and the page faults are read around each timed step, their differences
    summed per cell: per step for the calls and faults, in all for the retries. (Off CUDA there
    is no allocator: a stand-in that moves by 3 calls and 1 retry between each pair of readings;
    the fault counter's stand-in moves by 5.)"""
    import profiling.sweep

    readings, fault_readings = itertools.count(), itertools.count(step=5)

    def allocator(self: Sweep) -> tuple[int, int]:
        k = next(readings)
        return 3 * k, k

    monkeypatch.setattr(Sweep, "_allocator", allocator)
    monkeypatch.setattr(profiling.sweep, "minor_faults", lambda: next(fault_readings))
    rc, results = sweep(tmp_path, "--variants", "naive,inplace", "--layers", "1", "--no-traces")
    assert rc == 0
    for row in results["rows"]:
        assert row["step_ms"]["n"] == 2
        assert row["allocator_calls_per_step"] == 3 and row["alloc_retries"] == 2
        assert row["page_faults_per_step"] == 5
    assert next(readings) == 2 * 2 * 2  # two readings per timed step, none elsewhere
    assert next(fault_readings) == 5 * 2 * 2 * 2
    report = (tmp_path / "sweep" / "report.md").read_text()
    assert "per timed step: median 3, at most 3 over the cells (naive L1)." in report


def test_collections_are_timed_by_generation_while_watched_only() -> None:
    from profiling.cells import GcRuns

    runs = GcRuns()
    gc.collect()  # before watching: not seen
    with runs.watching() as watched:
        gc.collect(0)
        gc.collect(2)
    gc.collect(1)  # after: not seen, and the callback is gone
    assert [g for g, _ in watched.runs] == [0, 2]
    # A run's stop with no start seen (one already going as watching began) is not timed
    with GcRuns().watching() as watched:
        watched._callback("stop", {"generation": 1})
    assert watched.runs == []
    assert runs._callback not in gc.callbacks


def test_a_sweep_counts_the_collections_that_land_in_its_timed_steps_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step (first, warm-up, timed) runs a generation-1 collection here; the sweep's own
    full collections before them, and the warm-ups' ones, are not the timed steps'. Automatic
    collections are off, so none other lands."""
    import profiling.sweep
    from profiling.measure import timed

    def collecting(step: Callable[[], object], device: torch.device) -> float:
        gc.collect(1)
        return timed(step, device)

    monkeypatch.setattr(profiling.sweep, "timed", collecting)
    enabled = gc.isenabled()
    gc.disable()
    try:
        rc, results = sweep(tmp_path, "--variants", "naive,inplace", "--layers", "1", "--no-traces")
    finally:
        if enabled:
            gc.enable()
    assert rc == 0
    for row in results["rows"]:
        assert row["gc_collections"] == [0, 2, 0]
        assert row["gc_longest_ms"] > 0
    report = (tmp_path / "sweep" / "report.md").read_text()
    assert "over the 4 timed steps, 4 collections landed in them (generation 0: 0, 1: 4, 2, a " in (
        report
    )
    assert "a full one: 0); the longest took " in report
    with open(tmp_path / "sweep" / "results.csv", newline="") as f:
        assert [r["gc_collections"] for r in csv.DictReader(f)] == ["2", "2"]


def test_collection_line_names_the_cells_with_a_full_collection() -> None:
    from profiling.method import collection_lines

    def row(variant: str, collections: list[int], longest: float) -> dict:
        return {
            "variant": variant,
            "compile": True,
            "n_layer": 4,
            "step_ms": {"median": 90.0, "p10": 85.0, "p90": 95.0, "n": 20},
            "gc_collections": collections,
            "gc_longest_ms": longest,
        }

    [line] = collection_lines([row("naive", [3, 1, 0], 1.25), row("sdpa", [2, 0, 1], 31.5)])
    assert "over the 40 timed steps, 7 collections landed in them" in line
    assert "(generation 0: 5, 1: 1, 2, a full one: 1, in sdpa+compile L4)" in line, line
    assert "the longest took 32 ms, in sdpa+compile L4 (median step 90.0 ms)." in line
    [line] = collection_lines([row("naive", [1, 0, 0], 0.0123)])
    assert "the longest took 0.012 ms" in line
    [line] = collection_lines([row("naive", [0, 0, 0], 0.0)])
    assert line.endswith("over the 20 timed steps, no collection landed in one.")
    # Sweeps written before collections were counted, and failed cells: no line, no count
    assert collection_lines([{"variant": "naive", "compile": False, "n_layer": 1}]) == []
    failed = {"variant": "sdpa", "compile": False, "n_layer": 1, "gc_collections": None}
    assert collection_lines([row("naive", [1, 0, 0], 0.5), failed])[0].count("20 timed") == 1
    # A row whose times were cleared after the counts (edited, or a check failed later)
    cleared = {**row("sdpa", [4, 0, 0], 9.0), "step_ms": None}
    [line] = collection_lines([row("naive", [1, 0, 0], 0.5), cleared])
    assert "over the 20 timed steps, 1 collection landed" in line and "sdpa" not in line, line


@pytest.mark.cuda
def test_cuda_allocator_counts_see_memory_reserved_and_released() -> None:
    """The counters the sweep reads exist in this torch and move when the allocator goes to
    the device: one allocation the cache cannot serve, one release."""
    from profiling.cells import allocator_counts

    torch.cuda.empty_cache()
    calls, _ = allocator_counts(torch.cuda.memory_stats())
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    del x
    torch.cuda.empty_cache()
    assert allocator_counts(torch.cuda.memory_stats())[0] - calls >= 2


def test_device_memory_line_names_the_cell_with_most_allocator_calls() -> None:
    from profiling.method import device_memory_lines

    def row(variant: str, calls: float | None, retries: int | None) -> dict:
        return {
            "variant": variant,
            "compile": False,
            "n_layer": 12,
            "allocator_calls_per_step": calls,
            "alloc_retries": retries,
        }

    [line] = device_memory_lines([row("naive", 0.0, 0), row("sdpa", 2.5, 3), row("flex", 0.0, 0)])
    assert "per timed step: median 0, at most 2.5 over the cells (sdpa L12)." in line
    assert "over all the timed steps: 3 in sdpa L12." in line
    [line] = device_memory_lines([row("naive", 0.0, 0), row("sdpa", 1 / 32, 0)])
    assert "at most 0.031 over the cells (sdpa L12)." in line  # not "0.0"
    assert "retried" not in line and "failed" not in line
    [line] = device_memory_lines(
        [row("naive", 0.0, 0), {**row("sdpa", None, None), "status": "oom"}]
    )
    assert "at most 0 over the cells." in line and "A cell that failed freed the cache" in line
    # CPU sweeps, and CUDA sweeps written before the calls were counted: no line.
    assert device_memory_lines([row("naive", None, None)]) == []
    assert device_memory_lines([{"variant": "naive", "compile": False, "n_layer": 1}]) == []


def test_host_memory_line_names_the_cell_with_most_page_faults() -> None:
    from profiling.method import host_memory_lines

    rows = [
        {"variant": v, "compile": False, "n_layer": 4, "page_faults_per_step": f}
        for v, f in (("naive", 871.0), ("inplace", 0.4), ("sdpa", 0.3))
    ]
    [line] = host_memory_lines({"device": "cpu", "host_memory": "keep"}, rows)
    assert "median 0.4, at most 871 over the cells (naive L4)" in line and "bursts" in line
    [line] = host_memory_lines({"device": "cpu", "host_memory": "release"}, rows)
    assert "bursts" not in line and "as glibc's malloc does by default" in line
    # A Mac's malloc cannot be tuned: not said to be glibc's, nor released by a flag
    mac = {"device": "cpu", "host_memory": "release", "platform": "macOS-14.5-arm64-arm-64bit"}
    [line] = host_memory_lines(mac, rows)
    assert "glibc's malloc does" not in line and "tunes glibc's only" in line, line
    none = [{**r, "page_faults_per_step": 0.0} for r in rows]
    [line] = host_memory_lines({"device": "cpu", "host_memory": "keep"}, none)
    assert "at most 0 over the cells." in line  # no cell named for a maximum of zero
    few = [{**r, "page_faults_per_step": f} for r, f in zip(rows, (0.0, 0.3, 0.0), strict=True)]
    assert (
        "median 0, at most 0.3 over the cells (inplace L4)"
        in host_memory_lines({"device": "cpu", "host_memory": "keep"}, few)[0]
    )
    assert "grown by" not in line
    reserved = {"device": "cpu", "host_memory": "keep", "heap_reserve_bytes": 256 << 20}
    assert "the heap was grown by 256 MiB" in host_memory_lines(reserved, rows)[0]


def test_headline_marks_cells_timed_on_a_busy_machine() -> None:
    def row(variant: str, n: int, p10: float, p90: float) -> dict:
        return {
            "variant": variant,
            "compile": False,
            "n_layer": n,
            "status": "ok",
            "step_ms": {"median": (p10 + p90) / 2, "p10": p10, "p90": p90, "n": 20},
            "mfu": None,
            "peak_mem_bytes": None,
            "ops_per_step": None,
        }

    rows = [row("naive", 1, 10, 11), row("naive", 2, 20, 21), row("naive", 4, 40, 90)]
    lines = headline_table({"rows": rows, "fits": fits_by_label(rows)})
    table = "\n".join(lines)
    assert "| 10.5 | 20.5 | 65.0* |" in table
    assert "Cells marked * varied widely" in table
    calm = headline_table({"rows": rows[:2], "fits": fits_by_label(rows[:2])})
    assert "*" not in "\n".join(calm) and "†" not in "\n".join(calm)
    # One shallow cell timed while the machine was busy: the line through it slopes down.
    upset = [row("naive", 1, 150, 200), row("naive", 2, 55, 60)]
    table = "\n".join(headline_table({"rows": upset, "fits": fits_by_label(upset)}))
    assert "| -117.50 (2 depths: no se)† |" in table
    assert "A layer cannot cost less than nothing" in table


@pytest.mark.png
def test_plots_draw_each_variant_and_its_fitted_line(
    naive_vs_inplace: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each plot has one legend entry per variant, in the registry's names, a point per depth at
    the cell's median, and the variant's fitted line through a + b * n_layer."""
    import matplotlib.figure

    from profiling.plots import MiB, plot_results

    drawn = {}
    save = matplotlib.figure.Figure.savefig

    def keep(fig, path, **kwargs):
        drawn[Path(path).name] = fig.axes[0]
        save(fig, path, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    plot_results(tmp_path, naive_vs_inplace, "setup")
    rows, fits = naive_vs_inplace["rows"], naive_vs_inplace["fits"]
    variants = ["naive", "inplace", "sdpa-math"]
    for name, metric, value, scale in (
        ("step_time_vs_layers.png", "step_ms", lambda r: r["step_ms"]["median"], 1.0),
        ("memory_vs_layers.png", "peak_mem_bytes", lambda r: r["peak_mem_bytes"], 1 / MiB),
    ):
        assert (tmp_path / name).stat().st_size > 0
        ax = drawn[name]
        assert [t.get_text() for t in ax.get_legend().get_texts()] == variants
        fitted = {line.get_gid(): line for line in ax.get_lines() if line.get_gid()}
        assert sorted(fitted) == sorted(f"fit {v}" for v in variants)
        for variant in variants:
            line, fit = fitted[f"fit {variant}"], fits[variant][metric]
            xs, ys = line.get_data()
            assert list(xs) == [1, 3]  # the true depths: only the points shift sideways
            expected = [(fit["intercept"] + fit["slope"] * x) * scale for x in xs]
            assert list(ys) == pytest.approx(expected)
            medians = sorted(
                (r["n_layer"], value(r) * scale) for r in rows if r["variant"] == variant
            )
            points = next(c for c in ax.containers if c.get_label() == variant)
            assert list(points.lines[0].get_ydata()) == pytest.approx([m for _, m in medians])
            assert points.has_yerr == (metric == "step_ms")  # a peak has no p10-p90 to show
        assert list(ax.get_xticks()) == [1, 2, 3]  # the depths measured: no 1.5
    notes = [t.get_text() for t in drawn["step_time_vs_layers.png"].texts]
    assert any("bars: p10 to p90" in t and "dashed: fitted lines" in t for t in notes), notes
    # One depth: no line is fitted, and the note under the plot does not speak of one
    one = {**naive_vs_inplace, "rows": [r for r in rows if r["n_layer"] == 1]}
    one["fits"] = fits_by_label(one["rows"])
    plot_results(tmp_path, one, "setup")
    (note,) = drawn["step_time_vs_layers.png"].texts
    assert "fitted" not in note.get_text() and "points shifted sideways" in note.get_text()


def test_a_variant_keeps_its_colour_from_sweep_to_sweep() -> None:
    """Set side by side, two sweeps' plots show sdpa in one colour whichever variants ran
    with it; compiled, the same colour with squares; a name the registry lacks, the next free."""
    from profiling.plots import styles

    def rows(*cells: tuple[str, bool]) -> list[dict[str, Any]]:
        return [{"variant": v, "compile": c} for v, c in cells]

    full = styles(rows(("naive", False), ("inplace", False), ("sdpa", False), ("sdpa", True)))
    alone = styles(rows(("sdpa", False), ("gone", False)))
    assert alone["sdpa"] == full["sdpa"] == ("C2", "o") and full["sdpa+compile"] == ("C2", "s")
    assert len({colour for colour, _ in full.values()}) == 3
    assert alone["gone"] == (f"C{len(VARIANTS) % 10}", "o")


def test_the_report_shows_only_plots_that_were_drawn(
    naive_vs_inplace: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the sweep runs its report has no plots yet, and says when they come; a Ctrl-C
    while they are drawn leaves a report of the latest rows, showing no PNG that is not there."""
    import profiling.report

    profiling.report.write_report(tmp_path, naive_vs_inplace, plots=False)
    report = (tmp_path / "report.md").read_text()
    assert "![" not in report and "The plots are drawn when the sweep ends" in report

    def interrupted(out: Path, results: dict, setup: str) -> None:
        (out / "step_time_vs_layers.png").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(profiling.report, "plot_results", interrupted)
    later = copy.deepcopy(naive_vs_inplace)  # the sweep's end: MFU against both peak readings
    for row in later["rows"]:
        # Not a fraction of it: on a busy machine a tiny model's MFU and half of it both
        # read 0.0%.
        row["mfu"] = row["mfu"] and 0.987654
    with pytest.raises(KeyboardInterrupt):
        profiling.report.write_report(tmp_path, later, plots=True)
    shown = (tmp_path / "report.md").read_text()
    assert shown == profiling.report._report_md(later, ()) != report  # these rows, no PNG
    monkeypatch.undo()
    profiling.report.write_report(tmp_path, naive_vs_inplace, plots=True)
    report = (tmp_path / "report.md").read_text()
    assert "![step time vs layers](step_time_vs_layers.png)" in report
    assert "![peak memory vs layers](memory_vs_layers.png)" in report


def test_a_disturbed_cell_does_not_squash_the_step_time_plot() -> None:
    """A step ten times the median stretches its p90 bar; the axis keeps to the medians and
    the fitted lines, cutting that bar, when the bar reaches past 1.5x the highest of them."""
    from profiling.plots import axis_top

    medians_and_lines = [32.6, 52.8, 92.7, 166.3]
    assert axis_top(medians_and_lines, [34.1, 54.4, 1017.5, 167.8]) == pytest.approx(191.2, 0.01)
    assert axis_top(medians_and_lines, [34.1, 54.4, 95.0, 167.8]) is None


def share_while_busy(cpu: int | None = None) -> float | None:
    """OtherLoad's share over a second in which another process spins (on `cpu`, if given)."""
    pin = None if cpu is None else lambda: os.sched_setaffinity(0, {cpu})
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin)
    try:
        time.sleep(0.3)  # started
        load = OtherLoad()
        time.sleep(1.0)
        return load.share()
    finally:
        busy.kill()
        busy.wait()


def busy_share(cpu: int) -> float:
    """The share of a second that CPU `cpu` was busy (not idle or waiting for I/O), from
    /proc/stat, without OtherLoad."""

    def times() -> list[int]:
        line = next(
            x for x in Path("/proc/stat").read_text().splitlines() if x.startswith(f"cpu{cpu} ")
        )
        return [int(field) for field in line.split()[1:]]

    before = times()
    time.sleep(1.0)
    delta = [b - a for a, b in zip(before, times(), strict=True)]
    idle = delta[3] + delta[4]  # idle, iowait
    return 1 - idle / max(sum(delta[:8]), 1)  # guest times are within user's


def test_other_load_sees_another_busy_process() -> None:
    """The report's 'other processes used X% of the CPUs' comes from here."""
    if not OtherLoad().linux:
        pytest.skip("no /proc/stat here")
    share = share_while_busy()
    cores = len(OtherLoad().cpus or range(os.cpu_count() or 1))  # those it counts
    assert share is not None and share > 0.6 / cores  # one busy process: about 1/cores


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs to pin to",
)
def test_other_load_counts_only_the_cpus_this_process_may_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a container given some of the host's CPUs (cpuset, taskset), load on the others is
    not this run's neighbour, and load on its own is not diluted by them."""
    mine, other = sorted(os.sched_getaffinity(0))[:2]
    stat = Path("/proc/stat")
    if not stat.exists() or f"\ncpu{other} " not in stat.read_text():
        pytest.skip("/proc/stat does not list this machine's CPUs one by one")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {mine})
    # A spinner on this process's one CPU fills it; one on the other CPU adds nothing. (Counted
    # over every CPU, both would read about 1/2, plus whatever else runs.) Whatever else runs
    # on this CPU reads as load too, so a busy machine gets three tries.
    readings = []
    for _ in range(3):
        on_mine, on_other = share_while_busy(mine), share_while_busy(other)
        readings.append((on_mine, on_other))
        if on_mine > 0.7 and on_mine - on_other > 0.3:
            break
    else:
        # Other work that fills this CPU by itself (a second test run, a training job) leaves
        # nothing to tell apart: then that is said, not a failure of the count. Read from
        # /proc/stat directly, so a count that reads high by mistake still fails.
        if (quiet := busy_share(mine)) > 0.5:
            pytest.skip(f"other processes kept CPU {mine} {quiet:.0%} busy: nothing to tell")
        pytest.fail(f"(share with a spinner on this CPU, on the other): {readings}")


def test_other_load_counts_only_inside_its_windows() -> None:
    """A sweep counts other processes' share in its timed rounds, not while it compiles."""
    load = OtherLoad(running=False)
    if not load.linux:
        pytest.skip("no /proc/stat here")
    assert load.share() is None  # no window yet
    with load.counting():
        time.sleep(0.05)
    first = load.share()
    assert first is not None
    time.sleep(0.3)  # outside every window: nothing changes
    assert load.share() == first
    with load.counting():
        time.sleep(0.05)
    # The two windows' wall time, without the 0.3 s between them (a loose upper bound: a
    # busy machine may wake a sleeper late)
    assert 0.1 <= load._closed[2] < 0.4


def test_a_failed_cell_leaves_the_report_honest(naive_vs_inplace: dict) -> None:
    """The report's interval matches the sweep's depths; a cell that failed its backend check
    shows no memory figure, its variant's saving is fitted over the depths both measured
    (and says so), and a line through two points claims no r²."""
    from profiling.report import _interval_text, _report_md

    report = _report_md(naive_vs_inplace)
    assert "1 with 3 depths, as here: a 95% interval is ± 12.7 se" in report
    assert "the depths both measured" not in report
    two = [timed_row("naive", n, 10.0 * n) for n in (1, 2)]
    assert "none with 2 depths" in _interval_text(two)
    assert "fits no line" in _interval_text(two[:1])

    results = copy.deepcopy(naive_vs_inplace)
    failed = next(r for r in results["rows"] if r["variant"] == "sdpa-math" and r["n_layer"] == 3)
    failed.update(status="failed", reason="backend check", step_ms=None, tokens_per_s=None)
    assert failed["peak_mem_bytes"]
    results["fits"] = fits_by_label(results["rows"])
    report = _report_md(results)
    headline = next(line for line in report.splitlines() if line.startswith("| sdpa-math |"))
    assert headline.endswith("| – |"), headline
    assert "`sdpa-math` against naive at L1,2 only, the depths both measured." in report
    assert "| sdpa-math | step_ms |" in report and "| – (2 depths) |" in report


def test_a_projection_through_a_noisy_cell_is_marked(naive_vs_inplace: dict) -> None:
    """The 12/24/48-layer projections extrapolate far: one fitted through a cell that varied
    widely (marked * in the headline) is marked too, its baseline's noise included."""
    from profiling.report import _report_md

    def projection(report: str, name: str) -> str:
        section = report.split("## Projected savings")[1].split("## Every cell")[0]
        return next(line for line in section.splitlines() if line.startswith(f"| {name}"))

    results = copy.deepcopy(naive_vs_inplace)
    for r in results["rows"]:  # the tiny sweep's cells, calm
        if r["step_ms"]:
            r["step_ms"] = {**r["step_ms"], "p90": r["step_ms"]["p10"]}
    report = _report_md(results)
    assert projection(report, "inplace").startswith("| inplace | ")
    assert "fitted through cells marked *" not in report
    cell = next(r for r in results["rows"] if r["variant"] == "naive" and r["n_layer"] == 3)
    cell["step_ms"] = {**cell["step_ms"], "p90": 3 * cell["step_ms"]["p10"]}
    report = _report_md(results)
    for name in ("inplace", "sdpa-math"):  # naive's noise is in every saving against it
        assert projection(report, name).startswith(f"| {name}* | ")
    assert "fitted through cells marked * in the headline" in report


def test_the_report_points_only_to_traces_and_compile_times_it_has(
    naive_vs_inplace: dict,
) -> None:
    """An eager sweep's report does not explain compile times; one without traces does not
    send the reader to traces/, and one traced at some depths names them."""
    from profiling.report import _report_md

    report = _report_md(naive_vs_inplace)
    assert "Open a trace from `traces/` in" in report
    assert "**Compile time**" not in report  # the fixture's cells are all eager
    results = copy.deepcopy(naive_vs_inplace)
    for r in results["rows"]:
        if r["n_layer"] != 2:
            r["trace"] = None
    assert "Open a trace from `traces/` (cells at L2 only) in" in _report_md(results)
    for r in results["rows"]:
        r["trace"] = None
    report = _report_md(results)  # traces asked for, and none written: every cell failed, say
    assert "No cell of this sweep wrote a trace." in report and "traces/" not in report
    results["meta"]["traces"] = False
    report = _report_md(results)
    assert "This sweep wrote no traces (`--no-traces`)." in report and "traces/" not in report
    del results["meta"]["traces"]  # a sweep from before meta said: its command does
    results["meta"]["command"] += " --no-traces"
    assert "This sweep wrote no traces (`--no-traces`)." in _report_md(results)
    results["rows"][0]["compile"] = True
    assert "**Compile time**: for `+compile` cells" in _report_md(results)


def test_the_report_states_the_method_its_sweep_used(naive_vs_inplace: dict) -> None:
    """A sweep made before the balanced orders, before buffers counted as resident memory,
    or before ops and kernels were placed by the operator around them, is still described as
    it was measured."""
    from profiling.report import _report_md

    assert naive_vs_inplace["meta"]["round_order"] == "balanced"
    report = _report_md(naive_vs_inplace)
    assert "balanced Latin square" in report
    assert "parameters, buffers and optimizer state resident" in report
    assert "the category of the outermost operator around it" in report
    older = copy.deepcopy(naive_vs_inplace)
    del older["meta"]["round_order"], older["meta"]["resident"]
    del older["meta"]["time_categories"]
    report = _report_md(older)
    assert "each round starting one later" in report and "Latin" not in report
    assert "parameters and optimizer state resident" in report
    assert "By the op's name" in report and "outermost" not in report
    # A sweep from before an op calling itself again counted once says its counts are high:
    # under autocast loudly, where the findings are, as every wrapped op doubled.
    assert "counted twice" not in report and "is the same call, counted once" in report
    del older["meta"]["op_calls"]
    assert "counted twice an op whose overload calls another" in _report_md(older)
    bf16 = copy.deepcopy(naive_vs_inplace)
    bf16["meta"]["autocast"] = True
    assert "twice per call" not in _report_md(bf16)
    del bf16["meta"]["op_calls"]
    findings = _report_md(bf16).split("## Findings")[1].split("##")[0]
    assert "counted an op autocast wraps twice per call" in findings


def test_report_details_follow_the_cells_that_measured() -> None:
    """Degrees of freedom count the depths that measured; a compiled saving fitted over fewer
    depths names the baseline it is against, naive+compile."""
    from profiling.analysis import baselines
    from profiling.report import _interval_text
    from profiling.tables import _fewer_depths

    def oom(row: dict) -> dict:
        return {**row, "status": "oom", "step_ms": None}

    rows = [
        timed_row(v, n, 10.0 + k * n, True)
        for v, k in (("naive", 5), ("sdpa", 3))
        for n in (1, 2, 4, 8)
    ]
    all_oom_at_8 = [oom(r) if r["n_layer"] == 8 else r for r in rows]
    assert _interval_text(all_oom_at_8).startswith("1 with 3 depths")
    sdpa_oom_at_8 = [oom(r) if r["n_layer"] == 8 and r["variant"] == "sdpa" else r for r in rows]
    assert "failed at some" not in _interval_text(all_oom_at_8)
    # The sweep's 4 depths give 2 degrees of freedom; sdpa's fit and saving have 1.
    interval = _interval_text(sdpa_oom_at_8)
    assert interval.startswith("2 with 4 depths")
    assert interval.endswith(
        "fewer for a fit or saving that lacks a depth, as a failed cell leaves it"
    )
    notes = _fewer_depths(savings(sdpa_oom_at_8), [1, 2, 4, 8], baselines(sdpa_oom_at_8))
    assert notes[-1].endswith(
        "`sdpa+compile` against naive+compile at L1,2,4 only, the depths both measured: "
        "a 95% interval is ± 12.7 se."
    )


def test_resident_memory_counts_the_causal_mask_naive_holds() -> None:
    """Peak memory's resident part: parameters, optimizer state, and buffers, the one place
    naive and inplace hold more than the SDPA variants (a block_size^2 bool mask)."""
    from model import GPT, GPTConfig
    from profiling.measure import resident_bytes

    config = GPTConfig(vocab_size=64, block_size=48, n_layer=1, n_head=2, n_embd=16)

    def resident(attention: str) -> int:
        model = GPT(dataclasses.replace(config, attention=attention))
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.zeros(1, 8, dtype=torch.long))[0].sum().backward()
        optimizer.step()
        return resident_bytes(model, optimizer)

    tensors = list(GPT(config).parameters())  # 16: lm_head shares the embedding's
    weights = 4 * sum(p.numel() for p in tensors)
    # Weights and AdamW's two moments, in fp32, and its 4-byte step count per tensor.
    assert resident("sdpa") == 3 * weights + 4 * len(tensors)
    assert resident("naive") - resident("sdpa") == 48 * 48


def test_the_trace_warning_goes_by_the_size_a_viewer_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Traces are gzipped (about 14x smaller); the warning weighs the JSON a viewer unzips."""
    import gzip

    import profiling.sweep

    monkeypatch.setattr(profiling.sweep, "TRACE_WARN_BYTES", 10**5)
    assert sweep(tmp_path, "--variants", "naive", "--layers", "1")[0] == 0
    (trace,) = (tmp_path / "sweep" / "traces").glob("*.json.gz")
    assert trace.stat().st_size < 10**5 < len(gzip.decompress(trace.read_bytes()))
    err = capsys.readouterr().err
    assert f"warning: trace {trace} is" in err and "--trace-stacks" not in err
    # With Python stacks, the largest part of a trace: leaving them out is named too
    assert (
        sweep(tmp_path, "--variants", "naive", "--layers", "1", "--trace-stacks", name="s")[0] == 0
    )
    assert "lower --profile-steps or the model size, or leave out --trace-stacks" in (
        capsys.readouterr().err
    )


def test_python_stacks_only_where_a_trace_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--trace-stacks slows the profiled step (the Python tracer): only cells whose trace is
    kept pay for it."""
    import profiling.sweep

    asked = []
    real = profiling.sweep.profiled_steps

    def recording(device, active, trace_path, with_stack=False):
        asked.append((trace_path is not None, with_stack))
        return real(device, active, trace_path, with_stack)

    monkeypatch.setattr(profiling.sweep, "profiled_steps", recording)
    args = ("--variants", "naive", "--layers", "1,2", "--trace-layers", "1", "--trace-stacks")
    assert sweep(tmp_path, *args)[0] == 0
    assert sorted(asked) == [(False, False), (True, True)]


def test_a_sweep_records_the_code_that_measured_it(naive_vs_inplace: dict) -> None:
    """The git commit (as checkpoints record it), so a result can be traced to its code."""
    from checkpoint import provenance
    from profiling.report import _report_md

    meta = naive_vs_inplace["meta"]
    assert meta["commit"] == provenance()["commit"]
    with_commit = {**naive_vs_inplace, "meta": {**meta, "commit": "0123456789ab-dirty"}}
    assert "code at commit 0123456789ab-dirty)" in _report_md(with_commit)
    without = {**naive_vs_inplace, "meta": {**meta, "commit": None}}
    assert "code at commit" not in _report_md(without)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it would run the whole check")
def test_a_gpu_check_without_cuda_says_so_and_touches_nothing(tmp_path: Path) -> None:
    """A warm machine keeps OUT between calls: a rerun moves the earlier run aside, whole,
    rather than have the sweeps refuse the folder and the log overwritten. Without CUDA, as
    here, the check stops first, with one line that says why, and moves or makes nothing."""
    out = tmp_path / "gc"
    out.mkdir()
    (out / "gpu_check.log").write_text("the earlier run's log")
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"error: no CUDA GPU for {sys.executable} here (torch missing, a CPU build, or no GPU); "
        "PYTHON=... picks another python"
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["gc"]
    assert (out / "gpu_check.log").read_text() == "the earlier run's log"


def test_a_gpu_check_counts_a_sweep_stopped_on_its_way_out_only_if_it_finished(
    tmp_path: Path,
) -> None:
    """Inductor's compile workers can hold a finished sweep's process past its time limit:
    gpu_check.sh counts it as done where results.json says it finished (meta.finished_at,
    written after every other file), and as stopped otherwise."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    function = script[script.index("sweep_status() {") :]
    function = function[: function.index("\n}\n") + 3]
    for name, meta in (("finished", {"finished_at": "2026-11-30T22:00:00+00:00"}), ("cut", {})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"meta": meta, "rows": []}))
    calls = [(d, rc) for d in ("finished", "cut", "missing") for rc in (0, 1, 124, 137)]
    body = "".join(f'echo "$(sweep_status {tmp_path / d} {rc} 2>/dev/null)"\n' for d, rc in calls)
    done = subprocess.run(
        ["bash", "-c", function + body],
        env={**os.environ, "PY": sys.executable},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    got = dict(zip(calls, map(int, done.stdout.split()), strict=True))
    assert got == {(d, rc): 0 if d == "finished" and rc in (124, 137) else rc for d, rc in calls}


def test_the_one_page_op_diff_shows_the_hidden_copy(
    run_script: Callable[..., tuple[int, str, str]],
) -> None:
    """scripts/op_diff.py, the profiler's core in one page: inplace against naive is one
    aten::clone fewer per layer, in the forward, and nothing changes in the optimizer."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "op_diff.py"), "--layers", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "USDT" not in done.stderr  # libkineto's lines, silenced as in profile_train.py
    # A against B, as --diff A,B: the default, inplace,naive, reads as inplace's change
    assert done.stdout.splitlines()[0].endswith("inplace against naive: naive's count -> inplace's")
    changed = {tuple(line.split()[:2]): line.split()[-1] for line in done.stdout.splitlines()[1:]}
    assert changed[("forward", "aten::clone")] == "-3"
    assert changed[("forward", "aten::masked_fill")] == "-3"
    assert not any(region != "forward" for region, _ in changed)
    status, _, err = run_script("op_diff", "--variants", "naive,sdpa-cudnn")
    assert status == 2 and "'sdpa-cudnn' cannot run on cpu" in err


def test_peak_memory_off_cpu_and_cuda_is_not_measured() -> None:
    """MPS keeps no allocator peak, and the profiler's allocation events are the CPU's: its
    cells record no peak rather than the parameters alone, which read alike for every variant."""
    from profiling.measure import peak_memory

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    step = lambda: None
    assert peak_memory(model, optimizer, step, torch.device("mps"), cpu_transient=123) is None
    assert peak_memory(model, optimizer, step, torch.device("cpu"), cpu_transient=123) > 123


def test_where_the_time_goes_on_mps_says_it_is_host_time() -> None:
    """On MPS the profiler records the CPU side only: the split is the host's queueing time."""
    from profiling.method import METHOD, where_time_goes_intro

    meta = {"time_categories": METHOD["time_categories"], "profile_steps": 1}
    assert not any("MPS" in line for line in where_time_goes_intro({**meta, "device": "cpu"}))
    assert "not the GPU's time" in where_time_goes_intro({**meta, "device": "mps"})[-1]


def test_op_diff_script_refuses_one_variant_twice_and_says_when_nothing_differs(
    run_script: Callable[..., tuple[int, str, str]],
) -> None:
    """scripts/op_diff.py: naive,naive is an error, as --diff's is; two variants whose steps
    run the same ops (sdpa picks flash here) say so rather than print a bare header."""
    status, _, err = run_script("op_diff", "--variants", "naive,naive")
    assert status == 2 and "two different variants" in err, err
    status, out, err = run_script("op_diff", "--variants", "sdpa,sdpa-flash", "--layers", "1")
    assert status == 0, err
    assert "no op count differs" in out


def test_after_profiler_script_times_steps_around_each_session(
    run_script: Callable[..., tuple[int, str, str]],
) -> None:
    """scripts/after_profiler.py, the check behind profiling.md's "a depth's timed steps run
    after the previous depth's profiled steps": each session's steps timed before and after it,
    on the model and step a cell uses; a bad count or config is a one-line error."""
    tiny = str(ROOT / "configs" / "tiny.toml")
    status, out, err = run_script(
        "after_profiler", "--config", tiny, "--steps", "2", "--sessions", "2"
    )
    assert status == 0, err
    head, *sessions = out.splitlines()
    assert head.startswith("sdpa, n_layer=2, B=") and "median of 2 steps" in head
    assert [s.split(":")[0] for s in sessions] == ["session 1", "session 2"]
    for line in sessions:
        timing = re.fullmatch(r"session \d: ([\d.]+) ms per step before, ([\d.]+) after", line)
        assert timing and float(timing[1]) > 0 and float(timing[2]) > 0, line
    for bad, named in [
        (["--steps", "0"], "--steps=0: must be >= 1"),
        (["--model.attention=sdpa-flsh"], "sdpa-flsh"),
        (["--model.attention=sdpa-cudnn"], "'sdpa-cudnn' cannot run on cpu"),
        (["--train.dtype=tf32"], "train.dtype='tf32'"),
        (["--data.name=nosuch"], "no prepared corpus at data/nosuch/"),
    ]:
        status, _, err = run_script("after_profiler", "--config", tiny, *bad)
        assert status == 2 and named in err and "Traceback" not in err, err


def test_after_profiler_script_stops_quietly_when_its_reader_goes(
    run_script: Callable[..., tuple[int, str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`after_profiler.py | head -1` ends at the next line, as the shell's SIGPIPE status,
    with no traceback; on a full disk, status 2 and why. (Both were tracebacks.)"""
    tiny = str(ROOT / "configs" / "tiny.toml")
    args = ("after_profiler", "--config", tiny, "--steps", "1", "--sessions", "3")
    head = ReaderTakesLines(1, BrokenPipeError(errno.EPIPE, "Broken pipe"))
    monkeypatch.setattr(sys, "stdout", head)
    status, _, err = run_script(*args)
    assert status == 128 + signal.SIGPIPE and err == "", err
    assert head.getvalue().startswith("sdpa, n_layer=2") and head.getvalue().count("\n") == 1
    monkeypatch.setattr(sys, "stdout", FullDisk())
    status, _, err = run_script(*args)
    assert status == 2 and "error: cannot write to stdout (No space left on device)" in err, err


def test_a_running_sweep_holds_its_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second sweep racing for the same --out is refused, not let replace the first one's
    rows; --report and --compare on a sweep still running say so, rather than call it
    stopped and redraw its files under it. The lock goes when the sweep ends."""
    from rundir import sweep_lock

    rc, _ = sweep(tmp_path, "--variants", "naive", "--layers", "1", "--no-traces")
    assert rc == 0 and not (tmp_path / "sweep" / ".lock").exists()
    running = tmp_path / "sweep"
    other = shutil.copytree(running, tmp_path / "other")
    with sweep_lock(running):
        refused = pytest.raises(ConfigError, match=r"another sweep \(pid \d+\) is writing there")
        with refused, sweep_lock(running):
            pass
        for flag in (["--report", str(running)], ["--compare", str(other), str(running)]):
            assert profile_train.main(flag) == 2
            assert "is still writing there" in capsys.readouterr().err
    assert profile_train.main(["--report", str(running)]) == 0
