"""Second order of the two attention cores, in both tiers: ``scaled_dot_product_attention_backward_jvp``
and ``memory_efficient_attention_backward_jvp`` (``(grads, grad_tangents)`` for tangents ``tq, tk, tv``,
then ``tmask`` with ``mask_grad``, then ``tsinks`` with sinks, and ``ddout``).

``grads`` equal the backward's; ``grad_tangents`` against central differences of the backward along
``(tangents, ddout)``, the other tier (1e-12) and the other core, and ``torch.func.jvp`` of
``torch.func.vjp`` of the one torch oracle (``_oracles.attention_formula``, float64) with every
option; bad arguments are refused naming them; the memory-efficient second order never holds an
``(Lq, Lk)`` array.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from _oracles import attention_formula, rel_err
from hypothesis import given, settings

import npattn.functional as F
import npattn.functional.kernels as K
import npattn.functional.reference as R
from npattn.functional._random import keep_mask
from npattn.testing import attention_configs

CORES = {  # forward, backward, backward_jvp
    "sdpa": (F.scaled_dot_product_attention, F.scaled_dot_product_attention_backward),
    "sdpa_ref": (R.scaled_dot_product_attention, R.scaled_dot_product_attention_backward),
    "me": (F.memory_efficient_attention, F.memory_efficient_attention_backward),
    "me_ref": (R.memory_efficient_attention, R.memory_efficient_attention_backward),
}
SECOND = {
    "sdpa": F.scaled_dot_product_attention_backward_jvp,
    "sdpa_ref": R.scaled_dot_product_attention_backward_jvp,
    "me": F.memory_efficient_attention_backward_jvp,
    "me_ref": R.memory_efficient_attention_backward_jvp,
}


def _primals(cfg):
    """The differentiable inputs in tangent order: q, k, v, [mask with mask_grad], [sinks]."""
    ps = [cfg.q, cfg.k, cfg.v]
    if cfg.mask_grad:
        ps.append(cfg.attn_mask)
    if cfg.sinks is not None:
        ps.append(cfg.sinks)
    return ps


def _call(core, cfg, primals, block_size=2):
    """The forward with the primals substituted (an int seed: the same dropout mask at every call)."""
    kw = cfg.kwargs()
    if core.startswith("me"):
        kw["block_size"] = block_size
    q, k, v, *rest = primals
    if cfg.mask_grad:
        kw["attn_mask"] = rest.pop(0)
    if cfg.sinks is not None:
        kw["sinks"] = rest.pop(0)
    return CORES[core][0](q, k, v, **kw)


def _draws(cfg, seed):
    """Random tangents (each primal's shape, float64), an upstream gradient and its tangent."""
    rng = np.random.default_rng(seed)
    out_shape = _call("sdpa_ref", cfg, _primals(cfg))[0].shape
    tangents = [rng.standard_normal(np.shape(p)) for p in _primals(cfg)]
    return tangents, rng.standard_normal(out_shape), rng.standard_normal(out_shape)


def _second(core, cfg, tangents, dout, ddout, block_size=2):
    _, cache = _call(core, cfg, _primals(cfg), block_size)
    return SECOND[core](dout, cache, tuple(tangents), ddout)


# -- grads are the backward's; tangents against central differences of the backward ----------------


@settings(max_examples=40)
@given(attention_configs(options=True, dropout=True, max_len=5))
def test_grads_equal_the_backward_and_tangents_central_differences(cfg):
    tangents, dout, ddout = _draws(cfg, cfg.seed + 1)
    primals, eps = _primals(cfg), 1e-6
    for core in CORES:
        grads, tgrads = _second(core, cfg, tangents, dout, ddout)
        want = CORES[core][1](dout, _call(core, cfg, primals)[1])
        assert len(grads) == len(want) == len(tgrads) == len(primals), core
        for g, w, t, p in zip(grads, want, tgrads, primals):
            np.testing.assert_array_equal(g, w)
            assert t.shape == np.shape(p) and t.dtype == np.float64, core

        def moved(sign, core=core):
            inputs = [p + sign * eps * t for p, t in zip(primals, tangents)]
            return CORES[core][1](dout + sign * eps * ddout, _call(core, cfg, inputs)[1])

        for i, (plus, minus) in enumerate(zip(moved(1), moved(-1))):
            num = (plus - minus) / (2 * eps)
            assert rel_err(tgrads[i], num, floor=1.0, relative_to="max_b") < 1e-6, (core, i)


# -- the tiers and the cores agree ----------------------------------------------------------------


@settings(max_examples=80)
@given(attention_configs(options=True, dropout=True, max_len=6))
def test_fast_equals_textbook_and_the_cores_agree(cfg):
    tangents, dout, ddout = _draws(cfg, cfg.seed + 2)
    got = {core: _second(core, cfg, tangents, dout, ddout) for core in CORES}
    for fast, ref in (("sdpa", "sdpa_ref"), ("me", "me_ref")):
        for a, b in zip(got[fast][1], got[ref][1]):
            assert rel_err(a, b, floor=1.0, relative_to="max_b") < 1e-12, fast
    if cfg.dropout_p == 0.0:  # the two cores draw different dropout masks
        for a, b in zip(got["me"][1], got["sdpa"][1]):
            assert rel_err(a, b, floor=1.0, relative_to="max_b") < 1e-12


@settings(max_examples=25)
@given(attention_configs(options=True, dropout=True, min_len=5, max_len=9))
def test_memory_efficient_block_sizes_agree(cfg):
    tangents, dout, ddout = _draws(cfg, cfg.seed + 3)
    want = _second("me_ref", cfg, tangents, dout, ddout)[1]
    for bs in (1, 3, 64):
        for a, b in zip(_second("me", cfg, tangents, dout, ddout, block_size=bs)[1], want):
            assert rel_err(a, b, floor=1.0, relative_to="max_b") < 1e-12, bs


# -- torch.func.jvp of torch.func.vjp of the one oracle ---------------------------------------------


def _torch_second(torch, cfg, tangents, dout, ddout, keep):
    """``torch.func.jvp`` of ``torch.func.vjp`` of ``attention_formula``: the gradients' tangents."""
    primals = tuple(torch.tensor(np.asarray(p, np.float64)) for p in _primals(cfg))

    def f(q, k, v, *rest):
        rest = list(rest)
        mask = rest.pop(0) if cfg.mask_grad else cfg.attn_mask
        if mask is not None and not cfg.mask_grad and mask.dtype != bool:
            mask = torch.tensor(np.asarray(mask, np.float64))
        sinks = rest.pop(0) if cfg.sinks is not None else None
        return attention_formula(
            q,
            k,
            v,
            mask,
            sinks=sinks,
            is_causal=cfg.is_causal,
            scale=cfg.scale,
            dropout_p=cfg.dropout_p,
            keep=keep,
            enable_gqa=cfg.enable_gqa,
            causal_align=cfg.causal_align,
            window=cfg.window,
            alibi_slopes=cfg.alibi_slopes,
            softcap=cfg.softcap,
        )

    def grads(*args):
        *inputs, g = args
        _, vjp = torch.func.vjp(f, *inputs)
        return vjp(g)

    tans = tuple(torch.tensor(np.asarray(t, np.float64)) for t in tangents)
    _, tgrads = torch.func.jvp(grads, primals + (torch.tensor(dout),), tans + (torch.tensor(ddout),))
    return [t.numpy() for t in tgrads]


@settings(max_examples=40)
@given(attention_configs(options=True, dropout=True, max_len=5))
def test_matches_torch_func_jvp_of_vjp(cfg):
    torch = pytest.importorskip("torch")
    tangents, dout, ddout = _draws(cfg, cfg.seed + 4)
    _, cache = _call("sdpa", cfg, _primals(cfg))  # the plain cores' mask, drawn from rng
    want = _torch_second(torch, cfg, tangents, dout, ddout, None if cache.keep is None else torch.tensor(cache.keep))
    for core in ("sdpa", "sdpa_ref"):
        for i, (a, b) in enumerate(zip(_second(core, cfg, tangents, dout, ddout)[1], want)):
            assert rel_err(a, b, floor=1.0, relative_to="max_b") < 1e-10, (core, i)

    def me_keep(shape):  # the memory-efficient cores regenerate their mask from one seed drawn from rng
        seed = int(np.random.default_rng(cfg.seed).integers(0, 2**63 - 1, dtype=np.int64))
        return torch.tensor(keep_mask(seed, cfg.dropout_p, shape))

    want = _torch_second(torch, cfg, tangents, dout, ddout, me_keep)
    for core in ("me", "me_ref"):
        for i, (a, b) in enumerate(zip(_second(core, cfg, tangents, dout, ddout)[1], want)):
            assert rel_err(a, b, floor=1.0, relative_to="max_b") < 1e-10, (core, i)


# -- zero, left out, linear; the Hessian is symmetric ------------------------------------------------


@settings(max_examples=30)
@given(attention_configs(options=True, dropout=True))
def test_none_is_zero_linear_and_symmetric(cfg):
    tangents, dout, ddout = _draws(cfg, cfg.seed + 5)
    u = _draws(cfg, cfg.seed + 6)[0]
    for core in CORES:
        _, cache = _call(core, cfg, _primals(cfg))
        second = SECOND[core]
        full = second(dout, cache, tuple(tangents), ddout)[1]
        parts = [second(dout, cache, (), ddout)[1]]  # the backward of ddout alone
        for i in range(len(tangents)):
            one = [None] * i + [tangents[i]]  # trailing ones left out
            parts.append(second(dout, cache, one)[1])
        for j, whole in enumerate(full):
            assert rel_err(sum(p[j] for p in parts), whole, floor=1.0, relative_to="max_b") < 1e-12, core
        backward_of_ddout = CORES[core][1](ddout, cache)
        for a, b in zip(parts[0], backward_of_ddout):
            assert rel_err(a, b, floor=1.0, relative_to="max_b") < 1e-12, core
        for t in second(dout, cache, None)[1]:
            assert not np.any(t), core
        # H, the Hessian of <dout, out>, is symmetric: <u, H t> = <H u, t>
        hv = second(dout, cache, tuple(tangents))[1]
        hu = second(dout, cache, tuple(u))[1]
        lhs = sum(float(np.sum(a * b)) for a, b in zip(u, hv))
        rhs = sum(float(np.sum(a * b)) for a, b in zip(hu, tangents))
        assert abs(lhs - rhs) <= 1e-10 * max(1.0, abs(lhs)), (core, lhs, rhs)


def test_a_row_that_sees_no_key_gives_zero():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 5, 3)), rng.standard_normal((2, 5, 2))
    mask = np.ones((4, 5), bool)
    mask[1] = False
    tangents = [rng.standard_normal(a.shape) for a in (q, k, v)]
    dout, ddout = rng.standard_normal((2, 4, 2)), rng.standard_normal((2, 4, 2))
    for core in CORES:
        _, cache = CORES[core][0](q, k, v, attn_mask=mask)
        _, (tdq, tdk, tdv) = SECOND[core](dout, cache, tuple(tangents), ddout)
        assert np.all(tdq[:, 1] == 0.0) and all(np.isfinite(t).all() for t in (tdq, tdk, tdv)), core


