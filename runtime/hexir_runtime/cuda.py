"""The CUDA device: device buffers and the module's CUBIN/PTX, driven through cuda-python.

Only the driver API (`cuda.bindings.driver`) is used, and every call goes through `check`,
which turns a failing CUresult into a DeviceError naming the call and the driver's message.
The image that fits the GPU is chosen from the kernel's `images` (docs/hxb-format.md): the
CUBIN of its own architecture, else one of the same major version and a lower minor, else
the PTX (JIT-compiled by the driver) if its virtual architecture is not above the GPU's, else
a custom kernel's fatbin (the driver picks inside it). A kernel takes its `sizes` (a custom
kernel its `scalars`) as 64-bit integers after its device pointers; its grid is evaluated per
call, and a grid with an empty axis is not launched.

The call path (CudaProgram, one per loaded module): everything a call does on the GPU is
queued on the module's own stream, in order, and the host waits (cuStreamSynchronize) only
where it needs data: a transfer to a host buffer (an output, a print). Host buffers that
meet the GPU are page-locked (`alloc_pinned`, the executor's staging buffers, reused and grown
like any buffer), so copies are truly asynchronous. A kernel's parameter block (the values
and the `void*` array pointing at them) is built once per kernel and call shape by `launcher`;
a call rewrites only the slots of pointers that change (a caller's tensor, a fresh output).
`output` makes a call's device outputs: fresh stream-ordered allocations that the caller owns
through DLPack. The device-level copies (`CudaDevice.copy_in`...) stay synchronous: they serve
load time (constants) and tools.
"""

from __future__ import annotations

import collections
import ctypes
import math
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .dlpack import CUDA, DLPackArray
from .errors import DeviceError, KernelError
from .format import Hxb, Kernel, Launch, evaluate, to_text
from .format.attention import misaligned_view
from .tensormap import TensorMaps


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python < 12.6
        except ImportError:
            raise DeviceError("CUDA support needs cuda-python: pip install 'hexir-runtime[cuda]'") from None
    return driver


_success: list[Any] = [None]  # the driver's CUDA_SUCCESS, once seen: enum members are singletons


def check(result: tuple, call: str) -> Any:
    """The values a driver call returns after its CUresult, or DeviceError if it failed."""
    status = result[0]
    if status is not _success[0]:  # on the call path, an identity test instead of an import and a lookup
        driver = _driver()
        if status != driver.CUresult.CUDA_SUCCESS:
            _, text = driver.cuGetErrorString(status)
            message = text.decode() if isinstance(text, bytes) else str(text)
            raise DeviceError(f"{call} failed: {getattr(status, 'name', status)} ({message})")
        _success[0] = status
    return result[1] if len(result) == 2 else tuple(result[1:])


class DeviceBuffer:
    """A block of device memory holding a C-contiguous array of `shape` and `dtype`."""

    def __init__(self, pointer: Any, shape: tuple[int, ...], dtype: str) -> None:
        self.pointer = pointer
        self.shape = shape
        self.dtype = np.dtype(dtype)
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * self.dtype.itemsize


#: The most blocks a grid has along x, y, z; the dynamic shared memory a block gets without opting in.
MAX_GRID = (2**31 - 1, 65535, 65535)
DEFAULT_SHARED_BYTES = 48 * 1024
#: Device outputs given back that a module keeps, per size, for later calls' outputs.
SPARE_OUTPUTS = 4
#: A result copied to the host at least this big comes back in page-locked memory (`copy_out`).
#: Device outputs and page-locked results given back are kept for later calls of SPARE_SIZES sizes.
PINNED_RESULT_BYTES, SPARE_SIZES = 1 << 20, 8

#: The oldest architecture the compiler targets (CUDA 13's ptxas starts there).
OLDEST_TARGET = 75


