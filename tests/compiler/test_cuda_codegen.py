"""The compiler's CUDA output, checked without a GPU: the scheduled and outlined IR, the manifest
of a cuda-placed module (launch geometry, images, cpu fallbacks, transfers), the CUBIN (an ELF
for EM_CUDA of the requested SM, holding the kernels) and the PTX, bad targets refused before
any pass runs, and the cuda module's cpu fallbacks and reference run compared with numpy.

The launch geometry is computed here from the shapes and the tile sizes the schedule documents
(64x64 tiles of 16x16 threads, 128x128 for large outputs; 256-thread blocks for element-wise
ops), never from the compiler's own functions or output.
"""

# IR lines are checked as printed: wrapping them would change what they check.
# ruff: noqa: E501

from __future__ import annotations

import math
import re
import struct
import subprocess
from pathlib import Path

import hexir_runtime
import numpy as np
import pytest
from hexir_runtime import format as hxb
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import hexir
import hexir.cli
from hexir.backend import cuda as cuda_backend
from hexir.errors import TargetError
from hexir.schedules import cpu_families, cuda_families
from hexir.schedules import cuda as gpu_schedule
from hexir.target import CUDA_ARCHS, MAX_SHARED_BYTES

from .conftest import LLVM_BIN, cpu_linear_tiles, cuda_linear_launch, family_attrs, filecheck, linear_program, lower

ON_CUDA = (("hexir.linear", "cuda"), ("hexir.relu", "cuda"))
RELU = family_attrs("relu")
EM_CUDA = 190

# x[17, 5] @ W[5, 7], then relu: sizes no block divides, distinct from the schedule's constants.
# The linear's result is printed too, so the relu is not fused into it: the relu's own schedule
# and launch are checked here (tests/compiler/test_fuse.py has the fused pair).
PROGRAM = f"""\
func.func @main(%arg0: tensor<17x5xf32>) -> tensor<17x7xf32> {{
  %0 = "hexir.constant"() {{device = "auto", name = "W", value = dense<0.5> : tensor<5x7xf32>}} : () -> tensor<5x7xf32>
  %1 = "hexir.linear"(%arg0, %0) {{device = "auto", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>}} : (tensor<17x5xf32>, tensor<5x7xf32>) -> tensor<17x7xf32>
  %2 = "hexir.relu"(%1) {{device = "auto", {RELU}}} : (tensor<17x7xf32>) -> tensor<17x7xf32>
  "hexir.print"(%1) : (tensor<17x7xf32>) -> ()
  return %2 : tensor<17x7xf32>
}}
"""

RELU_3D = f"""\
func.func @main(%arg0: tensor<2x3x5xf64>) -> tensor<2x3x5xf64> {{
  %0 = "hexir.relu"(%arg0) {{device = "auto", {RELU}}} : (tensor<2x3x5xf64>) -> tensor<2x3x5xf64>
  return %0 : tensor<2x3x5xf64>
}}
"""


# ---- the scheduled and the outlined IR --------------------------------------------------------


# x[17, 5] @ W[5, 7] + b, then relu, all fused into one cuda kernel (the relu is the linear's only user).
FUSED_BIAS_RELU = f"""\
func.func @main(%arg0: tensor<17x5xf32>) -> tensor<17x7xf32> {{
  %0 = "hexir.constant"() {{device = "auto", name = "W", value = dense<0.5> : tensor<5x7xf32>}} : () -> tensor<5x7xf32>
  %b = "hexir.constant"() {{device = "auto", name = "b", value = dense<-1.0> : tensor<7xf32>}} : () -> tensor<7xf32>
  %1 = "hexir.linear"(%arg0, %0, %b) {{device = "auto", operandSegmentSizes = array<i32: 1, 1, 1, 0, 0, 0, 0>}} : (tensor<17x5xf32>, tensor<5x7xf32>, tensor<7xf32>) -> tensor<17x7xf32>
  %2 = "hexir.relu"(%1) {{device = "auto", {RELU}}} : (tensor<17x7xf32>) -> tensor<17x7xf32>
  return %2 : tensor<17x7xf32>
}}
"""

# x[17, 5] @ w[5, 7]: more rows than the row-streaming kernel takes, too few blocks for larger
# tiles: the SIMT kernel with the smallest tiling of the schedule's table, 16x16 tiles of out (two
# blocks along M), k slices of 16, one sum per thread, so 16x16 threads stage 16*16 / 256 = 1
# element of each tile per slice, and read their row (column) as a 1-wide vector (WIDTH) per k.
TILE, STEP, PER = 16, 16, 1
LOADS, WIDTH = TILE * STEP // 256, 1


def _fetch_checks(name: str, source: str, staged: str, origin: tuple[str, str], width: int,
                  bounds: tuple[int, int], shape: str) -> str:
    """One thread's loads of a slice into registers: element e at thread + 256 e, split into
    (r, c) by the slice's width, at origin + (r, c), loaded only inside bounds (else 0)."""
    return f"""
        CHECK:      scf.for %[[{name}E:arg[0-9]+]] = %c0 to %c{LOADS} step %c1 {{
        CHECK-NEXT:   %c256 = arith.constant 256 : index
        CHECK-NEXT:   %[[{name}E256:[0-9]+]] = arith.muli %[[{name}E]], %c256 : index
        CHECK-NEXT:   %[[{name}POS:[0-9]+]] = arith.addi %[[THREAD]], %[[{name}E256]] : index
        CHECK-NEXT:   %[[{name}R:[0-9]+]] = arith.divui %[[{name}POS]], %c{width} : index
        CHECK-NEXT:   %[[{name}C:[0-9]+]] = arith.remui %[[{name}POS]], %c{width} : index
        CHECK-NEXT:   %[[{name}ROW:[0-9]+]] = arith.addi {origin[0]}, %[[{name}R]] : index
        CHECK-NEXT:   %[[{name}COL:[0-9]+]] = arith.addi {origin[1]}, %[[{name}C]] : index
        CHECK-NEXT:   %[[{name}IN1:[0-9]+]] = arith.cmpi ult, %[[{name}ROW]], %c{bounds[0]} : index
        CHECK-NEXT:   %[[{name}IN2:[0-9]+]] = arith.cmpi ult, %[[{name}COL]], %c{bounds[1]} : index
        CHECK-NEXT:   %[[{name}IN:[0-9]+]] = arith.andi %[[{name}IN1]], %[[{name}IN2]] : i1
        CHECK-NEXT:   %[[{name}V:[0-9]+]] = scf.if %[[{name}IN]] -> (f32) {{
        CHECK-NEXT:     %[[{name}L:[0-9]+]] = "hextir.load"({source}, %[[{name}ROW]], %[[{name}COL]]) : ({shape}, index, index) -> f32
        CHECK-NEXT:     scf.yield %[[{name}L]] : f32
        CHECK-NEXT:   }} else {{
        CHECK-NEXT:     scf.yield %[[ZERO]] : f32
        CHECK-NEXT:   }}
        CHECK-NEXT:   "hextir.store"(%[[{name}V]], %[[{staged}]], %[[{name}E]])
        CHECK-NEXT: }} {{hextir.schedule = #hextir.loop<"unrolled", "">}}"""


def _put_checks(name: str, staged: str, tile: str, buffer: str, width: int, transposed: bool) -> str:
    """What _fetch_checks loaded, stored into tile[buffer] at [r, c] (x: transposed, [c, r])."""
    at = f"%[[{name}C]], %[[{name}R]]" if transposed else f"%[[{name}R]], %[[{name}C]]"
    return f"""
        CHECK:      scf.for %[[{name}E:arg[0-9]+]] = %c0 to %c{LOADS} step %c1 {{
        CHECK:        %[[{name}R:[0-9]+]] = arith.divui %{{{{.+}}}}, %c{width} : index
        CHECK-NEXT:   %[[{name}C:[0-9]+]] = arith.remui %{{{{.+}}}}, %c{width} : index
        CHECK-NEXT:   %[[{name}V:[0-9]+]] = "hextir.load"(%[[{staged}]], %[[{name}E]])
        CHECK-NEXT:   "hextir.store"(%[[{name}V]], %[[{tile}]], {buffer}, {at})
        CHECK-NEXT: }} {{hextir.schedule = #hextir.loop<"unrolled", "">}}"""


