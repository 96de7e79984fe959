"""DeepSeek sparse attention's pairs (``lightning_indexer``, ``sparse_attention``,
``indexer_kl_loss``) and the top-k choice (``index_topk``), both tiers:

* every backward, JVP and second order against central differences (float64, random upstream
  gradients and tangents, inputs away from the ReLU's kink);
* against torch autograd and ``torch.func.jvp`` of the same formulas (the indexer's scores, dense
  attention with the chosen keys as a mask, the KL loss with its target detached);
* the fast tier equal to the textbook one (1e-12), hypothesis over shapes, heads (GQA), masks,
  empty slots and reductions;
* ``index_topk`` against ``torch.topk`` of the masked scores; bad input named.
"""

import numpy as np
import pytest
from _fd import fd_gradients
from _oracles import rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn.functional as F
from npattn.functional import reference as R

TIERS = pytest.mark.parametrize("tier", [R, F], ids=["textbook", "fast"])


def close(a, b, tol=1e-12):
    """max |a - b| <= tol * max(1, max |b|), equal shapes."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.size:
        err = float(np.max(np.abs(a - b)))
        assert err <= tol * max(1.0, float(np.max(np.abs(b)))), err


def _indexer_case(rng, lead=(2,), h=3, lq=5, lk=6, d=4):
    q, k = rng.standard_normal(lead + (h, lq, d)), rng.standard_normal(lead + (lk, d))
    w = rng.standard_normal(lead + (lq, h))
    return q, k, w


def _causal_topk(rng, lead, lq, lk, topk):
    """A top-k choice of causal keys (bottom-right: query l sees keys 0 .. l + lk - lq), from random scores."""
    mask = np.arange(lk) <= np.arange(lq)[:, None] + (lk - lq)
    return F.index_topk(rng.standard_normal(lead + (lq, lk)), topk, mask=mask)


def _sparse_case(rng, lead=(2,), h=4, hk=2, lq=6, lk=6, e=3, ev=2, topk=3):
    q = rng.standard_normal(lead + (h, lq, e))
    k, v = rng.standard_normal(lead + (hk, lk, e)), rng.standard_normal(lead + (hk, lk, ev))
    idx = _causal_topk(rng, lead, lq, lk, topk)
    return q, k, v, idx


def _kl_case(rng, lead=(2,), h=3, lq=5, lk=5):
    scores = rng.standard_normal(lead + (lq, lk))
    attn = rng.random(lead + (h, lq, lk))
    mask = np.tril(np.ones((lq, lk), bool))
    mask[2, :] = False  # a row that sees nothing
    return scores, attn, mask


# -- central differences -------------------------------------------------------------------------------------
@TIERS
def test_lightning_indexer_against_central_differences(tier):
    rng = np.random.default_rng(7)
    q, k, w = _indexer_case(rng)
    out, cache = tier.lightning_indexer(q, k, w, scale=0.7)
    assert np.abs(cache.s).min() > 1e-3  # no score within a difference step of the ReLU's kink
    dout = rng.standard_normal(out.shape)
    # piecewise linear in q and k: steps of 1e-5 have no truncation error and less rounding
    num = fd_gradients(lambda *xs: np.sum(tier.lightning_indexer(*xs, scale=0.7)[0] * dout), [q, k, w], eps=1e-5)
    for name, g, n in zip("qkw", tier.lightning_indexer_backward(dout, cache), num):
        assert rel_err(g, n) < 1e-6, name
    t = [rng.standard_normal(x.shape) for x in (q, k, w)]
    eps = 1e-6
    up = tier.lightning_indexer(*(x + eps * u for x, u in zip((q, k, w), t)), scale=0.7)[0]
    down = tier.lightning_indexer(*(x - eps * u for x, u in zip((q, k, w), t)), scale=0.7)[0]
    assert rel_err(tier.lightning_indexer_jvp(cache, *t), (up - down) / (2 * eps)) < 1e-6
    _second_order_check(tier.lightning_indexer, tier.lightning_indexer_backward_jvp, (q, k, w), dict(scale=0.7), rng)


def _second_order_check(forward, backward_jvp, arrays, kwargs, rng, eps=1e-6):
    """``backward_jvp``'s tangents against central differences of the backward along the tangents
    and ``ddout``; its gradients equal the backward's."""
    out, cache = forward(*arrays, **kwargs)
    dout, ddout = rng.standard_normal(np.shape(out)), rng.standard_normal(np.shape(out))
    t = [rng.standard_normal(x.shape) for x in arrays]
    grads, tgrads = backward_jvp(dout, cache, tuple(t), ddout)

    def grads_at(sign):
        moved = [x + sign * eps * u for x, u in zip(arrays, t)]
        c = forward(*moved, **kwargs)[1]
        return backward_jvp(dout + sign * eps * ddout, c, None)[0]

    up, down = grads_at(1), grads_at(-1)
    for i, (tg, a, b) in enumerate(zip(tgrads, up, down)):
        assert rel_err(tg, (a - b) / (2 * eps)) < 1e-6, i
    plain = backward_jvp(dout, cache, None)[0]
    for a, b in zip(grads, plain):
        np.testing.assert_array_equal(a, b)


