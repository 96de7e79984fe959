"""Property: a refused call changes no state, for every module.

For each module of ``CASES`` (one line per module: a factory and its inputs), hypothesis draws a
seed, a dtype, a training flag and one refused call (bad input, mask, ``dy``, state dict or
option).  After a valid forward, the refused call must raise ``ValueError``/``TypeError`` and
leave everything as it was: parameters, gradients, parameter versions, training flags, the
generators' states (a refused forward draws no dropout mask) and the kept forward state (a
backward with a valid ``dy`` gives exactly what a twin module that never saw the refused call
gives).  New modules are added with one line in ``CASES``.
"""

import copy
import inspect
from dataclasses import dataclass
from typing import Callable, Tuple

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import npattn  # noqa: E402
from npattn import book  # noqa: E402

D, L, B = 4, 3, 2


@dataclass
class Case:
    make: Callable  # (seed, dtype) -> Module
    # "x": one float (B, L, D); "ids": token ids (B, L) below ``vocab``; "x3": cross-attention
    # (query, key (B, L+1, 3), value (B, L+1, 5)); "x_memory": (x, memory (B, L+1, D)) as DecoderBlock
    inputs: str = "x"
    # mask keywords of the forward: True for (attn_mask, key_padding_mask), or the names; a name with
    # "key_padding" is (B, Lk) True = padding, else (Lq, Lk); names starting "memory" use the memory's length
    masks: object = False
    vocab: int = 7
    features: bool = True  # the input's last axis has a fixed width
    max_len: int = 0  # > 0: longer inputs are refused


CASES = {
    "Linear": Case(lambda s, dt: npattn.Linear(D, 3, rng=s, dtype=dt)),
    "LayerNorm": Case(lambda s, dt: npattn.LayerNorm(D, dtype=dt)),
    "RMSNorm": Case(lambda s, dt: npattn.RMSNorm(D, dtype=dt)),
    "Dropout": Case(lambda s, dt: npattn.Dropout(0.3, rng=s), features=False),
    "Embedding": Case(lambda s, dt: npattn.Embedding(7, D, rng=s, dtype=dt), inputs="ids"),
    "Embedding-options": Case(
        lambda s, dt: npattn.Embedding(7, D, padding_idx=1, max_norm=0.8, scale_grad_by_freq=True, rng=s, dtype=dt),
        inputs="ids",
    ),
    "FeedForward": Case(lambda s, dt: npattn.FeedForward(D, 6, dropout=0.2, activation="gelu", rng=s, dtype=dt)),
    "FeedForward-swiglu": Case(
        lambda s, dt: npattn.FeedForward(D, 6, dropout=0.2, activation="swiglu", bias=False, rng=s, dtype=dt)
    ),
    "MultiHeadAttention": Case(
        lambda s, dt: npattn.MultiHeadAttention(D, D, 2, dropout=0.2, qkv_bias=True, rng=s, dtype=dt), masks=True
    ),
    "MultiHeadAttention-gqa-cross": Case(
        lambda s, dt: npattn.MultiHeadAttention(D, D, 2, num_kv_heads=1, kdim=3, vdim=5, causal=True, rng=s, dtype=dt),
        inputs="x3",
        masks=True,
    ),
    "MultiHeadAttention-memeff": Case(
        lambda s, dt: npattn.MultiHeadAttention(D, D, 2, memory_efficient=True, rng=s, dtype=dt), masks=True
    ),
    "EncoderBlock": Case(lambda s, dt: npattn.EncoderBlock(D, 2, 6, dropout=0.2, rng=s, dtype=dt), masks=True),
    "EncoderBlock-pre": Case(
        lambda s, dt: npattn.EncoderBlock(D, 2, 6, dropout=0.2, norm_first=True, rng=s, dtype=dt), masks=True
    ),
    "EncoderBlock-pre-nobias": Case(
        lambda s, dt: npattn.EncoderBlock(
            D, 2, 6, dropout=0.2, norm_first=True, bias=False, activation="swiglu", rng=s, dtype=dt
        ),
        masks=True,
    ),
    "SelfAttention_v1": Case(lambda s, dt: book.SelfAttention_v1(D, 3, rng=s, dtype=dt)),
    "SelfAttention_v2": Case(lambda s, dt: book.SelfAttention_v2(D, 3, qkv_bias=True, rng=s, dtype=dt)),
    "CausalAttention": Case(lambda s, dt: book.CausalAttention(D, 3, 5, 0.2, rng=s, dtype=dt)),
    "MultiHeadAttentionWrapper": Case(lambda s, dt: book.MultiHeadAttentionWrapper(D, 2, 5, 0.2, 2, rng=s, dtype=dt)),
    "book.MultiHeadAttention": Case(lambda s, dt: book.MultiHeadAttention(D, D, 5, 0.2, 2, rng=s, dtype=dt)),
    "TinyTransformer": Case(
        lambda s, dt: npattn.TinyTransformer(7, 5, D, 2, 2, 6, dropout=0.1, rng=s, dtype=dt), inputs="ids", max_len=5
    ),
}


