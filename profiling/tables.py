"""The report's tables: the headline, every cell, what compiling buys, the savings paired by
round and the fits, and how their numbers are written (± a standard error, one too small to
show, a fit with none, a cell that varied widely while timed). Pure rendering: no measuring."""

from __future__ import annotations

import math
from typing import Any

from profiling.analysis import (
    BASELINE,
    REGIONS,
    baseline_pairs,
    baselines,
    label,
    labels,
    measured_saving,
    mfu_text,
    ok_rows,
    paired_savings,
    savings,
)
from profiling.method import compile_mark
from profiling.plots import MiB

NOISY_SPREAD = 1.25  # p90/p10 of a cell's step times above which its headline cell gets a *


def _se(se: float, decimals: int) -> str:
    """A standard error to `decimals` places; one that rounds to nothing there is '<0.01'
    (not '0.00', which reads as exact); '0' only for an exact fit."""
    if se == 0:
        return "0"
    if round(se, decimals) == 0:
        return f"<{10.0**-decimals:.{decimals}f}"
    return f"{se:.{decimals}f}"


def _pm(value: float, se: float | None, spec: str = ".2f", unit: str = "") -> str:
    """'1.23 ± 0.04 ms', or '1.23 ms (2 depths: no se)' when the fit had no residual to
    estimate it from."""
    if se is None:
        return f"{value:{spec}}{unit} (2 depths: no se)"
    return f"{value:{spec}} ± {_se(se, 2)}{unit}"


def projected(p: dict[str, float | None]) -> str:
    """'+45.5 ± 0.9 ms (+19.8 ± 0.4%)', or, with no standard error (two depths), the numbers
    marked as such: not a bare figure that reads as known."""
    if p["saving"] is None:
        return f"n/a: {p['why_none']}"
    if p["saving_se"] is None:
        return f"{p['saving']:+.1f} ms ({p['percent']:+.1f}%), 2 depths: no se"
    return f"{p['saving']:+.1f} ± {_se(p['saving_se'], 1)} ms ({_projected_percent(p)})"


def _projected_percent(p: dict[str, float | None]) -> str:
    if p["percent"] is None:
        return "n/a"
    if p["percent_se"] is None:
        return f"{p['percent']:+.1f}% (no se)"
    return f"{p['percent']:+.1f} ± {_se(p['percent_se'], 1)}%"


def _fmt(x: float | None, spec: str = ".1f", none: str = "–") -> str:
    return none if x is None else format(x, spec)


def _total(counts: dict[str, dict[str, float]], region: str) -> float:
    return sum(counts.get(region, {}).values())


def noisy(step_ms: dict[str, float]) -> bool:
    return step_ms["p90"] > NOISY_SPREAD * step_ms["p10"]


def t95(dof: int) -> float:
    """Student's t quantile for a two-sided 95% interval: tabled to 10 degrees of freedom,
    then the Cornish-Fisher expansion around the normal's, to 1/dof³ (off by 0.0002 at most
    there)."""
    table = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
    if dof <= len(table):
        return table[dof - 1]
    z = 1.959964
    return (
        z
        + (z**3 + z) / (4 * dof)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * dof**3)
    )


