"""The two plots of a sweep: step time and peak memory against n_layer, by variant."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from model import VARIANTS
from profiling.analysis import label, labels, ok_rows

MiB = 2**20


def styles(rows: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """Each label's colour and marker: a variant's colour is its place in the registry, so it
    keeps it from sweep to sweep whichever others ran (a name the registry no longer has takes
    the next one free); compiled, the same colour with squares."""
    variants = list(VARIANTS) + sorted({r["variant"] for r in rows} - set(VARIANTS))
    return {
        label(r["variant"], r["compile"]): (
            f"C{variants.index(r['variant']) % 10}",
            "s" if r["compile"] else "o",
        )
        for r in rows
    }


def axis_top(drawn: list[float], bar_tops: list[float]) -> float | None:
    """Where to cut the y axis, or None to let it hold everything: a disturbed cell's p90 (a
    step ten times the median) would squash every median and line into the bottom of the plot,
    so past 1.5x the highest of those the axis shows them and the bar is cut."""
    if not drawn or max(bar_tops, default=0.0) <= 1.5 * max(drawn):
        return None
    return 1.15 * max(drawn)


# What plot_results draws, and the report's text for each
PLOTS = {
    "step_time_vs_layers.png": "step time vs layers",
    "memory_vs_layers.png": "peak memory vs layers",
}


def plot_results(out: Path, results: dict[str, Any], setup: str) -> None:
    """step_time_vs_layers.png and memory_vs_layers.png: a point (p10-p90 bar) per cell, one
    colour per variant label, and each label's fitted line; `setup` goes under the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, fits = ok_rows(results["rows"]), results["fits"]
    names = labels(rows)
    style = styles(rows)
    specs = [
        (
            "step_time_vs_layers.png",
            "step_ms",
            "median step time (ms)",
            lambda r: (r["step_ms"]["median"], r["step_ms"]["p10"], r["step_ms"]["p90"]),
            1.0,
        ),
        (
            "memory_vs_layers.png",
            "peak_mem_bytes",
            "peak memory per step (MiB)",
            lambda r: (r["peak_mem_bytes"],) * 3 if r["peak_mem_bytes"] else None,
            1 / MiB,
        ),
    ]
    for filename, metric, ylabel, values, scale in specs:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        drawn, bar_tops, fitted = _draw_series(ax, rows, fits, style, metric, values, scale)
        top = axis_top(drawn, bar_tops)
        if top is not None:
            ax.set_ylim(0, top)  # from 0: the long bar would otherwise push it below
            ax.annotate(
                "some p90 bars run past the top (cells that varied widely)",
                (0.01, 0.99),
                xycoords="axes fraction",
                va="top",
                fontsize=7,
            )
        ax.set_xlabel("n_layer")
        ax.set_xticks(sorted({r["n_layer"] for r in rows}))  # the depths measured, no 1.5
        if names:  # under the plot, where it hides no point
            compiled = any(m == "s" for _, m in style.values())
            notes = [
                *(["bars: p10 to p90 of the timed steps"] if metric == "step_ms" else []),
                "points shifted sideways to stay apart",
                *(["dashed: fitted lines"] if fitted else []),
                *(["compiled: squares" + (", dotted" if fitted else "")] if compiled else []),
            ]
            ax.annotate(
                "; ".join(notes),
                (0.99, 0.01),
                xycoords="figure fraction",
                ha="right",
                va="bottom",
                fontsize=7,
            )
        ax.set_ylabel(ylabel)
        ax.set_title(
            f"{ylabel.split(' (')[0]} vs depth ({results['meta']['device']})\n{setup}", fontsize=9
        )
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout(rect=(0, 0.03, 1, 1))  # room for the note
        try:
            fig.savefig(out / filename, dpi=110)
        except OSError as e:  # Pillow's failed write names no file: this one does
            raise OSError(e.errno, e.strerror or str(e), str(out / filename)) from e
        finally:
            plt.close(fig)


def _draw_series(
    ax: Any,
    rows: list[dict[str, Any]],
    fits: dict[str, Any],
    style: dict[str, tuple[str, str]],
    metric: str,
    values: Callable[[dict[str, Any]], tuple[float, float, float] | None],
    scale: float,
) -> tuple[list[float], list[float], bool]:
    """Each label's points (with p10-p90 bars for step time) and fitted line on `ax`; what the
    axis must show (medians and lines), the bars' tops, and whether any line was drawn."""
    names = labels(rows)
    drawn: list[float] = []
    bar_tops: list[float] = []
    fitted = False
    for i, name in enumerate(names):
        pts = sorted(
            (r["n_layer"], values(r)) for r in rows if label(r["variant"], r["compile"]) == name
        )
        pts = [(x, v) for x, v in pts if v is not None]
        if not pts:
            continue
        # A small sideways shift per variant, so that equal values (sdpa and the backend
        # it picked) stay visible; the fitted lines use the true n_layer.
        shift = 0.06 * (i - (len(names) - 1) / 2)
        xs = [x + shift for x, _ in pts]
        mid = [v[0] * scale for _, v in pts]
        # One peak per cell has no spread: no bars, and none in its legend either
        err = [[(v[0] - v[1]) * scale for _, v in pts], [(v[2] - v[0]) * scale for _, v in pts]]
        spread = metric == "step_ms"
        color, marker = style[name]
        ax.errorbar(
            xs,
            mid,
            yerr=err if spread else None,
            fmt=marker,
            color=color,
            label=name,
            capsize=3,
        )
        drawn += mid
        bar_tops += [v[2] * scale for _, v in pts]
        fit = fits.get(name, {}).get(metric)
        if fit:
            line_x = [min(xs) - shift, max(xs) - shift]
            line_y = [(fit["intercept"] + fit["slope"] * x) * scale for x in line_x]
            dashes = ":" if marker == "s" else "--"  # compiled: dotted, as its squares differ
            ax.plot(line_x, line_y, dashes, color=color, linewidth=1, gid=f"fit {name}")
            drawn += line_y
            fitted = True
    return drawn, bar_tops, fitted
