"""GPT-NeoX (model_type gpt_neox, Pythia): the reader, the per-head fused query_key_value both ways,
and the model against transformers' GPTNeoXForCausalLM in float64."""

import numpy as np
import pytest
from _hf64 import transformers_or_none

from npattn.models import CausalLM
from npattn.models.configs import config_from_hf
from npattn.models.save import fused_tensors
from npattn.models.tiny import TINY_CONFIGS

T = transformers_or_none()
needs_hf = pytest.mark.skipif(T is None, reason="needs torch and transformers")

TINY = TINY_CONFIGS["gpt_neox"]


def _split_qkv(a, heads):
    """GPT-NeoX's fused rows, viewed as (heads, 3 * head_dim) as GPTNeoXAttention does, into q, k, v."""
    per = a.reshape(heads, 3, -1, *a.shape[1:])
    return [per[:, i].reshape(-1, *a.shape[1:]) for i in range(3)]


def _npattn_names(sd: dict, heads: int) -> dict:
    """transformers' names (gpt_neox.*, query_key_value) as npattn's model names them."""
    out = {}
    for k, v in sd.items():
        k = k.replace("gpt_neox.", "model.", 1)
        if ".query_key_value." in k:
            for part, rows in zip("qkv", _split_qkv(v, heads)):
                out[k.replace("query_key_value", f"{part}_proj")] = rows
        else:
            out[k] = v
    return out


def test_reader():
    cfg = config_from_hf(TINY)
    assert cfg.layer_norm and cfg.layer_norm_bias and cfg.parallel_residual
    assert cfg.mlp_types == ("plain", "plain") and cfg.mlp_bias and cfg.attention_bias
    assert cfg.hidden_act == "gelu" and cfg.num_key_value_heads == 4 and cfg.head_dim == 4
    assert cfg.rope["default"]["partial_rotary_factor"] == 0.5 and cfg.rope["default"]["rope_theta"] == 1000.0
    assert not cfg.pad_embedding_row and cfg.layout.fused_groups == 4
    d = config_from_hf({**TINY, "rotary_pct": None, "rotary_emb_base": None, "use_parallel_residual": False})
    assert d.rope["default"]["partial_rotary_factor"] == 0.25 and d.rope["default"]["rope_theta"] == 10000.0
    assert not d.parallel_residual
    # rope_parameters wins over rotary_pct / rotary_emb_base (GPTNeoXConfig's setdefault)
    e = config_from_hf(
        {**TINY, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0, "partial_rotary_factor": 1.0}}
    )
    assert e.rope["default"]["rope_theta"] == 7.0 and e.rope["default"]["partial_rotary_factor"] == 1.0


@pytest.mark.parametrize(
    "key, value",
    [
        ("rope_theta", 500.0),
        ("partial_rotary_factor", 0.5),
        ("num_key_value_heads", 2),
        ("head_dim", 8),
        ("hidden_dropout", 0.1),
        ("unknown_key", 1),
    ],
)
def test_refused_by_name(key, value):
    with pytest.raises(ValueError, match=key):
        config_from_hf({**TINY, key: value})


def test_fused_per_head_both_ways():
    """save's fused_tensors and the loader's split are inverse, rows interleaved per head."""
    rng = np.random.default_rng(0)
    m = CausalLM(config_from_hf(TINY), rng=0)
    sd = m.state_dict()
    fused = fused_tensors(sd, m.config.layout.fused, m.config.layout.fused_groups)
    w = fused["model.layers.0.attention.query_key_value.weight"]
    b = fused["model.layers.0.attention.query_key_value.bias"]
    assert w.shape == (48, 16) and b.shape == (48,)
    q, k, v = _split_qkv(w, 4)
    np.testing.assert_array_equal(q, sd["model.layers.0.attention.q_proj.weight"])
    np.testing.assert_array_equal(v, sd["model.layers.0.attention.v_proj.weight"])
    np.testing.assert_array_equal(b[4:8], sd["model.layers.0.attention.k_proj.bias"][:4])  # head 0's k
    ids = rng.integers(0, 41, (2, 5))
    back = CausalLM.from_hf(fused, TINY)
    np.testing.assert_array_equal(back(ids), m(ids))


