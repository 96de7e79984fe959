"""``npattn bench``'s windowed memory-efficient rows: measured in a subprocess, formatted."""
import npattn.tools.bench as B


def test_window_rows_measure_time_and_memory():
    rows = B.window_memory_efficient_rows((256, 512), window=(32, 0), b=1, h=2, E=16, repeats=1)
    assert [r["seq"] for r in rows] == [256, 512]
    for r in rows:
        assert "error" not in r, r
        assert r["seconds"] > 0 and r["extra_mib"] >= 0 and r["window"] == [32, 0]
    lines = B.format_window_memory_efficient(rows)
    assert "window=(32, 0)" in lines[1] and lines[-1].split()[0] == "512"


def test_window_rows_in_the_table_and_errors_reported():
    assert B.format_window_memory_efficient([]) == []
    row = {"impl": "memory_efficient_attention", "seq": 64, "window": [8, 0], "batch": 1, "heads": 1,
           "head_dim": 4, "error": "boom"}
    assert "error: boom" in B.format_window_memory_efficient([row])[-1]
    bad = B.window_memory_efficient_one(64, (-5, 0), b=1, h=1, E=4, repeats=1)  # refused by the op
    assert "window" in bad["error"]
