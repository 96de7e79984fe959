"""GGUF files (llama.cpp's format) into a ``CausalLM``, read by the ``gguf`` package.

``gguf`` is llama.cpp's own Python reader (numpy only; the extra ``gguf``).  A GGUF file holds
the model's metadata (``general.architecture``, ``<arch>.block_count``, ``<arch>.attention.head_count``,
..., the tokenizer under ``tokenizer.ggml.*``) and its tensors under llama.cpp's names
(``token_embd.weight``, ``blk.{i}.attn_q.weight``, ``blk.{i}.ffn_gate_exps.weight``, ...), each in
a GGML type: ``F32``, ``F16``, ``BF16`` or a block quantization (the legacy ``Q8_0`` ... ``Q5_1``,
the k-quants ``Q2_K`` ... ``Q6_K``, the i-quants, the ternary ``TQ1_0``/``TQ2_0``, ``MXFP4`` and
``NVFP4``: ``GGUF_TYPES``).  The architectures read (``llama``, whose files with experts are
Mixtral's, ``qwen2``, ``qwen2moe``, ``qwen3``, ``qwen3moe``, ``olmoe``, ``gemma2``, ``gemma3``,
``smollm3``, ``phi3``, ``granite``, ``granitemoe``, ``granitehybrid`` (with Mamba-2 layers), ``lfm2``, ``lfm2moe``,
``olmo2``, whose files with a sliding window are OLMo 3's, ``exaone4``, ``ernie4_5``, ``glm4``, ``mistral3``,
Ministral 3's or Mistral Small 3.x's text model, ``arcee``, ``olmo`` (the first OLMo), ``apertus``
(its xIELU's numbers per layer in the metadata ``xielu.*``: ``GgufFamily.per_layer``), ``falcon-h1``,
Falcon-H1's, ``nemotron_h``, Nemotron-H's, ``nemotron_h_moe``, Nemotron 3's with routed experts, ``mamba2``,
``command-r``, Command R's, ``cohere2``, Command R7B's,
``hunyuan-dense``, ``starcoder2``, ``gptneox``, Pythia's and GPT-NeoX-20B's, ``phi2``, Phi-1's, Phi-1.5's and
Phi-2's, their head's bias ``output.bias``, ``gpt2``, GPT-2's, its learned positions
``position_embd``, ``stablelm``, StableLM-3B-4E1T's and StableLM 2's, the
12B's per-head q/k LayerNorms and parallel residual read off its tensors) and what each means in Hugging Face terms (a
``granite`` or ``granitemoe`` file may hold Granite 4.0 or GraniteMoeShared: ``_gguf_granite``) are
``GGUF_FAMILIES`` in ``models/configs.py``.

Reading one:

1. the metadata becomes the Hugging Face config dict of the same network (``_config``): the keys
   every architecture has (llama.cpp's defaults for the optional ones a file leaves out,
   ``_llama_cpp_defaults``), the family's own (``GgufFamily.keys``: the experts' counts), and what
   llama.cpp derives rather than reads (``GgufFamily.derive``: Gemma 3's sliding-window pattern of
   6, its sliding layers' RoPE base and its score scale; Phi-3's partial rotary from
   ``rope.dimension_count``; an ``olmo2`` file with a sliding window is OLMo 3's, its layer pattern
   and YaRN on its full layers); the dict goes through ``config_from_hf`` as a ``config.json`` would;
2. every tensor name is translated by ``gguf``'s own ``TensorNameMap`` (the table llama.cpp's
   converter writes with), from the names the config says the model has; the experts' fused
   ``gate_up_proj`` ``(E, 2I, H)`` is the file's ``ffn_gate_exps`` and ``ffn_up_exps`` joined (an
   early Mixtral file's experts apart, ``ffn_gate.{x}``, ``ffn_up.{x}``, ``ffn_down.{x}``, are
   stacked as llama.cpp's loader stacks them: ``_per_expert``);
3. each tensor is dequantized by ``gguf.quants.dequantize`` (float32) when it is loaded, one at a
   time, straight into its parameter;
4. llama.cpp's converter reorders the rows of a ``llama`` model's q and k projections for its
   interleaved RoPE (``LlamaModel.permute`` in ``convert_hf_to_gguf.py``: each head's rows
   ``(2, D/2)`` become ``(D/2, 2)``; a ``smollm3``, ``granite``, ``granitemoe``, ``granitehybrid``,
   ``mistral3``, ``arcee`` or ``olmo`` model's too,
   their converters being Llama's; q's and k's biases alike); the reverse reordering gives back
   Hugging Face's rotate-half rows (a ``smollm3`` file's NoPE layers are llama.cpp's fixed every
   fourth).  An ``ernie4_5``, ``command-r`` or ``cohere2`` file is not permuted: ERNIE 4.5 and
   Cohere's models themselves rotate the pairs ``(2i, 2i + 1)`` (``CausalLMConfig.rope_interleaved``),
   llama.cpp's normal RoPE; nor is a
   ``glm4`` file (GLM-4's pairs are those too, over its first ``rope.dimension_count`` features;
   ``Glm4Model`` reorders them only for GLM-4V's M-RoPE, refused).  The other
   architectures' files use the rotate-half (NeoX) RoPE and are not permuted.  The converter
   stores Gemma's norm weights as ``1 + w`` (what
   ``Gemma3RMSNorm`` multiplies by; ``Gemma3Model.norm_shift``): one is subtracted again.
   Llama 3.x files keep their RoPE scaling (Hugging Face's ``rope_scaling`` ``"llama3"``) not in the
   metadata but as the divisors of the tensor ``rope_freqs.weight``, which becomes that
   ``rope_scaling`` again (``_rope_freqs_scaling``); Phi-3's LongRoPE factors are the tensors
   ``rope_factors_long.weight`` and ``rope_factors_short.weight``, which become its
   ``rope_scaling`` ``"longrope"`` (``_longrope_scaling``);
5. a ``phi3`` file keeps Phi-3's checkpoint's fused projections (``attn_qkv``: q, k, v rows;
   ``ffn_up``: gate then up rows, as ``gate_up_proj``; a ``glm4`` file its ``ffn_up`` so, its norms
   after attention and after the MLP being ``post_attention_norm`` and ``post_ffw_norm``, the one
   before the MLP ``ffn_norm``): they are given to ``load_into`` under the
   checkpoint's fused names (``CheckpointLayout.fused``), which splits them as it splits a
   checkpoint's, each part dequantizing only its own rows' blocks (``_GGUFTensor.rows``); a file
   with ``attn_q``/``attn_k``/``attn_v`` apart (llama.cpp's loader takes either) is read as it is.
   A ``gptneox`` file's ``attn_qkv`` (weight and bias) is the checkpoint's per-head
   ``query_key_value`` (``CheckpointLayout.fused_groups``) that ``GPTNeoXModel.modify_tensors``
   reordered into all q rows, all k rows, all v rows: each part is its own rows of it
   (``_part_rows``), not the checkpoint's per-head split.  A ``gpt2`` file's ``attn_qkv`` is
   found under the checkpoint's name (``transformer.h.{i}.attn.c_attn``, which gguf's map knows);
   ``GPT2Model.modify_tensors`` transposed the checkpoint's ``Conv1D`` weights back to ``(out,
   in)``, so the file's tensors are the model's layout (``CheckpointLayout.transposed`` is a
   checkpoint's, not a file's);
6. a ``granitehybrid`` file's Mamba-2 layers (``head_count_kv`` 0; their sizes the ``ssm.*`` keys,
   ``_gguf_mamba2`` in ``models/configs.py``) are stored as ``Mamba2Model.modify_tensors`` in
   ``convert_hf_to_gguf.py`` writes them: ``A_log`` as ``ssm_a`` = ``-exp(A_log)`` of shape
   ``(H, 1)``, read back as ``log(-A)`` (``_a_log``); ``D`` as ``ssm_d`` ``(H, 1)`` (both named
   without ``.weight``); ``dt_bias`` as ``ssm_dt.bias``; the gated norm's weight ``(I,)`` as
   ``ssm_norm`` ``(n_group, I / n_group)`` (``_converter_shape``); the convolution ``(C, 1, K)``
   as ``ssm_conv1d`` ``(C, K)``; the biases of the convolution and of the projections are the
   file's ``ssm_conv1d.bias`` and ``ssm_in.bias`` / ``ssm_out.bias`` where it has them;
7. a ``falcon-h1`` file (``FalconH1Model``, a ``Mamba2Model``: every layer attention and Mamba-2
   side by side, stored as in 6., q/k not permuted; the MLP's norm ``blk.{i}.ffn_norm`` without
   ``.weight``: ``_lookup``) holds its weights with every muP multiplier multiplied in and none in
   the metadata: ``embedding_multiplier`` in ``token_embd``, ``lm_head_multiplier`` in ``output``,
   ``attention_in_multiplier`` in ``attn_q``/``attn_k``/``attn_v`` (and ``key_multiplier`` in
   ``attn_k``), ``attention_out_multiplier`` in ``attn_output``, ``ssm_in_multiplier`` and the
   five ``ssm_multipliers`` (rows z, x, B, C, dt) in ``ssm_in``, ``ssm_out_multiplier`` in
   ``ssm_out``, ``mlp_multipliers`` in ``ffn_gate`` and ``ffn_down``.  With the factors unknown the
   folds cannot be undone: the model keeps the folded weights with every multiplier 1, the network
   llama.cpp computes (the checkpoint's up to the folds' float32 roundings, exactly where a
   multiplier is a power of two), and ``save_pretrained`` writes it so (``_gguf_falcon_h1`` in
   ``models/configs.py``: the gate before the grouped norm, biases);
8. a ``nemotron_h`` file (``NemotronHModel``, a ``GraniteHybridModel``: q/k permuted though no
   layer rotates; Mamba-2 blocks stored as in 6.) records each block's kind per layer: both
   ``attention.head_count_kv`` and ``feed_forward_length`` 0, Mamba-2; a head count, attention; a
   width, the relu2 MLP ``ffn_up``/``ffn_down`` (``_gguf_nemotron_h`` in ``models/configs.py``).
   gguf's map knows its Mamba-2 and MLP tensors by the checkpoint's ``backbone.layers.{i}.mixer.*``
   names only (``_lookup``: ``CheckpointLayout.renames``).  llama.cpp's scan clips no step: the
   model's ``time_step_min`` is 0.  A ``nemotron_h_moe`` file (Nemotron 3 Nano 30B-A3B) is one whose
   widths mark routed-experts blocks: the stacked ``ffn_up_exps``/``ffn_down_exps`` (relu2, not
   gated; the converter's merged ``model.layers.{i}.mlp.experts.*``), the router ``ffn_gate_inp``
   and its choice bias ``exp_probs_b``, the shared expert ``ffn_up_shexp``/``ffn_down_shexp``, the
   latent projections ``ffn_latent_down``/``ffn_latent_up`` (``_gguf_nemotron_h_moe``);
9. a ``mamba2`` file (``Mamba2Model``: Mamba-2 blocks alone, stored as in 6., under the
   checkpoint's ``backbone.*`` names as in 8.) has no attention: its ``attention.head_count`` and
   ``feed_forward_length`` are 0 (``GgufFamily.attention``), its sizes the ``ssm.*`` keys
   (``_gguf_mamba2_lm`` in ``models/configs.py``).
"""

