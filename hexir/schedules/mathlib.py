"""mathlib: float32 exp, log, tanh, erf (and rsqrt) as arith ops, so cpu code stays vectorised.

LLVM has no vector exp: `math.exp` on a vector<16xf32> becomes sixteen calls to libm's expf,
and a loop calling expf is not vectorised. `emit(name, x)` writes the function instead, for a
float32 scalar or vector `x`, from operations every x86-64 level has in vector form (add, mul,
div, compare, select, integer add/shift and bit casts: no conversion between float and i64,
which AVX2 lacks). Each function widens x to float64, evaluates there, and rounds once at the
end: the float64 evaluation is accurate to about 1e-10 relative (a tenth of a thousandth of a
float32 ulp), so the results are within 1 ulp of the exact values, most are correctly rounded
(bench/math_accuracy.py measures it; docs/math.md has the numbers). No fast-math flags: NaN,
±inf, -0 and overflow behave as numpy's.

- exp: n = round(y / ln 2) by adding 1.5 * 2^52; r = y - n ln 2 (two-part ln 2, exact products),
  exp(r) by its Taylor series to r^10 (|r| <= 0.347), times 2^n built from n's bits. y is first
  clamped to [-104, 89], where float32 exp has already underflowed to 0 or overflowed to inf.
- log: x = 2^k m with m in [sqrt(1/2), sqrt(2)) taken from the bits, s = (m - 1) / (m + 1),
  log m = 2 atanh(s) = 2 (s + s^3/3 + ... + s^15/15) (|s| <= 0.172), plus k ln 2. 0, negative
  numbers, +inf and NaN are chosen by compares (-inf, NaN, inf, NaN); float32 subnormals are
  normal in float64.
- tanh: tanh |x| = e / (e + 2) with e = expm1(2|x|) = 2^n expm1(r) + (2^n - 1), 2|x| clamped
  to 40 (tanh is 1 in float64 beyond 19), the sign put back by copysign (so tanh(-0) = -0).
- erf: for |x| < 1 the Taylor series x (2/sqrt(pi)) sum (-x^2)^n / (n! (2n + 1)) to n = 12;
  for 1 <= |x| <= 4, 1 - exp(-x^2) g(x) where g(x) = exp(x^2) erfc(x) is a degree-14 polynomial
  interpolating g at Chebyshev points (computed here once from Python's math.erfc); beyond 4
  erf is 1 in float32.
- rsqrt: 1 / sqrt(x) in float64 (vector instructions), rounded once.

Float64 values, and every other op, get None: the caller lowers those to libm.
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
ERF_SPLIT, ERF_ONE = 1.0, 4.0    # erf's two pieces meet at 1; erf rounds to 1 in float32 beyond 4


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


_EXP_TAYLOR = [1 / math.factorial(k) for k in range(11)]       # exp(r), |r| <= 0.347
_EXPM1_TAYLOR = [1 / math.factorial(k + 1) for k in range(10)]  # expm1(r) / r
_ATANH_SERIES = [2 / (2 * k + 1) for k in range(8)]             # 2 atanh(s) / s in s^2
_ERF_TAYLOR = [2 / math.sqrt(math.pi) * (-1) ** n / (math.factorial(n) * (2 * n + 1)) for n in range(13)]


@functools.cache
def _erfcx_coefficients() -> list[float]:
    """g(x) = exp(x^2) erfc(x) on [1, 4] as a polynomial in t = (2x - 5) / 3 in [-1, 1]."""
    interpolant = np.polynomial.Chebyshev.interpolate(
        np.vectorize(lambda x: math.erfc(x) * math.exp(x * x)), 14, domain=[ERF_SPLIT, ERF_ONE])
    return [float(c) for c in np.polynomial.chebyshev.cheb2poly(interpolant.coef)]


def _reduce(w: _Wide, y: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(r, 2^n) with y = n ln 2 + r, |r| <= ln 2 / 2; y finite, |y| < 700."""
    t = arith.addf(arith.mulf(y, w.f(1 / math.log(2))), w.f(MAGIC))
    n = arith.subf(t, w.f(MAGIC))
    r = arith.subf(arith.subf(y, arith.mulf(n, w.f(LN2_HI))), arith.mulf(n, w.f(LN2_LO)))
    n_bits = arith.subi(arith.bitcast(w.i64, t), w.i(np.float64(MAGIC).view(np.int64).item()))
    scale = arith.bitcast(w.f64, arith.shli(arith.addi(n_bits, w.i(1023)), w.i(52)))
    return r, scale


