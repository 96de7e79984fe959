"""The command-line tools' rooms: the demos share ``_train``/``_blas`` instead of importing each other,
and the benchmark's modules never import torch when they are imported."""

import ast
import contextlib
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import npattn._blas as core_blas
import npattn.tools.bench.runner as runner
from npattn.tools import _blas, _train

TOOLS = Path(__file__).resolve().parents[1] / "npattn" / "tools"


def _imported_modules(path):
    """The relative modules ``path`` imports (``.demo``, ``._train`` ...), wherever the import sits."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.add(node.module or "")
    return found


def test_demo_chars_does_not_import_demo():
    assert "demo" not in _imported_modules(TOOLS / "demo_chars.py")
    assert {"_train", "_blas"} <= _imported_modules(TOOLS / "demo_chars.py")
    assert {"_train", "_blas"} <= _imported_modules(TOOLS / "demo.py")


def test_demo_chars_imports_alone():
    code = "import sys, npattn.tools.demo_chars; print('npattn.tools.demo' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=runner.child_env(), check=True
    )
    assert out.stdout.strip() == "False"


def test_bench_package_imports_without_torch():
    code = "import sys, npattn.__main__, npattn.tools.bench; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=runner.child_env(), check=True
    )
    assert out.stdout.strip() == "False"


def test_smooth_is_a_moving_mean():
    x = np.array([1.0, 3.0, 5.0, 7.0])
    np.testing.assert_allclose(_train.smooth(x, 2), [2.0, 4.0, 6.0])
    np.testing.assert_allclose(_train.smooth(x, 10), [4.0])  # the window is at most the length


def test_progress_without_tqdm_prints_ten_lines(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    bar = _train.Progress(20)
    for step in range(20):
        bar(step, 1.0)
    bar.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("(install tqdm") and len(lines) == 11 and lines[-1] == "step    20/20  loss 1.0000"


def test_single_blas_thread_restores_the_thread_count(monkeypatch):
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # OpenBLAS's own functions, when found
    fns = _blas.openblas_functions("get_num_threads", "set_num_threads")
    before = None if fns is None else _get(fns[0])
    with _blas.single_blas_thread():
        if fns is not None:
            assert _get(fns[0]) == 1
    if fns is not None:
        assert _get(fns[0]) == before


def _get(fn):
    import ctypes

    fn.restype = ctypes.c_int
    return fn()


def test_progress_with_tqdm_shows_a_bar(monkeypatch):
    updates = []

    class FakeBar:
        def __init__(self, **kw):
            updates.append(("init", kw["total"]))

        def update(self, n):
            updates.append(("update", n))

        def set_postfix(self, **kw):
            updates.append(("postfix", kw["loss"]))

        def close(self):
            updates.append(("close",))

    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=FakeBar))
    bar = _train.Progress(3)
    for step in range(3):
        bar(step, 2.0)
    bar.close()
    assert updates[0] == ("init", 3) and updates[-1] == ("close",)
    assert updates.count(("update", 1)) == 3 and ("postfix", "2.0000") in updates


def test_openblas_lookup_without_openblas(monkeypatch):
    monkeypatch.setattr(core_blas, "_loaded_openblas_paths", lambda: ["/no/such/libopenblas.so"])
    assert _blas.openblas_functions("get_num_threads") is None  # cannot be loaded: skipped
    monkeypatch.setattr(core_blas, "_loaded_openblas_paths", lambda: [])
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)
    with _blas.single_blas_thread():  # no BLAS to limit: the block just runs
        pass


def test_openblas_paths_without_proc(monkeypatch):
    def no_proc(*args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr(core_blas, "open", no_proc, raising=False)
    assert core_blas._loaded_openblas_paths() == []


@pytest.mark.parametrize(
    "core, mnk", [(b"SkylakeX", 100**3), (b"SapphireRapids", 100**3), (b"Haswell", 1 << 18), (b"Zen", 1 << 18)]
)
def test_single_thread_gemm_mnk_follows_the_openblas_core(monkeypatch, core, mnk):
    """Products up to 100^3 multiply-adds only on the cores with OpenBLAS's small-matrix kernels;
    any other core, another BLAS or none: OpenBLAS's threading threshold 2^18."""
    monkeypatch.setattr(core_blas, "openblas_functions", lambda *names: [lambda: core])
    core_blas.single_thread_gemm_mnk.cache_clear()
    try:
        assert core_blas.single_thread_gemm_mnk() == mnk
        monkeypatch.setattr(core_blas, "openblas_functions", lambda *names: None)
        core_blas.single_thread_gemm_mnk.cache_clear()
        assert core_blas.single_thread_gemm_mnk() == 1 << 18
    finally:
        core_blas.single_thread_gemm_mnk.cache_clear()


def test_single_blas_thread_uses_threadpoolctl_when_installed(monkeypatch):
    seen = []

    @contextlib.contextmanager
    def threadpool_limits(limits, user_api):
        seen.append((limits, user_api))
        yield

    monkeypatch.setitem(sys.modules, "threadpoolctl", types.SimpleNamespace(threadpool_limits=threadpool_limits))
    with _blas.single_blas_thread():
        pass
    assert seen == [(1, "blas")]
