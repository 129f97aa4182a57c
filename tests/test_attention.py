"""The promise every measurement stands on: the attention variants compute the same function."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from model import GPT, VARIANTS
from model.attention import FLEX_BLOCK, inplace, naive
from tiny_models import tiny_config
from training.probe import VariantUnavailable, available_variants, check_variant, unavailable_reason

ROOT = Path(__file__).resolve().parents[1]


# What the registry says runs on the CPU: every variant without a reason it cannot. Read from
# the registry, not by running each (available_variants): a new variant that raises must fail
# these tests, not be left out of them as one the CPU cannot run.
OFF_CUDA = [name for name, v in VARIANTS.items() if not v.cuda_only_reason]
AGAINST_NAIVE = [v for v in OFF_CUDA if v != "naive"]  # naive against itself proves nothing
# Those whose dropout runs on the CPU, by running them: it depends on the device (the CPU's
# flash kernel has none, CUDA's has)
WITH_DROPOUT = available_variants("cpu", torch.float32, head_size=8, dropout_p=0.5)
SHAPES = [(1, 1), (2, 17), (3, 40), (2, 64)]  # (B, T): T=1, T not a multiple of 16, B > 1


def twin_models(variant: str, dtype: torch.dtype, **overrides) -> tuple[GPT, GPT]:
    """A naive model and a `variant` model with identical weights."""
    torch.manual_seed(0)
    reference = GPT(tiny_config("naive", **overrides)).to(dtype)
    other = GPT(tiny_config(variant, **overrides)).to(dtype)
    other.load_state_dict(reference.state_dict())
    return reference, other


def test_cpu_runs_what_it_should() -> None:
    # If this changes, a torch upgrade changed what CPU can do: the docs must follow.
    assert available_variants("cpu", torch.float32, head_size=8) == [
        "naive",
        "inplace",
        "sdpa",
        "sdpa-math",
        "sdpa-flash",
    ]
    assert set(VARIANTS) == {
        "naive",
        "inplace",
        "sdpa",
        "sdpa-math",
        "sdpa-flash",
        "sdpa-efficient",
        "sdpa-cudnn",
        "flex",
    }


@pytest.mark.parametrize("variant", AGAINST_NAIVE)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}T{s[1]}")
def test_variant_matches_naive_float64(variant: str, shape: tuple[int, int]) -> None:
    reference, other = twin_models(variant, torch.float64)
    idx = torch.randint(0, 97, shape)
    targets = torch.randint(0, 97, shape)
    logits_ref, loss_ref = reference(idx, targets)
    logits, loss = other(idx, targets)
    loss_ref.backward()
    loss.backward()
    tol = dict(rtol=1e-9, atol=1e-10)  # float64: only summation order may differ
    torch.testing.assert_close(logits, logits_ref, **tol)
    torch.testing.assert_close(loss, loss_ref, **tol)
    grads_ref = dict(reference.named_parameters())
    for name, p in other.named_parameters():
        torch.testing.assert_close(p.grad, grads_ref[name].grad, **tol, msg=name)


@pytest.mark.parametrize("variant", AGAINST_NAIVE)
@pytest.mark.parametrize("n_head", [1, 2])
def test_variant_matches_naive_other_head_counts(variant: str, n_head: int) -> None:
    reference, other = twin_models(variant, torch.float64, n_head=n_head, n_layer=1)
    idx = torch.randint(0, 97, (2, 33))
    torch.testing.assert_close(other(idx)[0], reference(idx)[0], rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("variant", OFF_CUDA)
def test_causal(variant: str) -> None:
    torch.manual_seed(0)
    model = GPT(tiny_config(variant)).eval()
    idx = torch.randint(0, 97, (2, 40))
    t = 23
    changed = idx.clone()
    changed[:, t + 1 :] = torch.randint(0, 97, (2, 40 - t - 1))
    with torch.no_grad():
        before, after = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(after[:, : t + 1], before[:, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, t + 1 :], before[:, t + 1 :])


def test_inplace_gradcheck() -> None:
    torch.manual_seed(0)
    B, H, T, D = 1, 2, 5, 3
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    assert torch.autograd.gradcheck(lambda q, k, v: inplace(q, k, v, mask, 0.0), (q, k, v))
    grads = torch.autograd.grad(inplace(q, k, v, mask, 0.0).sum(), (q, k, v))
    grads_ref = torch.autograd.grad(naive(q, k, v, mask, 0.0).sum(), (q, k, v))
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=0, atol=0)


def clones_in_one_training_step(variant: str, n_layer: int, device: str = "cpu") -> int:
    """aten::clone calls in one forward + backward + AdamW step of training.step.train_step."""
    from torch.profiler import ProfilerActivity, profile

    from training.config import TrainConfig
    from training.optim import build_optimizer
    from training.step import train_step

    torch.manual_seed(0)
    model = GPT(tiny_config(variant, n_layer=n_layer)).to(device)
    optimizer = build_optimizer(model, TrainConfig(), torch.device(device))
    batch = torch.randint(0, 97, (2, 33), device=device)
    with profile(activities=[ProfilerActivity.CPU], acc_events=True) as prof:
        train_step(model, optimizer, [(batch[:, :-1], batch[:, 1:])], grad_clip=1.0)
    return sum(1 for e in prof.events() if e.name == "aten::clone")


@pytest.mark.parametrize("n_layer", [1, 2, 4])
def test_hidden_copy_in_a_training_step(n_layer: int) -> None:
    """The blog's finding, inside forward + backward + AdamW: one aten::clone per layer."""
    extra = clones_in_one_training_step("naive", n_layer) - clones_in_one_training_step(
        "inplace", n_layer
    )
    assert extra == n_layer


