"""The Python API: load, entries, signatures, argument checks, outputs, buffers, print."""

from __future__ import annotations

import re
from pathlib import Path

import hexir_runtime
import numpy as np
import pytest
from hexir_runtime import HexirRuntimeError, InputError, Module, load
from hexir_runtime import format as hxb
from hexir_runtime.device import HostMemory
from hexir_runtime.executor import format_tensor


@pytest.fixture(scope="module")
def module(modules) -> Module:
    return load(hxb.encode(*modules.mlp()), "reference")


@pytest.fixture
def x() -> np.ndarray:
    return np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)


def test_entries_and_signatures(module):
    assert module.entries == ("main", "layers", "matmul")
    assert str(module.signature("main")) == "main(x: float32[2, 8]) -> float32[2, 4]"
    assert str(module.signature("layers")) == "layers(x: float32[2, 8]) -> (float32[2, 16], float32[2, 4])"
    assert str(module.signature("matmul")) == "matmul(a: float32[2, 2], b: float32[2, 2]) -> float32[2, 2]"
    assert module.signature("main").inputs[0][1].shape == (2, 8)
    assert module.device_name == "reference"
    assert "main" in repr(module)


def test_load_sources(modules, tmp_path, c_library):
    parts = modules.mlp(c_library)
    hxb.write(tmp_path / "m.hxb", *parts)
    for source in (tmp_path / "m.hxb", str(tmp_path / "m.hxb"), hxb.encode(*parts), hxb.read(tmp_path / "m.hxb")):
        assert load(source).device_name == "cpu"  # auto: no CUDA kernels


def test_run_and_attribute_access_agree(module, x):
    np.testing.assert_array_equal(module.run("main", x), module.main(x))
    with pytest.raises(AttributeError, match="no attribute or entry 'nope'"):
        module.nope  # noqa: B018
    with pytest.raises(InputError, match=r"no entry 'nope' \(entries: main, layers, matmul\)"):
        module.run("nope", x)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (lambda: [np.zeros((3, 8), np.float32)], "main(): argument 'x' expects float32[2, 8], got float32[3, 8]"),
        (lambda: [np.zeros((2, 8))], "main(): argument 'x' expects float32[2, 8], got float64[2, 8]"),
        (lambda: [np.zeros(16, np.float32)], "main(): argument 'x' expects float32[2, 8], got float32[16]"),
        (lambda: [np.zeros((2, 8), ">f4")], "main(): argument 'x' expects float32[2, 8], got >f4[2, 8]"),
        (lambda: [[[0.0] * 8] * 2], "main(): argument 'x' expects a numpy array float32[2, 8], got list"),
        (lambda: [np.array(1, np.float32)], "main(): argument 'x' expects float32[2, 8], got float32[]"),
        (lambda: [np.float32(1)], "main(): argument 'x' expects a numpy array float32[2, 8], got float32"),
        (lambda: [], "main(): expects 1 argument(s) (x), got 0"),
        (lambda: [np.zeros((2, 8), np.float32)] * 2, "main(): expects 1 argument(s) (x), got 2"),
    ],
    ids=["shape", "dtype", "rank", "byte order", "list", "0-d", "scalar", "too few", "too many"],
)
def test_arguments_are_checked_not_cast(module, arguments, message):
    with pytest.raises(InputError, match=re.escape(message)):
        module.main(*arguments())


def test_non_contiguous_arguments(module, x):
    wide = np.zeros((2, 16), np.float32)
    wide[:, ::2] = x
    strided = wide[:, ::2]
    assert not strided.flags.c_contiguous
    np.testing.assert_array_equal(module.main(strided), module.main(x))
    fortran = np.asfortranarray(x)
    np.testing.assert_array_equal(module.main(fortran), module.main(x))


def test_non_contiguous_arguments_are_copied_once(module, x, monkeypatch):
    received = []

    def copy_in(self, buffer, array):
        received.append(array)
        np.copyto(buffer, array)
    monkeypatch.setattr(HostMemory, "copy_in", copy_in)
    strided = np.zeros((2, 16), np.float32)[:, ::2]
    module.main(strided)
    assert received[0] is strided  # straight into the entry's buffer, not through a contiguous copy first


