"""Modules, torch-style: ``y = m(x)``, ``dx = m.backward(dy)``, parameter gradients added into ``p.grad``.

Thin layers over ``npattn.functional``, each composing its submodules.
"""

from .attention import MultiHeadAttention
from .containers import ModuleList, ParallelSum, Sequential
from .delta_net import GatedDeltaNet
from .kimi_delta import KimiDeltaAttention
from .latent_attention import MultiHeadLatentAttention
from .layers import Dropout, Embedding, FeedForward, LayerNorm, Linear, RMSNorm
from .mamba2 import Mamba2Mixer
from .module import Module, Parameter, is_grad_enabled, no_grad
from .moe import Experts, GatedMLP, GptOssExperts, MoE, PlainExperts, SparseMoeBlock, TopKRouter
from .short_conv import ShortConv
from .transformer import DecoderBlock, EncoderBlock

__all__ = [
    "Module",
    "ModuleList",
    "ParallelSum",
    "Sequential",
    "Parameter",
    "no_grad",
    "is_grad_enabled",
    "Linear",
    "LayerNorm",
    "RMSNorm",
    "Dropout",
    "Embedding",
    "FeedForward",
    "MultiHeadAttention",
    "GatedDeltaNet",
    "KimiDeltaAttention",
    "ShortConv",
    "Mamba2Mixer",
    "MultiHeadLatentAttention",
    "TopKRouter",
    "Experts",
    "GptOssExperts",
    "PlainExperts",
    "GatedMLP",
    "SparseMoeBlock",
    "MoE",
    "EncoderBlock",
    "DecoderBlock",
]
