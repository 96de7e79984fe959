"""``MultiHeadAttention.jvp``: forward mode of the attention module with its options.

Checked against central differences of the forward (inputs and parameters moved together),
against the backward by the transposition identity ``<u, J t> = <J^T u, t>`` (input and
parameter gradients), against ``torch.func.jvp`` of ``torch.nn.MultiheadAttention`` with the
same weights; the forward state survives ``jvp`` for a later ``backward``; bad tangents are
refused naming the argument; float32 stays float32.
"""

from __future__ import annotations

import numpy as np
import pytest
from _oracles import rel_err

from npattn.nn.attention import MultiHeadAttention

CONFIGS = {
    "plain": ({}, False),
    "gqa_qknorm_rope_sinks_causal_alibi_softcap": (
        dict(qkv_bias=True, num_kv_heads=2, qk_norm=True, rope=True, sinks=True, causal=True, alibi=True, softcap=5.0),
        False,
    ),
    "cross_bias_kv_zero_attn": (dict(qkv_bias=True, add_bias_kv=True, add_zero_attn=True, kdim=3, vdim=4), True),
    "gate_unit_offset_memory_efficient_window": (
        dict(
            output_gate=True,
            qk_norm=True,
            qk_norm_unit_offset=True,
            memory_efficient=True,
            sinks=True,
            window=(2, 1),
            num_kv_heads=2,
        ),
        False,
    ),
    "cross_gate_interleaved_rope": (dict(output_gate=True, kdim=3, vdim=5, rope=True, rope_interleaved=True), True),
    "causal_bottom_right_window_mem_eff": (
        dict(causal=True, causal_align="bottom_right", window=(1, -1), memory_efficient=True, alibi=True),
        True,
    ),
}


def _setup(name, dtype=np.float64, seed=0):
    kw, cross = CONFIGS[name]
    rng = np.random.default_rng(seed)
    m = MultiHeadAttention(6, 8, 4, rng=1, dtype=dtype, **kw)
    for p in m.parameters():  # away from the initial zeros/ones (sinks, unit-offset norms)
        p.data[...] += (0.1 * rng.standard_normal(p.data.shape)).astype(dtype)
    x = rng.standard_normal((2, 5, 6)).astype(dtype)
    ins = (x, rng.standard_normal((2, 6, m.kdim)).astype(dtype), rng.standard_normal((2, 6, m.vdim)).astype(dtype))
    ins = ins if cross else (x,)
    tins = [rng.standard_normal(a.shape).astype(dtype) for a in ins]
    tp = {n: rng.standard_normal(p.data.shape).astype(dtype) for n, p in m.named_parameters()}
    return m, ins, tins, tp


@pytest.mark.parametrize("name", list(CONFIGS))
def test_jvp_matches_central_differences(name):
    m, ins, tins, tp = _setup(name)
    m(*ins)
    t = m.jvp(*tins, param_tangents=tp)
    params = dict(m.named_parameters())
    base = {n: p.data.copy() for n, p in params.items()}
    eps = 1e-6

    def f(sign):
        for n, p in params.items():
            p.data[...] = base[n] + sign * eps * tp[n]
        with_t = [a + sign * eps * ta for a, ta in zip(ins, tins)]
        out = m(*with_t)
        m.clear_saved()
        return out

    num = (f(1) - f(-1)) / (2 * eps)
    for n, p in params.items():
        p.data[...] = base[n]
    assert rel_err(t, num, floor=1.0, relative_to="max_b") < 1e-6, name


@pytest.mark.parametrize("name", list(CONFIGS))
def test_transposition_identity_and_state_kept(name):
    m, ins, tins, tp = _setup(name, seed=1)
    y = m(*ins)
    t = m.jvp(*tins, param_tangents=tp)
    again = m.jvp(*tins, param_tangents=tp)  # the state is not consumed ...
    np.testing.assert_array_equal(t, again)
    u = np.random.default_rng(2).standard_normal(y.shape)
    m.zero_grad()
    grads = m.backward(u)  # ... so backward follows
    grads = grads if isinstance(grads, tuple) else (grads,)
    rhs = sum(float(np.sum(g * ti)) for g, ti in zip(grads, tins))
    rhs += sum(float(np.sum(p.grad * tp[n])) for n, p in m.named_parameters())
    lhs = float(np.sum(u * t))
    assert abs(lhs - rhs) <= 1e-10 * max(1.0, abs(lhs)), (name, lhs, rhs)


@pytest.mark.parametrize("name", ["plain", "cross_bias_kv_zero_attn"])
def test_tangents_left_out_are_zero(name):
    m, ins, tins, tp = _setup(name, seed=3)
    m(*ins)
    assert not np.any(m.jvp())
    only_x = m.jvp(tins[0])
    np.testing.assert_array_equal(only_x, m.jvp(tins[0], *[np.zeros_like(t) for t in tins[1:]], param_tangents={}))
    one_param = m.jvp(param_tangents={"out_proj.weight": tp["out_proj.weight"]})
    full = {n: np.zeros_like(t) for n, t in tp.items()}
    full["out_proj.weight"] = tp["out_proj.weight"]
    np.testing.assert_allclose(one_param, m.jvp(None, param_tangents=full), rtol=0, atol=1e-14)


