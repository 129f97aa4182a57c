"""What every cell of a sweep shares, made once before any is measured: the batches each
steps on, the FLOP count of a step at each depth, the process's one-time start-up, paid, and
the device's name for the record."""

from __future__ import annotations

import dataclasses
import platform
import sys
import time

import torch
from tqdm import tqdm

from config import Config
from console import one_line
from cpu_linear import cpu_field
from data.loader import TokenBatches
from data.meta import check_vocab, load_meta
from profiling.measure import count_flops, synchronize
from step import build_model, train_step

BATCH_POOL = 4  # distinct batches cycled through, drawn before timing so no I/O is timed

Batch = list[tuple[torch.Tensor, torch.Tensor]]  # one step's micro-batches, (x, y) each


def batch_pool(config: Config, device: torch.device) -> list[Batch]:
    """BATCH_POOL steps' batches from config.data.name: a prepared corpus's train split, or
    random tokens ("synthetic") whose targets are still the next input token."""
    mc, tc = config.model, config.train
    if config.data.name == "synthetic":
        g = torch.Generator().manual_seed(tc.seed)
        shape = (tc.batch_size, mc.block_size + 1)
        draw = lambda: torch.randint(mc.vocab_size, shape, generator=g).to(device)
        pool = [[draw() for _ in range(tc.grad_accum)] for _ in range(BATCH_POOL)]
        return [[(xy[:, :-1], xy[:, 1:]) for xy in step] for step in pool]
    meta = load_meta(config.data.root, config.data.name, mc.vocab_size)
    check_vocab(meta, mc.vocab_size, config.data.name)
    source = TokenBatches(
        config.data.dir / "train.bin",
        mc.block_size,
        tc.batch_size,
        tc.seed,
        device,
        expected_tokens=meta["splits"]["train"]["tokens"],
        vocab_size=meta["vocab_size"],
    )
    return [[source.next() for _ in range(tc.grad_accum)] for _ in range(BATCH_POOL)]


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
            model_cfg = dataclasses.replace(mc, attention="naive", n_layer=n_layer)
            model, optimizer = build_model(model_cfg, tc, meta, onednn=False, compile=False)
            x = torch.zeros(tc.batch_size, mc.block_size, dtype=torch.long)  # ids, targets
        # The real step's count, as the tests check: FLOPs depend on neither the dtype (so
        # no autocast) nor the Linear path (cpu_linear.py counts the oneDNN op as
        # nn.Linear). Clipping is in it, and adds none: flop_counter counts matmuls only.
        micro = [(x, x)] * tc.grad_accum
        by_op = count_flops(lambda: train_step(model, optimizer, micro, tc.grad_clip))
    except Exception as e:  # not KeyboardInterrupt: Ctrl-C stops the sweep
        tqdm.write(
            f"warning: no FLOP count at n_layer={n_layer} ({one_line(e)}); no MFU there",
            file=sys.stderr,
        )
        return 0, 0
    return sum(by_op.values()), by_op.get("aten.bmm", 0)


def pay_startup(
    config: Config,
    device: torch.device,
    onednn: bool,
    amp_dtype: torch.dtype | None,
    compiled: bool,
) -> float | None:
    """One training step of a tiny model, eager, then compiled if the sweep compiles; the
    seconds the last took, or None if it failed (a warning says so).

    The process's one-time costs (the compiler's imports and workers, the first trace and
    compile, the first eager step's set-up) are then paid here, not charged to whichever
    cell comes first. Its sizes are not the sweep's: no cell finds its graphs in Inductor's
    cache because of it.
    """
    tc, mc = config.train, config.model
    tiny = dataclasses.replace(
        mc,
        attention="naive",
        n_layer=1,
        n_embd=16 if mc.n_embd != 16 else 24,  # a width the cells' blocks do not have
        n_head=2,
        block_size=16,
        vocab_size=64,
    )
    ids = torch.randint(64, (2, 17)).to(device)
    batch = [(ids[:, :-1], ids[:, 1:])]
    try:
        for compiling in [False, True] if compiled else [False]:
            model, optimizer = build_model(tiny, tc, device, onednn=onednn, compile=compiling)
            t0 = time.perf_counter()  # not `timed`: that times cells
            train_step(model, optimizer, batch, tc.grad_clip, amp_dtype)
            synchronize(device)
            seconds = time.perf_counter() - t0
    except Exception as e:  # not KeyboardInterrupt; the cells will say what fails there
        tqdm.write(
            f"warning: the start-up warm-up failed ({one_line(e)}); the first cell's "
            "first step may carry the process's one-time costs",
            file=sys.stderr,
        )
        return None
    return seconds


def device_name(device: torch.device) -> str:
    """The device's model, as results.json and the report name it."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return torch.backends.mps.get_name()  # the Apple GPU, e.g. "Apple M2"
    return f"{cpu_field('model name') or platform.processor()}, {platform.machine()}"
