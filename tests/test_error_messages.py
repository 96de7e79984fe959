"""Messages that say the right thing: what to pass for a dtype argument, like-with-like shapes for a
KV cache, mixed q/k/v dtypes refused (as torch), and a ``top_k`` beyond the vocabulary."""

import numpy as np
import pytest

import npattn
import npattn.functional as F
import npattn.functional.reference as R
from npattn import book
from npattn.generation import generate, next_token_probs


# -- a dtype argument is passed, not converted ------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float16, np.longdouble])
@pytest.mark.parametrize(
    "build",
    [
        lambda dt: npattn.Linear(4, 4, dtype=dt),
        lambda dt: npattn.LayerNorm(4, dtype=dt),
        lambda dt: npattn.Embedding(5, 4, dtype=dt),
        lambda dt: npattn.MultiHeadAttention(4, 4, 2, dtype=dt),
        lambda dt: book.CausalAttention(4, 4, 6, 0.0, dtype=dt),
        lambda dt: npattn.Linear(4, 4).to(dt),
    ],
    ids=["Linear", "LayerNorm", "Embedding", "MultiHeadAttention", "book.CausalAttention", "to"],
)
def test_an_unsupported_dtype_argument_says_what_to_pass(build, dtype):
    if np.dtype(dtype) == np.float64:  # platforms where longdouble is float64: nothing to refuse
        pytest.skip("longdouble is float64 here")
    with pytest.raises(TypeError) as info:
        build(dtype)
    msg = str(info.value)
    assert msg.startswith(f"dtype: {np.dtype(dtype).name} is not supported")
    assert msg.endswith("pass dtype=np.float32 (or np.float64)") and "astype" not in msg


@pytest.mark.parametrize("dtype", [">f4", ">f8"] if np.little_endian else ["<f4", "<f8"])
def test_a_foreign_byte_order_is_named_as_such(dtype):
    """A float32 or float64 of the other byte order (a big-endian file's array) is refused naming
    its byte order, not as "float32 is not supported", which contradicts the advice to pass float32."""
    with pytest.raises(
        TypeError, match=rf"dtype: {dtype} is not supported \(byte order '{dtype}'.*pass dtype=np.float32"
    ):
        npattn.Linear(4, 4, dtype=dtype)
    with pytest.raises(TypeError, match=rf"x: {dtype} is not supported \(byte order.*x.astype\(np.float32\)"):
        npattn.functional.softmax(np.ones(3, dtype))


def test_an_unsupported_input_dtype_still_says_convert():
    from npattn._validate import check_float_dtype

    with pytest.raises(TypeError, match=r"x: float16 is not supported .*; convert with x\.astype\(np\.float32\)"):
        npattn.Linear(4, 4)(np.ones((2, 4), np.float16))
    with pytest.raises(TypeError, match=r"; convert with it\.astype\(np\.float32\)"):  # a name that is no identifier
        check_float_dtype(np.float16, "masks[0]")


def test_dtype_argument_advice_without_an_identifier_name():
    from npattn._validate import check_float_dtype

    with pytest.raises(TypeError, match=r"; pass np\.float32 \(or np\.float64\)$"):
        check_float_dtype(np.float16, "model dtype", is_dtype_argument=True)


# -- the KV cache: batch shape against batch shape -----------------------------------------------------
@pytest.mark.parametrize(
    "build, name, cache",
    [
        (lambda: npattn.MultiHeadAttention(16, 16, 2, causal=True, rng=0), "query", "KV cache"),
        (lambda: npattn.GatedDeltaNet(16, 2, 1, 4, 4, 2, rng=0), "x", "decoding cache"),
        (
            lambda: npattn.MultiHeadLatentAttention(
                16, 2, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, rng=0
            ),
            "x",
            "latent cache",
        ),
    ],
    ids=["MultiHeadAttention", "GatedDeltaNet", "MultiHeadLatentAttention"],
)
def test_a_cache_batch_change_compares_batch_shapes(build, name, cache):
    m = build()
    rng = np.random.default_rng(0)
    with npattn.no_grad():
        m(rng.standard_normal((2, 3, 16)), use_cache=True)
        with pytest.raises(ValueError) as info:
            m(rng.standard_normal((1, 1, 16)), use_cache=True)
    msg = str(info.value)
    assert msg.startswith(f"{name}: expected the batch shape (2,) of the {cache}, got the batch shape (1,)")
    assert f"{name} of shape (1, 1, 16)" in msg and "reset_kv_cache()" in msg