from __future__ import annotations

import functools
import math
import numbers
import os
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .._hints import install_hint
from ..functional._bfloat16 import to_bfloat16_bits
from ..functional.rope_scaling import inverse_frequencies
from .configs import GGUF_FAMILIES
from .hf import LazyTensor, _Mapping, _short, check_weights_dtype, checkpoint_key, load_into, rounds_into_bits
from .save import _renamed

__all__ = [
    "from_gguf",
    "read_gguf",
    "gguf_tokenizer",
    "gguf_chat_template",
    "GGUF_TYPES",
    "GGUF_PRE_TOKENIZERS",
    "GgufPreTokenizer",
]

# the GGML types npattn reads, each dequantized by gguf.quants.dequantize (the installed gguf must
# know it: ``_dequantizes``): every type of the quantization mixes llama.cpp releases (Q4_K_M takes
# Q4_K and Q6_K, Q3_K_M Q3_K to Q6_K, IQ4_XS, MXFP4_MOE for the experts, ...)
GGUF_TYPES = (
    *("F32", "F16", "BF16"),
    *("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"),  # blocks of 32: a scale (and a minimum)
    *("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"),  # k-quants: blocks of 256, scaled sub-blocks
    *("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS"),  # i-quants: grids
    *("TQ1_0", "TQ2_0"),  # ternary
    *("MXFP4", "NVFP4"),  # 4-bit floats: one shared scale per 32 (a power of two) or per 16 (an FP8)
)


def _gguf():
    """The ``gguf`` package, imported when a GGUF file is read."""
    try:
        import gguf
    except ImportError:
        raise ImportError(f"reading GGUF files needs the gguf package: {install_hint('gguf')}") from None
    return gguf


# config key <- metadata key under "<arch>."; required unless marked optional below
_COMMON = {
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "rope_theta": "rope.freq_base",
    "max_position_embeddings": "context_length",
    "head_dim": "attention.key_length",
}
_OPTIONAL = {"num_key_value_heads", "rope_theta", "max_position_embeddings", "head_dim"}


def _llama_cpp_defaults(config: dict) -> dict:
    """What llama.cpp takes for an optional key a file leaves out (``llm_load_hparams``): as many
    key/value heads as query heads, heads of ``embedding_length / head_count`` dimensions, a RoPE
    base of 10000; not the Hugging Face family's defaults (Qwen3's and Gemma 3's ``head_dim`` are
    128 and 256, Gemma 3's ``num_key_value_heads`` 4), which would build another network than the
    one the file holds."""
    heads = config["num_attention_heads"]
    return {"num_key_value_heads": heads, "head_dim": config["hidden_size"] // heads, "rope_theta": 10000.0}


# metadata keys read only to be checked (against the config they imply)
_CHECKED = {"vocab_size", "rope.dimension_count", "attention.value_length"}

_ARCHES = GGUF_FAMILIES


@dataclass
class _File:
    """A GGUF file opened: its path, the reader, the architecture and its metadata by key."""

    path: str
    reader: object
    arch: str
    meta: dict


def _read(path) -> _File:
    """The file opened by ``gguf.GGUFReader`` (``_reader_class``) and its metadata (any
    architecture).  The reader parses every metadata array item by item when it opens a file (a
    tokenizer's 150k-260k tokens, scores, types and merges take seconds), so the last two files
    read are kept, by path, size and modification time: ``npattn generate`` reads the model, the
    tokenizer and the chat template from one parse."""
    _gguf()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"path: no such file {path!r}")
    st = os.stat(path)
    return _read_once(path, st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=None)
def _reader_class():
    """``gguf.GGUFReader`` reading the file through npattn's own read-only map of it
    (``hf._Mapping``: a plain uint8 array, and ``release`` for the pages of a tensor once read, so
    loading holds the model and not the model plus the file, as for safetensors).  The reader
    slices its ``data`` once per value it parses (a tokenizer's 150k-260k tokens, scores, types
    and merges are millions of slices), and every slice of its own ``np.memmap`` runs memmap's
    Python-level ``__getitem__`` and ``__array_finalize__``: two thirds of the time to open a
    262k-token file.  A slice of a plain array runs neither.  The same bytes; the tensors'
    ``data`` are views of them as before."""

    class _Reader(_gguf().GGUFReader):
        mapping: _Mapping | None = None

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, m):
            if isinstance(m, np.memmap) and m.mode == "r" and m.filename and m.size:
                self.mapping = _Mapping(os.fspath(m.filename), m.size)
                self._plain = self.mapping.array
            else:  # pragma: no cover - another mode: its own map, as a plain view
                self._plain = m.view(np.ndarray) if isinstance(m, np.memmap) else m

    return _Reader


