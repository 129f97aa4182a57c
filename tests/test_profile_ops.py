"""A step's FLOPs, ops and kernels counted by region from the profiler's events, and the time under
each operator."""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.autograd import DeviceType

import profile_train
from model import GPT, attention
from profiling.cells import Cell
from profiling.measure import count_flops, parse_events, step_flops, verify_backend
from profiling.sweep import Sweep
from sweeps import ROOT, TINY, sweep
from training.config import load_config
from training.cpu_linear import onednn_unavailable_reason

# The stand-ins of sweeps.py, for every test here.
pytestmark = pytest.mark.usefixtures("quick_peak", "flops_counted_once", "plots_unrendered")


@pytest.mark.parametrize("linear", ["torch", "onednn"])
def test_meta_flop_count_equals_a_real_naive_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, linear: str
) -> None:
    """The count runs naive on the meta device only, and equals that of a real eager naive
    step on the CPU, the sweep's own cell (grad accumulation, clipping, AdamW, either Linear
    path), in total and in attention's part."""
    if linear == "onednn" and onednn_unavailable_reason() is not None:
        pytest.skip(onednn_unavailable_reason())
    ran_on: list[str] = []

    def recorded(q, k, v, mask, dropout_p):
        ran_on.append(q.device.type)
        return attention.naive(q, k, v, mask, dropout_p)

    monkeypatch.setitem(attention.VARIANTS, "naive", attention.Variant("naive", recorded, "rec"))
    config = ROOT / "configs" / "profile.toml"  # grad_clip = 1.0
    flags = [*TINY, "--train.grad_accum=2", f"--train.cpu_linear={linear}"]
    args, overrides = profile_train.parse_args(
        ["--config", str(config), "--out", str(tmp_path), *flags]
    )
    s = Sweep(load_config(args.config, overrides), profile_train.sweep_options(args))
    assert s.onednn == (linear == "onednn") and s.config.train.grad_accum == 2
    for n_layer in (1, 3):
        cell = Cell("naive", n_layer, False)
        s._build(cell)
        real = count_flops(cell.step)
        ran_on.clear()
        assert step_flops(s.config, n_layer) == (sum(real.values()), real["aten.bmm"])
        assert set(ran_on) == {"meta"}
        # Attention's T x T products: 12 B T^2 C per layer and micro-batch (B=2, T=32, C=32).
        assert real["aten.bmm"] == 2 * 12 * 2 * 32**2 * 32 * n_layer


def test_flops_do_not_need_naive_to_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, naive_vs_inplace: dict
) -> None:
    """Naive out of memory where another variant fits: that variant still gets its FLOPs and
    MFU, the same count as in a sweep where naive fits."""

    def too_big(q, k, v, mask, dropout_p):
        if q.size(0) > 1 and not q.is_meta:  # the availability probe (B=1) passes
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.15 GiB")
        return attention.naive(q, k, v, mask, dropout_p)

    monkeypatch.setitem(attention.VARIANTS, "naive", attention.Variant("naive", too_big, "big"))
    rc, results = sweep(tmp_path, "--variants", "naive,sdpa-math", "--layers", "1,2")
    assert rc == 0
    counted = {
        r["n_layer"]: (r["flops_per_step"], r["attention_flops_per_step"])
        for r in naive_vs_inplace["rows"]
        if r["variant"] == "sdpa-math"
    }
    rows = {(r["variant"], r["n_layer"]): r for r in results["rows"]}
    for n_layer in (1, 2):
        assert rows[("naive", n_layer)]["status"] == "oom"
        row = rows[("sdpa-math", n_layer)]
        assert row["status"] == "ok", row["reason"]
        assert (row["flops_per_step"], row["attention_flops_per_step"]) == counted[n_layer]
        assert 0 < row["mfu"] < 1
    assert results["meta"]["flop_count"] == "meta device"
    assert "on the meta device" in (tmp_path / "sweep" / "report.md").read_text()


