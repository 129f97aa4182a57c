"""results.json -> summary.txt, report.md and the two plots. Pure rendering: no measuring."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from profiling.analysis import (
    PROJECT_AT,
    REGIONS,
    baselines,
    cells_done,
    label,
    labels,
    measured_saving,
    ok_rows,
    paired_savings,
    savings,
)
from profiling.findings import findings, where_time_goes
from profiling.method import (
    KERNEL_LABELS,
    METHOD,
    PROFILE_WAIT,
    PROFILE_WARMUP,
    causal_note,
    compile_mark,
    device_memory_lines,
    doubled_ops,
    eager_excess_text,
    flop_count_text,
    host_memory_lines,
    one_call_text,
    reused_text,
    round_order_text,
    serialised_text,
    startup_text,
    unattributed_lines,
    where_time_goes_intro,
)
from profiling.plots import PLOTS, MiB, plot_results

NOISY_SPREAD = 1.25  # p90/p10 of a cell's step times above which its headline cell gets a *


def _rate_unit(flops: float) -> tuple[float, str]:
    """The divisor and unit a matmul rate reads best in: a CPU's GFLOP/s, a GPU's TFLOP/s."""
    return (1e12, "TFLOP/s") if flops >= 1e13 else (1e9, "GFLOP/s")


def rate_text(flops: float, unit_of: float | None = None) -> str:
    """'483.8 GFLOP/s', '700.0 TFLOP/s'; in the unit `unit_of` reads best in, if given (rates
    shown side by side share one)."""
    scale, unit = _rate_unit(flops if unit_of is None else unit_of)
    return f"{flops / scale:.1f} {unit}"


def _peak_readings(meta: dict[str, Any]) -> str:
    scale, unit = _rate_unit(meta["peak_flops"])
    start = meta.get("peak_flops_start", meta["peak_flops"]) / scale
    if "peak_flops_end" not in meta:
        return (
            f"{start:.1f} {unit}, measured at the start only: the sweep stopped before the end "
            "reading, whose higher value a whole sweep divides by. One reading taken while "
            "something else ran reads low, and every MFU here high: compare it with a whole "
            "sweep's peak on this machine"
        )
    end = meta["peak_flops_end"] / scale
    return (
        f"{start:.1f} / {end:.1f} {unit}, measured at the start and end of the sweep, higher used"
    )


def _completeness(meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """A line saying the sweep stopped early, if it did."""
    planned, done = meta.get("cells_planned"), cells_done(rows)
    if planned is None or done >= planned:
        return []
    timed = len(rows) - done
    also = f"; {timed} more were timed, not profiled (status interrupted)" if timed else ""
    return [
        f"**Incomplete sweep**: {done} of {planned} cells were measured before it stopped{also}.",
        "",
    ]


def _compiled_while_timed(rows: list[dict[str, Any]]) -> list[str]:
    """A warning naming the cells whose timed steps compiled something (a recompile)."""
    cells = [
        f"{label(r['variant'], r['compile'])} L{r['n_layer']} "
        f"({r['compiles_while_timed']} of {r['step_ms']['n']})"
        for r in rows
        if r.get("compiles_while_timed") and r.get("step_ms")
    ]
    if not cells:
        return []
    return [
        f"**Warning**: timed steps compiled something (a recompile: a guard failed, a shape "
        f"was made dynamic) in {', '.join(cells)}; those steps' times are in the figures, and "
        "the p90 above all shows them.",
        "",
    ]


def _steps(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


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


def _projected(p: dict[str, float | None]) -> str:
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


def headline_table(results: dict[str, Any]) -> list[str]:
    """One line per variant: step time by depth, per-layer cost, and savings against naive:
    the fitted one per layer, and the one measured at the deepest depth."""
    rows, fits = results["rows"], results["fits"]
    layers = sorted({r["n_layer"] for r in rows})
    saved = savings(rows)
    reference_of = baselines(rows)
    by = {(label(r["variant"], r["compile"]), r["n_layer"]): r for r in rows}
    kernels = any(r.get("kernels_per_step") for r in rows)  # CUDA: the post counted kernels
    head = (
        ["variant"]
        + [f"ms @L{n}" for n in layers]
        + [
            "ms/layer (±se)",
            "saving/layer vs naive",
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
                cells.append(_fmt(r["step_ms"]["median"]) + ("*" if _noisy(r["step_ms"]) else ""))
            else:
                cells.append((r or {}).get("status", "–"))
        step_fit = fits.get(name, {}).get("step_ms")
        cells.append(
            _pm(step_fit["slope"], step_fit["slope_se"]) + "†" * (step_fit["slope"] < 0)
            if step_fit
            else "–"
        )
        s = saved.get(name)
        cells.append(_pm(s["per_layer"], s["per_layer_se"], "+.2f", " ms") if s else "–")
        cells.append(_measured_saving(rows, name, reference_of[name], layers[-1]))
        last = by.get((name, layers[-1]))
        cells.append(
            _fmt(last["mfu"] * 100 if last and last["mfu"] else None, ".1f")
            + ("%" if last and last["mfu"] else "")
        )
        for kind in ["ops_per_step"] + ["kernels_per_step"] * kernels:
            count_fit = fits.get(name, {}).get(f"{kind}.total")
            cells.append(_fmt(count_fit["slope"] if count_fit else None, ".0f"))
        measured = last and last["status"] == "ok" and last["peak_mem_bytes"]
        cells.append(_fmt(last["peak_mem_bytes"] / MiB if measured else None))
        lines.append("| " + " | ".join(cells) + " |")
    lines += _fewer_depths(saved, layers, baselines(rows))
    if any(r["compile"] for r in rows):
        lines += ["", "`+compile` rows are compared with `naive+compile`, like against like."]
    if any(f.get("step_ms", {}).get("slope", 0) < 0 for f in fits.values()):
        lines += [
            "",
            "† A layer cannot cost less than nothing: a cell of that variant was disturbed "
            "while timed, most likely one of its shallower ones. Rerun to check.",
        ]
    if any(r["step_ms"] and _noisy(r["step_ms"]) for r in rows):
        lines += [
            "",
            f"Cells marked * varied widely while timed (p90/p10 above {NOISY_SPREAD}): the "
            "machine was likely busy, so their medians and the fits through them are less "
            "certain. Rerun to check.",
        ]
    return lines


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
            f": a 95% interval is ± {_t95(len(s['depths']) - 2):.1f} se."
            if len(s["depths"]) > 2
            else "."
        )
        for name, s in saved.items()
        if s["depths"] != layers
    ]
    return ["", "Savings, like against like: " + " ".join(notes)] if notes else []


def _t95(dof: int) -> float:
    """Student's t quantile for a two-sided 95% interval: tabled to 10 degrees of freedom,
    then the Cornish-Fisher expansion around the normal's (off by 0.002 at most there)."""
    table = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
    if dof <= len(table):
        return table[dof - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)


