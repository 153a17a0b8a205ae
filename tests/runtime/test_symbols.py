"""Symbolic dimensions (format version 2): size expressions, binding symbols per call, buffers
sized per call and reused, batch 0; and version-1 files from tests/data, upgraded on read."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import pytest
from hexir_runtime import DeviceError, HxbFormatError, InputError, load
from hexir_runtime import format as hxb
from hexir_runtime.cli import main as hexir_run
from hexir_runtime.cpu import CpuDevice
from hexir_runtime.describe import safe
from hexir_runtime.reference import ReferenceDevice

DATA = Path(__file__).parents[1] / "data"

# --- size expressions ------------------------------------------------------------------------


@pytest.mark.parametrize("expr, sizes, value, text", [
    (7, {}, 7, "7"),
    ("batch", {"batch": 5}, 5, "batch"),
    (("ceildiv", "batch", 64), {"batch": 65}, 2, "ceildiv(batch, 64)"),
    (("ceildiv", "batch", 64), {"batch": 0}, 0, "ceildiv(batch, 64)"),
    (("mul", ("add", "m", 1), "n"), {"m": 2, "n": 10}, 30, "mul(add(m, 1), n)"),
    (("min", "m", ("max", "n", 3)), {"m": 9, "n": 1}, 3, "min(m, max(n, 3))"),
])
def test_expressions_evaluate_and_print(expr, sizes, value, text):
    assert hxb.evaluate(expr, sizes) == value
    assert hxb.to_text(expr) == text


def nested(depth: int) -> list | str:
    return "batch" if depth == 0 else ["add", nested(depth - 1), 1]


@pytest.mark.parametrize("extent, field, reason", [
    (["div", "batch", 2], "kernels[1].work.extent[0]", "expected one of ceildiv, mul, add, min, max, got 'div'"),
    (["ceildiv", "batch", 0], "kernels[1].work.extent[2]", "ceildiv divides by a literal integer >= 1, got 0"),
    (["ceildiv", 64, "batch"], "kernels[1].work.extent[2]", "ceildiv divides by a literal integer >= 1, got 'batch'"),
    (["add", "batch"], "kernels[1].work.extent", "expected an int, a symbol or [op, expr, expr], got 2 items"),
    (["add", "n", 1], "kernels[1].work.extent[1]", "symbol 'n' is no dimension of the kernel's args (batch)"),
    (nested(9), "kernels[1].work.extent[1][1][1][1][1][1][1][1]", "size expressions nest at most 8 deep"),
    (2.5, "kernels[1].work.extent", "expected an integer >= 0, got 2.5"),
])
def test_expression_format_errors(modules, extent, field, reason):
    manifest, blobs = modules.batched()
    manifest["kernels"][1]["work"]["extent"] = extent
    with pytest.raises(HxbFormatError) as caught:
        hxb.encode(manifest, blobs)
    assert (caught.value.field, caught.value.reason) == (field, reason)


def test_eight_levels_of_nesting_are_allowed(modules):
    manifest, blobs = modules.batched()
    manifest["kernels"][1]["work"]["extent"] = nested(8)
    assert hxb.decode(hxb.encode(manifest, blobs)).manifest.kernels[1].cpu_code.work.extent[0] == "add"


def test_symbol_rules(modules):
    manifest, blobs = modules.batched()
    bad = copy.deepcopy(manifest)
    bad["entries"][0]["inputs"][0]["shape"] = [2, 8]  # nothing binds batch any more
    bad["entries"][0]["buffers"][0]["shape"] = [2, 8]
    with pytest.raises(HxbFormatError, match=r"^entries\[0\]\.outputs\[0\]\.shape: symbol 'batch' is bound by no"):
        hxb.encode(bad, blobs)
    bad = copy.deepcopy(manifest)
    bad["kernels"][0]["sizes"] = []
    with pytest.raises(HxbFormatError, match=r'kernels\[0\]\.sizes: expected .* \["batch"\], got \[\]'):
        hxb.encode(bad, blobs)
    bad = copy.deepcopy(manifest)
    bad["kernels"][2]["args"][2]["shape"] = ["rows", 4]  # out[M, N] must have x's M
    with pytest.raises(HxbFormatError, match=r"kernels\[2\]\.args: linear expects .*float32\[rows, 4\]"):
        hxb.encode(bad, blobs)


# --- a symbolic batch, run -------------------------------------------------------------------


@pytest.fixture(scope="module")
def batched_data(modules, c_library) -> bytes:
    return hxb.encode(*modules.batched(c_library))


def test_signature_shows_the_symbols(batched_data):
    module = load(batched_data, "reference")
    assert str(module.signature("main")) == "main(x: float32[batch, 8]) -> float32[batch, 4]"
    assert module.signature("main").inputs[0][1].shape == ("batch", 8)


@pytest.mark.parametrize("device", ["cpu", "reference"])
def test_any_batch_matches_numpy(modules, batched_data, device):
    module, w = load(batched_data, device), modules.weights()
    for batch in (0, 1, 2, 7, 1000, 2, 0, 7):  # growing, shrinking, repeating
        x = np.random.default_rng(batch).standard_normal((batch, 8)).astype(np.float32)
        y = module.main(x)
        assert y.shape == (batch, 4) and y.dtype == np.float32
        np.testing.assert_allclose(y, modules.mlp_numpy(x, w), rtol=1e-5, atol=1e-5)


def test_static_dimensions_and_ranks_are_still_checked(batched_data):
    module = load(batched_data, "reference")
    for shape in [(3, 9), (8,), (1, 3, 8)]:
        with pytest.raises(InputError, match=re.escape(f"main(): argument 'x' expects float32[batch, 8], got "
                                                       f"float32[{', '.join(map(str, shape))}]")):
            module.main(np.zeros(shape, np.float32))


def test_one_symbol_two_sizes_is_an_input_error(modules, c_library):
    builder = modules.Builder()
    add = builder.kernel("linear", [["batch", 2], [2, 2], ["batch", 2]])
    entry = builder.entry()
    x, y = entry.input("x", ["batch", 2]), entry.input("y", [2, 2])
    entry.ret(entry.call(add, x, y))
    entry = builder.entry("pair")
    entry.ret(entry.input("x", ["batch", 3]), entry.input("y", [2, "batch"]))
    module = load(hxb.encode(*builder.build(c_library)), "reference")
    with pytest.raises(InputError) as caught:
        module.pair(np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32))
    assert str(caught.value) == "pair(): input 'y' has batch = 3 (axis 1), but input 'x' has batch = 2 (axis 0)"
    x, y = module.pair(np.ones((4, 3), np.float32), np.ones((2, 4), np.float32))
    assert x.shape == (4, 3) and y.shape == (2, 4)


def test_a_byte_count_past_2_63_is_an_input_error(modules):
    builder = modules.Builder()
    outer = builder.kernel("linear", [["n", 0], [0, "n"], ["n", "n"]])  # x[n, 0] @ w[0, n]: n * n zeros
    entry = builder.entry()
    entry.ret(entry.call(outer, entry.input("x", ["n", 0]), entry.input("w", [0, "n"])))
    module = load(hxb.encode(*builder.build()), "reference")
    np.testing.assert_array_equal(module.main(np.zeros((3, 0), np.float32), np.zeros((0, 3), np.float32)),
                                  np.zeros((3, 3)))
    with pytest.raises(InputError) as caught:
        module.main(np.zeros((2**31, 0), np.float32), np.zeros((0, 2**31), np.float32))
    assert str(caught.value) == "main(): buffer 2 would be float32[2147483648, 2147483648], 2^63 bytes or more"


def test_outputs_too_big_for_memory_are_a_device_error_naming_them(modules):
    builder = modules.Builder()
    outer = builder.kernel("linear", [["n", 0], [0, "n"], ["n", "n"]])
    entry = builder.entry()
    entry.ret(entry.call(outer, entry.input("x", ["n", 0]), entry.input("w", [0, "n"])))
    module = load(hxb.encode(*builder.build()), "reference")
    module.main(np.zeros((2, 0), np.float32), np.zeros((0, 2), np.float32))  # planned, then dropped below
    n = 2**25  # 2^52 bytes: past any machine's memory and address space, short of 2^63
    with pytest.raises(DeviceError) as caught:  # numpy's MemoryError (or "array is too big") until now
        module.main(np.zeros((n, 0), np.float32), np.zeros((0, n), np.float32))
    assert str(caught.value) == ("main(): out of memory allocating output 0 (buffer 2), float32[33554432, 33554432]: "
                                 "4,503,599,627,370,496 bytes")
    np.testing.assert_array_equal(module.main(np.zeros((2, 0), np.float32), np.zeros((0, 2), np.float32)),
                                  np.zeros((2, 2)))  # the module still works for sizes that fit


class NoMemoryForResults(ReferenceDevice):
    """The reference device, out of memory when it copies an output out for the caller."""

    def copy_out(self, buffer):
        raise MemoryError


def test_outputs_that_cannot_be_returned_are_a_device_error(batched_data):
    module = load(batched_data, NoMemoryForResults())
    with pytest.raises(DeviceError, match=r"^main\(\): out of memory allocating the outputs returned, 448 bytes$"):
        module.main(np.ones((28, 8), np.float32))


class CountingCpu(CpuDevice):
    """The CPU device, counting the buffers it allocates (by element count)."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[int] = []
        self.launched: list[int] = []

    def alloc(self, shape, dtype):
        self.allocations.append(int(np.prod(shape)))
        return super().alloc(shape, dtype)

    def load(self, hxb_module):
        program, launched = super().load(hxb_module), self.launched
        launch = program.launch

        def counting(kernel, buffers, sizes):
            launched.append(kernel)
            launch(kernel, buffers, sizes)
        program.launch = counting
        return program


