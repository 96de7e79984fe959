"""Gemma 4's layers by hand: attention that may reuse another layer's keys and values, and the
per-layer input embeddings.

``SharedKVAttention`` (a decoder layer's ``self_attn``, as transformers' ``Gemma4TextAttention``;
shapes for one token, ``H`` query heads, ``Hk`` key/value heads of ``d`` features)::

    q = rope(q_norm(q_proj(x)))                  (H, d)    RMSNorm over d with a weight
    k = rope(k_norm(k_proj(x)))                  (Hk, d)   a layer that makes its keys and values
    v = v_norm(v_proj(x))                        (Hk, d)   RMSNorm over d, no weight;
                                                           k_eq_v: v_norm(k_proj(x)), before k_norm
    y = o_proj(softmax(q k^T * scale + causal/window mask) v)

A layer built with ``reuse=True`` has no key or value projection: it attends over the keys and
values of the layer it shares with (``share_from``), as they were in that layer's call (its cache
included), with its own queries (cross-layer KV sharing, ``num_kv_shared_layers``).  The backward
sends the gradient of those keys and values home: the reusing layers, whose backward runs first
(they come later in the model), add their ``dk``, ``dv`` (and, in the second order, their
tangents) into the call's ``SharedKV`` record, and the producing layer's backward adds them to its
own before going back through RoPE, the norms and the projections.  The forward tangents travel
the other way: the producing layer's JVP leaves its keys' and values' tangents in the record, for
the reusing layers' JVP that follows.

``PerLayerInput`` (in each decoder layer, after the MLP) and ``PerLayerEmbeddings`` (once, beside
the token embedding) are the per-layer input embeddings (PLE)::

    p = ((norm(per_layer_model_projection(e) / sqrt(hidden)) + embed_tokens_per_layer(ids) sqrt(P))
         / sqrt(2))                              (n_layers, P): layer i gets p[i]
    x = x + post_per_layer_input_norm(per_layer_projection(act(per_layer_input_gate(x)) * p[i]))

with ``e`` the (scaled) token embeddings.  Parameters carry transformers' names.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .._validate import (
    as_float,
    as_index,
    as_rng,
    check_bool,
    check_broadcastable,
    check_dtype,
    check_positive_float,
    check_size,
    check_tangent,
    check_tangents,
)
from ..functional import kernels as K
from ..functional.rope_scaling import check_scaling, resolve_base, resolve_rotary_dim
from .kv_cache import KVCache, RollingKVCache, _KeysCacheHooks
from .layers import Embedding, Linear, RMSNorm, act_kernels
from .module import Module, Parameter

__all__ = ["SharedKVAttention", "SharedKV", "PerLayerInput", "PerLayerEmbeddings", "ScaledRouter", "DenseWithExperts"]


class SharedKV:
    """One call's keys and values of a producing ``SharedKVAttention`` (after its cache), for the
    layers that reuse them: ``k``, ``v (..., Hk, Lk, d)``, the call's first position ``start`` and
    the keys a rolling cache had dropped before it (``dropped``); the reusing layers' gradients
    ``dk``, ``dv`` (summed) and, for the second order, their tangents ``tdk``, ``tdv``; the producing
    layer's forward tangents ``tk``, ``tv``."""

    def __init__(self, k, v, start: int, dropped: int):
        self.k, self.v, self.start, self.dropped = k, v, start, dropped
        self.dk = self.dv = self.tdk = self.tdv = self.tk = self.tv = None

    def send_home(self, dk, dv, tdk=None, tdv=None) -> None:
        """A reusing layer's gradients of ``k`` and ``v`` (and their tangents), added up."""
        self.dk = dk if self.dk is None else self.dk + dk
        self.dv = dv if self.dv is None else self.dv + dv
        if tdk is not None:
            self.tdk = tdk if self.tdk is None else self.tdk + tdk
            self.tdv = tdv if self.tdv is None else self.tdv + tdv

    def received(self, dk, dv, tdk=None, tdv=None):
        """The producing layer's ``(dk, dv, tdk, tdv)`` with the reusing layers' added (then cleared)."""
        if self.dk is not None:
            dk, dv = dk + self.dk, dv + self.dv
        if self.tdk is not None and tdk is not None:
            tdk, tdv = tdk + self.tdk, tdv + self.tdv
        self.dk = self.dv = self.tdk = self.tdv = None
        return dk, dv, tdk, tdv


class _State(NamedTuple):
    lead: tuple  # the batch shape
    steps: int
    q_rope: tuple
    k_rope: tuple | None  # None in a reusing layer
    attn: object  # the attention kernel's cache
    shared: SharedKV


class _Tangents(NamedTuple):
    """The forward's tangents stage by stage (what the second order feeds each stage)."""

    x: np.ndarray | None  # the input's (checked; None: zero)
    q: tuple  # (after q_proj, after q_norm) as (..., L, H, d)
    k: tuple | None  # (after k_proj, after v_proj or k_proj, after k_norm) as (..., L, Hk, d)
    attended: tuple  # (tq, tk, tv) the attention core's inputs (..., H or Hk, L, d)
    merged: np.ndarray  # o_proj's input (..., L, H d)


