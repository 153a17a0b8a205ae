"""verify: the hexir graph obeys the shape and dtype rules (IRDL checks structure only).

Input: a hexir module, traced or parsed from a `.mlir` file. Output: the same module, or a
`TraceError` at the offending op's location. The rules are each op's registered shape rule
(`hexir/ops.py`), the ones the tracer applies, so both inputs fail alike:

    %y = "hexir.linear"(%x, %w) : (tensor<2x8xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
  error: prog.mlir:3:8: linear: inner dimensions differ: x is float32[2, 8] and w is ...

Besides: @main takes and returns ranked tensors of f32 or f64 (or int64) whose symbolic
extents are named (`tensor<?x?x8xf32, "batch,seq">`), a constant's value has its result's
type, and a call names a kernel of the module.
"""

from __future__ import annotations

import re

from hexir_runtime.format import HxbFormatError, TensorType, layouts, scalars
from mlir import ir

from hexir import ops
from hexir.dialects import hexir as hx
from hexir.dialects import hextir as ht
from hexir.errors import CompileError, TraceError
from hexir.passes.common import location_of
from hexir.target import check_launch

_GRAPH_OPS = ("hexir.constant", "hexir.print", "hexir.transfer", "hexir.call", "hexir.custom_call", "func.return")


def verify(module: ir.Module) -> None:
    """Check @main's signature and every op of it against hexir's rules; raise TraceError at
    the first breach."""
    main = hx.main_function(module)
    if not main.regions[0].blocks:
        raise TraceError("main has no body; expected the host program", location_of(main))
    _check_signature(main)
    # a cpu twin is reached through its cuda kernel, never called directly
    kernel_names = {ht.name_of(k) for k in ht.kernels(module) if ht.fallback_of(k) is None}
    for op in main.regions[0].blocks[0].operations:
        op = op.operation
        if op.name not in _GRAPH_OPS and ops.lookup(op.name) is None:
            raise TraceError(f"'{op.name}' is not a hexir graph op; expected one of "
                             f"{', '.join(_GRAPH_OPS + hx.compute_ops())}", location_of(op))
        try:
            _check(op, kernel_names)
        except TraceError as error:
            raise TraceError(error.message, location_of(op)) from None


def _check_tensor(type_: ir.Type) -> hx.Shape:
    if not isinstance(type_, ir.RankedTensorType):
        raise TraceError(f"{type_} is not a tensor; expected a tensor of f32 or f64")
    return hx.shape_of(type_)


def _check_signature(main: ir.Operation) -> None:
    """The runtime passes @main tensors of f32 or f64 and takes tensors back."""
    function_type = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    values = [(f"argument '{name}'", type_)
              for name, type_ in zip(hx.argument_names(main), function_type.inputs, strict=True)]
    values += [(f"result {position}", type_) for position, type_ in enumerate(function_type.results)]
    for what, type_ in values:
        try:
            _check_tensor(type_)
            hx.dtype_of(type_)
        except TraceError as error:
            raise TraceError(f"main: {what}: {error.message}", location_of(main)) from None


def _check(op: ir.Operation, kernel_names: set[str]) -> None:
    short_name = op.name.split(".")[1]
    for what, value in [*((f"operand {i}", v) for i, v in enumerate(op.operands)),
                        *((f"result {i}", v) for i, v in enumerate(op.results))]:
        try:
            _check_tensor(value.type)
        except TraceError as error:
            raise TraceError(f"{short_name}: {what}: {error.message}") from None
    if hx.W_PANELS in op.attributes:  # (the pass runs after this check: no input carries it)
        raise TraceError(f"{short_name}: {hx.W_PANELS} is set by the compiler (pack-weights), not by its input")
    specs = [(hx.shape_of(v.type), hx.dtype_of(v.type)) for v in op.operands]
    definition = ops.lookup(op.name)
    if definition is not None:
        expected, dtype = _family_result(op, definition, short_name, specs)
    elif op.name == "hexir.transfer":
        if hx.string_attr(op, "source") == hx.string_attr(op, "target"):
            raise TraceError(f"transfer: source and target are both {hx.string_attr(op, 'source')}")
        expected, dtype = hx.elementwise_shape(short_name, specs[0]), specs[0][1]
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
    allowed = expected if isinstance(expected, list) else [tuple(expected)]
    if result[1] != dtype or result[0] not in allowed:
        raise TraceError(f"{short_name}: result type is {hx.describe(*result)}, "
                         f"expected {' or '.join(hx.describe(e, dtype) for e in allowed)}")


