"""How every measurement of ``npattn bench`` is made: the one runner all sections share.

* ``time_interleaved(fns)``: the median seconds per call of several callables that take turns
  (the timing and decode sections);
* ``Child``: npattn's callables of one case in a child process that never imports torch,
  answering the parent's turns over a pipe (so torch and npattn still alternate);
* ``fresh(case, dtype, side)``: one case in a fresh process: the best seconds of a few calls and
  the peak resident memory above what was resident just before them (memory and window sections,
  the ``mem_eff`` row's memory);
* ``call_in_child(function, kwargs)``: any function of this package in a child process, with some
  environment variables removed (the OpenBLAS probe and its variant report);
* ``run_steps``: a section's steps with ``[3/12] label ... ~40 s left`` progress on stderr.

All children start as ``python -c CHILD <request as JSON>`` and enter ``child_main``.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .cases import KINDS, Missing

__all__ = [
    "CHILD",
    "torch_or_none",
    "child_env",
    "status_kib",
    "PAUSE",
    "BATCH_SECONDS",
    "time_interleaved",
    "Child",
    "time_case",
    "fresh",
    "call_in_child",
    "child_main",
    "Step",
    "run_steps",
]


CHILD = "from npattn.tools.bench.runner import child_main; child_main()"


def torch_or_none():
    """torch (with ``NPATTN_BENCH_THREADS`` threads, default 2, as numpy's OpenBLAS here), or None."""
    try:
        import torch
    except ImportError:
        return None
    return _threads(torch)  # pragma: needs torch


def _threads(torch):  # pragma: needs torch
    torch.set_num_threads(int(os.environ.get("NPATTN_BENCH_THREADS", "2")))
    return torch


def child_env(unset=()):
    """This environment, less the variables in ``unset``, with this copy of npattn first on ``PYTHONPATH``
    (never changes this process's own environment)."""
    env = dict(os.environ)
    for key in unset:
        env.pop(key, None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def status_kib(key):
    """``VmRSS`` (resident now) or ``VmHWM`` (this process image's peak) in KiB, from
    ``/proc/self/status`` (``ru_maxrss`` would include the parent's size at fork, kept across exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    import resource  # not Linux: the peak is the best there is

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# -- timing: turns ------------------------------------------------------------------------------------
# Pause before each turn: OpenBLAS's idle threads spin (yielding) for about 0.1 s after a
# multithreaded GEMM and libgomp's (torch's) briefly too; without the pause one library's spinning
# threads would steal a core from the other's next turn.  (A sleeping machine wakes up slowly:
# each turn's first call is untimed.)
PAUSE = 0.12
BATCH_SECONDS = 0.05  # a turn of short calls lasts about this long
_MAX_BATCH = 25


def time_interleaved(fns, *, warmup=1, repeats=5, pause=PAUSE, batch_seconds=BATCH_SECONDS):
    """Median wall time in seconds per call of each zero-argument callable in ``fns`` (a dict).

    After ``warmup`` calls of each, the callables take turns ``repeats`` times (interleaved, so
    that a slow spell of the machine hits all of them alike).  A turn is what a training loop
    does: consecutive calls of one library.  It starts after ``pause`` seconds idle and one
    untimed call, then times a batch: one call, or as many short calls as fit in
    ``batch_seconds`` (at most ``_MAX_BATCH``); every timed call counts towards the median.

    Why turns and not single alternating calls: a call right after the other library's measures
    that library's leftovers too: its idle thread pool still spinning on the cores (OpenBLAS's
    threads spin for about 0.1 s after a threaded GEMM, libgomp's briefly too), its data in the
    caches, and the memory it just freed, which spares the next numpy allocations their page
    faults.  On the project's machine these moved a ratio at b=4, L=64 between 0.6 and 1.9, and
    made code that allocates afresh every step look 10 % faster than it runs on its own."""
    runners = {name: fn if isinstance(fn, _ChildFn) else _Local(fn) for name, fn in fns.items()}
    batch = {}
    for name, r in runners.items():
        best = r.warm(max(1, warmup))
        batch[name] = int(min(_MAX_BATCH, max(1, batch_seconds // max(best, 1e-9))))
    times: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, r in runners.items():
            times[name] += r.turn(batch[name], pause)
    return {name: statistics.median(ts) for name, ts in times.items()}


class _Local:
    """Turns of a callable in this process (see ``time_interleaved``)."""

    def __init__(self, fn):
        self.fn = fn

    def warm(self, n):
        """``n`` calls; the best time."""
        best = math.inf
        for _ in range(n):
            t0 = time.perf_counter()
            self.fn()
            best = min(best, time.perf_counter() - t0)
        return best

    def turn(self, n, pause):
        """``pause`` seconds idle, one untimed call, then ``n`` timed calls; their times."""
        if pause:
            time.sleep(pause)  # the other library's idle threads stop spinning
        self.fn()  # untimed: this library's threads, caches and heap, not the other's, for the timed calls
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.fn()
            out.append(time.perf_counter() - t0)
        return out


# npattn's side of a timed case runs in a child process that never imports torch: torch's own
# allocations and threads in the same process change what numpy's costs (on the project's machine a
# step that allocated afresh ran 25 % faster while torch ran beside it than on its own), and
# npattn's users are mostly programs without torch.  The child rebuilds the same case (same seeds,
# same weights) and answers the parent's turns over a pipe, so the two libraries still alternate.
class Child:
    """npattn's callables of one case (``KINDS[kind].build(dtype, None, **params).npattn``) in a child
    process without torch; ``fn(label)`` is a callable for ``time_interleaved``."""

    def __init__(self, kind, params, dtype):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps({"serve": True})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        self.ask({"kind": kind, "params": params, "dtype": np.dtype(dtype).name})

    def ask(self, msg):
        """Send one request, return the child's answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"npattn bench: the timing subprocess ended (exit status {self.proc.wait()})")
        return json.loads(line)

    def fn(self, label):
        return _ChildFn(self, label)

    def close(self):
        try:
            self.ask({"quit": True})
        except (RuntimeError, OSError, ValueError):
            pass
        self.proc.wait()


class _ChildFn:
    """One of a ``Child``'s callables; ``warm``/``turn`` as ``_Local``'s."""

    def __init__(self, child, label):
        self.child, self.label = child, label

    def warm(self, n):
        return self.child.ask({"warm": n, "label": self.label})["best"]

    def turn(self, n, pause):
        return self.child.ask({"turn": n, "pause": pause, "label": self.label})["times"]


def _serve() -> None:
    """The child side of ``Child``: one JSON request per line on stdin, one answer per line on stdout."""
    runners: dict = {}
    for line in sys.stdin:
        msg = json.loads(line)
        if "kind" in msg:
            built = KINDS[msg["kind"]].build(np.dtype(msg["dtype"]), None, **msg["params"])
            runners = {label: _Local(fn) for label, fn in built.npattn.items()}
            answer: dict = {"ok": True}
        elif "warm" in msg:
            answer = {"best": runners[msg["label"]].warm(msg["warm"])}
        elif "turn" in msg:
            answer = {"times": runners[msg["label"]].turn(msg["turn"], msg["pause"])}
        else:
            answer = {"ok": True}
        print(json.dumps(answer), flush=True)
        if "quit" in msg:
            return


def time_case(kind, params, dtype, *, use_torch=True, own_process=False, warmup=1, repeats=5, pause=PAUSE):
    """Build a case (with torch's twin when ``use_torch`` and torch is importable), run its ``check``
    (one call of each callable), then time every callable in turns.  With ``own_process`` (and a torch side to separate
    from) npattn's callables are timed in a ``Child``.  Returns ``(built, seconds per label, facts)``."""
    torch = torch_or_none() if use_torch else None
    built = KINDS[kind].build(np.dtype(dtype), torch, **params)
    facts = built.check() if built.check is not None else {}
    fns: dict = dict(built.npattn)
    child = Child(kind, params, dtype) if own_process and built.torch else None
    if child is not None:  # pragma: needs torch
        fns = {label: child.fn(label) for label in built.npattn}
    try:
        times = time_interleaved(dict(fns, **built.torch), warmup=warmup, repeats=repeats, pause=pause)
    finally:
        if child is not None:  # pragma: needs torch
            child.close()
    return built, times, facts


# -- a fresh process: seconds and peak memory -----------------------------------------------------------
def _measure(kind, params, dtype, side, repeats):
    """In the fresh child: build the case (its inputs, and a tiny warm-up call), then ``repeats``
    calls; the best seconds and the memory before and at the peak."""
    torch = torch_or_none() if side == "torch" else None
    try:
        built = KINDS[kind].build(np.dtype(dtype), torch, **params)
    except Missing:
        return {"missing": True}
    fns = built.torch if side == "torch" else built.npattn
    if not fns:
        return {"missing": True}
    (fn,) = fns.values()
    before_kib = status_kib("VmRSS")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()  # its outputs are dropped before the next call
        times.append(time.perf_counter() - t0)
    return {"before_kib": before_kib, "peak_kib": status_kib("VmHWM"), "seconds": min(times)}


def fresh(kind, params, dtype=np.float32, *, side="npattn", repeats=1):
    """One case's single callable of ``side`` (``"npattn"`` or ``"torch"``) in a fresh process:
    ``{"seconds"`` (best of ``repeats``), ``"peak_mib"``, ``"extra_mib"`` (above the resident size
    just before the calls: interpreter, numpy, npattn, the inputs)``}``; ``{"missing": True}`` when
    the case does not exist there (no such core, or an option it lacks); ``{"error": ...}``."""
    request = {"fresh": {"kind": kind, "params": params, "dtype": np.dtype(dtype).name}, "side": side}
    r = _spawn(dict(request, repeats=repeats))
    if "error" in r or r.get("missing"):
        return r
    return {
        "seconds": r["seconds"],
        "peak_mib": r["peak_kib"] / 1024,
        "extra_mib": (r["peak_kib"] - r["before_kib"]) / 1024,
    }


def call_in_child(function, kwargs=None, *, unset=(), show_stderr=False):
    """``function`` (``"module:name"`` inside this package) called with ``kwargs`` in a child process
    whose environment lacks ``unset``; its JSON result (or ``{"error": ...}``)."""
    return _spawn({"call": function, "kwargs": kwargs or {}}, unset=unset, show_stderr=show_stderr)


def _spawn(request, unset=(), show_stderr=False):
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(request)],
        stdout=subprocess.PIPE,
        stderr=None if show_stderr else subprocess.PIPE,
        text=True,
        env=child_env(unset),
    )
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return {"error": tail[0]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child_main() -> None:
    """The entry of every child process (``CHILD``): the request is ``sys.argv[1]`` as JSON."""
    request = json.loads(sys.argv[1])
    if request.get("serve"):
        _serve()
        return
    if "fresh" in request:
        spec = request["fresh"]
        answer = _measure(spec["kind"], spec["params"], spec["dtype"], request["side"], request["repeats"])
    else:
        module, name = request["call"].split(":")
        answer = getattr(importlib.import_module(f"{__package__}.{module}"), name)(**request["kwargs"])
    print(json.dumps(answer))


# -- a section's steps, with progress --------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One step of a section: ``run()`` gives its rows; ``guess``: rough seconds, for the estimate."""

    label: str
    guess: float
    run: Callable[[], Any]


def _duration(seconds):
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def run_steps(title, steps, *, progress=True, note=None):
    """Run ``steps`` in order; the list of their results.  With ``progress``, before each step a line
    on stderr ``[i/n] label ... ~T left``: the guesses of the steps left, scaled by how the steps done
    so far compared with their guesses; after it ``note(result)`` when given."""
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    total = sum(s.guess for s in steps)
    say(f"== {title}: {len(steps)} steps, about {_duration(total)} (a guess)")
    results, start, guessed_done = [], time.perf_counter(), 0.0
    for i, step in enumerate(steps):
        left = sum(s.guess for s in steps[i:])
        if guessed_done > 0:
            left *= (time.perf_counter() - start) / guessed_done
        say(f"[{i + 1}/{len(steps)}] {step.label} ... ~{_duration(left)} left")
        results.append(step.run())
        guessed_done += step.guess
        text = note(results[-1]) if note is not None else ""
        if text:
            say("    " + text)
    say(f"== {title}: done in {_duration(time.perf_counter() - start)}")
    return results
