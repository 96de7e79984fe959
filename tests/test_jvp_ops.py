"""Forward mode (``<op>_jvp``) of the functional pairs other than attention, in both tiers.

Each JVP is checked against ``torch.func.jvp`` of the op's formula written in torch (float64,
1e-10), against central differences of the forward (an independent check that needs no torch),
against the other tier (1e-12), and against the backward by the transposition identity
``<u, J t> = <J^T u, t>``; bad tangents are refused naming the argument; float32 stays float32.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import numpy as np
import pytest
from _oracles import rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn.functional as F
import npattn.functional.reference as R
from npattn.testing import dtypes, seeds, shapes


class Case(NamedTuple):
    """One forward call: ``op`` names the pair; ``primals`` the differentiable inputs in tangent
    order; ``kw`` the rest.  ``torch_fn(torch, *tensors)`` is the formula in torch (None: no
    oracle); ``fd``/``transpose``: whether central differences / the backward's transpose apply."""

    name: str
    op: str
    primals: tuple
    call: Callable  # call(module, *primals) -> (out, cache), module F or R
    torch_fn: Optional[Callable]
    fd: bool = True
    transpose: bool = True


def _ids(rng, shape, n):
    return rng.integers(0, n, shape)


def make_cases(rng, dtype=np.float64, lead=(2, 3)) -> list:
    """Every op with its options, at small random shapes with leading dims ``lead``."""
    lead = tuple(lead)

    def u(*shape, scale=1.0):
        return rng.uniform(-scale, scale, shape).astype(dtype)

    d, o, c = 4, 3, 5
    cases = []
    # -- linear
    x, w, b = u(*lead, d), u(o, d), u(o)
    cases.append(
        Case("linear", "linear", (x, w, b), lambda M, x, w, b: M.linear(x, w, b), lambda t, x, w, b: x @ w.T + b)
    )
    cases.append(Case("linear_nobias", "linear", (x, w), lambda M, x, w: M.linear(x, w), lambda t, x, w: x @ w.T))
    # -- embedding
    n = 6
    ids = _ids(rng, lead, n)
    ew = u(n, d)
    tf = lambda kw: lambda t, w: t.nn.functional.embedding(t.tensor(ids), w, **kw)  # noqa: E731
    cases.append(Case("embedding", "embedding", (ew,), lambda M, w: M.embedding(ids, w), tf({})))
    opts = dict(padding_idx=int(ids.reshape(-1)[0]), scale_grad_by_freq=True)
    cases.append(
        Case(
            "embedding_pad_freq",
            "embedding",
            (ew,),
            lambda M, w: M.embedding(ids, w, **opts),
            tf(opts),
            transpose=False,  # these options change torch's backward, not the derivative
        )
    )
    cases.append(
        Case(
            "embedding_max_norm",
            "embedding",
            (ew,),
            lambda M, w: M.embedding(ids, w, max_norm=0.5),
            lambda t, w: t.nn.functional.embedding(t.tensor(ids), w.clone(), max_norm=0.5),
            fd=False,  # the renormalisation is not differentiated (as torch)
        )
    )
    # -- activations
    sx = u(*lead, c, scale=3.0)
    sx_inf = sx.copy()
    sx_inf[..., 0] = -np.inf  # a masked column: weight 0, tangent 0
    cases.append(Case("softmax", "softmax", (sx,), lambda M, x: M.softmax(x), lambda t, x: t.softmax(x, -1)))
    cases.append(Case("softmax_axis0", "softmax", (sx,), lambda M, x: M.softmax(x, 0), lambda t, x: t.softmax(x, 0)))
    cases.append(Case("softmax_inf", "softmax", (sx_inf,), lambda M, x: M.softmax(x), lambda t, x: t.softmax(x, -1)))
    rx = u(*lead, c)
    rx = np.where(np.abs(rx) < 0.05, 0.5, rx).astype(dtype)  # away from the kink
    cases.append(Case("relu", "relu", (rx,), lambda M, x: M.relu(x), lambda t, x: t.relu(x)))
    gx = u(*lead, c, scale=3.0)
    cases.append(Case("gelu", "gelu", (gx,), lambda M, x: M.gelu(x), lambda t, x: t.nn.functional.gelu(x)))
    cases.append(
        Case(
            "gelu_tanh",
            "gelu",
            (gx,),
            lambda M, x: M.gelu(x, approximate="tanh"),
            lambda t, x: t.nn.functional.gelu(x, approximate="tanh"),
        )
    )
    cases.append(Case("silu", "silu", (gx,), lambda M, x: M.silu(x), lambda t, x: t.nn.functional.silu(x)))
    seed = int(rng.integers(0, 2**31))
    keep = np.random.default_rng(seed).random(gx.shape) >= 0.3
    cases.append(
        Case(
            "dropout",
            "dropout",
            (gx,),
            lambda M, x: M.dropout(x, 0.3, seed),  # an int seed: the same mask at every call
            lambda t, x: x * t.tensor(keep) / 0.7,
        )
    )
    cases.append(
        Case("dropout_eval", "dropout", (gx,), lambda M, x: M.dropout(x, 0.3, seed, False), lambda t, x: x * 1)
    )
    # -- norms
    lx = u(*lead, c, scale=2.0)
    lw, lb = u(c) + 1.5, u(c)

    def t_ln(t, shape, x, w=None, b=None):
        return t.nn.functional.layer_norm(x, shape, w, b, 1e-5)

    cases.append(
        Case(
            "layer_norm",
            "layer_norm",
            (lx, lw, lb),
            lambda M, x, w, b: M.layer_norm(x, w, b),
            lambda t, x, w, b: t_ln(t, (c,), x, w, b),
        )
    )
    cases.append(
        Case("layer_norm_plain", "layer_norm", (lx,), lambda M, x: M.layer_norm(x), lambda t, x: t_ln(t, (c,), x))
    )
    if len(lead) >= 1:
        ns = (lead[-1], c)
        lw2 = u(*ns) + 1.5
        cases.append(
            Case(
                "layer_norm_2axes",
                "layer_norm",
                (lx, lw2),
                lambda M, x, w: M.layer_norm(x, w, normalized_shape=ns),
                lambda t, x, w: t_ln(t, ns, x, w),
            )
        )
    cases.append(
        Case(
            "rms_norm",
            "rms_norm",
            (lx, lw),
            lambda M, x, w: M.rms_norm(x, w, 1e-6),
            lambda t, x, w: t.nn.functional.rms_norm(x, (c,), w, 1e-6),
        )
    )
    cases.append(
        Case(
            "rms_norm_plain",
            "rms_norm",
            (lx,),
            lambda M, x: M.rms_norm(x),
            lambda t, x: t.nn.functional.rms_norm(x, (c,)),
        )
    )
    # -- rope
    L, D = 3, 6
    px = u(*lead, L, D)
    pos = rng.integers(0, 50, L)

    def t_rope(t, x, positions, interleaved):
        ang = t.tensor(positions, dtype=t.float64)[..., None] * 10000.0 ** (-t.arange(0, D, 2, dtype=t.float64) / D)
        cos, sin = t.cos(ang).to(x.dtype), t.sin(ang).to(x.dtype)
        a, b_ = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : D // 2], x[..., D // 2 :])
        ya, yb = a * cos - b_ * sin, b_ * cos + a * sin
        return t.stack([ya, yb], -1).reshape(x.shape) if interleaved else t.cat([ya, yb], -1)

    cases.append(Case("rope", "rope", (px,), lambda M, x: M.rope(x), lambda t, x: t_rope(t, x, np.arange(L), False)))
    cases.append(
        Case(
            "rope_interleaved_pos",
            "rope",
            (px,),
            lambda M, x: M.rope(x, pos, interleaved=True),
            lambda t, x: t_rope(t, x, pos, True),
        )
    )
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}  # attention factor != 1
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    for label, kw in (("rope_yarn", dict(scaling=yarn)), ("rope_partial_llama3", dict(rotary_dim=4, scaling=llama3))):
        cases.append(
            Case(
                label,
                "rope",
                (px,),
                lambda M, x, kw=kw: M.rope(x, pos, **kw),
                None,  # a scaled rotation: checked by central differences, the backward and the other tier
            )
        )
    # -- cross_entropy
    z = u(*lead, c, scale=2.0)
    tgt = _ids(rng, lead, c)
    ign = tgt.copy()
    ign.reshape(-1)[0] = -100
    cw = rng.uniform(0.5, 2.0, c).astype(dtype)
    probs = rng.dirichlet(np.ones(c), lead).astype(dtype)

    def t_ce(t, x, target, **kw):  # classes on torch's axis 1
        return t.nn.functional.cross_entropy(x.reshape(-1, c), target, **kw).reshape(
            lead if kw.get("reduction") == "none" else ()
        )

    for red in ("mean", "sum", "none"):
        cases.append(
            Case(
                f"ce_{red}",
                "cross_entropy",
                (z,),
                lambda M, x, red=red: M.cross_entropy(x, tgt, reduction=red),
                lambda t, x, red=red: t_ce(t, x, t.tensor(tgt.reshape(-1)), reduction=red),
            )
        )
    ce_kw = dict(weight=cw, label_smoothing=0.2)
    cases.append(
        Case(
            "ce_weight_smooth_ignore",
            "cross_entropy",
            (z,),
            lambda M, x: M.cross_entropy(x, ign, -100, **ce_kw),
            lambda t, x: t_ce(
                t, x, t.tensor(ign.reshape(-1)), ignore_index=-100, weight=t.tensor(cw), label_smoothing=0.2
            ),
        )
    )
    cases.append(
        Case(
            "ce_probs",
            "cross_entropy",
            (z,),
            lambda M, x: M.cross_entropy(x, probs, weight=cw, label_smoothing=0.1, reduction="none"),
            lambda t, x: t_ce(
                t, x, t.tensor(probs.reshape(-1, c)), weight=t.tensor(cw), label_smoothing=0.1, reduction="none"
            ),
        )
    )
    return cases


