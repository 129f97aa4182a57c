"""The report's account of how its sweep was measured, in words.

Each note follows what the sweep that wrote meta did, so a results.json from an older sweep is
described as it was measured, not as this code measures now.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from profiling.analysis import balanced_orders, cell_name, label, mfu_text, ok_rows

# The profiler's schedule: steps it skips, then steps it records and drops, before the active
# window whose events are counted. A cell runs PROFILE_LEAD_STEPS + --profile-steps of them.
PROFILE_WAIT, PROFILE_WARMUP = 1, 1
PROFILE_LEAD_STEPS = PROFILE_WAIT + PROFILE_WARMUP

# Timed steps per cell without --steps: at least this many, rounded up to whole sets of the
# round orders that balance the depth's cells (see analysis.balanced_orders).
MIN_TIMED_STEPS = 20

# How this code's sweeps measure, written into results.json's meta (the sweep adds `startup`
# once its warm-up has run). The notes below test these keys: a sweep written before a change
# lacks its key, or holds another value, and is described as it was measured.
METHOD = {
    # balanced_orders; sweeps before it rotated one order
    "round_order": "balanced",
    # two cells' rounds A B, B A (sweeps before it alternated them, A B A B)
    "two_cells": "crossover",
    # what the resident part of peak memory counts (sweeps before it: no buffers)
    "resident": "parameters, buffers and optimizer state",
    # compile_s nets out the eager twin's first step...
    "compile_time": "less eager",
    # ...unless it compiled too; None, not 0, where the twin's excess is the larger
    "compile_netting": "eager compiles kept",
    # time_split places each op and kernel by the op around it (before: by its name)
    "time_categories": "by enclosing op, attention calls marked",
    # sweeps before it ran a real eager naive step
    "flop_count": "meta device",
    # an op directly inside one of its name (autocast's wrapper, an overload calling another)
    # counts once; sweeps before it counted it twice
    "op_calls": "re-dispatch counted once",
    # other_cpu_share over the timed rounds (before: the whole sweep, compiling included)
    "other_cpu_window": "timed rounds",
    # each failed cell's traceback, in this file of the sweep's folder (before: none kept)
    "failures_log": "failures.log",
    # a compiled cell is "cached" only if no C++ kernel was built again behind the graphs the
    # FX graph cache held (before: by the graph cache's counters alone)
    "compile_cache": "graphs and C++ kernels",
}
STARTUP = "tiny model"  # the warm-up's model (sweeps before it: a tiny compiled function)

# The opening shared by the splits by enclosing operator (time_categories 'by enclosing op'
# and later).
_BY_ENCLOSING_OP = (
    "Each variant's deepest cell, {profiled}: on "
    "CPU the self time of every ATen operator, summed, so nothing counts twice; on CUDA "
    "each kernel's time. Each goes to the category of the outermost operator around it "
    "that has one, and backward work to that of the forward operator it is the gradient "
    "of: **linear layers** (`nn.Linear`: `aten::linear` or the oneDNN linear), "
)
_UNLAUNCHED_KERNELS = (
    "A kernel that no operator launched (a compiled graph's Triton code) goes by its own name, "
    "and the GEMMs among those, whose names do not say which layer launched them, get a "
    "category of their own (**matmul kernels**)."
)


def where_time_goes_intro(meta: dict[str, Any]) -> list[str]:
    """How the time of the profiled step is split, as the sweep that wrote meta split it."""
    if meta.get("time_categories") == METHOD["time_categories"]:
        how = (
            _BY_ENCLOSING_OP
            + "**attention** and **everything else** (GELU, LayerNorm, the loss, AdamW, the "
            "transposes into and out of the heads, the residual, MLP and embedding dropout). "
            "In an eager cell's profiled steps each "
            "layer's call of its attention variant runs inside a `record_function` range named "
            "`attention` (it shows in the traces), so all that the variant runs is attention's, "
            "forward and backward: naive's matmuls, scale multiply, mask, hidden copy, softmax "
            "and dropout, as much as SDPA's fused kernel, and on CUDA the casts autocast adds "
            "there. Compiled cells are not marked (a compiled block holds the call in its "
            "graph, where no range shows): there the attention operators name it (matmuls "
            "outside a linear, softmax, the mask, the fused SDPA kernels, a pinned variant's "
            "call, which runs eager at a graph break), Inductor's fused CUDA kernels go by the "
            "ops their names list (the scale multiply usually joins the softmax's kernel), and "
            "on CPU Inductor's fused code is not an ATen operator, so its time falls outside "
            "the categories. " + _UNLAUNCHED_KERNELS
        )
    elif meta.get("time_categories") == "by enclosing op":
        how = (
            _BY_ENCLOSING_OP
            + "**attention** (matmuls outside a linear, softmax, the mask, the fused SDPA kernels: "
            "the same work whichever variant does it) "
            "and **everything else** (GELU, LayerNorm, the loss, AdamW, and elementwise ops "
            "outside attention's operators: the transposes of q, k and v, dropout, and naive's "
            "scale multiply, though that one is a pass over the T×T scores that the fused kernels "
            "do inside). So what runs inside an attention operator counts as attention, in the "
            "forward and the backward: naive's hidden copy, and on CUDA the casts autocast adds "
            "for softmax and the second matmul. " + _UNLAUNCHED_KERNELS
        )
    else:  # sweeps before the enclosing op was used: by each op's or kernel's own name
        how = (
            "Each variant's deepest cell, {profiled}. On "
            "CPU the self time of every ATen operator is summed, so nothing counts twice; on CUDA "
            "each kernel's time. By the op's name: **linear layers** (`addmm`/`mm`, the oneDNN "
            "linear), **attention** (batched matmuls, softmax, the mask, the fused SDPA kernels: "
            "the same work whichever variant does it) and **everything else** (copies, GELU, "
            "LayerNorm, the loss, AdamW). Elementwise ops that attention shares with the rest "
            "(copies, the scale's multiply, dropout) count as everything else. On CUDA a kernel's "
            "name does not say which layer launched it: GEMMs get a category of their own "
            "(unfused attention's matmuls among them), and unfused attention's softmax and mask "
            "kernels count as everything else, so there the attention category holds only the "
            "fused SDPA kernels."
        )
    steps = meta.get("profile_steps", 1)
    profiled = (
        f"per step, over its {steps} profiled steps (none of them a timed step)"
        if steps > 1
        else "in one profiled step (not one of the timed steps)"
    )
    return [
        how.replace("{profiled}", profiled),
        "",
        "The timed median minus that total is the time outside the operators: Python, the "
        "autograd engine, dispatch between ops (on CUDA: time with no kernel running). The "
        "profiler's own overhead inflates the ops' times, so the remainder reads smaller than it "
        "is, and it can come out negative when the profiled "
        + ("steps ran" if steps > 1 else "step ran")
        + " slower than the timed ones.",
        "",
        "MFU counts matmul FLOPs only, the linear layers' and attention's (inside the fused kernel "
        "for SDPA), against the rate of one large square matmul. It stays below that peak because "
        "these matmuls run slower than it at their shapes, and because everything else and the "
        "time outside the operators take time without counted FLOPs.",
        *(
            [
                "",
                "> On MPS the profiler sees the host only: an operator's time here is how long "
                "the CPU took to queue its GPU work, not the GPU's time, so this split and the "
                "remainder say little about where the GPU spends the step; the step times do.",
            ]
            if meta.get("device") == "mps"
            else []
        ),
    ]


KERNEL_LABELS = (
    " In the findings and under where the time goes, a kernel goes by a short label: PyTorch's "
    "elementwise, reduction and multi-tensor launchers by the operation they run and its dtype "
    "(`direct_copy_kernel_cuda<float>`, with `(casting)` when it converts as it loads), other "
    "kernels by their unqualified name, launches of one label summed; results.json and "
    "`--diff` keep the full names."
)


def serialised_text(meta: dict[str, Any]) -> str:
    if not meta["device"].startswith("cuda"):
        return ""
    return (
        " (so each step starts on an idle GPU and the host waits for its last kernel: the "
        "next step's launches cannot overlap this one's tail as in train.py's loop, and a "
        "short step reads a little slower than it trains)"
    )


def doubled_ops(meta: dict[str, Any]) -> str | None:
    """For a sweep made before an op that calls itself again counted once: what that means."""
    if meta.get("op_calls") == METHOD["op_calls"]:
        return None
    if meta.get("autocast"):
        return (
            "**This sweep counted an op autocast wraps twice per call** (at autocast's dispatch "
            "key and again as it calls the op: `aten::linear`, `aten::matmul`, "
            "`aten::scaled_dot_product_attention`, `aten::softmax`, `aten::layer_norm`, ...; "
            "also ops whose overloads call one another, such as `aten::arange`), so those "
            "counts, the ops per layer and the ATen op diffs here are too high; sweeps since "
            "count each call once. Kernel counts are not affected."
        )
    return (
        "This sweep counted twice an op whose overload calls another of the same name: "
        "`aten::arange`; on CPU `aten::add_` in AdamW, once per parameter tensor; in "
        "`sdpa-math`, some `aten::mul` and `aten::where`. Its ops per layer are too high by "
        "those, and so are its op diffs that involve them; sweeps since count each call once. "
        "Kernel counts are not affected."
    )


def one_call_text(meta: dict[str, Any]) -> str:
    if (doubled := doubled_ops(meta)) is not None:
        return " " + doubled
    return (
        " An op directly inside one of its own name is the same call, counted once: autocast "
        "records an op it wraps at its own dispatch key and again as it calls the op in the "
        "cast dtype, and some overloads call another (`aten::add_` on a tensor and a number, "
        "`aten::arange`). That is in the profiler's raw events; `key_averages()` merges a pair "
        "whose outer op has only the inner one inside, so it shows those overloads once but "
        "autocast's pairs twice."
    )


def eager_excess_text(meta: dict[str, Any]) -> str:
    if meta.get("compile_time") != METHOD["compile_time"]:
        return ""
    return (
        ", less the same difference of the eager cell of that variant and depth where the "
        "sweep timed one (`eager_excess_s`: AdamW's state and the allocator's and oneDNN's "
        "set-up, which any first step pays)"
        + (
            ", unless that eager first step compiled something itself (eager `flex` compiles "
            "its kernel); – where the eager cell's difference was the larger: each is one "
            "first step, so the compile time is within their noise"
            if meta.get("compile_netting") == METHOD["compile_netting"]
            else ""
        )
    )


def flop_count_text(meta: dict[str, Any]) -> str:
    if meta.get("flop_count") != METHOD["flop_count"]:
        return ""
    return (
        " on the meta device (shapes without data: no memory or compute, so a depth where "
        "naive does not fit is counted too)"
    )


def round_order_text(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    if meta.get("round_order") != METHOD["round_order"]:
        return "each round starting one later (A B C, B C A, C A B, …)"
    # The cells each depth's rounds ran; sweeps before round_cells ran every cell's turn,
    # those left out included (they were skipped)
    per_depth = meta.get("round_cells") or Counter(str(r["n_layer"]) for r in rows)
    crossed = meta.get("two_cells") == METHOD["two_cells"]
    most = max(per_depth.values(), default=0)
    if most < 2 or (most == 2 and not crossed):  # nothing to balance
        return {0: "no cell ran", 1: "one cell per depth"}.get(
            most, "the two cells alternating (A B A B …)"
        )
    short = sorted(
        {
            n
            for n in per_depth.values()
            if (n > 2 or crossed) and meta["steps"] % len(balanced_orders(n))
        }
    )
    partial = (
        f" (here {meta['steps']} rounds of "
        + " or ".join(
            f"{n} cells: not a whole number of the {len(balanced_orders(n))} orders that "
            "balance them"
            for n in short
        )
        + ", so that balance is not complete)"
        if short
        else ""
    )
    crossover = (
        "A B and B A in turn, so over each pair of rounds each variant takes each position "
        "once, and follows itself as often as the other does"
    )
    if most == 2:
        return "each round in one of the two orders " + crossover + partial
    return (
        "each round in an order of a balanced Latin square (Williams design; for three: "
        "A B C, B C A, C A B, A C B, C B A, B A C), so over each full set of orders every "
        "variant takes every position and, within a round, directly follows every other "
        "equally often, and none runs twice in a row"
        + (
            f" (at a depth of two cells: {crossover if crossed else 'alternating, A B A B …'})"
            if 2 in per_depth.values()
            else ""
        )
        + partial
    )


def compile_mark(row: dict[str, Any]) -> str:
    """After a compiled cell's compile time: what its first step compiled, where that
    qualifies the number (or its absence)."""
    cache = row.get("compile_cache")
    if cache == "none" and row.get("compile_s") is not None:  # sweeps before it gave one
        return ""
    return {
        "cached": " (cached)",
        "shared": " (shared)",
        "partly shared": " (partly shared)",
        "none": " (reused)",
    }.get(cache, "")


def reused_text(rows: list[dict[str, Any]]) -> str:
    """What `(shared)`, `(partly shared)` and `(reused)` say, where a cell has one."""
    marks = {compile_mark(r) for r in rows}
    text = ""
    if " (shared)" in marks or " (partly shared)" in marks:
        text += (
            " `(shared)` and `(partly shared)`: a pinned variant's compiled cell after the "
            "first of its depth. Their blocks break at the same call, so it runs graphs "
            "compiled for that first one: all of them (its first step compiled nothing, and "
            "no compile time is given) or all but those its attention's output strides change "
            "(the time given is that of the rest)."
        )
    if " (reused)" in marks:
        text += " `(reused)`: the cell's first step compiled nothing; no compile time is given."
    return text


def startup_text(meta: dict[str, Any]) -> str:
    """The compiler's one-time start-up, paid before the first cell (absent before it was)."""
    if meta.get("startup") == STARTUP:
        compiled = meta.get("compiler_startup_s")
        how = (
            f"eager and then compiled ({compiled:.1f} s: the compiler's imports and workers, "
            "its first trace and compile)"
            if compiled is not None
            else "eager"
        )
        return (
            " The process's one-time start-up was paid before the first cell, on a training "
            f"step of a tiny model, {how}, so the first cell's first step does not carry "
            "it (what is particular to a shape still falls to the first cell of that shape). "
            "A full garbage collection runs before each cell's first step and before the "
            "timed rounds, so what came before is not collected in them; the collector stays "
            "on during them, as in training."
        )
    if meta.get("compiler_startup_s") is None:
        return ""
    return (
        f" The compiler's one-time start-up ({meta['compiler_startup_s']:.1f} s: imports, "
        "compile workers) was paid on a tiny function before the first cell, so no cell's "
        "time includes it."
    )


