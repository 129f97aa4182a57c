"""Build every attention variant that runs here and take one training step with each.

    python scripts/demo.py [--device auto|cpu|cuda|mps]

A smoke test a newcomer can read in a minute: the variants share one model and one step.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from console import StdoutClosed, say, stdout_closed
from model import VARIANTS, GPTConfig
from train import USER_ERRORS
from training.config import TrainConfig
from training.cpu_linear import wants_onednn
from training.probe import unavailable_reason
from training.runtime import autocast_dtype, pick_device
from training.step import build_model, train_step


def main() -> int:
    try:
        return _demo()
    except StdoutClosed as e:  # `| head`: what was printed stands
        return stdout_closed(e)


def _demo() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, mps")
    try:
        device = pick_device(parser.parse_args().device, "--device")
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    amp = autocast_dtype("auto", device)
    dtype = amp or torch.float32
    tc = TrainConfig()
    onednn = wants_onednn(tc.cpu_linear, device, amp is not None)  # as train.py decides
    config = GPTConfig(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=128)
    torch.manual_seed(0)  # the same batch on every run
    batch = torch.randint(0, config.vocab_size, (4, config.block_size + 1), device=device)
    linear = ", nn.Linear through oneDNN" if onednn else ""
    say(f"one training step per variant on {device} ({dtype}{linear}), B=4 T={config.block_size}")

    def first_loss(attention: str) -> float:
        """A fresh model's first training step, on the same weights and batch: its loss."""
        torch.manual_seed(0)
        model_cfg = dataclasses.replace(config, attention=attention)
        model, optimizer = build_model(model_cfg, tc, device, onednn=onednn, compile=False)
        return train_step(model, optimizer, [(batch[:, :-1], batch[:, 1:])], 1.0, amp).loss.item()

    losses = {}
    for name, variant in VARIANTS.items():
        reason = unavailable_reason(name, device, dtype, config.head_size)
        if reason is not None:
            say(f"  {name:15s} skipped: {reason}")
            continue
        losses[name] = first_loss(name)
        say(f"  {name:15s} loss {losses[name]:.4f}  ({variant.summary})")
    # One function done differently: the losses agree to rounding (bf16's, on a GPU).
    spread = max(losses.values()) - min(losses.values())
    if spread > (2e-2 if amp is not None else 1e-4):
        print(f"error: the variants' losses differ by {spread:.4g}", file=sys.stderr)
        return 1
    say(
        f"{len(losses)} variants, one loss: the same attention, computed differently. "
        "For their step times: make profile"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
