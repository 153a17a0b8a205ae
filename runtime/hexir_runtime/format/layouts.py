"""The layout family (#24): kernels that move elements and compute nothing. A kernel's `expr`
is its record, which says how each output element is found in the inputs:

| record                                             | args               | out[i] is                       |
|----------------------------------------------------|--------------------|---------------------------------|
| `{"kind": "transpose", "perm": [p0, ...]}`         | x, out             | x at j, j[perm[k]] = i[k]       |
| `{"kind": "reshape"}`                              | x, out             | x at i's row-major position     |
| `{"kind": "slice", "start": [...], "step": [...]}` | x, out             | x[start + step * i]             |
| `{"kind": "concat", "axis": a}`                    | x0, ..., xn-1, out | the input whose part holds i[a] |
| `{"kind": "take"}`                                 | table, ids, out    | table[ids[i[:r]], i[r:]]        |

A slice's counts are its output's shape; take is numpy's `take(table, ids, axis=0)` (r: ids' rank).

Every arg has one dtype (any: float32, float64, bfloat16, float16, int32, int64), except take's ids (int32 or int64).
A symbol may only stay where it is: a reshape keeps its inputs' symbols in order (the static
dims between them regroup, each group's product unchanged), a slice takes a symbolic axis
whole, a concat's axis is static. `check` holds a kernel to this (the compiler's shape rules
are the same function); `numpy_function` is its meaning for the reference device; `id_sources`
finds, in an entry's program, where each take's ids come from, so that the runtime can check
them before a call (docs/hxb-format.md, "Layout kernels").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .fields import _choice, _fail, _int, _json, _list, _object
from .types import Dim, Entry, Kernel, TensorType

KINDS = {"transpose": ("perm",), "reshape": (), "slice": ("start", "step"), "concat": ("axis",), "take": ()}
IDS = ("int32", "int64")


def _shape(shape: tuple[Dim, ...]) -> str:
    return f"[{', '.join(map(str, shape))}]"


def check(record: Any, args: tuple[TensorType, ...], path: str) -> dict[str, Any]:
    """Check a layout kernel's record against its args (destination last); return the record."""
    _object(record, path, ("kind",), sum(KINDS.values(), ()))
    kind = _choice(record["kind"], f"{path}.kind", tuple(KINDS))
    _object(record, path, ("kind", *KINDS[kind]))
    inputs, out = args[:-1], args[-1]
    count = {"take": 2, "concat": len(inputs) or 1}.get(kind, 1)
    if len(inputs) != count:
        _fail(path, f"a {kind} takes {count} input(s), got {len(inputs)}")
    data = [a for j, a in enumerate(args) if not (kind == "take" and j == 1)]
    for arg in data:
        if arg.dtype != data[0].dtype:
            _fail(path, f"a {kind}'s args have one dtype; got {', '.join(map(str, args))}")
    if kind == "take" and inputs[1].dtype not in IDS:
        _fail(path, f"take's ids are int32 or int64, got {inputs[1]}")
    shapes = [a.shape for a in inputs]
    expected = globals()[f"_{kind}"](record, shapes, out.shape, path)
    if tuple(expected) != out.shape:
        _fail(path, f"a {kind} of {', '.join(map(_shape, shapes))} makes {_shape(expected)}, "
                    f"but its output is {_shape(out.shape)}")
    return record


def _transpose(record: dict, shapes: list, out: tuple, path: str) -> tuple:
    (x,) = shapes
    perm = [_int(p, f"{path}.perm[{k}]", 0) for k, p in enumerate(_list(record["perm"], f"{path}.perm"))]
    if sorted(perm) != list(range(len(x))):
        _fail(f"{path}.perm", f"expected a permutation of the {len(x)} axes of {_shape(x)}, got {_json(perm)}")
    return tuple(x[p] for p in perm)


def groups(shape: tuple[Dim, ...]) -> tuple[list[str], list[int]]:
    """A shape's symbols in order, and the products of the static dims before, between and after them."""
    symbols, products = [], [1]
    for dim in shape:
        if isinstance(dim, str):
            symbols.append(dim)
            products.append(1)
        else:
            products[-1] *= dim
    return symbols, products


def _reshape(record: dict, shapes: list, out: tuple, path: str) -> tuple:
    (x,) = shapes
    if groups(x) != groups(out):
        how = "its symbols differ" if groups(x)[0] != groups(out)[0] else "the sizes differ"
        _fail(path, f"cannot reshape {_shape(x)} to {_shape(out)}: {how} (a symbolic dimension may only map "
                    "to itself, the same names in the same order; the static dimensions between them regroup "
                    "with their product unchanged)")
    return out


def _slice(record: dict, shapes: list, out: tuple, path: str) -> tuple:
    (x,) = shapes
    start, step = (_list(record[key], f"{path}.{key}") for key in ("start", "step"))
    if len(start) != len(x) or len(step) != len(x) or len(out) != len(x):
        _fail(path, f"a slice of {_shape(x)} has a start, a step and an output dimension per axis, got "
                    f"{len(start)}, {len(step)} and {_shape(out)}")
    for axis, (dim, count) in enumerate(zip(x, out, strict=True)):
        first, stride = start[axis], step[axis]
        if type(first) is not int or type(stride) is not int or not stride:
            _fail(f"{path}.start[{axis}]", f"expected an int start and a non-zero int step, got {first!r}, {stride!r}")
        if isinstance(dim, str) or isinstance(count, str):
            if count != dim or first != 0 or stride != 1:
                _fail(f"{path}.start[{axis}]", f"a symbolic axis ({dim}) is taken whole: start 0, step 1, "
                                               f"output {dim}; got {first}, {stride}, {count}")
        elif count and not (0 <= first < dim and 0 <= first + stride * (count - 1) < dim):
            _fail(f"{path}.start[{axis}]", f"{count} elements from {first} in steps of {stride} leave axis "
                                           f"{axis} of {_shape(x)}")
    return out


