"""The textbook pairs of ``npattn.functional.reference`` other than attention: against torch
(float64, 1e-10, outputs and every gradient) and against central differences (``npattn.gradcheck``
and the independent ``tests/_fd.py``)."""

import numpy as np
import pytest
from _fd import fd_check
from _oracles import rel_err

from npattn import gradcheck
from npattn.functional import reference as R

TOL = 1e-10


def _t(torch, a, grad=True):
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def _check(got, want):
    want = want.detach().numpy() if hasattr(want, "detach") else np.asarray(want)
    assert np.shape(got) == want.shape
    assert rel_err(got, want) < TOL


# -- torch parity ------------------------------------------------------------------------------------


def test_linear_matches_torch(torch_or_skip):
    torch = torch_or_skip
    rng = np.random.default_rng(0)
    for xshape, bias in [((2, 3, 4), True), ((4,), True), ((5, 4), False)]:
        x, w, b = rng.standard_normal(xshape), rng.standard_normal((3, 4)), rng.standard_normal(3)
        y, cache = R.linear(x, w, b if bias else None)
        dy = rng.standard_normal(y.shape)
        dx, dw, db = R.linear_backward(dy, cache)
        tx, tw, tb = _t(torch, x), _t(torch, w), _t(torch, b)
        ty = torch.nn.functional.linear(tx, tw, tb if bias else None)
        ty.backward(torch.tensor(dy))
        _check(y, ty)
        _check(dx, tx.grad)
        _check(dw, tw.grad)
        assert (db is None) == (not bias)
        if bias:
            _check(db, tb.grad)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"padding_idx": 1},
        {"padding_idx": -2},
        {"scale_grad_by_freq": True},
        {"max_norm": 1.5},
        {"max_norm": 0.8, "norm_type": 1.0},
        {"max_norm": 1.0, "norm_type": float("inf"), "padding_idx": 0, "scale_grad_by_freq": True},
    ],
)
def test_embedding_matches_torch(torch_or_skip, kw):
    torch = torch_or_skip
    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 3))
    ids = np.array([[0, 1, 1, 4], [5, 1, 0, 0]])
    pristine = w.copy()
    out, cache = R.embedding(ids, w, **kw)
    assert np.array_equal(w, pristine)  # the functional op never modifies the weight
    dout = rng.standard_normal(out.shape)
    dw = R.embedding_backward(dout, cache)
    tw = _t(torch, w)
    tout = torch.nn.functional.embedding(torch.tensor(ids), tw, **kw)
    tout.backward(torch.tensor(dout))
    _check(out, tout)
    _check(dw, tw.grad)


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_matches_torch(torch_or_skip, axis):
    torch = torch_or_skip
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 4, 5)) * 3
    x[0, 0, :] += 1e4  # large logits stay finite
    y, cache = R.softmax(x, axis=axis)
    dy = rng.standard_normal(y.shape)
    tx = _t(torch, x)
    ty = torch.softmax(tx, dim=axis)
    ty.backward(torch.tensor(dy))
    _check(y, ty)
    _check(R.softmax_backward(dy, cache), tx.grad)


def test_softmax_of_a_scalar_and_of_masked_rows(torch_or_skip):
    torch = torch_or_skip
    y, cache = R.softmax(np.array(2.5))
    assert y.shape == () and y == 1.0
    dx = R.softmax_backward(np.array(0.7), cache)
    tx = _t(torch, 2.5)
    torch.softmax(tx, dim=-1).backward(torch.tensor(0.7, dtype=torch.float64))
    assert dx.shape == () and dx == 0.0 == tx.grad.item()
    y, cache = R.softmax(np.array([[-np.inf, -np.inf], [0.0, 1.0]]))
    assert np.all(y[0] == 0) and np.isfinite(R.softmax_backward(np.ones((2, 2)), cache)).all()


@pytest.mark.parametrize("op", ["relu", "gelu", "gelu_tanh", "silu"])
def test_activations_match_torch(torch_or_skip, op):
    torch = torch_or_skip
    F = torch.nn.functional
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 7)) * 3
    x[0, :3] = [0.0, 30.0, -30.0]
    name, kw, tfun = {
        "relu": ("relu", {}, F.relu),
        "gelu": ("gelu", {}, F.gelu),
        "gelu_tanh": ("gelu", {"approximate": "tanh"}, lambda t: F.gelu(t, approximate="tanh")),
        "silu": ("silu", {}, F.silu),
    }[op]
    y, cache = getattr(R, name)(x, **kw)
    dy = rng.standard_normal(y.shape)
    dx = getattr(R, name + "_backward")(dy, cache)
    tx = _t(torch, x)
    ty = tfun(tx)
    ty.backward(torch.tensor(dy))
    _check(y, ty)
    _check(dx, tx.grad)


