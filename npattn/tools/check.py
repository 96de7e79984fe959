"""``npattn check``: ``npattn.gradcheck`` over every module and functional op, as a table.

Every hand-written derivative is checked in both modes (``gradcheck(..., mode="both")``): the
backward against central finite differences in float64, at small sizes, with a random upstream
gradient, and the forward mode (the op's ``_jvp``, ``Module.jvp``) against the central difference
of the output along a random tangent, and against the backward (``<g, J v> = <J^T g, v>``);
``--seed`` picks the inputs, the upstream gradient and the tangents.  One table row per case
gives the worst absolute and relative error over all checked tensors of the case (inputs and
parameters) in both modes; a failing case is followed by its full per-tensor report (one row per
tensor and mode).  The exit code is 1 when any case fails (or raises), else 0.

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
import time
from typing import Any, Callable, List, Tuple

import numpy as np

__all__ = ["cases", "run", "main"]


def cases(seed: int = 0) -> List[Tuple[str, Callable[[], Any]]]:
    """``[(name, thunk)]``: each thunk runs one ``gradcheck`` and returns its report."""
    from .. import functional as F
    from ..book import CausalAttention, MultiHeadAttentionWrapper, SelfAttention_v1, SelfAttention_v2
    from ..book import MultiHeadAttention as BookMultiHeadAttention
    from ..models import TinyTransformer
    from ..nn.attention import MultiHeadAttention
    from ..nn.layers import Dropout, Embedding, FeedForward, LayerNorm, Linear
    from ..nn.transformer import EncoderBlock
    from ..testing.gradcheck import gradcheck

    rng = np.random.default_rng(seed)

    def randn(*shape):
        return rng.standard_normal(shape)

    def check(target, *inputs, mode="both", **kwargs):
        return lambda: gradcheck(target, *inputs, seed=seed, mode=mode, **kwargs)

    b, L, d = 2, 4, 6
    x = randn(b, L, d)
    q, k, v = randn(b, 2, 3, 4), randn(b, 2, 5, 4), randn(b, 2, 5, 3)
    q4 = randn(b, 4, 3, 4)  # 4 query heads over the 2 kv heads of k, v
    qs, ks, vs = randn(b, 2, 5, 4), randn(b, 2, 5, 4), randn(b, 2, 5, 3)  # square, for causal
    bool_mask = rng.random((b, 1, 3, 5)) < 0.7
    bool_mask[..., 0] = True
    bool_mask[0, 0, 1] = False  # one fully masked query row: output 0, gradient 0
    float_mask = randn(3, 5)
    kpm = np.zeros((b, L), dtype=bool)
    kpm[1, -1] = True
    attn_mask = ~np.triu(np.ones((L, L), dtype=bool), k=1)

    out = [
        # -- functional ops --------------------------------------------------------------------
        ("linear", check(F.linear, x, randn(5, d), randn(5))),
        ("linear (no bias)", check(F.linear, x, randn(5, d))),
        ("embedding", check(F.embedding, rng.integers(0, 7, (b, L)), randn(7, d))),
        ("softmax (last axis)", check(F.softmax, x)),
        ("softmax (axis=1)", check(F.softmax, x, axis=1)),
        ("relu", check(F.relu, x)),
        ("gelu (erf)", check(F.gelu, x)),
        ("gelu (tanh)", check(F.gelu, x, approximate="tanh")),
        ("dropout (p=0.3, fixed rng)", check(F.dropout, x, 0.3, np.random.default_rng(seed))),
        ("layer_norm", check(F.layer_norm, x, 1 + 0.1 * randn(d), randn(d))),
        ("layer_norm (no affine)", check(F.layer_norm, x)),
        ("cross_entropy", check(F.cross_entropy, randn(b, L, 5), rng.integers(0, 5, (b, L)))),
        (
            "cross_entropy (ignore_index)",
            check(
                F.cross_entropy,
                randn(b, L, 5),
                np.where(rng.random((b, L)) < 0.3, -100, rng.integers(0, 5, (b, L))),
                ignore_index=-100,
            ),
        ),
        ("sdpa", check(F.scaled_dot_product_attention, q, k, v)),
        ("sdpa (no head axis)", check(F.scaled_dot_product_attention, randn(b, 3, 4), randn(b, 5, 4), randn(b, 5, 3))),
        ("sdpa (causal)", check(F.scaled_dot_product_attention, qs, ks, vs, is_causal=True)),
        ("sdpa (causal, Lq < Lk)", check(F.scaled_dot_product_attention, q, k, v, is_causal=True)),
        ("sdpa (bool mask, empty row)", check(F.scaled_dot_product_attention, q, k, v, attn_mask=bool_mask)),
        ("sdpa (float mask)", check(F.scaled_dot_product_attention, q, k, v, attn_mask=float_mask)),
        ("sdpa (scale=0.3)", check(F.scaled_dot_product_attention, q, k, v, scale=0.3)),
        ("sdpa (GQA)", check(F.scaled_dot_product_attention, q4, k, v, enable_gqa=True)),
        ("sdpa (GQA, causal)", check(F.scaled_dot_product_attention, q4, k, v, enable_gqa=True, is_causal=True)),
        (
            "sdpa (dropout, fixed rng)",
            check(F.scaled_dot_product_attention, q, k, v, dropout_p=0.3, rng=np.random.default_rng(seed)),
        ),
    ]
    out += [
        ("memory_efficient_attention", check(F.memory_efficient_attention, q, k, v, block_size=2)),
        (
            "memory_efficient_attention (causal)",
            check(F.memory_efficient_attention, qs, ks, vs, is_causal=True, block_size=2),
        ),
        (
            "memory_efficient_attention (bool mask)",
            check(F.memory_efficient_attention, q, k, v, attn_mask=bool_mask, block_size=2),
        ),
        (
            "memory_efficient_attention (float mask)",
            check(F.memory_efficient_attention, q, k, v, attn_mask=float_mask, block_size=3),
        ),
    ]
    out += _option_cases(rng, check, seed)

    # -- modules -----------------------------------------------------------------------------
    r = seed  # module initialisation seed
    out += [
        ("Linear", check(Linear(d, 5, rng=r), x)),
        ("Linear (no bias)", check(Linear(d, 5, bias=False, rng=r), x)),
        ("LayerNorm", check(LayerNorm(d), x)),
        ("Dropout (p=0.3, fixed rng)", check(Dropout(0.3, rng=r), x)),
        ("Embedding", check(Embedding(7, d, rng=r), rng.integers(0, 7, (b, L)))),
    ]
    for act in ("relu", "gelu", "gelu_tanh"):
        out.append((f"FeedForward ({act})", check(FeedForward(d, 8, activation=act, rng=r), x)))
    xc, kc, vc = randn(b, 5, 4), randn(b, 5, 3), randn(b, 5, 3)
    out += [
        ("MultiHeadAttention (self)", check(MultiHeadAttention(d, d, 2, rng=r), x)),
        ("MultiHeadAttention (qkv_bias)", check(MultiHeadAttention(d, d, 2, qkv_bias=True, rng=r), x)),
        ("MultiHeadAttention (cross, kdim/vdim)", check(MultiHeadAttention(d, d, 2, kdim=3, vdim=3, rng=r), x, kc, vc)),
        ("MultiHeadAttention (cross, same dims)", check(MultiHeadAttention(4, 6, 2, rng=r), randn(b, L, 4), xc, xc)),
        ("MultiHeadAttention (GQA)", check(MultiHeadAttention(8, 8, 4, num_kv_heads=2, rng=r), randn(b, L, 8))),
        (
            "MultiHeadAttention (masks)",
            check(MultiHeadAttention(d, d, 2, rng=r), x, attn_mask=attn_mask, key_padding_mask=kpm),
        ),
        ("MultiHeadAttention (causal)", check(MultiHeadAttention(d, d, 2, causal=True, rng=r), x)),
        ("MultiHeadAttention (dropout)", check(MultiHeadAttention(d, d, 2, dropout=0.2, rng=r), x)),
        (
            "MultiHeadAttention (memory_efficient)",
            check(MultiHeadAttention(d, d, 2, causal=True, memory_efficient=True, rng=r), x),
        ),
        ("EncoderBlock (post-norm)", check(EncoderBlock(d, 2, 8, dropout=0.0, rng=r), x)),
        (
            "EncoderBlock (pre-norm, causal)",
            check(EncoderBlock(d, 2, 8, dropout=0.0, norm_first=True, causal=True, rng=r), x),
        ),
        ("EncoderBlock (dropout, gelu)", check(EncoderBlock(d, 2, 8, dropout=0.2, activation="gelu", rng=r), x)),
        ("EncoderBlock (key_padding_mask)", check(EncoderBlock(d, 2, 8, dropout=0.0, rng=r), x, key_padding_mask=kpm)),
        ("book.SelfAttention_v1", check(SelfAttention_v1(d, 4, rng=r), x)),
        ("book.SelfAttention_v2", check(SelfAttention_v2(d, 4, rng=r), x)),
        ("book.CausalAttention", check(CausalAttention(d, 4, L, 0.2, rng=r), x)),
        ("book.MultiHeadAttentionWrapper", check(MultiHeadAttentionWrapper(d, 2, L, 0.0, 2, rng=r), x)),
        ("book.MultiHeadAttention", check(BookMultiHeadAttention(d, d, L, 0.0, 2, rng=r), x)),
        ("book.MultiHeadAttention (2-d input)", check(BookMultiHeadAttention(d, d, L, 0.0, 2, rng=r), x[0])),
        ("TinyTransformer", check(TinyTransformer(5, 6, 8, 2, 2, 12, rng=r), rng.integers(0, 5, (b, 5)))),
    ]
    out += _module_option_cases(rng, check, r)
    out += _moe_cases(rng, check, r)
    out += _delta_net_cases(rng, check, r)
    out += _latent_cases(rng, check, r)
    return out


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


def _option_cases(rng, check, seed):
    """The newer functional ops and options: rms_norm, silu, rope, layer_norm over several axes,
    embedding and cross_entropy options, and every attention option in both attention cores."""
    from .. import functional as F

    def randn(*shape):
        return rng.standard_normal(shape)

    b, L, d = 2, 4, 6
    x = randn(b, L, d)
    out = [
        ("silu", check(F.silu, x)),
        ("rms_norm", check(F.rms_norm, x, 1 + 0.1 * randn(d))),
        ("rms_norm (no weight)", check(F.rms_norm, x)),
        ("rms_norm (2 axes, eps)", check(F.rms_norm, x, 1 + 0.1 * randn(L, d), 1e-5)),
        ("rope (rotate half)", check(F.rope, x)),
        ("rope (interleaved)", check(F.rope, x, interleaved=True)),
        ("rope (offset positions)", check(F.rope, x, np.arange(L) + 7, base=100.0)),
        ("rope (per-batch positions, interleaved)", check(F.rope, x, rng.integers(0, 50, (b, L)), interleaved=True)),
        (
            "rope (yarn, partial rotary)",
            check(
                F.rope,
                x,
                scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2},
                rotary_dim=4,
            ),
        ),
        (
            "rope (llama3)",
            check(
                F.rope,
                x,
                np.arange(L) + 9,
                scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 4,
                },
            ),
        ),
        ("layer_norm (2 axes)", check(F.layer_norm, x, 1 + 0.1 * randn(L, d), randn(L, d))),
        ("layer_norm (2 axes, no affine)", check(F.layer_norm, x, normalized_shape=(L, d))),
        ("layer_norm (weight only)", check(F.layer_norm, x, 1 + 0.1 * randn(d))),
    ]
    # embedding: the padding row gets no gradient by definition (torch), so it is held fixed at 0
    # and checked to receive exactly 0; scale_grad_by_freq divides each row's gradient by its count.
    ids = rng.integers(0, 7, (b, L))
    ids[0, 0] = 2
    ids[1, 1:3] = 5
    counts = np.bincount(ids.ravel(), minlength=7)[:, None]

    def emb_pad(ids, w_rest):
        weight = np.insert(w_rest, 2, 0.0, axis=0)
        return F.embedding(ids, weight, padding_idx=2)

    def emb_pad_backward(dout, cache):
        dweight = F.embedding_backward(dout, cache)
        if np.any(dweight[2] != 0):
            raise AssertionError("embedding: the padding_idx row received a gradient")
        return np.delete(dweight, 2, axis=0)

    def emb_freq(ids, weight):
        return F.embedding(ids, weight, scale_grad_by_freq=True)

    def emb_pad_jvp(cache, tw_rest):  # the held padding row does not move
        return F.embedding_jvp(cache, np.insert(tw_rest, 2, 0.0, axis=0))

    def emb_freq_backward(dout, cache):
        return F.embedding_backward(dout, cache) * np.maximum(counts, 1)

    n_cls = 5
    logits, targets = randn(b, L, n_cls), rng.integers(0, n_cls, (b, L))
    probs = F.softmax(randn(b, L, n_cls))[0]
    cw = rng.uniform(0.5, 2.0, n_cls)
    out += [
        ("embedding (padding_idx)", check((emb_pad, emb_pad_backward, emb_pad_jvp), ids, randn(6, d))),
        ("embedding (scale_grad_by_freq)", check((emb_freq, emb_freq_backward, F.embedding_jvp), ids, randn(7, d))),
        ("cross_entropy (weight)", check(F.cross_entropy, logits, targets, weight=cw)),
        ("cross_entropy (reduction=sum)", check(F.cross_entropy, logits, targets, reduction="sum")),
        ("cross_entropy (reduction=none)", check(F.cross_entropy, logits, targets, reduction="none")),
        ("cross_entropy (label_smoothing)", check(F.cross_entropy, logits, targets, label_smoothing=0.1)),
        ("cross_entropy (probabilities, weight)", check(F.cross_entropy, logits, targets=probs, weight=cw)),
    ]

    # attention options, in both cores: q (b, 2, 3, 4) against k, v of 5 keys (Lq < Lk)
    q, k, v = randn(b, 2, 3, 4), randn(b, 2, 5, 4), randn(b, 2, 5, 3)
    q4 = randn(b, 4, 3, 4)
    slopes, sinks, fmask = rng.uniform(0.1, 1.0, 2), randn(2), randn(3, 5)
    cores = [
        (
            "sdpa",
            F.scaled_dot_product_attention,
            F.scaled_dot_product_attention_backward,
            F.scaled_dot_product_attention_jvp,
            {},
        ),
        (
            "memory_efficient_attention",
            F.memory_efficient_attention,
            F.memory_efficient_attention_backward,
            F.memory_efficient_attention_jvp,
            {"block_size": 2},
        ),
    ]
    for core, fwd, bwd, jvp, blk in cores:

        def opt(label, *extras, qq=q, **opts):
            rng_kw = {"rng": opts.pop("rng")} if "rng" in opts else {}  # gradcheck renews it per call
            pair = _opts_pair(fwd, bwd, jvp, [e for e, _ in extras], **blk, **opts)
            return (f"{core} ({label})", check(pair, qq, k, v, *[a for _, a in extras], **rng_kw))

        out += [
            opt("causal, bottom_right", is_causal=True, causal_align="bottom_right"),
            opt("window (2, 1)", window=(2, 1)),
            opt("window (1, -1), bottom_right", window=(1, -1), causal_align="bottom_right"),
            opt("causal, window (1, 0)", is_causal=True, window=(1, 0), causal_align="bottom_right"),
            opt("alibi_slopes", alibi_slopes=slopes),
            opt("softcap", softcap=1.5),
            opt("sinks -> dsinks", ("sinks", sinks)),
            opt("mask_grad -> dmask", ("attn_mask", fmask)),
            opt(
                "all options, GQA -> dmask, dsinks",
                ("attn_mask", randn(b, 1, 3, 5)),
                ("sinks", randn(4)),
                qq=q4,
                enable_gqa=True,
                is_causal=True,
                causal_align="bottom_right",
                window=(2, 0),
                alibi_slopes=rng.uniform(0.1, 1.0, 4),
                softcap=2.0,
            ),
            opt(
                "options, dropout (fixed rng)",
                ("sinks", sinks),
                window=(1, 1),
                softcap=2.0,
                alibi_slopes=slopes,
                dropout_p=0.3,
                rng=np.random.default_rng(seed),
            ),
        ]
    return out


def _module_option_cases(rng, check, r):
    """The newer modules and module options: RMSNorm, SiLU/SwiGLU feed-forwards, EncoderBlock(bias=False),
    DecoderBlock, MultiHeadAttention's attention options, book.GPTModel."""
    from .. import book
    from ..nn import layers, transformer
    from ..nn.attention import MultiHeadAttention

    def randn(*shape):
        return rng.standard_normal(shape)

    b, L, d = 2, 4, 6
    x = randn(b, L, d)
    out = [
        ("RMSNorm", check(layers.RMSNorm(d), x)),
        ("RMSNorm (2 axes, no affine)", check(layers.RMSNorm((L, d), elementwise_affine=False), x)),
    ]
    out += [
        ("FeedForward (silu)", check(layers.FeedForward(d, 8, activation="silu", rng=r), x)),
        ("FeedForward (swiglu)", check(layers.FeedForward(d, 8, activation="swiglu", rng=r), x)),
        ("FeedForward (swiglu, no bias)", check(layers.FeedForward(d, 8, activation="swiglu", bias=False, rng=r), x)),
        ("EncoderBlock (bias=False)", check(transformer.EncoderBlock(d, 2, 8, dropout=0.0, bias=False, rng=r), x)),
    ]
    xd, mem = randn(1, 3, 4), randn(1, 2, 4)
    tgt_mask = ~np.triu(np.ones((3, 3), dtype=bool), k=1)
    out += [
        (
            "DecoderBlock (post-norm, tgt_mask)",
            check(transformer.DecoderBlock(4, 2, 6, dropout=0.0, rng=r), xd, mem, tgt_mask=tgt_mask),
        ),
        (
            "DecoderBlock (pre-norm, causal, swiglu, bias=False)",
            check(
                transformer.DecoderBlock(
                    4, 2, 6, dropout=0.0, norm_first=True, causal=True, activation="swiglu", bias=False, rng=r
                ),
                xd,
                mem,
            ),
        ),
    ]
    x8 = randn(b, 5, 8)

    def mha(**kw):
        return MultiHeadAttention(8, 8, 2, rng=r, **kw)

    sink_mha = mha(sinks=True)
    sink_mha.sinks.data[...] = randn(2)  # away from the zeros it starts with
    all_mha = MultiHeadAttention(
        8,
        8,
        4,
        num_kv_heads=2,
        causal=True,
        window=(3, 0),
        alibi=True,
        softcap=2.0,
        sinks=True,
        rope=True,
        qk_norm=True,
        memory_efficient=True,
        rng=r,
    )
    all_mha.sinks.data[...] = randn(4)
    all_mha.q_norm.weight.data[...] += 0.1 * randn(*all_mha.q_norm.weight.data.shape)
    out += [
        ("MultiHeadAttention (window, causal)", check(mha(causal=True, window=(2, 0)), x8)),
        ("MultiHeadAttention (alibi)", check(mha(causal=True, alibi=True), x8)),
        ("MultiHeadAttention (softcap)", check(mha(softcap=1.5), x8)),
        ("MultiHeadAttention (sinks)", check(sink_mha, x8)),
        ("MultiHeadAttention (rope)", check(mha(causal=True, rope=True, rope_base=100.0), x8)),
        ("MultiHeadAttention (qk_norm)", check(mha(qk_norm=True), x8)),
        (
            "MultiHeadAttention (Qwen3-Next: output gate, head_dim, partial rotary, (1 + w) qk_norm)",
            check(
                mha(
                    causal=True,
                    output_gate=True,
                    head_dim=6,
                    rope=True,
                    partial_rotary_factor=2 / 3,
                    qk_norm=True,
                    qk_norm_unit_offset=True,
                    qk_norm_eps=1e-6,
                ),
                x8,
            ),
        ),
        (
            "MultiHeadAttention (Gemma 3 / GPT-OSS: scale, window, yarn, biases)",
            check(
                mha(
                    causal=True,
                    window=(2, 0),
                    scale=0.3,
                    rope=True,
                    qkv_bias=True,
                    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2},
                ),
                x8,
            ),
        ),
        (
            "MultiHeadAttention (cross, bottom_right)",
            check(mha(causal=True, causal_align="bottom_right"), randn(b, 3, 8), x8, x8),
        ),
        ("MultiHeadAttention (all options, GQA, memory_efficient)", check(all_mha, x8)),
    ]
    cfg = {
        "vocab_size": 7,
        "context_length": 6,
        "emb_dim": 8,
        "n_heads": 2,
        "n_layers": 1,
        "drop_rate": 0.0,
        "qkv_bias": True,
    }
    out.append(("book.GPTModel (tiny)", check(book.GPTModel(cfg, rng=r), rng.integers(0, 7, (b, 5)))))
    return out