def test_float32_stays_float32():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 5, 4)).astype(np.float32) for _ in range(3))
    sinks = rng.standard_normal(2).astype(np.float32)
    tangents = [rng.standard_normal(a.shape).astype(np.float32) for a in (q, k, v, sinks)]
    dout = rng.standard_normal((1, 2, 5, 4)).astype(np.float32)
    for core in ("sdpa", "me"):
        _, cache = CORES[core][0](q, k, v, is_causal=True, softcap=5.0, sinks=sinks)
        grads, tgrads = SECOND[core](dout, cache, tuple(tangents), dout)
        assert all(t.dtype == np.float32 and np.isfinite(t).all() for t in grads + tgrads), core


# -- bad arguments ---------------------------------------------------------------------------------


def _full_cache(core):
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((2, 4, 5, 3)), rng.standard_normal((2, 2, 6, 3)), rng.standard_normal((2, 2, 6, 2))
    mask, sinks = rng.standard_normal((4, 5, 6)), rng.standard_normal(4)
    out, cache = CORES[core][0](q, k, v, attn_mask=mask, enable_gqa=True, sinks=sinks, mask_grad=True)
    tangents = [rng.standard_normal(np.shape(a)) for a in (q, k, v, mask, sinks)]
    return cache, tangents, rng.standard_normal(out.shape), (q, k, v)


