"""--resume: a run continues where it stopped, exactly, or says why it cannot."""

from __future__ import annotations

import dataclasses
import json
import math
import weakref
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import pytest
import torch

import train
from data.prepare import prepare
from tiny_runs import (
    SHARED_OVERRIDES,
    STEPS,
    TINY,
    copy_run,
    copy_run_trained_with,
    error_of,
    eval_lines,
    load_ckpt,
    meta,
    misbehave_at,
    run,
    stdlib_documents,
    train_lines,
)
from training import checkpoint, loop, optim, resume, start
from training.config import dump_toml, load_config

# tiny_runs.py's stand-in, for every test here.
pytestmark = pytest.mark.usefixtures("sample_on_the_cpu")


@pytest.mark.parametrize("dropout", ["0.0", "0.1"])  # with dropout, the torch RNG state matters
def test_resume_reproduces_the_uninterrupted_run_exactly(
    base_run: Path,
    data_root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    dropout: str,
) -> None:
    overrides = (*SHARED_OVERRIDES, f"--model.dropout={dropout}")
    whole = base_run
    if dropout != "0.0":
        whole = tmp_path / "whole"
        assert run(data_root, whole, *overrides) == 0
    split = tmp_path / "split"
    capsys.readouterr()
    assert run(data_root, split, *overrides, "--stop-after", "7") == 0
    assert load_ckpt(split)["step"] == 7
    err = capsys.readouterr().err
    assert f"paused after step 7 of {STEPS}" in err and f"--resume --out {split}" in err
    assert run(data_root, split, *overrides, "--resume", "--stop-after", "6") == 0
    assert f"resuming {split} after step 7 of {STEPS}\n" in capsys.readouterr().out
    assert load_ckpt(split)["step"] == 13
    assert run(data_root, split, *overrides, "--resume") == 0

    a_lines, b_lines = train_lines(whole), train_lines(split)
    assert [r["step"] for r in b_lines] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in b_lines] == [r["loss"] for r in a_lines]  # exactly, not approx
    assert [r["lr"] for r in b_lines] == [r["lr"] for r in a_lines]
    a, b = load_ckpt(whole), load_ckpt(split)
    assert b["step"] == a["step"] == STEPS
    assert a["model"].keys() == b["model"].keys()
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    split_evals = {r["step"]: r["val_loss"] for r in eval_lines(split)}
    for r in eval_lines(whole):
        assert split_evals[r["step"]] == r["val_loss"]


