"""The CUDA device: device buffers and the module's CUBIN/PTX, driven through cuda-python.

Only the driver API (`cuda.bindings.driver`) is used, and every call goes through `check`,
which turns a failing CUresult into a DeviceError naming the call and the driver's message.
The image that fits the GPU is chosen from the kernel's `images` (docs/hxb-format.md): the
CUBIN of its own architecture, else one of the same major version and a lower minor, else
the PTX (JIT-compiled by the driver) if its virtual architecture is not above the GPU's, else
a custom kernel's fatbin (the driver picks inside it). A kernel takes its `sizes` (a custom
kernel its `scalars`) as 64-bit integers after its device pointers; its grid is evaluated per
call, and a grid with an empty axis is not launched.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .errors import DeviceError, KernelError
from .format import Hxb, Kernel, Launch, evaluate, to_text


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python < 12.6
        except ImportError:
            raise DeviceError("CUDA support needs cuda-python: pip install 'hexir-runtime[cuda]'") from None
    return driver


def check(result: tuple, call: str) -> Any:
    """The values a driver call returns after its CUresult, or DeviceError if it failed."""
    driver = _driver()
    status, *values = result
    if status != driver.CUresult.CUDA_SUCCESS:
        _, text = driver.cuGetErrorString(status)
        message = text.decode() if isinstance(text, bytes) else str(text)
        raise DeviceError(f"{call} failed: {getattr(status, 'name', status)} ({message})")
    return values[0] if len(values) == 1 else tuple(values)


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

#: The oldest architecture the compiler targets (CUDA 13's ptxas starts there).
OLDEST_TARGET = 75


def pick_image(images: dict[str, int], major: int, minor: int) -> tuple[str, int]:
    """The (architecture, blob) to load on a GPU of compute capability major.minor."""
    own = major * 10 + minor
    cubins = {int(arch[3:]): (arch, blob) for arch, blob in images.items() if arch.startswith("sm_")}
    if own in cubins:
        return cubins[own]
    compatible = [cc for cc in cubins if cc // 10 == major and cc <= own]
    if compatible:
        return cubins[max(compatible)]
    ptx = {int(arch[8:]): (arch, blob) for arch, blob in images.items() if arch.startswith("compute_")}
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
        attribute = driver.CUdevice_attribute
        self.capability = (
            check(driver.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device),
                  "cuDeviceGetAttribute"),
            check(driver.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.device),
                  "cuDeviceGetAttribute"))
        raw = check(driver.cuDeviceGetName(256, self.device), "cuDeviceGetName")
        self.gpu_name = raw.split(b"\0")[0].decode()
        self.name = f"cuda ({self.gpu_name})"
        self.context = check(driver.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self.make_current()

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
        try:
            modules: dict[int, Any] = {}  # by blob
            for index, kernel in enumerate(hxb.manifest.kernels):
                code = kernel.gpu_code
                if code is None:
                    continue
                arch, blob = pick_image(code.images, *self.capability)
                if blob not in modules:
                    image = bytes(hxb.blob(blob))
                    if arch.startswith("compute_"):
                        image += b"\0"  # the driver reads PTX as a C string
                    modules[blob] = check(self.driver.cuModuleLoadData(image), f"cuModuleLoadData ({arch})")
                    program.modules.append(modules[blob])
                try:
                    function = check(self.driver.cuModuleGetFunction(modules[blob], code.symbol.encode()),
                                     "cuModuleGetFunction")
                    if code.launch.shared_bytes > DEFAULT_SHARED_BYTES:  # a bigger block needs opting in
                        attribute = self.driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                        check(self.driver.cuFuncSetAttribute(function, attribute, code.launch.shared_bytes),
                              "cuFuncSetAttribute")
                except DeviceError as error:
                    raise KernelError(f"kernels[{index}] ({kernel.name}): {error}") from None
                program.kernels[index] = (function, kernel, code.launch)
        except BaseException:
            program.close()  # the images loaded before the failure
            raise
        return program


class CudaProgram:
    """The module's CUDA kernels, ready to launch with their geometry evaluated per call."""

    def __init__(self, device: CudaDevice, kernels: dict[int, tuple[Any, Kernel, Launch]]) -> None:
        self.device = device
        self.kernels = kernels
        self.modules: list[Any] = []  # the loaded CUmodules, unloaded by close

    def close(self) -> None:
        """Unload the module's images from the GPU (idempotent); its kernels cannot be launched after."""
        modules, self.modules = self.modules, []
        self.kernels = {}
        if modules:
            self.device.make_current()
        for module in modules:
            check(self.device.driver.cuModuleUnload(module), "cuModuleUnload")

    def launch(self, kernel: int, buffers: Sequence[DeviceBuffer], sizes: Mapping[str, int]) -> None:
        """Launch kernels[kernel] on device `buffers` and wait for it (errors surface here); no
        launch when an axis of its grid is 0 for this call's `sizes`."""
        if kernel not in self.kernels:
            raise KernelError(f"kernels[{kernel}] is not a CUDA kernel of this module")
        function, spec, launch = self.kernels[kernel]
        grid = [evaluate(size, sizes) for size in launch.grid]
        if 0 in grid:
            return
        for axis, expr, count, limit in zip("xyz", launch.grid, grid, MAX_GRID, strict=True):
            if count > limit:
                raise KernelError(f"kernels[{kernel}] ({spec.name}) needs {count} blocks along grid {axis} "
                                  f"({to_text(expr)}); CUDA allows at most {limit}")
        self.device.make_current()  # the context is per thread; this one may not have it yet
        # kernelParams: an array of pointers, each to one argument's value: the device pointers,
        # then the kernel's sizes (a custom kernel's scalars) as 64-bit integers.
        values = [ctypes.c_void_p(int(buffer.pointer)) for buffer in buffers]
        values += [ctypes.c_int64(evaluate(expr, sizes)) for expr in spec.integers]
        params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        driver = self.device.driver
        check(driver.cuLaunchKernel(function, *grid, *launch.block, launch.shared_bytes,
                                    0, ctypes.addressof(params), 0), "cuLaunchKernel")
        self.device.synchronize()
