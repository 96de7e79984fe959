"""The second-order section (``npattn bench --second-order``): what a Hessian-vector product costs.

Two questions, each against first order on the same module and inputs:

* **time**: a Hessian-vector product (forward over reverse) against one forward + backward, as a
  ratio (issue 31's goal: at most 3x), in float32 and float64:

  - ``mha_hvp``: ``MultiHeadAttention(768, 768, 12, causal=True)`` on ``(8, 256, 768)`` (``MHA``):
    the product of the parameters' Hessian of ``1/2 ||y - t||^2`` with a direction ``v`` by the
    curvature guide's recipe, ``y = m(x)``, ``ty = m.jvp(param_tangents=v)``, ``m.backward_jvp(y
    - t, param_tangents=v, ddy=ty)`` (which reuses the forward tangents the ``jvp`` computed),
    against ``y = m(x)``, ``m.backward(y - t)``;
  - ``family_hvp``: ``CausalLM.loss_hvp(ids, targets, v)`` of a small model of a family
    (``FAMILY``: the family's tiny config at width 128, 2 layers, vocab 1024, ``(1, 64)`` tokens)
    against ``loss`` + ``backward``;

  both callables take turns (``runner.time_interleaved``) in a child process that never imports
  torch (``runner.call_in_child``); the row gives each one's median seconds and ``ratio`` =
  HVP / first order.
* **memory**: ``memory_efficient_attention_backward_jvp`` at L = 4096 (b=1, h=12, E=64, float32,
  causal; ``MEM_EFF``) against ``memory_efficient_attention_backward`` of the same forward's cache,
  each in a fresh process (``runner.fresh``, as the memory section measures): the peak resident
  memory during the call above what was resident before it (inputs, tangents and the forward's
  cache loaded), and ``ratio`` = second order / backward (goal: at most 2x).

The kinds (``mha_hvp``, ``family_hvp``, ``attention_order``) are registered in ``cases.KINDS`` when
this module is imported (the package imports it through ``cli.SECTIONS``, children too).
"""

from __future__ import annotations

import numpy as np

from .cases import KINDS, Built, Kind, Missing, mha_flops
from .families import family_config
from .runner import Step, call_in_child, fresh, run_steps, time_interleaved
from .text import fmt, table

__all__ = [
    "MHA",
    "MHA_QUICK",
    "FAMILY",
    "FAMILY_QUICK",
    "FAMILY_TYPES",
    "MEM_EFF",
    "MEM_EFF_QUICK",
    "TIME_GOAL",
    "MEMORY_GOAL",
    "mha_hvp",
    "family_hvp",
    "attention_order",
    "hvp_row",
    "memory_row",
    "collect",
    "format_section",
]

MHA = dict(b=8, L=256, d=768, h=12)
MHA_QUICK = dict(b=2, L=16, d=32, h=4)
FAMILY = dict(hidden=128, layers=2, vocab=1024, batch=1, L=64)
FAMILY_QUICK = dict(hidden=32, layers=2, vocab=64, batch=1, L=8)
FAMILY_TYPES = ("llama", "qwen3_next")  # a transformer, and gated DeltaNet layers beside attention
MEM_EFF = dict(b=1, h=12, L=4096, E=64)
MEM_EFF_QUICK = dict(b=1, h=2, L=64, E=16)
DTYPES = ("float32", "float64")
TIME_GOAL, MEMORY_GOAL = 3.0, 2.0
FIRST, SECOND = "first order", "hvp"  # the two callables of a timed case


def _normal(dtype, *shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def _direction(module, dtype, seed=2):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(p.data.shape).astype(dtype) for n, p in module.named_parameters()}


def mha_hvp(dtype, torch, *, b, L, d, h):
    """``MultiHeadAttention(d, d, h, causal=True)`` on ``(b, L, d)``: ``FIRST`` = forward + backward
    of ``1/2 ||y - t||^2``, ``SECOND`` = its Hessian-vector product along every parameter (returns
    ``{name: H v}``, the parameters' ``grad_tangent``).  No torch twin (``torch`` is ignored)."""
    from ...nn.attention import MultiHeadAttention

    m = MultiHeadAttention(d, d, h, causal=True, rng=0, dtype=dtype)
    x, t = _normal(dtype, (b, L, d), (b, L, d))
    v = _direction(m, dtype)
    params = dict(m.named_parameters())

    def first():
        m.zero_grad()
        y = m(x)
        return m.backward(y - t)

    def second():
        m.zero_grad()
        y = m(x)
        ty = m.jvp(param_tangents=v)  # J v: the loss's second derivative along v is ty itself
        m.backward_jvp(y - t, param_tangents=v, ddy=ty)
        return {n: p.grad_tangent for n, p in params.items()}

    shape = {"batch": b, "seq": L, "d_model": d, "heads": h, "causal": True}
    return Built("mha", shape, {FIRST: first, SECOND: second}, {})


