"""runtime.StepReadout: a step's values and time, read without waiting for later work."""

from __future__ import annotations

import time

import pytest
import torch

from runtime import StepReadout

SLEEP_CYCLES = 1_000_000_000  # torch.cuda._sleep: about half a second at a GPU's ~2 GHz


def test_readout_gives_the_values_and_the_host_time_on_cpu() -> None:
    readout = StepReadout(torch.device("cpu"))
    time.sleep(0.02)  # the step
    readout.finish(torch.tensor([1.5, 0.0, float("nan")]))
    values, seconds = readout.read(next_began=readout.began + 0.5)
    assert values[:2] == [1.5, 0.0] and values[2] != values[2]
    assert seconds == 0.5  # from the step's start to the next one's
    _, at_once = readout.read()
    assert 0.02 <= at_once < 0.5  # read at once: until now


def sleep_on(device: torch.device) -> None:
    with torch.cuda.device(device):  # _sleep runs on the current device
        torch.cuda._sleep(SLEEP_CYCLES)


def check_waits_for_its_step_only(device: torch.device) -> None:
    """StepReadout and finish() run with whatever device is current, as in train.py."""
    torch.empty(1, pin_memory=True)  # the first page-locked allocation may wait for the GPU
    torch.cuda.synchronize(device)
    readout = StepReadout(device)
    sleep_on(device)  # the step's work
    t = torch.arange(3.0, device=device)
    began = time.perf_counter()
    readout.finish(t)
    assert time.perf_counter() - began < 0.1, "finish() waited for the device"
    t.add_(10)  # a later step's work, queued behind the copy
    sleep_on(device)
    values, seconds = readout.read()
    waited = time.perf_counter() - began
    torch.cuda.synchronize(device)
    total = time.perf_counter() - began
    assert values == [0.0, 1.0, 2.0]
    assert waited < 0.75 * total, f"read waited {waited:.3f} s of {total:.3f} s, later work too"
    assert 0.5 * waited < seconds < 1.5 * waited, (seconds, waited)  # the device's time for it


@pytest.mark.cuda
def test_readout_waits_for_its_step_not_for_later_work() -> None:
    check_waits_for_its_step_only(torch.device("cuda", 0))


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_readout_on_a_gpu_that_is_not_the_current_one() -> None:
    """The events go on the tensor's GPU, not on the current device (cuda:0)."""
    torch.cuda.set_device(0)
    check_waits_for_its_step_only(torch.device("cuda", 1))
