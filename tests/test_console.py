"""console.py: path flags, one-line errors, and a stdout that is closed or fails."""

import signal
from pathlib import Path

import pytest

from console import cannot_show, cli_path, first_line, stdout_closed


def test_stdout_closed_where_stdout_has_no_descriptor(capsys: pytest.CaptureFixture[str]) -> None:
    """In-process (a test's captured stdout, a redirect_stdout) there is no descriptor to point
    elsewhere: the status all the same, and nothing raised."""
    assert stdout_closed() == 128 + signal.SIGPIPE


def test_cli_path_expands_what_no_shell_did() -> None:
    assert cli_path("~/runs/x") == Path.home() / "runs" / "x"
    assert cli_path("~nosuchuser-xyz/x") == Path("~nosuchuser-xyz/x")  # left as typed


@pytest.mark.parametrize("command", ["prepare", "profile_train"])
def test_an_empty_path_flag_is_refused_not_read_as_the_current_folder(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Path('') is '.': `--out-root=$UNSET` wrote a corpus into the current folder, and
    `--out=` was refused as if '.' had been typed."""
    import profile_train
    from data import prepare

    monkeypatch.chdir(tmp_path)
    args = {
        "prepare": (prepare.main, ["--name", "x", "--stdlib", "--out-root="]),
        "profile_train": (profile_train.main, ["--out="]),
    }
    main, argv = args[command]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "an empty path" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_first_line_names_an_error_without_a_message() -> None:
    assert first_line(ValueError("bad value\nsecond line")) == "bad value"
    assert first_line(ValueError("  ")) == "ValueError"


def test_what_stdout_cannot_show_is_blamed_on_the_encoding_or_on_a_name() -> None:
    """A character the encoding lacks: PYTHONIOENCODING. A name given in bytes that are not
    UTF-8 (held as lone surrogates, which no encoding writes): not the encoding's fault."""

    def error(text: str, encoding: str) -> UnicodeEncodeError:
        with pytest.raises(UnicodeEncodeError) as raised:
            text.encode(encoding)
        return raised.value

    said = cannot_show(error("caf\u00e9", "ascii"), "the text")
    assert (
        said
        == "stdout's encoding, ascii, cannot show the text ('\u00e9'); set PYTHONIOENCODING=utf-8"
    )
    for encoding in ("utf-8", "ascii"):
        said = cannot_show(error("runs/\udcffx", encoding), "a line")
        assert (
            said == "a line holds '\\udcff', bytes of a name that are not UTF-8; give UTF-8 names"
        )
