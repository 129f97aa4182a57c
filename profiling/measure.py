"""Measurements of one training step: wall time, ops and kernels by region, memory, FLOPs.

Each measurement runs in its own steps: the profiler is never attached to a timed step.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import itertools
import os
import re
import shutil
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function, schedule
from torch.utils.flop_counter import FlopCounterMode
from tqdm import tqdm

from console import one_line
from model.attention import VARIANTS, AttentionFn
from model.gpt import CausalSelfAttention
from profiling.analysis import REGIONS
from profiling.method import PROFILE_WAIT, PROFILE_WARMUP
from profiling.names import (
    ATTENTION_CALL,
    OP_NAMESPACES,
    OTHER,
    enclosing_category,
    shares,
    time_category,
)
from training.config import Config
from training.cpu_linear import onednn_unavailable_reason
from training.probe import BACKEND_OPS, sdpa_ops_instead
from training.step import build_model, train_step

TRACE_WARN_BYTES = 50 * 2**20
TOP_TIMES = 12  # ops or kernels listed by name in "where the time goes"

# A pattern the CUDA kernels of each pinned SDPA backend match, beside its ATen op
# (probe.BACKEND_OPS).
BACKEND_KERNELS = {  # PyTorch's FA2 kernels; its cutlass "mem-efficient" kernels; cuDNN's
    "FLASH_ATTENTION": re.compile(r"flash_(fwd|bwd)"),
    "EFFICIENT_ATTENTION": re.compile(r"fmha_cutlass[FB]|AttentionKernel|AttentionBackwardKernel"),
    "CUDNN_ATTENTION": re.compile(r"cudnn", re.I),
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds for one call of fn, the device drained before and after."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def matmul_peaks(
    device: torch.device, dtype: torch.dtype, seconds: float = 0.5
) -> dict[str, float]:
    """The best matmul rate in `dtype` by each path PyTorch offers here, measured now (FLOP/s).

    `torch.mm` goes to the BLAS (MKL or OpenBLAS on CPUs, cuBLAS on GPUs). On CPUs PyTorch also
    ships oneDNN, whose matmul can be much faster: MKL runs AVX2 code on AMD processors, oneDNN
    their AVX-512. The device's peak, the MFU denominator, is the highest of these. (oneDNN's
    bfloat16 path raises on a CPU without bf16 instructions: a sweep asks for float32's there,
    see missing_bf16_instructions.)
    """
    sizes = (1024, 2048) if device.type == "cpu" else (4096, 8192)
    peaks = {"torch.mm": max(_matmul_rate(n, device, dtype, seconds) for n in sizes)}
    if device.type == "cpu" and onednn_unavailable_reason() is None:
        peaks["oneDNN"] = _matmul_rate(2048, device, dtype, seconds, onednn=True)
    return peaks


def _matmul_rate(
    n: int, device: torch.device, dtype: torch.dtype, seconds: float, onednn: bool = False
) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    if onednn:  # a @ w.T, w packed once into oneDNN's layout: its kernel's best case
        w = torch.ops.mkldnn._reorder_linear_weight(b, None)
        matmul = lambda: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")
    else:
        matmul = lambda: torch.mm(a, b, out=c)

    def run(reps: int) -> None:
        for _ in range(reps):
            matmul()

    run(1)  # warm-up: thread pool, kernel selection
    reps = max(1, int(seconds / max(timed(lambda: run(1), device), 1e-6)))
    return max(2 * n**3 * reps / timed(lambda: run(reps), device) for _ in range(3))


def count_flops(step: Callable[[], object]) -> dict[str, int]:
    """FLOPs of one call of `step` by op ('aten.mm', 'aten.bmm', ...), counted by
    torch.utils.flop_counter (matmul-class ops)."""
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return {str(op): n for op, n in counter.get_flop_counts().get("Global", {}).items()}


def step_flops(config: Config, n_layer: int) -> tuple[int, int]:
    """FLOPs of one step at this depth, counted on an eager `naive` model, and the part of
    them in attention's (B, H, T, T) products (naive's batched matmuls, `aten.bmm`).

    Every variant computes the same function, so all share this count: MFU then compares
    variants by one measure of work, not by what each implementation happens to do. As in
    nanoGPT's and PaLM's MFU, attention counts over the full T x T; the report also gives
    MFU with only the causal half of that part counted.

    The step runs on the meta device, shapes without data: no memory and no compute, so a
    depth where naive, the variant that needs the most memory, would not fit on the device
    still gets its count.
    """
    mc, tc = config.model, config.train
    meta = torch.device("meta")
    try:
        with meta:
            model_cfg = replace(mc, attention="naive", n_layer=n_layer)
            model, optimizer = build_model(model_cfg, tc, meta, onednn=False, compile=False)
            x = torch.zeros(tc.batch_size, mc.block_size, dtype=torch.long)  # ids, targets
        # The real step's count, as the tests check: FLOPs depend on neither the dtype (so
        # no autocast) nor the Linear path (training/cpu_linear.py counts the oneDNN op
        # as nn.Linear). Clipping is in it, and adds none: flop_counter counts matmuls only.
        micro = [(x, x)] * tc.grad_accum
        by_op = count_flops(lambda: train_step(model, optimizer, micro, tc.grad_clip))
    except Exception as e:  # not KeyboardInterrupt: Ctrl-C stops the sweep
        tqdm.write(
            f"warning: no FLOP count at n_layer={n_layer} ({one_line(e)}); no MFU there",
            file=sys.stderr,
        )
        return 0, 0
    return sum(by_op.values()), by_op.get("aten.bmm", 0)


def resident_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters, buffers (the causal mask naive and inplace read) and optimizer
    state: what lives on the device between steps."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    total = sum(t.numel() * t.element_size() for t in tensors)
    for state in optimizer.state.values():
        total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    return total


def peak_memory(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: Callable[[], object],
    device: torch.device,
    cpu_transient: int,
) -> int | None:
    """Resident state (parameters, buffers, optimizer state) plus the step's own peak above it.

    CUDA: the caching allocator's peak during one more unprofiled step. CPU: the peak of
    live bytes from the profiler's allocation events during the profiled step. MPS: None,
    not measured (its allocator keeps no peak, and the profiler records CPU allocations).
    """
    resident = resident_bytes(model, optimizer)
    if device.type == "cpu":
        return resident + cpu_transient
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    synchronize(device)
    return resident + torch.cuda.max_memory_allocated(device) - before


@dataclass
class StepProfile:
    """What the profiler saw, per step, by region. `kernels` is empty off CUDA."""

    ops: dict[str, Counter] = field(default_factory=lambda: {r: Counter() for r in REGIONS})
    kernels: dict[str, Counter] = field(default_factory=lambda: {r: Counter() for r in REGIONS})
    # CUDA kernels whose launching call is in no region or not in the trace at all: counted
    # here so that a launch API the profiler does not record shows, instead of vanishing.
    unattributed: Counter = field(default_factory=Counter)
    peak_transient_bytes: int = 0  # CPU: from the profiler's allocation events
    # Where the time goes: CPU self time of each op, and CUDA time of each kernel (us), by name
    # and by category (names.CATEGORIES).
    cpu_self_us: Counter = field(default_factory=Counter)
    device_us: Counter = field(default_factory=Counter)
    cpu_split_us: Counter = field(default_factory=Counter)
    device_split_us: Counter = field(default_factory=Counter)
    trace: Path | None = None
    trace_bytes: int = 0  # unzipped: what a viewer loads
    trace_error: str | None = None  # why no trace was written where one was asked for

    def per_step(self, steps: int) -> dict[str, dict[str, dict[str, float]]]:
        def scale(by_region: dict[str, Counter]) -> dict[str, dict[str, float]]:
            return {r: {n: c / steps for n, c in sorted(by_region[r].items())} for r in REGIONS}

        def top_ms(times: Counter) -> dict[str, float]:
            """The TOP_TIMES largest, in ms per step, and the rest summed as 'other'."""
            ranked = times.most_common()
            top = {n: us / 1e3 / steps for n, us in ranked[:TOP_TIMES]}
            rest = sum(us for _, us in ranked[TOP_TIMES:])
            return top | ({"other": rest / 1e3 / steps} if rest else {})

        return {
            "ops": scale(self.ops),
            "kernels": scale(self.kernels),
            "unattributed": {n: c / steps for n, c in sorted(self.unattributed.items())},
            "cpu_ms": top_ms(self.cpu_self_us),
            "device_ms": top_ms(self.device_us),
            # shares by category over every op or kernel, not only the listed ones
            "time_split": shares(self.device_split_us or self.cpu_split_us),
        }


def _region_of(start_ns: int, regions: list[tuple[int, int, str]]) -> str | None:
    for begin, end, name in regions:
        if begin <= start_ns <= end:
            return name
    return None


def _categorised(events: list) -> Iterator[tuple[Any, str | None, int, bool]]:
    """Each CPU event with the category it counts under, its self time (ns): its duration
    less that of the events directly inside it, and whether it is a re-dispatch: directly
    inside an event of its own name, as autocast records an op it wraps (`aten::linear` at
    the Autocast key, then again as it calls the op in the cast dtype): one call, not two.

    Events nest by time within their thread. The category is that of the outermost op around
    the event, itself included, that gives one (names.enclosing_category). Backward work
    goes where its forward op does: an autograd node carries the sequence number, and the
    forward thread, of the event that created it, the last there to start with that number
    (`ToCopyBackward0` of the cast autocast adds inside `aten::softmax` is attention's; a
    compiled graph's backward is `CompiledFunction`'s, an event with no op name).
    """
    threads: dict[int, list] = defaultdict(list)
    for e in events:
        # --trace-stacks's Python frames run inside the ops they call back into Python from
        # (the oneDNN linear's wrapper): left out, so that an op's self time is the same with
        # stacks or without, and no frame's time goes uncounted. Before torch 2.12 events()
        # held no frames, and its events have no is_python_function.
        python_frame = getattr(e, "is_python_function", None)
        if python_frame is None or not python_frame():
            threads[e.start_thread_id()].append(e)
    for thread in threads.values():
        thread.sort(key=lambda e: (e.start_ns(), -e.end_ns()))  # parents before their children

    creators: dict[tuple[int, int], tuple[int, str | None]] = {}  # (thread, seq): start, category
    for e, category, _, _ in _nest(threads.values(), linked=lambda e: None):
        if e.sequence_nr() >= 0 and e.fwd_thread_id() == 0:  # a forward event
            key = (e.start_thread_id(), e.sequence_nr())
            if key not in creators or e.start_ns() >= creators[key][0]:
                creators[key] = (e.start_ns(), category)

    def forward_category(e: Any) -> str | None:
        if e.fwd_thread_id() == 0 or e.sequence_nr() < 0:
            return None  # not an autograd node's event
        creator = creators.get((e.fwd_thread_id(), e.sequence_nr()))
        return creator[1] if creator else None

    yield from _nest(threads.values(), linked=forward_category)


@dataclass
class _Open:
    """An event the walk is inside of."""

    event: Any
    category: str | None
    redispatch: bool  # directly inside an event of the same name
    children_ns: int = 0

    def closed(self) -> tuple[Any, str | None, int, bool]:
        self_ns = max(0, self.event.duration_ns() - self.children_ns)
        return self.event, self.category, self_ns, self.redispatch


def _nest(
    threads: Iterable[list], linked: Callable[[Any], str | None]
) -> Iterator[tuple[Any, str | None, int, bool]]:
    """Walks each thread's events (sorted parents first) as a tree, as torch's profiler builds
    it: an event is inside the last open one if it starts before that one ends and ends no
    later. Yields (event, category, self time in ns, re-dispatch) as each event closes; the
    category is the enclosing event's, else `linked(event)`'s, else its own name's."""
    for thread in threads:
        stack: list[_Open] = []
        for e in thread:
            while stack and (
                stack[-1].event.end_ns() <= e.start_ns() or e.end_ns() > stack[-1].event.end_ns()
            ):
                yield stack.pop().closed()
            if stack:
                stack[-1].children_ns += e.duration_ns()
            outer = stack[-1].category if stack else None
            again = bool(stack) and stack[-1].event.name() == e.name()
            stack.append(_Open(e, outer or linked(e) or enclosing_category(e.name()), again))
        while stack:
            yield stack.pop().closed()


