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

from . import functional as F
from ._docs import BACKWARD_RAISES, shared_doc
from ._validate import (
    as_float,
    as_index,
    as_rng,
    check_bool,
    check_dtype,
    check_prob,
    check_size,
    check_tangent,
    check_tangents,
    to_numpy,
)
from .functional import kernels as K
from .generation import generate as _generate
from .nn import attention as _attention
from .nn.containers import ModuleList, Sequential
from .nn.layers import Dropout, Embedding, Linear, input_tangent
from .nn.module import Module, Parameter, no_grad

__all__ = ["SelfAttention_v1", "SelfAttention_v2", "CausalAttention", "MultiHeadAttentionWrapper", "MultiHeadAttention"]


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


def _tx(module, input_tangents, shape, dtype, method="jvp"):
    """The one input tangent of a book module's ``jvp`` (or ``backward_jvp``), checked at its edge
    (None: zero)."""
    (tx,) = check_tangents(input_tangents, ("tx",), f"{type(module).__name__}.{method}")
    return check_tangent(tx, "tx", shape, dtype)


# the first lines of the Examples sections: chapter 3's weights and inputs (``data.load``), and a
# tiny GPT configuration (chapters 4 and 5)
_CHAPTER3 = """
    >>> import numpy as np
    >>> from npattn import book, data
    >>> ch3 = data.load("chapter3")                          # the book's seeded weights and inputs
    >>> def weights(prefix):
    ...     return {k[len(prefix) + 1:]: v for k, v in ch3.items() if k.startswith(prefix + ".")}
    >>> inputs = ch3["inputs"].astype(np.float64)           # "Your journey starts with one step"
    """
_TINY_CFG = """
    >>> import numpy as np
    >>> from npattn import book
    >>> cfg = {"vocab_size": 50, "context_length": 8, "emb_dim": 16, "n_heads": 2, "n_layers": 1,
    ...        "drop_rate": 0.0, "qkv_bias": False}
    """


def _forward_doc(x, out):
    """A book class's ``forward`` documented: its line ``<io>`` becomes the Parameters (``x`` of shape
    ``x``), Returns (of shape ``out``) and Raises sections."""
    return shared_doc(
        io=f"""
        Parameters
        ----------
        x : array_like
            ``{x}``.

        Returns
        -------
        ndarray
            ``{out}``.

        Raises
        ------
        TypeError, ValueError
            An input of the wrong kind or shape (more tokens than ``context_length`` included).
        """
    )


class _BookModule(Module):
    """What npattn adds to a book class: ``backward`` (the book leaves it to autograd) checks ``dy``
    and takes the last forward's state, which the class's ``_backward(dy, saved)`` turns into ``dx``
    (adding every parameter's gradient into ``p.grad``); ``jvp`` and ``backward_jvp`` are
    ``Module``'s, through each class's ``_jvp`` and ``_backward_jvp`` hooks."""

    @shared_doc(raises=BACKWARD_RAISES)
    def backward(self, dy):
        """The backward pass of the last forward (the book leaves it to autograd): returns ``dx`` and
        adds every parameter's gradient into ``p.grad``.

        Parameters
        ----------
        dy : array_like
            The upstream gradient, of the output's shape.

        Returns
        -------
        ndarray
            ``dx``, of the input's shape.

        Raises
        ------
        <raises>
        """
        dy = self._check_dy(dy)
        return self._backward(dy, self.pop_saved())

    def _backward(self, dy, saved):  # pragma: no cover - every book class has its own
        raise NotImplementedError


@shared_doc(chapter3=_CHAPTER3)
class SelfAttention_v1(_BookModule):
    """Self-attention with raw weight matrices ``W_query, W_key, W_value`` of shape ``(d_in, d_out)``
    drawn from U[0, 1) (the book's ``torch.rand``): ``softmax(x Wq (x Wk)^T / sqrt(d_out)) x Wv``.

    Examples
    --------
    <chapter3>
    >>> sa = book.SelfAttention_v1(3, 2)
    >>> _ = sa.load_state_dict(weights("sa_v1"))
    >>> np.round(sa(inputs)[0], 4)                           # the book prints tensor([0.2996, 0.8053])
    array([0.2996, 0.8053])
    """

    def __init__(self, d_in, d_out, *, rng=None, dtype=np.float64):
        super().__init__()
        self.d_in, self.d_out = check_size(d_in, "d_in"), check_size(d_out, "d_out")
        self._dtype = check_dtype(dtype)
        rng = as_rng(rng)
        self.W_query = Parameter(rng.random((self.d_in, self.d_out)), self._dtype)
        self.W_key = Parameter(rng.random((self.d_in, self.d_out)), self._dtype)
        self.W_value = Parameter(rng.random((self.d_in, self.d_out)), self._dtype)

    @_forward_doc("(num_tokens, d_in)", "(num_tokens, d_out)")
    def forward(self, x):
        """The forward pass: ``(num_tokens, d_in) -> (num_tokens, d_out)``.

        <io>
        """
        x = _check_tokens(self, x)
        # x @ W is linear() with weight W.T; its weight gradient comes back transposed
        (q, cq), (k, ck), (v, cv) = (F.linear(x, W.data.T) for W in (self.W_query, self.W_key, self.W_value))
        ctx, ca = F.scaled_dot_product_attention(q, k, v)
        self.save_for_backward((cq, ck, cv, ca))
        return ctx

    def _backward(self, dy, saved):
        cq, ck, cv, ca = saved
        dx = 0
        for W, d, c in zip(
            (self.W_query, self.W_key, self.W_value), F.scaled_dot_product_attention_backward(dy, ca), (cq, ck, cv)
        ):
            dx_i, dwt, _ = F.linear_backward(d, c)
            self.accumulate_grad(W, dwt.T)
            dx = dx + dx_i
        return dx

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: ``tq = tx W_query + x tW_query`` (and k, v alike; ``x W`` is ``linear``
        with weight ``W^T``, so its weight tangent goes in transposed), then the attention's
        tangent (``scaled_dot_product_attention_jvp``)."""
        cq, ck, cv, ca = state
        tx = _tx(self, input_tangents, cq.x.shape, cq.x.dtype)
        tq, tk, tv = (
            K.linear_jvp(c, tx, None if param_tangents.get(W) is None else param_tangents.get(W).T)
            for W, c in zip((self.W_query, self.W_key, self.W_value), (cq, ck, cv))
        )
        return K.scaled_dot_product_attention_jvp(ca, tq, tk, tv)

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: the projections' tangents (as ``_jvp``), the attention's
        ``scaled_dot_product_attention_backward_jvp``, then each ``x W`` by ``linear_backward_jvp``
        (weight ``W^T``: its tangent goes in and its gradient's tangent comes out transposed)."""
        cq, ck, cv, ca = state
        tx = _tx(self, input_tangents, cq.x.shape, cq.x.dtype, "backward_jvp")
        mats, caches = (self.W_query, self.W_key, self.W_value), (cq, ck, cv)
        tws = [None if param_tangents.get(W) is None else param_tangents.get(W).T for W in mats]
        tqkv = [K.linear_jvp(c, tx, tw) for c, tw in zip(caches, tws)]
        grads, tangents = K.scaled_dot_product_attention_backward_jvp(dy, ca, tuple(tqkv), ddy)
        dx = tdx = 0
        for W, c, tw, d, td in zip(mats, caches, tws, grads, tangents):
            (dx_i, dwt, _), (tdx_i, tdwt, _) = K.linear_backward_jvp(d, c, (tx, tw, None), td)
            self._accumulate_second(((W, dwt.T, tdwt.T),))
            dx, tdx = dx + dx_i, tdx + tdx_i
        return dx, tdx


