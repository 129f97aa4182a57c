"""training/cpu_linear.py: the oneDNN path computes what nn.Linear computes, and says when it
cannot run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from model import GPT, GPTConfig
from profiling.measure import count_flops, matmul_peaks
from training import cpu_linear, step
from training.config import ConfigError, load_config
from training.cpu_linear import OneDNNLinear, use_onednn_linears, wants_onednn

needs_onednn = pytest.mark.skipif(
    cpu_linear.onednn_unavailable_reason() is not None,
    reason=str(cpu_linear.onednn_unavailable_reason()),
)
CPU = torch.device("cpu")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(2, 5, 32, 96), (7, 96, 32), (3, 4, 24, 24)])
def test_onednn_linear_equals_nn_linear(shape: tuple[int, ...], bias: bool) -> None:
    """Output and every gradient, for wide, narrow and square weights, 2-D and 3-D inputs."""
    *lead, fan_in, fan_out = shape
    torch.manual_seed(0)
    ref = nn.Linear(fan_in, fan_out, bias=bias)
    fast = nn.Linear(fan_in, fan_out, bias=bias)
    fast.load_state_dict(ref.state_dict())
    assert use_onednn_linears(fast) == 1 and isinstance(fast, OneDNNLinear)
    x = torch.randn(*lead, fan_in)
    xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, yf = ref(xr), fast(xf)
    assert yf.shape == yr.shape
    assert rel_err(yf, yr) < 1e-5
    grad = torch.randn_like(yr)
    yr.backward(grad)
    yf.backward(grad)
    assert rel_err(xf.grad, xr.grad) < 1e-5
    for pr, pf in zip(ref.parameters(), fast.parameters(), strict=True):
        assert rel_err(pf.grad, pr.grad) < 1e-5


@needs_onednn
def test_inputs_onednn_cannot_take_go_through_nn_linear() -> None:
    """float64, an empty batch, bf16 under autocast: nn.Linear's results, not a oneDNN error."""
    torch.manual_seed(0)
    ref = nn.Linear(16, 8)
    fast = nn.Linear(16, 8)
    fast.load_state_dict(ref.state_dict())
    use_onednn_linears(fast)
    for x in (torch.randn(3, 16), torch.empty(0, 16)):
        xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref(xr).sum().backward()
        fast(xf).sum().backward()
        torch.testing.assert_close(xf.grad, xr.grad)
    ref.double(), fast.double()
    x = torch.randn(3, 16, dtype=torch.float64)
    assert torch.equal(fast(x), ref(x))
    ref.float(), fast.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fast(torch.randn(3, 16))
        assert y.dtype == torch.bfloat16 and y.dtype == ref(torch.randn(3, 16)).dtype


@needs_onednn
def test_gpt_with_onednn_linears_trains_the_same() -> None:
    """Same loss and gradients as the plain model; weights stay tied; checkpoints interchange."""
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=True)
    torch.manual_seed(0)
    plain = GPT(cfg)
    fast = GPT(cfg)
    fast.load_state_dict(plain.state_dict())
    assert use_onednn_linears(fast) == 1 + 4 * cfg.n_layer  # lm_head, 4 per block
    assert fast.lm_head.weight is fast.wte.weight
    x, y = torch.randint(0, 64, (3, 16)), torch.randint(0, 64, (3, 16))
    lp, lf = plain(x, y)[1], fast(x, y)[1]
    assert lf.item() == pytest.approx(lp.item(), rel=1e-5)
    lp.backward()
    lf.backward()
    for (name, pp), pf in zip(plain.named_parameters(), fast.parameters(), strict=True):
        assert rel_err(pf.grad, pp.grad) < 1e-5, name
    assert fast.state_dict().keys() == plain.state_dict().keys()
    GPT(cfg).load_state_dict(fast.state_dict())


@needs_onednn
def test_flop_count_does_not_depend_on_the_path() -> None:
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    counts = []
    for onednn in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg)
        if onednn:
            use_onednn_linears(model)
        counts.append(sum(count_flops(lambda m=model: m(x, y)[1].backward()).values()))
    assert counts[0] == counts[1] > 0


