"""Normalisation over trailing axes: ``layer_norm`` and ``rms_norm``.

Both normalise each slice over the trailing ``len(normalized_shape)`` axes of ``x`` (one "row" of
``N = prod(normalized_shape)`` values); ``weight`` and ``bias`` have shape ``normalized_shape``.
The public ops validate and call the unvalidated kernels ``layer_norm_kernel`` / ``rms_norm_kernel``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import numpy as np

from .._docs import (
    FD_CHECK,
    OP_BACKWARD_RAISES,
    SEVERAL_TANGENTS,
    backward_jvp_sections,
    jvp_sections,
    op_backward_args,
    shared_doc,
)
from .._validate import (
    as_float,
    check_backward_jvp,
    check_cache,
    check_grad,
    check_ndim,
    check_normalized_shape,
    check_positive_float,
    check_tangents_as,
)

__all__ = [
    "LayerNormCache",
    "RMSNormCache",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_jvp",
    "layer_norm_backward_jvp",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_jvp",
    "rms_norm_backward_jvp",
]


class LayerNormCache(NamedTuple):
    xhat: np.ndarray  # (x - mean) * rstd, x's shape
    rstd: np.ndarray  # 1 / sqrt(var + eps), x's shape with the normalised axes kept as 1
    weight: Optional[np.ndarray]
    has_bias: bool
    ndim: int  # how many trailing axes are normalised


class RMSNormCache(NamedTuple):
    xhat: np.ndarray  # x * rstd
    rstd: np.ndarray  # 1 / sqrt(mean(x^2) + eps)
    weight: Optional[np.ndarray]
    ndim: int


def _check_norm_args(x, weight, bias, normalized_shape, eps):
    """Shared checks: returns ``(x, weight, bias, normalized_shape, eps)`` cast and resolved."""
    x = as_float(x, "x")
    check_ndim(x, "x", 1, "(..., features)")
    if weight is not None:
        weight = as_float(weight, "weight", x.dtype)
    if normalized_shape is not None:
        ns = check_normalized_shape(normalized_shape, x.shape)
        if weight is not None and weight.shape != ns:
            raise ValueError(f"weight: expected shape {ns} (normalized_shape), got {weight.shape}")
    elif weight is not None:
        ns = weight.shape
        if weight.ndim == 0 or weight.ndim > x.ndim or x.shape[x.ndim - weight.ndim :] != ns:
            raise ValueError(
                f"weight: expected shape ({x.shape[-1]},) (x's last dimension) or the shape of more "
                f"trailing axes of x {x.shape}, got {weight.shape}"
            )
    else:
        ns = x.shape[-1:]
    if math.prod(ns) < 1:
        raise ValueError(f"x: expected at least 1 feature in the normalised axes {ns}, got shape {x.shape}")
    if bias is not None:
        bias = as_float(bias, "bias", x.dtype)
        if bias.shape != ns:
            where = "normalized_shape" if normalized_shape is not None or weight is not None else "x's last dimension"
            raise ValueError(f"bias: expected shape {ns} ({where}), got {bias.shape}")
    if eps is not None:
        eps = check_positive_float(eps, "eps", allow_zero=True)
    return x, weight, bias, ns, eps


def _axes(x, normalized_shape, weight):
    k = len(normalized_shape) if normalized_shape is not None else (weight.ndim if weight is not None else 1)
    return k, tuple(range(x.ndim - k, x.ndim))


@functools.lru_cache(maxsize=16)
def _ones(n: int, dtype: str) -> np.ndarray:
    """A read-only vector of ``n`` ones (``_mean``'s, made once per size: a decoding step asks for
    it twice per layer)."""
    ones = np.ones(n, dtype)
    ones.flags.writeable = False
    return ones


def _mean(a, k):
    """The mean over the last ``k`` axes of ``a``, kept as size-1 axes.  For a C-contiguous ``a``
    it is one matrix-vector product ``(N, n) @ ones(n) / n``: BLAS sums the short rows 3-8x faster
    than ``a.mean`` does (its reduction restarts for every row)."""
    n = math.prod(a.shape[a.ndim - k :])
    lead = a.shape[: a.ndim - k]
    if n == 0 or not a.flags.c_contiguous:
        return a.mean(axis=tuple(range(a.ndim - k, a.ndim)), keepdims=True)
    sums = np.matmul(a.reshape(math.prod(lead), n), _ones(n, a.dtype.char))
    sums /= n
    return sums.reshape(lead + (1,) * k)


def _one_rstd(y, eps: float):
    """``1 / sqrt(mean(x^2) + eps)`` of a single slice from its squares ``y`` (C-contiguous), as a
    scalar of ``y``'s dtype, the array path's numbers: ``_mean``'s product, then ``/ n``, ``+ eps``,
    the square root and the reciprocal, each rounded to the dtype (a square root taken in double
    and rounded to float32 is float32's own, correctly rounded), and 0 for a slice of zeros with no
    eps.  Scalars, not four ufunc calls on 1-element arrays: a decoding step normalises about three
    single rows a layer."""
    n = y.size
    ms = np.matmul(y.reshape(1, n), _ones(n, y.dtype.char))[0] / n + eps
    return y.dtype.type(1.0) / y.dtype.type(math.sqrt(ms)) if ms else y.dtype.type(0.0)


# ------------------------------------------------------------------------------------ layer_norm


def _forward_tail(op: str, cache: str) -> str:
    """A norm's forward sections from ``normalized_shape`` to its ``TypeError`` (its ``ValueError``
    follows in its own docstring)."""
    return f"""
    normalized_shape : int or tuple of int, optional
        The trailing axes to normalise over.

    Returns
    -------
    y : ndarray
        Of ``x``'s shape and dtype.
    cache : {cache}
        For ``{op}_backward`` and ``{op}_jvp``.

    Raises
    ------
    TypeError
        A non-numeric array, or a non-integer ``normalized_shape``.
    """


@shared_doc(forward_tail=_forward_tail("layer_norm", "LayerNormCache"))
def layer_norm(
    x: np.ndarray,
    weight: Optional[np.ndarray] = None,
    bias: Optional[np.ndarray] = None,
    eps: float = 1e-5,
    *,
    normalized_shape=None,
) -> tuple[np.ndarray, LayerNormCache]:
    """``y = (x - mean) / sqrt(var + eps) * weight + bias`` over the trailing axes (biased variance).

    The normalised axes are ``normalized_shape`` (an int or a tuple: the trailing axes of x, as
    ``torch.nn.functional.layer_norm``); by default ``weight.shape`` when a weight is given, else
    the last axis.  ``weight`` and ``bias`` have shape ``normalized_shape``.

    A slice of zero variance (constant values) gives ``y = bias`` and finite gradients; with ``eps=0``
    such a slice would be ``0 / 0``: it is normalised to 0 instead of NaN (``y = bias``, ``dx = 0``).
    Returns ``(y, cache)``.

    Parameters
    ----------
    x : array_like
        ``(..., *normalized_shape)``, float32 or float64.
    weight, bias : array_like, optional
        Of shape ``normalized_shape`` (the affine scale and shift).
    eps : float
        Added to the variance, >= 0.
    <forward_tail>
    ValueError
        ``normalized_shape`` not the trailing axes of ``x``, ``weight``/``bias`` of another shape, a
        negative or non-finite ``eps``.

    <examples>
    >>> y, cache = F.layer_norm(np.array([[1.0, 2.0, 3.0, 4.0]]), np.ones(4), np.zeros(4))
    >>> np.round(y, 4)
    array([[-1.3416, -0.4472,  0.4472,  1.3416]])
    >>> dx, dweight, dbias = F.layer_norm_backward(np.array([[1.0, 0.0, 0.0, 0.0]]), cache)
    >>> np.round(dx.sum(), 12)   # shifting x changes nothing: the gradient sums to zero
    0.0
    """
    x, weight, bias, ns, eps = _check_norm_args(x, weight, bias, normalized_shape, eps)
    return layer_norm_kernel(x, weight, bias, eps, normalized_shape=ns)


def layer_norm_kernel(x, weight=None, bias=None, eps=1e-5, *, normalized_shape=None):
    k, _ = _axes(x, normalized_shape, weight)
    mu = _mean(x, k)
    xc = x - mu
    y = np.multiply(xc, xc)  # (x - mu)^2, in what becomes y's buffer
    var = _mean(y, k)
    std = np.sqrt(var + eps)
    if eps == 0.0:
        std[std == 0] = np.inf  # zero variance, no eps: rstd = 0, so xhat = 0 (not 0/0)
    rstd = 1.0 / std
    xhat = np.multiply(xc, rstd, out=xc)  # xhat = (x - mu) * rstd, in place
    if weight is not None:
        np.multiply(xhat, weight, out=y)
    else:
        np.copyto(y, xhat)
    if bias is not None:
        y += bias
    return y, LayerNormCache(xhat, rstd, weight, bias is not None, k)


@shared_doc(backward_args=op_backward_args("layer_norm"), backward_raises=OP_BACKWARD_RAISES)
def layer_norm_backward(dout: np.ndarray, cache: LayerNormCache):
    """With ``xhat = (x - mu) * rstd`` and ``g = dy * weight`` (the gradient at xhat):

    ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` (means over the normalised axes: the two
    terms are the gradients through ``mu`` and through ``var``), ``dweight = sum(dy * xhat)``,
    ``dbias = sum(dy)`` over all leading axes.  Returns ``(dx, dweight, dbias)``, None where absent.

    <backward_args>

    Returns
    -------
    dx : ndarray
        Of ``x``'s shape.
    dweight, dbias : ndarray or None
        Of ``normalized_shape``; None where the forward had no weight / bias.

    <backward_raises>
    """
    check_cache(cache, LayerNormCache, "layer_norm_backward")
    return layer_norm_backward_kernel(check_grad(dout, cache.xhat.shape, cache.xhat.dtype), cache)


def layer_norm_backward_kernel(dout, cache):
    xhat, rstd, weight, has_bias, k = cache
    return _norm_backward(dout, xhat, rstd, weight, k, centred=True, has_bias=has_bias)


def _norm_backward(dout, xhat, rstd, weight, k, *, centred, has_bias=False):
    """``dx = rstd * (g - [mean(g)] - xhat * mean(g * xhat))`` with ``g = dy * weight`` (the
    ``mean(g)`` term for layer norm only, ``centred``), ``dweight = sum(dy * xhat)`` and
    ``dbias = sum(dy)`` over the leading axes; shared by both norms' backward kernels.

    As ``(rows, n)`` matrices every sum over the rows or along a row is a matrix-vector product
    (BLAS), several times faster than ``ndarray.sum`` on short rows, and the row means come
    straight from dy: ``mean(g) = (dy @ weight) / n``, ``mean(g * xhat) = ((dy * xhat) @ weight) / n``
    (``g * xhat`` is never formed)."""
    n = math.prod(xhat.shape[xhat.ndim - k :])
    rows = math.prod(xhat.shape[: xhat.ndim - k])
    dy = dout.reshape(rows, n)
    xh = xhat.reshape(rows, n)
    tmp = np.multiply(dy, xh)  # dy * xhat (then xhat * mean(g * xhat): one scratch)
    ones = np.ones(rows, dout.dtype)
    w = np.ones(n, dout.dtype) if weight is None else weight.reshape(n)
    dweight = None if weight is None else (ones @ tmp).reshape(weight.shape)
    dbias = (ones @ dy).reshape(xhat.shape[xhat.ndim - k :]) if has_bias else None
    m2 = np.divide(tmp @ w, n)[:, None]  # mean(g * xhat)
    dx = np.multiply(dy, w) if weight is not None else np.array(dy)  # g, then dx in place
    if centred:
        dx -= np.divide(dy @ w, n)[:, None]  # mean(g)
    dx -= np.multiply(xh, m2, out=tmp)
    dx *= rstd.reshape(rows, 1)
    return dx.reshape(xhat.shape), dweight, dbias


def _jvp_example(op: str) -> str:
    """A norm's ``op_jvp`` example: ``tout`` along ``(tx, tweight)`` against the central difference
    of ``op``."""
    return f"""
    >>> import numpy as np
    >>> from npattn import functional as F
    >>> rng = np.random.default_rng(0)
    >>> x, tx = rng.standard_normal((3, 5)), rng.standard_normal((3, 5))
    >>> w, tw = np.ones(5), rng.standard_normal(5)
    >>> out, cache = F.{op}(x, w)
    >>> tout = F.{op}_jvp(cache, tx, tw)
    >>> f = lambda s: F.{op}(x + s * tx, w + s * tw)[0]
    """ + FD_CHECK.lstrip()


def _checked_backward_jvp(kernel, cache_type, op: str, dout, cache, tangents, ddout):
    """The public edge of a norm's ``op_backward_jvp``: the cache, ``dout``, the tangents and ``ddout``
    checked, then ``kernel``."""
    check_cache(cache, cache_type, f"{op}_backward_jvp")
    xhat = cache.xhat
    dout, tangents, ddout = check_backward_jvp(
        dout, tangents, ddout, f"{op}_backward_jvp", xhat.shape, xhat.dtype, _norm_tangent_specs(cache)
    )
    return kernel(dout, cache, tangents, ddout)


def _checked_jvp(kernel, cache_type, op: str, cache, tangents):
    """The public edge of a norm's ``op_jvp``: the cache and the tangents checked (``_norm_tangent_specs``),
    then ``kernel``."""
    check_cache(cache, cache_type, f"{op}_jvp")
    specs = _norm_tangent_specs(cache)
    return kernel(cache, *check_tangents_as(tangents, f"{op}_jvp", cache.xhat.dtype, specs))


@shared_doc(
    jvp_sections=jvp_sections(
        "layer_norm",
        "LayerNormCache",
        tangents=(
            "``tx`` (``x``'s shape), ``tweight``, ``tbias`` (``normalized_shape``), in the order "
            "``layer_norm_backward`` returns gradients; None (or omitted at the end) is zero; "
            "``tweight``/``tbias`` must be None when the forward had no weight/bias."
        ),
        most="three tangents",
        wrong=", or one for an input the forward did not have",
    ),
    jvp_example=_jvp_example("layer_norm"),
)
def layer_norm_jvp(cache: LayerNormCache, *tangents) -> np.ndarray:
    """Forward mode of ``layer_norm``: the tangent of ``y = xhat * w + b`` along ``(tx, tweight, tbias)``.

    With ``xhat = (x - mu) r``, ``r = (var + eps)^(-1/2)`` over the ``N`` normalised values:
    ``tmu = mean(tx)``; ``tvar = 2 mean((x - mu)(tx - tmu)) = 2 mean((x - mu) tx)`` (``x - mu`` has
    mean 0); ``tr = -r^3 tvar / 2 = -r^2 mean(xhat tx)``; so
    ``txhat = r (tx - tmu) + (x - mu) tr = r (tx - mean(tx) - xhat mean(xhat tx))`` (the same
    symmetric operator as the backward's), and by the product rule

        ty = txhat * w + xhat * tw + tb.

    A slice normalised to 0 because ``eps = 0`` and its variance is 0 (``r = 0``) gets ``txhat = 0``.

    <jvp_sections>

    Examples
    --------
    <jvp_example>
    """
    return _checked_jvp(layer_norm_jvp_kernel, LayerNormCache, "layer_norm", cache, tangents)


def _norm_tangent_specs(cache):
    """``(name, shape, present)`` of each tangent of ``layer_norm`` or ``rms_norm``, in the
    backward's order: ``tx``, ``tweight`` (and ``tbias`` for layer norm)."""
    xhat, weight, k = cache.xhat, cache.weight, cache.ndim
    ns = xhat.shape[xhat.ndim - k :]
    specs = (("tx", xhat.shape, True), ("tweight", ns, weight is not None))
    return specs + (("tbias", ns, cache.has_bias),) if isinstance(cache, LayerNormCache) else specs


def layer_norm_jvp_kernel(cache, tx=None, tweight=None, tbias=None):
    """The kernel of ``layer_norm_jvp`` (tangents checked, None = zero)."""
    xhat, rstd, weight, _, k = cache
    return _norm_jvp(xhat, rstd, weight, k, tx, tweight, tbias, centred=True)


def _norm_jvp(xhat, rstd, weight, k, tx, tweight, tbias, *, centred):
    """``ty = txhat * w + xhat * tw + tb`` with ``txhat = r (tx - [mean(tx)] - xhat mean(xhat tx))``
    (``mean(tx)`` for layer norm only, ``centred``); shared by both norms' JVP kernels."""
    if tx is not None:
        ty = _norm_backward(tx, xhat, rstd, None, k, centred=centred)[0]  # txhat: the operator is symmetric
        if weight is not None:
            ty *= weight
    else:
        ty = np.zeros(xhat.shape, xhat.dtype)
    if tweight is not None:
        ty += xhat * tweight
    if tbias is not None:
        ty += tbias
    return ty


def _backward_jvp_sections(op: str, cache: str, inputs: tuple) -> str:
    """A norm's ``op_backward_jvp`` sections: the gradients of ``inputs`` (``x`` and the affine
    parameters it has) and their tangents."""
    tangents, grads = (", ".join(f"{p}{n}" for n in inputs) for p in ("t", "d"))
    return backward_jvp_sections(
        op,
        cache,
        dout=", of the output's shape.",
        tangents=f"``({tangents})`` as ``{op}_jvp`` takes them; None (or left out at the end): zero.",
        grads=f"``({grads})``",
        grad_tangents="Their tangents, of the same shapes, None where the gradient is None.",
        **SEVERAL_TANGENTS,
    )


@shared_doc(backward_jvp_sections=_backward_jvp_sections("layer_norm", "LayerNormCache", ("x", "weight", "bias")))
def layer_norm_backward_jvp(dout: np.ndarray, cache: LayerNormCache, tangents, ddout=None):
    """Second order of ``layer_norm``: ``layer_norm_backward``'s gradients and their tangents.

    The backward (``g = dy w``, means over the normalised axes, ``m = mean(g xhat)``)::

        dx = r (g - mean(g) - xhat m),   dw = sum(dy xhat),   db = sum(dy)

    differentiated along ``(tx, tw, tb)`` and ``ddy``, with ``txhat = r (tx - mean(tx) - xhat
    mean(xhat tx))`` and ``tr = -r^2 mean(xhat tx)`` (as in ``layer_norm_jvp``) and ``tg = ddy w +
    dy tw``::

        tdx = (tr / r) dx + r (tg - mean(tg) - xhat mean(tg xhat)) - r (txhat m + xhat mean(g txhat))
        tdw = sum(ddy xhat + dy txhat),   tdb = sum(ddy)

    (``tb`` does not enter; the middle term of ``tdx`` is the backward's own operator applied to
    ``tg``).

    <backward_jvp_sections>
    """
    return _checked_backward_jvp(
        layer_norm_backward_jvp_kernel, LayerNormCache, "layer_norm", dout, cache, tangents, ddout
    )


def layer_norm_backward_jvp_kernel(dout, cache, tangents, ddout=None):
    """The kernel of ``layer_norm_backward_jvp`` (``tangents`` the checked ``(tx, tweight, tbias)``)."""
    xhat, rstd, weight, has_bias, k = cache
    tx, tweight, _ = tangents
    return _norm_backward_jvp(dout, xhat, rstd, weight, k, tx, tweight, ddout, centred=True, has_bias=has_bias)


def _norm_backward_jvp(dout, xhat, rstd, weight, k, tx, tweight, ddout, *, centred, has_bias=False):
    """Both norms' second order (derived in ``layer_norm_backward_jvp``; ``centred``: layer norm's
    ``mean`` terms): ``(grads, grad_tangents)`` as ``_norm_backward`` returns them, each part
    from ``_norm_backward``'s operator where it is one."""
    grads = _norm_backward(dout, xhat, rstd, weight, k, centred=centred, has_bias=has_bias)
    dx, dweight, dbias = grads
    if ddout is not None:  # the backward is linear in dy
        tdx, tdweight, tdbias = _norm_backward(ddout, xhat, rstd, weight, k, centred=centred, has_bias=has_bias)
    else:
        tdx = np.zeros_like(dx)
        tdweight = None if dweight is None else np.zeros_like(dweight)
        tdbias = None if dbias is None else np.zeros_like(dbias)
    if tweight is not None:  # tg = dy tw through the operator r (tg - mean(tg) - xhat mean(tg xhat))
        tdx += _norm_backward(dout * tweight, xhat, rstd, None, k, centred=centred)[0]
    if tx is not None:  # xhat and r move
        n = math.prod(xhat.shape[xhat.ndim - k :])
        rows = math.prod(xhat.shape[: xhat.ndim - k])
        txhat = _norm_backward(tx, xhat, rstd, None, k, centred=centred)[0].reshape(rows, n)
        r = rstd.reshape(rows, 1)
        xh, dy = xhat.reshape(rows, n), dout.reshape(rows, n)
        g = dy if weight is None else dy * weight.reshape(n)
        m = (g * xh).mean(axis=1, keepdims=True)
        rho = -r * (xh * tx.reshape(rows, n)).mean(axis=1, keepdims=True)  # tr / r
        tdx += (rho * dx.reshape(rows, n) - r * (txhat * m + xh * (g * txhat).mean(axis=1, keepdims=True))).reshape(
            dx.shape
        )
        if tdweight is not None:
            tdweight += (dy * txhat).sum(axis=0).reshape(tdweight.shape)
    return grads, (tdx, tdweight, tdbias)


# -------------------------------------------------------------------------------------- rms_norm


@shared_doc(forward_tail=_forward_tail("rms_norm", "RMSNormCache"))
def rms_norm(
    x: np.ndarray, weight: Optional[np.ndarray] = None, eps: Optional[float] = None, *, normalized_shape=None
) -> tuple[np.ndarray, RMSNormCache]:
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the trailing axes (no centring, no bias).

    The normalised axes are chosen as in ``layer_norm`` (``normalized_shape``, else ``weight.shape``,
    else the last axis).  ``eps=None`` is ``np.finfo(x.dtype).eps``, as
    ``torch.nn.functional.rms_norm``.  A slice of zeros with ``eps=0`` gives 0 (not 0/0 = NaN).
    Returns ``(y, cache)``.

    Parameters
    ----------
    x : array_like
        ``(..., *normalized_shape)``, float32 or float64.
    weight : array_like, optional
        Of shape ``normalized_shape``.
    eps : float, optional
        Added to the mean square, >= 0; None: the dtype's machine epsilon.
    <forward_tail>
    ValueError
        ``normalized_shape`` not the trailing axes of ``x``, ``weight`` of another shape, a negative
        or non-finite ``eps``.

    <examples>
    >>> y, cache = F.rms_norm(np.array([[3.0, 4.0]]), np.ones(2), eps=0.0)
    >>> y                              # divided by sqrt((9 + 16) / 2)
    array([[0.84852814, 1.13137085]])
    >>> dx, dweight = F.rms_norm_backward(np.array([[1.0, 1.0]]), cache)
    >>> dx.shape, dweight.shape
    ((1, 2), (2,))
    """
    x, weight, _, ns, eps = _check_norm_args(x, weight, None, normalized_shape, eps)
    return rms_norm_kernel(x, weight, eps, normalized_shape=ns)


def rms_norm_kernel(x, weight=None, eps=None, *, normalized_shape=None, keep=True):
    """The kernel of ``rms_norm``; ``keep=False`` (a forward that keeps no state): ``y`` alone,
    formed in place with the same roundings (``(x rstd) weight``), and None for the cache."""
    k, _ = _axes(x, normalized_shape, weight)
    if eps is None:
        eps = float(np.finfo(x.dtype).eps)
    y = np.multiply(x, x, out=np.empty(x.shape, x.dtype))  # x^2, in what becomes y's buffer
    if not keep and y.size == math.prod(x.shape[x.ndim - k :]):  # one slice: a decoding step's
        rstd = _one_rstd(y, eps)
    else:
        rms = np.sqrt(_mean(y, k) + eps)
        if eps == 0.0:
            rms[rms == 0] = np.inf  # a slice of zeros, no eps: rstd = 0, so xhat = 0 (not 0/0)
        rstd = 1.0 / rms
    if not keep:  # no xhat to keep: one pass and one array fewer
        np.multiply(x, rstd, out=y)
        if weight is not None:
            y *= weight
        return y, None
    xhat = np.multiply(x, rstd, out=np.empty(x.shape, x.dtype))  # C-contiguous, whatever x's layout
    if weight is not None:
        np.multiply(xhat, weight, out=y)
    else:
        np.copyto(y, xhat)
    return y, RMSNormCache(xhat, rstd, weight, k)


@shared_doc(backward_args=op_backward_args("rms_norm"), backward_raises=OP_BACKWARD_RAISES)
def rms_norm_backward(dout: np.ndarray, cache: RMSNormCache):
    """With ``r = (mean(x^2) + eps)^(-1/2)``, ``xhat = x r`` and ``g = dy * weight``:

    ``dr/dx_j = -r^3 x_j / N``, so ``dx = r g + x * sum(g x) * (-r^3 / N) = r (g - xhat * mean(g * xhat))``
    (mean over the N normalised values: the one term is the gradient through the rms),
    ``dweight = sum(dy * xhat)`` over all leading axes.  Returns ``(dx, dweight)``, dweight None
    without a weight.

    <backward_args>

    Returns
    -------
    dx : ndarray
        Of ``x``'s shape.
    dweight : ndarray or None
        Of ``normalized_shape``; None without a weight.

    <backward_raises>
    """
    check_cache(cache, RMSNormCache, "rms_norm_backward")
    return rms_norm_backward_kernel(check_grad(dout, cache.xhat.shape, cache.xhat.dtype), cache)


def rms_norm_backward_kernel(dout, cache):
    xhat, rstd, weight, k = cache
    dx, dweight, _ = _norm_backward(dout, xhat, rstd, weight, k, centred=False)
    return dx, dweight


@shared_doc(
    jvp_sections=jvp_sections(
        "rms_norm",
        "RMSNormCache",
        tangents=(
            "``tx`` (``x``'s shape) and ``tweight`` (``normalized_shape``; None without a weight in "
            "the forward), in the order ``rms_norm_backward`` returns gradients; None (or omitted) is "
            "zero."
        ),
        most="two tangents",
        wrong=", or ``tweight`` when the forward had no weight",
    ),
    jvp_example=_jvp_example("rms_norm"),
)
def rms_norm_jvp(cache: RMSNormCache, *tangents) -> np.ndarray:
    """Forward mode of ``rms_norm``: the tangent of ``y = xhat * w`` along ``(tx, tweight)``.

    With ``xhat = x r``, ``r = (mean(x^2) + eps)^(-1/2)``: ``tr = -r^3 mean(x tx) = -r^2 mean(xhat tx)``,
    so ``txhat = r tx + x tr = r (tx - xhat mean(xhat tx))`` and ``ty = txhat * w + xhat * tw``.

    <jvp_sections>

    Examples
    --------
    <jvp_example>
    """
    return _checked_jvp(rms_norm_jvp_kernel, RMSNormCache, "rms_norm", cache, tangents)


def rms_norm_jvp_kernel(cache, tx=None, tweight=None):
    """The kernel of ``rms_norm_jvp`` (tangents checked, None = zero)."""
    xhat, rstd, weight, k = cache
    return _norm_jvp(xhat, rstd, weight, k, tx, tweight, None, centred=False)


@shared_doc(backward_jvp_sections=_backward_jvp_sections("rms_norm", "RMSNormCache", ("x", "weight")))
def rms_norm_backward_jvp(dout: np.ndarray, cache: RMSNormCache, tangents, ddout=None):
    """Second order of ``rms_norm``: as ``layer_norm_backward_jvp`` without the means of ``g``
    and ``tx`` and without a bias: with ``dx = r (g - xhat m)``, ``m = mean(g xhat)``, ``txhat =
    r (tx - xhat mean(xhat tx))``, ``tr = -r^2 mean(xhat tx)`` and ``tg = ddy w + dy tw``::

        tdx = (tr / r) dx + r (tg - xhat mean(tg xhat)) - r (txhat m + xhat mean(g txhat))
        tdw = sum(ddy xhat + dy txhat)

    <backward_jvp_sections>
    """
    return _checked_backward_jvp(rms_norm_backward_jvp_kernel, RMSNormCache, "rms_norm", dout, cache, tangents, ddout)


def rms_norm_backward_jvp_kernel(dout, cache, tangents, ddout=None):
    """The kernel of ``rms_norm_backward_jvp`` (``tangents`` the checked ``(tx, tweight)``)."""
    xhat, rstd, weight, k = cache
    tx, tweight = tangents
    (dx, dweight, _), (tdx, tdweight, _) = _norm_backward_jvp(
        dout, xhat, rstd, weight, k, tx, tweight, ddout, centred=False
    )
    return (dx, dweight), (tdx, tdweight)
