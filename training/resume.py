"""Resuming a run: the corpus and seed it trained with checked, its checkpoint's state put
back, and what the settings given now change against the run so far (attention variant,
Linear path, schedule, batch, processes), said before the first step, since a resumed run then
will not match one that never stopped."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

import torch

from data.loader import TokenBatches
from data.meta import DataError, load_meta, rebuild_command
from model import GPT
from training.checkpoint import (
    CHECKPOINT,
    CheckpointError,
    first_non_finite,
    load_checkpoint,
    restoring,
)
from training.config import Config, ConfigError, TrainConfig
from training.cpu_linear import LINEAR_PATHS
from training.optim import SCHEDULE_FIELDS, load_optimizer_state, lr_at
from training.runtime import precision


def check_seed(ckpt: dict[str, Any], seed: int, out_dir: Path) -> None:
    """A resume goes on from the checkpoint's random state (dropout, the batch order), so
    another train.seed would change only the windows val_loss and train_loss are evaluated
    on: the curve would jump, the randomness not change. An error, before anything runs."""
    before = ckpt.get("config", {}).get("train", {}).get("seed")
    if before is not None and before != seed:
        raise ConfigError(
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
        if not (resume and tokenizer.is_file()):  # (data.name is a plain name: DataConfig's)
            raise
        data_dir = config.data.dir
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


def say_what_resuming_changes(
    ckpt: dict[str, Any], config: Config, linear: str | None, computes_in: str
) -> None:
    """A resume in another precision, through another attention variant or nn.Linear path, or
    compiled where it ran eagerly (or back), computes the same function, rounded differently,
    and another dropout rate regularises differently: said, as the run will not match an
    uninterrupted one. (Checkpoints from before the precision and path were recorded have no
    "precision" and "linear".)"""
    rounding = (
        "the same function, rounded differently, so the run will not match one that never "
        "stopped to the last bit"
    )
    written_by = ckpt.get("written_by", {})
    precision_before = written_by.get("precision") or _precision_recorded(ckpt)
    if precision_before not in (None, computes_in):
        # Its Linear path follows from it (oneDNN's is fp32's): told here, not as a choice
        path = f", nn.Linear through {LINEAR_PATHS[linear]}" if linear is not None else ""
        print(
            f"resuming in {computes_in} (train.dtype={config.train.dtype}{path}); the run "
            f"trained in {precision_before} so far: {rounding}",
            file=sys.stderr,
        )
        linear = None
    trained_with = ckpt["config"]["model"].get("attention")
    if trained_with not in (None, config.model.attention):
        print(
            f"resuming with attention {config.model.attention}; the run trained with "
            f"{trained_with} so far (attention holds no weights; {rounding})",
            file=sys.stderr,
        )
    compiled_before = ckpt["config"].get("train", {}).get("compile")
    if compiled_before not in (None, config.train.compile):
        now, then = ("compiled", "eagerly") if config.train.compile else ("eagerly", "compiled")
        # Inductor draws dropout masks from its own generator, not the eager one
        masks = "; and other dropout masks" if config.model.dropout > 0 else ""
        print(
            f"resuming {now} (train.compile={str(config.train.compile).lower()}); the run "
            f"trained {then} so far (Inductor fuses and reorders the same ops: {rounding}"
            f"{masks})",
            file=sys.stderr,
        )
    dropout_before = ckpt["config"]["model"].get("dropout")
    if dropout_before not in (None, config.model.dropout):
        print(
            f"resuming with model.dropout={config.model.dropout}; the run trained with "
            f"{dropout_before} so far (dropout holds no weights; the run will not match one "
            "that never stopped)",
            file=sys.stderr,
        )
    linear_before = written_by.get("linear")
    if linear is not None and linear_before not in (None, linear):
        print(
            f"resuming with nn.Linear through {LINEAR_PATHS[linear]} (train.cpu_linear="
            f"{config.train.cpu_linear}); the run trained through "
            f"{LINEAR_PATHS.get(linear_before)} so far: {rounding}",
            file=sys.stderr,
        )


def _precision_recorded(ckpt: dict[str, Any]) -> str | None:
    """A checkpoint's precision from before written_by recorded it: from the train.dtype its
    config holds, or for auto on the CPU it ran on, fp32; None where that cannot tell (auto on
    a GPU: bf16 with bf16 tensor cores, else fp32)."""
    dtype = ckpt.get("config", {}).get("train", {}).get("dtype")
    if dtype in ("float32", "tf32", "bfloat16"):
        return precision(dtype, torch.bfloat16 if dtype == "bfloat16" else None)
    if dtype == "auto" and ckpt.get("written_by", {}).get("device") == "cpu":
        return "float32"
    return None


def say_the_corpus_changed(ckpt: dict[str, Any], meta: dict[str, Any], name: str) -> None:
    """A corpus prepared again with the same tokenizer resumes (the token ids mean the same),
    but on other documents: said, as the run is no longer trained on one corpus. (Checkpoints
    from before the corpus was recorded have no "corpus_sha256".)"""
    before, now = ckpt.get("corpus_sha256"), meta.get("content_sha256")
    if before is not None and before != now:
        print(
            f"resuming on corpus '{name}' as it is now: it was prepared again since the "
            f"checkpoint, from other documents or settings (content sha256 {str(before)[:12]} "
            f"-> {str(now)[:12]}) but with the same tokenizer; the run goes on with the new data",
            file=sys.stderr,
        )


def say_the_schedule_changed(ckpt: dict[str, Any], tc: TrainConfig) -> None:
    """The learning rate follows the settings given now from the resume step on: new schedule
    settings (above all a larger max_steps, to extend a run) move it there, up the cosine
    again where the run had decayed. Said, with the rate before and after, as nanoGPT's and
    torchtitan's schedules do the same without a word."""
    try:
        step = int(ckpt["step"])
        before = {k: ckpt["config"]["train"][k] for k in SCHEDULE_FIELDS}
        was = dataclasses.replace(tc, **before)
    except (KeyError, TypeError, ValueError, AttributeError):
        return  # a checkpoint that says too little to tell; restoring it says what is wrong
    changed = [
        f"{k} {before[k]} -> {getattr(tc, k)}" for k in before if before[k] != getattr(tc, k)
    ]
    if step >= tc.max_steps or not changed:
        return
    then, now = lr_at(step, was), lr_at(step, tc)
    if math.isclose(then, now, rel_tol=1e-6):
        return
    hint = ""
    # Extending a run that had decayed to min_lr, past any new warm-up: lr=min_lr holds it there
    # (not where this command sets train.lr itself)
    if step >= was.max_steps and step >= tc.warmup_steps and now > then and before["lr"] == tc.lr:
        hint = f"; to go on at min_lr instead, also give --train.lr={tc.min_lr:g}"
    print(
        f"resuming with train.{', train.'.join(changed)}: the learning-rate schedule is "
        f"recomputed over the new settings, so step {step + 1} trains at {now:.3g} where the "
        f"run's own schedule gives {then:.3g}{hint}",
        file=sys.stderr,
    )


