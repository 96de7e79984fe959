"""Row lookup: ``embedding`` and ``embedding_backward``, with torch's options.

The public pair validates and calls the unvalidated kernels ``embedding_kernel`` / ``embedding_backward_kernel``.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np

from .._docs import FD_CHECK, OP_BACKWARD_RAISES, backward_jvp_sections, jvp_sections, op_backward_args, shared_doc
from .._validate import (
    as_float,
    as_index,
    check_backward_jvp,
    check_bool,
    check_cache,
    check_grad,
    check_tangents_as,
)

__all__ = ["EmbeddingCache", "embedding", "embedding_backward", "embedding_jvp", "embedding_backward_jvp"]


_RENORM_EPS = 1e-7  # torch's embedding_renorm_: scale = max_norm / (norm + 1e-7)


class EmbeddingCache(NamedTuple):
    ids: np.ndarray  # integer, any shape
    weight_shape: tuple  # (num_embeddings, embedding_dim)
    dtype: np.dtype
    padding_idx: int | None  # in [0, num_embeddings): that row gets no gradient
    scale_grad_by_freq: bool


@shared_doc()
def embedding(
    ids,
    weight: np.ndarray,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
) -> tuple[np.ndarray, EmbeddingCache]:
    """Row lookup ``out[...] = weight[ids[...]]``; ``ids`` integer of any shape, ``weight (num, dim)``.

    Options, with ``torch.nn.functional.embedding``'s semantics for outputs and gradients:

    - ``padding_idx``: an int in ``[-num, num)`` (negative counts from the end); that row gets no
      gradient (its ``dweight`` row is 0).  The output still reads the row as it is (the module
      ``Embedding`` starts it at zero; the functional op does not touch it).
    - ``max_norm``: a float > 0.  Every looked-up row whose ``norm_type``-norm exceeds ``max_norm``
      is scaled by ``max_norm / (norm + 1e-7)`` in the OUTPUT.  torch does this by renormalising the
      given weight in place (``embedding_renorm_`` under ``no_grad``); here the given ``weight`` is
      never modified (use the module ``Embedding``, which renormalises its own rows as torch does).
      As in torch the rescaling is not differentiated: torch's gradient is the plain scatter-add of
      ``dout`` into the rows (the renormalised weight is treated as a constant leaf), so
      ``dweight`` is that same scatter-add, with or without ``max_norm``.
    - ``norm_type``: the p of the p-norm for ``max_norm``, a float > 0 or ``inf`` (default 2).
    - ``scale_grad_by_freq``: divide each row's gradient by the number of times it occurs in ``ids``.

    Returns ``(out (*ids.shape, dim), cache)``; ids outside ``[0, num)`` raise ``ValueError``.

    Parameters
    ----------
    ids : array_like of int
        Any shape; each in ``[0, num)``.
    weight : array_like
        ``(num, dim)``, float32 or float64.
    padding_idx : int, optional
        A row that gets no gradient.
    max_norm : float, optional
        Looked-up rows longer than this (in ``norm_type``) are rescaled in the output.
    norm_type : float
        The p of the p-norm for ``max_norm``.
    scale_grad_by_freq : bool
        Divide each row's gradient by how often its id occurs.

    Returns
    -------
    out : ndarray
        ``ids.shape + (dim,)``, in ``weight``'s dtype.
    cache : EmbeddingCache
        For ``embedding_backward`` and ``embedding_jvp``.

    Raises
    ------
    TypeError
        Non-integer ``ids``, a non-numeric ``weight``, a non-bool flag.
    ValueError
        An id out of range, ``weight`` not 2-d, ``padding_idx`` out of range, a non-positive
        ``max_norm``.

    <examples>
    >>> W = np.arange(8.0).reshape(4, 2)
    >>> out, cache = F.embedding(np.array([[1, 3, 1]]), W)
    >>> out
    array([[[2., 3.],
            [6., 7.],
            [2., 3.]]])
    >>> F.embedding_backward(np.ones((1, 3, 2)), cache)   # row 1 was looked up twice
    array([[0., 0.],
           [2., 2.],
           [0., 0.],
           [1., 1.]])
    """
    ids = as_index(ids, "ids")
    weight = as_float(weight, "weight")
    if weight.ndim != 2:
        raise ValueError(f"weight: expected shape (num_embeddings, embedding_dim), got {weight.shape}")
    num = weight.shape[0]
    if ids.size and (ids.min() < 0 or ids.max() >= num):
        bad = ids.min() if ids.min() < 0 else ids.max()
        raise ValueError(f"ids: expected values in [0, {num}), got {bad}")
    if padding_idx is not None:
        if isinstance(padding_idx, bool) or not isinstance(padding_idx, numbers.Integral):
            raise TypeError(f"padding_idx: expected an int or None, got {padding_idx!r}")
        if not -num <= padding_idx < num:
            raise ValueError(
                f"padding_idx: expected a value in [{-num}, {num}) (num_embeddings {num}), got {padding_idx}"
            )
        padding_idx = int(padding_idx) % num
    if max_norm is not None:
        if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real):
            raise TypeError(f"max_norm: expected a float or None, got {max_norm!r}")
        if not (math.isfinite(max_norm) and max_norm > 0):
            raise ValueError(f"max_norm: expected a finite number > 0, got {max_norm}")
        max_norm = float(max_norm)
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real):
        raise TypeError(f"norm_type: expected a float, got {norm_type!r}")
    if not norm_type > 0:  # also refuses NaN; inf is the max-norm
        raise ValueError(f"norm_type: expected a number > 0 (or inf), got {norm_type}")
    scale_grad_by_freq = check_bool(scale_grad_by_freq, "scale_grad_by_freq")
    return embedding_kernel(ids, weight, padding_idx, max_norm, float(norm_type), scale_grad_by_freq)


def embedding_kernel(ids, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False):
    """Kernel: ``padding_idx`` already in ``[0, num)``."""
    out = weight[ids]  # (*ids.shape, dim), a copy
    if max_norm is not None and out.size:
        # torch renormalises each distinct looked-up row once: the same scale for every occurrence
        norms = np.linalg.norm(out, ord=norm_type, axis=-1)  # (*ids.shape,)
        over = norms > max_norm
        if over.any():
            scale = max_norm / (norms[over].astype(np.float64) + _RENORM_EPS)
            out[over] *= scale.astype(out.dtype)[:, None]
    cache = EmbeddingCache(ids, weight.shape, weight.dtype, padding_idx, scale_grad_by_freq)
    return out, cache


@shared_doc(backward_args=op_backward_args("embedding"), backward_raises=OP_BACKWARD_RAISES)
def embedding_backward(dout: np.ndarray, cache: EmbeddingCache) -> np.ndarray:
    """A lookup copies rows, so its gradient scatter-adds: ``dW[i] = sum of dy where ids == i``.

    With ``scale_grad_by_freq`` each ``dW[i]`` is divided by the count of ``i`` in ``ids``; the
    ``padding_idx`` row is 0.  ``max_norm`` changes nothing here (see ``embedding``: torch does not
    differentiate the renormalisation).  Returns ``dweight`` (ids have no gradient).

    <backward_args>

    Returns
    -------
    ndarray
        ``dweight``, ``(num, dim)``.

    <backward_raises>
    """
    check_cache(cache, EmbeddingCache, "embedding_backward")
    return embedding_backward_kernel(check_grad(dout, cache.ids.shape + (cache.weight_shape[1],), cache.dtype), cache)


def embedding_backward_kernel(dout, cache):
    ids, wshape, dtype, padding_idx, scale_grad_by_freq = cache
    flat = ids.reshape(-1)
    rows = dout.reshape(-1, wshape[1])
    dweight = np.zeros(wshape, dtype=dtype)
    if flat.size:
        # dweight[i] = the sum of the rows of dout whose id is i.  Not np.add.at (a slow scatter,
        # one row at a time): sort the ids, then one add.reduceat sums each run of equal ids.
        order = np.argsort(flat, kind="stable")
        ids_sorted = flat[order]
        starts = np.flatnonzero(np.concatenate(([True], ids_sorted[1:] != ids_sorted[:-1])))
        dweight[ids_sorted[starts]] = np.add.reduceat(rows[order], starts, axis=0)
    if scale_grad_by_freq:
        counts = np.bincount(flat, minlength=wshape[0])
        dweight /= np.maximum(counts, 1).astype(dtype)[:, None]
    if padding_idx is not None:
        dweight[padding_idx] = 0
    return dweight


@shared_doc(
    jvp_sections=jvp_sections(
        "embedding",
        "EmbeddingCache",
        tangents="``tweight``, of ``weight``'s shape ``(num_embeddings, embedding_dim)`` (None: zero).",
        returns="``tout``, of the output's shape ``(*ids.shape, embedding_dim)`` and dtype.",
    ),
    fd_check=FD_CHECK,
)
def embedding_jvp(cache: EmbeddingCache, *tangents) -> np.ndarray:
    """Forward mode of ``embedding``: the lookup is linear in ``weight``, so ``tout = tweight[ids]``.

    This is the directional derivative of the lookup, as ``torch.func.jvp`` gives it: the options
    that change only torch's backward (``padding_idx``: no gradient for that row;
    ``scale_grad_by_freq``: gradients divided by counts) do not enter it, and ``max_norm``'s
    renormalisation is, as in the backward and in torch, a change of the weight made before the
    lookup and not differentiated (the tangent row is not rescaled).  So ``<u, J v> = <J^T u, v>``
    with ``embedding_backward`` holds without ``padding_idx`` and ``scale_grad_by_freq``.
    ``ids`` are integers: they have no tangent.

    <jvp_sections>

    <examples>
    >>> rng = np.random.default_rng(0)
    >>> W, tW = rng.standard_normal((6, 3)), rng.standard_normal((6, 3))
    >>> ids = np.array([[0, 5, 5]])
    >>> out, cache = F.embedding(ids, W)
    >>> tout = F.embedding_jvp(cache, tW)
    >>> f = lambda s: F.embedding(ids, W + s * tW)[0]
    <fd_check>
    """
    check_cache(cache, EmbeddingCache, "embedding_jvp")
    return embedding_jvp_kernel(
        cache, *check_tangents_as(tangents, "embedding_jvp", cache.dtype, _embedding_tangent_specs(cache))
    )


def _embedding_tangent_specs(cache):
    """``(name, shape)`` of the one tangent, ``tweight``."""
    return (("tweight", cache.weight_shape),)


def embedding_jvp_kernel(cache, tweight=None):
    """The kernel of ``embedding_jvp`` (``tweight`` checked, None = zero)."""
    if tweight is None:
        return np.zeros(cache.ids.shape + (cache.weight_shape[1],), cache.dtype)
    return tweight[cache.ids]


@shared_doc(
    backward_jvp_sections=backward_jvp_sections(
        "embedding",
        "EmbeddingCache",
        dout=", of the output's shape.",
        tangents="``(tweight,)`` as ``embedding_jvp`` takes it; None or ``()``: zero.",
        grads="``dweight``",
        grad_tangents="``tdweight``, of ``weight``'s shape.",
        too_many="",
        wrong="``dout``, ``ddout`` or ``tweight`` of the wrong shape.",
    )
)
def embedding_backward_jvp(dout: np.ndarray, cache: EmbeddingCache, tangents, ddout=None):
    """Second order (forward over reverse): ``embedding_backward``'s gradient and its tangent.

    The backward scatter-adds ``dy`` into the rows of ``ids`` (divided by the counts with
    ``scale_grad_by_freq``, the ``padding_idx`` row zeroed): it is linear in ``dy`` and does not
    read ``weight``.  So moving ``weight`` along ``tweight`` changes nothing, and moving ``dy``
    along ``ddout`` moves ``dweight`` by the same scatter-add of ``ddout``: ``tdweight =
    embedding_backward(ddout)`` (zero without ``ddout``).

    <backward_jvp_sections>
    """
    check_cache(cache, EmbeddingCache, "embedding_backward_jvp")
    dout, tangents, ddout = check_backward_jvp(
        dout,
        tangents,
        ddout,
        "embedding_backward_jvp",
        cache.ids.shape + (cache.weight_shape[1],),
        cache.dtype,
        _embedding_tangent_specs(cache),
    )
    return embedding_backward_jvp_kernel(dout, cache, tangents, ddout)


def embedding_backward_jvp_kernel(dout, cache, tangents=(None,), ddout=None):
    """The kernel of ``embedding_backward_jvp``: ``tweight`` does not enter."""
    grads = embedding_backward_kernel(dout, cache)
    return grads, (np.zeros_like(grads) if ddout is None else embedding_backward_kernel(ddout, cache))
