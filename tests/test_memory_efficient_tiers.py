"""The fast memory_efficient_attention against the textbook tier (``npattn.functional.reference``:
its dense formula and its textbook FlashAttention) and against the fast scaled_dot_product_attention:
equal to 1e-12 in float64 over generated shapes and every option, dropout included (same rng)."""

import inspect

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn.functional.reference as R
from npattn.functional.attention import scaled_dot_product_attention, scaled_dot_product_attention_backward
from npattn.functional.memory_efficient import memory_efficient_attention, memory_efficient_attention_backward


def _close(got, ref, tol=1e-12, what=""):
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert got.dtype == ref.dtype == np.float64, what
    if ref.size:
        err = float(np.max(np.abs(got - ref)))
        assert err <= tol * max(1.0, float(np.max(np.abs(ref)))), (what, err)


@st.composite
def cases(draw, dropout=True):
    gqa = draw(st.booleans())
    hk = draw(st.integers(1, 2))
    hq = hk * (draw(st.integers(1, 3)) if gqa else 1)
    b = draw(st.integers(1, 2))
    lq, lk = draw(st.integers(1, 10)), draw(st.integers(1, 10))
    e, ev = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hq, lq, e))
    k = rng.standard_normal((b, hk, lk, e))
    v = rng.standard_normal((b, hk, lk, ev))
    dout = rng.standard_normal((b, hq, lq, ev))
    kw = dict(
        enable_gqa=gqa, is_causal=draw(st.booleans()), causal_align=draw(st.sampled_from(["top_left", "bottom_right"]))
    )
    if draw(st.booleans()):
        kw["window"] = (draw(st.integers(-1, 4)), draw(st.integers(-1, 4)))
    if draw(st.booleans()):
        kw["alibi_slopes"] = rng.random(hq)
    if draw(st.booleans()):
        kw["softcap"] = draw(st.floats(0.5, 5.0))
    if draw(st.booleans()):
        kw["sinks"] = rng.standard_normal(hq)
    if dropout and draw(st.booleans()):
        kw["dropout_p"], kw["rng"] = draw(st.sampled_from([0.2, 0.5, 1.0])), seed % 1000
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    if mask_kind != "none":
        shape = tuple(n if draw(st.booleans()) else 1 for n in (b, hq, lq, lk))[draw(st.integers(0, 2)) :]
        if mask_kind == "bool":
            kw["attn_mask"] = rng.random(shape) < 0.7
        else:
            kw["attn_mask"] = rng.standard_normal(shape)
            kw["attn_mask"][rng.random(shape) < 0.2] = -np.inf
            kw["mask_grad"] = draw(st.booleans())
    return q, k, v, dout, kw


def _both(fwd, bwd, q, k, v, dout, kw):
    out, cache = fwd(q, k, v, **kw)
    return (out,) + tuple(bwd(dout, cache))


@settings(deadline=None, max_examples=150)
@given(cases(), st.sampled_from([None, 1, 2, 3, 5]))
def test_equals_the_textbook_flash_attention(case, block_size):
    """The textbook tier's memory_efficient_attention forms the same keep-mask from the same seed."""
    q, k, v, dout, kw = case
    got = _both(
        memory_efficient_attention, memory_efficient_attention_backward, q, k, v, dout, dict(kw, block_size=block_size)
    )
    ref = _both(R.memory_efficient_attention, R.memory_efficient_attention_backward, q, k, v, dout, kw)
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        _close(g, r, what=i)


@settings(deadline=None, max_examples=150)
@given(cases(dropout=False), st.sampled_from([None, 2, 3]))
def test_equals_the_textbook_formula(case, block_size):
    q, k, v, dout, kw = case
    got = _both(
        memory_efficient_attention, memory_efficient_attention_backward, q, k, v, dout, dict(kw, block_size=block_size)
    )
    ref = _both(R.scaled_dot_product_attention, R.scaled_dot_product_attention_backward, q, k, v, dout, kw)
    for i, (g, r) in enumerate(zip(got, ref)):
        _close(g, r, what=i)


_SDPA_OPTIONS = "window" in inspect.signature(scaled_dot_product_attention).parameters


@settings(deadline=None, max_examples=100)
@given(cases(dropout=False))
def test_equals_the_fast_scaled_dot_product_attention(case):
    q, k, v, dout, kw = case
    if not _SDPA_OPTIONS:
        kw = {key: val for key, val in kw.items() if key in ("enable_gqa", "is_causal", "attn_mask")}
        if kw.get("is_causal") and q.shape[-2] > k.shape[-2]:
            kw["is_causal"] = False  # top-left causal with Lq > Lk: both cores agree, keep it simple
        kw.pop("mask_grad", None)
    got = _both(memory_efficient_attention, memory_efficient_attention_backward, q, k, v, dout, kw)
    ref = _both(scaled_dot_product_attention, scaled_dot_product_attention_backward, q, k, v, dout, kw)
    for i, (g, r) in enumerate(zip(got, ref)):
        _close(g, np.ascontiguousarray(r), 1e-10, what=i)


def test_gqa_and_dropout_fixed_case_against_the_textbook_tier():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 6, 33, 8)), rng.standard_normal((2, 2, 40, 8)), rng.standard_normal((2, 2, 40, 5))
    dout = rng.standard_normal((2, 6, 33, 5))
    kw = dict(
        enable_gqa=True,
        dropout_p=0.3,
        rng=11,
        is_causal=True,
        causal_align="bottom_right",
        window=(9, 0),
        sinks=rng.standard_normal(6),
        alibi_slopes=rng.random(6),
        softcap=2.5,
        attn_mask=rng.standard_normal((33, 40)),
        mask_grad=True,
    )
    got = _both(memory_efficient_attention, memory_efficient_attention_backward, q, k, v, dout, dict(kw, block_size=7))
    ref = _both(R.memory_efficient_attention, R.memory_efficient_attention_backward, q, k, v, dout, kw)
    assert len(got) == 6
    for i, (g, r) in enumerate(zip(got, ref)):
        _close(g, r, what=i)
