"""The compute ops, one registration each: adding an op means one `register(OpDef(...))`.

A registration says everything the compiler needs about an op:
- `operands`: its tensor operands (a trailing `?` marks an optional one), which also defines
  `hexir.<name>` in the dialect;
- `shape`: the shape rule, from each operand's (shape, dtype) to the result's shape, raising
  TraceError; the tracer and the verifier both use it, so both fail alike;
- `reference`: its meaning in numpy (what tests compare against);
- `schedules`: for each device, the builder of its kernel (`hexir/schedules/<device>.py`);
- `scalar`: for an element-wise op, its per-element function; such an op can also be fused
  into a preceding linear as an epilogue;
- `variants`: for a device, the schedule's other kernels for the op, the runtime choosing one
  per call from the bound sizes (the cuda linear with a symbolic batch: a kernel per tile).

    register(OpDef("neg", ("x",), shape=elementwise_rule("neg"), reference=np.negative,
                   schedules=ELEMENTWISE, scalar=lambda v: arith.NegFOp(v).result))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from mlir import ir
from mlir.dialects import arith

from hexir.dialects import hexir as hx
from hexir.errors import TraceError
from hexir.schedules import Builder, Variants, cpu, cuda, cuda_tiles


@dataclass(frozen=True)
class OpDef:
    name: str
    operands: tuple[str, ...]
    shape: Callable[..., hx.Shape]
    reference: Callable[..., np.ndarray]
    schedules: dict[str, Builder]
    scalar: Callable[[ir.Value], ir.Value] | None = None
    variants: dict[str, Variants] = field(default_factory=dict)  # device -> the schedule's other kernels


REGISTRY: dict[str, OpDef] = {}
ELEMENTWISE: dict[str, Builder] = {"cpu": cpu.elementwise, "cuda": cuda.elementwise}


def register(op: OpDef) -> OpDef:
    """Make `op` known to the dialect, the tracer, the verifier and lower-to-tir."""
    if op.name in REGISTRY or not op.name.isidentifier():
        raise TraceError(f"register: op name {op.name!r} is taken or not an identifier")
    if set(op.schedules) != set(hx.DEVICES):
        raise TraceError(f"register: op {op.name} needs a schedule for each of {', '.join(hx.DEVICES)}")
    REGISTRY[op.name] = op
    hx.define_op(op.name, op.operands)
    return op


def lookup(full_name: str) -> OpDef | None:
    """The registration of `hexir.<name>`, or None for any other op."""
    return REGISTRY.get(full_name.removeprefix("hexir.")) if full_name.startswith("hexir.") else None


def elementwise_rule(name: str) -> Callable[[tuple], hx.Shape]:
    return lambda x: hx.elementwise_shape(name, x)


def linear_shape(x: tuple, w: tuple, bias: tuple | None = None) -> hx.Shape:
    """Result shape of linear; each operand is (shape, dtype). Raises TraceError."""
    (x_shape, x_dtype), (w_shape, w_dtype) = x, w
    for name, (shape, dtype) in (("x", x), ("w", w)):
        hx.check_dtype("linear", name, dtype)
        if len(shape) != 2:
            raise TraceError(f"linear: argument '{name}' must have rank 2, got rank {len(shape)} "
                             f"({hx.describe(shape, dtype)})")
        hx.check_extents("linear", name, shape, dtype, static=name == "w")
    if w_dtype != x_dtype:
        raise TraceError(f"linear: mixed dtypes: x is {x_dtype} but w is {w_dtype}")
    if x_shape[1] != w_shape[0]:
        raise TraceError(
            f"linear: inner dimensions differ: x is {hx.describe(x_shape, x_dtype)} and w is "
            f"{hx.describe(w_shape, w_dtype)}; expected w to have {x_shape[1]} rows, got {w_shape[0]}")
    if bias is not None:
        b_shape, b_dtype = bias
        if b_dtype != x_dtype:
            raise TraceError(f"linear: mixed dtypes: x is {x_dtype} but bias is {b_dtype}")
        hx.check_extents("linear", "bias", b_shape, b_dtype, static=True)
        if tuple(b_shape) != (w_shape[1],):
            raise TraceError(f"linear: argument 'bias' must be {hx.describe((w_shape[1],), x_dtype)}, "
                             f"got {hx.describe(b_shape, b_dtype)}")
    return (x_shape[0], w_shape[1])


def _zero_like(value: ir.Value) -> ir.Value:
    """0 of a value's type: a float, or a vector of them (the cpu linear's epilogue works on vectors)."""
    if isinstance(value.type, ir.VectorType):
        element = ir.VectorType(value.type).element_type
        return arith.ConstantOp(value.type, ir.DenseElementsAttr.get_splat(
            value.type, ir.FloatAttr.get(element, 0.0))).result
    return arith.ConstantOp(value.type, ir.FloatAttr.get(value.type, 0.0)).result


register(OpDef("linear", ("x", "w", "bias?"), linear_shape,
               reference=lambda x, w, bias=None: x @ w + (0 if bias is None else bias),
               schedules={"cpu": cpu.linear, "cuda": cuda.linear}, variants={"cuda": cuda_tiles.linear_variants}))
register(OpDef("relu", ("x",), elementwise_rule("relu"), reference=lambda x: np.maximum(x, 0),
               schedules=ELEMENTWISE, scalar=lambda v: arith.MaximumFOp(v, _zero_like(v)).result))