@pytest.mark.parametrize("core", ["sdpa", "me"])
def test_bad_arguments_are_refused_by_name(core):
    cache, good, dout, qkv = _full_cache(core)
    second = SECOND[core]
    for i, name in enumerate(("tq", "tk", "tv", "tmask", "tsinks")):
        for bad, kind in (
            (np.zeros(np.shape(good[i]) + (1,)), ValueError),
            (np.zeros(np.shape(good[i])[1:]), ValueError),  # broadcastable is not enough
            (np.ones(np.shape(good[i]), bool), TypeError),
            (good[i].astype(complex), TypeError),
        ):
            args = list(good)
            args[i] = bad
            with pytest.raises(kind, match=name):
                second(dout, cache, tuple(args))
    with pytest.raises(TypeError, match="at most 5 tangents"):
        second(dout, cache, tuple(good) + (good[0],))
    with pytest.raises(TypeError, match="tangents"):
        second(dout, cache, good[0])  # one array, not a tuple
    with pytest.raises(ValueError, match="dout"):
        second(dout[..., :1], cache, tuple(good))
    with pytest.raises(ValueError, match="ddout"):
        second(dout, cache, tuple(good), dout[..., :1])
    with pytest.raises(TypeError, match="cache"):
        second(dout, ("not", "a", "cache"), tuple(good))
    _, plain = CORES[core][0](*qkv, enable_gqa=True)
    with pytest.raises(TypeError, match=r"at most 3 tangents \(tq, tk, tv\)"):
        second(dout, plain, tuple(good[:4]))
    # lists and integer arrays are taken as the JVP takes them
    ints = [np.ones(np.shape(g), np.int64) for g in good]
    floats = second(dout, cache, [np.ones(np.shape(g)) for g in good])[1]
    for a, b in zip(second(dout, cache, ints)[1], floats):
        np.testing.assert_array_equal(a, b)


