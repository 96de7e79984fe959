"""Determinism, threads and memory.

* the same seeds give bit-identical parameters, dropout masks and training runs (in this process
  and in a fresh one);
* the functional API is safe to call from many threads at once (each result bit-identical to the
  single-threaded one); separate module instances train independently in threads; ``no_grad`` is
  thread-local;
* ``backward`` releases every array the forward kept; ``no_grad`` forwards keep none: no
  ``(L, L)`` array is held after an inference forward, measured with ``tracemalloc``.
"""

import gc
import os
import subprocess
import sys
import threading
import tracemalloc
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from _hardening import MODULES, build_case, cache_arrays, walk_arrays

import npattn
import npattn.functional as F
from npattn.models import TinyTransformer
from npattn.nn.module import Module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _first(y):
    return y[0] if isinstance(y, tuple) else y


def _tuple(g):
    return g if isinstance(g, tuple) else (g,)


# ----------------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("name", sorted(MODULES))
def test_same_seed_same_parameters_outputs_and_dropout_masks(name):
    runs = []
    for _ in range(2):
        m, inputs, kw = build_case(name, 11)
        m.train()
        ys = [_first(m(*inputs, **kw)) for _ in range(2)]  # two forwards: the dropout stream advances
        g = _tuple(m.backward(np.ones(ys[-1].shape)))
        runs.append((m.state_dict(), ys, g, {n: p.grad.copy() for n, p in m.named_parameters()}))
    (sd1, ys1, g1, pg1), (sd2, ys2, g2, pg2) = runs
    assert list(sd1) == list(sd2)
    for k in sd1:
        np.testing.assert_array_equal(sd1[k], sd2[k], err_msg=k)
    for a, b in zip(ys1 + [x for x in g1 if x is not None], ys2 + [x for x in g2 if x is not None]):
        np.testing.assert_array_equal(a, b)
    for k in pg1:
        np.testing.assert_array_equal(pg1[k], pg2[k], err_msg=k)


def test_int_seed_equals_generator_and_different_seeds_differ():
    for make in (
        lambda r: npattn.Linear(5, 4, rng=r),
        lambda r: npattn.MultiHeadAttention(6, 8, 2, rng=r),
        lambda r: npattn.EncoderBlock(6, 2, 8, rng=r),
        lambda r: TinyTransformer(5, 6, 8, 2, 1, 8, rng=r),
    ):
        a, b, c = make(3).state_dict(), make(np.random.default_rng(3)).state_dict(), make(4).state_dict()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        assert any(not np.array_equal(a[k], c[k]) for k in a if a[k].std() > 0)
    x = np.ones((4, 100))
    m1, m2 = npattn.Dropout(0.5, rng=7), npattn.Dropout(0.5, rng=np.random.default_rng(7))
    for _ in range(3):
        np.testing.assert_array_equal(m1(x), m2(x))


TRAIN_SCRIPT = r"""
import hashlib, numpy as np
from npattn.models import TinyTransformer
from npattn.nn.module import Module
from npattn.optim import AdamW, clip_grad_norm_

def train(seed, steps=3):
    model = TinyTransformer(vocab_size=7, context_length=8, d_model=16, num_heads=2, num_layers=2, d_ff=32,
                            dropout=0.1, rng=seed)
    opt = AdamW(model, lr=1e-2)
    data = np.random.default_rng(seed + 1)
    losses = []
    for _ in range(steps):
        ids = data.integers(0, 7, (4, 8))
        opt.zero_grad()
        loss, dlogits = model.loss(ids[:, :-1], ids[:, 1:])
        model.backward(dlogits)
        clip_grad_norm_(model, 1.0)
        opt.step()
        losses.append(loss)
    h = hashlib.sha256(np.array(losses).tobytes())
    for k, v in model.state_dict().items():
        h.update(k.encode()); h.update(np.ascontiguousarray(v).tobytes())
    return h.hexdigest()
"""


