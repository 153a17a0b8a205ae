"""The DLPack protocol (https://dmlc.github.io/dlpack/latest/), both ways, with ctypes only.

Importing: `tensor_of(obj)` reads any object with `__dlpack__` (torch, cupy, jax, numpy). A
host tensor becomes a numpy array through `np.from_dlpack` (no copy); a CUDA tensor becomes a
`DeviceTensor`: its device pointer, shape and dtype, read from the capsule's DLManagedTensor,
whose deleter runs when the DeviceTensor is released (`release`, or garbage collection). The
producer is asked for the tensor on our stream (`stream=`), so our kernels run after its writes.
A CUDA tensor with `__cuda_array_interface__` is read through that dict instead, a torch CUDA
tensor through its own methods (each cheaper than the last; see `tensor_of`).

Exporting: `DLPackArray` wraps memory that we own (a device output of a call) as an object
that `from_dlpack` of torch, cupy, jax or numpy takes without a copy. Each capsule holds a
reference to the array (Py_IncRef through `manager_ctx`), dropped by the deleter the consumer
calls, so the memory lives while either the array or any consumer's tensor does. Before
handing out a capsule, `ready(stream)` makes the consumer's stream wait for our work.

Only legacy (unversioned, "dltensor") capsules are made and read: every producer and consumer
of DLPack >= 0.6 speaks them.
"""

from __future__ import annotations

import ctypes
import math
import struct
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import InputError

CPU, CUDA, CUDA_HOST = 1, 2, 3  # DLDeviceType
INT, FLOAT, BFLOAT = 0, 2, 4  # DLDataTypeCode kDLInt, kDLFloat, kDLBfloat


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.Py_IncRef.argtypes = _api.Py_DecRef.argtypes = [ctypes.py_object]
_CAPSULE_GET = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(("PyCapsule_GetPointer", _api))
_DECREF = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)(("Py_DecRef", _api))


class DeviceTensor:
    """A caller's tensor in GPU memory, borrowed through DLPack for one call."""

    def __init__(self, pointer: int, shape: tuple[int, ...], dtype: np.dtype, device: tuple[int, int],
                 strides: tuple[int, ...] | None, managed: Any) -> None:
        self.pointer, self.shape, self.dtype, self.device, self.strides = pointer, shape, dtype, device, strides
        self.nbytes = math.prod(shape) * dtype.itemsize
        self._managed = managed  # the DLManagedTensor, whose deleter we owe the producer
        self.stream: int | None = None  # a producer's stream our work must follow (the interface's)

    @property
    def contiguous(self) -> bool:
        """Whether the strides (in elements) are C order's, ignoring axes of extent 1."""
        if self.strides is None:
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def release(self) -> None:
        """Tell the producer we are done with its tensor (idempotent)."""
        managed, self._managed = self._managed, None
        if managed and managed.contents.deleter:
            managed.contents.deleter(managed)

    __del__ = release


def tensor_of(obj: Any, stream: int | None = None, interface: bool = False) -> np.ndarray | DeviceTensor:
    """The host array or the device tensor `obj` (an ndarray or an object with `__dlpack__`)
    holds; a device tensor's producer is asked to make it ready on `stream` (None: sync it).

    With `interface`, a CUDA tensor that also has `__cuda_array_interface__` (torch, cupy,
    numba) is read through that instead: a dict, where torch's `__dlpack__(stream=)` costs ~15
    µs of Python a call (a torch tensor of a dtype we read that needs no grad: through its
    methods, cheaper still, when torch is imported). Then nothing waits yet: the DeviceTensor's
    `stream` is the stream the caller must order its own after (None: none), the one the
    interface names, or for torch, whose interface names none, torch's current stream on the
    tensor's device (what its `__dlpack__` would have waited for)."""
    if isinstance(obj, np.ndarray):
        return obj
    torch = sys.modules.get("torch")
    if interface and torch is not None and type(obj) is torch.Tensor and obj.is_cuda and not obj.requires_grad:
        found = _torch_tensor(obj, torch)
        if found is not None:
            return found
    device_type, device_id = obj.__dlpack_device__()
    if device_type in (CPU, CUDA_HOST):
        capsule = obj.__dlpack__()
        address = _api.PyCapsule_GetPointer(capsule, b"dltensor")
        if _DLTENSOR.unpack(ctypes.string_at(address, _DLTENSOR.size))[4] == BFLOAT:  # numpy has none (ml_dtypes has)
            return _host_array(unpack(capsule))
        return np.from_dlpack(_Capsule(capsule, (device_type, device_id)))
    if device_type == CUDA and interface:
        try:
            found = obj.__cuda_array_interface__
        except Exception:  # noqa: BLE001 - none, or none for this tensor (torch: bfloat16): DLPack says why
            found = None
        if found is not None:
            return _interfaced(obj, found, device_id)
    capsule = obj.__dlpack__(stream=stream) if stream is not None else obj.__dlpack__()
    return unpack(capsule)


