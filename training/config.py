"""Run configuration: TOML sections that mirror dataclasses, overridden from the command line.

Precedence: command line (`--section.field=value`) > TOML file > dataclass defaults.
Unknown sections or keys and wrong types are errors that name the key. Nothing is executed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import textwrap
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from console import is_utf8
from data.meta import corpus_name_problem
from model import GPTConfig

CPU_LINEAR = ("auto", "onednn", "torch")  # see cpu_linear.py
DTYPES = ("auto", "float32", "tf32", "bfloat16")  # auto: bf16 on CUDA from Ampere on, else fp32


NOT_A_DEVICE = "not a device; use auto, cpu, cuda, cuda:N or mps"


def parse_device(name: str) -> torch.device | None:
    """The torch.device `name` spells, or None; whether this machine has it is not asked."""
    try:
        return torch.device(name)
    except RuntimeError:
        return None


@dataclass
class DataConfig:
    name: str = "stdlib"  # a corpus prepared by data/prepare.py into <root>/<name>/
    root: str = "data"  # folder holding prepared corpora, relative to the working directory

    def __post_init__(self) -> None:
        # ~ expanded, as prepare.py's --out-root is: no shell does it in a TOML file or after
        # '=' (--data.root=~/corpora); ~nosuchuser is left as typed
        self.root = os.path.expanduser(self.root)
        if (problem := corpus_name_problem(self.name)) is not None:  # here, the file is named
            raise ValueError(problem)

    @property
    def dir(self) -> Path:
        """The corpus's folder, <root>/<name>."""
        return Path(self.root) / self.name