def _takes(cls, *names):
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    return all(n in params for n in names)


# modules and options that land on other branches join the table when they exist
if _takes(npattn.MultiHeadAttention, "sinks", "qk_norm", "rope", "window", "alibi", "softcap"):
    CASES["MultiHeadAttention-options"] = Case(
        lambda s, dt: npattn.MultiHeadAttention(
            D,
            D,
            2,
            sinks=True,
            qk_norm=True,
            rope=True,
            window=(2, 0),
            alibi=True,
            softcap=5.0,
            causal=True,
            rng=s,
            dtype=dt,
        ),
        masks=True,
    )
if hasattr(npattn, "DecoderBlock"):
    CASES["DecoderBlock"] = Case(
        lambda s, dt: npattn.DecoderBlock(D, 2, 6, dropout=0.2, rng=s, dtype=dt),
        inputs="x_memory",
        masks=("tgt_mask", "tgt_key_padding_mask", "memory_mask", "memory_key_padding_mask"),
    )
if hasattr(book, "GPTModel"):
    _GPT = dict(vocab_size=11, context_length=5, emb_dim=D, n_heads=2, n_layers=2, drop_rate=0.1, qkv_bias=True)
    CASES["GPTModel"] = Case(
        lambda s, dt: book.GPTModel(dict(_GPT), rng=s, dtype=dt), inputs="ids", vocab=11, max_len=5
    )


def _mask_names(case) -> Tuple[str, ...]:
    if case.masks is True:
        return ("attn_mask", "key_padding_mask")
    return tuple(case.masks or ())


# Refusals known to leave state behind, fixed elsewhere: (case, refusal prefix).  None today (the
# pre-norm encoder block checks its masks before layer norm 1 runs).
# -- the valid call ----------------------------------------------------------------------------------
def _valid_inputs(case, seed, dtype):
    rng = np.random.default_rng(seed)
    if case.inputs == "ids":
        return (rng.integers(0, case.vocab, (B, L)),), {}
    x = rng.standard_normal((B, L, D)).astype(dtype)
    kw = {}
    for name in _mask_names(case):
        if "key_padding" in name:
            kpm = np.zeros((B, _lk(case, name)), bool)
            kpm[0, -1] = True  # pad the last key of the first sequence
            kw[name] = kpm
    if case.inputs == "x3":
        lk = L + 1
        return (x, rng.standard_normal((B, lk, 3)).astype(dtype), rng.standard_normal((B, lk, 5)).astype(dtype)), kw
    if case.inputs == "x_memory":
        return (x, rng.standard_normal((B, L + 1, D)).astype(dtype)), kw
    return (x,), kw


def _lk(case, name="attn_mask"):
    """The number of keys the mask ``name`` covers."""
    if case.inputs == "x3" or (case.inputs == "x_memory" and name.startswith("memory")):
        return L + 1
    return L