class _SingleHead(_BookModule):
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
        ctx, cache = F.scaled_dot_product_attention(
            self.W_query(x), self.W_key(x), self.W_value(x), attn_mask=attn_mask, dropout_p=dropout_p, rng=self.rng
        )
        self.save_for_backward(cache)
        return ctx

    def _backward(self, dy, cache):
        dq, dk, dv = F.scaled_dot_product_attention_backward(dy, cache)
        return self.W_query.backward(dq) + self.W_key.backward(dk) + self.W_value.backward(dv)

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: the projections' tangents (each ``Linear``'s ``_jvp`` of this call), then
        the attention's (``scaled_dot_product_attention_jvp``; dropout with the forward's mask)."""
        tq, tk, tv = (
            self._child_jvp(m, -1, input_tangents, param_tangents) for m in (self.W_query, self.W_key, self.W_value)
        )
        return K.scaled_dot_product_attention_jvp(state, tq, tk, tv)

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: the projections' tangents (each ``Linear``'s ``_jvp`` of this call), the
        attention's ``scaled_dot_product_attention_backward_jvp``, each projection's
        ``backward_jvp``; the three input gradients and their tangents summed."""
        (tx,) = check_tangents(input_tangents, ("tx",), f"{type(self).__name__}.backward_jvp")
        projections = (self.W_query, self.W_key, self.W_value)
        tqkv = tuple(self._child_jvp(m, -1, (tx,), param_tangents) for m in projections)
        grads, tangents = K.scaled_dot_product_attention_backward_jvp(dy, state, tqkv, ddy)
        dx = tdx = 0
        for m, d, td in zip(projections, grads, tangents):
            dx_i, tdx_i = self._child_backward_jvp(m, d, (tx,), param_tangents, td)
            dx, tdx = dx + dx_i, tdx + tdx_i
        return dx, tdx


@shared_doc(chapter3=_CHAPTER3)
class SelfAttention_v2(_SingleHead):
    """Self-attention with ``Linear`` projections ``W_query``, ``W_key``, ``W_value``.

    Examples
    --------
    <chapter3>
    >>> sa = book.SelfAttention_v2(3, 2)
    >>> _ = sa.load_state_dict(weights("sa_v2"))
    >>> bool(np.allclose(sa(inputs), ch3["out.sa_v2"], atol=1e-6))   # torch's output
    True
    """

    def __init__(self, d_in, d_out, qkv_bias=False, *, rng=None, dtype=np.float64):
        super().__init__()
        self._init_projections(d_in, d_out, qkv_bias, rng, dtype)

    @_forward_doc("(num_tokens, d_in)", "(num_tokens, d_out)")
    def forward(self, x):
        """The forward pass: ``(num_tokens, d_in) -> (num_tokens, d_out)``.

        <io>
        """
        return self._attend(_check_tokens(self, x))


@shared_doc(chapter3=_CHAPTER3)
class CausalAttention(_SingleHead):
    """Single-head causal attention with dropout on the weights and the ``mask`` buffer
    (ones above the diagonal, as the book's ``torch.triu(torch.ones(...), diagonal=1)``).

    Examples
    --------
    <chapter3>
    >>> batch = np.stack([inputs, inputs])                   # (2, 6, 3)
    >>> ca = book.CausalAttention(3, 2, 6, 0.0)
    >>> _ = ca.load_state_dict(weights("ca"))
    >>> out = ca(batch)
    >>> bool(np.allclose(out, ch3["out.ca"], atol=1e-6)), out.shape   # torch's output
    (True, (2, 6, 2))
    """

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False, *, rng=None, dtype=np.float64):
        super().__init__()
        self._init_projections(d_in, d_out, qkv_bias, rng, dtype)
        self.context_length = check_size(context_length, "context_length")
        self.dropout = check_prob(dropout, "dropout")
        self.register_buffer("mask", np.triu(np.ones((self.context_length,) * 2, dtype=self._dtype), k=1))

    @_forward_doc("(batch, num_tokens, d_in)", "(batch, num_tokens, d_out)")
    def forward(self, x):
        """The forward pass: ``(batch, num_tokens, d_in) -> (batch, num_tokens, d_out)``.

        <io>
        """
        x = _check_tokens(self, x, self.context_length)
        n = x.shape[-2]
        return self._attend(x, attn_mask=self.mask[:n, :n] == 0, dropout_p=self.dropout if self.training else 0.0)