def _per_step(n: float) -> str:
    """A mean count per step (page faults, allocator calls), or a pause in ms: whole from 10
    up, two significant figures below (0.3 or 0.031, not 0)."""
    return f"{n:,.0f}" if n >= 10 or n == 0 else f"{n:.2g}"


def device_memory_lines(rows: list[dict[str, Any]]) -> list[str]:
    """CUDA: the caching allocator's device calls and retries in the timed steps (absent in
    sweeps written before they were counted)."""
    counted = [r for r in rows if r.get("allocator_calls_per_step") is not None]
    if not counted:
        return []
    calls = [r["allocator_calls_per_step"] for r in counted]
    most = max(counted, key=lambda r: r["allocator_calls_per_step"])
    retried = [r for r in counted if r.get("alloc_retries")]
    line = (
        "- **Device memory**: the CUDA caching allocator's calls to allocate or free device "
        "memory (cudaMalloc, cudaFree) per timed step: "
        f"median {_per_step(statistics.median(calls))}"
        f", at most {_per_step(max(calls))} over the cells"
        + (f" ({cell_name(most)})" if max(calls) else "")
        + "."
    )
    if retried:
        line += " Allocations the device refused, retried after the cache was freed, over all "
        line += "the timed steps: " + ", ".join(
            f"{r['alloc_retries']} in {cell_name(r)}" for r in retried
        )
        line += "."
    if any(r.get("status") in ("oom", "failed") for r in rows):
        line += " A cell that failed freed the cache, so the cells timed after it allocated anew."
    line += (
        " A settled allocator makes none. cudaFree waits until the device has finished its "
        "queued work, so a step that frees device memory can leave the GPU idle: compare these "
        "counts with the time with no kernel running under Where the time goes."
    )
    return [line]