def test_arguments_and_cache_are_not_modified():
    for core in CORES:
        cache, good, dout, _ = _full_cache(core)
        copies = [t.copy() for t in good] + [dout.copy()]
        before = [np.array(a, copy=True) if isinstance(a, np.ndarray) else a for a in cache]
        SECOND[core](dout, cache, tuple(good), dout)
        for t, c in zip(good + [dout], copies):
            np.testing.assert_array_equal(t, c)
        for a, b in zip(cache, before):
            if isinstance(a, np.ndarray):
                np.testing.assert_array_equal(a, b)


# -- memory ----------------------------------------------------------------------------------------


def test_memory_efficient_second_order_never_holds_a_score_array():
    """numpy reports its allocations to tracemalloc: the second order (every tangent, ddout,
    dropout, softcap and sinks on) never allocates anything of the size of one (H, Lq, Lk) score
    array (L = 2048): its peak is the gradients, their tangents and O(L) rows, plus blocks."""
    rng = np.random.default_rng(7)
    h, L, E = 2, 2048, 16
    q, k, v, tq, tk, tv = (rng.standard_normal((h, L, E)) for _ in range(6))
    sinks, tsinks = rng.standard_normal(h), rng.standard_normal(h)
    score_bytes = h * L * L * 8
    out, cache = F.memory_efficient_attention(
        q, k, v, is_causal=True, block_size=64, dropout_p=0.1, rng=0, softcap=20.0, sinks=sinks
    )
    dout, ddout = rng.standard_normal(out.shape), rng.standard_normal(out.shape)
    tracemalloc.start()
    try:
        grads, tgrads = F.memory_efficient_attention_backward_jvp(dout, cache, (tq, tk, tv, tsinks), ddout)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert tgrads[0].shape == q.shape
    io_bytes = 16 * q.nbytes  # 8 gradients and tangents, O(L) rows (tO, tD, scale q, scale tq, dO, ddO)
    assert peak < io_bytes + score_bytes / 8, (peak, score_bytes)


