"""The strategies for the attention options in ``npattn.testing``: valid, well-conditioned draws.

Each strategy's values are checked for range and shape, then fed to the attention cores (the
textbook tier, and the fast cores where they take the option): outputs are finite, invisible
pairs get weight 0, and the hand-written backward equals central differences at the default
tolerances (so the draws are honestly well conditioned).
"""

import inspect

import numpy as np
import pytest

pytest.importorskip("hypothesis")
from _fd import fd_check  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import npattn.functional as F  # noqa: E402
import npattn.functional.reference as R  # noqa: E402
import npattn.testing as T  # noqa: E402
from npattn.testing import gradcheck  # noqa: E402
from npattn.testing.strategies import _option_names  # noqa: E402


def test_new_names_are_exported():
    for name in (
        "windows",
        "alibi_slopes",
        "standard_alibi_slopes",
        "softcaps",
        "sinks",
        "positions",
        "ATTENTION_OPTIONS",
        "POSITION_KINDS",
    ):
        assert name in T.__all__ and getattr(T, name) is not None


@given(w=T.windows(max_left=3, max_right=2))
def test_windows(w):
    left, right = w
    assert isinstance(left, int) and isinstance(right, int)
    assert left == -1 or 0 <= left <= 3
    assert right == -1 or 0 <= right <= 2


@given(w=T.windows(unbounded=False))
def test_windows_bounded(w):
    assert min(w) >= 0


@given(h=st.integers(1, 8), data=st.data())
def test_alibi_slopes(h, data):
    s = data.draw(T.alibi_slopes(h, batch=(2,), dtype=np.float32))
    assert s.shape == (2, h) and s.dtype == np.float32
    assert np.isfinite(s).all() and (s > 0).all() and (s <= 1.0).all()


def test_standard_alibi_slopes():
    np.testing.assert_allclose(T.standard_alibi_slopes(8), [2.0 ** -(i + 1) for i in range(8)])
    np.testing.assert_allclose(T.standard_alibi_slopes(4), [2.0 ** (-2 * (i + 1)) for i in range(4)])


@given(c=T.softcaps())
def test_softcaps(c):
    assert isinstance(c, float) and 1.0 <= c <= 30.0


@given(s=T.sinks(3, dtype=np.float32))
def test_sinks(s):
    assert s.shape == (3,) and s.dtype == np.float32 and np.abs(s).max() <= 2.0


@given(
    data=st.data(),
    length=st.integers(1, 5),
    lead=st.lists(st.integers(1, 3), max_size=3).map(tuple),
    kind=st.sampled_from(T.POSITION_KINDS),
)
def test_positions_broadcast_and_feed_rope(data, length, lead, kind):
    pos = data.draw(T.positions(length, lead, max_offset=10, kinds=kind))
    assert pos.dtype.kind == "i" and (pos >= 0).all() and pos.max() < 10 + length
    assert np.broadcast_shapes(pos.shape, lead + (length,)) == lead + (length,)
    if kind == "arange":
        np.testing.assert_array_equal(pos, np.arange(length))
    if kind == "offset":
        assert (np.diff(pos) == 1).all()
    x = np.random.default_rng(0).standard_normal(lead + (length, 4))
    y, _ = F.rope(x, pos)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)  # rotations
    if length >= 2 and kind != "random":
        rep = gradcheck(F.rope, x, positions=pos)
        assert rep.ok, str(rep)


def test_bad_arguments():
    with pytest.raises(ValueError, match="options"):
        _option_names(["windw"])
    with pytest.raises(ValueError):
        T.windows(max_left=-2)
    with pytest.raises(ValueError):
        T.alibi_slopes(0)
    with pytest.raises(ValueError):
        T.softcaps(0.0)
    with pytest.raises(ValueError):
        T.sinks(0)
    with pytest.raises(ValueError, match="kinds"):
        T.positions(3, kinds=["nope"])


@settings(max_examples=50)
@given(cfg=T.attention_configs())
def test_default_configs_draw_no_option(cfg):
    assert cfg.options() == {}
    assert set(cfg.kwargs()) == {"attn_mask", "is_causal", "dropout_p", "scale", "rng", "enable_gqa"}


