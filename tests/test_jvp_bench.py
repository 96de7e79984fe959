"""The bench's forward-mode rows: ``attention_jvp`` cases (the memory-efficient core's forward alone,
and forward + JVP) at tiny sizes: they run, compute what they say, and sit in the ``--long`` section."""

import numpy as np
import pytest

import npattn.functional as F
from npattn.tools.bench import timing
from npattn.tools.bench.cases import KINDS, Missing, attention_flops
from npattn.tools.bench.runner import fresh

SIZES = dict(b=1, h=2, L=40, E=8)


@pytest.mark.parametrize("jvp", [False, True])
def test_the_case_computes_the_forward_and_its_jvp(jvp):
    built = KINDS["attention_jvp"].build(np.dtype("float64"), None, **SIZES, jvp=jvp)
    assert built.name == ("mem_eff jvp" if jvp else "mem_eff fwd") and not built.torch
    out, tout = built.npattn["npattn"]()
    rng = np.random.default_rng(0)  # the case's inputs: q, k, v, then the tangents
    q, k, v, tq, tk, tv = (rng.standard_normal((1, 2, 40, 8)) for _ in range(6))
    want, cache = F.memory_efficient_attention(q, k, v, is_causal=True)
    np.testing.assert_array_equal(out, want)
    if jvp:
        np.testing.assert_allclose(tout, F.memory_efficient_attention_jvp(cache, tq, tk, tv), rtol=0, atol=1e-12)
    else:
        assert tout is None


def test_flops_and_table_rows():
    full = attention_flops(1, 2, 40, 40, 8, 8, True)
    assert KINDS["attention_jvp"].flops(**SIZES, jvp=True) == full
    assert KINDS["attention_jvp"].flops(**SIZES, jvp=False) == pytest.approx(full / 3)
    rows = [(kind, p) for kind, p in timing.LONG if kind == "attention_jvp"]
    assert [p.get("jvp", True) for _, p in rows] == [False, True]
    assert all(p["L"] == 4096 and p["impl"] == "memory_efficient_attention" for _, p in rows)


def test_a_core_without_a_jvp_is_missing():
    with pytest.raises(Missing):
        KINDS["attention_jvp"].build(np.dtype("float64"), None, **SIZES, impl="no_such_core")


def test_timed_row_and_fresh_memory():
    r = timing.row(
        "attention_jvp",
        dict(SIZES, impl="memory_efficient_attention"),
        "float32",
        use_torch=False,
        repeats=1,
        pause=0.0,
    )
    assert r["name"] == "mem_eff jvp" and r["npattn_s"] > 0 and r["torch_s"] is None
    m = fresh("attention_jvp", dict(SIZES, impl="memory_efficient_attention"))
    assert m["extra_mib"] >= 0 and m["seconds"] > 0
    assert fresh("attention_jvp", dict(SIZES, impl="memory_efficient_attention"), side="torch") == {"missing": True}
