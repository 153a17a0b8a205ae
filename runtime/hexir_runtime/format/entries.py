"""The meaning of an entry: its inputs, outputs and buffers, and its host program checked as a
dataflow (every buffer written once before it is read, of the type and on the device its use
needs); builds the frozen `Entry`."""

from __future__ import annotations

from typing import Any

from .fields import _choice, _fail, _identifier, _index, _list, _object, _tensor
from .layouts import id_sources
from .types import _COMMAND_TYPES, DEVICES, HOST, Buffer, Command, Constant, Entry, Kernel, TensorType

COMMANDS = {  # host program op -> its other fields
    "input": ("index", "dst"),
    "constant": ("constant", "dst"),
    "call": ("kernel", "args"),
    "transfer": ("src", "dst"),
    "print": ("src",),
    "return": ("srcs",),
}
_COMMAND_FIELDS = tuple(sorted({field for fields in COMMANDS.values() for field in fields}))


def _check_entry(entry: Any, path: str, constants: list[Constant], kernels: tuple[Kernel, ...],
                 previous: list[Entry]) -> Entry:
    _object(entry, path, ("name", "inputs", "outputs", "buffers", "program"))
    name = _identifier(entry["name"], f"{path}.name")
    if name in [other.name for other in previous]:
        _fail(f"{path}.name", f"a second entry named {name!r}")
    inputs: list[tuple[str, TensorType]] = []
    for i, spec in enumerate(_list(entry["inputs"], f"{path}.inputs")):
        tensor = _tensor(spec, f"{path}.inputs[{i}]", ("name",))
        input_name = _identifier(spec["name"], f"{path}.inputs[{i}].name")
        if input_name in [other for other, _ in inputs]:
            _fail(f"{path}.inputs[{i}].name", f"a second input named {input_name!r}")
        inputs.append((input_name, tensor))
    bound_symbols = {symbol for _, tensor in inputs for symbol in tensor.symbols}
    outputs = [_tensor(spec, f"{path}.outputs[{i}]")
               for i, spec in enumerate(_list(entry["outputs"], f"{path}.outputs"))]
    buffers = _Buffers(_list(entry["buffers"], f"{path}.buffers"), f"{path}.buffers")
    for what, tensors in (("outputs", outputs), ("buffers", buffers.types)):
        for i, tensor in enumerate(tensors):
            for symbol in tensor.symbols:
                if symbol not in bound_symbols:
                    _fail(f"{path}.{what}[{i}].shape", f"symbol {symbol!r} is bound by no input")
    bound = [False] * len(inputs)
    program = _list(entry["program"], f"{path}.program")
    commands: list[Command] = []
    for c, command in enumerate(program):
        where = f"{path}.program[{c}]"
        _object(command, where, ("op",), _COMMAND_FIELDS)
        op = _choice(command["op"], f"{where}.op", tuple(COMMANDS))
        _object(command, where, ("op", *COMMANDS[op]))
        if op == "input":
            i = _index(command["index"], f"{where}.index", len(inputs), "input")
            if bound[i]:
                _fail(f"{where}.index", f"input {i} is bound a second time")
            bound[i] = True
            buffers.write(command["dst"], f"{where}.dst", inputs[i][1], f"input {i}", HOST)
        elif op == "constant":
            k = _index(command["constant"], f"{where}.constant", len(constants), "constant")
            buffers.write(command["dst"], f"{where}.dst", constants[k].type, f"constant {k}")
        elif op == "call":
            k = _index(command["kernel"], f"{where}.kernel", len(kernels), "kernel")
            specs, device = kernels[k].args, kernels[k].device
            args = _list(command["args"], f"{where}.args")
            if len(args) != len(specs):
                _fail(f"{where}.args", f"kernels[{k}] takes {len(specs)} args, got {len(args)}")
            for j, (arg, spec) in enumerate(zip(args, specs, strict=True)):
                use = buffers.write if j == len(args) - 1 else buffers.read
                use(arg, f"{where}.args[{j}]", spec, f"kernels[{k}].args[{j}]", device)
        elif op == "transfer":
            src = buffers.read(command["src"], f"{where}.src")
            dst = buffers.write(command["dst"], f"{where}.dst", buffers.types[src], f"buffer {src}")
            if buffers.devices[src] == buffers.devices[dst]:
                _fail(where, f"a transfer between two buffers on {buffers.devices[src]} (it must change device)")
        elif op == "print":
            buffers.read(command["src"], f"{where}.src", None, "a printed buffer", HOST)
        elif c != len(program) - 1:
            _fail(where, "return must be the last command")
        else:
            srcs = _list(command["srcs"], f"{where}.srcs")
            if len(srcs) != len(outputs):
                _fail(f"{where}.srcs", f"returns {len(srcs)} values, but the entry has {len(outputs)} outputs")
            for j, src in enumerate(srcs):
                buffers.read(src, f"{where}.srcs[{j}]", outputs[j], f"output {j}", HOST)
        fields = {key: tuple(value) if isinstance(value, list) else value for key, value in command.items()}
        del fields["op"]
        commands.append(_COMMAND_TYPES[op](**fields))
    if not program or program[-1]["op"] != "return":
        _fail(f"{path}.program", "the last command must be a return")
    for i in range(len(inputs)):
        if not bound[i]:
            _fail(f"{path}.inputs[{i}]", "never bound by an input command")
    for i in range(len(buffers.types)):
        if not buffers.written[i]:
            _fail(f"{path}.buffers[{i}]", "never written")
    places = tuple(Buffer(tensor, device) for tensor, device in zip(buffers.types, buffers.devices, strict=True))
    checked = Entry(name, tuple(inputs), tuple(outputs), places, tuple(commands))
    id_sources(checked, kernels, f"{path}.program")  # a take's ids must come from where the runtime bounds them
    return checked


class _Buffers:
    """An entry's buffers while its program is checked: their types, devices, and which are written."""

    def __init__(self, specs: list[Any], path: str) -> None:
        self.types = [_tensor(spec, f"{path}[{i}]", ("device",)) for i, spec in enumerate(specs)]
        self.devices = [_choice(spec["device"], f"{path}[{i}].device", DEVICES) for i, spec in enumerate(specs)]
        self.written = [False] * len(specs)

    def read(self, value: Any, field: str, expected: TensorType | None = None, what: str = "",
             device: str | None = None) -> int:
        """Check a buffer a command reads (written before; of type `expected`, on `device` if given)."""
        return self._use(value, field, False, expected, what, device)

    def write(self, value: Any, field: str, expected: TensorType, what: str, device: str | None = None) -> int:
        """Check a buffer a command writes (not written before; of type `expected`, on `device` if given)."""
        return self._use(value, field, True, expected, what, device)

    def _use(self, value: Any, field: str, write: bool, expected: TensorType | None, what: str,
             device: str | None) -> int:
        index = _index(value, field, len(self.types), "buffer")
        if self.written[index] == write:
            _fail(field, f"buffer {index} is " + ("written a second time" if write else "read before it is written"))
        self.written[index] = True
        if expected is not None and self.types[index] != expected:
            _fail(field, f"buffer {index} is {self.types[index]} but {what} is {expected}")
        if device is not None and self.devices[index] != device:
            _fail(field, f"buffer {index} is on {self.devices[index]}, but {what} must be on {device}")
        return index
