"""Train a GPT on a prepared corpus, with any attention variant, on one device or under torchrun.

    python train.py --config configs/default.toml [--section.field=value ...] [--out DIR]
    python train.py --out runs/default --resume [--train.max_steps=N ...]   # its own config.toml
    torchrun --nproc_per_node=2 train.py --config configs/tiny.toml

A run directory holds ckpt.pt, config.toml, metrics.jsonl and the corpus's tokenizer.json.

Here: the command line. A run's set-up, everything checked before a byte is written, is
training/start.py's; the step, training/step.py's (profile_train.py imports the same one); the
loop, training/loop.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from console import (
    StdoutClosed,
    cannot_show,
    cli_path,
    dropping,
    first_line,
    is_utf8,
    one_line,
    stdout_closed,
)
from data.meta import DataError
from training.checkpoint import CHECKPOINT, CheckpointError, describe_os_error
from training.config import ConfigError, TrainConfig, fields_help
from training.loop import TrainError
from training.rundir import RunDirError, resume_hint, run_config
from training.runtime import StopAtOnce, launched_ranks, out_of_memory
from training.start import train

USER_ERRORS = (ConfigError, TrainError, RunDirError, DataError, CheckpointError)


def _say_error(text: str) -> None:
    """An error on stderr, in one write, so that two ranks' lines cannot run together. Under
    torchrun every rank says its own; ranks other than 0 mark theirs as PyTorch's logs do
    (`[rank1]: error: ...`)."""
    try:
        rank = launched_ranks()[0]
    except ConfigError:  # torchrun's variables are what is wrong: said in the text
        rank = 0
    with contextlib.suppress(OSError, ValueError):  # stderr gone: nothing else to tell
        sys.stderr.write(("" if rank == 0 else f"[rank{rank}]: ") + text + "\n")
        sys.stderr.flush()


def _failed_to_compile(e: BaseException) -> bool:
    """An error of torch.compile's backend (no C++ compiler for Inductor, say)."""
    dynamo = sys.modules.get("torch._dynamo.exc")  # there once anything was compiled
    return dynamo is not None and isinstance(e, dynamo.BackendCompilerFailed)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any config field can be overridden: --model.attention=sdpa --train.max_steps=200\n"
        + fields_help(),
        allow_abbrev=False,  # unknown --flags are config overrides; never guess a prefix
    )
    parser.add_argument(
        "--config",
        type=cli_path,
        help="TOML file with [model], [data], [train]; with --resume, the run's own config.toml "
        "is used instead when it has one",
    )
    parser.add_argument(
        "--out",
        type=cli_path,
        help="run directory (default: runs/<config name>, or runs/builtin without --config)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its checkpoint"
    )
    parser.add_argument(
        "--stop-after",
        type=int,
        metavar="N",
        help="stop (and save) after N more steps, e.g. to split a run across sessions",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """train.py's command; its exit status. What it prints is a view of the run, which
    metrics.jsonl and the checkpoint keep: a stderr gone or full costs its lines (the progress
    bar, notes), and a stdout that fails stops the run as SIGPIPE would (StopSignal), saved,
    with stdout's status (console.stdout_closed)."""
    with dropping("stdout", lines=True) as stdout, dropping("stderr"):
        status = _main(argv)
        failed = stdout.error
        # stdout's status where the run ended as planned or stdout stopped it; a signal's or
        # an error's stays
        if failed is not None and status in (0, 128 + signal.SIGPIPE):
            return stdout_closed(StdoutClosed.after(failed))
        return status


def _main(argv: list[str] | None) -> int:
    args, overrides = _parser().parse_known_args(argv)
    out: Path | None = None
    try:
        if args.stop_after is not None and args.stop_after < 1:
            raise TrainError(f"--stop-after {args.stop_after}: must be at least 1 step")
        # runs/<config name>; the built-in defaults are not configs/default.toml, so not
        # runs/default, where `make train` keeps that config's run.
        out = args.out or Path("runs") / (args.config.stem if args.config else "builtin")
        if not is_utf8(str(out)):  # sample.py could not open it: tokenizers takes UTF-8 paths
            raise TrainError(f"--out {str(out)!r}: not valid UTF-8; give another folder")
        saved = out / "config.toml"
        config_read = None
        if args.resume and saved.is_file():
            with contextlib.suppress(OSError):  # unreadable: run_config says so
                config_read = saved.read_bytes()
        config = run_config(out, args.config, overrides, args.resume)
        with StopAtOnce():  # in the set-up; the loop's own StopSignal saves first
            end = train(config, out, args.resume, args.stop_after, config_read)
    except USER_ERRORS as e:
        _say_error(f"error: {e}")
        return 2
    except (torch.OutOfMemoryError, RuntimeError, MemoryError) as e:
        said = _compile_or_memory_error(e)
        if said is None:
            raise
        _say_error(said)
        return 2
    except OSError as e:  # a full disk, a run folder made read-only: not this program's bug
        what, fix = describe_os_error(e)
        saved = out is not None and (out / CHECKPOINT).is_file()
        then = f"continue with {resume_hint(out)}" if saved else "run again"
        _say_error(
            f"error: {what}; the last checkpoint saved, if any, is whole: {fix or 'fix that'}, "
            f"then {then}"
        )
        return 2
    except UnicodeEncodeError as e:  # a line stdout's encoding lacks a character of: a path's
        saved = out is not None and (out / CHECKPOINT).is_file()
        _say_error(
            f"error: {cannot_show(e, 'a line of the run')}, then "
            + (f"continue with {resume_hint(out)}" if saved else "run again")
        )
        return 2
    except KeyboardInterrupt as e:  # a second SIGTERM too (StopNow): its own status
        _say_error("interrupted: stopped without saving; the last checkpoint, if any, is as it was")
        return 128 + getattr(e, "signum", signal.SIGINT)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if end.stopped_by is not None:
        # Saved, but not finished: a shell's `train && sample` must not go on. 128 + the signal
        # number, as the shell reports a process killed by it.
        return 128 + signal.Signals[end.stopped_by]
    tc = config.train
    # A sample only when the run has just reached its end: not after a split.
    finished = end.steps_taken > 0 and end.step == tc.max_steps
    shown = not getattr(sys.stdout, "failed", False)  # no sample into a stdout that failed
    if finished and shown and tc.sample_tokens > 0 and launched_ranks()[0] == 0:
        return _sample_at_end(end.run_dir, tc)
    return 0


def _compile_or_memory_error(e: BaseException) -> str | None:
    """What to tell the user of a failed torch.compile or of running out of memory (while
    compiling too: autotuning); None where the traceback should show instead: any other
    error (a bug, here or in torch), or a failed compile under TORCHDYNAMO_VERBOSE=1."""
    cause = getattr(e, "inner_exception", None) or e  # a compile's: the backend's own
    if _failed_to_compile(e) and not out_of_memory(cause):
        if os.environ.get("TORCHDYNAMO_VERBOSE") == "1":  # torch's knob for its traceback
            return None
        return (
            f"error: train.compile=true, and torch.compile failed: "
            f"{one_line(cause)[:200]}; train without it "
            "(--train.compile=false), or fix what it names (TORCHDYNAMO_VERBOSE=1 shows "
            "torch's traceback); the last checkpoint, if any, is as it was"
        )
    if not out_of_memory(cause):
        return None
    return (
        f"error: out of memory ({first_line(cause)[:200]}); "
        "lower train.batch_size (raise train.grad_accum to keep the tokens per step; with "
        "train.global_batch_size set, that is derived), or the "
        "model's size (model.block_size, n_layer, n_embd); the last checkpoint, if any, is "
        "as it was"
    )


def _sample_at_end(run_dir: Path, tc: TrainConfig) -> int:
    """A finished run's sample (train.sample_tokens of it), printed; the exit status."""
    print(f"\n--- sample from {run_dir} (prompt {tc.sample_prompt!r}) ---")
    try:
        import sample  # here: it needs `tokenizers`, training does not
    except ImportError as e:
        print(f"error: no sample ({e}); the run is saved in {run_dir}", file=sys.stderr)
        return 2
    try:
        text = sample.sample_run(run_dir, tc.sample_prompt, tc.sample_tokens, device=tc.device)
    except KeyboardInterrupt:
        print("sample interrupted; the run is saved", file=sys.stderr)
        return 130
    except (*sample.USER_ERRORS, ValueError) as e:
        print(f"error: no sample ({e}); the run is saved in {run_dir}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    code = main()
    with contextlib.suppress(ConfigError):  # an environment main has refused: no ranks
        if launched_ranks()[1] > 1:
            # Under torchrun, leave without interpreter teardown: gloo's worker threads outlive
            # destroy_process_group once DDP has run (torch 2.13), and one freeing its last
            # job during teardown can abort the process (SIGABRT), failing a finished run.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    sys.exit(code)
