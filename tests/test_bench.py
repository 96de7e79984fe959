"""``npattn bench``: well-formed results at tiny sizes (no timed assertions), each section alone, progress
with an estimate, aligned columns, the ``--json`` output, and the exactness of the performance
machinery the benchmark exercises (blocked causal attention, the backward's ``out=`` buffers), at
block heights small enough that tiny inputs span many blocks."""

import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import npattn
import npattn.functional as F
import npattn.functional.attention as A
import npattn.functional.kernels as K
import npattn.tools.bench as B
from npattn.__main__ import build_parser
from npattn.tools.bench import cli, decode, machine, memory, runner, text, timing, window

ROOT = Path(__file__).resolve().parents[1]
RESULT_KEYS = {
    "name",
    "shape",
    "dtype",
    "npattn_s",
    "torch_s",
    "ratio",
    "gflop",
    "npattn_gflops",
    "torch_gflops",
    "gemm_peak_gflops",
    "fraction_of_gemm_peak",
}


def _has_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


_NEEDS_TORCH = pytest.mark.skipif(not _has_torch(), reason="no torch")
_TORCH_OR_NOT = [False, pytest.param(True, marks=_NEEDS_TORCH)]


def _positive(x):
    return isinstance(x, float) and np.isfinite(x) and x > 0


def _args(**flags):
    """What ``npattn bench`` parses from ``flags`` (e.g. ``window=True``)."""
    argv = ["bench"] + [f"--{name}" for name, on in flags.items() if on]
    return build_parser().parse_args(argv)


# -- the runner ------------------------------------------------------------------------------------------
def test_time_interleaved_gives_a_median_per_callable():
    calls = []
    times = B.time_interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, warmup=1, repeats=3, pause=0
    )
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    # warm-up, then 3 turns each: a batch of consecutive calls (one untimed first), interleaved
    n = runner._MAX_BATCH + 1
    assert calls == ["a", "b"] + (["a"] * n + ["b"] * n) * 3


def test_time_interleaved_runs_long_calls_one_per_turn():
    calls = []

    def slow(name):
        def fn():
            calls.append(name)
            time.sleep(0.02)

        return fn

    times = B.time_interleaved({"a": slow("a"), "b": slow("b")}, warmup=1, repeats=2, pause=0, batch_seconds=0.01)
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 2  # an untimed call, then one timed call
    assert all(0.015 < t < 1.0 for t in times.values())


def test_run_steps_shows_progress_with_an_estimate(capsys):
    done = []
    steps = [runner.Step(f"step {i}", 2.0, lambda i=i: done.append(i) or i) for i in range(3)]
    assert runner.run_steps("demo section", steps, note=lambda r: f"result {r}") == [0, 1, 2]
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "== demo section: 3 steps, about 6 s (a guess)"
    assert err[1] == "[1/3] step 0 ... ~6 s left"  # before any step: the guesses
    # later estimates scale the guesses left by measured/guessed so far (the steps are instant here)
    assert err[3].startswith("[2/3] step 1 ... ~") and err[3].endswith(" left") and err[2] == "    result 0"
    assert err[-1].startswith("== demo section: done in ")
    assert done == [0, 1, 2]
    runner.run_steps("quiet", steps, progress=False)
    assert capsys.readouterr().err == ""


def test_duration_reads_in_seconds_then_minutes():
    assert runner._duration(42.4) == "42 s" and runner._duration(150) == "2.5 min"


def test_gemm_peak_is_a_rate():
    assert _positive(B.gemm_peak(np.float32, n=64, repeats=2))


