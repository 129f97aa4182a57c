"""runtime.StepReadout: a step's values and time, read without waiting for later work; and
train.py's loop on CUDA, which uses it (here, not in test_train_*.py: this file needs no
tokenizers, which the GPU machine may lack)."""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from training import runtime
from training.config import ConfigError, TrainConfig
from training.runtime import (
    StepReadout,
    autocast_dtype,
    missing_bf16_instructions,
    pick_device,
    set_fp32_matmul_precision,
)

ROOT = Path(__file__).resolve().parents[1]
SLEEP_CYCLES = 1_000_000_000  # torch.cuda._sleep: about half a second at a GPU's ~2 GHz


@pytest.fixture
def matmul_precision():
    """Puts back the process-wide fp32 matmul precision a test changes."""
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def test_tf32_is_set_for_cuda_and_refused_elsewhere(
    matmul_precision: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda = torch.device("cuda")  # only named, with an H100's compute capability: no GPU needed
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    set_fp32_matmul_precision("tf32", cuda)
    assert torch.get_float32_matmul_precision() == "high"
    for dtype in ("float32", "auto", "bfloat16"):  # any other dtype: IEEE fp32 matmuls again
        set_fp32_matmul_precision("tf32", cuda)
        set_fp32_matmul_precision(dtype, cuda)
        assert torch.get_float32_matmul_precision() == "highest", dtype
    for device in ("cpu", "mps"):
        with pytest.raises(ConfigError, match=rf"train.dtype='tf32'.*{device}"):
            set_fp32_matmul_precision("tf32", torch.device(device))
    assert torch.get_float32_matmul_precision() == "highest", "a refusal changes nothing"


def test_a_gpu_without_bf16_tensor_cores_gets_fp32_or_a_clear_error(
    matmul_precision: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 and TF32 tensor cores start at compute capability 8.0: on a V100 or T4, auto
    trains in fp32 and an explicit bfloat16 or tf32 is refused, naming the setting; not
    emulated or ignored in silence."""
    cuda = torch.device("cuda")  # only named: no GPU needed
    capability = (8, 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert autocast_dtype("auto", cuda) == autocast_dtype("bfloat16", cuda) == torch.bfloat16
    capability = (7, 5)
    assert autocast_dtype("auto", cuda) is None
    assert autocast_dtype("float32", cuda) is None
    why = r"tensor cores: this GPU \(compute capability 7.5\) has none"
    with pytest.raises(ConfigError, match=rf"train.dtype='bfloat16' needs bf16 {why}"):
        autocast_dtype("bfloat16", cuda)
    with pytest.raises(ConfigError, match=rf"train.dtype='tf32' needs TF32 {why}"):
        set_fp32_matmul_precision("tf32", cuda)
    assert torch.get_float32_matmul_precision() == "highest", "a refusal changes nothing"


def test_a_cpu_without_bf16_instructions_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 autocast on a CPU whose matmuls have no bf16 instructions runs (train.py and
    sample.py take it) but slowly: the reason is given for bfloat16 on such a CPU only."""
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert runtime.bf16_matmul_instructions() == check()  # oneDNN's own check, where it has one
    for supported in (True, False):
        monkeypatch.setattr(runtime, "bf16_matmul_instructions", lambda s=supported: s)
        assert missing_bf16_instructions(cpu, None) is None
        assert missing_bf16_instructions(torch.device("cuda"), bf16) is None
        reason = missing_bf16_instructions(cpu, bf16)
        assert (reason is None) == supported
    assert reason.startswith("this CPU has no bfloat16 matmul instructions (oneDNN's need")
    monkeypatch.undo()
    monkeypatch.setattr(torch.ops, "mkldnn", types.SimpleNamespace())  # a build without it
    assert runtime.bf16_matmul_instructions(), "a build that cannot tell: nothing is claimed"


@pytest.mark.cuda
def test_tf32_rounds_cuda_matmuls(matmul_precision: None) -> None:
    """TF32 keeps a 10-bit mantissa: its products are ~1e-3 off in relative terms, IEEE
    fp32's ~1e-6. So the setting is seen to reach cuBLAS, not just a Python flag."""
    device = torch.device("cuda")
    a, b = (torch.randn(512, 512, dtype=torch.float64, device=device) for _ in range(2))
    exact = a @ b

    def error(dtype: str) -> float:
        set_fp32_matmul_precision(dtype, device)
        off = ((a.float() @ b.float()).double() - exact).abs().max()
        return (off / exact.abs().max()).item()

    assert error("tf32") > 30 * error("float32")


def test_readout_gives_the_values_and_the_host_time_on_cpu() -> None:
    readout = StepReadout(torch.device("cpu"))
    time.sleep(0.02)  # the step
    readout.finish(torch.tensor([1.5, 0.0, float("nan")]))
    following = StepReadout(torch.device("cpu"))
    following.began = readout.began + 0.5
    values, seconds = readout.read(following)
    assert values[:2] == [1.5, 0.0] and values[2] != values[2]
    assert seconds == 0.5  # from the step's start to the next one's
    _, at_once = readout.read()
    assert 0.02 <= at_once < 0.5  # read at once: until now


def sleep_on(device: torch.device) -> None:
    with torch.cuda.device(device):  # _sleep runs on the current device
        torch.cuda._sleep(SLEEP_CYCLES)


def check_waits_for_its_step_only(device: torch.device) -> None:
    """StepReadout and finish() run with whatever device is current, as in train.py."""
    # The first page-locked allocation of a size may wait for the GPU: made here, for the
    # size finish() takes, and cached for it.
    torch.empty(3, pin_memory=True)
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
def test_a_gap_the_host_leaves_the_gpu_idle_counts_in_the_step() -> None:
    """Timed to the next step's start, a step includes the time the device waited for the
    host between them (logging, the next batch): tokens/s is the run's, not the kernels'."""
    device = torch.device("cuda", 0)
    torch.empty(3, pin_memory=True)
    torch.cuda.synchronize(device)
    readout = StepReadout(device)
    sleep_on(device)  # the step's work
    readout.finish(torch.arange(3.0, device=device))
    torch.cuda.synchronize(device)  # the device has finished, and idles...
    time.sleep(0.3)  # ...while the host does something else
    following = StepReadout(device)
    sleep_on(device)  # the next step's work: not waited for
    began = time.perf_counter()
    _, with_gap = readout.read(following)
    assert time.perf_counter() - began < 0.25, "read waited for the next step's work"
    _, alone = readout.read()
    assert with_gap - alone >= 0.25, (with_gap, alone)
    torch.cuda.synchronize(device)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_readout_on_a_gpu_that_is_not_the_current_one() -> None:
    """The events go on the tensor's GPU, not on the current device (cuda:0)."""
    torch.cuda.set_device(0)
    check_waits_for_its_step_only(torch.device("cuda", 1))


def fake_corpus(root: Path, vocab: int = 512, tokens: int = 20_000) -> None:
    """A corpus as data/prepare.py lays it out, of random ids: training needs no tokenizer
    (the GPU machine may have none); tokenizer.json is only copied into the run."""
    corpus = root / "tiny"
    corpus.mkdir(parents=True)
    g = np.random.default_rng(0)
    for split in ("train", "val"):
        g.integers(0, vocab, tokens, dtype=np.uint16).tofile(corpus / f"{split}.bin")
    meta = {
        "vocab_size": vocab,
        "tokenizer_sha256": hashlib.sha256(b"{}").hexdigest(),  # checked as the run reads it
        "content_sha256": "0" * 64,  # what the checkpoint records of the corpus
        "splits": {split: {"tokens": tokens, "bytes": 3 * tokens} for split in ("train", "val")},
    }
    (corpus / "meta.json").write_text(json.dumps(meta))
    (corpus / "tokenizer.json").write_text("{}")


@pytest.mark.cuda
def test_a_training_run_on_cuda(tmp_path: Path) -> None:
    """train.py's CUDA loop, steps read a step late: every one logged once and in order, with
    a time, the peak memory of its own step, evaluations and the checkpoint at their steps."""
    import train

    fake_corpus(tmp_path / "data")
    out = tmp_path / "run"
    argv = ["--config", str(ROOT / "configs" / "tiny.toml"), f"--data.root={tmp_path / 'data'}"]
    argv += ["--out", str(out), "--train.device=cuda", "--train.max_steps=12"]
    argv += ["--train.eval_interval=5", "--train.peak_tflops=1000"]
    assert train.main(argv) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert [r["step"] for r in lines if "val_loss" in r] == [0, 5, 10, 12]  # 0: untrained
    for r in steps:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]), r
        assert 0 < r["ms_per_step"] < 10_000 and r["peak_mem_mib"] > 0, r
        assert 0 < r["mfu"] < 1, r
    # Steps 2-12 allocate alike (step 1 also makes the optimizer state): the same peak, also
    # for steps read at once (5, 10, 12), whose peak is read before the next step is queued.
    peaks = [r["peak_mem_mib"] for r in steps[1:]]
    assert max(peaks) <= 1.05 * min(peaks), peaks
    ckpt = torch.load(out / "ckpt.pt", map_location="cpu", weights_only=True)
    assert ckpt["step"] == 12 and ckpt["config"]["train"]["device"] == "cuda"


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("mps", "MPS (Apple GPUs) is not available"),
        ("meta", "use auto, cpu, cuda, cuda:N or mps"),
        ("gpu", "not a device"),
        (f"cuda:{torch.cuda.device_count()}", "CUDA"),
        ("cpu:1", "the CPU has no index"),
    ],
)
def test_a_device_this_machine_lacks_is_a_config_error(name: str, says: str) -> None:
    """Refused by name before anything is built, not a dispatcher traceback mid-run."""
    if name == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    with pytest.raises(ConfigError, match=re.escape(says)) as refused:
        pick_device(name, "--device")
    assert str(refused.value).startswith(f"--device={name!r}")