class SharedKVAttention(_KeysCacheHooks, Module):
    """Gemma 4's attention, ``(..., L, hidden) -> (..., L, hidden)`` (see the module docstring).

    Parameters
    ----------
    hidden_size, num_heads, num_kv_heads, head_dim : int
        The model width, ``H``, ``Hk`` (dividing ``H``: grouped-query attention) and ``d``.
    bias : bool
        Biases on the four projections (transformers' ``attention_bias``).
    window : tuple or None
        ``(left, 0)``: each query sees itself and ``left`` keys before it (a sliding layer).
    rope_scaling : mapping
        The layer type's RoPE dict (``rope_theta``, ``rope_type`` such as ``"proportional"``).
    k_eq_v : bool
        The values are the key projection's output (``attention_k_eq_v``): no ``v_proj``.
    reuse : bool
        No key or value projection: attend over the keys and values of the layer given to
        ``share_from`` (cross-layer KV sharing).
    eps : float
        The q/k/v norms' eps.
    scale : float
        The scores' factor (Gemma 4: 1, its q and k being normalised).
    rng, dtype
        As every module.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn.nn.shared_kv import SharedKVAttention
    >>> first = SharedKVAttention(16, 4, 2, 8, rope_scaling={"rope_theta": 100.0}, rng=0)
    >>> later = SharedKVAttention(16, 4, 2, 8, rope_scaling={"rope_theta": 100.0}, reuse=True, rng=1)
    >>> later.share_from(first)
    >>> x = np.random.default_rng(2).standard_normal((2, 5, 16))
    >>> y = later(first(x) + x)
    >>> sorted(n for n, _ in later.named_parameters())        # no k_proj, v_proj, k_norm
    ['o_proj.weight', 'q_norm.weight', 'q_proj.weight']
    >>> dx = first.backward(later.backward(np.ones_like(y)))   # later's dk, dv reach first's k_proj
    >>> dx.shape, first.k_proj.weight.grad.shape
    ((2, 5, 16), (16, 16))
    """

    _source: "SharedKVAttention | None"
    _last: SharedKV | None
    _kv_cache: KVCache | None

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        bias: bool = False,
        window: tuple | None = None,
        rope_scaling=None,
        k_eq_v: bool = False,
        reuse: bool = False,
        eps: float = 1e-6,
        scale: float = 1.0,
        rng=None,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        self.hidden_size = n = check_size(hidden_size, "hidden_size")
        self.num_heads = check_size(num_heads, "num_heads")
        self.num_kv_heads = check_size(num_kv_heads, "num_kv_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: expected a divisor of num_heads={self.num_heads}, got {num_kv_heads}")
        self.head_dim = d = check_size(head_dim, "head_dim")
        bias = check_bool(bias, "bias")
        self.k_eq_v = check_bool(k_eq_v, "k_eq_v")
        self.reuse = check_bool(reuse, "reuse")
        if window is not None and not (
            isinstance(window, tuple) and len(window) == 2 and window[1] == 0 and check_size(window[0], "window[0]")
        ):
            raise ValueError(f"window: expected None or (left, 0) with left >= 1, got {window!r}")
        self.window = window
        self.rope_scaling = check_scaling(rope_scaling, "rope_scaling")
        self.rope_base = resolve_base(10000.0, self.rope_scaling, "rope_scaling['rope_theta']")
        self.rotary_dim = resolve_rotary_dim(d, None, self.rope_scaling, "head_dim")
        self.eps = check_positive_float(eps, "eps", allow_zero=True)
        self.scale = check_positive_float(scale, "scale")
        self._dtype = dt = check_dtype(dtype)
        rng = as_rng(rng)
        self.q_proj = Linear(n, self.num_heads * d, bias, rng=rng, dtype=dt)
        self.q_norm = RMSNorm(d, self.eps, dtype=dt)
        if not self.reuse:
            self.k_proj = Linear(n, self.num_kv_heads * d, bias, rng=rng, dtype=dt)
            self.v_proj = None if self.k_eq_v else Linear(n, self.num_kv_heads * d, bias, rng=rng, dtype=dt)
            self.k_norm = RMSNorm(d, self.eps, dtype=dt)
            self.v_norm = RMSNorm(d, self.eps, elementwise_affine=False, dtype=dt)
        self.o_proj = Linear(self.num_heads * d, n, bias, rng=rng, dtype=dt)
        object.__setattr__(self, "_source", None)
        self.reset_kv_cache()

    def share_from(self, source: "SharedKVAttention") -> None:
        """Attend over ``source``'s keys and values (a layer before this one, of the same shapes);
        ``source`` is not a submodule (its parameters stay its own)."""
        if not self.reuse:
            raise ValueError("share_from: this layer makes its own keys and values (built with reuse=False)")
        if not isinstance(source, SharedKVAttention) or source.reuse:
            raise TypeError("source: expected a SharedKVAttention that makes its keys and values (reuse=False)")
        if (source.num_kv_heads, source.head_dim) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"source: its keys have {source.num_kv_heads} heads of {source.head_dim}, expected "
                f"{self.num_kv_heads} of {self.head_dim}"
            )
        object.__setattr__(self, "_source", source)

    def reset_kv_cache(self) -> None:
        """Empty the KV cache (a reusing layer holds none: it reads its source's)."""
        object.__setattr__(self, "_kv_cache", None)
        object.__setattr__(self, "_last", None)

    def _rewinds_anywhere(self) -> bool:
        """``_KeysCacheHooks``': False where the cache is a rolling window's."""
        return self.window is None

    def _set_cache_state(self, state: tuple) -> None:
        super()._set_cache_state(state)
        object.__setattr__(self, "_last", None)  # the last call's keys, read by the layers reusing them

    @property
    def kv_cache_length(self) -> int:
        """The tokens seen through the cache (a reusing layer: its source's)."""
        layer = self._source if self.reuse else self
        cache = None if layer is None else layer._kv_cache
        return 0 if cache is None else cache.position

    @property
    def kv_cache_nbytes(self) -> int:
        """The bytes of keys and values this layer's cache holds: 0 in a reusing layer (what
        cross-layer KV sharing saves); a sliding layer's rolling cache holds its window's."""
        return 0 if self._kv_cache is None else self._kv_cache.nbytes

    # -- forward ------------------------------------------------------------------------------
    def forward(self, x, *, use_cache: bool = False, key_padding_mask=None, positions=None):
        """``x (..., L, hidden)`` -> ``(..., L, hidden)``.  ``use_cache``: append this call's keys
        and values to the cache and attend over every cached one (no state kept for backward);
        ``key_padding_mask (..., T + L)`` bool, True = padding (over the cached keys too);
        ``positions`` RoPE's positions broadcastable to ``(..., L)`` (default ``T + arange(L)``).
        A reusing layer runs after its source's call of the same tokens."""
        x = as_float(x, "x", self.dtype)
        if x.ndim < 2 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected shape (..., L, {self.hidden_size}), got {x.shape}")
        use_cache = check_bool(use_cache, "use_cache")
        if positions is not None:
            positions = as_index(positions, "positions")
            check_broadcastable(positions.shape, x.shape[:-1], "positions", "x's shape without hidden")
        src = self._source
        if self.reuse and (src is None or src._last is None):
            raise RuntimeError("SharedKVAttention: a reusing layer runs after the call of the layer it shares with")
        lk = x.shape[-2] + (self._past(use_cache) if not self.reuse else src._last.start)  # type: ignore[union-attr]
        if key_padding_mask is not None:
            kpm = np.asarray(key_padding_mask)
            if kpm.dtype != bool or kpm.shape != x.shape[:-2] + (lk,):
                raise ValueError(
                    f"key_padding_mask: expected bool of shape {x.shape[:-2] + (lk,)}, got {kpm.dtype} {kpm.shape}"
                )
            key_padding_mask = kpm
        return self._forward(x, use_cache, key_padding_mask, positions)

    def _past(self, use_cache: bool) -> int:
        cache = self._kv_cache
        return cache.position if use_cache and cache is not None else 0

    def _heads(self, t, heads: int):
        """``(..., L, heads * d) -> (..., L, heads, d)``."""
        return t.reshape(t.shape[:-1] + (heads, self.head_dim))

    def _rope(self, t, positions, start: int):
        """RoPE of heads ``t (..., h, L, d)`` at ``positions`` (``(..., L)``) or ``start + arange(L)``."""
        pos = np.arange(start, start + t.shape[-2]) if positions is None else positions
        if positions is not None and positions.ndim > 1:
            pos = positions[..., None, :]  # one row of positions for every head
        return K.rope(t, pos, base=self.rope_base, scaling=self.rope_scaling, rotary_dim=self.rotary_dim)

    def _keys_values(self, x, use_cache: bool, positions) -> tuple:
        """This call's keys and values (after the cache): the ``SharedKV`` record and RoPE's cache."""
        hk = self.num_kv_heads
        kr = self._heads(self.k_proj._forward(x), hk)
        vr = kr if self.v_proj is None else self._heads(self.v_proj._forward(x), hk)
        kh, k_rope = self._rope(self.k_norm._forward(kr).swapaxes(-2, -3), positions, self._past(use_cache))
        vh = self.v_norm._forward(vr).swapaxes(-2, -3)
        start = dropped = 0
        if use_cache:
            if self._kv_cache is None:
                keep = None if self.window is None else self.window[0]
                object.__setattr__(self, "_kv_cache", KVCache() if keep is None else RollingKVCache(keep))
            cache = self._kv_cache
            assert cache is not None
            if cache.lead is not None and cache.lead != x.shape[:-2]:
                raise ValueError(f"x: the cached calls' batch shape is {cache.lead}, got {x.shape[:-2]}")
            start, dropped = cache.position, cache.position - cache.length
            kh, vh = (a.copy() for a in cache.append(kh, vh))  # the views change when the cache rolls
        shared = SharedKV(kh, vh, start, dropped)
        object.__setattr__(self, "_last", shared)
        return shared, k_rope

    def _forward(self, x, use_cache: bool = False, key_padding_mask=None, positions=None):
        lead, steps, h = x.shape[:-2], x.shape[-2], self.num_heads
        q = self.q_norm._forward(self._heads(self.q_proj._forward(x), h)).swapaxes(-2, -3)
        if self.reuse:
            shared, k_rope = self._source._last, None  # type: ignore[union-attr]
            if shared.k.shape[:-3] != lead:  # type: ignore[union-attr]
                raise ValueError(f"x: its batch shape {lead} differs from the shared keys' {shared.k.shape[:-3]}")  # type: ignore[union-attr]
        else:
            shared, k_rope = self._keys_values(x, use_cache, positions)
        assert shared is not None
        qh, q_rope = self._rope(q, positions, shared.start)
        mask = None
        if key_padding_mask is not None:  # (..., Lk) True = padding -> (..., 1, 1, Lk) True = may attend
            mask = ~key_padding_mask[..., shared.dropped :][..., None, None, :]
        ctx, attn = K.scaled_dot_product_attention(
            qh, shared.k, shared.v, mask, True, 0.0, self.scale, None, h != self.num_kv_heads,
            causal_align="bottom_right" if use_cache else "top_left", window=self.window,
        )  # fmt: skip
        out = self.o_proj._forward(self._merge(ctx))
        if use_cache:
            if not self.reuse:
                self._kv_cache.trim()  # type: ignore[union-attr]
            self.clear_saved()
        else:
            self.save_for_backward(_State(lead, steps, q_rope, k_rope, attn, shared))
        return out

    @staticmethod
    def _merge(t):
        """``(..., h, L, d) -> (..., L, h d)``."""
        t = t.swapaxes(-2, -3)
        return t.reshape(t.shape[:-2] + (t.shape[-2] * t.shape[-1],))

    # -- backward -----------------------------------------------------------------------------
    def backward(self, dy) -> np.ndarray:
        """``dx``; each parameter's gradient added into its ``.grad``.  ``o_proj``, the attention
        core, then queries (RoPE, ``q_norm``, ``q_proj``); a reusing layer sends ``dk``, ``dv`` to
        its source's record, a producing layer adds the reusing layers' to its own, then RoPE,
        ``k_norm``, ``v_norm`` and the projections (``k_eq_v``: ``k_proj`` gets both gradients)."""
        return self._backward(self._check_dy(dy))

    def _backward(self, dy):
        st: _State = self.pop_saved()
        h = self.num_heads
        dctx = self._heads(self.o_proj._backward(dy), h).swapaxes(-2, -3)
        dq, dk, dv = K.scaled_dot_product_attention_backward(dctx, st.attn)[:3]
        dx = self._kv_backward(st, dk, dv)
        dq = self.q_norm._backward(K.rope_backward(dq, st.q_rope).swapaxes(-2, -3))
        dxq = self.q_proj._backward(dq.reshape(dq.shape[:-2] + (h * self.head_dim,)))
        return dxq if dx is None else dxq + dx

    def _kv_backward(self, st: _State, dk, dv):
        """The keys' and values' part of ``dx`` (None in a reusing layer, which sends them home)."""
        if self.reuse:
            st.shared.send_home(dk, dv)
            return None
        dk, dv, _, _ = st.shared.received(dk, dv)
        dkr = self.k_norm._backward(K.rope_backward(dk, st.k_rope).swapaxes(-2, -3))
        dvr = self.v_norm._backward(dv.swapaxes(-2, -3))
        flat = dkr.shape[:-2] + (self.num_kv_heads * self.head_dim,)
        if self.v_proj is None:  # k_eq_v: the key projection made both
            return self.k_proj._backward((dkr + dvr).reshape(flat))
        return self.k_proj._backward(dkr.reshape(flat)) + self.v_proj._backward(dvr.reshape(flat))

    # -- forward mode ---------------------------------------------------------------------------
    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: each stage's JVP in the forward's order (projections, norms and RoPE
        linear in their tangents, ``scaled_dot_product_attention_jvp``); a producing layer leaves
        its keys' and values' tangents in the record, a reusing layer takes them from it."""
        return self._forward_tangents(state, input_tangents, param_tangents, "jvp")[1]

    def _forward_tangents(self, st: _State, input_tangents, pt, method: str) -> tuple:
        """``(_Tangents, the output's tangent)`` from the input's tangent."""
        (tx,) = check_tangents(input_tangents, ("tx",), f"SharedKVAttention.{method}")
        shape = st.lead + (st.steps, self.hidden_size)
        tx_in = tx = check_tangent(tx, "tx", shape, self.dtype)
        if tx is None:
            tx = np.zeros(shape, self.dtype)

        def sub(m, t):
            return self._child_jvp(m, -1, (t,), pt)

        tq0 = self._heads(sub(self.q_proj, tx), self.num_heads)
        tq1 = sub(self.q_norm, tq0)
        tqh = K.rope_jvp(st.q_rope, tq1.swapaxes(-2, -3))
        tk = None
        if self.reuse:
            if st.shared.tk is None:
                raise RuntimeError(
                    "SharedKVAttention.jvp: the layer it shares with has no tangents of this call yet "
                    "(run its jvp first)"
                )
            tkh, tvh = st.shared.tk, st.shared.tv
        else:
            tkr = self._heads(sub(self.k_proj, tx), self.num_kv_heads)
            tvr = tkr if self.v_proj is None else self._heads(sub(self.v_proj, tx), self.num_kv_heads)
            tkn = sub(self.k_norm, tkr)
            tkh = K.rope_jvp(st.k_rope, tkn.swapaxes(-2, -3))
            tvh = sub(self.v_norm, tvr).swapaxes(-2, -3)
            st.shared.tk, st.shared.tv = tkh, tvh
            tk = (tkr, tvr, tkn)
        tmerged = self._merge(K.scaled_dot_product_attention_jvp(st.attn, tqh, tkh, tvh))
        tangents = _Tangents(tx_in, (tq0, tq1), tk, (tqh, tkh, tvh), tmerged)
        return tangents, sub(self.o_proj, tmerged)

    # -- second order ---------------------------------------------------------------------------
    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: the forward's tangents (as ``_jvp``), then the backward's stages in
        reverse, each by its ``backward_jvp`` (``o_proj``, the attention core, RoPE, the norms,
        the projections); the reusing layers' gradients and their tangents reach the producing
        layer through the record, as in ``backward``."""
        st: _State = state
        pt, h, d = param_tangents, self.num_heads, self.head_dim
        tg, _ = self._forward_tangents(st, input_tangents, pt, "backward_jvp")
        tx_in = tg.x

        def back(m, g, t, gt):
            return self._child_backward_jvp(m, g, (t,), pt, gt)

        dm, tdm = back(self.o_proj, dy, tg.merged, ddy)
        dctx, tdctx = (self._heads(a, h).swapaxes(-2, -3) for a in (dm, tdm))
        grads, tans = K.scaled_dot_product_attention_backward_jvp(dctx, st.attn, tg.attended, tdctx)
        dx, tdx = self._kv_backward_jvp(st, tg, grads[1:3], tans[1:3], tx_in, back)
        dq, tdq = K.rope_backward_jvp(grads[0], st.q_rope, (tg.q[1].swapaxes(-2, -3),), tans[0])
        dq, tdq = back(self.q_norm, dq.swapaxes(-2, -3), tg.q[0], tdq.swapaxes(-2, -3))
        flat = dq.shape[:-2] + (h * d,)
        dxq, tdxq = back(self.q_proj, dq.reshape(flat), tx_in, tdq.reshape(flat))
        return (dxq, tdxq) if dx is None else (dxq + dx, tdxq + tdx)

    def _kv_backward_jvp(self, st: _State, tg: _Tangents, grads, tans, tx, back):
        """The keys' and values' part of ``(dx, its tangent)``: sent home in a reusing layer."""
        (dk, dv), (tdk, tdv) = grads, tans
        if self.reuse:
            st.shared.send_home(dk, dv, tdk, tdv)
            return None, None
        assert tg.k is not None
        tkr, tvr, tkn = tg.k
        dk, dv, tdk, tdv = st.shared.received(dk, dv, tdk, tdv)
        dk, tdk = K.rope_backward_jvp(dk, st.k_rope, (tkn.swapaxes(-2, -3),), tdk)
        dkr, tdkr = back(self.k_norm, dk.swapaxes(-2, -3), tkr, tdk.swapaxes(-2, -3))
        dvr, tdvr = back(self.v_norm, dv.swapaxes(-2, -3), tvr, tdv.swapaxes(-2, -3))
        flat = dkr.shape[:-2] + (self.num_kv_heads * self.head_dim,)
        if self.v_proj is None:  # k_eq_v: the key projection made both
            return back(self.k_proj, (dkr + dvr).reshape(flat), tx, (tdkr + tdvr).reshape(flat))
        dxk, tdxk = back(self.k_proj, dkr.reshape(flat), tx, tdkr.reshape(flat))
        dxv, tdxv = back(self.v_proj, dvr.reshape(flat), tx, tdvr.reshape(flat))
        return dxk + dxv, tdxk + tdxv

    def extra_repr(self) -> str:
        """The arguments shown by ``repr(module)``."""
        s = (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}"
        )
        s += "".join(f", {k}=True" for k in ("k_eq_v", "reuse") if getattr(self, k))
        return s + (f", window={self.window}" if self.window is not None else "")


