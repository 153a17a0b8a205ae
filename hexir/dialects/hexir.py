"""The `hexir` dialect: the graph level — what to compute, on tensors with value semantics.

Ops (generic form, as IRDL prints them):

    %w = "hexir.constant"() {name = "W1", value = dense<...> : tensor<8x16xf32>, device = "auto"}
    %y = "hexir.linear"(%x, %w[, %b]) {device = "cuda"}   // x[M,K] @ w[K,N] (+ b[N])
    %r = "hexir.relu"(%y) {device = "auto"}               // max(y, 0)
    "hexir.print"(%r)                                      // host I/O, always on the cpu
    %t = "hexir.transfer"(%y) {source = "cuda", target = "cpu"}  // inserted by partition
    %z = "hexir.call"(%x, %w) {callee = @linear_0, device = "cpu"} // after lower-to-tir (1-4 args)
    %c = "hexir.custom_call"(%x) {kernel = "relu6", objects = {cuda = "/abs/relu6.cu"},
                                  grid = array<i64: 4, 1, 1>, block = array<i64: 256, 1, 1>, device = "auto"}

`device` is "auto" until the partition pass decides "cpu" or "cuda". The shape rules live
here (`linear_shape`, ...) and are shared by the tracer and the verifier, so a `.mlir` file
and a traced function are held to the same rules with the same messages.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mlir import ir

from hexir.dialects.irdl_text import call_operands, one_of
from hexir.errors import TraceError

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "float64")
#: Ops a `-placement=` or an `on()` context may move between devices.
PLACEABLE_OPS = ("hexir.linear", "hexir.relu", "hexir.custom_call")

#: IRDL gives every operand of a variadic group one type, so calls take up to four operands
#: of their own types, as one required and three optional groups.
MAX_CALL_ARGS = 4
_DEVICE = one_of("device", ("auto", *DEVICES))

IRDL = f"""
irdl.dialect @hexir {{
  irdl.operation @constant {{
    %value = irdl.base "#builtin.dense_int_or_fp_elements"
    %name = irdl.base "#builtin.string"
{_DEVICE}
    irdl.attributes {{"value" = %value, "name" = %name, "device" = %device}}
    %tensor = irdl.base "!builtin.tensor"
    irdl.results(result: %tensor)
  }}
  irdl.operation @linear {{
    %x = irdl.base "!builtin.tensor"
    %w = irdl.base "!builtin.tensor"
    %bias = irdl.base "!builtin.tensor"
    %result = irdl.base "!builtin.tensor"
    irdl.operands(x: %x, w: %w, bias: optional %bias)
    irdl.results(result: %result)
{_DEVICE}
    irdl.attributes {{"device" = %device}}
  }}
  irdl.operation @relu {{
    %tensor = irdl.base "!builtin.tensor"
    irdl.operands(x: %tensor)
    irdl.results(result: %tensor)
{_DEVICE}
    irdl.attributes {{"device" = %device}}
  }}
  irdl.operation @print {{
    %tensor = irdl.base "!builtin.tensor"
    irdl.operands(x: %tensor)
  }}
  irdl.operation @transfer {{
    %tensor = irdl.base "!builtin.tensor"
    irdl.operands(x: %tensor)
    irdl.results(result: %tensor)
{one_of("source", DEVICES)}
{one_of("target", DEVICES)}
    irdl.attributes {{"source" = %source, "target" = %target}}
  }}
  irdl.operation @call {{
{call_operands(MAX_CALL_ARGS)}
    %callee = irdl.base "#builtin.symbol_ref"
{one_of("device", DEVICES)}
    irdl.attributes {{"callee" = %callee, "device" = %device}}
  }}
  irdl.operation @custom_call {{
{call_operands(MAX_CALL_ARGS)}
    %kernel = irdl.base "#builtin.string"
    %objects = irdl.base "#builtin.dictionary"
    %grid = irdl.base "#builtin.dense_array"
    %block = irdl.base "#builtin.dense_array"
{_DEVICE}
    irdl.attributes {{"kernel" = %kernel, "objects" = %objects, "grid" = %grid, "block" = %block,
                     "device" = %device}}
  }}
}}
"""


# ---- types ---------------------------------------------------------------------------

def element_type(dtype: str) -> ir.Type:
    """The MLIR element type of a numpy dtype name (float32 or float64)."""
    return ir.F32Type.get() if dtype == "float32" else ir.F64Type.get()


def tensor_type(shape: Sequence[int], dtype: str) -> ir.RankedTensorType:
    return ir.RankedTensorType.get(list(shape), element_type(dtype))


def dtype_of(type_: ir.Type) -> str:
    """The numpy dtype name of a tensor/memref type or an element type."""
    try:
        element = ir.ShapedType(type_).element_type
    except ValueError:
        element = type_
    # isinstance, not `== ir.F32Type.get()`, which needs an active context
    if isinstance(element, ir.F32Type):
        return "float32"
    if isinstance(element, ir.F64Type):
        return "float64"
    raise TraceError(f"element type {element} is not supported; expected f32 or f64")


def shape_of(type_: ir.Type) -> tuple[int, ...]:
    return tuple(ir.ShapedType(type_).shape)


# ---- shape rules (shared by the tracer and the verifier) ------------------------------

def _describe(shape: Sequence[int], dtype: str) -> str:
    return f"{dtype}[{', '.join(str(d) for d in shape)}]"


def check_dtype(op: str, argument: str, dtype: str) -> None:
    if dtype not in DTYPES:
        raise TraceError(f"{op}: argument '{argument}' has dtype {dtype}; expected float32 or float64")


def check_extents(op: str, argument: str, shape: Sequence[int], dtype: str) -> None:
    """Only the first axis may be empty: a buffer whose inner axis is 0 has no stride the
    bare-pointer calling convention can express (nothing would be computed anyway)."""
    if any(extent == 0 for extent in shape[1:]):
        raise TraceError(f"{op}: argument '{argument}' is {_describe(shape, dtype)}; only the first axis "
                         "of a tensor may be empty")


def linear_shape(x: tuple, w: tuple, bias: tuple | None = None) -> tuple[int, int]:
    """Result shape of linear; each operand is (shape, dtype). Raises TraceError."""
    (x_shape, x_dtype), (w_shape, w_dtype) = x, w
    for name, (shape, dtype) in (("x", x), ("w", w)):
        check_dtype("linear", name, dtype)
        check_extents("linear", name, shape, dtype)
        if len(shape) != 2:
            raise TraceError(
                f"linear: argument '{name}' must have rank 2, got rank {len(shape)} "
                f"({_describe(shape, dtype)})")
    if w_dtype != x_dtype:
        raise TraceError(f"linear: mixed dtypes: x is {x_dtype} but w is {w_dtype}")
    if x_shape[1] != w_shape[0]:
        raise TraceError(
            f"linear: inner dimensions differ: x is {_describe(x_shape, x_dtype)} and w is "
            f"{_describe(w_shape, w_dtype)}; expected w to have {x_shape[1]} rows, got {w_shape[0]}")
    if bias is not None:
        b_shape, b_dtype = bias
        if b_dtype != x_dtype:
            raise TraceError(f"linear: mixed dtypes: x is {x_dtype} but bias is {b_dtype}")
        if tuple(b_shape) != (w_shape[1],):
            raise TraceError(
                f"linear: argument 'bias' must be {_describe((w_shape[1],), x_dtype)}, "
                f"got {_describe(b_shape, b_dtype)}")
    return (x_shape[0], w_shape[1])


def elementwise_shape(op: str, x: tuple) -> tuple[int, ...]:
    shape, dtype = x
    check_dtype(op, "x", dtype)
    if len(shape) < 1:
        raise TraceError(f"{op}: argument 'x' must have rank >= 1, got a scalar")
    check_extents(op, "x", shape, dtype)
    return tuple(shape)


# ---- typed builders ------------------------------------------------------------------

def _str(value: str) -> ir.StringAttr:
    return ir.StringAttr.get(value)


def constant(array: np.ndarray, name: str, device: str = "auto") -> ir.Value:
    native = array.astype(array.dtype.newbyteorder("="), copy=False)  # MLIR reads native order only
    value = ir.DenseElementsAttr.get(np.ascontiguousarray(native))
    op = ir.Operation.create(
        "hexir.constant", results=[value.type],
        attributes={"value": value, "name": _str(name), "device": _str(device)})
    return op.result


def linear(x: ir.Value, w: ir.Value, bias: ir.Value | None = None, device: str = "auto") -> ir.Value:
    operands = [x, w] + ([bias] if bias is not None else [])
    shape = linear_shape(*((shape_of(v.type), dtype_of(v.type)) for v in operands[:2]),
                         (shape_of(bias.type), dtype_of(bias.type)) if bias is not None else None)
    op = ir.Operation.create(
        "hexir.linear", results=[tensor_type(shape, dtype_of(x.type))], operands=operands,
        attributes={"device": _str(device)})
    return op.result


def relu(x: ir.Value, device: str = "auto") -> ir.Value:
    op = ir.Operation.create("hexir.relu", results=[x.type], operands=[x],
                             attributes={"device": _str(device)})
    return op.result


def print_(x: ir.Value) -> ir.Operation:
    return ir.Operation.create("hexir.print", operands=[x])


def transfer(x: ir.Value, source: str, target: str) -> ir.Value:
    op = ir.Operation.create("hexir.transfer", results=[x.type], operands=[x],
                             attributes={"source": _str(source), "target": _str(target)})
    return op.result


def _segments(op: str, args: Sequence[ir.Value]) -> ir.Attribute:
    if not 1 <= len(args) <= MAX_CALL_ARGS:
        raise TraceError(f"{op} takes 1 to {MAX_CALL_ARGS} tensors, got {len(args)}")
    return ir.DenseI32ArrayAttr.get([1] + [int(len(args) > i) for i in range(1, MAX_CALL_ARGS)])


def call(callee: str, args: Sequence[ir.Value], result_type: ir.Type, device: str) -> ir.Value:
    op = ir.Operation.create(
        "hexir.call", results=[result_type], operands=list(args),
        attributes={"callee": ir.FlatSymbolRefAttr.get(callee), "device": _str(device),
                    "operandSegmentSizes": _segments("hexir.call", args)})
    return op.result


def custom_call(kernel: str, args: Sequence[ir.Value], result_type: ir.Type, objects: dict[str, str],
                grid: Sequence[int], block: Sequence[int], device: str = "auto") -> ir.Value:
    """A user-supplied kernel: `objects` maps each device it can run on to its source/object file."""
    op = ir.Operation.create(
        "hexir.custom_call", results=[result_type], operands=list(args),
        attributes={"kernel": _str(kernel), "device": _str(device),
                    "objects": ir.DictAttr.get({d: _str(path) for d, path in objects.items()}),
                    "grid": ir.DenseI64ArrayAttr.get(list(grid)), "block": ir.DenseI64ArrayAttr.get(list(block)),
                    "operandSegmentSizes": _segments(f"custom kernel {kernel}", args)})
    return op.result


def objects_of(op: ir.Operation) -> dict[str, str]:
    """device -> file of a hexir.custom_call."""
    objects = ir.DictAttr(op.attributes["objects"])
    return {named.name: ir.StringAttr(named.attr).value for named in objects}


# ---- accessors -----------------------------------------------------------------------

def device_of(op: ir.Operation) -> str:
    """The device an op runs on ("auto" before partitioning); print runs on the host."""
    if op.name == "hexir.print":
        return "cpu"
    if op.name == "hexir.transfer":
        return ir.StringAttr(op.attributes["target"]).value
    return ir.StringAttr(op.attributes["device"]).value


def set_device(op: ir.Operation, device: str) -> None:
    op.attributes["device"] = _str(device)


def string_attr(op: ir.Operation, name: str) -> str:
    return ir.StringAttr(op.attributes[name]).value


def callee_of(op: ir.Operation) -> str:
    return ir.FlatSymbolRefAttr(op.attributes["callee"]).value


def constant_array(op: ir.Operation) -> np.ndarray:
    """The numpy value of a hexir.constant (a copy, C-contiguous, its own dtype)."""
    attr = ir.DenseElementsAttr(op.attributes["value"])
    shape = shape_of(op.result.type)
    dtype = np.dtype(dtype_of(op.result.type))
    if attr.is_splat:
        return np.full(shape, ir.FloatAttr(attr.get_splat_value()).value, dtype=dtype)
    return np.array(attr, dtype=dtype).reshape(shape)
