"""``MultiHeadAttention``: the public multi-head attention module, ``MultiHeadAttentionCore`` plus
torch's compatibility extras.

Why two classes: the common path every model uses (projections, RoPE and QK-norm, the attention
core with its options, the output gate, the KV cache) lives in ``nn/attention_core.py`` as four
named stages, readable without torch's special cases.  ``torch.nn.MultiheadAttention``'s extras
live here, apart: ``add_bias_kv`` and ``add_zero_attn`` (keys appended after the real ones, with
their mask columns and positional mask, their gradients, tangents and second order), ``need_weights`` /
``average_attn_weights`` and ``from_torch_state_dict``.  They override exactly one stage of the
core, ``attend`` (with its backward and JVP), and the edge (``forward``, ``__init__``).

``npattn.MultiHeadAttention`` is this class, so its public constructor, ``forward`` and
``from_torch_state_dict`` keep every argument of the contract; npattn's own models may build the
core alone.  (A ``TorchMultiheadAttention(MultiHeadAttention)`` subclass would have had to take
the extras away from the public name, which the contract forbids; a factory or ``__new__``
dispatch would hide which class one gets.)  ``kdim``/``vdim`` stay in the core: they are
cross-attention's input widths (``DecoderBlock``'s memory), two widths of ``W_key``/``W_value``,
not a torch special case.
"""

from __future__ import annotations

import math
from typing import cast

import numpy as np