def _interval_text(rows: list[dict[str, Any]]) -> str:
    """How wide a 95% interval is, in standard errors, at this sweep's number of depths, and
    whether some fits have fewer."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("step_ms")]
    n = len({r["n_layer"] for r in ok})
    if n == 0:
        return "no cell measured, as here, fits no line"
    if n == 1:
        return "one depth, as here, fits no line"
    if n == 2:
        text = "none with 2 depths, as here: a line through two points leaves no residual"
    else:
        text = f"{n - 2} with {n} depths, as here: a 95% interval is ± {_t95(n - 2):.1f} se"
    per_label: dict[str, set[int]] = defaultdict(set)
    for r in ok:
        per_label[label(r["variant"], r["compile"])].add(r["n_layer"])
    if n > 2 and any(len(depths) < n for depths in per_label.values()):
        text += "; fewer for a fit or saving that lacks a depth, as a failed cell leaves it"
    return text


def _not_run(rows: list[dict[str, Any]], bold: bool = False) -> list[str]:
    """One line per label and reason for the cells that failed or did not run, their depths
    together."""
    depths: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        if r["status"] != "ok":
            key = (label(r["variant"], r["compile"]), f"{r['status']}: {r['reason']}")
            depths.setdefault(key, []).append(str(r["n_layer"]))
    mark = "**" if bold else ""
    return [f"- {mark}{name}{mark} @L{','.join(ns)}: {why}" for (name, why), ns in depths.items()]


def _failures_log(meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """Where the failed cells' tracebacks are, for a sweep that kept them."""
    if not meta.get("failures_log") or not any(r["status"] == "failed" for r in rows):
        return []
    return ["", f"Each failed cell's traceback is in `{meta['failures_log']}`."]


