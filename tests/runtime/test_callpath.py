"""The call path on the host: inputs read in place, out=, no allocation per call, DLPack
host arguments, outputs="device" on a cpu module, and 8 threads calling one module."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import pytest
from hexir_runtime import InputError, executor, load
from hexir_runtime import format as hxb
from hexir_runtime.cpu import CpuDevice
from hexir_runtime.device import ALIGNMENT, HostMemory
from hexir_runtime.executor import IN_PLACE_BYTES


@pytest.fixture
def batched(modules, c_library):
    """`main(x: float32[batch, 8]) -> float32[batch, 4]` on the cpu."""
    return load(hxb.encode(*modules.batched(c_library)), "cpu")


@pytest.fixture
def copies(monkeypatch) -> list[Any]:
    """The arrays copied into entry buffers (HostMemory.copy_in's sources)."""
    received: list[Any] = []
    original = HostMemory.copy_in

    def copy_in(self, buffer, array):
        received.append(array)
        original(self, buffer, array)
    monkeypatch.setattr(HostMemory, "copy_in", copy_in)
    return received


def expected(modules, x: np.ndarray) -> np.ndarray:
    return modules.mlp_numpy(x, modules.weights())


def test_a_big_contiguous_input_is_read_in_place(batched, modules, copies):
    rows = IN_PLACE_BYTES // 32 + 1  # 32 bytes a row
    x = np.random.default_rng(0).standard_normal((rows, 8)).astype(np.float32)
    np.testing.assert_allclose(batched.main(x), expected(modules, x), rtol=1e-5, atol=1e-5)
    assert copies == []  # the kernel read x itself
    strided = np.asfortranarray(x)  # same values, not C-contiguous: copied into the entry's buffer
    np.testing.assert_allclose(batched.main(strided), expected(modules, x), rtol=1e-5, atol=1e-5)
    assert len(copies) == 1 and copies[0] is strided
    readonly = x.copy()
    readonly.flags.writeable = False  # addressed another way, still in place
    np.testing.assert_allclose(batched.main(readonly), expected(modules, x), rtol=1e-5, atol=1e-5)
    assert len(copies) == 1


def test_a_small_input_is_copied_which_is_cheaper_than_addressing_it(batched, modules, copies):
    x = np.ones((2, 8), np.float32)
    np.testing.assert_allclose(batched.main(x), expected(modules, x), rtol=1e-5, atol=1e-5)
    assert len(copies) == 1 and copies[0] is x


def test_out_is_written_and_returned(modules, c_library):
    module = load(hxb.encode(*modules.mlp(c_library)), "cpu")
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    h, y = np.empty((2, 16), np.float32), np.empty((2, 4), np.float32)
    assert module.layers(x, out=(h, y)) == (h, y)
    result = module.layers(x)
    np.testing.assert_array_equal(h, result[0])
    np.testing.assert_array_equal(y, result[1])
    strided = np.empty((4, 4), np.float32)[::2]
    assert module.run("layers", x, out=[h, strided])[1] is strided
    np.testing.assert_array_equal(strided, result[1])


@pytest.mark.parametrize(("out", "message"), [
    (lambda: np.empty((2, 4), np.float32), "layers(): out has 1 array(s) for 2 output(s)"),
    (lambda: (np.empty((2, 16), np.float32), np.empty((2, 4))),
     "layers(): out[1] expects float32[2, 4], got float64[2, 4]"),
    (lambda: (np.empty((2, 16), np.float32), np.empty((3, 4), np.float32)),
     "layers(): out[1] expects float32[2, 4], got float32[3, 4]"),
    (lambda: (np.empty((2, 16), np.float32), [[0.0] * 4] * 2),
     "layers(): out[1] must be a writable numpy array float32[2, 4], got list"),
    (lambda: (np.empty((2, 16), np.float32), np.broadcast_to(np.float32(0), (2, 4))),
     "layers(): out[1] must be a writable numpy array float32[2, 4], got ndarray"),
], ids=["count", "dtype", "shape", "type", "read-only"])
def test_a_wrong_out_is_an_input_error(modules, c_library, out, message):
    module = load(hxb.encode(*modules.mlp(c_library)), "cpu")
    with pytest.raises(InputError) as error:
        module.layers(np.ones((2, 8), np.float32), out=out())
    assert str(error.value) == message


def test_out_with_a_symbolic_batch_must_have_the_calls_shape(batched):
    with pytest.raises(InputError, match=r"^main\(\): out\[0\] has shape \(3, 4\), this call's output 0 \(2, 4\)$"):
        batched.main(np.ones((2, 8), np.float32), out=np.empty((3, 4), np.float32))


def test_a_big_out_of_another_batch_is_an_input_error_and_left_as_it_was(batched):
    """An output big enough to be written by its kernel in place: an out= of fewer rows than
    the call's is refused, never written past its end."""
    rows = IN_PLACE_BYTES // 16 + 1  # 16 bytes a row of out
    guard = np.full((2 * rows, 4), 7.0, np.float32)
    message = rf"^main\(\): out\[0\] has shape \(1, 4\), this call's output 0 \({rows}, 4\)$"
    with pytest.raises(InputError, match=message):
        batched.main(np.ones((rows, 8), np.float32), out=guard[:1])
    assert (guard == 7.0).all()


@pytest.fixture
def copied_out(monkeypatch) -> list[Any]:
    """The buffers copied out of the module (HostMemory.copy_out's and copy_out_into's sources)."""
    copied: list[Any] = []
    original_out, original_into = HostMemory.copy_out, HostMemory.copy_out_into

    def copy_out(self, buffer):
        copied.append(buffer)
        return original_out(self, buffer)

    def copy_out_into(self, buffer, array):
        copied.append(buffer)
        original_into(self, buffer, array)
    monkeypatch.setattr(HostMemory, "copy_out", copy_out)
    monkeypatch.setattr(HostMemory, "copy_out_into", copy_out_into)
    return copied


@pytest.mark.parametrize("pool", ["batched", "steps"])
def test_a_big_output_is_written_by_its_kernel_into_the_array_returned(batched, modules, copied_out, pool):
    executor = batched._executors["main"]
    rows = IN_PLACE_BYTES // 16 + 1  # 16 bytes a row of out
    rng = np.random.default_rng(4)
    x1, x2 = (rng.standard_normal((rows, 8)).astype(np.float32) for _ in range(2))
    first = batched.main(x1)
    if pool == "steps":  # the steps, as when another thread holds the pool
        next(iter(executor.plans.values())).fast = None
    second = batched.main(x2)
    assert copied_out == []  # no copy of a buffer: the kernel wrote each array returned
    assert first.ctypes.data % ALIGNMENT == second.ctypes.data % ALIGNMENT == 0 and not np.shares_memory(first, second)
    np.testing.assert_allclose(first, expected(modules, x1), rtol=1e-5, atol=1e-5)  # the second call left it
    np.testing.assert_allclose(second, expected(modules, x2), rtol=1e-5, atol=1e-5)
    out = np.full((rows, 4), np.nan, np.float32)
    assert batched.main(x1, out=out) is out and copied_out == []  # written in place, no copy
    np.testing.assert_array_equal(out, first)
    strided = np.empty((rows, 8), np.float32)[:, ::2]  # not contiguous: computed, then copied into
    assert batched.main(x2, out=strided) is strided and len(copied_out) == 1
    np.testing.assert_array_equal(strided, second)
    small = batched.main(x1[:3])  # a small output: copied from the buffer, which costs less
    assert len(copied_out) == 2 and small.base is None
    np.testing.assert_allclose(small, expected(modules, x1[:3]), rtol=1e-5, atol=1e-5)


@pytest.fixture
def empties(monkeypatch) -> list[tuple]:
    """The shapes of the arrays a call makes anew while the test runs (aligned_empty's)."""
    made: list[tuple] = []
    original = executor.aligned_empty

    def empty(shape, *args, **keys):
        made.append(tuple(shape))
        return original(shape, *args, **keys)
    monkeypatch.setattr(executor, "aligned_empty", empty)
    return made


def test_a_big_output_dropped_by_the_caller_is_the_next_calls_array(batched, modules, empties):
    """Its memory is faulted in already. An array the caller still holds, or anything made from
    it, is never written again; nor one whose shape or flags the caller changed."""
    rows = IN_PLACE_BYTES // 16 + 1  # 16 bytes a row of out
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal((rows, 8)).astype(np.float32) for _ in range(9)]
    wanted = [expected(modules, x) for x in xs]
    y = batched.main(xs[0])
    address = y.ctypes.data
    del y
    empties.clear()
    y = batched.main(xs[1])
    assert empties == [] and y.ctypes.data == address and address % ALIGNMENT == 0
    np.testing.assert_allclose(y, wanted[1], rtol=1e-5, atol=1e-5)
    holds = {"a view": lambda y: y[1:], "a memoryview": memoryview, "a weak reference": weakref.ref,
             "the array": lambda y: y, "its base": lambda y: y.base}
    for index, how in enumerate(holds, start=2):  # the last result held as `how`: the next is new
        held, offset = holds[how](y), y.ctypes.data - y.base.ctypes.data  # (where y lies in its base)
        del y
        empties.clear()
        y = batched.main(xs[index])
        assert empties == [(rows, 4)], how
        np.testing.assert_allclose(y, wanted[index], rtol=1e-5, atol=1e-5)
        if how == "a weak reference":  # let go, never rewritten
            assert held() is None
            continue
        before = held[offset:offset + rows * 16].view(np.float32).reshape(rows, 4) if how == "its base" \
            else np.asarray(held)
        np.testing.assert_allclose(before, wanted[index - 1][1:] if how == "a view" else wanted[index - 1],
                                   rtol=1e-5, atol=1e-5, err_msg=how)  # the caller's array left as it was
        del held, before
    for index, change in enumerate(("shape", "writeable"), start=7):  # changed, then dropped: made anew
        if change == "shape":
            y.shape = (-1,)
        else:
            y.flags.writeable = False
        del y
        empties.clear()
        y = batched.main(xs[index])
        assert empties == [(rows, 4)], change
        np.testing.assert_allclose(y, wanted[index], rtol=1e-5, atol=1e-5)


