"""``MultiHeadLatentAttention``: DeepSeek-V2/V3's multi-head latent attention (MLA), with its
latent cache, absorbed decoding and a hand-written backward.

The layer (as Hugging Face ``DeepseekV3Attention``; ``H`` heads, ``dn = qk_nope_head_dim``,
``dr = qk_rope_head_dim``, ``dv = v_head_dim``, ``r = kv_lora_rank``)::

    q        = q_proj(x)                       or  q_b_proj(q_a_layernorm(q_a_proj(x)))   (..., L, H (dn + dr))
    q_nope, q_pe = split(q)                    per head: (..., H, L, dn), (..., H, L, dr)
    c, k_pe  = split(kv_a_proj_with_mqa(x))    (..., L, r), (..., L, dr)
    c        = kv_a_layernorm(c)               the compressed latent: all a token leaves for keys and values
    q_pe, k_pe = rope(q_pe), rope(k_pe)        k_pe is ONE key part shared by all heads
    k_nope, v = split(kv_b_proj(c))            per head: (..., H, L, dn), (..., H, L, dv)
    o        = softmax(scale [q_nope, q_pe] . [k_nope, k_pe]^T) v      per head
    y        = o_proj(merge(o))

Absorbed form.  ``kv_b_proj.weight`` is ``(H (dn + dv), r)``: per head a key block ``W_uk[h] (dn, r)``
and a value block ``W_uv[h] (dv, r)``, with ``k_nope[h, t] = W_uk[h] c_t`` and ``v[h, t] = W_uv[h] c_t``.
Matrix products regroup:

    q_nope[h] . k_nope[h, t] = q_nope[h] . (W_uk[h] c_t) = (W_uk[h]^T q_nope[h]) . c_t
    sum_t p[h, t] v[h, t]    = W_uv[h] (sum_t p[h, t] c_t)

so with ``q_lat[h] = W_uk[h]^T q_nope[h]`` (r features) the scores are those of a query
``[q_lat, q_pe]`` against ONE key ``[c_t, k_pe_t]`` shared by all heads, and the output is
attention over the latents ``c_t`` (values shared by all heads too), then ``W_uv[h]``, then
``o_proj``: multi-query attention with ``E = r + dr`` and ``Ev = r``.  A decoding step then needs,
per past token, only ``[c_t, k_pe_t]``: ``r + dr`` numbers instead of MHA's ``H (dn + dr + dv)``.
That is the latent cache (``cache_bytes_per_token``).  Both forms have a backward here; they give
the same outputs and gradients (tests hold them equal to 1e-12).

RoPE: pairs ``(i, i + dr/2)`` (rotate half) or, with ``rope_interleave=True`` (DeepSeek-V3's
default), ``(2i, 2i + 1)``.  Hugging Face's ``apply_rotary_pos_emb_interleave`` rotates the same
pairs by the same angles but writes the result de-interleaved (evens then odds); q and k are
permuted alike, so every dot product (and so the layer) is the same as ``rope(...,
interleaved=True)``, which keeps the layout.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Mapping, NamedTuple

import numpy as np

from .._validate import (
    as_float,
    as_index,
    as_rng,
    check_bool,
    check_broadcastable,
    check_cache_batch,
    check_dtype,
    check_mask,
    check_positive_float,
    check_size,
    to_numpy,
)
from ..functional import kernels as K
from ..functional.rope_scaling import check_scaling, resolve_base, rope_softmax_scale
from ..functional.sparse_attention import (
    index_topk_kernel,
    indexer_kl_loss_kernel,
    lightning_indexer_backward,
    lightning_indexer_kernel,
    sparse_attention_kernel,
)
from .kv_cache import KVCache, _KeysCacheHooks
from .layers import LayerNorm, Linear, RMSNorm, input_tangent
from .module import Module, no_grad

__all__ = ["MultiHeadLatentAttention", "LightningIndexer", "kv_cache_bytes_per_token"]


class _State(NamedTuple):
    """What ``MultiHeadLatentAttention.backward`` needs from its forward (the submodules keep
    their own caches)."""

    absorbed: bool
    q_rope: tuple  # rope caches of q_pe (..., H, L, dr) and of the shared k_pe (..., 1, L, dr)
    k_rope: tuple
    attn: tuple  # the attention kernel's cache
    q_nope: np.ndarray | None  # absorbed form: q_nope (..., H, L, dn) and the latent output (..., H, L, r)
    ctx_lat: np.ndarray | None


def kv_cache_bytes_per_token(num_kv_heads: int, k_head_dim: int, v_head_dim: int, dtype=np.float64) -> int:
    """Bytes one token adds to one layer's key/value cache in (grouped-query) multi-head
    attention: ``num_kv_heads * (k_head_dim + v_head_dim) * itemsize``.

    Parameters
    ----------
    num_kv_heads : int
        Key/value heads (``num_heads`` for MHA, fewer for GQA, 1 for MQA).
    k_head_dim, v_head_dim : int
        Features of each cached key and value.
    dtype : dtype
        The cache's dtype (its item size counts).

    Returns
    -------
    int

    Raises
    ------
    TypeError, ValueError
        A size that is not a positive integer; a dtype other than float32/float64.
    """
    n = check_size(num_kv_heads, "num_kv_heads")
    dk, dv = check_size(k_head_dim, "k_head_dim"), check_size(v_head_dim, "v_head_dim")
    return n * (dk + dv) * check_dtype(dtype).itemsize


def _split(t: np.ndarray, heads: int) -> np.ndarray:
    """``(..., L, heads * d) -> (..., heads, L, d)`` (a view)."""
    return t.reshape(t.shape[:-1] + (heads, t.shape[-1] // heads)).swapaxes(-2, -3)


def _merge(t: np.ndarray) -> np.ndarray:
    """``(..., heads, L, d) -> (..., L, heads * d)``."""
    t = t.swapaxes(-2, -3)
    return t.reshape(t.shape[:-2] + (t.shape[-2] * t.shape[-1],))


def _data(p):
    """A parameter's array, or None for an absent one (no bias)."""
    return None if p is None else p.data


def _core_backward_jvp(d, cache, tangents, td):
    """The attention core's ``(dq, dk, dv)`` and their tangents (second order)."""
    grads, grad_tangents = K.scaled_dot_product_attention_backward_jvp(d, cache, tangents, td)
    return grads[:3], grad_tangents[:3]


