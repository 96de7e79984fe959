"""``Mamba2Mixer``: the Mamba-2 layer of Granite 4.0's hybrid models, backward by hand.

The layer, as transformers' ``GraniteMoeHybridMambaLayer`` (``I = H P`` the inner width, ``H`` heads
of ``P`` channels, ``G`` groups of ``B`` and ``C`` of width ``N``, ``K`` convolution taps):

    [z xBC dt] = in_proj(x)                 I, I + 2 G N and H features
    xBC        = silu(conv(xBC))            a causal depthwise conv1d over the sequence (bias optional)
    [x' B C]   = xBC                        I, G N, G N features
    y          = mamba2_scan(x', dt, -exp(A_log), B, C, D, dt_bias)     the selective state-space scan
    h          = y * silu(z)                the gate, then an RMSNorm over each of G groups of I / G
    out        = out_proj(rms_norm_per_group(h) * norm.weight)

(transformers' ``GraniteMoeHybridRMSNormGated`` gates before it normalises, in groups: not Qwen3-Next's
gated norm, which normalises first).  Falcon-H1's layer (``FalconH1Mixer``) is the same with three
options: ``gated_norm="norm_first"`` (``rms_norm_per_group(y) * norm.weight * silu(z)``) or None (no
norm: ``out_proj(y * silu(z))``), ``proj_multipliers`` (a factor on each of ``z``, ``x'``, ``B``, ``C``,
``dt`` of in_proj's output) and ``out_proj_bias`` apart from ``proj_bias``.

Parameters carry transformers' state-dict names (under ``mamba.`` in a decoder layer):
``in_proj.weight (2 I + 2 G N + H, hidden)``, ``conv1d.weight (I + 2 G N, 1, K)``, ``conv1d.bias``,
``dt_bias``, ``A_log``, ``D (H,)``, ``norm.weight (I,)``, ``out_proj.weight (hidden, I)`` (the
projections' biases with ``proj_bias``).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np

from .._validate import as_rng, check_bool, check_dtype, check_positive_float, check_size
from ..functional import kernels as K
from ..functional.activation import SiluCache
from ..functional.conv import CausalConv1dCache
from ..functional.mamba2 import Mamba2ScanCache
from ..functional.norm import RMSNormCache
from .delta_net import RecurrentLayer, _Weights
from .layers import Linear, input_tangent
from .module import Parameter

__all__ = ["Mamba2Mixer"]

_GATED_NORMS = ("gate_first", "norm_first", None)


class _State(NamedTuple):
    lead: tuple  # the batch shape
    steps: int
    conv: CausalConv1dCache
    scan: Mamba2ScanCache
    y: np.ndarray  # (B..., L, I) the scan's output
    gate: SiluCache  # silu(z)'s cache
    g: np.ndarray  # (B..., L, I) silu(z)
    h: Optional[np.ndarray]  # (B..., L, I) y * silu(z) ("gate_first" only)
    norm: Optional[RMSNormCache]  # the per-group RMSNorm's (no weight), over (B..., L, G, I / G); None: no norm
    n: Optional[np.ndarray]  # (B..., L, I) the normalised h ("norm_first": y), before norm.weight
    keep: Optional[np.ndarray] = None  # (B..., L, 1): 1 at a token, 0 at padding (attention_mask given)
    u: Optional[np.ndarray] = None  # (B..., L, I) "norm_first": n * norm.weight, before the gate


class _Tangents(NamedTuple):
    """The forward's tangents by stage (``Mamba2Mixer._stage_tangents``)."""

    x: np.ndarray  # the input's (masked as the input)
    z: np.ndarray
    xbc: np.ndarray  # the convolution's input's
    conv_weight: Optional[np.ndarray]  # (C, K) as the op takes it, None: zero
    conv_bias: Optional[np.ndarray]
    conv_forward: tuple  # the convolution's JVP's (tz, txp), for its second order (forward=)
    scan: tuple  # mamba2_scan's tangents (tx, tdt, tA, tB, tC, tD, tdt_bias), as the scan takes them
    y: np.ndarray
    g: np.ndarray  # silu(z)'s
    h: Optional[np.ndarray]  # y * silu(z)'s ("gate_first", None)
    n: Optional[np.ndarray]
    out: np.ndarray  # out_proj's input's
    u: Optional[np.ndarray] = None  # "norm_first": n * norm.weight's


