"""A Hugging Face config dict -> ``CausalLMConfig``, one reader per ``model_type``.

``CausalLM`` is one class; a family is a configuration of it (as LitGPT keeps one model and a
config per family).  ``config_from_hf(d)`` reads the plain dict of ``PretrainedConfig.to_dict()``
(or a checkpoint's ``config.json``) and returns the ``CausalLMConfig`` that describes the same
network.  Every key of the dict is either read, known to change nothing in the forward pass
(metadata such as ``architectures``, ``initializer_range``, ``use_cache``), or refused: an option
npattn does not implement raises ``ValueError`` naming the key, never a silently different model.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import reprlib
from dataclasses import dataclass, field
from typing import Any, Mapping

from .._validate import check_size
from ..functional.rope_scaling import _standardize, resolve_rotary_dim

__all__ = [
    "CausalLMConfig",
    "config_from_hf",
    "SUPPORTED_MODEL_TYPES",
    "AttentionConfig",
    "LatentConfig",
    "DeltaNetConfig",
    "KdaConfig",
    "Mamba2Config",
    "ShortConvConfig",
    "SharedKVConfig",
    "MoEConfig",
    "CheckpointLayout",
    "latent_config",
    "delta_net_config",
    "kda_config",
    "moe_config",
    "GgufFamily",
    "GGUF_FAMILIES",
    "TextTower",
    "MULTIMODAL",
    "text_checkpoint",
]

SUPPORTED_MODEL_TYPES = (
    "llama",
    "qwen3",
    "qwen3_moe",
    "gemma3_text",
    "gpt_oss",
    "deepseek_v3",
    "qwen3_next",
    "olmo3",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "kimi_linear",
    "deepseek_v32",
    "gemma4_text",
    "mistral",
    "qwen2",
    "gemma2",
    "olmo2",
    "smollm3",
    "phi3",
    "mixtral",
    "qwen2_moe",
    "olmoe",
    "granite",
    "granitemoe",
    "granitemoeshared",
    "granitemoehybrid",
    "lfm2",
    "exaone4",
    "ernie4_5",
    "ministral3",
    "ministral",
    "lfm2_moe",
    "falcon_h1",
    "nemotron_h",
    "mamba2",
    "arcee",
    "glm4",
    "cohere2",
    "cohere",
    "apertus",
    "hunyuan_v1_dense",
    "gpt_neox",
    "phi",
    "stablelm",
    "olmo",
    "gpt2",
    "starcoder2",
)

ATTENTION_KINDS = (
    "full_attention", "sliding_attention", "linear_attention", "latent_attention", "conv", "hybrid", "none",
)  # fmt: skip
MLP_KINDS = ("dense", "moe", "dense_and_experts", "plain", "none")


# -- GGUF files: which family each llama.cpp architecture is (read by models/gguf.py) -------------
@dataclass(frozen=True)
class GgufFamily:
    """What a GGUF ``general.architecture`` is in Hugging Face terms: its ``model_type``, fixed
    config entries of the family's files (``extra``), whether llama.cpp's converter permuted the
    q/k rows for its interleaved RoPE (``permute_qk``), more config keys read from the metadata
    (``keys``: config key -> metadata key under ``"<arch>."``, each optional), the number the
    converter added to every norm weight (``norm_shift``: Gemma's ``1 + w`` norms are stored as
    ``1 + w``), and ``derive(config, meta)``, which fills the entries llama.cpp derives rather than
    reads (``meta``: the metadata under ``"<arch>."`` by suffix; the suffixes it reads: ``reads``).
    ``biases``: config key -> ``(weight, bias)`` tensor suffixes: where a block of the file holds
    the weight, the key is whether a block holds the bias (the metadata says nothing of biases; nor
    of an optional norm: Falcon-H1's ``ssm_norm``, its ``mamba_rms_norm``; Command R's q/k norms;
    StableLM's ``ffn_norm``, whose absence ``derive`` reads as its parallel residual).
    ``eps``: the config key of the norms' epsilon and its metadata key (required): RMSNorm's
    ``attention.layer_norm_rms_epsilon``, or a LayerNorm family's ``attention.layer_norm_epsilon``.
    ``own_names``: the file's tensors are looked up under the family's own layer names
    (``CausalLMConfig.layer_names``, the checkpoint's, which its converter maps) before Llama's:
    GLM-4's, whose norm after attention ``post_self_attn_layernorm`` is Llama's name
    ``post_attention_layernorm`` to npattn, the name of GLM-4's norm before the MLP in its
    checkpoints.  ``per_layer``: a layer's tensor name (under ``model.layers.{i}.``) -> the
    metadata key (no ``<arch>.`` prefix) whose array holds one number per layer for it (or one for
    every layer), a number the converter took out of the checkpoint (Apertus's xIELU parameters and
    buffers).  ``attention`` False: the family has no attention, its ``attention.head_count`` 0 (a
    ``mamba2`` file's, which ``derive`` reads without any attention key)."""

    model_type: str
    permute_qk: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)
    keys: Mapping[str, str] = field(default_factory=dict)
    norm_shift: float = 0.0
    derive: Any = None
    reads: tuple = ()
    biases: Mapping[str, tuple] = field(default_factory=dict)
    own_names: bool = False
    eps: tuple = ("rms_norm_eps", "attention.layer_norm_rms_epsilon")
    per_layer: Mapping[str, str] = field(default_factory=dict)
    attention: bool = True

    def base_config(self) -> dict:
        """The start of the Hugging Face config dict of such a file (the rest is read from its metadata)."""
        return {"model_type": self.model_type, **self.extra}


def _gguf_experts(config: dict, arch: str, keys: tuple = ("num_experts", "num_experts_per_tok")) -> None:
    """Refuse a MoE file of ``arch`` without its expert counts (``keys``: the config keys read from
    ``expert_count`` and ``expert_used_count``), as llama.cpp's loader does."""
    metadata = dict(_GGUF_EXPERTS, num_local_experts="expert_count")
    for key in keys:
        if not config.get(key):
            name = f"{arch}.{metadata[key]}"
            raise ValueError(f"metadata {name!r} missing or 0 (the model's {key})")


def _gguf_qwen3moe(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``qwen3moe`` (``llama_model_qwen3moe``): every layer routed, softmax then top-k,
    the top k always renormalised (``norm_w`` true whatever the file says), no shared expert; the
    experts' width ``expert_feed_forward_length``, else ``feed_forward_length / expert_used_count``."""
    _gguf_experts(config, "qwen3moe")
    config.setdefault("moe_intermediate_size", config["intermediate_size"] // config["num_experts_per_tok"])


def _gguf_qwen2moe(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``qwen2moe`` (``llama_model_qwen2moe``, Qwen1.5-MoE and Qwen2-MoE files): every
    layer routed (no ``decoder_sparse_step`` or ``mlp_only_layers``), softmax then top-k never
    renormalised (its ``norm_w`` false), beside the shared expert scaled by the sigmoid of
    ``ffn_gate_inp_shexp``; the experts' width ``expert_feed_forward_length``, else
    ``feed_forward_length / expert_used_count``, the shared expert's
    ``expert_shared_feed_forward_length``, else ``feed_forward_length``; biases on q, k and v where
    the file has them (Qwen2MoeConfig's ``qkv_bias``), none on o."""
    _gguf_experts(config, "qwen2moe")
    config.setdefault("moe_intermediate_size", config["intermediate_size"] // config["num_experts_per_tok"])
    config.setdefault("shared_expert_intermediate_size", config["intermediate_size"])
    config["qkv_bias"] = config.pop("attention_bias")


def _gguf_olmoe(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``olmoe`` (``llama_model_olmoe``): every layer routed, softmax then top-k never
    renormalised (its ``norm_w`` false), the experts ``feed_forward_length`` wide, q/k norms over
    the whole projection, RoPE on rotate-half pairs (the converter does not permute)."""
    _gguf_experts(config, "olmoe")


def _gguf_llama(config: dict, meta: Mapping) -> None:
    """A ``llama`` file with ``expert_count`` > 0 is Mixtral's (``MixtralForCausalLM`` is converted
    by ``LlamaModel``: q/k permuted, the experts as ``ffn_{gate,up,down}_exps`` and the router as
    ``ffn_gate_inp``): llama.cpp's ``llama`` graph routes every layer, softmax then the top
    ``expert_used_count`` renormalised (its ``norm_w`` true), experts ``feed_forward_length`` wide,
    and masks no window; biases on its attention are refused.  Without experts it is Llama's."""
    if not meta.get("expert_count"):
        return
    config.update(
        model_type="mixtral", num_local_experts=meta["expert_count"], num_experts_per_tok=meta.get("expert_used_count")
    )
    _gguf_experts(config, "llama", ("num_local_experts", "num_experts_per_tok"))
    if config.pop("attention_bias", False):
        raise ValueError("tensor 'blk.0.attn_q.bias' in a llama file with experts: Mixtral's attention has no biases")


def _gguf_gemma2(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``gemma2`` (``llm_load_hparams``; ``Gemma2Model`` in ``convert_hf_to_gguf.py``):
    sliding and full layers alternating, the first sliding (its fixed pattern of 2), a window of
    ``attention.sliding_window`` (llama.cpp's 4096 where absent); the scores scaled by
    ``1/sqrt(head_dim)``, or ``1/sqrt(hidden/heads)`` for the 46-layer (27B) model (Gemma 2's
    ``query_pre_attn_scalar``, which the file does not store).  The softcaps are read
    (``GgufFamily.keys``; absent, llama.cpp's and Gemma2Config's 50 and 30)."""
    n = config["num_hidden_layers"]
    config["layer_types"] = _interleaved(n, 2, "sliding_attention")
    config["sliding_window"] = meta.get("attention.sliding_window", 4096)
    wide = config["hidden_size"] // config["num_attention_heads"]
    config["query_pre_attn_scalar"] = wide if n == 46 else config["head_dim"]


def _gguf_gemma3(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``gemma3`` (``llama_load_hparams_gemma3``; ``Gemma3Model`` in
    ``convert_hf_to_gguf.py``): with ``attention.sliding_window`` (> 0) every sixth layer full and
    the others sliding (llama.cpp's fixed pattern of 6), else every layer full; the sliding layers'
    RoPE base ``rope.freq_base_swa`` (llama.cpp's fixed 10000 where absent), the full layers'
    ``rope.freq_base`` with ``rope.scaling.type`` ``linear`` (``rope.scaling.factor``) applied to
    them only; the scores scaled by ``1/sqrt(head_dim)``, or ``1/sqrt(hidden/heads)`` for the
    62-layer (27B) model (Gemma's ``query_pre_attn_scalar``, which the file does not store)."""
    n, window = config["num_hidden_layers"], meta.get("attention.sliding_window")
    sliding = window is not None and window > 0
    config["layer_types"] = _interleaved(n, 6, "sliding_attention") if sliding else ["full_attention"] * n
    if sliding:
        config["sliding_window"] = window
    head_dim = config["head_dim"]  # the file's, else llama.cpp's embedding_length / head_count (gguf.py)
    config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"] if n == 62 else head_dim
    full = {"rope_type": "default", "rope_theta": config.pop("rope_theta", 10000.0)}
    kind = meta.get("rope.scaling.type", "none")
    if kind == "linear":
        if "rope.scaling.factor" not in meta:
            raise ValueError("metadata 'gemma3.rope.scaling.factor' missing (rope.scaling.type is linear)")
        full.update(rope_type="linear", factor=meta["rope.scaling.factor"])
    elif kind != "none":
        raise ValueError(f"metadata 'gemma3.rope.scaling.type' {_show(kind)} is not supported (npattn reads 'linear')")
    swa = {"rope_type": "default", "rope_theta": meta.get("rope.freq_base_swa", 10000.0)}
    config["rope_parameters"] = {"full_attention": full, "sliding_attention": swa}


def _gguf_rotated_share(config: dict, meta: Mapping, arch: str) -> float:
    """The share of each head that rotates in a file of ``arch``: its ``rope.dimension_count``
    features (absent: the whole head, llama.cpp's ``n_rot`` default) as the
    ``partial_rotary_factor`` from which transformers' ``int(head_dim * factor)`` gives them back."""
    head_dim = config["head_dim"]
    dims = meta.get("rope.dimension_count", head_dim)
    if isinstance(dims, bool) or not isinstance(dims, int) or dims < 2 or dims % 2 or dims > head_dim:
        raise ValueError(
            f"metadata '{arch}.rope.dimension_count' {_show(dims)}: expected an even number of rotated features "
            f"from 2 to the head's {head_dim}"
        )
    factor = dims / head_dim
    if int(head_dim * factor) < dims:  # the quotient rounded down: the next float up gives dims back
        factor = math.nextafter(factor, 1.0)
    return factor


def _gguf_phi3(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``phi3`` (``Phi3MiniModel`` in llama.cpp's converter, ``llama_model_phi3``):
    heads of ``embedding_length / head_count`` (the converter writes no ``key_length``), the first
    ``rope.dimension_count`` features of each rotating (the converter's
    ``int(partial_rotary_factor * hidden) // heads``: Phi3Config's ``partial_rotary_factor`` is
    that share of the head, the one transformers' ``int(head_dim * factor)`` gives back),
    ``rope.scaling.original_context_length`` Phi3Config's ``original_max_position_embeddings``
    (LongRoPE's switch and, with ``context_length``, its attention factor), and
    ``attention.sliding_window`` the window of every layer, 0 none (the converter writes 0 for a
    config without one).  llama.cpp itself turns Phi-3's window off (``n_swa = 0``: "Phi SWA is
    currently disabled"); npattn keeps it, as transformers' Phi-3 masks with it, the model the file
    was converted from.  LongRoPE's factors are tensors (``models/gguf.py``: ``_longrope_scaling``)."""
    factor = _gguf_rotated_share(config, meta, "phi3")
    if factor != 1.0:
        config["partial_rotary_factor"] = factor
    window = meta.get("attention.sliding_window", 0)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"metadata 'phi3.attention.sliding_window' {_show(window)}: expected an integer >= 0")
    if window:
        config["sliding_window"] = window
    original = meta.get("rope.scaling.original_context_length")
    if original is not None:
        config["original_max_position_embeddings"] = original


def _gguf_granite(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``granite``, ``granitemoe`` and ``granitehybrid`` (``llama_model_granite[_moe]``,
    ``llama_model_granite_hybrid``; ``GraniteModel``, ``GraniteMoeModel`` and ``GraniteHybridModel``
    in ``convert_hf_to_gguf.py``, each a ``LlamaModel``: q/k permuted, ``head_dim`` dropped, the
    ``_multiplier`` keys written as ``_scale`` where not 0): ``logit_scale`` is required (llama.cpp
    refuses a ``granite``/``granitemoe`` file without it; the converter always writes it) and must
    be > 0; ``embedding_scale`` and ``residual_scale`` absent or 0 mean none (1);
    ``attention.scale`` absent or 0 means ``1/sqrt(head_dim)`` (llama.cpp's ``kq_scale``; not
    GraniteConfig's default of 1);
    ``rope.scaling.finetuned`` is llama.cpp's switch for RoPE in these files (true where absent).

    Which model a file holds: ``GraniteHybridModel`` writes Granite 4.0 (``granitemoehybrid``)
    without Mamba layers as a ``granite`` file (no experts: ``expert_count`` 0, the shared MLP as
    ``ffn_gate``/``ffn_up``/``ffn_down``) or a ``granitemoe`` one (the shared MLP as
    ``ffn_*_shexp``), with its Mamba keys (``ssm.*``), ``expert_shared_feed_forward_length`` and a
    ``head_count_kv`` per layer; with Mamba layers it writes ``granitehybrid``, whose layers of
    ``head_count_kv`` 0 are Mamba-2 layers (llama.cpp's ``recurrent_layer_arr``; ``_gguf_mamba2``:
    their sizes from the ``ssm.*`` keys), the others attention layers, all of one count (RoPE where
    ``rope.scaling.finetuned``, else none, as llama.cpp's graph; the hybrid releases' none); a
    ``granite`` or ``granitemoe`` file with such a layer is refused by name (llama.cpp reads
    recurrent layers in a ``granitehybrid`` file only).  A ``granitemoe`` file with
    ``expert_shared_feed_forward_length`` and no ``ssm.*`` is GraniteMoeShared's
    (``GraniteMoeModel``).  Granite 3.x files without RoPE are refused (transformers' Granite
    always rotates); experts need their counts."""
    mt = config["model_type"]
    arch = "granitehybrid" if mt == "granitemoehybrid" else mt
    n = config["num_hidden_layers"]
    scale = config.get("logits_scaling")
    if scale is None:  # the converter writes it (Granite's logits_scaling); llama.cpp's graphs divide by it
        raise ValueError(f"metadata '{arch}.logit_scale' missing (the model's logits_scaling; llama.cpp requires it)")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"metadata '{arch}.logit_scale': expected a finite number > 0, got {_show(scale)}")
    for key in ("embedding_multiplier", "residual_multiplier"):
        if not config.get(key):
            config[key] = 1.0
    if not config.get("attention_multiplier"):
        config["attention_multiplier"] = 1.0 / math.sqrt(config["head_dim"])
    kv = config.get("num_key_value_heads")
    if arch == "granitehybrid" and isinstance(kv, int) and not isinstance(kv, bool):
        kv = [kv] * n  # one count for every layer (llama.cpp's n_head_kv(il)): 0, every layer Mamba-2
    if isinstance(kv, (list, tuple)):  # one per layer (GraniteHybridModel): 0 on a Mamba-2 layer
        name = f"metadata '{arch}.attention.head_count_kv' {_show(kv)}"
        if len(kv) != n or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in kv):
            raise ValueError(f"{name}: expected {n} counts (block_count), 0 on a Mamba-2 layer")
        mamba = [i for i, k in enumerate(kv) if k == 0]
        if mamba and arch != "granitehybrid":
            raise ValueError(
                f"{name}: layers {mamba} are Mamba-2 layers (head_count_kv 0), which llama.cpp reads only from a "
                "granitehybrid file"
            )
        counts = {k for k in kv if k}
        if len(counts) > 1:
            raise ValueError(f"{name}: the attention layers' counts differ")
        config["num_key_value_heads"] = counts.pop() if counts else config["num_attention_heads"]
        if mamba:
            _gguf_mamba2(config, meta, arch)
    rope = meta.get("rope.scaling.finetuned", True)
    granite4 = arch == "granitehybrid" or any(k.startswith("ssm.") for k in meta)
    if arch == "granite" and config.get("shared_intermediate_size"):
        granite4 = True  # only GraniteHybridModel writes a shared MLP's width into a granite file
    experts = config.get("num_local_experts") or 0
    if arch == "granite":  # TextModel writes Granite 4.0's counts of 0; a granite file has no experts
        for key, suffix in (("num_local_experts", "expert_count"), ("num_experts_per_tok", "expert_used_count")):
            if config.pop(key, 0):
                raise ValueError(
                    f"metadata 'granite.{suffix}' = {_show(meta.get(suffix))}: a granite file has no experts"
                )
        experts = 0
    if experts or arch == "granitemoe":
        _gguf_experts(config, arch, ("num_local_experts", "num_experts_per_tok"))
    if not granite4:
        if rope is not True:
            raise ValueError(
                f"metadata '{arch}.rope.scaling.finetuned' = {_show(rope)}: llama.cpp's {arch} then attends without "
                "RoPE, which transformers' Granite (and npattn's) does not"
            )
        if config.get("shared_intermediate_size"):  # GraniteMoeModel's GraniteMoeShared
            config["model_type"] = "granitemoeshared"
        return
    if not config.get("shared_intermediate_size"):
        raise ValueError(
            f"metadata '{arch}.expert_shared_feed_forward_length' missing or 0 (Granite 4.0's shared MLP width, "
            "shared_intermediate_size)"
        )
    config.update(
        model_type="granitemoehybrid",
        layer_types=["mamba" if k == 0 else "attention" for k in kv] if isinstance(kv, list) else ["attention"] * n,
        position_embedding_type="rope" if rope is True else "nope",
        num_local_experts=experts,
        num_experts_per_tok=config.get("num_experts_per_tok") or 0,
    )


# Mamba-2's names (Mamba2Config's) of Granite 4.0's mamba_* keys (_mamba2's, _gguf_mamba2's)
_MAMBA2_KEYS = {
    "mamba_n_heads": "num_heads",
    "mamba_d_head": "head_dim",
    "mamba_n_groups": "n_groups",
    "mamba_d_state": "state_size",
    "mamba_d_conv": "conv_kernel",
    "mamba_chunk_size": "chunk_size",
    "mamba_expand": "expand",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_proj_bias": "use_bias",
}
# the Mamba-2 sizes <- Mamba2Model.set_gguf_parameters' ssm.* keys (Granite 4.0's, Falcon-H1's;
# time_step_rank is the number of heads, "mamba_n_heads"; the inner width is ssm.inner_size: _gguf_mamba2)
_GGUF_MAMBA2 = {
    "mamba_d_conv": "ssm.conv_kernel",
    "mamba_d_state": "ssm.state_size",
    "mamba_n_groups": "ssm.group_count",
    "mamba_n_heads": "ssm.time_step_rank",
}


def _gguf_mamba2(config: dict, meta: Mapping, arch: str) -> None:
    """The Mamba-2 layers' sizes as ``Mamba2Model.set_gguf_parameters`` writes them (Granite 4.0's
    ``GraniteHybridModel``, Falcon-H1's ``FalconH1Model``): ``ssm.conv_kernel`` taps,
    ``ssm.state_size``, ``ssm.group_count`` groups, ``ssm.time_step_rank`` heads over
    ``ssm.inner_size`` channels (``mamba_n_heads * mamba_d_head``).  Granite 4.0's inner width is
    ``mamba_expand * hidden_size`` (so a multiple of ``embedding_length``); Falcon-H1's is its own
    ``mamba_d_ssm``.  The file stores no chunk size (a summation order, not another network:
    transformers' default, 256) and no ``time_step_limit`` (llama.cpp's scan clips no step:
    transformers' default, none); the biases are its tensors' (``GgufFamily.biases``)."""
    for key, suffix in (*_GGUF_MAMBA2.items(), ("inner", "ssm.inner_size")):
        v = meta.get(suffix)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            # the family's own config key (Nemotron-H's are not Granite 4.0's mamba_*)
            nemotron = arch in ("nemotron_h", "nemotron_h_moe")
            own = _GGUF_NEMOTRON_H_MAMBA2.get(key, key) if nemotron else key
            own = _MAMBA2_KEYS.get(key, key) if arch == "mamba2" else own
            own = "mamba_num_heads * mamba_head_dim" if nemotron and key == "inner" else own
            own = "expand * hidden_size" if arch == "mamba2" and key == "inner" else own
            raise ValueError(
                f"metadata '{arch}.{suffix}': expected an integer >= 1 (the Mamba-2 layers' {own}), got {_show(v)}"
            )
        config[key] = v
    inner, hidden = config.pop("inner"), config["hidden_size"]
    heads, groups = config["mamba_n_heads"], config["mamba_n_groups"]
    if arch in ("granitehybrid", "mamba2") and inner % hidden:
        expand = "mamba_expand" if arch == "granitehybrid" else "expand"
        raise ValueError(
            f"metadata '{arch}.ssm.inner_size' {inner}: expected a multiple of embedding_length {hidden} "
            f"(the inner width is {expand} * hidden_size)"
        )
    if inner % heads:
        raise ValueError(
            f"metadata '{arch}.ssm.inner_size' {inner}: expected a multiple of ssm.time_step_rank {heads} "
            "(the heads fill the inner width)"
        )
    if heads % groups:
        raise ValueError(
            f"metadata '{arch}.ssm.group_count' {groups}: expected a divisor of ssm.time_step_rank {heads}"
        )
    width = {"mamba_d_ssm": inner} if arch == "falcon-h1" else {"mamba_expand": inner // hidden}
    if arch in ("nemotron_h", "nemotron_h_moe"):  # its inner width is mamba_num_heads * mamba_head_dim (no expand)
        width = {}
    config.update(width, mamba_d_head=inner // heads, mamba_chunk_size=256)


def _gguf_falcon_h1(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``falcon-h1`` (``llama_model_falcon_h1``; ``FalconH1Model`` in
    ``convert_hf_to_gguf.py``, a ``Mamba2Model``: q/k not permuted, llama.cpp's RoPE NeoX's): every
    layer attention and Mamba-2 side by side (``_gguf_mamba2``: the ``ssm.*`` sizes).

    The converter multiplies every muP multiplier into the weights and writes none of them
    (``FalconH1Model.modify_tensors``): ``embedding_multiplier`` into ``token_embd``,
    ``lm_head_multiplier`` into ``output``, ``attention_in_multiplier`` into ``attn_q``, ``attn_k``
    and ``attn_v`` (``key_multiplier`` too into ``attn_k``), ``attention_out_multiplier`` into
    ``attn_output``, ``ssm_in_multiplier`` and the five ``ssm_multipliers`` (the z, x, B, C and dt
    rows) into ``ssm_in``, ``ssm_out_multiplier`` into ``ssm_out``, ``mlp_multipliers`` into
    ``ffn_gate`` and ``ffn_down`` (their biases alike); llama.cpp's graph multiplies by nothing.
    The factors are not in the file, so the folds cannot be undone: the model read keeps the
    folded weights and every multiplier 1 (FalconH1Config's defaults), the network llama.cpp
    computes, which is the checkpoint's up to the folds' roundings (one per weight, none where a
    multiplier is a power of two).  A tied file (no ``output``) computes its logits with the folded
    embedding, as llama.cpp does.

    llama.cpp's Mamba-2 layer gates before its grouped norm (``mamba_norm_before_gate`` false),
    which it applies where the file holds ``ssm_norm`` (``mamba_rms_norm``); it reads no bias of
    ``ssm_in`` or ``ssm_out`` (``mamba_proj_bias``, ``projectors_bias`` false: a file with one is
    refused by the tensor's name).  Attention biases are refused: llama.cpp adds q's, k's and v's
    (multiplied by ``attention_in_multiplier`` where transformers adds them unmultiplied) and drops
    ``attn_output``'s, no network of transformers' Falcon-H1."""
    if config.get("attention_bias"):
        raise ValueError(
            "tensors 'blk.*.attn_q.bias': attention biases in a falcon-h1 file are not supported (llama.cpp adds q's, "
            "k's and v's times attention_in_multiplier and drops attn_output's: not transformers' Falcon-H1)"
        )
    _gguf_mamba2(config, meta, "falcon-h1")


def _gguf_mamba2_lm(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``mamba2`` (``llama_model_mamba2``; ``Mamba2Model`` in ``convert_hf_to_gguf.py``):
    every block a Mamba-2 mixer alone, its sizes the ``ssm.*`` keys (``_gguf_mamba2``: heads
    ``ssm.time_step_rank``, the inner width ``ssm.inner_size``, a multiple of
    ``embedding_length``: ``expand``), every norm's epsilon ``attention.layer_norm_rms_epsilon``.
    ``attention.head_count`` and ``feed_forward_length`` are 0 (no attention, no MLP: written as
    "seemingly required when loading"), the context length 2**20 (no position is read); no chunk
    size (transformers' 256: a summation order) and no ``time_step_limit`` (llama.cpp's scan clips
    no step, transformers' default); the head the embedding where the file has no ``output``
    (``tie_word_embeddings``).  llama.cpp's mamba2 loader requires ``ssm_conv1d.bias`` and loads no
    ``ssm_in.bias`` or ``ssm_out.bias`` (Mamba2Config's ``use_bias``): a file without the one or
    with the others, which llama.cpp cannot load, is refused by name."""
    if config.get("use_conv_bias") is False:
        raise ValueError("no tensor 'blk.0.ssm_conv1d.bias': llama.cpp's mamba2 requires it (use_conv_bias)")
    if config.get("use_bias"):
        raise ValueError(
            "tensor 'blk.0.ssm_in.bias' in a mamba2 file: llama.cpp's mamba2 reads no in_proj/out_proj bias (use_bias)"
        )
    attention = ("num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "attention_bias")
    for key in (*attention, "intermediate_size"):
        config.pop(key, None)  # (_config's llama.cpp defaults and attention_bias: no module reads them)
    _gguf_mamba2(config, meta, "mamba2")
    config.update({own: config.pop(key) for key, own in _MAMBA2_KEYS.items() if key in config})
    config["layer_norm_epsilon"] = config.pop("rms_norm_eps")


# Nemotron-H's names for _gguf_mamba2's Mamba-2 sizes (Granite 4.0's)
_GGUF_NEMOTRON_H_MAMBA2 = {
    "mamba_d_conv": "conv_kernel",
    "mamba_n_groups": "n_groups",
    "mamba_d_state": "ssm_state_size",
    "mamba_n_heads": "mamba_num_heads",
    "mamba_d_head": "mamba_head_dim",
    "mamba_chunk_size": "chunk_size",
}


def _gguf_nemotron_h_counts(config: dict, key: str, suffix: str, arch: str = "nemotron_h") -> list:
    """``config[key]`` (the metadata ``nemotron_h.<suffix>``) as one count per layer: a list of
    ``block_count`` integers >= 0, or one integer for every layer (llama.cpp's ``get_key_or_arr``)."""
    n, v = config["num_hidden_layers"], config.get(key)
    if isinstance(v, int) and not isinstance(v, bool):
        v = [v] * n
    if (
        not isinstance(v, (list, tuple))
        or len(v) != n
        or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in v)
    ):
        raise ValueError(f"metadata '{arch}.{suffix}' {_show(v)}: expected {n} counts (block_count), integers >= 0")
    return list(v)


def _gguf_nemotron_h(config: dict, meta: Mapping, arch: str = "nemotron_h") -> None:
    """llama.cpp's ``nemotron_h`` (``llama_model_nemotron_h``; ``NemotronHModel`` in
    ``convert_hf_to_gguf.py``, a ``GraniteHybridModel``: q/k permuted as a Llama's, though no
    layer rotates; ``head_dim`` as ``attention.key_length``): blocks of one sublayer each, their
    kinds recorded as llama.cpp reads them, per layer, by ``attention.head_count_kv`` and
    ``feed_forward_length`` (``NemotronHModel.set_gguf_parameters``): both 0, a Mamba-2 mixer
    (``recurrent_layer_arr``; its sizes the ``ssm.*`` keys: ``_gguf_mamba2``); a head count and
    width 0, attention (without RoPE: ``rope.scaling.finetuned`` and ``rope.dimension_count``,
    which GraniteModel takes from ``hidden_size / head_count``, are read by no layer); a width and
    head count 0, the MLP ``ffn_down(relu2(ffn_up(x)))``.  A layer with both is refused (no
    converter writes one; llama.cpp would run only its MLP).  Every norm's epsilon is
    ``attention.layer_norm_rms_epsilon`` (TextModel's ``attention.layer_norm_epsilon``, of the
    same value, is read by nothing); llama.cpp's scan clips no step (``time_step_min`` 0); the
    biases are the tensors' (``GgufFamily.biases``).  ``arch`` ``nemotron_h_moe``: a width is the
    routed experts' block instead (``_gguf_nemotron_h_moe``)."""
    kv = _gguf_nemotron_h_counts(config, "num_key_value_heads", "attention.head_count_kv", arch)
    ff = _gguf_nemotron_h_counts(config, "intermediate_size", "feed_forward_length", arch)
    both = [i for i, (k, f) in enumerate(zip(kv, ff)) if k and f]
    if both:
        raise ValueError(
            f"metadata '{arch}.attention.head_count_kv' {_show(kv)} and '{arch}.feed_forward_length' "
            f"{_show(ff)}: layers {both} have both (a Nemotron-H block is attention, an MLP or Mamba-2)"
        )
    for name, counts in (("attention.head_count_kv", kv), ("feed_forward_length", ff)):
        if len({c for c in counts if c}) > 1:
            raise ValueError(f"metadata '{arch}.{name}' {_show(counts)}: the layers' counts differ")
    mlp = "moe" if arch == "nemotron_h_moe" else "mlp"
    kinds = ["full_attention" if k else mlp if f else "linear_attention" for k, f in zip(kv, ff)]
    config["num_key_value_heads"] = next((k for k in kv if k), config["num_attention_heads"])
    config["intermediate_size"] = next((f for f in ff if f), config["hidden_size"])  # (read by no layer if none)
    config["layers_block_type"] = kinds
    config["layer_norm_epsilon"] = config.pop("rms_norm_eps")
    config.pop("rope_theta", None)  # no layer rotates
    if "linear_attention" in kinds:
        _gguf_mamba2(config, meta, arch)
        for granite, nemotron in _GGUF_NEMOTRON_H_MAMBA2.items():
            config[nemotron] = config.pop(granite)
        config["time_step_min"] = 0.0


def _gguf_nemotron_h_moe(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``nemotron_h_moe`` (NVIDIA Nemotron 3 Nano 30B-A3B; ``NemotronHModel`` with
    ``is_moe``, ``llama_model_nemotron_h``'s loader and graph): Nemotron-H's blocks
    (``_gguf_nemotron_h``), a ``feed_forward_length`` width marking a routed-experts block
    (``NemotronHMoE``), never a dense MLP.  The block as ``build_ffn_layer`` computes it: sigmoid
    scores of ``ffn_gate_inp``, ``exp_probs_b`` for the choice only, ``expert_used_count`` of
    ``expert_count`` experts (``ffn_up_exps``/``ffn_down_exps``, relu2, not gated,
    ``expert_feed_forward_length`` wide, else ``feed_forward_length / expert_used_count``), their
    weights renormalised if ``expert_weights_norm`` (llama.cpp's default false) and scaled by
    ``expert_weights_scale`` (0 or missing: 1), within ``moe_latent_size`` (0 or missing: none)
    between ``ffn_latent_down`` and ``ffn_latent_up``; beside them the relu2 shared expert
    ``ffn_up_shexp``/``ffn_down_shexp`` ``expert_shared_feed_forward_length`` wide.  Groups:
    ``expert_group_count`` (the converter's ``n_group``) and ``expert_group_used_count`` (which
    the converter does not write; required, as llama.cpp's loader asserts, where there are groups).
    ``expert_shared_count`` and ``expert_gating_func`` are read by no layer (one shared expert,
    sigmoid scores: the graph's own); a file with multi-token-prediction blocks
    (``nextn_predict_layers``, counted in ``block_count``) is refused by name."""
    arch = "nemotron_h_moe"
    nextn = meta.get("nextn_predict_layers", 0)
    if nextn:
        raise ValueError(
            f"metadata '{arch}.nextn_predict_layers' {_show(nextn)} is not supported by npattn (supported: [0]): "
            "its multi-token-prediction blocks are counted in block_count"
        )
    _gguf_nemotron_h(config, meta, arch)
    if "moe" not in config["layers_block_type"]:
        return
    width = config["intermediate_size"]  # (kept, read by no layer: no block is a dense MLP)
    for key, suffix in (
        ("n_routed_experts", "expert_count"),
        ("num_experts_per_tok", "expert_used_count"),
        ("moe_intermediate_size", "expert_feed_forward_length"),
        ("moe_shared_expert_intermediate_size", "expert_shared_feed_forward_length"),
    ):
        v = meta.get(suffix)
        if v is None and key == "moe_intermediate_size":  # llama.cpp's n_ff / n_expert_used
            v = width // config["num_experts_per_tok"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(
                f"metadata '{arch}.{suffix}': expected an integer >= 1 (the model's {key}), got {_show(v)}"
            )
        config[key] = v
    groups = meta.get("expert_group_count", 0) or 1
    used = meta.get("expert_group_used_count")
    if groups > 1 and (isinstance(used, bool) or not isinstance(used, int) or not 1 <= used <= groups):
        raise ValueError(
            f"metadata '{arch}.expert_group_used_count' {_show(used)}: expected an integer from 1 to "
            f"expert_group_count {groups} (the model's topk_group)"
        )
    config.update(n_group=groups, topk_group=used if groups > 1 else 1)
    config["norm_topk_prob"] = bool(meta.get("expert_weights_norm", False))
    config["routed_scaling_factor"] = float(meta.get("expert_weights_scale", 0.0) or 1.0)
    latent = meta.get("moe_latent_size", 0)
    if latent:
        config["moe_latent_size"] = latent


# Granite's four numbers <- llama.cpp's names for them (GraniteModel.set_gguf_parameters)
_GGUF_GRANITE_KEYS = {
    "embedding_multiplier": "embedding_scale",
    "residual_multiplier": "residual_scale",
    "attention_multiplier": "attention.scale",
    "logits_scaling": "logit_scale",
    # the experts' counts (a Granite 4.0 granite file's are 0), the shared MLP's width
    "num_local_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "shared_intermediate_size": "expert_shared_feed_forward_length",
}
# the RoPE switch and GraniteHybridModel's Mamba-2 keys (read where a granitehybrid file has Mamba-2
# layers: _gguf_mamba2; in a granite or granitemoe file they describe no layer of the model)
_GGUF_SSM_READS = ("ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.inner_size", "ssm.time_step_rank")
_GGUF_GRANITE_READS = ("rope.scaling.finetuned", *_GGUF_SSM_READS)


# the experts' counts (every MoE file) and width (Qwen's): config key <- metadata key
_GGUF_EXPERTS = {"num_experts": "expert_count", "num_experts_per_tok": "expert_used_count"}
_GGUF_QWEN_EXPERTS = dict(_GGUF_EXPERTS, moe_intermediate_size="expert_feed_forward_length")


def _gguf_lfm2_layers(config: dict, arch: str) -> None:
    """What llama.cpp's ``lfm2`` and ``lfm2moe`` files share: ``attention.head_count_kv`` one entry
    per layer, 0 on the short-convolution layers (the layer types), the attention layers' count on
    the others; ``attention.layer_norm_rms_epsilon`` the config's ``norm_eps``; no convolution or
    attention biases (llama.cpp has none: a file with them is refused, its tensors unread)."""
    kv, n = config.get("num_key_value_heads"), config["num_hidden_layers"]
    if isinstance(kv, (list, tuple)):
        if len(kv) != n or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in kv):
            raise ValueError(
                f"metadata '{arch}.attention.head_count_kv' {_show(kv)}: expected {n} counts (block_count), 0 on a "
                "short-convolution layer"
            )
        counts = {k for k in kv if k}
        if len(counts) > 1:
            raise ValueError(f"metadata '{arch}.attention.head_count_kv' {_show(kv)}: attention layers' counts differ")
        config["layer_types"] = ["full_attention" if k else "conv" for k in kv]
        config["num_key_value_heads"] = counts.pop() if counts else config["num_attention_heads"]
    else:  # a single count: every layer attends (Lfm2MoeConfig has no default layer types)
        config["layer_types"] = ["full_attention"] * n
    config["norm_eps"] = config.pop("rms_norm_eps")
    if config.pop("attention_bias", False):
        raise ValueError(f"tensor 'blk.0.attn_q.bias': llama.cpp's {arch} has no attention biases")


def _gguf_lfm2(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``lfm2`` (``LFM2Model`` in ``convert_hf_to_gguf.py``): the layers of
    ``_gguf_lfm2_layers``; ``feed_forward_length`` the MLP's width as ``Lfm2MLP`` adjusted it (so no
    adjustment is made again); the convolution's taps ``shortconv.l_cache`` (``GgufFamily.keys``)."""
    _gguf_lfm2_layers(config, "lfm2")
    config["block_auto_adjust_ff_dim"] = False


# llama.cpp's expert_gating_func values (llama_expert_gating_func_type): 1 softmax, 2 sigmoid
_GGUF_SIGMOID_GATING = 2


def _gguf_lfm2moe(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``lfm2moe`` (``LFM2MoeModel``): LFM2's layers (``_gguf_lfm2_layers``), the dense
    MLPs ``feed_forward_length`` wide in the first ``leading_dense_block_count`` layers (llama.cpp's
    default 0), routed experts ``expert_feed_forward_length`` wide after them, chosen by
    ``expert_gating_func`` 2 (sigmoid, the only one its graph is written for) through the expert
    bias ``exp_probs_b`` (a tensor of every routed layer, as llama.cpp's loader requires it),
    always renormalised and never scaled (its ``build_moe_ffn`` call: ``norm_w`` true,
    ``scale_w`` false), so ``norm_topk_prob`` true and ``routed_scaling_factor`` 1."""
    _gguf_lfm2_layers(config, "lfm2moe")
    _gguf_experts(config, "lfm2moe")
    if not config.get("moe_intermediate_size"):
        raise ValueError(
            "metadata 'lfm2moe.expert_feed_forward_length' missing or 0 (the model's moe_intermediate_size)"
        )
    gating = meta.get("expert_gating_func", _GGUF_SIGMOID_GATING)
    if gating != _GGUF_SIGMOID_GATING:
        raise ValueError(
            f"metadata 'lfm2moe.expert_gating_func' {_show(gating)} is not supported by npattn (supported: "
            f"[{_GGUF_SIGMOID_GATING}], sigmoid: LFM2-MoE's router)"
        )
    config.setdefault("num_dense_layers", 0)
    config.update(norm_topk_prob=True, routed_scaling_factor=1.0, use_expert_bias=True)


# YaRN as llama.cpp's converter writes it (TextModel.set_gguf_parameters; an older Olmo2Model wrote
# the attention factor as rope.scaling.attn_factor): Hugging Face's key <- the metadata's
_GGUF_YARN = {
    "factor": "rope.scaling.factor",
    "original_max_position_embeddings": "rope.scaling.original_context_length",
    "attention_factor": "rope.scaling.yarn_attn_factor",
    "beta_fast": "rope.scaling.yarn_beta_fast",
    "beta_slow": "rope.scaling.yarn_beta_slow",
}
_GGUF_YARN_ATTN_OLD = "rope.scaling.attn_factor"


def _gguf_yarn(meta: Mapping, arch: str) -> dict:
    """The Hugging Face ``yarn`` RoPE parameters of a file's ``rope.scaling.*`` metadata (``{}``
    without ``rope.scaling.type``, or with ``none``): the factor (required), the original context
    length, the attention factor (either key; both differing refused) and the betas, each where the
    file has it (left out, transformers' and llama.cpp's defaults agree: the original length is
    the context length, the betas 32 and 1, the attention factor ``0.1 ln(factor) + 1``).  Another
    scaling type, or a scaling key without the type, is refused by name."""
    kind = meta.get("rope.scaling.type", "none")
    present = [k for k in (*_GGUF_YARN.values(), _GGUF_YARN_ATTN_OLD) if k in meta]
    if kind == "none":
        if present:
            raise ValueError(f"metadata '{arch}.{present[0]}' without '{arch}.rope.scaling.type' 'yarn'")
        return {}
    if kind != "yarn":
        raise ValueError(f"metadata '{arch}.rope.scaling.type' {_show(kind)} is not supported (npattn reads 'yarn')")
    if "rope.scaling.factor" not in meta:
        raise ValueError(f"metadata '{arch}.rope.scaling.factor' missing (rope.scaling.type is yarn)")
    old, new = meta.get(_GGUF_YARN_ATTN_OLD), meta.get(_GGUF_YARN["attention_factor"])
    if old is not None and new is not None and old != new:
        raise ValueError(
            f"metadata '{arch}.{_GGUF_YARN_ATTN_OLD}' {_show(old)} and '{arch}.{_GGUF_YARN['attention_factor']}' "
            f"{_show(new)} differ (both are YaRN's attention factor)"
        )
    params = {"rope_type": "yarn", **{k: meta[m] for k, m in _GGUF_YARN.items() if m in meta}}
    if old is not None:
        params["attention_factor"] = old
    return params


_GGUF_MISTRAL3_READS = (
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow",
    "rope.scaling.yarn_log_multiplier",
    "attention.temperature_scale",
)


def _gguf_mistral3(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``mistral3`` (``Mistral3Model`` in the converter, for ``Mistral3ForConditionalGeneration``
    and ``Ministral3ForCausalLM``: Llama's tensors with q/k permuted, the vision tower and projector
    left out; ``llm_build_mistral3``): every layer full (no window), no biases.  With
    ``attention.temperature_scale`` (the converter's ``llama_4_scaling_beta``) the file is Ministral
    3's: the queries after RoPE times ``1 + beta log(1 + floor(p / n))``, ``n`` llama.cpp's
    ``n_ctx_orig_yarn`` (``rope.scaling.original_context_length``), under the file's YaRN, which it
    requires (transformers' Ministral 3 reads the length from its YaRN parameters).  Without it, the
    text model of a ``mistral`` checkpoint (Mistral Small 3.x).  YaRN's attention factor: the
    converter writes ``mscale_all_dim`` as ``rope.scaling.yarn_log_multiplier`` and llama.cpp takes
    ``mscale`` as 1; npattn reads the releases' 1 (a factor of 1) and refuses another value."""
    for key in ("attention_bias", "mlp_bias"):
        if config.pop(key, False):
            where = "attn_q" if key == "attention_bias" else "ffn_up"
            raise ValueError(f"tensor 'blk.0.{where}.bias' in a mistral3 file: Mistral 3's layers have no biases")
    yarn = _gguf_yarn(meta, "mistral3")
    log_mul = meta.get("rope.scaling.yarn_log_multiplier")
    if yarn:
        if log_mul != 1.0:
            raise ValueError(
                f"metadata 'mistral3.rope.scaling.yarn_log_multiplier' {_show(log_mul)}: npattn reads 1 "
                "(Ministral 3's mscale_all_dim, with llama.cpp's mscale of 1: YaRN's attention factor 1)"
            )
        yarn.update(mscale=1.0, mscale_all_dim=1.0)
    elif log_mul is not None:
        raise ValueError(
            "metadata 'mistral3.rope.scaling.yarn_log_multiplier' without 'mistral3.rope.scaling.type' 'yarn'"
        )
    beta = meta.get("attention.temperature_scale", 0.0)
    theta = config.pop("rope_theta")
    if beta:
        if not yarn:
            raise ValueError(
                "metadata 'mistral3.attention.temperature_scale' without 'mistral3.rope.scaling.type' 'yarn' "
                "(Ministral 3's query scale takes its length from YaRN's original context length)"
            )
        rope = {**yarn, "rope_theta": theta, "llama_4_scaling_beta": beta}
        config.update(model_type="ministral3", rope_parameters=rope)
        return
    config.update(model_type="mistral", sliding_window=None)
    config["rope_parameters"] = {**yarn, "rope_theta": theta} if yarn else {"rope_type": "default", "rope_theta": theta}


def _gguf_arcee(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``arcee`` (``llama_model_arcee``; ``ArceeModel(LlamaModel)`` in the converter:
    q/k rows permuted): Llama's attention and the MLP ``ffn_down(relu2(ffn_up(x)))``, its RoPE the
    file's YaRN where it has one (the converter writes ``rope.scaling.type`` yarn, the factor and
    the original context length; the betas and attention factor left out are llama.cpp's and
    transformers' same defaults).  llama.cpp's arcee loads no bias (not q/k/v's as optional tensors
    beside an output bias, as ``ArceeAttention``'s ``attention_bias`` has, nor the MLP's): a file
    with biases is refused."""
    for key in ("attention_bias", "mlp_bias"):
        if config.pop(key, False):
            where = "attn_q" if key == "attention_bias" else "ffn_up"
            raise ValueError(f"tensor 'blk.0.{where}.bias' in an arcee file: llama.cpp's arcee reads no biases")
    yarn = _gguf_yarn(meta, "arcee")
    if yarn:
        config["rope_scaling"] = yarn


def _gguf_apertus(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``apertus`` (``llama_model_apertus``; ``ApertusModel(LlamaModel)`` in the
    converter, ``undo_permute = False``: q/k rows as the checkpoint's, NeoX RoPE of the file's base;
    Llama 3's scaling, the released models', as ``rope_freqs.weight``): per-head q/k
    norms, the non-gated MLP ``ffn_down(xielu(ffn_up(x)))``, xIELU's raw ``alpha_p``/``alpha_n``
    and its ``beta``/``eps`` one number per layer in ``xielu.*`` (``GgufFamily.per_layer``; ggml's
    xielu applies the softplus as transformers does).  llama.cpp's apertus loader requires
    ``output.weight`` (a file without it, whose head npattn would tie, is refused) and reads an
    output bias only beside q/k/v biases where ``attention_bias`` puts all four."""
    if config.get("tie_word_embeddings"):
        raise ValueError("no tensor 'output.weight': llama.cpp's apertus requires it (Apertus ties no head)")
    # RoPE of the file's base, unscaled (ApertusConfig's default, llama3 at 12e6, is the config's
    # without rope_parameters; a file's Llama 3 scaling is its rope_freqs.weight, read in its place)
    config["rope_scaling"] = {"rope_type": "default"}


def _gguf_olmo(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``olmo`` (``OlmoModel`` in the converter: q/k weight rows permuted as Llama's,
    ``attention.layer_norm_epsilon`` its fixed 1e-5, ``attention.clamp_kqv`` where the config has a
    ``clip_qkv``): LayerNorms without weight or bias.  The epsilon must be 1e-5 (transformers'
    ``OlmoLayerNorm`` has no other); a file with q/k biases is refused, the converter permuting the
    weights' rows and not the biases'."""
    eps = config.pop("layer_norm_eps")
    if not math.isclose(eps, 1e-5, rel_tol=1e-6):  # the file's float32 of 1e-5
        raise ValueError(
            f"metadata 'olmo.attention.layer_norm_epsilon' = {eps}: OLMo's LayerNorms have eps 1e-5 (OlmoLayerNorm)"
        )
    if config.get("attention_bias"):
        raise ValueError(
            "tensor 'blk.0.attn_q.bias' in an olmo file: the converter permutes q/k weights, not their biases"
        )


def _gguf_layer_pattern(pattern, n: int, arch: str, min_period: int) -> list:
    """The layer types ``attention.sliding_window_pattern`` gives ``n`` layers: one boolean per
    layer (the converter writes the config's ``layer_types`` so, true where a layer slides), or
    llama.cpp's period ``p`` (``llama_hparams::set_swa_pattern``: layer ``i`` slides where
    ``i % p < p - 1``; 0, where ``min_period`` allows it, makes every layer slide); anything else
    refused by name."""
    key = f"metadata '{arch}.attention.sliding_window_pattern' {_show(pattern)}"
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != n or not all(isinstance(p, bool) for p in pattern):
            raise ValueError(f"{key}: expected {n} booleans (block_count), true where a layer slides")
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < min_period:
        raise ValueError(f"{key}: expected one boolean per layer or a period >= {min_period}")
    return ["sliding_attention"] * n if pattern == 0 else _interleaved(n, pattern, "sliding_attention")


def _gguf_logit_scale(config: dict, meta: Mapping, arch: str) -> None:
    """Command R's and Command R7B's ``logit_scale`` (required by llama.cpp's loader, a number > 0),
    their RoPE without scaling (the converter's ``rope.scaling.type`` "none"; any other refused) and
    their tied head (gguf's tables have no output tensor for them: the converter cannot write one,
    llama.cpp's loader reads ``token_embd`` twice; a file with one is refused)."""
    if not config.get("tie_word_embeddings", True):
        raise ValueError(f"tensor 'output.weight': llama.cpp's {arch} has no output tensor (its head is token_embd's)")
    scale = meta.get("logit_scale")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"metadata '{arch}.logit_scale' {_show(scale)}: expected a number > 0 (llama.cpp requires it)")
    kind = meta.get("rope.scaling.type", "none")
    if kind != "none":
        raise ValueError(
            f"metadata '{arch}.rope.scaling.type' {_show(kind)}: llama.cpp's {arch} applies no RoPE scaling"
        )
    config["logit_scale"] = float(scale)


def _gguf_command_r(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``command-r`` (``CommandR2Model`` in ``convert_hf_to_gguf.py``, a ``TextModel``:
    ``CohereForCausalLM``'s tensors under gguf's names, q/k rows as the checkpoint has them: llama.cpp
    rotates this architecture's pairs ``(2i, 2i + 1)``, its normal RoPE, Cohere's own), the
    LayerNorms' ``attention.layer_norm_epsilon``, ``logit_scale`` (``_gguf_logit_scale``).  Biases
    and Command R+'s q/k norms (``attn_q_norm``, ``attn_k_norm``: ``(head_count, head_dim)``, a
    LayerNorm weight row per head, llama.cpp's ``LLM_NORM`` of each head) are the tensors': the
    config's ``use_qk_norm``."""
    _gguf_logit_scale(config, meta, "command-r")


def _gguf_cohere2(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``cohere2`` (``Cohere2Model`` in ``convert_hf_to_gguf.py``; ``llama_model_cohere2``):
    Command R's tensors and keys (``_gguf_logit_scale``; the converter drops the checkpoint's biases,
    which must be zero),
    ``attention.sliding_window`` (required), the sliding layers ``attention.sliding_window_pattern``
    gives (a period, llama.cpp's default 4 where absent, which the converter never writes: layer
    ``i`` slides where ``i % p < p - 1``; or one flag per layer), RoPE on the sliding layers only,
    as transformers' Cohere2 (``rope.dimension_count`` = ``rotary_pct * head_dim`` must be the
    heads' width).  ``rope.freq_base_swa`` is read and left unused, as llama.cpp's graph leaves it
    (its sliding layers rotate at ``rope.freq_base``)."""
    _gguf_logit_scale(config, meta, "cohere2")
    window = meta.get("attention.sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"metadata 'cohere2.attention.sliding_window' {_show(window)}: expected an integer >= 1")
    pattern = meta.get("attention.sliding_window_pattern", 4)
    layer_types = _gguf_layer_pattern(pattern, config["num_hidden_layers"], "cohere2", min_period=0)
    config.update(sliding_window=window, layer_types=layer_types)


def _gguf_olmo2(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``olmo2`` (``llama_model_olmo2``; ``Olmo2Model`` in ``convert_hf_to_gguf.py``,
    which converts both ``Olmo2ForCausalLM`` and ``Olmo3ForCausalLM``): post-norm layers
    (``post_attention_norm``, ``post_ffw_norm``), q/k RMSNorm over the whole projection, rotate-half
    RoPE (not permuted).  Without ``attention.sliding_window`` (or 0) the file is OLMo 2's: every
    layer full.  With it, OLMo 3's: the layers ``attention.sliding_window_pattern`` says (the
    converter writes one bool per layer from ``layer_types``; a number ``p`` is llama.cpp's period,
    layer ``i`` sliding where ``i % p < p - 1``; absent, llama.cpp's period of 4), the window the
    file's, the full layers' RoPE ``rope.freq_base`` with the file's YaRN, the sliding layers' plain
    RoPE of base ``rope.freq_base_swa`` (``rope.freq_base`` where absent; llama.cpp's olmo2 rotates
    them without YaRN, as transformers' Olmo3).  llama.cpp's own loader reads only a period from the
    pattern key (its bool array ignored, the period 4 kept): the released OLMo 3 checkpoints'
    ``layer_types`` are that period.  llama.cpp's olmo2 has no attention biases: a file with them is
    refused."""
    n, window = config["num_hidden_layers"], meta.get("attention.sliding_window", 0)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"metadata 'olmo2.attention.sliding_window' {_show(window)}: expected an integer >= 0")
    if config.pop("attention_bias", False):
        raise ValueError("tensor 'blk.0.attn_q.bias': llama.cpp's olmo2 has no attention biases")
    yarn = _gguf_yarn(meta, "olmo2")
    pattern = meta.get("attention.sliding_window_pattern")
    if not window:
        if pattern is not None:
            raise ValueError("metadata 'olmo2.attention.sliding_window_pattern' without a sliding window")
        if yarn:
            config["rope_scaling"] = yarn
        return
    types = _gguf_layer_pattern(4 if pattern is None else pattern, n, "olmo2", min_period=0)
    theta = config.pop("rope_theta")  # the file's, else llama.cpp's 10000 (models/gguf.py)
    config.update(
        model_type="olmo3",
        layer_types=types,
        sliding_window=window,
        rope_parameters={
            "full_attention": {"rope_type": "default", **yarn, "rope_theta": theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": meta.get("rope.freq_base_swa", theta)},
        },
    )


def _gguf_exaone4(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``exaone4`` (``Exaone4Model`` in ``convert_hf_to_gguf.py``, ``llama_model_exaone4``):
    q/k unpermuted (rotate-half RoPE), Llama 3's scaling as ``rope_freqs.weight``.  The converter
    writes ``attention.sliding_window`` and ``attention.sliding_window_pattern`` (one flag per
    layer, true where it slides: the config's ``layer_types``) only for a config with a window; a
    file without them is the 1.2B's kind, every layer full and rotating (a null
    ``sliding_window``), and so is one with a window but no flags (the converter's for a config
    with a window but neither ``layer_types`` nor ``sliding_window_pattern``), as llama.cpp builds
    both.  With both the file is read as the model it was converted from (only
    the sliding layers rotate) at any depth, where llama.cpp's graph slides and skips RoPE in
    64-layer (32B) files only (npattn keeps the window, as transformers' Exaone4 masks with it);
    a 64-layer file without them is llama.cpp's 32B: a window of 4096, every fourth layer full (its
    ``swa_period`` 4; an integer pattern is such a period).  llama.cpp's exaone4 has no attention
    biases: a file with them is refused (its tensors unread)."""
    if config.pop("attention_bias", False):
        raise ValueError("tensor 'blk.0.attn_q.bias': llama.cpp's exaone4 has no attention biases")
    n = config["num_hidden_layers"]
    window, pattern = meta.get("attention.sliding_window"), meta.get("attention.sliding_window_pattern")
    if n == 64:  # llama.cpp's 32B: a window of 4096, every fourth layer full, where the metadata says none
        window = 4096 if window is None else window
        pattern = 4 if pattern is None else pattern
    elif window is None or pattern is None:  # llama.cpp: no sliding layer at another depth
        if pattern is not None:
            raise ValueError(
                "metadata 'exaone4.attention.sliding_window_pattern' without 'exaone4.attention.sliding_window'"
            )
        config.update(sliding_window=None, layer_types=["full_attention"] * n)
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"metadata 'exaone4.attention.sliding_window' {_show(window)}: expected an integer >= 1")
    layer_types = _gguf_layer_pattern(pattern, n, "exaone4", min_period=1)
    config.update(sliding_window=window, layer_types=layer_types)


def _gguf_ernie4_5(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``ernie4_5`` (``Ernie4_5Model`` in ``convert_hf_to_gguf.py``, a ``TextModel``):
    the q/k rows as the checkpoint has them (not permuted: llama.cpp rotates this architecture's
    pairs ``(2i, 2i + 1)``, its "normal" RoPE, which are Ernie4_5's own), ``attention.key_length``
    the heads' width (Ernie4_5Config's ``head_dim``; absent, llama.cpp's ``embedding_length /
    head_count``), the head tied where the file has no ``output.weight``.  llama.cpp's graph adds
    biases to q, k and v only, never to o or the MLP (which transformers' ``use_bias`` has too): a
    file with biases is refused, as no model both read alike (the released ERNIE 4.5 have none)."""
    for key, tensor in (("attention_bias", "blk.0.attn_q.bias"), ("mlp_bias", "blk.0.ffn_up.bias")):
        if config.pop(key, False):
            raise ValueError(
                f"tensor {tensor!r} in an ernie4_5 file: llama.cpp's ernie4_5 adds biases to q, k and v only, "
                "transformers' use_bias to all seven projections; npattn reads ernie4_5 files without biases"
            )


def _gguf_glm4(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``glm4`` (``Glm4Model`` in ``convert_hf_to_gguf.py``, ``llm_build_glm4``): the
    q/k rows as the checkpoint has them (llama.cpp rotates this architecture's pairs ``(2i, 2i + 1)``,
    its "normal" RoPE, which are GLM's own; the converter reorders them only for GLM-4V's M-RoPE,
    whose ``rope.dimension_sections`` is refused as unknown metadata), the first
    ``rope.dimension_count`` features of each head rotating (the converter's ``int(head_dim *
    partial_rotary_factor)``; absent, llama.cpp rotates the whole head, not Glm4Config's half),
    heads ``attention.key_length`` wide, ``post_attention_norm`` after attention, ``ffn_norm`` before
    the MLP and ``post_ffw_norm`` after it (``GgufFamily.own_names``: GLM's names map them), the
    MLP's gate and up rows in one ``ffn_up``, q/k/v biases where the file holds them (never o's:
    ``Glm4Attention`` has none)."""
    config["partial_rotary_factor"] = _gguf_rotated_share(config, meta, "glm4")


def _gguf_hunyuan_dense(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``hunyuan-dense`` (``HunYuanModel`` in ``convert_hf_to_gguf.py``, a
    ``TextModel``): the q/k rows as the checkpoint has them (llama.cpp rotates this architecture's
    halves, NEOX, which are Hunyuan's own), ``attn_q_norm``/``attn_k_norm`` the checkpoint's
    ``query_layernorm``/``key_layernorm`` applied after RoPE (``llm_build_hunyuan_dense``, as the
    family's reader builds it).  For a ``"dynamic"`` RoPE dict the converter writes the NTK-alpha
    base itself as ``rope.freq_base`` (``rope_theta * alpha ** (head_dim / (head_dim - 2))``, in
    float32), ``rope.scaling.type`` none and factor 1 (and 256K as both context lengths): the
    file's model is the default RoPE of that base.  Another scaling type or factor is refused."""
    kind, factor = meta.get("rope.scaling.type", "none"), meta.get("rope.scaling.factor", 1.0)
    if kind != "none":
        raise ValueError(
            f"metadata 'hunyuan-dense.rope.scaling.type' {_show(kind)} is not supported (llama.cpp's converter "
            "writes 'none': the NTK-alpha base is rope.freq_base)"
        )
    if factor != 1:
        raise ValueError(f"metadata 'hunyuan-dense.rope.scaling.factor' {_show(factor)} is not supported (expected 1)")


def _gguf_gptneox(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``gptneox`` (``GPTNeoXModel`` in ``convert_hf_to_gguf.py``, ``llama_model_gptneox``):
    LayerNorms with biases (``attention.layer_norm_epsilon``), ``use_parallel_residual`` (required,
    as llama.cpp's loader requires it), heads of ``embedding_length / head_count``, the first
    ``rope.dimension_count`` features of each rotating on rotate-half pairs (the converter's
    ``int(rotary_pct * hidden / heads)``), the base ``rope.freq_base`` (the converter writes none:
    llama.cpp's 10000, Pythia's ``rotary_emb_base``); biases on every projection.  The file does
    not say the MLP's activation: GPTNeoXConfig's default exact ``gelu`` (Pythia's) is read."""
    parallel = meta.get("use_parallel_residual")
    if not isinstance(parallel, bool):
        raise ValueError(f"metadata 'gptneox.use_parallel_residual' {_show(parallel)}: expected true or false")
    config["rotary_pct"] = _gguf_rotated_share(config, meta, "gptneox")
    config["rotary_emb_base"] = config.pop("rope_theta")
    config["use_parallel_residual"] = parallel
    config.pop("mlp_bias", None)  # GPTNeoXMLP's biases: always


def _gguf_phi2(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``phi2`` (``Phi2Model`` in ``convert_hf_to_gguf.py``, ``llama_model_phi2``):
    one LayerNorm with a bias a layer (``attention.layer_norm_epsilon``) read by the attention
    and the MLP side by side, heads of ``embedding_length / head_count`` (``head_count_kv`` the
    converter's ``head_count``), the first ``rope.dimension_count`` features of each rotating on
    rotate-half pairs (the converter's ``int(partial_rotary_factor * hidden) // heads``), no base
    written (llama.cpp's 10000, PhiConfig's), biases on every projection and on the head
    (``output.bias``); the MLP's ``gelu_new`` (llama.cpp's tanh GELU) is PhiConfig's default."""
    config["partial_rotary_factor"] = _gguf_rotated_share(config, meta, "phi2")
    for key in ("attention_bias", "mlp_bias"):  # PhiAttention's and PhiMLP's biases: always
        config.pop(key, None)


def _gguf_stablelm(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``stablelm`` (``StableLMModel`` in ``convert_hf_to_gguf.py``, ``llama_model_stablelm``:
    StableLM-3B-4E1T, StableLM 2 1.6B and 12B, their Zephyrs): LayerNorms with biases
    (``attention.layer_norm_epsilon``), q, k, v apart and not permuted (llama.cpp's NeoX RoPE on
    rotate-half pairs), heads of ``embedding_length / head_count``, the first
    ``rope.dimension_count`` features of each rotating (the converter's ``int(partial_rotary_factor
    * hidden / heads)``), no base written (llama.cpp's 10000, StableLmConfig's), SiLU's gated MLP
    (llama.cpp's fixed ``LLM_FFN_SILU``, StableLmConfig's default).  What the tensors say, as
    llama.cpp's loader takes them: q/k/v biases (``attn_q.bias``: ``use_qkv_bias``); StableLM 2
    12B's per-head q/k LayerNorms (``attn_q_norm`` ``(head_count, head_dim)``, ``attn_k_norm``
    ``(head_count_kv, head_dim)``, the converter's stack of ``q_layernorm.norms.{h}``: the model's
    ``q_norm.weight`` as it is; ``qk_layernorm``); the parallel residual where the layers have no
    ``ffn_norm`` (the MLP then reads the attention's ``attn_norm``).  The converter's
    ``use_parallel_residual`` is not read: it writes true where the config has no such key
    (StableLM-3B-4E1T's), whose layers keep their ``ffn_norm`` and run one after the other, and
    llama.cpp's loader reads the key not at all."""
    config["partial_rotary_factor"] = _gguf_rotated_share(config, meta, "stablelm")
    config["use_qkv_bias"] = config.pop("attention_bias")
    config["use_parallel_residual"] = not config.pop("ffn_norm", True)


def _gguf_gpt2(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``gpt2`` (``GPT2Model`` in ``convert_hf_to_gguf.py``, ``llm_build_gpt2``): learned
    absolute positions ``position_embd`` of ``context_length`` rows (the converter's ``n_ctx``, old
    configs' ``n_positions``; required, as llama.cpp requires it), LayerNorms with biases
    (``attention.layer_norm_epsilon``), the fused ``attn_qkv`` [q; k; v] with its bias, heads of
    ``embedding_length / head_count`` with as many key/value heads (the converter writes no
    ``head_count_kv``: one of another count is refused), no RoPE (a ``rope.freq_base`` is not
    read), the plain MLP ``feed_forward_length`` wide with biases (its converter writes ``4
    n_embd``, GPT-2's; the tensors' shapes must agree), the head tied to ``token_embd`` where the
    file has no ``output.weight``.  The converter transposed the checkpoint's ``Conv1D`` weights
    back to ``(out, in)``: the model's own layout, read as it is.  The file does not say the
    activation: GPT2Config's ``gelu_new`` (llama.cpp's tanh GELU) is read."""
    if not config.get("max_position_embeddings"):
        raise ValueError("metadata 'gpt2.context_length' missing (the model's n_positions: its position_embd rows)")
    heads = config["num_attention_heads"]
    if config.pop("num_key_value_heads") != heads:
        raise ValueError(f"metadata 'gpt2.attention.head_count_kv': expected {heads} (GPT-2's heads, head_count)")
    if config.pop("head_dim") != config["hidden_size"] // heads:
        raise ValueError("metadata 'gpt2.attention.key_length': expected embedding_length / head_count (GPT-2's heads)")
    config["n_inner"] = config.pop("intermediate_size")
    for key in ("rope_theta", "attention_bias", "mlp_bias"):  # no RoPE; GPT-2's biases: always
        config.pop(key, None)


def _gguf_starcoder2(config: dict, meta: Mapping) -> None:
    """llama.cpp's ``starcoder2`` (``StarCoder2Model`` in ``convert_hf_to_gguf.py``, TextModel's
    keys alone; ``llama_model_starcoder2``): LayerNorms with biases (``attention.layer_norm_epsilon``),
    q, k, v apart and not permuted (rotate-half RoPE over the whole head), the plain MLP
    ``ffn_up``/``ffn_down`` under ``LLM_FFN_GELU`` (ggml's tanh GELU: Starcoder2Config's
    ``gelu_pytorch_tanh``).  ``use_bias`` is whether the file's blocks hold the biases, the
    attention's and the MLP's together (a file with one and not the other is refused by name: no
    StarCoder2 has it).  No sliding window: the converter writes none and llama.cpp masks no key
    out of the causal past, so a file's model attends to every earlier token (the checkpoint's
    ``sliding_window`` of 4096 is not in the file: beyond 4096 tokens its logits are llama.cpp's,
    not transformers').  An ``attention.sliding_window`` a file may hold is not read, as
    llama.cpp's loader reads it not at all."""
    attention, mlp = config.pop("attention_bias"), config.pop("mlp_bias", False)
    if attention != mlp:
        have, lack = ("attn_q.bias", "ffn_up.bias") if attention else ("ffn_up.bias", "attn_q.bias")
        raise ValueError(
            f"tensor 'blk.0.{have}' without 'blk.0.{lack}': a starcoder2 file's biases are all or none (use_bias)"
        )
    config["use_bias"] = attention


GGUF_FAMILIES = {
    "llama": GgufFamily("llama", permute_qk=True, derive=_gguf_llama, reads=("expert_count", "expert_used_count")),
    "qwen2": GgufFamily("qwen2"),
    # llama.cpp's smollm3 (src/models/smollm3.cpp): a llama file (q/k permuted by the converter,
    # SmolLM3Model(LlamaModel)) whose every fourth layer skips RoPE: its n_no_rope_layer_step is a
    # fixed 4 and no metadata says otherwise (the converter stores no no_rope_layers)
    "smollm3": GgufFamily("smollm3", permute_qk=True, extra={"no_rope_layer_interval": 4}),
    "qwen3": GgufFamily("qwen3"),
    "qwen3moe": GgufFamily("qwen3_moe", extra={"norm_topk_prob": True}, keys=_GGUF_QWEN_EXPERTS, derive=_gguf_qwen3moe),
    "qwen2moe": GgufFamily(
        "qwen2_moe",
        extra={"norm_topk_prob": False},
        keys=dict(_GGUF_QWEN_EXPERTS, shared_expert_intermediate_size="expert_shared_feed_forward_length"),
        derive=_gguf_qwen2moe,
    ),
    "olmoe": GgufFamily("olmoe", extra={"norm_topk_prob": False}, keys=_GGUF_EXPERTS, derive=_gguf_olmoe),
    "gemma2": GgufFamily(
        "gemma2",
        keys={"attn_logit_softcapping": "attn_logit_softcapping", "final_logit_softcapping": "final_logit_softcapping"},
        norm_shift=1.0,
        derive=_gguf_gemma2,
        reads=("attention.sliding_window",),
    ),
    "gemma3": GgufFamily(
        "gemma3_text",
        keys={"final_logit_softcapping": "final_logit_softcapping"},
        norm_shift=1.0,
        derive=_gguf_gemma3,
        reads=("attention.sliding_window", "rope.freq_base_swa", "rope.scaling.type", "rope.scaling.factor"),
    ),
    # Phi-3, Phi-3.5, Phi-4-mini: q/k/v fused in attn_qkv (or split), gate and up in ffn_up, their
    # rotate-half rows unpermuted; LongRoPE's factors the tensors rope_factors_long / _short
    "phi3": GgufFamily(
        "phi3",
        derive=_gguf_phi3,
        reads=(
            "rope.dimension_count",
            "attention.sliding_window",
            "rope.scaling.original_context_length",
            "rope.scaling.attn_factor",
        ),
    ),
    # Granite 3.x and Granite MoE: llama files (q/k permuted) with Granite's four numbers; the
    # MoE's experts ffn_{gate,up,down}_exps and router ffn_gate_inp, every layer routed
    "granite": GgufFamily(
        "granite", permute_qk=True, keys=_GGUF_GRANITE_KEYS, derive=_gguf_granite, reads=_GGUF_GRANITE_READS
    ),
    "granitemoe": GgufFamily(
        "granitemoe", permute_qk=True, keys=_GGUF_GRANITE_KEYS, derive=_gguf_granite, reads=_GGUF_GRANITE_READS
    ),
    # Granite 4.0 with Mamba-2 layers (head_count_kv 0 there; their sizes ssm.*, their biases the tensors')
    "granitehybrid": GgufFamily(
        "granitemoehybrid",
        permute_qk=True,
        keys=_GGUF_GRANITE_KEYS,
        derive=_gguf_granite,
        reads=_GGUF_GRANITE_READS,
        biases={
            "mamba_conv_bias": ("ssm_conv1d.weight", "ssm_conv1d.bias"),
            "mamba_proj_bias": ("ssm_in.weight", "ssm_in.bias"),
        },
    ),
    # Falcon-H1: attention and Mamba-2 side by side in every layer, the muP multipliers folded into
    # the weights by the converter (read as 1), the gated norm after the gate where ssm_norm is held
    "falcon-h1": GgufFamily(
        "falcon_h1",
        extra={
            "mamba_norm_before_gate": False,
            "mamba_proj_bias": False,
            "projectors_bias": False,
        },
        derive=_gguf_falcon_h1,
        reads=_GGUF_SSM_READS,
        biases={
            "mamba_conv_bias": ("ssm_conv1d.weight", "ssm_conv1d.bias"),
            "mamba_rms_norm": ("ssm_in.weight", "ssm_norm.weight"),
        },
    ),
    # Mamba-2: blocks of a Mamba-2 mixer alone (no attention: head_count 0), the conv and in_proj
    # biases the tensors'
    "mamba2": GgufFamily(
        "mamba2",
        derive=_gguf_mamba2_lm,
        reads=_GGUF_SSM_READS,
        attention=False,
        biases={
            "use_conv_bias": ("ssm_conv1d.weight", "ssm_conv1d.bias"),
            "use_bias": ("ssm_in.weight", "ssm_in.bias"),
        },
    ),
    # Nemotron-H: Mamba-2, attention (no RoPE) or relu2 MLP blocks, their kinds per layer in
    # head_count_kv and feed_forward_length (both 0: Mamba-2), q/k permuted (GraniteHybridModel's)
    "nemotron_h": GgufFamily(
        "nemotron_h",
        permute_qk=True,
        derive=_gguf_nemotron_h,
        reads=(*_GGUF_SSM_READS, "rope.scaling.finetuned", "rope.dimension_count", "attention.layer_norm_epsilon"),
        biases={
            "use_conv_bias": ("ssm_conv1d.weight", "ssm_conv1d.bias"),
            "use_bias": ("ssm_in.weight", "ssm_in.bias"),
            "mlp_bias": ("ffn_up.weight", "ffn_up.bias"),
        },
    ),
    # Nemotron 3 (Nano 30B-A3B): Nemotron-H's blocks, a width marking routed experts (sigmoid, not gated)
    "nemotron_h_moe": GgufFamily(
        "nemotron_h",
        permute_qk=True,
        derive=_gguf_nemotron_h_moe,
        reads=(
            *_GGUF_SSM_READS,
            "rope.scaling.finetuned",
            "rope.dimension_count",
            "attention.layer_norm_epsilon",
            "expert_count",
            "expert_used_count",
            "expert_feed_forward_length",
            "expert_shared_feed_forward_length",
            "expert_shared_count",
            "expert_weights_norm",
            "expert_weights_scale",
            "expert_group_count",
            "expert_group_used_count",
            "expert_gating_func",
            "moe_latent_size",
            "nextn_predict_layers",
        ),
        biases={
            "use_conv_bias": ("ssm_conv1d.weight", "ssm_conv1d.bias"),
            "use_bias": ("ssm_in.weight", "ssm_in.bias"),
            "mlp_bias": ("ffn_up_shexp.weight", "ffn_up_shexp.bias"),
        },
    ),
    # LFM2: the layer types in head_count_kv (0: a short convolution), its conv weight (D, K)
    "lfm2": GgufFamily("lfm2", keys={"conv_L_cache": "shortconv.l_cache"}, derive=_gguf_lfm2),
    # LFM2-MoE: LFM2's layers, the leading dense ones counted, then sigmoid-routed experts
    "lfm2moe": GgufFamily(
        "lfm2_moe",
        keys=dict(_GGUF_QWEN_EXPERTS, conv_L_cache="shortconv.l_cache", num_dense_layers="leading_dense_block_count"),
        derive=_gguf_lfm2moe,
        reads=("expert_gating_func",),
    ),
    # OLMo 2 (no window) and OLMo 3 (a window, the sliding layers' pattern): post-norm layers, q/k
    # norms over the whole projection, rotate-half RoPE, YaRN on the full layers
    "olmo2": GgufFamily(
        "olmo2",
        derive=_gguf_olmo2,
        reads=(
            "attention.sliding_window",
            "attention.sliding_window_pattern",
            "rope.freq_base_swa",
            "rope.scaling.type",
            _GGUF_YARN_ATTN_OLD,
            *_GGUF_YARN.values(),
        ),
    ),
    # EXAONE 4.0: the window and which layers slide (and so rotate) in the metadata, or none
    "exaone4": GgufFamily(
        "exaone4", derive=_gguf_exaone4, reads=("attention.sliding_window", "attention.sliding_window_pattern")
    ),
    # ERNIE 4.5 dense: its interleaved RoPE pairs are llama.cpp's own (no permutation), no biases
    "ernie4_5": GgufFamily("ernie4_5", derive=_gguf_ernie4_5),
    # The first OLMo: llama files (q/k permuted) without norm tensors (LayerNorms without weight or
    # bias), the LayerNorms' eps 1e-5 and clip_qkv from attention.clamp_kqv
    "olmo": GgufFamily(
        "olmo",
        permute_qk=True,
        derive=_gguf_olmo,
        keys={"clip_qkv": "attention.clamp_kqv"},
        eps=("layer_norm_eps", "attention.layer_norm_epsilon"),
    ),
    # Arcee (AFM-4.5B): llama files (q/k permuted) with a non-gated relu2 MLP (ffn_up, ffn_down) and YaRN
    "arcee": GgufFamily(
        "arcee",
        permute_qk=True,
        derive=_gguf_arcee,
        reads=("rope.scaling.type", _GGUF_YARN_ATTN_OLD, *_GGUF_YARN.values()),
    ),
    # Apertus: q/k as the checkpoint's (not permuted), q/k norms, the xIELU MLP's numbers per layer
    "apertus": GgufFamily(
        "apertus",
        derive=_gguf_apertus,
        per_layer={
            "mlp.act_fn.alpha_p": "xielu.alpha_p",
            "mlp.act_fn.alpha_n": "xielu.alpha_n",
            "mlp.act_fn.beta": "xielu.beta",
            "mlp.act_fn.eps": "xielu.eps",
        },
    ),
    # Mistral 3 (Ministral 3's text model, Mistral Small 3.x's): llama files (q/k permuted) with
    # Ministral 3's query scale and YaRN in the metadata; no window
    "mistral3": GgufFamily("ministral3", permute_qk=True, derive=_gguf_mistral3, reads=_GGUF_MISTRAL3_READS),
    # GLM-4 (0414, Z1): interleaved RoPE pairs as llama.cpp's own (not permuted) over the first
    # rope.dimension_count features, norms after both sublayers, gate and up fused in ffn_up
    "glm4": GgufFamily("glm4", derive=_gguf_glm4, reads=("rope.dimension_count",), own_names=True),
    # Command R, Command R+ (its q/k norms the tensors') and Command R7B: interleaved RoPE pairs,
    # llama.cpp's own (no permutation), LayerNorms, the logits' scale; R7B's sliding layers
    "command-r": GgufFamily(
        "cohere",
        derive=_gguf_command_r,
        reads=("logit_scale", "rope.scaling.type"),
        biases={"use_qk_norm": ("attn_q.weight", "attn_q_norm.weight")},
        eps=("layer_norm_eps", "attention.layer_norm_epsilon"),
    ),
    "cohere2": GgufFamily(
        "cohere2",
        derive=_gguf_cohere2,
        reads=(
            "logit_scale",
            "rope.scaling.type",
            "attention.sliding_window",
            "attention.sliding_window_pattern",
            "rope.freq_base_swa",
        ),
        eps=("layer_norm_eps", "attention.layer_norm_epsilon"),
    ),
    # GPT-NeoX (Pythia, GPT-NeoX-20B): LayerNorms with biases, the parallel residual, a partial
    # rotary; the converter reorders query_key_value's per-head q, k, v rows into [q; k; v]
    "gptneox": GgufFamily(
        "gpt_neox",
        derive=_gguf_gptneox,
        reads=("rope.dimension_count", "use_parallel_residual"),
        biases={"attention_bias": ("attn_qkv.weight", "attn_qkv.bias")},
        eps=("layer_norm_eps", "attention.layer_norm_epsilon"),
    ),
    # Phi-1, Phi-1.5, Phi-2: q, k, v apart (the checkpoint's), the head's bias output.bias
    "phi2": GgufFamily(
        "phi",
        derive=_gguf_phi2,
        reads=("rope.dimension_count",),
        eps=("layer_norm_eps", "attention.layer_norm_epsilon"),
    ),
    # StarCoder2: LayerNorms with biases, q, k, v apart (rotate-half rows, not permuted), the plain
    # tanh-GELU MLP, use_bias from the tensors (_gguf_starcoder2); no window (llama.cpp's full attention,
    # attention.sliding_window known and not read, as its loader reads it not at all)
    "starcoder2": GgufFamily(
        "starcoder2",
        derive=_gguf_starcoder2,
        reads=("attention.sliding_window",),
        eps=("norm_epsilon", "attention.layer_norm_epsilon"),
    ),
    # StableLM: q, k, v apart (rotate-half rows, not permuted), the per-head q/k LayerNorms and the
    # parallel residual (no ffn_norm) of StableLM 2 12B read off the tensors (_gguf_stablelm)
    "stablelm": GgufFamily(
        "stablelm",
        derive=_gguf_stablelm,
        reads=("rope.dimension_count", "use_parallel_residual"),
        biases={
            "qk_layernorm": ("attn_q.weight", "attn_q_norm.weight"),
            "ffn_norm": ("attn_q.weight", "ffn_norm.weight"),
        },
        eps=("layer_norm_eps", "attention.layer_norm_epsilon"),
    ),
    # GPT-2: learned positions (position_embd), the fused attn_qkv [q; k; v] with its bias, LayerNorms
    # with biases; its converter transposed the Conv1D weights to (out, in)
    "gpt2": GgufFamily("gpt2", derive=_gguf_gpt2, eps=("layer_norm_epsilon", "attention.layer_norm_epsilon")),
    # Hunyuan dense: rows as written, the NTK-alpha base as rope.freq_base (_gguf_hunyuan_dense)
    "hunyuan-dense": GgufFamily(
        "hunyuan_v1_dense",
        derive=_gguf_hunyuan_dense,
        reads=("rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length"),
    ),
}


# -- multimodal checkpoints: their text model (read by models/hf.py's from_pretrained) ------------
@dataclass(frozen=True)
class TextTower:
    """Where a multimodal checkpoint keeps its text model: the ``text_config``'s ``model_type``
    (``text_type``), the prefix of its weights (``text_prefix``, read as ``model.``) and of its
    untied head (``head_prefix``: ``{head_prefix}lm_head.weight``, read as ``lm_head.weight``), the
    other towers' weight prefixes and config keys (set aside by name: ``towers``, ``tower_keys``),
    and the ``text_config`` keys that transformers' multimodal class does not apply (``unapplied``:
    dropped, so that the text model computes what that class computes).  ``text_type`` may be a
    tuple of the text models the checkpoints hold.  ``outer_tie``: None, the two
    ``tie_word_embeddings`` must agree; a bool, the multimodal class ties its head by the top-level
    key alone (its default this bool), whatever the ``text_config`` says (Mistral 3's)."""

    text_type: str | tuple
    text_prefix: str = "model.language_model."
    head_prefix: str = ""
    towers: tuple = ()
    tower_keys: tuple = ()
    unapplied: tuple = ()
    outer_tie: bool | None = None


_QWEN3_5_TOWERS = ("model.visual.", "mtp.")  # the vision tower, the multi-token-prediction layers
_QWEN3_5_KEYS = ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
# Gemma 4's vision and audio towers and their embedders into the text model
_GEMMA4_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
_GEMMA4_KEYS = (
    "vision_config",
    "audio_config",
    "boi_token_id",
    "eoi_token_id",
    "image_token_id",
    "video_token_id",
    "boa_token_id",
    "eoa_token_index",
    "audio_token_id",
)
# Gemma 3 (4B and larger): SigLIP's vision tower and its projector; the checkpoints, the released
# ones and transformers' own saves alike, keep the text model under Gemma3ForCausalLM's names
# behind "language_model." (transformers renames them on load: its "llava" conversion mapping).
# Gemma3ForConditionalGeneration never caps its logits (its forward has no final_logit_softcapping
# step, Gemma3ForCausalLM's has; the releases leave it unset)
_GEMMA3_TOWERS = ("vision_tower.", "multi_modal_projector.")
_GEMMA3_KEYS = ("vision_config", "boi_token_index", "eoi_token_index", "image_token_index", "mm_tokens_per_image")
# Mistral 3 (Ministral 3, Mistral Small 3.1/3.2): Pixtral's vision tower and its projector; the
# text model (ministral3 or mistral) under the Llava names, as Gemma 3's; Mistral3Config's own
# tie_word_embeddings (default true) ties the head, the text config's is not applied
_MISTRAL3_TOWERS = ("vision_tower.", "multi_modal_projector.")
_MISTRAL3_KEYS = (
    "vision_config",
    "image_token_index",
    "projector_hidden_act",
    "vision_feature_layer",
    "multimodal_projector_bias",
    "spatial_merge_size",
)
MULTIMODAL = {
    "gemma3": TextTower(
        "gemma3_text",
        text_prefix="language_model.model.",
        head_prefix="language_model.",
        towers=_GEMMA3_TOWERS,
        tower_keys=_GEMMA3_KEYS,
        unapplied=("final_logit_softcapping",),
    ),
    "qwen3_5": TextTower("qwen3_5_text", towers=_QWEN3_5_TOWERS, tower_keys=_QWEN3_5_KEYS),
    "qwen3_5_moe": TextTower("qwen3_5_moe_text", towers=_QWEN3_5_TOWERS, tower_keys=_QWEN3_5_KEYS),
    "gemma4": TextTower("gemma4_text", towers=_GEMMA4_TOWERS, tower_keys=_GEMMA4_KEYS),
    "mistral3": TextTower(
        ("ministral3", "mistral"),
        text_prefix="language_model.model.",
        head_prefix="language_model.",
        towers=_MISTRAL3_TOWERS,
        tower_keys=_MISTRAL3_KEYS,
        outer_tie=True,
    ),
}


def text_checkpoint(config: Mapping[str, Any], tensors: Mapping) -> tuple[Mapping[str, Any], dict, dict]:
    """``(text config, tensors, set aside)`` of a checkpoint: for a multimodal one (``MULTIMODAL``)
    its ``text_config`` and its text model's tensors under ``model.*`` (``lm_head.weight`` as it
    is), the other towers' tensors set aside (``{prefix: count}``); any other checkpoint as given.
    A top-level key that is neither metadata, a tower's nor ``text_config`` is refused by name, and
    so is a ``tie_word_embeddings`` that disagrees with the text config's.  A tensor under no known
    prefix stays, so that the loader refuses it as unexpected."""
    tower = MULTIMODAL.get(config.get("model_type"))  # type: ignore[arg-type]
    if tower is None:
        return config, dict(tensors), {}
    mt = config["model_type"]
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise ValueError(f"config['text_config']: expected the text model's config (a mapping), got {_show(text)}")
    types = tower.text_type if isinstance(tower.text_type, tuple) else (tower.text_type,)
    if text.get("model_type") not in types:
        want = " or ".join(map(repr, types))
        raise ValueError(
            f"config['text_config']['model_type']: expected {want} in a {mt!r} checkpoint, "
            f"got {_show(text.get('model_type'))}"
        )
    known = set(_METADATA) | set(tower.tower_keys) | {"text_config"}
    left = [k for k in config if k not in known and not k.startswith("_")]
    if left:
        raise ValueError(
            f"config: key {left[0]!r} is not supported by npattn for model_type {mt!r} "
            f"(an option npattn does not implement; unknown keys: {left})"
        )
    outer, inner = config.get("tie_word_embeddings"), text.get("tie_word_embeddings")
    if tower.outer_tie is not None:  # the multimodal class ties by its own key alone
        if "tie_word_embeddings" in config:
            outer = _json_bool("tie_word_embeddings", outer, tower.outer_tie)
        else:
            outer = tower.outer_tie
        text = dict(text, tie_word_embeddings=outer)
        inner = outer
    if outer is not None and inner is not None and outer != inner:
        raise ValueError(
            f"config['tie_word_embeddings'] = {_show(outer)} disagrees with config['text_config']"
            f"['tie_word_embeddings'] = {_show(inner)}"
        )
    text = dict(text) if inner is not None or outer is None else dict(text, tie_word_embeddings=outer)
    for key in tower.unapplied:
        text.pop(key, None)
    out: dict = {}
    aside: dict = {}
    n, head = len(tower.text_prefix), tower.head_prefix + "lm_head.weight"
    for key, t in tensors.items():
        if key.startswith(tower.text_prefix):
            out["model." + key[n:]] = t
            continue
        if key == head:
            out["lm_head.weight"] = t
            continue
        prefix = next((p for p in tower.towers if key.startswith(p)), None)
        if prefix is None:
            out[key] = t
        else:
            aside[prefix] = aside.get(prefix, 0) + 1
    return text, out, aside


# -- the typed sub-configs: each is one module's constructor arguments, by name -------------------
class _Kwargs:
    """A frozen dataclass whose fields are a module constructor's keyword arguments."""

    def kwargs(self) -> dict:
        """The fields as keyword arguments (``Module(**sub.kwargs())``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]


@dataclass(frozen=True)
class AttentionConfig(_Kwargs):
    """``MultiHeadAttention``'s arguments for one kind of layer (full or sliding-window attention)
    of a ``CausalLM`` (``CausalLMConfig.attention_config(layer_type)``): the keyword arguments by
    their names, ``num_heads`` included; ``embed_dim`` is the model's ``hidden_size``."""

    num_heads: int
    head_dim: int
    num_kv_heads: int
    qkv_bias: bool
    out_bias: bool
    causal: bool
    dropout: float
    window: tuple | None
    softcap: float | None
    sinks: bool
    scale: float | None
    rope: bool
    rope_scaling: Mapping[str, Any]  # rope_theta, the scaling's type and keys, partial_rotary_factor
    qk_norm: bool
    qk_norm_eps: float | None
    qk_norm_unit_offset: bool
    output_gate: bool
    qk_norm_scope: str = "head"
    rope_interleaved: bool = False  # RoPE on the pairs (2i, 2i+1) instead of rotate-half (ERNIE 4.5)
    query_scale_by_position: tuple | None = None  # (beta, length): Ministral 3's scale of the queries
    qk_norm_after_rope: bool = False  # QK-norm of the rotated heads (Hunyuan), not before RoPE
    qkv_clip: float | None = None  # q, k and v clamped to [-qkv_clip, qkv_clip] before RoPE (OLMo's clip_qkv)


@dataclass(frozen=True)
class LatentConfig(_Kwargs):
    """``MultiHeadLatentAttention``'s keyword arguments (DeepSeek-V3's MLA), by their names."""

    hidden_size: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None
    attention_bias: bool
    rope_theta: float
    rope_scaling: Mapping[str, Any]
    rope_interleave: bool
    rope: bool = True
    index_topk: int | None = None  # DeepSeek-V3.2's sparse attention: the lightning indexer's choice
    index_n_heads: int | None = None
    index_head_dim: int | None = None


@dataclass(frozen=True)
class DeltaNetConfig(_Kwargs):
    """``GatedDeltaNet``'s keyword arguments (Qwen3-Next's linear attention), by their names (which
    are the Hugging Face config's)."""

    hidden_size: int
    linear_num_value_heads: int
    linear_num_key_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    hidden_act: str
    projections: str = "qkvz_ba"


@dataclass(frozen=True)
class KdaConfig(_Kwargs):
    """``KimiDeltaAttention``'s keyword arguments (Kimi Linear's linear attention), by their names
    (the Hugging Face ``KimiLinearConfig``'s)."""

    hidden_size: int
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    hidden_act: str


@dataclass(frozen=True)
class Mamba2Config(_Kwargs):
    """``Mamba2Mixer``'s keyword arguments (Granite 4.0's Mamba-2 layers: the Hugging Face
    ``GraniteMoeHybridConfig``'s ``mamba_*`` keys, ``rms_norm_eps`` and ``time_step_limit``)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    rms_norm_eps: float
    time_step_limit: tuple
    chunk_size: int
    out_proj_bias: bool | None = None  # Falcon-H1's projectors_bias (None: proj_bias)
    gated_norm: str | None = "gate_first"  # Falcon-H1: "norm_first" or None (mamba_norm_before_gate, mamba_rms_norm)
    proj_multipliers: tuple | None = None  # Falcon-H1's ssm_multipliers (z, x, B, C, dt)


@dataclass(frozen=True)
class ShortConvConfig(_Kwargs):
    """``ShortConv``'s keyword arguments (LFM2's gated short convolution), by their names (the
    Hugging Face ``Lfm2Config``'s)."""

    hidden_size: int
    conv_L_cache: int
    conv_bias: bool


@dataclass(frozen=True)
class SharedKVConfig(_Kwargs):
    """``SharedKVAttention``'s keyword arguments for one kind of layer (Gemma 4's full or sliding
    attention), by their names; whether a layer makes its keys and values or reuses another's is
    per layer (``CausalLMConfig.kv_sources``)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool
    window: tuple | None
    rope_scaling: Mapping[str, Any]
    k_eq_v: bool
    eps: float
    scale: float = 1.0


@dataclass(frozen=True)
class MoEConfig(_Kwargs):
    """``SparseMoeBlock``'s keyword arguments (the routed experts of one family), by their names:
    the router's variant and options, the experts' kind, the shared expert and the state-dict
    names (see ``SparseMoeBlock``)."""

    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int
    router: str = "softmax_topk"
    norm_topk_prob: bool = False
    router_bias: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_eps: float | None = None
    correction_bias: bool = True
    experts: str = "swiglu"
    hidden_act: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    router_name: str = "gate"
    shared_name: str = "shared_expert"
    experts_first: bool = False
    shared_bias: bool = False  # Nemotron 3's shared expert: mlp_bias
    latent_size: int | None = None  # Nemotron 3's moe_latent_size
    latent_bias: bool = False


@dataclass(frozen=True)
class CheckpointLayout:
    """How a family's checkpoint is written, as ``npattn.models.hf`` reads it.

    ``family``: the name the loader's messages give the model (its ``model_type``);
    ``per_expert``: the routed experts may come one expert at a time
    (``mlp.experts.{e}.{gate,up,down}_proj.weight``, as DeepSeek-V3's and Qwen3-Next's checkpoints
    and ``save_pretrained`` write them), fused while loading into the ``(E, 2I, H)`` and
    ``(E, H, I)`` tensors the model holds, as transformers does; ``expert_projs`` names the three
    per-expert projections (Kimi's ``w1``, ``w3``, ``w2``).  ``renames``: pairs of a part of the
    model's key and the part the checkpoint writes instead (Kimi's ``block_sparse_moe`` for
    ``mlp``, its forget gate's parameters directly under ``self_attn``); ``split_conv``: a KDA
    layer's convolution written as three tensors, q's, k's and v's channels (transformers'
    ``conversion_mapping`` for ``kimi_linear``, both directions).  ``mtp``: the prefixes of the
    multi-token-prediction layers the family's released checkpoints carry beside the model
    (DeepSeek-V3's ``num_nextn_predict_layers`` layers ``model.layers.{n}.`` after its ``n``,
    Qwen3-Next's and Qwen3.5's ``mtp.``): not part of the causal LM, their tensors are left
    unread, as transformers ignores them (``_keys_to_ignore_on_load_unexpected``).  ``fused``: pairs
    of a checkpoint's projection and the model's projections whose rows it stacks, in order
    (Phi-3's ``self_attn.qkv_proj`` for ``q_proj``, ``k_proj``, ``v_proj`` and ``mlp.gate_up_proj``
    for ``gate_proj``, ``up_proj``): split while loading (the split names are read too), written
    fused by ``save_pretrained``; the model and its ``state_dict`` keep the split names; a bias of
    the fused projection is fused alike.  ``fused_groups``: the fused rows come in that many groups,
    each holding its share of every part's rows in order (GPT-NeoX's ``query_key_value``, viewed as
    ``(heads, 3 * head_dim)``: ``[q_h, k_h, v_h]`` for each head ``h``).  ``ignored``: endings of
    names the family's checkpoints carry that are no weights, left unread as transformers does
    (``_keys_to_ignore_on_load_unexpected``: Pythia's ``attention.bias`` causal-mask and
    ``attention.masked_bias`` buffers).  ``per_row``: endings of the model's names (StableLM's
    ``self_attn.q_norm.weight``, ``(heads, head_dim)``) whose rows the checkpoint writes one tensor
    each, ``<module>.norms.{h}.weight`` (``StableLmLayerNormPerHead``'s ``nn.ModuleList`` of one
    LayerNorm a head): stacked while loading, split by ``save_pretrained``.  ``transposed``: endings of the
    checkpoint's names, under the model's (a fused tensor's name where it is fused), whose weights
    it stores transposed, ``(in, out)`` (GPT-2's ``Conv1D``: ``attn.c_attn``, ``attn.c_proj``,
    ``mlp.c_fc``, ``mlp.c_proj``): transposed while loading a checkpoint's keys (those written under
    the checkpoint's names; the model's own names, as ``state_dict()`` and a GGUF file give them,
    are ``(out, in)``) and by ``save_pretrained``.  ``base_prefix``: the checkpoint's prefix of the
    backbone's keys (transformers' ``base_model_prefix``, GPT-2's ``transformer.``), which a
    checkpoint of the bare model leaves out (GPT-2's original ``h.0.ln_1.weight``, ``wte.weight``):
    such keys are read with it."""

    family: str = ""
    per_expert: bool = False
    # a per-expert checkpoint's gate (None: no gate, Nemotron 3's), up and down names
    expert_projs: tuple = ("gate_proj", "up_proj", "down_proj")
    renames: tuple = ()  # (model name part, checkpoint name part): the checkpoint's keys say the second
    split_conv: bool = False  # KDA's self_attn.conv1d.weight kept as q_conv1d, k_conv1d, v_conv1d (thirds)
    mtp: tuple = ()  # key prefixes of the checkpoint's multi-token-prediction layers, left unread
    fused: tuple = ()  # (checkpoint part, (model parts, ...)): one checkpoint tensor, the parts' rows in order
    fused_groups: int = 1  # the fused tensors' rows in this many groups (GPT-NeoX's heads), each the parts' in order
    ignored: tuple = ()  # endings of the checkpoint's names left unread (GPT-NeoX's attention.bias mask buffers)
    per_row: tuple = ()  # endings of model names written one row a tensor, <module>.norms.{h}.weight (StableLM)
    transposed: tuple = ()  # endings of model names the checkpoint stores (in, out): GPT-2's Conv1D weights
    base_prefix: str = ""  # the backbone's checkpoint prefix, absent from a bare model's checkpoint (GPT-2's h.0...)


@dataclass(frozen=True)
class CausalLMConfig:
    """Everything that shapes a ``CausalLM``; the Hugging Face names where a key exists.

    Per layer: ``layer_types[i]`` is ``"full_attention"``, ``"sliding_attention"`` (a causal
    window of ``sliding_window`` keys, the query's own included, as Hugging Face masks),
    ``"linear_attention"`` (gated DeltaNet, Kimi's KDA or Granite 4.0's Mamba-2, as
    ``linear_attention`` holds a ``DeltaNetConfig``, a ``KdaConfig`` or a ``Mamba2Config``),
    ``"latent_attention"`` (MLA), ``"conv"`` (LFM2's gated short convolution, ``short_conv`` its
    arguments) or ``"hybrid"`` (Falcon-H1: full attention and a Mamba-2 mixer, ``linear_attention``'s
    ``Mamba2Config``, side by side on the same input, their outputs summed; ``hybrid_multipliers``
    their factors) or ``"none"`` (no attention sublayer and no norm before one: Nemotron-H's MLP
    blocks); ``mlp_types[i]`` is
    ``"dense"`` (a gated MLP: ``down(act(gate(x)) * up(x))``), ``"plain"`` (``down(act(up(x)))``,
    ``FeedForward`` under the names ``up_proj``, ``down_proj``: Nemotron-H's and Arcee's, their
    ``hidden_act`` ``"relu2"``; Apertus's, ``"xielu"``, its parameters in ``act_fn``), ``"moe"``
    (routed experts), ``"dense_and_experts"`` (Gemma 4's
    ``enable_moe_block``: both, each with its own norms, summed; ``moe`` holds the experts' sizes) or
    ``"none"`` (no MLP sublayer and no norm before one: Nemotron-H's Mamba-2 and attention blocks).

    ``rope[layer_type]`` is the Hugging Face ``rope_parameters`` dict of that kind of layer
    (``rope_theta``, ``rope_type`` and the scaling's own keys) as transformers 5 standardizes the
    config's ``rope_parameters``, ``rope_scaling`` (which, when non-empty, takes the place of
    ``rope_parameters``; Gemma 3 merges it into the full-attention layers' dict), ``rope_theta``,
    ``partial_rotary_factor`` and ``max_position_embeddings`` (``original_max_position_embeddings``
    of ``yarn`` and ``llama3`` where the dict has none; ``dynamic`` keeps it in the dict).
    ``dynamic`` NTK scaling computes each call's frequencies from that call's length, as a
    transformers model does on its first pass and for every sequence longer than any before it
    or shorter than ``max_position_embeddings``; a transformers model instance also keeps the
    frequencies of the longest sequence it has seen for later sequences between those (a cache of
    its own state, which npattn does not imitate).  ``norm_offset``: norms multiply by
    ``1 + weight`` (Gemma, Qwen3-Next); ``sandwich_norm``: norms also after attention and after the
    MLP (Gemma, GLM-4); ``pre_norm``: the norms before attention and before the MLP (False: OLMo 2/3's
    post-norm, each sublayer's output normalised before its residual sum, with ``sandwich_norm``);
    ``qk_norm_scope``: the QK-norm over each head (``"head"``) or over the whole projection
    (``"all_heads"``, OLMo 2/3), or a bias-free LayerNorm over each head with a weight row per head
    (``"each_head"``, Command R+); ``embed_scale``: embeddings times ``sqrt(hidden_size)`` cast to the
    dtype where ``True`` (Gemma), times the number where a number (Granite's ``embedding_multiplier``),
    unscaled where ``False``.  ``attention_scale`` is the scores' factor (``None``:
    ``1/sqrt(head_dim)``; Granite's ``attention_multiplier``).  ``residual_multiplier``: each
    sublayer's output (after its sandwich norm, if any) times this number before its residual sum
    (Granite).  ``logits_scaling``: the output head's logits divided by this number (Granite),
    before a final softcap.  ``moe``,
    ``latent`` and ``linear_attention`` are the typed arguments of those layers' modules
    (``MoEConfig``, ``LatentConfig``, ``DeltaNetConfig``), ``None`` where the model has no such
    layer; ``attention_config(layer_type)`` gives ``MultiHeadAttention``'s (``AttentionConfig``).
    ``layout`` says how the checkpoint is written (``CheckpointLayout``); ``hf`` is the Hugging
    Face dict itself, completed with transformers' defaults (for messages; nothing is built from it).

    Gemma 4: ``shared_kv`` holds ``SharedKVAttention``'s arguments per layer type (its layers are
    built from them instead of ``attention_config``), ``kv_sources[i]`` the layer whose keys and
    values layer ``i`` attends over (``i`` itself: it makes its own; cross-layer KV sharing);
    ``per_layer_input_size`` the per-layer input embeddings' width ``P`` (0: none) and
    ``per_layer_vocab_size`` their table's rows; ``layer_scalar``: each layer's output times its
    ``layer_scalar`` buffer; ``double_wide_mlp``: the MLPs of the reusing layers are twice as wide
    (``mlp_size``).

    ``layer_names``: pairs of a decoder layer's tensor name (a dotted prefix, as Llama's checkpoints
    name it) and the family's own (LFM2's ``operator_norm`` for ``input_layernorm``,
    ``feed_forward.w1`` for ``mlp.gate_proj``, ``self_attn.out_proj`` for ``self_attn.o_proj`` ...;
    GraniteMoe's ``block_sparse_moe`` for ``mlp``; GLM-4's ``post_self_attn_layernorm`` for the norm
    after attention, its ``post_attention_layernorm`` for the one before the MLP), and
    ``final_norm_name`` the final norm's (``model.embedding_norm``), ``embed_name`` the embedding's
    (Nemotron-H's ``model.embeddings``): the model's parameters, state dict and checkpoints all say
    the family's names (``generic_name`` undoes the layers' ones).  ``pad_embedding_row``: the
    embedding's ``pad_token_id`` row is a padding row (no gradient, as torch's ``padding_idx``);
    False where the family's embedding has none (Nemotron-H's).

    ``rope_layers[i]``: whether layer ``i`` rotates its queries and keys (``None``: every layer
    does).  SmolLM3's NoPE layers (its ``no_rope_layers``, whose 0 marks a layer without RoPE) and
    EXAONE 4.0's full layers beside sliding ones are ``False`` here: a per-layer flag beside
    ``layer_types``, not a kind of layer or a ``rope`` entry, since a NoPE layer is otherwise a
    layer of its kind (full or sliding, with that kind's window) and the layer types stay
    transformers' own.  ``attention_config(layer_type, i)`` turns it into
    ``MultiHeadAttention``'s ``rope`` flag; the module's forward, backward, JVP and cached decoding
    then skip the rotation as for any layer built with ``rope=False``.

    ``rope_interleaved``: RoPE rotates each head's features in the pairs ``(2i, 2i + 1)`` (ERNIE
    4.5's, as GLM's: ``MultiHeadAttention``'s ``rope_interleaved``) instead of the rotate-half pairs
    ``(i, i + head_dim/2)`` of Llama and the others; pair ``i`` turns by the same angle either way.

    ``query_scale_by_position``: ``(beta, length)``, each query at position ``p`` multiplied by
    ``1 + beta log(1 + floor(p / length))`` after RoPE (Ministral 3's ``llama_4_scaling_beta`` and
    its YaRN ``original_max_position_embeddings``: ``MultiHeadAttention``'s option of that name).

    ``qk_norm_after_rope``: the QK-norm normalises the rotated heads (Hunyuan's dense models),
    instead of the heads RoPE then rotates (``MultiHeadAttention``'s option of that name).

    ``qkv_clip``: q, k and v clamped to ``[-qkv_clip, qkv_clip]`` after the projections (and the
    QK-norm), before RoPE (OLMo's and OLMoE's ``clip_qkv``: ``MultiHeadAttention``'s option of
    that name); None: no clamp.

    ``hybrid_multipliers``: a ``"hybrid"`` layer's four factors (Falcon-H1's muP ones): the
    attention's input and output, the Mamba-2 mixer's input and output (``ParallelSum``'s).
    ``mlp_multipliers``: the dense MLP's factor of ``gate_proj(x)`` before the activation and of its
    output (``GatedMLP``'s ``gate_multiplier``, ``down_multiplier``; Falcon-H1's).

    ``layer_norm``: every norm (before the sublayers, the final one) is a LayerNorm without bias,
    ``(x - mean) / sqrt(var + eps) * weight`` (Cohere's ``CohereLayerNorm``; ``rms_norm_eps`` its eps)
    instead of an RMSNorm.  ``parallel_mlp``: each layer's MLP runs beside its attention on the same
    normed input, ``x + attn(norm(x)) + mlp(norm(x))`` (Cohere's parallel block: one norm a layer, the
    two sublayers a ``ParallelSum`` under their own names ``self_attn`` and ``mlp``).
    ``layer_norm_bias``: those LayerNorms have a bias too (GPT-NeoX's ``nn.LayerNorm``).
    ``layer_norm_affine`` False: those LayerNorms have neither weight nor bias,
    ``(x - mean) / sqrt(var + eps)`` (the first OLMo's ``OlmoLayerNorm``).
    ``parallel_residual``: the MLP's norm reads the layer's input instead of the attention's
    residual sum, ``x + attn(input_layernorm(x)) + mlp(post_attention_layernorm(x))`` (GPT-NeoX's
    ``use_parallel_residual``: two norms, unlike ``parallel_mlp``'s one).  ``lm_head_bias``: the
    (untied) head has a bias, ``lm_head.bias`` (Phi-1, Phi-1.5, Phi-2).

    ``position_embedding``: the name of a learned table of ``max_position_embeddings`` absolute
    positions, ``model.{position_embedding}.weight``, whose row of each token's position is added
    to its embedding (GPT-2's ``wpe``; "": none).  A token's position counts the tokens before it
    (those cached included; a padded row's from its first token), and an input reaching past the
    table's last row is refused.  ``attention_scale_by_layer``: layer ``i``'s scores' factor
    (``attention_scale``, or ``1/sqrt(head_dim)``) divided by ``i + 1`` (GPT-2's
    ``scale_attn_by_inverse_layer_idx``).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    layer_types: tuple
    mlp_types: tuple
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    rope: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    sliding_window: int | None = None
    attention_bias: bool = False
    attention_out_bias: bool | None = None  # o_proj's bias where it differs from attention_bias's (Qwen2: none)
    mlp_bias: bool = False
    qk_norm: bool = False
    norm_offset: bool = False
    sandwich_norm: bool = False
    pre_norm: bool = True
    qk_norm_scope: str = "head"
    embed_scale: bool | float = False  # True: sqrt(hidden_size) (Gemma); a number: that factor (Granite)
    attention_scale: float | None = None
    residual_multiplier: float = 1.0  # each sublayer's output times it before the residual sum (Granite)
    logits_scaling: float = 1.0  # the logits divided by it (Granite)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sinks: bool = False
    attn_output_gate: bool = False
    attention_dropout: float = 0.0
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: Any = None
    max_position_embeddings: int | None = None
    moe: MoEConfig | None = None
    latent: LatentConfig | None = None
    linear_attention: DeltaNetConfig | KdaConfig | Mamba2Config | None = None
    shared_kv: Mapping[str, SharedKVConfig] | None = None
    kv_sources: tuple | None = None
    per_layer_input_size: int = 0
    per_layer_vocab_size: int | None = None
    layer_scalar: bool = False
    double_wide_mlp: bool = False
    rope_layers: tuple | None = None  # per layer: whether it rotates q and k (SmolLM3's NoPE layers: False)
    rope_interleaved: bool = False  # RoPE rotates the pairs (2i, 2i+1) of each head (ERNIE 4.5), not (i, i + D/2)
    query_scale_by_position: tuple | None = None  # (beta, length): queries times 1 + beta log(1 + floor(p / length))
    qk_norm_after_rope: bool = False  # the QK-norm after RoPE (Hunyuan), not before
    qkv_clip: float | None = None  # q, k, v clamped to +-qkv_clip after the projections (OLMo's clip_qkv)
    short_conv: ShortConvConfig | None = None  # the "conv" layers' arguments (LFM2)
    hybrid_multipliers: tuple = (1.0, 1.0, 1.0, 1.0)  # "hybrid" layers: attention in, out, Mamba-2 in, out
    mlp_multipliers: tuple = (1.0, 1.0)  # the dense MLP's gate and down factors (Falcon-H1)
    layer_names: tuple = ()  # (a layer's tensor name, the family's): LFM2's operator_norm for input_layernorm ...
    final_norm_name: str = "norm"  # model.{final_norm_name}: LFM2's embedding_norm
    embed_name: str = "embed_tokens"  # model.{embed_name}: Nemotron-H's embeddings
    pad_embedding_row: bool = True  # the embedding's pad_token_id row gets no gradient (torch's padding_idx)
    layer_norm: bool = False  # the norms are LayerNorm (mean subtracted) with a weight and no bias (Cohere)
    layer_norm_bias: bool = False  # with layer_norm: each LayerNorm has a bias too (GPT-NeoX)
    layer_norm_affine: bool = True  # with layer_norm: False, no weight and no bias (OLMo's OlmoLayerNorm)
    parallel_mlp: bool = False  # the MLP beside the attention on the same normed input, both summed (Cohere)
    parallel_residual: bool = False  # x + attn(norm1(x)) + mlp(norm2(x)): the MLP's norm reads the layer's input
    lm_head_bias: bool = False  # the untied head has a bias (Phi-1/1.5/2)
    position_embedding: str = ""  # model.{name}: a learned table of absolute positions added to the embeddings (GPT-2)
    attention_scale_by_layer: bool = False  # layer i's scores' factor divided by i + 1 (GPT-2's option)
    layout: CheckpointLayout = field(default_factory=CheckpointLayout)
    hf: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def reuses_kv(self, i: int) -> bool:
        """Whether layer ``i`` attends over another layer's keys and values (``kv_sources``)."""
        return self.kv_sources is not None and self.kv_sources[i] != i

    def mlp_size(self, i: int) -> int:
        """The intermediate size of layer ``i``'s dense MLP (twice ``intermediate_size`` on a
        reusing layer with ``double_wide_mlp``)."""
        return self.intermediate_size * (2 if self.double_wide_mlp and self.reuses_kv(i) else 1)

    def generic_name(self, key: str) -> str:
        """A model tensor name under the layer names Llama's checkpoints use (``layer_names``
        undone: LFM2's ``model.layers.0.feed_forward.w1.weight`` is ``model.layers.0.mlp.gate_proj.weight``),
        as converters that know the generic names look tensors up."""
        head, sep, rest = key.partition(".layers.")
        if not sep or "." not in rest:
            return key
        index, _, name = rest.partition(".")
        for generic, own in self.layer_names:
            if name == own or name.startswith(own + "."):
                return f"{head}.layers.{index}.{generic}{name[len(own) :]}"
        return key

    def replace(self, **changes) -> CausalLMConfig:
        """A copy with ``changes`` (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def attention_config(self, layer_type: str, layer: int | None = None) -> AttentionConfig:
        """``MultiHeadAttention``'s arguments for the layers of kind ``layer_type``
        (``"full_attention"`` or ``"sliding_attention"``): the RoPE parameters of that kind (or
        the model's one ``"default"``), a causal window of ``sliding_window`` keys on sliding
        layers; for layer ``layer`` (its index), whether it rotates at all (``rope_layers``;
        ``layer`` None: a layer of that kind that rotates) and, with ``attention_scale_by_layer``,
        its scores' factor divided by ``layer + 1``."""
        rope = dict(self.rope.get(layer_type, self.rope.get("default", {})))
        scale = self.attention_scale
        if self.attention_scale_by_layer and layer is not None:  # GPT-2's scale_attn_by_inverse_layer_idx
            scale = (self.head_dim**-0.5 if scale is None else scale) / (layer + 1)
        rotates = layer is None or self.rope_layers is None or bool(self.rope_layers[layer])
        sliding = layer_type == "sliding_attention" and self.sliding_window
        return AttentionConfig(
            num_heads=self.num_attention_heads,
            head_dim=self.head_dim,
            num_kv_heads=self.num_key_value_heads,
            qkv_bias=self.attention_bias,
            out_bias=self.attention_bias if self.attention_out_bias is None else self.attention_out_bias,
            causal=True,
            dropout=self.attention_dropout,
            window=(self.sliding_window - 1, 0) if sliding else None,  # type: ignore[operator]
            softcap=self.attn_logit_softcapping,
            sinks=self.sinks,
            scale=scale,
            rope=rotates,
            rope_scaling=rope,
            qk_norm=self.qk_norm,
            qk_norm_eps=self.rms_norm_eps if self.qk_norm else None,
            qk_norm_unit_offset=self.qk_norm and self.norm_offset,
            output_gate=self.attn_output_gate,
            qk_norm_scope=self.qk_norm_scope,
            rope_interleaved=self.rope_interleaved,
            query_scale_by_position=self.query_scale_by_position,
            qk_norm_after_rope=self.qk_norm and self.qk_norm_after_rope,
            qkv_clip=self.qkv_clip,
        )

    def describe(self) -> str:
        """The one line ``repr(CausalLM)`` shows: family, layers, width and vocabulary."""
        return (
            f"model_type={self.model_type!r}, layers={self.num_hidden_layers}, hidden={self.hidden_size}, "
            f"vocab={self.vocab_size}"
        )


# Keys of every PretrainedConfig (and of older ones on the Hub) that change nothing in the forward
# pass of a causal LM in inference or training (generation defaults, labels, bookkeeping).
_METADATA = frozenset(
    {
        "architectures",
        "transformers_version",
        "model_type",
        "dtype",
        "torch_dtype",
        "id2label",
        "label2id",
        "problem_type",
        "return_dict",
        "output_hidden_states",
        "output_attentions",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "initializer_range",
        "use_cache",
        "output_router_logits",
        "router_aux_loss_coef",
        "tokenizer_class",
        "task_specific_params",
        "finetuning_task",
        "prefix",
        "sep_token_id",
        "decoder_start_token_id",
        "cache_implementation",
        "auto_map",
        "num_nextn_predict_layers",  # DeepSeek-V3's multi-token-prediction layers: not part of the causal LM
        "pretraining_tp",  # the forward pass is the same whatever it says (transformers ignores it)
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "max_position_embeddings",
        "tie_word_embeddings",
    }
)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


def _show(v) -> str:
    """``repr(v)`` shortened (a config value in a message: never a huge or deeply nested one whole)."""
    return _REPR.repr(v)


def _json_bool(key: str, v, default: bool, show=_show) -> bool:
    """``config[key]``'s value ``v`` as a flag: a JSON boolean only; null is false where the default
    is (transformers tests the value's truth), refused where the default is true."""
    if v is None and not default:
        return False
    if not isinstance(v, bool):
        raise ValueError(f"config[{key!r}]: expected true or false (a JSON boolean), got {show(v)}")
    return v


class _Reader:
    """Reads keys of a config dict, remembering which were read; ``finish`` refuses the rest."""

    def __init__(self, d: Mapping[str, Any], model_type: str):
        self.d = d
        self.model_type = model_type
        self.used: set = set()

    def has(self, key: str) -> bool:
        return key in self.d and self.d[key] is not None

    def get(self, key: str, default=None):
        self.used.add(key)
        v = self.d.get(key, default)
        return default if v is None else v

    def int(self, key: str, default=None, *, minimum: int = 1):
        if default is None and not self.has(key):
            raise ValueError(f"config: model_type {self.model_type!r} needs the key {key!r}, which is missing")
        v = self.get(key, default)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < minimum:
            raise ValueError(f"config[{key!r}]: expected an integer >= {minimum}, got {_show(v)}")
        return int(v)

    def float(self, key: str, default=None, *, positive: bool = True):
        v = self.get(key, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or (positive and v <= 0):
            raise ValueError(f"config[{key!r}]: expected a finite number{' > 0' if positive else ''}, got {_show(v)}")
        return float(v)

    def bool(self, key: str, default: bool = False) -> bool:
        """A JSON boolean only: ``"false"``, ``0`` or ``1`` are refused (a non-empty string would
        read as True).  ``null`` reads as false where false is the default (transformers tests
        the value's truth); where the default is true it is refused (null would be false there)."""
        self.used.add(key)
        return _json_bool(key, self.d.get(key, default), default)

    def only(self, key: str, allowed: tuple, default=None, why: str = ""):
        """The value of ``key``, which must be one of ``allowed`` (npattn lacks the others)."""
        v = self.get(key, default)
        # equal and both booleans or both not (0 is not false, 1 is not true)
        if not any(v == a and isinstance(v, bool) == isinstance(a, bool) for a in allowed):
            raise ValueError(
                f"config[{key!r}] = {_show(v)} is not supported by npattn for model_type {self.model_type!r} "
                f"(supported: {list(allowed)}){': ' + why if why else ''}"
            )
        return v

    def finish(self) -> None:
        left = [k for k in self.d if k not in self.used and k not in _METADATA and not k.startswith("_")]
        if left:
            raise ValueError(
                f"config: key {left[0]!r} is not supported by npattn for model_type {self.model_type!r} "
                f"(an option npattn does not implement; unknown keys: {left})"
            )


def _act(r: _Reader, key: str, default: str) -> str:
    """The Hugging Face activation name (one of ``npattn.nn.moe.HIDDEN_ACTS``)."""
    from ..nn.moe import HIDDEN_ACTS

    v = r.get(key, default)
    if v not in HIDDEN_ACTS:
        raise ValueError(f"config[{key!r}] = {_show(v)} is not supported by npattn (supported: {sorted(HIDDEN_ACTS)})")
    return v


def _mlp_and_bias(r: _Reader, act_key: str = "hidden_act", act_default: str = "silu") -> dict:
    """The dense MLP's ``intermediate_size`` and activation (``act_key``, ``act_default``) and the
    attention projections' ``attention_bias``, as most families' readers read them."""
    return dict(
        intermediate_size=r.int("intermediate_size"),
        hidden_act=_act(r, act_key, act_default),
        attention_bias=r.bool("attention_bias"),
    )


def _rope_mapping(r: _Reader, key: str):
    v = r.get(key)
    if v is not None and not isinstance(v, Mapping):
        raise ValueError(f"config[{key!r}]: expected a mapping (a RoPE parameters dict) or null, got {_show(v)}")
    return v


def _max_positions(r: _Reader):
    """``max_position_embeddings`` (transformers' class default where the dict has none), checked,
    or None when absent."""
    return r.int("max_position_embeddings") if r.has("max_position_embeddings") else None


def _whole_heads(r: _Reader, params: Mapping, where: str) -> None:
    """Refuse a ``partial_rotary_factor`` other than 1 in the RoPE dict ``params`` of a family
    whose transformers attention rotates whole heads (every family but those that pass
    ``partial=True``: Qwen3-Next's and Qwen3.5's rotate the first features only): its default
    RoPE ignores the factor, so npattn's partial rotation would give other logits, and the other
    types' tables, which honour it, do not fit the heads there."""
    f = params.get("partial_rotary_factor")
    if f is not None and f != 1.0:
        raise ValueError(
            f"config: partial_rotary_factor = {_show(f)} (beside or in {where}) is not supported by npattn for "
            f"model_type {r.model_type!r}: its attention in transformers rotates whole heads (the default RoPE ignores "
            "the factor; the other rope types' tables, which honour it, do not fit the heads)"
        )


def _rope_params(
    r: _Reader,
    default_theta: float,
    default: Mapping | None = None,
    *,
    partial: bool = False,
    aside: tuple = (),
    retype: str | None = None,
) -> dict:
    """``{"default": rope parameters}`` as transformers 5 reads the config
    (``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict``, then ``standardize_rope_params``):
    a non-empty ``rope_scaling`` (the older key) takes the place of ``rope_parameters`` altogether
    (its ``rope_theta`` included); ``rope_parameters`` left out is the family's ``default``; then
    ``rope_theta`` and ``partial_rotary_factor`` beside the dict fill what it lacks, and
    ``max_position_embeddings`` gives ``yarn``/``llama3`` their ``original_max_position_embeddings``
    (and ``dynamic`` its length).  ``partial``: the family rotates the first
    ``partial_rotary_factor`` of each head (else a factor other than 1 is refused: ``_whole_heads``).
    ``aside``: keys of the chosen dict that are not RoPE's, left out of it (the family reads them:
    ``_rope_extra``); ``retype``: the ``rope_type`` the family's model computes in place of the
    dict's (Hunyuan's ``"dynamic"`` with an ``alpha`` is ``"ntk_alpha"``)."""
    rp = _rope_mapping(r, "rope_parameters")
    scaling = _rope_mapping(r, "rope_scaling")
    theta = r.get("rope_theta")
    key = "rope_scaling" if scaling else "rope_parameters"
    chosen = scaling or (default if rp is None else rp) or {}
    chosen = {k: v for k, v in chosen.items() if k not in aside}
    if retype is not None:
        chosen = {k: v for k, v in chosen.items() if k not in ("rope_type", "type")} | {"rope_type": retype}
    params = _standardize(
        chosen,
        f"config[{key!r}]",
        rope_theta=default_theta if theta is None else theta,
        partial_rotary_factor=r.get("partial_rotary_factor"),
        max_position_embeddings=_max_positions(r),
    )
    if not partial:
        _whole_heads(r, params, key)
    return {"default": params}


_GEMMA_TYPES = ("full_attention", "sliding_attention")


def _gemma_rope_params(r: _Reader) -> dict:
    """``{"full_attention": ..., "sliding_attention": ...}`` as transformers 5's Gemma 3 config
    reads them (``Gemma3TextConfig.convert_rope_params_to_dict``): ``rope_parameters`` holds one
    dict per layer type; ``rope_scaling`` (the older key) is merged into the full-attention layers'
    dict; a base left out is ``rope_theta`` (global, default 1e6) or ``rope_local_base_freq``
    (sliding, default 1e4)."""
    theta, local = r.get("rope_theta"), r.get("rope_local_base_freq")
    bases = {
        "full_attention": 1_000_000.0 if theta is None else theta,
        "sliding_attention": 10_000.0 if local is None else local,
    }
    return _typed_rope_params(r, bases, "Gemma 3")


def _typed_rope_params(r: _Reader, bases: dict, family: str) -> dict:
    """``{"full_attention": ..., "sliding_attention": ...}``, one RoPE dict per layer type, as the
    configs of Gemma 3 and OLMo 3 read them: ``rope_parameters`` holds one dict per layer type;
    ``rope_scaling`` (the older key) is merged into the full-attention layers' dict; a base left
    out is ``bases[layer_type]``."""
    rp = _rope_mapping(r, "rope_parameters")
    scaling = _rope_mapping(r, "rope_scaling")
    out: dict = {}
    for t, v in (rp or {}).items():
        if t not in _GEMMA_TYPES:
            raise ValueError(
                f"config['rope_parameters'][{t!r}]: {family}'s rope_parameters holds one dict per layer type "
                f"({list(_GEMMA_TYPES)}); transformers ignores any other key"
            )
        if v is not None and not isinstance(v, Mapping):
            raise ValueError(f"config['rope_parameters'][{t!r}]: expected a mapping or null, got {_show(v)}")
        if v is not None:
            out[t] = dict(v)
    for t in _GEMMA_TYPES:
        out.setdefault(t, {"rope_type": "default"})
    if scaling is not None:
        full = out["full_attention"]
        if "type" in scaling and "rope_type" not in scaling and full.get("rope_type") is not None:
            raise ValueError(
                f"config['rope_scaling']['type'] = {_show(scaling['type'])}: transformers merges rope_scaling into "
                f"the full-attention layers' rope parameters, whose rope_type {full.get('rope_type')!r} it keeps, "
                "so it never applies this 'type'; write 'rope_type' instead"
            )
        full.update(scaling)
    mp = _max_positions(r)
    prf = r.get("partial_rotary_factor")
    params = {
        t: _standardize(
            out[t],
            f"config['rope_parameters'][{t!r}]",
            rope_theta=bases[t],
            partial_rotary_factor=prf,
            max_position_embeddings=mp,
        )
        for t in _GEMMA_TYPES
    }
    for t, p in params.items():
        _whole_heads(r, p, f"rope_parameters[{t!r}]")
    return params


def _common(r: _Reader) -> dict:
    heads = r.int("num_attention_heads")
    hidden = r.int("hidden_size")
    kv = r.int("num_key_value_heads", heads)
    if heads % kv:
        raise ValueError(f"config['num_key_value_heads']: expected a divisor of num_attention_heads={heads}, got {kv}")
    head_dim = r.int("head_dim", hidden // heads)
    n_layers = r.int("num_hidden_layers")
    dropout = r.float("attention_dropout", 0.0, positive=False)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"config['attention_dropout']: expected a probability in [0, 1), got {dropout}")
    pad = r.d.get("pad_token_id")
    vocab = r.int("vocab_size")
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, numbers.Integral)):
        raise ValueError(f"config['pad_token_id']: expected an integer or null, got {_show(pad)}")
    if pad is not None and not 0 <= int(pad) < vocab:
        pad = None  # a pad id outside the table (some configs say -1) marks no embedding row
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=r.float("rms_norm_eps", 1e-6),
        attention_dropout=dropout,
        tie_word_embeddings=r.bool("tie_word_embeddings"),
        pad_token_id=pad,
        bos_token_id=r.d.get("bos_token_id"),
        eos_token_id=r.d.get("eos_token_id"),
        max_position_embeddings=r.d.get("max_position_embeddings"),
        layout=CheckpointLayout(r.model_type),
    )


def _no_attention_dropout(c: dict, family: str, why: str = "") -> None:
    """Refuse an ``attention_dropout`` other than 0 (read by ``_common`` into ``c``) for a family
    whose transformers attention never drops its weights."""
    if c["attention_dropout"]:
        raise ValueError(
            f"config['attention_dropout'] = {c['attention_dropout']} is not supported by npattn for {family}"
            + (f": {why}" if why else "")
        )


def _layer_types(r: _Reader, n: int, allowed: tuple, default: list) -> tuple:
    lt = r.get("layer_types") or default
    if len(lt) != n:
        raise ValueError(f"config['layer_types']: expected {n} entries (num_hidden_layers), got {len(lt)}")
    for t in lt:
        if t not in allowed:
            raise ValueError(
                f"config['layer_types']: {t!r} is not supported by npattn for model_type {r.model_type!r} "
                f"(supported: {list(allowed)})"
            )
    return tuple(lt)


def _interleaved(n: int, interval: int, other: str) -> list:
    """Every ``interval``-th layer (the last of each run) ``"full_attention"``, the others ``other``:
    the default layer pattern of Gemma 3, GPT-OSS and Qwen3-Next."""
    return [other if (i + 1) % interval else "full_attention" for i in range(n)]


def _window(r: _Reader, layer_types: tuple):
    if "sliding_attention" not in layer_types:
        r.get("sliding_window")
        return None
    return r.int("sliding_window")


def _dense_layers(r: _Reader, layer_types) -> dict:
    """The fields of layers of ``layer_types`` (full or sliding attention) each with a dense MLP:
    the kinds, the window (read where a layer slides), the MLPs."""
    lt = tuple(layer_types)
    return dict(layer_types=lt, sliding_window=_window(r, lt), mlp_types=("dense",) * len(lt))


def _llama(r: _Reader) -> dict:
    c = _common(r)
    n = c["num_hidden_layers"]
    c.update(
        _mlp_and_bias(r),
        mlp_bias=r.bool("mlp_bias"),
        rope=_rope_params(r, 10000.0),
        layer_types=("full_attention",) * n,
        mlp_types=("dense",) * n,
    )
    return c


def _olmo(r: _Reader) -> dict:
    """The first OLMo (allenai/OLMo-1B-hf, OLMo-7B-hf, OLMo-7B-0424-hf; ``OlmoForCausalLM``): Llama's
    pre-norm layers (SwiGLU MLP without biases, RoPE, ``attention_bias`` on q, k, v and o) whose
    norms are LayerNorms without weight or bias (``OlmoLayerNorm``: eps 1e-5 fixed, no config key),
    so no norm tensor in the checkpoint.  ``clip_qkv`` (OLMo-7B-0424's 8.0; null: none): q, k and v
    clamped to +-clip_qkv after the projections, before RoPE (``qkv_clip``); a number > 0."""
    c = _common(r)
    n = c["num_hidden_layers"]
    r.used.discard("rms_norm_eps")  # OlmoLayerNorm's eps is 1e-5, read from no key
    c.update(
        _mlp_and_bias(r),
        qkv_clip=r.float("clip_qkv"),
        rms_norm_eps=1e-5,
        layer_norm=True,
        layer_norm_affine=False,
        rope=_rope_params(r, 10000.0),
        layer_types=("full_attention",) * n,
        mlp_types=("dense",) * n,
    )
    return c


def _arcee(r: _Reader) -> dict:
    """Arcee (arcee-ai/AFM-4.5B, ``ArceeForCausalLM``): Llama's layers with a non-gated MLP,
    ``down_proj(act(up_proj(x)))`` (``ArceeMLP``; MLP kind ``"plain"``, its activation
    ``hidden_act``, ``relu2`` by default), under Llama's names (``mlp.up_proj``, ``mlp.down_proj``;
    no ``gate_proj``).  Its keys are Llama's: ``attention_bias``, ``mlp_bias``, ``head_dim``, RoPE
    (AFM-4.5B's YaRN) as ``_rope_params`` reads it."""
    c = _llama(r)
    c.update(hidden_act=_act(r, "hidden_act", "relu2"), mlp_types=("plain",) * c["num_hidden_layers"])
    return c


# ApertusConfig's rope_parameters when the config has none (Llama 3's scaling at base 12e6)
_APERTUS_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 12000000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 8192,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
}
# Apertus's norms under their own names
_APERTUS_NAMES = (("input_layernorm", "attention_layernorm"), ("post_attention_layernorm", "feedforward_layernorm"))


def _apertus(r: _Reader) -> dict:
    """Apertus (swiss-ai/Apertus-8B and 70B, ``ApertusForCausalLM``): Llama's attention with
    per-head q/k RMSNorms before RoPE (``q_norm``, ``k_norm``, ``rms_norm_eps``) and
    ``attention_bias`` on q, k, v and o, a non-gated MLP ``down_proj(act(up_proj(x)))`` without
    biases (MLP kind ``"plain"``), its activation ``hidden_act``, ``xielu`` by default (xIELU's
    ``act_fn.alpha_p``/``alpha_n`` parameters and ``beta``/``eps`` buffers in each layer's MLP), the
    norms named ``attention_layernorm`` and ``feedforward_layernorm``.  RoPE: ``_rope_params`` with
    ApertusConfig's default (``rope_type`` llama3, factor 8 over 8192 positions, base 12e6).  Keys
    ApertusConfig does not have but the released config.json writes, which transformers' model
    ignores, are read as what it computes: ``mlp_bias`` and ``post_norm`` must be false,
    ``qk_norm`` true; ``hidden_dropout`` is metadata (no dropout in ApertusModel)."""
    c = _common(r)
    n = c["num_hidden_layers"]
    r.only("mlp_bias", (False,), False, "ApertusMLP's projections have no bias whatever the config says")
    r.only("post_norm", (False,), False, "ApertusDecoderLayer normalises before each sublayer")
    r.only("qk_norm", (True,), True, "ApertusAttention always normalises q and k")
    r.get("hidden_dropout")
    c.update(
        intermediate_size=r.int("intermediate_size"),
        hidden_act=_act(r, "hidden_act", "xielu"),
        attention_bias=r.bool("attention_bias"),
        mlp_bias=False,
        qk_norm=True,
        rope=_rope_params(r, 12000000.0, _APERTUS_ROPE),
        layer_types=("full_attention",) * n,
        mlp_types=("plain",) * n,
        layer_names=_APERTUS_NAMES,
    )
    return c


# GPT-NeoX's names: attention.* (its fused query_key_value, dense), the plain MLP's dense_h_to_4h and
# dense_4h_to_h; gpt_neox.* and embed_out in its checkpoints (transformers' in-memory model.* and
# lm_head are read too)
_GPT_NEOX_NAMES = (
    ("self_attn.o_proj", "attention.dense"),
    ("self_attn", "attention"),
    ("mlp.up_proj", "mlp.dense_h_to_4h"),
    ("mlp.down_proj", "mlp.dense_4h_to_h"),
)
_GPT_NEOX_FUSED = (("attention.query_key_value", ("attention.q_proj", "attention.k_proj", "attention.v_proj")),)
_GPT_NEOX_RENAMES = (("model.", "gpt_neox."), ("lm_head.", "embed_out."))


def _gpt_neox(r: _Reader) -> dict:
    """EleutherAI's GPT-NeoX (Pythia 70M to 12B, GPT-NeoX-20B; ``GPTNeoXForCausalLM``): LayerNorms
    with a bias (``layer_norm_eps``); with ``use_parallel_residual`` (the default) each layer is
    ``x + attention(input_layernorm(x)) + mlp(post_attention_layernorm(x))``, else the sequential
    pre-norm block; full attention over heads of ``hidden_size // num_attention_heads`` with
    ``attention_bias`` on ``query_key_value`` and ``dense``; RoPE on rotate-half pairs of the first
    ``partial_rotary_factor`` of each head (``rotary_pct``, default 0.25, and ``rotary_emb_base``,
    default 10000, fill what ``rope_parameters`` / ``rope_scaling`` lack, as
    ``GPTNeoXConfig.convert_rope_params_to_dict`` does); the plain MLP
    ``dense_4h_to_h(act(dense_h_to_4h(x)))`` with biases (``hidden_act``, exact ``gelu`` by
    default); an untied head ``embed_out`` (``tie_word_embeddings`` ties it to ``embed_in``); the
    embedding has no padding row.  The checkpoint's ``query_key_value`` holds each head's q, k and v
    rows in turn (``CheckpointLayout.fused_groups``).  Top-level ``rope_theta`` and
    ``partial_rotary_factor`` (which ``GPTNeoXConfig`` ignores), ``num_key_value_heads`` and
    ``head_dim`` other than ``hidden_size // num_attention_heads`` (GPTNeoXAttention ignores them)
    and a ``hidden_dropout`` other than 0 are refused by name; ``classifier_dropout`` (the
    classification heads'), ``is_decoder`` and GPT-NeoX-20B's ``attention_probs_dropout_prob`` and
    ``hidden_dropout_prob`` (which no transformers module reads) are metadata.  GPT-NeoX-20B's
    ``gelu_fast`` is ``gelu_new``'s formula with ``sqrt(2 / pi)`` rounded to 0.7978845608 (a
    relative difference of 4e-12 in that constant)."""
    heads, hidden = r.int("num_attention_heads"), r.int("hidden_size")
    if hidden % heads:
        raise ValueError(f"config['num_attention_heads']: expected a divisor of hidden_size = {hidden}, got {heads}")
    why = "GPTNeoXConfig ignores it"
    r.only("rope_theta", (None,), None, why + " (its base is rotary_emb_base or rope_parameters' rope_theta)")
    r.only("partial_rotary_factor", (None,), None, why + " (its factor is rotary_pct or rope_parameters')")
    r.only("num_key_value_heads", (None, heads), None, "GPTNeoXAttention has as many key/value heads as heads")
    r.only("head_dim", (None, hidden // heads), None, "GPTNeoXAttention's heads are hidden_size // num_attention_heads")
    r.only("hidden_dropout", (0, 0.0), 0.0, "npattn has no dropout on the residual branches")
    r.get("classifier_dropout")
    r.get("is_decoder")
    # GPT-NeoX-20B's config.json: keys of its training code that no transformers module reads
    r.get("attention_probs_dropout_prob")
    r.get("hidden_dropout_prob")
    c = _common(r)
    r.used.discard("rms_norm_eps")  # GPT-NeoX's eps is layer_norm_eps; rms_norm_eps is no key of it
    rp = _rope_mapping(r, "rope_parameters")
    scaling = _rope_mapping(r, "rope_scaling")
    key = "rope_scaling" if scaling else "rope_parameters"
    chosen = dict(scaling or rp or {})
    base, pct = r.float("rotary_emb_base", 10000.0), r.float("rotary_pct", 0.25)
    rope = _standardize(
        chosen,
        f"config[{key!r}]",
        rope_theta=base,
        partial_rotary_factor=pct,
        max_position_embeddings=_max_positions(r),
    )
    n = c["num_hidden_layers"]
    c.update(
        intermediate_size=r.int("intermediate_size"),
        hidden_act=_act(r, "hidden_act", "gelu"),
        attention_bias=r.bool("attention_bias", True),
        mlp_bias=True,  # GPTNeoXMLP's nn.Linear layers
        rms_norm_eps=r.float("layer_norm_eps", 1e-5),
        layer_norm=True,
        layer_norm_bias=True,
        parallel_residual=r.bool("use_parallel_residual", True),
        rope={"default": rope},
        layer_types=("full_attention",) * n,
        mlp_types=("plain",) * n,
        pad_embedding_row=False,  # GPTNeoXModel's embed_in has no padding_idx
        layer_names=_GPT_NEOX_NAMES,
        final_norm_name="final_layer_norm",
        embed_name="embed_in",
        layout=CheckpointLayout(
            r.model_type,
            renames=_GPT_NEOX_RENAMES,
            fused=_GPT_NEOX_FUSED,
            fused_groups=heads,
            ignored=(".attention.bias", ".attention.masked_bias"),  # GPTNeoXPreTrainedModel's
        ),
    )
    return c


# Phi's names: self_attn.dense for o_proj, the plain MLP's fc1 and fc2, model.final_layernorm
_PHI_NAMES = (("self_attn.o_proj", "self_attn.dense"), ("mlp.up_proj", "mlp.fc1"), ("mlp.down_proj", "mlp.fc2"))


def _phi(r: _Reader) -> dict:
    """Microsoft's Phi-1, Phi-1.5 and Phi-2 (``PhiForCausalLM``): one LayerNorm with a bias a
    layer (``layer_norm_eps``) whose output both the attention and the MLP read, both added to the
    residual (``parallel_mlp``); q, k, v and ``dense`` with biases, grouped key/value heads
    (``num_key_value_heads``), RoPE on rotate-half pairs of the first ``partial_rotary_factor``
    (default 0.5, as ``PhiConfig.__post_init__`` sets it) of each head; the plain MLP
    ``fc2(act(fc1(x)))`` with biases (``hidden_act``, ``gelu_new`` by default); the head has a bias
    (``lm_head.bias``); the final norm ``model.final_layernorm``.  ``qk_layernorm`` (a LayerNorm of
    each head's q and k, one weight and bias over the heads) is refused unless false, as a tied head
    (its bias beside the embedding's table is not implemented).  ``resid_pdrop`` and
    ``embd_pdrop`` (dropout while training: Phi-2's 0.1) are read as probabilities and not applied:
    npattn has no dropout on the residual branches or the embedding, so its training is
    transformers' without them; at evaluation both are the identity."""
    if not r.has("partial_rotary_factor"):  # PhiConfig.__post_init__: kwargs.setdefault(..., 0.5)
        r.d = {**r.d, "partial_rotary_factor": 0.5}
    c = _common(r)
    r.used.discard("rms_norm_eps")  # Phi's eps is layer_norm_eps; rms_norm_eps is no key of it
    for key in ("resid_pdrop", "embd_pdrop"):
        p = r.float(key, 0.0, positive=False)
        if not 0.0 <= p < 1.0:
            raise ValueError(f"config[{key!r}]: expected a probability in [0, 1), got {p}")
    r.only("qk_layernorm", (False,), False, "a LayerNorm of q and k with a bias shared over the heads")
    r.only("tie_word_embeddings", (False,), False, "PhiForCausalLM's head has a bias beside the tied table")
    n = c["num_hidden_layers"]
    c.update(
        intermediate_size=r.int("intermediate_size"),
        hidden_act=_act(r, "hidden_act", "gelu_new"),
        attention_bias=True,  # PhiAttention's q_proj, k_proj, v_proj, dense
        mlp_bias=True,  # PhiMLP's fc1, fc2
        lm_head_bias=True,
        tie_word_embeddings=False,
        rms_norm_eps=r.float("layer_norm_eps", 1e-5),
        layer_norm=True,
        layer_norm_bias=True,
        parallel_mlp=True,
        rope=_rope_params(r, 10000.0, partial=True),
        layer_types=("full_attention",) * n,
        mlp_types=("plain",) * n,
        layer_names=_PHI_NAMES,
        final_norm_name="final_layernorm",
    )
    return c


# GPT-2's names: ln_1, attn (its c_proj for o_proj), ln_2, mlp.c_fc and mlp.c_proj, wte, wpe, ln_f;
# transformer.h.{i} in its checkpoints, whose Conv1D weights are stored (in, out)
_GPT2_NAMES = (
    ("input_layernorm", "ln_1"),
    ("post_attention_layernorm", "ln_2"),
    ("self_attn.o_proj", "attn.c_proj"),
    ("self_attn", "attn"),
    ("mlp.up_proj", "mlp.c_fc"),
    ("mlp.down_proj", "mlp.c_proj"),
)
_GPT2_FUSED = (("attn.c_attn", ("attn.q_proj", "attn.k_proj", "attn.v_proj")),)
_GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_GPT2_RENAMES = (("model.layers.", "transformer.h."), ("model.", "transformer."))


def _gpt2(r: _Reader) -> dict:
    """OpenAI's GPT-2 (``GPT2LMHeadModel``; the model of *Build a Large Language Model (From
    Scratch)*, ``npattn.book.GPTModel``): learned absolute positions ``wpe`` (``n_positions``
    rows) added to the token embeddings ``wte``, no RoPE; pre-LayerNorm blocks with biases
    (``ln_1``, ``ln_2``, ``ln_f``; ``layer_norm_epsilon``); the fused ``attn.c_attn`` (q, k, v in
    turn, with a bias) and ``attn.c_proj``, the plain MLP ``mlp.c_proj(act(mlp.c_fc(x)))`` with
    biases, ``n_inner`` wide (``4 n_embd`` where null; ``activation_function``, ``gelu_new``, the
    tanh GELU, by default); transformers' ``Conv1D`` stores these four weights ``(in, out)``
    (``CheckpointLayout.transposed``); the head is tied to ``wte`` by default; the embedding has
    no padding row.  ``n_embd``, ``n_layer``, ``n_head`` and ``n_positions`` are read as
    ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads`` and
    ``max_position_embeddings`` (``GPT2Config.attribute_map``; either name, not two values).
    ``scale_attn_weights`` false: scores not divided by ``sqrt(head_dim)``;
    ``scale_attn_by_inverse_layer_idx``: layer ``i``'s scores also divided by ``i + 1``
    (``attention_scale_by_layer``); ``reorder_and_upcast_attn`` (transformers' eager attention in
    float32 under mixed precision) computes the same scores in exact arithmetic and is read as it
    is; ``add_cross_attention`` is refused unless false.
    ``attn_pdrop``, ``resid_pdrop`` and ``embd_pdrop`` (dropout while training: 0.1 by default)
    are read as probabilities and not applied: npattn has no dropout on the attention weights of
    this family, the residual branches or the embeddings, so its training is transformers' without
    them; at evaluation all three are the identity.  The ``summary_*`` keys
    (``GPT2DoubleHeadsModel``'s head) and ``n_ctx`` (old configs' context size, which GPT2Config
    no longer reads) are metadata.  Keys of other families' attention (``num_key_value_heads``,
    ``head_dim``, ``attention_dropout``, ``rms_norm_eps``) are refused."""
    heads, hidden = r.int("num_attention_heads"), r.int("hidden_size")
    if hidden % heads:
        raise ValueError(f"config['n_head']: expected a divisor of n_embd = {hidden}, got {heads}")
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        p = r.float(key, 0.0, positive=False)
        if not 0.0 <= p < 1.0:
            raise ValueError(f"config[{key!r}]: expected a probability in [0, 1), got {p}")
    r.only("add_cross_attention", (False,), False, "cross-attention layers over an encoder's states")
    r.bool("reorder_and_upcast_attn")
    for key in ("n_ctx", "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels"):
        r.get(key)
    r.get("summary_first_dropout")
    act = _act(r, "activation_function", "gelu_new")
    if act == "xielu":
        raise ValueError("config['activation_function'] = 'xielu' is not supported by npattn for model_type 'gpt2'")
    c = _common(r)
    for key in ("num_key_value_heads", "head_dim", "attention_dropout", "rms_norm_eps"):
        r.used.discard(key)  # no keys of GPT-2: refused by finish() where given
    n = c["num_hidden_layers"]
    inner = r.int("n_inner") if r.has("n_inner") else 4 * hidden
    r.used.add("n_inner")
    c.update(
        intermediate_size=inner,
        hidden_act=act,
        attention_bias=True,
        mlp_bias=True,
        attention_scale=None if r.bool("scale_attn_weights", True) else 1.0,
        attention_scale_by_layer=r.bool("scale_attn_by_inverse_layer_idx"),
        rms_norm_eps=r.float("layer_norm_epsilon", 1e-5),
        layer_norm=True,
        layer_norm_bias=True,
        layer_types=("full_attention",) * n,
        mlp_types=("plain",) * n,
        rope_layers=(False,) * n,
        position_embedding="wpe",
        max_position_embeddings=r.int("max_position_embeddings"),
        pad_embedding_row=False,  # GPT2Model's wte has no padding_idx
        layer_names=_GPT2_NAMES,
        final_norm_name="ln_f",
        embed_name="wte",
        layout=CheckpointLayout(
            r.model_type,
            renames=_GPT2_RENAMES,
            fused=_GPT2_FUSED,
            transposed=_GPT2_CONV1D,
            base_prefix="transformer.",
            ignored=(".attn.bias", ".attn.masked_bias"),  # GPT2PreTrainedModel's mask buffers of old checkpoints
        ),
    )
    return c


# StableLM's per-head LayerNorms: q_layernorm.norms.{h}.weight (CheckpointLayout.per_row)
_STABLELM_RENAMES = (("self_attn.q_norm", "self_attn.q_layernorm"), ("self_attn.k_norm", "self_attn.k_layernorm"))


def _stablelm(r: _Reader) -> dict:
    """Stability's StableLM (StableLM-3B-4E1T, StableLM-2-1.6B, StableLM-2-Zephyr, StableLM-Zephyr-3B;
    ``StableLmForCausalLM``): Llama's names and gated MLP (``hidden_act``, ``silu`` by default) on
    LayerNorms with a bias (``layer_norm_eps``); q, k and v with biases where ``use_qkv_bias`` says
    so, ``o_proj`` without; grouped key/value heads of ``hidden_size // num_attention_heads``; RoPE
    on rotate-half pairs of the first ``partial_rotary_factor`` of each head (0.25 where the config
    gives none, as ``StableLmConfig.__post_init__`` sets it).  ``use_parallel_residual``: the MLP
    beside the attention on the same ``input_layernorm``, ``x + attn(ln(x)) + mlp(ln(x))``
    (``parallel_mlp``, no ``post_attention_layernorm``).  ``qk_layernorm``: a bias-free LayerNorm of
    each head's q and k before RoPE, one per head (``qk_norm_scope`` ``"each_head"``), which the
    checkpoint writes ``self_attn.q_layernorm.norms.{h}.weight`` (``CheckpointLayout.per_row``).
    ``hidden_dropout`` (dropout of the MLP's output while training) is read as a probability and not
    applied: the identity at evaluation.  A ``head_dim`` other than ``hidden_size //
    num_attention_heads`` is refused by name (StableLmAttention ignores the key)."""
    if not r.has("partial_rotary_factor"):  # StableLmConfig.__post_init__: kwargs.setdefault(..., 0.25)
        r.d = {**r.d, "partial_rotary_factor": 0.25}
    heads, hidden = r.int("num_attention_heads"), r.int("hidden_size")
    if hidden % heads:
        raise ValueError(f"config['num_attention_heads']: expected a divisor of hidden_size = {hidden}, got {heads}")
    why = "StableLmAttention's heads are hidden_size // num_attention_heads"
    r.only("head_dim", (None, hidden // heads), None, why)
    c = _common(r)
    r.used.discard("rms_norm_eps")  # StableLM's eps is layer_norm_eps; rms_norm_eps is no key of it
    p = r.float("hidden_dropout", 0.0, positive=False)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"config['hidden_dropout']: expected a probability in [0, 1), got {p}")
    qk = r.bool("qk_layernorm")
    n = c["num_hidden_layers"]
    c.update(
        intermediate_size=r.int("intermediate_size"),
        hidden_act=_act(r, "hidden_act", "silu"),
        attention_bias=r.bool("use_qkv_bias"),
        attention_out_bias=False,  # StableLmAttention's o_proj
        rms_norm_eps=r.float("layer_norm_eps", 1e-5),
        layer_norm=True,
        layer_norm_bias=True,
        parallel_mlp=r.bool("use_parallel_residual"),
        qk_norm=qk,
        rope=_rope_params(r, 10000.0, partial=True),
        layer_types=("full_attention",) * n,
        mlp_types=("dense",) * n,
        layout=CheckpointLayout(
            r.model_type, renames=_STABLELM_RENAMES, per_row=("self_attn.q_norm.weight", "self_attn.k_norm.weight")
        ),
    )
    if qk:
        c["qk_norm_scope"] = "each_head"
    return c


# StarCoder2's names: the plain MLP's c_fc and c_proj
_STARCODER2_NAMES = (("mlp.up_proj", "mlp.c_fc"), ("mlp.down_proj", "mlp.c_proj"))


def _starcoder2(r: _Reader) -> dict:
    """BigCode's StarCoder2 (3B, 7B, 15B and their instruct versions; ``Starcoder2ForCausalLM``):
    pre-norm layers whose norms are LayerNorms with a bias (``norm_epsilon``); attention over
    grouped key/value heads with RoPE (rotate-half pairs of each whole head, ``_rope_params``) and
    a window of ``sliding_window`` keys on every layer (null: full attention), as Mistral's; the
    plain MLP ``c_proj(act(c_fc(x)))`` (``hidden_act``, ``gelu_pytorch_tanh`` by default; an
    activation with trained parameters is refused); ``use_bias`` gives q, k, v, o, ``c_fc`` and
    ``c_proj`` their biases (the LayerNorms always have theirs, the head never); the head tied to
    the embedding as ``tie_word_embeddings`` says (true by default).  ``attention_dropout`` is
    the attention's (applied while training, as transformers does); ``residual_dropout`` and
    ``embedding_dropout`` (dropout while training: the released checkpoints' 0.1) are read as
    probabilities and not applied: npattn has no dropout on the residual branches or the
    embedding, so its training is transformers' without them; at evaluation both are the
    identity.  The released config.json's ``mlp_type`` ("default") and ``norm_type``
    ("layer_norm"), keys of BigCode's training code that transformers ignores, are read as the
    only values transformers' model computes."""
    from ..nn.moe import PARAMETRIZED_ACTS

    c = _common(r)
    r.used.discard("rms_norm_eps")  # StarCoder2's eps is norm_epsilon; rms_norm_eps is no key of it
    for key in ("residual_dropout", "embedding_dropout"):
        p = r.float(key, 0.0, positive=False)
        if not 0.0 <= p < 1.0:
            raise ValueError(f"config[{key!r}]: expected a probability in [0, 1), got {p}")
    r.only("mlp_type", ("default",), "default", "Starcoder2MLP is c_proj(act(c_fc(x)))")
    r.only("norm_type", ("layer_norm",), "layer_norm", "Starcoder2DecoderLayer's norms are nn.LayerNorm")
    act = _act(r, "hidden_act", "gelu_pytorch_tanh")
    if act in PARAMETRIZED_ACTS:
        raise ValueError(
            f"config['hidden_act'] = {act!r} is not supported by npattn for model_type 'starcoder2' "
            "(its trained parameters are no tensors of a StarCoder2 checkpoint)"
        )
    bias = r.bool("use_bias", True)
    n = c["num_hidden_layers"]
    kind = "full_attention" if r.get("sliding_window") is None else "sliding_attention"
    c.update(
        intermediate_size=r.int("intermediate_size"),
        hidden_act=act,
        attention_bias=bias,
        mlp_bias=bias,
        rms_norm_eps=r.float("norm_epsilon", 1e-5),
        layer_norm=True,
        layer_norm_bias=True,
        rope=_rope_params(r, 10000.0),
        **_dense_layers(r, (kind,) * n),
    )
    c.update(mlp_types=("plain",) * n, layer_names=_STARCODER2_NAMES)
    return c


def _qwen3(r: _Reader) -> dict:
    c = _common(r)
    n = c["num_hidden_layers"]
    use_sw = r.bool("use_sliding_window")
    mwl = r.int("max_window_layers", n, minimum=0)
    sw = r.get("sliding_window") if use_sw else None
    default = ["sliding_attention" if sw is not None and i >= mwl else "full_attention" for i in range(n)]
    lt = _layer_types(r, n, ("full_attention", "sliding_attention"), default)
    c.update(
        _mlp_and_bias(r),
        qk_norm=True,
        rope=_rope_params(r, 10000.0),
        **_dense_layers(r, lt),
    )
    return c


def _rope_extra(r: _Reader, key: str, default: Mapping | None = None):
    """The value of ``key`` in the RoPE dict ``_rope_params`` reads (a non-empty ``rope_scaling``,
    else ``rope_parameters``, else the family's ``default``), or None."""
    rp, scaling = _rope_mapping(r, "rope_parameters"), _rope_mapping(r, "rope_scaling")
    chosen = scaling or (default if rp is None else rp) or {}
    return chosen.get(key)


def _mistral(r: _Reader, rope_theta: float = 10000.0, rope: dict | None = None) -> dict:
    """Mistral (7B, Nemo, Small, the Ministral and Devstral text models that say ``mistral``):
    Llama without biases, ``head_dim`` apart from ``hidden / heads`` where given, and a window of
    ``sliding_window`` keys on every layer (null: full attention), as ``MistralAttention`` masks it
    (the contributing guide's worked example).  ``rope_theta``: the family's RoPE base where the
    config gives none (Mixtral's is 1e6); ``rope``: the RoPE parameters the family read itself."""
    c = _common(r)
    n = c["num_hidden_layers"]
    kind = "full_attention" if r.get("sliding_window") is None else "sliding_attention"
    c.update(
        intermediate_size=r.int("intermediate_size"),
        hidden_act=_act(r, "hidden_act", "silu"),
        rope=_rope_params(r, rope_theta) if rope is None else rope,
        **_dense_layers(r, (kind,) * n),
    )
    return c


def _ministral(r: _Reader) -> dict:
    """Ministral (mistralai/Ministral-8B-Instruct-2410, ``MinistralForCausalLM``): Mistral's layers
    (no biases, ``head_dim`` apart from ``hidden / heads`` where given) with ``layer_types`` naming
    each layer full or sliding (a window of ``sliding_window`` keys; by default every layer slides
    when ``sliding_window`` is set, else none), as transformers builds one mask per layer type."""
    c = _common(r)
    n = c["num_hidden_layers"]
    sw = r.get("sliding_window")
    default = ["sliding_attention" if sw is not None else "full_attention"] * n
    lt = _layer_types(r, n, ("full_attention", "sliding_attention"), default)
    c.update(
        intermediate_size=r.int("intermediate_size"),
        hidden_act=_act(r, "hidden_act", "silu"),
        rope=_rope_params(r, 10000.0),
        **_dense_layers(r, lt),
    )
    return c


# Ministral 3's rope_parameters where the config has none (Ministral3Config.__post_init__; the
# reader adds the config's max_position_embeddings, as there)
_MINISTRAL3_ROPE = {
    "type": "yarn",
    "rope_theta": 1000000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 16384,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}


def _ministral3(r: _Reader) -> dict:
    """Ministral 3 (mistralai/Ministral-3-{3,8,14}B-*-2512, ``Ministral3ForCausalLM``, the text model
    of their ``mistral3`` checkpoints): Mistral's layers (a window of ``sliding_window`` keys on
    every layer, null: full) whose queries, after RoPE, are multiplied by
    ``1 + beta log(1 + floor(p / original_max_position_embeddings))`` at position ``p``
    (``get_llama_4_attn_scale``), ``beta`` the ``llama_4_scaling_beta`` of ``rope_parameters`` and
    the length that dict's ``original_max_position_embeddings`` (YaRN's, as transformers
    standardizes it); both are required, as transformers' attention reads them.  ``rope_parameters``
    left out is ``Ministral3Config``'s (YaRN, factor 16 over 16384 positions, base 1e6, beta 0.1)."""
    beta = _rope_extra(r, "llama_4_scaling_beta", _MINISTRAL3_ROPE)
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not math.isfinite(beta):
        raise ValueError(
            f"config['rope_parameters']['llama_4_scaling_beta']: expected a finite number (the queries' scale "
            f"by position), got {_show(beta)}"
        )
    default = dict(_MINISTRAL3_ROPE, max_position_embeddings=_max_positions(r))  # as __post_init__ writes it
    rope = _rope_params(r, 10000.0, default, aside=("llama_4_scaling_beta",))
    c = _mistral(r, rope=rope)
    length = rope["default"].get("original_max_position_embeddings")
    if not isinstance(length, numbers.Integral) or isinstance(length, bool) or length < 1:
        raise ValueError(
            f"config['rope_parameters']['original_max_position_embeddings']: expected an integer >= 1 (the length "
            f"of Ministral 3's query scale, in a 'yarn' dict), got {_show(length)}"
        )
    c.update(query_scale_by_position=(float(beta), int(length)))
    return c


# Mixtral's released checkpoints (and transformers' save_pretrained of MixtralForCausalLM) keep
# the routed experts one at a time as w1 (gate), w3 (up), w2 (down) under block_sparse_moe
# (transformers' conversion_mapping for "mixtral", both directions)
_MIXTRAL_LAYOUT: dict[str, Any] = dict(
    per_expert=True, expert_projs=("w1", "w3", "w2"), renames=((".mlp.", ".block_sparse_moe."),)
)


# the keys of Hunyuan's "dynamic" RoPE dict that its NTK-alpha frequencies never read (the
# releases carry YaRN's beside the alpha; HunYuanDenseV1RotaryEmbedding reads rope_theta and alpha)
_NTK_ALPHA_UNREAD = ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _hunyuan_v1_dense(r: _Reader) -> dict:
    """Hunyuan's dense models (tencent/Hunyuan-0.5B/1.8B/4B/7B-Instruct,
    ``HunYuanDenseV1ForCausalLM``): Llama's layers (``attention_bias`` on all four projections, an
    MLP without biases) whose attention rotates q and k first and then normalises each head of
    both (``query_layernorm``, ``key_layernorm``: RMSNorms of ``head_dim`` with the model's eps),
    the reverse of Qwen3's order (``qk_norm_after_rope``).  ``head_dim`` is required
    (``HunYuanDenseV1Attention`` reads the config's, null included).  A RoPE dict of type
    ``"dynamic"`` with a non-zero ``alpha`` is NTK-aware scaling by that fixed alpha
    (``"ntk_alpha"``: base ``rope_theta * alpha ** (head_dim / (head_dim - 2))``; the dict's other
    YaRN-like keys are not read there); without one it is transformers' dynamic NTK.
    ``eod_token_id`` is a token id (metadata)."""
    if not r.has("head_dim"):
        raise ValueError(
            "config: model_type 'hunyuan_v1_dense' needs the key 'head_dim' (HunYuanDenseV1Attention reads the "
            "config's, without a default), which is missing or null"
        )
    c = _common(r)
    r.get("eod_token_id")  # a token id: metadata
    kind = _rope_extra(r, "rope_type") or _rope_extra(r, "type")
    if kind == "dynamic" and _rope_extra(r, "alpha"):
        rope = _rope_params(r, 10000.0, aside=_NTK_ALPHA_UNREAD, retype="ntk_alpha")
    else:  # a null or zero alpha: HunYuanDenseV1RotaryEmbedding keeps the dict's type (and ignores the key)
        rope = _rope_params(r, 10000.0, aside=("alpha",) if _rope_extra(r, "alpha") is not None else ())
    c.update(
        _mlp_and_bias(r),
        qk_norm=True,
        qk_norm_after_rope=True,
        rope=rope,
        layer_names=_HUNYUAN_NAMES,
        **_dense_layers(r, ("full_attention",) * c["num_hidden_layers"]),
    )
    return c


_HUNYUAN_NAMES = (("self_attn.q_norm", "self_attn.query_layernorm"), ("self_attn.k_norm", "self_attn.key_layernorm"))


def _mixtral(r: _Reader) -> dict:
    """Mixtral (8x7B, 8x22B): Mistral's attention (a window of ``sliding_window`` keys on every
    layer, null: full; RoPE base 1e6 by default) and on every layer routed experts of
    ``intermediate_size`` (softmax over ``num_local_experts``, the top ``num_experts_per_tok``
    renormalised, no shared expert); ``router_jitter_noise`` (a training-time noise on the
    router's input) must be 0."""
    c = _mistral(r, 1_000_000.0)
    # transformers' attribute_map lets the config say num_local_experts or num_experts
    experts = {k: r.int(k) for k in ("num_local_experts", "num_experts") if r.has(k)}
    if len(set(experts.values())) > 1:
        raise ValueError(f"config: num_local_experts and num_experts differ ({experts})")
    r.int("num_experts_per_tok")
    r.get("router_jitter_noise")  # refused unless 0 by the MoE reader (_moe_mixtral)
    c.update(
        mlp_types=("moe",) * c["num_hidden_layers"],
        moe=moe_config({**r.d, "num_local_experts": next(iter(experts.values()), 8)}),
        layout=CheckpointLayout(r.model_type, **_MIXTRAL_LAYOUT),
    )
    return c


def _qwen2(r: _Reader) -> dict:
    """Qwen2 and Qwen2.5 (and the models built on them, e.g. DeepSeek-R1's Qwen distills): Qwen3's
    layers and sliding-window keys without QK-norm, with biases on q, k and v but none on o
    (``Qwen2Attention`` fixes both; an ``attention_bias`` in the dict changes nothing there, nor
    here)."""
    c = _qwen3(r)
    c.update(qk_norm=False, attention_bias=True, attention_out_bias=False)
    return c


def _no_rope_layers(r: _Reader, n: int) -> tuple:
    """SmolLM3's ``no_rope_layers`` as ``rope_layers``: a list of ``n`` entries (num_hidden_layers),
    each 1 (the layer rotates) or 0 (NoPE); left out, ``SmolLM3Config``'s rule: every
    ``no_rope_layer_interval``-th layer (the last of each run) NoPE, the others RoPE."""
    v = r.get("no_rope_layers")
    if v is None:
        interval = r.int("no_rope_layer_interval", 4)
        return tuple((i + 1) % interval != 0 for i in range(n))
    r.get("no_rope_layer_interval")  # transformers reads it only to make a missing list
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"config['no_rope_layers']: expected a list of 0 and 1 (1: RoPE, 0: NoPE), got {_show(v)}")
    if len(v) != n:
        raise ValueError(f"config['no_rope_layers']: expected {n} entries (num_hidden_layers), got {len(v)}")
    for x in v:
        if isinstance(x, bool) or x not in (0, 1):
            raise ValueError(
                f"config['no_rope_layers']: expected entries 0 (NoPE) or 1 (RoPE), got {_show(x)} in {_show(v)}"
            )
    return tuple(x == 1 for x in v)


def _ernie4_5(r: _Reader) -> dict:
    """ERNIE 4.5 dense (baidu/ERNIE-4.5-0.3B-PT, ``Ernie4_5ForCausalLM``): Llama's layers with
    ``use_bias`` one switch for the biases of all seven projections (q, k, v, o and the MLP's gate,
    up, down; never the head's), RoPE on interleaved pairs ``(2i, 2i + 1)`` over the whole head
    (``Ernie4_5``'s ``apply_rotary_pos_emb``: each frequency repeated twice, GLM's ``rotate_half``)
    at a base of 500000 where none is given, ``head_dim`` 128 where the key is missing (null:
    ``hidden_size / num_attention_heads``), a tied head by default.  ``Ernie4_5Attention`` never
    drops attention weights: an ``attention_dropout`` other than 0 is refused."""
    c = _common(r)
    _no_attention_dropout(c, "ernie4_5", "Ernie4_5Attention's dropout is always 0 (transformers ignores the key)")
    n = c["num_hidden_layers"]
    bias = r.bool("use_bias")
    c.update(
        intermediate_size=r.int("intermediate_size"),
        hidden_act=_act(r, "hidden_act", "silu"),
        attention_bias=bias,
        mlp_bias=bias,
        rope=_rope_params(r, 500000.0),
        rope_interleaved=True,
        layer_types=("full_attention",) * n,
        mlp_types=("dense",) * n,
    )
    return c


# GLM-4's names of the four norms of a layer (Glm4DecoderLayer): the norm after attention is its
# post_self_attn_layernorm, the one before the MLP its post_attention_layernorm (Llama's name of the
# pre-MLP norm, Gemma's of the post-attention one), the one after the MLP its post_mlp_layernorm
_GLM4_NAMES = (
    ("post_attention_layernorm", "post_self_attn_layernorm"),
    ("pre_feedforward_layernorm", "post_attention_layernorm"),
    ("post_feedforward_layernorm", "post_mlp_layernorm"),
)
# Glm4MLP's one gate_up_proj: the gate's rows, then the up projection's (its chunk(2))
_GLM4_FUSED = (("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),)


def _glm4(r: _Reader) -> dict:
    """GLM-4 (GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1, ``Glm4ForCausalLM``): Llama's attention with
    biases on q, k and v only (``attention_bias``, default true; ``o_proj`` has none), RoPE on the
    interleaved pairs ``(2i, 2i + 1)`` of the first ``partial_rotary_factor`` of each head (default
    0.5; ``Glm4``'s ``apply_rotary_pos_emb`` repeats each frequency twice and its ``rotate_half``
    pairs neighbours), plain RMSNorms around both sublayers (``sandwich_norm``, under GLM's own
    names: ``_GLM4_NAMES``), the gated MLP's gate and up rows in one ``gate_up_proj``
    (``_GLM4_FUSED``), an untied head by default.  ``Glm4Model`` masks causally with no window: a
    ``sliding_window`` key is refused; so is a factor that leaves an odd number of features to
    rotate (transformers would turn one more at frequencies of the odd width)."""
    c = _common(r)
    n = c["num_hidden_layers"]
    rope = _rope_params(r, 10000.0, partial=True)
    resolve_rotary_dim(c["head_dim"], None, rope["default"])  # an even number of features rotating
    c.update(
        _mlp_and_bias(r),
        attention_out_bias=False,
        sandwich_norm=True,
        rope=rope,
        rope_interleaved=True,
        layer_types=("full_attention",) * n,
        mlp_types=("dense",) * n,
        layer_names=_GLM4_NAMES,
        layout=CheckpointLayout(r.model_type, fused=_GLM4_FUSED),
    )
    return c


def _smollm3(r: _Reader) -> dict:
    """SmolLM3 (HuggingFaceTB/SmolLM3-3B): Llama's layers (``attention_bias`` on all four attention
    projections, ``mlp_bias`` on the MLP's three, a tied head by default, RoPE base 2e6) of which
    those with a 0 in ``no_rope_layers`` attend without RoPE (NoPE; by default every fourth,
    ``no_rope_layer_interval``): ``CausalLMConfig.rope_layers``.  With ``use_sliding_window`` and a
    ``sliding_window`` the NoPE layers slide by default (``SmolLM3Config``'s ``layer_types``); a
    ``sliding_attention`` layer without ``use_sliding_window`` is refused (transformers' eager and
    SDPA attention mask its window, its flash attention does not), and so is a
    ``partial_rotary_factor`` below 1 (SmolLM3Attention rotates whole heads: ``_whole_heads``)."""
    c = _common(r)
    n = c["num_hidden_layers"]
    rope_layers = _no_rope_layers(r, n)
    # SmolLM3-3B's config.json says max_window_layers (a Qwen2 key): SmolLM3Config has no such
    # field and nothing in transformers' SmolLM3 reads it (sliding layers: layer_types)
    r.get("max_window_layers")
    use_sw = r.bool("use_sliding_window")
    sw = r.get("sliding_window") if use_sw else None
    default = ["sliding_attention" if sw is not None and not rope_layers[i] else "full_attention" for i in range(n)]
    lt = _layer_types(r, n, ("full_attention", "sliding_attention"), default)
    if "sliding_attention" in lt and not use_sw:
        raise ValueError(
            "config['layer_types']: 'sliding_attention' with use_sliding_window false is not supported by npattn "
            "for model_type 'smollm3' (transformers' attention implementations disagree on it)"
        )
    c.update(
        _mlp_and_bias(r),
        mlp_bias=r.bool("mlp_bias"),
        rope=_rope_params(r, 2000000.0),
        rope_layers=rope_layers,
        **_dense_layers(r, lt),
    )
    return c


def _sparse_step(r: _Reader, n: int) -> tuple:
    """The Qwen MoE families' ``mlp_types``: routed experts on every ``decoder_sparse_step``-th
    layer (the last of each run) not listed in ``mlp_only_layers``, a dense MLP on the others."""
    step = r.int("decoder_sparse_step", 1)
    only = r.get("mlp_only_layers") or []
    if not isinstance(only, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise ValueError(f"config['mlp_only_layers']: expected a list of layer indices, got {_show(only)}")
    return tuple("moe" if i not in only and (i + 1) % step == 0 else "dense" for i in range(n))


def _qwen2_moe(r: _Reader) -> dict:
    """Qwen1.5-MoE and Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (biases on
    q, k and v when ``qkv_bias``, none on o), routed experts of ``moe_intermediate_size`` (softmax,
    top k, renormalised when ``norm_topk_prob``) beside a shared expert of
    ``shared_expert_intermediate_size`` whose output is scaled by ``sigmoid(shared_expert_gate(x))``,
    on every ``decoder_sparse_step``-th layer not in ``mlp_only_layers`` (the others: a dense MLP
    of ``intermediate_size``; ``num_experts`` 0: every layer dense).  With ``use_sliding_window``
    the layers below ``max_window_layers`` of even index slide through ``sliding_window`` keys
    (``Qwen2MoeConfig``'s ``layer_types``); a sliding layer without ``use_sliding_window`` is
    refused (transformers' config sets its window to 0 then)."""
    c = _common(r)
    n = c["num_hidden_layers"]
    use_sw = r.bool("use_sliding_window")
    mwl = r.int("max_window_layers", minimum=0)
    default = ["sliding_attention" if (i + 1) % 2 and i < mwl and use_sw else "full_attention" for i in range(n)]
    lt = _layer_types(r, n, ("full_attention", "sliding_attention"), default)
    if "sliding_attention" in lt and not use_sw:
        raise ValueError(
            "config['layer_types']: 'sliding_attention' with use_sliding_window false is not supported by npattn "
            "for model_type 'qwen2_moe' (transformers' Qwen2MoeConfig sets sliding_window to 0 then)"
        )
    experts = r.int("num_experts", minimum=0)
    sparse = _sparse_step(r, n)
    mlp_types = sparse if experts else ("dense",) * n
    for key in ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
        r.int(key)
    r.bool("norm_topk_prob")
    qkv_bias = r.bool("qkv_bias", True)
    c.update(
        intermediate_size=r.int("intermediate_size"),
        hidden_act=_act(r, "hidden_act", "silu"),
        attention_bias=qkv_bias,
        attention_out_bias=False,
        rope=_rope_params(r, 10000.0),
        layer_types=lt,
        sliding_window=_window(r, lt),
        mlp_types=mlp_types,
        moe=moe_config(r.d) if "moe" in mlp_types else None,
        layout=CheckpointLayout(r.model_type, per_expert=True),
    )
    return c


def _granite_scalars(r: _Reader) -> dict:
    """Granite's four numbers (``GraniteConfig``'s and ``GraniteMoeConfig``'s, each 1 by default):
    ``embedding_multiplier`` times the embeddings (``embed_scale``; 1: none), ``residual_multiplier``
    times each sublayer's output before its residual sum, ``attention_multiplier`` the scores'
    factor in place of ``1/sqrt(head_dim)`` (``attention_scale``), ``logits_scaling`` dividing the
    logits.  Each must be a finite number > 0."""
    embed = r.float("embedding_multiplier", 1.0)
    return dict(
        embed_scale=False if embed == 1.0 else embed,
        residual_multiplier=r.float("residual_multiplier", 1.0),
        attention_scale=r.float("attention_multiplier", 1.0),
        logits_scaling=r.float("logits_scaling", 1.0),
    )


def _granite(r: _Reader) -> dict:
    """Granite 3.x dense (ibm-granite/granite-3.3-2b, -8b, ...; ``GraniteForCausalLM``): Llama's
    layers (``attention_bias`` on the four attention projections, ``mlp_bias`` on the MLP's three,
    ``head_dim`` where given) with Granite's four numbers (``_granite_scalars``)."""
    c = _llama(r)
    c.update(_granite_scalars(r))
    return c


def _granitemoe(r: _Reader) -> dict:
    """Granite 3.0/3.1 MoE (granite-3.0-1b-a400m, -3b-a800m; ``GraniteMoeForCausalLM``): Llama's
    attention (``attention_bias`` on its four projections) and Granite's four numbers, every layer's
    MLP routed experts (``block_sparse_moe``): ``num_local_experts`` SwiGLU experts of width
    ``intermediate_size``, the router's ``num_experts_per_tok`` largest logits softmaxed among
    themselves (``GraniteMoeTopKRouter``: no bias, no shared expert).  The released checkpoints
    write the router as ``router.layer.weight`` and the experts fused as ``input_linear.weight``
    ``(E, 2I, H)`` (gate rows, then up rows) and ``output_linear.weight`` ``(E, H, I)``:
    transformers' ``router.weight``, ``experts.gate_up_proj`` and ``experts.down_proj`` (its
    ``conversion_mapping``, both directions: ``CheckpointLayout.renames``)."""
    c = _common(r)
    n = c["num_hidden_layers"]
    c.update(_granite_attention(r, n), **_granite_experts(r, n, shared=False))
    return c


def _granitemoeshared(r: _Reader) -> dict:
    """GraniteMoeShared (``GraniteMoeSharedForCausalLM``): Granite MoE (``_granitemoe``) whose
    layers also run a shared MLP of width ``shared_intermediate_size`` on the same normalised input,
    its output added to the experts' before the residual multiplier
    (``GraniteMoeSharedDecoderLayer``: ``moe(h) + shared_mlp(h)``).  ``SparseMoeBlock``'s shared
    expert, under transformers' names: ``shared_mlp.input_linear.weight`` ``(2S, H)`` (gate rows,
    then up rows, as its ``chunk(2)`` splits them; the model holds them as ``shared_mlp.gate_proj``
    and ``shared_mlp.up_proj``: ``CheckpointLayout.fused``) and ``shared_mlp.output_linear.weight``.
    A ``shared_intermediate_size`` of 0 (the class default) is no shared MLP: Granite MoE."""
    c = _common(r)
    n = c["num_hidden_layers"]
    shared = r.int("shared_intermediate_size", minimum=0) > 0
    c.update(_granite_attention(r, n), **_granite_experts(r, n, shared=shared))
    return c


# the Mamba-2 layers' keys of a GraniteMoeHybrid config (Mamba2Config's; read by no layer of an
# all-attention model)
_GRANITE_MAMBA_KEYS = (
    "mamba_n_heads",
    "mamba_n_groups",
    "mamba_d_state",
    "mamba_d_head",
    "mamba_d_conv",
    "mamba_expand",
    "mamba_chunk_size",
    "mamba_conv_bias",
    "mamba_proj_bias",
    "time_step_limit",
)


def _granitemoehybrid(r: _Reader) -> dict:
    """Granite 4.0 (``GraniteMoeHybridForCausalLM``): the all-attention models (granite-4.0-micro,
    -1b, -350m: ``layer_types`` all ``"attention"``, which transformers 5 calls
    ``"full_attention"``) and the hybrid ones (granite-4.0-h-micro, -h-tiny, -h-small: mostly
    ``"mamba"`` layers, transformers 5's ``"linear_attention"``, and every layer where
    ``layer_types`` is missing, transformers' default).  The attention layers are
    GraniteMoeShared's (``_granitemoeshared``), the Mamba-2 layers ``Mamba2Mixer``s under
    ``mamba.`` (``_granite_mamba``: the ``mamba_*`` keys, ``time_step_limit``, the convolution's
    activation ``hidden_act``); every layer's MLP is the shared MLP (``shared_intermediate_size``),
    with the routed experts only where ``num_local_experts`` > 0; with 0 (the released dense
    models) the layer's MLP is the shared MLP alone (``GraniteMoeHybridDecoderLayer``'s
    ``has_experts``), ``intermediate_size`` and ``num_experts_per_tok`` then read by no module.
    ``position_embedding_type``: ``"rope"`` rotates q and k (the released all-attention models);
    null (transformers' default) or ``"nope"`` (the hybrid releases') leaves them unrotated, as
    ``GraniteMoeHybridModel`` builds no rotary embedding for any value but ``"rope"``
    (``rope_layers`` all False).  Without Mamba-2 layers the ``mamba_*`` keys are metadata, and so
    are ``init_method`` (the initialisation) and ``normalization_function`` (which must say
    ``"rmsnorm"``: transformers' layers are RMSNorms whatever it says)."""
    c = _common(r)
    n = c["num_hidden_layers"]
    lt = r.get("layer_types")
    if lt is None:  # transformers' GraniteMoeHybridConfig: every layer a Mamba-2 layer
        lt = ["linear_attention"] * n
    if not isinstance(lt, (list, tuple)) or len(lt) != n:
        raise ValueError(f"config['layer_types']: expected a list of {n} entries (num_hidden_layers), got {_show(lt)}")
    kinds = {"mamba": "linear_attention", "linear_attention": "linear_attention"}
    kinds.update(attention="full_attention", full_attention="full_attention")
    for t in lt:
        if t not in kinds:
            raise ValueError(
                f"config['layer_types']: {t!r} is not supported by npattn for model_type 'granitemoehybrid' "
                f"(supported: {sorted(kinds)})"
            )
    layer_types = tuple(kinds[t] for t in lt)
    r.get("init_method")
    r.only("normalization_function", ("rmsnorm",), "rmsnorm", "transformers' Granite 4.0 layers are RMSNorms")
    position = r.only("position_embedding_type", (None, "rope", "nope"), None, "RoPE or no positions")
    c.update(_granite_attention(r, n), layer_types=layer_types)
    if "linear_attention" in layer_types:
        c.update(linear_attention=_granite_mamba(r, c))
    else:
        for key in _GRANITE_MAMBA_KEYS:
            r.get(key)
    if position != "rope":  # GraniteMoeHybridModel: no rotary embedding
        c.update(rope_layers=(False,) * n)
    if r.int("shared_intermediate_size") and r.int("num_local_experts", minimum=0) > 0:
        c.update(_granite_experts(r, n, shared=True))
        return c
    r.get("intermediate_size"), r.get("num_experts_per_tok")  # the experts' (there are none)
    c.update(
        intermediate_size=r.int("shared_intermediate_size"),
        mlp_types=("dense",) * n,
        layer_names=_GRANITE_DENSE_NAMES,
        layout=CheckpointLayout(r.model_type, fused=_GRANITE_SHARED_FUSED),
    )
    return c


# transformers' encoding of the floats JSON lacks (PretrainedConfig._encode_special_floats)
_TAGGED_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf}


def _is_tagged_float(v) -> bool:
    return isinstance(v, Mapping) and set(v) == {"__float__"} and v["__float__"] in _TAGGED_FLOATS


def _granite_mamba(r: _Reader, c: dict) -> Mamba2Config:
    """Granite 4.0's Mamba-2 layers (``GraniteMoeHybridMambaLayer``): ``mamba_n_heads`` heads of
    ``mamba_d_head`` channels (``"auto"``: ``mamba_expand * hidden_size / mamba_n_heads``, their
    product always that inner width), ``mamba_n_groups`` groups of ``B``, ``C`` of width
    ``mamba_d_state``, ``mamba_d_conv`` taps, the biases ``mamba_conv_bias`` / ``mamba_proj_bias``,
    ``time_step_limit`` and the norm's ``rms_norm_eps``; the convolution's activation is
    ``hidden_act``, which must be SiLU (the layer has no other)."""
    return _mamba2(r, c, r.int("mamba_expand") * c["hidden_size"], "mamba_expand * hidden_size")


def _mamba2(r: _Reader, c: dict, inner: int, inner_name: str, keys: Mapping | None = None, **options) -> Mamba2Config:
    """The ``Mamba2Config`` of Granite 4.0's and Falcon-H1's ``mamba_*`` keys (``_granite_mamba``)
    for the inner width ``inner`` (``inner_name`` says how the config gives it); ``keys``: the
    family's own names of those keys (Mamba-2's ``num_heads``, ``head_dim`` ...); ``options``: the
    family's own ``Mamba2Mixer`` options."""
    k = {name: name for name in _GRANITE_MAMBA_KEYS} | dict(keys or {})
    heads = r.int(k["mamba_n_heads"])
    head_dim = r.get(k["mamba_d_head"], "auto")
    if head_dim == "auto":
        if inner % heads:
            raise ValueError(
                f"config[{k['mamba_n_heads']!r}]: expected a divisor of {inner_name} = {inner}, got {heads}"
            )
        head_dim = inner // heads
    elif isinstance(head_dim, bool) or not isinstance(head_dim, numbers.Integral) or head_dim < 1:
        raise ValueError(f"config[{k['mamba_d_head']!r}]: expected 'auto' or an integer >= 1, got {_show(head_dim)}")
    if heads * head_dim != inner:
        raise ValueError(
            f"config[{k['mamba_d_head']!r}]: expected {inner_name} / {k['mamba_n_heads']} = {inner / heads:g} "
            f"(the heads fill the inner width {inner}), got {head_dim}"
        )
    groups = r.int(k["mamba_n_groups"])
    if heads % groups:
        raise ValueError(
            f"config[{k['mamba_n_groups']!r}]: expected a divisor of {k['mamba_n_heads']} = {heads}, got {groups}"
        )
    limit = r.get("time_step_limit", [0.0, math.inf])  # transformers' default: no clip
    if isinstance(limit, (list, tuple)):  # transformers 5 writes an infinity as {"__float__": "Infinity"}
        limit = [_TAGGED_FLOATS.get(v["__float__"], v) if _is_tagged_float(v) else v for v in limit]
    ok = isinstance(limit, (list, tuple)) and len(limit) == 2
    ok = ok and all(isinstance(v, numbers.Real) and not isinstance(v, bool) and v == v for v in limit)
    if not ok or not limit[0] <= limit[1]:
        raise ValueError(
            f"config['time_step_limit']: expected two numbers [low, high] with low <= high, got {_show(limit)}"
        )
    if c["hidden_act"] not in ("silu", "swish"):
        raise ValueError(
            f"config['hidden_act'] = {c['hidden_act']!r} is not supported by npattn for model_type "
            f"{r.model_type!r} with Mamba-2 layers (supported: ['silu']): the layers' convolution applies it"
        )
    return Mamba2Config(
        hidden_size=c["hidden_size"],
        num_heads=heads,
        head_dim=head_dim,
        state_size=r.int(k["mamba_d_state"]),
        n_groups=groups,
        conv_kernel=r.int(k["mamba_d_conv"]),
        conv_bias=r.bool(k["mamba_conv_bias"], True),
        proj_bias=r.bool(k["mamba_proj_bias"]),
        rms_norm_eps=c["rms_norm_eps"],
        time_step_limit=(float(limit[0]), float(limit[1])),
        chunk_size=r.int(k["mamba_chunk_size"]),
        **options,
    )


_FALCON_H1_NAMES = (("mlp", "feed_forward"), ("post_attention_layernorm", "pre_ff_layernorm"))


def _multipliers(r: _Reader, key: str, n: int) -> tuple:
    """``n`` finite numbers > 0 under ``key`` (null: ``n`` ones, as transformers fills them)."""
    v = r.get(key)
    if v is None:
        return (1.0,) * n
    ok = isinstance(v, (list, tuple)) and len(v) == n
    ok = ok and all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < float(x) < math.inf for x in v)
    if not ok:
        raise ValueError(f"config[{key!r}]: expected a list of {n} finite numbers > 0, got {_show(v)}")
    return tuple(float(x) for x in v)


def _falcon_h1(r: _Reader) -> dict:
    """Falcon-H1 (tiiuae/Falcon-H1-0.5B/1.5B/1.5B-Deep/3B/7B/34B, Falcon-H1R;
    ``FalconH1ForCausalLM``): every layer ``"hybrid"``, Llama's attention (RoPE, ``attention_bias``
    on the four projections) and a Mamba-2 mixer side by side on the same normalised input, their
    outputs summed, then the gated MLP; the muP factors: ``embedding_multiplier`` (``embed_scale``),
    ``lm_head_multiplier`` (the logits divided by its inverse: ``logits_scaling``), ``key_multiplier``
    (the keys' factor, the same as the scores': ``attention_scale = key_multiplier / sqrt(head_dim)``),
    ``attention_in_multiplier``, ``attention_out_multiplier``, ``ssm_in_multiplier``,
    ``ssm_out_multiplier`` (``hybrid_multipliers``), ``mlp_multipliers`` (gate, down) and
    ``ssm_multipliers`` (the mixer's ``proj_multipliers``).  The mixer: ``_mamba2``'s keys with the
    inner width ``mamba_d_ssm`` (null: ``mamba_expand * hidden_size``), out_proj's bias
    ``projectors_bias``, the grouped RMSNorm where ``mamba_rms_norm`` (before the gate where
    ``mamba_norm_before_gate``: ``gated_norm``).  Checkpoint names: ``mamba.*``, ``self_attn.*``,
    ``feed_forward.*``, ``input_layernorm``, ``pre_ff_layernorm``, ``model.final_layernorm``.
    Keys of the released config.json files that transformers reads nowhere: ``mamba_use_mlp`` (must
    be true: every layer has its MLP), ``attn_layer_indices`` (must be null: every layer attends),
    ``mlp_expansion_factor`` and ``time_step_min``/``_max``/``_floor``/``_rank`` (the sizes' and the
    initialisation's bookkeeping: metadata); ``num_logits_to_keep`` is a generation option."""
    c = _common(r)
    n = c["num_hidden_layers"]
    c.update(
        _mlp_and_bias(r),
        mlp_bias=r.bool("mlp_bias"),
        rope=_rope_params(r, 10000.0),
        layer_types=("hybrid",) * n,
        mlp_types=("dense",) * n,
        layer_names=_FALCON_H1_NAMES,
        final_norm_name="final_layernorm",
    )
    r.only("mamba_use_mlp", (True,), True, "transformers' Falcon-H1 layers all have their MLP")
    r.only("attn_layer_indices", (None,), None, "transformers' Falcon-H1 layers all attend")
    for key in ("mlp_expansion_factor", "time_step_min", "time_step_max", "time_step_floor", "time_step_rank"):
        r.get(key)
    r.get("num_logits_to_keep")
    embed = r.float("embedding_multiplier", 1.0)
    scale = r.float("key_multiplier", 1.0) / math.sqrt(c["head_dim"])
    hybrid = tuple(
        r.float(k, 1.0)
        for k in ("attention_in_multiplier", "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier")
    )
    c.update(
        embed_scale=False if embed == 1.0 else embed,
        attention_scale=scale,
        logits_scaling=1.0 / r.float("lm_head_multiplier", 1.0),
        hybrid_multipliers=hybrid,
        mlp_multipliers=_multipliers(r, "mlp_multipliers", 2),
    )
    d_ssm = r.d.get("mamba_d_ssm")
    r.used.add("mamba_d_ssm")
    if d_ssm is None:
        inner, name = r.int("mamba_expand") * c["hidden_size"], "mamba_expand * hidden_size"
    else:
        inner, name = r.int("mamba_d_ssm"), "mamba_d_ssm"
        r.get("mamba_expand")  # transformers reads it only without mamba_d_ssm
    norm = r.bool("mamba_rms_norm")
    before = r.bool("mamba_norm_before_gate", True)
    ssm = _multipliers(r, "ssm_multipliers", 5)
    c.update(
        linear_attention=_mamba2(
            r,
            c,
            inner,
            name,
            out_proj_bias=r.bool("projectors_bias"),
            gated_norm=("norm_first" if before else "gate_first") if norm else None,
            proj_multipliers=None if ssm == (1.0,) * 5 else ssm,
        )
    )
    return c


def _cohere_keys(r: _Reader, c: dict) -> None:
    """The keys Cohere's released config.json files carry beside CohereConfig's / Cohere2Config's
    (their own training code's; transformers reads none of them): each must say what transformers'
    model does, else it is refused by name.  ``use_parallel_block`` (true: the parallel block),
    ``use_gated_activation`` (true: the gated MLP), ``position_embedding_type`` ("rope_gptj": RoPE on
    interleaved pairs), ``rotary_pct`` (1: whole heads), ``use_embedding_sharing`` (the head tied or
    not, as ``tie_word_embeddings``), ``order_of_interleaved_layers`` ("local_attn_first": the
    sliding layers first in each period); ``use_parallel_embedding`` (tensor-parallel sharding),
    ``layer_switch`` (the period, ``sliding_window_pattern``'s twin) and ``model_max_length``
    (Command R's trained context, which llama.cpp's converter takes for the context length) are
    metadata."""
    why = "transformers' Cohere models always do this"
    r.only("use_parallel_block", (True,), True, why)
    r.only("use_gated_activation", (True,), True, why)
    r.only("position_embedding_type", ("rope_gptj",), "rope_gptj", why + " (RoPE on interleaved pairs)")
    r.only("rotary_pct", (1, 1.0), 1.0, why + " (RoPE on whole heads)")
    tie = c["tie_word_embeddings"]
    r.only("use_embedding_sharing", (tie,), tie, "it must agree with tie_word_embeddings")
    r.only("order_of_interleaved_layers", ("local_attn_first",), "local_attn_first", why)
    r.get("use_parallel_embedding")
    r.get("layer_switch")
    r.get("model_max_length")


def _cohere_common(r: _Reader, rope_theta: float) -> dict:
    """What Command R and Command R7B share: Llama's sizes and gated MLP, one bias-free LayerNorm
    a layer (``layer_norm_eps``) before attention and MLP side by side (``parallel_mlp``), RoPE on
    interleaved pairs (``rotate_half`` of ``x[..., ::2]`` and ``x[..., 1::2]``, each frequency
    repeated twice), the logits times ``logit_scale`` (``logits_scaling`` its inverse), a tied head
    by default."""
    c = _common(r)
    r.used.discard("rms_norm_eps")  # Cohere's eps is layer_norm_eps; rms_norm_eps is no key of it
    c.update(
        _mlp_and_bias(r),
        rms_norm_eps=r.float("layer_norm_eps", 1e-5),
        rope=_rope_params(r, rope_theta),
        rope_interleaved=True,
        layer_norm=True,
        parallel_mlp=True,
        logits_scaling=1.0 / r.float("logit_scale", 0.0625),
    )
    _cohere_keys(r, c)
    return c


def _cohere2(r: _Reader) -> dict:
    """Command R7B (CohereLabs/c4ai-command-r7b-12-2024 and its Arabic twin; ``Cohere2ForCausalLM``):
    ``_cohere_common``'s layers, of which the ``"sliding_attention"`` ones (a window of
    ``sliding_window`` keys) rotate and the ``"full_attention"`` ones do not (``Cohere2Attention``
    applies RoPE only where its layer has a window: ``rope_layers``); ``layer_types`` left out, every
    ``sliding_window_pattern``-th layer (default 4, the last of each period) is full.  ``head_dim``
    is always ``hidden_size // num_attention_heads`` (``Cohere2Config`` overwrites the key: another
    value is refused); ``use_qk_norm`` must be false (Cohere2's attention has no QK-norm)."""
    c = _cohere_common(r, 10000.0)
    n, heads = c["num_hidden_layers"], c["num_attention_heads"]
    hd = c["hidden_size"] // heads
    if c["head_dim"] != hd:
        raise ValueError(
            f"config['head_dim'] = {c['head_dim']}: Cohere2Config sets head_dim to hidden_size // "
            f"num_attention_heads = {hd} whatever the key says; npattn refuses the disagreement"
        )
    r.only("use_qk_norm", (False,), False, "transformers' Cohere2 attention has no QK-norm")
    if r.has("layer_types"):
        r.get("sliding_window_pattern")  # transformers reads it only to make a missing list
        default: list = []
    else:
        default = _interleaved(n, r.int("sliding_window_pattern", 4), "sliding_attention")
    lt = _layer_types(r, n, ("full_attention", "sliding_attention"), default)
    c.update(_dense_layers(r, lt), rope_layers=tuple(t == "sliding_attention" for t in lt))
    return c


def _cohere(r: _Reader) -> dict:
    """Command R and Command R+ (CohereLabs/c4ai-command-r-v01, c4ai-command-r-08-2024,
    c4ai-command-r-plus; ``CohereForCausalLM``): ``_cohere_common``'s layers, all full attention
    with RoPE (base 500000 where none is given); ``use_qk_norm`` (Command R+): a bias-free
    LayerNorm of each head's q and k before RoPE, each head with its own weight row
    (``qk_norm_scope`` ``"each_head"``, eps ``layer_norm_eps``)."""
    c = _cohere_common(r, 500000.0)
    qk = r.bool("use_qk_norm")
    n = c["num_hidden_layers"]
    c.update(layer_types=("full_attention",) * n, mlp_types=("dense",) * n, qk_norm=qk)
    if qk:
        c["qk_norm_scope"] = "each_head"
    return c


# Nemotron-H's blocks: one sublayer each, under mixer.* beside the block's one norm
_NEMOTRON_H_NAMES = (
    ("input_layernorm", "norm"),
    ("post_attention_layernorm", "norm"),
    ("self_attn", "mixer"),
    ("mamba", "mixer"),
    ("mlp", "mixer"),
)
# hybrid_override_pattern's characters (NemotronHConfig._pattern_to_list) and each kind's sublayers
_NEMOTRON_H_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_NEMOTRON_H_KINDS = {"linear_attention": ("linear_attention", "none"), "full_attention": ("full_attention", "none")}
_NEMOTRON_H_KINDS["mlp"] = ("none", "plain")
_NEMOTRON_H_KINDS["moe"] = ("none", "moe")  # Nemotron 3's routed experts (NemotronHMoE)
# NemotronHConfig's older key names (its __post_init__ takes them in the place of the newer ones)
_NEMOTRON_H_ALIASES = {
    "n_groups": "mamba_n_groups",
    "conv_kernel": "mamba_d_conv",
    "expand": "mamba_expand",
    "time_step_min": "mamba_dt_min",
    "time_step_max": "mamba_dt_max",
    "time_step_limit": "mamba_dt_limit",
    "time_step_floor": "mamba_dt_init_floor",
    "use_conv_bias": "mamba_conv_bias",
    "chunk_size": "mamba_chunk_size",
}
# the routed experts' keys (NemotronHMoE's, read by no module of a model without "moe" blocks);
# n_shared_experts and moe_shared_expert_overlap are read by no module of transformers' (one shared
# expert of moe_shared_expert_intermediate_size, always)
_NEMOTRON_H_MOE_KEYS = (
    "n_routed_experts", "num_local_experts", "n_shared_experts", "moe_intermediate_size",
    "moe_shared_expert_intermediate_size", "moe_latent_size", "moe_shared_expert_overlap", "num_experts_per_tok",
    "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob",
)  # fmt: skip


def _nemotron_h_aliased(r: _Reader, key: str):
    """``key``'s value, its older name's where the config gives that (NemotronHConfig's
    ``__post_init__``: the older name wins); both marked read."""
    old = _NEMOTRON_H_ALIASES[key]
    if old in r.d:
        r.get(key)
        return old
    r.used.add(old)
    return key


def _nemotron_h_layers(r: _Reader) -> list:
    """The blocks' kinds: ``layers_block_type`` (or its alias ``layer_types``), else
    ``hybrid_override_pattern`` ("M" Mamba-2, "*" attention, "-" MLP, "E" experts), else
    NemotronHConfig's default; ``num_hidden_layers`` is ignored, as transformers does."""
    lt = r.get("layers_block_type") or r.get("layer_types")
    pattern = r.get("hybrid_override_pattern")
    if lt is None and pattern is not None:
        if not isinstance(pattern, str) or any(ch not in _NEMOTRON_H_PATTERN for ch in pattern) or not pattern:
            raise ValueError(
                f"config['hybrid_override_pattern']: expected a string of {sorted(_NEMOTRON_H_PATTERN)}, "
                f"got {_show(pattern)}"
            )
        lt = [_NEMOTRON_H_PATTERN[ch] for ch in pattern]
    if lt is None:
        lt = ["linear_attention", "moe", "full_attention", "mlp"]
    if not isinstance(lt, (list, tuple)) or not lt:
        raise ValueError(f"config['layers_block_type']: expected a non-empty list of block kinds, got {_show(lt)}")
    for t in lt:
        if t not in _NEMOTRON_H_KINDS:
            raise ValueError(
                f"config['layers_block_type']: {t!r} is not supported by npattn for model_type 'nemotron_h' "
                f"(supported: {sorted(_NEMOTRON_H_KINDS)})"
            )
    r.get("num_hidden_layers")  # transformers: the list's length, whatever this says
    return list(lt)


def _nemotron_h_moe(r: _Reader, hidden: int) -> MoEConfig:
    """Nemotron 3's routed-experts block (``NemotronHMoE``): the router ``NemotronHTopkRouter``
    (DeepSeek-V3's: sigmoid scores, the buffer ``e_score_correction_bias`` for the choice only,
    ``n_group`` / ``topk_group``, ``norm_topk_prob`` with ``sum + 1e-20``,
    ``routed_scaling_factor``), ``n_routed_experts`` (or its alias ``num_local_experts``) experts
    that are not gated (``NemotronHExperts``: ``down(act(up(x)))``, ``moe_intermediate_size``,
    ``mlp_hidden_act``), one shared expert ``NemotronHMLP`` of ``moe_shared_expert_intermediate_size``
    (biases ``mlp_bias``) on the block's input, added; with ``moe_latent_size`` the routed experts
    between ``fc1_latent_proj`` and ``fc2_latent_proj`` (biases ``mlp_bias``).  Keys under
    ``mixer.``: ``gate.weight``, ``gate.e_score_correction_bias``, ``experts.up_proj``,
    ``experts.down_proj``, ``shared_experts.up_proj`` / ``down_proj``, ``fc{1,2}_latent_proj``."""
    alias = r.d.get("num_local_experts") is not None  # NemotronHConfig.attribute_map: it sets n_routed_experts
    experts = r.int("num_local_experts" if alias else "n_routed_experts")
    latent = r.d.get("moe_latent_size")
    return MoEConfig(
        hidden,
        experts,
        r.int("num_experts_per_tok"),
        r.int("moe_intermediate_size"),
        router="sigmoid",
        norm_topk_prob=r.bool("norm_topk_prob", True),
        routed_scaling_factor=r.float("routed_scaling_factor", 1.0),
        n_group=r.int("n_group", 1),
        topk_group=r.int("topk_group", 1),
        experts="plain",
        hidden_act=_act(r, "mlp_hidden_act", "relu2"),
        shared_intermediate_size=r.int("moe_shared_expert_intermediate_size"),
        shared_name="shared_experts",
        experts_first=True,
        shared_bias=r.bool("mlp_bias"),
        latent_size=None if latent is None else r.int("moe_latent_size"),
        latent_bias=r.bool("mlp_bias"),
    )


def _nemotron_h(r: _Reader) -> dict:
    """NVIDIA Nemotron-H (NVIDIA-Nemotron-Nano-9B-v2/12B-v2, Nemotron-H-4B/8B/47B/56B;
    ``NemotronHForCausalLM``): blocks of one sublayer each, ``x + mixer(norm(x))``, their kinds
    ``layers_block_type`` (or ``hybrid_override_pattern``): a Mamba-2 mixer (layer kind
    ``"linear_attention"``, MLP kind ``"none"``), attention without RoPE or biases
    (``"full_attention"``, ``"none"``) or an MLP ``down_proj(relu2(up_proj(x)))`` (layer kind
    ``"none"``, MLP kind ``"plain"``; ``mlp_hidden_act``, ``mlp_bias``) or Nemotron 3's routed
    experts (``"moe"``: layer kind ``"none"``, MLP kind ``"moe"``, ``_nemotron_h_moe``).  The
    mixer: ``mamba_num_heads`` heads of
    ``mamba_head_dim``, ``n_groups`` groups of ``ssm_state_size``, ``conv_kernel`` taps,
    ``use_conv_bias``, ``use_bias`` (in_proj's and out_proj's), ``chunk_size``, its gated norm
    (the gate first, in groups) and every norm with ``layer_norm_epsilon``; its step clipped
    below at ``time_step_min`` (transformers' ``time_step_limit = (time_step_min, inf)``; the
    config's ``time_step_limit`` is read by nothing).  Older key names (``mamba_n_groups``,
    ``mamba_d_conv``, ``mamba_chunk_size``, ``mamba_dt_min`` ...) as NemotronHConfig takes them.
    ``tie_word_embeddings`` is read and ignored, as transformers does (the head is its own
    ``lm_head.weight``).  Checkpoint names: ``backbone.embeddings``, ``backbone.layers.{i}.norm``,
    ``backbone.layers.{i}.mixer.*``, ``backbone.norm_f``; the embedding has no padding row.
    Metadata: ``expand`` (the inner width is heads times head_dim), ``time_step_max``/``_floor``
    (initialisation), ``mamba_proj_bias`` (must be false), ``residual_in_fp32``, ``hidden_dropout``,
    ``rescale_prenorm_residual``, ``use_mamba_kernels``, ``mamba_ssm_cache_dtype``,
    ``num_logits_to_keep``, the multi-token-prediction layers' ``mtp_layers_block_type`` (their
    ``mtp.*`` tensors left unread), ``n_shared_experts`` and ``moe_shared_expert_overlap`` (read by no
    module of transformers': one shared expert, always) and, without "moe" blocks, the experts'
    keys.  ``tie_word_embeddings``: ``NemotronHForCausalLM._tied_weights_keys`` is empty, so
    transformers 5 ties nothing whatever the flag says (``lm_head.weight`` is its own, read from
    the checkpoint, saved beside the flag as given); npattn reads the same untied head, writes it
    and the flag as transformers does, and refuses by name a checkpoint without ``lm_head.weight``
    (where transformers would leave the head at its random initialisation)."""
    lt = _nemotron_h_layers(r)
    n = len(lt)
    r.d = {**r.d, "num_hidden_layers": n}
    c = _common(r)
    eps = r.float("layer_norm_epsilon", 1e-5)
    r.only("attention_bias", (False,), False, "transformers' Nemotron-H attention has no biases")
    r.only("sliding_window", (None,), None, "transformers' Nemotron-H attention attends over every key")
    r.only("mamba_proj_bias", (False,), False, "transformers' Nemotron-H mixer reads use_bias")
    if r.get("mamba_hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(
            f"config['mamba_hidden_act'] = {_show(r.get('mamba_hidden_act'))} is not supported by npattn for "
            "model_type 'nemotron_h' (supported: ['silu']): the mixer's convolution applies it"
        )
    for key in ("expand", "time_step_max", "time_step_floor", "time_step_limit"):
        r.get(_nemotron_h_aliased(r, key))
    for key in ("residual_in_fp32", "hidden_dropout", "rescale_prenorm_residual", "use_mamba_kernels"):
        r.get(key)
    for key in ("mamba_ssm_cache_dtype", "num_logits_to_keep", "mtp_layers_block_type", "mtp_hybrid_override_pattern"):
        r.get(key)
    moe = _nemotron_h_moe(r, c["hidden_size"]) if "moe" in lt else None
    for key in _NEMOTRON_H_MOE_KEYS:
        r.get(key)
    heads, head_dim = r.int("mamba_num_heads"), r.int("mamba_head_dim")
    groups = r.int(_nemotron_h_aliased(r, "n_groups"))
    if heads % groups:
        raise ValueError(f"config['n_groups']: expected a divisor of mamba_num_heads = {heads}, got {groups}")
    t_min = r.float(_nemotron_h_aliased(r, "time_step_min"), 0.001, positive=False)
    if t_min < 0:
        raise ValueError(f"config['time_step_min']: expected a number >= 0, got {t_min}")
    mamba = Mamba2Config(
        hidden_size=c["hidden_size"],
        num_heads=heads,
        head_dim=head_dim,
        state_size=r.int("ssm_state_size"),
        n_groups=groups,
        conv_kernel=r.int(_nemotron_h_aliased(r, "conv_kernel")),
        conv_bias=r.bool(_nemotron_h_aliased(r, "use_conv_bias"), True),
        proj_bias=r.bool("use_bias"),
        rms_norm_eps=eps,
        time_step_limit=(t_min, math.inf),
        chunk_size=r.int(_nemotron_h_aliased(r, "chunk_size")),
    )
    kinds = [_NEMOTRON_H_KINDS[t] for t in lt]
    c.update(
        rms_norm_eps=eps,
        pad_embedding_row=False,  # NemotronHModel's embedding has no padding row
        tie_word_embeddings=False,  # NemotronHForCausalLM ties nothing (_tied_weights_keys = {}), whatever it says
        intermediate_size=r.int("intermediate_size"),
        hidden_act=_act(r, "mlp_hidden_act", "relu2"),
        mlp_bias=r.bool("mlp_bias"),
        layer_types=tuple(k[0] for k in kinds),
        mlp_types=tuple(k[1] for k in kinds),
        moe=moe,
        rope={"default": {"rope_type": "default", "rope_theta": 10000.0}},
        rope_layers=(False,) * n,  # JambaAttention: no rotary embedding
        linear_attention=mamba,
        layer_names=_NEMOTRON_H_NAMES,
        final_norm_name="norm_f",
        embed_name="embeddings",
        # Nemotron 3's released checkpoints keep each expert apart: mixer.experts.{e}.{up,down}_proj.weight
        layout=CheckpointLayout(
            r.model_type,
            per_expert=moe is not None,
            expert_projs=(None, "up_proj", "down_proj"),
            renames=_NEMOTRON_H_RENAMES,
            mtp=("mtp.",),
        ),
    )
    return c


# (the model's part, the checkpoint's part): the released checkpoints' backbone.* (transformers' own
# model.*, as the model names it, is read too)
_NEMOTRON_H_RENAMES = (("model.", "backbone."),)


# Mamba-2's blocks: the norm and the mixer (Nemotron-H's names, its Mamba-2 blocks')
_MAMBA2_NAMES = (("input_layernorm", "norm"), ("mamba", "mixer"))
# the attention keys _common reads, which a Mamba2Config has not (the reader gives them for _common)
_MAMBA2_NO_ATTENTION = ("num_attention_heads", "num_key_value_heads", "rms_norm_eps", "attention_dropout")


def _mamba2_lm(r: _Reader) -> dict:
    """Mamba-2 (``Mamba2ForCausalLM``: Mamba-Codestral-7B, state-spaces/mamba2-130m to 2.7b in
    transformers' format): every block ``x + mixer(norm(x))``, a Mamba-2 mixer (layer kind
    ``"linear_attention"``, MLP kind ``"none"``: Nemotron-H's Mamba-2 block), ``num_heads`` heads of
    ``head_dim`` (their product must be ``expand * hidden_size``, as Mamba2Config checks),
    ``n_groups`` groups of ``state_size``, ``conv_kernel`` taps, ``use_conv_bias``, ``use_bias``
    (in_proj's and out_proj's), ``chunk_size``, ``time_step_limit`` (the step's clip), the gated
    norm (the gate first, in groups) and every norm with ``layer_norm_epsilon``; the convolution's
    activation ``hidden_act`` (SiLU only).  The head is tied to the embedding where
    ``tie_word_embeddings`` (``Mamba2ForCausalLM._tied_weights_keys``).  Checkpoint names:
    ``backbone.embeddings``, ``backbone.layers.{i}.norm``, ``backbone.layers.{i}.mixer.*``,
    ``backbone.norm_f``, ``lm_head`` (the embedding's older name ``backbone.embedding`` read too, as
    ``Mamba2Model.load_hook`` does); the embedding has no padding row.  Metadata:
    ``time_step_rank`` (read by no module), ``time_step_min``/``_max``/``_floor`` and
    ``rescale_prenorm_residual``, ``time_step_init_scheme``, ``time_step_scale`` (the
    initialisation), ``residual_in_fp32`` (the residual's precision: npattn's is the model's dtype,
    float64 or float32, never lower); transformers 4.44's ``rms_norm`` and ``norm_before_gate``,
    which no mixer of transformers reads, must say what the mixer does (true, false).  The
    state-spaces/mamba2-* repositories' own config.json (mamba_ssm's ``d_model``, ``n_layer``,
    ``ssm_cfg``, no ``model_type``) is not transformers': their converted copies are read."""
    heads, head_dim = r.int("num_heads"), r.int("head_dim")
    eps = r.float("layer_norm_epsilon", 1e-5)
    d = r.d
    r.d = {**d, "num_attention_heads": heads, "head_dim": head_dim, "rms_norm_eps": eps}
    c = _common(r)
    r.d = d
    r.used.difference_update(_MAMBA2_NO_ATTENTION)  # a Mamba2Config with one of them: refused by name (finish)
    n, hidden = c["num_hidden_layers"], c["hidden_size"]
    expand = r.int("expand")
    if heads * head_dim != expand * hidden:
        raise ValueError(
            f"config['head_dim']: expected expand * hidden_size / num_heads = {expand * hidden / heads:g} "
            f"(num_heads * head_dim must equal expand * hidden_size = {expand * hidden}), got {head_dim}"
        )
    c["hidden_act"] = _act(r, "hidden_act", "silu")
    for key in ("time_step_rank", "time_step_min", "time_step_max", "time_step_floor"):
        r.get(key)
    r.bool("rescale_prenorm_residual"), r.bool("residual_in_fp32", True)
    r.get("time_step_init_scheme"), r.get("time_step_scale")  # transformers 4.44's initialisation keys
    # transformers 4.44's Mamba2Config options that its mixer (and transformers 5's) never read
    r.only("rms_norm", (True,), True, "transformers' Mamba-2 mixer always applies its gated RMSNorm")
    r.only("norm_before_gate", (False,), False, "transformers' Mamba-2 mixer gates before its grouped RMSNorm")
    c.update(
        linear_attention=_mamba2(r, c, heads * head_dim, "num_heads * head_dim", keys=_MAMBA2_KEYS),
        pad_embedding_row=False,  # Mamba2Model's embedding has no padding row
        layer_types=("linear_attention",) * n,
        mlp_types=("none",) * n,
        intermediate_size=1,  # no MLP
        rope={"default": {"rope_type": "default", "rope_theta": 10000.0}},
        rope_layers=(False,) * n,
        layer_names=_MAMBA2_NAMES,
        final_norm_name="norm_f",
        embed_name="embeddings",
        layout=CheckpointLayout(r.model_type, renames=_MAMBA2_RENAMES),
    )
    return c


# Nemotron-H's backbone.*, and the embedding's older name backbone.embedding (Mamba2Model.load_hook's,
# read, never written: after the first rename, as a checkpoint's key has become model.embedding)
_MAMBA2_RENAMES = (*_NEMOTRON_H_RENAMES, ("model.embeddings.", "model.embedding."))


def _granite_attention(r: _Reader, n: int) -> dict:
    """The attention layers (and the activation) of Granite MoE, GraniteMoeShared and Granite 4.0:
    Llama's (``attention_bias`` on the four projections, RoPE) with Granite's four numbers."""
    return dict(
        hidden_act=_act(r, "hidden_act", "silu"),
        attention_bias=r.bool("attention_bias"),
        rope=_rope_params(r, 10000.0),
        layer_types=("full_attention",) * n,
        **_granite_scalars(r),
    )


def _granite_experts(r: _Reader, n: int, *, shared: bool) -> dict:
    """Every layer's routed experts under ``block_sparse_moe`` (``num_local_experts`` of width
    ``intermediate_size``, the top ``num_experts_per_tok``), with the shared MLP where ``shared``
    (``shared_intermediate_size``; ``shared_mlp``), in the released checkpoints' layout."""
    experts, top_k = r.int("num_local_experts"), r.int("num_experts_per_tok")
    if top_k > experts:
        raise ValueError(f"config['num_experts_per_tok']: expected at most num_local_experts={experts}, got {top_k}")
    names: tuple = (("mlp", "block_sparse_moe"),)
    layout = CheckpointLayout(r.model_type, renames=_GRANITEMOE_RENAMES)
    if shared:
        names = _GRANITE_SHARED_NAMES + names
        layout = dataclasses.replace(layout, fused=_GRANITE_SHARED_FUSED)
    return dict(
        intermediate_size=r.int("intermediate_size"),
        mlp_types=("moe",) * n,
        moe=moe_config(r.d),
        layer_names=names,
        layout=layout,
    )


# (the model's part, the released checkpoints' part): transformers' conversion_mapping for granitemoe
_GRANITEMOE_RENAMES = (
    (".block_sparse_moe.router.weight", ".block_sparse_moe.router.layer.weight"),
    (".block_sparse_moe.experts.gate_up_proj", ".block_sparse_moe.input_linear.weight"),
    (".block_sparse_moe.experts.down_proj", ".block_sparse_moe.output_linear.weight"),
)
# GraniteMoeShared's and Granite 4.0's shared MLP (transformers' GraniteMoeSharedMLP): SparseMoeBlock's
# shared expert beside the experts, or the dense layer's MLP; input_linear stacks gate and up
_GRANITE_SHARED_NAMES = (
    ("mlp.shared_expert.down_proj", "shared_mlp.output_linear"),
    ("mlp.shared_expert", "shared_mlp"),
)
_GRANITE_DENSE_NAMES = (("mlp.down_proj", "shared_mlp.output_linear"), ("mlp", "shared_mlp"))
_GRANITE_SHARED_FUSED = (("shared_mlp.input_linear", ("shared_mlp.gate_proj", "shared_mlp.up_proj")),)


def _qwen3_moe(r: _Reader) -> dict:
    """Qwen3-MoE: Qwen3's attention (QK-norm) and routed experts (softmax, top-k, renormalised
    when ``norm_topk_prob``, no shared expert) on every ``decoder_sparse_step``-th layer not in
    ``mlp_only_layers`` (those keep Qwen3's gated MLP of ``intermediate_size``).  With
    ``use_sliding_window`` every layer attends through ``sliding_window`` (transformers' Qwen3-MoE
    has no ``max_window_layers``: the key is read and changes nothing)."""
    c = _common(r)
    n = c["num_hidden_layers"]
    r.get("max_window_layers")
    sliding = r.bool("use_sliding_window") and r.get("sliding_window") is not None
    r.get("sliding_window")
    lt = ("sliding_attention" if sliding else "full_attention",) * n
    mlp_types = _sparse_step(r, n)
    # transformers' attribute_map lets the config say num_experts or num_local_experts (to_dict's)
    experts = {k: r.int(k) for k in ("num_experts", "num_local_experts") if r.has(k)}
    if len(set(experts.values())) > 1:
        raise ValueError(f"config: num_experts and num_local_experts differ ({experts})")
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        r.int(key)
    r.bool("norm_topk_prob")
    r.bool("output_router_logits")
    r.float("router_aux_loss_coef", positive=False)
    c.update(
        _mlp_and_bias(r),
        qk_norm=True,
        rope=_rope_params(r, 10000.0),
        layer_types=lt,
        sliding_window=r.int("sliding_window") if sliding else None,
        mlp_types=mlp_types,
        moe=moe_config({**r.d, "num_experts": next(iter(experts.values()), 128)}) if "moe" in mlp_types else None,
        layout=CheckpointLayout(r.model_type, per_expert=True),
    )
    return c


def _gemma_layer(r: _Reader) -> dict:
    """What Gemma 2's and 3's layers share: the gated GELU MLP, ``1 + w`` norms around both
    sublayers, the embedding times ``sqrt(hidden)``, scores scaled by ``query_pre_attn_scalar``,
    the final logits' softcap."""
    return dict(
        _mlp_and_bias(r, "hidden_activation", "gelu_pytorch_tanh"),
        norm_offset=True,
        sandwich_norm=True,
        embed_scale=True,
        attention_scale=r.float("query_pre_attn_scalar", 256) ** -0.5,
        final_logit_softcapping=r.float("final_logit_softcapping"),
    )


def _gemma3(r: _Reader) -> dict:
    c = _common(r)
    n = c["num_hidden_layers"]
    r.only("use_bidirectional_attention", (False,), False, "npattn's CausalLM is causal")
    # transformers' Gemma 3 attention never applies attn_logit_softcapping (Gemma 2's did): checked, unused
    r.float("attn_logit_softcapping")
    pattern = r.int("sliding_window_pattern", 6)
    default = _interleaved(n, pattern, "sliding_attention")
    lt = _layer_types(r, n, _GEMMA_TYPES, default)
    c.update(
        _gemma_layer(r),
        qk_norm=True,
        rope=_gemma_rope_params(r),
        **_dense_layers(r, lt),
    )
    return c


def _gemma2(r: _Reader) -> dict:
    """Gemma 2: Gemma 3's layer (``1 + w`` norms around both sublayers, the embedding times
    ``sqrt(hidden)``, scores scaled by ``query_pre_attn_scalar``) without QK-norm, with
    ``attn_logit_softcapping`` on the scores (``c tanh(s / c)``, ``Gemma2Attention``'s) and one RoPE
    for every layer; sliding and full layers alternate, the first sliding."""
    c = _common(r)
    n = c["num_hidden_layers"]
    r.only("use_bidirectional_attention", (None, False), None, "npattn's CausalLM is causal")
    lt = _layer_types(r, n, _GEMMA_TYPES, _interleaved(n, 2, "sliding_attention"))
    c.update(
        _gemma_layer(r),
        attn_logit_softcapping=r.float("attn_logit_softcapping"),
        rope=_rope_params(r, 10000.0),
        **_dense_layers(r, lt),
    )
    return c


def _gpt_oss(r: _Reader) -> dict:
    c = _common(r)
    n = c["num_hidden_layers"]
    default = _interleaved(n, 2, "sliding_attention")
    lt = _layer_types(r, n, ("full_attention", "sliding_attention"), default)
    hidden_act = r.only("hidden_act", ("silu",), "silu", "GPT-OSS's experts use their own clamped SwiGLU")
    k = r.int("num_experts_per_tok")
    # OpenAI's checkpoints also carry experts_per_token (the same number) and initial_context_length
    # (YaRN's original length, which rope_scaling states again); transformers reads neither
    r.only("experts_per_token", (None, k), None, "it must equal num_experts_per_tok")
    r.get("initial_context_length")
    c.update(
        intermediate_size=r.int("intermediate_size"),
        attention_bias=r.bool("attention_bias", True),
        sinks=True,
        hidden_act=hidden_act,
        rope=_rope_params(r, 150000.0, _GPT_OSS_ROPE),
        layer_types=lt,
        sliding_window=_window(r, lt),
        mlp_types=("moe",) * n,
    )
    r.int("num_local_experts")
    r.float("swiglu_limit", 7.0)
    r.float("swiglu_alpha", 1.702)
    c.update(moe=moe_config(r.d))  # the block's arguments (keys checked above), as from_hf_config reads them
    return c


def _deepseek_v3(r: _Reader) -> dict:
    c = _common(r)
    n = c["num_hidden_layers"]
    k_dense = r.int("first_k_dense_replace", 0, minimum=0)
    # DeepSeek's own config keys: the routing transformers implements (sigmoid scores, the
    # auxiliary-loss-free correction bias, every layer after the dense ones routed) ...
    r.only("scoring_func", ("sigmoid",), "sigmoid")
    r.only("topk_method", ("noaux_tc",), "noaux_tc")
    r.only("moe_layer_freq", (1,), 1)
    for key in ("aux_loss_alpha", "seq_aux", "ep_size"):  # ... and training / parallelism settings
        r.get(key)
    r.get("qk_head_dim")  # derived: qk_nope_head_dim + qk_rope_head_dim
    q_lora = r.get("q_lora_rank")
    # the multi-token-prediction layers after the model's: transformers' default 1 (DeepseekV3Config;
    # DeepseekV32Config writes it num_mtp_layers), as the released checkpoints have
    n_mtp = r.int("num_mtp_layers" if r.has("num_mtp_layers") else "num_nextn_predict_layers", 1, minimum=0)
    mtp = tuple(f"model.layers.{n + i}." for i in range(n_mtp))
    c.update(
        _mlp_and_bias(r),
        rope=_rope_params(r, 10000.0),
        layer_types=("latent_attention",) * n,
        mlp_types=tuple("dense" if i < k_dense else "moe" for i in range(n)),
        layout=CheckpointLayout(r.model_type, per_expert=True, mtp=mtp),
    )
    if q_lora is not None:
        r.int("q_lora_rank")
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        r.int(key)
    r.bool("rope_interleave", True)
    r.int("n_routed_experts")
    r.int("n_shared_experts", 0, minimum=0)
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        r.int(key)
    r.int("n_group", 1)
    r.int("topk_group", 1)
    r.float("routed_scaling_factor", 1.0)
    r.bool("norm_topk_prob", True)
    # the head_dim key of DeepSeek-V3's config is qk_rope_head_dim (the rotary part); transformers
    # rotates head_dim features, so another value makes a model that cannot run
    dr = r.int("qk_rope_head_dim")
    if r.d.get("head_dim") not in (None, dr):
        raise ValueError(
            f"config['head_dim'] = {r.d['head_dim']!r}: DeepSeek-V3 expects head_dim = qk_rope_head_dim = {dr}"
        )
    c["head_dim"] = dr
    # the modules' arguments (the keys checked above), as from_config / from_hf_config read them;
    # MLA's rotation is the one standardized above
    rope = dict(r.d, rope_parameters=c["rope"]["default"], rope_scaling=None)
    c.update(latent=latent_config(rope), moe=moe_config(r.d) if "moe" in c["mlp_types"] else None)
    return c


def _mlp_layer_types(r: _Reader, n: int, default: list) -> tuple:
    """``mlp_layer_types`` (``"dense"`` or ``"sparse"`` per layer; ``default`` when absent) as
    ``CausalLMConfig.mlp_types`` (``"dense"`` / ``"moe"``)."""
    mlp = r.get("mlp_layer_types") or default
    if len(mlp) != n or any(t not in ("dense", "sparse") for t in mlp):
        raise ValueError(f"config['mlp_layer_types']: expected {n} entries of 'dense' or 'sparse', got {_show(mlp)}")
    return tuple("moe" if t == "sparse" else "dense" for t in mlp)


def _deepseek_v32(r: _Reader) -> dict:
    """DeepSeek-V3.2: DeepSeek-V3's model (``_deepseek_v3``: MLA, dense then routed MLPs, its
    checkpoint names) whose every attention layer is sparse: a lightning indexer (``index_n_heads``
    heads of ``index_head_dim`` features) chooses each query's ``index_topk`` keys
    (``LatentConfig.index_topk``; ``layer_types`` all ``"indexed_attention"``, as transformers'
    config says).  ``mlp_layer_types`` (``"dense"``/``"sparse"``) takes the place of
    ``first_k_dense_replace`` when given; transformers' MLPs have no bias whatever ``mlp_bias`` says,
    and its attention always rotates interleaved pairs."""
    r.only("rope_interleave", (True,), True, "DeepseekV32Attention always rotates interleaved pairs")
    r.get("mlp_bias")  # DeepseekV32MLP builds its projections without bias whatever it says
    c = _deepseek_v3(r)
    n = c["num_hidden_layers"]
    _layer_types(r, n, ("indexed_attention",), ["indexed_attention"] * n)
    default = ["sparse" if t == "moe" else "dense" for t in c["mlp_types"]]  # from first_k_dense_replace
    c["mlp_types"] = _mlp_layer_types(r, n, default)
    r.int("q_lora_rank")  # transformers' sparse attention has no full-rank query path
    index = {key: r.int(key) for key in ("index_topk", "index_n_heads", "index_head_dim")}
    if index["index_head_dim"] < c["head_dim"]:
        raise ValueError(
            f"config['index_head_dim']: expected at least qk_rope_head_dim={c['head_dim']} (its rotated part), "
            f"got {index['index_head_dim']}"
        )
    c.update(
        latent=dataclasses.replace(c["latent"], **index),
        moe=moe_config(r.d) if "moe" in c["mlp_types"] else None,
    )
    return c


def _qwen3_next(r: _Reader) -> dict:
    c = _common(r)
    n = c["num_hidden_layers"]
    interval = r.int("full_attention_interval", 4)
    for key in ("use_sliding_window", "sliding_window", "max_window_layers"):  # Qwen's configs carry them;
        r.get(key)  # transformers' Qwen3-Next has no sliding window and ignores them
    default = _interleaved(n, interval, "linear_attention")
    lt = _layer_types(r, n, ("full_attention", "linear_attention"), default)
    step = r.int("decoder_sparse_step", 1)
    only = set(r.get("mlp_only_layers", []) or [])
    n_exp = r.int("num_experts")
    mlp = tuple("moe" if i not in only and n_exp > 0 and (i + 1) % step == 0 else "dense" for i in range(n))
    c.update(
        _mlp_and_bias(r),
        qk_norm=True,
        norm_offset=True,
        attn_output_gate=True,
        rope=_rope_params(r, 10000.0, partial=True),
        layer_types=lt,
        mlp_types=mlp,
        layout=CheckpointLayout(r.model_type, per_expert=True, mtp=("mtp.",)),
    )
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        r.int(key)
    r.int("shared_expert_intermediate_size", 0, minimum=0)
    r.bool("norm_topk_prob", True)
    for key in ("conv_kernel_dim", "key_head_dim", "value_head_dim", "num_key_heads", "num_value_heads"):
        r.int("linear_" + key)
    # the modules' arguments (the keys checked above), as from_hf_config / from_config read them
    c.update(
        moe=moe_config(r.d) if "moe" in mlp else None,
        linear_attention=delta_net_config(r.d) if "linear_attention" in lt else None,
    )
    return c


def _text_mrope(r: _Reader) -> None:
    """Qwen3.5's ``rope_parameters`` carry ``mrope_section`` and ``mrope_interleaved`` (how the
    rotary features are split between the temporal, height and width positions of images and
    video).  For text the three positions are each the token's own (transformers' text model
    expands its position ids to all three), so the rotation is plain RoPE whatever the split: the
    two keys are checked and set aside."""
    rp = _rope_mapping(r, "rope_parameters")
    if rp is None or not ({"mrope_section", "mrope_interleaved"} & set(rp)):
        return
    rp = dict(rp)
    sec, inter = rp.pop("mrope_section", None), rp.pop("mrope_interleaved", None)
    if sec is not None and not (
        isinstance(sec, (list, tuple))
        and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and int(v) >= 0 for v in sec)
    ):
        raise ValueError(f"config['rope_parameters']['mrope_section']: expected a list of integers, got {_show(sec)}")
    if inter is not None and not isinstance(inter, bool):
        raise ValueError(f"config['rope_parameters']['mrope_interleaved']: expected true or false, got {_show(inter)}")
    r.d = dict(r.d, rope_parameters=rp)


def _qwen3_5(r: _Reader) -> dict:
    """Qwen3.5, dense (``qwen3_5_text``) and MoE (``qwen3_5_moe_text``): Qwen3-Next's layers (gated
    DeltaNet and gated full attention, 3:1 by default, partial RoPE, ``1 + w`` norms) with the
    DeltaNet's four input projections (``delta_net_config``) and mRoPE that is plain RoPE for text
    (``_text_mrope``); the MoE variant routes every layer (softmax, top-k, always renormalised, a
    gated shared expert), the dense one has a gated MLP on every layer."""
    _text_mrope(r)
    c = _common(r)
    n = c["num_hidden_layers"]
    interval = r.int("full_attention_interval", 4)
    lt = _layer_types(r, n, ("full_attention", "linear_attention"), _interleaved(n, interval, "linear_attention"))
    moe = r.model_type == "qwen3_5_moe_text"
    c.update(
        # the MoE variant has no dense MLP: intermediate_size is unused there (the experts' width)
        intermediate_size=r.int("moe_intermediate_size" if moe else "intermediate_size"),
        hidden_act=_act(r, "hidden_act", "silu"),
        attention_bias=r.bool("attention_bias"),
        qk_norm=True,
        norm_offset=True,
        attn_output_gate=True,
        rope=_rope_params(r, 10000.0, partial=True),
        layer_types=lt,
        mlp_types=("moe" if moe else "dense",) * n,
        layout=CheckpointLayout(r.model_type, per_expert=moe, mtp=("mtp.",)),
    )
    for key in ("conv_kernel_dim", "key_head_dim", "value_head_dim", "num_key_heads", "num_value_heads"):
        r.int("linear_" + key)
    if moe:
        r.get("intermediate_size")  # transformers' MoE text model has no dense MLP and ignores it
        for key in ("num_experts", "num_experts_per_tok"):
            r.int(key)
        r.int("shared_expert_intermediate_size", 0, minimum=0)
    c.update(
        moe=moe_config(r.d) if moe else None,
        linear_attention=delta_net_config(r.d) if "linear_attention" in lt else None,
    )
    return c


def _kimi_linear(r: _Reader) -> dict:
    """Kimi Linear: KDA layers (``KimiDeltaAttention``) and MLA layers without RoPE, a dense MLP
    in the first ``first_k_dense_replace`` layers and DeepSeek-V3's routed experts after them.
    ``linear_attn_config`` lists the layers of each kind 1-indexed (``kda_layers``,
    ``full_attn_layers``), as transformers reads it; its fields (and the aliases transformers'
    ``attribute_map`` gives the MoE keys) are read by ``kda_config`` and the MoE reader."""
    c = _common(r)
    n = c["num_hidden_layers"]
    lac = r.get("linear_attn_config", {})
    if not isinstance(lac, Mapping):
        raise ValueError(f"config['linear_attn_config']: expected a dict, got {_show(lac)}")
    left = sorted(set(lac) - {"num_heads", "head_dim", "short_conv_kernel_size", "kda_layers", "full_attn_layers"})
    if left:
        raise ValueError(f"config['linear_attn_config']: key {left[0]!r} is not supported by npattn for kimi_linear")
    if r.has("layer_types") or not ("kda_layers" in lac and "full_attn_layers" in lac):
        default = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    else:
        given: list = [None] * n
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for i in lac[key]:
                if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 1 <= int(i) <= n:
                    raise ValueError(f"config['linear_attn_config'][{key!r}]: expected layers 1..{n}, got {_show(i)}")
                given[int(i) - 1] = kind  # 1-indexed, as transformers reads them
        if None in given:
            raise ValueError(f"config['linear_attn_config']: layer {given.index(None) + 1} is in no list")
        default = given
    lt = _layer_types(r, n, ("full_attention", "linear_attention"), default)
    k_dense = r.int("first_k_dense_replace", 1, minimum=0)
    moe = _mlp_layer_types(r, n, ["dense" if i < k_dense else "sparse" for i in range(n)])
    for key in ("model_max_length", "qk_head_dim", "head_dim", "q_lora_rank"):  # derived or read below
        r.get(key)
    for key in ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim"):
        r.int(key, 1)
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_intermediate_size"):
        r.int(key)
    for group in _KIMI_MOE_KEYS:  # each key under either of its names (transformers' attribute_map)
        for key in group:
            r.get(key)
    r.float("routed_scaling_factor", 1.0)
    c.update(
        _mlp_and_bias(r),
        layer_types=tuple("latent_attention" if t == "full_attention" else t for t in lt),
        mlp_types=moe,
        head_dim=r.int("qk_rope_head_dim"),
        layout=CheckpointLayout(
            r.model_type, per_expert=True, expert_projs=("w1", "w3", "w2"), renames=_KIMI_RENAMES, split_conv=True
        ),
    )
    c.update(
        latent=dataclasses.replace(latent_config(r.d), rope=False) if "full_attention" in lt else None,
        moe=moe_config(r.d) if "moe" in moe else None,
        linear_attention=kda_config(r.d) if "linear_attention" in lt else None,
    )
    return c


# Kimi Linear's checkpoint names (transformers' conversion_mapping): (model's part, checkpoint's part)
_KIMI_RENAMES = (
    (".mlp.", ".block_sparse_moe."),
    ("self_attn.forget_gate.f_a_proj.", "self_attn.f_a_proj."),
    ("self_attn.forget_gate.f_b_proj.", "self_attn.f_b_proj."),
    ("self_attn.forget_gate.dt_bias", "self_attn.dt_bias"),
    ("self_attn.forget_gate.A_log", "self_attn.A_log"),
)

# Kimi Linear's MoE keys: transformers' attribute_map lets a config say either name
_KIMI_MOE_KEYS = (
    ("num_experts", "num_local_experts"),
    ("num_experts_per_token", "num_experts_per_tok"),
    ("num_shared_experts", "n_shared_experts"),
    ("num_expert_group", "n_group"),
    ("topk_group",),
    ("moe_renormalize", "norm_topk_prob"),
)


# OLMo 2's and 3's layers: post-norm (each sublayer's output normalised, then added; no norm
# before attention or the MLP), q/k RMSNorm over the whole projection
_OLMO_LAYER = dict(qk_norm=True, qk_norm_scope="all_heads", pre_norm=False, sandwich_norm=True)


def _olmo2(r: _Reader) -> dict:
    """OLMo 2: OLMo 3's post-norm layers (each sublayer's output normalised, then added) and q/k
    RMSNorm over the whole projection, every layer full, one RoPE."""
    c = _common(r)
    c.update(
        _mlp_and_bias(r),
        **_OLMO_LAYER,
        rope=_rope_params(r, 10000.0),
        **_dense_layers(r, ("full_attention",) * c["num_hidden_layers"]),
    )
    return c


def _exaone4_layer_types(r: _Reader, n: int, window) -> tuple:
    """EXAONE 4.0's ``layer_types``, or, left out, as ``Exaone4Config`` makes them from the integer
    ``sliding_window_pattern`` (every pattern-th layer, the last of each run, full; the others
    sliding).  transformers cannot make them from a null ``sliding_window`` (it sets the pattern to
    0 and divides by it) or from a string pattern such as ``"LLLG"`` (it divides by the string):
    both are refused by name.  Given, ``layer_types`` are what transformers reads, the pattern beside
    them nothing (EXAONE-4.0-32B's config.json says ``"LLLG"`` beside its list)."""
    pattern = r.get("sliding_window_pattern")
    if r.has("layer_types"):
        return _layer_types(r, n, _GEMMA_TYPES, [])
    if window is None:
        raise ValueError(
            "config['layer_types']: needed where sliding_window is null (Exaone4Config then sets "
            "sliding_window_pattern to 0 and cannot derive the layer types from it)"
        )
    if isinstance(pattern, str):
        raise ValueError(
            f"config['sliding_window_pattern'] = {_show(pattern)}: transformers derives layer_types from an "
            "integer pattern only; give layer_types beside a string pattern"
        )
    return tuple(_interleaved(n, r.int("sliding_window_pattern"), "sliding_attention"))


def _exaone4(r: _Reader) -> dict:
    """EXAONE 4.0 (LG AI Research's EXAONE-4.0-1.2B and -32B, ``Exaone4ForCausalLM``): OLMo 2's
    post-norm layers (each sublayer's output normalised, then added: ``post_attention_layernorm``,
    ``post_feedforward_layernorm``, no norm before a sublayer) with Qwen3's per-head QK-norm before
    RoPE, no biases, sliding-window and full layers (``layer_types``, or every
    ``sliding_window_pattern``-th layer full: ``_exaone4_layer_types``).  Which layers rotate
    (``Exaone4Attention``: "global NoPE for hybrid attention"): with a ``sliding_window`` (not
    null) only the sliding layers, the full ones attend without RoPE (``CausalLMConfig.rope_layers``;
    the 32B's every fourth layer); with a null ``sliding_window`` every layer (the 1.2B's, all full).
    RoPE is Llama's, its scaling included (the releases' ``llama3``, factor 16)."""
    c = _common(r)
    n = c["num_hidden_layers"]
    window = r.get("sliding_window")
    lt = _exaone4_layer_types(r, n, window)
    c.update(
        intermediate_size=r.int("intermediate_size"),
        hidden_act=_act(r, "hidden_act", "silu"),
        qk_norm=True,
        pre_norm=False,
        sandwich_norm=True,
        rope=_rope_params(r, 10000.0),
        rope_layers=None if window is None else tuple(t == "sliding_attention" for t in lt),
        **_dense_layers(r, lt),
    )
    return c


def _olmoe(r: _Reader) -> dict:
    """OLMoE (OLMoE-1B-7B): Llama's pre-norm layers (biases on q, k, v and o with
    ``attention_bias``) with OLMo's q/k RMSNorm over the whole projection before RoPE, and on every
    layer routed experts of ``intermediate_size`` (softmax over ``num_experts``, the top
    ``num_experts_per_tok`` renormalised only with ``norm_topk_prob``, false by default), no shared
    expert.  ``clip_qkv`` (null: none): q, k and v clamped to +-clip_qkv after the projections and
    the q/k norms, before RoPE (``qkv_clip``); a number > 0.  A ``head_dim`` other than
    ``hidden_size / num_attention_heads`` is refused (OlmoeAttention's norms are that wide
    whatever the heads are)."""
    c = _common(r)
    n, hidden, heads = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"]
    c["qkv_clip"] = r.float("clip_qkv")
    if c["head_dim"] != hidden // heads:
        raise ValueError(
            f"config['head_dim'] = {c['head_dim']}: OLMoE expects hidden_size / num_attention_heads = "
            f"{hidden // heads} (its q/k norms are that wide)"
        )
    # transformers' attribute_map lets the config say num_experts or num_local_experts
    experts = {k: r.int(k) for k in ("num_experts", "num_local_experts") if r.has(k)}
    if len(set(experts.values())) > 1:
        raise ValueError(f"config: num_experts and num_local_experts differ ({experts})")
    r.int("num_experts_per_tok")
    r.bool("norm_topk_prob")
    c.update(
        _mlp_and_bias(r),
        qk_norm=True,
        qk_norm_scope="all_heads",
        rope=_rope_params(r, 10000.0),
        layer_types=("full_attention",) * n,
        mlp_types=("moe",) * n,
        moe=moe_config({**r.d, "num_experts": next(iter(experts.values()), 64)}),
        layout=CheckpointLayout(r.model_type, per_expert=True),
    )
    return c


# Phi-3's checkpoints (and transformers' Phi3Attention / Phi3MLP) stack q, k, v and gate, up
_PHI3_FUSED = (
    ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
)


def _phi3_rope(r: _Reader, head_dim: int) -> dict:
    """Phi-3's RoPE dict as ``Phi3Config.convert_rope_params_to_dict`` reads it: ``rope_scaling``
    (when non-empty) or ``rope_parameters``; the older types ``"su"`` and ``"yarn"`` are
    ``"longrope"``; for ``longrope`` and ``yarn`` the config's top-level
    ``original_max_position_embeddings`` (a field of Phi3Config, 4096 when absent) takes the place
    of the dict's own (``standardize_rope_params``: Phi-3's exception), for ``su`` the dict's own
    (which it must have) stays."""
    rp = _rope_mapping(r, "rope_parameters")
    scaling = _rope_mapping(r, "rope_scaling")
    key = "rope_scaling" if scaling else "rope_parameters"
    chosen = {k: v for k, v in dict(scaling or rp or {}).items() if v is not None}
    kind = chosen.get("rope_type", chosen.get("type"))
    original = r.int("original_max_position_embeddings")
    if kind in ("longrope", "yarn"):  # standardize_rope_params: Phi3Config's own field wins
        chosen["original_max_position_embeddings"] = original
    elif kind == "su" and "original_max_position_embeddings" not in chosen:
        raise ValueError(
            f"config[{key!r}]: rope type 'su' needs its own 'original_max_position_embeddings' (transformers 5 "
            "takes the top-level one for 'longrope' and 'yarn' only, and refuses the dict without it)"
        )
    if kind in ("su", "yarn"):
        chosen.pop("type", None)
        chosen["rope_type"] = "longrope"
    theta = r.get("rope_theta")
    params = _standardize(
        chosen,
        f"config[{key!r}]",
        rope_theta=10000.0 if theta is None else theta,
        partial_rotary_factor=r.get("partial_rotary_factor"),
        max_position_embeddings=_max_positions(r),
    )
    if params["rope_type"] not in ("default", "longrope"):
        raise ValueError(
            f"config[{key!r}]['rope_type']: Phi-3 reads 'default' or 'longrope' ('su' and 'yarn' mean "
            f"'longrope'), got {params['rope_type']!r}"
        )
    pairs = int(head_dim * params.get("partial_rotary_factor", 1.0)) // 2
    for k in ("short_factor", "long_factor"):
        if k in params and len(params[k]) != pairs:
            raise ValueError(
                f"config[{key!r}][{k!r}]: expected {pairs} numbers (one per rotated pair: head_dim {head_dim} times "
                f"partial_rotary_factor, halved), got {len(params[k])}"
            )
    return {"default": params}


def _phi3(r: _Reader) -> dict:
    """Phi-3, Phi-3.5 and Phi-4-mini (``Phi3ForCausalLM``): Llama's layers without biases, the
    checkpoint's fused ``qkv_proj`` and ``gate_up_proj`` (``_PHI3_FUSED``), partial rotary
    (``partial_rotary_factor``), LongRoPE, a window of ``sliding_window`` keys on every layer where
    it is set (``Phi3Model`` masks with ``create_sliding_window_causal_mask`` then: Phi-3-mini's
    2047), a tied head where ``tie_word_embeddings`` (Phi-4-mini).  ``resid_pdrop`` (dropout on each
    sublayer's output, training only) must be 0; ``embd_pdrop`` is read by no module of
    transformers' Phi-3 (metadata)."""
    c = _common(r)
    r.only("resid_pdrop", (0, 0.0), 0.0, "npattn has no dropout on the residual branches")
    r.float("embd_pdrop", 0.0, positive=False)  # Phi3Model has no embedding dropout
    r.only("attention_bias", (False,), False, "Phi3Attention's projections have no biases")
    r.only("mlp_bias", (False,), False, "Phi3MLP's projections have no biases")
    # Phi-4-mini's config.json carries three keys of its remote code that transformers' Phi-3
    # reads nowhere: their released values only (any other would mean what transformers ignores)
    r.only("lm_head_bias", (False,), False, "Phi3ForCausalLM's head has no bias")
    r.only("full_attn_mod", (1,), 1, "transformers' Phi-3 ignores it; 1 (Phi-4-mini's) is every layer as here")
    r.only("interpolate_factor", (1, 1.0), 1, "transformers' Phi-3 ignores it; 1 is Phi-4-mini's")
    n = c["num_hidden_layers"]
    kind = "full_attention" if r.get("sliding_window") is None else "sliding_attention"
    c.update(
        intermediate_size=r.int("intermediate_size"),
        hidden_act=_act(r, "hidden_act", "silu"),
        rope=_phi3_rope(r, c["head_dim"]),
        layout=CheckpointLayout(r.model_type, fused=_PHI3_FUSED),
        **_dense_layers(r, (kind,) * n),
    )
    return c


def _olmo3(r: _Reader) -> dict:
    """OLMo 3: post-norm (each sublayer's output normalised, then added: no norm before attention
    or the MLP), q/k RMSNorm over the whole projection, sliding-window layers (by default three
    of every four), one RoPE dict per layer type."""
    c = _common(r)
    n = c["num_hidden_layers"]
    lt = _layer_types(r, n, _GEMMA_TYPES, _interleaved(n, 4, "sliding_attention"))
    # transformers' Olmo3Config.convert_rope_params_to_dict: the legacy rope_theta is taken (popped)
    # for the full-attention layers only; the sliding layers' base left out is the class's 500000
    theta = r.get("rope_theta")
    bases = {"full_attention": 500_000.0 if theta is None else theta, "sliding_attention": 500_000.0}
    c.update(
        _mlp_and_bias(r),
        **_OLMO_LAYER,
        rope=_typed_rope_params(r, bases, "OLMo 3"),
        **_dense_layers(r, lt),
    )
    return c


def _gemma4(r: _Reader) -> dict:
    """Gemma 4's text model: Gemma's sandwich-normed blocks (plain ``w`` norms, embeddings times
    ``sqrt(hidden)``, a final softcap) with ``SharedKVAttention`` (q/k norms with a weight, a value
    norm without, scale 1; the full-attention layers' own ``head_dim`` and kv heads, keys as values
    with ``attention_k_eq_v``, proportional RoPE), the last ``num_kv_shared_layers`` layers
    reusing the keys and values of the last layer of their type before them (``_kv_sources``),
    the per-layer input embeddings (``hidden_size_per_layer_input``) and a ``layer_scalar`` per
    layer.  transformers makes the last layer full attention whatever ``layer_types`` says; so does
    this reader."""
    c = _common(r)
    n, heads = c["num_hidden_layers"], c["num_attention_heads"]
    r.only(
        "use_bidirectional_attention", (None, "vision"), None, "npattn's CausalLM is causal ('vision': image tokens)"
    )
    moe = None
    if r.bool("enable_moe_block"):  # routed experts beside every layer's MLP (DenseWithExperts)
        E, k = r.int("num_experts"), r.int("top_k_experts")
        if k > E:
            raise ValueError(f"config['top_k_experts']: expected at most num_experts={E}, got {k}")
        act = _act(r, "hidden_activation", "gelu_pytorch_tanh")
        moe = MoEConfig(c["hidden_size"], E, k, r.int("moe_intermediate_size"), norm_topk_prob=True, hidden_act=act)
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):  # read by the MoE block only
        r.get(key)
    _no_attention_dropout(c, "gemma4_text")
    lt = _layer_types(r, n, _GEMMA_TYPES, _interleaved(n, 6, "sliding_attention"))[:-1] + ("full_attention",)
    k_eq_v = r.bool("attention_k_eq_v")
    shapes = _gemma4_heads(r, lt, c["head_dim"], c["num_key_value_heads"], k_eq_v)
    for t, (_, kv) in shapes.items():
        if heads % kv:
            raise ValueError(
                f"config: {t} layers' num_key_value_heads={kv} does not divide num_attention_heads={heads}"
            )
    rope = _gemma4_rope(r, lt)
    window = _window(r, lt)
    bias = r.bool("attention_bias")
    shared = {
        t: SharedKVConfig(
            c["hidden_size"],
            heads,
            kv,
            hd,
            bias,
            (window - 1, 0) if t == "sliding_attention" else None,
            rope[t],
            k_eq_v and t == "full_attention",
            c["rms_norm_eps"],
        )  # fmt: skip
        for t, (hd, kv) in shapes.items()
    }
    ple = r.int("hidden_size_per_layer_input", 0, minimum=0)
    vp = r.int("vocab_size_per_layer_input", c["vocab_size"]) if ple else r.get("vocab_size_per_layer_input")
    if ple and vp < c["vocab_size"]:
        raise ValueError(
            f"config['vocab_size_per_layer_input']: expected >= vocab_size={c['vocab_size']} (a row per token), "
            f"got {vp}"
        )
    c.update(
        intermediate_size=r.int("intermediate_size"),
        hidden_act=_act(r, "hidden_activation", "gelu_pytorch_tanh"),
        attention_bias=bias,
        sandwich_norm=True,
        embed_scale=True,
        attention_scale=1.0,
        final_logit_softcapping=r.float("final_logit_softcapping"),
        rope=rope,
        layer_types=lt,
        sliding_window=window,
        mlp_types=("dense" if moe is None else "dense_and_experts",) * n,
        moe=moe,
        shared_kv=shared,
        kv_sources=_kv_sources(lt, r.int("num_kv_shared_layers", 0, minimum=0)),
        per_layer_input_size=ple,
        per_layer_vocab_size=vp if ple else None,
        layer_scalar=True,
        double_wide_mlp=r.bool("use_double_wide_mlp"),
    )
    return c


def _gemma4_heads(r: _Reader, lt: tuple, head_dim: int, kv: int, k_eq_v: bool) -> dict:
    """``{layer type: (head_dim, num_key_value_heads)}`` as transformers' ``Gemma4TextConfig`` gives
    them: ``per_layer_config`` (what its ``save_pretrained`` writes: overrides by layer index, the
    same for every layer of a type), or else the full-attention layers' ``global_head_dim``
    (default 512) and, with ``attention_k_eq_v``, ``num_global_key_value_heads``."""
    per = r.get("per_layer_config")
    r.get("global_head_dim")  # read below when there is no per_layer_config (transformers: ignored then)
    gkv = r.get("num_global_key_value_heads")
    if per is None:
        full = (
            r.int("global_head_dim", 512),
            r.int("num_global_key_value_heads") if k_eq_v and gkv is not None else kv,
        )
        return {t: full if t == "full_attention" else (head_dim, kv) for t in dict.fromkeys(lt)}
    if not isinstance(per, Mapping):
        raise ValueError(
            f"config['per_layer_config']: expected a mapping of layer indices to overrides, got {_show(per)}"
        )
    layers = [(head_dim, kv)] * len(lt)
    for key, over in per.items():
        i = int(key) if isinstance(key, (str, numbers.Integral)) and str(key).isdigit() else -1
        if not 0 <= i < len(lt) or not isinstance(over, Mapping):
            raise ValueError(f"config['per_layer_config'][{key!r}]: expected a layer index < {len(lt)} and a mapping")
        left = sorted(set(over) - {"head_dim", "num_key_value_heads"})
        if left:
            raise ValueError(
                f"config['per_layer_config'][{key!r}]: key {left[0]!r} is not supported by npattn for gemma4_text"
            )
        for name in over:
            v = over[name]
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(
                    f"config['per_layer_config'][{key!r}][{name!r}]: expected an integer >= 1, got {_show(v)}"
                )
        layers[i] = (int(over.get("head_dim", head_dim)), int(over.get("num_key_value_heads", kv)))
    out: dict = {}
    for i, t in enumerate(lt):
        if out.setdefault(t, layers[i]) != layers[i]:
            raise ValueError(
                f"config['per_layer_config']: layer {i} ({t}) has (head_dim, num_key_value_heads) {layers[i]}, "
                f"another {t} layer {out[t]} (transformers needs one per layer type)"
            )
    return out


_GEMMA4_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


def _gemma4_rope(r: _Reader, lt: tuple) -> dict:
    """One RoPE dict per layer type (``rope_parameters``, transformers' two by default), each
    with its ``rope_theta``; ``"default"`` (whose ``partial_rotary_factor`` transformers' Gemma 4
    ignores: refused) or ``"proportional"``."""
    rp = _rope_mapping(r, "rope_parameters") or _GEMMA4_ROPE
    for t in rp:
        if t not in _GEMMA_TYPES:
            raise ValueError(
                f"config['rope_parameters'][{t!r}]: Gemma 4 holds one dict per layer type {list(_GEMMA_TYPES)}"
            )
    out = {}
    for t in dict.fromkeys(lt):
        name = f"config['rope_parameters'][{t!r}]"
        v: Any = rp.get(t)
        if not isinstance(v, Mapping) or v.get("rope_theta") is None:
            raise ValueError(
                f"{name}: expected a mapping with its 'rope_theta' (transformers needs one), got {_show(v)}"
            )
        params = _standardize(v, name, rope_theta=float(v["rope_theta"]), max_position_embeddings=_max_positions(r))
        kind = params["rope_type"]
        if kind not in ("default", "proportional") or (kind == "default" and "partial_rotary_factor" in params):
            what = "partial_rotary_factor" if kind == "default" else "rope_type"
            raise ValueError(
                f"{name}[{what!r}] is not supported by npattn for gemma4_text (rope_type 'default' or 'proportional')"
            )
        out[t] = params
    return out


def _kv_sources(lt: tuple, shared: int) -> tuple:
    """Each layer's keys' and values' layer (transformers' ``kv_sharing_modes``): the last
    ``shared`` layers reuse those of the last layer of their type before them."""
    n = len(lt)
    if shared >= n:
        raise ValueError(f"config['num_kv_shared_layers']: expected fewer than num_hidden_layers={n}, got {shared}")
    first = n - shared
    out = list(range(n))
    for i in range(first, n):
        makers = [j for j in range(first) if lt[j] == lt[i]]
        if not makers:
            raise ValueError(
                f"config['num_kv_shared_layers'] = {shared}: no {lt[i]} layer before layer {first} makes the keys "
                f"and values layer {i} would reuse"
            )
        out[i] = makers[-1]
    return tuple(out)


# LFM2's tensor names where Llama's say otherwise (a decoder layer's; the final norm: embedding_norm)
_LFM2_NAMES = (
    ("input_layernorm", "operator_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("mlp.gate_proj", "feed_forward.w1"),
    ("mlp.up_proj", "feed_forward.w3"),
    ("mlp.down_proj", "feed_forward.w2"),
    ("self_attn.o_proj", "self_attn.out_proj"),
    ("self_attn.q_norm", "self_attn.q_layernorm"),
    ("self_attn.k_norm", "self_attn.k_layernorm"),
)
# keys of the released LFM2 config.json files (the original implementation's) that transformers'
# Lfm2 reads nowhere: each must say what transformers builds anyway: (key, the config key whose
# value it must equal) here, (key, the one value allowed) in _LFM2_FIXED, and theta the RoPE base
_LFM2_ECHOES = (
    ("block_dim", "hidden_size"),
    ("conv_dim", "hidden_size"),
    ("conv_dim_out", "hidden_size"),
    ("num_heads", "num_attention_heads"),
    ("block_norm_eps", "norm_eps"),
)
_LFM2_FIXED = (("block_use_swiglu", True), ("use_pos_enc", True))
# the original implementation's initialisation options: they change no forward pass
_LFM2_INIT = ("block_mlp_init_scale", "block_out_init_scale", "block_use_xavier_init", "conv_use_xavier_init")


def _lfm2_ff_dim(r: _Reader) -> int:
    """``Lfm2MLP``'s width: ``intermediate_size`` (``block_ff_dim`` where given, as ``Lfm2Config``
    pops it), with ``block_auto_adjust_ff_dim`` made ``int(2 I / 3)``, then times
    ``block_ffn_dim_multiplier`` and rounded up to a multiple of ``block_multiple_of``."""
    size = r.int("block_ff_dim") if r.has("block_ff_dim") else r.int("intermediate_size")
    r.get("intermediate_size")
    multiplier = r.float("block_ffn_dim_multiplier")
    if multiplier is None:  # Lfm2Config's field is a number (its model's None branch is never reached)
        raise ValueError("config['block_ffn_dim_multiplier']: expected a finite number > 0, got None")
    multiple = r.int("block_multiple_of")
    if not r.bool("block_auto_adjust_ff_dim", True):
        return size
    size = int(multiplier * int(2 * size / 3))
    size = multiple * ((size + multiple - 1) // multiple)
    if size < 1:
        raise ValueError(f"config: the MLP's adjusted width is {size} (intermediate_size too small); expected >= 1")
    return size


def _lfm2_layer_types(r: _Reader, n: int) -> tuple:
    """``layer_types``, or from ``full_attn_idxs`` (default: every layer) as ``Lfm2Config`` makes
    them: ``"full_attention"`` at those indices, ``"conv"`` elsewhere (``full_attn_idxs`` is read
    and changes nothing beside ``layer_types``, as transformers)."""
    idxs = r.get("full_attn_idxs")
    if idxs is not None and (
        not isinstance(idxs, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in idxs)
    ):
        raise ValueError(f"config['full_attn_idxs']: expected a list of layer indices, got {_show(idxs)}")
    full = range(n) if idxs is None else idxs
    default = ["full_attention" if i in full else "conv" for i in range(n)]
    return _layer_types(r, n, ("full_attention", "conv"), default)


def _lfm2(r: _Reader) -> dict:
    """LFM2 (Liquid AI's LFM2-350M/700M/1.2B, ``Lfm2ForCausalLM``): layers of two kinds
    (``layer_types``, or ``full_attn_idxs``): grouped-query attention with per-head QK-norm
    (``q_layernorm``, ``k_layernorm``) and RoPE (base 1e6), or the gated short convolution
    (``conv``: ``ShortConv``, ``conv_L_cache`` taps, ``conv_bias``); each with the SwiGLU MLP of
    ``_lfm2_ff_dim``'s width, RMSNorms of ``norm_eps`` before both (``operator_norm``,
    ``ffn_norm``), a final ``embedding_norm`` and a tied head by default (``tie_embedding``, the
    older key, takes the place of ``tie_word_embeddings`` where given).  The keys of the released
    config.json files that transformers reads nowhere are checked against what it builds
    (``_LFM2_ECHOES``, ``_LFM2_FIXED``) or are initialisation options (``_LFM2_INIT``)."""
    c = _common(r)
    n, hidden = c["num_hidden_layers"], c["hidden_size"]
    eps = r.float("norm_eps")
    for key, other in _LFM2_ECHOES:
        v = r.get(key)
        if v is not None and v != r.d.get(other):
            raise ValueError(
                f"config[{key!r}] = {_show(v)} differs from config[{other!r}] = {_show(r.d.get(other))}: transformers' "
                f"Lfm2 reads only {other!r}, so this config does not say which one the weights were made for"
            )
    for key, value in _LFM2_FIXED:
        r.only(key, (value,), value, "transformers' Lfm2 builds only that")
    for key in _LFM2_INIT:
        r.get(key)
    rope = _rope_params(r, 1000000.0)
    theta, base = r.get("theta"), rope["default"]["rope_theta"]
    if theta is not None and theta != base:  # the original implementation's name of the RoPE base
        raise ValueError(
            f"config['theta'] = {_show(theta)} differs from the RoPE base {_show(base)} (rope_theta or "
            "rope_parameters): transformers' Lfm2 reads only the latter"
        )
    tie = r.bool("tie_embedding") if r.has("tie_embedding") else c["tie_word_embeddings"]
    lt = _lfm2_layer_types(r, n)
    c.update(
        rms_norm_eps=eps,
        attention_dropout=0.0,  # Lfm2Attention's dropout is 0 whatever the config says
        tie_word_embeddings=tie,
        intermediate_size=_lfm2_ff_dim(r),
        hidden_act="silu",
        qk_norm=True,
        rope=rope,
        layer_types=lt,
        mlp_types=("dense",) * n,
        short_conv=ShortConvConfig(hidden, r.int("conv_L_cache"), r.bool("conv_bias")) if "conv" in lt else None,
        layer_names=_LFM2_NAMES,
        final_norm_name="embedding_norm",
    )
    if "conv" not in lt:
        r.int("conv_L_cache"), r.bool("conv_bias")
    return c


# LFM2-MoE's names: LFM2's, and its MoE block's (feed_forward.gate, feed_forward.experts) with the
# routing bias on the block itself (feed_forward.expert_bias, a buffer as DeepSeek-V3's)
_LFM2_MOE_NAMES = _LFM2_NAMES + (
    ("mlp.gate.e_score_correction_bias", "feed_forward.expert_bias"),
    ("mlp", "feed_forward"),
)
# the renormalisation's eps of Lfm2MoeTopKRouter: w / (sum w + 1e-6)
_LFM2_MOE_NORM_EPS = 1e-6


def _lfm2_moe(r: _Reader) -> dict:
    """LFM2-MoE (Liquid AI's LFM2-8B-A1B, ``Lfm2MoeForCausalLM``): LFM2's layers (``layer_types``
    of ``"full_attention"`` and ``"conv"``, required: ``Lfm2MoeConfig`` makes none), their MLPs
    plain SwiGLUs of ``intermediate_size`` (no width adjustment) in the first ``num_dense_layers``
    layers and routed experts after them (``moe_config``: sigmoid scores, the top
    ``num_experts_per_tok`` of ``num_experts`` chosen by the scores plus ``expert_bias`` where
    ``use_expert_bias``, weighted by the scores alone, renormalised by ``sum + 1e-6`` when
    ``norm_topk_prob``, times ``routed_scaling_factor``; experts of ``moe_intermediate_size``).
    ``tie_embedding``, the older key, takes the place of ``tie_word_embeddings`` where given."""
    c = _common(r)
    n, hidden = c["num_hidden_layers"], c["hidden_size"]
    if not r.has("layer_types"):  # Lfm2MoeModel indexes config.layer_types: it cannot run without
        raise ValueError(
            f"config: model_type 'lfm2_moe' needs the key 'layer_types' ({n} entries of 'full_attention' or 'conv'), "
            "which is missing"
        )
    lt = _layer_types(r, n, ("full_attention", "conv"), [])
    tie = r.bool("tie_embedding") if r.has("tie_embedding") else c["tie_word_embeddings"]
    k_dense = r.int("num_dense_layers", minimum=0)
    mlp_types = tuple("dense" if i < k_dense else "moe" for i in range(n))
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        r.int(key)
    r.bool("use_expert_bias", True)
    r.bool("norm_topk_prob", True)
    r.float("routed_scaling_factor")
    c.update(
        rms_norm_eps=r.float("norm_eps"),
        attention_dropout=0.0,  # Lfm2Attention's dropout is 0 whatever the config says
        tie_word_embeddings=tie,
        intermediate_size=r.int("intermediate_size"),
        hidden_act="silu",
        qk_norm=True,
        rope=_rope_params(r, 1000000.0),
        layer_types=lt,
        mlp_types=mlp_types,
        short_conv=ShortConvConfig(hidden, r.int("conv_L_cache"), r.bool("conv_bias")) if "conv" in lt else None,
        moe=moe_config(r.d) if "moe" in mlp_types else None,
        layer_names=_LFM2_MOE_NAMES,
        final_norm_name="embedding_norm",
        layout=CheckpointLayout(r.model_type, per_expert=True, expert_projs=("w1", "w3", "w2")),
    )
    if "conv" not in lt:
        r.int("conv_L_cache"), r.bool("conv_bias")
    return c


_SIZE_KEYS = {
    "positions": "max_position_embeddings",
    "vocab": "vocab_size",
    "hidden": "hidden_size",
    "intermediate": "intermediate_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "expert": "moe_intermediate_size",
    "top_k": "num_experts_per_tok",
}


def _sizes(**sizes: int) -> dict:
    """A family's sizes by their short names (``_SIZE_KEYS``) as config keys."""
    return {_SIZE_KEYS[k]: v for k, v in sizes.items()}


# The SiLU MLP without biases or tied embeddings most families have.
_SILU: dict = dict(hidden_act="silu", tie_word_embeddings=False, attention_bias=False)

# The defaults Qwen3-Next, Qwen3.5 and Qwen3.5-MoE share (their hybrid layers' shapes and options).
_DELTA_HEADS: dict = dict(
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32
)
_QWEN_HYBRID: dict = dict(
    _SILU,
    **_sizes(positions=32768, heads=16),
    head_dim=256,
    rms_norm_eps=1e-6,
    partial_rotary_factor=0.25,
    linear_conv_kernel_dim=4,
    **_DELTA_HEADS,
)
_QWEN_HYBRID_MOE: dict = dict(moe_intermediate_size=512, shared_expert_intermediate_size=512)


# The defaults families share: Llama's sizes (OLMo 3's too), Qwen3's (Qwen3-MoE's), Gemma 3's
# (Gemma 4's), DeepSeek-V3's MLA heads (Kimi Linear's).
_LLAMA_SIZES: dict = _sizes(positions=2048, hidden=4096, intermediate=11008, layers=32, heads=32)
_QWEN3: dict = dict(
    _SILU,
    **_sizes(positions=32768, vocab=151936, heads=32),
    rms_norm_eps=1e-6,
    use_sliding_window=False,
)
_GEMMA: dict = dict(
    **_sizes(positions=131072, hidden=2304, intermediate=9216, heads=8, kv_heads=4),
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6,
    pad_token_id=0,
    tie_word_embeddings=True,
    attention_bias=False,
)
_MLA: dict = dict(kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128)


# transformers' (5.x) class defaults of the keys that shape each family's forward pass, for a config
# dict that leaves them out (a hand-written dict, an older config.json): a missing key must mean
# what it means to transformers, never npattn's own guess.  Keys derived from others (Llama's and
# DeepSeek's head_dim and num_key_value_heads) are left to the readers, and so is RoPE (each reader's
# base and GPT-OSS's YaRN, _GPT_OSS_ROPE, read as transformers reads them; see _rope_params).
# GraniteConfig's and GraniteMoeConfig's shared class defaults (Llama's sizes, the four numbers 1)
_GRANITE: dict = dict(
    _LLAMA_SIZES,
    vocab_size=32000,
    **_SILU,
    rms_norm_eps=1e-6,
    attention_dropout=0.0,
    embedding_multiplier=1.0,
    residual_multiplier=1.0,
    attention_multiplier=1.0,
    logits_scaling=1.0,
    bos_token_id=1,
    eos_token_id=2,
)

# Lfm2Config's and Lfm2MoeConfig's shared class defaults
_LFM2: dict = dict(
    norm_eps=1e-5,
    tie_word_embeddings=True,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    conv_bias=False,
    conv_L_cache=3,
)

_DEFAULTS: dict = {
    "llama": dict(_LLAMA_SIZES, vocab_size=32000, **_SILU, rms_norm_eps=1e-6, mlp_bias=False),
    "gemma2": dict(
        _GEMMA,
        **_sizes(positions=8192, vocab=256000, layers=26),
        query_pre_attn_scalar=256,
        sliding_window=4096,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
    ),
    "mistral": dict(
        **_sizes(positions=131072, vocab=32000, hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8),
        hidden_act="silu",
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        sliding_window=4096,
    ),
    # Ministral3Config's class defaults (8B's sizes, head_dim 128, no window; its rope_parameters
    # are the reader's _MINISTRAL3_ROPE)
    "ministral3": dict(
        **_sizes(positions=262144, vocab=131072, hidden=4096, intermediate=14336, layers=34, heads=32, kv_heads=8),
        head_dim=128,
        hidden_act="silu",
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        pad_token_id=11,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # MinistralConfig's class defaults (Mistral's, eps 1e-6, a window of 4096 on every layer)
    "ministral": dict(
        **_sizes(positions=131072, vocab=32000, hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8),
        hidden_act="silu",
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        sliding_window=4096,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "mixtral": dict(
        **_sizes(positions=131072, vocab=32000, hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8),
        hidden_act="silu",
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        num_experts_per_tok=2,  # num_local_experts (8): the reader's, as it has two names
        router_jitter_noise=0.0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen2": dict(
        _QWEN3,
        **_sizes(hidden=4096, intermediate=22016, layers=32),
        sliding_window=4096,
        max_window_layers=28,
    ),
    "qwen3": dict(
        _QWEN3,
        **_sizes(hidden=4096, intermediate=22016, layers=32),
        head_dim=128,
        max_window_layers=28,
    ),
    "qwen3_moe": dict(
        _QWEN3,
        **_sizes(hidden=2048, intermediate=6144, layers=24, kv_heads=4, expert=768),
        sliding_window=4096,
        decoder_sparse_step=1,
        num_experts_per_tok=8,  # num_experts (128): the reader's, as it has two names
        norm_topk_prob=False,
    ),
    "gemma3_text": dict(
        _GEMMA,
        **_sizes(vocab=262208, layers=26),
        query_pre_attn_scalar=256,
        sliding_window=4096,
    ),
    "gpt_oss": dict(
        _SILU,
        **_sizes(positions=131072, vocab=201088, hidden=2880, intermediate=2880, layers=36, heads=64, kv_heads=8),
        head_dim=64,
        num_local_experts=128,
        num_experts_per_tok=4,
        sliding_window=128,
        rms_norm_eps=1e-5,
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
        attention_bias=True,
    ),
    "deepseek_v3": dict(
        _MLA,
        **_sizes(positions=4096, vocab=129280, hidden=7168, intermediate=18432, layers=61, heads=128, expert=2048),
        num_experts_per_tok=8,
        n_shared_experts=1,
        n_routed_experts=256,
        routed_scaling_factor=2.5,
        q_lora_rank=1536,
        n_group=8,
        topk_group=4,
        first_k_dense_replace=3,
        norm_topk_prob=True,
        **_SILU,
        rms_norm_eps=1e-6,
        rope_interleave=True,
    ),
    "kimi_linear": dict(  # KimiLinearConfig's class defaults (the MoE keys with two names: the reader's)
        _MLA,
        **_sizes(vocab=163840, hidden=2304, intermediate=9216, layers=27, heads=32, kv_heads=32, expert=1024),
        routed_scaling_factor=2.446,
        topk_group=1,
        **_SILU,
        rms_norm_eps=1e-5,
        linear_head_dim=128,
        linear_num_heads=32,
        linear_conv_kernel_dim=4,
    ),
    "qwen3_next": dict(
        _QWEN_HYBRID,
        **_sizes(vocab=151936, hidden=2048, intermediate=5632, layers=48, kv_heads=2, top_k=10),
        decoder_sparse_step=1,
        **_QWEN_HYBRID_MOE,
        num_experts=512,
        norm_topk_prob=True,
    ),
    "qwen3_5_text": dict(
        _QWEN_HYBRID,
        **_sizes(vocab=248320, hidden=4096, intermediate=12288, layers=32, kv_heads=4),
    ),
    "qwen3_5_moe_text": dict(
        _QWEN_HYBRID,
        **_sizes(vocab=248320, hidden=2048, layers=40, kv_heads=2, top_k=8),
        **_QWEN_HYBRID_MOE,
        num_experts=256,
    ),
    "gemma4_text": dict(  # Gemma4TextConfig's class defaults (global_head_dim: the reader's, 512)
        _GEMMA,
        **_sizes(vocab=262144, layers=30),
        eos_token_id=1,
        bos_token_id=2,
        sliding_window=512,
        vocab_size_per_layer_input=262144,
        hidden_size_per_layer_input=256,
    ),
    "smollm3": dict(
        _SILU,
        **_sizes(positions=32768, vocab=128256, hidden=2048, intermediate=11008, layers=36, heads=16, kv_heads=4),
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        mlp_bias=False,
        use_sliding_window=False,
        no_rope_layer_interval=4,
        pad_token_id=128004,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "phi3": dict(
        **_sizes(positions=4096, vocab=32064, hidden=3072, intermediate=8192, layers=32, heads=32),
        original_max_position_embeddings=4096,
        hidden_act="silu",
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attention_dropout=0.0,
        bos_token_id=1,
        eos_token_id=32000,
        pad_token_id=32000,
    ),
    "granite": dict(_GRANITE, mlp_bias=False),
    "granitemoe": dict(_GRANITE, num_local_experts=8, num_experts_per_tok=2),
    "granitemoeshared": dict(_GRANITE, num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=0),
    "granitemoehybrid": dict(
        _GRANITE,
        num_local_experts=8,
        num_experts_per_tok=2,
        shared_intermediate_size=1024,
        position_embedding_type=None,
        mamba_n_heads=128,  # mamba_d_head's default "auto" follows from them (the reader's)
        mamba_n_groups=1,
        mamba_d_state=256,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=256,
        mamba_conv_bias=True,
        mamba_proj_bias=False,  # time_step_limit's default (0, inf) is the reader's: JSON has no Infinity
    ),
    "olmo2": dict(_LLAMA_SIZES, vocab_size=50304, **_SILU, rms_norm_eps=1e-5, pad_token_id=1, eos_token_id=50279),
    "olmo": dict(  # OlmoConfig's (OLMo-7B's sizes; no eps key: OlmoLayerNorm's is 1e-5)
        _LLAMA_SIZES, vocab_size=50304, **_SILU, pad_token_id=1, eos_token_id=50279, clip_qkv=None
    ),
    "lfm2": dict(
        **_sizes(positions=128000, vocab=65536, hidden=2560, intermediate=12288, layers=32, heads=32, kv_heads=8),
        **_LFM2,
        block_multiple_of=256,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=True,
    ),
    "lfm2_moe": dict(
        **_sizes(positions=128000, vocab=65536, hidden=2048, intermediate=7168, layers=32, heads=32, kv_heads=8),
        **_sizes(expert=1792, top_k=4),
        **_LFM2,
        num_dense_layers=2,
        num_experts=32,
        use_expert_bias=True,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
    ),
    "falcon_h1": dict(  # FalconH1Config's (mlp_multipliers, ssm_multipliers null: ones; time_step_limit: the reader's)
        **_sizes(positions=8192, vocab=128000, hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8),
        **_SILU,
        rms_norm_eps=1e-5,
        attention_dropout=0.0,
        mlp_bias=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        mamba_d_ssm=1024,
        mamba_n_heads=128,
        mamba_d_head="auto",
        mamba_n_groups=1,
        mamba_d_state=256,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=256,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
        mamba_norm_before_gate=True,
        mamba_rms_norm=False,
        projectors_bias=False,
        lm_head_multiplier=1.0,
        embedding_multiplier=1.0,
        key_multiplier=1.0,
        attention_out_multiplier=1.0,
        attention_in_multiplier=1.0,
        ssm_in_multiplier=1.0,
        ssm_out_multiplier=1.0,
    ),
    "nemotron_h": dict(  # NemotronHConfig's (layers_block_type: the reader's default)
        vocab_size=131072,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        intermediate_size=21504,
        mlp_hidden_act="relu2",
        mlp_bias=False,
        attention_bias=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        ssm_state_size=128,
        mamba_num_heads=128,
        mamba_head_dim=64,
        mamba_hidden_act="silu",
        n_groups=8,
        conv_kernel=4,
        expand=2,
        time_step_min=0.001,
        time_step_max=0.1,
        time_step_floor=1e-4,
        use_conv_bias=True,
        chunk_size=128,
        mamba_proj_bias=False,
        use_bias=False,
        layer_norm_epsilon=1e-5,
        n_routed_experts=8,
        n_shared_experts=1,
        moe_intermediate_size=7688,
        moe_shared_expert_intermediate_size=7688,
        moe_shared_expert_overlap=True,
        num_experts_per_tok=2,
        routed_scaling_factor=1.0,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
    ),
    "mamba2": dict(  # Mamba2Config's (time_step_limit: the reader's)
        num_heads=128,
        head_dim=64,
        vocab_size=32768,
        hidden_size=4096,
        state_size=128,
        num_hidden_layers=64,
        layer_norm_epsilon=1e-5,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        expand=2,
        conv_kernel=4,
        n_groups=8,
        use_bias=False,
        use_conv_bias=True,
        hidden_act="silu",
        residual_in_fp32=True,
        time_step_rank="auto",
        time_step_min=0.001,
        time_step_max=0.1,
        time_step_floor=1e-4,
        rescale_prenorm_residual=False,
        chunk_size=256,
        tie_word_embeddings=False,
    ),
    "exaone4": dict(  # Exaone4Config's class defaults (no RoPE key: the reader's base of 10000)
        **_sizes(positions=2048, vocab=102400, hidden=4096, intermediate=16384, layers=32, heads=32, kv_heads=32),
        hidden_act="silu",
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=2,
        sliding_window=4096,
        sliding_window_pattern=4,
    ),
    # Glm4Config's class defaults (GLM-4-9B's sizes, head_dim 128, biases on q/k/v, half the head rotating)
    "glm4": dict(
        **_sizes(positions=131072, vocab=151552, hidden=4096, intermediate=13696, layers=40, heads=32, kv_heads=2),
        head_dim=128,
        hidden_act="silu",
        rms_norm_eps=1.5625e-07,
        tie_word_embeddings=False,
        attention_bias=True,
        attention_dropout=0.0,
        partial_rotary_factor=0.5,
        pad_token_id=151329,
        eos_token_id=[151329, 151336, 151338],
    ),
    "arcee": dict(  # ArceeConfig's (AFM-4.5B-Base's sizes; head_dim and num_key_value_heads: the reader's)
        **_sizes(positions=4096, vocab=32000, hidden=2560, intermediate=18432, layers=32, heads=32),
        hidden_act="relu2",
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "apertus": dict(  # ApertusConfig's (Apertus-8B's sizes; num_key_value_heads and RoPE: the reader's)
        **_sizes(positions=65536, vocab=131072, hidden=4096, intermediate=14336, layers=32, heads=32),
        hidden_act="xielu",
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
        pad_token_id=3,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Ernie4_5Config's class defaults (0.3B's sizes, head_dim 128, a tied head, no biases)
    "ernie4_5": dict(
        **_sizes(positions=131072, vocab=103424, hidden=1024, intermediate=3072, layers=18, heads=16, kv_heads=2),
        hidden_act="silu",
        head_dim=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        use_bias=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # HunYuanDenseV1Config's class defaults (the 7B's sizes; head_dim null, which the reader refuses)
    "hunyuan_v1_dense": dict(
        **_sizes(positions=2048, vocab=290943, hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32),
        **_SILU,
        rms_norm_eps=1e-5,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        eod_token_id=3,
    ),
    "olmo3": dict(
        _LLAMA_SIZES,
        vocab_size=50304,
        **_SILU,
        rms_norm_eps=1e-5,
        pad_token_id=1,
        eos_token_id=50279,
        sliding_window=4096,
    ),
}


# DeepseekV32Config's class defaults: DeepSeek-V3's but for these (no rope_interleave key: always interleaved)
_DEFAULTS["deepseek_v32"] = dict(
    _DEFAULTS["deepseek_v3"],
    **_sizes(positions=163840, kv_heads=128),
    index_topk=2048,
    index_head_dim=128,
    index_n_heads=64,
    bos_token_id=0,
    eos_token_id=1,
)


# Qwen2MoeConfig's class defaults: Qwen3-MoE's but for these (no attention_bias field: qkv_bias)
_DEFAULTS["qwen2_moe"] = dict(
    {k: v for k, v in _DEFAULTS["qwen3_moe"].items() if k != "attention_bias"},
    **_sizes(intermediate=5632, heads=16, kv_heads=16, expert=1408, top_k=4),
    max_window_layers=28,
    shared_expert_intermediate_size=5632,
    num_experts=60,
    qkv_bias=True,
)


# OlmoeConfig's class defaults: OLMo 2's but for these (num_experts, 64: the reader's, as it has two names)
_DEFAULTS["olmoe"] = dict(
    _DEFAULTS["olmo2"],
    **_sizes(positions=4096, hidden=2048, intermediate=2048, layers=16, heads=16, top_k=8),
    norm_topk_prob=False,
)


_DEFAULTS["gpt2"] = dict(  # GPT2Config's, under the attribute_map's names (with_defaults reads n_embd ... as them)
    vocab_size=50257,
    max_position_embeddings=1024,
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    activation_function="gelu_new",
    resid_pdrop=0.1,
    embd_pdrop=0.1,
    attn_pdrop=0.1,
    layer_norm_epsilon=1e-5,
    scale_attn_weights=True,
    bos_token_id=50256,
    eos_token_id=50256,
    scale_attn_by_inverse_layer_idx=False,
    reorder_and_upcast_attn=False,
    add_cross_attention=False,
    tie_word_embeddings=True,
)
# a family's own names of config keys -> the names transformers' attribute_map reads them as
_ALIASES: dict[str, tuple] = {
    "gpt2": (
        ("n_embd", "hidden_size"),
        ("n_layer", "num_hidden_layers"),
        ("n_head", "num_attention_heads"),
        ("n_positions", "max_position_embeddings"),
    ),
}
_DEFAULTS["gpt_neox"] = dict(  # GPTNeoXConfig's (rotary_pct and rotary_emb_base: the reader's defaults)
    vocab_size=50432,
    hidden_size=6144,
    num_hidden_layers=44,
    num_attention_heads=64,
    intermediate_size=24576,
    hidden_act="gelu",
    attention_dropout=0.0,
    hidden_dropout=0.0,
    max_position_embeddings=2048,
    layer_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=2,
    tie_word_embeddings=False,
    use_parallel_residual=True,
    attention_bias=True,
)
_DEFAULTS["phi"] = dict(  # PhiConfig's (partial_rotary_factor 0.5: the reader's, as __post_init__'s)
    vocab_size=51200,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=24,
    num_attention_heads=32,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attention_dropout=0.0,
    hidden_act="gelu_new",
    max_position_embeddings=2048,
    layer_norm_eps=1e-5,
    tie_word_embeddings=False,
    qk_layernorm=False,
    bos_token_id=1,
    eos_token_id=2,
)
_DEFAULTS["starcoder2"] = dict(  # Starcoder2Config's
    **_sizes(positions=4096, vocab=49152, hidden=3072, intermediate=12288, layers=30, heads=24, kv_heads=2),
    hidden_act="gelu_pytorch_tanh",
    norm_epsilon=1e-5,
    bos_token_id=50256,
    eos_token_id=50256,
    sliding_window=None,
    attention_dropout=0.0,
    residual_dropout=0.0,
    embedding_dropout=0.0,
    use_bias=True,
    tie_word_embeddings=True,
)
_DEFAULTS["stablelm"] = dict(  # StableLmConfig's (partial_rotary_factor 0.25: the reader's, as __post_init__'s)
    **_sizes(positions=4096, vocab=50304, hidden=2560, intermediate=6912, layers=32, heads=32, kv_heads=32),
    hidden_act="silu",
    layer_norm_eps=1e-5,
    tie_word_embeddings=False,
    use_qkv_bias=False,
    qk_layernorm=False,
    use_parallel_residual=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    bos_token_id=0,
    eos_token_id=0,
)
_DEFAULTS["cohere2"] = dict(  # Cohere2Config's (head_dim: hidden_size // num_attention_heads, always)
    **_sizes(positions=8192, vocab=256000, hidden=8192, intermediate=22528, layers=40, heads=64),
    hidden_act="silu",
    logit_scale=0.0625,
    layer_norm_eps=1e-5,
    tie_word_embeddings=True,
    attention_bias=False,
    attention_dropout=0.0,
    sliding_window=4096,
    pad_token_id=0,
    bos_token_id=5,
    eos_token_id=255001,
)
_DEFAULTS["cohere"] = dict(  # CohereConfig's
    **_sizes(positions=8192, vocab=256000, hidden=8192, intermediate=22528, layers=40, heads=64),
    hidden_act="silu",
    logit_scale=0.0625,
    layer_norm_eps=1e-5,
    tie_word_embeddings=True,
    attention_bias=False,
    attention_dropout=0.0,
    use_qk_norm=False,
    pad_token_id=0,
    bos_token_id=5,
    eos_token_id=255001,
)


def with_defaults(config: Mapping[str, Any]) -> dict:
    """``config`` completed with transformers' class defaults of its ``model_type`` for the keys
    it leaves out (see ``_DEFAULTS``), a family's own names of keys read as transformers'
    ``attribute_map`` reads them (GPT-2's ``n_embd`` as ``hidden_size``: ``_ALIASES``)."""
    mt = config.get("model_type")
    config = dict(config)
    for own, alias in _ALIASES.get(str(mt), ()):  # GPT-2's n_embd is its hidden_size (GPT2Config.attribute_map)
        if own in config:
            v = config.pop(own)
            if config.get(alias, v) != v:
                other = _show(config[alias])
                raise ValueError(f"config[{own!r}] = {_show(v)} and config[{alias!r}] = {other}: expected one value")
            config[alias] = v
    d = dict(_DEFAULTS.get(mt, {}))
    d.update(config)
    return d


# -- one module's arguments from a Hugging Face config -------------------------------------------
# The readers behind MultiHeadLatentAttention.from_config, GatedDeltaNet.from_config and
# SparseMoeBlock.from_hf_config (and, on a dict the family reader above has checked, behind
# CausalLM's layers): they read only their module's keys and leave the rest of the config alone.


class _Loose:
    """Reads one module's keys from a config mapping: a missing key names the ``model_type``; a
    flag is a JSON boolean only."""

    def __init__(self, config: Mapping[str, Any]):
        self.d = config
        self.model_type = config.get("model_type")

    def get(self, *names, default: Any = KeyError):
        """The first of ``names`` the config has (not null), else ``default`` (required without one)."""
        for name in names:
            if self.d.get(name) is not None:
                return self.d[name]
        if default is KeyError:
            raise ValueError(f"config: model_type {self.model_type!r} needs {' or '.join(map(repr, names))}, missing")
        return default

    def flag(self, name: str, default: bool) -> bool:
        """A JSON boolean only ("false" would read as True); null is false, as transformers tests
        the value's truth, and refused where the default is true."""
        return _json_bool(name, self.d.get(name, default), default, repr)


def latent_config(config: Mapping[str, Any]) -> LatentConfig:
    """``MultiHeadLatentAttention``'s arguments from a Hugging Face ``DeepseekV3Config`` as a dict.

    Reads ``hidden_size``, ``num_attention_heads``, ``q_lora_rank``, ``kv_lora_rank``,
    ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``attention_bias``,
    ``rope_interleave`` and the rotation from ``rope_parameters`` (transformers 5) or
    ``rope_theta`` + ``rope_scaling`` (older), as transformers 5 reads them: a non-empty
    ``rope_scaling`` takes the place of ``rope_parameters``; ``rope_theta`` and
    ``max_position_embeddings`` beside the dict fill what it lacks.  A ``deepseek_v32`` config's
    ``index_topk``, ``index_n_heads`` and ``index_head_dim`` too (the lightning indexer).

    Raises
    ------
    TypeError
        ``config`` is not a mapping.
    ValueError
        A required key is missing; ``num_key_value_heads`` differs from ``num_attention_heads``
        or ``attention_dropout`` is not 0 (not supported); a flag that is not a JSON boolean.
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"config: expected a dict (PretrainedConfig.to_dict()), got {type(config).__name__}")
    need = ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")
    missing = [k for k in need + ("v_head_dim",) if config.get(k) is None]
    if missing:
        raise ValueError(f"config: missing keys {missing}")
    heads = config["num_attention_heads"]
    if config.get("num_key_value_heads", heads) not in (None, heads):
        raise ValueError(
            f"config: num_key_value_heads={config['num_key_value_heads']} differs from "
            f"num_attention_heads={heads} (not supported: MLA's keys have one head per query head)"
        )
    if config.get("attention_dropout", 0.0):
        raise ValueError(f"config: attention_dropout={config['attention_dropout']} is not supported (expected 0)")
    old = config.get("rope_scaling")
    theta = config.get("rope_theta")
    scaling = _standardize(
        old or config.get("rope_parameters") or {},
        f"config[{'rope_scaling' if old else 'rope_parameters'!r}]",
        rope_theta=10000.0 if theta is None else theta,
        partial_rotary_factor=config.get("partial_rotary_factor"),
        max_position_embeddings=config.get("max_position_embeddings"),
    )
    flags = {k: config[k] if k in config else d for k, d in (("attention_bias", False), ("rope_interleave", True))}
    for k, v in flags.items():  # JSON booleans only ("false" would read as True; null as false)
        if v is None and k == "attention_bias":
            flags[k] = False
        elif not isinstance(v, bool):
            raise ValueError(f"config[{k!r}]: expected true or false (a JSON boolean), got {v!r}")
    return LatentConfig(
        hidden_size=config["hidden_size"],
        num_heads=heads,
        kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
        q_lora_rank=config.get("q_lora_rank"),
        attention_bias=flags["attention_bias"],
        rope_theta=scaling.pop("rope_theta"),
        rope_scaling=scaling,
        rope_interleave=flags["rope_interleave"],
        **_indexer(config),
    )


def _indexer(config: Mapping[str, Any]) -> dict:
    """DeepSeek-V3.2's lightning indexer (``index_topk``, ``index_n_heads``, ``index_head_dim``,
    transformers' defaults where absent) for ``LatentConfig``; none for another family."""
    if config.get("model_type") != "deepseek_v32":
        return {}
    d = _DEFAULTS["deepseek_v32"]
    return {k: config.get(k, d[k]) for k in ("index_topk", "index_n_heads", "index_head_dim")}


def delta_net_config(config: Mapping[str, Any]) -> DeltaNetConfig:
    """``GatedDeltaNet``'s arguments from a Hugging Face ``Qwen3NextConfig`` as a mapping:
    ``hidden_size`` (required), the ``linear_*`` fields, ``rms_norm_eps`` and ``hidden_act``, each
    left out meaning transformers' default (``Qwen3NextConfig``'s, which are the module's too).

    Raises
    ------
    ValueError
        No ``hidden_size``.
    """
    if "hidden_size" not in config:
        raise ValueError("config: expected a 'hidden_size' entry")
    defaults = _DEFAULTS["qwen3_next"]
    names = [f.name for f in dataclasses.fields(DeltaNetConfig) if f.name != "projections"]
    projections = _DELTA_PROJECTIONS.get(str(config.get("model_type")), "qkvz_ba")
    return DeltaNetConfig(**{k: config[k] if k in config else defaults[k] for k in names}, projections=projections)


def kda_config(config: Mapping[str, Any]) -> KdaConfig:
    """``KimiDeltaAttention``'s arguments from a Hugging Face ``KimiLinearConfig`` as a mapping:
    ``hidden_size`` (required), ``linear_attn_config``'s ``num_heads``, ``head_dim`` and
    ``short_conv_kernel_size`` (or the config's ``linear_num_heads``, ``linear_head_dim``,
    ``linear_conv_kernel_dim``, which transformers fills from them), ``rms_norm_eps``,
    ``hidden_act``; each left out meaning transformers' default.

    Raises
    ------
    ValueError
        No ``hidden_size``; a size that is not a positive integer (named).
    """
    if "hidden_size" not in config:
        raise ValueError("config: expected a 'hidden_size' entry")
    d = _DEFAULTS["kimi_linear"]
    lac = config.get("linear_attn_config") or {}
    sizes = {}
    for name, key in (("linear_num_heads", "num_heads"), ("linear_head_dim", "head_dim")):
        sizes[name] = check_size(lac.get(key, config.get(name, d[name])), name)
    taps = lac.get("short_conv_kernel_size", config.get("linear_conv_kernel_dim", d["linear_conv_kernel_dim"]))
    return KdaConfig(
        hidden_size=config["hidden_size"],
        linear_conv_kernel_dim=check_size(taps, "linear_conv_kernel_dim"),
        rms_norm_eps=config.get("rms_norm_eps", d["rms_norm_eps"]),
        hidden_act=config.get("hidden_act", d["hidden_act"]),
        **sizes,
    )


# GatedDeltaNet's input projections by family: Qwen3.5's four (in_proj_qkv, in_proj_z, in_proj_b,
# in_proj_a), not Qwen3-Next's two grouped per key head (the default)
_DELTA_PROJECTIONS = {"qwen3_5_text": "qkv_z_b_a", "qwen3_5_moe_text": "qkv_z_b_a"}


def _moe_sizes(c: _Loose, experts: tuple, inter: str) -> dict:
    """``MoEConfig``'s sizes: ``hidden_size``, the experts (the first of ``experts`` the config has),
    ``num_experts_per_tok`` and the experts' width ``inter``."""
    return dict(
        hidden_size=c.get("hidden_size"),
        num_experts=c.get(*experts),
        top_k=c.get("num_experts_per_tok"),
        intermediate_size=c.get(inter),
    )


def _moe_gpt_oss(c: _Loose) -> MoEConfig:
    # variant "topk_softmax" with a router bias, GptOssExperts, keys router.*, experts.*
    return MoEConfig(
        **_moe_sizes(c, ("num_local_experts", "num_experts"), "intermediate_size"),
        router="topk_softmax",
        router_bias=True,
        experts="gpt_oss",
        swiglu_alpha=c.get("swiglu_alpha", default=1.702),
        swiglu_limit=c.get("swiglu_limit", default=7.0),
        router_name="router",
    )


# DeepSeek-V3's block under each family's key names: per argument, the keys (the first, then its
# aliases) and the default (KeyError: required); Kimi's each also under transformers' attribute_map alias
_SIGMOID_MOE_KEYS: dict = {
    "deepseek_v3": dict(
        experts=(("n_routed_experts", "num_local_experts"), KeyError),
        top_k=(("num_experts_per_tok",), KeyError),
        scaling=(("routed_scaling_factor",), 1.0),
        n_group=(("n_group",), 1),
        n_shared=(("n_shared_experts",), 0),
    ),
    "kimi_linear": dict(
        experts=(("num_experts", "num_local_experts"), 256),
        top_k=(("num_experts_per_token", "num_experts_per_tok"), 8),
        scaling=(("routed_scaling_factor",), 2.446),
        n_group=(("num_expert_group", "n_group"), 1),
        n_shared=(("num_shared_experts", "n_shared_experts"), 1),
    ),
}


def _moe_sigmoid(c: _Loose, keys: Mapping[str, tuple], renorm: str = "norm_topk_prob") -> MoEConfig:
    # sigmoid scores, keys gate.weight, gate.e_score_correction_bias, experts.*, shared_experts.*
    def read(arg: str):
        names, default = keys[arg]
        return c.get(*names, default=default)

    inter = c.get("moe_intermediate_size")
    n_shared = read("n_shared")
    return MoEConfig(
        c.get("hidden_size"),
        read("experts"),
        read("top_k"),
        inter,
        router="sigmoid",
        norm_topk_prob=c.flag(renorm, True),
        routed_scaling_factor=read("scaling"),
        n_group=read("n_group"),
        topk_group=c.get("topk_group", default=1),
        hidden_act=c.get("hidden_act", default="silu"),
        shared_intermediate_size=inter * check_size(n_shared, keys["n_shared"][0][0]) if n_shared else None,
        shared_name="shared_experts",
        experts_first=True,
    )


def _moe_deepseek_v3(c: _Loose) -> MoEConfig:
    return _moe_sigmoid(c, _SIGMOID_MOE_KEYS["deepseek_v3"])


def _moe_kimi_linear(c: _Loose) -> MoEConfig:
    # DeepSeek-V3's block (sigmoid scores, correction bias, groups, shared experts) under Kimi's key names
    renorm = "moe_renormalize" if c.d.get("moe_renormalize") is not None else "norm_topk_prob"
    return _moe_sigmoid(c, _SIGMOID_MOE_KEYS["kimi_linear"], renorm)


def _moe_qwen3_next(c: _Loose) -> MoEConfig:
    # softmax then top-k, keys gate.weight, experts.*, shared_expert.*, shared_expert_gate.weight
    return MoEConfig(
        **_moe_sizes(c, ("num_experts",), "moe_intermediate_size"),
        router="softmax_topk",
        norm_topk_prob=c.flag("norm_topk_prob", True),
        hidden_act=c.get("hidden_act", default="silu"),
        shared_intermediate_size=c.get("shared_expert_intermediate_size") or None,  # 0: none
        shared_expert_gate=bool(c.get("shared_expert_intermediate_size")),
    )


def _moe_qwen3_5_moe(c: _Loose) -> MoEConfig:
    # Qwen3-Next's block; its router (Qwen3VLMoeTextTopKRouter) always renormalises the top k
    return dataclasses.replace(_moe_qwen3_next(c), norm_topk_prob=True)


def _moe_qwen3_moe(c: _Loose) -> MoEConfig:
    # softmax then top-k, keys experts.*, gate.weight
    return MoEConfig(
        **_moe_sizes(c, ("num_experts", "num_local_experts"), "moe_intermediate_size"),
        norm_topk_prob=c.flag("norm_topk_prob", False),
        hidden_act=c.get("hidden_act", default="silu"),
        experts_first=True,
    )


def _moe_qwen2_moe(c: _Loose) -> MoEConfig:
    # softmax then top-k, keys gate.weight, experts.*, shared_expert.*, shared_expert_gate.weight
    # (Qwen3-Next's block; the shared expert always there, the renormalisation off by default)
    return MoEConfig(
        **_moe_sizes(c, ("num_experts",), "moe_intermediate_size"),
        norm_topk_prob=c.flag("norm_topk_prob", False),
        hidden_act=c.get("hidden_act", default="silu"),
        shared_intermediate_size=c.get("shared_expert_intermediate_size"),
        shared_expert_gate=True,
    )


def _moe_olmoe(c: _Loose) -> MoEConfig:
    # softmax then top-k, renormalised only with norm_topk_prob, keys gate.weight, experts.*
    return MoEConfig(
        **_moe_sizes(c, ("num_experts", "num_local_experts"), "intermediate_size"),
        norm_topk_prob=c.flag("norm_topk_prob", False),
        hidden_act=c.get("hidden_act", default="silu"),
    )


def _moe_mixtral(c: _Loose) -> MoEConfig:
    # softmax then top-k, renormalised, keys gate.weight, experts.*
    jitter = c.get("router_jitter_noise", default=0.0)
    if jitter:
        raise ValueError(f"config: router_jitter_noise expected 0 (not supported), got {jitter!r}")
    return MoEConfig(
        **_moe_sizes(c, ("num_local_experts", "num_experts"), "intermediate_size"),
        norm_topk_prob=True,
        hidden_act=c.get("hidden_act", default="silu"),
    )


def _moe_granitemoe(c: _Loose) -> MoEConfig:
    # the top k of the logits, then a softmax over them (no bias); keys router.weight, experts.*;
    # GraniteMoeShared's shared MLP where shared_intermediate_size > 0 (its default 0), Granite 4.0's
    # always (its default 1024): the shared expert (the decoder layer calls it shared_mlp)
    shared = None
    if c.model_type == "granitemoeshared":
        shared = c.get("shared_intermediate_size", default=0) or None
    elif c.model_type == "granitemoehybrid":
        shared = c.get("shared_intermediate_size", default=1024)
    if not c.get("num_local_experts", default=8):  # transformers' block_sparse_moe None: no MoE block
        raise ValueError(
            f"config['num_local_experts'] = 0: a {c.model_type!r} layer without experts has no MoE block "
            "(Granite 4.0's dense layers: the shared MLP alone)"
        )
    return MoEConfig(
        **_moe_sizes(c, ("num_local_experts",), "intermediate_size"),
        router="topk_softmax",
        hidden_act=c.get("hidden_act", default="silu"),
        router_name="router",
        shared_intermediate_size=shared,
    )


def _moe_lfm2_moe(c: _Loose) -> MoEConfig:
    # sigmoid scores, the expert bias for the choice only (use_expert_bias), w / (sum w + 1e-6);
    # keys experts.*, gate.weight, expert_bias (the decoder layer calls the block feed_forward)
    return MoEConfig(
        **_moe_sizes(c, ("num_experts",), "moe_intermediate_size"),
        router="sigmoid",
        norm_topk_prob=c.flag("norm_topk_prob", True),
        routed_scaling_factor=c.get("routed_scaling_factor", default=1.0),
        norm_topk_eps=_LFM2_MOE_NORM_EPS,
        correction_bias=c.flag("use_expert_bias", True),
        experts_first=True,
    )


_MOE_READERS = {
    "gpt_oss": _moe_gpt_oss,
    "deepseek_v3": _moe_deepseek_v3,
    "deepseek_v32": _moe_deepseek_v3,
    "kimi_linear": _moe_kimi_linear,
    "qwen3_next": _moe_qwen3_next,
    "qwen3_5_moe_text": _moe_qwen3_5_moe,
    "qwen3_moe": _moe_qwen3_moe,
    "mixtral": _moe_mixtral,
    "qwen2_moe": _moe_qwen2_moe,
    "olmoe": _moe_olmoe,
    "granitemoe": _moe_granitemoe,
    "granitemoeshared": _moe_granitemoe,
    "granitemoehybrid": _moe_granitemoe,
    "lfm2_moe": _moe_lfm2_moe,
}


def moe_config(config) -> MoEConfig:
    """``SparseMoeBlock``'s arguments for a decoder layer of a Hugging Face model, from its config.

    ``config``: a mapping (``PretrainedConfig.to_dict()``) or a config object, with ``model_type``
    one of ``"gpt_oss"``, ``"deepseek_v3"``, ``"qwen3_next"``, ``"qwen3_moe"``, ``"mixtral"``,
    ``"qwen2_moe"``, ``"olmoe"``, ``"granitemoe"``, ``"granitemoeshared"``, ``"granitemoehybrid"``, ``"lfm2_moe"`` (the
    fields each reads: ``SparseMoeBlock.from_hf_config``).

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
    c = _Loose(config)
    if not isinstance(c.model_type, str) or c.model_type not in _MOE_READERS:
        raise ValueError(
            f"config: model_type expected one of {', '.join(map(repr, _MOE_READERS))}, got {c.model_type!r}"
        )
    return _MOE_READERS[c.model_type](c)


# GptOssConfig's rope_parameters when the config has none (its rope_theta read beside it)
_GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}

_READERS = {
    "llama": _llama,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "olmoe": _olmoe,
    "gemma2": _gemma2,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "gemma3_text": _gemma3,
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _deepseek_v3,
    "qwen3_next": _qwen3_next,
    "olmo2": _olmo2,
    "phi3": _phi3,
    "olmo3": _olmo3,
    "qwen3_5_text": _qwen3_5,
    "qwen3_5_moe_text": _qwen3_5,
    "kimi_linear": _kimi_linear,
    "deepseek_v32": _deepseek_v32,
    "gemma4_text": _gemma4,
    "smollm3": _smollm3,
    "granite": _granite,
    "granitemoe": _granitemoe,
    "granitemoeshared": _granitemoeshared,
    "granitemoehybrid": _granitemoehybrid,
    "lfm2": _lfm2,
    "lfm2_moe": _lfm2_moe,
    "falcon_h1": _falcon_h1,
    "nemotron_h": _nemotron_h,
    "mamba2": _mamba2_lm,
    "arcee": _arcee,
    "olmo": _olmo,
    "gpt_neox": _gpt_neox,
    "gpt2": _gpt2,
    "phi": _phi,
    "starcoder2": _starcoder2,
    "stablelm": _stablelm,
    "cohere2": _cohere2,
    "cohere": _cohere,
    "apertus": _apertus,
    "exaone4": _exaone4,
    "ernie4_5": _ernie4_5,
    "ministral3": _ministral3,
    "ministral": _ministral,
    "glm4": _glm4,
    "hunyuan_v1_dense": _hunyuan_v1_dense,
}


def _plain_only(fields: dict) -> None:
    """Refuse an activation with trained parameters (``xielu``) in a family whose MLPs are not all
    the plain one (``FeedForward``, which holds them as ``act_fn``): a gated MLP or experts have no
    place for them."""
    from ..nn.moe import PARAMETRIZED_ACTS

    act, kinds = fields.get("hidden_act"), set(fields.get("mlp_types", ())) - {"none"}
    if act in PARAMETRIZED_ACTS and kinds != {"plain"}:
        raise ValueError(
            f"config['hidden_act'] = {act!r} is not supported by npattn for this family's {sorted(kinds)} MLPs: "
            "its trained parameters have a place in the plain (non-gated) MLP only"
        )


def config_from_hf(config: Mapping[str, Any]) -> CausalLMConfig:
    """The ``CausalLMConfig`` of a Hugging Face config dict (``PretrainedConfig.to_dict()`` or a
    checkpoint's ``config.json``).  A key the dict leaves out means what it means to transformers
    (its config class's default; ``with_defaults``), so a short hand-written dict describes the
    same model in both.

    Parameters
    ----------
    config : mapping
        The config; ``config["model_type"]`` is one of ``SUPPORTED_MODEL_TYPES`` (this
        module's table of the families read).

    Returns
    -------
    CausalLMConfig

    Raises
    ------
    TypeError
        ``config`` is not a mapping.
    ValueError
        An unsupported ``model_type``, a missing or malformed key, or a key naming an option
        npattn does not implement (the message names the key).

    Examples
    --------
    >>> from npattn.models.configs import config_from_hf
    >>> cfg = config_from_hf({"model_type": "llama", "vocab_size": 32, "hidden_size": 16,
    ...                       "intermediate_size": 24, "num_hidden_layers": 1,
    ...                       "num_attention_heads": 4, "num_key_value_heads": 2})
    >>> cfg.model_type, cfg.num_key_value_heads, cfg.head_dim          # head_dim: 16 / 4
    ('llama', 2, 4)
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"config: expected a mapping (PretrainedConfig.to_dict()), got {type(config).__name__}")
    mt = config.get("model_type")
    if mt not in _READERS:
        raise ValueError(f"config['model_type']: expected one of {list(SUPPORTED_MODEL_TYPES)}, got {mt!r}")
    full = with_defaults(config)
    r = _Reader(full, mt)
    fields = _READERS[mt](r)
    r.finish()
    _plain_only(fields)
    return CausalLMConfig(model_type=mt, hf=full, **fields)
