"""The reference device: numpy computes every kernel from its `op`.

It is the executable definition of each op and the oracle the other devices are compared
with. It runs the kernels of every manifest device (cpu and cuda) and never loads native code,
so it refuses a module with custom kernels (the user's code has no numpy twin) when it loads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .device import HostMemory
from .errors import KernelError
from .format import Hxb


def _linear(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    np.matmul(x, w, out=out)


def _linear_bias(x: np.ndarray, w: np.ndarray, bias: np.ndarray, out: np.ndarray) -> None:
    np.matmul(x, w, out=out)
    out += bias


def _relu(x: np.ndarray, out: np.ndarray) -> None:
    np.maximum(x, 0, out=out)


def _relu_after(linear: Callable[..., None]) -> Callable[..., None]:
    def fused(*buffers: np.ndarray) -> None:
        linear(*buffers)
        np.maximum(buffers[-1], 0, out=buffers[-1])
    return fused


OPS: dict[str, Callable[..., None]] = {
    "linear": _linear, "linear_bias": _linear_bias, "relu": _relu,
    "linear_relu": _relu_after(_linear), "linear_bias_relu": _relu_after(_linear_bias),
}


class ReferenceDevice(HostMemory):
    """Host buffers; kernels computed by numpy."""

    name = "reference"
    kinds = ("cpu", "cuda")

    def load(self, hxb: Hxb) -> ReferenceProgram:
        """Prepare the module's kernels (all of them, whatever their device); KernelError for a custom one."""
        for index, kernel in enumerate(hxb.manifest["kernels"]):
            if kernel["op"] not in OPS:
                raise KernelError(f"kernels[{index}] ({kernel['name']}) is a {kernel['op']} kernel: "
                                  "the reference device has no numpy version of it")
        return ReferenceProgram([OPS[kernel["op"]] for kernel in hxb.manifest["kernels"]])


class ReferenceProgram:
    """A module's kernels as numpy functions."""

    def __init__(self, functions: list[Callable[..., None]]) -> None:
        self.functions = functions

    def launch(self, kernel: int, buffers: Sequence[Any]) -> None:
        """Compute kernels[kernel] into the last of `buffers`."""
        if not 0 <= kernel < len(self.functions):
            raise KernelError(f"kernel {kernel} does not exist (the module has {len(self.functions)})")
        self.functions[kernel](*buffers)

    def close(self) -> None:
        """Nothing to unload: the kernels are numpy functions."""