def linear_kernel_checks(out: str, epilogue: str, ret: str) -> str:
    """FileCheck lines for the cuda linear kernel of x[17, 5] @ w[5, 7] (M, K, N = 17, 5, 7, so
    each bound is told apart by its constant): slices of x [TILE, STEP] from (row0 + r, k0 + c)
    guarded by row < M and k < K, of w [STEP, TILE] from (k0 + r, col0 + c) guarded by k < K
    and col < N, through registers into two shared buffers (x transposed); the FMAs read
    WIDTH-wide vectors; the store of out[row, col] is guarded by row < M and col < N, both,
    with `epilogue` between the sum's load and the store."""
    def fetches(k0: str) -> str:
        return (_fetch_checks("X", "%arg0", "XSTAGED", ("%[[ROW0]]", k0), STEP, (17, 5), "memref<17x5xf32>")
                + _fetch_checks("W", "%arg1", "WSTAGED", (k0, "%[[COL0]]"), TILE, (5, 7), "memref<5x7xf32>"))

    def puts(buffer: str) -> str:
        return (_put_checks("PX", "XSTAGED", "XTILE", buffer, STEP, transposed=True)
                + _put_checks("PW", "WSTAGED", "WTILE", buffer, TILE, transposed=False))
    return f"""
        CHECK:      scf.for %[[BY:arg[0-9]+]] = %c0 to %c2 step %c1 {{
        CHECK-NEXT:   scf.for %[[BX:arg[0-9]+]] = %c0 to %c1 step %c1 {{
        CHECK-NEXT:     %[[XTILE:[0-9]+]] = "hextir.alloc_local"() {{space = "shared"}} : () -> memref<2x{STEP}x{TILE + WIDTH}xf32, #gpu.address_space<workgroup>>
        CHECK-NEXT:     %[[WTILE:[0-9]+]] = "hextir.alloc_local"() {{space = "shared"}} : () -> memref<2x{STEP}x{TILE}xf32, #gpu.address_space<workgroup>>
        CHECK:          scf.for %[[TY:arg[0-9]+]] = %c0 to %c16 step %c1 {{
        CHECK-NEXT:       scf.for %[[TX:arg[0-9]+]] = %c0 to %c16 step %c1 {{
        CHECK-NEXT:         %[[SUMS:[0-9]+]] = "hextir.alloc_local"() {{space = "private"}} : () -> memref<{PER}x{PER}xf32>
        CHECK-NEXT:         %[[ZERO:cst[_0-9]*]] = arith.constant 0.000000e+00 : f32
        CHECK-COUNT-{PER * PER}: "hextir.store"(%[[ZERO]], %[[SUMS]]
        CHECK-NEXT:         %[[T1:[0-9]+]] = arith.muli %[[TY]], %c16 : index
        CHECK-NEXT:         %[[THREAD:[0-9]+]] = arith.addi %[[T1]], %[[TX]] : index
        CHECK:              %[[ROW0:[0-9]+]] = arith.muli %[[BY]], %c{TILE} : index
        CHECK-NEXT:         %[[COL0:[0-9]+]] = arith.muli %[[BX]], %c{TILE} : index
        CHECK-NEXT:         %[[XSTAGED:[0-9]+]] = "hextir.alloc_local"() {{space = "private"}} : () -> memref<{LOADS}xf32>
        CHECK-NEXT:         %[[WSTAGED:[0-9]+]] = "hextir.alloc_local"() {{space = "private"}} : () -> memref<{LOADS}xf32>

        slice 0 into buffer 0, then a barrier
        {fetches("%c0")}
        {puts("%c0")}
        CHECK-NEXT: "hextir.barrier"() : () -> ()

        each slice: the next one's loads, the sum read (PER = 1), the FMAs on this one's buffer
        (KS % 2), the sum written, the next one stored into the other buffer (1 - KS % 2), a barrier
        CHECK-NEXT: scf.for %[[KS:arg[0-9]+]] = %c0 to %c1 step %c1 {{
        CHECK-NEXT:   %[[NEXT:[0-9]+]] = arith.addi %[[KS]], %c1 : index
        CHECK-NEXT:   %[[K0:[0-9]+]] = arith.muli %[[NEXT]], %c{STEP} : index
        {fetches("%[[K0]]")}
        CHECK-NEXT:   %[[BUF:[0-9]+]] = arith.remui %[[KS]], %c2 : index
        CHECK-NEXT:   %[[OLD:[0-9]+]] = "hextir.load"(%[[SUMS]], %c0, %c0)
        CHECK-NEXT:   %[[TYW:[0-9]+]] = arith.muli %[[TY]], %c{WIDTH} : index
        CHECK-NEXT:   %[[XAT:[0-9]+]] = arith.addi %[[TYW]], %c0 : index
        CHECK-NEXT:   %[[A:[0-9]+]] = vector.load %[[XTILE]][%[[BUF]], %c0, %[[XAT]]] {{alignment = {4 * WIDTH} : i64}} : memref<2x{STEP}x{TILE + WIDTH}xf32, #gpu.address_space<workgroup>>, vector<{WIDTH}xf32>
        CHECK-NEXT:   %[[A0:[0-9]+]] = vector.extract %[[A]][0] : f32 from vector<{WIDTH}xf32>
        CHECK-NEXT:   %[[TXW:[0-9]+]] = arith.muli %[[TX]], %c{WIDTH} : index
        CHECK-NEXT:   %[[WAT:[0-9]+]] = arith.addi %[[TXW]], %c0 : index
        CHECK-NEXT:   %[[B:[0-9]+]] = vector.load %[[WTILE]][%[[BUF]], %c0, %[[WAT]]] {{alignment = {4 * WIDTH} : i64}} : memref<2x{STEP}x{TILE}xf32, #gpu.address_space<workgroup>>, vector<{WIDTH}xf32>
        CHECK-NEXT:   %[[B0:[0-9]+]] = vector.extract %[[B]][0] : f32 from vector<{WIDTH}xf32>
        CHECK-NEXT:   %[[P:[0-9]+]] = arith.mulf %[[A0]], %[[B0]] fastmath<contract> : f32
        CHECK-NEXT:   arith.addf %[[OLD]], %[[P]] fastmath<contract> : f32
        CHECK-COUNT-{STEP * PER * PER - 1}: arith.mulf
        CHECK-NOT:    "hextir.store"
        CHECK:        "hextir.store"(%{{{{.+}}}}, %[[SUMS]], %c0, %c0)
        CHECK-NEXT:   %[[OTHER:[0-9]+]] = arith.subi %c1, %[[BUF]] : index
        {puts("%[[OTHER]]")}
        CHECK-NEXT:   "hextir.barrier"() : () -> ()
        CHECK-NEXT: }} {{hextir.schedule = #hextir.loop<"serial", "">}}

        the store: out[row0 + 2 ty + i, col0 + 2 tx + j] where row < M = 17 and col < N = 7
        CHECK-NEXT: %[[I0:[0-9]+]] = arith.muli %[[TY]], %c{WIDTH} : index
        CHECK-NEXT: %[[RIN:[0-9]+]] = arith.addi %[[I0]], %c0 : index
        CHECK-NEXT: %[[ROW:[0-9]+]] = arith.addi %[[ROW0]], %[[RIN]] : index
        CHECK-NEXT: %[[J0:[0-9]+]] = arith.muli %[[TX]], %c{WIDTH} : index
        CHECK-NEXT: %[[CIN:[0-9]+]] = arith.addi %[[J0]], %c0 : index
        CHECK-NEXT: %[[COL:[0-9]+]] = arith.addi %[[COL0]], %[[CIN]] : index
        CHECK-NEXT: %[[IN1:[0-9]+]] = arith.cmpi ult, %[[ROW]], %c17 : index
        CHECK-NEXT: %[[IN2:[0-9]+]] = arith.cmpi ult, %[[COL]], %c7 : index
        CHECK-NEXT: %[[IN:[0-9]+]] = arith.andi %[[IN1]], %[[IN2]] : i1
        CHECK-NEXT: scf.if %[[IN]] {{
        CHECK-NEXT:   %[[SUM:[0-9]+]] = "hextir.load"(%[[SUMS]], %c0, %c0) : (memref<{PER}x{PER}xf32>, index, index) -> f32
        {epilogue}
        CHECK-NEXT:   "hextir.store"(%[[{ret}]], %{out}, %[[ROW]], %[[COL]]) : (f32, memref<17x7xf32>, index, index) -> ()
        CHECK-NEXT: }}
        CHECK-NOT:    scf.if
        CHECK:        }} {{hextir.schedule = #hextir.loop<"parallel", "threadIdx.x">}}
        CHECK-NEXT:   }} {{hextir.schedule = #hextir.loop<"parallel", "threadIdx.y">}}
        CHECK-NEXT: }} {{hextir.schedule = #hextir.loop<"parallel", "blockIdx.x">}}
        CHECK-NEXT: }} {{hextir.schedule = #hextir.loop<"parallel", "blockIdx.y">}}
        CHECK-NEXT: return
    """


