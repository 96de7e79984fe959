"""GPT-2 (model_type gpt2): the reader, the learned positions, the Conv1D checkpoint layout, and the
model against transformers' GPT2LMHeadModel in float64."""

import json

import numpy as np
import pytest
from _hf64 import transformers_or_none

from npattn import no_grad
from npattn.models import CausalLM
from npattn.models.configs import config_from_hf
from npattn.models.tiny import TINY_CONFIGS

T = transformers_or_none()
needs_hf = pytest.mark.skipif(T is None, reason="needs torch and transformers")

TINY = TINY_CONFIGS["gpt2"]
# GPT2Config's own names of the sizes (as its config.json writes them)
OWN = {"n_embd": 16, "n_layer": 2, "n_head": 4, "n_positions": 128}
CANONICAL = ("hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings")


def test_reader():
    cfg = config_from_hf(TINY)
    assert cfg.layer_norm and cfg.layer_norm_bias and not cfg.parallel_mlp and not cfg.parallel_residual
    assert cfg.mlp_types == ("plain", "plain") and cfg.mlp_bias and cfg.attention_bias and cfg.tie_word_embeddings
    assert cfg.hidden_act == "gelu_new" and cfg.num_key_value_heads == 4 and cfg.rms_norm_eps == 1e-4
    assert cfg.rope_layers == (False, False) and cfg.position_embedding == "wpe" and cfg.intermediate_size == 24
    assert cfg.attention_scale is None and cfg.attention_dropout == 0.0  # attn_pdrop 0.1: read, not applied
    own = config_from_hf({**{k: v for k, v in TINY.items() if k not in CANONICAL}, **OWN})
    assert own.replace(hf={}) == cfg.replace(hf={})  # n_embd ... read as hidden_size ...
    d = config_from_hf({k: v for k, v in TINY.items() if k != "n_inner"})
    assert d.intermediate_size == 64 and d.hidden_act == "gelu_new"  # n_inner null: 4 n_embd
    assert config_from_hf({**TINY, "scale_attn_weights": False}).attention_scale == 1.0
    by_layer = config_from_hf({**TINY, "scale_attn_by_inverse_layer_idx": True})
    assert [by_layer.attention_config("full_attention", i).scale for i in range(2)] == [0.5, 0.25]
    assert cfg.attention_config("full_attention", 1).scale is None and not cfg.attention_scale_by_layer
    assert config_from_hf({**TINY, "activation_function": "gelu"}).hidden_act == "gelu"
    names = dict(CausalLM(cfg, rng=0).named_parameters())
    assert list(names)[:2] == ["model.wte.weight", "model.wpe.weight"] and names["model.wpe.weight"].shape == (128, 16)
    for n in ("ln_f.bias", "layers.0.ln_1.bias", "layers.1.ln_2.weight", "layers.0.mlp.c_fc.bias"):
        assert "model." + n in names
    assert "model.layers.0.attn.c_proj.weight" in names and "model.layers.0.attn.q_proj.bias" in names
    assert "lm_head.weight" not in names and not any("rotary" in n or "embed_tokens" in n for n in names)


# the config.json of OpenAI's released gpt2 (124M): GPT-2's own names, n_ctx, the double-heads' keys
RELEASED = {
    "activation_function": "gelu_new",
    "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1,
    "bos_token_id": 50256,
    "embd_pdrop": 0.1,
    "eos_token_id": 50256,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2",
    "n_ctx": 1024,
    "n_embd": 768,
    "n_head": 12,
    "n_layer": 12,
    "n_positions": 1024,
    "resid_pdrop": 0.1,
    "summary_activation": None,
    "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True,
    "summary_type": "cls_index",
    "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
    "vocab_size": 50257,
}


def test_the_released_config_reads():
    cfg = config_from_hf(RELEASED)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim) == (768, 12, 12, 64)
    assert cfg.intermediate_size == 3072 and cfg.max_position_embeddings == 1024 and cfg.tie_word_embeddings
    assert cfg.hidden_act == "gelu_new" and cfg.rms_norm_eps == 1e-5 and cfg.eos_token_id == 50256
    assert config_from_hf({"model_type": "gpt2"}) == cfg.replace(bos_token_id=50256)  # GPT2Config's defaults


@pytest.mark.parametrize(
    "key, value",
    [
        ("add_cross_attention", True),
        ("resid_pdrop", 1.0),
        ("attn_pdrop", -0.1),
        ("embd_pdrop", 1.5),
        ("activation_function", "quick_gelu"),
        ("activation_function", "xielu"),
        ("head_dim", 4),
        ("num_key_value_heads", 2),
        ("rms_norm_eps", 1e-6),
        ("n_embd", 32),  # and hidden_size 16: two values
        ("x_key", 1),
    ],
)
def test_refused_by_name(key, value):
    with pytest.raises(ValueError, match=key):
        config_from_hf({**TINY, key: value})


