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
from hexir.frontend.tensor import Tensor, TensorSpec
from hexir.frontend.trace import linear, on, print, relu  # noqa: A004
from hexir.jit import export, jit
from hexir.ops import OpDef
from hexir.version import __version__


def register_op(definition: OpDef):  # noqa: ANN201 - returns the op's traceable function
    """Add a compute op (see `hexir.ops`) and return the function that builds it in a trace."""
    from hexir import ops
    from hexir.frontend.trace import op_function

    return op_function(ops.register(definition))


__all__ = [
    "jit", "export", "explain", "on", "linear", "relu", "print", "kernel", "CustomKernel", "Tensor", "TensorSpec",
    "OpDef", "register_op", "HexirError", "ArgumentError", "TraceError", "PlacementError", "TargetError",
    "CompileError", "__version__",
]
