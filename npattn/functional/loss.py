"""Losses: ``cross_entropy``.  The public pair validates; the kernels ``cross_entropy_kernel`` /
``cross_entropy_backward_kernel`` compute."""

from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np

from .._docs import FD_CHECK, OP_BACKWARD_RAISES, backward_jvp_sections, jvp_sections, op_backward_args, shared_doc
from .._validate import (
    as_float,
    check_backward_jvp,
    check_cache,
    check_grad,
    check_ndim,
    check_prob,
    check_tangents_as,
    to_numpy,
)
from .activation import SoftmaxCache, softmax_jvp_kernel

__all__ = [
    "CrossEntropyCache",
    "cross_entropy",
    "cross_entropy_backward",
    "cross_entropy_jvp",
    "cross_entropy_backward_jvp",
]


_REDUCTIONS = ("mean", "sum", "none")


class CrossEntropyCache(NamedTuple):
    logp: np.ndarray  # log_softmax(logits), (..., C)
    targets: np.ndarray  # integer class ids (..., ) with ignored ones set to 0, or probabilities (..., C)
    counted: np.ndarray | None  # bool (...,): not ignored (class ids), None for probabilities
    weight: np.ndarray | None  # (C,)
    label_smoothing: float
    reduction: str
    denom: float  # what "mean" divides by (1 for "sum"/"none"); 0 means "nothing counted"


@shared_doc()
def cross_entropy(
    logits: np.ndarray,
    targets: np.ndarray,
    ignore_index: int | None = None,
    *,
    weight: np.ndarray | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> tuple[np.ndarray, CrossEntropyCache]:
    """Negative log-likelihood of ``targets`` under ``softmax(logits)``, torch's ``F.cross_entropy``.

    Classes are on the **last** axis: ``logits (..., C)`` (torch puts them on axis 1, ``(N, C, ...)``;
    move the axis, e.g. ``np.moveaxis(logits, 1, -1)``, when porting such code).  ``targets`` are

    - integer class ids of shape ``logits.shape[:-1]``, each in ``[0, C)`` unless equal to
      ``ignore_index`` (that element is not counted: loss 0, gradient 0); or
    - float class probabilities of shape ``logits.shape`` (finite; as torch, they are not required
      to sum to 1); ``ignore_index`` must then be None or negative (it has no effect, as in torch).

    ``weight (C,)`` rescales each class; ``label_smoothing`` in ``[0, 1]`` mixes the target with the
    uniform distribution, ``(1 - eps) * target + eps / C``.  Per element (with ``logp = log_softmax``):
    ``loss = -(1 - eps) w[t] logp[t] - eps/C sum_c w[c] logp[c]`` for class ids, and
    ``loss = -sum_c w[c] q[c] logp[c]`` with ``q = (1 - eps) p + eps/C`` for probabilities.
    ``reduction``: ``"none"`` returns these per-element losses (shape ``logits.shape[:-1]``, 0 where
    ignored), ``"sum"`` their sum, ``"mean"`` (default) torch's rule: for class ids the sum divided by
    the total weight ``sum w[t]`` of the counted targets (their number without ``weight``), for
    probabilities the sum divided by the number of elements.

    When "mean" has nothing to divide by (every target ignored, an empty batch, or a total weight
    of 0), torch returns NaN (0/0); npattn returns ``0.0`` (positive zero) with a zero gradient, so
    a batch of pure padding adds nothing instead of turning every later number into NaN.
    ``log_softmax`` is computed stably as ``z - log(sum(exp(z)))`` with ``z = x - max(x)``.
    Returns ``(loss, cache)``: a 0-d array for "mean"/"sum", shape ``logits.shape[:-1]`` for "none".

    Parameters
    ----------
    logits : array_like
        ``(..., C)``: classes on the last axis; float32 or float64.
    targets : array_like
        Class ids ``(...)`` (integers in ``[0, C)``), or class probabilities of ``logits``' shape.
    ignore_index : int, optional
        Class-id targets equal to it are not counted.
    weight : array_like, optional
        ``(C,)`` per-class weights (torch's weighted mean).
    reduction : {"mean", "sum", "none"}
    label_smoothing : float
        In ``[0, 1]``.

    Returns
    -------
    loss : ndarray
        A 0-d array (``"mean"``, ``"sum"``) or the per-position losses (``"none"``).
    cache : CrossEntropyCache
        For ``cross_entropy_backward`` and ``cross_entropy_jvp``.

    Raises
    ------
    TypeError
        Non-numeric logits, non-integer class ids, a non-string ``reduction``.
    ValueError
        Shapes that do not match, a class id out of range, an unknown ``reduction``, a
        ``label_smoothing`` outside ``[0, 1]``.

    <examples>
    >>> logits = np.array([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    >>> loss, cache = F.cross_entropy(logits, np.array([0, 2]))
    >>> round(float(loss), 4)          # the mean of -log softmax at the targets: (0.2395 + ln 3) / 2
    0.6691
    >>> np.round(F.cross_entropy_backward(1.0, cache), 4)   # (softmax - onehot) / 2
    array([[-0.1065,  0.0533,  0.0533],
           [ 0.1667,  0.1667, -0.3333]])
    """
    logits = as_float(logits, "logits")
    check_ndim(logits, "logits", 1, "(..., classes)")
    c = logits.shape[-1]
    t = to_numpy(targets, "targets")
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral)):
        raise TypeError(f"ignore_index: expected an int or None, got {ignore_index!r}")
    if t.dtype.kind in "iu":
        if t.shape != logits.shape[:-1]:
            raise ValueError(
                f"targets: expected shape {logits.shape[:-1]} (logits without the class axis), got {t.shape}"
            )
        counted = np.ones(t.shape, dtype=bool) if ignore_index is None else t != ignore_index
        tc = t[counted]
        if tc.size and (tc.min() < 0 or tc.max() >= c):
            bad = tc.min() if tc.min() < 0 else tc.max()
            raise ValueError(f"targets: expected class indices in [0, {c}), got {bad}")
    elif t.dtype.kind == "f":
        t = as_float(t, "targets", logits.dtype)  # float16/longdouble refused as everywhere
        if t.shape != logits.shape:
            kind = TypeError if t.shape == logits.shape[:-1] else ValueError
            raise kind(
                f"targets: expected integer class ids of shape {logits.shape[:-1]} or float class "
                f"probabilities of shape {logits.shape}, got dtype {t.dtype} of shape {t.shape}"
            )
        if not np.isfinite(t).all():
            raise ValueError("targets: expected finite class probabilities, got NaN or inf")
        if ignore_index is not None and ignore_index >= 0:
            raise ValueError(f"ignore_index: not supported with probability targets (as torch), got {ignore_index}")
    else:
        raise TypeError(
            "targets: expected an integer array (class ids) or a float array (class probabilities), "
            f"got dtype {t.dtype}"
        )
    if weight is not None:
        weight = as_float(weight, "weight", logits.dtype)
        if weight.shape != (c,):
            raise ValueError(f"weight: expected shape ({c},) (one per class, logits' last axis), got {weight.shape}")
        if not np.isfinite(weight).all():
            raise ValueError("weight: expected finite class weights, got NaN or inf")
    if not isinstance(reduction, str):
        raise TypeError(f"reduction: expected 'mean', 'sum' or 'none', got {reduction!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: expected 'mean', 'sum' or 'none', got {reduction!r}")
    label_smoothing = check_prob(label_smoothing, "label_smoothing")
    return cross_entropy_kernel(
        logits, t, ignore_index, weight=weight, reduction=reduction, label_smoothing=label_smoothing
    )


