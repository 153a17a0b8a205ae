"""Scalar expressions: what an element-wise or reduce kernel computes per element. The one
definition of the language: the compiler's ops are written in it (hexir/ops/) and emit their IR
from it; the manifest carries it (a kernel's `expr`); the runtime checks it as untrusted input
and its reference device evaluates it with numpy.

A tree is JSON: `["arg", i]` (the kernel's i-th input, broadcast to the output), `["const", x]`
(a finite number), `["red", i]` (in a reduce kernel: the i-th reduction of the current row),
`["len"]` (in a reduce kernel: the reduced axis' extent), or `[op, tree...]` with op one of
`UNARY` or `BINARY` (`pow`'s exponent is a const). `gelu` is
`["mul", ["mul", ["const", 0.5], ["arg", 0]], ["add", ["const", 1], ["erf", ...]]]`; `text`
prints it as `0.5 * a0 * (1 + erf(a0 * 0.7071067811865476))`.

A reduce program (`Program`) is reductions over one axis, each `(kind, tree)` with kind in
`REDUCTIONS` (a tree may use the earlier reductions: layer_norm's variance uses the mean),
then the tree of the output: per row (it uses no arg: `sum`, `argmax`) or per element
(softmax: `exp(a0 - r0) / r1`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .fields import _fail, _int, _list, _object

Tree = Any  # a JSON list as above
UNARY = ("neg", "abs", "exp", "log", "tanh", "sqrt", "rsqrt", "erf")
BINARY = ("add", "sub", "mul", "div", "max", "min", "pow")
REDUCTIONS = ("sum", "max", "argmax")
LEAVES = ("arg", "const", "red", "len")
MAX_DEPTH = 64
MAX_NODES = 4096


# --- checking (a manifest's trees are untrusted) ---------------------------------------------


def check(tree: Any, path: str, args: int, reds: int = 0, reduce: bool = False) -> Tree:
    """`tree` if it is a well-formed expression over `args` inputs and `reds` reductions (`len`
    only where `reduce`), else HxbFormatError naming `path`."""
    count = [0]

    def walk(node: Any, where: str, depth: int) -> None:
        count[0] += 1
        if depth > MAX_DEPTH or count[0] > MAX_NODES:
            _fail(path, f"the expression is deeper than {MAX_DEPTH} or larger than {MAX_NODES} nodes")
        if not isinstance(node, list) or not node or not isinstance(node[0], str):
            _fail(where, f"expected [op, ...], got {json.dumps(node)[:60]}")
        op, rest = node[0], node[1:]
        if op in ("arg", "red"):
            bound = args if op == "arg" else reds
            if len(rest) != 1:
                _fail(where, f"expected [{op!r}, index]")
            if isinstance(rest[0], bool) or not isinstance(rest[0], int) or not 0 <= rest[0] < bound:
                _fail(f"{where}[1]", f"expected an {op} index below {bound}, got {json.dumps(rest[0])[:20]}")
        elif op == "const":  # (an int too large for a float is no finite number: float() would overflow)
            if len(rest) != 1 or isinstance(rest[0], bool) or not isinstance(rest[0], (int, float)) \
                    or not (abs(rest[0]) < 2**1023 if isinstance(rest[0], int) else math.isfinite(rest[0])):
                _fail(where, "expected ['const', a finite number]")
        elif op == "len":
            if rest or not reduce:
                _fail(where, "['len'] (the reduced extent) exists only in a reduce kernel, alone")
        elif op in UNARY or op in BINARY:
            if len(rest) != (1 if op in UNARY else 2):
                _fail(where, f"{op} takes {1 if op in UNARY else 2} operand(s), got {len(rest)}")
            if op == "pow" and (not isinstance(rest[1], list) or rest[1][:1] != ["const"]):
                _fail(f"{where}[2]", "pow's exponent must be a const")
            for j, child in enumerate(rest):
                walk(child, f"{where}[{j + 1}]", depth + 1)
        else:
            _fail(where, f"unknown op {op!r}; expected one of {', '.join(LEAVES + UNARY + BINARY)}")

    walk(tree, path, 1)
    return tree


@dataclass(frozen=True)
class Program:
    """A reduce kernel's meaning: `reductions` over `axis` (of the first input), then `out`."""

    axis: int
    reductions: tuple[tuple[str, Tree], ...]
    out: Tree

    @property
    def rows(self) -> bool:
        """Whether the output has one element per row (else one per element of the input)."""
        return not uses(self.out, "arg")

    def to_json(self) -> dict[str, Any]:
        return {"axis": self.axis, "reductions": [[kind, tree] for kind, tree in self.reductions], "out": self.out}


