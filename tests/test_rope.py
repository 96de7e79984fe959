"""Rotary position embedding: the explicit formulas with torch autograd (rotate-half as Hugging
Face's ``apply_rotary_pos_emb``, interleaved as Meta's complex multiplication), finite
differences, the properties that make RoPE a relative position code, and bad input."""

import importlib

import numpy as np
import pytest
from _fd import fd_check
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn.functional as F
from npattn.functional import kernels
from npattn.testing import gradcheck, seeds

TOL = 1e-10


@st.composite
def rope_cases(draw):
    """x (*lead, L, D) and positions of one of the supported forms."""
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    length, half = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    shape = lead + (length, 2 * half)
    kind = draw(st.sampled_from(["default", "offset", "per_batch", "scalar"]))
    rng = np.random.default_rng(draw(seeds()))
    if kind == "default":
        pos = None
    elif kind == "offset":
        pos = np.arange(length) + draw(st.integers(0, 4000))  # a KV cache of t tokens
    elif kind == "per_batch":  # one row of positions per leading index (broadcast over the others)
        pshape = tuple(d if draw(st.booleans()) else 1 for d in lead) + (length,)
        pos = rng.integers(-5, 100, pshape)
    else:
        pos = np.array(draw(st.integers(0, 50)))
    base = draw(st.sampled_from([10000.0, 500000.0, 10.0, 1.5]))
    return rng.standard_normal(shape), pos, base, draw(st.booleans()), rng


def explicit_positions(x_shape, pos):
    return np.broadcast_to(np.arange(x_shape[-2]) if pos is None else pos, x_shape[:-1])


# ------------------------------------------------------------------------------- torch, explicit formula


def _torch_rope(torch, x, pos, base, interleaved):
    """The formulas as the model code writes them (independent of npattn's implementation)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.from_numpy(np.asarray(pos, dtype=np.float64))[..., None] * inv_freq  # (..., L, D/2)
    if interleaved:  # Meta's Llama: view pairs as complex numbers, multiply by e^{i theta}
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2))
        return torch.view_as_real(xc * torch.polar(torch.ones_like(freqs), freqs)).flatten(-2)
    emb = torch.cat((freqs, freqs), dim=-1)  # Hugging Face: x * cos + rotate_half(x) * sin
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin()


@given(rope_cases())
def test_rope_equals_the_explicit_formula_with_torch_autograd(case):
    torch = pytest.importorskip("torch")
    x, pos, base, interleaved, rng = case
    y, cache = F.rope(x, pos, base=base, interleaved=interleaved)
    dy = rng.standard_normal(y.shape)
    dx = F.rope_backward(dy, cache)
    tx = torch.from_numpy(x.copy()).requires_grad_(True)
    ty = _torch_rope(torch, tx, explicit_positions(x.shape, pos), base, interleaved)
    ty.backward(torch.from_numpy(dy))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=0, atol=TOL * max(1.0, np.abs(x).max()))
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=0, atol=TOL * max(1.0, np.abs(dy).max()))


# ---------------------------------------------------------------------------------- finite differences


@given(rope_cases())
def test_rope_backward_finite_differences(case):
    x, pos, base, interleaved, rng = case
    kw = dict(base=base, interleaved=interleaved)
    report = gradcheck(F.rope, x, pos, **kw)
    assert report.ok and [r.name for r in report.rows] == ["x"], str(report)
    out, _ = F.rope(x, pos, **kw)
    (err,) = fd_check(lambda a: F.rope(a, pos, **kw), F.rope_backward, [x], rng.standard_normal(out.shape))
    assert err <= 1e-6


# ------------------------------------------------------------------------------------------ properties


@given(rope_cases())
def test_rope_is_a_rotation(case):
    """Each pair keeps its length, and the backward (the transpose) undoes the forward."""
    x, pos, base, interleaved, _ = case
    y, cache = F.rope(x, pos, base=base, interleaved=interleaved)
    d = x.shape[-1]
    pairs = (
        (lambda a: np.stack([a[..., 0::2], a[..., 1::2]]))
        if interleaved
        else (lambda a: np.stack([a[..., : d // 2], a[..., d // 2 :]]))
    )
    np.testing.assert_allclose(np.hypot(*pairs(y)), np.hypot(*pairs(x)), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(F.rope_backward(y, cache), x, rtol=1e-12, atol=1e-13)


@given(
    st.integers(1, 4),
    st.integers(1, 6),
    st.integers(0, 300),
    st.integers(0, 300),
    st.integers(0, 3000),
    st.booleans(),
    seeds(),
)
def test_rope_scores_depend_on_relative_position_only(half, length, p, s, shift, interleaved, seed):
    """<rope(q at p), rope(k at s)> = <rope(q at p + t), rope(k at s + t)>: what attention sees is p - s."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, length, 2 * half))
    qp, kp = np.arange(length) + p, np.arange(length) + s
    score = F.rope(q, qp, interleaved=interleaved)[0] @ F.rope(k, kp, interleaved=interleaved)[0].T
    shifted = F.rope(q, qp + shift, interleaved=interleaved)[0] @ F.rope(k, kp + shift, interleaved=interleaved)[0].T
    np.testing.assert_allclose(shifted, score, rtol=1e-9, atol=1e-9 * 2 * half)


