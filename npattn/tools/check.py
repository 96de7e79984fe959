"""``npattn check``: ``npattn.gradcheck`` over every module and functional op, as a table.

Every hand-written derivative is checked in both modes (``gradcheck(..., mode="both")``): the
backward against central finite differences in float64, at small sizes, with a random upstream
gradient, and the forward mode (the op's ``_jvp``, ``Module.jvp``) against the central difference
of the output along a random tangent, and against the backward (``<g, J v> = <J^T g, v>``);
``--seed`` picks the inputs, the upstream gradient and the tangents.  One table row per case
gives the worst absolute and relative error over all checked tensors of the case (inputs and
parameters) in both modes; a failing case is followed by its full per-tensor report (one row per
tensor and mode).  The exit code is 1 when any case fails (or raises), else 0.

``--order 2`` runs ``npattn.gradgradcheck`` on the same cases, with the same inputs: each
``backward_jvp`` (a pair's ``<op>_backward_jvp``, a module's ``backward_jvp``) against central
differences of the backward along every input, parameter and the upstream gradient, and the
Hessian's symmetry.  A case without a second order (no ``<op>_backward_jvp`` yet, a module whose
``backward_jvp`` is missing or not implemented) is shown as skipped and listed with the reason;
it neither passes nor fails.

Covered: every functional op (linear, embedding and its padding_idx / scale_grad_by_freq options,
softmax, relu, gelu, silu, dropout, layer_norm and rms_norm over one or two axes, cross_entropy
with weights, reductions, label smoothing and probability targets, rope in both layouts with
offset and per-batch positions), both attention cores with masks, causal, GQA, dropout and every
attention option (bottom-right alignment, window, ALiBi, softcap, sinks with ``dsinks``, a learnable
float mask with ``dmask``, all of them at once), and every module (with MultiHeadAttention's
window, ALiBi, softcap, sinks, RoPE and QK-norm options, DecoderBlock, SwiGLU, book.GPTModel, the
mixture-of-experts blocks of GPT-OSS, DeepSeek-V3 and Qwen3-Next).
"""

from __future__ import annotations

import inspect
import operator
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from .. import book
from .. import functional as F
from ..models import TinyTransformer
from ..nn import layers, transformer
from ..nn.attention import MultiHeadAttention
from ..nn.delta_net import GatedDeltaNet
from ..nn.kimi_delta import KimiDeltaAttention
from ..nn.latent_attention import MultiHeadLatentAttention
from ..nn.module import Module
from ..nn.moe import SparseMoeBlock
from ..nn.shared_kv import DenseWithExperts, PerLayerEmbeddings, PerLayerInput, SharedKVAttention
from ..nn.short_conv import ShortConv
from ..testing.gradcheck import companion, gradcheck
from ..testing.gradgradcheck import gradgradcheck

__all__ = ["cases", "run", "main", "Skipped"]

# The cases are a table: parts of (inputs, rows), built in order by ``cases`` with one generator
# (``--seed``), so that the n-th case always checks the same numbers.  An input or a row's argument
# is a literal or a draw, made when the table is built: N (standard normal), U (uniform), I (integers
# in [0, hi)), S.name (an input of the part's scope), Call (a function of made arguments: a module, a
# mask) and the seeds R (modules' initialisation seed) and FRESH (a generator of the seed).


class _Ctx(NamedTuple):
    rng: np.random.Generator  # the part's stream
    seed: int
    scope: Dict[str, Any]  # the inputs made so far, by name


class _Draw:
    def make(self, ctx: _Ctx) -> Any:
        raise NotImplementedError


def _make(value: Any, ctx: _Ctx) -> Any:
    """``value`` with every draw made, in order (an array literal is copied)."""
    if isinstance(value, _Draw):
        return value.make(ctx)
    if isinstance(value, (tuple, list)):
        return type(value)(_make(v, ctx) for v in value)
    if isinstance(value, dict):
        return {k: _make(v, ctx) for k, v in value.items()}
    return value.copy() if isinstance(value, np.ndarray) else value


class N(_Draw):
    """``loc + scale * standard_normal(shape)``."""

    def __init__(self, *shape: int, loc: float = 0.0, scale: float = 1.0) -> None:
        self.shape, self.loc, self.scale = shape, loc, scale

    def make(self, ctx):
        z = ctx.rng.standard_normal(self.shape)
        z = self.scale * z if self.scale != 1 else z
        return self.loc + z if self.loc else z


class U(_Draw):
    def __init__(self, low: float, high: float, *shape: int) -> None:
        self.low, self.high, self.shape = low, high, shape

    def make(self, ctx):
        return ctx.rng.uniform(self.low, self.high, self.shape)


class I(_Draw):  # noqa: E742
    def __init__(self, high: int, *shape: int) -> None:
        self.high, self.shape = high, shape

    def make(self, ctx):
        return ctx.rng.integers(0, self.high, self.shape)


class Call(_Draw):
    """``f(*args, **kwargs)`` of the made arguments (positional first, then keywords)."""

    def __init__(self, f: Callable, *args: Any, **kwargs: Any) -> None:
        self.f, self.args, self.kwargs = f, args, kwargs

    def make(self, ctx):
        args = _make(self.args, ctx)
        return self.f(*args, **_make(self.kwargs, ctx))


class _Named(_Draw):
    def __init__(self, name: str) -> None:
        self.name = name

    def make(self, ctx):
        return ctx.scope[self.name]


class _Scope:
    def __getattr__(self, name: str) -> _Named:
        return _Named(name)


class _Special(_Draw):
    def __init__(self, of: Callable[[_Ctx], Any]) -> None:
        self.of = of

    def make(self, ctx):
        return self.of(ctx)


S = _Scope()
R = _Special(lambda ctx: ctx.seed)  # modules' initialisation seed
FRESH = _Special(lambda ctx: np.random.default_rng(ctx.seed))  # a generator that gradcheck renews per call
RNG = _Special(lambda ctx: ctx.rng)  # the part's stream, for an input drawn by a helper