@pytest.mark.cuda
def test_cuda_sweep_counts_kernels(tmp_path: Path) -> None:
    rc, results = sweep(
        tmp_path,
        "--variants",
        "naive,inplace,sdpa-flash",
        "--layers",
        "1,2",
        "--train.device=cuda",
        "--train.dtype=bfloat16",
    )
    assert rc == 0
    rows = {(r["variant"], r["n_layer"]): r for r in results["rows"]}
    for row in rows.values():
        assert row["status"] == "ok", row["reason"]
        # Every region launches kernels (the backward's from the autograd engine's own
        # thread), and every kernel is matched to the region of its launch.
        for region in ("forward", "backward", "optimizer"):
            assert sum(row["kernels_per_step"][region].values()) > 0, region
        assert not row["kernels_unattributed_per_step"], row["kernels_unattributed_per_step"]
        assert row["allocator_calls_per_step"] >= 0 and row["alloc_retries"] >= 0

    def forward_kernels(variant: str, n: int) -> float:
        return sum(rows[(variant, n)]["kernels_per_step"]["forward"].values())

    for n in (1, 2):  # the hidden copy is one more device copy per layer in the forward
        assert forward_kernels("naive", n) - forward_kernels("inplace", n) == n

    # Every eager kernel is launched inside an operator, which gives its category: naive's
    # matmuls, softmax and mask count as attention, and no GEMM is left unplaced.
    for (variant, _), row in rows.items():
        split = row["time_split"]
        assert set(split) == {"linear layers", "attention", "everything else"}, (variant, split)
        assert split["attention"] > 0 and split["linear layers"] > 0, (variant, split)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_every_op_of_a_training_step_is_in_a_region(grad_accum: int) -> None:
    """Ops and kernels are counted by region: work outside forward/backward/optimizer would be
    missing from the counts (and, on CUDA, reported as kernels with no region)."""
    from torch.profiler import profile

    from model import GPTConfig
    from profiling.analysis import REGIONS
    from training.config import TrainConfig
    from training.optim import build_optimizer
    from training.step import train_step

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    optimizer = build_optimizer(model, TrainConfig(), torch.device("cpu"))
    xy = torch.randint(64, (2, 17))
    micro = [(xy[:, :-1], xy[:, 1:])] * grad_accum
    with profile(acc_events=True) as prof:
        train_step(model, optimizer, micro, grad_clip=1.0)
    events = prof.profiler.kineto_results.events()
    regions = [(e.start_ns(), e.end_ns()) for e in events if e.name() in REGIONS]
    outside = [
        e.name()
        for e in events
        if e.name().startswith("aten::") and not any(a <= e.start_ns() <= b for a, b in regions)
    ]
    assert outside == []


def test_ops_autocast_wraps_count_once_per_call() -> None:
    """Autocast records an op it wraps twice, at its own dispatch key and again as it calls the
    op in the cast dtype: a bf16 step counts each call once, as the same fp32 step does."""
    from torch.profiler import profile

    from model import GPTConfig
    from profiling.measure import parse_events
    from training.config import TrainConfig
    from training.optim import build_optimizer
    from training.step import train_step

    def forward_ops(amp_dtype: torch.dtype | None) -> Counter:
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
        model = GPT(dataclasses.replace(config, attention="sdpa"))
        optimizer = build_optimizer(model, TrainConfig(), torch.device("cpu"))
        xy = torch.randint(64, (2, 17))
        with profile() as prof:
            train_step(model, optimizer, [(xy[:, :-1], xy[:, 1:])], 1.0, amp_dtype)
        events = prof.profiler.kineto_results.events()
        return parse_events(events, torch.device("cpu")).ops["forward"]

    fp32, bf16 = forward_ops(None), forward_ops(torch.bfloat16)
    # 4 linears a layer and the head; one attention call a layer, whatever the dtype
    assert fp32["aten::linear"] == bf16["aten::linear"] == 2 * 4 + 1, (fp32, bf16)
    assert bf16["aten::layer_norm"] == fp32["aten::layer_norm"] == 2 * 2 + 1
    assert bf16["aten::scaled_dot_product_attention"] == 2, bf16
    assert bf16["aten::_to_copy"] > 0  # autocast's casts are counted: they are real calls