@TIERS
def test_sparse_attention_against_central_differences(tier):
    rng = np.random.default_rng(1)
    q, k, v, idx = _sparse_case(rng)
    assert (idx == -1).any() and (idx >= 0).any()  # early queries see fewer than topk keys

    def fwd(q, k, v, **kw):
        return tier.sparse_attention(q, k, v, idx, **kw)

    out, cache = fwd(q, k, v, scale=0.6)
    dout = rng.standard_normal(out.shape)
    num = fd_gradients(lambda *xs: np.sum(fwd(*xs, scale=0.6)[0] * dout), [q, k, v])
    for name, g, n in zip("qkv", tier.sparse_attention_backward(dout, cache), num):
        assert rel_err(g, n) < 1e-6, name
    t = [rng.standard_normal(x.shape) for x in (q, k, v)]
    eps = 1e-6
    up = fwd(*(x + eps * u for x, u in zip((q, k, v), t)), scale=0.6)[0]
    down = fwd(*(x - eps * u for x, u in zip((q, k, v), t)), scale=0.6)[0]
    assert rel_err(tier.sparse_attention_jvp(cache, *t), (up - down) / (2 * eps)) < 1e-6
    _second_order_check(fwd, tier.sparse_attention_backward_jvp, (q, k, v), dict(scale=0.6), rng)


@TIERS
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_indexer_kl_loss_against_central_differences(tier, reduction):
    rng = np.random.default_rng(2)
    scores, attn, mask = _kl_case(rng)

    def fwd(s, **kw):
        return tier.indexer_kl_loss(s, attn, mask=mask, reduction=reduction, **kw)

    loss, cache = fwd(scores)
    dout = 1.7
    (num,) = fd_gradients(lambda s: fwd(s)[0] * dout, [scores])
    g = tier.indexer_kl_loss_backward(dout, cache)
    assert rel_err(g, num) < 1e-6
    assert not g[:, 2].any() and not g[np.broadcast_to(~mask, g.shape)].any()  # hidden keys, empty row: 0
    ts = rng.standard_normal(scores.shape)
    eps = 1e-6
    fd = (fwd(scores + eps * ts)[0] - fwd(scores - eps * ts)[0]) / (2 * eps)
    assert rel_err(tier.indexer_kl_loss_jvp(cache, ts), fd) < 1e-6
    _second_order_check(fwd, tier.indexer_kl_loss_backward_jvp, (scores,), {}, rng)


def test_indexer_kl_loss_is_the_textbook_kl_and_zero_at_the_target():
    rng = np.random.default_rng(3)
    scores, attn, mask = _kl_case(rng, lead=())
    loss, _ = F.indexer_kl_loss(scores, attn, mask=mask)
    want = 0.0
    for row in range(scores.shape[0]):
        vis = mask[row]
        if not vis.any():
            continue
        p = attn[:, row, vis].sum(0)
        p = p / p.sum()
        q = np.exp(scores[row, vis]) / np.exp(scores[row, vis]).sum()
        want += float(np.sum(p * np.log(p / q)))
    close(loss, want)
    # the indexer matching the main attention's distribution costs nothing and gets no gradient
    target = np.where(mask, attn.sum(0), 0)
    logits = np.where(mask, np.log(np.where(target > 0, target, 1)), 0.0)
    loss0, cache0 = F.indexer_kl_loss(logits, attn, mask=mask)
    assert abs(float(loss0)) < 1e-14
    assert np.abs(F.indexer_kl_loss_backward(1.0, cache0)).max() < 1e-15