# -- the refused calls --------------------------------------------------------------------------------
def _refusals(case, dtype):
    """``{name: call(m, args, kwargs, y)}``; each call must raise ValueError or TypeError."""
    out = {}

    def fwd(**changes):
        def call(m, args, kw, y):
            # other valid inputs, so that a sublayer which ran before the refusal would be caught
            # holding the wrong forward state
            a, k = list(_valid_inputs(case, 12345, dtype)[0]), dict(kw)
            for key, val in changes.items():
                if isinstance(key, str) and key.startswith("arg"):
                    a[int(key[3:])] = val(a[int(key[3:])]) if callable(val) else val
                else:
                    k[key] = val
            m(*a, **k)

        return call

    if case.inputs == "ids":
        out["ids-float"] = fwd(arg0=lambda a: a.astype(np.float64))
        out["ids-bool"] = fwd(arg0=lambda a: a > 2)
        out["ids-out-of-range"] = fwd(arg0=lambda a: a + case.vocab)
        out["ids-negative"] = fwd(arg0=lambda a: a - case.vocab)
        if case.max_len:
            out["ids-too-long"] = fwd(arg0=lambda a: np.zeros((B, case.max_len + 1), np.int64))
    else:
        if case.features:
            out["x-width"] = fwd(arg0=lambda a: np.ones(a.shape[:-1] + (a.shape[-1] + 1,), dtype))
        out["x-bool"] = fwd(arg0=lambda a: a > 0)
        out["x-float16"] = fwd(arg0=lambda a: a.astype(np.float16))
        out["x-complex"] = fwd(arg0=lambda a: a.astype(np.complex128))
        out["x-strings"] = fwd(arg0=lambda a: np.full(a.shape, "a"))
        out["x-ragged"] = fwd(arg0=[[1.0, 2.0], [3.0]])
    if case.inputs == "x3":
        out["key-width"] = fwd(arg1=lambda a: np.ones(a.shape[:-1] + (a.shape[-1] + 2,), dtype))
        out["value-length"] = fwd(arg2=lambda a: a[:, :-1])
        out["key-missing"] = fwd(arg2=None)
    if case.inputs == "x_memory":
        out["memory-width"] = fwd(arg1=lambda a: np.ones(a.shape[:-1] + (a.shape[-1] + 1,), dtype))
        out["memory-batch"] = fwd(arg1=lambda a: np.ones((B + 1,) + a.shape[1:], dtype))
    for name in _mask_names(case):
        lk = _lk(case, name)
        if "key_padding" in name:
            out[f"{name}-shape"] = fwd(**{name: np.zeros((B, lk + 1), bool)})
            out[f"{name}-int"] = fwd(**{name: np.zeros((B, lk), np.int64)})
        else:
            out[f"{name}-shape"] = fwd(**{name: np.ones((L + 2, lk + 1), bool)})
            out[f"{name}-int"] = fwd(**{name: np.ones((L, lk), np.int64)})
            out[f"{name}-nan"] = fwd(**{name: np.full((L, lk), np.nan)})
            out[f"{name}-float16"] = fwd(**{name: np.zeros((L, lk), np.float16)})
    if "attn_mask" in _mask_names(case):
        out["need_weights-str"] = fwd(need_weights="yes")
    out["unknown-keyword"] = fwd(no_such_option=1)

    def dy(make):
        def call(m, args, kw, y):
            m.backward(make(y))

        return call

    out["dy-shape"] = dy(lambda y: np.ones(y.shape[:-1] + (y.shape[-1] + 1,)))
    out["dy-bool"] = dy(lambda y: np.ones(y.shape, bool))
    out["dy-float16"] = dy(lambda y: np.ones(y.shape, np.float16))
    out["dy-strings"] = dy(lambda y: np.full(y.shape, "a"))
    out["dy-scalar"] = dy(lambda y: 1.0)

    def sd(edit, strict=True):
        def call(m, args, kw, y):
            d = {k: v + 1 if v.dtype.kind == "f" else v for k, v in m.state_dict().items()}
            m.load_state_dict(edit(d), strict=strict)

        return call

    def first(d):
        return next(iter(d)) if d else None

    out["sd-extra-key"] = sd(lambda d: {**d, "no.such.key": np.zeros(2)})
    out["sd-not-a-mapping"] = sd(lambda d: list(d.items()))
    out["sd-strict-str"] = sd(lambda d: d, strict="yes")
    out["sd-missing-key"] = sd(lambda d: {k: v for k, v in list(d.items())[1:]} if d else {"x": 1})
    out["sd-wrong-shape"] = sd(lambda d: {**d, first(d): np.zeros(3)} if d else {"x": 1})
    out["sd-bool"] = sd(lambda d: {**d, first(d): np.ones(d[first(d)].shape, bool)} if d else {"x": 1})
    out["sd-strings"] = sd(lambda d: {**d, first(d): np.full(d[first(d)].shape, "a")} if d else {"x": 1})
    out["sd-float16"] = sd(lambda d: {**d, first(d): d[first(d)].astype(np.float16)} if d else {"x": 1})
    if np.dtype(dtype) == np.float32:
        out["sd-out-of-float32-range"] = sd(
            lambda d: {**d, first(d): np.full(d[first(d)].shape, 1e300)} if d else {"x": 1}
        )

    def other(fn):
        def call(m, args, kw, y):
            fn(m)

        return call

    out["train-str"] = other(lambda m: m.train("yes"))
    out["to-float16"] = other(lambda m: m.to(np.float16))
    out["to-junk"] = other(lambda m: m.to("junk"))
    return out


# -- state -----------------------------------------------------------------------------------------
def _generators(m):
    seen = {}
    for sub in m.modules():
        for name, v in vars(sub).items():
            if isinstance(v, np.random.Generator) and id(v) not in seen:
                seen[id(v)] = v
    return [g.bit_generator.state for g in seen.values()]