@shared_doc(chapter3=_CHAPTER3)
class MultiHeadAttentionWrapper(_BookModule):
    """``num_heads`` independent ``CausalAttention`` heads, outputs concatenated:
    ``(..., num_tokens, num_heads * d_out)``.  Backward splits ``dy`` per head and sums the
    heads' input gradients.

    Examples
    --------
    <chapter3>
    >>> batch = np.stack([inputs, inputs])                   # (2, 6, 3)
    >>> mhaw = book.MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)
    >>> _ = mhaw.load_state_dict(weights("mhaw"))
    >>> out = mhaw(batch)
    >>> bool(np.allclose(out, ch3["out.mhaw"], atol=1e-6)), out.shape   # the heads side by side
    (True, (2, 6, 4))
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, *, rng=None, dtype=np.float64):
        super().__init__()
        num_heads = check_size(num_heads, "num_heads")
        rng = as_rng(rng)
        self._dtype = check_dtype(dtype)
        self.d_out = check_size(d_out, "d_out")
        self.heads = ModuleList(
            [
                CausalAttention(d_in, d_out, context_length, dropout, qkv_bias, rng=rng, dtype=dtype)
                for _ in range(num_heads)
            ]
        )

    @_forward_doc("(batch, num_tokens, d_in)", "(batch, num_tokens, num_heads * d_out)")
    def forward(self, x):
        """The heads' outputs concatenated: ``(batch, num_tokens, d_in) -> (batch, num_tokens, num_heads * d_out)``.

        <io>
        """
        x = _check_tokens(self.heads[0], x, self.heads[0].context_length)
        out = np.concatenate([head(x) for head in self.heads], axis=-1)
        self.save_for_backward(out.shape)
        return out

    def _backward(self, dy, _):
        return sum(head.backward(d) for head, d in zip(self.heads, np.split(dy, len(self.heads), axis=-1)))

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: the heads' tangents, concatenated as their outputs."""
        return np.concatenate([self._child_jvp(h, -1, input_tangents, param_tangents) for h in self.heads], axis=-1)

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: ``dy`` and ``ddy`` split per head, each head's ``backward_jvp``, the input
        gradients and their tangents summed."""
        n = len(self.heads)
        ddys = [None] * n if ddy is None else np.split(ddy, n, axis=-1)
        dx = tdx = 0
        for head, d, dd in zip(self.heads, np.split(dy, n, axis=-1), ddys):
            dx_i, tdx_i = self._child_backward_jvp(head, d, input_tangents, param_tangents, dd)
            dx, tdx = dx + dx_i, tdx + tdx_i
        return dx, tdx


@shared_doc(chapter3=_CHAPTER3)
class MultiHeadAttention(_attention.MultiHeadAttention):
    """The book's batched multi-head causal attention: ``npattn.MultiHeadAttention`` with the
    book's positional signature, ``out_proj`` with bias, and the causal ``mask`` buffer.

    Examples
    --------
    <chapter3>
    >>> mha = book.MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)
    >>> _ = mha.load_state_dict(weights("mha"))
    >>> out = mha(np.stack([inputs, inputs]))
    >>> np.round(out[0, 0], 4)                              # the book prints [0.3190, 0.4858]
    array([0.319 , 0.4858])
    >>> mha.backward(np.ones_like(out)).shape
    (2, 6, 3)
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, *, rng=None, dtype=np.float64):
        super().__init__(
            d_in, d_out, num_heads, dropout=dropout, qkv_bias=qkv_bias, out_bias=True, rng=rng, dtype=dtype
        )
        self.context_length = check_size(context_length, "context_length")
        self.register_buffer("mask", np.triu(np.ones((self.context_length,) * 2, dtype=self._dtype), k=1))

    def forward(self, x, use_cache=False):
        """``x (b, num_tokens, d_in)`` -> ``(b, num_tokens, d_out)``.

        ``use_cache=True`` (the book's chapter-4 KV cache): this call's keys and values join the
        cache of ``npattn.MultiHeadAttention`` and its queries are the rows ``T .. T + n - 1`` of
        the ``mask`` buffer over the ``T + n`` cached keys (``T`` tokens cached before), as the
        book's ``mask[ptr:ptr + n, :T + n]``; nothing is kept for backward.  ``T + n`` may not
        exceed ``context_length``.  ``reset_kv_cache()`` empties the cache."""
        use_cache = check_bool(use_cache, "use_cache")
        past = self.kv_cache_length if use_cache else 0
        x = _check_tokens(self, x, self.context_length)
        n = x.shape[-2]
        if past + n > self.context_length:
            raise ValueError(
                f"x: expected at most context_length={self.context_length} tokens with the {past} cached "
                f"ones, got {n} more (call reset_kv_cache() to start a new sequence)"
            )
        self._check_cache(x, True, use_cache)
        # the mask comes from the module's own buffer, already of the shape _forward takes
        return self._forward(x, mask=self.mask[past : past + n, : past + n] == 0, use_cache=use_cache)


# ==============================================================================================
# Chapter 4: the GPT model.  Chapter 5: generation with temperature / top-k, GPT-2 weights.
# ==============================================================================================

__all__ += [
    "GELU",
    "GPT2_MODEL_CONFIGS",
    "GPT_CONFIG_124M",
    "FeedForward",
    "GPTModel",
    "LayerNorm",
    "TransformerBlock",
    "generate",
    "generate_text_simple",
    "load_weights_into_gpt",
]

#: The book's configuration of the 124M-parameter GPT-2 (chapter 4).
GPT_CONFIG_124M = {
    "vocab_size": 50257,
    "context_length": 1024,
    "emb_dim": 768,
    "n_heads": 12,
    "n_layers": 12,
    "drop_rate": 0.1,
    "qkv_bias": False,
}
#: The sizes of the four GPT-2 checkpoints (chapter 5; OpenAI's weights use ``qkv_bias=True``).
GPT2_MODEL_CONFIGS = {
    "gpt2-small (124M)": {"emb_dim": 768, "n_layers": 12, "n_heads": 12},
    "gpt2-medium (355M)": {"emb_dim": 1024, "n_layers": 24, "n_heads": 16},
    "gpt2-large (774M)": {"emb_dim": 1280, "n_layers": 36, "n_heads": 20},
    "gpt2-xl (1558M)": {"emb_dim": 1600, "n_layers": 48, "n_heads": 25},
}
_CFG_KEYS = ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "drop_rate", "qkv_bias")


