"""Batches for training: random windows of the token files that data/prepare.py writes.

Imports only numpy and torch, so it runs where `datasets` and `tokenizers` are absent.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from data.meta import TOKEN_DTYPE, DataError, rebuild_hint, token_file_problem


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
        whole_batches: bool = True,
        vocab_size: int | None = None,
    ) -> None:
        """`expected_tokens`: what meta.json says the file holds; checked against its size.
        `whole_batches`: refuse a batch of more tokens than the file holds (a typo, in the
        split training draws from; the windows of a small val split may overlap).
        `vocab_size`: the tokenizer's; a batch holding an id at or above it is an error (a file
        of the right size but damaged), where the embedding would fail with an IndexError."""
        problem = token_file_problem(path, expected_tokens)
        if problem is not None:
            raise DataError(f"{problem}; {rebuild_hint(path.parent)}")
        self.tokens = np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
        if len(self.tokens) < block_size + 1:
            raise DataError(
                f"{path} holds {len(self.tokens)} tokens, fewer than block_size + 1 = "
                f"{block_size + 1}: prepare a larger corpus or lower model.block_size"
            )
        if whole_batches and batch_size * world_size * block_size > len(self.tokens):
            # Not wrong as sampling, but surely a typo: and the rows are gathered in host
            # memory before the device, which a batch of 10^8 rows fills.
            raise DataError(
                f"train.batch_size={batch_size} x {world_size} rank(s) x model.block_size="
                f"{block_size} is {batch_size * world_size * block_size:,} tokens a batch, more "
                f"than {path} holds ({len(self.tokens):,}): lower train.batch_size"
            )
        self.block_size, self.batch_size = block_size, batch_size
        self.rank, self.world_size, self.device = rank, world_size, device
        self.seed, self.vocab_size, self.path = seed, vocab_size, path
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[Tensor, Tensor]:
        n = self.batch_size * self.world_size
        starts = torch.randint(len(self.tokens) - self.block_size, (n,), generator=self.generator)
        starts = starts[self.rank * self.batch_size : (self.rank + 1) * self.batch_size].tolist()
        rows = np.stack([self.tokens[s : s + self.block_size + 1] for s in starts]).astype(np.int64)
        if self.vocab_size is not None and rows.max() >= self.vocab_size:  # microseconds, on host
            row, col = np.unravel_index(rows.argmax(), rows.shape)
            raise DataError(
                f"{self.path} is damaged: token {starts[row] + col:,} is id {rows[row, col]}, "
                f"beyond its tokenizer's {self.vocab_size} ids; {rebuild_hint(self.path.parent)}"
            )
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
