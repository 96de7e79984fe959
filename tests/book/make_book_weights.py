"""Regenerate ``npattn/data/chapter3.npz`` (read by ``npattn.data.load``; run by hand; needs torch):

    python tests/book/make_book_weights.py

Reproduces the seeded constructions of chapter 3 of *Build a Large Language
Model (From Scratch)* (rasbt/LLMs-from-scratch, ch03/01_main-chapter-code/
ch03.ipynb) with the reference classes in ``chapter3_torch.py``, asserts that
the numbers printed in the chapter come out (atol 5e-5), and stores, as the
float32 arrays torch produced:

* ``inputs``                      the 6x3 "Your journey starts with one step" embeddings
* ``manual.W_query/W_key/W_value`` the section-3.4.1 stand-alone (3, 2) matrices
* ``<prefix>.<state_dict key>``   weights/buffers of every chapter object
* ``out.<prefix>``                each object's output (v1/v2 on ``inputs``,
                                   the others on ``batch = stack((inputs, inputs))``)
* ``out.simple``                  section-3.3.2 context vectors without weights
                                   (``softmax(inputs @ inputs.T) @ inputs``)
* ``out.manual``                  section-3.4.1 ``context_vec_2`` (shape (2,))

Seeds and construction order (each one as in the notebook, no extra random
draws in between are needed -- every object gets a fresh ``manual_seed``):

* ``manual``: ``manual_seed(123)``; ``torch.rand(3, 2)`` three times in the order
  query, key, value  -> ``query_2 = [0.4306, 1.4551]``, ``context_vec_2 = [0.3061, 0.8210]``
* ``sa_v1``: ``manual_seed(123)``; ``SelfAttention_v1(3, 2)`` (same draws as
  ``manual``, so identical weights)          -> first row ``[0.2996, 0.8053]``
* ``sa_v2``: ``manual_seed(789)``; ``SelfAttention_v2(3, 2)`` -> first row ``[-0.0739, 0.0713]``
* ``ca``:    ``manual_seed(123)``; ``CausalAttention(3, 2, 6, 0.0)`` -> ``[-0.4519, 0.2216]``
* ``mhaw``:  ``manual_seed(123)``; ``MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)``
  (head 0 equals ``ca``)                     -> ``[-0.4519, 0.2216, 0.4772, 0.1063]``
* ``mha``:   ``manual_seed(123)``; ``MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)``
                                             -> ``[0.3190, 0.4858]``

(The Dropout-only cells of section 3.5.2 use ``manual_seed(123)`` too, but they
create no parameters and happen after the objects above are seeded anew, so
they do not influence anything stored here.)
"""

import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from chapter3_torch import (  # noqa: E402  (standalone import, see docstring)
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
)

ATOL = 5e-5
OUT_PATH = os.path.join(HERE, "..", "..", "npattn", "data", "chapter3.npz")


def check(name, got, expected):
    got = got.detach().cpu().numpy()
    expected = np.asarray(expected, dtype=np.float32)
    print(f"{name:<34s} {np.array2string(got, precision=4)}")
    assert np.allclose(got, expected, atol=ATOL, rtol=0), (name, got, expected)


def f32(t):
    a = t.detach().cpu().numpy()
    assert a.dtype == np.float32, a.dtype
    return a


