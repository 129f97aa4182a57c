"""A sweep's progress bar: moved by steps, each weighted by its cell's depth."""

from __future__ import annotations

from typing import Self

from tqdm import tqdm

from profiling.cells import Cell


class Progress:
    """A depth's cells finish together, after their interleaved rounds: the bar moves by steps
    instead, each weighted by n_layer + 1, about what an eager step costs (its fixed part,
    embeddings, head and loss, near one layer's), so the time left holds from the first depth
    on; counted in cells, it would show about half the time still to come. (Compiling, about
    as long at every depth, is not weighed: a compiled sweep's first depth takes more than its
    share.)
    """

    def __init__(
        self, layers: list[int], cells_per_depth: int, steps_per_cell: int, planned: int
    ) -> None:
        self.steps_per_cell, self.planned = steps_per_cell, planned
        self.bar = tqdm(
            total=sum((n_layer + 1) * steps_per_cell * cells_per_depth for n_layer in layers),
            desc="sweep",
            dynamic_ncols=True,
            mininterval=1.0,  # a step takes ~0.1 s: redrawn at each, a log fills with bars
            bar_format="{l_bar}{bar}| [{elapsed}<{remaining}{postfix}]",
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        # Closed on Ctrl-C too, so the message after it starts on a line of its own.
        self.bar.close()

    def advance(self, cell: Cell, steps: int | None = None) -> None:
        """Move by `steps` of the cell's steps (None: the ones it has yet to show)."""
        steps = self.steps_per_cell - cell.done if steps is None else steps
        cell.done += steps
        self.bar.update(steps * (cell.n_layer + 1))

    def say(self, recorded: int, doing: str = "") -> None:
        """The bar's words: the cells recorded so far (a row each), and what it is doing now."""
        done = f"{recorded}/{self.planned} cells"
        self.bar.set_postfix_str(f"{done}, {doing}" if doing else done)
