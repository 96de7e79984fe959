"""Batched prompts with padding (issue 30, item 3): ``CausalLM(ids, attention_mask=mask)`` for every
family of the tiny table, left padding as transformers generates.  Each row's logits at its tokens,
its cached decoding, its gradients and its JVP equal those of its prompt run alone (float64, 1e-10);
transformers' own models with the same mask and generate's ``position_ids`` agree on real tokens."""

from __future__ import annotations

import numpy as np
import pytest
from _families import FAMILIES, one_rope_regime

from npattn import no_grad
from npattn.models import CausalLM

LENS = (5, 3, 1)  # the first row fills the batch, the last is one token after four of padding


def _batch(vocab, seed=0, lens=LENS):
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, vocab, n) for n in lens]
    L = max(lens)
    ids = np.zeros((len(rows), L), np.int64)
    mask = np.zeros((len(rows), L), np.int64)
    for i, r in enumerate(rows):
        ids[i, L - len(r) :], mask[i, L - len(r) :] = r, 1
        ids[i, : L - len(r)] = rng.integers(0, vocab, L - len(r))  # padding ids need not be pad_token_id
    return rows, ids, mask


def _err(a, b):
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-300)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_row_equals_its_prompt_alone(name):
    m = CausalLM(one_rope_regime(name), rng=0)  # LongRoPE: a batch's factors follow its longest row
    rows, ids, mask = _batch(m.config.vocab_size)
    L = ids.shape[1]
    with no_grad():
        out = m(ids, attention_mask=mask)
        for i, r in enumerate(rows):
            assert _err(out[i, L - len(r) :], m(r[None])[0]) < 1e-10, i
            assert not out[i, : L - len(r)].any()  # padded positions: logits 0
        assert np.array_equal(m(ids, attention_mask=np.ones_like(mask)), m(ids))  # no padding: as without a mask


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_cached_decoding_after_a_padded_prompt_equals_each_row_alone(name):
    m = CausalLM(one_rope_regime(name), rng=0)
    rows, ids, mask = _batch(m.config.vocab_size)
    nxt = np.random.default_rng(1).integers(0, m.config.vocab_size, (len(rows), 3))
    m.reset_kv_cache()
    m(ids, attention_mask=mask, use_cache=True)
    steps = [m(nxt[:, :1], use_cache=True)]  # no mask: tokens
    full = np.concatenate([mask, np.ones((len(rows), 2), np.int64)], axis=1)  # transformers' (B, T + L)
    steps.append(m(nxt[:, 1:2], attention_mask=full, use_cache=True))
    steps.append(m(nxt[:, 2:], attention_mask=np.ones((len(rows), 1)), use_cache=True))  # (B, L): this call's
    for i, r in enumerate(rows):
        m.reset_kv_cache()
        m(r[None], use_cache=True)
        for j, step in enumerate(steps):
            assert _err(step[i], m(nxt[i : i + 1, j : j + 1], use_cache=True)[0]) < 1e-10, (i, j)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_gradients_and_jvp_of_each_row_equal_the_row_alone(name):
    m = CausalLM(FAMILIES[name], rng=0)
    V = m.config.vocab_size
    rows, ids, mask = _batch(V, lens=(4, 2))
    L = ids.shape[1]
    rng = np.random.default_rng(2)
    dlogits = rng.standard_normal(ids.shape + (V,))  # random everywhere, padding included
    params = dict(m.named_parameters())
    tangents = {n: rng.standard_normal(p.shape) for n, p in params.items()}
    m.zero_grad()
    m(ids, attention_mask=mask)
    tz = m.jvp(param_tangents=tangents)
    m.backward(dlogits)
    padded = {n: p.grad.copy() for n, p in params.items()}
    m.zero_grad()
    for i, r in enumerate(rows):
        m(r[None])
        tz_i = m.jvp(param_tangents=tangents)
        assert _err(tz[i, L - len(r) :], tz_i[0]) < 1e-10, i
        assert not tz[i, : L - len(r)].any()
        m.backward(dlogits[i : i + 1, L - len(r) :])  # the padded positions' dlogits count for nothing
    for n, p in params.items():
        # (GPT-2's key bias, without RoPE, shifts each query's scores alike: its gradient is 0 but
        # for rounding, ~1e-17, which the floor allows)
        assert np.abs(padded[n] - p.grad).max() <= 1e-10 * max(np.abs(p.grad).max(), 1e-5), n


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_one_padded_sequence_without_a_batch_axis(name):
    """``ids (L,)`` with ``attention_mask (L,)``: backward, JVP and backward_jvp run (the layers see
    a batch of one) and give what the batch of one gives."""
    m = CausalLM(FAMILIES[name], rng=0)
    V = m.config.vocab_size
    ids = np.random.default_rng(3).integers(3, V, 6)
    mask = np.array([0, 0, 1, 1, 1, 1])
    rng = np.random.default_rng(4)
    dlogits = rng.standard_normal((6, V))
    params = dict(m.named_parameters())
    tangents = {n: rng.standard_normal(p.shape) for n, p in params.items()}
    results = []
    for lead in ((), (1,)):
        m.zero_grad()
        for p in params.values():
            p.grad_tangent = None
        out = m(ids.reshape(lead + (6,)), attention_mask=mask.reshape(lead + (6,)))
        tz = m.jvp(param_tangents=tangents)
        m.backward(dlogits.reshape(lead + dlogits.shape))
        grads = {n: p.grad.copy() for n, p in params.items()}
        if "kimi" not in name:  # KDA has no second order yet
            m(ids.reshape(lead + (6,)), attention_mask=mask.reshape(lead + (6,)))
            m.backward_jvp(dlogits.reshape(lead + dlogits.shape), param_tangents=tangents)
        tangent = {n: None if p.grad_tangent is None else p.grad_tangent.copy() for n, p in params.items()}
        results.append((out.reshape(6, V), tz.reshape(6, V), grads, tangent))
    (o1, t1, g1, h1), (o2, t2, g2, h2) = results
    assert _err(o1, o2) < 1e-12 and _err(t1, t2) < 1e-12
    for n in params:
        assert _err(g1[n], g2[n]) < 1e-12, n
        if h2[n] is not None:
            assert _err(h1[n], h2[n]) < 1e-12, n