def _noisy(step_ms: dict[str, float]) -> bool:
    return step_ms["p90"] > NOISY_SPREAD * step_ms["p10"]


def _setup_line(meta: dict[str, Any]) -> str:
    m, t = meta["config"]["model"], meta["config"]["train"]
    return (
        f"B={t['batch_size']}x{t['grad_accum']} T={m['block_size']} C={m['n_embd']} "
        f"H={m['n_head']} V={m['vocab_size']} {meta['dtype']}"
        f"{' autocast' if meta.get('autocast') else ''}, data: {meta['data']}"
        f"{', nn.Linear through oneDNN' if meta.get('linear') == 'oneDNN' else ''}"
    )


def _peak_paths(meta: dict[str, Any]) -> str:
    """'; best of each path: torch.mm 212.0, oneDNN 477.0 GFLOP/s', where several were timed."""
    paths = meta.get("peak_flops_by_path") or {}
    if len(paths) < 2:
        return ""
    scale, unit = _rate_unit(max(paths.values()))
    rates = ", ".join(f"{name} {rate / scale:.1f}" for name, rate in paths.items())
    return f"; best of each path: {rates} {unit}"


def _machine_line(meta: dict[str, Any]) -> str:
    extra = f", CUDA {meta['cuda']}" if meta.get("cuda") else ""
    other = meta.get("other_cpu_share")
    load = (
        ""
        if other is None
        else f"; other processes used {other:.0%} of the CPUs {_while(meta, 'meanwhile')}"
    )
    return (
        f"{meta['device']} ({meta['device_name']}), {meta['cpu_count']} logical CPUs, "
        f"{meta['torch_threads']} torch threads, torch {meta['torch_version']}{extra}, "
        f"Python {meta['python']}, {meta['platform']}{load}"
    )


def _commit_text(meta: dict[str, Any]) -> str:
    """', code at commit 1a2b3c4d5e6f': which code measured, where the sweep knew it."""
    return f", code at commit {meta['commit']}" if meta.get("commit") else ""


BUSY_SHARE = 0.10  # other processes' share of the CPUs above which the report warns


def _busy_warning(meta: dict[str, Any]) -> list[str]:
    other = meta.get("other_cpu_share")
    if other is None or other <= BUSY_SHARE:
        return []
    return [
        f"**Warning**: other processes used {other:.0%} of the CPUs "
        f"{_while(meta, 'during this sweep')}; its "
        "times are slower and noisier than this machine's. Rerun on a quiet machine.",
        "",
    ]


def _while(meta: dict[str, Any], before: str) -> str:
    """When other processes' share of the CPUs was counted; `before` for sweeps that counted
    it over the whole sweep, compiling and profiling too."""
    if meta.get("other_cpu_window") == METHOD["other_cpu_window"]:
        return "during the timed steps"
    return before


def write_report(out: Path, results: dict[str, Any], plots: bool = True) -> None:
    meta, rows = results["meta"], results["rows"]
    if not rows:
        return
    not_run = _not_run(rows)
    scale, unit = _rate_unit(meta["peak_flops"])
    summary = [
        "Full training steps (forward + backward + AdamW), median step time in ms",
        f"machine: {_machine_line(meta)}",
        f"setup:   {_setup_line(meta)}",
        f"peak:    {meta['peak_flops'] / scale:.1f} {unit} {meta['dtype']} matmul, "
        "measured on the spot"
        f"{_peak_paths(meta)}",
        f"command: {meta['command']}{_commit_text(meta)}",
        "",
        *_completeness(meta, rows),
        *_busy_warning(meta),
        *_compiled_while_timed(rows),
        *headline_table(results),
        *_paired_deepest(rows),
        *(["", "Failed or did not run:", *not_run] if not_run else []),
    ]
    (out / "summary.txt").write_text("\n".join(summary) + "\n", encoding="utf-8")

    def report() -> None:  # showing the plots there are: none while the sweep runs
        drawn = tuple(name for name in PLOTS if (out / name).is_file())
        (out / "report.md").write_text(_report_md(results, drawn), encoding="utf-8")

    # Before the plots are drawn, and again after: an interruption or a failure while drawing
    # them leaves a report of these rows that shows no PNG it does not have.
    report()
    if plots:
        plot_results(out, results, _setup_line(results["meta"]))
        report()


