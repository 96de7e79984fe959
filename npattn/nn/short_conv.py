"""``ShortConv``: LFM2's gated short-convolution layer (transformers' ``Lfm2ShortConv``), backward by hand.

The layer, for ``x (B..., L, H)``:

    [B C x'] = in_proj(x)                 three chunks of H features each
    z        = conv(B * x')               a causal depthwise conv1d over the sequence (K taps, bias optional)
    y        = out_proj(C * z)

The convolution is ``npattn.functional.causal_conv1d`` without an activation (Gated DeltaNet's,
which applies SiLU).  Parameters carry transformers' state-dict names (under ``conv.`` in a
decoder layer): ``conv.weight (H, 1, K)``, ``conv.bias (H,)`` with ``conv_bias``,
``in_proj.weight (3H, H)``, ``out_proj.weight (H, H)`` and their biases with ``conv_bias``.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np

from .._validate import as_rng, check_bool, check_dtype, check_size
from ..functional import kernels as K
from ..functional.conv import CausalConv1dCache
from .delta_net import RecurrentLayer, _Weights
from .layers import Linear, input_tangent
from .module import Parameter

__all__ = ["ShortConv"]


class _State(NamedTuple):
    lead: tuple  # the batch shape
    steps: int
    b: np.ndarray  # (B..., L, H) the chunks of in_proj(x)
    c: np.ndarray
    xs: np.ndarray
    z: np.ndarray  # (B..., L, H) conv(b * xs)
    conv: CausalConv1dCache
    keep: np.ndarray | None = None  # (B..., L, 1): 1 at a token, 0 at padding (attention_mask given)


class _Tangents(NamedTuple):
    """The forward's tangents by stage (``ShortConv._stage_tangents``)."""

    x: np.ndarray  # the input's (masked as the input)
    b: np.ndarray
    c: np.ndarray
    xs: np.ndarray
    bx: np.ndarray  # the convolution's input's
    weight: Optional[np.ndarray]  # conv.weight's as the op takes it (H, K), None: zero
    bias: Optional[np.ndarray]
    z: np.ndarray
    conv_forward: tuple  # the convolution's JVP's (tz, txp), for its second order (forward=)
    y: np.ndarray  # out_proj's input's


