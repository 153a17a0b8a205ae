"""verify: the hexir graph obeys the shape and dtype rules (IRDL checks structure only).

Input: a hexir module, traced or parsed from a `.mlir` file. Output: the same module, or a
`TraceError` at the offending op's location. The rules are the dialect's own
(`hexir.linear_shape`, ...), the ones the tracer applies, so both inputs fail alike:

    %y = "hexir.linear"(%x, %w) : (tensor<2x8xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
  error: prog.mlir:3:8: linear: inner dimensions differ: x is float32[2, 8] and w is ...
"""

from __future__ import annotations

from mlir import ir

from hexir.dialects import hexir as hx
from hexir.errors import TraceError
from hexir.passes.common import main_function

_GRAPH_OPS = ("hexir.constant", "hexir.linear", "hexir.relu", "hexir.print", "hexir.transfer",
              "hexir.call", "func.return")


def _where(op: ir.Operation) -> str:
    text = str(op.location)
    return text[len("loc("):-1].strip('"').replace('":', ":") if text.startswith("loc(") else text


def verify(module: ir.Module) -> None:
    """Check every op of @main against hexir's rules; raise TraceError at the first breach."""
    main = main_function(module)
    for argument in main.regions[0].blocks[0].arguments:
        hx.dtype_of(argument.type)
    for op in main.regions[0].blocks[0].operations:
        op = op.operation
        if op.name not in _GRAPH_OPS:
            raise TraceError(f"'{op.name}' is not a hexir graph op; expected one of {', '.join(_GRAPH_OPS)}",
                             _where(op))
        try:
            _check(op)
        except TraceError as error:
            raise TraceError(error.message, _where(op)) from None


def _check(op: ir.Operation) -> None:
    specs = [(hx.shape_of(v.type), hx.dtype_of(v.type)) for v in op.operands]
    if op.name == "hexir.linear":
        expected = hx.linear_shape(specs[0], specs[1], specs[2] if len(specs) == 3 else None)
    elif op.name in ("hexir.relu", "hexir.transfer"):
        expected = hx.elementwise_shape(op.name.split(".")[1], specs[0])
    elif op.name == "hexir.print":
        hx.elementwise_shape("print", specs[0])
        return
    elif op.name == "hexir.constant":
        hx.dtype_of(op.result.type)
        return
    else:
        return
    result = (hx.shape_of(op.result.type), hx.dtype_of(op.result.type))
    if result != (tuple(expected), specs[0][1]):
        raise TraceError(f"{op.name.split('.')[1]}: result type is {result[1]}{list(result[0])}, "
                         f"expected {specs[0][1]}{list(expected)}")