def test_flop_counts():
    # causal attention counts the L(L+1)/2 visible pairs; 2 GEMMs forward, 4 backward, 2 FLOPs per MAC
    assert B.attention_flops(1, 1, 4, 4, 8, 8, causal=True) == 3 * 2 * 10 * 16
    assert B.attention_flops(2, 3, 4, 5, 8, 6, causal=False) == 3 * 2 * 2 * 3 * 20 * 14
    # MHA: q/k/v and output projections (8 N d^2 forward) plus attention, backward twice the forward
    b, L, d, h = 2, 4, 8, 2
    assert B.mha_flops(b, L, d, h, True) == 3 * 8 * b * L * d * d + B.attention_flops(b, h, L, L, 4, 4, True)
    # a window counts (roughly) its band: linear in L
    band = B.KINDS["attention"].flops
    assert band(b=1, h=1, L=64, E=4, window=[8, 0]) * 2 == band(b=1, h=1, L=128, E=4, window=[8, 0])


# -- the timing section ----------------------------------------------------------------------------------
@pytest.mark.parametrize("use_torch", _TORCH_OR_NOT)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cases_are_well_formed(use_torch, dtype):
    kw = dict(use_torch=use_torch, peak=10.0, warmup=1, repeats=1, pause=0)
    results = [
        B.row("attention", dict(b=2, h=2, L=8, E=4), dtype, **kw),
        B.row("attention", dict(b=2, h=2, L=8, E=4, impl="memory_efficient_attention"), dtype, **kw),
        B.row("mha", dict(b=2, L=8, d=8, h=2), dtype, **kw),
        B.row("encoder", dict(b=2, L=8, d=8, h=2), dtype, **kw),
    ]
    assert [r["name"] for r in results] == ["sdpa", "mem_eff", "mha", "encoder"]
    for r in results:
        assert RESULT_KEYS <= set(r)
        assert r["dtype"] == np.dtype(dtype).name
        assert _positive(r["npattn_s"]) and _positive(r["gflop"]) and _positive(r["npattn_gflops"])
        assert _positive(r["fraction_of_gemm_peak"])
        if use_torch:
            assert _positive(r["torch_s"]) and _positive(r["ratio"]) and _positive(r["torch_gflops"])
            # the same computation: outputs and input gradients agree with torch's
            assert r["max_rel_diff_vs_torch"] < (1e-3 if dtype == np.float32 else 1e-10)
        else:
            assert r["torch_s"] is None and r["ratio"] is None
    json.dumps(results)  # JSON-able


@pytest.mark.parametrize("use_torch", _TORCH_OR_NOT)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_demo_row_is_a_training_step_equal_to_torch(use_torch, dtype):
    sizes = dict(timing.QUICK)["demo"]
    r = B.row("demo", sizes, dtype, use_torch=use_torch, peak=10.0, warmup=1, repeats=1, pause=0)
    assert RESULT_KEYS <= set(r) and r["name"] == "demo" and r["dtype"] == np.dtype(dtype).name
    assert _positive(r["npattn_s"]) and _positive(r["gflop"])
    assert r["shape"]["layers"] == sizes["layers"] and r["shape"]["vocab"] == 11
    if use_torch:  # loss, head and token-embedding gradients agree with torch's equivalent model
        assert _positive(r["ratio"]) and r["max_rel_diff_vs_torch"] < (1e-4 if dtype == np.float32 else 1e-10)
    json.dumps(r)


def test_demo_case_defaults_to_the_demos_own_model():
    from npattn.tools.demo import DemoConfig

    cfg = DemoConfig()
    built = B.KINDS["demo"].build(np.dtype("float32"), None)
    assert built.shape == {
        "batch": cfg.batch_size,
        "seq": 2 * cfg.n_digits,
        "d_model": cfg.d_model,
        "heads": cfg.num_heads,
        "d_ff": cfg.d_ff,
        "layers": cfg.num_layers,
        "vocab": 11,
    }
    assert B.KINDS["demo"].flops() > B.KINDS["demo"].flops(b=1)


def _report(rows, **extra):
    part = {"gemm_peak_gflops": {"float32": 1.0, "float64": 0.5}, "gemm_n": 64, "repeats": 1, "results": rows}
    return dict(part, machine=B.machine_info(use_torch=False), **extra)