class LightningIndexer(Module):
    """DeepSeek-V3.2's lightning indexer: which keys each query of a ``MultiHeadLatentAttention``
    attends to (its ``index_topk`` best), with the parameter names of transformers'
    ``DeepseekV32Indexer``: ``wq_b.weight (H D, q_lora_rank)``, ``wk.weight (D, hidden)``,
    ``k_norm.weight``, ``k_norm.bias (D,)`` (a LayerNorm, eps 1e-6), ``weights_proj.weight (H, hidden)``.

    For a token ``x`` with the attention's low-rank query ``a = q_a_layernorm(q_a_proj(x))``::

        q_h = rope(wq_b(a)_h)      k = rope(k_norm(wk(x)))      w = weights_proj(x) / sqrt(H)
        I[l, t] = sum_h w[l, h] relu(q_h[l] . k[t] / sqrt(D))            (lightning_indexer)

    RoPE rotates the first ``qk_rope_head_dim`` features of q and k in the rotate-half layout
    (pairs ``(i, i + dr/2)``), whatever the attention's layout; the rest pass unrotated.  The choice
    of keys is piecewise constant, so nothing is differentiated through it: its parameters get no
    gradient from the model's loss (zero, as transformers' ``no_grad``); they are trained by the
    indexer's own KL loss (``npattn.functional.indexer_kl_loss``).  A parameter holder: the
    attention calls ``scores``; ``keys`` is what its cache keeps per token (``D`` numbers).
    """

    def __init__(self, hidden_size, q_lora_rank, num_heads, head_dim, rope_dim, *, rng=None, dtype=np.float64):
        super().__init__()
        self.num_heads = check_size(num_heads, "index_n_heads")
        self.head_dim = check_size(head_dim, "index_head_dim")
        if self.head_dim < rope_dim:
            raise ValueError(f"index_head_dim: expected at least qk_rope_head_dim={rope_dim}, got {self.head_dim}")
        self.rope_dim = rope_dim
        self._dtype = check_dtype(dtype)
        self.wq_b = Linear(q_lora_rank, self.num_heads * self.head_dim, False, rng=rng, dtype=dtype)
        self.wk = Linear(hidden_size, self.head_dim, False, rng=rng, dtype=dtype)
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6, dtype=dtype)
        self.weights_proj = Linear(hidden_size, self.num_heads, False, rng=rng, dtype=dtype)

    def forward(self, x):  # pragma: no cover - called through its attention
        raise RuntimeError("LightningIndexer: call it through its MultiHeadLatentAttention (it has no forward)")

    def _rotated(self, t, rope):
        """RoPE of the first ``rope_dim`` features of ``t (..., heads, L, D)``, rotate-half."""
        return np.concatenate([rope(t[..., : self.rope_dim]), t[..., self.rope_dim :]], axis=-1)

    def keys(self, x, rope):
        """The indexer keys of ``x (..., L, hidden)``: ``(..., L, D)`` (``rope(t)`` rotates ``(..., 1, L, dr)``)."""
        k = K.layer_norm(K.linear(x, self.wk.weight.data)[0], self.k_norm.weight.data, self.k_norm.bias.data, 1e-6)[0]
        return self._rotated(k[..., None, :, :], rope)[..., 0, :, :]

    def scores(self, x, a, keys, rope):
        """``I (..., L, T)``: the queries of ``x`` (low-rank query ``a``) against ``keys (..., T, D)``."""
        q = K.linear(a, self.wq_b.weight.data)[0]
        q = self._rotated(_split(q, self.num_heads), rope)  # (..., H, L, D)
        w = K.linear(x, self.weights_proj.weight.data)[0] * self.num_heads**-0.5
        return lightning_indexer_kernel(q, keys, w, self.head_dim**-0.5)[0]


