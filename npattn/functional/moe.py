"""Mixture of experts, the fast tier: the top-k router and the sorted dispatch of the experts.

Each token ``x_n`` (``N`` tokens, width ``H``) goes to ``k`` of ``E`` experts; the block's output is

    y_n = sum_{j < k} w_nj * expert_{i_nj}(x_n)

where the router gives the chosen experts ``i (N, k)`` and their weights ``w (N, k)``.  Two pairs:

* ``topk_router(logits, top_k, ...) -> ((weights, indices), cache)``: the routing of GPT-OSS
  (``"topk_softmax"``), Qwen3-Next / Qwen3-MoE / Mixtral (``"softmax_topk"``) and DeepSeek-V3
  (``"sigmoid"`` with a correction bias, group-limited choice and a routed scaling factor);
  ``topk_router_backward(dweights, cache) -> dlogits``.
* ``moe_experts(x, indices, weights, gate_up, down, ...) -> (y, cache)``: ``E`` experts stored
  as fused 3-D weights, SwiGLU (``kind="swiglu"``), GPT-OSS's clamped SwiGLU with biases
  (``kind="gpt_oss"``) or not gated, ``down(act(up x))`` (``kind="plain"``: Nemotron 3's);
  ``moe_experts_backward(dy, cache) -> (dx, dweights, dgate_up, ddown,
  dgate_up_bias, ddown_bias)``.

Both are written as the formula, one token and one chosen expert at a time, with their
derivations, in the textbook tier (``npattn.functional.reference``, section "Mixture of
experts"); this file computes the same numbers with whole-array steps and is property-tested
equal to it.

Dispatch sorts, it never computes every expert on every token: the ``S = N k`` (token, slot)
pairs are ordered by expert id (``order = argsort(flat expert ids)``, stable), the tokens are
gathered in that order so each expert's tokens form one contiguous slice, each expert runs once
on its slice (two GEMMs), and the results go back to their (token, slot) places through the same
permutation (``y_pairs[order] = ...``), to be summed over the ``k`` slots.  Backward scatters
with that permutation again.

Gradients.  The choice of experts is a piecewise-constant function of the logits (it changes only
where two scores tie), so its derivative is zero almost everywhere: no gradient flows through
*which* experts were chosen, only through the chosen weights and the chosen experts' own
computations.  At a tie the function jumps and has no derivative; finite-difference checks must
stay away from ties.  DeepSeek-V3's correction bias enters only the choice: it gets no gradient.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional

import numpy as np

from .._docs import jvp_sections, shared_doc
from .._validate import (
    as_float,
    as_index,
    check_backward_jvp,
    check_bool,
    check_cache,
    check_grad,
    check_positive_float,
    check_size,
    check_tangent,
    check_tangents,
    check_tangents_as,
)
from .activation import (
    clamp_inside,
    gelu_backward_jvp_kernel,
    gelu_backward_kernel,
    gelu_kernel,
    relu2_backward_jvp_kernel,
    relu2_backward_kernel,
    relu2_kernel,
    relu_backward_jvp_kernel,
    relu_backward_kernel,
    relu_kernel,
    sigmoid,
    silu_backward_jvp_kernel,
    silu_backward_kernel,
    silu_kernel,
)

__all__ = [
    "ROUTER_VARIANTS",
    "EXPERT_KINDS",
    "EXPERT_ACTIVATIONS",
    "TopKRouterCache",
    "MoeExpertsCache",
    "topk_router",
    "topk_router_backward",
    "topk_router_jvp",
    "topk_router_backward_jvp",
    "moe_experts",
    "moe_experts_backward",
    "moe_experts_jvp",
    "moe_experts_backward_jvp",
]

ROUTER_VARIANTS = ("softmax_topk", "topk_softmax", "sigmoid")
EXPERT_KINDS = ("swiglu", "gpt_oss", "plain")
# the activations of SwiGLU-kind and plain experts: name -> (kernel, its backward, keyword arguments)
_ACTS = {
    "silu": (silu_kernel, silu_backward_kernel, {}),
    "gelu": (gelu_kernel, gelu_backward_kernel, {"approximate": "none"}),
    "gelu_tanh": (gelu_kernel, gelu_backward_kernel, {"approximate": "tanh"}),
    "relu": (relu_kernel, relu_backward_kernel, {}),
    "relu2": (relu2_kernel, relu2_backward_kernel, {}),
}
EXPERT_ACTIVATIONS = tuple(_ACTS)
# their second order (the kernels of ``<act>_backward_jvp``)
_ACT_SECOND = {
    "silu": silu_backward_jvp_kernel,
    "gelu": gelu_backward_jvp_kernel,
    "gelu_tanh": gelu_backward_jvp_kernel,
    "relu": relu_backward_jvp_kernel,
    "relu2": relu2_backward_jvp_kernel,
}

# the renormalisation ``w / (sum w + eps)``: DeepSeek-V3 adds 1e-20 to a sum of sigmoids (which
# may underflow); a sum of softmax probabilities is >= 1/E and is divided as it is (Qwen3-Next)
SIGMOID_NORM_EPS = 1e-20


def check_real(x, name: str) -> float:
    """A finite real number (bools and non-numbers: ``TypeError``; NaN and inf: ``ValueError``)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: expected a finite real number, got {x!r} ({type(x).__name__})")
    if not math.isfinite(float(x)):
        raise ValueError(f"{name}: expected a finite real number, got {x!r}")
    return float(x)


def check_routing(indices, weights, lead: tuple, dtype, names=("indices", "weights"), num_experts=None):
    """The routing given to the experts (shared by ``moe_experts`` and ``nn.moe``'s experts):
    integer ``indices (*lead, k)`` over ``x``'s leading axes ``lead`` (``k >= 1``), then, with
    ``num_experts``, their values (``check_expert_ids``), then ``weights`` of their shape, cast to
    ``dtype``.  ``names``: the two arguments' names.  Returns ``(indices, weights)``."""
    iname, wname = names
    idx = as_index(indices, iname)
    if idx.ndim != len(lead) + 1 or idx.shape[:-1] != lead or idx.shape[-1] < 1:
        raise ValueError(f"{iname}: expected shape {lead + ('k',)} (x's leading axes, k >= 1), got {idx.shape}")
    if num_experts is not None:
        check_expert_ids(idx, num_experts, iname)
    w = as_float(weights, wname, dtype)
    if w.shape != idx.shape:
        whose = iname + ("'" if iname.endswith("s") else "'s")
        raise ValueError(f"{wname}: expected shape {idx.shape} ({whose}), got {w.shape}")
    return idx, w


def check_expert_ids(idx: np.ndarray, num_experts: int, name: str, whose: str = "") -> None:
    """Every chosen expert in ``[0, num_experts)`` (``whose``: where that number comes from)."""
    if idx.size and (idx.min() < 0 or idx.max() >= num_experts):
        bad = idx.min() if idx.min() < 0 else idx.max()
        raise ValueError(f"{name}: expected values in [0, {num_experts}){whose}, got {bad}")