def test_training_is_bit_identical_across_runs_and_processes():
    ns = {}
    exec(TRAIN_SCRIPT, ns)
    first, second, other = ns["train"](5), ns["train"](5), ns["train"](6)
    assert first == second and first != other
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONHASHSEED="random")
    r = subprocess.run(
        [sys.executable, "-c", TRAIN_SCRIPT + "\nprint(train(5))"], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == first


# ----------------------------------------------------------------------------------- threads
def _functional_task(seed):
    """Forward + backward of several ops on inputs drawn from ``seed``: a list of arrays."""
    rng = np.random.default_rng(seed)
    q, k, v = (
        rng.standard_normal((2, 4, 48, 16)),
        rng.standard_normal((2, 2, 64, 16)),
        rng.standard_normal((2, 2, 64, 8)),
    )
    mask = rng.random((48, 64)) < 0.8
    res = []
    out, c = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=bool(seed % 2), enable_gqa=True, dropout_p=0.1, rng=seed
    )
    res += [out, *F.scaled_dot_product_attention_backward(np.ones(out.shape), c)]
    kr, vr = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    out, c = F.memory_efficient_attention(q, kr, vr, attn_mask=mask, is_causal=bool(seed % 2), block_size=16)
    res += [out, *F.memory_efficient_attention_backward(np.ones(out.shape), c)]
    x = rng.standard_normal((8, 32, 24))
    y, c = F.layer_norm(x, rng.standard_normal(24), rng.standard_normal(24))
    res += [y, *F.layer_norm_backward(y, c)]
    y, c = F.linear(x, rng.standard_normal((12, 24)), rng.standard_normal(12))
    res += [y, *F.linear_backward(y, c)]
    y, c = F.softmax(x * 10, axis=1)
    res += [y, F.softmax_backward(x, c)]
    y, c = F.gelu(x, "tanh")
    res += [y, F.gelu_backward(x, c)]
    y, c = F.dropout(x, 0.3, seed)
    res += [y, F.dropout_backward(x, c)]
    loss, c = F.cross_entropy(x, rng.integers(0, 24, (8, 32)))
    res += [loss, F.cross_entropy_backward(np.ones(()), c)]
    return res


def test_functional_api_is_thread_safe():
    seeds = list(range(16))
    expected = [_functional_task(s) for s in seeds]
    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(_functional_task, seeds * 3))
    for i, res in enumerate(got):
        for a, b in zip(expected[i % len(seeds)], res):
            np.testing.assert_array_equal(a, b)


def _train_module(seed):
    m = npattn.EncoderBlock(16, 4, 32, dropout=0.1, norm_first=True, causal=True, rng=seed)
    x = np.random.default_rng(seed).standard_normal((2, 12, 16))
    for _ in range(3):
        y = m(x)
        m.backward(y)
        for p in m.parameters():
            p.data -= 0.01 * p.grad
        m.zero_grad()
    return m.state_dict()


def test_separate_module_instances_train_independently_in_threads():
    seeds = list(range(8))
    expected = [_train_module(s) for s in seeds]
    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(_train_module, seeds))
    for e, g in zip(expected, got):
        for k in e:
            np.testing.assert_array_equal(e[k], g[k], err_msg=k)


def test_no_grad_is_thread_local():
    x = np.random.default_rng(0).standard_normal((2, 5, 6))
    m_a, m_b = npattn.MultiHeadAttention(6, 6, 2, rng=0), npattn.MultiHeadAttention(6, 6, 2, rng=0)
    inside, b_done = threading.Event(), threading.Event()
    seen = {}

    def thread_a():
        with npattn.no_grad():
            inside.set()
            assert b_done.wait(10)
            seen["a_enabled"] = npattn.is_grad_enabled()
            m_a(x)
            seen["a_cache"] = m_a._cache
        seen["a_after"] = npattn.is_grad_enabled()

    def thread_b():
        assert inside.wait(10)  # thread a is inside no_grad now
        seen["b_enabled"] = npattn.is_grad_enabled()
        m_b(x)
        seen["b_cached"] = m_b._cache is not None
        m_b.backward(np.ones((2, 5, 6)))
        b_done.set()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"a_enabled": False, "a_cache": None, "a_after": True, "b_enabled": True, "b_cached": True}
    assert npattn.is_grad_enabled()


