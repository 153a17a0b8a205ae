"""The DLPack protocol of hexir_runtime.dlpack, checked against numpy's own implementation:
numpy's capsules read by `unpack`, our `DLPackArray`s taken by `np.from_dlpack`."""

from __future__ import annotations

import gc
import sys
import tarfile
import types
from pathlib import Path

import numpy as np
import pytest
from hexir_runtime import InputError
from hexir_runtime.dlpack import CPU, CUDA, MAX_NDIM, DLManagedTensor, DLPackArray, describe, tensor_of, unpack


def test_unpack_reads_numpys_capsules():
    array = np.arange(24, dtype=np.float64).reshape(2, 3, 4)
    tensor = unpack(array.__dlpack__())
    assert tensor.pointer == array.ctypes.data and tensor.shape == (2, 3, 4) and tensor.dtype == np.float64
    assert tensor.device == (CPU, 0) and tensor.contiguous and tensor.nbytes == array.nbytes
    view = unpack(array[:, 1:, ::2].__dlpack__())
    assert view.pointer == array.ctypes.data + 4 * 8 and view.shape == (2, 2, 2)
    assert view.strides == (12, 4, 2) and not view.contiguous
    assert unpack(array[0][:, None, :].__dlpack__()).contiguous  # the stride of an axis of 1 does not matter
    assert describe(unpack(np.float32([1]).__dlpack__())) == "float32[1] on DLPack device type 1:0"
    assert describe(unpack(np.int32([1]).__dlpack__())) == "int32[1] on DLPack device type 1:0"
    assert describe(unpack(np.int16([1]).__dlpack__())) == "code 0 bits 16 lanes 1[1] on DLPack device type 1:0"


def test_releasing_an_unpacked_capsule_runs_the_producers_deleter():
    array = np.ones(3, np.float32)
    references = sys.getrefcount(array)
    tensor = unpack(array.__dlpack__())
    assert sys.getrefcount(array) == references + 1  # numpy's capsule keeps the array
    tensor.release()
    tensor.release()  # once only
    assert sys.getrefcount(array) == references
    dropped = unpack(array.__dlpack__())
    del dropped
    gc.collect()
    assert sys.getrefcount(array) == references


def test_numpy_takes_our_arrays_without_a_copy_and_keeps_them_alive():
    memory = np.arange(12, dtype=np.float32)
    freed: list[int] = []
    array = DLPackArray(memory.ctypes.data, (3, 4), np.float32, (CPU, 0), free=freed.append)
    taken = np.from_dlpack(array)
    assert taken.shape == (3, 4) and taken.dtype == np.float32 and np.shares_memory(taken, memory)
    np.testing.assert_array_equal(taken, memory.reshape(3, 4))
    del array
    gc.collect()
    assert freed == []  # numpy's array still uses the memory
    del taken
    gc.collect()
    assert freed == [memory.ctypes.data]


def test_a_capsule_nobody_consumes_gives_its_reference_back():
    freed: list[int] = []
    array = DLPackArray(1234, (2,), np.float64, (CPU, 0), free=freed.append)
    capsule = array.__dlpack__()
    del capsule, array
    gc.collect()
    assert freed == [1234]


def test_our_capsules_read_back_and_ready_gets_the_consumers_stream():
    streams: list[object] = []
    array = DLPackArray(4096, (5, 6), np.float64, (2, 0), ready=streams.append)
    tensor = unpack(array.__dlpack__(stream=7))
    assert (tensor.pointer, tensor.shape, tensor.dtype, tensor.device) == (4096, (5, 6), np.float64, (2, 0))
    assert tensor.strides is None and streams == [7]
    tensor.release()
    array.__dlpack__(stream=-1)  # -1: the consumer asks for no synchronization
    assert streams == [7]
    assert array.__dlpack_device__() == (2, 0) and array.nbytes == 240 and array.ndim == 2
    assert "float64[5, 6]" in repr(array)


def test_a_view_exported_with_a_byte_offset_starts_at_data_plus_the_offset():
    """DLPack lets a producer export a view into a bigger tensor as the storage's start (`data`)
    and the view's distance from it (`byte_offset`): the tensor read is at their sum."""
    array = DLPackArray(4096 + 96, (2, 3), np.float32, (CUDA, 0))  # rows 8.. of a [10, 3] storage at 4096
    capsule = array.__dlpack__()
    exported = DLManagedTensor.from_buffer(array._exports[-1]).dl_tensor
    exported.data, exported.byte_offset = 4096, 96
    tensor = unpack(capsule)
    assert (tensor.pointer, tensor.shape, tensor.nbytes) == (4096 + 96, (2, 3), 24)
    tensor.release()


