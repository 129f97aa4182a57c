import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


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


def _no_cxx() -> str | None:
    """Why torch.compile's Inductor cannot build CPU code here (no C++ compiler), or None."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
    except InvalidCxxCompiler as e:
        return str(e)
    return None
