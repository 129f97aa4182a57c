"""Several sweeps of one setup side by side: each label's cost and saving per layer in each,
and their median.

One sweep's standard errors say how well its lines fit; they do not say what the machine does
between sweeps (a shared host's slow periods last minutes, longer than a sweep). Rerunning the
same sweep and reading the savings across the runs does.
"""

from __future__ import annotations

import datetime as dt
import statistics
import sys
from pathlib import Path
from typing import Any

from profiling.analysis import (
    BASELINE,
    baselines,
    cells_done,
    fits_by_label,
    labels,
    measured_saving,
    points_by_label,
    savings,
)
from profiling.header import BUSY_SHARE, peak_dtype, rate_text
from profiling.method import METHOD
from profiling.results import cannot_read, load_results
from training.config import ConfigError

# What must be the same for savings to be one quantity, from each sweep's results.json, and
# the depths (see comparable); the sweep's own knobs (steps, warm-up, commit) may differ, and
# each sweep's is shown.
SAME = {
    "device": lambda r: r["meta"]["device_name"],
    "threads": lambda r: r["meta"].get("torch_threads"),
    "torch": lambda r: r["meta"]["torch_version"],
    "dtype": lambda r: r["meta"]["dtype"],
    # float32's for bfloat16 on a CPU without bf16 instructions (sweeps before it: bfloat16's)
    "the matmul peak's dtype": lambda r: peak_dtype(r["meta"]),
    "linears": lambda r: r["meta"].get("linear"),
    "model": lambda r: {
        k: v for k, v in r["meta"]["config"]["model"].items() if k not in ("n_layer", "attention")
    },
    "batch_size": lambda r: r["meta"]["config"]["train"]["batch_size"],
    "micro-batches (grad_accum, global_batch_size)": lambda r: (
        r["meta"]["config"]["train"].get("grad_accum", 1),
        r["meta"]["config"]["train"].get("global_batch_size", 0),
    ),
    # Any clip norm or decay rate does the same work; on or off does not.
    "the optimizer step (clipping, weight decay: on or off)": lambda r: (
        r["meta"]["config"]["train"].get("grad_clip", 0) > 0,
        r["meta"]["config"]["train"].get("weight_decay", 0) > 0,
    ),
    "data (--data)": lambda r: r["meta"].get("data"),
    "host memory (--host-memory)": lambda r: r["meta"].get("host_memory"),
    # How far the heap is grown before each depth's timed steps decides which cells page-fault
    "heap reserve": lambda r: (
        None if (b := r["meta"].get("heap_reserve_bytes")) is None else f"{b / 2**20:.0f} MiB"
    ),
}


# Machines of one name can differ in speed: two cloud VMs both "AMD EPYC", one with half the
# other's matmul peak. Sweeps whose peaks differ by more than this ratio ran on different
# machines; on one quiet machine they differ by a few percent (each the higher of two readings).
PEAK_RATIO = 1.3


