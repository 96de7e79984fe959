"""The golden file: every case of ``tests/golden/record.py`` recomputed and compared with
``tests/golden/round4.npz``, recorded before the redesign of issue 29 (nothing changes for users).

float64 must agree to 1e-13 and float32 to 1e-6 of the array's largest element (a changed
summation order moves the last digits; anything larger is a changed formula); NaN positions, shapes,
dtypes, integer arrays (token ids, chosen experts) and the set of recorded names must be equal.
A number that a legitimate fix moves is re-recorded with ``python tests/golden/record.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from golden.record import CASES, DTYPES, GOLDEN, compute

TOLERANCE = {"float64": 1e-13, "float32": 1e-6}


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as z:
        return {name: z[name] for name in z.files}


def mismatch(got: np.ndarray, want: np.ndarray, tol: float) -> str | None:
    """Why ``got`` differs from the recorded ``want`` (None if it does not): relative error
    ``max |got - want| / max(max |want|, tiny)`` over the finite elements."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"expected {want.dtype} {want.shape}, got {got.dtype} {got.shape}"
    if not np.issubdtype(want.dtype, np.floating):
        return None if np.array_equal(got, want) else f"values differ at {np.argwhere(got != want)[:5].tolist()}"
    if not np.array_equal(np.isnan(got), np.isnan(want)):
        return "NaN positions differ"
    finite = np.isfinite(want)
    if not np.array_equal(got[~finite & ~np.isnan(want)], want[~finite & ~np.isnan(want)]):
        return "infinities differ"
    a, b = got[finite].astype(np.float64), want[finite].astype(np.float64)
    if b.size == 0:
        return None
    err = float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), float(np.finfo(want.dtype).tiny))
    if not err <= tol:  # also catches a NaN where the recording has a finite number
        worst = np.unravel_index(int(np.argmax(np.where(finite, np.abs(got - want), -1))), want.shape)
        return f"relative error {err:.2e} > {tol:.0e} (worst at {tuple(map(int, worst))})"
    return None


def test_the_golden_file_holds_every_case_and_is_small(golden):
    recorded = {k.split("/")[0] for k in golden}
    assert recorded == {c.__name__ for c in CASES}
    assert GOLDEN.stat().st_size < 5e6


@pytest.mark.parametrize("dtype", [np.dtype(d).name for d in DTYPES])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_golden(case, dtype, golden):
    prefix, suffix = f"{case.__name__}/", f"/{dtype}"
    want = {k[len(prefix) : -len(suffix)]: v for k, v in golden.items() if k.startswith(prefix) and k.endswith(suffix)}
    got = compute(case, np.dtype(dtype).type)
    assert sorted(got) == sorted(want), "the recorded names differ"
    bad = {name: why for name in want if (why := mismatch(got[name], want[name], TOLERANCE[dtype])) is not None}
    shown = "; ".join(f"{n}: {w}" for n, w in list(bad.items())[:6])
    assert not bad, f"{case.__name__} ({dtype}), {len(bad)} of {len(want)} arrays differ: {shown}"


def test_mismatch_catches_what_it_should():
    rng = np.random.default_rng(0)
    b = rng.standard_normal((3, 4))
    assert mismatch(b * (1 + 1e-14), b, 1e-13) is None
    assert "relative error" in mismatch(b + 1e-12 * np.abs(b).max(), b, 1e-13)
    assert "expected" in mismatch(b.astype(np.float32), b, 1e-6)
    nan = b.copy()
    nan[1, 2] = np.nan
    assert mismatch(nan, nan.copy(), 1e-13) is None
    assert mismatch(b, nan, 1e-13) == "NaN positions differ"
    assert mismatch(np.zeros(3), np.zeros(3), 1e-13) is None
    assert "relative error" in mismatch(np.full(3, 1e-200), np.zeros(3), 1e-13)
    assert "values differ" in mismatch(np.array([1, 2]), np.array([1, 3]), 0.0)