def _moe_cases(rng, check, r):
    """The mixture-of-experts blocks of the three families (router variants, both kinds of
    experts, shared experts and their gate), built from Hugging Face config fields."""
    from ..nn.moe import SparseMoeBlock

    x = rng.uniform(-1.5, 1.5, (2, 3, 5))
    families = {
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
    out = [
        (f"SparseMoeBlock ({name})", check(SparseMoeBlock.from_hf_config(dict(cfg, hidden_size=5), rng=r), x))
        for name, cfg in families.items()
    ]
    return out + _moe_pair_cases(np.random.default_rng((r, 22)), check)


def _moe_pair_cases(rng, check):
    """The functional pairs under the blocks: ``topk_router`` (DeepSeek-V3's sigmoid routing with
    groups; random logits are tie-free) and ``moe_experts`` (both kinds)."""
    from .. import functional as F

    bias = rng.uniform(-0.3, 0.3, 8)

    def router(logits):
        (w, _), cache = F.topk_router(
            logits, 3, variant="sigmoid", norm_topk_prob=True, correction_bias=bias, n_group=4, topk_group=2,
            routed_scaling_factor=2.5,
        )  # fmt: skip
        return w, cache

    x = rng.standard_normal((2, 3, 4))
    idx = rng.integers(0, 5, (2, 3, 2))
    w = rng.uniform(0.1, 1.0, (2, 3, 2))
    swiglu = (rng.standard_normal((5, 6, 4)), rng.standard_normal((5, 4, 3)))
    gpt_oss = tuple(rng.standard_normal(s) for s in ((5, 4, 6), (5, 3, 4), (5, 6), (5, 4)))
    return [
        (
            "topk_router (sigmoid, groups)",
            check((router, F.topk_router_backward, F.topk_router_jvp), rng.standard_normal((2, 3, 8))),
        ),
        ("moe_experts (swiglu)", check(F.moe_experts, x, idx, w, *swiglu)),
        ("moe_experts (gpt_oss)", check(F.moe_experts, x, idx, w, *gpt_oss, kind="gpt_oss")),
    ]


def _latent_cases(rng, check, r):
    """``MultiHeadLatentAttention`` (DeepSeek-V3's MLA): the plain and the absorbed form, the
    query through ``q_proj`` or the low-rank ``q_lora_rank`` path with biases and YaRN."""
    from ..nn.latent_attention import MultiHeadLatentAttention

    dims = {"kv_lora_rank": 3, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 2}
    yarn = {"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 0.7, "original_max_position_embeddings": 2}
    x = rng.standard_normal((2, 3, 6))
    plain = MultiHeadLatentAttention(6, 2, rng=r, **dims)
    lora = MultiHeadLatentAttention(6, 2, q_lora_rank=4, attention_bias=True, rope_scaling=yarn, rng=r, **dims)
    return [
        ("MultiHeadLatentAttention (q_proj)", check(plain, x)),
        ("MultiHeadLatentAttention (q_proj, absorbed)", check(plain, x, absorb=True)),
        ("MultiHeadLatentAttention (q_lora_rank, bias, yarn, absorbed)", check(lora, x, absorb=True)),
    ]


def _delta_net_cases(rng, check, r):
    """Gated DeltaNet's pairs (the chunked delta rule with an initial state, the short convolution
    with its carried state, both norms) and the ``GatedDeltaNet`` layer with grouped key heads."""
    from .. import functional as F
    from ..nn.delta_net import GatedDeltaNet

    lead, L, dk, dv = (2, 2), 7, 3, 2

    def delta_rule(q, k, v, g, beta, initial_state):
        return F.gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, use_qk_l2norm=True, chunk_size=3)

    def conv(x, weight, bias, initial_state):
        return F.causal_conv1d(x, weight, bias, activation="silu", initial_state=initial_state)

    x = rng.standard_normal((2, 5, 4))
    return [
        (
            "gated_delta_rule (chunks of 3, l2norm, initial state)",
            check(
                (delta_rule, F.gated_delta_rule_backward, F.gated_delta_rule_jvp),
                rng.standard_normal(lead + (L, dk)),
                rng.standard_normal(lead + (L, dk)),
                rng.standard_normal(lead + (L, dv)),
                -rng.uniform(0.05, 1.0, lead + (L,)),
                rng.uniform(0.1, 0.9, lead + (L,)),
                rng.standard_normal(lead + (dk, dv)),
            ),
        ),
        (
            "causal_conv1d (silu, bias, initial state)",
            check((conv, F.causal_conv1d_backward, F.causal_conv1d_jvp), x, rng.standard_normal((4, 3)),
                  rng.standard_normal(4), rng.standard_normal((2, 2, 4))),
        ),  # fmt: skip
        ("l2_norm", check(F.l2_norm, x)),
        ("rms_norm_gated", check(F.rms_norm_gated, x, rng.standard_normal(x.shape), 1 + 0.1 * rng.standard_normal(4))),
        ("GatedDeltaNet (4 value heads, 2 key heads)", check(GatedDeltaNet(6, 4, 2, 2, 3, 3, chunk_size=3, rng=r),
                                                              rng.standard_normal((2, 5, 6)))),
    ]  # fmt: skip


def _fmt_row(cells, widths):
    return " | ".join(
        [cells[0].ljust(widths[0])]
        + [c.rjust(w) for c, w in zip(cells[1:3], widths[1:3])]
        + [cells[3].ljust(widths[3])]
    ).rstrip()


def run(seed: int = 0, printer: Callable[[str], Any] = print) -> bool:
    """Run every case, print the table; True when all pass."""
    start = time.perf_counter()
    results = []  # (name, abs, rel, ok, report_or_error)
    for name, thunk in cases(seed):
        try:
            report = thunk()
        except Exception as e:  # a crash is a failure, reported in the table
            results.append((name, float("nan"), float("nan"), False, f"{type(e).__name__}: {e}"))
            continue
        results.append(
            (name, max(r.max_abs_err for r in report.rows), max(r.max_rel_err for r in report.rows), report.ok, report)
        )
    head = ("name", "max abs err", "max rel err", "ok")
    body = [(n, f"{a:.2e}", f"{r:.2e}", "yes" if ok else "NO") for n, a, r, ok, _ in results]
    widths = [max(len(row[i]) for row in [head] + body) for i in range(4)]
    printer(
        "gradcheck: hand-written backward and forward mode (JVP) vs central differences "
        "(float64; errors over inputs and parameters, both modes)"
    )
    printer(_fmt_row(head, widths))
    printer("-+-".join("-" * w for w in widths))
    for row in body:
        printer(_fmt_row(row, widths))
    failed = [(n, detail) for n, _, _, ok, detail in results if not ok]
    for name, detail in failed:
        printer(f"\n{name}:\n{detail}")
    printer(
        f"\n{len(results) - len(failed)}/{len(results)} cases passed "
        f"(backward and forward mode, float64 central differences, seed {seed}) in {time.perf_counter() - start:.1f} s"
    )
    return not failed


def main(args: Any) -> int:
    return 0 if run(getattr(args, "seed", 0)) else 1