# -- against torch --------------------------------------------------------------------------------------------
def test_pairs_against_torch_autograd_and_jvp():
    torch = pytest.importorskip("torch")
    from torch.func import jvp

    rng = np.random.default_rng(4)
    T = torch.from_numpy

    # the lightning indexer, as transformers' DeepseekV32Indexer computes its scores
    q, k, w = _indexer_case(rng)

    def indexer(q, k, w):
        s = torch.relu(q @ k.unsqueeze(-3).transpose(-1, -2) * 0.5)  # (B, H, Lq, Lk)
        return (w.transpose(-1, -2).unsqueeze(-1) * s).sum(-3)

    _against_torch(
        F.lightning_indexer,
        F.lightning_indexer_backward,
        F.lightning_indexer_jvp,
        indexer,
        (q, k, w),
        dict(scale=0.5),
        rng,
        torch,
        jvp,
    )

    # attention over the chosen keys: dense attention with the choice as a mask
    q, k, v, idx = _sparse_case(rng)
    chosen = T((idx[..., None] == np.arange(k.shape[-2])).any(-2))[:, None]  # (B, 1, Lq, Lk)

    def dense(q, k, v):
        kr, vr = (x.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for x in (k, v))
        s = (q @ kr.transpose(-1, -2) * 0.6).masked_fill(~chosen, float("-inf"))
        return torch.softmax(s, -1) @ vr

    def fwd(q, k, v, **kw):
        return F.sparse_attention(q, k, v, idx, **kw)

    _against_torch(
        fwd, F.sparse_attention_backward, F.sparse_attention_jvp, dense, (q, k, v), dict(scale=0.6), rng, torch, jvp
    )

    # the KL loss, its target detached (DeepSeek's): gradient to the scores only
    scores, attn, mask = _kl_case(rng)
    mask[2, :] = True  # torch's softmax needs a visible key per row
    m = T(mask)

    def kl(s):
        target = torch.where(m, T(attn).sum(-3), 0.0).detach()
        target = target / target.sum(-1, keepdim=True)
        logq = torch.log_softmax(s.masked_fill(~m, float("-inf")), -1)
        return torch.where(m, target * (torch.log(torch.where(m, target, 1.0)) - logq), 0.0).sum()

    def fwd_kl(s):
        return F.indexer_kl_loss(s, attn, mask=mask)

    _against_torch(
        fwd_kl,
        F.indexer_kl_loss_backward,
        F.indexer_kl_loss_jvp,
        kl,
        (scores,),
        {},
        rng,
        torch,
        jvp,
        dout=np.array(1.3),
    )


def _against_torch(fwd, backward, jvp_fn, torch_fn, arrays, kwargs, rng, torch, jvp, dout=None):
    out, cache = fwd(*arrays, **kwargs)
    xs = [torch.from_numpy(a).requires_grad_(True) for a in arrays]
    ref = torch_fn(*xs)
    close(out, ref.detach().numpy())
    dout = rng.standard_normal(out.shape) if dout is None else dout
    ref.backward(torch.as_tensor(dout))
    grads = backward(dout, cache)
    grads = grads if isinstance(grads, tuple) else (grads,)
    for g, x in zip(grads, xs):
        close(g, x.grad.numpy())
    t = [rng.standard_normal(a.shape) for a in arrays]
    _, tref = jvp(torch_fn, tuple(torch.from_numpy(a) for a in arrays), tuple(torch.from_numpy(u) for u in t))
    close(jvp_fn(cache, *t), tref.numpy())


def test_index_topk_against_torch_topk():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    scores = rng.standard_normal((2, 6, 9))
    mask = (np.arange(9) <= np.arange(6)[:, None] + 3) & (rng.random((2, 1, 9)) > 0.2)  # causal and padding
    idx = F.index_topk(scores, 4, mask=mask)
    ref = torch.from_numpy(np.where(mask, scores, -np.inf)).topk(4, dim=-1).indices.numpy()
    seen = mask.sum(-1)
    for b in range(2):
        for row in range(6):
            n = min(4, seen[b, row])
            np.testing.assert_array_equal(idx[b, row, :n], ref[b, row, :n])
            assert (idx[b, row, n:] == -1).all()
    assert F.index_topk(scores, 20).shape == (2, 6, 9)  # K = min(topk, Lk)


# -- fast equals textbook -------------------------------------------------------------------------------------
@st.composite
def _shapes(draw):
    lead = tuple(draw(st.lists(st.integers(1, 2), max_size=2)))
    hk = draw(st.integers(1, 2))
    h = hk * draw(st.integers(1, 3))
    lq, lk = draw(st.integers(1, 5)), draw(st.integers(1, 7))
    return lead, h, hk, lq, lk, draw(st.integers(1, 8)), draw(st.integers(0, 2**16))


@settings(max_examples=40)
@given(_shapes())
def test_fast_equals_textbook(shape):
    lead, h, hk, lq, lk, topk, seed = shape
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal(lead + (h, lq, 4)), rng.standard_normal(lead + (lk, 4))
    w = rng.standard_normal(lead + (lq, h))
    _tiers_equal("lightning_indexer", (q, k, w), {}, rng)
    qa = rng.standard_normal(lead + (h, lq, 3))
    ka, va = rng.standard_normal(lead + (hk, lk, 3)), rng.standard_normal(lead + (hk, lk, 2))
    mask = rng.random(lead + (lq, lk)) > 0.3
    idx = F.index_topk(rng.standard_normal(lead + (lq, lk)), topk, mask=mask)
    _tiers_equal("sparse_attention", (qa, ka, va), dict(indices=idx), rng)
    for reduction in ("sum", "mean"):
        kw = dict(attn=rng.random(lead + (h, lq, lk)), mask=mask, reduction=reduction)
        _tiers_equal("indexer_kl_loss", (rng.standard_normal(lead + (lq, lk)),), kw, rng)


