"""mathlib: exp, log, tanh, erf (and float32 rsqrt) as arith ops, so cpu code stays vectorised.

LLVM has no vector exp: `math.exp` on a vector<16xf32> becomes sixteen calls to libm's expf,
and a loop calling expf is not vectorised. `emit(name, x)` writes the function instead, for a
float32 or float64 scalar or vector `x`, from operations every x86-64 level has in vector form
(add, mul, div, sqrt, compare, select, integer add/shift, bit casts: no conversion between
float and i64, which AVX2 lacks). A float32 x is widened to float64, evaluated there (about
1e-15 relative) and rounded once, so its results are within 0.5 ulp plus a hair of the exact
value; a float64 x is evaluated in float64 (under 5e-16 relative). bench/
math_accuracy.py measures it; docs/math.md has the numbers. No fast-math flags: NaN, ±inf,
-0, subnormals and overflow behave as numpy's.

- exp: n = round(y / ln 2) by adding 1.5 * 2^52; r = y - n ln 2 (two-part ln 2, exact products);
  exp(r) by its Taylor series to r^13 (|r| <= 0.347), times 2^(n//2) then 2^(n - n//2), built
  from n's bits (so a subnormal or overflowing result is rounded once). y is first clamped to
  [-746, 710], beyond which exp is 0 or inf.
- log: x = 2^k m with m in [sqrt(1/2), sqrt(2)) taken from the bits (a subnormal x scaled by
  2^54 first), s = (m - 1) / (m + 1), log m = 2 atanh(s) = 2 (s + s^3/3 + ... + s^23/23)
  (|s| <= 0.172), plus k ln 2. 0, negative numbers, +inf and NaN are chosen by compares.
- tanh: tanh |x| = e / (e + 2) with e = expm1(2|x|) = 2^n expm1(r) + (2^n - 1), 2|x| clamped
  to 40 (tanh is 1 in float64 beyond 19), the sign put back by copysign (so tanh(-0) = -0).
- erf: for |x| < 1.5 the Taylor series x (2/sqrt(pi)) sum (-x^2)^n / (n! (2n + 1)) to n = 25;
  for 1.5 <= |x| <= 6, 1 - exp(-x^2) g(x) where g(x) = exp(x^2) erfc(x) is the degree-24
  polynomial interpolating g at Chebyshev points (computed here once, from Python's math.erfc);
  beyond 6 erf is 1 in float64. From 1.5 on, erfc <= 0.034 erf, so the polynomial's error
  (about 1e-14 relative: its samples of g are that accurate) reaches erf 30 times smaller.
- rsqrt (float32): 1 / sqrt(x) in float64, rounded once (in float32: two roundings, 1.5 ulp).

Other ops, and float64 rsqrt (LLVM's 1 / sqrt), get None: the caller lowers them to LLVM/libm.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from mlir import ir
from mlir.dialects import arith
from mlir.dialects import math as math_dialect

MAGIC = 1.5 * 2.0**52            # adding it rounds a float64 below 2^51 to an integer, in its low bits
LN2_HI = 0.6931471803691238      # ln 2 in 32 significant bits: n * LN2_HI is exact for |n| < 2^21
LN2_LO = 1.9082149292705877e-10  # ln 2 - LN2_HI
SQRT_HALF_BITS = 0x3FE6A09E667F3BCD
ERF_SPLIT, ERF_ONE = 1.5, 6.0    # erf's two pieces meet at 1.5; erf rounds to 1 in float64 beyond 5.93
ERF_DEGREE = 24                  # of the polynomial for exp(x^2) erfc(x) on [ERF_SPLIT, ERF_ONE]


class _Wide:
    """Builds float64/i64/i1 values of the shape of one float32 value (scalar or vector)."""

    def __init__(self, value: ir.Value):
        self.shape = list(value.type.shape) if isinstance(value.type, ir.VectorType) else None
        self.f64 = self.typed(ir.F64Type.get())
        self.i64 = self.typed(ir.IntegerType.get_signless(64))

    def typed(self, element: ir.Type) -> ir.Type:
        return element if self.shape is None else ir.VectorType.get(self.shape, element)

    def constant(self, type_: ir.Type, number: float | int) -> ir.Value:
        element = type_.element_type if self.shape is not None else type_
        attribute = (ir.FloatAttr.get(element, number) if isinstance(number, float)
                     else ir.IntegerAttr.get(element, number))
        if self.shape is not None:
            attribute = ir.DenseElementsAttr.get_splat(type_, attribute)
        return arith.constant(type_, attribute)

    def f(self, number: float) -> ir.Value:
        return self.constant(self.f64, float(number))

    def i(self, number: int) -> ir.Value:
        return self.constant(self.i64, number)

    def horner(self, x: ir.Value, coefficients: list[float]) -> ir.Value:
        """c0 + x (c1 + x (c2 + ...)), lowest degree first."""
        result = self.f(coefficients[-1])
        for c in reversed(coefficients[:-1]):
            result = arith.addf(arith.mulf(result, x), self.f(c))
        return result

    def clamp(self, x: ir.Value, low: float | None, high: float) -> ir.Value:
        """x limited to [low, high] by compares: a NaN stays a NaN."""
        x = arith.select(arith.cmpf(arith.CmpFPredicate.OGT, x, self.f(high)), self.f(high), x)
        if low is not None:
            x = arith.select(arith.cmpf(arith.CmpFPredicate.OLT, x, self.f(low)), self.f(low), x)
        return x


_EXP_TAYLOR = [1 / math.factorial(k) for k in range(14)]       # exp(r), |r| <= 0.347: 4e-18 left
_EXPM1_TAYLOR = [1 / math.factorial(k + 1) for k in range(13)]  # expm1(r) / r
_ATANH_SERIES = [2 / (2 * k + 1) for k in range(12)]            # 2 atanh(s) / s in s^2 <= 0.0295
_ERF_TAYLOR = [2 / math.sqrt(math.pi) * (-1) ** n / (math.factorial(n) * (2 * n + 1)) for n in range(26)]


@functools.cache
def _erfcx_coefficients() -> list[float]:
    """g(x) = exp(x^2) erfc(x) on [1.5, 6] as a polynomial in t = (2x - 7.5) / 4.5 in [-1, 1]."""
    interpolant = np.polynomial.Chebyshev.interpolate(
        np.vectorize(lambda x: math.erfc(x) * math.exp(x * x)), ERF_DEGREE, domain=[ERF_SPLIT, ERF_ONE])
    return [float(c) for c in np.polynomial.chebyshev.cheb2poly(interpolant.coef)]


def _reduce(w: _Wide, y: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
    """(r, 2^h, 2^(n - h)) with y = n ln 2 + r, |r| <= ln 2 / 2, h = n // 2; |y| < 750. Two
    factors, so that 2^n may be a float64 subnormal or overflow: (p 2^h) 2^(n - h) rounds once."""
    t = arith.addf(arith.mulf(y, w.f(1 / math.log(2))), w.f(MAGIC))
    n = arith.subf(t, w.f(MAGIC))
    r = arith.subf(arith.subf(y, arith.mulf(n, w.f(LN2_HI))), arith.mulf(n, w.f(LN2_LO)))
    n_bits = arith.subi(arith.bitcast(w.i64, t), w.i(np.float64(MAGIC).view(np.int64).item()))
    half = arith.shrsi(n_bits, w.i(1))
    return r, *(arith.bitcast(w.f64, arith.shli(arith.addi(k, w.i(1023)), w.i(52)))
                for k in (half, arith.subi(n_bits, half)))


def _exp_wide(w: _Wide, y: ir.Value) -> ir.Value:
    r, scale, rest = _reduce(w, w.clamp(y, -746.0, 710.0))  # exp underflows to 0 / overflows beyond
    return arith.mulf(arith.mulf(w.horner(r, _EXP_TAYLOR), scale), rest)


def _log_wide(w: _Wide, x: ir.Value) -> ir.Value:
    subnormal = arith.cmpf(arith.CmpFPredicate.OLT, x, w.f(2.0**-1022))
    x = arith.select(subnormal, arith.mulf(x, w.f(2.0**54)), x)
    bits = arith.addi(arith.bitcast(w.i64, x), w.i(0x3FF0000000000000 - SQRT_HALF_BITS))
    k = arith.subi(arith.shrui(bits, w.i(52)), arith.select(subnormal, w.i(1023 + 54), w.i(1023)))
    m = arith.bitcast(w.f64, arith.addi(arith.andi(bits, w.i((1 << 52) - 1)), w.i(SQRT_HALF_BITS)))
    k_float = arith.subf(arith.bitcast(w.f64, arith.addi(k, w.i(0x4338000000000000))), w.f(MAGIC))
    s = arith.divf(arith.subf(m, w.f(1.0)), arith.addf(m, w.f(1.0)))  # x = 2^k m, m in [sqrt(1/2), sqrt(2))
    log_m = arith.mulf(s, w.horner(arith.mulf(s, s), _ATANH_SERIES))
    result = arith.addf(arith.addf(arith.mulf(k_float, w.f(LN2_LO)), log_m), arith.mulf(k_float, w.f(LN2_HI)))
    for predicate, bound, value in ((arith.CmpFPredicate.OEQ, math.inf, math.inf),
                                    (arith.CmpFPredicate.OEQ, 0.0, -math.inf),
                                    (arith.CmpFPredicate.ULT, 0.0, math.nan)):  # below 0, or NaN
        result = arith.select(arith.cmpf(predicate, x, w.f(bound)), w.f(value), result)
    return result


def _tanh_wide(w: _Wide, x: ir.Value) -> ir.Value:
    a = math_dialect.absf(x)
    r, scale, rest = _reduce(w, w.clamp(arith.addf(a, a), None, 40.0))
    two_n = arith.mulf(scale, rest)  # 2^n, n <= 58
    e = arith.addf(arith.mulf(two_n, arith.mulf(r, w.horner(r, _EXPM1_TAYLOR))), arith.subf(two_n, w.f(1.0)))
    return math_dialect.copysign(arith.divf(e, arith.addf(e, w.f(2.0))), x)


def _erf_wide(w: _Wide, x: ir.Value) -> ir.Value:
    a = w.clamp(math_dialect.absf(x), None, ERF_ONE)
    square = arith.mulf(a, a)
    small = arith.mulf(a, w.horner(square, _ERF_TAYLOR))
    t = arith.divf(arith.subf(arith.addf(a, a), w.f(ERF_SPLIT + ERF_ONE)), w.f(ERF_ONE - ERF_SPLIT))
    tail = arith.mulf(_exp_wide(w, arith.negf(square)), w.horner(t, _erfcx_coefficients()))
    result = arith.select(arith.cmpf(arith.CmpFPredicate.OLT, a, w.f(ERF_SPLIT)), small,
                          arith.subf(w.f(1.0), tail))
    return math_dialect.copysign(result, x)


def _rsqrt_wide(w: _Wide, x: ir.Value) -> ir.Value:
    """1 / sqrt(x) rounded once (in float32 it would be rounded twice: up to 1.5 ulp)."""
    return arith.divf(w.f(1.0), math_dialect.sqrt(x))


_WIDE = {"math.exp": _exp_wide, "math.log": _log_wide, "math.tanh": _tanh_wide, "math.erf": _erf_wide,
         "math.rsqrt": _rsqrt_wide}


def emit(name: str, x: ir.Value) -> ir.Value | None:
    """`name` ("math.exp", ...) of x as arith ops at the current insertion point and location,
    for a float32 or float64 scalar or vector x; None where this module has no approximation
    (other ops, float64 rsqrt): lower those to LLVM or libm."""
    element = x.type.element_type if isinstance(x.type, ir.VectorType) else x.type
    if name not in _WIDE or not isinstance(element, ir.F32Type | ir.F64Type) or (
            name == "math.rsqrt" and isinstance(element, ir.F64Type)):  # LLVM's 1 / sqrt is this already
        return None
    w = _Wide(x)
    if isinstance(element, ir.F64Type):
        return _WIDE[name](w, x)
    return arith.truncf(x.type, _WIDE[name](w, arith.extf(w.f64, x)))
