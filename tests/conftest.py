"""Shared pytest configuration: hypothesis profiles and small helpers.

Profiles: ``ci`` (the default; derandomized, 200 examples, no deadline) and ``dev`` (1000
examples).  Choose one with ``HYPOTHESIS_PROFILE=dev pytest``.
"""

import os

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


@pytest.fixture
def torch_or_skip():
    """The ``torch`` module, or skip the test when torch is not installed (an oracle only)."""
    return pytest.importorskip("torch")
