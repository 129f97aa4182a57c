"""The CPU host a run shares: its malloc (freed memory kept for the next step, the heap grown
ahead of timed steps), and the share of the CPUs that other processes take meanwhile.

Used by train.py and the profiler on CPU runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import sys
import time
from collections.abc import Iterator

import torch


def keep_freed_host_memory() -> bool:
    """Let freed tensor memory stay in the process's heap for the next step (glibc only).

    glibc's malloc serves blocks above its mmap threshold (dynamic, at most 32 MiB) with mmap
    and unmaps them on free, and trims the heap top past its trim threshold, so each CPU step
    faults in fresh zeroed pages for its activations: at the profile shape
    20,000-30,000 page faults per step for naive attention, a fifth of its step. Raising the
    mmap threshold and turning trimming off keeps freed blocks for reuse, as the caching
    allocator does on CUDA; the price is that the process keeps its heap's high-water mark, which
    fragmentation can push past the live peak (it does under glibc's trimming too). (A finite trim
    threshold, e.g. 1 GiB, still hands the heap back after each step whose peak passes it: at
    T=1024, 100,000-370,000 faults per step for naive attention at 4 layers.) Returns
    False where this malloc cannot be tuned.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:  # a libc without mallopt (e.g. musl)
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    mmap_set = mallopt(m_mmap_threshold, 1 << 30)  # blocks under 1 GiB from the heap
    trim_set = mallopt(m_trim_threshold, -1)  # -1: never trim (mallopt(3))
    return bool(mmap_set and trim_set)


def reserve_heap(nbytes: int) -> None:
    """Grow the heap by `nbytes` of pages faulted in now, and free them, for the heap's top to
    keep (after keep_freed_host_memory, which turns trimming off).

    With freed memory kept, a CPU run's heap still grows for tens of steps: blocks freed in one
    order do not fit the next step's requests, so now and then a whole tensor's pages are taken
    fresh and faulted in (2048 for an 8 MiB one, ~1.5 µs each). That is a one-time cost, which
    a long run amortises; a short timed window would charge it to whichever step met it.
    """
    torch.ones(nbytes, dtype=torch.uint8)  # written, so every page is faulted in, then freed


class OtherLoad:
    """The share of the machine's CPU time that went elsewhere while a run or measurement goes on.

    Busy time of the CPUs this process may run on (Linux /proc/stat, steal included: a VM's
    neighbours count; a container's cpuset or taskset limits them) minus this process's own
    CPU time, over wall time x those CPUs. It counts from construction to
    `share()`, or, made with `running=False`, only inside its `counting()` windows, summed.
    Another job on the machine shows here before it shows as noise in the step times.
    Inductor's compile workers (--compile) are other processes, so they count too.
    """

    def __init__(self, running: bool = True) -> None:
        self.cpus = _cpus_to_count()  # None: every CPU, from /proc/stat's total line
        self.linux = self._read() is not None
        self._closed = (0.0, 0.0, 0.0)  # busy, own and wall seconds of the windows closed
        self._open = self._read() if running else None

    def _read(self) -> tuple[float, float, float] | None:
        try:
            stat = _proc_stat()
            hz = os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None  # not Linux
        try:
            counted = [stat[cpu] for cpu in self.cpus] if self.cpus else [stat["cpu"]]
        except KeyError:  # a CPU taken offline since, or no total line
            return None
        # user nice system idle iowait irq softirq steal; guest time is inside user.
        busy = sum(sum(t) - t[3] - t[4] for t in counted) / hz
        own = resource.getrusage(resource.RUSAGE_SELF)
        return busy, own.ru_utime + own.ru_stime, time.monotonic()

    def _counted(self) -> tuple[float, float, float]:
        """The closed windows' seconds and, if one is open, its seconds so far."""
        end = self._read() if self._open is not None else None
        if end is None:
            return self._closed
        return tuple(c + e - s for c, e, s in zip(self._closed, end, self._open, strict=True))

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count the time inside this block, adding it to what earlier blocks counted."""
        self._open = self._read()
        try:
            yield
        finally:
            self._closed = self._counted()
            self._open = None

    def share(self) -> float | None:
        busy, own, wall = self._counted()
        if not self.linux or wall <= 0:
            return None
        cpus = len(self.cpus) if self.cpus else os.cpu_count() or 1
        return max(0.0, (busy - own) / (wall * cpus))


def _proc_stat() -> dict[str, list[int]]:
    """/proc/stat's CPU lines: 'cpu' (all of them) and 'cpu0', 'cpu1', ..., each's first 8
    tick counts."""
    with open("/proc/stat") as f:
        lines = [line.split() for line in f if line.startswith("cpu")]
    return {fields[0]: [int(x) for x in fields[1:9]] for fields in lines}


def _cpus_to_count() -> list[str] | None:
    """The /proc/stat lines of the CPUs this process may run on, where fewer than all; None
    for all, or where it cannot tell (not Linux; a container whose /proc/stat numbers its
    CPUs otherwise than its affinity does)."""
    try:
        usable = [f"cpu{i}" for i in sorted(os.sched_getaffinity(0))]
        lines = _proc_stat().keys() - {"cpu"}
    except (AttributeError, OSError, ValueError, IndexError):
        return None
    return usable if set(usable) < lines else None
