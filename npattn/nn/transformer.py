"""``EncoderBlock`` and ``DecoderBlock``: attention and feed-forward sublayers with residuals and
layer norm, as ``torch.nn.TransformerEncoderLayer`` / ``TransformerDecoderLayer`` with
``batch_first=True``.

Each block validates *all* its inputs (arrays and masks) at its own edge, before any sublayer
runs, so a refused call changes no state; it then calls its sublayers' unvalidated ``_forward`` /
``_backward`` (see ``npattn.nn.layers``).  A residual ``h = x + f(x)`` gives
``dx = dh + f.backward(dh)``.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import numpy as np

from .._docs import BACKWARD_RAISES, shared_doc
from .._validate import (
    as_float,
    as_rng,
    check_bool,
    check_dtype,
    check_prob,
    check_size,
    check_tangent,
    check_tangents,
    to_numpy,
)
from .attention import MultiHeadAttention
from .layers import Dropout, FeedForward, LayerNorm
from .module import Module

__all__ = ["EncoderBlock", "DecoderBlock"]


def _identity(x):
    return x


def _plus(fresh, other):
    """``fresh + other``, written into ``fresh``: a sublayer's new output or gradient, which nothing
    else holds (a residual connection makes no new ``(..., L, d)`` array)."""
    return np.add(fresh, other, out=fresh)


def _block_tangents(block: Module, input_tangents: tuple, names: tuple, shapes: tuple, method: str = "jvp") -> list:
    """A block's input tangents, checked at its edge (naming each) and made arrays (None: zeros),
    so the residual sums ``t + f'(t)`` need no special case."""
    given = check_tangents(input_tangents, names, f"{type(block).__name__}.{method}")
    dt = block.dtype
    return [
        np.zeros(shape, dt) if t is None else check_tangent(t, n, shape, dt)
        for t, n, shape in zip(given, names, shapes)
    ]


class _SecondOrder:
    """A block's second order in its own words: ``sub(m, *t)`` a sublayer's output tangent from
    its state of this call (forward mode, nothing consumed), ``back(m, g, *t)`` its
    ``backward_jvp`` on ``g = (gradient, its tangent)`` with ``t`` its inputs' tangents (consumed),
    ``drop(i, ...)`` the same for the i-th dropout when it was active (else the identity), and
    ``plus(g, h)`` a residual's sum of two such pairs."""

    def __init__(self, block: Module, drop: tuple, param_tangents):
        self.block, self.active, self.pt = block, drop, param_tangents

    def sub(self, m, *t):
        return self.block._child_jvp(m, -1, t, self.pt)

    def back(self, m, g, *t):
        return self.block._child_backward_jvp(m, g[0], t, self.pt, g[1])

    def drop_sub(self, i, t):
        return self.sub(self.block._dropouts()[i], t) if self.active[i] else t

    def drop_back(self, i, g, t):
        return self.back(self.block._dropouts()[i], g, t) if self.active[i] else g

    @staticmethod
    def plus(g, h):
        return _plus(g[0], h[0]), _plus(g[1], h[1])


def _check_sequence(x, name: str, d: int, dtype) -> np.ndarray:
    """``(..., L, d)`` float array of the block's dtype (``(L, d)``: unbatched, as torch)."""
    x = as_float(x, name, dtype)
    if x.ndim < 2 or x.shape[-1] != d:
        raise ValueError(f"{name}: expected shape (..., L, {d}) (d_model={d}), got {x.shape}")
    return x


