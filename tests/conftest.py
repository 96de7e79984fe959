"""Shared pytest configuration: hypothesis profiles and small helpers.

Profiles: ``ci`` (the default; derandomized, 200 examples, no deadline) and ``dev`` (1000
examples).  Choose one with ``HYPOTHESIS_PROFILE=dev pytest``.
"""

import os
import sys

import pytest

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # tests that need hypothesis fail at their own import with a clear message
    settings = None

if settings is not None:
    settings.register_profile(
        "ci",
        derandomize=True,
        deadline=None,
        max_examples=200,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.register_profile("dev", max_examples=1000, deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    """In an xdist worker (the README's command runs one per core), numpy's OpenBLAS computes on
    the worker's own thread: with its default of a thread per core, every worker's threaded
    products spin-wait for cores the other workers hold (a test module's products took twice the
    wall time and three times the CPU).  Set through OpenBLAS's own call in this process only (no
    environment variable, nothing a child process inherits): npattn chooses no code path by the
    BLAS's thread count (its thread pools count the CPUs), so every test runs what it ran before.
    A run without workers (``-n 0``) keeps the BLAS's default."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        from npattn._blas import openblas_functions

        blas = openblas_functions("set_num_threads")
        if blas is not None:
            blas[0](1)


def pytest_runtest_setup(item):
    """torch, where a test module has imported it (an oracle only), computes on one thread: its
    tensors here are tiny, and its OpenMP threads spin while they wait, so two of them in each of
    the two xdist workers on two cores take turns at 50 times a thread's time.  Set before every
    test: ``npattn.tools.bench`` sets torch's threads for its own timings."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture
def torch_or_skip():
    """The ``torch`` module, or skip the test when torch is not installed (an oracle only)."""
    return pytest.importorskip("torch")


@pytest.fixture(scope="session", autouse=True)
def _jupyter_kernel_of_this_python(tmp_path_factory):
    """Jupyter kernels the suite starts (the notebooks, the docs build's executed pages) run the
    interpreter under test, whatever kernelspecs the user's own Jupyter directories hold (a
    ``python3`` spec there may point at another environment, or at one deleted since): ipykernel's
    own spec for ``sys.executable``, written into a temporary directory put first on
    ``JUPYTER_PATH`` (searched before the user's and the environment's directories).  Without
    ipykernel nothing is written (those tests skip)."""
    try:
        from ipykernel.kernelspec import write_kernel_spec
    except ImportError:
        yield
        return
    kernels = tmp_path_factory.mktemp("jupyter") / "kernels"
    kernels.mkdir()
    write_kernel_spec(kernels / "python3")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, [str(kernels.parent), os.environ.get("JUPYTER_PATH")])))
        yield
