"""``causal_conv1d``: the short causal depthwise convolution of Qwen3-Next's linear attention.

Each channel is filtered on its own along the sequence by ``K`` taps (``K`` = 4 in Qwen3-Next);
output ``t`` sees inputs ``t - K + 1 .. t`` only, the inputs before the first coming from a carried
state (the last ``K - 1`` inputs of the previous call) when decoding.  Layout: npattn's batch-first
``x (B..., L, C)``; transformers' ``causal_conv1d_fn`` / ``causal_conv1d_update`` take the transpose
``(B, C, L)``.  The taps are a loop of ``K`` whole-array multiply-adds (no windows materialised).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from .._docs import SEVERAL_TANGENTS, backward_jvp_sections, shared_doc
from .._validate import as_float, check_backward_jvp, check_bool, check_cache, check_grad, check_tangents_as
from .activation import SiluCache, silu_backward_jvp_kernel, silu_backward_kernel, silu_jvp_kernel, silu_kernel

__all__ = [
    "causal_conv1d",
    "causal_conv1d_backward",
    "causal_conv1d_jvp",
    "causal_conv1d_backward_jvp",
    "CausalConv1dCache",
]


class CausalConv1dCache(NamedTuple):
    xp: np.ndarray  # (B..., K - 1 + L, C): the initial state (or zeros) followed by x
    weight: np.ndarray  # (C, K)
    has_bias: bool
    has_initial_state: bool
    act: Optional[SiluCache]  # silu's cache of the pre-activation, or None
    final_state: Optional[np.ndarray]  # (B..., K - 1, C) with output_final_state, else None


@shared_doc()
def causal_conv1d(
    x: np.ndarray,
    weight: np.ndarray,
    bias: Optional[np.ndarray] = None,
    *,
    activation: Optional[str] = None,
    initial_state: Optional[np.ndarray] = None,
    output_final_state: bool = False,
) -> tuple[np.ndarray, CausalConv1dCache]:
    """``y_t = activation(bias + sum_j weight[:, j] * x_{t - K + 1 + j})``, channel by channel.

    Parameters
    ----------
    x : ndarray ``(B..., L, C)``
    weight : ndarray ``(C, K)``
        torch's ``Conv1d(C, C, K, groups=C).weight`` ``(C, 1, K)`` without its middle axis
        (``weight[:, K - 1]`` multiplies the current step).
    bias : ndarray ``(C,)``, optional
    activation : None or ``"silu"``
    initial_state : ndarray ``(B..., K - 1, C)``, optional
        The ``K - 1`` inputs before ``x`` (zeros if None): the state of the previous call.
    output_final_state : bool
        Keep the last ``K - 1`` inputs (of the initial state followed by x) as
        ``cache.final_state``, the state for the next call.

    Returns
    -------
    (y, cache)
        ``y (B..., L, C)``.

    Raises
    ------
    TypeError, ValueError
        Naming the argument, expected vs actual, before any arithmetic.

    <examples>
    >>> x = np.arange(5.0).reshape(1, 5, 1)            # (batch, L, channels)
    >>> y, cache = F.causal_conv1d(x, np.array([[1.0, 1.0]]))   # each output: x[t - 1] + x[t]
    >>> y[0, :, 0]
    array([0., 1., 3., 5., 7.])
    >>> F.causal_conv1d_backward(np.ones_like(y), cache)[0][0, :, 0]
    array([2., 2., 2., 2., 1.])
    """
    x = as_float(x, "x")
    if x.ndim < 2 or x.shape[-2] < 1:
        raise ValueError(f"x: expected shape (..., L, C) with L >= 1, got {x.shape}")
    channels = x.shape[-1]
    weight = as_float(weight, "weight", x.dtype)
    if weight.ndim != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(f"weight: expected shape ({channels}, K) (x's channels, K >= 1 taps), got {weight.shape}")
    if bias is not None:
        bias = as_float(bias, "bias", x.dtype)
        if bias.shape != (channels,):
            raise ValueError(f"bias: expected shape ({channels},), got {bias.shape}")
    if activation not in (None, "silu"):
        raise ValueError(f"activation: expected None or 'silu', got {activation!r}")
    if initial_state is not None:
        initial_state = as_float(initial_state, "initial_state", x.dtype)
        want = x.shape[:-2] + (weight.shape[1] - 1, channels)
        if initial_state.shape != want:
            raise ValueError(f"initial_state: expected shape {want} (..., K - 1, C), got {initial_state.shape}")
    output_final_state = check_bool(output_final_state, "output_final_state")
    return causal_conv1d_kernel(
        x, weight, bias, activation=activation, initial_state=initial_state, output_final_state=output_final_state
    )


def causal_conv1d_kernel(x, weight, bias=None, *, activation=None, initial_state=None, output_final_state=False):
    taps, steps = weight.shape[1], x.shape[-2]
    xp = np.empty(x.shape[:-2] + (taps - 1 + steps, x.shape[-1]), x.dtype)
    xp[..., : taps - 1, :] = 0.0 if initial_state is None else initial_state
    xp[..., taps - 1 :, :] = x
    z = xp[..., :steps, :] * weight[:, 0]  # tap 0 reads x_{t - K + 1}: row t of xp
    for j in range(1, taps):
        z += xp[..., j : j + steps, :] * weight[:, j]
    if bias is not None:
        z += bias
    act = None
    if activation == "silu":
        z, act = silu_kernel(z)
    final = xp[..., steps:, :].copy() if output_final_state else None
    return z, CausalConv1dCache(xp, weight, bias is not None, initial_state is not None, act, final)


def causal_conv1d_backward(
    dout: np.ndarray, cache: CausalConv1dCache
) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray], Optional[np.ndarray]]:
    """Input ``x_s`` fed ``z_t`` through tap ``j = s - t + K - 1``, so ``dx_s = sum_j w_j dz_{s + K - 1 - j}``
    (the taps run backwards over dz), ``dw_j = sum_t dz_t x_{t - K + 1 + j}`` over the batch and the
    steps, ``dbias = sum dz``; the first ``K - 1`` padded rows are the initial state's gradient.

    Returns
    -------
    (dx, dweight, dbias, dinitial_state)
        None where the forward had no bias / no initial state.
    """
    check_cache(cache, CausalConv1dCache, "causal_conv1d_backward")
    xp = cache.xp
    shape = xp.shape[:-2] + (xp.shape[-2] - cache.weight.shape[1] + 1, xp.shape[-1])
    return causal_conv1d_backward_kernel(check_grad(dout, shape, xp.dtype), cache)


def causal_conv1d_backward_kernel(dout, cache):
    xp, weight, has_bias, has_initial, act, _ = cache
    dz = dout if act is None else silu_backward_kernel(dout, act)
    taps, steps, channels = weight.shape[1], dz.shape[-2], dz.shape[-1]
    dz2 = dz.reshape(-1, steps, channels)
    xp2 = xp.reshape(-1, xp.shape[-2], channels)
    dxp = np.zeros(xp.shape, dz.dtype)
    dweight = np.empty(weight.shape, dz.dtype)
    for j in range(taps):
        dxp[..., j : j + steps, :] += dz * weight[:, j]
        dweight[:, j] = np.einsum("blc,blc->c", dz2, xp2[:, j : j + steps])
    dbias = dz2.sum(axis=(0, 1)) if has_bias else None
    return dxp[..., taps - 1 :, :], dweight, dbias, (dxp[..., : taps - 1, :] if has_initial else None)


def causal_conv1d_jvp(cache: CausalConv1dCache, *tangents) -> np.ndarray:
    """Forward mode of ``causal_conv1d``: ``z`` is bilinear in the padded input and the weight,
    so ``tz_t = tbias + sum_j (tw_j x_{t-K+1+j} + w_j tx_{t-K+1+j})`` (the padded ``tx`` starting
    with ``tinitial_state``), then the activation's JVP.

    Parameters
    ----------
    cache : CausalConv1dCache
    *tangents : ndarray or None
        ``(tx, tweight, tbias, tinitial_state)``, the backward's order; None or left out: zero
        (``tbias`` / ``tinitial_state`` must be None when the forward had none).

    Returns
    -------
    ty : ndarray ``(B..., L, C)``
    """
    check_cache(cache, CausalConv1dCache, "causal_conv1d_jvp")
    specs = _conv_tangent_specs(cache)
    return causal_conv1d_jvp_kernel(cache, *check_tangents_as(tangents, "causal_conv1d_jvp", cache.xp.dtype, specs))


def _conv_tangent_specs(cache):
    """``(name, shape, present)`` of each tangent, in the backward's order; the first is ``x``'s
    (and the output's) shape."""
    xp, weight = cache.xp, cache.weight
    taps, lead, channels = weight.shape[1], xp.shape[:-2], xp.shape[-1]
    return (
        ("tx", lead + (xp.shape[-2] - taps + 1, channels), True),
        ("tweight", weight.shape, True),
        ("tbias", (channels,), cache.has_bias),
        ("tinitial_state", lead + (taps - 1, channels), cache.has_initial_state),
    )


def causal_conv1d_jvp_kernel(cache, tx=None, tweight=None, tbias=None, tinitial_state=None, *, keep=False):
    """The kernel of ``causal_conv1d_jvp``; with ``keep``, ``(ty, (tz, txp))``: also the
    pre-activation's tangent and the padded input's (None for zero), which
    ``causal_conv1d_backward_jvp_kernel(..., forward=)`` along the same tangents takes."""
    xp, weight, _, _, act, _ = cache
    taps = weight.shape[1]
    steps = xp.shape[-2] - taps + 1
    tz = np.zeros(xp.shape[:-2] + (steps, xp.shape[-1]), xp.dtype)
    txp = _padded_tangent(cache, tx, tinitial_state)
    if txp is not None:
        for j in range(taps):
            tz += txp[..., j : j + steps, :] * weight[:, j]
    if tweight is not None:
        for j in range(taps):
            tz += xp[..., j : j + steps, :] * tweight[:, j]
    if tbias is not None:
        tz += tbias
    ty = tz if act is None else silu_jvp_kernel(act, tz)
    return (ty, (tz, txp)) if keep else ty


def _padded_tangent(cache, tx, tinitial_state):
    """``tinitial_state`` followed by ``tx`` (zeros for None), as the forward pads x; None when both are."""
    if tx is None and tinitial_state is None:
        return None
    taps = cache.weight.shape[1]
    txp = np.zeros(cache.xp.shape, cache.xp.dtype)
    if tinitial_state is not None:
        txp[..., : taps - 1, :] = tinitial_state
    if tx is not None:
        txp[..., taps - 1 :, :] = tx
    return txp


@shared_doc(
    backward_jvp_sections=backward_jvp_sections(
        "causal_conv1d",
        "CausalConv1dCache",
        dout=" ``(B..., L, C)``.",
        tangents=(
            "``(tx, tweight, tbias, tinitial_state)`` as ``causal_conv1d_jvp`` takes them; None (or "
            "left out at the end): zero."
        ),
        grads="``(dx, dweight, dbias, dinitial_state)``",
        grad_tangents="Their tangents, of the same shapes, None where the gradient is None.",
        **SEVERAL_TANGENTS,
    )
)
def causal_conv1d_backward_jvp(dout: np.ndarray, cache: CausalConv1dCache, tangents, ddout=None):
    """Second order of ``causal_conv1d``: the backward's gradients and their tangents.

    The backward is ``dz = act'(z) dy`` (the activation's backward; ``dz = dy`` without one),
    then ``B(dz; xp, w)``: ``dxp_s = sum_j w_j dz_{s+K-1-j}``, ``dw_j = sum_t dz_t
    xp_{t+j}``, ``dbias = sum dz``, bilinear in ``dz`` and ``(xp, w)``.  Along ``(tx, tweight,
    tbias, tinitial_state)`` and ``ddout``: the pre-activation moves by ``tz`` (the JVP without the
    activation), so ``tdz`` is silu's second order along ``(tz, ddout)`` (``tdz = ddout`` without
    an activation), and the product rule gives

        (tdx, tdw, tdbias, tdinitial_state) = B(tdz; xp, w) + B(dz; txp, tw)

    where ``txp`` is ``tinitial_state`` followed by ``tx`` and ``B(dz; txp, tw)`` has no bias term.

    <backward_jvp_sections>
    """
    check_cache(cache, CausalConv1dCache, "causal_conv1d_backward_jvp")
    specs = _conv_tangent_specs(cache)
    dout, tangents, ddout = check_backward_jvp(
        dout, tangents, ddout, "causal_conv1d_backward_jvp", specs[0][1], cache.xp.dtype, specs
    )
    return causal_conv1d_backward_jvp_kernel(dout, cache, tangents, ddout)


def causal_conv1d_backward_jvp_kernel(dout, cache, tangents, ddout=None, *, forward=None):
    """The kernel of ``causal_conv1d_backward_jvp`` (``tangents`` the checked four); ``forward``:
    the ``(tz, txp)`` that ``causal_conv1d_jvp_kernel(..., keep=True)`` gave along the same
    tangents (computed here when None)."""
    tx, tweight, tbias, tinitial_state = tangents
    xp, weight, _, _, act, _ = cache
    linear = cache._replace(act=None)  # B(.; xp, w): the backward after the activation
    moved = any(t is not None for t in tangents)
    if forward is None:
        tz = causal_conv1d_jvp_kernel(linear, tx, tweight, tbias, tinitial_state) if moved and act is not None else None
        txp = _padded_tangent(cache, tx, tinitial_state)
    else:
        tz, txp = forward
    if act is None:
        dz, tdz = dout, ddout
    else:
        dz, tdz = silu_backward_jvp_kernel(dout, act, (tz if moved else None,), ddout)
    grads = causal_conv1d_backward_kernel(dz, linear)
    if tdz is not None:
        tgrads = list(causal_conv1d_backward_kernel(tdz, linear))
    else:
        tgrads = [None if g is None else np.zeros_like(g) for g in grads]
    if txp is not None or tweight is not None:
        txp = np.zeros_like(xp) if txp is None else txp
        tw = np.zeros_like(weight) if tweight is None else tweight
        mdx, mdweight, _, mdinitial = causal_conv1d_backward_kernel(
            dz, linear._replace(xp=txp, weight=tw, has_bias=False, has_initial_state=True)
        )
        tgrads[0] += mdx
        tgrads[1] += mdweight
        if tgrads[3] is not None:
            tgrads[3] += mdinitial
    return grads, tuple(tgrads)
