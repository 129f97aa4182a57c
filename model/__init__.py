"""The network only: config, attention variants, GPT."""

from model.attention import (
    VARIANTS,
    bool_causal_mask,
    get_variant,
    unknown_variant,
)
from model.config import GPTConfig
from model.gpt import GPT

__all__ = [
    "GPT",
    "VARIANTS",
    "GPTConfig",
    "bool_causal_mask",
    "get_variant",
    "unknown_variant",
]