@settings(max_examples=40)
@given(cfg=T.attention_configs(options=["window", "causal_align"], head_axis=False))
def test_options_subset(cfg):
    assert set(cfg.options()) <= {"window", "causal_align"}


# -- the configs drive the cores ----------------------------------------------------------------------
def _checked(cfg):
    wrt = ["q", "k", "v"]
    if cfg.mask_grad:
        wrt.append("attn_mask")
    if cfg.sinks is not None:
        wrt.append("sinks")
    return wrt


@settings(max_examples=80)
@given(cfg=T.attention_configs(options=True, head_axis=True, min_len=2, max_len=4))
def test_option_configs_are_valid_for_the_textbook_tier(cfg):
    kw = cfg.kwargs()
    out, cache = R.scaled_dot_product_attention(cfg.q, cfg.k, cfg.v, **kw)
    assert np.isfinite(out).all()
    vis = np.broadcast_to(cfg.visible(), cache.p.shape)
    assert (cache.p[~vis] == 0).all()  # what visible() says is hidden gets weight 0
    rows_empty = ~vis.any(axis=-1)
    assert (out[rows_empty] == 0).all()  # a row with no visible key gives 0
    rep = gradcheck(
        (R.scaled_dot_product_attention, R.scaled_dot_product_attention_backward),
        cfg.q,
        cfg.k,
        cfg.v,
        wrt=_checked(cfg),
        **kw,
    )
    assert rep.ok, str(rep)


@settings(max_examples=25)
@given(cfg=T.attention_configs(options=True, head_axis=True, mask_kinds=("float", "none", "causal")))
def test_option_configs_agree_with_the_independent_fd(cfg):
    kw = cfg.kwargs()
    kw.pop("mask_grad", None)
    sinks = kw.pop("sinks", None)
    arrays = [cfg.q, cfg.k, cfg.v] + ([] if sinks is None else [sinks])

    def forward(q, k, v, s=None):
        return R.scaled_dot_product_attention(q, k, v, sinks=s, **kw)

    g = np.random.default_rng(cfg.seed).standard_normal(forward(*arrays)[0].shape)
    errs = fd_check(forward, R.scaled_dot_product_attention_backward, arrays, g)
    assert max(errs) < 1e-6, errs


def _fast_core_takes(name):
    return name in inspect.signature(F.scaled_dot_product_attention).parameters


@pytest.mark.skipif(not _fast_core_takes("window"), reason="the fast cores do not take the attention options yet")
@settings(max_examples=60)
@given(cfg=T.attention_configs(options=True, head_axis=True))  # the textbook tier wants (..., H, L, E)
def test_option_configs_fast_cores_match_the_textbook_tier(cfg):
    kw = cfg.kwargs()
    ref, _ = R.scaled_dot_product_attention(cfg.q, cfg.k, cfg.v, **kw)
    out, _ = F.scaled_dot_product_attention(cfg.q, cfg.k, cfg.v, **kw)
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-12)
    kw.pop("dropout_p")
    kw.pop("rng")
    me, _ = F.memory_efficient_attention(cfg.q, cfg.k, cfg.v, **kw)
    np.testing.assert_allclose(me, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(not _fast_core_takes("window"), reason="the fast cores do not take the attention options yet")
@settings(max_examples=40)
@given(cfg=T.attention_configs(options=True, head_axis=True), fast=st.booleans())
def test_option_configs_gradcheck_of_the_fast_cores(cfg, fast):
    """What a user does with these strategies: gradcheck an attention core under every option,
    naming the keyword inputs (sinks, a float mask with mask_grad) whose gradient it appends."""
    kw = cfg.kwargs()
    rep = gradcheck(F.scaled_dot_product_attention, cfg.q, cfg.k, cfg.v, wrt=_checked(cfg), fast=fast, **kw)
    assert rep.ok, str(rep)
    kw.pop("dropout_p")
    kw.pop("rng")
    rep = gradcheck(F.memory_efficient_attention, cfg.q, cfg.k, cfg.v, wrt=_checked(cfg), fast=fast, **kw)
    assert rep.ok, str(rep)