def restore_state(
    ckpt: dict[str, Any],
    ckpt_path: Path,
    model: GPT,
    optimizer: torch.optim.AdamW,
    train_batches: TokenBatches,
    tc: TrainConfig,
) -> int:
    """The checkpoint's weights, optimizer state (with the settings given now on top) and data
    position; returns its step. A bad entry is an error naming it."""
    with restoring(ckpt_path, "model"):
        model.load_state_dict(ckpt["model"])
    # train.py never saves them (it stops at the first NaN): edited, or written by another program
    broken = first_non_finite(model)
    if broken is not None:
        raise CheckpointError(
            f"{ckpt_path} holds NaN or infinite weights, in {broken}: there is nothing to resume"
        )
    with restoring(ckpt_path, "optimizer"):
        load_optimizer_state(optimizer, ckpt["optimizer"], tc)
        # A checkpoint follows a step, which gave every parameter AdamW's moments: fewer
        # would restart them silently (load_state_dict accepts any subset).
        moments = {"step", "exp_avg", "exp_avg_sq"}
        have = sum(moments <= state.keys() for state in optimizer.state.values())
        params = len(list(model.parameters()))
        if have != params:
            raise ValueError(f"it holds AdamW's moments for {have} of {params} parameters")
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        if any(not t.isfinite().all() for t in state):
            raise ValueError("it holds NaN or infinite optimizer state: there is nothing to resume")
    with restoring(ckpt_path, "data"):
        train_batches.load_state_dict(ckpt["data"])
    return ckpt["step"]