def pick_image(images: dict[str, int], major: int, minor: int) -> tuple[str, int]:
    """The (architecture, blob) to load on a GPU of compute capability major.minor: its own
    architecture-specific image (sm_90a: on 9.0 alone) first, then the newest plain CUBIN of its
    major version not newer than it, then the newest PTX not newer than it."""
    own = major * 10 + minor
    for arch in (f"sm_{own}a", f"sm_{own}"):
        if arch in images:
            return arch, images[arch]
    cubins = {int(arch[3:]): (arch, blob) for arch, blob in images.items() if arch.startswith("sm_")
              and not arch.endswith("a")}
    compatible = [cc for cc in cubins if cc // 10 == major and cc <= own]
    if compatible:
        return cubins[max(compatible)]
    ptx = {int(arch[8:]): (arch, blob) for arch, blob in images.items() if arch.startswith("compute_")
           and not arch.endswith("a")}
    if f"compute_{own}a" in images:
        return f"compute_{own}a", images[f"compute_{own}a"]
    usable = [cc for cc in ptx if cc <= own]
    if usable:
        return ptx[max(usable)]
    if "fatbin" in images:  # last: we cannot tell what it holds, the driver can
        return "fatbin", images["fatbin"]
    advice = (f"recompile with -target=cuda:sm_{own}" if own >= OLDEST_TARGET else
              f"hexir generates code for sm_{OLDEST_TARGET} and newer only")
    raise DeviceError(
        f"this module has CUDA code for {', '.join(sorted(images))}, none of which runs on this GPU "
        f"(sm_{own}); {advice}")


class CudaDevice:
    """GPU 0 of this machine, through its primary context."""

    kinds = ("cuda",)

    def __init__(self, ordinal: int = 0) -> None:
        driver = self.driver = _driver()
        try:
            status = driver.cuInit(0)
        except RuntimeError as error:  # cuda-python raises when libcuda.so cannot be loaded
            raise DeviceError(f"no CUDA driver on this machine ({error})") from None
        check(status, "cuInit")
        count = check(driver.cuDeviceGetCount(), "cuDeviceGetCount")
        if ordinal >= count:
            raise DeviceError(f"no CUDA device {ordinal}: this machine has {count}")
        self.device = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
        self.capability = tuple(check(driver.cuDeviceGetAttribute(getattr(
            driver.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_{part}"), self.device),
            "cuDeviceGetAttribute") for part in ("MAJOR", "MINOR"))  # (major, minor)
        raw = check(driver.cuDeviceGetName(256, self.device), "cuDeviceGetName")
        self.gpu_name = raw.split(b"\0")[0].decode()
        self.name = f"cuda ({self.gpu_name})"
        self.ordinal = ordinal
        self.context = check(driver.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self.make_current()
        try:  # keep freed device outputs in the stream-ordered pool, as torch's caching allocator does
            pool = check(driver.cuDeviceGetDefaultMemPool(self.device), "cuDeviceGetDefaultMemPool")
            check(driver.cuMemPoolSetAttribute(pool, driver.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                               driver.cuuint64_t(2**64 - 1)), "cuMemPoolSetAttribute")
        except Exception:  # noqa: BLE001 - an optimisation only: without it the pool returns memory sooner
            pass

    def make_current(self) -> None:
        """Bind this device's context to the calling thread (CUDA contexts are per thread)."""
        check(self.driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def alloc(self, shape: tuple[int, ...], dtype: str) -> DeviceBuffer:
        """Device memory for an array (at least one byte, so that every buffer has an address)."""
        self.make_current()
        buffer = DeviceBuffer(None, shape, dtype)
        buffer.pointer = check(self.driver.cuMemAlloc(max(buffer.nbytes, 1)), "cuMemAlloc")
        return buffer

    def view(self, buffer: DeviceBuffer, shape: tuple[int, ...]) -> DeviceBuffer:
        """The start of `buffer`'s memory as an array of `shape` (freed with `buffer`, not on its own)."""
        return DeviceBuffer(buffer.pointer, shape, buffer.dtype)

    def free(self, buffer: DeviceBuffer) -> None:
        """Give the buffer's device memory back."""
        self.make_current()
        check(self.driver.cuMemFree(buffer.pointer), "cuMemFree")

    def alloc_pinned(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """A host array in page-locked memory, which the GPU copies from and to asynchronously."""
        self.make_current()
        dtype = np.dtype(dtype)
        nbytes = max(math.prod(shape) * dtype.itemsize, 1)
        pointer = int(check(self.driver.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc"))
        memory = (ctypes.c_char * nbytes).from_address(pointer)
        return np.frombuffer(memory, dtype, math.prod(shape)).reshape(shape)

    def free_pinned(self, array: np.ndarray) -> None:
        """Give back the page-locked memory of an `alloc_pinned` array (its views must be gone)."""
        self.make_current()
        check(self.driver.cuMemFreeHost(array.ctypes.data), "cuMemFreeHost")

    def copy_in(self, buffer: DeviceBuffer, array: np.ndarray) -> None:
        """Copy host `array` (the buffer's shape and dtype) to the device; straight from it if C-contiguous."""
        host = np.ascontiguousarray(array, dtype=buffer.dtype)
        if buffer.nbytes:
            self.make_current()
            check(self.driver.cuMemcpyHtoD(buffer.pointer, host.ctypes.data, buffer.nbytes), "cuMemcpyHtoD")

    def copy_out(self, buffer: DeviceBuffer) -> np.ndarray:
        """A fresh host array with the buffer's contents, owned by the caller."""
        host = np.empty(buffer.shape, buffer.dtype)
        self.copy_out_into(buffer, host)
        return host

    def copy_out_into(self, buffer: DeviceBuffer, array: np.ndarray) -> None:
        """Copy the buffer's contents into host `array` (its shape and dtype); straight into it if C-contiguous."""
        if not array.flags.c_contiguous:
            array[...] = self.copy_out(buffer)
        elif buffer.nbytes:
            self.make_current()
            check(self.driver.cuMemcpyDtoH(array.ctypes.data, buffer.pointer, buffer.nbytes), "cuMemcpyDtoH")

    def synchronize(self) -> None:
        """Wait for everything launched on the device (a failed kernel's error surfaces here)."""
        self.make_current()
        check(self.driver.cuCtxSynchronize(), "cuCtxSynchronize")

    def load(self, hxb: Hxb) -> CudaProgram:
        """Load each fitting image once per module and look up every CUDA kernel in its image."""
        self.make_current()
        program = CudaProgram(self, {})
        program.stream = check(self.driver.cuStreamCreate(0), "cuStreamCreate")  # blocking: ordered after
        # the legacy default stream, where torch works unless told otherwise
        program.event = check(self.driver.cuEventCreate(2), "cuEventCreate")  # CU_EVENT_DISABLE_TIMING
        program.wait_event = check(self.driver.cuEventCreate(2), "cuEventCreate")
        try:
            modules: dict[int, Any] = {}  # by blob
            for index, kernel in enumerate(hxb.manifest.kernels):
                code = kernel.gpu_code
                if code is None:
                    continue
                if kernel.op == "attention" and (why := misaligned_view(kernel.args, kernel.views)):
                    raise KernelError(f"kernels[{index}] ({kernel.name}).{why}")
                arch, blob = pick_image(code.images, *self.capability)
                code = code.for_image(arch)  # (an sm_XYa variant: only from its own image)
                if blob not in modules:
                    image = bytes(hxb.blob(blob))
                    if arch.startswith("compute_"):
                        image += b"\0"  # the driver reads PTX as a C string
                    modules[blob] = check(self.driver.cuModuleLoadData(image), f"cuModuleLoadData ({arch})")
                    program.modules.append(modules[blob])
                functions = {}  # the kernel's symbol and its variants'
                for symbol, launch in [(code.symbol, code.launch), *((v.symbol, v.launch) for v in code.variants)]:
                    try:
                        function = check(self.driver.cuModuleGetFunction(modules[blob], symbol.encode()),
                                         "cuModuleGetFunction")
                        if launch.shared_bytes > DEFAULT_SHARED_BYTES:  # a bigger block needs opting in
                            attribute = self.driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                            check(self.driver.cuFuncSetAttribute(function, attribute, launch.shared_bytes),
                                  "cuFuncSetAttribute")
                    except DeviceError as error:
                        raise KernelError(f"kernels[{index}] ({kernel.name}): {error}") from None
                    functions[symbol] = function
                program.kernels[index] = (functions, kernel, code)
        except BaseException:
            program.close()  # the images loaded before the failure
            raise
        return program


def _keep(spares: dict[int, list[int]], nbytes: int, pointer: int) -> bool:
    """Keep `pointer` among `spares` (by size) for a later call, if there is room: up to
    SPARE_OUTPUTS of a size, of SPARE_SIZES sizes."""
    kept = spares.get(nbytes)
    if kept is None and len(spares) < SPARE_SIZES:
        kept = spares.setdefault(nbytes, [])
    if kept is None or len(kept) >= SPARE_OUTPUTS:
        return False
    kept.append(pointer)
    return True


class CudaProgram:
    """The module's CUDA kernels, its stream, and the stream-ordered copies of its calls."""

    def __init__(self, device: CudaDevice, kernels: dict[int, tuple[Any, Kernel, Launch]]) -> None:
        self.device = device
        self.driver = device.driver
        self.kernels = kernels
        self.modules: list[Any] = []  # the loaded CUmodules, unloaded by close
        self.stream: Any = None
        self.event: Any = None  # what a consumer's stream waits for (DLPack outputs)
        self.wait_event: Any = None  # what our stream waits for (a caller's tensor on its stream)
        self.staged = False  # an asynchronous copy may still read a staging buffer
        self.spare: dict[int, list[int]] = {}  # device outputs given back, by size, for later calls
        self.frees: dict[int, Callable[[int], None]] = {}  # by size: what an output's array calls when it goes
        # Page-locked host results: kept by size (at most SPARE_SIZES sizes), lent by size, and
        # those whose arrays are gone (appended by a finalizer, on any thread, even during a
        # garbage collection on a thread inside `lock`: so without taking it), taken back by copy_out.
        self.spare_host: dict[int, list[int]] = {}
        self.lent: dict[int, int] = {}
        self.returned: collections.deque[tuple[int, int]] = collections.deque()
        self.lock = threading.Lock()
        self.tensor_maps = TensorMaps(self.driver, check)  # the TMA maps of kernels that take them

    def close(self) -> None:
        """Unload the module's images from the GPU (idempotent); its kernels cannot be launched
        after. Every release is attempted; the first that failed is raised after the others (a
        context broken by a failed kernel fails them all)."""
        modules, self.modules = self.modules, []
        stream, events, self.stream = self.stream, (self.event, self.wait_event), None
        self.event = self.wait_event = None
        self.kernels = {}
        with self.lock:
            host, self.spare_host = [p for kept in self.spare_host.values() for p in kept], {}
        device, self.spare = [p for kept in self.spare.values() for p in kept], {}
        releases = [("cuStreamSynchronize", stream), ("cuStreamDestroy", stream)] if stream is not None else []
        releases += [("cuMemFree", p) for p in device] + [("cuMemFreeHost", p) for p in host]
        releases += [("cuEventDestroy", e) for e in events if e is not None]
        releases += [("cuModuleUnload", m) for m in modules]
        failed: list[DeviceError] = []
        if releases:
            self.device.make_current()
        for call, handle in releases:
            try:
                check(getattr(self.driver, call)(handle), call)
            except DeviceError as error:
                failed.append(error)
            if call == "cuStreamSynchronize":  # nothing reads the tensor maps now
                try:
                    self.tensor_maps.release()
                except DeviceError as error:
                    failed.append(error)
        self._free_returned()  # (and those given back later: see _given_back)
        if failed:
            raise failed[0]

    def begin(self) -> None:
        """Make the device's context current on the calling thread (at the start of each call)."""
        self.device.make_current()

    def copy_in(self, buffer: DeviceBuffer, array: np.ndarray) -> None:
        """Queue a copy of C-contiguous host `array` into `buffer`. A page-locked array must not
        change until the stream has done it (`staged` says whether it may not have); a pageable
        one the driver has read into its own staging memory when this returns."""
        if buffer.nbytes:
            check(self.driver.cuMemcpyHtoDAsync(buffer.pointer, array.ctypes.data, buffer.nbytes, self.stream),
                  "cuMemcpyHtoDAsync")
            self.staged = True

    def copy_out_into(self, buffer: DeviceBuffer, array: np.ndarray) -> None:
        """Copy `buffer` into host `array` once the queued work is done; wait for it."""
        if not array.flags.c_contiguous:
            array[...] = self.copy_out(buffer)
            return
        if buffer.nbytes:
            check(self.driver.cuMemcpyDtoHAsync(array.ctypes.data, buffer.pointer, buffer.nbytes, self.stream),
                  "cuMemcpyDtoHAsync")
        self.synchronize()

    def copy_out(self, buffer: DeviceBuffer) -> np.ndarray:
        """A fresh host array with the buffer's contents, once the queued work is done. From
        PINNED_RESULT_BYTES on it is page-locked memory (the copy runs at the link's full rate:
        pageable memory goes through the driver's staging buffer), kept for a later call's
        result of the same size when the caller drops the array (up to SPARE_OUTPUTS of a size
        lent at once, of SPARE_SIZES sizes kept; past that, or if none can be had, pageable)."""
        nbytes, pointer = buffer.nbytes, None
        if nbytes >= PINNED_RESULT_BYTES:
            with self.lock:
                self._take_back()
                kept = self.spare_host.get(nbytes)
                if kept or self.lent.get(nbytes, 0) < SPARE_OUTPUTS:
                    pointer = kept.pop() if kept else 0
                    self.lent[nbytes] = self.lent.get(nbytes, 0) + 1
        if pointer == 0:
            try:
                self.device.make_current()
                pointer = int(check(self.driver.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc"))
            except DeviceError:  # page-locked memory exhausted: pageable, as below the threshold
                with self.lock:
                    self.lent[nbytes] -= 1
                pointer = None
        if pointer is None:
            host = np.empty(buffer.shape, buffer.dtype)
        else:
            memory = (ctypes.c_char * nbytes).from_address(pointer)
            weakref.finalize(memory, self._given_back, nbytes, pointer).atexit = False
            host = np.frombuffer(memory, buffer.dtype, math.prod(buffer.shape)).reshape(buffer.shape)
        self.copy_out_into(buffer, host)
        return host

    def _given_back(self, nbytes: int, pointer: int) -> None:
        """A page-locked result's array is gone: its memory goes back (see `returned`)."""
        self.returned.append((nbytes, pointer))
        if self.stream is None:  # closed: nothing will take it back
            self._free_returned()

    def _take_back(self) -> None:
        """Keep the results given back for later calls, or free them (under `lock`)."""
        while self.returned:
            nbytes, pointer = self.returned.popleft()
            self.lent[nbytes] -= 1
            if not _keep(self.spare_host, nbytes, pointer):
                self.device.make_current()
                check(self.driver.cuMemFreeHost(pointer), "cuMemFreeHost")

    def _free_returned(self) -> None:
        while self.returned:
            _, pointer = self.returned.popleft()
            self.device.make_current()
            check(self.driver.cuMemFreeHost(pointer), "cuMemFreeHost")

    def synchronize(self) -> None:
        """Wait for the module's queued work (a failed kernel's error surfaces here)."""
        check(self.driver.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
        self.staged = False

    def wait_for(self, stream: int) -> None:
        """Order the module's stream after the work queued so far on `stream` (a caller's)."""
        self.device.make_current()
        check(self.driver.cuEventRecord(self.wait_event, stream), "cuEventRecord")
        check(self.driver.cuStreamWaitEvent(self.stream, self.wait_event, 0), "cuStreamWaitEvent")

    def output(self, shape: tuple[int, ...], dtype: Any) -> DLPackArray:
        """Device memory for one output of one call, owned by the returned array until it and
        every tensor taken from it are gone; then kept for a later call's output of the same
        size (up to SPARE_OUTPUTS of each, of SPARE_SIZES sizes), else freed."""
        nbytes = max(math.prod(shape) * dtype.itemsize, 1)
        spare = self.spare.get(nbytes)
        pointer = spare.pop() if spare else int(check(self.driver.cuMemAllocAsync(nbytes, self.stream),
                                                      "cuMemAllocAsync"))
        free = self.frees.get(nbytes) or self._free_of(nbytes)
        return DLPackArray(pointer, shape, dtype, (CUDA, self.device.ordinal), free, self.ready)

    def _free_of(self, nbytes: int) -> Callable[[int], None]:
        """What gives back an output of `nbytes` (made once per size: see `frees`)."""
        device, driver, spares = self.device, self.driver, self.spare

        def free(pointer: int) -> None:
            # a later call writes it on our stream, which (blocking) waits for the legacy stream's
            # work queued before: torch's default stream's last reads of it, as cuMemFreeAsync on
            # the legacy stream would
            if self.stream is not None and _keep(spares, nbytes, pointer):
                return
            device.make_current()  # the last reference may go on any thread
            check(driver.cuMemFreeAsync(pointer, 0), "cuMemFreeAsync")
        if len(self.frees) >= 64:  # a caller of ever new sizes
            self.frees.clear()
        self.frees[nbytes] = free
        return free

    def ready(self, stream: int | None) -> None:
        """Order a consumer's stream after our work, before an output is exported to it. DLPack's 1
        (or None) is the legacy default stream, which waits for our (blocking) stream by itself;
        others wait for an event (none once the module is closed: its stream was drained)."""
        if stream not in (None, 1) and self.stream is not None:
            self.device.make_current()
            check(self.driver.cuEventRecord(self.event, self.stream), "cuEventRecord")
            check(self.driver.cuStreamWaitEvent(stream, self.event, 0), "cuStreamWaitEvent")

    def launcher(self, kernel: int, buffers: Sequence[DeviceBuffer],
                 sizes: Mapping[str, int]) -> Callable[[Sequence[tuple[int, Any]]], None] | None:
        """A function launching kernels[kernel] on `buffers` for this call shape's `sizes` (None if
        its grid is empty), given (argument, buffer) pairs that replace some of them in a call.

        Its parameter block is built here, once: kernelParams is an array of pointers, each to
        one argument's value: the device pointers, then the sizes (a custom kernel's scalars)
        as 64-bit integers, then the device addresses of its TMA tensor maps (tensormap.py),
        looked up per call for the pointers that call passes."""
        if kernel not in self.kernels:
            raise KernelError(f"kernels[{kernel}] is not a CUDA kernel of this module")
        functions, spec, code = self.kernels[kernel]
        symbol, launch = code.pick(sizes)  # the variant for this call's sizes, or the kernel itself
        function = functions[symbol]
        grid = [evaluate(size, sizes) for size in launch.grid]
        if 0 in grid:
            return None
        for axis, expr, count, limit in zip("xyz", launch.grid, grid, MAX_GRID, strict=True):
            if count > limit:
                raise KernelError(f"kernels[{kernel}] ({spec.name}) needs {count} blocks along grid {axis} "
                                  f"({to_text(expr)}); CUDA allows at most {limit}")
        base = [int(buffer.pointer) for buffer in buffers]
        first_map, maps = len(base) + len(spec.integers), code.maps_of(symbol)
        values = (ctypes.c_uint64 * (first_map + len(maps)))(
            *base, *(evaluate(expr, sizes) for expr in spec.integers), *(0 for _ in maps))
        params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(values) + 8 * i for i in range(len(values))))
        arguments = (function, *grid, *launch.block, launch.shared_bytes, self.stream, ctypes.addressof(params), 0)
        launch_kernel = self.driver.cuLaunchKernel

        def go(overrides: Sequence[tuple[int, Any]] = ()) -> None:
            for position, buffer in overrides:
                values[position] = int(buffer.pointer)
            if maps:
                with self.tensor_maps.lock:  # (no map freed between its fetch and this launch)
                    self.tensor_maps.reserve(len(maps), self.stream)
                    for i, tmap in enumerate(maps):
                        matrix = buffers[tmap.arg]  # (its leading axes as rows: a kernel may read it as a view)
                        values[first_map + i] = self.tensor_maps.pointer(
                            tmap.box, values[tmap.arg], (math.prod(matrix.shape[:-1]), matrix.shape[-1]),
                            matrix.dtype.name, self.stream, f"kernels[{kernel}] ({spec.name}) tensor_maps[{i}]")
                    check(launch_kernel(*arguments), "cuLaunchKernel")
            else:
                check(launch_kernel(*arguments), "cuLaunchKernel")
            for position, _ in overrides:  # the plan's own buffers again, for calls without overrides
                values[position] = base[position]
        go.params = params  # what the launch reads (for tests)
        return go

    def launch(self, kernel: int, buffers: Sequence[DeviceBuffer], sizes: Mapping[str, int]) -> None:
        """Queue kernels[kernel] on device `buffers` (not waiting for it); no launch when an axis
        of its grid is 0 for this call's `sizes`."""
        self.device.make_current()  # the context is per thread; this one may not have it yet
        go = self.launcher(kernel, buffers, sizes)
        if go is not None:
            go()