def headline_table(results: dict[str, Any]) -> list[str]:
    """One line per variant: step time by depth, per-layer cost, and savings against naive:
    the fitted one per layer, and the one measured at the deepest depth."""
    rows, fits = results["rows"], results["fits"]
    layers = sorted({r["n_layer"] for r in rows})
    saved = savings(rows)
    reference_of = baselines(rows)
    by = {(label(r["variant"], r["compile"]), r["n_layer"]): r for r in rows}
    kernels = any(r.get("kernels_per_step") for r in rows)  # kernels are counted on CUDA only
    head = (
        ["variant"]
        + [f"ms @L{n}" for n in layers]
        + [
            "ms/layer (±se)",
            f"saving/layer vs {BASELINE}",
            f"saving @L{layers[-1]}, measured",
            f"MFU @L{layers[-1]}",
            "ops/layer",
            *(["kernels/layer"] if kernels else []),
            f"peak MiB @L{layers[-1]}",
        ]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in labels(rows):
        cells = [name]
        for n in layers:
            r = by.get((name, n))
            if r and r["step_ms"]:
                cells.append(
                    _fmt(r["step_ms"]["median"]) + ("*" if noisy(r["step_ms"]) else "") + _not_ok(r)
                )
            else:
                cells.append((r or {}).get("status", "–"))
        step_fit = fits.get(name, {}).get("step_ms")
        cells.append(
            _pm(step_fit["slope"], step_fit["slope_se"]) + ("†" if step_fit["slope"] < 0 else "")
            if step_fit
            else "–"
        )
        s = saved.get(name)
        cells.append(_pm(s["per_layer"], s["per_layer_se"], "+.2f", " ms") if s else "–")
        cells.append(_measured_saving(rows, name, reference_of[name], layers[-1]))
        last = by.get((name, layers[-1]))
        cells.append(mfu_text(last["mfu"] if last else None))
        for kind in ["ops_per_step"] + ["kernels_per_step"] * kernels:
            count_fit = fits.get(name, {}).get(f"{kind}.total")
            cells.append(_fmt(count_fit["slope"] if count_fit else None, ".0f"))
        measured = last and last["status"] == "ok" and last["peak_mem_bytes"]
        cells.append(_fmt(last["peak_mem_bytes"] / MiB if measured else None))
        lines.append("| " + " | ".join(cells) + " |")
    lines += _se_note(fits, saved)
    lines += _fewer_depths(saved, layers, reference_of)
    if not any(r["variant"] == BASELINE for r in ok_rows(rows)):
        lines += [
            "",
            f"No `{BASELINE}` cell measured here: the savings are against it, so they read –.",
        ]
    # Said where it applies: naive+compile measured, and another compiled label set against it
    compiled = {r["variant"] for r in ok_rows(rows) if r["compile"]}
    if BASELINE in compiled and len(compiled) > 1:
        lines += [
            "",
            f"`+compile` rows are compared with `{BASELINE}+compile`, like against like.",
        ]
    if any(f.get("step_ms", {}).get("slope", 0) < 0 for f in fits.values()):
        lines += [
            "",
            "† A layer cannot cost less than nothing: a cell of that variant was disturbed "
            "while timed, most likely one of its shallower ones. Rerun to check.",
        ]
    stopped = sorted({r["status"] for r in rows if r["step_ms"] and r["status"] != "ok"})
    if stopped:
        lines += [
            "",
            f"A time marked ({') or ('.join(stopped)}) was measured before its cell stopped: "
            "shown, but left out of the fits and savings.",
        ]
    if any(r["step_ms"] and noisy(r["step_ms"]) for r in rows):
        lines += [
            "",
            f"Cells marked * varied widely while timed (p90/p10 above {NOISY_SPREAD}): the "
            "machine was likely busy, so their medians"
            + (" and the fits through them" if any(f.get("step_ms") for f in fits.values()) else "")
            + " are less certain. Rerun to check.",
        ]
    return lines


def _se_note(fits: dict[str, dict[str, Any]], saved: dict[str, dict[str, Any]]) -> list[str]:
    """What the headline's ± means: a slope's standard error over as many depths as its fit
    took (those whose cells finished), and the multiplier for a 95% interval at each count."""
    counts = {f["step_ms"]["points"] for f in fits.values() if f.get("step_ms")}
    counts |= {len(s["depths"]) for s in saved.values()}
    counts = sorted((n for n in counts if n > 2), reverse=True)
    if not counts:
        return []
    if len(counts) == 1:
        n = counts[0]
        dof = f"{n - 2} degree{'s' if n > 3 else ''} of freedom"
        return [
            "",
            f"± is one standard error (se) of a line fitted over {n} depths: {dof}, so a 95% "
            f"interval is ± {t95(n - 2):.1f} se.",
        ]
    each = "; ".join(f"over {n} depths, ± {t95(n - 2):.1f} se" for n in counts)
    return [
        "",
        "± is one standard error (se) of a line fitted over the depths whose cells finished; "
        f"a 95% interval is {each}.",
    ]


def _not_ok(row: dict[str, Any]) -> str:
    """' (failed)' after a figure whose cell did not finish, as the fits leave it out."""
    return "" if row["status"] == "ok" else f" ({row['status']})"


def _measured_saving(rows: list[dict[str, Any]], name: str, reference: str, deepest: int) -> str:
    """measured_saving's figure, in ms and % of the reference's step (the depth named where it
    is not the sweep's deepest)."""
    if name == reference:
        return "–"
    found = measured_saving(rows, name, reference)
    if found is None:
        return "–"
    n, saving, ref = found
    where = "" if n == deepest else f" @L{n}"
    return f"{saving:+.1f} ms ({100 * saving / ref:+.0f}%){where}"


def _fewer_depths(
    saved: dict[str, dict[str, Any]], layers: list[int], reference_of: dict[str, str]
) -> list[str]:
    """Which savings were fitted over fewer depths than the sweep's: both lines over the
    depths the variant and its naive have in common."""
    notes = [
        f"`{name}` against {reference_of[name]} at L{','.join(map(str, s['depths']))} only, "
        "the depths both measured"
        + (
            f": a 95% interval is ± {t95(len(s['depths']) - 2):.1f} se."
            if len(s["depths"]) > 2
            else "."
        )
        for name, s in saved.items()
        if s["depths"] != layers
    ]
    return ["", "Savings, like against like: " + " ".join(notes)] if notes else []


def cell_table(rows: list[dict[str, Any]]) -> list[str]:
    head = [
        "variant",
        "L",
        "status",
        "ms median [p10, p90] (n)",
        "tokens/s",
        "MFU",
        "peak MiB",
        "compile s",
        "SDPA backend",
        "ops/step fwd·bwd·opt",
        "kernels/step fwd·bwd·opt",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        t = r["step_ms"]
        regions = lambda c: "·".join(_fmt(_total(c, g), ".0f") for g in REGIONS) if c else "–"
        lines.append(
            "| "
            + " | ".join(
                [
                    label(r["variant"], r["compile"]),
                    str(r["n_layer"]),
                    r["status"],
                    f"{t['median']:.2f} [{t['p10']:.2f}, {t['p90']:.2f}] ({t['n']})" if t else "–",
                    _fmt(r["tokens_per_s"], ",.0f"),
                    mfu_text(r["mfu"]),
                    _fmt(r["peak_mem_bytes"] / MiB if r["peak_mem_bytes"] else None),
                    _fmt(r["compile_s"]) + compile_mark(r),
                    r["backend"] or "–",
                    regions(r["ops_per_step"]),
                    regions(r["kernels_per_step"]),
                ]
            )
            + " |"
        )
    return lines


def compile_gain(rows: list[dict[str, Any]]) -> list[str]:
    """For each variant timed both eager and compiled, at each depth both measured: the two
    medians, the speedup, and the steps whose savings repay the compile time."""
    timed = {(r["variant"], r["compile"], r["n_layer"]): r for r in ok_rows(rows) if r["step_ms"]}
    pairs = [
        (variant, n, eager, timed[(variant, True, n)])
        for (variant, compiled, n), eager in timed.items()
        if not compiled and (variant, True, n) in timed
    ]
    if not pairs:
        return []
    lines = [
        "| variant | n_layer | eager ms | compiled ms | speedup | compile s | steps to repay it |",
        "|---|---|---|---|---|---|---|",
    ]
    order = list(dict.fromkeys(r["variant"] for r in rows))  # as the sweep ran them
    cold = any(c.get("compile_s") is not None and not compile_mark(c) for *_, c in pairs)
    for variant, n, eager, compiled in sorted(pairs, key=lambda p: (order.index(p[0]), p[1])):
        e, c = eager["step_ms"]["median"], compiled["step_ms"]["median"]
        paid = compiled.get("compile_s")
        if paid is None:
            repay = "–"
        elif e <= c:
            repay = "never (no faster)"
        else:
            repay = f"{math.ceil(paid * 1e3 / (e - c)):,}"
        lines.append(
            f"| {variant} | {n} | {e:.1f} | {c:.1f} | {e / c:.2f}× | "
            f"{_fmt(paid)}{compile_mark(compiled)} | {repay} |"
        )
    return [
        *lines,
        "",
        "Speedup: the eager median over the compiled one, timed in the same rounds. Steps to "
        "repay it: the cell's compile time over the time a step saves."
        + (
            " A `(cached)` cell's graphs came from Inductor's on-disk cache (an earlier "
            "depth's blocks, or an earlier run): what a run pays when the cache is warm; a "
            "cold compile takes longer" + (", as in the cells without the mark." if cold else ".")
            if any(compile_mark(c) == " (cached)" for *_, c in pairs)
            else ""
        )
        + (
            " `(shared)`, `(partly shared)` and `(reused)`: see how the compile time was "
            "measured, below."
            if any(compile_mark(c) not in ("", " (cached)") for *_, c in pairs)
            else ""
        ),
    ]


def _paired_text(s: dict[str, Any]) -> str:
    """'+5.64 [+4.17, +8.50]': a paired saving's median and its interval, in ms."""

    def ms(x: float) -> str:
        return f"{round(x, 2) or 0.0:+.2f}"  # a saving that rounds to nothing: +0.00, not -0.00

    if s["interval"] is None:
        return f"{ms(s['median'])} (n={s['n']})"
    low, high = s["interval"]
    return f"{ms(s['median'])} [{ms(low)}, {ms(high)}]"


def paired_deepest(rows: list[dict[str, Any]]) -> list[str]:
    """The summary's line of paired savings at the deepest depth, where the sweep has them."""
    paired = paired_savings(rows)
    deepest = max((n for by_layer in paired.values() for n in by_layer), default=None)
    at = [(name, by_layer[deepest]) for name, by_layer in paired.items() if deepest in by_layer]
    if not at:
        return []
    return [
        "",
        f"Saving per step at L{deepest} against {BASELINE}"
        + (f" (+compile rows: {BASELINE}+compile)" if any("+compile" in n for n, _ in at) else "")
        + ", paired by round (ms, median [95% interval]"
        + (
            "; (n=N): too few rounds for an interval, 6 at least"
            if any(s["interval"] is None for _, s in at)
            else ""
        )
        + "; report.md has every depth):",
        *(f"  {name}: {_paired_text(s)}" for name, s in at),
    ]


def paired_table(rows: list[dict[str, Any]]) -> list[str]:
    """The saving at each depth from the round-by-round pairs (analysis.paired_savings), with
    its interval; [] for a sweep with no pair to take (no naive beside another variant), one
    line for one whose rows keep no `times_ms` to take them from."""
    paired = paired_savings(rows)
    if not paired:
        if baseline_pairs(rows) and not any(r.get("times_ms") for r in ok_rows(rows)):
            return [
                "None: this sweep's rows keep no per-step times (`times_ms`, recorded by sweeps "
                "made since commit 26cc8bc) to pair; the fitted savings above stand."
            ]
        return []
    layers = sorted({n for by_layer in paired.values() for n in by_layer})

    def cell(s: dict[str, Any] | None) -> str:
        return "–" if s is None else _paired_text(s)

    return [
        "Each round of a depth's timed steps runs every cell once, so the reference's step less "
        "the variant's in the same round is one paired difference, free of any drift slower than "
        "a round. The median over the rounds, in ms per step, with a 95% interval for it from the "
        "order statistics (it covers the median at least 95% of the time, more where rounds are "
        "few: from 6 to 8 it spans them all; it assumes nothing about how the times spread, only "
        "that the rounds vary independently; under 6 rounds give none). An interval that "
        "excludes 0 is a saving measured in this run, though of many intervals up to one in "
        "twenty would exclude 0 by chance where there is no saving; the ms/layer columns above "
        "are fitted across depths.",
        "",
        "| variant | " + " | ".join(f"L{n}" for n in layers) + " |",
        "|---|" + "---|" * len(layers),
        *(
            f"| {name} | " + " | ".join(cell(by_layer.get(n)) for n in layers) + " |"
            for name, by_layer in paired.items()
        ),
    ]


# The fits table's unit for a metric and what a JSON value is divided by for it; counts of
# ops and kernels (ops_per_step.forward, ...) go by their own name, undivided.
FIT_UNITS = {"step_ms": ("ms", 1), "peak_mem_bytes": ("MiB", 2**20)}


def _fit_number(x: float, count: bool) -> str:
    """Two decimals (a count that fits exactly, whole), thousands separated, never -0.00."""
    if count and abs(x - round(x)) < 0.005:
        return f"{round(x):,}"
    text = f"{x:,.2f}"
    return text[1:] if text == "-0.00" else text


def fits_table(fits: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    lines = [
        "| variant | metric | unit | slope (per layer) | ± se | intercept | r² |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, by_metric in fits.items():
        for metric, f in sorted(by_metric.items()):
            count = metric not in FIT_UNITS
            unit, scale = FIT_UNITS.get(metric, (metric.partition("_per_step")[0], 1))
            r2 = f"{f['r2']:.4f}" if f.get("points", 3) > 2 else "– (2 depths)"
            if f["slope_se"] is None:
                se = "–"
            else:  # one that rounds to nothing but is not 0 reads <0.01, as in the headline
                x = f["slope_se"] / scale
                se = _fit_number(x, count) if x == 0 or round(x, 2) else _se(x, 2)
            lines.append(
                f"| {name} | {metric} | {unit} | {_fit_number(f['slope'] / scale, count)} | "
                f"{se} | {_fit_number(f['intercept'] / scale, count)} | {r2} |"
            )
    return lines