def comparable(sweeps: list[tuple[Path, dict[str, Any]]]) -> str | None:
    """None if the sweeps measured the same setup at the same depths (a sweep stopped early
    at some of them) on machines of the same speed; otherwise what differs, with each
    sweep's value."""
    for what, of in SAME.items():
        values = [of(results) for _, results in sweeps]
        if any(v != values[0] for v in values):
            return _differ(what, sweeps, values)
    # Of whole sweeps: one that stopped before its closing reading has only its first, which
    # a busy moment can have lowered. A busy CPU sweep's (its savings shown marked, out of the
    # medians) may read low for the same reason, as other processes slow the peak's matmul too,
    # but not high: one faster than the quiet sweeps' slowest is checked against them.
    whole = [r["meta"] for _, r in sweeps if "peak_flops_end" in r["meta"]]
    slowed = [_slowed(m) and str(m.get("device")).startswith("cpu") for m in whole]
    quiet = [m["peak_flops"] for m, s in zip(whole, slowed, strict=True) if not s]
    busy = [m["peak_flops"] for m, s in zip(whole, slowed, strict=True) if s]
    quiet = quiet or busy
    peaks = quiet + [p for p in busy if p > min(quiet)]
    if len(peaks) > 1 and max(peaks) > PEAK_RATIO * min(peaks):
        shown = [
            rate_text(r["meta"]["peak_flops"], unit_of=max(peaks))
            + (" (start only)" if "peak_flops_end" not in r["meta"] else "")
            for _, r in sweeps
        ]
        return _differ("matmul peak", sweeps, shown, "machines of one name, not of one speed")
    whole = {tuple(_layers(results)) for _, results in sweeps if not _stopped(results)}
    depths = set(_depths(sweeps))
    if not depths:
        return (
            "no depth to compare: every sweep stopped before it profiled one (its rows are "
            "interrupted ones, timed only)"
        )
    if len(whole) > 1 or any(not set(_layers(r)) <= depths for _, r in sweeps):
        return _differ("n_layer", sweeps, [_layers(r) for _, r in sweeps]) + _stopped_early(sweeps)
    return _nothing_shared(sweeps)


def _nothing_shared(sweeps: list[tuple[Path, dict[str, Any]]]) -> str | None:
    """What a sweep whose labels no other sweep has would add: a column of – only (an eager
    sweep beside a compiled one: `naive` is not `naive+compile`); None where each shares one."""
    each = [set(labels(results["rows"])) for _, results in sweeps]
    for i, (path, _) in enumerate(sweeps):
        if not each[i] & set().union(*each[:i], *each[i + 1 :]):
            shown = "; ".join(f"{p}: {', '.join(labels(r['rows']))}" for p, r in sweeps)
            return (
                f"{path} shares no variant with the other sweeps ({shown}): there is nothing to "
                "set beside it (a variant compiled and not compiled are two; --compile both "
                "measures each)"
            )
    return None


def _differ(
    what: str, sweeps: list[tuple[Path, dict[str, Any]]], values: list[Any], why: str = ""
) -> str:
    shown = "; ".join(f"{path}: {v}" for (path, _), v in zip(sweeps, values, strict=True))
    why = f"{why}, whose" if why else "their"
    return f"the sweeps differ in {what} ({shown}): {why} savings are not one quantity"


def _stopped(results: dict[str, Any]) -> bool:
    """Whether the sweep stopped before its last cell (interrupted)."""
    return cells_done(results["rows"]) < results["meta"].get("cells_planned", 0)


def _depths(sweeps: list[tuple[Path, dict[str, Any]]]) -> list[int]:
    """The depths compared: those of the sweeps that ran to the end, or, where none did, every
    depth any of them measured."""
    whole = [r for _, r in sweeps if not _stopped(r)]
    return sorted({n for r in (whole or [r for _, r in sweeps]) for n in _layers(r)})


def _stopped_early(sweeps: list[tuple[Path, dict[str, Any]]]) -> str:
    """Which of the sweeps were interrupted, the likely cause of a difference in depths."""
    stopped = [
        f"{path}, {cells_done(results['rows'])} of {results['meta']['cells_planned']} cells"
        for path, results in sweeps
        if _stopped(results)
    ]
    return f"; stopped before the end: {'; '.join(stopped)}" if stopped else ""


def _layers(results: dict[str, Any]) -> list[int]:
    """The depths a sweep measured: not one whose cells it only timed before it stopped."""
    return sorted({r["n_layer"] for r in results["rows"] if r["status"] != "interrupted"})