# ----------------------------------------------------------------------------------- memory
def _kept_by_caller(m, inputs, kw):
    """ids of the arrays that outlive a backward legitimately: the caller's inputs and masks,
    parameters (and the arrays they are views of, e.g. a fused weight), gradients and buffers."""
    keep = [*inputs, *(v for v in kw.values() if isinstance(v, np.ndarray))]
    for p in m.parameters():
        keep += [p.data, p.grad, p.data.base]
    keep += [b for _, b in m.named_buffers()]
    return {id(a) for a in keep}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_backward_releases_every_cached_array(name):
    m, inputs, kw = build_case(name, 12)
    y = _first(m(*inputs, **kw))
    keep = _kept_by_caller(m, inputs, kw)
    refs = [(path, weakref.ref(a)) for path, a in cache_arrays(m) if id(a) not in keep]
    if name not in ("Linear", "Embedding"):  # these keep only the caller's input and their weight
        assert refs, "the forward kept nothing?"
    dy = np.ones(y.shape)
    del y
    grads = m.backward(dy)
    del grads
    gc.collect()
    for _, sub in m.named_modules():
        assert sub._cache is None
    # what stays is only what a module keeps in its workspace for the next step's reuse
    pooled = {id(b) for b in _pooled(m)}
    alive = [path for path, r in refs if r() is not None and id(_base(r())) not in pooled]
    assert not alive, f"still alive after backward: {alive}"