def host_memory_lines(meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """How freed host memory was handled, and the page faults the timed steps took."""
    counted = [r for r in rows if r.get("page_faults_per_step") is not None]
    if not counted or meta["device"] != "cpu" or "host_memory" not in meta:
        return []
    faults = [r["page_faults_per_step"] for r in counted]
    most = max(counted, key=lambda r: r["page_faults_per_step"])
    how = (
        "kept in the heap for the next step (glibc's mmap and trim thresholds raised, as "
        "`train.py` does on CPU)"
        if meta["host_memory"] == "keep"
        else "returned to the OS as glibc's malloc does by default (`--host-memory release`)"
        if "glibc" in meta.get("platform", "glibc")
        else "left to this C library's malloc (`--host-memory keep` tunes glibc's only)"
    )
    return [
        f"- **Host memory**: memory that tensors free was {how}; minor page faults per timed "
        f"step: median {_per_step(statistics.median(faults))}, at most {_per_step(max(faults))} "
        "over the cells"
        + (f" ({cell_name(most)})" if max(faults) else "")
        + "."
        + (
            " With memory kept they come in sporadic bursts, a whole tensor's pages at once when "
            "the heap takes fresh ones; a cell with many per step paid for them in its step times."
            if meta["host_memory"] == "keep"
            else ""
        )
        + (
            f" Before each depth's timed steps the heap was grown by "
            f"{meta['heap_reserve_bytes'] >> 20} MiB of pages faulted in then and freed, so its "
            "growth as the cells' allocations interleave (a one-time cost, which a long run "
            "amortises) takes pages already there."
            if meta.get("heap_reserve_bytes")
            else ""
        )
    ]


def collection_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The garbage collector's runs that landed in the timed steps (absent in sweeps written
    before they were counted)."""
    counted = [r for r in rows if r.get("gc_collections") is not None and r.get("step_ms")]
    if not counted:
        return []
    by_generation = [sum(r["gc_collections"][g] for r in counted) for g in range(3)]
    steps = sum(r["step_ms"]["n"] for r in counted)
    line = (
        "- **Garbage collection**: on in the timed steps, as in training, after a full "
        f"collection before each depth's; over the {steps:,} timed steps, "
    )
    total = sum(by_generation)
    if not total:
        return [line + "no collection landed in one."]
    longest = max(counted, key=lambda r: r.get("gc_longest_ms") or 0.0)
    pause = longest.get("gc_longest_ms") or 0.0
    full = [r for r in counted if r["gc_collections"][2]]
    return [
        line + f"{total:,} collection{'s' if total != 1 else ''} landed in them (generation 0: "
        f"{by_generation[0]:,}, 1: {by_generation[1]:,}, 2, a full one: {by_generation[2]:,}"
        + (f", in {', '.join(cell_name(r) for r in full)}" if full else "")
        + f"); the longest took {_per_step(pause)} ms, in {cell_name(longest)} "
        f"(median step {longest['step_ms']['median']:.1f} ms)."
    ]


def unattributed_lines(rows: list[dict[str, Any]]) -> list[str]:
    """A warning when some CUDA kernels' launches were not found in any region."""
    lost = {
        cell_name(r): sum(counts.values())
        for r in rows
        if (counts := r.get("kernels_unattributed_per_step"))
    }
    if not lost:
        return []
    worst = max(lost, key=lost.__getitem__)
    return [
        f"- **Kernels not attributed**: in {len(lost)} cell{'s' if len(lost) != 1 else ''} some "
        "kernels' launching call was in "
        f"no region or missing from the trace (most: {lost[worst]:g} per step in {worst}). They "
        "count in device time and in the backend check, not in the per-region kernel counts; "
        "`kernels_unattributed_per_step` in results.json names them."
    ]


def causal_note(rows: list[dict[str, Any]]) -> str:
    """What MFU would read with attention's masked half left out, for the best measured cell."""
    cells = [r for r in ok_rows(rows) if r.get("mfu") and r.get("attention_flops_per_step")]
    if not cells:
        return ""
    deepest = max(r["n_layer"] for r in cells)
    best = max((r for r in cells if r["n_layer"] == deepest), key=lambda r: r["mfu"])
    share = best["attention_flops_per_step"] / best["flops_per_step"]
    causal = best["mfu"] * (1 - share / 2)
    return (
        f" Attention's T×T products are {share:.1%} of the count at L{deepest}; with only their "
        f"causal half counted, {label(best['variant'], best['compile'])} at L{deepest} would "
        f"read {mfu_text(causal)} MFU instead of {mfu_text(best['mfu'])}. The half is a "
        "convention, not what a kernel does: a causal kernel skips only the blocks wholly "
        "above the diagonal, so it computes more than half, how much more depending on its "
        "block sizes and the sequence length."
    )
