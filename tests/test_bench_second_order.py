"""The second-order section of ``npattn bench`` (``--second-order``): its cases compute what they
say (the MHA's Hessian-vector product against central differences of its gradient, ``loss_hvp``
against ``loss``, the memory-efficient core's backward and backward_jvp against the functional
calls), the section alone at tiny sizes, its table (no timed assertions)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
from _oracles import rel_err

import npattn
import npattn.functional as F
from npattn.tools import bench as B
from npattn.tools.bench import cli, second_order

TINY_MHA = dict(b=2, L=5, d=8, h=2)


def _mha_grads(m, x, t):
    m.zero_grad()
    y = m(x)
    m.backward(y - t)
    return {n: p.grad.copy() for n, p in m.named_parameters()}


def test_mha_case_is_the_hessian_vector_product_of_half_the_squared_error():
    built = B.KINDS["mha_hvp"].build(np.dtype(np.float64), None, **TINY_MHA)
    assert set(built.npattn) == {second_order.FIRST, second_order.SECOND} and built.torch == {}
    hvp = built.npattn[second_order.SECOND]()
    # the same module, inputs and direction, rebuilt: H v is the derivative of the gradient along v
    m = npattn.MultiHeadAttention(8, 8, 2, causal=True, rng=0, dtype=np.float64)
    rng = np.random.default_rng(0)
    x, t = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 5, 8))
    vrng = np.random.default_rng(2)
    v = {n: vrng.standard_normal(p.data.shape) for n, p in m.named_parameters()}
    assert set(hvp) == set(v)
    eps, moved = 1e-5, []
    for s in (eps, -eps):
        for n, p in m.named_parameters():
            p.data = p.data + s * v[n]
        moved.append(_mha_grads(m, x, t))
        for n, p in m.named_parameters():
            p.data = p.data - s * v[n]
    for n in v:
        fd = (moved[0][n] - moved[1][n]) / (2 * eps)
        assert np.abs(fd).max() > 1e-3, n
        assert rel_err(hvp[n], fd, floor=1e-300, relative_to="max_b") < 1e-6, n
    dx = built.npattn[second_order.FIRST]()  # the first order: forward + backward of the same loss
    m.zero_grad()
    np.testing.assert_array_equal(dx, m.backward(m(x) - t))
    assert B.KINDS["mha_hvp"].flops(**TINY_MHA) > 0


@pytest.mark.parametrize("model_type", second_order.FAMILY_TYPES)
def test_family_case_is_loss_hvp_against_loss_and_backward(model_type):
    params = dict(second_order.FAMILY_QUICK, model_type=model_type)
    built = B.KINDS["family_hvp"].build(np.dtype(np.float64), None, **params)
    loss = built.npattn[second_order.FIRST]()
    loss2, grads, hvp = built.npattn[second_order.SECOND]()
    assert loss == pytest.approx(loss2, rel=1e-14) and np.log(64) / 2 < loss < 2 * np.log(64)
    assert set(grads) == set(hvp) and all(np.isfinite(h).all() for h in hvp.values())
    assert sum(np.abs(h).sum() for h in hvp.values()) > 0
    assert built.shape["model_type"] == model_type and built.shape["parameters"] > 0


@pytest.mark.parametrize("order", [1, 2])
def test_memory_case_calls_the_core_backward_or_its_second_order(order):
    sizes = dict(b=1, h=2, L=9, E=4)
    built = B.KINDS["attention_order"].build(np.dtype(np.float64), None, **sizes, order=order)
    got = built.npattn["npattn"]()
    rng = np.random.default_rng(0)
    q, k, v, dout, tq, tk, tv, ddout = (rng.standard_normal((1, 2, 9, 4)) for _ in range(8))
    _, cache = F.memory_efficient_attention(q, k, v, is_causal=True)
    if order == 1:
        want = F.memory_efficient_attention_backward(dout, cache)
    else:
        want = F.memory_efficient_attention_backward_jvp(dout, cache, (tq, tk, tv), ddout)
        got, want = got[0] + got[1], want[0] + want[1]
    assert len(got) == len(want) == 3 * order
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(B.Missing):
        B.KINDS["attention_order"].build(np.dtype(np.float64), None, **sizes, order=order, impl="no_such_core")


def test_flag_and_the_section_alone(monkeypatch, capsys):
    section = next(s for s in cli.SECTIONS if s.name == "second-order")
    from npattn.__main__ import build_parser

    parsed = build_parser().parse_args(["bench", "--second-order"])
    assert parsed.second_order is True and cli.selected(parsed) == [section]
    for other in cli.SECTIONS:
        if other is not section:
            monkeypatch.setattr(other.module, "collect", lambda *a, **k: pytest.fail("another section ran"))
    monkeypatch.setattr(second_order, "MHA_QUICK", dict(b=1, L=4, d=8, h=2))
    monkeypatch.setattr(second_order, "FAMILY_QUICK", dict(second_order.FAMILY_QUICK, L=4))
    monkeypatch.setattr(second_order, "DTYPES", ("float64",))
    assert cli.main(SimpleNamespace(second_order=True, quick=True, json=True)) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert set(report) == {"machine", "second_order"} and "== second-order: " in err
    rows = report["second_order"]
    assert [r["kind"] for r in rows] == ["mha_hvp", "family_hvp", "family_hvp", "attention_order"]
    for r in rows[:3]:
        assert r["dtype"] == "float64" and r["goal"] == 3.0
        assert all(s > 0 for s in r["seconds"].values()) and r["ratio"] > 0
    mem = rows[-1]
    assert mem["goal"] == 2.0 and mem["backward"]["extra_mib"] >= 0 and mem["backward_jvp"]["seconds"] > 0
    text = B.format_table(report)
    assert "a Hessian-vector product against one forward + backward" in text
    assert "memory_efficient_attention b=1 h=2 L=64 E=16" in text and "backward_jvp" in text


def test_table_marks_errors_and_a_missed_goal():
    ok = {"kind": "mha_hvp", "name": "mha", "shape": {"batch": 1, "seq": 2, "d_model": 4, "heads": 1}}
    rows = [
        dict(ok, dtype="float32", seconds={second_order.FIRST: 0.01, second_order.SECOND: 0.05}, ratio=5.0, goal=3.0),
        {"error": "boom"},
        {
            "kind": "attention_order",
            "shape": {"batch": 1, "heads": 2, "seq": 8, "head_dim": 4},
            "ratio": None,
            "backward": {"error": "x"},
            "backward_jvp": {"missing": True},
        },
    ]
    lines = second_order.format_section({"second_order": rows})
    assert lines[-3].split()[-2:] == ["5.00", "NO"] and "error" in lines[-2]
    assert "{'error': 'x'}" in lines[-1] and "{'missing': True}" in lines[-1]
    assert second_order.format_section({}) == []