_TYPESTRS = {**{f"<f{size}": np.dtype(f"float{size * 8}") for size in (2, 4, 8)}, "<i4": np.dtype("int32"),
             "<i8": np.dtype("int64")}


def _interfaced(obj: Any, interface: Any, device_id: int) -> DeviceTensor:
    """The DeviceTensor a `__cuda_array_interface__` (version 2 or 3) describes; InputError if
    the dict is not one (a bug in its producer)."""
    try:
        shape, typestr, (pointer, _) = tuple(interface["shape"]), interface["typestr"], interface["data"]
        strides = interface.get("strides")
        stream = interface["stream"] if "stream" in interface else _torch_stream(obj, device_id)
        if interface.get("mask") is not None:
            raise InputError(f"a {type(obj).__name__} with a mask: masked CUDA arrays are not supported")
        if not all(type(n) is int and n >= 0 for n in shape) or type(pointer) is not int or len(shape) > MAX_NDIM:
            raise TypeError(f"shape {shape}, data {pointer!r}")
        dtype = _TYPESTRS.get(typestr) or np.dtype(typestr)
        if strides is not None:  # in bytes: in elements, as DLPack's (a fraction is never contiguous)
            strides = tuple(s // dtype.itemsize if s % dtype.itemsize == 0 else s / dtype.itemsize
                            for s in map(int, strides))
            if len(strides) != len(shape):
                raise TypeError(f"{len(strides)} strides for {len(shape)} axes")
        if stream is not None and type(stream) is not int:
            raise TypeError(f"stream {stream!r}")
    except InputError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever the dict holds
        raise InputError(f"a {type(obj).__name__} whose __cuda_array_interface__ is not one ({error})") from None
    result = DeviceTensor(pointer, shape, dtype, (CUDA, device_id), strides, None)
    result.owner = obj  # held for the call, as a capsule would hold it
    result.stream = None if stream in (None, 0, 1) else stream  # 0, 1: the legacy default stream,
    if dtype.kind != "f" or dtype.itemsize not in (2, 4, 8) or not dtype.isnative:  # which ours follows
        result.dtype_text = dtype.name if dtype.isnative else dtype.str
    return result


def _torch_tensor(obj: Any, torch: Any) -> DeviceTensor | None:
    """A torch CUDA tensor read through its own methods (~1.5 µs, where its
    `__cuda_array_interface__` costs ~5 and `__dlpack__` ~15); None for a dtype we do not read
    (the general path then says why)."""
    dtypes = _TORCH_DTYPES.get(torch)
    if dtypes is None:
        dtypes = _TORCH_DTYPES[torch] = {getattr(torch, name): np.dtype(name)
                                         for name in ("float16", "float32", "float64", "int32", "int64")}
        if _bfloat16() is not None:
            dtypes[torch.bfloat16] = _bfloat16()
    dtype = dtypes.get(obj.dtype)
    if dtype is None:
        return None
    device_id = obj.get_device()
    strides = None if obj.is_contiguous() else tuple(obj.stride())  # None: C order, nothing to check
    result = DeviceTensor(obj.data_ptr(), tuple(obj.shape), dtype, (CUDA, device_id), strides, None)
    result.owner = obj  # held for the call, as a capsule would hold it
    stream = _torch_current_stream(torch, device_id)  # (a torch tensor: what _torch_stream would find)
    result.stream = None if stream in (0, 1) else stream
    return result


#: Per torch module (whichever `sys.modules["torch"]` is: never imported here), the dtypes we read.
_TORCH_DTYPES: dict[Any, dict[Any, np.dtype]] = {}


def _torch_stream(obj: Any, device_id: int) -> int | None:
    """For a torch tensor (whose interface names no stream): torch's current stream's handle on
    its device. Another producer that names none promises, by the protocol, a ready tensor."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor):
        return None
    return _torch_current_stream(torch, device_id)


def _torch_current_stream(torch: Any, device_id: int) -> int:
    """torch's current stream's handle on a device."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # the handle, without a Stream object
    return raw(device_id) if raw is not None else torch.cuda.current_stream(device_id).cuda_stream


