"""Causal self-attention variants: one signature, one registry, looked up by name.

Shape legend: B batch, H heads, T sequence length, D head size.

Every variant is a plain function

    fn(q, k, v, mask, dropout_p) -> y

    q, k, v    (B, H, T, D)
    mask       the causal mask in the variant's own form, made once per forward pass by the
               model (outside any compiled block) and shared by every layer: for naive and
               inplace, a (T, T) bool tensor, True where a query may NOT attend, sliced from a
               buffer built once; for flex, a BlockMask from `Variant.make_mask`. SDPA
               variants get None and pass is_causal=True, so their models hold no T x T mask.
    dropout_p  probability of dropping an attention weight; 0.0 outside training.
    y          (B, H, T, D)

The layer resolves its variant once, when it is built; forward has no branch on the name.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask  # imported where flex runs

Mask: TypeAlias = "Tensor | BlockMask | None"  # the causal mask in the variant's own form
AttentionFn = Callable[[Tensor, Tensor, Tensor, Mask, float], Tensor]


def naive(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, dropout_p: float) -> Tensor:
    """The readable reference and the test oracle: five ops and one hidden copy.

    `masked_fill` is out of place, so it first copies the whole (B, H, T, T) score tensor
    (an aten::clone) and then fills the copy. That copy is what `inplace` removes.
    """
    scale = 1.0 / q.size(-1) ** 0.5
    att = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, T)
    att = att.masked_fill(mask, float("-inf"))
    att = F.softmax(att, dim=-1)
    if dropout_p > 0.0:
        att = F.dropout(att, p=dropout_p)
    return att @ v  # (B, H, T, D)


def inplace(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, dropout_p: float) -> Tensor:
    """`naive` with `masked_fill_`: the same function, one copy fewer per layer.

    Why this is safe under autograd (the blog only showed it under no_grad): an in-place op
    on a tensor whose value a backward formula saved makes that backward raise (the saved
    tensor's version counter has moved). The scores come from a multiply by a Python scalar,
    whose backward needs only that scalar, and the matmul before it saved q and k, not its
    output. So nothing saved the scores, their version bump is harmless, and masked_fill_'s
    own backward only needs the mask. softmax saves its output, which is a new tensor, so it
    is unaffected.
    """
    scale = 1.0 / q.size(-1) ** 0.5
    att = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, T)
    att.masked_fill_(mask, float("-inf"))
    att = F.softmax(att, dim=-1)
    if dropout_p > 0.0:
        att = F.dropout(att, p=dropout_p)
    return att @ v  # (B, H, T, D)


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: None, dropout_p: float) -> Tensor:
    """PyTorch's fused entry point; PyTorch picks the backend for these inputs.

    is_causal=True instead of passing `mask`: an explicit mask rules out CUDA's flash kernel
    and makes the kernels that take one (the CPU's flash kernel among them) read a T x T
    mask and compute the blocks it hides, while is_causal lets the fused kernels skip key
    blocks wholly above the diagonal: CUDA's flash, efficient and cuDNN kernels by tile, the
    CPU's flash kernel by 512-key block only, so up to T=512 it computes all of T x T and
    masks inside the block (MKL_VERBOSE shows each 64-query block times all 256 keys at
    T=256, torch 2.13). The math backend computes all of T x T.
    """
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


def _pinned(backend: SDPBackend) -> AttentionFn:
    # A model's layer keeps it out of torch.compile's graphs (Variant.layer_fn).
    def fn(q: Tensor, k: Tensor, v: Tensor, mask: None, dropout_p: float) -> Tensor:
        # sdpa_kernel with a single backend: if it cannot take these inputs, torch raises
        # instead of quietly using another kernel.
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)

    fn.__doc__ = f"SDPA pinned to SDPBackend.{backend.name}."
    return fn


def bool_causal_mask(T: int, device: torch.device | None = None) -> Tensor:
    """naive's and inplace's mask: (T, T) bool, True above the diagonal, where a query may
    not attend (SDPA's bool attn_mask reads the other way: True where it may)."""
    return torch.ones(T, T, dtype=torch.bool, device=device).triu(1)


def no_mask(T: int, device: torch.device) -> None:
    """The mask of the SDPA variants: none, is_causal=True says it."""
    return None


def _causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return q_idx >= kv_idx


@functools.cache
def _compiled_flex_attention(dynamic: bool) -> Callable[..., Tensor]:
    # flex_attention is only fast when compiled: eager mode runs a slow reference.
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=dynamic)


# flex's block: its masks are made of (BLOCK, BLOCK) tiles
FLEX_BLOCK = 128


def causal_block_mask(T: int, device: torch.device) -> BlockMask:
    """flex's causal mask for length T, built once per length and device, and reused.

    Called by the model in eager code: inside a compiled region Dynamo would trace through
    the cache and rebuild the mask on every call.

    On a CPU it covers T rounded up to whole blocks, and flex pads q, k and v to that length:
    on a 2-core AMD EPYC (Inductor's AVX2 code), its C++ kernel for flex (PyTorch 2.13)
    returned wrong rows, NaN at times and different from run to run, at lengths that end in a
    part-filled block (seen at 8, 24, 40, 56, 72 and 104, against SDPA); an Intel AVX-512
    machine did not show it, even with ATEN_CPU_CAPABILITY=avx2. At whole blocks it matched at
    every length tried. Causal, the padding is never attended by a real row, so the rows kept
    are exact.
    """
    if device.type == "cpu":
        T = -(-T // FLEX_BLOCK) * FLEX_BLOCK
    return _causal_block_mask(T, device)


@functools.cache
def _causal_block_mask(T: int, device: torch.device) -> BlockMask:
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(_causal, B=None, H=None, Q_LEN=T, KV_LEN=T, device=device)


def flex(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask, dropout_p: float) -> Tensor:
    """flex_attention with the causal BlockMask in `mask`, compiled. No dropout: flex has none.

    Training (gradients on) gets a kernel specialised to its one shape. Without gradients
    (generate(), which grows the length by one every token, and evaluation) the shapes are
    symbolic: past the first lengths one kernel serves all, where static ones would recompile
    per length until Dynamo's recompile limit sent flex to its slow eager reference. Grad
    mode, not a shape change, decides: the check that a variant runs calls it at a small
    shape first, and a shape change would make the training kernel symbolic too.

    A mask longer than q (a CPU's, see causal_block_mask) runs on q, k and v padded to its
    length, and returns q's rows.
    """
    if dropout_p > 0.0:  # GPTConfig refuses it; a direct call must not train without it
        raise ValueError(f"flex has no attention dropout: dropout_p={dropout_p} must be 0.0")
    T, padded = q.shape[-2], mask.seq_lengths[0]
    if padded > T:
        q, k, v = (F.pad(x, (0, 0, 0, padded - T)) for x in (q, k, v))
        return flex(q, k, v, mask, dropout_p)[:, :, :T]
    if torch.compiler.is_compiling():  # inside a compiled block: that graph holds it
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=mask)
    return _compiled_flex_attention(not torch.is_grad_enabled())(q, k, v, block_mask=mask)


@dataclass(frozen=True)
class Variant:
    name: str
    fn: AttentionFn
    summary: str
    backend: SDPBackend | None = None  # the SDPA backend it is pinned to, if any
    supports_dropout: bool = True
    cuda_only_reason: str | None = None  # why it cannot train off CUDA, if it cannot
    forward_off_cuda: bool = False  # its forward alone runs off CUDA all the same
    # Builds the variant's own mask for (T, device); None: the model's boolean causal mask.
    # (flex's, on a CPU, is for T rounded up to whole blocks: see causal_block_mask.)
    make_mask: Callable[[int, torch.device], Mask] | None = None

    @property
    def layer_fn(self) -> AttentionFn:
        """`fn` as a model's layer calls it. A pinned variant's is kept out of torch.compile's
        graphs: there Inductor's attention-fusion pass can rewrite the pinned math back into a
        plain SDPA call that picks its own backend (a compiled SDPA-math block ran the CPU flash
        kernel). Eager, the pin holds; the rest of a compiled block stays compiled around it."""
        return _outside_compiled_graphs(self.fn) if self.backend is not None else self.fn

    def __post_init__(self) -> None:
        # A function that cannot take the one signature fails where it is registered, naming
        # itself, not at its first call deep in a training step.
        try:
            signature = inspect.signature(self.fn)
        except (TypeError, ValueError):  # a callable whose signature Python cannot read
            return
        try:
            signature.bind("q", "k", "v", "mask", 0.0)
        except TypeError as e:
            raise TypeError(
                f"attention variant {self.name!r}: its function takes {signature}, and cannot "
                f"be called as fn(q, k, v, mask, dropout_p) ({e})"
            ) from None


@functools.cache
def _outside_compiled_graphs(fn: AttentionFn) -> AttentionFn:
    # Applied when a layer is built, not at import: torch.compiler.disable imports
    # torch._dynamo, about 2 s that every command, compiled or not, would pay at its start.
    return torch.compiler.disable(fn)


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("naive", naive, "matmul, scale, masked_fill (out of place), softmax, matmul"),
        Variant("inplace", inplace, "naive with masked_fill_: no hidden copy"),
        Variant(
            "sdpa",
            sdpa,
            "F.scaled_dot_product_attention, backend chosen by PyTorch",
            make_mask=no_mask,
        ),
        Variant(
            "sdpa-math",
            _pinned(SDPBackend.MATH),
            "SDPA pinned to the math backend",
            backend=SDPBackend.MATH,
            make_mask=no_mask,
        ),
        Variant(
            "sdpa-flash",
            _pinned(SDPBackend.FLASH_ATTENTION),
            "SDPA pinned to the flash backend",
            backend=SDPBackend.FLASH_ATTENTION,
            make_mask=no_mask,
        ),
        Variant(
            "sdpa-efficient",
            _pinned(SDPBackend.EFFICIENT_ATTENTION),
            "SDPA pinned to the memory-efficient backend",
            backend=SDPBackend.EFFICIENT_ATTENTION,
            make_mask=no_mask,
            cuda_only_reason="the memory-efficient SDPA kernel exists only for CUDA",
        ),
        Variant(
            "sdpa-cudnn",
            _pinned(SDPBackend.CUDNN_ATTENTION),
            "SDPA pinned to the cuDNN backend",
            backend=SDPBackend.CUDNN_ATTENTION,
            make_mask=no_mask,
            cuda_only_reason="the cuDNN SDPA kernel exists only for CUDA",
        ),
        Variant(
            "flex",
            flex,
            "flex_attention with a causal block mask, compiled",
            supports_dropout=False,
            cuda_only_reason=(
                "PyTorch has no flex_attention backward off CUDA; only its forward runs here"
            ),
            forward_off_cuda=True,
            make_mask=causal_block_mask,
        ),
    )
}


def get_variant(name: str) -> Variant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(unknown_variant(name)) from None


def unknown_variant(*names: str) -> str:
    """What an error says of names the registry lacks: each with the closest valid one, then
    all of them."""

    def named(name: str) -> str:
        close = difflib.get_close_matches(name, VARIANTS, n=1)
        return f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")

    plural = "s" if len(names) > 1 else ""
    return (
        f"unknown attention variant{plural} {', '.join(map(named, names))}; "
        f"valid choices: {', '.join(VARIANTS)}"
    )
