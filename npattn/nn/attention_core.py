"""``MultiHeadAttentionCore``: the common path of multi-head attention, as four named stages.

``project`` (q, k, v from one fused GEMM in self-attention, three in cross-attention) ->
``position`` (QK-norm, OLMo's clamp of q, k and v, then RoPE with the KV cache's offset) ->
``attend`` (the attention core, ``scaled_dot_product_attention`` or
``memory_efficient_attention``, with the module's ``AttentionOptions``) -> ``output``
(Qwen3-Next's output gate, then ``out_proj``).  The backward and the JVP walk the same stages,
each by its own method.

The attention options (``causal_align``, ``window``, ALiBi, ``softcap``) are validated once, in
``__init__``, by the cores' own ``AttentionOptions.checked``, and held as one ``AttentionOptions``
(``self.options``); each call adds only what changes per call (the sinks parameter's current
values, the bottom-right alignment of a cached call).  The KV cache is a ``KVCache`` (or a
``RollingKVCache`` for a sliding window) of ``npattn.nn.kv_cache``.

The torch-compatibility extras (``add_bias_kv``, ``add_zero_attn``, ``need_weights``,
``from_torch_state_dict``) are not here: ``npattn.MultiHeadAttention`` (``nn/attention.py``) is
this core plus them, overriding the ``attend`` stage (and its backward and JVP) to append the
extra keys.  The core validates everything at its own edge (``forward``), then calls the kernels
(``npattn.functional.kernels``), which do not validate again.  It owns its parameters outright:
for self-attention the three projection weights are row blocks of one fused
``(q_rows + 2 kv, d_in)`` array (``W_query.weight.data`` *is* a view of it), so q, k and v come
out of one GEMM without copying the weights on every call.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, cast

import numpy as np

from .. import masks as _masks
from .._validate import (
    as_float,
    as_index,
    as_rng,
    check_additive_values,
    check_bool,
    check_broadcastable,
    check_cache_batch,
    check_dtype,
    check_mask,
    check_positive_float,
    check_prob,
    check_size,
    check_tangent,
    check_tangents,
    to_numpy,
)
from ..functional import AttentionCache
from ..functional import kernels as K
from ..functional._blocks import AttentionOptions
from ..functional.rope_scaling import check_scaling, resolve_base, resolve_rotary_dim
from .kv_cache import KVCache, RollingKVCache, _KeysCacheHooks
from .layers import LayerNorm, Linear, RMSNorm, fused_linears
from .module import Module, Parameter, is_grad_enabled

__all__ = ["MultiHeadAttentionCore"]

_MASK_NAMES = ("attn_mask", "key_padding_mask")
_POSITION_BLOCK = 1 << 15  # elements of tokens taken at a time by _position_joint (128 KB in float32: stays in L2)


def _token_block(heads: int, head_dim: int) -> int:
    """The tokens of ``heads`` heads of ``head_dim`` features ``_position_joint`` takes at a time:
    about ``_POSITION_BLOCK`` elements, the block's rows (tokens times heads) a multiple of 16.
    The QK-norm's means are one BLAS matrix-vector product (``rms_norm``), whose kernels sum the
    rows in groups of 4 (or 8): blocks whose rows start at a multiple of 16 group them as the
    whole array's product does, so each row's mean has the same bits (a block of 10 rows would not)."""
    unit = 16 // math.gcd(16, heads)
    return max(unit, _POSITION_BLOCK // (heads * head_dim) // unit * unit)


# QK-norm over each head's features, over all heads' of a token, or (each_head) a LayerNorm over each
# head's features with each head its own weight
QK_NORM_SCOPES = ("head", "all_heads", "each_head")


def _check_qk_norm_scope(scope, unit_offset: bool) -> str:
    """``qk_norm_scope``, one of ``QK_NORM_SCOPES``; ``"each_head"``'s weights start at 1, so it
    takes no unit offset."""
    if scope not in QK_NORM_SCOPES:
        raise ValueError(f"qk_norm_scope: expected one of {list(QK_NORM_SCOPES)}, got {scope!r}")
    if scope == "each_head" and unit_offset:
        raise ValueError("qk_norm_unit_offset: expected False with qk_norm_scope='each_head' (its weights start at 1)")
    return scope


class Projected(NamedTuple):
    """The ``project`` stage's output: heads of q (and the output gate), k, v, and the caches."""

    q: np.ndarray  # (..., H, L, hd)
    gate: np.ndarray | None  # (..., L, H, hd) with output_gate
    k: np.ndarray  # (..., Hk, L, hd)
    v: np.ndarray
    caches: tuple  # the linear caches: one fused (self-attention) or three
    qkv: np.ndarray | None  # the fused projection's output (self-attention)


class Positioned(NamedTuple):
    """The ``position`` stage's caches: ``rms_norm`` of q and k (qk_norm), ``rope`` of q and k,
    ``clamp`` of q, k and v (qkv_clip)."""

    q_norm: tuple | None = None
    k_norm: tuple | None = None
    q_rope: tuple | None = None
    k_rope: tuple | None = None
    q_scale: np.ndarray | None = None  # query_scale_by_position: each query's factor, (..., 1|H, Lq, 1)
    q_clip: tuple | None = None  # qkv_clip: clamp's caches of the q, k and v heads
    k_clip: tuple | None = None
    v_clip: tuple | None = None


class State(NamedTuple):
    """What the backward (and the JVP) needs from a forward."""

    self_attn: bool
    proj: tuple  # the linear caches: one fused (self-attention) or three
    position: Positioned
    attn: Any  # the attention kernel's cache
    out: Any  # out_proj's linear cache
    lk: int  # number of real keys (before any extra keys)
    n_extra: int  # number of extra keys appended after them (torch's bias_k / zero key)
    memory_efficient: bool
    sinks: bool
    reused: tuple = ()  # arrays from the module's workspace, given back after the backward
    gate: tuple | None = None  # output_gate: (attention output (..., L, H*hd), sigmoid(gate) of its shape)
    dropped: int = 0  # keys a rolling KV cache had dropped before this call


class _Tangents(NamedTuple):
    """The forward's tangents stage by stage (``_forward_tangents``), what the second order feeds
    each stage's ``backward_jvp``."""

    inputs: list  # the checked input tangents (tquery[, tkey, tvalue])
    projected: tuple  # (tq, tk) heads after the projections
    between: tuple  # (tq, tk) between the two position steps (QK-norm's output and RoPE's input, or the reverse)
    attended: tuple  # (tq, tk, tv) the core's input tangents
    gate: Any  # the output gate's tangent (..., L, H, hd), or None
    merged: np.ndarray  # the core's output, heads merged (..., L, H * hd)
    out_in: np.ndarray  # out_proj's input (merged times the gate)
    weights: Any = None  # the core's weights' tangents block by block (its JVP's), for its second order


def _sigmoid(x):
    """``1 / (1 + exp(-x))`` without overflow: ``exp(-log(1 + exp(-x)))``."""
    return np.exp(-np.logaddexp(0.0, -x))


def _check_query_scale(v) -> tuple[float, int] | None:
    """``query_scale_by_position``: None, or a pair ``(beta, length)`` of a finite number and a
    positive integer."""
    if v is None:
        return None
    ok = isinstance(v, (tuple, list)) and len(v) == 2
    if ok:
        beta, length = v
        ok = isinstance(beta, (int, float, np.floating, np.integer)) and not isinstance(beta, bool)
        ok = ok and math.isfinite(beta) and isinstance(length, (int, np.integer)) and not isinstance(length, bool)
        ok = ok and length >= 1
    if not ok:
        raise ValueError(
            f"query_scale_by_position: expected None or a pair (beta, length) of a finite number and an integer "
            f">= 1, got {v!r}"
        )
    return float(beta), int(length)