def test_dropout_mask_and_gradient(torch_or_skip):
    """torch draws its own masks: compare to the explicit formula on the same keep-mask."""
    torch = torch_or_skip
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 6))
    y, cache = R.dropout(x, 0.3, np.random.default_rng(7))
    keep = np.random.default_rng(7).random(x.shape) >= 0.3
    dy = rng.standard_normal(y.shape)
    tx = _t(torch, x)
    ty = tx * torch.tensor(keep) / 0.7
    ty.backward(torch.tensor(dy))
    _check(y, ty)
    _check(R.dropout_backward(dy, cache), tx.grad)
    for p, training in [(0.0, True), (0.5, False)]:
        y, cache = R.dropout(x, p, 0, training)
        assert np.array_equal(y, x) and np.array_equal(R.dropout_backward(dy, cache), dy)
    y, cache = R.dropout(x, 1.0, 0)
    assert np.all(y == 0) and np.all(R.dropout_backward(dy, cache) == 0)


@pytest.mark.parametrize(
    "shape,nshape,affine",
    [((2, 3, 5), (5,), True), ((2, 3, 5), (3, 5), True), ((4, 2, 3, 2), (2, 3, 2), True), ((3, 5), (5,), False)],
)
def test_layer_norm_matches_torch(torch_or_skip, shape, nshape, affine):
    torch = torch_or_skip
    rng = np.random.default_rng(5)
    x = rng.standard_normal(shape) * 2 + 1
    w, b = rng.standard_normal(nshape), rng.standard_normal(nshape)
    if affine:
        y, cache = R.layer_norm(x, w, b, 1e-5)
    else:
        y, cache = R.layer_norm(x, normalized_shape=nshape)
    dy = rng.standard_normal(y.shape)
    dx, dw, db = R.layer_norm_backward(dy, cache)
    tx, tw, tb = _t(torch, x), _t(torch, w), _t(torch, b)
    ty = torch.nn.functional.layer_norm(tx, nshape, tw if affine else None, tb if affine else None, 1e-5)
    ty.backward(torch.tensor(dy))
    _check(y, ty)
    _check(dx, tx.grad)
    if affine:
        _check(dw, tw.grad)
        _check(db, tb.grad)
    else:
        assert dw is None and db is None


@pytest.mark.parametrize("shape,nshape,eps", [((2, 3, 5), (5,), None), ((2, 3, 5), (3, 5), 1e-6), ((3, 4), (4,), 0.1)])
def test_rms_norm_matches_torch(torch_or_skip, shape, nshape, eps):
    torch = torch_or_skip
    rng = np.random.default_rng(6)
    x, w = rng.standard_normal(shape), rng.standard_normal(nshape)
    y, cache = R.rms_norm(x, w, eps)
    dy = rng.standard_normal(y.shape)
    dx, dw = R.rms_norm_backward(dy, cache)
    tx, tw = _t(torch, x), _t(torch, w)
    ty = torch.nn.functional.rms_norm(tx, nshape, tw, eps)
    ty.backward(torch.tensor(dy))
    _check(y, ty)
    _check(dx, tx.grad)
    _check(dw, tw.grad)
    y2, cache2 = R.rms_norm(x, eps=eps, normalized_shape=nshape)  # no weight
    tx = _t(torch, x)
    ty = torch.nn.functional.rms_norm(tx, nshape, None, eps)
    ty.backward(torch.tensor(dy))
    _check(y2, ty)
    dx2, dw2 = R.rms_norm_backward(dy, cache2)
    _check(dx2, tx.grad)
    assert dw2 is None


CE_CASES = [
    {},
    {"ignore_index": 2},
    {"weight": True},
    {"weight": True, "ignore_index": 1},
    {"reduction": "sum"},
    {"reduction": "none", "ignore_index": 0},
    {"label_smoothing": 0.2},
    {"label_smoothing": 0.1, "weight": True, "ignore_index": 3, "reduction": "mean"},
    {"label_smoothing": 0.3, "weight": True, "reduction": "none"},
    {"probs": True},
    {"probs": True, "weight": True, "label_smoothing": 0.2},
    {"probs": True, "reduction": "sum", "weight": True},
    {"probs": True, "reduction": "none", "label_smoothing": 0.1},
]


