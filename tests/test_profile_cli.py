"""profile_train.py's arguments and output streams, and the scripts beside it (op_diff,
after_profiler, gpu_check)."""

from __future__ import annotations

import datetime as dt
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import profile_train
from streams import FullDisk, ReaderTakesLines
from sweeps import ROOT, TINY, sweep

# The stand-ins of sweeps.py, for every test here.
pytestmark = pytest.mark.usefixtures("quick_peak", "flops_counted_once", "plots_unrendered")


@pytest.mark.parametrize("flag", ["--variants=naive,sdpa,naive", "--layers=1,2,1"])
def test_a_variant_or_depth_given_twice_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    assert profile_train.main(["--out", str(tmp_path / "s"), flag, *TINY]) == 2
    err = capsys.readouterr().err
    assert flag.split("=")[0] in err and "more than once" in err
    assert not (tmp_path / "s").exists()


def test_unknown_variants_are_each_named_with_the_closest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--out", str(tmp_path / "s"), "--variants=sdpa_flash,naive,xyz", *TINY]
    assert profile_train.main(argv) == 2
    err = capsys.readouterr().err
    assert "--variants: unknown attention variants 'sdpa_flash' (did you mean 'sdpa-flash'?)" in err
    assert ", 'xyz'; valid choices: naive, inplace, sdpa," in err
    assert not (tmp_path / "s").exists()


def test_bad_arguments_name_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc, _ = sweep(tmp_path, "--variants", "naive,flash9")
    assert rc == 2 and "flash9" in capsys.readouterr().err
    rc, _ = sweep(tmp_path, "--layers", "0,2")
    assert rc == 2 and "--layers" in capsys.readouterr().err
    rc, _ = sweep(tmp_path, "--model.n_heads=3")
    assert rc == 2 and "model.n_heads" in capsys.readouterr().err
    # Only variants that cannot run here: refused at once, with each one's reason.
    rc, _ = sweep(tmp_path, "--variants", "flex,sdpa-cudnn")
    err = capsys.readouterr().err
    assert rc == 2 and "--variants: none can run on cpu (float32)" in err
    assert "flex: PyTorch has no flex_attention backward" in err and "sdpa-cudnn: " in err
    bad = [
        ("--layers", "1,a"),
        ("--trace-layers", "1,x"),
        ("--trace-layers", "4"),  # not among --layers
        ("--trace-layers", ""),  # not "all": --no-traces is none
        ("--steps", "0"),
        ("--peak-seconds", "nan"),
        ("--variants", ""),
        ("--variants", "naive,,sdpa"),
        ("--layers", "1,2,"),
        ("--diff", "inplace,naive"),  # needs --report
        ("--model.n_layer=3", None),  # the sweep sets n_layer itself
        ("--train.compile=true", None),  # --compile decides, per cell
        ("--data.name=stdlib", None),  # --data decides
        ("--data.root=/corpora", None),  # read for --data NAME only
        ("--train.warmup_steps=0", None),  # the sweep has no schedule: --warmup is its own
        ("--train.peak_tflops=989", None),  # MFU is against the peak measured
        ("--data", "../data/tiny"),  # a path: outside data.root
        ("--data=", None),
    ]
    for flag, value in bad:
        rc, _ = sweep(tmp_path, "--layers", "1", flag, *([value] if value is not None else []))
        err = capsys.readouterr().err
        assert rc == 2 and flag.split("=")[0].split(".")[-1] in err, err
        assert "Traceback" not in err, err
    rc, _ = sweep(tmp_path, "--layers", "1,2", "--trace-layers", "2,4")
    assert "--trace-layers=2,4: 4 not among --layers=1,2" in capsys.readouterr().err
    for given in (["--trace-layers", "1"], ["--trace-stacks"]):
        rc, _ = sweep(tmp_path, "--layers", "1", "--no-traces", *given)
        err = capsys.readouterr().err
        assert rc == 2 and f"{given[0]} with --no-traces: no trace is written" in err, err
    rc, _ = sweep(tmp_path, "--layers", "1", "--data.name=stdlib")
    assert "--data synthetic or --data NAME" in capsys.readouterr().err
    rc, _ = sweep(tmp_path, "--layers", "1", "--data.root=/corpora")
    assert (
        "a sweep on --data synthetic reads no corpus; give --data NAME" in capsys.readouterr().err
    )
    rc, _ = sweep(tmp_path, "--layers", "1", "--train.warmup_steps=0")
    assert "the sweep does not use it; its steps run at train.lr" in capsys.readouterr().err
    assert not (tmp_path / "sweep").exists(), "bad input wrote nothing"
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "notes.txt").write_text("mine")
    rc, _ = sweep(tmp_path)
    assert rc == 2 and "not an empty folder" in capsys.readouterr().err
    # A lock no process holds (a sweep killed before it wrote anything) leaves it empty
    (tmp_path / "sweep" / "notes.txt").unlink()
    (tmp_path / "sweep" / ".lock").write_text("12345\n")
    profile_train._check_new_out(tmp_path / "sweep")


