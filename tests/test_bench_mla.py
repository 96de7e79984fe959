"""``npattn bench --decode``'s multi-head latent attention rows (``latent.mla_decode``): every way of
decoding gives the absorbed run's outputs (torch's eager twin included), the rows carry the cache's
bytes per token, and the section prints them.  No timed assertions."""

import numpy as np
import pytest

from npattn.tools.bench import cases, decode, latent

TINY = dict(decode.MLA_DECODE_QUICK)


def test_registered_kind():
    built = cases.KINDS["mla_decode"].build(np.dtype(np.float64), None, cfg=TINY, prompt_len=2, new_tokens=1)
    assert built.name == "mla_decode"
    flops = cases.KINDS["mla_decode"].flops(cfg=TINY, prompt_len=4, new_tokens=12)
    assert flops > 0


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-12), (np.float32, 1e-5)])
@pytest.mark.parametrize("extra", [{}, {"q_lora_rank": None, "rope_interleave": False, "attention_bias": True}])
def test_every_run_decodes_alike(dtype, tol, extra):
    built = latent.mla_decode(np.dtype(dtype), None, cfg={**TINY, **extra}, prompt_len=3, new_tokens=5, batch=2)
    diffs = built.check()["max_rel_diff_vs_absorbed"]
    assert set(diffs) == {"npattn, absorbed latent cache", "npattn, latent cache expanded", "npattn, no cache"}
    assert max(diffs.values()) <= tol
    out = built.npattn["npattn, absorbed latent cache"]()
    assert out.shape == (2, 8, TINY["hidden_size"]) and out.dtype == dtype


def test_torch_twin_decodes_alike(torch_or_skip):
    for extra in ({}, {"q_lora_rank": None, "rope_interleave": False, "attention_bias": True}):
        cfg = {**TINY, **extra}
        built = latent.mla_decode(np.dtype(np.float64), torch_or_skip, cfg=cfg, prompt_len=3, new_tokens=4)
        assert built.check()["max_rel_diff_vs_absorbed"]["torch eager, latent cache expanded"] <= 1e-12


def test_rows_and_text():
    rows = decode.bench_mla_decode(TINY, np.float32, prompt_len=3, new_tokens=4, use_torch=False, repeats=1)
    assert {r["impl"] for r in rows} == {
        "npattn, absorbed latent cache",
        "npattn, latent cache expanded",
        "npattn, no cache",
    }
    r = TINY["kv_lora_rank"] + TINY["qk_rope_head_dim"]
    mha = TINY["num_heads"] * (TINY["qk_nope_head_dim"] + TINY["qk_rope_head_dim"] + TINY["v_head_dim"])
    for row in rows:
        assert row["name"] == "mla_decode" and row["tokens_per_s"] > 0 and row["max_rel_diff_vs_absorbed"] < 1e-5
        assert row["shape"]["cache_bytes_per_token"]["mla"] == 4 * r
        assert row["shape"]["cache_bytes_per_token"]["mha"] == 4 * mha
    text = "\n".join(decode.format_section({"decode": rows}))
    assert f"latent {r} numbers, MHA with the same heads {mha}" in text
    assert "npattn, absorbed latent cache" in text and "greedy decoding of npattn.book" not in text
