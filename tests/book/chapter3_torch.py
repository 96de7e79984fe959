"""PyTorch reference versions of the chapter-3 attention classes of
Sebastian Raschka, *Build a Large Language Model (From Scratch)*
(rasbt/LLMs-from-scratch, ch03/01_main-chapter-code/ch03.ipynb).

These are the oracles that ``npattn.book`` (the NumPy port) is tested against.
They are written independently for this project, but reproduce the book's
classes behaviourally, which is what the tests rely on:

* the same public class names and constructor signatures;
* the same sub-module / parameter / buffer names, hence the same
  ``state_dict`` keys (``W_query``, ``W_key``, ``W_value``, ``out_proj``,
  ``mask``, ``heads.<i>.``...);
* the same order of random draws in ``__init__`` (query, key, value, then
  ``out_proj``), so that a given ``torch.manual_seed`` yields the book's
  weights and printed numbers (checked in ``make_book_weights.py``);
* the same forward computation: ``scores = queries @ keys^T``, causal mask
  applied in place with ``-inf`` on the strict upper triangle (buffer
  ``triu(ones(T, T), diagonal=1)``), ``softmax(scores / d_k**0.5)``, dropout
  on the attention weights, weights @ values, and (for ``MultiHeadAttention``)
  the heads merged back and passed through ``out_proj``.

This module imports torch at import time.  Load it standalone (``importlib``
or ``sys.path``); it has no relative imports.  Tests that use it must skip
when torch is not installed.
"""

import torch
import torch.nn as nn

__all__ = [
    "SelfAttention_v1",
    "SelfAttention_v2",
    "CausalAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadAttention",
]


def _causal_mask(context_length):
    # 1.0 strictly above the diagonal = positions a token may NOT attend to.
    return torch.triu(torch.ones(context_length, context_length), diagonal=1)


class SelfAttention_v1(nn.Module):
    """Section 3.4.2: scaled dot-product self-attention, raw ``(d_in, d_out)``
    parameter matrices drawn with ``torch.rand`` (uniform [0, 1)).
    Input ``(num_tokens, d_in)`` -> output ``(num_tokens, d_out)``."""

    def __init__(self, d_in, d_out):
        super().__init__()
        # Draw order matters for seeded reproduction: query, key, value.
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x):
        keys = x @ self.W_key
        queries = x @ self.W_query
        values = x @ self.W_value
        scores = queries @ keys.T
        weights = torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1)
        return weights @ values


class SelfAttention_v2(nn.Module):
    """Section 3.4.2: same as v1 but with ``nn.Linear`` projections (default
    Kaiming-uniform init; weight stored as ``(d_out, d_in)``).
    Input ``(num_tokens, d_in)`` -> output ``(num_tokens, d_out)``."""

    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        scores = queries @ keys.T
        weights = torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1)
        return weights @ values


class CausalAttention(nn.Module):
    """Section 3.5.3: batched single-head causal self-attention with dropout
    on the attention weights.
    Input ``(b, num_tokens, d_in)`` with ``num_tokens <= context_length``
    -> output ``(b, num_tokens, d_out)``."""

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", _causal_mask(context_length))

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)

        scores = queries @ keys.transpose(1, 2)
        scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        weights = torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1)
        weights = self.dropout(weights)
        return weights @ values


class MultiHeadAttentionWrapper(nn.Module):
    """Section 3.6.1: ``num_heads`` independent ``CausalAttention`` heads whose
    outputs are concatenated on the last axis.
    Input ``(b, num_tokens, d_in)`` -> output ``(b, num_tokens, num_heads * d_out)``."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.heads = nn.ModuleList(
            CausalAttention(d_in, d_out, context_length, dropout, qkv_bias) for _ in range(num_heads)
        )

    def forward(self, x):
        return torch.cat([head(x) for head in self.heads], dim=-1)


class MultiHeadAttention(nn.Module):
    """Section 3.6.2: multi-head causal attention with one fused projection
    per Q/K/V split into ``num_heads`` heads of size ``d_out // num_heads``,
    followed by an output projection ``out_proj`` (``nn.Linear(d_out, d_out)``
    with bias).
    Input ``(b, num_tokens, d_in)`` -> output ``(b, num_tokens, d_out)``."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads

        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", _causal_mask(context_length))

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)

        # (b, T, d_out) -> (b, T, H, hd) -> (b, H, T, hd)
        split = (b, num_tokens, self.num_heads, self.head_dim)
        keys = keys.view(*split).transpose(1, 2)
        queries = queries.view(*split).transpose(1, 2)
        values = values.view(*split).transpose(1, 2)

        scores = queries @ keys.transpose(2, 3)  # (b, H, T, T)
        scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        weights = torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1)
        weights = self.dropout(weights)

        # (b, H, T, hd) -> (b, T, H, hd) -> (b, T, d_out)
        context = (weights @ values).transpose(1, 2)
        context = context.contiguous().view(b, num_tokens, self.d_out)
        return self.out_proj(context)
