"""The sweep's data files: results.json (the contract), results.csv, then the rendered report."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from profiling.analysis import fits_by_label
from profiling.report import replace_file, write_report


def render_results(out: Path, results: dict[str, Any], plots: bool = True) -> None:
    """What results.json's data makes: results.csv, summary.txt, report.md and the PNGs, each
    made before any is written (see write_report)."""
    write_report(out, results, plots, data_files={"results.csv": _csv_text(results["rows"])})


def write_json(out: Path, meta: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """results.json alone, atomically; returns what it holds."""
    results = {"meta": meta, "rows": rows, "fits": fits_by_label(rows)}
    replace_file(out / "results.json", json.dumps(results, indent=1))
    return results


def _csv_text(rows: list[dict[str, Any]]) -> str:
    columns = [
        "variant",
        "n_layer",
        "compile",
        "status",
        "step_ms_median",
        "step_ms_p10",
        "step_ms_p90",
        "n",
        "tokens_per_s",
        "mfu",
        "peak_mem_bytes",
        "compile_s",
        "compile_cache",
        "page_faults_per_step",
        "allocator_calls_per_step",
        "alloc_retries",
        "ops_per_step",
        "kernels_per_step",
        "kernels_unattributed_per_step",
        "backend",
        "reason",
    ]

    def total(counts: dict[str, dict[str, float]] | None) -> float | None:  # over all regions
        return sum(sum(c.values()) for c in counts.values()) if counts else None

    f = io.StringIO(newline="")
    writer = csv.writer(f)
    writer.writerow(columns)
    for r in rows:
        t = r["step_ms"] or {}
        unattributed = r.get("kernels_unattributed_per_step")  # absent before; None on CPU
        writer.writerow(
            [
                r["variant"],
                r["n_layer"],
                r["compile"],
                r["status"],
                t.get("median"),
                t.get("p10"),
                t.get("p90"),
                t.get("n"),
                r["tokens_per_s"],
                r["mfu"],
                r["peak_mem_bytes"],
                r["compile_s"],
                r.get("compile_cache"),  # absent in sweeps written before it
                r.get("page_faults_per_step"),
                r.get("allocator_calls_per_step"),  # CUDA, and absent in older sweeps
                r.get("alloc_retries"),
                total(r["ops_per_step"]),
                total(r["kernels_per_step"]),
                None if unattributed is None else sum(unattributed.values()),
                r["backend"],
                r["reason"],
            ]
        )
    return f.getvalue()