class FakeEvent:
    """The parts of a kineto event that parse_events reads."""

    def __init__(
        self,
        name,
        kind,
        start,
        end=None,
        corr=0,
        annotation=False,
        thread=1,
        seq=-1,
        fwd=0,
        nbytes=0,
        python=False,
    ) -> None:
        self._name, self._kind, self._start, self._end = name, kind, start, end or start + 1
        self._python = python  # a Python frame, as --trace-stacks records them
        self._corr, self._annotation, self._thread = corr, annotation, thread
        self._seq, self._fwd = seq, fwd  # an autograd node's forward op: (fwd thread, seq)
        self._nbytes = nbytes  # a [memory] event's: negative where memory is freed

    def name(self) -> str:
        return self._name

    def device_type(self):
        return self._kind

    def start_ns(self) -> int:
        return self._start

    def end_ns(self) -> int:
        return self._end

    def duration_ns(self) -> int:
        return self._end - self._start

    def correlation_id(self) -> int:
        return self._corr

    def is_user_annotation(self) -> bool:
        return self._annotation

    def nbytes(self) -> int:
        return self._nbytes

    def start_thread_id(self) -> int:
        return self._thread

    def sequence_nr(self) -> int:
        return self._seq

    def fwd_thread_id(self) -> int:
        return self._fwd

    def is_python_function(self) -> bool:
        return self._python


def test_an_ops_self_time_is_the_same_with_python_stacks_recorded() -> None:
    """--trace-stacks records Python frames, some inside an op (the oneDNN linear's wrapper
    runs Python): they are not operators, and an op's self time does not lose theirs."""
    cpu = DeviceType.CPU
    with_stacks = [
        FakeEvent("forward", cpu, 0, 1000),
        FakeEvent("cpu_linear::linear", cpu, 100, 500),
        FakeEvent("cpu_linear.py(80): _linear", cpu, 110, 480, python=True),
        FakeEvent("mkldnn::_linear_pointwise", cpu, 200, 400),
    ]
    without = [e for e in with_stacks if not e.is_python_function()]

    class Torch211Event:  # before torch 2.12: no frames in events(), no is_python_function
        def __init__(self, event: FakeEvent) -> None:
            self.event = event

        def __getattr__(self, name: str) -> Any:
            if name == "is_python_function":
                raise AttributeError(name)
            return getattr(self.event, name)

    older = [Torch211Event(e) for e in without]
    assert not hasattr(older[0], "is_python_function")
    for events in (with_stacks, without, older):
        seen = parse_events(events, torch.device("cpu"))
        assert seen.cpu_self_us["cpu_linear::linear"] == pytest.approx(0.2)  # 400 - 200 ns
        assert seen.cpu_self_us["mkldnn::_linear_pointwise"] == pytest.approx(0.2)


def test_cpu_peak_memory_is_the_most_live_at_once() -> None:
    """The profiler's [memory] events, in time order: allocations add, frees subtract; the peak
    is the most bytes live at one time above what was live before the step."""
    cpu = DeviceType.CPU
    sizes = [(50, 3), (100, 1), (-80, 5), (-100, 2), (30, 4)]  # (bytes, when), out of order
    events = [FakeEvent("[memory]", cpu, t, nbytes=n) for n, t in sizes]
    # Live in time order: 100, 0, 50, 80, 0
    assert parse_events(events, torch.device("cpu")).peak_transient_bytes == 100
    events.append(FakeEvent("[memory]", cpu, 6, nbytes=120))  # 0 live after t=5: peak 120
    assert parse_events(events, torch.device("cpu")).peak_transient_bytes == 120


