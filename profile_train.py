"""Profile complete training steps (forward, backward, AdamW) by attention variant and depth.

    python profile_train.py --config configs/profile.toml [--variants a,b,...] [--layers 1,2,4,8]
        [--compile off|on|both] [--steps N] [--data synthetic|NAME] [--out DIR]
    python profile_train.py --report DIR [--diff A,B]     # re-render a report, or diff two variants
    python profile_train.py --compare DIR DIR ...         # several sweeps side by side

For every cell of variants x n_layer x compile it measures, each in its own steps:
  1. step time without the profiler: warm-up excluded, device synchronised, variants of one
     depth interleaved round by round so drift hits all alike; median and p10/p90; page faults;
  2. one profiled window (wait/warmup/active): ATen ops and CUDA kernels per step by region
     (forward, backward, optimizer) and a gzipped Chrome/Perfetto trace; peak memory, on CPUs
     from the window's allocations, on CUDA from the allocator in one more step without it;
  3. FLOPs of the step (torch.utils.flop_counter, on the meta device: no memory or compute),
     against a matmul peak measured on the spot by every path PyTorch has here (torch.mm; on
     CPUs also oneDNN), the fastest taken.
The step is training.step.train_step, the one train.py runs, imported, on a model set up as
train.py sets it up (on CPUs: oneDNN linears per train.cpu_linear, freed memory kept): it
measures what train.py runs.
This file is the command line; the sweep itself is profiling/sweep.py.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import math
import shutil
import signal
import sys
from pathlib import Path

import torch

from console import (
    StdoutClosed,
    cli_path,
    dropping,
    is_utf8,
    quiet_profiler_start,
    say,
    stdout_closed,
)
from data.meta import CORPUS_NAME, CORPUS_NAME_RULE
from model import VARIANTS, GPTConfig, unknown_variant
from profiling.analysis import fits_by_label
from profiling.compare import compare_folders
from profiling.findings import diff_text
from profiling.method import MIN_TIMED_STEPS
from profiling.results import cannot_read, load_results, render_results
from profiling.sweep import COMPILE_MODES, Sweep, SweepOptions
from train import USER_ERRORS
from training.checkpoint import describe_os_error
from training.config import ConfigError, fields_help, load_config
from training.probe import available_variants, unavailable_reason
from training.rundir import lock_holder
from training.runtime import SignalScope, autocast_dtype, pick_device

# train.py's fields a sweep does not use, and why (a config file may hold them for train.py)
SWEEP_UNUSED = [
    (  # not min_lr: a lower train.lr needs one no higher to pass the config's check
        ("max_steps", "warmup_steps"),
        "its steps run at train.lr, with no schedule: --warmup, --steps and "
        "--profile-steps set how many each cell runs",
    ),
    (
        ("eval_interval", "eval_batches", "log_interval", "sample_tokens", "sample_prompt"),
        "it neither evaluates, logs metrics.jsonl nor samples",
    ),
    (
        ("peak_tflops",),
        "MFU is against the peak it measures on the spot (--peak-seconds: how long)",
    ),
]
# Config fields the sweep sets itself, from its own flags, or does not use: as overrides, an
# error saying which flag does what they look like
SWEEP_SETS = {
    **dict.fromkeys(
        ("--model.n_layer", "--model.attention"),
        "the sweep sets model.n_layer and model.attention per cell: use --layers and --variants",
    ),
    "--train.compile": "--train.compile: the sweep compiles per cell; use --compile off|on|both",
    "--data.name": "--data.name: the sweep reads the data --data names: --data synthetic or "
    "--data NAME, a corpus prepared under data.root",
    **{
        f"--train.{name}": f"--train.{name}: the sweep does not use it; {why}"
        for names, why in SWEEP_UNUSED
        for name in names
    },
}


class _DefaultsShown(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written; each option's default where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        flag = action.nargs == 0  # --no-traces and the like: nothing to show
        if not flag and action.default not in (None, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _csv_list(text: str, kind: type, flag: str) -> list:
    """'a,b,c' -> [kind(a), kind(b), kind(c)]; a bad, empty or repeated item is an error naming
    the flag (a repeated variant or depth would be measured twice and written over its trace;
    an empty one is likely a name left out). Empty text is an empty list."""
    words = [x.strip() for x in text.split(",")] if text.strip() else []
    if "" in words:
        raise ConfigError(f"{flag}={text!r}: an empty item (a comma too many)")
    try:
        items = [kind(x) for x in words]
    except ValueError:
        raise ConfigError(
            f"{flag}={text!r}: expected comma-separated {kind.__name__} values"
        ) from None
    repeated = sorted({str(x) for x in items if items.count(x) > 1})
    if repeated:
        raise ConfigError(f"{flag}={text!r}: {', '.join(repeated)} given more than once")
    return items


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=_DefaultsShown,
        epilog="Any config field can be overridden, as in train.py: --train.cpu_linear=torch "
        "--model.n_embd=256 (not model.n_layer, model.attention, train.compile or data.name: "
        "--layers, --variants, --compile and --data; nor the train fields a sweep does not use: "
        + ", ".join(name for names, _ in SWEEP_UNUSED for name in names)
        + ")\n"
        + fields_help(),
        allow_abbrev=False,  # unknown --flags are config overrides; never guess a prefix
    )
    p.add_argument(
        "--config",
        type=cli_path,
        default=Path("configs/profile.toml"),
        help="TOML with the shapes to profile",
    )
    p.add_argument("--variants", help="comma-separated (default: every variant that runs here)")
    p.add_argument("--layers", default="1,2,4,8", help="comma-separated n_layer values")
    p.add_argument(
        "--compile",
        choices=["off", "on", "both"],
        help="compile the cells, or both (default: as the config's train.compile says: on for "
        "configs/gpt2-small.toml, off for the profile configs)",
    )
    p.add_argument(
        "--steps",
        type=int,
        help=f"timed steps per cell (default: {MIN_TIMED_STEPS}, rounded up to whole sets of the "
        "round orders that balance the cells)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="steps per cell before the timed ones, left out of the step time (a compiled "
        "cell's compile time is its first step's excess over the median)",
    )
    p.add_argument(
        "--profile-steps", type=int, default=1, help="active steps in the profiled window"
    )
    p.add_argument("--data", default="synthetic", help="'synthetic' or a prepared corpus name")
    p.add_argument(
        "--out",
        type=cli_path,
        help="output folder, new or empty (default: profiles/<config name>/<timestamp>)",
    )
    p.add_argument("--no-traces", dest="traces", action="store_false", help="write no trace files")
    p.add_argument(
        "--trace-layers", help="write traces only for these n_layer values (default: all)"
    )
    p.add_argument(
        "--trace-stacks", action="store_true", help="record Python stacks in traces (large)"
    )
    p.add_argument(
        "--peak-seconds",
        type=float,
        default=0.5,
        help="seconds per matmul size when measuring the peak FLOP rate",
    )
    p.add_argument(
        "--host-memory",
        choices=["keep", "release"],
        default="keep",
        help="CPU: keep freed tensor memory in the heap for the next step (keep), or leave "
        "glibc's malloc as it is, which returns it to the OS (release), to see what the page "
        "faults cost",
    )
    p.add_argument(
        "--report",
        type=cli_path,
        metavar="DIR",
        help=(
            "re-render the report of an existing sweep from its results.json, which stays as it is"
        ),
    )
    p.add_argument(
        "--diff", metavar="A,B", help="with --report: print the op/kernel diff of A minus B"
    )
    p.add_argument(
        "--compare",
        type=cli_path,
        nargs="+",
        metavar="DIR",
        help="print the step times, costs and savings per layer of several sweeps of one setup "
        "side by side, with their median",
    )
    return p.parse_known_args(argv)


class Terminated(KeyboardInterrupt):
    """SIGTERM (`timeout`, a job scheduler), handled as Ctrl-C is: the rows and plots stay."""


class Interrupts(SignalScope):
    """While active, SIGINT and SIGTERM raise at once, as Ctrl-C does, and are remembered.

    Python runs a signal handler in whatever code is running when the signal lands. In a weakref
    callback or a `__del__` (Dynamo and Inductor run many), the exception it raises is printed
    as "Exception ignored" and dropped: the sweep calls `raise_if_received` before every step,
    so such a signal stops it there instead of being lost.
    """

    def __init__(self) -> None:
        super().__init__()
        self.received: int | None = None

    def _handle(self, signum: int, frame: object) -> None:
        self.received = signum
        self.raise_if_received()

    def raise_if_received(self) -> None:
        if self.received == signal.SIGTERM:
            raise Terminated
        if self.received is not None:
            raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    # A stderr gone or full (`2>&1 | head`, `2>/dev/full`) costs its lines (the progress bar,
    # notes, errors), not the sweep
    with dropping("stderr"):
        try:
            with Interrupts() as interrupts:
                return _main(argv, interrupts)
        except StdoutClosed as e:  # stdout read by `head`, say: what was printed stands
            return stdout_closed(e)


def sweep_options(
    args: argparse.Namespace, trace_layers: frozenset[int] = frozenset(), link_latest: bool = False
) -> SweepOptions:
    """The sweep's part of the flags, once _main has checked them."""
    return SweepOptions(
        config_file=args.config,
        out=args.out,
        data=args.data,
        steps=args.steps,
        warmup=args.warmup,
        profile_steps=args.profile_steps,
        peak_seconds=args.peak_seconds,
        traces=args.traces,
        trace_layers=trace_layers,
        trace_stacks=args.trace_stacks,
        compile=args.compile,
        host_memory=args.host_memory,
        link_latest=link_latest,
    )