def _concat(record: dict, shapes: list, out: tuple, path: str) -> tuple:
    rank = len(shapes[0])
    axis = _int(record["axis"], f"{path}.axis", 0)
    if axis >= rank or any(len(s) != rank for s in shapes):
        _fail(path, f"a concat along axis {axis} takes inputs of one rank > {axis}, got "
                    f"{', '.join(map(_shape, shapes))}")
    if any(isinstance(s[axis], str) for s in shapes) or any(
            s[:axis] + s[axis + 1:] != shapes[0][:axis] + shapes[0][axis + 1:] for s in shapes):
        _fail(path, f"cannot concatenate {', '.join(map(_shape, shapes))} along axis {axis}: the other "
                    "dimensions must be equal and this one static")
    return shapes[0][:axis] + (sum(s[axis] for s in shapes),) + shapes[0][axis + 1:]


def _take(record: dict, shapes: list, out: tuple, path: str) -> tuple:
    table, ids = shapes
    if not table or not isinstance(table[0], int) or table[0] < 1:
        _fail(path, f"take's table is indexed along a static, non-empty first axis, got {_shape(table)}")
    return ids + table[1:]


def rows(record: dict, args: tuple[TensorType, ...]) -> int | None:
    """A take's bound on its ids (its table's rows); None for another kind."""
    return args[0].shape[0] if record["kind"] == "take" else None


def text(record: dict[str, Any]) -> str:
    """A checked record as `--info` prints it: `transpose perm=[1, 0]`."""
    return " ".join([record["kind"], *(f"{key}={_json(record[key])}" for key in KINDS[record["kind"]])])


# ---- the reference device's meaning -------------------------------------------------------------

def numpy_function(record: dict[str, Any]) -> Callable[..., None]:
    """What computes a layout kernel in numpy (ids already checked: numpy's own check raises too)."""
    kind = record["kind"]

    def run(*args: np.ndarray) -> None:
        out = args[-1]
        if kind == "transpose":
            out[...] = args[0].transpose(record["perm"])
        elif kind == "reshape":
            out[...] = args[0].reshape(out.shape)
        elif kind == "slice":
            out[...] = args[0][tuple(_numpy_slice(s, t, c) for s, t, c in zip(record["start"], record["step"],
                                                                               out.shape, strict=True))]
        elif kind == "concat":
            np.concatenate(args[:-1], record["axis"], out=out)
        else:
            out[...] = np.take(args[0], args[1], axis=0)
    return run


def _numpy_slice(start: int, step: int, count: int) -> slice:
    stop = start + step * count
    return slice(start, stop if stop >= 0 else None, step)


# ---- where a take's ids come from ---------------------------------------------------------------

@dataclass
class IdSources:
    """What bounds each take's ids in an entry: inputs and constants checked against the fewest
    rows of a table they index (input index -> (rows, the take kernel's name)), and argmaxes by
    the length of their axis (an int, or a symbol bound per call)."""

    inputs: dict[int, tuple[int, str]] = field(default_factory=dict)
    constants: dict[int, tuple[int, str]] = field(default_factory=dict)
    argmaxes: list[tuple[Dim, int, str]] = field(default_factory=list)


def id_sources(entry: Entry, kernels: tuple[Kernel, ...], path: str) -> IdSources:
    """Follow each take's ids back through transfers and other layout kernels to the inputs,
    constants and argmaxes they come from; HxbFormatError for ids the runtime cannot bound."""
    writers: dict[int, Any] = {}
    for command in entry.program:
        if command.op in ("input", "constant", "transfer"):
            writers[command.dst] = command
        elif command.op == "call":
            writers[command.args[-1]] = command
    sources = IdSources()

    def follow(buffer: int, bound: int, take: str, seen: set[int]) -> None:
        if buffer in seen:
            return
        seen.add(buffer)
        command = writers[buffer]
        if command.op == "input":
            held = sources.inputs.get(command.index, (bound, take))
            sources.inputs[command.index] = min(held, (bound, take))
        elif command.op == "constant":
            held = sources.constants.get(command.constant, (bound, take))
            sources.constants[command.constant] = min(held, (bound, take))
        elif command.op == "transfer":
            follow(command.src, bound, take, seen)
        else:
            kernel = kernels[command.kernel]
            if kernel.op == "layout":
                for arg in command.args[:1] if kernel.expr["kind"] == "take" else command.args[:-1]:
                    follow(arg, bound, take, seen)
            elif kernel.op == "reduce" and kernel.args[-1].dtype == "int64":  # an argmax
                sources.argmaxes.append((kernel.args[0].shape[kernel.expr.axis], bound, take))
            else:
                _fail(path, f"the ids of {take} come from kernel {kernel.name!r}, a {kernel.op} kernel: the "
                            "runtime bounds ids only from inputs, constants, argmaxes and layout kernels")

    for command in entry.program:
        if command.op == "call" and kernels[command.kernel].op == "layout":
            kernel = kernels[command.kernel]
            if kernel.expr["kind"] == "take":
                follow(command.args[1], rows(kernel.expr, kernel.args), kernel.name, set())
    return sources


def out_of_range(ids: np.ndarray, bound: int) -> tuple[int, tuple[int, ...]] | None:
    """The first id of `ids` outside [0, bound) and where it is, or None."""
    if not ids.size or (ids.min() >= 0 and ids.max() < bound):
        return None
    where = np.unravel_index(int(np.argmax((ids < 0) | (ids >= bound))), ids.shape)
    return int(ids[where]), tuple(map(int, where))

