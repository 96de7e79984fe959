"""The textbook attention (``npattn.functional.reference``) against torch and finite differences.

Both reference cores (``scaled_dot_product_attention`` and ``memory_efficient_attention``) are
checked with every option: against torch autograd on the explicit formula (the independent
one in ``tests/_oracles.py``), against ``torch.nn.functional.scaled_dot_product_attention`` where
torch has the feature, against each other, and against central differences (``npattn.gradcheck``
and the independent ``tests/_fd.py``).
"""

import itertools

import numpy as np
import pytest
from _fd import fd_gradients
from _oracles import rel_err, torch_attention

from npattn import gradcheck
from npattn.functional import reference as R
from npattn.functional._random import draw_seed, keep_mask

CORES = ("sdpa", "memeff")


def _call(core, q, k, v, mask=None, **kw):
    if core == "sdpa":
        return R.scaled_dot_product_attention(q, k, v, mask, **kw)
    kw = dict(kw)
    return R.memory_efficient_attention(
        q, k, v, mask, kw.pop("is_causal", False), kw.pop("scale", None), kw.pop("block_size", 3), **kw
    )


def _backward(core, dout, cache):
    if core == "sdpa":
        return R.scaled_dot_product_attention_backward(dout, cache)
    return R.memory_efficient_attention_backward(dout, cache)


# -- torch: autograd on the explicit formula (tests/_oracles.py) ------------------------------------


def _leaves(torch, *arrays):
    return [None if a is None else torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in arrays]


def _compare_to_torch(torch, core, q, k, v, mask=None, sinks=None, alibi=None, dropout_p=0.0, seed=0, **opts):
    rng = np.random.default_rng(123)
    mask_grad = mask is not None and mask.dtype != bool
    kw = dict(opts, sinks=sinks, alibi_slopes=alibi, mask_grad=mask_grad)
    if dropout_p:
        kw.update(dropout_p=dropout_p, rng=np.random.default_rng(seed))
    out, cache = _call(core, q, k, v, mask, **kw)
    dout = rng.standard_normal(out.shape)
    grads = _backward(core, dout, cache)
    keep = None
    if dropout_p:
        score_shape = out.shape[:-1] + (k.shape[-2],)
        if core == "sdpa":
            keep = np.random.default_rng(seed).random(score_shape) >= dropout_p
        else:
            keep = keep_mask(draw_seed(np.random.default_rng(seed)), dropout_p, score_shape)
    tout, expected = torch_attention(
        q,
        k,
        v,
        mask,
        dout=dout,
        mask_grad=mask_grad,
        sinks=sinks,
        alibi_slopes=alibi,
        keep=keep,
        dropout_p=dropout_p,
        **opts,
    )
    assert rel_err(out, tout) < 1e-10
    assert len(grads) == len(expected)
    for got, want in zip(grads, expected):
        assert got.shape == want.shape
        assert rel_err(got, want) < 1e-10


def _qkv(rng, batch=(2,), hq=2, hk=2, lq=5, lk=5, e=4, ev=3):
    q = rng.standard_normal(batch + (hq, lq, e))
    k = rng.standard_normal(batch + (hk, lk, e))
    v = rng.standard_normal(batch + (hk, lk, ev))
    return q, k, v


OPTION_CASES = [
    dict(),
    dict(is_causal=True),
    dict(is_causal=True, causal_align="bottom_right"),
    dict(window=(1, 1)),
    dict(window=(2, -1)),
    dict(window=(-1, 0), causal_align="bottom_right"),
    dict(is_causal=True, window=(1, 3)),
    dict(softcap=1.5),
    dict(scale=0.7, softcap=0.8, is_causal=True),
]


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("opts", OPTION_CASES)
@pytest.mark.parametrize("lq,lk", [(5, 5), (3, 6), (6, 3)])
def test_options_match_torch_formula(torch_or_skip, core, opts, lq, lk):
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, lq=lq, lk=lk)
    _compare_to_torch(torch_or_skip, core, q, k, v, **opts)