@pytest.mark.parametrize("ndim", [-1, MAX_NDIM + 1, 2**31 - 1])
def test_a_capsule_with_an_impossible_ndim_is_an_input_error_and_stays_its_producers(ndim):
    """A corrupt DLTensor (a producer's bug) is refused before anything is read through its
    shape pointer; the capsule is not marked consumed, so its producer still frees it."""
    freed: list[int] = []
    array = DLPackArray(4096, (5, 6), np.float64, (2, 0), free=freed.append)
    capsule = array.__dlpack__()
    DLManagedTensor.from_buffer(array._exports[-1]).dl_tensor.ndim = ndim  # corrupt the struct as exported
    with pytest.raises(InputError, match=rf"a DLPack tensor with ndim {ndim} and shape at"):
        unpack(capsule)
    del capsule, array
    gc.collect()
    assert freed == [4096]  # the capsule's destructor ran the deleter, which let the array go


def test_copies_and_other_devices_are_refused():
    array = DLPackArray(4096, (2,), np.float32, (2, 0))
    with pytest.raises(BufferError, match="without a copy only"):
        array.__dlpack__(copy=True)
    with pytest.raises(BufferError, match=r"lives on DLPack device \(2, 0\), not \(1, 0\)"):
        array.__dlpack__(dl_device=(1, 0))


def test_tensor_of_gives_host_tensors_as_numpy_arrays():
    array = np.ones((2, 2), np.float32)
    assert tensor_of(array) is array

    class Host:
        def __dlpack__(self, stream=None, **keys):
            return array.__dlpack__()

        def __dlpack_device__(self):
            return (CPU, 0)

    taken = tensor_of(Host())
    assert isinstance(taken, np.ndarray) and np.shares_memory(taken, array)


class Interfaced:
    """A CUDA tensor as torch and cupy lend it: `__dlpack_device__` and `__cuda_array_interface__`."""

    def __init__(self, interface, device=(CUDA, 0)):
        self.__cuda_array_interface__, self.device = interface, device

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None, **keys):
        raise AssertionError("read through __cuda_array_interface__, never DLPack")


def test_tensor_of_reads_the_cuda_array_interface_and_the_producers_stream():
    face = {"shape": (3, 5), "typestr": "<f4", "data": (1 << 32, False), "version": 2, "strides": None}
    tensor = tensor_of(Interfaced(face, (CUDA, 1)), 1, interface=True)
    assert (tensor.pointer, tensor.shape, tensor.dtype, tensor.device) == (1 << 32, (3, 5), np.float32, (CUDA, 1))
    assert tensor.contiguous and tensor.nbytes == 60 and tensor.stream is None  # no stream: ready, by the protocol
    for legacy in (0, 1):  # the legacy default stream: ours is ordered after it by itself
        assert tensor_of(Interfaced({**face, "version": 3, "stream": legacy}), 1, interface=True).stream is None
    assert tensor_of(Interfaced({**face, "version": 3, "stream": 0x7F00}), 1, interface=True).stream == 0x7F00
    view = tensor_of(Interfaced({**face, "strides": (4, 12)}), 1, interface=True)
    assert view.strides == (1, 3) and not view.contiguous  # bytes -> elements
    odd = tensor_of(Interfaced({**face, "strides": (22, 4)}), 1, interface=True)
    assert not odd.contiguous  # 5.5 elements apart: never C order
    assert describe(tensor_of(Interfaced({**face, "typestr": "<i4"}), 1, interface=True)) == "int32[3, 5] on cuda:0"
    assert describe(tensor_of(Interfaced({**face, "typestr": ">f4"}), 1, interface=True)) == ">f4[3, 5] on cuda:0"


class FakeTorch:
    """What the runtime reads of torch: its Tensor type, dtypes and current stream."""

    float16, float32, float64, bfloat16 = "torch.float16", "torch.float32", "torch.float64", "torch.bfloat16"
    int32, int64 = "torch.int32", "torch.int64"

    def __init__(self, current: dict) -> None:
        class Stream:
            def __init__(self, device):
                assert device == 1
                self.cuda_stream = current["stream"]

        class Tensor:
            """A CUDA tensor on device 1 at 4096, read through its methods only."""

            is_cuda = True

            def __init__(self, shape=(2, 3), dtype=FakeTorch.float64, requires_grad=False, strides=None):
                self.shape, self.dtype, self.requires_grad = shape, dtype, requires_grad
                self.strides = strides or (shape[1], 1)

            def get_device(self):
                return 1

            def data_ptr(self):
                return 4096

            def stride(self):
                return self.strides

            def is_contiguous(self):
                return self.strides == (self.shape[1], 1)

            def __dlpack_device__(self):
                return (CUDA, 1)

            @property
            def __cuda_array_interface__(self):
                raise RuntimeError("not read for a tensor the runtime reads itself")

            def __dlpack__(self, stream=None, **keys):
                raise BufferError("the general path")

        self.Tensor, self.Stream = Tensor, Stream
        self.cuda, self._C = types.SimpleNamespace(current_stream=Stream), types.SimpleNamespace()