def cross_entropy_kernel(logits, targets, ignore_index=None, *, weight=None, reduction="mean", label_smoothing=0.0):
    """Kernel: integer targets are class ids, float targets probabilities of logits' dtype."""
    c = logits.shape[-1]
    eps = label_smoothing
    eps_c = eps / c if c else 0.0  # eps/C (no class at all: nothing to smooth over)
    z = logits - logits.max(axis=-1, keepdims=True, initial=-np.inf)
    logsumexp = np.log(np.exp(z).sum(axis=-1, keepdims=True))
    logp = z - logsumexp  # (..., C)
    wlogp = logp * weight if weight is not None else logp
    if targets.dtype.kind == "f":  # probabilities: loss = -sum_c w_c q_c logp_c
        counted = None
        q = targets if eps == 0 else (1.0 - eps) * targets + eps_c
        losses = -(q * wlogp).sum(axis=-1)
        denom = float(losses.size)
    else:  # class ids
        counted = np.ones(targets.shape, dtype=bool) if ignore_index is None else targets != ignore_index
        targets = np.where(counted, targets, 0)  # an ignored id may lie outside [0, C)
        picked = np.take_along_axis(wlogp, targets[..., None], axis=-1)[..., 0]  # w[t] logp[t]
        losses = -(1.0 - eps) * picked
        if eps:
            losses -= eps_c * wlogp.sum(axis=-1)
        losses *= counted
        wt = weight[targets] * counted if weight is not None else counted
        denom = float(wt.sum())
    if reduction == "none":
        loss = losses + 0.0  # + 0.0: no -0.0 for an ignored element
        denom = 1.0
    elif reduction == "sum":
        loss = np.asarray(losses.sum() + 0.0, dtype=logits.dtype)
        denom = 1.0
    else:
        loss = np.asarray(losses.sum() / denom + 0.0 if denom else 0.0, dtype=logits.dtype)
    cache = CrossEntropyCache(logp, targets, counted, weight, eps, reduction, denom)
    return loss, cache