def test_refusals_name_the_argument():
    m = CausalLM(FAMILIES["llama"], rng=0)
    ids = np.ones((2, 4), np.int64)
    with pytest.raises(ValueError, match="attention_mask: a row has padding between"):
        m(ids, attention_mask=np.array([[1, 0, 1, 1], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="attention_mask: expected shape"):
        m(ids, attention_mask=np.ones((2, 5)))
    with pytest.raises(ValueError, match="attention_mask: expected 1/True"):
        m(ids, attention_mask=np.full((2, 4), 2))
    m.reset_kv_cache()
    m(ids, attention_mask=np.array([[0, 1, 1, 1], [1, 1, 1, 1]]), use_cache=True)
    with pytest.raises(ValueError, match="first columns differ"):
        m(ids[:, :1], attention_mask=np.ones((2, 5)), use_cache=True)
    with pytest.raises(ValueError, match="padding between"):  # right padding then more tokens
        m.reset_kv_cache()
        m(ids, attention_mask=np.array([[1, 1, 1, 0], [1, 1, 1, 1]]), use_cache=True)
        m(ids[:, :1], use_cache=True)


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_against_transformers_with_the_same_mask(name):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch
    from _hf64 import float64_reference, state_dict
    from test_causal_lm_parity import _family

    hf, cfg = _family(name)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    rows, ids, mask = _batch(cfg["vocab_size"])
    position_ids = np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 0)  # generate's, as transformers 5.24
    with float64_reference(), torch.no_grad():
        ref = hf(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            position_ids=torch.from_numpy(position_ids),
            use_cache=False,
        ).logits.numpy()
    with no_grad():
        out = m(ids, attention_mask=mask)
    real = mask.astype(bool)
    assert _err(out[real], ref[real]) < 1e-10