def _cell_table(rows: list[dict[str, Any]]) -> list[str]:
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
                    _fmt(r["mfu"] * 100 if r["mfu"] else None) + "%" * bool(r["mfu"]),
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


def _paired_deepest(rows: list[dict[str, Any]]) -> list[str]:
    """The summary's line of paired savings at the deepest depth, where the sweep has them."""
    paired = paired_savings(rows)
    deepest = max((n for by_layer in paired.values() for n in by_layer), default=None)
    at = [(name, by_layer[deepest]) for name, by_layer in paired.items() if deepest in by_layer]
    if not at:
        return []
    return [
        "",
        f"Saving per step at L{deepest} against naive, paired by round (ms, median [95% "
        "interval]; report.md has every depth):",
        *(f"  {name}: {_paired_text(s)}" for name, s in at),
    ]


def paired_table(rows: list[dict[str, Any]]) -> list[str]:
    """The saving at each depth from the round-by-round pairs (analysis.paired_savings), with
    its interval; [] for a sweep without them (no naive, or one that recorded no times_ms)."""
    paired = paired_savings(rows)
    if not paired:
        return []
    layers = sorted({n for by_layer in paired.values() for n in by_layer})

    def cell(s: dict[str, Any] | None) -> str:
        return "–" if s is None else _paired_text(s)

    return [
        "Each round of a depth's timed steps runs every cell once, so the reference's step less "
        "the variant's in the same round is one paired difference, free of any drift slower than "
        "a round. The median over the rounds, in ms per step, with a 95% interval for it from the "
        "order statistics (it assumes nothing about how the times spread; under 6 rounds give "
        "none). An interval that excludes 0 is a saving measured in this run; the ms/layer "
        "columns above are fitted across depths.",
        "",
        "| variant | " + " | ".join(f"L{n}" for n in layers) + " |",
        "|---|" + "---|" * len(layers),
        *(
            f"| {name} | " + " | ".join(cell(by_layer.get(n)) for n in layers) + " |"
            for name, by_layer in paired.items()
        ),
    ]


