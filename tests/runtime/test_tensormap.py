"""The TMA tensor maps the runtime builds for kernels that take them (hexir_runtime/tensormap.py),
against a stand-in for the driver's calls: what is encoded (extents innermost first, the row
pitch, the box), one encoding per (address, extents, dtype, box), a misaligned address refused
with the kernel named, and a full cache emptied only after the stream drained."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hexir_runtime import tensormap
from hexir_runtime.errors import KernelError
from hexir_runtime.tensormap import TensorMaps


class Driver:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.next = 0x1000
        names = lambda *members: SimpleNamespace(**{m: m for m in members})  # noqa: E731
        self.CUtensorMapDataType = names("CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", "CU_TENSOR_MAP_DATA_TYPE_FLOAT16",
                                         "CU_TENSOR_MAP_DATA_TYPE_FLOAT32", "CU_TENSOR_MAP_DATA_TYPE_FLOAT64")
        self.CUtensorMapInterleave = names("CU_TENSOR_MAP_INTERLEAVE_NONE")
        self.CUtensorMapSwizzle = names("CU_TENSOR_MAP_SWIZZLE_128B")
        self.CUtensorMapL2promotion = names("CU_TENSOR_MAP_L2_PROMOTION_L2_128B")
        self.CUtensorMapFloatOOBfill = names("CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE")
        self.cuuint64_t = lambda value: ("u64", value)  # the bindings' own integer types, as the real ones
        self.cuuint32_t = lambda value: ("u32", value)

    def cuTensorMapEncodeTiled(self, *args):
        self.calls.append(("encode", *args))
        return 0, SimpleNamespace(getPtr=lambda: 0xABC)

    def cuMemAlloc(self, size):
        self.calls.append(("alloc", size))
        self.next += 0x100
        return 0, self.next

    def cuMemcpyHtoDAsync(self, device, host, size, stream):
        self.calls.append(("copy", device, host, size, stream))
        return (0,)

    def cuStreamSynchronize(self, stream):
        self.calls.append(("sync", stream))
        return (0,)

    def cuMemFree(self, pointer):
        self.calls.append(("free", pointer))
        return (0,)


def check(result, call):
    assert result[0] == 0, call
    return result[1] if len(result) == 2 else None


def test_a_map_is_encoded_once_per_address_and_extents():
    driver = Driver()
    maps = TensorMaps(driver, check)
    first = maps.pointer((64, 128), 0x10000, (1000, 4096), "bfloat16", "s", "k")
    assert maps.pointer((64, 128), 0x10000, (1000, 4096), "bfloat16", "s", "k") == first
    encode = [c for c in driver.calls if c[0] == "encode"]
    assert encode == [("encode", "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", 2, 0x10000, [("u64", 4096), ("u64", 1000)],
                       [("u64", 8192)], [("u32", 64), ("u32", 128)], [("u32", 1), ("u32", 1)],
                       "CU_TENSOR_MAP_INTERLEAVE_NONE", "CU_TENSOR_MAP_SWIZZLE_128B",
                       "CU_TENSOR_MAP_L2_PROMOTION_L2_128B", "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE")]
    assert ("copy", first, 0xABC, 128, "s") in driver.calls  # on the module's stream, before any launch
    assert maps.pointer((64, 128), 0x20000, (1000, 4096), "bfloat16", "s", "k") != first
    assert maps.pointer((64, 128), 0x10000, (999, 4096), "bfloat16", "s", "k") != first
    assert len([c for c in driver.calls if c[0] == "encode"]) == 3


def test_a_misaligned_address_is_refused_naming_the_kernel():
    with pytest.raises(KernelError, match=r"kernels\[3\] \(linear_0\) tensor_maps\[1\]: .*16-byte aligned.*0x10008"):
        TensorMaps(Driver(), check).pointer((64, 64), 0x10008, (64, 64), "float16", "s",
                                            "kernels[3] (linear_0) tensor_maps[1]")


def test_a_full_cache_is_emptied_after_the_stream_drains_before_a_launch_fetches_its_maps(monkeypatch):
    """Never between one launch's maps: its first map, cached, must not be freed by its second."""
    monkeypatch.setattr(tensormap, "CACHE_LIMIT", 2)
    driver = Driver()
    maps = TensorMaps(driver, check)
    maps.reserve(2, "s")
    kept = [maps.pointer((64, 64), address, (64, 64), "float16", "s", "k") for address in (0x100, 0x200)]
    assert not any(c[0] in ("sync", "free") for c in driver.calls)
    maps.reserve(2, "s")  # a launch of two maps, one of them cached: room is made before either is fetched
    sync = driver.calls.index(("sync", "s"))
    assert [c[1] for c in driver.calls[sync + 1:] if c[0] == "free"] == kept and not maps.maps
    x = maps.pointer((64, 64), 0x100, (64, 64), "float16", "s", "k")
    w = maps.pointer((64, 64), 0x300, (64, 64), "float16", "s", "k")
    assert x != w and len(maps.maps) == 2 and driver.calls.count(("sync", "s")) == 1
    maps.reserve(1, "s")  # hits or not, a fetch never frees: only reserve does
    assert driver.calls.count(("sync", "s")) == 2 and not maps.maps
