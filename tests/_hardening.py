"""Helpers shared by ``tests/test_hardening_*.py``: what "npattn's own error" means, and a walk
over a module's kept forward state."""

import linecache
import os
import re

import numpy as np
import pytest

import npattn
from npattn import book
from npattn.models import TinyTransformer

PKG_DIR = os.path.dirname(os.path.abspath(npattn.__file__))

# what numpy says when a check was missing and the arithmetic itself failed
NUMPY_LIKE = re.compile(
    r"operands could not be broadcast|matmul: Input operand|shapes .* not aligned|"
    r"axis -?\d+ is out of bounds|index -?\d+ is out of bounds|too many indices|"
    r"Cannot cast ufunc|ufunc '\w+' not supported|unsupported operand type|"
    r"object has no attribute|missing \d+ required positional argument"
)
# "name: ..." with the name of an argument (``q``, ``attn_mask``, ``key, value``, ``betas[0]``,
# ``state_dict['w']``, ``Linear.backward``, ``load_state_dict``, ``<lambda>``)
MESSAGE_START = re.compile(r"^[\w<>][\w<>\[\]'\".]*(, [\w<>][\w<>\[\]'\".]*)*: \S")
OWN_TYPES = (ValueError, TypeError, RuntimeError)


def innermost_frame(exc):
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename, tb.tb_lineno


def assert_own_error(exc, expected_type=None, name=None, contains=()):
    """``exc`` is one of npattn's own errors: exactly ValueError/TypeError/RuntimeError (not a
    numpy subclass such as AxisError or UFuncTypeError), raised by an explicit ``raise`` inside
    npattn, with a message ``"<name>: ..."`` that shows ``contains`` (expected and actual values)
    and reads nothing like numpy's own errors."""
    assert type(exc) in OWN_TYPES, f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    if expected_type is not None:
        assert type(exc) is expected_type, f"expected {expected_type.__name__}, got {type(exc).__name__}: {exc}"
    msg = str(exc)
    assert MESSAGE_START.match(msg), f"message does not start with an argument name and ':': {msg!r}"
    if name is not None:
        assert re.match(name, msg), f"message does not start with {name!r}: {msg!r}"
    assert not NUMPY_LIKE.search(msg), f"looks like a raw numpy/python error: {msg!r}"
    for c in contains:
        assert c in msg, f"{c!r} not in {msg!r}"
    path, line = innermost_frame(exc)
    assert os.path.abspath(path).startswith(PKG_DIR), f"raised outside npattn, in {path}:{line}: {msg!r}"
    assert "raise" in linecache.getline(path, line), (
        f"not an explicit raise ({path}:{line}: {linecache.getline(path, line).strip()!r}): {msg!r}"
    )


def expect_error(fn, expected_type, name, *contains):
    with pytest.raises(OWN_TYPES) as info:
        fn()
    assert_own_error(info.value, expected_type, name, contains)
    return str(info.value)


def walk_arrays(obj, path="", seen=None):
    """Every ndarray reachable from ``obj`` through tuples, lists, dicts and plain objects
    (named tuples included), as ``(path, array)``; modules are not entered."""
    if seen is None:
        seen = set()
    if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, np.generic)):
        return
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        yield path, obj
        if isinstance(obj.base, np.ndarray):  # a view keeps its base alive
            yield from walk_arrays(obj.base, path + ".base", seen)
        return
    if isinstance(obj, npattn.Module) or isinstance(obj, type) or callable(obj):
        return
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (tuple, list)):
        items = enumerate(obj)
    elif hasattr(obj, "__dict__"):
        items = vars(obj).items()
    else:
        return
    for k, v in items:
        yield from walk_arrays(v, f"{path}[{k!r}]" if not hasattr(obj, "__dict__") else f"{path}.{k}", seen)


def cache_arrays(module):
    """``(dotted path, array)`` of every array kept in ``module._cache`` and its submodules'."""
    for name, sub in module.named_modules():
        yield from walk_arrays(sub._cache, (name or "<root>") + "._cache")


# every module class, in a configuration that exercises its options (masks, dropout, GQA, ...)
MHA, ENC = npattn.MultiHeadAttention, npattn.EncoderBlock


# name -> (factory(dtype), inputs(rng, dtype), forward kwargs(rng))
def _x(*shape):
    return lambda rng, dt: (rng.standard_normal(shape).astype(dt),)


