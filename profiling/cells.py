"""A sweep's cells (variant x n_layer x compile) and what is worked out from each one's steps:
compile time, page faults, garbage collections, allocator calls and failures, and the row each
one gets in results.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from console import one_line
from profiling.analysis import label
from training.metrics import summarize_ms

# What a row keeps where another backend than the variant's ran: which cell it is, what ran
# (the backend, ops, kernels, trace: they show why) and the step's counted FLOPs. Every other
# field, the measured numbers, is cleared: they are not the variant's.
KEPT_ON_WRONG_BACKEND = frozenset(
    {
        "variant",
        "n_layer",
        "compile",
        "label",
        "status",
        "reason",
        "flops_per_step",
        "attention_flops_per_step",
        "compile_cache",
        "backend",
        "ops_per_step",
        "kernels_per_step",
        "kernels_unattributed_per_step",
        "trace",
        "trace_error",
    }
)


@dataclasses.dataclass
class Cell:
    variant: str
    n_layer: int
    compiled: bool
    step: Callable[[], object] | None = None
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    times: list[float] = dataclasses.field(default_factory=list)
    page_faults: int = 0  # minor page faults of this process during the timed steps
    # The collector's runs that landed in the timed steps: (generation, seconds) each
    gc_runs: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    # CUDA (None elsewhere): the caching allocator's calls to allocate and free device memory
    # during the timed steps, and its retries then (see allocator_counts)
    device_allocs: int | None = None
    alloc_retries: int | None = None
    first_step_s: float | None = None
    # Compiled cells: the first-step excess over the median step of the eager cell of the same
    # variant and depth, the part of the compiled cell's excess that is not compilation.
    eager_excess_s: float | None = None
    compile_cache: str | None = None  # compiled cells: what Inductor's cache held (see below)
    # Eager cells: their first step compiled something all the same (flex compiles its kernel)
    first_step_compiled: bool = False
    compiles_while_timed: int = 0  # timed steps in which something was compiled
    status: str = "ok"
    reason: str | None = None
    done: int = 0  # of its warm-up, timed and profiled steps, how many the progress bar shows

    @property
    def name(self) -> str:
        return f"{label(self.variant, self.compiled)} L{self.n_layer}"

    def fail(self, status: str, error: BaseException | str) -> None:
        self.status = status
        self.reason = error if isinstance(error, str) else one_line(error)
        self.step = self.model = self.optimizer = None

    def row(self, flops: tuple[int, int], tokens_per_step: int) -> dict[str, Any]:
        """The cell's row, with the timed steps' numbers where it has them: a failure in the
        profiled steps after them (the trace's write, memory) marks the cell failed and
        leaves them in its row."""
        row: dict[str, Any] = {
            "variant": self.variant,
            "n_layer": self.n_layer,
            "compile": self.compiled,
            "label": label(self.variant, self.compiled),
            "status": self.status,
            "reason": self.reason,
            "step_ms": None,
            "times_ms": None,
            "tokens_per_s": None,
            "flops_per_step": flops[0] or None,
            "attention_flops_per_step": flops[1] or None,
            "mfu": None,
            "peak_mem_bytes": None,
            "compile_s": None,
            "compile_cache": self.compile_cache,
            "first_step_ms": None,
            "eager_excess_s": None,
            "backend": None,
            "ops_per_step": None,
            "kernels_per_step": None,
            "kernels_unattributed_per_step": None,
            "page_faults_per_step": None,
            "gc_collections": None,
            "gc_longest_ms": None,
            "compiles_while_timed": None,
            "allocator_calls_per_step": None,
            "alloc_retries": None,
            "cpu_ms_per_step": None,
            "device_ms_per_step": None,
            "time_split": None,
            "trace": None,
            "trace_error": None,  # why a trace asked for was not written (a full disk)
        }
        if self.step is not None:
            row.update(self._timing_fields(tokens_per_step))
        return row

    def _timing_fields(self, tokens_per_step: int) -> dict[str, Any]:
        stats = summarize_ms(self.times)
        fields: dict[str, Any] = {
            "step_ms": stats,
            # Each timed step, in round order: round i's steps of a depth's cells pair up
            "times_ms": [t * 1e3 for t in self.times],
            "tokens_per_s": tokens_per_step / (stats["median"] / 1e3),
            "page_faults_per_step": self.page_faults / len(self.times),
            # Over all the timed steps, by generation (2: a full collection)
            "gc_collections": [
                sum(g == generation for g, _ in self.gc_runs) for generation in range(3)
            ],
            "gc_longest_ms": max((s * 1e3 for _, s in self.gc_runs), default=0.0),
            "compiles_while_timed": self.compiles_while_timed,
        }
        if self.device_allocs is not None:
            fields["allocator_calls_per_step"] = self.device_allocs / len(self.times)
            fields["alloc_retries"] = self.alloc_retries  # over all the timed steps
        if self.first_step_s is not None:
            fields["first_step_ms"] = self.first_step_s * 1e3
        if self.compiled and self.first_step_s is not None:
            fields["eager_excess_s"] = self.eager_excess_s
            if self.compile_cache not in ("none", "shared"):  # else it compiled nothing
                fields["compile_s"] = compile_seconds(
                    self.first_step_s, stats["median"] / 1e3, self.eager_excess_s
                )
        return fields


def eager_first_step_excess(cells: list[Cell]) -> dict[str, float]:
    """By variant, what its eager cell's first step took beyond its median step: what any first
    step pays (AdamW's state, the allocator's and oneDNN's set-up), which a compiled cell's
    excess holds too. Not where that first step compiled something itself (eager flex compiles
    its kernel): its excess is compilation too, and taking it off would hide it."""
    return {
        cell.variant: cell.first_step_s - statistics.median(cell.times)
        for cell in cells
        if not cell.compiled
        and not cell.first_step_compiled
        and cell.status == "ok"
        and cell.first_step_s is not None
        and cell.times
    }


def compile_seconds(
    first_step_s: float, median_s: float, eager_excess_s: float | None
) -> float | None:
    """A compiled cell's compile time: its first step less its median step, less its eager
    twin's excess where there is one. None where the twin's excess is the larger: each is a
    single first step, and the compile time (mostly tracing, from a warm cache) is within
    their noise: not 0."""
    # A twin's first step faster than its median is noise, not time to give back.
    net = first_step_s - median_s - max(0.0, eager_excess_s or 0.0)
    return net if net > 0 else None


def minor_faults() -> int:
    """Minor page faults of this process so far: pages the OS had to map in and zero."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class GcRuns:
    """The garbage collector's runs while inside `watching()`: (generation, seconds) each, in
    order, read from gc.callbacks, which Python calls as each run starts and stops."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, float]] = []
        self._started: float | None = None

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:  # not a run already going when watching began
            self.runs.append((info["generation"], time.perf_counter() - self._started))
            self._started = None

    @contextlib.contextmanager
    def watching(self) -> Iterator[GcRuns]:
        gc.callbacks.append(self._callback)
        try:
            yield self
        finally:
            gc.callbacks.remove(self._callback)


def allocator_counts(stats: dict[str, int]) -> tuple[int, int]:
    """From torch.cuda.memory_stats(): the caching allocator's calls to allocate and free device
    memory so far (cudaMalloc and cudaFree, or cuMemMap and cuMemUnmap with expandable
    segments), and its retries: allocations the device refused, retried after the cache was
    freed. A settled allocator makes none. cudaFree waits until the device has finished its
    queued work, so a step that frees device memory can leave the GPU idle; whether that is
    where a step's time with no kernel running goes is for a GPU run to show."""
    calls = stats.get("num_device_alloc", 0) + stats.get("num_device_free", 0)
    return calls, stats.get("num_alloc_retries", 0)


def compile_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    inductor = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")
    return {k: counters["inductor"][k] for k in inductor} | {
        "graphs": counters["stats"]["unique_graphs"]  # traced by Dynamo
    }


def kernel_libraries() -> int:
    """The shared libraries in Inductor's cache folder: the C++ kernels it has built, in this
    process or its compile workers. A graph found in the FX graph cache can still build its
    kernels again (their libraries gone, or keyed by other compiler flags), which no counter
    shows; the files do. Read around a cell's first step only: it walks the folder."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = Path(cache_dir())
    triton = root / "triton"  # on CUDA, Triton's own launchers and utilities: not kernels built
    return sum(1 for path in root.rglob("*.so") if triton not in path.parents)


def compile_cache(before: dict[str, int], after: dict[str, int], kernels_built: int = 0) -> str:
    """'cached' if Inductor's on-disk caches held every graph the step compiled and its
    kernels (the compile time is then mostly Dynamo's tracing), 'cold' if it compiled any
    itself (a cache miss, a graph the cache passes by, the cache off, or a C++ kernel built
    again behind a graph found there), 'none' if the step compiled nothing. (The sweep adds
    'shared' and 'partly shared': see _time.)"""
    new = {k: after[k] - before[k] for k in after}
    if new["fxgraph_cache_miss"] or new["fxgraph_cache_bypass"] or kernels_built > 0:
        return "cold"
    if new["fxgraph_cache_hit"]:
        return "cached"
    return "cold" if new["graphs"] else "none"