def test_heads_that_do_not_divide_the_width_refused():
    with pytest.raises(ValueError, match=r"config\['n_head'\]: expected a divisor of n_embd = 16, got 3"):
        config_from_hf({**TINY, "num_attention_heads": 3})


def test_positions_past_the_table_refused_by_name():
    m = CausalLM(dict(TINY, max_position_embeddings=8), rng=0)
    with pytest.raises(ValueError, match="position 8 .*max_position_embeddings.*n_positions"):
        m(np.ones((1, 9), np.int64))
    m(np.ones((1, 8), np.int64))  # the whole table
    with no_grad():
        m.reset_kv_cache()
        m(np.ones((1, 6), np.int64), use_cache=True)
        with pytest.raises(ValueError, match="6 cached and 3 given"):
            m(np.ones((1, 3), np.int64), use_cache=True)
        assert m(np.ones((1, 2), np.int64), use_cache=True).shape == (1, 2, 41)  # nothing changed by the refusal


def test_generate_refuses_positions_past_the_table_before_the_first_token():
    """``L + max_new_tokens - 1`` positions are fed (the last token is not): at most the table's."""
    m = CausalLM(dict(TINY, max_position_embeddings=8), rng=0)
    ids = np.array([[3, 4, 5, 6, 7]])
    assert m.generate(ids, 4, eos_token_id=[]).shape == (1, 9)
    for call in (m.generate, lambda *a, **k: list(m.stream(*a, **k))):
        with pytest.raises(ValueError, match="max_new_tokens: expected at most 4 after a prompt of 5 tokens .* got 5"):
            call(ids, 5, eos_token_id=[])


def test_cached_decoding_reads_each_tokens_position():
    """The position rows of cached calls start where the cache ends (a left-padded row's at its
    first token): the logits of a full pass, without torch."""
    m = CausalLM(TINY, rng=1)
    ids = np.random.default_rng(0).integers(3, 41, (2, 7))
    full = m(ids)
    with no_grad():
        m.reset_kv_cache()
        parts = [m(ids[:, :3], use_cache=True)] + [m(ids[:, t : t + 1], use_cache=True) for t in range(3, 7)]
    np.testing.assert_allclose(np.concatenate(parts, axis=1), full, rtol=1e-12, atol=1e-12)
    mask = np.array([[1] * 7, [0, 0, 1, 1, 1, 1, 1]])
    np.testing.assert_allclose(m(ids, attention_mask=mask)[1, 2:], m(ids[1:, 2:])[0], rtol=1e-12, atol=1e-12)


def _checkpoint(tmp_path, m):
    from safetensors.numpy import load_file

    m.save_pretrained(tmp_path)
    return load_file(str(tmp_path / "model.safetensors")), json.loads((tmp_path / "config.json").read_text())