def parse_events(events: list, device: torch.device) -> StepProfile:
    """Count ops and kernels by region, and time them by name and by category, from the
    profiler's kineto events.

    Regions are the record_function ranges `forward`, `backward` and `optimizer`; an op, on
    whichever thread, belongs to the region its start falls in (the autograd engine runs CUDA
    backward ops on another thread, so parent links would miss them). A kernel belongs to the
    region of the CPU runtime call that launched it (cudaLaunchKernel, cuLaunchKernelEx,
    cudaMemcpyAsync, ...), found by correlation id, since GPU timestamps run behind the CPU's;
    its category is that call's, from the ops around it, else its own name's.
    """
    result = StepProfile()
    cpu = [e for e in events if e.device_type() == DeviceType.CPU]
    regions = sorted((e.start_ns(), e.end_ns(), e.name()) for e in cpu if e.name() in REGIONS)
    launches: dict[int, tuple[int, str | None]] = {}  # correlation id: (start, category)
    for e, category, self_ns, redispatch in _categorised(cpu):
        name = e.name()
        if name.startswith(OP_NAMESPACES):
            region = _region_of(e.start_ns(), regions)
            if region and not redispatch:
                result.ops[region][name] += 1
            result.cpu_self_us[name] += self_ns / 1e3
            result.cpu_split_us[category or OTHER] += self_ns / 1e3
        elif e.correlation_id() and name.startswith("cu"):
            launches[e.correlation_id()] = (e.start_ns(), category)
    if device.type == "cpu":
        live = 0
        for e in sorted((e for e in cpu if e.name() == "[memory]"), key=lambda e: e.start_ns()):
            live += e.nbytes()
            result.peak_transient_bytes = max(result.peak_transient_bytes, live)
    if device.type == "cuda":
        for e in events:
            if e.device_type() != DeviceType.CUDA or e.is_user_annotation() or "Sync" in e.name():
                continue  # annotations and synchronisation records are not work
            start, category = launches.get(e.correlation_id(), (None, None))
            region = _region_of(start, regions) if start is not None else None
            if region:
                result.kernels[region][e.name()] += 1
            else:
                result.unattributed[e.name()] += 1
            result.device_us[e.name()] += e.duration_ns() / 1e3
            result.device_split_us[category or time_category(e.name())] += e.duration_ns() / 1e3
    return result