class _Block(Module):
    """What ``EncoderBlock`` and ``DecoderBlock`` share: the constructor's checks, their sublayers
    built alike (attentions, feed-forward, one layer norm and one dropout per residual: the order of
    the rng's draws; the blocks assign them in that order, the order of ``named_parameters``),
    ``extra_repr`` and the reading of a torch layer's state dict."""

    #: torch's attention key prefixes -> this block's attention attributes, in the blocks' order.
    _TORCH_ATTNS: Dict[str, str] = {}

    def _sublayers(self, d_model, num_heads, d_ff, dropout, activation, norm_first, attns, bias, rng, dtype) -> tuple:
        """``(attentions, feed-forward, layer norms, dropouts)``; ``attns``: ``(qkv_bias, causal)``
        per attention (already checked), each followed by a residual, as the feed-forward is."""
        d_model, num_heads = check_size(d_model, "d_model"), check_size(num_heads, "num_heads")
        if d_model % num_heads:
            raise ValueError(f"d_model: expected a multiple of num_heads={num_heads}, got {d_model}")
        d_ff, dropout = check_size(d_ff, "d_ff"), check_prob(dropout, "dropout")
        self.norm_first = check_bool(norm_first, "norm_first")
        rng = as_rng(rng)
        self._dtype = check_dtype(dtype)
        mhas = tuple(
            MultiHeadAttention(
                d_model,
                d_model,
                num_heads,
                dropout=dropout,
                qkv_bias=qkv,
                out_bias=bias,
                causal=causal,
                rng=rng,
                dtype=dtype,
            )
            for qkv, causal in attns
        )
        ffn = FeedForward(d_model, d_ff, activation=activation, dropout=dropout, bias=bias, rng=rng, dtype=dtype)
        norms = tuple(LayerNorm(d_model, bias=bias, dtype=dtype) for _ in range(len(attns) + 1))
        return mhas, ffn, norms, tuple(Dropout(dropout, rng=rng) for _ in range(len(attns) + 1))

    def extra_repr(self):
        """The arguments shown by ``repr(module)``."""
        return f"norm_first={self.norm_first}"

    @classmethod
    def _from_torch(cls, state_dict, num_heads: int, kwargs: dict, **bias_flags):
        """The block of a torch layer's ``state_dict``: its keys checked, ``d_model``, ``d_ff`` and
        the bias read from them (``bias_flags``: the further arguments set to that bias)."""
        attns = tuple(cls._TORCH_ATTNS)
        sd, d_model, d_ff, bias, kwargs = _torch_layer_state(state_dict, kwargs, attns, len(attns) + 1)
        build: Callable[..., _Block] = cls  # a subclass, with the blocks' constructor
        m = build(d_model, num_heads, d_ff, bias=bias, **{k: bias for k in bias_flags}, **kwargs)
        m.load_state_dict(_rename_torch_state(sd, cls._TORCH_ATTNS, d_model))
        return m


#: The blocks' ``forward`` Returns and Raises.
_FORWARD_RETURNS = """
    Returns
    -------
    ndarray
        ``(..., L, d_model)``, in the module's dtype.

    Raises
    ------
    TypeError, ValueError
        An input or mask of the wrong kind or shape (checked before any sublayer runs).
    """


