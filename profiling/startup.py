"""What a sweep does once, before its first cell: it draws the batches every cell steps on,
pays the process's one-time costs on a tiny model, and names the device for the record."""

from __future__ import annotations

import dataclasses
import platform
import sys
import time

import torch
from tqdm import tqdm

from console import one_line
from data.loader import TokenBatches
from data.meta import check_vocab, load_meta
from profiling.measure import synchronize
from training.config import Config
from training.cpu_linear import cpu_field
from training.step import build_model, train_step

BATCH_POOL = 4  # distinct batches cycled through, drawn before timing so no I/O is timed

StepBatches = list[tuple[torch.Tensor, torch.Tensor]]  # one step's micro-batches, (x, y) each


def batch_pool(config: Config, device: torch.device) -> list[StepBatches]:
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


def warm_up(
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