@needs_hf
@pytest.mark.parametrize("parallel", [True, False])
def test_against_transformers(parallel):
    from _hf64 import build, check_cached_decoding, check_logits_and_grads, check_padded_batch, state_dict

    d = {k: v for k, v in TINY.items() if k not in ("model_type", "num_key_value_heads")}
    # the sequential block without attention biases (query_key_value and dense), the parallel one with them
    d.update(use_parallel_residual=parallel, attention_bias=parallel)
    hf, cfg = build(T.GPTNeoXConfig, T.GPTNeoXForCausalLM, **d)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    assert m.config.parallel_residual is parallel
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 41, (2, 7))
    ids[0, 2] = 0  # the pad token: its embedding row gets its gradient (no padding_idx)
    dlogits = rng.standard_normal((2, 7, 41))
    check_logits_and_grads(m, hf, ids, dlogits, grads=lambda g: _npattn_names(g, 4))
    check_cached_decoding(m, hf, ids)
    check_padded_batch(m, hf, 41, (7, 4), decode=2)


@needs_hf
def test_save_pretrained_read_by_transformers(tmp_path):
    import torch
    from _hf64 import hf_logits

    m = CausalLM(config_from_hf(TINY), rng=3)
    m.save_pretrained(tmp_path)
    hf = T.GPTNeoXForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, attn_implementation="eager").eval()
    ids = np.random.default_rng(2).integers(0, 41, (1, 6))
    ref = hf_logits(hf, ids)
    np.testing.assert_allclose(m(ids), ref, rtol=1e-9, atol=1e-9)
    from safetensors.numpy import load_file

    keys = set(load_file(tmp_path / "model.safetensors"))
    assert "embed_out.weight" in keys and "gpt_neox.embed_in.weight" in keys
    assert "gpt_neox.layers.0.attention.query_key_value.bias" in keys and "gpt_neox.final_layer_norm.bias" in keys
    assert not any("q_proj" in k or k.startswith("model.") for k in keys)


@needs_hf
@pytest.mark.parametrize("tied", [False, True])
def test_from_pretrained_reads_transformers_directory(tmp_path, tied):
    """A directory transformers writes (embed_out, gpt_neox.*, the fused query_key_value), tied or
    not (tied: the head is embed_in's table)."""
    from _hf64 import build, hf_logits

    d = {k: v for k, v in TINY.items() if k not in ("model_type", "num_key_value_heads")}
    hf, _ = build(T.GPTNeoXConfig, T.GPTNeoXForCausalLM, **{**d, "tie_word_embeddings": tied})
    hf.save_pretrained(tmp_path)
    from safetensors.numpy import load_file

    keys = set(load_file(tmp_path / "model.safetensors"))
    assert ("embed_out.weight" in keys) is not tied
    m = CausalLM.from_pretrained(tmp_path, dtype=np.float64)
    assert m.config.tie_word_embeddings is tied
    ids = np.random.default_rng(5).integers(0, 41, (2, 6))
    np.testing.assert_allclose(m(ids), hf_logits(hf, ids), rtol=1e-9, atol=1e-9)


