"""report.md and the plots: what they say, and only what the sweep measured."""

from __future__ import annotations

import copy
import gzip
import json
import shutil
import statistics
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import pytest

import profile_train
from model import VARIANTS
from profiling.analysis import fits_by_label, savings
from profiling.results import results_problem
from sweeps import ROOT, split_row, sweep, timed_row

# The stand-ins of sweeps.py, for every test here.
pytestmark = pytest.mark.usefixtures("quick_peak", "flops_counted_once", "plots_unrendered")


def test_every_published_results_json_passes_the_check() -> None:
    """The check reads the sweeps written before its fields were added, as the report does."""
    published = sorted(Path(__file__).parent.parent.glob("docs/results/**/results.json"))
    assert len(published) >= 11
    for path in published:
        assert results_problem(json.loads(path.read_text())) is None, path


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


def test_report_rerender_and_diff(
    naive_vs_inplace: dict,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A copy: re-rendered here, its plots are stand-ins, and the session's sweep stays as made.
    out = str(shutil.copytree(naive_vs_inplace["meta"]["out"], tmp_path / "sweep"))
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
    step_line = "- **Step**: `training.step.train_step`, the step train.py runs, imported: forward, backward, "
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


def test_where_the_time_goes_shows_the_time_outside_the_operators() -> None:
    """Operators' self time leaves out Python and the autograd engine: the report gives the
    remainder to the timed median; where the operators exceed it (the profiled step ran
    slower), it says so, and the shares are of the profiled step, never over 100%."""
    from profiling.findings import where_time_goes

    naive = {"mkldnn::_linear_pointwise": 40.0, "aten::bmm": 30.0, "aten::gelu": 20.0}
    sdpa = {"mkldnn::_linear_pointwise": 40.0, "aten::_scaled_dot_product_flash_attention": 30.0}
    rows = [
        split_row("naive", 100.0, naive),
        split_row("sdpa", 60.0, sdpa, compile=True),
    ]
    naive_line, sdpa_line, *note = where_time_goes(rows)
    assert "timed median 100.0 ms, the base of the percentages." in naive_line
    assert "90.0 ms: linear layers 40.0 ms (40%), attention 30.0 ms (30%), everything" in naive_line
    assert "outside the operators +10.0 ms (10%)" in naive_line and "exceeds" not in naive_line
    # Operators' 70 ms against a 60 ms median: the profiled step is the base, not the median.
    assert "timed median 60.0 ms. " in sdpa_line
    assert "linear layers 40.0 ms (57%), attention 30.0 ms (43%)" in sdpa_line
    assert "70.0 ms: " in sdpa_line and "outside the operators -" not in sdpa_line
    assert "10.0 ms more than the timed median: the profiled step ran slower" in sdpa_line
    assert "the percentages are of the operators' time in it" in sdpa_line
    assert "their time is in none of the categories" in sdpa_line
    assert "Inductor's fused kernels are not ATen operators" in sdpa_line
    assert "Inductor" not in naive_line
    assert "predates these categories" in note[-1]  # no stored split in these rows
    naive_of_three, sdpa_of_three, *_ = where_time_goes(rows, profile_steps=3)
    assert "Operators' self time per profiled step 90.0 ms" in naive_of_three
    assert "the profiled steps ran slower than the timed ones" in sdpa_of_three

    # A stored split over every op is used as is, in ms of the listed total.
    stored = {"linear layers": 0.5, "attention": 0.25, "everything else": 0.25}
    [line] = where_time_goes([split_row("naive", 100.0, naive, time_split=stored)])
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
    # (a sweep under load may add a second note, that some p90 bars run past the top)
    (note,) = [t for t in drawn["step_time_vs_layers.png"].texts if "p90 bars" not in t.get_text()]
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


def test_the_trace_warning_goes_by_the_size_a_viewer_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Traces are gzipped (about 14x smaller); the warning weighs the JSON a viewer unzips."""

    import profiling.cell_profile

    monkeypatch.setattr(profiling.cell_profile, "TRACE_WARN_BYTES", 10**5)
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
    import profiling.cell_profile

    asked = []
    real = profiling.cell_profile.profiled_steps

    def recording(device, active, trace_path, with_stack=False):
        asked.append((trace_path is not None, with_stack))
        return real(device, active, trace_path, with_stack)

    monkeypatch.setattr(profiling.cell_profile, "profiled_steps", recording)
    args = ("--variants", "naive", "--layers", "1,2", "--trace-layers", "1", "--trace-stacks")
    assert sweep(tmp_path, *args)[0] == 0
    assert sorted(asked) == [(False, False), (True, True)]


def test_a_sweep_records_the_code_that_measured_it(naive_vs_inplace: dict) -> None:
    """The git commit (as checkpoints record it), so a result can be traced to its code."""
    from profiling.report import _report_md
    from training.checkpoint import provenance

    meta = naive_vs_inplace["meta"]
    assert meta["commit"] == provenance()["commit"]
    with_commit = {**naive_vs_inplace, "meta": {**meta, "commit": "0123456789ab-dirty"}}
    assert "code at commit 0123456789ab-dirty)" in _report_md(with_commit)
    without = {**naive_vs_inplace, "meta": {**meta, "commit": None}}
    assert "code at commit" not in _report_md(without)


def test_where_the_time_goes_on_mps_says_it_is_host_time() -> None:
    """On MPS the profiler records the CPU side only: the split is the host's queueing time."""
    from profiling.method import METHOD, where_time_goes_intro

    meta = {"time_categories": METHOD["time_categories"], "profile_steps": 1}
    assert not any("MPS" in line for line in where_time_goes_intro({**meta, "device": "cpu"}))
    assert "not the GPU's time" in where_time_goes_intro({**meta, "device": "mps"})[-1]


def test_the_fits_table_reads_in_each_metrics_unit() -> None:
    """Step time in ms, memory in MiB (not 2.758e+07 bytes), counts of ops and kernels (whole
    where exact), never in e-notation; an se that rounds to 0 but is not reads <0.01, as in
    the headline."""
    from profiling.tables import fits_table

    def fit(slope: float, intercept: float, se: float | None, r2: float = 1.0) -> dict:
        return {"slope": slope, "intercept": intercept, "r2": r2, "slope_se": se, "points": 4}

    fits = {
        "naive": {
            "peak_mem_bytes": fit(27_577_344.0, 72_830_000.0, 0.0),
            "step_ms": fit(19.031, 13.71, 0.2149, 0.9998),
            "ops_per_step.forward": fit(127.0, 60.0, None) | {"points": 2},
            "kernels_per_step.total": fit(99.29, 86.34, 0.08),
        },
        "sdpa": {
            "step_ms": fit(-0.001, 14.31, 0.004),
            "ops_per_step.total": fit(123456.0, 7.0, 456.0),
        },
    }
    table = "\n".join(fits_table(fits))
    assert "| naive | peak_mem_bytes | MiB | 26.30 | 0.00 | 69.46 | 1.0000 |" in table
    assert "| naive | step_ms | ms | 19.03 | 0.21 | 13.71 | 0.9998 |" in table
    assert "| naive | ops_per_step.forward | ops | 127 | – | 60 | – (2 depths) |" in table
    assert "| naive | kernels_per_step.total | kernels | 99.29 | 0.08 | 86.34 | 1.0000 |" in table
    assert "| sdpa | step_ms | ms | 0.00 | <0.01 | 14.31 | 1.0000 |" in table  # not -0.00
    assert "| sdpa | ops_per_step.total | ops | 123,456 | 456 | 7 | 1.0000 |" in table
