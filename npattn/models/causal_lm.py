"""``CausalLM``: one config-driven decoder-only language model for the open model families.

A family is a ``CausalLMConfig`` (``configs.py``), not a class.  The network, for every family::

    x = embed_tokens(ids)                        # (B, L, hidden); Gemma: * sqrt(hidden); Granite: * its multiplier
                                                 # GPT-2: + wpe(positions), a learned row a position (no RoPE)
    for layer in layers:                         # pre-norm residual blocks
        h = input_layernorm(x)                   # OLMo 2/3 (post-norm): h = x, no norm before a sublayer;
                                                 # Cohere's norms: LayerNorm (mean subtracted), no bias
        a = attention(h)                         # MHA (full / sliding window), MLA, DeltaNet, ShortConv, Mamba-2;
                                                 # Falcon-H1: MHA and Mamba-2 side by side, summed (ParallelSum);
                                                 # Cohere: MHA and the MLP side by side (no m below)
                                                 # layer kind "none" (Nemotron-H's MLP blocks): no a, x stays
        a = post_attention_layernorm(a)          # Gemma's "sandwich" and OLMo's post-norm only
        x = x + a                                # Granite: x + a * residual_multiplier (and so for m)
        h = pre_mlp_norm(x)                      # post_attention_layernorm, or Gemma's pre_feedforward_layernorm;
                                                 # GPT-NeoX's parallel residual: of the layer's input x, not x + a
        m = mlp(h)                               # gated MLP, plain MLP (down(act(up(h)))), or routed experts;
                                                 # MLP kind "none" (Nemotron-H's other blocks): no m, no pre-MLP norm
        m = post_feedforward_layernorm(m)        # Gemma only
        x = x + m
    logits = lm_head(norm(x))                    # tied: embed_tokens.weight; Granite: / logits_scaling;
                                                 # then Gemma 2/3: c * tanh(logits / c)

Backward visits the same modules in reverse.  A residual ``x + f(norm(x))`` passes its gradient
``dx`` straight through and adds the branch's ``norm.backward(f.backward(dx))``; a sandwich norm is
one more module on the branch.  The tied head is a second use of the embedding table, so its
gradient ``dlogits^T h`` is added to the embedding's own (the rows of the looked-up tokens).

Parameter names are Hugging Face's (``model.layers.{i}.self_attn.q_proj.weight``...): the decoder
layer renames the few modules whose own names differ (``MultiHeadAttention``'s ``W_query``,
``FeedForward``'s ``linear1``...), so ``named_parameters()``, ``state_dict()`` and
``load_state_dict()`` speak the checkpoint's language.  Phi-3's checkpoints stack q, k and v into
``qkv_proj`` and gate and up into ``gate_up_proj``: the model keeps the split projections under
Llama's names (``q_proj``, ``gate_proj``, ...), ``from_hf`` reads either, ``save_pretrained``
writes the fused ones (``CheckpointLayout.fused``).  LFM2 names its modules its own way
(``operator_norm``, ``feed_forward.w1``, ``self_attn.out_proj``, ``embedding_norm``...): its
``CausalLMConfig.layer_names`` and ``final_norm_name`` rename them in the model itself; so do
Nemotron-H's (each block's one ``norm`` and ``mixer``, ``embeddings``, ``norm_f``), whose
checkpoints also say ``backbone.`` for ``model.`` (``CheckpointLayout.renames``).
"""

from __future__ import annotations

import math
import numbers
import os
from typing import NamedTuple

import numpy as np

from .. import functional as F
from .._validate import as_index, as_rng, check_bool, check_dtype, to_numpy
from ..functional import kernels as K
from ..functional._bfloat16 import BFloat16Array, to_bfloat16_bits
from ..nn.attention import MultiHeadAttention
from ..nn.containers import ModuleList, ParallelSum
from ..nn.delta_net import GatedDeltaNet, RecurrentLayer
from ..nn.kimi_delta import KimiDeltaAttention
from ..nn.latent_attention import MultiHeadLatentAttention
from ..nn.layers import Embedding, FeedForward, LayerNorm, Linear, RMSNorm
from ..nn.mamba2 import Mamba2Mixer
from ..nn.module import Module, is_grad_enabled, no_grad
from ..nn.moe import HIDDEN_ACTS, Experts, GatedMLP, GptOssExperts, PlainExperts, SparseMoeBlock
from ..nn.shared_kv import DenseWithExperts, PerLayerEmbeddings, PerLayerInput, SharedKVAttention
from ..nn.short_conv import ShortConv
from ..nn.transformer import _block_tangents
from .configs import CausalLMConfig, DeltaNetConfig, KdaConfig, Mamba2Config, config_from_hf

__all__ = ["CausalLM", "bfloat16_parameters", "store_bfloat16"]


# -- norms ---------------------------------------------------------------------------------
class _OffsetRMSNorm(RMSNorm):
    """RMSNorm that multiplies by ``1 + weight`` (Gemma, Qwen3-Next; the weight starts at 0).

    ``y = x / rms(x) * (1 + w)``: the gradient of the effective scale ``1 + w`` is the gradient
    of ``w``, so the backward is ``RMSNorm``'s."""

    def _forward(self, x: np.ndarray) -> np.ndarray:
        w = self.weight.data + 1  # type: ignore[union-attr]
        y, cache = K.rms_norm(x, w, self.eps, normalized_shape=self.normalized_shape, keep=is_grad_enabled())
        self.save_for_backward(cache)
        return y


def _norm_params(cfg: CausalLMConfig) -> tuple:
    """A norm's parameters: its weight, and GPT-NeoX's LayerNorm bias; none for OLMo's."""
    if cfg.layer_norm and not cfg.layer_norm_affine:  # OLMo: neither
        return ()
    return ("weight", "bias") if cfg.layer_norm and cfg.layer_norm_bias else ("weight",)


def _norm(cfg: CausalLMConfig, dtype) -> RMSNorm | LayerNorm:
    if cfg.layer_norm:  # Cohere: mean subtracted, a weight and no bias; GPT-NeoX: a bias too
        return LayerNorm(
            cfg.hidden_size,
            eps=cfg.rms_norm_eps,
            elementwise_affine=cfg.layer_norm_affine,
            bias=cfg.layer_norm_bias,
            dtype=dtype,
        )
    cls = _OffsetRMSNorm if cfg.norm_offset else RMSNorm
    return cls(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)


# -- Hugging Face names ----------------------------------------------------------------------
class _Renamed(Module):
    """A container whose submodules' parameter names are shown under Hugging Face's names:
    ``_names`` maps a dotted prefix of npattn's name to the checkpoint's (``named_parameters``,
    ``state_dict`` and ``load_state_dict`` all use the mapped names)."""

    _names: dict = {}

    def _rename(self, name: str) -> str:
        return _renamed(name, self._names.items())

    def named_parameters(self, prefix: str = ""):
        for name, p in super().named_parameters():
            name = self._rename(name)
            yield (f"{prefix}.{name}" if prefix else name), p

    def _state_entries(self, prefix: str = ""):
        for key, owner, name, is_param in super()._state_entries():
            key = self._rename(key)
            yield (f"{prefix}.{key}" if prefix else key), owner, name, is_param


def _renamed(name: str, names) -> str:
    """``name`` under the first of ``names`` (pairs of a dotted prefix and its replacement) that
    prefixes it."""
    for old, new in names:
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
    return name


def _family_names(names: dict, family: tuple) -> dict:
    """``names`` (npattn's prefix -> the checkpoint's) with the family's own names
    (``CausalLMConfig.layer_names``) put in place of the checkpoint's, and the family's other
    entries added."""
    out = {old: _renamed(new, family) for old, new in names.items()}
    for generic, own in family:
        out.setdefault(generic, own)
    return out


_MHA_NAMES = {
    "self_attn.W_query": "self_attn.q_proj",
    "self_attn.W_key": "self_attn.k_proj",
    "self_attn.W_value": "self_attn.v_proj",
    "self_attn.out_proj": "self_attn.o_proj",
}


# the plain MLP (FeedForward: Nemotron-H's, Arcee's) under its checkpoint names
_PLAIN_MLP_NAMES = {"mlp.linear1": "mlp.up_proj", "mlp.linear2": "mlp.down_proj"}
# Gemma 4's MLP beside routed experts (DenseWithExperts, the decoder layer's mlp) under its checkpoint names
_DENSE_WITH_EXPERTS_NAMES = {
    f"mlp.{n}": n
    for n in (
        "pre_feedforward_layernorm",
        "mlp",
        "post_feedforward_layernorm_1",
        "router",
        "experts",
        "pre_feedforward_layernorm_2",
        "post_feedforward_layernorm_2",
    )
}
# Gemma 4's per-layer input parts under their checkpoint names: a decoder layer's, the backbone's
_PER_LAYER_NAMES = {
    f"per_layer.{n}": n for n in ("per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm")
}
_PER_LAYER_MODEL_NAMES = {
    f"per_layer.{n}": n for n in ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")
}


def _attention(cfg: CausalLMConfig, i: int, rng, dtype) -> Module:
    """The attention module of layer ``i``, from its typed sub-config."""
    kind = cfg.layer_types[i]
    if cfg.qkv_clip is not None and (cfg.shared_kv is not None or kind in ("latent_attention", "linear_attention")):
        what = "Gemma 4's shared keys and values" if cfg.shared_kv is not None else f"layers of type {kind!r}"
        raise ValueError(f"qkv_clip: not supported with {what} (only MultiHeadAttention clamps q, k and v)")
    if cfg.shared_kv is not None:  # Gemma 4
        return SharedKVAttention(**cfg.shared_kv[kind].kwargs(), reuse=cfg.reuses_kv(i), rng=rng, dtype=dtype)
    if kind == "latent_attention":
        return MultiHeadLatentAttention(**_sub(cfg.latent).kwargs(), rng=rng, dtype=dtype)
    if kind == "conv":  # LFM2's gated short convolution
        return ShortConv(**_sub(cfg.short_conv).kwargs(), rng=rng, dtype=dtype)
    if kind == "linear_attention":
        la = _sub(cfg.linear_attention)
        kinds = {KdaConfig: KimiDeltaAttention, Mamba2Config: Mamba2Mixer}
        return kinds.get(type(la), GatedDeltaNet)(**la.kwargs(), rng=rng, dtype=dtype)
    if kind == "hybrid":  # Falcon-H1: the Mamba-2 mixer and full attention on the same input, summed
        mamba = Mamba2Mixer(**_sub(cfg.linear_attention).kwargs(), rng=rng, dtype=dtype)
        mha = cfg.attention_config("full_attention", i).kwargs()
        attn = MultiHeadAttention(cfg.hidden_size, cfg.hidden_size, **mha, rng=rng, dtype=dtype)
        a_in, a_out, m_in, m_out = cfg.hybrid_multipliers
        return ParallelSum(
            {"mamba": mamba, "self_attn": attn},
            input_multipliers={"mamba": m_in, "self_attn": a_in},
            output_multipliers={"mamba": m_out, "self_attn": a_out},
        )
    mha = cfg.attention_config(kind, i).kwargs()
    attn = MultiHeadAttention(cfg.hidden_size, cfg.hidden_size, **mha, rng=rng, dtype=dtype)
    if cfg.parallel_mlp:  # Cohere: the MLP beside the attention on the same input, summed
        return ParallelSum({"self_attn": attn, "mlp": _mlp(cfg, i, rng, dtype)})
    return attn


