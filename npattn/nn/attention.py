"""``MultiHeadAttention``: projections, heads, masks, dropout, grouped-query attention, the modern
attention options (RoPE, QK-norm, ALiBi, sliding window, softcapping, sinks) and a KV cache, over
the functional kernels (``npattn.functional.kernels``).

The module validates everything at its own edge (``forward``), then calls the kernels, which do
not validate again.  It owns its parameters outright: the state-dict keys are those of the
contract (``W_query.weight``, ...), but for self-attention the three projection weights are row
blocks of one fused ``(d_out + 2 kv, d_in)`` array (``W_query.weight.data`` *is* a view of it), so
q, k and v come out of one GEMM without copying the weights on every call.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, cast

import numpy as np

from .. import masks as _masks
from .._validate import (
    as_float,
    as_rng,
    check_additive_values,
    check_bool,
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
from ..functional.rope_scaling import _check_scaling, _resolve_base, _resolve_rotary_dim
from .layers import Linear, RMSNorm
from .module import Module, Parameter, is_grad_enabled

__all__ = ["MultiHeadAttention"]

_ALIGNS = ("top_left", "bottom_right")
_MASK_NAMES = ("attn_mask", "key_padding_mask")


class _State(NamedTuple):
    """What ``MultiHeadAttention.backward`` needs from its forward."""

    self_attn: bool
    proj: tuple  # the linear caches: one fused (self-attention) or three
    q_norm: tuple | None  # rms_norm caches of q and k (qk_norm)
    k_norm: tuple | None
    q_rope: tuple | None  # rope caches of q and k (rope)
    k_rope: tuple | None
    attn: tuple  # the attention kernel's cache
    out: tuple  # out_proj's linear cache
    lk: int  # number of real keys (before bias_k / the zero key)
    n_extra: int  # number of extra keys (bias_k, the zero key)
    memory_efficient: bool
    sinks: bool
    reused: tuple = ()  # arrays from the module's workspace, given back after the backward
    gate: tuple | None = None  # output_gate: (attention output (..., L, H*hd), sigmoid(gate) of its shape)


class _KVCache:
    """Projected (and rotated) keys and values of the tokens seen so far, ``(..., Hk, T, hd)``,
    held in buffers whose capacity doubles as they fill (appending is amortised O(new tokens)).

    ``keep`` (a sliding window's ``left``): a rolling cache.  A later query at position ``p`` sees
    keys ``p - left .. p`` only, so after each call (``trim``) all but the last ``keep`` tokens are
    dropped: memory stays O(keep + tokens per call) however long the sequence.  ``length`` counts
    the tokens held, ``position`` the tokens seen (the position of the next one)."""

    def __init__(self, k, v, keep: int | None = None):
        self.lead = k.shape[:-3]
        self.length = 0
        self.position = 0
        self.keep = keep
        self.k = self.v = None
        self._grow(k, v, max(16, 2 * k.shape[-2]))

    def trim(self):
        """A rolling cache drops every token but the last ``keep`` (moved to the front) and shrinks
        an oversized buffer; call it once the keys and values ``append`` returned are used."""
        if self.keep is None or self.length <= self.keep:
            return
        keep, drop = self.keep, self.length - self.keep
        cap = max(16, 2 * (keep + 1))
        if self.k.shape[-2] > 2 * cap:  # e.g. after a long prompt: give the memory back
            nk = np.empty(self.k.shape[:-2] + (cap, self.k.shape[-1]), self.k.dtype)
            nv = np.empty(self.v.shape[:-2] + (cap, self.v.shape[-1]), self.v.dtype)
        else:
            nk, nv = self.k, self.v  # numpy copies overlapping slices correctly
        nk[..., :keep, :] = self.k[..., drop : self.length, :]
        nv[..., :keep, :] = self.v[..., drop : self.length, :]
        self.k, self.v, self.length = nk, nv, keep

    def _grow(self, k, v, capacity):
        """New buffers of ``capacity`` tokens in ``k``'s dtype, holding the cached tokens."""
        shape = k.shape[:-2] + (capacity, k.shape[-1])
        nk, nv = np.empty(shape, k.dtype), np.empty(shape[:-1] + (v.shape[-1],), v.dtype)
        if self.k is not None:
            nk[..., : self.length, :] = self.k[..., : self.length, :]
            nv[..., : self.length, :] = self.v[..., : self.length, :]
        self.k, self.v = nk, nv

    def append(self, k, v):
        """Add ``k, v (..., Hk, n, hd)``; return views of every cached key and value."""
        n = k.shape[-2]
        if self.length + n > self.k.shape[-2] or self.k.dtype != k.dtype:  # full, or the module was cast (.to())
            self._grow(k, v, max(2 * self.k.shape[-2], self.length + n))
        self.k[..., self.length : self.length + n, :] = k
        self.v[..., self.length : self.length + n, :] = v
        self.length += n
        self.position += n
        return self.k[..., : self.length, :], self.v[..., : self.length, :]


def _check_window(window):
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window: expected None or a pair (left, right) of integers, got {window!r}")
    out = []
    for side, w in zip(("left", "right"), window):
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise TypeError(f"window: expected integers (left, right), got {side}={w!r} ({type(w).__name__})")
        if w < -1:
            raise ValueError(f"window: expected {side} >= 0 or -1 (unbounded), got {int(w)}")
        out.append(int(w))
    return tuple(out)


def _check_softcap(softcap):
    if softcap is None:
        return None
    return check_positive_float(softcap, "softcap")


def _sigmoid(x):
    """``1 / (1 + exp(-x))`` without overflow: ``exp(-log(1 + exp(-x)))``."""
    return np.exp(-np.logaddexp(0.0, -x))


class MultiHeadAttention(Module):
    """Multi-head attention, batch first: ``(..., L, d_in) -> (..., L, d_out)``; unbatched
    ``(L, d_in) -> (L, d_out)`` too (any number of leading axes, none included).

    ``d_out`` is split into ``num_heads`` heads of ``d_out // num_heads`` (or, with ``head_dim``,
    the heads have ``head_dim`` features each whatever ``d_out``: ``W_query`` is
    ``(num_heads * head_dim, d_in)``, ``out_proj`` ``(d_out, num_heads * head_dim)``, as Qwen3,
    Gemma 3 and GPT-OSS); with ``num_kv_heads``
    smaller than ``num_heads`` (and dividing it) the key/value projections have
    ``num_kv_heads`` heads each shared by ``num_heads // num_kv_heads`` query heads
    (grouped-query attention).  ``kdim``/``vdim`` are the key/value input widths for
    cross-attention (default ``d_in``).  ``dropout`` acts on the attention weights in training.

    Masks (see ``npattn.masks``): ``attn_mask`` bool **True = may attend** (the polarity of
    ``torch.nn.functional.scaled_dot_product_attention``; note ``torch.nn.MultiheadAttention``
    uses the opposite) or float (added to the scaled scores), broadcastable to
    ``(..., num_heads, Lq, Lk)``; torch's ``(batch * num_heads, Lq, Lk)`` layout is accepted too.
    ``key_padding_mask`` ``(..., Lk)``: **True = padding** (ignored key), or float additive.
    ``causal=True`` masks future keys (aligned by ``causal_align``).  With a KV cache, ``Lk``
    counts every cached key.

    torch's options: ``add_bias_kv`` appends one learnable key/value (``bias_k``, ``bias_v``, each
    ``(1, 1, kv)``) after the projected keys/values, ``add_zero_attn`` one zero key/value per head
    after those; the masks get a visible column for each (as torch pads them).  These extra keys
    carry no position: they are visible to every query whatever ``causal``, ``window`` and
    ``alibi`` say, they are not normalised (``qk_norm``) and not rotated (``rope``).

    The attention options (see ``scaled_dot_product_attention``): ``window=(left, right)``,
    ``causal_align`` (``"top_left"`` or ``"bottom_right"``), ``softcap``, ``alibi=True`` (slopes
    ``2**(-8 (h+1) / num_heads)``), ``sinks=True`` (a learnable logit per head, parameter
    ``sinks (num_heads,)``, zeros at start), ``rope=True`` (rotary embedding, rotate-half, of each
    head's q and k, base ``rope_base``; query/key ``i`` at position ``i``, plus the KV cache's
    length), ``qk_norm=True`` (RMSNorm over each head's q and k, parameters ``q_norm.weight`` and
    ``k_norm.weight`` ``(head_dim,)``; applied before RoPE).

    Options of the open-model families (Hugging Face's attention classes):

    - ``scale``: the softmax scale (default ``1/sqrt(head_dim)``), e.g. Gemma 3's
      ``query_pre_attn_scalar**-0.5`` or DeepSeek's (``npattn.functional.rope_softmax_scale``).
    - ``rope_scaling``: a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict (``linear``,
      ``dynamic``, ``yarn``, ``llama3``; see ``npattn.functional.rope_frequencies``), its
      ``rope_theta`` the base when given (``rope_base`` left at its default or equal);
      ``partial_rotary_factor``: only the first ``int(head_dim * factor)`` features of each head
      rotate (Qwen3-Next); ``rope_interleaved``: pairs ``(2i, 2i+1)`` instead of rotate-half.
      A per-layer base (Gemma 3's local/global) is just ``rope_base`` per module.  With
      ``"dynamic"`` the frequencies follow the largest position of each call, so cached decoding
      past ``max_position_embeddings`` differs from one full pass (the cached keys keep the
      rotation of their call), exactly as in Hugging Face's models.
    - ``qk_norm_eps``: the QK-norm's eps (default ``RMSNorm``'s: the dtype's machine epsilon);
      ``qk_norm_unit_offset=True``: ``x_norm * (1 + weight)`` with the weight zeros at start
      (Gemma 3's and Qwen3-Next's RMSNorm; the state dict holds that weight as they do).
    - ``output_gate=True`` (Qwen3-Next's gated attention): ``W_query`` is
      ``(2 * num_heads * head_dim, d_in)``, each head's ``2 head_dim`` outputs its query then its
      gate ``g``; the attention output (heads merged) is multiplied by ``sigmoid(g)`` before
      ``out_proj``.  Backward: with ``a`` the attention output and ``s = sigmoid(g)``,
      ``d a = d(a s) * s`` and ``d g = d(a s) * a * s (1 - s)`` (``s' = s (1 - s)``).
    - GPT-OSS: ``qkv_bias=True, out_bias=True, sinks=True``, a ``window``, ``rope_scaling`` yarn.

    KV cache: ``forward(x, use_cache=True)`` (self-attention) appends this call's keys/values
    (after RoPE) to the module's cache and lets the queries attend over every cached key,
    with bottom-right alignment (the new queries are the last positions); see ``forward``.
    With a sliding window that hides the past beyond ``left`` (``window=(left, right)`` and
    ``causal``, or ``window=(left, 0)``), the cache rolls: it holds the last ``left`` tokens
    between calls, never more (``kv_cache_size``), and gives the logits of the full pass.

    With ``memory_efficient=True`` the attention core is ``memory_efficient_attention`` (no
    ``(Lq, Lk)`` array held, dropout masks regenerated block by block, so they differ from the
    plain core's for the same rng; no ``need_weights``).

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> mha = npattn.MultiHeadAttention(16, 16, num_heads=4, num_kv_heads=2, causal=True, rope=True, rng=0)
    >>> x = np.random.default_rng(1).standard_normal((2, 6, 16))
    >>> y = mha(x)
    >>> mha.backward(np.ones_like(y)).shape, mha.W_key.weight.grad.shape   # 2 kv heads of 4 dims
    ((2, 6, 16), (8, 16))

    Decoding token by token with the KV cache gives the full causal pass's outputs:

    >>> with npattn.no_grad():
    ...     steps = [mha(x[:, t:t + 1], use_cache=True) for t in range(6)]
    >>> bool(np.allclose(np.concatenate(steps, axis=1), y, rtol=0, atol=1e-12))
    True
    """

    _fused: tuple | None  # (W, b, weight views, bias views) of the fused q/k/v projection
    _kv_cache: _KVCache | None

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
        head_dim: int | None = None,
        scale: float | None = None,
        rope_scaling=None,
        partial_rotary_factor: float = 1.0,
        rope_interleaved: bool = False,
        output_gate: bool = False,
        rng=None,
        dtype=np.float64,
    ) -> None:
        super().__init__()
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
        self.dropout = check_prob(dropout, "dropout")
        self.causal = check_bool(causal, "causal")
        self.memory_efficient = check_bool(memory_efficient, "memory_efficient")
        qkv_bias = check_bool(qkv_bias, "qkv_bias")
        out_bias = check_bool(out_bias, "out_bias")
        self.add_bias_kv = check_bool(add_bias_kv, "add_bias_kv")
        self.add_zero_attn = check_bool(add_zero_attn, "add_zero_attn")
        self.window = _check_window(window)
        if not isinstance(causal_align, str) or causal_align not in _ALIGNS:
            raise ValueError(f"causal_align: expected one of {_ALIGNS}, got {causal_align!r}")
        self.causal_align = causal_align
        self.softcap = _check_softcap(softcap)
        self.alibi = check_bool(alibi, "alibi")
        use_sinks = check_bool(sinks, "sinks")
        self.rope = check_bool(rope, "rope")
        self.rope_scaling = _check_scaling(rope_scaling, "rope_scaling")  # normalised; "default" when None
        self.rope_base = _resolve_base(rope_base, self.rope_scaling, "rope_base")
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
            self.rotary_dim = _resolve_rotary_dim(self.head_dim, None, params, "rotary_dim")
        self.scale = None if scale is None else check_positive_float(scale, "scale")
        self.qk_norm = check_bool(qk_norm, "qk_norm")
        qk_norm_eps = None if qk_norm_eps is None else check_positive_float(qk_norm_eps, "qk_norm_eps", allow_zero=True)
        self.qk_norm_unit_offset = check_bool(qk_norm_unit_offset, "qk_norm_unit_offset")
        self.output_gate = check_bool(output_gate, "output_gate")
        self._dtype = check_dtype(dtype)
        self.rng = as_rng(rng)
        kv = self.num_kv_heads * self.head_dim
        inner = self.num_heads * self.head_dim  # the merged heads' width (d_out unless head_dim says otherwise)
        self._q_rows = inner * (2 if self.output_gate else 1)  # query (and gate) features of the projection
        # the draws of the projections come first and in this order (same seed, same weights)
        self.W_query = Linear(self.d_in, self._q_rows, qkv_bias, rng=self.rng, dtype=dtype)
        self.W_key = Linear(self.kdim, kv, qkv_bias, rng=self.rng, dtype=dtype)
        self.W_value = Linear(self.vdim, kv, qkv_bias, rng=self.rng, dtype=dtype)
        self.out_proj = Linear(inner, self.d_out, out_bias, rng=self.rng, dtype=dtype)
        if self.add_bias_kv:  # torch: xavier_normal_ on (1, 1, kv), std sqrt(2 / (kv + kv))
            std = math.sqrt(1.0 / kv)
            self.bias_k = Parameter(self.rng.normal(0.0, std, (1, 1, kv)), self._dtype)
            self.bias_v = Parameter(self.rng.normal(0.0, std, (1, 1, kv)), self._dtype)
        self.sinks = Parameter(np.zeros(self.num_heads), self._dtype) if use_sinks else None
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=qk_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(self.head_dim, eps=qk_norm_eps, dtype=dtype)
            if self.qk_norm_unit_offset:  # x_norm * (1 + weight): the weight starts at zero
                self.q_norm.weight = Parameter(np.zeros(self.head_dim), self._dtype)
                self.k_norm.weight = Parameter(np.zeros(self.head_dim), self._dtype)
        object.__setattr__(self, "_fused", None)
        object.__setattr__(self, "_kv_cache", None)
        self._fused_qkv()

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
        for name in (
            "add_bias_kv",
            "add_zero_attn",
            "alibi",
            "rope",
            "rope_interleaved",
            "qk_norm",
            "qk_norm_unit_offset",
            "output_gate",
            "memory_efficient",
        ):
            if getattr(self, name):
                s += f", {name}=True"
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
        return s

    # -- the fused q/k/v weight -------------------------------------------------------------
    def _fused_qkv(self):
        """``(W, b)``: the fused self-attention projection, ``W (d_out + 2 kv, d_in)`` whose row
        blocks are ``W_query.weight.data``, ``W_key.weight.data``, ``W_value.weight.data`` (views;
        ``b`` likewise for the biases, None without ``qkv_bias``).  Built once; rebuilt (and the
        three parameters' ``.data`` re-pointed at it, same values) only when one of them was
        replaced by another array (``Module.to``, ``copy.deepcopy``, an assignment to ``.data``).
        None when ``kdim`` or ``vdim`` differs from ``d_in`` (no self-attention)."""
        if self.kdim != self.d_in or self.vdim != self.d_in:
            return None
        mods = (self.W_query, self.W_key, self.W_value)
        f = self._fused
        if (
            f is not None
            and _linked(f[0], f[2], [m.weight for m in mods])
            and (f[1] is None or _linked(f[1], f[3], [m.bias for m in mods]))
        ):
            return f[0], f[1]
        W = np.concatenate([m.weight.data for m in mods])
        wv = _views(W, [m.weight for m in mods])
        b = bv = None
        if self.W_query.bias is not None:
            b = np.concatenate([m.bias.data for m in mods])
            bv = _views(b, [m.bias for m in mods])
        object.__setattr__(self, "_fused", (W, b, wv, bv))
        return W, b

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

    def alibi_slopes(self) -> np.ndarray:
        """The ALiBi slopes ``2**(-8 (h + 1) / num_heads)``, ``(num_heads,)``."""
        return 2.0 ** (-8.0 * np.arange(1, self.num_heads + 1, dtype=self.dtype) / self.num_heads)

    def _positional_mask(self, lq, lk, align):
        """causal, window and ALiBi over the real keys as one explicit mask (used when extra keys
        follow them, which must stay visible and carry no position): bool ``(Lq, Lk)`` True = may
        attend, or float ``(num_heads, Lq, Lk)`` with ALiBi's bias and ``-inf`` where hidden."""
        p = np.arange(lq)[:, None] + (lk - lq if align == "bottom_right" else 0)
        j = np.arange(lk)[None, :]
        allowed = np.ones((lq, lk), bool)
        if self.causal:
            allowed &= j <= p
        if self.window is not None:
            left, right = self.window
            if left >= 0:
                allowed &= j >= p - left
            if right >= 0:
                allowed &= j <= p + right
        if not self.alibi:
            return allowed
        bias = -self.alibi_slopes()[:, None, None] * np.abs(p - j).astype(self.dtype)
        return np.where(allowed, bias, -np.inf).astype(self.dtype)

    def _with_extra_keys(self, kh, vh, lead):
        """Append ``bias_k``/``bias_v`` and the zero key/value (``add_bias_kv``, ``add_zero_attn``)."""
        ks, vs = [kh], [vh]
        hk, hd = self.num_kv_heads, self.head_dim
        if self.add_bias_kv:
            ks.append(np.broadcast_to(self.bias_k.data.reshape(hk, 1, hd), lead + (hk, 1, hd)))
            vs.append(np.broadcast_to(self.bias_v.data.reshape(hk, 1, hd), lead + (hk, 1, hd)))
        if self.add_zero_attn:
            ks.append(np.zeros(lead + (hk, 1, hd), kh.dtype))
            vs.append(np.zeros(lead + (hk, 1, hd), vh.dtype))
        return np.concatenate(ks, axis=-2), np.concatenate(vs, axis=-2)

    # -- forward / backward ----------------------------------------------------------------
    def forward(
        self,
        query,
        key=None,
        value=None,
        *,
        attn_mask=None,
        key_padding_mask=None,
        need_weights: bool = False,
        average_attn_weights: bool = False,
        use_cache: bool = False,
    ):
        """Returns ``(..., Lq, d_out)``, or ``(out, weights)`` when ``need_weights``: per-head
        ``weights (..., num_heads, Lq, Lk)`` (after dropout, as torch), averaged over the heads to
        ``(..., Lq, Lk)`` with ``average_attn_weights=True``.  ``Lk`` counts the extra keys of
        ``add_bias_kv``/``add_zero_attn`` (last columns) and every cached key.

        ``use_cache=True`` (self-attention only) decodes incrementally: this call's keys and
        values (after RoPE) are appended to the module's KV cache and the queries attend over
        every cached key; query ``i`` of this call sits at position ``T + i`` (``T`` the cache's
        length before the call), for causal masking, the window, ALiBi and RoPE alike, whatever
        ``causal_align`` says (bottom-right alignment).  Masks then cover all ``T + Lq`` keys.
        Such a call keeps no state for backward (a ``backward`` afterwards raises
        ``RuntimeError``, as after ``no_grad``).  ``reset_kv_cache()`` empties the cache; the
        batch shape of every cached call must be the same.  Feeding a sequence token by token
        (or in chunks) gives the outputs of one full causal forward over it.
        """
        # -- validate everything before any arithmetic or state change --------------------------
        x, k_in, v_in, self_attn = self._check_inputs(query, key, value)
        need_weights = check_bool(need_weights, "need_weights")
        average = check_bool(average_attn_weights, "average_attn_weights")
        use_cache = check_bool(use_cache, "use_cache")
        if need_weights and self.memory_efficient:
            raise ValueError("need_weights: memory_efficient attention never forms the weights; expected False")
        past = self._check_cache(x, self_attn, use_cache)
        mask = self._build_mask(attn_mask, key_padding_mask, x.shape[:-2], x.shape[-2], past + k_in.shape[-2])
        return self._forward(
            x,
            None if self_attn else k_in,
            None if self_attn else v_in,
            mask,
            need_weights=need_weights,
            average_attn_weights=average,
            use_cache=use_cache,
        )

    def _forward(
        self,
        x: np.ndarray,
        key: np.ndarray | None = None,
        value: np.ndarray | None = None,
        mask: np.ndarray | None = None,
        *,
        need_weights: bool = False,
        average_attn_weights: bool = False,
        use_cache: bool = False,
    ):
        """``forward`` on validated arguments, for npattn's own modules (which validate at their
        own edge): ``x`` (and, for cross-attention, ``key`` and ``value``; None for
        self-attention) arrays of the module's dtype checked by ``_check_inputs``, ``mask`` built
        by ``_build_mask`` (over the cached keys too), flags as bools, ``use_cache`` accepted by
        ``_check_cache``.  Nothing is checked again."""
        self_attn = key is None or value is None
        k_in, v_in = (x, x) if key is None or value is None else (key, value)
        lead, lq = x.shape[:-2], x.shape[-2]
        cache = self._kv_cache
        past = cache.length if use_cache and cache is not None else 0
        # a rolling cache no longer holds the first `dropped` keys (hidden by the window anyway):
        # the mask, built over every key seen, loses their columns; the weights get them back as 0
        dropped = cache.position - cache.length if use_cache and cache is not None else 0
        if dropped and mask is not None and mask.shape[-1] != 1:
            mask = mask[..., dropped:]
        lk = past + k_in.shape[-2]  # real keys: cached + this call's

        # -- projections: one GEMM for q, k and v in self-attention ----------------------------
        H, Hk, hd = self.num_heads, self.num_kv_heads, self.head_dim
        d_kv = Hk * hd
        # A training step's internal arrays come from (and go back to) the module's workspace
        ws = self._workspace() if self_attn and not use_cache and is_grad_enabled() else None
        if self_attn:
            W, b = self._fused_qkv()
            qkv, c = K.linear(x, W, b, out=None if ws is None else ws.empty(lead + (lq, W.shape[0]), x.dtype))
            proj = (c,)
            nq = self._q_rows
            q, k, v = qkv[..., :nq], qkv[..., nq : nq + d_kv], qkv[..., nq + d_kv :]
        else:
            outs = [
                K.linear(a, m.weight.data, None if m.bias is None else m.bias.data)
                for a, m in ((x, self.W_query), (k_in, self.W_key), (v_in, self.W_value))
            ]
            (q, _), (k, _), (v, _) = outs
            proj = tuple(c for _, c in outs)
        (qh, gate), kh, vh = self._split_query(q), self._split(k, Hk), self._split(v, Hk)
        qn = kn = qr = kr = None
        if self.qk_norm:
            qh, qn = K.rms_norm(qh, self._qk_weight(self.q_norm), self.q_norm.eps)
            kh, kn = K.rms_norm(kh, self._qk_weight(self.k_norm), self.k_norm.eps)
        if self.rope:
            start = cache.position if use_cache and cache is not None else 0  # rolled-out tokens count too
            ropt = dict(
                base=self.rope_base,
                interleaved=self.rope_interleaved,
                scaling=self.rope_scaling,
                rotary_dim=self.rotary_dim,
            )
            qh, qr = K.rope(qh, np.arange(start, start + lq), **ropt)
            kh, kr = K.rope(kh, np.arange(start, start + k_in.shape[-2]), **ropt)
        if use_cache:
            if cache is None:
                cache = _KVCache(kh, vh, keep=self._rolling_keep())
                object.__setattr__(self, "_kv_cache", cache)
            kh, vh = cache.append(kh, vh)

        # -- attention --------------------------------------------------------------------------
        align = "bottom_right" if use_cache else self.causal_align
        n_extra = int(self.add_bias_kv) + int(self.add_zero_attn)
        opts = {}
        if n_extra:
            kh, vh = self._with_extra_keys(kh, vh, lead)
            if self.causal or self.window is not None or self.alibi:
                mask = _masks.combine(mask, self._positional_mask(lq, lk, align))
            if mask is not None:  # a visible column for each extra key
                mask = np.broadcast_to(mask, mask.shape[:-1] + (lk,))
                pad = np.broadcast_to(
                    np.array(True if mask.dtype == bool else 0, mask.dtype), mask.shape[:-1] + (n_extra,)
                )
                mask = np.concatenate([mask, pad], axis=-1)
            is_causal = False
        else:
            is_causal = self.causal
            if self.window is not None:
                opts["window"] = self.window
            if self.alibi:
                opts["alibi_slopes"] = self.alibi_slopes()
        if align != "top_left" and (is_causal or "window" in opts or "alibi_slopes" in opts):
            opts["causal_align"] = align
        if self.softcap is not None:
            opts["softcap"] = self.softcap
        if self.scale is not None:
            opts["scale"] = self.scale
        if self.sinks is not None:
            opts["sinks"] = self.sinks.data
        if Hk != H:
            opts["enable_gqa"] = True
        p = self.dropout if self.training else 0.0
        if p > 0:
            opts.update(dropout_p=p, rng=self.rng)
        if self.memory_efficient:
            ctx, attn_cache = K.memory_efficient_attention(qh, kh, vh, attn_mask=mask, is_causal=is_causal, **opts)
        else:
            ctx, attn_cache = K.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=mask, is_causal=is_causal, heads_last=True, workspace=ws, **opts
            )
        merged = self._merge(ctx)  # (..., L, H * hd)
        gated = None
        if gate is not None:  # Qwen3-Next: the output times sigmoid(gate), feature by feature
            s = _sigmoid(gate).reshape(merged.shape)
            gated, merged = (merged, s), merged * s
        if cache is not None and use_cache:
            cache.trim()  # a rolling cache forgets what no later query can see
        out, out_cache = K.linear(
            merged, self.out_proj.weight.data, None if self.out_proj.bias is None else self.out_proj.bias.data
        )
        reused: tuple = ()
        if ws is not None:
            reused = (qkv,) if self.memory_efficient else (qkv, ctx) + tuple(cast(AttentionCache, attn_cache).p)
        state = _State(
            self_attn,
            proj,
            qn,
            kn,
            qr,
            kr,
            attn_cache,
            out_cache,
            lk,
            n_extra,
            self.memory_efficient,
            "sinks" in opts,
            reused,
            gated,
        )
        if use_cache:
            self.clear_saved()  # a cached call keeps nothing for backward, nor an earlier forward's state
        else:
            self._save(state)
        if not need_weights:
            return out
        c = cast(AttentionCache, attn_cache)  # need_weights is refused with memory_efficient
        weights = c.weights.copy() if c.keep is None else c.weights * c.keep * c.drop_scale
        if dropped:
            weights = np.concatenate([np.zeros(weights.shape[:-1] + (dropped,), weights.dtype), weights], axis=-1)
        if average_attn_weights:
            weights = weights.mean(axis=-3)
        return out, weights

    def backward(self, dy):
        """Through ``out_proj``, the attention core, RoPE, QK-norm and the projections.  Returns
        ``dx`` for self-attention (the sum over the input's three uses, shaped like the input),
        else ``(dquery, dkey, dvalue)``."""
        return self._backward(self._check_dy(dy))  # checked before any state is taken

    def _backward(self, dy):
        """``backward`` on a checked ``dy`` (npattn's blocks call it after their own check)."""
        st = self._pop()
        H, Hk = self.num_heads, self.num_kv_heads
        d_kv = Hk * self.head_dim
        ws = self._scratch() if st.reused else None  # the backward's own arrays: shared by all modules
        dctx, dwo, dbo = K.linear_backward(dy, st.out, None if ws is None else ws.empty(st.out.x.shape, dy.dtype))
        self._accumulate(self.out_proj.weight, dwo)
        if self.out_proj.bias is not None:
            self._accumulate(self.out_proj.bias, dbo)
        dgate = None
        if st.gate is not None:  # out_proj saw a * s: d a = d(a s) s, d g = d(a s) a s (1 - s)
            a, s = st.gate
            dgate = dctx * a * s * (1 - s)
            np.multiply(dctx, s, out=dctx)
        dctx = self._split(dctx, H)
        # with nothing between the projections and the attention core, its gradients are those of
        # the projections' outputs
        plain = st.q_norm is None and st.q_rope is None and st.n_extra == 0 and st.gate is None
        dqkv = None
        nq = self._q_rows
        if st.self_attn:
            shape = dy.shape[:-1] + (nq + 2 * d_kv,)
            dqkv = np.empty(shape, dy.dtype) if ws is None else ws.empty(shape, dy.dtype)
            dq_view, dgate_view = self._split_query(dqkv[..., :nq])
            views = (
                dq_view,
                self._split(dqkv[..., nq : nq + d_kv], Hk),
                self._split(dqkv[..., nq + d_kv :], Hk),
            )
        if st.memory_efficient:
            grads = K.memory_efficient_attention_backward(dctx, st.attn)
        elif st.self_attn and plain:
            # the attention backward writes dq, dk, dv straight into the (..., L, d_out + 2 kv)
            # gradient of the fused projection's output (no concatenate)
            grads = K.scaled_dot_product_attention_backward(dctx, st.attn, out=views, workspace=ws)
        else:
            grads = K.scaled_dot_product_attention_backward(dctx, st.attn)
        dqh, dkh, dvh = grads[:3]
        if st.sinks:
            self._accumulate(self.sinks, grads[-1])
        lk = st.lk
        lead_axes = tuple(range(dkh.ndim - 3))
        if self.add_bias_kv and st.n_extra:  # the key/value appended at position lk, broadcast over the batch
            self._accumulate(self.bias_k, self._merge(dkh[..., lk : lk + 1, :]).sum(axis=lead_axes).reshape(1, 1, d_kv))
            self._accumulate(self.bias_v, self._merge(dvh[..., lk : lk + 1, :]).sum(axis=lead_axes).reshape(1, 1, d_kv))
        dkh, dvh = dkh[..., :lk, :], dvh[..., :lk, :]
        if st.q_rope is not None:
            dqh = K.rope_backward(dqh, st.q_rope)
            dkh = K.rope_backward(dkh, st.k_rope)
        if st.q_norm is not None:
            dqh, dwq = K.rms_norm_backward(dqh, st.q_norm)
            dkh, dwk = K.rms_norm_backward(dkh, st.k_norm)
            self._accumulate(self.q_norm.weight, dwq)
            self._accumulate(self.k_norm.weight, dwk)
        mods = (self.W_query, self.W_key, self.W_value)
        if st.self_attn:
            if st.memory_efficient or not plain:
                for view, d in zip(views, (dqh, dkh, dvh)):
                    view[...] = d
            if dgate is not None:
                dgate_view[...] = dgate.reshape(dgate_view.shape)
            dx, dW, db = K.linear_backward(dqkv, st.proj[0])
            rows = np.cumsum([0, nq, d_kv, d_kv])
            for i, m in enumerate(mods):
                self._accumulate(m.weight, dW[rows[i] : rows[i + 1]])
                if m.bias is not None:
                    self._accumulate(m.bias, db[rows[i] : rows[i + 1]])
            if ws is not None:  # nothing refers to them any more: the next step reuses them
                ws.give(dctx, dqkv)
                self._workspace().give(*st.reused)
            return dx
        grads = []
        dq = self._merge(dqh)
        if dgate is not None:  # interleave each head's query and gate gradients as W_query's rows are
            dq = np.empty(dgate.shape[:-1] + (nq,), dgate.dtype)
            dq_view, dgate_view = self._split_query(dq)
            dq_view[...] = dqh
            dgate_view[...] = dgate.reshape(dgate_view.shape)
        for m, d, c in zip(mods, (dq, self._merge(dkh), self._merge(dvh)), st.proj):
            dx_i, dw_i, db_i = K.linear_backward(d, c)
            self._accumulate(m.weight, dw_i)
            if m.bias is not None:
                self._accumulate(m.bias, db_i)
            grads.append(dx_i)
        return tuple(grads)

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode (``jvp``): the forward's steps in order, each by its functional JVP.

        The projections (``ty = tx W^T + x tW^T + tb``; the fused self-attention weight's tangent
        is the three weights' stacked), QK-norm and RoPE, the extra keys (``bias_k``/``bias_v``
        move with their tangents, the zero key does not), the attention core
        (``scaled_dot_product_attention_jvp`` or ``memory_efficient_attention_jvp``, the sinks
        with their tangent, dropout with the forward's mask), the output gate
        (``t(a s) = ta s + a s (1 - s) tg``, ``s = sigmoid(g)``) and ``out_proj``.  Input tangents:
        ``tquery`` for self-attention, ``tquery, tkey, tvalue`` for cross-attention (each of its
        input's shape, None = zero)."""
        st = state
        Hk, hd = self.num_kv_heads, self.head_dim
        d_kv, nq = Hk * hd, self._q_rows
        pt = param_tangents
        mods = (self.W_query, self.W_key, self.W_value)
        names = ("tquery",) if st.self_attn else ("tquery", "tkey", "tvalue")
        dt = st.out.x.dtype
        given = check_tangents(input_tangents, names, "MultiHeadAttention.jvp")
        ts = [check_tangent(t, n, c.x.shape, dt) for t, n, c in zip(given, names, st.proj)]
        if st.self_attn:  # the fused projection: its weight's (and bias') tangent stacks the three

            def stacked(params):
                tans = [pt.get(p) for p in params]
                if all(t is None for t in tans):
                    return None
                return np.concatenate([np.zeros(p.data.shape, dt) if t is None else t for p, t in zip(params, tans)])

            tb = stacked([m.bias for m in mods]) if self.W_query.bias is not None else None
            tqkv = K.linear_jvp(st.proj[0], ts[0], stacked([m.weight for m in mods]), tb)
            tq, tk, tv = tqkv[..., :nq], tqkv[..., nq : nq + d_kv], tqkv[..., nq + d_kv :]
        else:
            tq, tk, tv = (K.linear_jvp(c, t, pt.get(m.weight), pt.get(m.bias)) for c, t, m in zip(st.proj, ts, mods))
        (tqh, tgate), tkh, tvh = self._split_query(tq), self._split(tk, Hk), self._split(tv, Hk)
        if st.q_norm is not None:  # the weight is w or 1 + w: its tangent is tw either way
            tqh = K.rms_norm_jvp(st.q_norm, tqh, pt.get(self.q_norm.weight))
            tkh = K.rms_norm_jvp(st.k_norm, tkh, pt.get(self.k_norm.weight))
        if st.q_rope is not None:
            tqh, tkh = K.rope_jvp(st.q_rope, tqh), K.rope_jvp(st.k_rope, tkh)
        if st.n_extra:  # the appended keys/values, as in _with_extra_keys
            lead = tkh.shape[:-3]
            tks, tvs = [tkh], [tvh]
            extra = [(self.bias_k, self.bias_v)] if self.add_bias_kv else []
            extra += [(None, None)] if self.add_zero_attn else []
            for pk, pv in extra:
                for out, p in ((tks, pk), (tvs, pv)):
                    t = pt.get(p)
                    shape = lead + (Hk, 1, hd)
                    out.append(np.zeros(shape, dt) if t is None else np.broadcast_to(t.reshape(Hk, 1, hd), shape))
            tkh, tvh = np.concatenate(tks, axis=-2), np.concatenate(tvs, axis=-2)
        tsinks = pt.get(self.sinks) if st.sinks else None
        core = K.memory_efficient_attention_jvp if st.memory_efficient else K.scaled_dot_product_attention_jvp
        tmerged = self._merge(core(st.attn, tqh, tkh, tvh, None, tsinks))  # (..., L, H * hd)
        if st.gate is not None:  # out_proj saw a * s, s = sigmoid(gate)
            a, s = st.gate
            tmerged = tmerged * s
            tmerged += a * s * (1 - s) * tgate.reshape(a.shape)
        return K.linear_jvp(st.out, tmerged, pt.get(self.out_proj.weight), pt.get(self.out_proj.bias))

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

    # -- interop ---------------------------------------------------------------------------
    _TORCH_KEYS = (
        "in_proj_weight",
        "q_proj_weight",
        "k_proj_weight",
        "v_proj_weight",
        "in_proj_bias",
        "bias_k",
        "bias_v",
        "out_proj.weight",
        "out_proj.bias",
    )

    @classmethod
    def from_torch_state_dict(cls, state_dict, num_heads: int, **kwargs) -> MultiHeadAttention:
        """Build from the ``state_dict`` of ``torch.nn.MultiheadAttention`` (``batch_first=True``
        gives the same outputs).  Packed ``in_proj_weight`` ``[q; k; v]`` or separate
        ``q_proj_weight``/``k_proj_weight``/``v_proj_weight``; ``in_proj_bias``; ``out_proj.*``;
        ``bias_k``/``bias_v`` (``add_bias_kv``).  Pass ``add_zero_attn=True`` when torch's module was
        built with it (nothing in its state dict says so).  Other keys raise ``ValueError``.

        ``dtype=`` (np.float32, ``"float32"``, ``np.dtype``...) chooses the module's dtype; by default
        the state dict's own float32/float64 (float64 otherwise).  Remember that torch's bool
        ``attn_mask`` means True = *masked*; npattn's means True = may attend (pass ``~mask``)."""
        if not hasattr(state_dict, "items"):
            raise TypeError(f"state_dict: expected a mapping of names to arrays, got {type(state_dict).__name__}")
        unknown = [k for k in state_dict if k not in cls._TORCH_KEYS]
        if unknown:
            raise ValueError(
                f"state_dict: unknown keys {unknown} (torch.nn.MultiheadAttention has {list(cls._TORCH_KEYS)})"
            )
        sd = {k: to_numpy(v, f"state_dict[{k!r}]") for k, v in state_dict.items()}
        if "out_proj.weight" not in sd:
            raise ValueError(f"state_dict: expected key 'out_proj.weight', got keys {sorted(sd)}")
        if sd["out_proj.weight"].ndim != 2:
            raise ValueError(
                f"state_dict: expected 'out_proj.weight' of shape (E, E), got {sd['out_proj.weight'].shape}"
            )
        E = sd["out_proj.weight"].shape[0]
        if "in_proj_weight" in sd:
            w = sd["in_proj_weight"]
            if w.shape != (3 * E, E):
                raise ValueError(f"state_dict: expected 'in_proj_weight' of shape {(3 * E, E)}, got {w.shape}")
            wq, wk, wv = w[:E], w[E : 2 * E], w[2 * E :]
        else:
            missing = [k for k in ("q_proj_weight", "k_proj_weight", "v_proj_weight") if k not in sd]
            if missing:
                raise ValueError(
                    f"state_dict: expected 'in_proj_weight' or the separate projections, missing {missing}"
                )
            wq, wk, wv = sd["q_proj_weight"], sd["k_proj_weight"], sd["v_proj_weight"]
            for name, w in (("q_proj_weight", wq), ("k_proj_weight", wk), ("v_proj_weight", wv)):
                if w.ndim != 2 or w.shape[0] != E:
                    raise ValueError(f"state_dict: expected {name!r} of shape ({E}, in), got {w.shape}")
        has_bias_kv = "bias_k" in sd or "bias_v" in sd
        if has_bias_kv and not ("bias_k" in sd and "bias_v" in sd):
            raise ValueError("state_dict: expected both 'bias_k' and 'bias_v' (add_bias_kv=True) or neither")
        if "add_bias_kv" in kwargs and check_bool(kwargs.pop("add_bias_kv"), "add_bias_kv") != has_bias_kv:
            raise ValueError(
                f"add_bias_kv: the state dict {'has' if has_bias_kv else 'has no'} 'bias_k'/'bias_v', "
                f"expected add_bias_kv={has_bias_kv} (or leave it out)"
            )
        if "dtype" in kwargs:
            kwargs["dtype"] = check_dtype(kwargs["dtype"])
        else:
            dt = sd["out_proj.weight"].dtype
            kwargs["dtype"] = dt if dt in (np.dtype(np.float32), np.dtype(np.float64)) else np.dtype(np.float64)
        m = cls(
            wq.shape[1],
            E,
            num_heads,
            qkv_bias="in_proj_bias" in sd,
            out_bias="out_proj.bias" in sd,
            kdim=wk.shape[1],
            vdim=wv.shape[1],
            add_bias_kv=has_bias_kv,
            **kwargs,
        )
        new = {"W_query.weight": wq, "W_key.weight": wk, "W_value.weight": wv, "out_proj.weight": sd["out_proj.weight"]}
        if "in_proj_bias" in sd:
            b = sd["in_proj_bias"]
            if b.shape != (3 * E,):
                raise ValueError(f"state_dict: expected 'in_proj_bias' of shape {(3 * E,)}, got {b.shape}")
            new.update({"W_query.bias": b[:E], "W_key.bias": b[E : 2 * E], "W_value.bias": b[2 * E :]})
        for key in ("out_proj.bias", "bias_k", "bias_v"):
            if key in sd:
                new[key] = sd[key]
        m.load_state_dict(new, strict=False)
        return m


def _linked(fused, views, params) -> bool:
    """True while each parameter's ``.data`` is still the view of ``fused`` handed to it."""
    return all(p.data is w and w.base is fused for p, w in zip(params, views))


def _views(fused, params):
    """Point each parameter's ``.data`` at its row block of ``fused``; return the views."""
    views, r = [], 0
    for p in params:
        n = p.data.shape[0]
        w = fused[r : r + n]
        version = p._version
        p.data = w
        p._version = version  # the same values, only in another array: nothing a kept forward state must refuse
        views.append(w)
        r += n
    return tuple(views)
