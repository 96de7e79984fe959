"""The golden file of round 4: outputs, gradients and tangents of every public op and module.

``python tests/golden/record.py`` runs every case of ``CASES`` in float64 and float32 and writes
``tests/golden/round4.npz`` with the keys ``"<case>/<name>/<dtype>"``; ``tests/test_golden.py``
recomputes the same cases and compares (float64 to 1e-13, float32 to 1e-6 of the largest element).
Recorded before the redesign of issue 29 so that it can show that nothing changed for users.

Only public names are used (``npattn.functional``'s and ``npattn.functional.reference``'s
``__all__``, the modules' constructors, ``forward``/``backward``/``jvp``, ``named_parameters``,
``state_dict``/``load_state_dict``, ``zero_grad``, ``reset_kv_cache``), so the file survives a
redesign of the internals.  Each case is a small function ``case(dtype) -> {name: ndarray}``:

* a functional pair (both tiers, cases ``functional.<op>.<variant>`` and
  ``reference.<op>.<variant>`` on the same inputs): the forward's outputs (``out*``), the
  backward's gradients for a random upstream gradient (``grad*``, in the backward's order) and the
  JVP along random tangents (``jvp*``);
* a module (``nn.*``, ``book.*``, ``TinyTransformer``) or a CausalLM family (``family.*``): the
  output, its tangent along random input and parameter tangents (``jvp``), the input gradients
  (``dx*``) and every parameter's gradient by name (``grad.<name>``) for a random upstream
  gradient, and for the decoders the logits of cached decoding (``decode``).

Everything is seeded (``np.random.default_rng`` of a fixed number per case, and per parameter
name for the parameters and their tangents, so that neither depends on the order in which a module
lists its parameters or draws its initialisation: each module's parameters are overwritten with
``load_state_dict``).  Dropout takes int seeds only.  Float32 inputs are the float64 ones rounded.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import numpy as np

import npattn
import npattn.book as book
import npattn.functional as F
import npattn.functional.reference as R
from npattn import masks, nn, optim
from npattn.generation import generate
from npattn.models import CausalLM

GOLDEN = Path(__file__).resolve().parent / "round4.npz"
DTYPES = (np.float64, np.float32)
CASES: list = []


def _seed(*parts: str) -> list:
    return [zlib.crc32(p.encode()) for p in parts]


def _rng(*parts: str) -> np.random.Generator:
    return np.random.default_rng(_seed(*parts))


def _randn(rng, shape, dtype, scale=1.0):
    return np.asarray(rng.standard_normal(shape) * scale).astype(dtype)


def _copy(a):
    return np.array(a, copy=True)


def _name(fn, name):
    fn.__name__ = fn.__qualname__ = name
    return fn


# --------------------------------------------------------------------------------------------
# functional pairs, both tiers
# --------------------------------------------------------------------------------------------


def _run_pair(tier, op, make, bwd_extra, case, dtype):
    """Forward, backward (random upstream gradient) and JVP (random tangents) of ``tier.op``."""
    fwd, bwd, jvp = (getattr(tier, op + s) for s in ("", "_backward", "_jvp"))

    def forward():  # the inputs drawn afresh from the case's seed: the same in both tiers
        args, kwargs = make(_rng(case), dtype)
        return fwd(*args, **kwargs)

    res = {}
    out, cache = forward()
    outs = out if isinstance(out, tuple) else (out,)
    for i, o in enumerate(outs):
        res[f"out{i}"] = _copy(o)
    final = getattr(cache, "final_state", None)
    if final is not None:
        res["final_state"] = _copy(final)
    rng = _rng(case, "upstream")
    dout = _randn(rng, outs[0].shape, outs[0].dtype)
    extra = bwd_extra(rng, cache) if bwd_extra is not None else ()
    grads = bwd(dout, cache, *extra)
    grads = grads if isinstance(grads, tuple) else (grads,)
    for i, g in enumerate(grads):
        if g is not None:
            res[f"grad{i}"] = _copy(g)
    # the JVP from a fresh forward's cache (a backward need not leave its cache usable)
    _, cache = forward()
    rng = _rng(case, "tangents")
    tangents = tuple(None if g is None else _randn(rng, g.shape, g.dtype) for g in grads)
    t = jvp(cache, *tangents)
    for i, ti in enumerate(t if isinstance(t, tuple) else (t,)):
        res[f"jvp{i}"] = _copy(ti)
    return res


def pair(op, variant, make, bwd_extra=None):
    """Register ``functional.<op>.<variant>`` and ``reference.<op>.<variant>``: ``make(rng, dtype)
    -> (args, kwargs)`` of ``op``'s forward; ``bwd_extra(rng, cache)`` the backward's further
    arguments."""
    case = f"{op}.{variant}"
    for prefix, tier in (("functional", F), ("reference", R)):

        def run(dtype, tier=tier):
            return _run_pair(tier, op, make, bwd_extra, case, dtype)

        CASES.append(_name(run, f"{prefix}.{case}"))


def _n(rng, dtype, *shape, scale=1.0):
    return _randn(rng, shape, dtype, scale)


# linear, embedding
pair("linear", "bias", lambda r, d: ((_n(r, d, 2, 3, 5), _n(r, d, 4, 5), _n(r, d, 4)), {}))
pair("linear", "nobias", lambda r, d: ((_n(r, d, 3, 5), _n(r, d, 4, 5)), {}))
pair("embedding", "plain", lambda r, d: ((r.integers(0, 7, (2, 5)), _n(r, d, 7, 4)), {}))
pair(
    "embedding",
    "padding_freq",
    lambda r, d: (
        (np.array([[2, 1, 1, 5], [2, 6, 1, 0]]), _n(r, d, 7, 4)),
        dict(padding_idx=2, scale_grad_by_freq=True),
    ),
)
pair(
    "embedding",
    "max_norm",
    lambda r, d: ((np.array([[0, 3, 3], [6, 2, 4]]), _n(r, d, 7, 4)), dict(max_norm=1.5, norm_type=3.0)),
)
# activations, softmax, dropout
pair("softmax", "last", lambda r, d: ((_n(r, d, 2, 3, 6),), {}))
pair("softmax", "axis1_large", lambda r, d: ((_n(r, d, 2, 4, 3, scale=40.0),), dict(axis=1)))
pair("relu", "plain", lambda r, d: ((_n(r, d, 3, 7),), {}))
pair("gelu", "none", lambda r, d: ((_n(r, d, 3, 7, scale=2.0),), {}))
pair("gelu", "tanh", lambda r, d: ((_n(r, d, 3, 7, scale=2.0),), dict(approximate="tanh")))
pair("silu", "plain", lambda r, d: ((_n(r, d, 3, 7, scale=2.0),), {}))
pair("dropout", "p03", lambda r, d: ((_n(r, d, 3, 4, 5), 0.3), dict(rng=11)))
# norms
pair("layer_norm", "affine", lambda r, d: ((_n(r, d, 2, 3, 6), 1 + _n(r, d, 6, scale=0.3), _n(r, d, 6)), {}))
pair("layer_norm", "plain_eps", lambda r, d: ((_n(r, d, 2, 3, 6, scale=0.1),), dict(eps=1e-3)))
pair(
    "layer_norm",
    "two_axes",
    lambda r, d: ((_n(r, d, 2, 3, 4, 5), 1 + _n(r, d, 4, 5, scale=0.3), _n(r, d, 4, 5)), {}),
)
pair("rms_norm", "weight", lambda r, d: ((_n(r, d, 2, 3, 6), 1 + _n(r, d, 6, scale=0.3)), {}))
pair("rms_norm", "plain_eps", lambda r, d: ((_n(r, d, 2, 3, 6, scale=0.1),), dict(eps=1e-4)))
pair("rms_norm", "two_axes", lambda r, d: ((_n(r, d, 2, 3, 4, 5),), dict(normalized_shape=(4, 5))))
pair("l2_norm", "plain", lambda r, d: ((_n(r, d, 2, 3, 5),), {}))
pair(
    "rms_norm_gated",
    "plain",
    lambda r, d: ((_n(r, d, 2, 3, 5), _n(r, d, 2, 3, 5), 1 + _n(r, d, 5, scale=0.3)), {}),
)


# cross-entropy
def _ce_ids(r, d):
    return (_n(r, d, 2, 5, 7, scale=2.0), r.integers(0, 7, (2, 5))), {}


def _ce_ignore(r, d):
    t = r.integers(0, 7, (2, 5))
    t[0, 1] = t[1, 3] = -100
    return (_n(r, d, 2, 5, 7, scale=2.0), t), dict(ignore_index=-100, weight=r.random(7).astype(d), label_smoothing=0.1)


def _ce_probs(r, d):
    p = np.exp(r.standard_normal((2, 5, 7)))
    return (_n(r, d, 2, 5, 7, scale=2.0), (p / p.sum(-1, keepdims=True)).astype(d)), dict(reduction="none")


def _ce_sum(r, d):
    return (_n(r, d, 4, 7, scale=2.0), r.integers(0, 7, 4)), dict(ignore_index=3, reduction="sum")


pair("cross_entropy", "ids_mean", _ce_ids)
pair("cross_entropy", "ignore_weight_smoothing", _ce_ignore)
pair("cross_entropy", "probs_none", _ce_probs)
pair("cross_entropy", "sum", _ce_sum)

# rope
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4, "beta_fast": 32.0, "beta_slow": 1.0}
_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 4,
}
pair("rope", "default", lambda r, d: ((_n(r, d, 2, 3, 5, 8),), {}))
pair(
    "rope",
    "interleaved_offset",
    lambda r, d: ((_n(r, d, 2, 3, 5, 8), np.arange(5) + 3), dict(base=500.0, interleaved=True)),
)
pair(
    "rope",
    "per_sequence_positions",
    lambda r, d: ((_n(r, d, 2, 3, 5, 8), r.integers(0, 20, (2, 1, 5))), {}),
)
pair("rope", "yarn_partial", lambda r, d: ((_n(r, d, 2, 3, 5, 8),), dict(scaling=_YARN, rotary_dim=4)))
pair("rope", "llama3", lambda r, d: ((_n(r, d, 2, 5, 8), np.arange(5) * 3), dict(scaling=_LLAMA3)))
pair("rope", "linear", lambda r, d: ((_n(r, d, 2, 5, 8),), dict(scaling={"rope_type": "linear", "factor": 2.0})))
pair(
    "rope",
    "dynamic",
    lambda r, d: (
        (_n(r, d, 2, 6, 8),),
        dict(scaling={"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 4}),
    ),
)


def rope_frequencies(dtype):
    """``rope_frequencies``, ``rope_softmax_scale`` and ``yarn_mscale`` (no backward: forward only)."""
    res = {}
    for name, scaling in (
        ("default", None),
        ("linear", {"rope_type": "linear", "factor": 2.0}),
        ("yarn", _YARN),
        ("yarn_mscale", dict(_YARN, mscale=0.7, mscale_all_dim=0.9)),
        ("llama3", _LLAMA3),
        ("dynamic", {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 4}),
    ):
        inv, factor = F.rope_frequencies(8, 500.0, scaling, seq_len=9)
        res[f"{name}.inv_freq"] = np.asarray(inv)
        res[f"{name}.attention_factor"] = np.asarray(factor)
        res[f"{name}.softmax_scale"] = np.asarray(F.rope_softmax_scale(0.25, scaling))
    res["yarn_mscale"] = np.asarray([F.yarn_mscale(s, m) for s in (0.5, 1.0, 4.0, 40.0) for m in (1.0, 0.707)])
    return res


CASES.append(_name(rope_frequencies, "functional.rope_frequencies"))


# attention cores (the same variants for both; the memory-efficient one in blocks of 2)
def _qkv(r, d, q_shape, k_shape, v_last=None):
    v_shape = k_shape[:-1] + (v_last or k_shape[-1],)
    return _n(r, d, *q_shape), _n(r, d, *k_shape), _n(r, d, *v_shape)


def _att_plain(r, d):
    return _qkv(r, d, (2, 3, 5, 4), (2, 3, 5, 4)), {}


def _att_no_head_axis(r, d):
    return _qkv(r, d, (2, 5, 4), (2, 6, 4), 3), dict(scale=0.8)


def _att_causal(r, d):
    return _qkv(r, d, (2, 3, 5, 4), (2, 3, 5, 4), 3), dict(is_causal=True)


def _att_gqa_bottom_right(r, d):
    return _qkv(r, d, (2, 4, 3, 4), (2, 2, 6, 4)), dict(is_causal=True, causal_align="bottom_right", enable_gqa=True)


def _att_bool_mask(r, d):
    mask = r.random((5, 6)) < 0.6
    mask[0] = False  # a row that sees nothing: output 0, gradient 0
    return _qkv(r, d, (2, 3, 5, 4), (2, 3, 6, 4)), dict(attn_mask=mask)


def _att_float_mask_grad(r, d):
    return _qkv(r, d, (2, 3, 5, 4), (2, 3, 6, 4)), dict(attn_mask=_n(r, d, 1, 3, 5, 6), mask_grad=True)


def _att_broadcast_batch(r, d):
    return _qkv(r, d, (2, 3, 5, 4), (1, 3, 6, 4)), {}


def _att_window_alibi(r, d):
    return _qkv(r, d, (2, 3, 6, 4), (2, 3, 6, 4)), dict(window=(2, 1), alibi_slopes=r.random(3).astype(d), scale=0.7)


def _att_softcap_sinks(r, d):
    (q, k, v) = _qkv(r, d, (2, 3, 5, 4), (2, 3, 6, 4))
    return (q * d(3), k, v), dict(softcap=2.0, sinks=_n(r, d, 3))


def _att_everything(r, d):
    args = _qkv(r, d, (2, 4, 4, 4), (2, 2, 7, 4), 3)
    return args, dict(
        attn_mask=_n(r, d, 4, 7),
        mask_grad=True,
        is_causal=True,
        causal_align="bottom_right",
        enable_gqa=True,
        window=(3, 0),
        alibi_slopes=r.random((2, 4)).astype(d),
        softcap=3.0,
        sinks=_n(r, d, 4),
    )


def _att_dropout(r, d):
    return _qkv(r, d, (2, 3, 5, 4), (2, 3, 6, 4)), dict(dropout_p=0.3, rng=5)


for _variant, _make in (
    ("plain", _att_plain),
    ("no_head_axis", _att_no_head_axis),
    ("causal", _att_causal),
    ("gqa_bottom_right", _att_gqa_bottom_right),
    ("bool_mask_empty_row", _att_bool_mask),
    ("float_mask_grad", _att_float_mask_grad),
    ("broadcast_batch", _att_broadcast_batch),
    ("window_alibi_scale", _att_window_alibi),
    ("softcap_sinks", _att_softcap_sinks),
    ("everything", _att_everything),
    ("dropout", _att_dropout),
):
    pair("scaled_dot_product_attention", _variant, _make)

    def _blocked(r, d, make=_make):
        args, kwargs = make(r, d)
        return args, dict(kwargs, block_size=2)

    pair("memory_efficient_attention", _variant, _blocked)


# gated delta rule, causal conv1d
def _delta(r, d, h=2, length=7):
    q, k, v = _qkv(r, d, (2, h, length, 4), (2, h, length, 4), 3)
    g = (-r.random((2, h, length)) * 0.7).astype(d)
    beta = r.random((2, h, length)).astype(d)
    return q, k, v, g, beta


def _final_state_grad(r, cache):
    return (_randn(r, cache.final_state.shape, cache.final_state.dtype),)


pair("gated_delta_rule", "plain", lambda r, d: (_delta(r, d), {}))
pair("gated_delta_rule", "chunks_of_3", lambda r, d: (_delta(r, d), dict(chunk_size=3)))
pair(
    "gated_delta_rule",
    "l2norm_state",
    lambda r, d: (
        _delta(r, d),
        dict(
            scale=0.3,
            use_qk_l2norm=True,
            initial_state=_n(r, d, 2, 2, 4, 3),
            output_final_state=True,
            chunk_size=3,
        ),
    ),
    _final_state_grad,
)
pair(
    "causal_conv1d",
    "bias_silu",
    lambda r, d: ((_n(r, d, 2, 6, 3), _n(r, d, 3, 4), _n(r, d, 3)), dict(activation="silu")),
)
pair(
    "causal_conv1d",
    "state",
    lambda r, d: ((_n(r, d, 2, 6, 3), _n(r, d, 3, 4)), dict(initial_state=_n(r, d, 2, 3, 3), output_final_state=True)),
)


# mixture of experts
def _distinct_indices(r, n_tokens, n_experts, k):
    return np.stack([r.permutation(n_experts)[:k] for _ in range(n_tokens)])


pair("topk_router", "softmax_norm", lambda r, d: ((_n(r, d, 2, 5, 6), 2), dict(norm_topk_prob=True)))
pair("topk_router", "topk_softmax", lambda r, d: ((_n(r, d, 2, 5, 6), 2), dict(variant="topk_softmax")))
pair(
    "topk_router",
    "sigmoid_groups",
    lambda r, d: (
        (_n(r, d, 2, 5, 6), 2),
        dict(
            variant="sigmoid",
            norm_topk_prob=True,
            correction_bias=_n(r, d, 6, scale=0.3),
            n_group=3,
            topk_group=2,
            routed_scaling_factor=2.5,
        ),
    ),
)


def _moe_swiglu(r, d, activation="silu"):
    x, i = _n(r, d, 2, 3, 5), _distinct_indices(r, 6, 4, 2).reshape(2, 3, 2)
    w, gu, dn = r.random((2, 3, 2)).astype(d), _n(r, d, 4, 6, 5, scale=0.5), _n(r, d, 4, 5, 3, scale=0.5)
    return (x, i, w, gu, dn), dict(activation=activation)


def _moe_gpt_oss(r, d):
    x, i = _n(r, d, 6, 5), _distinct_indices(r, 6, 4, 2)
    w, gu, dn = r.random((6, 2)).astype(d), _n(r, d, 4, 5, 6), _n(r, d, 4, 3, 5)
    return (x, i, w, gu, dn, _n(r, d, 4, 6), _n(r, d, 4, 5)), dict(kind="gpt_oss", alpha=1.5, limit=1.2)


pair("moe_experts", "swiglu", _moe_swiglu)
pair("moe_experts", "swiglu_gelu_tanh", lambda r, d: _moe_swiglu(r, d, "gelu_tanh"))
pair("moe_experts", "gpt_oss_clamped", _moe_gpt_oss)


# --------------------------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------------------------


def _param_value(case, name, shape, dtype):
    r = _rng(case, "param", name)
    if len(shape) >= 2:
        return _randn(r, shape, dtype, 1.0 / np.sqrt(shape[-1]))
    return (1.0 + 0.25 * r.standard_normal(shape)).astype(dtype)


def set_params(m, case):
    """Every parameter drawn from a seed of (case, its name), loaded with ``load_state_dict``."""
    sd = m.state_dict()
    for name, p in m.named_parameters():
        sd[name] = _param_value(case, name, p.data.shape, p.data.dtype)
    m.load_state_dict(sd)
    return m


def param_tangents(m, case):
    return {name: _randn(_rng(case, "tangent", name), p.data.shape, p.data.dtype) for name, p in m.named_parameters()}


def _is_float(a):
    return isinstance(a, np.ndarray) and np.issubdtype(a.dtype, np.floating)


# The key projection's bias adds ``q . b_k`` to every score of a query's row, which the softmax
# cancels: its gradient is zero (where neither RoPE, a q/k norm nor a softcap acts between, as in
# every case here that has it) and the computed one rounding noise, so it is checked, not recorded.
_ZERO_GRADS = ("W_key.bias",)


def run_module(m, case, inputs, **kwargs):
    """Output, JVP (every input and parameter moving), input and parameter gradients of ``m``."""
    set_params(m, case)
    res = {}
    y = m(*inputs, **kwargs)
    ys = y if isinstance(y, tuple) else (y,)
    for i, yi in enumerate(ys):
        res["out" if i == 0 else f"out{i}"] = _copy(yi)
    r = _rng(case, "input tangents")
    tin = tuple(_randn(r, a.shape, a.dtype) if _is_float(a) else None for a in inputs)
    res["jvp"] = _copy(m.jvp(*tin, param_tangents=param_tangents(m, case)))
    dy = _randn(_rng(case, "upstream"), ys[0].shape, ys[0].dtype)
    m.zero_grad()
    dx = m.backward(dy)
    for i, g in enumerate(dx if isinstance(dx, tuple) else (dx,)):
        if g is not None:
            res[f"dx{i}"] = _copy(g)
    scale = max((float(np.max(np.abs(p.grad))) for _, p in m.named_parameters() if p.grad is not None), default=0.0)
    for name, p in m.named_parameters():
        if p.grad is None:
            continue
        if name.endswith(_ZERO_GRADS):
            tol = 1e-12 if p.grad.dtype == np.float64 else 1e-5
            assert float(np.max(np.abs(p.grad))) <= tol * scale, f"{case}: {name}'s gradient is not zero"
        else:
            res[f"grad.{name}"] = _copy(p.grad)
    return res


def module(name, build, make_inputs=None, decode=None, **kwargs):
    """Register the case ``name``: ``build(dtype)`` a module, ``make_inputs(rng, dtype)`` its
    forward's positional inputs (default: one ``(2, 5, 8)`` array), ``kwargs`` its forward's
    keyword arguments; ``decode(m, inputs)`` the outputs of a cached decoding, if any."""

    def run(dtype):
        r = _rng(name, "inputs")
        inputs = make_inputs(r, dtype) if make_inputs is not None else (_n(r, dtype, 2, 5, 8),)
        m = build(dtype)
        res = run_module(m, name, inputs, **kwargs)
        if decode is not None:
            with npattn.no_grad():
                res["decode"] = _copy(decode(m, inputs))
        return res

    CASES.append(_name(run, name))


def _steps(m, x, first=3, **kw):
    """The outputs of a cached decoding: ``first`` tokens, then one at a time."""
    m.reset_kv_cache()
    out = [m(x[:, :first], use_cache=True, **kw)] + [
        m(x[:, t : t + 1], use_cache=True, **kw) for t in range(first, x.shape[1])
    ]
    m.reset_kv_cache()
    return np.concatenate(out, axis=1)


module("nn.Linear", lambda d: nn.Linear(8, 6, rng=0, dtype=d))
module(
    "nn.Linear.nobias_unbatched", lambda d: nn.Linear(8, 6, bias=False, rng=0, dtype=d), lambda r, d: (_n(r, d, 5, 8),)
)
module("nn.LayerNorm", lambda d: nn.LayerNorm(8, dtype=d))
module("nn.LayerNorm.two_axes_nobias", lambda d: nn.LayerNorm((5, 8), bias=False, dtype=d))
module("nn.RMSNorm", lambda d: nn.RMSNorm(8, dtype=d))
module("nn.RMSNorm.eps", lambda d: nn.RMSNorm(8, eps=1e-3, dtype=d))
module("nn.Embedding", lambda d: nn.Embedding(11, 8, rng=0, dtype=d), lambda r, d: (r.integers(0, 11, (2, 5)),))
module(
    "nn.Embedding.padding_freq",
    lambda d: nn.Embedding(11, 8, padding_idx=3, scale_grad_by_freq=True, rng=0, dtype=d),
    lambda r, d: (np.array([[3, 1, 1, 5, 3], [0, 1, 10, 3, 2]]),),
)
module(
    "nn.Embedding.max_norm",
    lambda d: nn.Embedding(11, 8, max_norm=1.0, rng=0, dtype=d),
    lambda r, d: (np.array([[4, 1, 1, 5, 9], [0, 7, 10, 4, 2]]),),
)
module("nn.Dropout", lambda d: nn.Dropout(0.3, rng=123))
for _act in ("relu", "gelu", "gelu_tanh", "silu", "swiglu"):
    module(f"nn.FeedForward.{_act}", lambda d, a=_act: nn.FeedForward(8, 12, activation=a, rng=0, dtype=d))
module("nn.FeedForward.nobias", lambda d: nn.FeedForward(8, 12, bias=False, rng=0, dtype=d))
module(
    "nn.Sequential",
    lambda d: nn.Sequential(nn.Linear(8, 6, rng=0, dtype=d), nn.LayerNorm(6, dtype=d), nn.Linear(6, 4, rng=0, dtype=d)),
)


# multi-head attention
def _mha(d, heads=4, **kw):
    return nn.MultiHeadAttention(8, 8, heads, rng=0, dtype=d, **kw)


def _x(length=6, width=8):
    return lambda r, d: (_n(r, d, 2, length, width),)


module("nn.MultiHeadAttention.plain", lambda d: _mha(d))
module("nn.MultiHeadAttention.causal_qkv_bias", lambda d: _mha(d, causal=True, qkv_bias=True, out_bias=False))
module(
    "nn.MultiHeadAttention.gqa_rope_qk_norm",
    lambda d: _mha(d, 2, causal=True, num_kv_heads=1, rope=True, rope_base=100.0, qk_norm=True),
    _x(),
    decode=lambda m, x: _steps(m, x[0]),
)
module(
    "nn.MultiHeadAttention.window_alibi_softcap_sinks",
    lambda d: _mha(d, causal=True, window=(2, 0), alibi=True, softcap=1.5, sinks=True),
    _x(),
    decode=lambda m, x: _steps(m, x[0]),
)
module(
    "nn.MultiHeadAttention.bidirectional_window",
    lambda d: _mha(d, window=(1, 2), alibi=True),
    _x(),
)
module(
    "nn.MultiHeadAttention.memory_efficient",
    lambda d: _mha(d, causal=True, num_kv_heads=2, memory_efficient=True, window=(3, 0), sinks=True, rope=True),
    _x(),
    decode=lambda m, x: _steps(m, x[0]),
)
module(
    "nn.MultiHeadAttention.family_style",
    lambda d: _mha(
        d,
        causal=True,
        num_kv_heads=2,
        head_dim=4,
        scale=0.3,
        rope=True,
        rope_scaling=_YARN,
        partial_rotary_factor=0.5,
        qk_norm=True,
        qk_norm_eps=1e-5,
        qk_norm_unit_offset=True,
        output_gate=True,
    ),
    _x(),
    decode=lambda m, x: _steps(m, x[0]),
)
module(
    "nn.MultiHeadAttention.bottom_right_masks",
    lambda d: _mha(d, causal=True, causal_align="bottom_right"),
    _x(),
    attn_mask=np.array([[True] * 6] * 5 + [[True, False] * 3]),
    key_padding_mask=np.array([[False] * 6, [True, False, False, False, False, False]]),
)


def _cross_inputs(r, d):
    return _n(r, d, 2, 4, 8), _n(r, d, 2, 6, 5), _n(r, d, 2, 6, 3)


module(
    "nn.MultiHeadAttention.cross_kdim_vdim_masks",
    lambda d: _mha(d, kdim=5, vdim=3, qkv_bias=True),
    _cross_inputs,
    attn_mask=np.random.default_rng(1).standard_normal((4, 6)),
    key_padding_mask=np.array([[False] * 5 + [True], [False] * 6]),
)
module(
    "nn.MultiHeadAttention.need_weights_bias_kv_zero_attn",
    lambda d: _mha(d, add_bias_kv=True, add_zero_attn=True),
    _x(),
    need_weights=True,
    average_attn_weights=True,
)
module("nn.MultiHeadAttention.unbatched", lambda d: _mha(d, causal=True), lambda r, d: (_n(r, d, 5, 8),))


# blocks
module("nn.EncoderBlock.post_norm", lambda d: nn.EncoderBlock(8, 2, 12, dropout=0.0, rng=0, dtype=d))
module(
    "nn.EncoderBlock.pre_norm_gelu_causal",
    lambda d: nn.EncoderBlock(
        8, 2, 12, dropout=0.0, activation="gelu", norm_first=True, causal=True, qkv_bias=True, rng=0, dtype=d
    ),
    key_padding_mask=np.array([[False] * 5, [False, False, False, True, True]]),
)
module(
    "nn.EncoderBlock.nobias",
    lambda d: nn.EncoderBlock(8, 2, 12, dropout=0.0, bias=False, rng=0, dtype=d),
)


def _decoder_inputs(r, d):
    return _n(r, d, 2, 5, 8), _n(r, d, 2, 4, 8)


module("nn.DecoderBlock.post_norm", lambda d: nn.DecoderBlock(8, 2, 12, dropout=0.0, rng=0, dtype=d), _decoder_inputs)
module(
    "nn.DecoderBlock.pre_norm_causal_masks",
    lambda d: nn.DecoderBlock(8, 2, 12, dropout=0.0, activation="gelu", norm_first=True, causal=True, rng=0, dtype=d),
    _decoder_inputs,
    memory_key_padding_mask=np.array([[False, False, False, True], [False] * 4]),
)

# latent attention, gated DeltaNet
_MLA: dict[str, Any] = dict(kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=3)
module(
    "nn.MultiHeadLatentAttention.q_lora",
    lambda d: nn.MultiHeadLatentAttention(8, 2, q_lora_rank=5, rope_theta=100.0, rng=0, dtype=d, **_MLA),
    _x(),
    decode=lambda m, x: _steps(m, x[0]),
)
module(
    "nn.MultiHeadLatentAttention.yarn_bias_absorb",
    lambda d: nn.MultiHeadLatentAttention(
        8,
        2,
        attention_bias=True,
        rope_scaling=dict(_YARN, mscale=1.0, mscale_all_dim=1.0),
        rope_interleave=False,
        rng=0,
        dtype=d,
        **_MLA,
    ),
    _x(),
    decode=lambda m, x: _steps(m, x[0], absorb=True),
)
module(
    "nn.MultiHeadLatentAttention.positions_mask_bidirectional",
    lambda d: nn.MultiHeadLatentAttention(8, 2, causal=False, rng=0, dtype=d, **_MLA),
    _x(),
    positions=np.array([[0, 1, 2, 3, 4, 5], [2, 3, 4, 5, 6, 7]]),
    attn_mask=np.tril(np.ones((6, 6), bool)) | np.eye(6, k=1, dtype=bool),
)
_GDN: dict[str, Any] = dict(
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=4,
    linear_value_head_dim=3,
    linear_conv_kernel_dim=3,
)
module(
    "nn.GatedDeltaNet",
    lambda d: nn.GatedDeltaNet(8, **_GDN, rng=0, dtype=d),
    _x(7),
    decode=lambda m, x: _steps(m, x[0]),
)
module("nn.GatedDeltaNet.chunks_of_3", lambda d: nn.GatedDeltaNet(8, **_GDN, chunk_size=3, rng=0, dtype=d), _x(7))


# mixture of experts
def _routed(r, d):
    return _n(r, d, 2, 3, 8), _distinct_indices(r, 6, 4, 2).reshape(2, 3, 2), r.random((2, 3, 2)).astype(d)


module("nn.TopKRouter.softmax_topk", lambda d: nn.TopKRouter(8, 6, 2, norm_topk_prob=True, rng=0, dtype=d))
module(
    "nn.TopKRouter.sigmoid_groups_bias",
    lambda d: nn.TopKRouter(
        8,
        6,
        2,
        variant="sigmoid",
        norm_topk_prob=True,
        bias=True,
        routed_scaling_factor=2.5,
        n_group=3,
        topk_group=2,
        rng=0,
        dtype=d,
    ),
)
module("nn.Experts", lambda d: nn.Experts(4, 8, 5, rng=0, dtype=d), _routed)
module("nn.Experts.gelu", lambda d: nn.Experts(4, 8, 5, hidden_act="gelu", rng=0, dtype=d), _routed)
module("nn.GptOssExperts", lambda d: nn.GptOssExperts(4, 8, 5, limit=1.0, rng=0, dtype=d), _routed)
module("nn.GatedMLP", lambda d: nn.GatedMLP(8, 12, rng=0, dtype=d))
module("nn.GatedMLP.bias_gelu", lambda d: nn.GatedMLP(8, 12, "gelu", bias=True, rng=0, dtype=d))
module(
    "nn.SparseMoeBlock.qwen_shared_gate",
    lambda d: nn.SparseMoeBlock(
        8, 4, 2, 5, norm_topk_prob=True, shared_intermediate_size=6, shared_expert_gate=True, rng=0, dtype=d
    ),
)
module(
    "nn.SparseMoeBlock.gpt_oss",
    lambda d: nn.SparseMoeBlock(
        8, 4, 2, 5, router="topk_softmax", router_bias=True, experts="gpt_oss", swiglu_limit=1.0, rng=0, dtype=d
    ),
)
module(
    "nn.MoE.deepseek",
    lambda d: nn.MoE(
        8,
        6,
        2,
        5,
        router="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        n_group=3,
        topk_group=2,
        shared_intermediate_size=5,
        router_bias=True,
        rng=0,
        dtype=d,
    ),
)

# the tiny transformer of npattn.models
module(
    "TinyTransformer",
    lambda d: npattn.TinyTransformer(13, 8, 8, 2, 2, 12, activation="gelu", rng=0, dtype=d),
    lambda r, d: (r.integers(0, 13, (2, 6)),),
)


def _optimizer(make_opt, clip=None, schedule=False):
    def run(dtype):
        """Four steps of an optimizer (after clipping, under a schedule) on a seeded FeedForward."""
        case = run.__name__
        m = set_params(nn.FeedForward(8, 12, activation="gelu", rng=0, dtype=dtype), case)
        opt = make_opt(m)
        sched = optim.WarmupCosine(opt, warmup_steps=2, total_steps=4, min_lr=1e-3) if schedule else None
        res, norms = {}, []
        r = _rng(case, "steps")
        for _ in range(4):
            x = _randn(r, (2, 5, 8), dtype)
            opt.zero_grad()
            m.backward(_randn(r, m(x).shape, dtype))
            if clip is not None:
                norms.append(optim.clip_grad_norm_(m, clip))
            opt.step()
            if sched is not None:
                sched.step()
        for name, p in m.named_parameters():
            res[name] = _copy(p.data)
        if norms:
            res["clip_norms"] = np.asarray(norms, np.float64)
        res["lr"] = np.asarray(opt.lr, np.float64)
        return res

    return run


for _name_, _make_opt, _kw in (
    ("SGD", lambda m: optim.SGD(m, 0.1), {}),
    ("SGD.momentum_nesterov_decay", lambda m: optim.SGD(m, 0.1, 0.9, 0.01, nesterov=True), {}),
    ("Adam.decay", lambda m: optim.Adam(m, 0.01, weight_decay=0.01), {}),
    ("AdamW.clip_schedule", lambda m: optim.AdamW(m, 0.05, betas=(0.8, 0.99)), dict(clip=0.5, schedule=True)),
):
    CASES.append(_name(_optimizer(_make_opt, **_kw), f"optim.{_name_}"))


def masks_case(dtype):
    """``npattn.masks`` (booleans, True = may attend) and ``to_additive`` in the dtype."""
    kpm = np.array([[False, False, True], [False, True, True]])
    return {
        "causal": masks.causal(4, 6),
        "padding": masks.padding([2, 4], 5),
        "sliding_window": masks.sliding_window(5, 2),
        "combine": masks.combine(masks.causal(5), masks.sliding_window(5, 2)),
        "from_key_padding_mask": masks.from_key_padding_mask(kpm),
        "to_additive": masks.to_additive(masks.causal(4, 6), dtype=dtype),
    }


CASES.append(_name(masks_case, "masks"))


# --------------------------------------------------------------------------------------------
# npattn.book
# --------------------------------------------------------------------------------------------

_GPT = dict(vocab_size=23, context_length=10, emb_dim=8, n_heads=2, n_layers=2, drop_rate=0.0, qkv_bias=True)

module("book.SelfAttention_v1", lambda d: book.SelfAttention_v1(8, 6, rng=0, dtype=d), lambda r, d: (_n(r, d, 5, 8),))
module(
    "book.SelfAttention_v2", lambda d: book.SelfAttention_v2(8, 6, True, rng=0, dtype=d), lambda r, d: (_n(r, d, 5, 8),)
)
module("book.CausalAttention", lambda d: book.CausalAttention(8, 6, 7, 0.0, rng=0, dtype=d), _x(5))
module(
    "book.MultiHeadAttentionWrapper",
    lambda d: book.MultiHeadAttentionWrapper(8, 3, 7, 0.0, 2, rng=0, dtype=d),
    _x(5),
)
module(
    "book.MultiHeadAttention",
    lambda d: book.MultiHeadAttention(8, 8, 7, 0.0, 2, qkv_bias=True, rng=0, dtype=d),
    _x(6),
    decode=lambda m, x: _steps(m, x[0]),
)
module("book.GELU", lambda d: book.GELU())
module("book.LayerNorm", lambda d: book.LayerNorm(8, dtype=d))
module("book.FeedForward", lambda d: book.FeedForward(_GPT, rng=0, dtype=d))
module(
    "book.TransformerBlock",
    lambda d: book.TransformerBlock(dict(_GPT, context_length=6), rng=0, dtype=d),
    _x(6),
)


def _gpt_decode(m, inputs):
    (ids,) = inputs
    return _steps(m, ids, first=4)


module(
    "book.GPTModel",
    lambda d: book.GPTModel(_GPT, rng=0, dtype=d),
    lambda r, d: (r.integers(0, 23, (2, 7)),),
    decode=_gpt_decode,
)


def book_generate(dtype):
    """The book's ``generate_text_simple`` and ``generate`` (greedy and sampled) on a seeded GPTModel."""
    m = set_params(book.GPTModel(_GPT, rng=0, dtype=dtype), "book.generate")
    idx = _rng("book.generate", "ids").integers(0, 23, (2, 3))
    with npattn.no_grad():
        return {
            "simple": book.generate_text_simple(m, idx, 5, 10),
            "greedy": book.generate(m, idx, 5, 10),
            "greedy_nocache": book.generate(m, idx, 5, 10, use_cache=False),
            "sampled": book.generate(m, idx, 5, 10, temperature=1.3, top_k=6, rng=3),
        }