def test_buffers_grow_only_when_a_call_needs_more(batched_data):
    device = CountingCpu()
    module = load(batched_data, device)
    constants = len(device.allocations)
    assert constants == 3  # W1, b1, W2; no buffer is sized before the first call
    x = np.ones((7, 8), np.float32)
    module.main(x)
    first = device.allocations[constants:]
    assert sorted(first) == sorted([7 * 8, 7 * 16, 7 * 16, 7 * 4])  # x, h, relu(h), y
    module.main(x)
    module.main(x[:2])
    module.main(x[:0])
    assert len(device.allocations) == constants + len(first)  # repeated, smaller, empty: no allocation
    module.main(np.ones((9, 8), np.float32))
    assert sorted(device.allocations[constants + len(first):]) == sorted([9 * 8, 9 * 16, 9 * 16, 9 * 4])


def test_batch_0_launches_nothing(batched_data):
    device = CountingCpu()
    module = load(batched_data, device)
    assert module.main(np.zeros((0, 8), np.float32)).shape == (0, 4)
    assert device.launched == []
    module.main(np.zeros((1, 8), np.float32))
    assert device.launched == [0, 1, 2]


def test_a_zero_extent_skips_the_call_and_grain_bounds_the_chunks(modules, compile_c, monkeypatch):
    manifest, blobs = modules.batched()
    manifest["kernels"][1]["work"]["grain"] = 400  # relu: at most 1000 // 400 = 2 chunks
    monkeypatch.setattr("hexir_runtime.cpu._native", None)  # chunks as Python calls, which the test can see
    library = compile_c(modules.kernels_code + modules.table_c(manifest["kernels"]), "grain_400")
    blobs[manifest["cpu"]["libraries"][0]["library"]] = ("cpu.so", library)
    device = CpuDevice(threads=8, split_bytes=0)
    module = load(hxb.encode(manifest, blobs), device)
    calls = []
    function, work, integers = device_kernels(module)[1]
    device_kernels(module)[1] = (lambda *args: calls.append(args[-3:]) or function(*args), work, integers)
    x = np.random.default_rng(0).standard_normal((1000, 8)).astype(np.float32)
    np.testing.assert_allclose(module.main(x), modules.mlp_numpy(x, modules.weights()), rtol=1e-5, atol=1e-5)
    assert sorted(calls) == [(1000, 0, 500), (1000, 500, 1000)]  # batch, first, last