@pytest.mark.parametrize(
    ("cuda", "mps", "picked"),
    [(True, True, "cuda"), (False, True, "mps"), (False, False, "cpu")],
)
def test_auto_picks_cuda_then_mps_then_the_cpu(
    monkeypatch: pytest.MonkeyPatch, cuda: bool, mps: bool, picked: str
) -> None:
    """train.device=auto, the default: the first of cuda, mps and cpu that this machine has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    assert pick_device("auto") == torch.device(picked)


def test_no_cuda_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """train.device=cuda where CUDA is not there says why it is not, as far as torch can
    tell: a build without CUDA (the CPU wheel on a GPU machine), GPUs hidden, or none found."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ConfigError, match=r"cuda'.*is a build without CUDA; on a GPU machine"):
        pick_device("cuda")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError, match=r"CUDA_VISIBLE_DEVICES='' hides every GPU"):
        pick_device("cuda")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(
        ConfigError, match=r"no GPU or driver found \(this torch is built for CUDA 12\.8\)"
    ):
        pick_device("cuda:1")


def test_a_gpu_index_past_the_last_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a machine with one GPU (the count is all that is read)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pick_device("cuda:0") == torch.device("cuda:0")
    assert pick_device("cuda") == torch.device("cuda")
    with pytest.raises(ConfigError, match=r"has 1 CUDA device\(s\), cuda:0 to cuda:0"):
        pick_device("cuda:1")