@pytest.mark.parametrize("device", ["reference", "cpu"])
def test_close_and_with_blocks_on_host_devices(modules, c_library, x, device):
    data = hxb.encode(*modules.mlp(c_library))
    with load(data, device) as module:
        expected = module.layers(x)[1]
        assert not module.closed
    assert module.closed
    module.close()  # idempotent
    with pytest.raises(HexirRuntimeError, match=r"^layers\(\): the module is closed"):
        module.layers(x)
    np.testing.assert_array_equal(load(data, device).layers(x)[1], expected)


def test_outputs_are_fresh_and_buffers_reused(modules, c_library, x):
    module = load(hxb.encode(*modules.mlp(c_library)), "cpu")
    buffers = list(module._executors["main"].views)
    first = module.main(x)
    kept = first.copy()
    second = module.main(x * 2)
    assert first is not second and not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, kept)  # a later call did not overwrite an earlier result
    first[...] = 7  # the caller owns it
    np.testing.assert_array_equal(module.main(x), kept)
    assert all(np.shares_memory(a, b) for a, b in zip(buffers, module._executors["main"].views, strict=True))
    for buffer in buffers:
        assert not any(np.shares_memory(buffer, output) for output in (first, second))
    assert len(module._executors["main"].views) == 7
    # W1, b1 and W2 are bound by two entries but uploaded once.
    constants = module._executors["main"].views[1], module._executors["layers"].views[1]
    assert constants[0] is constants[1]


def test_return_of_an_input_is_a_copy(modules):
    builder = modules.Builder()
    entry = builder.entry("identity")
    entry.ret(entry.input("x", [3]))
    entry = builder.entry("show")
    entry.print(entry.input("x", [3]))
    entry.ret()
    module = load(hxb.encode(*builder.build()))
    x = np.ones(3, np.float32)
    y = module.identity(x)
    assert not np.shares_memory(x, y)
    assert module.show(x) is None


def test_print_goes_to_the_current_stdout(modules, capsys):
    module = load(hxb.encode(*modules.mlp()), "reference")
    a = np.array([[10, -1], [-8, 10]], np.float32)
    b = np.array([[1, 2], [2, 3]], np.float32)
    np.testing.assert_array_equal(module.matmul(a, b), [[8, 17], [12, 14]])
    assert capsys.readouterr().out == "8.000000 17.000000 \n12.000000 14.000000 \n"


@pytest.mark.parametrize("device", ["reference", "cpu"])
def test_prints_false_leaves_the_prints_out(modules, c_library, capsys, device):
    a = np.array([[10, -1], [-8, 10]], np.float32)
    b = np.array([[1, 2], [2, 3]], np.float32)
    quiet = load(hxb.encode(*modules.mlp(c_library)), device, prints=False)
    np.testing.assert_array_equal(quiet.matmul(a, b), [[8, 17], [12, 14]])
    assert capsys.readouterr().out == ""
    loud = load(hxb.encode(*modules.mlp(c_library)), device)  # the default still prints
    loud.matmul(a, b)
    assert capsys.readouterr().out == "8.000000 17.000000 \n12.000000 14.000000 \n"


@pytest.mark.parametrize(
    "array, text",
    [
        (np.array([1.5, -2], np.float32), "1.500000 -2.000000 \n"),
        (np.arange(8, dtype=np.float64).reshape(2, 2, 2), "0.000000 1.000000 \n2.000000 3.000000 \n"
         "4.000000 5.000000 \n6.000000 7.000000 \n"),
        (np.array(3.25), "3.250000 \n"),
        (np.zeros((2, 0)), "\n\n"),
        (np.zeros((0, 3)), ""),
        (np.array([-0.0, 1e-7, 123456.789], np.float64), "-0.000000 0.000000 123456.789000 \n"),
        (np.array([0.1], np.float32), "0.100000 \n"),
    ],
)
def test_print_format(array, text):
    assert format_tensor(array) == text


def test_version_matches_pyproject():
    pyproject = (Path(__file__).parents[2] / "runtime" / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == hexir_runtime.__version__
