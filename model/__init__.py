"""The network only: config, attention variants, GPT."""

from model.attention import (
    VARIANTS,
    get_variant,
    unknown_variant,
)
from model.config import GPTConfig
from model.gpt import GPT

__all__ = [
    "GPT",
    "VARIANTS",
    "GPTConfig",
    "get_variant",
    "unknown_variant",
]