def _check_cfg(cfg):
    if not hasattr(cfg, "keys") or not hasattr(cfg, "__getitem__"):
        raise TypeError(f"cfg: expected a dict with keys {list(_CFG_KEYS)}, got {type(cfg).__name__}")
    missing = [k for k in _CFG_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"cfg: missing keys {missing} (expected {list(_CFG_KEYS)})")
    for k in ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers"):
        check_size(cfg[k], f"cfg['{k}']")
    check_prob(cfg["drop_rate"], "cfg['drop_rate']")
    check_bool(cfg["qkv_bias"], "cfg['qkv_bias']")
    if cfg["emb_dim"] % cfg["n_heads"]:
        raise ValueError(
            f"cfg['emb_dim']: expected a multiple of cfg['n_heads']={cfg['n_heads']}, got {cfg['emb_dim']}"
        )
    return {k: cfg[k] for k in _CFG_KEYS}


class LayerNorm(_BookModule):
    """The book's layer norm: ``scale * (x - mean) / sqrt(var + eps) + shift`` over the last axis,
    biased variance, ``eps = 1e-5``; parameters ``scale`` (ones) and ``shift`` (zeros).
    The functional ``layer_norm`` pair with ``weight=scale``, ``bias=shift``.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn import book
    >>> ln = book.LayerNorm(4)
    >>> y = ln(np.array([[1.0, 2.0, 3.0, 4.0]]))
    >>> np.round(y, 4), sorted(ln.state_dict())              # the book's names: scale, shift
    (array([[-1.3416, -0.4472,  0.4472,  1.3416]]), ['scale', 'shift'])
    """

    def __init__(self, emb_dim, *, dtype=np.float64):
        super().__init__()
        self.emb_dim = check_size(emb_dim, "emb_dim")
        self.eps = 1e-5
        self._dtype = check_dtype(dtype)
        self.scale = Parameter(np.ones(self.emb_dim), self._dtype)
        self.shift = Parameter(np.zeros(self.emb_dim), self._dtype)

    @_forward_doc("(..., emb_dim)", "(..., emb_dim)")
    def forward(self, x):
        """``scale * (x - mean) / sqrt(var + eps) + shift``: ``(..., emb_dim) -> (..., emb_dim)``.

        <io>
        """
        x = as_float(x, "x", self.dtype)
        if x.ndim < 1 or x.shape[-1] != self.emb_dim:
            raise ValueError(f"x: expected shape (..., {self.emb_dim}), got {x.shape}")
        y, cache = K.layer_norm(x, self.scale.data, self.shift.data, self.eps)
        self.save_for_backward(cache)
        return y

    def _backward(self, dy, cache):
        dx, dscale, dshift = K.layer_norm_backward(dy, cache)
        self.accumulate_grad(self.scale, dscale)
        self.accumulate_grad(self.shift, dshift)
        return dx

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode (``functional.layer_norm_jvp`` with ``tweight = tscale``, ``tbias = tshift``)."""
        tx = _tx(self, input_tangents, state.xhat.shape, state.xhat.dtype)
        return K.layer_norm_jvp(state, tx, param_tangents.get(self.scale), param_tangents.get(self.shift))

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order (``functional.layer_norm_backward_jvp``, weight ``scale``, bias ``shift``)."""
        tx = _tx(self, input_tangents, state.xhat.shape, state.xhat.dtype, "backward_jvp")
        tangents = (tx, param_tangents.get(self.scale), param_tangents.get(self.shift))
        (dx, dscale, dshift), (tdx, tdscale, tdshift) = K.layer_norm_backward_jvp(dy, state, tangents, ddy)
        self._accumulate_second(((self.scale, dscale, tdscale), (self.shift, dshift, tdshift)))
        return dx, tdx


class GELU(_BookModule):
    """The book's GELU, the tanh form: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn import book
    >>> gelu = book.GELU()
    >>> np.round(gelu(np.array([-1.0, 0.0, 1.0])), 4)
    array([-0.1588,  0.    ,  0.8412])
    """

    @_forward_doc("(...)", "(...)")
    def forward(self, x):
        """The tanh approximation of GELU: ``(...) -> (...)``.

        <io>
        """
        y, cache = K.gelu(as_float(x, "x"), "tanh")
        self.save_for_backward(cache)
        return y

    def _backward(self, dy, cache):
        return K.gelu_backward(dy, cache)

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode (``functional.gelu_jvp``): ``ty = gelu'(x) tx``."""
        return K.gelu_jvp(state, _tx(self, input_tangents, state.x.shape, state.x.dtype))

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order (``functional.gelu_backward_jvp``): ``tdx = ddy gelu'(x) + dy gelu''(x) tx``."""
        tx = _tx(self, input_tangents, state.x.shape, state.x.dtype, "backward_jvp")
        return K.gelu_backward_jvp(dy, state, (tx,), ddy)


class _Sequential(Sequential):
    """``nn.Sequential`` built from a list, as the book's classes build it (keys ``0``, ``1``, ...;
    forward, backward and forward mode are ``Sequential``'s)."""

    def __init__(self, modules=()):
        super().__init__(*modules)


