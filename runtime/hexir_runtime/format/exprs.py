"""Size expressions: how many iterations, blocks or elements a kernel needs, as a function of
the sizes that are known only when the module runs (the symbols, e.g. `batch`). The one
definition of the language: the compiler builds expressions with it, the runtime checks and
evaluates them.

An expression is an int, a symbol (a str), or `(op, a, b)` with op in ceildiv, mul, add, min,
max. A schedule writes one for each launch (`ceildiv(batch, 64)` blocks) and builds its loops
from the same value, so the two cannot disagree (`ceildiv` and `mul` fold constants: a module
whose shapes are all static has only ints). The manifest carries it as JSON
(`["ceildiv", "batch", 64]`, checked by `_expr`) and the runtime evaluates it per call; the
text form (`ceildiv(batch, 64)`: `to_text`, `parse`) is what the compiler's IR attributes hold
and what `-emit` and `--info` print.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from typing import Any

from .fields import _choice, _describe, _fail, _identifier, _int

Expr = int | str | tuple  # a size expression: an int, a symbol, or (op, Expr, Expr)
OPS = {"ceildiv": lambda a, b: -(-a // b), "mul": lambda a, b: a * b, "add": lambda a, b: a + b,
       "min": min, "max": max}
EXPR_OPS = tuple(OPS)
EXPR_DEPTH = 8  # the deepest nesting of [op, a, b] lists


# --- building (the compiler's schedules) -------------------------------------------------------


def _make(op: str, a: Expr, b: Expr) -> Expr:
    if isinstance(a, int) and isinstance(b, int):
        return OPS[op](a, b)
    return (op, a, b)


def ceildiv(a: Expr, b: int) -> Expr:
    return a if b == 1 else _make("ceildiv", a, b)


def mul(a: Expr, b: Expr) -> Expr:
    return a if b == 1 else b if a == 1 else _make("mul", a, b)


def product(values: Iterable[Expr]) -> Expr:
    """The product of size expressions, folded as `mul` folds them (1 for none)."""
    return functools.reduce(mul, values, 1)


# --- reading -----------------------------------------------------------------------------------


def evaluate(expr: Expr, sizes: Mapping[str, int]) -> int:
    """The value of a (checked) size expression, the symbols taking their `sizes`."""
    if isinstance(expr, int):
        return expr
    if isinstance(expr, str):
        return sizes[expr]
    return OPS[expr[0]](evaluate(expr[1], sizes), evaluate(expr[2], sizes))


def to_text(expr: Expr) -> str:
    """A size expression for people: `ceildiv(batch, 64)`."""
    if isinstance(expr, tuple):
        return f"{expr[0]}({to_text(expr[1])}, {to_text(expr[2])})"
    return str(expr)


def symbols_of(expr: Expr) -> list[str]:
    """The symbols of a size expression, in order of first appearance."""
    if isinstance(expr, str):
        return [expr]
    if isinstance(expr, tuple):
        return list(dict.fromkeys(symbols_of(expr[1]) + symbols_of(expr[2])))
    return []


def to_json(expr: Expr) -> int | str | list:
    """The manifest's form: tuples become lists."""
    return [expr[0], to_json(expr[1]), to_json(expr[2])] if isinstance(expr, tuple) else expr


_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_]*)|([(),]))")


def parse(source: str) -> Expr:
    """The expression of its text form (the inverse of `text`); ValueError if malformed."""
    tokens = [next(t for t in match.groups() if t is not None) for match in _TOKEN.finditer(source)]
    if "".join(tokens) != re.sub(r"\s", "", source):
        raise ValueError(f"not a size expression: {source!r}")
    position = 0

    def take() -> str:
        nonlocal position
        if position == len(tokens):
            raise ValueError(f"not a size expression: {source!r}")
        position += 1
        return tokens[position - 1]

    def expression() -> Expr:
        token = take()
        if token.isdigit():
            return int(token)
        if token in OPS and position < len(tokens) and tokens[position] == "(":
            take()
            a = expression()
            if take() != ",":
                raise ValueError(f"not a size expression: {source!r}")
            b = expression()
            if take() != ")":
                raise ValueError(f"not a size expression: {source!r}")
            return (token, a, b)
        if token in "(),":
            raise ValueError(f"not a size expression: {source!r}")
        return token

    result = expression()
    if position != len(tokens):
        raise ValueError(f"not a size expression: {source!r}")
    return result


def _expr(value: Any, path: str, symbols: list[str], depth: int = 0) -> Expr:
    """A checked size expression (lists become tuples) whose symbols are among `symbols`."""
    if isinstance(value, str):
        if _identifier(value, path) not in symbols:
            _fail(path, f"symbol {value!r} is no dimension of the kernel's args ({', '.join(symbols) or 'none'})")
        return value
    if not isinstance(value, list):
        return _int(value, path)
    if depth == EXPR_DEPTH:
        _fail(path, f"size expressions nest at most {EXPR_DEPTH} deep")
    if len(value) != 3:
        _fail(path, f"expected an int, a symbol or [op, expr, expr], got {len(value)} items")
    op = _choice(value[0], f"{path}[0]", EXPR_OPS)
    left = _expr(value[1], f"{path}[1]", symbols, depth + 1)
    if op == "ceildiv" and (isinstance(value[2], (str, list)) or _int(value[2], f"{path}[2]") < 1):
        _fail(f"{path}[2]", f"ceildiv divides by a literal integer >= 1, got {_describe(value[2])}")
    return (op, left, _expr(value[2], f"{path}[2]", symbols, depth + 1))
