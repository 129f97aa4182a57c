"""runtime.py: reading a step's values back without waiting for work queued after it."""

from __future__ import annotations

import time

import pytest
import torch

from runtime import to_host_async


def test_to_host_async_gives_the_values_on_cpu() -> None:
    t = torch.tensor([1.5, 0.0, float("nan")])
    read = to_host_async(t)
    values = read()
    assert values[:2] == [1.5, 0.0] and values[2] != values[2]


@pytest.mark.cuda
def test_to_host_async_waits_for_its_copy_not_for_later_work() -> None:
    t = torch.arange(3.0, device="cuda")
    read = to_host_async(t)
    t.add_(10)  # queued after the copy: the values read are from before it
    torch.cuda._sleep(2_000_000_000)  # about a second of device time, queued after the copy
    began = time.perf_counter()
    assert read() == [0.0, 1.0, 2.0]
    waited = time.perf_counter() - began
    torch.cuda.synchronize()
    slept = time.perf_counter() - began
    assert waited < slept / 4, f"read waited {waited:.3f} s of the {slept:.3f} s of later work"
