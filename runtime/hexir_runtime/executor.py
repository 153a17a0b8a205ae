"""Runs one entry's host program (docs/hxb-format.md, "entries") on a set of devices.

What can be done once is done in `Executor.__init__`: the program becomes a list of steps, each
a closure bound to its devices, kernel and buffer slots, and constants are bound (uploaded once
per module and device, by `Constants`). A call (`run`) then only sizes the buffers for the
sizes its inputs bound (`bind`) and runs the steps.

Buffers are reused across calls: each keeps one flat allocation, and a call views it with the
call's shape. An allocation grows (is replaced by a larger one) only when a call needs more
elements than it holds, so a repeated or smaller batch allocates nothing. A call whose
destination has no elements (batch 0) is skipped: there is nothing to compute.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .device import Device, Program
from .errors import InputError
from .format import Entry, Hxb, TensorType


class Constants:
    """The module's weights, uploaded to a device the first time an entry binds them there."""

    def __init__(self, hxb: Hxb) -> None:
        self.hxb = hxb
        self.uploaded: dict[tuple[int, Device], Any] = {}

    def get(self, index: int, device: Device) -> Any:
        """The device buffer holding constants[index]."""
        if (index, device) not in self.uploaded:
            constant = self.hxb.manifest.constants[index]
            shape, dtype = constant.type.shape, constant.type.dtype
            array = np.frombuffer(self.hxb.blob(constant.blob), dtype).reshape(shape)
            buffer = self.uploaded[index, device] = device.alloc(shape, dtype)
            device.copy_in(buffer, array)
        return self.uploaded[index, device]

    def close(self) -> None:
        """Free every uploaded constant (idempotent)."""
        uploaded, self.uploaded = self.uploaded, {}
        for (_, device), buffer in uploaded.items():
            device.free(buffer)


def bind(entry: Entry, arrays: Sequence[np.ndarray]) -> dict[str, int]:
    """The sizes of the entry's symbols, from the shapes of its (dtype- and rank-checked)
    arguments; InputError if two inputs give one symbol different sizes."""
    sizes: dict[str, int] = {}
    where: dict[str, tuple[str, int]] = {}  # symbol -> the input and axis that bound it
    for (name, tensor), array in zip(entry.inputs, arrays, strict=True):
        for axis, (dim, size) in enumerate(zip(tensor.shape, array.shape, strict=True)):
            if not isinstance(dim, str):
                continue
            if dim in sizes and sizes[dim] != size:
                first, first_axis = where[dim]
                raise InputError(f"{entry.name}(): input {name!r} has {dim} = {size} (axis {axis}), but input "
                                 f"{first!r} has {dim} = {sizes[dim]} (axis {first_axis})")
            sizes[dim], where[dim] = size, (name, axis)
    return sizes