class MultiHeadAttentionCore(_KeysCacheHooks, Module):
    """The common path of ``npattn.MultiHeadAttention`` (see its docstring for the arguments):
    batch first ``(..., L, d_in) -> (..., L, d_out)``, projections, heads, masks, dropout,
    grouped-query attention, the attention options, RoPE, QK-norm, the output gate and a KV
    cache, without torch's extras (``add_bias_kv``, ``add_zero_attn``, ``need_weights``)."""

    _TORCH_EXTRAS: bool = False  # add_bias_kv / add_zero_attn accepted (npattn.MultiHeadAttention)
    _n_extra: int = 0  # keys appended after the real ones by a subclass's attend stage (torch's extras)
    _fused: tuple | None  # (W, b, weight views, bias views) of the fused q/k/v projection
    _kv_cache: KVCache | None
    _REPR_FLAGS: tuple[str, ...] = (
        "alibi",
        "rope",
        "rope_interleaved",
        "qk_norm",
        "qk_norm_unit_offset",
        "qk_norm_after_rope",
        "output_gate",
        "memory_efficient",
    )

    def __init__(
        self,
        d_in: int,
        d_out: int,
        num_heads: int,
        *,
        dropout: float = 0.0,
        qkv_bias: bool = False,
        out_bias: bool = True,
        causal: bool = False,
        num_kv_heads: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        memory_efficient: bool = False,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        window: tuple[int, int] | None = None,
        causal_align: str = "top_left",
        softcap: float | None = None,
        alibi: bool = False,
        sinks: bool = False,
        rope: bool = False,
        rope_base: float = 10000.0,
        qk_norm: bool = False,
        qk_norm_eps: float | None = None,
        qk_norm_unit_offset: bool = False,
        qk_norm_scope: str = "head",
        qk_norm_after_rope: bool = False,
        head_dim: int | None = None,
        scale: float | None = None,
        rope_scaling=None,
        partial_rotary_factor: float = 1.0,
        rope_interleaved: bool = False,
        output_gate: bool = False,
        query_scale_by_position: tuple[float, int] | None = None,
        qkv_clip: float | None = None,
        rng=None,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        self._init_shapes(d_in, d_out, num_heads, num_kv_heads, head_dim, kdim, vdim)
        self.dropout = check_prob(dropout, "dropout")
        self.causal = check_bool(causal, "causal")
        self.memory_efficient = check_bool(memory_efficient, "memory_efficient")
        qkv_bias = check_bool(qkv_bias, "qkv_bias")
        out_bias = check_bool(out_bias, "out_bias")
        extras = self._check_extra_keys(add_bias_kv, add_zero_attn)
        options = self._check_options(causal_align, window, softcap, dtype)
        self.alibi = check_bool(alibi, "alibi")
        use_sinks = check_bool(sinks, "sinks")
        self._init_rope(rope, rope_base, rope_scaling, partial_rotary_factor, rope_interleaved)
        self.scale = None if scale is None else check_positive_float(scale, "scale")
        self.qk_norm = check_bool(qk_norm, "qk_norm")
        qk_norm_eps = None if qk_norm_eps is None else check_positive_float(qk_norm_eps, "qk_norm_eps", allow_zero=True)
        self.qk_norm_unit_offset = check_bool(qk_norm_unit_offset, "qk_norm_unit_offset")
        self.qk_norm_scope = _check_qk_norm_scope(qk_norm_scope, self.qk_norm_unit_offset)
        self.qk_norm_after_rope = check_bool(qk_norm_after_rope, "qk_norm_after_rope")
        self.output_gate = check_bool(output_gate, "output_gate")
        self.query_scale_by_position = _check_query_scale(query_scale_by_position)
        self.qkv_clip = None if qkv_clip is None else check_positive_float(qkv_clip, "qkv_clip")
        self._dtype = check_dtype(dtype)
        self.rng = as_rng(rng)
        self._set_options(options)
        self._init_projections(qkv_bias, out_bias)
        self.sinks = Parameter(np.zeros(self.num_heads), self._dtype) if use_sinks else None
        if self.qk_norm:
            self._init_qk_norm(qk_norm_eps)
        object.__setattr__(self, "_fused", None)
        object.__setattr__(self, "_kv_cache", None)
        self._fused_qkv()
        self._init_extra_keys(*extras)

    def _set_options(self, options: AttentionOptions) -> None:
        """The checked ``options`` with the module's ALiBi slopes: ``self.options``, and the same as
        the kernels' keyword arguments (``_options_kw``)."""
        self.options = AttentionOptions(
            causal_align=options.causal_align,
            window=options.window,
            alibi_slopes=self.alibi_slopes() if self.alibi else None,
            softcap=options.softcap,
        )
        self._options_kw: dict[str, Any] = {
            "causal_align": self.options.causal_align,
            "window": self.options.window,
            "alibi_slopes": self.options.alibi_slopes,
            "softcap": self.options.softcap,
            "sinks": None,
        }

    def _check_extra_keys(self, add_bias_kv, add_zero_attn) -> tuple[bool, bool]:
        """torch's two flags checked; True refused where the class has no extra keys (the core)."""
        extras = check_bool(add_bias_kv, "add_bias_kv"), check_bool(add_zero_attn, "add_zero_attn")
        for name, flag in zip(("add_bias_kv", "add_zero_attn"), extras):
            if flag and not self._TORCH_EXTRAS:
                raise ValueError(
                    f"{name}: expected False (MultiHeadAttentionCore has no extra keys; npattn.MultiHeadAttention has)"
                )
        return extras

    def _init_extra_keys(self, add_bias_kv: bool, add_zero_attn: bool) -> None:
        """torch's extra keys: only ``npattn.MultiHeadAttention`` has them (``_TORCH_EXTRAS``; it
        overrides this and the ``attend`` stage).  The core takes the two flags so that both classes
        share one constructor signature, refuses True and has nothing to set up."""

    def _check_options(self, causal_align, window, softcap, dtype) -> AttentionOptions:
        """The options checked by the cores' own ``AttentionOptions.checked``; a window that is not
        a pair and a ``causal_align`` that is not a string keep the module's exception types
        (``TypeError``, ``ValueError``), which its callers rely on."""
        if window is not None:
            if not (isinstance(window, (tuple, list)) and len(window) == 2):
                raise TypeError(f"window: expected None or a pair (left, right) of integers, got {window!r}")
            window = tuple(window)
        if not isinstance(causal_align, str):
            raise ValueError(f"causal_align: expected 'top_left' or 'bottom_right', got {causal_align!r}")
        return AttentionOptions(causal_align, window, softcap=softcap).checked((self.num_heads, 1, 1), dtype, None)

    def _init_shapes(self, d_in, d_out, num_heads, num_kv_heads, head_dim, kdim, vdim) -> None:
        """Check and set the widths: ``d_in``, ``d_out``, the heads, ``head_dim``, ``kdim``, ``vdim``."""
        self.d_in = check_size(d_in, "d_in")
        self.d_out = check_size(d_out, "d_out")
        self.num_heads = check_size(num_heads, "num_heads")
        if head_dim is not None:
            self.head_dim = check_size(head_dim, "head_dim")
        elif self.d_out % self.num_heads:
            raise ValueError(f"d_out: expected a multiple of num_heads={self.num_heads}, got {self.d_out}")
        else:
            self.head_dim = self.d_out // self.num_heads
        self.num_kv_heads = self.num_heads if num_kv_heads is None else check_size(num_kv_heads, "num_kv_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: expected a divisor of num_heads={self.num_heads}, got {self.num_kv_heads}")
        self.kdim = self.d_in if kdim is None else check_size(kdim, "kdim")
        self.vdim = self.d_in if vdim is None else check_size(vdim, "vdim")

    def _init_rope(self, rope, rope_base, rope_scaling, partial_rotary_factor, rope_interleaved) -> None:
        """Check and set RoPE's settings: base, scaling dict, interleaving, rotary features."""
        self.rope = check_bool(rope, "rope")
        self.rope_scaling = check_scaling(rope_scaling, "rope_scaling")  # normalised; "default" when None
        self.rope_base = resolve_base(rope_base, self.rope_scaling, "rope_base")
        self.rope_interleaved = check_bool(rope_interleaved, "rope_interleaved")
        self.partial_rotary_factor = check_positive_float(partial_rotary_factor, "partial_rotary_factor")
        in_dict = self.rope_scaling.get("partial_rotary_factor")
        if self.partial_rotary_factor > 1 or (in_dict is not None and self.partial_rotary_factor not in (1.0, in_dict)):
            raise ValueError(
                f"partial_rotary_factor: expected a share in (0, 1] (agreeing with rope_scaling's {in_dict}), "
                f"got {self.partial_rotary_factor}"
            )
        if in_dict is not None:
            self.partial_rotary_factor = in_dict
        self.rotary_dim = self.head_dim  # the features of each head that rotate
        if self.rope:
            if self.head_dim % 2 and self.partial_rotary_factor == 1.0:
                raise ValueError(f"rope: expected an even head_dim (d_out // num_heads), got {self.head_dim}")
            params = dict(self.rope_scaling, partial_rotary_factor=self.partial_rotary_factor)
            self.rotary_dim = resolve_rotary_dim(self.head_dim, None, params, "rotary_dim")

    def _init_projections(self, qkv_bias: bool, out_bias: bool) -> None:
        """``W_query``, ``W_key``, ``W_value``, ``out_proj``: their draws come first and in this
        order (same seed, same weights)."""
        kv = self.num_kv_heads * self.head_dim
        inner = self.num_heads * self.head_dim  # the merged heads' width (d_out unless head_dim says otherwise)
        self._q_rows = inner * (2 if self.output_gate else 1)  # query (and gate) features of the projection
        self.W_query = Linear(self.d_in, self._q_rows, qkv_bias, rng=self.rng, dtype=self._dtype)
        self.W_key = Linear(self.kdim, kv, qkv_bias, rng=self.rng, dtype=self._dtype)
        self.W_value = Linear(self.vdim, kv, qkv_bias, rng=self.rng, dtype=self._dtype)
        self.out_proj = Linear(inner, self.d_out, out_bias, rng=self.rng, dtype=self._dtype)

    def _init_qk_norm(self, eps) -> None:
        """``q_norm``, ``k_norm``: ``(head_dim,)`` weights, or with ``qk_norm_scope="all_heads"``
        one weight over every head's features (``(num_heads * head_dim,)``, ``(num_kv_heads * head_dim,)``),
        or with ``"each_head"`` bias-free LayerNorms holding one weight per head
        (``(num_heads, head_dim)``, ``(num_kv_heads, head_dim)``; eps 1e-5 by default)."""
        self.q_norm: RMSNorm | LayerNorm
        self.k_norm: RMSNorm | LayerNorm
        if self.qk_norm_scope == "each_head":
            e = 1e-5 if eps is None else eps
            self.q_norm = LayerNorm((self.num_heads, self.head_dim), eps=e, bias=False, dtype=self._dtype)
            self.k_norm = LayerNorm((self.num_kv_heads, self.head_dim), eps=e, bias=False, dtype=self._dtype)
            return
        heads = self.qk_norm_scope == "all_heads"
        nq = self.num_heads * self.head_dim if heads else self.head_dim
        nk = self.num_kv_heads * self.head_dim if heads else self.head_dim
        self.q_norm = RMSNorm(nq, eps=eps, dtype=self._dtype)
        self.k_norm = RMSNorm(nk, eps=eps, dtype=self._dtype)
        if self.qk_norm_unit_offset:  # x_norm * (1 + weight): the weight starts at zero
            self.q_norm.weight = Parameter(np.zeros(nq), self._dtype)
            self.k_norm.weight = Parameter(np.zeros(nk), self._dtype)

    # -- the attention options, read by name --------------------------------------------------
    @property
    def window(self) -> tuple[int, int] | None:
        """The sliding window ``(left, right)`` or None (``self.options.window``)."""
        return self.options.window

    @property
    def causal_align(self) -> str:
        """``"top_left"`` or ``"bottom_right"`` (``self.options.causal_align``)."""
        return self.options.causal_align

    @property
    def softcap(self) -> float | None:
        """The logit softcap or None (``self.options.softcap``)."""
        return self.options.softcap

    def alibi_slopes(self) -> np.ndarray:
        """The ALiBi slopes ``2**(-8 (h + 1) / num_heads)``, ``(num_heads,)``."""
        return 2.0 ** (-8.0 * np.arange(1, self.num_heads + 1, dtype=self.dtype) / self.num_heads)

    def _call_options(self, align: str | None) -> dict:
        """This call's options as the kernels' keywords: the held ones, the sinks' current values,
        ``align`` (a cached call's ``"bottom_right"``) when given."""
        kw = dict(self._options_kw)
        if align is not None:
            kw["causal_align"] = align
        if self.alibi and kw["alibi_slopes"].dtype != self.dtype:  # cast by .to() since __init__
            kw["alibi_slopes"] = self.alibi_slopes()
        if self.sinks is not None:
            kw["sinks"] = self.sinks.data
        return kw

    def extra_repr(self):
        """The arguments shown by ``repr(module)``."""
        s = f"d_in={self.d_in}, d_out={self.d_out}, num_heads={self.num_heads}"
        if self.num_kv_heads != self.num_heads:
            s += f", num_kv_heads={self.num_kv_heads}"
        if self.causal:
            s += ", causal=True"
        if self.dropout:
            s += f", dropout={self.dropout}"
        if self.head_dim * self.num_heads != self.d_out:
            s += f", head_dim={self.head_dim}"
        s += "".join(f", {name}=True" for name in self._REPR_FLAGS if getattr(self, name))
        if self.rope and self.rope_scaling["rope_type"] != "default":
            s += f", rope_scaling={self.rope_scaling['rope_type']!r}"
        if self.rope and self.rotary_dim != self.head_dim:
            s += f", partial_rotary_factor={self.partial_rotary_factor}"
        if self.scale is not None:
            s += f", scale={self.scale}"
        if self.sinks is not None:
            s += ", sinks=True"
        if self.window is not None:
            s += f", window={self.window}"
        if self.causal_align != "top_left":
            s += f", causal_align={self.causal_align!r}"
        if self.softcap is not None:
            s += f", softcap={self.softcap}"
        if self.query_scale_by_position is not None:
            s += f", query_scale_by_position={self.query_scale_by_position}"
        if self.qkv_clip is not None:
            s += f", qkv_clip={self.qkv_clip}"
        return s

    # -- the fused q/k/v weight -------------------------------------------------------------
    def _fused_qkv(self):
        """``(W, b)``: the fused self-attention projection, ``W (q_rows + 2 kv, d_in)`` whose row
        blocks are ``W_query.weight.data``, ``W_key.weight.data``, ``W_value.weight.data`` (views;
        ``b`` likewise for the biases, None without ``qkv_bias``).  Built once; rebuilt (and the
        three parameters' ``.data`` re-pointed at it, same values) only when one of them was
        replaced by another array (``Module.to``, ``copy.deepcopy``, an assignment to ``.data``).
        None when ``kdim`` or ``vdim`` differs from ``d_in`` (no self-attention)."""
        if self.kdim != self.d_in or self.vdim != self.d_in:
            return None
        return fused_linears(self, (self.W_query, self.W_key, self.W_value))

    # -- helpers ---------------------------------------------------------------------------
    def _split(self, t, heads):
        """``(..., L, heads * hd) -> (..., heads, L, hd)`` (a view)."""
        return t.reshape(t.shape[:-1] + (heads, self.head_dim)).swapaxes(-2, -3)

    def _split_query(self, t):
        """``(..., L, q_rows) -> (query (..., H, L, hd), gate (..., L, H, hd) or None)``, views.
        With ``output_gate`` each head's ``2 hd`` projected features are its query, then its gate
        (Hugging Face Qwen3-Next's ``q_proj``, viewed ``(..., heads, 2 hd)`` and chunked)."""
        if not self.output_gate:
            return self._split(t, self.num_heads), None
        t = t.reshape(t.shape[:-1] + (self.num_heads, 2 * self.head_dim))
        return t[..., : self.head_dim].swapaxes(-2, -3), t[..., self.head_dim :]

    def _qk_weight(self, norm):
        """The weight the QK-norm multiplies by: ``weight``, or ``1 + weight`` (unit offset)."""
        w = norm.weight.data
        return w + 1 if self.qk_norm_unit_offset else w

    # QK-norm on heads ``(..., h, L, hd)``: over each head's ``hd`` features, or with
    # ``qk_norm_scope="all_heads"`` over all ``h * hd`` features of a token (OLMo 2/3 normalise the
    # whole projection): the heads' view ``(..., L, h, hd)`` normalised over its last two axes with
    # the weight seen as ``(h, hd)``; the gradients come back in the heads' layout, the weight's flat.
    def _qk_heads(self, x):
        return x.swapaxes(-2, -3) if self.qk_norm_scope == "all_heads" else x

    def _qk_w(self, w, h: int):
        return w if w is None or self.qk_norm_scope == "head" else w.reshape(h, self.head_dim)

    # ``qk_norm_scope="each_head"``: a LayerNorm without weight over each head's ``hd`` features
    # (``y0``), then times the head's own weight row (``(h, 1, hd)`` against ``(..., h, L, hd)``):
    # ``dw = sum(dy y0)`` over all but the head and feature axes, ``dx`` the LayerNorm's backward of
    # ``dy w``; the cache ``(layer_norm's, y0, w)``.
    @staticmethod
    def _per_head_sum(a):
        """``a (..., h, L, hd)`` summed to ``(h, hd)``."""
        a = a.sum(axis=-2)
        return a.reshape((-1,) + a.shape[-2:]).sum(axis=0)

    def _qk_norm(self, x, norm, keep: bool = True):
        """``(normed x, cache)`` (the cache None unless ``keep``: ``rms_norm_kernel``'s)."""
        if self.qk_norm_scope == "each_head":
            y0, c = K.layer_norm(x, None, None, norm.eps)
            w = norm.weight.data[:, None, :]
            return y0 * w, ((c, y0, w) if keep else None)
        y, c = K.rms_norm(self._qk_heads(x), self._qk_w(self._qk_weight(norm), x.shape[-3]), norm.eps, keep=keep)
        return self._qk_heads(y), c

    def _qk_norm_backward(self, dy, cache):
        """``(dx, dweight)`` (the weight's flat shape; ``"each_head"``: its ``(h, hd)``)."""
        if self.qk_norm_scope == "each_head":
            c, y0, w = cache
            return K.layer_norm_backward(dy * w, c)[0], self._per_head_sum(dy * y0)
        dx, dw = K.rms_norm_backward(self._qk_heads(dy), cache)
        return self._qk_heads(dx), dw.reshape(-1)

    def _qk_norm_jvp(self, cache, t, tw):
        """The output's tangent along ``t`` (heads' layout) and the weight's ``tw`` (flat or None)."""
        if self.qk_norm_scope == "each_head":
            c, y0, w = cache
            ty = K.layer_norm_jvp(c, t) * w
            return ty if tw is None else ty + y0 * tw[:, None, :]
        return self._qk_heads(K.rms_norm_jvp(cache, self._qk_heads(t), self._qk_w(tw, t.shape[-3])))

    def _qk_norm_backward_jvp(self, dy, cache, t, tw, tdy):
        """``((dx, dweight), (their tangents))`` along ``t``, ``tw`` and ``tdy``."""
        if self.qk_norm_scope == "each_head":  # y = y0 w: dw = sum(dy y0), dx = LN'(dy w)
            c, y0, w = cache
            tg = None if tdy is None else tdy * w
            if tw is not None:
                tg = dy * tw[:, None, :] if tg is None else tg + dy * tw[:, None, :]
            (dx, _, _), (tdx, _, _) = K.layer_norm_backward_jvp(dy * w, c, (t, None, None), tg)
            tp = 0 if tdy is None else tdy * y0
            if t is not None:
                tp = tp + dy * K.layer_norm_jvp(c, t)
            tdw = self._per_head_sum(tp) if isinstance(tp, np.ndarray) else np.zeros_like(w[:, 0, :])
            return (dx, self._per_head_sum(dy * y0)), (tdx, tdw)
        h, q = dy.shape[-3], self._qk_heads
        tdy = None if tdy is None else q(tdy)
        t = None if t is None else q(t)
        (dx, dw), (tdx, tdw) = K.rms_norm_backward_jvp(q(dy), cache, (t, self._qk_w(tw, h)), tdy)
        flat = (lambda a: a) if self.qk_norm_scope == "head" else (lambda a: None if a is None else a.reshape(-1))
        return (q(dx), flat(dw)), (q(tdx), flat(tdw))

    def _rewinds_anywhere(self) -> bool:
        """``_KeysCacheHooks``': False where the cache is a rolling window's."""
        return self._rolling_keep() is None

    def _rolling_keep(self) -> int | None:
        """How many past tokens a later query can still see (a rolling KV cache), None for all."""
        w = self.window
        if w is None or w[0] < 0 or not (self.causal or w[1] == 0):
            return None
        return w[0]

    @staticmethod
    def _merge(t):
        """``(..., heads, L, hd) -> (..., L, heads * hd)``."""
        t = t.swapaxes(-2, -3)
        return t.reshape(t.shape[:-2] + (t.shape[-2] * t.shape[-1],))

    # -- validation at the edge ------------------------------------------------------------
    def _check_inputs(self, query, key, value):
        x = as_float(query, "query", self.dtype)
        if x.ndim < 2 or x.shape[-1] != self.d_in:
            raise ValueError(f"query: expected shape (..., L, {self.d_in}) or (L, {self.d_in}), got {x.shape}")
        if key is None and value is None:
            if self.kdim != self.d_in or self.vdim != self.d_in:
                raise ValueError(
                    f"key, value: required when kdim={self.kdim} or vdim={self.vdim} differs from "
                    f"d_in={self.d_in} (self-attention needs kdim == vdim == d_in), got neither"
                )
            return x, x, x, True
        if key is None or value is None:
            raise ValueError("key, value: expected both (cross-attention) or neither (self-attention), got one")
        k = as_float(key, "key", self.dtype)
        v = as_float(value, "value", self.dtype)
        lead = x.shape[:-2]
        if k.ndim != x.ndim or k.shape[:-2] != lead or k.shape[-1] != self.kdim:
            raise ValueError(f"key: expected shape {lead + ('Lk', self.kdim)}, got {k.shape}")
        if v.ndim != x.ndim or v.shape[:-2] != lead or v.shape[-1] != self.vdim or v.shape[-2] != k.shape[-2]:
            raise ValueError(f"value: expected shape {lead + (k.shape[-2], self.vdim)}, got {v.shape}")
        return x, k, v, False

    def _check_cache(self, x: np.ndarray, self_attn: bool, use_cache: bool) -> int:
        """The number of keys in the KV cache before this call (0 without ``use_cache``); refuses
        ``use_cache`` in cross-attention and a batch shape other than the cache's."""
        if not use_cache:
            return 0
        if not self_attn:
            raise ValueError("use_cache: the KV cache is for self-attention; expected key=None and value=None")
        cache = self._kv_cache
        if cache is None:
            return 0
        check_cache_batch(cache.lead, x.shape, "query", "KV cache")
        return cache.position

    def _build_mask(
        self, attn_mask, key_padding_mask, lead: tuple, lq: int, lk: int, names: tuple[str, str] = _MASK_NAMES
    ) -> np.ndarray | None:
        """Validate ``attn_mask`` and ``key_padding_mask`` for ``lq`` queries over ``lk`` real keys
        and combine them into the one mask ``_forward`` takes (None when neither is given).
        ``names`` are the arguments' names in the messages (a block's ``tgt_mask``...)."""
        target = lead + (self.num_heads, lq, lk)
        mask = None
        if attn_mask is not None:
            m = to_numpy(attn_mask, names[0])
            if (
                m.ndim == 3
                and len(lead) == 1
                and m.shape == (lead[0] * self.num_heads, lq, lk)
                and m.shape[0] != self.num_heads
            ):
                m = m.reshape(target)  # torch's (batch * num_heads, Lq, Lk)
            mask = check_mask(m, names[0], target)
        if key_padding_mask is not None:
            kpm = to_numpy(key_padding_mask, names[1])
            if kpm.dtype.kind not in "bf":
                raise TypeError(f"{names[1]}: expected bool (True = padding) or float, got dtype {kpm.dtype}")
            if kpm.shape != lead + (lk,):
                raise ValueError(f"{names[1]}: expected shape {lead + (lk,)}, got {kpm.shape}")
            check_additive_values(kpm, names[1])
            mask = _masks.combine(mask, _masks.from_key_padding_mask(kpm))
        if mask is not None and mask.dtype.kind == "f" and mask.dtype != self.dtype:
            mask = mask.astype(self.dtype)  # a float64 mask keeps a float32 module float32 (caches included)
        return mask

    def _check_positions(self, positions, x: np.ndarray):
        """``positions`` (None, or integers broadcastable to ``x.shape[:-1]``: each query's and
        key's RoPE position in place of ``T + i``), checked before any arithmetic."""
        if positions is None:
            return None
        positions = as_index(positions, "positions")
        check_broadcastable(positions.shape, x.shape[:-1], "positions", "query's shape without d_in")
        return positions

    def _check_call(self, query, key, value, attn_mask, key_padding_mask, use_cache):
        """``forward``'s checks, before any arithmetic or state change: the arguments of ``_forward``
        (``x``, ``key`` and ``value`` or None for self-attention, the mask, ``use_cache``)."""
        x, k_in, v_in, self_attn = self._check_inputs(query, key, value)
        use_cache = check_bool(use_cache, "use_cache")
        past = self._check_cache(x, self_attn, use_cache)
        mask = self._build_mask(attn_mask, key_padding_mask, x.shape[:-2], x.shape[-2], past + k_in.shape[-2])
        return x, None if self_attn else k_in, None if self_attn else v_in, mask, use_cache

    # -- forward -----------------------------------------------------------------------------
    def forward(
        self,
        query,
        key=None,
        value=None,
        *,
        attn_mask=None,
        key_padding_mask=None,
        use_cache: bool = False,
        positions=None,
    ):
        """Returns ``(..., Lq, d_out)``; see ``npattn.MultiHeadAttention.forward``."""
        x, key, value, mask, use_cache = self._check_call(query, key, value, attn_mask, key_padding_mask, use_cache)
        positions = self._check_positions(positions, x)
        return self._forward(x, key, value, mask, use_cache=use_cache, positions=positions)

    def _forward(self, x, key=None, value=None, mask=None, *, use_cache: bool = False, positions=None):
        """``forward`` on validated arguments, for npattn's own modules (which validate at their
        own edge): ``x`` (and, for cross-attention, ``key`` and ``value``; None for
        self-attention) arrays of the module's dtype checked by ``_check_inputs``, ``mask`` built
        by ``_build_mask`` (over the cached keys too), ``use_cache`` accepted by ``_check_cache``.
        Nothing is checked again.  ``positions``: RoPE's positions, None for ``T + i``."""
        return self._run(x, key, value, mask, use_cache, positions, weights=False)[0]

    def _run(
        self, x, key, value, mask, use_cache: bool, positions=None, weights: bool = True
    ) -> tuple[np.ndarray, State]:
        """The stages in order; returns the output and the state (kept for backward unless cached).
        ``weights=False``: the caller reads no attention weights from the state (``_forward``)."""
        self_attn = key is None or value is None
        # A training step's internal arrays come from (and go back to) the module's workspace
        kept = not use_cache and is_grad_enabled()  # the state is kept for a backward
        ws = self._workspace() if self_attn and kept else None
        p = self._project(x, None if self_attn else key, None if self_attn else value, ws)
        cache = self._kv_cache_in_use() if use_cache else None
        start = 0 if cache is None else cache.position  # rolled-out tokens count
        qkv = p.qkv
        joint = not kept and qkv is not None and positions is None and self._joint_heads()
        if joint and qkv is not None and self.qkv_clip is not None:  # q, k, v clamped in one pass over it
            np.clip(qkv, -self.qkv_clip, self.qkv_clip, out=qkv)
        qh, kh, pos = self._position(p.q, p.k, start, positions, kept, qkv if joint else None)
        vh, dropped = p.v, 0
        if self.qkv_clip is not None and not joint:  # v as q and k (its clamp's cache beside theirs)
            vh, v_clip = K.clamp(vh, -self.qkv_clip, self.qkv_clip)
            pos = pos._replace(v_clip=v_clip)
        if cache is not None:
            # a rolling cache no longer holds the first `dropped` keys (hidden by the window anyway):
            # the mask, built over every key seen, loses their columns; the weights get them back as 0
            dropped = cache.position - cache.length
            if dropped and mask is not None and mask.shape[-1] != 1:
                mask = mask[..., dropped:]
            kh, vh = cache.append(kh, vh)
        lk = kh.shape[-2]  # real keys: cached + this call's
        if not kept and not weights and self._decodes(qh, kh, mask, use_cache):
            ctx, attn_cache = K.decoding_attention(qh, kh, vh, self.scale, self.num_heads // self.num_kv_heads), None
        else:
            ctx, attn_cache = self._attend(qh, kh, vh, mask, "bottom_right" if use_cache else None, ws)
        out, out_cache, gated = self._output(ctx, p.gate)
        if cache is not None:
            cache.trim()  # a rolling cache forgets what no later query can see
        reused: tuple = ()
        if ws is not None:
            reused = (p.qkv,) if self.memory_efficient else (p.qkv, ctx) + tuple(cast(AttentionCache, attn_cache).p)
        state = State(
            self_attn, p.caches, pos, attn_cache, out_cache, lk, self._n_extra, self.memory_efficient,
            self.sinks is not None, reused, gated, dropped,
        )  # fmt: skip
        if use_cache:
            self.clear_saved()  # a cached call keeps nothing for backward, nor an earlier forward's state
        else:
            self.save_for_backward(state)
        return out, state

    def _kv_cache_in_use(self) -> KVCache:
        """The module's KV cache, made on first use (rolling when the window allows)."""
        if self._kv_cache is None:
            keep = self._rolling_keep()
            object.__setattr__(self, "_kv_cache", KVCache() if keep is None else RollingKVCache(keep))
        return cast(KVCache, self._kv_cache)

    def _project(self, x, key, value, ws) -> Projected:
        """Stage 1: q, k, v (one GEMM in self-attention, ``key is None``), split into heads."""
        d_kv, nq = self.num_kv_heads * self.head_dim, self._q_rows
        qkv = None
        if key is None:
            W, b = self._fused_qkv()
            out = None if ws is None else ws.empty(x.shape[:-1] + (W.shape[0],), x.dtype)
            qkv, c = K.linear(x, W, b, out=out)
            caches: tuple = (c,)
            q, k, v = qkv[..., :nq], qkv[..., nq : nq + d_kv], qkv[..., nq + d_kv :]
        else:
            outs = [
                K.linear(a, m.weight.data, None if m.bias is None else m.bias.data)
                for a, m in ((x, self.W_query), (key, self.W_key), (value, self.W_value))
            ]
            (q, _), (k, _), (v, _) = outs
            caches = tuple(c for _, c in outs)
        qh, gate = self._split_query(q)
        return Projected(qh, gate, self._split(k, self.num_kv_heads), self._split(v, self.num_kv_heads), caches, qkv)

    def _position(
        self, qh, kh, start: int, positions=None, kept: bool = True, qkv=None
    ) -> tuple[np.ndarray, np.ndarray, Positioned]:
        """Stage 2: QK-norm, then RoPE (the reverse with ``qk_norm_after_rope``; ``qkv_clip``
        clamps q and k right before RoPE, as OLMo's and OLMoE's after their projections and
        norms; query/key ``i`` of this call at position ``start + i``, or
        at ``positions`` (broadcastable to ``(..., L)``) when given: a padded batch's rows).
        ``kept``: the state is kept for a backward (else QK-norm keeps no cache).  ``qkv``: the
        fused projection's output of a call that keeps nothing (None otherwise), whose q and k
        heads then go through both steps as one array (``_position_joint``)."""
        if qkv is not None and positions is None and self._joint_heads():
            return self._position_joint(qkv, start)
        qn = kn = qr = kr = qs = qc = kc = None
        if self.qk_norm and not self.qk_norm_after_rope:
            qh, qn = self._qk_norm(qh, self.q_norm, kept)
            kh, kn = self._qk_norm(kh, self.k_norm, kept)
        if self.qkv_clip is not None:
            qh, qc = K.clamp(qh, -self.qkv_clip, self.qkv_clip)
            kh, kc = K.clamp(kh, -self.qkv_clip, self.qkv_clip)
        if self.rope:
            ropt = dict(
                base=self.rope_base,
                interleaved=self.rope_interleaved,
                scaling=self.rope_scaling,
                rotary_dim=self.rotary_dim,
            )
            if positions is None:
                qpos, kpos = np.arange(start, start + qh.shape[-2]), np.arange(start, start + kh.shape[-2])
            else:  # (..., L) -> (..., 1, L): one row of positions for every head
                qpos = kpos = positions[..., None, :] if positions.ndim > 1 else positions
            qh, qr = K.rope(qh, qpos, **ropt)
            if positions is not None or kh.shape[-2] == qh.shape[-2]:  # the same angles: q's cos and sin
                kh, kr = K.rope_again(kh, qr)
            else:
                kh, kr = K.rope(kh, kpos, **ropt)
        if self.qk_norm and self.qk_norm_after_rope:  # Hunyuan's order: the rotated heads normalised
            qh, qn = self._qk_norm(qh, self.q_norm, kept)
            kh, kn = self._qk_norm(kh, self.k_norm, kept)
        if self.query_scale_by_position is not None:
            if positions is None:
                qs = self._query_scale(np.arange(start, start + qh.shape[-2]), qh.dtype)
            else:  # (..., L) -> (..., 1, L, 1): one row of factors for every head
                qs = self._query_scale(positions[..., None, :] if positions.ndim > 1 else positions, qh.dtype)
            qh = qh * qs
        return qh, kh, Positioned(qn, kn, qr, kr, qs, qc, kc)

    def _query_scale(self, positions, dtype) -> np.ndarray:
        """``query_scale_by_position``'s factors ``1 + beta log(1 + floor(p / length))`` of the
        integer ``positions`` (``(..., L)``), as ``(..., L, 1)`` in ``dtype``."""
        beta, length = cast(tuple, self.query_scale_by_position)
        p = np.asarray(positions)
        return (1.0 + beta * np.log1p(np.floor_divide(p, length).astype(dtype)))[..., None].astype(dtype, copy=False)

    def _joint_heads(self) -> bool:
        """q and k sit side by side in the fused projection's output and take the same steps:
        no output gate (its features lie between the heads), QK-norm (if any) per head and before
        RoPE (after it, the norm of q and k as one array rounds its means otherwise than the staged
        path's two: a batch without padding would differ in the last bit from its padded twin)."""
        plain_norm = not self.qk_norm or (self.qk_norm_scope == "head" and not self.qk_norm_after_rope)
        # qkv_clip: the fused output clamped first (``_run``), so no norm may come before the clamp
        return not self.output_gate and plain_norm and (self.qkv_clip is None or not self.qk_norm)

    def _position_joint(self, qkv, start: int) -> tuple[np.ndarray, np.ndarray, Positioned]:
        """``_position`` of a call that keeps nothing, on the ``H + Hk`` heads of q and k as one
        array in the projection's own token-major layout ``(..., L, H + Hk, hd)`` (a view of
        ``qkv``, each token's heads contiguous): one norm and one rotation instead of two of each
        on heads-first views whose rows are strided (a decoding step makes them for every layer;
        on a long prompt those strided rows made the norm about twice as slow), the same
        roundings per head (``x rstd``, then times its own weight; the same cos and sin, whose
        tables ``K.rope_run_tables`` shares between the layers of a step).  A long prompt (one
        sequence) goes through both steps a block of tokens at a time (``_token_block``,
        ``_norm_turn``), so that their passes read a block the cache holds, not the whole
        ``(L, H + Hk, hd)``."""
        h, hk = self.num_heads, self.num_kv_heads
        qk = qkv[..., : (h + hk) * self.head_dim].reshape(qkv.shape[:-1] + (h + hk, self.head_dim))
        if self.qk_norm or self.rope:
            tables = None
            if self.rope:  # token i at start + i, its heads turned alike
                r = self.head_dim if self.rotary_dim is None else self.rotary_dim
                ropt = dict(base=self.rope_base, interleaved=self.rope_interleaved, scaling=self.rope_scaling)
                tables = K.rope_run_tables(start, qk.shape[-3], r, qk.dtype, **ropt)
            length, step = qk.shape[-3], _token_block(h + hk, self.head_dim)
            if length <= step or qk.size != length * (h + hk) * self.head_dim:  # short, or a batch: whole
                qk = self._norm_turn(qk, tables, 0)
            else:
                out = np.empty(qk.shape, qk.dtype)
                for t in range(0, length, step):
                    out[..., t : t + step, :, :] = self._norm_turn(qk[..., t : t + step, :, :], tables, t)
                qk = out
        qk = qk.swapaxes(-2, -3)  # (..., H + Hk, L, hd)
        qh = qk[..., :h, :, :]
        if self.query_scale_by_position is not None:  # a new array: qk may be a view of qkv
            qh = qh * self._query_scale(np.arange(start, start + qh.shape[-2]), qh.dtype)
        return qh, qk[..., h:, :, :], Positioned()

    def _norm_turn(self, qk, tables, offset: int) -> np.ndarray:
        """``_position_joint``'s two steps on tokens ``offset..`` of ``qk (..., l, H + Hk, hd)``: the
        QK-norm (each head by its own weight) and the rotation by the run's ``tables`` (None: no
        RoPE); a new array, or ``qk`` itself when neither step applies."""
        h = self.num_heads
        if self.qk_norm:
            qk = K.rms_norm(qk, None, self.q_norm.eps, keep=False)[0]
            qk[..., :h, :] *= self._qk_weight(self.q_norm)
            qk[..., h:, :] *= self._qk_weight(self.k_norm)
        if tables is not None:
            qk = K.rope_turn(qk, tables, self.rope_interleaved, offset)
        return qk

    def _decodes(self, qh, kh, mask, use_cache: bool) -> bool:
        """A cached call's one query row that ``K.decoding_attention`` serves: grouped heads (no
        extra keys, no batch broadcast), no mask, dropout or memory-efficient core, nothing but the
        scale in the scores (``AttentionOptions.scale_only``, the kernel's own test) and no window,
        so the row sees every key."""
        opts = self.options if self.sinks is None else self.options._replace(sinks=self.sinks.data)
        plain = opts.window is None and opts.scale_only
        one_row = use_cache and qh.shape[-2] == 1 and mask is None and qh.shape[:-3] == kh.shape[:-3]
        grouped = self.num_kv_heads != self.num_heads and not self._n_extra and not self.memory_efficient
        return one_row and plain and grouped and not (self.training and self.dropout)

    def _attend(self, qh, kh, vh, mask, align: str | None, ws):
        """Stage 3: the attention core with the module's options (``align``: a cached call's
        ``"bottom_right"``, None for the module's own)."""
        return self._core(qh, kh, vh, mask, self.causal, self._call_options(align), ws)

    def _core(self, qh, kh, vh, mask, is_causal: bool, opts: dict, ws):
        """The attention kernel on heads: ``(ctx (..., H, Lq, hd), its cache)``."""
        if self.scale is not None:
            opts["scale"] = self.scale
        if self.num_kv_heads != self.num_heads:
            opts["enable_gqa"] = True
        p = self.dropout if self.training else 0.0
        if p > 0:
            opts.update(dropout_p=p, rng=self.rng)
        if self.memory_efficient:
            return K.memory_efficient_attention(qh, kh, vh, attn_mask=mask, is_causal=is_causal, **opts)
        return K.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, is_causal=is_causal, heads_last=True, workspace=ws, **opts
        )

    def _output(self, ctx, gate):
        """Stage 4: heads merged, times ``sigmoid(gate)`` (output_gate), through ``out_proj``:
        ``(out, out_proj's cache, (a, s) or None)``."""
        merged = self._merge(ctx)  # (..., L, H * hd)
        gated = None
        if gate is not None:  # Qwen3-Next: the output times sigmoid(gate), feature by feature
            s = _sigmoid(gate).reshape(merged.shape)
            gated, merged = (merged, s), merged * s
        bias = None if self.out_proj.bias is None else self.out_proj.bias.data
        out, out_cache = K.linear(merged, self.out_proj.weight.data, bias)
        return out, out_cache, gated

    # -- backward ------------------------------------------------------------------------------
    def backward(self, dy):
        """Through ``out_proj``, the attention core, RoPE, QK-norm and the projections.  Returns
        ``dx`` for self-attention (the sum over the input's three uses, shaped like the input),
        else ``(dquery, dkey, dvalue)``."""
        return self._backward(self._check_dy(dy))  # checked before any state is taken

    def _backward(self, dy):
        """``backward`` on a checked ``dy`` (npattn's blocks call it after their own check): the
        stages in reverse."""
        st: State = self.pop_saved()
        ws = self._scratch() if st.reused else None  # the backward's own arrays: shared by all modules
        dctx, dgate = self._output_backward(dy, st, ws)
        # with nothing between the projections and the attention core, its gradients are those of
        # the projections' outputs: written straight into the fused projection's output gradient
        plain = all(c is None for c in st.position) and st.n_extra == 0 and st.gate is None
        dqkv = views = None
        if st.self_attn:
            shape = dy.shape[:-1] + (self._q_rows + 2 * self.num_kv_heads * self.head_dim,)
            dqkv = np.empty(shape, dy.dtype) if ws is None else ws.empty(shape, dy.dtype)
            views = self._fused_views(dqkv)
        out = views if plain and not st.memory_efficient else None
        dqh, dkh, dvh = self._attend_backward(dctx, st, out, ws)
        dqh, dkh = self._position_backward(dqh, dkh, st.position)
        if st.position.v_clip is not None:
            dvh = K.clamp_backward(dvh, st.position.v_clip)
        if not st.self_attn:
            return self._project_backward_cross(dqh, dkh, dvh, dgate, st)
        if out is None:
            for view, d in zip(views[:3], (dqh, dkh, dvh)):
                view[...] = d
        if dgate is not None:
            views[3][...] = dgate.reshape(views[3].shape)
        dx = self._project_backward_fused(dqkv, st)
        if ws is not None:  # nothing refers to them any more: the next step reuses them
            ws.give(dctx, dqkv)
            self._workspace().give(*st.reused)
        return dx

    def _output_backward(self, dy, st: State, ws):
        """``out_proj`` and the output gate backward: ``(dctx (..., H, L, hd), dgate or None)``."""
        dctx, dwo, dbo = K.linear_backward(dy, st.out, None if ws is None else ws.empty(st.out.x.shape, dy.dtype))
        self.accumulate_grad(self.out_proj.weight, dwo)
        if self.out_proj.bias is not None:
            self.accumulate_grad(self.out_proj.bias, dbo)
        dgate = None
        if st.gate is not None:  # out_proj saw a * s: d a = d(a s) s, d g = d(a s) a s (1 - s)
            a, s = st.gate
            dgate = dctx * a * s * (1 - s)
            np.multiply(dctx, s, out=dctx)
        return self._split(dctx, self.num_heads), dgate

    def _fused_views(self, dqkv):
        """Views of the fused projection's output gradient: ``(dq heads, dk heads, dv heads, dgate)``."""
        nq, d_kv = self._q_rows, self.num_kv_heads * self.head_dim
        dq_view, dgate_view = self._split_query(dqkv[..., :nq])
        dk_view = self._split(dqkv[..., nq : nq + d_kv], self.num_kv_heads)
        return dq_view, dk_view, self._split(dqkv[..., nq + d_kv :], self.num_kv_heads), dgate_view

    def _attend_backward(self, dctx, st: State, out, ws):
        """The attention core's backward (``out``: views to write dq, dk, dv into); the sinks'
        gradient accumulated; returns ``(dq, dk, dv)`` over every key the core saw."""
        if st.memory_efficient:
            grads = K.memory_efficient_attention_backward(dctx, st.attn)
        elif out is not None:
            grads = K.scaled_dot_product_attention_backward(dctx, st.attn, out=out[:3], workspace=ws)
        else:
            grads = K.scaled_dot_product_attention_backward(dctx, st.attn)
        if st.sinks:
            self.accumulate_grad(cast(Parameter, self.sinks), grads[-1])
        return grads[:3]

    def _position_backward(self, dqh, dkh, pos: Positioned):
        """The query's scale by position (a constant per query), RoPE's backward, the clamp's
        (``qkv_clip``), then QK-norm's (its weights' gradients accumulated); QK-norm's first with
        ``qk_norm_after_rope``."""
        if pos.q_scale is not None:
            dqh = dqh * pos.q_scale
        if self.qk_norm_after_rope:
            dqh, dkh = self._qk_norm_backward_both(dqh, dkh, pos)
        if pos.q_rope is not None:
            dqh = K.rope_backward(dqh, pos.q_rope)
            dkh = K.rope_backward(dkh, pos.k_rope)
        if pos.q_clip is not None:
            dqh = K.clamp_backward(dqh, pos.q_clip)
            dkh = K.clamp_backward(dkh, pos.k_clip)
        if not self.qk_norm_after_rope:
            dqh, dkh = self._qk_norm_backward_both(dqh, dkh, pos)
        return dqh, dkh

    def _qk_norm_backward_both(self, dqh, dkh, pos: Positioned):
        """QK-norm's backward of q and k (nothing without it), its weights' gradients accumulated."""
        if pos.q_norm is not None:
            dqh, dwq = self._qk_norm_backward(dqh, pos.q_norm)
            dkh, dwk = self._qk_norm_backward(dkh, pos.k_norm)
            self.accumulate_grad(cast(Parameter, self.q_norm.weight), dwq)
            self.accumulate_grad(cast(Parameter, self.k_norm.weight), dwk)
        return dqh, dkh

    def _project_backward_fused(self, dqkv, st: State):
        """The fused projection's backward: ``dx``; each weight's gradient is its row block."""
        dx, dW, db = K.linear_backward(dqkv, st.proj[0])
        d_kv = self.num_kv_heads * self.head_dim
        rows = np.cumsum([0, self._q_rows, d_kv, d_kv])
        for i, m in enumerate((self.W_query, self.W_key, self.W_value)):
            self.accumulate_grad(m.weight, dW[rows[i] : rows[i + 1]])
            if m.bias is not None:
                self.accumulate_grad(m.bias, db[rows[i] : rows[i + 1]])
        return dx

    def _project_backward_cross(self, dqh, dkh, dvh, dgate, st: State):
        """The three projections' backward (cross-attention): ``(dquery, dkey, dvalue)``."""
        dq = self._merge(dqh)
        if dgate is not None:  # interleave each head's query and gate gradients as W_query's rows are
            dq = np.empty(dgate.shape[:-1] + (self._q_rows,), dgate.dtype)
            dq_view, dgate_view = self._split_query(dq)
            dq_view[...] = dqh
            dgate_view[...] = dgate.reshape(dgate_view.shape)
        grads = []
        mods = (self.W_query, self.W_key, self.W_value)
        for m, d, c in zip(mods, (dq, self._merge(dkh), self._merge(dvh)), st.proj):
            dx_i, dw_i, db_i = K.linear_backward(d, c)
            self.accumulate_grad(m.weight, dw_i)
            if m.bias is not None:
                self.accumulate_grad(m.bias, db_i)
            grads.append(dx_i)
        return tuple(grads)

    # -- forward mode --------------------------------------------------------------------------
    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode (``jvp``): the forward's stages in order, each by its functional JVP.

        The projections (``ty = tx W^T + x tW^T + tb``; the fused self-attention weight's tangent
        is the three weights' stacked), QK-norm and RoPE, the attention core
        (``scaled_dot_product_attention_jvp`` or ``memory_efficient_attention_jvp``, the sinks
        with their tangent, dropout with the forward's mask), the output gate
        (``t(a s) = ta s + a s (1 - s) tg``, ``s = sigmoid(g)``) and ``out_proj``.  Input tangents:
        ``tquery`` for self-attention, ``tquery, tkey, tvalue`` for cross-attention (each of its
        input's shape, None = zero)."""
        st: State = state
        pt = param_tangents
        tangents = self._stage_tangents(st, input_tangents, pt, "jvp")
        return K.linear_jvp(st.out, tangents.out_in, pt.get(self.out_proj.weight), pt.get(self.out_proj.bias))

    def _stage_tangents(self, st: State, input_tangents, pt, method: str) -> "_Tangents":
        """``_forward_tangents`` from the unchecked input tangents of ``jvp`` / ``backward_jvp``
        (``method``), computed once per state and tangents while ``pt`` remembers (``loss_hvp``)."""
        return pt._remember(
            (self, "stages", st) + tuple(input_tangents),
            lambda: self._forward_tangents(st, self._input_tangents(st, input_tangents, method), pt),
        )

    def _forward_tangents(self, st: State, ts, pt) -> "_Tangents":
        """The forward's stages on tangents, from the checked input tangents ``ts``: each stage's
        input tangent, kept for the second order (``_jvp`` needs only ``out_proj``'s)."""
        tq, tk, tv = self._project_jvp(st, ts, pt)
        (tq0, tgate), tk0, tv0 = (
            self._split_query(tq),
            self._split(tk, self.num_kv_heads),
            self._split(tv, self.num_kv_heads),
        )
        pos = st.position
        if pos.v_clip is not None:
            tv0 = K.clamp_jvp(pos.v_clip, tv0)
        if self.qk_norm_after_rope:  # clamp, RoPE, QK-norm: the clamped tangents are RoPE's input
            tq0, tk0 = self._clip_tangents(pos, tq0, tk0)
            tq1, tk1 = self._rope_tangents(pos, tq0, tk0, pt)
            tq2, tk2 = self._norm_tangents(pos, tq1, tk1, pt)
        else:  # QK-norm, clamp, RoPE: `between` holds RoPE's input
            tq1, tk1 = self._clip_tangents(pos, *self._norm_tangents(pos, tq0, tk0, pt))
            tq2, tk2 = self._rope_tangents(pos, tq1, tk1, pt)
        if pos.q_scale is not None:  # a constant factor per query: its tangent is the same factor
            tq2 = tq2 * pos.q_scale
        weights: list = []  # the core's tP block by block, which its second order reads again
        tmerged = self._merge(self._attend_jvp(st, tq2, tk2, tv0, pt, weights))  # (..., L, H * hd)
        out_in = tmerged
        if st.gate is not None:  # out_proj saw a * s, s = sigmoid(gate)
            a, s = st.gate
            out_in = tmerged * s
            out_in += a * s * (1 - s) * tgate.reshape(a.shape)
        return _Tangents(ts, (tq0, tk0), (tq1, tk1), (tq2, tk2, tv0), tgate, tmerged, out_in, weights or None)

    def _norm_tangents(self, pos: Positioned, tq, tk, pt):
        """QK-norm's output tangents of q and k (the same without it)."""
        if pos.q_norm is None:
            return tq, tk
        # the weight is w or 1 + w: its tangent is tw either way
        return (
            self._qk_norm_jvp(pos.q_norm, tq, pt.get(self.q_norm.weight)),
            self._qk_norm_jvp(pos.k_norm, tk, pt.get(self.k_norm.weight)),
        )

    @staticmethod
    def _clip_tangents(pos: Positioned, tq, tk):
        """The clamp's output tangents of q and k (``qkv_clip``; the same without it)."""
        if pos.q_clip is None:
            return tq, tk
        return K.clamp_jvp(pos.q_clip, tq), K.clamp_jvp(pos.k_clip, tk)

    @staticmethod
    def _rope_tangents(pos: Positioned, tq, tk, pt):
        """RoPE's output tangents of q and k (the same without it)."""
        if pos.q_rope is None:
            return tq, tk
        return K.rope_jvp(pos.q_rope, tq), K.rope_jvp(pos.k_rope, tk)

    def _input_tangents(self, st: State, input_tangents, method: str) -> list:
        """The input tangents of ``jvp`` / ``backward_jvp`` checked by name (``tquery`` for
        self-attention, ``tquery, tkey, tvalue`` for cross-attention), each None or of its input's
        shape, cast to the module's dtype."""
        names = ("tquery",) if st.self_attn else ("tquery", "tkey", "tvalue")
        dt = st.out.x.dtype
        given = check_tangents(input_tangents, names, f"MultiHeadAttention.{method}")
        return [check_tangent(t, n, c.x.shape, dt) for t, n, c in zip(given, names, st.proj)]

    def _stacked_tangent(self, params, pt, dtype):
        """The fused projection's weight (or bias) tangent: the three parameters' stacked, None
        when none has one."""
        tans = [pt.get(p) for p in params]
        if all(t is None for t in tans):
            return None
        return np.concatenate([np.zeros(p.data.shape, dtype) if t is None else t for p, t in zip(params, tans)])

    def _project_jvp(self, st: State, ts, pt):
        """The projections' tangents ``(tq, tk, tv)`` (merged heads) from the checked input tangents."""
        mods = (self.W_query, self.W_key, self.W_value)
        if not st.self_attn:
            return tuple(K.linear_jvp(c, t, pt.get(m.weight), pt.get(m.bias)) for c, t, m in zip(st.proj, ts, mods))
        dt = st.out.x.dtype
        tb = self._stacked_tangent([m.bias for m in mods], pt, dt) if self.W_query.bias is not None else None
        tqkv = K.linear_jvp(st.proj[0], ts[0], self._stacked_tangent([m.weight for m in mods], pt, dt), tb)
        nq, d_kv = self._q_rows, self.num_kv_heads * self.head_dim
        return tqkv[..., :nq], tqkv[..., nq : nq + d_kv], tqkv[..., nq + d_kv :]

    def _attend_jvp(self, st: State, tqh, tkh, tvh, pt, weights=None):
        """The attention core's tangent (the sinks' tangent included); ``weights``: a list that gets
        the weights' tangents block by block for ``_attend_backward_jvp`` (not with the
        memory-efficient core, which keeps no weights)."""
        tsinks = pt.get(self.sinks) if st.sinks else None
        if st.memory_efficient:
            return K.memory_efficient_attention_jvp(st.attn, tqh, tkh, tvh, None, tsinks)
        return K.scaled_dot_product_attention_jvp(st.attn, tqh, tkh, tvh, None, tsinks, weights=weights)

    # -- second order --------------------------------------------------------------------------
    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order (``backward_jvp``): the forward's tangents stage by stage (as ``_jvp``),
        then the backward's stages in reverse, each by its functional ``<op>_backward_jvp`` fed
        the tangents of its inputs and of its upstream gradient: ``out_proj``; the output gate by
        the product rule (``m = a s``: ``dg = dm a s (1 - s)`` and ``da = dm s`` differentiated
        with ``ts = s (1 - s) tg``); the attention core
        (``scaled_dot_product_attention_backward_jvp`` or
        ``memory_efficient_attention_backward_jvp``, the sinks' tangent included, dropout with
        the forward's mask); RoPE; QK-norm; the projections (the fused one's weight tangent the
        three stacked, its gradient's tangent split as its gradient)."""
        st: State = state
        pt = param_tangents
        tg = self._stage_tangents(st, input_tangents, pt, "backward_jvp")
        wo, bo = self.out_proj.weight, self.out_proj.bias
        (dm, dwo, dbo), (tdm, tdwo, tdbo) = K.linear_backward_jvp(dy, st.out, (tg.out_in, pt.get(wo), pt.get(bo)), ddy)
        self._accumulate_second(((wo, dwo, tdwo), (bo, dbo, tdbo)))
        dgate = tdgate = None
        if st.gate is not None:
            a, s = st.gate
            sp = s * (1 - s)
            ts = sp * tg.gate.reshape(a.shape)
            dgate = dm * a * s * (1 - s)  # as the backward rounds it
            tdgate = tdm * a * sp + dm * (tg.merged * sp + a * (1 - 2 * s) * ts)
            dm, tdm = dm * s, tdm * s + dm * ts
        fused = views = None
        ws = self._scratch()  # the fused arrays below live only inside this call: shared by all modules
        if st.self_attn:  # the fused projection's output gradient and its tangent, filled through views
            shape = dy.shape[:-1] + (self._q_rows + 2 * self.num_kv_heads * self.head_dim,)
            fused = (ws.empty(shape, dy.dtype), ws.empty(shape, dy.dtype))
            views = tuple(self._fused_views(a) for a in fused)
        # with nothing between the projections and the fast core, it writes straight into them
        direct = views is not None and not st.memory_efficient and st.n_extra == 0 and st.gate is None
        direct = direct and all(c is None for c in st.position)
        (dq, dk, dv), (tdq, tdk, tdv) = self._attend_backward_jvp(
            self._split(dm, self.num_heads),
            self._split(tdm, self.num_heads),
            st,
            tg.attended,
            pt,
            tg.weights,
            tuple(v[:3] for v in views) if direct and views is not None else None,
        )
        pos = st.position
        if pos.q_scale is not None:
            dq, tdq = dq * pos.q_scale, tdq * pos.q_scale
        # each step's input tangents: the projections' for the first step, `between` for the second
        after = self.qk_norm_after_rope
        rope_in, norm_in = (tg.projected, tg.between) if after else (tg.between, tg.projected)
        if after:
            dq, tdq, dk, tdk = self._norm_backward_jvp(pos, pt, norm_in, dq, tdq, dk, tdk)
        if pos.q_rope is not None:
            dq, tdq = K.rope_backward_jvp(dq, pos.q_rope, (rope_in[0],), tdq)
            dk, tdk = K.rope_backward_jvp(dk, pos.k_rope, (rope_in[1],), tdk)
        if pos.q_clip is not None:  # the clamp's mask is a constant: tx does not enter
            dq, tdq = K.clamp_backward_jvp(dq, pos.q_clip, (None,), tdq)
            dk, tdk = K.clamp_backward_jvp(dk, pos.k_clip, (None,), tdk)
        if pos.v_clip is not None:
            dv, tdv = K.clamp_backward_jvp(dv, pos.v_clip, (None,), tdv)
        if not after:
            dq, tdq, dk, tdk = self._norm_backward_jvp(pos, pt, norm_in, dq, tdq, dk, tdk)
        if fused is not None and views is not None:
            if not direct:
                for fv, parts in zip(views, ((dq, dk, dv, dgate), (tdq, tdk, tdv, tdgate))):
                    for view, d in zip(fv, parts):
                        if d is not None:
                            view[...] = d.reshape(view.shape)
            result = self._fused_backward_jvp(st, tg, pt, *fused)
            ws.give(*fused)  # read by the projection's second order only, whose results are new arrays
        else:
            grads = (self._join_query(dq, dgate), self._merge(dk), self._merge(dv))
            tangents = (self._join_query(tdq, tdgate), self._merge(tdk), self._merge(tdv))
            result = self._cross_backward_jvp(st, tg, pt, grads, tangents)
        if st.reused:  # nothing refers to them any more: the next step reuses them
            self._workspace().give(*st.reused)
        return result

    def _norm_backward_jvp(self, pos: Positioned, pt, norm_in, dq, tdq, dk, tdk):
        """QK-norm's second order of q and k (``norm_in``: its input tangents), the weights'
        gradients and their tangents accumulated; the same four arrays without it."""
        if pos.q_norm is None:
            return dq, tdq, dk, tdk
        wq, wk = cast(Parameter, self.q_norm.weight), cast(Parameter, self.k_norm.weight)
        (dq, dwq), (tdq, tdwq) = self._qk_norm_backward_jvp(dq, pos.q_norm, norm_in[0], pt.get(wq), tdq)
        (dk, dwk), (tdk, tdwk) = self._qk_norm_backward_jvp(dk, pos.k_norm, norm_in[1], pt.get(wk), tdk)
        self._accumulate_second(((wq, dwq, tdwq), (wk, dwk, tdwk)))
        return dq, tdq, dk, tdk

    def _fused_backward_jvp(self, st: State, tg: "_Tangents", pt, dqkv, tdqkv):
        """The fused projection's second order from its output gradient and that gradient's
        tangent: ``(dx, dx_tangent)``; each weight's (bias's) gradient and its tangent are their
        row block of the fused ones (the weight tangent the three stacked)."""
        mods = (self.W_query, self.W_key, self.W_value)
        dt = dqkv.dtype
        tw = self._stacked_tangent([m.weight for m in mods], pt, dt)
        tb = self._stacked_tangent([m.bias for m in mods], pt, dt) if self.W_query.bias is not None else None
        (dx, dW, db), (tdx, tdW, tdb) = K.linear_backward_jvp(dqkv, st.proj[0], (tg.inputs[0], tw, tb), tdqkv)
        d_kv = self.num_kv_heads * self.head_dim
        rows = np.cumsum([0, self._q_rows, d_kv, d_kv])
        for i, m in enumerate(mods):
            part = slice(rows[i], rows[i + 1])
            self._accumulate_second(((m.weight, dW[part], tdW[part]),))
            if m.bias is not None:
                self._accumulate_second(((m.bias, db[part], tdb[part]),))
        return dx, tdx

    def _cross_backward_jvp(self, st: State, tg: "_Tangents", pt, grads, tangents):
        """The three projections' second order (cross-attention): ``((dquery, dkey, dvalue), their
        tangents)``."""
        dxs, tdxs = [], []
        mods = (self.W_query, self.W_key, self.W_value)
        for m, g, t, c, tin in zip(mods, grads, tangents, st.proj, tg.inputs):
            (dx_i, dw_i, db_i), (tdx_i, tdw_i, tdb_i) = K.linear_backward_jvp(
                g, c, (tin, pt.get(m.weight), pt.get(m.bias)), t
            )
            self._accumulate_second(((m.weight, dw_i, tdw_i), (m.bias, db_i, tdb_i)))
            dxs.append(dx_i)
            tdxs.append(tdx_i)
        return tuple(dxs), tuple(tdxs)

    def _join_query(self, dqh, dgate):
        """The inverse of ``_split_query``: ``(..., L, q_rows)`` from the query heads and the gate
        (each head's query, then its gate, as ``W_query``'s rows)."""
        if dgate is None:
            return self._merge(dqh)
        out = np.empty(dgate.shape[:-1] + (self._q_rows,), dgate.dtype)
        q_view, gate_view = self._split_query(out)
        q_view[...] = dqh
        gate_view[...] = dgate.reshape(gate_view.shape)
        return out

    def _attend_backward_jvp(self, dctx, tdctx, st: State, tangents, pt, weights=None, out=None):
        """The attention core's second order: ``((dq, dk, dv), their tangents)`` over every key
        the core saw, from ``tangents = (tq, tk, tv)`` of its inputs (and ``weights``, what
        ``_attend_jvp`` kept along them, or None); the sinks' gradient and its tangent accumulated.
        ``out``: ``(views of dq, dk, dv; views of their tangents)`` for the fast core to write into."""
        core_tangents = tuple(tangents) + ((pt.get(self.sinks),) if st.sinks else ())
        if st.memory_efficient:
            grads, tans = K.memory_efficient_attention_backward_jvp(dctx, st.attn, core_tangents, tdctx)
        else:
            views, tviews = (None, None) if out is None else out
            grads, tans = K.scaled_dot_product_attention_backward_jvp(
                dctx,
                st.attn,
                core_tangents,
                tdctx,
                weights_tangents=weights,
                out=views,
                tout=tviews,
                workspace=self._scratch() if st.reused else None,
            )
        if st.sinks:
            self._accumulate_second(((cast(Parameter, self.sinks), grads[-1], tans[-1]),))
        return tuple(grads[:3]), tuple(tans[:3])

    # -- KV cache --------------------------------------------------------------------------
    def reset_kv_cache(self) -> None:
        """Empty the KV cache (start a new sequence)."""
        object.__setattr__(self, "_kv_cache", None)

    @property
    def kv_cache_length(self) -> int:
        """The number of tokens seen through the cache (0 when it is empty): the position of the
        next token.  A rolling cache (sliding window) holds fewer: ``kv_cache_size``."""
        return 0 if self._kv_cache is None else self._kv_cache.position

    @property
    def kv_cache_size(self) -> int:
        """The number of tokens whose keys and values the cache holds (at most the window's
        ``left`` between calls for a rolling cache; ``kv_cache_length`` otherwise)."""
        return 0 if self._kv_cache is None else self._kv_cache.length
