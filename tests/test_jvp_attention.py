"""Forward mode of the two attention cores, in both tiers: ``scaled_dot_product_attention_jvp``
and ``memory_efficient_attention_jvp`` (tangents ``tq, tk, tv``, then ``tmask`` with
``mask_grad``, then ``tsinks`` with sinks).

Checked against ``torch.func.jvp`` of the dense formula (float64, 1e-10), central differences,
the other tier and the other core (1e-12), the backward by the transposition identity; bad
tangents are refused naming the argument; float32 stays float32; the memory-efficient JVP never
holds an ``(Lq, Lk)`` array.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from _oracles import attention_formula, rel_err
from hypothesis import given, settings

import npattn.functional as F
import npattn.functional.reference as R
from npattn.functional._random import keep_mask
from npattn.testing import attention_configs, dtypes

CORES = {
    "sdpa": (F.scaled_dot_product_attention, F.scaled_dot_product_attention_jvp),
    "sdpa_ref": (R.scaled_dot_product_attention, R.scaled_dot_product_attention_jvp),
    "me": (F.memory_efficient_attention, F.memory_efficient_attention_jvp),
    "me_ref": (R.memory_efficient_attention, R.memory_efficient_attention_jvp),
}
BACKWARD = {
    "sdpa": F.scaled_dot_product_attention_backward,
    "sdpa_ref": R.scaled_dot_product_attention_backward,
    "me": F.memory_efficient_attention_backward,
    "me_ref": R.memory_efficient_attention_backward,
}


def _kwargs(cfg, core, block_size=2):
    kw = cfg.kwargs()
    if core.startswith("me"):  # the memory-efficient signature: scale and block_size positional-or-keyword
        kw["block_size"] = block_size
    return kw


def _primals(cfg):
    """The differentiable inputs in tangent order: q, k, v, [mask with mask_grad], [sinks]."""
    ps = [cfg.q, cfg.k, cfg.v]
    if cfg.mask_grad:
        ps.append(cfg.attn_mask)
    if cfg.sinks is not None:
        ps.append(cfg.sinks)
    return ps


def _call(core, cfg, primals, **extra):
    """The forward with the primals substituted (mask and sinks included when they are primals)."""
    fwd = CORES[core][0]
    kw = {**_kwargs(cfg, core), **extra}
    q, k, v, *rest = primals
    if cfg.mask_grad:
        kw["attn_mask"] = rest.pop(0)
    if cfg.sinks is not None:
        kw["sinks"] = rest.pop(0)
    return fwd(q, k, v, **kw)


def _tangents(primals, rng, dtype=np.float64):
    ts = []
    for p in primals:
        t = rng.standard_normal(np.shape(p))
        ts.append(t.astype(dtype))
    return ts


def _jvp(core, cfg, tangents, **extra):
    _, cache = _call(core, cfg, _primals(cfg), **extra)
    return CORES[core][1](cache, *tangents)


# -- torch.func.jvp of the dense formula ------------------------------------------------------------


def _torch_jvp(torch, cfg, tangents, keep=None):
    primals = [torch.tensor(np.asarray(p, np.float64)) for p in _primals(cfg)]
    tans = [torch.tensor(np.asarray(t, np.float64)) for t in tangents]
    n_extra = int(cfg.mask_grad) + int(cfg.sinks is not None)

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

    assert len(primals) == 3 + n_extra
    _, t = torch.func.jvp(f, tuple(primals), tuple(tans))
    return t.numpy()


@settings(max_examples=40)
@given(attention_configs(options=True, dropout=True, max_len=5))
def test_jvp_matches_torch_func_jvp(cfg):
    torch = pytest.importorskip("torch")
    tangents = _tangents(_primals(cfg), np.random.default_rng(cfg.seed + 1))
    # the dense cores draw their dropout mask from rng; take the cache's own
    _, cache = _call("sdpa", cfg, _primals(cfg))
    want = _torch_jvp(torch, cfg, tangents, None if cache.keep is None else torch.tensor(cache.keep))
    for core in ("sdpa", "sdpa_ref"):
        assert rel_err(_jvp(core, cfg, tangents), want, floor=1.0, relative_to="max_b") < 1e-10, core
    # the memory-efficient cores regenerate their mask from one seed drawn from rng

    def me_keep(shape):
        seed = int(np.random.default_rng(cfg.seed).integers(0, 2**63 - 1, dtype=np.int64))
        return torch.tensor(keep_mask(seed, cfg.dropout_p, shape))

    want = _torch_jvp(torch, cfg, tangents, me_keep)
    for core in ("me", "me_ref"):
        assert rel_err(_jvp(core, cfg, tangents), want, floor=1.0, relative_to="max_b") < 1e-10, core


# -- central differences ----------------------------------------------------------------------------


@settings(max_examples=30)
@given(attention_configs(options=True, dropout=True, max_len=5))
def test_jvp_matches_central_differences(cfg):
    primals = _primals(cfg)
    tangents = _tangents(primals, np.random.default_rng(cfg.seed + 2))
    eps = 1e-6
    for core in ("sdpa", "me"):  # an int seed: the same dropout mask at every call

        def f(sign, core=core):
            moved = [p + sign * eps * t for p, t in zip(primals, tangents)]
            return _call(core, cfg, moved)[0]

        num = (f(1) - f(-1)) / (2 * eps)
        assert rel_err(_jvp(core, cfg, tangents), num, floor=1.0, relative_to="max_b") < 1e-6, core


# -- the tiers and the cores agree --------------------------------------------------------------------


@settings(max_examples=80)
@given(attention_configs(options=True, dropout=True, dtype=dtypes()))
def test_both_tiers_and_both_cores_equal(cfg):
    tangents = _tangents(_primals(cfg), np.random.default_rng(cfg.seed + 3), cfg.dtype)
    tol = 1e-12 if cfg.dtype == np.float64 else 1e-5
    got = {core: _jvp(core, cfg, tangents) for core in CORES}
    for core, t in got.items():
        assert t.dtype == cfg.dtype, core
    assert rel_err(got["sdpa"], got["sdpa_ref"], floor=1.0, relative_to="max_b") < tol
    assert rel_err(got["me"], got["me_ref"], floor=1.0, relative_to="max_b") < tol
    if cfg.dropout_p == 0.0:  # the two cores draw different dropout masks
        assert rel_err(got["me"], got["sdpa"], floor=1.0, relative_to="max_b") < tol


@settings(max_examples=25)
@given(attention_configs(options=True, dropout=True, min_len=5, max_len=9))
def test_memory_efficient_block_sizes_agree(cfg):
    tangents = _tangents(_primals(cfg), np.random.default_rng(cfg.seed + 4))
    ref = _jvp("me_ref", cfg, tangents)
    for bs in (1, 3, 64):
        _, cache = _call("me", cfg, _primals(cfg), block_size=bs)
        got = F.memory_efficient_attention_jvp(cache, *tangents)
        assert rel_err(got, ref, floor=1.0, relative_to="max_b") < 1e-12, bs


# -- forward and reverse modes are each other's transpose ---------------------------------------------


@settings(max_examples=40)
@given(attention_configs(options=True, dropout=True))
def test_transposition_identity(cfg):
    rng = np.random.default_rng(cfg.seed + 5)
    tangents = _tangents(_primals(cfg), rng)
    for core in CORES:
        out, cache = _call(core, cfg, _primals(cfg))
        u = rng.standard_normal(out.shape)
        lhs = float(np.sum(u * CORES[core][1](cache, *tangents)))
        grads = BACKWARD[core](u, cache)
        rhs = sum(float(np.sum(g * t)) for g, t in zip(grads, tangents))
        assert abs(lhs - rhs) <= 1e-11 * max(1.0, abs(lhs)), (core, lhs, rhs)


# -- tangents left out, zero tangents, one tangent at a time ------------------------------------------


@settings(max_examples=30)
@given(attention_configs(options=True, dropout=True))
def test_none_is_zero_and_the_tangent_is_linear(cfg):
    primals = _primals(cfg)
    tangents = _tangents(primals, np.random.default_rng(cfg.seed + 6))
    for core in CORES:
        _, cache = _call(core, cfg, primals)
        jvp = CORES[core][1]
        full = jvp(cache, *tangents)
        parts = []
        for i in range(len(tangents)):
            one = [None] * len(tangents)
            one[i] = tangents[i]
            parts.append(jvp(cache, *one[: i + 1]))  # trailing ones left out
        assert rel_err(sum(parts), full, floor=1.0, relative_to="max_b") < 1e-12, core
        zero = jvp(cache)
        assert zero.shape == full.shape and not np.any(zero), core
        np.testing.assert_array_equal(jvp(cache, *[np.zeros_like(t) for t in tangents]), zero)


def test_a_row_that_sees_no_key_has_tangent_zero():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 5, 3)), rng.standard_normal((2, 5, 2))
    mask = np.ones((4, 5), bool)
    mask[1] = False
    tq, tk, tv = (rng.standard_normal(a.shape) for a in (q, k, v))
    for core in CORES:
        fwd, jvp = CORES[core]
        _, cache = fwd(q, k, v, attn_mask=mask)
        t = jvp(cache, tq, tk, tv)
        assert np.all(t[:, 1] == 0.0) and np.all(np.isfinite(t)), core


# -- float32 --------------------------------------------------------------------------------------------


@settings(max_examples=30)
@given(attention_configs(options=True, dropout=True, dtype=np.float32))
def test_float32_stays_float32(cfg):
    t32 = _tangents(_primals(cfg), np.random.default_rng(cfg.seed + 7), np.float32)
    for core in ("sdpa", "me"):
        got = _jvp(core, cfg, t32)
        assert got.dtype == np.float32, core
        assert np.all(np.isfinite(got))


# -- bad tangents ---------------------------------------------------------------------------------------


def _full_config(core):
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((2, 4, 5, 3)), rng.standard_normal((2, 2, 6, 3)), rng.standard_normal((2, 2, 6, 2))
    mask, sinks = rng.standard_normal((4, 5, 6)), rng.standard_normal(4)
    fwd, jvp = CORES[core]
    _, cache = fwd(q, k, v, attn_mask=mask, enable_gqa=True, sinks=sinks, mask_grad=True)
    return cache, jvp, [q, k, v, mask, sinks]


@pytest.mark.parametrize("core", ["sdpa", "me"])
def test_bad_tangents_are_refused(core):
    cache, jvp, primals = _full_config(core)
    good = _tangents(primals, np.random.default_rng(2))
    for i, name in enumerate(("tq", "tk", "tv", "tmask", "tsinks")):
        for bad, kind in (
            (np.zeros(np.shape(good[i]) + (1,)), ValueError),  # a wrong shape
            (np.zeros(np.shape(good[i])[1:]), ValueError),  # a broadcastable one is not enough
            (np.ones(np.shape(good[i]), bool), TypeError),
            (good[i].astype(complex), TypeError),
            (np.array([["a"]]), TypeError),
        ):
            args = list(good)
            args[i] = bad
            with pytest.raises(kind, match=name):
                jvp(cache, *args)
    with pytest.raises(TypeError, match="at most 5 tangents"):
        jvp(cache, *good, good[0])
    with pytest.raises(TypeError, match="cache"):
        jvp(("not", "a", "cache"), *good)
    # without mask_grad and sinks, the fourth tangent is one too many
    fwd = CORES[core][0]
    _, plain = fwd(*primals[:3], enable_gqa=True)
    with pytest.raises(TypeError, match=r"at most 3 tangents \(tq, tk, tv\)"):
        jvp(plain, *good[:3], good[3])
    # integers are cast, as every array argument
    ints = [np.ones(np.shape(g), np.int64) for g in good]
    np.testing.assert_array_equal(jvp(cache, *ints), jvp(cache, *[np.ones(np.shape(g)) for g in good]))


def test_tangents_and_cache_are_not_modified():
    for core in CORES:
        cache, jvp, primals = _full_config(core)
        good = _tangents(primals, np.random.default_rng(3))
        copies = [t.copy() for t in good]
        before = [np.array(a, copy=True) if isinstance(a, np.ndarray) else a for a in cache]
        jvp(cache, *good)
        for t, c in zip(good, copies):
            np.testing.assert_array_equal(t, c)
        for a, b in zip(cache, before):
            if isinstance(a, np.ndarray):
                np.testing.assert_array_equal(a, b)


# -- memory ---------------------------------------------------------------------------------------------


def test_memory_efficient_jvp_never_holds_a_score_array():
    """numpy reports its allocations to tracemalloc: the JVP (every tangent, dropout and the
    options on) never allocates anything of the size of one (H, Lq, Lk) score array (L = 2048: the
    block buffers of up to 8 worker threads stay well below an eighth of it)."""
    rng = np.random.default_rng(7)
    h, L, E = 2, 2048, 16
    q, k, v, tq, tk, tv = (rng.standard_normal((h, L, E)) for _ in range(6))
    sinks, tsinks = rng.standard_normal(h), rng.standard_normal(h)
    score_bytes = h * L * L * 8
    out, cache = F.memory_efficient_attention(
        q, k, v, is_causal=True, block_size=64, dropout_p=0.1, rng=0, softcap=20.0, sinks=sinks
    )
    tracemalloc.start()
    try:
        t = F.memory_efficient_attention_jvp(cache, tq, tk, tv, tsinks)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert t.shape == out.shape
    io_bytes = 2 * q.nbytes  # the tangent and its transposed accumulators; block buffers are O(block^2)
    assert peak < io_bytes + score_bytes / 8, (peak, score_bytes)
