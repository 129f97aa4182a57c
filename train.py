"""Train a GPT on a prepared corpus, with any attention variant, on one device or under torchrun.

    python train.py --config configs/default.toml [--section.field=value ...] [--out DIR]
    python train.py --out runs/default --resume [--train.max_steps=N ...]   # its own config.toml
    torchrun --nproc_per_node=2 train.py --config configs/tiny.toml

A run directory holds ckpt.pt, config.toml, metrics.jsonl and the corpus's tokenizer.json.

Here: the command line, and a run's set-up, everything checked before a byte is written. The
step is training/step.py's (profile_train.py imports the same one); the loop, training/loop.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

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
from data.loader import TokenBatches
from data.meta import DataError, check_vocab
from training.checkpoint import (
    CHECKPOINT,
    CheckpointError,
    describe_os_error,
    provenance,
    restore_rng,
    restoring,
)
from training.config import Config, ConfigError, TrainConfig, fields_help
from training.cpu_linear import LINEAR_PATHS, wants_onednn
from training.host import keep_freed_host_memory
from training.loop import Run, RunEnd, TrainError
from training.metrics import start_metrics
from training.optim import lr_at
from training.probe import VariantUnavailable, available_variants, check_variant
from training.resume import (
    check_seed,
    corpus_meta,
    restore_state,
    say_the_batch_changed,
    say_the_corpus_changed,
    say_the_schedule_changed,
    say_what_resuming_changes,
)
from training.rundir import (
    RunDirError,
    lock_run_dir,
    open_run,
    resume_hint,
    run_config,
    write_run_files,
)
from training.runtime import (
    StopAtOnce,
    autocast_dtype,
    init_distributed,
    launched_ranks,
    missing_bf16_instructions,
    out_of_memory,
    precision,
    set_fp32_matmul_precision,
    wrap_ddp,
)
from training.step import build_model

USER_ERRORS = (ConfigError, TrainError, RunDirError, DataError, CheckpointError)


# --- a run's set-up ------------------------------------------------------------------------------


def check_attention(
    config: Config, device: torch.device, amp_dtype: torch.dtype | None, resume: bool = False
) -> None:
    """Fail early, naming the variant and why, if it cannot train here, and the ones that can
    (a resume may change variant: attention holds no weights)."""
    mc, dtype = config.model, amp_dtype or torch.float32
    try:
        check_variant(mc.attention, device, dtype, mc.head_size, mc.dropout)
    except VariantUnavailable as e:
        runs = available_variants(device, dtype, mc.head_size, mc.dropout)
        if not runs:
            raise TrainError(str(e)) from None
        what = "resume with another (attention holds no weights)" if resume else "choose another"
        suggest = "sdpa" if "sdpa" in runs else runs[0]
        raise TrainError(
            f"{e}; {what}, e.g. --model.attention={suggest} (these train here: {', '.join(runs)})"
        ) from None


def token_batches(
    config: Config,
    data_dir: Path,
    meta: dict[str, Any],
    device: torch.device,
    rank: int,
    world_size: int,
) -> dict[str, TokenBatches]:
    """The run's batch samplers, each with its own seed."""
    tc = config.train
    return {
        name: TokenBatches(
            data_dir / f"{split}.bin",
            config.model.block_size,
            tc.batch_size,
            tc.seed + offset,
            device,
            rank,
            world_size,
            expected_tokens=meta["splits"][split]["tokens"],
            whole_batches=split == "train",
            vocab_size=meta["vocab_size"],
        )
        # "train_eval": fixed windows of the train split, evaluated beside val so the gap
        # between the two (overfitting) shows; "train" is the sampler the steps draw from.
        for name, split, offset in (
            ("train", "train", 0),
            ("val", "val", 1),
            ("train_eval", "train", 2),
        )
    }


def check_step_tokens(
    config: Config, meta: dict[str, Any], grad_accum: int, ckpt: dict[str, Any] | None
) -> None:
    """One process's step of more tokens than the train split holds is surely a typo
    (global_batch_size=4000000): each evaluation reads train.eval_batches x its micro-batches,
    and would run for hours before the first step. The loader refuses a micro-batch that large;
    this is the same for the micro-batches a step makes. A resume with the batch its run had
    is not refused now: the run chose it."""
    tc = config.train
    batch = ("batch_size", "grad_accum", "global_batch_size")
    before = (ckpt or {}).get("config", {}).get("train", {})
    if ckpt is not None and all(before.get(k) == getattr(tc, k) for k in batch):
        return
    tokens = tc.batch_size * grad_accum * config.model.block_size  # one process's micro-batches
    held = meta["splits"]["train"]["tokens"]
    if grad_accum > 1 and tokens > held:
        raise DataError(
            f"train.batch_size={tc.batch_size} x {grad_accum} micro-batches x model.block_size="
            f"{config.model.block_size} is {tokens:,} tokens a step in each process, more than "
            f"{config.data.dir / 'train.bin'} holds ({held:,}): lower train.global_batch_size "
            "(or train.grad_accum)"
        )


