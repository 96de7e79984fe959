"""The pure core: every op is a pair ``op(...) -> (out, cache)`` and ``op_backward(dout, cache)``.

No hidden state: the cache is an ordinary object holding what the backward needs, and each
backward sits directly under its forward, its docstring deriving it.
"""

from .activation import (
    dropout,
    dropout_backward,
    dropout_jvp,
    gelu,
    gelu_backward,
    gelu_jvp,
    relu,
    relu_backward,
    relu_jvp,
    silu,
    silu_backward,
    silu_jvp,
    softmax,
    softmax_backward,
    softmax_jvp,
)
from .attention import (
    AttentionCache,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
    scaled_dot_product_attention_jvp,
)
from .conv import causal_conv1d, causal_conv1d_backward, causal_conv1d_jvp
from .delta_rule import (
    gated_delta_rule,
    gated_delta_rule_backward,
    gated_delta_rule_jvp,
    l2_norm,
    l2_norm_backward,
    l2_norm_jvp,
    rms_norm_gated,
    rms_norm_gated_backward,
    rms_norm_gated_jvp,
)
from .embedding import embedding, embedding_backward, embedding_jvp
from .linear import linear, linear_backward, linear_jvp
from .loss import cross_entropy, cross_entropy_backward, cross_entropy_jvp
from .memory_efficient import (
    memory_efficient_attention,
    memory_efficient_attention_backward,
    memory_efficient_attention_jvp,
)
from .moe import (
    moe_experts,
    moe_experts_backward,
    moe_experts_jvp,
    topk_router,
    topk_router_backward,
    topk_router_jvp,
)
from .norm import layer_norm, layer_norm_backward, layer_norm_jvp, rms_norm, rms_norm_backward, rms_norm_jvp
from .rope import rope, rope_backward, rope_jvp
from .rope_scaling import rope_frequencies, rope_softmax_scale, yarn_mscale

__all__ = [
    "rope_frequencies",
    "rope_softmax_scale",
    "yarn_mscale",
    "linear",
    "linear_backward",
    "linear_jvp",
    "embedding",
    "embedding_backward",
    "embedding_jvp",
    "softmax",
    "softmax_backward",
    "softmax_jvp",
    "relu",
    "relu_backward",
    "relu_jvp",
    "gelu",
    "gelu_backward",
    "gelu_jvp",
    "silu",
    "silu_backward",
    "silu_jvp",
    "dropout",
    "dropout_backward",
    "dropout_jvp",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_jvp",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_jvp",
    "rope",
    "rope_backward",
    "rope_jvp",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "scaled_dot_product_attention_jvp",
    "AttentionCache",
    "cross_entropy",
    "cross_entropy_backward",
    "cross_entropy_jvp",
    "memory_efficient_attention",
    "memory_efficient_attention_backward",
    "memory_efficient_attention_jvp",
    "gated_delta_rule",
    "gated_delta_rule_backward",
    "gated_delta_rule_jvp",
    "causal_conv1d",
    "causal_conv1d_backward",
    "causal_conv1d_jvp",
    "l2_norm",
    "l2_norm_backward",
    "l2_norm_jvp",
    "rms_norm_gated",
    "rms_norm_gated_backward",
    "rms_norm_gated_jvp",
    "topk_router",
    "topk_router_backward",
    "topk_router_jvp",
    "moe_experts",
    "moe_experts_backward",
    "moe_experts_jvp",
]