def _mlp(cfg: CausalLMConfig, i: int, rng, dtype) -> Module:
    """The MLP of layer ``i``: the dense gated MLP, the plain one (``up_proj``, ``down_proj``:
    ``FeedForward``), or the routed experts."""
    if cfg.mlp_types[i] == "plain":  # Nemotron-H, Arcee: down(act(up(x))), their activation relu2
        act = HIDDEN_ACTS[cfg.hidden_act]
        return FeedForward(cfg.hidden_size, cfg.mlp_size(i), activation=act, bias=cfg.mlp_bias, rng=rng, dtype=dtype)
    if cfg.mlp_types[i] == "moe":
        return SparseMoeBlock(**_sub(cfg.moe).kwargs(), rng=rng, dtype=dtype)
    if cfg.mlp_types[i] == "dense_and_experts":  # Gemma 4: the MLP and routed experts side by side
        e = _sub(cfg.moe)
        return DenseWithExperts(
            cfg.hidden_size, cfg.mlp_size(i), e.num_experts, e.top_k, e.intermediate_size, e.hidden_act,
            eps=cfg.rms_norm_eps, rng=rng, dtype=dtype,
        )  # fmt: skip
    gate, down = cfg.mlp_multipliers
    return GatedMLP(
        cfg.hidden_size, cfg.mlp_size(i), cfg.hidden_act, bias=cfg.mlp_bias,
        gate_multiplier=gate, down_multiplier=down, rng=rng, dtype=dtype,
    )  # fmt: skip


def _sub(sub):
    """A layer's sub-config, which the config reader gives whenever a layer of its kind exists."""
    if sub is None:  # pragma: no cover - a CausalLMConfig not made by config_from_hf
        raise ValueError("config: a layer's kind has no sub-config (moe, latent, linear_attention, short_conv: None)")
    return sub


# -- shapes from the config alone ----------------------------------------------------------
# What DecoderLayer and CausalLM build, said as (state-dict name, shape) without building anything,
# so that a checkpoint is compared with the config before a single array is allocated and a config
# too large to build is refused by name (tests/test_config_strict.py checks these against the
# built modules of every family and option).
def _lin(name: str, out: int, inp: int, bias: bool) -> list:
    return [(f"{name}.weight", (out, inp))] + ([(f"{name}.bias", (out,))] if bias else [])


def _attention_shapes(cfg: CausalLMConfig, i: int) -> list:
    H, heads, kind = cfg.hidden_size, cfg.num_attention_heads, cfg.layer_types[i]
    if cfg.shared_kv is not None:  # SharedKVAttention (Gemma 4): a reusing layer has no k/v projection
        s = cfg.shared_kv[kind]
        hd, kv_rows, b = s.head_dim, s.num_kv_heads * s.head_dim, s.bias
        out = _lin("q_proj", heads * hd, H, b) + [("q_norm.weight", (hd,))]
        if not cfg.reuses_kv(i):
            out += _lin("k_proj", kv_rows, H, b) + ([] if s.k_eq_v else _lin("v_proj", kv_rows, H, b))
            out += [("k_norm.weight", (hd,))]
        return [(f"self_attn.{n}", s) for n, s in out + _lin("o_proj", H, heads * hd, b)]
    if kind == "latent_attention":  # MultiHeadLatentAttention
        lat = _sub(cfg.latent)
        b, dn, dr, dv = lat.attention_bias, lat.qk_nope_head_dim, lat.qk_rope_head_dim, lat.v_head_dim
        qk, r, q_lora = dn + dr, lat.kv_lora_rank, lat.q_lora_rank
        q = (
            _lin("q_proj", heads * qk, H, False)
            if q_lora is None
            else _lin("q_a_proj", q_lora, H, b)
            + [("q_a_layernorm.weight", (q_lora,))]
            + _lin("q_b_proj", heads * qk, q_lora, False)
        )
        kv = _lin("kv_a_proj_with_mqa", r + dr, H, b) + [("kv_a_layernorm.weight", (r,))]
        kv += _lin("kv_b_proj", heads * (dn + dv), r, False)
        out = q + kv + _lin("o_proj", H, heads * dv, b)
        if lat.index_topk is not None:  # DeepSeek-V3.2's lightning indexer (LightningIndexer)
            ih, idim = lat.index_n_heads or 64, lat.index_head_dim or 128
            out += _lin("indexer.wq_b", ih * idim, q_lora or 0, False) + _lin("indexer.wk", idim, H, False)
            out += [("indexer.k_norm.weight", (idim,)), ("indexer.k_norm.bias", (idim,))]
            out += _lin("indexer.weights_proj", ih, H, False)
        return [(f"self_attn.{n}", s) for n, s in out]
    if kind == "conv":  # ShortConv
        sc = _sub(cfg.short_conv)
        out = [("conv.weight", (H, 1, sc.conv_L_cache))] + ([("conv.bias", (H,))] if sc.conv_bias else [])
        out += _lin("in_proj", 3 * H, H, sc.conv_bias) + _lin("out_proj", H, H, sc.conv_bias)
        return [(f"conv.{n}", s) for n, s in out]
    if kind == "none":
        return []
    if kind == "linear_attention" and isinstance(cfg.linear_attention, KdaConfig):  # KimiDeltaAttention
        kda = cfg.linear_attention
        d, hd = kda.linear_head_dim, kda.linear_num_heads * kda.linear_head_dim
        out = _lin("q_proj", hd, H, False) + _lin("k_proj", hd, H, False) + _lin("v_proj", hd, H, False)
        out += [("conv1d.weight", (3 * hd, 1, kda.linear_conv_kernel_dim))]
        out += [("forget_gate.dt_bias", (hd,)), ("forget_gate.A_log", (1, 1, kda.linear_num_heads, 1))]
        out += _lin("forget_gate.f_a_proj", d, H, False) + _lin("forget_gate.f_b_proj", hd, d, False)
        out += _lin("b_proj", kda.linear_num_heads, H, False)
        out += _lin("g_a_proj", d, H, False) + _lin("g_b_proj", hd, d, False)
        out += [("o_norm.weight", (d,))] + _lin("o_proj", H, hd, False)
        return [(f"self_attn.{n}", s) for n, s in out]
    if kind == "linear_attention" and isinstance(cfg.linear_attention, Mamba2Config):  # Mamba2Mixer (Granite 4.0)
        return _mamba_shapes(cfg)
    if kind == "hybrid":  # ParallelSum of Mamba2Mixer and MultiHeadAttention (Falcon-H1)
        return _mamba_shapes(cfg) + _mha_shapes(cfg, "full_attention", i)
    if kind == "linear_attention":  # GatedDeltaNet
        la = _sub(cfg.linear_attention)
        assert isinstance(la, DeltaNetConfig)
        nk, nv = la.linear_num_key_heads, la.linear_num_value_heads
        key, value = nk * la.linear_key_head_dim, nv * la.linear_value_head_dim
        out = [("dt_bias", (nv,)), ("A_log", (nv,)), ("conv1d.weight", (2 * key + value, 1, la.linear_conv_kernel_dim))]
        if la.projections == "qkvz_ba":
            out += _lin("in_proj_qkvz", 2 * key + 2 * value, H, False) + _lin("in_proj_ba", 2 * nv, H, False)
        else:  # Qwen3.5's four
            out += _lin("in_proj_qkv", 2 * key + value, H, False) + _lin("in_proj_z", value, H, False)
            out += _lin("in_proj_b", nv, H, False) + _lin("in_proj_a", nv, H, False)
        out += [("norm.weight", (la.linear_value_head_dim,))] + _lin("out_proj", H, value, False)
        return [(f"linear_attn.{n}", s) for n, s in out]
    return _mha_shapes(cfg, kind, i)


def _mamba_shapes(cfg: CausalLMConfig) -> list:
    """``Mamba2Mixer``'s tensors under ``mamba.``."""
    m = cfg.linear_attention
    assert isinstance(m, Mamba2Config)
    H, inner, bc = cfg.hidden_size, m.num_heads * m.head_dim, 2 * m.n_groups * m.state_size
    out: list = [("dt_bias", (m.num_heads,)), ("A_log", (m.num_heads,)), ("D", (m.num_heads,))]
    out += _lin("in_proj", 2 * inner + bc + m.num_heads, H, m.proj_bias)
    out += [("conv1d.weight", (inner + bc, 1, m.conv_kernel))]
    out += [("conv1d.bias", (inner + bc,))] if m.conv_bias else []
    out += [("norm.weight", (inner,))] if m.gated_norm is not None else []
    out += _lin("out_proj", H, inner, m.proj_bias if m.out_proj_bias is None else m.out_proj_bias)
    return [(f"mamba.{n}", s) for n, s in out]


def _mha_shapes(cfg: CausalLMConfig, kind: str, i: int) -> list:
    """``MultiHeadAttention``'s tensors under ``self_attn.``."""
    H, heads = cfg.hidden_size, cfg.num_attention_heads
    a = cfg.attention_config(kind, i)
    hd, kv_rows, b = a.head_dim, a.num_kv_heads * a.head_dim, a.qkv_bias
    out: list = [("sinks", (heads,))] if a.sinks else []
    out += _lin("q_proj", heads * hd * (2 if a.output_gate else 1), H, b)
    out += _lin("k_proj", kv_rows, H, b) + _lin("v_proj", kv_rows, H, b) + _lin("o_proj", H, heads * hd, a.out_bias)
    if a.qk_norm and a.qk_norm_scope == "each_head":  # a weight row per head (Command R+)
        out += [("q_norm.weight", (heads, hd)), ("k_norm.weight", (a.num_kv_heads, hd))]
    elif a.qk_norm:  # each head's features, or all heads' (qk_norm_scope "all_heads")
        whole = a.qk_norm_scope == "all_heads"
        out += [("q_norm.weight", (heads * hd if whole else hd,)), ("k_norm.weight", (kv_rows if whole else hd,))]
    return [(f"self_attn.{n}", s) for n, s in out]


def _gated(name: str, H: int, inter: int, bias: bool = False) -> list:
    return (
        _lin(f"{name}.gate_proj", inter, H, bias)
        + _lin(f"{name}.up_proj", inter, H, bias)
        + _lin(f"{name}.down_proj", H, inter, bias)
    )


# XIELU's parameters (alpha_p, alpha_n) and buffers (beta, eps), in torch's order
_XIELU_SHAPES = (("alpha_p", (1,)), ("alpha_n", (1,)), ("beta", ()), ("eps", ()))