@dataclass
class TrainConfig:
    device: str = "auto"  # auto picks cuda > mps > cpu; or name one: cuda, cuda:1, mps, cpu
    # auto: bf16 autocast on CUDA GPUs from Ampere (compute capability 8.0) on, fp32 elsewhere;
    # or float32 (IEEE, PyTorch's default), tf32 (fp32 tensors, CUDA matmuls on TF32 tensor
    # cores: 10-bit mantissa, as nanoGPT turns on), bfloat16 (autocast; parameters and
    # optimizer state stay fp32); tf32 and bfloat16 need Ampere on
    dtype: str = "auto"
    compile: bool = False  # torch.compile each block; pays off on GPUs, costs a compile up front
    # fp32 nn.Linear on CPUs (cpu_linear.py): auto takes oneDNN on AMD CPUs with AVX-512 (about
    # 2x MKL's rate there), torch keeps PyTorch's BLAS, onednn insists (an error off CPU or
    # under autocast)
    cpu_linear: str = "auto"
    seed: int = 1337  # one seed for init, dropout and batch sampling: runs are reproducible
    batch_size: int = 16  # sequences per micro-batch per process
    grad_accum: int = 1  # micro-batches per rank per optimizer step; see global_batch_size
    # Sequences per optimizer step over all ranks, the same whatever their number (litgpt's and
    # torchtitan's global batch size): grad_accum is then derived, global / (batch x ranks),
    # and must be left at 1.
    # 0: batch_size x grad_accum x ranks, more ranks taking more sequences per step.
    global_batch_size: int = 0
    max_steps: int = 1000  # optimizer steps in the run
    lr: float = 1e-3  # peak learning rate, reached after warmup
    min_lr: float = 1e-4  # the cosine's floor at max_steps; the last step trained is just above
    warmup_steps: int = 100  # linear warmup, from lr/(warmup_steps+1): early Adam updates are noisy
    weight_decay: float = 0.1  # decoupled decay on matrices only; not on biases, norms
    beta1: float = 0.9  # AdamW momentum, as GPT-2/3 and nanoGPT use
    beta2: float = 0.95  # below 0.999: adapts faster, steadier for small transformers
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    eval_interval: int = 100  # steps between evaluations (and checkpoints); 0: only at the end
    eval_batches: int = 20  # steps' worth of val batches per evaluation; the same ones each time
    log_interval: int = 10  # steps between metrics.jsonl lines
    # One device's peak TFLOP/s in the run's dtype, from its datasheet (e.g. 989 for an H100's
    # dense bf16); 0: none. metrics.jsonl logs the job's achieved TFLOP/s, and MFU against this
    # times the number of ranks.
    peak_tflops: float = 0.0
    sample_tokens: int = 200  # tokens sampled when a run reaches max_steps; 0: none
    sample_prompt: str = "def"  # no trailing space: a space begins the next word's token

    def __post_init__(self) -> None:
        at_least = {
            "batch_size": 1,
            "grad_accum": 1,
            "global_batch_size": 0,
            "max_steps": 1,
            "eval_batches": 1,
            "log_interval": 1,
            "warmup_steps": 0,
            "eval_interval": 0,
            "sample_tokens": 0,
        }
        for name, low in at_least.items():
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool) and value < low:
                raise ValueError(f"train.{name}={value}: must be >= {low}")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip", "peak_tflops"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):  # `nan < 0` is False: test finiteness
                raise ValueError(f"train.{name}={value}: must be a finite number >= 0")
        if self.sample_tokens > 0 and not self.sample_prompt:
            raise ValueError(
                "train.sample_prompt is empty: give at least one character, or set "
                "train.sample_tokens=0 for no sample"
            )
        if self.global_batch_size and self.grad_accum != 1:
            # Both would set the micro-batches; and a run's config.toml must resume on any
            # number of ranks, which a grad_accum fitted to one number would not.
            raise ValueError(
                f"train.grad_accum={self.grad_accum} with train.global_batch_size="
                f"{self.global_batch_size}: a global batch size derives the micro-batches, "
                "so set train.grad_accum=1 (or train.global_batch_size=0 to set them yourself)"
            )
        if self.global_batch_size % self.batch_size:
            raise ValueError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                f"train.batch_size={self.batch_size}, the sequences of one micro-batch"
            )
        if self.min_lr > self.lr:
            raise ValueError(
                f"train.min_lr={self.min_lr} is above train.lr={self.lr}: the cosine decay "
                "would rise; min_lr is the floor the schedule decays to"
            )
        if not 0 <= self.seed < 2**63:  # the samplers seed their generators with seed + 2
            raise ValueError(f"train.seed={self.seed}: must be in [0, 2**63)")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)}: must be in [0, 1)")
        if self.cpu_linear not in CPU_LINEAR:
            raise ValueError(
                f"train.cpu_linear={self.cpu_linear!r}: valid choices: {', '.join(CPU_LINEAR)}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"train.dtype={self.dtype!r}: valid choices: {', '.join(DTYPES)}")
        if self.device != "auto" and parse_device(self.device) is None:
            raise ValueError(f"train.device={self.device!r}: {NOT_A_DEVICE}")

    def micro_batches(self, world_size: int) -> int:
        """Micro-batches per rank in one optimizer step: grad_accum, or the number that makes
        global_batch_size sequences on `world_size` ranks of batch_size each."""
        if not self.global_batch_size:
            return self.grad_accum
        per_pass = self.batch_size * world_size
        derived, rest = divmod(self.global_batch_size, per_pass)
        ranks = f"{world_size} rank{'s' if world_size > 1 else ''}"
        if rest or not derived:
            # A smaller batch_size that splits it (the largest: fewest micro-batches) keeps
            # the rows each step trains on
            fits = next(
                (
                    b
                    for b in range(self.batch_size - 1, 0, -1)
                    if not self.global_batch_size % (b * world_size)
                ),
                None,
            )
            keep = (
                f"; or keep it, and so the rows each step trains on, with train.batch_size={fits}"
                if fits
                else ""
            )
            raise ConfigError(
                f"train.global_batch_size={self.global_batch_size} does not split into "
                f"micro-batches of train.batch_size={self.batch_size} on {ranks}: it must be a "
                f"multiple of {per_pass}{keep}"
            )
        return derived

    def in_one_process(self) -> TrainConfig:
        """This config as one process runs it (a sweep's cell): a global batch size becomes
        its grad_accum micro-batches, recorded as such."""
        accum = self.micro_batches(world_size=1)
        return dataclasses.replace(self, grad_accum=accum, global_batch_size=0)


@dataclass
class Config:
    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def tokens_per_step(self, world_size: int = 1) -> int:
        """Tokens one optimizer step trains on, over `world_size` ranks: each rank's
        micro-batches of batch_size sequences of block_size tokens."""
        tc = self.train
        return tc.batch_size * tc.micro_batches(world_size) * world_size * self.model.block_size


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key."""


def _check_type(key: str, value: Any, expected: Any) -> Any:
    if isinstance(expected, types.UnionType) or typing.get_origin(expected) is typing.Union:
        for option in typing.get_args(expected):
            if option is type(None) and value is None:
                return value
            try:
                return _check_type(key, value, option)
            except ConfigError:
                continue
    elif expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    elif expected is int and isinstance(value, bool):
        pass
    elif isinstance(expected, type) and isinstance(value, expected):
        return value
    name = getattr(expected, "__name__", str(expected))
    raise ConfigError(
        f"{key}: expected {name}, got {type(value).__name__} {value!r}{_spelling(value, expected)}"
    )


def _spelling(value: Any, expected: Any) -> str:
    """How TOML spells what a Python habit typed: --train.compile=False, --train.lr=.001."""
    if not isinstance(value, str):
        return ""
    if expected is bool and value.lower() in ("true", "false"):
        return f" (TOML spells it {value.lower()})"
    if expected is float:
        try:
            number = float(value)
        except ValueError:
            return ""
        return f" (TOML spells it {number!r})" if math.isfinite(number) else ""
    return ""


def _build(
    cls: type,
    values: dict[str, Any],
    section: str,
    in_file: str = "",
    overridden: set[str] = (),
    file_values: dict[str, Any] | None = None,
) -> Any:
    """One section's dataclass from `values`: file_values (the file's own) with the keys in
    `overridden` set by --section.key overrides. An error in one value names where it came
    from: in_file ('path: ') or its override. One of the section's own checks names the
    overrides that went in, and the file too where the file's values fail alone as well."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        where = "" if key in overridden else in_file
        if key not in known:
            raise ConfigError(
                f"{where}unknown key {section}.{key!s}; valid keys in [{section}]: "
                f"{', '.join(sorted(known))}"
            )
        label = f"--{section}.{key}" if key in overridden else f"{section}.{key}"
        try:
            kwargs[key] = _check_type(label, value, hints[key])
        except ConfigError as e:
            raise ConfigError(where + str(e)) from None
    try:
        return cls(**kwargs)
    except ValueError as e:  # a dataclass's own validation, of fields alone or together
        if not in_file:
            raise ConfigError(str(e)) from None
        if not overridden:
            raise ConfigError(in_file + str(e)) from None
        file_values = file_values or {}

        def error_without(keys: set[str]) -> str | None:
            kept = {k: v for k, v in values.items() if k not in keys}
            kept |= {k: file_values[k] for k in keys if k in file_values}
            try:
                _build(cls, kept, section)
            except ConfigError as error:
                return str(error)
            return None

        # The overrides this error depends on: without one, it goes or changes. Where the
        # file's values alone fail too, the file is named as well.
        involved = [k for k in sorted(overridden) if error_without({k}) != str(e)]
        named = in_file if error_without(overridden) is not None else ""
        if not (involved or named):  # only together (each alone would fail it the same way)
            involved = sorted(overridden)
        given = ", ".join(f"--{section}.{k}" for k in involved)
        raise ConfigError(named + str(e) + (f" (with {given})" if given else "")) from None


