"""CausalLM.from_gguf: tiny GGUF files written with gguf's own GGUFWriter (quantized by
gguf.quants.quantize, or raw random blocks for the K-quants it cannot quantize) load with the
source model's weights as llama.cpp's converter wrote them (its q/k permutation undone) and the
source model's logits."""

from __future__ import annotations

import numpy as np
import pytest
from _families import FAMILIES
from test_causal_lm_io import _model

from npattn import no_grad
from npattn.models import CausalLM

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# hidden and intermediate sizes of 256: a K-quant block is 256 values of a row
LLAMA = dict(FAMILIES["llama"], hidden_size=256, intermediate_size=256, attention_bias=False, num_attention_heads=4)
QWEN3 = dict(FAMILIES["qwen3"], hidden_size=256, intermediate_size=256, head_dim=64, use_sliding_window=False)
QWEN3.pop("sliding_window"), QWEN3.pop("max_window_layers")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (convert_hf_to_gguf.py): rotate-half rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _raw_blocks(qtype, shape, rng) -> np.ndarray:
    """Random bytes of a K-quant tensor of ``shape`` (rows, cols), its float16 scales sane."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    scales = {Q.Q4_K: (0, 4), Q.Q5_K: (0, 4), Q.Q6_K: (size - 2, size)}[qtype]  # d (and dmin) as float16
    raw[..., scales[0] : scales[1]] = (
        rng.uniform(1e-3, 1e-2, (shape[0], shape[1] // block, (scales[1] - scales[0]) // 2))
        .astype(np.float16)
        .view(np.uint8)
    )
    return raw.reshape(shape[0], -1)


def _write(path, config, sd, qtype, arch):
    """``sd`` (Hugging Face names) as a GGUF file of ``arch``, 2-D weights in ``qtype``, norms
    float32; returns {HF name: the float32 values the file holds, in llama.cpp's row order}."""
    rng = np.random.default_rng(7)
    H, heads = config["hidden_size"], config["num_attention_heads"]
    kv, hd = config["num_key_value_heads"], config.get("head_dim", H // heads)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(64)
    w.add_embedding_length(H)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    w.add_rope_freq_base(config.get("rope_theta", 10000.0))
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], 2)
    held = {}
    for key, value in sd.items():
        value = np.asarray(value, np.float32)
        if arch == "llama" and key.endswith(("q_proj.weight", "k_proj.weight")):
            value = _permute(value, heads if "q_proj" in key else kv)
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if value.ndim == 1 or qtype == Q.F32:
            w.add_tensor(name, value)
            held[key] = value
        elif qtype == Q.F16:
            w.add_tensor(name, value.astype(np.float16))
            held[key] = value.astype(np.float16).astype(np.float32)
        else:
            data = (
                _raw_blocks(qtype, value.shape, rng)
                if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K)
                else gguf.quants.quantize(value, qtype)
            )
            w.add_tensor(name, data, raw_dtype=qtype)
            held[key] = gguf.quants.dequantize(data, qtype).reshape(value.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def _unpermuted(held: dict, config: dict, arch: str) -> dict:
    """The file's values in Hugging Face's row order: llama.cpp's permutation (llama files only)
    inverted as a row index."""
    out = dict(held)
    for key, v in held.items():
        if arch == "llama" and key.endswith(("q_proj.weight", "k_proj.weight")):
            n = config["num_attention_heads"] if "q_proj" in key else config["num_key_value_heads"]
            order = _permute(np.arange(v.shape[0]), n)
            out[key] = v[np.argsort(order)]
    return out


def _logits(m, ids):
    with no_grad():
        return m(ids)


CASES = [(LLAMA, "llama"), (QWEN3, "qwen3")]


@pytest.mark.parametrize("config, arch", CASES)
def test_f32_file_is_the_source_model(tmp_path, config, arch):
    src = _model(config)
    _write(tmp_path / "m.gguf", config, src.state_dict(), Q.F32, arch)
    loaded = CausalLM.from_gguf(tmp_path / "m.gguf")
    for k, v in src.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[k], v, err_msg=k)
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 6))
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(src, ids))


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("config, arch", CASES)
def test_quantized_file_is_its_dequantized_model(tmp_path, config, arch, qtype):
    src = _model(config)
    held = _write(tmp_path / "m.gguf", config, src.state_dict(), qtype, arch)
    want = _unpermuted(held, config, arch)
    loaded = CausalLM.from_gguf(tmp_path / "m.gguf")
    for k, v in loaded.state_dict().items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)
    if arch == "llama":  # the permutation matters: the file's rows are not Hugging Face's
        assert not np.array_equal(
            held["model.layers.0.self_attn.q_proj.weight"], want["model.layers.0.self_attn.q_proj.weight"]
        )
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 6))
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(CausalLM.from_hf(want, config), ids))
    if qtype in (Q.F16, Q.BF16, Q.Q8_0):  # close to the source model too
        got, ref = _logits(loaded, ids), _logits(src, ids)
        assert np.abs(got - ref).max() <= 0.03 * np.abs(ref).max()


def test_unknown_type_and_architecture_are_refused(tmp_path):
    src = _model(LLAMA)
    _write(tmp_path / "q41.gguf", LLAMA, src.state_dict(), Q.Q4_1, "llama")
    with pytest.raises(ValueError, match=r"tensor 'token_embd.weight' has type Q4_1"):
        CausalLM.from_gguf(tmp_path / "q41.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"general.architecture 'phi2' is not supported"):
        CausalLM.from_gguf(tmp_path / "phi.gguf")
    (tmp_path / "not.gguf").write_bytes(b"GGUX" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        CausalLM.from_gguf(tmp_path / "not.gguf")
    with pytest.raises(FileNotFoundError):
        CausalLM.from_gguf(tmp_path / "missing.gguf")