class PerLayerInput(Module):
    """A decoder layer's per-layer input (Gemma 4's PLE), ``(x (..., hidden), p (..., P)) -> (...,
    hidden)``: ``x + post_per_layer_input_norm(per_layer_projection(act(per_layer_input_gate(x)) *
    p))``.  ``backward(dy)`` returns ``(dx, dp)``.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn.nn.shared_kv import PerLayerInput
    >>> m = PerLayerInput(8, 4, rng=0)
    >>> x, p = np.ones((2, 3, 8)), np.ones((2, 3, 4))
    >>> [a.shape for a in m.backward(m(x, p))]
    [(2, 3, 8), (2, 3, 4)]
    """

    def __init__(self, hidden_size: int, per_layer_size: int, hidden_act: str = "gelu_pytorch_tanh", *,
                 eps: float = 1e-6, rng=None, dtype=np.float64) -> None:  # fmt: skip
        from .moe import HIDDEN_ACTS, PARAMETRIZED_ACTS

        super().__init__()
        known = sorted(set(HIDDEN_ACTS) - PARAMETRIZED_ACTS)
        if hidden_act not in known:
            raise ValueError(f"hidden_act: expected one of {known}, got {hidden_act!r}")
        self.hidden_act = hidden_act
        self._acts = act_kernels(HIDDEN_ACTS[hidden_act])
        self.hidden_size, self.per_layer_size = (
            check_size(hidden_size, "hidden_size"),
            check_size(per_layer_size, "per_layer_size"),
        )
        self._dtype = dt = check_dtype(dtype)
        rng = as_rng(rng)
        self.per_layer_input_gate = Linear(self.hidden_size, self.per_layer_size, False, rng=rng, dtype=dt)
        self.per_layer_projection = Linear(self.per_layer_size, self.hidden_size, False, rng=rng, dtype=dt)
        self.post_per_layer_input_norm = RMSNorm(
            self.hidden_size, check_positive_float(eps, "eps", allow_zero=True), dtype=dt
        )

    def forward(self, x, p):
        """``x (..., hidden)``, ``p (..., P)`` of the same leading shape -> ``(..., hidden)``."""
        x, p = as_float(x, "x", self.dtype), as_float(p, "p", self.dtype)
        if x.shape[-1:] != (self.hidden_size,) or p.shape != x.shape[:-1] + (self.per_layer_size,):
            raise ValueError(
                f"x, p: expected shapes (..., {self.hidden_size}) and (..., {self.per_layer_size}) with the same "
                f"leading axes, got {x.shape} and {p.shape}"
            )
        return self._forward(x, p)

    def _forward(self, x, p):
        s, act_cache = self._acts[0](self.per_layer_input_gate._forward(x))
        y = self.post_per_layer_input_norm._forward(self.per_layer_projection._forward(s * p))
        self.save_for_backward((act_cache, s, p))
        return x + y

    def backward(self, dy):
        """``(dx, dp)``: ``g = s p`` with ``s = act(a)``, ``a = gate x``: ``dp = dg s``,
        ``da = act'(a) (dg p)``; ``dx`` is ``dy`` (the residual) plus the gate's input gradient."""
        return self._backward(self._check_dy(dy))

    def _backward(self, dy):
        act_cache, s, p = self.pop_saved()
        dg = self.per_layer_projection._backward(self.post_per_layer_input_norm._backward(dy))
        da = self._acts[1](dg * p, act_cache)
        return dy + self.per_layer_input_gate._backward(da), dg * s

    def _tangents(self, state, input_tangents, pt, method: str):
        """``(ta, ts, tg, tx, tp)``: the gate's output and its activation, ``g = s p``, the inputs."""
        act_cache, s, p = state
        tx, tp = check_tangents(input_tangents, ("tx", "tp"), f"PerLayerInput.{method}")
        tx = check_tangent(tx, "tx", p.shape[:-1] + (self.hidden_size,), self.dtype)
        tp = check_tangent(tp, "tp", p.shape, self.dtype)
        tx = np.zeros(p.shape[:-1] + (self.hidden_size,), self.dtype) if tx is None else tx
        ta = self._child_jvp(self.per_layer_input_gate, -1, (tx,), pt)
        ts = self._acts[2](act_cache, ta)
        tg = ts * p if tp is None else ts * p + s * tp
        return ta, ts, tg, tx, tp

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: ``ty = tx + norm'(proj'(ts p + s tp))``, ``ts = act'(a) ta``."""
        _, _, tg, tx, _ = self._tangents(state, input_tangents, param_tangents, "jvp")
        t = self._child_jvp(self.per_layer_projection, -1, (tg,), param_tangents)
        return tx + self._child_jvp(self.post_per_layer_input_norm, -1, (t,), param_tangents)

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: the norm and the projection by their ``backward_jvp``, then ``dp = dg s``
        and ``u = dg p`` by the product rule (``tdp = tdg s + dg ts``, ``tu = tdg p + dg tp``),
        the activation's ``backward_jvp``, the gate's; the residual adds ``(dy, ddy)``."""
        act_cache, s, p = state
        pt = param_tangents
        ta, ts, tg, tx, tp = self._tangents(state, input_tangents, pt, "backward_jvp")
        tproj = self._child_jvp(self.per_layer_projection, -1, (tg,), pt)
        ddy = np.zeros_like(dy) if ddy is None else ddy
        dz, tdz = self._child_backward_jvp(self.post_per_layer_input_norm, dy, (tproj,), pt, ddy)
        dg, tdg = self._child_backward_jvp(self.per_layer_projection, dz, (tg,), pt, tdz)
        tu = tdg * p if tp is None else tdg * p + dg * tp
        da, tda = self._acts[3](dg * p, act_cache, (ta,), tu)
        dxg, tdxg = self._child_backward_jvp(self.per_layer_input_gate, da, (tx,), pt, tda)
        return (dy + dxg, dg * s), (ddy + tdxg, tdg * s + dg * ts)


class PerLayerEmbeddings(Module):
    """The per-layer inputs of every layer (Gemma 4's PLE), ``(ids (..., L), e (..., L, hidden))
    -> (..., L, num_layers, P)``: ``(norm(per_layer_model_projection(e) / sqrt(hidden)) +
    embed_tokens_per_layer(ids) sqrt(P)) / sqrt(2)``, the projection and the table each
    ``num_layers * P`` wide, seen as ``(num_layers, P)``; ``e`` is the model's scaled token
    embedding.  ``backward(dout)`` returns ``de`` (token ids have no gradient).

    Examples
    --------
    >>> import numpy as np
    >>> from npattn.nn.shared_kv import PerLayerEmbeddings
    >>> m = PerLayerEmbeddings(10, 8, 3, 4, rng=0)
    >>> p = m(np.array([[1, 2]]), np.ones((1, 2, 8)))
    >>> p.shape, m.backward(np.ones_like(p)).shape
    ((1, 2, 3, 4), (1, 2, 8))
    """

    def __init__(self, vocab_size: int, hidden_size: int, num_layers: int, per_layer_size: int, *,
                 padding_idx: int | None = None, eps: float = 1e-6, rng=None, dtype=np.float64) -> None:  # fmt: skip
        super().__init__()
        self.hidden_size, self.num_layers = check_size(hidden_size, "hidden_size"), check_size(num_layers, "num_layers")
        self.per_layer_size = check_size(per_layer_size, "per_layer_size")
        self._dtype = dt = check_dtype(dtype)
        rng = as_rng(rng)
        width = self.num_layers * self.per_layer_size
        self.embed_tokens_per_layer = Embedding(vocab_size, width, padding_idx, rng=rng, dtype=dt)
        self.per_layer_model_projection = Linear(self.hidden_size, width, False, rng=rng, dtype=dt)
        self.per_layer_projection_norm = RMSNorm(
            self.per_layer_size, check_positive_float(eps, "eps", allow_zero=True), dtype=dt
        )

    def _scales(self):
        """``(sqrt(P), 1/sqrt(hidden), 1/sqrt(2))`` in the module's dtype (transformers' factors)."""
        t = self.dtype.type
        return t(math.sqrt(self.per_layer_size)), t(self.hidden_size**-0.5), t(2.0**-0.5)

    def forward(self, ids, e):
        """``ids (..., L)`` (below ``vocab_size``), ``e (..., L, hidden)`` -> ``(..., L, num_layers, P)``."""
        ids = self.embed_tokens_per_layer._check_input(ids)
        e = as_float(e, "e", self.dtype)
        if e.shape != ids.shape + (self.hidden_size,):
            raise ValueError(f"e: expected shape {ids.shape + (self.hidden_size,)}, got {e.shape}")
        return self._forward(ids, e)

    def _layers(self, t):
        return t.reshape(t.shape[:-1] + (self.num_layers, self.per_layer_size))

    def _forward(self, ids, e):
        s_tok, s_proj, s_sum = self._scales()
        tok = self._layers(self.embed_tokens_per_layer._forward(ids) * s_tok)
        proj = self.per_layer_projection_norm._forward(
            self._layers(self.per_layer_model_projection._forward(e) * s_proj)
        )
        self.save_for_backward(e.shape)
        return (proj + tok) * s_sum

    def backward(self, dout):
        """``de``; the table's, the projection's and the norm's gradients added into their ``.grad``."""
        return self._backward(self._check_dy(dout, "dout"))

    def _backward(self, dout):
        shape = self.pop_saved()
        s_tok, s_proj, s_sum = self._scales()
        d = dout * s_sum
        flat = shape[:-1] + (self.num_layers * self.per_layer_size,)
        self.embed_tokens_per_layer._backward((d * s_tok).reshape(flat))
        dproj = self.per_layer_projection_norm._backward(d).reshape(flat) * s_proj
        return self.per_layer_model_projection._backward(dproj)

    def _te(self, state, input_tangents, method: str):
        tids, te = check_tangents(input_tangents, ("tids", "te"), f"PerLayerEmbeddings.{method}")
        if tids is not None:
            raise TypeError(f"PerLayerEmbeddings.{method}: token ids have no tangent; expected None")
        te = check_tangent(te, "te", state, self.dtype)
        return np.zeros(state, self.dtype) if te is None else te

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: the table's tangent rows and the projection's and norm's JVPs, scaled as
        the forward."""
        s_tok, s_proj, s_sum = self._scales()
        te = self._te(state, input_tangents, "jvp")
        pt = param_tangents
        ttok = self._child_jvp(self.embed_tokens_per_layer, -1, (), pt)
        tproj = self._child_jvp(self.per_layer_model_projection, -1, (te,), pt)
        tn = self._child_jvp(self.per_layer_projection_norm, -1, (self._layers(tproj * s_proj),), pt)
        return (tn + self._layers(ttok * s_tok)) * s_sum

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: each child's ``backward_jvp`` on the scaled gradient and its tangent."""
        s_tok, s_proj, s_sum = self._scales()
        te, pt = self._te(state, input_tangents, "backward_jvp"), param_tangents
        d, td = dy * s_sum, (np.zeros_like(dy) if ddy is None else ddy) * s_sum
        flat = state[:-1] + (self.num_layers * self.per_layer_size,)
        self._child_backward_jvp(
            self.embed_tokens_per_layer, (d * s_tok).reshape(flat), (), pt, (td * s_tok).reshape(flat)
        )
        tproj = self._layers(self._child_jvp(self.per_layer_model_projection, -1, (te,), pt) * s_proj)
        dn, tdn = self._child_backward_jvp(self.per_layer_projection_norm, d, (tproj,), pt, td)
        return self._child_backward_jvp(
            self.per_layer_model_projection, dn.reshape(flat) * s_proj, (te,), pt, tdn.reshape(flat) * s_proj
        )


