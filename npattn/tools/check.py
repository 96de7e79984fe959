"""``npattn check``: ``npattn.gradcheck`` over every module and functional op, as a table.

Every hand-written backward is compared with central finite differences in float64, at small
sizes, with a random upstream gradient (``--seed`` picks the inputs and that gradient).  One
table row per case gives the worst absolute and relative error over all checked tensors of the
case (inputs and parameters); a failing case is followed by its full per-tensor report.  The
exit code is 1 when any case fails (or raises), else 0.
"""
from __future__ import annotations

import time

import numpy as np

__all__ = ["cases", "run", "main"]


def cases(seed: int = 0):
    """``[(name, thunk)]``: each thunk runs one ``gradcheck`` and returns its report."""
    from .. import functional as F
    from ..nn.attention import MultiHeadAttention
    from ..book import (CausalAttention, MultiHeadAttentionWrapper, SelfAttention_v1, SelfAttention_v2)
    from ..book import MultiHeadAttention as BookMultiHeadAttention
    from ..testing.gradcheck import gradcheck
    from ..nn.layers import Dropout, Embedding, FeedForward, LayerNorm, Linear
    from ..models import TinyTransformer
    from ..nn.transformer import EncoderBlock

    rng = np.random.default_rng(seed)

    def randn(*shape):
        return rng.standard_normal(shape)

    def check(target, *inputs, **kwargs):
        return lambda: gradcheck(target, *inputs, seed=seed, **kwargs)

    b, L, d = 2, 4, 6
    x = randn(b, L, d)
    q, k, v = randn(b, 2, 3, 4), randn(b, 2, 5, 4), randn(b, 2, 5, 3)
    q4 = randn(b, 4, 3, 4)  # 4 query heads over the 2 kv heads of k, v
    qs, ks, vs = randn(b, 2, 5, 4), randn(b, 2, 5, 4), randn(b, 2, 5, 3)  # square, for causal
    bool_mask = rng.random((b, 1, 3, 5)) < 0.7
    bool_mask[..., 0] = True
    bool_mask[0, 0, 1] = False  # one fully masked query row: output 0, gradient 0
    float_mask = randn(3, 5)
    kpm = np.zeros((b, L), dtype=bool)
    kpm[1, -1] = True
    attn_mask = ~np.triu(np.ones((L, L), dtype=bool), k=1)

    out = [
        # -- functional ops --------------------------------------------------------------------
        ("linear", check(F.linear, x, randn(5, d), randn(5))),
        ("linear (no bias)", check(F.linear, x, randn(5, d))),
        ("embedding", check(F.embedding, rng.integers(0, 7, (b, L)), randn(7, d))),
        ("softmax (last axis)", check(F.softmax, x)),
        ("softmax (axis=1)", check(F.softmax, x, axis=1)),
        ("relu", check(F.relu, x)),
        ("gelu (erf)", check(F.gelu, x)),
        ("gelu (tanh)", check(F.gelu, x, approximate="tanh")),
        ("dropout (p=0.3, fixed rng)", check(F.dropout, x, 0.3, np.random.default_rng(seed))),
        ("layer_norm", check(F.layer_norm, x, 1 + 0.1 * randn(d), randn(d))),
        ("layer_norm (no affine)", check(F.layer_norm, x)),
        ("cross_entropy", check(F.cross_entropy, randn(b, L, 5), rng.integers(0, 5, (b, L)))),
        ("cross_entropy (ignore_index)",
         check(F.cross_entropy, randn(b, L, 5), np.where(rng.random((b, L)) < 0.3, -100, rng.integers(0, 5, (b, L))),
               ignore_index=-100)),
        ("sdpa", check(F.scaled_dot_product_attention, q, k, v)),
        ("sdpa (no head axis)", check(F.scaled_dot_product_attention, randn(b, 3, 4), randn(b, 5, 4), randn(b, 5, 3))),
        ("sdpa (causal)", check(F.scaled_dot_product_attention, qs, ks, vs, is_causal=True)),
        ("sdpa (causal, Lq < Lk)", check(F.scaled_dot_product_attention, q, k, v, is_causal=True)),
        ("sdpa (bool mask, empty row)", check(F.scaled_dot_product_attention, q, k, v, attn_mask=bool_mask)),
        ("sdpa (float mask)", check(F.scaled_dot_product_attention, q, k, v, attn_mask=float_mask)),
        ("sdpa (scale=0.3)", check(F.scaled_dot_product_attention, q, k, v, scale=0.3)),
        ("sdpa (GQA)", check(F.scaled_dot_product_attention, q4, k, v, enable_gqa=True)),
        ("sdpa (GQA, causal)", check(F.scaled_dot_product_attention, q4, k, v, enable_gqa=True, is_causal=True)),
        ("sdpa (dropout, fixed rng)",
         check(F.scaled_dot_product_attention, q, k, v, dropout_p=0.3, rng=np.random.default_rng(seed))),
    ]
    if hasattr(F, "memory_efficient_attention"):
        out += [
            ("memory_efficient_attention", check(F.memory_efficient_attention, q, k, v, block_size=2)),
            ("memory_efficient_attention (causal)",
             check(F.memory_efficient_attention, qs, ks, vs, is_causal=True, block_size=2)),
            ("memory_efficient_attention (bool mask)",
             check(F.memory_efficient_attention, q, k, v, attn_mask=bool_mask, block_size=2)),
            ("memory_efficient_attention (float mask)",
             check(F.memory_efficient_attention, q, k, v, attn_mask=float_mask, block_size=3)),
        ]

    # -- modules -----------------------------------------------------------------------------
    r = seed  # module initialisation seed
    out += [
        ("Linear", check(Linear(d, 5, rng=r), x)),
        ("Linear (no bias)", check(Linear(d, 5, bias=False, rng=r), x)),
        ("LayerNorm", check(LayerNorm(d), x)),
        ("Dropout (p=0.3, fixed rng)", check(Dropout(0.3, rng=r), x)),
        ("Embedding", check(Embedding(7, d, rng=r), rng.integers(0, 7, (b, L)))),
    ]
    for act in ("relu", "gelu", "gelu_tanh"):
        out.append((f"FeedForward ({act})", check(FeedForward(d, 8, activation=act, rng=r), x)))
    xc, kc, vc = randn(b, 5, 4), randn(b, 5, 3), randn(b, 5, 3)
    out += [
        ("MultiHeadAttention (self)", check(MultiHeadAttention(d, d, 2, rng=r), x)),
        ("MultiHeadAttention (qkv_bias)", check(MultiHeadAttention(d, d, 2, qkv_bias=True, rng=r), x)),
        ("MultiHeadAttention (cross, kdim/vdim)",
         check(MultiHeadAttention(d, d, 2, kdim=3, vdim=3, rng=r), x, kc, vc)),
        ("MultiHeadAttention (cross, same dims)", check(MultiHeadAttention(4, 6, 2, rng=r), randn(b, L, 4), xc, xc)),
        ("MultiHeadAttention (GQA)", check(MultiHeadAttention(8, 8, 4, num_kv_heads=2, rng=r), randn(b, L, 8))),
        ("MultiHeadAttention (masks)",
         check(MultiHeadAttention(d, d, 2, rng=r), x, attn_mask=attn_mask, key_padding_mask=kpm)),
        ("MultiHeadAttention (causal)", check(MultiHeadAttention(d, d, 2, causal=True, rng=r), x)),
        ("MultiHeadAttention (dropout)", check(MultiHeadAttention(d, d, 2, dropout=0.2, rng=r), x)),
        ("MultiHeadAttention (memory_efficient)",
         check(MultiHeadAttention(d, d, 2, causal=True, memory_efficient=True, rng=r), x)),
        ("EncoderBlock (post-norm)", check(EncoderBlock(d, 2, 8, dropout=0.0, rng=r), x)),
        ("EncoderBlock (pre-norm, causal)",
         check(EncoderBlock(d, 2, 8, dropout=0.0, norm_first=True, causal=True, rng=r), x)),
        ("EncoderBlock (dropout, gelu)", check(EncoderBlock(d, 2, 8, dropout=0.2, activation="gelu", rng=r), x)),
        ("EncoderBlock (key_padding_mask)", check(EncoderBlock(d, 2, 8, dropout=0.0, rng=r), x, key_padding_mask=kpm)),
        ("book.SelfAttention_v1", check(SelfAttention_v1(d, 4, rng=r), x)),
        ("book.SelfAttention_v2", check(SelfAttention_v2(d, 4, rng=r), x)),
        ("book.CausalAttention", check(CausalAttention(d, 4, L, 0.2, rng=r), x)),
        ("book.MultiHeadAttentionWrapper", check(MultiHeadAttentionWrapper(d, 2, L, 0.0, 2, rng=r), x)),
        ("book.MultiHeadAttention", check(BookMultiHeadAttention(d, d, L, 0.0, 2, rng=r), x)),
        ("book.MultiHeadAttention (2-d input)", check(BookMultiHeadAttention(d, d, L, 0.0, 2, rng=r), x[0])),
        ("TinyTransformer", check(TinyTransformer(5, 6, 8, 2, 2, 12, rng=r), rng.integers(0, 5, (b, 5)))),
    ]
    return out


