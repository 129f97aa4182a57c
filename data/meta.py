"""A prepared corpus's folder as its readers see it: meta.json, the token files' sizes, and
the data/prepare.py command that makes it (again).

Imports only the standard library, so it runs where `datasets` and `tokenizers` are absent.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from pathlib import Path
from typing import Any

PROJECT = Path(__file__).resolve().parents[1]

EOT = "<|endoftext|>"  # the separator prepare.py puts between documents, a special token
EOT_ID = 0  # the tokenizer trainer gives special tokens the first ids
MIN_VOCAB_SIZE = 256 + 1  # a byte-level tokenizer's least: every byte, plus EOT
TOKEN_DTYPE = "uint16"  # meta.json's "dtype": what the token files hold
TOKEN_BYTES = 2  # of a TOKEN_DTYPE id
MAX_VOCAB_SIZE = 2 ** (8 * TOKEN_BYTES)  # every id fits a TOKEN_DTYPE
CORPUS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a plain folder name under data.root
CORPUS_NAME_RULE = "a plain folder name: a letter or digit, then letters, digits, '.', '_' or '-'"


class DataError(RuntimeError):
    """A prepared corpus that is missing or too small for the run."""


def corpus_name_problem(name: str) -> str | None:
    """What is wrong with data.name=`name`, or None for a plain folder name."""
    if CORPUS_NAME.fullmatch(name):
        return None
    return f"data.name={name!r}: a corpus name must be {CORPUS_NAME_RULE}"


def load_meta(root: str | Path, name: str, vocab_size: int | None = None) -> dict[str, Any]:
    """The corpus's meta.json; the error for a missing one says how to prepare it. `name`
    must be a plain folder name: a path would read outside `root`, or the root itself."""
    if (problem := corpus_name_problem(name)) is not None:
        raise DataError(problem)
    path = Path(root) / name / "meta.json"
    if os.path.isfile(root):  # else the hint would prepare into --out-root FILE, which fails
        raise DataError(f"data.root {str(root)!r} is a file; give the folder of corpora")
    if not path.is_file():
        too_few = vocab_size is not None and vocab_size < MIN_VOCAB_SIZE
        raise DataError(
            f"no prepared corpus at {path.parent}/{_outside_note(path)} (missing meta.json); "
            f"prepare it first, e.g. {prepare_command(path.parent, vocab_size)}"
            + (
                f"; and model.vocab_size={vocab_size} is below the {MIN_VOCAB_SIZE} tokens any "
                "byte-level tokenizer has: raise it"
            )
            * too_few
        )
    try:
        meta = json.loads(path.read_text())
        # What a run reads from it: token and byte counts, the tokenizer's size and hash, the
        # content's hash (its checkpoints record it).
        counts = [meta["splits"][s][k] for s in ("train", "val") for k in ("tokens", "bytes")]
        counts += [meta["vocab_size"], len(meta["tokenizer_sha256"]), len(meta["content_sha256"])]
    except OSError as e:
        raise DataError(f"cannot read {path} ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise DataError(
            f"{path} is damaged ({type(e).__name__}: {e}); {rebuild_hint(path.parent)}"
        ) from None
    if not all(isinstance(n, int) and n >= 0 for n in counts):
        raise DataError(f"{path} is damaged (counts {counts}); {rebuild_hint(path.parent)}")
    if not holds_token_dtype(meta):
        raise DataError(
            f"{path} says its token files hold {meta['dtype']!r}; this project reads "
            f"{TOKEN_DTYPE} token files, as data/prepare.py writes them: "
            + rebuild_hint(path.parent)
        )
    tokenizer = path.parent / "tokenizer.json"
    if not tokenizer.is_file():
        raise DataError(
            f"{path.parent}/ has no tokenizer.json (a corpus folder copied in part?): copy it "
            f"whole, or {rebuild_hint(path.parent)}"
        )
    # A run copies it to decode its samples: one damaged here would be copied over its good one.
    try:
        digest = file_sha256(tokenizer)
    except OSError as e:
        raise DataError(f"cannot read {tokenizer} ({e.strerror or e})") from None
    if digest != meta["tokenizer_sha256"]:
        raise DataError(
            f"{tokenizer} is not the tokenizer {path.name} records (sha256 {digest[:12]}, "
            f"not {str(meta['tokenizer_sha256'])[:12]}): it is damaged or was replaced; "
            + rebuild_hint(path.parent)
        )
    return meta


def holds_token_dtype(meta: dict[str, Any]) -> bool:
    """Whether meta.json's token files are of TOKEN_DTYPE, the one the loader maps them as (a
    meta.json without "dtype" is an older prepare's, which wrote the same)."""
    return meta.get("dtype", TOKEN_DTYPE) == TOKEN_DTYPE


