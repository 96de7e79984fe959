"""The functional pairs without their input checks, for npattn's own modules.

``npattn.functional.op`` is a public edge: it validates and casts its arguments, then calls the
kernel.  A module has already validated its inputs at its own edge (``__call__``), so it calls
the kernel here directly: validation runs once.  Each kernel has the public op's name and
signature and computes exactly the same numbers; its arguments must already be what the public op
would have made of them (float arrays of one dtype, shapes that fit, checked options).

Internal extras a kernel may take beyond the public signature are documented where it is defined
(e.g. the attention kernels' output layout for ``MultiHeadAttention``'s fused buffer).
"""

from .activation import _dropout as dropout
from .activation import _dropout_backward as dropout_backward
from .activation import _dropout_backward_jvp as dropout_backward_jvp
from .activation import _dropout_jvp as dropout_jvp
from .activation import _gelu as gelu
from .activation import _gelu_backward as gelu_backward
from .activation import _gelu_backward_jvp as gelu_backward_jvp
from .activation import _gelu_jvp as gelu_jvp
from .activation import _relu as relu
from .activation import _relu_backward as relu_backward
from .activation import _relu_backward_jvp as relu_backward_jvp
from .activation import _relu_jvp as relu_jvp
from .activation import _silu as silu
from .activation import _silu_backward as silu_backward
from .activation import _silu_backward_jvp as silu_backward_jvp
from .activation import _silu_jvp as silu_jvp
from .activation import _softmax as softmax
from .activation import _softmax_backward as softmax_backward
from .activation import _softmax_backward_jvp as softmax_backward_jvp
from .activation import _softmax_jvp as softmax_jvp
from .attention import _scaled_dot_product_attention as scaled_dot_product_attention
from .attention import _scaled_dot_product_attention_backward as scaled_dot_product_attention_backward
from .attention import _scaled_dot_product_attention_jvp as scaled_dot_product_attention_jvp
from .embedding import _embedding as embedding
from .embedding import _embedding_backward as embedding_backward
from .embedding import _embedding_backward_jvp as embedding_backward_jvp
from .embedding import _embedding_jvp as embedding_jvp
from .linear import _linear as linear
from .linear import _linear_backward as linear_backward
from .linear import _linear_backward_jvp as linear_backward_jvp
from .linear import _linear_jvp as linear_jvp
from .loss import _cross_entropy as cross_entropy
from .loss import _cross_entropy_backward as cross_entropy_backward
from .loss import _cross_entropy_backward_jvp as cross_entropy_backward_jvp
from .loss import _cross_entropy_jvp as cross_entropy_jvp
from .memory_efficient import _memory_efficient_attention as memory_efficient_attention
from .memory_efficient import _memory_efficient_attention_backward as memory_efficient_attention_backward
from .memory_efficient import _memory_efficient_attention_jvp as memory_efficient_attention_jvp
from .moe import _moe_experts as moe_experts
from .moe import _moe_experts_backward as moe_experts_backward
from .moe import _moe_experts_jvp as moe_experts_jvp
from .moe import _topk_router as topk_router
from .moe import _topk_router_backward as topk_router_backward
from .moe import _topk_router_jvp as topk_router_jvp
from .norm import _layer_norm as layer_norm
from .norm import _layer_norm_backward as layer_norm_backward
from .norm import _layer_norm_backward_jvp as layer_norm_backward_jvp
from .norm import _layer_norm_jvp as layer_norm_jvp
from .norm import _rms_norm as rms_norm
from .norm import _rms_norm_backward as rms_norm_backward
from .norm import _rms_norm_backward_jvp as rms_norm_backward_jvp
from .norm import _rms_norm_jvp as rms_norm_jvp
from .rope import _rope as rope
from .rope import _rope_backward as rope_backward
from .rope import _rope_backward_jvp as rope_backward_jvp
from .rope import _rope_jvp as rope_jvp

__all__ = [
    "dropout",
    "dropout_backward",
    "dropout_jvp",
    "dropout_backward_jvp",
    "gelu",
    "gelu_backward",
    "gelu_jvp",
    "gelu_backward_jvp",
    "relu",
    "relu_backward",
    "relu_jvp",
    "relu_backward_jvp",
    "silu",
    "silu_backward",
    "silu_jvp",
    "silu_backward_jvp",
    "softmax",
    "softmax_backward",
    "softmax_jvp",
    "softmax_backward_jvp",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "scaled_dot_product_attention_jvp",
    "embedding",
    "embedding_backward",
    "embedding_jvp",
    "embedding_backward_jvp",
    "linear",
    "linear_backward",
    "linear_jvp",
    "linear_backward_jvp",
    "cross_entropy",
    "cross_entropy_backward",
    "cross_entropy_jvp",
    "cross_entropy_backward_jvp",
    "memory_efficient_attention",
    "memory_efficient_attention_backward",
    "memory_efficient_attention_jvp",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_jvp",
    "layer_norm_backward_jvp",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_jvp",
    "rms_norm_backward_jvp",
    "rope",
    "rope_backward",
    "rope_jvp",
    "rope_backward_jvp",
    "topk_router",
    "topk_router_backward",
    "topk_router_jvp",
    "moe_experts",
    "moe_experts_backward",
    "moe_experts_jvp",
]
