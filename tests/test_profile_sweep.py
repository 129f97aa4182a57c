"""profile_train.py's sweep: its cells, what results.json holds, and the timing design (rounds,
warm-up)."""

from __future__ import annotations

import csv
import dataclasses
import errno
import gzip
import itertools
import json
import os
import shutil
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import profile_train
from model import GPT, attention
from profiling.analysis import op_diff
from profiling.sweep import KEPT_ON_WRONG_BACKEND, Sweep
from sweeps import ROOT, TINY, sweep
from training import probe, runtime
from training.config import load_config

# The stand-ins of sweeps.py, for every test here.
pytestmark = pytest.mark.usefixtures("quick_peak", "flops_counted_once", "plots_unrendered")


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


def test_bfloat16_on_a_cpu_without_bf16_instructions_is_held_to_float32_s_peak(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """There bfloat16's matmul rate is a slow path's, which the model's small matmuls beat
    (MFU read 350%), and oneDNN's bf16 linear raises (it ended such a sweep at its start): the
    peak is float32's, the fastest matmul the CPU has, and the sweep and report say so."""
    import profiling.sweep

    monkeypatch.setattr(runtime, "bf16_matmul_instructions", lambda: False)
    stand_in, dtypes = profiling.sweep.matmul_peaks, []

    def peaks(device: torch.device, dtype: torch.dtype, seconds: float) -> dict[str, float]:
        dtypes.append(dtype)
        return stand_in(device, dtype, seconds)

    monkeypatch.setattr(profiling.sweep, "matmul_peaks", peaks)
    rc, results = sweep(tmp_path, "--variants", "sdpa", "--layers", "1", "--train.dtype=bfloat16")
    assert rc == 0 and results["rows"][0]["status"] == "ok"
    assert dtypes == [torch.float32, torch.float32]  # at the start and the end
    meta = results["meta"]
    assert (meta["dtype"], meta["peak_dtype"]) == ("bfloat16", "float32")
    assert meta["peak_dtype_why"].startswith("this CPU has no bfloat16 matmul instructions")
    assert "warning: train.dtype='bfloat16': this CPU has no bfloat16" in capsys.readouterr().err
    report = (tmp_path / "sweep" / "report.md").read_text()
    assert "- **Matmul peak** (float32): " in report
    assert "; float32's, not bfloat16's: this CPU has no bfloat16 matmul" in report
    assert "square matmuls in float32 (see the matmul peak above)" in report
    assert (
        " float32 matmul, measured on the spot" in (tmp_path / "sweep" / "summary.txt").read_text()
    )
    # Warned once the settings passed their checks: not before a setting that stops the sweep
    rc, _ = sweep(tmp_path, "--train.dtype=bfloat16", "--train.cpu_linear=onednn", name="no")
    err = capsys.readouterr().err
    assert rc == 2 and "error: train.cpu_linear='onednn'" in err and "warning" not in err


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


@pytest.mark.parametrize("fails", ["export", "gzip"])
def test_a_trace_that_cannot_be_written_loses_only_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fails: str
) -> None:
    """On a full disk PyTorch's trace export raises nothing: it leaves a part-written .tmp
    (which would take the space results.json needs) and no trace; or the gzipped copy fails.
    The cell keeps its measurements, what was written of the trace goes, and the sweep says
    which trace is missing."""

    def export_that_fails(self: torch.profiler.profile, path: str) -> None:
        Path(path + ".tmp").write_text('{"traceEvents": [')  # as far as the disk allowed

    def copy_that_fails(src: Any, dst: Any) -> None:
        dst.write(src.read(100))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if fails == "export":
        monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", export_that_fails)
        said = "naive_L1.json: PyTorch's export wrote no file (is the disk full?)"
    else:
        monkeypatch.setattr(shutil, "copyfileobj", copy_that_fails)
        said = "naive_L1.json.gz: No space left on device"
    rc, results = sweep(tmp_path, "--variants", "naive", "--layers", "1")
    assert rc == 0
    (row,) = results["rows"]
    assert row["status"] == "ok" and row["trace"] is None and row["ops_per_step"]["forward"]
    assert not list((tmp_path / "sweep" / "traces").iterdir())
    why = f"could not write the trace {tmp_path / 'sweep' / 'traces' / said}"
    assert f"warning: {why}; " in capsys.readouterr().err
    assert row["trace_error"] == why  # and the report, read later, says it too
    assert f"No trace of naive at L1: {why}." in (tmp_path / "sweep" / "report.md").read_text()


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


def test_a_region_the_profiler_does_not_know_fails_the_cell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ops are counted by the regions training.step.train_step names: one renamed there fails
    the cell, named, rather than counting that region's ops as none."""
    from training import step

    real = step.record_function
    renamed = lambda name: real("optim" if name == "optimizer" else name)
    monkeypatch.setattr(step, "record_function", renamed)
    rc, results = sweep(tmp_path, "--variants", "naive", "--layers", "1")
    assert rc == 1
    [row] = results["rows"]
    assert row["status"] == "failed"
    assert "no ATen ops in the profiled steps' optimizer region" in row["reason"]


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


def test_warm_up_is_left_out_and_the_timed_steps_summarised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
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
    # Two micro-batches of B=2 a step, derived from the global batch (one process: no ranks
    # to divide by); an explicit --train.grad_accum=2 resolves to the same config
    # (test_config.py), so one sweep covers both.
    rc, results = sweep(tmp_path, *args, "--train.global_batch_size=4")
    assert rc == 0
    assert results["meta"]["config"]["train"]["grad_accum"] == 2  # what ran, derived
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