@pytest.mark.parametrize("variant", WITH_DROPOUT)
def test_attention_dropout(variant: str) -> None:
    """The variant itself drops attention weights at the rate asked, rescaled so the expectation
    is unchanged."""
    B, H, T, D = 4000, 2, 8, 8  # one call draws a mask per row: 4000 draws
    torch.manual_seed(0)
    q, k = (torch.randn(1, H, T, D).expand(B, H, T, D) for _ in range(2))
    v = torch.eye(T).expand(B, H, T, D)  # the output is then the attention weights themselves
    config = tiny_config(variant, n_head=H, n_embd=H * D, dropout=0.5)
    mask = GPT(config).attention_mask(T)
    fn = VARIANTS[variant].fn
    exact = fn(q, k, v, mask, 0.0)[0]
    draws = fn(q, k, v, mask, 0.5)
    assert not torch.allclose(draws[0], exact), "dropout_p is ignored"
    assert not torch.equal(draws[0], draws[1]), "the same mask for every row"
    assert not torch.equal(fn(q, k, v, mask, 0.5), draws), "the same masks every call"
    # The weights a query may attend to are all above 0; dropped, they read exactly 0.
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    dropped = (draws[..., allowed] == 0).float().mean().item()
    assert abs(dropped - 0.5) < 0.01, f"{dropped:.3f} of the weights dropped at dropout_p=0.5"
    # Unbiased: the mean over draws approaches the output without dropout (a weight of 1 reads
    # 0 or 2, so its mean's sd is 1/sqrt(4000) = 0.016; observed max error ~0.03; dropping
    # without the 1/(1-p) rescale misses by ~0.5).
    torch.testing.assert_close(draws.mean(0), exact, rtol=0, atol=0.08)


@pytest.mark.parametrize("variant", WITH_DROPOUT)
def test_model_dropout_only_in_training(variant: str) -> None:
    torch.manual_seed(0)
    reference, model = twin_models(variant, torch.float32, dropout=0.5)
    idx = torch.randint(0, 97, (2, 20))
    model.train()
    assert not torch.equal(model(idx)[0], model(idx)[0]), "dropout is not active in training"
    model.eval(), reference.eval()
    torch.testing.assert_close(model(idx)[0], reference(idx)[0], rtol=1e-5, atol=1e-5)


def test_cpu_flash_with_dropout_is_refused() -> None:
    with pytest.raises(VariantUnavailable, match="sdpa-flash") as info:
        check_variant("sdpa-flash", "cpu", torch.float32, head_size=8, dropout_p=0.1)
    # torch's reasons, in words: without the C++ source lines its warnings end with
    assert "not support non-zero dropout" in str(info.value)
    assert "Triggered internally" not in str(info.value) and ".cpp" not in str(info.value)


