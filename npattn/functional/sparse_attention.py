"""DeepSeek sparse attention (DSA, DeepSeek-V3.2): the lightning indexer, the top-k choice of keys,
attention restricted to the chosen keys, and the indexer's KL training loss.

The fast tier of the pairs in ``npattn.functional.reference`` (the derivations are there and in
``docs/derivations/sparse_attention.md``), proven equal to them by property tests:

* ``lightning_indexer``: ``I[l, t] = sum_h w[l, h] relu(scale q[h, l] . k[t])``, one batched matrix
  product for every head and one for the weighted sum over the heads (the textbook loops over them).
* ``index_topk``: each query's ``topk`` best keys among those a mask lets it see (``-1`` fills the
  slots of a query that sees fewer), as transformers' ``DeepseekV32Indexer`` chooses them.  Not a
  pair: the choice is piecewise constant, its derivative 0.
* ``sparse_attention``: the textbook form is attention with the mask ``[t in S_l]`` over all
  ``Lk`` keys; here the ``K`` chosen keys of each query are gathered and the softmax runs over
  them alone: work and memory ``O(Lq K)`` per head instead of ``O(Lq Lk)``, no ``(Lq, Lk)`` array.
  The backward scatters the gathered keys' gradients back to their positions (``np.add.at``: a
  key chosen by several queries sums their gradients).
* ``indexer_kl_loss``: ``sum_l KL(target_l || softmax(I_l))`` with the main attention's weights,
  summed over heads and normalised over the visible keys, as a fixed target.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .._docs import shared_doc
from .._validate import (
    as_floats_of_one_dtype,
    as_index,
    check_backward_jvp,
    check_cache,
    check_grad,
    check_positive_float,
    check_size,
    check_tangents_as,
    to_numpy,
)

__all__ = [
    "lightning_indexer",
    "lightning_indexer_backward",
    "lightning_indexer_jvp",
    "lightning_indexer_backward_jvp",
    "LightningIndexerCache",
    "index_topk",
    "sparse_attention",
    "sparse_attention_backward",
    "sparse_attention_jvp",
    "sparse_attention_backward_jvp",
    "SparseAttentionCache",
    "indexer_kl_loss",
    "indexer_kl_loss_backward",
    "indexer_kl_loss_jvp",
    "indexer_kl_loss_backward_jvp",
    "IndexerKLCache",
]


def _backward_jvp_sections(dout: str, cache: str, ddout: str = "ndarray or None") -> str:
    """The ``Parameters`` and ``Returns`` of this module's ``op_backward_jvp(dout, cache, tangents, ddout)``
    (``dout``, ``ddout``: their types; ``cache``: the cache's class)."""
    return f"""
    Parameters
    ----------
    dout : {dout}
    cache : {cache}
    tangents : tuple or None
    ddout : {ddout}

    Returns
    -------
    (grads, grad_tangents)
    """


def _bool_mask(mask, shape: tuple, meaning: str) -> np.ndarray:
    """``mask`` checked and broadcast to ``shape``: a bool array (True = ``meaning``), or a
    TypeError/ValueError naming it."""
    m = to_numpy(mask, "mask")
    if m.dtype != bool:
        raise TypeError(f"mask: expected a bool array (True = {meaning}), got dtype {m.dtype}")
    try:
        return np.broadcast_to(m, shape)
    except ValueError:
        raise ValueError(f"mask: expected a shape broadcastable to {shape}, got {m.shape}") from None


def _scale(scale, d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else check_positive_float(scale, "scale")


def _lead_of(a: np.ndarray, name: str, lead: tuple, tail: tuple, desc: str) -> None:
    """``a`` has exactly the shape ``lead + tail`` (``None`` in ``tail``: any size)."""
    want = lead + tail
    ok = a.ndim == len(want) and all(w is None or w == s for w, s in zip(want, a.shape))
    if not ok:
        shown = "(" + ", ".join("?" if w is None else str(w) for w in want) + ")"
        raise ValueError(f"{name}: expected shape {shown} ({desc}), got {a.shape}")


# -- the lightning indexer ---------------------------------------------------------------------------------
class LightningIndexerCache(NamedTuple):
    """What ``lightning_indexer_backward`` needs: the inputs and the scores before the ReLU."""

    q: np.ndarray  # (B..., H, Lq, D)
    k: np.ndarray  # (B..., Lk, D)
    weights: np.ndarray  # (B..., Lq, H)
    s: np.ndarray  # (B..., H, Lq, Lk) scale q k^T
    scale: float


def lightning_indexer(q, k, weights, *, scale=None) -> tuple[np.ndarray, LightningIndexerCache]:
    """The lightning indexer's scores (DeepSeek-V3.2): ``I (B..., Lq, Lk)``,
    ``I[l, t] = sum_h weights[l, h] * relu(scale * q[h, l] . k[t])``.

    Parameters
    ----------
    q : ndarray ``(B..., H, Lq, D)``
        Indexer queries, one per head (transformers: ``wq_b(q_resid)`` with RoPE on its first
        ``qk_rope_head_dim`` features).
    k : ndarray ``(B..., Lk, D)``
        Indexer keys, one per token shared by the heads (``k_norm(wk(x))``, rotated likewise).
    weights : ndarray ``(B..., Lq, H)``
        Each query's head weights (``weights_proj(x) * H**-0.5``).
    scale : float > 0, optional
        Default ``1 / sqrt(D)``.

    Returns
    -------
    (scores, cache)
        ``scores (B..., Lq, Lk)`` in the inputs' dtype.

    Raises
    ------
    TypeError, ValueError
        Naming the argument: non-float arrays or mixed float dtypes, shapes that do not fit
        (expected vs actual), a bad ``scale``.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn import functional as F
    >>> from npattn.functional import reference as R
    >>> rng = np.random.default_rng(0)
    >>> q, k, w = rng.standard_normal((2, 4, 3, 8)), rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 3, 4))
    >>> out, cache = F.lightning_indexer(q, k, w)
    >>> out.shape, bool(np.allclose(out, R.lightning_indexer(q, k, w)[0], rtol=0, atol=1e-12))
    ((2, 3, 5), True)
    """
    q, k, weights = as_floats_of_one_dtype(("q", q), ("k", k), ("weights", weights))
    if q.ndim < 3:
        raise ValueError(f"q: expected shape (B..., H, Lq, D), got {q.shape}")
    lead, (h, lq, d) = q.shape[:-3], q.shape[-3:]
    _lead_of(k, "k", lead, (None, d), "q's batch shape, then (Lk, D)")
    _lead_of(weights, "weights", lead, (lq, h), "q's batch shape, then (Lq, H)")
    return lightning_indexer_kernel(q, k, weights, _scale(scale, d))


def _head_sum(r, w):
    """``sum_h w[l, h] r[h, l, t]``: ``(B..., Lq, 1, H) @ (B..., Lq, H, Lk)``."""
    return (w[..., None, :] @ r.swapaxes(-3, -2))[..., 0, :]


def lightning_indexer_kernel(q, k, w, scale):
    """``lightning_indexer`` on checked arguments (``scale`` resolved)."""
    s = q @ k[..., None, :, :].swapaxes(-1, -2)  # (B..., H, Lq, Lk)
    s *= scale
    return _head_sum(np.maximum(s, 0), w), LightningIndexerCache(q, k, w, s, scale)


def _indexer_grads(ds, q, k, scale):
    """``dq = scale ds k``, ``dk = scale sum_h ds_h^T q_h`` (heads and queries in one product)."""
    dq = ds @ k[..., None, :, :]
    dq *= scale
    lead, (h, lq, lk) = ds.shape[:-3], ds.shape[-3:]
    dk = ds.swapaxes(-1, -2).swapaxes(-3, -2).reshape(lead + (lk, h * lq)) @ q.reshape(lead + (h * lq, -1))
    dk *= scale
    return dq, dk


def lightning_indexer_backward(dout, cache: LightningIndexerCache):
    """Gradients of ``lightning_indexer``: ``(dq, dk, dweights)`` (derivation: the textbook tier's
    ``lightning_indexer_backward``).

    Parameters
    ----------
    dout : ndarray ``(B..., Lq, Lk)``
    cache : LightningIndexerCache

    Returns
    -------
    (dq, dk, dweights)
    """
    check_cache(cache, LightningIndexerCache, "lightning_indexer_backward")
    dout = check_grad(dout, cache.s.shape[:-3] + cache.s.shape[-2:], cache.s.dtype)
    return _lightning_indexer_backward(dout, cache)


def _lightning_indexer_backward(dout, c):
    on = c.s > 0
    dw = (np.maximum(c.s, 0).swapaxes(-3, -2) @ dout[..., :, :, None])[..., 0]  # (B..., Lq, H)
    ds = c.weights.swapaxes(-1, -2)[..., :, :, None] * dout[..., None, :, :]  # w_h dI
    ds *= on
    dq, dk = _indexer_grads(ds, c.q, c.k, c.scale)
    return dq, dk, dw


def _indexer_specs(c: LightningIndexerCache):
    return (("tq", c.q.shape), ("tk", c.k.shape), ("tweights", c.weights.shape))


def _score_tangent(c, tq, tk):
    ts = np.zeros(c.s.shape, c.s.dtype)
    if tq is not None:
        ts += tq @ c.k[..., None, :, :].swapaxes(-1, -2)
    if tk is not None:
        ts += c.q @ tk[..., None, :, :].swapaxes(-1, -2)
    ts *= c.scale
    return ts


def lightning_indexer_jvp(cache: LightningIndexerCache, *tangents):
    """Forward mode of ``lightning_indexer`` along ``(tq, tk, tweights)`` (None or left out: zero):
    ``tI = sum_h (tw_h relu(s_h) + w_h [s_h > 0] ts_h)``, ``ts = scale (tq k^T + q tk^T)``.

    Parameters
    ----------
    cache : LightningIndexerCache
    *tangents : ndarray or None

    Returns
    -------
    ndarray ``(B..., Lq, Lk)``
    """
    c = check_cache(cache, LightningIndexerCache, "lightning_indexer_jvp")
    tq, tk, tw = check_tangents_as(tangents, "lightning_indexer_jvp", c.s.dtype, _indexer_specs(c))
    out = _head_sum(np.where(c.s > 0, _score_tangent(c, tq, tk), 0), c.weights)
    if tw is not None:
        out += _head_sum(np.maximum(c.s, 0), tw)
    return out


@shared_doc(backward_jvp_sections=_backward_jvp_sections("ndarray ``(B..., Lq, Lk)``", "LightningIndexerCache"))
def lightning_indexer_backward_jvp(dout, cache: LightningIndexerCache, tangents, ddout=None):
    """Second order of ``lightning_indexer`` (derivation: the textbook tier's): the backward's
    ``(dq, dk, dweights)`` and their tangents along ``tangents = (tq, tk, tweights)`` and ``ddout``.

    <backward_jvp_sections>
    """
    c = check_cache(cache, LightningIndexerCache, "lightning_indexer_backward_jvp")
    shape = c.s.shape[:-3] + c.s.shape[-2:]
    dout, (tq, tk, tw), ddout = check_backward_jvp(
        dout, tangents, ddout, "lightning_indexer_backward_jvp", shape, c.s.dtype, _indexer_specs(c)
    )
    grads = _lightning_indexer_backward(dout, c)
    on = c.s > 0
    tdout = np.zeros_like(dout) if ddout is None else ddout
    tr = np.where(on, _score_tangent(c, tq, tk), 0).swapaxes(-3, -2)  # (B..., Lq, H, Lk)
    tdw = (np.maximum(c.s, 0).swapaxes(-3, -2) @ tdout[..., :, :, None])[..., 0]
    tdw += (tr @ dout[..., :, :, None])[..., 0]
    wt = c.weights.swapaxes(-1, -2)[..., :, :, None]
    tds = wt * tdout[..., None, :, :]
    if tw is not None:
        tds += tw.swapaxes(-1, -2)[..., :, :, None] * dout[..., None, :, :]
    tds *= on
    tdq, tdk = _indexer_grads(tds, c.q, c.k, c.scale)
    ds = wt * dout[..., None, :, :] * on
    if tk is not None:
        tdq += _indexer_grads(ds, c.q, tk, c.scale)[0]
    if tq is not None:
        tdk += _indexer_grads(ds, tq, c.k, c.scale)[1]
    return grads, (tdq, tdk, tdw)


# -- the top-k choice ------------------------------------------------------------------------------------------
def index_topk(scores, topk: int, *, mask=None) -> np.ndarray:
    """Each query's ``topk`` highest-scoring keys among those it may see: ``indices (B..., Lq, K)``,
    ``K = min(topk, Lk)``, integer key positions (largest score first), ``-1`` for the slots of a
    query that sees fewer than ``K`` keys.  transformers' ``DeepseekV32Indexer`` adds its causal and
    padding mask to the scores and takes ``topk``; keys it picks among the hidden ones are hidden
    in the attention anyway, so the same keys attend.  Ties (equal scores) are broken by the lower
    key position; the choice is piecewise constant in the scores, so nothing is differentiated.

    Parameters
    ----------
    scores : ndarray ``(B..., Lq, Lk)``
        The indexer's scores (``lightning_indexer``).
    topk : int >= 1
    mask : bool ndarray broadcastable to ``(B..., Lq, Lk)`` or None
        True = the query may see that key (causal, padding); None: every key.

    Returns
    -------
    ndarray of int64 ``(B..., Lq, K)``

    Raises
    ------
    TypeError, ValueError
        Naming the argument: non-float scores, a ``topk`` that is not a positive integer, a mask
        that is not boolean or does not broadcast.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn import functional as F
    >>> s = np.array([[0.5, 2.0, 1.0, -1.0]] * 2)
    >>> F.index_topk(s, 2, mask=np.tril(np.ones((2, 4), bool)))     # query 0 sees key 0 only
    array([[ 0, -1],
           [ 1,  0]])
    """
    (scores,) = as_floats_of_one_dtype(("scores", scores))
    topk = check_size(topk, "topk")
    if scores.ndim < 2:
        raise ValueError(f"scores: expected shape (B..., Lq, Lk), got {scores.shape}")
    visible = None
    if mask is not None:
        visible = _bool_mask(mask, scores.shape, "may see")
    return index_topk_kernel(scores, topk, visible)


def index_topk_kernel(scores, topk, visible=None):
    """``index_topk`` on checked arguments (``visible`` None or bool of the scores' shape)."""
    k = min(topk, scores.shape[-1])
    z = scores if visible is None else np.where(visible, scores, -np.inf)
    order = np.argsort(-z, axis=-1, kind="stable")[..., :k]  # highest first, ties to the lower position
    if visible is None:
        return order
    return np.where(np.take_along_axis(visible, order, axis=-1), order, -1)


# -- attention over the chosen keys ------------------------------------------------------------------------------
class SparseAttentionCache(NamedTuple):
    """What ``sparse_attention_backward`` needs: the inputs, the gathered keys' weights."""

    q: np.ndarray  # (B..., H, Lq, E)
    k: np.ndarray  # (B..., Hk, Lk, E)
    v: np.ndarray  # (B..., Hk, Lk, Ev)
    indices: np.ndarray  # (B..., Lq, K), -1 for an empty slot
    p: np.ndarray  # (N, Hk, G, Lq, K) the softmax over each query's chosen keys (0 on empty slots)
    scale: float


def sparse_attention(q, k, v, indices, *, scale=None) -> tuple[np.ndarray, SparseAttentionCache]:
    """Attention restricted to chosen keys: query ``l`` attends to the keys ``indices[..., l, :]``
    only, ``out[h, l] = sum_j softmax_j(scale q[h, l] . k[t_j]) v[t_j]`` over its chosen ``t_j``
    (DeepSeek sparse attention's main attention).  The same numbers as the textbook form, attention
    with the mask ``[t in S_l]``, but the ``K`` chosen keys are gathered: no ``(Lq, Lk)`` array.

    Parameters
    ----------
    q : ndarray ``(B..., H, Lq, E)``
    k : ndarray ``(B..., Hk, Lk, E)``
        ``Hk`` divides ``H``; query head ``h`` reads kv head ``h // (H / Hk)`` (MLA's absorbed
        form: ``Hk = 1``).
    v : ndarray ``(B..., Hk, Lk, Ev)``
    indices : integer ndarray ``(B..., Lq, K)``
        Key positions in ``[0, Lk)``, distinct within a row, ``-1`` for an empty slot; the same
        keys for every head (``index_topk``).  A query with no key gets 0 and gradient 0.
    scale : float > 0, optional
        Default ``1 / sqrt(E)``.

    Returns
    -------
    (out, cache)
        ``out (B..., H, Lq, Ev)``.

    Raises
    ------
    TypeError, ValueError
        Naming the argument: non-float q/k/v or mixed dtypes, non-integer indices, shapes that do
        not fit, an index outside ``[-1, Lk)`` or repeated within a row, a bad ``scale``.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn import functional as F
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((1, 4, 6, 8)), rng.standard_normal((1, 1, 6, 8))
    >>> v = rng.standard_normal((1, 1, 6, 3))
    >>> idx = F.index_topk(rng.standard_normal((1, 6, 6)), 2, mask=np.tril(np.ones((6, 6), bool)))
    >>> out, _ = F.sparse_attention(q, k, v, idx)
    >>> dense, _ = F.scaled_dot_product_attention(q, k, v, (idx[..., None] == np.arange(6)).any(-2)[:, None],
    ...                                           enable_gqa=True)
    >>> bool(np.allclose(out, dense, rtol=0, atol=1e-12))
    True
    """
    q, k, v = as_floats_of_one_dtype(("q", q), ("k", k), ("v", v))
    indices = as_index(indices, "indices")
    if q.ndim < 3:
        raise ValueError(f"q: expected shape (B..., H, Lq, E), got {q.shape}")
    lead, (h, lq, e) = q.shape[:-3], q.shape[-3:]
    _lead_of(k, "k", lead, (None, None, e), "q's batch shape, then (Hk, Lk, E)")
    hk, lk = k.shape[-3:-1]
    _lead_of(v, "v", lead, (hk, lk, None), "k's shape but the last axis")
    if h % hk:
        raise ValueError(f"k: expected a number of heads dividing q's {h}, got {hk}")
    _lead_of(indices, "indices", lead, (lq, None), "q's batch shape, then (Lq, K)")
    if indices.size and (indices.min() < -1 or indices.max() >= lk):
        bad = indices.min() if indices.min() < -1 else indices.max()
        raise ValueError(f"indices: expected key positions in [-1, {lk}) (-1: an empty slot), got {bad}")
    srt = np.sort(indices, axis=-1)
    if ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any():
        raise ValueError("indices: a key is chosen twice by one query (expected distinct positions per row)")
    return sparse_attention_kernel(q, k, v, indices, _scale(scale, e))


def _folded(c_q, hk):
    """``(B..., H, Lq, E) -> (N, Hk, G, Lq, E)``: the query heads beside the kv head they read."""
    h, lq, e = c_q.shape[-3:]
    return c_q.reshape((-1, hk, h // hk, lq, e))


def _gather(x, indices):
    """``x (B..., Hk, Lk, F)`` at each query's chosen keys: ``(N, Hk, Lq, K, F)`` (slot -1 reads key 0;
    its weight is 0)."""
    hk, lk, f = x.shape[-3:]
    xf = x.reshape((-1, hk, lk, f))
    idx = np.maximum(indices, 0).reshape((xf.shape[0],) + indices.shape[-2:])  # (N, Lq, K)
    g = xf[np.arange(xf.shape[0])[:, None, None], :, idx]  # (N, Lq, K, Hk, F): advanced axes first
    return np.moveaxis(g, 3, 1)


def _scatter(dg, indices, shape):
    """The adjoint of ``_gather``: ``dg (N, Hk, Lq, K, F)`` summed into the keys' positions."""
    n = dg.shape[0]
    hk, lk, f = shape[-3:]
    out = np.zeros((n, lk, hk, f), dg.dtype)
    idx = np.maximum(indices, 0).reshape((n,) + indices.shape[-2:])
    np.add.at(out, (np.arange(n)[:, None, None], idx), np.moveaxis(dg, 1, 3))
    return out.swapaxes(1, 2).reshape(shape)


def sparse_attention_kernel(q, k, v, indices, scale):
    """``sparse_attention`` on checked arguments (``scale`` resolved)."""
    hk = k.shape[-3]
    valid = (indices >= 0).reshape((-1, 1, 1) + indices.shape[-2:])  # (N, 1, 1, Lq, K)
    qf, kg, vg = _folded(q, hk), _gather(k, indices), _gather(v, indices)
    s = np.einsum("nhgle,nhlke->nhglk", qf, kg) * scale
    s = np.where(valid, s, -np.inf)
    top = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(top), top, 0))  # exp(-inf) = 0 on empty slots
    total = p.sum(axis=-1, keepdims=True)
    p /= np.where(total > 0, total, 1)  # a query with no key: all 0
    out = np.einsum("nhglk,nhlkf->nhglf", p, vg)
    return out.reshape(q.shape[:-1] + v.shape[-1:]), SparseAttentionCache(q, k, v, indices, p, scale)


def sparse_attention_backward(dout, cache: SparseAttentionCache):
    """Gradients of ``sparse_attention``: ``(dq, dk, dv)`` (the indices, a piecewise-constant
    choice, get none).  On the gathered keys: ``dP = dO V^T``, ``dS = P (dP - rowsum(dP P))``,
    ``dq = scale dS K``, and the gathered keys' ``dK = scale dS^T q``, ``dV = P^T dO`` scattered
    back to their positions (summed where several queries chose one key).

    Parameters
    ----------
    dout : ndarray ``(B..., H, Lq, Ev)``
    cache : SparseAttentionCache

    Returns
    -------
    (dq, dk, dv)
    """
    c = check_cache(cache, SparseAttentionCache, "sparse_attention_backward")
    dout = check_grad(dout, c.q.shape[:-1] + c.v.shape[-1:], c.q.dtype)
    return _sparse_backward(dout, c)


def _sparse_backward(dout, c, kg=None, vg=None):
    hk = c.k.shape[-3]
    kg = _gather(c.k, c.indices) if kg is None else kg
    vg = _gather(c.v, c.indices) if vg is None else vg
    do = _folded(dout, hk)
    dp = np.einsum("nhglf,nhlkf->nhglk", do, vg)
    ds = c.p * (dp - (dp * c.p).sum(axis=-1, keepdims=True))
    dq = np.einsum("nhglk,nhlke->nhgle", ds, kg) * c.scale
    dkg = np.einsum("nhglk,nhgle->nhlke", ds, _folded(c.q, hk)) * c.scale
    dvg = np.einsum("nhglk,nhglf->nhlkf", c.p, do)
    return dq.reshape(c.q.shape), _scatter(dkg, c.indices, c.k.shape), _scatter(dvg, c.indices, c.v.shape)


def _sparse_specs(c: SparseAttentionCache):
    return (("tq", c.q.shape), ("tk", c.k.shape), ("tv", c.v.shape))


def _sparse_tangents(c, tq, tk, tv):
    """The gathered forward's tangents ``(tP, tO)`` (folded): ``ts = scale (tq K^T + q tK^T)``,
    ``tP = P (ts - rowsum(P ts))``, ``tO = tP V + P tV``; and the gathered ``tK``, ``tV``."""
    hk = c.k.shape[-3]
    kg, vg = _gather(c.k, c.indices), _gather(c.v, c.indices)
    ts = np.zeros(c.p.shape, c.p.dtype)
    if tq is not None:
        ts += np.einsum("nhgle,nhlke->nhglk", _folded(tq, hk), kg)
    tkg = None if tk is None else _gather(tk, c.indices)
    if tkg is not None:
        ts += np.einsum("nhgle,nhlke->nhglk", _folded(c.q, hk), tkg)
    ts *= c.scale
    tp = c.p * (ts - (c.p * ts).sum(axis=-1, keepdims=True))
    tvg = None if tv is None else _gather(tv, c.indices)
    to = np.einsum("nhglk,nhlkf->nhglf", tp, vg)
    if tvg is not None:
        to += np.einsum("nhglk,nhlkf->nhglf", c.p, tvg)
    return tp, to, kg, vg, tkg, tvg


def sparse_attention_jvp(cache: SparseAttentionCache, *tangents):
    """Forward mode of ``sparse_attention`` along ``(tq, tk, tv)`` (None or left out: zero), the
    choice fixed: ``tO = tP V + P tV`` on the gathered keys.

    Parameters
    ----------
    cache : SparseAttentionCache
    *tangents : ndarray or None

    Returns
    -------
    ndarray ``(B..., H, Lq, Ev)``
    """
    c = check_cache(cache, SparseAttentionCache, "sparse_attention_jvp")
    tq, tk, tv = check_tangents_as(tangents, "sparse_attention_jvp", c.q.dtype, _sparse_specs(c))
    return _sparse_tangents(c, tq, tk, tv)[1].reshape(c.q.shape[:-1] + c.v.shape[-1:])


@shared_doc(backward_jvp_sections=_backward_jvp_sections("ndarray ``(B..., H, Lq, Ev)``", "SparseAttentionCache"))
def sparse_attention_backward_jvp(dout, cache: SparseAttentionCache, tangents, ddout=None):
    """Second order of ``sparse_attention``: ``(dq, dk, dv)`` and their tangents along
    ``tangents = (tq, tk, tv)`` and ``ddout``, each line of the backward by the product rule
    (masked attention's, on the gathered keys; the choice fixed)::

        tdP = tdO V^T + dO tV^T;   tD = rowsum(tdP P + dP tP);   tdS = tP (dP - D) + P (tdP - tD)
        tdq = scale (tdS K + dS tK);   tdK = scale (tdS^T q + dS^T tq);   tdV = tP^T dO + P^T tdO

    <backward_jvp_sections>
    """
    c = check_cache(cache, SparseAttentionCache, "sparse_attention_backward_jvp")
    shape = c.q.shape[:-1] + c.v.shape[-1:]
    dout, (tq, tk, tv), ddout = check_backward_jvp(
        dout, tangents, ddout, "sparse_attention_backward_jvp", shape, c.q.dtype, _sparse_specs(c)
    )
    hk = c.k.shape[-3]
    tp, _, kg, vg, tkg, tvg = _sparse_tangents(c, tq, tk, tv)
    grads = _sparse_backward(dout, c, kg, vg)
    do = _folded(dout, hk)
    tdo = np.zeros_like(do) if ddout is None else _folded(ddout, hk)
    qf = _folded(c.q, hk)
    dp = np.einsum("nhglf,nhlkf->nhglk", do, vg)
    tdp = np.einsum("nhglf,nhlkf->nhglk", tdo, vg)
    if tvg is not None:
        tdp += np.einsum("nhglf,nhlkf->nhglk", do, tvg)
    d = (dp * c.p).sum(axis=-1, keepdims=True)
    td = (tdp * c.p + dp * tp).sum(axis=-1, keepdims=True)
    ds = c.p * (dp - d)
    tds = tp * (dp - d) + c.p * (tdp - td)
    tdq = np.einsum("nhglk,nhlke->nhgle", tds, kg)
    tdkg = np.einsum("nhglk,nhgle->nhlke", tds, qf)
    if tkg is not None:
        tdq += np.einsum("nhglk,nhlke->nhgle", ds, tkg)
    if tq is not None:
        tdkg += np.einsum("nhglk,nhgle->nhlke", ds, _folded(tq, hk))
    tdvg = np.einsum("nhglk,nhglf->nhlkf", tp, do) + np.einsum("nhglk,nhglf->nhlkf", c.p, tdo)
    tdq *= c.scale
    tdkg *= c.scale
    return grads, (
        tdq.reshape(c.q.shape),
        _scatter(tdkg, c.indices, c.k.shape),
        _scatter(tdvg, c.indices, c.v.shape),
    )


# -- the indexer's training loss ----------------------------------------------------------------------------------
class IndexerKLCache(NamedTuple):
    """What ``indexer_kl_loss_backward`` needs: the indexer's distribution, the target and the weights."""

    p_index: np.ndarray  # (B..., Lq, Lk) softmax of the indexer's scores over the visible keys
    target: np.ndarray  # (B..., Lq, Lk) the main attention's distribution (heads summed, normalised)
    has_target: np.ndarray  # (B..., Lq, 1) 1 where the row's target has mass, else 0
    weight: float  # 1 ("sum") or 1 / rows ("mean")


def indexer_kl_loss(scores, attn, *, mask=None, reduction: str = "sum") -> tuple[np.ndarray, IndexerKLCache]:
    """The lightning indexer's training loss (DeepSeek-V3.2): per query row,
    ``KL(target || softmax(scores))`` over the visible keys, where ``target`` is the main
    attention's weights summed over the heads and normalised over the visible keys, held fixed
    (detached: no gradient); summed over the rows (``"sum"``, DeepSeek's formula) or averaged
    (``"mean"``, over every query row).  ``0 log 0 = 0``; a row with no visible key or no target
    mass adds 0.

    Parameters
    ----------
    scores : ndarray ``(B..., Lq, Lk)``
        The indexer's scores (``lightning_indexer``).
    attn : ndarray ``(B..., H, Lq, Lk)``
        The main attention's weights (non-negative).
    mask : bool ndarray broadcastable to ``(B..., Lq, Lk)`` or None
        True = visible (causal; in DeepSeek's sparse stage the chosen keys); None: every key.
    reduction : ``"sum"`` or ``"mean"``

    Returns
    -------
    (loss, cache)
        ``loss`` a 0-d array of the scores' dtype.

    Raises
    ------
    TypeError, ValueError
        Naming the argument: non-float arrays or mixed dtypes, shapes that do not fit, a negative
        attention weight, a non-boolean or non-broadcasting mask, an unknown ``reduction``.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn import functional as F
    >>> rng = np.random.default_rng(0)
    >>> s, a = rng.standard_normal((4, 4)), rng.random((2, 4, 4))
    >>> loss, cache = F.indexer_kl_loss(s, a, mask=np.tril(np.ones((4, 4), bool)))
    >>> bool(loss > 0), F.indexer_kl_loss_backward(1.0, cache).shape
    (True, (4, 4))
    """
    scores, attn = as_floats_of_one_dtype(("scores", scores), ("attn", attn))
    if scores.ndim < 2:
        raise ValueError(f"scores: expected shape (B..., Lq, Lk), got {scores.shape}")
    _lead_of(attn, "attn", scores.shape[:-2], (None,) + scores.shape[-2:], "scores' batch shape, then (H, Lq, Lk)")
    if attn.size and not (attn >= 0).all():
        raise ValueError("attn: expected attention weights >= 0 (a distribution per head), got a negative or NaN")
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction: expected 'sum' or 'mean', got {reduction!r}")
    visible = np.ones(scores.shape, bool)
    if mask is not None:
        visible = _bool_mask(mask, scores.shape, "visible")
    return indexer_kl_loss_kernel(scores, attn, visible, reduction)


def indexer_kl_loss_kernel(scores, attn, visible, reduction="sum"):
    """``indexer_kl_loss`` on checked arguments (``visible`` bool of the scores' shape)."""
    mass = attn.sum(axis=-3)
    mass *= visible
    total = mass.sum(axis=-1, keepdims=True)
    has = total > 0
    target = mass / np.where(has, total, 1)
    z = np.where(visible, scores, -np.inf)
    top = z.max(axis=-1, keepdims=True)
    z -= np.where(np.isfinite(top), top, 0)
    e = np.exp(z)
    norm = e.sum(axis=-1, keepdims=True)
    safe = np.where(norm > 0, norm, 1)
    p_index = e / safe
    pos = target > 0
    log_ratio = np.log(np.where(pos, target, 1)) - np.where(pos, z, 0) + np.log(safe)
    rows = math.prod(scores.shape[:-1])
    weight = 1.0 if reduction == "sum" else 1.0 / max(rows, 1)
    loss = np.asarray((target * log_ratio).sum() * weight, dtype=scores.dtype)
    return loss, IndexerKLCache(p_index, target, has.astype(scores.dtype), weight)


def _kl_grad(c: IndexerKLCache):
    return c.weight * (c.has_target * c.p_index - c.target)


def indexer_kl_loss_backward(dout, cache: IndexerKLCache):
    """Gradient of ``indexer_kl_loss`` in the scores: ``dscores = dout * weight * (q - p)`` per row
    (``q`` the indexer's softmax, ``p`` the target; 0 on a row without target).

    Parameters
    ----------
    dout : float or 0-d ndarray
    cache : IndexerKLCache

    Returns
    -------
    ndarray ``(B..., Lq, Lk)``
    """
    c = check_cache(cache, IndexerKLCache, "indexer_kl_loss_backward")
    dout = check_grad(dout, (), c.p_index.dtype)
    return dout * _kl_grad(c)


def indexer_kl_loss_jvp(cache: IndexerKLCache, *tangents):
    """Forward mode of ``indexer_kl_loss`` along ``tscores`` (the target is fixed):
    ``tloss = sum weight (q - p) tscores``.

    Parameters
    ----------
    cache : IndexerKLCache
    *tangents : ndarray or None

    Returns
    -------
    0-d ndarray
    """
    c = check_cache(cache, IndexerKLCache, "indexer_kl_loss_jvp")
    (ts,) = check_tangents_as(tangents, "indexer_kl_loss_jvp", c.p_index.dtype, (("tscores", c.p_index.shape),))
    if ts is None:
        return np.zeros((), c.p_index.dtype)
    return np.asarray((_kl_grad(c) * ts).sum())


@shared_doc(
    backward_jvp_sections=_backward_jvp_sections("float or 0-d ndarray", "IndexerKLCache", "float, 0-d ndarray or None")
)
def indexer_kl_loss_backward_jvp(dout, cache: IndexerKLCache, tangents, ddout=None):
    """Second order of ``indexer_kl_loss``: ``dscores`` and its tangent along ``(tscores,)`` and
    ``ddout``: ``ddout w (h q - p) + dout w h q (ts - rowsum(q ts))`` (softmax's Jacobian).

    <backward_jvp_sections>
    """
    c = check_cache(cache, IndexerKLCache, "indexer_kl_loss_backward_jvp")
    dout, (ts,), ddout = check_backward_jvp(
        dout, tangents, ddout, "indexer_kl_loss_backward_jvp", (), c.p_index.dtype, (("tscores", c.p_index.shape),)
    )
    g = _kl_grad(c)
    tgrad = np.zeros_like(g) if ddout is None else ddout * g
    if ts is not None:
        q = c.p_index
        tgrad = tgrad + dout * c.weight * c.has_target * q * (ts - (q * ts).sum(axis=-1, keepdims=True))
    return (dout * g,), (tgrad,)
