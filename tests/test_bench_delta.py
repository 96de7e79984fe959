"""The delta-rule section of ``npattn bench`` (``--delta``): its case, its table, the section alone."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from npattn.tools import bench as B
from npattn.tools.bench import cli, delta


def test_case_sides_compute_the_same_delta_rule():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    built = B.KINDS["delta_rule"].build(np.dtype(np.float64), torch, b=1, h=2, L=20, D=4, chunk_size=8)
    assert set(built.npattn) == {"chunked", "recurrence"} and set(built.torch) == {"torch"}
    diff = built.check()["max_rel_diff"]
    assert diff["chunked"] == 0.0 and diff["recurrence"] < 1e-12
    assert diff["torch"] < 1e-5  # transformers computes the delta rule in float32


def test_case_without_torch_and_flops():
    built = B.KINDS["delta_rule"].build(np.dtype(np.float32), None, b=1, h=1, L=9, D=3, impls=("chunked",))
    assert built.torch == {} and built.npattn["chunked"]().shape == (1, 1, 9, 3)
    flops = B.KINDS["delta_rule"].flops
    assert flops(b=1, h=1, L=64, D=4) * 2 == flops(b=1, h=1, L=128, D=4) > 0  # linear in L


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
    assert [r["seq"] for r in rows] == [8]
    for r in rows:
        assert {"chunked", "recurrence"} <= set(r["seconds"]) and r["max_rel_diff"]["recurrence"] < 1e-5
    text = B.format_table(report)
    assert "gated delta rule" in text and "recurrence s" in text


def test_table_marks_a_failed_row():
    lines = delta.format_delta([{"seq": 4, "error": "boom"}]).splitlines()
    assert lines[-1].split()[:2] == ["4", "error"]
    assert delta.format_section({}) == []
