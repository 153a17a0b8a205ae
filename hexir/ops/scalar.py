"""Scalars: how an op's element meaning is written. A pointwise op is a Python function of
`Scalar`s (`lambda x: 0.5 * x * (1 + erf(x * SQRT1_2))`); calling it on `Scalar.arg(i)`s
gives its tree in the runtime's scalar-expression language (`hexir_runtime.format.scalars`),
the one source of its IR, its numpy meaning and its cache key. A reduce op's function also
calls `row_sum`, `row_max`, `row_argmax` and `row_length` (the reduced axis), each a reduction
of the current row, which its program (`reduce_program`) collects in order.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from hexir_runtime.errors import HxbFormatError
from hexir_runtime.format import scalars

from hexir.errors import TraceError

Number = int | float
_state = threading.local()


def _operators(op: str) -> tuple[Callable[..., Scalar], Callable[..., Scalar]]:
    """A Scalar's `x <op> other` and reflected `other <op> x` (a number on the left): the tree `[op, ...]`."""
    def forward(self: Scalar, other: Scalar | Number) -> Scalar:
        return _binary(op, self, other)

    def reflected(self: Scalar, other: Number) -> Scalar:
        return _binary(op, other, self)
    return forward, reflected


class Scalar:
    """One element of a tensor inside an op's definition: arithmetic builds the tree."""

    __slots__ = ("tree",)

    def __init__(self, tree: scalars.Tree) -> None:
        self.tree = tree

    @staticmethod
    def arg(index: int) -> Scalar:
        return Scalar(["arg", index])

    __add__, __radd__ = _operators("add")
    __sub__, __rsub__ = _operators("sub")
    __mul__, __rmul__ = _operators("mul")
    __truediv__, __rtruediv__ = _operators("div")

    def __neg__(self) -> Scalar:
        return Scalar(["const", -self.tree[1]]) if self.tree[0] == "const" else Scalar(["neg", self.tree])

    def __pow__(self, exponent: Number) -> Scalar:
        if isinstance(exponent, Scalar) or not _is_number(exponent):
            raise TraceError(f"** takes a number exponent, got {type(exponent).__name__}")
        return _binary("pow", self, exponent)

    def __abs__(self) -> Scalar:
        return _unary("abs", self)

    def __repr__(self) -> str:
        return f"Scalar({scalars.text(self.tree)})"

    def _not_a_number(self, *_: object) -> Any:
        raise TraceError(f"{self!r} is an op's element, not a number: math.exp and the like, if and int() "
                         "need its value; use hexir.scalar.exp (log, tanh, sqrt, rsqrt, erf, maximum, "
                         "minimum), not math.exp, and no branches on it")

    # math.exp(x), float(x), `if x > 0`, range(x), a[x]: each needs a value an element does not have
    __float__ = __int__ = __index__ = __bool__ = __gt__ = __ge__ = __lt__ = __le__ = _not_a_number


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def lift(value: Scalar | Number) -> scalars.Tree:
    if isinstance(value, Scalar):
        return value.tree
    if _is_number(value) and math.isfinite(value):
        return ["const", float(value)]
    raise TraceError(f"an op's element function got {value!r}; expected a Scalar or a finite number")


def _binary(op: str, a: Scalar | Number, b: Scalar | Number) -> Scalar:
    ta, tb = lift(a), lift(b)
    if ta[0] == tb[0] == "const":  # folded here: 1 / math.sqrt(2) and the like stay one number
        value = scalars.evaluate([op, ta, tb], [], "float64").item()
        if math.isfinite(value):
            return Scalar(["const", value])
    return Scalar([op, ta, tb])


def _unary(op: str, x: Scalar | Number) -> Scalar:
    return Scalar([op, lift(x)])


def exp(x: Scalar) -> Scalar:
    return _unary("exp", x)


def log(x: Scalar) -> Scalar:
    return _unary("log", x)


def tanh(x: Scalar) -> Scalar:
    return _unary("tanh", x)


def sqrt(x: Scalar) -> Scalar:
    return _unary("sqrt", x)


def rsqrt(x: Scalar) -> Scalar:
    return _unary("rsqrt", x)


def erf(x: Scalar) -> Scalar:
    return _unary("erf", x)


def maximum(a: Scalar | Number, b: Scalar | Number) -> Scalar:
    return _binary("max", a, b)


def minimum(a: Scalar | Number, b: Scalar | Number) -> Scalar:
    return _binary("min", a, b)


# ---- reduce programs -------------------------------------------------------------------------

def _reductions() -> list[tuple[str, scalars.Tree]]:
    current = getattr(_state, "reductions", None)
    if current is None:
        raise TraceError("row_sum, row_max, row_argmax and row_length exist only in a reduce op's definition")
    return current


def _reduce(kind: str, x: Scalar) -> Scalar:
    found = _reductions()
    found.append((kind, lift(x)))
    return Scalar(["red", len(found) - 1])


def row_sum(x: Scalar) -> Scalar:
    """The sum of `x` over the reduced axis, for the current row."""
    return _reduce("sum", x)


def row_max(x: Scalar) -> Scalar:
    """The largest `x` of the row (NaN if any is: numpy's max)."""
    return _reduce("max", x)


def row_argmax(x: Scalar) -> Scalar:
    """The index of the row's first largest `x` (numpy's argmax): an int64 output, usable only as the result."""
    return _reduce("argmax", x)


def row_length() -> Scalar:
    """The reduced axis' extent."""
    _reductions()
    return Scalar(["len"])


def _call(op: str, function: Callable[..., Any], operands: Sequence[Scalar | None], params: dict) -> scalars.Tree:
    """The tree of `function(*operands, **params)`: its result must be a Scalar, and what it
    raises (numpy or `math` called on a Scalar, a wrong parameter) becomes a TraceError naming the op."""
    try:
        result = function(*operands, **params)
    except TraceError as error:
        raise TraceError(f"op {op}: {error.message}") from None
    except Exception as error:  # the user's definition failed: say which op, and what it may call
        raise TraceError(f"op {op}: its function raised {type(error).__name__}: {error} (it computes on "
                         "hexir.scalar.Scalar values: arithmetic, ** a number, and hexir.scalar's functions, "
                         "not numpy's or math's)") from None
    if not isinstance(result, Scalar):
        raise TraceError(f"op {op}: its function returned {type(result).__name__} {result!r:.40}; expected a "
                         "hexir.scalar.Scalar computed from its operands")
    return result.tree


def pointwise_tree(op: str, function: Callable[..., Scalar], arity: int, **params: Any) -> scalars.Tree:
    """The tree of the pointwise op `op`'s function of `arity` scalars (and keyword `params`)."""
    return _call(op, function, [Scalar.arg(i) for i in range(arity)], params)


def reduce_program(op: str, function: Callable[..., Scalar], operands: Sequence[Scalar | None], axis: int,
                   **params: Any) -> scalars.Program:
    """The program of the reduce op `op`'s function called on `operands` (None for an absent
    optional one), checked as the runtime will check it."""
    _state.reductions = []
    try:
        out = _call(op, function, operands, params)
        reductions = tuple(_state.reductions)
    finally:
        _state.reductions = None
    if not reductions:
        raise TraceError(f"op {op}: a reduce op's function must reduce (call row_sum, row_max or row_argmax)")
    program = scalars.Program(axis, reductions, out)
    try:
        scalars.check_program(program.to_json(), op, len(operands), axis + 1)
    except HxbFormatError as error:
        raise TraceError(f"op {op}: its function makes a program the runtime refuses: {error}") from None
    return program
