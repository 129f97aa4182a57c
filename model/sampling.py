"""How `GPT.generate` picks the next token from the last position's scores: temperature,
top-k, top-p (nucleus). Shape legend: B batch, V the ids that can be drawn."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """A ValueError naming the setting that no sampler can use."""
    if not temperature >= 0:  # NaN too
        raise ValueError(f"temperature={temperature}: must be >= 0")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k={top_k}: must be a positive integer or None")
    if top_p is not None and not 0 < top_p <= 1:  # NaN too
        raise ValueError(f"top_p={top_p}: must be in (0, 1] or None")


def next_token(
    logits: Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> Tensor:
    """One id (B, 1) drawn from fp32 scores (B, V), -inf where an id may not be drawn.

    Temperature 0 (or below fp32's smallest normal number, ~1e-38) is greedy, and an infinite
    one samples uniformly. top_k keeps the k likeliest tokens; top_p then the fewest of the
    likeliest whose probabilities, after temperature, add up to at least top_p. Likeliest by
    the model's scores: with an infinite temperature, top_k=1 is still greedy."""
    if temperature < torch.finfo(logits.dtype).tiny:  # 0, or too small for fp32: greedy
        return logits.argmax(dim=-1, keepdim=True)
    # Shifted so the largest is 0: a tiny temperature then gives 0 and -inf, not inf, and an
    # infinite one all zeros (uniform), not NaN.
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    # Masked-out ids (-inf) stay -inf, where an infinite temperature would make NaN.
    scaled = (shifted / temperature).masked_fill(shifted.isneginf(), float("-inf"))
    # The likeliest are chosen by the model's scores, not the scaled ones: a huge temperature
    # ties them all at 0, and top_k or top_p would then keep any.
    if top_k is not None:
        scaled = scaled.masked_fill(~_top_k(shifted, top_k), float("-inf"))
    probs = F.softmax(scaled, dim=-1)
    if top_p is not None and top_p < 1:
        order = shifted.argsort(dim=-1, descending=True, stable=True)
        probs = nucleus(probs, top_p, order)
    return torch.multinomial(probs, num_samples=1, generator=generator)


def _top_k(scores: Tensor, k: int) -> Tensor:
    """A mask (B, V) of exactly k ids: those scoring above the k-th score, then of those tied
    with it (bf16 scores tie often) the lowest ids, as argmax breaks ties, so k=1 is greedy.
    O(V), where a full sort costs several times more per token at GPT-2's vocabulary."""
    k = min(k, scores.size(-1))
    kth = torch.topk(scores, k).values[:, -1:]
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(dim=-1, keepdim=True)  # places left for the tied
    return above | (tied & (tied.cumsum(dim=-1) <= room))


def nucleus(probs: Tensor, top_p: float, order: Tensor) -> Tensor:
    """probs (B, V) cut to the fewest likeliest tokens whose mass reaches top_p (the likeliest
    is always kept); multinomial renormalises what is left. order (B, V) ranks the ids from
    likeliest, by the model's scores: they order the tokens as probs do but without the ties a
    huge temperature makes, and a stable sort keeps the same tokens on every device."""
    sorted_probs = probs.gather(-1, order)
    # Drop a token when the mass before it already reaches top_p.
    drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
    return probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
