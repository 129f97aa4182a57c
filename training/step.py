"""The one training step of this project, and the model and optimizer it steps: train.py
(its set-up, start.py, and its loop, loop.py) and profile_train.py import them, never a copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import record_function

from data.loader import TokenBatches
from model import GPT, GPTConfig
from training.config import TrainConfig
from training.cpu_linear import use_onednn_linears
from training.optim import build_optimizer
from training.runtime import autocast


class StepResult(NamedTuple):
    loss: Tensor  # the mean over this process's micro-batches (the caller all-reduces it)
    grad_norm: Tensor | None  # the gradients' total norm before clipping; None without clipping


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[tuple[Tensor, Tensor]],
    grad_clip: float = 0.0,
    amp_dtype: torch.dtype | None = None,
) -> StepResult:
    """Forward, backward and optimizer update over this process's micro-batches of one step
    (under DDP, with the gradients averaged over all processes).

    The regions are named for the profiler, which counts ops by them (REGIONS in
    profiling/analysis.py). Loss and norm come back as device tensors, so the caller decides
    when to synchronise.
    """
    device = next(model.parameters()).device
    n = len(micro_batches)
    total: Tensor | None = None
    for i, (x, y) in enumerate(micro_batches):
        # Under DDP, all-reduce gradients only after the last micro-batch.
        sync = (
            contextlib.nullcontext()
            if i == n - 1 or not isinstance(model, DDP)
            else model.no_sync()
        )
        with sync:
            with record_function("forward"), autocast(device, amp_dtype):
                _, loss = model(x, y)
                loss = loss / n
                # Summed in the region too, so the profiler finds no work outside the three.
                total = loss.detach() if total is None else total + loss.detach()
            with record_function("backward"):
                loss.backward()
    assert total is not None, "train_step needs at least one micro-batch"
    grad_norm = None
    with record_function("optimizer"):
        if grad_clip > 0:
            # foreach=None: torch._foreach_norm where the device supports the foreach API
            # (CUDA: multi-tensor kernels; CPU: a loop over the tensors inside the op), a Python
            # loop elsewhere (MPS, meta), where foreach=True raises.
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip, foreach=None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return StepResult(total, grad_norm)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, batches: TokenBatches, n_batches: int, amp_dtype: torch.dtype | None
) -> float:
    """Mean loss over the same n_batches micro-batches every time (the generator is reset),
    over all ranks: the loop asks for eval_batches steps' worth (x grad_accum), so a config
    with global_batch_size evaluates the same windows on any number of ranks. The model is
    left in the mode it came in."""
    was_training = model.training
    model.eval()
    batches.restart()
    device = batches.device
    total = torch.zeros((), device=device)
    for _ in range(n_batches):
        x, y = batches.next()
        with autocast(device, amp_dtype):
            total += model(x, y)[1]
    model.train(was_training)
    if dist.is_initialized():
        dist.all_reduce(total)
        total /= dist.get_world_size()
    return total.item() / n_batches


def compile_blocks(model: GPT) -> None:
    """torch.compile each transformer block in place; embeddings, head and loss stay eager.

    The blocks are identical modules, so they share one compiled graph: compile time stays
    flat with depth (as in torchtitan), which is what a sweep over n_layer needs.
    """
    for block in model.blocks:
        block.compile()


def build_model(
    model_cfg: GPTConfig,
    tc: TrainConfig,
    device: torch.device,
    *,
    onednn: bool,
    compile: bool,
) -> tuple[GPT, torch.optim.AdamW]:
    """The model and optimizer as a training run makes them; the profiler and demo use it too.

    Seed the RNG before calling: initialisation draws from it.
    """
    model = GPT(model_cfg).to(device)
    if onednn:
        use_onednn_linears(model)
    optimizer = build_optimizer(model, tc, device)
    if compile:
        compile_blocks(model)  # in place: parameter names and the state dict do not change
    return model, optimizer
