"""Whether an attention variant can run on a device and dtype, decided by running it.

A variant that cannot run is named with the reason, before any model is built: train.py, the
profiler, sample.py and the scripts ask here, and none of them falls back to another variant.
"""

from __future__ import annotations

import contextlib
import re
import warnings

import torch
from torch.profiler import ProfilerActivity

from console import first_line, quiet_profiler_start
from model import VARIANTS, bool_causal_mask, get_variant


class VariantUnavailable(RuntimeError):
    """An attention variant that cannot run (train, or infer) on a device and dtype."""


# The ATen op by which a trace shows each SDPA backend ran: how a pinned variant's profiled
# cell is checked, and its probe where the device may ignore a pin (not in PINS_RAISE). On
# MPS the math backend is a kernel of its own.
BACKEND_OPS = {
    "MATH": (
        "aten::_scaled_dot_product_attention_math",
        "aten::_scaled_dot_product_attention_math_for_mps",
    ),
    "FLASH_ATTENTION": (
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
    ),
    "EFFICIENT_ATTENTION": ("aten::_scaled_dot_product_efficient_attention",),
    "CUDNN_ATTENTION": ("aten::_scaled_dot_product_cudnn_attention",),
}
# Devices where SDPA pinned to a backend that cannot take the inputs raises instead of running
# another kernel (CUDA's seen on an H200; the CPU's by the tests). On others (MPS: whether its
# SDPA reads the pin depends on the build) a probe checks its trace for the backend's op.
PINS_RAISE = frozenset({"cpu", "cuda"})


_TRIGGERED = re.compile(r"\s*\(Triggered internally at [^)]*\)")


def unavailable_reason(
    name: str,
    device: torch.device | str,
    dtype: torch.dtype,
    head_size: int = 64,
    dropout_p: float = 0.0,
    backward: bool = True,
) -> str | None:
    """Why `name` cannot train on `device` in `dtype` (with `backward=False`: cannot run its
    forward, as inference does), or None if it can.

    Decided by running it: a tiny causal forward, and backward, at this head size. For pinned
    SDPA backends that is the only honest test, since their constraints (dtype, head size,
    dropout, GPU generation, build) differ by version and device.
    """
    variant = get_variant(name)
    device = torch.device(device)
    if (
        variant.cuda_only_reason
        and device.type != "cuda"
        and (backward or not variant.forward_off_cuda)
    ):
        return variant.cuda_only_reason
    if dropout_p > 0 and not variant.supports_dropout:
        return "it has no attention dropout"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available"
    T = 128
    q, k, v = (
        torch.randn(1, 2, T, head_size, device=device, dtype=dtype, requires_grad=backward)
        for _ in range(3)
    )
    if variant.make_mask is not None:
        mask = variant.make_mask(T, device)
    else:
        mask = bool_causal_mask(T, device)
    # Elsewhere than PINS_RAISE a device may run its own kernel whatever the pin, so the
    # probe's trace must show the pinned backend's op (not under a profiler already running:
    # one at a time).
    traced = variant.backend is not None and device.type not in PINS_RAISE
    traced &= not torch.autograd._profiler_enabled()
    if traced:
        quiet_profiler_start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with (
                torch.profiler.profile(activities=[ProfilerActivity.CPU])
                if traced
                else contextlib.nullcontext()
            ) as trace:
                with torch.set_grad_enabled(backward):
                    out = variant.fn(q, k, v, mask, dropout_p)
                if backward and _same_shape(out, q):  # else said below
                    out.sum().backward()
        except (RuntimeError, NotImplementedError, ValueError) as e:
            # torch explains why a pinned kernel refused the inputs in warnings; keep them,
            # without the C++ source line each ends with.
            why = [
                _TRIGGERED.sub("", str(w.message)).strip()
                for w in caught
                if "kernel" in str(w.message)
            ]
            first = " ".join(first_line(e).split())
            return "; ".join(part.rstrip(".") for part in [first, *why]).replace(":; ", ": ")
    if not _same_shape(out, q):  # the model would view a (B, T, H, D) y as (B, T, C) silently
        got = (
            f"a tensor of shape {tuple(out.shape)}"
            if isinstance(out, torch.Tensor)
            else f"a {type(out).__name__}"
        )
        return (
            f"it returns {got} for q, k, v of shape {tuple(q.shape)}; every variant returns "
            "y of q's shape, (B, H, T, D)"
        )
    if traced and variant.backend is not None:
        instead = sdpa_ops_instead(variant.backend.name, {e.name for e in trace.events()})
        if instead is not None:
            return (
                f"PyTorch does not honour a pin to SDPBackend.{variant.backend.name} here: "
                f"it ran {', '.join(instead) or 'no SDPA op'} instead"
            )
    return None


def sdpa_ops_instead(backend: str, ran: set[str]) -> list[str] | None:
    """None if the ATen ops in `ran` show `backend` ran (BACKEND_OPS); otherwise the SDPA ops
    they show instead, if any."""
    if ran.intersection(BACKEND_OPS[backend]):
        return None
    return sorted(op for op in ran if "scaled_dot_product" in op)


def _same_shape(out: object, q: torch.Tensor) -> bool:
    return isinstance(out, torch.Tensor) and out.shape == q.shape


def check_variant(
    name: str,
    device: torch.device | str,
    dtype: torch.dtype,
    head_size: int = 64,
    dropout_p: float = 0.0,
    backward: bool = True,
) -> None:
    """Raise VariantUnavailable, naming the variant, device, dtype and reason, if it can't run
    (train, or with `backward=False` run its forward)."""
    reason = unavailable_reason(name, device, dtype, head_size, dropout_p, backward)
    if reason is not None:
        raise VariantUnavailable(
            f"attention variant {name!r} cannot run on {torch.device(device)} "
            f"({str(dtype).removeprefix('torch.')}, head size {head_size}, "
            f"dropout {dropout_p}): {reason}"
        )


def available_variants(
    device: torch.device | str,
    dtype: torch.dtype,
    head_size: int = 64,
    dropout_p: float = 0.0,
) -> list[str]:
    """The variant names that can train on this device and dtype, in registry order."""
    return [
        n for n in VARIANTS if unavailable_reason(n, device, dtype, head_size, dropout_p) is None
    ]
