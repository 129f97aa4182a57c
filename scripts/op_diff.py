"""Two attention variants' training steps, profiled once each, and the ops whose counts differ.

    python scripts/op_diff.py [--variants inplace,naive] [--layers 4]

A against B, as `profile_train.py --report DIR --diff A,B` reads them: B's count -> A's.

The idea of what profile_train.py measures, in one page, apart from its code: the model and
step train.py runs (nn.Linear on PyTorch's own path, not oneDNN's), torch.profiler over one step
after a warm-up one, ATen ops counted by the region (forward, backward, optimizer) that
train_step names, found through the op tree. Its default shows the hidden copy that
out-of-place masked_fill makes in each layer. CPU only (on a GPU the backward's ops run on
autograd's own thread, outside the range: profile_train.py places them by time, and counts
kernels too); no timing here: see make profile.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from console import StdoutClosed, quiet_profiler_start, say, stdout_closed
from model import GPTConfig
from train import USER_ERRORS
from training.config import TrainConfig
from training.probe import VariantUnavailable, check_variant
from training.step import build_model, train_step

REGIONS = ("forward", "backward", "optimizer")


def op_counts(config: GPTConfig) -> Counter[tuple[str, str]]:
    """(region, op) -> calls in one training step of a fresh model."""
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    model, optimizer = build_model(config, TrainConfig(), cpu, onednn=False, compile=False)
    ids = torch.randint(0, config.vocab_size, (4, config.block_size + 1))
    step = lambda: train_step(model, optimizer, [(ids[:, :-1], ids[:, 1:])], grad_clip=1.0)
    step()  # warm-up: AdamW's state, first-call set-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts: Counter[tuple[str, str]] = Counter()
    for event in prof.events():
        region = event.cpu_parent
        while region is not None and region.name not in REGIONS:
            region = region.cpu_parent
        if event.name.startswith("aten::") and region is not None:
            counts[region.name, event.name] += 1
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--variants",
        default="inplace,naive",
        help="two names, A,B: A's ops against B's (default: inplace,naive)",
    )
    parser.add_argument("--layers", type=int, default=4, help="n_layer of both (default: 4)")
    args = parser.parse_args()
    variants = args.variants.split(",")
    try:
        if len(variants) != 2 or args.layers < 1:
            raise ValueError(f"--variants {args.variants} --layers {args.layers}: want A,B and 1+")
        if variants[0] == variants[1]:
            raise ValueError(f"--variants {args.variants}: two different variants, A,B")
        config = GPTConfig(vocab_size=512, block_size=64, n_layer=args.layers, n_head=4, n_embd=64)
        for name in variants:
            check_variant(name, "cpu", torch.float32, config.head_size)
    except (*USER_ERRORS, VariantUnavailable, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    quiet_profiler_start()
    a, b = (op_counts(dataclasses.replace(config, attention=v)) for v in variants)
    try:
        say(
            f"ATen ops in one training step at n_layer={args.layers}, {variants[0]} against "
            f"{variants[1]}: {variants[1]}'s count -> {variants[0]}'s"
        )
        differ = [key for key in sorted(a.keys() | b.keys()) if a[key] != b[key]]
        for region, op in differ:
            change = a[region, op] - b[region, op]
            say(f"  {region:9s} {op:48s} {b[region, op]:4d} -> {a[region, op]:4d}  {change:+d}")
        if not differ:
            say("  no op count differs: the same ATen ops in every region")
    except StdoutClosed as e:  # `| head`, or a full disk: what was printed stands
        return stdout_closed(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