def check_program(spec: Any, path: str, args: int, rank: int) -> Program:
    """A reduce program over `args` inputs whose first has rank `rank`, checked."""
    _object(spec, path, ("axis", "reductions", "out"))
    axis = _int(spec["axis"], f"{path}.axis")
    if axis >= rank:
        _fail(f"{path}.axis", f"expected an axis below the input's rank {rank}, got {axis}")
    reductions = []
    for j, item in enumerate(_list(spec["reductions"], f"{path}.reductions")):
        where = f"{path}.reductions[{j}]"
        if not isinstance(item, list) or len(item) != 2 or item[0] not in REDUCTIONS:
            _fail(where, f"expected [kind, tree] with kind one of {', '.join(REDUCTIONS)}")
        reductions.append((item[0], check(item[1], f"{where}[1]", args, j, reduce=True)))
    if not reductions:
        _fail(f"{path}.reductions", "expected at least one reduction")
    out = check(spec["out"], f"{path}.out", args, len(reductions), reduce=True)
    argmaxes = [j for j, (kind, _) in enumerate(reductions) if kind == "argmax"]
    if argmaxes and out != ["red", argmaxes[-1]]:
        _fail(f"{path}.out", "an argmax program's output is its argmax, ['red', i]")
    if any(uses(tree, "red", j) for j in argmaxes for _, tree in reductions):
        _fail(f"{path}.reductions", "an argmax (an index) cannot feed another reduction")
    return Program(axis, tuple(reductions), out)


# --- reading ---------------------------------------------------------------------------------


def uses(tree: Tree, op: str, index: int | None = None) -> bool:
    """Whether `tree` has a leaf `[op, index]` (any index when None)."""
    if tree[0] == op:
        return index is None or tree[1] == index
    return tree[0] != "const" and any(uses(child, op, index) for child in tree[1:] if isinstance(child, list))


def substitute(tree: Tree, args: Sequence[Tree]) -> Tree:
    """`tree` with each `["arg", i]` replaced by `args[i]` (composing element-wise functions)."""
    if tree[0] == "arg":
        return args[tree[1]]
    if tree[0] in ("const", "red", "len"):
        return tree
    return [tree[0], *(substitute(child, args) for child in tree[1:])]


_INFIX = {"add": ("+", 1), "sub": ("-", 1), "mul": ("*", 2), "div": ("/", 2), "pow": ("**", 4)}


def text(tree: Tree) -> str:
    """A tree for people: `max(a0 + a1, 0)`, `exp(a0 - r0) / r1`."""
    def show(node: Tree, outer: int) -> str:
        op = node[0]
        if op in ("arg", "red"):
            return f"{op[0]}{node[1]}"
        if op == "const":
            value = node[1]
            return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else repr(float(value))
        if op == "len":
            return "len"
        if op == "neg":
            return f"-{show(node[1], 3)}"
        if op in _INFIX:
            symbol, level = _INFIX[op]
            shown = f"{show(node[1], level)} {symbol} {show(node[2], level + 1)}"
            return f"({shown})" if level < outer else shown
        return f"{op}({', '.join(show(child, 0) for child in node[1:])})"
    return show(tree, 0)


def program_text(program: Program) -> str:
    steps = [f"r{j} = {kind}({text(tree)})" for j, (kind, tree) in enumerate(program.reductions)]
    return f"over axis {program.axis}: {'; '.join(steps)}; out = {text(program.out)}"


# --- numpy meaning (the reference device; the compiler's tests) -------------------------------


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float64])(x).astype(x.dtype)


_NUMPY: dict[str, Callable[..., np.ndarray]] = {
    "neg": np.negative, "abs": np.abs, "exp": np.exp, "log": np.log, "tanh": np.tanh, "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x), "erf": _erf, "add": np.add, "sub": np.subtract,
    "mul": np.multiply, "div": np.divide, "max": np.maximum, "min": np.minimum, "pow": np.power}


def evaluate(tree: Tree, args: Sequence[np.ndarray], dtype: str, reds: Sequence[np.ndarray] = (),
             length: int = 0) -> np.ndarray:
    """numpy's value of `tree` on `args` (broadcast as numpy does), computed in `dtype`."""
    kind = np.dtype(dtype).type

    def value(node: Tree) -> Any:
        op = node[0]
        if op == "arg":
            return np.asarray(args[node[1]], dtype)
        if op == "red":
            return reds[node[1]]
        if op == "const":
            with np.errstate(all="ignore"):  # (a float64 const beyond float32's range is inf there)
                return kind(node[1])
        if op == "len":
            return kind(length)
        operands = [value(child) for child in node[1:]]
        with np.errstate(all="ignore"):
            return np.asarray(_NUMPY[op](*operands), dtype)

    return value(tree)


def run_program(program: Program, args: Sequence[np.ndarray], dtype: str) -> np.ndarray:
    """numpy's value of a reduce program: reductions keep their axis (size 1); a per-row output
    keeps it too (the caller reshapes to the kernel's output)."""
    axis, reds = program.axis, []
    length = np.shape(args[0])[axis]
    for kind, tree in program.reductions:
        values = np.broadcast_to(evaluate(tree, args, dtype, reds, length), np.shape(args[0]))
        if kind == "argmax":
            reds.append(np.argmax(values, axis=axis, keepdims=True).astype(np.int64))
        else:
            with np.errstate(all="ignore"):
                reds.append((np.sum if kind == "sum" else np.max)(values, axis=axis, keepdims=True))
    if program.out[0] == "red":
        return reds[program.out[1]]
    return evaluate(program.out, args, dtype, reds, length)
