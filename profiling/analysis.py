"""From rows of measurements to per-layer costs: linear fits in n_layer, savings, op diffs."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from typing import Any

REGIONS = ("forward", "backward", "optimizer")  # the record_function names in train_step
PROJECT_AT = (12, 24, 48)


def label(variant: str, compiled: bool) -> str:
    """The one name a cell goes by in fits, tables and plot legends."""
    return f"{variant}+compile" if compiled else variant


def cell_name(row: dict[str, Any]) -> str:
    """A row's cell as the report names it: its label and depth, `sdpa+compile L4`."""
    return f"{label(row['variant'], row['compile'])} L{row['n_layer']}"


def mfu_text(mfu: float | None) -> str:
    """An MFU as the report writes it: a percentage to one decimal, or to two significant
    figures below 1% (a tiny test sweep's), where one decimal would read alike; – for none."""
    if not mfu:
        return "–"
    return f"{100 * mfu:.1f}%" if mfu >= 0.01 else f"{100 * mfu:.2g}%"


def labels(rows: list[dict[str, Any]]) -> list[str]:
    """The labels of the rows, each once, in the order the sweep ran them."""
    return list(dict.fromkeys(label(r["variant"], r["compile"]) for r in rows))


# What every saving is measured against: the hand-written reference, the tests' oracle too
BASELINE = "naive"


def baselines(rows: list[dict[str, Any]]) -> dict[str, str]:
    """Each label's reference: BASELINE in the same compile mode, like against like."""
    return {label(r["variant"], r["compile"]): label(BASELINE, r["compile"]) for r in rows}


def fit_line(xs: list[float], ys: list[float]) -> dict[str, float | None] | None:
    """Least squares y = intercept + slope * x, with r^2 and the slope's standard error.

    None with fewer than two distinct x. The standard error needs three points; with two it
    is None (a line through two points has no residual to estimate it from).
    """
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = sum((y - my) ** 2 for y in ys)
    if ss_res <= 1e-20 * ss_tot or ss_tot <= 1e-24 * sum(y * y for y in ys):
        ss_res = 0.0  # an exact line (op counts per layer), or a flat one, left only rounding
    # A flat series has no spread to explain: r^2 1 by convention, as its line is exact.
    r2 = min(1.0, max(0.0, 1.0 - ss_res / ss_tot)) if ss_res else 1.0
    # Two points fit exactly and say nothing about the error: None (JSON null), not NaN.
    slope_se = math.sqrt(ss_res / (n - 2) / sxx) if n > 2 else None
    return {"slope": slope, "intercept": intercept, "r2": r2, "slope_se": slope_se, "points": n}


def line_se_at(points: dict[int, float], x: float) -> float | None:
    """Standard error of the least-squares line through points (n_layer -> value) at x.

    var(a + b x) = s^2 (1/n + (x - mean_x)^2 / Sxx), s^2 the residual variance with n - 2
    degrees of freedom. None with fewer than three depths. Far beyond the depths measured it
    says how well the line is pinned down there, not whether the cost stays linear that far.
    """
    xs = list(points)
    fit = fit_line(xs, list(points.values()))
    if fit is None or fit["slope_se"] is None:
        return None
    n = len(xs)
    mx = sum(xs) / n
    sxx = sum((v - mx) ** 2 for v in xs)
    # slope_se^2 = s^2 / Sxx, so the variance above is slope_se^2 (Sxx / n + (x - mean_x)^2).
    return fit["slope_se"] * math.sqrt(sxx / n + (x - mx) ** 2)


def row_metrics(row: dict[str, Any]) -> dict[str, float]:
    """The scalar metrics of one row that are fitted against n_layer."""
    metrics: dict[str, float] = {}
    if row.get("step_ms"):
        metrics["step_ms"] = row["step_ms"]["median"]
    if row.get("peak_mem_bytes") is not None:
        metrics["peak_mem_bytes"] = row["peak_mem_bytes"]
    for kind in ("ops_per_step", "kernels_per_step"):
        counts = row.get(kind)
        if not counts:
            continue
        for region in REGIONS:
            metrics[f"{kind}.{region}"] = sum(counts.get(region, {}).values())
        metrics[f"{kind}.total"] = sum(metrics[f"{kind}.{r}"] for r in REGIONS)
    return metrics


def ok_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("status") == "ok"]


def cells_done(rows: list[dict[str, Any]]) -> int:
    """The cells that ran to their end (measured or failed): not those a stopped sweep had
    timed but not yet profiled (status interrupted)."""
    return sum(r.get("status") != "interrupted" for r in rows)


