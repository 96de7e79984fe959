"""``npattn bench``: forward+backward timings of the main layers, against torch in the same run.

What is timed, each time one forward and one backward producing the input gradient and every
parameter gradient (the median over several turns, npattn and torch taking turns after warm-up; a
turn of short calls is a batch of consecutive calls, as a training loop makes them; npattn's side
runs in a child process that never imports torch, ``_Child``):

* ``sdpa``: ``scaled_dot_product_attention`` on ``(b, h, L, E)`` q, k, v, causal; torch's
  ``F.scaled_dot_product_attention(..., is_causal=True)``.
* ``mha``: ``MultiHeadAttention(d, d, h, causal=True)``; torch's fastest eager equivalent, one
  fused ``nn.Linear`` for q, k, v (bias-free, as npattn's default), ``F.scaled_dot_product_attention``
  with ``is_causal=True`` and an ``nn.Linear`` output projection, with the same weights.
* ``encoder``: ``EncoderBlock(d, h, 4d, dropout=0, causal=True, qkv_bias=True)`` (post-norm, ReLU);
  torch's ``nn.TransformerEncoderLayer(batch_first=True, dropout=0)`` with a causal mask.
* ``demo``: one training step of ``npattn demo``'s model (``TinyTransformer`` as the demo builds it:
  vocab 11, d_model 64, 4 heads, 2 pre-norm blocks, d_ff 256, batch 64, L 16): forward, mean
  cross-entropy and backward; torch's equivalent (``nn.Embedding`` x 2, pre-norm
  ``nn.TransformerEncoderLayer`` x 2, ``nn.LayerNorm``, ``nn.Linear``, ``F.cross_entropy``) with the
  same weights.
* ``mem_eff``: ``memory_efficient_attention`` at b=1, h=12, L=4096, E=64, causal against torch's
  flash kernel; its row also gives the peak memory above the inputs of each (``npattn_extra_mib``,
  ``torch_extra_mib``, float32, a fresh subprocess each).

Sizes: a small one (MHA(128, 4) and EncoderBlock(128, 4, 512) at batch 4, seq 64), GPT-2-small's
block (batch 8, seq 256, d_model 768, 12 heads, d_ff 3072) and MHA at batch 2, seq 1024, each in
float32 and float64.  ``--quick`` keeps tiny sizes only (for the test suite).

FLOP rates count the *useful* multiply-adds of the GEMMs (2 FLOPs each): a causal attention
counts only the ``L(L+1)/2`` visible (query, key) pairs, as FlashAttention's papers do, and a
backward counts twice its forward.  They are compared with numpy's own GEMM rate measured in the
same run (a ``2048 x 2048`` matmul; the best of several, at the start and again at the end of the
run, the better kept), the ceiling of anything built on it.

``--memory``: peak resident memory of one forward+backward of ``scaled_dot_product_attention``
against ``memory_efficient_attention`` (b=1, h=12, E=64, float32, causal) for several sequence
lengths, each in a fresh subprocess (``VmHWM``), minus that process's resident size just
before the call (after numpy, npattn and the inputs are loaded).

``--window``: windowed attention (``window=(256, 0)``, causal; b=1, h=4, E=64, float32) of both
cores against L = 1k ... 16k (``--quick``: 256 ... 1024), the best of 2 forward+backward runs in a fresh
subprocess: seconds, milliseconds per 1000 query rows (constant when the work is linear in L) and
peak extra MiB.  A core without the ``window`` option is reported as missing.

Environment: the numbers are measured under this machine's own BLAS settings, always.  Some
machines set ``OPENBLAS_CORETYPE`` (e.g. forcing OpenBLAS's Haswell/AVX2 kernels on a CPU that has
AVX-512) and ``OPENBLAS_L2_SIZE``; when they are set, ``main`` then measures numpy's GEMM peak with
and without them (fresh subprocesses) and, when it is faster without, runs the timing cases a
second time in a subprocess without them: a second, labelled section (``variants`` in the JSON),
never the default.  ``--quick`` and ``NPATTN_BENCH_KEEP_ENV=1`` skip the variant.  torch links its
own BLAS and is not affected by these variables.  The report names the CPU, its SIMD flags that
matter to a GEMM (``avx2``, ``fma``, ``avx512*``), the BLAS numpy uses (name, version, the kernel
core type in use, threads) and torch's thread count.

The machine's load matters (two cores shared with anything else that runs): the report gives
the load average and the idle fraction measured just before the run.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

__all__ = [
    "main",
    "run",
    "gemm_peak",
    "time_interleaved",
    "bench_sdpa",
    "bench_mha",
    "bench_encoder",
    "memory_table",
    "window_table",
    "bench_demo",
    "memory_torch",
    "bench_decode",
    "format_decode",
    "machine_info",
    "probe_openblas_env",
    "format_table",
]

_TORCH = None


def _torch():
    """torch (with 2 threads, as numpy's OpenBLAS here), or None when it is not importable."""
    global _TORCH
    if _TORCH is None:
        try:
            import torch
        except Exception:  # pragma: no cover - torch is optional
            _TORCH = False
        else:
            torch.set_num_threads(int(os.environ.get("NPATTN_BENCH_THREADS", "2")))
            _TORCH = torch
    return _TORCH or None


# -- timing ----------------------------------------------------------------------------------------
# Pause before each turn: OpenBLAS's idle threads spin (yielding) for about 0.1 s after a
# multithreaded GEMM and libgomp's (torch's) briefly too; without the pause one library's spinning
# threads would steal a core from the other's next turn.  (A sleeping machine wakes up slowly:
# each turn's first call is untimed.)
PAUSE = 0.12
BATCH_SECONDS = 0.05  # a turn of short calls lasts about this long
_MAX_BATCH = 25


def time_interleaved(fns, *, warmup=1, repeats=5, pause=PAUSE, batch_seconds=BATCH_SECONDS):
    """Median wall time in seconds per call of each zero-argument callable in ``fns`` (a dict).

    After ``warmup`` calls of each, the callables take turns ``repeats`` times (interleaved, so
    that a slow spell of the machine hits all of them alike).  A turn is what a training loop
    does: consecutive calls of one library.  It starts after ``pause`` seconds idle and one
    untimed call, then times a batch: one call, or as many short calls as fit in
    ``batch_seconds`` (at most ``_MAX_BATCH``); every timed call counts towards the median.

    Why turns and not single alternating calls: a call right after the other library's measures
    that library's leftovers too: its idle thread pool still spinning on the cores (OpenBLAS's
    threads spin for about 0.1 s after a threaded GEMM, libgomp's briefly too), its data in the
    caches, and the memory it just freed, which spares the next numpy allocations their page
    faults.  On the project's machine these moved a ratio at b=4, L=64 between 0.6 and 1.9, and
    made code that allocates afresh every step look 10 % faster than it runs on its own."""
    runners = {name: fn if isinstance(fn, _Child) else _Local(fn) for name, fn in fns.items()}
    batch = {}
    for name, r in runners.items():
        best = r.warm(max(1, warmup))
        batch[name] = int(min(_MAX_BATCH, max(1, batch_seconds // max(best, 1e-9))))
    times: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, r in runners.items():
            times[name] += r.turn(batch[name], pause)
    return {name: statistics.median(ts) for name, ts in times.items()}


class _Local:
    """Turns of a callable in this process (see ``time_interleaved``)."""

    def __init__(self, fn):
        self.fn = fn

    def warm(self, n):
        """``n`` calls; the best time."""
        best = math.inf
        for _ in range(n):
            t0 = time.perf_counter()
            self.fn()
            best = min(best, time.perf_counter() - t0)
        return best

    def turn(self, n, pause):
        """``pause`` seconds idle, one untimed call, then ``n`` timed calls; their times."""
        if pause:
            time.sleep(pause)  # the other library's idle threads stop spinning
        self.fn()  # untimed: this library's threads, caches and heap, not the other's, for the timed calls
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.fn()
            out.append(time.perf_counter() - t0)
        return out


# npattn's side of a timed case runs in a child process that never imports torch: torch's own
# allocations and threads in the same process change what numpy's costs (on the project's machine a
# step that allocated afresh ran 25 % faster while torch ran beside it than on its own), and
# npattn's users are mostly programs without torch.  The child rebuilds the same case (same seeds,
# same weights) and answers the parent's turns over a pipe, so the two libraries still alternate.
_CHILD_SCRIPT = "import npattn.tools.bench as b; b._serve()"


class _Child:
    """npattn's callable of one case, ``bench_<case>(**kw, use_torch=False, _build_only=True)``, in
    a child process without torch; ``warm``/``turn`` as ``_Local``'s."""

    def __init__(self, case, kw):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD_SCRIPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_child_env(),
        )
        self._ask({"case": case, "kw": kw})

    def _ask(self, msg):
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"npattn bench: the timing subprocess ended (exit status {self.proc.wait()})")
        return json.loads(line)

    def warm(self, n):
        return self._ask({"warm": n})["best"]

    def turn(self, n, pause):
        return self._ask({"turn": n, "pause": pause})["times"]

    def close(self):
        try:
            self._ask({"quit": True})
        except (RuntimeError, OSError, ValueError):
            pass
        self.proc.wait()


def _serve() -> None:
    """The child side of ``_Child``: one JSON request per line on stdin, one answer per line on stdout."""
    runner: Any = None
    for line in sys.stdin:
        msg = json.loads(line)
        if "case" in msg:
            kw = dict(msg["kw"], dtype=np.dtype(msg["kw"]["dtype"]), use_torch=False, _build_only=True)
            build: Any = _CASES[msg["case"]]
            runner = _Local(build(**kw))
            answer: dict = {"ok": True}
        elif "warm" in msg:
            answer = {"best": runner.warm(msg["warm"])}
        elif "turn" in msg:
            answer = {"times": runner.turn(msg["turn"], msg["pause"])}
        else:
            answer = {"ok": True}
        print(json.dumps(answer), flush=True)
        if "quit" in msg:
            return


def _timed(fns, case, kw, *, warmup, repeats, pause, own_process):
    """``time_interleaved`` of ``fns``; with ``own_process`` npattn's side runs in a ``_Child``."""
    if not own_process or "torch" not in fns:
        return time_interleaved(fns, warmup=warmup, repeats=repeats, pause=pause)
    child = _Child(case, {k: (np.dtype(v).name if k == "dtype" else v) for k, v in kw.items()})
    try:
        return time_interleaved(dict(fns, npattn=child), warmup=warmup, repeats=repeats, pause=pause)
    finally:
        child.close()


def gemm_peak(dtype, n=2048, repeats=5):
    """numpy's GEMM rate in GFLOP/s: the best of ``repeats`` ``(n, n) @ (n, n)`` into a buffer."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    c = np.empty((n, n), dtype)
    np.matmul(a, b, out=c)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.matmul(a, b, out=c)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best / 1e9


# -- FLOP counts (useful multiply-adds x 2; backward = 2 x forward) ---------------------------------
def _attention_flops(b, h, lq, lk, e, ev, causal):
    pairs = sum(min(i + 1, lk) for i in range(lq)) if causal else lq * lk
    return 3 * 2 * b * h * pairs * (e + ev)


def _mha_flops(b, L, d, h, causal):
    n = b * L
    projections = 2 * n * d * 3 * d + 2 * n * d * d
    return 3 * projections + _attention_flops(b, h, L, L, d // h, d // h, causal)


def _encoder_flops(b, L, d, h, d_ff, causal):
    return _mha_flops(b, L, d, h, causal) + 3 * 2 * (2 * b * L * d * d_ff)


def _rel_diff(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _result(name, shape, dtype, flops, times, peak, check=None):
    t_np, t_torch = times["npattn"], times.get("torch")
    r = {
        "name": name,
        "shape": shape,
        "dtype": np.dtype(dtype).name,
        "npattn_s": t_np,
        "torch_s": t_torch,
        "ratio": (t_np / t_torch) if t_torch else None,
        "gflop": flops / 1e9,
        "npattn_gflops": flops / t_np / 1e9,
        "torch_gflops": (flops / t_torch / 1e9) if t_torch else None,
        "gemm_peak_gflops": peak,
        "fraction_of_gemm_peak": (flops / t_np / 1e9 / peak) if peak else None,
    }
    if check is not None:
        r["max_rel_diff_vs_torch"] = check
    return r


# -- the cases ---------------------------------------------------------------------------------------
def bench_sdpa(
    b,
    h,
    L,
    E,
    dtype=np.float32,
    *,
    causal=True,
    use_torch=True,
    peak=None,
    warmup=1,
    repeats=5,
    pause=PAUSE,
    memory_efficient=False,
    own_process=False,
    _build_only=False,
):
    """``scaled_dot_product_attention`` (or, with ``memory_efficient``, ``memory_efficient_attention``)
    forward+backward on ``(b, h, L, E)``, and torch's ``F.scaled_dot_product_attention`` (its CPU
    flash kernel for these inputs)."""
    from .. import functional as F

    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((b, h, L, E)).astype(dtype) for _ in range(4))
    fwd, bwd = (
        (F.memory_efficient_attention, F.memory_efficient_attention_backward)
        if memory_efficient
        else (F.scaled_dot_product_attention, F.scaled_dot_product_attention_backward)
    )

    def run_np():
        out, cache = fwd(q, k, v, is_causal=causal)
        return out, bwd(dout, cache)

    if _build_only:
        return run_np
    fns = {"npattn": run_np}
    torch = _torch() if use_torch else None
    check = None
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(a.copy()).requires_grad_() for a in (q, k, v))
        tdout = torch.from_numpy(dout)

        def run_torch():
            for t in (tq, tk, tv):
                t.grad = None
            out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
            out.backward(tdout)
            return out

        fns["torch"] = run_torch
        out, (dq, _, _) = run_np()
        tout = run_torch()
        check = max(_rel_diff(out, tout.detach().numpy()), _rel_diff(dq, tq.grad.numpy()))
    kw = dict(b=b, h=h, L=L, E=E, dtype=dtype, causal=causal, memory_efficient=memory_efficient)
    times = _timed(fns, "sdpa", kw, warmup=warmup, repeats=repeats, pause=pause, own_process=own_process)
    return _result(
        "mem_eff" if memory_efficient else "sdpa",
        {"batch": b, "heads": h, "seq": L, "head_dim": E, "causal": causal},
        dtype,
        _attention_flops(b, h, L, L, E, E, causal),
        times,
        peak,
        check,
    )


def _torch_mha(torch, mha):
    """torch's fastest eager MHA with the weights of the npattn ``mha`` (no qkv bias)."""
    nn = torch.nn
    d, h = mha.d_out, mha.num_heads

    class TorchMHA(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(mha.d_in, 3 * d, bias=False)
            self.out_proj = nn.Linear(d, d, bias=mha.out_proj.bias is not None)

        def forward(self, x):
            b, L, _ = x.shape
            q, k, v = self.qkv(x).view(b, L, 3, h, d // h).permute(2, 0, 3, 1, 4)
            ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=mha.causal)
            return self.out_proj(ctx.transpose(1, 2).reshape(b, L, d))

    m = TorchMHA()
    dt = torch.float32 if mha.dtype == np.float32 else torch.float64
    m.to(dt)
    with torch.no_grad():
        m.qkv.weight.copy_(
            torch.from_numpy(np.concatenate([mha.W_query.weight.data, mha.W_key.weight.data, mha.W_value.weight.data]))
        )
        m.out_proj.weight.copy_(torch.from_numpy(mha.out_proj.weight.data))
        if mha.out_proj.bias is not None:
            m.out_proj.bias.copy_(torch.from_numpy(mha.out_proj.bias.data))
    return m


def _module_fns(module, tmodule, x, dy, torch):
    """Zero-argument callables running forward+backward of the npattn and the torch module."""

    def run_np():
        out = module(x)
        return out, module.backward(dy)

    fns = {"npattn": run_np}
    check = None
    if tmodule is not None:
        tx = torch.from_numpy(x.copy()).requires_grad_()
        tdy = torch.from_numpy(dy)
        params = list(tmodule.parameters())

        def run_torch():
            tx.grad = None
            for p in params:
                p.grad = None
            out = tmodule(tx)
            out.backward(tdy)
            return out

        fns["torch"] = run_torch
        out, dx = run_np()
        tout = run_torch()
        check = max(_rel_diff(out, tout.detach().numpy()), _rel_diff(dx, tx.grad.numpy()))
    return fns, check


def bench_mha(
    b,
    L,
    d,
    h,
    dtype=np.float32,
    *,
    causal=True,
    use_torch=True,
    peak=None,
    warmup=1,
    repeats=5,
    pause=PAUSE,
    own_process=False,
    _build_only=False,
):
    """``MultiHeadAttention(d, d, h, causal=causal)`` forward+backward on ``(b, L, d)`` (and torch's)."""
    from ..nn.attention import MultiHeadAttention

    rng = np.random.default_rng(0)
    mha = MultiHeadAttention(d, d, h, causal=causal, rng=0, dtype=dtype)
    x, dy = (rng.standard_normal((b, L, d)).astype(dtype) for _ in range(2))
    if _build_only:
        return _module_fns(mha, None, x, dy, None)[0]["npattn"]
    torch = _torch() if use_torch else None
    tm = _torch_mha(torch, mha) if torch is not None else None
    fns, check = _module_fns(mha, tm, x, dy, torch)
    kw = dict(b=b, L=L, d=d, h=h, dtype=dtype, causal=causal)
    times = _timed(fns, "mha", kw, warmup=warmup, repeats=repeats, pause=pause, own_process=own_process)
    return _result(
        "mha",
        {"batch": b, "seq": L, "d_model": d, "heads": h, "causal": causal},
        dtype,
        _mha_flops(b, L, d, h, causal),
        times,
        peak,
        check,
    )


# -- the demo's model: one training step ------------------------------------------------------------
DEMO = dict(b=64, L=16)  # npattn demo's batch and context (2 * n_digits)
DEMO_QUICK = dict(b=2, L=8, d=16, h=2, layers=1, d_ff=32)


def _demo_flops(b, L, d, h, d_ff, layers, vocab):
    return layers * _encoder_flops(b, L, d, h, d_ff, True) + 3 * 2 * b * L * d * vocab


def _torch_demo(torch, model, L):
    """torch's eager equivalent of a ``TinyTransformer`` (pre-norm causal blocks), same weights."""
    nn = torch.nn
    dt = torch.float32 if model.dtype == np.float32 else torch.float64
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    layers = [_torch_encoder(torch, blk, L) for blk in model.blocks]

    class TorchTiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(*model.tok_emb.weight.data.shape)
            self.pos = nn.Embedding(*model.pos_emb.weight.data.shape)
            self.blocks = nn.ModuleList(layers)
            self.norm = nn.LayerNorm(model.norm.weight.data.shape[0])
            self.head = nn.Linear(*model.head.weight.data.shape[::-1])

        def forward(self, ids):
            x = self.tok(ids) + self.pos(torch.arange(ids.shape[-1]))
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.norm(x))

    m = TorchTiny().to(dt)
    with torch.no_grad():
        for tl, nl in ((m.tok, model.tok_emb), (m.pos, model.pos_emb), (m.norm, model.norm), (m.head, model.head)):
            tl.weight.copy_(t(nl.weight.data))
            if getattr(nl, "bias", None) is not None:
                tl.bias.copy_(t(nl.bias.data))
    return m


def bench_demo(
    dtype=np.float32,
    *,
    quick=False,
    use_torch=True,
    peak=None,
    warmup=1,
    repeats=5,
    pause=PAUSE,
    own_process=False,
    _build_only=False,
):
    """One training step of ``npattn demo``'s ``TinyTransformer`` (forward, mean cross-entropy over
    the answer half of each sequence, backward) and of torch's equivalent with the same weights."""
    from ..models import TinyTransformer
    from .demo import IGNORE_INDEX, VOCAB_SIZE, DemoConfig

    cfg = DemoConfig()
    b, L = (DEMO_QUICK["b"], DEMO_QUICK["L"]) if quick else (DEMO["b"], DEMO["L"])
    d, h, layers, d_ff = (
        (DEMO_QUICK[k] for k in ("d", "h", "layers", "d_ff"))
        if quick
        else (cfg.d_model, cfg.num_heads, cfg.num_layers, cfg.d_ff)
    )
    model = TinyTransformer(VOCAB_SIZE, L, d, h, layers, d_ff, rng=np.random.default_rng(cfg.seed), dtype=dtype)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB_SIZE, (b, L))
    targets = rng.integers(0, VOCAB_SIZE, (b, L))
    targets[:, : L // 2] = IGNORE_INDEX  # the prompt half is not scored, as in the demo

    def run_np():
        loss, dlogits = model.loss(ids, targets, ignore_index=IGNORE_INDEX)
        model.backward(dlogits)
        return loss

    if _build_only:
        return run_np
    fns = {"npattn": run_np}
    torch = _torch() if use_torch else None
    check = None
    if torch is not None:
        tm = _torch_demo(torch, model, L)
        tids, ttargets = torch.from_numpy(ids), torch.from_numpy(targets)
        params = list(tm.parameters())

        def run_torch():
            for p in params:
                p.grad = None
            logits = tm(tids)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ttargets.reshape(-1), ignore_index=IGNORE_INDEX
            )
            loss.backward()
            return loss

        fns["torch"] = run_torch
        model.zero_grad()
        loss = run_np()
        tloss = run_torch()
        check = max(
            _rel_diff(loss, tloss.item()),
            _rel_diff(model.head.weight.grad, tm.head.weight.grad.numpy()),
            _rel_diff(model.tok_emb.weight.grad, tm.tok.weight.grad.numpy()),
        )
    kw = dict(dtype=dtype, quick=quick)
    times = _timed(fns, "demo", kw, warmup=warmup, repeats=repeats, pause=pause, own_process=own_process)
    return _result(
        "demo",
        {"batch": b, "seq": L, "d_model": d, "heads": h, "d_ff": d_ff, "layers": layers, "vocab": VOCAB_SIZE},
        dtype,
        _demo_flops(b, L, d, h, d_ff, layers, VOCAB_SIZE),
        times,
        peak,
        check,
    )