def test_timing_table_columns_are_aligned_with_and_without_torch():
    row = B.row("mha", dict(b=1, L=4, d=8, h=2), np.float32, use_torch=False, peak=1.0, repeats=1, pause=0)
    with_torch = dict(row, torch_s=row["npattn_s"] / 3, ratio=3.0, torch_gflops=123.4, max_rel_diff_vs_torch=1e-7)
    lines = timing.format_results(_report([row, with_torch]))[-3:]
    header = lines[0]
    for title in ("npattn ms", "torch ms", "ratio", "GFLOP/s", "%peak", "rel.diff"):
        end = header.index(title) + len(title)  # numbers are right-aligned under their title
        for line in lines[1:]:
            assert line[end - 1] != " " and (len(line) == end or line[end] == " "), (title, lines)
    assert " - " in lines[1] and "3.00" in lines[2]


def test_text_table_pads_every_column_to_its_widest_cell():
    lines = text.table([("name", "<"), ("n", ">")], [["a", "1"], ["longer", "12345"]])
    assert lines == ["name        n", "a           1", "longer  12345"]


def test_format_table_and_machine_info():
    report = _report(
        [B.row("mha", dict(b=1, L=4, d=8, h=2), np.float32, use_torch=False, peak=1.0, repeats=1, pause=0)],
        memory=[
            {"impl": "scaled_dot_product_attention", "seq": 8, "peak_mib": 2.0, "extra_mib": 1.0, "seconds": 0.1},
            {"impl": "memory_efficient_attention", "seq": 8, "missing": True},
            {"impl": "scaled_dot_product_attention", "seq": 16, "error": "boom"},
        ],
    )
    out = B.format_table(report)
    assert "mha" in out and "numpy" in out and "missing" in out and "error" in out and "torch not installed" in out
    json.dumps(report)


def test_machine_states_cpu_flags_and_blas():
    m = B.machine_info()
    assert isinstance(m["cpu_flags"], list) and set(m["cpu_flags"]) <= set(machine.SIMD_FLAGS)
    for blas in m["blas"] or []:
        assert {"internal_api", "version", "architecture", "num_threads"} <= set(blas)


def test_blas_info_without_threadpoolctl(monkeypatch):
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # import raises: OpenBLAS's own functions
    for blas in machine._blas_info() or []:
        assert blas["internal_api"] == "openblas" and isinstance(blas["num_threads"], int)


