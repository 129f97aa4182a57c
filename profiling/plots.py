"""The two plots of a sweep: step time and peak memory against n_layer, by variant."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from profiling.analysis import label, labels, ok_rows

MiB = 2**20


def plot_results(out: Path, results: dict[str, Any], setup: str) -> None:
    """step_time_vs_layers.png and memory_vs_layers.png: a point (p10-p90 bar) per cell, one
    colour per variant label, and each label's fitted line; `setup` goes under the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, fits = ok_rows(results["rows"]), results["fits"]
    names = labels(rows)
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
            err = [[(v[0] - v[1]) * scale for _, v in pts], [(v[2] - v[0]) * scale for _, v in pts]]
            color = f"C{i % 10}"
            ax.errorbar(xs, mid, yerr=err, fmt="o", color=color, label=name, capsize=3)
            fit = fits.get(name, {}).get(metric)
            if fit:
                line_x = [min(xs) - shift, max(xs) - shift]
                ax.plot(
                    line_x,
                    [(fit["intercept"] + fit["slope"] * x) * scale for x in line_x],
                    "--",
                    color=color,
                    linewidth=1,
                )
        ax.set_xlabel("n_layer")
        ax.set_ylabel(ylabel)
        ax.set_title(
            f"{ylabel.split(' (')[0]} vs depth ({results['meta']['device']})\n{setup}", fontsize=9
        )
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=110)
        plt.close(fig)
