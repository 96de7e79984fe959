"""Bad input for every attention option: npattn's own clear error naming the argument, before any
arithmetic, nothing modified; the backward recognises its own cache; ``rng`` checked always."""

import re

import numpy as np
import pytest

import npattn.functional as F
from npattn.functional import _blocks
from npattn.functional import reference as R

sdpa, sdpa_bw = F.scaled_dot_product_attention, F.scaled_dot_product_attention_backward


def _inputs():
    rng = np.random.default_rng(0)
    return rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 3, 6, 5)), rng.standard_normal((2, 3, 6, 2))


BAD = [  # (keyword arguments, exception, argument named, text the message contains)
    (dict(causal_align="bottom-right"), ValueError, "causal_align", "'bottom-right'"),
    (dict(causal_align="TOP_LEFT"), ValueError, "causal_align", "TOP_LEFT"),
    (dict(causal_align=None), TypeError, "causal_align", "None"),
    (dict(causal_align=1), TypeError, "causal_align", "int"),
    (dict(window=3), TypeError, "window", "int"),
    (dict(window="3,0"), TypeError, "window", "str"),
    (dict(window=(3,)), ValueError, "window", "(3,)"),
    (dict(window=(1, 2, 3)), ValueError, "window", "3 values"),
    (dict(window=(-2, 0)), ValueError, "window", "left = -2"),
    (dict(window=(0, -5)), ValueError, "window", "right = -5"),
    (dict(window=(1.5, 0)), TypeError, "window", "1.5"),
    (dict(window=(True, 0)), TypeError, "window", "True"),
    (dict(window=(None, 0)), TypeError, "window", "None"),
    (dict(alibi_slopes=np.ones(4)), ValueError, "alibi_slopes", "(4,)"),
    (dict(alibi_slopes=np.ones((3, 3))), ValueError, "alibi_slopes", "(2, 3)"),
    (dict(alibi_slopes=np.array([1.0, np.nan, 1.0])), ValueError, "alibi_slopes", "NaN"),
    (dict(alibi_slopes=np.array([1.0, np.inf, 1.0])), ValueError, "alibi_slopes", "inf"),
    (dict(alibi_slopes=np.ones(3, bool)), TypeError, "alibi_slopes", "bool"),
    (dict(alibi_slopes="steep"), TypeError, "alibi_slopes", ""),
    (dict(softcap=0.0), ValueError, "softcap", "0.0"),
    (dict(softcap=-1.0), ValueError, "softcap", "-1.0"),
    (dict(softcap=float("nan")), ValueError, "softcap", "nan"),
    (dict(softcap=float("inf")), ValueError, "softcap", "inf"),
    (dict(softcap="30"), TypeError, "softcap", "'30'"),
    (dict(softcap=True), TypeError, "softcap", "True"),
    (dict(sinks=np.zeros(4)), ValueError, "sinks", "(3,)"),
    (dict(sinks=np.zeros((1, 3))), ValueError, "sinks", "(1, 3)"),
    (dict(sinks=np.zeros(())), ValueError, "sinks", "()"),
    (dict(sinks=np.array([0.0, np.nan, 0.0])), ValueError, "sinks", "NaN"),
    (dict(sinks=np.array(["a", "b", "c"])), TypeError, "sinks", "dtype"),
    (dict(sinks=[[0.0], [1.0, 2.0]]), TypeError, "sinks", ""),
    (dict(mask_grad=1), TypeError, "mask_grad", "1"),
    (dict(mask_grad="yes"), TypeError, "mask_grad", "yes"),
    (dict(mask_grad=True), ValueError, "mask_grad", "float attn_mask"),
    (dict(mask_grad=True, attn_mask=np.ones((4, 6), bool)), ValueError, "mask_grad", "bool"),
    (dict(scale=float("nan")), ValueError, "scale", "nan"),
    (dict(scale=float("inf")), ValueError, "scale", "inf"),
    (dict(scale=-float("inf")), ValueError, "scale", "inf"),
    (dict(scale="0.5"), TypeError, "scale", "'0.5'"),
    (dict(scale=1j), TypeError, "scale", "complex"),
    (dict(rng=1.5), TypeError, "rng", "float"),
    (dict(rng="seed"), TypeError, "rng", "str"),
    (dict(rng=-1), ValueError, "rng", "-1"),
    (dict(rng=1.5, dropout_p=0.0), TypeError, "rng", "float"),
]