def _tiers_equal(op, arrays, kwargs, rng):
    def call(tier):
        f = getattr(tier, op)
        if op == "sparse_attention":
            return f(*arrays, kwargs["indices"])
        return f(*arrays, **kwargs)

    (out_f, c_f), (out_r, c_r) = call(F), call(R)
    close(out_f, out_r)
    dout = rng.standard_normal(np.shape(out_r))
    t = tuple(rng.standard_normal(a.shape) for a in arrays)
    ddout = rng.standard_normal(np.shape(out_r))
    g_f, tg_f = getattr(F, op + "_backward_jvp")(dout, c_f, t, ddout)
    g_r, tg_r = getattr(R, op + "_backward_jvp")(dout, c_r, t, ddout)
    for a, b in zip(g_f + tg_f, g_r + tg_r):
        close(a, b)
    plain = getattr(F, op + "_backward")(dout, c_f)
    for a, b in zip(g_f, plain if isinstance(plain, tuple) else (plain,)):
        np.testing.assert_array_equal(a, b)  # the second order's gradients are the backward's
    close(getattr(F, op + "_jvp")(c_f, *t), getattr(R, op + "_jvp")(c_r, *t))


# -- bad input ------------------------------------------------------------------------------------------------
def test_bad_input_is_named():
    rng = np.random.default_rng(6)
    q, k, w = _indexer_case(rng)
    with pytest.raises(ValueError, match="k: expected shape"):
        F.lightning_indexer(q, k[..., :3], w)
    with pytest.raises(ValueError, match="weights: expected shape"):
        F.lightning_indexer(q, k, w[..., :2])
    with pytest.raises(TypeError, match="k: expected the dtype of q"):
        F.lightning_indexer(q, k.astype(np.float32), w)
    q, k, v, idx = _sparse_case(rng)
    with pytest.raises(ValueError, match=r"indices: expected key positions in \[-1, 6\)"):
        F.sparse_attention(q, k, v, np.where(idx == 0, 6, idx))
    with pytest.raises(ValueError, match="indices: a key is chosen twice"):
        F.sparse_attention(q, k, v, np.concatenate([idx[..., :1], idx[..., :1]], -1).clip(0))
    with pytest.raises(TypeError, match="indices: expected an integer array"):
        F.sparse_attention(q, k, v, idx.astype(float))
    with pytest.raises(ValueError, match="k: expected a number of heads dividing"):
        F.sparse_attention(q[:, :3], k, v, idx)
    with pytest.raises(ValueError, match="v: expected shape"):
        F.sparse_attention(q, k, v[..., :4, :], idx)
    with pytest.raises(TypeError, match="topk: expected an integer"):
        F.index_topk(np.zeros((2, 2)), 1.5)
    with pytest.raises(TypeError, match="mask: expected a bool array"):
        F.index_topk(np.zeros((2, 2)), 1, mask=np.ones((2, 2)))
    scores, attn, mask = _kl_case(rng)
    with pytest.raises(ValueError, match="attn: expected attention weights >= 0"):
        F.indexer_kl_loss(scores, -attn)
    with pytest.raises(ValueError, match="reduction: expected 'sum' or 'mean'"):
        F.indexer_kl_loss(scores, attn, reduction="batchmean")
    with pytest.raises(ValueError, match="attn: expected shape"):
        F.indexer_kl_loss(scores, attn[..., :3])
    with pytest.raises(ValueError, match="mask: expected a shape broadcastable"):
        F.indexer_kl_loss(scores, attn, mask=mask[:, :3])
    _, cache = F.indexer_kl_loss(scores, attn)
    with pytest.raises(TypeError, match="cache: sparse_attention_backward expected"):
        F.sparse_attention_backward(np.zeros(3), cache)


def test_npattn_check_covers_sparse_attention():
    """``npattn check`` (both orders) runs the three pairs and MLA restricted to the indexer's choice."""
    from npattn.tools.check import cases

    for order in (1, 2):
        found = {n: t for n, t in cases(0, order=order) if n.startswith(("lightning", "sparse", "indexer", "DeepSeek"))}
        assert len(found) == 4, sorted(found)
        for name, thunk in found.items():
            assert thunk().ok, (order, name)
