"""Runs one entry's host program (docs/hxb-format.md, "entries") on a set of devices.

What can be done once is done once. At load (`Executor.__init__`) constants are bound
(uploaded once per module and device, by `Constants`) and the program is analysed: which
inputs can be read in place, which outputs can stay on the GPU, which host buffers meet a GPU
(those are page-locked staging buffers). Per call shape (the inputs' shapes, and whether the
outputs stay on the device) a `Plan` is built the first time: buffers sized for it, and the
program as a list of steps bound to that shape's buffer views, with each kernel's launcher (its
arguments, or CUDA parameter block, built there). A repeated call shape then only looks its plan
up and runs the steps: no allocation, no size evaluation. A static entry is planned at load.
A plan of host kernels alone (no GPU, print or transfer) also gets `fast`: its kernels in one
foreign call (`_batched`), which the steps stand in for while another thread holds the pool.

Buffers are reused across calls: each keeps one flat allocation, and a plan views it with its
shape. An allocation grows (is replaced by a larger one) only when a call needs more elements
than it holds; that drops the plans, whose views it invalidates. A step whose destination has no
elements (batch 0) is left out: there is nothing to compute.

In place: a C-contiguous host input read only by host kernels is passed to them as it is (no
copy into its buffer); a CUDA input (DLPack) copied only to the GPU for GPU kernels is given to
them as it is (no host round trip). With `device=True`, an output that the program copies from
the GPU to the host stays on the GPU: the kernel that computes it writes a fresh device buffer
(`output`), which the call returns. A call passes the objects that replace buffers as `handles`
(one per input, then one per output; None: use the buffer), and a step's launcher gets them as
(argument position, object) overrides.

Outputs straight into the arrays returned: a host output of at least IN_PLACE_BYTES that one host
kernel writes (`host_outputs`) is written by it into a fresh array made for the call (or into the
caller's `out=` array, when that is C-contiguous and overlaps no input), never into a buffer of
the module: the caller owns what it is given, and no later call writes it. A copy of a big
output cost as much as a fast kernel (docs/tuning.md, "CPU linear with w known at run time").
The array made for the call is the one returned last for that output when the caller has let it
go (`_fresh`: nothing but the executor refers to it), so a loop that drops each result writes
memory that is faulted in already rather than a new mapping of a big array.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .cpu import CpuProgram, address
from .device import Device, Program, aligned_empty
from .dlpack import DeviceTensor
from .errors import DeviceError, InputError
from .format import Entry, Hxb, HxbFormatError, TensorType, numpy_dtype
from .format.layouts import id_sources, out_of_range

Step = Callable[[Sequence[Any], list[Any]], None]  # (the call's arrays, its handles)
# A host input smaller than this is copied into its buffer rather than read in place: numpy
# takes ~0.7 us to give an array's address, and copying 16 KiB into a buffer whose address the
# plan already holds costs about as much.
IN_PLACE_BYTES = 16 << 10
# A host input bound for the GPU at least this big is copied to it straight from the caller's
# (pageable) array, which the driver stages in pieces while it copies, rather than first copied
# whole into our page-locked buffer by one host thread and only then sent; an output as big
# comes back straight into the array returned (page-locked: CudaProgram.copy_out).
DIRECT_BYTES = 1 << 20
#: Whether a direct output is the array returned last for it, when nothing holds that any more.
RECYCLE = True
MAX_PLANS = 64  # call shapes kept; past that the cache starts again (a module called with ever new sizes)


def _references() -> tuple[int, int]:
    """sys.getrefcount of an aligned array that only a local name holds, and of its base (2 and 2
    in CPython 3.11-3.13; an interpreter that borrows references may count fewer)."""
    array = aligned_empty((1,), np.uint8)
    return sys.getrefcount(array), sys.getrefcount(array.base)


_UNHELD, _UNHELD_BASE = _references()


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


def bind(entry: Entry, shapes: Sequence[tuple[int, ...]]) -> dict[str, int]:
    """The sizes of the entry's symbols, from the shapes of its (dtype- and rank-checked)
    arguments; InputError if two inputs give one symbol different sizes."""
    sizes: dict[str, int] = {}
    where: dict[str, tuple[str, int]] = {}  # symbol -> the input and axis that bound it
    for (name, tensor), shape in zip(entry.inputs, shapes, strict=True):
        for axis, (dim, size) in enumerate(zip(tensor.shape, shape, strict=True)):
            if not isinstance(dim, str):
                continue
            if dim in sizes and sizes[dim] != size:
                first, first_axis = where[dim]
                raise InputError(f"{entry.name}(): input {name!r} has {dim} = {size} (axis {axis}), but input "
                                 f"{first!r} has {dim} = {sizes[dim]} (axis {first_axis})")
            sizes[dim], where[dim] = size, (name, axis)
    return sizes


class Plan:
    """The steps of one call shape, bound to that shape's buffer views."""

    def __init__(self, views: list[Any], steps: list[Step], outputs: list[tuple[int, Any, Any]], stages: bool,
                 direct: list[int]) -> None:
        self.views, self.steps = views, steps
        self.outputs = outputs  # per returned buffer: (handle index or -1, its view, who copies it out)
        self.stages = stages  # whether the host writes a staging buffer (an input bound for the GPU)
        self.direct = direct  # the outputs their kernel writes into the array returned (host_outputs, big)
        # a host program in one call (_batched), given the call's arrays and handles
        self.fast: Callable[[Sequence[np.ndarray], list[Any]], bool] | None = None