def _say_how_it_runs(
    config: Config,
    params: int,
    device: torch.device,
    world_size: int,
    grad_accum: int,
    tokens: int,
    linear: str | None,  # None off the CPU
    kept_host_memory: bool,
    computes_in: str,
) -> None:
    """The run's first lines: model, device, precision, tokens per step and how they split, the
    CPU's Linear path and memory reuse; and a warning for a schedule that never leaves its
    warm-up."""
    tc = config.train
    # batch_size is per process, as in torchtitan: more ranks take more tokens per step.
    split = f" ({world_size} ranks x {tokens // world_size:,})" if world_size > 1 else ""
    if grad_accum > 1:
        split += f", {grad_accum} micro-batches of {tc.batch_size} sequences" + (
            " per rank" if world_size > 1 else ""
        )
    print(
        f"{config.model.attention}: {params / 1e6:.2f}M parameters (without position "
        f"embeddings) on {device} in {computes_in}, {tokens:,} tokens per step{split}"
    )
    if device.type == "cpu":
        print(
            f"cpu: nn.Linear through {LINEAR_PATHS[linear]} (train.cpu_linear={tc.cpu_linear}); "
            f"freed memory {'kept for the next step' if kept_host_memory else 'returned to the OS'}"
        )
    if tc.warmup_steps and tc.warmup_steps >= tc.max_steps - 1:  # a run cut short, say
        print(
            f"warning: train.warmup_steps={tc.warmup_steps} with train.max_steps="
            f"{tc.max_steps}: the learning rate warms up the whole run, to "
            f"{lr_at(tc.max_steps - 1, tc):.3g} at the last step (train.lr={tc.lr:.3g}), "
            "and never decays; lower train.warmup_steps for a full schedule",
            file=sys.stderr,
        )


def _say_what_an_evaluation_reads(
    tc: TrainConfig, tokens_per_step: int, meta: dict[str, Any]
) -> None:
    """An evaluation takes train.eval_batches steps' worth of windows from each split, drawn at
    random: more than val.bin holds reads its tokens again and again, and can take hours
    (eval_batches=100000, one 0 too many) before the first step. Said, as nanoGPT-style
    settings on a small corpus do it on purpose."""
    reads, held = tc.eval_batches * tokens_per_step, meta["splits"]["val"]["tokens"]
    if reads > held:
        print(
            f"note: an evaluation reads train.eval_batches={tc.eval_batches} x "
            f"{tokens_per_step:,} tokens from each split, {reads / held:.1f} times what val.bin "
            f"holds ({held:,} tokens; its windows are drawn at random, so it reads them again): "
            "lower train.eval_batches for quicker evaluations",
            file=sys.stderr,
        )


def train(
    config: Config,
    out_dir: Path,
    resume: bool = False,
    stop_after: int | None = None,
    config_read: bytes | None = None,
) -> RunEnd:
    """Run (or resume) training. Raises one of USER_ERRORS on bad input, before writing.

    config_read: the bytes of the run's config.toml that `config` was read from (main does,
    on --resume, before the run's lock is taken): if another process rewrote the file in
    between, resuming the same run with other settings, this one's are stale: an error."""
    with contextlib.ExitStack() as held:  # the run directory's lock, once it is taken
        return _train(config, out_dir, resume, stop_after, config_read, held)