def _main(argv: list[str] | None, interrupts: Interrupts) -> int:
    args, overrides = parse_args(argv)
    sweep: Sweep | None = None
    out_existed = default_out = False
    made_above: list[Path] = []
    try:
        if args.report is not None:
            _alone(
                args,
                overrides,
                "--report",
                ("report", "diff"),
                "re-renders a sweep as it was measured and takes only --diff",
            )
            return _rerender(args)
        if args.compare is not None:
            _alone(args, overrides, "--compare", ("compare",), "reads the sweeps as measured")
            say(compare_folders(args.compare), end="")
            return 0
        if args.config is not None and not is_utf8(str(args.config)):  # the report names it
            raise ConfigError(f"--config {str(args.config)!r}: not valid UTF-8; rename the file")
        config = load_config(args.config, overrides)
        default_out = args.out is None
        args.out = args.out or _default_out(args.config)
        _check_new_out(args.out)
        out_existed = args.out.exists()
        # The folders the sweep will make above --out: an interruption before the first cell
        # removes them too, where still empty
        made_above = [p for p in args.out.parents if not p.exists()]
        layers, traced = _sweep_flags(args, overrides)
        device = pick_device(config.train.device)
        if device.type == "cpu":
            quiet_profiler_start()
        dtype = autocast_dtype(config.train.dtype, device) or torch.float32
        variants, why = _variants(args.variants, config.model, device, dtype)
        options = sweep_options(args, frozenset(traced), link_latest=default_out)
        # The last check of the input; nothing is written before
        sweep = Sweep(config, options, why, raise_if_interrupted=interrupts.raise_if_received)
        if args.compile is None and sweep.compile_mode == "on":
            print(
                f"compiled cells only, as {args.config} sets train.compile = true "
                "(--compile off or both for eager ones)",
                file=sys.stderr,
            )
        sweep.run(variants, layers, COMPILE_MODES[sweep.compile_mode])
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a folder made read-only while the sweep ran
        what, fix = describe_os_error(e)
        kept = args.out is not None and (args.out / "results.json").exists()
        print(
            f"error: {what}"
            + (f" ({fix})" if fix else "")
            + (f"; the cells measured so far are in {args.out / 'results.json'}" if kept else ""),
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt as stop:
        # Only once this sweep held --out is what is there its own; before, it may be another
        # sweep's, given the same --out a moment earlier.
        ours = args.out if sweep is not None and sweep.held_out else None
        if ours is not None and (ours / "results.json").exists():
            print(
                f"interrupted; the cells measured so far are in {ours} (report.md)",
                file=sys.stderr,
            )
        elif ours is not None and ours.is_dir():
            _remove_unmeasured(ours, out_existed, made_above)
            print(
                f"interrupted before the first cell was measured; "
                f"{'the files written in ' if out_existed else ''}{ours} removed",
                file=sys.stderr,
            )
        else:
            print("interrupted", file=sys.stderr)
        return 128 + (signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT)
    say((args.out / "summary.txt").read_text(encoding="utf-8"))
    say(f"report: {args.out / 'report.md'}")
    if not any(r["status"] == "ok" for r in sweep.rows):
        print("error: no cell was measured; the reasons are above", file=sys.stderr)
        return 1
    return 0


def _check_new_out(out: Path) -> None:
    """--out for a new sweep: a folder that does not exist yet, or an empty one (but for a
    lock no process holds)."""
    running = lock_holder(out) if out.is_dir() else None
    if running is not None:
        raise ConfigError(
            f"--out {out}: a process (pid {running}) is writing there now (a sweep, or a "
            "training run); choose another folder"
        )
    if (out / "results.json").exists():
        raise ConfigError(f"--out {out} holds an earlier sweep; choose another folder")
    if out.is_file():
        raise ConfigError(f"--out {out} is a file; give a folder")
    if out.exists() and not out.is_dir():  # /dev/null, a pipe: not "a folder, not empty"
        raise ConfigError(f"--out {out} is neither a file nor a folder; give a new folder")
    # A .lock no process holds (checked above) is a killed sweep's, or run's, before it wrote
    # anything: the folder counts as empty
    if out.exists() and not (out.is_dir() and not {p.name for p in out.iterdir()} - {".lock"}):
        raise ConfigError(f"--out {out} exists and is not an empty folder; choose another")
    if not is_utf8(str(out)):  # the report and results.json name it
        raise ConfigError(f"--out {str(out)!r}: not valid UTF-8; give another folder")


def _remove_unmeasured(out: Path, out_existed: bool, made_above: list[Path]) -> None:
    """What a sweep interrupted before its first cell wrote: all of it is this sweep's
    (traces, no results). A folder the user made stays, emptied; those the sweep made above
    it go where still empty."""
    for path in out.iterdir() if out_existed else [out]:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    for parent in made_above:  # innermost first
        with contextlib.suppress(OSError):  # not empty: another process wrote there
            parent.rmdir()


def _sweep_flags(args: argparse.Namespace, overrides: list[str]) -> tuple[list[int], set[int]]:
    """The flags of a new sweep checked: its depths, and those whose cells write a trace."""
    if args.diff is not None:
        raise ConfigError("--diff compares two variants of an existing sweep: add --report DIR")
    if args.data != "synthetic" and not CORPUS_NAME.fullmatch(args.data):
        raise ConfigError(
            f"--data={args.data!r}: 'synthetic', or a corpus prepared under data.root by its "
            f"name, {CORPUS_NAME_RULE}"
        )
    for override in overrides:
        flag = override.split("=")[0]
        if flag in SWEEP_SETS:
            raise ConfigError(SWEEP_SETS[flag])
        if flag == "--data.root" and args.data == "synthetic":  # read for a corpus only
            raise ConfigError(
                "--data.root: a sweep on --data synthetic reads no corpus; give --data NAME too "
                "to sweep one prepared there"
            )
    layers = _csv_list(args.layers, int, "--layers")
    if not layers or min(layers) < 1:
        raise ConfigError(f"--layers={args.layers!r}: give positive integers, e.g. 1,2,4,8")
    for flag in ("steps", "warmup", "profile_steps"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')}={getattr(args, flag)}: must be >= 1")
    if not (math.isfinite(args.peak_seconds) and args.peak_seconds > 0):
        raise ConfigError(f"--peak-seconds={args.peak_seconds}: must be a positive number")
    if not args.traces and (args.trace_layers is not None or args.trace_stacks):
        given = "--trace-layers" if args.trace_layers is not None else "--trace-stacks"
        raise ConfigError(f"{given} with --no-traces: no trace is written to apply it to")
    traced = set(_csv_list(args.trace_layers or "", int, "--trace-layers"))
    if args.trace_layers is not None and not traced:  # an empty set would mean every depth
        raise ConfigError(
            f"--trace-layers={args.trace_layers!r}: give depths among --layers, or --no-traces"
        )
    if traced - set(layers):
        raise ConfigError(
            f"--trace-layers={args.trace_layers}: "
            f"{','.join(map(str, sorted(traced - set(layers))))} not among --layers={args.layers}"
        )
    return layers, traced


def _variants(
    asked: str | None, mc: GPTConfig, device: torch.device, dtype: torch.dtype
) -> tuple[list[str], dict[str, str | None]]:
    """The variants to sweep (--variants, or every one that runs here) and why each cannot run
    here (None: it can). Those named that cannot run are recorded as such; if none can, an
    error."""
    if asked is None:
        variants = available_variants(device, dtype, mc.head_size, mc.dropout)
        return variants, dict.fromkeys(variants)  # each can run: its probe said so
    variants = _csv_list(asked, str, "--variants")
    if not variants:
        raise ConfigError("--variants is empty; name at least one, or leave it out for all")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ConfigError(f"--variants: {unknown_variant(*unknown)}")
    why = {v: unavailable_reason(v, device, dtype, mc.head_size, mc.dropout) for v in variants}
    if all(why.values()):
        raise ConfigError(
            f"--variants: none can run on {device} ({str(dtype).removeprefix('torch.')}): "
            + "; ".join(f"{v}: {reason}" for v, reason in why.items())
        )
    return variants, why


def _default_out(config_path: Path, now: dt.datetime | None = None) -> Path:
    """profiles/<config>/<UTC timestamp>, with -2, -3, ... after a sweep of the same second."""
    stamp = (now or dt.datetime.now(dt.UTC)).strftime("%Y%m%d-%H%M%S")
    first = out = Path("profiles") / config_path.stem / stamp
    n = 1
    while out.exists():
        n += 1
        out = first.with_name(f"{stamp}-{n}")
    return out


def _alone(
    args: argparse.Namespace, overrides: list[str], flag: str, takes: tuple[str, ...], does: str
) -> None:
    """Refuses the options a mode that reads existing sweeps would ignore."""
    defaults = vars(parse_args([])[0])
    others = [
        "--no-traces" if key == "traces" else f"--{key.replace('_', '-')}"  # its one negated flag
        for key, value in vars(args).items()
        if key not in takes and value != defaults[key]
    ]
    if others or overrides:
        raise ConfigError(
            f"{flag} {does}, not {' '.join(others + overrides)}; other settings need a new sweep"
        )


def _rerender(args: argparse.Namespace) -> int:
    path = args.report / "results.json"
    results = load_results(args.report, "--report")
    if args.diff is not None:
        labels = _csv_list(args.diff, str, "--diff")
        if len(labels) != 2:
            raise ConfigError(f"--diff={args.diff!r}: give two labels A,B, e.g. inplace,naive")
        a, b = labels
        try:
            say(diff_text(results["rows"], a, b))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        except (KeyError, TypeError, AttributeError) as e:
            raise ConfigError(cannot_read(str(path), e)) from None
        return 0
    try:
        # results.json is the record of what was measured: left as it is. The fits are
        # derived data, fitted again from the rows by this code's rule.
        results["fits"] = fits_by_label(results["rows"])
        render_results(args.report, results)
    except OSError as e:
        raise ConfigError(
            f"--report {args.report}: cannot write the report there ({e.strerror}); "
            "--diff reads only"
        ) from None
    except (KeyError, TypeError, AttributeError, ValueError) as e:  # parsed, but hand-edited
        raise ConfigError(cannot_read(str(path), e)) from None
    say((args.report / "summary.txt").read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