@pytest.mark.parametrize("variant", ["sdpa-efficient", "sdpa-cudnn", "flex"])
def test_unavailable_on_cpu_says_why(variant: str) -> None:
    with pytest.raises(VariantUnavailable) as err:
        check_variant(variant, "cpu", torch.float32)
    message = str(err.value)
    assert variant in message and "cpu" in message and "CUDA" in message


def test_a_refusal_without_a_message_is_named_by_its_type(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuses(*args: Any) -> Tensor:
        raise RuntimeError("")

    monkeypatch.setitem(VARIANTS, "naive", dataclasses.replace(VARIANTS["naive"], fn=refuses))
    assert unavailable_reason("naive", "cpu", torch.float32, 16) == "RuntimeError"


@pytest.mark.parametrize("variant", OFF_CUDA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_variant_not_marked_cuda_only_trains_on_the_cpu(variant: str, dtype: torch.dtype) -> None:
    """The tests above take the registry's word for which variants run on the CPU; here it is
    checked. One that raises (a bug in its code) fails here with its error, where a test list
    made by running each would have left it out as one the CPU cannot run."""
    reason = unavailable_reason(variant, "cpu", dtype, head_size=8)
    assert reason is None, (
        f"{variant}: {reason} (if it cannot run off CUDA, say why in its cuda_only_reason)"
    )


def test_a_variant_that_cannot_take_the_signature_fails_where_it_is_registered() -> None:
    def four(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        return q

    with pytest.raises(TypeError, match=r"attention variant 'four': its function takes \(q: "):
        dataclasses.replace(VARIANTS["naive"], name="four", fn=four)
    with pytest.raises(TypeError, match=r"cannot be called as fn\(q, k, v, mask, dropout_p\)"):
        dataclasses.replace(VARIANTS["naive"], fn=lambda q, k, v: q)
    # Extra arguments with defaults, or *args, take the signature
    dataclasses.replace(VARIANTS["naive"], fn=lambda q, k, v, mask, dropout_p, scale=None: q)
    dataclasses.replace(VARIANTS["naive"], fn=lambda *args: args[0])


@pytest.mark.parametrize(
    ("returns", "said"),
    [
        (lambda q, k, v, mask, p: q.transpose(1, 2), "a tensor of shape (1, 128, 2, 8)"),
        (lambda q, k, v, mask, p: (q, None), "a tuple"),
    ],
)
def test_a_variant_that_returns_another_shape_is_refused(
    monkeypatch: pytest.MonkeyPatch, returns: Any, said: str
) -> None:
    """(B, T, H, D) has the elements of (B, H, T, D): the model would reshape it into (B, T, C)
    and train on it without a word."""
    monkeypatch.setitem(VARIANTS, "naive", dataclasses.replace(VARIANTS["naive"], fn=returns))
    for backward in (True, False):
        reason = unavailable_reason("naive", "cpu", torch.float32, 8, backward=backward)
        assert reason == (
            f"it returns {said} for q, k, v of shape (1, 2, 128, 8); every variant returns y "
            "of q's shape, (B, H, T, D)"
        )


def test_a_pin_the_device_does_not_honour_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where SDPA may run its own kernel whatever the pin (MPS), the probe's trace must show
    the pinned backend's op. Here the CPU stands in for such a device, and a variant pinned
    to flash runs math: refused, naming both; the honest pins pass."""
    from training import probe

    monkeypatch.setattr(probe, "PINS_RAISE", frozenset())
    for name in ("sdpa-math", "sdpa-flash"):
        assert unavailable_reason(name, "cpu", torch.float32, 16) is None, name
    runs_math = VARIANTS["sdpa-math"].fn
    monkeypatch.setitem(
        VARIANTS, "sdpa-flash", dataclasses.replace(VARIANTS["sdpa-flash"], fn=runs_math)
    )
    reason = unavailable_reason("sdpa-flash", "cpu", torch.float32, 16)
    assert reason is not None and "SDPBackend.FLASH_ATTENTION" in reason, reason
    assert "aten::_scaled_dot_product_attention_math" in reason, reason
    # Under a profiler already running (a sweep's), the probe does not start its own
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        unavailable_reason("sdpa-math", "cpu", torch.float32, 16)


@pytest.mark.cxx
def test_forward_only_check_passes_flex_on_cpu_and_nothing_else_new() -> None:
    """Inference needs only the forward: flex's runs on a CPU; the CUDA-only kernels do not."""
    assert unavailable_reason("flex", "cpu", torch.float32, 16, backward=False) is None
    assert "CUDA" in unavailable_reason("flex", "cpu", torch.float32, 16)
    for variant in ("sdpa-efficient", "sdpa-cudnn"):
        assert "CUDA" in unavailable_reason(variant, "cpu", torch.float32, 16, backward=False)


def test_flex_refuses_dropout() -> None:
    with pytest.raises(ValueError, match="'flex' cannot apply attention dropout"):
        tiny_config("flex", dropout=0.1)
    # Called directly, past the config's check, it raises rather than drop nothing.
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"flex has no attention dropout: dropout_p=0\.1"):
        VARIANTS["flex"].fn(q, q, q, None, 0.1)


def flex_graphs(lengths: Iterable[int], grad: bool) -> int:
    """Graphs compiled for flex's forward at these lengths, checked against SDPA. flex
    cannot train on CPU, but its compiled forward runs here and compiles the same way, at
    lengths padded to whole blocks (causal_block_mask)."""
    from torch._dynamo.utils import counters

    from model.attention import causal_block_mask, flex

    torch._dynamo.reset()
    counters.clear()
    for T in lengths:
        q, k, v = (torch.randn(1, 2, T, 16) for _ in range(3))  # as the variant check's
        with torch.set_grad_enabled(grad):
            out = flex(q, k, v, causal_block_mask(T, torch.device("cpu")), 0.0)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(out, expected)
    return counters["stats"]["unique_graphs"]


@pytest.mark.slow
@pytest.mark.cxx
def test_flex_without_gradients_does_not_compile_per_length() -> None:
    """generate() calls attention at a new length each token; a CPU pads it to whole blocks,
    a new length each FLEX_BLOCK tokens. Over 15 lengths of 1 to 7 blocks: a graph for the
    first block count, then one symbolic graph for the rest (the BlockMask's tensors, sized by
    the count of blocks, are static in the first). The first is the variant check's graph
    (one block, no gradients): its C++ kernel is built once in a test session."""
    lengths = range(8, 7 * FLEX_BLOCK, 61)
    assert flex_graphs(lengths, grad=False) <= 2, "flex recompiled for new lengths"


@pytest.mark.slow
@pytest.mark.cxx
def test_flex_training_kernel_is_specialised_to_its_shape() -> None:
    """The variant check runs flex at a small shape before training runs it at the real
    one: that second shape must get a static kernel of its own, not a symbolic one, which
    would serve a third shape without compiling. (Whole blocks: a CPU runs them unpadded, as a
    GPU runs every length.)"""
    from model.attention import causal_block_mask, flex

    assert flex_graphs([FLEX_BLOCK, 2 * FLEX_BLOCK], grad=True) == 2
    T = 3 * FLEX_BLOCK
    q, k, v = (torch.randn(1, 2, T, 16) for _ in range(3))
    mask = causal_block_mask(T, torch.device("cpu"))  # outside: only flex's compile is refused
    with (
        torch.compiler.set_stance("fail_on_recompile"),  # the third shape is not compiled
        pytest.raises(RuntimeError, match="Detected recompile"),
    ):
        flex(q, k, v, mask, 0.0)


@pytest.mark.cxx
def test_flex_on_a_cpu_is_exact_where_the_last_block_is_part_filled() -> None:
    """Unpadded, Inductor's C++ kernel for flex (PyTorch 2.13) returned wrong rows at these
    lengths, NaN at times, differing from run to run; padded to whole blocks, it matches."""
    assert flex_graphs([8, 24, 40, 56] * 3, grad=False) == 1


@pytest.mark.slow
@pytest.mark.cxx
@pytest.mark.parametrize("name", ["sdpa-math", "sdpa-flash"])
def test_pinned_backend_holds_inside_compiled_blocks(name: str) -> None:
    """torch.compile picks its own SDPA backend; a pinned variant must still run its own."""
    from torch.profiler import profile

    from training.cpu_linear import use_onednn_linears, wants_onednn
    from training.probe import BACKEND_OPS

    # The profiler tests' blocks, linears included (a sweep's cpu_linear="auto" picks them):
    # their C++ kernels are built once in a test session.
    model = GPT(tiny_config(name, n_head=2))
    if wants_onednn("auto", torch.device("cpu"), autocast=False):
        use_onednn_linears(model)
    for block in model.blocks:
        block.compile()
    idx = torch.randint(0, 97, (2, 32))
    model(idx, idx)[1].backward()  # compiles
    with profile() as prof:
        model(idx, idx)[1].backward()
    ran = {e.name for e in prof.events()}
    pinned = VARIANTS[name].backend.name
    for backend, ops in BACKEND_OPS.items():
        assert (backend == pinned) == bool(ran.intersection(ops)), (backend, sorted(ran))


def test_layers_keep_the_pinned_variants_out_of_compiled_graphs() -> None:
    """A layer calls Variant.layer_fn: for a pinned variant its fn under
    torch.compiler.disable, one wrapper shared by every layer; for any other, fn itself."""
    for name, variant in VARIANTS.items():
        if variant.backend is None:
            assert variant.layer_fn is variant.fn, name
            continue
        wrapped = variant.layer_fn
        assert wrapped is not variant.fn and wrapped is variant.layer_fn, name
        assert getattr(wrapped, "_torchdynamo_disable", False), name
        assert torch._dynamo.eval_frame.innermost_fn(wrapped) is variant.fn, name
    model = GPT(tiny_config("sdpa-math", n_head=2))
    assert all(b.attn.attend is VARIANTS["sdpa-math"].layer_fn for b in model.blocks)


def test_the_commands_start_without_the_compilers_import() -> None:
    """torch._dynamo takes about 2 s to import. The commands' modules and a model of an
    unpinned variant leave it out: `sample.py --help`, or a bad flag, would pay it at every
    start. (A pinned variant's layer imports it when built, to keep its call out of compiled
    graphs, as test_pinned_backend_holds_inside_compiled_blocks checks; building an optimizer
    imports it too: torch.optim's own use.)"""
    code = (
        "import sys, train, sample, profile_train, data.prepare\n"
        "from model import GPT, GPTConfig\n"
        "GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "False\n", "torch._dynamo was imported"


@pytest.mark.cuda
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cuda_variant_matches_naive_bf16(variant: str) -> None:
    dtype = torch.bfloat16
    try:
        check_variant(variant, "cuda", dtype, head_size=16)
    except VariantUnavailable as e:
        pytest.skip(str(e))
    torch.manual_seed(0)
    reference = GPT(tiny_config("naive", n_embd=64)).cuda()
    other = GPT(tiny_config(variant, n_embd=64)).cuda()
    other.load_state_dict(reference.state_dict())
    idx = torch.randint(0, 97, (2, 64), device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        logits_ref, loss_ref = reference(idx, idx)
        logits, loss = other(idx, idx)
    loss_ref.backward()
    loss.backward()
    torch.testing.assert_close(logits.float(), logits_ref.float(), rtol=2e-2, atol=2e-2)
    grads_ref = dict(reference.named_parameters())
    for name, p in other.named_parameters():
        torch.testing.assert_close(p.grad, grads_ref[name].grad, rtol=5e-2, atol=5e-3)


@pytest.mark.cuda
def test_cuda_fused_backends_available_in_bf16() -> None:
    # On a recent GPU the pinned fused backends must run; if one does not, say which and why.
    runnable = available_variants("cuda", torch.bfloat16, head_size=64)
    assert {"sdpa-flash", "sdpa-efficient"} <= set(runnable), runnable
    # On Hopper (an H200, torch 2.11) cuDNN's and flex's ran too: a skip of either in
    # test_cuda_variant_matches_naive_bf16 there is a regression, not a limit of the GPU
    if torch.cuda.get_device_capability()[0] == 9:
        assert {"sdpa-cudnn", "flex"} <= set(runnable), runnable


@pytest.mark.cuda
@pytest.mark.parametrize("n_layer", [1, 2])
def test_cuda_hidden_copy_in_a_training_step(n_layer: int) -> None:
    extra = clones_in_one_training_step("naive", n_layer, "cuda") - clones_in_one_training_step(
        "inplace", n_layer, "cuda"
    )
    assert extra == n_layer