def file_sha256(path: Path) -> str:
    """The hex sha256 of the file at `path`, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def prepare_command(corpus: Path, vocab_size: int | None = None) -> str:
    """A command that makes the corpus folder `corpus` (from the stdlib, the offline source),
    with a tokenizer of the model's `vocab_size` where one can have it, else the most it can
    (a model's vocabulary may be larger than its tokenizer's, as GPT-2's 50304 is)."""
    vocab = (
        []
        if vocab_size is None or vocab_size < MIN_VOCAB_SIZE
        else ["--vocab-size", str(min(vocab_size, MAX_VOCAB_SIZE))]
    )
    return _command(corpus, ["--stdlib", *vocab])


def _command(corpus: Path, args: list[str]) -> str:
    """data/prepare.py with `args`, writing the corpus folder `corpus`."""
    out_root = [] if corpus.parent == Path("data") else ["--out-root", str(corpus.parent)]
    words = [_prepare_script(), "--name", corpus.name, *args, *out_root]
    return "python " + " ".join(map(shlex.quote, words))


def _outside_note(path: Path) -> str:
    """Where a relative path was looked for, when that is not the project's folder."""
    if path.is_absolute() or Path.cwd().resolve() == PROJECT:
        return ""
    return f", relative to {Path.cwd()}"


def _prepare_script() -> str:
    """data/prepare.py as this directory reaches it: relative paths in configs (data.root)
    are the working directory's, so the command must run from here too."""
    script = Path(__file__).resolve().with_name("prepare.py")
    try:
        return str(script.relative_to(Path.cwd().resolve()))
    except ValueError:  # run from outside the project
        return str(script)


def rebuild_hint(corpus: Path) -> str:
    """How to make the corpus in folder `corpus` again: from the source and settings its
    meta.json records, where it can be read (a --files or --hub corpus rebuilt from the
    stdlib would be another corpus), else an example."""
    try:
        meta = json.loads((corpus / "meta.json").read_text())
        command = rebuild_command(corpus, meta["source"], meta["settings"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"prepare the corpus again from its source, e.g. {prepare_command(corpus)}"
    return f"prepare the corpus again from its source: {command}"


def rebuild_command(corpus: Path, source: dict[str, Any], settings: dict[str, Any]) -> str:
    """The data/prepare.py command line that made this corpus (meta.json's "source" and
    "settings"), writing it to folder `corpus`."""
    kind = settings["kind"]
    if kind == "stdlib":
        args = ["--stdlib"]
    elif kind == "files":
        args = ["--files", *source["patterns"]]
    else:
        args = ["--hub", source.get("dataset", settings["hub"])]
        if settings["hub_config"] is not None:
            args += ["--hub-config", settings["hub_config"]]
        args += ["--split", settings["split"], "--text-column", settings["text_column"]]
    args += ["--vocab-size", str(settings["vocab_size"])]
    args += ["--val-fraction", str(settings["val_fraction"]), "--seed", str(settings["seed"])]
    if settings["max_bytes"] is not None:
        args += ["--max-bytes", str(settings["max_bytes"])]
    if settings.get("encoding_errors", "strict") != "strict":
        args += ["--encoding-errors", settings["encoding_errors"]]
    return _command(corpus, args)


def token_file_problem(path: Path, expected_tokens: int | None = None) -> str | None:
    """What keeps `path` from being a whole token file of TOKEN_DTYPE ids (`expected_tokens`
    of them, where meta.json says how many), or None."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path} is missing"
    if path.is_dir():
        return f"{path} is a folder, not a token file"
    whole, part = divmod(size, TOKEN_BYTES)
    if part or (expected_tokens is not None and whole != expected_tokens):
        said = (
            f", not the {expected_tokens:,} meta.json says" if expected_tokens is not None else ""
        )
        tokens = f"{size / TOKEN_BYTES:,.2f}".rstrip("0").rstrip(".")  # 49.5, or 50
        return f"{path} is damaged: {size:,} bytes is {tokens} {TOKEN_DTYPE} tokens{said}"
    if size == 0:  # np.memmap cannot map an empty file
        return f"{path} holds no tokens"
    return None


def check_vocab(meta: dict[str, Any], vocab_size: int, name: str) -> None:
    """Every token id of the corpus must have a row in the model's embedding."""
    if meta["vocab_size"] > vocab_size:
        raise DataError(
            f"model.vocab_size={vocab_size} is smaller than the tokenizer of corpus "
            f"'{name}' ({meta['vocab_size']} tokens): give --model.vocab_size="
            f"{meta['vocab_size']} or more (a multiple of 64 runs faster"
            + (
                f"), or prepare the corpus with --vocab-size {vocab_size}"
                if vocab_size >= MIN_VOCAB_SIZE
                else f"; a byte-level tokenizer has at least {MIN_VOCAB_SIZE})"
            )
        )
