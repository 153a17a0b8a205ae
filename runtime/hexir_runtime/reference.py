"""The reference device: numpy computes every kernel from its family and `expr`.

It is the executable definition of each op and the oracle the other devices are compared
with. It runs the kernels of every manifest device (cpu and cuda) and never loads native code,
so it refuses a module with custom kernels (the user's code has no numpy twin) when it loads.
A kernel is computed from what the manifest says it computes (format/scalars.py), never from
its name: a `pointwise` kernel evaluates its tree over its inputs, broadcast to the output; a
`linear` (or `matmul`, numpy's a @ b) evaluates its tree over x @ w and its epilogue inputs; a
`reduce` runs its program over its axis; `pack_panels` lays w out as `linear_panels` reads it; a
`layout` kernel moves elements as its record says (format/layouts.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .device import HostMemory
from .errors import KernelError
from .format import Hxb, Kernel, layouts
from .format.attention import StridedView
from .format.families import compute_dtype
from .format.scalars import Program, evaluate, run_program


def _pointwise(tree: Any) -> Callable[..., None]:
    def pointwise(*args: np.ndarray) -> None:
        out = args[-1]
        out[...] = evaluate(tree, args[:-1], compute_dtype([a.dtype.name for a in args]))
    return pointwise


def _linear(tree: Any, op: str = "linear") -> Callable[..., None]:
    """tree(x @ w, epilogue inputs...); w given as panels[p, k, j] = w[k, p * L + j] for
    `linear_panels`, as w^T for `linear_t`."""
    def linear(x: np.ndarray, w: np.ndarray, *rest: np.ndarray) -> None:
        out = rest[-1]
        w = w.T if op == "linear_t" else w
        if op == "linear_panels":
            w = w.transpose(1, 0, 2).reshape(w.shape[1], w.shape[0] * w.shape[2])[:, :out.shape[-1]]  # (K may be 0)
        dtype = compute_dtype([out.dtype.name])  # 16-bit: products and sums in float32
        sums = np.matmul(x.astype(dtype, copy=False), w.astype(dtype, copy=False))
        out[...] = evaluate(tree, (sums, *rest[:-1]), dtype)
    return linear


def _attention(tree: Any) -> Callable[..., None]:
    """softmax(tree(q @ kᵀ, mask)) @ v over the keys, a block of query rows at a time (no
    [Sq, Sk] buffer for a whole head: seq 4096 stays small)."""
    def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *rest: np.ndarray) -> None:
        out, masks = rest[-1], rest[:-1]
        rows, dtype = q.shape[-2], compute_dtype([out.dtype.name])  # 16-bit: in float32, as the kernels
        if k.shape[-2] == 0:  # no keys: 0 / 0, as the kernels' running sums give
            out[...] = np.nan
            return
        q, k, v = (a.astype(dtype, copy=False) for a in (q, k, v))
        full = [np.broadcast_to(m, (*out.shape[:-2], rows, k.shape[-2])) for m in masks]  # (views)
        for start in range(0, rows, 256):
            part = slice(start, min(start + 256, rows))
            mine = [m[..., part, :] for m in full]
            scores = evaluate(tree, (np.matmul(q[..., part, :], np.swapaxes(k, -1, -2)), *mine), dtype)
            with np.errstate(invalid="ignore"):
                weights = np.exp(scores - scores.max(-1, keepdims=True))
                out[..., part, :] = np.matmul(weights / weights.sum(-1, keepdims=True), v)
    return attention


def _reduce(program: Program, label: str) -> Callable[..., None]:
    """The program over the axis of args[0]; its per-row result (the axis kept, as 1) reshaped
    into out, which has the axis as 1 or not at all."""
    extremum = any(kind != "sum" for kind, _ in program.reductions)

    def reduce(*args: np.ndarray) -> None:
        out, full = args[-1], args[0].shape
        if extremum and full[program.axis] == 0:
            raise KernelError(f"{label}: the max or argmax of an empty axis (axis {program.axis} of "
                              f"{list(full)}) has no value")
        kept = full[:program.axis] + (1,) + full[program.axis + 1:] if program.rows else full
        result = run_program(program, args[:-1], compute_dtype([a.dtype.name for a in args]))
        out[...] = np.broadcast_to(result, kept).reshape(out.shape)
    return reduce


def _pack_panels(w: np.ndarray, out: np.ndarray) -> None:
    """out[p, k, j] = w[k, p * L + j], zeros past N."""
    count, _, lanes = out.shape
    padded = np.zeros((w.shape[0], count * lanes), w.dtype)
    padded[:, :w.shape[1]] = w
    out[...] = padded.reshape(w.shape[0], count, lanes).transpose(1, 0, 2)


def numpy_function(kernel: Kernel, label: str = "") -> Callable[..., None] | None:
    """What computes `kernel` (`label` in errors: `kernels[3] (softmax_3)`) in numpy, or None for
    a custom kernel (the user's code); its inputs reshaped to their views first."""
    function = _numpy_function(kernel, label)
    if function is None or not any(kernel.views):
        return function

    def viewed(*arrays: np.ndarray) -> None:
        reshaped = []
        for array, arg, view in zip(arrays, kernel.args, kernel.views, strict=True):
            sizes = {d: n for d, n in zip(arg.shape, array.shape, strict=True) if isinstance(d, str)}
            if isinstance(view, StridedView):  # (a view of the buffer: the output written through it)
                flat = array.reshape(-1)[np.ravel_multi_index(view.start, array.shape, mode="clip"):]
                strides = [array.strides[a] * c for a, c in view.axes]
                reshaped.append(np.lib.stride_tricks.as_strided(flat, view.concrete(sizes), strides))
                continue
            reshaped.append(array if view is None else array.reshape(view.concrete(sizes)))
        function(*reshaped)
    return viewed


def _numpy_function(kernel: Kernel, label: str = "") -> Callable[..., None] | None:
    if kernel.op in ("linear", "linear_panels", "linear_t", "matmul"):
        return _linear(kernel.expr, kernel.op)
    if kernel.op == "attention":
        return _attention(kernel.expr)
    if kernel.op == "pointwise":
        return _pointwise(kernel.expr)
    if kernel.op == "reduce":
        return _reduce(kernel.expr, label or kernel.name)
    if kernel.op == "layout":
        return layouts.numpy_function(kernel.expr)
    return _pack_panels if kernel.op == "pack_panels" else None


class ReferenceDevice(HostMemory):
    """Host buffers; kernels computed by numpy."""

    name = "reference"
    kinds = ("cpu", "cuda")

    def load(self, hxb: Hxb) -> ReferenceProgram:
        """Prepare the module's kernels (all of them, whatever their device); KernelError for a
        custom one."""
        functions = [numpy_function(kernel, f"kernels[{index}] ({kernel.name})")
                     for index, kernel in enumerate(hxb.manifest.kernels)]
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