def device_kernels(module) -> dict:
    """The ctypes kernels of a module loaded on one CpuDevice (by kernel index)."""
    (program,) = module._finalizer.peek()[2][2]  # the finalizer's arguments: executors, constants, programs
    return program.kernels


# --- version 1 files -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mlp_v1", "split_v1"])
def test_version_1_files_run_on_the_reference_device_only(name):
    """A version-1 file is held to every check: its libraries have constructors (linked without
    -nostartfiles) and no kernel table, so its code cannot be checked and is refused; the
    reference device runs no code of the file, only its manifest and constants."""
    module = load(DATA / f"{name}.hxb", "reference")
    x, expected = np.load(DATA / f"{name}_x.npy"), np.load(DATA / f"{name}_y.npy")
    np.testing.assert_allclose(module.main(x), expected, rtol=1e-5, atol=1e-5)
    assert module.hxb.version == 1
    blob = {"mlp_v1": 0, "split_v1": 2}[name]
    with pytest.raises(HxbFormatError, match=rf"^cpu\.libraries\[0\]\.library: the CPU library for x86-64 \(blob "
                                             rf"{blob}\) has a constructor \(DT_INIT\): a library must run no code"):
        load(DATA / f"{name}.hxb", "cpu")


def test_version_1_is_upgraded_to_the_version_4_model():
    split = hxb.read(DATA / "split_v1.hxb")
    kernels = {kernel.name: kernel for kernel in split.manifest.kernels}
    assert [(kernel.op, kernel.expr) for kernel in kernels.values()] == [
        ("pointwise", ["max", ["arg", 0], ["const", 0]]), ("linear", ["add", ["arg", 0], ["arg", 1]]),
        ("linear", ["arg", 0])]
    assert kernels["linear_0"].cpu_code == hxb.Code("linear_0_cpu", hxb.Work(1, 1))
    assert kernels["linear_0"].gpu_code.launch == hxb.Launch((1, 1, 1), (16, 16, 1), 0)
    assert kernels["relu_1"].cpu_code.work == hxb.Work(4, 1) and kernels["relu_1"].integers == ()
    assert "parallel_extent" not in split.json["kernels"][0] and split.json["kernels"][0]["sizes"] == []
    mlp = hxb.read(DATA / "mlp_v1.hxb").manifest
    assert [(kernel.op, kernel.expr) for kernel in mlp.kernels] == [
        ("linear", ["max", ["arg", 0], ["const", 0]]), ("linear", ["arg", 0])]


