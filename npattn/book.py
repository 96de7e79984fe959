"""The attention classes of chapter 3 of *Build a Large Language Model (From Scratch)*, in NumPy.

Same names, positional signatures, parameter shapes and ``state_dict`` keys (the ``mask``
buffer included) as the book's PyTorch classes, so a state dict exported from those loads
unchanged (``load_state_dict`` accepts CPU torch tensors) and gives the same outputs and
gradients.  Each class also takes ``*, rng=None, dtype=np.float64`` and has ``backward``.

They are thin: the projections are ``npattn.Linear`` layers (``SelfAttention_v1`` holds raw
``(d_in, d_out)`` matrices as the book does), the attention is the functional
``scaled_dot_product_attention`` pair (whose default scale ``1/sqrt(d_out)`` is the book's
``keys.shape[-1] ** 0.5``), and the book's ``masked_fill_(mask.bool(), -inf)`` becomes the
may-attend mask ``mask == 0``.  Inputs are ``(num_tokens, d_in)`` or ``(batch, num_tokens, d_in)``.
"""
from __future__ import annotations

import numpy as np

from .nn import attention as _attention
from . import functional as F
from ._validate import as_float, as_rng, check_bool, check_dtype, check_prob, check_size
from .nn.layers import Linear
from .nn.module import Module, ModuleList, Parameter

__all__ = ["SelfAttention_v1", "SelfAttention_v2", "CausalAttention", "MultiHeadAttentionWrapper",
           "MultiHeadAttention"]


def _check_tokens(module, x, context_length=None):
    """The book's input: ``(num_tokens, d_in)`` or ``(batch, num_tokens, d_in)``."""
    x = as_float(x, "x", module.dtype)
    if x.ndim not in (2, 3) or x.shape[-1] != module.d_in:
        raise ValueError(
            f"x: expected shape (num_tokens, {module.d_in}) or (batch, num_tokens, {module.d_in}), got {x.shape}"
        )
    if context_length is not None and x.shape[-2] > context_length:
        raise ValueError(
            f"x: expected at most context_length={context_length} tokens, got {x.shape[-2]} (shape {x.shape})"
        )
    return x


class SelfAttention_v1(Module):
    """Self-attention with raw weight matrices ``W_query, W_key, W_value`` of shape ``(d_in, d_out)``
    drawn from U[0, 1) (the book's ``torch.rand``): ``softmax(x Wq (x Wk)^T / sqrt(d_out)) x Wv``."""

    def __init__(self, d_in, d_out, *, rng=None, dtype=np.float64):
        super().__init__()
        self.d_in, self.d_out = check_size(d_in, "d_in"), check_size(d_out, "d_out")
        self._dtype = check_dtype(dtype)
        rng = as_rng(rng)
        self.W_query = Parameter(rng.random((self.d_in, self.d_out)), self._dtype)
        self.W_key = Parameter(rng.random((self.d_in, self.d_out)), self._dtype)
        self.W_value = Parameter(rng.random((self.d_in, self.d_out)), self._dtype)

    def forward(self, x):
        x = _check_tokens(self, x)
        # x @ W is linear() with weight W.T; its weight gradient comes back transposed
        (q, cq), (k, ck), (v, cv) = (F.linear(x, W.data.T) for W in (self.W_query, self.W_key, self.W_value))
        ctx, ca = F.scaled_dot_product_attention(q, k, v)
        self._save((cq, ck, cv, ca))
        return ctx

    def backward(self, dy):
        dy = self._check_dy(dy)
        cq, ck, cv, ca = self._pop()
        dx = 0
        for W, d, c in zip((self.W_query, self.W_key, self.W_value),
                           F.scaled_dot_product_attention_backward(dy, ca), (cq, ck, cv)):
            dx_i, dwt, _ = F.linear_backward(d, c)
            self._accumulate(W, dwt.T)
            dx = dx + dx_i
        return dx