@contextlib.contextmanager
def attention_calls_marked(model: torch.nn.Module) -> Iterator[None]:
    """Each layer's call of its attention variant runs inside a record_function range named
    ATTENTION_CALL while this lasts: in the time split, all that the variant runs (naive's
    scale multiply and dropout too, which no attention op encloses) and the backward of it
    count as attention, as they do inside SDPA's fused kernel. For an eager cell's profiled
    steps only: a compiled block holds the call in its graph, and swapping the function would
    recompile it."""
    layers = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    originals = [m.attend for m in layers]

    def marked(attend: AttentionFn) -> AttentionFn:
        def fn(*args: Any, **kwargs: Any) -> torch.Tensor:
            with record_function(ATTENTION_CALL):
                return attend(*args, **kwargs)

        return fn

    for layer, attend in zip(layers, originals, strict=True):
        layer.attend = marked(attend)
    try:
        yield
    finally:
        for layer, attend in zip(layers, originals, strict=True):
            layer.attend = attend


@contextlib.contextmanager
def profiled_steps(
    device: torch.device, active: int, trace_path: Path | None, with_stack: bool = False
) -> Iterator[tuple[Callable[[], None], list[StepProfile]]]:
    """Profile with a wait/warmup/active schedule; yields (step(), results).

    Call step() after each training step (wait + warmup + active steps in all). When the
    active window closes, its events are counted into results[0] and, if trace_path is
    given, a gzipped Chrome/Perfetto trace is written there.
    """
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    results: list[StepProfile] = []

    def on_ready(prof: profile) -> None:
        parsed = parse_events(prof.profiler.kineto_results.events(), device)
        if trace_path is not None:
            try:  # the counts are in hand already: a trace that cannot be written loses only itself
                parsed.trace, parsed.trace_bytes = _export_trace(prof, trace_path)
            except OSError as e:
                parsed.trace_error = str(e)
        results.append(parsed)

    with profile(
        activities=activities,
        schedule=schedule(wait=PROFILE_WAIT, warmup=PROFILE_WARMUP, active=active, repeat=1),
        acc_events=True,  # one cycle, so nothing to clear; torch 2.11 warns once per cell without
        on_trace_ready=on_ready,
        profile_memory=device.type == "cpu",
        record_shapes=False,
        with_stack=with_stack,
    ) as prof:
        yield prof.step, results


