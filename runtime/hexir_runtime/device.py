"""What every device implements, and the host memory that the numpy-backed devices share.

A device runs the kernels of one or more manifest devices (`kinds`: "cpu", "cuda"). It owns
buffers (alloc, free, copy in, copy out, synchronize) and loads a module's kernels into a
program (load, launch, close). The executor only ever talks to devices through this interface.
Buffers are reused across calls whose sizes change: the executor allocates a flat buffer big
enough for the call and asks the device for a `view` of it with the call's shape.
Host buffers are numpy arrays: a device copies straight between them and its own buffers
(`copy_in` from one, `copy_out_into` one), so a transfer makes no intermediate array. A GPU
device also allocates page-locked host arrays (`alloc_pinned`, `free_pinned`): the executor's
staging buffers for the host buffers that meet the GPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from .format import Hxb


class Program(Protocol):
    """A module's kernels, loaded on one device.

    Optionally (the executor uses them where they exist): `launcher(kernel, buffers, sizes)`, a
    function doing `launch` with everything computed once per call shape, given per-call
    (argument, buffer) overrides, or None when there is nothing to run. A GPU program (one
    with `begin`) also queues the module's copies on its own stream: `begin()` at the start of
    each call, `copy_in`, `copy_out`, `copy_out_into`, `synchronize`, `staged` (a queued copy may
    still read a staging buffer) and `output(shape, dtype)` (a fresh device output, DLPack).
    """

    def launch(self, kernel: int, buffers: Sequence[Any], sizes: Mapping[str, int]) -> None:
        """Run kernels[kernel] on `buffers` (its args in order; the last one is written), its
        symbols having this call's `sizes`."""

    def close(self) -> None:
        """Unload the kernels from the device (idempotent); a closed program is not launched again."""


class Device(Protocol):
    """A place where buffers live and kernels run."""

    name: str
    kinds: tuple[str, ...]

    def alloc(self, shape: tuple[int, ...], dtype: str) -> Any: ...
    def free(self, buffer: Any) -> None: ...
    def view(self, buffer: Any, shape: tuple[int, ...]) -> Any: ...
    def copy_in(self, buffer: Any, array: np.ndarray) -> None: ...
    def copy_out(self, buffer: Any) -> np.ndarray: ...
    def copy_out_into(self, buffer: Any, array: np.ndarray) -> None: ...
    def synchronize(self) -> None: ...
    def load(self, hxb: Hxb) -> Program: ...


#: Where every host buffer handed to a kernel starts: a multiple of a cache line and of an
#: AVX-512 vector. np.empty's big arrays start 16 bytes into a page, so that every 64-byte vector
#: of them spans two cache lines (5-15% on the H200 host's CPU GEMMs, docs/tuning.md).
ALIGNMENT = 64


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A new uninitialised C-contiguous array whose data starts on an ALIGNMENT-byte boundary:
    a view of a slightly larger byte array (its `base`, which nothing else refers to)."""
    dtype = np.dtype(dtype)
    size = math.prod(shape) * dtype.itemsize
    raw = np.empty(size + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + size].view(dtype).reshape(shape)


class HostMemory:
    """Buffers that are C-contiguous numpy arrays in host memory, 64-byte aligned."""

    def alloc(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """A new uninitialised buffer."""
        return aligned_empty(shape, dtype)

    def free(self, buffer: np.ndarray) -> None:
        """Nothing to do: numpy frees the array with its last reference."""

    def view(self, buffer: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """The first elements of flat `buffer`, as an array of `shape` (no copy)."""
        return buffer[: math.prod(shape)].reshape(shape)

    def copy_in(self, buffer: np.ndarray, array: np.ndarray) -> None:
        """Copy `array` (same shape and dtype, any strides) into `buffer`."""
        buffer[...] = array  # the caller checked the dtype; 4x faster than np.copyto on small arrays

    def copy_out(self, buffer: np.ndarray) -> np.ndarray:
        """A fresh array with the buffer's contents, owned by the caller."""
        return buffer.copy()

    def copy_out_into(self, buffer: np.ndarray, array: np.ndarray) -> None:
        """Copy the buffer's contents into `array` (same shape and dtype, any strides)."""
        array[...] = buffer

    def synchronize(self) -> None:
        """Nothing to do: host kernels have finished when launch returns."""
