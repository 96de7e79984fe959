"""PyTorch reference of the chapter-4 GPT of Sebastian Raschka, *Build a Large Language Model
(From Scratch)* (rasbt/LLMs-from-scratch, ch04/01_main-chapter-code).

The oracle ``npattn.book.GPTModel`` is tested against.  Written for this project from the book's
published architecture; what the tests rely on is reproduced:

* the class names and the config dict (``vocab_size``, ``context_length``, ``emb_dim``,
  ``n_heads``, ``n_layers``, ``drop_rate``, ``qkv_bias``);
* the module names, hence the ``state_dict`` keys: ``tok_emb``, ``pos_emb``, ``drop_emb``,
  ``trf_blocks`` (an ``nn.Sequential``), in each block ``att`` (chapter 3's
  ``MultiHeadAttention``), ``ff.layers`` (``Linear, GELU, Linear``), ``norm1``, ``norm2``
  (``scale``/``shift``), ``drop_shortcut``; ``final_norm``; ``out_head`` (no bias);
* the construction order of the parameters (so a ``torch.manual_seed`` gives the book's weights);
* the forward: pre-norm blocks with two shortcut connections, tanh GELU, layer norm with biased
  variance and ``eps = 1e-5``.

Imports torch at import time; load it standalone (it imports ``chapter3_torch`` from this folder).
"""

import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chapter3_torch import MultiHeadAttention  # noqa: E402

__all__ = ["LayerNorm", "GELU", "FeedForward", "TransformerBlock", "GPTModel", "generate_text_simple", "generate"]


class LayerNorm(nn.Module):
    def __init__(self, emb_dim):
        super().__init__()
        self.eps = 1e-5
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)
        return self.scale * ((x - mean) / torch.sqrt(var + self.eps)) + self.shift


class GELU(nn.Module):
    def forward(self, x):
        c = torch.sqrt(torch.tensor(2.0 / torch.pi, dtype=x.dtype))
        return 0.5 * x * (1 + torch.tanh(c * (x + 0.044715 * torch.pow(x, 3))))


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg["emb_dim"]
        self.layers = nn.Sequential(nn.Linear(d, 4 * d), GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return self.layers(x)


class TransformerBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.att = MultiHeadAttention(
            d_in=cfg["emb_dim"],
            d_out=cfg["emb_dim"],
            context_length=cfg["context_length"],
            num_heads=cfg["n_heads"],
            dropout=cfg["drop_rate"],
            qkv_bias=cfg["qkv_bias"],
        )
        self.ff = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg["emb_dim"])
        self.norm2 = LayerNorm(cfg["emb_dim"])
        self.drop_shortcut = nn.Dropout(cfg["drop_rate"])

    def forward(self, x):
        shortcut = x
        x = self.drop_shortcut(self.att(self.norm1(x)))
        x = x + shortcut
        shortcut = x
        x = self.drop_shortcut(self.ff(self.norm2(x)))
        return x + shortcut


class GPTModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
        self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"])
        self.drop_emb = nn.Dropout(cfg["drop_rate"])
        self.trf_blocks = nn.Sequential(*[TransformerBlock(cfg) for _ in range(cfg["n_layers"])])
        self.final_norm = LayerNorm(cfg["emb_dim"])
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)

    def forward(self, in_idx):
        batch_size, seq_len = in_idx.shape
        tok_embeds = self.tok_emb(in_idx)
        pos_embeds = self.pos_emb(torch.arange(seq_len, device=in_idx.device))
        x = self.drop_emb(tok_embeds + pos_embeds)
        x = self.trf_blocks(x)
        return self.out_head(self.final_norm(x))


def generate_text_simple(model, idx, max_new_tokens, context_size):
    """Chapter 4: greedy decoding from the last ``context_size`` tokens."""
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(idx[:, -context_size:])[:, -1, :]
        idx = torch.cat((idx, torch.argmax(logits, dim=-1, keepdim=True)), dim=1)
    return idx


def generate(model, idx, max_new_tokens, context_size, temperature=0.0, top_k=None, eos_id=None):
    """Chapter 5: top-k, temperature and an end-of-sequence id (a batch of one for ``eos_id``)."""
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(idx[:, -context_size:])[:, -1, :]
        if top_k is not None:
            top_logits, _ = torch.topk(logits, top_k)
            logits = torch.where(logits < top_logits[:, -1:], torch.tensor(float("-inf")), logits)
        if temperature > 0.0:
            idx_next = torch.multinomial(torch.softmax(logits / temperature, dim=-1), num_samples=1)
        else:
            idx_next = torch.argmax(logits, dim=-1, keepdim=True)
        if eos_id is not None and idx_next.item() == eos_id:
            break
        idx = torch.cat((idx, idx_next), dim=1)
    return idx
