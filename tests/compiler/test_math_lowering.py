"""Math ops on both devices (docs/math.md): cpu kernels built by to-llvm and the cpu backend and
run against Python's math / numpy, float32 and float64, vectors and scalars, special values
included; which lowering each op takes; cuda kernels built to CUBIN and PTX with every libdevice
call resolved."""

from __future__ import annotations

import importlib.util
import math
import re

import numpy as np
import pytest
from mlir import ir

from hexir.backend import cuda
from hexir.errors import CompileError
from hexir.passes.to_llvm import cpu_kernels_to_llvm
from hexir.schedules import mathlib

from .conftest import REPO, filecheck, parse

_spec = importlib.util.spec_from_file_location("math_accuracy", REPO / "bench" / "math_accuracy.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

LEVEL = "x86-64-v3"  # AVX2 + FMA: what CI machines have; the baseline level is built in the bench


@pytest.fixture(scope="module")
def library():
    return bench.cpu_library(LEVEL)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op", bench.OPS)
def test_each_op_is_accurate_on_vectors_and_scalars(library, op, dtype):
    """float32 within 1 ulp of math's value (the lowering reaches 0.5), float64 within 1e-14 of
    numpy's; NaN, ±inf and signed zeros exactly as the reference."""
    x, p = bench.inputs(op, dtype, 4000, stride=18)
    exact = bench.reference(op, x, p)
    results = {}
    for width in ((16, 8)[dtype is np.float64], 1):
        with np.errstate(all="ignore"):
            results[width] = y = bench.run_cpu(library, op, width, x, p)
        error, wrong = bench.errors(y, exact)
        assert not wrong, f"{op}: {[(x[i], p[i], y[i], exact[i]) for i in wrong[:5]]}"
        assert error <= (1.0 if dtype is np.float32 else 1e-14), f"{op} {dtype.__name__} width {width}: {error}"
    # the vector body and the scalar tail of one loop compute the same function, bit for bit
    np.testing.assert_array_equal(*results.values())


SPECIAL = [("exp", 1000.0, math.inf), ("exp", -1000.0, 0.0), ("exp", -math.inf, 0.0), ("exp", math.nan, math.nan),
           ("log", 0.0, -math.inf), ("log", -0.0, -math.inf), ("log", -1.0, math.nan), ("log", math.inf, math.inf),
           ("log", 1.0, 0.0), ("tanh", math.inf, 1.0), ("tanh", -math.inf, -1.0), ("tanh", -0.0, -0.0),
           ("tanh", 1e-30, 1e-30), ("erf", math.inf, 1.0), ("erf", -math.inf, -1.0), ("erf", -0.0, -0.0),
           ("erf", math.nan, math.nan), ("sqrt", -1.0, math.nan), ("sqrt", -0.0, -0.0), ("rsqrt", 0.0, math.inf),
           ("rsqrt", -1.0, math.nan), ("absf", -0.0, 0.0)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("op", "x", "expected"), SPECIAL)
def test_special_values_behave_as_numpy(library, op, x, expected, dtype):
    for width in ((16, 8)[dtype is np.float64], 1):
        with np.errstate(all="ignore"):
            y = bench.run_cpu(library, op, width, np.full(17, x, dtype), np.zeros(17, dtype))
        assert np.array_equal(y, np.full(17, expected, dtype), equal_nan=True), (op, x, y)
        assert math.isnan(expected) or (np.signbit(y) == (math.copysign(1.0, expected) < 0)).all(), (op, x, y)


def _lowered(op: str, type_: str) -> str:
    """A kernel applying math.`op` to a `type_` (f32, vector<16xf32>...) through to-llvm, printed."""
    vector = type_.startswith("vector")
    memory = f"memref<16x{type_[-4:-1] if vector else type_}>"
    load, store = ((f"vector.load %x[%c0] : {memory}, {type_}", f"vector.store %e, %x[%c0] : {memory}, {type_}")
                   if vector else (f"memref.load %x[%c0] : {memory}", f"memref.store %e, %x[%c0] : {memory}"))
    return str(cpu_kernels_to_llvm(parse(f"""
    func.func @k(%x: {memory}) attributes {{hextir.kernel = #hextir.kernel<"cpu", "m">, hextir.level = "{LEVEL}"}} {{
      %c0 = arith.constant 0 : index
      %v = {load}
      %e = math.{op} %v : {type_}
      {store}
      return
    }}""")))


@pytest.mark.parametrize("op", ["exp", "log", "tanh", "erf"])
@pytest.mark.parametrize("type_", ["vector<16xf32>", "f32", "vector<8xf64>", "f64"])
def test_math_is_written_as_vector_arithmetic_without_calls_or_fast_math(op, type_):
    wide, bits = type_.replace("f32", "f64"), type_.replace("f32", "i64").replace("f64", "i64")
    checks = f"CHECK: llvm.fptrunc {{{{.*}}}} : {wide} to {type_}" if "f32" in type_ else ""
    filecheck(_lowered(op, type_), f"""
        CHECK: llvm.func @k
        CHECK-NOT: llvm.call
        CHECK-NOT: fastmath
        CHECK: llvm.bitcast {{{{.*}}}} : {wide} to {bits}
        {checks}
        CHECK-NOT: llvm.call
        CHECK: llvm.return""")


def test_rsqrt_is_one_division_by_a_square_root_in_float64():
    filecheck(_lowered("rsqrt", "vector<16xf32>"), """
        CHECK: llvm.fpext {{.*}} : vector<16xf32> to vector<16xf64>
        CHECK: llvm.intr.sqrt({{.*}}) : (vector<16xf64>) -> vector<16xf64>
        CHECK: llvm.fdiv
        CHECK: llvm.fptrunc""")


def test_other_math_goes_to_llvm_intrinsics_or_libm_calls_per_element():
    filecheck(_lowered("sin", "vector<8xf64>"), "CHECK: llvm.intr.sin({{.*}}) : (vector<8xf64>) -> vector<8xf64>")
    filecheck(_lowered("erfc", "vector<8xf64>"), """
        CHECK: llvm.func @erfc(f64) -> f64
        CHECK-COUNT-8: llvm.call @erfc(
        CHECK-NOT: llvm.call @erfc(""")


def test_ops_that_would_lose_accuracy_are_refused_at_their_location():
    with pytest.raises(CompileError, match=r"'math.expm1' at .*has no accurate cpu lowering"):
        _lowered("expm1", "f64")


def test_mathlib_leaves_other_ops_to_llvm_and_libm():
    module = parse("func.func @f(%x: f64, %y: f32) { return }")
    block = module.body.operations[0].regions[0].blocks[0]
    with module.context, ir.Location.unknown(), ir.InsertionPoint.at_block_terminator(block):
        x, y = block.arguments
        assert mathlib.emit("math.sin", y) is None
        assert mathlib.emit("math.rsqrt", x) is None  # LLVM's 1 / sqrt is what mathlib would write
        assert mathlib.emit("math.exp", x).type == x.type
        assert mathlib.emit("math.exp", y).type == y.type


def test_cuda_math_builds_cubins_and_ptx_with_libdevice_linked(tmp_path):
    bench.build(tmp_path)  # every op, float32 and float64, through the cuda backend
    ptx = (tmp_path / "sm_80.ptx").read_text()
    for op in bench.OPS:
        for t in ("f32", "f64"):
            assert f".entry {op}_{t}(" in ptx
    assert not re.search(r"\.extern|__nv_", ptx), "a libdevice call left unresolved"
    assert not re.search(r"sqrt\.approx", ptx), "libdevice's approximate square roots"
    for t, register in (("f32", "%r"), ("f64", "%rd")):
        rsqrt = ptx[ptx.index(f".entry rsqrt_{t}("):]
        assert re.search(rf"sqrt\.rn\.{t}\s+({register}\d+).*\n\s*rcp\.rn\.{t}\s+{register}\d+, \1;", rsqrt), rsqrt
    for arch in ("sm_80", "sm_90"):
        assert (tmp_path / f"{arch}.cubin").read_bytes()[:4] == b"\x7fELF"


def test_an_unresolved_device_function_is_a_compile_error_naming_it():
    module = parse("""
    module attributes {gpu.container_module} { gpu.module @hexir_cuda {
      func.func private @__nv_nothing(f32) -> f32
      gpu.func @k(%x: memref<4xf32>) kernel {
        %c0 = arith.constant 0 : index
        %v = memref.load %x[%c0] : memref<4xf32>
        %e = func.call @__nv_nothing(%v) : (f32) -> f32
        memref.store %e, %x[%c0] : memref<4xf32>
        gpu.return
      } } }""")
    with pytest.raises(CompileError, match="call __nv_nothing, which no library defines"):
        cuda.compile_kernels(module, ("sm_90",))
