"""``EncoderBlock``: attention and feed-forward sublayers with residuals and layer norm."""
from __future__ import annotations

import numpy as np

from .._validate import as_float, as_rng, check_bool, check_dtype, check_prob, check_size
from .attention import MultiHeadAttention
from .layers import Dropout, FeedForward, LayerNorm
from .module import Module

__all__ = ["EncoderBlock"]


class EncoderBlock(Module):
    """A transformer encoder layer (``torch.nn.TransformerEncoderLayer`` with ``batch_first=True``).

    Post-norm (default): ``x = LN1(x + Drop(MHA(x)))``, ``y = LN2(x + Drop(FFN(x)))``.
    Pre-norm (``norm_first=True``): ``x = x + Drop(MHA(LN1(x)))``, ``y = x + Drop(FFN(LN2(x)))``.
    ``dropout`` also acts on the attention weights and inside the feed-forward, as in torch.

    Backward follows the same graph in reverse; a residual ``h = x + f(x)`` gives
    ``dx = dh + f.backward(dh)``.
    """

    def __init__(self, d_model, num_heads, d_ff, *, dropout=0.1, activation="relu", norm_first=False,
                 causal=False, qkv_bias=False, rng=None, dtype=np.float64):
        super().__init__()
        d_model, num_heads = check_size(d_model, "d_model"), check_size(num_heads, "num_heads")
        if d_model % num_heads:
            raise ValueError(f"d_model: expected a multiple of num_heads={num_heads}, got {d_model}")
        check_size(d_ff, "d_ff")
        check_prob(dropout, "dropout")
        self.norm_first = check_bool(norm_first, "norm_first")
        rng = as_rng(rng)
        self._dtype = check_dtype(dtype)
        self.mha = MultiHeadAttention(d_model, d_model, num_heads, dropout=dropout, qkv_bias=qkv_bias,
                                      causal=causal, rng=rng, dtype=dtype)
        self.ffn = FeedForward(d_model, d_ff, activation=activation, dropout=dropout, rng=rng, dtype=dtype)
        self.layernorm1 = LayerNorm(d_model, dtype=dtype)
        self.layernorm2 = LayerNorm(d_model, dtype=dtype)
        self.dropout1 = Dropout(dropout, rng=rng)
        self.dropout2 = Dropout(dropout, rng=rng)

    def extra_repr(self):
        return f"norm_first={self.norm_first}"

    def forward(self, x, *, attn_mask=None, key_padding_mask=None):
        x = as_float(x, "x", self.dtype)
        d = self.layernorm1.normalized_shape[0]
        if x.ndim < 2 or x.shape[-1] != d:
            raise ValueError(f"x: expected shape (..., L, {d}) (d_model={d}), got {x.shape}")
        mha_kwargs = dict(attn_mask=attn_mask, key_padding_mask=key_padding_mask)
        # an inactive dropout (p = 0 or eval) is the identity: skipped, with its copies each way
        drop = (self.dropout1.active, self.dropout2.active)
        d1 = self.dropout1 if drop[0] else _identity
        d2 = self.dropout2 if drop[1] else _identity
        if self.norm_first:
            h = x + d1(self.mha(self.layernorm1(x), **mha_kwargs))
            y = h + d2(self.ffn(self.layernorm2(h)))
        else:
            h = self.layernorm1(x + d1(self.mha(x, **mha_kwargs)))
            y = self.layernorm2(h + d2(self.ffn(h)))
        self._save((y.shape, drop))  # the sublayers keep their own state
        return y

    def backward(self, dy):
        dy = self._check_dy(dy)  # the output's shape and the module's dtype, checked before the state is taken
        _, drop = self._pop()
        d1 = self.dropout1.backward if drop[0] else _identity
        d2 = self.dropout2.backward if drop[1] else _identity
        if self.norm_first:
            dh = dy + self.layernorm2.backward(self.ffn.backward(d2(dy)))
            return dh + self.layernorm1.backward(self.mha.backward(d1(dh)))
        ds = self.layernorm2.backward(dy)
        dh = ds + self.ffn.backward(d2(ds))
        dr = self.layernorm1.backward(dh)
        return dr + self.mha.backward(d1(dr))


def _identity(x):
    return x