CASES.append(_name(book_generate, "book.generate"))


# --------------------------------------------------------------------------------------------
# CausalLM families
# --------------------------------------------------------------------------------------------

_FAMILY_BASE = dict(vocab_size=41, hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2)

FAMILIES = {  # tests/_families.py of round 4, frozen: the golden inputs must not move with that table
    "llama": dict(_FAMILY_BASE, model_type="llama", num_hidden_layers=2, attention_bias=True, rope_theta=500.0),
    "qwen3": dict(
        _FAMILY_BASE,
        model_type="qwen3",
        num_hidden_layers=2,
        head_dim=4,
        use_sliding_window=True,
        sliding_window=3,
        max_window_layers=1,
        tie_word_embeddings=True,
    ),
    "gemma3_text": dict(
        _FAMILY_BASE,
        model_type="gemma3_text",
        num_hidden_layers=2,
        head_dim=4,
        query_pre_attn_scalar=8,
        sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
        pad_token_id=0,
    ),
    "gpt_oss": dict(
        _FAMILY_BASE,
        model_type="gpt_oss",
        num_hidden_layers=2,
        head_dim=4,
        sliding_window=3,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
            "rope_theta": 1000.0,
        },
    ),
    "deepseek_v3": dict(
        _FAMILY_BASE,
        model_type="deepseek_v3",
        num_hidden_layers=2,
        num_key_value_heads=4,
        first_k_dense_replace=1,
        moe_intermediate_size=8,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=4,
    ),
    "qwen3_next": dict(
        _FAMILY_BASE,
        model_type="qwen3_next",
        num_hidden_layers=2,
        head_dim=4,
        layer_types=["linear_attention", "full_attention"],
        linear_conv_kernel_dim=3,
        linear_key_head_dim=4,
        linear_value_head_dim=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=8,
        partial_rotary_factor=0.5,
    ),
}