@shared_doc(backward_args=op_backward_args("cross_entropy"), backward_raises=OP_BACKWARD_RAISES)
def cross_entropy_backward(dout: np.ndarray, cache: CrossEntropyCache) -> np.ndarray:
    """Write each element's loss as ``-sum_j q_j logp_j`` with a target vector ``q``: for a class id
    ``t``, ``q = (1 - eps) w[t] onehot(t) + eps/C w`` (``w = 1`` without weight); for probabilities
    ``p``, ``q = w ((1 - eps) p + eps/C)``; ``q = 0`` for an ignored element.  Since
    ``d logp_j / d z_k = delta_jk - softmax(z)_k``,

        dloss/dz = sum(q) * softmax(z) - q,

    times the upstream gradient: ``dout / denom`` for "mean" (0 when nothing was counted),
    ``dout`` for "sum", ``dout[...]`` per element for "none".  Returns ``dlogits``.

    <backward_args>

    Returns
    -------
    ndarray
        ``dlogits``, of ``logits``' shape.

    <backward_raises>
    """
    check_cache(cache, CrossEntropyCache, "cross_entropy_backward")
    shape = cache.logp.shape[:-1] if cache.reduction == "none" else ()
    return cross_entropy_backward_kernel(check_grad(dout, shape, cache.logp.dtype), cache)


def cross_entropy_backward_kernel(dout, cache):
    logp, targets, counted, weight, eps, reduction, denom = cache
    c = logp.shape[-1]
    eps_c = eps / c if c else 0.0
    p = np.exp(logp)
    if counted is None:  # probabilities
        q = targets if eps == 0 else (1.0 - eps) * targets + eps_c
        if weight is not None:
            q = q * weight
        dx = p * q.sum(axis=-1, keepdims=True) - q
    else:
        # the two parts of q separately (as torch): (1 - eps) w[t] (softmax - onehot) + eps/C (sum(w) softmax - w)
        t = targets[..., None]
        if weight is None and eps == 0:  # the plain case: softmax - onehot
            dx = p
            np.put_along_axis(dx, t, np.take_along_axis(dx, t, axis=-1) - 1.0, axis=-1)
        else:
            a = (1.0 - eps) * (weight[targets] if weight is not None else np.ones(targets.shape, dtype=logp.dtype))
            dx = p * a[..., None]
            np.put_along_axis(dx, t, np.take_along_axis(dx, t, axis=-1) - a[..., None], axis=-1)
        if eps:
            wsum = weight.sum() if weight is not None else c
            dx += eps_c * (p * wsum - (weight if weight is not None else 1.0))
        dx *= counted[..., None]
    if reduction == "none":
        dx *= dout[..., None]
    else:
        dx *= (dout / denom) if denom else 0.0
    return dx


@shared_doc(
    jvp_sections=jvp_sections(
        "cross_entropy",
        "CrossEntropyCache",
        tangents="``tlogits``, of ``logits``' shape (None: zero).",
        returns='The loss\'s tangent: 0-d for ``"mean"``/``"sum"``, ``logits.shape[:-1]`` for ``"none"``.',
    ),
    fd_check=FD_CHECK,
)
def cross_entropy_jvp(cache: CrossEntropyCache, *tangents) -> np.ndarray:
    """Forward mode of ``cross_entropy`` along ``tlogits``.

    Each element's loss ``-sum_j q_j logp_j`` is a scalar function of its logits ``z`` with
    gradient ``G = sum(q) softmax(z) - q`` (``cross_entropy_backward``, where the target vector ``q``
    carries the class weights, label smoothing and ignored elements), so its tangent is
    ``G . tz``; the reduction then acts on these tangents as on the losses: ``"none"`` keeps one per
    element, ``"sum"`` adds them, ``"mean"`` divides the sum by the same denominator (0 when
    nothing was counted, as the loss).  Targets, class ids or probabilities, are data: no tangent.

    <jvp_sections>

    <examples>
    >>> rng = np.random.default_rng(0)
    >>> z, tz = rng.standard_normal((4, 6)), rng.standard_normal((4, 6))
    >>> t = np.array([0, 5, 2, 2])
    >>> out, cache = F.cross_entropy(z, t)
    >>> tout = F.cross_entropy_jvp(cache, tz)
    >>> f = lambda s: F.cross_entropy(z + s * tz, t)[0]
    <fd_check>
    """
    check_cache(cache, CrossEntropyCache, "cross_entropy_jvp")
    specs = (("tlogits", cache.logp.shape),)
    return cross_entropy_jvp_kernel(cache, *check_tangents_as(tangents, "cross_entropy_jvp", cache.logp.dtype, specs))


