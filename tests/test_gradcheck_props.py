"""gradcheck is right about right code and about wrong code.

* No false failures: npattn's own ops and modules pass over many seeds, shapes and input scales
  (0.1 to 10), in both modes (the property tests below; hundreds of cases, a few seconds).
* Planted bugs are caught: one element of a gradient off by 1e-3 of the gradient's largest
  element (at its largest element or anywhere else), or the whole gradient scaled by 1 + 1e-3, in
  softmax, layer norm, attention, rope and a user's own module, at input scales 0.1 to 10.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
import npattn.functional as F
from npattn.testing import gradcheck

SCALES = (0.1, 0.3, 1.0, 3.0, 10.0)


# ----------------------------------------------------------------------------- the known cases


def test_the_false_failures_of_fixed_tolerances_are_gone():
    rng = np.random.default_rng(0)
    assert gradcheck(F.layer_norm, rng.standard_normal((4, 4, 16))).ok  # rel 2.8e-5 with eps=1e-6, rtol=1e-5
    x = np.random.default_rng(0).standard_normal((3, 3, 3, 3, 4))
    assert gradcheck(F.rope, x, positions=np.array([5, 6, 7])).ok
    for seed in range(100):  # about one seed in a hundred failed
        x = np.random.default_rng(seed).standard_normal((2, 3, 8))
        assert gradcheck(F.rms_norm, x, np.random.default_rng(seed + 1).standard_normal(8), seed=seed).ok, seed


# ----------------------------------------------------------------------------- no false failures


def _functional_case(name, rng, s, b, L, D):
    """``(target, args, kwargs)`` for op ``name`` with inputs of scale ``s``."""
    x = lambda *shape: rng.standard_normal(shape) * s  # noqa: E731
    if name == "softmax":
        return F.softmax, (x(b, L, D),), {"axis": int(rng.integers(-2, 0))}
    if name == "layer_norm":
        return F.layer_norm, (x(b, L, D), 1 + 0.3 * rng.standard_normal(D), x(D)), {}
    if name == "rms_norm":
        return F.rms_norm, (x(b, L, D), 1 + 0.3 * rng.standard_normal(D)), {}
    if name == "rope":
        return F.rope, (x(b, L, 2 * D),), {"positions": rng.integers(0, 20, L)}
    if name == "gelu":
        return F.gelu, (x(b, L, D),), {"approximate": str(rng.choice(["none", "tanh"]))}
    if name == "silu":
        return F.silu, (x(b, L, D),), {}
    if name == "relu":  # away from the kink by far more than a step
        return F.relu, (np.where(rng.random((b, L, D)) < 0.5, -1, 1) * rng.uniform(0.05, 1, (b, L, D)) * s,), {}
    if name == "linear":
        return F.linear, (x(b, L, D), x(3, D), x(3)), {}
    if name == "cross_entropy":
        return F.cross_entropy, (x(b * L, D), rng.integers(0, D, b * L)), {"label_smoothing": 0.1}
    if name == "embedding":
        return F.embedding, (rng.integers(0, 5, (b, L)), x(5, D)), {}
    if name == "dropout":
        return F.dropout, (x(b, L, D), 0.3, np.random.default_rng(int(rng.integers(1 << 30)))), {}
    if name in ("sdpa", "mea"):
        q, k, v = x(b, 2, L, D), x(b, 2, L + 1, D), x(b, 2, L + 1, D)
        op = F.scaled_dot_product_attention if name == "sdpa" else F.memory_efficient_attention
        kw = {"is_causal": bool(rng.integers(2)), "causal_align": "bottom_right"}
        if name == "mea":
            kw["block_size"] = 2
        return op, (q, k, v), kw
    raise AssertionError(name)


FUNCTIONAL = (
    "softmax",
    "layer_norm",
    "rms_norm",
    "rope",
    "gelu",
    "silu",
    "relu",
    "linear",
    "cross_entropy",
    "embedding",
    "dropout",
    "sdpa",
    "mea",
)


@settings(max_examples=260, deadline=None)
@given(
    name=st.sampled_from(FUNCTIONAL),
    seed=st.integers(0, 2**32 - 1),
    scale=st.sampled_from(SCALES),
    b=st.integers(1, 2),
    L=st.integers(2, 4),
    D=st.integers(2, 5),
    mode=st.sampled_from(["rev", "both"]),
)
def test_no_false_failures_of_functional_ops(name, seed, scale, b, L, D, mode):
    rng = np.random.default_rng(seed)
    target, args, kwargs = _functional_case(name, rng, scale, b, L, D)
    rep = gradcheck(target, *args, seed=seed % 1000, mode=mode, **kwargs)
    assert rep.ok, str(rep)


def _module_case(name, rng, s, b, L, D):
    x = rng.standard_normal((b, L, D)) * s
    r = int(rng.integers(1 << 30))
    if name == "Linear":
        return npattn.Linear(D, 3, rng=r), x
    if name == "LayerNorm":
        return npattn.LayerNorm(D), x
    if name == "RMSNorm":
        return npattn.RMSNorm(D), x
    if name == "FeedForward":
        act = str(rng.choice(["gelu", "gelu_tanh", "silu", "swiglu"]))
        return npattn.FeedForward(D, 2 * D, activation=act, dropout=0.2, rng=r), x
    if name == "Embedding":
        return npattn.Embedding(6, D, rng=r), rng.integers(0, 6, (b, L))
    if name == "Sequential":
        ln = npattn.LayerNorm(D)
        return npattn.Sequential(npattn.Linear(D, D, rng=r), ln, npattn.Linear(D, D, rng=r + 1), ln), x
    if name == "MultiHeadAttention":
        return npattn.MultiHeadAttention(D, 4, 2, causal=bool(rng.integers(2)), rng=r), x
    raise AssertionError(name)


MODULES = ("Linear", "LayerNorm", "RMSNorm", "FeedForward", "Embedding", "Sequential", "MultiHeadAttention")


@settings(max_examples=90, deadline=None)
@given(
    name=st.sampled_from(MODULES),
    seed=st.integers(0, 2**32 - 1),
    scale=st.sampled_from(SCALES),
    b=st.integers(1, 2),
    L=st.integers(2, 3),
    D=st.integers(2, 4),
    mode=st.sampled_from(["rev", "both"]),
)
def test_no_false_failures_of_modules(name, seed, scale, b, L, D, mode):
    rng = np.random.default_rng(seed)
    m, x = _module_case(name, rng, scale, b, L, D)
    rep = gradcheck(m, x, seed=seed % 1000, mode=mode, fast=name == "MultiHeadAttention")
    assert rep.ok, str(rep)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(("softmax", "layer_norm", "linear", "gelu", "silu", "rope", "sdpa")),
    seed=st.integers(0, 2**32 - 1),
    scale=st.sampled_from((0.3, 1.0, 3.0)),
    mode=st.sampled_from(["rev", "both"]),
)
def test_no_false_failures_of_the_float32_mode(name, seed, scale, mode):
    """Float32 against float64 (at moderate scales: an attention with scores of a few hundred is
    ill-conditioned enough that float32 legitimately loses more than the mode allows)."""
    rng = np.random.default_rng(seed)
    target, args, kwargs = _functional_case(name, rng, scale, 2, 3, 4)
    rep = gradcheck(target, *args, seed=seed % 1000, mode=mode, dtype=np.float32, **kwargs)
    assert rep.ok, str(rep)


# ----------------------------------------------------------------------------- planted bugs


def _off(grads, where, rng):
    """The first gradient with one element moved by 1e-3 of its largest magnitude."""
    tup = isinstance(grads, tuple)
    g = np.array(grads[0] if tup else grads, copy=True)
    flat = g.reshape(-1)
    i = int(np.argmax(np.abs(flat))) if where == "max" else int(rng.integers(flat.size))
    flat[i] += 1e-3 * np.abs(flat).max() * (1 if rng.random() < 0.5 else -1)
    return (g, *grads[1:]) if tup else g


def _scaled(grads):
    if isinstance(grads, tuple):
        return tuple(None if g is None else g * (1 + 1e-3) for g in grads)
    return grads * (1 + 1e-3)


def _planted(backward, bug, seed):
    """``backward`` with a bug, the same one at every call (as wrong code is)."""
    if bug == "scaled":
        return lambda dout, cache: _scaled(backward(dout, cache))
    return lambda dout, cache: _off(backward(dout, cache), bug, np.random.default_rng(seed))


def _bug_targets(rng, s):
    x = lambda *shape: rng.standard_normal(shape) * s  # noqa: E731
    return {
        "softmax": (F.softmax, F.softmax_backward, (x(3, 6),), {}),
        "layer_norm": (F.layer_norm, F.layer_norm_backward, (x(2, 3, 8), 1 + x(8) / s * 0.2, x(8)), {}),
        "attention": (  # keys at scale 1: scores of q * k at scale 100 would saturate the softmax,
            F.scaled_dot_product_attention,  # leaving gradients of 1e-26 that no difference resolves
            F.scaled_dot_product_attention_backward,
            (x(2, 3, 4), x(2, 4, 4) / s, x(2, 4, 3)),
            {"is_causal": True, "causal_align": "bottom_right"},
        ),
        "rope": (F.rope, F.rope_backward, (x(2, 3, 6),), {"positions": np.array([3, 4, 5])}),
    }


@pytest.mark.parametrize("bug", ["max", "anywhere", "scaled"])
@pytest.mark.parametrize("op", ["softmax", "layer_norm", "attention", "rope"])
@pytest.mark.parametrize("scale", [0.1, 1.0, 10.0])
def test_planted_bugs_in_functional_backwards_are_caught(op, bug, scale):
    for seed in range(3):
        forward, backward, args, kwargs = _bug_targets(np.random.default_rng(seed), scale)[op]
        assert gradcheck((forward, backward), *args, seed=seed, **kwargs).ok  # the right one passes
        rep = gradcheck((forward, _planted(backward, bug, seed)), *args, seed=seed, **kwargs)
        assert not rep.ok, f"{op} {bug} seed {seed}:\n{rep}"
        assert not rep.rows[0].ok  # the first gradient is wrong
        if bug != "scaled":  # ... and only it: the report points there
            assert rep.worst is rep.rows[0] and all(r.ok for r in rep.rows[1:])


def _planted_jvp(jvp, bug, seed):
    if bug == "scaled":
        return lambda cache, *t: jvp(cache, *t) * (1 + 1e-3)
    return lambda cache, *t: _off(jvp(cache, *t), bug, np.random.default_rng(seed))


@pytest.mark.parametrize("bug", ["max", "anywhere", "scaled"])
@pytest.mark.parametrize("op", ["softmax", "layer_norm", "attention", "rope"])
def test_planted_bugs_in_jvps_are_caught(op, bug):
    for scale in (0.1, 1.0, 10.0):
        forward, backward, args, kwargs = _bug_targets(np.random.default_rng(1), scale)[op]
        jvp = getattr(F, forward.__name__ + "_jvp")
        assert gradcheck((forward, backward, jvp), *args, mode="fwd", **kwargs).ok
        rep = gradcheck((forward, backward, _planted_jvp(jvp, bug, 1)), *args, mode="fwd", **kwargs)
        assert not rep.ok, f"{op} {bug} scale {scale}:\n{rep}"


class ScaledTanh(npattn.Module):
    """A user's module: ``y = a * tanh(x @ w)`` with its own backward (and an optional bug)."""

    def __init__(self, d_in, d_out, bug=None, rng=0):
        super().__init__()
        r = np.random.default_rng(rng)
        self.w = npattn.Parameter(r.standard_normal((d_in, d_out)) / np.sqrt(d_in))
        self.a = npattn.Parameter(r.uniform(0.5, 1.5, d_out))
        self.bug = bug

    def forward(self, x):
        t = np.tanh(x @ self.w.data)
        self.save_for_backward((x, t))
        return self.a.data * t

    def backward(self, dy):
        x, t = self.pop_saved()
        dt = dy * self.a.data
        dz = dt * (1 - t**2)
        dw = x.reshape(-1, x.shape[-1]).T @ dz.reshape(-1, dz.shape[-1])
        if self.bug == "scaled":
            dw = dw * (1 + 1e-3)
        elif self.bug is not None:
            dw = _off(dw, self.bug, np.random.default_rng(0))
        self.accumulate_grad(self.w, dw)
        self.accumulate_grad(self.a, np.sum(dy * t, axis=tuple(range(dy.ndim - 1))))
        return dz @ self.w.data.T