MODULES = {
    "Linear": (lambda dt: npattn.Linear(6, 4, rng=0, dtype=dt), _x(2, 5, 6), None),
    "LayerNorm": (lambda dt: npattn.LayerNorm(6, dtype=dt), _x(2, 5, 6), None),
    "Dropout": (lambda dt: npattn.Dropout(0.4, rng=0), _x(2, 5, 6), None),
    "Embedding": (
        lambda dt: npattn.Embedding(7, 6, rng=0, dtype=dt),
        lambda rng, dt: (rng.integers(0, 7, (2, 5)),),
        None,
    ),
    "FeedForward": (
        lambda dt: npattn.FeedForward(6, 10, activation="gelu_tanh", dropout=0.2, rng=0, dtype=dt),
        _x(2, 5, 6),
        None,
    ),
    "MHA": (
        lambda dt: MHA(6, 8, 2, dropout=0.3, qkv_bias=True, rng=0, dtype=dt),
        _x(2, 5, 6),
        lambda rng: dict(attn_mask=rng.standard_normal((5, 5)), key_padding_mask=rng.random((2, 5)) < 0.3),
    ),
    "MHA-causal-gqa": (
        lambda dt: MHA(6, 8, 4, num_kv_heads=2, causal=True, rng=0, dtype=dt),
        _x(2, 5, 6),
        lambda rng: dict(attn_mask=rng.random((2, 1, 5, 5)) < 0.8),
    ),
    "MHA-cross": (
        lambda dt: MHA(6, 8, 2, kdim=3, vdim=4, rng=0, dtype=dt),
        lambda rng, dt: tuple(rng.standard_normal(s).astype(dt) for s in ((2, 5, 6), (2, 7, 3), (2, 7, 4))),
        lambda rng: dict(key_padding_mask=rng.standard_normal((2, 7))),
    ),
    "MHA-memeff": (
        lambda dt: MHA(6, 8, 2, num_kv_heads=1, causal=True, memory_efficient=True, rng=0, dtype=dt),
        _x(2, 5, 6),
        lambda rng: dict(attn_mask=rng.standard_normal((5, 5)), key_padding_mask=rng.random((2, 5)) < 0.3),
    ),
    "EncoderBlock": (
        lambda dt: ENC(6, 2, 10, dropout=0.2, rng=0, dtype=dt),
        _x(2, 5, 6),
        lambda rng: dict(attn_mask=rng.standard_normal((5, 5)), key_padding_mask=rng.random((2, 5)) < 0.3),
    ),
    "EncoderBlock-prenorm": (
        lambda dt: ENC(6, 2, 10, norm_first=True, causal=True, activation="gelu", dropout=0.2, rng=0, dtype=dt),
        _x(2, 5, 6),
        None,
    ),
    "SelfAttention_v1": (lambda dt: book.SelfAttention_v1(6, 4, rng=0, dtype=dt), _x(5, 6), None),
    "SelfAttention_v2": (lambda dt: book.SelfAttention_v2(6, 4, qkv_bias=True, rng=0, dtype=dt), _x(2, 5, 6), None),
    "CausalAttention": (lambda dt: book.CausalAttention(6, 4, 8, 0.3, rng=0, dtype=dt), _x(2, 5, 6), None),
    "Wrapper": (lambda dt: book.MultiHeadAttentionWrapper(6, 4, 8, 0.3, 2, rng=0, dtype=dt), _x(2, 5, 6), None),
    "BookMHA": (lambda dt: book.MultiHeadAttention(6, 8, 8, 0.3, 2, rng=0, dtype=dt), _x(2, 5, 6), None),
    "TinyTransformer": (
        lambda dt: TinyTransformer(7, 8, 8, 2, 2, 12, dropout=0.2, rng=0, dtype=dt),
        lambda rng, dt: (rng.integers(0, 7, (2, 5)),),
        None,
    ),
}


def build_case(name, seed, dtype=np.float64):
    """``(module, inputs, forward kwargs)`` of ``MODULES[name]``, drawn from ``seed``."""
    make, inputs, kwargs = MODULES[name]
    rng = np.random.default_rng(seed)
    return make(dtype), inputs(rng, dtype), ({} if kwargs is None else kwargs(rng))
