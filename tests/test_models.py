"""TinyTransformer (npattn.models) and the demo's training pieces (npattn.demo)."""

from dataclasses import replace

import numpy as np
import pytest

from npattn import functional as F
from npattn import gradcheck
from npattn.models import TinyTransformer
from npattn.tools.demo import IGNORE_INDEX, SEP, TASKS, HeldOutSet, answer_of, make_examples, train


def tiny(num_layers=1, **kwargs):
    kwargs.setdefault("rng", 0)
    return TinyTransformer(5, 6, 8, 2, num_layers, 12, **kwargs)


def ids_of(shape, seed=1, vocab=5):
    return np.random.default_rng(seed).integers(0, vocab, shape)


# -- gradients ---------------------------------------------------------------------------------
@pytest.mark.parametrize("num_layers", [1, 2])
def test_gradcheck_every_parameter(num_layers):
    report = gradcheck(tiny(num_layers), ids_of((2, 6)))
    assert report.ok, str(report)
    names = {r.name for r in report.rows}
    assert {"tok_emb.weight", "pos_emb.weight", "norm.weight", "head.weight", "head.bias"} <= names
    assert f"blocks.{num_layers - 1}.mha.W_query.weight" in names


def test_gradcheck_with_dropout_gelu_and_unbatched_ids():
    report = gradcheck(tiny(2, dropout=0.2, activation="gelu"), ids_of((5,)))
    assert report.ok, str(report)


def test_gradcheck_three_batch_axes():
    assert gradcheck(tiny(1), ids_of((2, 2, 3))).ok


def test_backward_accumulates_and_releases_state():
    m = tiny(2)
    ids = ids_of((2, 6))
    g = np.random.default_rng(2).standard_normal((2, 6, 5))
    m(ids)
    assert m.backward(g) is None
    first = {n: p.grad.copy() for n, p in m.named_parameters()}
    assert all(np.any(v != 0) for v in first.values())
    with pytest.raises(RuntimeError):
        m.backward(g)
    m(ids)
    m.backward(g)
    for n, p in m.named_parameters():
        np.testing.assert_allclose(p.grad, 2 * first[n], rtol=1e-12, atol=1e-15)


def test_backward_before_forward_raises():
    with pytest.raises(RuntimeError):
        tiny().backward(np.zeros((1, 6, 5)))


# -- forward, shapes, state dict --------------------------------------------------------------
def test_state_dict_keys():
    keys = list(tiny(2).state_dict())
    assert keys[:2] == ["tok_emb.weight", "pos_emb.weight"]
    assert keys[-4:] == ["norm.weight", "norm.bias", "head.weight", "head.bias"]
    assert "blocks.0.mha.W_query.weight" in keys and "blocks.1.ffn.linear2.bias" in keys
    assert "blocks.1.layernorm2.weight" in keys and "blocks.2.mha.W_query.weight" not in keys


def test_state_dict_round_trip_gives_same_logits():
    a, b = tiny(2, rng=0), tiny(2, rng=1)
    ids = ids_of((3, 6))
    assert not np.allclose(a(ids), b(ids))
    b.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(a(ids), b(ids))


def test_same_seed_same_weights():
    for (n, p), (_, q) in zip(tiny(2, rng=7).named_parameters(), tiny(2, rng=7).named_parameters()):
        np.testing.assert_array_equal(p.data, q.data, err_msg=n)


@pytest.mark.parametrize("shape", [(6,), (2, 4), (2, 3, 6)])
def test_output_shapes(shape):
    assert tiny()(ids_of(shape)).shape == shape + (5,)


def test_causal_future_tokens_do_not_change_the_past():
    m = tiny(2)
    ids = ids_of((1, 6))
    other = ids.copy()
    other[0, 4:] = (other[0, 4:] + 1) % 5
    np.testing.assert_allclose(m(ids)[:, :4], m(other)[:, :4], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(m(ids[:, :4]), m(ids)[:, :4], rtol=1e-12, atol=1e-12)


def test_float32_end_to_end():
    m = tiny(2, dtype=np.float32)
    logits = m(ids_of((2, 6)))
    assert logits.dtype == np.float32
    m.backward(np.ones_like(logits))
    assert all(p.data.dtype == np.float32 and p.grad.dtype == np.float32 for p in m.parameters())


@pytest.mark.parametrize("bad", [np.zeros((2, 7), dtype=int), np.zeros((2, 0), dtype=int), np.array(3)])
def test_bad_lengths_raise(bad):
    with pytest.raises(ValueError, match="ids"):
        tiny()(bad)


def test_out_of_vocabulary_and_float_ids_raise():
    with pytest.raises(ValueError):
        tiny()(np.array([[0, 5]]))
    with pytest.raises(TypeError):
        tiny()(np.array([[0.0, 1.0]]))


# -- loss, generate, attention weights -----------------------------------------------------------
def test_loss_helper_matches_cross_entropy():
    m = tiny(2)
    ids = ids_of((2, 6))
    targets = ids_of((2, 6), seed=3)
    targets[:, :3] = -100
    loss, dlogits = m.loss(ids, targets, ignore_index=-100)
    ref, cache = F.cross_entropy(m(ids), targets, ignore_index=-100)
    assert isinstance(loss, float) and loss == pytest.approx(float(ref), rel=1e-12)
    np.testing.assert_allclose(dlogits, F.cross_entropy_backward(np.ones(()), cache), rtol=1e-12)
    assert np.all(dlogits[:, :3] == 0)


def test_loss_gradient_by_finite_differences():
    m = tiny(1)
    ids, targets = ids_of((2, 5)), ids_of((2, 5), seed=4)
    m.zero_grad()
    _, dlogits = m.loss(ids, targets)
    m.backward(dlogits)
    p = m.head.bias
    analytic = p.grad.copy()
    numeric = np.zeros_like(analytic)
    for i in range(p.data.size):
        old = p.data[i]
        p.data[i] = old + 1e-6
        up = m.loss(ids, targets)[0]
        p.data[i] = old - 1e-6
        down = m.loss(ids, targets)[0]
        p.data[i] = old
        numeric[i] = (up - down) / 2e-6
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-9)


