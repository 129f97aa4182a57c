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
from dataclasses import asdict, dataclass
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
    load_checkpoint,
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
    dump_toml,
    fields_help,
)
from cpu_linear import LINEAR_PATHS, use_onednn_linears, wants_onednn
from data.loader import TokenBatches
from data.meta import DataError, check_vocab, load_meta, rebuild_command
from metrics import MetricsLog, start_metrics
from model import GPT, GPTConfig
from optim import build_optimizer, lr_at
from resume import (
    restore_state,
    say_the_batch_changed,
    say_the_corpus_changed,
    say_the_ranks_changed,
    say_the_schedule_changed,
    say_what_resuming_changes,
)
from rundir import RunDirError, lock_run_dir, open_run, resume_hint, run_config
from runtime import (
    OtherLoad,
    StepReadout,
    StopSignal,
    VariantUnavailable,
    agreed_signal,
    autocast,
    autocast_dtype,
    available_variants,
    check_variant,
    init_distributed,
    keep_freed_host_memory,
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
    loss: Tensor  # the mean loss over the global batch
    grad_norm: Tensor | None  # the gradients' total norm before clipping; None without clipping


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[tuple[Tensor, Tensor]],
    grad_clip: float = 0.0,
    amp_dtype: torch.dtype | None = None,
) -> StepResult:
    """Forward, backward and optimizer update over one global batch.

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
        )
        # "train_eval": fixed windows of the train split, evaluated beside val so the gap
        # between the two (overfitting) shows; "train" is the sampler the steps draw from.
        for name, split, offset in (
            ("train", "train", 0),
            ("val", "val", 1),
            ("train_eval", "train", 2),
        )
    }


# --- the loop ---------------------------------------------------------------------------------------


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


def check_seed(ckpt: dict[str, Any], seed: int, out_dir: Path) -> None:
    """A resume goes on from the checkpoint's random state (dropout, the batch order), so
    another train.seed would change only the windows val_loss and train_loss are evaluated
    on: the curve would jump, the randomness not change. An error, before anything runs."""
    before = ckpt.get("config", {}).get("train", {}).get("seed")
    if before is not None and before != seed:
        raise TrainError(
            f"train.seed={seed}: {out_dir} was seeded with {before}. A resumed run goes on "
            "from its checkpoint's random state, so another seed would only move the windows "
            f"its losses are evaluated on; resume with train.seed={before}, or train another "
            "run (--out) with this seed"
        )


def trained_on(ckpt_path: Path, data_dir: Path) -> tuple[str | None, str | None]:
    """The data.name of the corpus the checkpoint trained on, and the command that makes that
    corpus again into `data_dir`; each None where the checkpoint does not say (the command:
    checkpoints from before it was recorded)."""
    try:
        ckpt = load_checkpoint(ckpt_path, needs=())
    except CheckpointError:
        return None, None
    try:
        name = ckpt["config"]["data"]["name"]
    except (KeyError, TypeError):
        name = None
    try:
        corpus = ckpt["corpus"]
        command = rebuild_command(data_dir, corpus["source"], corpus["settings"])
    except (KeyError, TypeError, AttributeError):
        command = None
    return (name if isinstance(name, str) else None), command


def corpus_meta(config: Config, out_dir: Path, resume: bool) -> dict[str, Any]:
    """The corpus's meta.json. A resume whose corpus is gone is told how to get it back: the
    corpus it trained on (another --data.name given now), or the command that makes it again."""
    try:
        return load_meta(config.data.root, config.data.name, config.model.vocab_size)
    except DataError as e:
        tokenizer = out_dir / "tokenizer.json"
        if not (resume and tokenizer.is_file()):
            raise
        data_dir = Path(config.data.root) / config.data.name
        # Problem first: a missing corpus's own hint, a stdlib command, makes another one.
        problem = e if (data_dir / "meta.json").is_file() else f"no prepared corpus at {data_dir}/"
        name, command = trained_on(out_dir / CHECKPOINT, data_dir)
        if name not in (None, config.data.name):  # --data.name=other on resume
            raise DataError(
                f"{problem}; {out_dir} trained on corpus '{name}' (data.name): resume it on "
                f"that one (--data.name={name}, or leave --data.name out)"
            ) from None
        again = (
            f"prepare it again as the run's was made: {command}"
            if command is not None
            else "prepare it again from the source and with the settings the run trained on"
        )
        raise DataError(
            f"{problem}; to resume {out_dir}, give "
            f"--data.root=FOLDER where that corpus is now, or {again} (its tokenizer must "
            f"come out as {tokenizer})"
        ) from None


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
        say_the_batch_changed(ckpt, tc)

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
        if master and ranks_before not in (None, world_size):
            with restoring(ckpt_path, "config"):
                batch_before = int(ckpt["config"]["train"]["batch_size"])
            say_the_ranks_changed(ranks_before, batch_before, world_size, tc.batch_size)
    resumed = ckpt is not None
    del ckpt  # its copy of the weights and optimizer state: host memory the run no longer needs
    model = wrap_ddp(raw_model, device) if world_size > 1 else raw_model

    tokens_per_step = tc.batch_size * grad_accum * world_size * config.model.block_size
    flops_per_step = raw_model.flops_per_token() * tokens_per_step

    # config.toml is the config of the run's checkpoint: a new run's is written now; on
    # resume, one with other settings replaces it only after the first checkpoint they make,
    # so a resume that fails before (a NaN from a bad override) leaves the run as it was.
    unsaved_config: bytes | None = None  # rank 0's settings config.toml does not hold yet
    if master:  # the directory was made and locked by lock_run_dir
        text = dump_toml(config).encode("utf-8")
        if not resumed:
            write_atomically(saved, lambda f: f.write(text))
        elif not (saved.is_file() and saved.read_bytes() == text):
            unsaved_config = text
        start_metrics(out_dir / "metrics.jsonl", step if resumed else None)
        # Atomically, as every file of the run: sample.py may be reading it.
        tokenizer = (data_dir / "tokenizer.json").read_bytes()
        write_atomically(out_dir / "tokenizer.json", lambda f: f.write(tokenizer))
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
    # Asked once, not at every save; with the device and, on CPU, the Linear path it ran.
    written_by = {**provenance(), "device": str(device), "linear": linear} if master else {}
    bpb_factor = meta["splits"]["val"]["tokens"] / meta["splits"]["val"]["bytes"] / math.log(2)

    first_step = step
    last_step = tc.max_steps if stop_after is None else min(tc.max_steps, step + stop_after)
    bar = tqdm(
        total=tc.max_steps,
        initial=step,
        disable=not master,
        desc=config.model.attention,
        dynamic_ncols=True,
        mininterval=1.0,
    )
    logs = MetricsLog(
        out_dir / "metrics.jsonl",
        enabled=master,
        log_interval=tc.log_interval,
        last_step=last_step,
        tokens_per_step=tokens_per_step,
        flops_per_step=flops_per_step,
        peak_tflops=tc.peak_tflops,
        devices=world_size,
        warn=lambda message: bar.write(message, file=sys.stderr),
    )

    def stopped_unsaved(what: str) -> TrainError:
        last = f"the last good one is {ckpt_path}" if ckpt_path.is_file() else "none yet"
        return TrainError(f"{what}; stopped without saving a checkpoint ({last})")

    # A step's worth of windows per eval batch: the same ones on any number of ranks.
    eval_micro_batches = tc.eval_batches * grad_accum

    def evaluate_and_log() -> tuple[float, str]:
        """val_loss and train_loss now, logged to metrics.jsonl; val_loss, and both as the
        progress line shows them."""
        val_loss = evaluate(model, batches["val"], eval_micro_batches, amp_dtype)
        if not math.isfinite(val_loss):  # the same on every rank: evaluate all-reduces it
            # Weights a step made non-finite while its own loss, computed before the update,
            # was finite (without clipping no norm shows it): never over the last good save.
            raise stopped_unsaved(
                f"val loss is {val_loss} at step {step}: the weights are not finite"
                if step
                else f"val loss is {val_loss} before training: the model's initial outputs "
                "are not finite (its config, or train.dtype)"
            )
        train_loss = evaluate(model, batches["train_eval"], eval_micro_batches, amp_dtype)
        if master:
            logs.write(
                {
                    "step": step,
                    "val_loss": val_loss,
                    "val_bpb": val_loss * bpb_factor,
                    "train_loss": train_loss,
                }
            )
        losses = (
            f"val loss {val_loss:.4f}, {val_loss * bpb_factor:.3f} bits/byte "
            f"(train {train_loss:.4f})"
        )
        return val_loss, losses

    def eval_and_save() -> None:
        nonlocal unsaved_config
        val_loss, losses = evaluate_and_log()
        rngs = rng_states(device, world_size)
        if master:
            state = {
                "model": raw_model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "rng": rngs,
                "data": batches["train"].state_dict(),
                "config": asdict(config),
                "tokenizer_sha256": meta["tokenizer_sha256"],
                "corpus_sha256": meta["content_sha256"],  # said on resume if it changed
                # How it was made: said on resume if it is gone.
                "corpus": {"source": meta["source"], "settings": meta["settings"]},
                "val_loss": val_loss,
                "written_by": written_by,
            }
            save_checkpoint(ckpt_path, state)
            if unsaved_config is not None:  # a resume's new settings, now the checkpoint's
                write_atomically(saved, lambda f: f.write(unsaved_config))
                unsaved_config = None
            bar.write(f"step {step}: {losses}; saved {ckpt_path}")
        if world_size > 1:
            # No rank leaves before rank 0 has saved: torchrun ends the others when one exits
            # with an error status, which a stopped run does.
            dist.barrier()

    def report(pending: Pending, following: StepReadout | None) -> bool:
        """Wait for a step's values, check, show and log them; True if a rank asked to stop."""
        (loss, stops, norm), seconds = pending.readout.read(following)
        if not math.isfinite(loss):
            raise stopped_unsaved(f"loss is {loss} at step {pending.step}")
        if tc.grad_clip > 0 and not math.isfinite(norm):
            # The loss came before the update; non-finite gradients made the weights NaN.
            raise stopped_unsaved(
                f"gradient norm is {norm} at step {pending.step}, so the step's update may "
                "have left the weights not finite"
            )
        # Shown at the bar's next redraw (at most once a second), not written out every step.
        bar.set_postfix(
            loss=f"{loss:.3f}",
            tok_s=f"{tokens_per_step / seconds:,.0f}",
            ms=f"{seconds * 1e3:.0f}",
            refresh=False,
        )
        bar.update(1)
        if logs.wants(pending.step):
            logs.step(
                pending.step,
                loss=loss,
                lr=lr_at(pending.step - 1, tc),
                seconds=seconds,
                grad_norm=norm if tc.grad_clip > 0 else None,
                peak_mem=pending.peak_mem,
            )
        return stops > 0

    other_load = OtherLoad()

    def note_other_load() -> None:
        """On a CPU, say when other processes took a large share of it: the step times, and
        so the time to train, say as much about them as about this run."""
        share = other_load.share() if device.type == "cpu" and world_size == 1 else None
        if master and share is not None and share > OTHER_LOAD_NOTE:
            workers = " (Inductor's compile workers among them)" * tc.compile
            print(
                f"note: other processes{workers} used {share:.0%} of the CPUs while this run "
                "trained; its step times (ms/step, tokens/s) are slower for it",
                file=sys.stderr,
            )

    with (
        StopSignal(torchrun="TORCHELASTIC_RUN_ID" in os.environ) as stop,
        bar,
    ):  # the bar closes on errors too, before the message
        if not resumed and tc.eval_interval:
            # The untrained model's losses (about ln(vocab_size)): where the curve starts.
            _, losses = evaluate_and_log()
            if master:
                bar.write(f"step 0: {losses}, before training")
        model.train()
        to_means = torch.tensor([1 / world_size, 1.0, 1 / world_size], device=device)
        unread: Pending | None = None  # the step before, until it is read
        while step < last_step:
            readout = StepReadout(device)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, tc)
            micro = [batches["train"].next() for _ in range(grad_accum)]
            loss, grad_norm = train_step(model, optimizer, micro, tc.grad_clip, amp_dtype)
            step += 1
            # One small all-reduce carries both the mean loss and "anyone asked to stop", so
            # every rank stops at the same step and none waits forever on a collective. The
            # norm rides along: DDP's gradients, and so their norm, are the same on every rank.
            # Made on the device (torch.full, not torch.tensor): copying a value from pageable
            # host memory to a GPU waits for the GPU, which is what the lag below avoids.
            stop_flag = torch.full((), float(stop.received is not None), device=device)
            norm = grad_norm.float() if grad_norm is not None else torch.zeros((), device=device)
            flags = torch.stack([loss.float(), stop_flag, norm])
            if world_size > 1:
                dist.all_reduce(flags)
                flags *= to_means
            readout.finish(flags)
            # The allocator counts what the host has queued, so the peak is read now, before
            # the next step is queued; it is reset where a line is logged, so each line has
            # the peak since the one before.
            peak_mem = None
            if device.type == "cuda":
                peak_mem = torch.cuda.max_memory_allocated(device)
                if logs.wants(step):
                    torch.cuda.reset_peak_memory_stats(device)
            # The host reads a step's values only once the next step is queued, so the device
            # never idles while Python logs and fetches the next batch (on the CPU, where
            # nothing is queued, this gains nothing). A non-finite loss is thus caught one
            # step late; nothing is saved in between.
            stop_requested = report(unread, readout) if unread is not None else False
            unread = Pending(step, readout, peak_mem)
            # A single process knows of its signal at once; ranks learn of each other's
            # through the flags.
            stop_requested |= world_size == 1 and stop.received is not None
            evaluating = bool(tc.eval_interval) and step % tc.eval_interval == 0
            if not (stop_requested or evaluating or step == last_step):
                continue
            stop_requested |= report(unread, None)  # checked before anything is saved
            unread = None
            if stop_requested and step < last_step:  # on the last step, the run ends as planned
                eval_and_save()
                stopped_by = agreed_signal(stop.received, device, world_size)
                bar.close()
                note_other_load()
                if master:
                    print(
                        f"stopped by {stopped_by} after step {step}; resume with "
                        f"{resume_hint(out_dir)}",
                        file=sys.stderr,
                    )
                return RunEnd(out_dir, step, step - first_step, stopped_by)
            if evaluating and step != last_step:
                eval_and_save()
        eval_and_save()
    note_other_load()
    if master and step < tc.max_steps:
        print(
            f"paused after step {step} of {tc.max_steps} (--stop-after {stop_after}); "
            f"resume with {resume_hint(out_dir)}",
            file=sys.stderr,
        )
    return RunEnd(out_dir, step, step - first_step, None)


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
        type=Path,
        help="TOML file with [model], [data], [train]; with --resume, the run's own config.toml "
        "is used instead when it has one",
    )
    parser.add_argument(
        "--out",
        type=Path,
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
        # CUDA raises OutOfMemoryError; the CPU allocator a RuntimeError that says so; Python
        # (NumPy, the batch loader) MemoryError.
        oom = isinstance(e, (torch.OutOfMemoryError, MemoryError))
        if not oom and "can't allocate memory" not in str(e):
            raise
        print(
            f"error: out of memory ({(str(e).strip() or type(e).__name__).splitlines()[0][:200]}); lower "
            "train.batch_size (raise train.grad_accum to keep the tokens per step; with "
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