class _SingleHead(Module):
    """Three ``Linear`` projections and the functional attention pair (shared by v2 and CausalAttention)."""

    def _init_projections(self, d_in, d_out, qkv_bias, rng, dtype):
        self.d_in, self.d_out = check_size(d_in, "d_in"), check_size(d_out, "d_out")
        self._dtype = check_dtype(dtype)
        qkv_bias = check_bool(qkv_bias, "qkv_bias")
        self.rng = as_rng(rng)
        self.W_query = Linear(self.d_in, self.d_out, qkv_bias, rng=self.rng, dtype=dtype)
        self.W_key = Linear(self.d_in, self.d_out, qkv_bias, rng=self.rng, dtype=dtype)
        self.W_value = Linear(self.d_in, self.d_out, qkv_bias, rng=self.rng, dtype=dtype)

    def _attend(self, x, attn_mask=None, dropout_p=0.0):
        ctx, cache = F.scaled_dot_product_attention(self.W_query(x), self.W_key(x), self.W_value(x),
                                                    attn_mask=attn_mask, dropout_p=dropout_p, rng=self.rng)
        self._save(cache)
        return ctx

    def backward(self, dy):
        dy = self._check_dy(dy)
        dq, dk, dv = F.scaled_dot_product_attention_backward(dy, self._pop())
        return self.W_query.backward(dq) + self.W_key.backward(dk) + self.W_value.backward(dv)


class SelfAttention_v2(_SingleHead):
    """Self-attention with ``Linear`` projections ``W_query``, ``W_key``, ``W_value``."""

    def __init__(self, d_in, d_out, qkv_bias=False, *, rng=None, dtype=np.float64):
        super().__init__()
        self._init_projections(d_in, d_out, qkv_bias, rng, dtype)

    def forward(self, x):
        return self._attend(_check_tokens(self, x))


class CausalAttention(_SingleHead):
    """Single-head causal attention with dropout on the weights and the ``mask`` buffer
    (ones above the diagonal, as the book's ``torch.triu(torch.ones(...), diagonal=1)``)."""

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False, *, rng=None, dtype=np.float64):
        super().__init__()
        self._init_projections(d_in, d_out, qkv_bias, rng, dtype)
        self.context_length = check_size(context_length, "context_length")
        self.dropout = check_prob(dropout, "dropout")
        self.register_buffer("mask", np.triu(np.ones((self.context_length,) * 2, dtype=self._dtype), k=1))

    def forward(self, x):
        x = _check_tokens(self, x, self.context_length)
        n = x.shape[-2]
        return self._attend(x, attn_mask=self.mask[:n, :n] == 0,
                            dropout_p=self.dropout if self.training else 0.0)


class MultiHeadAttentionWrapper(Module):
    """``num_heads`` independent ``CausalAttention`` heads, outputs concatenated:
    ``(..., num_tokens, num_heads * d_out)``.  Backward splits ``dy`` per head and sums the
    heads' input gradients."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, *, rng=None,
                 dtype=np.float64):
        super().__init__()
        num_heads = check_size(num_heads, "num_heads")
        rng = as_rng(rng)
        self._dtype = check_dtype(dtype)
        self.d_out = check_size(d_out, "d_out")
        self.heads = ModuleList([CausalAttention(d_in, d_out, context_length, dropout, qkv_bias, rng=rng, dtype=dtype)
                                 for _ in range(num_heads)])

    def forward(self, x):
        x = _check_tokens(self.heads[0], x, self.heads[0].context_length)
        out = np.concatenate([head(x) for head in self.heads], axis=-1)
        self._save(out.shape)
        return out

    def backward(self, dy):
        dy = self._check_dy(dy)
        self._pop()
        return sum(head.backward(d) for head, d in zip(self.heads, np.split(dy, len(self.heads), axis=-1)))


class MultiHeadAttention(_attention.MultiHeadAttention):
    """The book's batched multi-head causal attention: ``npattn.MultiHeadAttention`` with the
    book's positional signature, ``out_proj`` with bias, and the causal ``mask`` buffer."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, *, rng=None,
                 dtype=np.float64):
        super().__init__(d_in, d_out, num_heads, dropout=dropout, qkv_bias=qkv_bias, out_bias=True,
                         rng=rng, dtype=dtype)
        self.context_length = check_size(context_length, "context_length")
        self.register_buffer("mask", np.triu(np.ones((self.context_length,) * 2, dtype=self._dtype), k=1))

    def forward(self, x):
        x = _check_tokens(self, x, self.context_length)
        n = x.shape[-2]
        return super().forward(x, attn_mask=self.mask[:n, :n] == 0)