@given(rope_cases())
def test_rope_layouts_are_a_permutation_of_each_other(case):
    """Interleaved = rotate-half on features reordered (0, 2, 4, ..., 1, 3, 5, ...)."""
    x, pos, base, _, _ = case
    d = x.shape[-1]
    perm = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
    inter, _ = F.rope(x, pos, base=base, interleaved=True)
    half, _ = F.rope(x[..., perm], pos, base=base)
    np.testing.assert_array_equal(inter[..., perm], half)


@given(rope_cases())
def test_rope_defaults_and_position_zero(case):
    x, _, base, interleaved, _ = case
    length = x.shape[-2]
    y, _ = F.rope(x, base=base, interleaved=interleaved)
    np.testing.assert_array_equal(y, F.rope(x, np.arange(length), base=base, interleaved=interleaved)[0])
    y0, _ = F.rope(x, np.zeros(length, dtype=int), base=base, interleaved=interleaved)
    np.testing.assert_array_equal(y0, x)  # angle 0: the identity
    # an offset equals slicing a longer sequence (a KV cache decoding token by token)
    t = 7
    big = np.concatenate([np.zeros(x.shape[:-2] + (t, x.shape[-1])), x], axis=-2)
    np.testing.assert_allclose(
        F.rope(x, np.arange(length) + t, base=base, interleaved=interleaved)[0],
        F.rope(big, base=base, interleaved=interleaved)[0][..., t:, :],
        rtol=0,
        atol=0,
    )


def test_rope_float32_stays_float32_and_kernel_equals_public():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5, 8)).astype(np.float32)
    pos = np.arange(5) + 10000  # large positions: the angle is formed in float64, then cast
    y, cache = F.rope(x, pos)
    assert y.dtype == np.float32 and cache.cos.dtype == np.float32
    assert F.rope_backward(np.ones_like(y), cache).dtype == np.float32
    y64, _ = F.rope(x.astype(np.float64), pos)
    np.testing.assert_allclose(y, y64, rtol=0, atol=1e-5)
    yk, ck = kernels.rope(x, pos, base=10000.0, interleaved=False)
    np.testing.assert_array_equal(yk, y)
    np.testing.assert_array_equal(kernels.rope_backward(y, ck), F.rope_backward(y, cache))


def test_rope_does_not_modify_its_inputs():
    rng = np.random.default_rng(1)
    x, pos, dy = rng.standard_normal((2, 4, 6)), np.arange(4) + 3, rng.standard_normal((2, 4, 6))
    before = [a.copy() for a in (x, pos, dy)]
    _, cache = F.rope(x, pos)
    F.rope_backward(dy, cache)
    for a, b in zip((x, pos, dy), before):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------------------------- bad input


def raises(exc, name, fn, *parts):
    with pytest.raises(exc, match=f"^{name}:") as info:
        fn()
    for p in parts:
        assert p in str(info.value), (p, str(info.value))