@needs_onednn
@pytest.mark.cxx
def test_onednn_linears_compile() -> None:
    """Inside torch.compile'd blocks the oneDNN linear stays one opaque call, with gradients."""
    # The blocks of the profiler tests' sweeps (B=2, T=32, C=32, 2 heads): their C++ kernels
    # are built once in a test session.
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    plain = GPT(cfg)
    fast = GPT(cfg)
    fast.load_state_dict(plain.state_dict())
    use_onednn_linears(fast)
    step.compile_blocks(fast)
    x, y = torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))
    torch._dynamo.utils.counters.clear()
    lp = plain(x, y)[1]
    fast(x, y)  # compiles (tracing calls the op on fake tensors too)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        lf = fast(x, y)[1]
    # Every Linear of the model (4 in the block, the head) is one call of the op: none was
    # decomposed by the compiler, and the block compiled whole.
    calls = sum(e.count for e in prof.key_averages() if e.key == "cpu_linear::linear")
    assert calls == 5
    assert not torch._dynamo.utils.counters["graph_break"]
    lp.backward()
    lf.backward()
    assert lf.item() == pytest.approx(lp.item(), rel=1e-5)
    for (name, p_fast), p_plain in zip(fast.named_parameters(), plain.parameters(), strict=True):
        assert rel_err(p_fast.grad, p_plain.grad) < 1e-5, name


def test_choice_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    def cpu(vendor: str, flags: str = "fpu sse2 avx2 avx512f avx512bw"):
        fields = {"vendor_id": vendor, "flags": flags}
        monkeypatch.setattr(cpu_linear, "cpu_field", fields.get)

    monkeypatch.setattr(cpu_linear, "onednn_unavailable_reason", lambda: None)
    cpu("AuthenticAMD")
    assert wants_onednn("auto", CPU, autocast=False)
    assert wants_onednn("onednn", CPU, autocast=False)
    assert not wants_onednn("torch", CPU, autocast=False)
    assert not wants_onednn("auto", CPU, autocast=True)  # bf16 autocast keeps torch's path
    assert not wants_onednn("auto", torch.device("cuda"), autocast=True)
    with pytest.raises(ValueError, match=r"train\.cpu_linear='onednn' runs fp32 only"):
        wants_onednn("onednn", CPU, autocast=True)
    with pytest.raises(ValueError, match=r"train\.cpu_linear='onednn' is for CPU runs.*cuda"):
        wants_onednn("onednn", torch.device("cuda"), autocast=False)
    # On Intel CPUs MKL already runs AVX-512, and without AVX-512 both run AVX2: auto keeps
    # torch's path there.
    cpu("GenuineIntel")
    assert not wants_onednn("auto", CPU, autocast=False)
    assert wants_onednn("onednn", CPU, autocast=False)
    cpu("AuthenticAMD", flags="fpu sse2 avx2 fma")
    assert not wants_onednn("auto", CPU, autocast=False)
    assert wants_onednn("onednn", CPU, autocast=False)
    monkeypatch.setattr(cpu_linear, "onednn_unavailable_reason", lambda: "no oneDNN here")
    with pytest.raises(ValueError, match=r"train\.cpu_linear='onednn': no oneDNN here"):
        wants_onednn("onednn", CPU, autocast=False)


def test_bad_choice_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"train\.cpu_linear='mkl'.*auto, onednn, torch"):
        load_config(None, ["--train.cpu_linear=mkl"])


def test_matmul_peaks_time_each_path() -> None:
    peaks = matmul_peaks(CPU, torch.float32, seconds=0.02)
    assert peaks["torch.mm"] > 1e8
    if cpu_linear.onednn_unavailable_reason() is None:
        assert peaks["oneDNN"] > 1e8


def run_in_processes(*checks: tuple[str, str]) -> list[str]:
    """A malloc setting is process-wide: each check, (script, mode), runs in its own process,
    all started at once (each imports torch, ~2.5 s on a slow machine). Exit status 3: this
    malloc is not glibc's, and the check does not apply."""
    root = Path(__file__).parents[1]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=root,
        )
        for script, mode in checks
    ]
    try:
        outputs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()  # where one timed out: the others too
            proc.wait()
    if any(proc.returncode == 3 for proc in procs):
        pytest.skip("malloc here is not glibc's")
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
    return [out for out, _ in outputs]


