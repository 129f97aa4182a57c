"""Bad input to train.py (corpus, config, variant, memory): an error naming what is wrong, before a
step."""

from __future__ import annotations

import itertools
import json
import shlex
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

import train
from data import meta as data_meta
from data.meta import DataError
from data.prepare import prepare
from data.tokens import split_documents
from tiny_runs import (
    CUDA_ONLY,
    HEAD_SIZE,
    ROOT,
    STEPS,
    TINY,
    copy_run,
    error_of,
    load_ckpt,
    meta,
    misbehave_at,
    run,
    run_argv,
)
from training import checkpoint, start
from training.config import load_config
from training.probe import unavailable_reason

# tiny_runs.py's stand-in, for every test here.
pytestmark = pytest.mark.usefixtures("sample_on_the_cpu")


def test_onednn_linears_where_they_cannot_run_are_a_config_error(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """train.cpu_linear='onednn' insists: with bf16 autocast, which it cannot run, the run
    stops before writing, naming the field and the fix."""
    out = tmp_path / "run"
    assert run(data_root, out, "--train.cpu_linear=onednn", "--train.dtype=bfloat16") == 2
    err = error_of(capsys.readouterr().err)
    assert err.startswith("train.cpu_linear='onednn' runs fp32 only; set train.dtype=float32")
    assert not out.exists()


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        ("val.bin one byte short", "val.bin is damaged"),
        ("val.bin empty", "val.bin is damaged"),
        ("train.bin deleted", "train.bin is missing"),
        ("meta.json cut short", "meta.json is damaged (JSONDecodeError"),
        ("meta.json without splits", "meta.json is damaged (KeyError"),
        ("meta.json saying uint32", "meta.json says its token files hold 'uint32'; this"),
        ("tokenizer.json deleted", "has no tokenizer.json"),
        ("tokenizer.json cut short", "tokenizer.json is not the tokenizer meta.json records"),
        ("train.bin holding an id beyond the tokenizer", "is id 60000, beyond its tokenizer's"),
    ],
)
def test_a_damaged_corpus_is_an_error_naming_the_file(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str, named: str
) -> None:
    root = Path(shutil.copytree(data_root, tmp_path / "root"))
    corpus = root / "tiny"
    meta = corpus / "meta.json"
    match damage:
        case "val.bin one byte short":
            (corpus / "val.bin").write_bytes((corpus / "val.bin").read_bytes()[:-1])
        case "val.bin empty":
            (corpus / "val.bin").write_bytes(b"")
        case "train.bin deleted":
            (corpus / "train.bin").unlink()
        case "tokenizer.json deleted":
            (corpus / "tokenizer.json").unlink()
        case "tokenizer.json cut short":
            (corpus / "tokenizer.json").write_text('{"trunc')
        case "train.bin holding an id beyond the tokenizer":
            ids = np.fromfile(corpus / "train.bin", dtype=np.uint16)
            ids[::20] = 60000  # in every window: the right size, but damaged
            ids.tofile(corpus / "train.bin")
        case "meta.json cut short":
            meta.write_text(meta.read_text()[:40])
        case "meta.json saying uint32":
            meta.write_text(json.dumps(json.loads(meta.read_text()) | {"dtype": "uint32"}))
        case "meta.json without splits":
            meta.write_text(
                json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "splits"})
            )
    overrides = [f"--data.root={root}", "--train.max_steps=1"]
    assert train.main(["--config", str(TINY), "--out", str(tmp_path / "run"), *overrides]) == 2
    err = error_of(capsys.readouterr().err)
    assert named in err
    if damage == "meta.json cut short":  # nothing says how it was made: an example
        assert f"e.g. python data/prepare.py --name tiny --stdlib --out-root {root}" in err
    else:  # the command that made it, not a stdlib one that would make another corpus
        patterns = json.loads((data_root / "tiny" / "meta.json").read_text())["source"]["patterns"]
        assert (
            f"prepare the corpus again from its source: python data/prepare.py --name tiny "
            f"--files {' '.join(map(shlex.quote, patterns))} --vocab-size 512 --val-fraction 0.1 --seed 0 "
            f"--out-root {root}"
        ) in err
    # Found where a batch reads it (the file is not read whole before): no checkpoint saved.
    after_start = damage.startswith("train.bin holding")
    assert not (tmp_path / "run" / ("ckpt.pt" if after_start else "")).exists()


