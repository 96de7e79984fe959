"""What can be measured: each kind of case builds npattn's callables (and torch's twins, same weights).

A kind is a ``Kind(build, flops)`` in ``KINDS``:

* ``build(dtype, torch, **params) -> Built``: the inputs and models (seeded, so a child process
  rebuilds exactly the same), npattn's zero-argument callables by label (one forward+backward,
  or one decoding run), torch's when ``torch`` is a module (``None``: npattn's side only; this
  is how a child process without torch builds it), and ``check()``: facts for the row from one
  call of each (the largest relative difference to torch, the same tokens, ...);
* ``flops(**params)``: the useful FLOPs of one call (for GFLOP/s and the time estimate).

A new kind is one function here (or in a module of its own, registered in ``KINDS``); its torch
twin goes into ``twins.py``.  The sizes to run are data in the sections (``timing.py`` ...).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from . import twins

__all__ = [
    "Built",
    "Kind",
    "Missing",
    "rel_diff",
    "attention_flops",
    "mha_flops",
    "encoder_flops",
    "SHORT",
    "attention",
    "attention_jvp",
    "mha",
    "encoder",
    "demo",
    "decode",
    "DELTA_RULES",
    "delta_rule",
    "KINDS",
]


class Built(NamedTuple):
    """A case ready to run: ``name`` and ``shape`` for the report, the callables, and ``check``."""

    name: str
    shape: dict
    npattn: dict
    torch: dict
    check: Callable[[], dict] | None = None


class Kind(NamedTuple):
    build: Callable[..., Built]
    flops: Callable[..., float]


class Missing(Exception):
    """The case does not exist in this npattn (no such core, or a core without the option)."""


def rel_diff(a, b):
    """max |a - b| / max |b| in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _inputs(dtype, *shapes):
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


# -- FLOP counts (useful multiply-adds x 2; a backward counts twice its forward) ----------------------
def attention_flops(b, h, lq, lk, e, ev, causal):
    """A causal attention counts only the visible (query, key) pairs, as FlashAttention's papers do."""
    pairs = sum(min(i + 1, lk) for i in range(lq)) if causal else lq * lk
    return 3 * 2 * b * h * pairs * (e + ev)