CASE_NAMES = [c.name for c in make_cases(np.random.default_rng(0))]


def _case(name, seed=0, dtype=np.float64, lead=(2, 3)):
    return next(c for c in make_cases(np.random.default_rng(seed), dtype, lead) if c.name == name)


def _tangents(case, rng, dtype=np.float64):
    return tuple(rng.standard_normal(np.shape(p)).astype(dtype) for p in case.primals)


def _jvp(module, case, tangents):
    _, cache = case.call(module, *case.primals)
    return getattr(module, case.op + "_jvp")(cache, *tangents)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_jvp_matches_torch_func_jvp(name, torch_or_skip):
    torch = torch_or_skip
    case = _case(name, seed=1)
    if case.torch_fn is None:
        pytest.skip("no torch formula")
    tangents = _tangents(case, np.random.default_rng(2))
    primals_t = tuple(torch.tensor(np.asarray(p, np.float64)) for p in case.primals)
    tangents_t = tuple(torch.tensor(t) for t in tangents)
    _, want = torch.func.jvp(lambda *xs: case.torch_fn(torch, *xs), primals_t, tangents_t)
    for module in (F, R):
        got = _jvp(module, case, tangents)
        assert rel_err(got, want.numpy(), floor=1.0, relative_to="max_b") < 1e-10, (name, module.__name__)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_jvp_matches_central_differences(name):
    case = _case(name, seed=3)
    if not case.fd:
        pytest.skip("the op's derivative is not differentiated through (documented)")
    tangents = _tangents(case, np.random.default_rng(4))
    eps = 1e-6

    def f(sign):
        moved = [p + sign * eps * t for p, t in zip(case.primals, tangents)]
        return case.call(F, *moved)[0]

    num = (f(1) - f(-1)) / (2 * eps)
    num = np.where(np.isfinite(num), num, 0.0)  # -inf - -inf at masked softmax entries
    got = _jvp(F, case, tangents)
    assert rel_err(got, num, floor=1.0, relative_to="max_b") < 1e-6, name


