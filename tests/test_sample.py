"""sample.py: text from a trained run, its flags, and its errors."""

from __future__ import annotations

import io
import math
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

import sample
from data.meta import EOT, EOT_ID
from model import GPT
from streams import FullDisk
from tiny_models import tiny_config
from tiny_runs import ROOT, TINY, copy_run, copy_run_trained_with, error_of, run
from training import checkpoint, rundir, runtime
from training.config import load_config

# tiny_runs.py's stand-in, for every test here.
pytestmark = pytest.mark.usefixtures("sample_on_the_cpu")


def sample_text(capsys: pytest.CaptureFixture[str], run_dir: Path, *args: str) -> str:
    capsys.readouterr()
    assert sample.main(["--run", str(run_dir), "--prompt", "def ", "--tokens", "20", *args]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n")
    return out[:-1]


def test_a_prompt_longer_than_the_context_is_said_to_be_cut(
    base_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The model sees block_size tokens: a longer prompt conditions the text on its last
    block_size only, which a note says; it is still shown whole."""
    long = "def f(x):\n    return x + 1\n" * 20
    assert sample.main(["--run", str(base_run), "--prompt", long, "--tokens", "5"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(long)
    assert "and the model sees its last 32 (model.block_size)" in err, err
    assert sample.main(["--run", str(base_run), "--prompt", "def ", "--tokens", "5"]) == 0
    assert "model.block_size" not in capsys.readouterr().err


def test_sample_starts_with_the_prompt_and_is_seeded(
    base_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = sample_text(capsys, base_run, "--seed", "0")
    assert text.startswith("def ") and len(text) > len("def ")
    assert sample_text(capsys, base_run, "--seed", "0") == text
    assert sample_text(capsys, base_run, "--seed", "1") != text


def test_sample_generates_as_many_tokens_as_asked(
    base_run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[int] = []
    real = GPT.generate

    def counted(self: GPT, idx: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = real(self, idx, *args, **kwargs)
        made.append(out.size(1) - idx.size(1))
        return out

    monkeypatch.setattr(GPT, "generate", counted)
    sample_text(capsys, base_run, "--seed", "0")  # --tokens 20
    assert made == [20]


def test_sample_passes_its_sampling_flags_to_generate(
    base_run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--temperature (default 0.8), --top-k (default 50, 0 for none) and --top-p (default 1)
    reach the sampler."""
    asked: list[tuple[float, int | None, float | None]] = []
    real = GPT.generate

    def spied(self: GPT, idx: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        asked.append((kwargs["temperature"], kwargs["top_k"], kwargs["top_p"]))
        return real(self, idx, *args, **kwargs)

    monkeypatch.setattr(GPT, "generate", spied)
    sample_text(capsys, base_run)
    sample_text(capsys, base_run, "--temperature", "0.7", "--top-k", "7", "--top-p", "0.9")
    sample_text(capsys, base_run, "--top-k", "0")
    assert asked == [(0.8, 50, 1.0), (0.7, 7, 0.9), (0.8, None, 1.0)]


def test_sample_a_config_toml_cut_short_is_named_not_blamed_for_its_defaults(
    base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A field cut from config.toml would read as its default and be called a mismatch ("4 in
    config.toml", which the file never said): the missing field is named, as on resume."""
    out = copy_run(base_run, tmp_path / "cut")
    toml = out / "config.toml"
    toml.write_text(
        "".join(
            line for line in toml.read_text().splitlines(True) if not line.startswith("n_layer")
        )
    )
    assert sample.main(["--run", str(out), "--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{toml} lacks model.n_layer, which train.py writes" in err
    assert "delete it to sample with the config" in err
    toml.write_text("[model\n")  # one that does not parse: the same way on
    assert sample.main(["--run", str(out), "--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"config file {toml}: " in err and "delete it to sample with the config" in err


def test_sample_a_run_without_config_toml_uses_the_config_its_checkpoint_records(
    base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As resuming does: the same text as with config.toml."""
    out = copy_run(base_run, tmp_path / "no-config")
    (out / "config.toml").unlink()
    assert sample_text(capsys, out, "--seed", "0") == sample_text(capsys, base_run, "--seed", "0")


def test_sample_greedy_ignores_the_seed(base_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    greedy = sample_text(capsys, base_run, "--temperature", "0", "--seed", "0")
    assert greedy.startswith("def ")
    assert sample_text(capsys, base_run, "--temperature", "0", "--seed", "1") == greedy


def test_sample_top_p(base_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    greedy = sample_text(capsys, base_run, "--temperature", "0")
    assert sample_text(capsys, base_run, "--top-p", "1e-6", "--seed", "3") == greedy
    nucleus = sample_text(capsys, base_run, "--top-p", "0.9", "--seed", "3")
    assert nucleus.startswith("def ")
    assert nucleus != sample_text(capsys, base_run, "--top-p", "1", "--seed", "3")


def test_sample_stop_at_eot_ends_at_the_first_separator(
    base_run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A briefly trained model rarely samples the separator: generate() is replaced by one
    that does, after two tokens (its own stopping is tested in test_model.py)."""
    asked: list[int | None] = []

    def generate(self: GPT, idx: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        asked.append(kwargs.get("stop_id"))
        more = torch.tensor([[300, 301, EOT_ID, 302, EOT_ID]], device=idx.device)
        return torch.cat((idx, more), dim=1)

    monkeypatch.setattr(GPT, "generate", generate)
    text = sample_text(capsys, base_run)
    assert text.count(EOT) == 2, "without the flag, generation runs on past separators"
    assert sample_text(capsys, base_run, "--stop-at-eot") == text[: text.index(EOT)]
    assert asked == [None, EOT_ID]


def test_sample_heals_the_prompts_last_token(
    base_run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "def " ends in a lone space token, which training saw rarely before a word: generate()
    gets the prompt without it and draws first among the tokens that start with a space."""
    tokenizer = Tokenizer.from_file(str(base_run / "tokenizer.json"))
    ids = tokenizer.encode("def ").ids
    assert tokenizer.id_to_token(ids[-1]) == "Ġ", "the test needs a prompt ending mid-token"
    seen: list[tuple[list[int], set[int]]] = []  # the prompt, and the first token's choices
    real = GPT.generate

    def spy(self: GPT, idx: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        scores = kwargs["logits_hook"](0, torch.zeros(1, self.config.vocab_size))
        seen.append((idx[0].tolist(), set(scores[0].isfinite().nonzero().flatten().tolist())))
        return real(self, idx, *args, **kwargs)

    monkeypatch.setattr(GPT, "generate", spy)
    for temperature in ("0", "1"):
        assert sample_text(capsys, base_run, "--temperature", temperature).startswith("def ")
    spaced = {i for token, i in tokenizer.get_vocab().items() if token.startswith("Ġ")}
    assert seen[0] == (ids[:-1], spaced)
    sample_text(capsys, base_run, "--no-token-healing")
    assert seen[-1] == (ids, set(range(tokenizer.get_vocab_size())))
    for unhealed in ("d", EOT, f"def{EOT}"):  # one token; ends in the separator
        prompt = tokenizer.encode(unhealed).ids
        assert sample.heal(tokenizer, prompt) == (prompt, None), unhealed
    # A prompt ending in "<", which the separator's text starts with: never the separator
    _, allowed = sample.heal(tokenizer, tokenizer.encode("x <").ids)
    assert allowed is not None and allowed.any() and not allowed[tokenizer.token_to_id(EOT)]
    # Nothing to sample: the prompt as given, not healed (its last token dropped)
    assert sample.sample_run(base_run, "def ", max_new_tokens=0) == "def "


def test_logits_hook_draws_only_ids_the_tokenizer_has() -> None:
    """A model's vocab_size padded past its tokenizer's: the rows above are cut before
    temperature, top_k and top_p, so they are never drawn and the rest share all the
    probability (an infinite temperature draws uniformly among them)."""
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()  # vocab_size 97, as if the tokenizer had only 10
    prompt = torch.randint(0, 10, (4, 3))
    unlimited = model.generate(prompt, 30, temperature=1.0)
    assert int(unlimited[:, 3:].max()) >= 10, "an untrained model samples the unused rows"
    limit = sample.logits_hook(10, 97)
    for kwargs in ({"temperature": 1.0}, {"temperature": 1.0, "top_k": 50}, {"temperature": 0}):
        limited = model.generate(prompt, 30, logits_hook=limit, **kwargs)
        assert int(limited.max()) < 10, kwargs
    uniform = model.generate(prompt, 50, temperature=math.inf, logits_hook=limit)
    assert set(uniform[:, 3:].flatten().tolist()) == set(range(10))
    # A tokenizer as large as the model's vocabulary: every id, as without a limit
    assert torch.equal(
        model.generate(prompt, 5, temperature=0, logits_hook=sample.logits_hook(97, 97)),
        model.generate(prompt, 5, temperature=0),
    )
    for bad in (0, 98):
        with pytest.raises(
            ValueError, match=rf"vocab_limit={bad}: must be in 1..vocab_size \(97\)"
        ):
            sample.logits_hook(bad, 97)


def test_sample_never_draws_the_rows_of_a_padded_vocabulary(
    data_root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model whose vocab_size (576) pads its tokenizer's 512 ids: sampling uniformly
    (--temperature inf, --top-k 0), no id from 512 up is drawn, on the healed first token too."""
    out = tmp_path / "padded"
    assert run(data_root, out, "--model.vocab_size=576", "--train.max_steps=1") == 0
    drawn: list[int] = []
    real = GPT.generate

    def spied(self: GPT, idx: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        ids = real(self, idx, *args, **kwargs)
        drawn.extend(ids[0, idx.size(1) :].tolist())
        return ids

    monkeypatch.setattr(GPT, "generate", spied)
    sample_text(capsys, out, "--temperature", "inf", "--top-k", "0", "--tokens", "300")
    assert len(drawn) == 300 and max(drawn) < 512 and len(set(drawn)) > 100


def test_logits_hook_draws_the_first_token_among_first_allowed_only() -> None:
    """Token healing's constraint, at every temperature (an infinite one included, where a
    masked score would turn NaN) and with top_k/top_p; the tokens after it are free."""
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()  # vocab_size 97
    prompt = torch.randint(0, 97, (8, 3))
    allowed = torch.zeros(97, dtype=torch.bool)
    allowed[[4, 40, 90]] = True
    hook = sample.logits_hook(97, 97, allowed)
    settings = [
        {"temperature": 0},
        {"temperature": 1.0},
        {"temperature": math.inf},
        {"temperature": 1.0, "top_k": 1},
        {"temperature": 1.0, "top_k": 5},
        {"temperature": math.inf, "top_p": 0.5},
    ]
    later = set()
    for kwargs in settings:
        out = model.generate(prompt, 6, logits_hook=hook, **kwargs)
        assert set(out[:, 3].tolist()) <= {4, 40, 90}, kwargs
        later |= set(out[:, 4:].flatten().tolist())
    assert len(later - {4, 40, 90}) > 10, "only the first token is constrained"
    first = model.generate(prompt, 1, temperature=math.inf, logits_hook=hook)[:, 3]
    assert len(set(first.tolist())) > 1, "sampled among the allowed, not collapsed onto one"
    cut = sample.logits_hook(10, 97, allowed[:10])  # a mask over the tokenizer's ids
    assert set(model.generate(prompt % 10, 2, logits_hook=cut)[:, 3].tolist()) == {4}
    for bad, problem in [(allowed[:10], r"shape \(97,\)"), (allowed.int(), "bool mask")]:
        with pytest.raises(ValueError, match=problem):
            sample.logits_hook(97, 97, bad)
    with pytest.raises(ValueError, match="allows no token"):
        sample.logits_hook(97, 97, torch.zeros(97, dtype=torch.bool))


def test_sample_with_another_attention_variant_gives_the_same_text(
    base_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Attention holds no weights: every variant that runs here computes the same function."""
    own = sample_text(capsys, base_run, "--temperature", "0")  # tiny.toml trains naive
    for variant in ("sdpa", "inplace"):
        assert sample_text(capsys, base_run, "--temperature", "0", "--attention", variant) == own


@pytest.mark.slow
@pytest.mark.cxx
def test_flex_samples_on_a_cpu_with_naives_logits(base_run: Path) -> None:
    """flex cannot train on a CPU, but its forward runs there (compiled, so slow the first time):
    the run's logits through it match naive's, at a prompt's length and at the full context."""
    cpu = torch.device("cpu")
    naive, _, config = sample.load_run(base_run, cpu)
    flex, _, _ = sample.load_run(base_run, cpu, attention="flex")
    assert flex.config.attention == "flex"
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for length in (7, 24, config.model.block_size):
            # One sequence, as sampling runs it: the kernel sampling compiles serves this too
            ids = torch.randint(config.model.vocab_size, (1, length), generator=generator)
            torch.testing.assert_close(flex(ids)[0], naive(ids)[0], rtol=1e-5, atol=1e-5)


def test_sample_a_run_whose_variant_cannot_run_here_names_it_and_the_way_out(
    base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GPU run trained with a CUDA-only kernel, sampled on a CPU."""
    out = copy_run_trained_with(base_run, tmp_path / "run", "model", "attention", "sdpa-efficient")
    capsys.readouterr()
    assert sample.main(["--run", str(out), "--device", "cpu"]) == 2
    err = error_of(capsys.readouterr().err)
    assert "'sdpa-efficient' cannot run on cpu" in err and "--attention sdpa" in err
    # No dtype makes a CUDA-only kernel run on a CPU: only another variant is offered.
    for given in ([], ["--attention", "sdpa-cudnn"]):
        argv = ["--run", str(out), "--device", "cpu", "--dtype", "float32", *given]
        assert sample.main(argv) == 2
        err = error_of(capsys.readouterr().err).rstrip()
        assert err.endswith("; sample with another variant, e.g. --attention sdpa"), err
    assert sample_text(capsys, out, "--device", "cpu", "--attention", "sdpa").startswith("def ")


def test_sample_a_tf32_run_off_cuda_in_ieee_fp32(
    base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GPU run trained with TF32, sampled on a CPU: fp32 as usual, not refused."""
    greedy = sample_text(capsys, base_run, "--temperature", "0")
    out = copy_run_trained_with(base_run, tmp_path / "run", "train", "dtype", "tf32")
    assert sample_text(capsys, out, "--temperature", "0", "--device", "cpu") == greedy
    assert torch.get_float32_matmul_precision() == "highest"


def test_sample_dtype_overrides_the_runs_precision(
    base_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--dtype picks the precision the forward runs in, whatever the run trained with: a
    bfloat16 run sampled in float32 runs without autocast, and float32 gives the fp32 run's
    own text; tf32 off CUDA is refused, naming the flag. On a CPU without bf16 instructions a
    bfloat16 run samples in float32, said, and --dtype bfloat16 runs, warned."""
    seen: list[torch.dtype | None] = []
    real = GPT.generate

    def recorded(self: GPT, *args: Any, **kwargs: Any) -> torch.Tensor:
        on = torch.is_autocast_enabled("cpu")
        seen.append(torch.get_autocast_dtype("cpu") if on else None)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GPT, "generate", recorded)
    bf16_instructions = True
    monkeypatch.setattr(runtime, "bf16_matmul_instructions", lambda: bf16_instructions)
    greedy = sample_text(capsys, base_run, "--temperature", "0")
    assert sample_text(capsys, base_run, "--temperature", "0", "--dtype", "float32") == greedy
    sample_text(capsys, base_run, "--temperature", "0", "--dtype", "bfloat16")
    bf16_run = copy_run_trained_with(base_run, tmp_path / "run", "train", "dtype", "bfloat16")
    sample_text(capsys, bf16_run, "--temperature", "0")
    assert sample_text(capsys, bf16_run, "--temperature", "0", "--dtype", "float32") == greedy
    assert seen == [None, None, torch.bfloat16, torch.bfloat16, None]
    assert sample.main(["--run", str(base_run), "--dtype", "tf32"]) == 2
    assert "--dtype tf32: TF32 is a CUDA mode" in capsys.readouterr().err

    bf16_instructions, seen[:] = False, []
    assert sample.main(["--run", str(bf16_run), "--prompt", "def ", "--tokens", "20"]) == 0
    err = capsys.readouterr().err
    assert "note: the run trained in bfloat16, but this CPU has no bfloat16 matmul" in err
    assert "far slower than float32's (--dtype bfloat16 to insist); sampling in float32" in err
    sample_text(capsys, bf16_run, "--temperature", "0", "--dtype", "bfloat16")
    assert seen == [None, torch.bfloat16]
    assert sample.main(["--run", str(bf16_run), "--tokens", "5", "--dtype", "bfloat16"]) == 0
    assert "warning: --dtype bfloat16: this CPU has no bfloat16" in capsys.readouterr().err


def test_sample_longer_than_the_context(
    base_run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--tokens past block_size (32): every token asked for is drawn, the model seeing the
    last block_size tokens at most."""
    drawn, seen = [], []
    generate, features = GPT.generate, GPT.features

    def counted(self: GPT, idx: torch.Tensor, max_new_tokens: int, **kw: Any) -> torch.Tensor:
        out = generate(self, idx, max_new_tokens, **kw)
        drawn.append(out.shape[1] - idx.shape[1])
        return out

    def widths(self: GPT, idx: torch.Tensor) -> torch.Tensor:
        seen.append(idx.shape[1])
        return features(self, idx)

    monkeypatch.setattr(GPT, "generate", counted)
    monkeypatch.setattr(GPT, "features", widths)
    text = sample_text(capsys, base_run, "--tokens", "50")
    assert text.startswith("def ") and drawn == [50]
    assert max(seen) == 32 and len(seen) == 50, seen


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--tokens", "-3"], "--tokens"),
        (["--top-k", "-5"], "--top-k"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--temperature", "-1"], "--temperature"),
        (["--temperature", "nan"], "--temperature"),
        (["--device", "cuda:x"], "--device"),
        (["--seed", str(2**64)], "--seed"),
        (
            ["--prompt", "ab\udcff"],
            "--prompt 'ab\\udcff' is not UTF-8 text",
        ),  # bytes a shell passed
    ],
)
def test_sample_bad_arguments_name_the_flag(
    base_run: Path, capsys: pytest.CaptureFixture[str], args: list[str], named: str
) -> None:
    assert sample.main(["--run", str(base_run), *args]) == 2
    assert named in error_of(capsys.readouterr().err)


@pytest.mark.cxx
def test_sampling_with_another_variant_is_not_refused_for_training_dropout(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """flex has no dropout, which only training applies: a run trained with dropout may still
    be sampled with it."""
    out = tmp_path / "run"
    one_step = ["--train.max_steps=1", "--train.eval_interval=0", "--train.eval_batches=1"]
    assert run(data_root, out, "--model.dropout=0.1", *one_step) == 0
    capsys.readouterr()
    assert sample.main(["--run", str(out), "--attention", "flex", "--tokens", "2"]) == 0
    model, _, _ = sample.load_run(out, torch.device("cpu"), attention="inplace")
    assert model.config.dropout == 0.0 and load_config(out / "config.toml").model.dropout == 0.1


def test_ctrl_c_while_sampling_keeps_the_text_so_far_and_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*args: object, stream: Callable[[str], None], **kwargs: object) -> str:
        stream("def f(")
        raise KeyboardInterrupt

    monkeypatch.setattr(sample, "sample_run", interrupted)
    assert sample.main(["--run", "runs/any", "--tokens", "3000"]) == 130
    captured = capsys.readouterr()
    assert captured.out == "def f(\n"
    assert captured.err == (
        "interrupted before the sample was complete (--tokens 3000); above, the text sampled "
        "so far\n"
    )


def test_sampled_text_streams_as_it_is_drawn(base_run: Path) -> None:
    """The pieces, the prompt first, make the text returned; a character whose bytes span
    two tokens comes out once whole, not as a replacement character."""
    for stop in (False, True):
        pieces: list[str] = []
        text = sample.sample_run(
            base_run, "def", 30, seed=2, stop_at_eot=stop, stream=pieces.append
        )
        assert "".join(pieces) == text and len(pieces) > 5 and text.startswith(pieces[0])
    tokenizer = Tokenizer.from_file(str(base_run / "tokenizer.json"))
    lead, tail = (tokenizer.token_to_id(c) for c in "Ã©")  # é's bytes, 0xC3 0xA9, byte-level
    pieces = []
    shown = sample.Shown(tokenizer, tokenizer.encode("a").ids, None, pieces.append)
    shown.add(torch.tensor([[lead]]))
    assert pieces == ["a"]  # half a character: not yet
    shown.add(torch.tensor([[tail]]))
    assert pieces == ["a", "é"]
    # A prompt cut in the middle of é (healing drops its last token): é once the byte comes.
    pieces = []
    shown = sample.Shown(tokenizer, [*tokenizer.encode("a").ids, lead], None, pieces.append)
    shown.add(torch.tensor([[tail]]))
    shown.finish("aé")
    assert pieces == ["a", "é"]
    # Given the whole prompt, as sample_run gives it: shown whole, first
    pieces = []
    shown = sample.Shown(tokenizer, [*tokenizer.encode("a").ids, lead], None, pieces.append, "aé")
    shown.add(torch.tensor([[tail]]))
    shown.add(torch.tensor([[tokenizer.token_to_id("b")]]))
    shown.finish("aéb")
    assert pieces == ["aé", "b"]


def test_sample_to_a_full_disk_or_a_stdout_that_cannot_encode_says_so(
    base_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An error naming stdout, not a traceback; and a stdout that cannot encode the text is
    named, not blamed on the input (the prompt is valid)."""
    monkeypatch.setattr(sys, "stdout", FullDisk())
    assert sample.main(["--run", str(base_run), "--tokens", "2"]) == 2
    assert capsys.readouterr().err == (
        "error: cannot write to stdout (No space left on device); the output is cut short\n"
    )
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="ascii"))
    assert sample.main(["--run", str(base_run), "--prompt", "é", "--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "error: stdout's encoding, ascii, cannot show the sampled text" in err
    assert "PYTHONIOENCODING=utf-8" in err
    # A run folder whose name is not UTF-8, which the tokenizer library cannot open: said so
    undecodable = os.fsdecode(bytes(base_run) + b"\xff")
    assert sample.main(["--run", undecodable, "--tokens", "2"]) == 2
    assert "not valid UTF-8; rename the folder" in capsys.readouterr().err


def test_a_healed_prompt_is_shown_whole_before_the_first_draw(base_run: Path) -> None:
    """Healing drops "x = "'s last token (a lone space) to draw it again among the tokens
    that start with it; what is shown first is still the prompt as typed, so a Ctrl-C before
    the first draw keeps it."""
    tokenizer = Tokenizer.from_file(str(base_run / "tokenizer.json"))
    healed, _ = sample.heal(tokenizer, tokenizer.encode("x = ").ids)
    assert tokenizer.decode(healed) == "x =", "the case this test is about"
    pieces: list[str] = []
    text = sample.sample_run(base_run, "x = ", 10, seed=0, stream=pieces.append)
    assert pieces[0] == "x = " and "".join(pieces) == text


def test_sampling_on_a_gpu_without_bf16_or_tf32_tensor_cores(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before Ampere: a run trained in bf16 or tf32 samples in fp32, said; asking for either
    with --dtype is an error naming the flag."""
    cuda = torch.device("cuda")  # only named, with a T4's compute capability: no GPU needed
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    for trained, cores in (("bfloat16", "bf16"), ("tf32", "TF32")):
        config = load_config(TINY, [f"--train.dtype={trained}"])
        assert sample.sampling_precision(config, cuda, None).train.dtype == "float32"
        assert (
            f"note: the run trained in {trained}, which needs {cores} tensor cores: this GPU "
            "(compute capability 7.5) has none" in capsys.readouterr().err
        )
        with pytest.raises(sample.SampleError, match=rf"--dtype {trained} needs {cores} tensor"):
            sample.sampling_precision(config, cuda, trained)
    float32 = load_config(TINY, ["--train.dtype=float32"])
    assert sample.sampling_precision(float32, cuda, "auto").train.dtype == "auto"
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert sample.sampling_precision(float32, cuda, "bfloat16").train.dtype == "bfloat16"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_sample_piped_into_a_reader_that_stops_ends_quietly(base_run: Path) -> None:
    """`sample.py | head`: once the reader has gone, sampling stops with the shell's status
    for SIGPIPE (128 + 13) and no traceback. Beside it, `> log 2>&1` on a full disk: status 2,
    though the error line cannot be written either (not 120, Python's for a flush that fails
    at exit)."""
    argv = [sys.executable, str(ROOT / "sample.py"), "--run", str(base_run), "--tokens", "3000"]
    with open("/dev/full", "w") as full:
        both = subprocess.Popen(argv, stdout=full, stderr=full)
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        try:
            assert proc.stdout is not None and proc.stderr is not None
            assert proc.stdout.read(1)  # the prompt, then the stream: the reader has its line
            proc.stdout.close()
            err = proc.stderr.read().decode()
            assert proc.wait(timeout=120) == 128 + signal.SIGPIPE, err
            assert both.wait(timeout=120) == 2
        finally:  # a failure or time-out leaves neither running
            both.kill()
            both.wait()
    assert "Traceback" not in err and "error" not in err, err


def test_sample_from_a_missing_dir_or_a_file_says_so(
    base_run: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    os.mkfifo(tmp_path / "pipe")  # as /dev/null: there, and not a run's folder
    assert sample.main(["--run", str(tmp_path / "pipe")]) == 2
    assert error_of(capsys.readouterr().err).endswith(
        "pipe is neither a file nor a folder; give a run directory\n"
    )
    nope = tmp_path / "nope"
    assert sample.main(["--run", str(nope)]) == 2
    err = error_of(capsys.readouterr().err)
    assert (
        f"does not exist; train it first (python train.py --config configs/default.toml --out {nope})"
        in err
    )
    # A run stopped before its first checkpoint: it has the tokenizer, not the weights
    started = tmp_path / "started"
    started.mkdir()
    shutil.copy(base_run / "tokenizer.json", started)
    assert sample.main(["--run", str(started)]) == 2
    err = error_of(capsys.readouterr().err)
    assert f"no checkpoint at {started / checkpoint.CHECKPOINT}; train it first" in err
    # With its config.toml, it starts over with the run's settings, not train.py's defaults
    shutil.copy(base_run / "config.toml", started)
    assert sample.main(["--run", str(started)]) == 2
    again = f"python train.py --config {started / 'config.toml'} --out {started}"
    assert f"train it first ({again})" in error_of(capsys.readouterr().err)
    # Still training, before its first save: not "train it first", which the lock refuses
    with rundir.run_lock(started):
        assert sample.main(["--run", str(started)]) == 2
    err = error_of(capsys.readouterr().err)
    assert f"yet: the run is training (pid {os.getpid()})" in err and "train it" not in err
    # In its first moments, before the tokenizer is copied in: held, not "no run"; as a sweep
    # in its first cell holds its folder, it does not say which
    (started / "tokenizer.json").unlink()
    with rundir.run_lock(started):
        assert sample.main(["--run", str(started)]) == 2
    assert (
        f"yet: pid {os.getpid()} holds it (a run starting, or a profile sweep writing there); "
        "a run saves one at each evaluation"
    ) in error_of(capsys.readouterr().err)
    # A sweep's folder, written or being written: not a run
    (started / "results.json").write_text("{}")
    with rundir.sweep_lock(started):
        assert sample.main(["--run", str(started)]) == 2
    assert f"--run {started} is a profile sweep's folder (results.json), not a run" in (
        error_of(capsys.readouterr().err)
    )
    assert rundir.lock_holder(started) is None  # the lock went with the run
    # A corpus folder has a tokenizer.json too: not a run, and no command that trains there
    assert sample.main(["--run", str(data_root / "tiny")]) == 2
    err = error_of(capsys.readouterr().err)
    assert f"--run {data_root / 'tiny'} is a prepared corpus, not a run; give --run" in err
    assert "train.py --out" not in err
    ckpt = base_run / checkpoint.CHECKPOINT
    assert sample.main(["--run", str(ckpt)]) == 2  # the checkpoint itself
    assert f"is a file; give the run directory ({base_run})" in error_of(capsys.readouterr().err)


def test_sample_from_a_dir_without_checkpoint_exits_2(
    base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    no_ckpt = tmp_path / "no-ckpt"
    no_ckpt.mkdir()
    for name in ("config.toml", "tokenizer.json"):
        shutil.copyfile(base_run / name, no_ckpt / name)
    empty = tmp_path / "empty"
    empty.mkdir()
    for run_dir in (no_ckpt, empty):
        capsys.readouterr()
        assert sample.main(["--run", str(run_dir), "--prompt", "def "]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith("error: ") and str(run_dir) in captured.err
        assert captured.out == ""


def test_logits_hook_masks_only_the_first_step() -> None:
    from sample import logits_hook

    allowed = torch.tensor([True, False, False, True])
    hook = logits_hook(4, 6, allowed)
    logits = torch.zeros(1, 6)
    assert hook(0, logits).isneginf().tolist() == [[False, True, True, False]]
    for step in (1, 2):
        out = hook(step, logits)
        assert out.shape == (1, 4) and not out.isneginf().any()


def _word_tokenizer():
    from tokenizers import Tokenizer, models

    vocab = {"a": 0, "b": 1, "<|endoftext|>": 2}
    return Tokenizer(models.WordLevel(vocab, unk_token="a"))


def test_shown_streams_nothing_after_the_separator_even_when_sampling_goes_on() -> None:
    from sample import Shown

    pieces: list[str] = []
    shown = Shown(_word_tokenizer(), [0], eot=2, stream=pieces.append)
    shown.add(torch.tensor([[1]]))
    before = "".join(pieces)
    shown.add(torch.tensor([[2]]))  # the separator
    shown.add(torch.tensor([[0]]))  # sampled on past it (another row has not stopped)
    shown.add(torch.tensor([[1]]))
    assert "".join(pieces) == before
