"""The bench's families section: rows for every open-model family, npattn alone and against
transformers (quick sizes), and the text report."""

import numpy as np
import pytest

from npattn.tools.bench import families
from npattn.tools.bench.cases import KINDS


def test_kinds_are_registered_and_configs_build():
    assert {"family_step", "family_decode"} <= set(KINDS)
    from npattn.models import CausalLM
    from npattn.models.tiny import TINY_CONFIGS

    for mt in families.FAMILIES:  # the tiny entries' names (nemotron_h_moe is a nemotron_h)
        cfg = families.family_config(mt, hidden=32, layers=4, vocab=64)
        m = CausalLM(cfg, rng=0)
        assert m.config.model_type == TINY_CONFIGS[mt]["model_type"]
        assert KINDS["family_step"].flops(model_type=mt, **families.FAMILY_QUICK) > 0
        assert KINDS["family_decode"].flops(model_type=mt, **families.FAMILY_QUICK) > 0


@pytest.mark.parametrize("mt", families.FAMILIES)
def test_npattn_rows_without_torch(mt):
    rows = families.bench_family(mt, np.float64, families.FAMILY_QUICK, use_torch=False, repeats=1)
    assert [(r["name"], r["impl"]) for r in rows] == [("family_step", "npattn"), ("family_decode", "npattn")]
    assert all(r["tokens_per_s"] > 0 and r["model_type"] == mt for r in rows)


@pytest.mark.parametrize("mt", families.FAMILIES)
def test_transformers_twins_match(mt):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    step = families.family_step(np.float32, torch, model_type=mt, **families.FAMILY_QUICK)
    assert step.check()["max_rel_diff_vs_torch"] < 1e-4
    assert set(step.torch) == {"transformers"}
    if mt in ("llama", "qwen3_next"):
        dec = families.family_decode(np.float32, torch, model_type=mt, **families.FAMILY_QUICK)
        assert dec.check() == {"same_tokens": True}


def test_report_text():
    rows = []
    for mt in families.FAMILIES[:2]:
        for r in families.bench_family(mt, np.float32, families.FAMILY_QUICK, use_torch=False, repeats=1):
            rows += [r, dict(r, impl="transformers", seconds=2 * r["seconds"], tokens_per_s=r["tokens_per_s"] / 2)]
    rows[0]["max_rel_diff_vs_torch"] = 1e-7
    text = "\n".join(families.format_section({"families": rows}))
    assert "llama" in text and "qwen3" in text and "2.00" in text and "1e-07" in text
    assert families.format_section({}) == []


def test_collect_runs_every_family(monkeypatch):
    seen = []

    def fake(mt, dtype, sizes, **kw):
        seen.append((mt, kw["own_process"]))
        return [{"name": "family_step", "model_type": mt, "impl": "npattn", "tokens_per_s": 1.0}]

    monkeypatch.setattr(families, "bench_family", fake)
    report = families.collect(quick=True, progress=False)
    assert [mt for mt, _ in seen] == list(families.FAMILIES) and not any(own for _, own in seen)
    assert len(report["families"]) == len(families.FAMILIES)
