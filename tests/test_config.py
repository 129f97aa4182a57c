"""Config loading: every shipped file parses; CLI > file > defaults; bad input names its key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import train
from model import GPTConfig
from training.config import Config, ConfigError, TrainConfig, dump_toml, load_config, parse_override

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "configs").glob("*.toml"))
TINY = ROOT / "configs" / "tiny.toml"


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- shipped configs ----------------------------------------------------------------------------


def test_configs_folder_ships_configs() -> None:
    # If the glob were empty, the parametrized test below would silently test nothing.
    assert {p.name for p in SHIPPED} >= {"tiny.toml", "default.toml", "gpt2-small.toml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_parses_and_round_trips(tmp_path: Path, path: Path) -> None:
    config = load_config(path)
    assert isinstance(config, Config)
    assert config != Config(), f"{path.name} changes nothing from the defaults"
    assert load_config(write(tmp_path, dump_toml(config))) == config


# --- precedence and value forms -----------------------------------------------------------------


def test_a_byte_order_mark_is_no_error(tmp_path: Path) -> None:
    """Some Windows editors start a UTF-8 file with one; invisible, it made line 1 invalid."""
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf[model]\nn_layer = 3\n")
    assert load_config(path).model.n_layer == 3


def test_no_file_and_no_overrides_gives_the_defaults() -> None:
    assert load_config(None) == Config()


def test_cli_beats_file_beats_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, "[train]\nmax_steps = 20\nlr = 0.5\n[model]\nn_layer = 3\n")
    config = load_config(path, ["--train.lr=0.25", "--model.n_embd=64"])
    assert config.train.lr == 0.25  # CLI over file
    assert config.model.n_embd == 64  # CLI over default
    assert config.train.max_steps == 20  # file over default
    assert config.model.n_layer == 3
    assert config.train.batch_size == TrainConfig().batch_size  # untouched: default
    assert config.model.n_head == GPTConfig().n_head


def test_later_override_of_the_same_key_wins() -> None:
    assert load_config(None, ["--train.seed=1", "--train.seed=2"]).train.seed == 2


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        ("--model.attention=sdpa", ("model", "attention", "sdpa")),  # bare word: a string
        ('--model.attention="sdpa-math"', ("model", "attention", "sdpa-math")),  # TOML string
        ("--model.attention=sdpa-math", ("model", "attention", "sdpa-math")),
        ("--train.lr=3e-4", ("train", "lr", 3e-4)),
        ("--train.max_steps=200", ("train", "max_steps", 200)),
        ("--train.compile=true", ("train", "compile", True)),
        ("--data.root=/tmp/some dir/corpora", ("data", "root", "/tmp/some dir/corpora")),
        ("--train.sample_prompt=x = 1", ("train", "sample_prompt", "x = 1")),  # '=' in a value
        ("--data.root=a.b/c", ("data", "root", "a.b/c")),  # '.' in a value
    ],
)
def test_parse_override(arg: str, expected: tuple) -> None:
    assert parse_override(arg) == expected


@pytest.mark.parametrize(
    ("arg", "field", "expected"),
    [
        ("--data.name=2024", ("data", "name"), "2024"),
        ("--train.sample_prompt=true", ("train", "sample_prompt"), "true"),
        ("--data.name=nan", ("data", "name"), "nan"),
        ("--data.root=1e3", ("data", "root"), "1e3"),
    ],
)
def test_a_string_field_takes_an_override_that_reads_as_another_type(
    arg: str, field: tuple[str, str], expected: str
) -> None:
    section, key = field
    assert getattr(getattr(load_config(None, [arg]), section), key) == expected


def test_a_typed_field_still_refuses_text() -> None:
    with pytest.raises(ConfigError, match=r"train\.max_steps: expected int"):
        load_config(None, ["--train.max_steps=ten"])


@pytest.mark.parametrize(
    ("arg", "spelled"),
    [("--train.compile=False", "false"), ("--train.lr=.001", "0.001"), ("--train.lr=2.", "2.0")],
)
def test_a_python_spelling_is_refused_with_the_toml_one(arg: str, spelled: str) -> None:
    """nanoGPT's configurator reads Python literals; TOML does not, so the error says how."""
    with pytest.raises(ConfigError, match=rf"\(TOML spells it {re.escape(spelled)}\)$"):
        load_config(None, [arg])


def test_overrides_reach_the_config() -> None:
    config = load_config(TINY, ["--model.attention=sdpa", "--train.lr=3e-4"])
    assert config.model.attention == "sdpa"
    assert config.train.lr == 3e-4
    assert isinstance(config.train.lr, float)