@pytest.mark.parametrize("kw,exc,name,text", BAD, ids=[f"{i}-{next(iter(b[0]))}" for i, b in enumerate(BAD)])
def test_bad_option_raises_a_clear_error_and_modifies_nothing(kw, exc, name, text):
    q, k, v = _inputs()
    kw = dict(kw)
    copies = [a.copy() for a in (q, k, v)] + [np.array(x, copy=True) for x in kw.values() if isinstance(x, np.ndarray)]
    with pytest.raises(exc, match=rf"^{re.escape(name)}: ") as info:
        sdpa(q, k, v, **kw)
    assert text in str(info.value)
    after = [q, k, v] + [x for x in kw.values() if isinstance(x, np.ndarray)]
    for a, b in zip(after, copies):
        np.testing.assert_array_equal(a, b)


def test_sinks_without_a_head_axis_are_one_logit():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((4, 3)), rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
    out, cache = sdpa(q, k, v, sinks=np.array([0.5]))
    assert sdpa_bw(np.ones(out.shape), cache)[3].shape == (1,)
    with pytest.raises(ValueError, match=r"^sinks: .*\(1,\)"):
        sdpa(q, k, v, sinks=np.zeros(2))


def test_gqa_sinks_and_slopes_are_per_query_head():
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((1, 4, 3, 2)), rng.standard_normal((1, 2, 5, 2)), rng.standard_normal((1, 2, 5, 2))
    with pytest.raises(ValueError, match=r"^sinks: expected shape \(4,\)"):
        sdpa(q, k, v, enable_gqa=True, sinks=np.zeros(2))
    with pytest.raises(ValueError, match=r"^alibi_slopes: .*\(1, 4\)"):
        sdpa(q, k, v, enable_gqa=True, alibi_slopes=np.ones(2))


def test_backward_recognises_its_own_cache():
    q, k, v = _inputs()
    out, _ = sdpa(q, k, v)
    _, me_cache = F.memory_efficient_attention(q, k, v)
    with pytest.raises(
        TypeError,
        match=r"^cache: scaled_dot_product_attention_backward expected a AttentionCache .* got MemoryEfficientCache$",
    ):
        sdpa_bw(np.ones(out.shape), me_cache)
    textbook = R.scaled_dot_product_attention(q, k, v)[1]  # the same class name in the other tier
    with pytest.raises(
        TypeError, match=r"functional\.attention\.AttentionCache .* got npattn\.functional\.reference\."
    ):
        sdpa_bw(np.ones(out.shape), textbook)
    with pytest.raises(TypeError, match=r"^cache: .* got tuple"):
        sdpa_bw(np.ones(out.shape), (q, k, v))
    with pytest.raises(TypeError, match=r"^cache: .* got NoneType"):
        sdpa_bw(np.ones(out.shape), None)


def test_bad_dout_with_options():
    q, k, v = _inputs()
    out, cache = sdpa(q, k, v, window=(1, 1), sinks=np.zeros(3))
    with pytest.raises(ValueError, match=r"^dout: .*\(2, 3, 4, 2\)"):
        sdpa_bw(np.ones((2, 3, 4, 3)), cache)
    with pytest.raises(TypeError, match=r"^dout: "):
        sdpa_bw(np.ones(out.shape, bool), cache)


def test_is_causal_with_a_right_window_side_is_causal():
    """With ``is_causal`` the window's right side is 0: (2, 3) and (2, 0) agree."""
    q, k, v = _inputs()
    a = sdpa(q, k, v, is_causal=True, window=(2, 3))[0]
    b = sdpa(q, k, v, is_causal=True, window=(2, 0))[0]
    np.testing.assert_array_equal(a, b)


def test_checked_options_defaults_and_plain():
    opts = _blocks.AttentionOptions().checked((2, 3, 4, 5), np.float64, None)
    assert opts == _blocks.AttentionOptions() and opts.plain
    assert not _blocks.AttentionOptions(window=(1, 1)).checked((2, 3, 4, 5), np.float64, None).plain


def test_band_and_key_ranges():
    b = _blocks.band(4, 10, True, "bottom_right", (2, -1))
    assert b == _blocks.Band(6, 2, 0)
    assert _blocks.key_range(b, 0, 2, 10) == (4, 8)  # positions 6, 7 see keys 4..7
    assert _blocks.key_range(_blocks.band(6, 3, True, "bottom_right"), 0, 4, 3) == (0, 1)  # only row 3 sees key 0
    assert _blocks.key_range(_blocks.band(6, 3, True, "bottom_right"), 0, 3, 3) == (0, 0)  # rows 0..2 see nothing
    assert _blocks.band_hidden(_blocks.band(4, 4, False), 0, 4, 0, 4) is None
    hidden = _blocks.band_hidden(_blocks.band(4, 4, True), 0, 4, 0, 4)  # key-major: key a hidden from query i iff a > i
    np.testing.assert_array_equal(hidden, np.arange(4)[:, None] > np.arange(4)[None, :])
    np.testing.assert_array_equal(_blocks.causal_hidden(4, 4, 0), hidden)
