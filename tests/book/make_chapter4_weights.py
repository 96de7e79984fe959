"""Regenerate ``npattn/data/chapter4.npz`` (read by ``npattn.data.load``; run by hand; needs torch):

    python tests/book/make_chapter4_weights.py

Builds the chapter-4 ``GPTModel`` of ``chapter4_torch.py`` at two tiny configurations from
``torch.manual_seed(123)`` (construction order as in the book), converts it to float64 and
stores, for each configuration ``<c>`` (``tiny``: ``qkv_bias=False``; ``bias``: ``qkv_bias=True``):

* ``<c>.sd.<state_dict key>``  the weights and ``mask`` buffers (float64 copies of the float32 init)
* ``<c>.idx``                  int64 token ids (batch 2)
* ``<c>.logits``               the float64 logits of ``idx`` in eval mode
* ``<c>.dlogits``              a random upstream gradient (seed 7)
* ``<c>.grad.<parameter>``     every parameter's gradient of ``sum(logits * dlogits)``
* ``<c>.greedy``               ``generate_text_simple(model, idx[:1], 6, context_length)``

and ``<c>.cfg`` (the config values in ``CFG_KEYS`` order).  So ``tests/test_gpt_book.py`` checks
the NumPy port without torch.
"""

import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from chapter4_torch import GPTModel, generate_text_simple  # noqa: E402

OUT_PATH = os.path.join(HERE, "..", "..", "npattn", "data", "chapter4.npz")
CFG_KEYS = ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "drop_rate", "qkv_bias")
CONFIGS = {
    "tiny": {
        "vocab_size": 31,
        "context_length": 8,
        "emb_dim": 12,
        "n_heads": 3,
        "n_layers": 2,
        "drop_rate": 0.1,
        "qkv_bias": False,
    },
    "bias": {
        "vocab_size": 23,
        "context_length": 6,
        "emb_dim": 8,
        "n_heads": 2,
        "n_layers": 3,
        "drop_rate": 0.0,
        "qkv_bias": True,
    },
}


def main():
    arrays = {}
    for name, cfg in CONFIGS.items():
        torch.manual_seed(123)
        model = GPTModel(cfg).double().eval()
        for key, value in model.state_dict().items():
            arrays[f"{name}.sd.{key}"] = value.detach().numpy().copy()
        g = torch.Generator().manual_seed(7)
        idx = torch.randint(0, cfg["vocab_size"], (2, cfg["context_length"] - 1), generator=g)
        logits = model(idx)
        dlogits = torch.randn(logits.shape, generator=g, dtype=torch.float64)
        (logits * dlogits).sum().backward()
        arrays[f"{name}.idx"] = idx.numpy()
        arrays[f"{name}.logits"] = logits.detach().numpy()
        arrays[f"{name}.dlogits"] = dlogits.numpy()
        for key, p in model.named_parameters():
            arrays[f"{name}.grad.{key}"] = p.grad.numpy().copy()
        arrays[f"{name}.greedy"] = generate_text_simple(model, idx[:1, :3], 6, cfg["context_length"]).numpy()
        arrays[f"{name}.cfg"] = np.array([float(cfg[k]) for k in CFG_KEYS])
    np.savez_compressed(OUT_PATH, **arrays)
    print(f"wrote {OUT_PATH} ({len(arrays)} arrays, {os.path.getsize(OUT_PATH)} bytes)")


if __name__ == "__main__":
    main()