@pytest.mark.parametrize("kw", CE_CASES)
@pytest.mark.parametrize("lead", [(6,), (2, 3), ()])
def test_cross_entropy_matches_torch(torch_or_skip, kw, lead):
    torch = torch_or_skip
    rng = np.random.default_rng(7)
    kw = dict(kw)
    c = 4
    logits = rng.standard_normal(lead + (c,)) * 2
    if kw.pop("probs", False):
        targets = R.softmax(rng.standard_normal(lead + (c,)))[0]
        ttargets = torch.tensor(targets)
    else:
        targets = rng.integers(0, c, size=lead)
        if lead:
            targets.reshape(-1)[0] = kw.get("ignore_index", 0)  # at least one ignored when asked
        ttargets = torch.tensor(targets)
    if kw.get("weight"):
        kw["weight"] = rng.random(c) + 0.5
    else:
        kw.pop("weight", None)
    loss, cache = R.cross_entropy(logits, targets, **kw)
    dloss = rng.standard_normal(np.shape(loss))
    dlogits = R.cross_entropy_backward(dloss, cache)
    tl = _t(torch, logits)
    tkw = dict(kw)
    if "weight" in tkw:
        tkw["weight"] = torch.tensor(tkw["weight"])
    if tkw.get("ignore_index") is None:
        tkw.pop("ignore_index", None)
    # torch puts the classes on axis 1: move ours (the last) there
    tin = tl.movedim(-1, 1) if len(lead) > 1 else tl
    tt = ttargets.movedim(-1, 1) if (len(lead) > 1 and ttargets.dim() == tl.dim()) else ttargets
    tloss = torch.nn.functional.cross_entropy(tin, tt, **tkw)
    tloss.backward(torch.tensor(dloss))
    _check(loss, tloss)
    _check(dlogits, tl.grad)


def test_cross_entropy_nothing_counted_is_zero():
    logits = np.random.default_rng(8).standard_normal((3, 4))
    loss, cache = R.cross_entropy(logits, np.array([1, 1, 1]), ignore_index=1)
    assert loss == 0.0 and np.all(R.cross_entropy_backward(np.array(2.0), cache) == 0.0)


def _torch_rope(torch, x, positions, base, interleaved):
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.as_tensor(positions, dtype=torch.float64)[..., None] * inv
    cos, sin = torch.cos(ang), torch.sin(ang)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("positions", [None, "offset", "batch"])
def test_rope_matches_torch_formula(torch_or_skip, interleaved, positions):
    torch = torch_or_skip
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 3, 5, 6))
    pos = {None: None, "offset": np.arange(5) + 7, "batch": rng.integers(0, 50, size=(2, 1, 5))}[positions]
    y, cache = R.rope(x, pos, base=500.0, interleaved=interleaved)
    dy = rng.standard_normal(y.shape)
    tx = _t(torch, x)
    ty = _torch_rope(torch, tx, np.arange(5) if pos is None else pos, 500.0, interleaved)
    ty.backward(torch.tensor(dy))
    _check(y, ty)
    _check(R.rope_backward(dy, cache), tx.grad)


def test_rope_matches_the_llama_convention(torch_or_skip):
    """transformers' Llama rotary embedding (rotate half, base 10000), where it is importable."""
    torch = torch_or_skip
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    rng = np.random.default_rng(10)
    x = rng.standard_normal((1, 2, 4, 8))
    d = 8
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.arange(4, dtype=torch.float64)[:, None] * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    q, _ = llama.apply_rotary_pos_emb(torch.tensor(x), torch.tensor(x), emb.cos()[None], emb.sin()[None])
    _check(R.rope(x)[0], q)


# -- finite differences ------------------------------------------------------------------------------


def _upstream(fwd, *arrays, **kw):
    out = fwd(*arrays, **kw)[0]
    return np.random.default_rng(11).standard_normal(np.shape(out))


FD_CASES = [
    (
        R.linear,
        R.linear_backward,
        lambda r: [r.standard_normal((2, 3, 4)), r.standard_normal((5, 4)), r.standard_normal(5)],
        {},
    ),
    (R.softmax, R.softmax_backward, lambda r: [r.standard_normal((3, 5))], {"axis": 0}),
    (R.relu, R.relu_backward, lambda r: [r.standard_normal((3, 5)) + 0.05], {}),
    (R.gelu, R.gelu_backward, lambda r: [r.standard_normal((3, 5)) * 2], {}),
    (R.gelu, R.gelu_backward, lambda r: [r.standard_normal((3, 5)) * 2], {"approximate": "tanh"}),
    (R.silu, R.silu_backward, lambda r: [r.standard_normal((3, 5)) * 2], {}),
    (R.dropout, R.dropout_backward, lambda r: [r.standard_normal((3, 5))], {"p": 0.4, "rng": 3}),
    (
        R.layer_norm,
        R.layer_norm_backward,
        lambda r: [r.standard_normal((2, 3, 4)), r.standard_normal((3, 4)), r.standard_normal((3, 4))],
        {},
    ),
    (R.rms_norm, R.rms_norm_backward, lambda r: [r.standard_normal((2, 3, 4)), r.standard_normal((4,))], {"eps": 1e-3}),
    (R.rope, R.rope_backward, lambda r: [r.standard_normal((2, 3, 6))], {"interleaved": True}),
    (R.rope, R.rope_backward, lambda r: [r.standard_normal((2, 3, 6))], {"positions": np.array([3, 1, 4])}),
]