def test_help_names_every_config_field_a_sweep_refuses(capsys: pytest.CaptureFixture) -> None:
    """--help lists the config fields; those the sweep sets itself or does not use are named in
    its epilog, so no override's refusal comes as a surprise."""
    with pytest.raises(SystemExit):
        profile_train.parse_args(["--help"])
    epilog = capsys.readouterr().out.split("Any config field can be overridden")[1]
    for flag in profile_train.SWEEP_SETS:
        assert flag.split(".")[-1] in epilog.split("config fields, with")[0], flag


def test_compile_follows_the_config_unless_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A config that trains compiled (gpt2-small.toml) is profiled compiled; --compile wins, and
    what results.json records of the config is what the cells ran."""
    seen = []

    def run(self, variants, layers, compile_modes):
        seen.append((compile_modes, self.config.train.compile, self.meta["compile"]))
        self.out.mkdir()
        (self.out / "summary.txt").write_text("")
        self.rows.append({"status": "ok"})  # a cell measured: exit 0

    monkeypatch.setattr(profile_train.Sweep, "run", run)
    config = tmp_path / "compiled.toml"
    text = (ROOT / "configs" / "profile.toml").read_text()
    config.write_text(text.replace("[train]\n", "[train]\ncompile = true\n"))
    base = ["--config", str(config), "--variants", "naive", "--layers", "1", *TINY]
    for extra, out in [([], "a"), (["--compile", "off"], "b"), (["--compile", "both"], "c")]:
        assert profile_train.main([*base, *extra, "--out", str(tmp_path / out)]) == 0
        said = "compiled cells only, as " in capsys.readouterr().err
        assert said == (not extra), extra
    default = ["--variants", "naive", "--layers", "1", *TINY, "--out", str(tmp_path / "d")]
    assert profile_train.main(["--config", str(ROOT / "configs" / "profile.toml"), *default]) == 0
    assert seen == [
        ([True], True, "on"),
        ([False], False, "off"),
        ([False, True], True, "both"),
        ([False], False, "off"),
    ]


def test_bad_arguments_leave_no_default_output_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    config = str(ROOT / "configs" / "profile.toml")
    assert profile_train.main(["--config", config, "--layers", "0"]) == 2
    assert not (tmp_path / "profiles").exists()
    quick = ["--variants", "naive", "--layers", "1", "--steps", "1", "--warmup", "1", *TINY]
    assert profile_train.main(["--config", config, *quick, "--peak-seconds", "0.02"]) == 0
    assert (tmp_path / "profiles" / "profile" / "latest" / "results.json").is_file()
    # A `latest` that is not the tool's link (a file put there) is kept, and said so
    latest = tmp_path / "profiles" / "profile" / "latest"
    latest.unlink()
    latest.write_text("mine")
    capsys.readouterr()
    assert profile_train.main(["--config", config, *quick, "--peak-seconds", "0.02"]) == 0
    assert latest.read_text() == "mine"
    assert "warning: profiles/profile/latest is not a link" in capsys.readouterr().err


def test_sweeps_started_in_the_same_second_get_folders_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    config, now = Path("configs/profile.toml"), dt.datetime(2026, 11, 30, 12, 0, 0)
    first = profile_train._default_out(config, now)
    assert first == Path("profiles/profile/20261130-120000")
    first.mkdir(parents=True)
    assert profile_train._default_out(config, now) == first.with_name("20261130-120000-2")
    # Both chose the name before either made it: the second to make it stops, and writes nothing.
    monkeypatch.setattr(profile_train, "_default_out", lambda *args: first)
    argv = ["--config", str(ROOT / config), "--variants", "naive", "--layers", "1", *TINY]
    assert profile_train.main(argv) == 2
    assert "taken by another sweep started at the same time" in capsys.readouterr().err
    assert not any(first.iterdir())


def test_earlier_sweep_is_not_overwritten(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert sweep(tmp_path, "--variants", "naive", "--layers", "1", "--no-traces")[0] == 0
    before = (tmp_path / "sweep" / "results.json").read_bytes()
    rc, _ = sweep(tmp_path, "--variants", "inplace", "--layers", "1")
    assert rc == 2 and "earlier sweep" in capsys.readouterr().err
    assert (tmp_path / "sweep" / "results.json").read_bytes() == before


def test_a_stderr_that_fails_costs_its_lines_not_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`profile_train.py 2>/dev/full`: the progress bar and notes are lost, the sweep is not.
    (A failed write there used to stop the sweep as a full disk for its results does, and
    its error line then failed too: status 1, nothing written.)"""
    monkeypatch.setattr(sys, "stderr", FullDisk())
    rc, results = sweep(tmp_path, "--variants", "naive", "--layers", "1", "--no-traces")
    assert rc == 0 and [r["status"] for r in results["rows"]] == ["ok"]
    assert "report: " in capsys.readouterr().out