@pytest.mark.parametrize("core", CORES)
def test_everything_at_once_matches_torch_formula(torch_or_skip, core):
    """GQA, broadcast batch dims, float mask with mask_grad, causal bottom-right, window, ALiBi,
    softcap, sinks and dropout together."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 4, 5, 3))
    k = rng.standard_normal((1, 2, 7, 3))
    v = rng.standard_normal((1, 2, 7, 2))
    mask = rng.standard_normal((4, 1, 7))
    mask[1, 0, 2] = -np.inf
    _compare_to_torch(
        torch_or_skip,
        core,
        q,
        k,
        v,
        mask,
        sinks=rng.standard_normal(4),
        alibi=np.array([0.5, 0.25, 0.125, 0.0625]),
        dropout_p=0.3,
        seed=5,
        is_causal=True,
        causal_align="bottom_right",
        window=(3, -1),
        softcap=2.0,
        enable_gqa=True,
    )


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("case", ["bool", "float", "sinks", "alibi_batch", "gqa", "dropout", "no_head_axis"])
def test_single_features_match_torch_formula(torch_or_skip, core, case):
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, lq=4, lk=6)
    if case == "bool":
        mask = rng.random((2, 1, 4, 6)) < 0.6
        mask[0, 0, 1] = False  # a fully masked row
        _compare_to_torch(torch_or_skip, core, q, k, v, mask)
    elif case == "float":
        _compare_to_torch(torch_or_skip, core, q, k, v, rng.standard_normal((4, 6)))
    elif case == "sinks":
        _compare_to_torch(torch_or_skip, core, q, k, v, sinks=np.array([0.3, -1.0]), is_causal=True)
    elif case == "alibi_batch":
        _compare_to_torch(torch_or_skip, core, q, k, v, alibi=np.array([[0.5, 0.1], [0.2, 0.3]]))
    elif case == "gqa":
        q = rng.standard_normal((2, 6, 4, 4))
        _compare_to_torch(torch_or_skip, core, q, k, v, enable_gqa=True, is_causal=True)
    elif case == "dropout":
        _compare_to_torch(torch_or_skip, core, q, k, v, dropout_p=0.4, seed=11)
    else:
        q, k, v = q[0], k[0], v[0]  # (batch, L, E): the -3 axis is the batch
        _compare_to_torch(torch_or_skip, core, q, k, v, is_causal=True)


@pytest.mark.parametrize("core", CORES)
def test_matches_torch_sdpa(torch_or_skip, core):
    """torch's own kernel with an explicit mask: bool, float, causal (both alignments), GQA, broadcast."""
    torch = torch_or_skip
    F = torch.nn.functional
    rng = np.random.default_rng(4)
    cases = [
        (_qkv(rng, lq=5, lk=7), None, dict(is_causal=True)),
        (_qkv(rng, lq=5, lk=7), rng.random((5, 7)) < 0.7, dict()),
        (_qkv(rng, lq=5, lk=7), rng.standard_normal((2, 1, 5, 7)), dict()),
        (
            (rng.standard_normal((2, 4, 5, 3)), rng.standard_normal((2, 2, 5, 3)), rng.standard_normal((2, 2, 5, 3))),
            None,
            dict(enable_gqa=True),
        ),
        (
            (rng.standard_normal((3, 2, 4, 3)), rng.standard_normal((1, 2, 6, 3)), rng.standard_normal((2, 6, 5))),
            None,
            dict(),
        ),
    ]
    for (q, k, v), mask, kw in cases:
        out, cache = _call(core, q, k, v, mask, **kw)
        dout = rng.standard_normal(out.shape)
        grads = _backward(core, dout, cache)
        tq, tk, tv = _leaves(torch, q, k, v)
        tmask = None if mask is None else torch.tensor(mask)
        tout = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tmask, **kw)
        tout.backward(torch.tensor(dout))
        assert rel_err(out, tout.detach().numpy()) < 1e-10
        for got, want in zip(grads, (tq.grad, tk.grad, tv.grad)):
            assert rel_err(got, want.numpy()) < 1e-10
    # bottom-right causal alignment: torch's causal_lower_right bias
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = _qkv(rng, lq=3, lk=6)
    out, cache = _call(core, q, k, v, is_causal=True, causal_align="bottom_right")
    dout = rng.standard_normal(out.shape)
    grads = _backward(core, dout, cache)
    tq, tk, tv = _leaves(torch, q, k, v)
    tout = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=causal_lower_right(3, 6))
    tout.backward(torch.tensor(dout))
    assert rel_err(out, tout.detach().numpy()) < 1e-10
    for got, want in zip(grads, (tq.grad, tk.grad, tv.grad)):
        assert rel_err(got, want.numpy()) < 1e-10