def test_version_1_info(capsys):
    assert hexir_run([str(DATA / "split_v1.hxb"), "--info"]) == 0
    out = capsys.readouterr().out
    assert "version       : 1\n" in out
    assert ("  [1] linear_2: cpu linear(read float32[4, 16], read float32[16, 4], read float32[4], "
            "write float32[4, 4])\n      computes a0 + a1\n      symbol linear_2, work extent 1\n") in out
    assert "      cpu fallback: linear_0_cpu, work extent 1\n" in out


# --- --info --------------------------------------------------------------------------------


def test_info_shows_symbols_sizes_and_expressions(modules, tmp_path, capsys):
    manifest, blobs = modules.batched()
    manifest["kernels"][1]["work"] = {"extent": ["ceildiv", "batch", 4], "grain": 2}
    manifest["producer"] = "evil\x1b[2J\x07 producer"
    manifest["constants"][0]["name"] = "W1\n[0] fake"
    hxb.write(tmp_path / "b.hxb", manifest, blobs)
    assert hexir_run([str(tmp_path / "b.hxb"), "--info"]) == 0
    out = capsys.readouterr().out
    assert "producer      : evil\\x1b[2J\\x07 producer\n" in out
    assert "  [0] W1\\n[0] fake: float32[8, 16] in blob 0\n" in out
    assert "\x1b" not in out and "\x07" not in out
    assert "entry main(x: float32[batch, 8]) -> float32[batch, 4]\n" in out
    assert ("  [1] k1_relu: cpu pointwise(read float32[batch, 16], write float32[batch, 16])\n"
            "      computes max(a0, 0)\n"
            "      symbol relu_batchx16_batchx16_float32, work extent ceildiv(batch, 4), grain 2\n"
            "      sizes batch\n") in out


def test_safe_escapes_what_a_terminal_would_obey():
    assert safe("a\x1b[31mb\tc\u2028d é") == "a\\x1b[31mb\\tc\\u2028d é"
