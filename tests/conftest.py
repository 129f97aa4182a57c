import gc
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Fixtures shared by several test files: the profiler tests' (tests/test_profile_*.py), the
# trainer tests' (tests/test_train_*.py, tests/test_sample.py) and the data tests'
pytest_plugins = ["sweeps", "tiny_runs", "corpora"]
# Subprocesses run as from a user's shell, where Python writes a pipe's stdout 8 KiB at a time:
# CI runners and containers often set PYTHONUNBUFFERED, which would hide what that buffering
# does to a closed or failing pipe (a test that needs a process's lines at once sets it itself).
os.environ.pop("PYTHONUNBUFFERED", None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; torch.cuda.is_available() is False here")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
    compiling = [item for item in items if "cxx" in item.keywords]
    missing = compiling and _no_cxx()
    if missing:  # as on a Mac without Xcode's command-line tools
        skip = pytest.mark.skip(reason=f"compiles for the CPU, and Inductor says: {missing}")
        for item in compiling:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What is loaded by now (torch, the project, the test modules: ~300k objects) lives to the
    end of the session: frozen, it is left out of every full collection the code under test
    asks for (the profiler runs one before each cell), each of which would walk it again
    (0.2 s; 18 of them were 3.7 s of one sweep test)."""
    _freeze()


def _freeze() -> None:
    global _modules_frozen
    gc.collect()
    gc.freeze()
    _modules_frozen = len(sys.modules)


_modules_frozen = 0  # how many modules were loaded at the last freeze
# Modules imported since, that call for another freeze (matplotlib brings 182, a first compile
# 1,613: counted with torch 2.13)
_NEW_MODULES = 100


@pytest.fixture(autouse=True)
def freeze_new_imports() -> Iterator[None]:
    """What a test imported for the first time (matplotlib, Inductor, datasets) is frozen
    after it, as torch was at collection: otherwise every later full collection walks it again
    (up to 0.15 s each, 190 of them in the suite)."""
    yield
    if len(sys.modules) - _modules_frozen >= _NEW_MODULES:
        _freeze()


@pytest.fixture(autouse=True)
def fresh_dynamo(request: pytest.FixtureRequest) -> None:
    """A test that compiles starts from Dynamo's state in a new process, as a command does:
    the shapes an earlier test compiled would make Dynamo take the next test's sizes as
    dynamic, and build general-size kernels that test does not build alone."""
    if "cxx" in request.keywords:
        torch._dynamo.reset()


@pytest.fixture
def run_script(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., tuple[int, str, str]]:
    """scripts/NAME.py run in this process as `python scripts/NAME.py ARGS` runs it: (status,
    stdout, stderr). For what shows without a process of its own, such as an argument error:
    a subprocess imports torch again (~2 s)."""

    def run(name: str, *args: str) -> tuple[int, str, str]:
        path = ROOT / "scripts" / f"{name}.py"
        monkeypatch.setattr(sys, "path", list(sys.path))  # the script adds the project's root
        spec = importlib.util.spec_from_file_location(f"scripts_{name}", path)
        assert spec is not None and spec.loader is not None
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        monkeypatch.setattr(sys, "argv", [str(path), *args])
        monkeypatch.setenv("KINETO_LOG_LEVEL", "6")  # what quiet_profiler_start sets, undone
        capsys.readouterr()
        try:
            with torch.random.fork_rng():  # a script seeds torch's generator for itself
                status = script.main()
        except SystemExit as e:  # argparse's errors, and sys.exit
            status = e.code
        out, err = capsys.readouterr()
        return status, out, err

    return run


def _no_cxx() -> str | None:
    """Why torch.compile's Inductor cannot build CPU code here (no C++ compiler), or None."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
    except InvalidCxxCompiler as e:
        return str(e)
    return None
