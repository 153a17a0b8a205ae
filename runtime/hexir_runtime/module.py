"""Loading a .hxb module onto devices and calling its entries.

`load(path)` checks the file, picks the devices, loads every kernel and uploads every constant
once; `Module.run(entry, *arrays)` (or `module.<entry>(*arrays)`) checks the arguments against
the entry's signature and runs its host program. `Module.close()` (or leaving a `with load(...)
as module:` block, or dropping the last reference) frees the module's device memory and
unloads its GPU code.

Arguments must be numpy arrays with exactly the signature's dtype and shape (a symbol in the
shape, `float32[batch, 8]`, takes any size, the same wherever it appears): nothing is cast or
converted (a list, a float64 array for a float32 input, are errors), so a call never
silently changes precision. Non-contiguous arrays are accepted (copied into the entry's buffer);
C-contiguous ones that only host kernels read are read in place. Any object with `__dlpack__`
(torch, cupy, jax) is accepted too: a host one as the numpy array it shares memory with, a CUDA
one in place where the entry only copies it to the GPU for GPU kernels (it must be on the
module's GPU and C-contiguous). `out=` and `outputs="device"` choose where the outputs go
(`Module.run`); executor.py says what a call does and what it reuses.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import dlpack, signing
from .cpu import CpuDevice
from .device import Device, Program
from .errors import DeviceError, HexirRuntimeError, HxbFormatError, InputError
from .executor import Constants, Executor
from .format import Entry, Hxb, TensorType, check_table, decode, parse_table
from .reference import ReferenceDevice

DEVICE_NAMES = ("auto", "cpu", "cuda", "reference")


@dataclass(frozen=True)
class Signature:
    """An entry's name, named inputs and outputs; prints as `main(x: float32[2, 8]) -> float32[2, 4]`."""

    name: str
    inputs: tuple[tuple[str, TensorType], ...]
    outputs: tuple[TensorType, ...]

    @classmethod
    def of(cls, entry: Entry) -> Signature:
        """The signature of a (checked) manifest entry."""
        return cls(entry.name, entry.inputs, entry.outputs)

    def __str__(self) -> str:
        arguments = ", ".join(f"{name}: {tensor}" for name, tensor in self.inputs)
        outputs = ", ".join(map(str, self.outputs))
        return f"{self.name}({arguments}) -> {outputs if len(self.outputs) == 1 else f'({outputs})'}"


Source = str | os.PathLike[str] | bytes | bytearray | memoryview | Hxb


def load(source: Source, device: str | Device = "auto", trusted_keys: Any = None, *, prints: bool = True) -> Module:
    """Load a module from a path, the bytes of a .hxb file or a decoded `Hxb`.

    `device` is "auto" (cuda if the module has CUDA kernels and a GPU is usable, else cpu),
    "cpu" (CUDA kernels run as their cpu fallbacks), "cuda", "reference" (numpy, the oracle),
    or a device object such as `CpuDevice(threads=4)`. `trusted_keys` (paths of PEM public keys
    or Ed25519PublicKey objects) loads only a module signed by one of them, checked before its
    manifest is read (signing.py); None loads signed and unsigned modules alike.
    `prints=False` leaves the program's `print` commands out of every call (a server's calls:
    they are slow and flood its log).
    Raises HxbFormatError (UntrustedModuleError: not signed by a trusted key), KeyFileError,
    DeviceError or KernelError; OSError if the file cannot be read; TypeError if `source` is
    none of these (an int is not read as a file descriptor).
    """
    keys = None if trusted_keys is None else signing.trusted_keys(trusted_keys)  # bad keys fail before any work
    if isinstance(source, Hxb):
        data = source.data
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, (str, os.PathLike)) and isinstance(os.fspath(source), str):
        with open(source, "rb") as file:
            data = file.read()
    else:
        raise TypeError(f"load() takes a path, the bytes of a .hxb file or an Hxb, got {type(source).__name__}")
    if keys is not None:
        signing.verify(data, keys)
    # A given Hxb is decoded again when keys are required: its manifest must be the signed bytes'.
    return Module(source if isinstance(source, Hxb) and keys is None else decode(data), device, prints=prints)