def _mlp_shapes(cfg: CausalLMConfig, i: int) -> list:
    H, kind = cfg.hidden_size, cfg.mlp_types[i]
    if kind == "dense":
        return _gated("mlp", H, cfg.mlp_size(i), cfg.mlp_bias)
    if kind == "none":
        return []
    if kind == "plain":  # FeedForward under the names up_proj, down_proj (and xIELU's act_fn)
        inter, b = cfg.mlp_size(i), cfg.mlp_bias
        act = [(f"mlp.act_fn.{n}", s) for n, s in _XIELU_SHAPES] if cfg.hidden_act == "xielu" else []
        return _lin("mlp.up_proj", inter, H, b) + _lin("mlp.down_proj", H, inter, b) + act
    if kind == "dense_and_experts":  # DenseWithExperts, under the decoder layer's own names
        e = _sub(cfg.moe)
        E, mi = e.num_experts, e.intermediate_size
        out = [("pre_feedforward_layernorm.weight", (H,))] + _gated("mlp", H, cfg.mlp_size(i))
        out += [
            ("post_feedforward_layernorm_1.weight", (H,)),
            ("router.scale", (H,)),
            ("router.per_expert_scale", (E,)),
        ]
        out += [
            ("router.proj.weight", (E, H)),
            ("experts.gate_up_proj", (E, 2 * mi, H)),
            ("experts.down_proj", (E, H, mi)),
        ]
        return out + [(f"{n}.weight", (H,)) for n in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_2")]
    moe = _sub(cfg.moe)  # SparseMoeBlock: router, experts, shared expert and its gate
    E, inter, name = moe.num_experts, moe.intermediate_size, moe.router_name
    router = _lin(name, E, H, moe.router_bias)
    router += [(f"{name}.e_score_correction_bias", (E,))] if moe.router == "sigmoid" and moe.correction_bias else []
    if moe.experts == "gpt_oss":  # GptOssExperts: (E, H, 2I) interleaved, biases
        experts = [("experts.gate_up_proj", (E, H, 2 * inter)), ("experts.gate_up_proj_bias", (E, 2 * inter))]
        experts += [("experts.down_proj", (E, inter, H)), ("experts.down_proj_bias", (E, H))]
    elif moe.experts == "plain":  # PlainExperts (Nemotron 3's): (E, I, L), (E, L, I), L the latent width
        L = H if moe.latent_size is None else moe.latent_size
        experts = [("experts.up_proj", (E, inter, L)), ("experts.down_proj", (E, L, inter))]
    else:  # Experts: (E, 2I, H) gate rows then up rows, (E, H, I)
        experts = [("experts.gate_up_proj", (E, 2 * inter, H)), ("experts.down_proj", (E, H, inter))]
    out = experts + router if moe.experts_first else router + experts
    if moe.shared_intermediate_size is not None:
        si, sb = moe.shared_intermediate_size, moe.shared_bias
        if moe.experts == "plain":  # FeedForward under the names up_proj, down_proj
            out += _lin(f"{moe.shared_name}.up_proj", si, H, sb) + _lin(f"{moe.shared_name}.down_proj", H, si, sb)
        else:
            out += _gated(moe.shared_name, H, si, sb)
        out += _lin("shared_expert_gate", 1, H, False) if moe.shared_expert_gate else []
    if moe.latent_size is not None:
        L, b = moe.latent_size, moe.latent_bias
        out += _lin("fc1_latent_proj", L, H, b) + _lin("fc2_latent_proj", H, L, b)
    return [(f"mlp.{n}", s) for n, s in out]


def _layer_shapes(cfg: CausalLMConfig, i: int) -> list:
    """``[(name under model.layers.{i}., shape), ...]`` of layer ``i``'s parameters and buffers."""
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm") if cfg.pre_norm else ()
    if cfg.layer_types[i] == "none":  # no attention sublayer, no norm before it
        norms = tuple(n for n in norms if n != "input_layernorm")
    if (cfg.mlp_types[i] == "none" or cfg.parallel_mlp) and not cfg.sandwich_norm:  # no norm before an MLP
        norms = tuple(n for n in norms if n != "post_attention_layernorm")
    if cfg.sandwich_norm:
        pre_mlp: tuple[str, ...] = ("pre_feedforward_layernorm",) if cfg.pre_norm else ("post_attention_layernorm",)
        if cfg.mlp_types[i] == "dense_and_experts":  # DenseWithExperts has its own
            pre_mlp = ()
        norms += pre_mlp + ("post_feedforward_layernorm",)
    out: list = [("layer_scalar", (1,))] if cfg.layer_scalar else []  # a buffer: before the children, as torch
    out += _attention_shapes(cfg, i) + _mlp_shapes(cfg, i)
    out += [(f"{n}.{p}", (cfg.hidden_size,)) for n in norms for p in _norm_params(cfg)]
    P = cfg.per_layer_input_size
    if P:  # PerLayerInput
        out += [
            ("per_layer_input_gate.weight", (P, cfg.hidden_size)),
            ("per_layer_projection.weight", (cfg.hidden_size, P)),
        ]
        out += [("post_per_layer_input_norm.weight", (cfg.hidden_size,))]
    return [(_renamed(n, cfg.layer_names), s) for n, s in out] if cfg.layer_names else out


def _layer_kind(cfg: CausalLMConfig, i: int) -> tuple:
    """What makes layer ``i``'s names and shapes: its attention and MLP kinds, whether it reuses
    another layer's keys and values."""
    return cfg.layer_types[i], cfg.mlp_types[i], cfg.reuses_kv(i)


def _model_shapes(cfg: CausalLMConfig) -> list:
    """The backbone's own tensors beside the layers: the per-layer input embeddings (Gemma 4)."""
    P = cfg.per_layer_input_size
    if not P:
        return []
    n = cfg.num_hidden_layers * P
    return [
        ("model.embed_tokens_per_layer.weight", (cfg.per_layer_vocab_size, n)),
        ("model.per_layer_model_projection.weight", (n, cfg.hidden_size)),
        ("model.per_layer_projection_norm.weight", (P,)),
    ]


def _state_shapes(cfg: CausalLMConfig):
    """Every ``(state-dict key, shape)`` of ``CausalLM(cfg)``, lazily, layer after layer (one
    layer's names are worked out once per kind of layer)."""
    V, H = cfg.vocab_size, cfg.hidden_size
    yield f"model.{cfg.embed_name}.weight", (V, H)
    if cfg.position_embedding:  # GPT-2's wpe
        yield f"model.{cfg.position_embedding}.weight", (cfg.max_position_embeddings, H)
    kinds: dict = {}
    for i in range(cfg.num_hidden_layers):
        kind = _layer_kind(cfg, i)
        if kind not in kinds:
            kinds[kind] = _layer_shapes(cfg, i)
        for name, shape in kinds[kind]:
            yield f"model.layers.{i}.{name}", shape
    for p in _norm_params(cfg):
        yield f"model.{cfg.final_norm_name}.{p}", (H,)
    yield from _model_shapes(cfg)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", (V, H)
        if cfg.lm_head_bias:
            yield "lm_head.bias", (V,)


_MAX_LAYERS = 4096  # building costs about a millisecond a layer: more is no plausible model


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        return None


def _check_plausible(cfg: CausalLMConfig, dtype) -> None:
    """Refuse, naming the config keys, a model that cannot be built in reasonable time and memory:
    more than ``_MAX_LAYERS`` layers, or more bytes of parameters than this machine's memory
    (counted from the config alone, before anything is allocated)."""
    n = cfg.num_hidden_layers
    if n > _MAX_LAYERS:
        raise ValueError(
            f"config['num_hidden_layers']: {n} layers is not a plausible model (npattn builds at most {_MAX_LAYERS})"
        )
    counts: dict = {}
    for i in range(n):
        counts.setdefault(_layer_kind(cfg, i), [i, 0])[1] += 1
    shapes = [((cfg.vocab_size, cfg.hidden_size), 1 if cfg.tie_word_embeddings else 2)]  # embedding, head
    shapes += [(s, 1) for _, s in _model_shapes(cfg)]
    shapes += [(s, c) for i, c in counts.values() for _, s in _layer_shapes(cfg, i)]
    total = sum(math.prod(s) * c for s, c in shapes)
    nbytes, limit = total * np.dtype(dtype).itemsize, _physical_memory()
    if limit is not None and nbytes > limit:
        largest = max((s for s, _ in shapes), key=math.prod)
        sizes = {
            k: v
            for k, v in cfg.hf.items()
            if isinstance(v, int) and not isinstance(v, bool) and v in largest and k != "max_position_embeddings"
        }
        raise ValueError(
            f"config: the model would hold {total:.3g} parameters ({nbytes / 2**30:.3g} GiB in "
            f"{np.dtype(dtype).name}), more than this machine's memory ({limit / 2**30:.3g} GiB); its largest "
            f"tensor is {largest}" + "".join(f", {k}={v}" for k, v in sizes.items()) + f", num_hidden_layers={n}"
        )


def _checked(m: Module, x):
    """``m(x)`` for a norm or the gated MLP on a hidden state the model formed (its dtype and
    width right): without grad (nothing kept, so nothing for a backward to check) their
    ``_forward``, not validated again (a decoding step makes 84 such calls a token on 28 layers)."""
    return m._forward(x) if isinstance(m, (RMSNorm, LayerNorm, GatedMLP)) and not is_grad_enabled() else m(x)


class _Padding(NamedTuple):
    """A padded batch's per-call arrays (``CausalLM.forward(ids, attention_mask=...)``)."""

    tokens: np.ndarray  # (B, L) bool: this call's tokens (False: padding)
    keys: np.ndarray  # (B, T + L) bool: every key seen (the cache's and this call's) that is a token
    positions: np.ndarray  # (B, L) int: each token's position, cumsum(mask) - 1 (padding: 0)


def _padding_kwargs(att: Module, padding: _Padding) -> dict:
    """A padded batch's keyword arguments for an attention module, each kind its plain arrays: the
    padded keys (MHA's ``key_padding_mask``, MLA's ``attn_mask``), the positions, the recurrent
    layers' ``attention_mask``; a ``ParallelSum`` each branch's own (Falcon-H1)."""
    if isinstance(att, RecurrentLayer):  # GatedDeltaNet, KimiDeltaAttention, Mamba2Mixer, ShortConv
        return {"attention_mask": padding.tokens}
    if isinstance(att, MultiHeadLatentAttention):
        return {"attn_mask": padding.keys[:, None, None, :], "positions": padding.positions}  # True = may attend
    if isinstance(att, ParallelSum):  # Cohere's MLP branch takes no padding
        return {
            "branch_kwargs": {
                name: _padding_kwargs(m, padding)
                for name, m in att.branches()
                if not isinstance(m, (GatedMLP, FeedForward))
            }
        }
    return {"key_padding_mask": ~padding.keys, "positions": padding.positions}


class DecoderLayer(_Renamed):
    """One residual block of ``CausalLM`` (see the module docstring), with Hugging Face's names:
    ``self_attn.*`` (``linear_attn.*`` for gated DeltaNet), ``mlp.*``, ``input_layernorm``,
    ``post_attention_layernorm`` (and Gemma's ``pre_feedforward_layernorm``,
    ``post_feedforward_layernorm``).  Without ``cfg.pre_norm`` (OLMo 2/3) there is no norm before
    a sublayer: ``x + post_attention_layernorm(attn(x))``, then ``x + post_feedforward_layernorm(mlp(x))``.
    With ``cfg.residual_multiplier`` ``r`` (Granite) each residual sum is ``x + r * branch``.  A
    family's own names (``cfg.layer_names``: LFM2's, GraniteMoe's ``block_sparse_moe``, Granite 4.0's
    ``shared_mlp``) replace these."""

    def __init__(self, cfg: CausalLMConfig, index: int, *, rng=None, dtype=np.float64):
        super().__init__()
        self._dtype = check_dtype(dtype)
        self.index = index
        self.sandwich = cfg.sandwich_norm
        self.pre_norm = cfg.pre_norm
        self._parallel_residual = cfg.parallel_residual  # GPT-NeoX: the MLP's norm reads the layer's input
        r = float(cfg.residual_multiplier)
        self._residual = None if r == 1.0 else self._dtype.type(r)  # None: the branch as it is
        # Qwen3-Next names its gated DeltaNet layers linear_attn, LFM2 its short convolutions conv,
        # Granite 4.0 its Mamba-2 layers mamba, every other attention (Kimi's KDA too) self_attn
        linear = cfg.layer_types[index] == "linear_attention"
        delta_net = linear and isinstance(cfg.linear_attention, DeltaNetConfig)
        mamba = linear and isinstance(cfg.linear_attention, Mamba2Config)
        conv = cfg.layer_types[index] == "conv"
        hybrid = cfg.layer_types[index] == "hybrid"  # Falcon-H1's ParallelSum, its branches under their own names
        parallel = cfg.parallel_mlp  # Cohere's ParallelSum of attention and MLP, under their own names
        self._attn_name = "linear_attn" if delta_net else "mamba" if mamba else "conv" if conv else "self_attn"
        self._attn_name = "hybrid" if hybrid else "parallel" if parallel else self._attn_name
        # layer kind "none" / MLP kind "none": the block has no such sublayer (Nemotron-H: one each)
        self._has_attention = cfg.layer_types[index] != "none"
        if self._has_attention:
            setattr(self, self._attn_name, _attention(cfg, index, rng, dtype))
        self.mlp = None if cfg.mlp_types[index] == "none" or parallel else _mlp(cfg, index, rng, dtype)
        self._mlp_normed = isinstance(self.mlp, DenseWithExperts)  # it holds its pre_feedforward_layernorm
        if self.pre_norm and self._has_attention:
            self.input_layernorm = _norm(cfg, dtype)
        if self.mlp is not None or self.sandwich:
            self.post_attention_layernorm = _norm(cfg, dtype)
        if self.sandwich:
            if self.pre_norm and not self._mlp_normed:
                self.pre_feedforward_layernorm = _norm(cfg, dtype)
            self.post_feedforward_layernorm = _norm(cfg, dtype)
        names = dict(_MHA_NAMES) if isinstance(self.attention, MultiHeadAttention) else {}
        if hybrid:
            names = {f"hybrid.{k}": v for k, v in _MHA_NAMES.items()}
            names.update({"hybrid.mamba": "mamba", "hybrid.self_attn": "self_attn"})
        if parallel:
            names = {f"parallel.{k}": v for k, v in _MHA_NAMES.items()}
            if cfg.mlp_types[index] == "plain":  # Phi's plain MLP beside the attention (before parallel.mlp)
                names.update({f"parallel.{k}": v for k, v in _PLAIN_MLP_NAMES.items()})
            names.update({"parallel.self_attn": "self_attn", "parallel.mlp": "mlp"})
        if self._mlp_normed:
            names.update(_DENSE_WITH_EXPERTS_NAMES)
        if isinstance(self.mlp, FeedForward):
            names.update(_PLAIN_MLP_NAMES)
        if isinstance(self.mlp, SparseMoeBlock) and isinstance(self.mlp.shared_module, FeedForward):
            shared = self.mlp._shared_name  # Nemotron 3's shared expert: FeedForward under up_proj, down_proj
            names.update({f"mlp.{shared}.{k[4:]}": f"mlp.{shared}.{v[4:]}" for k, v in _PLAIN_MLP_NAMES.items()})
        self.per_layer = None
        if cfg.per_layer_input_size:  # Gemma 4: x + its per-layer input branch, after the MLP
            eps = cfg.rms_norm_eps
            self.per_layer = PerLayerInput(
                cfg.hidden_size, cfg.per_layer_input_size, cfg.hidden_act, eps=eps, rng=rng, dtype=dtype
            )
            names.update(_PER_LAYER_NAMES)
        if cfg.layer_scalar:  # Gemma 4: the layer's output times this buffer (no gradient, as transformers)
            self.register_buffer("layer_scalar", np.ones(1, self._dtype))
        object.__setattr__(self, "_names", _family_names(names, cfg.layer_names) if cfg.layer_names else names)

    @property
    def attention(self) -> Module | None:
        """The attention module (``self_attn``, ``linear_attn``, ``mamba`` ...; None: the layer has none)."""
        return self._modules[self._attn_name] if self._has_attention else None

    def _mlp_norm(self) -> Module | None:
        if not self.pre_norm or self._mlp_normed:
            return None
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    def _pre(self, norm: Module | None, x):
        """``norm(x)``, or ``x`` where the block has no pre-norm (its backward: ``_pre_back``)."""
        return x if norm is None else _checked(norm, x)

    def _pre_back(self, norm: Module | None, dx):
        return dx if norm is None else norm.backward(dx)

    def _attn_norm(self) -> Module | None:
        return self.input_layernorm if self.pre_norm and self._has_attention else None

    def _attend(self, h, use_cache: bool, padding: _Padding | None):
        """The attention sublayer on ``h``; a padded batch gives each kind its plain arrays
        (``_padding_kwargs``)."""
        att = self._modules[self._attn_name]  # called only where the layer has one
        if padding is None:
            if type(att) is MultiHeadAttention and not is_grad_enabled():  # h checked: the cache's batch only
                att._check_cache(h, True, use_cache)
                return att._forward(h, use_cache=use_cache)
            return att(h, use_cache=use_cache)
        return att(h, use_cache=use_cache, **_padding_kwargs(att, padding))

    def _scalar(self):
        return None if "layer_scalar" not in self._buffers else self.layer_scalar

    def _branch(self, a):
        """A sublayer's output (or its gradient, or a tangent) times the residual multiplier (Granite)."""
        return a if self._residual is None else a * self._residual

    def _branch_pair(self, g):
        """``_branch`` of a (gradient, tangent) pair."""
        return g if self._residual is None else (g[0] * self._residual, g[1] * self._residual)

    def forward(self, x, per_layer_input=None, *, use_cache: bool = False, padding: _Padding | None = None):
        """``x (B, L, hidden)`` -> the same shape (see ``CausalLM``); Gemma 4's layers also take
        their per-layer input ``(B, L, P)``."""
        if (per_layer_input is None) != (self.per_layer is None):
            raise ValueError(f"per_layer_input: expected {'none' if self.per_layer is None else 'an array'}")
        x_in = x
        if self._has_attention:
            a = self._attend(self._pre(self._attn_norm(), x), use_cache, padding)
            if self.sandwich:
                a = _checked(self.post_attention_layernorm, a)
            x = x + self._branch(a)
        self.save_for_backward(x.shape)
        if self.mlp is None:
            y = x
        else:
            m = _checked(self.mlp, self._pre(self._mlp_norm(), x_in if self._parallel_residual else x))
            if self.sandwich:
                m = _checked(self.post_feedforward_layernorm, m)
            y = x + self._branch(m)
        if self.per_layer is not None:
            y = self.per_layer._forward(y, per_layer_input)
        return y if self._scalar() is None else y * self._scalar()

    def backward(self, dy):
        """``dx``: the residual's ``dy`` plus each branch's gradient through its norm; with a
        per-layer input ``(dx, dper_layer_input)``."""
        dy = self._check_dy(dy)
        self.pop_saved()
        if self._scalar() is not None:
            dy = dy * self._scalar()
        dp = None
        if self.per_layer is not None:
            dy, dp = self.per_layer._backward(dy)
        dx = dy
        if self.mlp is not None:
            dm = self._branch(dy)
            dm = self.post_feedforward_layernorm.backward(dm) if self.sandwich else dm
            dx = dy + self._pre_back(self._mlp_norm(), self.mlp.backward(dm))
        if self.attention is not None:
            da = self._branch(dy if self._parallel_residual else dx)  # parallel: the attention's sum is y
            da = self.post_attention_layernorm.backward(da) if self.sandwich else da
            dx = dx + self._pre_back(self._attn_norm(), self.attention.backward(da))
        return dx if dp is None else (dx, dp)

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: the forward's chain on tangents, ``tx + norm'(f'(tx))`` per residual,
        each sublayer's ``_jvp`` from its state of this call.  One input tangent (None: zero)."""
        tx, tp = self._input_tangents(state, input_tangents, "jvp")
        _, _, tx2, _, tm = self._stage_tangents(state, tx, param_tangents)
        if self.sandwich and tm is not None:
            tm = self._child_jvp(self.post_feedforward_layernorm, -1, (tm,), param_tangents)
        ty = tx2 if tm is None else tx2 + self._branch(tm)
        if self.per_layer is not None:
            ty = self._child_jvp(self.per_layer, -1, (ty, tp), param_tangents)
        return ty if self._scalar() is None else ty * self._scalar()

    def _input_tangents(self, shape, input_tangents, method: str) -> tuple:
        """``(tx, tp)``: x's tangent (zeros for None) and the per-layer input's (None: zero)."""
        if self.per_layer is None:
            (tx,) = _block_tangents(self, input_tangents, ("tx",), (shape,), method)
            return tx, None
        p_shape = shape[:-1] + (self.per_layer.per_layer_size,)
        return tuple(_block_tangents(self, input_tangents, ("tx", "tper_layer_input"), (shape, p_shape), method))

    def _stage_tangents(self, state, tx, param_tangents) -> tuple:
        """``(th, ta, tx2, tm_in, tm)``: the tangents of the attention's input and output, of the
        first residual's sum, of the MLP's input and output (before a sandwich norm), each
        sublayer's ``_jvp`` from its state of this call; computed once per state and ``tx`` while
        ``param_tangents`` remembers (``loss_hvp``: its ``jvp``, then its ``backward_jvp``)."""

        def sub(m, t):  # the sublayer's tangent from its state of this call (no module: the identity)
            return t if m is None else self._child_jvp(m, -1, (t,), param_tangents)

        def compute():  # an absent sublayer: its tangents None, the residual's sum its input's
            th = ta = tm_in = tm = None
            tx2 = tx
            if self.attention is not None:
                th = sub(self._attn_norm(), tx)
                ta = sub(self.attention, th)
                tx2 = tx + self._branch(sub(self.post_attention_layernorm if self.sandwich else None, ta))
            if self.mlp is not None:
                tm_in = sub(self._mlp_norm(), tx if self._parallel_residual else tx2)
                tm = sub(self.mlp, tm_in)
            return th, ta, tx2, tm_in, tm

        return param_tangents._remember((self, "stages", state, tx), compute)

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: the forward's tangents first (as ``_jvp``: each sublayer's input
        tangent), then the backward's chain with each sublayer's ``backward_jvp`` on (gradient,
        its tangent), a residual adding both branches' pairs.  One input tangent (None: zero)."""
        tx, tp = self._input_tangents(state, input_tangents, "backward_jvp")

        def back(m, g, t):  # its backward_jvp on g = (gradient, tangent), its input's tangent t
            return g if m is None else self._child_backward_jvp(m, g[0], (t,), param_tangents, g[1])

        post_attn = self.post_attention_layernorm if self.sandwich else None
        post_mlp = self.post_feedforward_layernorm if self.sandwich else None
        th, ta, tx2, tm_in, tm = self._stage_tangents(state, tx, param_tangents)
        g = (dy, np.zeros_like(dy) if ddy is None else ddy)
        if self._scalar() is not None:
            g = (g[0] * self._scalar(), g[1] * self._scalar())
        gp = None
        if self.per_layer is not None:  # its input: the MLP residual's sum
            ty = tx2 + self._branch(tm if post_mlp is None else self._child_jvp(post_mlp, -1, (tm,), param_tangents))
            (dy2, dp), (tdy2, tdp) = self._child_backward_jvp(self.per_layer, g[0], (ty, tp), param_tangents, g[1])
            g, gp = (dy2, tdy2), (dp, tdp)
        gx = g
        if self.mlp is not None:
            t_mlp = tx if self._parallel_residual else tx2  # the MLP norm's input tangent
            gm = back(self._mlp_norm(), back(self.mlp, back(post_mlp, self._branch_pair(g), tm), tm_in), t_mlp)
            gx = (g[0] + gm[0], g[1] + gm[1])  # the residual: both branches
        if self.attention is not None:
            g_sum = g if self._parallel_residual else gx  # the gradient of the attention's residual sum
            ga = back(self._attn_norm(), back(self.attention, back(post_attn, self._branch_pair(g_sum), ta), th), tx)
            gx = (gx[0] + ga[0], gx[1] + ga[1])
        return gx if gp is None else ((gx[0], gp[0]), (gx[1], gp[1]))

    def reset_kv_cache(self) -> None:
        if self.attention is not None:
            self.attention.reset_kv_cache()  # type: ignore[attr-defined]


class _Backbone(_Renamed):
    """``model.*``: ``embed_tokens``, ``layers``, ``norm`` (a container; ``CausalLM`` runs it);
    Gemma 4's per-layer input embeddings (``per_layer``, under their checkpoint names), and its
    reusing layers pointed at the layers whose keys and values they attend over."""

    def __init__(self, cfg: CausalLMConfig, rng, dtype):
        super().__init__()
        self._dtype = check_dtype(dtype)
        # about to be loaded (CausalLM.from_hf): drop each part's zero gradients as soon as it is
        # built, so that building never holds a second model's worth of arrays
        pad = cfg.pad_token_id if cfg.pad_embedding_row else None  # Nemotron-H's embedding: no padding row
        self.embed_tokens = _released(Embedding(cfg.vocab_size, cfg.hidden_size, pad, rng=rng, dtype=dtype), rng)
        self.embed_positions = None  # GPT-2's wpe: a learned row a position, added to the embeddings
        if cfg.position_embedding:
            table = Embedding(int(cfg.max_position_embeddings or 0), cfg.hidden_size, rng=rng, dtype=dtype)
            self.embed_positions = _released(table, rng)
        self.layers = ModuleList(
            [_released(DecoderLayer(cfg, i, rng=rng, dtype=dtype), rng) for i in range(cfg.num_hidden_layers)]
        )
        self.norm = _norm(cfg, dtype)
        self.per_layer = None
        if cfg.per_layer_input_size:
            rows, P = cfg.per_layer_vocab_size or cfg.vocab_size, cfg.per_layer_input_size
            ple = PerLayerEmbeddings(
                rows, cfg.hidden_size, cfg.num_hidden_layers, P, padding_idx=cfg.pad_token_id, eps=cfg.rms_norm_eps,
                rng=rng, dtype=dtype,
            )  # fmt: skip
            self.per_layer = _released(ple, rng)
            object.__setattr__(self, "_names", _PER_LAYER_MODEL_NAMES)
        if cfg.final_norm_name != "norm":  # LFM2's embedding_norm
            object.__setattr__(self, "_names", {**self._names, "norm": cfg.final_norm_name})
        if cfg.embed_name != "embed_tokens":  # Nemotron-H's embeddings
            object.__setattr__(self, "_names", {**self._names, "embed_tokens": cfg.embed_name})
        if cfg.position_embedding:
            object.__setattr__(self, "_names", {**self._names, "embed_positions": cfg.position_embedding})
        for i, source in enumerate(cfg.kv_sources or ()):
            if source != i:
                self.layers[i].attention.share_from(self.layers[source].attention)


def _lifted(a, lifted: bool):
    """``a`` with the batch axis of one that the layers of a padded one-sequence call see (None stays None)."""
    return a[None] if lifted and a is not None else a


def _unlifted(a, lifted: bool):
    """``_lifted`` undone."""
    return a[0] if lifted and a is not None else a


def _released(m: Module, rng) -> Module:
    """``m`` as built for loading when ``rng`` is the loader's generator (``rng.loading``): its
    parameters' gradient buffers set to None (the first backward makes them again) and, with
    ``rng.bfloat16``, its large matrices kept as bfloat16 (zero bits, to be loaded), so that
    building never holds a second model's worth of arrays."""
    if getattr(rng, "loading", False):
        for p in m.parameters():
            p.grad = None
        if getattr(rng, "bfloat16", False):
            store_bfloat16(m, zeros=True)
    return m


def _zeroed_results(params) -> tuple[dict, dict]:
    """``(grads, hvp)`` for ``loss_hvp``: by name, a zeroed array of each parameter's shape and
    dtype for its gradient and one for the gradient's tangent, views of one array each when the
    parameters share a dtype (two allocations instead of two per parameter, whose fresh pages
    ``backward_jvp``'s first contributions would otherwise be copied into one by one); a parameter
    met under two names (tied) gets the same arrays under both."""
    unique = list({id(p): p for _, p in params}.values())
    dtypes = {p.data.dtype for p in unique}
    if len(dtypes) == 1:
        sizes = [p.data.size for p in unique]
        flat = np.zeros((2, sum(sizes)), dtypes.pop())
        ends = np.cumsum(sizes)
        made = {
            id(p): [flat[k, e - p.data.size : e].reshape(p.data.shape) for k in (0, 1)] for p, e in zip(unique, ends)
        }
    else:
        made = {id(p): [np.zeros_like(p.data), np.zeros_like(p.data)] for p in unique}
    return {n: made[id(p)][0] for n, p in params}, {n: made[id(p)][1] for n, p in params}


def bfloat16_parameters(m: Module) -> list:
    """The parameters ``weights_dtype="bfloat16"`` keeps as bfloat16: the large matrices, every
    ``Linear``'s and ``Embedding``'s weight and the routed experts' stacked projections (norms,
    biases, routers, convolutions and gates stay float32)."""
    out: list = []
    for sub in m.modules():
        if isinstance(sub, (Linear, Embedding)):
            out.append(sub.weight)
        elif isinstance(sub, (Experts, GptOssExperts)):
            out += [sub.gate_up_proj, sub.down_proj]
        elif isinstance(sub, PlainExperts):
            out += [sub.up_proj, sub.down_proj]
    return out


def store_bfloat16(m: Module, *, zeros: bool = False) -> Module:
    """Keep ``m``'s large matrices (``bfloat16_parameters``) as bfloat16 bits (a ``BFloat16Array``
    each), their values rounded to nearest even as torch's ``.to(torch.bfloat16)`` (``zeros``:
    zero bits, for a model about to be loaded); their gradients become None.  Returns ``m``."""
    for p in bfloat16_parameters(m):
        if not isinstance(p.data, BFloat16Array):
            bits = np.zeros(p.shape, np.uint16) if zeros else to_bfloat16_bits(p.data)
            p.data = BFloat16Array(bits)
        p.grad = p.grad_tangent = None
    for sub in m.modules():  # a fused q/k/v of the float32 weights is stale: made again from the bits
        if getattr(sub, "_fused", None) is not None:
            object.__setattr__(sub, "_fused", None)
    return m


class CausalLM(Module):
    """A decoder-only language model of any supported family: ``ids (B, L) -> logits (B, L, vocab)``.

    Build it from a Hugging Face checkpoint with ``CausalLM.from_hf(state_dict, config)`` or
    ``CausalLM.from_pretrained(directory)``, or with random weights from a ``CausalLMConfig``
    (or a Hugging Face config dict): ``CausalLM(config, rng=0)``.

    Parameters
    ----------
    config : CausalLMConfig or mapping
        The model's configuration (a mapping is read by ``config_from_hf``).
    rng : numpy Generator, int or None
        The initial weights' randomness (each layer's torch-style default initialisation).
    dtype : numpy dtype
        ``np.float64`` (default) or ``np.float32``; parameters, activations and gradients.

    Notes
    -----
    ``forward(ids)`` keeps what ``backward(dlogits)`` needs; ``backward`` adds every parameter's
    gradient into its ``.grad`` and returns ``None`` (ids have no gradient).
    ``forward(ids, use_cache=True)`` decodes incrementally (each attention layer's cache; the
    logits of the full pass over everything fed since ``reset_kv_cache()``), keeping nothing for
    backward.  Parameter names are Hugging Face's; a tied head is ``model.embed_tokens.weight``
    alone (as ``transformers`` lists it once).

    Raises
    ------
    ValueError
        A configuration npattn cannot build (the message names the config key), or one no machine
        could: more than 4096 layers, or more bytes of parameters than this machine's memory
        (counted from the config before anything is allocated).

    Examples
    --------
    >>> import numpy as np
    >>> from npattn.models import CausalLM
    >>> cfg = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
    ...        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
    >>> model = CausalLM(cfg, rng=0)
    >>> logits = model(np.array([[1, 2, 3]]))
    >>> logits.shape, next(iter(model.state_dict()))
    ((1, 3, 32), 'model.embed_tokens.weight')
    >>> model.backward(np.ones_like(logits)) is None     # every .grad filled, Hugging Face names
    True
    """

    _seen: int  # tokens fed through the cache since reset_kv_cache()
    _mask_history: np.ndarray | None  # their attention_mask (None: all tokens)

    def __init__(self, config, *, rng=None, dtype=np.float64):
        super().__init__()
        cfg = config if isinstance(config, CausalLMConfig) else config_from_hf(config)
        self._dtype = check_dtype(dtype)
        _check_plausible(cfg, self._dtype)  # from the config alone, before anything is built
        rng = as_rng(rng)
        self.config = cfg
        self.model = _Backbone(cfg, rng, dtype)
        bias = cfg.lm_head_bias  # Phi-1/1.5/2's head has a bias
        head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias, rng=rng, dtype=dtype)
        self.lm_head = None if head is None else _released(head, rng)
        # generation_config.json as from_pretrained read it (None: none read; generation_defaults)
        self.generation_config: dict | None = None
        self.reset_kv_cache()

    def extra_repr(self):
        """The arguments shown by ``repr(module)``."""
        return self.config.describe()

    @property
    def weights_dtype(self) -> str | None:
        """``"bfloat16"`` when the large matrices are kept as bfloat16 (``from_pretrained(...,
        weights_dtype="bfloat16")``), else None (every parameter in ``dtype``)."""
        return "bfloat16" if any(isinstance(p.data, BFloat16Array) for p in self.parameters()) else None

    @property
    def layers(self) -> ModuleList:
        """``model.layers``: the decoder layers."""
        return self.model.layers

    # -- forward / backward ----------------------------------------------------------------
    def _check_ids(self, ids) -> np.ndarray:
        ids = as_index(ids, "ids")
        if ids.ndim not in (1, 2) or ids.shape[-1] < 1:
            raise ValueError(f"ids: expected token ids of shape (B, L) or (L,) with L >= 1, got shape {ids.shape}")
        v = self.config.vocab_size  # (Gemma 4's per-layer table has at least as many rows)
        if ids.min() < 0 or ids.max() >= v:
            bad = ids.min() if ids.min() < 0 else ids.max()
            raise ValueError(f"ids: expected values in [0, {v}) (vocab_size), got {bad}")
        return ids

    def _embed_scale(self):
        """The embeddings' factor in the model's dtype (``CausalLMConfig.embed_scale``), or None."""
        s = self.config.embed_scale
        if isinstance(s, bool):
            return self.dtype.type(math.sqrt(self.config.hidden_size)) if s else None
        return self.dtype.type(s)

    def _logits_scaling(self):
        """The number the logits are divided by in the model's dtype (Granite), or None."""
        s = float(self.config.logits_scaling)
        return None if s == 1.0 else self.dtype.type(s)

    def forward(self, ids, *, use_cache: bool = False, attention_mask=None, logits_to_keep: int = 0):
        """``ids (B, L)`` (or ``(L,)``) integer token ids -> ``logits (B, L, vocab_size)``.

        ``use_cache=True``: append these tokens to every layer's cache and return the logits of
        their positions after everything cached (no state kept for backward).

        ``attention_mask``: a batch of prompts of different lengths, ``(B, L)`` like ``ids``, 1
        (True) for a token and 0 (False) for padding (left padding, as transformers generates; right
        padding too without a cache), or with ``use_cache`` also ``(B, T + L)`` over everything fed
        since ``reset_kv_cache()`` (transformers' convention; its first ``T`` columns must be the
        earlier calls'); after a padded call, a cached call without a mask counts its tokens as
        tokens.  Each token's position is ``cumsum(mask) - 1`` over its row (padding at 0), as
        transformers' ``generate`` computes ``position_ids``; padded keys are never attended;
        gated DeltaNet layers pass padded steps with their state unchanged; so each row's logits
        at its tokens are those of its prompt run alone, and cached decoding continues each row as
        alone.  The logits at padded positions are 0, so the backward and the JVP get nothing from
        them.  A row's tokens must be contiguous (no padding between two tokens: ValueError).

        ``logits_to_keep``: with ``use_cache``, a positive ``k`` returns the logits of the last
        ``k`` positions only, ``(B, k, vocab_size)`` (transformers' name; a prompt's prefill needs
        the last one, and the output head over every position would cost more than the layers);
        0 (default) keeps all."""
        ids = self._check_ids(ids)
        use_cache = check_bool(use_cache, "use_cache")
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, numbers.Integral) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep: expected an int >= 0 (0: every position), got {logits_to_keep!r}")
        if logits_to_keep and not use_cache:
            raise ValueError(
                f"logits_to_keep: {logits_to_keep} needs use_cache=True (a pass for backward keeps every position)"
            )
        padding = self._check_attention_mask(attention_mask, ids, use_cache)
        if use_cache:
            with no_grad():
                return self._forward(ids, True, padding, int(logits_to_keep))
        return self._forward(ids, False, padding)

    def _check_attention_mask(self, attention_mask, ids: np.ndarray, use_cache: bool) -> _Padding | None:
        """The padded batch's arrays from ``attention_mask`` (and, cached, the mask of the keys
        already seen), checked before anything changes; None for a batch without padding."""
        past = self._seen if use_cache else 0
        history = self._mask_history if use_cache else None
        if attention_mask is None and history is None:
            return None
        lead, n = ids.shape[:-1], ids.shape[-1]
        if attention_mask is None:
            new = np.ones(ids.shape, bool)
        else:
            m = to_numpy(attention_mask, "attention_mask")
            if m.dtype != bool and (m.dtype.kind not in "iuf" or not np.isin(m, (0, 1)).all()):
                raise ValueError(f"attention_mask: expected 1/True for tokens and 0/False for padding, got {m.dtype}")
            m = m.astype(bool)
            if m.shape == ids.shape:
                new = m
            elif use_cache and past and m.shape == lead + (past + n,):
                old = np.ones(lead + (past,), bool) if history is None else history
                if not np.array_equal(m[..., :past], old):
                    raise ValueError("attention_mask: its first columns differ from the cached calls' mask")
                new = m[..., past:]
            else:
                want = f"{ids.shape} (ids')"
                if use_cache and past:
                    want += f" or {lead + (past + n,)} (cached and new)"
                raise ValueError(f"attention_mask: expected shape {want}, got {m.shape}")
        if past and history is None:
            history = np.ones(lead + (past,), bool)
        keys = new if history is None else np.concatenate([history, new], axis=-1)
        count = keys.sum(-1)
        idx = np.arange(keys.shape[-1])
        first = np.where(keys, idx, keys.shape[-1]).min(-1)
        last = np.where(keys, idx, -1).max(-1)
        if ((count > 0) & (last - first + 1 != count)).any():
            raise ValueError("attention_mask: a row has padding between two of its tokens; expected left padding")
        positions = np.where(keys, np.cumsum(keys, axis=-1) - 1, 0)[..., past:]
        if ids.ndim == 1:  # one sequence: the modules see a batch of one
            new, keys, positions = new[None], keys[None], positions[None]
        return _Padding(new, keys, positions)

    def _positions(self, ids: np.ndarray, use_cache: bool, padding: _Padding | None) -> np.ndarray | None:
        """Each token's row of the learned position table (``CausalLMConfig.position_embedding``),
        shaped as ``ids``: the tokens before it, those cached included (a padded row's counted from
        its first token, as ``attention_mask`` gives them); None without a table.  A position past
        the table's last row is refused, naming ``max_position_embeddings``."""
        if self.model.embed_positions is None:
            return None
        if padding is not None:
            pos = padding.positions.reshape(ids.shape)
        else:
            pos = np.broadcast_to((self._seen if use_cache else 0) + np.arange(ids.shape[-1]), ids.shape)
        n = self.config.max_position_embeddings
        if pos.max() >= n:
            cached = f"{self._seen} cached and " if use_cache else ""
            raise ValueError(
                f"ids: position {int(pos.max())} is past the model's {n} learned positions "
                f"(max_position_embeddings, GPT-2's n_positions; {cached}{ids.shape[-1]} given)"
            )
        return pos

    def _embed(self, ids: np.ndarray, use_cache: bool, padding: _Padding | None):
        """The token embeddings (times ``embed_scale``) plus the learned positions' rows."""
        m = self.model
        pos = self._positions(ids, use_cache, padding)  # checked before any module keeps a state
        x = m.embed_tokens(ids)
        scale = self._embed_scale()
        if scale is not None:  # Gemma: sqrt(hidden) cast to the dtype first, as transformers does; Granite's number
            x = x * scale
        if pos is not None:  # GPT-2: x + wpe(positions)
            x = x + m.embed_positions(pos)
        return x

    def _forward(self, ids: np.ndarray, use_cache: bool, padding: _Padding | None = None, keep_last: int = 0):
        m = self.model
        x = self._embed(ids, use_cache, padding)
        ple = None if m.per_layer is None else m.per_layer(ids, x)  # Gemma 4: (..., L, layers, P)
        if padding is not None and ids.ndim == 1:
            x = x[None]
            ple = None if ple is None else ple[None]
        for i, layer in enumerate(m.layers):
            if ple is None:
                x = layer(x, use_cache=use_cache, padding=padding)
            else:
                x = layer(x, ple[..., i, :], use_cache=use_cache, padding=padding)
        keep = None
        if padding is not None:
            if ids.ndim == 1:
                x = x[0]
            keep = padding.tokens.reshape(ids.shape)[..., None]
        if use_cache:  # the keys seen, for the next cached call's mask and positions
            if padding is not None:
                object.__setattr__(self, "_mask_history", padding.keys.reshape(ids.shape[:-1] + (-1,)))
            object.__setattr__(self, "_seen", self._seen + ids.shape[-1])
        if keep_last:  # the last positions only (cached, so nothing is kept for backward)
            x = x[..., -keep_last:, :]
            keep = None if keep is None else keep[..., -keep_last:, :]
        h = _checked(m.norm, x)
        if self.lm_head is None:
            logits, head = K.linear(h, m.embed_tokens.weight.data)
        else:
            logits, head = self.lm_head(h), None
        divisor = self._logits_scaling()
        if divisor is not None:  # Granite: logits / logits_scaling
            logits = logits / divisor
        t = None
        cap = self.config.final_logit_softcapping
        if cap is not None:  # logits = c tanh(z / c); dz = dlogits (1 - tanh^2)
            t = np.tanh(logits / logits.dtype.type(cap))
            logits = t * logits.dtype.type(cap)
        if keep is not None:  # padded positions: logits 0 (transformers' are arbitrary there)
            logits = logits * keep
        lifted = padding is not None and ids.ndim == 1  # the layers saw a batch of one
        self.save_for_backward((head, t, keep, None if ple is None else ple.shape, lifted))
        return logits

    def _layers_backward(self, dx, ple_shape):
        """Every layer's backward, last first: ``(dx, dper_layer_inputs or None)``."""
        dple = None if ple_shape is None else np.zeros(ple_shape, dx.dtype)
        for i, layer in reversed(list(enumerate(self.model.layers))):
            dx = layer.backward(dx)
            if dple is not None:
                dx, dple[..., i, :] = dx
        return dx, dple

    def backward(self, dlogits):
        """Accumulate every parameter's gradient from ``dlogits (B, L, vocab)``; returns ``None``."""
        dlogits = self._check_dy(dlogits, "dlogits")
        head, t, keep, ple_shape, lifted = self.pop_saved()
        m = self.model
        if keep is not None:
            dlogits = dlogits * keep
        if t is not None:
            dlogits = dlogits * (1 - t * t)
        divisor = self._logits_scaling()
        if divisor is not None:
            dlogits = dlogits / divisor
        if head is None:
            dh = self.lm_head.backward(dlogits)
        else:  # the tied head: its weight gradient joins the embedding's
            dh, dw, _ = K.linear_backward(dlogits, head)
            self.accumulate_grad(m.embed_tokens.weight, dw)
        dx, dple = self._layers_backward(_lifted(m.norm.backward(dh), lifted), ple_shape)
        dx, dple = _unlifted(dx, lifted), _unlifted(dple, lifted)
        if dple is not None:  # the per-layer inputs were made from the scaled embeddings too
            dx = dx + m.per_layer.backward(dple)
        if m.embed_positions is not None:  # the position rows were added to the scaled embeddings
            m.embed_positions.backward(dx)
        scale = self._embed_scale()
        if scale is not None:
            dx = dx * scale
        m.embed_tokens.backward(dx)
        return None

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: the logits' tangent along the parameters' tangents (token ids have none:
        pass None or nothing), the forward's chain run on tangents; the tied head's is
        ``th E^T + h tE^T``, Granite's ``logits_scaling`` divides it, the final softcap's ``tz (1 - tanh^2)``."""
        head, t, keep, _, lifted = state
        m = self.model

        def sub(mod, tx):  # the submodule's tangent from its state of this call
            return self._child_jvp(mod, -1, (tx,), param_tangents)

        tx = self._child_jvp(m.embed_tokens, -1, input_tangents, param_tangents)  # refuses an ids tangent
        scale = self._embed_scale()
        if scale is not None:
            tx = tx * scale
        if m.embed_positions is not None:  # GPT-2: the position table's tangent rows
            tx = tx + self._child_jvp(m.embed_positions, -1, (None,), param_tangents)
        tple = None if m.per_layer is None else self._child_jvp(m.per_layer, -1, (None, tx), param_tangents)
        tx, tple = _lifted(tx, lifted), _lifted(tple, lifted)
        for i, layer in enumerate(m.layers):
            tx = sub(layer, tx) if tple is None else self._child_jvp(layer, -1, (tx, tple[..., i, :]), param_tangents)
        th = sub(m.norm, _unlifted(tx, lifted))
        if head is None:
            tz = sub(self.lm_head, th)
        else:
            tz = K.linear_jvp(head, th, param_tangents.get(m.embed_tokens.weight))
        divisor = self._logits_scaling()
        tz = tz if divisor is None else tz / divisor
        tz = tz if t is None else tz * (1 - t * t)
        return tz if keep is None else tz * keep

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: the forward's tangents first (as ``_jvp``: each layer's input tangent),
        then ``backward``'s chain on (gradient, its tangent) with each child's ``backward_jvp``.
        Granite's ``logits_scaling`` divides the pair (and the head's tangent ``tz``).  The final
        softcap ``c tanh(z / c)`` has backward ``dz = dl (1 - t^2)``, so ``tdz = ddl
        (1 - t^2) - 2 dl t tt`` with ``tt = (1 - t^2) tz / c``; the tied head is
        ``linear_backward_jvp`` with the embedding table as its weight, whose gradient and tangent
        join the embedding's.  Token ids take no tangent; returns ``(None, None)``."""
        head, t, keep, _, lifted = state
        m = self.model

        def sub(mod, tx):  # the submodule's tangent from its state of this call
            return self._child_jvp(mod, -1, (tx,), param_tangents)

        def back(mod, g, tx):  # its backward_jvp on g = (gradient, tangent), its input's tangent tx
            return self._child_backward_jvp(mod, g[0], (tx,), param_tangents, g[1])

        tx = self._child_jvp(m.embed_tokens, -1, input_tangents, param_tangents)  # refuses an ids tangent
        scale = self._embed_scale()
        if scale is not None:
            tx = tx * scale
        if m.embed_positions is not None:  # GPT-2: the position table's tangent rows
            tx = tx + self._child_jvp(m.embed_positions, -1, (None,), param_tangents)
        tple = None if m.per_layer is None else self._child_jvp(m.per_layer, -1, (None, tx), param_tangents)
        tple = _lifted(tple, lifted)
        inputs = [_lifted(tx, lifted)]  # each layer's input tangent, then the final norm's
        for i, layer in enumerate(m.layers):
            tin = (inputs[-1],) if tple is None else (inputs[-1], tple[..., i, :])
            inputs.append(self._child_jvp(layer, -1, tin, param_tangents))
        th = sub(m.norm, _unlifted(inputs[-1], lifted))
        table = m.embed_tokens.weight
        g = (dy, np.zeros_like(dy) if ddy is None else ddy)
        if keep is not None:
            g = (g[0] * keep, g[1] * keep)
        divisor = self._logits_scaling()
        if t is not None:
            tz = sub(self.lm_head, th) if head is None else K.linear_jvp(head, th, param_tangents.get(table))
            tz = tz if divisor is None else tz / divisor
            slope = 1 - t * t
            tt = slope * tz / t.dtype.type(self.config.final_logit_softcapping)
            g = (g[0] * slope, g[1] * slope - 2 * g[0] * t * tt)
        if divisor is not None:  # Granite: the logits were divided by it
            g = (g[0] / divisor, g[1] / divisor)
        if head is None:
            gh = back(self.lm_head, g, th)
        else:  # the tied head: its weight gradient and that gradient's tangent join the embedding's
            (dh, dw, _), (tdh, tdw, _) = K.linear_backward_jvp(g[0], head, (th, param_tangents.get(table), None), g[1])
            self._accumulate_second(((table, dw, tdw),))
            gh = (dh, tdh)
        gn = back(m.norm, gh, _unlifted(inputs[-1], lifted))
        out = self._layers_backward_jvp(tuple(_lifted(a, lifted) for a in gn), inputs, tple, param_tangents)
        gx = (_unlifted(out[0], lifted), _unlifted(out[1], lifted))
        if tple is not None:  # the per-layer inputs' gradient pair reaches the scaled embeddings too
            dple, tdple = (_unlifted(a, lifted) for a in out[2])
            ge = self._child_backward_jvp(m.per_layer, dple, (None, tx), param_tangents, tdple)
            gx = (gx[0] + ge[0], gx[1] + ge[1])
        if m.embed_positions is not None:
            back(m.embed_positions, gx, None)
        if scale is not None:
            gx = (gx[0] * scale, gx[1] * scale)
        back(m.embed_tokens, gx, None)
        return None, None

    def _layers_backward_jvp(self, gx, inputs, tple, param_tangents):
        """Every layer's ``backward_jvp``, last first, on ``gx = (gradient, tangent)``:
        ``(dx, tdx)``, with a third entry ``(dper_layer_inputs, their tangent)`` for Gemma 4."""
        gp = None if tple is None else (np.zeros_like(tple), np.zeros_like(tple))
        for i, layer in reversed(list(enumerate(self.model.layers))):
            tin = (inputs[i],) if tple is None else (inputs[i], tple[..., i, :])
            gx = self._child_backward_jvp(layer, gx[0], tin, param_tangents, gx[1])
            if gp is not None:
                (dx, gp[0][..., i, :]), (tdx, gp[1][..., i, :]) = gx
                gx = (dx, tdx)
        return gx if gp is None else (gx[0], gx[1], gp)

    def loss_hvp(self, ids, targets, param_tangents, *, ignore_index=None):
        """The loss, its gradient and its Hessian-vector product along ``param_tangents``.

        The loss is the mean cross-entropy of ``self(ids)`` against ``targets`` (as ``loss``:
        no shift, ``targets`` of ``ids``' shape, ``ignore_index`` not counted).  Forward over
        reverse: the forward, the logits' tangent along ``param_tangents`` (``jvp``), then
        ``cross_entropy_backward_jvp`` gives ``dlogits`` and its tangent (the loss's Hessian in
        the logits times their tangent), and ``backward_jvp`` carries both back through every
        layer; the parameters' gradient tangents are ``H v``.

        Parameters
        ----------
        ids : array of int, shape (B, L) or (L,)
            Token ids.
        targets : array of int, ids' shape
            The class of each position (``ignore_index`` ones not counted).
        param_tangents : mapping of str to numpy.ndarray
            The direction ``v`` by Hugging Face name (``named_parameters``'); missing names are
            zero; a tied head is ``model.embed_tokens.weight`` alone.
        ignore_index : int, optional
            As ``loss``'s.

        Returns
        -------
        loss : float
            What ``loss(ids, targets)`` returns first.
        grads : dict of str to numpy.ndarray
            Every parameter's gradient by Hugging Face name (what ``backward`` of ``loss``'s
            ``dlogits`` adds into ``p.grad`` from zero).
        hvp : dict of str to numpy.ndarray
            The Hessian-vector product ``H v``, by the same names and shapes.

        Notes
        -----
        The model is left as this call found it: ``p.grad`` and ``p.grad_tangent`` are the same
        arrays holding the same values after the call (the returned dicts are new arrays, not
        accumulated into them), and the forward state is consumed.

        Raises
        ------
        ValueError, TypeError
            Bad ``ids``, ``targets`` or ``ignore_index``, an unknown name or a tangent of the
            wrong shape in ``param_tangents`` (before anything is computed).
        """
        ids = self._check_ids(ids)
        targets = as_index(targets, "targets")
        if targets.shape != ids.shape:
            raise ValueError(f"targets: expected ids' shape {ids.shape} (no shift), got {targets.shape}")
        v = self.config.vocab_size
        bad = targets[((targets < 0) | (targets >= v)) & (targets != ignore_index)]
        if bad.size:
            raise ValueError(f"targets: expected values in [0, {v}) (vocab_size) or ignore_index, got {bad.flat[0]}")
        # the jvp below and the backward_jvp after it share their forward tangents (computed once)
        pt = self._param_tangents(param_tangents)._remembering()
        params = list(self.named_parameters())
        kept = [(p.grad, p.grad_tangent) for _, p in params]
        grads, hvp = _zeroed_results(params)
        try:
            for n, p in params:  # backward_jvp adds into the results' own arrays
                p.grad, p.grad_tangent = grads[n], hvp[n]
            logits = self.forward(ids)
            loss, cache = F.cross_entropy(logits, targets, ignore_index=ignore_index)
            tlogits = self.jvp(param_tangents=pt)
            dlogits, tdlogits = K.cross_entropy_backward_jvp(np.ones((), logits.dtype), cache, (tlogits,))
            self.backward_jvp(dlogits, param_tangents=pt, ddy=tdlogits)
        finally:
            for (_, p), (grad, tangent) in zip(params, kept):
                p.grad, p.grad_tangent = grad, tangent
        return float(loss), grads, hvp

    def loss(self, ids, targets, *, ignore_index=None, attention_mask=None):
        """Forward and mean cross-entropy of ``targets (B, L)`` (``ignore_index`` not counted;
        ``attention_mask`` as ``forward``'s, its padded targets best set to ``ignore_index``).
        Returns ``(loss as float, dlogits)`` for ``backward``."""
        logits = self.forward(ids, attention_mask=attention_mask)
        loss, cache = F.cross_entropy(logits, targets, ignore_index=ignore_index)
        return float(loss), F.cross_entropy_backward(np.ones((), logits.dtype), cache)

    def reset_kv_cache(self) -> None:
        """Empty every layer's cache (start a new sequence)."""
        for layer in self.model.layers:
            layer.reset_kv_cache()
        object.__setattr__(self, "_seen", 0)  # tokens fed through the cache
        object.__setattr__(self, "_mask_history", None)  # their attention_mask (None: all tokens)

    # What a npattn.generation.PromptCache asks of every module with a decoding cache
    # (npattn.nn.kv_cache._KeysCacheHooks); here, the count of the tokens fed.
    def _cache_state(self) -> tuple:
        return (self._seen, self._mask_history)

    def _set_cache_state(self, state: tuple) -> None:
        object.__setattr__(self, "_seen", state[0])
        object.__setattr__(self, "_mask_history", state[1])

    def _cache_mark(self, n: int) -> None:
        return None

    def _can_rewind(self, n: int, mark) -> bool:
        return self._mask_history is None and 0 <= n <= self._seen

    def _rewind_cache(self, n: int, mark) -> None:
        object.__setattr__(self, "_seen", n)

    def _rewinds_anywhere(self) -> bool:
        return True

    def prompt_cache(self):
        """An empty ``npattn.generation.PromptCache`` of this model: pass it to ``generate`` or
        ``stream`` as ``prompt_cache=`` to keep the layers' caches between calls and reuse the
        part of each prompt the last call already ran (a chat's conversation so far).

        Examples
        --------
        >>> import numpy as np
        >>> from npattn.models import CausalLM
        >>> from npattn.models.tiny import tiny_config
        >>> model = CausalLM(tiny_config("llama"), rng=0)
        >>> cache = model.prompt_cache()
        >>> first = model.generate(np.array([1, 2, 3]), 4, prompt_cache=cache)
        >>> len(cache), cache.reused                      # the prompt and the tokens fed after it
        (6, 0)
        >>> second = model.generate(np.concatenate([first, [5, 6]]), 4, prompt_cache=cache)
        >>> cache.reused                                  # the first call's 6 tokens were not run again
        6
        >>> bool(np.array_equal(second, model.generate(np.concatenate([first, [5, 6]]), 4)))
        True
        """
        from ..generation import PromptCache

        return PromptCache(self)

    @property
    def reencode_length(self) -> int | None:
        """The length (prompt and new tokens) at which cached decoding (``generate``, ``stream``)
        encodes the whole sequence again instead of feeding one token: with LongRoPE,
        ``original_max_position_embeddings + 1``, where the frequencies switch from the short
        factors to the long ones (keys cached before would keep the short ones), as transformers'
        ``Phi3ForCausalLM.prepare_inputs_for_generation`` drops its cache there; None otherwise.
        A direct ``model(ids, use_cache=True)`` does not: each call's frequencies follow its own
        largest position, as a transformers forward with a cache."""
        lengths = [
            int(p["original_max_position_embeddings"])
            for p in self.config.rope.values()
            if p is not None and p.get("rope_type") == "longrope"
        ]
        return min(lengths) + 1 if lengths else None

    # -- saving and generating ---------------------------------------------------------------
    def save_pretrained(self, directory, *, max_shard_size="5GB") -> None:
        """Write the model as a Hugging Face directory that ``transformers.AutoModelForCausalLM.from_pretrained``
        and ``CausalLM.from_pretrained`` read: ``config.json`` (the config the model was built from,
        ``dtype`` the model's) and its tensors as safetensors under the checkpoint's names (a tied
        head once; each routed expert apart where the family's checkpoints keep them so), in
        ``model.safetensors`` or, above ``max_shard_size``, in shards listed by
        ``model.safetensors.index.json``.  Atomic: written into a temporary sibling directory,
        flushed to disk, then renamed into place; an existing directory is replaced only once the
        new one is complete (its other files, e.g. a tokenizer, are carried over), and a failed or
        interrupted save leaves it as it was (``npattn.models.save``).  A directory no rename can
        replace (a mount point, e.g. a container's volume) gets its files replaced in place, in an
        order that never leaves a directory loading a mix of two models or a part of one.

        Parameters
        ----------
        directory : str or path
        max_shard_size : int or str
            Bytes, or a size as transformers parses it: ``"5GB"`` (default), ``"500MB"`` (powers of 1000).

        Raises
        ------
        TypeError, ValueError
            A malformed ``max_shard_size``, a ``directory`` that is a file, a config that is not
            a Hugging Face dict (before anything is written).
        OSError
            From the file system (the old directory, if any, as it was; in place, one that loads
            the old model, the new one, or none).
        """
        from .save import save_pretrained

        save_pretrained(self, directory, max_shard_size)

    @property
    def generation_defaults(self) -> dict:
        """``{"eos_token_id": ..., "pad_token_id": ..., "repetition_penalty": ...}``, what
        ``generate`` and ``stream`` use when not given, as transformers' ``generate`` takes them
        from ``model.generation_config`` (the repetition penalty greedy or not, as transformers
        applies it): ``generation_config.json``'s values where ``from_pretrained`` read one (a key
        the file leaves out is None there, as in transformers), else the config's
        (``config.json``'s; no repetition penalty)."""
        source = self.generation_config if self.generation_config is not None else vars(self.config)
        return {key: source.get(key) for key in ("eos_token_id", "pad_token_id", "repetition_penalty")}

    def _generation_options(self, ids, eos_token_id, repetition_penalty, max_new_tokens) -> tuple:
        """``ids`` checked against the vocabulary (and, with a learned position table, the prompt
        and ``max_new_tokens`` against its rows: the last token is never fed back, so ``L +
        max_new_tokens - 1`` positions), and the eos and pad ids and the repetition penalty: each
        given one, else ``generation_defaults``'."""
        special = self.generation_defaults
        if eos_token_id is not None:
            special["eos_token_id"] = eos_token_id
        if repetition_penalty is not None:
            special["repetition_penalty"] = repetition_penalty
        ids = self._check_ids(ids)
        n, k = self.config.max_position_embeddings, max_new_tokens
        # GPT-2's wpe (a malformed max_new_tokens gets stream_tokens' message)
        if self.config.position_embedding and isinstance(k, numbers.Integral) and not isinstance(k, bool) and n:
            if int(k) > 0 and ids.shape[-1] + int(k) - 1 > n:
                raise ValueError(
                    f"max_new_tokens: expected at most {n - ids.shape[-1] + 1} after a prompt of {ids.shape[-1]} "
                    f"tokens (the model's {n} learned positions, max_position_embeddings, GPT-2's n_positions), got {k}"
                )
        return ids, special

    def generate(
        self,
        ids,
        max_new_tokens,
        *,
        attention_mask=None,
        do_sample=False,
        temperature=1.0,
        top_k=None,
        top_p=None,
        eos_token_id=None,
        rng=None,
        min_p=None,
        repetition_penalty=None,
        prompt_cache=None,
    ) -> np.ndarray:
        """The prompt ``ids (B, L)`` followed by up to ``max_new_tokens`` new tokens, as
        transformers' ``generate`` returns them: greedy unless ``do_sample`` (then ``temperature``,
        ``top_k``, ``top_p``, ``min_p``; ``rng`` an int seed or a Generator); ``eos_token_id`` (an
        id or a list; ``[]``: none) defaults to ``generation_defaults``' (``generation_config.json``'s,
        else the config's); a row that has produced it continues with the ``pad_token_id`` of
        ``generation_defaults`` (its eos where there is none).  ``repetition_penalty`` (1: none)
        defaults to ``generation_defaults``' too and applies greedy or not, as transformers
        applies a ``generation_config.json``'s (Qwen2.5's instruct models ship 1.05).  The result is always
        ``(B, L + max_new_tokens)``: decoding stops when every row has finished (as transformers',
        which then returns fewer columns) and the remaining columns hold that pad token, so the
        tokens transformers returns are this result's first columns.  Sampling settings in
        ``generation_config.json`` (``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``min_p``) are not applied: the defaults are this signature's (greedy), as transformers' with
        ``do_sample=False``; pass them to sample as the checkpoint suggests.  The
        prompt is encoded once into the cache, then one token per step
        (``npattn.generation.stream_tokens`` has the details).  ``attention_mask (B, L)``: 1 for a
        token, 0 for left padding (as ``forward``'s), so that each row continues as its prompt
        alone would.  ``prompt_cache`` (one sequence, from ``prompt_cache()``): the caches kept
        from the last call that used it, whose tokens shared with ``ids`` are not run again
        (``npattn.generation.PromptCache``); None (default): a fresh cache, emptied after the call.

        Examples
        --------
        >>> import numpy as np
        >>> from npattn.models import CausalLM
        >>> from npattn.models.tiny import tiny_config
        >>> model = CausalLM(tiny_config("llama"), rng=0)
        >>> model.generate(np.array([[1, 2, 3], [4, 5, 6]]), 4).shape
        (2, 7)
        """
        from ..generation import _check_token_ids, generate_tokens

        ids, special = self._generation_options(ids, eos_token_id, repetition_penalty, max_new_tokens)
        out = generate_tokens(
            self,
            ids,
            max_new_tokens,
            attention_mask=attention_mask,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            rng=rng,
            prompt_cache=prompt_cache,
            **special,
        )
        missing = ids.shape[-1] + int(max_new_tokens) - out.shape[-1]
        if missing:  # every row finished early: each continues with the pad token (or its eos)
            eos = special["eos_token_id"]
            pad = special["pad_token_id"]
            pad = pad if pad is not None else _check_token_ids(eos, "eos_token_id")[0]
            out = np.concatenate([out, np.full(out.shape[:-1] + (missing,), pad, dtype=out.dtype)], axis=-1)
        return out

    def stream(
        self,
        ids,
        max_new_tokens,
        *,
        attention_mask=None,
        do_sample=False,
        temperature=1.0,
        top_k=None,
        top_p=None,
        eos_token_id=None,
        rng=None,
        min_p=None,
        repetition_penalty=None,
        prompt_cache=None,
    ):
        """``generate``'s new tokens as they come: a generator of one ``(B,)`` array per step
        (``()`` for a prompt ``(L,)``), the same tokens ``generate`` appends.  The arguments are
        checked before it is returned; while it runs the model is in eval mode and holds its
        cache (both restored when it ends or is closed; a ``prompt_cache`` then keeps the tokens
        fed, see ``npattn.generation.PromptCache``).

        Examples
        --------
        >>> import numpy as np
        >>> from npattn.models import CausalLM
        >>> from npattn.models.tiny import tiny_config
        >>> model = CausalLM(tiny_config("llama"), rng=0)
        >>> ids = np.array([[1, 2, 3]])
        >>> steps = list(model.stream(ids, 4))
        >>> bool((np.stack(steps, axis=-1) == model.generate(ids, 4)[:, 3:]).all())
        True
        """
        from ..generation import stream_tokens

        ids, special = self._generation_options(ids, eos_token_id, repetition_penalty, max_new_tokens)
        return stream_tokens(
            self,
            ids,
            max_new_tokens,
            attention_mask=attention_mask,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            rng=rng,
            prompt_cache=prompt_cache,
            **special,
        )

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, state_dict, config, *, dtype=None, weights_dtype=None) -> CausalLM:
        """A model with the weights of a Hugging Face ``*ForCausalLM`` state dict.

        Parameters
        ----------
        state_dict : mapping
            Hugging Face names (``model.embed_tokens.weight``, ``model.layers.0.self_attn.q_proj.weight``,
            ..., ``lm_head.weight``) to numpy arrays, CPU torch tensors (bfloat16 included) or
            the lazy tensors of ``npattn.models.hf``.  A tied head may be present or absent, or
            stand alone for the pair (``lm_head.weight`` without ``model.embed_tokens.weight``, as
            ``safetensors.torch.save_model`` writes shared tensors: transformers ties the embedding to it).
            DeepSeek-V3's and Qwen3-Next's routed experts may come fused (``mlp.experts.gate_up_proj``,
            as transformers holds them) or one expert at a time (``mlp.experts.{e}.gate_proj.weight``
            ..., as their checkpoints and ``save_pretrained`` write them).
        config : mapping or CausalLMConfig
            The model's ``PretrainedConfig.to_dict()`` (or ``config.json``).
        dtype : numpy dtype or None
            The model's dtype; ``None``: the state dict's float64 or float32 (bfloat16 and float16
            become float32).
        weights_dtype : None or "bfloat16"
            As in ``from_pretrained``.

        Returns
        -------
        CausalLM

        Raises
        ------
        ValueError
            An unsupported config option (naming the key), or a missing, unexpected or wrongly
            shaped state-dict key (naming it; a per-expert part by its own key, and an expert
            index with a leading zero or per-expert keys beside their fused tensor as ambiguous).
            Every key and shape is compared with those the config gives before any layer is
            built or any array allocated; nothing is converted before all have been checked.
        TypeError
            A state dict that is not a mapping, or a tensor that is not a float array.
        """
        from .hf import load_into

        return load_into(cls, state_dict, config, dtype, weights_dtype)

    @classmethod
    def from_pretrained(cls, directory, *, dtype=None, weights_dtype=None) -> CausalLM:
        """A model from a saved Hugging Face directory: ``config.json`` and ``model.safetensors``
        (or the shards of ``model.safetensors.index.json``), read without torch, one tensor at a
        time from a memory map (bfloat16, float16, float32, float64, float8 e4m3).  Released
        quantized checkpoints (``quantization_config`` with ``quant_method`` ``"mxfp4"``: GPT-OSS's
        ``*_blocks``/``*_scales`` experts; ``"fp8"``: DeepSeek-V3's ``weight_scale_inv`` per
        ``weight_block_size`` block) are dequantized as transformers and DeepSeek do
        (``npattn.models.quant``).

        Parameters
        ----------
        directory : str or path
        dtype : numpy dtype or None
            ``None``: float32 (float64 for a float64 checkpoint).
        weights_dtype : None or "bfloat16"
            ``"bfloat16"``: keep the large matrices (every linear layer's weight, the embedding
            table, the routed experts: ``bfloat16_parameters``) as bfloat16 bits and compute in
            float32 — half the bytes; the logits are those of a float32 model whose weights were
            rounded to bfloat16 (round to nearest even, as torch's ``.to(torch.bfloat16)``;
            a bfloat16 checkpoint's bits are kept as they are, read straight into place without
            a float32 copy).  Each matrix is widened where it is used, block by block into a
            reused buffer (``npattn.functional._bfloat16``).  Such a model is for inference and
            ``save_pretrained`` (which then writes bfloat16 tensors): ``backward``, ``jvp``,
            ``backward_jvp`` and optimizers refuse its bfloat16 weights (``RuntimeError`` /
            ``ValueError`` naming the option); ``model.to(np.float32)`` makes a float32 model of
            the same values that trains.  ``dtype`` must then be None or float32.

        Returns
        -------
        CausalLM

        Raises
        ------
        FileNotFoundError
            No ``config.json`` or no safetensors file.
        ValueError
            As ``from_hf``; also a malformed safetensors file, or a quantization npattn does not
            read or a malformed quantized tensor (named); a ``weights_dtype`` other than None and
            ``"bfloat16"`` (or with a ``dtype`` other than float32), before any file is read.
        """
        from .hf import from_pretrained

        return from_pretrained(cls, directory, dtype, weights_dtype)

    @classmethod
    def from_gguf(cls, path, *, dtype=None, weights_dtype=None) -> CausalLM:
        """A model from a GGUF file (llama.cpp's format; the extra ``gguf``): ``llama`` (Mixtral's
        too), ``qwen2``, ``qwen2moe``, ``qwen3``, ``qwen3moe``, ``olmoe``, ``gemma2``, ``gemma3``,
        ``smollm3``, ``phi3``, ``granite``, ``granitemoe`` (GraniteMoeShared's and Granite 4.0's too),
        ``granitehybrid`` (Granite 4.0's hybrids, their Mamba-2 layers too), ``lfm2``, ``lfm2moe``,
        ``olmo2`` (OLMo 2's, and OLMo 3's with a sliding window), ``exaone4``, ``ernie4_5``, ``glm4``,
        ``mistral3`` (Ministral 3's query scale by position), ``arcee``, ``olmo`` (the first OLMo),
        ``apertus``, ``command-r`` (Command R and R+), ``cohere2`` (Command R7B), ``hunyuan-dense``,
        ``gptneox`` (Pythia, GPT-NeoX-20B), ``phi2`` (Phi-1 to 2), ``starcoder2``, ``stablelm`` (StableLM-3B-4E1T,
        StableLM 2 1.6B and 12B), ``gpt2`` (GPT-2, its learned
        positions), ``falcon-h1``, ``nemotron_h``
        (Nemotron-H), ``nemotron_h_moe`` (Nemotron 3 Nano's routed experts) and ``mamba2`` files of ``F32``,
        ``F16`` or ``BF16`` tensors or of any block quantization of llama.cpp's releases (``Q8_0`` ... ``Q5_1``,
        ``Q2_K`` ... ``Q6_K``, the i-quants, ``TQ1_0``/``TQ2_0``, ``MXFP4``, ``NVFP4``:
        ``npattn.models.gguf.GGUF_TYPES``), dequantized by the ``gguf`` package;
        the config from the file's metadata (and what llama.cpp derives: Gemma 2's and 3's window patterns
        and score scales; OLMo 3's layer pattern from its per-layer booleans or period), the tensors
        under Hugging Face's names, llama.cpp's q/k RoPE permutation and Gemma's ``1 + w`` norm
        storage undone, the experts' gate and up joined (an early Mixtral file's experts, one tensor
        each, stacked), Llama 3.x's ``rope_freqs.weight`` read as its ``rope_scaling``, Phi-3's fused
        ``attn_qkv`` / ``ffn_up`` split and its LongRoPE factor tensors read as its ``rope_scaling``,
        LFM2's layer types read off its per-layer ``head_count_kv`` and its squeezed convolution
        weights given back their unit axis, Granite 4.0's Mamba-2 layers off its per-layer
        ``head_count_kv`` and its ``ssm.*`` keys (``A_log`` from the stored ``A = -exp(A_log)``),
        EXAONE 4.0's sliding (and so rotating) layers off its ``sliding_window_pattern``,
        Nemotron-H's blocks off its per-layer ``head_count_kv`` and ``feed_forward_length`` (both 0:
        Mamba-2; a width in a ``nemotron_h_moe`` file: routed experts); a
        ``falcon-h1`` file's weights hold its muP multipliers (its converter multiplied them in and
        kept no factor): read as they are, every multiplier 1, the network llama.cpp computes
        (``npattn.models.gguf``).

        Parameters
        ----------
        path : str or path
        dtype : numpy dtype or None
            ``None``: float32.
        weights_dtype : None or "bfloat16"
            ``"bfloat16"``: as ``from_pretrained``'s, each large matrix dequantized, then rounded
            to bfloat16 bits (half the float32 model's bytes; computed in float32).

        Returns
        -------
        CausalLM

        Raises
        ------
        ImportError
            Without the ``gguf`` package.
        FileNotFoundError
            No such file.
        ValueError
            A file that is not GGUF, an architecture, option or tensor type npattn does not read
            (named), or a tensor the model does not have; as ``from_hf`` for the rest.
        """
        from .gguf import from_gguf

        return from_gguf(cls, path, dtype, weights_dtype)