def _fits_table(fits: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    lines = [
        "| variant | metric | slope (per layer) | ± se | intercept | r² |",
        "|---|---|---|---|---|---|",
    ]
    for name, by_metric in fits.items():
        for metric, f in sorted(by_metric.items()):
            r2 = f"{f['r2']:.4f}" if f.get("points", 3) > 2 else "– (2 depths)"
            lines.append(
                f"| {name} | {metric} | {f['slope']:.4g} | {_fmt(f['slope_se'], '.2g')} | "
                f"{f['intercept']:.4g} | {r2} |"
            )
    return lines


def _step_parts(meta: dict[str, Any]) -> str:
    """What the timed step does, as the sweep's config has it."""
    tc = meta["config"]["train"]
    clip = (
        f"gradient clipping (norm {tc['grad_clip']:g}) and " if tc.get("grad_clip", 0) > 0 else ""
    )
    decay = " without weight decay" if tc.get("weight_decay", 0) == 0 else ""
    return f"forward, backward, {clip}a fused AdamW step{decay}"


def _report_md(results: dict[str, Any], plots: tuple[str, ...] = tuple(PLOTS)) -> str:
    """The report; `plots` are the PNGs it shows, those drawn."""
    meta, rows = results["meta"], results["rows"]
    doubled = doubled_ops(meta)  # a caveat for sweeps that counted re-dispatched ops twice
    problems = _not_run(rows, bold=True)
    return "\n".join(
        [
            *_header(meta, rows),
            "",
            "## Headline",
            "",
            *headline_table(results),
            "",
            *(
                [f"![{PLOTS[name]}]({name})" for name in plots]
                or [
                    "(The plots are drawn when the sweep ends; "
                    "`python profile_train.py --report DIR` draws them for one that did not.)"
                ]
            ),
            "",
            *(["## What compiling buys", "", *gain, ""] if (gain := compile_gain(rows)) else []),
            "## Findings: what each variant changes, per layer per step",
            "",
            *([f"> {doubled}", ""] if meta.get("autocast") and doubled else []),
            *(findings(rows) or ["- (needs `naive` and at least one other variant in the sweep)"]),
            "",
            "## Where the time goes",
            "",
            *where_time_goes_intro(meta),
            "",
            *where_time_goes(rows),
            "",
            *(
                [
                    "## Saving per step at each depth, paired by round (against naive; "
                    "`+compile` rows: against naive+compile)",
                    "",
                    *paired,
                    "",
                ]
                if (paired := paired_table(rows))
                else []
            ),
            *_projections(rows),
            "",
            "## Every cell",
            "",
            *_cell_table(rows),
            "",
            *(
                [
                    "## Cells that failed or did not run",
                    "",
                    *problems,
                    *_failures_log(meta, rows),
                    "",
                ]
                if problems
                else []
            ),
            "## Fits: metric = intercept + slope × n_layer",
            "",
            *_fits_table(results["fits"]),
            "",
            *_method(meta, rows),
            "",
            "## How to read it",
            "",
            "The slope column is what one more layer costs per training step. A variant's saving "
            "per layer, multiplied by depth and by steps, is what the change buys over a training "
            "run. Ops per layer count dispatcher calls (a rough proxy for launch overhead on "
            "GPUs); the op diff above says which ops a variant adds or removes. "
            + _traces_text(meta, rows),
            "",
        ]
    )


def _header(meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """The title, warnings about the sweep as a whole, and where and how it ran."""
    return [
        "# Training-step profile by attention variant and depth",
        "",
        *_completeness(meta, rows),
        *_busy_warning(meta),
        *_compiled_while_timed(rows),
        f"- **Machine**: {_machine_line(meta)}",
        f"- **Setup**: {_setup_line(meta)}; {_steps(meta['steps'], 'timed step')} per cell "
        f"after {_steps(meta['warmup'], 'warm-up step')}",
        f"- **Matmul peak** ({meta['dtype']}): {_peak_readings(meta)}{_peak_paths(meta)}",
        f"- **Command**: `{meta['command']}` "
        f"(config `{meta['config_file']}`{_commit_text(meta)}), started {meta['started_at']}",
    ]


def _projections(rows: list[dict[str, Any]]) -> list[str]:
    """The savings against naive projected to PROJECT_AT layers, from the fitted lines; those
    fitted through a noisy cell (marked * in the headline) are marked too."""
    saved = savings(rows)
    reference_of = baselines(rows)
    noisy = {  # (label, n_layer) of the cells marked *
        (label(r["variant"], r["compile"]), r["n_layer"])
        for r in rows
        if r["step_ms"] and _noisy(r["step_ms"])
    }
    shaky = {  # projections whose lines were fitted through one
        name
        for name, s in saved.items()
        if any((x, n) in noisy for x in (name, reference_of[name]) for n in s["depths"])
    }
    projected = [
        f"| {name}{'*' if name in shaky else ''} | "
        + " | ".join(_projected(s["projected"][str(n)]) for n in PROJECT_AT)
        + " |"
        for name, s in saved.items()
    ]
    if not projected:
        table = ["(needs `naive` and another variant measured at two depths or more)"]
    else:
        table = [
            "| variant | " + " | ".join(f"at {n} layers" for n in PROJECT_AT) + " |",
            "|---|" + "---|" * len(PROJECT_AT),
            *projected,
        ]
        if shaky:
            table += [
                "",
                "\\* fitted through cells marked * in the headline (they varied "
                "widely while timed): less certain than shown.",
            ]
    return [
        "## Projected savings against naive (`+compile` rows: against naive+compile; from "
        "the fitted lines)",
        "",
        "± the standard error of the fitted line of per-depth differences at that depth. It says "
        "how well the line is pinned down there, not whether a layer's cost stays the same "
        "that far beyond the depths measured.",
        "",
        *table,
    ]


def _method(meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """How this sweep measured: the step, its time, ops and kernels, memory, FLOPs and MFU,
    the backend check and the fits, as the code that ran it did."""
    return [
        "## How this was measured",
        "",
        f"- **Step**: `train.train_step`, imported from train.py: {_step_parts(meta)} over one "
        "global batch. Batches are drawn before timing and cycled.",
        "- **Step time**: no profiler attached; warm-up steps excluded; the device synchronised "
        "before and after each step"
        + serialised_text(meta)
        + "; the variants of one depth run interleaved round by round, so machine drift "
        "hits all alike, "
        + round_order_text(meta, rows)
        + ". Median with 10th/90th percentiles over the timed steps.",
        *(_compile_time_lines(meta, rows) if any(r["compile"] for r in rows) else []),
        *host_memory_lines(meta, rows),
        *device_memory_lines(rows),
        "- **Ops and kernels**: separate steps under torch.profiler with a "
        f"wait={PROFILE_WAIT}/warmup={PROFILE_WARMUP}/active schedule; "
        "ATen ops (and the oneDNN linear's `cpu_linear::linear`/`mkldnn::_linear_pointwise`) "
        "counted (nested calls included, so `aten::masked_fill` and the `aten::clone` it makes "
        "both count) by the `record_function` region their start falls in; CUDA kernels (and "
        "memcpy/memset) by the region of the runtime call that launched them, matched by "
        "correlation id."
        + one_call_text(meta)
        + (KERNEL_LABELS if any(r.get("kernels_per_step") for r in rows) else ""),
        *unattributed_lines(rows),
        f"- **Peak memory**: {meta.get('resident', 'parameters and optimizer state')} resident "
        "before the step, plus the step's own peak above that: on CUDA from the caching "
        "allocator (`max_memory_allocated`) over one more step, on CPU from the profiler's "
        "allocation events in the profiled step.",
        "- **FLOPs and MFU**: `torch.utils.flop_counter` over one eager `naive` step at each depth"
        + flop_count_text(meta)
        + " (matmul-class ops; attention counted over the full T×T, not halved for causality). "
        "All variants compute the same function, so they share that count. MFU = FLOPs / median "
        "step time / matmul peak, the peak measured on the spot with square matmuls in the run's "
        "dtype by every path PyTorch offers here (`torch.mm`, i.e. the BLAS; on CPUs also "
        "oneDNN), the fastest taken." + causal_note(rows),
        "- **Backend check**: every pinned SDPA cell's trace must contain its backend's ATen op "
        "(and, on CUDA, a kernel whose name matches it); otherwise the cell is marked failed.",
        "- **Fits**: least squares of each metric against n_layer; the slope is the per-layer "
        "cost, ± its standard error, which has n − 2 degrees of freedom for n depths "
        f"({_interval_text(rows)}). "
        "Savings are the difference of slopes against naive (a "
        "`+compile` variant's against `naive+compile`), both fitted over the depths the two "
        "measured, ± the "
        "standard error of the line fitted to the per-depth differences: the variants of a depth "
        "are timed interleaved, so a disturbance they share cancels there. These errors measure "
        "this run's scatter about its lines, not how far another run would land: on a shared "
        "machine, repeat sweeps have differed by more than them, so rerun before trusting a "
        "small saving.",
    ]


def _compile_time_lines(meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    return [
        "- **Compile time**: for `+compile` cells, the first step's time minus the median "
        "step"
        + eager_excess_text(meta)
        + ". Dynamo is reset before each depth, so every compiled cell traces its graphs "
        "anew instead of reusing the last depth's; `(cached)` marks a cell whose compiled "
        "graphs Inductor then found in its on-disk cache, from an earlier depth or run: its "
        "time is mostly that tracing, not a compile from scratch."
        + reused_text(rows)
        + startup_text(meta)
    ]


def _traces_text(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """Where the sweep's traces are, or that it wrote none, and why where that is known."""
    traced = sorted({r["n_layer"] for r in rows if r.get("trace")})
    if not traced:
        asked = meta.get("traces", "--no-traces" not in meta["command"])  # older: the command
        if not asked:
            return "This sweep wrote no traces (`--no-traces`)."
        return "No cell of this sweep wrote a trace."
    depths = {r["n_layer"] for r in rows}
    where = "" if set(traced) == depths else f" (cells at L{','.join(map(str, traced))} only)"
    return f"Open a trace from `traces/`{where} in https://ui.perfetto.dev or chrome://tracing."
