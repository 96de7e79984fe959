"""Fine-tuning steps on every CausalLM family in float32 (cross-entropy, AdamW, clipping): the
loss goes down and parameters, gradients and logits stay float32; generation and cached decoding
on the same models."""

from __future__ import annotations

import numpy as np
import pytest
from _families import FAMILIES, one_rope_regime

from npattn import no_grad
from npattn.generation import generate
from npattn.models import CausalLM
from npattn.optim import AdamW, clip_grad_norm_


def _build(name, dtype=np.float32):
    cfg = FAMILIES[name]
    return CausalLM(cfg, rng=0, dtype=dtype)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_fine_tuning_lowers_the_loss_in_float32(name):
    m = _build(name)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 41, (2, 9))
    x, y = ids[:, :-1], ids[:, 1:]
    opt = AdamW(m, lr=3e-2, weight_decay=0.01)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss, dlogits = m.loss(x, y)
        assert dlogits.dtype == np.float32
        m.backward(dlogits)
        clip_grad_norm_(m, 1.0)
        opt.step()
        losses.append(loss)
    assert losses[-1] < losses[0] - 0.1, losses
    for n, p in m.named_parameters():
        assert p.data.dtype == np.float32, n
        assert p.grad is None or p.grad.dtype == np.float32, n
    assert m(x).dtype == np.float32


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_generation_uses_the_cache(name):
    m = CausalLM(one_rope_regime(name), rng=0)  # float64; the step-by-step pass below stays on one side of a switch
    prompt = np.array([[1, 2, 3], [4, 5, 6]])
    out = generate(m, prompt, 5, 64)
    slow = generate(m, prompt, 5, 64, use_cache=False)
    np.testing.assert_array_equal(out, slow)
    sampled = generate(m, prompt, 5, 64, temperature=1.0, top_k=10, top_p=0.9, rng=1)
    np.testing.assert_array_equal(sampled, generate(m, prompt, 5, 64, temperature=1.0, top_k=10, top_p=0.9, rng=1))
    with no_grad():
        full = m(out)
    m.reset_kv_cache()
    step = np.concatenate(
        [m(out[:, :3], use_cache=True)] + [m(out[:, t : t + 1], use_cache=True) for t in range(3, 8)], 1
    )
    np.testing.assert_allclose(step, full, rtol=1e-10, atol=1e-12)


def test_forward_arguments_are_checked():
    m = _build("llama")
    with pytest.raises(ValueError, match="ids"):
        m(np.array([[1, 41]]))
    with pytest.raises(ValueError, match="ids"):
        m(np.zeros((1, 1, 2), int))
    with pytest.raises(TypeError, match="ids"):
        m(np.array([[0.5]]))
    with pytest.raises(TypeError, match="use_cache"):
        m(np.array([[1]]), use_cache="yes")
    with pytest.raises(RuntimeError):
        m.backward(np.zeros((1, 1, 41), np.float32))
    logits = m(np.array([1, 2, 3]))  # unbatched
    assert logits.shape == (3, 41)
    with pytest.raises(ValueError, match="dlogits"):
        m.backward(np.zeros((3, 40), np.float32))
    m.backward(np.ones((3, 41), np.float32))
    assert "llama" in repr(m) and len(m.layers) == 2


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_load_state_dict_speaks_hugging_face_names(name):
    a, b = _build(name, np.float64), CausalLM(FAMILIES[name], rng=1)
    sd = a.state_dict()
    assert all(k.startswith(("model.", "lm_head.")) for k in sd)
    own = dict(a.config.layer_names).get("self_attn.o_proj", "self_attn.o_proj")  # LFM2's out_proj
    internal = ("W_query", "W_key", "W_value") + (() if own.endswith("out_proj") else ("out_proj.weight",))
    mixers = ("linear_attn", ".conv.", ".mamba.", ".mixer.out_proj")  # their out_proj is transformers' own name
    assert not any(w in k for k in sd for w in internal if not any(m in k for m in mixers))
    b.load_state_dict(sd)
    ids = np.array([[3, 1, 4, 1, 5]])
    with no_grad():
        np.testing.assert_array_equal(a(ids), b(ids))
    with pytest.raises(ValueError, match="model.norm.weight"):
        b.load_state_dict({**sd, "model.norm.weight": np.ones(3)})