WHERE_A_BIG_BLOCK_LIVES = """
import sys, torch
from training import host
if sys.argv[1] == "keep" and not host.keep_freed_host_memory():
    sys.exit(3)


def heap(ptr=0):
    for line in open("/proc/self/maps"):
        fields = line.split()
        if fields[-1] == "[heap]":
            lo, hi = (int(a, 16) for a in fields[0].split("-"))
            return hi - lo, lo <= ptr < hi
    return 0, False


x = torch.empty(16 * 2**20)  # 64 MiB: above any mmap threshold glibc picks by itself
in_heap = heap(x.data_ptr())[1]
del x
print(in_heap, heap()[0])
"""


@pytest.fixture(scope="module")
def host_checks() -> dict[str, list[str]]:
    """The three checks below, their five processes started at once: each test reads its own
    outputs (one at a time, they were three rounds of torch imports)."""
    checks = {
        "big block": [(WHERE_A_BIG_BLOCK_LIVES, "release"), (WHERE_A_BIG_BLOCK_LIVES, "keep")],
        "fresh block": [(FAULTS_OF_A_FRESH_BLOCK, "fresh"), (FAULTS_OF_A_FRESH_BLOCK, "reserve")],
        "large peak": [(FAULTS_AFTER_A_LARGE_PEAK, "keep")],
    }
    outputs = iter(run_in_processes(*(check for each in checks.values() for check in each)))
    return {name: [next(outputs) for _ in each] for name, each in checks.items()}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux")
def test_kept_host_memory_stays_for_reuse(host_checks: dict[str, list[str]]) -> None:
    """Under glibc's defaults a 64 MiB activation is mmapped and unmapped on free, so the next
    step faults its pages in again; after keep_freed_host_memory it comes from the heap, and
    the heap keeps it after the free. Each in its own process: the setting is process-wide."""

    def parse(out: str) -> tuple[bool, int]:
        in_heap, heap_bytes = out.split()
        return in_heap == "True", int(heap_bytes)

    (released_in_heap, released_heap), (kept_in_heap, kept_heap) = map(
        parse, host_checks["big block"]
    )
    assert not released_in_heap and kept_in_heap
    assert kept_heap - released_heap > 60 * 2**20  # freed, and still there for the next step


FAULTS_OF_A_FRESH_BLOCK = """
import resource, sys, torch
from training import host
if not host.keep_freed_host_memory():
    sys.exit(3)
torch.ones(2**20, dtype=torch.uint8)  # the heap's first growth, whatever it costs
if sys.argv[1] == "reserve":
    host.reserve_heap(64 * 2**20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.ones(32 * 2**20, dtype=torch.uint8)  # a block the heap has not held yet
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux")
def test_a_reserved_heap_serves_new_blocks_without_page_faults(
    host_checks: dict[str, list[str]],
) -> None:
    """With memory kept, a block the heap has not held yet is faulted in page by page (8192
    for 32 MiB); after reserve_heap, the heap's top already holds faulted pages for it. So the
    profiler's timed steps do not pay for the heap's growth."""

    fresh, reserved = map(int, host_checks["fresh block"])
    assert fresh > 6000  # most of its 8192 pages (the heap top may hold a few)
    assert reserved < 500


FAULTS_AFTER_A_LARGE_PEAK = """
import ctypes, resource, sys
from training import host
if not host.keep_freed_host_memory():
    sys.exit(3)
libc = ctypes.CDLL(None)  # glibc's malloc: the trim alone (torch's posix_memalign also fragments)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 600 * 2**20
for step in range(3):  # each step's peak leaves 1.2 GiB free at the heap's top
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(size) for _ in range(2)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in blocks:
        libc.free(block)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux")
def test_kept_host_memory_stays_after_a_peak_over_a_gib(
    host_checks: dict[str, list[str]],
) -> None:
    """Trimming is off, not merely raised: a step finds the 1.2 GiB the one before freed still in
    the heap (at a 1 GiB trim threshold all 300,000 pages were faulted in again, every step)."""
    (faults,) = host_checks["large peak"]
    assert int(faults) < 1000
