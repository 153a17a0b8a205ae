"""The runtime's CUDA device, driven through a fake `cuda.bindings.driver` (no GPU needed).

`FakeDriver` stands in for cuda-python's driver module: it answers the calls the runtime makes
with the same tuples (`(CUresult, value...)`), keeps device memory in host bytearrays keyed by
fake device pointers, loads images the way the driver does (a CUBIN only on its own major
version at an equal or lower minor, PTX only NUL-terminated and not above the GPU, a fatbin
as it is), and "executes" a launch by decoding `kernelParams` (an array of `void*`, each
pointing at a device pointer, then, for a custom kernel, at each int64 dimension) and
computing the kernel's op in numpy on the bytes those pointers name (a custom kernel: the
Python function the test gives in `custom_code`). So a module
compiled by the real compiler runs end to end through `CudaDevice`, and a wrong pointer, order
or size gives wrong numbers or a driver error; each launch's geometry is recorded and compared
with the manifest's (whether that geometry covers the output is the compiler tests' business,
tests/compiler/test_cuda_codegen.py). Like the real driver, the fake tracks the current context
per thread.

The modules are compiled by hexir (its CUBIN/PTX need ptxas); tests that need them skip where
MLIR is not installed.
"""

from __future__ import annotations

import ctypes
import enum
import gc
import json
import math
import re
import struct
import sys
import threading
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import hexir_runtime
import hexir_runtime.cuda
import hexir_runtime.module
import numpy as np
import pytest
from hexir_runtime import DeviceError, HexirRuntimeError, KernelError, load
from hexir_runtime import format as hxb
from hexir_runtime.cli import main as hexir_run
from hexir_runtime.cuda import PINNED_RESULT_BYTES, SPARE_OUTPUTS, SPARE_SIZES, CudaDevice, pick_image
from hexir_runtime.device import HostMemory
from hexir_runtime.executor import DIRECT_BYTES
from hexir_runtime.format import scalars

# ---- the fake driver ----------------------------------------------------------------------


FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_IMAGE = 200
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209
    CUDA_ERROR_INVALID_PTX = 218
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_LAUNCH_FAILED = 719


ERROR_STRINGS = {  # as the real driver's cuGetErrorString spells them
    CUresult.CUDA_SUCCESS: b"no error",
    CUresult.CUDA_ERROR_INVALID_VALUE: b"invalid argument",
    CUresult.CUDA_ERROR_OUT_OF_MEMORY: b"out of memory",
    CUresult.CUDA_ERROR_NOT_INITIALIZED: b"initialization error",
    CUresult.CUDA_ERROR_NO_DEVICE: b"no CUDA-capable device is detected",
    CUresult.CUDA_ERROR_INVALID_DEVICE: b"invalid device ordinal",
    CUresult.CUDA_ERROR_INVALID_IMAGE: b"device kernel image is invalid",
    CUresult.CUDA_ERROR_INVALID_CONTEXT: b"invalid device context",
    CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU: b"no kernel image is available for execution on the device",
    CUresult.CUDA_ERROR_INVALID_PTX: b"a PTX JIT compilation failed",
    CUresult.CUDA_ERROR_INVALID_HANDLE: b"invalid resource handle",
    CUresult.CUDA_ERROR_NOT_FOUND: b"named symbol not found",
    CUresult.CUDA_ERROR_ILLEGAL_ADDRESS: b"an illegal memory access was encountered",
    CUresult.CUDA_ERROR_LAUNCH_FAILED: b"unspecified launch failure",
}


class CUdevice_attribute(enum.IntEnum):
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


class CUfunction_attribute(enum.IntEnum):
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class Handle:
    """An opaque driver object (CUdevice, CUcontext, CUmodule, CUfunction, CUdeviceptr)."""

    def __init__(self, kind: str, value: int, **details: Any) -> None:
        self.kind, self.value, self.details = kind, value, details

    def __int__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"<{self.kind} {self.value:#x}>"


def cubin_arch(image: bytes) -> int:
    """The SM number of a CUBIN, from e_flags as LLVM's getNVPTXCPUName reads it: the low byte
    under ELF ABI version 7, bits 8-15 under version 8 (what CUDA 12.8+ ptxas writes)."""
    flags = struct.unpack_from("<I", image, 48)[0]
    return flags & 0xFF if image[8] == 7 else (flags >> 8) & 0xFF


def elf_functions(image: bytes) -> set[str]:
    """The names of the STT_FUNC symbols of a 64-bit little-endian ELF."""
    shoff = struct.unpack_from("<Q", image, 40)[0]
    shentsize, shnum = struct.unpack_from("<HH", image, 58)
    sections = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        strings = sections[link][4]
        for start in range(offset, offset + size, entsize):
            name, info = struct.unpack_from("<IB", image, start)
            if info & 0xF == 2:  # STT_FUNC
                end = image.index(b"\0", strings + name)
                names.add(image[strings + name:end].decode())
    return names


def one_call_at_a_time(cls: type) -> type:
    """Runs each of the class's driver calls (`cu*`) and helpers on its state under the
    instance's re-entrant `lock`, as the real driver is thread-safe: 8 threads calling a module
    at once must not see a half-made allocation (two blocks at one address) nor a dict changing
    size under `_memory`'s walk. (Re-entrant: an asynchronous call runs its synchronous twin, and a
    garbage collection inside a call may run an output's finalizer, which frees it.)"""
    def locked(method: Any) -> Any:
        def call(self: Any, *args: Any, **keys: Any) -> Any:
            with self.lock:
                return method(self, *args, **keys)
        call.__name__, call.__doc__ = method.__name__, method.__doc__
        return call
    for name, method in list(vars(cls).items()):
        if callable(method) and (name.startswith("cu") or name in cls.LOCKED_HELPERS):
            setattr(cls, name, locked(method))
    return cls


