"""The reference device: numpy computes every kernel from its `op`.

It is the executable definition of each op and the oracle the other devices are compared
with. It runs the kernels of every manifest device (cpu and cuda) and never loads native code,
so it refuses a module with custom kernels (the user's code has no numpy twin), or with an op
it does not know, when it loads. A `linear` applies its epilogues (bias, relu) in order;
`pack_panels` lays w out as `linear_panels` reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .device import HostMemory
from .errors import KernelError
from .format import Hxb, Kernel


def _linear(epilogues: tuple[str, ...], panels: bool = False) -> Callable[..., None]:
    """x @ w, then its epilogues in order: + bias, max(., 0); w given as panels[p, k, j] =
    w[k, p * L + j] for `linear_panels`."""
    def linear(x: np.ndarray, w: np.ndarray, *rest: np.ndarray) -> None:
        out = rest[-1]
        if panels:
            w = w.transpose(1, 0, 2).reshape(w.shape[1], w.shape[0] * w.shape[2])[:, :out.shape[1]]  # (K may be 0)
        np.matmul(x, w, out=out)
        for epilogue in epilogues:
            if epilogue == "bias":
                out += rest[0]
            else:
                np.maximum(out, 0, out=out)
    return linear


def _relu(x: np.ndarray, out: np.ndarray) -> None:
    np.maximum(x, 0, out=out)


def _pack_panels(w: np.ndarray, out: np.ndarray) -> None:
    """out[p, k, j] = w[k, p * L + j], zeros past N."""
    count, _, lanes = out.shape
    padded = np.zeros((w.shape[0], count * lanes), w.dtype)
    padded[:, :w.shape[1]] = w
    out[...] = padded.reshape(w.shape[0], count, lanes).transpose(1, 0, 2)


def numpy_function(kernel: Kernel) -> Callable[..., None] | None:
    """What computes `kernel` in numpy, or None for an op without a numpy version (custom, unknown)."""
    if kernel.op in ("linear", "linear_panels"):
        return _linear(kernel.epilogues, kernel.op == "linear_panels") if set(kernel.epilogues) <= {"bias", "relu"} \
            else None
    return {"relu": _relu, "pack_panels": _pack_panels}.get(kernel.op)


class ReferenceDevice(HostMemory):
    """Host buffers; kernels computed by numpy."""

    name = "reference"
    kinds = ("cpu", "cuda")

    def load(self, hxb: Hxb) -> ReferenceProgram:
        """Prepare the module's kernels (all of them, whatever their device); KernelError for a
        custom one or an op this runtime does not know."""
        functions = [numpy_function(kernel) for kernel in hxb.manifest.kernels]
        for index, (kernel, function) in enumerate(zip(hxb.manifest.kernels, functions, strict=True)):
            if function is None:
                raise KernelError(f"kernels[{index}] ({kernel.name}) is a {kernel.op} kernel: "
                                  "the reference device has no numpy version of it")
        return ReferenceProgram(functions)


class ReferenceProgram:
    """A module's kernels as numpy functions."""

    def __init__(self, functions: list[Callable[..., None]]) -> None:
        self.functions = functions

    def launch(self, kernel: int, buffers: Sequence[Any], sizes: Mapping[str, int]) -> None:
        """Compute kernels[kernel] into the last of `buffers` (whose shapes already hold the sizes)."""
        if not 0 <= kernel < len(self.functions):
            raise KernelError(f"kernel {kernel} does not exist (the module has {len(self.functions)})")
        self.functions[kernel](*buffers)

    def close(self) -> None:
        """Nothing to unload: the kernels are numpy functions."""