def main():
    torch.set_grad_enabled(False)
    arrays = {}

    inputs = torch.tensor(
        [
            [0.43, 0.15, 0.89],  # Your     (x^1)
            [0.55, 0.87, 0.66],  # journey  (x^2)
            [0.57, 0.85, 0.64],  # starts   (x^3)
            [0.22, 0.58, 0.33],  # with     (x^4)
            [0.77, 0.25, 0.10],  # one      (x^5)
            [0.05, 0.80, 0.55],
        ]  # step     (x^6)
    )
    arrays["inputs"] = f32(inputs)
    d_in, d_out = inputs.shape[1], 2

    # -- 3.3.1 / 3.3.2: attention without trainable weights ------------------
    query = inputs[1]
    attn_scores_2 = inputs @ query
    check("scores(journey)", attn_scores_2, [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865])
    attn_weights_2 = torch.softmax(attn_scores_2, dim=0)
    check("softmax weights(journey)", attn_weights_2, [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581])
    context_vec_2 = attn_weights_2 @ inputs
    check("context_vec(journey)", context_vec_2, [0.4419, 0.6515, 0.5683])
    all_context = torch.softmax(inputs @ inputs.T, dim=-1) @ inputs
    check("all context vecs, row 2", all_context[1], [0.4419, 0.6515, 0.5683])
    arrays["out.simple"] = f32(all_context)

    # -- 3.4.1: stand-alone weight matrices, seed 123 ------------------------
    torch.manual_seed(123)
    W_query = torch.rand(d_in, d_out)
    W_key = torch.rand(d_in, d_out)
    W_value = torch.rand(d_in, d_out)
    arrays["manual.W_query"] = f32(W_query)
    arrays["manual.W_key"] = f32(W_key)
    arrays["manual.W_value"] = f32(W_value)
    query_2 = inputs[1] @ W_query
    check("manual query_2", query_2, [0.4306, 1.4551])
    keys = inputs @ W_key
    values = inputs @ W_value
    check("manual attn_score_22", query_2 @ keys[1], 1.8524)
    w2 = torch.softmax((query_2 @ keys.T) / keys.shape[-1] ** 0.5, dim=-1)
    manual_context_vec_2 = w2 @ values
    check("manual context_vec_2", manual_context_vec_2, [0.3061, 0.8210])
    arrays["out.manual"] = f32(manual_context_vec_2)

    batch = torch.stack((inputs, inputs), dim=0)
    context_length = batch.shape[1]

    # -- the chapter's objects ------------------------------------------------
    def export(prefix, module, x, first_row):
        module.eval()  # dropout is 0.0 anyway
        for key, value in module.state_dict().items():
            arrays[f"{prefix}.{key}"] = f32(value)
        out = module(x)
        row = out[0] if out.dim() == 2 else out[0, 0]
        check(f"{prefix} first output row", row, first_row)
        arrays[f"out.{prefix}"] = f32(out)
        return out

    torch.manual_seed(123)
    sa_v1 = SelfAttention_v1(d_in, d_out)
    assert torch.equal(sa_v1.W_query, W_query) and torch.equal(sa_v1.W_value, W_value)
    out = export("sa_v1", sa_v1, inputs, [0.2996, 0.8053])
    check("sa_v1 row 2 (= context_vec_2)", out[1], [0.3061, 0.8210])

    torch.manual_seed(789)
    sa_v2 = SelfAttention_v2(d_in, d_out)
    export("sa_v2", sa_v2, inputs, [-0.0739, 0.0713])

    torch.manual_seed(123)
    ca = CausalAttention(d_in, d_out, context_length, 0.0)
    out = export("ca", ca, batch, [-0.4519, 0.2216])
    check("ca last row", out[1, -1], [-0.5299, -0.1081])

    torch.manual_seed(123)
    mhaw = MultiHeadAttentionWrapper(d_in, d_out, context_length, 0.0, num_heads=2)
    out = export("mhaw", mhaw, batch, [-0.4519, 0.2216, 0.4772, 0.1063])
    check("mhaw last row", out[1, -1], [-0.5299, -0.1081, 0.5077, 0.3493])

    torch.manual_seed(123)
    mha = MultiHeadAttention(d_in, d_out, context_length, 0.0, num_heads=2)
    out = export("mha", mha, batch, [0.3190, 0.4858])
    check("mha last row", out[1, -1], [0.2575, 0.4028])

    for key, value in arrays.items():
        assert value.dtype == np.float32, key
    np.savez(OUT_PATH, **arrays)
    print(f"\nwrote {OUT_PATH} ({len(arrays)} arrays):")
    for key in sorted(arrays):
        print(f"  {key:<28s} {arrays[key].shape}")


if __name__ == "__main__":
    main()
