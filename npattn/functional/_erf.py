"""Vectorized error function in pure NumPy.

Port of the classic fdlibm ``s_erf.c`` (as shipped in FreeBSD msun and musl
``src/math/erf.c``), which carries this notice::

    Copyright (C) 1993 by Sun Microsystems, Inc. All rights reserved.
    Developed at SunPro, a Sun Microsystems, Inc. business.
    Permission to use, copy, modify, and distribute this
    software is freely granted, provided that this notice
    is preserved.

Algorithm (``a = |x|``, result carries the sign of ``x``):

1. ``a < 0.84375``:       ``erf = x + x*P(x^2)/Q(x^2)``  (subnormals scaled by 8)
2. ``0.84375 <= a < 1.25``: ``erf = erx + P1(s)/Q1(s)``, ``s = a - 1``,
   ``erx = (float)0.84506291151``
3. ``1.25 <= a < 1/0.35``: ``erf = 1 - exp(-z*z - 0.5625) * exp((z-a)*(z+a) + R1/S1) / a``
4. ``1/0.35 <= a < 6``:    same with ``R2/S2``; both in ``t = 1/a^2``.  ``z`` is
   ``a`` with its low mantissa bits cleared so ``z*z`` is exact (fdlibm's
   ``SET_LOW_WORD(z, 0)``; for float32 the ``erff`` mask ``0xffffe000``).
5. ``a >= 6`` (incl. inf): ``erf = sign(x)``.  NaN propagates.

Every branch is evaluated only on its own subset of elements.  Coefficients
are Python floats, so float32 input is computed and returned in float32
(NEP 50); float64 results are within ~1 ulp of the C library ``erf``.
"""

import numpy as np

__all__ = ["erf"]

_ERX = 8.45062911510467529297e-01
_EFX8 = 1.02703333676410069053e00
# [0, 0.84375)
_PP = (
    1.28379167095512558561e-01,
    -3.25042107247001499370e-01,
    -2.84817495755985104766e-02,
    -5.77027029648944159157e-03,
    -2.37630166566501626084e-05,
)
_QQ = (
    1.0,
    3.97917223959155352819e-01,
    6.50222499887672944485e-02,
    5.08130628187576562776e-03,
    1.32494738004321644526e-04,
    -3.96022827877536812320e-06,
)
# [0.84375, 1.25)
_PA = (
    -2.36211856075265944077e-03,
    4.14856118683748331666e-01,
    -3.72207876035701323847e-01,
    3.18346619901161753674e-01,
    -1.10894694282396677476e-01,
    3.54783043256182359371e-02,
    -2.16637559486879084300e-03,
)
_QA = (
    1.0,
    1.06420880400844228286e-01,
    5.40397917702171048937e-01,
    7.18286544141962662868e-02,
    1.26171219808761642112e-01,
    1.36370839120290507362e-02,
    1.19844998467991074170e-02,
)
# [1.25, 1/0.35)
_RA = (
    -9.86494403484714822705e-03,
    -6.93858572707181764372e-01,
    -1.05586262253232909814e01,
    -6.23753324503260060396e01,
    -1.62396669462573470355e02,
    -1.84605092906711035994e02,
    -8.12874355063065934246e01,
    -9.81432934416914548592e00,
)
_SA = (
    1.0,
    1.96512716674392571292e01,
    1.37657754143519042600e02,
    4.34565877475229228821e02,
    6.45387271733267880336e02,
    4.29008140027567833386e02,
    1.08635005541779435134e02,
    6.57024977031928170135e00,
    -6.04244152148580987438e-02,
)
# [1/0.35, 6)
_RB = (
    -9.86494292470009928597e-03,
    -7.99283237680523006574e-01,
    -1.77579549177547519889e01,
    -1.60636384855821916062e02,
    -6.37566443368389627722e02,
    -1.02509513161107724954e03,
    -4.83519191608651397019e02,
)
_SB = (
    1.0,
    3.03380607434824582924e01,
    3.25792512996573918826e02,
    1.53672958608443695994e03,
    3.19985821950859553908e03,
    2.55305040643316442583e03,
    4.74528541206955367215e02,
    -2.24409524465858183362e01,
)

# fdlibm's high-word threshold 0x4006DB6E for 1/0.35 (~2.857143), as a float.
_X035 = float(np.array(0x4006DB6E00000000, dtype=np.uint64).view(np.float64))


def _poly(c, t):
    """Horner evaluation of sum(c[k] * t**k) with Python-float coefficients."""
    r = c[-1]
    for ck in reversed(c[:-1]):
        r = ck + t * r
    return r


def _trunc(a):
    """``a`` with low mantissa bits zeroed, so that ``a*a`` is exact."""
    if a.dtype == np.float64:
        return (a.view(np.uint64) & np.uint64(0xFFFFFFFF00000000)).view(np.float64)
    if a.dtype == np.float32:
        return (a.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)
    return a


def erf(x):
    """Error function ``2/sqrt(pi) * int_0^x exp(-t^2) dt``, elementwise.

    float32/float64 inputs keep their dtype (float16 is computed in float32,
    integers/bools in float64).  The input is never modified.  Scalars give a
    NumPy scalar back.
    """
    x = np.asarray(x)
    if x.dtype.kind == "c":
        raise TypeError("erf: complex input is not supported")
    in_dtype = x.dtype if x.dtype.kind == "f" else np.dtype(np.float64)
    work = np.float32 if in_dtype == np.float16 else in_dtype
    x = x.astype(work, copy=True)  # NaN stays NaN unless overwritten
    out = x
    a = np.abs(x)
    sign = np.copysign(1.0, x)  # work dtype (Python float is weak)

    m = a < 0.84375  # 1. x + x*R(x^2)
    if m.any():
        xs = x[m]
        z = xs * xs
        r = xs + xs * (_poly(_PP, z) / _poly(_QQ, z))
        tiny = np.abs(xs) < np.finfo(work).tiny * 256  # avoid subnormal loss
        if tiny.any():
            xt = xs[tiny]
            r[tiny] = 0.125 * (8.0 * xt + _EFX8 * xt)
        out[m] = r

    m = (a >= 0.84375) & (a < 1.25)  # 2. erx + P1/Q1 around 1
    if m.any():
        s = a[m] - 1.0
        out[m] = sign[m] * (_ERX + _poly(_PA, s) / _poly(_QA, s))

    m = (a >= 1.25) & (a < 6.0)  # 3./4. 1 - erfc, asymptotic form
    if m.any():
        am = a[m]
        t = 1.0 / (am * am)
        lo = am < _X035
        rs = np.empty_like(am)
        if lo.any():
            tl = t[lo]
            rs[lo] = _poly(_RA, tl) / _poly(_SA, tl)
        hi = ~lo
        if hi.any():
            th = t[hi]
            rs[hi] = _poly(_RB, th) / _poly(_SB, th)
        z = _trunc(am)
        r = np.exp(-z * z - 0.5625) * np.exp((z - am) * (z + am) + rs)
        out[m] = sign[m] * (1.0 - r / am)

    m = a >= 6.0  # 5. saturated (incl. +-inf)
    out[m] = sign[m]

    if work != in_dtype:
        out = out.astype(in_dtype)
    return out[()] if out.ndim == 0 else out