def family_hvp(dtype, torch, *, model_type, hidden, layers, vocab, batch, L):
    """``CausalLM`` of ``model_type`` (``families.family_config`` at these sizes) on ``(batch, L)``
    tokens: ``FIRST`` = ``loss`` + ``backward``, ``SECOND`` = ``loss_hvp`` along a direction of
    every parameter (returns its ``(loss, grads, hvp)``)."""
    from ...models import CausalLM

    m = CausalLM(family_config(model_type, hidden=hidden, layers=layers, vocab=vocab), rng=0, dtype=dtype)
    rng = np.random.default_rng(0)
    ids, targets = rng.integers(3, vocab, (2, batch, L))
    v = _direction(m, dtype)

    def first():
        m.zero_grad()
        loss, dlogits = m.loss(ids, targets)
        m.backward(dlogits)
        return loss

    def second():
        return m.loss_hvp(ids, targets, v)

    shape = {"model_type": model_type, "hidden": hidden, "layers": layers, "vocab": vocab, "batch": batch, "seq": L}
    return Built(model_type, dict(shape, parameters=m.num_parameters()), {FIRST: first, SECOND: second}, {})


def attention_order(dtype, torch, *, b, h, L, E, order, impl="memory_efficient_attention"):
    """``impl``'s forward on ``(b, h, L, E)`` q, k, v (causal) done when built; the one callable is
    its backward (``order=1``) or ``impl_backward_jvp`` along tangents of q, k, v and ``dout``
    (``order=2``), from that cache (``runner.fresh`` measures the call's memory above it)."""
    from ... import functional as F

    name = impl + ("_backward" if order == 1 else "_backward_jvp")
    if not hasattr(F, name):
        raise Missing(name)
    arrays = _normal(dtype, *[(b, h, L, E)] * 8)  # q, k, v, dout, then the tangents of q, k, v, dout
    _, cache = getattr(F, impl)(*arrays[:3], is_causal=True)
    op, dout, tangents, ddout = getattr(F, name), arrays[3], tuple(arrays[4:7]), arrays[7]

    def run():
        return op(dout, cache) if order == 1 else op(dout, cache, tangents, ddout)

    return Built(name, {"batch": b, "heads": h, "seq": L, "head_dim": E, "causal": True}, {"npattn": run}, {})


def _family_flops(*, hidden, layers, vocab, batch, L, **_):
    per_layer = 4 * hidden * hidden + 3 * hidden * 2 * hidden
    return 6 * batch * L * (layers * per_layer + hidden * vocab)


def _order_flops(*, b, h, L, E, order, **_):
    return (1 if order == 1 else 4) * 2 * 2 * b * h * L * L * E  # backward's four GEMMs over half the pairs


KINDS["mha_hvp"] = Kind(mha_hvp, lambda **p: mha_flops(p["b"], p["L"], p["d"], p["h"]))
KINDS["family_hvp"] = Kind(family_hvp, _family_flops)
KINDS["attention_order"] = Kind(attention_order, _order_flops)


def hvp_row(kind, params, dtype, repeats=3):
    """One timed case (run this in a child without torch: ``runner.call_in_child``): ``{"kind",
    "name", "shape", "dtype", "seconds": {FIRST, SECOND}, "ratio", "goal"}``."""
    built = KINDS[kind].build(np.dtype(dtype), None, **params)
    times = time_interleaved(built.npattn, warmup=1, repeats=repeats, pause=0.0)
    return {
        "kind": kind,
        "name": built.name,
        "shape": built.shape,
        "dtype": np.dtype(dtype).name,
        "seconds": times,
        "ratio": times[SECOND] / times[FIRST],
        "goal": TIME_GOAL,
    }


def memory_row(params, dtype="float32"):
    """Peak memory above the resident size of ``memory_efficient_attention``'s backward and of its
    ``backward_jvp``, a fresh process each: ``{"shape", "dtype", "backward", "backward_jvp"
    ({"extra_mib", "seconds"} or {"error"/"missing"}), "ratio", "goal"}``."""
    orders = {"backward": 1, "backward_jvp": 2}
    parts = {name: fresh("attention_order", dict(params, order=o), dtype) for name, o in orders.items()}
    ok = all("extra_mib" in r for r in parts.values()) and parts["backward"]["extra_mib"] > 0
    return {
        "kind": "attention_order",
        "name": "mem_eff",
        "shape": {"batch": params["b"], "heads": params["h"], "seq": params["L"], "head_dim": params["E"]},
        "dtype": np.dtype(dtype).name,
        **parts,
        "ratio": parts["backward_jvp"]["extra_mib"] / parts["backward"]["extra_mib"] if ok else None,
        "goal": MEMORY_GOAL,
    }