class ScaledRouter(Module):
    """Gemma 4's router, ``x (N, hidden) -> (weights (N, k), indices (N, k))``: the chosen experts
    of ``TopKRouter`` (``proj``: softmax, top-k, renormalised) on ``RMSNorm(x) * scale /
    sqrt(hidden)`` (a norm without weight, then the learnt ``scale``), each weight times its
    expert's ``per_expert_scale``.  The choice is piecewise constant: the gradient flows through
    the chosen weights (``TopKRouter``), and ``per_expert_scale`` gets ``sum dw w`` per expert."""

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, *, eps: float = 1e-6, rng=None, dtype=np.float64
    ):
        from .moe import TopKRouter

        super().__init__()
        self.hidden_size = check_size(hidden_size, "hidden_size")
        self.num_experts = check_size(num_experts, "num_experts")
        self.eps = check_positive_float(eps, "eps", allow_zero=True)
        self._dtype = dt = check_dtype(dtype)
        self.proj = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob=True, rng=rng, dtype=dt)
        self.scale = Parameter(np.ones(self.hidden_size), dt)
        self.per_expert_scale = Parameter(np.ones(self.num_experts), dt)

    def _c(self):
        return self.dtype.type(self.hidden_size**-0.5)

    def forward(self, x):
        """``x (N, hidden)`` -> ``(weights (N, k), indices (N, k))``."""
        x = as_float(x, "x", self.dtype)
        if x.ndim != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"x: expected shape (N, {self.hidden_size}), got {x.shape}")
        return self._forward(x)

    def _forward(self, x):
        h, norm = K.rms_norm(x, self.scale.data * self._c(), self.eps)
        w, idx = self.proj._forward(h)
        self.save_for_backward((norm, w, idx))
        return w * self.per_expert_scale.data[idx], idx

    def backward(self, dweights):
        """``dx``: ``dw = dweights * per_expert_scale[idx]`` through ``proj`` and the norm."""
        return self._backward(self._check_dy(dweights, "dweights"))

    def _scatter(self, idx, v):
        return np.bincount(idx.reshape(-1), weights=v.reshape(-1), minlength=self.num_experts).astype(self.dtype)

    def _backward(self, dout):
        norm, w, idx = self.pop_saved()
        self.accumulate_grad(self.per_expert_scale, self._scatter(idx, dout * w))
        dx, dweight = K.rms_norm_backward(self.proj._backward(dout * self.per_expert_scale.data[idx]), norm)
        self.accumulate_grad(self.scale, dweight * self._c())
        return dx

    def _tangents(self, state, input_tangents, pt, method):
        norm, w, idx = state
        tx = input_tangent_of(input_tangents, "ScaledRouter", method)
        ts = pt.get(self.scale)
        th = K.rms_norm_jvp(norm, tx, None if ts is None else ts * self._c())
        tw = self._child_jvp(self.proj, -1, (th,), pt)
        return tx, th, tw

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: ``tout = tw * s[idx] + w * ts[idx]`` (``s`` the per-expert scale)."""
        _, w, idx = state
        _, _, tw = self._tangents(state, input_tangents, param_tangents, "jvp")
        tpes = param_tangents.get(self.per_expert_scale)
        tout = tw * self.per_expert_scale.data[idx]
        return tout if tpes is None else tout + w * tpes[idx]

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: ``dw = dy s[idx]`` and ``dper_expert_scale = scatter(dy w)`` by the product
        rule, then ``proj``'s and the norm's ``backward_jvp``."""
        norm, w, idx = state
        pt = param_tangents
        tx, th, tw = self._tangents(state, input_tangents, pt, "backward_jvp")
        pes, tpes = self.per_expert_scale.data[idx], pt.get(self.per_expert_scale)
        ddy = np.zeros_like(dy) if ddy is None else ddy
        dw, tdw = dy * pes, ddy * pes + (0 if tpes is None else dy * tpes[idx])
        pairs = [(self.per_expert_scale, self._scatter(idx, dy * w), self._scatter(idx, ddy * w + dy * tw))]
        dh, tdh = self._child_backward_jvp(self.proj, dw, (th,), pt, tdw)
        ts = pt.get(self.scale)
        (dx, dwt), (tdx, tdwt) = K.rms_norm_backward_jvp(dh, norm, (tx, None if ts is None else ts * self._c()), tdh)
        self._accumulate_second(pairs + [(self.scale, dwt * self._c(), tdwt * self._c())])
        return dx, tdx


