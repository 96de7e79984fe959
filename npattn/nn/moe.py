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
* ``PlainExperts``: experts that are not gated, ``up_proj (E, I, H)`` and ``down_proj (E, H, I)``:
  ``down(act(up))`` (Nemotron 3's ``NemotronHExperts``, its activation relu2).
* ``GatedMLP``: the dense ``down_proj(act(gate_proj(x)) * up_proj(x))`` of the shared experts.
* ``SparseMoeBlock`` (alias ``MoE``): router + experts + optional shared expert(s) and sigmoid
  shared-expert gate; ``SparseMoeBlock.from_hf_config(config)`` builds it from a model's config.

The routing and the dispatch are the functional pairs ``npattn.functional.topk_router`` and
``npattn.functional.moe_experts`` (their textbook twins, one token at a time with the
derivations, are in ``npattn.functional.reference``): the modules here hold the parameters, call
those pairs' kernels and add the gradients into ``.grad``.  Dispatch sorts the ``(token, slot)``
pairs by expert, so each expert runs once on a contiguous slice (no dense all-experts compute).
No gradient flows through *which* experts were chosen (the choice is piecewise constant in the
logits), only through the chosen weights and the chosen experts; DeepSeek-V3's
``e_score_correction_bias`` enters only the choice, so it gets no gradient (it is a buffer,
updated by a load-balancing rule outside backprop).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np

from .._docs import shared_doc
from .._validate import (
    as_float,
    as_rng,
    check_bool,
    check_dtype,
    check_positive_float,
    check_size,
    check_tangent,
)
from ..functional import kernels as K
from ..functional.moe import (
    ROUTER_VARIANTS,
    MoeExpertsCache,
    TopKRouterCache,
    check_norm_topk_eps,
    check_real,
    check_router_options,
    check_routing,
    experts_tangents,
    sigmoid,
    topk_router_backward_jvp,
)
from .layers import (
    FeedForward,
    Linear,
    check_features,
    gated_unit,
    gated_unit_backward,
    gated_unit_backward_jvp,
    gated_unit_jvp,
    gated_unit_tangents,
    input_tangent,
)
from .module import Module, Parameter

#: The entries under ``Raises`` of the modules' constructors.
_INIT_RAISES = """
    TypeError, ValueError
        For a bad argument, naming it.
    """

#: The entries under ``Raises`` of the modules' ``forward(x)``.
_FORWARD_RAISES = """
    TypeError, ValueError
        For an ``x`` that is not a real array of shape ``(..., H)``.
    """

#: The entries under ``Raises`` of the modules' ``backward(dy)``.
_BACKWARD_RAISES = """
    RuntimeError
        Without a forward state.
    TypeError, ValueError
        For a ``dy`` of another kind or shape.
    """

__all__ = [
    "ROUTER_VARIANTS",
    "HIDDEN_ACTS",
    "PARAMETRIZED_ACTS",
    "TopKRouter",
    "Experts",
    "GptOssExperts",
    "PlainExperts",
    "GatedMLP",
    "SparseMoeBlock",
    "MoE",
]

# Hugging Face ``hidden_act`` names -> npattn's activation kernels (``layers._act``)
HIDDEN_ACTS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",  # FastGELUActivation: gelu_new's formula with sqrt(2/pi) written 0.7978845608
    "relu": "relu",
    "relu2": "relu2",
    "xielu": "xielu",  # trained parameters of its own: only the plain MLP (FeedForward's act_fn) applies it
}
# the activations with trained parameters, which no gated MLP, expert or per-layer input applies
PARAMETRIZED_ACTS = frozenset({"xielu"})


def _check_hidden_act(hidden_act) -> str:
    """The kernel name of a gated MLP's or an expert's ``hidden_act`` (one without parameters)."""
    known = sorted(set(HIDDEN_ACTS) - PARAMETRIZED_ACTS)
    if not isinstance(hidden_act, str) or hidden_act not in known:
        raise ValueError(f"hidden_act: expected one of {known}, got {hidden_act!r}")
    return HIDDEN_ACTS[hidden_act]


# ------------------------------------------------------------------------------------------ router


class RouterCache(NamedTuple):
    linear: tuple  # the logits' linear cache (x (N, H) is its first entry)
    route: TopKRouterCache  # topk_router's cache
    lead: tuple  # the leading axes of the public input (N = their product)