class Executor:
    """One entry, ready to run: its constants bound, its call shapes planned on first use."""

    def __init__(
        self, entry: Entry, devices: dict[str, Device], programs: list[Program], constants: Constants,
        prints: bool = True,
    ) -> None:
        self.entry = entry
        for buffer in entry.buffers:  # a bfloat16 one imports ml_dtypes (numpy's name for it), or says to install it
            numpy_dtype(buffer.type.dtype)
        self.prints = prints  # False: the program's print commands are left out of its plans
        self.programs = programs
        self.places = [devices[buffer.device] for buffer in entry.buffers]
        by_device = {program.device: program for program in programs if hasattr(program, "begin")}
        # Who copies to and from each buffer: a GPU program (on its stream), else the device.
        self.runners = [by_device.get(place, place) for place in self.places]
        self.gpus = list({id(r): r for r in self.runners if hasattr(r, "begin")}.values())
        # The stream DLPack producers are asked to make inputs ready on: the legacy default one
        # (DLPack's 1), which our streams wait for by themselves (they are blocking streams), and
        # where torch works by default, so that it needs no event either.
        self.stream = 1 if self.gpus else None
        # How a caller's CUDA tensor written on another stream is waited for (the first GPU's stream).
        self.wait = self.gpus[0].wait_for if self.gpus else None
        self.views: list[Any] = [None] * len(entry.buffers)  # each buffer, with the last plan's shape
        # Buffers to size per call: index -> [its flat allocation or None, its capacity in elements,
        # what allocates it, what frees it (a staging buffer's: the GPU's page-locked memory, `pinned`)].
        self.allocations: dict[int, list[Any]] = {}
        self.constants = {command.dst for command in entry.program if command.op == "constant"}
        self.returns: tuple[int, ...] = next((c.srcs for c in entry.program if c.op == "return"), ())
        self.plans: dict[tuple, Plan] = {}
        self.spares: dict[int, list[np.ndarray]] = {}  # per direct output, the array returned last (_fresh)
        # What each input must be, for the call's checks: its name, type, numpy dtype, and its
        # shape when it has no symbol (then one tuple comparison checks it).
        self.expected = [(name, tensor, numpy_dtype(tensor.dtype), None if tensor.symbols else tensor.shape)
                         for name, tensor in entry.inputs]
        self.returned = [(tensor, numpy_dtype(tensor.dtype), None if tensor.symbols else tensor.shape)
                         for tensor in entry.outputs]  # the same, for out= arrays
        for command in entry.program:
            if command.op == "constant":
                self.views[command.dst] = constants.get(command.constant, self.places[command.dst])
        self.ids = id_sources(entry, constants.hxb.manifest.kernels, f"{entry.name}()")  # checked per call
        for index, (rows, take) in self.ids.constants.items():
            constant = constants.hxb.manifest.constants[index]
            bad = out_of_range(np.frombuffer(constants.hxb.blob(constant.blob), constant.type.dtype), rows)
            if bad is not None:
                raise HxbFormatError(f"constants[{index}]", f"holds the id {bad[0]}, out of range for {take}'s "
                                                            f"table of {rows} rows")
        self._analyse()
        for index in range(len(entry.buffers)):
            if index not in self.constants:
                place = self.places[index]
                self.allocations[index] = [None, 0, *self.pinned.get(index, (place.alloc, place.free))]
        if not any(tensor.symbols for _, tensor in entry.inputs):
            try:  # static shapes: plan now, so that a module that cannot fit fails when it loads
                self._plan((tuple(tensor.shape for _, tensor in entry.inputs), False))
            except BaseException:
                self.close()
                raise

    def _analyse(self) -> None:
        """Which buffers are page-locked, which inputs are read in place, which outputs can stay on the GPU."""
        program, places = self.entry.program, self.places
        uses: dict[int, list[tuple[Any, str]]] = {index: [] for index in range(len(places))}
        for command in program:
            if command.op == "call":
                for position, arg in enumerate(command.args):
                    uses[arg].append((command, "write" if position == len(command.args) - 1 else "read"))
            elif command.op == "transfer":
                uses[command.src].append((command, "from"))
                uses[command.dst].append((command, "to"))
            elif command.op in ("print", "return"):
                for src in (command.srcs if command.op == "return" else (command.src,)):
                    uses[src].append((command, command.op))

        def gpu(index: int) -> bool:
            return hasattr(places[index], "alloc_pinned")

        def only_kernels(index: int, kinds: tuple[str, ...] = ("read",)) -> bool:
            return all(kind in kinds for _, kind in uses[index])

        self.pinned: dict[int, tuple] = {}  # host buffer -> the alloc and free of the GPU's staging memory
        for command in program:
            if command.op == "transfer" and gpu(command.src) != gpu(command.dst):
                host, device = (command.dst, command.src) if gpu(command.src) else (command.src, command.dst)
                self.pinned[host] = (places[device].alloc_pinned, places[device].free_pinned)
        self.host_inputs: dict[int, int] = {}  # input -> its buffer, read in place when it can be
        self.device_inputs: dict[int, int] = {}  # input -> its GPU buffer, a caller's CUDA tensor when given
        for command in program:
            if command.op != "input" or command.index in self.ids.inputs:  # (ids are checked on the host)
                continue
            dst = command.dst
            if not gpu(dst) and uses[dst] and only_kernels(dst):
                self.host_inputs[command.index] = dst
            elif len(uses[dst]) == 1 and uses[dst][0][1] == "from" and gpu(uses[dst][0][0].dst):
                target = uses[dst][0][0].dst
                if only_kernels(target, ("read", "to")):
                    self.device_inputs[command.index] = target
        self.device_outputs: dict[int, tuple[int, int]] = {}  # output -> (its host buffer, the GPU buffer)
        for position, src in enumerate(self.returns):
            copies = [command for command, kind in uses[src] if kind == "to"]
            if len(copies) == 1 and len(uses[src]) == 2 and self.returns.count(src) == 1 and gpu(copies[0].src):
                device = copies[0].src
                kinds = [kind for _, kind in uses[device]]
                if kinds.count("write") == 1 and kinds.count("from") == 1 and only_kernels(
                        device, ("read", "write", "from")) and device not in self.device_inputs.values():
                    self.device_outputs[position] = (src, device)
        self.host_outputs = [position for position, src in enumerate(self.returns)
                             if not gpu(src) and self.returns.count(src) == 1 and uses[src]
                             and [kind for _, kind in uses[src]].count("write") == 1
                             and only_kernels(src, ("read", "write", "return"))]

    def run(self, arrays: Sequence[Any], out: Sequence[np.ndarray] | None = None, device: bool = False) -> list[Any]:
        """Run the program on `arrays` (numpy arrays, or DeviceTensors for `device_inputs`; dtypes,
        ranks and static sizes already checked against the signature); return the outputs:
        fresh arrays, the arrays of `out`, or (`device`) GPU-resident DLPack arrays where the
        program computes them on the GPU."""
        for index, (rows, take) in self.ids.inputs.items():
            bad = out_of_range(arrays[index], rows)
            if bad is not None:
                raise InputError(f"{self.entry.name}(): input {self.entry.inputs[index][0]!r} holds the id {bad[0]} "
                                 f"at {list(bad[1])}, out of range for {take}'s table of {rows} rows")
        key = (tuple([array.shape for array in arrays]), device)
        plan = self.plans.get(key) or self._plan(key)
        handles: list[Any] = [None] * (len(arrays) + len(self.returns))
        for position in plan.direct:  # written by their kernel straight into what the call returns
            view = plan.outputs[position][1]
            given = out[position] if out is not None else None
            in_place = given is not None and given.shape == view.shape and _writable_in_place(given, arrays, out)
            try:
                handles[len(arrays) + position] = given if in_place else self._fresh(position, view) \
                    if out is None else None
            except MemoryError:
                raise self._no_memory_for(plan) from None
        if plan.fast is not None and plan.fast(arrays, handles):  # host memory: a copy is the view's
            return [self._result(position, plan, handles, arrays, out) for position in range(len(plan.outputs))]
        for gpu in self.gpus:
            gpu.begin()
            if gpu.staged and plan.stages:  # the last call returned without waiting for its copies
                gpu.synchronize()  # from the staging buffers that this call writes
        for index in self.host_inputs:
            array = arrays[index]
            if array.nbytes >= IN_PLACE_BYTES and array.flags.c_contiguous and array.flags.aligned:
                handles[index] = array
        for index in self.device_inputs:
            if isinstance(arrays[index], DeviceTensor):
                handles[index] = arrays[index]
        if device:
            for position in self.device_outputs:
                _, view, runner = plan.outputs[position]
                handles[len(arrays) + position] = runner.output(view.shape, view.dtype)
        for step in plan.steps:
            step(arrays, handles)
        return [self._result(position, plan, handles, arrays, out) for position in range(len(plan.outputs))]

    def _fresh(self, position: int, view: np.ndarray) -> np.ndarray:
        """A new array for direct output `position`, of `view`'s shape and dtype: the array this
        entry returned last for it when nothing holds that any more (the caller dropped it and
        every view of it, it has no weak reference, its shape, dtype and flags are as we made
        them), else a new one (64-byte aligned, as every host buffer: device.aligned_empty). Reused
        memory is mapped and faulted in already; a fresh big array is faulted page by page by the
        kernel that writes it (docs/tuning.md, "The user's call")."""
        spares = self.spares.setdefault(position, [])
        try:
            array = spares.pop()  # (one pop: another thread's call cannot take it too)
        except IndexError:
            array = None
        # (a view of it is a view of its base: numpy points views at the array owning the memory)
        if array is None or not RECYCLE or sys.getrefcount(array) > _UNHELD or weakref.getweakrefcount(array) \
                or sys.getrefcount(array.base) > _UNHELD_BASE \
                or array.shape != view.shape or array.dtype != view.dtype \
                or not (array.flags.writeable and array.flags.c_contiguous):
            array = aligned_empty(view.shape, view.dtype)
        spares.append(array)
        return array

    def _result(self, position: int, plan: Plan, handles: list[Any], arrays: Sequence[Any],
                out: Sequence[np.ndarray] | None) -> Any:
        """Output `position` of a call that has run: the array its kernel wrote, else the
        caller's `out` array (filled from its buffer here), else a copy of its buffer."""
        handle, view, runner = plan.outputs[position]
        if handle >= 0 and handles[handle] is not None:
            return handles[handle]
        if out is not None:
            return self._into(view, out, position, runner)
        try:
            return runner.copy_out(view)
        except MemoryError:
            raise self._no_memory_for(plan) from None

    def _no_memory_for(self, plan: Plan) -> DeviceError:
        """The error of a call whose returned arrays (fresh copies of the outputs) cannot be allocated."""
        return DeviceError(f"{self.entry.name}(): out of memory allocating the outputs returned, "
                           f"{sum(view.nbytes for _, view, _ in plan.outputs):,} bytes")

    def _into(self, view: Any, out: Sequence[np.ndarray], position: int, runner: Any) -> np.ndarray:
        """Copy output `position` (`view`) into the caller's `out[position]`, of its shape."""
        if out[position].shape != view.shape:
            raise InputError(f"{self.entry.name}(): out[{position}] has shape {out[position].shape}, "
                             f"this call's output {position} {view.shape}")
        runner.copy_out_into(view, out[position])
        return out[position]

    def _plan(self, key: tuple) -> Plan:
        """Size the buffers for the call shape `key` and bind the program's steps to their views."""
        shapes, device = key
        sizes = bind(self.entry, shapes)
        for length, rows, take in self.ids.argmaxes:
            if sizes.get(length, length) > rows:
                count = f"{length} = {sizes[length]}" if isinstance(length, str) else length
                raise InputError(f"{self.entry.name}(): the ids of {take} are an argmax over {count} values, but its "
                                 f"table has {rows} rows")
        try:
            grew = self._size_buffers(sizes)
        except BaseException:
            self.plans.clear()  # an allocation may have grown before another failed
            raise
        if grew or len(self.plans) >= MAX_PLANS:
            self.plans.clear()  # their views may be of freed allocations
        views, runners = list(self.views), self.runners
        inputs = len(self.entry.inputs)
        bound = {buffer: index for index, buffer in {**self.host_inputs, **self.device_inputs}.items()}
        skipped = set()  # transfers that device outputs make unnecessary
        # a big output the GPU computes comes back straight into the array returned (DIRECT_BYTES)
        sent_back = {position: gpu for position, (host, gpu) in self.device_outputs.items()
                     if not device and views[gpu].nbytes >= DIRECT_BYTES}
        for position, (host, gpu) in self.device_outputs.items():
            if device:
                bound[gpu] = inputs + position
            if device or position in sent_back:
                skipped.add(host)
        direct = [position for position in self.host_outputs if views[self.returns[position]].nbytes >= IN_PLACE_BYTES]
        for position in direct:
            bound[self.returns[position]] = inputs + position
        steps: list[Step] = []
        launches: list[tuple[Any, tuple, list[tuple[int, int]]]] = []  # (program, prepared launch, patches)
        for command in self.entry.program:
            op = command.op
            if op == "input":
                steps.append(_input(command.index, views[command.dst], runners[command.dst],
                                    command.index in self.device_inputs))
            elif op == "call":
                buffers = [views[arg] for arg in command.args]
                if not math.prod(buffers[-1].shape):  # an empty destination: nothing to compute
                    continue
                program = self.programs[command.kernel]
                if _unwrapped_cpu(program):  # its launch prepared once, for its step and for the batch
                    prepared = program.prepare(command.kernel, buffers, sizes)
                    go = program.launcher_of(prepared)
                else:
                    prepared, go = None, _launcher(program, command.kernel, buffers, sizes)
                if go is not None:
                    patches = [(position, bound[arg]) for position, arg in enumerate(command.args) if arg in bound]
                    steps.append(_call(go, patches))
                    if launches is not None and prepared:
                        launches.append((program, prepared, patches))
                    else:
                        launches = None
            elif op == "transfer" and command.dst not in skipped:
                launches = None
                source = next((index for index, gpu in self.device_inputs.items() if gpu == command.dst), None)
                steps.append(_transfer(views[command.src], views[command.dst], runners[command.src],
                                       runners[command.dst], source))
            elif op == "print" and self.prints:
                launches = None
                steps.append(_print(views[command.src], runners[command.src]))
        outputs = []
        for position, src in enumerate(self.returns):
            if device and position in self.device_outputs:
                gpu = self.device_outputs[position][1]
                outputs.append((inputs + position, views[gpu], runners[gpu]))
            elif position in sent_back:
                outputs.append((-1, views[sent_back[position]], runners[sent_back[position]]))
            elif position in direct:
                outputs.append((inputs + position, views[src], runners[src]))
            else:
                outputs.append((-1, views[src], runners[src]))
        stages = any(command.op == "input" and command.dst in self.pinned for command in self.entry.program)
        plan = self.plans[key] = Plan(views, steps, outputs, stages, direct)
        if launches and not self.gpus:
            plan.fast = _batched(launches, [(c.index, views[c.dst], runners[c.dst].copy_in)
                                            for c in self.entry.program if c.op == "input"],
                                 [(inputs + position, views[self.returns[position]]) for position in direct])
        return plan

    def _size_buffers(self, sizes: Mapping[str, int]) -> bool:
        """View every buffer with this call's shape, growing an allocation only if it is too
        small; whether any allocation changed."""
        shapes = {}
        for index in self.allocations:
            tensor: TensorType = self.entry.buffers[index].type
            shape = shapes[index] = tensor.concrete(sizes)
            if math.prod(shape) * tensor.itemsize >= 2**63:
                raise InputError(f"{self.entry.name}(): buffer {index} would be {tensor.dtype}"
                                 f"[{', '.join(map(str, shape))}], 2^63 bytes or more")
        grew = False
        for index, slot in self.allocations.items():
            shape, dtype = shapes[index], self.entry.buffers[index].type.dtype
            count = math.prod(shape)
            if slot[0] is None or count > slot[1]:
                if slot[0] is not None:
                    slot[0], old, slot[1] = None, slot[0], 0
                    slot[3](old)
                grew = True
                try:
                    slot[0], slot[1] = slot[2]((count,), dtype), count
                except (MemoryError, ValueError):  # numpy: "Unable to allocate", or "array is too big"
                    raise DeviceError(f"{self.entry.name}(): out of memory allocating {self._role(index)} "
                                      f"(buffer {index}), {dtype}[{', '.join(map(str, shape))}]: "
                                      f"{count * self.entry.buffers[index].type.itemsize:,} bytes") from None
            self.views[index] = self.places[index].view(slot[0], shape)
        return grew

    def _role(self, index: int) -> str:
        """What buffer `index` holds, for messages: "input 'x'", "output 0" or "an intermediate"."""
        if index in self.returns:
            return f"output {self.returns.index(index)}"
        inputs = {command.dst: command.index for command in self.entry.program if command.op == "input"}
        return f"input {self.entry.inputs[inputs[index]][0]!r}" if index in inputs else "an intermediate"

    def close(self) -> None:
        """Free the buffers this entry allocated (idempotent); the constants are `Constants.close`'s."""
        self.plans.clear()
        self.spares.clear()
        for slot in self.allocations.values():
            if slot[0] is not None:
                slot[0], buffer = None, slot[0]
                slot[1] = 0
                slot[3](buffer)


