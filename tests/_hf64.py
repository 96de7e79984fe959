"""Hugging Face ``transformers`` as float64 oracles (torch is imported lazily, inside each helper).

``transformers`` computes RoPE frequencies with ``dtype=torch.float`` (float32) and upcasts to
float32 in places (softmax ``dtype=torch.float32``, RMSNorm's ``.to(torch.float32)``, RoPE's
``.float()`` angles, the MoE routers' ``.type(torch.float32)``, DeltaNet's ``.to(torch.float32)``);
in float64 tests those upcasts would be *down*casts, rounding the reference to float32 precision.
Two ways to run the same code in float64 instead (the comparisons then hold to 1e-9 instead of
being loosened to float32's 1e-6):

* ``float64_torch(monkeypatch, *modules)`` replaces the ``torch`` each given module sees by a proxy
  whose ``float``/``float32`` are ``torch.float64`` (everything else is torch's); tensor methods
  (``x.float()``) are not affected: the tests patch those classes where they matter and say so.
  ``default_float64()`` makes float64 torch's default dtype for a block (integer tensors times
  Python floats, e.g. the dynamic NTK base at a tensor ``seq_len``).
* ``float64_reference()`` turns every cast to float32 (``Tensor.to/float/type``, softmax's
  ``dtype``) and every float32 factory into float64, torch-wide, while a whole model is built and
  run (``build``, ``hf_logits_and_grads``: transformers' own models as oracles for
  ``npattn.models.CausalLM``).
"""

import contextlib
import functools
import importlib

import numpy as np


def transformers_or_none():
    """``transformers`` where it and torch import, else None: a test module whose oracle tests are
    marked ``pytest.mark.skipif(T is None, ...)`` keeps its other tests (configs, refusals) running
    without torch, where a module-level ``importorskip`` would skip them all."""
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError:
        return None
    return transformers


class _Float64Torch:
    def __init__(self, torch):
        self._torch = torch
        self.float = torch.float64
        self.float32 = torch.float64

    def __getattr__(self, name):
        return getattr(self._torch, name)


def float64_torch(monkeypatch, *module_names):
    """Patch ``torch`` inside each module (dotted names under ``transformers``)."""
    import torch

    proxy = _Float64Torch(torch)
    for name in module_names:
        monkeypatch.setattr(importlib.import_module(f"transformers.{name}"), "torch", proxy)
    return proxy


@contextlib.contextmanager
def default_float64():
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _dt(d):
    import torch

    return torch.float64 if d is torch.float32 else d


@contextlib.contextmanager
def float64_reference():
    """Every float32 cast / factory inside becomes float64; default dtype float64."""
    import torch

    T = torch.Tensor
    orig = {"to": T.to, "float": T.float, "type": T.type}
    sm = torch.nn.functional.softmax
    factories = {n: getattr(torch, n) for n in ("arange", "zeros", "ones", "tensor", "full", "empty", "linspace")}

    def to(self, *args, **kwargs):
        args = tuple(_dt(a) if isinstance(a, torch.dtype) else a for a in args)
        if "dtype" in kwargs:
            kwargs["dtype"] = _dt(kwargs["dtype"])
        return orig["to"](self, *args, **kwargs)

    def flt(self, *args, **kwargs):
        return orig["to"](self, torch.float64)

    def typ(self, dtype=None, *args, **kwargs):
        if dtype is None:
            return orig["type"](self)
        return orig["type"](self, _dt(dtype), *args, **kwargs)

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        return sm(input, dim=dim, dtype=_dt(dtype) if dtype is not None else None)

    def factory(f):
        @functools.wraps(f)
        def g(*args, **kwargs):
            if "dtype" in kwargs:
                kwargs["dtype"] = _dt(kwargs["dtype"])
            return f(*args, **kwargs)

        return g

    T.to, T.float, T.type = to, flt, typ
    torch.nn.functional.softmax = softmax
    for n, f in factories.items():
        setattr(torch, n, factory(f))
    try:
        with default_float64():
            yield
    finally:
        T.to, T.float, T.type = orig["to"], orig["float"], orig["type"]
        torch.nn.functional.softmax = sm
        for n, f in factories.items():
            setattr(torch, n, f)


