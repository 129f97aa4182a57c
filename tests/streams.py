"""Stand-ins for stdout and stderr whose writes fail, as a closed pipe or a full disk makes them."""

from __future__ import annotations

import errno
import io


class FullDisk(io.StringIO):
    """A stream whose writes fail as one on a full disk does (`> file`, `2>/dev/full`)."""

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


class ReaderTakesLines(io.StringIO):
    """stdout read by `head -N`: after N lines, a write fails as a closed pipe's (or a full
    disk's) does."""

    def __init__(self, lines: int, error: OSError) -> None:
        super().__init__()
        self.lines, self.error = lines, error

    def write(self, text: str) -> int:
        if self.getvalue().count("\n") >= self.lines:
            raise self.error
        return super().write(text)