def test_an_out_array_overlapping_an_input_gets_the_result_after_the_program(modules, c_library):
    """A kernel writing out= in place would overwrite rows of the x it has still to read: such
    an out is filled from the module's buffer once the program has run."""
    builder, rng = modules.Builder(), np.random.default_rng(5)
    w, b = (builder.constant(name, rng.standard_normal(shape)) for name, shape in (("W", (96, 64)), ("b", (64,))))
    entry = builder.entry()
    layer = builder.kernel("linear_bias", [[300, 96], [96, 64], [64], [300, 64]], "float64")
    entry.ret(entry.call(layer, entry.input("x", [300, 96], "float64"), entry.constant(w), entry.constant(b)))
    module = load(hxb.encode(*builder.build(c_library)), "cpu")
    memory = rng.standard_normal(300 * 96 + 300 * 64)
    x = memory[: 300 * 96].reshape(300, 96)
    wanted = module.main(x.copy())
    out = memory[150 * 96: 150 * 96 + 300 * 64].reshape(300, 64)  # its first rows lie on x's last
    assert module.main(x, out=out) is out
    np.testing.assert_array_equal(out, wanted)
    memory = rng.standard_normal(300 * 96 + 300 * 64)  # the same with x an ndarray subclass (np.memmap is one)
    x = memory[: 300 * 96].reshape(300, 96).view(_Subclass)
    wanted = module.main(np.array(x))
    out = memory[150 * 96: 150 * 96 + 300 * 64].reshape(300, 64)
    assert module.main(x, out=out) is out
    np.testing.assert_array_equal(out, wanted)