from .. import masks as _masks
from .._validate import check_bool, check_dtype, to_numpy
from ..functional import AttentionCache
from ..functional._blocks import band, band_hidden
from .attention_core import MultiHeadAttentionCore, State
from .module import Parameter

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(MultiHeadAttentionCore):
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
      ``dynamic``, ``ntk_alpha``, ``yarn``, ``llama3``, ``longrope``; see ``npattn.functional.rope_frequencies``), its
      ``rope_theta`` the base when given (``rope_base`` left at its default or equal);
      ``partial_rotary_factor``: only the first ``int(head_dim * factor)`` features of each head
      rotate (Qwen3-Next); ``rope_interleaved``: pairs ``(2i, 2i+1)`` instead of rotate-half.
      A per-layer base (Gemma 3's local/global) is just ``rope_base`` per module.  With
      ``"dynamic"`` the frequencies follow the largest position of each call, so cached decoding
      past ``max_position_embeddings`` differs from one full pass (the cached keys keep the
      rotation of their call), exactly as in Hugging Face's models; so does ``"longrope"``'s
      decoding across ``original_max_position_embeddings`` (``CausalLM.generate`` then encodes
      the sequence again, as transformers' Phi-3 generate).
    - ``qk_norm_eps``: the QK-norm's eps (default ``RMSNorm``'s: the dtype's machine epsilon);
      ``qk_norm_unit_offset=True``: ``x_norm * (1 + weight)`` with the weight zeros at start
      (Gemma 3's and Qwen3-Next's RMSNorm; the state dict holds that weight as they do);
      ``qk_norm_scope="all_heads"``: one RMSNorm over all heads' features of a token instead of
      each head's (OLMo 2/3's ``q_norm``/``k_norm`` over the whole projection, weights
      ``(num_heads * head_dim,)`` and ``(num_kv_heads * head_dim,)``); ``qk_norm_scope="each_head"``:
      a LayerNorm (mean subtracted, no bias, eps ``qk_norm_eps`` or 1e-5) over each head's
      features, each head with its own weight row (``q_norm``/``k_norm`` weights
      ``(num_heads, head_dim)`` and ``(num_kv_heads, head_dim)``: Command R+'s ``use_qk_norm``).
      ``qk_norm_after_rope=True``: RoPE first, then the QK-norm of the rotated heads (Hunyuan's
      dense models' order; the default normalises, then rotates, as Qwen3 and the others do).
    - ``output_gate=True`` (Qwen3-Next's gated attention): ``W_query`` is
      ``(2 * num_heads * head_dim, d_in)``, each head's ``2 head_dim`` outputs its query then its
      gate ``g``; the attention output (heads merged) is multiplied by ``sigmoid(g)`` before
      ``out_proj``.  Backward: with ``a`` the attention output and ``s = sigmoid(g)``,
      ``d a = d(a s) * s`` and ``d g = d(a s) * a * s (1 - s)`` (``s' = s (1 - s)``).
    - GPT-OSS: ``qkv_bias=True, out_bias=True, sinks=True``, a ``window``, ``rope_scaling`` yarn.
    - ``query_scale_by_position=(beta, length)``: the query at position ``p`` (after RoPE) is
      multiplied by ``1 + beta * log(1 + floor(p / length))``, a constant per position that grows
      past each multiple of ``length`` (Ministral 3's ``llama_4_scaling_beta`` with its YaRN
      ``original_max_position_embeddings``, the attention temperature tuning of Llama 4, which
      counts positions from 1); the positions are those of RoPE (the KV cache's offset, or
      ``positions``), the backward, JVP and second order multiply by the same factors.
    - ``qkv_clip``: q, k and v clamped to ``[-qkv_clip, qkv_clip]`` after the projections (and
      after a QK-norm that comes before RoPE), right before RoPE (OLMo's and OLMoE's ``clip_qkv``;
      ``functional.clamp``): the gradient, tangent and second order pass where an entry lies within
      the bounds (the bounds included, as torch's ``clamp``) and are 0 where the clamp held it.

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

    _REPR_FLAGS = ("add_bias_kv", "add_zero_attn") + MultiHeadAttentionCore._REPR_FLAGS

    _TORCH_EXTRAS = True

    # The constructor is the core's (one signature for both classes); this hook adds torch's keys.
    def _init_extra_keys(self, add_bias_kv: bool, add_zero_attn: bool) -> None:
        """``bias_k``/``bias_v`` (``add_bias_kv``) and the count of keys appended after the real ones."""
        self.add_bias_kv, self.add_zero_attn = add_bias_kv, add_zero_attn
        self._n_extra = int(add_bias_kv) + int(add_zero_attn)  # keys appended after the real ones
        if add_bias_kv:  # torch: xavier_normal_ on (1, 1, kv), std sqrt(2 / (kv + kv)); drawn after out_proj
            kv = self.num_kv_heads * self.head_dim
            std = math.sqrt(1.0 / kv)
            self.bias_k = Parameter(self.rng.normal(0.0, std, (1, 1, kv)), self._dtype)
            self.bias_v = Parameter(self.rng.normal(0.0, std, (1, 1, kv)), self._dtype)
            if self.sinks is not None:  # registered again: after bias_k, bias_v, as in the state dict's order
                self.sinks = self.sinks

    # -- the edge: need_weights ------------------------------------------------------------------
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
        positions=None,
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
        need_weights = check_bool(need_weights, "need_weights")
        average = check_bool(average_attn_weights, "average_attn_weights")
        if need_weights and self.memory_efficient:
            raise ValueError("need_weights: memory_efficient attention never forms the weights; expected False")
        x, key, value, mask, use_cache = self._check_call(query, key, value, attn_mask, key_padding_mask, use_cache)
        positions = self._check_positions(positions, x)
        return self._forward(
            x,
            key,
            value,
            mask,
            need_weights=need_weights,
            average_attn_weights=average,
            use_cache=use_cache,
            positions=positions,
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
        positions=None,
    ):
        """``forward`` on validated arguments (see ``MultiHeadAttentionCore._forward``)."""
        out, state = self._run(x, key, value, mask, use_cache, positions, weights=need_weights)
        if not need_weights:
            return out
        return out, self._weights(state, average_attn_weights)

    @staticmethod
    def _weights(st: State, average: bool) -> np.ndarray:
        """The attention weights of a forward (after dropout), zero over a rolling cache's
        dropped keys, averaged over the heads when ``average``."""
        c = cast(AttentionCache, st.attn)  # need_weights is refused with memory_efficient
        weights = c.weights.copy() if c.keep is None else c.weights * c.keep * c.drop_scale
        if st.dropped:
            weights = np.concatenate([np.zeros(weights.shape[:-1] + (st.dropped,), weights.dtype), weights], axis=-1)
        return weights.mean(axis=-3) if average else weights

    # -- the attend stage with torch's extra keys -------------------------------------------------
    def _attend(self, qh, kh, vh, mask, align, ws):
        """The core's ``attend``; with ``add_bias_kv``/``add_zero_attn`` the extra keys follow the
        real ones, visible to every query and carrying no position: causal, window and ALiBi
        become an explicit mask over the real keys, padded with a visible column per extra key."""
        n_extra = self._n_extra
        if not n_extra:
            return super()._attend(qh, kh, vh, mask, align, ws)
        lq, lk = qh.shape[-2], kh.shape[-2]
        kh, vh = self._with_extra_keys(kh, vh, kh.shape[:-3])
        if self.causal or self.window is not None or self.alibi:
            mask = _masks.combine(mask, self._positional_mask(lq, lk, align or self.causal_align))
        if mask is not None:  # a visible column for each extra key
            mask = np.broadcast_to(mask, mask.shape[:-1] + (lk,))
            pad = np.broadcast_to(np.array(True if mask.dtype == bool else 0, mask.dtype), mask.shape[:-1] + (n_extra,))
            mask = np.concatenate([mask, pad], axis=-1)
        opts = self._call_options(None)
        opts.update(causal_align="top_left", window=None, alibi_slopes=None)  # all in the mask now
        return self._core(qh, kh, vh, mask, False, opts, ws)

    def _positional_mask(self, lq, lk, align):
        """causal, window and ALiBi over the real keys as one explicit mask (used when extra keys
        follow them, which must stay visible and carry no position): bool ``(Lq, Lk)`` True = may
        attend, or float ``(num_heads, Lq, Lk)`` with ALiBi's bias and ``-inf`` where hidden."""
        b = band(lq, lk, self.causal, align, self.window)  # the cores' band of visible keys
        hidden = band_hidden(b, 0, lk, 0, lq)  # key-major (Lk, Lq), None: nothing hidden
        allowed = np.ones((lq, lk), bool) if hidden is None else ~hidden.T
        if not self.alibi:
            return allowed
        p, j = np.arange(lq)[:, None] + b.offset, np.arange(lk)[None, :]
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

    def _attend_backward(self, dctx, st: State, out, ws):
        """The core's, then ``bias_k``/``bias_v``'s gradients (the keys at position ``lk``, broadcast
        over the batch) and the extra keys' rows dropped."""
        dqh, dkh, dvh = super()._attend_backward(dctx, st, out, ws)
        if not st.n_extra:
            return dqh, dkh, dvh
        lk = st.lk
        if self.add_bias_kv:
            self.accumulate_grad(self.bias_k, self._extra_key_grad(dkh, lk))
            self.accumulate_grad(self.bias_v, self._extra_key_grad(dvh, lk))
        return dqh, dkh[..., :lk, :], dvh[..., :lk, :]

    def _extra_key_grad(self, d, lk: int):
        """``bias_k``'s (or ``bias_v``'s) share of a key (value) gradient ``d (..., Hk, Lk', hd)``:
        the row at position ``lk``, summed over the batch, shaped ``(1, 1, kv)``."""
        lead_axes = tuple(range(d.ndim - 3))
        return self._merge(d[..., lk : lk + 1, :]).sum(axis=lead_axes).reshape(1, 1, self.num_kv_heads * self.head_dim)

    def _extra_key_tangents(self, st: State, tkh, tvh, pt):
        """The keys' and values' tangents with the extra keys' appended as in ``_with_extra_keys``
        (``bias_k``/``bias_v``'s move with their tangents, the zero key's do not)."""
        lead, dt = tkh.shape[:-3], st.out.x.dtype
        shape = lead + (self.num_kv_heads, 1, self.head_dim)
        tks, tvs = [tkh], [tvh]
        extra: list[tuple[Parameter | None, Parameter | None]] = []
        extra += [(self.bias_k, self.bias_v)] if self.add_bias_kv else []
        extra += [(None, None)] if self.add_zero_attn else []
        for pk, pv in extra:
            for out, p in ((tks, pk), (tvs, pv)):
                t = pt.get(p)
                out.append(np.zeros(shape, dt) if t is None else np.broadcast_to(t.reshape(shape[-3:]), shape))
        return np.concatenate(tks, axis=-2), np.concatenate(tvs, axis=-2)

    def _attend_jvp(self, st: State, tqh, tkh, tvh, pt, weights=None):
        """The core's, after the extra keys' tangents are appended (``_extra_key_tangents``)."""
        if st.n_extra:
            tkh, tvh = self._extra_key_tangents(st, tkh, tvh, pt)
        return super()._attend_jvp(st, tqh, tkh, tvh, pt, weights)

    def _attend_backward_jvp(self, dctx, tdctx, st: State, tangents, pt, weights=None, out=None):
        """The core's second order with the extra keys' tangents appended; ``bias_k``/``bias_v``'s
        gradients and their tangents (the rows at ``lk``) accumulated, the extra keys' rows dropped."""
        tqh, tkh, tvh = tangents
        if not st.n_extra:
            return super()._attend_backward_jvp(dctx, tdctx, st, tangents, pt, weights, out)
        tkh, tvh = self._extra_key_tangents(st, tkh, tvh, pt)
        (dqh, dkh, dvh), (tdqh, tdkh, tdvh) = super()._attend_backward_jvp(
            dctx, tdctx, st, (tqh, tkh, tvh), pt, weights
        )
        lk = st.lk
        if self.add_bias_kv:
            self._accumulate_second(
                (
                    (self.bias_k, self._extra_key_grad(dkh, lk), self._extra_key_grad(tdkh, lk)),
                    (self.bias_v, self._extra_key_grad(dvh, lk), self._extra_key_grad(tdvh, lk)),
                )
            )
        cut = (..., slice(None, lk), slice(None))
        return (dqh, dkh[cut], dvh[cut]), (tdqh, tdkh[cut], tdvh[cut])

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