def _torch_encoder(torch, block, L):
    """``nn.TransformerEncoderLayer`` with the weights of the npattn ``block`` and a causal mask."""
    mha, ffn = block.mha, block.ffn
    d, h = mha.d_out, mha.num_heads
    layer = torch.nn.TransformerEncoderLayer(
        d, h, ffn.linear1.out_features, dropout=0.0, batch_first=True, norm_first=block.norm_first
    )
    dt = torch.float32 if block.dtype == np.float32 else torch.float64
    layer.to(dt)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    with torch.no_grad():
        layer.self_attn.in_proj_weight.copy_(
            t(np.concatenate([mha.W_query.weight.data, mha.W_key.weight.data, mha.W_value.weight.data]))
        )
        if mha.W_query.bias is None:  # qkv_bias=False: torch's layer always has one, kept at zero
            layer.self_attn.in_proj_bias.zero_()
        else:
            layer.self_attn.in_proj_bias.copy_(
                t(np.concatenate([mha.W_query.bias.data, mha.W_key.bias.data, mha.W_value.bias.data]))
            )
        layer.self_attn.out_proj.weight.copy_(t(mha.out_proj.weight.data))
        layer.self_attn.out_proj.bias.copy_(t(mha.out_proj.bias.data))
        for tl, nl in (
            (layer.linear1, ffn.linear1),
            (layer.linear2, ffn.linear2),
            (layer.norm1, block.layernorm1),
            (layer.norm2, block.layernorm2),
        ):
            tl.weight.copy_(t(nl.weight.data))
            tl.bias.copy_(t(nl.bias.data))
    mask = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=dt)

    class Causal(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return self.layer(x, src_mask=mask, is_causal=True)

    return Causal()


def bench_encoder(
    b,
    L,
    d,
    h,
    dtype=np.float32,
    *,
    d_ff=None,
    causal=True,
    use_torch=True,
    peak=None,
    warmup=1,
    repeats=5,
    pause=PAUSE,
    own_process=False,
    _build_only=False,
):
    """``EncoderBlock(d, h, d_ff, dropout=0, causal=causal, qkv_bias=True)`` forward+backward (and torch's)."""
    from ..nn.transformer import EncoderBlock

    d_ff = 4 * d if d_ff is None else d_ff
    rng = np.random.default_rng(0)
    block = EncoderBlock(d, h, d_ff, dropout=0.0, causal=causal, qkv_bias=True, rng=0, dtype=dtype)
    x, dy = (rng.standard_normal((b, L, d)).astype(dtype) for _ in range(2))
    if _build_only:
        return _module_fns(block, None, x, dy, None)[0]["npattn"]
    torch = _torch() if use_torch else None
    tm = _torch_encoder(torch, block, L) if torch is not None else None
    fns, check = _module_fns(block, tm, x, dy, torch)
    kw = dict(b=b, L=L, d=d, h=h, dtype=dtype, d_ff=d_ff, causal=causal)
    times = _timed(fns, "encoder", kw, warmup=warmup, repeats=repeats, pause=pause, own_process=own_process)
    return _result(
        "encoder",
        {"batch": b, "seq": L, "d_model": d, "heads": h, "d_ff": d_ff, "causal": causal},
        dtype,
        _encoder_flops(b, L, d, h, d_ff, causal),
        times,
        peak,
        check,
    )


_CASES = {"sdpa": bench_sdpa, "mha": bench_mha, "encoder": bench_encoder, "demo": bench_demo}


# -- decoding with and without the KV cache -------------------------------------------------------
DECODE = {
    "vocab_size": 512,
    "context_length": 256,
    "emb_dim": 256,
    "n_heads": 4,
    "n_layers": 4,
    "drop_rate": 0.0,
    "qkv_bias": False,
}
DECODE_QUICK = {
    "vocab_size": 64,
    "context_length": 32,
    "emb_dim": 32,
    "n_heads": 2,
    "n_layers": 2,
    "drop_rate": 0.0,
    "qkv_bias": False,
}


def _torch_book_gpt(torch, cfg):
    """The book's chapter-4 GPTModel in torch (eager, no cache), as ``tests/book/chapter4_torch.py``."""
    nn = torch.nn

    class LayerNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.scale, self.shift = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

        def forward(self, x):
            mean, var = x.mean(-1, keepdim=True), x.var(-1, keepdim=True, unbiased=False)
            return self.scale * (x - mean) / torch.sqrt(var + 1e-5) + self.shift

    class GELU(nn.Module):
        def forward(self, x):
            return 0.5 * x * (1 + torch.tanh((2.0 / math.pi) ** 0.5 * (x + 0.044715 * x**3)))

    class MHA(nn.Module):
        def __init__(self):
            super().__init__()
            d = cfg["emb_dim"]
            self.W_query, self.W_key, self.W_value = (nn.Linear(d, d, bias=cfg["qkv_bias"]) for _ in range(3))
            self.out_proj = nn.Linear(d, d)
            self.register_buffer("mask", torch.triu(torch.ones(cfg["context_length"], cfg["context_length"]), 1))

        def forward(self, x):
            b, n, d = x.shape
            h = cfg["n_heads"]
            q, k, v = (W(x).view(b, n, h, d // h).transpose(1, 2) for W in (self.W_query, self.W_key, self.W_value))
            s = (q @ k.transpose(2, 3)).masked_fill(self.mask.bool()[:n, :n], -torch.inf)
            w = torch.softmax(s / k.shape[-1] ** 0.5, dim=-1)
            return self.out_proj((w @ v).transpose(1, 2).reshape(b, n, d))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d = cfg["emb_dim"]
            self.att = MHA()
            self.ff = nn.Module()
            self.ff.layers = nn.Sequential(nn.Linear(d, 4 * d), GELU(), nn.Linear(4 * d, d))
            self.norm1, self.norm2 = LayerNorm(d), LayerNorm(d)

        def forward(self, x):
            x = x + self.att(self.norm1(x))
            return x + self.ff.layers(self.norm2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
            self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"])
            self.trf_blocks = nn.Sequential(*[Block() for _ in range(cfg["n_layers"])])
            self.final_norm = LayerNorm(cfg["emb_dim"])
            self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)

        def forward(self, idx):
            x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
            return self.out_head(self.final_norm(self.trf_blocks(x)))

    return GPT()


def bench_decode(cfg=None, dtype=np.float32, *, prompt_len=16, batch=1, use_torch=True, repeats=3):
    """Greedy decoding of ``npattn.book.GPTModel`` from a ``prompt_len``-token prompt until the
    context is full (``context_length - prompt_len`` new tokens), with the KV cache (one token
    per step) and without (every step re-encodes the whole sequence), and torch's eager book
    model (no cache) with the same weights.  Rows: ``{"name": "decode", "impl", "tokens_per_s",
    "seconds", ...}``; ``same_tokens`` says whether each run produced the cached run's tokens."""
    from ..book import GPTModel, generate

    cfg = dict(DECODE if cfg is None else cfg)
    ctx = cfg["context_length"]
    new = ctx - prompt_len
    model = GPTModel(cfg, rng=0, dtype=dtype)
    prompt = np.random.default_rng(0).integers(0, cfg["vocab_size"], (batch, prompt_len))
    outs = {}

    def run_np(use_cache):
        def fn():
            outs[use_cache] = generate(model, prompt, new, ctx, use_cache=use_cache)

        return fn

    fns = {"npattn, KV cache": run_np(True), "npattn, no cache": run_np(False)}
    torch = _torch() if use_torch else None
    if torch is not None:
        tm = _torch_book_gpt(torch, cfg).to(torch.float32 if np.dtype(dtype) == np.float32 else torch.float64).eval()
        tm.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in model.state_dict().items()})

        def run_torch():
            idx = torch.from_numpy(prompt)
            with torch.no_grad():
                for _ in range(new):
                    nxt = tm(idx[:, -ctx:])[:, -1].argmax(-1, keepdim=True)
                    idx = torch.cat([idx, nxt], dim=1)
            outs["torch"] = idx.numpy()

        fns["torch eager, no cache"] = run_torch
    times = time_interleaved(fns, warmup=1, repeats=repeats, pause=PAUSE)
    keys = {"npattn, KV cache": True, "npattn, no cache": False, "torch eager, no cache": "torch"}
    shape = {"batch": batch, "prompt": prompt_len, "new_tokens": new, **cfg}
    return [
        {
            "name": "decode",
            "impl": impl,
            "shape": shape,
            "dtype": np.dtype(dtype).name,
            "seconds": t,
            "tokens_per_s": batch * new / t,
            "same_tokens": bool(np.array_equal(outs[keys[impl]], outs[True])),
        }
        for impl, t in times.items()
    ]


def format_decode(rows):
    """The decode rows as lines of text."""
    if not rows:
        return []
    s = rows[0]["shape"]
    lines = [
        f"greedy decoding of npattn.book.GPTModel (emb {s['emb_dim']}, {s['n_layers']} layers, {s['n_heads']} "
        f"heads, vocab {s['vocab_size']}): a {s['prompt']}-token prompt to the full context of "
        f"{s['context_length']}, batch {s['batch']}",
        f"{'implementation':<24} {'dtype':<8} {'seconds':>8} {'tokens/s':>9} {'same tokens':>12}",
    ]
    lines += [
        f"{r['impl']:<24} {r['dtype']:<8} {r['seconds']:>8.2f} {r['tokens_per_s']:>9.1f} "
        f"{'yes' if r['same_tokens'] else 'no':>12}"
        for r in rows
    ]
    return lines


# -- the whole run ---------------------------------------------------------------------------------
SMALL = dict(b=4, L=64, d=128, h=4)
GPT2 = dict(b=8, L=256, d=768, h=12)
LONG = dict(b=2, L=1024, d=768, h=12)
_ENV_KEYS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
_SLOW_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")  # see the module docstring


def _openblas_info():
    """The BLAS numpy uses: name, version, kernel core type, threads (threadpoolctl when installed,
    else OpenBLAS's own ``get_config``/``get_corename``/``get_num_threads`` found in this process)."""
    try:
        import threadpoolctl
    except ImportError:
        return _openblas_ctypes()
    return [
        {k: i.get(k) for k in ("internal_api", "architecture", "num_threads", "version")}
        for i in threadpoolctl.threadpool_info()
        if i.get("user_api") == "blas"
    ] or _openblas_ctypes()


def _openblas_ctypes():
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line})
    except OSError:
        return None
    found = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas_", "64_"), ("openblas_", "64_"), ("openblas_", "")):
            fns = [getattr(lib, f"{prefix}get_{n}{suffix}", None) for n in ("config", "corename", "num_threads")]
            if all(fn is not None for fn in fns):
                fns[0].restype = fns[1].restype = ctypes.c_char_p
                fns[2].restype = ctypes.c_int
                config = fns[0]().decode(errors="replace")
                words = config.split()
                found.append(
                    {
                        "internal_api": "openblas",
                        "version": words[1] if len(words) > 1 else None,
                        "architecture": fns[1]().decode(errors="replace"),
                        "num_threads": fns[2](),
                        "config": config,
                    }
                )
                break
    return found or None