def parse_override(arg: str, after: str | None = None) -> tuple[str, str, Any]:
    """'--train.lr=3e-4' -> ('train', 'lr', 0.0003). Bare words are strings: --model.attention=sdpa
    `after`: the argument that follows, the value where one was given apart (--train.lr 3e-4)."""
    body = arg.removeprefix("--")
    if not arg.startswith("--"):  # a stray word, or a config file given without --config
        hint = f"; did you mean --config {arg}?" if arg.endswith(".toml") else " (see --help)"
        raise ConfigError(f"unexpected argument {arg!r}{hint}")
    if "." not in body.split("=", 1)[0]:  # not an override at all: a mistyped option, say
        raise ConfigError(
            f"unknown option {arg!r} (see --help); a config override reads --section.field=value"
        )
    if "=" not in body:
        apart = after is not None and not after.startswith("--")
        hint = f"; did you mean {shlex.quote(f'{arg}={after}')}?" if apart else ""
        raise ConfigError(f"override {arg!r}: expected --section.field=value{hint}")
    dotted, raw = body.split("=", 1)
    section, key = dotted.split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, key, value


def read_toml(path: str | Path) -> dict[str, Any]:
    """A config file's tables, as written; errors name the file."""
    path = Path(path)
    try:
        # TOML is UTF-8 by spec; a byte-order mark (some Windows editors write one) is dropped
        return tomllib.loads(path.read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        project = Path(__file__).resolve().parents[1]
        if path.is_absolute() or Path.cwd().resolve() == project:
            raise ConfigError(f"config file {path} does not exist") from None
        also = f"; the project's is {project / path}" if (project / path).is_file() else ""
        raise ConfigError(
            f"config file {path} does not exist, relative to {Path.cwd()}{also}"
        ) from None
    except OSError as e:  # a directory, no permission
        raise ConfigError(f"config file {path}: cannot read it ({e.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        # tomllib says only "Invalid value" of the commonest slips: a bare word for a string,
        # True for true, .5 for 0.5
        hint = (
            ' (TOML wants strings in quotes, as attention = "sdpa", true and false in lower '
            "case, and a digit before a decimal point)"
            if str(e).startswith("Invalid value")
            else ""
        )
        raise ConfigError(f"config file {path}: {e}{hint}") from None


def missing_fields(raw: dict[str, Any], recorded: dict[str, Any]) -> list[str]:
    """The 'section.field' names of the config that a config's tables leave out and that
    `recorded` (another record of the same run) has: dump_toml writes them all."""
    return [
        f"{section.name}.{field.name}"
        for section in dataclasses.fields(Config)
        for field in dataclasses.fields(typing.get_type_hints(Config)[section.name])
        if field.name not in _table(raw, section.name)
        and field.name in _table(recorded, section.name)
    ]


def _table(tables: dict[str, Any], name: str) -> dict[str, Any]:
    table = tables.get(name)
    return table if isinstance(table, dict) else {}


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """A config file's Config, overrides on top; an error in the file's values names it."""
    if path is None:
        return build_config({}, overrides)
    return build_config(read_toml(path), overrides, source=str(path))


def build_config(
    raw: dict[str, Any], overrides: list[str] = (), source: str | None = None
) -> Config:
    """A Config from TOML-like tables (a file's, a checkpoint's record) and overrides on top.
    An error names where the value came from: its override, or `source` (the file)."""
    raw = {
        section: dict(values) if isinstance(values, dict) else values
        for section, values in raw.items()
    }
    sections = [f.name for f in dataclasses.fields(Config)]
    hints = typing.get_type_hints(Config)
    fields_of = lambda section: {f.name for f in dataclasses.fields(hints[section])}

    def check_section(section: str, values: Any) -> None:
        if section not in sections and not isinstance(values, dict):  # a key before any table
            tables = [f"[{s}]" for s in sections]
            holders = [f"[{s}]" for s in sections if section in fields_of(s)]
            where = f"put it under {' or '.join(holders)}" if holders else "no table has it"
            raise ConfigError(
                f"{section} = {values!r} is outside any table ({', '.join(tables)}): {where}"
            )
        if section not in sections:
            raise ConfigError(f"unknown section [{section}]; valid sections: {', '.join(sections)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: expected a [{section}] table, got {values!r}")

    in_file = source + ": " if source else ""
    for section, values in raw.items():  # the file's own, before overrides go into them
        try:
            check_section(section, values)
        except ConfigError as e:
            raise ConfigError(in_file + str(e)) from None
    file_raw = {section: dict(values) for section, values in raw.items()}
    overridden: dict[str, set[str]] = {}
    for i, arg in enumerate(overrides):
        after = overrides[i + 1] if i + 1 < len(overrides) else None
        section, key, value = parse_override(arg, after)
        field_types = typing.get_type_hints(hints[section]) if section in sections else {}
        if field_types.get(key) is str and not isinstance(value, str):
            # --data.name=2024 or --train.sample_prompt=true: the text as typed, not a number
            value = arg.split("=", 1)[1]
        if isinstance(value, str) and not is_utf8(value):
            raise ConfigError(f"--{section}.{key}: not valid UTF-8 text")
        raw.setdefault(section, {})[key] = value
        overridden.setdefault(section, set()).add(key)
    built = {}
    for section, values in raw.items():
        check_section(section, values)
        ours, theirs = overridden.get(section, set()), file_raw.get(section, {})
        built[section] = _build(hints[section], values, section, in_file, ours, theirs)
    return Config(**built)


def config_diff(a: Config, b: Config) -> list[tuple[str, Any, Any]]:
    """('section.field', value in a, value in b) for every field whose values differ."""
    return [
        (f"{section}.{key}", value, getattr(getattr(b, section), key))
        for section, values in dataclasses.asdict(a).items()
        for key, value in values.items()
        if value != getattr(getattr(b, section), key)
    ]


def dump_toml(config: Config) -> str:
    """The effective config, as TOML that load_config reads back to the same Config."""
    lines = []
    for section, values in dataclasses.asdict(config).items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        # JSON's escapes are TOML's; TOML also forbids a raw DEL, which JSON leaves
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    return repr(value)


def fields_help() -> str:
    """Every config field with its default, by section: the end of --help."""
    lines = ["config fields, with their built-in defaults (the --config file sets some):"]
    for section, values in dataclasses.asdict(Config()).items():
        items = " ".join(f"{key}={_toml(value)}" for key, value in values.items())
        head = f"  [{section}] "
        lines.append(
            textwrap.fill(items, 88, initial_indent=head, subsequent_indent=" " * len(head))
        )
    return "\n".join(lines)