class Executor:
    """One entry, ready to run: its steps built, its constants bound, its buffers sized per call."""

    def __init__(
        self, entry: Entry, devices: dict[str, Device], programs: list[Program], constants: Constants
    ) -> None:
        self.entry = entry
        self.places = [devices[buffer.device] for buffer in entry.buffers]
        self.views: list[Any] = [None] * len(entry.buffers)  # each buffer, with this call's shape
        # Buffers to size per call: index -> [its flat allocation or None, its capacity in elements].
        self.allocations: dict[int, list[Any]] = {}
        self.constants = {command.dst for command in entry.program if command.op == "constant"}
        self.steps: list[Callable[[Sequence[np.ndarray], Mapping[str, int]], None]] = []
        self.returns: tuple[int, ...] = ()
        for command in entry.program:
            if command.op == "constant":
                place = self.places[command.dst]
                self.views[command.dst] = constants.get(command.constant, place)
            elif command.op == "return":
                self.returns = command.srcs
            else:
                self.steps.append(self._step(command, programs))
        for index in range(len(entry.buffers)):
            if index not in self.constants:
                self.allocations[index] = [None, 0]
        if not any(tensor.symbols for _, tensor in entry.inputs):
            try:  # static shapes: allocate now, so that a module that cannot fit fails when it loads
                self._size_buffers({})
            except BaseException:
                self.close()
                raise

    def _step(self, command: Any, programs: list[Program]) -> Callable[[Sequence[np.ndarray], Mapping[str, int]], None]:
        """A closure running `command` on this call's buffer views."""
        views, places = self.views, self.places
        if command.op == "input":
            place, dst, index = places[command.dst], command.dst, command.index
            return lambda arrays, sizes: place.copy_in(views[dst], arrays[index])
        if command.op == "call":
            program, kernel, args = programs[command.kernel], command.kernel, command.args

            def call(arrays: Sequence[np.ndarray], sizes: Mapping[str, int]) -> None:
                buffers = [views[arg] for arg in args]
                if math.prod(buffers[-1].shape):  # an empty destination: nothing to compute
                    program.launch(kernel, buffers, sizes)
            return call
        if command.op == "transfer":
            src, dst = command.src, command.dst
            return lambda arrays, sizes: self._transfer(src, dst)
        place, src = places[command.src], command.src  # print
        return lambda arrays, sizes: sys.stdout.write(format_tensor(place.copy_out(views[src])))

    def run(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Run the program on `arrays` (dtypes, ranks and static sizes already checked against
        the signature); return the outputs."""
        sizes = bind(self.entry, arrays)
        self._size_buffers(sizes)
        for step in self.steps:
            step(arrays, sizes)
        return [self.places[src].copy_out(self.views[src]) for src in self.returns]

    def _size_buffers(self, sizes: Mapping[str, int]) -> None:
        """View every buffer with this call's shape, growing an allocation only if it is too small."""
        shapes = {}
        for index in self.allocations:
            tensor: TensorType = self.entry.buffers[index].type
            shape = shapes[index] = tensor.concrete(sizes)
            if math.prod(shape) * tensor.itemsize >= 2**63:
                raise InputError(f"{self.entry.name}(): buffer {index} would be {tensor.dtype}"
                                 f"[{', '.join(map(str, shape))}], 2^63 bytes or more")
        for index, slot in self.allocations.items():
            place, shape, dtype = self.places[index], shapes[index], self.entry.buffers[index].type.dtype
            count = math.prod(shape)
            if slot[0] is None or count > slot[1]:
                if slot[0] is not None:
                    slot[0], old = None, slot[0]
                    place.free(old)
                slot[0], slot[1] = place.alloc((count,), dtype), count
            self.views[index] = place.view(slot[0], shape)

    def _transfer(self, src: int, dst: int) -> None:
        source, destination = self.views[src], self.views[dst]
        if isinstance(source, np.ndarray):  # from a host buffer: the device copies it straight in
            self.places[dst].copy_in(destination, source)
        elif isinstance(destination, np.ndarray):  # into a host buffer: straight out of the device
            self.places[src].copy_out_into(source, destination)
        else:  # between two devices' own memories: through the host
            self.places[dst].copy_in(destination, self.places[src].copy_out(source))

    def close(self) -> None:
        """Free the buffers this entry allocated (idempotent); the constants are `Constants.close`'s."""
        for index, slot in self.allocations.items():
            if slot[0] is not None:
                slot[0], buffer = None, slot[0]
                slot[1] = 0
                self.places[index].free(buffer)


def format_tensor(array: np.ndarray) -> str:
    """What `print` writes: each element as C's `%f` and a space, a newline after each row.

    A row is the last axis (a 1-D tensor is one row, a scalar a row of one); higher ranks print
    their rows in C order.
    """
    columns = array.shape[-1] if array.ndim else 1
    rows = array.reshape(math.prod(array.shape[:-1]), columns)
    return "".join("".join(f"{value:f} " for value in row) + "\n" for row in rows.tolist())
