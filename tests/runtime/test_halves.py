"""bfloat16 and float16 in the runtime (#26): the family contracts, the reference device's
float32 compute, DLPack (kDLBfloat, kDLFloat 16), hexir-run's .npy files, print, serving's
datatypes, and a runtime without ml_dtypes. Modules are built by hand (conftest.Builder)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hexir_runtime import HxbFormatError, load
from hexir_runtime import format as hxb
from hexir_runtime.cli import main as hexir_run
from hexir_runtime.dlpack import BFLOAT, FLOAT, DLPackArray, tensor_of, unpack
from hexir_runtime.serving import protocol
from test_kernel_families import A0, A1, SOFTMAX, one_kernel

BF16 = np.dtype(ml_dtypes.bfloat16)
RUNTIME = Path(__file__).parents[2] / "runtime"


def test_a_pointwise_kernel_may_convert_and_computes_in_float32(modules):
    """A cast (bf16 in, f32 out) and a mixed add: the reference computes in float32, then stores."""
    module = load(hxb.encode(*one_kernel(modules, "pointwise", ["add", A0, A1], [([4], "bfloat16"), ([4], "float16")],
                                         ([4], "float32"))), "reference")
    a, b = np.array([1, 2**-8, 3, 256], BF16), np.float16([2**-11, 1, 0.5, 1])
    result = module.main(a, b)
    assert result.dtype == np.float32
    np.testing.assert_array_equal(result, a.astype(np.float32) + b.astype(np.float32))
    softmax = load(hxb.encode(*one_kernel(modules, "reduce", SOFTMAX, [(["n", 3], "bfloat16")],
                                          (["n", 3], "bfloat16"))), "reference")
    x = np.array([[0, 1, 2]], BF16)
    e = np.exp(np.float32([0, 1, 2]) - 2)
    np.testing.assert_array_equal(softmax.main(x), (e / e.sum()).astype(BF16)[None])


def test_a_contract_keeps_one_dtype(modules):
    manifest, blobs = one_kernel(modules, "linear", A0, [([2, 3], "float32"), ([3, 4], "float32")], ([2, 4], "float32"))
    manifest["kernels"][0]["args"][2]["dtype"] = "bfloat16"
    with pytest.raises(HxbFormatError, match=r"kernels\[0\].args\[2\].dtype: expected float32 like args\[0\], got "
                                             r"'bfloat16'"):
        hxb.encode(manifest, blobs)
    module = load(hxb.encode(*one_kernel(modules, "linear", A0, [([2, 3], "bfloat16"), ([3, 4], "bfloat16")],
                                         ([2, 4], "bfloat16"))), "reference")
    x, w = (np.arange(n, dtype=np.float32).reshape(s).astype(BF16) / 7 for n, s in ((6, (2, 3)), (12, (3, 4))))
    np.testing.assert_array_equal(module.main(x, w), (x.astype(np.float32) @ w.astype(np.float32)).astype(BF16))


def test_dlpack_reads_and_writes_bfloat16_and_float16():
    class Host:  # a host producer (numpy's from_dlpack refuses a bfloat16 one)
        def __init__(self, array):
            self.array = array

        def __dlpack_device__(self):
            return (1, 0)

        def __dlpack__(self, stream=None, **_):
            return self.array.__dlpack__()

    for dtype, code in ((BF16, BFLOAT), (np.dtype(np.float16), FLOAT)):
        memory = np.arange(6, dtype=np.float32).astype(dtype).reshape(2, 3)
        array = DLPackArray(memory.ctypes.data, (2, 3), dtype, (1, 0))
        capsule = array.__dlpack__()
        assert _code_of(capsule) == code
        tensor = unpack(capsule)
        assert tensor.dtype == dtype and tensor.shape == (2, 3)
        tensor.release()
        host = tensor_of(Host(array))
        assert host.dtype == dtype and host.tolist() == memory.tolist() and host.ctypes.data == memory.ctypes.data


def _code_of(capsule) -> int:
    import ctypes

    from hexir_runtime.dlpack import _DLTENSOR, _api

    return _DLTENSOR.unpack(ctypes.string_at(_api.PyCapsule_GetPointer(capsule, b"dltensor"), _DLTENSOR.size))[4]


def test_dlpack_with_torch_when_it_is_installed():
    torch = pytest.importorskip("torch")
    for name in ("bfloat16", "float16"):
        source = torch.arange(6, dtype=getattr(torch, name)).reshape(2, 3)
        array = tensor_of(source)
        assert array.dtype.name == name and array.astype(np.float32).tolist() == source.float().tolist()
        exported = DLPackArray(array.ctypes.data, (2, 3), array.dtype, (1, 0))
        assert torch.from_dlpack(exported).dtype == getattr(torch, name)


@pytest.fixture
def doubling(modules, tmp_path) -> Path:
    """main(x: bfloat16[n, 3]) -> x * 2 (a reference-device module)."""
    path = tmp_path / "double.hxb"
    path.write_bytes(hxb.encode(*one_kernel(modules, "pointwise", ["mul", A0, ["const", 2]], [(["n", 3], "bfloat16")],
                                            (["n", 3], "bfloat16"))))
    return path


def test_hexir_run_reads_numpys_raw_2_byte_files_as_bfloat16(doubling, tmp_path, capsys):
    x = np.array([[1, 2.5, -3]], BF16)
    np.save(tmp_path / "x.npy", x)  # (numpy writes ml_dtypes' bfloat16 as '<V2')
    assert hexir_run([str(doubling), "--device=reference", "--input", f"a0={tmp_path / 'x.npy'}",
                      "--output", str(tmp_path / "y.npz")]) == 0
    assert "output0: bfloat16[1, 3]" in capsys.readouterr().out
    np.testing.assert_array_equal(np.load(tmp_path / "y.npz")["output0"].view(BF16), x * 2)
    np.save(tmp_path / "f.npy", np.float32([[1, 2, 3]]))
    assert hexir_run([str(doubling), "--device=reference", "--input", f"a0={tmp_path / 'f.npy'}"]) == 1
    assert "bfloat16" in capsys.readouterr().err


def test_print_writes_16_bit_values_as_floats():
    from hexir_runtime.executor import format_tensor

    assert format_tensor(np.array([1.5, -2], BF16)) == "1.500000 -2.000000 \n"
    assert format_tensor(np.float16([[0.25]])) == "0.250000 \n"


def test_serving_names_bfloat16_bf16():
    assert protocol.DATATYPES["bfloat16"] == "BF16" and protocol.DATATYPES["float16"] == "FP16"
    blobs: list[bytes] = []
    body, headers = protocol._message({"outputs": [protocol._tensor("y", np.array([1, 2], BF16), True, blobs)]}, blobs)
    decoded = protocol.decode_response(body, int(headers[protocol.HEADER_LENGTH]))
    assert decoded["y"].dtype == BF16 and decoded["y"].tolist() == [1, 2]


def test_without_ml_dtypes_the_runtime_imports_and_a_bfloat16_module_says_what_to_install(doubling, mlp_file, tmp_path):
    np.save(tmp_path / "x.npy", np.ones((2, 8), np.float32))
    program = "\n".join([
        "import sys", "sys.modules['ml_dtypes'] = None", "import numpy as np", "import hexir_runtime",
        "print(hexir_runtime.load(sys.argv[1], 'cpu').main(np.load(sys.argv[2])).shape)",
        "try:", "    hexir_runtime.load(sys.argv[3], 'reference')",
        "except hexir_runtime.DeviceError as error:", "    print(error)",
        "assert 'ml_dtypes' not in sys.modules or sys.modules['ml_dtypes'] is None"])
    environment = {**os.environ, "PYTHONPATH": str(RUNTIME) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-c", program, str(mlp_file), str(tmp_path / "x.npy"), str(doubling)],
                            capture_output=True, text=True, env=environment)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-2:] == [
        "(2, 4)", "bfloat16 tensors need the ml_dtypes package (numpy's bfloat16): pip install 'hexir-runtime[bf16]'"]
