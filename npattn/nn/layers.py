"""Basic layers: ``Linear``, ``LayerNorm``, ``Dropout``, ``Embedding``, ``FeedForward``.

Each is thin: it holds ``Parameter``s, calls a functional pair, keeps that pair's cache and adds
parameter gradients into ``.grad`` on ``backward``.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from .. import functional as F
from .._validate import (as_float, as_rng, check_bool, check_dtype, check_positive_float, check_prob,
                        check_size)
from .module import Module, Parameter

__all__ = ["Linear", "LayerNorm", "Dropout", "Embedding", "FeedForward"]


def _check_features(x, name, expected, module):
    if x.ndim < 1 or x.shape[-1] != expected:
        raise ValueError(
            f"{name}: expected shape (..., {expected}) for {module}, got {x.shape}"
        )


class Linear(Module):
    """``y = x @ weight.T + bias``; ``weight (out, in)`` and ``bias (out,)`` drawn from
    U(-1/sqrt(in), 1/sqrt(in)) as ``torch.nn.Linear``."""

    def __init__(self, in_features, out_features, bias=True, *, rng=None, dtype=np.float64):
        super().__init__()
        self.in_features = check_size(in_features, "in_features")
        self.out_features = check_size(out_features, "out_features")
        has_bias = check_bool(bias, "bias")
        self._dtype = check_dtype(dtype)
        rng = as_rng(rng)
        bound = 1.0 / math.sqrt(self.in_features)
        self.weight = Parameter(rng.uniform(-bound, bound, (self.out_features, self.in_features)), self._dtype)
        self.bias = Parameter(rng.uniform(-bound, bound, (self.out_features,)), self._dtype) if has_bias else None

    def forward(self, x):
        x = as_float(x, "x", self.dtype)
        _check_features(x, "x", self.in_features, f"Linear({self.in_features}, {self.out_features})")
        y, cache = F.linear(x, self.weight.data, None if self.bias is None else self.bias.data)
        self._save(cache)
        return y

    def backward(self, dy):
        dy = self._check_dy(dy)
        dx, dw, db = F.linear_backward(dy, self._pop())
        self._accumulate(self.weight, dw)
        if self.bias is not None:
            self._accumulate(self.bias, db)
        return dx

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class LayerNorm(Module):
    """Layer norm over the last axis; ``weight`` ones and ``bias`` zeros at start."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, *, dtype=np.float64):
        super().__init__()
        if isinstance(normalized_shape, (tuple, list)):
            if len(normalized_shape) != 1:
                raise ValueError(
                    f"normalized_shape: only normalisation over the last axis is supported, expected an int "
                    f"or a 1-tuple, got {tuple(normalized_shape)}"
                )
            normalized_shape = normalized_shape[0]
        self.normalized_shape = (check_size(normalized_shape, "normalized_shape"),)
        self.eps = check_positive_float(eps, "eps", allow_zero=True)
        self.elementwise_affine = check_bool(elementwise_affine, "elementwise_affine")
        check_bool(bias, "bias")
        self._dtype = check_dtype(dtype)
        d = self.normalized_shape[0]
        self.weight = Parameter(np.ones(d), self._dtype) if self.elementwise_affine else None
        self.bias = Parameter(np.zeros(d), self._dtype) if (self.elementwise_affine and bias) else None

    def forward(self, x):
        x = as_float(x, "x", self.dtype)
        _check_features(x, "x", self.normalized_shape[0], f"LayerNorm({self.normalized_shape[0]})")
        y, cache = F.layer_norm(x, None if self.weight is None else self.weight.data,
                                None if self.bias is None else self.bias.data, self.eps)
        self._save(cache)
        return y

    def backward(self, dy):
        dy = self._check_dy(dy)
        dx, dw, db = F.layer_norm_backward(dy, self._pop())
        if self.weight is not None:
            self._accumulate(self.weight, dw)
        if self.bias is not None:
            self._accumulate(self.bias, db)
        return dx

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class Dropout(Module):
    """Inverted dropout, active only in training mode; masks drawn from ``rng``."""

    def __init__(self, p=0.5, *, rng=None):
        super().__init__()
        self.p = check_prob(p, "p")
        self.rng = as_rng(rng)

    def forward(self, x):
        y, cache = F.dropout(x, self.p, self.rng, self.training)
        self._save(cache)
        return y

    def backward(self, dy):
        return F.dropout_backward(self._check_dy(dy), self._pop())

    @property
    def active(self):
        """True when ``forward`` changes anything (training mode and ``p > 0``)."""
        return self.training and self.p > 0.0

    def extra_repr(self):
        return f"p={self.p}"


class Embedding(Module):
    """Lookup table ``weight (num_embeddings, embedding_dim)`` drawn from N(0, 1) as torch.
    ``backward`` returns None (token ids have no gradient) and accumulates into ``weight.grad``."""

    def __init__(self, num_embeddings, embedding_dim, *, rng=None, dtype=np.float64):
        super().__init__()
        self.num_embeddings = check_size(num_embeddings, "num_embeddings")
        self.embedding_dim = check_size(embedding_dim, "embedding_dim")
        self._dtype = check_dtype(dtype)
        self.weight = Parameter(as_rng(rng).standard_normal((self.num_embeddings, self.embedding_dim)), self._dtype)

    def forward(self, ids):
        y, cache = F.embedding(ids, self.weight.data)
        self._save(cache)
        return y

    def backward(self, dy):
        dy = self._check_dy(dy)
        self._accumulate(self.weight, F.embedding_backward(dy, self._pop()))
        return None

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}"


_ACTIVATIONS = {
    "relu": (F.relu, F.relu_backward, {}),
    "gelu": (F.gelu, F.gelu_backward, {"approximate": "none"}),
    "gelu_tanh": (F.gelu, F.gelu_backward, {"approximate": "tanh"}),
}


class FeedForward(Module):
    """Position-wise feed-forward: ``linear2(dropout(act(linear1(x))))`` (as torch's encoder layer).

    ``activation`` is ``"relu"``, ``"gelu"`` (erf form) or ``"gelu_tanh"``.
    """

    def __init__(self, d_model, d_ff, *, activation="relu", dropout=0.0, rng=None, dtype=np.float64):
        super().__init__()
        check_size(d_model, "d_model")
        check_size(d_ff, "d_ff")
        if not isinstance(activation, str) or activation not in _ACTIVATIONS:
            raise ValueError(f"activation: expected one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        check_prob(dropout, "dropout")
        rng = as_rng(rng)
        self.activation = activation
        self._dtype = check_dtype(dtype)
        self.linear1 = Linear(d_model, d_ff, rng=rng, dtype=dtype)
        self.linear2 = Linear(d_ff, d_model, rng=rng, dtype=dtype)
        self.dropout = Dropout(dropout, rng=rng)

    def forward(self, x):
        act, _, kwargs = _ACTIVATIONS[self.activation]
        h, cache = act(self.linear1(x), **kwargs)
        drop = self.dropout.active  # an inactive dropout is skipped: no copy of (..., d_ff) each way
        self._save((cache, drop))
        return self.linear2(self.dropout(h) if drop else h)

    def backward(self, dy):
        dy = self._check_dy(dy)
        cache, drop = self._pop()
        dh = self.linear2.backward(dy)
        if drop:
            dh = self.dropout.backward(dh)
        return self.linear1.backward(_ACTIVATIONS[self.activation][1](dh, cache))

    def extra_repr(self):
        return f"activation={self.activation!r}"