def points_by_label(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[int, float]]]:
    """label -> metric -> {n_layer: value}, over the rows that measured."""
    points: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for row in ok_rows(rows):
        for metric, value in row_metrics(row).items():
            points[label(row["variant"], row["compile"])][metric][row["n_layer"]] = value
    return points


def fits_by_label(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """For each variant label and metric, the fit of metric against n_layer."""
    fits: dict[str, dict[str, dict[str, float]]] = {}
    for name, by_metric in points_by_label(rows).items():
        for metric, by_layer in by_metric.items():
            fit = fit_line(list(by_layer), list(by_layer.values()))
            if fit is not None:
                fits.setdefault(name, {})[metric] = fit
    return fits


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median: the order statistics x(k) and x(n+1-k)
    with k the largest for which P(Binomial(n, 1/2) < k) <= (1 - level) / 2, so the interval
    covers the median with probability >= level whatever the values' distribution. None
    where n is too small for one (below 6 at 95%)."""
    n, tail = len(values), (1 - level) / 2
    below, k = 0.0, 0  # below: P(Binomial(n, 1/2) <= k - 1)
    while k < n // 2 and below + math.comb(n, k) / 2**n <= tail:
        below += math.comb(n, k) / 2**n
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def baseline_pairs(
    rows: list[dict[str, Any]],
) -> list[tuple[str, int, dict[str, Any], dict[str, Any]]]:
    """Each measured (ok) cell beside its BASELINE cell of the same depth and compile mode:
    (label, n_layer, its row, the baseline's row)."""
    by = {(label(r["variant"], r["compile"]), r["n_layer"]): r for r in ok_rows(rows)}
    reference_of = baselines(rows)
    return [
        (name, n_layer, row, reference)
        for (name, n_layer), row in by.items()
        if (reference := by.get((reference_of[name], n_layer))) is not None and reference is not row
    ]


def paired_savings(rows: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """label -> n_layer -> the saving against BASELINE (like against like, as in savings)
    from the timed rounds: each round runs every cell of a depth once, so round i's baseline
    step less the variant's round-i step is one paired difference, free of drift slower than
    a round. Their median (ms), its 95% interval (median_interval; None below 6 rounds) and
    the number of rounds. Only cells that measured (ok) and recorded their times, in round
    order (`times_ms`), of the same number of rounds."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for name, n_layer, row, reference in baseline_pairs(rows):
        ours, theirs = row.get("times_ms"), reference.get("times_ms")
        if not ours or not theirs or len(ours) != len(theirs):
            continue
        diffs = [t - o for t, o in zip(theirs, ours, strict=True)]
        out.setdefault(name, {})[n_layer] = {
            "median": statistics.median(diffs),
            "interval": median_interval(diffs),
            "n": len(diffs),
        }
    return out


def savings(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per-layer step-time saving of each label against BASELINE, +- its standard error, and
    the saving the two fitted lines project at 12, 24 and 48 layers. Compiled labels are
    compared with the compiled baseline ('sdpa+compile' with 'naive+compile'): like against
    like.

    Both lines are fitted over the depths the two measured (`depths`): a step's cost is not
    exactly linear in depth, so slopes over different depths (a sweep stopped part-way, a cell
    that failed) would differ by that curvature as well. The saving is the slope of the
    per-depth differences; the variants of one depth are timed interleaved, so a disturbance
    of the machine hits both, and their difference is freer of it than either: its standard
    error is that of the line fitted to the differences. Each projection carries its standard
    error the same way (`saving_se`), and so does the percent (`percent_se`, by the delta
    method): 100 S/R moves with the baseline's projected time R as well as with the saving S,
    and with the ratio held at S/R, var(S - (S/R) R) is the variance of the line fitted to
    diff - (S/R) baseline at that depth, the covariance of the two included. The errors are
    None with two depths; a label with fewer than two depths in
    common with its baseline is left out. Where either line projects a time of zero or less
    (noisy fits over few depths), the projection is None throughout, with `why_none`.
    """
    points = {name: by_metric["step_ms"] for name, by_metric in points_by_label(rows).items()}
    reference_of = baselines(rows)
    out = {}
    for name, these in points.items():
        reference = reference_of[name]
        if name == reference or reference not in points:
            continue
        depths = sorted(points[reference].keys() & these.keys())
        base = fit_line(depths, [points[reference][n] for n in depths])
        fit = fit_line(depths, [these[n] for n in depths])
        if base is None or fit is None:
            continue
        diffs = {n: points[reference][n] - these[n] for n in depths}
        projected = {}
        for layers in PROJECT_AT:
            ref = base["intercept"] + base["slope"] * layers
            this = fit["intercept"] + fit["slope"] * layers
            if min(ref, this) <= 0:  # noisy fits over few depths: no saving to speak of
                worse = reference if ref <= this else name
                projected[str(layers)] = {
                    "saving": None,
                    "percent": None,
                    "saving_se": None,
                    "percent_se": None,
                    "why_none": (
                        f"{worse}'s fitted step_ms is {min(ref, this):.1f} at {layers} layers"
                    ),
                }
                continue
            saving_se = line_se_at(diffs, layers)
            ratio = (ref - this) / ref
            ratio_se = line_se_at(
                {n: diffs[n] - ratio * points[reference][n] for n in depths}, layers
            )
            projected[str(layers)] = {
                "saving": ref - this,
                "percent": 100 * ratio,
                "saving_se": saving_se,
                "percent_se": None if ratio_se is None else 100 * ratio_se / ref,
            }
        out[name] = {
            "per_layer": base["slope"] - fit["slope"],
            "per_layer_se": fit_line(depths, list(diffs.values()))["slope_se"],
            "depths": depths,
            "projected": projected,
        }
    return out


def measured_saving(
    rows: list[dict[str, Any]], name: str, reference: str
) -> tuple[int, float, float] | None:
    """(n_layer, the reference's median step less this label's, the reference's) at the
    deepest depth both measured; None where they have none in common. No fit: what was timed."""
    points = points_by_label(rows)
    ours, theirs = points[name]["step_ms"], points[reference]["step_ms"]
    common = ours.keys() & theirs.keys()
    if not common:
        return None
    n = max(common)
    return n, theirs[n] - ours[n], theirs[n]


def _op_series(
    rows: list[dict[str, Any]], name: str, kind: str, key_of: Callable[[str], str]
) -> tuple[set[int], dict[tuple[str, str], dict[int, float]]]:
    """For one label: its measured depths, and (region, key_of(op)) -> {n_layer: count per
    step}, the counts of ops that share a key summed."""
    series: dict[tuple[str, str], dict[int, float]] = defaultdict(lambda: defaultdict(float))
    depths = set()
    for row in ok_rows(rows):
        if label(row["variant"], row["compile"]) != name or not row.get(kind):
            continue
        depths.add(row["n_layer"])
        for region, counts in row[kind].items():
            for op, count in counts.items():
                series[(region, key_of(op))][row["n_layer"]] += count
    return depths, series


def op_diff(
    rows: list[dict[str, Any]],
    a: str,
    b: str,
    kind: str = "ops_per_step",
    threshold: float = 0.25,
    key_of: Callable[[str], str] = lambda name: name,
) -> list[dict[str, Any]] | None:
    """Ops whose per-layer per-step count differs between labels a and b (a minus b), by region,
    largest first: the slope of the difference over the depths both measured (a cell that
    failed at one depth leaves that depth out of both). Where the difference is not a straight
    line in n_layer, the entry has `linear: False` and per_layer is its least-squares slope.
    key_of names what counts as one op: kernels go by `kernel_label` in prose, so launches of
    one operation through different launchers count together, before the threshold.

    With a single depth in common, each entry also has `one_depth`, that n_layer: its
    per_layer is the whole step's difference divided by n_layer, so ops outside the layers
    (embeddings, the loss, the optimizer) count in it too. No depth in common (or no counts of
    this kind, as kernels off CUDA): None, not an empty list, which says they differ in nothing.
    """
    (depths_a, sa), (depths_b, sb) = (_op_series(rows, x, kind, key_of) for x in (a, b))
    common = sorted(depths_a & depths_b)
    if not common:
        return None
    diffs = []
    for key in sa.keys() | sb.keys():
        delta = [sa.get(key, {}).get(n, 0.0) - sb.get(key, {}).get(n, 0.0) for n in common]
        if len(common) == 1:  # no line: the whole step's difference, per layer
            per_layer, entry = delta[0] / common[0], {"one_depth": common[0]}
            shown = abs(delta[0]) >= threshold  # counts, exact: one more per step is one more
        else:  # fit_line reads an exact line's rounding as none
            fit = fit_line(common, delta)
            per_layer, entry = fit["slope"], {} if fit["r2"] == 1 else {"linear": False}
            shown = abs(per_layer) >= threshold
        if shown:
            diffs.append(
                {"region": key[0], "name": key[1], "per_layer": round(per_layer, 2)} | entry
            )
    return _by_region_and_size(diffs)


def _by_region_and_size(diffs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(
        diffs, key=lambda d: (REGIONS.index(d["region"]), -abs(d["per_layer"]), d["name"])
    )


# Ops that only make views or allocate: counted, but summed in words rather than named.
BOOKKEEPING = frozenset(
    "aten::" + n
    for n in (
        "as_strided",
        "expand",
        "view",
        "reshape",
        "_reshape_alias",
        "_unsafe_view",
        "transpose",
        "t",
        "permute",
        "unsqueeze",
        "squeeze",
        "select",
        "slice",
        "split",
        "split_with_sizes",
        "narrow",
        "detach",
        "alias",
        "resolve_conj",
        "resolve_neg",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty_strided",
        "lift_fresh",
        "contiguous",
        "to",
        "_to_copy",
        "zeros",
        "zeros_like",
        "ones_like",
        "scalar_tensor",
        "result_type",
    )
)


SHOWN = 12  # ops named in the report's findings; --diff names them all


def describe_diff(
    a: str, b: str, diffs: list[dict[str, Any]], unit: str = "op", full: bool = False
) -> str:
    """'inplace vs naive, per layer per step: 1 aten::clone fewer (forward); ...' in words.

    Ops that do work are named, the SHOWN first; views and allocations are summed at the end.
    full: every op that differs, views included, by region, one a line, no cap (for --diff).
    """
    if not diffs:
        return f"{a} vs {b}: the same {unit} counts per layer."
    head = f"{a} vs {b}, per layer per step"
    if "one_depth" in diffs[0]:
        n = diffs[0]["one_depth"]
        head = (
            f"{a} vs {b}, one depth in common (n_layer={n}): the whole step's difference divided "
            f"by {n}, ops outside the layers included"
        )
    if full:
        lines = [f"{head}, every {unit} that differs:"]
        for region in REGIONS:
            these = [f"    {_amount(d, region=False)}" for d in diffs if d["region"] == region]
            lines += [f"  {region}:", *these] if these else []
        return "\n".join(lines)
    named = [d for d in diffs if d["name"] not in BOOKKEEPING]
    parts = [_amount(d) for d in _largest_of_each_region(named, SHOWN)]
    if len(named) > SHOWN:
        parts.append(
            f"{len(named) - SHOWN} more differences (`profile_train.py --report <this folder> "
            f"--diff {a},{b}` lists them all)"
        )
    views = sum(d["per_layer"] for d in diffs if d["name"] in BOOKKEEPING)
    if views:
        parts.append(f"net {abs(views):g} view/allocation ops {'more' if views > 0 else 'fewer'}")
    return f"{head}: " + "; ".join(parts) + "."


def _largest_of_each_region(diffs: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """n of the diffs (sorted by region, then size), taking each region's largest in turn, so
    that a long forward list does not hide the backward's; returned in region order."""
    queues = [[d for d in diffs if d["region"] == region] for region in REGIONS]
    chosen: list[dict[str, Any]] = []
    while len(chosen) < n and any(queues):
        for queue in queues:
            if queue and len(chosen) < n:
                chosen.append(queue.pop(0))
    return _by_region_and_size(chosen)


def _amount(d: dict[str, Any], region: bool = True) -> str:
    """'1 aten::clone fewer (forward)'."""
    n = abs(d["per_layer"])
    amount = f"{n:g}" if n != int(n) else str(int(n))
    more = "more" if d["per_layer"] > 0 else "fewer"
    where = [d["region"]] if region else []
    if d.get("linear") is False:
        where.append("on average: not the same at every depth")
    return f"{amount} {d['name']} {more}" + (f" ({', '.join(where)})" if where else "")


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of n cells for successive rounds: a Williams design, the balanced Latin square.

    Over the rows every cell takes every position equally often and, within a round, directly
    follows every other equally often: n rows for even n, 2n for odd (the rows and their
    reverses). Rounds run back to back, cycling through the rows, so they are chained so that
    no round starts with the cell the one before it ended with. Rotating one order instead
    (A B C, B C A, C A B) puts A after C in two rounds of three.

    Two cells cross over, A B then B A: alternating A B A B would always time B one step after
    A, so a machine slowing steadily would read as B's cost. No chain of two-cell rounds avoids
    a repeat; in this one each cell follows itself once every two rounds, as the other does.
    """
    if n <= 1:
        return [list(range(n))]
    if n == 2:
        return [[0, 1], [1, 0]]
    # 0, 1, n-1, 2, n-2, ...: its successive differences are all distinct mod n.
    first = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]
    rows = [[(c + shift) % n for c in first] for shift in range(n)]
    if n % 2 == 0:  # row s ends with s + n/2 and row s + 1 starts with s + 1
        return rows
    # Row s runs s ... s + (n+1)/2 and its reverse the other way: reversed rows n-2, n-3, ...,
    # 0, n-1 after the rows never meet a round that begins where the last ended.
    return rows + [rows[s][::-1] for s in [*range(n - 2, -1, -1), n - 1]]
