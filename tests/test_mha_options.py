"""``MultiHeadAttention``'s attention options (window, causal_align, softcap, alibi, sinks, rope,
qk_norm) and torch's add_bias_kv/add_zero_attn: equality with an explicit formula written here in
plain numpy, finite differences (``npattn.gradcheck`` and the independent ``tests/_fd.py``) for
every option and combinations, in both attention cores."""

import itertools

import numpy as np
import pytest
from _fd import fd_gradients
from _oracles import rel_err

import npattn

H, HD = 4, 4
D = H * HD


# -- the explicit formula ---------------------------------------------------------------------------
def _rms(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.finfo(x.dtype).eps) * w


def _rope(x, pos, base):
    """Rotate-half RoPE: pairs (i, i + d/2) at angle pos * base**(-2i/d)."""
    d = x.shape[-1]
    theta = pos[:, None] * base ** (-2.0 * np.arange(d // 2) / d)
    c, s = np.cos(theta), np.sin(theta)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def reference(m, xq, xk=None, xv=None, attn_mask=None, key_padding_mask=None, past=0, align=None):
    """The module's output from its parameters, written as the formula (no kernel, no blocks)."""
    xk = xq if xk is None else xk
    xv = xq if xv is None else xv
    Hq, Hk, hd = m.num_heads, m.num_kv_heads, m.head_dim

    def proj(x, lin, heads):
        y = x @ lin.weight.data.T + (0 if lin.bias is None else lin.bias.data)
        return np.swapaxes(y.reshape(y.shape[:-1] + (heads, hd)), -2, -3)  # (..., heads, L, hd)

    q, k, v = proj(xq, m.W_query, Hq), proj(xk, m.W_key, Hk), proj(xv, m.W_value, Hk)
    lq, lk = q.shape[-2], k.shape[-2]
    if m.qk_norm:
        q, k = _rms(q, m.q_norm.weight.data), _rms(k, m.k_norm.weight.data)
    if m.rope:
        q = _rope(q, np.arange(past, past + lq), m.rope_base)
        k = _rope(k, np.arange(lk), m.rope_base)
    lead = q.shape[:-3]
    n_extra = 0
    if m.add_bias_kv:
        k = np.concatenate([k, np.broadcast_to(m.bias_k.data.reshape(Hk, 1, hd), lead + (Hk, 1, hd))], -2)
        v = np.concatenate([v, np.broadcast_to(m.bias_v.data.reshape(Hk, 1, hd), lead + (Hk, 1, hd))], -2)
        n_extra += 1
    if m.add_zero_attn:
        k = np.concatenate([k, np.zeros(lead + (Hk, 1, hd))], -2)
        v = np.concatenate([v, np.zeros(lead + (Hk, 1, hd))], -2)
        n_extra += 1
    k, v = np.repeat(k, Hq // Hk, axis=-3), np.repeat(v, Hq // Hk, axis=-3)
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(hd)
    if m.softcap is not None:
        s = m.softcap * np.tanh(s / m.softcap)
    align = align or m.causal_align
    p = np.arange(lq)[:, None] + (lk - lq if align == "bottom_right" else 0)
    j = np.arange(lk)[None, :]
    visible = np.ones((lq, lk), bool)
    if m.causal:
        visible &= j <= p
    if m.window is not None:
        left, right = m.window
        visible &= (j >= p - left) | (left == -1)
        visible &= (j <= p + right) | (right == -1)
    bias = np.zeros((Hq, lq, lk))
    if m.alibi:
        slopes = 2.0 ** (-8.0 * np.arange(1, Hq + 1) / Hq)
        bias = -slopes[:, None, None] * np.abs(p - j)
    vis = np.concatenate([np.broadcast_to(visible, (Hq, lq, lk)), np.ones((Hq, lq, n_extra), bool)], -1)
    add = np.concatenate([bias, np.zeros((Hq, lq, n_extra))], -1)
    s = s + add
    if attn_mask is not None:
        am = np.asarray(attn_mask)
        am = np.concatenate(
            [
                np.broadcast_to(am, am.shape[:-1] + (lk,)),
                np.full(am.shape[:-1] + (n_extra,), True if am.dtype == bool else 0.0),
            ],
            -1,
        )
        if am.dtype == bool:
            vis = vis & am
        else:
            s = s + am
    if key_padding_mask is not None:
        kp = np.concatenate([np.asarray(key_padding_mask), np.zeros(lead + (n_extra,), bool)], -1)
        vis = vis & ~kp[..., None, None, :]
    s = np.where(vis, s, -np.inf)
    if m.sinks is not None:
        s = np.concatenate([s, np.broadcast_to(m.sinks.data[:, None, None], s.shape[:-1] + (1,))], -1)
    mx = np.max(s, axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    e = np.exp(s - mx)
    tot = e.sum(-1, keepdims=True)
    P = e / np.where(tot == 0, 1.0, tot)
    if m.sinks is not None:
        P = P[..., :-1]
    ctx = P @ v
    ctx = np.swapaxes(ctx, -2, -3).reshape(ctx.shape[:-3] + (lq, Hq * hd))
    out = ctx @ m.out_proj.weight.data.T + (0 if m.out_proj.bias is None else m.out_proj.bias.data)
    return out, P


def randomise(m, seed):
    """Non-trivial values for the parameters that start at constants (sinks 0, norm weights 1)."""
    rng = np.random.default_rng(seed)
    for name, p in m.named_parameters():
        if name in ("sinks", "q_norm.weight", "k_norm.weight"):
            p.data[...] = rng.uniform(0.5, 1.5, p.data.shape) if "norm" in name else rng.normal(0, 1, p.data.shape)
            p.bump_version()
    return m


OPTIONS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (2, 1)},
    "causal_window": {"causal": True, "window": (2, 0)},
    "window_left_unbounded": {"window": (-1, 1)},
    "bottom_right": {"causal": True, "causal_align": "bottom_right"},
    "softcap": {"softcap": 0.7},
    "alibi": {"alibi": True},
    "alibi_causal": {"alibi": True, "causal": True},
    "sinks": {"sinks": True},
    "rope": {"rope": True},
    "rope_base": {"rope": True, "rope_base": 50.0},
    "qk_norm": {"qk_norm": True},
    "gqa": {"num_kv_heads": 2},
    "mqa_rope_qk_norm": {"num_kv_heads": 1, "rope": True, "qk_norm": True},
    "bias_kv": {"add_bias_kv": True},
    "zero_attn": {"add_zero_attn": True},
    "extras_causal_window_alibi": {
        "add_bias_kv": True,
        "add_zero_attn": True,
        "causal": True,
        "window": (1, 0),
        "alibi": True,
    },
    "everything": {
        "causal": True,
        "window": (3, 0),
        "softcap": 2.0,
        "alibi": True,
        "sinks": True,
        "rope": True,
        "qk_norm": True,
        "num_kv_heads": 2,
        "qkv_bias": True,
    },
    "everything_bottom_right_extras": {
        "causal": True,
        "causal_align": "bottom_right",
        "window": (2, 1),
        "softcap": 2.0,
        "alibi": True,
        "sinks": True,
        "rope": True,
        "qk_norm": True,
        "num_kv_heads": 2,
        "add_bias_kv": True,
        "add_zero_attn": True,
    },
}


def make(name, memory_efficient=False, seed=0, **extra):
    kw = dict(OPTIONS[name], **extra)
    m = npattn.MultiHeadAttention(D, D, H, memory_efficient=memory_efficient, rng=seed, **kw)
    return randomise(m, seed + 1)


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_options_equal_the_explicit_formula(name, memory_efficient):
    m = make(name, memory_efficient)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 6, D))
    np.testing.assert_allclose(m(x), reference(m, x)[0], rtol=0, atol=1e-12)
    # masks join the options: a bool attn_mask and key padding
    allowed = rng.random((6, 6)) < 0.7
    np.fill_diagonal(allowed, True)
    pad = np.zeros((2, 6), bool)
    pad[1, 0] = True
    got = m(x, attn_mask=allowed, key_padding_mask=pad)
    np.testing.assert_allclose(got, reference(m, x, attn_mask=allowed, key_padding_mask=pad)[0], rtol=0, atol=1e-12)
    fmask = rng.uniform(-1, 1, (H, 6, 6))
    np.testing.assert_allclose(m(x, attn_mask=fmask), reference(m, x, attn_mask=fmask)[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_options_returned_weights_equal_the_formula(name):
    m = make(name)
    x = np.random.default_rng(4).standard_normal((2, 5, D))
    out, w = m(x, need_weights=True)
    ref_out, ref_w = reference(m, x)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-12)
    np.testing.assert_allclose(w, ref_w, rtol=0, atol=1e-12)
    _, w_avg = m(x, need_weights=True, average_attn_weights=True)
    np.testing.assert_allclose(w_avg, ref_w.mean(axis=-3), rtol=0, atol=1e-12)


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_cross_attention_with_options_equals_the_formula(memory_efficient):
    m = make("everything_bottom_right_extras", memory_efficient, kdim=3, vdim=5)
    rng = np.random.default_rng(5)
    xq, xk, xv = rng.standard_normal((2, 3, D)), rng.standard_normal((2, 6, 3)), rng.standard_normal((2, 6, 5))
    np.testing.assert_allclose(m(xq, xk, xv), reference(m, xq, xk, xv)[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_options_gradcheck(name, memory_efficient):
    m = make(name, memory_efficient)
    x = np.random.default_rng(6).standard_normal((2, 4, D))
    report = npattn.gradcheck(m, x)
    assert report.ok, str(report)
    names = {row[0] for row in report.rows}
    for p, _ in m.named_parameters():
        assert p in names


def _fd_check(m, inputs, seed=0, **fwd):
    """The independent helper: inputs and the parameters that start at constants or are new."""
    params = [
        (n, p)
        for n, p in m.named_parameters()
        if n in ("sinks", "q_norm.weight", "k_norm.weight", "bias_k", "bias_v", "W_key.weight")
    ]
    out = m(*inputs, **fwd)
    g = np.random.default_rng(seed).standard_normal(out.shape)
    m.zero_grad()
    grads = m.backward(g)
    grads = grads if isinstance(grads, tuple) else (grads,)
    analytic = list(grads) + [p.grad.copy() for _, p in params]
    saved = [p.data.copy() for _, p in params]

    def f(*arrays):
        for (_, p), a in zip(params, arrays[len(inputs) :]):
            p.data[...] = a
        with npattn.no_grad():  # forwards whose backward never comes keep no state
            return np.sum(m(*arrays[: len(inputs)], **fwd) * g)

    numeric = fd_gradients(f, list(inputs) + saved)
    for (_, p), a in zip(params, saved):
        p.data[...] = a
    for i, (a, n) in enumerate(zip(analytic, numeric)):
        what = f"input {i}" if i < len(inputs) else params[i - len(inputs)][0]
        assert rel_err(a, n) < 1e-6, what


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize(
    "name", ["everything", "everything_bottom_right_extras", "sinks", "rope", "qk_norm", "extras_causal_window_alibi"]
)
def test_options_independent_finite_differences(name, memory_efficient):
    m = make(name, memory_efficient)
    _fd_check(m, (np.random.default_rng(7).standard_normal((2, 4, D)),))


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_cross_attention_options_independent_finite_differences(memory_efficient):
    m = make("everything_bottom_right_extras", memory_efficient, kdim=3, vdim=5)
    rng = np.random.default_rng(8)
    _fd_check(m, (rng.standard_normal((2, 3, D)), rng.standard_normal((2, 5, 3)), rng.standard_normal((2, 5, 5))))


def test_options_with_dropout_gradcheck():
    """Dropout with a fixed rng (gradcheck restores the generator before each call: the same mask)."""
    m = make("everything", dropout=0.3)
    report = npattn.gradcheck(m, np.random.default_rng(9).standard_normal((2, 4, D)))
    assert report.ok, str(report)


def test_unbatched_options_gradcheck_and_shapes():
    m = make("everything_bottom_right_extras")
    x = np.random.default_rng(10).standard_normal((5, D))
    out = m(x)
    assert out.shape == (5, D)
    np.testing.assert_allclose(out, reference(m, x)[0], rtol=0, atol=1e-12)
    assert m.backward(np.ones_like(out) * 0.5 + np.arange(out.size).reshape(out.shape) * 0.01).shape == x.shape
    assert npattn.gradcheck(m, x).ok


def test_state_dict_keys_per_contract():
    m = npattn.MultiHeadAttention(
        D, D, H, qkv_bias=True, num_kv_heads=2, add_bias_kv=True, sinks=True, qk_norm=True, rope=True, rng=0
    )
    sd = m.state_dict()
    kv = 2 * HD
    expect = {
        "bias_k": (1, 1, kv),
        "bias_v": (1, 1, kv),
        "sinks": (H,),
        "W_query.weight": (D, D),
        "W_query.bias": (D,),
        "W_key.weight": (kv, D),
        "W_key.bias": (kv,),
        "W_value.weight": (kv, D),
        "W_value.bias": (kv,),
        "out_proj.weight": (D, D),
        "out_proj.bias": (D,),
        "q_norm.weight": (HD,),
        "k_norm.weight": (HD,),
    }
    assert {k: v.shape for k, v in sd.items()} == expect
    np.testing.assert_array_equal(sd["sinks"], 0.0)
    np.testing.assert_array_equal(sd["q_norm.weight"], 1.0)
    m2 = npattn.MultiHeadAttention(
        D, D, H, qkv_bias=True, num_kv_heads=2, add_bias_kv=True, sinks=True, qk_norm=True, rope=True, rng=1
    )
    m2.load_state_dict(sd)
    x = np.random.default_rng(0).standard_normal((2, 3, D))
    np.testing.assert_array_equal(m2(x), m(x))


def test_same_seed_same_parameters_as_before_the_options():
    """The projections are drawn first, in the same order: adding options keeps their values."""
    a = npattn.MultiHeadAttention(D, D, H, rng=3)
    b = npattn.MultiHeadAttention(D, D, H, rng=3, add_bias_kv=True, sinks=True, qk_norm=True)
    for n, p in a.named_parameters():
        np.testing.assert_array_equal(p.data, dict(b.named_parameters())[n].data)


def test_alibi_slopes():
    m = npattn.MultiHeadAttention(8, 8, 8, alibi=True, rng=0)
    np.testing.assert_allclose(m.alibi_slopes(), [2.0 ** -(i + 1) for i in range(8)], rtol=0, atol=0)


@pytest.mark.parametrize(
    "a, b",
    list(itertools.combinations(["sinks", "rope", "qk_norm", "alibi", "softcap", "window", "bias_kv", "zero_attn"], 2)),
)
def test_pairs_of_options_gradcheck(a, b):
    kw = dict(OPTIONS[a], **OPTIONS[b])
    m = randomise(npattn.MultiHeadAttention(8, 8, 2, causal=True, rng=11, **kw), 12)
    x = np.random.default_rng(13).standard_normal((2, 3, 8))
    assert npattn.gradcheck(m, x).ok
    np.testing.assert_allclose(m(x), reference(m, x)[0], rtol=0, atol=1e-12)


def test_float32_stays_float32_with_every_option():
    m = make("everything_bottom_right_extras", dtype=np.float32)
    x = np.random.default_rng(0).standard_normal((2, 4, D)).astype(np.float32)
    out = m(x)
    assert out.dtype == np.float32
    dx = m.backward(np.ones_like(out))
    assert dx.dtype == np.float32
    assert all(p.grad.dtype == np.float32 for p in m.parameters())
    m64 = make("everything_bottom_right_extras")
    np.testing.assert_allclose(out, m64(x.astype(np.float64)), rtol=0, atol=1e-4)
