"""Inputs a demanding user will try: each gets the right answer or a clear error."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import threading
import warnings
from pathlib import Path

import hexir_runtime
import hexir_runtime.cuda
import hexir_runtime.module
import numpy as np
import pytest

import hexir
from hexir.cli import main
from hexir.errors import CompileError, InputFileError, PlacementError, TraceError

from .conftest import lower, manifest

X = np.arange(6, dtype=np.float32).reshape(2, 3) - 2


@pytest.mark.parametrize(("fn", "check"), [
    (lambda x: (hexir.relu(x),), lambda r: isinstance(r, tuple) and len(r) == 1),
    (lambda x: [hexir.relu(x), x], lambda r: isinstance(r, list) and len(r) == 2),
    (lambda x: hexir.relu(x), lambda r: isinstance(r, np.ndarray)),
    (lambda x: hexir.print(x), lambda r: r is None),
], ids=["tuple", "list", "single", "none"])
def test_jit_returns_results_in_the_functions_own_form(fn, check):
    assert check(hexir.jit(fn)(X))


def test_big_endian_inputs_and_weights_are_taken():
    w = np.arange(12, dtype=">f4").reshape(3, 4)
    result = hexir.jit(lambda x: hexir.linear(x, w))(X.astype(">f4"))
    np.testing.assert_allclose(result, X @ w.astype(np.float32), rtol=1e-6)


def test_one_trace_per_signature_from_several_threads():
    fn = hexir.jit(lambda x: hexir.relu(x))
    threads = [threading.Thread(target=fn, args=(X,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert fn.trace_count == 1


def test_argument_names_must_be_ascii_identifiers():
    namespace: dict = {}
    exec("def f(é):\n    return é\n", namespace)
    with pytest.raises(TraceError, match=r"argument 'é' must be an ASCII identifier"):
        hexir.jit(namespace["f"])


def test_export_checks_its_destination_before_compiling(tmp_path):
    with pytest.raises(TraceError, match=r"hexir.export: cannot write .*/missing/m.hxb: the folder .*/missing does "
                                         r"not exist"):
        hexir.export(lambda x: hexir.relu(x), tmp_path / "missing" / "m.hxb", X)


@pytest.mark.parametrize("placement", [{"hexir.linear": 1}, {1: "cuda"}])
def test_placement_dicts_are_type_checked(placement):
    with pytest.raises(PlacementError, match="placement: expected op name -> device name strings"):
        hexir.jit(lambda x: x, placement=placement)


def test_a_launch_cuda_cannot_make_is_a_compile_error():
    fn = hexir.jit(lambda x, w: hexir.linear(x, w), placement="hexir.linear=cuda")
    with pytest.raises(CompileError, match=r"its launch needs 65625 blocks along y, more than CUDA's 65535"):
        fn.compile(hexir.TensorSpec((8_400_000, 1), "float32"), hexir.TensorSpec((1, 1), "float32"))


def test_custom_kernels_from_files_of_one_name_keep_their_own_code(tmp_path):
    kernels = []
    for folder, factor in (("a", 2), ("b", 10)):
        (tmp_path / folder).mkdir()
        source = tmp_path / folder / "k.c"
        source.write_text(f"#include <stdint.h>\nvoid scale_{folder}(const float *x, float *y, int64_t a, "
                          f"int64_t b, int64_t c, int64_t d) {{ for (int64_t i = 0; i < a * b; ++i) "
                          f"y[i] = {factor} * x[i]; }}\n")
        built = tmp_path / folder / "k.so"
        subprocess.run(["cc", "-shared", "-fPIC", "-nostartfiles", str(source), "-o", str(built)], check=True)
        kernels.append(hexir.kernel(f"scale_{folder}", cpu=built, out=lambda x: hexir.TensorSpec(x.shape, x.dtype),
                                    dtypes=("float32", "float32")))
    path = tmp_path / "m.hxb"
    hexir.export(lambda x: (kernels[0](x), kernels[1](x)), path, X)
    two, ten = hexir_runtime.load(path, "cpu").main(X)
    np.testing.assert_array_equal(two, 2 * X)
    np.testing.assert_array_equal(ten, 10 * X)


@pytest.mark.parametrize(("attributes", "message"), [
    ('kernel = "k", objects = {gpu = "/k.cu"}', r"objects must map some of cpu, cuda to files, got gpu"),
    ('kernel = "k", objects = {cpu = "/k.c"}, grid = array<i64: 0, 1>',
     r"grid must be 3 positive sizes, got \[0, 1\]"),
    ('kernel = "1k", objects = {cpu = "/k.c"}', r"kernel '1k' is not a C symbol"),
])
def test_custom_calls_in_mlir_files_are_verified(attributes, message):
    defaults = {"grid": "array<i64: 1, 1, 1>"}
    if "grid" not in attributes:
        attributes += f", grid = {defaults['grid']}"
    text = f'''
    func.func @main(%arg0: tensor<2xf32>) -> tensor<2xf32> {{
      %0 = "hexir.custom_call"(%arg0) {{{attributes}, block = array<i64: 32, 1, 1>, device = "auto",
        operandSegmentSizes = array<i32: 1, 0, 0, 0, 0, 0, 0, 0>}} : (tensor<2xf32>) -> tensor<2xf32>
      return %0 : tensor<2xf32>
    }}'''
    with pytest.raises(TraceError, match=message):
        lower(text, "mlir")


def test_a_transfer_to_its_own_device_is_refused():
    text = '''
    func.func @main(%arg0: tensor<2xf32>) -> tensor<2xf32> {
      %0 = "hexir.transfer"(%arg0) {source = "cpu", target = "cpu"} : (tensor<2xf32>) -> tensor<2xf32>
      return %0 : tensor<2xf32>
    }'''
    with pytest.raises(TraceError, match=r"transfer: source and target are both cpu"):
        lower(text, "mlir")


def test_the_command_keeps_the_decorators_options_under_its_own(tmp_path, capsys):
    program = tmp_path / "placed.py"
    program.write_text("import hexir\n\n@hexir.jit(placement='hexir.linear=cuda')\n"
                       "def f(x, w):\n    return hexir.linear(x, w)\n")
    specs = [f"{program}:f", "-emit=mlir-hetero", "-spec=x=2x3xf32", "-spec=w=3x4xf32"]
    assert main(specs) == 0
    assert re.search(r'"hexir.linear"\(%\d+, %\d+\) \{device = "cuda", operandSegmentSizes', capsys.readouterr().out)
    assert main([*specs, "-placement=hexir.linear=cpu"]) == 0
    assert '"hexir.linear"(%arg0, %arg1) {device = "cpu", operandSegmentSizes' in capsys.readouterr().out


def test_the_command_reports_a_file_that_fails_to_load(tmp_path, capsys):
    (tmp_path / "broken.py").write_text("import hexir\nraise RuntimeError('boom')\n")
    assert main([f"{tmp_path}/broken.py:f", "-emit=mlir"]) == 1
    err = capsys.readouterr().err
    assert err == f"hexir: error: {tmp_path}/broken.py:2: {tmp_path}/broken.py failed to load: RuntimeError: boom\n"
    (tmp_path / "value.py").write_text("W = 3\n")
    with pytest.raises(InputFileError, match=r"'W' is a int, not a function"):
        from hexir.cli import _load_function
        _load_function(f"{tmp_path}/value.py:W")


W_SHARED = np.arange(9, dtype=np.float32).reshape(3, 3) - 4


def _shared_weight(x):
    with hexir.on("cuda"):
        h = hexir.linear(x, W_SHARED)
    return hexir.linear(h, W_SHARED)


def test_a_weight_used_on_two_devices_is_stored_once():
    compiled = hexir.jit(_shared_weight).compile(hexir.TensorSpec((2, 3), "float32"))
    data = manifest(compiled)
    (entry,) = data["entries"]
    bound = [c for c in entry["program"] if c["op"] == "constant"]
    assert len(data["constants"]) == 1 and {entry["buffers"][c["dst"]]["device"] for c in bound} == {"cpu", "cuda"}
    assert not [c for c in entry["program"] if c["op"] == "transfer" and c["src"] in {b["dst"] for b in bound}]
    for device in ("auto", "cpu", "reference"):  # auto: the GPU, where there is one
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "no usable GPU", where there is none
            module = hexir_runtime.load(compiled, device)
        np.testing.assert_array_equal(module.main(X), X @ W_SHARED @ W_SHARED, err_msg=device)


def _fake_gpu():
    """tests/runtime's fake CUDA driver (a GPU's memory kept in host bytearrays, kernels run in
    numpy), so that a module runs its cuda part on a device of its own, apart from the cpu."""
    path = Path(__file__).resolve().parents[1] / "runtime" / "test_cuda.py"
    spec = importlib.util.spec_from_file_location("_hexir_fake_cuda", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        return module.FakeDriver
    except Exception as error:  # noqa: BLE001 - whatever keeps it from loading, say it
        pytest.skip(f"the fake CUDA driver of tests/runtime/test_cuda.py does not load: {error!r}")


def test_a_weight_used_on_two_devices_gives_each_device_its_own_copy(tmp_path, monkeypatch):
    """The cpu linear and the cuda linear bind one constant: each device needs its own upload
    (a cache of uploads keyed by the constant alone hands the cpu kernel a GPU pointer)."""
    driver = _fake_gpu()()
    monkeypatch.setattr(hexir_runtime.cuda, "_driver", lambda: driver)
    monkeypatch.setattr(hexir_runtime.module, "_cuda_devices", [])
    path = hexir.export(_shared_weight, tmp_path / "shared.hxb", hexir.TensorSpec((2, 3), "float32"))
    driver.know(path)
    with hexir_runtime.load(path, "cuda") as module:
        assert module.device_name.startswith("cuda")
        np.testing.assert_array_equal(module.main(X), X @ W_SHARED @ W_SHARED)
