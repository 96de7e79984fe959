"""The functional pairs without their input checks, for npattn's own modules.

``npattn.functional.op`` is a public edge: it validates and casts its arguments, then calls the
kernel.  A module has already validated its inputs at its own edge (``__call__``), so it calls
the kernel here directly: validation runs once.  Each kernel has the public op's name and
signature and computes exactly the same numbers; its arguments must already be what the public op
would have made of them (float arrays of one dtype, shapes that fit, checked options).

Internal extras a kernel may take beyond the public signature are documented where it is defined
(e.g. the attention kernels' output layout for ``MultiHeadAttention``'s fused buffer).
Two kernels have no public op of their own, each a public op's output, bit for bit, for a call
that keeps nothing (see their docstrings): ``decoding_attention``, ``scaled_dot_product_attention``
of a decoding step's one query row of grouped heads, and ``rope_run``, ``rope`` of tokens at
consecutive positions with the angle tables shared between the calls (the layers) of a step
(``rope_run_tables`` makes them, ``rope_turn`` turns a block of the run's tokens).  Two helpers
of a call that keeps nothing compute a public op's numbers too: ``sigmoid`` (``silu``'s) and
``silu_mul_`` (``silu(a) * b`` in place, SwiGLU's gated unit).
"""

# ruff: noqa: F401  (every import is a re-export, listed by __all__ below)