def test_a_torch_tensor_is_read_through_its_methods_and_follows_torchs_current_stream(monkeypatch):
    """A torch CUDA tensor is read through data_ptr/shape/is_contiguous/stride/dtype/get_device (its interface
    costs more); its stream is torch's current one on its device (a side stream's handle; None for
    the legacy default, 0), as its __dlpack__ would wait for."""
    current = {"stream": 0}
    torch = FakeTorch(current)
    monkeypatch.setitem(sys.modules, "torch", torch)
    tensor = tensor_of(torch.Tensor(), 1, interface=True)
    assert (tensor.pointer, tensor.shape, tensor.dtype, tensor.device, tensor.contiguous) == \
        (4096, (2, 3), np.float64, (CUDA, 1), True)
    assert tensor.stream is None
    assert not tensor_of(torch.Tensor(strides=(1, 2)), 1, interface=True).contiguous  # a transposed view
    current["stream"] = 0xBEEF
    assert tensor_of(torch.Tensor(), 1, interface=True).stream == 0xBEEF
    face = {"shape": (2,), "typestr": "<f8", "data": (4096, False), "version": 2}
    assert tensor_of(Interfaced(face, (CUDA, 1)), 1, interface=True).stream is None  # not torch's
    torch._C._cuda_getCurrentRawStream = lambda device: torch.Stream(device).cuda_stream + 1  # where torch has it
    assert tensor_of(torch.Tensor(), 1, interface=True).stream == 0xBEEF + 1
    assert tensor_of(torch.Tensor(dtype=torch.bfloat16), 1, interface=True).dtype.name == "bfloat16"  # (ml_dtypes')
    # a dtype the runtime does not read, or a tensor that requires grad: the general path (which says why)
    for odd in (torch.Tensor(dtype="torch.complex64"), torch.Tensor(requires_grad=True)):
        with pytest.raises(BufferError, match="the general path"):
            tensor_of(odd, 1, interface=True)
    # another torch module (a test's stand-in, then the real one) has dtypes of its own: read as its
    other = FakeTorch(current)
    other.float64 = "another torch's float64"
    monkeypatch.setitem(sys.modules, "torch", other)
    assert tensor_of(other.Tensor(dtype=other.float64), 1, interface=True).dtype == np.float64


def test_without_interface_a_cuda_tensor_goes_through_dlpack():
    class Both(Interfaced):
        def __dlpack__(self, stream=None, **keys):
            raise BufferError(f"asked on stream {stream}")

    with pytest.raises(BufferError, match="asked on stream 1"):
        tensor_of(Both({"shape": (1,), "typestr": "<f4", "data": (4096, False)}), 1)


@pytest.mark.parametrize("broken", [
    {"shape": (3, -1)}, {"shape": None}, {"data": None}, {"data": ("0x10", False)}, {"typestr": "not a type"},
    {"strides": (4,)}, {"mask": object()}, {"shape": (1,) * (MAX_NDIM + 1)}, {"version": 3, "stream": "s"},
])
def test_a_cuda_array_interface_that_is_not_one_is_an_input_error(broken):
    face = {"shape": (3, 5), "typestr": "<f4", "data": (4096, False), "version": 2, **broken}
    with pytest.raises(InputError, match="Interfaced"):
        tensor_of(Interfaced(face), 1, interface=True)


