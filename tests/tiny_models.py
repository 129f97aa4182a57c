"""Tiny models for the model and attention tests: the config both build them from."""

from __future__ import annotations

from model import GPTConfig


def tiny_config(attention: str = "naive", **overrides) -> GPTConfig:
    fields = dict(vocab_size=97, block_size=64, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
    fields.update(overrides)
    return GPTConfig(attention=attention, **fields)
