"""hexir: trace a model, place its ops on the cpu or a cuda GPU, ship one .hxb file.

    @hexir.jit
    def mlp(x):
        with hexir.on("cuda"):
            h = hexir.relu(hexir.linear(x, W1))
        return hexir.linear(h, W2)
"""

__version__ = "0.1.0"

from hexir.errors import (  # noqa: E402
    ArgumentError,
    CompileError,
    HexirError,
    PlacementError,
    TargetError,
    TraceError,
)
from hexir.frontend.custom import CustomKernel, kernel  # noqa: E402
from hexir.frontend.jit import export, jit  # noqa: E402
from hexir.frontend.tensor import Tensor, TensorSpec  # noqa: E402
from hexir.frontend.trace import linear, on, print, relu  # noqa: E402, A004

__all__ = [
    "jit", "export", "on", "linear", "relu", "print", "kernel", "CustomKernel", "Tensor", "TensorSpec",
    "HexirError", "ArgumentError", "TraceError", "PlacementError", "TargetError", "CompileError", "__version__",
]
