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

from collections.abc import Callable
from dataclasses import dataclass, field

from hexir_runtime.format import exprs
from mlir import ir

from hexir.dialects import hextir as ht
from hexir.errors import CompileError
from hexir.target import Target


@dataclass(frozen=True)
class Request:
    """What a schedule builds: `op` with its `epilogues` (e.g. ("bias", "relu")) for `dtype` on
    `target`. `scalars` maps each element-wise op involved (the op itself, or one fused as an
    epilogue) to its per-element function, built at the insertion point."""

    op: str
    epilogues: tuple[str, ...]
    dtype: str
    target: Target
    symbols: tuple[str, ...] = ()
    scalars: dict[str, Callable[[ir.Value], ir.Value]] = field(default_factory=dict)
    variant: str | None = None  # one of the schedule's variants (see `Variants`), or its own choice
    panels: bool = False  # a cpu linear's w comes packed in panels (passes/pack_weights.py)

    def fused(self) -> list[Callable[[ir.Value], ir.Value]]:
        """The per-element functions of the epilogues after the bias, in order."""
        return [self.scalars[e] for e in self.epilogues if e != "bias"]


Builder = Callable[[list[ir.Value], dict[str, ir.Value], Request], "ht.Work | ht.Launch"]
#: A schedule's other kernels for one op, chosen per call: given the kernel's buffer types and the
#: request, [(variant, {symbol: bound})]: the runtime runs the first variant whose sizes are all
#: below their bounds, else the kernel itself.
Variants = Callable[[list[ir.Type], Request], list[tuple[str, dict[str, int]]]]


def extent(buffer: ir.Value | ir.Type, axis: int, request: Request) -> exprs.Expr:
    """The extent of `buffer` (a value or its type) along `axis`: an int, or the kernel's size
    symbol for a `?` (a generated kernel has at most one: its rows)."""
    shaped = ir.MemRefType(buffer.type if isinstance(buffer, ir.Value) else buffer)
    if not shaped.is_dynamic_dim(axis):
        return shaped.shape[axis]
    if len(request.symbols) != 1:
        raise CompileError(f"a generated {request.op} kernel takes one symbolic extent, got {request.symbols}")
    return request.symbols[0]