class Module:
    """A loaded module: its entries are callable as `module.run(name, *arrays)` or `module.name(*arrays)`.

    It holds device memory (every entry's buffers, the uploaded constants) and loaded GPU code
    until `close()`, the end of a `with` block, or the last reference going away.
    """

    def __init__(self, hxb: Hxb, device: str | Device = "auto", *, prints: bool = True) -> None:
        self.hxb = hxb
        manifest = hxb.manifest
        kinds = {kernel.device for kernel in manifest.kernels}
        kinds |= {buffer.device for entry in manifest.entries for buffer in entry.buffers}
        candidates = _device_objects(device, kinds)
        try:
            devices, loaded = _load_on(hxb, kinds, candidates)
        except DeviceError as error:
            if device != "auto" or not candidates[0].name.startswith("cuda"):
                raise
            # a GPU is there but cannot run this module (e.g. no image for its architecture)
            notice(f"the GPU cannot run this module ({error}); running the CUDA kernels on the cpu", 4)
            candidates = [CpuDevice()]
            devices, loaded = _load_on(hxb, kinds, candidates)
        self.device_name = candidates[0].name
        programs = [loaded[devices[kernel.device]] for kernel in manifest.kernels]
        constants = Constants(hxb)
        self._signatures: dict[str, Signature] = {}
        self._executors: dict[str, Executor] = {}
        # The finalizer holds the resources, never the module, so that it cannot keep it alive.
        # At exit the process gives everything back anyway.
        self._finalizer = weakref.finalize(self, _release, self._executors, constants, list(loaded.values()))
        self._finalizer.atexit = False
        self._lock = threading.Lock()  # an entry's buffers are reused, so one call at a time
        try:
            for entry in manifest.entries:
                self._signatures[entry.name] = Signature.of(entry)
                try:
                    self._executors[entry.name] = Executor(entry, devices, programs, constants, prints)
                except MemoryError:
                    raise DeviceError(f"out of memory allocating the buffers of entry {entry.name!r}") from None
        except BaseException:
            self.close()  # what was loaded and allocated before the failure
            raise

    @property
    def entries(self) -> tuple[str, ...]:
        """The names of the module's entries."""
        return tuple(self._signatures)

    def signature(self, entry: str) -> Signature:
        """The named inputs and the outputs of `entry`."""
        if entry not in self._signatures:
            raise InputError(f"the module has no entry {entry!r} (entries: {', '.join(self._signatures)})")
        return self._signatures[entry]

    def run(self, entry: str, *arrays: Any, out: Any = None, outputs: str = "host") -> Any:
        """Call `entry`: one output returns an array, several a tuple, none None.

        Arguments are numpy arrays or any object with `__dlpack__` (torch, cupy, jax); a CUDA
        tensor is used in place where the entry copies it to the GPU for GPU kernels only.
        The outputs are fresh numpy arrays that the caller owns; or the arrays of `out` (an
        array, or a tuple of one per output), written and returned; or, with
        `outputs="device"`, each output the GPU computes as a fresh GPU array that the caller
        owns and gives to `torch.from_dlpack` (or cupy's, jax's) without a copy (the others
        stay numpy arrays). Raises InputError if the arguments do not match the signature
        (nothing is cast).
        """
        executor = self._executors.get(entry)
        if executor is None:
            self.signature(entry)  # InputError naming the entries
        if outputs != "host" and outputs != "device":
            raise InputError(f"{entry}(): outputs must be 'host' or 'device', got {outputs!r}")
        with self._lock:
            if not self._finalizer.alive:
                raise HexirRuntimeError(f"{entry}(): the module is closed (load it again to call its entries)")
            arguments = _arguments(entry, arrays, executor)
            if out is not None:
                out = _check_out(entry, out, outputs, executor)
            results = executor.run(arguments, out, outputs == "device")
        if not results:
            return None
        return results[0] if len(results) == 1 else tuple(results)

    @property
    def closed(self) -> bool:
        """Whether `close` has run (or the module's resources were freed otherwise)."""
        return not self._finalizer.alive

    def close(self) -> None:
        """Free every entry's buffers and the uploaded constants, and unload the GPU code (idempotent).

        The entries cannot be called afterwards; signatures and entries can still be read.
        """
        with self._lock:
            self._finalizer()

    def __enter__(self) -> Module:
        return self

    def __exit__(self, *exception: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name in self.__dict__.get("_signatures", {}):
            return functools.partial(self.run, name)
        raise AttributeError(f"the module has no attribute or entry {name!r}")

    def __repr__(self) -> str:
        closed = " closed" if self.closed else ""
        return f"<hexir_runtime.Module entries={list(self.entries)} device={self.device_name!r}{closed}>"


def _release(executors: dict[str, Executor], constants: Constants, programs: list[Program]) -> None:
    """Free what a module holds on its devices: buffers, then constants, then loaded code."""
    try:
        for executor in executors.values():
            executor.close()
        constants.close()
    finally:
        for program in programs:
            program.close()


def _arguments(entry: str, arrays: tuple[Any, ...], executor: Executor) -> Sequence[Any]:
    """The arguments as numpy arrays, or DeviceTensors (borrowed CUDA tensors) where the entry
    takes them in place; InputError naming the argument if one does not match the signature."""
    if len(arrays) != len(executor.expected):
        names = [name for name, *_ in executor.expected]
        raise InputError(f"{entry}(): expects {len(names)} argument(s) ({', '.join(names)}), got {len(arrays)}")
    result: Any = arrays
    for index, (name, expected, dtype, shape) in enumerate(executor.expected):
        array = arrays[index]
        if type(array) is np.ndarray and array.dtype == dtype and (array.shape == shape or (
                shape is None and _fits(expected, array.shape))):
            continue  # the common case, checked in a few comparisons (dtype.name alone takes 3 us)
        if result is arrays:
            result = list(arrays)
        if not isinstance(array, np.ndarray):
            if isinstance(array, np.generic) or not hasattr(array, "__dlpack__"):
                raise InputError(f"{entry}(): argument {name!r} expects a numpy array {expected}, "
                                 f"got {type(array).__name__}")
            try:
                array = result[index] = dlpack.tensor_of(array, executor.stream, executor.wait is not None)
            except InputError as error:
                raise InputError(f"{entry}(): argument {name!r}: {error}") from None
            except HexirRuntimeError:
                raise
            except Exception as error:  # noqa: BLE001 - the producer refused to lend it
                raise InputError(f"{entry}(): argument {name!r}: the {type(array).__name__} cannot be read "
                                 f"({type(error).__name__}: {error})") from None
            if isinstance(array, dlpack.DeviceTensor):
                _check_device_tensor(entry, name, expected, dtype, shape, array, index, executor)
                if array.stream is not None:  # written on a stream of its producer's: ours follows it
                    executor.wait(array.stream)
                continue
        if array.dtype.name != expected.dtype or not array.dtype.isnative or not _fits(expected, array.shape):
            dtype = array.dtype.name if array.dtype.isnative else array.dtype.str
            actual = f"{dtype}[{', '.join(map(str, array.shape))}]"
            raise InputError(f"{entry}(): argument {name!r} expects {expected}, got {actual}")
    return result


def _fits(expected: TensorType, shape: tuple[int, ...]) -> bool:
    return len(shape) == len(expected.shape) and all(
        isinstance(dim, str) or dim == size for dim, size in zip(expected.shape, shape, strict=True))


def _check_device_tensor(entry: str, name: str, expected: TensorType, dtype: np.dtype, shape: tuple[int, ...] | None,
                         tensor: dlpack.DeviceTensor, index: int, executor: Executor) -> None:
    """InputError unless a CUDA tensor is one the entry can read in place: on the module's GPU,
    of the expected dtype and shape (`shape` where it has no symbol), C-contiguous, 16-byte aligned."""
    gpu = executor.gpus[0].device if executor.gpus else None
    problem = None  # (before, after the tensor's description); each check a comparison or two
    if index not in executor.device_inputs or gpu is None:
        problem = f"is read on the host: expects a host (numpy or CPU DLPack) {expected}, got", ""
    elif tensor.device != (dlpack.CUDA, gpu.ordinal):
        problem = f"expects {expected} on cuda:{gpu.ordinal} (the module's GPU), got", ""
    elif tensor.dtype != dtype or (tensor.shape != shape if shape is not None else not _fits(expected, tensor.shape)):
        problem = f"expects {expected} on cuda:{gpu.ordinal}, got", ""
    elif not tensor.contiguous:
        problem = "expects a C-contiguous tensor, got", f" with strides {tensor.strides} (in elements; " \
                                                        ".contiguous() makes one)"
    elif tensor.pointer % 16 and tensor.nbytes and tensor.shape[-1] * tensor.dtype.itemsize % 16 == 0:
        # kernels read rows of a multiple of 16 bytes 16 bytes at a time: such rows start aligned
        problem = "expects a tensor at a 16-byte aligned address, got", f" at {tensor.pointer:#x} (.clone() makes one)"
    if problem is not None:
        raise InputError(f"{entry}(): argument {name!r} {problem[0]} {dlpack.describe(tensor)}{problem[1]}")


def _check_out(entry: str, out: Any, outputs: str, executor: Executor) -> Sequence[np.ndarray]:
    """`out` as a tuple of one writable numpy array per output, each of the output's dtype and shape."""
    if type(out) is np.ndarray and outputs == "host" and len(executor.returned) == 1:
        _, dtype, shape = executor.returned[0]
        if out.dtype == dtype and out.shape == shape and out.flags.writeable:
            return (out,)  # the common case, in three comparisons
    arrays = out if isinstance(out, (tuple, list)) else (out,)
    where = f"{entry}(): out"
    if outputs == "device":
        raise InputError(f"{where} takes host arrays: it cannot be combined with outputs='device'")
    if len(arrays) != len(executor.entry.outputs):
        raise InputError(f"{where} has {len(arrays)} array(s) for {len(executor.entry.outputs)} output(s)")
    for position, (array, (expected, dtype, shape)) in enumerate(zip(arrays, executor.returned, strict=True)):
        if type(array) is not np.ndarray or not array.flags.writeable:
            raise InputError(f"{where}[{position}] must be a writable numpy array {expected}, "
                             f"got {type(array).__name__}")
        if array.dtype != dtype or (array.shape != shape and (shape is not None or not _fits(expected, array.shape))):
            raise InputError(f"{where}[{position}] expects {expected}, got "
                             f"{array.dtype.name}[{', '.join(map(str, array.shape))}]")
    return tuple(arrays)


def _load_on(hxb: Hxb, kinds: set[str], candidates: list[Device]) -> tuple[dict[str, Device], dict[Device, Program]]:
    """Which device runs each manifest device, and each device's loaded program (loaded once)."""
    devices = _place(kinds, candidates)
    if "cuda" in devices and not isinstance(devices["cuda"], (CpuDevice, ReferenceDevice)):
        _check_cuda_table(hxb)  # before any GPU code is loaded
    loaded: dict[Device, Program] = {}
    try:
        for place in devices.values():
            if place not in loaded:
                loaded[place] = place.load(hxb)
    except BaseException:
        for program in loaded.values():  # what loaded before the failure
            program.close()
        raise
    return devices, loaded


def _place(kinds: set[str], candidates: list[Device]) -> dict[str, Device]:
    """Which of `candidates` runs each manifest device ("cpu", "cuda") the module uses."""
    placement = {}
    for kind in sorted(kinds):
        runners = [candidate for candidate in candidates if kind in candidate.kinds]
        if not runners:
            raise DeviceError(f"this module has {kind} kernels or buffers, which {candidates[0].name} cannot run")
        placement[kind] = runners[0]
    return placement


def _device_objects(device: str | Device, kinds: set[str]) -> list[Device]:
    """The device objects `device` names for a module using `kinds`, the main one first."""
    if not isinstance(device, str):
        return [device]
    if device == "auto" and "cuda" in kinds:
        try:
            return [_cuda_device(), CpuDevice(fallbacks=False)]
        except DeviceError as error:  # no usable GPU: the CUDA kernels run as their cpu fallbacks
            notice(f"no usable GPU ({error}); running the CUDA kernels on the cpu")
    if device in ("auto", "cpu"):
        return [CpuDevice()]
    if device == "reference":
        return [ReferenceDevice()]
    if device == "cuda":
        if "cuda" not in kinds:
            raise DeviceError("this module has no CUDA kernels (run it with --device=cpu)")
        return [_cuda_device(), CpuDevice(fallbacks=False)]
    raise DeviceError(f"unknown device {device!r} (expected one of {', '.join(DEVICE_NAMES)})")


_cuda_devices: list[Device] = []


def _cuda_device() -> Device:
    """The process's CUDA device (GPU 0), made once; DeviceError if there is no usable one."""
    if not _cuda_devices:
        from .cuda import CudaDevice  # imports cuda-python lazily: cpu-only installs never need it

        try:
            _cuda_devices.append(CudaDevice())
        except DeviceError as error:
            if "cuda-python" in str(error) and not has_cuda_driver():  # the real reason: no GPU at all
                raise DeviceError("no CUDA driver on this machine (libcuda.so.1 cannot be loaded)") from None
            raise
    return _cuda_devices[0]


def has_cuda_driver() -> bool:
    """Whether the CUDA driver library loads (without cuda-python)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


# Notices already given: "no usable GPU" is said once per process with its reason, not per module or shape.
_notices: set[str] = set()


def notice(message: str, stacklevel: int = 5) -> None:
    """Warn (RuntimeWarning) with `message` unless this process has already said it."""
    if message not in _notices:
        _notices.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def _check_cuda_table(hxb: Hxb) -> None:
    """Check the CUDA kernels against the table the compiler wrote next to their images (a file
    of any version without one is refused); HxbFormatError naming the kernel and field on any difference."""
    manifest = hxb.manifest
    if manifest.cuda_table is None:
        raise HxbFormatError("cuda", "no kernel table for the CUDA kernels: built by an older compiler?")
    where = f"the CUDA kernels (blob {manifest.cuda_table})"
    table, _ = parse_table(bytes(hxb.blob(manifest.cuda_table)), "cuda.table")
    check_table(hxb, table, [i for i, kernel in enumerate(manifest.kernels) if kernel.gpu_code], True, where)