def test_cuda_kernels_are_counted_in_the_region_that_launched_them() -> None:
    """Off a GPU, with made-up events: GPU timestamps lag the CPU's, so a kernel belongs to
    the region of its launch (any launch API, cuDNN's cuLaunchKernelEx included), and a
    kernel whose launch is not in the trace is kept aside, still seen by the backend check."""
    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    events = [
        FakeEvent("forward", cpu, 0, 100),
        FakeEvent("backward", cpu, 100, 200),
        FakeEvent("aten::_scaled_dot_product_cudnn_attention", cpu, 10),
        FakeEvent("cudaLaunchKernel", cpu, 20, corr=1),
        FakeEvent("cuLaunchKernelEx", cpu, 30, corr=2),
        FakeEvent("cudaMemcpyAsync", cpu, 150, corr=3),
        FakeEvent("ampere_sgemm_128x64_tn", gpu, 160, corr=1),  # runs in backward's time
        FakeEvent("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", gpu, 170, corr=2),
        FakeEvent("Memcpy DtoD (Device -> Device)", gpu, 180, corr=3),
        FakeEvent("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", gpu, 190, corr=9),
        FakeEvent("forward", gpu, 160, 175, annotation=True),
        FakeEvent("Event Sync", gpu, 195),
    ]
    seen = parse_events(events, torch.device("cuda")).per_step(1)
    assert seen["kernels"]["forward"] == {
        "ampere_sgemm_128x64_tn": 1,
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop": 1,
    }
    assert seen["kernels"]["backward"] == {"Memcpy DtoD (Device -> Device)": 1}
    assert seen["unattributed"] == {"cudnn_generated_fort_native_sdpa_sm90_flash_bprop": 1}
    assert len(seen["device_ms"]) == 4  # every kernel's time counts, attributed or not
    assert seen["ops"]["forward"] == {"aten::_scaled_dot_product_cudnn_attention": 1}

    only_unattributed = {"forward": {}, "unattributed": seen["unattributed"]}
    cuda = torch.device("cuda")
    assert verify_backend("CUDNN_ATTENTION", seen["ops"], only_unattributed, cuda) is None
    problem = verify_backend("CUDNN_ATTENTION", seen["ops"], {"forward": {}}, cuda)
    assert problem is not None and "/cudnn/" in problem


def test_kernel_time_counts_under_the_operator_that_launched_it() -> None:
    """Off a GPU, with made-up events: a kernel's name does not say who launched it, the ops
    around its launch do. Casts inside softmax and matmuls outside a linear are attention's; a
    GEMM inside aten::linear is the linear layers'; backward kernels go where the forward op
    of their autograd node does; a kernel no op launched (a compiled graph's) goes by its name."""
    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    node = "autograd::engine::evaluate_function: "
    # (thread, ops around the launch, outermost first, with their sequence numbers; kernel; us)
    launched = [
        (1, [("aten::linear", 0), ("aten::addmm", 0)], "nvjet_sm90_tst_h_bz_coopA_NNT", 8),
        (1, [("aten::linear", 1), ("aten::to", 1), ("aten::copy_", -1)], "bf16_copy_kernel", 1),
        (1, [("aten::matmul", 2), ("aten::bmm", 2)], "nvjet_sm90_tst_h_bz_NTN", 4),
        (1, [("aten::matmul", 3), ("aten::to", 3), ("aten::copy_", -1)], "bf16_copy_kernel", 2),
        (1, [("aten::softmax", 4), ("aten::to", 4), ("aten::copy_", -1)], "direct_copy", 3),
        (1, [("aten::masked_fill", 5), ("aten::clone", -1)], "Memcpy DtoD", 5),
        (1, [("aten::mul", 6)], "MulFunctor", 6),  # the scale: elementwise, shared
        (2, [(node + "AddmmBackward0", 0), ("aten::sum", -1)], "reduce_kernel", 7),
        (2, [(node + "ToCopyBackward0", 4), ("aten::to", -1)], "direct_copy", 9),
        (2, [(node + "MulBackward0", 6), ("aten::mul", -1)], "MulFunctor", 14),
        (1, [("Torch-Compiled Region: 0/0", -1)], "triton_per_fused__softmax_masked_fill_3", 10),
        (1, [("Torch-Compiled Region: 0/0", -1)], "triton_red_fused__log_softmax_2", 11),
        (1, [("Torch-Compiled Region: 0/0", -1)], "triton_tem_fused_mm_4", 12),
    ]
    events = [FakeEvent("forward", cpu, 0, 10_000)]
    for i, (thread, ops, kernel, us) in enumerate(launched):
        t = 100 * (i + 1)
        for depth, (op, seq) in enumerate(ops):
            fwd = 1 if op.startswith(node) else 0  # a node's forward op ran on thread 1
            end = t + 50 - depth
            events.append(FakeEvent(op, cpu, t + depth, end, thread=thread, seq=seq, fwd=fwd))
        events.append(FakeEvent("cudaLaunchKernel", cpu, t + 20, corr=i + 1, thread=thread))
        events.append(FakeEvent(kernel, gpu, 20_000 + 100 * i, 20_000 + 100 * i + us, corr=i + 1))

    seen = parse_events(events, torch.device("cuda")).per_step(1)
    total = sum(us for *_, us in launched)
    split = {k: round(v * total) for k, v in seen["time_split"].items()}
    assert split == {
        "linear layers": 8 + 1 + 7,
        "attention": 4 + 2 + 3 + 5 + 9 + 10,
        "matmul kernels (linear layers; attention's too unless fused)": 12,
        "everything else": 6 + 14 + 11,
    }