def _exp_wide(w: _Wide, y: ir.Value) -> ir.Value:
    r, scale = _reduce(w, y)
    return arith.mulf(w.horner(r, _EXP_TAYLOR), scale)


def _exp(w: _Wide, x: ir.Value) -> ir.Value:
    return _exp_wide(w, w.clamp(arith.extf(w.f64, x), -104.0, 89.0))


def _log(w: _Wide, x: ir.Value) -> ir.Value:
    wide = arith.extf(w.f64, x)
    bits = arith.addi(arith.bitcast(w.i64, wide), w.i(0x3FF0000000000000 - SQRT_HALF_BITS))
    k = arith.subi(arith.shrui(bits, w.i(52)), w.i(1023))  # x = 2^k m, m in [sqrt(1/2), sqrt(2))
    m = arith.bitcast(w.f64, arith.addi(arith.andi(bits, w.i((1 << 52) - 1)), w.i(SQRT_HALF_BITS)))
    k_float = arith.subf(arith.bitcast(w.f64, arith.addi(k, w.i(0x4338000000000000))), w.f(MAGIC))
    s = arith.divf(arith.subf(m, w.f(1.0)), arith.addf(m, w.f(1.0)))
    log_m = arith.mulf(s, w.horner(arith.mulf(s, s), _ATANH_SERIES))
    result = arith.addf(arith.addf(arith.mulf(k_float, w.f(LN2_LO)), log_m), arith.mulf(k_float, w.f(LN2_HI)))
    for predicate, bound, value in ((arith.CmpFPredicate.OEQ, math.inf, math.inf),
                                    (arith.CmpFPredicate.OEQ, 0.0, -math.inf),
                                    (arith.CmpFPredicate.ULT, 0.0, math.nan)):  # below 0, or NaN
        result = arith.select(arith.cmpf(predicate, wide, w.f(bound)), w.f(value), result)
    return result


def _tanh(w: _Wide, x: ir.Value) -> ir.Value:
    a = arith.extf(w.f64, math_dialect.absf(x))
    r, scale = _reduce(w, w.clamp(arith.addf(a, a), None, 40.0))
    e = arith.addf(arith.mulf(scale, arith.mulf(r, w.horner(r, _EXPM1_TAYLOR))), arith.subf(scale, w.f(1.0)))
    return math_dialect.copysign(arith.divf(e, arith.addf(e, w.f(2.0))), arith.extf(w.f64, x))


def _erf(w: _Wide, x: ir.Value) -> ir.Value:
    a = w.clamp(arith.extf(w.f64, math_dialect.absf(x)), None, ERF_ONE)
    square = arith.mulf(a, a)  # exact: a float32 squared fits a float64
    small = arith.mulf(a, w.horner(square, _ERF_TAYLOR))
    t = arith.divf(arith.subf(arith.addf(a, a), w.f(ERF_SPLIT + ERF_ONE)), w.f(ERF_ONE - ERF_SPLIT))
    tail = arith.mulf(_exp_wide(w, arith.negf(square)), w.horner(t, _erfcx_coefficients()))
    large = arith.subf(w.f(1.0), tail)
    result = arith.select(arith.cmpf(arith.CmpFPredicate.OLT, a, w.f(ERF_SPLIT)), small, large)
    return math_dialect.copysign(result, arith.extf(w.f64, x))


def _rsqrt(w: _Wide, x: ir.Value) -> ir.Value:
    """1 / sqrt(x) rounded once (in float32 it would be rounded twice: up to 1.5 ulp)."""
    return arith.divf(w.f(1.0), math_dialect.sqrt(arith.extf(w.f64, x)))


_FLOAT32 = {"math.exp": _exp, "math.log": _log, "math.tanh": _tanh, "math.erf": _erf, "math.rsqrt": _rsqrt}


def emit(name: str, x: ir.Value) -> ir.Value | None:
    """`name` ("math.exp", ...) of x as arith ops at the current insertion point and location,
    for a float32 scalar or vector x; None where this module has no approximation (float64, other
    ops): lower those to libm."""
    element = x.type.element_type if isinstance(x.type, ir.VectorType) else x.type
    if name not in _FLOAT32 or not isinstance(element, ir.F32Type):
        return None
    w = _Wide(x)
    return arith.truncf(x.type, _FLOAT32[name](w, x))
