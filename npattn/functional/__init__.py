"""The pure core: every op is a pair ``op(...) -> (out, cache)`` and ``op_backward(dout, cache)``.

No hidden state: the cache is an ordinary object holding what the backward needs, and each
backward sits directly under its forward, its docstring deriving it.
"""

from .activation import (
    dropout,
    dropout_backward,
    gelu,
    gelu_backward,
    relu,
    relu_backward,
    silu,
    silu_backward,
    softmax,
    softmax_backward,
)
from .conv import causal_conv1d, causal_conv1d_backward
from .delta_rule import (
    gated_delta_rule,
    gated_delta_rule_backward,
    l2_norm,
    l2_norm_backward,
    rms_norm_gated,
    rms_norm_gated_backward,
)
from .attention import AttentionCache, scaled_dot_product_attention, scaled_dot_product_attention_backward
from .embedding import embedding, embedding_backward
from .linear import linear, linear_backward
from .loss import cross_entropy, cross_entropy_backward
from .memory_efficient import memory_efficient_attention, memory_efficient_attention_backward
from .norm import layer_norm, layer_norm_backward, rms_norm, rms_norm_backward
from .rope import rope, rope_backward

__all__ = [
    "linear",
    "linear_backward",
    "embedding",
    "embedding_backward",
    "softmax",
    "softmax_backward",
    "relu",
    "relu_backward",
    "gelu",
    "gelu_backward",
    "silu",
    "silu_backward",
    "dropout",
    "dropout_backward",
    "layer_norm",
    "layer_norm_backward",
    "rms_norm",
    "rms_norm_backward",
    "rope",
    "rope_backward",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "AttentionCache",
    "cross_entropy",
    "cross_entropy_backward",
    "memory_efficient_attention",
    "memory_efficient_attention_backward",
    "gated_delta_rule",
    "gated_delta_rule_backward",
    "causal_conv1d",
    "causal_conv1d_backward",
    "l2_norm",
    "l2_norm_backward",
    "rms_norm_gated",
    "rms_norm_gated_backward",
]
