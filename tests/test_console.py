"""console.py: path flags, one-line errors, and a stdout that is closed or fails."""

import signal
from pathlib import Path

import pytest

from console import cli_path, first_line, stdout_closed


def test_stdout_closed_where_stdout_has_no_descriptor(capsys: pytest.CaptureFixture[str]) -> None:
    """In-process (a test's captured stdout, a redirect_stdout) there is no descriptor to point
    elsewhere: the status all the same, and nothing raised."""
    assert stdout_closed() == 128 + signal.SIGPIPE


def test_cli_path_expands_what_no_shell_did() -> None:
    assert cli_path("~/runs/x") == Path.home() / "runs" / "x"
    assert cli_path("~nosuchuser-xyz/x") == Path("~nosuchuser-xyz/x")  # left as typed


def test_first_line_names_an_error_without_a_message() -> None:
    assert first_line(ValueError("bad value\nsecond line")) == "bad value"
    assert first_line(ValueError("  ")) == "ValueError"