def _family_result(op: ir.Operation, definition: ops.OpDef, name: str, specs: list) -> tuple[object, str]:
    """The shape(s) and dtype a compute op's rule gives its result; its expr checked as the
    runtime will check the kernel's."""
    try:
        expr = hx.expr_of(op)
        if definition.family == "pointwise":
            scalars.check(expr, f"{name}: expr", len(specs))
            result = hx.dtype_of(op.result.type)  # a conversion (cast: the tree ["arg", 0]) to any float
            converts = expr == ["arg", 0] and result in hx.DTYPES
            return ops.pointwise_shape(name, specs), result if converts else specs[0][1]
        if definition.family == "layout":
            result = (hx.shape_of(op.result.type), hx.dtype_of(op.result.type))
            layouts.check(expr, tuple(TensorType(tuple(s), d) for s, d in [*specs, result]), f"{name}: expr")
            return result
        if definition.family == "reduce":
            program = scalars.check_program(expr, f"{name}: expr", len(specs), len(specs[0][0]))
            shapes = {ops.reduce_shape(name, specs, program, keep) for keep in (False, True)}
            return sorted(shapes, key=len), ops.result_dtype(program, specs[0][1])
        groups = hx.operand_groups(op)  # a contract: its named operands, then its epilogue's inputs
        named = [(hx.shape_of(g[0].type), hx.dtype_of(g[0].type)) for g in groups[:len(definition.operands)] if g]
        shape = definition.shape(*named)
        extras = [v for g in groups[len(definition.operands):] for v in g]
        for extra in extras:
            extra_spec = (hx.shape_of(extra.type), hx.dtype_of(extra.type))
            if extra_spec[1] != specs[0][1] or ops.broadcast(name, [shape, extra_spec[0]]) != tuple(shape):
                raise TraceError(f"{name}: an epilogue input is {hx.describe(*extra_spec)}; expected a {specs[0][1]} "
                                 f"tensor that broadcasts to the result {hx.describe(shape, specs[0][1])}")
        if expr is not None or extras:
            scalars.check(expr, f"{name}: {hx.EPILOGUE}", 1 + len(extras))
    except HxbFormatError as error:
        raise TraceError(str(error)) from None
    return shape, specs[0][1]


def _check_custom_call(op: ir.Operation) -> None:
    """What IRDL cannot say about a custom call: its files' devices, its symbol, its launch."""
    kernel = hx.string_attr(op, "kernel")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", kernel):
        raise TraceError(f"custom_call: kernel {kernel!r} is not a C symbol")
    objects = hx.objects_of(op)
    if not objects or not set(objects) <= set(hx.DEVICES):
        raise TraceError(f"custom_call {kernel}: objects must map some of {', '.join(hx.DEVICES)} to files, "
                         f"got {', '.join(objects) or 'nothing'}")
    grid, block = hx.launch_of(op)
    for name, dims in (("grid", grid), ("block", block)):
        if len(dims) != 3 or min(dims) < 1:
            raise TraceError(f"custom_call {kernel}: {name} must be 3 positive sizes, got {dims}")
    if any(isinstance(d, str) for v in [*op.operands, op.result] for d in hx.shape_of(v.type)):
        raise TraceError(f"custom_call {kernel}: custom kernels take tensors of static shapes only")
    try:
        check_launch(kernel, grid, block)
    except CompileError as error:
        raise TraceError(error.message) from None