def cross_entropy_jvp_kernel(cache, tlogits=None):
    """The kernel of ``cross_entropy_jvp`` (``tlogits`` checked, None = zero)."""
    shape = cache.logp.shape[:-1] if cache.reduction == "none" else ()
    if tlogits is None:
        return np.zeros(shape, cache.logp.dtype)
    # the backward with dout = 1 per element (or for the reduced loss): each element's gradient,
    # already divided by the mean's denominator; its dot product with tz is the loss's tangent
    g = cross_entropy_backward_kernel(np.ones(shape, cache.logp.dtype), cache)
    t = np.einsum("...c,...c->...", g, tlogits)
    return t if cache.reduction == "none" else np.asarray(t.sum(), dtype=cache.logp.dtype)


@shared_doc(
    backward_jvp_sections=backward_jvp_sections(
        "cross_entropy",
        "CrossEntropyCache",
        dout=", of the loss's shape.",
        tangents="``(tlogits,)`` as ``cross_entropy_jvp`` takes it; None or ``()``: zero.",
        grads="``dlogits``",
        grad_tangents="Its tangent, of ``logits``' shape.",
        wrong="``dout``, ``ddout`` or ``tlogits`` of the wrong shape.",
    ),
)
def cross_entropy_backward_jvp(dout: np.ndarray, cache: CrossEntropyCache, tangents, ddout=None):
    """Second order of ``cross_entropy``: ``cross_entropy_backward``'s gradient and its tangent.

    Per element the backward is ``dz = d (sum(q) p - q)`` with ``p = softmax(z)``, the target
    vector ``q`` (class weights, label smoothing and ignored elements in it, see
    ``cross_entropy_backward``) and the element's share ``d`` of ``dout`` (``dout / denom`` for
    "mean", ``dout`` for "sum", ``dout[...]`` for "none").  ``q`` and the denominator are data;
    ``d`` is linear in ``dout`` and only ``p`` depends on the logits, ``tp = p (tz - <p, tz>)``
    (``softmax_jvp``), so

        tdz = cross_entropy_backward(ddout) + d sum(q) tp.

    That is the Hessian of the loss times ``tz`` plus the backward of ``ddout``; with "mean" and
    nothing counted both are 0, as the gradient.

    <backward_jvp_sections>

    <examples>
    >>> z, tz = np.array([[1.0, 0.0, -1.0]]), np.array([[0.0, 1.0, 0.0]])
    >>> loss, cache = F.cross_entropy(z, np.array([0]))
    >>> dz, hv = F.cross_entropy_backward_jvp(1.0, cache, (tz,))      # the Hessian times tz
    >>> p = np.exp(z) / np.exp(z).sum()
    >>> bool(np.allclose(hv, (np.diag(p[0]) - np.outer(p[0], p[0])) @ tz[0]))
    True
    """
    check_cache(cache, CrossEntropyCache, "cross_entropy_backward_jvp")
    logp = cache.logp
    dout, tangents, ddout = check_backward_jvp(
        dout,
        tangents,
        ddout,
        "cross_entropy_backward_jvp",
        logp.shape[:-1] if cache.reduction == "none" else (),
        logp.dtype,
        (("tlogits", logp.shape),),
    )
    return cross_entropy_backward_jvp_kernel(dout, cache, tangents, ddout)


def cross_entropy_backward_jvp_kernel(dout, cache, tangents=(None,), ddout=None):
    """The kernel of ``cross_entropy_backward_jvp``."""
    (tz,) = tangents
    grads = cross_entropy_backward_kernel(dout, cache)
    tdz = np.zeros_like(grads) if ddout is None else cross_entropy_backward_kernel(ddout, cache)
    if tz is not None:
        logp, targets, counted, weight, eps, reduction, denom = cache
        c = logp.shape[-1]
        if counted is None:  # probabilities: sum(q) = sum_c w_c ((1 - eps) p_c + eps/C)
            q = targets if eps == 0 else (1.0 - eps) * targets + (eps / c if c else 0.0)
            mass = (q if weight is None else q * weight).sum(axis=-1)
        else:  # class ids: sum(q) = (1 - eps) w[t] + eps/C sum(w), 0 where ignored
            mass = (1.0 - eps) * (weight[targets] if weight is not None else 1.0)
            if eps:
                mass = mass + eps / c * (weight.sum() if weight is not None else c)
            mass = mass * counted
        share = dout if reduction == "none" else ((dout / denom) if denom else np.zeros_like(dout))
        tp = softmax_jvp_kernel(SoftmaxCache(np.exp(logp), -1), tz)
        tdz += (share * mass).astype(logp.dtype)[..., None] * tp
    return grads, tdz
