"""Train a GPT on a prepared corpus, with any attention variant, on one device or under torchrun.

    python train.py --config configs/default.toml [--section.field=value ...] [--out DIR]
    python train.py --out runs/default --resume [--train.max_steps=N ...]   # its own config.toml
    torchrun --nproc_per_node=2 train.py --config configs/tiny.toml

A run directory holds ckpt.pt, config.toml, metrics.jsonl and the corpus's tokenizer.json.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import record_function
from tqdm import tqdm

from checkpoint import (
    CHECKPOINT,
    CheckpointError,
    describe_os_error,
    first_non_finite,
    provenance,
    restore_rng,
    restoring,
    rng_states,
    save_checkpoint,
    write_atomically,
)
from config import (
    Config,
    ConfigError,
    TrainConfig,
    fields_help,
)
from console import cli_path, first_line
from cpu_linear import LINEAR_PATHS, use_onednn_linears, wants_onednn
from data.loader import TokenBatches
from data.meta import DataError, check_vocab
from host import OtherLoad, keep_freed_host_memory
from metrics import MetricsLog
from model import GPT, GPTConfig
from optim import build_optimizer, lr_at
from resume import (
    check_seed,
    corpus_meta,
    restore_state,
    say_the_batch_changed,
    say_the_corpus_changed,
    say_the_schedule_changed,
    say_what_resuming_changes,
)
from rundir import (
    RunDirError,
    lock_run_dir,
    open_run,
    resume_hint,
    run_config,
    write_run_files,
)
from runtime import (
    StepReadout,
    StopSignal,
    VariantUnavailable,
    agreed_signal,
    autocast,
    autocast_dtype,
    available_variants,
    check_variant,
    init_distributed,
    set_fp32_matmul_precision,
    wrap_ddp,
)

OTHER_LOAD_NOTE = 0.2  # a CPU run says so when other processes took more of the CPUs


class TrainError(RuntimeError):
    """A run that cannot start or go on; the message says what and where."""


# What a user can fix: printed as one "error: ..." line, exit status 2, nothing overwritten.
USER_ERRORS = (ConfigError, TrainError, RunDirError, DataError, CheckpointError)


# --- the training step ----------------------------------------------------------------------------
# The one training step of this project: profile_train.py imports it, never a copy.


class StepResult(NamedTuple):
    loss: Tensor  # the mean over this process's micro-batches (the caller all-reduces it)
    grad_norm: Tensor | None  # the gradients' total norm before clipping; None without clipping


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[tuple[Tensor, Tensor]],
    grad_clip: float = 0.0,
    amp_dtype: torch.dtype | None = None,
) -> StepResult:
    """Forward, backward and optimizer update over this process's micro-batches of one step
    (under DDP, with the gradients averaged over all processes).

    The regions are named for the profiler. Loss and norm come back as device tensors, so the
    caller decides when to synchronise.
    """
    device = next(model.parameters()).device
    n = len(micro_batches)
    total: Tensor | None = None
    for i, (x, y) in enumerate(micro_batches):
        # Under DDP, all-reduce gradients only after the last micro-batch.
        sync = (
            contextlib.nullcontext()
            if i == n - 1 or not isinstance(model, DDP)
            else model.no_sync()
        )
        with sync:
            with record_function("forward"), autocast(device, amp_dtype):
                _, loss = model(x, y)
                loss = loss / n
                # Summed in the region too, so the profiler finds no work outside the three.
                total = loss.detach() if total is None else total + loss.detach()
            with record_function("backward"):
                loss.backward()
    assert total is not None, "train_step needs at least one micro-batch"
    grad_norm = None
    with record_function("optimizer"):
        if grad_clip > 0:
            # foreach=None: the multi-tensor norm where the device has one (CPU, CUDA), a loop
            # elsewhere (MPS, meta), where foreach=True raises.
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip, foreach=None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return StepResult(total, grad_norm)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, batches: TokenBatches, n_batches: int, amp_dtype: torch.dtype | None
) -> float:
    """Mean loss over the same n_batches micro-batches every time (the generator is reset),
    over all ranks: train.py asks for eval_batches steps' worth (x grad_accum), so a config
    with global_batch_size evaluates the same windows on any number of ranks."""
    model.eval()
    batches.restart()
    device = batches.device
    total = torch.zeros((), device=device)
    for _ in range(n_batches):
        x, y = batches.next()
        with autocast(device, amp_dtype):
            total += model(x, y)[1]
    model.train()
    if dist.is_initialized():
        dist.all_reduce(total)
        total /= dist.get_world_size()
    return total.item() / n_batches


# --- what a run is made of: model, optimizer, batches ------------------------------------------


def compile_blocks(model: GPT) -> None:
    """torch.compile each transformer block in place; embeddings, head and loss stay eager.

    The blocks are identical modules, so they share one compiled graph: compile time stays
    flat with depth (as in torchtitan), which is what a sweep over n_layer needs.
    """
    for block in model.blocks:
        block.compile()


def build_model(
    model_cfg: GPTConfig,
    tc: TrainConfig,
    device: torch.device,
    *,
    onednn: bool,
    compile: bool,
) -> tuple[GPT, torch.optim.AdamW]:
    """The model and optimizer as a training run makes them; the profiler and demo use it too.

    Seed the RNG before calling: initialisation draws from it.
    """
    model = GPT(model_cfg).to(device)
    if onednn:
        use_onednn_linears(model)
    optimizer = build_optimizer(model, tc, device)
    if compile:
        compile_blocks(model)  # in place: parameter names and the state dict do not change
    return model, optimizer


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


def linear_path(config: Config, device: torch.device, amp_dtype: torch.dtype | None) -> bool:
    """Whether nn.Linear goes through oneDNN (cpu_linear.py), as train.cpu_linear asks; an
    error naming the field where it asks for what cannot run here."""
    try:
        return wants_onednn(config.train.cpu_linear, device, amp_dtype is not None)
    except ValueError as e:
        raise TrainError(str(e)) from None


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


# --- the loop -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunEnd:
    """How a call to `train` ended."""

    run_dir: Path
    step: int  # the run's step count now
    steps_taken: int  # optimizer steps taken by this call
    stopped_by: str | None  # the signal's name (SIGINT, SIGTERM) when stopped before its last step


class Pending(NamedTuple):
    """A step whose values the host has not read yet."""

    step: int
    readout: StepReadout
    peak_mem: int | None  # the CUDA allocator's peak, in bytes, since the last logged step


def _say_how_it_runs(
    config: Config,
    params: int,
    device: torch.device,
    world_size: int,
    grad_accum: int,
    tokens: int,
    linear: str,
    kept_host_memory: bool,
) -> None:
    """The run's first lines: model, device, tokens per step and how they split, the CPU's
    Linear path and memory reuse; and a warning for a schedule that never leaves its warm-up."""
    tc = config.train
    # batch_size is per process, as in torchtitan: more ranks take more tokens per step.
    split = f" ({world_size} ranks x {tokens // world_size:,})" * (world_size > 1)
    if grad_accum > 1:
        split += f", {grad_accum} micro-batches of {tc.batch_size} sequences" + (
            " per rank" * (world_size > 1)
        )
    print(
        f"{config.model.attention}: {params / 1e6:.2f}M parameters (without position "
        f"embeddings) on {device}, {tokens:,} tokens per step{split}"
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
    meta = corpus_meta(config, out_dir, resume)
    check_vocab(meta, config.model.vocab_size, config.data.name)
    data_dir = Path(config.data.root) / config.data.name
    check_attention(config, device, amp_dtype, resume)
    onednn = linear_path(config, device, amp_dtype)

    ckpt_path, ckpt = open_run(out_dir, config, meta["tokenizer_sha256"], resume)
    if ckpt is not None:
        check_seed(ckpt, tc.seed, out_dir)
    # On CPU, which nn.Linear ran: train.cpu_linear=auto picks by CPU, so a run resumed on
    # another machine can change it.
    linear = ("onednn" if onednn else "torch") if device.type == "cpu" else None
    if master and ckpt is not None:
        say_what_resuming_changes(ckpt, config, linear)
        say_the_corpus_changed(ckpt, meta, config.data.name)
        say_the_schedule_changed(ckpt, tc)

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
        if step >= tc.max_steps:
            if master:
                print(f"{out_dir} is complete (step {step} of train.max_steps={tc.max_steps})")
            return RunEnd(out_dir, step, 0, None)
        with restoring(ckpt_path, "rng"):
            ranks_before = restore_rng(ckpt["rng"], tc.seed, step, device, rank, world_size)
        if master:
            say_the_batch_changed(ckpt, tc, ranks_before, world_size, config.model.dropout)
    resumed = ckpt is not None
    del ckpt  # its copy of the weights and optimizer state: host memory the run no longer needs
    model = wrap_ddp(raw_model, device) if world_size > 1 else raw_model

    tokens_per_step = tc.batch_size * grad_accum * world_size * config.model.block_size
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
        # Asked once, not at every save; with the device and, on CPU, the Linear path it ran.
        written_by={**provenance(), "device": str(device), "linear": linear} if master else {},
    )
    return run.loop()


@dataclass(eq=False, repr=False)  # holds the model: no field-by-field == or repr
class Run:
    """A run under way, as `_train` set it up: the loop, and what it does between steps
    (read a step's values, evaluate, save)."""

    config: Config
    out_dir: Path
    device: torch.device
    rank: int
    world_size: int
    raw_model: GPT
    model: torch.nn.Module  # raw_model, or its DDP wrapper under torchrun
    optimizer: torch.optim.Optimizer
    batches: dict[str, TokenBatches]
    meta: dict[str, Any]  # the corpus's meta.json
    amp_dtype: torch.dtype | None
    grad_accum: int  # micro-batches per step on each rank
    tokens_per_step: int  # of the whole job, all ranks
    ckpt_path: Path
    step: int  # the run's step count: optimizer steps taken, by this call and before
    last_step: int  # where this call stops: train.max_steps, or before it with --stop-after
    resumed: bool
    unsaved_config: bytes | None  # rank 0's settings that config.toml does not hold yet
    written_by: dict[str, Any]  # saved with each checkpoint: torch, host, device, Linear path
    bar: tqdm = field(init=False)
    logs: MetricsLog = field(init=False)
    bpb_factor: float = field(init=False)  # val_loss (nats per token) -> bits per byte
    eval_micro_batches: int = field(init=False)
    to_means: Tensor = field(init=False)

    def __post_init__(self) -> None:
        tc = self.config.train
        val = self.meta["splits"]["val"]
        self.bpb_factor = val["tokens"] / val["bytes"] / math.log(2)
        # A step's worth of windows per eval batch: the same ones on any number of ranks.
        self.eval_micro_batches = tc.eval_batches * self.grad_accum
        self.bar = tqdm(
            total=tc.max_steps,
            initial=self.step,
            disable=not self.master,
            desc=self.config.model.attention,
            dynamic_ncols=True,
            mininterval=1.0,
        )
        self.logs = MetricsLog(
            self.out_dir / "metrics.jsonl",
            enabled=self.master,
            log_interval=tc.log_interval,
            last_step=self.last_step,
            tokens_per_step=self.tokens_per_step,
            flops_per_step=self.raw_model.flops_per_token() * self.tokens_per_step,
            peak_tflops=tc.peak_tflops,
            devices=self.world_size,
            warn=lambda message: self.bar.write(message, file=sys.stderr),
        )
        # Turns the all-reduced sums of (loss, stop flag, norm) into the mean loss, the
        # number of ranks asked to stop, and the norm (the same on every rank).
        self.to_means = torch.tensor(
            [1 / self.world_size, 1.0, 1 / self.world_size], device=self.device
        )

    @property
    def master(self) -> bool:
        return self.rank == 0

    def loop(self) -> RunEnd:
        """Train from `step` to `last_step`, evaluating and saving every train.eval_interval
        steps and at the end; a signal ends it early, saved."""
        tc = self.config.train
        first_step = self.step
        other_load = OtherLoad()
        with (
            StopSignal(torchrun="TORCHELASTIC_RUN_ID" in os.environ) as stop,
            self.bar,
        ):  # the bar closes on errors too, before the message
            if not self.resumed and tc.eval_interval:
                # The untrained model's losses (about ln(vocab_size)): where the curve starts.
                _, losses = self.eval_and_log()
                if self.master:
                    self.bar.write(f"step 0: {losses}, before training")
            self.model.train()
            unread: Pending | None = None  # the step before, until it is read
            while self.step < self.last_step:
                pending = self.queue_step(stop)
                # The host reads a step's values only once the next step is queued, so the
                # device never idles while Python logs and fetches the next batch (on the
                # CPU, where nothing is queued, this gains nothing). A non-finite loss is thus
                # caught one step late; nothing is saved in between.
                stop_requested = self.read(unread, pending.readout) if unread is not None else False
                unread = pending
                # A single process knows of its signal at once; ranks learn of each other's
                # through the flags.
                stop_requested |= self.world_size == 1 and stop.received is not None
                evaluating = bool(tc.eval_interval) and self.step % tc.eval_interval == 0
                if not (stop_requested or evaluating or self.step == self.last_step):
                    continue
                stop_requested |= self.read(unread, None)  # checked before anything is saved
                unread = None
                if stop_requested and self.step < self.last_step:  # the last step ends as planned
                    self.save_to_stop()
                    return self.stopped(stop, first_step, other_load)
                if evaluating and self.step != self.last_step:
                    self.eval_and_save()
                    # A signal during the evaluation: saved with it, so one process stops now
                    # (ranks learn of each other's signals only in the next step's flags)
                    if self.world_size == 1 and stop.received is not None:
                        return self.stopped(stop, first_step, other_load)
            self.eval_and_save()
        self.note_other_load(other_load)
        if self.master and self.step < tc.max_steps:
            print(
                f"paused after step {self.step} of {tc.max_steps} (--stop-after "
                f"{self.last_step - first_step}); resume with {resume_hint(self.out_dir)}",
                file=sys.stderr,
            )
        return RunEnd(self.out_dir, self.step, self.step - first_step, None)

    def stopped(self, stop: StopSignal, first_step: int, other_load: OtherLoad) -> RunEnd:
        """The end of a run a signal stopped, once it is saved."""
        stopped_by = agreed_signal(stop.received, self.device, self.world_size)
        self.bar.close()
        self.note_other_load(other_load)
        if self.master:
            print(
                f"stopped by {stopped_by} after step {self.step}; resume with "
                f"{resume_hint(self.out_dir)}",
                file=sys.stderr,
            )
        return RunEnd(self.out_dir, self.step, self.step - first_step, stopped_by)

    def queue_step(self, stop: StopSignal) -> Pending:
        """One training step, queued; its loss, norm and this rank's stop flag not yet read.
        The flag is made after the step: a signal that came during it stops every rank after
        this step, not the next."""
        tc = self.config.train
        readout = StepReadout(self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, tc)
        micro = [self.batches["train"].next() for _ in range(self.grad_accum)]
        loss, grad_norm = train_step(
            self.model, self.optimizer, micro, tc.grad_clip, self.amp_dtype
        )
        self.step += 1
        # One small all-reduce carries both the mean loss and "anyone asked to stop", so every
        # rank stops at the same step and none waits forever on a collective. The norm rides
        # along: DDP's gradients, and so their norm, are the same on every rank. Made on the
        # device (torch.full, not torch.tensor): copying a value from pageable host memory to
        # a GPU waits for the GPU, which is what reading a step late avoids.
        stop_flag = torch.full((), float(stop.received is not None), device=self.device)
        norm = grad_norm.float() if grad_norm is not None else torch.zeros((), device=self.device)
        flags = torch.stack([loss.float(), stop_flag, norm])
        if self.world_size > 1:
            dist.all_reduce(flags)
            flags *= self.to_means
        readout.finish(flags)
        # The allocator counts what the host has queued, so the peak is read now, before the
        # next step is queued; it is reset where a line is logged, so each line has the peak
        # since the one before.
        peak_mem = None
        if self.device.type == "cuda":
            peak_mem = torch.cuda.max_memory_allocated(self.device)
            if self.logs.wants(self.step):
                torch.cuda.reset_peak_memory_stats(self.device)
        return Pending(self.step, readout, peak_mem)

    def read(self, pending: Pending, following: StepReadout | None) -> bool:
        """Wait for a step's values, check, show and log them; True if a rank asked to stop."""
        tc = self.config.train
        (loss, stops, norm), seconds = pending.readout.read(following)
        if not math.isfinite(loss):
            raise self.stopped_unsaved(f"loss is {loss} at step {pending.step}")
        if tc.grad_clip > 0 and not math.isfinite(norm):
            # The loss came before the update; non-finite gradients made the weights NaN.
            raise self.stopped_unsaved(
                f"gradient norm is {norm} at step {pending.step}, so the step's update may "
                "have left the weights not finite"
            )
        # Shown at the bar's next redraw (at most once a second), not written out every step.
        self.bar.set_postfix(
            loss=f"{loss:.3f}",
            tok_s=f"{self.tokens_per_step / seconds:,.0f}",
            ms=f"{seconds * 1e3:.0f}",
            refresh=False,
        )
        self.bar.update(1)
        if self.logs.wants(pending.step):
            self.logs.step(
                pending.step,
                loss=loss,
                lr=lr_at(pending.step - 1, tc),
                seconds=seconds,
                grad_norm=norm if tc.grad_clip > 0 else None,
                peak_mem=pending.peak_mem,
            )
        return stops > 0

    def eval_and_log(self) -> tuple[float, str]:
        """val_loss and train_loss now, logged to metrics.jsonl; val_loss, and both as the
        progress line shows them."""
        val_loss = evaluate(
            self.model, self.batches["val"], self.eval_micro_batches, self.amp_dtype
        )
        if not math.isfinite(val_loss):  # the same on every rank: evaluate all-reduces it
            # Weights a step made non-finite while its own loss, computed before the update,
            # was finite (without clipping no norm shows it): never over the last good save.
            raise self.stopped_unsaved(
                f"val loss is {val_loss} at step {self.step}: the weights are not finite"
                if self.step
                else f"val loss is {val_loss} before training: the model's initial outputs "
                "are not finite (its config, or train.dtype)"
            )
        train_loss = evaluate(
            self.model, self.batches["train_eval"], self.eval_micro_batches, self.amp_dtype
        )
        val_bpb = val_loss * self.bpb_factor
        if self.master:
            self.logs.write(
                {
                    "step": self.step,
                    "val_loss": val_loss,
                    "val_bpb": val_bpb,
                    "train_loss": train_loss,
                }
            )
        return (
            val_loss,
            f"val loss {val_loss:.4f}, {val_bpb:.3f} bits/byte (train {train_loss:.4f})",
        )

    def eval_and_save(self) -> None:
        """Evaluate, then save the checkpoint (rank 0) with its loss and the state to go on."""
        val_loss, losses = self.eval_and_log()
        self.save(val_loss, losses)

    def save_to_stop(self) -> None:
        """Save without evaluating: a signal asks for a prompt stop, and torchrun kills its
        workers 30 s after forwarding one. The evaluation's other role, never saving weights
        a step made non-finite, is kept by checking them (the same on every rank)."""
        if first_non_finite(self.raw_model) is not None:
            raise self.stopped_unsaved(f"the weights are not finite at step {self.step}")
        self.save(None, "not evaluated, to stop promptly")

    def save(self, val_loss: float | None, losses: str) -> None:
        """The checkpoint (rank 0): the weights, the state to go on, and their val_loss."""
        rngs = rng_states(self.device, self.world_size)
        if self.master:
            meta = self.meta
            state = {
                "model": self.raw_model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "step": self.step,
                "rng": rngs,
                "data": self.batches["train"].state_dict(),
                "config": asdict(self.config),
                "tokenizer_sha256": meta["tokenizer_sha256"],
                "corpus_sha256": meta["content_sha256"],  # said on resume if it changed
                # How it was made, where meta.json says: said on resume if it is gone.
                "corpus": {"source": meta.get("source"), "settings": meta.get("settings")},
                "val_loss": val_loss,
                "written_by": self.written_by,
            }
            save_checkpoint(self.ckpt_path, state)
            if self.unsaved_config is not None:  # a resume's new settings, now the checkpoint's
                text = self.unsaved_config
                write_atomically(self.out_dir / "config.toml", lambda f: f.write(text))
                self.unsaved_config = None
            self.bar.write(f"step {self.step}: {losses}; saved {self.ckpt_path}")
        if self.world_size > 1:
            # No rank leaves before rank 0 has saved: torchrun ends the others when one exits
            # with an error status, which a stopped run does.
            dist.barrier()

    def stopped_unsaved(self, what: str) -> TrainError:
        last = f"the last good one is {self.ckpt_path}" if self.ckpt_path.is_file() else "none yet"
        return TrainError(f"{what}; stopped without saving a checkpoint ({last})")

    def note_other_load(self, other_load: OtherLoad) -> None:
        """On a CPU, say when other processes took a large share of it: the step times, and
        so the time to train, say as much about them as about this run."""
        single_cpu = self.device.type == "cpu" and self.world_size == 1
        share = other_load.share() if single_cpu else None
        if self.master and share is not None and share > OTHER_LOAD_NOTE:
            workers = " (Inductor's compile workers among them)" * self.config.train.compile
            print(
                f"note: other processes{workers} used {share:.0%} of the CPUs while this run "
                "trained; its step times (ms/step, tokens/s) are slower for it",
                file=sys.stderr,
            )


def _failed_to_compile(e: BaseException) -> bool:
    """An error of torch.compile's backend (no C++ compiler for Inductor, say)."""
    dynamo = sys.modules.get("torch._dynamo.exc")  # there once anything was compiled
    return dynamo is not None and isinstance(e, dynamo.BackendCompilerFailed)


def _out_of_memory(e: BaseException) -> bool:
    # CUDA raises OutOfMemoryError; the CPU allocator a RuntimeError that says so; Python
    # (NumPy, the batch loader) MemoryError.
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(e)


def main(argv: list[str] | None = None) -> int:
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
    args, overrides = parser.parse_known_args(argv)
    out: Path | None = None
    try:
        if args.stop_after is not None and args.stop_after < 1:
            raise TrainError(f"--stop-after {args.stop_after}: must be at least 1 step")
        # runs/<config name>; the built-in defaults are not configs/default.toml, so not
        # runs/default, where `make train` keeps that config's run.
        out = args.out or Path("runs") / (args.config.stem if args.config else "builtin")
        saved = out / "config.toml"
        config_read = None
        if args.resume and saved.is_file():
            with contextlib.suppress(OSError):  # unreadable: run_config says so
                config_read = saved.read_bytes()
        config = run_config(out, args.config, overrides, args.resume)
        end = train(config, out, args.resume, args.stop_after, config_read)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (torch.OutOfMemoryError, RuntimeError, MemoryError) as e:
        cause = getattr(e, "inner_exception", None) or e  # a compile's: the backend's own
        if _failed_to_compile(e) and not _out_of_memory(cause):
            if os.environ.get("TORCHDYNAMO_VERBOSE") == "1":  # torch's knob for its traceback
                raise
            print(
                f"error: train.compile=true, and torch.compile failed: "
                f"{type(cause).__name__}: {first_line(cause)[:200]}; train without it "
                "(--train.compile=false), or fix what it names (TORCHDYNAMO_VERBOSE=1 shows "
                "torch's traceback); the last checkpoint, if any, is as it was",
                file=sys.stderr,
            )
            return 2
        if not _out_of_memory(cause):  # out of memory while compiling too (autotuning)
            raise
        print(
            f"error: out of memory ({first_line(cause)[:200]}); "
            "lower train.batch_size (raise train.grad_accum to keep the tokens per step; with "
            "train.global_batch_size set, that is derived), or the "
            "model's size (model.block_size, n_layer, n_embd); the last checkpoint, if any, is "
            "as it was",
            file=sys.stderr,
        )
        return 2
    except OSError as e:  # a full disk, a run folder made read-only: not this program's bug
        what, fix = describe_os_error(e)
        saved = out is not None and (out / CHECKPOINT).is_file()
        then = f"continue with {resume_hint(out)}" if saved else "run again"
        print(
            f"error: {what}; the last checkpoint, if any, is as it was: {fix or 'fix that'}, "
            f"then {then}",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt as e:  # a second SIGTERM too (StopNow): its own status
        print(
            "interrupted: stopped without saving; the last checkpoint, if any, is as it was",
            file=sys.stderr,
        )
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
    if finished and tc.sample_tokens > 0 and int(os.environ.get("RANK", 0)) == 0:
        print(f"\n--- sample from {end.run_dir} (prompt {tc.sample_prompt!r}) ---")
        try:
            import sample  # here: it needs `tokenizers`, training does not
        except ImportError as e:
            print(f"error: no sample ({e}); the run is saved in {end.run_dir}", file=sys.stderr)
            return 2
        try:
            text = sample.sample_run(
                end.run_dir, tc.sample_prompt, tc.sample_tokens, device=tc.device
            )
        except KeyboardInterrupt:
            print("sample interrupted; the run is saved", file=sys.stderr)
            return 130
        except (*sample.USER_ERRORS, ValueError) as e:
            print(f"error: no sample ({e}); the run is saved in {end.run_dir}", file=sys.stderr)
            return 2
        print(text)
    return 0


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        # Under torchrun, leave without interpreter teardown: gloo's worker threads outlive
        # destroy_process_group once DDP has run (torch 2.13), and one freeing its last job
        # during teardown can abort the process (SIGABRT), failing a finished run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