def test_variant_is_a_second_labelled_section():
    row = B.row("mha", dict(b=1, L=4, d=8, h=2), np.float32, use_torch=False, peak=1.0, repeats=1, pause=0)
    part = {"gemm_peak_gflops": {"float32": 1.0, "float64": 0.5}, "gemm_n": 64, "repeats": 1, "results": [row]}
    report = _report(
        [row],
        openblas_env_probe={
            "vars": {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": None},
            "gemm_peak_gflops": {"as_set": {"float32": 1.0, "float64": 1.0}, "unset": {"float32": 2.0, "float64": 2.0}},
            "unset": True,
        },
        variants=[dict(part, label="without OPENBLAS_CORETYPE=Haswell", unset=["OPENBLAS_CORETYPE"])],
    )
    out = B.format_table(report)
    own, variant = out.index("this machine's own settings"), out.index("VARIANT, not this machine's settings")
    assert own < variant and "OPENBLAS_CORETYPE=Haswell" in out[variant:] and "a variant section below" in out
    assert out.count("mha ") == 2


# -- memory and window: a fresh process each -------------------------------------------------------------
def test_torch_memory_row():
    pytest.importorskip("torch")
    r = B.memory_torch(64)
    assert r["impl"] == "torch" and r["seq"] == 64 and _positive(r["peak_mib"]) and r["extra_mib"] >= 0


def test_memory_rows():
    r = B.memory_one("scaled_dot_product_attention", 64)
    assert r["seq"] == 64 and _positive(r["peak_mib"]) and r["extra_mib"] >= 0 and r["seconds"] >= 0
    assert B.memory_one("no_such_attention", 64) == {"impl": "no_such_attention", "seq": 64, "missing": True}


def test_fresh_reports_a_failing_case_as_an_error():
    r = runner.fresh("attention", dict(b=1, h=1, L=4, E=4, causal="not a bool"))
    assert set(r) == {"error"} and r["error"]


def test_a_core_without_the_window_option_is_missing(monkeypatch):
    def no_window(q, k, v, **kw):
        if "window" in kw:
            raise TypeError("no_window() got an unexpected keyword argument 'window'")

    monkeypatch.setattr(F, "no_window", no_window, raising=False)
    monkeypatch.setattr(F, "no_window_backward", no_window, raising=False)
    with pytest.raises(B.Missing):
        B.KINDS["attention"].build(np.dtype("float32"), None, b=1, h=1, L=4, E=4, impl="no_window", window=[2, 0])
    assert runner._measure(
        "attention", dict(b=1, h=1, L=4, E=4, impl="no_window", window=[2, 0]), "float32", "npattn", 1
    ) == {"missing": True}


# -- each section alone ----------------------------------------------------------------------------------
def test_every_section_has_its_flag():
    for section in cli.SECTIONS:
        assert getattr(_args(**{section.name: True}), section.dest) is True
    assert cli.selected(_args()) == [cli.SECTIONS[0]]  # no flag: the timing table
    assert [s.name for s in cli.selected(_args(memory=True, window=True))] == ["memory", "window"]


def _refuse(*args, **kwargs):
    raise AssertionError("a section that was not asked for ran")


@pytest.mark.parametrize("name", ["memory", "window", "decode", "large", "long"])
def test_a_section_runs_alone(monkeypatch, capsys, name):
    for section in cli.SECTIONS:
        if section.name != name:
            monkeypatch.setattr(section.module, "collect", _refuse)
    monkeypatch.setattr(memory, "QUICK_LENGTHS", (32,))
    monkeypatch.setattr(window, "QUICK_LENGTHS", (32,))
    monkeypatch.setattr(decode, "DECODE_QUICK", dict(decode.DECODE_QUICK, context_length=8, n_layers=1))
    assert cli.main(SimpleNamespace(**{name: True, "quick": True, "json": True})) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert set(report) == {"machine", name}
    assert f"== {name}: " in err and "left" in err  # its progress, with an estimate
    assert B.format_table(report).count("\n") > 3


def test_quick_sections_print_aligned_tables(monkeypatch, capsys):
    monkeypatch.setattr(memory, "QUICK_LENGTHS", (32,))
    monkeypatch.setattr(window, "QUICK_LENGTHS", (32, 64))
    assert cli.main(SimpleNamespace(memory=True, window=True, quick=True, json=False)) == 0
    out = capsys.readouterr().out
    assert "peak memory of forward+backward" in out and "windowed attention" in out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:3] == ["L", "sdpa", "s"])
    rows = lines[at : at + 3]
    assert len({len(r) for r in rows}) == 1  # right-aligned numbers: equal widths