def _export_trace(prof: profile, path: Path) -> tuple[Path, int]:
    """Writes the trace gzipped to path; returns it and its size unzipped, the size a viewer
    loads (JSON traces compress about 14x)."""
    raw = path.with_suffix("")  # foo.json.gz -> foo.json
    # PyTorch writes raw.tmp, then renames it; where the write fails (a full disk) it logs
    # "Failed to write to log file!", raises nothing and keeps raw.tmp open until the profiler
    # is collected: emptied, not just unlinked, it gives back the space results.json needs next.
    partial = raw.with_name(raw.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(raw))
        if not raw.is_file():
            message = "PyTorch's export wrote no file (is the disk full?)"
            raise FileNotFoundError(errno.ENOENT, message, str(raw))
        size = raw.stat().st_size
        with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
    except OSError as e:
        for leftover in (partial, raw, path):
            with contextlib.suppress(OSError):
                os.truncate(leftover, 0)
            leftover.unlink(missing_ok=True)
        raise OSError(f"could not write the trace {e.filename or path}: {e.strerror or e}") from e
    os.remove(raw)
    return path, size


def verify_backend(
    backend: str,
    ops: dict[str, dict[str, float]],
    kernels: dict[str, dict[str, float]],
    device: torch.device,
) -> str | None:
    """None if the trace shows the pinned SDPA backend ran; otherwise what was missing.

    `kernels` maps any grouping (regions, and the unattributed ones) to kernel names: a
    kernel counts wherever it was launched from.
    """
    instead = sdpa_ops_instead(backend, {name for region in ops.values() for name in region})
    if instead is not None:
        wanted = " or ".join(BACKEND_OPS[backend])
        return f"trace lacks {wanted} (SDPA ops seen: {', '.join(instead) or 'none'})"
    pattern = BACKEND_KERNELS.get(backend)
    if device.type == "cuda" and pattern is not None:
        seen_kernels = {name for region in kernels.values() for name in region}
        if not any(pattern.search(k) for k in seen_kernels):
            longest = sorted(seen_kernels, key=len, reverse=True)[:3]  # templates: attention's
            return (
                f"trace has no kernel whose name matches /{pattern.pattern}/ (e.g. "
                f"{'; '.join(longest)[:600]})"
            )
    return None


def backend_that_ran(ops: dict[str, dict[str, float]]) -> str | None:
    """Which SDPA backend the trace shows, for variants that let PyTorch choose."""
    seen = {name for region in ops.values() for name in region}
    for backend, names in BACKEND_OPS.items():
        if seen.intersection(names):
            return backend
    return None


def backend_problem(variant: str, row: dict[str, Any], device: torch.device) -> str | None:
    """For a pinned variant, why its profiled steps do not show its backend ran, if not."""
    backend = VARIANTS[variant].backend
    if backend is None:
        return None
    every_kernel = (row["kernels_per_step"] or {}) | {
        "unattributed": row["kernels_unattributed_per_step"] or {}
    }
    problem = verify_backend(backend.name, row["ops_per_step"], every_kernel, device)
    return (
        None if problem is None else f"backend check: asked for {backend.name}, but the {problem}"
    )