def test_tir_binds_the_cuda_loops_and_guards_the_shapes():
    launch = 'hextir.launch = {block = array<i64: 16, 16, 1>, grid = ["1", "2", "1"], shared_bytes = 0 : i64}'
    filecheck(lower(PROGRAM, "mlir-tir", placement=ON_CUDA), f"""
        CHECK:      func.func public @[[LINEAR:linear_[0-9]+]](
        CHECK-SAME: %{{{{.+}}}}: memref<17x5xf32>, %{{{{.+}}}}: memref<5x7xf32>, %{{{{.+}}}}: memref<17x7xf32>)
        CHECK-SAME: hextir.expr = "[\\22arg\\22,0]"
        CHECK-SAME: hextir.kernel = #hextir.kernel<"cuda", "linear">, {launch}, hextir.sizes = []}}
        {linear_kernel_checks("arg2", "", "SUM")}

        CHECK:      func.func public @[[LINEAR]]_cpu(
        CHECK-SAME: hextir.expr = "[\\22arg\\22,0]", hextir.fallback_of = @[[LINEAR]]
        CHECK-SAME: hextir.kernel = #hextir.kernel<"cpu", "linear">, hextir.level = "x86-64", hextir.sizes = [], hextir.work = {{extent = "{cpu_linear_tiles(17, 7, "float32")}", grain = 1 : i64}}
        CHECK-NOT:  Idx
        CHECK:      #hextir.loop<"parallel", "">
        CHECK-NEXT: return

        CHECK:      func.func public @[[RELU:relu_[0-9]+]](
        CHECK-SAME: hextir.expr = "[\\22max\\22,[\\22arg\\22,0],[\\22const\\22,0.0]]"
        CHECK-SAME: hextir.kernel = #hextir.kernel<"cuda", "pointwise">, hextir.launch = {{block = array<i64: 256, 1, 1>, grid = ["1", "1", "1"], shared_bytes = 0 : i64}}
        CHECK:      arith.cmpi ult, %{{{{.+}}}}, %c119 : index
        CHECK:      #hextir.loop<"parallel", "threadIdx.x">
        CHECK-NEXT: #hextir.loop<"parallel", "blockIdx.x">
        CHECK-NEXT: return

        CHECK-LABEL: func.func @main(
        CHECK: "hexir.transfer"(%arg0) {{source = "cpu", target = "cuda"}}
        CHECK: %[[Y:.+]] = "hexir.call"({{{{.+}}}}) {{callee = @[[LINEAR]], device = "cuda"
        CHECK: %[[R:.+]] = "hexir.call"(%[[Y]]) {{callee = @[[RELU]], device = "cuda"
        CHECK: "hexir.transfer"(%[[Y]]) {{source = "cuda", target = "cpu"}}
        CHECK: "hexir.transfer"(%[[R]]) {{source = "cuda", target = "cpu"}}
    """)


def test_tir_fused_epilogues_read_the_bias_by_column_then_apply_the_relu():
    epilogue = """
        CHECK-NEXT:   %[[BIAS:[0-9]+]] = "hextir.load"(%arg2, %[[COL]]) : (memref<7xf32>, index) -> f32
        CHECK-NEXT:   %[[BIASED:[0-9]+]] = arith.addf %[[SUM]], %[[BIAS]] : f32
        CHECK-NEXT:   %[[RELU:[0-9]+]] = arith.maximumf %[[BIASED]], %[[ZERO]] : f32"""
    filecheck(lower(FUSED_BIAS_RELU, "mlir-tir", placement=ON_CUDA), f"""
        CHECK:      func.func public @[[LINEAR:linear_[0-9]+]](
        CHECK-SAME: %{{{{.+}}}}: memref<17x5xf32>, %{{{{.+}}}}: memref<5x7xf32>, %{{{{.+}}}}: memref<7xf32>, %{{{{.+}}}}: memref<17x7xf32>)
        CHECK-SAME: hextir.expr = "[\\22max\\22,[\\22add\\22,[\\22arg\\22,0],[\\22arg\\22,1]],[\\22const\\22,0.0]]"
        CHECK-SAME: hextir.kernel = #hextir.kernel<"cuda", "linear">
        {linear_kernel_checks("arg3", epilogue, "RELU")}
        CHECK-NOT:  hexir.relu
    """)


def test_tir_relu_of_any_rank_is_one_flat_guarded_axis():
    filecheck(lower(RELU_3D, "mlir-tir", placement=ON_CUDA), """
        CHECK-LABEL: func.func public @relu_
        CHECK-DAG: %[[IN:.+]] = memref.collapse_shape %arg0 {{\\[\\[}}0, 1, 2{{\\]\\]}} : memref<2x3x5xf64> into memref<30xf64>
        CHECK-DAG: %[[OUT:.+]] = memref.collapse_shape %arg1 {{\\[\\[}}0, 1, 2{{\\]\\]}} : memref<2x3x5xf64> into memref<30xf64>
        CHECK: %[[AT:.+]] = arith.addi
        CHECK: arith.cmpi ult, %[[AT]], %c30{{(_[0-9]+)?}} : index
        CHECK: "hextir.load"(%[[IN]], %[[AT]])
        CHECK: arith.maximumf
        CHECK: "hextir.store"(%{{.+}}, %[[OUT]], %[[AT]])
        CHECK: #hextir.loop<"parallel", "threadIdx.x">
        CHECK-NEXT: #hextir.loop<"parallel", "blockIdx.x">
    """)


def test_gpu_stage_outlines_the_cuda_kernels_into_one_gpu_module():
    text = lower(PROGRAM, "mlir-gpu", placement=ON_CUDA)
    threads = TILE // PER  # two small tiles cover out[17, 7]
    linear_launch = f'hextir.launch = {{block = array<i64: {threads}, {threads}, 1>, grid = ["1", "2", "1"], shared_bytes = 0 : i64}}'
    relu_launch = 'hextir.launch = {block = array<i64: 256, 1, 1>, grid = ["1", "1", "1"], shared_bytes = 0 : i64}'
    filecheck(text, f"""
        CHECK: module attributes {{gpu.container_module}}
        CHECK: func.func public @[[LINEAR:linear_[0-9]+]]_cpu(
        CHECK: gpu.module @hexir_cuda {{
        CHECK: gpu.func @[[LINEAR]](%{{{{[a-z0-9]+}}}}: memref<17x5xf32>, %{{{{[a-z0-9]+}}}}: memref<5x7xf32>,
        CHECK-SAME: %{{{{[a-z0-9]+}}}}: memref<17x7xf32>)
        CHECK-SAME: workgroup(%{{{{[a-z0-9]+}}}} : memref<2x{STEP}x{TILE + WIDTH}xf32, #gpu.address_space<workgroup>> {{llvm.align = 16 : i64}}, %{{{{[a-z0-9]+}}}} : memref<2x{STEP}x{TILE}xf32, #gpu.address_space<workgroup>> {{llvm.align = 16 : i64}})
        CHECK-SAME: kernel
        CHECK-SAME: {linear_launch}
        CHECK-SAME: known_block_size = array<i32: {threads}, {threads}, 1>
        CHECK-DAG: gpu.block_id y
        CHECK-DAG: gpu.block_id x
        CHECK-DAG: gpu.thread_id y
        CHECK-DAG: gpu.thread_id x
        CHECK: arith.cmpi ult
        CHECK: gpu.return
        CHECK: gpu.func @[[RELU:relu_[0-9]+]](%{{{{[a-z0-9]+}}}}: memref<17x7xf32>, %{{{{[a-z0-9]+}}}}: memref<17x7xf32>) kernel
        CHECK-SAME: {relu_launch}
        CHECK-SAME: known_block_size = array<i32: 256, 1, 1>
        CHECK: gpu.block_id x
        CHECK: gpu.thread_id x
        CHECK: gpu.return
        CHECK: func.func @main(
    """)
    gpu_module = text[text.index("gpu.module @hexir_cuda"):text.index("func.func @main(")]
    for leftover in ("hextir.schedule", "hextir.load", "hextir.store", "hextir.alloc_local", "hextir.barrier",
                     "hextir.grid", "hextir.block"):
        assert leftover not in gpu_module, f"the gpu.module still has {leftover!r}"
    assert not re.search(r"func\.func public @(linear|relu)_[0-9]+\(", text)


