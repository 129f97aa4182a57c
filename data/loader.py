"""Batches for training: random windows of the token files that data/prepare.py writes.

Imports only numpy and torch, so it runs where `datasets` and `tokenizers` are absent.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor


class DataError(RuntimeError):
    """A prepared corpus that is missing or too small for the run."""


def load_meta(root: str | Path, name: str, vocab_size: int | None = None) -> dict[str, Any]:
    """The corpus's meta.json; the error for a missing one says how to prepare it."""
    path = Path(root) / name / "meta.json"
    if not path.is_file():
        raise DataError(
            f"no prepared corpus at {path.parent}/ (missing meta.json); prepare it first, e.g. "
            f"{prepare_command(path.parent, vocab_size)}"
        )
    try:
        meta = json.loads(path.read_text())
        # What a run reads from it: token and byte counts, the tokenizer's size and hash.
        counts = [meta["splits"][s][k] for s in ("train", "val") for k in ("tokens", "bytes")]
        counts += [meta["vocab_size"], len(meta["tokenizer_sha256"])]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise DataError(
            f"{path} is damaged ({type(e).__name__}: {e}); {_redo(path.parent)}"
        ) from None
    if not all(isinstance(n, int) and n >= 0 for n in counts):
        raise DataError(f"{path} is damaged (counts {counts}); {_redo(path.parent)}")
    if not (path.parent / "tokenizer.json").is_file():
        raise DataError(
            f"{path.parent}/ has no tokenizer.json (a corpus folder copied in part?): copy it "
            f"whole, or {_redo(path.parent)}"
        )
    return meta


def prepare_command(corpus: Path, vocab_size: int | None = None) -> str:
    """A command that makes the corpus folder `corpus` (from the stdlib, the offline source)."""
    vocab = ["--vocab-size", str(vocab_size)] if vocab_size is not None else []
    return _command(corpus, ["--stdlib", *vocab])


def _command(corpus: Path, args: list[str]) -> str:
    """data/prepare.py with `args`, writing the corpus folder `corpus`."""
    out_root = [] if corpus.parent == Path("data") else ["--out-root", str(corpus.parent)]
    words = ["--name", corpus.name, *args, *out_root]
    return "python data/prepare.py " + " ".join(map(shlex.quote, words))


def _redo(corpus: Path) -> str:
    """How to make the corpus in folder `corpus` again: from the source and settings its
    meta.json records, where it can be read (a --files or --hub corpus rebuilt from the
    stdlib would be another corpus), else an example."""
    try:
        meta = json.loads((corpus / "meta.json").read_text())
        command = _rebuild_command(corpus, meta["source"], meta["settings"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"prepare the corpus again from its source, e.g. {prepare_command(corpus)}"
    return f"prepare the corpus again from its source: {command}"


def _rebuild_command(corpus: Path, source: dict[str, Any], settings: dict[str, Any]) -> str:
    """The data/prepare.py command line that made this corpus."""
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
    """What keeps `path` from being a whole uint16 token file (of `expected_tokens`, where
    meta.json says how many), or None."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path} is missing"
    if size % 2 or (expected_tokens is not None and size != 2 * expected_tokens):
        said = (
            f", not the {expected_tokens:,} meta.json says" if expected_tokens is not None else ""
        )
        tokens = f"{size // 2:,}{'.5' * (size % 2)}"
        return f"{path} is damaged: {size:,} bytes is {tokens} uint16 tokens{said}"
    if size == 0:  # np.memmap cannot map an empty file
        return f"{path} holds no tokens"
    return None


def check_vocab(meta: dict[str, Any], vocab_size: int, name: str) -> None:
    """Every token id of the corpus must have a row in the model's embedding."""
    if meta["vocab_size"] > vocab_size:
        raise DataError(
            f"model.vocab_size={vocab_size} is smaller than the tokenizer of corpus "
            f"'{name}' ({meta['vocab_size']} tokens)"
        )


class TokenBatches:
    """Random windows of a uint16 token file, as (x, y) batches shifted by one token.

    Every rank draws the same world_size x batch_size offsets from one seeded generator and
    keeps its own rows: each rank reads its own share of every global batch, and a single
    process with world_size x batch_size rows sees exactly what the ranks see together.
    """

    def __init__(
        self,
        path: Path,
        block_size: int,
        batch_size: int,
        seed: int,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        expected_tokens: int | None = None,
    ) -> None:
        """`expected_tokens`: what meta.json says the file holds; checked against its size."""
        problem = token_file_problem(path, expected_tokens)
        if problem is not None:
            raise DataError(f"{problem}; {_redo(path.parent)}")
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        if len(self.tokens) < block_size + 1:
            raise DataError(
                f"{path} holds {len(self.tokens)} tokens, fewer than block_size + 1 = "
                f"{block_size + 1}: prepare a larger corpus or lower model.block_size"
            )
        if batch_size * world_size * block_size > len(self.tokens):
            # Not wrong as sampling, but surely a typo: and the rows are gathered in host
            # memory before the device, which a batch of 10^8 rows fills.
            raise DataError(
                f"train.batch_size={batch_size} x {world_size} rank(s) x model.block_size="
                f"{block_size} is {batch_size * world_size * block_size:,} tokens a batch, more "
                f"than {path} holds ({len(self.tokens):,}): lower train.batch_size"
            )
        self.block_size, self.batch_size = block_size, batch_size
        self.rank, self.world_size, self.device = rank, world_size, device
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[Tensor, Tensor]:
        n = self.batch_size * self.world_size
        starts = torch.randint(len(self.tokens) - self.block_size, (n,), generator=self.generator)
        starts = starts[self.rank * self.batch_size : (self.rank + 1) * self.batch_size].tolist()
        rows = np.stack([self.tokens[s : s + self.block_size + 1] for s in starts]).astype(np.int64)
        xy = torch.from_numpy(rows)
        if self.device.type == "cuda":
            xy = xy.pin_memory().to(self.device, non_blocking=True)
        else:
            xy = xy.to(self.device)
        return xy[:, :-1], xy[:, 1:]  # (B, T) each

    def restart(self) -> None:
        self.generator.manual_seed(self.seed)

    def state_dict(self) -> dict[str, Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.generator.set_state(state["generator"])