@pytest.mark.parametrize("name", CASE_NAMES)
def test_transposition_identity(name):
    """``<u, J t> = sum_i <(J^T u)_i, t_i>``: the hand-written forward and reverse modes agree."""
    case = _case(name, seed=5)
    if not case.transpose:
        pytest.skip("backward is not the derivative's transpose here (documented)")
    rng = np.random.default_rng(6)
    tangents = _tangents(case, rng)
    out, cache = case.call(F, *case.primals)
    u = rng.standard_normal(np.shape(out))
    grads = getattr(F, case.op + "_backward")(u, cache)
    grads = grads if isinstance(grads, tuple) else (grads,)
    lhs = float(np.sum(u * F.__dict__[case.op + "_jvp"](cache, *tangents)))
    rhs = sum(float(np.sum(g * t)) for g, t in zip(grads, tangents) if g is not None)
    assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), (name, lhs, rhs)


@settings(max_examples=60)
@given(st.sampled_from(CASE_NAMES), seeds(), shapes(1, 2, 1, 3), dtypes())
def test_both_tiers_equal(name, seed, lead, dtype):
    case = _case(name, seed, dtype, lead)
    rng = np.random.default_rng(seed + 1)
    tangents = _tangents(case, rng, dtype)
    fast, ref = _jvp(F, case, tangents), _jvp(R, case, tangents)
    assert fast.dtype == dtype, (name, fast.dtype)
    assert rel_err(fast, ref, floor=1.0, relative_to="max_b") < (1e-12 if dtype == np.float64 else 1e-5), name
    # a tangent left out (None) is zero: the same as passing zeros
    if len(tangents) > 1:
        part = _jvp(F, case, tangents[:1])
        zeros = _jvp(F, case, tangents[:1] + tuple(np.zeros_like(t) for t in tangents[1:]))
        np.testing.assert_array_equal(part, zeros)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_float32_stays_float32(name):
    c64 = _case(name, seed=7)
    c32 = _case(name, seed=7, dtype=np.float32)
    t64 = _tangents(c64, np.random.default_rng(8))
    got = _jvp(F, c32, tuple(t.astype(np.float32) for t in t64))
    assert got.dtype == np.float32
    assert rel_err(got, _jvp(F, c64, t64), floor=1.0, relative_to="max_b") < 1e-4, name


