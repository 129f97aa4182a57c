"""A sweep when things go wrong (a failing cell, Ctrl-C, a file that cannot be written or read):
what it measured is kept."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import shutil
import signal
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import profile_train
from model import attention
from profiling.sweep import Sweep
from sweeps import ROOT, TINY, sweep
from training.config import ConfigError

# The stand-ins of sweeps.py, for every test here.
pytestmark = pytest.mark.usefixtures("quick_peak", "flops_counted_once", "plots_unrendered")


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
    from training import rundir

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
    # Or a folder above it: mkdir's "File exists" read as another sweep's doing
    below = dangling / "sweep"
    assert profile_train.main(["--variants", "naive", "--layers", "1", "--out", str(below)]) == 2
    err = capsys.readouterr().err
    assert f"--out {below}: {dangling} is a link to {tmp_path / 'gone'}, which does not" in err
    # A file is named as one; a name that is not UTF-8 (the report names the folder) refused
    (tmp_path / "afile").write_text("")
    assert (
        profile_train.main(
            ["--variants", "naive", "--layers", "1", "--out", str(tmp_path / "afile")]
        )
        == 2
    )
    assert f"--out {tmp_path / 'afile'} is a file; give a folder" in capsys.readouterr().err
    os.mkfifo(tmp_path / "pipe")  # as /dev/null: neither
    assert profile_train.main(["--out", str(tmp_path / "pipe")]) == 2
    assert "pipe is neither a file nor a folder; give a new folder" in capsys.readouterr().err
    undecodable = os.fsdecode(bytes(tmp_path / "out") + b"\xff")
    assert profile_train.main(["--variants", "naive", "--layers", "1", "--out", undecodable]) == 2
    assert "not valid UTF-8; give another folder" in capsys.readouterr().err
    assert not Path(undecodable).exists()
    # So is a config file's, which the report names too (it failed writing results.csv)
    config = Path(os.fsdecode(bytes(tmp_path / "c") + b"\xff.toml"))
    shutil.copyfile(ROOT / "configs" / "profile.toml", config)
    argv = ["--config", str(config), "--variants", "naive", "--layers", "1"]
    assert profile_train.main([*argv, "--out", str(tmp_path / "o")]) == 2
    assert "--config" in (err := capsys.readouterr().err) and "not valid UTF-8" in err
    assert not (tmp_path / "o").exists()


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
    assert "The plots leave out the cells that failed or did not run" in report
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


def test_an_incomplete_sweep_counts_its_failed_cells_apart() -> None:
    """A cell that ran out of memory ran to its end, but measured nothing: the report's line
    says so, not that it was measured. A report written between cells (no stopped_at) does
    not say the sweep stopped: it may be running still."""
    from profiling.header import _completeness

    rows = [{"status": "oom"}, {"status": "ok"}, {"status": "interrupted"}]
    stopped = {"cells_planned": 4, "stopped_at": "2026-12-07T20:00:00+00:00"}
    assert _completeness(stopped, rows) == [
        "**Incomplete sweep**: 2 of 4 cells ran to their end before it stopped (1 of them "
        "failed: out of memory, unsupported or an error); 1 more was timed, not profiled "
        "(status interrupted).",
        "",
    ]
    assert _completeness({"cells_planned": 4}, rows[:2]) == [
        "**Incomplete sweep**: 2 of 4 cells have run to their end (1 of them failed: out of "
        "memory, unsupported or an error): the sweep is still running, or was killed before "
        "its end.",
        "",
    ]


def test_a_sweep_stopped_while_profiling_keeps_the_depths_timed_cells(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A depth's cells are all timed, then profiled one by one: a Ctrl-C in between (or
    gpu_check.sh's timeout) keeps the step times of the cells not yet profiled, marked so."""
    import profiling.sweep

    real_profile = profiling.sweep.profile_cell

    def profile_then_interrupt(cell, options, device):
        if cell.n_layer == 2:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises at once; this is never finished
        return real_profile(cell, options, device)

    monkeypatch.setattr(profiling.sweep, "profile_cell", profile_then_interrupt)
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
    assert "**Incomplete sweep**: 2 of 4 cells ran to their end before it stopped; 2 more" in report
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
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
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
    said = f"interrupted; the cells measured so far are in {tmp_path / 'sweep'} (report.md)"
    assert said in capsys.readouterr().err
    assert "finished_at" not in results["meta"]  # what gpu_check.sh tells a whole sweep by
    assert "stopped_at" in results["meta"]
    report = (tmp_path / "sweep" / "report.md").read_text()
    assert "measured at the start only (the sweep stopped first): the end reading" in report
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
    # A folder named results.json: said so, not "no results.json there"
    (tmp_path / "results.json").unlink()
    (tmp_path / "results.json").mkdir()
    assert profile_train.main(["--report", str(tmp_path)]) == 2
    assert f"{tmp_path / 'results.json'} is not a file" in capsys.readouterr().err
    (tmp_path / "results.json").rmdir()
    (tmp_path / "results.json").write_text("{}")
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
        (
            lambda r: r["rows"][2].update(status="weird"),
            'status is "weird", not one of ok, failed, oom, unsupported, interrupted',
        ),
        (
            lambda r: r["rows"][2].update(peak_mem_bytes=math.inf),
            "rows[2] (sdpa-math L1): peak_mem_bytes is Infinity, not a number",
        ),
        (lambda r: r["rows"][1].update(n_layer=0), "rows[1]: n_layer is 0, not a whole number"),
        (lambda r: r["rows"][4]["step_ms"].pop("n"), "rows[4] (inplace L2): step_ms.n is missing"),
        (
            lambda r: r["rows"][0]["ops_per_step"]["forward"].update({"aten::mm": None}),
            "rows[0] (naive L1): ops_per_step.forward.aten::mm is null, not a number",
        ),
        (lambda r: r["rows"].append(r["rows"][4]), "rows[4] and rows[9] (inplace L2) measure the"),
        (lambda r: r["rows"][5]["times_ms"].__setitem__(0, None), "times_ms[0] is null, not a"),
        (
            lambda r: r["rows"][0]["step_ms"].update(median=0),
            "rows[0] (naive L1): step_ms has p10 ",
        ),
        (
            lambda r: r["rows"][1]["step_ms"].update(p90=-1.0),
            "p90 -1.0, not 0 < p10 <= median <= p90",
        ),
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