#: DLTensor's fields up to its byte offset: data, device (type, id), ndim, dtype (code, bits,
#: lanes), shape, strides, byte_offset: read in one struct.unpack (field by field through
#: ctypes costs several microseconds a call)
_DLTENSOR = struct.Struct("<QiiiBBHQQQ")
_DTYPES = {**{(FLOAT, bits): np.dtype(f"float{bits}") for bits in (16, 32, 64)}, (INT, 32): np.dtype("int32"),
           (INT, 64): np.dtype("int64")}


#: More dimensions than a producer's tensor can sensibly have: its DLTensor is refused as corrupt.
MAX_NDIM = 64


def unpack(capsule: Any) -> DeviceTensor:
    """The DLTensor of a (legacy) DLPack capsule, which is marked consumed; InputError (the
    capsule left to its producer) if its dimension count is impossible."""
    address = _api.PyCapsule_GetPointer(capsule, b"dltensor")
    data, device_type, device_id, ndim, code, bits, lanes, shape_at, strides_at, offset = \
        _DLTENSOR.unpack(ctypes.string_at(address, _DLTENSOR.size))
    if not 0 <= ndim <= MAX_NDIM or (ndim and not shape_at):
        raise InputError(f"a DLPack tensor with ndim {ndim} and shape at {shape_at:#x}: not a tensor this "
                         "runtime can read (a bug in its producer)")
    _api.PyCapsule_SetName(capsule, b"used_dltensor")  # ours now: its destructor must not free it
    shape = struct.unpack(f"<{ndim}q", ctypes.string_at(shape_at, 8 * ndim)) if ndim else ()
    strides = struct.unpack(f"<{ndim}q", ctypes.string_at(strides_at, 8 * ndim)) if ndim and strides_at else None
    dtype = (_bfloat16() if (code, bits) == (BFLOAT, 16) else _DTYPES.get((code, bits))) if lanes == 1 else None
    result = DeviceTensor(data + offset, shape, dtype or np.dtype("V1"), (device_type, device_id), strides,
                          ctypes.cast(address, ctypes.POINTER(DLManagedTensor)))
    if dtype is None:
        result.dtype_text = f"code {code} bits {bits} lanes {lanes}"
    return result


class _Capsule:
    """A capsule already taken from its producer, for `np.from_dlpack`."""

    def __init__(self, capsule: Any, device: tuple[int, int]) -> None:
        self.capsule, self.device = capsule, device

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(self, **_: Any) -> Any:
        return self.capsule


def _bfloat16() -> np.dtype | None:
    """ml_dtypes' bfloat16, or None where it is not installed (then a bfloat16 tensor's dtype is
    unknown, and a module's bfloat16 input has already said to install it)."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def _host_array(tensor: DeviceTensor) -> np.ndarray:
    """A host DLTensor numpy cannot read itself (bfloat16) as a numpy array of its memory, which
    keeps the tensor (and so the producer's memory) alive."""
    if getattr(tensor, "dtype_text", None) or any(s < 0 for s in tensor.strides or ()):
        raise InputError(f"a host DLPack tensor of {describe(tensor)}{' with negative strides' * bool(tensor.strides)}"
                         ": not one this runtime reads")
    size = tensor.dtype.itemsize
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.strides or (), strict=False)) \
        if tensor.strides else math.prod(tensor.shape)
    memory = (ctypes.c_char * (size * extent if all(tensor.shape) else 0)).from_address(tensor.pointer)
    memory.tensor = tensor  # released with the array
    flat = np.frombuffer(memory, tensor.dtype)
    strides = tuple(s * size for s in tensor.strides) if tensor.strides else None
    return np.lib.stride_tricks.as_strided(flat, tensor.shape, strides) if strides else flat.reshape(tensor.shape)


def describe(tensor: DeviceTensor) -> str:
    """`float32[2, 8] on cuda:0`, for error messages."""
    dtype = getattr(tensor, "dtype_text", None) or tensor.dtype.name
    kind = {CUDA: "cuda"}.get(tensor.device[0], f"DLPack device type {tensor.device[0]}")
    return f"{dtype}[{', '.join(map(str, tensor.shape))}] on {kind}:{tensor.device[1]}"


