"""The sweep's data files: results.json (the contract), results.csv, then the rendered report;
and the check of a results.json read back (--report, --diff, --compare)."""

from __future__ import annotations

import csv
import io
import json
import math
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from profiling.analysis import cell_name, fits_by_label
from profiling.report import replace_file, write_report
from training.config import ConfigError
from training.rundir import lock_holder


def render_results(out: Path, results: dict[str, Any], plots: bool = True) -> None:
    """What results.json's data makes: results.csv, summary.txt, report.md and the PNGs, each
    made before any is written (see write_report)."""
    write_report(out, results, plots, data_files={"results.csv": _csv_text(results["rows"])})


def write_json(out: Path, meta: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """results.json alone, atomically; returns what it holds."""
    results = {"meta": meta, "rows": rows, "fits": fits_by_label(rows)}
    replace_file(out / "results.json", json.dumps(results, indent=1))
    return results


# A field's check: None where its value is what the report reads, else what is wrong: where
# below the field (e.g. ".p90", or "" for the field itself), the value there, what it should be.
Problem = tuple[str, Any, str]
_ABSENT = object()  # the value of a field that is not there
Check = Callable[[Any], Problem | None]


def _is(what: str, holds: Callable[[Any], bool]) -> Check:
    return lambda v: None if holds(v) else ("", v, what)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _below(key: object, problem: Problem | None) -> Problem | None:
    where = f"[{key}]" if isinstance(key, int) else f".{key}"  # a list's index, or a field
    return problem and (where + problem[0], problem[1], problem[2])


def _each(check: Check, kind: type = dict) -> Check:
    """An object (or, with `kind` list, a list) whose every value passes `check`."""

    def each(v: Any) -> Problem | None:
        if not isinstance(v, kind):
            return "", v, "a list" if kind is list else "an object"
        items = enumerate(v) if kind is list else v.items()
        return next(filter(None, (_below(k, check(x)) for k, x in items)), None)

    return each


def _fields(checks: dict[str, Check]) -> Check:
    """An object with these fields, each passing its check."""

    def fields(v: Any) -> Problem | None:
        if not isinstance(v, dict):
            return "", v, f"an object with {', '.join(checks)}"
        missing = [k for k in checks if k not in v]
        if missing:
            return f".{missing[0]}", _ABSENT, ""
        return next(filter(None, (_below(k, c(v[k])) for k, c in checks.items())), None)

    return fields


_TEXT = _is("text", lambda v: isinstance(v, str))
_NUMBER = _is("a number", _number)
# A cell's outcome: measured; failed (its reason); out of memory; a variant that cannot run
# here; or stopped part-way by an interruption (its steps kept)
STATUSES = ("ok", "failed", "oom", "unsupported", "interrupted")
_COUNT = _is("a whole number", _count)
_BY_NAME = _each(_NUMBER)

# What the report reads of a row, and what each field must hold; any may be null but the
# first four. Those down to kernels_per_step are the contract's: every row has them. The rest
# came later, and a sweep written before them lacks them.
ROW_FIELDS: dict[str, Check] = {
    "variant": _TEXT,
    "n_layer": _is("a whole number of 1 or more", lambda v: _count(v) and v >= 1),
    "compile": _is("true or false", lambda v: isinstance(v, bool)),
    "status": _is("one of " + ", ".join(STATUSES), lambda v: isinstance(v, str) and v in STATUSES),
    "reason": _TEXT,
    "step_ms": _fields({"median": _NUMBER, "p10": _NUMBER, "p90": _NUMBER, "n": _COUNT}),
    "tokens_per_s": _NUMBER,
    "mfu": _NUMBER,
    "peak_mem_bytes": _NUMBER,
    "compile_s": _NUMBER,
    "ops_per_step": _each(_BY_NAME),  # by region, then by op
    "kernels_per_step": _each(_BY_NAME),
    "label": _TEXT,
    "times_ms": _each(_NUMBER, list),
    "flops_per_step": _NUMBER,
    "attention_flops_per_step": _NUMBER,
    "compile_cache": _TEXT,
    "first_step_ms": _NUMBER,
    "eager_excess_s": _NUMBER,
    "backend": _TEXT,
    "kernels_unattributed_per_step": _BY_NAME,
    "page_faults_per_step": _NUMBER,
    "gc_collections": _is(
        "a list of 3 whole numbers (by generation)",
        lambda v: isinstance(v, list) and len(v) == 3 and all(map(_count, v)),
    ),
    "gc_longest_ms": _NUMBER,
    "compiles_while_timed": _COUNT,
    "allocator_calls_per_step": _NUMBER,
    "alloc_retries": _COUNT,
    "cpu_ms_per_step": _BY_NAME,
    "device_ms_per_step": _BY_NAME,
    "time_split": _BY_NAME,
    "trace": _TEXT,
    "trace_error": _TEXT,
}
_IN_EVERY_ROW = list(ROW_FIELDS)[: list(ROW_FIELDS).index("kernels_per_step") + 1]
_NEVER_NULL = _IN_EVERY_ROW[:4]
# What the report reads of meta in every sweep: the contract's fields, the command and steps
META_FIELDS: dict[str, Check] = {
    "device": _TEXT,
    "device_name": _TEXT,
    "torch_version": _TEXT,
    "dtype": _TEXT,
    "config": _is("an object", lambda v: isinstance(v, dict)),
    "peak_flops": _is("a number above 0", lambda v: _number(v) and v > 0),
    "started_at": _TEXT,
    "command": _TEXT,
    "steps": _COUNT,
}


def results_problem(results: dict[str, Any]) -> str | None:
    """What in a results.json the report cannot read (a file edited by hand, or a bug), named
    by its place, e.g. 'rows[3] (naive L2): step_ms.p90 is "fast", not a number'; None if
    nothing. Two rows of one cell are a problem too: the tables would show only one of them."""
    meta, rows = results["meta"], results["rows"]
    for field, check in META_FIELDS.items():
        if field not in meta:
            return f"meta has no {field!r}"
        if problem := check(meta[field]):
            return _wrong(f"meta.{field}", problem)
    if not isinstance(rows, list):
        return f"rows is {_shown(rows)}, not a list"
    cells: dict[tuple[str, int, bool], int] = {}
    for i, row in enumerate(rows):
        where = f"rows[{i}]"
        if not isinstance(row, dict):
            return f"{where} is {_shown(row)}, not an object"
        for field, check in ROW_FIELDS.items():
            if field not in row:
                if field in _IN_EVERY_ROW:
                    return f"{where} has no {field!r}"
                continue
            if row[field] is None and field not in _NEVER_NULL:
                continue
            if problem := check(row[field]):
                return f"{where}: {_wrong(field, problem)}"
            if field == "compile":  # the cell is known: named from here on
                where += f" ({cell_name(row)})"
        if row["status"] == "ok" and row["step_ms"] is None:
            return f"{where}: status is 'ok' but step_ms is null"
        if (ms := row["step_ms"]) is not None and not 0 < ms["p10"] <= ms["median"] <= ms["p90"]:
            # the plots' error bars and the per-layer shares divide and subtract with them
            return (
                f"{where}: step_ms has p10 {ms['p10']}, median {ms['median']}, p90 "
                f"{ms['p90']}, not 0 < p10 <= median <= p90"
            )
        cell = (row["variant"], row["n_layer"], row["compile"])
        if cell in cells:
            return f"rows[{cells[cell]}] and {where} measure the same cell"
        cells[cell] = i
    return None


def _wrong(field: str, problem: Problem) -> str:
    below, value, what = problem
    if value is _ABSENT:
        return f"{field}{below} is missing"
    return f"{field}{below} is {_shown(value)}, not {what}"


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


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
        "gc_collections",
        "gc_longest_ms",
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
                None if r.get("gc_collections") is None else sum(r["gc_collections"]),
                r.get("gc_longest_ms"),  # absent in sweeps written before they were counted
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


def load_results(folder: Path, flag: str) -> dict:
    """A sweep's results.json, or an error naming the folder and what is wrong with it."""
    path = folder / "results.json"
    if not folder.exists():
        raise ConfigError(f"{flag} {folder}: no such folder; give a sweep's --out folder")
    if not folder.is_dir():
        raise ConfigError(
            f"{flag} {folder}: a file, not a folder; give the sweep's folder"
            + (f" ({folder.parent})" if folder.name == "results.json" else "")
        )
    running = lock_holder(folder)
    if running is not None:  # its files are rewritten after every cell, and it has not ended
        report = (
            "its report.md is redrawn after every cell: read that"
            if (folder / "report.md").is_file()
            else "its report.md comes with its first cell: read that then"
        )
        raise ConfigError(
            f"{flag} {folder}: a sweep (pid {running}) is still writing there; {report}, or "
            "wait for it to end"
        )
    if path.exists() and not path.is_file():
        raise ConfigError(f"{path} is not a file: not a results.json of profile_train.py")
    if not path.is_file():
        raise ConfigError(f"{flag} {folder}: no results.json there")
    try:
        results = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); was it edited by hand?") from None
    if not (isinstance(results, dict) and isinstance(results.get("meta"), dict)):
        raise ConfigError(f"{path} has no 'meta' object: not a results.json of profile_train.py")
    if not results.get("rows"):
        raise ConfigError(
            f"{path} has no rows: no cell was measured, so there is nothing to report"
        )
    problem = results_problem(results)
    if problem is not None:
        raise ConfigError(f"{path}: {problem}; was it edited by hand?")
    return results


def cannot_read(what: str, e: Exception) -> str:
    """A results.json that parsed but lacks what the report reads: edited by hand, most
    likely, or a bug here; the line that failed tells which."""
    frames = traceback.extract_tb(e.__traceback__)
    here = Path(__file__).resolve().parents[1]  # the project's root
    ours = [f for f in frames if Path(f.filename).resolve().is_relative_to(here)] or frames
    where = (
        f"{Path(ours[-1].filename).name}:{ours[-1].lineno}"  # the project's line, not a library's
    )
    return (
        f"{what} lacks what the report reads ({type(e).__name__}: {e}, at {where}): was it "
        "edited by hand? If not, that line has a bug"
    )
