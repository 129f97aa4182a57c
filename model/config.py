"""GPTConfig: the architecture's knobs, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from model.attention import VARIANTS, unknown_variant


@dataclass
class GPTConfig:
    vocab_size: int = 2048  # tokenizer vocabulary; the LM head shares the embedding matrix
    block_size: int = 256  # longest context; sizes the position table and the causal mask
    n_layer: int = 4  # transformer blocks; the depth axis along which per-layer costs add up
    n_head: int = 4  # attention heads; head size is n_embd // n_head
    n_embd: int = 128  # residual stream width
    dropout: float = 0.0  # on embeddings, attention probabilities and residual branches
    bias: bool = True  # biases in Linear and LayerNorm, as in GPT-2; False is a little faster
    # A name from model.attention.VARIANTS. naive, the reference every other variant is checked
    # and timed against, is slower than SDPA's fused kernels; configs/default.toml trains sdpa.
    attention: str = "naive"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"model.{name}={value!r}: must be a positive integer")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"model.n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                f"each head gets n_embd // n_head channels"
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)):
            raise ValueError(f"model.dropout={self.dropout!r}: must be a number in [0, 1)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout!r}: must be in [0, 1)")
        if not isinstance(self.bias, bool):
            raise ValueError(f"model.bias={self.bias!r}: must be true or false")
        if self.attention not in VARIANTS:
            raise ValueError(f"model.attention: {unknown_variant(self.attention)}")
        variant = VARIANTS[self.attention]
        if self.dropout > 0 and not variant.supports_dropout:
            raise ValueError(
                f"model.attention={self.attention!r} cannot apply attention dropout "
                f"(dropout={self.dropout}); use dropout=0 or another variant"
            )

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head