from .activation import clamp_backward_jvp_kernel as clamp_backward_jvp
from .activation import clamp_backward_kernel as clamp_backward
from .activation import clamp_jvp_kernel as clamp_jvp
from .activation import clamp_kernel as clamp
from .activation import dropout_backward_jvp_kernel as dropout_backward_jvp
from .activation import dropout_backward_kernel as dropout_backward
from .activation import dropout_jvp_kernel as dropout_jvp
from .activation import dropout_kernel as dropout
from .activation import gelu_backward_jvp_kernel as gelu_backward_jvp
from .activation import gelu_backward_kernel as gelu_backward
from .activation import gelu_jvp_kernel as gelu_jvp
from .activation import gelu_kernel as gelu
from .activation import relu2_backward_jvp_kernel as relu2_backward_jvp
from .activation import relu2_backward_kernel as relu2_backward
from .activation import relu2_jvp_kernel as relu2_jvp
from .activation import relu2_kernel as relu2
from .activation import relu_backward_jvp_kernel as relu_backward_jvp
from .activation import relu_backward_kernel as relu_backward
from .activation import relu_jvp_kernel as relu_jvp
from .activation import relu_kernel as relu
from .activation import sigmoid, silu_mul_
from .activation import silu_backward_jvp_kernel as silu_backward_jvp
from .activation import silu_backward_kernel as silu_backward
from .activation import silu_jvp_kernel as silu_jvp
from .activation import silu_kernel as silu
from .activation import softmax_backward_jvp_kernel as softmax_backward_jvp
from .activation import softmax_backward_kernel as softmax_backward
from .activation import softmax_jvp_kernel as softmax_jvp
from .activation import softmax_kernel as softmax
from .activation import xielu_backward_jvp_kernel as xielu_backward_jvp
from .activation import xielu_backward_kernel as xielu_backward
from .activation import xielu_jvp_kernel as xielu_jvp
from .activation import xielu_kernel as xielu
from .attention import decoding_attention
from .attention import scaled_dot_product_attention_backward_jvp_kernel as scaled_dot_product_attention_backward_jvp
from .attention import scaled_dot_product_attention_backward_kernel as scaled_dot_product_attention_backward
from .attention import scaled_dot_product_attention_jvp_kernel as scaled_dot_product_attention_jvp
from .attention import scaled_dot_product_attention_kernel as scaled_dot_product_attention
from .conv import causal_conv1d_backward_jvp_kernel as causal_conv1d_backward_jvp
from .conv import causal_conv1d_backward_kernel as causal_conv1d_backward
from .conv import causal_conv1d_jvp_kernel as causal_conv1d_jvp
from .conv import causal_conv1d_kernel as causal_conv1d
from .delta_rule import gated_delta_rule_backward_jvp_kernel as gated_delta_rule_backward_jvp
from .delta_rule import gated_delta_rule_backward_kernel as gated_delta_rule_backward
from .delta_rule import gated_delta_rule_jvp_kernel as gated_delta_rule_jvp
from .delta_rule import gated_delta_rule_kernel as gated_delta_rule
from .delta_rule import l2_norm_backward_jvp_kernel as l2_norm_backward_jvp
from .delta_rule import l2_norm_backward_kernel as l2_norm_backward
from .delta_rule import l2_norm_jvp_kernel as l2_norm_jvp
from .delta_rule import l2_norm_kernel as l2_norm
from .delta_rule import rms_norm_gated_backward_jvp_kernel as rms_norm_gated_backward_jvp
from .delta_rule import rms_norm_gated_backward_kernel as rms_norm_gated_backward
from .delta_rule import rms_norm_gated_jvp_kernel as rms_norm_gated_jvp
from .delta_rule import rms_norm_gated_kernel as rms_norm_gated
from .embedding import embedding_backward_jvp_kernel as embedding_backward_jvp
from .embedding import embedding_backward_kernel as embedding_backward
from .embedding import embedding_jvp_kernel as embedding_jvp
from .embedding import embedding_kernel as embedding
from .linear import linear_backward_jvp_kernel as linear_backward_jvp
from .linear import linear_backward_kernel as linear_backward
from .linear import linear_jvp_kernel as linear_jvp
from .linear import linear_kernel as linear
from .loss import cross_entropy_backward_jvp_kernel as cross_entropy_backward_jvp
from .loss import cross_entropy_backward_kernel as cross_entropy_backward
from .loss import cross_entropy_jvp_kernel as cross_entropy_jvp
from .loss import cross_entropy_kernel as cross_entropy
from .mamba2 import mamba2_scan_backward_jvp_kernel as mamba2_scan_backward_jvp
from .mamba2 import mamba2_scan_backward_kernel as mamba2_scan_backward
from .mamba2 import mamba2_scan_jvp_kernel as mamba2_scan_jvp
from .mamba2 import mamba2_scan_kernel as mamba2_scan
from .memory_efficient import memory_efficient_attention_backward_jvp_kernel as memory_efficient_attention_backward_jvp
from .memory_efficient import memory_efficient_attention_backward_kernel as memory_efficient_attention_backward
from .memory_efficient import memory_efficient_attention_jvp_kernel as memory_efficient_attention_jvp
from .memory_efficient import memory_efficient_attention_kernel as memory_efficient_attention
from .moe import moe_experts_backward_jvp_kernel as moe_experts_backward_jvp
from .moe import moe_experts_backward_kernel as moe_experts_backward
from .moe import moe_experts_jvp_kernel as moe_experts_jvp
from .moe import moe_experts_kernel as moe_experts
from .moe import topk_router_backward_jvp_kernel as topk_router_backward_jvp
from .moe import topk_router_backward_kernel as topk_router_backward
from .moe import topk_router_jvp_kernel as topk_router_jvp
from .moe import topk_router_kernel as topk_router
from .norm import layer_norm_backward_jvp_kernel as layer_norm_backward_jvp
from .norm import layer_norm_backward_kernel as layer_norm_backward
from .norm import layer_norm_jvp_kernel as layer_norm_jvp
from .norm import layer_norm_kernel as layer_norm
from .norm import rms_norm_backward_jvp_kernel as rms_norm_backward_jvp
from .norm import rms_norm_backward_kernel as rms_norm_backward
from .norm import rms_norm_jvp_kernel as rms_norm_jvp
from .norm import rms_norm_kernel as rms_norm
from .rope import rope_again_kernel as rope_again
from .rope import rope_backward_jvp_kernel as rope_backward_jvp
from .rope import rope_backward_kernel as rope_backward
from .rope import rope_jvp_kernel as rope_jvp
from .rope import rope_kernel as rope
from .rope import rope_run_kernel as rope_run
from .rope import rope_run_tables, rope_turn

__all__ = sorted(name for name in dir() if not name.startswith("_"))  # every kernel imported above