# --- exporting -------------------------------------------------------------------------------------


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _delete(managed: int, _word=ctypes.c_void_p.from_address, _decref=_DECREF,
            _at=DLManagedTensor.manager_ctx.offset) -> None:
    """The deleter of our DLManagedTensors: drop the capsule's reference to its DLPackArray
    (its manager_ctx, read from the struct's bytes: no ctypes structure built). What it calls is
    bound here: a consumer (jax) may free a tensor at interpreter exit, after this module's
    globals are gone."""
    _decref(_word(managed + _at).value)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _destroy_capsule(capsule: int) -> None:
    """A capsule nobody consumed: run the deleter ourselves (the protocol's rule)."""
    if _api.PyCapsule_IsValid(capsule, b"dltensor"):
        managed = ctypes.cast(_CAPSULE_GET(capsule, b"dltensor"), ctypes.POINTER(DLManagedTensor))
        managed.contents.deleter(managed)


_DELETE_AT = ctypes.cast(_delete, ctypes.c_void_p).value
_DESTROY_AT = ctypes.cast(_destroy_capsule, ctypes.c_void_p).value
_MANAGED_BYTES = ctypes.c_char * ctypes.sizeof(DLManagedTensor)


# A DLManagedTensor as one struct.pack: DLTensor (data, device type and id, ndim, dtype code,
# bits, lanes, shape, strides, byte_offset), manager_ctx, deleter: one ctypes object per export
# instead of five (an export cost ~7 us of Python, now ~3).
_MANAGED = struct.Struct("<QiiiBBHQQQQQ")
_MANAGER_AT = DLManagedTensor.manager_ctx.offset
assert _MANAGED.size == ctypes.sizeof(DLManagedTensor) and _MANAGER_AT == 48
_NEW_CAPSULE = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", _api))
_INCREF = ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_IncRef", _api))


#: The int64 arrays of the shapes exported lately, shared by their DLPackArrays (never written).
_SHAPES: dict[tuple[int, ...], Any] = {}


def _shape_of(shape: tuple[int, ...]) -> Any:
    if len(_SHAPES) >= 64:  # a caller of ever new sizes: start again (each array keeps its own)
        _SHAPES.clear()
    made = _SHAPES[shape] = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    return made


class DLPackArray:
    """Memory we own, lent through DLPack: `torch.from_dlpack(array)` and the like take it as is.

    `free(pointer)` runs when the array and every tensor made from it are gone; `ready(stream)`
    runs before each export, to order the consumer's `stream` after our writes.
    """

    def __init__(self, pointer: int, shape: tuple[int, ...], dtype: np.dtype, device: tuple[int, int],
                 free: Callable[[int], None] | None = None, ready: Callable[[int | None], None] | None = None) -> None:
        self.pointer, self.shape, self.device = pointer, tuple(shape), device
        self.dtype = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
        self._free, self._ready = free, ready
        # What the DLManagedTensors point at: kept with the array, which outlives them all.
        self._shape = _SHAPES.get(self.shape) or _shape_of(self.shape)
        self._exports: list[Any] = []
        code = INT if self.dtype.kind == "i" else BFLOAT if self.dtype.name == "bfloat16" else FLOAT
        self._managed = (pointer, device[0], device[1], len(self.shape), code, self.dtype.itemsize * 8, 1,
                         ctypes.addressof(self._shape), 0, 0, id(self), _DELETE_AT)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(self, stream: int | None = None, max_version: Any = None, dl_device: Any = None,
                   copy: bool | None = None) -> Any:
        if copy:
            raise BufferError("this array is exported without a copy only (copy=True is not supported)")
        if dl_device is not None and tuple(dl_device) != self.device:
            raise BufferError(f"this array lives on DLPack device {self.device}, not {tuple(dl_device)}")
        if self._ready is not None and stream != -1:
            self._ready(stream)
        managed = _MANAGED_BYTES.from_buffer_copy(_MANAGED.pack(*self._managed))  # C-contiguous: no strides
        _INCREF(self)  # dropped by _delete, when the consumer is done
        self._exports.append(managed)
        return _NEW_CAPSULE(ctypes.addressof(managed), b"dltensor", _DESTROY_AT)

    def __del__(self, _finalizing=sys.is_finalizing) -> None:
        if self._free is not None and not _finalizing():  # (at exit the driver frees it, and the
            self._free(self.pointer)                      # runtime's modules may be gone already)

    def __repr__(self) -> str:
        return f"<DLPackArray {self.dtype.name}[{', '.join(map(str, self.shape))}] on device {self.device}>"
