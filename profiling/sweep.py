"""One sweep of training steps over variants x n_layer x compile: time, profile, count, record.

Each cell is built the way train.py builds a run (training.step.build_model) and stepped
with training.step.train_step, the step train.py's loop runs, imported: the sweep measures
what training runs. profile_train.py is the command line around it; a cell's profiled steps,
read into its row, are profiling/cell_profile.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import gc
import itertools
import math
import os
import platform
import shlex
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from console import first_line
from model import VARIANTS
from profiling.analysis import balanced_orders
from profiling.cell_profile import profile_cell
from profiling.cells import (
    KEPT_ON_WRONG_BACKEND,
    Cell,
    GcRuns,
    allocator_counts,
    compile_cache,
    compile_counters,
    eager_first_step_excess,
    kernel_libraries,
    minor_faults,
)
from profiling.header import peak_dtype
from profiling.measure import (
    backend_problem,
    matmul_peaks,
    step_flops,
    synchronize,
    timed,
)
from profiling.method import METHOD, MIN_TIMED_STEPS, PROFILE_LEAD_STEPS, STARTUP
from profiling.progress import Progress
from profiling.results import render_results, write_json
from profiling.startup import BATCH_POOL, batch_pool, device_name, warm_up
from training.checkpoint import provenance
from training.config import Config, ConfigError
from training.cpu_linear import wants_onednn
from training.host import OtherLoad, keep_freed_host_memory, reserve_heap
from training.probe import unavailable_reason
from training.rundir import make_sweep_folder, point_latest, sweep_lock
from training.runtime import (
    autocast_dtype,
    dtype_name,
    missing_bf16_instructions,
    out_of_memory,
    pick_device,
    set_fp32_matmul_precision,
)
from training.step import build_model, train_step

HEAP_RESERVE = 256 << 20  # CPU, memory kept: heap faulted in before each depth's timed steps


# --compile: which of eager (False) and compiled (True) cells a sweep measures
COMPILE_MODES = {"off": [False], "on": [True], "both": [False, True]}


@dataclasses.dataclass(frozen=True)
class SweepOptions:
    """What profile_train.py's flags ask of a sweep, checked there."""

    config_file: Path  # --config, recorded in meta
    out: Path  # a new or empty folder
    data: str  # "synthetic", or a prepared corpus's name
    steps: int | None  # timed steps per cell; None: MIN_TIMED_STEPS, in whole sets of orders
    warmup: int
    profile_steps: int  # the profiler's active steps
    peak_seconds: float  # per matmul size, measuring the peak
    traces: bool
    trace_layers: frozenset[int]  # the depths whose cells write a trace; empty: all
    trace_stacks: bool
    compile: str | None  # off, on or both; None: as the config's train.compile says
    host_memory: str  # keep or release
    link_latest: bool = False  # a default (timestamped) folder: `latest` points at it


