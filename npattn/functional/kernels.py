"""The functional pairs without their input checks, for npattn's own modules.

``npattn.functional.op`` is a public edge: it validates and casts its arguments, then calls the
kernel.  A module has already validated its inputs at its own edge (``__call__``), so it calls
the kernel here directly: validation runs once.  Each kernel has the public op's name and
signature and computes exactly the same numbers; its arguments must already be what the public op
would have made of them (float arrays of one dtype, shapes that fit, checked options).

Internal extras a kernel may take beyond the public signature are documented where it is defined
(e.g. the attention kernels' output layout for ``MultiHeadAttention``'s fused buffer).
"""
# -- linear, embedding, activations, norms, loss, rope (one line per pair) --------------------------
from .activation import _dropout as dropout, _dropout_backward as dropout_backward  # noqa: F401
from .activation import _gelu as gelu, _gelu_backward as gelu_backward  # noqa: F401
from .activation import _relu as relu, _relu_backward as relu_backward  # noqa: F401
from .activation import _silu as silu, _silu_backward as silu_backward  # noqa: F401
from .activation import _softmax as softmax, _softmax_backward as softmax_backward  # noqa: F401
from .embedding import _embedding as embedding, _embedding_backward as embedding_backward  # noqa: F401
from .linear import _linear as linear, _linear_backward as linear_backward  # noqa: F401
from .loss import _cross_entropy as cross_entropy, _cross_entropy_backward as cross_entropy_backward  # noqa: F401
from .norm import _layer_norm as layer_norm, _layer_norm_backward as layer_norm_backward  # noqa: F401
from .norm import _rms_norm as rms_norm, _rms_norm_backward as rms_norm_backward  # noqa: F401
from .rope import _rope as rope, _rope_backward as rope_backward  # noqa: F401

# -- attention ----------------------------------------------------------------------------------------
from .attention import scaled_dot_product_attention, scaled_dot_product_attention_backward  # noqa: F401
from .memory_efficient import memory_efficient_attention, memory_efficient_attention_backward  # noqa: F401