_SIMD_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "asimd",
    "sve",
)


def _cpu_flags():
    """The CPU's SIMD flags that matter to a GEMM kernel (Linux ``/proc/cpuinfo``; [] elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in _SIMD_FLAGS if flag in have]
    except OSError:
        pass
    return []


def _idle_fraction(seconds=0.5):
    """Fraction of all CPUs' time spent idle over ``seconds`` (Linux ``/proc/stat``; None elsewhere)."""

    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v)

    try:
        i0, t0 = snap()
        time.sleep(seconds)
        i1, t1 = snap()
    except (OSError, ValueError, IndexError):
        return None
    return (i1 - i0) / max(t1 - t0, 1)


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info():
    """Versions, CPU, the OpenBLAS kernel in use, the relevant environment and how busy the machine is."""
    torch = _torch()
    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__ if torch is not None else None,
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "cpu": _cpu_name(),
        "cpus": os.cpu_count(),
        "cpu_flags": _cpu_flags(),
        "blas": _openblas_info(),
        "env": {k: os.environ.get(k) for k in _ENV_KEYS},
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "idle_at_start": _idle_fraction(),
    }


def run(quick=False, use_torch=True, repeats=None, progress=None, memory=None):
    """All timing cases; returns a JSON-able dict (``machine``, ``gemm_peak_gflops``, ``results``).
    ``memory`` (default: not ``quick``) adds the peak extra MiB of the ``mem_eff`` row's two kernels."""
    memory = (not quick) if memory is None else memory
    repeats = repeats or (3 if quick else 7)
    dtypes = (np.float32, np.float64)
    machine = machine_info()
    gemm_n = 512 if quick else 2048
    peaks = {np.dtype(dt).name: gemm_peak(dt, n=gemm_n) for dt in dtypes}
    if quick:
        plan = [
            ("sdpa", dict(b=2, h=2, L=32, E=16)),
            ("mha", dict(b=2, L=32, d=32, h=4)),
            ("encoder", dict(b=2, L=32, d=32, h=4)),
            ("demo", dict(quick=True)),
        ]
    else:
        s, g = SMALL, GPT2
        plan = [
            ("sdpa", dict(b=s["b"], h=s["h"], L=s["L"], E=s["d"] // s["h"])),
            ("sdpa", dict(b=g["b"], h=g["h"], L=g["L"], E=g["d"] // g["h"])),
            ("mha", SMALL),
            ("mha", GPT2),
            ("mha", LONG),
            ("encoder", SMALL),
            ("encoder", GPT2),
            ("demo", {}),
            ("mem_eff", dict(b=1, h=12, L=4096, E=64)),
        ]  # against torch's CPU flash kernel
    funcs = {
        "sdpa": bench_sdpa,
        "mha": bench_mha,
        "encoder": bench_encoder,
        "demo": bench_demo,
        "mem_eff": lambda **kw: bench_sdpa(**kw, memory_efficient=True),
    }
    results = []
    for name, kw in plan:
        for dt in dtypes:
            if progress:
                progress(f"{name} {kw} {np.dtype(dt).name}")
            results.append(
                funcs[name](
                    **kw,
                    dtype=dt,
                    use_torch=use_torch,
                    peak=peaks[np.dtype(dt).name],
                    repeats=repeats,
                    pause=0.0 if quick else PAUSE,
                    own_process=not quick,
                )
            )
            if name == "mem_eff" and dt == np.float32 and memory:
                if progress:
                    progress("  peak memory of memory_efficient_attention and of torch's flash kernel")
                mine = memory_one("memory_efficient_attention", kw["L"])
                theirs = memory_torch(kw["L"]) if use_torch and _torch() is not None else {}
                results[-1]["npattn_extra_mib"] = mine.get("extra_mib")
                results[-1]["torch_extra_mib"] = theirs.get("extra_mib")
            if progress:
                progress("  " + _format_row(results[-1]))
    # numpy's GEMM peak again at the end, the better of both kept: one slow spell of a shared
    # machine at the start would otherwise inflate every row's "% of peak"
    samples = {"start": peaks, "end": {np.dtype(dt).name: gemm_peak(dt, n=gemm_n) for dt in dtypes}}
    peaks = {name: max(samples["start"][name], samples["end"][name]) for name in peaks}
    for r in results:
        r["gemm_peak_gflops"] = peaks[r["dtype"]]
        r["fraction_of_gemm_peak"] = r["npattn_gflops"] / peaks[r["dtype"]]
    return {
        "machine": machine,
        "gemm_peak_gflops": peaks,
        "gemm_peak_samples": samples,
        "gemm_n": gemm_n,
        "repeats": repeats,
        "results": results,
    }


# -- memory ------------------------------------------------------------------------------------------
_MEMORY_SCRIPT = r"""
import json, resource, sys, time
import numpy as np
import npattn.functional as F
impl, L = sys.argv[1], int(sys.argv[2])
if not hasattr(F, impl):
    print(json.dumps({"missing": True}))
    sys.exit(0)
rng = np.random.default_rng(0)
q, k, v, dout = (rng.standard_normal((1, 12, L, 64)).astype(np.float32) for _ in range(4))
fwd, bwd = getattr(F, impl), getattr(F, impl + "_backward")

def status_kib(key):  # VmRSS: resident now; VmHWM: this process image's peak (ru_maxrss would include
    with open("/proc/self/status") as f:  # the parent's size at fork, kept across exec)
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

before_kib = status_kib("VmRSS")
t0 = time.perf_counter()
out, cache = fwd(q, k, v, is_causal=True)
grads = bwd(dout, cache)
seconds = time.perf_counter() - t0
print(json.dumps({"before_kib": before_kib, "peak_kib": status_kib("VmHWM"), "seconds": seconds}))
"""


def _child_env(unset=()):
    """This environment, less ``unset``, with this npattn first on ``PYTHONPATH``."""
    env = dict(os.environ)
    for key in unset:
        env.pop(key, None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def memory_one(impl, L):
    """Peak RSS of one forward+backward of ``impl`` (a ``npattn.functional`` name) at sequence length
    ``L`` (b=1, h=12, E=64, float32, causal) in a fresh subprocess (``VmHWM``).  ``extra_mib``: above
    the process's resident size just before the call (numpy, npattn and the inputs loaded)."""
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, impl, str(L)], capture_output=True, text=True, env=_child_env()
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return {"impl": impl, "seq": L, "error": tail[0]}
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    if r.get("missing"):
        return {"impl": impl, "seq": L, "missing": True}
    return {
        "impl": impl,
        "seq": L,
        "peak_mib": r["peak_kib"] / 1024,
        "extra_mib": (r["peak_kib"] - r["before_kib"]) / 1024,
        "seconds": r["seconds"],
    }


_TORCH_MEMORY_SCRIPT = r"""
import json, sys, time
import numpy as np
import torch
torch.set_num_threads(int(sys.argv[2]))
L = int(sys.argv[1])
rng = np.random.default_rng(0)
q, k, v = (torch.from_numpy(rng.standard_normal((1, 12, L, 64)).astype(np.float32)).requires_grad_()
           for _ in range(3))
dout = torch.from_numpy(rng.standard_normal((1, 12, L, 64)).astype(np.float32))
sdpa = torch.nn.functional.scaled_dot_product_attention
sdpa(q[..., :2, :], k[..., :2, :], v[..., :2, :], is_causal=True).backward(dout[..., :2, :])  # load the kernels
for t in (q, k, v):
    t.grad = None

def status_kib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])

before_kib = status_kib("VmRSS")
t0 = time.perf_counter()
sdpa(q, k, v, is_causal=True).backward(dout)
seconds = time.perf_counter() - t0
print(json.dumps({"before_kib": before_kib, "peak_kib": status_kib("VmHWM"), "seconds": seconds}))
"""


def memory_torch(L):
    """As ``memory_one`` for torch's ``F.scaled_dot_product_attention`` (its CPU flash kernel here):
    one causal forward+backward at b=1, h=12, E=64, float32 in a fresh subprocess (gradients included)."""
    threads = os.environ.get("NPATTN_BENCH_THREADS", "2")
    proc = subprocess.run(
        [sys.executable, "-c", _TORCH_MEMORY_SCRIPT, str(L), threads], capture_output=True, text=True, env=_child_env()
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return {"impl": "torch", "seq": L, "error": tail[0]}
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "impl": "torch",
        "seq": L,
        "peak_mib": r["peak_kib"] / 1024,
        "extra_mib": (r["peak_kib"] - r["before_kib"]) / 1024,
        "seconds": r["seconds"],
    }


MEMORY_IMPLS = ("scaled_dot_product_attention", "memory_efficient_attention")


def memory_table(lengths=(512, 1024, 2048, 4096), progress=None):
    """Peak-memory rows of ``scaled_dot_product_attention`` and ``memory_efficient_attention``
    (a row with ``missing: True`` when npattn has no ``memory_efficient_attention``)."""
    rows = []
    for L in lengths:
        for impl in MEMORY_IMPLS:
            if progress:
                progress(f"memory {impl} L={L}")
            rows.append(memory_one(impl, L))
    return rows


# -- windowed attention: work that grows with L * window ---------------------------------------------
WINDOW = (256, 0)
WINDOW_SHAPE = {"batch": 1, "heads": 4, "head_dim": 64}
WINDOW_LENGTHS = (1024, 2048, 4096, 8192, 16384)
WINDOW_QUICK_LENGTHS = (256, 512, 1024)

_WINDOW_SCRIPT = r"""
import json, resource, sys, time
import numpy as np
import npattn.functional as F
impl = sys.argv[1]
L, left, right, h, E, repeats = (int(a) for a in sys.argv[2:8])
if not hasattr(F, impl):
    print(json.dumps({"missing": True}))
    sys.exit(0)
rng = np.random.default_rng(0)
q, k, v, dout = (rng.standard_normal((1, h, L, E)).astype(np.float32) for _ in range(4))
fwd, bwd = getattr(F, impl), getattr(F, impl + "_backward")
try:  # a core without the window option is reported as missing (and the libraries are warmed up)
    fwd(q[..., :2, :], k[..., :2, :], v[..., :2, :], is_causal=True, window=(left, right))
except TypeError as exc:
    if "window" in str(exc):
        print(json.dumps({"missing": True}))
        sys.exit(0)
    raise

def status_kib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

before_kib = status_kib("VmRSS")
times = []
for _ in range(repeats):
    t0 = time.perf_counter()
    out, cache = fwd(q, k, v, is_causal=True, window=(left, right))
    grads = bwd(dout, cache)
    times.append(time.perf_counter() - t0)
    del out, cache, grads
print(json.dumps({"before_kib": before_kib, "peak_kib": status_kib("VmHWM"), "seconds": min(times)}))
"""


def window_one(impl, L, window=WINDOW, heads=WINDOW_SHAPE["heads"], head_dim=WINDOW_SHAPE["head_dim"], repeats=2):
    """The best of ``repeats`` windowed, causal forward+backward runs of ``impl`` (b=1, float32) at
    sequence length ``L`` and the peak memory above the inputs, in a fresh subprocess;
    ``missing: True`` when ``impl`` has no ``window`` option."""
    argv = [impl] + [str(a) for a in (L, window[0], window[1], heads, head_dim, repeats)]
    proc = subprocess.run(
        [sys.executable, "-c", _WINDOW_SCRIPT, *argv], capture_output=True, text=True, env=_child_env()
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return {"impl": impl, "seq": L, "error": tail[0]}
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    if r.get("missing"):
        return {"impl": impl, "seq": L, "missing": True}
    return {
        "impl": impl,
        "seq": L,
        "seconds": r["seconds"],
        "ms_per_1k_rows": 1e6 * r["seconds"] / L,
        "extra_mib": (r["peak_kib"] - r["before_kib"]) / 1024,
    }


def window_table(lengths=WINDOW_LENGTHS, window=WINDOW, progress=None, repeats=2):
    """Windowed attention against sequence length, both cores: with the work limited to the band,
    time and memory per query row stay roughly constant (linear in ``L``)."""
    rows = []
    for L in lengths:
        for impl in MEMORY_IMPLS:
            if progress:
                progress(f"window {tuple(window)} {impl} L={L}")
            rows.append(window_one(impl, L, window, repeats=repeats))
    return rows


def format_window(rows, window=WINDOW):
    """The windowed sweep as text: per core, seconds, milliseconds per 1000 query rows, MiB."""
    shape = WINDOW_SHAPE
    lines = [
        f"windowed attention, window={tuple(window)}, causal (b={shape['batch']}, h={shape['heads']}, "
        f"E={shape['head_dim']}, float32), forward+backward in a fresh process, best of 2:",
        f"{'L':>6} {'sdpa s':>8} {'ms/1k rows':>10} {'MiB':>7}   {'mem-eff s':>9} {'ms/1k rows':>10} {'MiB':>7}",
    ]
    by = {}
    for r in rows:
        by.setdefault(r["seq"], {})[r["impl"]] = r

    def cells(r):
        if r is None or r.get("missing"):
            return ("missing", "-", "-")
        if "error" in r:
            return ("error", "-", "-")
        return (f"{r['seconds']:.2f}", f"{r['ms_per_1k_rows']:.1f}", f"{r['extra_mib']:.0f}")

    for L, d in sorted(by.items()):
        a, b = cells(d.get(MEMORY_IMPLS[0])), cells(d.get(MEMORY_IMPLS[1]))
        lines.append(f"{L:>6} {a[0]:>8} {a[1]:>10} {a[2]:>7}   {b[0]:>9} {b[1]:>10} {b[2]:>7}")
    return "\n".join(lines)


# -- output ------------------------------------------------------------------------------------------
def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def _shape_str(shape):
    names = {"batch": "b", "heads": "h", "seq": "L", "head_dim": "E", "d_model": "d", "d_ff": "ff"}
    return " ".join(f"{short}={shape[k]}" for k, short in names.items() if k in shape)


def _format_row(r):
    t = r["torch_s"]
    frac = r["fraction_of_gemm_peak"]
    return (
        f"{r['name']:<8} {_shape_str(r['shape']):<29} {r['dtype']:<8} {r['npattn_s'] * 1e3:>10.2f} "
        f"{_fmt(t and t * 1e3, '>10.2f')} {_fmt(r['ratio'], '>6.2f')} "
        f"{r['npattn_gflops']:>8.1f} {_fmt(r['torch_gflops'], '>7.1f')} "
        f"{_fmt(frac and 100 * frac, '>6.0f')}% {_fmt(r.get('max_rel_diff_vs_torch'), '>9.1e')}"
    )


def _format_results(report):
    """The timing rows of ``report`` (or of one of its ``variants``) as lines of text."""
    lines = [
        f"numpy GEMM peak ({report.get('gemm_n', 2048)}^2 matmul, best at the start or end of this run): "
        + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in report["gemm_peak_gflops"].items()),
        f"forward+backward (input and parameter gradients), median over {report['repeats']} interleaved turns"
        " (short calls: batches of consecutive calls);"
        " GFLOP/s count useful FLOPs (causal: visible pairs only); ratio = npattn / torch",
        "",
        f"{'op':<8} {'shape':<29} {'dtype':<8} {'npattn ms':>10} {'torch ms':>10} {'ratio':>6} "
        f"{'GFLOP/s':>8} {'torch':>7} {'%peak':>7} {'rel.diff':>9}",
    ]
    lines += [_format_row(r) for r in report["results"]]
    for r in report["results"]:
        if r.get("npattn_extra_mib") is not None:
            lines.append(
                f"{r['name']} {_shape_str(r['shape'])} {r['dtype']}: peak extra memory npattn "
                f"{r['npattn_extra_mib']:.0f} MiB, torch {_fmt(r.get('torch_extra_mib'), '.0f')} MiB "
                "(forward+backward above the inputs, a fresh process each)"
            )
    return lines


def format_table(report):
    """The report as a plain-text table."""
    m = report["machine"]
    blas = ", ".join(
        f"{b['internal_api']} {b['version']} {b['architecture']} x{b['num_threads']}" for b in (m.get("blas") or [])
    )
    env = ", ".join(f"{k}={v}" for k, v in m["env"].items() if v is not None) or "none of " + ", ".join(_ENV_KEYS)
    load = m.get("loadavg")
    idle = m.get("idle_at_start")
    lines = [
        f"machine: {m['cpu']} ({m['cpus']} cpus); python {m['python']}, numpy {m['numpy']}"
        f"{' (' + blas + ')' if blas else ''}, torch {m['torch'] or 'not installed'}"
        f"{'' if m['torch_threads'] is None else ' (' + str(m['torch_threads']) + ' threads)'}",
        f"environment: {env}"
        + (f"; load average {load[0]:.2f}" if load else "")
        + (f", {100 * idle:.0f}% idle at start" if idle is not None else ""),
    ]
    if m.get("cpu_flags") is not None:
        lines.insert(1, "cpu flags (SIMD): " + (" ".join(m["cpu_flags"]) or "none found"))
    probe = report.get("openblas_env_probe")
    if probe and "gemm_peak_gflops" in probe:
        p = probe["gemm_peak_gflops"]
        lines.append(
            "OpenBLAS probe, GEMM GFLOP/s with "
            + ", ".join(f"{k}={v}" for k, v in probe["vars"].items())
            + f": float32 {p['as_set']['float32']:.0f}, float64 {p['as_set']['float64']:.0f}; without: "
            f"float32 {p['unset']['float32']:.0f}, float64 {p['unset']['float64']:.0f}"
            + (" -> a variant section below, without them" if probe["unset"] else "")
        )
    lines += ["", "this machine's own settings:"] + _format_results(report)
    for var in report.get("variants") or []:
        lines += ["", f"VARIANT, not this machine's settings: {var['label']}"] + _format_results(var)
    if report.get("decode"):
        lines += [""] + format_decode(report["decode"])
    if report.get("memory"):
        lines += [
            "",
            "peak memory of forward+backward (b=1, h=12, E=64, float32, causal): MiB above the inputs, seconds",
            f"{'L':>6} {'sdpa MiB':>10} {'mem-eff MiB':>12} {'sdpa s':>8} {'mem-eff s':>10}",
        ]
        by = {}
        for r in report["memory"]:
            by.setdefault(r["seq"], {})[r["impl"]] = r

        def cell(r, key, spec):
            if r is None or r.get("missing"):
                return "missing"
            if "error" in r:
                return "error"
            return format(r[key], spec)

        for L, d in sorted(by.items()):
            a, b = d.get(MEMORY_IMPLS[0]), d.get(MEMORY_IMPLS[1])
            lines.append(
                f"{L:>6} {cell(a, 'extra_mib', '.0f'):>10} {cell(b, 'extra_mib', '.0f'):>12} "
                f"{cell(a, 'seconds', '.2f'):>8} {cell(b, 'seconds', '.2f'):>10}"
            )
    if report.get("window"):
        lines += ["", format_window(report["window"])]
    return "\n".join(lines)


# -- OpenBLAS environment and the command ---------------------------------------------------------
_PEAK_SCRIPT = (
    "import json, npattn.tools.bench as b; print(json.dumps({d: b.gemm_peak(d) for d in ('float32', 'float64')}))"
)


def probe_openblas_env(progress=None):
    """numpy's GEMM peak with this machine's ``OPENBLAS_CORETYPE``/``OPENBLAS_L2_SIZE`` and with both
    unset, each in a fresh subprocess (OpenBLAS reads them when it loads).  None when neither is
    set; else a dict with both peaks and ``unset``: True when the run without them is faster by
    more than 10% in both float32 and float64."""
    if not any(os.environ.get(k) for k in _SLOW_ENV):
        return None
    peaks = {}
    for label, unset in (("as_set", ()), ("unset", _SLOW_ENV)):
        if progress:
            progress(f"numpy GEMM peak with the OpenBLAS variables {label.replace('_', ' ')}")
        proc = subprocess.run(
            [sys.executable, "-c", _PEAK_SCRIPT], capture_output=True, text=True, env=_child_env(unset)
        )
        if proc.returncode != 0:
            return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1], "unset": False}
        peaks[label] = json.loads(proc.stdout.strip().splitlines()[-1])
    faster = all(peaks["unset"][d] > 1.1 * peaks["as_set"][d] for d in peaks["as_set"])
    return {"vars": {k: os.environ.get(k) for k in _SLOW_ENV}, "gemm_peak_gflops": peaks, "unset": faster}


def _collect(quick, memory, progress, window=False, decode=False):
    report = run(quick=quick, progress=progress)
    if decode:
        if progress:
            progress("decode with and without the KV cache")
        report["decode"] = [
            r
            for dt in (np.float32, np.float64)
            for r in bench_decode(
                DECODE_QUICK if quick else DECODE, dt, prompt_len=4 if quick else 16, repeats=1 if quick else 3
            )
        ]
    if memory:
        report["memory"] = memory_table((256, 512) if quick else (512, 1024, 2048, 4096), progress=progress)
    if window:
        report["window"] = window_table(WINDOW_QUICK_LENGTHS if quick else WINDOW_LENGTHS, progress=progress)
    return report


def _worker():
    """The benchmark's own subprocess (started by ``main`` for the variant environment): the
    options as JSON in ``argv[1]``, the report as JSON on stdout, progress on stderr."""
    opts = json.loads(sys.argv[1])
    progress = (lambda msg: print(msg, file=sys.stderr, flush=True)) if opts["progress"] else None
    if opts.get("timings_only"):
        print(json.dumps(run(quick=opts["quick"], progress=progress, memory=False)))
        return
    print(
        json.dumps(
            _collect(opts["quick"], opts["memory"], progress, opts.get("window", False), opts.get("decode", False))
        )
    )


def main(args):
    """``npattn bench [--json] [--memory] [--window] [--decode] [--quick]``: print the table (or the JSON report).

    Everything is measured under this machine's own environment.  When its ``OPENBLAS_CORETYPE``/
    ``OPENBLAS_L2_SIZE`` are measured to slow numpy's GEMM (``probe_openblas_env``), the timing cases
    run a second time in a subprocess without them: ``report["variants"]``, a second labelled
    section.  Never with ``--quick`` or ``NPATTN_BENCH_KEEP_ENV=1``.
    """
    quick = bool(getattr(args, "quick", False))
    as_json = bool(getattr(args, "json", False))
    memory = bool(getattr(args, "memory", False))
    window = bool(getattr(args, "window", False))
    decode = bool(getattr(args, "decode", False))
    progress = None if as_json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    report = _collect(quick, memory, progress, window, decode)
    probe = None
    if not quick and os.environ.get("NPATTN_BENCH_KEEP_ENV") != "1":
        probe = probe_openblas_env(progress)
    report["openblas_env_probe"] = probe
    report["variants"] = []
    if probe and probe.get("unset"):
        if progress:
            progress(
                f"numpy's GEMM is faster without {' and '.join(_SLOW_ENV)}: the timing cases again, in a "
                "subprocess without them (a labelled variant)"
            )
        opts = json.dumps(
            {"quick": quick, "memory": False, "window": False, "progress": progress is not None, "timings_only": True}
        )
        proc = subprocess.run(
            [sys.executable, "-c", "import npattn.tools.bench as b; b._worker()", opts],
            stdout=subprocess.PIPE,
            text=True,
            env=_child_env(_SLOW_ENV),
        )
        if proc.returncode != 0:
            print(f"npattn bench: the variant subprocess failed (exit status {proc.returncode})", file=sys.stderr)
        else:
            variant = json.loads(proc.stdout.strip().splitlines()[-1])
            variant["label"] = "without " + " and ".join(
                f"{k}={probe['vars'][k]}" for k in _SLOW_ENV if probe["vars"].get(k)
            )
            variant["unset"] = list(_SLOW_ENV)
            report["variants"].append(variant)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
    return 0