def test_second_order_forms_the_backward_score_product_once(monkeypatch):
    """The fast second order takes the backward's own ``dP = dout v^T`` and ``D`` block by block
    (issue 31, item 7): 14 score-sized GEMMs a block with every tangent and ``ddout`` (the
    backward's 4: dv, dP, dq, dk; then ts 2, tdv 2, tdP 2, tdq 2, tdk 2), not 15; the result
    still the backward's, its central difference and the textbook tier's."""
    rng = np.random.default_rng(7)
    q, k, v, dy, ddy, tq, tk, tv = rng.standard_normal((8, 2, 3, 300, 8))
    _, cache = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    calls = []
    matmul = np.matmul

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return matmul(*args, **kwargs)

    monkeypatch.setattr(np, "matmul", counting)
    grads, tans = F.scaled_dot_product_attention_backward_jvp(dy, cache, (tq, tk, tv), ddy)
    monkeypatch.setattr(np, "matmul", matmul)
    assert len(cache.blocks) > 1 and len(calls) == 14 * len(cache.blocks)
    for a, b in zip(grads, F.scaled_dot_product_attention_backward(dy, cache)):
        assert np.array_equal(a, b)
    h = 1e-6

    def moved(s):
        _, c = F.scaled_dot_product_attention(q + s * tq, k + s * tk, v + s * tv, is_causal=True)
        return F.scaled_dot_product_attention_backward(dy + s * ddy, c)

    for t, plus, minus in zip(tans, moved(h), moved(-h)):
        assert rel_err(t, (plus - minus) / (2 * h), floor=1.0, relative_to="max_b") < 1e-6
    _, ref_cache = R.scaled_dot_product_attention(q, k, v, is_causal=True)
    for t, want in zip(tans, R.scaled_dot_product_attention_backward_jvp(dy, ref_cache, (tq, tk, tv), ddy)[1]):
        assert rel_err(t, want) < 1e-12


@settings(max_examples=40)
@given(attention_configs(options=True, dropout=True, max_len=6))
def test_second_order_takes_the_jvps_weight_tangents(cfg):
    """The fast core's JVP hands its weights' tangents ``(tP, mu)`` block by block to a second
    order along the same tangents (issue 31, item 7): the result is the one formed from scratch
    bit for bit (every option); blocks with softcap or dropout hand nothing over."""
    tangents, dout, ddout = _draws(cfg, cfg.seed + 4)
    _, cache = _call("sdpa", cfg, _primals(cfg))
    tq, tk, tv, *rest = tangents
    tmask = rest.pop(0) if cfg.mask_grad else None
    tsinks = rest.pop(0) if cfg.sinks is not None else None
    weights: list = []
    K.scaled_dot_product_attention_jvp(cache, tq, tk, tv, tmask, tsinks, weights=weights)
    assert len(weights) == len(cache.blocks)
    plain = cache.dcap is None and cache.keep is None
    assert all((w is not None) == plain for w in weights)
    want = K.scaled_dot_product_attention_backward_jvp(dout, cache, tuple(tangents), ddout)
    got = K.scaled_dot_product_attention_backward_jvp(dout, cache, tuple(tangents), ddout, weights_tangents=weights)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        np.testing.assert_array_equal(a, b)