def _family(model_type):
    case = f"family.{model_type}"

    def run(dtype):
        m = set_params(CausalLM(FAMILIES[model_type], rng=0, dtype=dtype), case)
        r = _rng(case, "ids")
        ids = r.integers(0, 41, (2, 7))
        res = run_module(m, case, (ids,))
        targets = r.integers(0, 41, (2, 7))
        loss, cache = F.cross_entropy(res["out"], targets)
        res["loss"] = _copy(loss)
        with npattn.no_grad():
            res["decode"] = _steps(m, ids, first=4)
            res["generate"] = generate(m, ids[:, :3], 4, 64)
            res["sample"] = generate(m, ids[:, :3], 4, 64, temperature=0.8, top_k=10, top_p=0.9, rng=1)
        return res

    CASES.append(_name(run, case))


for _model_type in FAMILIES:
    _family(_model_type)


def compute(case, dtype) -> dict:
    """``case(dtype)`` with every value an ndarray."""
    return {k: np.asarray(v) for k, v in case(dtype).items()}


def key(case, name, dtype) -> str:
    return f"{case.__name__}/{name}/{np.dtype(dtype).name}"


def main() -> None:
    arrays = {}
    for case in CASES:
        for dtype in DTYPES:
            for name, value in compute(case, dtype).items():
                arrays[key(case, name, dtype)] = value
    np.savez_compressed(GOLDEN, **arrays)
    size = GOLDEN.stat().st_size
    print(f"{GOLDEN}: {len(CASES)} cases, {len(arrays)} arrays, {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
