"""verify: the hexir graph obeys the shape and dtype rules (IRDL checks structure only).

Input: a hexir module, traced or parsed from a `.mlir` file. Output: the same module, or a
`TraceError` at the offending op's location. The rules are the dialect's own
(`hexir.linear_shape`, ...), the ones the tracer applies, so both inputs fail alike:

    %y = "hexir.linear"(%x, %w) : (tensor<2x8xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
  error: prog.mlir:3:8: linear: inner dimensions differ: x is float32[2, 8] and w is ...

Besides: @main takes and returns tensors of f32 or f64, every shape is static (later
stages size buffers and loops from them), a constant's value has its result's type, and a
call names a kernel of the module.
"""

from __future__ import annotations

import re

from mlir import ir

from hexir.dialects import hexir as hx
from hexir.errors import CompileError, TraceError
from hexir.passes.common import argument_names, kernels, location_of, main_function
from hexir.passes.to_gpu import check_launch

_GRAPH_OPS = ("hexir.constant", "hexir.linear", "hexir.relu", "hexir.print", "hexir.transfer",
              "hexir.call", "hexir.custom_call", "func.return")


def verify(module: ir.Module) -> None:
    """Check @main's signature and every op of it against hexir's rules; raise TraceError at
    the first breach."""
    main = main_function(module)
    if not main.regions[0].blocks:
        raise TraceError("main has no body; expected the host program", location_of(main))
    _check_signature(main)
    # a cpu twin (hextir.fallback_of) is reached through its cuda kernel, never called directly
    kernel_names = {ir.StringAttr(k.attributes["sym_name"]).value for k in kernels(module)
                    if "hextir.fallback_of" not in k.attributes}
    for op in main.regions[0].blocks[0].operations:
        op = op.operation
        if op.name not in _GRAPH_OPS:
            raise TraceError(f"'{op.name}' is not a hexir graph op; expected one of {', '.join(_GRAPH_OPS)}",
                             location_of(op))
        try:
            _check(op, kernel_names)
        except TraceError as error:
            raise TraceError(error.message, location_of(op)) from None


def _check_static_tensor(type_: ir.Type) -> None:
    if not isinstance(type_, ir.RankedTensorType):
        raise TraceError(f"{type_} is not a tensor; expected a tensor of f32 or f64")
    if not type_.has_static_shape:
        raise TraceError(f"{type_} has a dynamic shape; expected a static shape")


def _check_signature(main: ir.Operation) -> None:
    """The runtime passes @main tensors of f32 or f64 and takes tensors back."""
    function_type = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    values = [(f"argument '{name}'", type_)
              for name, type_ in zip(argument_names(main), function_type.inputs, strict=True)]
    values += [(f"result {position}", type_) for position, type_ in enumerate(function_type.results)]
    for what, type_ in values:
        try:
            _check_static_tensor(type_)
            hx.dtype_of(type_)
        except TraceError as error:
            raise TraceError(f"main: {what}: {error.message}", location_of(main)) from None


def _check(op: ir.Operation, kernel_names: set[str]) -> None:
    short_name = op.name.split(".")[1]
    values = [(f"operand {i}", v) for i, v in enumerate(op.operands)]
    values += [(f"result {i}", v) for i, v in enumerate(op.results)]
    for what, value in values:
        try:
            _check_static_tensor(value.type)
        except TraceError as error:
            raise TraceError(f"{short_name}: {what}: {error.message}") from None
    specs = [(hx.shape_of(v.type), hx.dtype_of(v.type)) for v in op.operands]
    if op.name == "hexir.linear":
        if "hexir.epilogue" in op.attributes and hx.string_attr(op, "hexir.epilogue") != "relu":
            raise TraceError(f"linear: hexir.epilogue is {hx.string_attr(op, 'hexir.epilogue')!r}; the only "
                             "epilogue is \"relu\"")
        expected = hx.linear_shape(specs[0], specs[1], specs[2] if len(specs) == 3 else None)
    elif op.name in ("hexir.relu", "hexir.transfer"):
        if op.name == "hexir.transfer" and hx.string_attr(op, "source") == hx.string_attr(op, "target"):
            raise TraceError(f"transfer: source and target are both {hx.string_attr(op, 'source')}")
        expected = hx.elementwise_shape(short_name, specs[0])
    elif op.name == "hexir.print":
        hx.elementwise_shape("print", specs[0])
        return
    elif op.name == "hexir.constant":
        hx.dtype_of(op.result.type)
        value_type = ir.DenseElementsAttr(op.attributes["value"]).type
        if value_type != op.result.type:
            raise TraceError(f"constant: value has type {value_type}, expected the result type {op.result.type}")
        return
    elif op.name == "hexir.call":
        if hx.callee_of(op) not in kernel_names:
            raise TraceError(f"call: @{hx.callee_of(op)} is not a kernel of this module; expected a func.func "
                             "with hextir.kernel or a gpu.func in a gpu.module")
        return
    elif op.name == "hexir.custom_call":
        _check_custom_call(op)
        return
    else:
        return
    result = (hx.shape_of(op.result.type), hx.dtype_of(op.result.type))
    if result != (tuple(expected), specs[0][1]):
        raise TraceError(f"{short_name}: result type is {result[1]}{list(result[0])}, "
                         f"expected {specs[0][1]}{list(expected)}")


def _check_custom_call(op: ir.Operation) -> None:
    """What IRDL cannot say about a custom call: its files' devices, its symbol, its launch."""
    kernel = hx.string_attr(op, "kernel")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", kernel):
        raise TraceError(f"custom_call: kernel {kernel!r} is not a C symbol")
    objects = hx.objects_of(op)
    if not objects or not set(objects) <= set(hx.DEVICES):
        raise TraceError(f"custom_call {kernel}: objects must map some of {', '.join(hx.DEVICES)} to files, "
                         f"got {', '.join(objects) or 'nothing'}")
    for name in ("grid", "block"):
        dims = list(ir.DenseI64ArrayAttr(op.attributes[name]))
        if len(dims) != 3 or min(dims) < 1:
            raise TraceError(f"custom_call {kernel}: {name} must be 3 positive sizes, got {dims}")
    try:
        check_launch(kernel, list(ir.DenseI64ArrayAttr(op.attributes["grid"])),
                     list(ir.DenseI64ArrayAttr(op.attributes["block"])))
    except CompileError as error:
        raise TraceError(error.message) from None
