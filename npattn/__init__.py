"""npattn: transformer attention in pure NumPy, every backward pass derived and written by hand.

* ``npattn.functional``: pure ``op(...) -> (out, cache)`` / ``op_backward(dout, cache)`` pairs (the
  fast tier); ``npattn.functional.reference``: the same pairs as textbook formulas, each backward
  derived in comments.
* Modules (``Linear``, ``LayerNorm``, ``RMSNorm``, ``Dropout``, ``Embedding``, ``FeedForward``,
  ``MultiHeadAttention``, ``EncoderBlock``, ``DecoderBlock``): ``y = m(x)``, ``dx = m.backward(dy)``, gradients
  accumulated into ``p.grad``.
* ``npattn.book``: the chapter 3-5 classes of *Build a Large Language Model (From Scratch)*
  (attention classes, ``GPTModel``, ``generate``, GPT-2 weight loading).
* ``npattn.gradcheck``: central-difference checks of functional pairs and modules;
  ``npattn.gradgradcheck`` checks their second order (``backward_jvp``).
* ``npattn.masks``: causal, padding and sliding-window masks (True = may attend).
* ``npattn.optim``: SGD, Adam, AdamW, gradient clipping, a warm-up + cosine schedule.
* ``npattn.models.TinyTransformer``: a small causal transformer built from the public pieces.
* ``npattn.generation``: sampling (temperature, top-k, EOS) shared by every model.
* ``npattn.viz`` (matplotlib) and ``npattn.testing`` (hypothesis strategies): imported on demand.

Importing npattn imports numpy and nothing else outside the standard library.
"""

__version__ = "0.1.0"

from . import functional, masks, nn, optim  # noqa: F401
from .models import TinyTransformer
from .nn import *  # noqa: F403  (every name of nn.__all__)
from .testing.gradcheck import GradcheckReport, gradcheck
from .testing.gradgradcheck import gradgradcheck

__all__ = [
    *nn.__all__,
    "TinyTransformer",
    "gradcheck",
    "gradgradcheck",
    "GradcheckReport",
    "functional",
    "masks",
    "optim",
    "__version__",
]