@shared_doc(tiny_cfg=_TINY_CFG)
class FeedForward(_BookModule):
    """The book's feed-forward: ``layers = Sequential(Linear(emb, 4 emb), GELU(), Linear(4 emb, emb))``
    [``layers.0.weight``, ``layers.0.bias``, ``layers.2.weight``, ``layers.2.bias``].

    Examples
    --------
    <tiny_cfg>
    >>> ff = book.FeedForward(cfg, rng=0)
    >>> y = ff(np.ones((1, 3, 16)))
    >>> y.shape, sorted(ff.state_dict())[0]
    ((1, 3, 16), 'layers.0.bias')
    """

    def __init__(self, cfg, *, rng=None, dtype=np.float64):
        super().__init__()
        emb = check_size(cfg["emb_dim"], "cfg['emb_dim']")
        rng = as_rng(rng)
        self._dtype = check_dtype(dtype)
        self.layers = _Sequential(
            [Linear(emb, 4 * emb, rng=rng, dtype=dtype), GELU(), Linear(4 * emb, emb, rng=rng, dtype=dtype)]
        )

    @_forward_doc("(..., emb_dim)", "(..., emb_dim)")
    def forward(self, x):
        """The forward pass: ``(..., emb_dim) -> (..., emb_dim)``.

        <io>
        """
        y = self.layers(x)
        self.save_for_backward(True)  # the layers keep their own state
        return y

    def _backward(self, dy, _):
        return self.layers.backward(dy)

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: ``layers``' tangent."""
        return self._child_jvp(self.layers, -1, input_tangents, param_tangents)

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: ``layers``' (``Sequential``'s)."""
        return self._child_backward_jvp(self.layers, dy, input_tangents, param_tangents, ddy)


@shared_doc(tiny_cfg=_TINY_CFG)
class TransformerBlock(_BookModule):
    """The book's pre-norm block with its two shortcut connections::

        x = x + drop_shortcut(att(norm1(x)))
        x = x + drop_shortcut(ff(norm2(x)))

    Backward: each residual sum sends ``dy`` both ways, so ``dx = dy + branch.backward(dy)``,
    second branch first.  ``drop_shortcut`` is applied twice, so the block calls the functional
    dropout pair itself (with the module's ``rng``) and keeps both masks.

    Examples
    --------
    <tiny_cfg>
    >>> block = book.TransformerBlock(cfg, rng=0)
    >>> x = np.random.default_rng(1).standard_normal((2, 5, 16))
    >>> y = block(x)
    >>> block.backward(np.ones_like(y)).shape
    (2, 5, 16)
    """

    def __init__(self, cfg, *, rng=None, dtype=np.float64):
        super().__init__()
        cfg = _check_cfg(cfg)
        rng = as_rng(rng)
        self._dtype = check_dtype(dtype)
        self.att = MultiHeadAttention(
            cfg["emb_dim"],
            cfg["emb_dim"],
            cfg["context_length"],
            cfg["drop_rate"],
            cfg["n_heads"],
            cfg["qkv_bias"],
            rng=rng,
            dtype=dtype,
        )
        self.ff = FeedForward(cfg, rng=rng, dtype=dtype)
        self.norm1 = LayerNorm(cfg["emb_dim"], dtype=dtype)
        self.norm2 = LayerNorm(cfg["emb_dim"], dtype=dtype)
        self.drop_shortcut = Dropout(cfg["drop_rate"], rng=rng)

    def _drop(self, x):
        return K.dropout(x, self.drop_shortcut.p, self.drop_shortcut.rng, self.training)

    @_forward_doc("(batch, num_tokens, emb_dim)", "(batch, num_tokens, emb_dim)")
    def forward(self, x, *, use_cache=False):
        """The forward pass: ``(batch, num_tokens, emb_dim) -> (batch, num_tokens, emb_dim)``.

        <io>
        """
        x = as_float(x, "x", self.dtype)
        a, c1 = self._drop(self.att(self.norm1(x), use_cache=use_cache))
        x = x + a
        f, c2 = self._drop(self.ff(self.norm2(x)))
        self.save_for_backward((c1, c2))
        return x + f

    def _backward(self, dy, saved):
        c1, c2 = saved
        dx = dy + self.norm2.backward(self.ff.backward(K.dropout_backward(dy, c2)))
        return dx + self.norm1.backward(self.att.backward(K.dropout_backward(dx, c1)))

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: ``tx + drop(att'(norm1'(tx)))``, then ``tx + drop(ff'(norm2'(tx)))``, the
        dropouts with the forward's masks."""
        c1, c2 = state
        tx = _tx(self, input_tangents, c1.shape, c1.dtype)

        def sub(m, t):  # the submodule's tangent from its state of this call
            return self._child_jvp(m, -1, (t,), param_tangents)

        ta = K.dropout_jvp(c1, sub(self.att, sub(self.norm1, tx)))
        tx = ta if tx is None else tx + ta
        return tx + K.dropout_jvp(c2, sub(self.ff, sub(self.norm2, tx)))

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: the forward's tangents (as ``_jvp``), then the backward's chain with each
        submodule's ``backward_jvp`` and the shortcut dropouts' ``dropout_backward_jvp`` (the
        forward's masks); each residual adds both branches' gradients and their tangents."""
        c1, c2 = state
        tx = _tx(self, input_tangents, c1.shape, c1.dtype, "backward_jvp")
        tx = np.zeros(c1.shape, c1.dtype) if tx is None else tx
        ddy = np.zeros_like(dy) if ddy is None else ddy
        pt = param_tangents

        def sub(m, t):  # the submodule's tangent from its state of this call
            return self._child_jvp(m, -1, (t,), pt)

        def back(m, g, t):  # its backward_jvp on (gradient, tangent), its input's tangent t
            return self._child_backward_jvp(m, g[0], (t,), pt, g[1])

        def drop(c, g):
            return K.dropout_backward_jvp(g[0], c, (None,), g[1])

        tn1 = sub(self.norm1, tx)
        ta = sub(self.att, tn1)
        th = tx + K.dropout_jvp(c1, ta)
        tn2 = sub(self.norm2, th)
        gf = back(self.norm2, back(self.ff, drop(c2, (dy, ddy)), tn2), th)
        dh, tdh = dy + gf[0], ddy + gf[1]
        gx = back(self.norm1, back(self.att, drop(c1, (dh, tdh)), tn1), tx)
        return dh + gx[0], tdh + gx[1]


@shared_doc(tiny_cfg=_TINY_CFG)
class GPTModel(Module):
    """The book's GPT (chapter 4): ``idx (batch, num_tokens) -> logits (batch, num_tokens, vocab_size)``::

        x = drop_emb(tok_emb(idx) + pos_emb(arange(num_tokens)))
        x = trf_blocks(x)                      # n_layers TransformerBlocks
        logits = out_head(final_norm(x))       # Linear without bias

    ``cfg`` is the book's dict: ``vocab_size``, ``context_length``, ``emb_dim``, ``n_heads``,
    ``n_layers``, ``drop_rate``, ``qkv_bias`` (e.g. ``GPT_CONFIG_124M``).  The state-dict keys
    are the book's: ``tok_emb.weight``, ``pos_emb.weight``, ``trf_blocks.{i}.att.{mask,
    W_query.weight, W_key.weight, W_value.weight, out_proj.weight, out_proj.bias}`` (``W_*.bias``
    with ``qkv_bias``), ``trf_blocks.{i}.ff.layers.{0,2}.{weight,bias}``,
    ``trf_blocks.{i}.norm{1,2}.{scale,shift}``, ``final_norm.{scale,shift}``, ``out_head.weight``;
    initialisation as torch's defaults (embeddings N(0, 1), linears U(+-1/sqrt(in))).

    ``backward(dlogits)`` accumulates every parameter's gradient (the reverse of the forward:
    ``out_head``, ``final_norm``, the blocks last to first, the dropout, then both embeddings
    receive ``dx``; the position table gets it summed over the batch) and returns ``None``.

    ``forward(idx, use_cache=True)`` decodes incrementally: the blocks' attentions append this
    call's keys and values to their KV cache, and positions continue after the cached ones;
    ``reset_kv_cache()`` empties it.  Nothing is kept for backward then.  Also accepts
    ``(num_tokens,)`` ids (logits ``(num_tokens, vocab_size)``).

    Examples
    --------
    <tiny_cfg>
    >>> gpt = book.GPTModel(cfg, rng=0)
    >>> logits = gpt(np.array([[1, 2, 3]]))
    >>> logits.shape
    (1, 3, 50)
    >>> gpt.backward(np.ones_like(logits))
    >>> gpt.tok_emb.weight.grad.shape, sorted(gpt.state_dict())[:2]
    ((50, 16), ['final_norm.scale', 'final_norm.shift'])
    """

    def __init__(self, cfg, *, rng=None, dtype=np.float64):
        super().__init__()
        self.cfg = _check_cfg(cfg)
        cfg = self.cfg
        rng = as_rng(rng)
        self._dtype = check_dtype(dtype)
        self.tok_emb = Embedding(cfg["vocab_size"], cfg["emb_dim"], rng=rng, dtype=dtype)
        self.pos_emb = Embedding(cfg["context_length"], cfg["emb_dim"], rng=rng, dtype=dtype)
        self.drop_emb = Dropout(cfg["drop_rate"], rng=rng)
        self.trf_blocks = _Sequential([TransformerBlock(cfg, rng=rng, dtype=dtype) for _ in range(cfg["n_layers"])])
        self.final_norm = LayerNorm(cfg["emb_dim"], dtype=dtype)
        self.out_head = Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False, rng=rng, dtype=dtype)
        self.current_pos = 0

    def extra_repr(self):
        """The arguments shown by ``repr(module)``."""
        return ", ".join(f"{k}={v}" for k, v in self.cfg.items())

    def _check_idx(self, idx, start):
        idx = as_index(idx, "idx")
        ctx = self.cfg["context_length"]
        if idx.ndim not in (1, 2) or idx.shape[-1] < 1:
            raise ValueError(
                f"idx: expected token ids of shape (batch, num_tokens) or (num_tokens,), got shape {idx.shape}"
            )
        if start + idx.shape[-1] > ctx:
            cached = f" after {start} cached tokens" if start else ""
            raise ValueError(
                f"idx: expected at most context_length={ctx} tokens{cached}, got {idx.shape[-1]} (shape {idx.shape})"
            )
        v = self.cfg["vocab_size"]
        if idx.size and (idx.min() < 0 or idx.max() >= v):
            bad = idx.min() if idx.min() < 0 else idx.max()
            raise ValueError(f"idx: expected token ids in [0, {v}), got {bad}")
        return idx

    def forward(self, idx, use_cache=False):
        """``idx (batch, num_tokens)`` -> ``logits (batch, num_tokens, vocab_size)``."""
        use_cache = check_bool(use_cache, "use_cache")
        if use_cache:
            return self._forward_cached(idx)
        idx = self._check_idx(idx, 0)
        n = idx.shape[-1]
        x, c_drop = K.dropout(
            self.tok_emb(idx) + self.pos_emb(np.arange(n)), self.drop_emb.p, self.drop_emb.rng, self.training
        )
        logits = self.out_head(self.final_norm(self.trf_blocks(x)))
        self.save_for_backward((idx.shape, c_drop))
        return logits

    def backward(self, dlogits):
        """Every parameter gradient from ``dlogits`` (added into ``p.grad``); returns ``None``."""
        dlogits = self._check_dy(dlogits, "dlogits")
        idx_shape, c_drop = self.pop_saved()
        dx = self.trf_blocks.backward(self.final_norm.backward(self.out_head.backward(dlogits)))
        dx = K.dropout_backward(dx, c_drop)
        self.tok_emb.backward(dx)
        self.pos_emb.backward(dx.sum(axis=tuple(range(len(idx_shape) - 1))))  # one table shared by the batch

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: the logits' tangent along the parameters' tangents (``idx`` has none:
        pass None or nothing); ``drop(ttok + tpos)`` with the forward's mask, then the blocks,
        ``final_norm`` and ``out_head``, each from its state of this call."""
        _, c_drop = state

        def sub(m, t):  # the submodule's tangent from its state of this call
            return self._child_jvp(m, -1, (t,), param_tangents)

        tx = self._child_jvp(self.tok_emb, -1, input_tangents, param_tangents)  # refuses an idx tangent
        tx = K.dropout_jvp(c_drop, tx + sub(self.pos_emb, None))
        return sub(self.out_head, sub(self.final_norm, sub(self.trf_blocks, tx)))

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: the forward's tangents (as ``_jvp``), then ``out_head``, ``final_norm``,
        the blocks, the embedding dropout and both embeddings by their ``backward_jvp`` (the
        position table's gradient and its tangent summed over the batch).  ``idx`` takes no
        tangent; returns ``(None, None)``."""
        idx_shape, c_drop = state
        pt = param_tangents
        if input_tangent(input_tangents, "GPTModel", "backward_jvp") is not None:
            raise TypeError("GPTModel.backward_jvp: token ids have no tangent; expected None")

        def sub(m, t):  # the submodule's tangent from its state of this call
            return self._child_jvp(m, -1, (t,), pt)

        def back(m, g, t):  # its backward_jvp on (gradient, tangent), its input's tangent t
            return self._child_backward_jvp(m, g[0], (t,), pt, g[1])

        t0 = K.dropout_jvp(c_drop, sub(self.tok_emb, None) + sub(self.pos_emb, None))
        t1 = sub(self.trf_blocks, t0)
        t2 = sub(self.final_norm, t1)
        g = back(self.trf_blocks, back(self.final_norm, back(self.out_head, (dy, ddy), t2), t1), t0)
        g = K.dropout_backward_jvp(g[0], c_drop, (None,), g[1])
        back(self.tok_emb, g, None)
        batch = tuple(range(len(idx_shape) - 1))  # one position table shared by the batch
        back(self.pos_emb, (g[0].sum(axis=batch), g[1].sum(axis=batch)), None)
        return None, None

    # -- KV cache ----------------------------------------------------------------------------
    def _forward_cached(self, idx):
        idx = self._check_idx(idx, self.current_pos)
        n = idx.shape[-1]
        with no_grad():
            pos = np.arange(self.current_pos, self.current_pos + n)
            x, _ = K.dropout(self.tok_emb(idx) + self.pos_emb(pos), self.drop_emb.p, self.drop_emb.rng, self.training)
            for block in self.trf_blocks:
                x = block(x, use_cache=True)
            logits = self.out_head(self.final_norm(x))
            self.save_for_backward(None)
        self.current_pos += n
        return logits

    def reset_kv_cache(self) -> None:
        """Empty every block's KV cache; the next ``forward(idx, use_cache=True)`` starts at position 0."""
        for block in self.trf_blocks:
            block.att.reset_kv_cache()
        self.current_pos = 0

    # -- Hugging Face GPT-2 ----------------------------------------------------------------------
    @classmethod
    def from_hf_gpt2_state_dict(cls, state_dict, *, rng=None, dtype=None, **cfg):
        """A ``GPTModel`` with the weights of a Hugging Face ``GPT2LMHeadModel`` (or ``GPT2Model``)
        state dict: ``transformer.wte.weight``, ``transformer.wpe.weight``,
        ``transformer.h.{i}.ln_1.{weight,bias}``, ``.attn.c_attn.{weight,bias}``,
        ``.attn.c_proj.*``, ``.ln_2.*``, ``.mlp.c_fc.*``, ``.mlp.c_proj.*``,
        ``transformer.ln_f.*`` and ``lm_head.weight`` (tied to ``wte``; used when present).

        GPT-2's ``Conv1D`` stores ``(in, out)`` weights: they are transposed into the book's
        ``(out, in)`` ``Linear`` weights, and ``c_attn`` (``(emb, 3 emb)``) is split into
        ``W_query``, ``W_key``, ``W_value`` (so ``qkv_bias=True``).

        ``**cfg`` takes the book's config keys: ``vocab_size``, ``context_length``, ``emb_dim``
        and ``n_layers`` default to (and must agree with) the weights' shapes, ``qkv_bias`` must
        be True, ``drop_rate`` defaults to 0.0, and ``n_heads`` (``GPT2Config.n_head``; the
        shapes cannot tell it) defaults to ``emb_dim // 64``, GPT-2's head size, when ``emb_dim``
        is a multiple of 64.  So ``from_hf_gpt2_state_dict(sd, **GPT_CONFIG_124M)`` works.
        ``dtype`` defaults to the weights' (float32 or float64).  The logits are those of the
        Hugging Face model in eval mode (its attention scale and causal mask are the book's).
        """
        if not hasattr(state_dict, "keys"):
            raise TypeError(f"state_dict: expected a mapping of names to arrays, got {type(state_dict).__name__}")
        unknown = sorted(set(cfg) - set(_CFG_KEYS))
        if unknown:
            raise TypeError(
                f"from_hf_gpt2_state_dict: unexpected arguments {unknown} (expected the config keys "
                f"{list(_CFG_KEYS)}, rng, dtype)"
            )
        sd = {}
        for k, v in state_dict.items():
            sd[k.removeprefix("transformer.")] = to_numpy(v, f"state_dict[{k!r}]")
        for k in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"):
            if k not in sd:
                raise ValueError(
                    f"state_dict: expected key 'transformer.{k}' (GPT2LMHeadModel's keys), "
                    f"got keys {sorted(state_dict.keys())[:8]}..."
                )
        wte = sd["wte.weight"]
        n_layers = 0
        while f"h.{n_layers}.ln_1.weight" in sd:
            n_layers += 1
        found = {
            "vocab_size": wte.shape[0],
            "context_length": sd["wpe.weight"].shape[0],
            "emb_dim": wte.shape[1],
            "n_layers": n_layers,
            "qkv_bias": True,
        }
        for k, v in found.items():
            if k in cfg and cfg[k] != v:
                raise ValueError(f"{k}: the state dict has {k}={v}, got {cfg[k]!r}")
        n_heads = cfg.get("n_heads")
        if n_heads is None:
            if found["emb_dim"] % 64:
                raise ValueError(
                    f"n_heads: required (GPT2Config.n_head) when emb_dim={found['emb_dim']} is not a "
                    "multiple of GPT-2's head size 64; the weight shapes cannot tell it"
                )
            n_heads = found["emb_dim"] // 64
        cfg = dict(found, n_heads=n_heads, drop_rate=cfg.get("drop_rate", 0.0))
        if dtype is None:
            dtype = wte.dtype if wte.dtype in (np.float32, np.float64) else np.float64
        params = {"wte": wte, "wpe": sd["wpe.weight"], "g": sd["ln_f.weight"], "b": sd["ln_f.bias"], "blocks": []}
        try:
            for i in range(n_layers):

                def h(name, i=i):
                    return sd[f"h.{i}.{name}"]

                params["blocks"].append(
                    {
                        "attn": {
                            "c_attn": {"w": h("attn.c_attn.weight"), "b": h("attn.c_attn.bias")},
                            "c_proj": {"w": h("attn.c_proj.weight"), "b": h("attn.c_proj.bias")},
                        },
                        "mlp": {
                            "c_fc": {"w": h("mlp.c_fc.weight"), "b": h("mlp.c_fc.bias")},
                            "c_proj": {"w": h("mlp.c_proj.weight"), "b": h("mlp.c_proj.bias")},
                        },
                        "ln_1": {"g": h("ln_1.weight"), "b": h("ln_1.bias")},
                        "ln_2": {"g": h("ln_2.weight"), "b": h("ln_2.bias")},
                    }
                )
        except KeyError as e:
            raise ValueError(f"state_dict: expected key 'transformer.{e.args[0]}' (layer {i} of {n_layers})") from None
        lm_head = sd.get("lm_head.weight")
        gpt = cls(cfg, rng=0 if rng is None else rng, dtype=dtype)
        load_weights_into_gpt(gpt, params, out_head=lm_head)
        return gpt


@shared_doc(tiny_cfg=_TINY_CFG)
def generate_text_simple(model, idx, max_new_tokens, context_size):
    """The book's greedy decoding (chapter 4): append ``max_new_tokens`` arg-max tokens, each
    predicted from the last ``context_size`` tokens (``generate`` with its defaults, no cache).

    Examples
    --------
    <tiny_cfg>
    >>> gpt = book.GPTModel(cfg, rng=0)
    >>> out = book.generate_text_simple(gpt, np.array([[1, 2, 3]]), max_new_tokens=3, context_size=8)
    >>> out.shape, out[0, :3].tolist()                       # greedy: the arg-max at each step
    ((1, 6), [1, 2, 3])
    """
    return _generate(model, idx, max_new_tokens, context_size, use_cache=False)


@shared_doc(tiny_cfg=_TINY_CFG)
def generate(
    model, idx, max_new_tokens, context_size, temperature=0.0, top_k=None, eos_id=None, *, rng=None, use_cache=True
):
    """The book's ``generate`` (chapter 5) with ``rng`` and a KV cache; see
    ``npattn.generation.generate`` for the exact semantics (temperature 0 is greedy, ``top_k``
    masks all but the k largest logits with ``-inf``, a ``top_k`` of at least the vocabulary size
    keeps every token, ``eos_id`` stops, the same ``rng`` gives
    the same tokens, the cache gives the same tokens as recomputation).

    Examples
    --------
    <tiny_cfg>
    >>> gpt = book.GPTModel(cfg, rng=0)
    >>> out = book.generate(gpt, np.array([[1, 2, 3]]), max_new_tokens=4, context_size=8,
    ...                     temperature=1.0, top_k=5, rng=0)
    >>> out.shape, out[0, :3].tolist()
    ((1, 7), [1, 2, 3])
    """
    return _generate(model, idx, max_new_tokens, context_size, temperature, top_k, eos_id, rng=rng, use_cache=use_cache)


def _param(tree, path):
    node = tree
    for p in path:
        try:
            node = node[p]
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"params: expected an entry {''.join(f'[{q!r}]' for q in path)}") from None
    return to_numpy(node, "params" + "".join(f"[{q!r}]" for q in path))


