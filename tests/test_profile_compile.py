"""profile_train.py --compile: the compile time apart from the step time, and the graphs each cell
builds."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from profiling.cells import Cell
from profiling.sweep import Sweep
from sweeps import sweep

# The stand-ins of sweeps.py, for every test here.
pytestmark = pytest.mark.usefixtures("quick_peak", "flops_counted_once", "plots_unrendered")


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
    import profiling.cell_profile

    seconds = record_step_times(monkeypatch)
    marked = []  # compiled blocks' attention calls stay unmarked: swapping would recompile them
    monkeypatch.setattr(profiling.cell_profile, "attention_calls_marked", marked.append)
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


def test_compile_cache_bypass_is_cold() -> None:
    from profiling.cells import compile_cache

    keys = ("fxgraph_cache_miss", "fxgraph_cache_bypass", "fxgraph_cache_hit", "graphs")
    before = dict.fromkeys(keys, 0)
    # one graph from the cache, another the cache passed by: compiled, so cold
    after = {**before, "fxgraph_cache_bypass": 1, "fxgraph_cache_hit": 1, "graphs": 2}
    assert compile_cache(before, after) == "cold"