def test_backward_work_counts_where_its_forward_op_does() -> None:
    """With the profiler's own sequence numbers: under autocast, aten::matmul casts its fp32
    input, and the backward of that cast (ToCopyBackward0) is attention's, as the cast is; the
    backward of a cast made by hand, outside any attention op, is not."""
    from torch.profiler import profile

    from profiling.measure import _categorised

    x = torch.randn(4, 8, 8, requires_grad=True)
    with profile() as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.matmul(x, x.transpose(-1, -2))
        y.float().sum().backward()
    events = [e for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CPU]
    casts_back = Counter(c for e, c, _, _ in _categorised(events) if e.name() == "ToCopyBackward0")
    assert casts_back[None] == 1 and casts_back["attention"] >= 1, casts_back
    assert set(casts_back) == {None, "attention"}, casts_back


def test_operator_self_time_counts_under_the_operator_around_it() -> None:
    """On CPU each op's self time (its time less that of the ops inside it) counts under the
    outermost op around it that names a category: naive's hidden copy is attention's, and a
    matmul inside a linear layer is the linear layer's. Events nest as torch nests them: a
    parent first when both start together, and one that outlasts the op it starts in is not
    inside it."""
    cpu = DeviceType.CPU
    events = [
        FakeEvent("forward", cpu, 0, 1_000),
        FakeEvent("aten::clone", cpu, 10, 80),  # listed first, starts with its parent
        FakeEvent("aten::masked_fill", cpu, 10, 130),
        FakeEvent("aten::copy_", cpu, 30, 70),
        FakeEvent("aten::masked_fill_", cpu, 80, 100),
        FakeEvent("aten::mul", cpu, 200, 230),  # elementwise work outside attention's ops
        FakeEvent("aten::sub", cpu, 225, 245),  # outlasts mul: its sibling, not its child
        FakeEvent("aten::add_", cpu, 210, 220, thread=2),  # another thread's
        FakeEvent("aten::linear", cpu, 300, 400),
        FakeEvent("aten::matmul", cpu, 310, 370),
        FakeEvent("aten::mm", cpu, 320, 360),
    ]
    seen = parse_events(events, torch.device("cpu"))
    assert seen.cpu_self_us == pytest.approx(
        {
            "aten::masked_fill": 0.03,
            "aten::clone": 0.03,
            "aten::copy_": 0.04,
            "aten::masked_fill_": 0.02,
            "aten::mul": 0.03,
            "aten::sub": 0.02,
            "aten::add_": 0.01,
            "aten::linear": 0.04,
            "aten::matmul": 0.02,
            "aten::mm": 0.04,
        }
    )
    assert seen.per_step(1)["time_split"] == pytest.approx(
        {"attention": 120 / 280, "linear layers": 100 / 280, "everything else": 60 / 280}
    )


