"""Schedules: how each op is computed on each device, one module per device with the same shape.

`cpu.py` and `cuda.py` each define a builder per kind of op (`linear`, `elementwise`); an op's
registration (`hexir/ops.py`) names its builder for each device. lower-to-tir calls the builder
inside a fresh kernel function with the kernel's buffers, its size arguments and a `Request`
(what to build: op, epilogues, dtype, target); the builder writes the kernel's body — loops that
carry their schedules — and returns the kernel's work record (cpu) or launch record (cuda),
whose sizes are the same expressions its loops were built from.

Tile sizes live at the top of each device's module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hexir_runtime.format import exprs
from mlir import ir
from mlir.dialects import arith, vector

from hexir.dialects import hextir as ht
from hexir.errors import CompileError
from hexir.schedules.emit import emit
from hexir.target import Target


@dataclass(frozen=True)
class Request:
    """What a schedule builds: a kernel of family `op` (linear, pointwise, reduce, pack_panels)
    for `dtype` on `target`. `expr` is what it computes per element: a pointwise kernel's tree,
    a reduce kernel's program, a linear's epilogue (a tree over its sums, bias added: ["arg", 0];
    None: store the sums)."""

    op: str
    dtype: str
    target: Target
    symbols: tuple[str, ...] = ()
    expr: Any = None
    bias: bool = False  # a linear's args[2] is its bias
    extras: int = 0     # a linear's epilogue reads this many more tensors (its args after the bias)
    args: tuple = ()    # the kernel's buffers, once its builder has them (`with_args`): the epilogue reads them
    variant: str | None = None  # one of the schedule's variants (see `Variants`), or its own choice
    panels: bool = False  # a cpu linear's w comes packed in panels (passes/pack_weights.py)
    shapes: tuple[tuple[exprs.Expr, ...], ...] = ()  # each buffer argument's extents (ints, size expressions)
    precision: str = "highest"  # a contract's float32 products: "highest" (float32) or "tf32" (cuda: tensor cores)
    w_kmajor: bool = False  # a cuda linear's w comes transposed, [N, K] (pack-weights: TF32 on wgmma)

    def with_args(self, args: Sequence[ir.Value]) -> Request:
        return replace(self, args=tuple(args))

    def epilogue(self, value: ir.Value, at: Sequence[ir.Value] = ()) -> ir.Value:
        """A linear's epilogue applied to `value`, the sum (or a vector of the sums from) out[at]:
        its other inputs, the kernel's args after the bias, read there (broadcast as numpy)."""
        if self.expr is None:
            return value
        inputs = list(self.args)[2 + self.bias:2 + self.bias + self.extras]
        element = ir.VectorType(value.type).element_type if isinstance(value.type, ir.VectorType) else value.type
        return emit(self.expr, [value, *(_read_like(value, e, at) for e in inputs)], type_=element)  # (16-bit: widened)


Builder = Callable[[list[ir.Value], dict[str, ir.Value], Request], "ht.Work | ht.Launch"]
#: A schedule's other kernels for one op, chosen per call: given the kernel's buffer types and the
#: request, [(variant, {symbol: bound})]: the runtime runs the first variant whose sizes are all
#: below their bounds, else the kernel itself.
Variants = Callable[[list[ir.Type], Request], list[tuple[str, dict[str, int]]]]


def extent(buffer: ir.Value | int, axis: int, request: Request) -> exprs.Expr:
    """The extent of `buffer` (one of the kernel's buffer arguments, or its position) along
    `axis`: an int, or for a `?` a size expression over the kernel's symbols (`seq`,
    `mul(batch, seq)`: the rows of a linear on x[batch, seq, K])."""
    position = buffer if isinstance(buffer, int) else _position(buffer)
    dim = request.shapes[position][axis]
    if not isinstance(buffer, int) and ir.MemRefType(buffer.type).is_dynamic_dim(axis) == isinstance(dim, int):
        raise CompileError(f"a {request.op} kernel's argument {position} has the type {buffer.type}, "
                           f"but its extents are {request.shapes[position]}")
    return dim


def _position(buffer: ir.Value) -> int:
    try:
        return ir.BlockArgument(buffer).arg_number
    except ValueError:
        raise CompileError(f"extent: {buffer} is not an argument of the kernel (take extents before "
                           "re-viewing a buffer)") from None


def broadcast_indices(buffer: ir.Value, indices: Sequence[ir.Value]) -> list[ir.Value]:
    """Where `buffer` is read for the output element at `indices` (numpy's broadcasting:
    aligned right; an axis of static extent 1 is read at 0)."""
    shape = ir.MemRefType(buffer.type).shape
    tail = list(indices)[len(indices) - len(shape):]
    zero = None
    result = []
    for extent_here, index in zip(shape, tail, strict=True):
        if extent_here == 1:
            zero = zero or arith.ConstantOp(ir.IndexType.get(), 0).result
            index = zero
        result.append(index)
    return result


def _read_like(value: ir.Value, buffer: ir.Value, at: Sequence[ir.Value]) -> ir.Value:
    """`buffer` read where a linear's `value` sits: an element, or, for a vector of sums along
    out's row, a vector (the same one broadcast where `buffer`'s last axis is 1)."""
    indices = broadcast_indices(buffer, at)
    if not isinstance(value.type, ir.VectorType):
        loaded = ht.load(buffer, indices)  # a 16-bit input of an f32 epilogue: widened
        return loaded if loaded.type == value.type else arith.ExtFOp(value.type, loaded).result
    element = ir.MemRefType(buffer.type).element_type  # (a 16-bit one: emit widens it)
    like = ir.VectorType.get(ir.VectorType(value.type).shape, element)
    if ir.MemRefType(buffer.type).shape[-1] == 1:
        return vector.BroadcastOp(like, ht.load(buffer, indices)).result
    return vector.LoadOp(like, buffer, indices).result
