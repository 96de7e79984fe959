"""The families section (``npattn bench --families``): ``npattn.models.CausalLM`` of each open-model
family against the ``transformers`` model of the same config and weights.

For every ``model_type`` of ``npattn.models.tiny.TINY_CONFIGS`` (each family of that
table, in its order: ``FAMILIES``) one small model (``FAMILY`` sizes, ``FAMILY_QUICK`` with ``--quick``)
built from a Hugging Face config dict, two cases:

* ``family_step``: one forward and backward on ``(batch, L)`` token ids with a fixed upstream
  gradient of the logits, every parameter gradient produced;
* ``family_decode``: greedy decoding of ``new_tokens`` after a ``prompt``-token prompt, npattn with
  its caches (``npattn.generation.generate``), transformers with ``model.generate`` (its cache).

transformers runs eager (``attn_implementation="eager"``, eager experts) with torch's thread count
set by the runner (the same as numpy's BLAS here); npattn's side runs in a child process without
torch (``runner.Child``), with the weights of the same seed.  Decoding tokens/s counts new tokens;
``same_tokens`` says whether transformers produced npattn's tokens (in float32 an arg-max may
flip on a near tie).  The two kinds are registered in ``cases.KINDS`` when this module is imported
(the package imports it through ``cli.SECTIONS``, children too).
"""

from __future__ import annotations

import numpy as np

from ...models.tiny import TINY_CONFIGS, scaled_config
from .cases import KINDS, Built, Kind, rel_diff
from .runner import Step, run_steps, time_case
from .text import table

__all__ = [
    "FAMILIES",
    "FAMILY",
    "FAMILY_QUICK",
    "family_config",
    "family_step",
    "family_decode",
    "bench_family",
    "collect",
    "format_section",
]


FAMILIES = tuple(TINY_CONFIGS)  # every family of the one table of tiny configs, in its order
FAMILY = dict(hidden=128, layers=2, vocab=1024, batch=1, L=64, prompt=8, new_tokens=16)  # about a minute in all
FAMILY_QUICK = dict(hidden=32, layers=2, vocab=64, batch=1, L=8, prompt=4, new_tokens=4)


def family_config(model_type, *, hidden, layers, vocab):
    """A Hugging Face config dict of ``model_type`` with width ``hidden`` (a multiple of 16),
    ``layers`` layers and a ``vocab``-token vocabulary: the family's tiny config of
    ``npattn.models.tiny.TINY_CONFIGS`` (the one table the tests use too), exercising the family's
    own options (windows, sinks, MLA, experts, DeltaNet, KDA, ...), at these sizes (``scaled_config``)."""
    return scaled_config(model_type, hidden=hidden, layers=layers, vocab=vocab)


def _npattn_model(model_type, dtype, sizes):
    from ...models import CausalLM

    cfg = family_config(model_type, hidden=sizes["hidden"], layers=sizes["layers"], vocab=sizes["vocab"])
    return cfg, CausalLM(cfg, rng=0, dtype=dtype)


def _transformers_twin(torch, cfg, model):  # pragma: needs torch
    """transformers' model of ``cfg`` (eager attention and experts) with ``model``'s weights."""
    import transformers

    config = transformers.AutoConfig.for_model(**cfg)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    dtype = torch.float64 if model.dtype == np.float64 else torch.float32
    tm = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    sd = model.state_dict()
    if model.config.layout.transposed:  # GPT-2: its checkpoint's tensors (Conv1D's (in, out), transformer.h.*)
        from ...models.save import checkpoint_tensors

        sd = checkpoint_tensors(model)
    elif model.config.layout.fused:  # Phi-3: transformers' modules hold the checkpoint's fused projections
        from ...models.save import fused_tensors

        sd = fused_tensors(sd, model.config.layout.fused, model.config.layout.fused_groups)
    layout = model.config.layout
    if layout.per_row:  # StableLM: transformers' modules hold one LayerNorm a head, under its names
        from ...models.save import _renamed, row_tensors

        sd = {
            _renamed(k, layout.renames): v
            for key, a in sd.items()
            for k, v in (row_tensors(key, a) if key.endswith(layout.per_row) else {key: a}).items()
        }
    base = tm.base_model_prefix  # GPT-NeoX's gpt_neox (the model's own model.*)
    sd = {base + k[len("model") :] if k.startswith("model.") else k: v for k, v in sd.items()}
    sd = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}
    missing, unexpected = tm.load_state_dict(sd, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"bench families: weights do not fit transformers' model: {missing} {unexpected}")
    return tm