def test_cli_quick_json_parses():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(
        [sys.executable, "-m", "npattn", "bench", "--quick", "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert {"machine", "gemm_peak_gflops", "results"} <= set(report)
    assert report["openblas_env_probe"] is None  # --quick leaves the environment alone
    assert {r["name"] for r in report["results"]} == {"sdpa", "mha", "encoder", "demo"}
    assert report["variants"] == []  # no variant environment with --quick
    for r in report["results"]:
        assert RESULT_KEYS <= set(r) and _positive(r["npattn_s"])
        if r["torch_s"] is not None:
            assert _positive(r["ratio"])
    assert "[2/10] sdpa b=2 h=2 L=32 E=16 float32 ... ~" in proc.stderr  # progress on stderr


# -- exactness of the blocked causal attention -----------------------------------------------------------
def _reference(q, k, v, mask, causal, keep, p, scale, groups):
    """The textbook formulas on full (Lq, Lk) matrices, with repeated kv heads for GQA."""
    if groups > 1:
        k, v = np.repeat(k, groups, axis=-3), np.repeat(v, groups, axis=-3)
    s = (q @ k.swapaxes(-1, -2)) * scale
    lq, lk = s.shape[-2:]
    visible = np.ones(s.shape, bool)
    if causal:
        visible &= np.tri(lq, lk, dtype=bool)
    if mask is not None and mask.dtype == bool:
        visible &= mask
    elif mask is not None:
        s = s + mask
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    tot = e.sum(axis=-1, keepdims=True)
    w = e / np.where(tot == 0, 1.0, tot)
    drop = w if keep is None else w * keep / (1 - p)
    out = drop @ v

    def backward(dout):
        dv = drop.swapaxes(-1, -2) @ dout
        dp = dout @ v.swapaxes(-1, -2)
        if keep is not None:
            dp = dp * keep / (1 - p)
        ds = w * (dp - (dp * w).sum(axis=-1, keepdims=True))
        dq, dk = ds @ k * scale, ds.swapaxes(-1, -2) @ q * scale
        if groups > 1:
            sh = dk.shape
            dk = dk.reshape(sh[:-3] + (sh[-3] // groups, groups) + sh[-2:]).sum(axis=-3)
            dv = dv.reshape(sh[:-3] + (sh[-3] // groups, groups) + dv.shape[-2:]).sum(axis=-3)
        return dq, dk, dv

    return out, w, backward


CASES = [  # lead, Hq, Hk, Lq, Lk, E, Ev
    ((2,), 2, 2, 7, 7, 4, 3),
    ((), 3, 3, 9, 5, 4, 4),
    ((2,), 4, 2, 6, 11, 3, 5),
    ((1, 2), 6, 2, 8, 8, 4, 4),
    ((2,), 2, 2, 5, 0, 3, 3),
    ((2,), 2, 2, 0, 4, 3, 3),
    ((2,), 2, 2, 13, 13, 4, 4),
]


@pytest.mark.parametrize("height", [1, 2, 3, 5])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "dead"])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_blocked_causal_attention_equals_the_textbook_formulas(monkeypatch, height, case, mask_kind, p):
    monkeypatch.setattr(A, "_CAUSAL_BLOCK", height)
    lead, hq, hk, lq, lk, e, ev = case
    rng = np.random.default_rng(zlib.crc32(repr((height, case, mask_kind, p)).encode()))
    q, k, v = (rng.standard_normal(lead + s) for s in ((hq, lq, e), (hk, lk, e), (hk, lk, ev)))
    sshape = lead + (hq, lq, lk)
    mask = {
        "none": None,
        "bool": rng.random(sshape) > 0.3,
        "float": rng.standard_normal((lq, lk)),
        "dead": np.where(np.arange(lq)[:, None] < 2, False, rng.random((hq, lq, lk)) > 0.5),
    }[mask_kind]
    for causal in (False, True):
        out, cache = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, dropout_p=p, rng=3, enable_gqa=hq != hk
        )
        ref_out, ref_w, ref_backward = _reference(q, k, v, mask, causal, cache.keep, p, 1 / np.sqrt(e), hq // hk)
        np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(cache.weights, ref_w, rtol=1e-12, atol=1e-14)
        dout = rng.standard_normal(out.shape)
        for got, want in zip(F.scaled_dot_product_attention_backward(dout, cache), ref_backward(dout)):
            np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("groups", [1, 3])
def test_backward_writes_into_out_buffers(groups):
    rng = np.random.default_rng(0)
    b, hk, L, E = 2, 2, 9, 4
    hq = hk * groups
    fused = rng.standard_normal((b, L, (hq + 2 * hk) * E))

    def heads(a, h):
        return a.reshape(b, L, h, E).swapaxes(1, 2)

    q, k, v = (
        heads(fused[..., : hq * E], hq),
        heads(fused[..., hq * E : (hq + hk) * E], hk),
        heads(fused[..., (hq + hk) * E :], hk),
    )
    out, cache = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1)
    dout = rng.standard_normal(out.shape)
    want = F.scaled_dot_product_attention_backward(dout, cache)
    buf = np.full(fused.shape, np.nan)
    views = (
        heads(buf[..., : hq * E], hq),
        heads(buf[..., hq * E : (hq + hk) * E], hk),
        heads(buf[..., (hq + hk) * E :], hk),
    )
    got = K.scaled_dot_product_attention_backward(dout, cache, out=views)
    assert all(g is w for g, w in zip(got, views))
    for g, w in zip(views, want):
        np.testing.assert_array_equal(g, w)
    assert not np.isnan(buf).any()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mha_blocked_path_keeps_dtype_and_matches_small_blocks(monkeypatch, dtype):
    rng = np.random.default_rng(1)
    m = npattn.MultiHeadAttention(8, 8, 2, causal=True, rng=0, dtype=dtype)
    x = rng.standard_normal((2, 11, 8)).astype(dtype)
    dy = rng.standard_normal((2, 11, 8)).astype(dtype)
    y, w = m(x, need_weights=True)
    dx = m.backward(dy)
    grads = [p.grad.copy() for p in m.parameters()]
    monkeypatch.setattr(A, "_CAUSAL_BLOCK", 3)
    m.zero_grad()
    y3, w3 = m(x, need_weights=True)
    dx3 = m.backward(dy)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-14)
    for a, b_ in [(y, y3), (w, w3), (dx, dx3)] + list(zip(grads, (p.grad for p in m.parameters()))):
        assert a.dtype == b_.dtype == dtype
        np.testing.assert_allclose(a, b_, **tol)
    assert np.all(np.triu(w3[..., :, :], 1) == 0)  # causal weights: zero above the diagonal


def test_main_reports_the_own_environment_first_and_the_variant_second(monkeypatch, capsys):
    """The default numbers are this process's (its environment untouched); the faster environment
    without OPENBLAS_CORETYPE only adds a labelled variant, measured in a child process."""
    row = B.row("mha", dict(b=1, L=4, d=8, h=2), np.float32, use_torch=False, peak=1.0, repeats=1, pause=0)
    part = {"gemm_peak_gflops": {"float32": 1.0, "float64": 0.5}, "gemm_n": 64, "repeats": 1, "results": [row]}
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    monkeypatch.delenv("NPATTN_BENCH_KEEP_ENV", raising=False)
    monkeypatch.setattr(timing, "collect", lambda **kw: json.loads(json.dumps(part)))
    monkeypatch.setattr(
        cli,
        "probe_openblas_env",
        lambda progress=None: {
            "vars": {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": None},
            "gemm_peak_gflops": {"as_set": {"float32": 1.0, "float64": 1.0}, "unset": {"float32": 2.0, "float64": 2.0}},
            "unset": True,
        },
    )
    calls = []

    def fake_call(function, kwargs=None, *, unset=(), show_stderr=False):
        calls.append((function, unset))
        return json.loads(json.dumps(part))

    monkeypatch.setattr(cli, "call_in_child", fake_call)
    args = SimpleNamespace(quick=False, json=True)
    assert B.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert calls == [("cli:timing_variant", machine.SLOW_ENV)]  # only the variant child drops them
    assert os.environ["OPENBLAS_CORETYPE"] == "Haswell"  # this process's environment is left alone
    assert report["results"] == part["results"]  # the default rows: this process, this environment
    (variant,) = report["variants"]
    assert variant["label"] == "without OPENBLAS_CORETYPE=Haswell" and variant["unset"] == list(machine.SLOW_ENV)
    monkeypatch.setenv("NPATTN_BENCH_KEEP_ENV", "1")
    calls.clear()
    assert B.main(args) == 0
    assert calls == [] and json.loads(capsys.readouterr().out)["variants"] == []


def test_a_failed_variant_is_reported_not_fatal(monkeypatch, capsys):
    monkeypatch.setattr(cli, "call_in_child", lambda *a, **k: {"error": "boom"})
    assert cli._variant(False, {"vars": {"OPENBLAS_CORETYPE": "Haswell"}}) == []
    assert "the variant subprocess failed (boom)" in capsys.readouterr().err


def test_probe_measures_with_and_without_the_variables(monkeypatch):
    assert machine.probe_openblas_env() is None or any(os.environ.get(k) for k in machine.SLOW_ENV)
    monkeypatch.setenv("OPENBLAS_L2_SIZE", "1048576")
    seen = []

    def fake_call(function, kwargs=None, *, unset=(), show_stderr=False):
        seen.append(unset)
        return {"float32": 1.0, "float64": 1.0} if not unset else {"float32": 2.0, "float64": 2.0}

    monkeypatch.setattr(machine, "call_in_child", fake_call)
    probe = machine.probe_openblas_env(progress=lambda msg: None)
    assert seen == [(), machine.SLOW_ENV] and probe["unset"] is True
    monkeypatch.setattr(machine, "call_in_child", lambda *a, **k: {"error": "boom"})
    assert machine.probe_openblas_env() == {"error": "boom", "unset": False}


def test_variant_child_runs_the_timing_section(monkeypatch):
    monkeypatch.setattr(timing, "collect", lambda **kw: kw)
    assert cli.timing_variant(True) == {"quick": True, "progress": True, "memory": False}


def test_npattn_side_can_run_in_its_own_process():
    """The child process rebuilds the case (same seeds) and answers warm-up and turns over a pipe;
    it never imports torch."""
    child = B.Child("mha", {"b": 2, "L": 8, "d": 16, "h": 2, "causal": True}, "float32")
    try:
        fn = child.fn("npattn")
        assert _positive(fn.warm(2))
        times = fn.turn(3, 0.0)
        assert len(times) == 3 and all(_positive(t) for t in times)
        probe = child.ask({"probe": True})  # an unknown request is answered, not fatal
        assert probe == {"ok": True}
    finally:
        child.close()
    assert child.proc.returncode == 0


@pytest.mark.parametrize("use_torch", _TORCH_OR_NOT)
def test_timed_in_a_child_when_torch_is_beside_it(use_torch):
    built, times, facts = B.time_case(
        "mha", dict(b=1, L=4, d=8, h=2), "float64", use_torch=use_torch, own_process=True, repeats=1, pause=0
    )
    assert set(times) == ({"npattn", "torch"} if use_torch else {"npattn"})
    assert all(_positive(t) for t in times.values())
    assert (facts["max_rel_diff_vs_torch"] < 1e-10) if use_torch else facts == {}


def test_child_process_never_imports_torch():
    code = (
        "import sys, numpy as np, npattn.tools.bench as B\n"
        "built = B.KINDS['attention'].build(np.dtype('float64'), None, b=1, h=2, L=8, E=4)\n"
        "built.npattn['npattn']()\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=runner.child_env(), check=True
    )
    assert out.stdout.strip() == "False"


# -- what the report says about the machine, on any machine ------------------------------------------------
def test_blas_info_from_threadpoolctl(monkeypatch):
    fake = SimpleNamespace(
        threadpool_info=lambda: [
            {"user_api": "openmp", "internal_api": "openmp"},
            {"user_api": "blas", "internal_api": "openblas", "architecture": "X", "num_threads": 2, "version": "1"},
        ]
    )
    monkeypatch.setitem(sys.modules, "threadpoolctl", fake)
    assert machine._blas_info() == [{"internal_api": "openblas", "architecture": "X", "num_threads": 2, "version": "1"}]
    monkeypatch.setattr(machine, "openblas_functions", lambda *names: None)
    fake.threadpool_info = lambda: []  # threadpoolctl sees no BLAS, nor does the OpenBLAS lookup
    assert machine._blas_info() is None


def test_machine_facts_survive_a_machine_without_proc(monkeypatch):
    def no_proc(*args, **kwargs):
        raise OSError("no /proc here")

    for module in (machine, runner):
        monkeypatch.setattr(module, "open", no_proc, raising=False)
    assert machine._cpu_flags() == [] and machine._idle_fraction(0.0) is None
    assert isinstance(machine._cpu_name(), str)
    assert runner.status_kib("VmHWM") > 0  # the peak from getrusage instead


def test_child_env_puts_this_npattn_first(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    env = runner.child_env(unset=("OPENBLAS_CORETYPE",))
    assert env["PYTHONPATH"] == str(ROOT) + os.pathsep + "/elsewhere" and "OPENBLAS_CORETYPE" not in env
    assert os.environ["OPENBLAS_CORETYPE"] == "Haswell"  # this process's environment is untouched


def test_a_closed_child_closes_again_quietly():
    child = B.Child("attention", {"b": 1, "h": 1, "L": 4, "E": 4}, "float64")
    child.close()
    child.close()  # its pipe is gone: nothing to ask, nothing raised
    with pytest.raises((RuntimeError, OSError, ValueError)):  # a dead child is an error, never a hang
        child.ask({"warm": 1, "label": "npattn"})


def test_mem_eff_row_gets_the_peak_memory_of_its_kernel(monkeypatch):
    monkeypatch.setattr(timing, "QUICK", [("attention", dict(b=1, h=1, L=16, E=4, impl=timing.MEM_EFF["impl"]))])
    report = timing.collect(quick=True, progress=False, use_torch=False, memory=True)
    rows = report["results"]
    assert [r["name"] for r in rows] == ["mem_eff", "mem_eff"]
    assert rows[0]["npattn_extra_mib"] >= 0 and rows[0]["torch_extra_mib"] is None  # float32 only
    assert "npattn_extra_mib" not in rows[1]
    assert "peak extra memory npattn" in "\n".join(timing.format_results(report))


def test_window_table_marks_missing_and_failed_cores():
    rows = [
        {"impl": B.MEMORY_IMPLS[0], "seq": 64, "seconds": 0.5, "ms_per_1k_rows": 7.8, "extra_mib": 3.0},
        {"impl": B.MEMORY_IMPLS[1], "seq": 64, "missing": True},
        {"impl": B.MEMORY_IMPLS[0], "seq": 128, "error": "boom"},
    ]
    lines = B.format_window(rows, (16, 0)).splitlines()
    assert "missing" in lines[2] and "7.8" in lines[2] and "error" in lines[3] and "missing" in lines[3]


def test_progress_notes_name_their_units():
    assert window._note({"seconds": 0.12, "ms_per_1k_rows": 116.6, "extra_mib": 6.0}) == (
        "0.12 s, 116.6 ms per 1000 rows, 6 MiB"
    )
    assert window._note({"missing": True}) == "missing" and window._note({"error": "x"}) == "error"
    assert memory._note({"extra_mib": 16.0, "seconds": 0.87}) == "16 MiB above the inputs, 0.87 s"
    assert memory._note({"missing": True}) == "missing"


def test_the_larger_shapes_are_sections_of_their_own():
    """The default table stays at about a minute: the GPT-2-block encoder, MHA at L = 1024 and the
    L = 4096 rows (float32, fewer turns) run only with --large / --long."""
    from npattn.tools.bench import timing

    default = {(kind, tuple(sorted(p.items()))) for kind, p in timing.TABLE}
    for kind, p in timing.LARGE + timing.LONG:
        assert (kind, tuple(sorted(p.items()))) not in default
    assert all(p["L"] >= 1024 for _, p in timing.LARGE if "L" in p and _ == "mha")
    assert all(p["L"] == 4096 for _, p in timing.LONG)
    assert timing.LONG_SECTION.dtypes == ("float32",) and timing.LONG_SECTION.repeats == 3
    report = timing.LONG_SECTION.collect(quick=True, progress=False, use_torch=False)
    rows = report["long"]["results"]
    assert [r["name"] for r in rows] == ["mem_eff", "mem_eff fwd", "mem_eff jvp"]
    assert {r["dtype"] for r in rows} == {"float32"}
    text = "\n".join(timing.LONG_SECTION.format_section(report))
    assert "long sequences" in text and "mem_eff jvp" in text
    assert timing.LONG_SECTION.format_section({}) == []
