"""Test support that users import too.

* ``gradcheck``, ``GradcheckReport``, ``GradcheckRow``, ``numerical_gradient``: central-difference
  checks of functional pairs and modules (numpy only; also ``npattn.gradcheck``).
* ``gradgradcheck``: the second order (``backward_jvp``) against central differences of the
  backward, and the Hessian's symmetry (also ``npattn.gradgradcheck``).
* The hypothesis strategies of npattn's own property tests (``arrays``, ``attention_configs``, ...,
  see ``npattn.testing.strategies``): loaded on first use, so only they need hypothesis.  For
  attention variants: ``windows``, ``alibi_slopes``, ``softcaps``, ``sinks``, ``positions`` (RoPE)
  and ``attention_configs(options=True)``, which draws every attention option.
"""

from ._names import STRATEGIES as _STRATEGIES
from .gradcheck import GradcheckError, GradcheckReport, GradcheckRow, gradcheck, numerical_gradient
from .gradgradcheck import gradgradcheck

__all__ = [
    "gradcheck",
    "gradgradcheck",
    "GradcheckReport",
    "GradcheckRow",
    "GradcheckError",
    "numerical_gradient",
    *_STRATEGIES,
]


def __getattr__(name):
    if name in _STRATEGIES:
        from . import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module 'npattn.testing' has no attribute {name!r}")
