"""``MultiHeadAttention``: projections, heads, masks, dropout and grouped-query attention over the
functional ``linear`` and ``scaled_dot_product_attention`` pairs."""
from __future__ import annotations

import numpy as np

from .. import functional as F
from .. import masks as _masks
from .._validate import (as_float, as_rng, check_bool, check_dtype, check_mask, check_prob, check_size,
                        to_numpy)
from ..functional import kernels as K
from .layers import Linear
from .module import Module

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(Module):
    """Multi-head attention, batch first: ``(..., L, d_in) -> (..., L, d_out)``.

    ``d_out`` is split into ``num_heads`` heads of ``d_out // num_heads``; with ``num_kv_heads``
    smaller than ``num_heads`` (and dividing it) the key/value projections have
    ``num_kv_heads`` heads each shared by ``num_heads // num_kv_heads`` query heads
    (grouped-query attention).  ``kdim``/``vdim`` are the key/value input widths for
    cross-attention (default ``d_in``).  ``dropout`` acts on the attention weights in training.

    Masks (see ``npattn.masks``): ``attn_mask`` bool **True = may attend** (the polarity of
    ``torch.nn.functional.scaled_dot_product_attention``; note ``torch.nn.MultiheadAttention``
    uses the opposite) or float (added to the scaled scores), broadcastable to
    ``(..., num_heads, Lq, Lk)``; torch's ``(batch * num_heads, Lq, Lk)`` layout is accepted too.
    ``key_padding_mask`` ``(..., Lk)``: **True = padding** (ignored key), or float additive.
    ``causal=True`` masks future keys (top-left aligned).

    With ``memory_efficient=True`` the attention core is ``memory_efficient_attention`` (no
    ``(Lq, Lk)`` array held; no attention dropout, no ``need_weights``).
    """

    def __init__(self, d_in, d_out, num_heads, *, dropout=0.0, qkv_bias=False, out_bias=True, causal=False,
                 num_kv_heads=None, kdim=None, vdim=None, memory_efficient=False, rng=None, dtype=np.float64):
        super().__init__()
        self.d_in = check_size(d_in, "d_in")
        self.d_out = check_size(d_out, "d_out")
        self.num_heads = check_size(num_heads, "num_heads")
        if self.d_out % self.num_heads:
            raise ValueError(f"d_out: expected a multiple of num_heads={self.num_heads}, got {self.d_out}")
        self.num_kv_heads = self.num_heads if num_kv_heads is None else check_size(num_kv_heads, "num_kv_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: expected a divisor of num_heads={self.num_heads}, got {self.num_kv_heads}"
            )
        self.kdim = self.d_in if kdim is None else check_size(kdim, "kdim")
        self.vdim = self.d_in if vdim is None else check_size(vdim, "vdim")
        self.head_dim = self.d_out // self.num_heads
        self.dropout = check_prob(dropout, "dropout")
        self.causal = check_bool(causal, "causal")
        self.memory_efficient = check_bool(memory_efficient, "memory_efficient")
        if self.memory_efficient and self.dropout > 0:
            raise ValueError(
                f"dropout: memory_efficient attention has no attention dropout; expected 0.0, got {self.dropout}"
            )
        qkv_bias = check_bool(qkv_bias, "qkv_bias")
        out_bias = check_bool(out_bias, "out_bias")
        self._dtype = check_dtype(dtype)
        self.rng = as_rng(rng)
        kv = self.num_kv_heads * self.head_dim
        self.W_query = Linear(self.d_in, self.d_out, qkv_bias, rng=self.rng, dtype=dtype)
        self.W_key = Linear(self.kdim, kv, qkv_bias, rng=self.rng, dtype=dtype)
        self.W_value = Linear(self.vdim, kv, qkv_bias, rng=self.rng, dtype=dtype)
        self.out_proj = Linear(self.d_out, self.d_out, out_bias, rng=self.rng, dtype=dtype)

    def extra_repr(self):
        s = f"d_in={self.d_in}, d_out={self.d_out}, num_heads={self.num_heads}"
        if self.num_kv_heads != self.num_heads:
            s += f", num_kv_heads={self.num_kv_heads}"
        if self.causal:
            s += ", causal=True"
        if self.dropout:
            s += f", dropout={self.dropout}"
        return s

    # -- helpers ---------------------------------------------------------------------------
    def _split(self, t, heads):
        """``(..., L, heads * hd) -> (..., heads, L, hd)`` (a view)."""
        return t.reshape(t.shape[:-1] + (heads, self.head_dim)).swapaxes(-2, -3)

    @staticmethod
    def _merge(t):
        """``(..., heads, L, hd) -> (..., L, heads * hd)``."""
        t = t.swapaxes(-2, -3)
        return t.reshape(t.shape[:-2] + (t.shape[-2] * t.shape[-1],))

    def _check_inputs(self, query, key, value):
        x = as_float(query, "query", self.dtype)
        if x.ndim < 2 or x.shape[-1] != self.d_in:
            raise ValueError(f"query: expected shape (..., L, {self.d_in}), got {x.shape}")
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

    def _build_mask(self, attn_mask, key_padding_mask, lead, lq, lk):
        target = lead + (self.num_heads, lq, lk)
        mask = None
        if attn_mask is not None:
            m = to_numpy(attn_mask, "attn_mask")
            if (m.ndim == 3 and len(lead) == 1 and m.shape == (lead[0] * self.num_heads, lq, lk)
                    and m.shape[0] != self.num_heads):
                m = m.reshape(target)  # torch's (batch * num_heads, Lq, Lk)
            mask = check_mask(m, "attn_mask", target)
        if key_padding_mask is not None:
            kpm = to_numpy(key_padding_mask, "key_padding_mask")
            if kpm.dtype.kind not in "bf":
                raise TypeError(
                    f"key_padding_mask: expected bool (True = padding) or float, got dtype {kpm.dtype}"
                )
            if kpm.shape != lead + (lk,):
                raise ValueError(f"key_padding_mask: expected shape {lead + (lk,)}, got {kpm.shape}")
            mask = _masks.combine(mask, _masks.from_key_padding_mask(kpm))
        if mask is not None and mask.dtype.kind == "f" and mask.dtype != self.dtype:
            mask = mask.astype(self.dtype)  # a float64 mask keeps a float32 module float32 (caches included)
        return mask

    # -- forward / backward ----------------------------------------------------------------
    def forward(self, query, key=None, value=None, *, attn_mask=None, key_padding_mask=None, need_weights=False):
        """Returns ``(..., Lq, d_out)``, or ``(out, weights)`` with per-head ``weights``
        ``(..., num_heads, Lq, Lk)`` (after dropout, as torch) when ``need_weights``."""
        x, k_in, v_in, self_attn = self._check_inputs(query, key, value)
        need_weights = check_bool(need_weights, "need_weights")
        if need_weights and self.memory_efficient:
            raise ValueError("need_weights: memory_efficient attention never forms the weights; expected False")
        lead, lq, lk = x.shape[:-2], x.shape[-2], k_in.shape[-2]
        mask = self._build_mask(attn_mask, key_padding_mask, lead, lq, lk)
        Wq, Wk, Wv = self.W_query, self.W_key, self.W_value
        dq_, dkv = self.d_out, self.num_kv_heads * self.head_dim
        if self_attn:  # one fused GEMM for q, k and v
            W = np.concatenate([Wq.weight.data, Wk.weight.data, Wv.weight.data])
            b = None if Wq.bias is None else np.concatenate([Wq.bias.data, Wk.bias.data, Wv.bias.data])
            qkv, proj_cache = F.linear(x, W, b)
            q, k, v = qkv[..., :dq_], qkv[..., dq_:dq_ + dkv], qkv[..., dq_ + dkv:]
        else:
            (q, cq), (k, ck), (v, cv) = (F.linear(a, m.weight.data, None if m.bias is None else m.bias.data)
                                         for a, m in ((x, Wq), (k_in, Wk), (v_in, Wv)))
            proj_cache = (cq, ck, cv)
        qh, kh, vh = self._split(q, self.num_heads), self._split(k, self.num_kv_heads), self._split(v, self.num_kv_heads)
        if self.memory_efficient:
            groups = self.num_heads // self.num_kv_heads
            if groups > 1:
                kh, vh = np.repeat(kh, groups, axis=-3), np.repeat(vh, groups, axis=-3)
            ctx, attn_cache = F.memory_efficient_attention(qh, kh, vh, attn_mask=mask, is_causal=self.causal)
        else:
            p = self.dropout if self.training else 0.0
            ctx, attn_cache = K.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=mask, is_causal=self.causal, dropout_p=p, rng=self.rng,
                enable_gqa=self.num_kv_heads != self.num_heads, heads_last=True)
        out, out_cache = F.linear(self._merge(ctx), self.out_proj.weight.data,
                                  None if self.out_proj.bias is None else self.out_proj.bias.data)
        self._save((self_attn, proj_cache, attn_cache, out_cache))
        if not need_weights:
            return out
        c = attn_cache
        weights = c.weights.copy() if c.keep is None else c.weights * c.keep * c.drop_scale
        return out, weights

    def backward(self, dy):
        """Through ``out_proj``, the attention core and the projections.  Returns ``dx`` for
        self-attention (the sum over the input's three uses), else ``(dquery, dkey, dvalue)``."""
        dy = self._check_dy(dy)
        self_attn, proj_cache, attn_cache, out_cache = self._pop()
        dctx, dwo, dbo = F.linear_backward(dy, out_cache)
        self._accumulate(self.out_proj.weight, dwo)
        if self.out_proj.bias is not None:
            self._accumulate(self.out_proj.bias, dbo)
        dctx = self._split(dctx, self.num_heads)
        if self.memory_efficient:
            dqh, dkh, dvh = F.memory_efficient_attention_backward(dctx, attn_cache)
            groups = self.num_heads // self.num_kv_heads
            if groups > 1:  # undo the repeat: sum over the query heads sharing a kv head
                s = dkh.shape
                dkh = dkh.reshape(s[:-3] + (self.num_kv_heads, groups) + s[-2:]).sum(axis=-3)
                dvh = dvh.reshape(s[:-3] + (self.num_kv_heads, groups) + dvh.shape[-2:]).sum(axis=-3)
        elif self_attn:
            # the attention backward writes dq, dk, dv straight into one (..., L, d_q + 2 d_kv)
            # buffer, the gradient of the fused q/k/v projection's output (no concatenate)
            dq_, dkv = self.d_out, self.num_kv_heads * self.head_dim
            dqkv = np.empty(dy.shape[:-1] + (dq_ + 2 * dkv,), dy.dtype)
            views = (self._split(dqkv[..., :dq_], self.num_heads), self._split(dqkv[..., dq_:dq_ + dkv], self.num_kv_heads),
                     self._split(dqkv[..., dq_ + dkv:], self.num_kv_heads))
            K.scaled_dot_product_attention_backward(dctx, attn_cache, out=views)
        else:
            dqh, dkh, dvh = F.scaled_dot_product_attention_backward(dctx, attn_cache)
        mods = (self.W_query, self.W_key, self.W_value)
        if self_attn:
            if self.memory_efficient:
                dqkv = np.concatenate([self._merge(dqh), self._merge(dkh), self._merge(dvh)], axis=-1)
            dx, dW, db = F.linear_backward(dqkv, proj_cache)
            splits = np.cumsum([m.out_features for m in mods])[:-1]
            for m, dw_i, db_i in zip(mods, np.split(dW, splits), np.split(db, splits) if db is not None else (None,) * 3):
                self._accumulate(m.weight, dw_i)
                if m.bias is not None:
                    self._accumulate(m.bias, db_i)
            return dx
        grads = []
        for m, d, c in zip(mods, (self._merge(dqh), self._merge(dkh), self._merge(dvh)), proj_cache):
            dx_i, dw_i, db_i = F.linear_backward(d, c)
            self._accumulate(m.weight, dw_i)
            if m.bias is not None:
                self._accumulate(m.bias, db_i)
            grads.append(dx_i)
        return tuple(grads)

    # -- interop ---------------------------------------------------------------------------
    @classmethod
    def from_torch_state_dict(cls, state_dict, num_heads, **kwargs):
        """Build from the ``state_dict`` of ``torch.nn.MultiheadAttention`` (``batch_first=True``
        gives the same outputs).  Packed ``in_proj_weight`` ``[q; k; v]`` or separate
        ``q_proj_weight``/``k_proj_weight``/``v_proj_weight``; ``in_proj_bias``; ``out_proj.*``.
        ``bias_k``/``bias_v`` are not supported.  Remember that torch's bool ``attn_mask`` means
        True = *masked*; npattn's means True = may attend (pass ``~mask``)."""
        if not hasattr(state_dict, "items"):
            raise TypeError(f"state_dict: expected a mapping of names to arrays, got {type(state_dict).__name__}")
        sd = {k: to_numpy(v, f"state_dict[{k!r}]") for k, v in state_dict.items()}
        for key in ("bias_k", "bias_v"):
            if key in sd:
                raise ValueError(f"state_dict: {key!r} (add_bias_kv=True) is not supported")
        if "out_proj.weight" not in sd:
            raise ValueError(f"state_dict: expected key 'out_proj.weight', got keys {sorted(sd)}")
        if sd["out_proj.weight"].ndim != 2:
            raise ValueError(f"state_dict: expected 'out_proj.weight' of shape (E, E), got {sd['out_proj.weight'].shape}")
        E = sd["out_proj.weight"].shape[0]
        if "in_proj_weight" in sd:
            w = sd["in_proj_weight"]
            if w.shape != (3 * E, E):
                raise ValueError(f"state_dict: expected 'in_proj_weight' of shape {(3 * E, E)}, got {w.shape}")
            wq, wk, wv = w[:E], w[E:2 * E], w[2 * E:]
        else:
            missing = [k for k in ("q_proj_weight", "k_proj_weight", "v_proj_weight") if k not in sd]
            if missing:
                raise ValueError(f"state_dict: expected 'in_proj_weight' or the separate projections, missing {missing}")
            wq, wk, wv = sd["q_proj_weight"], sd["k_proj_weight"], sd["v_proj_weight"]
        has_in_bias = "in_proj_bias" in sd
        kwargs.setdefault("dtype", sd["out_proj.weight"].dtype if sd["out_proj.weight"].dtype.kind == "f" else np.float64)
        if kwargs["dtype"] not in (np.float32, np.float64):
            kwargs["dtype"] = np.float64
        m = cls(wq.shape[1], E, num_heads, qkv_bias=has_in_bias, out_bias="out_proj.bias" in sd,
                kdim=wk.shape[1], vdim=wv.shape[1], **kwargs)
        new = {"W_query.weight": wq, "W_key.weight": wk, "W_value.weight": wv, "out_proj.weight": sd["out_proj.weight"]}
        if has_in_bias:
            b = sd["in_proj_bias"]
            new.update({"W_query.bias": b[:E], "W_key.bias": b[E:2 * E], "W_value.bias": b[2 * E:]})
        if "out_proj.bias" in sd:
            new["out_proj.bias"] = sd["out_proj.bias"]
        m.load_state_dict(new)
        return m
