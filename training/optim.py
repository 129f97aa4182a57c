"""AdamW and the learning-rate schedule a run trains with; train.py and the profiler build
the optimizer here, and a resume puts the config's settings back on it."""

from __future__ import annotations

import math
from typing import Any

import torch

from training.config import TrainConfig


def build_optimizer(
    model: torch.nn.Module, cfg: TrainConfig, device: torch.device
) -> torch.optim.AdamW:
    """AdamW with decay on matrices (embeddings, Linear weights) only, fused where supported."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2]},
        {"params": [p for p in params if p.dim() < 2]},
    ]
    # Fused: one op updates all of a group's tensors (on CUDA, a few multi-tensor kernels) in
    # place of a loop of small ops per tensor. On CPU each tensor's step count is still
    # bumped, cast and read on its own: a handful of small ops per parameter tensor. MPS has
    # the fused kernel too; elsewhere, the multi-tensor (foreach) loop.
    fused = device.type in ("cuda", "cpu", "mps")
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, fused=fused, foreach=None if fused else True)
    apply_optimizer_settings(optimizer, cfg)
    return optimizer


def apply_optimizer_settings(optimizer: torch.optim.AdamW, cfg: TrainConfig) -> None:
    """The config's weight decay and betas on build_optimizer's two groups. Called again after
    resuming: load_state_dict brings back the checkpoint's, and a run resumed with
    --train.weight_decay=... must use the value its config.toml now records. (lr is set each
    step.)"""
    for group, decay in zip(optimizer.param_groups, (cfg.weight_decay, 0.0), strict=True):
        group["weight_decay"] = decay
        group["betas"] = (cfg.beta1, cfg.beta2)


def load_optimizer_state(
    optimizer: torch.optim.AdamW, state: dict[str, Any], cfg: TrainConfig
) -> None:
    """A checkpoint's AdamW state on build_optimizer's optimizer, on the fused or foreach path
    chosen for this device, with the config's settings on top.

    load_state_dict takes every group setting from the checkpoint, the path among them, and
    places each parameter's step count by it (on the parameter's device for fused, on the CPU
    for foreach): a checkpoint written where AdamW is not fused, resumed on a GPU, would keep
    CPU step counts that the fused kernel refuses. So the path is this optimizer's before the
    state loads."""
    path = {key: optimizer.defaults[key] for key in ("fused", "foreach")}
    groups = [{**group, **path} for group in state["param_groups"]]
    optimizer.load_state_dict({**state, "param_groups": groups})
    apply_optimizer_settings(optimizer, cfg)


SCHEDULE_FIELDS = ("lr", "min_lr", "warmup_steps", "max_steps")  # all that lr_at reads


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_steps, then cosine decay from lr (at step warmup_steps) to
    min_lr at max_steps. The warmup climbs in warmup_steps + 1 equal parts, so the peak is
    reached once, where the decay starts, not held for two steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