class _Subclass(np.ndarray):
    pass


class CountingCpu(CpuDevice):
    def __init__(self) -> None:
        super().__init__()
        self.allocations = 0

    def alloc(self, shape, dtype):
        self.allocations += 1
        return super().alloc(shape, dtype)


def test_repeated_sizes_allocate_nothing_and_reuse_their_plan(modules, c_library):
    device = CountingCpu()
    module = load(hxb.encode(*modules.batched(c_library)), device)
    executor = module._executors["main"]
    x, out = np.ones((5, 8), np.float32), np.empty((5, 4), np.float32)
    module.main(x)
    allocations, plan = device.allocations, executor.plans[(((5, 8),), False)]
    for rows in (5, 3, 5, 3):
        module.main(x[:rows])
        module.main(x[:rows], out=out[:rows])
    assert device.allocations == allocations and executor.plans[(((5, 8),), False)] is plan
    assert len(executor.plans) == 2
    module.main(np.ones((7, 8), np.float32))  # bigger: the buffers grow, the older plans go
    assert device.allocations > allocations and list(executor.plans) == [(((7, 8),), False)]


class Tensor:
    """A host tensor from another library: only the DLPack protocol (as torch's CPU tensors)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __dlpack__(self, stream: Any = None, **keys: Any) -> Any:
        return self.array.__dlpack__()

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.array.__dlpack_device__()


def test_host_dlpack_tensors_are_arguments_and_outputs_are_dlpack_too(batched, modules):
    x = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)
    y = batched.main(Tensor(x))
    np.testing.assert_allclose(y, expected(modules, x), rtol=1e-5, atol=1e-5)
    device = batched.main(Tensor(x), outputs="device")  # a cpu module: its outputs are on the host
    assert isinstance(device, np.ndarray) and device.__dlpack_device__() == (1, 0)
    np.testing.assert_array_equal(np.from_dlpack(device), y)
    with pytest.raises(InputError, match=r"^main\(\): argument 'x' expects float32\[batch, 8\], got float64\[3, 8\]$"):
        batched.main(Tensor(x.astype(np.float64)))


def test_outputs_must_be_host_or_device(batched):
    with pytest.raises(InputError, match=r"^main\(\): outputs must be 'host' or 'device', got 'gpu'$"):
        batched.main(np.ones((1, 8), np.float32), outputs="gpu")


def test_concurrent_calls_from_8_threads_with_changing_sizes(batched, modules, concurrently):
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal((1 + i % 700, 8)).astype(np.float32) for i in range(64)]
    wanted = [expected(modules, x) for x in inputs]

    def work(seed: int) -> None:
        for i in range(200):
            k = (seed * 7 + i) % len(inputs)
            out = np.empty_like(wanted[k]) if i % 3 == 0 else None
            y = batched.main(inputs[k], out=out)
            np.testing.assert_allclose(y, wanted[k], rtol=1e-5, atol=1e-5)

    assert concurrently(work) == []


class RecordingCpu(CpuDevice):
    def __init__(self) -> None:
        super().__init__()
        self.buffers: list[np.ndarray] = []

    def alloc(self, shape, dtype):
        self.buffers.append(super().alloc(shape, dtype))
        return self.buffers[-1]


@pytest.mark.parametrize("rows", [3, IN_PLACE_BYTES // 16 + 1])  # outputs copied out / written in place
def test_every_host_buffer_a_kernel_gets_starts_on_64_bytes(modules, c_library, rows):
    """The weights, the inputs copied in, the intermediates and the arrays returned: np.empty's
    big arrays start 16 bytes into a page, which puts every AVX-512 vector across two lines."""
    device = RecordingCpu()
    module = load(hxb.encode(*modules.batched(c_library)), device)
    x = np.asfortranarray(np.random.default_rng(7).standard_normal((rows, 8)).astype(np.float32))  # copied in
    for _ in range(2):  # the second call: the buffers and the returned array recycled
        y = module.main(x)
        np.testing.assert_allclose(y, expected(modules, x), rtol=1e-5, atol=1e-5)
        assert len(device.buffers) >= 4 and [b.ctypes.data % ALIGNMENT for b in device.buffers] == \
            [0] * len(device.buffers)
        assert y.ctypes.data % ALIGNMENT == 0 or rows == 3  # (a small output is a copy: numpy's own)
        del y
    module.close()
