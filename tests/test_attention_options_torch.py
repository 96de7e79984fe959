"""Attention options against torch (an oracle only), float64, 1e-10 for outputs and every gradient.

Where torch has the feature, its own ``scaled_dot_product_attention`` with an explicit bias or mask
built from the option (``causal_lower_right`` for ``causal_align="bottom_right"``); torch autograd
on the explicit formula (``tests/_oracles.py``) for softcap, sinks, ALiBi and ``dmask``.
"""

import numpy as np
import pytest
from _oracles import alibi_bias, torch_attention, visible
from test_attention_options import BROADCAST, COMBOS, make

import npattn.functional as F
import npattn.functional.attention as A

torch = pytest.importorskip("torch")
TF = torch.nn.functional
TOL = dict(rtol=1e-10, atol=1e-10)


def _close(a, b):
    np.testing.assert_allclose(a, b.detach().numpy() if hasattr(b, "detach") else b, **TOL)


def _leaves(*arrays):
    return [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in arrays]


@pytest.fixture(params=[2, 128], ids=lambda h: f"height{h}", autouse=True)
def height(request, monkeypatch):
    monkeypatch.setattr(A, "_CAUSAL_BLOCK", request.param)


# -- torch's own sdpa with the option as an explicit mask/bias -----------------------------------------------
@pytest.mark.filterwarnings("ignore:Lower right causal bias")
@pytest.mark.parametrize("lq,lk", [(5, 9), (9, 5), (7, 7)])
def test_bottom_right_causal_equals_causal_lower_right(lq, lk):
    from torch.nn.attention.bias import causal_lower_right

    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 3, lq, 4)), rng.standard_normal((2, 3, lk, 4)), rng.standard_normal((2, 3, lk, 5))
    out, cache = F.scaled_dot_product_attention(q, k, v, is_causal=True, causal_align="bottom_right")
    g = rng.standard_normal(out.shape)
    grads = F.scaled_dot_product_attention_backward(g, cache)
    tq, tk, tv = _leaves(q, k, v)
    tout = TF.scaled_dot_product_attention(tq, tk, tv, attn_mask=causal_lower_right(lq, lk))
    tout.backward(torch.from_numpy(g))
    # torch gives NaN on rows that see no key (Lq > Lk); npattn gives 0 there
    dead = ~visible(lq, lk, True, "bottom_right").any(-1)
    _close(out[..., ~dead, :], tout[..., ~dead, :])
    assert np.all(out[..., dead, :] == 0)
    if not dead.any():
        for a, t in zip(grads, (tq, tk, tv)):
            _close(a, t.grad)


@pytest.mark.parametrize("window", [(2, 1), (0, 0), (3, -1), (-1, 2), (1, 0)])
@pytest.mark.parametrize(
    "causal,align", [(False, "top_left"), (True, "top_left"), (True, "bottom_right"), (False, "bottom_right")]
)
def test_window_equals_sdpa_with_the_band_as_bool_mask(window, causal, align):
    rng = np.random.default_rng(1)
    lq, lk = 7, 9
    q, k, v = rng.standard_normal((2, 2, lq, 4)), rng.standard_normal((2, 2, lk, 4)), rng.standard_normal((2, 2, lk, 3))
    band = visible(lq, lk, causal, align, window)
    rows = band.any(-1)  # torch: NaN on rows that see no key; compare the others, ours are 0
    out, cache = F.scaled_dot_product_attention(q, k, v, is_causal=causal, causal_align=align, window=window)
    g = rng.standard_normal(out.shape) * rows[:, None]
    grads = F.scaled_dot_product_attention_backward(g, cache)
    tq, tk, tv = _leaves(q, k, v)
    tout = TF.scaled_dot_product_attention(tq, tk, tv, attn_mask=torch.from_numpy(band | ~rows[:, None]))
    tout.backward(torch.from_numpy(g))
    _close(out[..., rows, :], tout[..., rows, :])
    assert np.all(out[..., ~rows, :] == 0)
    for a, t in zip(grads, (tq, tk, tv)):
        _close(a, t.grad)


