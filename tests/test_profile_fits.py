"""The statistics of a report: fits over depth, savings paired by round, projections and their
errors."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

from profiling.analysis import fit_line, fits_by_label, median_interval, paired_savings, savings
from profiling.tables import headline_table, paired_deepest, paired_table, t95
from sweeps import timed_row

# The stand-ins of sweeps.py, for every test here.
pytestmark = pytest.mark.usefixtures("quick_peak", "flops_counted_once", "plots_unrendered")


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


def test_a_sweep_without_step_times_says_why_it_has_no_paired_savings() -> None:
    """Sweeps made before rows kept their timed steps: the section says why it is empty,
    where a sweep with no pair to take (no naive beside another variant) has none at all."""
    rows = [timed_row(v, n, 10.0 * n) for v in ("naive", "sdpa") for n in (1, 2)]
    assert "keep no per-step times" in "\n".join(paired_table(rows))
    assert paired_table([r for r in rows if r["variant"] == "sdpa"]) == []
    for row in rows:
        row["times_ms"] = [row["step_ms"]["median"]] * 6
    assert "keep no per-step times" not in "\n".join(paired_table(rows))


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


@pytest.mark.parametrize(
    ("dof", "t"),
    [(10, 2.2281), (11, 2.2010), (12, 2.1788), (20, 2.0860), (30, 2.0423), (120, 1.9799)],
)
def test_t95_beyond_its_table_is_students_t(dof: int, t: float) -> None:
    """A sweep over 13 depths or more leaves the table (dof > 10) for the expansion; 10, the
    table's last entry, is where it meets it."""
    assert t95(dof) == pytest.approx(t, abs=0.0002)


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
    assert "(n=N)" not in paired  # 6 rounds: each has its interval
    for r in rows:
        r["times_ms"] = r["times_ms"][:4]
    (paired,) = [line for line in paired_deepest(rows) if "paired by round" in line]
    assert "; (n=N): too few rounds for an interval, 6 at least;" in paired
    for r in rows:
        r["times_ms"] = [r["step_ms"]["median"]] * 6
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
    # A tiny sweep's MFU: not "0.2% MFU instead of 0.2%"
    note = causal_note([row | {"mfu": 0.0021}])
    assert "would read 0.19% MFU instead of 0.21%" in note
    from profiling.analysis import mfu_text  # the tables' and findings' MFU too

    assert [mfu_text(x) for x in (0.45, 0.01, 0.0021, None)] == ["45.0%", "1.0%", "0.21%", "–"]