def check_norm_topk_eps(norm_topk_eps, variant) -> Optional[float]:
    """The renormalisation's ``eps`` (``w / (sum w + eps)``), checked: None (the variant's own:
    ``SIGMOID_NORM_EPS`` for ``"sigmoid"``, none for ``"softmax_topk"``) or a finite number >= 0
    (LFM2-MoE's 1e-6); not with ``"topk_softmax"``, which never renormalises."""
    if norm_topk_eps is None:
        return None
    if variant == "topk_softmax":
        raise ValueError(
            f"norm_topk_eps: expected None with variant 'topk_softmax' (no renormalisation), got {norm_topk_eps!r}"
        )
    eps = check_real(norm_topk_eps, "norm_topk_eps")
    if eps < 0:
        raise ValueError(f"norm_topk_eps: expected a number >= 0, got {norm_topk_eps!r}")
    return eps


def check_router_options(num_experts, top_k, variant, norm_topk_prob, n_group, topk_group, routed_scaling_factor):
    """The router's options, checked (shared by ``topk_router`` and ``nn.TopKRouter``): returns
    ``(top_k, variant, norm_topk_prob, n_group, topk_group, routed_scaling_factor)``."""
    top_k = check_size(top_k, "top_k")
    if top_k > num_experts:
        raise ValueError(f"top_k: expected at most num_experts ({num_experts}), got {top_k}")
    if not isinstance(variant, str) or variant not in ROUTER_VARIANTS:
        raise ValueError(f"variant: expected one of {ROUTER_VARIANTS}, got {variant!r}")
    norm_topk_prob = check_bool(norm_topk_prob, "norm_topk_prob")
    if norm_topk_prob and variant == "topk_softmax":
        raise ValueError(
            "norm_topk_prob: expected False with variant 'topk_softmax' (its weights already sum to 1), got True"
        )
    routed_scaling_factor = check_positive_float(routed_scaling_factor, "routed_scaling_factor")
    n_group, topk_group = check_size(n_group, "n_group"), check_size(topk_group, "topk_group")
    if n_group > 1:
        e, g = num_experts, n_group
        if e % g or e // g < 2:
            raise ValueError(
                f"n_group: expected a divisor of num_experts ({e}) leaving at least 2 experts per group, got {g}"
            )
        if topk_group > g:
            raise ValueError(f"topk_group: expected at most n_group ({g}), got {topk_group}")
        if top_k > topk_group * (e // g):
            raise ValueError(
                f"top_k: expected at most topk_group * num_experts / n_group = {topk_group * (e // g)} "
                f"(the experts of the chosen groups), got {top_k}"
            )
    return top_k, variant, norm_topk_prob, n_group, topk_group, routed_scaling_factor


# ------------------------------------------------------------------------------------------ router


class TopKRouterCache(NamedTuple):
    indices: np.ndarray  # (N, k) chosen experts
    v: np.ndarray  # (N, k) the chosen probabilities / logits / sigmoid scores
    p: Optional[np.ndarray]  # (N, E) softmax probabilities ("softmax_topk" only)
    r: np.ndarray  # (N, k) the weights before the routed scaling factor
    denom: Optional[np.ndarray]  # (N, 1) the renormalisation's denominator, or None
    variant: str
    routed_scaling_factor: float
    logits_shape: tuple  # (..., E), the public input's shape (N = the product of its leading axes)


def _topk(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest entries of each row of ``scores (N, E)``, largest first (as
    ``torch.topk(sorted=True)``); equal chosen scores keep the lower index first.  Which of two
    equal scores at the boundary is chosen is not specified (nor is it by torch).  A NaN counts as
    larger than every number, as in ``torch.topk``: a NaN-scored expert is chosen first, so the
    NaN reaches the token's weights (numpy's sorts would put it last and drop it)."""
    n, e = scores.shape
    nan = np.isnan(scores)
    if nan.any():  # order by (not NaN, -score), stable: NaN first, then the largest, ties by index
        return np.lexsort((-np.where(nan, 0, scores), ~nan), axis=-1)[:, :k]
    if k < e:
        cand = np.argpartition(-scores, k - 1, axis=-1)[:, :k]  # the k largest, unordered
        cand.sort(axis=-1)  # ascending index, so the stable sort below breaks ties by index
    else:
        cand = np.broadcast_to(np.arange(e), (n, e))
    vals = np.take_along_axis(scores, cand, -1)
    return np.take_along_axis(cand, np.argsort(-vals, axis=-1, kind="stable"), -1)


def _choice(scores: np.ndarray, top_k: int, n_group: int, topk_group: int) -> np.ndarray:
    """Top-k of ``scores (N, E)`` within the ``topk_group`` best groups (all of them when
    ``n_group == 1``).  Piecewise constant in the scores: no gradient flows through it."""
    if n_group > 1:
        n, e = scores.shape
        grouped = scores.reshape(n, n_group, e // n_group)
        flat = grouped.reshape(n * n_group, e // n_group)
        best2 = np.take_along_axis(flat, _topk(flat, 2), -1).reshape(n, n_group, 2)  # each group's two best
        keep = _topk(best2.sum(-1), topk_group)  # (N, topk_group) groups
        allowed = np.zeros((n, n_group), bool)
        np.put_along_axis(allowed, keep, True, -1)
        scores = np.where(allowed[..., None], grouped, -np.inf).reshape(n, e)
    return _topk(scores, top_k)


@shared_doc()
def topk_router(
    logits: np.ndarray,
    top_k: int,
    *,
    variant: str = "softmax_topk",
    norm_topk_prob: bool = False,
    correction_bias: Optional[np.ndarray] = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    norm_topk_eps: Optional[float] = None,
):
    """Choose ``top_k`` of ``E`` experts per token from the router logits ``z`` and weigh them.

    Per token (a row of ``logits``):

    * ``"softmax_topk"``: ``p = softmax(z)``; the chosen are the top-k of ``p``; ``w = p_chosen``,
      divided by its sum when ``norm_topk_prob`` (Qwen3-Next, Qwen3-MoE, Mixtral);
    * ``"topk_softmax"``: the chosen are the top-k of ``z``; ``w = softmax(z_chosen)`` (GPT-OSS);
    * ``"sigmoid"``: ``s = sigmoid(z)``; the chosen are the top-k of ``s + correction_bias`` (used
      for the choice only); ``w = s_chosen``, divided by ``sum + 1e-20`` when ``norm_topk_prob``
      (DeepSeek-V3; LFM2-MoE's ``sum + 1e-6``: ``norm_topk_eps``).

    With ``n_group > 1`` the choice is group-limited (DeepSeek-V3): the experts form ``n_group``
    consecutive groups; a group's score is the sum of its two best choice scores; only the
    ``topk_group`` best groups compete for the top-k.  Finally ``w *= routed_scaling_factor``.

    A NaN score counts as larger than every number, as in ``torch.topk``: the NaN-scored expert is
    chosen first and the token's weights carry the NaN, as transformers' routers do (never a
    quietly finite routing around it).

    Parameters
    ----------
    logits : ndarray ``(..., E)``
        The router's logits (``x W^T + b``).
    top_k : int
        ``k``, ``1 <= k <= E``.
    variant : str
        One of ``ROUTER_VARIANTS``.
    norm_topk_prob : bool
        Renormalise the chosen weights (not with ``"topk_softmax"``: they already sum to 1).
    correction_bias : ndarray ``(E,)``, optional
        Added to the sigmoid scores for the choice only (variant ``"sigmoid"`` only).
    n_group, topk_group : int
        Group-limited choice; ``n_group`` divides ``E`` with at least 2 experts per group,
        ``topk_group <= n_group`` and ``top_k <= topk_group * E / n_group``.
    routed_scaling_factor : float
        Multiplies the weights (> 0; DeepSeek-V3's 2.5).
    norm_topk_eps : float, optional
        The renormalisation's ``eps``, ``w / (sum w + eps)``: None for the variant's own (1e-20
        with ``"sigmoid"``, 0 with ``"softmax_topk"``), or a number >= 0 (LFM2-MoE's 1e-6).

    Returns
    -------
    ((weights, indices), cache)
        ``weights (..., k)`` of the logits' dtype, ``indices (..., k)`` int64, the best first.

    Raises
    ------
    TypeError, ValueError
        Naming the argument, expected vs actual, before any arithmetic.

    <examples>
    >>> logits = np.array([[2.0, 1.0, 0.0, -1.0]])
    >>> (weights, indices), cache = F.topk_router(logits, 2, norm_topk_prob=True)
    >>> indices, np.round(weights, 4)               # the two largest, their softmax renormalised
    (array([[0, 1]]), array([[0.7311, 0.2689]]))
    """
    logits = as_float(logits, "logits")
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits: expected shape (..., E) with E >= 1 experts, got {logits.shape}")
    e = logits.shape[-1]
    opts = check_router_options(e, top_k, variant, norm_topk_prob, n_group, topk_group, routed_scaling_factor)
    if correction_bias is not None:
        if opts[1] != "sigmoid":
            raise ValueError(f"correction_bias: expected None with variant {opts[1]!r} (sigmoid only), got an array")
        correction_bias = as_float(correction_bias, "correction_bias", logits.dtype)
        if correction_bias.shape != (e,):
            raise ValueError(f"correction_bias: expected shape ({e},) (one per expert), got {correction_bias.shape}")
    top_k, variant, norm, n_group, topk_group, scale = opts
    return topk_router_kernel(
        logits,
        top_k,
        variant=variant,
        norm_topk_prob=norm,
        correction_bias=correction_bias,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=scale,
        norm_topk_eps=check_norm_topk_eps(norm_topk_eps, variant),
    )


def topk_router_kernel(
    logits,
    top_k,
    *,
    variant="softmax_topk",
    norm_topk_prob=False,
    correction_bias=None,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    norm_topk_eps=None,
):
    """The kernel of ``topk_router`` (arguments checked)."""
    e = logits.shape[-1]
    z = logits.reshape(-1, e)  # (N, E)
    p = denom = None
    if variant == "softmax_topk":
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)  # (N, E)
        idx = _choice(p, top_k, n_group, topk_group)
        v = np.take_along_axis(p, idx, -1)
    elif variant == "topk_softmax":
        idx = _choice(z, top_k, n_group, topk_group)
        v = np.take_along_axis(z, idx, -1)  # chosen logits
    else:
        s = sigmoid(z)
        idx = _choice(s if correction_bias is None else s + correction_bias, top_k, n_group, topk_group)
        v = np.take_along_axis(s, idx, -1)  # the bias steered the choice only
    if variant == "topk_softmax":
        r = np.exp(v - v[:, :1])  # v[:, 0] is the row's largest
        r /= r.sum(-1, keepdims=True)
    elif norm_topk_prob:
        denom = v.sum(-1, keepdims=True)
        eps = SIGMOID_NORM_EPS if norm_topk_eps is None and variant == "sigmoid" else norm_topk_eps
        if eps:
            denom += eps
        r = v / denom
    else:
        r = v
    w = r * routed_scaling_factor if routed_scaling_factor != 1.0 else r.copy()
    lead = logits.shape[:-1] + (top_k,)
    cache = TopKRouterCache(idx, v, p, r, denom, variant, routed_scaling_factor, logits.shape)
    return (w.reshape(lead), idx.reshape(lead)), cache


def topk_router_backward(dout: np.ndarray, cache: TopKRouterCache) -> np.ndarray:
    """Gradient through the chosen weights (the choice itself is piecewise constant: none).

    Backward, step by step (the choice ``idx`` is a constant):
    ``w = c r``                      -> ``dr = c dw``
    renormalised, ``r = v / D``, ``D = sum v (+ eps)`` ->
    ``dv_j = dr_j / D - sum_i dr_i v_i / D^2 = (dr_j - sum_i dr_i r_i) / D``;
    otherwise ``r = v``              -> ``dv = dr``;
    ``"topk_softmax"``, ``r = softmax(v)`` -> ``dv = r (dr - sum dr r)``.
    ``v`` gathers at ``idx``, so its gradient scatters back there (zero elsewhere):
    ``"topk_softmax"``: ``dz = scatter(dv)``; ``"sigmoid"``: ``dz = scatter(dv v (1 - v))``;
    ``"softmax_topk"``: ``dp = scatter(dv)``, then softmax's ``dz = p (dp - sum dp p)``, where
    ``sum_E dp p = sum_k dv v``: ``dz = scatter(dv v) - p sum_k dv v``.

    Parameters
    ----------
    dout : ndarray ``(..., k)``
        The gradient with respect to the weights (the indices have none).
    cache : TopKRouterCache

    Returns
    -------
    ndarray ``(..., E)``
        ``dlogits``.

    Raises
    ------
    TypeError, ValueError
        A cache from another op, or a ``dout`` of another shape.
    """
    check_cache(cache, TopKRouterCache, "topk_router_backward")
    shape = cache.logits_shape[:-1] + cache.indices.shape[-1:]
    return topk_router_backward_kernel(check_grad(dout, shape, cache.v.dtype), cache)


def _router_dv(dr, r, denom, variant):
    """``dv`` from ``dr``: the backward through ``r = softmax(v)``, ``v / D`` or ``v``."""
    if variant == "topk_softmax":
        return r * (dr - (dr * r).sum(-1, keepdims=True))
    if denom is not None:
        return (dr - (dr * r).sum(-1, keepdims=True)) / denom
    return dr


def topk_router_backward_kernel(dout, cache):
    """The kernel of ``topk_router_backward``."""
    idx, v, r, denom, variant = cache.indices, cache.v, cache.r, cache.denom, cache.variant
    c, shape = cache.routed_scaling_factor, cache.logits_shape
    dr = dout.reshape(idx.shape) * c if c != 1.0 else dout.reshape(idx.shape)
    dv = _router_dv(dr, r, denom, variant)
    dz = np.zeros((idx.shape[0], shape[-1]), v.dtype)
    if variant == "topk_softmax":
        np.put_along_axis(dz, idx, dv, -1)
    elif variant == "sigmoid":
        np.put_along_axis(dz, idx, dv * v * (1.0 - v), -1)
    else:
        dvv = dv * v
        np.put_along_axis(dz, idx, dvv, -1)
        dz -= cache.p * dvv.sum(-1, keepdims=True)
    return dz.reshape(shape)


@shared_doc(
    jvp_sections=jvp_sections(
        "topk_router",
        "TopKRouterCache",
        tangents="``tlogits``, of the logits' shape ``(..., E)`` (None: zero).",
        returns="``tweights``, of the weights' shape ``(..., k)`` and dtype.",
    )
)
def topk_router_jvp(cache: TopKRouterCache, *tangents) -> np.ndarray:
    """Forward mode of ``topk_router``: the weights' tangent along ``tlogits`` (the choice is
    constant), the backward's steps forwards: ``tv = tz_idx`` (``"topk_softmax"``),
    ``v (1 - v) tz_idx`` (``"sigmoid"``), ``v (tz_idx - sum_E p tz)`` (``"softmax_topk"``:
    softmax's tangent at the chosen); ``tr = r (tv - sum r tv)`` (the top-k softmax),
    ``(tv - r sum tv) / D`` (renormalised), ``tv`` (otherwise); ``tw = c tr``.

    <jvp_sections>
    """
    check_cache(cache, TopKRouterCache, "topk_router_jvp")
    (tz,) = check_tangents(tangents, ("tlogits",), "topk_router_jvp")
    return topk_router_jvp_kernel(cache, check_tangent(tz, "tlogits", cache.logits_shape, cache.v.dtype))


def topk_router_jvp_kernel(cache, tlogits=None):
    """The kernel of ``topk_router_jvp`` (tangent checked, None = zero)."""
    c, shape = cache.routed_scaling_factor, cache.logits_shape
    out = shape[:-1] + cache.indices.shape[-1:]
    if tlogits is None:
        return np.zeros(out, cache.v.dtype)
    return (_router_tangents(cache, tlogits.reshape(-1, shape[-1]))[2] * c).reshape(out)


def _router_tangents(cache, tz):
    """``(tzi, tv, tr)`` along ``tz (N, E)``: the logits' tangent at the chosen, then ``v``'s and
    ``r``'s (``topk_router_jvp``'s steps)."""
    idx, v, r, denom, variant = cache.indices, cache.v, cache.r, cache.denom, cache.variant
    tzi = np.take_along_axis(tz, idx, -1)
    if variant == "softmax_topk":
        tv = v * (tzi - (cache.p * tz).sum(-1, keepdims=True))
    elif variant == "sigmoid":
        tv = v * (1.0 - v) * tzi
    else:
        tv = tzi
    if variant == "topk_softmax":
        tr = r * (tv - (r * tv).sum(-1, keepdims=True))
    elif denom is not None:
        tr = (tv - r * tv.sum(-1, keepdims=True)) / denom
    else:
        tr = tv
    return tzi, tv, tr


def topk_router_backward_jvp(dout: np.ndarray, cache: TopKRouterCache, tangents, ddout=None):
    """Second order of ``topk_router``: ``dlogits`` and its tangent along ``tangents = (tlogits,)``
    and ``ddout`` (the tangent of ``dweights``).

    The choice of experts is piecewise constant in the logits: a tangent does not move it (its
    derivative is zero away from ties, undefined at one), so only the chosen values ``v``, the
    weights ``r`` and the denominator ``D`` move.  The backward is linear in ``dweights``: its
    part along ``ddout`` is ``topk_router_backward(ddout)``; the rest is the product rule on its
    steps with ``dr = c dweights`` fixed (``tv``, ``tr`` from ``topk_router_jvp``, ``tD = sum tv``)::

        dv = r (dr - <dr, r>)            +  tr (dr - <dr, r>) - r <dr, tr>     ("topk_softmax")
        dv = (dr - <dr, r>) / D          +  -(<dr, tr> + dv tD) / D            (renormalised)
        dz = scatter(dv)                 +  scatter(tdv)                       ("topk_softmax")
        dz = scatter(dv v (1 - v))       +  scatter(tdv v (1 - v) + dv (1 - 2v) tv)   ("sigmoid")
        dz = scatter(dv v) - p sum dv v  +  scatter(tdv v + dv tv) - tp sum dv v - p sum (tdv v + dv tv)
                                            ("softmax_topk", ``tp = p (tz - <p, tz>)``)

    Parameters
    ----------
    dout : ndarray ``(..., k)``
        ``dweights``.
    cache : TopKRouterCache
    tangents : tuple or None
        ``(tlogits,)`` as ``topk_router_jvp`` takes it (None: zero).
    ddout : ndarray ``(..., k)``, optional
        The tangent of ``dout`` (None: zero).

    Returns
    -------
    (dlogits, tdlogits)
        ``dlogits`` exactly ``topk_router_backward(dout, cache)``; both ``(..., E)``.

    Raises
    ------
    TypeError, ValueError
        A cache from another op, ``dout``, ``ddout`` or the tangent of the wrong kind or shape.
    """
    check_cache(cache, TopKRouterCache, "topk_router_backward_jvp")
    shape = cache.logits_shape[:-1] + cache.indices.shape[-1:]
    dout, tangents, ddout = check_backward_jvp(
        dout, tangents, ddout, "topk_router_backward_jvp", shape, cache.v.dtype, (("tlogits", cache.logits_shape),)
    )
    return topk_router_backward_jvp_kernel(dout, cache, tangents, ddout)


def topk_router_backward_jvp_kernel(dout, cache, tangents=(None,), ddout=None):
    """The kernel of ``topk_router_backward_jvp`` (arguments checked, None = zero)."""
    (tlogits,) = tangents
    grads = topk_router_backward_kernel(dout, cache)
    tgrads = np.zeros_like(grads) if ddout is None else topk_router_backward_kernel(ddout, cache)
    if tlogits is None:
        return grads, tgrads
    idx, v, r, denom, variant = cache.indices, cache.v, cache.r, cache.denom, cache.variant
    c, shape = cache.routed_scaling_factor, cache.logits_shape
    tz = tlogits.reshape(-1, shape[-1])
    _, tv, tr = _router_tangents(cache, tz)
    dr = dout.reshape(idx.shape) * c
    dv = _router_dv(dr, r, denom, variant)
    drtr = (dr * tr).sum(-1, keepdims=True)
    if variant == "topk_softmax":
        tdv = tr * (dr - (dr * r).sum(-1, keepdims=True)) - r * drtr
    elif denom is not None:
        tdv = -(drtr + dv * tv.sum(-1, keepdims=True)) / denom
    else:
        tdv = np.zeros_like(dv)
    tdz = np.zeros((idx.shape[0], shape[-1]), v.dtype)
    if variant == "topk_softmax":
        np.put_along_axis(tdz, idx, tdv, -1)
    elif variant == "sigmoid":
        np.put_along_axis(tdz, idx, tdv * v * (1.0 - v) + dv * (1.0 - 2.0 * v) * tv, -1)
    else:
        p = cache.p
        tdvv = tdv * v + dv * tv
        np.put_along_axis(tdz, idx, tdvv, -1)
        tp = p * (tz - (p * tz).sum(-1, keepdims=True))
        tdz -= tp * (dv * v).sum(-1, keepdims=True) + p * tdvv.sum(-1, keepdims=True)
    return grads, tgrads + tdz.reshape(shape)


# ----------------------------------------------------------------------------------------- experts


class MoeExpertsCache(NamedTuple):
    order: np.ndarray  # (S,) the (token, slot) pairs sorted by expert, S = N k
    tok: np.ndarray  # (S,) the token of each sorted pair
    bounds: np.ndarray  # (E + 1,) expert e owns sorted rows bounds[e]:bounds[e+1]
    ws: np.ndarray  # (S,) the routing weight of each sorted pair
    hs: np.ndarray  # (S, H) each pair's expert output, before weighting
    xs: np.ndarray  # (S, H) each sorted pair's token
    gu: np.ndarray  # (S, 2I) the gate and up pre-activations ("plain": (S, I), the up ones)
    mid: tuple  # the activation's intermediates (kind-dependent)
    params: tuple  # (gate_up, down, gate_up_bias or None, down_bias or None)
    kind: str
    activation: str
    alpha: float
    limit: float
    x_shape: tuple  # (..., H) the public input's shape
    k: int


def _experts_with_tokens(bounds: np.ndarray):
    """``(e, rows)`` for every expert that has tokens (its contiguous slice of the sorted rows)."""
    for e in np.flatnonzero(bounds[1:] > bounds[:-1]):
        yield int(e), slice(int(bounds[e]), int(bounds[e + 1]))


def moe_experts(
    x: np.ndarray,
    indices: np.ndarray,
    weights: np.ndarray,
    gate_up: np.ndarray,
    down: np.ndarray,
    gate_up_bias: Optional[np.ndarray] = None,
    down_bias: Optional[np.ndarray] = None,
    *,
    kind: str = "swiglu",
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
):
    """``y_n = sum_j w_nj expert_{i_nj}(x_n)``, dispatched by sorting the (token, slot) pairs per expert.

    The experts' weights are fused 3-D arrays in the layouts of Hugging Face ``transformers`` 5.x:

    * ``kind="swiglu"`` (DeepSeek-V3, Qwen3-Next, Qwen3-MoE, Mixtral): ``gate_up (E, 2I, H)`` whose
      first ``I`` rows are the gate projection and last ``I`` the up projection, ``down (E, H, I)``:
      ``expert_e(x) = down_e (act(gate_e x + bg) * (up_e x + bu)) + bd``;
    * ``kind="gpt_oss"``: ``gate_up (E, H, 2I)`` applied as ``x @ gate_up[e]`` (column ``2j`` is gate
      unit ``j``, column ``2j+1`` up unit ``j``), ``down (E, I, H)``, and the clamped SwiGLU
      ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``, ``h = (u + 1) g sigmoid(alpha g)``;
    * ``kind="plain"`` (Nemotron 3's ``NemotronHExperts``: not gated): ``gate_up (E, I, H)`` holds
      the up projection only, ``down (E, H, I)``: ``expert_e(x) = down_e act(up_e x + bu) + bd``.

    Parameters
    ----------
    x : ndarray ``(..., H)``
    indices : ndarray ``(..., k)``
        Integers in ``[0, E)``: each token's experts (repeats allowed), e.g. ``topk_router``'s.
    weights : ndarray ``(..., k)``
        Their weights.
    gate_up, down : ndarray
        ``(E, 2I, H)`` and ``(E, H, I)`` (``"swiglu"``), ``(E, H, 2I)`` and ``(E, I, H)`` (``"gpt_oss"``),
        ``(E, I, H)`` and ``(E, H, I)`` (``"plain"``).
    gate_up_bias, down_bias : ndarray ``(E, 2I)`` (``"plain"``: ``(E, I)``) and ``(E, H)``, optional
    kind : str
        One of ``EXPERT_KINDS``.
    activation : str
        ``"swiglu"``'s and ``"plain"``'s activation, one of ``EXPERT_ACTIVATIONS`` (``"gpt_oss"``
        ignores it).
    alpha, limit : float
        ``"gpt_oss"``'s ``swiglu_alpha`` (finite) and ``swiglu_limit`` (> 0).

    Returns
    -------
    (y, cache)
        ``y (..., H)``.

    Raises
    ------
    TypeError, ValueError
        Naming the argument, expected vs actual, before any arithmetic.
    """
    x = as_float(x, "x")
    if x.ndim < 1:
        raise ValueError(f"x: expected shape (..., H), got {x.shape}")
    lead, h = x.shape[:-1], x.shape[-1]
    idx, weights = check_routing(indices, weights, lead, x.dtype)
    if not isinstance(kind, str) or kind not in EXPERT_KINDS:
        raise ValueError(f"kind: expected one of {EXPERT_KINDS}, got {kind!r}")
    if not isinstance(activation, str) or activation not in _ACTS:
        raise ValueError(f"activation: expected one of {EXPERT_ACTIVATIONS}, got {activation!r}")
    alpha = check_real(alpha, "alpha")
    limit = check_positive_float(limit, "limit")
    gate_up = as_float(gate_up, "gate_up", x.dtype)
    out_in = kind != "gpt_oss"  # the weights stored (out, in), as torch's Linear
    want = {"swiglu": "(E, 2I, H)", "gpt_oss": "(E, H, 2I)", "plain": "(E, I, H)"}[kind]
    ok = gate_up.ndim == 3 and gate_up.shape[0] >= 1
    e, two_i = (gate_up.shape[0], gate_up.shape[1 if out_in else 2]) if ok else (0, 0)
    hh = gate_up.shape[2 if out_in else 1] if ok else -1
    gates = 1 if kind == "plain" else 2  # the rows (columns) per unit: gate and up, or up alone
    if not ok or hh != h or two_i < gates or two_i % gates:
        raise ValueError(
            f"gate_up: expected shape {want} with H = {h} (x's) and I >= 1 ({kind!r}), got {gate_up.shape}"
        )
    i = two_i // gates
    down = as_float(down, "down", x.dtype)
    want_down = (e, h, i) if out_in else (e, i, h)
    if down.shape != want_down:
        raise ValueError(f"down: expected shape {want_down} (E, I from gate_up, H from x; {kind!r}), got {down.shape}")
    if gate_up_bias is not None:
        gate_up_bias = as_float(gate_up_bias, "gate_up_bias", x.dtype)
        if gate_up_bias.shape != (e, two_i):
            raise ValueError(f"gate_up_bias: expected shape {(e, two_i)}, got {gate_up_bias.shape}")
    if down_bias is not None:
        down_bias = as_float(down_bias, "down_bias", x.dtype)
        if down_bias.shape != (e, h):
            raise ValueError(f"down_bias: expected shape {(e, h)}, got {down_bias.shape}")
    check_expert_ids(idx, e, "indices", " (gate_up's E)")
    return moe_experts_kernel(
        x,
        idx,
        weights,
        gate_up,
        down,
        gate_up_bias,
        down_bias,
        kind=kind,
        activation=activation,
        alpha=alpha,
        limit=limit,
    )


def moe_experts_kernel(
    x,
    indices,
    weights,
    gate_up,
    down,
    gate_up_bias=None,
    down_bias=None,
    *,
    kind="swiglu",
    activation="silu",
    alpha=1.702,
    limit=7.0,
):
    """The kernel of ``moe_experts`` (arguments checked): sort, run each expert on its slice, unsort."""
    h, k, e = x.shape[-1], indices.shape[-1], gate_up.shape[0]
    x2 = x.reshape(-1, h)  # (N, H)
    n = x2.shape[0]
    flat = indices.reshape(-1)  # pair t = n k + j is token n's j-th choice
    order = np.argsort(flat, kind="stable")  # (S,) pairs grouped by expert
    bounds = np.zeros(e + 1, np.intp)
    np.cumsum(np.bincount(flat, minlength=e), out=bounds[1:])
    tok = order // k  # (S,) token of each sorted pair
    ws = weights.reshape(-1)[order]  # (S,)
    xs = x2[tok]  # (S, H): each expert's tokens are one contiguous slice
    out_in = kind != "gpt_oss"  # the weights stored (out, in)
    two_i = gate_up.shape[1 if out_in else 2]
    gu = np.empty((xs.shape[0], two_i), x.dtype)  # (S, 2I); "plain": (S, I)
    for ex, rows in _experts_with_tokens(bounds):
        np.matmul(xs[rows], gate_up[ex].T if out_in else gate_up[ex], out=gu[rows])
        if gate_up_bias is not None:
            gu[rows] += gate_up_bias[ex]
    if kind == "plain":  # not gated: m = act(up)
        act, _, kw = _ACTS[activation]
        hmid, act_cache = act(gu, **kw)  # (S, I)
        mid: tuple = (act_cache,)
    elif kind == "swiglu":
        i = two_i // 2
        act, _, kw = _ACTS[activation]
        a, act_cache = act(gu[:, :i], **kw)  # (S, I)
        mid = (a, act_cache)
        hmid = a * gu[:, i:]
    else:
        gate, up = gu[:, ::2], gu[:, 1::2]  # interleaved columns
        g = np.minimum(gate, limit)
        u = np.clip(up, -limit, limit)
        sig = sigmoid(alpha * g)
        glu = g * sig
        hmid = (u + 1.0) * glu  # (S, I)
        mid = (g, u, sig, glu)
    hs = np.empty_like(xs)  # (S, H)
    for ex, rows in _experts_with_tokens(bounds):
        np.matmul(hmid[rows], down[ex].T if out_in else down[ex], out=hs[rows])
        if down_bias is not None:
            hs[rows] += down_bias[ex]
    y_pairs = np.empty_like(hs)
    y_pairs[order] = hs * ws[:, None]  # back to (token, slot) order: the inverse permutation
    y = y_pairs.reshape(n, k, h).sum(1).reshape(x.shape)
    params = (gate_up, down, gate_up_bias, down_bias)
    cache = MoeExpertsCache(
        order, tok, bounds, ws, hs, xs, gu, mid + (hmid,), params, kind, activation, alpha, limit, x.shape, k
    )
    return y, cache


def moe_experts_backward(dout: np.ndarray, cache: MoeExpertsCache):
    """Gradients of ``moe_experts``'s inputs (the indices have none: the choice is piecewise constant).

    ``y_n = sum_j w_nj h_nj`` with ``h_nj = expert_{i_nj}(x_n)``: ``dw_nj = <dy_n, h_nj>``,
    ``dh_nj = w_nj dy_n``; each expert's backward (on its sorted slice) turns its ``dh`` rows into
    ``dx`` rows and adds into its own weights' gradients; the ``dx`` rows go back to (token, slot)
    order through the forward's permutation and sum over the slots (a token chosen by k experts
    receives k gradients).  Per expert, SwiGLU: ``o = m Wd^T (+ bd)``: ``dm = do Wd``,
    ``dWd = do^T m``; ``m = a up``, ``a = act(gate)``: ``dgate = act'(gate) dm up``,
    ``dup = dm a``; ``gu = x Wgu^T (+ bgu)``: ``dx = dgu Wgu``, ``dWgu = dgu^T x``.  GPT-OSS:
    ``m = (u + 1) glu``, ``glu = g s``, ``s = sigmoid(alpha g)``: ``dglu = dm (u + 1)``,
    ``du = dm glu``, ``dg = dglu s (1 + alpha g (1 - s))``; the clamps pass the gradient where the
    input lies within the limits (bounds included, as torch's ``clamp``) and zero outside.

    Parameters
    ----------
    dout : ndarray ``(..., H)``
    cache : MoeExpertsCache

    Returns
    -------
    tuple
        ``(dx, dweights, dgate_up, ddown, dgate_up_bias, ddown_bias)``, the bias gradients None
        when the forward had no such bias.

    Raises
    ------
    TypeError, ValueError
        A cache from another op, or a ``dout`` of another shape.
    """
    check_cache(cache, MoeExpertsCache, "moe_experts_backward")
    return moe_experts_backward_kernel(check_grad(dout, cache.x_shape, cache.hs.dtype), cache)


def moe_experts_backward_kernel(dout, cache, keep=False):
    """The kernel of ``moe_experts_backward``; with ``keep``, also ``(dys, dhs, dm, dgu)`` (each
    sorted pair's upstream gradient, its expert output's, the activation output's and the gate and
    up pre-activations') for ``moe_experts_backward_jvp_kernel``."""
    order, tok, bounds, ws, xs, gu, mid = cache.order, cache.tok, cache.bounds, cache.ws, cache.xs, cache.gu, cache.mid
    gate_up, down, gate_up_bias, down_bias = cache.params
    alpha, limit, x_shape, k = cache.alpha, cache.limit, cache.x_shape, cache.k
    out_in = cache.kind != "gpt_oss"  # the weights stored (out, in)
    h = x_shape[-1]
    dy = dout.reshape(-1, h)
    n = dy.shape[0]
    dys = dy[tok]  # (S, H) each sorted pair's upstream gradient
    dw = np.empty(n * k, dy.dtype)
    dw[order] = np.einsum("sh,sh->s", dys, cache.hs)
    dhs = dys * ws[:, None]  # (S, H) the gradient of each pair's expert output
    hmid = mid[-1]
    dgate_up, ddown = np.zeros_like(gate_up), np.zeros_like(down)
    dgub = None if gate_up_bias is None else np.zeros_like(gate_up_bias)
    ddb = None if down_bias is None else np.zeros_like(down_bias)
    dm = np.empty_like(hmid)  # (S, I)
    for ex, rows in _experts_with_tokens(bounds):
        if out_in:
            np.matmul(dhs[rows], down[ex], out=dm[rows])
            ddown[ex] = dhs[rows].T @ hmid[rows]
        else:
            np.matmul(dhs[rows], down[ex].T, out=dm[rows])
            ddown[ex] = hmid[rows].T @ dhs[rows]
        if ddb is not None:
            ddb[ex] = dhs[rows].sum(0)
    dgu = np.empty_like(gu)  # (S, 2I); "plain": (S, I)
    if cache.kind == "plain":  # m = act(up): dup = act'(up) dm
        dgu[:] = _ACTS[cache.activation][1](dm, mid[0])
    elif cache.kind == "swiglu":
        i = gu.shape[1] // 2
        a, act_cache, _ = mid
        dgu[:, :i] = _ACTS[cache.activation][1](dm * gu[:, i:], act_cache)
        np.multiply(dm, a, out=dgu[:, i:])
    else:
        g, u, sig, glu, _ = mid
        gate, up = gu[:, ::2], gu[:, 1::2]
        dgu[:, ::2] = dm * (u + 1.0) * sig * (1.0 + alpha * g * (1.0 - sig)) * clamp_inside(gate, None, limit)
        dgu[:, 1::2] = dm * glu * clamp_inside(up, -limit, limit)
    dxs = np.empty_like(xs)
    for ex, rows in _experts_with_tokens(bounds):
        if out_in:
            dgate_up[ex] = dgu[rows].T @ xs[rows]
            np.matmul(dgu[rows], gate_up[ex], out=dxs[rows])
        else:
            dgate_up[ex] = xs[rows].T @ dgu[rows]
            np.matmul(dgu[rows], gate_up[ex].T, out=dxs[rows])
        if dgub is not None:
            dgub[ex] = dgu[rows].sum(0)
    dx_pairs = np.empty_like(dxs)
    dx_pairs[order] = dxs
    dx = dx_pairs.reshape(n, k, h).sum(1).reshape(x_shape)
    grads = dx, dw.reshape(x_shape[:-1] + (k,)), dgate_up, ddown, dgub, ddb
    return (grads, (dys, dhs, dm, dgu)) if keep else grads


@shared_doc(
    jvp_sections=jvp_sections(
        "moe_experts",
        "MoeExpertsCache",
        tangents=(
            "In the backward's order: ``tx``, ``tweights``, ``tgate_up``, ``tdown``, ``tgate_up_bias``, "
            "``tdown_bias`` (None: zero; a bias tangent only when the forward had the bias)."
        ),
        returns="``ty``, of ``x``'s shape ``(..., H)`` and dtype.",
        most="six tangents",
        wrong=", or a tangent for a bias the forward did not have",
    )
)
def moe_experts_jvp(cache: MoeExpertsCache, *tangents) -> np.ndarray:
    """Forward mode of ``moe_experts``: ``ty_n = sum_j (tw_nj h_nj + w_nj th_nj)``, the experts'
    tangents on the sorted rows (their forward steps on tangents: ``tgu = tx Wgu^T + x tWgu^T +
    tbgu``; SwiGLU ``tm = act'(gate) tgate up + a tup``; GPT-OSS ``tm = tu glu + (u + 1) tg s (1 +
    alpha g (1 - s))`` with the clamps passing the tangent inside their limits; ``to = tm Wd^T +
    m tWd^T + tbd``), back to (token, slot) order through the same permutation, summed over the
    slots.  The indices have no tangent.

    <jvp_sections>
    """
    check_cache(cache, MoeExpertsCache, "moe_experts_jvp")
    return moe_experts_jvp_kernel(cache, *check_tangents_as(tangents, "moe_experts_jvp", cache.hs.dtype, _specs(cache)))


def _specs(cache):
    """The tangents' ``(name, shape, present)`` in the backward's order (a bias's only when the
    forward had it)."""
    gate_up, down, gub, db = cache.params
    two_i = gate_up.shape[1 if cache.kind != "gpt_oss" else 2]
    return (
        ("tx", cache.x_shape, True),
        ("tweights", cache.x_shape[:-1] + (cache.k,), True),
        ("tgate_up", gate_up.shape, True),
        ("tdown", down.shape, True),
        ("tgate_up_bias", (gate_up.shape[0], two_i), gub is not None),
        ("tdown_bias", (down.shape[0], cache.x_shape[-1]), db is not None),
    )


def moe_experts_jvp_kernel(
    cache, tx=None, tweights=None, tgate_up=None, tdown=None, tgate_up_bias=None, tdown_bias=None, *, forward=None
):
    """The kernel of ``moe_experts_jvp`` (tangents checked, None = zero); ``forward``: what
    ``experts_tangents`` gave along the same tangents (computed here when None)."""
    x_shape, h = cache.x_shape, cache.x_shape[-1]
    if forward is None:
        forward = experts_tangents(cache, tx, tgate_up, tdown, tgate_up_bias, tdown_bias)
    ths = forward[3]
    ty_sorted = cache.ws[:, None] * ths
    if tweights is not None:
        ty_sorted += tweights.reshape(-1)[cache.order][:, None] * cache.hs
    ty_pairs = np.empty_like(ty_sorted)
    ty_pairs[cache.order] = ty_sorted
    return ty_pairs.reshape(math.prod(x_shape[:-1]), cache.k, h).sum(1).reshape(x_shape)


def experts_tangents(cache, tx, tgate_up, tdown, tgate_up_bias, tdown_bias):
    """``(txs, tgu, tm, ths)`` on the sorted rows: the token's tangent (None for zero), the gate
    and up pre-activations', the activation's output's and the expert output's (``moe_experts_jvp``'s
    steps without the weights).  The JVP and the second order both need them: a caller of both
    along the same tangents (``Experts`` in ``loss_hvp``) computes them once and hands them to
    each kernel as ``forward=``."""
    tok, bounds, xs, gu, mid = cache.tok, cache.bounds, cache.xs, cache.gu, cache.mid
    gate_up, down, _, _ = cache.params
    alpha, limit, h = cache.alpha, cache.limit, cache.x_shape[-1]
    out_in = cache.kind != "gpt_oss"  # the weights stored (out, in)
    txs = None if tx is None else tx.reshape(-1, h)[tok]
    tgu = np.zeros_like(gu)
    for ex, rows in _experts_with_tokens(bounds):
        if txs is not None:
            tgu[rows] += txs[rows] @ (gate_up[ex].T if out_in else gate_up[ex])
        if tgate_up is not None:
            tgu[rows] += xs[rows] @ (tgate_up[ex].T if out_in else tgate_up[ex])
        if tgate_up_bias is not None:
            tgu[rows] += tgate_up_bias[ex]
    hmid = mid[-1]
    if cache.kind == "plain":  # tm = act'(up) tup (the activation's Jacobian is diagonal)
        tm = _ACTS[cache.activation][1](tgu, mid[0])
    elif cache.kind == "swiglu":
        i = gu.shape[1] // 2
        a, act_cache, _ = mid
        # an elementwise activation's Jacobian is diagonal: its backward applied to a tangent is the tangent
        tm = _ACTS[cache.activation][1](tgu[:, :i], act_cache) * gu[:, i:] + a * tgu[:, i:]
    else:
        g, u, sig, glu, _ = mid
        gate, up = gu[:, ::2], gu[:, 1::2]
        tg = tgu[:, ::2] * clamp_inside(gate, None, limit)
        tu = tgu[:, 1::2] * clamp_inside(up, -limit, limit)
        tm = tu * glu + (u + 1.0) * tg * sig * (1.0 + alpha * g * (1.0 - sig))
    ths = np.empty_like(xs)
    for ex, rows in _experts_with_tokens(bounds):
        np.matmul(tm[rows], down[ex].T if out_in else down[ex], out=ths[rows])
        if tdown is not None:
            ths[rows] += hmid[rows] @ (tdown[ex].T if out_in else tdown[ex])
        if tdown_bias is not None:
            ths[rows] += tdown_bias[ex]
    return txs, tgu, tm, ths


def moe_experts_backward_jvp(dout: np.ndarray, cache: MoeExpertsCache, tangents, ddout=None):
    """Second order of ``moe_experts``: the backward's gradients and their tangents along
    ``tangents = (tx, tweights, tgate_up, tdown, tgate_up_bias, tdown_bias)`` (``moe_experts_jvp``'s
    order; None or left out: zero) and ``ddout`` (``tdy``).

    The indices have no tangent (the choice is piecewise constant).  On the sorted rows, with the
    forward's tangents ``tgu``, ``tm``, ``th`` (``moe_experts_jvp``'s steps), each backward step
    by the product rule: ``tdw = <tdy, h> + <dy, th>``; ``tdh = tw dy + w tdy``; per expert ``tdm
    = tdh Wd + dh tWd``, ``tdWd = tdh^T m + dh^T tm``, ``tdbd = sum tdh``; SwiGLU ``tdup = tdm a +
    dm act'(gate) tgate`` and ``tdgate`` the activation's own second order of ``dm up`` along
    ``(tgate, tdm up + dm tup)``; GPT-OSS, with ``phi(g) = g s``, ``phi' = s (1 + alpha g (1 -
    s))``, ``phi'' = alpha s (1 - s) (2 + alpha g (1 - 2 s))``: ``tdup = (tdm phi + dm phi' tg)
    [in]``, ``tdgate = (tdm (u + 1) phi' + dm tu phi' + dm (u + 1) phi'' tg) [gate <= limit]``
    (the clamps' masks constant, ``tg``, ``tu`` the clamped tangents); ``tdgu`` back through the
    gate-up projection: ``tdx = tdgu Wgu + dgu tWgu``, ``tdWgu = tdgu^T x + dgu^T tx``, ``tdbgu = sum
    tdgu``; the ``tdx`` rows summed over the slots as the backward's.

    Parameters
    ----------
    dout : ndarray ``(..., H)``
    cache : MoeExpertsCache
    tangents : tuple or None
        As ``moe_experts_jvp`` takes them (a bias tangent only when the forward had the bias).
    ddout : ndarray ``(..., H)``, optional
        The tangent of ``dout`` (None: zero).

    Returns
    -------
    (grads, grad_tangents)
        ``grads`` exactly ``moe_experts_backward(dout, cache)``; ``grad_tangents`` in its order and
        shapes, None where it has None.

    Raises
    ------
    TypeError, ValueError
        A cache from another op, ``dout``, ``ddout`` or a tangent of the wrong kind or shape, or
        a tangent for a bias the forward did not have.
    """
    check_cache(cache, MoeExpertsCache, "moe_experts_backward_jvp")
    dout, tangents, ddout = check_backward_jvp(
        dout, tangents, ddout, "moe_experts_backward_jvp", cache.x_shape, cache.hs.dtype, _specs(cache)
    )
    return moe_experts_backward_jvp_kernel(dout, cache, tangents, ddout)


def _expert_linear_tangents(bounds, out_in, w, tw, a, ta, g, tg, tda, tdw, tdb) -> None:
    """The tangents of one expert layer's backward on the sorted rows, per expert: the layer
    ``o = a W^T + b`` (``W`` stored ``(out, in)`` for SwiGLU and plain experts (``out_in``),
    ``(in, out)`` for GPT-OSS) has the
    backward ``da = g W``, ``dW = g^T a``, ``db = sum g``, whose tangents ``tda = tg W + g tW``,
    ``tdW = tg^T a + g^T ta``, ``tdb = sum tg`` are written into ``tda``, ``tdw`` and ``tdb`` (None:
    no bias).  ``tw``, ``ta`` None: zero."""
    for ex, rows in _experts_with_tokens(bounds):
        np.matmul(tg[rows], w[ex] if out_in else w[ex].T, out=tda[rows])
        if tw is not None:
            tda[rows] += g[rows] @ (tw[ex] if out_in else tw[ex].T)
        if out_in:
            tdw[ex] = tg[rows].T @ a[rows]
            if ta is not None:
                tdw[ex] += g[rows].T @ ta[rows]
        else:
            tdw[ex] = a[rows].T @ tg[rows]
            if ta is not None:
                tdw[ex] += ta[rows].T @ g[rows]
        if tdb is not None:
            tdb[ex] = tg[rows].sum(0)


def moe_experts_backward_jvp_kernel(dout, cache, tangents, ddout=None, *, forward=None):
    """The kernel of ``moe_experts_backward_jvp`` (``tangents`` the checked six, None = zero);
    ``forward``: what ``experts_tangents`` gave along the same tangents (computed here when
    None).  The backward's own intermediates (``dm``, ``dgu``) come from its kernel, not again."""
    tx, tweights, tgate_up, tdown, tgate_up_bias, tdown_bias = tangents
    grads, (dys, dhs, dm, dgu) = moe_experts_backward_kernel(dout, cache, keep=True)
    order, tok, bounds, ws, xs, gu, mid = cache.order, cache.tok, cache.bounds, cache.ws, cache.xs, cache.gu, cache.mid
    gate_up, down, gate_up_bias, down_bias = cache.params
    alpha, limit, x_shape, k = cache.alpha, cache.limit, cache.x_shape, cache.k
    out_in = cache.kind != "gpt_oss"  # the weights stored (out, in)
    h = x_shape[-1]
    if forward is None:
        forward = experts_tangents(cache, tx, tgate_up, tdown, tgate_up_bias, tdown_bias)
    txs, tgu, tm, ths = forward
    n = dys.shape[0] // k
    tdys = np.zeros_like(dys) if ddout is None else ddout.reshape(-1, h)[tok]
    # dw = <dy, h>
    tdw = np.empty(n * k, dys.dtype)
    tdw[order] = np.einsum("sh,sh->s", tdys, cache.hs) + np.einsum("sh,sh->s", dys, ths)
    # dh = w dy
    tdhs = tdys * ws[:, None]
    if tweights is not None:
        tdhs += dys * tweights.reshape(-1)[order][:, None]
    hmid = mid[-1]
    tdgate_up, tddown = np.zeros_like(gate_up), np.zeros_like(down)
    tdgub = None if gate_up_bias is None else np.zeros_like(gate_up_bias)
    tddb = None if down_bias is None else np.zeros_like(down_bias)
    tdm = np.empty_like(hmid)
    # dm = dh Wd, dWd = dh^T m, dbd = sum dh
    _expert_linear_tangents(bounds, out_in, down, tdown, hmid, tm, dhs, tdhs, tdm, tddown, tddb)
    tdgu = np.empty_like(gu)
    if cache.kind == "plain":  # dup = act'(up) dm: the activation's own second order along (tup, tdm)
        tdgu[:] = _ACT_SECOND[cache.activation](dm, mid[0], (tgu,), tdm)[1]
    elif cache.kind == "swiglu":
        i = gu.shape[1] // 2
        a, act_cache, _ = mid
        up, tgate, tup = gu[:, i:], tgu[:, :i], tgu[:, i:]
        ta = _ACTS[cache.activation][1](tgate, act_cache)  # act' is diagonal
        tdgu[:, :i] = _ACT_SECOND[cache.activation](dm * up, act_cache, (tgate,), tdm * up + dm * tup)[1]
        tdgu[:, i:] = tdm * a + dm * ta
    else:
        g, u, sig, glu, _ = mid
        gate, up = gu[:, ::2], gu[:, 1::2]
        below, inside = clamp_inside(gate, None, limit), clamp_inside(up, -limit, limit)  # clamp's masks
        tg, tu = tgu[:, ::2] * below, tgu[:, 1::2] * inside
        dphi = sig * (1.0 + alpha * g * (1.0 - sig))
        d2phi = alpha * sig * (1.0 - sig) * (2.0 + alpha * g * (1.0 - 2.0 * sig))
        tdgu[:, ::2] = (tdm * (u + 1.0) * dphi + dm * tu * dphi + dm * (u + 1.0) * d2phi * tg) * below
        tdgu[:, 1::2] = (tdm * glu + dm * dphi * tg) * inside
    tdxs = np.empty_like(xs)
    # dx = dgu Wgu, dWgu = dgu^T x, dbgu = sum dgu
    _expert_linear_tangents(bounds, out_in, gate_up, tgate_up, xs, txs, dgu, tdgu, tdxs, tdgate_up, tdgub)
    tdx_pairs = np.empty_like(tdxs)
    tdx_pairs[order] = tdxs
    tdx = tdx_pairs.reshape(n, k, h).sum(1).reshape(x_shape)
    return grads, (tdx, tdw.reshape(x_shape[:-1] + (k,)), tdgate_up, tddown, tdgub, tddb)