def _ids(sizes, length):
    return np.random.default_rng(0).integers(3, sizes["vocab"], (sizes["batch"], length))


def family_step(dtype, torch, *, model_type, **sizes):
    """One forward+backward of ``CausalLM`` (and of transformers' twin) on ``(batch, L)`` ids."""
    cfg, m = _npattn_model(model_type, dtype, sizes)
    ids = _ids(sizes, sizes["L"])
    dlogits = np.random.default_rng(1).standard_normal(ids.shape + (sizes["vocab"],)).astype(dtype)

    def run_np():
        logits = m(ids)
        m.backward(dlogits)
        return logits

    fns, torch_fns, check = {"npattn": run_np}, {}, None
    if torch is not None:  # pragma: needs torch
        tm = _transformers_twin(torch, cfg, m)
        tids, tdl = torch.from_numpy(ids), torch.from_numpy(dlogits)
        params = list(tm.parameters())

        def run_torch():
            for p in params:
                p.grad = None
            out = tm(input_ids=tids, use_cache=False).logits
            out.backward(tdl)
            return out

        torch_fns["transformers"] = run_torch

        def check():
            return {"max_rel_diff_vs_torch": rel_diff(run_np(), run_torch().detach().numpy())}

    shape = {"model_type": model_type, **sizes, "parameters": m.num_parameters()}
    return Built("family_step", shape, fns, torch_fns, check)


def family_decode(dtype, torch, *, model_type, **sizes):
    """Greedy decoding of ``new_tokens`` after a ``prompt``-token prompt, with the caches."""
    from ...generation import generate

    cfg, m = _npattn_model(model_type, dtype, sizes)
    prompt, new = _ids(sizes, sizes["prompt"]), sizes["new_tokens"]
    ctx = sizes["prompt"] + new

    def run_np():
        return generate(m, prompt, new, ctx)

    fns, torch_fns, check = {"npattn": run_np}, {}, None
    if torch is not None:  # pragma: needs torch
        tm = _transformers_twin(torch, cfg, m)
        tprompt = torch.from_numpy(prompt)

        def run_torch():
            with torch.no_grad():
                out = tm.generate(
                    tprompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=0
                )
            return out.numpy()

        torch_fns["transformers"] = run_torch

        def check():
            return {"same_tokens": bool(np.array_equal(run_np(), run_torch()))}

    shape = {"model_type": model_type, **sizes, "parameters": m.num_parameters()}
    return Built("family_decode", shape, fns, torch_fns, check)


def _step_flops(*, model_type, hidden, layers, vocab, batch, L, **_):
    """Roughly 6 FLOPs per parameter and token (forward 2, backward 4) for the layers and the head."""
    per_layer = 4 * hidden * hidden + 3 * hidden * 2 * hidden
    return 6 * batch * L * (layers * per_layer + hidden * vocab)


def _decode_flops(*, model_type, hidden, layers, vocab, batch, prompt, new_tokens, **_):
    per_layer = 4 * hidden * hidden + 3 * hidden * 2 * hidden
    return 2 * batch * (prompt + new_tokens) * (layers * per_layer + hidden * vocab)


KINDS["family_step"] = Kind(family_step, _step_flops)
KINDS["family_decode"] = Kind(family_decode, _decode_flops)


