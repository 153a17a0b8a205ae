"""TMA tensor maps for the CUDA kernels that take them (a kernel's `tensor_maps`, docs/hxb-format.md).

Each map is a 128-byte CUtensorMap describing one matrix argument to the tensor copy engine: its
address and extents (innermost first), its row pitch, the box a copy moves, 128-byte swizzling,
and zeros for what lies outside the matrix. The driver encodes it on the host
(cuTensorMapEncodeTiled); it is copied to device memory once, on the module's stream (so before
any launch that reads it), and the kernel gets its address after its sizes. Maps are cached per
(address, extents, dtype, box): calls on the same buffers encode nothing. A cache without room
for a launch's maps is emptied after the stream drains (a launch in flight may still read a map),
before that launch fetches any (never between its own maps); a launch fetches its maps and is
queued under the cache's lock, so another thread's emptying waits for it.
"""

from __future__ import annotations

import threading
from typing import Any

from .errors import KernelError

#: dtype -> (the driver's CUtensorMapDataType member, bytes)
DTYPES = {"bfloat16": ("BFLOAT16", 2), "float16": ("FLOAT16", 2), "float32": ("FLOAT32", 4), "float64": ("FLOAT64", 8)}
#: Maps kept per module before the cache is emptied.
CACHE_LIMIT = 256


class TensorMaps:
    """A module's encoded maps in device memory, by (address, extents, dtype, box)."""

    def __init__(self, driver: Any, check: Any) -> None:
        self.driver, self.check = driver, check
        self.maps: dict[tuple, int] = {}
        self.lock = threading.Lock()  # held from `reserve` through the launch that reads the maps

    def reserve(self, count: int, stream: Any) -> None:
        """Room for `count` maps more: a cache that lacks it is emptied once the stream drained."""
        if len(self.maps) + count > CACHE_LIMIT:
            self.check(self.driver.cuStreamSynchronize(stream), "cuStreamSynchronize")
            self.release()

    def pointer(self, box: tuple[int, ...], address: int, shape: tuple[int, ...], dtype: str, stream: Any,
                where: str) -> int:
        """The device address of the map of a [rows, columns] matrix at `address`."""
        key = (address, shape, dtype, box)
        found = self.maps.get(key)
        if found is not None:
            return found
        if address % 16:
            raise KernelError(f"{where}: the tensor copy engine needs a 16-byte aligned address, got {address:#x}")
        d, check = self.driver, self.check
        kind, size = DTYPES[dtype]
        rows, columns = shape
        wide, narrow = d.cuuint64_t, d.cuuint32_t  # (the bindings take no plain ints in these lists)
        encoded = check(d.cuTensorMapEncodeTiled(
            getattr(d.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{kind}"), 2, address,
            [wide(columns), wide(rows)], [wide(columns * size)], [narrow(b) for b in box], [narrow(1), narrow(1)],
            d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), f"{where}: cuTensorMapEncodeTiled")
        device = int(check(d.cuMemAlloc(128), "cuMemAlloc"))
        self.maps[key] = device
        check(d.cuMemcpyHtoDAsync(device, encoded.getPtr(), 128, stream), "cuMemcpyHtoDAsync")
        return device

    def release(self) -> list[int]:
        """Forget every map; their device memory is the caller's to free (after the stream drains)."""
        pointers, self.maps = list(self.maps.values()), {}
        for pointer in pointers:
            self.check(self.driver.cuMemFree(pointer), "cuMemFree")
        return pointers
