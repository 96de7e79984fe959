"""``GatedDeltaNet``: Qwen3-Next's linear-attention layer (``linear_attn``), backward by hand.

The layer, as transformers' ``Qwen3NextGatedDeltaNet`` (shapes for one token; ``nk``/``nv`` key/value
heads, ``r = nv / nk`` value heads per key head, ``Dk``/``Dv`` head widths):

    [q k v z] = in_proj_qkvz(x)     grouped per key head: (nk, Dk + Dk + r Dv + r Dv)
    [b a]     = in_proj_ba(x)       grouped per key head: (nk, r + r)
    q, k, v   = silu(causal depthwise conv1d over the sequence of [q k v])   (K taps, no bias)
    beta      = sigmoid(b);   g = -exp(A_log) * softplus(a + dt_bias)       (per value head)
    o         = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)     key head h // r serves value head h
    y         = out_proj(RMSNormGated(o, z))    RMSNorm over Dv, times norm.weight, times silu(z)

Qwen3.5 (``projections="qkv_z_b_a"``) projects the same q, k, v, z, b, a with four separate
matrices, each in plain head order: ``in_proj_qkv`` (all q heads, all k heads, all v heads: the
convolution's channels as they are), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.

Parameters carry transformers' state-dict names (under ``linear_attn.`` in a decoder layer):
``in_proj_qkvz.weight (2 nk Dk + 2 nv Dv, hidden)``, ``in_proj_ba.weight (2 nv, hidden)`` (or
``in_proj_qkv.weight (2 nk Dk + nv Dv, hidden)``, ``in_proj_z.weight (nv Dv, hidden)``,
``in_proj_b.weight``, ``in_proj_a.weight (nv, hidden)``),
``conv1d.weight (2 nk Dk + nv Dv, 1, K)``, ``dt_bias (nv,)``, ``A_log (nv,)``, ``norm.weight (Dv,)``,
``out_proj.weight (hidden, nv Dv)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple, Optional

import numpy as np

from .._validate import (
    as_float,
    as_rng,
    check_bool,
    check_cache_batch,
    check_dtype,
    check_positive_float,
    check_size,
    to_numpy,
)
from ..functional import kernels as K
from ..functional.conv import CausalConv1dCache
from ..functional.delta_rule import GatedDeltaRuleCache, RMSNormGatedCache
from .layers import Linear, input_tangent
from .module import Module, Parameter, no_grad

__all__ = ["GatedDeltaNet"]

PROJECTIONS = ("qkvz_ba", "qkv_z_b_a")  # Qwen3-Next's two input projections, Qwen3.5's four
_SOFTPLUS_THRESHOLD = 20.0  # torch's F.softplus: the identity above it


class _Weights(Module):
    """A submodule that only holds parameters (and linear maps) for its parent (``conv1d.weight``,
    ``norm.weight``, Kimi's ``forget_gate.*``): the parent computes with them, so the state-dict
    keys are transformers' own."""

    def __init__(self, weight: Optional[Parameter] = None, *, owner: str = "GatedDeltaNet", **members) -> None:
        super().__init__()
        object.__setattr__(self, "_owner", owner)
        if weight is not None:
            self.weight = weight
        for name, member in members.items():
            setattr(self, name, member)

    def forward(self, *args, **kwargs):
        raise TypeError(f"this submodule holds its parent's parameters; call the {self._owner} itself")


class _State(NamedTuple):
    lead: tuple  # the batch shape
    steps: int
    conv: CausalConv1dCache
    rule: GatedDeltaRuleCache
    norm: RMSNormGatedCache
    beta: np.ndarray  # (B..., L, nv) sigmoid(b)
    g: np.ndarray  # (B..., L, nv)
    pre: np.ndarray  # (B..., L, nv) a + dt_bias, softplus's input
    keep: np.ndarray | None = None  # (B..., L, 1): 1 at a token, 0 at padding (attention_mask given)


class RecurrentLayer(Module):
    """What the linear-attention layers (``GatedDeltaNet``, ``KimiDeltaAttention``) share: the
    forward's checks of ``x``, ``use_cache`` and ``attention_mask`` (a subclass implements
    ``_forward(x, use_cache, keep)``), and the decoding cache of a convolution window and a
    recurrent state per head (``_conv_state``, ``_recurrent_state``), kept by ``_forward``."""

    _REPR_FIELDS: tuple[str, ...] = ("hidden_size",)
    hidden_size: int
    chunk_size: int
    conv1d: "_Weights"
    _conv_state: Optional[np.ndarray]
    _recurrent_state: Optional[np.ndarray]
    _cache_lead: Optional[tuple]
    _cache_length: int

    def _forward(self, x: np.ndarray, use_cache: bool = False, keep: np.ndarray | None = None) -> np.ndarray:
        raise NotImplementedError

    def extra_repr(self) -> str:
        """The arguments shown by ``repr(module)``: the attributes ``_REPR_FIELDS`` names."""
        return ", ".join(f"{name}={getattr(self, name)}" for name in self._REPR_FIELDS)

    def _convolve(self, mixed: np.ndarray, use_cache: bool) -> tuple:
        """The short causal convolution (SiLU) over ``mixed = [q k v]``, continuing from the kept
        window when ``use_cache``: ``(out, CausalConv1dCache)``."""
        initial = self._conv_state if use_cache else None
        w = self.conv1d.weight.data[:, 0, :]
        return K.causal_conv1d(mixed, w, activation="silu", initial_state=initial, output_final_state=use_cache)

    def _rule_options(self, use_cache: bool) -> dict:
        """The delta rule's options: the kept state when ``use_cache``, L2-normed q and k, the chunk."""
        initial = self._recurrent_state if use_cache else None
        return dict(initial_state=initial, output_final_state=use_cache, use_qk_l2norm=True, chunk_size=self.chunk_size)

    def _keep_cache(
        self, lead: tuple, steps: int, conv_state: Optional[np.ndarray], recurrent_state: Optional[np.ndarray]
    ) -> None:
        """After a cached call: the new convolution window and states, ``steps`` more tokens."""
        object.__setattr__(self, "_conv_state", conv_state)
        object.__setattr__(self, "_recurrent_state", recurrent_state)
        object.__setattr__(self, "_cache_lead", lead)
        object.__setattr__(self, "_cache_length", self._cache_length + steps)
        self.save_for_backward(None)

    # -- forward ------------------------------------------------------------------------------
    def forward(self, x, *, use_cache: bool = False, attention_mask=None) -> np.ndarray:
        """``x (B..., L, hidden)`` -> ``(B..., L, hidden)``; ``use_cache=True`` continues from (and
        updates) the decoding cache (see the class notes).

        ``attention_mask (B..., L)``: 1 (True) at a token, 0 (False) at padding.  Padded steps leave
        the layer untouched: their input is zeroed (transformers' ``apply_mask_to_padding_states``,
        so the convolution sees zeros there, as before a sequence's start) and their decay and
        write strength are ``g = 0``, ``beta = 0``, so the recurrent state passes them unchanged
        (``S <- e^0 S + 0``, whatever the state); their output is 0, and no gradient or tangent
        reaches anything through them (a per-channel decay likewise: ``g = 0`` in every channel)."""
        x = as_float(x, "x", self.dtype)
        if x.ndim < 2 or x.shape[-1] != self.hidden_size or x.shape[-2] < 1:
            raise ValueError(f"x: expected shape (..., L, {self.hidden_size}) with L >= 1, got {x.shape}")
        use_cache = check_bool(use_cache, "use_cache")
        if use_cache and self._cache_lead is not None:
            check_cache_batch(self._cache_lead, x.shape, "x", "decoding cache")
        keep = None
        if attention_mask is not None:
            m = to_numpy(attention_mask, "attention_mask")
            if m.shape != x.shape[:-1]:
                raise ValueError(f"attention_mask: expected shape {x.shape[:-1]} (x's without hidden), got {m.shape}")
            if m.dtype != bool and not (m.dtype.kind in "iuf" and np.isin(m, (0, 1)).all()):
                raise ValueError("attention_mask: expected 1/True at tokens and 0/False at padding")
            keep = m.astype(self.dtype)[..., None]
        if use_cache:
            with no_grad():  # a cached call keeps nothing for backward
                return self._forward(x, use_cache=True, keep=keep)
        return self._forward(x, keep=keep)

    # -- decoding cache -------------------------------------------------------------------------
    def reset_kv_cache(self) -> None:
        """Empty the decoding cache (convolution window and recurrent states): start a new sequence."""
        object.__setattr__(self, "_conv_state", None)
        object.__setattr__(self, "_recurrent_state", None)
        object.__setattr__(self, "_cache_lead", None)
        object.__setattr__(self, "_cache_length", 0)

    reset_cache = reset_kv_cache

    # What a npattn.generation.PromptCache asks (as npattn.nn.kv_cache._KeysCacheHooks): a state
    # cannot be cut back, so the end of a prompt is remembered as the state itself (the arrays are
    # replaced by each call, never written into) and rewinding goes there or stays where it is.
    def _cache_state(self) -> tuple:
        return (self._conv_state, self._recurrent_state, self._cache_lead, self._cache_length)

    def _set_cache_state(self, state: tuple) -> None:
        for name, value in zip(("_conv_state", "_recurrent_state", "_cache_lead", "_cache_length"), state):
            object.__setattr__(self, name, value)

    def _cache_mark(self, n: int) -> tuple:
        return self._cache_state()

    def _can_rewind(self, n: int, mark) -> bool:
        return n == self._cache_length or (mark is not None and mark[3] == n)

    def _rewind_cache(self, n: int, mark) -> None:
        if n != self._cache_length:
            self._set_cache_state(mark)

    def _rewinds_anywhere(self) -> bool:
        return False

    @property
    def kv_cache_length(self) -> int:
        """The number of tokens decoded since the last reset (0 when the cache is empty)."""
        return self._cache_length

    @property
    def recurrent_state(self) -> Optional[np.ndarray]:
        """The cached delta-rule states ``(B..., heads, Dk, Dv)`` (None when the cache is empty)."""
        return self._recurrent_state

    @property
    def conv_state(self) -> Optional[np.ndarray]:
        """The cached convolution inputs ``(B..., K - 1, channels)`` (None when empty)."""
        return self._conv_state


class GatedDeltaNet(RecurrentLayer):
    """Gated DeltaNet, Qwen3-Next's linear attention layer: ``(B..., L, hidden) -> (B..., L, hidden)``.

    The constructor takes the fields of a Hugging Face ``Qwen3NextConfig`` by their names (their
    defaults are that config's); :meth:`from_config` reads them from a config mapping.

    Parameters
    ----------
    hidden_size : int
        The model width.
    linear_num_value_heads : int
        ``nv``, the heads of the delta rule (of v, z, beta, g and the state).
    linear_num_key_heads : int
        ``nk``, the heads of q and k; must divide ``nv``: key head ``h // (nv / nk)`` serves value
        head ``h`` (as grouped-query attention shares keys).
    linear_key_head_dim, linear_value_head_dim : int
        ``Dk`` and ``Dv``; each head's state is ``(Dk, Dv)``.
    linear_conv_kernel_dim : int
        ``K``, the taps of the short causal convolution over ``[q k v]``.
    rms_norm_eps : float
        The eps of the gated RMSNorm on the output.
    hidden_act : str
        The convolution's activation: ``"silu"`` (Qwen3-Next's; ``"swish"``, its other name in
        transformers, is accepted too), the only one supported.
    projections : str
        ``"qkvz_ba"`` (Qwen3-Next: ``in_proj_qkvz`` and ``in_proj_ba``, grouped per key head) or
        ``"qkv_z_b_a"`` (Qwen3.5: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``,
        each in head order); the same layer otherwise.
    chunk_size : int
        The delta rule's chunk length (any value gives the same numbers; see
        ``npattn.functional.gated_delta_rule``).
    rng, dtype
        As every module.  Initialisation as transformers: the projections as ``torch.nn.Linear``
        (no bias), the convolution as ``torch.nn.Conv1d`` (U(-1/sqrt(K), 1/sqrt(K))), ``dt_bias``
        ones, ``A_log = log(U(0.01, 16))``, ``norm.weight`` ones.

    Notes
    -----
    ``forward(x, use_cache=True)`` decodes incrementally: the layer keeps the last ``K - 1``
    convolution inputs and each head's state and continues from them, so feeding a sequence in
    pieces (token by token or in chunks) gives the outputs of one full pass.  Such a call keeps
    nothing for backward (as ``MultiHeadAttention``'s KV cache); ``reset_kv_cache()`` starts a
    new sequence.  transformers computes the delta rule, the gate and the norm in float32 for
    bf16/fp16 models; here everything runs in the module's dtype.

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> net = npattn.GatedDeltaNet(16, linear_num_value_heads=2, linear_num_key_heads=1,
    ...                            linear_key_head_dim=4, linear_value_head_dim=4, rng=0)
    >>> x = np.random.default_rng(1).standard_normal((2, 5, 16))
    >>> y = net(x)
    >>> y.shape, net.backward(np.ones_like(y)).shape
    ((2, 5, 16), (2, 5, 16))
    """

    _REPR_FIELDS = ("hidden_size", "num_v_heads", "num_k_heads", "head_k_dim", "head_v_dim", "conv_kernel_size")

    def __init__(
        self,
        hidden_size: int,
        linear_num_value_heads: int = 32,
        linear_num_key_heads: int = 16,
        linear_key_head_dim: int = 128,
        linear_value_head_dim: int = 128,
        linear_conv_kernel_dim: int = 4,
        rms_norm_eps: float = 1e-6,
        hidden_act: str = "silu",
        projections: str = "qkvz_ba",
        *,
        chunk_size: int = 64,
        rng=None,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        self.hidden_size = check_size(hidden_size, "hidden_size")
        self.num_v_heads = check_size(linear_num_value_heads, "linear_num_value_heads")
        self.num_k_heads = check_size(linear_num_key_heads, "linear_num_key_heads")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads: expected a multiple of linear_num_key_heads={self.num_k_heads}, "
                f"got {self.num_v_heads}"
            )
        self.head_k_dim = check_size(linear_key_head_dim, "linear_key_head_dim")
        self.head_v_dim = check_size(linear_value_head_dim, "linear_value_head_dim")
        self.conv_kernel_size = check_size(linear_conv_kernel_dim, "linear_conv_kernel_dim")
        self.eps = check_positive_float(rms_norm_eps, "rms_norm_eps", allow_zero=True)
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act: expected 'silu' (Qwen3-Next's) or 'swish', got {hidden_act!r}")
        if projections not in PROJECTIONS:
            raise ValueError(f"projections: expected one of {list(PROJECTIONS)}, got {projections!r}")
        self.projections = projections
        self.chunk_size = check_size(chunk_size, "chunk_size")
        self._dtype = dt = check_dtype(dtype)
        rng = as_rng(rng)
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        bound = 1.0 / math.sqrt(self.conv_kernel_size)
        conv_w = rng.uniform(-bound, bound, (self.conv_dim, 1, self.conv_kernel_size))
        self.conv1d = _Weights(Parameter(conv_w, dt))
        if projections == "qkvz_ba":
            qkvz = 2 * self.key_dim + 2 * self.value_dim
            self.in_proj_qkvz = Linear(self.hidden_size, qkvz, False, rng=rng, dtype=dt)
            self.in_proj_ba = Linear(self.hidden_size, 2 * self.num_v_heads, False, rng=rng, dtype=dt)
        else:
            self.in_proj_qkv = Linear(self.hidden_size, self.conv_dim, False, rng=rng, dtype=dt)
            self.in_proj_z = Linear(self.hidden_size, self.value_dim, False, rng=rng, dtype=dt)
            self.in_proj_b = Linear(self.hidden_size, self.num_v_heads, False, rng=rng, dtype=dt)
            self.in_proj_a = Linear(self.hidden_size, self.num_v_heads, False, rng=rng, dtype=dt)
        self.dt_bias = Parameter(np.ones(self.num_v_heads), dt)
        self.A_log = Parameter(np.log(rng.uniform(0.01, 16.0, self.num_v_heads)), dt)
        self.norm = _Weights(Parameter(np.ones(self.head_v_dim), dt))
        self.out_proj = Linear(self.value_dim, self.hidden_size, False, rng=rng, dtype=dt)
        self.reset_kv_cache()

    @classmethod
    def from_config(cls, config: Mapping, **kwargs) -> "GatedDeltaNet":
        """A layer from a Hugging Face ``Qwen3NextConfig`` as a mapping (``config.to_dict()``).

        A compatibility wrapper: ``npattn.models.configs.delta_net_config(config)`` reads the
        arguments (a ``DeltaNetConfig``), which are then passed to the constructor, as ``CausalLM``
        does.  Reads ``hidden_size`` (required) and the ``linear_*`` fields, ``rms_norm_eps``,
        ``hidden_act`` where present (transformers' defaults, which are the constructor's, where
        not); ``kwargs`` (``chunk_size``, ``rng``, ``dtype``) pass through.
        """
        from ..models.configs import delta_net_config  # models sits above nn: imported when called

        return cls(**delta_net_config(config).kwargs(), **kwargs)

    def _forward(self, x: np.ndarray, use_cache: bool = False, keep: np.ndarray | None = None) -> np.ndarray:
        nk, nv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        r = nv // nk
        lead, steps = x.shape[:-2], x.shape[-2]
        if keep is not None:
            x = x * keep  # padded steps: zero input (convolution window and projections)
        mixed, z, b, a = self._projected(lambda m: m._forward(x), lead, steps)
        conv_out, conv_cache = self._convolve(mixed, use_cache)
        q = conv_out[..., : self.key_dim].reshape(lead + (steps, nk, dk))
        k = conv_out[..., self.key_dim : 2 * self.key_dim].reshape(lead + (steps, nk, dk))
        v = conv_out[..., 2 * self.key_dim :].reshape(lead + (steps, nv, dv))
        beta = 0.5 * (1.0 + np.tanh(0.5 * b))  # sigmoid(b), without overflow
        pre = a + self.dt_bias.data
        g = -np.exp(self.A_log.data) * _softplus(pre)
        g_in, beta_in = (g, beta) if keep is None else (g * keep, beta * keep)  # padding: S unchanged
        heads = (-2, -3)  # (B..., L, heads, D) <-> (B..., heads, L, D)
        o, rule_cache = K.gated_delta_rule(
            np.repeat(q, r, axis=-2).swapaxes(*heads),
            np.repeat(k, r, axis=-2).swapaxes(*heads),
            v.swapaxes(*heads),
            g_in.swapaxes(-1, -2),
            beta_in.swapaxes(-1, -2),
            scale=1.0 / math.sqrt(dk),
            **self._rule_options(use_cache),
        )
        y, norm_cache = K.rms_norm_gated(o.swapaxes(*heads), z, self.norm.weight.data, self.eps)
        out = self.out_proj._forward(y.reshape(lead + (steps, self.value_dim)))
        if use_cache:
            self._keep_cache(lead, steps, conv_cache.final_state, rule_cache.final_state)
        else:
            self.save_for_backward(
                _State(
                    lead=lead,
                    steps=steps,
                    conv=conv_cache,
                    rule=rule_cache,
                    norm=norm_cache,
                    beta=beta,
                    g=g,
                    pre=pre,
                    keep=keep,
                )  # fmt: skip
            )
        return out

    # -- the input projections ------------------------------------------------------------------
    def _projected(self, run, lead: tuple, steps: int):
        """``(mixed (B..., L, 2 nk Dk + nv Dv), z (B..., L, nv, Dv), b, a (B..., L, nv))`` from
        ``run(linear)``, each input projection's output (the forward's, or its tangent): ``mixed``
        is ``[q k v]`` in transformers' order for the convolution (all q heads, all k heads, all v
        heads).  Qwen3-Next's two projections are grouped per key head and regrouped here;
        Qwen3.5's four are in that order already."""
        nk, nv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        if self.projections == "qkv_z_b_a":
            z = run(self.in_proj_z).reshape(lead + (steps, nv, dv))
            return run(self.in_proj_qkv), z, run(self.in_proj_b), run(self.in_proj_a)
        r = nv // nk
        qkvz = run(self.in_proj_qkvz).reshape(lead + (steps, nk, 2 * dk + 2 * r * dv))
        ba = run(self.in_proj_ba).reshape(lead + (steps, nk, 2 * r))
        mixed = np.concatenate(
            [
                qkvz[..., :dk].reshape(lead + (steps, self.key_dim)),
                qkvz[..., dk : 2 * dk].reshape(lead + (steps, self.key_dim)),
                qkvz[..., 2 * dk : 2 * dk + r * dv].reshape(lead + (steps, self.value_dim)),
            ],
            axis=-1,
        )
        z = qkvz[..., 2 * dk + r * dv :].reshape(lead + (steps, nv, dv))
        return mixed, z, ba[..., :r].reshape(lead + (steps, nv)), ba[..., r:].reshape(lead + (steps, nv))

    def _projected_grads(self, dmixed, dz, db, da, lead: tuple, steps: int) -> list:
        """``[(projection, the gradient at its output)]`` from the gradients of ``_projected``'s
        four outputs (or their tangents: the regrouping is linear)."""
        nk, nv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        if self.projections == "qkv_z_b_a":
            dz = dz.reshape(lead + (steps, self.value_dim))
            return [(self.in_proj_qkv, dmixed), (self.in_proj_z, dz), (self.in_proj_b, db), (self.in_proj_a, da)]
        r = nv // nk
        dqkvz = np.empty(lead + (steps, nk, 2 * dk + 2 * r * dv), dmixed.dtype)
        dqkvz[..., :dk] = dmixed[..., : self.key_dim].reshape(lead + (steps, nk, dk))
        dqkvz[..., dk : 2 * dk] = dmixed[..., self.key_dim : 2 * self.key_dim].reshape(lead + (steps, nk, dk))
        dqkvz[..., 2 * dk : 2 * dk + r * dv] = dmixed[..., 2 * self.key_dim :].reshape(lead + (steps, nk, r * dv))
        dqkvz[..., 2 * dk + r * dv :] = dz.reshape(lead + (steps, nk, r * dv))
        dba = np.concatenate([db.reshape(lead + (steps, nk, r)), da.reshape(lead + (steps, nk, r))], axis=-1).reshape(
            lead + (steps, 2 * nv)
        )
        return [(self.in_proj_qkvz, dqkvz.reshape(lead + (steps, -1))), (self.in_proj_ba, dba)]

    def _projected_backward(self, dmixed, dz, db, da, lead: tuple, steps: int) -> np.ndarray:
        """``dx`` of the input projections (their weights' gradients accumulated) from the
        gradients of ``_projected``'s four outputs."""
        pairs = self._projected_grads(dmixed, dz, db, da, lead, steps)
        dx = pairs[0][0]._backward(pairs[0][1])
        for m, d in pairs[1:]:
            dx += m._backward(d)
        return dx

    # -- backward -----------------------------------------------------------------------------
    def backward(self, dy) -> np.ndarray:
        """``dx (B..., L, hidden)``; every parameter's gradient is added into its ``.grad``.

        The chain, last step first: ``out_proj``; the gated norm (``dx``, ``dz``, ``dnorm.weight``);
        the delta rule's chunked backward (``dq, dk, dv, dg, dbeta``), each key head's gradient the
        sum over the ``r`` value heads it served; ``beta = sigmoid(b)``: ``db = dbeta beta (1 - beta)``;
        ``g = -exp(A_log) softplus(a + dt_bias)``: ``dA_log = sum dg g``, ``da = ddt_bias =
        -dg exp(A_log) sigmoid(a + dt_bias)`` (summed over tokens for ``dt_bias``); the
        convolution's backward (``dconv1d.weight``); the two input projections, whose input
        gradients add up.
        """
        dy = self._check_dy(dy)
        return self._backward(dy)

    def _backward(self, dy: np.ndarray) -> np.ndarray:
        nk, nv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        r = nv // nk
        st: _State = self.pop_saved()
        lead, steps, beta = st.lead, st.steps, st.beta
        heads = (-2, -3)
        dn = self.out_proj._backward(dy).reshape(lead + (steps, nv, dv))
        do, dz, dnorm_w = K.rms_norm_gated_backward(dn, st.norm)
        dq, dk_, dv_, dg, dbeta, _ = K.gated_delta_rule_backward(do.swapaxes(*heads), st.rule)
        dq = dq.swapaxes(*heads).reshape(lead + (steps, nk, r, dk)).sum(-2)  # the r value heads of each key head
        dk_ = dk_.swapaxes(*heads).reshape(lead + (steps, nk, r, dk)).sum(-2)
        dg, dbeta = dg.swapaxes(-1, -2), dbeta.swapaxes(-1, -2)  # (B..., L, nv)
        if st.keep is not None:  # g * keep, beta * keep
            dg, dbeta = dg * st.keep, dbeta * st.keep
        db = dbeta * beta * (1.0 - beta)
        dA_log = (dg * st.g).reshape(-1, nv).sum(0)  # dg/dA_log = -exp(A_log) softplus = g
        da = -dg * np.exp(self.A_log.data) * _softplus_grad(st.pre)
        ddt_bias = da.reshape(-1, nv).sum(0)
        dconv = np.concatenate(
            [
                dq.reshape(lead + (steps, self.key_dim)),
                dk_.reshape(lead + (steps, self.key_dim)),
                dv_.swapaxes(*heads).reshape(lead + (steps, self.value_dim)),
            ],
            axis=-1,
        )
        dmixed, dconv_w, _, _ = K.causal_conv1d_backward(dconv, st.conv)
        dx = self._projected_backward(dmixed, dz, db, da, lead, steps)
        if st.keep is not None:  # x * keep
            dx *= st.keep
        self.accumulate_grad(self.conv1d.weight, dconv_w[:, None, :])
        self.accumulate_grad(self.dt_bias, ddt_bias)
        self.accumulate_grad(self.A_log, dA_log)
        self.accumulate_grad(self.norm.weight, dnorm_w)
        return dx

    # -- second order ---------------------------------------------------------------------------
    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order (``backward_jvp``): the forward's tangents (``_forward_tangents``, the
        rule's and the gated norm's JVPs for ``out_proj``'s input), then ``backward``'s chain in
        reverse, each stage by its ``<op>_backward_jvp`` fed the tangents of its inputs and of its
        upstream gradient: ``out_proj``, ``rms_norm_gated``, the chunked
        ``gated_delta_rule_backward_jvp`` (the key heads' sums over their value heads), then the
        gates by the product rule: ``db = dbeta s'`` with ``s' = beta (1 - beta)``, ``ts' = (1 -
        2 beta) tbeta``; ``dA_log = sum dg g``; ``da = -dg e^{A_log} sigma(p)`` with ``sigma' =
        sigma (1 - sigma)`` (0 above softplus' threshold); ``causal_conv1d_backward_jvp``; the
        input projections."""
        st: _State = state
        nk, nv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        r = nv // nk
        lead, steps, beta, pt = st.lead, st.steps, st.beta, param_tangents
        heads = (-2, -3)
        t, to, ty, rule_forward = self._output_tangents(st, input_tangents, pt, "backward_jvp")
        nw = self.norm.weight
        dn, tdn = self._child_backward_jvp(self.out_proj, dy, (ty.reshape(lead + (steps, self.value_dim)),), pt, ddy)
        shape = lead + (steps, nv, dv)
        (do, dz, dnw), (tdo, tdz, tdnw) = K.rms_norm_gated_backward_jvp(
            dn.reshape(shape), st.norm, (to, t.z, pt.get(nw)), tdn.reshape(shape)
        )
        grads, tans = K.gated_delta_rule_backward_jvp(
            do.swapaxes(*heads), st.rule, t.rule, tdo.swapaxes(*heads), forward=rule_forward
        )
        (dq, dk_, dv_, dg, dbeta), (tdq, tdk, tdv, tdg, tdbeta) = grads[:5], tans[:5]
        dq, tdq, dk_, tdk = (x.swapaxes(*heads).reshape(lead + (steps, nk, r, dk)).sum(-2) for x in (dq, tdq, dk_, tdk))
        dg, tdg, dbeta, tdbeta = (x.swapaxes(-1, -2) for x in (dg, tdg, dbeta, tdbeta))  # (B..., L, nv)
        if st.keep is not None:  # g * keep, beta * keep
            dg, tdg, dbeta, tdbeta = (x * st.keep for x in (dg, tdg, dbeta, tdbeta))
        # beta = sigmoid(b): db = dbeta s', s' = beta (1 - beta), ts' = (1 - 2 beta) tbeta
        db = dbeta * beta * (1.0 - beta)  # as the backward rounds it
        tdb = tdbeta * beta * (1.0 - beta) + dbeta * (1.0 - 2.0 * beta) * t.beta
        # g = -exp(A_log) softplus(p): dA_log = sum dg g, da = -dg exp(A_log) sigma(p)
        dA_log = (dg * st.g).reshape(-1, nv).sum(0)
        tdA_log = (tdg * st.g + dg * t.g).reshape(-1, nv).sum(0)
        e, sig = np.exp(self.A_log.data), _softplus_grad(st.pre)
        da = -dg * e * sig
        tda = -tdg * e * sig - dg * e * _softplus_second(st.pre) * t.pre
        if t.A_log is not None:
            tda -= dg * e * t.A_log * sig
        dconv, tdconv = (
            np.concatenate(
                [
                    q.reshape(lead + (steps, self.key_dim)),
                    k.reshape(lead + (steps, self.key_dim)),
                    v.swapaxes(*heads).reshape(lead + (steps, self.value_dim)),
                ],
                axis=-1,
            )
            for q, k, v in ((dq, dk_, dv_), (tdq, tdk, tdv))
        )
        tw = t.conv_weight
        (dmixed, dconv_w, _, _), (tdmixed, tdconv_w, _, _) = K.causal_conv1d_backward_jvp(
            dconv, st.conv, (t.mixed, None if tw is None else tw[:, 0, :], None, None), tdconv, forward=t.conv_forward
        )
        dx = tdx = None
        for (m, d), (_, td) in zip(
            self._projected_grads(dmixed, dz, db, da, lead, steps),
            self._projected_grads(tdmixed, tdz, tdb, tda, lead, steps),
        ):
            mdx, mtdx = self._child_backward_jvp(m, d, (t.x,), pt, td)
            dx, tdx = (mdx, mtdx) if dx is None else (dx + mdx, tdx + mtdx)
        if st.keep is not None:  # x * keep
            dx, tdx = dx * st.keep, tdx * st.keep
        self._accumulate_second(
            (
                (self.conv1d.weight, dconv_w[:, None, :], tdconv_w[:, None, :]),
                (self.dt_bias, da.reshape(-1, nv).sum(0), tda.reshape(-1, nv).sum(0)),
                (self.A_log, dA_log, tdA_log),
                (nw, dnw, tdnw),
            )
        )
        return dx, tdx

    # -- forward mode ---------------------------------------------------------------------------
    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode (``m.jvp(tx, param_tangents=...)``): the forward's chain run on tangents.
        The projections, the convolution, the delta rule and the gated norm each give their JVP;
        ``beta = sigmoid(b)``: ``tbeta = beta (1 - beta) tb``; ``g = -exp(A_log) softplus(p)``,
        ``p = a + dt_bias``: ``tg = g tA_log - exp(A_log) sigmoid(p) (ta + tdt_bias)``; each key
        head's tangent is repeated for the value heads it serves, as its value in the forward."""
        st: _State = state
        ty = self._output_tangents(st, input_tangents, param_tangents, "jvp")[2]
        return self._child_jvp(self.out_proj, -1, (ty.reshape(st.lead + (st.steps, self.value_dim)),), param_tangents)

    def _output_tangents(self, st: _State, input_tangents, pt, method: str) -> tuple:
        """``(stages, to, ty, rule_forward)``: ``_forward_tangents``, the delta rule's output tangent
        (heads before steps, as the gated norm takes it), the gated norm's (``out_proj``'s input)
        and what the rule's JVP keeps for its second order along the same tangents (the states'
        tangents, which ``gated_delta_rule_backward_jvp`` then takes instead of computing them
        again), from the unchecked input tangents of ``jvp`` / ``backward_jvp`` (``method``);
        computed once per state and tangents while ``pt`` remembers (``loss_hvp``)."""

        def compute():
            t = self._forward_tangents(st, input_tangent(input_tangents, "GatedDeltaNet", method), pt)
            to, rule_forward = K.gated_delta_rule_jvp(st.rule, *t.rule, keep=True)
            to = to.swapaxes(-2, -3)
            return t, to, K.rms_norm_gated_jvp(st.norm, to, t.z, pt.get(self.norm.weight)), rule_forward

        return pt._remember((self, "stages", st) + tuple(input_tangents), compute)

    def _forward_tangents(self, st: _State, tx, pt) -> "_Tangents":
        """The tangents of the forward's stages up to the delta rule's inputs (``_jvp``'s chain)."""
        nk, nv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        r = nv // nk
        lead, steps = st.lead, st.steps
        if tx is None:
            tx = np.zeros(lead + (steps, self.hidden_size), st.beta.dtype)
        elif st.keep is not None:  # x * keep
            tx = tx * st.keep
        tmixed, tz, tb, ta = self._projected(lambda m: self._child_jvp(m, -1, (tx,), pt), lead, steps)
        tw = pt.get(self.conv1d.weight)
        tconv, conv_forward = K.causal_conv1d_jvp(st.conv, tmixed, None if tw is None else tw[:, 0, :], keep=True)
        tq = tconv[..., : self.key_dim].reshape(lead + (steps, nk, dk))
        tk = tconv[..., self.key_dim : 2 * self.key_dim].reshape(lead + (steps, nk, dk))
        tv = tconv[..., 2 * self.key_dim :].reshape(lead + (steps, nv, dv))
        tbeta = tb * st.beta * (1.0 - st.beta)
        tpre = ta
        tdt = pt.get(self.dt_bias)
        if tdt is not None:
            tpre = tpre + tdt
        tg = -np.exp(self.A_log.data) * _softplus_grad(st.pre) * tpre
        tA_log = pt.get(self.A_log)
        if tA_log is not None:
            tg += st.g * tA_log
        tg_in, tbeta_in = (tg, tbeta) if st.keep is None else (tg * st.keep, tbeta * st.keep)  # g * keep, beta * keep
        heads = (-2, -3)
        rule = (
            np.repeat(tq, r, axis=-2).swapaxes(*heads),
            np.repeat(tk, r, axis=-2).swapaxes(*heads),
            tv.swapaxes(*heads),
            tg_in.swapaxes(-1, -2),
            tbeta_in.swapaxes(-1, -2),
        )
        return _Tangents(
            x=tx,
            mixed=tmixed,
            z=tz,
            conv_weight=tw,
            conv_forward=conv_forward,
            beta=tbeta,
            g=tg,
            pre=tpre,
            A_log=tA_log,
            rule=rule,
        )


class _Tangents(NamedTuple):
    """The forward's tangents ``GatedDeltaNet._forward_tangents`` gives, by stage."""

    x: np.ndarray  # the input's (masked as the input)
    mixed: np.ndarray  # [q k v] before the convolution
    z: np.ndarray  # the output gate
    conv_weight: Optional[np.ndarray]  # conv1d.weight's (C, 1, taps), None: zero
    conv_forward: tuple  # the convolution's JVP's (tz, txp), for its second order (forward=)
    beta: np.ndarray  # beta's, unmasked
    g: np.ndarray  # g's, unmasked
    pre: np.ndarray  # a + dt_bias's
    A_log: Optional[np.ndarray]
    rule: tuple  # gated_delta_rule's (tq, tk, tv, tg, tbeta), as the rule takes them


def _softplus(x):
    """``log(1 + e^x)``, and ``x`` itself above 20 (torch's ``F.softplus`` threshold)."""
    return np.where(x > _SOFTPLUS_THRESHOLD, x, np.logaddexp(0.0, np.minimum(x, _SOFTPLUS_THRESHOLD)))


def _softplus_grad(x):
    """``sigmoid(x)``, and 1 above the threshold (torch's softplus backward)."""
    return np.where(x > _SOFTPLUS_THRESHOLD, 1.0, 0.5 * (1.0 + np.tanh(0.5 * x))).astype(x.dtype)


def _softplus_second(x):
    """softplus'' = ``sigmoid'(x) = sigmoid (1 - sigmoid)``, and 0 above the threshold (where
    softplus is the identity)."""
    sig = _softplus_grad(x)
    return np.where(x > _SOFTPLUS_THRESHOLD, 0.0, sig * (1.0 - sig))
