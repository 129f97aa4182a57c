"""Where and how a run executes: the device, the precision, the DDP group, stopping on a
signal, reading results back without stalling the device.

Shared by train.py, the profiler, sample.py and the demo, so that all of them run a model the
same way. Errors name the setting at fault (a ConfigError: the fix is in the config or flags).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import sys
import time
from typing import Any, Self

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from console import Droppable
from training.config import NOT_A_DEVICE, ConfigError, TrainConfig, parse_device


def out_of_memory(e: BaseException) -> bool:
    """CUDA's allocator raises OutOfMemoryError; the CPU's a RuntimeError that says so; Python
    (NumPy, the batch loader) MemoryError."""
    return isinstance(e, torch.OutOfMemoryError | MemoryError) or "can't allocate memory" in str(e)


def pick_device(name: str, setting: str = "train.device") -> torch.device:
    """cuda > mps > cpu for "auto", else the named device; errors name `setting`."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = parse_device(name)
    if device is None:
        raise ConfigError(f"{setting}={name!r}: {NOT_A_DEVICE}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{setting}={name!r}: CUDA is not available here: {_why_no_cuda()}")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(
            f"{setting}={name!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
            f"cuda:0 to cuda:{torch.cuda.device_count() - 1}"
        )
    if device.type == "cpu" and device.index:  # torch takes cpu:N as the CPU (cpu:0 is it)
        raise ConfigError(
            f"{setting}={name!r}: the CPU has no index (threads: OMP_NUM_THREADS); use cpu"
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{setting}={name!r}: MPS (Apple GPUs) is not available on this machine")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"{setting}={name!r}: use auto, cpu, cuda, cuda:N or mps")
    return device


def _why_no_cuda() -> str:
    """Why torch.cuda.is_available() is False, as far as this process can tell."""
    if torch.version.hip is not None:
        return f"this torch is built for ROCm {torch.version.hip}, and finds no GPU it can use"
    if torch.version.cuda is None:
        return (
            f"this torch ({torch.__version__}) is a build without CUDA; on a GPU machine "
            "install a CUDA wheel (make clean, then make without PIP_ARGS' CPU index)"
        )
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU"
    return f"no GPU or driver found (this torch is built for CUDA {torch.version.cuda})"


def missing_tensor_cores(dtype: str, device: torch.device) -> str | None:
    """Why `device` cannot run `dtype` ("needs bf16 tensor cores: ..."): bfloat16 and tf32 on a
    GPU before Ampere (compute capability below 8.0, e.g. V100, T4); None where it can."""
    cores = {"bfloat16": "bf16", "tf32": "TF32"}.get(dtype)
    if cores is None or device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= (8, 0):
        return None
    return (
        f"needs {cores} tensor cores: this GPU (compute capability {major}.{minor}) has none: "
        "they start at 8.0 (Ampere)"
    )


def missing_bf16_instructions(device: torch.device, amp_dtype: torch.dtype | None) -> str | None:
    """Why this CPU runs `amp_dtype`'s matmuls far slower than float32's: bfloat16 on a
    processor without bf16 instructions, where ATen takes a generic kernel (on a 2-core AVX2 VM a
    training step at make profile's shape took 13 times as long as in float32: docs/training.md).
    None where it has them, for float32, and off the CPU (an older GPU's bfloat16 is refused:
    autocast_dtype)."""
    if device.type != "cpu" or amp_dtype != torch.bfloat16 or bf16_matmul_instructions():
        return None
    return (
        "this CPU has no bfloat16 matmul instructions (oneDNN's need AVX-512 or AVX-NE-CONVERT "
        "on x86, BF16 on Arm), so its bfloat16 matmuls run in a generic kernel, far slower than "
        "float32's"
    )


def bf16_matmul_instructions() -> bool:
    """oneDNN's check, which ATen's CPU matmuls consult before taking oneDNN's bf16 kernel.
    True where this build has no such check: nothing is claimed of it."""
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return supported is None or bool(supported())


def autocast_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for plain fp32. Parameters and optimizer state stay fp32.
    auto: bf16 on CUDA GPUs with bf16 tensor cores, fp32 elsewhere; bfloat16 asked for on an
    older GPU is an error, as torch would emulate it."""
    if dtype == "auto":
        bf16 = device.type == "cuda" and missing_tensor_cores("bfloat16", device) is None
        return torch.bfloat16 if bf16 else None
    if dtype == "bfloat16" and (missing := missing_tensor_cores(dtype, device)) is not None:
        raise ConfigError(f"train.dtype='bfloat16' {missing}; use float32 (or auto)")
    # No float16: it needs loss scaling, which this trainer omits; bfloat16 does not.
    return {"float32": None, "tf32": None, "bfloat16": torch.bfloat16}[dtype]


def dtype_name(dtype: str, amp_dtype: torch.dtype | None) -> str:
    """train.dtype as resolved on its device, by its matmuls' dtype: bfloat16 (autocast),
    float32, or tf32 (fp32 tensors, TF32 matmuls)."""
    if amp_dtype is not None:
        return str(amp_dtype).removeprefix("torch.")
    return "tf32" if dtype == "tf32" else "float32"


def precision(dtype: str, amp_dtype: torch.dtype | None) -> str:
    """How a run computes, in words: 'bfloat16 autocast', 'float32' or 'tf32'."""
    return dtype_name(dtype, amp_dtype) + (" autocast" if amp_dtype is not None else "")


def set_fp32_matmul_precision(dtype: str, device: torch.device) -> None:
    """For train.dtype="tf32", fp32 matmuls on CUDA run on TF32 tensor cores (inputs rounded to
    a 10-bit mantissa, fp32 range and accumulation); for any other dtype they are IEEE fp32, as
    PyTorch defaults. TF32 is a CUDA mode: asking for it elsewhere is an error, not a no-op."""
    if dtype == "tf32" and device.type != "cuda":
        raise ConfigError(
            f"train.dtype='tf32': TF32 tensor cores are a CUDA feature, and this run is on "
            f"{device}; use float32 there"
        )
    if dtype == "tf32" and (missing := missing_tensor_cores(dtype, device)) is not None:
        raise ConfigError(f"train.dtype='tf32' {missing}; use float32")
    # PyTorch's own switch: "high" is TF32 for cuBLAS (and oneDNN), "highest" IEEE everywhere.
    torch.set_float32_matmul_precision("high" if dtype == "tf32" else "highest")


def autocast(
    device: torch.device, amp_dtype: torch.dtype | None
) -> contextlib.AbstractContextManager:
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=amp_dtype)


# What torchrun sets in each process it launches, and env:// rendezvous reads
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_ranks() -> tuple[int, int]:
    """This process's rank and the world size, as torchrun's environment gives them; (0, 1)
    in a process it did not launch. An environment torchrun would not make (left over from
    another job, say: WORLD_SIZE without RANK, or not a number) is an error naming it."""
    world = os.environ.get("WORLD_SIZE")
    if world is None:
        return 0, 1
    fix = "launch with torchrun (torchrun --nproc_per_node=N train.py ...), or unset it"
    if not world.strip().isdecimal() or int(world) < 1:
        raise ConfigError(f"WORLD_SIZE={world!r} in the environment is not a process count: {fix}")
    if int(world) == 1:
        return 0, 1
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise ConfigError(
            f"WORLD_SIZE={world} in the environment, but not {', '.join(missing)}, which "
            f"torchrun sets too: {fix}"
        )
    rank = os.environ["RANK"]
    if not rank.strip().isdecimal() or int(rank) >= int(world):
        raise ConfigError(f"RANK={rank!r} in the environment is not a rank of WORLD_SIZE={world}")
    return int(rank), int(world)


def init_distributed(train_cfg: TrainConfig) -> tuple[int, int, torch.device]:
    """Rank, world size and device; under torchrun, joins the process group (NCCL or gloo)."""
    rank, world_size = launched_ranks()
    if world_size == 1:
        return 0, 1, pick_device(train_cfg.device)
    wanted = pick_device(train_cfg.device)
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # started by hand: it waits for the others
        print(
            f"rank {rank} of WORLD_SIZE={world_size} (set by hand, not by torchrun): waiting "
            f"for the other processes at {os.environ['MASTER_ADDR']}:"
            f"{os.environ['MASTER_PORT']} until torch.distributed's timeout (Ctrl-C does not "
            "end the wait; SIGTERM does)",
            file=sys.stderr,
        )
    if wanted.type == "cuda":
        if wanted.index is not None:  # each rank takes the GPU torchrun gives it
            raise ConfigError(
                f"train.device={train_cfg.device!r}: under torchrun each process uses GPU "
                "LOCAL_RANK; give cuda (pick the GPUs with CUDA_VISIBLE_DEVICES)"
            )
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    elif wanted.type == "mps":
        raise ConfigError(
            f"train.device={train_cfg.device!r} is MPS here, which torch.distributed cannot "
            "all-reduce (gloo takes CPU and CUDA tensors); under torchrun give "
            "--train.device=cpu, or run one process"
        )
    else:
        device = wanted
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> DDP:
    """The model under DistributedDataParallel, for a process group already joined."""
    # The only buffer is the constant causal mask of the variants that read one (naive,
    # inplace; the others have none): never re-sent.
    # torch 2.13 renamed the flag (the old name warns); 2.11 and 2.12 know only the old.
    no_buffer_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DDP).parameters
        else {"broadcast_buffers": False}
    )
    return DDP(
        model, device_ids=[device.index] if device.type == "cuda" else None, **no_buffer_sync
    )


class SignalScope:
    """While active, SIGINT and SIGTERM go to `_handle`. The previous handlers come back on
    exit, so a caller's Ctrl-C works again afterwards."""

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Self:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        raise NotImplementedError


class StopNow(KeyboardInterrupt):
    """A second stop signal: stop at once, without saving; the exit status is 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopAtOnce(SignalScope):
    """While active, SIGINT and SIGTERM raise StopNow: for a run's set-up, before the loop's
    StopSignal, when there is nothing to save. Unhandled, SIGTERM would end the process with
    no word of what it left (Python raises KeyboardInterrupt for SIGINT only)."""

    def _handle(self, signum: int, frame: Any) -> None:
        raise StopNow(signum)


# torchrun forwards a signal it gets to its workers at once; a signal sent to the whole job
# (scancel, `pkill -f train.py`, a systemd stop) reaches each worker twice, this far apart at most.
FORWARDED_WITHIN_S = 2.0


class StopSignal(SignalScope):
    """While active, SIGINT/SIGTERM set a flag; the loop finishes its step, saves and exits.
    A second signal does not wait: it raises StopNow, a KeyboardInterrupt (no save).

    Under torchrun (`torchrun=True`), the same signal again within FORWARDED_WITHIN_S of the
    first is torchrun forwarding the one the job got, not a second request: it is ignored.

    `stdout`, where it is a Droppable (train.main's), stops the run as SIGPIPE would once a
    write to it fails, before or while active: its reader has gone (`| head`), or the write
    failed (`> log` on a full disk). Python ignores SIGPIPE itself, so a program learns of a
    reader gone from its writes; this one saves and exits with SIGPIPE's status. No repeat of
    it counts as a second signal: each later write would fail again.
    """

    def __init__(self, torchrun: bool = False, stdout: object = None) -> None:
        super().__init__()
        self.received: str | None = None
        self._first: tuple[int, float] | None = None  # signum, when
        self._torchrun = torchrun
        self._stdout = stdout if isinstance(stdout, Droppable) else None

    def __enter__(self) -> Self:
        super().__enter__()
        if self._stdout is not None:
            self._stdout.on_failure = self._stdout_failed
            if self._stdout.failed:  # a line before the loop: the run's first lines, say
                self._stdout_failed()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stdout is not None:
            self._stdout.on_failure = None
        super().__exit__()

    def _stdout_failed(self) -> None:
        if self.received is None:
            self.received = signal.Signals.SIGPIPE.name

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self._first is not None:
            first, at = self._first
            if self._torchrun and signum == first and now - at < FORWARDED_WITHIN_S:
                return  # the job's signal, forwarded by torchrun
            self.__exit__()  # a second signal: the step may hang; stop now
            raise StopNow(signum)
        self._first = signum, now
        self.received = signal.Signals(signum).name


def stop_cause(signal_name: str) -> str:
    """The signal that stopped a run, as its last line says it: SIGPIPE stands for stdout's
    failure (StopSignal), which no one sent."""
    if signal_name == "SIGPIPE":
        return "SIGPIPE (stdout's reader has gone, or writing to it failed)"
    return signal_name


def agreed_signal(received: str | None, device: torch.device, world_size: int) -> str | None:
    """The signal any rank received (None: none did), the same on every rank (a collective
    under DDP, which every rank calls at the same point), so that all stop together and exit
    with one status: ranks a signal did not reach take the others'. A single process knows at
    once, without touching the device."""
    if world_size == 1:
        return received
    signum = torch.tensor(signal.Signals[received] if received else 0, device=device)
    dist.all_reduce(signum, op=dist.ReduceOp.MAX)
    return signal.Signals(int(signum)).name if int(signum) else None


class StepReadout:
    """One step's time and small results (loss, flags), read without stalling the device.

    Made before the step's work is queued; `finish(t)` after it, with the tensor to read.
    A step lasts from its start to the next step's start, or, read before there is a next
    one, to its end. On CUDA, events on the device's stream mark those points as the device
    reaches them, so a gap in which the host left the device idle between steps counts too,
    as it does in the run's wall time; `t` is copied to pinned memory behind the step's
    work: reading waits for this step, not for any queued later, so the caller can queue the
    next step first. Elsewhere the host's clock times it, to the reading for a step read at
    once; on the CPU work runs as it is queued, so that is the step itself (on MPS reading
    waits for all queued work, so the lag gains nothing there).
    """

    def __init__(self, device: torch.device) -> None:
        self.began = time.perf_counter()
        self._values: Tensor | None = None
        self._start: torch.cuda.Event | None = None
        self._copied: torch.cuda.Event | None = None
        if device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record(torch.cuda.current_stream(device))

    def finish(self, t: Tensor) -> None:
        if self._start is None:
            self._values = t  # read when asked (the CPU's is ready; .tolist() waits elsewhere)
            return
        self._values = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.device(t.device):  # the event on t's stream, not on cuda:0's
            self._values.copy_(t, non_blocking=True)
            self._copied = torch.cuda.Event(enable_timing=True)
            self._copied.record()

    def read(self, following: StepReadout | None = None) -> tuple[list[float], float]:
        """The values and the step's seconds; `following` is the next step's readout, if the
        host has begun that step."""
        assert self._values is not None, "finish() the step before reading it"
        if self._copied is not None:
            end = self._copied if following is None else following._start
            self._copied.synchronize()
            end.synchronize()  # the next step's start: this step's end, not the next's work
            return self._values.tolist(), self._start.elapsed_time(end) / 1e3
        values = self._values.tolist()
        end = time.perf_counter() if following is None else following.began
        return values, end - self.began