def test_older_checkpoints_buffers_left_unread(tmp_path):
    """Pythia's first checkpoints carry each layer's causal-mask buffer attention.bias (bool),
    attention.masked_bias and the rotary inv_freq: no weights, left unread as transformers does."""
    from safetensors.numpy import load_file, save_file

    m = CausalLM(config_from_hf(TINY), rng=4)
    m.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    for i in range(2):
        sd[f"gpt_neox.layers.{i}.attention.bias"] = np.tril(np.ones((1, 1, 8, 8), bool))
        sd[f"gpt_neox.layers.{i}.attention.masked_bias"] = np.array(-1e9, np.float32)
        sd[f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq"] = np.ones(1, np.float32)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ids = np.random.default_rng(6).integers(0, 41, (1, 5))
    np.testing.assert_array_equal(CausalLM.from_pretrained(tmp_path, dtype=np.float64)(ids), m(ids))


def test_released_pythia_config_reads():
    """The keys of Pythia's config.json (pythia-70m's sizes; the later revisions' keys too)."""
    cfg = config_from_hf(
        {
            "architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu",
            "hidden_size": 512, "initializer_range": 0.02, "intermediate_size": 2048, "layer_norm_eps": 1e-05,
            "max_position_embeddings": 2048, "model_type": "gpt_neox", "num_attention_heads": 8,
            "num_hidden_layers": 6, "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False,
            "torch_dtype": "float16", "transformers_version": "4.24.0", "use_cache": True,
            "use_parallel_residual": True, "vocab_size": 50304, "attention_bias": True, "attention_dropout": 0.0,
            "classifier_dropout": 0.1, "hidden_dropout": 0.0, "rope_scaling": None,
        }
    )  # fmt: skip
    assert cfg.head_dim == 64 and cfg.rope["default"]["partial_rotary_factor"] == 0.25
    assert cfg.parallel_residual and not cfg.tie_word_embeddings and cfg.eos_token_id == 0


def test_tied_pair_under_the_head_name_alone(tmp_path):
    """A tied checkpoint that keeps the pair under the head's name alone (embed_out): the table is
    embed_in's, as transformers ties them."""
    from safetensors.numpy import load_file

    tied = {**TINY, "tie_word_embeddings": True}
    m = CausalLM(config_from_hf(tied), rng=5)
    m.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd["embed_out.weight"] = sd.pop("gpt_neox.embed_in.weight")
    ids = np.random.default_rng(7).integers(0, 41, (1, 5))
    np.testing.assert_array_equal(CausalLM.from_hf(sd, tied, dtype=np.float64)(ids), m(ids))


def test_gpt_neox_20b_config_reads():
    """GPT-NeoX-20B's config.json keys: gelu_fast, and two dropout keys no transformers module reads."""
    cfg = config_from_hf(
        {
            "architectures": ["GPTNeoXForCausalLM"], "attention_probs_dropout_prob": 0.1, "bos_token_id": 0,
            "eos_token_id": 0, "hidden_act": "gelu_fast", "hidden_dropout_prob": 0.1, "hidden_size": 6144,
            "initializer_range": 0.02, "intermediate_size": 24576, "layer_norm_eps": 1e-05,
            "max_position_embeddings": 2048, "model_type": "gpt_neox", "num_attention_heads": 64,
            "num_hidden_layers": 44, "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False,
            "torch_dtype": "float16", "use_cache": True, "vocab_size": 50432,
        }
    )  # fmt: skip
    assert cfg.hidden_act == "gelu_fast" and cfg.head_dim == 96


@needs_hf
def test_gelu_fast_against_transformers():
    """gelu_fast (FastGELUActivation's rounded constant) against transformers: logits to 1e-9 and
    every gradient to 1e-8."""
    from _hf64 import build, check_logits_and_grads, state_dict

    d = {k: v for k, v in TINY.items() if k not in ("model_type", "num_key_value_heads")}
    hf, cfg = build(T.GPTNeoXConfig, T.GPTNeoXForCausalLM, **{**d, "hidden_act": "gelu_fast"})
    m = CausalLM.from_hf(state_dict(hf), cfg)
    rng = np.random.default_rng(8)
    ids = rng.integers(0, 41, (2, 6))
    check_logits_and_grads(m, hf, ids, rng.standard_normal((2, 6, 41)), grads=lambda g: _npattn_names(g, 4))


def test_fused_per_head_read_into_bfloat16():
    """The per-head rows of a fused query_key_value read straight into bfloat16 bits are the split
    parts' (weights_dtype="bfloat16")."""
    m = CausalLM(config_from_hf(TINY), rng=9)
    sd = m.state_dict()
    fused = fused_tensors(sd, m.config.layout.fused, m.config.layout.fused_groups)
    ids = np.random.default_rng(9).integers(0, 41, (1, 5))
    a = CausalLM.from_hf(fused, TINY, weights_dtype="bfloat16")
    b = CausalLM.from_hf(sd, TINY, weights_dtype="bfloat16")
    np.testing.assert_array_equal(a(ids), b(ids))
    assert not np.array_equal(b(ids), CausalLM.from_hf(sd, TINY)(ids))  # the bits are bfloat16's