# ---- on a real GPU, with torch (and cupy if installed): skipped elsewhere ---------------------------

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def gpu_modules() -> Path:
    """bench/mlp.py's modules (built by `python bench/mlp.py build bench/mlp_modules`), on a
    machine with a GPU and torch."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU for torch")
    directory = BENCH / "mlp_modules"
    if not (directory / "one_kernel.hxb").exists():
        if not (BENCH / "mlp_modules.tar.gz").exists():
            pytest.skip("bench/mlp_modules not built (python bench/mlp.py build bench/mlp_modules)")
        with tarfile.open(BENCH / "mlp_modules.tar.gz") as archive:
            archive.extractall(BENCH, filter="data")
    return directory


def test_torch_cuda_tensors_in_and_out_without_copies(gpu_modules):
    import torch
    from hexir_runtime import load

    module = load(gpu_modules / "mlp_64x784x512x10_float32_cuda.hxb", "cuda")
    x = torch.randn(64, 784, device="cuda")
    y = module.main(x, outputs="device")
    taken = torch.from_dlpack(y)
    assert taken.device.type == "cuda" and taken.data_ptr() == y.pointer and taken.shape == (64, 10)
    np.testing.assert_allclose(taken.cpu().numpy(), module.main(x.cpu().numpy()), rtol=1e-6)  # numpy in and out
    np.testing.assert_allclose(module.main(x), taken.cpu().numpy(), rtol=1e-6)  # CUDA in, numpy out
    del y
    taken += 1  # still valid: the consumer's tensor keeps the memory
    torch.cuda.synchronize()
    with pytest.raises(InputError, match="expects a C-contiguous tensor"):
        module.main(torch.randn(784, 64, device="cuda").T)
    with pytest.raises(InputError, match=r"expects float32\[64, 784\] on cuda:0, got float64"):
        module.main(torch.randn(64, 784, device="cuda", dtype=torch.float64))
    with pytest.raises(InputError, match=r"argument 'x': the Tensor cannot be read \((Runtime|Buffer)Error: .*grad"):
        module.main(torch.randn(64, 784, device="cuda", requires_grad=True))


def test_a_torch_tensor_written_on_a_side_stream_is_waited_for(gpu_modules):
    """torch's __cuda_array_interface__ names no stream: the module asks torch for its current one."""
    import torch
    from hexir_runtime import load

    module = load(gpu_modules / "mlp_64x784x512x10_float32_cuda.hxb", "cuda")
    big = torch.ones(2048, 2048, device="cuda")
    with torch.cuda.stream(torch.cuda.Stream()):
        for trial in range(20):  # a long kernel on the side stream, then the input written after it
            x = torch.zeros(64, 784, device="cuda")
            big @ big
            x += trial
            y = module.main(x)  # numpy out: the module's stream, then the host, wait
            np.testing.assert_allclose(y, module.main(np.full((64, 784), trial, np.float32)), rtol=1e-5)


def test_a_tensor_written_on_another_stream_is_waited_for(gpu_modules):
    """cupy names its current stream in __cuda_array_interface__: our stream waits for it."""
    cupy = pytest.importorskip("cupy")
    from hexir_runtime import load

    module = load(gpu_modules / "mlp_64x784x512x10_float32_cuda.hxb", "cuda")
    with cupy.cuda.Stream(non_blocking=True):
        for trial in range(20):  # a long kernel on the side stream, then the input written after it
            x = cupy.zeros((64, 784), cupy.float32)
            cupy.matmul(cupy.ones((2048, 2048), cupy.float32), cupy.ones((2048, 2048), cupy.float32))
            x += trial
            y = cupy.from_dlpack(module.main(x, outputs="device"))
            np.testing.assert_allclose(cupy.asnumpy(y), module.main(np.full((64, 784), trial, np.float32)),
                                       rtol=1e-5)


def test_cupy_takes_device_outputs_too(gpu_modules):
    cupy = pytest.importorskip("cupy")
    from hexir_runtime import load

    module = load(gpu_modules / "mlp_64x784x512x10_float32_cuda.hxb", "cuda")
    x = cupy.random.standard_normal((64, 784), dtype=cupy.float32)
    y = cupy.from_dlpack(module.main(x, outputs="device"))
    np.testing.assert_allclose(cupy.asnumpy(y), module.main(cupy.asnumpy(x)), rtol=1e-6)


def test_an_array_dropped_while_the_interpreter_exits_frees_nothing():
    """A consumer (jax) may drop our arrays while the interpreter shuts down, when the modules
    their free() needs are gone (seen on the H200: `Exception ignored ... NoneType`, from
    cuda.py's free): then nothing is freed (the driver frees all at exit); otherwise it is."""
    freed = []
    memory = np.zeros(4, np.float32)
    array = DLPackArray(memory.ctypes.data, (4,), np.float32, (CPU, 0), free=freed.append)
    array.__del__(_finalizing=lambda: True)
    assert freed == []
    array.__del__()
    assert freed == [memory.ctypes.data]
    array._free = None  # (freed once)