# ---- compiling modules --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """`build(chain, dtype, m, k, n, linear=..., relu=..., target=...)`: the path of a compiled
    module whose inputs are x (and the weights, as arguments), made once per module."""
    directory = tmp_path_factory.mktemp("cuda-codegen")
    _compiled: dict[tuple, Path] = {}

    def make(chain: str, dtype: str, m: int, k: int, n: int, linear: str = "cuda", relu: str = "cuda",
             target: str | None = None) -> Path:
        key = (chain, dtype, m, k, n, linear, relu, target)
        if key not in _compiled:
            specs, fn = case(chain, dtype, m, k, n)
            path = directory / f"module{len(_compiled)}.hxb"
            _compiled[key] = hexir.export(fn, path, *specs, placement={"hexir.linear": linear, "hexir.relu": relu},
                                          target=target or "cpu:host,cuda:sm_90")  # one cpu library: faster
        return _compiled[key]

    return make


def case(chain: str, dtype: str, m: int, k: int, n: int):
    """The specs and function of a chain; `relu3` is a rank-3 relu of [m, k, n], `relu1` of [m].
    `linear_relu` is fused into one kernel where both ops share a device; `linear_relu_apart`
    prints the linear's result too, which keeps its relu a kernel of its own."""
    spec = hexir.TensorSpec
    if chain == "relu1":
        return (spec((m,), dtype),), lambda x: hexir.relu(x)
    if chain == "relu3":
        return (spec((m, k, n), dtype),), lambda x: hexir.relu(x)
    if chain == "linear_bias":
        return (spec((m, k), dtype), spec((k, n), dtype), spec((n,), dtype)), lambda x, w, b: hexir.linear(x, w, b)
    if chain == "linear_relu":
        return (spec((m, k), dtype), spec((k, n), dtype)), lambda x, w: hexir.relu(hexir.linear(x, w))
    if chain == "linear_relu_apart":
        def apart(x, w):
            y = hexir.linear(x, w)
            hexir.print(y)
            return hexir.relu(y)
        return (spec((m, k), dtype), spec((k, n), dtype)), apart
    return (spec((m, k), dtype), spec((k, n), dtype)), lambda x, w: hexir.linear(x, w)


def numpy_of(chain: str, arrays: list[np.ndarray]) -> np.ndarray:
    wide = [array.astype(np.float64) for array in arrays]
    if chain.startswith("relu"):
        return np.maximum(wide[0], 0)
    result = wide[0] @ wide[1]
    if chain == "linear_bias":
        result = result + wide[2]
    return np.maximum(result, 0) if chain.startswith("linear_relu") else result


def read(path: Path) -> tuple[dict, hxb.Hxb]:
    module = hxb.read(path)
    return module.json, module


def ceil_div(a: int, b: int) -> int:
    return max(1, math.ceil(a / b))


# ---- the manifest ------------------------------------------------------------------------------

LINEAR_SHAPES = [(1, 1, 1), (1000, 7, 33), (3, 5, 7), (64, 3, 64), (65, 2, 129), (2, 257, 1031), (2048, 3, 2049),
                 (2048, 2, 2048), (2049, 2, 2047), (1024, 2, 1024)]
POINTWISE_BLOCK = 256
RELU_TREE = ["max", ["arg", 0], ["const", 0.0]]


def test_the_tilings_are_chosen_by_the_blocks_they_make():
    assert cuda_families.POINTWISE_BLOCK == POINTWISE_BLOCK
    assert gpu_schedule.linear_tiling(2048, 2049) == (128, 16, 8)  # 16 x 17 = 272 blocks of 128x128
    assert gpu_schedule.linear_tiling(1024, 2048) == (128, 16, 8)  # exactly 128
    assert gpu_schedule.linear_tiling(1024, 1920) == (64, 16, 4)  # 8 x 15 = 120: too few; 16 x 30 of 64x64
    assert gpu_schedule.linear_tiling(1024, 1024) == (64, 16, 4)  # 16 x 16 = 256 of 64x64
    assert gpu_schedule.linear_tiling(1000, 1000) == (64, 16, 4)  # 16 x 16 (the last ones partial)
    assert gpu_schedule.linear_tiling(960, 1000) == (32, 16, 2)  # 15 x 16 = 240 of 64x64: too few
    assert gpu_schedule.linear_tiling(512, 512) == (32, 16, 2)  # 16 x 16 of 32x32
    assert gpu_schedule.linear_tiling(64, 512) == (16, 16, 1)  # 2 x 16 = 32 of 32x32: too few; 4 x 32 of 16x16
    assert gpu_schedule.linear_tiling(1, 1000) == (16, 16, 1)