@pytest.mark.parametrize("name", CASE_NAMES)
def test_no_tangent_is_zero(name):
    case = _case(name)
    out, cache = case.call(F, *case.primals)
    t = getattr(F, case.op + "_jvp")(cache)
    assert t.shape == np.shape(out) and t.dtype == out.dtype and not np.any(t)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_tangents_are_refused(name):
    case = _case(name)
    _, cache = case.call(F, *case.primals)
    jvp = getattr(F, case.op + "_jvp")
    good = _tangents(case, np.random.default_rng(9))
    names = {
        "linear": ("tx", "tweight", "tbias"),
        "layer_norm": ("tx", "tweight", "tbias"),
        "rms_norm": ("tx", "tweight"),
        "embedding": ("tweight",),
        "cross_entropy": ("tlogits",),
    }.get(case.op, ("tx",))
    for i in range(len(good)):
        wrong_shape = list(good)
        wrong_shape[i] = np.zeros(np.shape(good[i]) + (2,))
        with pytest.raises(ValueError, match=names[i]):
            jvp(cache, *wrong_shape)
        as_bool = list(good)
        as_bool[i] = np.ones(np.shape(good[i]), bool)
        with pytest.raises(TypeError, match=names[i]):
            jvp(cache, *as_bool)
        as_complex = list(good)
        as_complex[i] = good[i] + 0j
        with pytest.raises(TypeError, match=names[i]):
            jvp(cache, *as_complex)
    with pytest.raises(TypeError, match="at most"):
        jvp(cache, *(list(good) + [None] * (len(names) - len(good)) + [good[0]]))
    with pytest.raises(TypeError, match="cache"):
        jvp((1, 2), *good)
    # integer tangents are cast, as every array argument
    ints = tuple(np.ones(np.shape(g), np.int64) for g in good)
    np.testing.assert_array_equal(jvp(cache, *ints), jvp(cache, *(np.ones(np.shape(g)) for g in good)))


@pytest.mark.parametrize(
    "op,call",
    [
        ("linear", lambda: F.linear(np.ones((2, 3)), np.ones((4, 3)))),
        ("layer_norm", lambda: F.layer_norm(np.arange(6.0).reshape(2, 3))),
        ("rms_norm", lambda: F.rms_norm(np.arange(6.0).reshape(2, 3))),
    ],
)
def test_tangent_of_an_absent_input_is_refused(op, call):
    out, cache = call()
    jvp = getattr(F, op + "_jvp")
    n = {"linear": 3, "layer_norm": 3, "rms_norm": 2}[op]
    args = [None] * n
    args[-1] = np.ones(3) if op != "linear" else np.ones(4)
    with pytest.raises(ValueError, match="expected None"):
        jvp(cache, *args)


def test_tangents_are_not_modified():
    for case in make_cases(np.random.default_rng(10)):
        tangents = _tangents(case, np.random.default_rng(11))
        copies = [t.copy() for t in tangents]
        for module in (F, R):
            _jvp(module, case, tangents)
        for t, c in zip(tangents, copies):
            np.testing.assert_array_equal(t, c)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_textbook_no_tangent_is_zero(name):
    """The textbook tier: no tangent is zero, or None where the cache does not know the output's
    shape (rope, dropout in eval mode; documented in its module docstring)."""
    case = _case(name)
    out, cache = case.call(R, *case.primals)
    t = getattr(R, case.op + "_jvp")(cache)
    if t is None:
        assert case.op in ("rope", "dropout")
    else:
        assert np.size(t) == np.size(out) and not np.any(t)