@one_call_at_a_time
class FakeDriver:
    """What the runtime sees of `cuda.bindings.driver`, for one fake GPU (thread-safe: see
    `one_call_at_a_time`; tests read its records after their threads have ended)."""

    CUresult = CUresult
    CUdevice_attribute = CUdevice_attribute
    CUfunction_attribute = CUfunction_attribute
    LOCKED_HELPERS = ("know", "_enter", "_memory", "_on", "is_pinned")

    def __init__(self, capability: tuple[int, int] = (9, 0), count: int = 1, name: bytes = b"NVIDIA FakeGPU",
                 memory: int = 1 << 30) -> None:
        self.capability, self.count, self.gpu_name, self.memory = capability, count, name, memory
        self.fail: dict[str, CUresult] = {}        # call name -> the error it returns
        self.init_raises: Exception | None = None  # what cuInit raises (cuda-python without libcuda)
        self.kernels: dict[str, dict] = {}         # symbol -> its manifest kernel (the op the code computes)
        self.custom_code: dict[str, Any] = {}      # symbol -> f(arrays, scalars), a custom kernel's "code"
        self.calls: list[str] = []
        self.allocations: dict[int, bytearray] = {}
        self.loaded: list[bytes] = []              # images given to cuModuleLoadData
        self.modules: set[int] = set()             # the CUmodules loaded and not unloaded yet
        self.copies_in: list[tuple[int, bytes]] = []
        self.launches: list[dict] = []
        self.initialized = False
        self.streams: set[int] = set()             # the CUstreams created and not destroyed
        self.events: set[int] = set()
        self.on_stream: list[tuple[str, int]] = []  # (call, the stream it was queued on)
        self.pinned: dict[int, Any] = {}           # page-locked host memory by address
        self.pageable_copies = 0                   # asynchronous copies from or to pageable memory
        self._next_handle = 0x5000
        self._next_pointer = 0x7F00_0000_0000
        self._context = Handle("CUcontext", 0xC0)
        self._current = threading.local()
        self.lock = threading.RLock()  # every driver call holds it (see one_call_at_a_time)

    def know(self, path: Path) -> None:
        """Learn what each CUDA kernel of a module computes (the fake GPU's 'machine code')."""
        for kernel in hxb.read(path).json["kernels"]:
            self.kernels[kernel["symbol"]] = kernel
            for variant in kernel.get("variants", []):  # the same computation, in other tiles
                self.kernels[variant["symbol"]] = kernel

    def _enter(self, call: str, needs_context: bool = True) -> CUresult:
        self.calls.append(call)
        if call in self.fail:
            return self.fail[call]
        if call != "cuInit" and not self.initialized:
            return CUresult.CUDA_ERROR_NOT_INITIALIZED
        if needs_context and getattr(self._current, "context", None) is not self._context:
            return CUresult.CUDA_ERROR_INVALID_CONTEXT
        return CUresult.CUDA_SUCCESS

    def _memory(self, pointer: Any, size: int) -> memoryview | None:
        """The `size` bytes of device memory at `pointer`, or None if they are not allocated."""
        address = int(pointer)
        # a copy to walk: a garbage collection during the walk may run a finalizer that frees
        # a block on this very thread (the lock is re-entrant), changing the dict under it
        for base, block in self.allocations.copy().items():
            if base <= address and address + size <= base + len(block):
                return memoryview(block)[address - base:address - base + size]
        return None

    def cuGetErrorString(self, status: CUresult) -> tuple:
        return CUresult.CUDA_SUCCESS, ERROR_STRINGS[status]

    def cuInit(self, flags: int) -> tuple:
        if self.init_raises is not None:
            raise self.init_raises
        status = self._enter("cuInit", needs_context=False)
        self.initialized = status == CUresult.CUDA_SUCCESS
        return (status,)

    def cuDeviceGetCount(self) -> tuple:
        return self._enter("cuDeviceGetCount", needs_context=False), self.count

    def cuDeviceGet(self, ordinal: int) -> tuple:
        status = self._enter("cuDeviceGet", needs_context=False)
        if status == CUresult.CUDA_SUCCESS and not 0 <= ordinal < self.count:
            status = CUresult.CUDA_ERROR_INVALID_DEVICE
        return status, Handle("CUdevice", ordinal)

    def cuDeviceGetAttribute(self, attribute: CUdevice_attribute, device: Handle) -> tuple:
        status = self._enter("cuDeviceGetAttribute", needs_context=False)
        major, minor = self.capability
        return status, major if attribute == CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR else minor

    def cuDeviceGetName(self, length: int, device: Handle) -> tuple:
        return self._enter("cuDeviceGetName", needs_context=False), self.gpu_name.ljust(length, b"\0")[:length]

    def cuDevicePrimaryCtxRetain(self, device: Handle) -> tuple:
        return self._enter("cuDevicePrimaryCtxRetain", needs_context=False), self._context

    def cuCtxSetCurrent(self, context: Handle) -> tuple:
        status = self._enter("cuCtxSetCurrent", needs_context=False)
        if status == CUresult.CUDA_SUCCESS:
            self._current.context = context
        return (status,)

    def cuMemAlloc(self, size: int, call: str = "cuMemAlloc") -> tuple:
        status = self._enter(call)
        if status != CUresult.CUDA_SUCCESS:
            return status, None
        if size <= 0:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        if sum(map(len, self.allocations.values())) + size > self.memory:
            return CUresult.CUDA_ERROR_OUT_OF_MEMORY, None
        pointer = self._next_pointer
        self._next_pointer += (size + 511) // 256 * 256  # aligned, with a gap between blocks
        self.allocations[pointer] = bytearray(size)
        return status, Handle("CUdeviceptr", pointer)

    def cuMemFree(self, pointer: Any, call: str = "cuMemFree") -> tuple:
        status = self._enter(call)
        if status == CUresult.CUDA_SUCCESS and self.allocations.pop(int(pointer), None) is None:
            status = CUresult.CUDA_ERROR_INVALID_VALUE
        return (status,)

    def cuMemcpyHtoD(self, destination: Any, source: int, size: int, call: str = "cuMemcpyHtoD") -> tuple:
        status = self._enter(call)
        memory = self._memory(destination, size)
        if status == CUresult.CUDA_SUCCESS and memory is None:
            status = CUresult.CUDA_ERROR_INVALID_VALUE
        if status == CUresult.CUDA_SUCCESS:
            target = (ctypes.c_char * size).from_buffer(memory)
            ctypes.memmove(ctypes.addressof(target), int(source), size)
            del target
            self.copies_in.append((int(destination), bytes(memory)))
        return (status,)

    def cuMemcpyDtoH(self, destination: int, source: Any, size: int, call: str = "cuMemcpyDtoH") -> tuple:
        status = self._enter(call)
        memory = self._memory(source, size)
        if status == CUresult.CUDA_SUCCESS and memory is None:
            status = CUresult.CUDA_ERROR_INVALID_VALUE
        if status == CUresult.CUDA_SUCCESS:
            origin = (ctypes.c_char * size).from_buffer(memory)
            ctypes.memmove(int(destination), ctypes.addressof(origin), size)
            del origin
        return (status,)

    def cuModuleLoadData(self, image: bytes) -> tuple:
        status = self._enter("cuModuleLoadData")
        if status != CUresult.CUDA_SUCCESS:
            return status, None
        image = bytes(image)
        self.loaded.append(image)
        gpu = self.capability[0] * 10 + self.capability[1]
        if image.startswith(FATBIN_MAGIC):  # the real driver picks the image inside; here, any .entry
            symbols = {name.decode() for name in re.findall(rb"\.entry (\w+)\(", image)}
        elif image.startswith(b"\x7fELF"):
            if struct.unpack_from("<H", image, 18)[0] != 190:  # EM_CUDA
                return CUresult.CUDA_ERROR_INVALID_IMAGE, None
            arch = cubin_arch(image)
            if arch // 10 != gpu // 10 or arch > gpu:
                return CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU, None
            symbols = elf_functions(image)
        else:
            target = re.search(rb"^\.target sm_(\d+)", image, re.MULTILINE)
            if not image.endswith(b"\0") or target is None:  # the driver reads PTX as a C string
                return CUresult.CUDA_ERROR_INVALID_PTX, None
            if int(target.group(1)) > gpu:
                return CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU, None
            symbols = {name.decode() for name in re.findall(rb"\.entry (\w+)\(", image)}
        self.modules.add(len(self.loaded))
        return status, Handle("CUmodule", len(self.loaded), symbols=symbols)

    def cuModuleUnload(self, module: Handle) -> tuple:
        status = self._enter("cuModuleUnload")
        if status == CUresult.CUDA_SUCCESS and int(module) not in self.modules:
            status = CUresult.CUDA_ERROR_INVALID_HANDLE
        self.modules.discard(int(module))
        return (status,)

    def cuModuleGetFunction(self, module: Handle, name: bytes) -> tuple:
        status = self._enter("cuModuleGetFunction")
        if status == CUresult.CUDA_SUCCESS and name.decode() not in module.details["symbols"]:
            status = CUresult.CUDA_ERROR_NOT_FOUND
        return status, Handle("CUfunction", id(name), name=name.decode())

    def cuFuncSetAttribute(self, function: Handle, attribute: CUfunction_attribute, value: int) -> tuple:
        status = self._enter("cuFuncSetAttribute")
        if status == CUresult.CUDA_SUCCESS:
            function.details[attribute.name] = value
        return (status,)

    def cuLaunchKernel(self, function: Handle, grid_x: int, grid_y: int, grid_z: int, block_x: int, block_y: int,
                       block_z: int, shared: int, stream: Any, params: int, extra: Any) -> tuple:
        status = self._enter("cuLaunchKernel")
        if status != CUresult.CUDA_SUCCESS:
            return (status,)
        shared_limit = function.details.get("CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", 48 * 1024)
        if block_x * block_y * block_z > 1024 or shared > shared_limit or min(grid_x, grid_y, grid_z) < 1:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        kernel = self.kernels[function.details["name"]]
        # kernelParams: void*[n], each pointing at the argument's value: the device pointers,
        # then the kernel's sizes (a custom kernel's dimensions) as int64s
        count = len(kernel["args"])
        names = kernel["scalars"] if kernel["op"] == "custom" else kernel["sizes"]
        slots = (ctypes.c_void_p * (count + len(names))).from_address(params)
        pointers = [ctypes.c_void_p.from_address(slot).value for slot in slots[:count]]
        scalars = [ctypes.c_int64.from_address(slot).value for slot in slots[count:]]
        sizes = {name: value for name, value in zip(names, scalars, strict=True) if isinstance(name, str)}
        arrays = []
        for pointer, arg in zip(pointers, kernel["args"], strict=True):
            shape = [sizes[dim] if isinstance(dim, str) else dim for dim in arg["shape"]]
            itemsize = np.dtype(arg["dtype"]).itemsize
            memory = self._memory(pointer or 0, max(math.prod(shape) * itemsize, 1))
            if memory is None:
                return (CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,)
            arrays.append(np.frombuffer(memory, arg["dtype"], math.prod(shape)).reshape(shape))
        self.on_stream.append(("cuLaunchKernel", int(stream) if stream is not None else 0))
        self.launches.append({"kernel": kernel["symbol"], "symbol": function.details["name"], "params": params,
                              "grid": (grid_x, grid_y, grid_z),
                              "block": (block_x, block_y, block_z), "shared": shared, "pointers": pointers,
                              "scalars": scalars, "inputs": [array.copy() for array in arrays[:-1]]})
        if kernel["op"] == "custom":
            self.custom_code[kernel["symbol"]](arrays, scalars)
        else:
            _execute(kernel["op"], kernel["expr"], arrays)
        return (status,)

    def cuCtxSynchronize(self) -> tuple:
        return (self._enter("cuCtxSynchronize"),)

    # streams, events, page-locked memory and asynchronous copies: the fake runs everything at
    # once, so it only checks the handles and records which stream each call used.

    def _on(self, call: str, stream: Any) -> CUresult:
        status = self._enter(call)
        value = int(stream) if stream is not None else 0
        if status == CUresult.CUDA_SUCCESS and value not in self.streams | {0, 1, 2}:
            return CUresult.CUDA_ERROR_INVALID_HANDLE
        self.on_stream.append((call, value))
        return status

    def cuStreamCreate(self, flags: int) -> tuple:
        status = self._enter("cuStreamCreate")
        self._next_handle += 1
        self.streams.add(self._next_handle)
        return status, Handle("CUstream", self._next_handle)

    def cuStreamDestroy(self, stream: Handle) -> tuple:
        status = self._on("cuStreamDestroy", stream)
        self.streams.discard(int(stream))
        return (status,)

    def cuStreamSynchronize(self, stream: Handle) -> tuple:
        return (self._on("cuStreamSynchronize", stream),)

    def cuEventCreate(self, flags: int) -> tuple:
        self._next_handle += 1
        self.events.add(self._next_handle)
        return self._enter("cuEventCreate"), Handle("CUevent", self._next_handle)

    def cuEventDestroy(self, event: Handle) -> tuple:
        self.events.discard(int(event))
        return (self._enter("cuEventDestroy"),)

    def cuEventRecord(self, event: Handle, stream: Handle) -> tuple:
        return (self._on("cuEventRecord", stream),)

    def cuStreamWaitEvent(self, stream: Any, event: Handle, flags: int) -> tuple:
        status = self._on("cuStreamWaitEvent", stream)
        return (status if int(event) in self.events else CUresult.CUDA_ERROR_INVALID_HANDLE,)

    def cuMemHostAlloc(self, size: int, flags: int) -> tuple:
        status = self._enter("cuMemHostAlloc")
        memory = ctypes.create_string_buffer(size)
        self.pinned[ctypes.addressof(memory)] = memory
        return status, ctypes.addressof(memory)

    def cuMemFreeHost(self, pointer: int) -> tuple:
        status = self._enter("cuMemFreeHost")
        return (status if self.pinned.pop(int(pointer), None) is not None else CUresult.CUDA_ERROR_INVALID_VALUE,)

    def is_pinned(self, address: int, size: int) -> bool:
        return any(base <= address and address + size <= base + len(memory)
                   for base, memory in self.pinned.copy().items())

    def cuMemcpyHtoDAsync(self, destination: Any, source: int, size: int, stream: Any) -> tuple:
        self.on_stream.append(("cuMemcpyHtoDAsync", int(stream)))
        self.pageable_copies += not self.is_pinned(int(source), size)
        return self.cuMemcpyHtoD(destination, source, size, "cuMemcpyHtoDAsync")

    def cuMemcpyDtoHAsync(self, destination: int, source: Any, size: int, stream: Any) -> tuple:
        self.on_stream.append(("cuMemcpyDtoHAsync", int(stream)))
        self.pageable_copies += not self.is_pinned(int(destination), size)
        return self.cuMemcpyDtoH(destination, source, size, "cuMemcpyDtoHAsync")

    def cuMemAllocAsync(self, size: int, stream: Any) -> tuple:
        self.on_stream.append(("cuMemAllocAsync", int(stream)))
        return self.cuMemAlloc(size, "cuMemAllocAsync")

    def cuMemFreeAsync(self, pointer: Any, stream: Any) -> tuple:
        self.on_stream.append(("cuMemFreeAsync", int(stream)))
        return self.cuMemFree(pointer, "cuMemFreeAsync")