@pytest.mark.parametrize("gqa", [False, True])
def test_alibi_equals_sdpa_with_the_bias_as_float_mask(gqa):
    rng = np.random.default_rng(2)
    hq, hk = (4, 2) if gqa else (2, 2)
    q, k, v = rng.standard_normal((2, hq, 6, 4)), rng.standard_normal((2, hk, 8, 4)), rng.standard_normal((2, hk, 8, 3))
    slopes = rng.uniform(0.1, 1, (2, hq))  # per batch and head
    for align in ("top_left", "bottom_right"):
        out, cache = F.scaled_dot_product_attention(
            q, k, v, alibi_slopes=slopes, causal_align=align, enable_gqa=gqa, is_causal=True
        )
        g = rng.standard_normal(out.shape)
        grads = F.scaled_dot_product_attention_backward(g, cache)
        bias = alibi_bias(slopes, (2, hq), 6, 8, align)
        bias = np.where(visible(6, 8, True, align), bias, -np.inf)
        tq, tk, tv = _leaves(q, k, v)
        tout = TF.scaled_dot_product_attention(tq, tk, tv, attn_mask=torch.from_numpy(bias), enable_gqa=gqa)
        tout.backward(torch.from_numpy(g))
        _close(out, tout)
        for a, t in zip(grads, (tq, tk, tv)):
            _close(a, t.grad)


def test_mask_grad_equals_torch_autograd_of_the_float_mask():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 2, 5, 4)), rng.standard_normal((2, 2, 7, 4)), rng.standard_normal((2, 2, 7, 3))
    for shape in [(5, 7), (2, 1, 5, 7), (1, 7), (2, 2, 5, 7)]:
        mask = rng.standard_normal(shape)
        out, cache = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, mask_grad=True)
        g = rng.standard_normal(out.shape)
        grads = F.scaled_dot_product_attention_backward(g, cache)
        tq, tk, tv, tm = _leaves(q, k, v, mask)
        tout = TF.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm)
        tout.backward(torch.from_numpy(g))
        _close(out, tout)
        for a, t in zip(grads, (tq, tk, tv, tm)):
            assert a.shape == tuple(t.shape)
            _close(a, t.grad)


@pytest.mark.parametrize("qs,ks,vs,gqa", BROADCAST)
def test_batch_broadcasting_equals_torch(qs, ks, vs, gqa):
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal(s) for s in (qs, ks, vs))
    out, cache = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    g = rng.standard_normal(out.shape)
    grads = F.scaled_dot_product_attention_backward(g, cache)
    tq, tk, tv = _leaves(q, k, v)
    tout = TF.scaled_dot_product_attention(tq, tk, tv, enable_gqa=gqa)
    assert out.shape == tuple(tout.shape)
    tout.backward(torch.from_numpy(g))
    _close(out, tout)
    for a, t in zip(grads, (tq, tk, tv)):
        _close(a, t.grad)


# -- torch autograd on the explicit formula, every combination class ----------------------------------------
@pytest.mark.parametrize("name", list(COMBOS))
@pytest.mark.parametrize("lq,lk", [(6, 8), (8, 6)])
def test_every_combination_equals_torch_autograd_on_the_formula(name, lq, lk):
    q, k, v, kw = make(COMBOS[name], lq, lk)
    out, cache = F.scaled_dot_product_attention(q, k, v, **kw)
    g = np.random.default_rng(5).standard_normal(out.shape)
    grads = F.scaled_dot_product_attention_backward(g, cache)
    tkw = {key: val for key, val in kw.items() if key != "rng"}
    tout, tgrads = torch_attention(q, k, v, dout=g, keep=cache.keep, **tkw)
    _close(out, tout)
    assert len(grads) == len(tgrads)
    for a, t in zip(grads, tgrads):
        assert a.shape == t.shape
        _close(a, t)