def test_a_report_piped_into_a_reader_that_has_gone_ends_quietly(tmp_path: Path) -> None:
    """`profile_train.py --report DIR | head -0`: the report is written, then printing to the
    closed pipe ends with the shell's status for SIGPIPE (128 + 13), no traceback or error."""
    copy = Path(shutil.copytree(ROOT / "docs/results/cpu-2core", tmp_path / "sweep"))
    argv = [sys.executable, str(ROOT / "profile_train.py"), "--report", str(copy)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # the reader is gone before anything is printed
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 128 + signal.SIGPIPE, err
    assert err == "", err
    assert (copy / "report.md").read_bytes() == (
        ROOT / "docs/results/cpu-2core/report.md"
    ).read_bytes()


def test_tf32_off_cuda_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, results = sweep(tmp_path, "--variants", "naive", "--layers", "1", "--train.dtype=tf32")
    assert rc == 2 and not results
    assert "train.dtype='tf32': TF32 tensor cores are a CUDA feature" in capsys.readouterr().err
    assert not (tmp_path / "sweep").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it would run the whole check")
def test_a_gpu_check_without_cuda_says_so_and_touches_nothing(tmp_path: Path) -> None:
    """A warm machine keeps OUT between calls: a rerun moves the earlier run aside, whole,
    rather than have the sweeps refuse the folder and the log overwritten. Without CUDA, as
    here, the check stops first, with one line that says why, and moves or makes nothing."""
    out = tmp_path / "gc"
    out.mkdir()
    (out / "gpu_check.log").write_text("the earlier run's log")
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"error: no CUDA GPU for {sys.executable} here (torch missing, a CPU build, or no GPU); "
        "PYTHON=... picks another python"
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["gc"]
    assert (out / "gpu_check.log").read_text() == "the earlier run's log"


def test_a_gpu_check_moves_aside_only_an_earlier_gpu_checks_folder(tmp_path: Path) -> None:
    """OUT holding other files (a results folder, a home directory) is refused, not renamed:
    past the CUDA check (a stand-in python that says CUDA is there), before anything runs."""
    python = tmp_path / "python"
    python.write_text(
        f'#!/bin/bash\ncase "$*" in *cuda.is_available*) exit 0;; esac\nexec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    out = tmp_path / "results"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)],
        env={**os.environ, "PYTHON": str(python), "VARIANTS": "naive"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and done.stdout == "", done.stdout
    assert done.stderr == (
        f"error: {out} holds files that are not an earlier gpu_check's; give a new or empty folder\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["python", "results"]
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_a_gpu_check_counts_a_sweep_stopped_on_its_way_out_only_if_it_finished(
    tmp_path: Path,
) -> None:
    """Inductor's compile workers can hold a finished sweep's process past its time limit:
    gpu_check.sh counts it as done where results.json says it finished (meta.finished_at,
    written after every other file), and as stopped otherwise."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    function = script[script.index("sweep_status() {") :]
    function = function[: function.index("\n}\n") + 3]
    for name, meta in (("finished", {"finished_at": "2026-11-30T22:00:00+00:00"}), ("cut", {})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"meta": meta, "rows": []}))
    calls = [(d, rc) for d in ("finished", "cut", "missing") for rc in (0, 1, 124, 137)]
    body = "".join(f'echo "$(sweep_status {tmp_path / d} {rc} 2>/dev/null)"\n' for d, rc in calls)
    done = subprocess.run(
        ["bash", "-c", function + body],
        env={**os.environ, "PY": sys.executable},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    got = dict(zip(calls, map(int, done.stdout.split()), strict=True))
    assert got == {(d, rc): 0 if d == "finished" and rc in (124, 137) else rc for d, rc in calls}


def test_the_one_page_op_diff_shows_the_hidden_copy(
    run_script: Callable[..., tuple[int, str, str]],
) -> None:
    """scripts/op_diff.py, the profiler's core in one page: inplace against naive is one
    aten::clone fewer per layer, in the forward, and nothing changes in the optimizer."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "op_diff.py"), "--layers", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "USDT" not in done.stderr  # libkineto's lines, silenced as in profile_train.py
    # A against B, as --diff A,B: the default, inplace,naive, reads as inplace's change
    assert done.stdout.splitlines()[0].endswith("inplace against naive: naive's count -> inplace's")
    changed = {tuple(line.split()[:2]): line.split()[-1] for line in done.stdout.splitlines()[1:]}
    assert changed[("forward", "aten::clone")] == "-3"
    assert changed[("forward", "aten::masked_fill")] == "-3"
    assert not any(region != "forward" for region, _ in changed)
    status, _, err = run_script("op_diff", "--variants", "naive,sdpa-cudnn")
    assert status == 2 and "'sdpa-cudnn' cannot run on cpu" in err


def test_op_diff_script_refuses_one_variant_twice_and_says_when_nothing_differs(
    run_script: Callable[..., tuple[int, str, str]],
) -> None:
    """scripts/op_diff.py: naive,naive is an error, as --diff's is; two variants whose steps
    run the same ops (sdpa picks flash here) say so rather than print a bare header."""
    status, _, err = run_script("op_diff", "--variants", "naive,naive")
    assert status == 2 and "two different variants" in err, err
    status, out, err = run_script("op_diff", "--variants", "sdpa,sdpa-flash", "--layers", "1")
    assert status == 0, err
    assert "no op count differs" in out


def test_after_profiler_script_times_steps_around_each_session(
    run_script: Callable[..., tuple[int, str, str]],
) -> None:
    """scripts/after_profiler.py, the check behind profiling.md's "a depth's timed steps run
    after the previous depth's profiled steps": each session's steps timed before and after it,
    on the model and step a cell uses; a bad count or config is a one-line error."""
    tiny = str(ROOT / "configs" / "tiny.toml")
    status, out, err = run_script(
        "after_profiler", "--config", tiny, "--steps", "2", "--sessions", "2"
    )
    assert status == 0, err
    head, *sessions = out.splitlines()
    assert head.startswith("sdpa, n_layer=2, B=") and "median of 2 steps" in head
    assert [s.split(":")[0] for s in sessions] == ["session 1", "session 2"]
    for line in sessions:
        timing = re.fullmatch(r"session \d: ([\d.]+) ms per step before, ([\d.]+) after", line)
        assert timing and float(timing[1]) > 0 and float(timing[2]) > 0, line
    for bad, named in [
        (["--steps", "0"], "--steps=0: must be >= 1"),
        (["--model.attention=sdpa-flsh"], "sdpa-flsh"),
        (["--model.attention=sdpa-cudnn"], "'sdpa-cudnn' cannot run on cpu"),
        (["--train.dtype=tf32"], "train.dtype='tf32'"),
        (["--data.name=nosuch"], "no prepared corpus at data/nosuch/"),
    ]:
        status, _, err = run_script("after_profiler", "--config", tiny, *bad)
        assert status == 2 and named in err and "Traceback" not in err, err


def test_after_profiler_script_stops_quietly_when_its_reader_goes(
    run_script: Callable[..., tuple[int, str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`after_profiler.py | head -1` ends at the next line, as the shell's SIGPIPE status,
    with no traceback; on a full disk, status 2 and why. (Both were tracebacks.)"""
    tiny = str(ROOT / "configs" / "tiny.toml")
    args = ("after_profiler", "--config", tiny, "--steps", "1", "--sessions", "3")
    head = ReaderTakesLines(1, BrokenPipeError(errno.EPIPE, "Broken pipe"))
    monkeypatch.setattr(sys, "stdout", head)
    status, _, err = run_script(*args)
    assert status == 128 + signal.SIGPIPE and err == "", err
    assert head.getvalue().startswith("sdpa, n_layer=2") and head.getvalue().count("\n") == 1
    monkeypatch.setattr(sys, "stdout", FullDisk())
    status, _, err = run_script(*args)
    assert status == 2 and "error: cannot write to stdout (No space left on device)" in err, err
