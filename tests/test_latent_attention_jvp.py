"""Forward mode of ``MultiHeadLatentAttention`` (``m.jvp(tx, param_tangents=...)``): against central
differences along a joint direction of the input and every parameter, ``gradcheck(mode="both")``
(``<u, J v> = <J^T u, v>`` with the hand-written backward), the absorbed form's tangent equal to
the plain form's, and the protocol (the state survives for ``backward``)."""

import numpy as np
import pytest

import npattn

D, H = 12, 3
DIMS = {"kv_lora_rank": 5, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 3}
CONFIGS = {
    "q_proj": {},
    "q_lora_bias": {"q_lora_rank": 6, "attention_bias": True},
    "yarn_rotate_half": {
        "q_lora_rank": 6,
        "rope_interleave": False,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "mscale_all_dim": 0.7,
            "original_max_position_embeddings": 4,
        },
    },
}


def make(cfg):
    m = npattn.MultiHeadLatentAttention(D, H, rng=0, **DIMS, **CONFIGS[cfg])
    rng = np.random.default_rng(9)
    for name, p in m.named_parameters():
        if "layernorm" in name:
            p.data = rng.uniform(0.5, 1.5, p.shape)
    return m


def tangents(m, seed=2):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(p.shape) for n, p in m.named_parameters()}


@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_jvp_against_central_differences(cfg, absorb):
    m = make(cfg)
    rng = np.random.default_rng(1)
    x, tx = rng.standard_normal((2, 4, D)), rng.standard_normal((2, 4, D))
    tp = tangents(m)
    m(x, absorb=absorb)
    got = m.jvp(tx, param_tangents=tp)
    params = dict(m.named_parameters())
    base = {n: p.data.copy() for n, p in params.items()}
    eps = 1e-5

    def at(s):
        for n, p in params.items():
            p.data = base[n] + s * tp[n]
        return m(x + s * tx, absorb=absorb)

    want = (at(eps) - at(-eps)) / (2 * eps)
    assert np.abs(got - want).max() <= 1e-7 * np.abs(want).max()


@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_gradcheck_both_modes(cfg, absorb):
    m = make(cfg)
    x = np.random.default_rng(3).standard_normal((2, 4, D))
    report = npattn.gradcheck(m, x, mode="both", absorb=absorb)
    assert report.ok, str(report)


@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_absorbed_tangent_equals_plain(cfg):
    m = make(cfg)
    rng = np.random.default_rng(4)
    x, tx = rng.standard_normal((3, 5, D)), rng.standard_normal((3, 5, D))
    tp = tangents(m, 5)
    m(x)
    plain = m.jvp(tx, param_tangents=tp)
    m(x, absorb=True)
    absorbed = m.jvp(tx, param_tangents=tp)
    assert np.abs(absorbed - plain).max() <= 1e-12 * np.abs(plain).max()
    only_params = m.jvp(None, param_tangents={"kv_b_proj.weight": tp["kv_b_proj.weight"]})
    m(x)
    assert np.abs(only_params - m.jvp(param_tangents={"kv_b_proj.weight": tp["kv_b_proj.weight"]})).max() <= 1e-12 * (
        np.abs(only_params).max()
    )


def test_jvp_keeps_the_state_and_refuses_bad_calls():
    m = make("q_lora_bias")
    rng = np.random.default_rng(6)
    x, dy = rng.standard_normal((2, 4, D)), rng.standard_normal((2, 4, D))
    with pytest.raises(RuntimeError):
        m.jvp(x)
    m(x)
    dx_plain = m.backward(dy)
    m(x)
    m.jvp(rng.standard_normal(x.shape))
    assert np.array_equal(m.backward(dy), dx_plain)  # backward after jvp: same numbers
    m(x)
    with pytest.raises(TypeError, match="input tangent"):
        m.jvp(x, x)
    with pytest.raises(ValueError, match="unknown parameter"):
        m.jvp(x, param_tangents={"W_query.weight": np.zeros((2, 2))})
    assert np.array_equal(m.jvp(None), np.zeros((2, 4, D)))
