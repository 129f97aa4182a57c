"""The terminal side of the command-line tools: path flags, one-line errors, and stdout that
may be closed (`| head`) or fail (`> file` on a full disk).

It imports no torch, so data/prepare.py shares it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO


def first_line(error: BaseException) -> str:
    """An error's message in one line: its first, or its type's name where it has none."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def one_line(error: BaseException) -> str:
    """An error's type and the first line of its message, 'ValueError: ...'; its type alone
    where it has no message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def quiet_profiler_start() -> None:
    """Keep libkineto's "USDT: profiler_start/stop" lines off stderr, where each profile
    would print them through a progress bar. Read once per process, at the first profile; a
    user's own KINETO_LOG_LEVEL wins. Only where kineto has nothing else to say (CPU, and a
    probe's CPU-only trace): on CUDA its messages explain missing kernels (CUPTI errors)."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def cli_path(text: str) -> Path:
    """A path flag's value: ~ expanded, as no shell does after '=' (--out=~/runs/x); one that
    cannot be (~nosuchuser) is left as typed. An empty one (--out=, or "$UNSET") is an error,
    not the current folder, which is what Path('') means."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path; give a folder or file")
    return Path(os.path.expanduser(text))


def is_utf8(text: str) -> bool:
    """False for the lone surrogates Python decodes invalid UTF-8 in argv into."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def cannot_show(e: UnicodeEncodeError, what: str) -> str:
    """Why `what` could not be written to stdout, and the fix: a character its encoding lacks
    (PYTHONIOENCODING), or bytes of a name given on the command line that are not UTF-8, which
    Python holds as lone surrogates and no encoding writes."""
    chars = e.object[e.start : e.end]
    if not is_utf8(chars):
        return f"{what} holds {chars!r}, bytes of a name that are not UTF-8; give UTF-8 names"
    return (
        f"stdout's encoding, {e.encoding}, cannot show {what} ({chars!r}); "
        "set PYTHONIOENCODING=utf-8"
    )


class Droppable:
    """A stream whose failed writes are dropped, not raised, and after the first, not tried:
    for progress bars, which must not stop the work they show where stderr is gone
    (`2>&1 | head`) or full (`2>/dev/full`). `error` is the first failure (None: none yet);
    `on_failure`, if set, is called once, then. `lines`: each line is flushed as it is written
    (a pipe's stream is otherwise written 8 KiB at a time: `| tee` would show a run's lines
    late, and a reader gone would be found that late)."""

    def __init__(self, stream: TextIO, lines: bool = False) -> None:
        self.stream = stream
        self.error: OSError | ValueError | None = None  # ValueError: a stream already closed
        self.on_failure: Callable[[], None] | None = None
        self._lines = lines

    @property
    def failed(self) -> bool:
        return self.error is not None

    def write(self, text: str) -> int:
        if not self.failed:
            try:
                self.stream.write(text)
                if self._lines and "\n" in text:
                    self.stream.flush()
            except UnicodeEncodeError:  # the text, not the stream: the caller's to say
                raise
            except (OSError, ValueError) as e:
                self._fail(e)
        return len(text)

    def flush(self) -> None:
        if not self.failed:
            try:
                self.stream.flush()
            except (OSError, ValueError) as e:
                self._fail(e)

    def _fail(self, error: OSError | ValueError) -> None:
        self.error = error
        if self.on_failure is not None:
            self.on_failure()

    def __getattr__(self, name: str) -> Any:  # isatty, encoding, fileno: the stream's
        return getattr(self.stream, name)


@contextlib.contextmanager
def dropping(name: str, lines: bool = False) -> Iterator[Droppable]:
    """sys.stdout or sys.stderr (`name`) written through a Droppable while inside. The stream
    comes back on the way out, pointed at /dev/null where a write to it failed: the bytes it
    could not write stay in its buffer, and Python's flush at exit would fail on them again
    (status 120, and "Exception ignored" on stderr)."""
    stream = getattr(sys, name)
    dropped = Droppable(stream, lines)
    setattr(sys, name, dropped)
    try:
        yield dropped
    finally:
        setattr(sys, name, stream)
        if dropped.failed:
            _to_devnull(stream)


def _to_devnull(stream: TextIO) -> None:
    with contextlib.suppress(OSError, ValueError):  # a replaced stream (a test's): no descriptor
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)


class StdoutClosed(Exception):
    """stdout cannot be written to: its reader has gone (`| head`: it took what it wanted; no
    error to report), or the write failed (`> file` on a full disk: `error` says why)."""

    def __init__(self, error: OSError | None = None) -> None:
        super().__init__(error)
        self.error = error

    @classmethod
    def after(cls, failed: OSError | ValueError) -> StdoutClosed:
        """The one a failed write to stdout means: a broken pipe, or a stream already closed
        (ValueError), is a reader gone; any other error is said."""
        gone = isinstance(failed, BrokenPipeError) or not isinstance(failed, OSError)
        return cls(None if gone else failed)


def say(text: str = "", end: str = "\n") -> None:
    """print() to stdout, flushed, where a failed write raises StdoutClosed: only stdout's,
    not a worker process's broken pipe."""
    try:
        print(text, end=end, flush=True)
    except OSError as e:
        raise StdoutClosed.after(e) from None


def stdout_closed(closed: StdoutClosed | None = None) -> int:
    """The exit status after StdoutClosed: the shell's for SIGPIPE where the reader went, 2
    with an error where a write failed. Where stdout is a file descriptor, it is pointed at
    /dev/null, so Python's flush at exit does not fail again (as Python's signal documentation
    advises)."""
    _to_devnull(sys.stdout)
    if closed is not None and closed.error is not None:
        why = closed.error.strerror or closed.error
        try:
            print(
                f"error: cannot write to stdout ({why}); the output is cut short", file=sys.stderr
            )
        except (OSError, ValueError):  # `> log 2>&1` on a full disk: stderr fails too
            _to_devnull(sys.stderr)  # its line waits in its buffer, to fail again at exit
        return 2
    return 128 + signal.SIGPIPE
