"""The large decoding section (``npattn bench --decode-large``): decoding against the memory-bandwidth limit.

Decoding one token multiplies every weight matrix by one vector: it reads each weight once, so its
speed is bounded by the memory bandwidth, ``tokens/s <= bandwidth / bytes of weights read per
token``.  This section measures how close npattn comes (issue 32, item 5), on a model of
Qwen3-0.6B's shape (``QWEN3_06B``: 596M parameters, hidden 1024, 28 layers, 16 heads, 8 KV heads,
head_dim 128, intermediate 3072, vocab 151936, tied embeddings) with random weights:

* ``bandwidth``: the machine's matrix-vector bandwidth, a float32 GEMV over a matrix of the output
  head's shape (far larger than the caches) with the threads in use, GB/s of the median call (one
  BLAS call, as npattn decodes a float32 matrix), measured alone (the header's figure); beside it
  the same product with the matrix stored column-major, the layout of npattn's wide fused
  projections, which BLAS may read faster: the goals line gives the float32 fraction against it
  too where it is (``_Gemv``);
* ``npattn_side``: the model loaded from a bfloat16 checkpoint written once into a temporary
  directory (``write_checkpoint``), in float32 and with ``weights_dtype="bfloat16"``: greedy
  decoding after a 16-token prompt, tokens/s of the median step (each step one token through the
  KV cache), and the prefill of 512 tokens (the best of ``repeats``); ``fraction`` = tokens/s over
  the limit ``gb_per_s / bytes_per_token``, where ``bytes_per_token`` counts every parameter's
  stored bytes (the tied head reads the whole embedding table; an untied model's table is left
  out: decoding reads one row of it) and ``gb_per_s`` is the same GEMV timed in the side's own
  process just before and just after its steps (``_Gemv``; median), with ``cpu_wait``, the seconds the side's
  threads waited for a core per second of that loop (``/proc`` schedstat: 0 when nothing else
  runs);
* ``transformers_side``: transformers' eager model of the same checkpoint in float32, with the
  same threads (``runner.torch_or_none``), the same steps and the same GEMV around them (skipped
  without torch/transformers);
* ``paired_ratio``: bfloat16 storage's tokens/s over float32's, the ratio of the goal, with both
  models in one process decoding in alternating turns (``rounds`` turns each, the order swapped
  every round; a turn is ``runner``'s: a pause, one untimed step, ``steps`` timed steps), the
  median of the rounds' ratios.  The two rows above come from two processes run one after the
  other, so their ratio also carries the host's bandwidth swings between those moments; the
  paired ratio compares steps seconds apart.  The rows keep their own tokens/s and
  fractions, and the report gives both ratios;
* ``paired_prefill``: npattn's prefill of 512 tokens over transformers', timed in alternating turns
  (``runner.time_interleaved``, npattn in a child process without torch as the timing section
  runs it), the ratio of the goal, for the same reason as ``paired_ratio``: the rows' prefill
  figures come from separate processes minutes apart, and on a shared host the speed of every
  BLAS call can shift by a tenth between such moments; the report gives both ratios;
* ``load_peak``: the peak resident memory of ``from_pretrained(..., weights_dtype="bfloat16")``
  of that checkpoint, in a fresh process, above what was resident before the call (``VmHWM`` less
  ``VmRSS`` from ``/proc/self/status``, as ``resource.getrusage``'s ``ru_maxrss`` would give
  without the parent's size), against the loaded model's parameter bytes.

Why the bandwidth is timed around each side's steps: the machine is shared, and the limit and the
steps measured at different moments (the five calls of ``bandwidth``, a tenth of a second, in
another process before the sides) met different loads: the fraction swung from run to run on a
machine called idle while a direct timing of the step barely moved. Timed in the same process,
seconds before and after the steps, the limit and the tokens/s see the same conditions (not between
two steps: the BLAS threads' spin after each call would slow the next step of a side whose threads
are not the BLAS's, see ``_steps``); each side's row gets its own, transformers' as npattn's. (Busy,
the fractions still fall: a decoding step makes 113 threaded BLAS calls, each waiting for its
slowest thread, and a thread that loses its core to another process stalls the call; one large GEMV
loses little. ``cpu_wait`` says how busy.) What a step can reach (measured on the machine of issue
32; its figures are in the issue's notes and hold for that machine alone): the step's products
alone, called back to back, read their bytes at nearly the single GEMV's bandwidth at quiet moments,
so what is missing to the limit is the work between them (norms, RoPE, the attention over the cache,
Python), which runs with caches the weights have just flushed. Splitting each product over a pool of
threads making single-threaded BLAS calls (as bfloat16 storage does) won while other processes held
the cores but lost to the threaded BLAS on the quiet machine, so float32 keeps one BLAS call per
product.

Each runs in a child process of its own (npattn's without torch), one after another.  The goals
(issue 32): float32 decoding at >= 90 % of the limit, bfloat16 storage at >= 0.7x float32's
tokens/s, prefill at least transformers' speed, loading within 10 % of the model's bytes.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import tempfile
import time

import numpy as np

from .runner import Step, call_in_child, run_steps, status_kib, torch_or_none
from .text import fmt, table

__all__ = [
    "QWEN3_06B",
    "QUICK",
    "SIZES",
    "SIZES_QUICK",
    "GOALS",
    "bandwidth",
    "write_checkpoint",
    "npattn_side",
    "paired_ratio",
    "transformers_side",
    "prefill_case",
    "paired_prefill",
    "load_peak",
    "collect",
    "format_section",
]

QWEN3_06B = {  # Qwen/Qwen3-0.6B's config.json, the sizes that matter
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
QUICK = dict(
    QWEN3_06B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    bos_token_id=1,
    eos_token_id=2,
)
SIZES = dict(prompt=16, new_tokens=24, prefill=512, repeats=3)
SIZES_QUICK = dict(prompt=4, new_tokens=3, prefill=8, repeats=1)
PAIRED = dict(rounds=8, steps=3)  # paired_ratio's turns
PAIRED_QUICK = dict(rounds=2, steps=1)
PREFILL_TURNS, PREFILL_TURNS_QUICK = 5, 1  # paired_prefill's turns of each side
GOALS = {"fraction": 0.9, "bf16_over_f32": 0.7, "prefill_over_transformers": 1.0, "load_over_model": 1.1}


class _Gemv:
    """The bandwidth measure of ``bandwidth`` (one float32 GEMV over a matrix of the output head's
    shape, one BLAS call) taken between the decoding steps of a side, in its own process: each
    side's limit then comes from the bandwidth of the same seconds and the same process as its
    steps (another process's load, or a quiet moment, moves both alike).

    The limit's matrix is row-major, as the tied head (the embedding table) is read.  Each call
    also times the same product with the matrix stored column-major (``column_gb_per_s``), the
    layout npattn gives its wide fused projections (``nn.layers._stacked``): BLAS reads the two
    layouts at different speeds, and the report says what the fraction is against the faster
    one too, so that the layout npattn chose for its own products is not what lifts it."""

    def __init__(self, rows: int, cols: int):
        self.w = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
        self.w_column = np.asfortranarray(self.w)
        self.x = np.ones((1, cols), np.float32)
        self.y = np.empty((1, rows), np.float32)
        self.times: list = []
        self.column_times: list = []

    def __call__(self) -> None:
        for w, times in ((self.w, self.times), (self.w_column, self.column_times)):
            t = time.perf_counter()
            np.matmul(self.x, w.T, out=self.y)
            times.append(time.perf_counter() - t)

    def clear(self) -> None:
        self.times.clear()
        self.column_times.clear()

    def gb_per_s(self) -> float:
        return self.w.nbytes / statistics.median(self.times) / 1e9

    def column_gb_per_s(self) -> float:
        return self.w.nbytes / statistics.median(self.column_times) / 1e9


def bandwidth(rows: int, cols: int, repeats: int = 5) -> dict:
    """float32 GEMV ``x (1, cols) @ W.T`` over ``W (rows, cols)`` as npattn decodes a float32
    matrix (one BLAS call, OpenBLAS threading it): ``"gb_per_s"``, the limit, the GB/s of the
    median call."""
    from .._blas import openblas_functions

    gemv = _Gemv(rows, cols)
    gemv()  # its warm-up
    gemv.clear()
    for _ in range(repeats):
        gemv()
    blas = openblas_functions("get_num_threads")
    return {
        "gb_per_s": gemv.gb_per_s(),
        "column_gb_per_s": gemv.column_gb_per_s(),
        "bytes": gemv.w.nbytes,
        "threads": blas[0]() if blas else None,
    }


def write_checkpoint(directory: str, config: dict) -> dict:
    """A model of ``config`` with random weights (seed 0) saved with bfloat16 storage into
    ``directory`` (every tensor BF16, as released checkpoints are): ``{"parameters"}``."""
    from ...models import CausalLM
    from ...models.causal_lm import store_bfloat16

    m = CausalLM(config, rng=0, dtype=np.float32)
    store_bfloat16(m)
    m.save_pretrained(directory)
    return {"parameters": m.num_parameters()}


def _bytes_per_token(params, tied: bool, embedding) -> int:
    """The weight bytes one decoding step reads: every parameter, less an untied embedding table."""
    total = sum(p.data.nbytes for p in params)
    return total if tied else total - embedding.data.nbytes


def _run_delay():
    """Seconds this process's threads have waited for a core so far (the second field of
    ``/proc/self/task/*/schedstat``), None where the kernel does not say."""
    total = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return total / 1e9


def _steps(forward, prompt: int, new_tokens: int, gemv: _Gemv, calls: int = 5) -> tuple:
    """``(seconds of each greedy step after the prompt, seconds the threads waited for a core per
    second of the loop or None)``; ``forward(ids, first)`` -> last logits.  ``gemv()`` is timed
    ``calls`` times just before the prompt (after an untimed warm-up call) and ``calls`` times
    just after the last step, never between two steps: after a threaded call OpenBLAS's threads
    spin for about a tenth of a second, and where the step's threads are not the BLAS's (bfloat16
    storage's pool, torch's) they then share the cores with them (on the machine of issue 32 a
    GEMV after each bfloat16 step made the steps about 40 % slower; the prompt's untimed forward
    absorbs the first calls' spin)."""
    rng = np.random.default_rng(1)
    gemv()
    gemv.clear()
    for _ in range(calls):
        gemv()
    logits = forward(rng.integers(3, 100, (1, prompt)), True)
    times = []
    waited, start = _run_delay(), time.perf_counter()
    for _ in range(new_tokens):
        nxt = np.asarray(logits).argmax(-1).reshape(1, 1)
        t = time.perf_counter()
        logits = forward(nxt, False)
        times.append(time.perf_counter() - t)
    end = _run_delay()
    for _ in range(calls):
        gemv()
    wait = None if waited is None or end is None else (end - waited) / (time.perf_counter() - start)
    return times, wait


def _prompt(tokens: int) -> np.ndarray:
    """The prefill's ids (one row), the same on every side."""
    return np.random.default_rng(2).integers(3, 100, (1, tokens))


def _prefill(forward, prefill: int, repeats: int) -> float:
    ids = _prompt(prefill)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        forward(ids, True)
        best = min(best, time.perf_counter() - t)
    return best


def _row(impl, steps, gemv: _Gemv, prefill: int, prefill_s: float, bytes_per_token: int, model_bytes: int) -> dict:
    times, wait = steps
    return {
        "impl": impl,
        "tokens_per_s": 1.0 / statistics.median(times),
        "gb_per_s": gemv.gb_per_s(),
        "column_gb_per_s": gemv.column_gb_per_s(),
        "cpu_wait": wait,
        "prefill_tokens_per_s": prefill / prefill_s,
        "bytes_per_token": bytes_per_token,
        "model_bytes": model_bytes,
    }


def _npattn_model(directory: str, weights_dtype):
    """The checkpoint in ``directory`` loaded by npattn, and its ``forward(ids, first)`` -> last
    logits (``first``: a new prompt, the KV cache emptied)."""
    from ... import no_grad
    from ...models import CausalLM

    m = CausalLM.from_pretrained(directory, weights_dtype=weights_dtype)

    def forward(ids, first):
        if first:
            m.reset_kv_cache()
        with no_grad():
            return m(ids, use_cache=True, logits_to_keep=1)[:, -1]

    return m, forward


def paired_ratio(directory: str, prompt: int, rounds: int, steps: int) -> dict:
    """bfloat16 storage's decoding tokens/s over float32's, both loaded in this process and decoding
    in alternating turns (see the module docstring): ``"ratio"``, the median over ``rounds`` of
    (float32's median step / bfloat16's median step) in the round, each round's ``"ratios"``, and
    each side's ``"tokens_per_s"`` over all its timed steps.  A turn (``runner``'s ``_Local.turn``)
    starts with a pause and one untimed step, so the other side's BLAS threads, still spinning
    after its last call, and its data in the caches do not fall on the timed steps; the order
    alternates from round to round so that neither side always goes first."""
    from .runner import PAUSE, _Local

    rng = np.random.default_rng(1)
    sides = {}
    for name, weights_dtype in (("float32", None), ("bfloat16", "bfloat16")):
        _, forward = _npattn_model(directory, weights_dtype)
        state = {"logits": forward(rng.integers(3, 100, (1, prompt)), True)}

        def step(forward=forward, state=state):
            nxt = np.asarray(state["logits"]).argmax(-1).reshape(1, 1)
            state["logits"] = forward(nxt, False)

        sides[name] = _Local(step)
    times: dict = {name: [] for name in sides}
    ratios = []
    for r in range(rounds):
        turn = {name: sides[name].turn(steps, PAUSE) for name in (sorted(sides) if r % 2 else sorted(sides)[::-1])}
        ratios.append(statistics.median(turn["float32"]) / statistics.median(turn["bfloat16"]))
        for name in sides:
            times[name] += turn[name]
    return {
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "tokens_per_s": {name: 1.0 / statistics.median(ts) for name, ts in times.items()},
        "rounds": rounds,
        "steps": steps,
    }


def npattn_side(directory: str, weights_dtype, prompt: int, new_tokens: int, prefill: int, repeats: int) -> dict:
    """npattn's decoding and prefill of the checkpoint in ``directory`` (float32, or bfloat16 storage)."""
    m, forward = _npattn_model(directory, weights_dtype)
    gemv = _Gemv(m.config.vocab_size, m.config.hidden_size)
    steps = _steps(forward, prompt, new_tokens, gemv)
    prefill_s = _prefill(forward, prefill, repeats)
    params = list(m.parameters())
    nbytes = _bytes_per_token(params, m.lm_head is None, m.model.embed_tokens.weight)
    model_bytes = sum(p.data.nbytes for p in params)
    return _row(f"npattn {weights_dtype or 'float32'}", steps, gemv, prefill, prefill_s, nbytes, model_bytes)


def _transformers_model(directory: str, torch, transformers):  # pragma: needs torch
    """transformers' eager float32 model of ``directory`` and its ``forward(ids, first)``, as
    ``_npattn_model``'s."""
    tm = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    state: dict = {}

    def forward(ids, first):
        with torch.no_grad():
            out = tm(
                torch.from_numpy(ids),
                cache=None if first else state["cache"],
                use_cache=True,
                logits_to_keep=1,
            )
        state["cache"] = out.cache
        return out.logits[:, -1].numpy()

    return tm, forward


def transformers_side(directory: str, prompt: int, new_tokens: int, prefill: int, repeats: int) -> dict:
    """transformers' eager float32 model of the same checkpoint, the same steps (``{"missing"}``
    without torch or transformers)."""
    torch = torch_or_none()
    if torch is None or importlib.util.find_spec("transformers") is None:
        return {"impl": "transformers", "missing": "torch" if torch is None else "transformers"}
    import transformers  # pragma: needs torch

    tm, forward = _transformers_model(directory, torch, transformers)  # pragma: needs torch
    gemv = _Gemv(tm.config.vocab_size, tm.config.hidden_size)  # pragma: needs torch
    steps = _steps(forward, prompt, new_tokens, gemv)
    prefill_s = _prefill(forward, prefill, repeats)
    params = list(tm.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return _row("transformers float32", steps, gemv, prefill, prefill_s, nbytes, nbytes)


def prefill_case(dtype, torch, *, directory: str, tokens: int):
    """The bench case (``cases.KINDS["prefill"]``) of npattn's float32 prefill of ``tokens`` ids by
    the checkpoint in ``directory`` (the KV cache emptied first, the last position's logits), for
    ``paired_prefill``'s child process; npattn's side alone (``dtype`` and ``torch`` unused)."""
    from .cases import Built

    _, forward = _npattn_model(directory, None)
    ids = _prompt(tokens)
    return Built("prefill", {"tokens": tokens}, {"npattn": lambda: forward(ids, True)}, {})


def paired_prefill(directory: str, prefill: int, repeats: int) -> dict:
    """npattn's and transformers' prefill of ``prefill`` tokens timed in alternating turns
    (``runner.time_interleaved``: npattn in a child process without torch, as the timing section
    runs it; each turn a pause, one untimed call, one timed call): ``"ratio"``, transformers'
    median seconds over npattn's, and each side's ``"tokens_per_s"`` (``{"missing"}`` without
    torch or transformers).  The rows' prefill figures come from two processes minutes apart, so
    their ratio carries the host's swings between those moments too; these turns are seconds
    apart (see ``paired_ratio``)."""
    from .runner import Child, time_interleaved

    torch = torch_or_none()
    if torch is None or importlib.util.find_spec("transformers") is None:
        return {"missing": "torch" if torch is None else "transformers"}
    import transformers  # pragma: needs torch

    _, forward = _transformers_model(directory, torch, transformers)  # pragma: needs torch
    ids = _prompt(prefill)  # pragma: needs torch
    child = Child("prefill", {"directory": directory, "tokens": prefill}, np.float32)  # pragma: needs torch
    try:  # pragma: needs torch
        times = time_interleaved(
            {"npattn": child.fn("npattn"), "transformers": lambda: forward(ids, True)}, repeats=repeats
        )
    finally:
        child.close()
    return {  # pragma: needs torch
        "ratio": times["transformers"] / times["npattn"],
        "tokens_per_s": {name: prefill / s for name, s in times.items()},
        "repeats": repeats,
    }


def load_peak(directory: str) -> dict:
    """The peak resident memory of loading ``directory`` with bfloat16 storage, above what was
    resident before, against the loaded model's bytes (run it in a fresh process)."""
    from ...models import CausalLM

    before = status_kib("VmRSS")
    t = time.perf_counter()
    m = CausalLM.from_pretrained(directory, weights_dtype="bfloat16")
    seconds = time.perf_counter() - t
    # the kernel keeps VmHWM from per-CPU RSS counters, updated lazily: it can read below a VmRSS
    # seen earlier or now (a tiny model: below `before`); the true peak is at least every one of them
    peak = max(status_kib("VmHWM"), status_kib("VmRSS"), before)
    model = sum(p.data.nbytes for p in m.parameters())
    above = (peak - before) * 1024
    return {"peak_bytes": above, "model_bytes": model, "ratio": above / model, "seconds": seconds}


def collect(quick=False, progress=True):
    config, sizes, paired = (QUICK, SIZES_QUICK, PAIRED_QUICK) if quick else (QWEN3_06B, SIZES, PAIRED)
    turns = PREFILL_TURNS_QUICK if quick else PREFILL_TURNS
    big = not quick
    with tempfile.TemporaryDirectory(prefix="npattn-decode-large-") as tmp:
        d = os.path.join(tmp, "model")
        gemv = (config["vocab_size"], config["hidden_size"])

        def child(fn, **kw):
            return lambda: call_in_child(f"decode_large:{fn}", kw)

        steps = [
            Step(
                "write a bfloat16 checkpoint",
                60.0 if big else 1.0,
                child("write_checkpoint", directory=d, config=config),
            ),
            Step("GEMV bandwidth", 10.0 if big else 1.0, child("bandwidth", rows=gemv[0], cols=gemv[1])),
            Step(
                "npattn float32", 60.0 if big else 1.0, child("npattn_side", directory=d, weights_dtype=None, **sizes)
            ),
            Step(
                "npattn bfloat16 storage",
                60.0 if big else 1.0,
                child("npattn_side", directory=d, weights_dtype="bfloat16", **sizes),
            ),
            Step(
                "bfloat16 / float32 in turns",
                60.0 if big else 1.0,
                child("paired_ratio", directory=d, prompt=sizes["prompt"], **paired),
            ),
            Step("transformers float32", 90.0 if big else 2.0, child("transformers_side", directory=d, **sizes)),
            Step(
                "prefill in turns with transformers",
                90.0 if big else 3.0,
                child("paired_prefill", directory=d, prefill=sizes["prefill"], repeats=turns),
            ),
            Step("load peak (bfloat16 storage)", 20.0 if big else 1.0, child("load_peak", directory=d)),
        ]
        names = ("checkpoint", "bandwidth", "f32", "bf16", "paired", "hf", "paired_prefill", "load")
        got = dict(zip(names, run_steps("decode-large", steps, progress=progress, note=_note)))
    rows = [got.pop(k) for k in ("f32", "bf16", "hf")]
    config_sizes = {k: config[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
    return {"decode_large": dict(config=config_sizes, sizes=sizes, rows=rows, **got, goals=GOALS)}


def _note(r):
    if "error" in r or "missing" in r:
        return r.get("error") or f"skipped: no {r['missing']}"
    if "ratios" in r:
        return f"bfloat16 at {r['ratio']:.2f}x float32 (median of {r['rounds']} rounds)"
    if "repeats" in r:
        return f"npattn's prefill at {r['ratio']:.2f}x transformers' ({r['repeats']} turns each)"
    if "tokens_per_s" in r:
        return f"{r['tokens_per_s']:.1f} tokens/s, prefill {r['prefill_tokens_per_s']:.0f} tokens/s"
    if "gb_per_s" in r:
        return f"{r['gb_per_s']:.1f} GB/s"
    if "ratio" in r:
        return f"peak {r['peak_bytes'] / 2**20:.0f} MiB for {r['model_bytes'] / 2**20:.0f} MiB of model"
    return ""


def _verdict(value, goal, at_most=False):
    if value is None:
        return "-"
    return "yes" if (value <= goal if at_most else value >= goal) else "NO"


def _row_bandwidth(row: dict, alone):
    """The bandwidth a row's limit is taken from: the GEMV timed around its own steps (a report
    written before rows carried it: the one measured alone)."""
    return row.get("gb_per_s", alone)


def _paired_goal(r: dict, entry: str, rows, goal_key: str, label: str, how) -> str:
    """A goal's part of the goals line, its ratio measured in turns (``r[entry]``: ``paired_ratio``,
    ``paired_prefill``) where the report has it, with ``rows``, the rows' ratio (two processes at
    different moments), beside it; else the rows' ratio.  ``label`` holds the ratio's ``{}``;
    ``how(turns)`` says how the turns were taken."""
    paired = r.get(entry) or {}
    ratio = paired.get("ratio", rows)
    goal = r["goals"][goal_key]
    text = f"{label.format(fmt(ratio, '.2f'))} (>= {goal}: {_verdict(ratio, goal)})"
    if "ratio" in paired:
        text += f" {how(paired)}; the rows' separate processes: {fmt(rows, '.2f')}x)"
    return text


def _bf16_goal(r: dict, f32, bf16) -> str:
    """The goals line's bfloat16 part (``paired_ratio``'s rounds)."""
    rows = None if f32 is None or bf16 is None else bf16["tokens_per_s"] / f32["tokens_per_s"]
    label = "bfloat16 storage at {}x float32's tokens/s"
    return _paired_goal(r, "paired", rows, "bf16_over_f32", label, _rounds)


def _rounds(p: dict) -> str:
    return f"in turns in one process (median of {p['rounds']} rounds' ratios"


def _prefill_turns(p: dict) -> str:
    return f"in turns ({p['repeats']} each, the median call"


def _prefill_goal(r: dict, f32, hf) -> str:
    """The goals line's prefill part (``paired_prefill``'s turns)."""
    rows = None if f32 is None or hf is None else f32["prefill_tokens_per_s"] / hf["prefill_tokens_per_s"]
    label = "prefill at {}x transformers'"
    return _paired_goal(r, "paired_prefill", rows, "prefill_over_transformers", label, _prefill_turns)


def _column_fraction(f32) -> str:
    """The float32 fraction against the column-major GEMV timed around the same steps (``_Gemv``),
    where the row has it and it is the faster layout: the limit, were it taken from that one."""
    column = None if f32 is None else f32.get("column_gb_per_s")
    if column is None or column <= f32["gb_per_s"]:
        return ""
    frac = f32["tokens_per_s"] * f32["bytes_per_token"] / (column * 1e9)
    return f"; {frac:.2f} against the column-major GEMV's {column:.1f} GB/s"


def format_section(report):
    r = report.get("decode_large")
    if not r:
        return []
    bw = r["bandwidth"].get("gb_per_s")
    rows = [x for x in r["rows"] if "tokens_per_s" in x]
    by = {x["impl"]: x for x in rows}
    f32, bf16, hf = by.get("npattn float32"), by.get("npattn bfloat16"), by.get("transformers float32")
    cells = []
    for x in rows:
        row_bw = _row_bandwidth(x, bw)
        limit = None if row_bw is None else row_bw * 1e9 / x["bytes_per_token"]
        frac = None if limit is None else x["tokens_per_s"] / limit
        cells.append(
            [
                x["impl"],
                f"{x['bytes_per_token'] / 1e9:.2f}",
                fmt(row_bw, ".1f"),
                fmt(x.get("cpu_wait"), ".2f"),
                fmt(limit, ".1f"),
                f"{x['tokens_per_s']:.1f}",
                fmt(frac, ".2f"),
                f"{x['prefill_tokens_per_s']:.0f}",
            ]
        )
    columns = [
        ("impl", "<"),
        ("GB/token", ">"),
        ("GEMV GB/s", ">"),
        ("waited", ">"),
        ("limit tok/s", ">"),
        ("decode tok/s", ">"),
        ("of limit", ">"),
        (f"prefill {r['sizes']['prefill']} tok/s", ">"),
    ]
    c = r["config"]
    g = r["goals"]
    lines = [
        "",
        f"decoding against the memory-bandwidth limit: a Qwen3-0.6B-shaped model (hidden {c['hidden_size']}, "
        f"{c['num_hidden_layers']} layers, vocab {c['vocab_size']}, {r['checkpoint'].get('parameters', 0) / 1e6:.0f}M "
        f"parameters, random weights); float32 GEMV bandwidth alone {fmt(bw, '.1f')} GB/s with "
        f"{r['bandwidth'].get('threads') or '?'} threads (one BLAS call over the head's shape, row-major as the "
        f"head is read; column-major {fmt(r['bandwidth'].get('column_gb_per_s'), '.1f')} GB/s); decoding after "
        f"{r['sizes']['prompt']} tokens (median of {r['sizes']['new_tokens']} steps); each row's limit = "
        "its GEMV bandwidth (the same GEMV timed around its steps, median) / bytes of weights per token; "
        "waited: seconds its threads waited for a core per second of decoding (0 on an idle machine)",
    ] + table(columns, cells)
    for x in r["rows"]:
        if "tokens_per_s" not in x:
            lines.append(f"{x.get('impl', '?')}: " + (x.get("error") or f"skipped (no {x.get('missing')})"))
    f32_bw = None if f32 is None else _row_bandwidth(f32, bw)
    frac = None if f32 is None or f32_bw is None else f32["tokens_per_s"] * f32["bytes_per_token"] / (f32_bw * 1e9)
    load = r["load"].get("ratio")
    lines.append(
        f"goals: float32 at {fmt(frac, '.2f')} of the limit (>= {g['fraction']}: {_verdict(frac, g['fraction'])}"
        f"{_column_fraction(f32)}); "
        f"{_bf16_goal(r, f32, bf16)}; {_prefill_goal(r, f32, hf)}; loading the bfloat16 "
        f"checkpoint peaks at {fmt(load, '.2f')}x the model's bytes (<= {g['load_over_model']}: "
        f"{_verdict(load, g['load_over_model'], at_most=True)})"
    )
    return lines
