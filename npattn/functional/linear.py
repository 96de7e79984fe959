"""The affine map ``linear``: the public pair validates, the kernels ``linear_kernel`` /
``linear_backward_kernel`` compute."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .._docs import FD_CHECK, OP_BACKWARD_RAISES, backward_jvp_sections, jvp_sections, op_backward_args, shared_doc
from .._validate import as_float, check_backward_jvp, check_cache, check_grad, check_ndim, check_tangents_as
from ._bfloat16 import BFloat16Array, matmul_t

__all__ = ["LinearCache", "linear", "linear_backward", "linear_jvp", "linear_backward_jvp"]


class LinearCache(NamedTuple):
    x: np.ndarray  # (..., in)
    weight: np.ndarray  # (out, in)
    has_bias: bool


@shared_doc()
def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> tuple[np.ndarray, LinearCache]:
    """``y = x @ weight.T + bias`` with ``x (..., in)``, ``weight (out, in)``, ``bias (out,)``.

    Returns ``(y, cache)``; the cache holds ``(x, weight, has_bias)``.

    Parameters
    ----------
    x : array_like
        ``(..., in_features)``, float32 or float64 (integers are cast to float64).
    weight : array_like
        ``(out_features, in_features)``, torch's layout; cast to ``x``'s dtype.
    bias : array_like, optional
        ``(out_features,)``.

    Returns
    -------
    y : ndarray
        ``(..., out_features)``, in ``x``'s dtype.
    cache : LinearCache
        For ``linear_backward`` and ``linear_jvp``.

    Raises
    ------
    TypeError
        A non-numeric array, or float16/longdouble.
    ValueError
        ``x`` with no feature axis, ``weight`` not 2-d or not matching ``x``'s last axis, ``bias`` of
        the wrong shape.

    <examples>
    >>> x = np.arange(6.0).reshape(2, 3)
    >>> w = np.array([[1.0, 0.0, -1.0], [0.5, 0.5, 0.5]])
    >>> y, cache = F.linear(x, w, np.array([0.0, 1.0]))
    >>> y
    array([[-2. ,  2.5],
           [-2. ,  7. ]])
    >>> dx, dw, db = F.linear_backward(np.ones((2, 2)), cache)
    >>> dx.shape, dw.shape, db
    ((2, 3), (2, 3), array([2., 2.]))
    """
    x = as_float(x, "x")
    weight = as_float(weight, "weight", x.dtype)
    check_ndim(x, "x", 1, "(..., in_features)")
    if weight.ndim != 2:
        raise ValueError(f"weight: expected shape (out_features, in_features), got {weight.shape}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"weight: expected in_features {x.shape[-1]} (x's last dimension), got weight of shape {weight.shape}"
        )
    if bias is not None:
        bias = as_float(bias, "bias", x.dtype)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias: expected shape ({weight.shape[0]},), got {bias.shape}")
    return linear_kernel(x, weight, bias)


def linear_kernel(x, weight, bias=None, out=None):
    """The kernel of ``linear``; ``out``: an optional C-contiguous array of the output's shape and
    dtype to write ``y`` into (a module's workspace)."""
    n, d_out = math.prod(x.shape[:-1]), weight.shape[0]
    if isinstance(weight, BFloat16Array):  # bfloat16 storage: widened block by block into a reused buffer
        x2 = np.ascontiguousarray(x.reshape(n, x.shape[-1]), dtype=np.float32)
        y = matmul_t(x2, weight, None if out is None else out.reshape(n, d_out)).reshape(x.shape[:-1] + (d_out,))
    elif x.ndim > 2 and x.flags.c_contiguous:  # one (N, in) @ (in, out) GEMM, not one per leading index
        y2 = np.matmul(x.reshape(n, x.shape[-1]), weight.T, out=None if out is None else out.reshape(n, d_out))
        y = y2.reshape(x.shape[:-1] + (d_out,))
    else:
        y = np.matmul(x, weight.T, out=out)
    if bias is not None:
        y += bias
    return y, LinearCache(x, weight, bias is not None)


@shared_doc(backward_args=op_backward_args("linear"), backward_raises=OP_BACKWARD_RAISES)
def linear_backward(dout: np.ndarray, cache: LinearCache):
    """With ``y = x W^T + b``:  ``dx = dy W``, ``dW = dy^T x`` (summed over all leading dims),
    ``db = sum(dy)`` over the leading dims.  Returns ``(dx, dweight, dbias)``.

    <backward_args>

    Returns
    -------
    dx : ndarray
        Of ``x``'s shape.
    dweight : ndarray
        ``(out_features, in_features)``.
    dbias : ndarray or None
        ``(out_features,)``; None when the forward had no bias.

    <backward_raises>
    """
    check_cache(cache, LinearCache, "linear_backward")
    x, weight, _ = cache
    return linear_backward_kernel(check_grad(dout, x.shape[:-1] + (weight.shape[0],), x.dtype), cache)


def linear_backward_kernel(dout, cache, dx_out=None):
    """The kernel of ``linear_backward``; ``dx_out``: an optional C-contiguous array of ``x``'s
    shape and dtype to write ``dx`` into (a module's workspace)."""
    x, weight, has_bias = cache
    n = math.prod(x.shape[:-1])  # not reshape(-1, ...): that fails when a feature size is 0
    dy2 = dout.reshape(n, dout.shape[-1])  # (N, out): every GEMM below is one 2-d product
    dx = np.matmul(dy2, weight, out=None if dx_out is None else dx_out.reshape(n, x.shape[-1])).reshape(x.shape)
    dweight = dy2.T @ x.reshape(n, x.shape[-1])
    dbias = np.ones(n, dout.dtype) @ dy2 if has_bias else None  # the column sums: one BLAS matrix-vector product
    return dx, dweight, dbias


@shared_doc(
    jvp_sections=jvp_sections(
        "linear",
        "LinearCache",
        tangents="``tx (..., in)``, ``tweight (out, in)``, ``tbias (out,)``.",
        most="three tangents",
        wrong=", or ``tbias`` without a bias in the forward",
    ),
    fd_check=FD_CHECK,
)
def linear_jvp(cache: LinearCache, *tangents) -> np.ndarray:
    """Forward mode of ``linear``: the tangent of ``y = x W^T + b`` along ``(tx, tweight, tbias)``.

    ``y`` is bilinear in ``(x, W)`` and affine in ``b``, so its directional derivative is

        ty = tx W^T + x tW^T + tb

    (the product rule; a term whose tangent is None, i.e. zero, is skipped).  ``tangents`` come in
    the order ``linear_backward`` returns gradients, ``(tx, tweight, tbias)``, each of its input's
    shape or None; missing trailing ones are None; ``tbias`` must be None when the forward had no
    bias.

    <jvp_sections>

    <examples>
    >>> rng = np.random.default_rng(0)
    >>> x, tx = rng.standard_normal((3, 5)), rng.standard_normal((3, 5))
    >>> w, tw = rng.standard_normal((2, 5)), rng.standard_normal((2, 5))
    >>> out, cache = F.linear(x, w)
    >>> tout = F.linear_jvp(cache, tx, tw)
    >>> f = lambda s: F.linear(x + s * tx, w + s * tw)[0]
    <fd_check>
    """
    check_cache(cache, LinearCache, "linear_jvp")
    return linear_jvp_kernel(
        cache, *check_tangents_as(tangents, "linear_jvp", cache.x.dtype, _linear_tangent_specs(cache))
    )


def _linear_tangent_specs(cache):
    """``(name, shape[, present])`` of each tangent, in the backward's order."""
    x, weight, has_bias = cache
    return (("tx", x.shape), ("tweight", weight.shape), ("tbias", (weight.shape[0],), has_bias))


def linear_jvp_kernel(cache, tx=None, tweight=None, tbias=None):
    """The kernel of ``linear_jvp`` (tangents checked, None = zero)."""
    x, weight, _ = cache
    ty = None if tx is None else linear_kernel(tx, weight)[0]
    if tweight is not None:  # x tW^T, formed in place of the zero a missing tx would give
        part = linear_kernel(x, tweight)[0]
        ty = part if ty is None else np.add(ty, part, out=ty)
    if ty is None:
        ty = np.zeros(x.shape[:-1] + (weight.shape[0],), x.dtype)
    if tbias is not None:
        ty += tbias
    return ty


@shared_doc(
    backward_jvp_sections=backward_jvp_sections(
        "linear",
        "LinearCache",
        dout=", of the output's shape.",
        tangents="``(tx, tweight, tbias)`` as ``linear_jvp`` takes them; None (or left out at the end): zero.",
        grads="``(dx, dweight, dbias)``",
        grad_tangents="``(tdx, tdweight, tdbias)``, of the same shapes; ``tdbias`` None without a bias.",
        too_many="too many tangents, ",
        wrong="``dout``, ``ddout`` or a tangent of the wrong shape, or ``tbias`` without a bias.",
    ),
)
def linear_backward_jvp(dout: np.ndarray, cache: LinearCache, tangents, ddout=None):
    """Second order (forward over reverse): ``linear_backward``'s gradients and their tangents.

    The backward ``dx = dy W``, ``dW = dy^T x``, ``db = sum(dy)`` is bilinear in ``(dy, (x, W))``,
    so when ``(x, W, b)`` move along ``tangents = (tx, tweight, tbias)`` and ``dy`` along ``ddout``,
    the product rule gives

        tdx = ddy W + dy tW,   tdW = ddy^T x + dy^T tx,   tdb = sum(ddy)

    (``tb`` does not enter: the backward does not read ``b``).  The textbook tier derives it line
    by line (``npattn.functional.reference.linear_backward_jvp``).

    <backward_jvp_sections>

    <examples>
    >>> rng = np.random.default_rng(0)
    >>> x, tx = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    >>> w, dy = rng.standard_normal((2, 4)), rng.standard_normal((3, 2))
    >>> _, cache = F.linear(x, w)
    >>> (dx, dw, db), (tdx, tdw, tdb) = F.linear_backward_jvp(dy, cache, (tx,))
    >>> bool(np.allclose(tdw, dy.T @ tx)), bool(tdx.any()), db
    (True, False, None)
    """
    check_cache(cache, LinearCache, "linear_backward_jvp")
    x, weight, _ = cache
    dout, tangents, ddout = check_backward_jvp(
        dout,
        tangents,
        ddout,
        "linear_backward_jvp",
        x.shape[:-1] + (weight.shape[0],),
        x.dtype,
        _linear_tangent_specs(cache),
    )
    return linear_backward_jvp_kernel(dout, cache, tangents, ddout)


def linear_backward_jvp_kernel(dout, cache, tangents, ddout=None):
    """The kernel of ``linear_backward_jvp`` (``tangents`` the checked ``(tx, tweight, tbias)``)."""
    x, weight, has_bias = cache
    tx, tweight, _ = tangents
    grads = linear_backward_kernel(dout, cache)
    # ddy enters as dy did (the backward is linear in dy); tx and tW enter the backward of the
    # moved cache with dy: dx = dy tW, dW = dy^T tx
    if ddout is not None:
        tdx, tdweight, tdbias = linear_backward_kernel(ddout, cache)
    else:
        tdx, tdweight = np.zeros_like(grads[0]), np.zeros_like(grads[1])
        tdbias = np.zeros_like(grads[2]) if has_bias else None
    # only the products of a moving factor: a zero tangent's GEMM would add zeros (a third of a
    # Hessian-vector product's work in a projection whose input does not move)
    n = math.prod(x.shape[:-1])
    dy2 = dout.reshape(n, dout.shape[-1])
    if tweight is not None:
        tdx += np.matmul(dy2, tweight).reshape(x.shape)
    if tx is not None:
        tdweight += dy2.T @ tx.reshape(n, x.shape[-1])
    return grads, (tdx, tdweight, tdbias)
