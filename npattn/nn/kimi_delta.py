"""``KimiDeltaAttention``: Kimi Linear's linear-attention layer (``self_attn`` of its KDA layers), backward by hand.

The layer, as transformers' ``KimiLinearDeltaAttention`` (shapes for one token; ``H`` heads of
width ``D``, the same for q, k and v):

    q, k, v = q_proj(x), k_proj(x), v_proj(x)                           (H D each)
    q, k, v = silu(causal depthwise conv1d over the sequence of [q k v])   (K taps, no bias)
    p       = f_b_proj(f_a_proj(x)) + dt_bias                            low rank D, then (H, D)
    g       = -exp(A_log_h) * softplus(p)                                one log decay per key channel
    beta    = sigmoid(b_proj(x))                                         (H,)
    o       = kimi_delta_attention(q, k, v, g, beta, use_qk_l2norm=True)
    y       = o_proj(RMSNorm(o) * o_norm.weight * sigmoid(g_b_proj(g_a_proj(x))))   over D, per head

It is Qwen3-Next's gated DeltaNet (``delta_net.py``, whose forward checks, padding handling and
decoding cache it shares through ``RecurrentLayer``) with the decay made per channel, separate q,
k, v projections, low-rank decay and gate projections, and a sigmoid (not SiLU) output gate.

Parameters carry transformers' state-dict names (under ``self_attn.`` in a decoder layer):
``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight (H D, hidden)``, ``conv1d.weight (3 H D, 1,
K)``, ``forget_gate.f_a_proj.weight (D, hidden)``, ``forget_gate.f_b_proj.weight (H D, D)``,
``forget_gate.dt_bias (H D,)``, ``forget_gate.A_log (1, 1, H, 1)``, ``b_proj.weight (H, hidden)``,
``g_a_proj.weight (D, hidden)``, ``g_b_proj.weight (H D, D)``, ``o_norm.weight (D,)``,
``o_proj.weight (hidden, H D)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple, Optional

import numpy as np

from .._validate import as_rng, check_dtype, check_positive_float, check_size
from ..functional import kernels as K
from ..functional.conv import CausalConv1dCache
from ..functional.kda import (
    KimiDeltaAttentionCache,
    kimi_delta_attention,
    kimi_delta_attention_backward,
    kimi_delta_attention_backward_jvp,
    kimi_delta_attention_jvp,
)
from ..functional.norm import (
    rms_norm_backward_jvp_kernel,
    rms_norm_backward_kernel,
    rms_norm_jvp_kernel,
    rms_norm_kernel,
)
from .delta_net import RecurrentLayer, _softplus, _softplus_grad, _softplus_second, _Weights
from .layers import Linear, input_tangent
from .module import Parameter

__all__ = ["KimiDeltaAttention"]


class _State(NamedTuple):
    lead: tuple  # the batch shape
    steps: int
    conv: CausalConv1dCache
    rule: KimiDeltaAttentionCache
    norm: tuple  # rms_norm's cache of the output norm
    normed: np.ndarray  # (B..., L, H, D) RMSNorm(o) * o_norm.weight
    gate: np.ndarray  # (B..., L, H, D) sigmoid of the output gate
    beta: np.ndarray  # (B..., L, H) sigmoid(b)
    g: np.ndarray  # (B..., L, H, D)
    pre: np.ndarray  # (B..., L, H, D) f_b(f_a(x)) + dt_bias, softplus's input
    keep: np.ndarray | None = None  # (B..., L, 1): 1 at a token, 0 at padding (attention_mask given)


class _ForgetGate(_Weights):
    """``forget_gate``: the decay's parameters (transformers' ``KimiLinearForgetGate``), used by the layer."""

    f_a_proj: Linear
    f_b_proj: Linear
    dt_bias: Parameter
    A_log: Parameter


class KimiDeltaAttention(RecurrentLayer):
    """Kimi Delta Attention, Kimi Linear's linear attention layer: ``(B..., L, hidden) -> (B..., L, hidden)``.

    The constructor takes the fields of a Hugging Face ``KimiLinearConfig`` by their names (their
    defaults are that config's; ``linear_attn_config``'s ``num_heads``, ``head_dim`` and
    ``short_conv_kernel_size`` are its ``linear_num_heads``, ``linear_head_dim`` and
    ``linear_conv_kernel_dim``).

    Parameters
    ----------
    hidden_size : int
        The model width.
    linear_num_heads, linear_head_dim : int
        ``H`` and ``D``: each head's state is ``(D, D)``, its decay a vector of ``D`` channels.
    linear_conv_kernel_dim : int
        ``K``, the taps of the short causal convolution over ``[q k v]``.
    rms_norm_eps : float
        The eps of the gated RMSNorm on the output.
    hidden_act : str
        The convolution's activation: ``"silu"`` (or ``"swish"``), the only one supported.
    chunk_size : int
        The KDA chunk length (any value gives the same numbers; see
        ``npattn.functional.kimi_delta_attention``).
    rng, dtype
        As every module.  Initialisation as transformers: the projections and the convolution as
        torch's ``Linear`` / ``Conv1d``, ``A_log = log(U(1, 16))``, ``dt_bias`` the inverse softplus
        of ``exp(U(log 1e-3, log 0.1))``, ``o_norm.weight`` ones.

    Notes
    -----
    Decoding with ``forward(x, use_cache=True)``, ``attention_mask`` and ``reset_kv_cache()`` are
    ``GatedDeltaNet``'s (``RecurrentLayer``).  transformers computes the rule, the decay and the
    norm in float32 for bf16/fp16 models; here everything runs in the module's dtype.
    ``backward_jvp`` (the second order, ``CausalLM.loss_hvp``'s) runs the chunked
    ``kimi_delta_attention_backward_jvp`` inside the chain.

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> from npattn.nn.kimi_delta import KimiDeltaAttention
    >>> kda = KimiDeltaAttention(16, linear_num_heads=2, linear_head_dim=4, rng=0)
    >>> x = np.random.default_rng(1).standard_normal((2, 5, 16))
    >>> y = kda(x)
    >>> y.shape, kda.backward(np.ones_like(y)).shape
    ((2, 5, 16), (2, 5, 16))
    """

    _REPR_FIELDS = ("hidden_size", "num_heads", "head_dim", "conv_kernel_size")

    def __init__(
        self,
        hidden_size: int,
        linear_num_heads: int = 32,
        linear_head_dim: int = 128,
        linear_conv_kernel_dim: int = 4,
        rms_norm_eps: float = 1e-5,
        hidden_act: str = "silu",
        *,
        chunk_size: int = 16,
        rng=None,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        self.hidden_size = check_size(hidden_size, "hidden_size")
        self.num_heads = h = check_size(linear_num_heads, "linear_num_heads")
        self.head_dim = d = check_size(linear_head_dim, "linear_head_dim")
        self.conv_kernel_size = check_size(linear_conv_kernel_dim, "linear_conv_kernel_dim")
        self.eps = check_positive_float(rms_norm_eps, "rms_norm_eps", allow_zero=True)
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act: expected 'silu' (Kimi Linear's) or 'swish', got {hidden_act!r}")
        self.chunk_size = check_size(chunk_size, "chunk_size")
        self._dtype = dt = check_dtype(dtype)
        rng = as_rng(rng)
        self.qkv_dim = hd = h * d
        n = self.hidden_size
        self.q_proj = Linear(n, hd, False, rng=rng, dtype=dt)
        self.k_proj = Linear(n, hd, False, rng=rng, dtype=dt)
        self.v_proj = Linear(n, hd, False, rng=rng, dtype=dt)
        bound = 1.0 / math.sqrt(self.conv_kernel_size)
        conv_w = rng.uniform(-bound, bound, (3 * hd, 1, self.conv_kernel_size))
        self.conv1d = _Weights(Parameter(conv_w, dt), owner="KimiDeltaAttention")
        dt_init = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), hd))
        self.forget_gate = _ForgetGate(
            owner="KimiDeltaAttention",
            f_a_proj=Linear(n, d, False, rng=rng, dtype=dt),
            f_b_proj=Linear(d, hd, False, rng=rng, dtype=dt),
            dt_bias=Parameter(dt_init + np.log(-np.expm1(-dt_init)), dt),
            A_log=Parameter(np.log(rng.uniform(1.0, 16.0, (1, 1, h, 1))), dt),
        )
        self.b_proj = Linear(n, h, False, rng=rng, dtype=dt)
        self.g_a_proj = Linear(n, d, False, rng=rng, dtype=dt)
        self.g_b_proj = Linear(d, hd, False, rng=rng, dtype=dt)
        self.o_norm = _Weights(Parameter(np.ones(d), dt), owner="KimiDeltaAttention")
        self.o_proj = Linear(hd, n, False, rng=rng, dtype=dt)
        self.reset_kv_cache()

    @classmethod
    def from_config(cls, config: Mapping, **kwargs) -> "KimiDeltaAttention":
        """A layer from a Hugging Face ``KimiLinearConfig`` as a mapping (``config.to_dict()``):
        ``npattn.models.configs.kda_config(config)`` reads the arguments; ``kwargs`` (``chunk_size``,
        ``rng``, ``dtype``) pass through."""
        from ..models.configs import kda_config  # models sits above nn: imported when called

        return cls(**kda_config(config).kwargs(), **kwargs)

    def _decay(self, pre: np.ndarray) -> np.ndarray:
        """``g = -exp(A_log_h) softplus(p)``, ``p (B..., L, H, D)``."""
        return -np.exp(self.forget_gate.A_log.data[0, 0]) * _softplus(pre)

    # -- forward ------------------------------------------------------------------------------
    def _forward(self, x: np.ndarray, use_cache: bool = False, keep: np.ndarray | None = None) -> np.ndarray:
        h, d, hd = self.num_heads, self.head_dim, self.qkv_dim
        lead, steps = x.shape[:-2], x.shape[-2]
        heads = lead + (steps, h, d)
        if keep is not None:
            x = x * keep  # padded steps: zero input (convolution window and projections)
        fg = self.forget_gate
        mixed = np.concatenate([self.q_proj._forward(x), self.k_proj._forward(x), self.v_proj._forward(x)], axis=-1)
        conv_out, conv_cache = self._convolve(mixed, use_cache)
        q, k, v = (conv_out[..., i * hd : (i + 1) * hd].reshape(heads) for i in range(3))
        pre = (fg.f_b_proj._forward(fg.f_a_proj._forward(x)) + fg.dt_bias.data).reshape(heads)
        g = self._decay(pre)
        beta = K.sigmoid(self.b_proj._forward(x))
        g_in, beta_in = (g, beta) if keep is None else (g * keep[..., None], beta * keep)  # padding: S unchanged
        sw = (-2, -3)  # (B..., L, H, D) <-> (B..., H, L, D)
        o, rule_cache = kimi_delta_attention(
            q.swapaxes(*sw),
            k.swapaxes(*sw),
            v.swapaxes(*sw),
            g_in.swapaxes(*sw),
            beta_in.swapaxes(-1, -2),
            scale=1.0 / math.sqrt(d),
            **self._rule_options(use_cache),
        )
        normed, norm_cache = rms_norm_kernel(o.swapaxes(*sw), self.o_norm.weight.data, self.eps, normalized_shape=(d,))
        gate = K.sigmoid(self.g_b_proj._forward(self.g_a_proj._forward(x)).reshape(heads))
        out = self.o_proj._forward((normed * gate).reshape(lead + (steps, hd)))
        if use_cache:
            self._keep_cache(lead, steps, conv_cache.final_state, rule_cache.final_state)
        else:
            self.save_for_backward(
                _State(lead, steps, conv_cache, rule_cache, norm_cache, normed, gate, beta, g, pre, keep)
            )
        return out

    # -- backward -----------------------------------------------------------------------------
    def backward(self, dy) -> np.ndarray:
        """``dx (B..., L, hidden)``; every parameter's gradient is added into its ``.grad``.

        The chain, last step first: ``o_proj``; ``y = n s`` with ``n = RMSNorm(o) w`` and ``s =
        sigmoid(gate)``: ``dn = dy s`` (rms_norm's backward: ``do``, ``do_norm.weight``), ``dgate =
        dy n s (1 - s)`` (through ``g_b_proj``, ``g_a_proj``); the KDA backward (``dq, dk, dv, dg,
        dbeta``); ``beta = sigmoid(b)``: ``db = dbeta beta (1 - beta)``; ``g = -exp(A_log)
        softplus(p)``: ``dA_log_h = sum dg g`` over the head's channels and tokens, ``dp = -dg
        exp(A_log) sigmoid(p)`` (``ddt_bias`` its sum over tokens; through ``f_b_proj``,
        ``f_a_proj``); the convolution's backward (``dconv1d.weight``) into q, k, v_proj.  Every
        projection's input gradient adds into ``dx``.
        """
        dy = self._check_dy(dy)
        return self._backward(dy)

    def _backward(self, dy: np.ndarray) -> np.ndarray:
        h, d, hd = self.num_heads, self.head_dim, self.qkv_dim
        st: _State = self.pop_saved()
        lead, steps, fg = st.lead, st.steps, self.forget_gate
        flat = lead + (steps, hd)
        sw = (-2, -3)
        dn = self.o_proj._backward(dy).reshape(lead + (steps, h, d))
        do, dnorm_w = rms_norm_backward_kernel(dn * st.gate, st.norm)
        dgate = dn * st.normed * st.gate * (1.0 - st.gate)
        dx = self.g_a_proj._backward(self.g_b_proj._backward(dgate.reshape(flat)))
        grads = kimi_delta_attention_backward(do.swapaxes(*sw), st.rule)
        dq, dk, dv, dg, dbeta = (np.asarray(t) for t in grads[:5])  # never None: only dS0 may be
        dg, dbeta = dg.swapaxes(*sw), dbeta.swapaxes(-1, -2)  # (B..., L, H, D), (B..., L, H)
        if st.keep is not None:  # g * keep, beta * keep
            dg, dbeta = dg * st.keep[..., None], dbeta * st.keep
        dx += self.b_proj._backward(dbeta * st.beta * (1.0 - st.beta))
        dA_log = (dg * st.g).reshape(-1, h, d).sum((0, 2))  # dg/dA_log = -exp(A_log) softplus = g
        dpre = (-dg * np.exp(fg.A_log.data[0, 0]) * _softplus_grad(st.pre)).reshape(flat)
        dx += fg.f_a_proj._backward(fg.f_b_proj._backward(dpre))
        dconv = np.concatenate([t.swapaxes(*sw).reshape(flat) for t in (dq, dk, dv)], axis=-1)
        dmixed, dconv_w, _, _ = K.causal_conv1d_backward(dconv, st.conv)
        for i, proj in enumerate((self.q_proj, self.k_proj, self.v_proj)):
            dx += proj._backward(dmixed[..., i * hd : (i + 1) * hd])
        if st.keep is not None:  # x * keep
            dx *= st.keep
        self.accumulate_grad(self.conv1d.weight, dconv_w[:, None, :])
        self.accumulate_grad(fg.dt_bias, dpre.reshape(-1, hd).sum(0))
        self.accumulate_grad(fg.A_log, dA_log.reshape(1, 1, h, 1))
        self.accumulate_grad(self.o_norm.weight, dnorm_w)
        return dx

    # -- second order ---------------------------------------------------------------------------
    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order (``backward_jvp``): the forward's tangents (``_output_tangents``, shared
        with ``_jvp``; the rule's and the norm's JVPs for ``o_proj``'s input), then ``backward``'s
        chain in reverse, each stage by its ``<op>_backward_jvp`` fed the tangents of its inputs
        and of its upstream gradient: ``o_proj``; ``y = n s``: rms_norm's second order along
        ``((to, tw), tdy s + dy ts)``, and ``dgate = dy n s'`` with ``s' = s (1 - s)``, ``ts' =
        (1 - 2 s) ts`` (through ``g_b_proj``, ``g_a_proj``); the chunked
        ``kimi_delta_attention_backward_jvp``; the gates (``_gates_backward_jvp``);
        ``causal_conv1d_backward_jvp``; the q, k, v projections."""
        st: _State = state
        h, d, hd = self.num_heads, self.head_dim, self.qkv_dim
        lead, steps, pt = st.lead, st.steps, param_tangents
        heads, flat, sw = lead + (steps, h, d), lead + (steps, hd), (-2, -3)
        t, to, tn, ty = self._output_tangents(st, input_tangents, pt, "backward_jvp")
        tnw = pt.get(self.o_norm.weight)
        dn, tdn = self._child_backward_jvp(self.o_proj, dy, (ty.reshape(flat),), pt, ddy)
        dn, tdn = dn.reshape(heads), tdn.reshape(heads)
        (do, dnw), (tdo, tdnw) = rms_norm_backward_jvp_kernel(
            dn * st.gate, st.norm, (to, tnw), tdn * st.gate + dn * t.gate
        )
        # y = n s, s = sigmoid(gate): dgate = dy n s', s' = s (1 - s), ts' = (1 - 2 s) ts
        ds = st.gate * (1.0 - st.gate)
        dgate = dn * st.normed * st.gate * (1.0 - st.gate)  # as the backward rounds it
        tdgate = (tdn * st.normed + dn * tn) * ds + dn * st.normed * (1.0 - 2.0 * st.gate) * t.gate
        dh, tdh = self._child_backward_jvp(self.g_b_proj, dgate.reshape(flat), (t.gate_a,), pt, tdgate.reshape(flat))
        dx, tdx = self._child_backward_jvp(self.g_a_proj, dh, (t.x,), pt, tdh)
        grads, tans = kimi_delta_attention_backward_jvp(do.swapaxes(*sw), st.rule, t.rule, tdo.swapaxes(*sw))
        dx, tdx = self._gates_backward_jvp(st, t, pt, grads[3:5], tans[3:5], dx, tdx)
        dconv, tdconv = (
            np.concatenate([np.asarray(x).swapaxes(*sw).reshape(flat) for x in xs[:3]], axis=-1) for xs in (grads, tans)
        )
        tw = t.conv_weight
        (dmixed, dconv_w, _, _), (tdmixed, tdconv_w, _, _) = K.causal_conv1d_backward_jvp(
            dconv, st.conv, (t.mixed, None if tw is None else tw[:, 0, :], None, None), tdconv
        )
        for i, proj in enumerate((self.q_proj, self.k_proj, self.v_proj)):
            part = slice(i * hd, (i + 1) * hd)
            mdx, mtdx = self._child_backward_jvp(proj, dmixed[..., part], (t.x,), pt, tdmixed[..., part])
            dx, tdx = dx + mdx, tdx + mtdx
        if st.keep is not None:  # x * keep
            dx, tdx = dx * st.keep, tdx * st.keep
        self._accumulate_second(
            (
                (self.conv1d.weight, dconv_w[:, None, :], tdconv_w[:, None, :]),
                (self.o_norm.weight, dnw, tdnw),
            )
        )
        return dx, tdx

    def _gates_backward_jvp(self, st: "_State", t: "_Tangents", pt, grads, tans, dx, tdx):
        """The second order of the decay and the write strength, from the rule's ``(dg, dbeta)``
        and their tangents: ``dx`` and its tangent with ``b_proj``'s and ``f_a_proj``'s (through
        ``f_b_proj``) added, in the backward's order; ``dt_bias``' and ``A_log``'s gradients and
        tangents accumulated.  By the product
        rule: ``beta = sigmoid(b)``: ``db = dbeta s'``, ``s' = beta (1 - beta)``, ``ts' = (1 - 2
        beta) tbeta``; ``g = -e^{A_log} softplus(p)``: ``dA_log = sum dg g``, ``tdA_log = sum (tdg
        g + dg tg)``, ``dp = -dg e^{A_log} sigma(p)``, ``tdp = -(tdg sigma(p) + dg sigma'(p) tp +
        dg tA_log sigma(p)) e^{A_log}`` (``sigma' = 0`` above softplus' threshold)."""
        h, d, hd = self.num_heads, self.head_dim, self.qkv_dim
        fg, flat = self.forget_gate, st.lead + (st.steps, hd)
        dg, tdg = (x.swapaxes(-2, -3) for x in (grads[0], tans[0]))  # (B..., L, H, D)
        dbeta, tdbeta = (x.swapaxes(-1, -2) for x in (grads[1], tans[1]))  # (B..., L, H)
        if st.keep is not None:  # g * keep, beta * keep
            dg, tdg, dbeta, tdbeta = (
                dg * st.keep[..., None],
                tdg * st.keep[..., None],
                dbeta * st.keep,
                tdbeta * st.keep,
            )
        beta = st.beta
        db = dbeta * beta * (1.0 - beta)
        tdb = tdbeta * beta * (1.0 - beta) + dbeta * (1.0 - 2.0 * beta) * t.beta
        bdx, btdx = self._child_backward_jvp(self.b_proj, db, (t.x,), pt, tdb)
        dx, tdx = dx + bdx, tdx + btdx
        dA_log = (dg * st.g).reshape(-1, h, d).sum((0, 2))
        tdA_log = (tdg * st.g + dg * t.g).reshape(-1, h, d).sum((0, 2))
        e, sig = np.exp(fg.A_log.data[0, 0]), _softplus_grad(st.pre)
        dpre = -dg * e * sig
        tdpre = -tdg * e * sig - dg * e * _softplus_second(st.pre) * t.pre
        if t.A_log is not None:
            tdpre -= dg * e * t.A_log[0, 0] * sig
        dpre, tdpre = dpre.reshape(flat), tdpre.reshape(flat)
        df, tdf = self._child_backward_jvp(fg.f_b_proj, dpre, (t.forget_a,), pt, tdpre)
        fdx, ftdx = self._child_backward_jvp(fg.f_a_proj, df, (t.x,), pt, tdf)
        self._accumulate_second(
            (
                (fg.dt_bias, dpre.reshape(-1, hd).sum(0), tdpre.reshape(-1, hd).sum(0)),
                (fg.A_log, dA_log.reshape(1, 1, h, 1), tdA_log.reshape(1, 1, h, 1)),
            )
        )
        return dx + fdx, tdx + ftdx  # in the backward's order: g_a, b, f_a, then q, k, v

    # -- forward mode ---------------------------------------------------------------------------
    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode (``m.jvp(tx, param_tangents=...)``): the forward's chain run on tangents
        (``_forward_tangents``), then KDA's and RMSNorm's JVPs; ``y = n s``: ``ty = tn s + n ts``."""
        st: _State = state
        ty = self._output_tangents(st, input_tangents, param_tangents, "jvp")[3]
        return self._child_jvp(self.o_proj, -1, (ty.reshape(st.lead + (st.steps, self.qkv_dim)),), param_tangents)

    def _output_tangents(self, st: _State, input_tangents, pt, method: str) -> tuple:
        """``(stages, to, tn, ty)``: ``_forward_tangents``, KDA's output tangent (steps before heads,
        as the norm takes it), the norm's and ``o_proj``'s input's, from the unchecked input
        tangents of ``jvp`` / ``backward_jvp`` (``method``); computed once per state and tangents
        while ``pt`` remembers (``loss_hvp``), as ``GatedDeltaNet._output_tangents``."""

        def compute():
            t = self._forward_tangents(st, input_tangent(input_tangents, "KimiDeltaAttention", method), pt)
            to = kimi_delta_attention_jvp(st.rule, *t.rule).swapaxes(-2, -3)
            tn = rms_norm_jvp_kernel(st.norm, to, pt.get(self.o_norm.weight))
            return t, to, tn, tn * st.gate + st.normed * t.gate

        return pt._remember((self, "stages", st) + tuple(input_tangents), compute)

    def _forward_tangents(self, st: _State, tx, pt) -> "_Tangents":
        """The tangents of the forward's stages up to the rule's inputs and the output gate: the
        projections, the convolution and KDA each by their JVP; ``beta = sigmoid(b)``: ``tbeta =
        beta (1 - beta) tb``; ``g = -exp(A_log) softplus(p)``: ``tg = g tA_log - exp(A_log)
        sigmoid(p) tp``, ``tp = f_b(f_a(tx))``'s tangent ``+ tdt_bias``; ``s = sigmoid(gate)``:
        ``ts = s (1 - s) tgate``."""
        h, d, hd = self.num_heads, self.head_dim, self.qkv_dim
        lead, steps, fg = st.lead, st.steps, self.forget_gate
        heads = lead + (steps, h, d)
        if tx is None:
            tx = np.zeros(lead + (steps, self.hidden_size), st.beta.dtype)
        elif st.keep is not None:  # x * keep
            tx = tx * st.keep

        def lin(m, t):
            return self._child_jvp(m, -1, (t,), pt)

        tmixed = np.concatenate([lin(m, tx) for m in (self.q_proj, self.k_proj, self.v_proj)], axis=-1)
        tw = pt.get(self.conv1d.weight)
        tconv = K.causal_conv1d_jvp(st.conv, tmixed, None if tw is None else tw[:, 0, :])
        tq, tk, tv = (tconv[..., i * hd : (i + 1) * hd].reshape(heads) for i in range(3))
        forget_a = lin(fg.f_a_proj, tx)
        tpre = lin(fg.f_b_proj, forget_a)
        tdt = pt.get(fg.dt_bias)
        if tdt is not None:
            tpre = tpre + tdt
        tpre = tpre.reshape(heads)
        tg = -np.exp(fg.A_log.data[0, 0]) * _softplus_grad(st.pre) * tpre
        tA_log = pt.get(fg.A_log)
        if tA_log is not None:
            tg += st.g * tA_log[0, 0]
        tbeta = lin(self.b_proj, tx) * st.beta * (1.0 - st.beta)
        tg_in, tbeta_in = (tg, tbeta) if st.keep is None else (tg * st.keep[..., None], tbeta * st.keep)
        gate_a = lin(self.g_a_proj, tx)
        tgate = st.gate * (1.0 - st.gate) * lin(self.g_b_proj, gate_a).reshape(heads)
        sw = (-2, -3)
        rule = (tq.swapaxes(*sw), tk.swapaxes(*sw), tv.swapaxes(*sw), tg_in.swapaxes(*sw), tbeta_in.swapaxes(-1, -2))
        return _Tangents(
            x=tx,
            mixed=tmixed,
            conv_weight=tw,
            forget_a=forget_a,
            pre=tpre,
            g=tg,
            A_log=tA_log,
            beta=tbeta,
            gate_a=gate_a,
            gate=tgate,
            rule=rule,
        )


class _Tangents(NamedTuple):
    """The forward's tangents ``KimiDeltaAttention._forward_tangents`` gives, by stage."""

    x: np.ndarray  # the input's (masked as the input)
    mixed: np.ndarray  # [q k v] before the convolution
    conv_weight: Optional[np.ndarray]  # conv1d.weight's (3 H D, 1, K), None: zero
    forget_a: np.ndarray  # f_a_proj's output
    pre: np.ndarray  # (B..., L, H, D) p = f_b(f_a(x)) + dt_bias
    g: np.ndarray  # (B..., L, H, D) g's, unmasked
    A_log: Optional[np.ndarray]
    beta: np.ndarray  # (B..., L, H) beta's, unmasked
    gate_a: np.ndarray  # g_a_proj's output
    gate: np.ndarray  # (B..., L, H, D) the sigmoid output gate's
    rule: tuple  # kimi_delta_attention's (tq, tk, tv, tg, tbeta), as the rule takes them