@pytest.mark.parametrize(("m", "k", "n"), LINEAR_SHAPES, ids=lambda d: str(d))
def test_linear_launch_is_the_shape_ceil_divided_by_the_tile(build, m, k, n):
    (kernel,) = read(build("linear", "float32", m, k, n))[0]["kernels"]
    assert kernel["launch"] == cuda_linear_launch(m, n, k=k)
    grid, block = kernel["launch"]["grid"], kernel["launch"]["block"]
    if m > gpu_schedule.ROWS_MAX:  # a tile per block: the blocks cover the output, none wholly outside it
        tile_n, tile_m = -(-n // grid[0]), -(-m // grid[1])
        assert grid[0] * tile_n >= n and grid[1] * tile_m >= m
    else:  # 32 columns per block, every row
        assert grid == [-(-n // 32), 1, 1]
    assert math.prod(block) <= 1024


@pytest.mark.parametrize("shape", [(1,), (256,), (257,), (2, 3, 67), (1000, 33)], ids=str)
def test_relu_launch_is_the_element_count_ceil_divided_by_the_block(build, shape):
    chain, dims = ("relu1", (shape[0], 1, 1)) if len(shape) == 1 else ("relu3", (*shape, 1)[:3])
    (kernel,) = read(build(chain, "float32", *dims))[0]["kernels"]
    block = POINTWISE_BLOCK
    total = math.prod(kernel["args"][0]["shape"])
    assert total == math.prod(shape)
    assert kernel["launch"] == {"grid": [ceil_div(total, block), 1, 1], "block": [block, 1, 1], "shared_bytes": 0}


def test_cuda_kernels_carry_images_and_a_cpu_fallback(build):
    m = 9
    manifest, _ = read(build("linear_relu_apart", "float32", m, 4, 5))  # two kernels: one image for both
    linear, relu = manifest["kernels"]
    assert [(k["op"], k["expr"], k["sizes"], k["device"]) for k in (linear, relu)] == [
        ("linear", ["arg", 0], [], "cuda"), ("pointwise", RELU_TREE, [], "cuda")]
    assert re.fullmatch(r"linear_[0-9]+", linear["name"]) and re.fullmatch(r"relu_[0-9]+", relu["name"])
    assert [k["symbol"] for k in (linear, relu)] == [linear["name"], relu["name"]]
    assert "work" not in linear and "parallel_extent" not in linear
    assert linear["images"] == relu["images"]  # one binary per architecture for the whole module
    assert set(linear["images"]) == {"sm_90", "compute_90"}
    blobs = manifest["blobs"]
    assert blobs[linear["images"]["sm_90"]]["name"] == "cuda:sm_90.cubin"
    assert blobs[linear["images"]["compute_90"]]["name"] == "cuda:compute_90.ptx"
    # the cpu twins keep the cpu schedules: linear over tiles of its output, relu over the rows (a
    # thread's chunk at least CHUNK_ELEMENTS elements)
    streamed = {"spans": True} if m <= 16 else {}  # up to 16 rows streamed: a thread's chunk is its span
    assert linear["cpu_fallback"] == {"symbol": linear["name"] + "_cpu",
                                      "work": {"extent": cpu_linear_tiles(m, 5, "float32"), "grain": 1, **streamed}}
    assert relu["cpu_fallback"] == {"symbol": relu["name"] + "_cpu",
                                    "work": {"extent": m, "grain": -(-cpu_families.CHUNK_ELEMENTS // 5)}}
    libraries = manifest["cpu"]["libraries"]
    assert [blobs[library["library"]]["name"] for library in libraries] == [
        f"cpu-{library['cpu']}.so" for library in libraries]
    assert [arg["access"] for arg in linear["args"]] == ["read", "read", "write"]
    assert [arg["shape"] for arg in linear["args"]] == [[m, 4], [4, 5], [m, 5]]


def test_the_cpu_library_exports_the_fallbacks(build, tmp_path):
    manifest, module = read(build("linear_relu_apart", "float32", 9, 4, 5, target="cpu:x86-64-v3,cpu:x86-64,cuda:sm_90"))
    names = [kernel["name"] for kernel in manifest["kernels"]]
    (entry,) = manifest["cpu"]["libraries"]  # fallbacks alone: the lowest level's library
    assert entry["cpu"] == "x86-64"
    symbols = _symbols(tmp_path, module, entry)
    assert {f"{name}_cpu" for name in names} <= set(symbols)
    assert not set(names) & set(symbols)  # the GPU kernels live only in the CUBIN/PTX


def _symbols(tmp_path: Path, module, entry: dict, *options: str) -> str:
    library = tmp_path / f"{entry['cpu']}.so"
    library.write_bytes(bytes(module.blob(entry["library"])))
    return subprocess.run([str(LLVM_BIN / "llvm-nm"), "--defined-only", "-D", *options, str(library)],
                          capture_output=True, text=True, check=True).stdout.split()


def test_each_level_links_the_one_baseline_build_of_the_fallbacks(build, tmp_path):
    """The cpu relu is built per level; the cuda linear's twin once, for the lowest level, and
    every library holds that code: the same bytes in each, none of them AVX."""
    path = build("linear_relu_apart", "float32", 9, 4, 5, relu="cpu", target="cpu:x86-64-v3,cpu:x86-64,cuda:sm_90")
    manifest, module = read(path)
    linear = next(k for k in manifest["kernels"] if k["device"] == "cuda")
    twin = linear["cpu_fallback"]["symbol"]
    code = {}
    for entry in manifest["cpu"]["libraries"]:
        sizes = _symbols(tmp_path, module, entry, "--print-size")
        assert twin in sizes, entry["cpu"]
        library = tmp_path / f"{entry['cpu']}.so"
        listing = subprocess.run([str(LLVM_BIN / "llvm-objdump"), "-d", f"--disassemble-symbols={twin}",
                                  "--no-show-raw-insn", "--no-leading-addr", str(library)],
                                 capture_output=True, text=True, check=True).stdout
        code[entry["cpu"]] = [re.sub("0x[0-9a-f]+", "ADDRESS", line.split("#")[0].strip())  # (where it was linked)
                              for line in listing.splitlines() if line.startswith(" ")]
    assert list(code) == ["x86-64-v3", "x86-64"]
    assert code["x86-64-v3"] == code["x86-64"] and code["x86-64"]
    assert not any("ymm" in line or line.startswith("v") for line in code["x86-64"])  # SSE2, no VEX
    x, w = (np.random.default_rng(seed).standard_normal(shape).astype(np.float32) for seed, shape in ((0, (9, 4)),
                                                                                                   (1, (4, 5))))
    got = hexir_runtime.load(path, "cpu").main(x, w)
    np.testing.assert_allclose(got, numpy_of("linear_relu", [x, w]), rtol=1e-5, atol=1e-5)


# ---- the CUBIN and the PTX ---------------------------------------------------------------------


def cubin_sm(image: bytes) -> int:
    """The SM of a CUBIN as LLVM's ELFObjectFileBase::getNVPTXCPUName reads it: the low byte of
    e_flags under the CUDA ELF ABI version 7, bits 8-15 under version 8."""
    flags = struct.unpack_from("<I", image, 48)[0]
    return flags & 0xFF if image[8] == 7 else (flags & 0xFF00) >> 8


def elf_symbols(image: bytes) -> dict[str, tuple[int, int]]:
    """name -> (type, binding) of every symbol of a 64-bit little-endian ELF."""
    shoff = struct.unpack_from("<Q", image, 40)[0]
    shentsize, shnum = struct.unpack_from("<HH", image, 58)
    sections = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)]
    symbols = {}
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        strings = sections[link][4]
        for start in range(offset, offset + size, entsize):
            name, info = struct.unpack_from("<IB", image, start)
            text = image[strings + name:image.index(b"\0", strings + name)].decode()
            symbols[text] = (info & 0xF, info >> 4)
    return symbols


def elf_sections(image: bytes) -> dict[str, int]:
    """name -> size of every section of a 64-bit little-endian ELF."""
    shoff = struct.unpack_from("<Q", image, 40)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", image, 58)
    sections = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)]
    names = sections[shstrndx][4]
    return {image[names + s[0]:image.index(b"\0", names + s[0])].decode(): s[5] for s in sections}


def images_of(path: Path) -> dict[str, bytes]:
    manifest, module = read(path)
    return {arch: bytes(module.blob(blob)) for arch, blob in manifest["kernels"][0]["images"].items()}


@pytest.fixture(scope="module")
def two_archs(build) -> Path:
    """Two kernels, a linear and a relu (kept apart), compiled for two architectures."""
    return build("linear_relu_apart", "float64", 33, 17, 65, target="cuda:sm_80,cuda:sm_90")


def test_the_cubin_is_an_elf_for_em_cuda_of_the_requested_sm(build, tmp_path):
    cubin = images_of(build("linear_relu", "float32", 9, 4, 5))["sm_90"]
    assert cubin[:4] == b"\x7fELF"
    assert cubin[4:6] == b"\x02\x01"  # 64-bit, little-endian
    assert struct.unpack_from("<HH", cubin, 16) == (2, EM_CUDA)  # ET_EXEC for NVIDIA CUDA
    assert cubin_sm(cubin) == 90
    path = tmp_path / "kernels.cubin"
    path.write_bytes(cubin)
    header = subprocess.run([str(LLVM_BIN / "llvm-readelf"), "-h", str(path)], capture_output=True, text=True,
                            check=True).stdout
    assert re.search(r"Machine:\s+NVIDIA CUDA architecture", header)
    assert re.search(r"Flags:\s+0x[0-9a-f]+, sm_90$", header, re.MULTILINE)


def test_the_cubins_of_two_archs_differ_in_their_sm(two_archs):
    images = images_of(two_archs)
    assert set(images) == {"sm_80", "sm_90", "compute_80"}
    assert (cubin_sm(images["sm_80"]), cubin_sm(images["sm_90"])) == (80, 90)
    flags = [struct.unpack_from("<I", images[arch], 48)[0] for arch in ("sm_80", "sm_90")]
    assert flags[0] != flags[1]
    assert re.search(rb"^\.target sm_80$", images["compute_80"], re.MULTILINE)
    blobs = [blob["name"] for blob in read(two_archs)[0]["blobs"]]
    assert {"cuda:sm_80.cubin", "cuda:sm_90.cubin", "cuda:compute_80.ptx"} <= set(blobs)
    assert not any("compute_90" in name for name in blobs)  # PTX for the lowest architecture only


def test_the_cubin_holds_every_kernel_as_a_global_function(two_archs):
    for arch in ("sm_80", "sm_90"):
        symbols = elf_symbols(images_of(two_archs)[arch])
        names = [kernel["name"] for kernel in read(two_archs)[0]["kernels"]]
        assert len(names) == 2
        for name in names:
            assert symbols.get(name) == (2, 1), f"{arch}: {name} is not a global function"  # STT_FUNC, STB_GLOBAL
            assert f"{name}_cpu" not in symbols


def test_static_shared_memory_fits_the_default_limit(two_archs):
    """The launch asks for no dynamic shared memory; what the kernels declare must fit the 48 KiB
    a launch gets without opting in (float64 tiles are the largest)."""
    (kernel, _) = read(two_archs)[0]["kernels"]
    sections = elf_sections(images_of(two_archs)["sm_90"])
    static = sections.get(f".nv.shared.{kernel['name']}", 0)
    # float64 on sm_80 and sm_90: the tensor-core kernel (32x32 tiles for this small output), two slices 16 deep
    assert kernel["args"][-1]["shape"] == [33, 65]
    assert kernel["launch"] == cuda_linear_launch(33, 65, "float64", ("sm_80", "sm_90"))
    assert static >= 2 * 2 * 32 * 16 * 8  # the x and w tiles, float64, two of each, through shared memory
    assert static + kernel["launch"]["shared_bytes"] <= 48 * 1024


def test_the_ptx_is_text_for_the_lowest_arch_with_every_entry(build):
    path = build("linear_relu_apart", "float32", 9, 4, 5)  # two entries, with different blocks
    ptx = images_of(path)["compute_90"]
    assert b"\0" not in ptx  # the runtime adds the NUL the driver needs
    text = ptx.decode("ascii")
    assert re.search(r"^\.version \d+\.\d+$", text, re.MULTILINE)
    assert re.search(r"^\.target sm_90$", text, re.MULTILINE)
    assert re.search(r"^\.address_size 64$", text, re.MULTILINE)
    for kernel in read(path)[0]["kernels"]:
        assert re.search(rf"^\.visible \.entry {kernel['name']}\($", text, re.MULTILINE)
    # each entry's thread limit is the block the manifest launches it with
    limits = [tuple(map(int, found)) for found in re.findall(r"^\.maxntid (\d+), (\d+), (\d+)$", text, re.MULTILINE)]
    assert limits == [tuple(kernel["launch"]["block"]) for kernel in read(path)[0]["kernels"]]


def test_the_simt_linear_reads_shared_memory_128_bits_at_a_time_from_aligned_buffers(build):
    """64x64 tiles (1024 x 1024 x 1024 f32), 4 sums per thread axis: each k step's rows and
    columns are one ld.shared.v4 each, from buffers declared 16-byte aligned; nothing on the stack."""
    ptx = images_of(build("linear", "float32", 1024, 1024, 1024))["compute_90"].decode()
    assert re.findall(r"^\s*\.shared \.align (\d+)", ptx, re.MULTILINE) == ["16", "16"]
    assert len(re.findall(r"ld\.shared\.v4\.b32", ptx)) == 2 * 16  # x and w, 16 k per slice
    assert not re.search(r"ld\.shared\.b32|\.local|ld\.local", ptx)
    assert len(re.findall(r"fma\.rn\.f32", ptx)) == 16 * 4 * 4


@pytest.mark.parametrize(("target", "shape"), [("cuda:sm_90", "m16n8k4"), ("cuda:sm_80,cuda:sm_90", "m8n8k4")])
def test_the_float64_linear_issues_the_widest_dmma_every_target_has(build, target, shape):
    """m16n8k4 (sm_90 only, twice m8n8k4's rate on an H200) unless an older target is asked for."""
    path = build("linear", "float64", 256, 64, 256, target=target)
    ptx = next(image for arch, image in images_of(path).items() if arch.startswith("compute_")).decode()
    shapes = set(re.findall(r"mma\.sync\.aligned\.(m\d+n\d+k\d+)\.row\.col\.f64\.f64\.f64\.f64", ptx))
    assert shapes == {shape}
    assert not re.search(r"\.local", ptx)  # the sums stay in registers


def test_sm_90a_is_an_architecture_of_its_own_beside_sm_90(build):
    """-target=cuda:sm_90a,cuda:sm_90: a CUBIN for each (the runtime loads sm_90a on 9.0 alone), the
    PTX of the plain one; sm_90a counts as 90 where the schedules compare architectures (m16n8k4)."""
    images = images_of(build("linear", "float64", 256, 64, 256, target="cpu:host,cuda:sm_90a,cuda:sm_90"))
    assert set(images) == {"sm_90", "sm_90a", "compute_90"}
    assert re.search(rb"^\.target sm_90$", images["compute_90"], re.MULTILINE)
    assert b"m16n8k4" in images["compute_90"]
    assert cubin_sm(images["sm_90a"]) == 90


@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "sm_120"])
def test_the_ptx_assembles_for_its_arch_and_newer_ones(build, tmp_path, arch):
    """What a newer GPU's driver does with the PTX (JIT), done here by ptxas."""
    ptx = tmp_path / "kernels.ptx"
    ptx.write_bytes(images_of(build("linear_relu", "float32", 9, 4, 5))["compute_90"])
    ptxas = Path(cuda_backend.cuda_toolkit()) / "bin" / "ptxas"
    result = subprocess.run([str(ptxas), f"-arch={arch}", str(ptx), "-o", str(tmp_path / "out.cubin")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert cubin_sm((tmp_path / "out.cubin").read_bytes()) == int(arch[3:])


# ---- targets -----------------------------------------------------------------------------------


def test_the_compiler_and_the_backend_agree_on_the_cuda_archs():
    assert tuple(cuda_backend.PTX_FEATURES) == CUDA_ARCHS


@pytest.mark.parametrize("arch", ["sm_1", "sm_35", "sm_70", "compute_90"])
def test_an_unsupported_arch_is_a_target_error_before_any_pass_runs(arch, tmp_path, capsys, monkeypatch):
    source = tmp_path / "program.mlir"
    source.write_text(PROGRAM)
    ran = []
    monkeypatch.setattr(hexir.cli, "run_stage", lambda *args: ran.append(args))
    code = hexir.cli.main([str(source), "-emit=hxb", "-placement=hexir.linear=cuda", f"-target=cuda:{arch}",
                           "-o", str(tmp_path / "out.hxb")])
    assert (code, ran) == (2, [])
    assert capsys.readouterr().err == (f"hexir: error: target 'cuda:{arch}': '{arch}' is not a supported CUDA "
                                       f"architecture; expected one of {', '.join(CUDA_ARCHS)}\n")
    assert not (tmp_path / "out.hxb").exists()


@pytest.mark.parametrize("arch", ["sm_1", "sm_35"])
def test_export_refuses_an_unsupported_arch_without_tracing(arch, tmp_path):
    traced = []

    def f(x):
        traced.append(x)
        return hexir.relu(x)

    with pytest.raises(TargetError, match=rf"^target 'cuda:{arch}': '{arch}' is not a supported CUDA architecture"):
        hexir.export(f, tmp_path / "out.hxb", hexir.TensorSpec((2,), "float32"), placement={"hexir.relu": "cuda"},
                     target=f"cuda:{arch}")
    assert traced == []
    with pytest.raises(TargetError, match=rf"^'{arch}' is not a supported CUDA architecture; expected one of sm_75"):
        cuda_backend.check_archs((arch,))


# ---- the host program: transfers between devices -----------------------------------------------


def timeline(manifest: dict) -> list[tuple[str, str, str]]:
    """The transfers (source and destination device) and calls (op and device), in program order."""
    kernels, entry = manifest["kernels"], manifest["entries"][0]
    devices = [buffer["device"] for buffer in entry["buffers"]]
    steps = []
    for command in entry["program"]:
        if command["op"] == "transfer":
            steps.append(("transfer", devices[command["src"]], devices[command["dst"]]))
        elif command["op"] == "call":
            kernel = kernels[command["kernel"]]
            relu = ["relu"] if kernel["expr"] == RELU_TREE else []  # a relu alone, or fused into the linear
            op = "_".join([kernel["op"], *relu]) if kernel["op"] != "pointwise" else "_".join(relu or ["pointwise"])
            steps.append(("call", op, kernel["device"]))
    return steps


TO_GPU, TO_CPU = ("transfer", "cpu", "cuda"), ("transfer", "cuda", "cpu")


@pytest.mark.parametrize(("linear", "relu", "expected"), [  # on one device, the relu is fused into the linear
    ("cuda", "cuda", [TO_GPU, TO_GPU, ("call", "linear_relu", "cuda"), TO_CPU]),
    ("cuda", "cpu", [TO_GPU, TO_GPU, ("call", "linear", "cuda"), TO_CPU, ("call", "relu", "cpu")]),
    ("cpu", "cuda", [("call", "linear", "cpu"), TO_GPU, ("call", "relu", "cuda"), TO_CPU]),
    ("cpu", "cpu", [("call", "linear_relu", "cpu")]),
])
def test_placements_put_transfers_where_the_device_changes(build, linear, relu, expected):
    path = build("linear_relu", "float32", 6, 5, 7, linear=linear, relu=relu)
    manifest, _ = read(path)
    assert timeline(manifest) == expected
    entry = manifest["entries"][0]
    devices = [buffer["device"] for buffer in entry["buffers"]]
    for command in entry["program"]:
        if command["op"] == "call":  # every argument already on the kernel's device
            kernel = manifest["kernels"][command["kernel"]]
            assert {devices[arg] for arg in command["args"]} == {kernel["device"]}
        if command["op"] == "return":
            assert {devices[src] for src in command["srcs"]} == {"cpu"}
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((6, 5)).astype(np.float32), rng.standard_normal((5, 7)).astype(np.float32)
    for device in ("cpu", "reference"):
        np.testing.assert_allclose(hexir_runtime.load(path, device=device).main(x, w), numpy_of("linear_relu", [x, w]),
                                   rtol=1e-5, atol=1e-5, err_msg=f"on {device}")


# ---- the cpu fallbacks and the reference device compute what numpy does ------------------------

TOLERANCE = {"float32": 1e-5, "float64": 1e-12}
awkward = st.sampled_from([1, 2, 3, 7, 13, 31, 33, 63, 65, 97, 127, 257])
dims = awkward | st.integers(1, 150)


@settings(max_examples=24, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(chain=st.sampled_from(["linear", "linear_bias", "relu1", "relu3", "linear_relu"]),
       dtype=st.sampled_from(["float32", "float64"]), m=dims, k=dims, n=dims, seed=st.integers(0, 2**16))
@example(chain="linear", dtype="float32", m=1, k=1, n=1, seed=0)
@example(chain="linear_bias", dtype="float64", m=1000, k=3, n=33, seed=1)
@example(chain="relu3", dtype="float32", m=2, k=3, n=67, seed=2)
@example(chain="linear_relu", dtype="float32", m=65, k=257, n=31, seed=3)
def test_cuda_modules_run_on_the_cpu_and_the_reference_as_numpy(build, chain, dtype, m, k, n, seed):
    if chain == "relu3":
        m, k, n = (min(d, 20) for d in (m, k, n))  # keep the rank-3 tensors small
    if chain == "relu1":
        k = n = 1  # unused: one module per length
    path = build(chain, dtype, m, k, n)
    manifest, _ = read(path)
    assert {kernel["device"] for kernel in manifest["kernels"]} == {"cuda"}  # so the cpu runs the fallbacks
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(spec["shape"]).astype(dtype) for spec in manifest["entries"][0]["inputs"]]
    expected = numpy_of(chain, arrays)
    for device in ("cpu", "reference"):
        actual = hexir_runtime.load(path, device=device).main(*arrays)
        assert actual.dtype == np.dtype(dtype) and actual.shape == expected.shape
        if chain.startswith("relu"):
            np.testing.assert_array_equal(actual, expected.astype(dtype))
        else:
            np.testing.assert_allclose(actual, expected, rtol=TOLERANCE[dtype],
                                       atol=TOLERANCE[dtype] * math.sqrt(k), err_msg=f"on {device}")


@pytest.mark.parametrize(("m", "k", "n", "culprit"), [(2, 0, 3, r"'x' is float32\[2, 0\]"),
                                                      (2, 4, 0, r"'w' is float32\[4, 0\]")])
def test_a_linear_with_an_empty_inner_axis_is_refused_at_trace_time(build, m, k, n, culprit):
    message = f"linear: argument {culprit}; only the first axis of a tensor may be empty"
    with pytest.raises(hexir.TraceError, match=message):
        build("linear", "float32", m, k, n)


def test_a_linear_with_no_rows_runs(build):
    path = build("linear", "float32", 0, 4, 3)
    x, w = np.ones((0, 4), np.float32), np.ones((4, 3), np.float32)
    assert hexir_runtime.load(path, device="cpu").main(x, w).shape == (0, 3)


def test_a_ptxas_failure_is_a_short_compile_error_naming_the_kernel(monkeypatch):
    """Code ptxas refuses (here the FP64 mma's inline PTX made invalid) fails the compile with
    ptxas's log, not with the whole lowered module the diagnostics' notes print."""
    from mlir.dialects import llvm

    def invalid_mma(m, a, b, c):
        result = gpu_schedule.ir.Type.parse("!llvm.struct<(" + ", ".join(["f64"] * len(c)) + ")>")
        return llvm.InlineAsmOp(result, [*a, b, *c], "mma.sync.aligned.m99n8k4.row.col.f64.f64.f64.f64 {$0};",
                                ",".join(["=d"] * len(c) + ["d"] * (len(a) + 1 + len(c)))).result
    monkeypatch.setattr(gpu_schedule, "_mma_f64", invalid_mma)
    f = hexir.jit(lambda x, w: hexir.linear(x, w), placement="hexir.linear=cuda", target="cpu:host,cuda:sm_90",
                  cache=False)
    with pytest.raises(hexir.CompileError, match=r"(?s)cuda code generation failed for sm_90.*ptxas") as error:
        f.compile(hexir.TensorSpec((256, 256), "float64"), hexir.TensorSpec((256, 256), "float64"))
    assert len(str(error.value)) < 10_000 and "llvm.func" not in str(error.value)  # the log, not the IR


def test_shared_buffers_past_48_kib_are_dynamic_shared_memory_the_launch_asks_for(build):
    """The float64 kernel's 128x64 tiles, three 16-deep slices (89 KiB), are views of the block's
    dynamic shared memory (declared external, 1024-byte aligned: after any static shared variable);
    the launch record (and so the manifest) carries their bytes."""
    path = build("linear", "float64", 2048, 64, 2048)
    (kernel,) = read(path)[0]["kernels"]
    assert kernel["launch"] == {**cuda_linear_launch(2048, 2048, "float64"), "shared_bytes": 3 * (128 * 20 + 16 * 76) * 8}
    ptx = images_of(path)["compute_90"].decode()
    assert re.search(r"\.extern \.shared \.align 1024 \.b8 __dynamic_shmem__0\[\];", ptx) and "__wg_" not in ptx
    small = images_of(build("linear", "float64", 256, 64, 256))["compute_90"].decode()
    assert "__dynamic_shmem__" not in small and "__wg_" in small  # 64x64 or smaller: static, as before


def test_dmma_blocks_inside_the_matrices_load_their_slices_without_a_test_per_element():
    """(128x64 tiles over an odd K, so through registers:) one test per block and slice (its
    last row and k inside x, its last k and column inside w) picks loads without the per-element
    guard; the blocks at the edges keep it."""
    filecheck(lower(linear_program(2048, 63, 2048, "f64"), "mlir-tir", placement=ON_CUDA), """
        CHECK:      %[[ROWS:.+]] = arith.cmpi ule, %{{.+}}, %c2048 : index
        CHECK-NEXT: %[[DEPTH:.+]] = arith.cmpi ule, %{{.+}}, %c63 : index
        CHECK-NEXT: %[[WHOLE:.+]] = arith.andi %[[ROWS]], %[[DEPTH]] : i1
        CHECK-NEXT: scf.if %[[WHOLE]] {
        CHECK-NOT:    scf.if
        CHECK:        "hextir.load"(%arg0, %{{.+}}, %{{.+}}) : (memref<2048x63xf64>, index, index) -> f64
        CHECK-NOT:    scf.if
        CHECK:      } else {
        CHECK:        scf.if %{{.+}} -> (f64) {
        CHECK-NEXT:     "hextir.load"(%arg0
    """)


def test_a_product_of_few_tiles_splits_k_and_its_last_block_adds_the_parts_in_order():
    """64x784x512 f32 (32 tiles of 32x32): K in 7 parts of 112 (grid z), the last cut at K; each
    block writes its 4 sums per thread to a module global [7 parts, 32 tiles, 4, 256 threads],
    fences, and thread 0 counts the block in the tile's arrivals; the block that arrives 7th adds
    parts 0..6 in order, stores, and zeroes the count."""
    filecheck(lower(linear_program(64, 784, 512), "mlir-tir", placement=ON_CUDA), """
        CHECK:      func.func public @linear_0(
        CHECK-SAME: grid = ["16", "2", "7"]
        CHECK:      scf.for %[[SPLIT:arg[0-9]+]] = %c0 to %c7 step %c1 {
        CHECK:        %[[FIRST:.+]] = arith.muli %[[SPLIT]], %c112 : index
        CHECK:        %[[END:.+]] = arith.addi %[[FIRST]], %c112 : index
        CHECK:        arith.minui %[[END]], %c784 : index
        CHECK:        %[[PARTIAL:.+]] = "hextir.alloc_local"() {space = "global"} : () -> memref<7x32x4x256xf32>
        CHECK-NEXT:   %[[ARRIVALS:.+]] = "hextir.alloc_local"() {space = "global"} : () -> memref<32xi32>
        CHECK-COUNT-4: "hextir.store"(%{{.+}}, %[[PARTIAL]], %[[SPLIT]],
        CHECK:        llvm.inline_asm has_side_effects "fence.acq_rel.gpu;"
        CHECK-NEXT:   "hextir.barrier"
        CHECK:        memref.atomic_rmw addi %{{.+}}, %[[ARRIVALS]]
        CHECK:        "hextir.barrier"
        CHECK:        arith.cmpi eq, %{{.+}}, %c6_i32 : i32
        CHECK:        llvm.inline_asm has_side_effects "fence.acq_rel.gpu;"
        CHECK:        "hextir.load"(%[[PARTIAL]], %c0,
        CHECK-COUNT-6: "hextir.load"(%[[PARTIAL]], %c
        CHECK:        "hextir.store"(%c0_i32, %[[ARRIVALS]],
        CHECK:      #hextir.loop<"parallel", "blockIdx.z">
    """)


def test_split_k_keeps_its_parts_and_counts_in_zeroed_device_globals(build):
    """The parts and counts are .global arrays of the kernel's module (zeroed at load: no
    initializer), the count an atomic add between fences; an unsplit product has none."""
    split = images_of(build("linear_relu", "float64", 64, 784, 512))["compute_90"].decode()
    assert re.search(r"^\.global \.align 16 \.b8 linear_0_global0\[1048576\];$", split, re.MULTILINE)  # 4x32x8x128 f64
    assert re.search(r"^\.global \.align 16 \.b8 linear_0_global1\[128\];$", split, re.MULTILINE)  # 32 i32
    assert "atom.global.add.u32" in split and split.count("fence.acq_rel.gpu;") == 2
    whole = images_of(build("linear", "float64", 1024, 1024, 1024))["compute_90"].decode()
    assert ".global .align" not in whole and "atom." not in whole


def test_dmma_slices_fill_three_buffers_by_asynchronous_copies(build):
    """32x32 tiles (256x64x256 f64): each slice's 8 elements per thread (x 4, w 4) are cp.async
    copies, 16 bytes (2 elements) each where K and N are even (8 bytes where one is odd), with a
    source size that zero-fills outside the matrices, a commit group per slice (two issued before
    the loop, one per step: LLVM unrolls the steps, so the counts are only bounded), and each step
    waits for all but the newest group. 128x64 tiles over an odd K stage their slices through registers instead."""
    def copies(ptx: str, size: int) -> int:
        return len(re.findall(rf"cp\.async\.ca\.shared\.global \[[^]]+\], \[[^]]+\], {size}, %r\d+;", ptx))
    for k, size, per_slice in ((64, 16, 4), (63, 8, 8)):
        ptx = images_of(build("linear", "float64", 256, k, 256))["compute_90"].decode()
        groups = len(re.findall(r"cp\.async\.commit_group;", ptx))
        assert groups >= 3 and copies(ptx, size) >= 3 * per_slice and copies(ptx, size) % per_slice == 0
        assert copies(ptx, 24 - size) == 0
        assert set(re.findall(r"cp\.async\.wait_group\s+(\d+);", ptx)) == {"1"}
    assert "cp.async" in images_of(build("linear", "float64", 2048, 64, 2048))["compute_90"].decode()
    assert "cp.async" not in images_of(build("linear", "float64", 2048, 63, 2048))["compute_90"].decode()


def test_dmma_128x128_tiles_load_two_ks_of_x_a_thread_in_one_shared_load(build):
    """4096^2 f64 outputs (1024 tiles of 128x128, K and N even) take 4 x 2 warps, whose x fragments
    come two k's at a time in one 16-byte shared load (ld.shared.v2.b64; w's stay 8-byte), from rows
    padded to 24 and 130 elements; the 128x64 tiles of a smaller product keep one k a load."""
    path = build("linear", "float64", 4096, 64, 4096)
    (kernel,) = read(path)[0]["kernels"]
    assert kernel["launch"] == {**cuda_linear_launch(4096, 4096, "float64", k=64),
                                "shared_bytes": 3 * (128 * 24 + 16 * 130) * 8}
    assert kernel["launch"]["grid"] == [32, 32, 1] and kernel["launch"]["block"] == [256, 1, 1]
    ptx = images_of(path)["compute_90"].decode()
    # a 16-deep slice's (the step's body, once): x 2 pairs of k's x 2 fragments x 2 halves, w 4 k's x 8 columns
    assert len(re.findall(r"ld\.shared\.v2\.b64", ptx)) == 8 and len(re.findall(r"ld\.shared\.b64", ptx)) == 32
    smaller = images_of(build("linear", "float64", 2048, 64, 2048))["compute_90"].decode()
    assert "ld.shared.v2.b64" not in smaller


@pytest.mark.parametrize(("target", "block", "shared"), [
    ("cuda:sm_90", 256, 3 * (128 * 24 + 16 * 130) * 8), ("cuda:sm_80", 256, 3 * (128 * 24 + 16 * 130) * 8),
    ("cuda:sm_86", 128, 3 * (128 * 20 + 16 * 76) * 8), ("cuda:sm_89,cuda:sm_90", 128, 3 * (128 * 20 + 16 * 76) * 8)])
def test_dmma_tiles_fit_the_shared_memory_of_every_target(build, target, block, shared):
    """128x128 f64 tiles take 121 KiB of shared memory, more than a block of sm_86, sm_89 or sm_120
    may have (99 KiB): a module for any of them keeps 128x64 tiles (87 KiB)."""
    (kernel,) = read(build("linear", "float64", 4096, 64, 4096, target=f"cpu:host,{target}"))[0]["kernels"]
    assert (kernel["launch"]["block"][0], kernel["launch"]["shared_bytes"]) == (block, shared)
    assert shared <= min(MAX_SHARED_BYTES[arch.split(":")[1]] for arch in target.split(","))
    assert set(MAX_SHARED_BYTES) == set(CUDA_ARCHS)  # every architecture a target may name has its room
