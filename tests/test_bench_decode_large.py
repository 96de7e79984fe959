"""The large decoding section of ``npattn bench`` (``--decode-large``, issue 32 item 5) at tiny sizes:
its parts measure what they say (the checkpoint is the config's model in bfloat16, both npattn
sides and transformers decode the same model), the section runs alone, and its table computes the
fractions and the goals' verdicts from the rows (no timed assertions)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from npattn.models import CausalLM
from npattn.tools.bench import cli, decode_large
from npattn.tools.bench.cli import SECTIONS

SIZES = dict(decode_large.SIZES_QUICK)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("decode_large") / "model")
    written = decode_large.write_checkpoint(d, decode_large.QUICK)
    return d, written


def test_the_real_config_is_qwen3_06b():
    from npattn.models.causal_lm import _state_shapes
    from npattn.models.configs import config_from_hf

    cfg = config_from_hf(decode_large.QWEN3_06B)
    n = sum(int(np.prod(shape)) for _, shape in _state_shapes(cfg))
    assert 595e6 < n < 597e6  # 596M parameters, the tied head counted once


def test_checkpoint_is_the_model_in_bfloat16(checkpoint):
    d, written = checkpoint
    m = CausalLM.from_pretrained(d, weights_dtype="bfloat16")
    assert m.weights_dtype == "bfloat16" and written["parameters"] == m.num_parameters()
    assert json.load(open(f"{d}/config.json"))["dtype"] == "bfloat16"


def test_npattn_sides_decode_the_same_model(checkpoint):
    d, _ = checkpoint
    f32 = decode_large.npattn_side(d, None, **SIZES)
    bf16 = decode_large.npattn_side(d, "bfloat16", **SIZES)
    assert f32["impl"] == "npattn float32" and bf16["impl"] == "npattn bfloat16"
    assert bf16["model_bytes"] < 0.6 * f32["model_bytes"]
    assert f32["bytes_per_token"] == f32["model_bytes"]  # tied: the head reads the whole table
    assert all(r["tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0 for r in (f32, bf16))


def test_transformers_side(checkpoint):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    d, _ = checkpoint
    row = decode_large.transformers_side(d, **SIZES)
    f32 = decode_large.npattn_side(d, None, **SIZES)
    assert row["impl"] == "transformers float32" and row["bytes_per_token"] == f32["bytes_per_token"]


def test_paired_prefill_times_both_libraries_in_turns(checkpoint, monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from npattn.tools.bench import runner

    d, _ = checkpoint
    seen = {}
    timed = runner.time_interleaved

    def spy(fns, **kw):  # the turns see npattn in its child and transformers here, on the same prompt
        seen.update(names=sorted(fns), child=type(fns["npattn"]).__name__, repeats=kw["repeats"])
        return timed(fns, **kw)

    monkeypatch.setattr(runner, "time_interleaved", spy)
    r = decode_large.paired_prefill(d, SIZES["prefill"], 2)
    assert seen == {"names": ["npattn", "transformers"], "child": "_ChildFn", "repeats": 2}
    assert r["repeats"] == 2 and r["ratio"] > 0
    tps = r["tokens_per_s"]
    assert r["ratio"] == pytest.approx(tps["npattn"] / tps["transformers"])


def test_prefill_case_is_the_npattn_sides_prefill(checkpoint):
    d, _ = checkpoint
    built = decode_large.prefill_case(np.dtype("float32"), None, directory=d, tokens=5)
    assert built.torch == {} and list(built.npattn) == ["npattn"]
    m, forward = decode_large._npattn_model(d, None)
    ids = decode_large._prompt(5)
    np.testing.assert_array_equal(built.npattn["npattn"](), forward(ids, True))
    assert ids.shape == (1, 5)


def test_bandwidth_and_load_peak(checkpoint):
    d, _ = checkpoint
    bw = decode_large.bandwidth(256, 64, repeats=2)
    assert bw["gb_per_s"] > 0 and bw["column_gb_per_s"] > 0 and bw["bytes"] == 256 * 64 * 4
    load = decode_large.load_peak(d)
    m = CausalLM.from_pretrained(d, weights_dtype="bfloat16")
    assert load["model_bytes"] == sum(p.data.nbytes for p in m.parameters()) and load["peak_bytes"] >= 0


def _report(f32_tps=10.0, bf16_tps=8.0, hf_prefill=50.0, load_ratio=1.05):
    gb = 2e9

    def row(impl, tps, prefill, nbytes):
        return dict(
            impl=impl, tokens_per_s=tps, prefill_tokens_per_s=prefill, bytes_per_token=nbytes, model_bytes=nbytes
        )

    rows = [
        row("npattn float32", f32_tps, 100.0, gb),
        row("npattn bfloat16", bf16_tps, 90.0, gb / 2),
        row("transformers float32", 5.0, hf_prefill, gb),
    ]
    return {
        "decode_large": {
            "config": {"hidden_size": 1024, "num_hidden_layers": 28, "vocab_size": 151936},
            "sizes": decode_large.SIZES,
            "checkpoint": {"parameters": 596_000_000},
            "bandwidth": {"gb_per_s": 20.0, "bytes": 1, "threads": 2},
            "rows": rows,
            "load": {"ratio": load_ratio, "peak_bytes": 1, "model_bytes": 1},
            "goals": decode_large.GOALS,
        }
    }


def test_table_fractions_and_verdicts():
    text = "\n".join(decode_large.format_section(_report()))
    # limit 20 GB/s / 2 GB = 10 tokens/s: float32 at 1.00 of it; bfloat16's limit is 20
    assert "10.0" in text and "20.0" in text and " 1.00 " in text
    assert "float32 at 1.00 of the limit (>= 0.9: yes)" in text
    assert "bfloat16 storage at 0.80x float32's tokens/s (>= 0.7: yes)" in text
    assert "prefill at 2.00x transformers' (>= 1.0: yes)" in text
    assert "peaks at 1.05x the model's bytes (<= 1.1: yes)" in text
    bad = "\n".join(decode_large.format_section(_report(f32_tps=5.0, bf16_tps=2.0, hf_prefill=200.0, load_ratio=2.0)))
    assert bad.count(": NO)") == 4
    assert decode_large.format_section({}) == []


def test_prefill_goal_reads_the_turns_where_the_report_has_them():
    report = _report(hf_prefill=105.0)  # rows: 100 / 105 = 0.95x
    report["decode_large"]["paired_prefill"] = {"ratio": 1.03, "tokens_per_s": {}, "repeats": 5}
    text = "\n".join(decode_large.format_section(report))
    assert "prefill at 1.03x transformers' (>= 1.0: yes) in turns (5 each" in text
    assert "the rows' separate processes: 0.95x)" in text
    report["decode_large"]["paired_prefill"] = {"missing": "torch"}
    text = "\n".join(decode_large.format_section(report))
    assert "prefill at 0.95x transformers' (>= 1.0: NO)" in text and "in turns" not in text


def test_table_without_transformers():
    report = _report()
    report["decode_large"]["rows"][2] = {"impl": "transformers", "missing": "torch"}
    text = "\n".join(decode_large.format_section(report))
    assert "transformers: skipped (no torch)" in text and "prefill at -x transformers'" in text


def test_section_alone_quick(capsys, monkeypatch):
    assert "decode-large" in [s.name for s in SECTIONS]
    args = SimpleNamespace(decode_large=True, quick=True, json=True)
    assert cli.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    r = report["decode_large"]
    assert r["config"]["vocab_size"] == decode_large.QUICK["vocab_size"]
    assert [x.get("impl") for x in r["rows"][:2]] == ["npattn float32", "npattn bfloat16"]
    assert len(r["paired"]["ratios"]) == decode_large.PAIRED_QUICK["rounds"] and r["paired"]["ratio"] > 0
    pre = r["paired_prefill"]
    assert "missing" in pre or (pre["repeats"] == decode_large.PREFILL_TURNS_QUICK and pre["ratio"] > 0)
    assert r["load"]["model_bytes"] > 0 and r["bandwidth"]["gb_per_s"] > 0


def test_rows_carry_the_bandwidth_timed_around_their_steps(checkpoint):
    d, _ = checkpoint
    row = decode_large.npattn_side(d, None, **SIZES)
    assert row["gb_per_s"] > 0 and (row["cpu_wait"] is None or row["cpu_wait"] >= 0)
    gemv = decode_large._Gemv(64, 16)
    order = []
    forward = lambda ids, first: order.append(len(gemv.times)) or np.zeros((1, 8))  # noqa: E731
    times, _ = decode_large._steps(forward, 2, 5, gemv, calls=3)
    # three calls before the prompt (the warm-up dropped), none between the steps, three after
    assert len(times) == 5 and order == [3] * 6 and len(gemv.times) == len(gemv.column_times) == 6
    assert row["column_gb_per_s"] > 0 and gemv.w_column.flags.f_contiguous
    np.testing.assert_array_equal(gemv.w_column, gemv.w)


def test_each_row_limit_is_its_own_bandwidth():
    report = _report()
    rows = report["decode_large"]["rows"]
    rows[0]["gb_per_s"], rows[2]["gb_per_s"] = 40.0, 10.0  # the header's 20 GB/s measured alone
    text = "\n".join(decode_large.format_section(report))
    # float32: limit 40 GB/s / 2 GB = 20 tokens/s, 10 tokens/s is 0.50 of it; transformers: 5 of 5
    assert "float32 at 0.50 of the limit (>= 0.9: NO)" in text
    line = next(x for x in text.splitlines() if x.startswith("transformers float32"))
    assert " 10.0 " in line and " 1.00 " in line


def test_fraction_against_the_column_major_gemv_where_it_is_faster():
    report = _report()
    f32 = report["decode_large"]["rows"][0]
    f32["gb_per_s"], f32["column_gb_per_s"] = 20.0, 25.0  # 10 tokens/s of 2 GB: 1.00 and 0.80
    text = "\n".join(decode_large.format_section(report))
    assert "float32 at 1.00 of the limit (>= 0.9: yes; 0.80 against the column-major GEMV's 25.0 GB/s);" in text
    f32["column_gb_per_s"] = 19.0  # slower than the row-major limit: nothing to add
    text = "\n".join(decode_large.format_section(report))
    assert "float32 at 1.00 of the limit (>= 0.9: yes);" in text and "column-major GEMV" not in text


def test_paired_ratio_takes_turns(checkpoint, monkeypatch):
    from npattn.tools.bench import runner

    d, _ = checkpoint
    order = []
    turn = runner._Local.turn

    def spy(self, n, pause):
        order.append(n)
        return turn(self, n, pause)

    monkeypatch.setattr(runner._Local, "turn", spy)
    r = decode_large.paired_ratio(d, prompt=3, rounds=3, steps=2)
    assert order == [2] * 6 and r["rounds"] == 3 and len(r["ratios"]) == 3
    assert r["ratio"] == sorted(r["ratios"])[1] and all(x > 0 for x in r["ratios"])
    assert set(r["tokens_per_s"]) == {"float32", "bfloat16"} and all(v > 0 for v in r["tokens_per_s"].values())


def test_goal_reads_the_paired_ratio():
    report = _report()  # the rows: bfloat16 8 tokens/s against float32's 10
    report["decode_large"]["paired"] = {"ratio": 0.65, "ratios": [0.6, 0.65, 0.7], "rounds": 3, "steps": 3}
    text = "\n".join(decode_large.format_section(report))
    assert "bfloat16 storage at 0.65x float32's tokens/s (>= 0.7: NO) in turns in one process" in text
    assert "median of 3 rounds' ratios; the rows' separate processes: 0.80x" in text
    report["decode_large"]["paired"] = {"error": "MemoryError"}  # a failed paired step: the rows' ratio
    text = "\n".join(decode_large.format_section(report))
    assert "bfloat16 storage at 0.80x float32's tokens/s (>= 0.7: yes);" in text