# -- q, k, v share one dtype -------------------------------------------------------------------------------
CORES = [
    (F.scaled_dot_product_attention, F.scaled_dot_product_attention_backward),
    (F.memory_efficient_attention, F.memory_efficient_attention_backward),
]


def _qkv(seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((2, 2, 3, 4)), rng.standard_normal((2, 2, 5, 4)), rng.standard_normal((2, 2, 5, 3))


@pytest.mark.parametrize("fwd", [c[0] for c in CORES], ids=["sdpa", "memory_efficient"])
@pytest.mark.parametrize("odd", ["q", "k", "v"])
def test_mixed_float_dtypes_are_refused_by_both_cores(fwd, odd):
    arrays = dict(zip("qkv", _qkv()))
    arrays[odd] = arrays[odd].astype(np.float32)
    # the message names the first array whose dtype differs from q's
    name, want, got = ("k", "float32", "float64") if odd == "q" else (odd, "float64", "float32")
    with pytest.raises(TypeError) as info:
        fwd(arrays["q"], arrays["k"], arrays["v"])
    msg = str(info.value)
    assert msg.startswith(f"{name}: expected the dtype of q, {want}, got {got}")
    assert f"convert with {name}.astype(np.{want})" in msg and "q, k, v must share one dtype" in msg


@pytest.mark.parametrize("fwd", [c[0] for c in CORES], ids=["sdpa", "memory_efficient"])
def test_integer_inputs_take_the_float_dtype(fwd):
    q, k, v = (a.astype(np.float32) for a in _qkv())
    ik = np.arange(2 * 2 * 5 * 4).reshape(k.shape) % 3
    out, _ = fwd(q, ik, v)
    want, _ = fwd(q, ik.astype(np.float32), v)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("name", ["scaled_dot_product_attention", "memory_efficient_attention"])
def test_the_textbook_tier_promotes_mixed_dtypes_as_numpy_does(name):
    """The textbook tier validates nothing; with mixed dtypes it computes in numpy's promoted dtype
    (float64 here), never a float32 result from float64 keys and values."""
    fwd, bwd = getattr(R, name), getattr(R, name + "_backward")
    q, k, v = _qkv(1)
    for causal in (False, True):
        out, cache = fwd(q.astype(np.float32), k, v, is_causal=causal)
        want, want_cache = fwd(q.astype(np.float32).astype(np.float64), k, v, is_causal=causal)
        assert out.dtype == np.float64
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-14)
        dout = np.random.default_rng(2).standard_normal(out.shape)
        for g, w in zip(bwd(dout, cache)[:3], bwd(dout, want_cache)[:3]):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)


# -- top_k beyond the vocabulary: clamped, as Hugging Face's top-k warper --------------------------------
def test_next_token_probs_clamps_top_k_to_the_vocabulary():
    logits = np.random.default_rng(3).standard_normal((2, 10))
    full = next_token_probs(logits, 0.7)
    for k in (10, 11, 50):
        np.testing.assert_array_equal(next_token_probs(logits, 0.7, top_k=k), full)
    assert (next_token_probs(logits, 0.7, top_k=9) == 0).sum() == 2  # one token masked per row


def test_generate_with_top_k_above_the_vocabulary_samples_from_all_tokens():
    cfg = dict(vocab_size=10, context_length=8, emb_dim=8, n_heads=2, n_layers=1, drop_rate=0.0, qkv_bias=False)
    model = book.GPTModel(cfg, rng=0)
    prompt = np.array([[1, 2, 3]])
    a = generate(model, prompt, 5, 8, temperature=1.5, top_k=50, rng=7)
    b = generate(model, prompt, 5, 8, temperature=1.5, top_k=None, rng=7)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(book.generate(model, prompt, 5, 8, temperature=1.5, top_k=50, rng=7), b)
    c = generate(model, prompt, 5, 8, temperature=1.5, top_k=1, rng=7)  # top-k does act below the vocabulary
    np.testing.assert_array_equal(c, generate(model, prompt, 5, 8, rng=7))  # top_k=1 is greedy
