"""StableLM (model_type stablelm): the reader, the per-head LayerNorms' checkpoint layout and the
model against transformers' StableLmForCausalLM in float64."""

import re

import numpy as np
import pytest
from _hf64 import transformers_or_none

from npattn.models import CausalLM
from npattn.models.configs import config_from_hf
from npattn.models.save import checkpoint_tensors
from npattn.models.tiny import TINY_CONFIGS

T = transformers_or_none()
needs_hf = pytest.mark.skipif(T is None, reason="needs torch and transformers")

TINY = TINY_CONFIGS["stablelm"]
# StableLM-3B-4E1T's shape: sequential layers, no QK-norm, no q/k/v biases
SEQUENTIAL = {**TINY, "use_parallel_residual": False, "qk_layernorm": False, "use_qkv_bias": False}


def test_reader():
    cfg = config_from_hf(TINY)
    assert cfg.layer_norm and cfg.layer_norm_bias and cfg.parallel_mlp and not cfg.parallel_residual
    assert cfg.qk_norm and cfg.qk_norm_scope == "each_head" and cfg.attention_bias and cfg.attention_out_bias is False
    assert cfg.mlp_types == ("dense", "dense") and not cfg.mlp_bias and cfg.hidden_act == "silu"
    assert cfg.num_key_value_heads == 2 and cfg.rms_norm_eps == 1e-4
    assert cfg.rope["default"]["partial_rotary_factor"] == 0.5 and cfg.rope["default"]["rope_theta"] == 1000.0
    d = config_from_hf({k: v for k, v in TINY.items() if k not in ("partial_rotary_factor", "rope_theta")})
    assert d.rope["default"]["partial_rotary_factor"] == 0.25 and d.rope["default"]["rope_theta"] == 10000.0
    names = dict(CausalLM(cfg, rng=0).named_parameters())
    assert names["model.layers.0.self_attn.q_norm.weight"].shape == (4, 4)
    assert names["model.layers.0.self_attn.k_norm.weight"].shape == (2, 4)
    assert "model.norm.bias" in names and "model.layers.1.self_attn.q_proj.bias" in names
    assert not any("post_attention_layernorm" in n or "o_proj.bias" in n for n in names)
    s = config_from_hf(SEQUENTIAL)
    assert not s.parallel_mlp and not s.qk_norm and not s.attention_bias
    seq = dict(CausalLM(s, rng=0).named_parameters())
    assert "model.layers.0.post_attention_layernorm.bias" in seq
    assert not any("norm.weight" in n for n in seq if "attn" in n)


@pytest.mark.parametrize(
    "key, value",
    [("hidden_dropout", 1.0), ("head_dim", 8), ("num_attention_heads", 3), ("qk_layernorm", 2), ("x_key", 1)],
)
def test_refused_by_name(key, value):
    with pytest.raises(ValueError, match=key):
        config_from_hf({**TINY, key: value})


def _per_head(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items() if "layernorm.norms" in k}