def test_resume_drops_a_metrics_line_cut_short(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A kill in the middle of a log write leaves half a line; resuming must still work. So
    must other damage: a line whose step is not a number, bytes that are not UTF-8. How many
    lines went is said (a note typed into the log would be among them)."""
    out = copy_run(base_run, tmp_path / "run")
    with open(out / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": "x", "loss": 1.0}\n{"step": 99, "loss": 1.0, "note": "\xff"}\n')
        f.write(b'{"step": true, "loss": 1.0}\n')  # JSON's true is no step, though bool is int
        f.write(b'{"step": 21, "loss": 5.7')
    capsys.readouterr()
    assert run(data_root, out, f"--train.max_steps={STEPS + 2}", "--resume") == 0
    assert [r["step"] for r in train_lines(out)] == list(range(1, STEPS + 3))
    assert not list(out.glob("*.tmp"))
    assert f"metrics.jsonl: 4 line(s) dropped, logged after step {STEPS}" in (
        capsys.readouterr().err
    )


def test_resume_without_its_log_says_that_a_new_one_starts(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run copied without metrics.jsonl (or one deleted) resumes, and says that its log
    now starts after the checkpoint: the earlier steps' lines are not coming back."""
    out = copy_run(base_run, tmp_path / "run")
    (out / "metrics.jsonl").unlink()
    capsys.readouterr()
    assert run(data_root, out, f"--train.max_steps={STEPS + 2}", "--resume") == 0
    assert [r["step"] for r in train_lines(out)] == [STEPS + 1, STEPS + 2]
    said = f"metrics.jsonl is missing: a new one starts, with the steps after {STEPS} only"
    assert said in capsys.readouterr().err


def test_resume_without_checkpoint_is_an_error(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(data_root, tmp_path / "fresh", "--resume") == 2
    assert str(tmp_path / "fresh" / checkpoint.CHECKPOINT) in capsys.readouterr().err
    # No run there, and no corpus either: the error is the run's, not "prepare a corpus".
    argv = ["--out", str(tmp_path / "typo"), "--resume", f"--data.root={tmp_path / 'none'}"]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert f"no checkpoint at {tmp_path / 'typo' / checkpoint.CHECKPOINT}" in err, err
    assert not (tmp_path / "typo").exists()
    # A run killed before its first checkpoint: not "train first", but start it over, and how.
    early = tmp_path / "early"
    early.mkdir()
    (early / "config.toml").write_text(dump_toml(load_config(TINY)))
    assert run(data_root, early, "--resume") == 2
    err = capsys.readouterr().err
    assert f"{early} holds a run but no ckpt.pt (it stopped before its first checkpoint" in err
    assert f"--config {early / 'config.toml'}" in err
    assert run(data_root, early, "--config", str(early / "config.toml"), "--train.max_steps=1") == 0


def test_resume_with_another_model_config_names_the_field(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = copy_run(base_run, tmp_path / "run")
    before = (out / checkpoint.CHECKPOINT).read_bytes(), (out / "config.toml").read_text()
    assert run(data_root, out, *SHARED_OVERRIDES, "--resume", "--model.n_layer=3") == 2
    err = error_of(capsys.readouterr().err)
    assert "n_layer" in err and "model config" in err
    assert (
        "only model.attention and model.dropout may change on resume; to train these "
        "settings, start another run (--out)" in err
    )
    assert "n_embd" not in err, "only the fields that differ are named"
    assert ((out / checkpoint.CHECKPOINT).read_bytes(), (out / "config.toml").read_text()) == before


def test_resume_with_another_seed_is_refused(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The random state comes back from the checkpoint: another seed would only move the
    evaluation windows (the val curve jumps), so it is refused, and nothing changes."""
    out = copy_run(base_run, tmp_path / "run")
    seed = load_config(out / "config.toml").train.seed
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert run(data_root, out, *SHARED_OVERRIDES, "--resume", f"--train.seed={seed + 1}") == 2
    err = error_of(capsys.readouterr().err)
    assert f"train.seed={seed + 1}: {out} was seeded with {seed}" in err
    assert f"resume with train.seed={seed}" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_resume_may_change_the_dropout_rate(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Dropout holds no weights: a run goes on with another rate, as nanoGPT allows, and says
    so; the run's config then records it."""
    out = copy_run(base_run, tmp_path / "run")
    before = load_ckpt(out)["config"]["model"]["dropout"]
    capsys.readouterr()
    args = (f"--train.max_steps={STEPS + 1}", "--model.dropout=0.2", "--resume")
    assert run(data_root, out, *args) == 0
    assert (
        f"resuming with model.dropout=0.2; the run trained with {before} so far"
        in capsys.readouterr().err
    )
    assert load_ckpt(out)["config"]["model"]["dropout"] == 0.2
    assert load_config(out / "config.toml").model.dropout == 0.2


def test_resume_may_change_the_attention_variant(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It holds no weights: a run trained with one variant (cuDNN's, say, on a GPU) goes on
    with another (sdpa on a CPU)."""
    out = copy_run(base_run, tmp_path / "run")
    capsys.readouterr()
    assert (
        run(data_root, out, f"--train.max_steps={STEPS + 1}", "--model.attention=sdpa", "--resume")
        == 0
    )
    assert (
        "resuming with attention sdpa; the run trained with naive so far" in capsys.readouterr().err
    )
    assert load_ckpt(out)["step"] == STEPS + 1
    assert load_ckpt(out)["config"]["model"]["attention"] == "sdpa"
    assert load_config(out / "config.toml").model.attention == "sdpa"
    # A GPU run's variant that cannot train here: the error says how the run goes on.
    gpu = copy_run_trained_with(base_run, tmp_path / "gpu", "model", "attention", "sdpa-cudnn")
    assert run(data_root, gpu, f"--train.max_steps={STEPS + 1}", "--resume") == 2
    err = capsys.readouterr().err
    assert "'sdpa-cudnn' cannot run on cpu" in err
    assert "; resume with another (attention holds no weights), e.g. --model.attention=sdpa " in err
    assert run(data_root, tmp_path / "new", "--model.attention=flex") == 2
    assert "; choose another, e.g. --model.attention=sdpa" in capsys.readouterr().err


def test_resume_on_a_corpus_prepared_again_with_the_same_tokenizer_says_so(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The token ids mean the same, so it resumes; but on other documents, which is said."""
    assert load_ckpt(base_run)["corpus_sha256"] == meta(data_root)["content_sha256"]
    out = copy_run(base_run, tmp_path / "run")
    ckpt = load_ckpt(out)
    ckpt["corpus_sha256"] = "a" * 64  # as if it trained on the corpus before a re-prepare
    torch.save(ckpt, out / checkpoint.CHECKPOINT)
    capsys.readouterr()
    assert run(data_root, out, f"--train.max_steps={STEPS + 1}", "--resume") == 0
    said = "resuming on corpus 'tiny' as it is now: it was prepared again since the checkpoint"
    assert said in capsys.readouterr().err
    assert load_ckpt(out)["corpus_sha256"] == meta(data_root)["content_sha256"]
    assert run(data_root, out, f"--train.max_steps={STEPS + 2}", "--resume") == 0
    assert "resuming on corpus" not in capsys.readouterr().err


def test_resume_with_other_optimizer_settings_uses_them(
    base_run: Path, data_root: Path, tmp_path: Path
) -> None:
    """load_state_dict restores the checkpoint's decay and betas; the config's must win, as
    config.toml records them. It restores the path AdamW took on the device that wrote the
    checkpoint too: the resume takes the one built for its own device."""
    out = copy_run(base_run, tmp_path / "run")
    ckpt = load_ckpt(out)
    for group in ckpt["optimizer"]["param_groups"]:  # as written where there is no fused AdamW
        assert (group["fused"], group["foreach"]) == (True, None)
        group["fused"], group["foreach"] = None, True
    torch.save(ckpt, out / checkpoint.CHECKPOINT)
    changed = ["--train.weight_decay=0.5", "--train.beta1=0.8", "--train.beta2=0.9"]
    assert run(data_root, out, f"--train.max_steps={STEPS + 2}", *changed, "--resume") == 0
    groups = load_ckpt(out)["optimizer"]["param_groups"]
    assert [(g["weight_decay"], tuple(g["betas"]), g["fused"], g["foreach"]) for g in groups] == [
        (0.5, (0.8, 0.9), True, None),
        (0.0, (0.8, 0.9), True, None),
    ]
    assert load_config(out / "config.toml").train.weight_decay == 0.5


def test_extending_a_finished_run_says_the_learning_rate_climbs_again(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A larger max_steps recomputes the cosine over the longer run, so a run that had decayed
    to min_lr trains at a higher rate again: said, with both rates and the flag that keeps
    min_lr; the logged rate is the one said."""
    out = copy_run(base_run, tmp_path / "run")
    capsys.readouterr()
    assert run(data_root, out, f"--train.max_steps={STEPS + 10}", "--resume") == 0
    err = capsys.readouterr().err
    tc = load_config(out / "config.toml").train
    now = optim.lr_at(STEPS, tc)
    assert now > 2 * tc.min_lr  # the case this is about: well up the cosine again
    assert (
        f"resuming with train.max_steps {STEPS} -> {STEPS + 10}: the learning-rate schedule is "
        f"recomputed over the new settings, so step {STEPS + 1} trains at {now:.3g} where the "
        f"run's own schedule gives {tc.min_lr:.3g}; to go on at min_lr instead, also give "
        f"--train.lr={tc.min_lr:g}" in err
    ), err
    logged = train_lines(out)
    assert next(m["lr"] for m in logged if m["step"] == STEPS + 1) == pytest.approx(now)
    # The hint's flag: the rate stays at min_lr; a resume that keeps the schedule says nothing.
    again = copy_run(base_run, tmp_path / "again")
    argv = [f"--train.max_steps={STEPS + 2}", f"--train.lr={tc.min_lr:g}", "--resume"]
    assert run(data_root, again, *argv) == 0
    logged = train_lines(again)
    assert next(m["lr"] for m in logged if m["step"] == STEPS + 1) == pytest.approx(tc.min_lr)
    assert "learning-rate schedule" not in capsys.readouterr().err
    # A checkpoint lacking a schedule field says nothing rather than guess at it; a warm-up
    # raised past the resume step gets no min_lr hint (lr=min_lr would ramp up below it).
    fields = {k: getattr(tc, k) for k in optim.SCHEDULE_FIELDS} | {"max_steps": STEPS}
    for missing in optim.SCHEDULE_FIELDS:
        lacking = {k: v for k, v in fields.items() if k != missing}
        resume.say_the_schedule_changed({"step": STEPS, "config": {"train": lacking}}, tc)
        assert capsys.readouterr().err == "", missing
    warm = dataclasses.replace(tc, warmup_steps=STEPS + 5)
    resume.say_the_schedule_changed({"step": STEPS, "config": {"train": fields}}, warm)
    err = capsys.readouterr().err
    assert "learning-rate schedule is recomputed" in err and "min_lr instead" not in err
    # Nor one that sets train.lr itself: the hint would contradict the command just given.
    higher = dataclasses.replace(tc, max_steps=STEPS + 10, lr=2 * tc.lr)
    resume.say_the_schedule_changed({"step": STEPS, "config": {"train": fields}}, higher)
    err = capsys.readouterr().err
    assert f"train.lr {tc.lr} -> {2 * tc.lr}" in err and "min_lr instead" not in err
    split = tmp_path / "split"
    assert run(data_root, split, *SHARED_OVERRIDES, "--stop-after", "5") == 0
    assert run(data_root, split, "--resume", "--stop-after", "5") == 0
    assert "learning-rate schedule" not in capsys.readouterr().err


def test_a_resume_that_fails_before_saving_leaves_config_toml_as_it_was(
    base_run: Path, data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """config.toml is what a plain --resume goes on with: a resume's overrides replace it with
    the first checkpoint made under them, not before (a NaN from a bad override would have
    left the run resuming into it)."""
    out = copy_run(base_run, tmp_path / "run")
    before = (out / "config.toml").read_bytes()
    misbehave_at(monkeypatch, 2, loss=math.nan)
    argv = [f"--train.max_steps={STEPS + 4}", "--train.lr=0.5", "--resume"]
    assert run(data_root, out, *argv) == 2
    assert (out / "config.toml").read_bytes() == before
    assert load_ckpt(out)["step"] == STEPS
    monkeypatch.undo()
    # A save that fails (a full disk) leaves both as they were too.
    monkeypatch.setattr(loop, "save_checkpoint", Mock(side_effect=OSError(28, "No space")))
    config = load_config(out / "config.toml", argv[:2])
    with pytest.raises(OSError, match="No space"):
        train.train(config, out, resume=True)
    assert (out / "config.toml").read_bytes() == before
    monkeypatch.undo()
    assert run(data_root, out, *argv) == 0
    assert load_config(out / "config.toml").train.lr == 0.5
    assert load_ckpt(out)["config"]["train"]["lr"] == 0.5


def test_resume_after_a_stop_between_the_checkpoint_and_config_toml(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A resume's new settings reach config.toml just after the first checkpoint made under
    them: a run killed between the two writes leaves the old config.toml beside the new
    checkpoint. The next resume goes on with the checkpoint's settings, and says so."""
    out = copy_run(base_run, tmp_path / "run")
    before = (out / "config.toml").read_bytes()
    argv = [f"--train.max_steps={STEPS + 4}", "--resume", "--stop-after", "1"]
    assert run(data_root, out, *argv) == 0
    assert load_ckpt(out)["config"]["train"]["max_steps"] == STEPS + 4
    (out / "config.toml").write_bytes(before)  # killed between the two writes
    capsys.readouterr()
    assert run(data_root, out, "--resume") == 0
    err = capsys.readouterr().err
    assert "config.toml differs from the config" in err
    assert f"train.max_steps = {STEPS} there, {STEPS + 4} in the checkpoint" in err
    # run() gives --config too: how it differs names what the run resumes with, the checkpoint's
    assert f"resuming with the config {out / checkpoint.CHECKPOINT} records; " in err
    assert "the run's own config" not in err
    assert load_ckpt(out)["step"] == STEPS + 4, "the extension goes on"
    assert load_config(out / "config.toml").train.max_steps == STEPS + 4


def test_resume_with_another_tokenizer_is_an_error(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert meta(data_root, "other")["tokenizer_sha256"] != meta(data_root)["tokenizer_sha256"]
    out = copy_run(base_run, tmp_path / "run")
    assert run(data_root, out, *SHARED_OVERRIDES, "--resume", "--data.name=other") == 2
    err = error_of(capsys.readouterr().err)
    assert "tokenizer" in err


def test_resume_on_its_corpus_prepared_again_says_how_to_make_the_runs(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's corpus prepared again under its name, with a larger vocabulary: the advice is
    the command that makes the run's corpus again, not to grow model.vocab_size (the advice
    for a new run), which the checkpoint's weights refuse."""
    root = tmp_path / "root"
    prepare("tiny", files=stdlib_documents(tmp_path / "docs"), vocab_size=640, out_root=root)
    out = copy_run_trained_with(base_run, tmp_path / "run", "data", "root", str(root))
    assert run(root, out, *SHARED_OVERRIDES, "--resume") == 2
    err = error_of(capsys.readouterr().err)
    assert f"{root / 'tiny'} was prepared again since the run trained on it" in err, err
    assert "--vocab-size 512" in err and "model.vocab_size" not in err, err
    # Given another data.root than the run's: its own corpus is named first
    other = copy_run(base_run, tmp_path / "other")
    assert run(root, other, *SHARED_OVERRIDES, "--resume") == 2
    err = error_of(capsys.readouterr().err)
    assert f"it trained on the corpus in {data_root / 'tiny'} (--data.root={data_root})" in err
    assert f"or make the run's in {root / 'tiny'}: python data/prepare.py" in err, err


def test_resume_of_a_finished_run_changes_nothing(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = copy_run(base_run, tmp_path / "done")
    before = {name: (out / name).read_bytes() for name in ("ckpt.pt", "metrics.jsonl")}
    assert run(data_root, out, *SHARED_OVERRIDES, "--resume") == 0
    assert "is complete" in capsys.readouterr().out
    assert {name: (out / name).read_bytes() for name in before} == before


def test_a_finished_run_resumed_with_new_settings_says_only_that_it_is_complete(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing trains, so nothing changes: no "resuming with attention sdpa" before it. Lines a
    killed continuation logged past the checkpoint go: no checkpoint has their steps."""
    out = copy_run(base_run, tmp_path / "done")
    kept = (out / "metrics.jsonl").read_text()
    past = json.dumps({"step": STEPS + 1, "loss": 1.0}) + "\n"
    (out / "metrics.jsonl").write_text(kept + past)
    changes = ["--model.attention=sdpa", "--train.batch_size=2", "--train.lr=0.01"]
    assert run(data_root, out, *SHARED_OVERRIDES, *changes, "--resume") == 0
    printed = capsys.readouterr()
    assert printed.out.strip() == f"{out} is complete (step {STEPS} of train.max_steps={STEPS})"
    assert "resuming" not in printed.err and "sdpa" not in printed.err, printed.err
    assert f"1 line(s) dropped, logged after step {STEPS} (no checkpoint kept them)" in printed.err
    assert (out / "metrics.jsonl").read_text() == kept
    # A lower train.max_steps than the checkpoint's step: said so
    assert run(data_root, out, *SHARED_OVERRIDES, "--train.max_steps=5", "--resume") == 0
    assert capsys.readouterr().out.strip() == (
        f"{out} is complete: its checkpoint is at step {STEPS}, past train.max_steps=5"
    )


def test_a_sample_is_printed_once_when_the_run_reaches_its_end(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not after a --stop-after split, not when a finished run is resumed: only on the step
    that ends the run, so a split-and-resumed run prints one sample, as an unbroken one does."""
    out = tmp_path / "run"
    argv = ["--train.max_steps=3", "--train.eval_interval=0", "--train.sample_tokens=3"]
    argv.append("--train.sample_prompt=class Q")
    for extra, sampled in (
        (["--stop-after", "2"], False),
        (["--resume"], True),
        (["--resume"], False),
    ):
        assert run(data_root, out, *argv, *extra) == 0
        printed = capsys.readouterr().out
        assert ("--- sample from" in printed) == sampled, extra
        if sampled:  # from train.sample_prompt
            heading, text = printed.split("--- sample from")[1].split("\n", 1)
            assert heading.endswith("(prompt 'class Q') ---") and text.startswith("class Q"), text
    assert load_ckpt(out)["step"] == 3


def test_resume_without_config_continues_with_the_runs_own_config(
    base_run: Path, tmp_path: Path
) -> None:
    out = copy_run(base_run, tmp_path / "more")
    assert train.main(["--out", str(out), "--resume", f"--train.max_steps={STEPS + 2}"]) == 0
    assert load_ckpt(out)["step"] == STEPS + 2
    assert load_config(out / "config.toml").model == load_config(base_run / "config.toml").model


def test_resume_with_a_damaged_or_missing_config_toml(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config.toml cut before [train] would resume on the defaults (lr, batch, intervals)
    without a word: an error naming the fields. Without config.toml, the checkpoint's record."""
    out = tmp_path / "run"
    started = ("--train.max_steps=8", "--train.lr=0.01", "--train.batch_size=2")
    assert run(data_root, out, *started, "--stop-after", "2") == 0
    text = (out / "config.toml").read_text()
    (out / "config.toml").write_text(text[: text.index("[train]")])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert train.main(["--out", str(out), "--resume"]) == 2
    err = error_of(capsys.readouterr().err)
    assert "config.toml lacks train.device" in err and "train.lr" in err and "delete it" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before, "nothing written"
    # One that does not parse: the same way on
    (out / "config.toml").write_text(text.replace("[train]", "[train"))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert train.main(["--out", str(out), "--resume"]) == 2
    err = error_of(capsys.readouterr().err)
    assert f"config file {out / 'config.toml'}: " in err and "damaged or was edited" in err, err
    assert f"delete it to resume with the config {out / 'ckpt.pt'} records" in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before, "nothing written"

    (out / "config.toml").unlink()
    assert train.main(["--out", str(out), "--resume", "--stop-after", "1"]) == 0
    assert "config.toml is missing; resuming with the config" in capsys.readouterr().err
    resumed = load_config(out / "config.toml").train
    assert (resumed.lr, resumed.batch_size, resumed.max_steps) == (0.01, 2, 8)
    assert load_ckpt(out)["step"] == 3


def test_resume_of_a_run_older_than_a_config_field(base_run: Path, tmp_path: Path) -> None:
    """A field added to the config after a run was made is in neither its config.toml nor its
    checkpoint: not damage; the field's default holds."""
    out = copy_run(base_run, tmp_path / "old")
    ckpt = load_ckpt(out)
    del ckpt["config"]["train"]["peak_tflops"]
    torch.save(ckpt, out / checkpoint.CHECKPOINT)
    text = (out / "config.toml").read_text()
    (out / "config.toml").write_text(
        "".join(line for line in text.splitlines(True) if not line.startswith("peak_tflops"))
    )
    assert train.main(["--out", str(out), "--resume", f"--train.max_steps={STEPS + 1}"]) == 0
    assert load_config(out / "config.toml").train.peak_tflops == 0.0


def test_resume_with_config_keeps_the_runs_own_settings_and_names_those_that_differ(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make train ARGS=--resume` gives configs/default.toml again: the settings the run was
    started with must not fall back to that file's, and a setting given now still applies."""
    out = tmp_path / "run"
    started = ("--train.max_steps=8", "--train.lr=0.01")  # tiny.toml: 20 and 0.003
    assert run(data_root, out, *started, "--stop-after", "2") == 0
    capsys.readouterr()
    assert run(data_root, out, "--resume", "--stop-after", "1") == 0
    err = capsys.readouterr().err
    assert "train.max_steps = 8 (there 20)" in err and "train.lr = 0.01 (there 0.003)" in err
    assert "model." not in err, "only the fields that differ are named"
    kept = load_config(out / "config.toml").train
    assert (kept.max_steps, kept.lr, load_ckpt(out)["step"]) == (8, 0.01, 3)
    assert train_lines(out)[-1]["lr"] == pytest.approx(optim.lr_at(2, kept))

    assert run(data_root, out, "--resume", "--train.max_steps=9") == 0
    assert load_ckpt(out)["step"] == 9
    assert load_config(out / "config.toml").train.lr == 0.01

    # --config is only compared: an error in it is said, and the run resumes all the same.
    broken = tmp_path / "broken.toml"
    broken.write_text("[train]\nmax_step = 5\n")
    capsys.readouterr()
    argv = ["--config", str(broken), f"--data.root={data_root}", "--out", str(out)]
    assert train.main([*argv, "--resume", "--train.max_steps=10"]) == 0
    err = capsys.readouterr().err
    assert f"not compared with --config ({broken}: unknown key train.max_step;" in err
    assert load_ckpt(out)["step"] == 10


def test_resume_does_not_keep_the_loaded_checkpoint_in_memory(
    base_run: Path, data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its weights are copied into the model: holding it too costs a model's size of host RAM."""
    out = copy_run(base_run, tmp_path / "run")
    real_open_run = start.open_run
    loaded: list[weakref.ref] = []

    def open_run(*args: Any) -> tuple[Path, dict[str, Any] | None]:
        path, ckpt = real_open_run(*args)
        loaded.extend(weakref.ref(t) for t in ckpt["model"].values())
        return path, ckpt

    monkeypatch.setattr(start, "open_run", open_run)
    held = []
    misbehave_at(monkeypatch, 1, before=lambda: held.extend(r for r in loaded if r() is not None))
    assert run(data_root, out, f"--train.max_steps={STEPS + 1}", "--resume") == 0
    assert loaded and not held


def test_resume_reads_a_checkpoint_with_the_older_single_rng_state(
    base_run: Path, tmp_path: Path
) -> None:
    out = copy_run(base_run, tmp_path / "old")
    ckpt = load_ckpt(out)
    ckpt["rng"] = ckpt["rng"][0]  # the format before per-rank states: one dict
    torch.save(ckpt, out / checkpoint.CHECKPOINT)
    assert train.main(["--out", str(out), "--resume", f"--train.max_steps={STEPS + 1}"]) == 0
    assert load_ckpt(out)["step"] == STEPS + 1


class Crash(Exception):
    pass


def test_resume_after_a_crash_logs_each_step_once(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash() -> None:
        raise Crash("stands in for a kill -9 or an OOM between checkpoints")

    out = tmp_path / "run"
    overrides = ["--train.max_steps=8", "--train.eval_interval=5"]
    misbehave_at(monkeypatch, 7, before=crash)
    with pytest.raises(Crash):
        run(data_root, out, *overrides)
    monkeypatch.undo()
    assert load_ckpt(out)["step"] == 5
    assert run(data_root, out, *overrides, "--resume") == 0
    assert [r["step"] for r in train_lines(out)] == list(range(1, 9))


def test_resume_says_it_replaced_a_run_tokenizer_that_was_not_the_checkpoints(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = copy_run(base_run, tmp_path / "run")
    (out / "tokenizer.json").write_text("{}")
    assert run(data_root, out, f"--train.max_steps={STEPS + 1}", "--resume") == 0
    assert f"note: {out / 'tokenizer.json'} was not the tokenizer" in capsys.readouterr().err
    assert (out / "tokenizer.json").read_bytes() == (
        data_root / "tiny" / "tokenizer.json"
    ).read_bytes()
    assert run(data_root, out, f"--train.max_steps={STEPS + 2}", "--resume") == 0
    assert "was not the tokenizer" not in capsys.readouterr().err  # said once, when it was