def bench_family(model_type, dtype=np.float32, sizes=None, *, use_torch=True, repeats=3, own_process=False):
    """The two rows of one family: ``{"name": "family_step" | "family_decode", "model_type",
    "impl", "seconds", "tokens_per_s", ...}`` (training tokens/s for the step, new tokens/s for
    decoding), with the check's facts."""
    sizes = dict(FAMILY if sizes is None else sizes)
    rows = []
    for kind in ("family_step", "family_decode"):
        params = {"model_type": model_type, **sizes}
        built, times, facts = time_case(
            kind, params, dtype, use_torch=use_torch, own_process=own_process, warmup=1, repeats=repeats
        )
        tokens = sizes["batch"] * (sizes["L"] if kind == "family_step" else sizes["new_tokens"])
        for impl, t in times.items():
            rows.append(
                {
                    "name": kind,
                    "model_type": model_type,
                    "impl": impl,
                    "shape": built.shape,
                    "dtype": np.dtype(dtype).name,
                    "seconds": t,
                    "tokens_per_s": tokens / t,
                    **facts,
                }
            )
    return rows


def collect(quick=False, progress=True):
    sizes, repeats = (FAMILY_QUICK, 1) if quick else (FAMILY, 2)
    guess = 1.0 if quick else 10.0
    steps = [
        Step(
            f"{mt} float32",
            guess,
            lambda mt=mt: bench_family(mt, np.float32, sizes, repeats=repeats, own_process=not quick),
        )
        for mt in FAMILIES
    ]
    rows = run_steps("families", steps, progress=progress, note=lambda rows: "; ".join(_line(r) for r in rows))
    return {"families": [r for part in rows for r in part]}


def _line(r):
    return f"{r['name'][7:]} {r['impl']} {r['tokens_per_s']:.0f} tokens/s"


def format_section(report):
    rows = report.get("families") or []
    if not rows:
        return []
    s = rows[0]["shape"]
    by = {}
    for r in rows:
        by.setdefault(r["model_type"], {})[(r["name"], r["impl"])] = r
    cells = []
    for mt, rs in by.items():

        def rate(kind, impl, rs=rs):
            r = rs.get((kind, impl))
            return "-" if r is None else f"{r['tokens_per_s']:.0f}"

        def ratio(kind, rs=rs):
            a, b = rs.get((kind, "npattn")), rs.get((kind, "transformers"))
            return "-" if a is None or b is None else f"{b['seconds'] / a['seconds']:.2f}"

        step = rs.get(("family_step", "npattn"), {})
        dec = rs.get(("family_decode", "npattn"), {})
        diff = step.get("max_rel_diff_vs_torch")
        same = dec.get("same_tokens")
        cells.append(
            [
                mt,
                f"{step.get('shape', {}).get('parameters', 0) / 1e6:.2f}M",
                rate("family_step", "npattn"),
                rate("family_step", "transformers"),
                ratio("family_step"),
                rate("family_decode", "npattn"),
                rate("family_decode", "transformers"),
                ratio("family_decode"),
                "-" if diff is None else f"{diff:.0e}",
                "-" if same is None else ("yes" if same else "no"),
            ]
        )
    columns = [
        ("model_type", "<"),
        ("params", ">"),
        ("train tok/s", ">"),
        ("transformers", ">"),
        ("x", ">"),
        ("decode tok/s", ">"),
        ("transformers", ">"),
        ("x", ">"),
        ("logits diff", ">"),
        ("same tokens", ">"),
    ]
    return [
        "",
        f"open-model families (npattn.models.CausalLM vs transformers eager, {rows[0]['dtype']}): hidden "
        f"{s['hidden']}, {s['layers']} layers, vocab {s['vocab']}; forward+backward on batch {s['batch']} x "
        f"{s['L']} tokens; greedy decoding of {s['new_tokens']} tokens after {s['prompt']}; x = npattn's "
        "speed over transformers'",
    ] + table(columns, cells)