def test_per_head_norms_written_and_read_one_row_each():
    """save_pretrained writes each head's row as StableLmLayerNormPerHead's own LayerNorm, and
    from_hf stacks them back (without torch); a missing row, a leading zero and both forms are
    refused by name."""
    m = CausalLM(TINY, rng=1)
    rng = np.random.default_rng(2)
    for n, p in m.named_parameters():
        if n.endswith("_norm.weight"):  # each head's row its own (they start at 1)
            p.data[...] = 1 + 0.3 * rng.standard_normal(p.data.shape)
    out = checkpoint_tensors(m)
    rows = _per_head(out)
    assert len(rows) == 2 * (4 + 2) and not any(k.endswith(("q_norm.weight", "k_norm.weight")) for k in out)
    q = dict(m.named_parameters())["model.layers.1.self_attn.q_norm.weight"].data
    np.testing.assert_array_equal(out["model.layers.1.self_attn.q_layernorm.norms.3.weight"], q[3])
    sd = {k: np.array(v) for k, v in out.items()}
    back = CausalLM.from_hf(sd, TINY)
    ids = np.random.default_rng(0).integers(3, 41, (2, 5))
    np.testing.assert_array_equal(back(ids), m(ids))
    key = "model.layers.0.self_attn.k_layernorm.norms.1.weight"
    with pytest.raises(ValueError, match=re.escape(key)):
        CausalLM.from_hf({k: v for k, v in sd.items() if k != key}, TINY)
    mid = "model.layers.1.self_attn.q_layernorm.norms.1.weight"
    with pytest.raises(ValueError, match=f"missing key {re.escape(repr(mid))}"):
        CausalLM.from_hf({k: v for k, v in sd.items() if k != mid}, TINY)
    with pytest.raises(ValueError, match="leading zero"):
        rest = {k: v for k, v in sd.items() if k != key}
        CausalLM.from_hf({**rest, key.replace("1.weight", "01.weight"): sd[key]}, TINY)
    whole = "model.layers.0.self_attn.k_layernorm.weight"
    with pytest.raises(ValueError, match=re.escape(whole)):
        CausalLM.from_hf({**sd, whole: np.ones((2, 4))}, TINY)
    extra = "model.layers.0.self_attn.k_layernorm.norms.2.weight"
    with pytest.raises(ValueError, match=f"unexpected key {re.escape(repr(extra))}"):
        CausalLM.from_hf({**sd, extra: np.ones(4)}, TINY)
    with pytest.raises(ValueError, match=re.escape(key)):
        CausalLM.from_hf({**sd, key: np.ones(5)}, TINY)


def test_padded_rows_equal_each_row_alone():
    m = CausalLM(TINY, rng=1)
    ids = np.random.default_rng(0).integers(3, 41, (2, 5))
    mask = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    out = m(ids, attention_mask=mask)
    np.testing.assert_allclose(out[1, 2:], m(ids[1:, 2:])[0], rtol=1e-12, atol=1e-12)


def _stacked_grads(heads: dict):
    """transformers' gradients under npattn's names: each per-head LayerNorm's row stacked."""

    def f(g: dict) -> dict:
        out = {k: v for k, v in g.items() if ".norms." not in k}
        for k in [k for k in g if k.endswith(".norms.0.weight")]:
            prefix = k[: -len(".norms.0.weight")]
            n = heads["q" if prefix.endswith("q_layernorm") else "k"]
            name = prefix.replace("q_layernorm", "q_norm").replace("k_layernorm", "k_norm") + ".weight"
            out[name] = np.stack([g[f"{prefix}.norms.{h}.weight"] for h in range(n)])
        return out

    return f


@needs_hf
@pytest.mark.parametrize("config", [TINY, SEQUENTIAL], ids=["parallel_qk_norm", "sequential"])
def test_against_transformers(tmp_path, config):
    from _hf64 import build, check_cached_decoding, check_logits_and_grads, check_padded_batch, hf_logits, state_dict

    d = {k: v for k, v in config.items() if k != "model_type"}
    hf, cfg = build(T.StableLmConfig, T.StableLmForCausalLM, **d)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 41, (2, 7))
    ids[0, 3] = 0  # the pad token: its padding row gets no gradient on either side
    dlogits = rng.standard_normal((2, 7, 41))
    check_logits_and_grads(m, hf, ids, dlogits, grads=_stacked_grads({"q": 4, "k": 2}))
    check_cached_decoding(m, hf, ids)
    check_padded_batch(m, hf, 41, (7, 4), decode=2)
    hf.save_pretrained(tmp_path / "hf")  # transformers' directory read by npattn
    np.testing.assert_allclose(CausalLM.from_pretrained(tmp_path / "hf", dtype=np.float64)(ids), m(ids), rtol=1e-12)
    m.save_pretrained(tmp_path / "np")  # and npattn's read by transformers
    back = T.StableLmForCausalLM.from_pretrained(tmp_path / "np", dtype=hf.dtype, attn_implementation="eager").eval()
    np.testing.assert_allclose(hf_logits(back, ids), m(ids), rtol=1e-9, atol=1e-9)