class Sweep:
    def __init__(
        self,
        config: Config,
        options: SweepOptions,
        unavailable: dict[str, str | None] | None = None,
        raise_if_interrupted: Callable[[], None] = lambda: None,
    ) -> None:
        train = config.train.in_one_process()
        # --compile off|on|both, by default as the config's train.compile says; train.compile
        # then records whether any cell compiles (meta.compile says which).
        self.compile_mode = options.compile or ("on" if config.train.compile else "off")
        if self.compile_mode not in COMPILE_MODES:
            raise ConfigError(
                f"--compile={options.compile}: choose one of {', '.join(COMPILE_MODES)}"
            )
        config = dataclasses.replace(
            config,
            train=dataclasses.replace(train, compile=self.compile_mode != "off"),
            data=dataclasses.replace(config.data, name=options.data),  # what the sweep reads
        )
        self.config, self.options = config, options
        self.device = pick_device(config.train.device)
        set_fp32_matmul_precision(config.train.dtype, self.device)  # before the peak is measured
        self.amp_dtype = autocast_dtype(config.train.dtype, self.device)
        self.dtype = self.amp_dtype or torch.float32
        # The peak is measured in the run's dtype, but for bfloat16 on a CPU without bf16
        # instructions: ATen's generic kernel is at its slowest in the peak's layout (a @ b, both
        # row-major: 1 GFLOP/s on a 2-core AVX2 VM, 17 s a 2048-square matmul), nn.Linear's
        # transposed layouts ran 11 to 19 times as fast (MFU read 310-357% against it), and
        # float32's is the fastest matmul such a CPU has.
        self.slow_bf16 = missing_bf16_instructions(self.device, self.amp_dtype)
        self.peak_dtype = torch.float32 if self.slow_bf16 else self.dtype
        # tf32: fp32 tensors, TF32 matmuls; the peak is measured with them too
        self.dtype_name = dtype_name(config.train.dtype, self.amp_dtype)
        self.onednn = wants_onednn(config.train.cpu_linear, self.device, self.amp_dtype is not None)
        self.host_memory = "release"
        if options.host_memory == "keep" and self.device.type == "cpu":
            if keep_freed_host_memory():
                self.host_memory = "keep"
            else:  # not silently: the report's page faults are then the C library's default
                print(
                    "note: --host-memory keep: this C library's malloc cannot be tuned "
                    "(glibc's mallopt only); freed memory is left to it, as with "
                    "--host-memory release",
                    file=sys.stderr,
                )
        self.out = options.out
        # Set once this sweep holds --out: what is there from then on is its own. Before, it
        # may be another sweep's, started a moment earlier with the same --out.
        self.held_out = False
        # Raises if a Ctrl-C or SIGTERM arrived, in case Python dropped the exception its
        # handler raised. Called before every step.
        self.raise_if_interrupted = raise_if_interrupted
        # Timed steps per cell; without --steps, run rounds it up to whole sets of orders
        self.steps = MIN_TIMED_STEPS if options.steps is None else options.steps
        self.tokens_per_step = config.tokens_per_step()
        self.latest_pending = options.link_latest  # `latest` is pointed here at the first write
        self.render_failed = False  # warned once, between cells
        self.rows: list[dict[str, Any]] = []
        # The depth being profiled: its cells, timed, and the FLOPs of its step (see run)
        self.timed: tuple[list[Cell], tuple[int, int]] | None = None
        # By variant: why it cannot run (None: it can), probed once: the caller's probes, if
        # it ran them (each runs the variant, and flex compiles), then the sweep's own
        self.unavailable: dict[str, str | None] = dict(unavailable or {})
        # Set by run: the pinned variants whose compiled cells are left out, as sdpa+compile
        # is among the cells (see _build).
        self.pinned_apart: list[str] = []
        self.batches = batch_pool(config, self.device)
        self.meta = self._meta()

    # --- setup ---------------------------------------------------------------------------------

    def _meta(self) -> dict[str, Any]:
        meta = {
            "device": str(self.device),
            "device_name": device_name(self.device),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "host_memory": self.host_memory,
            # the heap grown by this much (faulted in, freed) before each depth's timed steps
            "heap_reserve_bytes": HEAP_RESERVE if self.host_memory == "keep" else None,
            "linear": "oneDNN" if self.onednn else "torch",
            "torch_version": torch.__version__,
            "commit": provenance()["commit"],  # this project's, '-dirty' with local changes
            "python": platform.python_version(),
            "platform": platform.platform(),
            "dtype": self.dtype_name,
            "autocast": self.amp_dtype is not None,
            "config": dataclasses.asdict(self.config),
            "config_file": str(self.options.config_file),
            "data": self.options.data,
            "steps": self.steps,
            "warmup": self.options.warmup,
            "compile": self.compile_mode,  # off, on or both
            **METHOD,
            "profile_steps": self.options.profile_steps,
            "traces": bool(self.options.traces),  # False: --no-traces
            "command": "python " + shlex.join(sys.argv),
            "out": str(self.out),
            "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        }
        if self.device.type == "cuda":
            meta["cuda"] = torch.version.cuda
            meta["cudnn"] = torch.backends.cudnn.version()
        if self.peak_dtype != self.dtype:
            meta["peak_dtype"] = str(self.peak_dtype).removeprefix("torch.")
            meta["peak_dtype_why"] = self.slow_bf16
        return meta

    def _left_out(self, variant: str, compiled: bool) -> str | None:
        """Why a cell does not run here (it is then "unsupported"), or None if it runs."""
        if variant not in self.unavailable:  # the probe runs the variant: once is enough
            mc = self.config.model
            self.unavailable[variant] = unavailable_reason(
                variant, self.device, self.dtype, mc.head_size, mc.dropout
            )
        reason = self.unavailable[variant]
        if reason is not None:
            return f"{variant} cannot run on {self.device}: {reason}"
        if compiled and variant in self.pinned_apart:
            # A pinned call is kept out of the graph (model/attention.py): Dynamo breaks the
            # block's graph there, and its cache entries for the break do not check which
            # function the block calls. sdpa's blocks, the same Block.forward with the same
            # None mask and no break of their own, would then run through them: more graphs,
            # and compiles while timed. (Pinned variants share those entries harmlessly: each
            # still calls its own function at the break.)
            return (
                "not compiled beside sdpa+compile, which would reuse its graph break at the "
                "pinned call; the pinned variants' compiled cells in a sweep without sdpa: "
                f"--variants naive,{','.join(self.pinned_apart)} --compile on"
            )
        return None

    def _build(self, cell: Cell) -> None:
        mc, tc = self.config.model, self.config.train
        reason = self._left_out(cell.variant, cell.compiled)
        if reason is not None:
            cell.fail("unsupported", reason)
            return
        torch.manual_seed(tc.seed)
        model_cfg = dataclasses.replace(mc, attention=cell.variant, n_layer=cell.n_layer)
        cell.model, cell.optimizer = build_model(
            model_cfg, tc, self.device, onednn=self.onednn, compile=cell.compiled
        )
        turn = itertools.count()

        def step() -> object:
            self.raise_if_interrupted()
            micro = self.batches[next(turn) % BATCH_POOL]
            return train_step(cell.model, cell.optimizer, micro, tc.grad_clip, self.amp_dtype)

        cell.step = step

    # --- the sweep ------------------------------------------------------------------------------

    def run(self, variants: list[str], layers: list[int], compile_modes: list[bool]) -> None:
        # A default folder is this sweep's alone: one started in the same second may have taken
        # the name since main chose it.
        make_sweep_folder(self.out, exclusive=self.options.link_latest)
        with sweep_lock(self.out):
            # Checked empty by main, before the lock: a sweep that ended meanwhile may have
            # written there, and its files are not this one's to overwrite.
            written = sorted(p.name for p in self.out.iterdir() if p.name != ".lock")
            if written:
                raise ConfigError(
                    f"--out {self.out}: another sweep wrote there since this one started "
                    f"({', '.join(written[:3])}); choose another folder"
                )
            self.held_out = True
            self._run(variants, layers, compile_modes)

    def _run(self, variants: list[str], layers: list[int], compile_modes: list[bool]) -> None:
        self.other_load = OtherLoad(running=False)  # counts in the timed rounds only
        if self.slow_bf16:  # once every setting has passed its check
            print(
                f"warning: train.dtype={self.config.train.dtype!r}: {self.slow_bf16}; MFU here "
                "is against float32's matmul peak, the fastest this CPU has",
                file=sys.stderr,
            )
        print(
            f"measuring the {peak_dtype(self.meta)} matmul peak of {self.meta['device_name']} ...",
            file=sys.stderr,
        )
        start = matmul_peaks(self.device, self.peak_dtype, self.options.peak_seconds)
        self.meta["peak_flops_start"] = max(start.values())
        self.meta["peak_flops"] = self.meta["peak_flops_start"]
        self.meta["peak_flops_by_path"] = start
        total = len(variants) * len(layers) * len(compile_modes)
        if "sdpa" in variants and any(compile_modes):
            self.pinned_apart = [v for v in variants if VARIANTS[v].backend is not None]
        self.meta["cells_planned"] = total
        # The cells each round runs: those that can run here and are not left out
        timed = sum(self._left_out(v, c) is None for v in variants for c in compile_modes)
        orders = len(balanced_orders(timed))
        if self.options.steps is None:
            self.steps = orders * math.ceil(MIN_TIMED_STEPS / orders)
        self.meta["steps"] = self.steps
        if self.steps % orders:
            print(
                f"warning: --steps {self.steps} is not a multiple of {orders}, the number "
                f"of orders that balance {timed} cells per depth: some cells will run in some "
                f"positions more often (--steps {orders * max(1, round(self.steps / orders))}"
                " would balance them)",
                file=sys.stderr,
            )
        seconds = warm_up(
            self.config, self.device, self.onednn, self.amp_dtype, compiled=any(compile_modes)
        )
        if seconds is not None:
            self.meta["startup"] = STARTUP
            if any(compile_modes):  # its graphs go with the first depth's Dynamo reset
                self.meta["compiler_startup_s"] = seconds
        # A depth's variants share Block.forward, and each adds a Dynamo cache entry to it. Past
        # the limit Dynamo would run the block eager with only a warning, under a "+compile"
        # label: the limit leaves room for them all, and hitting it fails the cell instead.
        no_silent_eager = torch._dynamo.config.patch(
            recompile_limit=max(8, 2 * len(variants)), fail_on_recompile_limit_hit=True
        )
        # A cell's warm-up, timed and profiled (wait, warmup, active) steps
        steps = self.options.warmup + self.steps + PROFILE_LEAD_STEPS + self.options.profile_steps
        try:
            self.progress = Progress(layers, len(variants) * len(compile_modes), steps, total)
            with no_silent_eager, self.progress:
                for n_layer in layers:
                    cells = [Cell(v, n_layer, c) for v in variants for c in compile_modes]
                    flops = step_flops(self.config, n_layer)
                    self.timed = (cells, flops)  # kept on a Ctrl-C from the first round on
                    self._time(cells)
                    for cell in cells:
                        self._profile_and_record(cell, flops)
                        self.progress.advance(cell)  # the rest: a failed cell's, all of it
                        self.progress.say(len(self.rows))
                    synchronize(self.device)
                    if self.device.type == "cuda":
                        torch.cuda.empty_cache()
            # A second reading of the peak: the MFU denominator is the higher of the two.
            end = matmul_peaks(self.device, self.peak_dtype, self.options.peak_seconds)
        except BaseException:  # Ctrl-C above all: the plots of what was measured, then stop
            # The report tells a stopped sweep from one still running (it writes after each cell)
            self.meta["stopped_at"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
            self._record_timed_only()
            if self.rows:
                self._write(plots=True)
            raise
        self.meta["peak_flops_end"] = max(end.values())
        self.meta["peak_flops"] = max(self.meta["peak_flops_start"], self.meta["peak_flops_end"])
        self.meta["peak_flops_by_path"] = {
            path: max(start.get(path, 0.0), end.get(path, 0.0)) for path in start | end
        }
        for row in self.rows:
            row["mfu"] = self._mfu(row)
        self._write(plots=True)
        # Once every file is written: a results.json with finished_at is a whole sweep's.
        self.meta["finished_at"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        write_json(self.out, self.meta, self.rows)

    def _time(self, cells: list[Cell]) -> None:
        if any(cell.compiled for cell in cells):
            # Every depth compiles its own graphs: identical blocks would otherwise reuse the
            # last depth's, and its compile time would read ~0.
            torch._dynamo.reset()
        pinned_built = False  # whether a compiled cell of a pinned variant came before
        for cell in cells:
            self.progress.say(len(self.rows), f"warm-up {cell.name}")
            with self._guard(cell):
                self._build(cell)
                if cell.step is None:  # it will not run: its share of the bar is done now
                    self.progress.advance(cell)
                    continue
                # A full collection now (up to 0.2 s with the compiler's objects about), not
                # one that lands in this first step because of what earlier cells left.
                gc.collect()
                before = compile_counters()
                libraries = kernel_libraries() if cell.compiled else 0
                cell.first_step_s = timed(cell.step, self.device)  # includes compilation
                built = kernel_libraries() - libraries if cell.compiled else 0
                cache = compile_cache(before, compile_counters(), built)
                if cell.compiled:
                    cell.compile_cache = cache
                    if VARIANTS[cell.variant].backend is not None:
                        # Pinned variants' blocks break at the same call, so a later one runs
                        # graphs compiled for the first, all of them or all but those its
                        # attention's output strides change: its first step times that rest.
                        if pinned_built:
                            cell.compile_cache = "shared" if cache == "none" else "partly shared"
                        pinned_built = True
                else:
                    cell.first_step_compiled = cache != "none"
                for _ in range(self.options.warmup - 1):
                    timed(cell.step, self.device)
                self.progress.advance(cell, self.options.warmup)
        if self.host_memory == "keep":
            # Room for the heap's growth as the cells' allocations interleave: fragmentation
            # would otherwise fault fresh pages in during the timed steps (at the profile
            # shape, up to 1,500 a step in naive at n_layer=8, where memory was kept).
            reserve_heap(HEAP_RESERVE)
        # What the warm-ups left is collected now, not in the timed steps. The collector stays
        # on in them, as in training.
        gc.collect()
        with self.other_load.counting(), GcRuns().watching() as gc_runs:
            self._timed_rounds(cells, gc_runs)
        _take_eager_excess(cells)
        # Interleaving keeps every cell of a depth built at once, so one may run out of memory
        # that alone would fit: say so, rather than charge the variant with all of it.
        resident = sum(cell.status in ("ok", "oom") for cell in cells) - 1
        for cell in cells:
            if cell.status == "oom" and resident > 0:
                cell.reason += (
                    f" (with up to {resident} other cell(s) of n_layer={cell.n_layer} in memory, "
                    f"as interleaved timing needs; alone: --variants {cell.variant} "
                    f"--layers {cell.n_layer} --compile {'on' if cell.compiled else 'off'})"
                )

    def _timed_rounds(self, cells: list[Cell], gc_runs: GcRuns) -> None:
        cells = [cell for cell in cells if cell.step is not None]  # left out, or failed to build
        if not cells:
            return
        orders = balanced_orders(len(cells))
        # What the report checks the rounds against: a whole number of these orders or not
        self.meta.setdefault("round_cells", {})[str(cells[0].n_layer)] = len(cells)
        for r in range(self.steps):
            self.progress.say(len(self.rows), f"L{cells[0].n_layer} round {r + 1}/{self.steps}")
            # Rounds of every cell: drift hits every variant alike; each round's order from a
            # balanced Latin square, so each cell follows every other equally often and what a
            # step inherits from the one before (caches, the heap's layout) is shared too.
            for cell in (cells[i] for i in orders[r % len(orders)]):
                if cell.step is None:
                    continue
                with self._guard(cell):
                    # read outside the step's window, as the allocator's counts are
                    compiles = compile_counters()
                    before = self._allocator()
                    faults = minor_faults()
                    runs = len(gc_runs.runs)
                    cell.times.append(timed(cell.step, self.device))
                    cell.gc_runs += gc_runs.runs[runs:]
                    cell.page_faults += minor_faults() - faults
                    after = self._allocator()
                    # A recompile (a guard that failed, a shape made dynamic) in a timed step:
                    # counted, so the report can say which times carry one.
                    cell.compiles_while_timed += compile_counters() != compiles
                    if before is not None and after is not None:
                        cell.device_allocs = (cell.device_allocs or 0) + after[0] - before[0]
                        cell.alloc_retries = (cell.alloc_retries or 0) + after[1] - before[1]
                self.progress.advance(cell, 1)

    def _allocator(self) -> tuple[int, int] | None:
        """allocator_counts on CUDA; None elsewhere, where there is no caching allocator."""
        if self.device.type != "cuda":
            return None
        return allocator_counts(torch.cuda.memory_stats(self.device))

    @contextlib.contextmanager
    def _guard(self, cell: Cell, during: str | None = None) -> Iterator[None]:
        """A cell that fails is recorded as failed (the reason after `during`, if given); the
        sweep goes on."""
        try:
            yield
        except Exception as e:  # not KeyboardInterrupt: Ctrl-C stops the sweep
            cell.fail("oom" if out_of_memory(e) else "failed", e)
            if during is not None:
                cell.reason = f"{during}: {cell.reason}"
            if cell.status == "failed":
                self._log_failure(cell, e)
        if cell.status != "ok" and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _log_failure(self, cell: Cell, error: Exception | None) -> None:
        """The whole traceback of a cell's failure, in DIR/failures.log: its row holds one
        line, which says what failed but not where (torch's error, or a bug here). A cell
        failed by the backend check raised nothing: its reason is all there is."""
        with contextlib.suppress(OSError), open(self.out / METHOD["failures_log"], "a") as log:
            log.write(f"--- {cell.name}: {cell.reason}\n")
            log.writelines(traceback.format_exception(error) if error else [])

    def _profile_and_record(self, cell: Cell, flops: tuple[int, int]) -> None:
        row = cell.row(flops, self.tokens_per_step)
        if cell.step is not None:
            with self._guard(cell, "in the profiled steps, after the timed ones"):
                row.update(profile_cell(cell, self.options, self.device))
                problem = backend_problem(cell.variant, row, self.device)
                if problem is not None:
                    # Another backend ran: its numbers are not the variant's. What ran (the
                    # backend, the ops and kernels, the trace) stays, to show why.
                    cell.fail("failed", problem)
                    self._log_failure(cell, None)
                    row.update(dict.fromkeys(row.keys() - KEPT_ON_WRONG_BACKEND))
        row["status"], row["reason"] = cell.status, cell.reason
        row["mfu"] = self._mfu(row)
        self.rows.append(row)
        cell.step = cell.model = cell.optimizer = None  # free it before the next depth
        self._write()

    def _record_timed_only(self) -> None:
        """On a Ctrl-C (or SIGTERM) during a depth's timed rounds or while its cells are
        profiled one by one: a row for each cell with timed steps but no profiled ones, with
        its step times, so a stopped sweep keeps all it timed. Not "ok": no trace verified its
        backend, and rounds cut short may have timed it fewer times than the others."""
        cells, flops = self.timed or ([], (0, 0))
        _take_eager_excess(cells)  # stopped in the rounds, before _time took it
        for cell in cells:
            if cell.step is not None and cell.status == "ok" and cell.times:
                row = cell.row(flops, self.tokens_per_step)
                row["status"] = "interrupted"
                timed = "its steps were timed"
                if len(cell.times) < self.steps:
                    timed = f"{len(cell.times)} of its {self.steps} steps were timed"
                row["reason"] = (
                    f"the sweep was stopped before its profiled steps: {timed}, its ops, "
                    "memory and backend not measured"
                )
                self.rows.append(row)
                cell.step = None

    def _mfu(self, row: dict[str, Any]) -> float | None:
        """Counted FLOPs / median step time / the highest matmul peak measured so far."""
        if row["status"] != "ok" or not row["flops_per_step"] or not row["step_ms"]:
            return None
        return row["flops_per_step"] / (row["step_ms"]["median"] / 1e3) / self.meta["peak_flops"]

    # --- output ---------------------------------------------------------------------------------

    def _write(self, plots: bool = False) -> None:
        """results.json, results.csv and the report after every cell, so an interrupted sweep
        keeps what it measured; the plots at the end (or the interruption), as they are slow.
        `latest` moves to a default folder once it holds a result."""
        self.meta["other_cpu_share"] = self.other_load.share()
        results = write_json(self.out, self.meta, self.rows)
        if self.latest_pending:
            point_latest(self.out)
            self.latest_pending = False
        try:
            render_results(self.out, results, plots)
        except Exception as e:  # a bug in the report's code: the disk's errors are raised
            if plots or isinstance(e, OSError):  # at the end, the error itself
                raise
            # Between cells the measuring goes on: results.json has every row, and the end
            # renders again (or `--report` once the bug is fixed).
            if not self.render_failed:
                tqdm.write(
                    f"warning: the report could not be drawn ({type(e).__name__}: "
                    f"{first_line(e)}); measuring goes on, results.json is written",
                    file=sys.stderr,
                )
            self.render_failed = True


def _take_eager_excess(cells: list[Cell]) -> None:
    """Give each compiled cell its eager twin's first-step excess, which its compile time nets
    out (see eager_first_step_excess)."""
    excess = eager_first_step_excess(cells)
    for cell in cells:
        if cell.compiled:
            cell.eager_excess_s = excess.get(cell.variant)