# -- fully masked rows -------------------------------------------------------------------------------


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(softcap=1.0),
        dict(alibi_slopes=np.array([0.5, 0.25])),
        dict(sinks=np.array([0.5, -0.5])),
        dict(dropout_p=0.5, rng=0),
    ],
)
def test_fully_masked_rows_are_exact_zeros(core, opts):
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, lq=4, lk=4)
    mask = np.ones((4, 4), dtype=bool)
    mask[2] = False
    # causal bottom-right with Lq > Lk also hides whole rows
    out, cache = _call(core, q, k, v, mask, **opts)
    grads = _backward(core, rng.standard_normal(out.shape), cache)
    assert np.all(out[..., 2, :] == 0.0)
    assert np.all(grads[0][..., 2, :] == 0.0)
    assert np.isfinite(out).all() and all(np.isfinite(g).all() for g in grads)
    q2, k2, v2 = _qkv(rng, lq=5, lk=3)
    out, cache = _call(core, q2, k2, v2, is_causal=True, causal_align="bottom_right", **opts)
    grads = _backward(core, rng.standard_normal(out.shape), cache)
    assert np.all(out[..., :2, :] == 0.0) and np.all(grads[0][..., :2, :] == 0.0)
    if "sinks" in opts:
        assert np.isfinite(grads[-1]).all()


# -- the two reference cores agree ------------------------------------------------------------------


@pytest.mark.parametrize("opts", OPTION_CASES)
@pytest.mark.parametrize("block", [1, 2, 64])
def test_memory_efficient_equals_plain(opts, block):
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, lq=5, lk=7)
    mask = rng.standard_normal((5, 7))
    extra = dict(alibi_slopes=np.array([0.3, 0.1]), sinks=np.array([0.2, 1.0]), mask_grad=True)
    o1, c1 = R.scaled_dot_product_attention(q, k, v, mask, **opts, **extra)
    kw = dict(opts)
    o2, c2 = R.memory_efficient_attention(
        q, k, v, mask, kw.pop("is_causal", False), kw.pop("scale", None), block, **kw, **extra
    )
    np.testing.assert_allclose(o2, o1, rtol=1e-12, atol=1e-13)
    dout = rng.standard_normal(o1.shape)
    for a, b in zip(R.scaled_dot_product_attention_backward(dout, c1), R.memory_efficient_attention_backward(dout, c2)):
        np.testing.assert_allclose(b, a, rtol=1e-11, atol=1e-12)


def test_memory_efficient_takes_a_mask_broadcast_over_the_keys():
    """A float mask of shape ``(Lq, 1)`` (one bias per query, broadcast over the keys) with key
    blocks after the first: every block reads the whole size-1 axis (it was sliced to nothing)."""
    rng = np.random.default_rng(8)
    q, k, v = _qkv(rng, lq=4, lk=5)
    mask = rng.standard_normal((4, 1))
    o1, c1 = R.scaled_dot_product_attention(q, k, v, mask, mask_grad=True)
    o2, c2 = R.memory_efficient_attention(q, k, v, mask, block_size=2, mask_grad=True)
    np.testing.assert_allclose(o2, o1, rtol=1e-12, atol=1e-13)
    dout = rng.standard_normal(o1.shape)
    for a, b in zip(R.scaled_dot_product_attention_backward(dout, c1), R.memory_efficient_attention_backward(dout, c2)):
        np.testing.assert_allclose(b, a, rtol=1e-11, atol=1e-12)
    tangents = [rng.standard_normal(a.shape) for a in (q, k, v, mask)]
    t1 = R.scaled_dot_product_attention_jvp(c1, *tangents)
    np.testing.assert_allclose(R.memory_efficient_attention_jvp(c2, *tangents), t1, rtol=1e-11, atol=1e-12)