@pytest.mark.parametrize("case", range(len(FD_CASES)))
def test_finite_differences(case):
    fwd, bwd, make, kw = FD_CASES[case]
    arrays = make(np.random.default_rng(case))
    assert gradcheck((fwd, bwd), *arrays, **kw).ok
    errs = fd_check(fwd, bwd, arrays, _upstream(fwd, *arrays, **kw), **kw)
    assert max(errs) < 1e-6


def test_embedding_and_cross_entropy_finite_differences():
    rng = np.random.default_rng(12)
    ids = np.array([[0, 2, 2], [1, 0, 3]])
    # (padding_idx, scale_grad_by_freq and max_norm follow torch's conventions, not the derivative)
    w = rng.standard_normal((4, 3))
    assert gradcheck((lambda w: R.embedding(ids, w), R.embedding_backward), w).ok
    logits = rng.standard_normal((2, 3, 4))
    targets = np.array([[0, 1, 3], [2, 2, 1]])
    for kw in [
        {"ignore_index": 1, "weight": rng.random(4) + 0.5, "label_smoothing": 0.2},
        {"reduction": "none"},
        {"reduction": "sum", "label_smoothing": 0.1},
    ]:
        fwd = lambda z, **k: R.cross_entropy(z, targets, **k)  # noqa: E731
        assert gradcheck((fwd, R.cross_entropy_backward), logits, **kw).ok
        errs = fd_check(fwd, R.cross_entropy_backward, [logits], _upstream(fwd, logits, **kw), **kw)
        assert max(errs) < 1e-6
    probs = R.softmax(rng.standard_normal((2, 3, 4)))[0]
    fwd = lambda z, **k: R.cross_entropy(z, probs, **k)  # noqa: E731
    assert gradcheck((fwd, R.cross_entropy_backward), logits, weight=rng.random(4), label_smoothing=0.3).ok


def test_float32_stays_float32():
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    w = rng.standard_normal((4,)).astype(np.float32)
    for fwd, bwd, args in [
        (R.softmax, R.softmax_backward, (x,)),
        (R.gelu, R.gelu_backward, (x,)),
        (R.silu, R.silu_backward, (x,)),
        (R.layer_norm, R.layer_norm_backward, (x, w, w)),
        (R.rms_norm, R.rms_norm_backward, (x, w)),
        (R.rope, R.rope_backward, (x,)),
        (R.linear, R.linear_backward, (x, rng.standard_normal((5, 4)).astype(np.float32))),
    ]:
        y, cache = fwd(*args)
        assert y.dtype == np.float32, fwd.__name__
        grads = bwd(np.ones_like(y), cache)
        for g in grads if isinstance(grads, tuple) else (grads,):
            assert g is None or g.dtype == np.float32, fwd.__name__
    loss, cache = R.cross_entropy(x, np.zeros((2, 3), dtype=int), label_smoothing=0.1)
    assert loss.dtype == np.float32 and R.cross_entropy_backward(np.float32(1.0), cache).dtype == np.float32


def test_the_textbook_tier_imports_only_numpy_and_shared_primitives():
    """No fast kernel behind the formulas: only numpy, the standard library, ``_erf``, ``_random``,
    ``_docs`` (``shared_doc`` only: docstring parts, no arithmetic) and, from ``_blocks``, what both
    tiers share by design: the one attention options object, the one GQA groups formula and the
    order of attention's tangents (no tiling, no kernel)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(R))
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert modules <= {"__future__", "math", "typing", "numpy", "_erf", "_random", "_docs", "_blocks"}, modules
    from_docs = {
        a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "_docs" for a in n.names
    }
    assert from_docs <= {"shared_doc"}, from_docs
    from_blocks = {
        a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "_blocks" for a in n.names
    }
    assert from_blocks <= {"AttentionOptions", "gqa_groups", "split_attention_tangents"}, from_blocks


@pytest.mark.parametrize("name", [n for n in R.__all__ if not n.endswith(("_backward", "_jvp"))])
def test_every_forward_has_its_backward_right_under_it(name):
    """Textbook layout: ``op_backward`` is defined after ``op`` and before the next public forward,
    and ``op_jvp`` (forward mode), where there is one, after the backward."""
    import inspect

    lines = {n: inspect.getsourcelines(getattr(R, n))[1] for n in R.__all__}
    forwards = sorted(lines[n] for n in R.__all__ if not n.endswith(("_backward", "_jvp")))
    start = lines[name]
    nxt = min([ln for ln in forwards if ln > start], default=float("inf"))
    assert start < lines[name + "_backward"] < nxt
    if name + "_jvp" in lines:
        assert lines[name + "_backward"] < lines[name + "_jvp"] < nxt