def test_dropout_uses_the_forwards_mask():
    m, ins, tins, tp = _setup("plain", seed=4)
    m.dropout = 0.3
    y = m(*ins)
    t = m.jvp(*tins, param_tangents=tp)
    u = np.random.default_rng(5).standard_normal(y.shape)
    m.zero_grad()
    dx = m.backward(u)
    rhs = float(np.sum(dx * tins[0])) + sum(float(np.sum(p.grad * tp[n])) for n, p in m.named_parameters())
    assert abs(float(np.sum(u * t)) - rhs) <= 1e-10 * max(1.0, abs(rhs))


def test_float32_stays_float32():
    m, ins, tins, tp = _setup("gqa_qknorm_rope_sinks_causal_alibi_softcap", dtype=np.float32)
    m(*ins)
    t = m.jvp(*tins, param_tangents=tp)
    assert t.dtype == np.float32
    m64, ins64, tins64, tp64 = _setup("gqa_qknorm_rope_sinks_causal_alibi_softcap")
    m64(*ins64)
    assert rel_err(t, m64.jvp(*tins64, param_tangents=tp64), floor=1.0, relative_to="max_b") < 1e-4


def test_bad_tangents_are_refused():
    m, ins, tins, tp = _setup("cross_bias_kv_zero_attn")
    m(*ins)
    for i, name in enumerate(("tquery", "tkey", "tvalue")):
        bad = list(tins)
        bad[i] = np.zeros(tins[i].shape[1:])
        with pytest.raises(ValueError, match=name):
            m.jvp(*bad)
        bad[i] = np.ones(tins[i].shape, bool)
        with pytest.raises(TypeError, match=name):
            m.jvp(*bad)
    with pytest.raises(TypeError, match="at most 3 tangents"):
        m.jvp(*tins, tins[0])
    m_self, ins_self, tins_self, _ = _setup("plain")
    m_self(*ins_self)
    with pytest.raises(TypeError, match=r"at most 1 tangents \(tquery\)"):
        m_self.jvp(tins_self[0], tins_self[0])
    with pytest.raises(ValueError, match="unknown parameter"):
        m_self.jvp(param_tangents={"nope": np.zeros(1)})


def test_no_state_after_a_cached_call():
    m = MultiHeadAttention(6, 8, 4, causal=True, rng=0)
    m(np.ones((1, 3, 6)), use_cache=True)
    with pytest.raises(RuntimeError):
        m.jvp(np.ones((1, 3, 6)))


def test_matches_torch_func_jvp_of_torch_multihead_attention(torch_or_skip):
    torch = torch_or_skip
    torch.manual_seed(0)
    tm = torch.nn.MultiheadAttention(8, 2, bias=True, batch_first=True, dtype=torch.float64)
    sd = {k: v.detach().numpy() for k, v in tm.state_dict().items()}
    m = MultiHeadAttention.from_torch_state_dict(sd, num_heads=2)
    rng = np.random.default_rng(6)
    x, tx = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 5, 8))
    names = dict(tm.named_parameters())
    tps = {n: rng.standard_normal(tuple(p.shape)) for n, p in names.items()}

    def f(xt, *ps):
        params = dict(zip(names, ps))
        # need_weights: torch's explicit softmax path (its CPU flash kernel has no forward mode)
        out, _ = torch.func.functional_call(tm, params, (xt, xt, xt), {"need_weights": True})
        return out

    primals = (torch.tensor(x),) + tuple(p.detach() for p in names.values())
    tangents = (torch.tensor(tx),) + tuple(torch.tensor(tps[n]) for n in names)
    _, want = torch.func.jvp(f, primals, tangents)
    # torch's packed in_proj_weight/bias are npattn's W_query/W_key/W_value rows
    d = 8
    ours = {
        "W_query.weight": tps["in_proj_weight"][:d],
        "W_key.weight": tps["in_proj_weight"][d : 2 * d],
        "W_value.weight": tps["in_proj_weight"][2 * d :],
        "W_query.bias": tps["in_proj_bias"][:d],
        "W_key.bias": tps["in_proj_bias"][d : 2 * d],
        "W_value.bias": tps["in_proj_bias"][2 * d :],
        "out_proj.weight": tps["out_proj.weight"],
        "out_proj.bias": tps["out_proj.bias"],
    }
    m(x)
    assert rel_err(m.jvp(tx, param_tangents=ours), want.numpy(), floor=1.0, relative_to="max_b") < 1e-10
