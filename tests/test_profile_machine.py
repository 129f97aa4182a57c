"""What a sweep records of the machine during its timed steps: allocator calls, page faults,
collections, other processes' load."""

from __future__ import annotations

import copy
import csv
import gc
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from profiling.analysis import fits_by_label
from profiling.sweep import Sweep
from profiling.tables import headline_table
from sweeps import sweep
from training.host import OtherLoad

# The stand-ins of sweeps.py, for every test here.
pytestmark = pytest.mark.usefixtures("quick_peak", "flops_counted_once", "plots_unrendered")


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


def test_the_report_warns_when_the_peaks_readings_drift_apart(
    naive_vs_inplace: dict, tmp_path: Path
) -> None:
    """The peak read at the start and at the end of a sweep: a few percent apart on a quiet
    machine; further apart, the machine's speed changed under the sweep, and MFU's base with it."""
    from profiling.report import write_report

    results = copy.deepcopy(naive_vs_inplace)
    meta = results["meta"]
    for start, end, warned in [(150e9, 160e9, False), (88.4e9, 148.6e9, True), (90e9, 60e9, True)]:
        meta |= {"peak_flops_start": start, "peak_flops_end": end, "peak_flops": max(start, end)}
        write_report(tmp_path, results, plots=False)
        for name in ("summary.txt", "report.md"):
            said = (tmp_path / name).read_text()
            assert ("**Warning**: the matmul peak read" in said) == warned, (start, end)
    assert "read 90.0 GFLOP/s at the start and 60.0 GFLOP/s at the end, 1.50× apart" in said
    del meta["peak_flops_end"]  # a sweep stopped before its end reading: one reading, no drift
    write_report(tmp_path, results, plots=False)
    assert "**Warning**: the matmul peak" not in (tmp_path / "report.md").read_text()


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


def busy_share(cpu: int, during: Callable[[], object] = lambda: time.sleep(1.0)) -> float:
    """The share of the time `during()` takes (a second's sleep) that CPU `cpu` was busy (not
    idle or waiting for I/O), from /proc/stat, without OtherLoad."""

    def times() -> list[int]:
        line = next(
            x for x in Path("/proc/stat").read_text().splitlines() if x.startswith(f"cpu{cpu} ")
        )
        return [int(field) for field in line.split()[1:]]

    before = times()
    during()
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
        on_mine, on_other = share_while_busy(mine), []
        # How busy this CPU was while the spinner ran on the other, from /proc/stat directly
        filled = busy_share(mine, lambda got=on_other: got.append(share_while_busy(other)))
        readings.append((on_mine, on_other[0], filled))
        if on_mine > 0.7 and on_mine - on_other[0] > 0.3:
            break
    else:
        # Other work that kept this CPU busy by itself while the spinner ran elsewhere (a second
        # test run, a training job) leaves nothing to tell apart: then that is said, not a
        # failure of the count; a count that reads high by mistake, on a CPU that was not busy,
        # still fails.
        if all(filled > 0.5 for *_, filled in readings):
            pytest.skip(f"other processes kept CPU {mine} busy: nothing to tell ({readings})")
        pytest.fail(
            f"(share with a spinner on this CPU, on the other; this CPU busy meanwhile): {readings}"
        )


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


def test_host_memory_kept_where_malloc_cannot_be_tuned_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--host-memory keep (the default) on a C library whose malloc refuses the tuning: the
    sweep records release, what it then measures, and says so instead of doing it silently."""
    import profiling.sweep
    from profiling.sweep import SweepOptions
    from training.config import load_config

    monkeypatch.setattr(profiling.sweep, "keep_freed_host_memory", lambda: False)
    config_file = Path(__file__).resolve().parents[1] / "configs" / "profile.toml"
    options = SweepOptions(
        config_file=config_file,
        out=tmp_path / "sweep",
        data="synthetic",
        steps=None,
        warmup=1,
        profile_steps=1,
        peak_seconds=0.02,
        traces=False,
        trace_layers=frozenset(),
        trace_stacks=False,
        compile=None,
        host_memory="keep",
    )
    swept = Sweep(load_config(config_file), options)
    assert swept.meta["host_memory"] == "release" and swept.meta["heap_reserve_bytes"] is None
    assert "--host-memory keep: this C library's malloc cannot be tuned" in capsys.readouterr().err
