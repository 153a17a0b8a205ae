"""Runs one entry's host program (docs/hxb-format.md, "entries") on a set of devices.

What can be done once is done in `Executor.__init__`: every buffer is allocated on its device
and constants are bound (uploaded once per module and device, by `Constants`). `run` then
walks the commands: bind inputs, launch kernels, transfer, print, and return fresh arrays.
`close` (and `Constants.close`) give the device memory back.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .device import Device, Program
from .format import Hxb


class Constants:
    """The module's weights, uploaded to a device the first time an entry binds them there."""

    def __init__(self, hxb: Hxb) -> None:
        self.hxb = hxb
        self.uploaded: dict[tuple[int, Device], Any] = {}

    def get(self, index: int, device: Device) -> Any:
        """The device buffer holding constants[index]."""
        if (index, device) not in self.uploaded:
            spec = self.hxb.manifest["constants"][index]
            array = np.frombuffer(self.hxb.blob(spec["blob"]), spec["dtype"]).reshape(spec["shape"])
            buffer = self.uploaded[index, device] = device.alloc(tuple(spec["shape"]), spec["dtype"])
            device.copy_in(buffer, array)
        return self.uploaded[index, device]

    def close(self) -> None:
        """Free every uploaded constant (idempotent)."""
        uploaded, self.uploaded = self.uploaded, {}
        for (_, device), buffer in uploaded.items():
            device.free(buffer)


class Executor:
    """One entry, ready to run: its buffers allocated, its constants bound."""

    def __init__(
        self, entry: dict[str, Any], devices: dict[str, Device], programs: list[Program], constants: Constants
    ) -> None:
        self.program = entry["program"]
        self.programs = programs  # by kernel index
        self.places = [devices[spec["device"]] for spec in entry["buffers"]]
        bound = {command["dst"]: command["constant"] for command in self.program if command["op"] == "constant"}
        self.buffers: list[Any] = []
        self.owned: list[tuple[Device, Any]] = []  # what close frees: all but the constants
        try:
            for i, (spec, place) in enumerate(zip(entry["buffers"], self.places, strict=True)):
                if i in bound:
                    self.buffers.append(constants.get(bound[i], place))
                else:
                    self.buffers.append(place.alloc(tuple(spec["shape"]), spec["dtype"]))
                    self.owned.append((place, self.buffers[-1]))
        except BaseException:
            self.close()
            raise

    def run(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Run the program on `arrays` (already checked against the signature); return the outputs."""
        buffers, places = self.buffers, self.places
        for command in self.program:
            op = command["op"]
            if op == "input":
                places[command["dst"]].copy_in(buffers[command["dst"]], arrays[command["index"]])
            elif op == "call":
                kernel = command["kernel"]
                self.programs[kernel].launch(kernel, [buffers[arg] for arg in command["args"]])
            elif op == "transfer":
                self._transfer(command["src"], command["dst"])
            elif op == "print":
                sys.stdout.write(format_tensor(places[command["src"]].copy_out(buffers[command["src"]])))
            elif op == "return":
                return [places[src].copy_out(buffers[src]) for src in command["srcs"]]
        raise AssertionError("a checked program ends with return")

    def _transfer(self, src: int, dst: int) -> None:
        source, destination = self.buffers[src], self.buffers[dst]
        if isinstance(source, np.ndarray):  # from a host buffer: the device copies it straight in
            self.places[dst].copy_in(destination, source)
        elif isinstance(destination, np.ndarray):  # into a host buffer: straight out of the device
            self.places[src].copy_out_into(source, destination)
        else:  # between two devices' own memories: through the host
            self.places[dst].copy_in(destination, self.places[src].copy_out(source))

    def close(self) -> None:
        """Free the buffers this entry allocated (idempotent); the constants are `Constants.close`'s."""
        owned, self.owned = self.owned, []
        for device, buffer in owned:
            device.free(buffer)


def format_tensor(array: np.ndarray) -> str:
    """What `print` writes: each element as C's `%f` and a space, a newline after each row.

    A row is the last axis (a 1-D tensor is one row, a scalar a row of one); higher ranks print
    their rows in C order.
    """
    columns = array.shape[-1] if array.ndim else 1
    rows = array.reshape(math.prod(array.shape[:-1]), columns)
    return "".join("".join(f"{value:f} " for value in row) + "\n" for row in rows.tolist())
