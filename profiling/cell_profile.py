"""A cell's profiled steps, after its timed ones: run under the profiler (a trace written where
the flags ask for one), and read into the fields of its row: ops and kernels by region, the time
split, the backend that ran, the trace and the peak memory."""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from profiling.analysis import REGIONS, label
from profiling.cells import Cell
from profiling.measure import (
    TRACE_WARN_BYTES,
    attention_calls_marked,
    backend_that_ran,
    peak_memory,
    profiled_steps,
    synchronize,
)
from profiling.method import PROFILE_LEAD_STEPS

if TYPE_CHECKING:
    from profiling.sweep import SweepOptions


def profile_cell(cell: Cell, options: SweepOptions, device: torch.device) -> dict[str, Any]:
    active = options.profile_steps
    trace = options.out / "traces" / f"{label(cell.variant, cell.compiled)}_L{cell.n_layer}.json.gz"
    wanted = options.traces and (not options.trace_layers or cell.n_layer in options.trace_layers)
    marked = contextlib.nullcontext() if cell.compiled else attention_calls_marked(cell.model)
    with (
        marked,
        profiled_steps(
            device, active, trace if wanted else None, options.trace_stacks and wanted
        ) as (advance, results),
    ):
        for _ in range(PROFILE_LEAD_STEPS + active):
            cell.step()
            synchronize(device)
            advance()
    seen = results[0]
    if seen.trace_error is not None:
        tqdm.write(
            f"warning: {seen.trace_error}; the cell's measurements are kept", file=sys.stderr
        )
    if seen.trace_bytes > TRACE_WARN_BYTES:
        tqdm.write(
            f"warning: trace {seen.trace} is {seen.trace_bytes / 2**20:.0f} MB unzipped, "
            "what a viewer loads; lower --profile-steps or the model size"
            + (", or leave out --trace-stacks" if options.trace_stacks else ""),
            file=sys.stderr,
        )
    counts = seen.per_step(active)
    # Ops are placed by the regions training.step.train_step names: a region renamed there
    # would otherwise count its ops as none.
    empty = [region for region in REGIONS if not counts["ops"][region]]
    if empty:
        raise RuntimeError(
            f"no ATen ops in the profiled steps' {' and '.join(empty)} region: the step "
            f"names its regions otherwise than the profiler ({', '.join(REGIONS)})"
        )
    fields: dict[str, Any] = {
        "ops_per_step": counts["ops"],
        "kernels_per_step": counts["kernels"] if device.type == "cuda" else None,
        "kernels_unattributed_per_step": (
            counts["unattributed"] if device.type == "cuda" else None
        ),
        "cpu_ms_per_step": counts["cpu_ms"],
        "time_split": counts["time_split"],
        "device_ms_per_step": counts["device_ms"] if device.type == "cuda" else None,
        "backend": backend_that_ran(counts["ops"]),
        "trace": str(seen.trace.relative_to(options.out)) if seen.trace else None,
        "trace_error": seen.trace_error,
        "peak_mem_bytes": peak_memory(
            cell.model, cell.optimizer, cell.step, device, seen.peak_transient_bytes
        ),
    }
    return fields