def _sent_directly(array: Any) -> bool:
    """Whether a host input bound for the GPU goes there straight from the caller's array."""
    return type(array) is np.ndarray and array.nbytes >= DIRECT_BYTES and array.flags.c_contiguous


def _input(index: int, view: Any, runner: Any, bound_for_gpu: bool) -> Step:
    def step(arrays: Sequence[Any], handles: list[Any]) -> None:
        # into its buffer, unless read in place or (bound for the GPU) sent from where it is
        if handles[index] is None and not (bound_for_gpu and _sent_directly(arrays[index])):
            runner.copy_in(view, arrays[index])
    return step


def _call(go: Callable[..., None], patches: list[tuple[int, int]]) -> Step:
    """Launch `go`, its arguments at `patches` (position, handle) given by the call where it gives
    them: a caller's array or CUDA tensor, our device output."""
    if not patches:
        return lambda arrays, handles: go(())

    def step(arrays: Sequence[Any], handles: list[Any]) -> None:
        go([(position, handles[h]) for position, h in patches if handles[h] is not None])
    return step


def _transfer(source: Any, destination: Any, src: Any, dst: Any, input_index: int | None) -> Step:
    """A copy between two devices' buffers: straight between a host buffer and a device, else
    through the host. The copy of an input to the GPU is skipped when the call gives a CUDA
    tensor (used in place), and made from the caller's array itself when that is big."""
    if isinstance(source, np.ndarray):
        def copy() -> None:
            dst.copy_in(destination, source)
    elif isinstance(destination, np.ndarray):
        def copy() -> None:
            src.copy_out_into(source, destination)
    else:
        def copy() -> None:
            dst.copy_in(destination, src.copy_out(source))
    if input_index is None:
        return lambda arrays, handles: copy()

    def step(arrays: Sequence[Any], handles: list[Any]) -> None:
        given = arrays[input_index]
        if _sent_directly(given):
            dst.copy_in(destination, given)
        elif handles[input_index] is None:
            copy()
    return step