def input_tangent_of(input_tangents: tuple, module: str, method: str):
    """The one input tangent of a module (None: zero), at most one given."""
    (t,) = check_tangents(input_tangents, ("tx",), f"{module}.{method}")
    return t


class DenseWithExperts(Module):
    """Gemma 4's feed-forward with routed experts beside the dense MLP (``enable_moe_block``),
    ``x (..., hidden) -> (..., hidden)``, as transformers' ``Gemma4TextDecoderLayer``::

        y = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(x)))
          + post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(x), router(x)))

    (the decoder layer's ``post_feedforward_layernorm`` follows).  Backward: the sum's gradient goes
    to both branches; the experts return the gradients of their input and of the routing weights,
    which the router takes back to ``x``."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 moe_intermediate_size: int, hidden_act: str = "gelu_pytorch_tanh", *, eps: float = 1e-6,
                 rng=None, dtype=np.float64) -> None:  # fmt: skip
        from .moe import Experts, GatedMLP

        super().__init__()
        self.hidden_size = h = check_size(hidden_size, "hidden_size")
        self._dtype = dt = check_dtype(dtype)
        rng = as_rng(rng)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, dtype=dt)
        self.mlp = GatedMLP(h, intermediate_size, hidden_act, rng=rng, dtype=dt)
        self.post_feedforward_layernorm_1 = RMSNorm(h, eps, dtype=dt)
        self.router = ScaledRouter(h, num_experts, top_k, eps=eps, rng=rng, dtype=dt)
        self.experts = Experts(num_experts, h, moe_intermediate_size, hidden_act=hidden_act, rng=rng, dtype=dt)
        self.pre_feedforward_layernorm_2 = RMSNorm(h, eps, dtype=dt)
        self.post_feedforward_layernorm_2 = RMSNorm(h, eps, dtype=dt)

    def forward(self, x):
        """``x (..., hidden)`` -> ``(..., hidden)``."""
        x = as_float(x, "x", self.dtype)
        if x.shape[-1:] != (self.hidden_size,):
            raise ValueError(f"x: expected shape (..., {self.hidden_size}), got {x.shape}")
        return self._forward(x)

    def _forward(self, x):
        flat = x.reshape(-1, self.hidden_size)
        a = self.post_feedforward_layernorm_1._forward(self.mlp._forward(self.pre_feedforward_layernorm._forward(flat)))
        w, idx = self.router._forward(flat)
        e = self.experts._forward(self.pre_feedforward_layernorm_2._forward(flat), idx, w)
        self.save_for_backward((x.shape, idx))
        return (a + self.post_feedforward_layernorm_2._forward(e)).reshape(x.shape)

    def backward(self, dy):
        """``dx``: both branches' and the router's."""
        return self._backward(self._check_dy(dy))

    def _backward(self, dy):
        shape, _ = self.pop_saved()
        d = dy.reshape(-1, self.hidden_size)
        de, dw = self.experts._backward(self.post_feedforward_layernorm_2._backward(d))
        dx = self.pre_feedforward_layernorm_2._backward(de) + self.router._backward(dw)
        dm = self.mlp._backward(self.post_feedforward_layernorm_1._backward(d))
        return (dx + self.pre_feedforward_layernorm._backward(dm)).reshape(shape)

    def _forward_tangents(self, state, input_tangents, pt, method):
        """``(tx, the dense branch's inputs, the experts' input, the routing weights' tangent)``."""
        shape, _ = state
        tx = check_tangent(input_tangent_of(input_tangents, "DenseWithExperts", method), "tx", shape, self.dtype)
        tx = (
            np.zeros((int(np.prod(shape[:-1])), self.hidden_size), self.dtype)
            if tx is None
            else tx.reshape(-1, self.hidden_size)
        )

        def sub(m, t):
            return self._child_jvp(m, -1, (t,), pt)

        t_pre = sub(self.pre_feedforward_layernorm, tx)
        t_mlp = sub(self.mlp, t_pre)
        return tx, (t_pre, t_mlp), sub(self.pre_feedforward_layernorm_2, tx), sub(self.router, tx)

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: each branch's chain of JVPs, summed; the experts' with the routing
        weights' tangent (the choice constant)."""
        pt = param_tangents
        _, (_, t_mlp), t_pre2, tw = self._forward_tangents(state, input_tangents, pt, "jvp")
        ta = self._child_jvp(self.post_feedforward_layernorm_1, -1, (t_mlp,), pt)
        te = self._child_jvp(self.experts, -1, (t_pre2, None, tw), pt)
        tb = self._child_jvp(self.post_feedforward_layernorm_2, -1, (te,), pt)
        return (ta + tb).reshape(state[0])

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: each child's ``backward_jvp`` in the backward's order, the branches'
        ``(dx, tdx)`` summed."""
        pt = param_tangents
        shape = state[0]
        tx, (t_pre, t_mlp), t_pre2, tw = self._forward_tangents(state, input_tangents, pt, "backward_jvp")
        te = self._child_jvp(self.experts, -1, (t_pre2, None, tw), pt)
        d = dy.reshape(-1, self.hidden_size)
        td = np.zeros_like(d) if ddy is None else ddy.reshape(d.shape)

        def back(m, g, *t):
            return self._child_backward_jvp(m, g[0], t, pt, g[1])

        gb = back(self.post_feedforward_layernorm_2, (d, td), te)
        (de, dw), (tde, tdw) = back(self.experts, gb, t_pre2, None, tw)
        g2 = back(self.pre_feedforward_layernorm_2, (de, tde), tx)
        gr = back(self.router, (dw, tdw), tx)
        ga = back(self.post_feedforward_layernorm_1, (d, td), t_mlp)
        g1 = back(self.pre_feedforward_layernorm, back(self.mlp, ga, t_pre), tx)
        dx = g2[0] + gr[0] + g1[0]
        tdx = g2[1] + gr[1] + g1[1]
        return dx.reshape(shape), tdx.reshape(shape)