def compare_text(sweeps: list[tuple[Path, dict[str, Any]]]) -> str:
    """Markdown: per label, the median step time at each depth across the sweeps; then the
    fitted cost per layer and per-layer saving (± se) and the saving measured at the deepest
    depth in each sweep, with their median, quartiles (from four sweeps) and range."""
    layers = _depths(sweeps)
    names = list(dict.fromkeys(n for _, results in sweeps for n in labels(results["rows"])))
    # A saving fitted over fewer depths (a cell failed, or the sweep stopped before it) is
    # another quantity: shown, marked, and left out of the median.
    # So is one from a sweep that other processes slowed (its report warns): shown, marked §,
    # and left out, as what they did is not the machine's own variation.
    busy = [_slowed(r["meta"]) for _, r in sweeps]
    costs = [
        {name: {**c, "partial": c["depths"] != layers, "busy": slowed} for name, c in _costs(r)}
        for (_, r), slowed in zip(sweeps, busy, strict=True)
    ]
    fitted = [
        {
            name: {**s, "partial": s["depths"] != layers, "busy": slowed}
            for name, s in savings(r["rows"]).items()
        }
        for (_, r), slowed in zip(sweeps, busy, strict=True)
    ]
    measured = [
        {name: {**s, "busy": slowed} for name, s in _measured(r["rows"], layers[-1]).items()}
        for (_, r), slowed in zip(sweeps, busy, strict=True)
    ]
    meta = sweeps[0][1]["meta"]
    lines = [
        f"# {len(sweeps)} sweeps of one setup",
        "",
        f"{meta['device_name']}, {meta.get('torch_threads', '?')} threads, torch "
        f"{meta['torch_version']}, {meta['dtype']}, n_layer {','.join(map(str, layers))}.",
        "",
    ]
    lines += _sweep_list(sweeps, busy)
    lines += ["", "## Step time across the sweeps (ms): median (lowest–highest)", ""]
    lines += _step_time_table(names, layers, [results["rows"] for _, results in sweeps], busy)
    for title, table, se, signed in (
        ("Cost per layer, fitted (ms/layer ± se)", costs, True, False),
        (f"Saving per layer against {BASELINE}, fitted (ms/layer ± se)", fitted, True, True),
        (f"Saving at n_layer={layers[-1]}, measured (ms)", measured, False, True),
    ):
        lines += ["", f"## {title}", ""]
        lines += _sweeps_table(names, table, se, signed)
    shown_se = any(s["per_layer_se"] is not None for by in costs for s in by.values())
    lines += [
        "",
        ("Each sweep's ± is its fit's standard error. " if shown_se else "")
        + "The median, the quartiles (given where "
        "there are four sweeps or more; numpy's default interpolation) and the range are "
        "across the sweeps: they say what the machine did between them. A label missing from "
        "a sweep, or failed in it, is – in that sweep's column.",
    ]
    if any(busy):
        lines += [
            "",
            f"§ Other processes used more than {BUSY_SHARE:.0%} of the CPUs during that sweep's "
            "timed steps (its report warns of it): its step times, costs and savings say what "
            "they did, not what the machine does, and are left out of the median, quartiles and "
            "range (a step time that only such sweeps measured is shown from them, marked §).",
        ]
    if any(s["partial"] for by_label in costs + fitted for s in by_label.values()):
        lines += [
            "",
            "‡ Fitted over fewer depths than those compared (a cell failed, or the sweep "
            "stopped before it): a step's cost is not "
            "exactly linear in depth, so it is another quantity, left out of the median, "
            "quartiles and range.",
        ]
    return "\n".join(lines) + "\n"


def _sweep_list(sweeps: list[tuple[Path, dict[str, Any]]], busy: list[bool]) -> list[str]:
    """One numbered line per sweep: its folder, when, the commit, its matmul peak (in one
    unit for all), the share of the CPUs others took (§ where it slowed the sweep), and
    whether it stopped early."""
    top_peak = max(r["meta"].get("peak_flops") or 0 for _, r in sweeps)
    lines = []
    for i, (path, results) in enumerate(sweeps, 1):
        m = results["meta"]
        stopped = (
            f", stopped after {cells_done(results['rows'])} of {m['cells_planned']} cells"
            if _stopped(results)
            else ""
        )
        in_dtype = f" ({m['peak_dtype']})" if m.get("peak_dtype") else ""
        peak = (
            f", matmul peak {rate_text(m['peak_flops'], top_peak)}{in_dtype}"
            if m.get("peak_flops")
            else ""
        )
        if m.get("other_cpu_share") is not None:
            peak += f", other processes {m['other_cpu_share']:.0%} of the CPUs"
            if busy[i - 1]:
                peak += " §"
        lines.append(
            f"{i}. `{path}`: {_started(m)}, commit {m.get('commit') or 'unknown'}{peak}{stopped}"
        )
    return lines