def as_torchrun_rank(monkeypatch: pytest.MonkeyPatch, world: str = "2", rank: str = "0") -> None:
    """The environment torchrun gives a process it launches."""
    for name, value in (
        ("WORLD_SIZE", world),
        ("RANK", rank),
        ("LOCAL_RANK", rank),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ):
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 in the environment, but not RANK, LOCAL_RANK"),
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' in the environment is not a process count"),
        ({"WORLD_SIZE": ""}, "WORLD_SIZE='' in the environment is not a process count"),
    ],
)
def test_an_environment_torchrun_did_not_make_is_named(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    env: dict[str, str],
    says: str,
) -> None:
    """WORLD_SIZE left over from another job, without torchrun: one line naming it and the
    way out, before anything is read or written (it was a traceback from the rendezvous)."""
    import train

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert train.main(["--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"error: {says}" in err and "launch with torchrun" in err, err
    assert not (tmp_path / "run").exists()


def test_a_rank_without_a_world_is_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """RANK=1 alone (no WORLD_SIZE): one process, rank 0, which prints the resume notices and
    the end-of-run sample; a rank past the world is refused."""
    from training.runtime import launched_ranks

    monkeypatch.setenv("RANK", "1")
    assert launched_ranks() == (0, 1)
    as_torchrun_rank(monkeypatch, world="2", rank="1")
    assert launched_ranks() == (1, 2)
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ConfigError, match=r"RANK='2' in the environment is not a rank"):
        launched_ranks()


def test_ranks_started_by_hand_say_they_wait_for_the_others(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without torchrun, a process given WORLD_SIZE=2 waits in the rendezvous for the other,
    which Ctrl-C does not end: it says so first. torchrun's own workers (TORCHELASTIC_RUN_ID)
    do not: torchrun starts them all."""
    from training import runtime

    class Joined(Exception):
        pass

    def init_process_group(*args: object, **kwargs: object) -> None:
        raise Joined

    monkeypatch.setattr(runtime.dist, "init_process_group", init_process_group)
    as_torchrun_rank(monkeypatch)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(Joined):
        runtime.init_distributed(TrainConfig(device="cpu"))
    assert capsys.readouterr().err.startswith(
        "rank 0 of WORLD_SIZE=2 (set by hand, not by torchrun): waiting for the other "
        "processes at 127.0.0.1:29500"
    )
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with pytest.raises(Joined):
        runtime.init_distributed(TrainConfig(device="cpu"))
    assert capsys.readouterr().err == ""


def test_torchrun_refuses_a_numbered_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun each rank takes GPU LOCAL_RANK: a train.device=cuda:1 that would be
    dropped without a word is an error instead (checked before any process group is joined)."""
    from training.config import TrainConfig
    from training.runtime import init_distributed

    as_torchrun_rank(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"train\.device='cuda:1': under torchrun"):
        init_distributed(TrainConfig(device="cuda:1"))


def test_torchrun_on_mps_is_refused_before_joining(monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo all-reduces CPU and CUDA tensors only: a torchrun run that would train on MPS is
    told to use the CPU, before any process group is joined."""
    from training import runtime
    from training.config import TrainConfig

    as_torchrun_rank(monkeypatch)
    monkeypatch.setattr(runtime, "pick_device", lambda name, setting="": torch.device("mps"))
    joined: list[object] = []
    monkeypatch.setattr(runtime.dist, "init_process_group", lambda *a, **k: joined.append(a))
    with pytest.raises(ConfigError, match=r"is MPS here.*--train\.device=cpu"):
        runtime.init_distributed(TrainConfig(device="auto"))
    assert joined == []