def _batched(launches: list[tuple[CpuProgram, tuple, list[tuple[int, int]]]],
             inputs: list[tuple[int, np.ndarray, Callable]],
             outputs: list[tuple[int, np.ndarray]]) -> Callable[[Sequence[np.ndarray], list[Any]], bool] | None:
    """A host program's steps for one call shape in one foreign call (`CpuProgram.sequence`):
    the small inputs copied into their buffers, the others' addresses written into the launches'
    words where they are read in place, and those of the arrays the direct `outputs` (handle,
    buffer) are written into, then every kernel in order. It returns False, having run nothing,
    when another thread holds the pool; None: the program cannot be batched."""
    batch = launches[0][0].sequence([prepared for _, prepared, _ in launches])
    if batch is None:
        return None
    slots: dict[int, list[tuple[Any, int]]] = {}  # input -> where its address goes
    for (_, _, patches), words in zip(launches, batch.words, strict=True):
        for position, index in patches:
            slots.setdefault(index, []).append((words, position))
    steps = [(index, view, copy, slots.get(index, []) if view.nbytes >= IN_PLACE_BYTES else [], view.ctypes.data)
             for index, view, copy in inputs]
    written = [(handle, slots.get(handle, []), view.ctypes.data) for handle, view in outputs]

    def run(arrays: Sequence[np.ndarray], handles: list[Any]) -> bool:
        for index, view, copy, places, at in steps:
            array = arrays[index]
            if places and array.flags.c_contiguous and array.flags.aligned:
                at = address(array)  # read in place
            else:
                copy(view, array)
            for words, position in places:
                words[position] = at
        for handle, places, at in written:
            given = handles[handle]
            at = address(given) if given is not None else at
            for words, position in places:
                words[position] = at
        return batch.run()
    return run