def randomize(model, seed: int = 0, scale: float = 0.2) -> None:
    """Every parameter (and float buffer of the state dict) drawn N(0, scale²); norm weights
    around their own centre (1 for ``w`` norms, 0 for Gemma's ``1 + w``), so that every
    gradient path carries signal."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype) * scale
            p.copy_(p + noise)
        persistent = set(model.state_dict())
        for name, b in model.named_buffers():  # e.g. DeepSeek-V3's e_score_correction_bias (choice only)
            if name in persistent and b.dtype.is_floating_point:
                b.copy_(torch.randn(b.shape, generator=g, dtype=b.dtype) * scale)


def build(config_cls, model_cls, seed: int = 0, **kwargs):
    """``(hf_model float64 eager, config dict)`` with random weights, built under ``float64_reference``."""
    import torch

    cfg = config_cls(**kwargs)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    with float64_reference():
        torch.manual_seed(seed)
        model = model_cls(cfg).double().eval()
        randomize(model, seed)
    return model, cfg.to_dict()


def hf_logits_and_grads(model, ids: np.ndarray, dlogits: np.ndarray):
    """transformers' logits and every parameter's gradient of ``sum(logits * dlogits)``."""
    import torch

    model.zero_grad()
    with float64_reference():
        out = model(input_ids=torch.from_numpy(ids), use_cache=False).logits
        out.backward(torch.from_numpy(dlogits))
    grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach().numpy(), grads


def check_logits_and_grads(m, hf, ids: np.ndarray, dlogits: np.ndarray, *, names="equal", grads=None, zero=()) -> dict:
    """npattn's ``m`` against transformers' ``hf`` on ``ids``: the logits to 1e-9 and every
    parameter's gradient of ``sum(logits * dlogits)`` to 1e-8 (relative to the largest entry).

    ``names``: ``"equal"``, both models name the same parameters; ``"subset"``, a parameter torch
    leaves without a gradient (not used, or under ``no_grad``) must get an exactly zero one.
    ``grads``: maps transformers' gradients (a dict by name) onto ``m``'s names (a fused checkpoint's
    parts).  ``zero``: names whose gradient is zero in exact arithmetic, where both sides must stay
    below 1e-12 of the largest gradient instead (a relative error of rounding noise means nothing).
    Returns ``m``'s parameters by name (their gradients set), for the caller's own checks."""
    from _oracles import rel_err

    ref, ref_grads = hf_logits_and_grads(hf, ids, dlogits)
    assert rel_err(m(ids), ref, floor=1e-300, relative_to="max_b") < 1e-9
    m.zero_grad()
    m.backward(dlogits)
    want = ref_grads if grads is None else grads(ref_grads)
    params = dict(m.named_parameters())
    if names == "equal":
        assert set(params) == set(want), set(params) ^ set(want)
    else:
        assert set(want) <= set(params), set(want) - set(params)
    scale = max(np.abs(g).max() for g in want.values())
    for n, p in params.items():
        if n in zero:
            assert np.abs(p.grad).max() < 1e-12 * scale and np.abs(want[n]).max() < 1e-12 * scale, n
        else:
            assert rel_err(p.grad, want.get(n, np.zeros_like(p.grad)), floor=1e-300, relative_to="max_b") < 1e-8, n
    return params


def check_directory_round_trip(tmp_path, config_cls, model_cls, cfg: dict, *, grads=None) -> dict:
    """transformers' own save_pretrained directory of ``model_cls`` (built from ``cfg`` in float64)
    loads with ``CausalLM.from_pretrained``: logits to 1e-9 and every gradient to 1e-8 under a
    random upstream gradient, the pad token among the ids; npattn's save_pretrained of it is read
    back by ``model_cls`` with no key missing, unexpected or of another shape, the same tensors.
    ``grads``: as ``check_logits_and_grads``' (transformers' names as npattn's).  Returns
    ``check_logits_and_grads``' parameters."""
    import torch

    from npattn.models import CausalLM

    hf, _ = build(config_cls, model_cls, **{k: v for k, v in cfg.items() if k != "model_type"})
    hf.save_pretrained(tmp_path / "hf")
    m = CausalLM.from_pretrained(tmp_path / "hf", dtype=np.float64)
    ids = np.array([[1, 5, 7, 0, 9, 3, 11], [4, 4, 8, 0, 1, 2, 30]])
    dlogits = np.random.default_rng(2).standard_normal(ids.shape + (cfg["vocab_size"],))
    params = check_logits_and_grads(m, hf, ids, dlogits, grads=grads)
    m.save_pretrained(tmp_path / "ours")
    back, info = model_cls.from_pretrained(tmp_path / "ours", dtype=torch.float64, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    theirs, again = state_dict(hf), state_dict(back)
    assert set(theirs) == set(again)
    for k, v in theirs.items():
        np.testing.assert_array_equal(again[k], v, err_msg=k)
    return params


def state_dict(model) -> dict:
    """The model's state dict as numpy arrays (float64)."""
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def hf_logits(model, ids: np.ndarray, **kwargs) -> np.ndarray:
    """transformers' float64 logits of ``ids`` (no gradient, no cache; ``kwargs``, tensors, to the model)."""
    import torch

    with float64_reference(), torch.no_grad():
        return model(input_ids=torch.from_numpy(ids), use_cache=False, **kwargs).logits.numpy()


def _close(a, b, what) -> None:
    from _oracles import rel_err

    err = rel_err(a, b, floor=1e-300, relative_to="max_b")
    assert err < 1e-10, (what, err)


def check_cached_decoding(m, hf, ids: np.ndarray, prompt: int = 4) -> None:
    """npattn's ``m`` decoding ``ids`` with its cache (``prompt`` tokens, then one at a time) gives
    transformers' full-pass logits (1e-10)."""
    from npattn import no_grad

    ref = hf_logits(hf, ids)
    m.reset_kv_cache()
    with no_grad():
        parts = [m(ids[:, :prompt], use_cache=True)]
        parts += [m(ids[:, t : t + 1], use_cache=True) for t in range(prompt, ids.shape[1])]
    _close(np.concatenate(parts, axis=1), ref, "cached decoding")


def check_padded_batch(m, hf, vocab: int, lens, *, seed: int = 4, decode: int = 0) -> None:
    """A left-padded batch (row ``i`` holds ``lens[i]`` real tokens): npattn's logits of the real
    tokens equal transformers' with the same mask and generate's positions (as transformers 5.24
    computes them), and each row's equal that prompt run alone (1e-10); with ``decode`` > 0, that
    many tokens more through the cache continue each row as alone."""
    import torch

    from npattn import no_grad

    rng = np.random.default_rng(seed)
    L = max(lens)
    ids = rng.integers(0, vocab, (len(lens), L))
    mask = np.array([[0] * (L - n) + [1] * n for n in lens])
    position_ids = np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 0)
    ref = hf_logits(hf, ids, attention_mask=torch.from_numpy(mask), position_ids=torch.from_numpy(position_ids))
    real = mask.astype(bool)
    with no_grad():
        out = m(ids, attention_mask=mask)
        _close(out[real], ref[real], "padded batch")
        for i, n in enumerate(lens):
            _close(out[i, L - n :], m(ids[i : i + 1, L - n :])[0], f"row {i} alone")
        if not decode:
            return
        nxt = rng.integers(0, vocab, (len(lens), decode))
        m.reset_kv_cache()
        m(ids, attention_mask=mask, use_cache=True)
        steps = np.concatenate([m(nxt[:, t : t + 1], use_cache=True) for t in range(decode)], axis=1)
        for i, n in enumerate(lens):
            alone = m(np.concatenate([ids[i, L - n :], nxt[i]])[None])[0, -decode:]
            _close(steps[i], alone, f"row {i} decoded after the padded prompt")