def test_rope_bad_input():
    x = np.zeros((2, 3, 4))
    raises(ValueError, "x", lambda: F.rope(np.zeros(4)), "(4,)")
    raises(ValueError, "x", lambda: F.rope(np.zeros((3, 5))), "even", "(3, 5)")
    raises(TypeError, "x", lambda: F.rope(np.zeros((3, 4), dtype=bool)))
    raises(TypeError, "positions", lambda: F.rope(x, np.arange(3.0)), "float64")
    raises(TypeError, "positions", lambda: F.rope(x, np.ones(3, dtype=bool)))
    raises(ValueError, "positions", lambda: F.rope(x, np.arange(4)), "(2, 3)", "(4,)")
    raises(ValueError, "positions", lambda: F.rope(x, np.zeros((3, 3), int)), "(3, 3)")
    raises(ValueError, "positions", lambda: F.rope(x, np.zeros((1, 2, 3), int)), "(1, 2, 3)")  # would widen x
    for bad in (0.0, -2.0, float("nan"), float("inf")):
        raises(ValueError, "base", lambda: F.rope(x, base=bad), repr(bad))
    for bad in ("big", None, True):
        raises(TypeError, "base", lambda: F.rope(x, base=bad))
    raises(TypeError, "interleaved", lambda: F.rope(x, interleaved=1))
    y, cache = F.rope(x)
    raises(ValueError, "dout", lambda: F.rope_backward(np.zeros((2, 3, 5)), cache), "(2, 3, 4)", "(2, 3, 5)")
    raises(TypeError, "cache", lambda: F.rope_backward(y, F.silu(x)[1]), "RopeCache", "SiluCache")
    raises(TypeError, "cache", lambda: F.rope_backward(y, (cache.cos, cache.sin)), "RopeCache", "tuple")


@pytest.mark.parametrize("scaling", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}])
def test_rope_again_is_rope_at_the_same_positions(scaling):
    """``rope_again`` rotates by the angles an earlier call cached (the keys at the queries'
    positions, issue 32, item 5): the numbers and the cache of ``rope`` itself."""
    rng = np.random.default_rng(7)
    q, k = rng.standard_normal((2, 4, 6, 8)), rng.standard_normal((2, 2, 6, 8))
    pos = np.arange(3, 9)
    from npattn.functional.rope_scaling import check_scaling

    params = None if scaling is None else check_scaling(scaling)
    _, qc = kernels.rope(q, pos, base=100.0, scaling=params)
    y, kc = kernels.rope_again(k, qc)
    y_ref, kc_ref = kernels.rope(k, pos, base=100.0, scaling=params)
    assert np.array_equal(y, y_ref) and np.abs(y).max() > 0
    assert kc.shape == kc_ref.shape and np.array_equal(kc.cos, kc_ref.cos) and np.array_equal(kc.sin, kc_ref.sin)
    assert np.array_equal(kernels.rope_backward(y, kc), kernels.rope_backward(y_ref, kc_ref))


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([np.float32, np.float64]),
    st.booleans(),
    st.sampled_from([None, 4, 2]),
    st.integers(1, 5),
    st.integers(0, 2**16),
)
def test_the_rotation_is_the_pairwise_formula_bit_for_bit(dtype, interleaved, rotary_dim, L, seed):
    """``_rotate`` forms ``x c + swap(x) s`` over whole rows: each pair's ``(a cos - b sin, b cos +
    a sin)`` with the pairwise form's own roundings, both layouts, partial rotary (the rest
    copied), cos and sin broadcast over the heads."""
    R = importlib.import_module("npattn.functional.rope")  # the module (the package's ``rope`` is the op)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, L, 6)).astype(dtype)
    r = 6 if rotary_dim is None else rotary_dim
    theta = rng.uniform(-10, 10, (L, r // 2))
    cos, sin = np.cos(theta).astype(dtype), np.sin(theta).astype(dtype)
    a, b = (x[..., 0:r:2], x[..., 1:r:2]) if interleaved else (x[..., : r // 2], x[..., r // 2 : r])
    want = x.copy()
    wa, wb = (want[..., 0:r:2], want[..., 1:r:2]) if interleaved else (want[..., : r // 2], want[..., r // 2 : r])
    wa[...], wb[...] = a * cos - b * sin, b * cos + a * sin
    np.testing.assert_array_equal(R._rotate(x, cos, sin, interleaved), want)