def test_second_order_with_the_jvps_weight_tangents_forms_no_score_tangent(monkeypatch):
    """Given the JVP's ``(tP, mu)``, a block of the second order does 12 score-sized GEMMs, not 14
    (no ``ts = scale (k tq^T + tk q^T)``), and the result is the one formed from scratch bit for
    bit, which is the textbook tier's."""
    rng = np.random.default_rng(7)
    q, k, v, dy, ddy, tq, tk, tv = rng.standard_normal((8, 2, 3, 300, 8))
    _, cache = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    weights: list = []
    K.scaled_dot_product_attention_jvp(cache, tq, tk, tv, weights=weights)
    calls = []
    matmul = np.matmul
    monkeypatch.setattr(np, "matmul", lambda *a, **kw: calls.append(1) or matmul(*a, **kw))
    _, tans = K.scaled_dot_product_attention_backward_jvp(dy, cache, (tq, tk, tv), ddy, weights_tangents=weights)
    monkeypatch.setattr(np, "matmul", matmul)
    assert len(cache.blocks) > 1 and len(calls) == 12 * len(cache.blocks)
    for t, scratch in zip(tans, K.scaled_dot_product_attention_backward_jvp(dy, cache, (tq, tk, tv), ddy)[1]):
        np.testing.assert_array_equal(t, scratch)
    _, ref_cache = R.scaled_dot_product_attention(q, k, v, is_causal=True)
    for t, want in zip(tans, R.scaled_dot_product_attention_backward_jvp(dy, ref_cache, (tq, tk, tv), ddy)[1]):
        assert rel_err(t, want) < 1e-12


def test_second_order_writes_into_the_given_arrays():
    """``out`` and ``tout`` (views of one fused array, as ``MultiHeadAttention`` gives them) get
    the gradients and their tangents, the very arrays returned, equal bit for bit to those of a
    call without them; grouped-query heads (another layout) are copied into them."""
    rng = np.random.default_rng(9)
    for hk in (4, 2):
        q, dy, ddy, tq = rng.standard_normal((4, 2, 4, 300, 8))
        k, v, tk, tv = rng.standard_normal((4, 2, hk, 300, 8))
        _, cache = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hk != 4)
        want = K.scaled_dot_product_attention_backward_jvp(dy, cache, (tq, tk, tv), ddy)
        fused = np.full((2, 2, 300, 4 + 2 * hk, 8), np.nan)  # (..., L, heads, hd): the heads-last views
        heads = (slice(0, 4), slice(4, 4 + hk), slice(4 + hk, 4 + 2 * hk))
        out, tout = ([fused[i][..., h, :].swapaxes(-2, -3) for h in heads] for i in (0, 1))
        got = K.scaled_dot_product_attention_backward_jvp(dy, cache, (tq, tk, tv), ddy, out=out, tout=tout)
        assert all(a is b for a, b in zip(got[0] + got[1], out + tout))
        for a, b in zip(got[0] + got[1], want[0] + want[1]):
            np.testing.assert_array_equal(a, b)


def test_second_order_takes_its_scratch_from_a_workspace():
    """With a ``workspace`` the blocks' scratch (the backward's and the tangents' products) comes
    from it and goes back to it, so a second call makes no new one; the results are those of a
    call without one, bit for bit, call after call."""
    from npattn.functional._workspace import Workspace

    rng = np.random.default_rng(10)
    q, k, v, dy, ddy, tq, tk, tv = rng.standard_normal((8, 2, 3, 300, 8))
    _, cache = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    want = K.scaled_dot_product_attention_backward_jvp(dy, cache, (tq, tk, tv), ddy)
    ws = Workspace()
    held = []
    for _ in range(2):
        got = K.scaled_dot_product_attention_backward_jvp(dy, cache, (tq, tk, tv), ddy, workspace=ws)
        for a, b in zip(got[0] + got[1], want[0] + want[1]):
            np.testing.assert_array_equal(a, b)
        held.append(ws.nbytes())
    assert held[0] > 0 and held[1] == held[0]