class _Row(NamedTuple):
    name: str
    target: Any  # an op, a (forward, backward[, jvp]) tuple or a module (or a draw making one)
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]  # the forward's keyword arguments, and rng for gradcheck


def _case(name: str, target: Any, *args: Any, **kwargs: Any) -> _Row:
    """A row: ``gradcheck(target, *args, **kwargs)``, both modes."""
    return _Row(name, target, args, kwargs)


class _Part(NamedTuple):
    scope: str  # parts of one scope see each other's inputs
    inputs: Dict[str, Any]  # made in order before the rows
    rows: List[_Row]
    stream: Any = None  # None: the table's generator; else default_rng((seed, stream))


def _build(table: List[_Part], seed: int, order: int = 1) -> List[Tuple[str, Callable[[], Any]]]:
    """The table's ``[(name, thunk)]``: a row's arguments are made before its target (the same
    draws whatever the order)."""
    streams = {None: np.random.default_rng(seed)}
    scopes: Dict[str, Dict[str, Any]] = {}
    out = []
    for part in table:
        if part.stream not in streams:
            streams[part.stream] = np.random.default_rng((seed, part.stream))
        ctx = _Ctx(streams[part.stream], seed, scopes.setdefault(part.scope, {}))
        for name, value in part.inputs.items():
            ctx.scope[name] = _make(value, ctx)
        for row in part.rows:
            args, kwargs = _make(row.args, ctx), _make(row.kwargs, ctx)
            target = _make(row.target, ctx)
            out.append((row.name, (_thunk if order == 1 else _second_order_thunk)(target, args, kwargs, seed)))
    return out


def _thunk(target, args, kwargs, seed):
    return lambda: gradcheck(target, *args, seed=seed, mode="both", **kwargs)


class Skipped(NamedTuple):
    """What a second-order thunk returns for a case without a second order: why."""

    reason: str


def _second_order(target) -> Tuple[Any, str]:
    """``(gradgradcheck target, "")`` for a case's target, or ``(None, why not)``: a pair's
    ``<op>_backward_jvp`` found by name, a tuple's ``<backward>_jvp`` (or its backward's
    ``backward_jvp`` attribute), a module's public ``backward_jvp``."""
    if isinstance(target, Module):
        found = callable(getattr(target, "backward_jvp", None))
        return (target, "") if found else (None, f"{type(target).__name__} has no backward_jvp")
    if isinstance(target, tuple):
        forward, backward = target[:2]
        backward_jvp = getattr(backward, "backward_jvp", None) or companion(backward, "_jvp")
        if callable(backward_jvp):
            return (forward, backward, backward_jvp), ""
        return None, f"no {backward.__name__}_jvp"
    found = callable(companion(target, "_backward_jvp"))
    return (target, "") if found else (None, f"no {target.__name__}_backward_jvp")


def _second_order_thunk(target, args, kwargs, seed):
    def check():
        second, reason = _second_order(target)
        if second is None:
            return Skipped(reason)
        try:
            return gradgradcheck(second, *args, seed=seed, **kwargs)
        except TypeError as e:  # a module whose backward_jvp is not implemented yet
            if isinstance(e.__cause__, NotImplementedError):
                return Skipped(str(e.__cause__) or f"{type(target).__name__}.backward_jvp is not implemented")
            raise

    return check


def cases(seed: int = 0, order: int = 1) -> List[Tuple[str, Callable[[], Any]]]:
    """``[(name, thunk)]``: each thunk runs one ``gradcheck`` (``order=2``: ``gradgradcheck``, or
    returns :class:`Skipped` for a case without a second order) and returns its report."""
    return _build(_TABLE, seed, order)


# -- helpers the table calls --------------------------------------------------------------------
B, L, D = 2, 4, 6  # batch, sequence length, width


def _bool_mask(rng):
    mask = rng.random((B, 1, 3, 5)) < 0.7
    mask[..., 0] = True
    mask[0, 0, 1] = False  # one fully masked query row: output 0, gradient 0
    return mask


def _key_padding_mask():
    kpm = np.zeros((B, L), dtype=bool)
    kpm[1, -1] = True
    return kpm


def _causal(n):
    return ~np.triu(np.ones((n, n), dtype=bool), k=1)


def _some_ignored(rng):
    return np.where(rng.random((B, L)) < 0.3, -100, rng.integers(0, 5, (B, L)))


def _probabilities(logits):
    return F.softmax(logits)[0]


def _repeated_ids(rng):
    ids = rng.integers(0, 7, (B, L))
    ids[0, 0] = 2
    ids[1, 1:3] = 5
    return ids


# embedding: the padding row gets no gradient by definition (torch), so it is held fixed at 0
# and checked to receive exactly 0; scale_grad_by_freq divides each row's gradient by its count.
def emb_pad(ids, w_rest):
    weight = np.insert(w_rest, 2, 0.0, axis=0)
    return F.embedding(ids, weight, padding_idx=2)


def emb_pad_backward(dout, cache):
    dweight = F.embedding_backward(dout, cache)
    if np.any(dweight[2] != 0):
        raise AssertionError("embedding: the padding_idx row received a gradient")
    return np.delete(dweight, 2, axis=0)


def emb_pad_jvp(cache, tw_rest):  # the held padding row does not move
    return F.embedding_jvp(cache, np.insert(tw_rest, 2, 0.0, axis=0))


def emb_pad_backward_jvp(dout, cache, tangents, ddout=None):
    (tw_rest,) = tuple(tangents or ()) or (None,)
    tw = None if tw_rest is None else np.insert(tw_rest, 2, 0.0, axis=0)
    dweight, tangent = F.embedding_backward_jvp(dout, cache, (tw,), ddout)
    return np.delete(dweight, 2, axis=0), np.delete(tangent, 2, axis=0)


