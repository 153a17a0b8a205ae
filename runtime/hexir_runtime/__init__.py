"""hexir_runtime: load and run modules compiled by hexir (.hxb files), with numpy and ctypes.

    module = hexir_runtime.load("mlp.hxb")
    y = module.main(x)

The runtime never imports the compiler (`hexir`) or MLIR.
"""

from .errors import (
    DeviceError,
    HexirRuntimeError,
    HxbFormatError,
    InputError,
    KernelError,
    KeyFileError,
    UntrustedModuleError,
)
from .module import Module, Signature, load

__version__ = "0.2.0"

__all__ = [
    "DeviceError",
    "HexirRuntimeError",
    "HxbFormatError",
    "InputError",
    "KernelError",
    "KeyFileError",
    "Module",
    "Signature",
    "UntrustedModuleError",
    "__version__",
    "load",
]
