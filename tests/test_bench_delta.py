"""The delta-rule section of ``npattn bench`` (``--delta``): its case for each rule (the gated delta
rule, Kimi Delta Attention), its tables, the section alone."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from npattn.tools import bench as B
from npattn.tools.bench import cli, delta

RULES = ("gated_delta_rule", "kimi_delta_attention")


@pytest.mark.parametrize("rule", RULES)
def test_case_sides_compute_the_same_delta_rule(rule):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    built = B.KINDS["delta_rule"].build(np.dtype(np.float64), torch, b=1, h=2, L=20, D=4, rule=rule, chunk_size=8)
    assert built.name == rule
    assert set(built.npattn) == {"chunked", "recurrence"} and set(built.torch) == {"torch"}
    diff = built.check()["max_rel_diff"]
    assert diff["chunked"] == 0.0 and diff["recurrence"] < 1e-12
    assert diff["torch"] < 1e-5  # transformers computes the delta rules in float32


@pytest.mark.parametrize("rule", RULES)
def test_case_without_torch_and_flops(rule):
    built = B.KINDS["delta_rule"].build(np.dtype(np.float64), None, b=1, h=2, L=9, D=3, rule=rule)
    assert built.torch == {} and built.npattn["chunked"]().shape == (1, 2, 9, 3)
    diff = built.check()["max_rel_diff"]
    assert set(diff) == {"chunked", "recurrence"} and diff["recurrence"] < 1e-12
    one = B.KINDS["delta_rule"].build(np.dtype(np.float32), None, b=1, h=1, L=9, D=3, rule=rule, impls=("chunked",))
    assert set(one.npattn) == {"chunked"}
    flops = B.KINDS["delta_rule"].flops
    assert flops(b=1, h=1, L=64, D=4, rule=rule) * 2 == flops(b=1, h=1, L=128, D=4, rule=rule) > 0  # linear in L


def test_the_rules_decay_differently():
    """KDA's case has a decay per key channel: its output is not the gated delta rule's on the same q, k, v."""
    outs = [
        B.KINDS["delta_rule"].build(np.dtype(np.float64), None, b=1, h=1, L=6, D=3, rule=rule).npattn["chunked"]()
        for rule in RULES
    ]
    assert np.abs(outs[0] - outs[1]).max() > 1e-3 * np.abs(outs[0]).max()


def test_section_runs_alone_and_prints_its_table(monkeypatch, capsys):
    for section in cli.SECTIONS:
        if section.name != "delta":
            monkeypatch.setattr(section.module, "collect", lambda *a, **k: pytest.fail("another section ran"))
    monkeypatch.setattr(delta, "QUICK_LENGTHS", (8,))
    assert cli.main(SimpleNamespace(delta=True, quick=True, json=True)) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert set(report) == {"machine", "delta"} and "== delta: " in err
    rows = report["delta"]
    assert [(r["rule"], r["seq"]) for r in rows] == [(rule, 8) for rule in RULES]
    for r in rows:
        assert {"chunked", "recurrence"} <= set(r["seconds"]) == set(r["ms_per_1k_steps"])
        assert r["ms_per_1k_steps"]["chunked"] == pytest.approx(1e6 * r["seconds"]["chunked"] / 8)
        assert r["max_rel_diff"]["recurrence"] < 1e-5  # float32
        if "torch" in r["seconds"]:
            assert r["max_rel_diff"]["torch"] < 1e-5
    text = B.format_table(report)
    assert "gated delta rule" in text and "Kimi Delta Attention" in text and "chunk_kimi_delta_attention" in text
    assert text.count("ms per 1000 steps") == 2
    kda_row = text.splitlines()[-1].split()  # L, chunked, recurrence, x, torch, x, rec. diff, torch diff
    assert kda_row[0] == "8" and float(kda_row[1]) == pytest.approx(rows[1]["ms_per_1k_steps"]["chunked"], abs=0.06)
    assert float(kda_row[6]) == pytest.approx(rows[1]["max_rel_diff"]["recurrence"], rel=0.06)


def test_table_marks_a_failed_row():
    lines = delta.format_delta([{"seq": 4, "error": "boom"}]).splitlines()
    assert "gated delta rule" in lines[0] and lines[-1].split()[:2] == ["4", "error"]
    lines = delta.format_delta([{"rule": "kimi_delta_attention", "seq": 4, "error": "boom"}]).splitlines()
    assert "Kimi Delta Attention" in lines[0] and lines[-1].split()[:2] == ["4", "error"]
    assert delta.format_section({}) == []