def _emb_freq_pair(ids):
    counts = np.maximum(np.bincount(ids.ravel(), minlength=7)[:, None], 1)

    def emb_freq(ids, weight):
        return F.embedding(ids, weight, scale_grad_by_freq=True)

    def emb_freq_backward(dout, cache):
        return F.embedding_backward(dout, cache) * counts

    def emb_freq_backward_jvp(dout, cache, tangents, ddout=None):
        dweight, tangent = F.embedding_backward_jvp(dout, cache, tangents, ddout)
        return dweight * counts, tangent * counts

    emb_freq_backward.backward_jvp = emb_freq_backward_jvp  # for --order 2
    return emb_freq, emb_freq_backward, F.embedding_jvp


def _opts_pair(
    forward: Callable, backward: Callable, jvp: Callable, extras: List[str], **opts: Any
) -> Tuple[Callable, Callable, Callable]:
    """A ``(forward, backward, jvp)`` triple taking ``q, k, v`` and then ``extras`` (``"attn_mask"``,
    ``"sinks"``, in the backward's order) positionally, so that ``gradcheck`` checks ``dmask`` and
    ``dsinks`` (and their tangents) as well."""

    def fwd(q, k, v, *more, **kw):
        kw.update(zip(extras, more))
        if "attn_mask" in kw:
            kw["mask_grad"] = True
        return forward(q, k, v, **kw, **opts)

    fwd.__name__ = f"{forward.__name__}_with_{'_'.join(extras) or 'options'}"
    fwd.__signature__ = inspect.Signature(  # type: ignore[attr-defined]  # the names gradcheck reports
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ["q", "k", "v", *extras]]
    )
    return fwd, backward, jvp


def _option_case(core: str, label: str, extras: Dict[str, Any], opts: Dict[str, Any]) -> _Row:
    """An attention option in one core: ``extras`` (``attn_mask``, ``sinks``) are inputs whose
    gradients are checked; ``q`` (default S.q) and ``rng`` go to the call, the rest to the op."""
    fwd, bwd, jvp, blk = _CORES[core]
    opts = dict(opts)
    q, rng_kw = opts.pop("q", S.q), ({"rng": opts.pop("rng")} if "rng" in opts else {})
    target = Call(_opts_pair, fwd, bwd, jvp, list(extras), **blk, **opts)
    return _case(f"{core} ({label})", target, q, S.k, S.v, *extras.values(), **rng_kw)


def _with_sinks(module, sinks, q_norm_shift=None):
    """``module`` with its sinks moved away from the zeros they start with (and its q_norm weight
    shifted by ``q_norm_shift``)."""
    module.sinks.data[...] = sinks
    if q_norm_shift is not None:
        module.q_norm.weight.data[...] += q_norm_shift
    return module


def _mha(**kw):
    return Call(MultiHeadAttention, 8, 8, 2, rng=R, **kw)


def _sigmoid_router(bias):
    """DeepSeek-V3's routing with groups as a pair in the logits alone."""

    def router(logits):
        (w, _), cache = F.topk_router(
            logits, 3, variant="sigmoid", norm_topk_prob=True, correction_bias=bias, n_group=4, topk_group=2,
            routed_scaling_factor=2.5,
        )  # fmt: skip
        return w, cache

    return router, F.topk_router_backward, F.topk_router_jvp


def delta_rule(q, k, v, g, beta, initial_state):
    return F.gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, use_qk_l2norm=True, chunk_size=3)


def kda(q, k, v, g, beta, initial_state):
    return F.kimi_delta_attention(q, k, v, g, beta, initial_state=initial_state, use_qk_l2norm=True, chunk_size=3)


def mamba2(x, dt, A, B, C, D, dt_bias, initial_state):
    return F.mamba2_scan(x, dt, A, B, C, D, dt_bias, initial_state=initial_state, chunk_size=2)


def conv(x, weight, bias, initial_state):
    return F.causal_conv1d(x, weight, bias, activation="silu", initial_state=initial_state)