def _execute(op: str, expr: Any, arrays: list[np.ndarray]) -> None:
    """What the kernel computes, from its manifest `op` and `expr` (the scalar language's numpy
    meaning), in float64 then stored in its dtype: a pointwise tree over its inputs, or a linear's
    tree over x @ w and its epilogue inputs."""
    *inputs, out = (array.astype(np.float64) for array in arrays)
    assert op in ("pointwise", "linear"), op
    operands = inputs if op == "pointwise" else [inputs[0] @ inputs[1], *inputs[2:]]
    arrays[-1][...] = scalars.evaluate(expr, operands, "float64")


# ---- fixtures -----------------------------------------------------------------------------

rng = np.random.default_rng(7)
W = rng.standard_normal((5, 7)).astype(np.float32)
B = rng.standard_normal(7).astype(np.float32)
W64 = rng.standard_normal((11, 33))


@pytest.fixture
def fake(monkeypatch) -> FakeDriver:
    """A fake GPU of compute capability 9.0, plugged in as the runtime's driver."""
    driver = FakeDriver()
    monkeypatch.setattr(hexir_runtime.cuda, "_driver", lambda: driver)
    monkeypatch.setattr(hexir_runtime.module, "_cuda_devices", [])
    return driver


@pytest.fixture
def no_cuda_python(monkeypatch) -> None:
    """A machine without cuda-python: importing it fails."""
    monkeypatch.setattr(hexir_runtime.module, "_cuda_devices", [])
    monkeypatch.setattr(hexir_runtime.module, "has_cuda_driver", lambda: True)  # a driver, but no cuda-python
    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver"):
        monkeypatch.setitem(sys.modules, name, None)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, Path]:
    """Modules compiled by hexir with their linear and relu on cuda (CUBIN sm_90 + PTX)."""
    try:
        import hexir
    except ImportError as error:  # no MLIR, or a compiler in the middle of a change
        pytest.skip(f"compiling the test modules needs hexir and MLIR ({error})")
    directory = tmp_path_factory.mktemp("cuda-modules")

    def mlp(x):
        y = hexir.relu(hexir.linear(x, W, B))  # one kernel: the relu is fused into the linear
        hexir.print(y)
        return y

    def apart(x):
        y = hexir.linear(x, W, B)
        return y, hexir.relu(y)  # the linear's result is returned too: its relu stays a second kernel

    def wide(x):
        return hexir.linear(x, W64)

    def relu(x):
        return hexir.relu(x)

    def constants_only():
        return hexir.linear(W.T.copy(), W)

    try:
        modules = _export_all(hexir, directory, mlp, apart, wide, relu, constants_only)
        if "cuda" not in hxb.read(modules["mlp"]).json:  # checked at load, not by the reader
            raise hxb.HxbFormatError("cuda", "no kernel table: built by an older compiler?")
        return modules
    except hxb.HxbFormatError as error:  # a compiler that does not write this runtime's format (yet)
        pytest.skip(f"the compiler's modules do not pass this runtime's format checks: {error}")


def _export_all(hexir: Any, directory: Path, mlp: Any, apart: Any, wide: Any, relu: Any,
                constants_only: Any) -> dict[str, Path]:
    spec = hexir.TensorSpec
    both = {"hexir.linear": "cuda", "hexir.relu": "cuda"}
    modules = {
        "mlp": hexir.export(mlp, directory / "mlp.hxb", spec((3, 5), "float32"), placement=both),
        "mlp_two_archs": hexir.export(mlp, directory / "mlp2.hxb", spec((3, 5), "float32"), placement=both,
                                      target="cuda:sm_80,cuda:sm_90"),
        "apart_two_archs": hexir.export(apart, directory / "apart2.hxb", spec((3, 5), "float32"), placement=both,
                                        target="cuda:sm_80,cuda:sm_90"),
        "wide": hexir.export(wide, directory / "wide.hxb", spec((37, 11), "float64"), placement=both),
        "relu": hexir.export(relu, directory / "relu.hxb", spec((2, 3, 67), "float32"), placement=both),
        "rows_relu": hexir.export(relu, directory / "rows_relu.hxb", spec(("batch", 1024), "float32"),
                                  placement=both),
        "constants_only": hexir.export(constants_only, directory / "constants.hxb", placement=both),
    }
    return modules


W_TILED = rng.standard_normal((64, 1024)).astype(np.float32)


@pytest.fixture(scope="module")
def tiled(tmp_path_factory) -> Path:
    """`main(x: float32[batch, 64]) -> x @ W_TILED` on cuda: a kernel per tile size, the runtime
    picking one per call from the batch (the manifest's `variants`, then the kernel itself)."""
    try:
        import hexir
    except ImportError as error:
        pytest.skip(f"compiling the test module needs hexir and MLIR ({error})")
    path = tmp_path_factory.mktemp("cuda-tiled") / "tiled.hxb"
    return hexir.export(lambda x: hexir.linear(x, W_TILED), path, hexir.TensorSpec(("batch", 64), "float32"),
                        placement={"hexir.linear": "cuda"})


@pytest.fixture
def module_file(compiled, fake) -> Any:
    """`module_file(name)`: the path of a compiled module, its kernels taught to the fake GPU."""

    def get(name: str) -> Path:
        fake.know(compiled[name])
        return compiled[name]

    return get


def linear_numpy(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float64) @ W + B


def mlp_numpy(x: np.ndarray) -> np.ndarray:
    return np.maximum(linear_numpy(x), 0)