class MultiHeadLatentAttention(_KeysCacheHooks, Module):
    """Multi-head latent attention (DeepSeek-V2/V3): ``(..., L, hidden_size) -> (..., L, hidden_size)``,
    with the semantics and parameter names of Hugging Face's ``DeepseekV3Attention``.

    Parameters
    ----------
    hidden_size : int
        Model width (input and output features).
    num_heads : int
        Attention heads ``H``.
    kv_lora_rank : int
        Width ``r`` of the compressed key/value latent (what the cache keeps per token).
    qk_nope_head_dim, qk_rope_head_dim : int
        Per head, the query/key features without position (``dn``) and the rotated ones (``dr``,
        even; the rotated key part is one ``(dr,)`` vector per token shared by all heads).
    v_head_dim : int
        Value features per head.
    q_lora_rank : int or None
        ``None``: one query projection ``q_proj``; an int: the low-rank query
        ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` through that many features.
    rms_norm_eps : float
        eps of ``q_a_layernorm`` and ``kv_a_layernorm``.  Hugging Face builds these two with its
        RMSNorm's default ``1e-6`` whatever ``config.rms_norm_eps`` says (``from_config`` does so too).
    attention_bias : bool
        Biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` (never on ``q_proj``,
        ``q_b_proj``, ``kv_b_proj``), as Hugging Face.
    rope_theta : float
        RoPE base (a ``rope_theta`` in ``rope_scaling`` takes its place).
    rope_scaling : dict or None
        Hugging Face's ``rope_scaling`` (or ``rope_parameters``) dict, as ``npattn.functional.rope``
        takes it (``linear``, ``dynamic``, ``yarn`` with its attention factor on cos/sin,
        ``llama3``; DeepSeek-V3 uses ``yarn``).  Besides the rotation, a non-default ``rope_type``
        with ``mscale_all_dim`` multiplies the softmax scale by ``(0.1 mscale_all_dim ln(factor) +
        1)**2`` (``rope_softmax_scale``, as Hugging Face's ``yarn_apply_mscale``).  Stored checked
        and normalised as ``self.rope_scaling``.
    rope_interleave : bool
        Rotate pairs ``(2i, 2i+1)`` (DeepSeek-V3's default, True) or ``(i, i + dr/2)``.
    rope : bool
        False: no rotation at all (Kimi Linear's MLA, "NoPE"): the ``qk_rope_head_dim`` features
        of q and the shared key part enter the scores as they are (computed as RoPE at position 0,
        an exact identity, so backward and JVP are unchanged); ``rope_scaling`` is then unused.
    causal : bool
        Query ``i`` sees keys ``0..i`` (True, as the model).
    index_topk, index_n_heads, index_head_dim : int or None
        DeepSeek-V3.2's sparse attention (``deepseek_v32``): with ``index_topk`` a
        ``LightningIndexer`` (``self.indexer``; ``index_n_heads`` heads of ``index_head_dim``
        features, needs ``q_lora_rank``) scores every key for every query, and each query attends
        to its ``index_topk`` best visible keys only (``npattn.functional.index_topk``; all of them
        when it sees fewer), as transformers' ``DeepseekV32Attention`` with its eager mask.  The
        choice is a constant mask for the backward and the JVPs: the gradient is that of the
        selected attention, the indexer's parameters get zero (``LightningIndexer``).  The cache
        keeps each token's indexer key beside its latent.  None (default): dense MLA.
    rng : Generator, int or None
        Draws the projections (``Linear``'s torch-like uniform init) in the order q, kv_a, kv_b, o
        (then the indexer's wq_b, wk, weights_proj).
    dtype : float32 or float64

    Notes
    -----
    Parameters (state-dict keys, Hugging Face's under ``self_attn.``): ``q_proj.weight`` or
    ``q_a_proj.weight`` (+ ``.bias``), ``q_a_layernorm.weight``, ``q_b_proj.weight``;
    ``kv_a_proj_with_mqa.weight (r + dr, hidden)`` (+ ``.bias``), ``kv_a_layernorm.weight (r,)``,
    ``kv_b_proj.weight (H (dn + dv), r)``, ``o_proj.weight (hidden, H dv)`` (+ ``.bias``).

    Latent cache: ``forward(x, use_cache=True)`` appends each token's ``[c, k_pe]`` (the latent after
    ``kv_a_layernorm`` and the rotated shared key: ``r + dr`` numbers) and attends in the absorbed
    form; feeding a sequence token by token gives the full causal pass's outputs.
    ``reset_kv_cache()`` starts a new sequence; ``cache_bytes_per_token()`` and
    ``cache_comparison()`` report the cache's size against MHA and GQA.

    Raises
    ------
    TypeError, ValueError
        A size that is not a positive integer (``qk_rope_head_dim`` must be even), a flag that is
        not a bool, a non-positive ``rms_norm_eps`` or ``rope_theta``, an unsupported
        ``rope_scaling``, a dtype other than float32/float64.
    """

    _kv_cache: KVCache | None
    _index_keys: np.ndarray | None  # DeepSeek-V3.2: the indexer keys of the cached tokens (..., T, D)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        rms_norm_eps: float = 1e-6,
        attention_bias: bool = False,
        rope_theta: float = 10000.0,
        rope_scaling: Mapping[str, Any] | None = None,
        rope_interleave: bool = True,
        causal: bool = True,
        rope: bool = True,
        index_topk: int | None = None,
        index_n_heads: int | None = None,
        index_head_dim: int | None = None,
        rng=None,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        self.hidden_size = check_size(hidden_size, "hidden_size")
        self.num_heads = check_size(num_heads, "num_heads")
        self.rope = check_bool(rope, "rope")
        self.kv_lora_rank = check_size(kv_lora_rank, "kv_lora_rank")
        self.qk_nope_head_dim = check_size(qk_nope_head_dim, "qk_nope_head_dim")
        self.qk_rope_head_dim = check_size(qk_rope_head_dim, "qk_rope_head_dim")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: expected an even size (pairs rotate), got {self.qk_rope_head_dim}")
        self.v_head_dim = check_size(v_head_dim, "v_head_dim")
        self.q_lora_rank = None if q_lora_rank is None else check_size(q_lora_rank, "q_lora_rank")
        self.rms_norm_eps = check_positive_float(rms_norm_eps, "rms_norm_eps")
        self.attention_bias = check_bool(attention_bias, "attention_bias")
        # the rotation: Hugging Face's dict checked once (names the key of a bad entry); its
        # rope_theta takes the place of rope_theta (left at its default 10000 or equal)
        self.rope_scaling = check_scaling(rope_scaling, "rope_scaling")
        self.rope_theta = resolve_base(rope_theta, self.rope_scaling, "rope_theta")
        if self.rope_scaling.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                "rope_scaling['partial_rotary_factor']: expected 1 (all qk_rope_head_dim features rotate), "
                f"got {self.rope_scaling['partial_rotary_factor']}"
            )
        self.rope_interleave = check_bool(rope_interleave, "rope_interleave")
        self.causal = check_bool(causal, "causal")
        self._dtype = check_dtype(dtype)
        rng = as_rng(rng)
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        # YaRN's temperature on the whole score: qk_head_dim**-0.5 * mscale(factor, mscale_all_dim)**2
        plain = self.qk_head_dim**-0.5
        self.scaling = rope_softmax_scale(plain, self.rope_scaling) if self.rope else plain
        H, D, r = self.num_heads, self.hidden_size, self.kv_lora_rank
        bias = self.attention_bias
        if self.q_lora_rank is None:
            self.q_proj = Linear(D, H * self.qk_head_dim, False, rng=rng, dtype=dtype)
        else:
            self.q_a_proj = Linear(D, self.q_lora_rank, bias, rng=rng, dtype=dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, self.rms_norm_eps, dtype=dtype)
            self.q_b_proj = Linear(self.q_lora_rank, H * self.qk_head_dim, False, rng=rng, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(D, r + self.qk_rope_head_dim, bias, rng=rng, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(r, self.rms_norm_eps, dtype=dtype)
        self.kv_b_proj = Linear(r, H * (self.qk_nope_head_dim + self.v_head_dim), False, rng=rng, dtype=dtype)
        self.o_proj = Linear(H * self.v_head_dim, D, bias, rng=rng, dtype=dtype)
        self.index_topk = None if index_topk is None else check_size(index_topk, "index_topk")
        if self.index_topk is not None:
            if self.q_lora_rank is None:
                raise ValueError("index_topk: the lightning indexer reads the low-rank query; q_lora_rank is needed")
            heads, dim = (
                (64 if index_n_heads is None else index_n_heads),
                (128 if index_head_dim is None else index_head_dim),
            )
            self.indexer = LightningIndexer(
                D, self.q_lora_rank, heads, dim, self.qk_rope_head_dim, rng=rng, dtype=dtype
            )
        object.__setattr__(self, "_kv_cache", None)
        object.__setattr__(self, "_index_keys", None)  # the indexer keys of the cached tokens

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, rng=None, dtype=np.float64) -> MultiHeadLatentAttention:
        """Build from a Hugging Face ``DeepseekV3Config`` as a dict (``config.to_dict()``).

        A compatibility wrapper: ``npattn.models.configs.latent_config(config)`` reads the
        arguments (a ``LatentConfig``), which are then passed to the constructor, as ``CausalLM``
        does.  Reads ``hidden_size``, ``num_attention_heads``, ``q_lora_rank``, ``kv_lora_rank``,
        ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``attention_bias``,
        ``rope_interleave`` and the rotation from ``rope_parameters`` (transformers 5) or
        ``rope_theta`` + ``rope_scaling`` (older); the latent norms get eps ``1e-6`` as in
        ``DeepseekV3Attention``.

        Raises
        ------
        TypeError, ValueError
            As ``latent_config``, which reads the config.
        """
        from ..models.configs import latent_config  # models sits above nn: imported when called

        return cls(**latent_config(config).kwargs(), rng=rng, dtype=dtype)

    def extra_repr(self):
        """The arguments shown by ``repr(module)``."""
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, "
            f"kv_lora_rank={self.kv_lora_rank}, qk_nope_head_dim={self.qk_nope_head_dim}, "
            f"qk_rope_head_dim={self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}"
        )

    # -- the latent cache -------------------------------------------------------------------
    def reset_kv_cache(self) -> None:
        """Empty the latent cache (and the indexer keys' cache; start a new sequence)."""
        object.__setattr__(self, "_kv_cache", None)
        object.__setattr__(self, "_index_keys", None)

    def _cache_state(self) -> tuple:
        return (self._kv_cache, self._index_keys)

    def _set_cache_state(self, state: tuple) -> None:
        object.__setattr__(self, "_kv_cache", state[0])
        object.__setattr__(self, "_index_keys", state[1])

    def _rewind_cache(self, n: int, mark) -> None:
        super()._rewind_cache(n, mark)
        if self._index_keys is not None:  # (..., T, D): one row per cached token
            object.__setattr__(self, "_index_keys", self._index_keys[..., :n, :])

    @property
    def kv_cache_length(self) -> int:
        """The number of cached tokens (0 when the cache is empty)."""
        return 0 if self._kv_cache is None else self._kv_cache.length

    def cache_bytes_per_token(self) -> int:
        """Bytes one token adds to this layer's latent cache: ``(kv_lora_rank + qk_rope_head_dim)
        * itemsize`` (the latent after ``kv_a_layernorm`` and the rotated shared key), plus
        ``index_head_dim * itemsize`` with a lightning indexer (the token's indexer key).

        Returns
        -------
        int
        """
        index = self.indexer.head_dim if self.index_topk is not None else 0
        return (self.kv_lora_rank + self.qk_rope_head_dim + index) * self.dtype.itemsize

    def cache_comparison(self, num_kv_heads: int | None = None) -> dict:
        """Cache bytes per token and layer of this MLA layer against multi-head attention with the
        same heads (``num_heads`` keys of ``qk_nope_head_dim + qk_rope_head_dim`` and values of
        ``v_head_dim``: what the expanded keys/values would take) and grouped-query attention with
        ``num_kv_heads`` key/value heads (default ``max(1, num_heads // 8)``), in the module's dtype.

        Parameters
        ----------
        num_kv_heads : int or None
            Key/value heads of the GQA row (a divisor of ``num_heads``).

        Returns
        -------
        dict
            ``{"mla": bytes, "mha": bytes, "gqa": bytes, "gqa_kv_heads": int, "mha_over_mla": float,
            "gqa_over_mla": float}``.

        Raises
        ------
        TypeError, ValueError
            ``num_kv_heads`` not a positive integer dividing ``num_heads``.
        """
        H = self.num_heads
        g = max(1, H // 8) if num_kv_heads is None else check_size(num_kv_heads, "num_kv_heads")
        if H % g:
            raise ValueError(f"num_kv_heads: expected a divisor of num_heads={H}, got {g}")
        mla = self.cache_bytes_per_token()
        mha = kv_cache_bytes_per_token(H, self.qk_head_dim, self.v_head_dim, self.dtype)
        gqa = kv_cache_bytes_per_token(g, self.qk_head_dim, self.v_head_dim, self.dtype)
        return {
            "mla": mla,
            "mha": mha,
            "gqa": gqa,
            "gqa_kv_heads": g,
            "mha_over_mla": mha / mla,
            "gqa_over_mla": gqa / mla,
        }

    # -- forward ---------------------------------------------------------------------------
    def forward(self, x, *, positions=None, attn_mask=None, use_cache: bool = False, absorb: bool | None = None):
        """Attention of ``x (..., L, hidden_size)`` (unbatched ``(L, hidden_size)`` too) over itself.

        Parameters
        ----------
        x : array
            Hidden states.
        positions : int array or None
            Positions for RoPE, broadcastable to ``x.shape[:-1]``; default ``T + arange(L)``
            (``T`` the cached tokens, 0 without the cache).
        attn_mask : bool or float array or None
            Broadcastable to ``(..., num_heads, L, Lk)`` (``Lk = T + L``): bool True = may attend,
            float added to the scaled scores; combined with ``causal``.
        use_cache : bool
            Append this call's latents and rotated keys to the latent cache and attend over every
            cached token (query ``i`` at position ``T + i``: bottom-right causal alignment).  Such a
            call keeps nothing for backward.
        absorb : bool or None
            Compute in the absorbed form (queries through ``W_uk``, attention over latents, then
            ``W_uv``) or the plain one (keys and values expanded by ``kv_b_proj``); same results.
            Default: absorbed with ``use_cache``, plain without.

        Returns
        -------
        ndarray ``(..., L, hidden_size)``

        Raises
        ------
        TypeError, ValueError
            ``x`` not a float/int array of shape ``(..., L, hidden_size)``; ``positions`` not
            integers of a broadcastable shape; a bad ``attn_mask``; a flag that is not a bool; a
            batch shape other than the cache's.
        """
        x = as_float(x, "x", self.dtype)
        if x.ndim < 2 or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"x: expected shape (..., L, {self.hidden_size}) or (L, {self.hidden_size}), got {x.shape}"
            )
        use_cache = check_bool(use_cache, "use_cache")
        absorb = use_cache if absorb is None else check_bool(absorb, "absorb")
        lead, lq = x.shape[:-2], x.shape[-2]
        past = 0
        if use_cache and self._kv_cache is not None:
            check_cache_batch(self._kv_cache.lead, x.shape, "x", "latent cache")
            past = self._kv_cache.length
        if positions is None:
            positions = np.arange(past, past + lq)
        else:
            positions = as_index(positions, "positions")
            check_broadcastable(positions.shape, x.shape[:-1], "positions", "x's shape without hidden_size")
        mask = None
        if attn_mask is not None:
            mask = check_mask(to_numpy(attn_mask, "attn_mask"), "attn_mask", lead + (self.num_heads, lq, past + lq))
            if mask.dtype.kind == "f" and mask.dtype != self.dtype:
                mask = mask.astype(self.dtype)
        if use_cache:
            with no_grad():  # a cached call keeps nothing for backward
                return self._forward(x, positions, mask, use_cache=True, absorb=absorb)
        return self._forward(x, positions, mask, absorb=absorb)

    def _rope(self, t: np.ndarray, positions: np.ndarray):
        """RoPE of ``t (..., heads, L, dr)``; ``positions`` broadcastable to ``(..., L)``."""
        pos = positions[..., None, :] if positions.ndim else positions
        if not self.rope:  # Kimi Linear's MLA: no rotation, the rope part kept as it is (position 0 rotates by 0)
            return K.rope(t, np.zeros_like(pos), base=self.rope_theta, interleaved=self.rope_interleave)
        return K.rope(t, pos, base=self.rope_theta, interleaved=self.rope_interleave, scaling=self.rope_scaling)

    def _forward(self, x, positions, mask=None, *, use_cache: bool = False, absorb: bool = False):
        """``forward`` on validated arguments (``x`` of the module's dtype and shape, integer
        ``positions`` broadcastable to ``x.shape[:-1]``, a checked ``mask``), for npattn's own
        models.  With ``use_cache`` the caller runs it under ``no_grad``."""
        H, dn, r = self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank
        lead = x.shape[:-2]
        # -- queries: (..., L, H dq) -> (..., H, L, dq) --------------------------------------
        a = None
        if self.q_lora_rank is None:
            q = self.q_proj._forward(x)
        else:
            a = self.q_a_layernorm._forward(self.q_a_proj._forward(x))
            q = self.q_b_proj._forward(a)
        qh = _split(q, H)
        q_nope = qh[..., :dn]
        q_pe, q_rope = self._rope(qh[..., dn:], positions)  # (..., H, L, dr)
        # -- the compressed latent and the shared rotated key --------------------------------
        ckv = self.kv_a_proj_with_mqa._forward(x)  # (..., L, r + dr)
        c = self.kv_a_layernorm._forward(ckv[..., :r])  # (..., L, r)
        k_pe, k_rope = self._rope(ckv[..., None, :, r:], positions)  # (..., 1, L, dr)
        if use_cache:
            cache = self._kv_cache
            if cache is None:
                cache = KVCache()
                object.__setattr__(self, "_kv_cache", cache)
            full, _ = cache.append(*self._latent_kv(c, k_pe))  # (..., 1, T, r + dr)
            c_all, k_pe_all = full[..., 0, :, :r], full[..., r:]
        else:
            full, c_all, k_pe_all = None, c, k_pe
        opts: dict = {"is_causal": self.causal, "scale": self.scaling}
        if self.causal and use_cache:
            opts["causal_align"] = "bottom_right"
        idx = None  # DeepSeek-V3.2: the chosen keys' positions
        if self.index_topk is not None:
            mask, idx = self._sparse_mask(x, a, positions, mask, use_cache)
        if absorb:
            # q_lat[h] = W_uk[h]^T q_nope[h]: (..., H, L, dn) @ (H, dn, r) -> (..., H, L, r)
            W_uk, W_uv = self._absorbed_weights()
            q_lat = np.matmul(q_nope, W_uk)
            query = np.concatenate([q_lat, q_pe], axis=-1)  # (..., H, L, r + dr)
            if full is None:
                full = np.concatenate([c[..., None, :, :], k_pe], axis=-1)  # (..., 1, L, r + dr)
            # multi-query attention: one key [c, k_pe] and one value c for all heads
            if use_cache and idx is not None:  # decoding: only the chosen latents are read (the gathered pair)
                ctx_lat, attn = sparse_attention_kernel(query, full, full[..., :r], idx, self.scaling)
            else:
                ctx_lat, attn = K.scaled_dot_product_attention(
                    query, full, full[..., :r], mask, enable_gqa=H > 1, **opts
                )  # (..., H, L, r)
            ctx = np.matmul(ctx_lat, W_uv.swapaxes(-1, -2))  # (..., H, L, r) @ (H, r, dv) -> (..., H, L, dv)
            state = _State(True, q_rope, k_rope, attn, q_nope, ctx_lat)
        else:
            kvh = _split(self._expand(c_all, use_cache), H)  # (..., H, T, dn + dv)
            T = kvh.shape[-2]
            query = np.concatenate([q_nope, q_pe], axis=-1)  # (..., H, L, dq)
            key = np.concatenate([kvh[..., :dn], np.broadcast_to(k_pe_all, lead + (H, T, k_pe.shape[-1]))], axis=-1)
            ctx, attn = K.scaled_dot_product_attention(query, key, kvh[..., dn:], mask, **opts)  # (..., H, L, dv)
            state = _State(False, q_rope, k_rope, attn, None, None)
        if getattr(self, "_want_weights", False):  # indexer_loss reads the main attention's weights
            object.__setattr__(self, "_weights", attn.weights)
        y = self.o_proj._forward(_merge(ctx))
        self.save_for_backward(state)
        return y

    def indexer_loss(self, x, *, reduction: str = "sum"):
        """DeepSeek-V3.2's indexer training step on ``x (..., L, hidden_size)`` (no cache, no
        mask but causality): the KL divergence of the main attention's distribution over each
        query's chosen keys (its weights summed over the heads and normalised, held fixed) to the
        indexer's softmax over the same keys (``npattn.functional.indexer_kl_loss``; DeepSeek's
        sparse training stage), summed over the queries (``reduction="sum"``) or averaged.  The
        indexer's input is detached, as DeepSeek trains it: the gradient reaches the indexer's
        parameters only, added into their ``.grad``; nothing is kept for a backward.

        Backward by hand: ``dI`` from the loss pair, ``(dq, dk, dw)`` from
        ``lightning_indexer_backward``, then ``w = weights_proj(x) / sqrt(H)``, the queries'
        ``q = rope(wq_b(a))`` and the keys' ``k = rope(k_norm(wk(x)))`` backwards (RoPE rotates
        back, the LayerNorm's pair, the projections' weight gradients ``d^T x``).

        Returns
        -------
        float
            The loss.

        Raises
        ------
        ValueError, TypeError
            No indexer (``index_topk`` None); ``x`` of the wrong shape or type; a bad ``reduction``.
        """
        if self.index_topk is None:
            raise ValueError("index_topk: this MultiHeadLatentAttention has no lightning indexer")
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction: expected 'sum' or 'mean', got {reduction!r}")
        x = as_float(x, "x", self.dtype)
        if x.ndim < 2 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected shape (..., L, {self.hidden_size}), got {x.shape}")
        positions = np.arange(x.shape[-2])
        object.__setattr__(self, "_want_weights", True)
        try:
            with no_grad():
                self._forward(x, positions)
        finally:
            object.__setattr__(self, "_want_weights", False)
        attn, chosen = self.__dict__.pop("_weights"), self.__dict__.pop("_chosen")  # (..., H, L, L), (..., L, L)
        ix = self.indexer
        a = K.rms_norm(
            K.linear(x, self.q_a_proj.weight.data, _data(self.q_a_proj.bias))[0],
            self.q_a_layernorm.weight.data,  # type: ignore[union-attr]
            self.rms_norm_eps,
        )[0]
        pos = positions[None, :]
        dr = ix.rope_dim
        k0, lin_k = K.linear(x, ix.wk.weight.data)
        k1, ln = K.layer_norm(k0, ix.k_norm.weight.data, ix.k_norm.bias.data, 1e-6)
        k_rot, k_rope = K.rope(k1[..., None, :, :dr], pos, base=self.rope_theta, scaling=self.rope_scaling)
        q0 = _split(K.linear(a, ix.wq_b.weight.data)[0], ix.num_heads)
        q_rot, q_rope = K.rope(q0[..., :dr], pos, base=self.rope_theta, scaling=self.rope_scaling)
        q = np.concatenate([q_rot, q0[..., dr:]], axis=-1)
        k = np.concatenate([k_rot[..., 0, :, :], k1[..., dr:]], axis=-1)
        w0 = K.linear(x, ix.weights_proj.weight.data)[0]
        scores, icache = lightning_indexer_kernel(q, k, w0 * ix.num_heads**-0.5, ix.head_dim**-0.5)
        loss, kl = indexer_kl_loss_kernel(scores, attn, chosen, reduction)
        dq, dk, dw = lightning_indexer_backward(kl.weight * (kl.has_target * kl.p_index - kl.target), icache)

        def outer(d, inp):  # a projection's weight gradient: sum over tokens of d inp^T
            return d.reshape(-1, d.shape[-1]).T @ inp.reshape(-1, inp.shape[-1])

        dq = np.concatenate([K.rope_backward(dq[..., :dr], q_rope), dq[..., dr:]], axis=-1)
        dk1 = np.concatenate([K.rope_backward(dk[..., None, :, :dr], k_rope)[..., 0, :, :], dk[..., dr:]], axis=-1)
        dk0, dln_w, dln_b = K.layer_norm_backward(dk1, ln)
        for p, g in (
            (ix.wq_b.weight, outer(_merge(dq), a)),
            (ix.wk.weight, K.linear_backward(dk0, lin_k)[1]),
            (ix.k_norm.weight, dln_w),
            (ix.k_norm.bias, dln_b),
            (ix.weights_proj.weight, outer(dw * ix.num_heads**-0.5, x)),
        ):
            self.accumulate_grad(p, g)
        return float(loss)

    def _sparse_mask(self, x, a, positions, mask, use_cache):
        """DeepSeek-V3.2's choice as an attention mask: the indexer's scores of this call's
        queries against every key (the cached tokens' indexer keys and this call's), hidden where
        causality (query ``i`` at ``T + i``) or ``mask`` hides the key (a float mask is added to the
        scores, as transformers does), each query's ``index_topk`` best kept: ``mask`` restricted
        to them, ``(..., 1, L, T + L)`` bool (True = may attend) or float (-inf off the choice);
        and, without a float mask, the chosen positions ``(..., L, K)`` (-1: an empty slot), which
        a cached call's absorbed attention gathers (``sparse_attention``) instead of masking."""
        pos = positions[..., None, :] if positions.ndim else positions

        def rope(t):  # rotate-half, the attention's frequencies and scaling
            return K.rope(t, pos, base=self.rope_theta, interleaved=False, scaling=self.rope_scaling)[0]

        keys = self.indexer.keys(x, rope)  # (..., L, D)
        if use_cache:
            old = self._index_keys
            keys = keys if old is None else np.concatenate([old, keys], axis=-2)
            object.__setattr__(self, "_index_keys", keys)
        scores = self.indexer.scores(x, a, keys, rope)  # (..., L, T)
        lq, lk = scores.shape[-2:]
        visible = np.ones(scores.shape, bool)
        if self.causal:
            visible = np.broadcast_to(np.arange(lk) <= np.arange(lq)[:, None] + (lk - lq), scores.shape)
        if mask is not None:
            if mask.ndim >= 3 and mask.shape[-3] != 1:
                raise ValueError(f"attn_mask: expected one mask for every head (axis -3 of size 1), got {mask.shape}")
            m = mask[..., 0, :, :] if mask.ndim >= 3 else mask
            if m.dtype == bool:
                visible = visible & m
            else:
                scores = scores + m
                visible = visible & np.isfinite(m)
        idx = index_topk_kernel(scores, self.index_topk, np.broadcast_to(visible, scores.shape))
        chosen = np.zeros(scores.shape, bool)
        np.put_along_axis(chosen, np.maximum(idx, 0), True, axis=-1)  # an empty slot (-1) marks key 0 ...
        chosen &= visible  # ... which stays hidden unless the query sees it (then it was chosen anyway)
        if getattr(self, "_want_weights", False):  # indexer_loss's distribution runs over the chosen keys
            object.__setattr__(self, "_chosen", chosen)
        chosen = chosen[..., None, :, :]
        if mask is None or mask.dtype == bool:  # the choice alone says who attends: its indices too
            return (chosen if mask is None else chosen & mask), idx
        return np.where(chosen, mask, -np.inf).astype(mask.dtype), None

    def _expand(self, c, use_cache):
        """``kv_b_proj(c)``; in a cached call the kernel alone (nothing kept, ``kv_b_proj`` untouched)."""
        if use_cache:  # c is a strided view of the cache: one contiguous copy keeps the product on BLAS
            return K.linear(np.ascontiguousarray(c), self.kv_b_proj.weight.data)[0]
        return self.kv_b_proj._forward(c)

    def _absorbed_weights(self):
        """``W_uk (H, dn, r)`` and ``W_uv (H, dv, r)``: the row blocks of ``kv_b_proj.weight`` (views)."""
        W = self.kv_b_proj.weight.data.reshape(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        return W[:, : self.qk_nope_head_dim], W[:, self.qk_nope_head_dim :]

    @staticmethod
    def _latent_kv(c, k_pe):
        """The cache's entry for new tokens: ``[c, k_pe] (..., 1, n, r + dr)`` as the cache's
        "keys" and a zero-width "value" (the values are the keys' first ``r`` features)."""
        new = np.concatenate([c[..., None, :, :], k_pe], axis=-1)
        return new, new[..., :0]

    # -- forward mode ----------------------------------------------------------------------
    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode (``m.jvp(tx, param_tangents=...)``): the forward's chain run on tangents.
        Each submodule's latest state is this call's; RoPE is linear (``rope_jvp`` rotates the
        tangent); the attention core's tangent is ``scaled_dot_product_attention_jvp``.  Absorbed
        form, by the product rule: ``tq_lat = tq_nope W_uk + q_nope tW_uk`` and ``tctx = tctx_lat
        W_uv^T + ctx_lat tW_uv^T``, the shared key's tangent ``[tc, tk_pe]`` and the value's ``tc``."""
        tx = input_tangent(input_tangents, "MultiHeadLatentAttention")
        st: _State = state
        H, dn, r = self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank
        jvp, pt = self._child_jvp, param_tangents
        if self.q_lora_rank is None:
            tq = jvp(self.q_proj, -1, (tx,), pt)
        else:
            ta = jvp(self.q_a_layernorm, -1, (jvp(self.q_a_proj, -1, (tx,), pt),), pt)
            tq = jvp(self.q_b_proj, -1, (ta,), pt)
        tqh = _split(tq, H)
        tq_nope, tq_pe = tqh[..., :dn], K.rope_jvp(st.q_rope, tqh[..., dn:])
        tckv = jvp(self.kv_a_proj_with_mqa, -1, (tx,), pt)
        tc = jvp(self.kv_a_layernorm, -1, (tckv[..., :r],), pt)
        tk_pe = K.rope_jvp(st.k_rope, tckv[..., None, :, r:])  # (..., 1, L, dr)
        if st.absorbed:
            W_uk, W_uv = self._absorbed_weights()
            tW = pt.get(self.kv_b_proj.weight)
            tq_lat = np.matmul(tq_nope, W_uk)
            if tW is not None:
                tW = tW.reshape(W_uk.shape[0], -1, r)
                tq_lat += np.matmul(st.q_nope, tW[:, :dn])
            tfull = np.concatenate([tc[..., None, :, :], tk_pe], axis=-1)
            tquery = np.concatenate([tq_lat, tq_pe], axis=-1)
            tctx_lat = K.scaled_dot_product_attention_jvp(st.attn, tquery, tfull, tfull[..., :r])
            tctx = np.matmul(tctx_lat, W_uv.swapaxes(-1, -2))
            if tW is not None:
                tctx += np.matmul(st.ctx_lat, tW[:, dn:].swapaxes(-1, -2))
        else:
            tkvh = _split(jvp(self.kv_b_proj, -1, (tc,), pt), H)  # (..., H, L, dn + dv)
            tkey = np.concatenate([tkvh[..., :dn], np.broadcast_to(tk_pe, tkvh.shape[:-1] + tk_pe.shape[-1:])], -1)
            tquery = np.concatenate([tq_nope, tq_pe], axis=-1)
            tctx = K.scaled_dot_product_attention_jvp(st.attn, tquery, tkey, tkvh[..., dn:])
        return jvp(self.o_proj, -1, (_merge(tctx),), pt)

    # -- second order ----------------------------------------------------------------------
    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order (``backward_jvp``): the forward's tangents (as ``_jvp``), then the
        backward's chain (as ``_backward``) with each step's tangent: the submodules'
        ``backward_jvp``, ``scaled_dot_product_attention_backward_jvp`` for the core,
        ``rope_backward_jvp`` for the rotations, and in the absorbed form the product rule on
        ``dctx_lat = dctx W_uv``, ``dW_uv = sum dctx^T ctx_lat``, ``dq_nope = dq_lat W_uk^T`` and
        ``dW_uk = sum q_nope^T dq_lat`` (``W_uk``, ``W_uv`` moving with ``kv_b_proj``'s tangent)."""
        tx = input_tangent(input_tangents, "MultiHeadLatentAttention", "backward_jvp")
        st: _State = state
        H, dn = self.num_heads, self.qk_nope_head_dim
        pt = param_tangents
        t = self._second_order_tangents(st, tx, pt)  # the forward's tangents

        def back(m, g, tin):  # a submodule's backward_jvp on (gradient, tangent), its input's tangent
            return self._child_backward_jvp(m, g[0], (tin,), pt, g[1])

        # the backward's chain with its tangents
        dctx, tdctx = (_split(a, H) for a in back(self.o_proj, (dy, ddy), _merge(t.ctx)))
        if st.absorbed:
            dq_nope, dq_pe, tdq_nope, tdq_pe, gc, dk_pe, tdk_pe = self._absorbed_backward_jvp(st, t, dctx, tdctx)
        else:
            (dquery, dkey, dvalue), (tdquery, tdkey, tdvalue) = _core_backward_jvp(dctx, st.attn, t.core, tdctx)
            dq_nope, dq_pe, tdq_nope, tdq_pe = dquery[..., :dn], dquery[..., dn:], tdquery[..., :dn], tdquery[..., dn:]
            gkv = (dkey, dvalue), (tdkey, tdvalue)
            gc = back(self.kv_b_proj, tuple(_merge(np.concatenate([k[..., :dn], v], axis=-1)) for k, v in gkv), t.c)
            dk_pe = dkey[..., dn:].sum(axis=-3, keepdims=True)  # the shared key: summed over heads
            tdk_pe = tdkey[..., dn:].sum(axis=-3, keepdims=True)
        dq_pe, tdq_pe = K.rope_backward_jvp(dq_pe, st.q_rope, (t.q_pe0,), tdq_pe)
        dk_pe, tdk_pe = K.rope_backward_jvp(dk_pe, st.k_rope, (t.k_pe0,), tdk_pe)
        gq = (_merge(np.concatenate([dq_nope, dq_pe], axis=-1)), _merge(np.concatenate([tdq_nope, tdq_pe], axis=-1)))
        if self.q_lora_rank is None:
            gx = back(self.q_proj, gq, tx)
        else:
            gx = back(self.q_a_proj, back(self.q_a_layernorm, back(self.q_b_proj, gq, t.a1), t.a0), tx)
        gc = back(self.kv_a_layernorm, gc, t.c0)
        gk = back(
            self.kv_a_proj_with_mqa,
            (np.concatenate([gc[0], dk_pe[..., 0, :, :]], -1), np.concatenate([gc[1], tdk_pe[..., 0, :, :]], -1)),
            tx,
        )
        self._indexer_zero(second_order=True)
        return gx[0] + gk[0], gx[1] + gk[1]

    def _second_order_tangents(self, st, tx, pt):
        """The forward's tangents that the second-order chain needs, by name: ``a0``, ``a1`` (the
        low-rank query path), ``q_nope``, ``q_pe0`` / ``q_pe`` (before / after RoPE), ``c0`` / ``c``
        (the latent before / after its norm), ``k_pe0`` / ``k_pe``, the core's input tangents
        ``core``, its output's ``ctx`` (and ``ctx_lat`` in the absorbed form), and the tangents
        ``W_uk``, ``W_uv`` of the absorbed weights (None when ``kv_b_proj`` does not move)."""
        H, dn, r = self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank
        t = SimpleNamespace(a0=None, a1=None, ctx_lat=None, W_uk=None, W_uv=None)

        def jvp(m, tin):  # the submodule's tangent from its state of this call
            return self._child_jvp(m, -1, (tin,), pt)

        if self.q_lora_rank is None:
            tq = jvp(self.q_proj, tx)
        else:
            t.a0 = jvp(self.q_a_proj, tx)
            t.a1 = jvp(self.q_a_layernorm, t.a0)
            tq = jvp(self.q_b_proj, t.a1)
        tqh = _split(tq, H)
        t.q_nope, t.q_pe0 = tqh[..., :dn], tqh[..., dn:]
        t.q_pe = K.rope_jvp(st.q_rope, t.q_pe0)
        tckv = jvp(self.kv_a_proj_with_mqa, tx)
        t.c0, t.k_pe0 = tckv[..., :r], tckv[..., None, :, r:]
        t.c = jvp(self.kv_a_layernorm, t.c0)
        t.k_pe = K.rope_jvp(st.k_rope, t.k_pe0)  # (..., 1, L, dr)
        if st.absorbed:
            W_uk, W_uv = self._absorbed_weights()
            tW = pt.get(self.kv_b_proj.weight)
            if tW is not None:
                tW = tW.reshape(H, -1, r)
                t.W_uk, t.W_uv = tW[:, :dn], tW[:, dn:]
            tq_lat = np.matmul(t.q_nope, W_uk)
            if t.W_uk is not None:
                tq_lat += np.matmul(st.q_nope, t.W_uk)
            tfull = np.concatenate([t.c[..., None, :, :], t.k_pe], axis=-1)
            t.core = (np.concatenate([tq_lat, t.q_pe], axis=-1), tfull, tfull[..., :r])
            t.ctx_lat = K.scaled_dot_product_attention_jvp(st.attn, *t.core)
            t.ctx = np.matmul(t.ctx_lat, W_uv.swapaxes(-1, -2))
            if t.W_uv is not None:
                t.ctx += np.matmul(st.ctx_lat, t.W_uv.swapaxes(-1, -2))
        else:
            tkvh = _split(jvp(self.kv_b_proj, t.c), H)  # (..., H, L, dn + dv)
            tkey = np.concatenate([tkvh[..., :dn], np.broadcast_to(t.k_pe, tkvh.shape[:-1] + t.k_pe.shape[-1:])], -1)
            t.core = (np.concatenate([t.q_nope, t.q_pe], axis=-1), tkey, tkvh[..., dn:])
            t.ctx = K.scaled_dot_product_attention_jvp(st.attn, *t.core)
        return t

    def _absorbed_backward_jvp(self, st, t, dctx, tdctx):
        """The absorbed form's core step of the second-order chain: ``dctx`` and its tangent
        through ``W_uv``, the attention core, and ``W_uk`` (each product by the product rule), with
        ``kv_b_proj``'s gradient and its tangent accumulated.  Returns ``(dq_nope, dq_pe,
        tdq_nope, tdq_pe, gc, dk_pe, tdk_pe)``, ``gc`` the latent's (gradient, tangent)."""
        r = self.kv_lora_rank
        W_uk, W_uv = self._absorbed_weights()
        lead_axes = tuple(range(dctx.ndim - 3))
        dctx_lat, tdctx_lat = np.matmul(dctx, W_uv), np.matmul(tdctx, W_uv)
        dW_uv = np.matmul(dctx.swapaxes(-1, -2), st.ctx_lat).sum(axis=lead_axes)
        tdW_uv = np.matmul(tdctx.swapaxes(-1, -2), st.ctx_lat) + np.matmul(dctx.swapaxes(-1, -2), t.ctx_lat)
        tdW_uv = tdW_uv.sum(axis=lead_axes)
        if t.W_uv is not None:
            tdctx_lat += np.matmul(dctx, t.W_uv)
        (dquery, dkey, dvalue), (tdquery, tdkey, tdvalue) = _core_backward_jvp(dctx_lat, st.attn, t.core, tdctx_lat)
        dq_lat, dq_pe, tdq_lat, tdq_pe = dquery[..., :r], dquery[..., r:], tdquery[..., :r], tdquery[..., r:]
        dq_nope = np.matmul(dq_lat, W_uk.swapaxes(-1, -2))
        tdq_nope = np.matmul(tdq_lat, W_uk.swapaxes(-1, -2))
        if t.W_uk is not None:
            tdq_nope += np.matmul(dq_lat, t.W_uk.swapaxes(-1, -2))
        dW_uk = np.matmul(st.q_nope.swapaxes(-1, -2), dq_lat).sum(axis=lead_axes)
        tdW_uk = np.matmul(t.q_nope.swapaxes(-1, -2), dq_lat) + np.matmul(st.q_nope.swapaxes(-1, -2), tdq_lat)
        tdW_uk = tdW_uk.sum(axis=lead_axes)
        dW = np.concatenate([dW_uk, dW_uv], axis=1).reshape(-1, r)
        tdW = np.concatenate([tdW_uk, tdW_uv], axis=1).reshape(-1, r)
        self._accumulate_second(((self.kv_b_proj.weight, dW, tdW),))
        gc = (dkey[..., 0, :, :r] + dvalue[..., 0, :, :], tdkey[..., 0, :, :r] + tdvalue[..., 0, :, :])
        return dq_nope, dq_pe, tdq_nope, tdq_pe, gc, dkey[..., r:], tdkey[..., r:]

    # -- backward --------------------------------------------------------------------------
    def backward(self, dy):
        """Gradient with respect to ``x``; every parameter's gradient is added into its ``.grad``.

        Raises
        ------
        RuntimeError
            No forward state (none yet, already used, or a ``use_cache`` / ``no_grad`` forward).
        TypeError, ValueError
            ``dy`` not numeric or not of the output's shape.
        """
        return self._backward(self._check_dy(dy))

    def _backward(self, dy):
        """``backward`` on a checked ``dy``.

        Plain form: the attention backward gives ``dquery = [dq_nope, dq_pe]``, ``dkey = [dk_nope,
        dk_pe]`` and ``dvalue`` per head.  ``[dk_nope, dvalue]`` is the gradient of ``kv_b_proj``'s
        output.  The rotated key is one vector per token broadcast to every head, so its gradient is
        the sum over heads (a broadcast's adjoint is a sum).

        Absorbed form: ``ctx[h] = ctx_lat[h] W_uv[h]^T`` gives ``dctx_lat[h] = dctx[h] W_uv[h]`` and
        ``dW_uv[h] = sum_l dctx[h, l]^T ctx_lat[h, l]``; ``q_lat[h] = q_nope[h] W_uk[h]`` gives
        ``dq_nope[h] = dq_lat[h] W_uk[h]^T`` and ``dW_uk[h] = sum_l q_nope[h, l]^T dq_lat[h, l]``.  The
        attention backward already sums the shared key's and value's gradients over the heads
        (multi-query); the latent is both the key's first ``r`` features and the value, so
        ``dc = dkey[:r] + dvalue``.

        Both: RoPE is a fixed rotation, its backward rotates back; the latent passes back through
        ``kv_a_layernorm``; ``[dc, dk_pe]`` is the gradient of ``kv_a_proj_with_mqa``'s output; ``dx``
        sums the query path's and the latent path's input gradients.
        """
        st: _State = self.pop_saved()
        H, dn, r = self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank
        dctx = _split(self.o_proj._backward(dy), H)  # (..., H, L, dv)
        if st.absorbed:
            W_uk, W_uv = self._absorbed_weights()
            lead_axes = tuple(range(dctx.ndim - 3))
            dctx_lat = np.matmul(dctx, W_uv)  # (..., H, L, dv) @ (H, dv, r)
            dW_uv = np.matmul(dctx.swapaxes(-1, -2), st.ctx_lat).sum(axis=lead_axes)  # (H, dv, r)
            dquery, dkey, dvalue = K.scaled_dot_product_attention_backward(dctx_lat, st.attn)[:3]
            dq_lat, dq_pe = dquery[..., :r], dquery[..., r:]
            dq_nope = np.matmul(dq_lat, W_uk.swapaxes(-1, -2))  # (..., H, L, r) @ (H, r, dn)
            dW_uk = np.matmul(st.q_nope.swapaxes(-1, -2), dq_lat).sum(axis=lead_axes)  # (H, dn, r)
            self.accumulate_grad(self.kv_b_proj.weight, np.concatenate([dW_uk, dW_uv], axis=1).reshape(-1, r))
            dc = dkey[..., 0, :, :r] + dvalue[..., 0, :, :]  # (..., L, r)
            dk_pe = dkey[..., r:]  # (..., 1, L, dr)
        else:
            dquery, dkey, dvalue = K.scaled_dot_product_attention_backward(dctx, st.attn)[:3]
            dq_nope, dq_pe = dquery[..., :dn], dquery[..., dn:]
            dc = self.kv_b_proj._backward(_merge(np.concatenate([dkey[..., :dn], dvalue], axis=-1)))
            dk_pe = dkey[..., dn:].sum(axis=-3, keepdims=True)  # the shared key: summed over heads
        dq_pe = K.rope_backward(dq_pe, st.q_rope)
        dk_pe = K.rope_backward(dk_pe, st.k_rope)[..., 0, :, :]  # (..., L, dr)
        dq = _merge(np.concatenate([dq_nope, dq_pe], axis=-1))  # (..., L, H dq)
        if self.q_lora_rank is None:
            dx = self.q_proj._backward(dq)
        else:
            dx = self.q_a_proj._backward(self.q_a_layernorm._backward(self.q_b_proj._backward(dq)))
        dc = self.kv_a_layernorm._backward(dc)
        dx += self.kv_a_proj_with_mqa._backward(np.concatenate([dc, dk_pe], axis=-1))
        self._indexer_zero()
        return dx

    def _indexer_zero(self, second_order: bool = False) -> None:
        """The indexer's share of a backward (and of a ``backward_jvp``: ``second_order``): the
        choice of keys is piecewise constant, so its parameters get a zero gradient (and a zero
        gradient tangent), as under transformers' ``no_grad`` indexer."""
        if self.index_topk is not None:
            for p in self.indexer.parameters():
                self.accumulate_grad(p, np.zeros_like(p.data))
                if second_order:
                    self.accumulate_grad_tangent(p, np.zeros_like(p.data))