def _timed(kind, params, dtype, repeats, guess):
    label = f"{kind} {' '.join(f'{k}={v}' for k, v in params.items())} {dtype}"
    request = {"kind": kind, "params": params, "dtype": dtype, "repeats": repeats}
    return Step(label, guess, lambda: call_in_child("second_order:hvp_row", request))


def collect(quick=False, progress=True):
    mha, fam, mem = (MHA_QUICK, FAMILY_QUICK, MEM_EFF_QUICK) if quick else (MHA, FAMILY, MEM_EFF)
    repeats = 1 if quick else 3
    mha_guess = {"float32": 25.0, "float64": 60.0}
    steps = [_timed("mha_hvp", mha, dt, repeats, 1.0 if quick else mha_guess[dt]) for dt in DTYPES]
    steps += [
        _timed("family_hvp", dict(fam, model_type=mt), dt, repeats, 1.0 if quick else 5.0)
        for mt in FAMILY_TYPES
        for dt in DTYPES
    ]
    steps.append(Step(f"memory mem_eff L={mem['L']} float32", 1.0 if quick else 60.0, lambda: memory_row(mem)))
    rows = run_steps("second-order", steps, progress=progress, note=_note)
    return {"second_order": rows}


def _note(r):
    if r is None or "error" in r:
        return "error" + ("" if r is None else f": {r['error']}")
    return f"ratio {fmt(r['ratio'], '.2f')} (goal <= {r['goal']:.0f}x)"


def _time_cells(r):
    if "error" in r:
        return [r.get("kind", "?"), "-", r.get("dtype", "-"), "error", "-", "-", "-"]
    s = r["seconds"]
    ratio = r["ratio"]
    return [
        r["name"],
        _shape_of(r),
        r["dtype"],
        f"{s[FIRST] * 1e3:.1f}",
        f"{s[SECOND] * 1e3:.1f}",
        f"{ratio:.2f}",
        "yes" if ratio <= r["goal"] else "NO",
    ]


def _shape_of(r):
    """A row's sizes in a few words."""
    s = r["shape"]
    if r["kind"] == "family_hvp":
        return f"hidden={s['hidden']} n={s['layers']} vocab={s['vocab']} b={s['batch']} L={s['seq']}"
    if r["kind"] == "mha_hvp":
        return f"b={s['batch']} L={s['seq']} d={s['d_model']} h={s['heads']}"
    return f"b={s['batch']} h={s['heads']} L={s['seq']} E={s['head_dim']}"


def _memory_line(r):
    if r.get("ratio") is None:
        return f"memory_efficient_attention {_shape_of(r)}: backward {r['backward']}, backward_jvp {r['backward_jvp']}"
    b, j = r["backward"], r["backward_jvp"]
    verdict = "within" if r["ratio"] <= r["goal"] else "ABOVE"
    return (
        f"memory_efficient_attention {_shape_of(r)} {r['dtype']} causal, peak extra memory of one call from the "
        f"forward's cache (a fresh process each): backward {b['extra_mib']:.0f} MiB ({b['seconds']:.2f} s), "
        f"backward_jvp {j['extra_mib']:.0f} MiB ({j['seconds']:.2f} s): ratio {r['ratio']:.2f}, {verdict} "
        f"the goal of <= {r['goal']:.0f}x"
    )


def format_section(report):
    rows = report.get("second_order")
    if not rows:
        return []
    timed = [r for r in rows if r is not None and r.get("kind") != "attention_order"]
    columns = [
        ("module", "<"),
        ("sizes", "<"),
        ("dtype", "<"),
        ("fwd+bwd ms", ">"),
        ("hvp ms", ">"),
        ("ratio", ">"),
        (f"<= {TIME_GOAL:.0f}x", ">"),
    ]
    lines = [
        "",
        "second order: a Hessian-vector product against one forward + backward of the same module (median of "
        "turns, a child process without torch); mha: forward, jvp and backward_jvp of 1/2 ||y - t||^2 along every "
        "parameter; a family: CausalLM.loss_hvp against loss + backward",
    ] + table(columns, [_time_cells(r) for r in timed])
    lines += [_memory_line(r) for r in rows if r is not None and r.get("kind") == "attention_order"]
    return lines
