"""Phi-1, Phi-1.5 and Phi-2 (model_type phi): the reader and the model against transformers'
PhiForCausalLM in float64."""

import numpy as np
import pytest
from _hf64 import transformers_or_none

from npattn.models import CausalLM
from npattn.models.configs import config_from_hf
from npattn.models.tiny import TINY_CONFIGS

T = transformers_or_none()
needs_hf = pytest.mark.skipif(T is None, reason="needs torch and transformers")

TINY = TINY_CONFIGS["phi"]


def test_reader():
    cfg = config_from_hf(TINY)
    assert cfg.layer_norm and cfg.layer_norm_bias and cfg.parallel_mlp and not cfg.parallel_residual
    assert cfg.mlp_types == ("plain", "plain") and cfg.mlp_bias and cfg.attention_bias and cfg.lm_head_bias
    assert cfg.hidden_act == "gelu_new" and cfg.num_key_value_heads == 2 and cfg.rms_norm_eps == 1e-4
    assert cfg.rope["default"]["partial_rotary_factor"] == 0.5 and cfg.rope["default"]["rope_theta"] == 1000.0
    d = config_from_hf({k: v for k, v in TINY.items() if k not in ("partial_rotary_factor", "rope_theta")})
    assert d.rope["default"]["partial_rotary_factor"] == 0.5 and d.rope["default"]["rope_theta"] == 10000.0
    names = dict(CausalLM(cfg, rng=0).named_parameters())
    for n in ("lm_head.bias", "model.final_layernorm.bias", "model.layers.0.self_attn.dense.bias"):
        assert n in names
    assert "model.layers.1.mlp.fc1.weight" in names and "model.layers.1.input_layernorm.bias" in names
    assert not any("post_attention_layernorm" in n or "up_proj" in n for n in names)


@pytest.mark.parametrize(
    "key, value",
    [("qk_layernorm", True), ("tie_word_embeddings", True), ("resid_pdrop", 1.0), ("embd_pdrop", -0.1), ("x_key", 1)],
)
def test_refused_by_name(key, value):
    with pytest.raises(ValueError, match=key):
        config_from_hf({**TINY, key: value})


def test_padded_rows_equal_each_row_alone():
    """The MLP branch beside the attention takes no padding: a left-padded batch's rows are each
    row's own logits (without torch)."""
    m = CausalLM(TINY, rng=1)
    ids = np.random.default_rng(0).integers(3, 41, (2, 5))
    mask = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    out = m(ids, attention_mask=mask)
    np.testing.assert_allclose(out[1, 2:], m(ids[1:, 2:])[0], rtol=1e-12, atol=1e-12)


@needs_hf
def test_against_transformers(tmp_path):
    from _hf64 import build, check_cached_decoding, check_logits_and_grads, check_padded_batch, hf_logits, state_dict

    d = {k: v for k, v in TINY.items() if k != "model_type"}
    hf, cfg = build(T.PhiConfig, T.PhiForCausalLM, **d)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 41, (2, 7))
    ids[0, 3] = 0  # the pad token: its padding row gets no gradient on either side
    dlogits = rng.standard_normal((2, 7, 41))
    check_logits_and_grads(m, hf, ids, dlogits)
    check_cached_decoding(m, hf, ids)
    check_padded_batch(m, hf, 41, (7, 4), decode=2)
    hf.save_pretrained(tmp_path / "hf")  # transformers' directory read by npattn
    np.testing.assert_allclose(CausalLM.from_pretrained(tmp_path / "hf", dtype=np.float64)(ids), m(ids), rtol=1e-12)
    m.save_pretrained(tmp_path / "np")  # and npattn's read by transformers
    back = T.PhiForCausalLM.from_pretrained(tmp_path / "np", dtype=hf.dtype, attn_implementation="eager").eval()
    np.testing.assert_allclose(hf_logits(back, ids), m(ids), rtol=1e-9, atol=1e-9)