def test_a_marked_attention_call_is_attentions_forward_and_backward() -> None:
    """Inside the `attention` range an eager cell's profiled steps put around each call of the
    variant, every op is attention's, and so is its backward: naive's scale multiply, which no
    attention op encloses. The same op outside the range is not."""
    cpu = DeviceType.CPU
    events = [
        FakeEvent("forward", cpu, 0, 1000),
        FakeEvent("attention", cpu, 100, 300, annotation=True),
        FakeEvent("aten::bmm", cpu, 110, 150, seq=1),
        FakeEvent("aten::mul", cpu, 160, 190, seq=2),  # the scale
        FakeEvent("aten::mul", cpu, 400, 420, seq=3),  # elementwise work elsewhere
        FakeEvent("backward", cpu, 1000, 2000),
        FakeEvent("MulBackward0", cpu, 1100, 1200, seq=2, fwd=1),
        FakeEvent("aten::mul", cpu, 1110, 1150),
        FakeEvent("MulBackward0", cpu, 1300, 1400, seq=3, fwd=1),
        FakeEvent("aten::mul", cpu, 1310, 1360),
    ]
    seen = parse_events(events, torch.device("cpu"))
    assert seen.cpu_split_us == pytest.approx({"attention": 0.11, "everything else": 0.07})
    assert sum(seen.ops["forward"].values()) == 3  # the range itself is not an op


def test_marking_attention_calls_changes_no_count_and_is_undone() -> None:
    """A naive model's profiled training step with its attention calls marked: the ranges show,
    one per layer, the scale multiply and its backward count as attention, the op counts are
    those of an unmarked step, and afterwards each layer calls its variant directly again."""
    from torch.profiler import profile

    from model import GPTConfig
    from profiling.measure import _categorised, attention_calls_marked
    from training.config import TrainConfig
    from training.optim import build_optimizer
    from training.step import train_step

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16))
    optimizer = build_optimizer(model, TrainConfig(), torch.device("cpu"))
    xy = torch.randint(64, (2, 17))
    micro = [(xy[:, :-1], xy[:, 1:])]
    train_step(model, optimizer, micro, grad_clip=1.0)  # the first makes AdamW's state
    attends = [block.attn.attend for block in model.blocks]

    def profiled(marked: bool) -> list:
        mark = attention_calls_marked(model) if marked else contextlib.nullcontext()
        with mark, profile(acc_events=True) as prof:
            train_step(model, optimizer, micro, grad_clip=1.0)
        return [
            e for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CPU
        ]

    plain, marked = profiled(False), profiled(True)
    assert [block.attn.attend for block in model.blocks] == attends
    with pytest.raises(KeyboardInterrupt), attention_calls_marked(model):
        raise KeyboardInterrupt
    assert [block.attn.attend for block in model.blocks] == attends
    assert sum(e.name() == "attention" for e in marked) == 2
    assert sum(e.name() == "attention" for e in plain) == 0
    device = torch.device("cpu")
    assert parse_events(marked, device).ops == parse_events(plain, device).ops

    def scale_muls(events: list) -> Counter:  # the categories of each aten::mul and its backward
        names = ("aten::mul", "MulBackward0")
        return Counter((e.name(), c) for e, c, _, _ in _categorised(events) if e.name() in names)

    assert scale_muls(marked)[("aten::mul", "attention")] == 4  # per layer: the scale, its backward
    assert scale_muls(marked)[("MulBackward0", "attention")] == 2
    assert scale_muls(plain)[("MulBackward0", "attention")] == 0


