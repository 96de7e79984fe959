import math

import numpy as np
import pytest
from _oracles import rel_err

from npattn.functional._erf import erf

SPECIAL = [
    0.0,
    -0.0,
    5e-324,
    -5e-324,
    2.2250738585072014e-308,
    1e-300,
    -1e-300,
    1e-100,
    1e-20,
    1e-10,
    -1e-10,
    3.7e-9,
    1e-5,
    0.25,
    0.5,
    0.6174,
    0.84375,
    0.8437499999999999,
    1.0,
    1.25,
    1.2499999999999998,
    2.857142857142857,
    2.857143,
    3.0,
    5.9999999999,
    6.0,
    6.5,
    27.9,
    28.0,
    30.0,
    1e10,
    1e300,
    1.7976931348623157e308,
]
SPECIAL = SPECIAL + [-v for v in SPECIAL]


def _grid():
    return np.concatenate(
        [
            np.linspace(-7.0, 7.0, 200001),
            np.array(SPECIAL),
            np.geomspace(1e-12, 30.0, 20001),
            -np.geomspace(1e-12, 30.0, 20001),
        ]
    )


def test_float64_matches_math_erf():
    x = _grid()
    ref = np.array([math.erf(v) for v in x])
    got = erf(x)
    assert got.dtype == np.float64 and got.shape == x.shape
    assert rel_err(got, ref, floor=1e-300, relative_to="b") <= 1e-15


def test_special_values():
    got = erf(np.array([np.inf, -np.inf, np.nan, -0.0, 0.0]))
    assert got[0] == 1.0 and got[1] == -1.0
    assert np.isnan(got[2])
    assert got[3] == 0.0 and np.signbit(got[3])
    assert got[4] == 0.0 and not np.signbit(got[4])
    assert erf(-0.0) == 0.0 and np.signbit(erf(-0.0))
    assert erf(30.0) == 1.0 and erf(-30.0) == -1.0
    assert np.isnan(erf(np.nan))


def test_scalar_and_int_inputs():
    assert isinstance(erf(0.5), np.float64)
    assert erf(0.5) == pytest.approx(math.erf(0.5), rel=1e-15)
    out = erf(np.array([0, 1, -2]))
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, [0.0, math.erf(1.0), math.erf(-2.0)], rtol=1e-15)


def test_float32_stays_float32():
    x64 = _grid()
    x32 = x64[np.abs(x64) < 1e38].astype(np.float32)
    got = erf(x32)
    assert got.dtype == np.float32
    ref = erf(x32.astype(np.float64))
    finite = np.isfinite(x32)
    assert rel_err(got[finite].astype(np.float64), ref[finite], floor=1e-300, relative_to="b") <= 2e-6
    assert erf(np.float32(0.5)).dtype == np.float32
    sp = erf(np.array([np.inf, -np.inf, np.nan, -0.0], dtype=np.float32))
    assert sp.dtype == np.float32
    assert sp[0] == 1.0 and sp[1] == -1.0 and np.isnan(sp[2]) and np.signbit(sp[3])


def test_input_not_modified():
    for dt in (np.float64, np.float32):
        x = np.linspace(-8, 8, 1001).astype(dt)
        x[::7] *= -1
        before = x.copy()
        erf(x)
        np.testing.assert_array_equal(x, before)


def test_matches_scipy():
    special = pytest.importorskip("scipy.special")
    x = _grid()
    assert rel_err(erf(x), special.erf(x), floor=1e-300, relative_to="b") <= 1e-15