def test_generate_is_greedy_and_keeps_the_mode():
    m = tiny(2)
    prompt = ids_of((3, 2))
    out = m.generate(prompt, 4)
    assert out.shape == (3, 6)
    np.testing.assert_array_equal(out[:, :2], prompt)
    for t in range(2, 6):
        np.testing.assert_array_equal(out[:, t], m(out[:, :t])[:, -1].argmax(-1))
    assert m.training
    with pytest.raises(ValueError, match="max_new_tokens"):
        m.generate(prompt, 6)


def test_attention_weights_shape_rows_and_causality():
    m = tiny(2, dropout=0.5)
    ids = ids_of((3, 6))
    w = m.attention_weights(ids)
    assert w.shape == (2, 3, 2, 6, 6)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-12)
    assert np.all(w[..., np.triu_indices(6, 1)[0], np.triu_indices(6, 1)[1]] == 0)
    assert m.training  # restored
    np.testing.assert_array_equal(w, m.attention_weights(ids))  # eval: dropout off


def test_attention_weights_are_those_the_forward_uses():
    m = tiny(1)
    ids = ids_of((1, 6))
    w = m.attention_weights(ids)[0]
    block = m.blocks[0]
    x = m.tok_emb.weight.data[ids] + m.pos_emb.weight.data[:6]
    h = block.layernorm1(x)
    _, ref = block.mha(h, need_weights=True)
    np.testing.assert_allclose(w, ref, rtol=1e-12)


# -- the demo's task and training ----------------------------------------------------------------
def test_examples_layout_and_ignored_prompt():
    digits = np.array([[3, 1, 4], [0, 0, 7]])
    ids, targets = make_examples(digits, "reverse")
    np.testing.assert_array_equal(ids[0], [3, 1, 4, SEP, 4, 1])
    np.testing.assert_array_equal(targets[0], [IGNORE_INDEX] * 3 + [4, 1, 3])
    _, targets = make_examples(digits, "sort")
    np.testing.assert_array_equal(targets[1, 3:], [0, 0, 7])
    np.testing.assert_array_equal(answer_of(digits, "sort")[0], [1, 3, 4])
    with pytest.raises(ValueError, match="task"):
        answer_of(digits, "nope")


def test_held_out_sequences_never_in_training_batches():
    rng = np.random.default_rng(0)
    held = HeldOutSet(rng, 2, 60)  # 60 of the 100 two-digit sequences
    assert len(np.unique(held.digits, axis=0)) == len(held.digits)
    assert held.contains(held.digits).all()
    batch = held.training_digits(rng, 500)
    assert not held.contains(batch).any()
    assert len(np.unique(batch, axis=0)) == 100 - len(held.digits)


SMALL = replace(
    TASKS["reverse"], n_digits=4, d_model=32, d_ff=64, batch_size=32, steps=60, warmup_steps=10, held_out=50
)


def test_short_training_run_halves_the_loss():
    result = train(SMALL)
    first, last = result.losses[:5].mean(), result.losses[-5:].mean()
    assert last < 0.5 * first, (first, last)
    assert 0.0 <= result.accuracy <= result.token_accuracy <= 1.0


def test_same_seed_same_losses():
    cfg = replace(SMALL, steps=8)
    a, b, c = train(cfg), train(cfg), train(replace(cfg, seed=1))
    np.testing.assert_array_equal(a.losses, b.losses)
    assert a.accuracy == b.accuracy
    assert not np.array_equal(a.losses, c.losses)


def test_training_is_float32():
    result = train(replace(SMALL, steps=2))
    assert all(p.data.dtype == np.float32 for p in result.model.parameters())
