"""metrics.jsonl, a training run's log: one JSON object per line, each with its "step".

A line for every `train.log_interval`-th step (and the last) and one per evaluation; train.py
writes them on rank 0 only. docs/training.md lists the fields.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from training.checkpoint import write_atomically


def summarize_ms(seconds: list[float]) -> dict[str, float | int]:
    """Median and 10th/90th percentiles in milliseconds (inclusive, as numpy's default rule):
    the profiler's step times and a training call's."""
    ms = sorted(s * 1e3 for s in seconds)
    if len(ms) == 1:
        return {"median": ms[0], "p10": ms[0], "p90": ms[0], "n": 1}
    deciles = statistics.quantiles(ms, n=10, method="inclusive")
    return {"median": statistics.median(ms), "p10": deciles[0], "p90": deciles[-1], "n": len(ms)}


def start_metrics(path: Path, resume_step: int | None, complete: bool = False) -> None:
    """A fresh run starts a fresh metrics.jsonl; a resumed one drops the lines logged after
    its checkpoint (a crash between checkpoints), since those steps run again (or, `complete`,
    a run that ends at its checkpoint, not at all), and a line cut short by a kill mid-write or
    without an integer step (bytes that are not UTF-8 are read as U+FFFD), saying how many.
    The kept lines are written to a temporary file and renamed over the log, so a crash
    meanwhile loses none of them."""
    if resume_step is None or not path.exists():
        if resume_step is not None:  # deleted, or never copied with the checkpoint
            print(
                f"note: {path} is missing: a new one starts, with the steps after "
                f"{resume_step} only",
                file=sys.stderr,
            )
        path.write_text("")
        return

    def kept(line: str) -> bool:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            return False
        step = record.get("step") if isinstance(record, dict) else None
        return isinstance(step, int) and not isinstance(step, bool) and step <= resume_step

    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    keep = [line for line in lines if kept(line)]
    text = "".join(line + "\n" for line in keep)
    write_atomically(path, lambda f: f.write(text.encode("utf-8")))
    dropped = sum(1 for line in lines if line.strip()) - len(keep)  # blank ones aside
    if dropped:  # said, as a note a user typed into the log is among them
        print(
            f"note: {path}: {dropped} line(s) dropped, logged after step {resume_step} "
            f"({'no checkpoint kept them' if complete else 'they run again'}) or not a step's "
            "record",
            file=sys.stderr,
        )


class MetricsLog:
    """Which steps get a line, what a step's line holds, and the writing of lines."""

    def __init__(
        self,
        path: Path,
        *,
        enabled: bool,  # False on ranks other than 0: nothing is written
        log_interval: int,
        last_step: int,  # the last step of this call, logged whatever the interval
        tokens_per_step: int,  # of the whole job, all ranks
        flops_per_step: int,  # likewise
        peak_tflops: float,  # one device's; 0: no MFU
        devices: int,
        warn: Callable[[str], None],
    ) -> None:
        self.path, self.enabled = path, enabled
        self.log_interval, self.last_step = log_interval, last_step
        self.tokens_per_step, self.flops_per_step = tokens_per_step, flops_per_step
        self.peak_tflops, self.devices = peak_tflops, devices
        self.warn = warn
        self.warned_mfu = False

    def wants(self, step: int) -> bool:
        return self.enabled and (step % self.log_interval == 0 or step == self.last_step)

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as e:  # a failed write names no file: this one does
                raise OSError(e.errno, e.strerror or str(e), str(self.path)) from e

    def step(
        self,
        step: int,
        *,
        loss: float,
        lr: float,
        seconds: float,
        grad_norm: float | None,  # None without clipping
        peak_mem: int | None,  # bytes; CUDA only
    ) -> None:
        """The line for one step, as nanoGPT logs: that step's values, not the interval's."""
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "ms_per_step": seconds * 1e3,
            "tokens_per_s": self.tokens_per_step / seconds,
            "tflops": self.flops_per_step / seconds / 1e12,
        }
        if grad_norm is not None:
            record["grad_norm"] = grad_norm
        if self.peak_tflops > 0:
            record["mfu"] = record["tflops"] / (self.peak_tflops * self.devices)
            if record["mfu"] > 1 and not self.warned_mfu:
                self.warned_mfu = True
                self.warn(
                    f"warning: MFU {record['mfu']:.2f} is above 1: train.peak_tflops="
                    f"{self.peak_tflops:g} is below what this run reaches; check the "
                    "device's datasheet peak for this dtype"
                )
        if peak_mem is not None:
            record["peak_mem_mib"] = peak_mem / 2**20
        self.write(record)