def _base(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _workspace_arrays(module):
    ws = module.__dict__.get("_ws")
    return [] if ws is None else [b for stack in ws._free.values() for b in stack]


def _pooled(m):
    """Every array kept for reuse: the modules' workspaces and the thread's shared scratch."""
    scratch = [b for stack in Module._scratch()._free.values() for b in stack]
    return [b for _, sub in m.named_modules() for b in _workspace_arrays(sub)] + scratch


@pytest.mark.parametrize("name", sorted(MODULES))
def test_workspace_holds_one_step_and_does_not_grow(name):
    """A second and third training step reuse the first step's arrays: the workspaces hold the
    same arrays (no new ones), and never anything returned to the caller."""
    m, inputs, kw = build_case(name, 12)
    held = []
    for _ in range(3):
        y = _first(m(*inputs, **kw))
        grads = m.backward(np.ones(y.shape))
        outs = [y] + [g for g in (grads if isinstance(grads, tuple) else (grads,)) if isinstance(g, np.ndarray)]
        pooled = _pooled(m)
        assert not {id(_base(o)) for o in outs} & {id(b) for b in pooled}
        held.append(sorted(id(b) for b in pooled))
    assert held[1] == held[2]
    m.eval()  # evaluation mode releases them
    assert not _pooled(m)


def test_workspace_reuse_keeps_the_numbers():
    """Steps that reuse the workspace give exactly the outputs and gradients of a fresh module."""
    from npattn.nn import EncoderBlock

    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal((2, 2, 5, 8)), rng.standard_normal((2, 2, 5, 8))
    warm = EncoderBlock(8, 2, 16, dropout=0.0, causal=True, rng=0)
    for _ in range(2):  # fill the workspaces with other numbers
        warm(rng.standard_normal(x.shape))
        warm.backward(rng.standard_normal(x.shape))
    warm.zero_grad()
    fresh = EncoderBlock(8, 2, 16, dropout=0.0, causal=True, rng=0)
    for m in (warm, fresh):
        m.zero_grad()
    y1, y2 = warm(x), fresh(x)
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_array_equal(warm.backward(dy), fresh.backward(dy))
    for (n1, p1), (_, p2) in zip(warm.named_parameters(), fresh.named_parameters()):
        np.testing.assert_array_equal(p1.grad, p2.grad, err_msg=n1)


L, H, D = 512, 4, 32
LL_BYTES = H * L * L * 8  # one (H, L, L) float64 array


def _retained_by_forward(m, x, grad):
    """Bytes still allocated after ``y = m(x)`` (``y`` kept), with or without ``no_grad``."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        if grad:
            y = m(x)
        else:
            with npattn.no_grad():
                y = m(x)
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert y.shape == x.shape[:-1] + (D,)
    return retained


def _square_arrays(m):
    """Arrays reachable from the module (kept state and attributes) with an ``(L, L)`` tail."""
    found = []
    for name, sub in m.named_modules():
        found += [p for p, a in walk_arrays(vars(sub), name or "<root>") if a.ndim >= 2 and a.shape[-2:] == (L, L)]
    return found


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(causal=True), dict(memory_efficient=True, causal=True)],
    ids=["plain", "causal", "memory_efficient"],
)
def test_no_grad_forward_keeps_no_square_arrays(kw):
    x = np.random.default_rng(0).standard_normal((1, L, D))
    m = npattn.MultiHeadAttention(D, D, H, rng=0, **kw)
    m(x[:, :8])  # warm-up: lazily built helpers are not counted below
    m.backward(np.ones((1, 8, D)))
    nograd = _retained_by_forward(m, x, grad=False)
    assert nograd < LL_BYTES / 4, f"no_grad forward retained {nograd} bytes"
    assert all(sub._cache is None for sub in m.modules())
    assert not _square_arrays(m)
    with_grad = _retained_by_forward(m, x, grad=True)
    if kw.get("memory_efficient"):
        assert with_grad < LL_BYTES / 4  # the memory-efficient core never keeps an (L, L) array
        assert not _square_arrays(m)
    elif kw.get("causal"):
        assert with_grad >= LL_BYTES / 2  # the causal path keeps only the lower half (and a bit)
        assert with_grad > 20 * nograd
    else:
        assert with_grad >= LL_BYTES
        assert _square_arrays(m)
    m.backward(np.ones((1, L, D)))
    assert not _square_arrays(m)


def test_layers_share_one_scratch_for_their_backward():
    """A deeper model keeps one layer's worth of backward arrays, not one per layer."""
    from npattn.nn import EncoderBlock

    def held(n_layers):
        blocks = [EncoderBlock(16, 2, 32, dropout=0.0, rng=i) for i in range(n_layers)]
        x = np.random.default_rng(0).standard_normal((2, 6, 16))
        blocks[0].eval().train()  # eval() empties the thread's scratch: count this model's alone
        for _ in range(2):
            h = x
            for blk in blocks:
                h = blk(h)
            g = np.ones_like(h)
            for blk in reversed(blocks):
                g = blk.backward(g)
        return sum(b.nbytes for stack in Module._scratch()._free.values() for b in stack)

    assert held(1) > 0 and held(4) == held(1)


def test_workspace_gives_back_views_once_and_keys_by_dtype():
    """``give`` takes views of the arrays ``empty`` handed out (once, however often given back);
    ``empty`` finds them again whether the dtype is named by a type or by a ``np.dtype``."""
    from npattn.functional._workspace import Workspace

    ws = Workspace()
    a = ws.empty((4, 6), np.float32)
    ws.give(a.T[1:], a, None, np.ones((4, 6), np.float32)[::2])  # the last: not from a workspace
    assert ws.nbytes() == a.nbytes
    assert ws.empty((6, 4), np.dtype(np.float32)).base is a.base
    assert ws.nbytes() == 0
    assert ws.empty((24,), np.float64).base is not a.base


def test_attention_geometry_is_reused_read_only_across_calls():
    """The block plan and the small band masks of a call are found again by the next call with the
    same geometry (no rebuilding each step), and the shared masks cannot be written to."""
    from npattn.functional import _blocks

    b = _blocks.band(16, 16, True, "top_left", None)
    assert _blocks.row_blocks(16, 16, 1, 8, b) is _blocks.row_blocks(16, 16, 1, 8, b)
    m1 = _blocks.band_hidden(b, 0, 16, 0, 8, {})
    m2 = _blocks.band_hidden(b, 0, 16, 0, 8, {})
    assert m1 is m2 and not m1.flags.writeable
    np.testing.assert_array_equal(m1, np.arange(16)[:, None] > np.arange(8)[None, :])
    with pytest.raises(ValueError):
        m1[0, 0] = True
    big = _blocks.band_hidden(b, 0, 200, 0, 200, {})  # above the shared size: built for the call
    assert big.flags.writeable