class EncoderBlock(_Block):
    """A transformer encoder layer (``torch.nn.TransformerEncoderLayer`` with ``batch_first=True``).

    Post-norm (default): ``x = LN1(x + Drop(MHA(x)))``, ``y = LN2(x + Drop(FFN(x)))``.
    Pre-norm (``norm_first=True``): ``x = x + Drop(MHA(LN1(x)))``, ``y = x + Drop(FFN(LN2(x)))``.
    ``dropout`` also acts on the attention weights and inside the feed-forward, as in torch.

    ``bias=False`` drops every linear and layer-norm bias (torch's ``bias=False``); ``qkv_bias``
    (default False, npattn's historical default) adds the q/k/v projection biases that torch's
    layer has with ``bias=True``.  ``causal=True`` masks future keys.  Keys: ``mha.*``,
    ``ffn.linear1.*``, ``ffn.linear2.*``, ``layernorm1.*``, ``layernorm2.*``.  Input ``(..., L,
    d_model)``, unbatched ``(L, d_model)`` included; masks as ``MultiHeadAttention``'s (bool
    ``attn_mask`` True = may attend; ``key_padding_mask`` True = padding).

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> block = npattn.EncoderBlock(16, 4, 32, dropout=0.0, norm_first=True, causal=True, rng=0)
    >>> x = np.random.default_rng(1).standard_normal((2, 5, 16))
    >>> y = block(x)
    >>> block.backward(np.ones_like(y)).shape
    (2, 5, 16)
    >>> npattn.gradcheck(block, x, fast=True).ok
    True
    """

    _TORCH_ATTNS = {"self_attn": "mha"}

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        *,
        dropout: float = 0.1,
        activation: str = "relu",
        norm_first: bool = False,
        causal: bool = False,
        qkv_bias: bool = False,
        bias: bool = True,
        rng=None,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        bias = check_bool(bias, "bias")
        qkv_bias = check_bool(qkv_bias, "qkv_bias")
        if qkv_bias and not bias:
            raise ValueError("qkv_bias: bias=False drops every bias; expected qkv_bias=False, got True")
        (self.mha,), self.ffn, (self.layernorm1, self.layernorm2), (self.dropout1, self.dropout2) = self._sublayers(
            d_model, num_heads, d_ff, dropout, activation, norm_first, ((qkv_bias, causal),), bias, rng, dtype
        )

    @shared_doc(forward_returns=_FORWARD_RETURNS)
    def forward(self, x, *, attn_mask=None, key_padding_mask=None) -> np.ndarray:
        """The forward pass.

        Parameters
        ----------
        x : array_like
            ``(..., L, d_model)``.
        attn_mask : array_like, optional
            Bool (True = may attend) or float, broadcastable to ``(..., num_heads, L, L)``.
        key_padding_mask : array_like, optional
            ``(..., L)``, True = padding.

        <forward_returns>
        """
        x = _check_sequence(x, "x", self.layernorm1.normalized_shape[0], self.dtype)
        lead, L = x.shape[:-2], x.shape[-2]
        mask = self.mha._build_mask(attn_mask, key_padding_mask, lead, L, L)  # refused here, before any sublayer
        return self._forward(x, mask)

    def _forward(self, x: np.ndarray, mask: Optional[np.ndarray]) -> np.ndarray:
        """The block on a validated ``x`` and the attention's mask built by ``mha._build_mask``."""

        def mha(h):
            return self.mha._forward(h, mask=mask)

        # an inactive dropout (p = 0 or eval) is the identity: skipped, with its copies each way
        drop = (self.dropout1.active, self.dropout2.active)
        d1 = self.dropout1._forward if drop[0] else _identity
        d2 = self.dropout2._forward if drop[1] else _identity
        ln1, ln2, ffn = self.layernorm1._forward, self.layernorm2._forward, self.ffn._forward
        if self.norm_first:
            h = _plus(d1(mha(ln1(x))), x)
            y = _plus(d2(ffn(ln2(h))), h)
        else:
            h = ln1(_plus(d1(mha(x)), x))
            y = ln2(_plus(d2(ffn(h)), h))
        self.save_for_backward((y.shape, drop))  # the sublayers keep their own state
        return y

    @shared_doc(raises=BACKWARD_RAISES)
    def backward(self, dy) -> np.ndarray:
        """The backward pass of the last forward: returns ``dx`` and adds every parameter's
        gradient into ``p.grad``.

        Parameters
        ----------
        dy : array_like
            ``(..., L, d_model)``.

        Returns
        -------
        ndarray
            ``dx``, of ``x``'s shape.

        Raises
        ------
        <raises>
        """
        return self._backward(self._check_dy(dy))  # checked before any state is taken

    def _backward(self, dy: np.ndarray) -> np.ndarray:
        _, drop = self.pop_saved()
        d1 = self.dropout1._backward if drop[0] else _identity
        d2 = self.dropout2._backward if drop[1] else _identity
        ln1, ln2, ffn = self.layernorm1._backward, self.layernorm2._backward, self.ffn._backward
        if self.norm_first:
            dh = _plus(ln2(ffn(d2(dy))), dy)
            return _plus(ln1(self.mha._backward(d1(dh))), dh)
        ds = ln2(dy)
        dh = _plus(ffn(d2(ds)), ds)
        dr = ln1(dh)
        return _plus(self.mha._backward(d1(dr)), dr)

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: the forward's chain on tangents, each sublayer's own ``_jvp`` from its
        state of this call (dropouts with the forward's masks), a residual adding its input's
        tangent.  One input tangent ``tx`` (of ``x``'s shape; None: zero); the masks have none."""
        shape, drop = state
        (tx,) = _block_tangents(self, input_tangents, ("tx",), (shape,))

        def sub(m, t):  # the sublayer's tangent from its state of this call
            return self._child_jvp(m, -1, (t,), param_tangents)

        def d1(t):
            return sub(self.dropout1, t) if drop[0] else t

        def d2(t):
            return sub(self.dropout2, t) if drop[1] else t

        if self.norm_first:
            th = d1(sub(self.mha, sub(self.layernorm1, tx))) + tx
            return d2(sub(self.ffn, sub(self.layernorm2, th))) + th
        th = sub(self.layernorm1, d1(sub(self.mha, tx)) + tx)
        return sub(self.layernorm2, d2(sub(self.ffn, th)) + th)

    def _dropouts(self):
        return self.dropout1, self.dropout2

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: the forward's tangents first (as ``_jvp``: each sublayer's input
        tangent), then the backward's chain with each sublayer's ``backward_jvp``, a residual
        adding both branches' gradients and their tangents."""
        shape, drop = state
        (tx,) = _block_tangents(self, input_tangents, ("tx",), (shape,), "backward_jvp")
        so = _SecondOrder(self, drop, param_tangents)
        g = (dy, np.zeros_like(dy) if ddy is None else ddy)
        if self.norm_first:
            tn1 = so.sub(self.layernorm1, tx)
            tm = so.sub(self.mha, tn1)
            th = so.drop_sub(0, tm) + tx
            tn2 = so.sub(self.layernorm2, th)
            tf = so.sub(self.ffn, tn2)
            gh = so.plus(so.back(self.layernorm2, so.back(self.ffn, so.drop_back(1, g, tf), tn2), th), g)
            return so.plus(so.back(self.layernorm1, so.back(self.mha, so.drop_back(0, gh, tm), tn1), tx), gh)
        tm = so.sub(self.mha, tx)
        r1 = so.drop_sub(0, tm) + tx
        th = so.sub(self.layernorm1, r1)
        tf = so.sub(self.ffn, th)
        r2 = so.drop_sub(1, tf) + th
        gs = so.back(self.layernorm2, g, r2)
        gh = so.plus(so.back(self.ffn, so.drop_back(1, gs, tf), th), gs)
        gr = so.back(self.layernorm1, gh, r1)
        return so.plus(so.back(self.mha, so.drop_back(0, gr, tm), tx), gr)

    @classmethod
    def from_torch_state_dict(cls, state_dict, num_heads: int, **kwargs) -> "EncoderBlock":
        """Build from the ``state_dict`` of ``torch.nn.TransformerEncoderLayer``: the same outputs
        and gradients as that layer with ``batch_first=True`` (pass its ``norm_first``,
        ``activation`` and ``dropout`` as keywords; torch's default dropout is 0.1 too).

        Keys: ``self_attn.in_proj_weight`` (packed ``[q; k; v]``), ``self_attn.in_proj_bias``,
        ``self_attn.out_proj.*``, ``linear1.*``, ``linear2.*``, ``norm1.*``, ``norm2.*``; either
        every bias key (``bias=True``) or none (``bias=False``).  A missing, unexpected or wrongly
        shaped key raises ``ValueError`` naming it.  ``dtype`` defaults to the state dict's
        (float32 tensors give a float32 block).  Remember that torch's bool ``src_mask`` means True
        = *masked*; npattn's ``attn_mask`` means True = may attend (pass ``~mask``).
        """
        return cls._from_torch(state_dict, num_heads, kwargs, qkv_bias=True)


class DecoderBlock(_Block):
    """A transformer decoder layer (``torch.nn.TransformerDecoderLayer`` with ``batch_first=True``):
    self-attention, cross-attention over ``memory`` (the encoder's output), feed-forward.

    Post-norm (default)::

        h1 = LN1(x + Drop1(SelfAttn(x)))
        h2 = LN2(h1 + Drop2(CrossAttn(h1, memory)))
        y  = LN3(h2 + Drop3(FFN(h2)))

    Pre-norm (``norm_first=True``)::

        h1 = x + Drop1(SelfAttn(LN1(x)))
        h2 = h1 + Drop2(CrossAttn(LN2(h1), memory))
        y  = h2 + Drop3(FFN(LN3(h2)))

    ``dropout`` also acts on both attentions' weights and inside the feed-forward, as in torch.
    ``causal=True`` masks future keys in the self-attention (top-left aligned), as torch's
    ``tgt_is_causal`` with a causal ``tgt_mask``.  ``bias=False`` drops every linear and
    layer-norm bias.  ``activation``: see ``FeedForward``.

    Keys: ``self_attn.*`` and ``cross_attn.*`` (``MultiHeadAttention``'s keys: ``W_query``,
    ``W_key``, ``W_value``, ``out_proj``, each ``.weight`` and, with ``bias``, ``.bias``),
    ``ffn.linear1.*``, ``ffn.linear2.*``, ``layernorm1.*``, ``layernorm2.*``, ``layernorm3.*``
    (torch: ``self_attn``, ``multihead_attn``, ``linear1``, ``linear2``, ``norm1..3``; see
    ``from_torch_state_dict``).

    ``forward(x, memory, *, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
    memory_key_padding_mask=None)``: ``x (..., L, d_model)``, ``memory (..., S, d_model)`` with the
    same leading axes (or unbatched ``(L, d_model)`` and ``(S, d_model)``).  Masks follow npattn's
    polarity: bool ``tgt_mask (L, L)`` / ``memory_mask (L, S)`` True = may attend (float: added to
    the scores), broadcastable to ``(..., num_heads, L, L|S)``; key padding masks ``(..., L)`` /
    ``(..., S)`` True = padding.  ``backward(dy)`` returns ``(dx, dmemory)``.

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> block = npattn.DecoderBlock(16, 4, 32, dropout=0.0, causal=True, rng=0)
    >>> rng = np.random.default_rng(1)
    >>> x, memory = rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 7, 16))
    >>> y = block(x, memory)
    >>> dx, dmemory = block.backward(np.ones_like(y))
    >>> dx.shape, dmemory.shape
    ((2, 5, 16), (2, 7, 16))
    """

    _TORCH_ATTNS = {"self_attn": "self_attn", "multihead_attn": "cross_attn"}

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        *,
        dropout: float = 0.1,
        activation: str = "relu",
        norm_first: bool = False,
        causal: bool = False,
        bias: bool = True,
        rng=None,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        bias = check_bool(bias, "bias")
        attns = ((bias, check_bool(causal, "causal")), (bias, False))  # self- and cross-attention
        (self.self_attn, self.cross_attn), self.ffn, norms, drops = self._sublayers(
            d_model, num_heads, d_ff, dropout, activation, norm_first, attns, bias, rng, dtype
        )
        self.layernorm1, self.layernorm2, self.layernorm3 = norms
        self.dropout1, self.dropout2, self.dropout3 = drops

    @shared_doc(forward_returns=_FORWARD_RETURNS)
    def forward(
        self, x, memory, *, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None, memory_key_padding_mask=None
    ) -> np.ndarray:
        """The forward pass (see the class docstring for the masks).

        <forward_returns>
        """
        d = self.layernorm1.normalized_shape[0]
        x = _check_sequence(x, "x", d, self.dtype)
        memory = _check_sequence(memory, "memory", d, self.dtype)
        lead, L, S = x.shape[:-2], x.shape[-2], memory.shape[-2]
        if memory.shape[:-2] != lead:
            raise ValueError(f"memory: expected shape {lead + ('S', d)} (x's leading axes), got {memory.shape}")
        # both masks are refused here, before any sublayer runs
        self_mask = self.self_attn._build_mask(
            tgt_mask, tgt_key_padding_mask, lead, L, L, ("tgt_mask", "tgt_key_padding_mask")
        )
        cross_mask = self.cross_attn._build_mask(
            memory_mask, memory_key_padding_mask, lead, L, S, ("memory_mask", "memory_key_padding_mask")
        )
        return self._forward(x, memory, self_mask, cross_mask)

    def _forward(
        self, x: np.ndarray, memory: np.ndarray, self_mask: Optional[np.ndarray], cross_mask: Optional[np.ndarray]
    ) -> np.ndarray:
        """The block on validated ``x`` and ``memory`` and the attentions' masks built by their
        ``_build_mask``."""

        def sa(h):
            return self.self_attn._forward(h, mask=self_mask)

        def ca(h):
            return self.cross_attn._forward(h, memory, memory, mask=cross_mask)

        drop = (self.dropout1.active, self.dropout2.active, self.dropout3.active)
        d1, d2, d3 = (m._forward if on else _identity for m, on in zip(self._dropouts(), drop))
        ln1, ln2, ln3 = self.layernorm1._forward, self.layernorm2._forward, self.layernorm3._forward
        ffn = self.ffn._forward
        if self.norm_first:
            h1 = _plus(d1(sa(ln1(x))), x)
            h2 = _plus(d2(ca(ln2(h1))), h1)
            y = _plus(d3(ffn(ln3(h2))), h2)
        else:
            h1 = ln1(_plus(d1(sa(x)), x))
            h2 = ln2(_plus(d2(ca(h1)), h1))
            y = ln3(_plus(d3(ffn(h2)), h2))
        self.save_for_backward((y.shape, drop, memory.shape))  # the sublayers keep their own state
        return y

    def _dropouts(self):
        return self.dropout1, self.dropout2, self.dropout3

    def backward(self, dy) -> Tuple[np.ndarray, np.ndarray]:
        """Returns ``(dx, dmemory)``; ``dmemory`` sums the cross-attention's key and value gradients."""
        return self._backward(self._check_dy(dy))  # checked before any state is taken

    def _backward(self, dy: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        _, drop, _ = self.pop_saved()
        d1, d2, d3 = (m._backward if on else _identity for m, on in zip(self._dropouts(), drop))
        ln1, ln2, ln3 = self.layernorm1._backward, self.layernorm2._backward, self.layernorm3._backward
        ffn = self.ffn._backward
        if self.norm_first:
            dh2 = _plus(ln3(ffn(d3(dy))), dy)
            dq, dk, dv = self.cross_attn._backward(d2(dh2))
            dh1 = _plus(ln2(dq), dh2)
            dx = _plus(ln1(self.self_attn._backward(d1(dh1))), dh1)
            return dx, _plus(dk, dv)
        ds3 = ln3(dy)
        dh2 = _plus(ffn(d3(ds3)), ds3)
        ds2 = ln2(dh2)
        dq, dk, dv = self.cross_attn._backward(d2(ds2))
        ds1 = ln1(_plus(dq, ds2))
        dx = _plus(self.self_attn._backward(d1(ds1)), ds1)
        return dx, _plus(dk, dv)

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: ``jvp(tx, tmemory)`` (each of its input's shape; None: zero), the
        forward's chain on tangents as ``EncoderBlock``'s; the cross-attention takes ``tmemory``
        as both its key's and its value's tangent."""
        shape, drop, memory_shape = state
        ca = self.cross_attn
        tx, tm = _block_tangents(self, input_tangents, ("tx", "tmemory"), (shape, memory_shape))

        def sub(m, *t):  # the sublayer's tangent from its state of this call
            return self._child_jvp(m, -1, t, param_tangents)

        def drop_(i, t):
            return sub(self._dropouts()[i], t) if drop[i] else t

        if self.norm_first:
            th1 = drop_(0, sub(self.self_attn, sub(self.layernorm1, tx))) + tx
            th2 = drop_(1, sub(ca, sub(self.layernorm2, th1), tm, tm)) + th1
            return drop_(2, sub(self.ffn, sub(self.layernorm3, th2))) + th2
        th1 = sub(self.layernorm1, drop_(0, sub(self.self_attn, tx)) + tx)
        th2 = sub(self.layernorm2, drop_(1, sub(ca, th1, tm, tm)) + th1)
        return sub(self.layernorm3, drop_(2, sub(self.ffn, th2)) + th2)

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: ``backward_jvp(dy, tx, tmemory, ...)``, the forward's tangents first (as
        ``_jvp``), then the backward's chain with each sublayer's ``backward_jvp``; returns
        ``((dx, dmemory), (tdx, tdmemory))``, the memory's the cross-attention's key and value
        parts summed."""
        shape, drop, memory_shape = state
        ca = self.cross_attn
        tx, tmem = _block_tangents(self, input_tangents, ("tx", "tmemory"), (shape, memory_shape), "backward_jvp")
        so = _SecondOrder(self, drop, param_tangents)
        g = (dy, np.zeros_like(dy) if ddy is None else ddy)

        def cross(gc, tq):  # the cross-attention's backward_jvp: (query's pair, memory's pair)
            (dq, dk, dv), (tdq, tdk, tdv) = so.back(ca, gc, tq, tmem, tmem)
            return (dq, tdq), (_plus(dk, dv), _plus(tdk, tdv))

        if self.norm_first:
            tn1 = so.sub(self.layernorm1, tx)
            ts = so.sub(self.self_attn, tn1)
            th1 = so.drop_sub(0, ts) + tx
            tn2 = so.sub(self.layernorm2, th1)
            tc = so.sub(ca, tn2, tmem, tmem)
            th2 = so.drop_sub(1, tc) + th1
            tn3 = so.sub(self.layernorm3, th2)
            tf = so.sub(self.ffn, tn3)
            gh2 = so.plus(so.back(self.layernorm3, so.back(self.ffn, so.drop_back(2, g, tf), tn3), th2), g)
            gq, gm = cross(so.drop_back(1, gh2, tc), tn2)
            gh1 = so.plus(so.back(self.layernorm2, gq, th1), gh2)
            gx = so.plus(so.back(self.layernorm1, so.back(self.self_attn, so.drop_back(0, gh1, ts), tn1), tx), gh1)
            return (gx[0], gm[0]), (gx[1], gm[1])
        ts = so.sub(self.self_attn, tx)
        r1 = so.drop_sub(0, ts) + tx
        th1 = so.sub(self.layernorm1, r1)
        tc = so.sub(ca, th1, tmem, tmem)
        r2 = so.drop_sub(1, tc) + th1
        th2 = so.sub(self.layernorm2, r2)
        tf = so.sub(self.ffn, th2)
        r3 = so.drop_sub(2, tf) + th2
        gs3 = so.back(self.layernorm3, g, r3)
        gh2 = so.plus(so.back(self.ffn, so.drop_back(2, gs3, tf), th2), gs3)
        gs2 = so.back(self.layernorm2, gh2, r2)
        gq, gm = cross(so.drop_back(1, gs2, tc), th1)
        gs1 = so.back(self.layernorm1, so.plus(gq, gs2), r1)
        gx = so.plus(so.back(self.self_attn, so.drop_back(0, gs1, ts), tx), gs1)
        return (gx[0], gm[0]), (gx[1], gm[1])

    @classmethod
    def from_torch_state_dict(cls, state_dict, num_heads: int, **kwargs) -> "DecoderBlock":
        """Build from the ``state_dict`` of ``torch.nn.TransformerDecoderLayer``: the same outputs
        and gradients as that layer with ``batch_first=True`` (pass its ``norm_first``,
        ``activation`` and ``dropout`` as keywords).

        Keys: ``self_attn.*`` and ``multihead_attn.*`` (``in_proj_weight`` packed ``[q; k; v]``,
        ``in_proj_bias``, ``out_proj.*``), ``linear1.*``, ``linear2.*``, ``norm1..3.*``; either
        every bias key (``bias=True``) or none (``bias=False``).  A missing, unexpected or wrongly
        shaped key raises ``ValueError`` naming it.  ``dtype`` defaults to the state dict's.  Bool
        masks: torch's True = *masked*, npattn's True = may attend (pass ``~mask``).
        """
        return cls._from_torch(state_dict, num_heads, kwargs)


# -- torch state dicts ----------------------------------------------------------------------------------


def _torch_layer_state(state_dict, kwargs: dict, attns: Tuple[str, ...], norms: int):
    """Check the keys of a torch transformer layer's state dict; returns ``(arrays, d_model, d_ff,
    bias, kwargs with dtype)``."""
    if not hasattr(state_dict, "items"):
        raise TypeError(f"state_dict: expected a mapping of names to arrays, got {type(state_dict).__name__}")
    for k in ("bias", "qkv_bias"):
        if k in kwargs:
            raise TypeError(f"{k}: set by the state dict (its bias keys), not a keyword of from_torch_state_dict")
    sd = {k: to_numpy(v, f"state_dict[{k!r}]") for k, v in state_dict.items()}
    weights = [f"{a}.in_proj_weight" for a in attns] + [f"{a}.out_proj.weight" for a in attns]
    weights += ["linear1.weight", "linear2.weight"] + [f"norm{i}.weight" for i in range(1, norms + 1)]
    biases = [f"{a}.in_proj_bias" for a in attns] + [f"{a}.out_proj.bias" for a in attns]
    biases += ["linear1.bias", "linear2.bias"] + [f"norm{i}.bias" for i in range(1, norms + 1)]
    unexpected = sorted(k for k in sd if k not in weights and k not in biases)
    if unexpected:
        raise ValueError(
            f"state_dict: unexpected keys {unexpected} (expected those of a torch transformer layer: "
            f"{weights + biases})"
        )
    missing = [k for k in weights if k not in sd]
    present = [k for k in biases if k in sd]
    if present and len(present) != len(biases):
        missing += [k for k in biases if k not in sd]
    if missing:
        raise ValueError(f"state_dict: missing keys {missing}")
    for k in ("linear1.weight", f"{attns[0]}.out_proj.weight"):
        if sd[k].ndim != 2:
            raise ValueError(f"state_dict: expected {k!r} of 2 dimensions, got shape {sd[k].shape}")
    d_model, d_ff = sd[f"{attns[0]}.out_proj.weight"].shape[0], sd["linear1.weight"].shape[0]
    if "dtype" not in kwargs:
        dt = sd[weights[0]].dtype
        kwargs = dict(kwargs, dtype=dt if dt in (np.float32, np.float64) else np.float64)
    return sd, d_model, d_ff, bool(present), kwargs


def _rename_torch_state(sd: Dict[str, np.ndarray], attns: Dict[str, str], d_model: int) -> Dict[str, np.ndarray]:
    """torch's keys -> npattn's (the packed ``in_proj`` split into q, k, v); shapes are checked by
    ``load_state_dict``."""
    out: Dict[str, np.ndarray] = {}
    E = d_model
    for k, v in sd.items():
        head, _, rest = k.partition(".")
        if head in attns:
            mine = attns[head]
            if rest.startswith("in_proj_"):
                kind = rest[len("in_proj_") :]
                if v.shape[0] != 3 * E:
                    shape = (3 * E, E) if kind == "weight" else (3 * E,)
                    raise ValueError(f"load_state_dict: key {k!r}: expected shape {shape}, got {v.shape}")
                for i, w in enumerate(("W_query", "W_key", "W_value")):
                    out[f"{mine}.{w}.{kind}"] = v[i * E : (i + 1) * E]
            else:
                out[f"{mine}.{rest}"] = v
        elif head.startswith("linear"):
            out[f"ffn.{k}"] = v
        else:
            out[k.replace("norm", "layernorm", 1)] = v
    return out