def test_a_resume_never_copies_a_damaged_tokenizer_over_the_runs_own(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = Path(shutil.copytree(data_root, tmp_path / "root"))
    (root / "tiny" / "tokenizer.json").write_text('{"trunc')
    out = copy_run(base_run, tmp_path / "run")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    argv = [f"--data.root={root}", f"--train.max_steps={STEPS + 2}", "--resume"]
    assert run(data_root, out, *argv) == 2
    assert "tokenizer.json is not the tokenizer meta.json records" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_missing_corpus_hints_at_prepare(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(data_root, tmp_path / "run", "--data.name=never-prepared") == 2
    err = error_of(capsys.readouterr().err)
    assert "never-prepared" in err and "data/prepare.py" in err
    # The hint prepares a corpus this model can read, where this run looks for it.
    assert "--vocab-size 512" in err and f"--out-root {data_root}" in err
    assert not (tmp_path / "run").exists()
    assert "to resume" not in err
    # data.root naming a file: said, not a prepare into --out-root FILE, which prepare refuses
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    assert run(data_root, tmp_path / "run", f"--data.root={a_file}") == 2
    err = error_of(capsys.readouterr().err)
    assert f"data.root '{a_file}' is a file; give the folder of corpora" in err
    # A loop of links: no corpus there, not a traceback from resolving it
    loop = tmp_path / "loop"
    loop.symlink_to(loop.name)
    assert run(data_root, tmp_path / "run", f"--data.root={loop}") == 2
    assert f"no prepared corpus at {loop}/tiny/" in error_of(capsys.readouterr().err)


def test_run_from_another_folder_the_hints_say_where_they_looked_and_what_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Relative paths are the working directory's: from outside the project, the errors say
    so, and the command they suggest runs from there."""
    monkeypatch.chdir(tmp_path)
    assert train.main(["--config", "configs/tiny.toml"]) == 2
    err = error_of(capsys.readouterr().err)
    assert f"relative to {tmp_path}; the project's is {ROOT / 'configs' / 'tiny.toml'}" in err
    assert train.main(["--config", str(TINY), "--train.max_steps=1"]) == 2
    err = error_of(capsys.readouterr().err)
    assert f"no prepared corpus at data/tiny/, relative to {tmp_path} (missing" in err
    assert f"e.g. python {ROOT / 'data' / 'prepare.py'} --name tiny --stdlib" in err
    assert list(tmp_path.iterdir()) == []


def test_resume_without_its_corpus_says_how_the_runs_was_made(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not the missing-corpus hint, a stdlib command, which makes a corpus but not
    necessarily the run's (another source, another vocabulary): the checkpoint's record."""
    out = copy_run(base_run, tmp_path / "moved")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    elsewhere = tmp_path / "elsewhere"
    gone = f"--data.root={elsewhere}"
    assert train.main(["--out", str(out), "--resume", gone]) == 2
    err = error_of(capsys.readouterr().err)
    made = meta(data_root)
    command = data_meta.rebuild_command(elsewhere / "tiny", made["source"], made["settings"])
    assert err.startswith(f"no prepared corpus at {elsewhere / 'tiny'}/; to resume {out}, ")
    assert "give --data.root=FOLDER where that corpus is now, or prepare it again as the " in err
    assert f"run's was made: {command} (its tokenizer must come out as " in err
    assert "e.g." not in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # A checkpoint from before the corpus was recorded: said in words.
    ckpt = load_ckpt(out)
    del ckpt["corpus"]
    torch.save(ckpt, out / checkpoint.CHECKPOINT)
    assert train.main(["--out", str(out), "--resume", gone]) == 2
    assert "or prepare it again from the source and with the settings the run trained on (" in (
        error_of(capsys.readouterr().err)
    )
    # Another corpus named on resume: the run's own is named, not a command to make this one
    assert train.main(["--out", str(out), "--resume", "--data.name=absent"]) == 2
    err = error_of(capsys.readouterr().err)
    assert f"{out} trained on corpus 'tiny' (data.name): resume it on that one" in err
    assert "prepare it" not in err and "data/prepare.py" not in err
    assert train.main(["--out", str(out), "--resume", "--data.name=other"]) == 2
    assert "; it trained on corpus 'tiny' (--data.name=tiny)" in error_of(capsys.readouterr().err)
    # No run there: nothing said about one.
    assert train.main(["--out", str(tmp_path / "none"), "--resume", gone]) == 2
    assert "to resume" not in error_of(capsys.readouterr().err)


@pytest.fixture(scope="module")
def short_val_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A corpus whose val split is one short document (< block_size + 1 tokens)."""
    tmp = tmp_path_factory.mktemp("short")
    docs = tmp / "docs"
    docs.mkdir()
    long_doc = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(200))
    # The split follows the text: take the first short document that prepare's defaults
    # (val_fraction 0.1, seed 0) put in val.
    shorts = (f"x = {i}\n" for i in itertools.count())
    short = next(t for t in shorts if split_documents([t, long_doc], 0.1, seed=0).val == [0])
    (docs / "a.py").write_text(short)
    (docs / "b.py").write_text(long_doc)
    prepare("short", files=[str(docs / "*.py")], vocab_size=300, out_root=tmp / "root")
    return tmp / "root"


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory"
        ),
        MemoryError(),  # NumPy, or the batch loader's Python lists
    ],
)
def test_out_of_memory_is_an_error_that_says_what_to_lower(
    data_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: Exception,
) -> None:
    def out_of_memory() -> None:
        raise error

    misbehave_at(monkeypatch, 1, before=out_of_memory)
    assert run(data_root, tmp_path / "run") == 2
    err = error_of(capsys.readouterr().err)
    assert "out of memory" in err and "train.batch_size" in err and "model.block_size" in err


def test_another_runtime_error_is_not_called_out_of_memory(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def breaks() -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    misbehave_at(monkeypatch, 1, before=breaks)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        run(data_root, tmp_path / "run")


def test_corpus_shorter_than_a_block_is_an_error(
    short_val_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert meta(short_val_root, "short")["splits"]["val"]["tokens"] < 33
    assert run(short_val_root, tmp_path / "run", "--data.name=short") == 2
    err = error_of(capsys.readouterr().err)
    assert "val.bin" in err and "block_size" in err


def test_a_batch_larger_than_the_corpus_is_an_error(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    """A typo'd batch_size (10^8) would gather its rows in host memory until it runs out.
    Told before a model is built: a typo'd block_size makes that model huge."""

    def build_model(*args, **kwargs):
        raise AssertionError("the model was built before the data was checked")

    monkeypatch.setattr(start, "build_model", build_model)
    assert run(data_root, tmp_path / "run", "--train.batch_size=100000000") == 2
    err = error_of(capsys.readouterr().err)
    assert "train.batch_size=100000000" in err and "lower train.batch_size" in err
    # The same through the micro-batches a global batch makes: the step-0 evaluation of
    # eval_batches x that many would have run for hours
    assert run(data_root, tmp_path / "run2", "--train.global_batch_size=40000000") == 2
    err = error_of(capsys.readouterr().err)
    assert "x 10000000 micro-batches" in err and "lower train.global_batch_size" in err
    assert not (tmp_path / "run2" / "metrics.jsonl").exists()
    # A resume keeps the batch its run chose (made before this check, or on fewer ranks); one
    # that changes it is checked as a new run is
    config = load_config(TINY, ["--train.global_batch_size=40000000"])
    corpus = {"splits": {"train": {"tokens": 1000}}}
    grad_accum = config.train.micro_batches(1)
    ran = {"config": {"train": asdict(config.train)}}
    start.check_step_tokens(config, corpus, grad_accum, ran)
    ran["config"]["train"]["global_batch_size"] = 8
    with pytest.raises(DataError, match="tokens a step in each process"):
        start.check_step_tokens(config, corpus, grad_accum, ran)


def test_data_vocab_larger_than_the_model_is_an_error(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(data_root, tmp_path / "run", "--model.vocab_size=300") == 2
    err = error_of(capsys.readouterr().err)
    assert "vocab_size" in err and "512" in err


def test_cuda_only_variants_include_efficient_and_flex() -> None:
    assert {"sdpa-efficient", "flex"} <= set(CUDA_ONLY)


@pytest.mark.parametrize("variant", CUDA_ONLY)
def test_variant_that_cannot_run_on_cpu_is_refused(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], variant: str
) -> None:
    assert (
        run(data_root, tmp_path / "run", f"--model.attention={variant}", "--train.device=cpu") == 2
    )
    err = error_of(capsys.readouterr().err)
    reason = unavailable_reason(variant, "cpu", torch.float32, HEAD_SIZE)
    assert reason
    assert f"'{variant}'" in err and "cpu" in err and reason in err
    assert not (tmp_path / "run").exists(), "no silent fallback, and nothing written"


# Each of these once crashed mid-run with a traceback (a modulo or division by zero, an empty
# np.stack, torch.device's RuntimeError) or, for grad_accum=0, "trained" with loss 0 and no update.
@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("--train.log_interval=0", "train.log_interval"),
        ("--train.eval_batches=0", "train.eval_batches"),
        ("--train.batch_size=0", "train.batch_size"),
        ("--train.grad_accum=0", "train.grad_accum"),
        ("--train.device=bogus", "train.device"),
        ("--train.dtype=float16", "train.dtype"),
    ],
)
def test_bad_train_values_are_config_errors(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str, key: str
) -> None:
    out = tmp_path / "run"
    argv = run_argv(data_root, out, "--train.max_steps=2", "--train.eval_interval=0", override)
    assert train.main(argv) == 2
    assert key in error_of(capsys.readouterr().err)
    assert not out.exists(), "a config error must fail before writing anything"


