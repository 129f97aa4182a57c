"""What train.py's lagged readout buys: the training loop's wall-clock time per step when each
step's loss is read only after the next step is queued (as train.py does) against read at once
(the host waits for every step before queueing the next, as a plain `loss.item()` would).

    python scripts/readout_gain.py --config configs/gpt2-small.toml [--steps 60] [--skip 10]
        [--rounds 2] [--train.compile=false ...]

Runs train.py's own loop (training/loop.py, imported, unchanged) on its config and prepared
corpus, the two modes interleaved round by round, with no evaluation, checkpoints between or
sample. A step's wall time is host time from one step's start to the next's, over the steps
after the first --skip (those compile and warm up). On the CPU the two modes do the same thing:
work runs as it is queued. Extra arguments are train.py's config overrides. Prints one line per
mode: the median over rounds of each run's mean ms per step, and every run's.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import train
from console import Droppable, StdoutClosed, say, stdout_closed
from training import loop, runtime

STARTS: list[float] = []  # when the host began each step of the current run


class _Timed(runtime.StepReadout):
    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        STARTS.append(self.began)


class _ReadAtOnce(_Timed):
    def finish(self, t: torch.Tensor) -> None:
        super().finish(t)
        if self._copied is not None:
            self._copied.synchronize()


def run(mode: type[_Timed], args: argparse.Namespace, overrides: list[str]) -> float:
    """One training run in this mode; its mean wall ms per step after the skipped ones."""
    STARTS.clear()
    loop.StepReadout = mode  # the loop's, read at each step
    with tempfile.TemporaryDirectory() as out:
        argv = ["--config", str(args.config), "--out", out, f"--train.max_steps={args.steps}"]
        argv += ["--train.eval_interval=0", "--train.sample_tokens=0", *overrides]
        # stdout: this script's table alone. train.py's lines go to stderr, where a failed
        # write costs the line (as train.py's own stderr does), not the timed run
        with contextlib.redirect_stdout(Droppable(sys.stderr)):
            code = train.main(argv)
        if code != 0:  # train.py said why, above; its status is this script's
            raise SystemExit(code)
    starts = STARTS[args.skip :]
    return (starts[-1] - starts[0]) / (len(starts) - 1) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Other arguments are train.py overrides (--model.n_layer=8 ...).",
    )
    parser.add_argument("--config", type=Path, required=True, help="a train.py config")
    parser.add_argument(
        "--steps", type=int, default=60, help="steps per run, at least --skip + 3 (default: 60)"
    )
    parser.add_argument(
        "--skip", type=int, default=10, help="first steps left out: compile (default: 10)"
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="runs of each readout, alternating (default: 2)"
    )
    args, overrides = parser.parse_known_args()
    for flag, value, least in (("--skip", args.skip, 0), ("--rounds", args.rounds, 1)):
        if value < least:
            parser.error(f"{flag}={value}: must be >= {least}")
    if args.steps < args.skip + 3:
        parser.error(f"--steps={args.steps} leaves fewer than 3 steps after --skip={args.skip}")
    ours = ("--out", "--train.max_steps", "--train.eval_interval", "--train.sample_tokens")
    taken = [o for o in overrides if o.split("=")[0] in ours]
    if taken:  # a step count short of --skip, or evaluations inside the timed window
        parser.error(f"{' '.join(taken)}: this script sets those (--steps for the step count)")
    partial = [o for o in overrides if o.split("=")[0] in ("--resume", "--stop-after")]
    if partial:
        parser.error(f"{' '.join(partial)}: not supported; each run is a whole new one")
    modes = {"lagged (train.py)": _Timed, "read at once": _ReadAtOnce}
    ms: dict[str, list[float]] = {name: [] for name in modes}
    for r in range(args.rounds):
        order = list(modes.items())[:: 1 if r % 2 == 0 else -1]  # alternate who goes first
        for name, mode in order:
            t0 = time.perf_counter()
            ms[name].append(run(mode, args, overrides))
            print(
                f"round {r + 1}, {name}: {ms[name][-1]:.2f} ms/step "
                f"(run {time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
            )
    try:
        say(
            f"config {args.config} {' '.join(overrides)}: wall ms/step over steps "
            f"{args.skip + 1}..{args.steps - 1}, median of {args.rounds} runs"
        )
        for name, values in ms.items():
            runs = ", ".join(f"{v:.2f}" for v in values)
            say(f"  {name:18s} {statistics.median(values):8.2f}   (runs: {runs})")
    except StdoutClosed as e:  # `| head`, or a full disk: what was printed stands
        return stdout_closed(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