def _sweeps_table(
    names: list[str], table: list[dict[str, dict[str, Any]]], se: bool, signed: bool
) -> list[str]:
    """A per-layer figure per label (rows) and sweep (columns: `table` holds one dict per
    sweep), then their median, quartiles and range; with `se`, each cell's standard error;
    `signed`, a saving's sign shown (+ where the label is faster)."""
    head = [str(i) for i in range(1, len(table) + 1)] + ["median", "quartiles", "range"]
    form = "+.2f" if signed else ".2f"
    rows = []
    for name in names:
        if all(name not in by_label for by_label in table):
            continue
        values = [_value(by_label.get(name)) for by_label in table]
        cells = [_cell(by_label.get(name), se, form) for by_label in table]
        rows.append(f"| {name} | " + " | ".join(cells + _spread(values, form)) + " |")
    if not rows:
        if not signed:
            return ["(none: a fit needs two depths)"]
        return [f"(none: a fit needs two depths, and a saving {BASELINE} and another variant)"]
    return ["| variant | " + " | ".join(head) + " |", "|" + "---|" * (len(head) + 1), *rows]


def _step_time_table(
    names: list[str], layers: list[int], sweeps: list[list[dict[str, Any]]], busy: list[bool]
) -> list[str]:
    """Per label and depth, the median of the sweeps' median step times and their range; a
    cell measured in fewer sweeps than all (failed, not run, or left out as busy) says in how
    many. A busy sweep's times are left out as its costs are; where only busy sweeps measured
    a cell, theirs are shown, marked §."""
    step_ms = [points_by_label(rows) for rows in sweeps]  # label -> metric -> {n_layer: ms}
    lines = [
        "| variant | " + " | ".join(f"L{n}" for n in layers) + " |",
        "|" + "---|" * (len(layers) + 1),
    ]
    for name in names:
        cells = []
        for n_layer in layers:
            by_sweep = [points[name]["step_ms"].get(n_layer) for points in step_ms]
            quiet = [ms for ms, b in zip(by_sweep, busy, strict=True) if ms is not None and not b]
            got = sorted(quiet or [ms for ms in by_sweep if ms is not None])
            if not got:
                cells.append("–")
                continue
            text = f"{statistics.median(got):.1f} ({got[0]:.1f}–{got[-1]:.1f})"
            if len(got) < len(sweeps):
                text += f", {len(got)} of {len(sweeps)}"
            cells.append(text + ("" if quiet else " §"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _costs(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Each label's step time per layer, the slope of its fit (the report's) over the depths it
    measured, in the shape of a fitted saving."""
    points = points_by_label(results["rows"])
    out = []
    for name, by_metric in fits_by_label(results["rows"]).items():
        if (fit := by_metric.get("step_ms")) is not None:
            depths = sorted(points[name]["step_ms"])
            cost = {"per_layer": fit["slope"], "per_layer_se": fit["slope_se"], "depths": depths}
            out.append((name, cost))
    return out


def _measured(rows: list[dict[str, Any]], deepest: int) -> dict[str, dict[str, Any]]:
    """Each label's saving against its reference measured at the deepest depth, where both
    measured there (in the shape of a fitted saving, with no error)."""
    reference_of = baselines(rows)
    out = {}
    for name in labels(rows):
        found = measured_saving(rows, name, reference_of[name])
        if name != reference_of[name] and found is not None and found[0] == deepest:
            out[name] = {"per_layer": found[1], "per_layer_se": None}
    return out


def _slowed(meta: dict[str, Any]) -> bool:
    """Whether other processes took more than BUSY_SHARE of the CPUs in the timed steps (not
    counted so in sweeps that counted them over the whole sweep, compiling included)."""
    share = meta.get("other_cpu_share")
    timed_only = meta.get("other_cpu_window") == METHOD["other_cpu_window"]
    return timed_only and (share or 0) > BUSY_SHARE


def _value(s: dict[str, Any] | None) -> float | None:
    return None if s is None or s.get("partial") or s.get("busy") else s["per_layer"]


def _cell(s: dict[str, Any] | None, se: bool, form: str) -> str:
    if s is None:
        return "–"
    text = f"{s['per_layer']:{form}}"
    if se and s["per_layer_se"] is not None:
        text += f" ± {s['per_layer_se']:.2f}"
    if s.get("partial"):
        text += f" ‡ (L{','.join(map(str, s['depths']))})"
    if s.get("busy"):
        text += " §"
    return text


def _spread(values: list[float | None], form: str) -> list[str]:
    """Median, quartiles (four values or more) and range of the values present."""
    got = sorted(v for v in values if v is not None)
    if len(got) < 2:
        return ["–"] * 3
    quartiles = "–"
    if len(got) >= 4:
        q1, _, q3 = statistics.quantiles(got, n=4, method="inclusive")
        quartiles = f"{q1:{form}}, {q3:{form}}"
    median = statistics.median(got)
    return [f"{median:{form}}", quartiles, f"{got[0]:{form}} to {got[-1]:{form}}"]


def _started(meta: dict[str, Any]) -> str:
    started = meta.get("started_at")
    if not started:
        return "start unknown"
    at = dt.datetime.fromisoformat(started).astimezone(dt.UTC)
    return at.strftime("started %Y-%m-%d %H:%M UTC")


def compare_folders(given: list[Path]) -> str:
    """--compare: the sweeps in these folders side by side (compare_text), each read once
    (profiles/<config>/* names each sweep and `latest`, a link to the newest); a ConfigError
    where they cannot be compared."""
    folders: dict[Path, Path] = {}
    for folder in given:
        if folder.is_dir() and not (folder / "results.json").exists():
            print(
                f"--compare: {folder} holds no results.json (a sweep stopped before its first "
                "cell?): left out",
                file=sys.stderr,
            )
            continue
        real = folder.resolve()
        if real in folders:
            same = "given twice" if folder == folders[real] else f"is {folders[real]}"
            print(f"--compare: {folder} {same}, counted once", file=sys.stderr)
            continue
        folders[real] = folder
    if len(folders) < 2:
        left = (
            f" ({len(folders)} left of the {len(given)} given, as said above)"
            if len(given) > 1
            else ""
        )
        raise ConfigError(f"--compare: give two sweep folders or more{left}")
    sweeps = [(folder, load_results(folder, "--compare")) for folder in folders.values()]
    seen: dict[tuple, Path] = {}
    for folder, results in sweeps:
        key = (results["meta"].get("started_at"), results["meta"].get("out"))
        if key in seen:
            raise ConfigError(f"--compare: {folder} and {seen[key]} hold the same sweep")
        seen[key] = folder
    try:
        differ = comparable(sweeps)
        text = "" if differ else compare_text(sweeps)
    except (KeyError, TypeError, AttributeError, ValueError) as e:  # parsed, but hand-edited
        # Which: the first that fails set beside itself
        what = next(
            (str(f / "results.json") for f, r in sweeps if not _compares([(f, r), (f, r)])),
            "a results.json",
        )
        raise ConfigError(f"--compare: {cannot_read(what, e)}") from None
    if differ:
        raise ConfigError(f"--compare: {differ}")
    return text


def _compares(sweeps: list[tuple[Path, dict[str, Any]]]) -> bool:
    try:
        comparable(sweeps)
        compare_text(sweeps)
    except (KeyError, TypeError, AttributeError, ValueError):
        return False
    return True