class Mamba2Mixer(RecurrentLayer):
    """Mamba-2, Granite 4.0's state-space layer: ``(B..., L, hidden) -> (B..., L, hidden)``.

    Parameters
    ----------
    hidden_size : int
        The model width.
    num_heads : int
        ``H``, the scan's heads (Granite's ``mamba_n_heads``).
    head_dim : int
        ``P``, each head's channels (``mamba_d_head``); the inner width is ``I = H P``.
    state_size : int
        ``N``, the width of ``B`` and ``C`` (``mamba_d_state``): each head's state is ``(P, N)``.
    n_groups : int
        ``G``, the groups sharing ``B`` and ``C`` and normalised apart (``mamba_n_groups``); divides ``H``.
    conv_kernel : int
        ``K``, the taps of the causal convolution over ``[x' B C]`` (``mamba_d_conv``).
    conv_bias, proj_bias : bool
        Biases on the convolution and on both projections (``mamba_conv_bias``, ``mamba_proj_bias``).
    rms_norm_eps : float
        The eps of the gated, grouped RMSNorm.
    time_step_limit : (float, float)
        The bounds of the step sizes (``time_step_limit``; the default never clips).
    chunk_size : int
        The scan's chunk length (any value gives the same numbers; ``mamba_chunk_size``).
    out_proj_bias : bool or None
        ``out_proj``'s bias where it differs from ``in_proj``'s (None: ``proj_bias``; Falcon-H1's
        ``projectors_bias``).
    gated_norm : {"gate_first", "norm_first"} or None
        The gate and the grouped RMSNorm before ``out_proj``: ``"gate_first"`` (Granite 4.0's
        ``rms_norm_per_group(y * silu(z)) * norm.weight``), ``"norm_first"``
        (``rms_norm_per_group(y) * norm.weight * silu(z)``: Falcon-H1's ``mamba_norm_before_gate``),
        None: no norm and no ``norm.weight``, ``out_proj(y * silu(z))`` (Falcon-H1 without
        ``mamba_rms_norm``).
    proj_multipliers : five floats or None
        Factors of ``in_proj``'s output (its bias included), one per part ``z``, ``x'``, ``B``,
        ``C``, ``dt`` (Falcon-H1's ``ssm_multipliers``, its muP vector); None: none.
    rng, dtype
        As every module.  Initialisation as transformers: the projections and the convolution as
        torch's ``Linear`` / ``Conv1d``, ``A_log = log(1 .. H)``, ``D`` and ``dt_bias`` ones,
        ``norm.weight`` ones.

    Notes
    -----
    ``forward(x, use_cache=True)`` decodes incrementally: the layer keeps the last ``K - 1``
    convolution inputs and each head's state and continues from them, so feeding a sequence in
    pieces gives the outputs of one full pass.  Such a call keeps nothing for backward;
    ``reset_kv_cache()`` starts a new sequence.  ``attention_mask`` zeroes the padded steps' input
    and the convolution's output there (transformers' ``apply_mask_to_padding_states``, both
    places): a left-padded sequence's state stays zero through its padding.

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> mixer = npattn.Mamba2Mixer(8, num_heads=4, head_dim=4, state_size=3, n_groups=2, rng=0)
    >>> x = np.random.default_rng(1).standard_normal((2, 5, 8))
    >>> y = mixer(x)
    >>> y.shape, mixer.backward(np.ones_like(y)).shape
    ((2, 5, 8), (2, 5, 8))
    """

    _REPR_FIELDS = ("hidden_size", "num_heads", "head_dim", "state_size", "n_groups", "conv_kernel")

    def __init__(
        self,
        hidden_size: int,
        num_heads: int = 128,
        head_dim: int = 64,
        state_size: int = 256,
        n_groups: int = 1,
        conv_kernel: int = 4,
        conv_bias: bool = True,
        proj_bias: bool = False,
        rms_norm_eps: float = 1e-6,
        time_step_limit: tuple = (0.0, math.inf),
        *,
        chunk_size: int = 256,
        out_proj_bias: Optional[bool] = None,
        gated_norm: Optional[str] = "gate_first",
        proj_multipliers: Optional[tuple] = None,
        rng=None,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden = check_size(hidden_size, "hidden_size")
        self.num_heads = heads = check_size(num_heads, "num_heads")
        self.head_dim = check_size(head_dim, "head_dim")
        self.state_size = n = check_size(state_size, "state_size")
        self.n_groups = groups = check_size(n_groups, "n_groups")
        if heads % groups:
            raise ValueError(f"n_groups: expected a divisor of num_heads={heads}, got {groups}")
        self.conv_kernel = taps = check_size(conv_kernel, "conv_kernel")
        self.conv_bias = check_bool(conv_bias, "conv_bias")
        self.proj_bias = check_bool(proj_bias, "proj_bias")
        self.eps = check_positive_float(rms_norm_eps, "rms_norm_eps", allow_zero=True)
        try:
            lo, hi = (float(v) for v in time_step_limit)
        except (TypeError, ValueError):
            raise ValueError(f"time_step_limit: expected two numbers (low, high), got {time_step_limit!r}") from None
        if not lo <= hi:
            raise ValueError(f"time_step_limit: expected low <= high, got {time_step_limit!r}")
        self.time_step_limit = (lo, hi)
        self.chunk_size = check_size(chunk_size, "chunk_size")
        self.out_proj_bias = self.proj_bias if out_proj_bias is None else check_bool(out_proj_bias, "out_proj_bias")
        if gated_norm not in _GATED_NORMS:
            raise ValueError(f"gated_norm: expected one of {list(_GATED_NORMS)}, got {gated_norm!r}")
        self.gated_norm = gated_norm
        self._dtype = dt = check_dtype(dtype)
        rng = as_rng(rng)
        self.intermediate_size = inner = heads * self.head_dim
        self.conv_dim = conv_dim = inner + 2 * groups * n
        self.in_proj = Linear(hidden, inner + conv_dim + heads, self.proj_bias, rng=rng, dtype=dt)
        bound = 1.0 / math.sqrt(taps)
        members = {"bias": Parameter(rng.uniform(-bound, bound, conv_dim), dt)} if self.conv_bias else {}
        self.conv1d = _Weights(
            Parameter(rng.uniform(-bound, bound, (conv_dim, 1, taps)), dt), owner="Mamba2Mixer", **members
        )
        self.dt_bias = Parameter(np.ones(heads), dt)
        self.A_log = Parameter(np.log(np.arange(1.0, heads + 1.0)), dt)
        self.D = Parameter(np.ones(heads), dt)
        if gated_norm is not None:
            self.norm = _Weights(Parameter(np.ones(inner), dt), owner="Mamba2Mixer")
        self.out_proj = Linear(inner, hidden, self.out_proj_bias, rng=rng, dtype=dt)
        self.proj_multipliers = None if proj_multipliers is None else self._multipliers(proj_multipliers)
        self._proj_scale = None
        if self.proj_multipliers is not None:  # one factor per feature of in_proj's output
            widths = (inner, inner, groups * n, groups * n, heads)
            self._proj_scale = np.repeat(np.array(self.proj_multipliers, dt), widths)
        self.reset_kv_cache()

    @staticmethod
    def _multipliers(values) -> tuple:
        try:
            out = tuple(float(v) for v in values)
        except (TypeError, ValueError):
            out = ()
        if len(out) != 5 or not all(math.isfinite(v) for v in out):
            raise ValueError(f"proj_multipliers: expected five finite numbers (z, x, B, C, dt), got {values!r}")
        return out

    def _conv_args(self) -> tuple:
        """``(weight (C, K), bias or None)`` as ``causal_conv1d`` takes them."""
        bias = getattr(self.conv1d, "bias", None)
        return self.conv1d.weight.data[:, 0, :], (None if bias is None else bias.data)

    def _split_proj(self, proj: np.ndarray) -> tuple:
        """``(z, xBC, dt)`` of ``in_proj``'s output."""
        inner = self.intermediate_size
        return proj[..., :inner], proj[..., inner : inner + self.conv_dim], proj[..., inner + self.conv_dim :]

    def _scan_inputs(self, xbc: np.ndarray, dt: np.ndarray, lead: tuple, steps: int) -> tuple:
        """``(x, dt, B, C)`` in the scan's head-first layout from the convolution's output and dt."""
        inner, groups, n = self.intermediate_size, self.n_groups, self.state_size
        x = xbc[..., :inner].reshape(lead + (steps, self.num_heads, self.head_dim)).swapaxes(-2, -3)
        B = xbc[..., inner : inner + groups * n].reshape(lead + (steps, groups, n)).swapaxes(-2, -3)
        C = xbc[..., inner + groups * n :].reshape(lead + (steps, groups, n)).swapaxes(-2, -3)
        return x, dt.swapaxes(-1, -2), B, C

    def _scan_grads(self, dx, ddt, dB, dC, lead: tuple, steps: int) -> tuple:
        """``(dxBC, ddt)`` in the layer's layout from the scan's gradients (the inverse of ``_scan_inputs``)."""
        flat = [a.swapaxes(-2, -3).reshape(lead + (steps, -1)) for a in (dx, dB, dC)]
        return np.concatenate(flat, axis=-1), ddt.swapaxes(-1, -2)

    def _grouped(self, a: np.ndarray) -> np.ndarray:
        """``(B..., L, I) -> (B..., L, G, I / G)``: the norm's groups."""
        return a.reshape(a.shape[:-1] + (self.n_groups, -1))

    def _forward(self, x: np.ndarray, use_cache: bool = False, keep: np.ndarray | None = None) -> np.ndarray:
        lead, steps = x.shape[:-2], x.shape[-2]
        if keep is not None:
            x = x * keep  # padded steps: zero input, as transformers' apply_mask_to_padding_states
        proj = self.in_proj._forward(x)
        if self._proj_scale is not None:
            proj = proj * self._proj_scale
        z, xbc, dt = self._split_proj(proj)
        w, bias = self._conv_args()
        initial = self._conv_state if use_cache else None
        xbc, conv_cache = K.causal_conv1d(
            xbc, w, bias, activation="silu", initial_state=initial, output_final_state=use_cache
        )
        if keep is not None:
            xbc = xbc * keep  # and the convolution's output, as transformers masks it again
        xs, dts, B, C = self._scan_inputs(xbc, dt, lead, steps)
        y, scan_cache = K.mamba2_scan(
            xs,
            dts,
            -np.exp(self.A_log.data),
            B,
            C,
            self.D.data,
            self.dt_bias.data,
            time_step_limit=self.time_step_limit,
            initial_state=self._recurrent_state if use_cache else None,
            output_final_state=use_cache,
            chunk_size=self.chunk_size,
        )
        y = y.swapaxes(-2, -3).reshape(lead + (steps, self.intermediate_size))
        g, gate_cache = K.silu(z)
        h = u = n = norm_cache = None
        if self.gated_norm is None:  # out_proj(y silu(z))
            out = self.out_proj._forward(y * g)
        elif self.gated_norm == "gate_first":  # out_proj(rms(y silu(z)) w)
            h = y * g
            n, norm_cache = self._rms(h)
            out = self.out_proj._forward(n * self.norm.weight.data)
        else:  # "norm_first": out_proj(rms(y) w silu(z))
            n, norm_cache = self._rms(y)
            u = n * self.norm.weight.data
            out = self.out_proj._forward(u * g)
        if use_cache:
            self._keep_cache(lead, steps, conv_cache.final_state, scan_cache.final_state)
        else:
            self.save_for_backward(
                _State(lead, steps, conv_cache, scan_cache, y, gate_cache, g, h, norm_cache, n, keep, u)
            )
        return out

    def _rms(self, a: np.ndarray) -> tuple:
        """The per-group RMSNorm (no weight) of ``a (B..., L, I)``: ``(n, its cache)``."""
        n, cache = K.rms_norm(self._grouped(a), None, self.eps, normalized_shape=(a.shape[-1] // self.n_groups,))
        return n.reshape(a.shape), cache

    # -- backward -----------------------------------------------------------------------------
    def backward(self, dy) -> np.ndarray:
        """``dx (B..., L, hidden)``; every parameter's gradient is added into its ``.grad``.

        The chain, last step first: ``out_proj``; ``n * norm.weight``; the per-group RMSNorm;
        ``h = y silu(z)``: ``dy_scan = dh silu(z)``, ``dz = silu'(z) dh y``; the scan's backward
        (``dD``, ``ddt_bias``, ``dA`` and ``A = -exp(A_log)``: ``dA_log = dA A``); the mask; the
        convolution's (``dconv1d.weight``, ``dconv1d.bias``); ``in_proj`` on ``[dz dxBC ddt]``.
        """
        return self._backward(self._check_dy(dy))

    def _backward(self, dy: np.ndarray) -> np.ndarray:
        st: _State = self.pop_saved()
        lead, steps = st.lead, st.steps
        dout = self.out_proj._backward(dy)
        dnorm_w = None
        if self.gated_norm is None:  # out = y g
            dz, dys = K.silu_backward(dout * st.y, st.gate), dout * st.g
        elif self.gated_norm == "gate_first":  # out = rms(h) w, h = y g
            w = self.norm.weight.data
            dnorm_w = (dout * st.n).reshape(-1, w.shape[0]).sum(0)
            dh = K.rms_norm_backward(self._grouped(dout * w), st.norm)[0].reshape(st.y.shape)
            dz, dys = K.silu_backward(dh * st.y, st.gate), dh * st.g
        else:  # "norm_first": out = u g, u = rms(y) w
            w = self.norm.weight.data
            du = dout * st.g
            dz = K.silu_backward(dout * st.u, st.gate)
            dnorm_w = (du * st.n).reshape(-1, w.shape[0]).sum(0)
            dys = K.rms_norm_backward(self._grouped(du * w), st.norm)[0].reshape(st.y.shape)
        ys = dys.reshape(lead + (steps, self.num_heads, self.head_dim)).swapaxes(-2, -3)
        g = K.mamba2_scan_backward(ys, st.scan)  # (dx, ddt, dA, dB, dC, dD, ddt_bias, dinitial_state)
        dA, dD, ddt_bias = g[2], g[5], g[6]
        dxbc, ddt = self._scan_grads(g[0], g[1], g[3], g[4], lead, steps)
        if st.keep is not None:
            dxbc = dxbc * st.keep
        dxbc, dconv_w, dconv_b, _ = K.causal_conv1d_backward(dxbc, st.conv)
        dproj = np.concatenate([dz, dxbc, ddt], axis=-1)
        if self._proj_scale is not None:
            dproj *= self._proj_scale
        dx = self.in_proj._backward(dproj)
        if st.keep is not None:  # x * keep
            dx *= st.keep
        self.accumulate_grad(self.conv1d.weight, dconv_w[:, None, :])
        bias = getattr(self.conv1d, "bias", None)
        if bias is not None:
            self.accumulate_grad(bias, dconv_b)
        self.accumulate_grad(self.dt_bias, ddt_bias)
        self.accumulate_grad(self.A_log, dA * -np.exp(self.A_log.data))  # A = -exp(A_log): dA/dA_log = A
        self.accumulate_grad(self.D, dD)
        if dnorm_w is not None:
            self.accumulate_grad(self.norm.weight, dnorm_w)
        return dx

    # -- forward mode ---------------------------------------------------------------------------
    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: the forward's chain on tangents (``_stage_tangents``), then ``out_proj``'s."""
        t = self._stage_tangents(state, input_tangent(input_tangents, "Mamba2Mixer"), param_tangents)
        return self._child_jvp(self.out_proj, -1, (t.out,), param_tangents)

    def _stage_tangents(self, st: _State, tx, pt) -> _Tangents:
        """The tangents of the forward's stages up to ``out_proj``'s input: ``in_proj``'s split as
        the forward splits, the convolution's JVP (its weight's and bias's tangents), the mask, the
        scan's JVP (``tA = A tA_log``), ``th = ty silu(z) + y silu'(z) tz``, the per-group RMSNorm's
        JVP, ``t(n w) = tn w + n tw``; computed once per state and input tangent while ``pt``
        remembers (``loss_hvp``: ``jvp``, then ``backward_jvp``)."""

        def compute():
            lead, steps = st.lead, st.steps
            x = tx
            if x is None:
                x = np.zeros(lead + (steps, self.hidden_size), st.y.dtype)
            elif st.keep is not None:  # x * keep
                x = x * st.keep
            tproj = self._child_jvp(self.in_proj, -1, (x,), pt)
            if self._proj_scale is not None:
                tproj = tproj * self._proj_scale
            tz, txbc, tdt = self._split_proj(tproj)
            tw = pt.get(self.conv1d.weight)
            tw = None if tw is None else tw[:, 0, :]
            tb = pt.get(getattr(self.conv1d, "bias", None))
            tconv, conv_forward = K.causal_conv1d_jvp(st.conv, txbc, tw, tb, keep=True)
            if st.keep is not None:
                tconv = tconv * st.keep
            txs, tdts, tB, tC = self._scan_inputs(tconv, tdt, lead, steps)
            tA_log = pt.get(self.A_log)
            tA = None if tA_log is None else -np.exp(self.A_log.data) * tA_log
            scan = (txs, tdts, tA, tB, tC, pt.get(self.D), pt.get(self.dt_bias))
            ty = K.mamba2_scan_jvp(st.scan, *scan)
            ty = ty.swapaxes(-2, -3).reshape(st.y.shape)
            tg = K.silu_jvp(st.gate, tz)
            th = tn = tu = None
            if self.gated_norm is None:
                return _Tangents(x, tz, txbc, tw, tb, conv_forward, scan, ty, tg, th, tn, ty * st.g + st.y * tg)
            w, tnw = self.norm.weight.data, pt.get(self.norm.weight)
            if self.gated_norm == "gate_first":
                th = ty * st.g + st.y * tg
                tn = K.rms_norm_jvp(st.norm, self._grouped(th)).reshape(th.shape)
                tout = tn * w if tnw is None else tn * w + st.n * tnw
            else:  # "norm_first"
                tn = K.rms_norm_jvp(st.norm, self._grouped(ty)).reshape(ty.shape)
                tu = tn * w if tnw is None else tn * w + st.n * tnw
                tout = tu * st.g + st.u * tg
            return _Tangents(x, tz, txbc, tw, tb, conv_forward, scan, ty, tg, th, tn, tout, tu)

        return pt._remember((self, "stages", st, tx), compute)

    # -- second order ---------------------------------------------------------------------------
    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: the forward's tangents (``_stage_tangents``), then ``backward``'s chain in
        reverse, each product by the product rule and each op by its ``<op>_backward_jvp``:
        ``out_proj``; ``n w``: ``tdw = sum(tdnw n + dnw tn)``, ``tdn = tdnw w + dnw tw``; the
        per-group RMSNorm; ``h = y g``: ``tdy = tdh g + dh tg``, ``t(dh y) = tdh y + dh ty`` into
        silu's second order; the scan's; ``dA_log = dA A``: ``tdA_log = tdA A + dA tA``; the mask;
        the convolution's (its forward tangents from the JVP); ``in_proj``'s."""
        st: _State = state
        pt = param_tangents
        lead, steps = st.lead, st.steps
        t = self._stage_tangents(st, input_tangent(input_tangents, "Mamba2Mixer", "backward_jvp"), pt)
        dout, tdout = self._child_backward_jvp(self.out_proj, dy, (t.out,), pt, ddy)
        norm_pair = None
        if self.gated_norm is None:  # out = y g
            dz, tdz = K.silu_backward_jvp(dout * st.y, st.gate, (t.z,), tdout * st.y + dout * t.y)
            dys, tdys = dout * st.g, tdout * st.g + dout * t.g
        else:
            w, tnw = self.norm.weight.data, pt.get(self.norm.weight)
            if self.gated_norm == "gate_first":  # out = rms(h) w, h = y g
                dnw, tdnw, normed = dout, tdout, t.h
            else:  # "norm_first": out = u g, u = rms(y) w
                dnw, tdnw, normed = dout * st.g, tdout * st.g + dout * t.g, t.y
                dz, tdz = K.silu_backward_jvp(dout * st.u, st.gate, (t.z,), tdout * st.u + dout * t.u)
            dnorm_w = (dnw * st.n).reshape(-1, w.shape[0]).sum(0)
            tdnorm_w = (tdnw * st.n + dnw * t.n).reshape(-1, w.shape[0]).sum(0)
            norm_pair = (self.norm.weight, dnorm_w, tdnorm_w)
            dn, tdn = dnw * w, tdnw * w
            if tnw is not None:
                tdn = tdn + dnw * tnw
            (dh, _), (tdh, _) = K.rms_norm_backward_jvp(
                self._grouped(dn), st.norm, (self._grouped(normed), None), self._grouped(tdn)
            )
            dh, tdh = dh.reshape(st.y.shape), tdh.reshape(st.y.shape)
            if self.gated_norm == "gate_first":
                dz, tdz = K.silu_backward_jvp(dh * st.y, st.gate, (t.z,), tdh * st.y + dh * t.y)
                dys, tdys = dh * st.g, tdh * st.g + dh * t.g
            else:
                dys, tdys = dh, tdh
        heads = (self.num_heads, self.head_dim)
        ys, tys = (a.reshape(lead + (steps,) + heads).swapaxes(-2, -3) for a in (dys, tdys))
        grads, tgrads = K.mamba2_scan_backward_jvp(ys, st.scan, t.scan + (None,), tys)
        dxbc, ddt = self._scan_grads(grads[0], grads[1], grads[3], grads[4], lead, steps)
        tdxbc, tddt = self._scan_grads(tgrads[0], tgrads[1], tgrads[3], tgrads[4], lead, steps)
        if st.keep is not None:
            dxbc, tdxbc = dxbc * st.keep, tdxbc * st.keep
        (dxbc, dconv_w, dconv_b, _), (tdxbc, tdconv_w, tdconv_b, _) = K.causal_conv1d_backward_jvp(
            dxbc, st.conv, (t.xbc, t.conv_weight, t.conv_bias, None), tdxbc, forward=t.conv_forward
        )
        d = np.concatenate([dz, dxbc, ddt], axis=-1)
        td = np.concatenate([tdz, tdxbc, tddt], axis=-1)
        if self._proj_scale is not None:
            d *= self._proj_scale
            td *= self._proj_scale
        dx, tdx = self._child_backward_jvp(self.in_proj, d, (t.x,), pt, td)
        if st.keep is not None:  # x * keep
            dx, tdx = dx * st.keep, tdx * st.keep
        A = -np.exp(self.A_log.data)
        dA, tdA = grads[2], tgrads[2]
        tA = t.scan[2]
        self._accumulate_second(
            (
                (self.conv1d.weight, dconv_w[:, None, :], tdconv_w[:, None, :]),
                (getattr(self.conv1d, "bias", None), dconv_b, tdconv_b),
                (self.dt_bias, grads[6], tgrads[6]),
                (self.A_log, dA * A, tdA * A + (0.0 if tA is None else dA * tA)),
                (self.D, grads[5], tgrads[5]),
                norm_pair or (None, None, None),
            )
        )
        return dx, tdx