def split_of(train: dict[str, Any], ranks: int) -> tuple[int, int, int]:
    """How one step's rows are split: (batch_size, micro-batches per process, processes), by a
    train config's fields (TrainConfig.micro_batches's rule, on a checkpoint's plain dict);
    their product is the rows a step trains on."""
    # Checkpoints before global_batch_size have none
    batch, global_batch = train["batch_size"], train.get("global_batch_size")
    micro = global_batch // (batch * ranks) if global_batch else train.get("grad_accum", 1)
    return batch, micro, ranks


BATCH_FIELDS = ("batch_size", "grad_accum", "global_batch_size")
# What evaluate() averages over: eval_batches steps' worth of micro-batches of these sizes
EVAL_FIELDS = (*BATCH_FIELDS, "eval_batches")


def say_the_batch_changed(
    ckpt: dict[str, Any], tc: TrainConfig, ranks_before: int | None, ranks: int, dropout: float
) -> None:
    """Another batch, number of micro-batches or number of processes, said with what it
    changes. The offsets of every micro-batch come from one stream, each step taking its rows
    over all ranks (data/loader.py): a step trains on the rows the run would have drawn while
    it takes as many, however they are split, and evaluate() reads the same windows while
    eval_batches steps' worth of rows stay as many. With dropout (the model's rate now) the
    masks are drawn per micro-batch from each process's generator, so another split or number
    of processes draws other masks. `ranks_before` None: a checkpoint that does not say (taken
    as `ranks`)."""
    try:
        before = {
            k: ckpt["config"]["train"][k] for k in EVAL_FIELDS if k in ckpt["config"]["train"]
        }
        ranks_before = ranks_before or ranks
        split_before = split_of(before, ranks_before)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return  # restoring it says what is wrong
    fields = [k for k, v in before.items() if v != getattr(tc, k)]
    changed = [f"train.{k} {before[k]} -> {getattr(tc, k)}" for k in fields]
    if ranks != ranks_before:
        processes = "1 process" if ranks == 1 else f"{ranks} processes"
        changed.append(f"{processes} where it trained on {ranks_before}")
    split = split_of(dataclasses.asdict(tc), ranks)
    rows, rows_before = math.prod(split), math.prod(split_before)
    evals_before = before.get("eval_batches", tc.eval_batches)
    windows_moved = rows * tc.eval_batches != rows_before * evals_before
    # By the split itself, not the fields: grad_accum 2 and a global batch of twice batch_size
    # on one process are the same micro-batches.
    split_changed = split != split_before
    if not (split_changed or windows_moved):
        return
    effects = []
    if rows != rows_before:
        effects.append(
            f"a step takes {rows} rows over all processes where it took {rows_before}, so the "
            "data differs from there on"
        )
    elif split_changed:
        effects.append("each step trains on the rows it would have drawn")
    if split_changed and dropout > 0:
        effects.append("dropout draws other masks")
    if windows_moved:
        effects.append(
            "val_loss and train_loss are evaluated on other windows from here on, so their "
            "curve can step at the resume"
        )
    if rows != rows_before or (split_changed and dropout > 0):
        effects.append("the run will not match one that never stopped")
    elif split_changed:  # the same rows, split otherwise, sum in another order
        effects.append("the run matches one that never stopped to rounding, not exactly")
    # A checkpoint older than a field that now sets the rows: said by its effect
    what = ", ".join(changed) or f"{rows} rows per step"
    print(f"resuming with {what}: {'; '.join(effects)}", file=sys.stderr)