@pytest.mark.parametrize("bug", ["max", "anywhere", "scaled"])
@pytest.mark.parametrize("scale", [0.1, 1.0, 10.0])
def test_planted_bug_in_a_user_module_is_caught(bug, scale):
    x = np.random.default_rng(3).standard_normal((2, 3, 4)) * scale
    assert gradcheck(ScaledTanh(4, 5), x).ok
    rep = gradcheck(ScaledTanh(4, 5, bug=bug), x)
    assert rep.failed == ["w"], str(rep)
    assert rep.worst.name == "w" and len(rep.worst.at) == 2


# ----------------------------------------------------------------------------- the strategies


def _strategies():
    return pytest.importorskip("npattn.testing.strategies")


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_strategies_serve_both_modes(data):
    T = _strategies()
    scale = data.draw(T.scales())
    mode = data.draw(T.gradcheck_modes())
    assert 0.1 <= scale <= 10 and mode in ("rev", "fwd", "both")
    x = data.draw(T.arrays((2, 3, 4), scale=scale))
    w = data.draw(T.arrays((3, 4)))
    assert gradcheck(F.linear, x, w, mode=mode).ok
    # tangents: arrays of the input's shape or None (zero); forward mode is linear in them
    tx, tw = data.draw(T.tangents(x.shape)), data.draw(T.tangents(w.shape, allow_none=False))
    assert tw is not None and tw.shape == w.shape
    _, cache = F.linear(x, w)
    both = F.linear_jvp(cache, tx, tw)
    apart = F.linear_jvp(cache, tx, None) + F.linear_jvp(cache, None, tw)
    np.testing.assert_allclose(both, apart, rtol=1e-12, atol=1e-12)