def _fmt_row(cells, widths):
    return " | ".join([cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:3], widths[1:3])]
                      + [cells[3].ljust(widths[3])]).rstrip()


def run(seed: int = 0, printer=print) -> bool:
    """Run every case, print the table; True when all pass."""
    start = time.perf_counter()
    results = []  # (name, abs, rel, ok, report_or_error)
    for name, thunk in cases(seed):
        try:
            report = thunk()
        except Exception as e:  # a crash is a failure, reported in the table
            results.append((name, float("nan"), float("nan"), False, f"{type(e).__name__}: {e}"))
            continue
        results.append((name, max(r.max_abs_err for r in report.rows), max(r.max_rel_err for r in report.rows),
                        report.ok, report))
    head = ("name", "max abs err", "max rel err", "ok")
    body = [(n, f"{a:.2e}", f"{r:.2e}", "yes" if ok else "NO") for n, a, r, ok, _ in results]
    widths = [max(len(row[i]) for row in [head] + body) for i in range(4)]
    printer("gradcheck: hand-written backward vs central differences (float64; errors over inputs and parameters)")
    printer(_fmt_row(head, widths))
    printer("-+-".join("-" * w for w in widths))
    for row in body:
        printer(_fmt_row(row, widths))
    failed = [(n, detail) for n, _, _, ok, detail in results if not ok]
    for name, detail in failed:
        printer(f"\n{name}:\n{detail}")
    printer(f"\n{len(results) - len(failed)}/{len(results)} cases passed "
            f"(float64 central differences, seed {seed}) in {time.perf_counter() - start:.1f} s")
    return not failed


def main(args) -> int:
    return 0 if run(getattr(args, "seed", 0)) else 1