def _writable_in_place(array: np.ndarray, arrays: Sequence[Any], out: Sequence[np.ndarray]) -> bool:
    """Whether a caller's `out=` array can be written by its kernel: C-contiguous and aligned, and
    sharing no memory with an input (which a kernel may still read) or another output."""
    return array.flags.c_contiguous and array.flags.aligned and not any(
        np.may_share_memory(array, other) for other in (*arrays, *out)
        if other is not array and isinstance(other, np.ndarray))


def _print(view: Any, runner: Any) -> Step:
    return lambda arrays, handles: sys.stdout.write(format_tensor(runner.copy_out(view)))


def _launcher(program: Program, kernel: int, buffers: list[Any],
              sizes: Mapping[str, int]) -> Callable[[Sequence[tuple[int, Any]]], None] | None:
    """A function running kernels[kernel] on `buffers` for these `sizes`, given per-call
    (argument position, array) overrides; None when there is nothing to run. (A CpuProgram's own
    launcher is `_plan`'s business; one whose launch a caller wrapped goes through `launch`.)"""
    make = getattr(program, "launcher", None)
    if make is not None and not isinstance(program, CpuProgram):
        return make(kernel, buffers, sizes)

    def launch(overrides: Sequence[tuple[int, Any]] = ()) -> None:
        arguments = list(buffers)
        for position, array in overrides:
            arguments[position] = array
        program.launch(kernel, arguments, sizes)
    return launch


def _unwrapped_cpu(program: Program) -> bool:
    """A CpuProgram whose `launch` no caller wrapped (tests count launches that way)."""
    return isinstance(program, CpuProgram) and "launch" not in vars(program)


def format_tensor(array: np.ndarray) -> str:
    """What `print` writes: each element as C's `%f` (an int64 one as `%d`) and a space, a
    newline after each row.

    A row is the last axis (a 1-D tensor is one row, a scalar a row of one); higher ranks print
    their rows in C order.
    """
    columns = array.shape[-1] if array.ndim else 1
    rows = array.reshape(math.prod(array.shape[:-1]), columns)
    spec = "d" if array.dtype.kind == "i" else "f"
    return "".join("".join(f"{value:{spec}} " for value in row) + "\n" for row in rows.tolist())