def load_weights_into_gpt(gpt, params, *, out_head=None):
    """Copy OpenAI's GPT-2 checkpoint, in the book's ``params`` layout (chapter 5), into ``gpt``.

    ``params``: ``wte`` ``(vocab, emb)``, ``wpe`` ``(ctx, emb)``, ``g``/``b`` (final norm) and
    ``blocks``, a list with one dict per layer: ``attn.c_attn.{w (emb, 3 emb), b (3 emb)}``,
    ``attn.c_proj.{w, b}``, ``mlp.c_fc.{w, b}``, ``mlp.c_proj.{w, b}``, ``ln_1.{g, b}``,
    ``ln_2.{g, b}``.  As in the book, ``c_attn`` is split in three along its last axis into
    query, key and value, every ``w`` (stored ``(in, out)``) is transposed into a ``Linear``
    weight ``(out, in)``, and the output head is tied to ``wte`` (``out_head`` overrides that).
    ``gpt`` needs ``qkv_bias=True`` (GPT-2 has q/k/v biases).  Atomic: every shape is checked
    (``ValueError`` naming the entry) before anything is copied.
    """
    if not isinstance(gpt, GPTModel):
        raise TypeError(f"gpt: expected a GPTModel, got {type(gpt).__name__}")
    if not hasattr(params, "__getitem__"):
        raise TypeError(f"params: expected the book's nested dict of arrays, got {type(params).__name__}")
    if not gpt.cfg["qkv_bias"]:
        raise ValueError("gpt: GPT-2 weights have query/key/value biases; build the model with cfg['qkv_bias']=True")
    try:
        blocks = params["blocks"]
    except (KeyError, IndexError, TypeError):
        raise ValueError("params: expected an entry ['blocks'] (one dict per layer)") from None
    if len(blocks) != gpt.cfg["n_layers"]:
        raise ValueError(
            f"params['blocks']: expected {gpt.cfg['n_layers']} layers (cfg['n_layers']), got {len(blocks)}"
        )
    new = {
        "tok_emb.weight": _param(params, ("wte",)),
        "pos_emb.weight": _param(params, ("wpe",)),
        "final_norm.scale": _param(params, ("g",)),
        "final_norm.shift": _param(params, ("b",)),
    }
    new["out_head.weight"] = new["tok_emb.weight"] if out_head is None else to_numpy(out_head, "out_head")
    emb = gpt.cfg["emb_dim"]
    for i in range(len(blocks)):
        pre = f"trf_blocks.{i}."
        w = _param(params, ("blocks", i, "attn", "c_attn", "w"))
        b = _param(params, ("blocks", i, "attn", "c_attn", "b"))
        if w.shape != (emb, 3 * emb) or b.shape != (3 * emb,):
            raise ValueError(
                f"params['blocks'][{i}]['attn']['c_attn']: expected w {(emb, 3 * emb)} and "
                f"b {(3 * emb,)}, got {w.shape} and {b.shape}"
            )
        for name, wq, bq in zip(("W_query", "W_key", "W_value"), np.split(w, 3, axis=-1), np.split(b, 3, axis=-1)):
            new[f"{pre}att.{name}.weight"] = wq.T
            new[f"{pre}att.{name}.bias"] = bq
        for ours, theirs in (
            ("att.out_proj", ("attn", "c_proj")),
            ("ff.layers.0", ("mlp", "c_fc")),
            ("ff.layers.2", ("mlp", "c_proj")),
        ):
            new[f"{pre}{ours}.weight"] = _param(params, ("blocks", i) + theirs + ("w",)).T
            new[f"{pre}{ours}.bias"] = _param(params, ("blocks", i) + theirs + ("b",))
        for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
            new[f"{pre}{ours}.scale"] = _param(params, ("blocks", i, theirs, "g"))
            new[f"{pre}{ours}.shift"] = _param(params, ("blocks", i, theirs, "b"))
    gpt.load_state_dict(new, strict=False)  # atomic; the masks keep their values
    return gpt
