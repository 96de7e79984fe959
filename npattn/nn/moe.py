"""Mixture of experts: a top-k router, fused experts, the sparse block of GPT-OSS, DeepSeek-V3 and Qwen3-Next.

Each token ``x_n`` (``N`` tokens, width ``H``) goes to ``k`` of ``E`` experts; the block's output is

    y_n = sum_{j < k} w_nj * expert_{i_nj}(x_n)  (+ shared expert, maybe gated)

where the router gives the chosen experts ``i (N, k)`` and their weights ``w (N, k)``.

Modules (parameter names and shapes are those of the Hugging Face ``transformers`` 5.x state dict
under a decoder layer's ``mlp.`` prefix, so a state dict loads unchanged):

* ``TopKRouter``: ``weight (E, H)`` [+ ``bias (E,)``, GPT-OSS] [+ the buffer
  ``e_score_correction_bias (E,)``, DeepSeek-V3].  Variants: ``"softmax_topk"`` (softmax over all
  experts then top-k, optionally renormalised: Qwen3-Next, Mixtral), ``"topk_softmax"`` (top-k of
  the logits then a softmax over the chosen: GPT-OSS), ``"sigmoid"`` (sigmoid scores, a correction
  bias used for the choice only, group-limited top-k, a routed scaling factor: DeepSeek-V3).
* ``Experts``: SwiGLU experts as fused 3-D parameters ``gate_up_proj (E, 2I, H)`` (rows: the ``I``
  gate rows, then the ``I`` up rows) and ``down_proj (E, H, I)``: ``down(act(gate) * up)``
  (DeepSeek-V3, Qwen3-Next).
* ``GptOssExperts``: ``gate_up_proj (E, H, 2I)`` (transposed; gate and up columns interleaved),
  ``gate_up_proj_bias (E, 2I)``, ``down_proj (E, I, H)``, ``down_proj_bias (E, H)``; GPT-OSS's
  clamped SwiGLU ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, l)``.
* ``GatedMLP``: the dense ``down_proj(act(gate_proj(x)) * up_proj(x))`` of the shared experts.
* ``SparseMoeBlock`` (alias ``MoE``): router + experts + optional shared expert(s) and sigmoid
  shared-expert gate; ``SparseMoeBlock.from_hf_config(config)`` builds it from a model's config.

Dispatch sorts, it never computes every expert on every token: the ``N k`` (token, slot) pairs
are ordered by expert id (``order = argsort(flat expert ids)``, stable), the tokens are gathered
in that order so each expert's tokens form one contiguous slice, each expert runs once on its
slice, and the results go back to their (token, slot) places through the same permutation
(``y_pairs[order] = ...``), to be summed over the ``k`` slots.  Backward scatters with that
permutation again.

Gradients.  The choice of experts is a piecewise-constant function of the logits (it changes only
where two scores tie), so its derivative is zero almost everywhere: no gradient flows through
*which* experts were chosen, only through the chosen weights ``w`` and the chosen experts' own
computations.  At a tie the function jumps and has no derivative; finite-difference checks must
stay away from ties.  DeepSeek-V3's ``e_score_correction_bias`` enters only the choice, so it
gets no gradient (it is a buffer, updated by a load-balancing rule outside backprop).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, NamedTuple, Optional

import numpy as np

from .._validate import (
    as_float,
    as_index,
    as_rng,
    check_bool,
    check_dtype,
    check_positive_float,
    check_size,
    check_tangent,
)
from .layers import Linear, _act, _check_features, _input_tangent
from .module import Module, Parameter

__all__ = [
    "ROUTER_VARIANTS",
    "HIDDEN_ACTS",
    "TopKRouter",
    "Experts",
    "GptOssExperts",
    "GatedMLP",
    "SparseMoeBlock",
    "MoE",
]

ROUTER_VARIANTS = ("softmax_topk", "topk_softmax", "sigmoid")

# Hugging Face ``hidden_act`` names -> npattn's activation kernels (``layers._act``)
HIDDEN_ACTS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "relu": "relu",
}

# the renormalisation ``w / (sum w + eps)``: DeepSeek-V3 adds 1e-20 to a sum of sigmoids (which
# may underflow); a sum of softmax probabilities is >= 1/E and is divided as it is (Qwen3-Next)
_SIGMOID_NORM_EPS = 1e-20


def _sigmoid(z: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-z))`` without overflow: with ``e = exp(-|z|) <= 1``, ``1/(1+e)`` for z >= 0
    and ``e/(1+e)`` for z < 0."""
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0, e) / (1.0 + e)


def _check_hidden_act(hidden_act) -> str:
    if not isinstance(hidden_act, str) or hidden_act not in HIDDEN_ACTS:
        raise ValueError(f"hidden_act: expected one of {sorted(HIDDEN_ACTS)}, got {hidden_act!r}")
    return HIDDEN_ACTS[hidden_act]


def _check_real(x, name: str) -> float:
    """A finite real number (bools and non-numbers: ``TypeError``; NaN and inf: ``ValueError``)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: expected a finite real number, got {x!r} ({type(x).__name__})")
    if not math.isfinite(float(x)):
        raise ValueError(f"{name}: expected a finite real number, got {x!r}")
    return float(x)


def _topk(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest entries of each row of ``scores (N, E)``, largest first (as
    ``torch.topk(sorted=True)``); equal chosen scores keep the lower index first.  Which of two
    equal scores at the boundary is chosen is not specified (nor is it by torch)."""
    n, e = scores.shape
    if k < e:
        cand = np.argpartition(-scores, k - 1, axis=-1)[:, :k]  # the k largest, unordered
        cand.sort(axis=-1)  # ascending index, so the stable sort below breaks ties by index
    else:
        cand = np.broadcast_to(np.arange(e), (n, e))
    vals = np.take_along_axis(scores, cand, -1)
    return np.take_along_axis(cand, np.argsort(-vals, axis=-1, kind="stable"), -1)


def _grad_buffer(p: Parameter) -> np.ndarray:
    """``p.grad``, created as zeros when the user set it to None (experts add into it slice by slice)."""
    if p.grad is None:
        p.grad = np.zeros_like(p.data)
    return p.grad


# ------------------------------------------------------------------------------------------ router


class RouterCache(NamedTuple):
    x: np.ndarray  # (N, H) the router's input
    idx: np.ndarray  # (N, k) chosen experts
    v: np.ndarray  # (N, k) the chosen probabilities / logits / sigmoid scores
    p: Optional[np.ndarray]  # (N, E) softmax probabilities ("softmax_topk" only)
    r: np.ndarray  # (N, k) the weights before the routed scaling factor
    denom: Optional[np.ndarray]  # (N, 1) the renormalisation's denominator, or None
    lead: tuple  # the leading axes of the public input (N = their product)