def test_memory_efficient_dropout_uses_the_counter_based_mask():
    """One seed drawn per call, the keep-mask of the whole score shape from ``keep_mask``."""
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, lq=4, lk=5)
    out, _ = R.memory_efficient_attention(q, k, v, block_size=2, dropout_p=0.5, rng=np.random.default_rng(9))
    keep = keep_mask(draw_seed(np.random.default_rng(9)), 0.5, (2, 2, 4, 5))
    s = q @ k.swapaxes(-1, -2) / 2.0
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(out, (p * keep * 2.0) @ v, rtol=1e-12, atol=1e-13)
    # the plain core draws rng.random(score_shape) >= p, as npattn.functional does
    out, _ = R.scaled_dot_product_attention(q, k, v, dropout_p=0.5, rng=np.random.default_rng(9))
    keep = np.random.default_rng(9).random((2, 2, 4, 5)) >= 0.5
    np.testing.assert_allclose(out, (p * keep * 2.0) @ v, rtol=1e-12, atol=1e-13)


def test_dropout_p_one_gives_zeros():
    rng = np.random.default_rng(8)
    q, k, v = _qkv(rng)
    for core in CORES:
        out, cache = _call(core, q, k, v, dropout_p=1.0, rng=0)
        assert np.all(out == 0)
        assert all(np.all(g == 0) for g in _backward(core, rng.standard_normal(out.shape), cache))


# -- finite differences ------------------------------------------------------------------------------

FD_CASES = [
    dict(),
    dict(is_causal=True, causal_align="bottom_right", window=(1, -1)),
    dict(window=(1, 2), alibi_slopes=np.array([0.4, 0.2, 0.3, 0.1]), softcap=1.2),
    dict(is_causal=True, dropout_p=0.3, rng=3, enable_gqa=True),
]


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("opts", FD_CASES)
def test_gradcheck(core, opts):
    rng = np.random.default_rng(9)
    q = rng.standard_normal((1, 4, 4, 3))
    gqa = opts.get("enable_gqa", False)
    k = rng.standard_normal((1, 2 if gqa else 4, 5, 3))
    v = rng.standard_normal((1, 2 if gqa else 4, 5, 2))
    if core == "sdpa":
        target = R.scaled_dot_product_attention
    else:
        target = (
            lambda q, k, v, **kw: R.memory_efficient_attention(q, k, v, block_size=2, **kw),
            R.memory_efficient_attention_backward,
        )
    assert gradcheck(target, q, k, v, **opts).ok


@pytest.mark.parametrize("core", CORES)
def test_independent_finite_differences_with_mask_and_sinks(core):
    """Every gradient, the mask's (mask_grad) and the sinks' included, against ``tests/_fd.py``."""
    rng = np.random.default_rng(10)
    q = rng.standard_normal((2, 2, 3, 3))
    k = rng.standard_normal((1, 2, 4, 3))
    v = rng.standard_normal((2, 1, 4, 2))
    mask = rng.standard_normal((2, 1, 4))
    sinks = rng.standard_normal(2)
    opts = dict(
        is_causal=True, causal_align="bottom_right", softcap=3.0, alibi_slopes=np.array([0.5, 0.25]), dropout_p=0.25
    )

    def f(q, k, v, mask, sinks):
        return _call(core, q, k, v, mask, sinks=sinks, mask_grad=True, rng=np.random.default_rng(4), **opts)

    out, cache = f(q, k, v, mask, sinks)
    dout = rng.standard_normal(out.shape)
    grads = _backward(core, dout, cache)
    num = fd_gradients(lambda *xs: np.sum(f(*xs)[0] * dout), [q, k, v, mask, sinks])
    assert len(grads) == 5
    for got, want in zip(grads, num):
        assert got.shape == want.shape
        assert rel_err(got, want) < 1e-6


def test_float32_stays_float32():
    rng = np.random.default_rng(11)
    q, k, v = (a.astype(np.float32) for a in _qkv(rng))
    for core, opts in itertools.product(
        CORES,
        [dict(), dict(alibi_slopes=np.array([0.5, 0.2]), softcap=2.0, sinks=np.array([0.1, 0.2]), is_causal=True)],
    ):
        out, cache = _call(core, q, k, v, rng.standard_normal((5, 5)), mask_grad=True, **opts)
        assert out.dtype == np.float32
        for g in _backward(core, rng.standard_normal(out.shape).astype(np.float32), cache):
            assert g.dtype == np.float32