@pytest.mark.parametrize("source", ["cli", "file"])
def test_int_is_accepted_for_a_float_field(tmp_path: Path, source: str) -> None:
    if source == "cli":
        config = load_config(None, ["--train.lr=1"])
    else:
        config = load_config(write(tmp_path, "[train]\nlr = 1\n"))
    assert config.train.lr == 1.0
    assert type(config.train.lr) is float


# --- errors name the key --------------------------------------------------------------------------

# (config file text or None, overrides, text the message must contain)
BAD = {
    "unknown-section": (None, ["--optim.lr=1"], ["optim", "valid sections"]),
    "unknown-section-file": ("[optim]\nlr = 1\n", [], ["optim"]),
    "unknown-key": (None, ["--train.learning_rate=1"], ["train.learning_rate", "lr"]),
    "unknown-key-file": ("[model]\nn_layers = 3\n", [], ["model.n_layers"]),
    "str-for-int": (None, ["--train.max_steps=abc"], ["train.max_steps", "int"]),
    "float-for-int": (None, ["--train.max_steps=1.5"], ["train.max_steps"]),
    "bool-for-int": (None, ["--train.batch_size=true"], ["train.batch_size"]),
    "str-for-float-file": ('[train]\nlr = "fast"\n', [], ["train.lr"]),
    "str-for-int-file": ('[train]\nbatch_size = "x"\n', [], ["train.batch_size"]),
    "section-not-a-table": ("train = 3\n", [], ["train"]),
    "section-not-a-table-with-an-override": ("train = 3\n", ["--train.lr=1.0"], ["train"]),
    "array-of-tables": ("[[train]]\nlr = 1.0\n", ["--train.lr=1.0"], ["train"]),
    "seed-beyond-63-bits": (None, ["--train.seed=18446744073709551615"], ["train.seed"]),
    "negative-seed": (None, ["--train.seed=-1"], ["train.seed"]),
    "invalid-utf8-argument": (
        None,
        ["--train.sample_prompt=a\udcff"],
        ["--train.sample_prompt", "UTF-8"],
    ),
    "not-an-override": (None, ["--train.lr"], ["--train.lr", "--section.field=value"]),
    "value-given-apart": (None, ["--train.lr", "0.1"], ["did you mean --train.lr=0.1?"]),
    "mistyped-option": (None, ["--variant=sdpa"], ["unknown option '--variant=sdpa'", "--help"]),
    "stray-word": (None, ["sdpa"], ["unexpected argument 'sdpa'"]),
    "config-without-flag": (
        None,
        ["configs/tiny.toml"],
        ["did you mean --config configs/tiny.toml"],
    ),
    "n_head-not-dividing": (None, ["--model.n_head=3"], ["model.n_embd", "n_head"]),
    "unknown-variant": (
        None,
        ["--model.attention=bogus"],
        ["model.attention", "bogus", "naive"],
    ),
    "negative-size": (None, ["--model.n_layer=0"], ["model.n_layer"]),
    "dropout-out-of-range": (None, ["--model.dropout=1.5"], ["model.dropout"]),
    "zero-log-interval": (None, ["--train.log_interval=0"], ["train.log_interval"]),
    "nan-lr": (None, ["--train.lr=nan"], ["train.lr", "finite"]),
    "inf-lr": (None, ["--train.lr=inf"], ["train.lr", "finite"]),
    "empty-sample-prompt": (None, ['--train.sample_prompt=""'], ["train.sample_prompt"]),
    "min-lr-above-lr": (
        None,
        ["--train.lr=0.01", "--train.min_lr=0.1"],
        ["train.min_lr", "train.lr"],
    ),
    "zero-grad-accum-file": ("[train]\ngrad_accum = 0\n", [], ["train.grad_accum"]),
    "float16": (None, ["--train.dtype=float16"], ["train.dtype", "bfloat16"]),
    "bogus-device": (None, ["--train.device=bogus"], ["train.device"]),
    "beta-of-one": (None, ["--train.beta2=1.0"], ["train.beta2"]),
    "negative-beta1": (None, ["--train.beta1=-0.1"], ["train.beta1", "[0, 1)"]),
    "zero-max-steps": (None, ["--train.max_steps=0"], ["train.max_steps=0", ">= 1"]),
    "global-batch-not-whole-micro-batches": (
        None,
        ["--train.batch_size=16", "--train.global_batch_size=40"],
        ["train.global_batch_size=40", "train.batch_size=16"],
    ),
    "negative-global-batch": (
        None,
        ["--train.global_batch_size=-16"],
        ["train.global_batch_size=-16", "must be >= 0"],
    ),
    "global-batch-and-grad-accum": (
        None,
        ["--train.global_batch_size=64", "--train.grad_accum=2"],
        ["train.grad_accum=2", "train.global_batch_size=64", "set train.grad_accum=1"],
    ),
}