class TopKRouter(Module):
    """Chooses ``top_k`` of ``num_experts`` experts per token and weighs them.

    With logits ``z = x W^T (+ b)`` (``W (E, H)``), per token:

    * ``"softmax_topk"``: ``p = softmax(z)``; the chosen are the top-k of ``p``; ``w = p_chosen``,
      divided by its sum when ``norm_topk_prob`` (Qwen3-Next, Qwen3-MoE, Mixtral);
    * ``"topk_softmax"``: the chosen are the top-k of ``z``; ``w = softmax(z_chosen)`` (GPT-OSS,
      with ``bias=True``);
    * ``"sigmoid"``: ``s = sigmoid(z)``; the chosen are the top-k of ``s + e_score_correction_bias``
      (the buffer: used for the choice only); ``w = s_chosen``, divided by ``sum + 1e-20`` when
      ``norm_topk_prob`` (DeepSeek-V3).

    With ``n_group > 1`` the choice is group-limited (DeepSeek-V3): the experts form ``n_group``
    consecutive groups; a group's score is the sum of its two best choice scores; only the
    ``topk_group`` best groups compete for the top-k.  Finally ``w *= routed_scaling_factor``.

    ``forward(x (..., H)) -> (weights (..., k), indices (..., k))``, indices largest first;
    ``backward(dweights) -> dx`` adds into ``weight.grad`` (and ``bias.grad``).  The last forward's
    statistics: ``last_counts`` (tokens per expert, ``(E,)`` int64), ``last_indices``,
    ``last_logits`` ``(..., E)`` (the router logits, for load-balancing losses).

    Parameters
    ----------
    hidden_size, num_experts, top_k : int
        ``H``, ``E`` and ``k`` (``1 <= k <= E``).
    variant : str
        One of ``ROUTER_VARIANTS``.
    norm_topk_prob : bool
        Renormalise the chosen weights to sum to 1 (not with ``"topk_softmax"``: already so).
    bias : bool
        A learnt logit bias [``bias (E,)``].
    routed_scaling_factor : float
        Multiplies the weights (DeepSeek-V3's 2.5).
    n_group, topk_group : int
        Group-limited choice; ``n_group`` divides ``E`` with at least 2 experts per group,
        ``topk_group <= n_group`` and ``top_k <= topk_group * E / n_group``.
    rng, dtype
        As every module: ``weight`` and ``bias`` are drawn from U(-1/sqrt(H), 1/sqrt(H)).

    Raises
    ------
    TypeError, ValueError
        For a bad argument, naming it.
    """

    e_score_correction_bias: np.ndarray  # a buffer, with variant "sigmoid"

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        variant: str = "softmax_topk",
        norm_topk_prob: bool = False,
        bias: bool = False,
        routed_scaling_factor: float = 1.0,
        n_group: int = 1,
        topk_group: int = 1,
        rng=None,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        self.hidden_size = check_size(hidden_size, "hidden_size")
        self.num_experts = check_size(num_experts, "num_experts")
        self.top_k = check_size(top_k, "top_k")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k: expected at most num_experts ({self.num_experts}), got {self.top_k}")
        if not isinstance(variant, str) or variant not in ROUTER_VARIANTS:
            raise ValueError(f"variant: expected one of {ROUTER_VARIANTS}, got {variant!r}")
        self.variant = variant
        self.norm_topk_prob = check_bool(norm_topk_prob, "norm_topk_prob")
        if self.norm_topk_prob and variant == "topk_softmax":
            raise ValueError(
                "norm_topk_prob: expected False with variant 'topk_softmax' (its weights already sum to 1), got True"
            )
        has_bias = check_bool(bias, "bias")
        self.routed_scaling_factor = check_positive_float(routed_scaling_factor, "routed_scaling_factor")
        self.n_group = check_size(n_group, "n_group")
        self.topk_group = check_size(topk_group, "topk_group")
        if self.n_group > 1:
            e, g = self.num_experts, self.n_group
            if e % g or e // g < 2:
                raise ValueError(
                    f"n_group: expected a divisor of num_experts ({e}) leaving at least 2 experts per group, got {g}"
                )
            if self.topk_group > g:
                raise ValueError(f"topk_group: expected at most n_group ({g}), got {self.topk_group}")
            if self.top_k > self.topk_group * (e // g):
                raise ValueError(
                    f"top_k: expected at most topk_group * num_experts / n_group = {self.topk_group * (e // g)} "
                    f"(the experts of the chosen groups), got {self.top_k}"
                )
        self._dtype = check_dtype(dtype)
        rng = as_rng(rng)
        bound = 1.0 / math.sqrt(self.hidden_size)
        self.weight = Parameter(rng.uniform(-bound, bound, (self.num_experts, self.hidden_size)), self._dtype)
        self.bias = Parameter(rng.uniform(-bound, bound, (self.num_experts,)), self._dtype) if has_bias else None
        if variant == "sigmoid":
            self.register_buffer("e_score_correction_bias", np.zeros(self.num_experts, self._dtype))
        self.last_counts: Optional[np.ndarray] = None
        self.last_indices: Optional[np.ndarray] = None
        self.last_logits: Optional[np.ndarray] = None

    def forward(self, x):
        """Route each token.

        Parameters
        ----------
        x : numpy.ndarray
            ``(..., H)`` tokens (cast to the module's dtype).

        Returns
        -------
        weights : numpy.ndarray
            ``(..., k)`` the chosen experts' weights.
        indices : numpy.ndarray
            ``(..., k)`` int64, the chosen experts, the best first (also ``last_indices``).

        Raises
        ------
        TypeError, ValueError
            For an ``x`` that is not a real array of shape ``(..., H)``.
        """
        x = as_float(x, "x", self.dtype)
        _check_features(x, "x", self.hidden_size, f"TopKRouter({self.hidden_size}, {self.num_experts})")
        w, _ = self._forward(x.reshape(-1, self.hidden_size), x.shape[:-1])
        self._shape_stats(x.shape[:-1])
        return w.reshape(x.shape[:-1] + (self.top_k,)), self.last_indices

    def _shape_stats(self, lead: tuple) -> None:
        """Give ``last_logits`` and ``last_indices`` the leading axes of the input."""
        self.last_logits = self.last_logits.reshape(lead + (self.num_experts,))  # type: ignore[union-attr]
        self.last_indices = self.last_indices.reshape(lead + (self.top_k,))  # type: ignore[union-attr]

    def _choice(self, scores: np.ndarray) -> np.ndarray:
        """Top-k of ``scores (N, E)`` within the ``topk_group`` best groups (all of them when
        ``n_group == 1``).  Piecewise constant in the scores: no gradient flows through it."""
        if self.n_group > 1:
            n, g = scores.shape[0], self.n_group
            grouped = scores.reshape(n, g, self.num_experts // g)
            best2 = -np.partition(-grouped, 1, axis=-1)[..., :2]  # the two best of each group
            keep = _topk(best2.sum(-1), self.topk_group)  # (N, topk_group) groups
            allowed = np.zeros((n, g), bool)
            np.put_along_axis(allowed, keep, True, -1)
            scores = np.where(allowed[..., None], grouped, -np.inf).reshape(n, self.num_experts)
        return _topk(scores, self.top_k)

    def _forward(self, x: np.ndarray, lead: Optional[tuple] = None):
        """``x (N, H)`` checked -> ``(weights (N, k), indices (N, k))``; ``lead``: the public
        input's leading axes (default ``(N,)``)."""
        z = x @ self.weight.data.T  # (N, E) logits
        if self.bias is not None:
            z += self.bias.data
        p = denom = None
        if self.variant == "softmax_topk":
            p = np.exp(z - z.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)  # (N, E)
            idx = self._choice(p)
            v = np.take_along_axis(p, idx, -1)
        elif self.variant == "topk_softmax":
            idx = self._choice(z)
            v = np.take_along_axis(z, idx, -1)  # chosen logits
        else:
            s = _sigmoid(z)
            idx = self._choice(s + self.e_score_correction_bias)  # the bias steers the choice only
            v = np.take_along_axis(s, idx, -1)
        if self.variant == "topk_softmax":
            r = np.exp(v - v[:, :1])  # v[:, 0] is the row's largest
            r /= r.sum(-1, keepdims=True)
        elif self.norm_topk_prob:
            denom = v.sum(-1, keepdims=True)
            if self.variant == "sigmoid":
                denom += _SIGMOID_NORM_EPS
            r = v / denom
        else:
            r = v
        w = r * self.routed_scaling_factor if self.routed_scaling_factor != 1.0 else r.copy()
        self.last_logits = z
        self.last_indices = idx
        self.last_counts = np.bincount(idx.reshape(-1), minlength=self.num_experts)
        self.save_for_backward(RouterCache(x, idx, v, p, r, denom, x.shape[:1] if lead is None else lead))
        return w, idx

    def backward(self, dweights) -> np.ndarray:
        """Gradient through the chosen weights (the choice itself has none).

        Parameters
        ----------
        dweights : numpy.ndarray
            ``(..., k)`` the gradient of the loss with respect to the returned weights.

        Returns
        -------
        numpy.ndarray
            ``(..., H)`` the gradient with respect to ``x``; ``weight.grad`` (and ``bias.grad``)
            grow by theirs.

        Raises
        ------
        RuntimeError
            Without a forward state.
        TypeError, ValueError
            For a ``dweights`` of another kind or shape.
        """
        dw = self._check_dy(dweights, "dweights")
        return self._backward(dw.reshape(-1, self.top_k)).reshape(dw.shape[:-1] + (self.hidden_size,))

    def _backward(self, dw: np.ndarray) -> np.ndarray:
        """``dw (N, k)`` -> ``dx (N, H)``.

        Backward, step by step (the choice ``idx`` is a constant: see the module docstring):
        ``w = c r``                      -> ``dr = c dw``
        renormalised, ``r = v / D``, ``D = sum v (+ eps)`` ->
                                            ``dv_j = dr_j / D - sum_i dr_i v_i / D^2 = (dr_j - sum_i dr_i r_i) / D``
        otherwise ``r = v``              -> ``dv = dr``
        ``"topk_softmax"``, ``r = softmax(v)`` -> ``dv = r (dr - sum dr r)``
        ``v`` gathers at ``idx``, so its gradient scatters back there (zero elsewhere):
        ``"topk_softmax"``: ``dz = scatter(dv)`` (v = z_idx)
        ``"sigmoid"``:      ``dz = scatter(dv v (1 - v))`` (v = s_idx, s' = s (1 - s)); the correction
                            bias sits only in the choice: it gets no gradient
        ``"softmax_topk"``: ``dp = scatter(dv)``, then softmax's ``dz = p (dp - sum dp p)``, where
                            ``sum_E dp p = sum_k dv v``: ``dz = scatter(dv v) - p sum_k dv v``
        ``z = x W^T + b``                -> ``dx = dz W``, ``dW = dz^T x``, ``db = sum_N dz``.
        """
        x, idx, v, p, r, denom, _ = self.pop_saved()
        dr = dw * self.routed_scaling_factor if self.routed_scaling_factor != 1.0 else dw
        if self.variant == "topk_softmax":
            dv = r * (dr - (dr * r).sum(-1, keepdims=True))
        elif denom is not None:
            dv = (dr - (dr * r).sum(-1, keepdims=True)) / denom
        else:
            dv = dr
        dz = np.zeros((x.shape[0], self.num_experts), x.dtype)
        if self.variant == "topk_softmax":
            np.put_along_axis(dz, idx, dv, -1)
        elif self.variant == "sigmoid":
            np.put_along_axis(dz, idx, dv * v * (1.0 - v), -1)
        else:
            dvv = dv * v
            np.put_along_axis(dz, idx, dvv, -1)
            dz -= p * dvv.sum(-1, keepdims=True)
        self.accumulate_grad(self.weight, dz.T @ x)
        if self.bias is not None:
            self.accumulate_grad(self.bias, dz.sum(0))
        return dz @ self.weight.data

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: the tangent of the weights ``(..., k)`` (the choice is constant)."""
        tx = _input_tangent(input_tangents, "TopKRouter")
        if tx is not None:
            tx = check_tangent(tx, "tx", state.lead + (self.hidden_size,), state.x.dtype).reshape(state.x.shape)
        return self._jvp_flat(state, tx, param_tangents).reshape(state.lead + (self.top_k,))

    def _jvp_flat(self, state: RouterCache, tx, param_tangents) -> np.ndarray:
        """``tx (N, H)`` or None -> ``tw (N, k)``, the backward's steps forwards:
        ``tz = tx W^T + x tW^T + tb``; ``tv = tz_idx`` (``"topk_softmax"``), ``v (1 - v) tz_idx``
        (``"sigmoid"``), ``v (tz_idx - sum_E p tz)`` (``"softmax_topk"``: softmax's tangent at the
        chosen); ``tr = r (tv - sum r tv)`` (the top-k softmax), ``(tv - r sum tv) / D``
        (renormalised), ``tv`` (otherwise); ``tw = c tr``."""
        x, idx, v, p, r, denom, _ = state
        tz = np.zeros((x.shape[0], self.num_experts), x.dtype)
        if tx is not None:
            tz += tx @ self.weight.data.T
        tweight, tbias = param_tangents.get(self.weight), param_tangents.get(self.bias)
        if tweight is not None:
            tz += x @ tweight.T
        if tbias is not None:
            tz += tbias
        tzi = np.take_along_axis(tz, idx, -1)
        if self.variant == "softmax_topk":
            tv = v * (tzi - (p * tz).sum(-1, keepdims=True))
        elif self.variant == "sigmoid":
            tv = v * (1.0 - v) * tzi
        else:
            tv = tzi
        if self.variant == "topk_softmax":
            tr = r * (tv - (r * tv).sum(-1, keepdims=True))
        elif denom is not None:
            tr = (tv - r * tv.sum(-1, keepdims=True)) / denom
        else:
            tr = tv
        return tr * self.routed_scaling_factor

    def extra_repr(self):
        s = f"{self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, variant={self.variant!r}"
        if self.norm_topk_prob:
            s += ", norm_topk_prob=True"
        if self.n_group > 1:
            s += f", n_group={self.n_group}, topk_group={self.topk_group}"
        if self.routed_scaling_factor != 1.0:
            s += f", routed_scaling_factor={self.routed_scaling_factor}"
        return s


# ----------------------------------------------------------------------------------------- experts


class ExpertsCache(NamedTuple):
    order: np.ndarray  # (S,) the (token, slot) pairs sorted by expert, S = N k
    tok: np.ndarray  # (S,) the token of each sorted pair
    bounds: np.ndarray  # (E + 1,) expert e owns sorted rows bounds[e]:bounds[e+1]
    ws: np.ndarray  # (S,) the routing weight of each sorted pair
    hs: np.ndarray  # (S, H) each pair's expert output, before weighting
    mlp: Any  # the expert MLP's own cache
    shape: tuple  # (N, k)
    lead: tuple  # the leading axes of the public input (N = their product)


class _SortedExperts(Module):
    """What every fused-experts module shares: sorting dispatch and the weighted combine.
    Subclasses define ``_mlp_forward(xs, bounds) -> (hs, cache)`` and ``_mlp_backward(dhs, cache,
    bounds) -> dxs`` on the expert-sorted rows (expert ``e`` owns rows ``bounds[e]:bounds[e+1]``)."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    _dtype: np.dtype

    def _experts(self, bounds: np.ndarray):
        """``(e, rows)`` for every expert that has tokens."""
        for e in np.flatnonzero(bounds[1:] > bounds[:-1]):
            yield int(e), slice(int(bounds[e]), int(bounds[e + 1]))

    def forward(self, x, top_k_index, top_k_weights) -> np.ndarray:
        """``y_n = sum_j w_nj expert_{i_nj}(x_n)``, dispatched by sorting.

        Parameters
        ----------
        x : numpy.ndarray
            ``(..., H)`` tokens.
        top_k_index : numpy.ndarray
            ``(..., k)`` integers in ``[0, E)``: each token's experts (repeats allowed).
        top_k_weights : numpy.ndarray
            ``(..., k)`` their weights.

        Returns
        -------
        numpy.ndarray
            ``(..., H)``.

        Raises
        ------
        TypeError, ValueError
            For a bad argument, naming it.
        """
        x = as_float(x, "x", self.dtype)
        _check_features(x, "x", self.hidden_size, f"{type(self).__name__}(hidden_size={self.hidden_size})")
        idx = as_index(top_k_index, "top_k_index")
        lead = x.shape[:-1]
        if idx.ndim != x.ndim or idx.shape[:-1] != lead or idx.shape[-1] < 1:
            raise ValueError(f"top_k_index: expected shape {lead + ('k',)} (x's leading axes, k >= 1), got {idx.shape}")
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_experts):
            bad = idx.min() if idx.min() < 0 else idx.max()
            raise ValueError(f"top_k_index: expected values in [0, {self.num_experts}), got {bad}")
        w = as_float(top_k_weights, "top_k_weights", self.dtype)
        if w.shape != idx.shape:
            raise ValueError(f"top_k_weights: expected shape {idx.shape} (top_k_index's), got {w.shape}")
        k = idx.shape[-1]
        y = self._forward(x.reshape(-1, self.hidden_size), idx.reshape(-1, k), w.reshape(-1, k), lead)
        return y.reshape(x.shape)

    def _forward(self, x: np.ndarray, idx: np.ndarray, w: np.ndarray, lead: Optional[tuple] = None) -> np.ndarray:
        """Sorting dispatch: ``x (N, H)``, ``idx, w (N, k)`` checked -> ``y (N, H)``; ``lead``: the
        public input's leading axes (default ``(N,)``)."""
        n, k = idx.shape
        flat = idx.reshape(-1)  # pair t = n k + j is token n's j-th choice
        order = np.argsort(flat, kind="stable")  # (S,) pairs grouped by expert
        bounds = np.zeros(self.num_experts + 1, np.intp)
        np.cumsum(np.bincount(flat, minlength=self.num_experts), out=bounds[1:])
        tok = order // k  # (S,) token of each sorted pair
        ws = w.reshape(-1)[order]  # (S,)
        hs, mlp = self._mlp_forward(x[tok], bounds)  # (S, H): each expert on its contiguous slice
        y_pairs = np.empty_like(hs)
        y_pairs[order] = hs * ws[:, None]  # back to (token, slot) order: the inverse permutation
        self.save_for_backward(ExpertsCache(order, tok, bounds, ws, hs, mlp, (n, k), (n,) if lead is None else lead))
        return y_pairs.reshape(n, k, x.shape[1]).sum(1)  # (N, H)

    def backward(self, dy):
        """Gradients of the inputs; every parameter's ``.grad`` grows by its own.

        Parameters
        ----------
        dy : numpy.ndarray
            ``(..., H)`` the gradient with respect to the output.

        Returns
        -------
        dx : numpy.ndarray
            ``(..., H)``.
        dtop_k_weights : numpy.ndarray
            ``(..., k)`` (the indices have no gradient).

        Raises
        ------
        RuntimeError
            Without a forward state.
        TypeError, ValueError
            For a ``dy`` of another kind or shape.
        """
        dy = self._check_dy(dy, "dy")
        n, k = self.saved_state().shape
        dx, dw = self._backward(dy.reshape(n, self.hidden_size))
        return dx.reshape(dy.shape), dw.reshape(dy.shape[:-1] + (k,))

    def _backward(self, dy: np.ndarray):
        """``dy (N, H)`` -> ``(dx (N, H), dw (N, k))``.

        ``y_n = sum_j w_nj h_nj`` with ``h_nj = expert_{i_nj}(x_n)``: ``dw_nj = <dy_n, h_nj>``,
        ``dh_nj = w_nj dy_n``; each expert's backward turns its ``dh`` rows into ``dx`` rows, which
        go back to (token, slot) order through the forward's permutation and sum over the slots
        (a token chosen by k experts receives k gradients)."""
        order, tok, bounds, ws, hs, mlp, (n, k), _ = self.pop_saved()
        dys = dy[tok]  # (S, H) each sorted pair's upstream gradient
        dw = np.empty(n * k, dy.dtype)
        dw[order] = np.einsum("sh,sh->s", dys, hs)
        dxs = self._mlp_backward(dys * ws[:, None], mlp, bounds)  # (S, H)
        dx_pairs = np.empty_like(dxs)
        dx_pairs[order] = dxs
        return dx_pairs.reshape(n, k, dy.shape[1]).sum(1), dw.reshape(n, k)

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: ``input_tangents`` are ``(tx, None, ttop_k_weights)`` (the indices have
        no tangent); returns ``ty (..., H)``."""
        if len(input_tangents) > 3:
            raise TypeError(f"{type(self).__name__}.jvp: expected at most 3 input tangents, got {len(input_tangents)}")
        tx, tidx, tw = tuple(input_tangents) + (None,) * (3 - len(input_tangents))
        if tidx is not None:
            raise TypeError(f"{type(self).__name__}.jvp: top_k_index has no tangent; expected None")
        (n, k), lead, dtype = state.shape, state.lead, state.hs.dtype
        if tx is not None:
            tx = check_tangent(tx, "tx", lead + (self.hidden_size,), dtype).reshape(n, self.hidden_size)
        if tw is not None:
            tw = check_tangent(tw, "ttop_k_weights", lead + (k,), dtype).reshape(n, k)
        return self._jvp_flat(state, tx, tw, param_tangents).reshape(lead + (self.hidden_size,))

    def _jvp_flat(self, state: ExpertsCache, tx, tw, param_tangents) -> np.ndarray:
        """``ty_n = sum_j (tw_nj h_nj + w_nj th_nj)``: the experts' tangents on the sorted rows,
        back to (token, slot) order through the same permutation, summed over the slots."""
        order, tok, bounds, ws, hs, mlp, (n, k), _ = state
        ty_sorted = ws[:, None] * self._mlp_jvp(None if tx is None else tx[tok], mlp, bounds, param_tangents)
        if tw is not None:
            ty_sorted += tw.reshape(-1)[order][:, None] * hs
        ty_pairs = np.empty_like(ty_sorted)
        ty_pairs[order] = ty_sorted
        return ty_pairs.reshape(n, k, hs.shape[1]).sum(1)

    def _mlp_forward(self, xs, bounds):  # pragma: no cover - abstract
        raise NotImplementedError

    def _mlp_jvp(self, txs, cache, bounds, param_tangents):  # pragma: no cover - abstract
        raise NotImplementedError

    def _mlp_backward(self, dhs, cache, bounds):  # pragma: no cover - abstract
        raise NotImplementedError

    def extra_repr(self):
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}"
        )


def _init_experts(module: Module, num_experts, hidden_size, intermediate_size, dtype, rng):
    module.num_experts = check_size(num_experts, "num_experts")
    module.hidden_size = check_size(hidden_size, "hidden_size")
    module.intermediate_size = check_size(intermediate_size, "intermediate_size")
    module._dtype = check_dtype(dtype)
    return as_rng(rng)


class Experts(_SortedExperts):
    """``E`` gated experts as fused 3-D parameters (DeepSeek-V3, Qwen3-Next, Qwen3-MoE, Mixtral in
    ``transformers`` 5.x): ``gate_up_proj (E, 2I, H)``, whose first ``I`` rows are the gate
    projection and last ``I`` rows the up projection, and ``down_proj (E, H, I)``; expert ``e`` maps
    ``x -> down_e (act(gate_e x) * up_e x)``.

    ``forward(x (..., H), top_k_index (..., k), top_k_weights (..., k)) -> y (..., H)``;
    ``backward(dy) -> (dx, dtop_k_weights)``.

    Parameters
    ----------
    num_experts, hidden_size, intermediate_size : int
        ``E``, ``H`` and each expert's ``I`` (``moe_intermediate_size``).
    hidden_act : str
        A Hugging Face activation name, one of ``HIDDEN_ACTS`` (``"silu"`` by default).
    rng, dtype
        As every module; weights from U(-1/sqrt(fan_in), 1/sqrt(fan_in)).

    Raises
    ------
    TypeError, ValueError
        For a bad argument, naming it.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        hidden_act: str = "silu",
        rng=None,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        rng = _init_experts(self, num_experts, hidden_size, intermediate_size, dtype, rng)
        self.hidden_act = hidden_act
        self._act = _check_hidden_act(hidden_act)
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        self.gate_up_proj = Parameter(rng.uniform(-1, 1, (e, 2 * i, h)) / math.sqrt(h), self._dtype)
        self.down_proj = Parameter(rng.uniform(-1, 1, (e, h, i)) / math.sqrt(i), self._dtype)

    def _mlp_forward(self, xs, bounds):
        """``gu = x Wgu_e^T`` per expert slice, then ``h = act(gate) * up`` on all rows at once and
        ``o = h Wd_e^T`` per slice."""
        i = self.intermediate_size
        gu = np.empty((xs.shape[0], 2 * i), xs.dtype)  # (S, 2I)
        for e, rows in self._experts(bounds):
            np.matmul(xs[rows], self.gate_up_proj.data[e].T, out=gu[rows])
        act, _, kwargs = _act(self._act)
        a, act_cache = act(gu[:, :i], **kwargs)  # (S, I)
        h = a * gu[:, i:]
        out = np.empty_like(xs)  # (S, H)
        for e, rows in self._experts(bounds):
            np.matmul(h[rows], self.down_proj.data[e].T, out=out[rows])
        return out, (xs, gu, a, act_cache, h)

    def _mlp_backward(self, dhs, cache, bounds):
        """``o = h Wd^T``: ``dh = do Wd``, ``dWd = do^T h``;  ``h = a up``: ``da = dh up``,
        ``dup = dh a``;  ``a = act(gate)``: ``dgate = act'(gate) da``;  ``gu = x Wgu^T``:
        ``dx = dgu Wgu``, ``dWgu = dgu^T x`` (each per expert slice)."""
        xs, gu, a, act_cache, h = cache
        i = self.intermediate_size
        g_gu, g_d = _grad_buffer(self.gate_up_proj), _grad_buffer(self.down_proj)
        dh = np.empty_like(h)  # (S, I)
        for e, rows in self._experts(bounds):
            np.matmul(dhs[rows], self.down_proj.data[e], out=dh[rows])
            g_d[e] += dhs[rows].T @ h[rows]
        dgu = np.empty_like(gu)  # (S, 2I)
        dgu[:, :i] = _act(self._act)[1](dh * gu[:, i:], act_cache)
        np.multiply(dh, a, out=dgu[:, i:])
        dxs = np.empty_like(xs)
        for e, rows in self._experts(bounds):
            g_gu[e] += dgu[rows].T @ xs[rows]
            np.matmul(dgu[rows], self.gate_up_proj.data[e], out=dxs[rows])
        return dxs

    def _mlp_jvp(self, txs, cache, bounds, param_tangents):
        """The forward's steps on tangents: ``tgu = tx Wgu^T + x tWgu^T``; ``th = act'(gate) tgate up
        + act(gate) tup`` (an elementwise activation's Jacobian is diagonal: its backward kernel
        applied to a tangent gives the tangent); ``to = th Wd^T + h tWd^T``."""
        xs, gu, a, act_cache, h = cache
        i = self.intermediate_size
        t_gu, t_d = param_tangents.get(self.gate_up_proj), param_tangents.get(self.down_proj)
        tgu = np.zeros_like(gu)
        for e, rows in self._experts(bounds):
            if txs is not None:
                tgu[rows] += txs[rows] @ self.gate_up_proj.data[e].T
            if t_gu is not None:
                tgu[rows] += xs[rows] @ t_gu[e].T
        th = _act(self._act)[1](tgu[:, :i], act_cache) * gu[:, i:] + a * tgu[:, i:]
        to = np.empty_like(xs)
        for e, rows in self._experts(bounds):
            np.matmul(th[rows], self.down_proj.data[e].T, out=to[rows])
            if t_d is not None:
                to[rows] += h[rows] @ t_d[e].T
        return to

    def extra_repr(self):
        return super().extra_repr() + f", hidden_act={self.hidden_act!r}"


class GptOssExperts(_SortedExperts):
    """GPT-OSS's experts: ``gate_up_proj (E, H, 2I)`` (applied as ``x @ gate_up_proj[e]``; column
    ``2j`` is gate unit ``j``, column ``2j+1`` up unit ``j``), ``gate_up_proj_bias (E, 2I)``,
    ``down_proj (E, I, H)`` (``h @ down_proj[e]``), ``down_proj_bias (E, H)``, and the clamped SwiGLU::

        g = min(gate, limit),  u = clamp(up, -limit, limit),  h = (u + 1) * g * sigmoid(alpha g)

    ``forward(x (..., H), top_k_index (..., k), top_k_weights (..., k)) -> y (..., H)``;
    ``backward(dy) -> (dx, dtop_k_weights)``.

    Parameters
    ----------
    num_experts, hidden_size, intermediate_size : int
        ``E``, ``H``, ``I`` (GPT-OSS's ``intermediate_size``).
    alpha, limit : float
        ``swiglu_alpha`` (1.702) and ``swiglu_limit`` (7.0, > 0).
    rng, dtype
        As every module.

    Raises
    ------
    TypeError, ValueError
        For a bad argument, naming it.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        alpha: float = 1.702,
        limit: float = 7.0,
        rng=None,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        rng = _init_experts(self, num_experts, hidden_size, intermediate_size, dtype, rng)
        self.alpha = _check_real(alpha, "alpha")
        self.limit = check_positive_float(limit, "limit")
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        self.gate_up_proj = Parameter(rng.uniform(-1, 1, (e, h, 2 * i)) / math.sqrt(h), self._dtype)
        self.gate_up_proj_bias = Parameter(rng.uniform(-1, 1, (e, 2 * i)) / math.sqrt(h), self._dtype)
        self.down_proj = Parameter(rng.uniform(-1, 1, (e, i, h)) / math.sqrt(i), self._dtype)
        self.down_proj_bias = Parameter(rng.uniform(-1, 1, (e, h)) / math.sqrt(i), self._dtype)

    def _mlp_forward(self, xs, bounds):
        i = self.intermediate_size
        gu = np.empty((xs.shape[0], 2 * i), xs.dtype)  # (S, 2I)
        for e, rows in self._experts(bounds):
            np.matmul(xs[rows], self.gate_up_proj.data[e], out=gu[rows])
            gu[rows] += self.gate_up_proj_bias.data[e]
        gate, up = gu[:, ::2], gu[:, 1::2]  # interleaved columns
        g = np.minimum(gate, self.limit)
        u = np.clip(up, -self.limit, self.limit)
        sig = _sigmoid(self.alpha * g)
        glu = g * sig
        h = (u + 1.0) * glu  # (S, I)
        out = np.empty_like(xs)
        for e, rows in self._experts(bounds):
            np.matmul(h[rows], self.down_proj.data[e], out=out[rows])
            out[rows] += self.down_proj_bias.data[e]
        return out, (xs, gu, g, u, sig, glu, h)

    def _mlp_backward(self, dhs, cache, bounds):
        """``o = h Wd + bd``: ``dh = do Wd^T``, ``dWd = h^T do``, ``dbd = sum do``.
        ``h = (u + 1) glu``: ``dglu = dh (u + 1)``, ``du = dh glu``.
        ``glu = g sigmoid(alpha g)``: ``dg = dglu s (1 + alpha g (1 - s))``, ``s = sigmoid(alpha g)``.
        The clamps pass the gradient where the input lies within the limits (bounds included, as
        torch's ``clamp``) and give zero outside, where the output is a constant:
        ``dgate = dg [gate <= limit]``, ``dup = du [-limit <= up <= limit]``.
        ``gu = x Wgu + bgu`` (columns interleaved back): ``dx = dgu Wgu^T``, ``dWgu = x^T dgu``,
        ``dbgu = sum dgu``."""
        xs, gu, g, u, sig, glu, h = cache
        lim = self.limit
        g_gu, g_gub = _grad_buffer(self.gate_up_proj), _grad_buffer(self.gate_up_proj_bias)
        g_d, g_db = _grad_buffer(self.down_proj), _grad_buffer(self.down_proj_bias)
        dh = np.empty_like(h)
        for e, rows in self._experts(bounds):
            np.matmul(dhs[rows], self.down_proj.data[e].T, out=dh[rows])
            g_d[e] += h[rows].T @ dhs[rows]
            g_db[e] += dhs[rows].sum(0)
        gate, up = gu[:, ::2], gu[:, 1::2]
        dgu = np.empty_like(gu)
        dgu[:, ::2] = dh * (u + 1.0) * sig * (1.0 + self.alpha * g * (1.0 - sig)) * (gate <= lim)
        dgu[:, 1::2] = dh * glu * ((up >= -lim) & (up <= lim))
        dxs = np.empty_like(xs)
        for e, rows in self._experts(bounds):
            g_gu[e] += xs[rows].T @ dgu[rows]
            g_gub[e] += dgu[rows].sum(0)
            np.matmul(dgu[rows], self.gate_up_proj.data[e].T, out=dxs[rows])
        return dxs

    def _mlp_jvp(self, txs, cache, bounds, param_tangents):
        """``tgu = tx Wgu + x tWgu + tbgu``; the clamps pass the tangent inside their limits;
        ``tglu = tg s (1 + alpha g (1 - s))``; ``th = tu glu + (u + 1) tglu``;
        ``to = th Wd + h tWd + tbd``."""
        xs, gu, g, u, sig, glu, h = cache
        lim = self.limit
        t_gu, t_gub = param_tangents.get(self.gate_up_proj), param_tangents.get(self.gate_up_proj_bias)
        t_d, t_db = param_tangents.get(self.down_proj), param_tangents.get(self.down_proj_bias)
        tgu = np.zeros_like(gu)
        for e, rows in self._experts(bounds):
            if txs is not None:
                tgu[rows] += txs[rows] @ self.gate_up_proj.data[e]
            if t_gu is not None:
                tgu[rows] += xs[rows] @ t_gu[e]
            if t_gub is not None:
                tgu[rows] += t_gub[e]
        gate, up = gu[:, ::2], gu[:, 1::2]
        tg = tgu[:, ::2] * (gate <= lim)
        tu = tgu[:, 1::2] * ((up >= -lim) & (up <= lim))
        th = tu * glu + (u + 1.0) * tg * sig * (1.0 + self.alpha * g * (1.0 - sig))
        to = np.empty_like(xs)
        for e, rows in self._experts(bounds):
            np.matmul(th[rows], self.down_proj.data[e], out=to[rows])
            if t_d is not None:
                to[rows] += h[rows] @ t_d[e]
            if t_db is not None:
                to[rows] += t_db[e]
        return to

    def extra_repr(self):
        return super().extra_repr() + f", alpha={self.alpha}, limit={self.limit}"


class GatedMLP(Module):
    """The dense gated MLP ``down_proj(act(gate_proj(x)) * up_proj(x))`` [``gate_proj.weight (I, H)``,
    ``up_proj.weight (I, H)``, ``down_proj.weight (H, I)``, no biases], as Hugging Face's
    ``LlamaMLP`` / ``DeepseekV3MLP`` / ``Qwen3NextMLP`` (the shared experts of an MoE block).

    Parameters
    ----------
    hidden_size, intermediate_size : int
        ``H`` and ``I``.
    hidden_act : str
        One of ``HIDDEN_ACTS``.
    bias : bool
        Biases on the three projections (``False`` in those models).
    rng, dtype
        As every module.

    Raises
    ------
    TypeError, ValueError
        For a bad argument, naming it.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str = "silu",
        *,
        bias: bool = False,
        rng=None,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        self.hidden_size = check_size(hidden_size, "hidden_size")
        self.intermediate_size = check_size(intermediate_size, "intermediate_size")
        self.hidden_act = hidden_act
        self._act = _check_hidden_act(hidden_act)
        bias = check_bool(bias, "bias")
        self._dtype = check_dtype(dtype)
        rng = as_rng(rng)
        h, i = self.hidden_size, self.intermediate_size
        self.gate_proj = Linear(h, i, bias, rng=rng, dtype=dtype)
        self.up_proj = Linear(h, i, bias, rng=rng, dtype=dtype)
        self.down_proj = Linear(i, h, bias, rng=rng, dtype=dtype)

    def forward(self, x) -> np.ndarray:
        """``down_proj(act(gate_proj(x)) * up_proj(x))`` of ``x (..., H)``, shape ``(..., H)``.

        Raises
        ------
        TypeError, ValueError
            For an ``x`` that is not a real array of shape ``(..., H)``.
        """
        x = as_float(x, "x", self.dtype)
        _check_features(x, "x", self.hidden_size, f"GatedMLP({self.hidden_size}, {self.intermediate_size})")
        return self._forward(x)

    def _forward(self, x: np.ndarray) -> np.ndarray:
        act, _, kwargs = _act(self._act)
        a, act_cache = act(self.gate_proj._forward(x), **kwargs)
        b = self.up_proj._forward(x)
        self.save_for_backward((act_cache, a, b))
        return self.down_proj._forward(a * b)

    def backward(self, dy) -> np.ndarray:
        """``dx (..., H)`` from ``dy (..., H)``; the projections' ``.grad`` grow by theirs.

        Raises
        ------
        RuntimeError
            Without a forward state.
        TypeError, ValueError
            For a ``dy`` of another kind or shape.
        """
        return self._backward(self._check_dy(dy))

    def _backward(self, dy: np.ndarray) -> np.ndarray:
        """``h = a b`` with ``a = act(gate_proj x)``, ``b = up_proj x``: ``da = dh b``, ``db = dh a``,
        and ``dx`` sums the two projections' input gradients."""
        act_cache, a, b = self.pop_saved()
        dh = self.down_proj._backward(dy)
        dx = self.up_proj._backward(dh * a)
        dx += self.gate_proj._backward(_act(self._act)[1](dh * b, act_cache))
        return dx

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: ``th = act'(g) tg b + a tb`` with the projections' tangents ``tg``, ``tb``
        (each child's latest state is this call's), then ``down_proj``'s."""
        tx = _input_tangent(input_tangents, "GatedMLP")
        act_cache, a, b = state
        if tx is not None:
            tx = check_tangent(tx, "tx", a.shape[:-1] + (self.hidden_size,), a.dtype)
        tg = self._child_jvp(self.gate_proj, -1, (tx,), param_tangents)
        tb = self._child_jvp(self.up_proj, -1, (tx,), param_tangents)
        th = _act(self._act)[1](tg, act_cache) * b + a * tb
        return self._child_jvp(self.down_proj, -1, (th,), param_tangents)

    def extra_repr(self):
        return f"{self.hidden_size}, {self.intermediate_size}, hidden_act={self.hidden_act!r}"


# ------------------------------------------------------------------------------------------- block

_ROUTER_NAMES = ("gate", "router")
_SHARED_NAMES = ("shared_expert", "shared_experts")


class SparseMoeBlock(Module):
    """A sparse mixture-of-experts feed-forward block: a ``TopKRouter``, fused experts, and
    optionally a shared dense expert (every token, added to the routed output), itself optionally
    scaled by a sigmoid gate ``sigmoid(x w_g^T)`` (Qwen3-Next)::

        y = sum_j w_j expert_{i_j}(x) [+ sigmoid(shared_expert_gate(x)) *] shared(x)

    The submodules' names are the Hugging Face state dict's: ``router_name`` (``"gate"``, or
    ``"router"`` for GPT-OSS), ``experts``, ``shared_name`` (``"shared_expert"`` for Qwen3-Next,
    ``"shared_experts"`` for DeepSeek-V3) and ``shared_expert_gate`` [``weight (1, H)``].  The
    submodules: ``router_module``, ``experts``, ``shared_module``, ``shared_gate_module`` (None when
    absent).  ``tokens_per_expert`` is the last forward's ``(E,)`` count.

    ``forward(x (..., H)) -> y (..., H)``; ``backward(dy) -> dx``: through the chosen experts and
    the chosen weights into the router (never through the choice itself) and through the shared
    expert and its gate.

    Parameters
    ----------
    hidden_size, num_experts, top_k, intermediate_size : int
        ``H``, ``E``, ``k`` and each routed expert's ``I``.
    router : str
        The router's variant, one of ``ROUTER_VARIANTS``.
    norm_topk_prob, router_bias, routed_scaling_factor, n_group, topk_group
        As ``TopKRouter`` (``router_bias`` is its ``bias``).
    experts : str
        ``"swiglu"`` (``Experts``) or ``"gpt_oss"`` (``GptOssExperts``).
    hidden_act : str
        The activation of ``Experts`` and of the shared expert (one of ``HIDDEN_ACTS``).
    swiglu_alpha, swiglu_limit : float
        ``GptOssExperts``' ``alpha`` and ``limit``.
    shared_intermediate_size : int or None
        The shared expert's width (DeepSeek-V3: ``moe_intermediate_size * n_shared_experts``); None:
        no shared expert.
    shared_expert_gate : bool
        The sigmoid gate on the shared expert (needs one).
    router_name, shared_name : str
        The state-dict names, see above.
    experts_first : bool
        List ``experts`` before the router in ``state_dict()`` / ``named_parameters()``, in the
        order of transformers' ``DeepseekV3MoE`` and ``Qwen3MoeSparseMoeBlock``.
    rng, dtype
        As every module.

    Raises
    ------
    TypeError, ValueError
        For a bad argument, naming it.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        *,
        router: str = "softmax_topk",
        norm_topk_prob: bool = False,
        router_bias: bool = False,
        routed_scaling_factor: float = 1.0,
        n_group: int = 1,
        topk_group: int = 1,
        experts: str = "swiglu",
        hidden_act: str = "silu",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        shared_intermediate_size: Optional[int] = None,
        shared_expert_gate: bool = False,
        router_name: str = "gate",
        shared_name: str = "shared_expert",
        experts_first: bool = False,
        rng=None,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        if not isinstance(experts, str) or experts not in ("swiglu", "gpt_oss"):
            raise ValueError(f"experts: expected 'swiglu' or 'gpt_oss', got {experts!r}")
        if router_name not in _ROUTER_NAMES:
            raise ValueError(f"router_name: expected one of {_ROUTER_NAMES}, got {router_name!r}")
        if shared_name not in _SHARED_NAMES:
            raise ValueError(f"shared_name: expected one of {_SHARED_NAMES}, got {shared_name!r}")
        gated = check_bool(shared_expert_gate, "shared_expert_gate")
        experts_first = check_bool(experts_first, "experts_first")
        if shared_intermediate_size is not None:
            shared_intermediate_size = check_size(shared_intermediate_size, "shared_intermediate_size")
        elif gated:
            raise ValueError(
                "shared_expert_gate: expected False without a shared expert (shared_intermediate_size=None), got True"
            )
        self._dtype = check_dtype(dtype)
        rng = as_rng(rng)
        self.hidden_size = check_size(hidden_size, "hidden_size")
        self._router_name, self._shared_name = router_name, shared_name
        route = TopKRouter(
            hidden_size,
            num_experts,
            top_k,
            variant=router,
            norm_topk_prob=norm_topk_prob,
            bias=router_bias,
            routed_scaling_factor=routed_scaling_factor,
            n_group=n_group,
            topk_group=topk_group,
            rng=rng,
            dtype=dtype,
        )
        setattr(self, router_name, route)
        if experts == "gpt_oss":
            self.experts: _SortedExperts = GptOssExperts(
                num_experts,
                hidden_size,
                intermediate_size,
                alpha=swiglu_alpha,
                limit=swiglu_limit,
                rng=rng,
                dtype=dtype,
            )
        else:
            self.experts = Experts(
                num_experts, hidden_size, intermediate_size, hidden_act=hidden_act, rng=rng, dtype=dtype
            )
        if shared_intermediate_size is not None:
            setattr(
                self, shared_name, GatedMLP(hidden_size, shared_intermediate_size, hidden_act, rng=rng, dtype=dtype)
            )
            if gated:
                self.shared_expert_gate = Linear(hidden_size, 1, False, rng=rng, dtype=dtype)
        if experts_first:  # experts, router, then the shared expert and its gate (transformers' order)
            for name in (router_name, shared_name, "shared_expert_gate"):
                if name in self._modules:
                    self._modules.move_to_end(name)

    # -- the submodules under their state-dict names -------------------------------------------
    @property
    def router_module(self) -> TopKRouter:
        """The ``TopKRouter`` (``self.gate`` or ``self.router``)."""
        return self._modules[self._router_name]  # type: ignore[return-value]

    @property
    def shared_module(self) -> Optional[GatedMLP]:
        """The shared expert (``self.shared_expert`` / ``self.shared_experts``), or None."""
        return self._modules.get(self._shared_name)  # type: ignore[return-value]

    @property
    def shared_gate_module(self) -> Optional[Linear]:
        """The shared expert's gate projection ``Linear(H, 1)``, or None."""
        return self._modules.get("shared_expert_gate")  # type: ignore[return-value]

    @property
    def tokens_per_expert(self) -> Optional[np.ndarray]:
        """``(E,)`` how many tokens the last forward sent to each expert (None before one)."""
        return self.router_module.last_counts

    # -- forward / backward ---------------------------------------------------------------------
    def forward(self, x) -> np.ndarray:
        """The block's output for ``x (..., H)``, shape ``(..., H)``; the router's statistics
        (``tokens_per_expert``, ``router_module.last_indices`` / ``last_logits``) are this call's.

        Raises
        ------
        TypeError, ValueError
            For an ``x`` that is not a real array of shape ``(..., H)``.
        """
        x = as_float(x, "x", self.dtype)
        _check_features(x, "x", self.hidden_size, f"SparseMoeBlock(hidden_size={self.hidden_size})")
        y = self._forward(x.reshape(-1, self.hidden_size), x.shape[:-1]).reshape(x.shape)
        self.router_module._shape_stats(x.shape[:-1])
        return y

    def _forward(self, x: np.ndarray, lead: Optional[tuple] = None) -> np.ndarray:
        """``x (N, H)`` checked -> ``y (N, H)``; ``lead``: the public input's leading axes."""
        w, idx = self.router_module._forward(x)
        y = self.experts._forward(x, idx, w)
        shared, gate = self.shared_module, self.shared_gate_module
        g = s = None
        if shared is not None:
            s = shared._forward(x)
            if gate is not None:
                g = _sigmoid(gate._forward(x))  # (N, 1)
                y += g * s
            else:
                y += s
        self.save_for_backward((g, s, x.shape[:1] if lead is None else lead))
        return y

    def backward(self, dy) -> np.ndarray:
        """``dx (..., H)`` from ``dy (..., H)``; every parameter's ``.grad`` grows by its own
        (through the chosen experts and weights, never through the choice).

        Raises
        ------
        RuntimeError
            Without a forward state.
        TypeError, ValueError
            For a ``dy`` of another kind or shape.
        """
        dy = self._check_dy(dy)
        return self._backward(dy.reshape(-1, self.hidden_size)).reshape(dy.shape)

    def _backward(self, dy: np.ndarray) -> np.ndarray:
        """The routed part: the experts give ``dx`` and ``dw``, the router turns ``dw`` into its
        own ``dx``.  The shared part, ``y += g s`` with ``g = sigmoid(x w_g^T)``: ``ds = g dy``,
        ``d(x w_g^T) = <dy, s> g (1 - g)``."""
        g, s, _ = self.pop_saved()
        dx, dw = self.experts._backward(dy)
        dx += self.router_module._backward(dw)
        shared, gate = self.shared_module, self.shared_gate_module
        if shared is not None:
            if gate is not None:
                dx += gate._backward(np.einsum("nh,nh->n", dy, s)[:, None] * g * (1.0 - g))
                dx += shared._backward(dy * g)
            else:
                dx += shared._backward(dy)
        return dx

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: the router's weight tangent (the choice is constant), the experts'
        ``sum_j (tw_j h_j + w_j th_j)``, and the shared part ``tg s + g ts`` with
        ``tg = g (1 - g) t(x w_g^T)``.  Each child's latest state is this call's."""
        tx = _input_tangent(input_tangents, "SparseMoeBlock")
        g, s, lead = state
        router, experts = self.router_module, self.experts
        xr = router.saved_state().x
        if tx is not None:
            tx = check_tangent(tx, "tx", lead + (self.hidden_size,), xr.dtype).reshape(xr.shape)
        tw = router._jvp_flat(router.saved_state(), tx, param_tangents)
        ty = experts._jvp_flat(experts.saved_state(), tx, tw, param_tangents)
        shared, gate = self.shared_module, self.shared_gate_module
        if shared is not None:
            ts = self._child_jvp(shared, -1, (tx,), param_tangents)
            if gate is not None:
                tgz = self._child_jvp(gate, -1, (tx,), param_tangents)
                ty += g * ts + g * (1.0 - g) * tgz * s
            else:
                ty += ts
        return ty.reshape(lead + (self.hidden_size,))

    # -- from a Hugging Face config ------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config, *, rng=None, dtype=np.float64) -> "SparseMoeBlock":
        """The MoE block of a decoder layer of a Hugging Face model, from its config.

        ``config``: a mapping (``PretrainedConfig.to_dict()``) or a config object, with
        ``model_type`` one of ``"gpt_oss"``, ``"deepseek_v3"``, ``"qwen3_next"``, ``"qwen3_moe"``,
        ``"mixtral"``.  Fields read:

        * gpt_oss: ``hidden_size``, ``num_local_experts``, ``num_experts_per_tok``,
          ``intermediate_size``, ``swiglu_alpha`` (1.702), ``swiglu_limit`` (7.0) -> variant
          ``"topk_softmax"`` with a router bias, ``GptOssExperts``, keys ``router.*``, ``experts.*``;
        * deepseek_v3: ``hidden_size``, ``n_routed_experts`` (or ``num_local_experts``),
          ``num_experts_per_tok``, ``moe_intermediate_size``, ``n_shared_experts``, ``norm_topk_prob``,
          ``routed_scaling_factor``, ``n_group``, ``topk_group``, ``hidden_act`` -> variant
          ``"sigmoid"``, keys ``gate.weight``, ``gate.e_score_correction_bias``, ``experts.*``,
          ``shared_experts.{gate,up,down}_proj.weight``;
        * qwen3_next: ``hidden_size``, ``num_experts``, ``num_experts_per_tok``,
          ``moe_intermediate_size``, ``shared_expert_intermediate_size``, ``norm_topk_prob``,
          ``hidden_act`` -> variant ``"softmax_topk"``, keys ``gate.weight``, ``experts.*``,
          ``shared_expert.*``, ``shared_expert_gate.weight``;
        * qwen3_moe: ``hidden_size``, ``num_experts`` (or ``num_local_experts``), ``num_experts_per_tok``,
          ``moe_intermediate_size``, ``norm_topk_prob``, ``hidden_act`` -> ``"softmax_topk"``, keys
          ``experts.*``, ``gate.weight``;
        * mixtral: ``hidden_size``, ``num_local_experts``, ``num_experts_per_tok``, ``intermediate_size``,
          ``hidden_act`` -> ``"softmax_topk"`` renormalised, keys ``gate.weight``, ``experts.*``
          (``router_jitter_noise``, a training-time input noise, must be 0).

        Raises
        ------
        TypeError
            ``config`` is not a mapping or a config object.
        ValueError
            An unsupported ``model_type``, a missing field (named) or a bad value (named).
        """
        if hasattr(config, "to_dict") and not isinstance(config, Mapping):
            config = config.to_dict()
        if not isinstance(config, Mapping):
            raise TypeError(f"config: expected a mapping (a config's to_dict()), got {type(config).__name__}")
        model_type = config.get("model_type")

        def get(*names, default=KeyError):
            for name in names:
                if config.get(name) is not None:
                    return config[name]
            if default is KeyError:
                raise ValueError(f"config: model_type {model_type!r} needs {' or '.join(map(repr, names))}, missing")
            return default

        kw: dict = dict(rng=rng, dtype=dtype)
        if model_type == "gpt_oss":
            args = (
                get("hidden_size"),
                get("num_local_experts", "num_experts"),
                get("num_experts_per_tok"),
                get("intermediate_size"),
            )
            kw.update(
                router="topk_softmax",
                router_bias=True,
                experts="gpt_oss",
                swiglu_alpha=get("swiglu_alpha", default=1.702),
                swiglu_limit=get("swiglu_limit", default=7.0),
                router_name="router",
            )
        elif model_type == "deepseek_v3":
            inter = get("moe_intermediate_size")
            n_shared = get("n_shared_experts", default=0)
            args = (get("hidden_size"), get("n_routed_experts", "num_local_experts"), get("num_experts_per_tok"), inter)
            kw.update(
                router="sigmoid",
                norm_topk_prob=get("norm_topk_prob", default=True),
                routed_scaling_factor=get("routed_scaling_factor", default=1.0),
                n_group=get("n_group", default=1),
                topk_group=get("topk_group", default=1),
                hidden_act=get("hidden_act", default="silu"),
                shared_intermediate_size=inter * check_size(n_shared, "n_shared_experts") if n_shared else None,
                shared_name="shared_experts",
                experts_first=True,
            )
        elif model_type == "qwen3_next":
            args = (get("hidden_size"), get("num_experts"), get("num_experts_per_tok"), get("moe_intermediate_size"))
            kw.update(
                router="softmax_topk",
                norm_topk_prob=get("norm_topk_prob", default=True),
                hidden_act=get("hidden_act", default="silu"),
                shared_intermediate_size=get("shared_expert_intermediate_size") or None,  # 0: none
                shared_expert_gate=bool(get("shared_expert_intermediate_size")),
            )
        elif model_type == "qwen3_moe":
            experts = get("num_experts", "num_local_experts")
            args = (get("hidden_size"), experts, get("num_experts_per_tok"), get("moe_intermediate_size"))
            kw.update(
                norm_topk_prob=get("norm_topk_prob", default=False),
                hidden_act=get("hidden_act", default="silu"),
                experts_first=True,
            )
        elif model_type == "mixtral":
            jitter = get("router_jitter_noise", default=0.0)
            if jitter:
                raise ValueError(f"config: router_jitter_noise expected 0 (not supported), got {jitter!r}")
            experts = get("num_local_experts", "num_experts")
            args = (get("hidden_size"), experts, get("num_experts_per_tok"), get("intermediate_size"))
            kw.update(norm_topk_prob=True, hidden_act=get("hidden_act", default="silu"))
        else:
            raise ValueError(
                "config: model_type expected one of 'gpt_oss', 'deepseek_v3', 'qwen3_next', 'qwen3_moe', 'mixtral', "
                f"got {model_type!r}"
            )
        return cls(*args, **kw)

    def extra_repr(self):
        return f"hidden_size={self.hidden_size}"


MoE = SparseMoeBlock