def _train(
    config: Config,
    out_dir: Path,
    resume: bool,
    stop_after: int | None,
    config_read: bytes | None,
    held: contextlib.ExitStack,
) -> RunEnd:
    """Everything checked that can be before a byte is written, then the model, the
    checkpoint's state and the run's files; then the loop (`Run`)."""
    tc = config.train
    rank, world_size, device = init_distributed(tc)
    lock_run_dir(held, out_dir, config, resume, rank, world_size, device)
    saved = out_dir / "config.toml"
    if config_read is not None and (not saved.is_file() or saved.read_bytes() != config_read):
        raise TrainError(
            f"{saved} changed while this process waited for the run (another one resumed it "
            "meanwhile); run the command again to resume with the settings it has now"
        )
    kept_host_memory = device.type == "cpu" and keep_freed_host_memory()
    master = rank == 0
    set_fp32_matmul_precision(tc.dtype, device)
    grad_accum = tc.micro_batches(world_size)
    amp_dtype = autocast_dtype(tc.dtype, device)
    computes_in = precision(tc.dtype, amp_dtype)  # said, and recorded with each checkpoint
    meta = corpus_meta(config, out_dir, resume)
    data_dir = config.data.dir
    check_attention(config, device, amp_dtype, resume)
    onednn = wants_onednn(tc.cpu_linear, device, amp_dtype is not None)

    # A resume's corpus prepared again since, with another vocabulary, is told as such here,
    # before the model's vocab_size is checked against it: that advice is for new runs.
    ckpt_path, ckpt = open_run(out_dir, config, meta["tokenizer_sha256"], resume)
    check_vocab(meta, config.model.vocab_size, config.data.name)
    check_step_tokens(config, meta, grad_accum, ckpt)
    if ckpt is not None:
        check_seed(ckpt, tc.seed, out_dir)
    # On CPU, which nn.Linear ran: train.cpu_linear=auto picks by CPU, so a run resumed on
    # another machine can change it.
    linear = ("onednn" if onednn else "torch") if device.type == "cpu" else None

    # Before the model: a corpus too small for the batch is told in a second, not after a
    # model of block_size (and its memory) is built.
    batches = token_batches(config, data_dir, meta, device, rank, world_size)
    # Per rank, as in nanoGPT: ranks must draw different dropout masks. Initial weights may
    # differ too; DDP broadcasts rank 0's when it wraps the model.
    torch.manual_seed(tc.seed + rank)
    raw_model, optimizer = build_model(config.model, tc, device, onednn=onednn, compile=tc.compile)
    step = 0
    if ckpt is not None:
        step = restore_state(ckpt, ckpt_path, raw_model, optimizer, batches["train"], tc)
        if step >= tc.max_steps:  # nothing to train: what resuming would change is moot
            if master:
                _say_complete(out_dir, step, tc.max_steps)
            return RunEnd(out_dir, step, 0, None)
        with restoring(ckpt_path, "rng"):
            ranks_before = restore_rng(ckpt["rng"], tc.seed, step, device, rank, world_size)
        if master:
            say_what_resuming_changes(ckpt, config, linear, computes_in)
            say_the_corpus_changed(ckpt, meta, config.data.name)
            say_the_schedule_changed(ckpt, tc)
            say_the_batch_changed(ckpt, tc, ranks_before, world_size, config.model.dropout)
    resumed = ckpt is not None
    del ckpt  # its copy of the weights and optimizer state: host memory the run no longer needs
    model = wrap_ddp(raw_model, device) if world_size > 1 else raw_model

    tokens_per_step = config.tokens_per_step(world_size)
    unsaved_config = None
    if master:  # the directory was made and locked by lock_run_dir
        unsaved_config = write_run_files(config, out_dir, data_dir, step if resumed else None)
        if resumed:
            print(f"resuming {out_dir} after step {step} of {tc.max_steps}")
        _say_how_it_runs(
            config,
            raw_model.num_params(),
            device,
            world_size,
            grad_accum,
            tokens_per_step,
            linear,
            kept_host_memory,
            computes_in,
        )
        _say_what_an_evaluation_reads(tc, tokens_per_step, meta)
        if (slow := missing_bf16_instructions(device, amp_dtype)) is not None:
            print(
                f"warning: train.dtype={tc.dtype!r}: {slow}; float32 trains faster here",
                file=sys.stderr,
            )
    run = Run(
        config=config,
        out_dir=out_dir,
        device=device,
        rank=rank,
        world_size=world_size,
        raw_model=raw_model,
        model=model,
        optimizer=optimizer,
        batches=batches,
        meta=meta,
        amp_dtype=amp_dtype,
        grad_accum=grad_accum,
        tokens_per_step=tokens_per_step,
        ckpt_path=ckpt_path,
        step=step,
        last_step=tc.max_steps if stop_after is None else min(tc.max_steps, step + stop_after),
        resumed=resumed,
        unsaved_config=unsaved_config,
        # Asked once, not at every save; with the device, the precision and, on CPU, the Linear
        # path it ran.
        written_by=(
            {
                **provenance(),
                "device": str(device),
                "linear": linear,
                "precision": computes_in,
            }
            if master
            else {}
        ),
    )
    return run.loop()


def _say_complete(out_dir: Path, step: int, max_steps: int) -> None:
    """A resume with nothing to train. Lines logged after the checkpoint (a run killed between
    saves, resumed with a train.max_steps it has reached) are dropped: no checkpoint has
    their steps, so the log ends where the run does."""
    if (out_dir / "metrics.jsonl").is_file():  # one deleted stays so: nothing to log
        start_metrics(out_dir / "metrics.jsonl", step, complete=True)
    if step > max_steps:
        print(
            f"{out_dir} is complete: its checkpoint is at step {step}, past "
            f"train.max_steps={max_steps}"
        )
    else:
        print(f"{out_dir} is complete (step {step} of train.max_steps={max_steps})")


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