def test_tf32_off_cuda_is_a_config_error(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """TF32 is a CUDA tensor-core mode: asked for on a CPU it is refused, not run as fp32."""
    out = tmp_path / "run"
    assert run(data_root, out, "--train.device=cpu", "--train.dtype=tf32") == 2
    error = error_of(capsys.readouterr().err)
    assert "train.dtype='tf32'" in error and "cpu" in error
    assert not out.exists(), "a config error must fail before writing anything"


@pytest.mark.parametrize("name", ["../data/tiny", "", "-x", "tiny/"])
def test_a_corpus_name_that_is_not_a_plain_folder_name_is_refused(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """A path, or nothing, would read a corpus outside data.root (or the root itself), and
    the hints would suggest prepare commands that fail; nothing is written."""
    assert run(data_root, tmp_path / "run", f"--data.name={name}") == 2
    err = error_of(capsys.readouterr().err)
    assert f"data.name={name!r}: a corpus name must be a plain folder name" in err
    assert not (tmp_path / "run").exists()
    # Set in a config file: the error names the file, as for every other field
    toml = tmp_path / "mine.toml"
    toml.write_text(TINY.read_text().replace('name = "tiny"', f"name = {name!r}"))
    assert train.main(["--config", str(toml), "--out", str(tmp_path / "run")]) == 2
    assert f"{toml}: data.name={name!r}: a corpus name must be" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_model_vocabulary_smaller_than_the_corpus_says_what_to_give(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = meta(data_root)["vocab_size"]
    assert run(data_root, tmp_path / "run", "--model.vocab_size=256") == 2
    err = error_of(capsys.readouterr().err)
    assert f"model.vocab_size=256 is smaller than the tokenizer of corpus 'tiny' ({tokens}" in err
    assert f"give --model.vocab_size={tokens} or more" in err
    # 256 is below a byte-level tokenizer's least: no prepare command that would be refused
    assert "--vocab-size 256" not in err and "has at least 257" in err
    assert not (tmp_path / "run").exists()
    assert run(data_root, tmp_path / "run", "--model.vocab_size=300") == 2
    assert "or prepare the corpus with --vocab-size 300" in capsys.readouterr().err


@pytest.mark.parametrize("n", ["0", "-2"])
def test_stop_after_must_be_positive(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], n: str
) -> None:
    assert run(data_root, tmp_path / "run", "--stop-after", n) == 2
    assert "--stop-after" in error_of(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()
