"""fp32 Linear layers through oneDNN on x86 CPUs: the same math at up to twice the matmul rate.

On a CPU, PyTorch sends an fp32 `F.linear` to its BLAS, which in the x86 wheels is MKL. On
the 2-core AMD EPYC machine this project is measured on, MKL's fp32 matmul reaches about 213
GFLOP/s, the AVX2 rate (MKL_ENABLE_INSTRUCTIONS=AVX512 changes nothing: MKL keeps its
AVX-512 code for Intel processors), while oneDNN, which the same wheels ship and which picks
its code by instruction set, reaches about 475 with AVX-512, for the same fp32 results.

`use_onednn_linears(model)` makes every `nn.Linear` of a model run its forward and backward
through oneDNN. Parameters, state dict and architecture are unchanged; `model/` knows nothing
of it. `torch.utils.flop_counter` learns to count the oneDNN op here, so FLOP counts and MFU
do not depend on which path ran.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import register_flop_formula

from training.config import ConfigError

LINEAR_PATHS = {"onednn": "oneDNN", "torch": "PyTorch BLAS"}  # the CPU nn.Linear paths, by name


def cpu_field(name: str) -> str | None:
    """A field of /proc/cpuinfo ('vendor_id', 'model name'), or None where there is none."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    return None


def onednn_unavailable_reason() -> str | None:
    """Why the oneDNN path cannot run in this build, or None if it can."""
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN (mkldnn)"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this PyTorch build lacks torch.ops.mkldnn._linear_pointwise"
    return None


def wants_onednn(choice: str, device: torch.device, autocast: bool) -> bool:
    """Resolve `train.cpu_linear` for a run; a ConfigError where 'onednn' cannot apply.

    'auto' takes oneDNN for fp32 CPU runs on AMD processors with AVX-512, where it was
    measured at about twice MKL's matmul rate (oneDNN at AVX-512, MKL at AVX2). Elsewhere it
    keeps PyTorch's path: on Intel CPUs MKL runs AVX-512 already, and without AVX-512 both
    run AVX2 (one shape, the LM head, was slower through oneDNN there); no gain was measured
    on either, so set 'onednn' to try.
    """
    if choice == "torch":
        return False
    reason = onednn_unavailable_reason()
    if choice == "auto":
        amd = cpu_field("vendor_id") == "AuthenticAMD"
        avx512 = "avx512f" in (cpu_field("flags") or "").split()
        return device.type == "cpu" and not autocast and reason is None and amd and avx512
    if device.type != "cpu":
        raise ConfigError(f"train.cpu_linear='onednn' is for CPU runs; this one is on {device}")
    if reason is not None:
        raise ConfigError(f"train.cpu_linear='onednn': {reason}")
    if autocast:
        raise ConfigError("train.cpu_linear='onednn' runs fp32 only; set train.dtype=float32")
    return True


@torch.library.custom_op(
    "cpu_linear::linear",
    mutates_args=(),
    device_types="cpu",
    schema="(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
)
def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x (M, K) @ weight (N, K).T + bias, in oneDNN.

    A custom op, so that torch.compile keeps it as one opaque kernel call: Inductor's own
    lowering of the oneDNN op takes frozen (inference) weights only.
    """
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _save(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor | None], output: Tensor) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight)


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    x, weight = ctx.saved_tensors  # x (M, K), weight (N, K); grad (M, N)
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_x = _linear(grad, weight.t(), None)  # (M, N) @ (N, K) -> (M, K)
    if ctx.needs_input_grad[1]:
        # grad.T @ x, (N, M) @ (M, K) -> (N, K). oneDNN copies a transposed first operand
        # into place, so the product is taken in the orientation whose first operand is
        # narrower: 1.5-1.8x faster here.
        if weight.shape[0] >= weight.shape[1]:
            grad_w = _linear(x.t(), grad.t(), None).t().contiguous()  # ((K, M) @ (M, N)).T
        else:
            grad_w = _linear(grad.t(), x.t(), None)  # (N, M) @ (M, K)
    if ctx.needs_input_grad[2]:
        grad_b = grad.sum(0)  # (N,)
    return grad_x, grad_w, grad_b


_linear.register_autograd(_backward, setup_context=_save)


class OneDNNLinear(nn.Linear):
    """An nn.Linear whose forward and backward run through oneDNN (fp32, CPU); any other
    input (another dtype, under autocast, off the CPU, an empty batch) takes nn.Linear's path."""

    def forward(self, x: Tensor) -> Tensor:
        fp32 = x.dtype == self.weight.dtype == torch.float32
        if not (fp32 and x.is_cpu and x.numel() and not torch.is_autocast_enabled("cpu")):
            return super().forward(x)
        y = _linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


def use_onednn_linears(model: nn.Module) -> int:
    """Route every nn.Linear of model through oneDNN, in place; returns how many.

    The modules change class, as `torch.nn.utils.parametrize` does, and nothing else: weights
    (tied ones included) stay the same Parameters.
    """
    reason = onednn_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"oneDNN linears: {reason}")
    swapped = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
            swapped += 1
    return swapped


@register_flop_formula(torch.ops.cpu_linear.linear)
def _linear_flops(
    x_shape: torch.Size, w_shape: torch.Size, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    return 2 * x_shape[0] * x_shape[1] * w_shape[0]
