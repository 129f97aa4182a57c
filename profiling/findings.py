"""What changed and where the time goes, in words: the op and kernel differences between
variants, and the split of a profiled step by category. Read from results.json rows."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from profiling.analysis import (
    baselines,
    describe_diff,
    label,
    labels,
    mfu_text,
    ok_rows,
    op_diff,
)
from profiling.names import CATEGORIES, OTHER, kernel_label, time_split, unnumbered


def findings(rows: list[dict[str, Any]]) -> list[str]:
    """The op and kernel differences of every variant against naive (a compiled variant's
    against compiled naive), in words."""
    lines = []
    measured = labels(ok_rows(rows))
    reference_of = baselines(rows)
    for name in measured:
        base = reference_of[name]
        if name == base or base not in measured:
            continue
        ops = op_diff(rows, name, base)
        if ops is None:
            lines.append(f"- {name} vs {base}: not measured at a common n_layer, so no diff.")
            continue
        lines.append("- " + describe_diff(name, base, ops))
        kernels = op_diff(rows, name, base, kind="kernels_per_step", key_of=kernel_label)
        if kernels:
            lines.append("  - CUDA kernels: " + describe_diff(name, base, kernels, unit="kernel"))
    return lines


def where_time_goes(rows: list[dict[str, Any]], profile_steps: int = 1) -> list[str]:
    """For each variant at its deepest measured depth: the time of the profiled step by category
    (linear layers, attention, everything else), what lies outside the ops, and the largest ops
    (CPU) or kernels (CUDA)."""
    deepest: dict[str, dict[str, Any]] = {}
    for r in ok_rows(rows):
        name = label(r["variant"], r["compile"])
        if r.get("cpu_ms_per_step") and r["n_layer"] >= deepest.get(name, {}).get("n_layer", 0):
            deepest[name] = r
    lines = [_time_line(name, r, profile_steps) for name, r in deepest.items()]
    if any(_split_ms(r)[1] for r in deepest.values()):
        lines += [
            "",
            "This results.json predates these categories, so the split comes from the largest "
            f"ops each cell lists by name, the rest counted as {OTHER}.",
        ]
    return lines


def _time_line(name: str, r: dict[str, Any], profile_steps: int) -> str:
    cuda = bool(r.get("device_ms_per_step"))
    times = r["device_ms_per_step"] if cuda else r["cpu_ms_per_step"]
    total = sum(times.values())
    split, _ = _split_ms(r)
    median = r["step_ms"]["median"] if r.get("step_ms") else None
    # Profiled steps that ran slower than the timed ones (a busy moment) are their own base:
    # against the median, the categories would add up to more than 100%.
    slower = median is not None and total > median
    base = total if slower else median
    of = (lambda ms: f" ({100 * ms / base:.0f}%)") if base else (lambda ms: "")
    parts = ", ".join(f"{k} {ms:.1f} ms{of(ms)}" for k, ms in split.items())
    what = "Kernel time" if cuda else "Operators' self time"
    mfu = f", MFU {mfu_text(r['mfu'])}" if r.get("mfu") else ""
    line = f"- **{name}** at L{r['n_layer']}{mfu}: "
    if median:
        line += f"timed median {median:.1f} ms" + (
            ". " if slower else ", the base of the percentages. "
        )
    profiled = "per profiled step" if profile_steps > 1 else "in the profiled step"
    line += f"{what} {profiled} {total:.1f} ms: {parts}"
    if slower:
        line += (
            f"; {total - median:.1f} ms more than the timed median: the profiled "
            + ("steps ran" if profile_steps > 1 else "step ran")
            + " slower than the timed ones, so the percentages are of the "
            + ("kernels'" if cuda else "operators'")
            + " time in it, and this says nothing of the time outside them"
        )
    elif median:
        rest = median - total
        line += (
            f"; {'no kernel running' if cuda else 'outside the operators'} {rest:+.1f} ms{of(rest)}"
        )
    if r["compile"] and not cuda:
        where = "in none of the categories" if slower else "in the remainder, not in the categories"
        line += f". Inductor's fused kernels are not ATen operators: their time is {where}"
    named = {n: ms for n, ms in times.items() if n != "other"}  # "other": the unlisted, summed
    if cuda:  # by short label: one operation through several launchers counts once
        by_label: dict[str, float] = defaultdict(float)
        for n, ms in named.items():
            by_label[kernel_label(n)] += ms
        named = dict(sorted(by_label.items(), key=lambda kv: -kv[1]))
    top = ", ".join(f"`{n}` {ms:.1f}" for n, ms in list(named.items())[:6])
    return line + f". Largest (ms): {top}."


def _split_ms(r: dict[str, Any]) -> tuple[dict[str, float], bool]:
    """ms per category, in CATEGORIES order, over every op or kernel of the profiled step, and
    whether it had to come from the listed ones only (a results.json from before the current
    categories, whose stored split used others)."""
    times = r.get("device_ms_per_step") or r["cpu_ms_per_step"]
    stored = r.get("time_split")
    listed_only = not stored or not set(stored) <= set(CATEGORIES)
    shares = time_split(times) if listed_only else stored
    total = sum(times.values())
    return {k: shares[k] * total for k in CATEGORIES if k in shares}, listed_only


def diff_text(rows: list[dict[str, Any]], a: str, b: str) -> str:
    """The op (and kernel) counts per layer in which label a differs from label b, in words.

    Raises ValueError naming the valid labels if either was not measured.
    """
    measured = labels([r for r in ok_rows(rows) if r.get("ops_per_step")])
    for name in (a, b):
        if name not in measured:
            raise ValueError(
                f"--diff: no measured cell is labelled {name!r}; measured: {', '.join(measured)}"
            )
    ops = op_diff(rows, a, b)
    if ops is None:
        return f"{a} vs {b}: not measured at a common n_layer, so no per-layer diff."
    parts = [describe_diff(a, b, ops, full=True)]
    # Every full name, but one kernel renumbered is none.
    kernels = op_diff(rows, a, b, kind="kernels_per_step", threshold=0.005, key_of=unnumbered)
    if kernels:
        parts.append(describe_diff(a, b, kernels, unit="kernel", full=True))
    return "\n".join(parts)
