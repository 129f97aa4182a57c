"""The training loop: a run as start.py sets it up, stepped (step.py) to its last step or to
a signal, its losses read and logged between steps, evaluated and saved every eval_interval."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from tqdm import tqdm

from data.loader import TokenBatches
from model import GPT
from training.checkpoint import first_non_finite, rng_states, save_checkpoint, write_atomically
from training.config import Config
from training.host import OtherLoad
from training.metrics import MetricsLog, summarize_ms
from training.optim import lr_at
from training.rundir import resume_hint
from training.runtime import StepReadout, StopSignal, agreed_signal, stop_cause
from training.step import evaluate, train_step

OTHER_LOAD_NOTE = 0.2  # a CPU run says so when other processes took more of the CPUs


class TrainError(RuntimeError):
    """A run that cannot start or go on; the message says what and where (train.py prints it
    as one line)."""


@dataclass(frozen=True)
class RunEnd:
    """How a call to `train` ended."""

    run_dir: Path
    step: int  # the run's step count now
    steps_taken: int  # optimizer steps taken by this call
    # The signal's name when stopped before its last step: SIGINT, SIGTERM, or SIGPIPE for a
    # stdout that failed (StopSignal)
    stopped_by: str | None


class Pending(NamedTuple):
    """A step whose values the host has not read yet."""

    step: int
    readout: StepReadout
    peak_mem: int | None  # the CUDA allocator's peak, in bytes, since the last logged step


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
    # Saved with each checkpoint: torch and Python versions, commit, device, Linear path, precision
    written_by: dict[str, Any]
    bar: tqdm = field(init=False)
    logs: MetricsLog = field(init=False)
    bpb_factor: float = field(init=False)  # val_loss (nats per token) -> bits per byte
    eval_micro_batches: int = field(init=False)
    to_means: Tensor = field(init=False)
    step_seconds: list[float] = field(init=False, default_factory=list)  # this call's, as read
    first_step_compiled: bool = field(init=False, default=False)  # this call's first step

    def __post_init__(self) -> None:
        tc = self.config.train
        val = self.meta["splits"]["val"]
        self.bpb_factor = val["tokens"] / val["bytes"] / math.log(2)
        # A step's worth of windows per eval batch: with global_batch_size, the same ones on
        # any number of ranks (a fixed grad_accum evaluates more of them on more ranks).
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
            StopSignal(torchrun="TORCHELASTIC_RUN_ID" in os.environ, stdout=sys.stdout) as stop,
            self.bar,
        ):  # the bar closes on errors too, before the message
            if not self.resumed and tc.eval_interval:
                # The untrained model's losses (about ln(vocab_size)): where the curve starts.
                _, losses = self.eval_and_log()
                if self.signalled(stop):  # during it
                    return self.stopped_before_training(stop)
                if self.master:
                    self.bar.write(f"step 0: {losses}, before training")
            self.model.train()
            unread: Pending | None = None  # the step before, until it is read
            graphs = graphs_compiled()  # the step-0 evaluation's compiled before
            while self.step < self.last_step:
                pending = self.queue_step(stop)
                if self.step == first_step + 1:
                    self.first_step_compiled = graphs_compiled() > graphs
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
                    if self.signalled(stop):  # during the evaluation: saved with it
                        return self.stopped(stop, first_step, other_load)
            self.eval_and_save()
        self.say_step_times()
        self.note_other_load(other_load)
        if self.master and self.step < tc.max_steps:
            print(
                f"paused after step {self.step} of {tc.max_steps} (--stop-after "
                f"{self.last_step - first_step}); resume with {resume_hint(self.out_dir)}",
                file=sys.stderr,
            )
        return RunEnd(self.out_dir, self.step, self.step - first_step, None)

    def signalled(self, stop: StopSignal) -> bool:
        """Whether any rank has had a signal, asked after an evaluation (every rank evaluates
        at the same steps): ranks agree through one small collective, where between steps they
        learn of each other's through the next step's flags, read a step late, and would train
        two steps more."""
        return agreed_signal(stop.received, self.device, self.world_size) is not None

    def stopped(self, stop: StopSignal, first_step: int, other_load: OtherLoad) -> RunEnd:
        """The end of a run a signal stopped, once it is saved."""
        stopped_by = agreed_signal(stop.received, self.device, self.world_size)
        self.bar.close()
        self.note_other_load(other_load)
        if self.master:
            print(
                f"stopped by {stop_cause(stopped_by)} after step {self.step}; resume with "
                f"{resume_hint(self.out_dir)}",
                file=sys.stderr,
            )
        return RunEnd(self.out_dir, self.step, self.step - first_step, stopped_by)

    def stopped_before_training(self, stop: StopSignal) -> RunEnd:
        """A signal during the evaluation before the first step: stopped at once, with nothing
        to save (a checkpoint holds the optimizer's state, which only a step makes)."""
        stopped_by = agreed_signal(stop.received, self.device, self.world_size)
        self.bar.close()
        if self.master:
            print(
                f"stopped by {stop_cause(stopped_by)} before the first step: nothing trained "
                "or saved; the same command starts the run again",
                file=sys.stderr,
            )
        return RunEnd(self.out_dir, self.step, 0, stopped_by)

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
        self.step_seconds.append(seconds)
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

    def say_step_times(self) -> None:
        """This call's step times in one line (evaluations and saves not in them), to compare
        runs by: their median, whatever the first steps' set-up cost, and its spread. A first
        step that compiled (torch.compile, flex's kernel) is said apart, out of the median: it
        can take a thousand steps' time, and a call of two steps would have half of it."""
        seconds = self.step_seconds
        if not self.master or not seconds:
            return
        compiled = ""
        if self.first_step_compiled and len(seconds) > 1:
            first, seconds = seconds[0], seconds[1:]
            compiled = (
                f"; step {self.step - len(seconds)} compiled ({first * 1e3:.0f} ms), left out"
            )
        elif self.first_step_compiled:
            compiled = ", its compiling included (the call's only step)"
        times = summarize_ms(seconds)
        median, n = times["median"], times["n"]
        spread = f" (p10 {times['p10']:.1f}, p90 {times['p90']:.1f})" if n >= 10 else ""
        steps = f"step {self.step}" if n == 1 else f"steps {self.step - n + 1}-{self.step}"
        print(
            f"{self.config.model.attention}, {steps}: median {median:.1f} ms/step{spread}, "
            f"{self.tokens_per_step / median * 1e3:,.0f} tokens/s{compiled}"
        )

    def note_other_load(self, other_load: OtherLoad) -> None:
        """On a CPU, say when other processes took a large share of it: the step times, and
        so the time to train, say as much about them as about this run."""
        single_cpu = self.device.type == "cpu" and self.world_size == 1
        share = other_load.share() if single_cpu else None
        if self.master and share is not None and share > OTHER_LOAD_NOTE:
            workers = (
                " (Inductor's compile workers among them)" if self.config.train.compile else ""
            )
            print(
                f"note: other processes{workers} used {share:.0%} of the CPUs while this run "
                "trained; its step times (ms/step, tokens/s) are slower for it",
                file=sys.stderr,
            )


def graphs_compiled() -> int:
    """The graphs Dynamo has compiled in this process: none where it was never imported."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return 0 if dynamo is None else dynamo.counters["stats"]["unique_graphs"]
