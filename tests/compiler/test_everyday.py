"""Everyday use of the API and the command (issue 13): keyword calls and static arguments,
the captured-array rule, and the `hexir` command's spellings, checks and readable dumps."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import hexir_runtime
import numpy as np
import pytest
from hexir_runtime import format as hxb
from hexir_runtime.dlpack import DLTensor

import hexir
from hexir import TraceError

REPO = Path(__file__).resolve().parents[2]
MLP = REPO / "examples" / "mlp.py"
rng = np.random.default_rng(5)
W = rng.standard_normal((8, 4)).astype(np.float32)
X = rng.standard_normal((3, 8)).astype(np.float32)


# ---- keywords and static arguments ---------------------------------------------------------------

B = rng.standard_normal(4).astype(np.float32)


@hexir.jit
def scaled(x, bias, scale=1.0, mode="relu"):
    y = hexir.linear(x, W * scale, bias)  # scale is a plain float while tracing
    return hexir.relu(y) if mode == "relu" else y


def reference(x, bias, scale=1.0, mode="relu"):
    y = x @ (W * scale) + bias
    return np.maximum(y, 0) if mode == "relu" else y


@pytest.mark.parametrize(("args", "kwargs"), [
    ((X, B), {}), ((), {"x": X, "bias": B}), ((X,), {"bias": B, "scale": 2.0}), ((X, B, 3.0, "none"), {}),
    ((X, B), {"mode": "none"}),
])
def test_keyword_calls_and_static_values(args, kwargs):
    np.testing.assert_allclose(scaled(*args, **kwargs), reference(*args, **kwargs), rtol=1e-5, atol=1e-5)


def test_a_static_value_is_part_of_the_key_with_its_type():
    @hexir.jit
    def f(x, times=1):
        for _ in range(times if isinstance(times, int) else 1):
            x = hexir.relu(x)
        return x

    for times in (1, 1, 2, 1.0, True, 2):
        f(X, times)
    f(X)
    f(x=X, times=2)
    assert f.trace_count == 4  # 1, 2, 1.0, True: equal in Python, but not the same static value


def test_the_module_takes_the_tensors_only(tmp_path):
    path = hexir.export(scaled, tmp_path / "m.hxb", hexir.TensorSpec(("batch", 8), "float32"), B, scale=2.0)
    [entry] = hxb.read(path).manifest.entries
    assert [name for name, _ in entry.inputs] == ["x", "bias"]
    np.testing.assert_allclose(hexir_runtime.load(path).main(X, B), reference(X, B, 2.0), rtol=1e-5, atol=1e-5)


def test_a_value_that_cannot_be_static():
    with pytest.raises(TraceError, match=r"scaled\(\): argument 'scale' must be a numpy array, got list \(a static "
                                         r"argument is a number, string, None or a tuple of those\)"):
        scaled(X, B, [2.0])
    with pytest.raises(TraceError, match=r"scaled\(\): got an unexpected keyword argument 'y'"):
        scaled(X, B, y=1)
    with pytest.raises(TraceError, match=r"scaled\(\): missing a required argument: 'bias'"):
        scaled(x=X)


# ---- captured arrays ----------------------------------------------------------------------------

def test_captured_arrays_become_read_only_constants():
    weight = np.ones((8, 4), np.float32)
    given = X.copy()

    @hexir.jit
    def f(x):
        return hexir.linear(x, weight)

    expected = f(given)
    with pytest.raises(ValueError, match="read-only"):
        weight *= 10  # the compiled module holds the old values: refused, not silently stale
    np.testing.assert_array_equal(f(given), expected)
    given *= 2  # arguments are inputs, not constants: still writable, and read per call
    np.testing.assert_allclose(f(given), 2 * expected, rtol=1e-6)


def test_the_base_of_a_captured_view_is_made_read_only_too():
    torch_layout = np.ones((4, 8), np.float32)  # [out, in], as PyTorch keeps a linear's weight
    weight = torch_layout.T  # a view: its memory is torch_layout's
    wide = np.ones((8, 6), np.float32)

    @hexir.jit
    def f(x):
        return hexir.linear(x, weight), hexir.linear(x, wide[:, :4])

    expected = f(X)
    for base in (torch_layout, wide):  # a view captured by name, and one made while tracing
        with pytest.raises(ValueError, match="read-only"):
            base *= 10  # would change what the module's constants were copied from: refused
    for result, before in zip(f(X), expected, strict=True):
        np.testing.assert_array_equal(result, before)


def test_an_array_returned_as_is_is_captured_too():
    table = np.ones((2, 2), np.float32)
    f = hexir.jit(lambda x: (hexir.relu(x), table))
    f(X)
    assert not table.flags.writeable


# ---- the command ----------------------------------------------------------------------------------

def hexir_command(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(REPO), str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "hexir.cli", *argv], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": path})


def test_version_and_both_spellings(tmp_path):
    done = hexir_command("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"hexir {hexir.__version__}"
    short = hexir_command(f"{MLP}:mlp", "-spec=x=2x8xf32", "-emit=mlir-hetero", "-placement=hexir.linear=cuda")
    long = hexir_command(f"{MLP}:mlp", "--spec", "x=2x8xf32", "--emit", "mlir-hetero", "--placement",
                         "hexir.linear=cuda", "--target", "cuda:sm_90")
    assert short.returncode == long.returncode == 0, short.stderr + long.stderr
    assert short.stdout == long.stdout and 'device = "cuda"' in long.stdout
    done = hexir_command(f"{MLP}:mlp", "--spec=x=2x8xf32", "--emit=hxb", "--output", str(tmp_path / "m.hxb"))
    assert done.returncode == 0 and (tmp_path / "m.hxb").read_bytes().startswith(b"\x89HXB")


@pytest.mark.parametrize(("make", "message"), [
    (lambda d: d / "missing.mlir", "cannot read '{path}': no such file"),
    (lambda d: d, "cannot read '{path}': it is a folder, not a file"),
    (lambda d: (d / "empty.mlir").write_text("") or d / "empty.mlir", "cannot read '{path}': the file is empty"),
    (lambda d: (d / "empty.py").write_text("") or d / "empty.py", "cannot read '{path}': the file is empty"),
    (lambda d: hexir.export(lambda x: hexir.relu(x), d / "m.hxb", X) and d / "m.hxb",
     "'{path}' is a compiled module (.hxb), not a program: run it with hexir-run"),
], ids=["missing", "folder", "empty mlir", "empty python", "hxb"])
def test_input_files_are_checked_and_named(tmp_path, make, message):
    path = make(tmp_path)
    argument = f"{path}:f" if path.suffix == ".py" else str(path)
    done = hexir_command(argument, "-emit=mlir", "-spec=x=2x8xf32")
    assert done.returncode == 1
    assert done.stderr.strip() == f"hexir: error: {message.format(path=path)}"


def test_the_output_folder_is_checked_before_the_work(tmp_path):
    done = hexir_command(f"{MLP}:mlp", "-spec=x=2x8xf32", "-emit=hxb", "-o", str(tmp_path / "no" / "m.hxb"))
    assert done.returncode == 1 and "the folder" in done.stderr and "does not exist" in done.stderr
    assert "float32[2, 4]" not in done.stdout  # nothing ran: mlp prints its output when it runs
    done = hexir_command(f"{MLP}:mlp", "-spec=x=2x8xf32", "-emit=mlir", "-o", str(tmp_path))
    assert done.returncode == 1 and f"cannot write {tmp_path}: is a folder" in done.stderr
    done = hexir_command(f"{MLP}:mlp", "-spec=x=2x8xf32", "-emit=mlir", "--kernel-search-path", str(tmp_path / "no"))
    assert done.returncode == 1 and f"--kernel-search-path {tmp_path / 'no'}: no such folder" in done.stderr


def test_large_constants_are_elided_on_stdout(tmp_path):
    elided = hexir_command(f"{MLP}:mlp", "-spec=x=2x8xf32", "-emit=mlir")
    assert elided.stdout.startswith("// hexir: constants over 16 elements are elided")
    assert "dense_resource<__elided__> : tensor<8x16xf32>" in elided.stdout
    kept = hexir_command(f"{MLP}:mlp", "-spec=x=2x8xf32", "-emit=mlir", "--keep-constants")
    assert "__elided__" not in kept.stdout and kept.stdout.startswith("module")
    assert hexir_command(f"{MLP}:mlp", "-spec=x=2x8xf32", "-emit=mlir", "-o", str(tmp_path / "m.mlir")).returncode == 0
    assert (tmp_path / "m.mlir").read_text() == kept.stdout  # a file is complete: it can be compiled further


def test_static_values_on_the_command_line(tmp_path):
    program = tmp_path / "prog.py"
    program.write_text("import hexir\n\ndef f(x, w, scale=1.0, mode='relu'):\n"
                       "    y = hexir.linear(x, w)\n    return hexir.relu(y) if mode == 'relu' else y\n")
    done = hexir_command(f"{program}:f", "-spec=x=2x8xf32", "-spec=w=8x4xf32", "-spec=mode='none'", "-emit=mlir")
    assert done.returncode == 0, done.stderr
    assert "hexir.linear" in done.stdout and "hexir.relu" not in done.stdout
    assert 'hexir.arg_names = ["x", "w"]' in done.stdout
    done = hexir_command(f"{program}:f", "-spec=x=2x8xf32", "-spec=mode='none'", "-emit=mlir")
    assert done.returncode == 2 and "missing a required argument: 'w'" in done.stderr


class _HostTensor:
    """A tensor of another library, as the DLPack protocol shows it (on the host)."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_a_jit_function_takes_any_dlpack_tensor():
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    f = hexir.jit(lambda x: hexir.linear(x, w))
    x = np.random.default_rng(3).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(f(_HostTensor(x)), x @ w, rtol=1e-5)
    np.testing.assert_allclose(f(x), x @ w, rtol=1e-5)  # the same compiled module
    assert f.trace_count == 1
    with pytest.raises(hexir.TraceError, match="argument 'x' has dtype int8; expected float32, float64, "
                                                 "bfloat16 or float16"):
        f(_HostTensor(np.ones((2, 4), np.int8)))


class _Bfloat16:
    """A bfloat16 tensor as a DLPack producer (torch's, on the host or a GPU) shows it: numpy's
    capsule of 16-bit words, its dtype code made DLPack's 4 (kDLBfloat)."""

    def __init__(self, device: tuple[int, int]):
        self.memory, self.device = np.zeros((2, 4), np.uint16), device

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None, **request):
        capsule = self.memory.__dlpack__()
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        managed = get(capsule, b"dltensor")
        ctypes.c_uint8.from_address(managed + DLTensor.dtype.offset).value = 4
        return capsule


@pytest.mark.parametrize("device", [(1, 0), (2, 0)], ids=["host", "cuda"])
def test_a_bfloat16_tensor_with_a_float32_one_is_a_trace_error_naming_both(device):
    f = hexir.jit(lambda w, x: hexir.linear(x, w))
    tensor = _Bfloat16(device)
    with pytest.raises(hexir.TraceError, match="linear: mixed dtypes: x is bfloat16 but w is float32") as error:
        f(np.ones((4, 3), np.float32), tensor)
    assert error.value.where.startswith(__file__)
