"""``npattn bench --window``: the windowed sweep runs and reports per-row cost (a smoke test; no timing claims)."""

import npattn.tools.bench as B
from npattn.__main__ import build_parser


def test_window_sweep_rows_and_table():
    rows = B.window_table((64, 128), window=(16, 0))
    assert [(r["impl"], r["seq"]) for r in rows] == [(i, L) for L in (64, 128) for i in B.MEMORY_IMPLS]
    sdpa = [r for r in rows if r["impl"] == "scaled_dot_product_attention"]
    for r in sdpa:
        assert "error" not in r and not r.get("missing"), r
        assert r["seconds"] > 0 and r["ms_per_1k_rows"] > 0 and r["extra_mib"] >= 0
    for r in rows:  # the memory-efficient core: measured, or missing until it has the window option
        assert "error" not in r, r
    text = B.format_window(rows, (16, 0))
    assert "window=(16, 0)" in text and "ms/1k rows" in text and len(text.splitlines()) == 4 and "best of 2" in text


def test_bench_window_flag():
    assert build_parser().parse_args(["bench", "--window", "--quick"]).window is True
    assert build_parser().parse_args(["bench"]).window is False
