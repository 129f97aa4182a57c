"""A run's set-up, as train.py's command starts it: everything checked that can be before a byte
is written (the run directory's lock, the corpus, the variant, the batch against the corpus, a
resume's checkpoint and seed), then the model, the checkpoint's state and the run's files, and
the lines that say how the run goes; then the loop (loop.py's `Run`).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import torch

from data.loader import TokenBatches
from data.meta import DataError, check_vocab
from training.checkpoint import provenance, restore_rng, restoring
from training.config import Config, TrainConfig
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
from training.rundir import lock_run_dir, open_run, write_run_files
from training.runtime import (
    autocast_dtype,
    init_distributed,
    missing_bf16_instructions,
    precision,
    set_fp32_matmul_precision,
    wrap_ddp,
)
from training.step import build_model


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
    """Run (or resume) training. Raises one of train.py's USER_ERRORS on bad input, before
    writing.

    config_read: the bytes of the run's config.toml that `config` was read from (train.py's
    main does, on --resume, before the run's lock is taken): if another process rewrote the file
    in between, resuming the same run with other settings, this one's are stale: an error."""
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