@shared_doc(init_raises=_INIT_RAISES)
class TopKRouter(Module):
    """Chooses ``top_k`` of ``num_experts`` experts per token and weighs them.

    With logits ``z = x W^T (+ b)`` (``W (E, H)``), per token:

    * ``"softmax_topk"``: ``p = softmax(z)``; the chosen are the top-k of ``p``; ``w = p_chosen``,
      divided by its sum when ``norm_topk_prob`` (Qwen3-Next, Qwen3-MoE, Mixtral);
    * ``"topk_softmax"``: the chosen are the top-k of ``z``; ``w = softmax(z_chosen)`` (GPT-OSS,
      with ``bias=True``);
    * ``"sigmoid"``: ``s = sigmoid(z)``; the chosen are the top-k of ``s + e_score_correction_bias``
      (the buffer: used for the choice only; none when ``correction_bias`` is false); ``w =
      s_chosen``, divided by ``sum + 1e-20`` (``norm_topk_eps`` where given: LFM2-MoE's 1e-6)
      when ``norm_topk_prob`` (DeepSeek-V3, LFM2-MoE).

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
    norm_topk_eps : float, optional
        The renormalisation's ``eps``, ``w / (sum w + eps)``: None for the variant's own (1e-20
        with ``"sigmoid"``, 0 with ``"softmax_topk"``), or a number >= 0 (LFM2-MoE's 1e-6).
    correction_bias : bool
        With ``"sigmoid"``: the ``e_score_correction_bias`` buffer (False: the choice is the top-k
        of ``s`` itself, LFM2-MoE's ``use_expert_bias=False``).
    n_group, topk_group : int
        Group-limited choice; ``n_group`` divides ``E`` with at least 2 experts per group,
        ``topk_group <= n_group`` and ``top_k <= topk_group * E / n_group``.
    rng, dtype
        As every module: ``weight`` and ``bias`` are drawn from U(-1/sqrt(H), 1/sqrt(H)).

    Raises
    ------
    <init_raises>

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> router = npattn.TopKRouter(8, num_experts=4, top_k=2, rng=0)
    >>> weights, indices = router(np.random.default_rng(1).standard_normal((3, 8)))
    >>> weights.shape, indices.shape
    ((3, 2), (3, 2))
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
        norm_topk_eps: Optional[float] = None,
        correction_bias: bool = True,
        rng=None,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        self.hidden_size = check_size(hidden_size, "hidden_size")
        self.num_experts = check_size(num_experts, "num_experts")
        has_bias = check_bool(bias, "bias")
        (
            self.top_k,
            self.variant,
            self.norm_topk_prob,
            self.n_group,
            self.topk_group,
            self.routed_scaling_factor,
        ) = check_router_options(
            self.num_experts, top_k, variant, norm_topk_prob, n_group, topk_group, routed_scaling_factor
        )
        self.norm_topk_eps = check_norm_topk_eps(norm_topk_eps, self.variant)
        self._corrected = check_bool(correction_bias, "correction_bias") and self.variant == "sigmoid"
        self._dtype = check_dtype(dtype)
        rng = as_rng(rng)
        bound = 1.0 / math.sqrt(self.hidden_size)
        self.weight = Parameter(rng.uniform(-bound, bound, (self.num_experts, self.hidden_size)), self._dtype)
        self.bias = Parameter(rng.uniform(-bound, bound, (self.num_experts,)), self._dtype) if has_bias else None
        if self._corrected:
            self.register_buffer("e_score_correction_bias", np.zeros(self.num_experts, self._dtype))
        self.last_counts: Optional[np.ndarray] = None
        self.last_indices: Optional[np.ndarray] = None
        self.last_logits: Optional[np.ndarray] = None

    @shared_doc(forward_raises=_FORWARD_RAISES)
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
        <forward_raises>
        """
        x = as_float(x, "x", self.dtype)
        check_features(x, "x", self.hidden_size, f"TopKRouter({self.hidden_size}, {self.num_experts})")
        w, _ = self._forward(x.reshape(-1, self.hidden_size), x.shape[:-1])
        self._shape_stats(x.shape[:-1])
        return w.reshape(x.shape[:-1] + (self.top_k,)), self.last_indices

    def _shape_stats(self, lead: tuple) -> None:
        """Give ``last_logits`` and ``last_indices`` the leading axes of the input."""
        self.last_logits = self.last_logits.reshape(lead + (self.num_experts,))  # type: ignore[union-attr]
        self.last_indices = self.last_indices.reshape(lead + (self.top_k,))  # type: ignore[union-attr]

    def _forward(self, x: np.ndarray, lead: Optional[tuple] = None):
        """``x (N, H)`` checked -> ``(weights (N, k), indices (N, k))``; ``lead``: the public
        input's leading axes (default ``(N,)``).  The logits ``z = x W^T (+ b)``, then the
        ``topk_router`` pair."""
        z, lin = K.linear(x, self.weight.data, None if self.bias is None else self.bias.data)  # (N, E)
        (w, idx), route = K.topk_router(
            z,
            self.top_k,
            variant=self.variant,
            norm_topk_prob=self.norm_topk_prob,
            correction_bias=self.e_score_correction_bias if self._corrected else None,
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            norm_topk_eps=self.norm_topk_eps,
        )
        self.last_logits = z
        self.last_indices = idx
        self.last_counts = np.bincount(idx.reshape(-1), minlength=self.num_experts)
        self.save_for_backward(RouterCache(lin, route, x.shape[:1] if lead is None else lead))
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
        """``dw (N, k)`` -> ``dx (N, H)``: ``topk_router_backward`` gives ``dz`` (through the chosen
        weights only, see its derivation), then ``z = x W^T + b``: ``dx = dz W``, ``dW = dz^T x``,
        ``db = sum_N dz``."""
        lin, route, _ = self.pop_saved()
        dx, dweight, dbias = K.linear_backward(K.topk_router_backward(dw, route), lin)
        self.accumulate_grad(self.weight, dweight)
        if self.bias is not None:
            self.accumulate_grad(self.bias, dbias)
        return dx

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: the tangent of the weights ``(..., k)`` (the choice is constant)."""
        tx = input_tangent(input_tangents, "TopKRouter")
        x = state.linear.x
        if tx is not None:
            tx = check_tangent(tx, "tx", state.lead + (self.hidden_size,), x.dtype).reshape(x.shape)
        return self._jvp_flat(state, tx, param_tangents).reshape(state.lead + (self.top_k,))

    def _jvp_flat(self, state: RouterCache, tx, param_tangents) -> np.ndarray:
        """``tx (N, H)`` or None -> ``tw (N, k)``: ``tz = tx W^T + x tW^T + tb`` (``linear_jvp``),
        then ``topk_router_jvp``."""
        tz = K.linear_jvp(state.linear, tx, param_tangents.get(self.weight), param_tangents.get(self.bias))
        return K.topk_router_jvp(state.route, tz)

    def _backward_jvp(self, state, dweights, input_tangents, param_tangents, ddweights):
        """Second order (``backward_jvp(dweights, tx, ...)``): ``tz`` as ``_jvp``, then
        ``topk_router_backward_jvp`` (the choice constant) and ``linear_backward_jvp``."""
        tx = input_tangent(input_tangents, "TopKRouter", "backward_jvp")
        x = state.linear.x
        if tx is not None:
            tx = check_tangent(tx, "tx", state.lead + (self.hidden_size,), x.dtype).reshape(x.shape)
        dx, tdx = self._backward_jvp_flat(state, dweights.reshape(-1, self.top_k), tx, param_tangents, ddweights)
        shape = state.lead + (self.hidden_size,)
        return dx.reshape(shape), tdx.reshape(shape)

    def _backward_jvp_flat(self, state: RouterCache, dw, tx, param_tangents, ddw):
        """``dw (N, k)``, ``tx (N, H)`` or None -> ``(dx, tdx)`` of ``(N, H)``; parameters'
        gradients and their tangents accumulated."""
        tW, tb = param_tangents.get(self.weight), param_tangents.get(self.bias)
        tz = K.linear_jvp(state.linear, tx, tW, tb)
        ddw = None if ddw is None else ddw.reshape(dw.shape)
        dz, tdz = topk_router_backward_jvp(dw, state.route, (tz,), ddw)  # the checked pair (no kernel export yet)
        (dx, dW, db), (tdx, tdW, tdb) = K.linear_backward_jvp(dz, state.linear, (tx, tW, tb), tdz)
        self._accumulate_second(((self.weight, dW, tdW), (self.bias, db, tdb)))
        return dx, tdx

    def extra_repr(self):
        """The arguments shown by ``repr(module)``."""
        s = f"{self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, variant={self.variant!r}"
        if self.norm_topk_prob:
            s += ", norm_topk_prob=True"
        if self.n_group > 1:
            s += f", n_group={self.n_group}, topk_group={self.topk_group}"
        if self.routed_scaling_factor != 1.0:
            s += f", routed_scaling_factor={self.routed_scaling_factor}"
        if self.norm_topk_eps is not None:
            s += f", norm_topk_eps={self.norm_topk_eps}"
        if self.variant == "sigmoid" and not self._corrected:
            s += ", correction_bias=False"
        return s


# ----------------------------------------------------------------------------------------- experts


class ExpertsCache(NamedTuple):
    experts: MoeExpertsCache  # moe_experts' cache
    lead: tuple  # the leading axes of the public input (N = their product)


class _SortedExperts(Module):
    """What every fused-experts module shares: the edge checks and the calls to the
    ``moe_experts`` pair (sorting dispatch and the weighted combine).  Subclasses define
    ``_pair_params()`` (their parameters in the pair's order ``gate_up, down, gate_up_bias,
    down_bias``, None for an absent one) and ``_pair_options()`` (the pair's keyword arguments)."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    _dtype: np.dtype

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
        check_features(x, "x", self.hidden_size, f"{type(self).__name__}(hidden_size={self.hidden_size})")
        lead = x.shape[:-1]
        names = ("top_k_index", "top_k_weights")
        idx, w = check_routing(top_k_index, top_k_weights, lead, self.dtype, names, self.num_experts)
        k = idx.shape[-1]
        y = self._forward(x.reshape(-1, self.hidden_size), idx.reshape(-1, k), w.reshape(-1, k), lead)
        return y.reshape(x.shape)

    def _pair_params(self) -> tuple:  # pragma: no cover - abstract
        raise NotImplementedError

    def _pair_options(self) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def _forward(self, x: np.ndarray, idx: np.ndarray, w: np.ndarray, lead: Optional[tuple] = None) -> np.ndarray:
        """``x (N, H)``, ``idx, w (N, k)`` checked -> ``y (N, H)`` (the ``moe_experts`` kernel);
        ``lead``: the public input's leading axes (default ``(N,)``)."""
        params = [None if p is None else p.data for p in self._pair_params()]
        y, cache = K.moe_experts(x, idx, w, *params, **self._pair_options())
        self.save_for_backward(ExpertsCache(cache, x.shape[:1] if lead is None else lead))
        return y

    @shared_doc(backward_raises=_BACKWARD_RAISES)
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
        <backward_raises>
        """
        dy = self._check_dy(dy, "dy")
        k = self.saved_state().experts.k
        dx, dw = self._backward(dy.reshape(-1, self.hidden_size))
        return dx.reshape(dy.shape), dw.reshape(dy.shape[:-1] + (k,))

    def _backward(self, dy: np.ndarray):
        """``dy (N, H)`` -> ``(dx (N, H), dw (N, k))`` by ``moe_experts_backward`` (derived there);
        the experts' weight gradients add into their ``.grad``."""
        cache, _ = self.pop_saved()
        dx, dw, *dparams = K.moe_experts_backward(dy, cache)
        for p, g in zip(self._pair_params(), dparams):
            if p is not None:
                self.accumulate_grad(p, g)
        return dx, dw

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: ``input_tangents`` are ``(tx, None, ttop_k_weights)`` (the indices have
        no tangent); returns ``ty (..., H)``."""
        tx, tw = self._input_tangents(state, input_tangents, "jvp")
        return self._jvp_flat(state, tx, tw, param_tangents).reshape(state.lead + (self.hidden_size,))

    def _input_tangents(self, state: ExpertsCache, input_tangents, method: str):
        """``(tx (N, H), tw (N, k))`` checked from ``(tx, None, ttop_k_weights)`` (the indices have
        no tangent), each None for zero."""
        if len(input_tangents) > 3:
            raise TypeError(
                f"{type(self).__name__}.{method}: expected at most 3 input tangents, got {len(input_tangents)}"
            )
        tx, tidx, tw = tuple(input_tangents) + (None,) * (3 - len(input_tangents))
        if tidx is not None:
            raise TypeError(f"{type(self).__name__}.{method}: top_k_index has no tangent; expected None")
        cache, lead = state
        n, k, dtype = math.prod(lead), cache.k, cache.hs.dtype
        if tx is not None:
            tx = check_tangent(tx, "tx", lead + (self.hidden_size,), dtype).reshape(n, self.hidden_size)
        if tw is not None:
            tw = check_tangent(tw, "ttop_k_weights", lead + (k,), dtype).reshape(n, k)
        return tx, tw

    def _jvp_flat(self, state: ExpertsCache, tx, tw, param_tangents) -> np.ndarray:
        """``ty_n = sum_j (tw_nj h_nj + w_nj th_nj)`` by ``moe_experts_jvp``."""
        tparams = [None if p is None else param_tangents.get(p) for p in self._pair_params()]
        forward = self._expert_tangents(state, tx, tparams, param_tangents)
        return K.moe_experts_jvp(state.experts, tx, tw, *tparams, forward=forward)

    def _expert_tangents(self, state: ExpertsCache, tx, tparams, param_tangents) -> tuple:
        """The experts' forward tangents on the sorted rows (``moe.experts_tangents``), which the
        JVP and the second order both take: computed once per state and ``tx`` while
        ``param_tangents`` remembers (``loss_hvp``)."""
        tgate_up, tdown, tgub, tdb = tparams
        return param_tangents._remember(
            (self, "experts", state, tx),
            lambda: experts_tangents(state.experts, tx, tgate_up, tdown, tgub, tdb),
        )

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: ``backward_jvp(dy, tx, None, ttop_k_weights, ...) -> ((dx, dtop_k_weights),
        their tangents)`` by ``moe_experts_backward_jvp`` (the indices have no tangent)."""
        tx, tw = self._input_tangents(state, input_tangents, "backward_jvp")
        lead, n, k = state.lead, math.prod(state.lead), state.experts.k
        flat = (dy.reshape(n, self.hidden_size), None if ddy is None else ddy.reshape(n, self.hidden_size))
        (dx, dw), (tdx, tdw) = self._backward_jvp_flat(state, flat[0], tx, tw, param_tangents, flat[1])
        shapes = (lead + (self.hidden_size,), lead + (k,))
        return (dx.reshape(shapes[0]), dw.reshape(shapes[1])), (tdx.reshape(shapes[0]), tdw.reshape(shapes[1]))

    def _backward_jvp_flat(self, state: ExpertsCache, dy, tx, tw, param_tangents, ddy):
        """``dy (N, H)`` -> ``((dx, dw), (tdx, tdw))``; the parameters' gradients and their
        tangents accumulated."""
        params = self._pair_params()
        tparams = [None if p is None else param_tangents.get(p) for p in params]
        forward = self._expert_tangents(state, tx, tparams, param_tangents)
        (dx, dw, *dparams), (tdx, tdw, *tdparams) = K.moe_experts_backward_jvp(
            dy, state.experts, (tx, tw, *tparams), ddy, forward=forward
        )
        self._accumulate_second(zip(params, dparams, tdparams))
        return (dx, dw), (tdx, tdw)

    def extra_repr(self):
        """The arguments shown by ``repr(module)``."""
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


@shared_doc(init_raises=_INIT_RAISES)
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
    <init_raises>

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> experts = npattn.Experts(num_experts=4, hidden_size=8, intermediate_size=16, rng=0)
    >>> x = np.random.default_rng(1).standard_normal((3, 8))              # 3 tokens
    >>> indices = np.array([[0, 1], [2, 3], [1, 0]])                       # each token's 2 experts
    >>> y = experts(x, indices, np.full((3, 2), 0.5))
    >>> dx, dweights = experts.backward(np.ones_like(y))
    >>> y.shape, dx.shape, dweights.shape, experts.gate_up_proj.grad.shape
    ((3, 8), (3, 8), (3, 2), (4, 32, 8))
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

    def _pair_params(self) -> tuple:
        return self.gate_up_proj, self.down_proj, None, None

    def _pair_options(self) -> dict:
        return {"kind": "swiglu", "activation": self._act}

    def extra_repr(self):
        """The arguments shown by ``repr(module)``."""
        return super().extra_repr() + f", hidden_act={self.hidden_act!r}"


@shared_doc(init_raises=_INIT_RAISES)
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
    <init_raises>

    Examples
    --------
    >>> import npattn
    >>> experts = npattn.GptOssExperts(num_experts=4, hidden_size=8, intermediate_size=16, rng=0)
    >>> [name for name, _ in experts.named_parameters()]
    ['gate_up_proj', 'gate_up_proj_bias', 'down_proj', 'down_proj_bias']
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
        self.alpha = check_real(alpha, "alpha")
        self.limit = check_positive_float(limit, "limit")
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        self.gate_up_proj = Parameter(rng.uniform(-1, 1, (e, h, 2 * i)) / math.sqrt(h), self._dtype)
        self.gate_up_proj_bias = Parameter(rng.uniform(-1, 1, (e, 2 * i)) / math.sqrt(h), self._dtype)
        self.down_proj = Parameter(rng.uniform(-1, 1, (e, i, h)) / math.sqrt(i), self._dtype)
        self.down_proj_bias = Parameter(rng.uniform(-1, 1, (e, h)) / math.sqrt(i), self._dtype)

    def _pair_params(self) -> tuple:
        return self.gate_up_proj, self.down_proj, self.gate_up_proj_bias, self.down_proj_bias

    def _pair_options(self) -> dict:
        return {"kind": "gpt_oss", "alpha": self.alpha, "limit": self.limit}

    def extra_repr(self):
        """The arguments shown by ``repr(module)``."""
        return super().extra_repr() + f", alpha={self.alpha}, limit={self.limit}"


@shared_doc(init_raises=_INIT_RAISES)
class PlainExperts(_SortedExperts):
    """``E`` experts that are not gated (Nemotron 3's ``NemotronHExperts`` in ``transformers``
    5.x): ``up_proj (E, I, H)`` and ``down_proj (E, H, I)``; expert ``e`` maps ``x -> down_e
    act(up_e x)`` (the ``moe_experts`` pair's ``kind="plain"``).

    ``forward(x (..., H), top_k_index (..., k), top_k_weights (..., k)) -> y (..., H)``;
    ``backward(dy) -> (dx, dtop_k_weights)``.

    Parameters
    ----------
    num_experts, hidden_size, intermediate_size : int
        ``E``, ``H`` and each expert's ``I`` (``moe_intermediate_size``).
    hidden_act : str
        A Hugging Face activation name, one of ``HIDDEN_ACTS`` (``"relu2"`` by default, Nemotron
        3's ``mlp_hidden_act``).
    rng, dtype
        As every module; weights from U(-1/sqrt(fan_in), 1/sqrt(fan_in)).

    Raises
    ------
    <init_raises>

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> experts = npattn.PlainExperts(num_experts=4, hidden_size=8, intermediate_size=16, rng=0)
    >>> x = np.random.default_rng(1).standard_normal((3, 8))
    >>> y = experts(x, np.array([[0, 1], [2, 3], [1, 0]]), np.full((3, 2), 0.5))
    >>> y.shape, [name for name, _ in experts.named_parameters()]
    ((3, 8), ['up_proj', 'down_proj'])
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        hidden_act: str = "relu2",
        rng=None,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        rng = _init_experts(self, num_experts, hidden_size, intermediate_size, dtype, rng)
        self.hidden_act = hidden_act
        self._act = _check_hidden_act(hidden_act)
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        self.up_proj = Parameter(rng.uniform(-1, 1, (e, i, h)) / math.sqrt(h), self._dtype)
        self.down_proj = Parameter(rng.uniform(-1, 1, (e, h, i)) / math.sqrt(i), self._dtype)

    def _pair_params(self) -> tuple:
        return self.up_proj, self.down_proj, None, None

    def _pair_options(self) -> dict:
        return {"kind": "plain", "activation": self._act}

    def extra_repr(self):
        """The arguments shown by ``repr(module)``."""
        return super().extra_repr() + f", hidden_act={self.hidden_act!r}"


@shared_doc(init_raises=_INIT_RAISES)
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
    gate_multiplier, down_multiplier : float
        Factors of ``gate_proj(x)`` before the activation and of ``down_proj``'s output
        (Falcon-H1's ``mlp_multipliers``; 1: none): ``down_multiplier down_proj(act(gate_multiplier
        gate_proj(x)) * up_proj(x))``.
    rng, dtype
        As every module.

    Raises
    ------
    <init_raises>

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> mlp = npattn.GatedMLP(8, 16, rng=0)
    >>> y = mlp(np.ones((2, 8)))
    >>> y.shape, sorted(dict(mlp.named_parameters()))
    ((2, 8), ['down_proj.weight', 'gate_proj.weight', 'up_proj.weight'])
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str = "silu",
        *,
        bias: bool = False,
        gate_multiplier: float = 1.0,
        down_multiplier: float = 1.0,
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
        self.gate_multiplier = check_positive_float(gate_multiplier, "gate_multiplier")
        self.down_multiplier = check_positive_float(down_multiplier, "down_multiplier")
        # the factors in the dtype, None for 1 (the arrays as they are)
        self._gate_scale = None if self.gate_multiplier == 1.0 else self._dtype.type(self.gate_multiplier)
        self._down_scale = None if self.down_multiplier == 1.0 else self._dtype.type(self.down_multiplier)
        rng = as_rng(rng)
        h, i = self.hidden_size, self.intermediate_size
        self.gate_proj = Linear(h, i, bias, rng=rng, dtype=dtype)
        self.up_proj = Linear(h, i, bias, rng=rng, dtype=dtype)
        self.down_proj = Linear(i, h, bias, rng=rng, dtype=dtype)

    @shared_doc(forward_raises=_FORWARD_RAISES)
    def forward(self, x) -> np.ndarray:
        """``down_proj(act(gate_proj(x)) * up_proj(x))`` of ``x (..., H)``, shape ``(..., H)``.

        Raises
        ------
        <forward_raises>
        """
        x = as_float(x, "x", self.dtype)
        check_features(x, "x", self.hidden_size, f"GatedMLP({self.hidden_size}, {self.intermediate_size})")
        return self._forward(x)

    def _forward(self, x: np.ndarray) -> np.ndarray:
        h, state = gated_unit(self._act, self.gate_proj, self.up_proj, x, self, self._gate_scale)
        self.save_for_backward(state)
        y = self.down_proj._forward(h)
        return y if self._down_scale is None else y * self._down_scale

    def _down(self, a):
        """``a`` (a gradient or a tangent of the output) times ``down_multiplier``."""
        return a if self._down_scale is None or a is None else a * self._down_scale

    @shared_doc(backward_raises=_BACKWARD_RAISES)
    def backward(self, dy) -> np.ndarray:
        """``dx (..., H)`` from ``dy (..., H)``; the projections' ``.grad`` grow by theirs.

        Raises
        ------
        <backward_raises>
        """
        return self._backward(self._check_dy(dy))

    def _backward(self, dy: np.ndarray) -> np.ndarray:
        """``down_proj``'s, then the gated unit's (``layers.gated_unit_backward``)."""
        state = self.pop_saved()
        dh = self.down_proj._backward(self._down(dy))
        return gated_unit_backward(self._act, self.gate_proj, self.up_proj, dh, state, self._gate_scale)

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: ``th = act'(g) tg b + a tb`` with the projections' tangents ``tg``, ``tb``
        (each child's latest state is this call's), then ``down_proj``'s."""
        tx = input_tangent(input_tangents, "GatedMLP")
        s = state[1]  # act(gate_proj x)
        if tx is not None:
            tx = check_tangent(tx, "tx", s.shape[:-1] + (self.hidden_size,), s.dtype)
        th = gated_unit_jvp(self, self._act, self.gate_proj, self.up_proj, tx, state, param_tangents, self._gate_scale)
        return self._down(self._child_jvp(self.down_proj, -1, (th,), param_tangents))

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: the gated unit's tangents (``layers.gated_unit_tangents``), ``down_proj``'s
        ``backward_jvp``, then the gated unit's (``layers.gated_unit_backward_jvp``)."""
        tx = input_tangent(input_tangents, "GatedMLP", "backward_jvp")
        s = state[1]
        if tx is not None:
            tx = check_tangent(tx, "tx", s.shape[:-1] + (self.hidden_size,), s.dtype)
        pt = param_tangents
        gs = self._gate_scale
        th, inner = gated_unit_tangents(self, self._act, self.gate_proj, self.up_proj, tx, state, pt, gs)
        dh, tdh = self._child_backward_jvp(self.down_proj, self._down(dy), (th,), pt, self._down(ddy))
        return gated_unit_backward_jvp(self, self._act, self.gate_proj, self.up_proj, dh, tdh, tx, inner, state, pt, gs)

    def extra_repr(self):
        """The arguments shown by ``repr(module)``."""
        out = f"{self.hidden_size}, {self.intermediate_size}, hidden_act={self.hidden_act!r}"
        if self.gate_multiplier != 1.0 or self.down_multiplier != 1.0:
            out += f", gate_multiplier={self.gate_multiplier!r}, down_multiplier={self.down_multiplier!r}"
        return out


# ------------------------------------------------------------------------------------------- block

_ROUTER_NAMES = ("gate", "router")
_SHARED_NAMES = ("shared_expert", "shared_experts")


def _check_layout(experts, router_name, shared_name, shared_intermediate_size, shared_expert_gate, experts_first):
    """``SparseMoeBlock``'s choice of submodules and their names, checked before anything is built:
    returns ``(shared_intermediate_size, shared_expert_gate, experts_first)``."""
    if not isinstance(experts, str) or experts not in ("swiglu", "gpt_oss", "plain"):
        raise ValueError(f"experts: expected 'swiglu', 'gpt_oss' or 'plain', got {experts!r}")
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
    return shared_intermediate_size, gated, experts_first


def _routed_experts(kind, num_experts, width, intermediate_size, hidden_act, alpha, limit, kw) -> _SortedExperts:
    """``SparseMoeBlock``'s routed experts of ``kind`` (``_check_layout``'s), ``width`` wide (the
    hidden size, or the latent one): SwiGLU, GPT-OSS's clamped SwiGLU or not gated."""
    if kind == "plain":
        return PlainExperts(num_experts, width, intermediate_size, hidden_act=hidden_act, **kw)
    if kind == "gpt_oss":
        return GptOssExperts(num_experts, width, intermediate_size, alpha=alpha, limit=limit, **kw)
    return Experts(num_experts, width, intermediate_size, hidden_act=hidden_act, **kw)


def _shared_expert(kind, hidden_size, size, hidden_act, bias, kw) -> Module:
    """The shared expert beside routed experts of ``kind``: gated (``GatedMLP``), or beside plain
    experts not gated either, ``down(act(up(x)))`` (``FeedForward``: Nemotron 3's NemotronHMLP)."""
    if kind == "plain":
        return FeedForward(hidden_size, size, activation=_check_hidden_act(hidden_act), bias=bias, **kw)
    return GatedMLP(hidden_size, size, hidden_act, bias=bias, **kw)


@shared_doc(init_raises=_INIT_RAISES)
class SparseMoeBlock(Module):
    """A sparse mixture-of-experts feed-forward block: a ``TopKRouter``, fused experts, and
    optionally a shared dense expert (every token, added to the routed output), itself optionally
    scaled by a sigmoid gate ``sigmoid(x w_g^T)`` (Qwen3-Next)::

        y = sum_j w_j expert_{i_j}(x) [+ sigmoid(shared_expert_gate(x)) *] shared(x)

    With ``latent_size`` (Nemotron 3's ``moe_latent_size``) the routed experts work in a narrower
    width ``L``: ``fc2_latent_proj(sum_j w_j expert_{i_j}(fc1_latent_proj(x)))``, the router and
    the shared expert on ``x`` itself.

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
    norm_topk_prob, router_bias, routed_scaling_factor, n_group, topk_group, norm_topk_eps, correction_bias
        As ``TopKRouter`` (``router_bias`` is its ``bias``).
    experts : str
        ``"swiglu"`` (``Experts``), ``"gpt_oss"`` (``GptOssExperts``) or ``"plain"``
        (``PlainExperts``, not gated; its shared expert is not gated either: a ``FeedForward``
        ``linear2(act(linear1(x)))``, which a model's layer shows as ``up_proj``, ``down_proj``).
    hidden_act : str
        The activation of ``Experts`` / ``PlainExperts`` and of the shared expert (one of ``HIDDEN_ACTS``).
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
    shared_bias : bool
        Biases on the shared expert's projections (Nemotron 3's ``mlp_bias``).
    latent_size : int or None
        The routed experts' width ``L`` between ``fc1_latent_proj (L, H)`` and ``fc2_latent_proj
        (H, L)`` (None: none, the experts on ``x``).
    latent_bias : bool
        Biases on the two latent projections (Nemotron 3's ``mlp_bias``).
    rng, dtype
        As every module.

    Raises
    ------
    <init_raises>

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> moe = npattn.SparseMoeBlock(8, num_experts=4, top_k=2, intermediate_size=16, rng=0)
    >>> x = np.random.default_rng(1).standard_normal((2, 3, 8))
    >>> y = moe(x)
    >>> y.shape, [name for name, _ in moe.named_parameters()]
    ((2, 3, 8), ['gate.weight', 'experts.gate_up_proj', 'experts.down_proj'])
    >>> moe.backward(np.ones_like(y)).shape
    (2, 3, 8)
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
        norm_topk_eps: Optional[float] = None,
        correction_bias: bool = True,
        experts: str = "swiglu",
        hidden_act: str = "silu",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        shared_intermediate_size: Optional[int] = None,
        shared_expert_gate: bool = False,
        router_name: str = "gate",
        shared_name: str = "shared_expert",
        experts_first: bool = False,
        shared_bias: bool = False,
        latent_size: Optional[int] = None,
        latent_bias: bool = False,
        rng=None,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        latent_bias = check_bool(latent_bias, "latent_bias")
        shared_bias = check_bool(shared_bias, "shared_bias")
        if latent_size is not None:
            latent_size = check_size(latent_size, "latent_size")
        shared_intermediate_size, gated, experts_first = _check_layout(
            experts, router_name, shared_name, shared_intermediate_size, shared_expert_gate, experts_first
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
            norm_topk_eps=norm_topk_eps,
            correction_bias=correction_bias,
            rng=rng,
            dtype=dtype,
        )
        setattr(self, router_name, route)
        width = hidden_size if latent_size is None else latent_size  # the routed experts'
        kw = {"rng": rng, "dtype": dtype}
        self.experts = _routed_experts(
            experts, num_experts, width, intermediate_size, hidden_act, swiglu_alpha, swiglu_limit, kw
        )
        self.latent_size = latent_size
        if latent_size is not None:
            self.fc1_latent_proj = Linear(hidden_size, latent_size, latent_bias, rng=rng, dtype=dtype)
            self.fc2_latent_proj = Linear(latent_size, hidden_size, latent_bias, rng=rng, dtype=dtype)
        if shared_intermediate_size is not None:
            setattr(
                self,
                shared_name,
                _shared_expert(experts, hidden_size, shared_intermediate_size, hidden_act, shared_bias, kw),
            )
            if gated:
                self.shared_expert_gate = Linear(hidden_size, 1, False, rng=rng, dtype=dtype)
        if experts_first:  # experts, router, the shared expert and its gate, the latent projections (transformers')
            for name in (router_name, shared_name, "shared_expert_gate", "fc1_latent_proj", "fc2_latent_proj"):
                if name in self._modules:
                    self._modules.move_to_end(name)

    # -- the submodules under their state-dict names -------------------------------------------
    @property
    def router_module(self) -> TopKRouter:
        """The ``TopKRouter`` (``self.gate`` or ``self.router``)."""
        return self._modules[self._router_name]  # type: ignore[return-value]

    @property
    def shared_module(self) -> Optional[GatedMLP | FeedForward]:
        """The shared expert (``self.shared_expert`` / ``self.shared_experts``: a ``GatedMLP``, or
        a ``FeedForward`` beside ``PlainExperts``), or None."""
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
    @shared_doc(forward_raises=_FORWARD_RAISES)
    def forward(self, x) -> np.ndarray:
        """The block's output for ``x (..., H)``, shape ``(..., H)``; the router's statistics
        (``tokens_per_expert``, ``router_module.last_indices`` / ``last_logits``) are this call's.

        Raises
        ------
        <forward_raises>
        """
        x = as_float(x, "x", self.dtype)
        check_features(x, "x", self.hidden_size, f"SparseMoeBlock(hidden_size={self.hidden_size})")
        y = self._forward(x.reshape(-1, self.hidden_size), x.shape[:-1]).reshape(x.shape)
        self.router_module._shape_stats(x.shape[:-1])
        return y

    def _forward(self, x: np.ndarray, lead: Optional[tuple] = None) -> np.ndarray:
        """``x (N, H)`` checked -> ``y (N, H)``; ``lead``: the public input's leading axes."""
        w, idx = self.router_module._forward(x)
        if self.latent_size is None:
            y = self.experts._forward(x, idx, w)
        else:  # the experts in the latent width
            y = self.fc2_latent_proj._forward(self.experts._forward(self.fc1_latent_proj._forward(x), idx, w))
        shared, gate = self.shared_module, self.shared_gate_module
        g = s = None
        if shared is not None:
            s = shared._forward(x)
            if gate is not None:
                g = sigmoid(gate._forward(x))  # (N, 1)
                y += g * s
            else:
                y += s
        self.save_for_backward((g, s, x.shape[:1] if lead is None else lead))
        return y

    @shared_doc(backward_raises=_BACKWARD_RAISES)
    def backward(self, dy) -> np.ndarray:
        """``dx (..., H)`` from ``dy (..., H)``; every parameter's ``.grad`` grows by its own
        (through the chosen experts and weights, never through the choice).

        Raises
        ------
        <backward_raises>
        """
        dy = self._check_dy(dy)
        return self._backward(dy.reshape(-1, self.hidden_size)).reshape(dy.shape)

    def _backward(self, dy: np.ndarray) -> np.ndarray:
        """The routed part: the experts give ``dx`` and ``dw``, the router turns ``dw`` into its
        own ``dx``.  The shared part, ``y += g s`` with ``g = sigmoid(x w_g^T)``: ``ds = g dy``,
        ``d(x w_g^T) = <dy, s> g (1 - g)``."""
        g, s, _ = self.pop_saved()
        if self.latent_size is None:
            dx, dw = self.experts._backward(dy)
        else:
            dxl, dw = self.experts._backward(self.fc2_latent_proj._backward(dy))
            dx = self.fc1_latent_proj._backward(dxl)
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
        g, s, lead = state
        pt = param_tangents
        tx, tw, ts, tgz, txl = self._stage_tangents(state, input_tangents, pt, "jvp")
        if self.latent_size is None:
            ty = self.experts._jvp_flat(self.experts.saved_state(), tx, tw, pt)
        else:  # the experts on fc1's tangent, then fc2: each child's latest state is this call's
            tyl = self.experts._jvp_flat(self.experts.saved_state(), txl, tw, pt)
            ty = self._child_jvp(self.fc2_latent_proj, -1, (tyl,), pt)
        if ts is not None:
            ty += ts if tgz is None else g * ts + g * (1.0 - g) * tgz * s
        return ty.reshape(lead + (self.hidden_size,))

    def _stage_tangents(self, state, input_tangents, pt, method: str) -> tuple:
        """``(tx, tw, ts, tgz, txl)``: the input tangent (checked, flat as the router's input), the
        router's weights', the shared expert's output and its gate's logit (None without them),
        ``fc1_latent_proj``'s output (None without a latent width),
        from the unchecked input tangents of ``jvp`` / ``backward_jvp`` (``method``); computed once
        per state and tangents while ``pt`` remembers (``loss_hvp``)."""

        def compute():
            tx = input_tangent(input_tangents, "SparseMoeBlock", method)
            router, shared, gate = self.router_module, self.shared_module, self.shared_gate_module
            xr = router.saved_state().linear.x
            if tx is not None:
                tx = check_tangent(tx, "tx", state[2] + (self.hidden_size,), xr.dtype).reshape(xr.shape)
            tw = router._jvp_flat(router.saved_state(), tx, pt)
            ts = None if shared is None else self._child_jvp(shared, -1, (tx,), pt)
            tgz = None if shared is None or gate is None else self._child_jvp(gate, -1, (tx,), pt)
            txl = None if self.latent_size is None else self._child_jvp(self.fc1_latent_proj, -1, (tx,), pt)
            return tx, tw, ts, tgz, txl

        return pt._remember((self, "stages", state) + tuple(input_tangents), compute)

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: the router's weight tangent and the shared part's tangents first (as
        ``_jvp``), then the experts' ``backward_jvp`` (``dx``, ``dw`` and their tangents), the
        router's on ``(dw, tdw)``, and the shared part ``y += g s`` by the product rule: ``ds = g
        dy`` with ``tds = tg dy + g tdy``; ``dz = c g (1 - g)``, ``c = <dy, s>``, with ``tdz = tc g
        (1 - g) + c (1 - 2 g) tg``, ``tc = <tdy, s> + <dy, ts>``."""
        g, s, lead = state
        pt = param_tangents
        router, experts = self.router_module, self.experts
        xr = router.saved_state().linear.x
        tx, tw, ts, tgz, txl = self._stage_tangents(state, input_tangents, pt, "backward_jvp")
        dy = dy.reshape(xr.shape)
        ddy = np.zeros_like(dy) if ddy is None else ddy.reshape(xr.shape)
        shared, gate = self.shared_module, self.shared_gate_module
        if self.latent_size is None:
            (dx, dw), (tdx, tdw) = experts._backward_jvp_flat(experts.pop_saved(), dy, tx, tw, pt, ddy)
        else:  # back through fc2, the experts (on fc1's output and its tangent), then fc1
            fc1, fc2 = self.fc1_latent_proj, self.fc2_latent_proj
            tyl = experts._jvp_flat(experts.saved_state(), txl, tw, pt)
            dyl, tdyl = self._child_backward_jvp(fc2, dy, (tyl,), pt, ddy)
            (dxl, dw), (tdxl, tdw) = experts._backward_jvp_flat(experts.pop_saved(), dyl, txl, tw, pt, tdyl)
            dx, tdx = self._child_backward_jvp(fc1, dxl, (tx,), pt, tdxl)
        dxr, tdxr = router._backward_jvp_flat(router.pop_saved(), dw, tx, pt, tdw)
        dx += dxr
        tdx += tdxr
        if shared is not None:
            if gate is not None:
                tg = g * (1.0 - g) * tgz
                c = np.einsum("nh,nh->n", dy, s)[:, None]
                tc = (np.einsum("nh,nh->n", ddy, s) + np.einsum("nh,nh->n", dy, ts))[:, None]
                dz, tdz = c * g * (1.0 - g), tc * g * (1.0 - g) + c * (1.0 - 2.0 * g) * tg
                dxg, tdxg = self._child_backward_jvp(gate, dz, (tx,), pt, tdz)
                dxs, tdxs = self._child_backward_jvp(shared, dy * g, (tx,), pt, ddy * g + dy * tg)
                dx, tdx = dx + dxg + dxs, tdx + tdxg + tdxs
            else:
                dxs, tdxs = self._child_backward_jvp(shared, dy, (tx,), pt, ddy)
                dx, tdx = dx + dxs, tdx + tdxs
        shape = lead + (self.hidden_size,)
        return dx.reshape(shape), tdx.reshape(shape)

    # -- from a Hugging Face config ------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config, *, rng=None, dtype=np.float64) -> "SparseMoeBlock":
        """The MoE block of a decoder layer of a Hugging Face model, from its config.

        ``config``: a mapping (``PretrainedConfig.to_dict()``) or a config object, with
        ``model_type`` one of ``"gpt_oss"``, ``"deepseek_v3"``, ``"qwen3_next"``, ``"qwen3_moe"``,
        ``"mixtral"``, ``"qwen2_moe"``, ``"olmoe"``, ``"granitemoe"``, ``"granitemoeshared"``,
        ``"granitemoehybrid"``, ``"lfm2_moe"``.  Fields read:

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
          (``router_jitter_noise``, a training-time input noise, must be 0);
        * qwen2_moe: ``hidden_size``, ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
          ``shared_expert_intermediate_size``, ``norm_topk_prob`` (false), ``hidden_act`` ->
          ``"softmax_topk"``, keys ``gate.weight``, ``experts.*``, ``shared_expert.*``,
          ``shared_expert_gate.weight``;
        * olmoe: ``hidden_size``, ``num_experts`` (or ``num_local_experts``), ``num_experts_per_tok``,
          ``intermediate_size``, ``norm_topk_prob`` (false), ``hidden_act`` -> ``"softmax_topk"``,
          keys ``gate.weight``, ``experts.*``;
        * granitemoe: ``hidden_size``, ``num_local_experts``, ``num_experts_per_tok``,
          ``intermediate_size``, ``hidden_act`` -> ``"topk_softmax"`` without a bias, keys
          ``router.weight``, ``experts.*`` (the decoder layer calls the block ``block_sparse_moe``);
        * granitemoeshared, granitemoehybrid: granitemoe's and ``shared_intermediate_size`` (the
          shared expert, ``shared_expert.*``, which the decoder layer calls ``shared_mlp``; none where
          0, GraniteMoeShared's default; Granite 4.0's default 1024);
        * lfm2_moe: ``hidden_size``, ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
          ``norm_topk_prob``, ``routed_scaling_factor``, ``use_expert_bias`` -> variant ``"sigmoid"``
          renormalised by ``sum + 1e-6`` (``norm_topk_eps``), the correction bias only with
          ``use_expert_bias``, keys ``experts.*``, ``gate.weight``, ``gate.e_score_correction_bias``
          (the decoder layer calls the block ``feed_forward`` and the bias ``expert_bias``).

        A compatibility wrapper: ``npattn.models.configs.moe_config(config)`` reads the arguments
        (a ``MoEConfig``; each family's reader lives there), which are then passed to the
        constructor, as ``CausalLM`` does.

        Raises
        ------
        TypeError, ValueError
            As ``moe_config``, which reads the config.
        """
        from ..models.configs import moe_config  # models sits above nn: imported when called

        return cls(**moe_config(config).kwargs(), rng=rng, dtype=dtype)

    def extra_repr(self):
        """The arguments shown by ``repr(module)``."""
        return f"hidden_size={self.hidden_size}"


MoE = SparseMoeBlock
