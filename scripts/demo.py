"""Build every attention variant that runs here and take one training step with each.

    python scripts/demo.py [--device auto|cpu|cuda]

A smoke test a newcomer can read in a minute: the variants share one model and one step.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config import TrainConfig
from cpu_linear import wants_onednn
from model import VARIANTS, GPTConfig
from runtime import autocast_dtype, pick_device, unavailable_reason
from train import USER_ERRORS, build_model, train_step


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="auto")
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
    print(f"one training step per variant on {device} ({dtype}{linear}), B=4 T={config.block_size}")
    print("(each a first step, with its own warm-up: not a benchmark; see make profile)")

    def first_step(attention: str) -> tuple[float, float]:
        """A fresh model's first training step: its loss and seconds."""
        torch.manual_seed(0)
        model_cfg = dataclasses.replace(config, attention=attention)
        model, optimizer = build_model(model_cfg, tc, device, onednn=onednn, compile=False)
        t0 = time.perf_counter()
        loss = train_step(model, optimizer, [(batch[:, :-1], batch[:, 1:])], 1.0, amp).loss.item()
        return loss, time.perf_counter() - t0

    # The process's one-time set-up (thread pools, allocator, kernel caches) on an untimed step,
    # so that the first variant listed does not pay it for all of them.
    first_step(config.attention)
    for name, variant in VARIANTS.items():
        reason = unavailable_reason(name, device, dtype, config.head_size)
        if reason is not None:
            print(f"  {name:15s} skipped: {reason}")
            continue
        loss, seconds = first_step(name)
        print(f"  {name:15s} loss {loss:.4f}  {1e3 * seconds:7.1f} ms  ({variant.summary})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