def _state(m):
    return {
        "sd": m.state_dict(),
        "grads": {n: None if p.grad is None else p.grad.copy() for n, p in m.named_parameters()},
        "dtypes": {n: p.data.dtype for n, p in m.named_parameters()},
        "versions": {n: p._version for n, p in m.named_parameters()},
        "training": [sub.training for sub in m.modules()],
        "rngs": _generators(m),
    }


def _assert_same_state(a, b):
    assert a["sd"].keys() == b["sd"].keys()
    for k in a["sd"]:
        assert a["sd"][k].dtype == b["sd"][k].dtype, k
        np.testing.assert_array_equal(a["sd"][k], b["sd"][k], err_msg=k)
    for k in a["grads"]:
        np.testing.assert_array_equal(a["grads"][k], b["grads"][k], err_msg=k)
    assert a["dtypes"] == b["dtypes"]
    assert a["versions"] == b["versions"]
    assert a["training"] == b["training"]
    assert a["rngs"] == b["rngs"]


def _first(y):
    return y[0] if isinstance(y, tuple) else y


def _check(name, seed, dtype, training, refusal):
    case = CASES[name]
    m = case.make(seed, dtype)
    m.train(training)
    twin = copy.deepcopy(m)
    args, kw = _valid_inputs(case, seed, dtype)
    y = _first(m(*args, **kw))
    y_twin = _first(twin(*args, **kw))
    np.testing.assert_array_equal(y, y_twin)
    before = _state(m)
    with pytest.raises((ValueError, TypeError)):
        _refusals(case, dtype)[refusal](m, args, kw, y)
    after = _state(m)
    _assert_same_state(before, after)
    _assert_same_state(after, _state(twin))
    dy = np.random.default_rng(seed + 1).standard_normal(y.shape).astype(y.dtype)
    g = m.backward(dy)  # the forward state kept from the valid call
    g_twin = twin.backward(dy)
    for a, b in zip(g if isinstance(g, tuple) else (g,), g_twin if isinstance(g_twin, tuple) else (g_twin,)):
        if a is None:
            assert b is None
        else:
            np.testing.assert_array_equal(a, b)
    _assert_same_state(_state(m), _state(twin))
    # and the module keeps working: the next forward draws the same dropout masks as the twin's
    np.testing.assert_array_equal(_first(m(*args, **kw)), _first(twin(*args, **kw)))


@pytest.mark.parametrize("name", list(CASES))
@settings(max_examples=25)
@given(
    data=st.data(), seed=st.integers(0, 2**16), dtype=st.sampled_from([np.float64, np.float32]), training=st.booleans()
)
def test_refused_call_changes_no_state(name, data, seed, dtype, training):
    refusals = sorted(_refusals(CASES[name], dtype))
    refusal = data.draw(st.sampled_from(refusals), label="refusal")
    _check(name, seed, dtype, training, refusal)


@pytest.mark.parametrize("name", list(CASES))
def test_every_refusal_once(name):
    """Each refused call of each module, deterministically (the property above samples them)."""
    for dtype in (np.float64, np.float32):
        for refusal in sorted(_refusals(CASES[name], dtype)):
            try:
                _check(name, 3, dtype, True, refusal)
            except BaseException as e:  # name the refusal in the failure
                raise AssertionError(f"{name} / {np.dtype(dtype)} / {refusal}: {type(e).__name__}: {e}") from e


@pytest.mark.parametrize("name", list(CASES))
def test_rejected_dy_after_the_forward_method_keeps_state(name):
    """``m.forward(x)`` (not ``m(x)``), a refused ``dy``, then the right one: the same gradients
    as a twin that never saw the refused ``dy`` (the README's "retry with the right dy")."""
    case = CASES[name]
    m = case.make(5, np.float64)
    twin = copy.deepcopy(m)
    args, kw = _valid_inputs(case, 5, np.float64)
    y = _first(m.forward(*args, **kw))
    _first(twin(*args, **kw))
    for bad in (np.ones(y.shape[:-1] + (y.shape[-1] + 1,)), np.ones(y.shape, bool), np.ones(y.shape, np.float16)):
        with pytest.raises((ValueError, TypeError)):
            m.backward(bad)
    dy = np.random.default_rng(6).standard_normal(y.shape)
    g, g_twin = m.backward(dy), twin.backward(dy)
    for a, b in zip(g if isinstance(g, tuple) else (g,), g_twin if isinstance(g_twin, tuple) else (g_twin,)):
        if a is None:
            assert b is None
        else:
            np.testing.assert_array_equal(a, b)
    _assert_same_state(_state(m), _state(twin))