_CORES = {
    "sdpa": (
        F.scaled_dot_product_attention,
        F.scaled_dot_product_attention_backward,
        F.scaled_dot_product_attention_jvp,
        {},
    ),
    "memory_efficient_attention": (
        F.memory_efficient_attention,
        F.memory_efficient_attention_backward,
        F.memory_efficient_attention_jvp,
        {"block_size": 2},
    ),
}
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2}
_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 4,
}
_GPT_TINY = {
    "vocab_size": 7,
    "context_length": 6,
    "emb_dim": 8,
    "n_heads": 2,
    "n_layers": 1,
    "drop_rate": 0.0,
    "qkv_bias": True,
}
_MOE_FAMILIES = {
    "GPT-OSS: top-k then softmax, clamped SwiGLU": dict(
        model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, intermediate_size=3
    ),
    "DeepSeek-V3: sigmoid, groups, shared experts": dict(
        model_type="deepseek_v3", n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=3,
        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    ),
    "Qwen3-Next: softmax then top-k, gated shared expert": dict(
        model_type="qwen3_next", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=3,
        shared_expert_intermediate_size=4,
    ),
}  # fmt: skip
_MLA_DIMS = {"kv_lora_rank": 3, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 2}
_MLA_YARN = {"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 0.7, "original_max_position_embeddings": 2}

_SDPA, _MEA = F.scaled_dot_product_attention, F.memory_efficient_attention
_CORE_OPS = _Part(
    "core",
    {
        "x": N(B, L, D),
        "q": N(B, 2, 3, 4),
        "k": N(B, 2, 5, 4),
        "v": N(B, 2, 5, 3),
        "q4": N(B, 4, 3, 4),  # 4 query heads over the 2 kv heads of k, v
        "qs": N(B, 2, 5, 4),  # square, for causal
        "ks": N(B, 2, 5, 4),
        "vs": N(B, 2, 5, 3),
        "bool_mask": Call(_bool_mask, RNG),
        "float_mask": N(3, 5),
        "kpm": Call(_key_padding_mask),
        "attn_mask": Call(_causal, L),
    },
    [
        _case("linear", F.linear, S.x, N(5, D), N(5)),
        _case("linear (no bias)", F.linear, S.x, N(5, D)),
        _case("embedding", F.embedding, I(7, B, L), N(7, D)),
        _case("softmax (last axis)", F.softmax, S.x),
        _case("softmax (axis=1)", F.softmax, S.x, axis=1),
        _case("relu", F.relu, S.x),
        _case("gelu (erf)", F.gelu, S.x),
        _case("gelu (tanh)", F.gelu, S.x, approximate="tanh"),
        _case("dropout (p=0.3, fixed rng)", F.dropout, S.x, 0.3, FRESH),
        _case("layer_norm", F.layer_norm, S.x, N(D, loc=1, scale=0.1), N(D)),
        _case("layer_norm (no affine)", F.layer_norm, S.x),
        _case("cross_entropy", F.cross_entropy, N(B, L, 5), I(5, B, L)),
        _case("cross_entropy (ignore_index)", F.cross_entropy, N(B, L, 5), Call(_some_ignored, RNG), ignore_index=-100),
        _case("sdpa", _SDPA, S.q, S.k, S.v),
        _case("sdpa (no head axis)", _SDPA, N(B, 3, 4), N(B, 5, 4), N(B, 5, 3)),
        _case("sdpa (causal)", _SDPA, S.qs, S.ks, S.vs, is_causal=True),
        _case("sdpa (causal, Lq < Lk)", _SDPA, S.q, S.k, S.v, is_causal=True),
        _case("sdpa (bool mask, empty row)", _SDPA, S.q, S.k, S.v, attn_mask=S.bool_mask),
        _case("sdpa (float mask)", _SDPA, S.q, S.k, S.v, attn_mask=S.float_mask),
        _case("sdpa (scale=0.3)", _SDPA, S.q, S.k, S.v, scale=0.3),
        _case("sdpa (GQA)", _SDPA, S.q4, S.k, S.v, enable_gqa=True),
        _case("sdpa (GQA, causal)", _SDPA, S.q4, S.k, S.v, enable_gqa=True, is_causal=True),
        _case("sdpa (dropout, fixed rng)", _SDPA, S.q, S.k, S.v, dropout_p=0.3, rng=FRESH),
        _case("memory_efficient_attention", _MEA, S.q, S.k, S.v, block_size=2),
        _case("memory_efficient_attention (causal)", _MEA, S.qs, S.ks, S.vs, is_causal=True, block_size=2),
        _case("memory_efficient_attention (bool mask)", _MEA, S.q, S.k, S.v, attn_mask=S.bool_mask, block_size=2),
        _case("memory_efficient_attention (float mask)", _MEA, S.q, S.k, S.v, attn_mask=S.float_mask, block_size=3),
    ],
)

# The newer functional ops and options: rms_norm, silu, rope, layer_norm over several axes,
# embedding and cross_entropy options, and every attention option in both attention cores.
_OP_OPTIONS = _Part(
    "options",
    {"x": N(B, L, D)},
    [
        _case("silu", F.silu, S.x),
        _case("rms_norm", F.rms_norm, S.x, N(D, loc=1, scale=0.1)),
        _case("rms_norm (no weight)", F.rms_norm, S.x),
        _case("rms_norm (2 axes, eps)", F.rms_norm, S.x, N(L, D, loc=1, scale=0.1), 1e-5),
        _case("rope (rotate half)", F.rope, S.x),
        _case("rope (interleaved)", F.rope, S.x, interleaved=True),
        _case("rope (offset positions)", F.rope, S.x, np.arange(L) + 7, base=100.0),
        _case("rope (per-batch positions, interleaved)", F.rope, S.x, I(50, B, L), interleaved=True),
        _case("rope (yarn, partial rotary)", F.rope, S.x, scaling=_YARN, rotary_dim=4),
        _case("rope (llama3)", F.rope, S.x, np.arange(L) + 9, scaling=_LLAMA3),
        _case("layer_norm (2 axes)", F.layer_norm, S.x, N(L, D, loc=1, scale=0.1), N(L, D)),
        _case("layer_norm (2 axes, no affine)", F.layer_norm, S.x, normalized_shape=(L, D)),
        _case("layer_norm (weight only)", F.layer_norm, S.x, N(D, loc=1, scale=0.1)),
    ],
)
_EMB_LOSS_OPTIONS = _Part(
    "options",
    {
        "ids": Call(_repeated_ids, RNG),
        "logits": N(B, L, 5),
        "targets": I(5, B, L),
        "probs": Call(_probabilities, N(B, L, 5)),
        "cw": U(0.5, 2.0, 5),
    },
    [
        _case("embedding (padding_idx)", (emb_pad, emb_pad_backward, emb_pad_jvp), S.ids, N(6, D)),
        _case("embedding (scale_grad_by_freq)", Call(_emb_freq_pair, S.ids), S.ids, N(7, D)),
        _case("cross_entropy (weight)", F.cross_entropy, S.logits, S.targets, weight=S.cw),
        _case("cross_entropy (reduction=sum)", F.cross_entropy, S.logits, S.targets, reduction="sum"),
        _case("cross_entropy (reduction=none)", F.cross_entropy, S.logits, S.targets, reduction="none"),
        _case("cross_entropy (label_smoothing)", F.cross_entropy, S.logits, S.targets, label_smoothing=0.1),
        _case("cross_entropy (probabilities, weight)", F.cross_entropy, S.logits, targets=S.probs, weight=S.cw),
    ],
)
# (label, extras, options) of each attention option, in both cores: q (b, 2, 3, 4) against k, v
# of 5 keys (Lq < Lk)
_ATTENTION_OPTIONS: List[Tuple[str, Dict[str, Any], Dict[str, Any]]] = [
    ("causal, bottom_right", {}, dict(is_causal=True, causal_align="bottom_right")),
    ("window (2, 1)", {}, dict(window=(2, 1))),
    ("window (1, -1), bottom_right", {}, dict(window=(1, -1), causal_align="bottom_right")),
    ("causal, window (1, 0)", {}, dict(is_causal=True, window=(1, 0), causal_align="bottom_right")),
    ("alibi_slopes", {}, dict(alibi_slopes=S.slopes)),
    ("softcap", {}, dict(softcap=1.5)),
    ("sinks -> dsinks", {"sinks": S.sinks}, {}),
    ("mask_grad -> dmask", {"attn_mask": S.fmask}, {}),
    (
        "all options, GQA -> dmask, dsinks",
        {"attn_mask": N(B, 1, 3, 5), "sinks": N(4)},
        dict(
            q=S.q4,
            enable_gqa=True,
            is_causal=True,
            causal_align="bottom_right",
            window=(2, 0),
            alibi_slopes=U(0.1, 1.0, 4),
            softcap=2.0,
        ),
    ),
    (
        "options, dropout (fixed rng)",
        {"sinks": S.sinks},
        dict(window=(1, 1), softcap=2.0, alibi_slopes=S.slopes, dropout_p=0.3, rng=FRESH),
    ),
]
_ATTENTION = _Part(
    "options",
    {
        "q": N(B, 2, 3, 4),
        "k": N(B, 2, 5, 4),
        "v": N(B, 2, 5, 3),
        "q4": N(B, 4, 3, 4),
        "slopes": U(0.1, 1.0, 2),
        "sinks": N(2),
        "fmask": N(3, 5),
    },
    [_option_case(core, *option) for core in _CORES for option in _ATTENTION_OPTIONS],
)

# -- modules ---------------------------------------------------------------------------------------
_MODULES = _Part(
    "core",
    {},
    [
        _case("Linear", Call(layers.Linear, D, 5, rng=R), S.x),
        _case("Linear (no bias)", Call(layers.Linear, D, 5, bias=False, rng=R), S.x),
        _case("LayerNorm", Call(layers.LayerNorm, D), S.x),
        _case("Dropout (p=0.3, fixed rng)", Call(layers.Dropout, 0.3, rng=R), S.x),
        _case("Embedding", Call(layers.Embedding, 7, D, rng=R), I(7, B, L)),
        *[
            _case(f"FeedForward ({act})", Call(layers.FeedForward, D, 8, activation=act, rng=R), S.x)
            for act in ("relu", "gelu", "gelu_tanh")
        ],
    ],
)
_ENC = transformer.EncoderBlock
_ATTENTION_MODULES = _Part(
    "core",
    {"xc": N(B, 5, 4), "kc": N(B, 5, 3), "vc": N(B, 5, 3)},
    [
        _case("MultiHeadAttention (self)", Call(MultiHeadAttention, D, D, 2, rng=R), S.x),
        _case("MultiHeadAttention (qkv_bias)", Call(MultiHeadAttention, D, D, 2, qkv_bias=True, rng=R), S.x),
        _case(
            "MultiHeadAttention (cross, kdim/vdim)",
            Call(MultiHeadAttention, D, D, 2, kdim=3, vdim=3, rng=R),
            S.x,
            S.kc,
            S.vc,
        ),
        _case(
            "MultiHeadAttention (cross, same dims)", Call(MultiHeadAttention, 4, 6, 2, rng=R), N(B, L, 4), S.xc, S.xc
        ),
        _case("MultiHeadAttention (GQA)", Call(MultiHeadAttention, 8, 8, 4, num_kv_heads=2, rng=R), N(B, L, 8)),
        _case(
            "MultiHeadAttention (masks)",
            Call(MultiHeadAttention, D, D, 2, rng=R),
            S.x,
            attn_mask=S.attn_mask,
            key_padding_mask=S.kpm,
        ),
        _case("MultiHeadAttention (causal)", Call(MultiHeadAttention, D, D, 2, causal=True, rng=R), S.x),
        _case("MultiHeadAttention (dropout)", Call(MultiHeadAttention, D, D, 2, dropout=0.2, rng=R), S.x),
        _case(
            "MultiHeadAttention (memory_efficient)",
            Call(MultiHeadAttention, D, D, 2, causal=True, memory_efficient=True, rng=R),
            S.x,
        ),
        _case("EncoderBlock (post-norm)", Call(_ENC, D, 2, 8, dropout=0.0, rng=R), S.x),
        _case(
            "EncoderBlock (pre-norm, causal)",
            Call(_ENC, D, 2, 8, dropout=0.0, norm_first=True, causal=True, rng=R),
            S.x,
        ),
        _case("EncoderBlock (dropout, gelu)", Call(_ENC, D, 2, 8, dropout=0.2, activation="gelu", rng=R), S.x),
        _case("EncoderBlock (key_padding_mask)", Call(_ENC, D, 2, 8, dropout=0.0, rng=R), S.x, key_padding_mask=S.kpm),
        _case("book.SelfAttention_v1", Call(book.SelfAttention_v1, D, 4, rng=R), S.x),
        _case("book.SelfAttention_v2", Call(book.SelfAttention_v2, D, 4, rng=R), S.x),
        _case("book.CausalAttention", Call(book.CausalAttention, D, 4, L, 0.2, rng=R), S.x),
        _case("book.MultiHeadAttentionWrapper", Call(book.MultiHeadAttentionWrapper, D, 2, L, 0.0, 2, rng=R), S.x),
        _case("book.MultiHeadAttention", Call(book.MultiHeadAttention, D, D, L, 0.0, 2, rng=R), S.x),
        _case(
            "book.MultiHeadAttention (2-d input)",
            Call(book.MultiHeadAttention, D, D, L, 0.0, 2, rng=R),
            Call(operator.itemgetter(0), S.x),
        ),
        _case("TinyTransformer", Call(TinyTransformer, 5, 6, 8, 2, 2, 12, rng=R), I(5, B, 5)),
    ],
)

# The newer modules and module options: RMSNorm, SiLU/SwiGLU feed-forwards, EncoderBlock(bias=False),
# DecoderBlock, MultiHeadAttention's attention options, book.GPTModel.
_FF, _DEC = layers.FeedForward, transformer.DecoderBlock
_MODULE_OPTIONS = _Part(
    "module options",
    {"x": N(B, L, D)},
    [
        _case("RMSNorm", Call(layers.RMSNorm, D), S.x),
        _case("RMSNorm (2 axes, no affine)", Call(layers.RMSNorm, (L, D), elementwise_affine=False), S.x),
        _case("FeedForward (silu)", Call(_FF, D, 8, activation="silu", rng=R), S.x),
        _case("FeedForward (swiglu)", Call(_FF, D, 8, activation="swiglu", rng=R), S.x),
        _case("FeedForward (swiglu, no bias)", Call(_FF, D, 8, activation="swiglu", bias=False, rng=R), S.x),
        _case("EncoderBlock (bias=False)", Call(_ENC, D, 2, 8, dropout=0.0, bias=False, rng=R), S.x),
    ],
)
_DECODER = _Part(
    "module options",
    {"xd": N(1, 3, 4), "mem": N(1, 2, 4), "tgt_mask": Call(_causal, 3)},
    [
        _case(
            "DecoderBlock (post-norm, tgt_mask)",
            Call(_DEC, 4, 2, 6, dropout=0.0, rng=R),
            S.xd,
            S.mem,
            tgt_mask=S.tgt_mask,
        ),
        _case(
            "DecoderBlock (pre-norm, causal, swiglu, bias=False)",
            Call(_DEC, 4, 2, 6, dropout=0.0, norm_first=True, causal=True, activation="swiglu", bias=False, rng=R),
            S.xd,
            S.mem,
        ),
    ],
)
_ALL_OPTIONS = dict(causal=True, window=(3, 0), alibi=True, softcap=2.0, sinks=True, rope=True, qk_norm=True)
_ALL_OPTIONS_MHA = Call(MultiHeadAttention, 8, 8, 4, num_kv_heads=2, memory_efficient=True, rng=R, **_ALL_OPTIONS)
_MHA_OPTIONS = _Part(
    "module options",
    {
        "x8": N(B, 5, 8),
        "sink_mha": Call(_with_sinks, _mha(sinks=True), N(2)),
        "all_mha": Call(_with_sinks, _ALL_OPTIONS_MHA, N(4), q_norm_shift=N(2, scale=0.1)),
    },
    [
        _case("MultiHeadAttention (window, causal)", _mha(causal=True, window=(2, 0)), S.x8),
        _case("MultiHeadAttention (alibi)", _mha(causal=True, alibi=True), S.x8),
        _case("MultiHeadAttention (softcap)", _mha(softcap=1.5), S.x8),
        _case("MultiHeadAttention (sinks)", S.sink_mha, S.x8),
        _case("MultiHeadAttention (rope)", _mha(causal=True, rope=True, rope_base=100.0), S.x8),
        _case("MultiHeadAttention (qk_norm)", _mha(qk_norm=True), S.x8),
        _case(
            "MultiHeadAttention (Qwen3-Next: output gate, head_dim, partial rotary, (1 + w) qk_norm)",
            _mha(
                causal=True,
                output_gate=True,
                head_dim=6,
                rope=True,
                partial_rotary_factor=2 / 3,
                qk_norm=True,
                qk_norm_unit_offset=True,
                qk_norm_eps=1e-6,
            ),
            S.x8,
        ),
        _case(
            "MultiHeadAttention (Gemma 3 / GPT-OSS: scale, window, yarn, biases)",
            _mha(causal=True, window=(2, 0), scale=0.3, rope=True, qkv_bias=True, rope_scaling=_YARN),
            S.x8,
        ),
        _case(
            "MultiHeadAttention (cross, bottom_right)",
            _mha(causal=True, causal_align="bottom_right"),
            N(B, 3, 8),
            S.x8,
            S.x8,
        ),
        _case("MultiHeadAttention (all options, GQA, memory_efficient)", S.all_mha, S.x8),
        _case("book.GPTModel (tiny)", Call(book.GPTModel, _GPT_TINY, rng=R), I(7, B, 5)),
    ],
)

# The mixture-of-experts blocks of the three families (router variants, both kinds of experts,
# shared experts and their gate), built from Hugging Face config fields, then the functional pairs
# under them: topk_router (DeepSeek-V3's sigmoid routing with groups; random logits are tie-free)
# and moe_experts (both kinds), from a stream of their own.
_MOE = _Part(
    "moe",
    {"x": U(-1.5, 1.5, 2, 3, 5)},
    [
        _case(f"SparseMoeBlock ({name})", Call(SparseMoeBlock.from_hf_config, dict(cfg, hidden_size=5), rng=R), S.x)
        for name, cfg in _MOE_FAMILIES.items()
    ],
)
_MOE_PAIRS = _Part(
    "moe pairs",
    {
        "bias": U(-0.3, 0.3, 8),
        "x": N(2, 3, 4),
        "idx": I(5, 2, 3, 2),
        "w": U(0.1, 1.0, 2, 3, 2),
        "gate_up": N(5, 6, 4),  # swiglu's
        "down": N(5, 4, 3),
        "gpt_gate_up": N(5, 4, 6),
        "gpt_down": N(5, 3, 4),
        "gpt_gate_up_bias": N(5, 6),
        "gpt_down_bias": N(5, 4),
    },
    [
        _case("topk_router (sigmoid, groups)", Call(_sigmoid_router, S.bias), N(2, 3, 8)),
        _case("moe_experts (swiglu)", F.moe_experts, S.x, S.idx, S.w, S.gate_up, S.down),
        _case(
            "moe_experts (gpt_oss)",
            F.moe_experts,
            *(S.x, S.idx, S.w, S.gpt_gate_up, S.gpt_down, S.gpt_gate_up_bias, S.gpt_down_bias),
            kind="gpt_oss",
        ),
    ],
    stream=22,
)

# Gated DeltaNet's pairs (the chunked delta rule with an initial state, the short convolution with
# its carried state, both norms), the GatedDeltaNet layer with grouped key heads, LFM2's
# ShortConv layer (the same convolution, without its activation) and Mamba-2's scan.
_DELTA_NET = _Part(
    "delta net",
    {"x": N(2, 5, 4)},
    [
        _case(
            "gated_delta_rule (chunks of 3, l2norm, initial state)",
            (delta_rule, F.gated_delta_rule_backward, F.gated_delta_rule_jvp),
            *(N(2, 2, 7, 3), N(2, 2, 7, 3), N(2, 2, 7, 2)),  # q, k, v: (lead..., L, dk | dv)
            Call(np.negative, U(0.05, 1.0, 2, 2, 7)),  # g
            U(0.1, 0.9, 2, 2, 7),  # beta
            N(2, 2, 3, 2),  # initial state (lead..., dk, dv)
        ),
        _case(
            "causal_conv1d (silu, bias, initial state)",
            (conv, F.causal_conv1d_backward, F.causal_conv1d_jvp),
            *(S.x, N(4, 3), N(4), N(2, 2, 4)),
        ),
        _case("l2_norm", F.l2_norm, S.x),
        _case("rms_norm_gated", F.rms_norm_gated, S.x, N(2, 5, 4), N(4, loc=1, scale=0.1)),
        _case(
            "GatedDeltaNet (4 value heads, 2 key heads)",
            Call(GatedDeltaNet, 6, 4, 2, 2, 3, 3, chunk_size=3, rng=R),
            N(2, 5, 6),
        ),
        _case("ShortConv (LFM2: 3 taps, biases)", Call(ShortConv, 6, 3, True, rng=R), N(2, 5, 6)),
        _case(
            "mamba2_scan (chunks of 2, 4 heads in 2 groups, initial state)",
            (mamba2, F.mamba2_scan_backward, F.mamba2_scan_jvp),
            *(N(2, 4, 5, 3), N(2, 4, 5), Call(np.negative, U(0.5, 2.0, 4))),  # x, dt, A
            *(N(2, 2, 5, 2), N(2, 2, 5, 2), N(4), N(4), N(2, 4, 3, 2)),  # B, C, D, dt_bias, initial state
        ),
    ],
)

# MultiHeadLatentAttention (DeepSeek-V3's MLA): the plain and the absorbed form, the query through
# q_proj or the low-rank q_lora_rank path with biases and YaRN.
_MLA = MultiHeadLatentAttention
_LATENT = _Part(
    "latent",
    {
        "x": N(2, 3, 6),
        "plain": Call(_MLA, 6, 2, rng=R, **_MLA_DIMS),
        "lora": Call(_MLA, 6, 2, q_lora_rank=4, attention_bias=True, rope_scaling=_MLA_YARN, rng=R, **_MLA_DIMS),
    },
    [
        _case("MultiHeadLatentAttention (q_proj)", S.plain, S.x),
        _case("MultiHeadLatentAttention (q_proj, absorbed)", S.plain, S.x, absorb=True),
        _case("MultiHeadLatentAttention (q_lora_rank, bias, yarn, absorbed)", S.lora, S.x, absorb=True),
    ],
)


def _causal_topk(scores, topk):
    """Each query's ``topk`` best causal keys (empty slots -1): a fixed choice for ``sparse_attention``."""
    return F.index_topk(scores, topk, mask=np.tril(np.ones(scores.shape[-2:], bool)))


# DeepSeek-V3.2's sparse attention: the lightning indexer, attention over a causal top-2 choice
# (early queries with empty slots, grouped heads), the indexer's KL loss, and MLA restricted to the
# indexer's top 2 keys (the choice a constant: its parameters' gradient is 0, as the differences say).
_SPARSE = _Part(
    "sparse",
    {"scores": N(2, 5, 5)},
    [
        _case("lightning_indexer", F.lightning_indexer, N(2, 3, 5, 4), N(2, 6, 4), N(2, 5, 3)),
        _case(
            "sparse_attention (top 2 causal, 4 heads on 2)",
            F.sparse_attention,
            *(N(2, 4, 5, 3), N(2, 2, 5, 3), N(2, 2, 5, 2)),
            indices=Call(_causal_topk, S.scores, 2),
        ),
        _case(
            "indexer_kl_loss (causal)",
            F.indexer_kl_loss,
            S.scores,
            attn=U(0.0, 1.0, 2, 3, 5, 5),
            mask=Call(np.tril, Call(np.ones, (5, 5), bool)),
        ),
        _case(
            "DeepSeek-V3.2 sparse MLA (top 2 keys)",
            Call(_MLA, 6, 2, q_lora_rank=4, index_topk=2, index_n_heads=4, index_head_dim=3, rng=R, **_MLA_DIMS),
            N(2, 5, 6),
        ),
    ],
    stream=31,
)

# Gemma 4's layers: SharedKVAttention with keys as values and proportional RoPE (full layers), with
# a window (sliding layers), the per-layer input of a decoder layer, routed experts beside the MLP
# (its router's own norm, scale and per-expert scales) and the per-layer embeddings.
_GEMMA4_ROPE = {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 50.0}
_SHARED_KV = _Part(
    "shared kv",
    {"x": N(2, 5, 8)},
    [
        _case(
            "SharedKVAttention (k_eq_v, proportional RoPE, 4 heads on 1)",
            Call(SharedKVAttention, 8, 4, 1, 6, k_eq_v=True, rope_scaling=_GEMMA4_ROPE, rng=R),
            S.x,
        ),
        _case(
            "SharedKVAttention (window 2, bias, 4 heads on 2)",
            Call(SharedKVAttention, 8, 4, 2, 4, bias=True, window=(2, 0), rope_scaling={"rope_theta": 30.0}, rng=R),
            S.x,
        ),
        _case("PerLayerInput (gelu tanh gate)", Call(PerLayerInput, 8, 3, rng=R), S.x, N(2, 5, 3)),
        _case(
            "DenseWithExperts (top 2 of 3 experts beside the MLP)", Call(DenseWithExperts, 8, 6, 3, 2, 4, rng=R), S.x
        ),
        _case(
            "PerLayerEmbeddings (3 layers of 2)",  # no padding row: it has no gradient, as torch's
            Call(PerLayerEmbeddings, 7, 8, 3, 2, rng=R),
            np.array([[1, 0, 4, 6, 2], [3, 5, 5, 0, 1]]),
            S.x,
        ),
    ],
    stream=41,
)

# Kimi Linear's KDA: the chunked rule with a decay per key channel and an initial state, and the
# KimiDeltaAttention layer (short convolutions, low-rank decay, sigmoid output gate, norm).
_KDA = _Part(
    "kda",
    {},
    [
        _case(
            "kimi_delta_attention (chunks of 3, l2norm, initial state)",
            (kda, F.kimi_delta_attention_backward, F.kimi_delta_attention_jvp),
            *(N(2, 2, 7, 3), N(2, 2, 7, 3), N(2, 2, 7, 2)),  # q, k, v: (lead..., L, dk | dv)
            Call(np.negative, U(0.05, 1.0, 2, 2, 7, 3)),  # g: one per key channel
            U(0.1, 0.9, 2, 2, 7),  # beta
            N(2, 2, 3, 2),  # initial state (lead..., dk, dv)
        ),
        _case(
            "KimiDeltaAttention (2 heads of 3)", Call(KimiDeltaAttention, 6, 2, 3, 3, chunk_size=3, rng=R), N(2, 5, 6)
        ),
    ],
    stream=51,
)

_TABLE = [
    _CORE_OPS,
    _OP_OPTIONS,
    _EMB_LOSS_OPTIONS,
    _ATTENTION,
    _MODULES,
    _ATTENTION_MODULES,
    _MODULE_OPTIONS,
    _DECODER,
    _MHA_OPTIONS,
    _MOE,
    _MOE_PAIRS,
    _DELTA_NET,
    _LATENT,
    _SPARSE,
    _SHARED_KV,
    _KDA,
]


def _fmt_row(cells, widths):
    return " | ".join(
        [cells[0].ljust(widths[0])]
        + [c.rjust(w) for c, w in zip(cells[1:3], widths[1:3])]
        + [cells[3].ljust(widths[3])]
    ).rstrip()


_TITLES = {
    1: (
        "gradcheck: hand-written backward and forward mode (JVP) vs central differences "
        "(float64; errors over inputs and parameters, both modes)",
        "backward and forward mode",
    ),
    2: (
        "gradgradcheck: hand-written second order (backward_jvp) vs central differences of the backward, "
        "and <u, Hv> = <Hu, v> (float64; errors over every gradient along every input, parameter and dout)",
        "second order",
    ),
}


def run(seed: int = 0, printer: Callable[[str], Any] = print, order: int = 1) -> bool:
    """Run every case, print the table; True when all pass.  ``order=2`` runs ``gradgradcheck``
    where a case has a second order; the others are listed as skipped, with the reason."""
    start = time.perf_counter()
    results: List[Tuple[str, float, float, Optional[bool], Any]] = []  # (name, abs, rel, ok, detail); ok None: skipped
    for name, thunk in cases(seed) if order == 1 else cases(seed, order):
        try:
            report = thunk()
        except Exception as e:  # a crash is a failure, reported in the table
            results.append((name, float("nan"), float("nan"), False, f"{type(e).__name__}: {e}"))
            continue
        if isinstance(report, Skipped):
            results.append((name, float("nan"), float("nan"), None, report.reason))
            continue
        results.append(
            (name, max(r.max_abs_err for r in report.rows), max(r.max_rel_err for r in report.rows), report.ok, report)
        )
    head = ("name", "max abs err", "max rel err", "ok")
    body = [
        (n, "-", "-", "skipped") if ok is None else (n, f"{a:.2e}", f"{r:.2e}", "yes" if ok else "NO")
        for n, a, r, ok, _ in results
    ]
    widths = [max(len(row[i]) for row in [head] + body) for i in range(4)]
    title, what = _TITLES[order]
    printer(title)
    printer(_fmt_row(head, widths))
    printer("-+-".join("-" * w for w in widths))
    for row in body:
        printer(_fmt_row(row, widths))
    failed = [(n, detail) for n, _, _, ok, detail in results if ok is False]
    for name, detail in failed:
        printer(f"\n{name}:\n{detail}")
    skipped = [(n, reason) for n, _, _, ok, reason in results if ok is None]
    if skipped:
        printer(f"\nskipped, no {what} to check ({len(skipped)}):")
        for name, reason in skipped:
            printer(f"  {name}: {reason}")
    checked = len(results) - len(skipped)
    printer(
        f"\n{checked - len(failed)}/{checked} cases passed"
        + (f", {len(skipped)} skipped" if skipped else "")
        + f" ({what}, float64 central differences, seed {seed}) in {time.perf_counter() - start:.1f} s"
    )
    return not failed


def main(args: Any) -> int:
    return 0 if run(getattr(args, "seed", 0), order=getattr(args, "order", 1)) else 1