def mha_flops(b, L, d, h, causal=True):
    n = b * L
    projections = 2 * n * d * 3 * d + 2 * n * d * d
    return 3 * projections + attention_flops(b, h, L, L, d // h, d // h, causal)


def encoder_flops(b, L, d, h, d_ff=None, causal=True):
    d_ff = 4 * d if d_ff is None else d_ff
    return mha_flops(b, L, d, h, causal) + 3 * 2 * (2 * b * L * d * d_ff)


# -- attention cores ---------------------------------------------------------------------------------
SHORT = {"scaled_dot_product_attention": "sdpa", "memory_efficient_attention": "mem_eff"}


def attention(dtype, torch, *, b, h, L, E, causal=True, impl="scaled_dot_product_attention", window=None):
    """``impl`` (a ``npattn.functional`` attention core) forward+backward on ``(b, h, L, E)`` q, k, v
    (with ``window``, that option); torch's ``F.scaled_dot_product_attention`` (no window)."""
    from ... import functional as F

    if not hasattr(F, impl):
        raise Missing(impl)
    fwd, bwd = getattr(F, impl), getattr(F, impl + "_backward")
    q, k, v, dout = _inputs(dtype, *[(b, h, L, E)] * 4)
    opts: dict[str, Any] = {"is_causal": causal}
    if window is not None:
        opts["window"] = tuple(window)
    try:  # a tiny call: loads the code, and finds a core without the option
        fwd(q[..., :2, :], k[..., :2, :], v[..., :2, :], **opts)
    except TypeError as exc:
        if window is not None and "window" in str(exc):
            raise Missing(f"{impl}(window=...)") from None
        raise

    def run_np():
        out, cache = fwd(q, k, v, **opts)
        return out, bwd(dout, cache)

    shape = {"batch": b, "heads": h, "seq": L, "head_dim": E, "causal": causal}
    if window is not None:
        shape["window"] = list(window)
    fns, check = {}, None
    if torch is not None and window is None:  # pragma: needs torch
        fns["torch"], tq = twins.sdpa(torch, q, k, v, dout, causal)

        def check():
            out, (dq, _, _) = run_np()
            return {
                "max_rel_diff_vs_torch": max(
                    rel_diff(out, fns["torch"]().detach().numpy()), rel_diff(dq, tq.grad.numpy())
                )
            }

    return Built(SHORT.get(impl, impl), shape, {"npattn": run_np}, fns, check)


def _attention_flops(*, b, h, L, E, causal=True, impl=None, window=None):
    if window is None:
        return attention_flops(b, h, L, L, E, E, causal)
    left = L if window[0] < 0 else window[0]
    return 3 * 2 * b * h * L * min(L, left + 1) * 2 * E  # roughly: the band's pairs


def attention_jvp(dtype, torch, *, b, h, L, E, causal=True, impl="memory_efficient_attention", jvp=True):
    """Forward mode of ``impl``: its forward and ``impl_jvp`` along random tangents of q, k, v
    (``jvp=False``: the forward alone, the row to read it against).  torch's twin: its
    ``F.scaled_dot_product_attention`` forward for ``jvp=False``; none for the JVP (torch has no
    forward-mode derivative of its CPU attention kernels: ``torch.func.jvp`` raises)."""
    from ... import functional as F

    if not hasattr(F, impl + "_jvp"):
        raise Missing(impl + "_jvp")
    fwd, fjvp = getattr(F, impl), getattr(F, impl + "_jvp")
    q, k, v, tq, tk, tv = _inputs(dtype, *[(b, h, L, E)] * 6)

    def run_np():
        out, cache = fwd(q, k, v, is_causal=causal)
        return out, fjvp(cache, tq, tk, tv) if jvp else None

    name = SHORT.get(impl, impl) + (" jvp" if jvp else " fwd")
    shape = {"batch": b, "heads": h, "seq": L, "head_dim": E, "causal": causal}
    fns: dict = {}
    if torch is not None and not jvp:  # pragma: needs torch
        fns["torch"] = twins.sdpa_forward(torch, q, k, v, causal)
    return Built(name, shape, {"npattn": run_np}, fns)


def _attention_jvp_flops(*, b, h, L, E, causal=True, impl=None, jvp=True):
    """The forward's two GEMMs; the JVP's four more (tS from tq and tk, (P tS) v and P tv)."""
    return attention_flops(b, h, L, L, E, E, causal) * (1 if jvp else 1 / 3)


# -- modules ------------------------------------------------------------------------------------------
def _module(module, twin, x, dy, torch):
    """npattn's forward+backward of ``module`` on ``x``; torch's ``twin`` and the check."""

    def run_np():
        return module(x), module.backward(dy)

    torch_fns, check = ({}, None) if twin is None else _module_twin(run_np, twin, x, dy, torch)
    return {"npattn": run_np}, torch_fns, check


def _module_twin(run_np, twin, x, dy, torch):  # pragma: needs torch
    run_torch, tx = twins.module_step(torch, twin, x, dy)

    def check():
        out, dx = run_np()
        tout = run_torch()
        return {"max_rel_diff_vs_torch": max(rel_diff(out, tout.detach().numpy()), rel_diff(dx, tx.grad.numpy()))}

    return {"torch": run_torch}, check


def mha(dtype, torch, *, b, L, d, h, causal=True):
    """``MultiHeadAttention(d, d, h, causal=causal)`` forward+backward on ``(b, L, d)``; torch's fastest
    eager equivalent (one fused q/k/v ``nn.Linear``, ``F.scaled_dot_product_attention``, the output
    projection), same weights."""
    from ...nn.attention import MultiHeadAttention

    m = MultiHeadAttention(d, d, h, causal=causal, rng=0, dtype=dtype)
    x, dy = _inputs(dtype, (b, L, d), (b, L, d))
    npattn_fns, torch_fns, check = _module(m, torch and twins.mha(torch, m), x, dy, torch)
    return Built(
        "mha", {"batch": b, "seq": L, "d_model": d, "heads": h, "causal": causal}, npattn_fns, torch_fns, check
    )


def encoder(dtype, torch, *, b, L, d, h, d_ff=None, causal=True):
    """``EncoderBlock(d, h, d_ff, dropout=0, causal=causal, qkv_bias=True)`` (post-norm, ReLU)
    forward+backward; torch's ``nn.TransformerEncoderLayer`` with a causal mask, same weights."""
    from ...nn.transformer import EncoderBlock

    d_ff = 4 * d if d_ff is None else d_ff
    block = EncoderBlock(d, h, d_ff, dropout=0.0, causal=causal, qkv_bias=True, rng=0, dtype=dtype)
    x, dy = _inputs(dtype, (b, L, d), (b, L, d))
    npattn_fns, torch_fns, check = _module(block, torch and twins.encoder(torch, block, L), x, dy, torch)
    shape = {"batch": b, "seq": L, "d_model": d, "heads": h, "d_ff": d_ff, "causal": causal}
    return Built("encoder", shape, npattn_fns, torch_fns, check)


# -- the demo's model: one training step ---------------------------------------------------------------
def _demo_sizes(b, L, d, h, layers, d_ff):
    from ..demo import DemoConfig

    cfg = DemoConfig()
    return (
        cfg.batch_size if b is None else b,
        2 * cfg.n_digits if L is None else L,
        cfg.d_model if d is None else d,
        cfg.num_heads if h is None else h,
        cfg.num_layers if layers is None else layers,
        cfg.d_ff if d_ff is None else d_ff,
    )


def demo(dtype, torch, *, b=None, L=None, d=None, h=None, layers=None, d_ff=None):
    """One training step of ``npattn demo``'s ``TinyTransformer`` (its sizes unless given): forward,
    mean cross-entropy over the answer half of each sequence, backward; torch's equivalent
    (``nn.Embedding`` x 2, pre-norm ``nn.TransformerEncoderLayer`` blocks, ``nn.LayerNorm``,
    ``nn.Linear``, ``F.cross_entropy``) with the same weights."""
    from ...models import TinyTransformer
    from ..demo import IGNORE_INDEX, VOCAB_SIZE, DemoConfig

    b, L, d, h, layers, d_ff = _demo_sizes(b, L, d, h, layers, d_ff)
    model = TinyTransformer(
        VOCAB_SIZE, L, d, h, layers, d_ff, rng=np.random.default_rng(DemoConfig().seed), dtype=dtype
    )
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB_SIZE, (b, L))
    targets = rng.integers(0, VOCAB_SIZE, (b, L))
    targets[:, : L // 2] = IGNORE_INDEX  # the prompt half is not scored, as in the demo

    def run_np():
        loss, dlogits = model.loss(ids, targets, ignore_index=IGNORE_INDEX)
        model.backward(dlogits)
        return loss

    shape = {"batch": b, "seq": L, "d_model": d, "heads": h, "d_ff": d_ff, "layers": layers, "vocab": VOCAB_SIZE}
    torch_fns, check = ({}, None) if torch is None else _demo_twin(torch, model, run_np, ids, targets)
    return Built("demo", shape, {"npattn": run_np}, torch_fns, check)


def _demo_twin(torch, model, run_np, ids, targets):  # pragma: needs torch
    from ..demo import IGNORE_INDEX

    tm = twins.demo(torch, model, ids.shape[-1])
    run_torch = twins.demo_step(torch, tm, ids, targets, IGNORE_INDEX)

    def check():
        model.zero_grad()
        loss, tloss = run_np(), run_torch()
        return {
            "max_rel_diff_vs_torch": max(
                rel_diff(loss, tloss.item()),
                rel_diff(model.head.weight.grad, tm.head.weight.grad.numpy()),
                rel_diff(model.tok_emb.weight.grad, tm.tok.weight.grad.numpy()),
            )
        }

    return {"torch": run_torch}, check


def _demo_flops(*, b=None, L=None, d=None, h=None, layers=None, d_ff=None):
    from ..demo import VOCAB_SIZE

    b, L, d, h, layers, d_ff = _demo_sizes(b, L, d, h, layers, d_ff)
    return layers * encoder_flops(b, L, d, h, d_ff, True) + 3 * 2 * b * L * d * VOCAB_SIZE


# -- greedy decoding of the book's GPT ------------------------------------------------------------------
def decode(dtype, torch, *, cfg, prompt_len=16, batch=1):
    """Greedy decoding of ``npattn.book.GPTModel(cfg)`` from a ``prompt_len``-token prompt to the full
    context, with the KV cache and without (every step re-encodes the sequence); torch's eager book
    model (no cache), same weights.  ``check``: whether each run gives the cached run's tokens."""
    from ...book import GPTModel, generate

    ctx = cfg["context_length"]
    new = ctx - prompt_len
    model = GPTModel(cfg, rng=0, dtype=dtype)
    prompt = np.random.default_rng(0).integers(0, cfg["vocab_size"], (batch, prompt_len))

    def run_np(use_cache):
        return lambda: generate(model, prompt, new, ctx, use_cache=use_cache)

    fns = {"npattn, KV cache": run_np(True), "npattn, no cache": run_np(False)}
    torch_fns = {}
    if torch is not None:  # pragma: needs torch
        torch_fns["torch eager, no cache"] = twins.book_gpt_greedy(torch, cfg, model.state_dict(), prompt, new)

    def check():
        want = fns["npattn, KV cache"]()
        return {"same_tokens": {k: bool(np.array_equal(f(), want)) for k, f in {**fns, **torch_fns}.items()}}

    shape = {"batch": batch, "prompt": prompt_len, "new_tokens": new, **cfg}
    return Built("decode", shape, fns, torch_fns, check)


def _decode_flops(*, cfg, prompt_len=16, batch=1):
    """Roughly: the no-cache run re-encodes every prefix (2 FLOPs per weight and token)."""
    d, n = cfg["emb_dim"], cfg["n_layers"]
    weights = n * 12 * d * d + d * cfg["vocab_size"]
    ctx = cfg["context_length"]
    return 2 * batch * weights * sum(range(prompt_len, ctx))


# -- decoding with multi-head latent attention: its own module (latent.py), loaded when used ------------
def _mla_decode(dtype, torch, **params):
    from .latent import mla_decode

    return mla_decode(dtype, torch, **params)


def _mla_decode_flops(**params):
    from .latent import mla_decode_flops

    return mla_decode_flops(**params)


# -- the delta rules (Qwen3-Next's gated DeltaNet, Kimi Linear's KDA) ----------------------------------
# per rule: whether the decay is per key channel (else a scalar per step) and npattn's chunk size
# (each rule's fastest here: KDA's pairwise decays cost C * Dk numbers per step)
DELTA_RULES = {"gated_delta_rule": (False, 64), "kimi_delta_attention": (True, 16)}


def delta_rule(
    dtype,
    torch,
    *,
    b,
    h,
    L,
    D,
    rule="gated_delta_rule",
    impls=("chunked", "recurrence"),
    chunk_size=None,
    with_torch=True,
):
    """``rule`` forward+backward with ``use_qk_l2norm`` (as Qwen3-Next and Kimi Linear) on ``(b, h,
    L, D)`` q, k, v (``D = Dk = Dv``): ``"gated_delta_rule"`` (a log decay ``g (b, h, L)`` per step)
    or ``"kimi_delta_attention"`` (``g (b, h, L, D)``, one per key channel), for each of ``impls``:
    ``"chunked"`` (``npattn.functional``, work linear in L, chunks of ``chunk_size``, default the
    rule's in ``DELTA_RULES``) and ``"recurrence"`` (``npattn.functional.reference``, one step at a
    time); torch's twin: transformers' own torch implementation with autograd
    (``twins.delta_rule``, when transformers is importable and ``with_torch``).  ``check``: the
    largest relative difference of each output to the chunked one's."""
    from ... import functional as F
    from ...functional import reference as R

    per_channel, default_chunk = DELTA_RULES[rule]
    q, k, v, dout = _inputs(dtype, *([(b, h, L, D)] * 4))
    rng = np.random.default_rng(1)
    g_shape = (b, h, L, D) if per_channel else (b, h, L)
    g = (-np.logaddexp(0.0, rng.standard_normal(g_shape))).astype(dtype)  # log decays <= 0
    beta = (1.0 / (1.0 + np.exp(-rng.standard_normal((b, h, L))))).astype(dtype)
    pairs = {
        "chunked": (getattr(F, rule), getattr(F, f"{rule}_backward"), {"chunk_size": chunk_size or default_chunk}),
        "recurrence": (getattr(R, rule), getattr(R, f"{rule}_backward"), {}),
    }

    def step(impl):
        forward, backward, kw = pairs[impl]

        def run():
            out, cache = forward(q, k, v, g, beta, use_qk_l2norm=True, **kw)
            backward(dout, cache)
            return out

        return run

    fns = {impl: step(impl) for impl in impls}
    torch_fns = {}
    if torch is not None and with_torch:  # pragma: needs torch
        run = twins.delta_rule(torch, rule, q, k, v, g, beta, dout)
        if run is not None:
            torch_fns["torch"] = run

    def check():
        want = step("chunked")()
        return {"max_rel_diff": {name: rel_diff(f(), want) for name, f in {**fns, **torch_fns}.items()}}

    return Built(rule, {"b": b, "h": h, "L": L, "D": D}, fns, torch_fns, check)


def _delta_rule_flops(*, b, h, L, D, **_):
    """The recurrence's useful work: per step and head ``S^T k``, the rank-1 write and ``S^T q``
    (``3 D^2`` multiply-adds), a backward twice that (either rule: KDA's per-channel decay is one
    more scaling of the state's rows)."""
    return 3 * 2 * b * h * L * 3 * D * D


def _prefill(dtype, torch, **params):
    """A large model's prefill (``decode_large.prefill_case``), npattn's side alone."""
    from .decode_large import prefill_case

    return prefill_case(dtype, torch, **params)


KINDS = {
    "attention": Kind(attention, _attention_flops),
    "attention_jvp": Kind(attention_jvp, _attention_jvp_flops),
    "mha": Kind(mha, mha_flops),
    "encoder": Kind(encoder, encoder_flops),
    "demo": Kind(demo, _demo_flops),
    "decode": Kind(decode, _decode_flops),
    "delta_rule": Kind(delta_rule, _delta_rule_flops),
    "mla_decode": Kind(_mla_decode, _mla_decode_flops),
    "prefill": Kind(_prefill, lambda **_: 0.0),  # decode_large's paired prefill (its own report)
}