class ShortConv(RecurrentLayer):
    """LFM2's gated short convolution: ``(B..., L, hidden) -> (B..., L, hidden)``.

    ``out_proj(C * conv(B * x'))`` with ``[B C x'] = in_proj(x)`` and ``conv`` a causal depthwise
    convolution of ``conv_L_cache`` taps over the sequence (transformers' ``Lfm2ShortConv``).

    Parameters
    ----------
    hidden_size : int
        The model width ``H`` (the convolution's channels).
    conv_L_cache : int
        ``K``, the convolution's taps (LFM2's ``conv_L_cache``, 3 in its releases).
    conv_bias : bool
        Biases on the convolution and on both projections (LFM2's ``conv_bias``).
    rng, dtype
        As every module.  Initialisation as torch's ``Linear`` and ``Conv1d`` (the convolution's
        weight and bias U(-1/sqrt(K), 1/sqrt(K))).

    Notes
    -----
    ``forward(x, use_cache=True)`` decodes incrementally: the layer keeps the last ``K - 1``
    inputs of the convolution (``conv_state``) and continues from them, so feeding a sequence in
    pieces gives the outputs of one full pass.  Such a call keeps nothing for backward;
    ``reset_kv_cache()`` starts a new sequence.  ``attention_mask`` zeroes the padded steps' input
    (transformers' ``apply_mask_to_padding_states``), as GatedDeltaNet's; with ``conv_bias`` the
    projection of that zero is the bias, which transformers convolves too.

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> conv = npattn.ShortConv(8, conv_L_cache=3, rng=0)
    >>> x = np.random.default_rng(1).standard_normal((2, 5, 8))
    >>> y = conv(x)
    >>> y.shape, conv.backward(np.ones_like(y)).shape
    ((2, 5, 8), (2, 5, 8))
    """

    _REPR_FIELDS = ("hidden_size", "conv_L_cache", "conv_bias")

    def __init__(
        self,
        hidden_size: int,
        conv_L_cache: int = 3,
        conv_bias: bool = False,
        *,
        rng=None,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        self.hidden_size = h = check_size(hidden_size, "hidden_size")
        self.conv_L_cache = taps = check_size(conv_L_cache, "conv_L_cache")
        self.conv_bias = bias = check_bool(conv_bias, "conv_bias")
        self._dtype = dt = check_dtype(dtype)
        rng = as_rng(rng)
        bound = 1.0 / math.sqrt(taps)
        weight = Parameter(rng.uniform(-bound, bound, (h, 1, taps)), dt)
        members = {"bias": Parameter(rng.uniform(-bound, bound, h), dt)} if bias else {}
        self.conv = _Weights(weight, owner="ShortConv", **members)
        self.in_proj = Linear(h, 3 * h, bias, rng=rng, dtype=dt)
        self.out_proj = Linear(h, h, bias, rng=rng, dtype=dt)
        self.reset_kv_cache()

    def _bias(self) -> Optional[Parameter]:
        """``conv.bias`` (None without ``conv_bias``)."""
        return getattr(self.conv, "bias", None)

    def _conv_args(self) -> tuple:
        """``(weight (H, K), bias or None)`` as ``causal_conv1d`` takes them."""
        bias = self._bias()
        return self.conv.weight.data[:, 0, :], (None if bias is None else bias.data)

    def _split(self, bcx: np.ndarray) -> tuple:
        h = self.hidden_size
        return bcx[..., :h], bcx[..., h : 2 * h], bcx[..., 2 * h :]

    def _forward(self, x: np.ndarray, use_cache: bool = False, keep: np.ndarray | None = None) -> np.ndarray:
        lead, steps = x.shape[:-2], x.shape[-2]
        if keep is not None:
            x = x * keep  # padded steps: zero input, as transformers' apply_mask_to_padding_states
        b, c, xs = self._split(self.in_proj._forward(x))
        w, bias = self._conv_args()
        initial = self._conv_state if use_cache else None
        z, conv_cache = K.causal_conv1d(b * xs, w, bias, initial_state=initial, output_final_state=use_cache)
        out = self.out_proj._forward(c * z)
        if use_cache:
            self._keep_cache(lead, steps, conv_cache.final_state, None)
        else:
            self.save_for_backward(_State(lead, steps, b, c, xs, z, conv_cache, keep))
        return out

    # -- backward -----------------------------------------------------------------------------
    def backward(self, dy) -> np.ndarray:
        """``dx (B..., L, hidden)``; every parameter's gradient is added into its ``.grad``.

        The chain, last step first: ``out_proj``; ``y = C z``: ``dC = dy z``, ``dz = dy C``; the
        convolution's backward (``dconv.weight``, ``dconv.bias``, ``d(B x')``); ``B x'``:
        ``dB = d(Bx') x'``, ``dx' = d(Bx') B``; ``in_proj`` on ``[dB dC dx']``.
        """
        return self._backward(self._check_dy(dy))

    def _backward(self, dy: np.ndarray) -> np.ndarray:
        st: _State = self.pop_saved()
        dyc = self.out_proj._backward(dy)
        dbx, dw, dbias, _ = K.causal_conv1d_backward(dyc * st.c, st.conv)
        dx = self.in_proj._backward(np.concatenate([dbx * st.xs, dyc * st.z, dbx * st.b], axis=-1))
        if st.keep is not None:  # x * keep
            dx *= st.keep
        self.accumulate_grad(self.conv.weight, dw[:, None, :])
        bias = self._bias()
        if bias is not None:
            self.accumulate_grad(bias, dbias)
        return dx

    # -- forward mode ---------------------------------------------------------------------------
    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: ``in_proj``'s tangent split as the forward splits, ``t(B x') = tB x' +
        B tx'``, the convolution's JVP (with the tangents of its weight and bias), ``ty = tC z +
        C tz``, then ``out_proj``'s."""
        t = self._stage_tangents(state, input_tangent(input_tangents, "ShortConv"), param_tangents)
        return self._child_jvp(self.out_proj, -1, (t.y,), param_tangents)

    def _stage_tangents(self, st: _State, tx, pt) -> _Tangents:
        """The tangents of the forward's stages up to ``out_proj``'s input, computed once per
        state and input tangent while ``pt`` remembers (``loss_hvp``: ``jvp``, then ``backward_jvp``)."""

        def compute():
            x = tx
            if x is None:
                x = np.zeros(st.lead + (st.steps, self.hidden_size), st.z.dtype)
            elif st.keep is not None:  # x * keep
                x = x * st.keep
            tb, tc, txs = self._split(self._child_jvp(self.in_proj, -1, (x,), pt))
            tbx = tb * st.xs + st.b * txs
            tw = pt.get(self.conv.weight)
            tw = None if tw is None else tw[:, 0, :]
            bias = self._bias()
            tbias = None if bias is None else pt.get(bias)
            tz, conv_forward = K.causal_conv1d_jvp(st.conv, tbx, tw, tbias, keep=True)
            ty = tc * st.z + st.c * tz
            return _Tangents(x, tb, tc, txs, tbx, tw, tbias, tz, conv_forward, ty)

        return pt._remember((self, "stages", st, tx), compute)

    # -- second order ---------------------------------------------------------------------------
    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: the forward's tangents (``_stage_tangents``), then ``backward``'s chain
        in reverse, each product by the product rule: ``out_proj``'s ``backward_jvp``; ``dC = dy
        z``: ``tdC = tdy z + dy tz``; ``dz = dy C``: ``tdz = tdy C + dy tC``;
        ``causal_conv1d_backward_jvp`` (its forward tangents from the JVP); ``dB = d(Bx') x'``,
        ``dx' = d(Bx') B`` likewise; ``in_proj``'s ``backward_jvp``."""
        st: _State = state
        pt = param_tangents
        tx = input_tangent(input_tangents, "ShortConv", "backward_jvp")
        t = self._stage_tangents(st, tx, pt)
        dyc, tdyc = self._child_backward_jvp(self.out_proj, dy, (t.y,), pt, ddy)
        (dbx, dw, dbias, _), (tdbx, tdw, tdbias, _) = K.causal_conv1d_backward_jvp(
            dyc * st.c, st.conv, (t.bx, t.weight, t.bias, None), tdyc * st.c + dyc * t.c, forward=t.conv_forward
        )
        d = np.concatenate([dbx * st.xs, dyc * st.z, dbx * st.b], axis=-1)
        td = np.concatenate([tdbx * st.xs + dbx * t.xs, tdyc * st.z + dyc * t.z, tdbx * st.b + dbx * t.b], axis=-1)
        dx, tdx = self._child_backward_jvp(self.in_proj, d, (t.x,), pt, td)
        if st.keep is not None:  # x * keep
            dx, tdx = dx * st.keep, tdx * st.keep
        self._accumulate_second(
            (
                (self.conv.weight, dw[:, None, :], tdw[:, None, :]),
                (self._bias(), dbias, tdbias),
            )
        )
        return dx, tdx