@functools.lru_cache(maxsize=2)
def _read_once(path: str, size: int, mtime_ns: int, inode: int) -> _File:
    try:
        reader = _reader_class()(path)
    except Exception as e:  # the reader's own errors (a bad magic, a truncated file) name no file
        raise ValueError(f"{path}: not a GGUF file gguf can read ({type(e).__name__}: {_short(str(e))})") from None
    meta = {}
    for key, f in reader.fields.items():
        if not key.startswith("GGUF."):
            try:
                meta[key] = f.contents()
            except Exception:  # pragma: no cover - a field type this gguf version cannot decode
                meta[key] = None
    return _File(path, reader, meta.get("general.architecture"), meta)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=None)
def _dequantizes(kind: str) -> bool:
    """Whether the installed ``gguf`` dequantizes the GGML type ``kind`` (asked of one block of
    zeros: gguf's releases added types over time, and an older one raises NotImplementedError)."""
    gguf = _gguf()
    qtype = gguf.GGMLQuantizationType[kind]
    try:
        gguf.quants.dequantize(np.zeros(gguf.GGML_QUANT_SIZES[qtype][1], np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _open(path) -> _File:
    f = _read(path)
    count = f.meta.get("split.count")
    if isinstance(count, int) and count > 1:  # llama.cpp's gguf-split: the model's tensors over several files
        no = f.meta.get("split.no")
        part = f"part {no + 1} of {count}" if isinstance(no, int) else f"one of {count} parts"
        raise ValueError(
            f"{f.path}: {part} of a split GGUF model (split.count {count}); npattn reads the whole model "
            "from one file: merge the parts first (llama.cpp's llama-gguf-split --merge)"
        )
    if f.arch not in _ARCHES:
        raise ValueError(
            f"{f.path}: general.architecture {_short(f.arch)} is not supported (npattn reads {sorted(_ARCHES)})"
        )
    return f


def _config(f: _File, tensor_names: set) -> dict:
    """The Hugging Face config dict of the GGUF file's model."""
    spec, arch, meta = _ARCHES[f.arch], f.arch, f.meta
    config: dict = spec.base_config()
    required = {**_COMMON, spec.eps[0]: spec.eps[1]}  # the norms' epsilon: RMSNorm's or LayerNorm's
    for key, suffix in (*required.items(), *spec.keys.items()):
        name = f"{arch}.{suffix}"
        if name in meta:
            config[key] = meta[name]
        elif key in required and key not in _OPTIONAL:
            raise ValueError(f"{f.path}: no metadata {name!r} (the model's {key})")
    for key in ("hidden_size", "num_attention_heads"):  # what the defaults are derived from
        value = config[key]
        if key == "num_attention_heads" and not spec.attention:  # (Mamba-2: no attention, head_count 0)
            if value != 0:
                raise ValueError(
                    f"{f.path}: metadata '{arch}.{_COMMON[key]}': expected 0 (a {arch} model has no attention), "
                    f"got {_short(value)}"
                )
            config[key] = 1  # for the defaults below, which the family's derive drops
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{f.path}: metadata '{arch}.{_COMMON[key]}': expected an integer >= 1, got {_short(value)}"
            )
    for key, value in _llama_cpp_defaults(config).items():
        config.setdefault(key, value)
    known = {f"{arch}.{s}" for s in (*required.values(), *_CHECKED, *spec.keys.values(), *spec.reads)}
    unknown = sorted(k for k in meta if k.startswith(f"{arch}.") and k not in known)
    if unknown:
        raise ValueError(f"{f.path}: metadata {unknown[0]!r} is not supported by npattn's GGUF reader")
    embed = next((t for t in f.reader.tensors if t.name == "token_embd.weight"), None)  # type: ignore[attr-defined]
    if embed is None:
        raise ValueError(f"{f.path}: no tensor 'token_embd.weight'")
    config["vocab_size"] = int(embed.shape[-1])  # GGUF shapes are innermost first: (hidden, vocab)
    if meta.get(f"{arch}.vocab_size", config["vocab_size"]) != config["vocab_size"]:
        raise ValueError(
            f"{f.path}: metadata '{arch}.vocab_size' {meta[f'{arch}.vocab_size']} differs from token_embd.weight's "
            f"{config['vocab_size']} rows"
        )
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    config["attention_bias"] = any(n.startswith("blk.") and n.endswith(".attn_q.bias") for n in tensor_names)
    for key, (weight, bias) in spec.biases.items():  # (a hybrid's first block may be of another kind)
        if any(n.startswith("blk.") and n.endswith(f".{weight}") for n in tensor_names):
            config[key] = any(n.startswith("blk.") and n.endswith(f".{bias}") for n in tensor_names)
    if "blk.0.ffn_up.bias" in tensor_names:  # the MLP's biases (Llama's and Granite's mlp_bias)
        config["mlp_bias"] = True
    for key in ("bos_token_id", "eos_token_id"):  # the padding id is generate's (from_gguf), not the embedding's
        if f"tokenizer.ggml.{key}" in meta:
            config[key] = meta[f"tokenizer.ggml.{key}"]
    head_dim = config["head_dim"]
    for suffix in ("rope.dimension_count", "attention.value_length"):
        if suffix in spec.reads:  # the family's own (Phi-3's partial rotary: GgufFamily.derive)
            continue
        value = meta.get(f"{arch}.{suffix}", head_dim)
        if value != head_dim:
            raise ValueError(
                f"{f.path}: metadata '{arch}.{suffix}' is {value}, but the heads have {head_dim} dimensions (npattn "
                "reads full-width RoPE and equal key and value heads)"
            )
    if spec.derive is not None:
        try:
            spec.derive(config, {k[len(arch) + 1 :]: v for k, v in meta.items() if k.startswith(f"{arch}.")})
        except ValueError as e:
            raise ValueError(f"{f.path}: {e}") from None
    return config


# Llama 3.x's RoPE scaling, which llama.cpp's converter stores not as metadata but as the tensor
# rope_freqs.weight: one divisor per rotated pair, the angle of pair i at position p being
# p base^(-2i/d) / rope_freqs[i] (LlamaModel.generate_extra_tensors in convert_hf_to_gguf.py, from
# the config's rope_scaling "llama3").  Every Llama 3.x release (3.1 with factor 8, 3.2 with 32,
# 3.3) has these three values; the factor is read off the divisors (the longest wavelengths take it).
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_ROPE_FREQS = "rope_freqs.weight"


def _rope_freqs_scaling(f: _File, t, config: dict) -> dict:
    """The Hugging Face ``rope_scaling`` of a file's ``rope_freqs.weight`` (``t``): Llama 3's, where
    the divisors are those its converter computes from it (to float32's precision); anything else
    is refused by name rather than read as another network."""
    gguf = _gguf()
    if "rope_parameters" in config:  # a family with a RoPE dict per kind of layer (Gemma 3)
        raise ValueError(f"{f.path}: tensor {_ROPE_FREQS!r} is not supported in a {f.arch} file")
    if config.get("rope_scaling", {}).get("rope_type") not in (None, "default"):  # the metadata's YaRN (arcee's)
        raise ValueError(f"{f.path}: tensor {_ROPE_FREQS!r} beside the file's YaRN (rope.scaling.type)")
    d = config["head_dim"]
    divisors = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float64).reshape(-1)
    factor = float(divisors.max(initial=0.0))
    params = {"rope_type": "llama3", "factor": factor, **_LLAMA3_ROPE}
    want = None
    if divisors.shape == (d // 2,) and factor >= 1.0:
        base = config["rope_theta"]
        want = inverse_frequencies(d, base, {"rope_type": "default"})[0] / inverse_frequencies(d, base, params)[0]
    if want is None or not np.allclose(divisors, want, rtol=1e-5, atol=0.0):
        raise ValueError(
            f"{f.path}: tensor {_ROPE_FREQS!r} holds RoPE divisors that are not Llama 3's scaling (a factor "
            f"with low_freq_factor 1, high_freq_factor 4 and original_max_position_embeddings 8192, over "
            f"{d // 2} pairs), the only ones npattn reads"
        )
    return params


# Phi-3's LongRoPE, which llama.cpp's converter stores as two tensors of one factor per rotated
# pair (Phi3MiniModel.generate_extra_tensors: the config's long_factor and short_factor, float32)
# and the attention factor it computes from max_position_embeddings / original_max_position_embeddings
# as transformers does (rope.scaling.attn_factor, float32).  llama.cpp picks the long factors
# for a context (n_ctx per sequence) longer than rope.scaling.original_context_length
# (llama_model::get_rope_factors(cparams, il); its newest phi3 graph also passes the batch's
# largest position, a use not read here); transformers per forward call, for a sequence (its
# largest position + 1) longer than it: npattn's longrope does as transformers.
_ROPE_FACTORS = {"long_factor": "rope_factors_long.weight", "short_factor": "rope_factors_short.weight"}


def _longrope_scaling(f: _File, tensors: dict, config: dict) -> dict:
    """The Hugging Face ``rope_scaling`` of a ``phi3`` file's ``rope_factors_long.weight`` and
    ``rope_factors_short.weight``: ``{"rope_type": "longrope", "long_factor": ..., "short_factor":
    ...}``, with ``attention_factor`` only where the file's ``rope.scaling.attn_factor`` is not
    (to float32's precision) the one transformers computes from ``context_length`` and
    ``rope.scaling.original_context_length``.  One without the other, factors of another length
    than the rotated pairs', or no original length are refused by name."""
    gguf = _gguf()
    missing = [n for n in _ROPE_FACTORS.values() if n not in tensors]
    if missing:
        raise ValueError(f"{f.path}: no tensor {missing[0]!r} (LongRoPE's factors come in pairs, long and short)")
    original_key = f"{f.arch}.rope.scaling.original_context_length"
    original, longest = f.meta.get(original_key), config.get("max_position_embeddings")
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ValueError(f"{f.path}: metadata {original_key!r}: expected an integer >= 1 beside LongRoPE's factors")
    pairs = int(config["head_dim"] * config.get("partial_rotary_factor", 1.0)) // 2
    params: dict = {"rope_type": "longrope"}
    for key, name in _ROPE_FACTORS.items():
        t = tensors[name]
        values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float64).reshape(-1)
        if values.shape != (pairs,) or not np.isfinite(values).all() or (values <= 0).any():
            raise ValueError(
                f"{f.path}: tensor {name!r} holds {values.size} numbers; LongRoPE's {key} is {pairs} positive "
                "numbers, one per rotated pair (rope.dimension_count / 2)"
            )
        params[key] = values.tolist()
    stated = f.meta.get(f"{f.arch}.rope.scaling.attn_factor")
    if stated is not None:
        factor = longest / original if isinstance(longest, int) else 1.0
        computed = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        if not math.isclose(stated, computed, rel_tol=2**-23, abs_tol=0.0):  # else: computed, in float64
            params["attention_factor"] = float(stated)
    return params


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of llama.cpp's ``LlamaModel.permute(w, n_head, n_head)``: each head's rows
    ``(D/2, 2)`` (the pairs llama.cpp's interleaved RoPE rotates) back to ``(2, D/2)``
    (Hugging Face's rotate-half halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# values dequantized at a time (_GGUFTensor._dequantize_into): 1 MiB of float32
_DEQUANTIZE_VALUES = 1 << 18


def _store(values: np.ndarray, dest: np.ndarray) -> None:
    """float32 ``values`` into ``dest``: a float array (cast), or ``uint16`` bfloat16 bits, a
    parameter kept as bfloat16 (rounded, ``to_bfloat16_bits``; ``dest`` C-contiguous)."""
    if dest.dtype == np.uint16:
        to_bfloat16_bits(values, out=dest)
    else:
        dest[...] = values


class _GGUFTensor(LazyTensor):
    """One tensor of the model under its Hugging Face name, from one or more tensors of a GGUF
    file (``parts``, joined along the second-to-last axis: the experts' gate and up projections
    are one ``(E, 2I, H)`` tensor in the model, two ``(E, I, H)`` in the file; with ``experts``
    = E, the parts are E groups, one expert's ``(I, H)`` tensors each, every group joined so and
    the groups stacked along a new first axis: an old Mixtral file's ``ffn_gate.{x}``,
    ``ffn_up.{x}``): ``numpy`` and ``read_into`` dequantize them with ``gguf.quants.dequantize``,
    then undo llama.cpp's q/k permutation where ``heads`` is set, subtract the converter's
    ``shift`` (Gemma's norms) and apply ``undo`` (Mamba-2's ``A``: ``_a_log``).  The file may
    hold the model's tensor in another shape of the same values in the same order: without the
    model's unit axes or with unit axes of its own (LFM2's and Mamba-2's convolutions ``(C, 1,
    K)`` as ``(C, K)``, Mamba-2's ``(H,)`` as ``(H, 1)``), or in ``file_shape`` (the converter's
    reshape: ``_converter_shape``)."""

    __slots__ = ("_parts", "_heads", "_shift", "_mapping", "_experts", "_undo")

    def __init__(
        self,
        name: str,
        parts: list,
        heads: int | None = None,
        shift: float = 0.0,
        mapping=None,
        model_shape=None,
        experts: int | None = None,
        undo=None,
        file_shape=None,
    ):
        group = parts if experts is None else parts[: len(parts) // experts]
        shapes = [_shape(t) for t in group]
        rows = sum(s[-2] for s in shapes) if len(shapes) > 1 else None
        self.name, self.dtype = name, "F32"
        self.shape = shapes[0] if rows is None else (*shapes[0][:-2], rows, shapes[0][-1])
        if experts is not None:
            self.shape = (experts, *self.shape)
        if len(parts) == 1 and model_shape is not None and self.shape != tuple(model_shape):
            if _squeezed(model_shape) == _squeezed(self.shape) or self.shape == file_shape:
                # unit axes squeezed or added (Qwen2-MoE's shared_expert_gate (1, H), which llama.cpp reads as
                # {n_embd}), or the converter's reshape
                self.shape = tuple(model_shape)
        self._parts, self._heads, self._shift, self._experts = parts, heads, shift, experts
        self._undo = undo
        self._mapping = mapping  # the file's _Mapping: the pages of each block released once read

    def numpy(self, dtype=None) -> np.ndarray:
        out = np.empty(self.shape, np.float32 if dtype is None else dtype)
        self.read_into(out)
        return out

    @rounds_into_bits
    def read_into(self, out: np.ndarray) -> None:
        for t, dest in self._destinations(out):
            shape = _shape(t)
            if dest.shape != shape:  # the model's unit axes the file squeezed: a view of the file's shape
                dest = dest.view()
                dest.shape = shape
            if self._heads is None:
                self._dequantize_into(t, dest)
            else:  # the permutation moves rows within each head: the whole matrix first
                values = np.empty(shape, np.float32)
                self._dequantize_into(t, values)
                _store(_unpermute(values, self._heads), dest)

    def _destinations(self, out: np.ndarray):
        """``(file tensor, the part of out it fills)`` for each of ``_parts``: the whole of ``out``,
        or its rows in turn (of ``out[e]``, expert ``e``'s, where the parts are stacked experts)."""
        per = len(self._parts) if self._experts is None else len(self._parts) // self._experts
        for first in range(0, len(self._parts), per):
            target = out if self._experts is None else out[first // per]
            start = 0
            for t in self._parts[first : first + per]:
                rows = int(t.shape[1]) if len(t.shape) > 1 else 0  # innermost first: (columns, rows, ...)
                yield t, target if per == 1 else target[..., start : start + rows, :]
                start += rows

    def _dequantize_into(self, t, dest: np.ndarray) -> None:
        """``gguf.quants.dequantize`` of the file tensor ``t`` (minus the shift, in float32) into
        ``dest`` of its shape (``_store``: floats, or bfloat16 bits), ``_DEQUANTIZE_VALUES``
        values at a time: its dequantization makes several temporaries of its input's size in
        float32 (an embedding table's would be gigabytes), and on blocks of rows that stay in
        cache it runs 1.1-2x faster.  Each block of a row is dequantized alone, so the values are
        those of the whole tensor at once."""
        quants, data = _gguf().quants, t.data  # (..., rows, bytes of a row), or (n,) for a vector
        begin = int(t.data_offset)
        if data.ndim < 2 or dest.ndim < 2:
            values = quants.dequantize(data, t.tensor_type).reshape(dest.shape)
            _store(self._finish(values), dest)
            self._release(begin, begin + data.nbytes)
            return
        rows, cols, row_bytes = data.shape[-2], dest.shape[-1], data.shape[-1] * data.itemsize
        step = max(1, _DEQUANTIZE_VALUES // cols)
        for lead in np.ndindex(*data.shape[:-2]):  # each expert of a stacked tensor
            for r in range(0, rows, step):
                part = lead + (slice(r, r + step),)
                values = quants.dequantize(data[part], t.tensor_type).reshape(-1, cols)
                _store(self._finish(values), dest[part])
                self._release(begin, begin + (min(r + step, rows) - r) * row_bytes)
                begin += (min(r + step, rows) - r) * row_bytes

    def _finish(self, values: np.ndarray) -> np.ndarray:
        """Dequantized float32 ``values`` minus the shift, then through ``undo``."""
        if self._shift:
            values = values - np.float32(self._shift)
        return values if self._undo is None else self._undo(values)

    def rows(self, start: int, stop: int) -> _GGUFTensor:
        """Rows ``start:stop`` of a one-tensor matrix (a ``phi3`` file's fused ``attn_qkv`` or
        ``ffn_up``) as a tensor of their own: a GGML tensor is stored row by row, each row its
        own blocks, so the rows are one range of the file's bytes, and ``read_into`` dequantizes
        only those (the values of the whole tensor's dequantization, block for block)."""
        (t,) = self._parts
        if self._heads is not None or t.data.ndim not in (1, 2):
            raise ValueError(f"{self.name}: rows of a permuted, joined or stacked tensor are not read apart")
        data = t.data[start:stop]  # a vector (GPT-NeoX's fused bias, float32): its elements
        shape = t.shape.copy()
        shape[-1] = stop - start  # innermost first: (columns, rows)
        row_bytes = t.data.shape[-1] * t.data.itemsize if t.data.ndim == 2 else t.data.itemsize
        part = t._replace(
            shape=shape,
            n_elements=data.shape[0] * (int(t.shape[0]) if t.data.ndim == 2 else 1),
            n_bytes=data.nbytes,
            data_offset=int(t.data_offset) + start * row_bytes,
            data=data,
        )
        return _GGUFTensor(self.name, [part], None, self._shift, self._mapping, undo=self._undo)

    def _release(self, begin: int, end: int) -> None:
        if self._mapping is not None:
            self._mapping.release(begin, end)

    def __repr__(self):
        return f"_GGUFTensor({self.name!r}, shape={self.shape}, gguf={[t.name for t in self._parts]!r})"


def _fused_parts(key: str, whole: str, cfg) -> list:
    """The model's names of the parts of the fused checkpoint tensor ``whole`` that holds ``key``
    (``CheckpointLayout.fused``), in their order."""
    fused, kind = whole.rsplit(".", 1)
    for name, parts in cfg.layout.fused:
        if fused.endswith(f".{name}"):
            return [f"{fused[: -len(name)]}{part}.{kind}" for part in parts]
    raise AssertionError(key)  # pragma: no cover - checkpoint_key found it


def _part_rows(key: str, whole: str, cfg, shapes: dict) -> tuple:
    """``(start, stop)``: the rows of ``key`` in the fused ``whole`` stored part after part."""
    start = 0
    for part in _fused_parts(key, whole, cfg):
        rows = int(shapes[part][0])
        if part == key:
            return start, start + rows
        start += rows
    raise AssertionError(key)  # pragma: no cover - key is one of the parts


def _squeezed(shape) -> tuple:
    """``shape`` without its unit axes (as llama.cpp's converter stores LFM2's convolution)."""
    return tuple(int(s) for s in shape if s != 1)


def _gguf_names(names, key: str) -> list:
    """The GGUF tensors that hold the model's ``key`` (by ``gguf``'s ``TensorNameMap``): one, or
    the gate and up experts that make up ``mlp.experts.gate_up_proj``; a key the map does not
    know is returned as it is (and then missing from the file).  A Mamba-2 layer's ``dt_bias``
    is the converter's ``dt_proj.bias`` (``Mamba2Model.filter_tensors``: ``ssm_dt.bias``), its
    ``A_log`` and ``D`` are named without a suffix (``ssm_a``, ``ssm_d``)."""
    if key.endswith(".experts.gate_up_proj"):
        return [n for part in ("gate_proj", "up_proj") for n in _gguf_names(names, key[: -len("gate_up_proj")] + part)]
    for old, new in _RENAMED:
        if key.endswith(old):
            key = key[: -len(old)] + new
    name = names.get_name(key, try_suffixes=(".weight", ".bias"))
    if name is None:
        return [key]
    return [name if key.endswith((".weight", ".bias", *_BARE)) else name + ".weight"]


def _maps(names, key: str) -> bool:
    """Whether gguf's ``TensorNameMap`` knows every GGUF tensor of the model's ``key`` (both
    halves of a ``gate_up_proj``; ``_gguf_names``' renames applied)."""
    if key.endswith(".experts.gate_up_proj"):
        return all(_maps(names, key[: -len("gate_up_proj")] + part) for part in ("gate_proj", "up_proj"))
    for old, new in _RENAMED:
        if key.endswith(old):
            key = key[: -len(old)] + new
    return names.get_name(key, try_suffixes=(".weight", ".bias")) is not None


def _lookup(names, cfg, key: str, own_names: bool = False) -> str:
    """The name under which gguf's ``TensorNameMap`` knows the model's ``key``: the checkpoint's
    where the family's checkpoints rename the model's and the map knows that name
    (``CheckpointLayout.renames``: Nemotron-H's ``backbone.layers.{i}.mixer.*``, whose
    ``mixer.out_proj`` is a Mamba-2 layer's ``ssm_out``, where Llama's name would say
    ``attn_output``), else Llama's layer names (``cfg.generic_name``: a family's own undone, as
    converters that know the generic names look tensors up), or the family's own where the map
    knows only those (Falcon-H1's ``pre_ff_layernorm.weight``, the file's ``blk.{i}.ffn_norm``,
    named without ``.weight``) or where the family's file is mapped by them (``own_names``:
    ``GgufFamily.own_names``, GLM-4's).  Nemotron 3's stacked ``mixer.experts.*`` are the
    converter's merged ``model.layers.{i}.mlp.experts.*`` (``NemotronHModel.modify_tensors``)."""
    checkpoint = _renamed(key, cfg.layout.renames)
    if checkpoint != key and _maps(names, checkpoint):
        return checkpoint
    if ".mixer.experts." in key and _maps(names, merged := key.replace(".mixer.experts.", ".mlp.experts.")):
        return merged
    generic = cfg.generic_name(key)
    if generic != key and (own_names or _gguf_names(names, generic) == [generic]) and _gguf_names(names, key) != [key]:
        return key
    return generic


_CORRECTION = ".e_score_correction_bias"  # the sigmoid router's choice bias (LFM2-MoE's expert_bias)
# the model's names the converters rename before mapping: LFM2-MoE's choice bias (e_score_correction.bias,
# llama.cpp's exp_probs_b.bias), Mamba-2's dt_bias (dt_proj.bias, llama.cpp's ssm_dt.bias)
_RENAMED = ((_CORRECTION, ".e_score_correction.bias"), (".dt_bias", ".dt_proj.bias"))
# the tensors the converter names without a suffix (Mamba2Model: format_tensor_name(..., suffix=""))
_BARE = (".A_log", ".D")


def _converter_shape(name: str, model_shape, cfg) -> tuple | None:
    """The shape in which llama.cpp's converter stores the tensor ``name`` of the model's
    ``model_shape`` where it reshapes more than unit axes: a Mamba-2 layer's gated norm ``(I,)``
    as ``(n_group, I / n_group)`` (``Mamba2Model.modify_tensors``; llama.cpp normalizes each group
    apart, as transformers does); else ``None``."""
    if name.endswith(".ssm_norm.weight") and len(model_shape) == 1:
        groups = cfg.linear_attention.n_groups
        return (groups, int(model_shape[0]) // groups)
    return None


def _a_log(where: str, a: np.ndarray) -> np.ndarray:
    """``A_log`` of a Mamba-2 layer's ``ssm_a`` (``where``: the file and tensor): the converter
    stores ``A = -exp(A_log)`` (float32), so ``A_log = log(-A)``, computed in float64 (then
    rounded to the model's dtype); an ``A`` not negative has no ``A_log`` and is refused."""
    a = np.asarray(a, np.float64)
    if not (a < 0).all():
        bad = a[~(a < 0)].flat[0]
        raise ValueError(f"{where}: Mamba-2's A = -exp(A_log) must be negative, got {bad!r}")
    return np.log(-a)


_EXPS = "_exps.weight"


def _per_expert(f: _File, tensors: dict, fused: list, model_shape, key: str) -> list | None:
    """The file's tensors of each expert apart, for the experts' stacked tensors ``fused``
    (``blk.{i}.ffn_gate_exps.weight`` ...) where the file holds none of them, expert-major
    (expert 0's gate and up, expert 1's, ...); ``None`` where the file holds them stacked or no
    expert apart.  Early Mixtral files (before
    llama.cpp stacked the experts, ``ggml_mul_mat_id`` on 3-D tensors) keep each expert's matrix
    as ``blk.{i}.ffn_gate.{x}.weight``, ``ffn_up.{x}``, ``ffn_down.{x}`` (llama.cpp's
    ``LLM_TENSOR_FFN_GATE_EXP`` ...); llama.cpp's loader still reads them, as views of one stacked
    tensor per kind (``create_tensor_as_view``).  An expert missing, or of another shape than
    expert 0's of its kind, is refused by name."""
    if not fused or not all(n.endswith(_EXPS) and n not in tensors for n in fused):
        return None
    E = int(model_shape[0])
    names = [[n[: -len(_EXPS)] + f".{x}.weight" for n in fused] for x in range(E)]
    if not any(n in tensors for group in names for n in group):
        return None
    first = {n: tensors.get(n) for n in names[0]}
    parts = []
    for x, group in enumerate(names):
        for n, base in zip(group, names[0]):
            t = tensors.get(n)
            if t is None:
                raise ValueError(f"{f.path}: no tensor {n!r} (expert {x} of the model's {key!r}, {E} experts)")
            shape, want = _shape(t), _shape(first[base])  # expert 0's: present (x = 0 came first)
            if len(shape) != 2 or shape != want:
                raise ValueError(
                    f"{f.path}: tensor {n!r} has shape {shape}, expert 0's {base!r} {want} (one 2-D matrix per expert)"
                )
            parts.append(t)
    return parts


def _shape(t) -> tuple:
    """A file tensor's shape, outermost first (GGUF stores it innermost first)."""
    return tuple(int(s) for s in reversed(t.shape))


def _per_layer(f: _File, spec, key: str, shape, n_layers: int):
    """Layer ``i``'s number of ``key`` from the metadata array ``GgufFamily.per_layer`` names (one
    number per layer, or one for all, as llama.cpp's ``get_key_or_arr`` reads it), as a float32
    array of the model's ``shape``; None where ``key`` is a tensor of the file."""
    parts = key.split(".")
    if len(parts) < 4 or parts[:2] != ["model", "layers"] or ".".join(parts[3:]) not in spec.per_layer:
        return None
    name = spec.per_layer[".".join(parts[3:])]
    if name not in f.meta:
        raise ValueError(f"{f.path}: no metadata {name!r} (the model's {key!r})")
    values = f.meta[name]
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    if len(values) not in (1, n_layers) or not all(
        isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values
    ):
        raise ValueError(
            f"{f.path}: metadata {name!r}: expected one number or {n_layers} (block_count), got {_short(values)}"
        )
    return np.full(shape, values[0 if len(values) == 1 else int(parts[2])], np.float32)


def _check_types(f: _File, tensors: dict) -> None:
    """Each tensor's GGML type one npattn reads and the installed ``gguf`` dequantizes (ValueError
    naming the tensor and its type)."""
    for name, t in tensors.items():
        kind = t.tensor_type.name
        if kind not in GGUF_TYPES:
            raise ValueError(
                f"{f.path}: tensor {name!r} has type {kind}, which npattn does not read (it reads {list(GGUF_TYPES)})"
            )
        if not _dequantizes(kind):
            raise ValueError(
                f"{f.path}: tensor {name!r} has type {kind}, which the installed gguf does not dequantize "
                "(a newer gguf may: pip install --upgrade gguf)"
            )


def read_gguf(path) -> tuple[dict, dict]:
    """``(Hugging Face config dict, {Hugging Face name: lazy float32 tensor})`` of a GGUF file;
    the tensors are dequantized when read.

    Raises
    ------
    ImportError
        Without the ``gguf`` package (with the install hint).
    FileNotFoundError
        No such file.
    ValueError
        A file ``gguf`` cannot read, one part of a split model (``split.count``), an
        architecture npattn does not read, metadata missing or naming an option npattn does not
        implement (named), a tensor of a GGML type npattn does not read (named, with its type),
        or a tensor no name of the model maps to (named).
    """
    from .causal_lm import _state_shapes
    from .configs import config_from_hf

    gguf = _gguf()
    f = _open(path)
    tensors = {t.name: t for t in f.reader.tensors}  # type: ignore[attr-defined]
    _check_types(f, tensors)
    config = _config(f, set(tensors))
    if _ROPE_FREQS in tensors:
        config["rope_scaling"] = _rope_freqs_scaling(f, tensors[_ROPE_FREQS], config)
    consumed = {_ROPE_FREQS}  # tensors read into the config
    attn_factor = f"{f.arch}.rope.scaling.attn_factor"  # LongRoPE's in a phi3 file (an olmo2 file's YaRN's)
    longrope = f.arch == "phi3" or "rope.scaling.attn_factor" not in _ARCHES[f.arch].reads
    if (longrope and attn_factor in f.meta) or any(n in tensors for n in _ROPE_FACTORS.values()):
        if f.arch != "phi3":
            name = next((n for n in _ROPE_FACTORS.values() if n in tensors), attn_factor)
            raise ValueError(f"{f.path}: {name!r} (LongRoPE) is not supported in a {f.arch} file")
        config["rope_scaling"] = _longrope_scaling(f, tensors, config)
        consumed |= set(_ROPE_FACTORS.values())
    cfg = config_from_hf(config)
    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[f.arch]
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    spec = _ARCHES[f.arch]
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    out: dict = {}
    shapes = dict(_state_shapes(cfg))
    for key, model_shape in shapes.items():
        number = _per_layer(f, spec, key, model_shape, cfg.num_hidden_layers)
        if number is not None:  # one number of a metadata array (Apertus's xIELU)
            out[key] = number
            continue
        whole = checkpoint_key(key, cfg.layout)  # Phi-3's fused qkv_proj / gate_up_proj, else key
        if whole != key and not all(n in tensors for n in _gguf_names(names, whole)):
            whole_names = _gguf_names(names, _lookup(names, cfg, whole))  # GPT-2's attn.c_attn: transformer.h.*
            if all(n in tensors for n in whole_names):
                if whole not in out:  # one tensor of the file, split by load_into as a checkpoint's
                    parts = [tensors[n] for n in whole_names]
                    out[whole] = _GGUFTensor(whole, parts, mapping=getattr(f.reader, "mapping", None))
                continue
        if whole != key and all(n in tensors for n in _gguf_names(names, whole)):
            if cfg.layout.fused_groups > 1:  # GPTNeoXModel.modify_tensors: the per-head groups as [q; k; v]
                (t,) = [tensors[n] for n in _gguf_names(names, whole)]
                qkv = _GGUFTensor(whole, [t], mapping=getattr(f.reader, "mapping", None))
                start, stop = _part_rows(key, whole, cfg, shapes)
                if qkv.shape[0] != sum(int(shapes[p][0]) for p in _fused_parts(key, whole, cfg)):
                    raise ValueError(f"{f.path}: tensor {t.name!r} has shape {qkv.shape}, not the model's q, k, v rows")
                out[key] = qkv.rows(start, stop)
                continue
            if whole not in out:  # one tensor of the file: load_into splits its rows (CheckpointLayout.fused)
                fused = [tensors[n] for n in _gguf_names(names, whole)]
                out[whole] = _GGUFTensor(whole, fused, mapping=getattr(f.reader, "mapping", None))
            continue
        lookup = _lookup(names, cfg, key, spec.own_names)
        parts = [tensors.get(n) for n in _gguf_names(names, lookup)]
        experts = _per_expert(f, tensors, _gguf_names(names, lookup), model_shape, key)
        if experts is not None:
            parts = experts
        elif None in parts:
            missing = _gguf_names(names, lookup)[parts.index(None)]
            raise ValueError(f"{f.path}: no tensor {missing!r} (the model's {key!r})")
        proj = key.rsplit(".", 2)[-2]
        first = _gguf_names(names, lookup)[0]  # the file's name (Mamba-2's ssm_a and ssm_norm: read as stored)
        out[key] = _GGUFTensor(
            key,
            parts,
            heads[proj] if spec.permute_qk and proj in heads else None,
            spec.norm_shift if key.endswith("norm.weight") else 0.0,
            getattr(f.reader, "mapping", None),
            model_shape,
            None if experts is None else int(model_shape[0]),
            functools.partial(_a_log, f"{f.path}: tensor {first!r}") if first.endswith(".ssm_a") else None,
            _converter_shape(first, model_shape, cfg),
        )
    used = {t.name for v in out.values() if isinstance(v, _GGUFTensor) for t in v._parts} | consumed
    extra = [n for n in tensors if n not in used and not (n == "output.weight" and cfg.tie_word_embeddings)]
    if extra:
        raise ValueError(f"{f.path}: tensor {extra[0]!r} is not part of the {f.arch} model npattn builds")
    return config, out


def from_gguf(cls, path, dtype=None, weights_dtype=None):
    """``CausalLM.from_gguf``: ``read_gguf`` then ``load_into`` (``weights_dtype`` checked first).
    ``tokenizer.ggml.padding_token_id`` becomes the model's ``generation_config`` pad (with the
    file's eos), what a Hugging Face directory keeps in ``generation_config.json``: a config's
    ``pad_token_id`` would also make its embedding row untrainable (``padding_idx``), which the
    original model's config may not say."""
    check_weights_dtype(weights_dtype, dtype)  # before the file is read
    config, tensors = read_gguf(path)
    pad = _read(path).meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 0):
        raise ValueError(f"{os.fspath(path)}: tokenizer.ggml.padding_token_id: expected a token id, got {_short(pad)}")
    model = load_into(cls, tensors, config, dtype, weights_dtype)
    if pad is not None:
        model.generation_config = {"eos_token_id": model.config.eos_token_id, "pad_token_id": pad}
    return model


# -- the tokenizer of a GGUF file -------------------------------------------------------------------
# tokenizer.ggml.pre -> the pre-tokenizer as the original tokenizer.json states it (its regexes, not
# the ones llama.cpp's llama-vocab.cpp rewrites for its own engine), with the original BPE's
# ignore_merges and NFC normalizer (GgufPreTokenizer)
_GPT4_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
# Mistral's tekken (Mistral Nemo's tokenizer.json)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek LLM's and DeepSeek Coder's: newlines alone, then (DeepSeek LLM) runs of cased letters and of
# ASCII / full-width punctuation, trailing spaces, and both's CJK runs (Han, Korean and U+0800-U+4E00)
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LETTERS = (
    r"\s?[A-Za-z"
    "\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377"
    "\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556"
    "\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
    "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_DEEPSEEK_PUNCT = r"\s?[!-/:-~" "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"


class GgufPreTokenizer(NamedTuple):
    """How an original tokenizer.json pre-tokenizes: ``splits``, its ``Split`` regexes in order
    (each ``Isolated``, as the file states them); ``digits``, a ``Digits(individual_digits=True)``
    step after them; then ``ByteLevel``, with GPT-2's own regex where ``splits`` is empty.
    ``ignore_merges``: its BPE takes a word found whole in the vocabulary without merging;
    ``nfc``: its normalizer is NFC."""

    splits: tuple[str, ...] = ()
    digits: bool = False
    ignore_merges: bool = False
    nfc: bool = False


#: The ``tokenizer.ggml.pre`` values ``gguf_tokenizer`` reads, each as its original's tokenizer.json
#: pre-tokenizes (``GgufPreTokenizer``).
GGUF_PRE_TOKENIZERS = {
    "gpt-2": GgufPreTokenizer(),
    # Phi-1, Phi-1.5 and Phi-2's (CodeGen's GPT-2 BPE; llama-vocab.cpp reads phi-2 as gpt-2)
    "phi-2": GgufPreTokenizer(),
    "llama-bpe": GgufPreTokenizer((_GPT4_SPLIT,), ignore_merges=True),
    "llama3": GgufPreTokenizer((_GPT4_SPLIT,), ignore_merges=True),
    "llama-v3": GgufPreTokenizer((_GPT4_SPLIT,), ignore_merges=True),
    "qwen2": GgufPreTokenizer((_QWEN2_SPLIT,), nfc=True),
    # StableLM 2's Arcade100k (its tokenizer.json: Qwen2's split, stated as the matches kept, a
    # Split "Removed" inverted; no normalizer; llama-vocab.cpp reads stablelm2 with qwen2's regex)
    "stablelm2": GgufPreTokenizer((_QWEN2_SPLIT,)),
    # GLM-4-0414 / GLM-Z1 (llama.cpp's CHATGLM4 of llama-vocab.cpp: Llama 3's split, without its
    # ignore_merges; the converter names the tokenizer of THUDM/glm-4-9b-hf and GLM-4.5 "glm4")
    "glm4": GgufPreTokenizer((_GPT4_SPLIT,)),
    "tekken": GgufPreTokenizer((_TEKKEN_SPLIT,), ignore_merges=True),
    "smollm": GgufPreTokenizer(digits=True),
    # Command R's and R7B's (transformers' CohereTokenizer: NFC, each digit alone, GPT-2's split;
    # llama-vocab.cpp gives command-r smollm's regexes, "\\p{N}" before GPT-2's)
    "command-r": GgufPreTokenizer(digits=True, nfc=True),
    # StarCoder2's (its tokenizer.json: each digit alone, then GPT-2's byte-level split, no
    # normalizer; llama-vocab.cpp gives starcoder smollm's regexes)
    "starcoder": GgufPreTokenizer(digits=True),
    # GPT-NeoX-20B's and Pythia's (their tokenizer.json: NFC, GPT-2's byte-level split; the
    # converter names it "olmo", OLMo 1.7's and MPT's being the same tokenizer, and llama-vocab.cpp
    # gives olmo GPT-2's regex)
    "olmo": GgufPreTokenizer(nfc=True),
    "deepseek-llm": GgufPreTokenizer(
        ("[\r\n]", _DEEPSEEK_LETTERS, _DEEPSEEK_PUNCT, r"\s+$", _DEEPSEEK_CJK), digits=True
    ),
    "deepseek-coder": GgufPreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK), digits=True),
}
_CONTROL, _USER_DEFINED = 3, 4  # gguf.TokenType


def _tokens(f: _File) -> tuple:
    """``(tokens, token types)`` of the file's tokenizer, checked (ValueError naming the key)."""
    tokens = f.meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{f.path}: tokenizer.ggml.tokens: expected a list of strings")
    types = f.meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{f.path}: tokenizer.ggml.token_type has {len(types)} entries, tokens {len(tokens)}")
    return tokens, types


def _bpe(f: _File, vocab: dict, tk) -> tuple:
    """``(model, normalizer, pre-tokenizer, decoder)`` of a ``gpt2`` (byte-level BPE) tokenizer:
    ``tokenizer.ggml.merges`` split as llama.cpp splits them (at the first space after the first
    character), the pre-tokenizer of ``tokenizer.ggml.pre``."""
    pre = f.meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ValueError(
            f"{f.path}: tokenizer.ggml.pre {_short(pre)} is not a pre-tokenizer npattn knows "
            f"(it reads {sorted(GGUF_PRE_TOKENIZERS)})"
        )
    spec = GGUF_PRE_TOKENIZERS[pre]
    merges = f.meta.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise ValueError(f"{f.path}: tokenizer.ggml.merges: expected a list of 'a b' strings, got {_short(merges)}")
    cut = [m.find(" ", 1) if isinstance(m, str) else -1 for m in merges]
    bad = next((i for i, c in enumerate(cut) if c < 0), None)
    if bad is not None:
        raise ValueError(f"{f.path}: tokenizer.ggml.merges[{bad}] {_short(merges[bad])} is not two tokens 'a b'")
    pairs = [(m[:c], m[c + 1 :]) for m, c in zip(merges, cut)]
    model = tk.models.BPE(vocab=vocab, merges=pairs, ignore_merges=spec.ignore_merges, fuse_unk=False)
    steps = [tk.pre_tokenizers.Split(tk.Regex(s), "isolated") for s in spec.splits]
    steps += [tk.pre_tokenizers.Digits(individual_digits=True)] if spec.digits else []
    byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=not spec.splits)
    pre_tokenizer = tk.pre_tokenizers.Sequence([*steps, byte_level]) if steps else byte_level
    return model, tk.normalizers.NFC() if spec.nfc else None, pre_tokenizer, tk.decoders.ByteLevel()


def _spm(f: _File, vocab: dict, tk) -> tuple:
    """``(model, normalizer, pre-tokenizer, decoder)`` of a ``llama`` (SentencePiece BPE) tokenizer
    as llama.cpp's ``llm_tokenizer_spm`` runs it: spaces as ``▁`` (one put first where
    ``tokenizer.ggml.add_space_prefix``, llama.cpp's default true), then adjacent pieces merged
    highest ``tokenizer.ggml.scores`` first while the merged piece is in the vocabulary, a
    character outside it as its UTF-8 bytes (``<0xXX>``).  As a BPE: each piece's splits into two
    pieces of the vocabulary, ranked by its score (transformers' ``SentencePieceExtractor``)."""
    scores = f.meta.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) <= max(vocab.values()):
        raise ValueError(f"{f.path}: tokenizer.ggml.scores: expected one number per token, got {_short(scores)}")
    score = {t: float(scores[i]) for t, i in vocab.items()}
    merges = []
    for piece, i in vocab.items():
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        merges += [(score[piece], i, vocab[a], vocab[b], a, b) for a, b in splits]
    merges.sort(key=lambda m: (-m[0], m[1], m[2], m[3]))
    unk = f.meta.get("tokenizer.ggml.unknown_token_id", 0)
    tokens = {i: t for t, i in vocab.items()}
    model = tk.models.BPE(
        vocab=vocab,
        merges=[m[4:] for m in merges],
        unk_token=tokens.get(unk) if isinstance(unk, int) else None,
        byte_fallback=True,
        fuse_unk=True,
    )
    prefix = f.meta.get("tokenizer.ggml.add_space_prefix", True)
    spaces = [tk.normalizers.Replace(" ", "▁")]
    normalizer = tk.normalizers.Sequence(([tk.normalizers.Prepend("▁")] if prefix else []) + spaces)
    steps = [tk.decoders.Replace("▁", " "), tk.decoders.ByteFallback(), tk.decoders.Fuse()]
    decoder = tk.decoders.Sequence(steps + ([tk.decoders.Strip(" ", 1, 0)] if prefix else []))
    return model, normalizer, None, decoder


_TOKENIZER_MODELS = {"gpt2": _bpe, "llama": _spm}


def gguf_tokenizer(path):
    """The ``tokenizers.Tokenizer`` of a GGUF file's tokenizer, built as the original was:
    ``tokenizer.ggml.model`` ``"gpt2"`` is byte-level BPE of ``tokenizer.ggml.tokens`` (ids by
    position) and ``tokenizer.ggml.merges`` with the pre-tokenizer of ``tokenizer.ggml.pre``
    (``GGUF_PRE_TOKENIZERS``); ``"llama"`` is SentencePiece's BPE of the tokens and their
    ``tokenizer.ggml.scores`` (Llama 2's, Gemma's; byte fallback).  The ``CONTROL`` tokens are
    special and the ``USER_DEFINED`` ones added (both matched whole, first), and
    ``tokenizer.ggml.bos_token_id`` / ``eos_token_id`` are added where ``add_bos_token`` /
    ``add_eos_token`` say so.

    Raises
    ------
    ImportError
        Without the ``gguf`` or ``tokenizers`` package (with the install hint).
    FileNotFoundError
        No such file.
    ValueError
        Not a GGUF file, a tokenizer model other than ``gpt2`` and ``llama`` or a pre-tokenizer
        npattn does not know (named), malformed tokenizer metadata (named).
    """
    try:
        import tokenizers as tk
    except ImportError:
        raise ImportError(f"a GGUF file's tokenizer needs the tokenizers package: {install_hint('hf')}") from None
    f = _read(path)
    kind = f.meta.get("tokenizer.ggml.model")
    if kind not in _TOKENIZER_MODELS:
        raise ValueError(
            f"{f.path}: tokenizer.ggml.model {_short(kind)} is not a tokenizer npattn builds (it reads "
            f"{sorted(_TOKENIZER_MODELS)}): pass the prompt as token ids"
        )
    tokens, types = _tokens(f)
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}  # a repeated token: its first id
    model, normalizer, pre_tokenizer, decoder = _TOKENIZER_MODELS[kind](f, vocab, tk)
    tok = tk.Tokenizer(model)
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    kinds = list(zip(tokens, types))
    tok.add_special_tokens([tk.AddedToken(t, special=True, normalized=False) for t, k in kinds if k == _CONTROL])
    tok.add_tokens([tk.AddedToken(t, special=False, normalized=False) for t, k in kinds if k == _USER_DEFINED])
    ends = {}
    for end, default in (("bos", kind == "llama"), ("eos", False)):  # llama.cpp's defaults
        i = f.meta.get(f"tokenizer.ggml.{end}_token_id")
        if f.meta.get(f"tokenizer.ggml.add_{end}_token", default) and isinstance(i, int) and 0 <= i < len(tokens):
            ends[end] = (tokens[i], i)
    if ends:
        single = [f"{ends[e][0]}:0" if e in ends else "$A:0" for e in ("bos", "$A", "eos") if e in ends or e == "$A"]
        tok.post_processor = tk.processors.TemplateProcessing(single=single, special_tokens=list(ends.values()))
    return tok


def gguf_chat_template(path) -> tuple:
    """``(tokenizer.chat_template or None, {"bos_token": ..., "eos_token": ...})`` of a GGUF
    file: the template its converter copied from ``tokenizer_config.json`` and the special tokens
    a template refers to, by the ids of ``tokenizer.ggml.bos_token_id`` / ``eos_token_id``."""
    f = _read(path)
    tokens = f.meta.get("tokenizer.ggml.tokens") or []
    special = {}
    for end in ("bos", "eos"):
        i = f.meta.get(f"tokenizer.ggml.{end}_token_id")
        if isinstance(i, int) and 0 <= i < len(tokens):
            special[f"{end}_token"] = tokens[i]
    return f.meta.get("tokenizer.chat_template"), special
