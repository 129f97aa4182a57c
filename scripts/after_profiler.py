"""Whether a profiler session slows the training steps timed after it, as a sweep times each
depth's steps after the previous depth's profiled ones.

    python scripts/after_profiler.py [--config configs/profile.toml] [--steps 30] [--sessions 3]
        [--model.n_layer=2 --model.attention=sdpa ...]

Builds one model as a sweep's cell does (the config's device, precision and nn.Linear path, on
synthetic batches unless --data.name says otherwise), takes three warm-up steps, then for each
session: --steps training steps timed one by one (the device synchronized around each), one
profiler session as a cell's (one step waited, one warmed up, one profiled and its events
counted), and the same number of steps timed again. Prints the median ms per step before and
after each session. On CUDA this is the check for CUPTI staying attached after a session.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from console import StdoutClosed, quiet_profiler_start, say, stdout_closed
from profiling.measure import profiled_steps, synchronize, timed
from profiling.method import PROFILE_WAIT, PROFILE_WARMUP
from profiling.startup import batch_pool
from train import USER_ERRORS
from training.config import load_config
from training.cpu_linear import wants_onednn
from training.host import keep_freed_host_memory
from training.probe import VariantUnavailable, check_variant
from training.runtime import autocast_dtype, pick_device, set_fp32_matmul_precision
from training.step import build_model, train_step


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Other arguments are train.py overrides, over the config and this script's "
        "own defaults: --model.n_layer=2 --model.attention=sdpa --data.name=synthetic.",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=Path("configs/profile.toml"),
        help="a train.py config (default: configs/profile.toml)",
    )
    parser.add_argument(
        "--steps", type=int, default=30, help="steps timed before and after each (default: 30)"
    )
    parser.add_argument(
        "--sessions", type=int, default=3, help="profiler sessions, one after another (default: 3)"
    )
    args, overrides = parser.parse_known_args()
    for flag, value in (("--steps", args.steps), ("--sessions", args.sessions)):
        if value < 1:
            parser.error(f"{flag}={value}: must be >= 1")
    defaults = ["--model.n_layer=2", "--model.attention=sdpa", "--data.name=synthetic"]
    try:
        config = load_config(args.config, [*defaults, *overrides])  # the last given wins
        config = dataclasses.replace(config, train=config.train.in_one_process())  # a sweep's
        device = pick_device(config.train.device)
        set_fp32_matmul_precision(config.train.dtype, device)
        amp = autocast_dtype(config.train.dtype, device)
        mc = config.model
        check_variant(mc.attention, device, amp or torch.float32, mc.head_size, mc.dropout)
        onednn = wants_onednn(config.train.cpu_linear, device, amp is not None)
        batches = batch_pool(config, device)
    except (*USER_ERRORS, VariantUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if device.type == "cpu":
        keep_freed_host_memory()  # as a sweep's default --host-memory keep
        quiet_profiler_start()  # on CUDA, kineto's lines explain a CUPTI error: kept
    torch.manual_seed(config.train.seed)
    model, optimizer = build_model(config.model, config.train, device, onednn=onednn, compile=False)

    def step(i: int) -> None:
        batch = batches[i % len(batches)]
        train_step(model, optimizer, batch, config.train.grad_clip, amp)

    def median_ms() -> float:
        gc.collect()  # as before a sweep's timed rounds
        ms = [timed(functools.partial(step, i), device) * 1e3 for i in range(args.steps)]
        return statistics.median(ms)

    # Each line is flushed as it is printed (say): under gpu_check.sh's time limit, what a
    # killed run printed stays.
    try:
        say(
            f"{mc.attention}, n_layer={mc.n_layer}, B={config.train.batch_size} T={mc.block_size} "
            f"C={mc.n_embd}, {amp or torch.float32} on {device}, torch {torch.__version__}; "
            f"median of {args.steps} steps"
        )
        for i in range(3):
            step(i)
        for session in range(1, args.sessions + 1):
            before = median_ms()
            with profiled_steps(device, active=1, trace_path=None) as (advance, counted):
                for i in range(PROFILE_WAIT + PROFILE_WARMUP + 1):
                    step(i)
                    synchronize(device)  # as a cell's profiled steps
                    advance()
            assert len(counted) == 1, "the profiled step's events were not counted"
            say(f"session {session}: {before:.1f} ms per step before, {median_ms():.1f} after")
    except StdoutClosed as e:  # `| head`, or a full disk: what was printed stands
        return stdout_closed(e)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