def x_of(shape: tuple[int, ...], dtype: str = "float32", seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def reencoded(path: Path, edit) -> bytes:
    """The module at `path` with `edit(manifest)` applied, written again by the format's encoder;
    a renamed cuda kernel is renamed in the cuda kernel table too (its image still lacks it)."""
    module = hxb.read(path)
    manifest = {key: value for key, value in module.json.items() if key != "blobs"}
    blobs = [(blob["name"], bytes(module.blob(i))) for i, blob in enumerate(module.json["blobs"])]
    symbols = [kernel.get("symbol") for kernel in manifest["kernels"]]
    edit(manifest)
    if "cuda" in manifest:
        renamed = {old: kernel["symbol"] for old, kernel in zip(symbols, manifest["kernels"], strict=False)}
        name, table = blobs[manifest["cuda"]["table"]]
        kernels = [{**entry, "symbol": renamed.get(entry["symbol"], entry["symbol"])}
                   for entry in json.loads(table)["kernels"]]
        blobs[manifest["cuda"]["table"]] = (name, json.dumps({"kernels": kernels}).encode())
    return hxb.encode(manifest, blobs)


# ---- opening the device: every failure names its cause ----------------------------------------


def test_without_cuda_python_the_device_says_what_to_install(no_cuda_python):
    with pytest.raises(DeviceError, match=r"^CUDA support needs cuda-python: pip install 'hexir-runtime\[cuda\]'$"):
        CudaDevice()


def test_without_a_driver_cuinit_raising_is_a_device_error(fake):
    fake.init_raises = RuntimeError("Failed to dlopen libcuda.so.1")
    with pytest.raises(DeviceError, match=r"^no CUDA driver on this machine \(Failed to dlopen libcuda\.so\.1\)$"):
        CudaDevice()


def test_cuinit_failing_names_the_call_and_the_driver_message(fake):
    fake.fail["cuInit"] = CUresult.CUDA_ERROR_NO_DEVICE
    with pytest.raises(DeviceError,
                       match=r"^cuInit failed: CUDA_ERROR_NO_DEVICE \(no CUDA-capable device is detected\)$"):
        CudaDevice()


def test_zero_devices(fake):
    fake.count = 0
    with pytest.raises(DeviceError, match=r"^no CUDA device 0: this machine has 0$"):
        CudaDevice()


@pytest.mark.parametrize("call", ["cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetAttribute", "cuDeviceGetName",
                                  "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent"])
def test_every_setup_call_is_checked(fake, call):
    fake.fail[call] = CUresult.CUDA_ERROR_INVALID_DEVICE
    with pytest.raises(DeviceError, match=rf"^{call} failed: CUDA_ERROR_INVALID_DEVICE \(invalid device ordinal\)$"):
        CudaDevice()


def test_the_device_names_the_gpu_and_its_capability(fake):
    fake.capability = (8, 6)
    device = CudaDevice()
    assert device.name == "cuda (NVIDIA FakeGPU)"
    assert device.capability == (8, 6)
    assert fake.calls[0] == "cuInit"


def test_buffers_round_trip_through_device_memory(fake):
    device = CudaDevice()
    array = x_of((3, 4), "float64")
    buffer = device.alloc((3, 4), "float64")
    assert len(fake.allocations[int(buffer.pointer)]) == array.nbytes
    device.copy_in(buffer, array)
    assert fake.copies_in[-1][1] == array.tobytes()
    np.testing.assert_array_equal(device.copy_out(buffer), array)
    for target in (np.empty((3, 4)), np.empty((4, 3)).T):  # C-contiguous or not
        device.copy_out_into(buffer, target)
        np.testing.assert_array_equal(target, array)
    device.free(buffer)
    assert int(buffer.pointer) not in fake.allocations


def test_an_empty_buffer_still_gets_an_address_and_copies_nothing(fake):
    device = CudaDevice()
    buffer = device.alloc((0, 3), "float32")
    assert len(fake.allocations[int(buffer.pointer)]) == 1  # cuMemAlloc(0) is an error in the driver
    device.copy_in(buffer, np.zeros((0, 3), np.float32))
    assert device.copy_out(buffer).shape == (0, 3)
    assert "cuMemcpyHtoD" not in fake.calls and "cuMemcpyDtoH" not in fake.calls


def test_out_of_memory_names_cumemalloc(module_file, fake):
    fake.memory = 64  # not even the 5x7 weights (140 bytes) fit
    with pytest.raises(DeviceError, match=r"^cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY \(out of memory\)$"):
        load(module_file("mlp"), "cuda")


def test_a_missing_kernel_is_a_kernel_error_naming_it(module_file):
    def rename(manifest):
        manifest["kernels"][0]["symbol"] = "not_in_the_image"

    with pytest.raises(KernelError, match=r"^kernels\[0\] \(linear_\d+\): cuModuleGetFunction failed: "
                                          r"CUDA_ERROR_NOT_FOUND \(named symbol not found\)$"):
        load(reencoded(module_file("mlp"), rename), "cuda")


def test_a_failing_module_load_names_the_call_and_the_image(module_file, fake):
    fake.fail["cuModuleLoadData"] = CUresult.CUDA_ERROR_INVALID_IMAGE
    with pytest.raises(DeviceError, match=r"^cuModuleLoadData \(sm_90\) failed: CUDA_ERROR_INVALID_IMAGE "
                                          r"\(device kernel image is invalid\)$"):
        load(module_file("mlp"), "cuda")


def test_a_failing_launch_names_culaunchkernel(module_file, fake):
    module = load(module_file("mlp"), "cuda")
    fake.fail["cuLaunchKernel"] = CUresult.CUDA_ERROR_LAUNCH_FAILED
    with pytest.raises(DeviceError, match=r"^cuLaunchKernel failed: CUDA_ERROR_LAUNCH_FAILED "
                                          r"\(unspecified launch failure\)$"):
        module.main(x_of((3, 5)))


def test_an_error_surfacing_at_synchronize_names_custreamsynchronize(module_file, fake):
    module = load(module_file("mlp"), "cuda")
    fake.fail["cuStreamSynchronize"] = CUresult.CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(DeviceError, match=r"^cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS "
                                          r"\(an illegal memory access was encountered\)$"):
        module.main(x_of((3, 5)))
    with pytest.raises(DeviceError, match="cuStreamSynchronize failed"):  # closing syncs too: it says so,
        module.close()
    assert {"cuStreamDestroy", "cuModuleUnload"} <= set(fake.calls[fake.calls.index("cuStreamSynchronize"):])
    del fake.fail["cuStreamSynchronize"]  # after releasing the rest


# ---- choosing the image ----------------------------------------------------------------------

IMAGES = {"sm_80": 0, "sm_90": 1, "compute_80": 2}


@pytest.mark.parametrize(("images", "capability", "chosen"), [
    (IMAGES, (9, 0), ("sm_90", 1)),               # the GPU's own architecture
    (IMAGES, (8, 0), ("sm_80", 0)),
    (IMAGES, (8, 6), ("sm_80", 0)),               # same major, lower minor
    (IMAGES, (8, 9), ("sm_80", 0)),
    ({"sm_80": 0, "sm_86": 1, "compute_80": 2}, (8, 9), ("sm_86", 1)),  # the closest of those
    (IMAGES, (10, 0), ("compute_80", 2)),         # newer major: JIT the PTX
    (IMAGES, (12, 1), ("compute_80", 2)),
    ({"sm_90": 0, "compute_90": 1}, (10, 3), ("compute_90", 1)),
    ({"sm_90": 0, "compute_90": 1}, (9, 0), ("sm_90", 0)),  # a CUBIN is preferred to PTX
    ({"compute_75": 4}, (8, 0), ("compute_75", 4)),
    ({"sm_100": 0, "compute_100": 1}, (10, 3), ("sm_100", 0)),
    ({"sm_80": 0, "fatbin": 1}, (9, 0), ("fatbin", 1)),  # a custom kernel's fatbin: when nothing else fits
    ({"sm_90": 0, "fatbin": 1}, (9, 0), ("sm_90", 0)),
    ({"compute_80": 0, "fatbin": 1}, (9, 0), ("compute_80", 0)),
    ({"fatbin": 2}, (7, 5), ("fatbin", 2)),
    ({"sm_90a": 0, "sm_90": 1, "compute_90": 2}, (9, 0), ("sm_90a", 0)),  # its own "a" image first
    ({"sm_90a": 0, "sm_80": 1, "compute_80": 2}, (9, 0), ("sm_90a", 0)),
    ({"sm_90a": 0, "sm_90": 1, "compute_90": 2}, (10, 0), ("compute_90", 2)),  # an "a" image: 9.0 alone
    ({"sm_90a": 0, "sm_80": 1, "compute_90a": 2}, (8, 9), ("sm_80", 1)),
    ({"sm_80": 0, "compute_90a": 1}, (9, 0), ("compute_90a", 1)),
], ids=lambda value: str(value))
def test_pick_image(images, capability, chosen):
    assert pick_image(images, *capability) == chosen


@pytest.mark.parametrize(("images", "capability", "message"), [
    ({"sm_90": 0, "compute_90": 1}, (8, 6),
     "this module has CUDA code for compute_90, sm_90, none of which runs on this GPU (sm_86); "
     "recompile with -target=cuda:sm_86"),
    ({"sm_86": 0, "compute_86": 1}, (8, 0),       # a higher minor does not run, nor newer PTX
     "this module has CUDA code for compute_86, sm_86, none of which runs on this GPU (sm_80); "
     "recompile with -target=cuda:sm_80"),
    ({"sm_90a": 0, "compute_90a": 1}, (10, 0),     # sm_90a code runs on 9.0 only
     "this module has CUDA code for compute_90a, sm_90a, none of which runs on this GPU (sm_100); "
     "recompile with -target=cuda:sm_100"),
    ({"sm_90": 0}, (10, 0),                        # no PTX to JIT on a newer major
     "this module has CUDA code for sm_90, none of which runs on this GPU (sm_100); "
     "recompile with -target=cuda:sm_100"),
])
def test_pick_image_refuses_when_nothing_fits(images, capability, message):
    with pytest.raises(DeviceError) as error:
        pick_image(images, *capability)
    assert str(error.value) == message


def test_pick_image_suggests_only_targets_the_compiler_accepts():
    with pytest.raises(DeviceError) as error:
        pick_image({"sm_90": 0, "compute_90": 1}, 7, 0)
    assert "-target=cuda:sm_70" not in str(error.value)


# ---- loading and running compiled modules ----------------------------------------------------


def test_a_module_runs_end_to_end_on_the_fake_gpu(module_file, fake, capsys):
    path = module_file("mlp")
    module = load(path, "cuda")
    assert module.device_name == "cuda (NVIDIA FakeGPU)"
    x = x_of((3, 5))
    y = module.main(x)
    np.testing.assert_allclose(y, mlp_numpy(x), rtol=1e-5, atol=1e-6)
    assert y.dtype == np.float32
    # relu(linear(x, W, B)) is one fused kernel
    (kernel,) = hxb.read(path).json["kernels"]
    assert (kernel["op"], scalars.text(kernel["expr"])) == ("linear", "max(a0 + a1, 0)")
    assert [launch["kernel"] for launch in fake.launches] == [kernel["symbol"]]
    assert capsys.readouterr().out == ("0.000000 0.321699 0.919127 0.000000 0.000000 0.000000 0.000000 \n"
                                       "1.139663 0.840737 0.448452 0.000000 0.000000 1.462706 0.000000 \n"
                                       "0.000000 0.000000 6.002014 1.616639 5.866879 5.289489 3.066010 \n")


def test_launches_pass_the_right_buffers_in_order_with_the_recorded_geometry(module_file, fake):
    path = module_file("apart_two_archs")  # a linear and a relu kernel, the second reading the first's output
    module = load(path, "cuda")
    x = x_of((3, 5), seed=3)
    y, r = module.main(x)
    np.testing.assert_allclose(y, linear_numpy(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r, mlp_numpy(x), rtol=1e-5, atol=1e-6)
    kernels = hxb.read(path).manifest.kernels
    assert [(k.op, scalars.text(k.expr)) for k in kernels] == [("linear", "a0 + a1"), ("pointwise", "max(a0, 0)")]
    linear, relu = fake.launches
    np.testing.assert_array_equal(linear["inputs"][0], x)
    np.testing.assert_array_equal(linear["inputs"][1], W)
    np.testing.assert_array_equal(linear["inputs"][2], B)
    assert relu["pointers"][0] == linear["pointers"][3]  # the relu reads what the linear wrote
    assert len(set(linear["pointers"])) == 4 and len(set(relu["pointers"])) == 2
    for launch, kernel in zip(fake.launches, kernels, strict=True):
        geometry = kernel.gpu_code.launch
        assert launch["grid"] == tuple(hxb.evaluate(size, {}) for size in geometry.grid)
        assert launch["block"] == geometry.block
        assert launch["shared"] == geometry.shared_bytes


@pytest.mark.parametrize("name", ["wide", "relu"])
def test_float64_and_rank_3_modules_run_end_to_end(module_file, fake, name):
    path = module_file(name)
    manifest = hxb.read(path).manifest
    shape = manifest.entries[0].inputs[0][1].shape
    x = x_of(shape, "float64" if name == "wide" else "float32")
    y = load(path, "cuda").main(x)
    expected = x @ W64 if name == "wide" else np.maximum(x, 0)
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)
    assert y.dtype == x.dtype and y.shape == expected.shape
    (launch,), (kernel,) = fake.launches, manifest.kernels
    geometry = kernel.gpu_code.launch
    assert (launch["grid"], launch["block"]) == (tuple(hxb.evaluate(size, {}) for size in geometry.grid),
                                                 geometry.block)


def test_one_image_is_loaded_once_for_all_kernels(module_file, fake):
    load(module_file("apart_two_archs"), "cuda")  # two kernels: a linear and its relu kept apart
    assert fake.calls.count("cuModuleLoadData") == 1
    assert fake.calls.count("cuModuleGetFunction") == 2
    assert cubin_arch(fake.loaded[0]) == 90  # of sm_80 and sm_90, the GPU's own


def test_a_same_major_gpu_loads_the_lower_minor_cubin(module_file, fake):
    fake.capability = (8, 9)
    x = x_of((3, 5))
    np.testing.assert_allclose(load(module_file("mlp_two_archs"), "cuda").main(x), mlp_numpy(x), rtol=1e-5, atol=1e-6)
    assert len(fake.loaded) == 1 and cubin_arch(fake.loaded[0]) == 80


def test_a_newer_gpu_jits_the_ptx_with_a_trailing_nul(module_file, fake):
    fake.capability = (10, 0)
    path = module_file("mlp")
    module = load(path, "cuda")
    images = hxb.read(path).json["kernels"][0]["images"]
    ptx = bytes(hxb.read(path).blob(images["compute_90"]))
    assert not ptx.endswith(b"\0")
    assert fake.loaded == [ptx + b"\0"]
    x = x_of((3, 5))
    np.testing.assert_allclose(module.main(x), mlp_numpy(x), rtol=1e-5, atol=1e-6)


def test_an_older_gpu_is_refused_before_any_image_is_loaded(module_file, fake):
    fake.capability = (7, 5)
    with pytest.raises(DeviceError, match=r"^this module has CUDA code for compute_90, sm_90, none of which runs on "
                                          r"this GPU \(sm_75\); recompile with -target=cuda:sm_75$"):
        load(module_file("mlp"), "cuda")
    assert fake.loaded == []


def test_weights_are_uploaded_once_and_buffers_reused_across_calls(module_file, fake):
    module = load(module_file("mlp"), "cuda")
    allocations = fake.calls.count("cuMemAlloc")
    assert allocations == 4  # x, W, b and the out of the fused linear + relu on the GPU
    pointers = None
    for seed in range(3):
        x = x_of((3, 5), seed=seed)
        np.testing.assert_allclose(module.main(x), mlp_numpy(x), rtol=1e-5, atol=1e-6)
        assert len(fake.launches) == seed + 1  # one kernel per call
        launched = [launch["pointers"] for launch in fake.launches[-1:]]
        assert pointers in (None, launched)
        pointers = launched
    assert fake.calls.count("cuMemAlloc") == allocations
    uploads = [data for _, data in fake.copies_in]
    assert uploads.count(W.tobytes()) == 1 and uploads.count(B.tobytes()) == 1
    assert len(uploads) == 2 + 3  # the weights once, then x once per call


def test_each_call_launches_the_kernel_its_batch_picks_with_that_kernels_grid(tiled, fake):
    """A symbolic cuda linear carries a kernel per tile size: a call launches the first variant
    whose `below` bounds its sizes are under (else the kernel itself) with that variant's own
    grid and block, which the kernel's own (bigger tiles: fewer blocks) would leave rows short."""
    fake.know(tiled)
    module = load(tiled, "cuda")
    (kernel,) = hxb.read(tiled).json["kernels"]
    assert len(kernel["variants"]) >= 2
    launched = set()
    for batch in (5, kernel["variants"][0]["below"]["batch"], kernel["variants"][-1]["below"]["batch"] + 1):
        symbol, launch = next(((v["symbol"], v["launch"]) for v in kernel["variants"] if batch < v["below"]["batch"]),
                              (kernel["symbol"], kernel["launch"]))
        x = x_of((batch, 64), seed=batch)
        np.testing.assert_allclose(module.main(x), x.astype(np.float64) @ W_TILED, rtol=1e-4, atol=1e-4)
        (call,) = [launch for launch in fake.launches if launch["inputs"][0].shape == (batch, 64)]
        grid = tuple(hxb.evaluate(expr, {"batch": batch}) for expr in launch["grid"])
        assert (call["symbol"], call["grid"], call["block"]) == (symbol, grid, tuple(launch["block"]))
        launched.add(symbol)
    small = [hxb.evaluate(expr, {"batch": 5}) for expr in kernel["launch"]["grid"]]
    assert fake.launches[0]["grid"] != tuple(small)  # (so a variant launched with the kernel's grid is seen)
    assert len(launched) == 3
    module.close()


def test_a_module_loaded_on_one_thread_runs_on_another(module_file, fake):
    module = load(module_file("mlp"), "cuda")
    results = []
    worker = threading.Thread(target=lambda: results.append(module.main(x_of((3, 5)))))
    worker.start()
    worker.join()
    np.testing.assert_allclose(results[0], mlp_numpy(x_of((3, 5))), rtol=1e-5, atol=1e-6)


def test_an_entry_without_inputs_runs_on_another_thread(module_file, fake):
    module = load(module_file("constants_only"), "cuda")
    results: list[Any] = []

    def call() -> None:
        try:
            results.append(module.main())
        except DeviceError as error:
            results.append(error)

    worker = threading.Thread(target=call)
    worker.start()
    worker.join()
    if isinstance(results[0], DeviceError):
        raise results[0]
    np.testing.assert_allclose(results[0], W.T @ W, rtol=1e-5, atol=1e-5)


# ---- a module's lifetime, and its transfers ------------------------------------------------


@pytest.fixture
def relu_file(modules, fake, tmp_path) -> Path:
    """conftest's `cuda` module, `main(x: float32[2, 3, 4]) -> relu(x)` (printed too) with the relu
    on cuda and no cpu fallback, its image fake PTX: it runs on the fake GPU without the compiler."""
    manifest, blobs = modules.cuda(fallback=False)
    kernel = manifest["kernels"][0]
    kernel["images"] = {"compute_90": len(blobs)}
    blobs.append(("relu.ptx", f".target sm_90\n.entry {kernel['symbol']}(".encode()))
    hxb.write(tmp_path / "relu.hxb", manifest, blobs)
    fake.know(tmp_path / "relu.hxb")
    return tmp_path / "relu.hxb"


def test_close_frees_every_buffer_and_unloads_the_code(relu_file, fake, capsys):
    x = x_of((2, 3, 4))
    for _ in range(20):  # as 20 jit signatures would
        module = load(relu_file, "cuda")
        np.testing.assert_array_equal(module.main(x), np.maximum(x, 0))
        module.close()
    assert fake.allocations == {} and fake.modules == set()
    assert fake.calls.count("cuMemFree") == fake.calls.count("cuMemAlloc") == 20 * 2  # x and relu(x) on the GPU
    assert fake.calls.count("cuModuleUnload") == fake.calls.count("cuModuleLoadData") == 20


def test_close_is_idempotent_and_a_closed_module_refuses_calls(relu_file, fake):
    module = load(relu_file, "cuda")
    module.close()
    calls = len(fake.calls)
    module.close()
    assert len(fake.calls) == calls and module.closed and "closed" in repr(module)
    with pytest.raises(HexirRuntimeError, match=r"^main\(\): the module is closed \(load it again to call its "
                                                r"entries\)$"):
        module.main(x_of((2, 3, 4)))
    assert str(module.signature("main")) == "main(x: float32[2, 3, 4]) -> float32[2, 3, 4]"


def test_a_with_block_or_dropping_the_last_reference_frees_too(relu_file, fake, capsys):
    x = x_of((2, 3, 4))
    with load(relu_file, "cuda") as module:
        np.testing.assert_array_equal(module.main(x), np.maximum(x, 0))
    assert module.closed and fake.allocations == {} and fake.modules == set()
    module = load(relu_file, "cuda")
    module.main(x)
    alive = weakref.ref(module)
    del module
    gc.collect()
    assert alive() is None  # the finalizer does not keep the module alive
    assert fake.allocations == {} and fake.modules == set()


def test_a_load_that_fails_halfway_gives_back_what_it_took(relu_file, fake):
    fake.memory = 100  # the module's first GPU buffer (96 bytes) fits, its second does not
    with pytest.raises(DeviceError, match=r"^cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY"):
        load(relu_file, "cuda")
    assert fake.calls.count("cuMemAlloc") == 2 and fake.allocations == {} and fake.modules == set()

    def rename(manifest):
        manifest["kernels"][0]["symbol"] = "not_in_the_image"

    with pytest.raises(KernelError, match="cuModuleGetFunction failed"):
        load(reencoded(relu_file, rename), "cuda")
    assert fake.calls.count("cuModuleLoadData") == 2 and fake.modules == set()


def test_transfers_copy_straight_between_host_buffers_and_the_gpu(relu_file, fake, monkeypatch, capsys):
    module = load(relu_file, "cuda")
    host_copies = []

    def spy(method):
        original = getattr(HostMemory, method)

        def counted(self, *args):
            host_copies.append(method)
            return original(self, *args)
        return counted
    for method in ("copy_in", "copy_out", "copy_out_into"):
        monkeypatch.setattr(HostMemory, method, spy(method))
    before = Counter(fake.calls)
    x = x_of((2, 3, 4))
    for _ in range(3):
        np.testing.assert_array_equal(module.main(x), np.maximum(x, 0))
    calls = Counter(fake.calls) - before
    assert calls["cuMemcpyHtoDAsync"] == calls["cuMemcpyDtoHAsync"] == 3  # one each way per call
    assert fake.pageable_copies == 0  # both from and to the page-locked staging buffers
    # per call, on the host: x into its buffer, then the fresh arrays of print and return; the
    # transfers copy straight from the host buffer of x, and into the one of relu(x)
    assert host_copies == ["copy_in", "copy_out", "copy_out"] * 3


# ---- hexir-run -------------------------------------------------------------------------------


@pytest.fixture
def x_file(tmp_path) -> tuple[Path, np.ndarray]:
    x = x_of((3, 5), seed=11)
    np.save(tmp_path / "x.npy", x)
    return tmp_path / "x.npy", x


def printed(array: np.ndarray) -> str:
    return "".join("".join(f"{value:f} " for value in row) + "\n" for row in array.tolist())


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_hexir_run_names_the_gpu(module_file, x_file, capsys, device):
    path, x = x_file
    assert hexir_run([str(module_file("mlp")), f"--device={device}", "--input", f"x={path}"]) == 0
    out, err = capsys.readouterr()
    header, _, body = out.partition("--\n")
    assert "device        : cuda (NVIDIA FakeGPU)\n" in header
    assert body.startswith(printed(mlp_numpy(x).astype(np.float32)) + "output0: float32[3, 7]\n")
    assert err == ""


def _no_driver(fake: FakeDriver) -> None:
    fake.init_raises = RuntimeError("Failed to dlopen libcuda.so.1")


def _no_device(fake: FakeDriver) -> None:
    fake.fail["cuInit"] = CUresult.CUDA_ERROR_NO_DEVICE


def _zero_devices(fake: FakeDriver) -> None:
    fake.count = 0


NO_GPU = [
    (None, "CUDA support needs cuda-python: pip install 'hexir-runtime[cuda]'"),
    (_no_driver, "no CUDA driver on this machine (Failed to dlopen libcuda.so.1)"),
    (_no_device, "cuInit failed: CUDA_ERROR_NO_DEVICE (no CUDA-capable device is detected)"),
    (_zero_devices, "no CUDA device 0: this machine has 0"),
]
NO_GPU_IDS = ["no cuda-python", "no driver", "cuInit no device", "zero devices"]


@pytest.fixture
def without_gpu(request, compiled, monkeypatch) -> str:
    """The machine of the parameter (None: no cuda-python); returns why there is no GPU."""
    breaks, reason = request.param
    if breaks is None:
        request.getfixturevalue("no_cuda_python")
    else:
        breaks(request.getfixturevalue("fake"))
    return reason


@pytest.mark.parametrize("without_gpu", NO_GPU, ids=NO_GPU_IDS, indirect=True)
def test_hexir_run_auto_without_gpu_falls_back_to_the_cpu_with_a_note(compiled, x_file, capsys, without_gpu):
    path, x = x_file
    assert hexir_run([str(compiled["mlp"]), "--device=auto", "--input", f"x={path}"]) == 0
    out, err = capsys.readouterr()
    assert err == f"hexir-run: note: no usable GPU ({without_gpu}); running the CUDA kernels on the cpu\n"
    header, _, body = out.partition("--\n")
    assert "device        : cpu\n" in header
    assert body.startswith(printed(mlp_numpy(x).astype(np.float32)) + "output0: float32[3, 7]\n")


@pytest.mark.parametrize("without_gpu", NO_GPU, ids=NO_GPU_IDS, indirect=True)
def test_hexir_run_cuda_without_gpu_exits_1(compiled, x_file, capsys, without_gpu):
    path, _ = x_file
    assert hexir_run([str(compiled["mlp"]), "--device=cuda", "--input", f"x={path}"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"hexir-run: {without_gpu}\n"


@pytest.mark.parametrize("without_gpu", NO_GPU[:1], ids=NO_GPU_IDS[:1], indirect=True)
def test_load_auto_without_gpu_warns_and_runs_the_cpu_fallbacks(compiled, without_gpu):
    with pytest.warns(RuntimeWarning, match=re.escape(f"no usable GPU ({without_gpu}); running the CUDA kernels "
                                                      "on the cpu")):
        module = load(compiled["mlp"], "auto")
    assert module.device_name == "cpu"
    x = x_of((3, 5))
    np.testing.assert_allclose(module.main(x), mlp_numpy(x), rtol=1e-5, atol=1e-6)


def test_auto_on_a_gpu_no_image_fits_falls_back_to_the_cpu_with_a_note(module_file, fake):
    fake.capability = (7, 5)  # the module carries sm_90 code only
    with pytest.warns(RuntimeWarning, match=r"the GPU cannot run this module \(this module has CUDA code for "
                                            r"compute_90, sm_90, none of which runs on this GPU \(sm_75\)"):
        module = load(module_file("mlp"), "auto")
    assert module.device_name == "cpu" and fake.loaded == []
    x = x_of((3, 5))
    np.testing.assert_allclose(module.main(x), mlp_numpy(x), rtol=1e-5, atol=1e-6)


# ---- custom kernels ----------------------------------------------------------------------------

FATBIN = FATBIN_MAGIC + b" .entry echo( .entry twice("


@pytest.fixture
def custom_file(modules, fake, tmp_path) -> Path:
    """`main(x: float32[2, 3], y: float64[4], e: float32[0, 2**33]) -> twice(echo(x, y, e))`: two
    custom CUDA kernels in one fatbin (and a CUBIN that does not fit the 9.0 GPU). `echo` writes
    its six dimensions, then the sums of x and y, into a float64[8]; `twice` doubles it. The
    empty `e` has a dimension that only a 64-bit integer holds."""
    builder = modules.Builder()
    fatbin, cubin = builder.blob("kernels.fatbin", FATBIN), builder.blob("kernels.cubin", b"\x7fELF sm_80")
    images = {"sm_80": cubin, "fatbin": fatbin}
    specs = [([2, 3], "float32"), ([4], "float64"), ([0, 2**33], "float32")]
    echo = builder.custom("echo", [*specs, ([8], "float64")], "cuda", images=images)
    twice = builder.custom("twice", [([8], "float64"), ([8], "float64")], "cuda", images=images)
    entry = builder.entry()
    inputs = [entry.transfer(entry.input(name, *spec), "cuda") for name, spec in zip("xye", specs, strict=True)]
    entry.ret(entry.transfer(entry.call(twice, entry.call(echo, *inputs)), "cpu"))
    hxb.write(tmp_path / "custom.hxb", *builder.build())
    fake.know(tmp_path / "custom.hxb")

    def run_echo(arrays, scalars):
        (x, y, _, out), (*dims, _) = arrays, scalars
        out[...] = [*dims, out.size, x.sum(), y.sum()]
    fake.custom_code = {"echo": run_echo, "twice": lambda arrays, scalars: np.multiply(arrays[0], 2, out=arrays[1])}
    return tmp_path / "custom.hxb"


def test_custom_kernel_params_are_the_pointers_then_int64_dimensions(custom_file, fake):
    x, y = x_of((2, 3)), x_of(4, "float64", seed=1)
    result = load(custom_file, "cuda").main(x, y, np.zeros((0, 2**33), np.float32))
    np.testing.assert_allclose(result, 2 * np.array([2, 3, 4, 0, 2**33, 8, x.sum(), y.sum()]), rtol=1e-6)
    echo, twice = fake.launches
    assert echo["scalars"] == [2, 3, 4, 0, 2**33, 8] and twice["scalars"] == [8, 8]
    np.testing.assert_array_equal(echo["inputs"][0], x)
    np.testing.assert_array_equal(echo["inputs"][1], y)
    assert twice["pointers"][0] == echo["pointers"][3] and len(set(echo["pointers"])) == 4
    assert (echo["grid"], echo["block"], echo["shared"]) == ((1, 1, 1), (256, 1, 1), 0)


def test_a_fatbin_is_loaded_as_it_is_once_per_module(custom_file, fake):
    load(custom_file, "cuda")
    assert fake.loaded == [FATBIN]  # no NUL added, the sm_80 CUBIN not tried on the 9.0 GPU
    assert fake.calls.count("cuModuleGetFunction") == 2


# ---- launch records with size expressions (a hand-built module, no compiler needed) -----------


@pytest.fixture
def symbolic_relu(modules, fake) -> bytes:
    """`main(x: float32[batch, 3]) -> relu(x)` on cuda, grid [ceildiv(batch, 2), 1, 1], its
    kernel taught to the fake GPU, its PTX naming it."""
    builder = modules.Builder()
    relu = builder.kernel("relu", [["batch", 3], ["batch", 3]], device="cuda", fallback=False)
    kernel = builder.kernels[relu]
    kernel["launch"] = {"grid": [["ceildiv", "batch", 2], 1, 1], "block": [64, 1, 1], "shared_bytes": 64 * 1024}
    ptx = kernel["images"]["compute_90"]
    builder.blobs[ptx] = ("ptx", f".version 8.0\n.target sm_90\n.entry {kernel['symbol']}(\n".encode())
    kernel["images"] = {"compute_90": ptx}
    entry = builder.entry()
    entry.ret(entry.transfer(entry.call(relu, entry.transfer(entry.input("x", ["batch", 3]), "cuda")), "cpu"))
    fake.kernels[kernel["symbol"]] = kernel
    return hxb.encode(*builder.build())


def test_grids_are_evaluated_per_call_and_sizes_follow_the_pointers(symbolic_relu, fake, request):
    module = load(symbolic_relu, "cuda")
    request.addfinalizer(module.close)  # while the fake driver is still plugged in
    assert "cuFuncSetAttribute" in fake.calls  # 64 KiB of shared memory needs opting in
    for batch, blocks in [(5, 3), (1, 1), (4, 2)]:
        x = x_of((batch, 3), seed=batch)
        np.testing.assert_array_equal(module.main(x), np.maximum(x, 0))
        launch = fake.launches[-1]
        assert (launch["grid"], launch["block"], launch["shared"]) == ((blocks, 1, 1), (64, 1, 1), 64 * 1024)
        assert launch["scalars"] == [batch]  # one int64 per entry of `sizes`, after the pointers
    assert len(fake.launches) == 3


def test_an_empty_grid_is_not_launched(symbolic_relu, fake, request):
    module = load(symbolic_relu, "cuda")
    request.addfinalizer(module.close)
    assert module.main(np.zeros((0, 3), np.float32)).shape == (0, 3)
    assert fake.launches == [] and "cuLaunchKernel" not in fake.calls


def test_a_grid_beyond_cuda_limits_is_a_kernel_error(symbolic_relu, fake, monkeypatch, request):
    module = load(symbolic_relu, "cuda")
    request.addfinalizer(module.close)
    monkeypatch.setattr(hexir_runtime.cuda, "MAX_GRID", (2, 65535, 65535))  # not 2^31 - 1: no 48 GiB input
    with pytest.raises(KernelError) as caught:
        module.main(np.zeros((5, 3), np.float32))
    assert str(caught.value) == ("kernels[0] (k0_relu) needs 3 blocks along grid x (ceildiv(batch, 2)); "
                                 "CUDA allows at most 2")
    assert "cuLaunchKernel" not in fake.calls


# ---- the call path: one stream, pinned staging, asynchronous copies, DLPack ---------------------


def calls_of_one_call(fake: FakeDriver, module: Any, *args: Any, **keys: Any) -> tuple[Any, list[str]]:
    """What module.main(*args) returns, and the driver calls it made."""
    before = len(fake.calls)
    result = module.main(*args, **keys)
    return result, fake.calls[before:]


def test_a_call_queues_everything_on_the_module_stream_and_waits_only_for_its_outputs(module_file, fake):
    module = load(module_file("apart_two_archs"), "cuda")  # two kernels, two outputs
    (stream,) = fake.streams
    x = x_of((3, 5), seed=4)
    for _ in range(3):
        before = len(fake.on_stream)
        (y, r), calls = calls_of_one_call(fake, module, x)
        np.testing.assert_allclose(r, mlp_numpy(x), rtol=1e-5, atol=1e-6)
        assert {value for _, value in fake.on_stream[before:]} == {stream}
        assert "cuCtxSynchronize" not in calls and "cuMemcpyHtoD" not in calls and "cuMemcpyDtoH" not in calls
        first, second = (i for i, call in enumerate(calls) if call == "cuLaunchKernel")
        assert "cuStreamSynchronize" not in calls[:second]  # nothing waits between the kernels
        # the host waits once per output copied back, after that copy
        assert [c for c in calls if c in ("cuMemcpyDtoHAsync", "cuStreamSynchronize")] == [
            "cuMemcpyDtoHAsync", "cuStreamSynchronize"] * 2
        assert "cuMemAlloc" not in calls and "cuMemHostAlloc" not in calls  # nothing allocated per call
    assert fake.pageable_copies == 0


def test_parameter_blocks_are_built_once_and_only_overridden_slots_change(module_file, fake):
    module = load(module_file("mlp"), "cuda")  # static: planned (and its block built) at load
    assert fake.launches == []
    for seed in range(3):
        module.main(x_of((3, 5), seed=seed))
    assert len({launch["params"] for launch in fake.launches}) == 1
    assert len({tuple(launch["pointers"]) for launch in fake.launches}) == 1


def test_pinned_staging_buffers_are_reused_for_repeated_sizes_and_grown_for_bigger_ones(symbolic_relu, fake, request):
    module = load(symbolic_relu, "cuda")
    request.addfinalizer(module.close)
    assert fake.calls.count("cuMemHostAlloc") == 0  # symbolic: sized by the first call
    for batch in (5, 5, 3, 5, 0):
        x = x_of((batch, 3), seed=batch)
        np.testing.assert_array_equal(module.main(x), np.maximum(x, 0))
    assert fake.calls.count("cuMemHostAlloc") == 2  # x's staging buffer and the output's
    assert fake.calls.count("cuMemAlloc") == 2
    module.main(x_of((9, 3)))
    assert fake.calls.count("cuMemHostAlloc") == 4 and fake.calls.count("cuMemFreeHost") == 2
    assert len(fake.pinned) == 2 and fake.pageable_copies == 0
    module.close()
    assert fake.pinned == {} and fake.streams == set() and fake.events == set()


class CudaTensor(hexir_runtime.dlpack.DLPackArray):
    """A caller's CUDA tensor (what torch.Tensor.__dlpack__ gives), in the fake GPU's memory;
    `strides` (in elements) are written into the DLTensor it exports, if given."""

    def __init__(self, fake: FakeDriver, array: np.ndarray, device: int = 0, strides: tuple[int, ...] | None = None):
        fake._current.context = fake._context  # as torch would have it on this thread
        pointer = int(fake.cuMemAlloc(max(array.nbytes, 1))[1])
        fake._memory(pointer, array.nbytes)[:] = array.tobytes()
        self.streams: list[Any] = []
        super().__init__(pointer, array.shape, array.dtype, (2, device), ready=self.streams.append)
        self.strides = strides

    def __dlpack__(self, stream: Any = None, **keys: Any) -> Any:
        capsule = super().__dlpack__(stream, **keys)
        if self.strides is not None:
            self._strides = (ctypes.c_int64 * len(self.strides))(*self.strides)
            exported = hexir_runtime.dlpack.DLManagedTensor.from_buffer(self._exports[-1]).dl_tensor
            exported.strides = ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64))
        return capsule


class CudaTensorView(hexir_runtime.dlpack.DLPackArray):
    """Rows `first`.. of a caller's CUDA tensor holding `storage`, exported as DLPack lets a
    view be: `data` at the storage's start, `byte_offset` to the view's first element."""

    def __init__(self, fake: FakeDriver, storage: np.ndarray, first: int) -> None:
        self.storage = CudaTensor(fake, storage)  # (keeps the memory)
        self.offset = storage[:first].nbytes
        view = storage[first:]
        super().__init__(self.storage.pointer + self.offset, view.shape, view.dtype, (2, 0))

    def __dlpack__(self, stream: Any = None, **keys: Any) -> Any:
        capsule = super().__dlpack__(stream, **keys)
        exported = hexir_runtime.dlpack.DLManagedTensor.from_buffer(self._exports[-1]).dl_tensor
        exported.data, exported.byte_offset = self.storage.pointer, self.offset
        return capsule


def test_a_cuda_tensor_that_is_a_view_at_a_byte_offset_is_read_there(symbolic_relu, fake):
    """A view into a bigger tensor (its DLPack `byte_offset` not 0) is read from the view's
    first element, not the storage's: the rows before it would give another answer."""
    module = load(symbolic_relu, "cuda")
    storage = x_of((7, 3), seed=8)
    for first in (1, 4):
        view = CudaTensorView(fake, storage, first)
        np.testing.assert_array_equal(module.main(view), np.maximum(storage[first:], 0))
        y = module.main(view, outputs="device")
        np.testing.assert_array_equal(device_bytes(fake, y), np.maximum(storage[first:], 0))
    module.close()


def device_bytes(fake: FakeDriver, array: Any) -> np.ndarray:
    """The contents of a device array (a DLPackArray in the fake GPU's memory)."""
    return np.frombuffer(bytes(fake._memory(array.pointer, array.nbytes)), array.dtype).reshape(array.shape)


def test_a_cuda_tensor_is_read_in_place_and_outputs_stay_on_the_gpu(module_file, fake):
    module = load(module_file("wide"), "cuda")  # x @ W64, float64[37, 11] -> [37, 33]
    (stream,) = fake.streams
    x = x_of((37, 11), "float64", seed=5)
    tensor = CudaTensor(fake, x)
    y, calls = calls_of_one_call(fake, module, tensor, outputs="device")
    assert tensor.streams == [1]  # the producer was asked for it on the legacy stream, which ours waits for
    assert "cuMemcpyHtoDAsync" not in calls and "cuMemcpyDtoHAsync" not in calls
    assert "cuStreamSynchronize" not in calls and "cuEventRecord" not in calls
    (launch,) = fake.launches
    assert launch["pointers"][0] == tensor.pointer and launch["pointers"][-1] == y.pointer
    assert y.__dlpack_device__() == (2, 0) and (y.shape, y.dtype) == ((37, 33), np.float64)
    np.testing.assert_allclose(device_bytes(fake, y), x @ W64, rtol=1e-12)
    before = len(fake.calls)
    consumed = hexir_runtime.dlpack.unpack(y.__dlpack__(stream=1))  # as torch.from_dlpack on its default stream
    assert fake.calls[before:] == []  # the legacy stream waits for our blocking stream by itself
    hexir_runtime.dlpack.unpack(y.__dlpack__(stream=stream)).release()  # another stream waits for an event
    assert fake.on_stream[-2:] == [("cuEventRecord", stream), ("cuStreamWaitEvent", stream)]
    assert (consumed.pointer, consumed.shape, consumed.device) == (y.pointer, (37, 33), (2, 0))
    pointer = y.pointer
    del y
    gc.collect()
    assert pointer in fake.allocations  # the consumer's tensor still uses it
    consumed.release()
    assert pointer in fake.allocations  # kept for the next call's output of that size, not freed
    assert "cuMemFreeAsync" not in [call for call, _ in fake.on_stream]
    again, calls = calls_of_one_call(fake, module, tensor, outputs="device")
    assert again.pointer == pointer and "cuMemAllocAsync" not in calls
    np.testing.assert_allclose(device_bytes(fake, again), x @ W64, rtol=1e-12)
    np.testing.assert_allclose(module.main(tensor), x @ W64, rtol=1e-12)  # numpy out
    del again
    gc.collect()
    module.close()
    assert pointer not in fake.allocations  # the module's kept outputs go with it


def test_big_host_inputs_and_outputs_are_copied_straight_from_and_to_the_callers_arrays(module_file, fake):
    """From DIRECT_BYTES on, the driver reads the caller's (pageable) array itself, in pieces as it
    copies, and the output comes back straight into the array returned (page-locked, see below);
    below, both go through our page-locked buffers (one host copy each, and the DMA)."""
    module = load(module_file("rows_relu"), "cuda")  # relu of float32[batch, 1024]
    rows = -(-DIRECT_BYTES // 4096)
    big, small = x_of((rows, 1024), seed=1), x_of((2, 1024), seed=2)
    for x in (big, small, big):
        copies = fake.pageable_copies
        np.testing.assert_array_equal(module.main(x), np.maximum(x, 0))
        assert fake.pageable_copies - copies == (1 if x is big else 0)  # the input in
    (launch, *_), last = fake.launches, fake.launches[-1]
    assert launch["pointers"][0] == last["pointers"][0]  # the kernel reads our buffer, not the array


def test_big_results_come_back_in_page_locked_memory_kept_for_later_calls(module_file, fake):
    """A result of PINNED_RESULT_BYTES or more is page-locked memory, which goes back to the
    module when the caller drops the array (up to SPARE_OUTPUTS per size lent at once; more
    results held at once are pageable); what the module keeps goes when it closes, what a
    caller still holds when the caller drops it."""
    module = load(module_file("rows_relu"), "cuda")
    x = x_of((-(-PINNED_RESULT_BYTES // 4096), 1024), seed=3)
    first = module.main(x)
    np.testing.assert_array_equal(first, np.maximum(x, 0))
    assert fake.is_pinned(first.ctypes.data, first.nbytes)
    address, allocated = first.ctypes.data, fake.calls.count("cuMemHostAlloc")
    del first
    gc.collect()
    again = module.main(x)
    assert again.ctypes.data == address and fake.calls.count("cuMemHostAlloc") == allocated  # reused
    held = [again] + [module.main(x) for _ in range(SPARE_OUTPUTS)]
    assert [fake.is_pinned(y.ctypes.data, y.nbytes) for y in held] == [True] * SPARE_OUTPUTS + [False]
    for y in held:
        np.testing.assert_array_equal(y, np.maximum(x, 0))
    view = held[1][1:]  # a view keeps its memory lent
    del held
    gc.collect()
    freed = fake.calls.count("cuMemFreeHost")
    module.close()
    assert fake.calls.count("cuMemFreeHost") - freed == SPARE_OUTPUTS - 1 + 1  # the kept ones, x's staging buffer
    np.testing.assert_array_equal(view, np.maximum(x, 0)[1:])
    del view
    gc.collect()
    assert fake.calls.count("cuMemFreeHost") - freed == SPARE_OUTPUTS + 1


def test_a_result_given_back_while_its_module_holds_its_lock_does_not_wait_for_it(module_file, fake):
    """A finalizer may run in a garbage collection on a thread inside the module's own locked
    section: it only queues the memory, which the next result takes back."""
    module = load(module_file("rows_relu"), "cuda")
    x = x_of((-(-PINNED_RESULT_BYTES // 4096), 1024), seed=4)
    first = module.main(x)
    address = first.ctypes.data
    program = module._executors["main"].gpus[0]
    with program.lock:
        del first  # (its finalizer runs here, on this thread)
        gc.collect()
    assert fake.is_pinned(address, 1) and len(program.returned) == 1
    assert module.main(x).ctypes.data == address and not program.returned


def test_without_page_locked_memory_a_big_result_is_pageable(module_file, fake):
    module = load(module_file("rows_relu"), "cuda")
    x = x_of((-(-PINNED_RESULT_BYTES // 4096), 1024), seed=5)
    module.main(x)  # plans the call: its staging buffers exist
    fake.fail["cuMemHostAlloc"] = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    held = [module.main(x) for _ in range(2)]  # (the first reuses the spare the last call gave back)
    assert [fake.is_pinned(y.ctypes.data, y.nbytes) for y in held] == [True, False]
    np.testing.assert_array_equal(held[1], np.maximum(x, 0))
    program = module._executors["main"].gpus[0]
    assert program.lent[held[0].nbytes] == 1  # the failed allocation lent nothing


def test_a_tensor_on_a_callers_stream_is_waited_for_with_an_event_of_its_own(module_file, fake):
    module = load(module_file("rows_relu"), "cuda")
    program = module._executors["main"].gpus[0]
    assert program.wait_event is not None and int(program.wait_event) != int(program.event)
    _, theirs = fake.cuStreamCreate(0)  # a caller's stream
    program.wait_for(int(theirs))
    assert fake.on_stream[-2:] == [("cuEventRecord", int(theirs)), ("cuStreamWaitEvent", int(program.stream))]


def test_a_module_keeps_a_few_given_back_outputs_per_size_and_frees_the_rest(module_file, fake):
    module = load(module_file("wide"), "cuda")
    tensor = CudaTensor(fake, x_of((37, 11), "float64", seed=5))
    outputs = [module.main(tensor, outputs="device") for _ in range(SPARE_OUTPUTS + 2)]
    pointers = {y.pointer for y in outputs}
    assert len(pointers) == SPARE_OUTPUTS + 2  # each alive at once: each its own memory
    del outputs
    gc.collect()
    assert sum(pointer in fake.allocations for pointer in pointers) == SPARE_OUTPUTS
    assert [call for call, _ in fake.on_stream].count("cuMemFreeAsync") == 2
    reused = [module.main(tensor, outputs="device") for _ in range(SPARE_OUTPUTS)]
    assert {y.pointer for y in reused} <= pointers


def test_given_back_outputs_are_kept_for_at_most_spare_sizes_sizes(module_file, fake):
    """A module called with ever new batch sizes keeps spare outputs of SPARE_SIZES sizes only."""
    module = load(module_file("rows_relu"), "cuda")
    program = module._executors["main"].gpus[0]
    for rows in range(1, SPARE_SIZES + 4):
        y = module.main(CudaTensor(fake, x_of((rows, 1024), seed=rows)), outputs="device")
        np.testing.assert_array_equal(device_bytes(fake, y), np.maximum(x_of((rows, 1024), seed=rows), 0))
        del y
        gc.collect()
    assert sorted(program.spare) == [rows * 4096 for rows in range(1, SPARE_SIZES + 1)]


def test_each_device_output_is_a_fresh_buffer_and_host_inputs_wait_for_the_last_call(module_file, fake):
    module = load(module_file("apart_two_archs"), "cuda")  # outputs linear(x) and relu(linear(x))
    xs = [x_of((3, 5), seed=seed) for seed in range(3)]
    outputs = [module.main(x, outputs="device") for x in xs]
    assert len({array.pointer for pair in outputs for array in pair}) == 6
    for x, (y, r) in zip(xs, outputs, strict=True):
        np.testing.assert_allclose(device_bytes(fake, y), linear_numpy(x), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(device_bytes(fake, r), mlp_numpy(x), rtol=1e-5, atol=1e-6)
    printed = load(module_file("mlp"), "cuda").main(xs[0], outputs="device")  # printed too: copied back
    assert isinstance(printed, np.ndarray)
    # a host input after a call that did not wait: its staging buffer may still be read
    _, calls = calls_of_one_call(fake, module, xs[0], outputs="device")
    assert calls.index("cuStreamSynchronize") < calls.index("cuMemcpyHtoDAsync")


@pytest.mark.parametrize(("make", "message"), [
    (lambda fake: CudaTensor(fake, x_of((3, 5)), device=1),
     "main(): argument 'x' expects float32[3, 5] on cuda:0 (the module's GPU), got float32[3, 5] on cuda:1"),
    (lambda fake: CudaTensor(fake, x_of((3, 5), "float64")),
     "main(): argument 'x' expects float32[3, 5] on cuda:0, got float64[3, 5] on cuda:0"),
    (lambda fake: CudaTensor(fake, x_of((5, 3))), "main(): argument 'x' expects float32[3, 5] on cuda:0, got "
                                                   "float32[5, 3] on cuda:0"),
    (lambda fake: CudaTensor(fake, x_of((3, 5)), strides=(1, 3)),
     "main(): argument 'x' expects a C-contiguous tensor, got float32[3, 5] on cuda:0 with strides (1, 3) "
     "(in elements; .contiguous() makes one)"),
], ids=["device", "dtype", "shape", "strides"])
def test_a_wrong_cuda_tensor_is_an_input_error_naming_it(module_file, fake, make, message):
    module = load(module_file("mlp"), "cuda")
    with pytest.raises(hexir_runtime.InputError) as error:
        module.main(make(fake))
    assert str(error.value) == message
    assert fake.launches == []


def test_a_cuda_tensor_at_a_misaligned_address_is_an_input_error(modules, fake):
    """Kernels read rows of a multiple of 16 bytes 16 bytes at a time: a view of such rows
    starting 4 bytes into its storage is refused (naming its address), never read misaligned (a
    sticky CUDA error on a real GPU); rows of other lengths are read as they are (the test above)."""
    builder = modules.Builder()
    relu = builder.kernel("relu", [["batch", 4], ["batch", 4]], device="cuda", fallback=False)
    kernel = builder.kernels[relu]
    ptx = kernel["images"]["compute_90"]
    builder.blobs[ptx] = ("ptx", f".version 8.0\n.target sm_90\n.entry {kernel['symbol']}(\n".encode())
    kernel["images"] = {"compute_90": ptx}
    fake.kernels[kernel["symbol"]] = kernel
    entry = builder.entry()
    entry.ret(entry.transfer(entry.call(relu, entry.transfer(entry.input("x", ["batch", 4]), "cuda")), "cpu"))
    module = load(hxb.encode(*builder.build()), "cuda")
    storage = CudaTensor(fake, x_of((17,)))
    view = hexir_runtime.dlpack.DLPackArray(storage.pointer + 4, (4, 4), np.dtype("float32"), (2, 0))  # 4 B in
    with pytest.raises(hexir_runtime.InputError, match=r"^main\(\): argument 'x' expects a tensor at a 16-byte "
                                                      r"aligned address, got float32\[4, 4\] on cuda:0 at 0x[0-9a-f]+ "
                                                      r"\(\.clone\(\) makes one\)$"):
        module.main(view)
    assert fake.launches == []
    module.close()


def test_concurrent_calls_from_8_threads_on_the_fake_gpu(symbolic_relu, fake, request, concurrently):
    module = load(symbolic_relu, "cuda")
    request.addfinalizer(module.close)

    def work(seed: int) -> None:
        for i in range(20):
            x = x_of((1 + (seed + i) % 6, 3), seed=seed * 100 + i)
            y = module.main(x) if i % 2 else module.main(CudaTensor(fake, x))
            np.testing.assert_array_equal(y, np.maximum(x, 0))

    assert concurrently(work) == []
    assert len(fake.launches) == 160
