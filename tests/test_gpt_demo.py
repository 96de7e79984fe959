"""``npattn demo --task chars`` at a few steps, and the decode rows of ``npattn bench``
(well-formed, no timing assertions: the machine may be busy)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import npattn.tools.bench as B
from npattn.tools import demo_chars

ROOT = Path(__file__).resolve().parents[1]


def run(*args, timeout=600):
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "npattn", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_corpus_is_npattns_own_docstrings():
    text = demo_chars.corpus()
    assert len(text) > 20000
    import npattn.book

    assert npattn.book.__doc__.strip()[:60] in text
    assert text == demo_chars.corpus()  # deterministic
    tok = demo_chars.CharTokenizer(text)
    ids = tok.encode("GPTModel")
    assert tok.decode(ids) == "GPTModel" and ids.dtype == np.int64
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("\x00")


def test_train_chars_few_steps_learns_something():
    cfg = demo_chars.CharsConfig(
        steps=12,
        batch_size=8,
        context_length=16,
        emb_dim=16,
        n_heads=2,
        n_layers=1,
        lr=1e-2,
        warmup_steps=2,
        eval_batches=2,
        sample_chars=20,
        prompt="The ",
    )
    r = demo_chars.train_chars(cfg)
    assert r.losses.shape == (12,) and np.isfinite(r.losses).all()
    assert r.losses[-3:].mean() < r.losses[:3].mean()
    assert np.isfinite(r.val_loss) and r.val_loss < np.log(r.tokenizer.vocab_size) + 0.5
    assert r.sample.startswith("The ") and len(r.sample) == 24
    r2 = demo_chars.train_chars(cfg)
    np.testing.assert_array_equal(r.losses, r2.losses)  # the same seed, the same run
    assert r.sample == r2.sample


def test_cli_demo_chars(tmp_path):
    r = run("demo", "--task", "chars", "--steps", "3", "--out", str(tmp_path), "--seed", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "task chars" in out and "npattn.book.GPTModel" in out and "sample (temperature" in out
    assert (tmp_path / "loss_curve.png").stat().st_size > 1000
    last = out.strip().splitlines()
    assert last[-1].startswith("final loss: ") and float(last[-1].split()[2]) > 0
    assert any(line.startswith("time: ") for line in last)


def test_bench_decode_rows():
    rows = B.bench_decode(dict(B.DECODE_QUICK, context_length=12), np.float64, prompt_len=3, repeats=1, use_torch=False)
    assert [r["impl"] for r in rows] == ["npattn, KV cache", "npattn, no cache"]
    for r in rows:
        assert r["name"] == "decode" and r["dtype"] == "float64" and r["shape"]["new_tokens"] == 9
        assert r["tokens_per_s"] > 0 and r["seconds"] > 0 and r["same_tokens"]
    lines = B.format_decode(rows)
    assert "KV cache" in lines[2] and "tokens/s" in lines[1]


def test_bench_decode_against_torch():
    pytest.importorskip("torch")
    rows = B.bench_decode(dict(B.DECODE_QUICK, context_length=8, n_layers=1), np.float64, prompt_len=3, repeats=1)
    assert [r["impl"] for r in rows][-1] == "torch eager, no cache"
    assert all(r["same_tokens"] for r in rows)  # float64: torch's book model picks the same tokens
