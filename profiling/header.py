"""What summary.txt and report.md open with: where and how the sweep ran (the machine, the
setup, the matmul peak, the command and commit), how much of it ran, and the warnings about it
as a whole (other processes' load, the peak's drift, compiles in timed steps)."""

from __future__ import annotations

from typing import Any

from profiling.analysis import cell_name, cells_done
from profiling.method import METHOD


def _rate_unit(flops: float) -> tuple[float, str]:
    """The divisor and unit a matmul rate reads best in: a CPU's GFLOP/s, a GPU's TFLOP/s."""
    return (1e12, "TFLOP/s") if flops >= 1e13 else (1e9, "GFLOP/s")


def rate_text(flops: float, unit_of: float | None = None) -> str:
    """'483.8 GFLOP/s', '700.0 TFLOP/s'; in the unit `unit_of` reads best in, if given (rates
    shown side by side share one)."""
    scale, unit = _rate_unit(flops if unit_of is None else unit_of)
    return f"{flops / scale:.1f} {unit}"


def _unfinished(meta: dict[str, Any]) -> str:
    """Why a sweep's results lack cells or its closing peak reading: a sweep writes them after
    every cell, so one still running reads as unfinished too; one stopped (Ctrl-C, SIGTERM, an
    error) says so on its way out."""
    if "stopped_at" in meta:
        return "the sweep stopped first"
    return "the sweep is still running, or was killed before its end"


def _peak_readings(meta: dict[str, Any]) -> str:
    scale, unit = _rate_unit(meta["peak_flops"])
    start = meta.get("peak_flops_start", meta["peak_flops"]) / scale
    if "peak_flops_end" not in meta:
        return (
            f"{start:.1f} {unit}, measured at the start only ({_unfinished(meta)}): the end "
            "reading, whose higher value a whole sweep divides by, follows its last cell. One "
            "reading taken while something else ran reads low, and every MFU here high: compare "
            "it with a whole sweep's peak on this machine"
        )
    end = meta["peak_flops_end"] / scale
    return (
        f"{start:.1f} / {end:.1f} {unit}, measured at the start and end of the sweep, higher used"
    )


def _completeness(meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """A line saying the sweep has cells still to run, if it has."""
    planned, done = meta.get("cells_planned"), cells_done(rows)
    if planned is None or done >= planned:
        return []
    timed = len(rows) - done
    failed = sum(r.get("status") not in ("ok", "interrupted") for r in rows)
    why = "out of memory, unsupported or an error"
    of_them = f" ({failed} of them failed: {why})" if failed else ""
    were = "was" if timed == 1 else "were"
    also = f"; {timed} more {were} timed, not profiled (status interrupted)" if timed else ""
    if "stopped_at" in meta:
        text = f"ran to their end before it stopped{of_them}{also}"
    else:
        text = f"have run to their end{of_them}{also}: {_unfinished(meta)}"
    return [f"**Incomplete sweep**: {done} of {planned} cells {text}.", ""]


def _compiled_while_timed(rows: list[dict[str, Any]]) -> list[str]:
    """A warning naming the cells whose timed steps compiled something (a recompile)."""
    cells = [
        f"{cell_name(r)} ({r['compiles_while_timed']} of {r['step_ms']['n']})"
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


def setup_line(meta: dict[str, Any]) -> str:
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


def peak_dtype(meta: dict[str, Any]) -> str:
    """The dtype the peak was measured in: the run's, but float32 for bfloat16 on a CPU without
    bf16 instructions."""
    return meta.get("peak_dtype", meta["dtype"])


def _peak_dtype_why(meta: dict[str, Any]) -> str:
    if "peak_dtype_why" not in meta:
        return ""
    return (
        f"; {peak_dtype(meta)}'s, not {meta['dtype']}'s: {meta['peak_dtype_why']}, so MFU is "
        "against the fastest matmul this CPU has"
    )


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


# The matmul peak's start and end readings of one sweep on a quiet machine: within 6% of each
# other in every published sweep. Further apart, the machine's speed changed while it ran.
PEAK_DRIFT = 1.15


def _peak_drift_warning(meta: dict[str, Any]) -> list[str]:
    start, end = meta.get("peak_flops_start"), meta.get("peak_flops_end")
    if not start or not end or max(start, end) <= PEAK_DRIFT * min(start, end):
        return []
    high = max(start, end)
    return [
        f"**Warning**: the matmul peak read {rate_text(start, unit_of=high)} at the start and "
        f"{rate_text(end, unit_of=high)} at the end, {high / min(start, end):.2f}× apart: the "
        "machine's speed changed during this sweep (other processes, its clocks, a neighbour "
        "on a shared VM). MFU divides by the higher reading; cells timed in the slower part "
        "ran slower than this machine can. Rerun on a quiet machine.",
        "",
    ]


def _while(meta: dict[str, Any], before: str) -> str:
    """When other processes' share of the CPUs was counted; `before` for sweeps that counted
    it over the whole sweep, compiling and profiling too."""
    if meta.get("other_cpu_window") == METHOD["other_cpu_window"]:
        return "during the timed steps"
    return before


def _steps(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def summary_header(meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """summary.txt's opening lines: where and how the sweep ran, and warnings about it as a
    whole."""
    scale, unit = _rate_unit(meta["peak_flops"])
    return [
        "Full training steps (forward + backward + AdamW), median step time in ms",
        f"machine: {_machine_line(meta)}",
        f"setup:   {setup_line(meta)}",
        f"peak:    {meta['peak_flops'] / scale:.1f} {unit} {peak_dtype(meta)} matmul, "
        "measured on the spot"
        + ("" if "peak_flops_end" in meta else f" at the start only ({_unfinished(meta)})")
        + _peak_paths(meta)
        + _peak_dtype_why(meta),
        f"command: {meta['command']}{_commit_text(meta)}",
        "",
        *_completeness(meta, rows),
        *_busy_warning(meta),
        *_peak_drift_warning(meta),
        *_compiled_while_timed(rows),
    ]


def report_header(meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """The title, warnings about the sweep as a whole, and where and how it ran."""
    return [
        "# Training-step profile by attention variant and depth",
        "",
        *_completeness(meta, rows),
        *_busy_warning(meta),
        *_peak_drift_warning(meta),
        *_compiled_while_timed(rows),
        f"- **Machine**: {_machine_line(meta)}",
        f"- **Setup**: {setup_line(meta)}; {_steps(meta['steps'], 'timed step')} per cell "
        f"after {_steps(meta['warmup'], 'warm-up step')}",
        f"- **Matmul peak** ({peak_dtype(meta)}): {_peak_readings(meta)}{_peak_paths(meta)}"
        + _peak_dtype_why(meta),
        f"- **Command**: `{meta['command']}` "
        f"(config `{meta['config_file']}`{_commit_text(meta)}), started {meta['started_at']}",
    ]
