"""StarCoder2 (model_type starcoder2): the reader and the model against transformers'
Starcoder2ForCausalLM in float64, with a sliding window shorter than the sequence."""

import numpy as np
import pytest
from _hf64 import transformers_or_none

from npattn.models import CausalLM
from npattn.models.configs import config_from_hf
from npattn.models.tiny import TINY_CONFIGS

T = transformers_or_none()
needs_hf = pytest.mark.skipif(T is None, reason="needs torch and transformers")

TINY = TINY_CONFIGS["starcoder2"]


def test_reader():
    cfg = config_from_hf(TINY)
    assert cfg.layer_norm and cfg.layer_norm_bias and not cfg.parallel_mlp and not cfg.parallel_residual
    assert cfg.mlp_types == ("plain", "plain") and cfg.mlp_bias and cfg.attention_bias and not cfg.lm_head_bias
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.num_key_value_heads == 2 and cfg.rms_norm_eps == 1e-4
    assert cfg.layer_types == ("sliding_attention",) * 2 and cfg.sliding_window == 4 and cfg.tie_word_embeddings
    assert cfg.rope["default"]["rope_theta"] == 1000.0
    d = config_from_hf({k: v for k, v in TINY.items() if k not in ("sliding_window", "rope_theta", "norm_epsilon")})
    assert d.layer_types == ("full_attention",) * 2 and d.sliding_window is None
    assert d.rope["default"]["rope_theta"] == 10000.0 and d.rms_norm_eps == 1e-5
    nb = config_from_hf({**TINY, "use_bias": False, "tie_word_embeddings": False, "mlp_type": "default"})
    assert not nb.attention_bias and not nb.mlp_bias and not nb.tie_word_embeddings
    names = dict(CausalLM(nb, rng=0).named_parameters())
    assert "model.layers.0.input_layernorm.bias" in names and "model.norm.bias" in names  # LayerNorms keep theirs
    assert not any(n.endswith("proj.bias") or n.endswith("c_fc.bias") for n in names) and "lm_head.weight" in names
    names = dict(CausalLM(cfg, rng=0).named_parameters())
    for n in ("model.layers.1.mlp.c_fc.bias", "model.layers.1.mlp.c_proj.bias", "model.layers.0.self_attn.o_proj.bias"):
        assert n in names
    assert not any("up_proj" in n or "gate_proj" in n or n.startswith("lm_head") for n in names)


# the keys of StarCoder2-15B's config.json (BigCode's training code's mlp_type and norm_type among them)
RELEASED_15B = dict(
    architectures=["Starcoder2ForCausalLM"], attention_dropout=0.1, residual_dropout=0.1, embedding_dropout=0.1,
    bos_token_id=0, eos_token_id=0, hidden_act="gelu_pytorch_tanh", hidden_size=6144, initializer_range=0.01275,
    intermediate_size=24576, max_position_embeddings=16384, mlp_type="default", model_type="starcoder2",
    norm_epsilon=1e-05, norm_type="layer_norm", num_attention_heads=48, num_hidden_layers=40, num_key_value_heads=4,
    rope_theta=100000, sliding_window=4096, torch_dtype="float32", transformers_version="4.37.0.dev0", use_bias=True,
    use_cache=True, vocab_size=49152,
)  # fmt: skip


def test_released_config_is_read():
    cfg = config_from_hf(RELEASED_15B)
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.sliding_window, cfg.attention_dropout) == (128, 4, 4096, 0.1)
    assert cfg.layer_types == ("sliding_attention",) * 40 and cfg.tie_word_embeddings
    assert cfg.rope["default"]["rope_theta"] == 100000 and cfg.hidden_act == "gelu_pytorch_tanh"


def test_attention_dropout_is_the_attention_s():
    """``attention_dropout`` reaches each attention (its weights dropped while training, as
    Starcoder2Attention's); the residual and embedding dropouts are read and not applied."""
    m = CausalLM({**TINY, "attention_dropout": 0.1}, rng=0)
    drops = {n: mod.dropout for n, mod in m.named_modules() if n.endswith("self_attn")}
    assert drops == {"model.layers.0.self_attn": 0.1, "model.layers.1.self_attn": 0.1}
    assert config_from_hf(TINY).attention_dropout == 0.0


@pytest.mark.parametrize(
    "key, value",
    [
        ("hidden_act", "xielu"),
        ("hidden_act", "mish"),
        ("residual_dropout", 1.0),
        ("embedding_dropout", -0.1),
        ("attention_dropout", 1.0),
        ("mlp_type", "gated"),
        ("norm_type", "rms_norm"),
        ("sliding_window", 0),
        ("x_key", 1),
    ],
)
def test_refused_by_name(key, value):
    with pytest.raises(ValueError, match=key):
        config_from_hf({**TINY, key: value})


def test_window_masks_keys():
    """The window of 4 keys: a token 4 or more places back does not reach the logits (no torch)."""
    m = CausalLM(TINY, rng=1)
    ids = np.random.default_rng(0).integers(3, 41, (1, 6))
    other = ids.copy()
    other[0, 0] = 3 if ids[0, 0] != 3 else 4
    a, b = m(ids), m(other)
    # two layers of a 4-key window: position 0 reaches position 6 at most (3 + 3)
    assert not np.allclose(a[0, 3], b[0, 3])
    full = CausalLM({**TINY, "sliding_window": None}, rng=1)
    np.testing.assert_allclose(full(ids)[0, :4], a[0, :4], rtol=1e-12, atol=1e-12)  # within the window: equal
    assert not np.allclose(full(ids)[0, 5], a[0, 5])


@needs_hf
def test_against_transformers(tmp_path):
    from _hf64 import (
        build,
        check_cached_decoding,
        check_directory_round_trip,
        check_logits_and_grads,
        check_padded_batch,
        state_dict,
    )

    for extra in ({}, {"tie_word_embeddings": False, "hidden_act": "gelu"}):
        d = {k: v for k, v in TINY.items() if k != "model_type"} | extra
        hf, cfg = build(T.Starcoder2Config, T.Starcoder2ForCausalLM, **d)
        m = CausalLM.from_hf(state_dict(hf), cfg)
        rng = np.random.default_rng(1)
        ids = rng.integers(0, 41, (2, 9))  # longer than the window of 4
        ids[0, 3] = 0  # the pad token: its padding row gets no gradient on either side
        dlogits = rng.standard_normal((2, 9, 41))
        check_logits_and_grads(m, hf, ids, dlogits)
        check_cached_decoding(m, hf, ids, prompt=6)
        check_padded_batch(m, hf, 41, (9, 5), decode=2)
        # transformers' directory read by npattn, and npattn's read by transformers
        check_directory_round_trip(
            tmp_path / str(len(extra)), T.Starcoder2Config, T.Starcoder2ForCausalLM, TINY | extra
        )
