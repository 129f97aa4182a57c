"""results.json -> summary.txt, report.md and the two plots. Pure rendering: no measuring.
What both files open with (the machine, setup, peak, command, warnings) is header.py's."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from profiling.analysis import BASELINE, PROJECT_AT, baselines, label, savings
from profiling.findings import findings, where_time_goes
from profiling.header import peak_dtype, report_header, setup_line, summary_header
from profiling.method import (
    KERNEL_LABELS,
    METHOD,
    PROFILE_WAIT,
    PROFILE_WARMUP,
    causal_note,
    collection_lines,
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
from profiling.plots import PLOTS, plot_results
from profiling.tables import (
    cell_table,
    compile_gain,
    fits_table,
    headline_table,
    noisy,
    paired_deepest,
    paired_table,
    projected,
    t95,
)
from training.checkpoint import write_atomically


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
        text = f"{n - 2} with {n} depths, as here: a 95% interval is ± {t95(n - 2):.1f} se"
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


def write_report(
    out: Path,
    results: dict[str, Any],
    plots: bool = True,
    data_files: dict[str, str] | None = None,
) -> None:
    """summary.txt, report.md, the `data_files` given (name: text) and, with `plots`, the PNGs.
    Every text is made before any file is written, and each file replaced whole: rows the
    report cannot read (a results.json edited by hand) leave the files as they were."""
    meta, rows = results["meta"], results["rows"]
    if not rows:
        for name, text in (data_files or {}).items():
            replace_file(out / name, text)
        return
    not_run = _not_run(rows)
    summary = [
        *summary_header(meta, rows),
        *headline_table(results),
        *paired_deepest(rows),
        *(["", "Failed or did not run:", *not_run] if not_run else []),
    ]

    def report() -> str:  # showing the plots there are: none while the sweep runs
        return _report_md(results, tuple(name for name in PLOTS if (out / name).is_file()))

    # Before the plots are drawn, and again after: an interruption or a failure while drawing
    # them leaves a report of these rows that shows no PNG it does not have.
    texts = (data_files or {}) | {"summary.txt": "\n".join(summary) + "\n", "report.md": report()}
    for name, text in texts.items():
        replace_file(out / name, text)
    if plots:
        plot_results(out, results, setup_line(results["meta"]))
        replace_file(out / "report.md", report())


def replace_file(path: Path, text: str) -> None:
    """`path` replaced whole (write_atomically): a reader never sees half a file, and a failed
    write (a full disk) names the file and leaves the one there before (unless only the flush
    after the rename failed: then the new one is there)."""
    write_atomically(path, lambda f: f.write(text.encode("utf-8")))  # the CSV's \r\n as made


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
    found = findings(rows)
    fitted = any(results["fits"].values())  # a fit needs two depths or more
    return "\n".join(
        [
            *report_header(meta, rows),
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
            *(
                ["", "The plots leave out the cells that failed or did not run (listed below)."]
                if plots and problems
                else []
            ),
            "",
            *(["## What compiling buys", "", *gain, ""] if (gain := compile_gain(rows)) else []),
            "## Findings: what each variant changes, per layer per step",
            "",
            *([f"> {doubled}", ""] if meta.get("autocast") and doubled else []),
            *(found or [f"- (needs `{BASELINE}` and at least one other variant in the sweep)"]),
            "",
            "## Where the time goes",
            "",
            *where_time_goes_intro(meta),
            "",
            *where_time_goes(rows, meta.get("profile_steps", 1)),
            "",
            *(
                [
                    f"## Saving per step at each depth, paired by round (against {BASELINE}; "
                    f"`+compile` rows: against {BASELINE}+compile)",
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
            *cell_table(rows),
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
            *(
                fits_table(results["fits"])
                if fitted
                else ["(none: a fit needs two depths or more)"]
            ),
            "",
            *_method(meta, rows),
            "",
            "## How to read it",
            "",
            (
                "The slope column is what one more layer costs per training step. A variant's "
                "saving per layer, multiplied by depth and by steps, is what the change buys "
                "over a training run. "
                if fitted
                else ""
            )
            + "Ops per layer count dispatcher calls (a rough proxy for launch overhead on "
            "GPUs)"
            + ("; the findings above say which ops a variant adds or removes. " if found else ". ")
            + _traces_text(meta, rows),
            "",
        ]
    )


def _projections(rows: list[dict[str, Any]]) -> list[str]:
    """The savings against naive projected to PROJECT_AT layers, from the fitted lines; those
    fitted through a noisy cell (marked * in the headline) are marked too."""
    saved = savings(rows)
    reference_of = baselines(rows)
    noisy_cells = {  # (label, n_layer) of the cells marked *
        (label(r["variant"], r["compile"]), r["n_layer"])
        for r in rows
        if r["step_ms"] and noisy(r["step_ms"])
    }
    shaky = {  # projections whose lines were fitted through one
        name
        for name, s in saved.items()
        if any((x, n) in noisy_cells for x in (name, reference_of[name]) for n in s["depths"])
    }
    lines = [
        f"| {name}{'*' if name in shaky else ''} | "
        + " | ".join(projected(s["projected"][str(n)]) for n in PROJECT_AT)
        + " |"
        for name, s in saved.items()
    ]
    if not lines:
        table = [f"(needs `{BASELINE}` and another variant measured at two depths or more)"]
    else:
        table = [
            "| variant | " + " | ".join(f"at {n} layers" for n in PROJECT_AT) + " |",
            "|---|" + "---|" * len(PROJECT_AT),
            *lines,
        ]
        if shaky:
            table += [
                "",
                "\\* fitted through cells marked * in the headline (they varied "
                "widely while timed): less certain than shown.",
            ]
    return [
        f"## Projected savings against {BASELINE} (`+compile` rows: against {BASELINE}+compile; "
        "from the fitted lines)",
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
        "- **Step**: `training.step.train_step`, the step train.py runs, imported: "
        f"{_step_parts(meta)} over one global batch. Batches are drawn before timing and cycled.",
        "- **Step time**: no profiler attached; warm-up steps excluded; the device synchronised "
        "before and after each step"
        + serialised_text(meta)
        + "; the variants of one depth run interleaved round by round, so machine drift "
        "hits all alike, "
        + round_order_text(meta, rows)
        + ". Median with 10th/90th percentiles over the timed steps (linear interpolation, "
        "numpy's default rule).",
        *(_compile_time_lines(meta, rows) if any(r["compile"] for r in rows) else []),
        *host_memory_lines(meta, rows),
        *collection_lines(rows),
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
        "allocation events in the profiled step; tensor bytes, not the process's RSS"
        + ("; on MPS not measured (no allocator peak)." if meta["device"] == "mps" else "."),
        "- **FLOPs and MFU**: `torch.utils.flop_counter` over one eager `naive` step at each depth"
        + flop_count_text(meta)
        + " (matmul-class ops; attention counted over the full T×T, not halved for causality). "
        "All variants compute the same function, so they share that count. MFU = FLOPs / median "
        "step time / matmul peak, the peak measured on the spot with square matmuls in "
        + (
            f"{peak_dtype(meta)} (see the matmul peak above)"
            if "peak_dtype" in meta
            else "the run's dtype"
        )
        + " by every path PyTorch offers here (`torch.mm`, i.e. the BLAS; on CPUs also "
        "oneDNN), the fastest taken." + causal_note(rows),
        "- **Backend check**: every pinned SDPA cell's trace must contain its backend's ATen op "
        "(and, on CUDA, a kernel whose name matches the flash, efficient or cuDNN backend's; "
        "the math backend's ops launch generic kernels, so its op alone is checked); otherwise "
        "the cell is marked failed.",
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
        "graphs Inductor then found in its on-disk cache, from an earlier depth or run"
        + (
            " (and, on CPU, built none of their C++ kernels again)"
            if meta.get("compile_cache") == METHOD["compile_cache"]
            else ""
        )
        + ": its time is mostly that tracing, not a compile from scratch."
        + reused_text(rows)
        + startup_text(meta)
    ]


def _traces_text(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """Where the sweep's traces are, or that it wrote none, and why where that is known."""
    missing = "".join(
        f" No trace of {label(r['variant'], r['compile'])} at L{r['n_layer']}: {r['trace_error']}."
        for r in rows
        if r.get("trace_error")  # a trace asked for that could not be written
    )
    traced = sorted({r["n_layer"] for r in rows if r.get("trace")})
    if not traced:
        asked = meta.get("traces", "--no-traces" not in meta["command"])  # older: the command
        if not asked:
            return "This sweep wrote no traces (`--no-traces`)."
        return "No cell of this sweep wrote a trace." + missing
    depths = {r["n_layer"] for r in rows}
    where = "" if set(traced) == depths else f" (cells at L{','.join(map(str, traced))} only)"
    return (
        f"Open a trace from `traces/`{where} in https://ui.perfetto.dev or chrome://tracing."
        + missing
    )