def test_a_compiled_graphs_backward_is_its_own() -> None:
    """A compiled graph's autograd node is made by `CompiledFunction`, which has no op name,
    after an op inside attention saw the same sequence number: the graph's backward kernels
    go by their own names, not to attention."""
    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    node = "autograd::engine::evaluate_function: CompiledFunctionBackward"
    events = [
        FakeEvent("forward", cpu, 0, 1000),
        FakeEvent("aten::scaled_dot_product_attention", cpu, 10, 100, seq=5),
        FakeEvent("aten::to", cpu, 20, 30, seq=6),  # makes no node: the next one is 6
        FakeEvent("Torch-Compiled Region: 2/0", cpu, 110, 200),
        FakeEvent("CompiledFunction", cpu, 111, 199, seq=6),
        FakeEvent("backward", cpu, 1000, 2000),
        FakeEvent(node, cpu, 1100, 1200, thread=2, seq=6, fwd=1),
        FakeEvent("cuLaunchKernel", cpu, 1110, corr=1, thread=2),
        FakeEvent("triton_poi_fused_gelu_backward_0", gpu, 5000, 5010, corr=1),
    ]
    split = parse_events(events, torch.device("cuda")).per_step(1)["time_split"]
    assert split == {"everything else": 1.0}


def test_self_times_match_the_profilers_own() -> None:
    """The self time parse_events derives from a real step's events is torch's own
    (key_averages), op by op."""
    from torch.profiler import ProfilerActivity, profile

    from model import GPTConfig
    from profiling.names import OP_NAMESPACES
    from training.config import TrainConfig
    from training.optim import build_optimizer
    from training.step import train_step

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16))
    optimizer = build_optimizer(model, TrainConfig(), torch.device("cpu"))
    xy = torch.randint(64, (2, 17))
    train_step(model, optimizer, [(xy[:, :-1], xy[:, 1:])])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(model, optimizer, [(xy[:, :-1], xy[:, 1:])], grad_clip=1.0)
    seen = parse_events(prof.profiler.kineto_results.events(), torch.device("cpu"))
    own = {
        a.key: a.self_cpu_time_total for a in prof.key_averages() if a.key.startswith(OP_NAMESPACES)
    }
    assert set(seen.cpu_self_us) == set(own)
    for name, us in own.items():
        assert seen.cpu_self_us[name] == pytest.approx(us, abs=0.01), name
    assert sum(seen.cpu_split_us.values()) == pytest.approx(sum(own.values()), abs=0.1)


def test_peak_memory_off_cpu_and_cuda_is_not_measured() -> None:
    """MPS keeps no allocator peak, and the profiler's allocation events are the CPU's: its
    cells record no peak rather than the parameters alone, which read alike for every variant."""
    from profiling.measure import peak_memory

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    step = lambda: None
    assert peak_memory(model, optimizer, step, torch.device("mps"), cpu_transient=123) is None
    assert peak_memory(model, optimizer, step, torch.device("cpu"), cpu_transient=123) > 123


def test_resident_memory_counts_the_causal_mask_naive_holds() -> None:
    """Peak memory's resident part: parameters, optimizer state, and buffers, the one place
    naive and inplace hold more than the SDPA variants (a block_size^2 bool mask)."""
    from model import GPTConfig
    from profiling.measure import resident_bytes

    config = GPTConfig(vocab_size=64, block_size=48, n_layer=1, n_head=2, n_embd=16)

    def resident(attention: str) -> int:
        model = GPT(dataclasses.replace(config, attention=attention))
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.zeros(1, 8, dtype=torch.long))[0].sum().backward()
        optimizer.step()
        return resident_bytes(model, optimizer)

    tensors = list(GPT(config).parameters())  # 16: lm_head shares the embedding's
    weights = 4 * sum(p.numel() for p in tensors)
    # Weights and AdamW's two moments, in fp32, and its 4-byte step count per tensor.
    assert resident("sdpa") == 3 * weights + 4 * len(tensors)
    assert resident("naive") - resident("sdpa") == 48 * 48


def test_per_step_other_time_is_per_step() -> None:
    from profiling.measure import TOP_TIMES, StepProfile

    p = StepProfile()
    p.cpu_self_us = Counter({f"aten::op{i}": 1000.0 * (100 - i) for i in range(TOP_TIMES + 2)})
    rest = sum(1000.0 * (100 - i) for i in range(TOP_TIMES, TOP_TIMES + 2))
    ms = p.per_step(4)["cpu_ms"]
    assert ms["other"] == pytest.approx(rest / 1e3 / 4)
    assert sum(ms.values()) == pytest.approx(sum(p.cpu_self_us.values()) / 1e3 / 4)
