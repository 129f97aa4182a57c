"""A GPT-2 style causal language model whose attention is chosen by name.

Shape legend: B batch, T sequence length, C n_embd, H n_head, D head size (C // H), V vocab.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model.attention import Mask, bool_causal_mask, get_variant
from model.config import GPTConfig
from model.sampling import check_sampling, next_token


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.attend = get_variant(config.attention).layer_fn  # looked up once, here

    def forward(self, x: Tensor, mask: Mask) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        dropout_p = self.dropout if self.training else 0.0
        y = self.attend(q, k, v, mask, dropout_p)  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm: normalise the input of each branch, keep the residual stream raw."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, mask: Mask) -> Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Tied: the same matrix embeds tokens and scores them; saves V*C parameters.
        self.lm_head.weight = self.wte.weight
        self.variant = get_variant(config.attention)
        # For the variants that read a boolean mask: True above the diagonal, positions a
        # query may not see. Built once for the longest context and sliced per forward; the
        # others (SDPA, flex) hold none, as it would take block_size^2 bytes. Not persistent:
        # it is derived, not learned.
        mask = None
        if self.variant.make_mask is None:
            mask = bool_causal_mask(config.block_size)
        self.register_buffer("causal_mask", mask, persistent=False)
        self.apply(self._init_weights)
        # GPT-2: each block adds two residual branches, so scale their output projections
        # by 1/sqrt(2 * n_layer) to keep the residual stream's variance flat with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; position embeddings excluded by default, as in FLOP estimates."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self) -> int:
        """Matmul FLOPs of one training step (forward and backward) per token of block_size
        context: 6N for the N weights that multiply (the linear layers' and the tied head's;
        nanoGPT's N, also without the position table, counts biases and norms too), plus
        12 * n_layer * block_size * n_embd for attention's two (T, T) products over the full
        T x T, as nanoGPT and PaLM count them. The profiler's FLOP counter gets the same."""
        c = self.config
        matmul_weights = sum(p.numel() for p in self.parameters() if p.dim() == 2)
        matmul_weights -= self.wpe.weight.numel()  # looked up, not multiplied
        return 6 * matmul_weights + 12 * c.n_layer * c.block_size * c.n_embd

    def attention_mask(self, T: int) -> Mask:
        """The causal mask for length T in the form this model's attention variant takes."""
        if self.variant.make_mask is not None:
            return self.variant.make_mask(T, self.wpe.weight.device)
        return self.causal_mask[:T, :T]

    def features(self, idx: Tensor) -> Tensor:
        """idx (B, T) token ids -> the final normalised hidden states (B, T, C)."""
        _, T = idx.shape
        if self.config.block_size < T:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        mask = self.attention_mask(T)  # once per forward, outside any compiled block
        for block in self.blocks:
            x = block(x, mask)
        return self.ln_f(x)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """idx (B, T) token ids -> logits (B, T, V) and, given targets (B, T), the mean loss.

        Targets equal to -1 are ignored by the loss.
        """
        logits = self.lm_head(self.features(idx))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1
            )
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        stop_id: int | None = None,
        logits_hook: Callable[[int, Tensor], Tensor] | None = None,
        on_token: Callable[[Tensor], None] | None = None,
    ) -> Tensor:
        """Extend idx (B, T) by max_new_tokens tokens, each drawn by `sampling.next_token`
        (temperature, top_k, top_p: see there). The model's mode is the caller's, as in
        nanoGPT: call .eval() first, or dropout, if the config has any, applies here too.

        stop_id: stop once every row has sampled it (a row that has goes on sampling until
        then: cut each at its first stop_id after the prompt).
        logits_hook: logits_hook(step, logits) gets each step's fp32 scores (B, V) and returns
        those to draw from, before temperature, top_k and top_p: -inf where an id may not be
        drawn, or fewer columns (ids from there up are never drawn).
        on_token: called with each step's sampled ids (B, 1) as they are drawn (to stream).
        """
        check_sampling(temperature, top_k, top_p)
        stopped = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
        for step in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]
            # Only the last position's scores are needed: (B, C) @ (C, V), not (B, T, C) @ (C, V).
            # Drawn from in fp32 (under autocast the head's output is bf16: this upcasts it,
            # its rounding stays).
            logits = self.lm_head(self.features(context)[:, -1, :]).float()  # (B, V)
            if logits_hook is not None:
                logits = logits_hook(step, logits)
            next_id = next_token(logits, temperature, top_k, top_p, generator)  # (B, 1)
            idx = torch.cat((idx, next_id), dim=1)
            if on_token is not None:
                on_token(next_id)
            if stop_id is not None:
                stopped |= next_id[:, 0] == stop_id
                if bool(stopped.all()):
                    break
        return idx
