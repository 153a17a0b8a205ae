"""hexir: trace a model, place its ops on the cpu or a cuda GPU, ship one .hxb file.

    @hexir.jit
    def mlp(x):
        with hexir.on("cuda"):
            h = hexir.relu(hexir.linear(x, W1))
        return hexir.linear(h, W2)
"""

from hexir.errors import ArgumentError, CompileError, HexirError, PlacementError, TargetError, TraceError
from hexir.explain import explain
from hexir.frontend.custom import CustomKernel, kernel
from hexir.frontend.functions import (  # noqa: A004
    abs,
    argmax,
    cast,
    erf,
    exp,
    gelu,
    layer_norm,
    log,
    log_softmax,
    max,
    maximum,
    mean,
    minimum,
    relu,
    rsqrt,
    sigmoid,
    silu,
    softmax,
    sqrt,
    sum,
    tanh,
)
from hexir.frontend.layout import concat, concatenate, reshape, take, transpose
from hexir.frontend.matmul import matmul
from hexir.frontend.tensor import Tensor, TensorSpec
from hexir.frontend.trace import linear, on, print  # noqa: A004
from hexir.jit import export, jit
from hexir.ops import Contract, Layout, OpDef, Pointwise, Reduce
from hexir.ops import scalar as scalar
from hexir.version import __version__


def register_op(definition: OpDef):  # noqa: ANN201 - returns the op's traceable function
    """Add an op (a `hexir.Pointwise` or `hexir.Reduce`; see `hexir.ops`) and return the
    function that builds it in a trace: `f(*operands, **params)` for a pointwise op,
    `f(x, *others, axis=-1, keepdims=False, **params)` for a reduce op."""
    from hexir import ops
    from hexir.frontend import functions
    from hexir.frontend.trace import _at_user_line, op_function

    try:
        op = ops.register(definition)
    except HexirError as error:
        raise _at_user_line(error) from None
    if isinstance(op, Pointwise):
        def apply(*operands, **params):  # noqa: ANN002, ANN003, ANN202
            return functions.pointwise(op.name, operands, **params)
    elif isinstance(op, Reduce):
        def apply(x, *others, axis=-1, keepdims=False, **params):  # noqa: ANN001, ANN002, ANN003, ANN202
            return functions.reduce(op.name, x, others, axis, keepdims, **params)
    else:
        return op_function(op)
    apply.__name__ = apply.__qualname__ = op.name
    return apply


__all__ = [
    "jit", "export", "explain", "on", "linear", "matmul", "print", "kernel", "CustomKernel", "Tensor", "TensorSpec",
    "relu", "exp", "log", "tanh", "sqrt", "rsqrt", "erf", "abs", "sigmoid", "silu", "gelu", "maximum", "minimum",
    "sum", "mean", "max", "argmax", "softmax", "log_softmax", "layer_norm", "cast",
    "reshape", "transpose", "concat", "concatenate", "take",
    "OpDef", "Pointwise", "Reduce", "Contract", "Layout", "scalar", "register_op", "HexirError", "ArgumentError",
    "TraceError",
    "PlacementError", "TargetError", "CompileError", "__version__",
]