def test_a_running_sweep_holds_its_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second sweep racing for the same --out is refused, not let replace the first one's
    rows; --report and --compare on a sweep still running say so, rather than call it
    stopped and redraw its files under it. The lock goes when the sweep ends."""
    from training.rundir import sweep_lock

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
            assert "is still writing there; its report.md is redrawn after every cell" in (
                capsys.readouterr().err
            )
    # One that has not finished its first cell has no report.md yet to read
    starting = tmp_path / "starting"
    starting.mkdir()
    with sweep_lock(starting):
        assert profile_train.main(["--report", str(starting)]) == 2
        assert "its report.md comes with its first cell: read that then, or wait" in (
            capsys.readouterr().err
        )
    with sweep_lock(running):
        # A new sweep given its folder: refused as running, not as holding an earlier sweep
        assert sweep(tmp_path, "--variants", "naive", "--layers", "1")[0] == 2
        assert re.search(
            r"--out \S+: a process \(pid \d+\) is writing there now", capsys.readouterr().err
        )
    assert profile_train.main(["--report", str(running)]) == 0


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


def test_a_failure_in_the_profiled_steps_keeps_the_timed_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The profiled steps come after the timed ones: a trace that cannot be written (a full
    disk) fails the cell, and its step times stay in the row."""
    import profiling.cell_profile

    @contextlib.contextmanager
    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")
        yield

    monkeypatch.setattr(profiling.cell_profile, "profiled_steps", full_disk)
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