def test_save_pretrained_writes_conv1d_weights_in_out(tmp_path):
    """The checkpoint's c_attn is [q; k; v] transposed, (n_embd, 3 n_embd), with its bias; c_proj,
    c_fc and the MLP's c_proj transposed too; read back equal; a bare model's checkpoint (GPT-2's
    own h.0..., wte.weight) with the attn.bias / attn.masked_bias buffers read alike (without torch)."""
    m = CausalLM(TINY, rng=2, dtype=np.float32)
    sd, config = _checkpoint(tmp_path / "a", m)
    p = {k: v for k, v in m.state_dict().items()}
    a = "model.layers.1.attn."
    qkv = np.concatenate([p[a + f"{x}_proj.weight"] for x in "qkv"])
    np.testing.assert_array_equal(sd["transformer.h.1.attn.c_attn.weight"], qkv.T)
    assert sd["transformer.h.1.attn.c_attn.weight"].shape == (16, 48)
    bias = np.concatenate([p[a + f"{x}_proj.bias"] for x in "qkv"])
    np.testing.assert_array_equal(sd["transformer.h.1.attn.c_attn.bias"], bias)
    np.testing.assert_array_equal(sd["transformer.h.1.attn.c_proj.weight"], p[a + "c_proj.weight"].T)
    np.testing.assert_array_equal(sd["transformer.h.0.mlp.c_fc.weight"], p["model.layers.0.mlp.c_fc.weight"].T)
    assert sd["transformer.h.0.mlp.c_fc.weight"].shape == (16, 24)
    assert sd["transformer.h.0.mlp.c_proj.weight"].shape == (24, 16)
    np.testing.assert_array_equal(sd["transformer.wpe.weight"], p["model.wpe.weight"])
    assert "lm_head.weight" not in sd and "transformer.ln_f.bias" in sd
    assert config["model_type"] == "gpt2"
    ids = np.random.default_rng(3).integers(0, 41, (2, 6))
    np.testing.assert_array_equal(CausalLM.from_pretrained(tmp_path / "a", dtype=np.float32)(ids), m(ids))
    bare = {k[len("transformer.") :]: v for k, v in sd.items()}
    for i in range(2):  # old checkpoints' causal-mask buffers
        bare[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 128, 128), np.float32))
        bare[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    np.testing.assert_array_equal(CausalLM.from_hf(bare, config, dtype=np.float32)(ids), m(ids))
    np.testing.assert_array_equal(CausalLM.from_hf(m.state_dict(), config, dtype=np.float32)(ids), m(ids))
    with pytest.raises(ValueError, match="missing key 'model.wte.weight'"):  # a Conv1D weight first
        CausalLM.from_hf({"h.0.attn.c_proj.weight": sd["transformer.h.0.attn.c_proj.weight"]}, config)


@needs_hf
@pytest.mark.parametrize(
    "changes",
    [
        {},
        dict(tie_word_embeddings=False, scale_attn_weights=False, activation_function="relu"),
        dict(activation_function="gelu", n_inner=None, scale_attn_by_inverse_layer_idx=True),
        dict(scale_attn_weights=False, scale_attn_by_inverse_layer_idx=True),
    ],
    ids=["gpt2", "untied-unscaled-relu", "gelu-4x-by-layer", "unscaled-by-layer"],
)
def test_against_transformers(tmp_path, changes):
    from _hf64 import build, check_cached_decoding, check_logits_and_grads, check_padded_batch, hf_logits, state_dict

    d = {k: v for k, v in {**TINY, **changes}.items() if k != "model_type"}
    hf, cfg = build(T.GPT2Config, T.GPT2LMHeadModel, **d)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 41, (2, 7))
    ids[0, 3] = 0  # the pad token: GPT-2's wte has no padding row, it gets its gradient
    dlogits = rng.standard_normal((2, 7, 41))

    def ours(grads):  # transformers' gradients under npattn's names: c_attn split, Conv1D transposed
        return {k: np.asarray(v) for k, v in CausalLM.from_hf(grads, cfg, dtype=np.float64).state_dict().items()}

    # the key bias shifts each query's scores alike (no RoPE): its gradient is 0 in exact arithmetic
    zero = tuple(f"model.layers.{i}.attn.k_proj.bias" for i in range(2))
    check_logits_and_grads(m, hf, ids, dlogits, grads=ours, zero=zero)
    check_cached_decoding(m, hf, ids, prompt=3)
    check_padded_batch(m, hf, 41, (7, 4), decode=2)
    hf.save_pretrained(tmp_path / "hf")  # transformers' directory read by npattn
    np.testing.assert_allclose(CausalLM.from_pretrained(tmp_path / "hf", dtype=np.float64)(ids), m(ids), rtol=1e-12)
    m.save_pretrained(tmp_path / "np")  # and npattn's read by transformers
    back, info = T.GPT2LMHeadModel.from_pretrained(
        tmp_path / "np", dtype=hf.dtype, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    np.testing.assert_allclose(hf_logits(back.eval(), ids), m(ids), rtol=1e-9, atol=1e-9)
    theirs, again = state_dict(hf), state_dict(back)
    for k, v in theirs.items():
        np.testing.assert_array_equal(again[k], v, err_msg=k)


@needs_hf
def test_reorder_and_upcast_attn_is_the_same_attention():
    """transformers' eager attention with ``reorder_and_upcast_attn`` (scores in float32 under
    mixed precision; it refuses float64) gives npattn's float32 logits of the same weights."""
    import torch
    from _hf64 import randomize

    config = T.GPT2Config(**{k: v for k, v in TINY.items() if k != "model_type"}, reorder_and_upcast_attn=True)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = T.GPT2LMHeadModel(config).eval()
    randomize(hf, 0)
    m = CausalLM.from_hf(hf.state_dict(), config.to_dict())
    ids = np.random.default_rng(5).integers(0, 41, (2, 9))
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(ids)).logits.numpy()
    out = m(ids)
    assert out.dtype == np.float32 and np.abs(out - ref).max() < 1e-5 * np.abs(ref).max()


def test_the_books_gpt_model_reads_the_same_checkpoint(tmp_path):
    """``npattn.book.GPTModel.from_hf_gpt2_state_dict`` (the book's own loader: its c_attn split and
    Conv1D transposes) reads ``save_pretrained``'s checkpoint as the same network (without torch)."""
    from safetensors.numpy import load_file

    from npattn.book import GPTModel

    book_shape = {k: v for k, v in TINY.items() if k != "n_inner"}  # the book's MLP: 4 emb_dim wide
    m = CausalLM(dict(book_shape, layer_norm_epsilon=1e-5), rng=4)  # and its LayerNorm's eps
    m.save_pretrained(tmp_path)
    book = GPTModel.from_hf_gpt2_state_dict(load_file(str(tmp_path / "model.safetensors")), n_heads=4)
    ids = np.random.default_rng(6).integers(0, 41, (2, 9))
    np.testing.assert_allclose(book(ids), m(ids), rtol=1e-12, atol=1e-12)