@pytest.mark.parametrize(("world_size", "micro_batches"), [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_a_global_batch_size_holds_whatever_the_ranks(world_size: int, micro_batches: int) -> None:
    tc = TrainConfig(batch_size=4, global_batch_size=32)
    assert tc.micro_batches(world_size) == micro_batches
    config = Config(model=GPTConfig(block_size=16), train=tc)
    assert config.tokens_per_step(world_size) == 32 * 16  # the same global batch


def test_without_a_global_batch_size_grad_accum_is_per_rank() -> None:
    tc = TrainConfig(batch_size=4, grad_accum=3)
    assert [tc.micro_batches(n) for n in (1, 2, 8)] == [3, 3, 3]
    config = Config(model=GPTConfig(block_size=16), train=tc)
    assert [config.tokens_per_step(n) for n in (1, 2)] == [4 * 3 * 16, 2 * 4 * 3 * 16]


@pytest.mark.parametrize(
    ("world_size", "named", "keeps"),
    [
        (16, ["train.global_batch_size=32", "16 ranks", "multiple of 64"], 2),
        (3, ["train.global_batch_size=32", "3 ranks", "multiple of 12"], None),
        (64, ["train.global_batch_size=32", "64 ranks", "multiple of 256"], None),
    ],
)
def test_a_global_batch_the_ranks_cannot_split_is_a_config_error(
    world_size: int, named: list[str], keeps: int | None
) -> None:
    """Named with both ways out: another global batch, or (where one splits it) a smaller
    batch_size, which keeps the rows each step trains on, as a resume on more ranks wants."""
    tc = TrainConfig(batch_size=4, global_batch_size=32)
    with pytest.raises(ConfigError) as info:
        tc.micro_batches(world_size)
    for part in named:
        assert part in str(info.value)
    keep = "; or keep it, and so the rows each step trains on, with train.batch_size="
    assert (keep in str(info.value)) == (keeps is not None)
    if keeps is not None:
        assert str(info.value).endswith(f"{keep}{keeps}")
        assert TrainConfig(batch_size=keeps, global_batch_size=32).micro_batches(world_size)


def load_bad(tmp_path: Path, text: str | None, overrides: list[str]) -> Config:
    return load_config(write(tmp_path, text) if text is not None else None, overrides)


@pytest.mark.parametrize(("text", "overrides", "named"), BAD.values(), ids=BAD.keys())
def test_bad_config_raises_config_error_naming_the_key(
    tmp_path: Path, text: str | None, overrides: list[str], named: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        load_bad(tmp_path, text, overrides)
    for part in named:
        assert part in str(info.value)


def test_an_error_names_the_file_or_the_override_its_value_came_from(tmp_path: Path) -> None:
    """Resuming reads two files (the run's config.toml, --config) besides the overrides: an
    error says which one to fix."""
    path = write(tmp_path, '[train]\nlr = "fast"\n')
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: train.lr: expected float"):
        load_config(path)
    assert load_config(path, ["--train.lr=0.1"]).train.lr == 0.1  # the override replaces it
    path = write(tmp_path, "[train]\nlr = 0.01\n[optim]\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: unknown section \\[optim\\]"):
        load_config(path)
    # A key before any table: TOML reads it as the root's, which is no section
    for text, hint in (
        ("n_layer = 2\n[train]\nlr = 0.01\n", "put it under [model]"),
        ("depth = 2\n", "no table has it"),
    ):
        path = write(tmp_path, text)
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert str(info.value).startswith(f"{path}: {text.split()[0]} = 2 is outside any table")
        assert str(info.value).endswith(hint), info.value
    path = write(tmp_path, "[train]\nlr = 0.01\nmax_step = 5\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: unknown key train.max_step;"):
        load_config(path)
    path = write(tmp_path, "[train]\nlr = 0.01\n")
    with pytest.raises(ConfigError, match=r"^--train\.lr: expected float") as info:
        load_config(path, ["--train.lr=fast"])
    assert str(path) not in str(info.value)
    # A section's own checks: the file, with the overrides that went in, where the file's
    # values alone fail them; the override alone where they pass.
    path = write(tmp_path, "[model]\nn_head = 5\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: .*n_head") as info:
        load_config(path, ["--model.n_embd=96"])
    assert str(info.value).endswith("(with --model.n_embd)")
    path = write(tmp_path, "[model]\nn_layer = 2\n")
    with pytest.raises(ConfigError, match=r"^train\.batch_size=0: must be >= 1 \(with --train\."):
        load_config(path, ["--train.batch_size=0"])
    # Only the overrides the error depends on: not every one given for the section.
    with pytest.raises(ConfigError) as info:
        load_config(path, ["--train.batch_size=0", "--train.max_steps=4"])
    assert str(info.value) == "train.batch_size=0: must be >= 1 (with --train.batch_size)"
    path = write(tmp_path, "[model]\nn_head = 5\n")
    with pytest.raises(ConfigError) as info:  # the file's own error, whatever else is given
        load_config(path, ["--model.vocab_size=2048"])
    assert str(info.value).startswith(f"{path}: ") and "(with" not in str(info.value)
    path = write(tmp_path, "[model]\nn_layer = 2\n")
    with pytest.raises(
        ConfigError, match=r"^model\.n_embd=90 is not divisible by n_head=4"
    ) as info:
        load_config(write(tmp_path, "[model]\nn_head = 4\n"), ["--model.n_embd=90"])
    assert str(info.value).endswith("(with --model.n_embd)")
    # The file's values fail alone too: both are named.
    path = write(tmp_path, "[model]\nn_head = 5\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: ") as info:
        load_config(path, ["--model.n_layer=0"])
    assert str(info.value).endswith("(with --model.n_layer)")


@pytest.mark.parametrize(
    "case",
    [
        "unknown-section",
        "unknown-key",
        "str-for-int",
        "str-for-int-file",
        "unknown-variant",
        "section-not-a-table-with-an-override",
        "seed-beyond-63-bits",
        "invalid-utf8-argument",
    ],
)
def test_train_main_exits_2_on_a_bad_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    text, overrides, named = BAD[case]
    argv = ["--out", str(tmp_path / "run"), *overrides]
    if text is not None:
        argv += ["--config", str(write(tmp_path, text))]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    for part in named:
        assert part in err
    assert not (tmp_path / "run").exists(), "a config error must fail before writing anything"


def test_missing_config_file_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_config(missing)
    assert str(missing) in str(info.value)
    assert train.main(["--config", str(missing), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(missing) in err and "Traceback" not in err
    folder = tmp_path / "configs.toml"  # a directory by that name
    folder.mkdir()
    with pytest.raises(ConfigError, match=r"configs\.toml: cannot read it \(Is a directory\)"):
        load_config(folder)


def test_malformed_toml_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[train\nlr = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "quotes" not in str(info.value)
    # A bare word for a string, which tomllib calls only "Invalid value": the hint says why
    path = write(tmp_path, "[model]\nattention = sdpa\n")
    with pytest.raises(ConfigError, match=r"line 2, column 13\) \(TOML wants strings in quotes"):
        load_config(path)


# --- dump_toml ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["--model.attention=sdpa", "--train.lr=3e-4", "--train.compile=true", "--model.bias=false"],
        ["--train.lr=1e-12", "--train.min_lr=0", "--train.grad_clip=1e300"],
        ['--train.sample_prompt="quote \\" back\\\\slash\\nnewline\\ttab é ü"'],
        ['--data.root="C:\\\\data\\\\corpora"'],
        ['--train.sample_prompt="control \\u0001 and DEL \\u007f"'],
    ],
    ids=["tiny", "overrides", "extreme-floats", "escapes", "windows-path", "control-chars"],
)
def test_dump_toml_round_trips(tmp_path: Path, overrides: list[str]) -> None:
    config = load_config(TINY, overrides)
    assert load_config(write(tmp_path, dump_toml(config))) == config


def test_dump_toml_round_trips_the_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, dump_toml(Config()))) == Config()


def test_dump_toml_round_trips_characters_outside_the_bmp(tmp_path: Path) -> None:
    config = load_config(TINY)
    config.train.sample_prompt = "# 🐍 def "
    assert load_config(write(tmp_path, dump_toml(config))) == config


def test_help_lists_every_config_field_with_its_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--help ends with each section's fields as --section.field=value takes them."""
    import dataclasses

    import train

    with pytest.raises(SystemExit):
        train.main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())  # wrapped lines joined
    for section in dataclasses.fields(Config):
        assert f"[{section.name}]" in shown
        for f in dataclasses.fields(getattr(Config(), section.name)):
            assert f" {f.name}=" in shown, f"{section.name}.{f.name}"
    assert 'attention="naive"' in shown and "compile=false" in shown  # TOML's spelling


def test_a_bool_for_a_float_field_is_rejected() -> None:
    from training.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=r"train\.lr"):
        build_config({"train": {"lr": True}})
    with pytest.raises(ConfigError, match="lr"):
        build_config({}, ["--train.lr=true"])
