"""The pure core: every op is a pair ``op(...) -> (out, cache)`` and ``op_backward(dout, cache)``.

No hidden state: the cache is an ordinary object holding what the backward needs, and each
backward sits directly under its forward, its docstring deriving it.
"""

# ruff: noqa: F403  (each submodule's names, as its __all__ lists them)
# the submodules under private names first: the star imports then rebind `embedding`, `linear` and
# `rope` to the functions of those names
from . import activation as _activation
from . import attention as _attention
from . import conv as _conv
from . import delta_rule as _delta_rule
from . import embedding as _embedding
from . import kda as _kda
from . import linear as _linear
from . import loss as _loss
from . import mamba2 as _mamba2
from . import memory_efficient as _memory_efficient
from . import moe as _moe
from . import norm as _norm
from . import rope as _rope
from . import rope_scaling as _rope_scaling
from . import sparse_attention as _sparse_attention
from .activation import *
from .attention import *
from .conv import *
from .delta_rule import *
from .embedding import *
from .kda import *
from .linear import *
from .loss import *
from .mamba2 import *
from .memory_efficient import *
from .moe import *
from .norm import *
from .rope import *
from .rope_scaling import *
from .sparse_attention import *

# every submodule's public names, as its own __all__ lists them (the one place they are written)
__all__: list = []
for _module in (
    _activation,
    _attention,
    _conv,
    _delta_rule,
    _embedding,
    _kda,
    _linear,
    _mamba2,
    _loss,
    _memory_efficient,
    _moe,
    _norm,
    _rope,
    _rope_scaling,
    _sparse_attention,
):
    __all__ += _module.__all__
