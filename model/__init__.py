"""The network only: config, attention variants, GPT."""

from model.attention import (
    VARIANTS,
    VariantUnavailable,
    available_variants,
    check_variant,
    get_variant,
    unavailable_reason,
    unknown_variant,
)
from model.config import GPTConfig
from model.gpt import GPT

__all__ = [
    "GPT",
    "VARIANTS",
    "GPTConfig",
    "VariantUnavailable",
    "available_variants",
    "check_variant",
    "get_variant",
    "unavailable_reason",
    "unknown_variant",
]
