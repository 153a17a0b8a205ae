"""Size expressions: how many iterations, blocks or elements a kernel needs, as a function of
the sizes that are known only when the module runs (the symbols, e.g. `batch`).

An expression is an int, a symbol (a str), or `(op, a, b)` with op in ceildiv, mul, add, min,
max. A schedule writes one for each launch (`ceildiv(batch, 64)` blocks) and builds its loops
from the same value, so the two cannot disagree; the manifest carries it as JSON
(`["ceildiv", "batch", 64]`) and the runtime evaluates it per call. Constants fold: a module
whose shapes are all static has only ints.

The text form (`ceildiv(batch, 64)`) is what the IR attributes hold and `-emit` prints.
"""

from __future__ import annotations

import re

Expr = int | str | tuple
OPS = {"ceildiv": lambda a, b: -(-a // b), "mul": lambda a, b: a * b, "add": lambda a, b: a + b,
       "min": min, "max": max}


def _make(op: str, a: Expr, b: Expr) -> Expr:
    if isinstance(a, int) and isinstance(b, int):
        return OPS[op](a, b)
    return (op, a, b)


def ceildiv(a: Expr, b: int) -> Expr:
    return a if b == 1 else _make("ceildiv", a, b)


def mul(a: Expr, b: Expr) -> Expr:
    return a if b == 1 else b if a == 1 else _make("mul", a, b)


def text(expr: Expr) -> str:
    """`ceildiv(mul(batch, 16), 256)`."""
    if isinstance(expr, tuple):
        return f"{expr[0]}({text(expr[1])}, {text(expr[2])})"
    return str(expr)


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


def to_json(expr: Expr) -> int | str | list:
    """The manifest's form: tuples become lists."""
    return [expr[0], to_json(expr[1]), to_json(expr[2])] if isinstance(expr, tuple) else expr


def evaluate(expr: Expr, sizes: dict[str, int]) -> int:
    if isinstance(expr, tuple):
        return OPS[expr[0]](evaluate(expr[1], sizes), evaluate(expr[2], sizes))
    return sizes[expr] if isinstance(expr, str) else expr
