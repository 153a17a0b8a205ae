"""The IR each family of ops makes (hexir/passes/fuse.py, hexir/schedules/cpu_families.py and
cuda_families.py), checked as lit tests check it: IR text in, a stage run, printed IR through
FileCheck.

- pointwise: a chain of element-wise ops is one `hexir.call` of one kernel whose `hextir.expr`
  is the composed tree; the cpu kernel loops over the output (the outer axis `parallel`), the
  cuda one is a flat axis of blocks x threads guarded by the element count; an input of extent 1
  along an axis (or without it) is read at index 0 there (numpy's broadcasting).
- reduce: one pass along the row per reduction, then the output per element (softmax); on cuda
  a block per row whose threads combine their partials through shared memory in a tree with
  barriers; argmax writes int64; a pointwise prologue is part of every pass.
- contract: a pointwise op of the linear's result alone becomes its epilogue (gelu: math.erf in
  the linear kernel); so does a residual add, reading the residual as its extra input.
- what must not fuse: a value used twice, a value on another device.
- `.mlir` input for family ops: the verifier holds each op's `expr` to the scalar language and
  the result type to the family's shape rule.
"""

# IR lines are checked as printed: wrapping them would change what they check.
# ruff: noqa: E501

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hexir_runtime import load

from hexir import ops
from hexir.driver import Options, run_stage
from hexir.errors import TraceError
from hexir.passes.fuse import fuse
from hexir.target import parse_target

from .conftest import family_attrs, filecheck, lower, manifest, parse

X, ROW, COL, OUT = "tensor<4x6xf32>", "tensor<6xf32>", "tensor<4x1xf32>", "tensor<4x6xf32>"
CPU = {"target": parse_target("cpu:x86-64-v4")}  # one level: one copy of each cpu kernel
CUDA = {"placement": (("*", "cuda"),), "target": parse_target("cpu:x86-64-v4,cuda:sm_90")}


def attrs(tree: object, operands: int = 1, device: str = "auto") -> str:
    """The attribute dictionary of a family op of `operands` tensors computing `tree`."""
    groups = ", ".join(["1"] * operands + ["0"] * (8 - operands))
    return f'{{device = "{device}", expr = {printed(tree)}, operandSegmentSizes = array<i32: {groups}>}}'


def printed(tree: object) -> str:
    """A tree as the IR prints it in an attribute."""
    return '"' + json.dumps(tree, separators=(",", ":")).replace('"', "\\22") + '"'


def pattern(tree: object) -> str:
    """`printed(tree)` as a FileCheck pattern (`[[` would start a FileCheck variable)."""
    return printed(tree).replace("[[", "{{\\[\\[}}")


def fused(text: str, **options) -> str:
    """The printed graph after partition and fuse: what lower-to-tir starts from."""
    module = run_stage(parse(text), "mlir-hetero", Options(**options))
    with module.context:
        fuse(module)
        assert module.operation.verify()
    return str(module)


A0, A1 = ["arg", 0], ["arg", 1]
SCALED = ["mul", A0, ["const", 2.0]]
SHIFTED = ["add", A0, A1]
CHAIN = ["sub", ["exp", ["add", SCALED, A1]], A0]  # exp(x * 2 + y) - x

# exp(x * 2 + y) - x, y a row [6]: four ops, one kernel of two inputs
POINTWISE_CHAIN = f"""
func.func @main(%x: {X}, %y: {ROW}) -> {OUT} {{
  %0 = "hexir.mul"(%x) {attrs(SCALED)} : ({X}) -> {X}
  %1 = "hexir.add"(%0, %y) {attrs(SHIFTED, 2)} : ({X}, {ROW}) -> {X}
  %2 = "hexir.exp"(%1) {attrs(["exp", A0])} : ({X}) -> {X}
  %3 = "hexir.sub"(%2, %x) {attrs(["sub", A0, A1], 2)} : ({X}, {X}) -> {X}
  return %3 : {OUT}
}}
"""


def test_a_pointwise_chain_fuses_into_one_op_with_the_composed_tree():
    filecheck(fused(POINTWISE_CHAIN), f"""
        CHECK-LABEL: func.func @main(%arg0: {X}, %arg1: {ROW})
        CHECK-NEXT:  %[[R:.+]] = "hexir.sub"(%arg0, %arg1) {{device = "cpu", expr = {pattern(CHAIN)}, operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0, 0>}} : ({X}, {ROW}) -> {OUT}
        CHECK-NEXT:  return %[[R]]
    """)


def test_the_cpu_pointwise_kernel_loops_over_the_output_reading_a_row_by_its_column():
    text = lower(POINTWISE_CHAIN, "mlir-tir", **CPU)
    filecheck(text, f"""
        CHECK:       func.func public @[[K:sub_[0-9]+]](%arg0: memref<4x6xf32>, %arg1: memref<6xf32>, %arg2: memref<4x6xf32>)
        CHECK-SAME:      hextir.expr = {pattern(CHAIN)}
        CHECK-SAME: hextir.kernel = #hextir.kernel<"cpu", "pointwise">, hextir.level = "x86-64-v4", hextir.sizes = [], hextir.work = {{extent = "4", grain = {-(-16384 // 6)} : i64}}}}
        CHECK:         scf.for %[[I:arg[0-9]+]] = %c0 to %c4 step %c1 {{
        CHECK:           scf.for %[[J:arg[0-9]+]] = %c0 to %c6 step %c1 {{
        CHECK-NEXT:        %[[X:[0-9]+]] = "hextir.load"(%arg0, %[[I]], %[[J]]) : (memref<4x6xf32>, index, index) -> f32
        CHECK-NEXT:        %[[Y:[0-9]+]] = "hextir.load"(%arg1, %[[J]]) : (memref<6xf32>, index) -> f32
        CHECK:             %[[M:[0-9]+]] = arith.mulf %[[X]], %{{{{.+}}}} : f32
        CHECK-NEXT:        %[[A:[0-9]+]] = arith.addf %[[M]], %[[Y]] : f32
        CHECK-NEXT:        %[[E:[0-9]+]] = math.exp %[[A]] : f32
        CHECK-NEXT:        %[[S:[0-9]+]] = arith.subf %[[E]], %[[X]] : f32
        CHECK-NEXT:        "hextir.store"(%[[S]], %arg2, %[[I]], %[[J]])
        CHECK-NEXT:      }} {{hextir.schedule = #hextir.loop<"serial", "">}}
        CHECK-NEXT:    }} {{hextir.schedule = #hextir.loop<"parallel", "">}}
        CHECK-LABEL: func.func @main
        CHECK-NEXT:    %[[R:.+]] = "hexir.call"(%arg0, %arg1) {{callee = @[[K]], device = "cpu"
        CHECK-NEXT:    return %[[R]]
    """)
    assert text.count('"hexir.call"') == 1


def test_the_cuda_pointwise_kernel_is_one_flat_guarded_axis_of_blocks_and_threads():
    text = lower(POINTWISE_CHAIN, "mlir-tir", **CUDA)
    filecheck(text, f"""
        CHECK:       func.func public @[[K:sub_[0-9]+]](%arg0: memref<4x6xf32>, %arg1: memref<6xf32>, %arg2: memref<4x6xf32>)
        CHECK-SAME:      hextir.expr = {pattern(CHAIN)}
        CHECK-SAME: hextir.kernel = #hextir.kernel<"cuda", "pointwise">, hextir.launch = {{block = array<i64: 256, 1, 1>, grid = ["1", "1", "1"], shared_bytes = 0 : i64}}
        CHECK-DAG:     %[[OUT:.+]] = memref.collapse_shape %arg2 {{{{\\[\\[}}}}0, 1{{{{\\]\\]}}}} : memref<4x6xf32> into memref<24xf32>
        CHECK-DAG:     %[[IN:.+]] = memref.collapse_shape %arg0 {{{{\\[\\[}}}}0, 1{{{{\\]\\]}}}} : memref<4x6xf32> into memref<24xf32>
        CHECK:         scf.for %[[B:arg[0-9]+]] =
        CHECK:           scf.for %[[T:arg[0-9]+]] = %c0 to %c256 step %c1 {{
        CHECK-NEXT:        %[[BASE:[0-9]+]] = arith.muli %[[B]], %c256 : index
        CHECK-NEXT:        %[[AT:[0-9]+]] = arith.addi %[[BASE]], %[[T]] : index
        CHECK-NEXT:        %[[INSIDE:[0-9]+]] = arith.cmpi ult, %[[AT]], %c24 : index
        CHECK-NEXT:        scf.if %[[INSIDE]] {{
        CHECK:               %[[COLUMN:[0-9]+]] = arith.remui %[[AT]], %c6 : index
        CHECK:               %[[X:[0-9]+]] = "hextir.load"(%[[IN]], %[[AT]]) : (memref<24xf32>, index) -> f32
        CHECK-NEXT:          "hextir.load"(%arg1, %[[COLUMN]]) : (memref<6xf32>, index) -> f32
        CHECK:               math.exp
        CHECK:               "hextir.store"(%{{{{.+}}}}, %[[OUT]], %[[AT]])
        CHECK:           }} {{hextir.schedule = #hextir.loop<"parallel", "threadIdx.x">}}
        CHECK-NEXT:    }} {{hextir.schedule = #hextir.loop<"parallel", "blockIdx.x">}}
        CHECK:       func.func public @[[K]]_cpu(
        CHECK-SAME:      hextir.fallback_of = @[[K]]
        CHECK-SAME: hextir.kernel = #hextir.kernel<"cpu", "pointwise">
        CHECK-LABEL: func.func @main
        CHECK:         "hexir.call"(%{{{{.+}}}}, %{{{{.+}}}}) {{callee = @[[K]], device = "cuda"
        CHECK-NOT:     "hexir.call"
    """)
    gpu = lower(POINTWISE_CHAIN, "mlir-gpu", **CUDA)
    filecheck(gpu, """
        CHECK:      gpu.func @sub_{{[0-9]+}}(
        CHECK-SAME: known_block_size = array<i32: 256, 1, 1>
        CHECK:      %[[B:.+]] = gpu.block_id x
        CHECK:      %[[T:.+]] = gpu.thread_id x
        CHECK:      %[[BASE:.+]] = arith.muli %[[B]], %c256
        CHECK-NEXT: %[[AT:.+]] = arith.addi %[[BASE]], %[[T]]
        CHECK-NEXT: arith.cmpi ult, %[[AT]], %c24
    """)


def test_a_broadcast_axis_is_read_at_index_0():
    """x[4, 6] + c[4, 1] + r[1, 6]: the column is read at (i, 0), the row at (0, j)."""
    row = "tensor<1x6xf32>"
    tree = ["add", ["add", A0, A1], ["arg", 2]]
    text = f"""
    func.func @main(%x: {X}, %c: {COL}, %r: {row}) -> {OUT} {{
      %0 = "hexir.add"(%x, %c, %r) {attrs(tree, 3)} : ({X}, {COL}, {row}) -> {OUT}
      return %0 : {OUT}
    }}"""
    filecheck(lower(text, "mlir-tir", **CPU), """
        CHECK:      scf.for %[[I:arg[0-9]+]] =
        CHECK:      scf.for %[[J:arg[0-9]+]] =
        CHECK-NEXT:   "hextir.load"(%arg0, %[[I]], %[[J]]) : (memref<4x6xf32>, index, index) -> f32
        CHECK-NEXT:   "hextir.load"(%arg1, %[[I]], %c0) : (memref<4x1xf32>, index, index) -> f32
        CHECK-NEXT:   "hextir.load"(%arg2, %c0, %[[J]]) : (memref<1x6xf32>, index, index) -> f32
    """)
    filecheck(lower(text, "mlir-tir", **CUDA), """
        CHECK:      #hextir.kernel<"cuda", "pointwise">
        CHECK:      scf.if
        CHECK:      %[[J:[0-9]+]] = arith.remui %{{.+}}, %c6 : index
        CHECK-NEXT: %[[I:[0-9]+]] = arith.divui %{{.+}}, %c6 : index
        CHECK:      "hextir.load"(%{{.+}}) : (memref<24xf32>, index) -> f32
        CHECK-NEXT: "hextir.load"(%arg1, %[[I]], %c0{{(_[0-9]+)?}}) : (memref<4x1xf32>, index, index) -> f32
        CHECK-NEXT: "hextir.load"(%arg2, %c0{{(_[0-9]+)?}}, %[[J]]) : (memref<1x6xf32>, index, index) -> f32
    """)


# ---- reduce -------------------------------------------------------------------------------------

SOFTMAX = f"""
func.func @main(%x: {X}) -> {OUT} {{
  %0 = "hexir.softmax"(%x) {{device = "auto", {family_attrs("softmax")}}} : ({X}) -> {OUT}
  return %0 : {OUT}
}}
"""


def test_the_cpu_softmax_walks_each_row_twice_then_writes_each_element():
    """Each reduction takes 16 elements at a time (a vector, its lanes combined at the end),
    then the rest of the row (here all 6) one by one."""
    filecheck(lower(SOFTMAX, "mlir-tir", **CPU), """
        CHECK:      func.func public @[[K:softmax_[0-9]+]](%arg0: memref<4x6xf32>, %arg1: memref<4x6xf32>)
        CHECK-SAME: hextir.kernel = #hextir.kernel<"cpu", "reduce">
        CHECK:      scf.for %[[ROW:arg[0-9]+]] = %c0 to %c4 step %c1 {
        CHECK:        %[[END:[0-9]+]] = arith.subi %c6, %{{.+}} : index
        CHECK:        %[[LANES:[0-9]+]] = scf.for %{{.+}} = %c0 to %[[END]] step %c16 iter_args(%{{.+}}) -> (vector<16xf32>) {
        CHECK-NEXT:     vector.load %arg0[%[[ROW]], %{{.+}}] : memref<4x6xf32>, vector<16xf32>
        CHECK-NEXT:     arith.maximumf %{{.+}} : vector<16xf32>
        CHECK:        } {hextir.schedule = #hextir.loop<"serial", "">}
        CHECK-NEXT:   %[[TOPS:[0-9]+]] = vector.reduction <maximumf>, %[[LANES]] : vector<16xf32> into f32
        CHECK-NEXT:   %[[TOP:[0-9]+]] = scf.for %{{.+}} = %[[END]] to %c6 step %c1 iter_args(%{{.+}} = %[[TOPS]]) -> (f32) {
        CHECK:          arith.maximumf
        CHECK:        } {hextir.schedule = #hextir.loop<"serial", "">}
        CHECK:        scf.for %{{.+}} = %c0 to %[[END]] step %c16 iter_args(%{{.+}}) -> (vector<16xf64>) {
        CHECK:          math.exp %{{.+}} : vector<16xf32>
        CHECK:          arith.addf %{{.+}} : vector<16xf64>
        CHECK:        vector.reduction <add>
        CHECK-NEXT:   %[[SUM:[0-9]+]] = scf.for %{{.+}} = %[[END]] to %c6 step %c1 iter_args(%{{.+}}) -> (f64) {
        CHECK:          %[[SHIFTED:[0-9]+]] = arith.subf %{{.+}}, %[[TOP]] : f32
        CHECK-NEXT:     %[[E:[0-9]+]] = math.exp %[[SHIFTED]] : f32
        CHECK-NEXT:     %[[WIDE:[0-9]+]] = arith.extf %[[E]] : f32 to f64
        CHECK-NEXT:     arith.addf %{{.+}}, %[[WIDE]] : f64
        CHECK:        } {hextir.schedule = #hextir.loop<"serial", "">}
        CHECK-NEXT:   %[[TOTAL:[0-9]+]] = arith.truncf %[[SUM]] : f64 to f32
        CHECK-NEXT:   scf.for %[[J:arg[0-9]+]] = %c0 to %c6 step %c1 {
        CHECK:          math.exp
        CHECK-NEXT:     %[[P:[0-9]+]] = arith.divf %{{.+}}, %[[TOTAL]] : f32
        CHECK-NEXT:     "hextir.store"(%[[P]], %arg1, %[[ROW]], %[[J]])
        CHECK:        } {hextir.schedule = #hextir.loop<"serial", "">}
        CHECK-NEXT: } {hextir.schedule = #hextir.loop<"parallel", "">}
        CHECK-LABEL: func.func @main
        CHECK-NEXT: "hexir.call"(%arg0) {callee = @[[K]], device = "cpu"
    """)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cpu_sums_and_maxes_in_vectors_are_numpys_with_a_tail_and_nans(dtype):
    """Rows of 16 (one vector) and of 37 (two, then 5 elements one by one): softmax, layer_norm (its
    weight and bias read as vectors), sum and max as numpy's; a NaN in a row's vectors or in its
    tail is its max, and its softmax's and layer_norm's (numpy's); a softmax of a fused prologue
    reading a row (a vector) and a column (one element a row, broadcast)."""
    import hexir
    function = hexir.jit(lambda x, w, b, c: (hexir.softmax(x), hexir.layer_norm(x, w, b), x.sum(axis=-1),
                                             x.max(axis=-1), hexir.softmax(x * 0.5 + c + w)))
    rng = np.random.default_rng(5)
    for n in (16, 37):
        x = (rng.standard_normal((4, n)) * 3).astype(dtype)
        w, b = (rng.standard_normal(n).astype(dtype) for _ in range(2))
        c = rng.standard_normal((4, 1)).astype(dtype)
        x[2, 5], x[3, n - 2] = np.nan, np.nan
        e = np.exp(x - x.max(-1, keepdims=True))
        centred = x - x.mean(-1, keepdims=True)
        y = x * 0.5 + c + w
        f = np.exp(y - y.max(-1, keepdims=True))
        wants = (e / e.sum(-1, keepdims=True), centred / np.sqrt((centred ** 2).mean(-1, keepdims=True) + 1e-5) * w + b,
                 x.sum(-1), x.max(-1), f / f.sum(-1, keepdims=True))
        tolerance = {"rtol": 2e-5, "atol": 1e-5} if dtype == "float32" else {"rtol": 1e-12, "atol": 1e-12}
        for got, want in zip(function(x, w, b, c), wants, strict=True):
            np.testing.assert_allclose(got, want, **tolerance, err_msg=f"n={n}")


def test_the_cuda_softmax_combines_each_reduction_by_warp_shuffles():
    """A row of 6: one warp, each reduction a butterfly of 5 xor shuffles, no shared memory."""
    text = lower(SOFTMAX, "mlir-tir", **CUDA)
    kernel = text[:text.index("_cpu(")]
    filecheck(kernel, """
        CHECK:      hextir.kernel = #hextir.kernel<"cuda", "reduce">, hextir.launch = {block = array<i64: 32, 1, 1>, grid = ["4", "1", "1"], shared_bytes = 0 : i64}
        CHECK:      scf.for %[[ROW:arg[0-9]+]] = %c0 to %c4 step %c1 {
        CHECK:        scf.for %[[T:arg[0-9]+]] = %c0 to %c32 step %c1 {
        CHECK:          %[[MINE:[0-9]+]] = scf.for %{{.+}} = %[[T]] to %c6 step %c32 iter_args(%{{.+}}) -> (f32) {
        CHECK:            arith.maximumf
        CHECK:          %[[S:.+]], %{{.+}} = gpu.shuffle  xor %[[MINE]], %c16_i32, %c32_i32 : f32
        CHECK-NEXT:     arith.maximumf %[[MINE]], %[[S]] : f32
        CHECK-COUNT-3:  gpu.shuffle  xor
        CHECK:          %{{.+}}, %{{.+}} = gpu.shuffle  xor %{{.+}}, %c1_i32, %c32_i32 : f32
        CHECK-NEXT:     %[[TOP:[0-9]+]] = arith.maximumf
        CHECK:          scf.for %{{.+}} = %[[T]] to %c6 step %c32 iter_args(%{{.+}}) -> (f64) {
        CHECK:            arith.subf %{{.+}}, %[[TOP]] : f32
        CHECK-COUNT-5:  gpu.shuffle  xor %{{.+}} : f64
        CHECK:          scf.for %[[J:arg[0-9]+]] = %[[T]] to %c6 step %c32 {
        CHECK:            arith.divf
        CHECK-NEXT:       "hextir.store"(%{{.+}}, %arg1, %[[ROW]], %[[J]])
        CHECK:        } {hextir.schedule = #hextir.loop<"parallel", "threadIdx.x">}
        CHECK-NEXT: } {hextir.schedule = #hextir.loop<"parallel", "blockIdx.x">}
    """)
    assert '"hextir.barrier"' not in kernel and "alloc_local" not in kernel


def test_a_block_of_warps_meets_once_in_shared_memory():
    """A row of 1000: 256 threads; per reduction 5 shuffles in each warp, lane 0 of each stores
    its warp's result, one barrier, then every warp combines the 8 results by 3 shuffles."""
    text = lower(SOFTMAX.replace("4x6", "4x1000"), "mlir-tir", **CUDA)
    kernel = text[:text.index("_cpu(")]
    filecheck(kernel, """
        CHECK:      block = array<i64: 256, 1, 1>
        CHECK:      scf.for %[[T:arg[0-9]+]] = %c0 to %c256 step %c1 {
        CHECK-COUNT-5:  gpu.shuffle  xor %{{.+}} : f32
        CHECK:          %[[WARPS:[0-9]+]] = "hextir.alloc_local"() {space = "shared"} : () -> memref<8xf32, #gpu.address_space<workgroup>>
        CHECK:          %[[LANE:[0-9]+]] = arith.remui %[[T]], %c32 : index
        CHECK-NEXT:     arith.cmpi ult, %[[LANE]], %c1 : index
        CHECK:            "hextir.store"(%{{.+}}, %[[WARPS]], %{{.+}})
        CHECK:          "hextir.barrier"()
        CHECK:          %[[AT:[0-9]+]] = arith.remui %[[LANE]], %c8 : index
        CHECK-NEXT:     "hextir.load"(%[[WARPS]], %[[AT]])
        CHECK-NEXT:     gpu.shuffle  xor %{{.+}}, %c4_i32, %c32_i32 : f32
        CHECK-COUNT-2:  gpu.shuffle  xor %{{.+}} : f32
        CHECK-NOT:      gpu.shuffle  xor %{{.+}} : f32
    """)
    assert kernel.count('"hextir.barrier"') == 2  # one per reduction
    filecheck(lower(SOFTMAX.replace("4x6", "4x1000"), "mlir-gpu", **CUDA), """
        CHECK:      gpu.func @softmax_{{[0-9]+}}(%{{.+}}: memref<4x1000xf32>, %{{.+}}: memref<4x1000xf32>) workgroup(%{{.+}} : memref<8xf32, #gpu.address_space<workgroup>> {{.*}}, %{{.+}} : memref<8xf64, #gpu.address_space<workgroup>> {{.*}}) kernel
        CHECK:      gpu.shuffle  xor
        CHECK:      gpu.barrier
    """)


def test_a_long_row_s_layer_norm_reads_its_weight_and_bias_only_for_the_output():
    """A row of 16384 f32 in registers: 512 threads of 8 vectors (128 bytes each, REGISTER_MOST);
    x's vectors are loaded first, the weight's and bias's only after both reductions' barriers,
    where the output uses them (loaded with x they held as many registers again: 212 in all).
    A row of 4096 (256 threads) reads them with x, as before."""
    x, row = "tensor<2x16384xf32>", "tensor<16384xf32>"
    text = f"""
    func.func @main(%x: {x}, %w: {row}, %b: {row}) -> {x} {{
      %0 = "hexir.layer_norm"(%x, %w, %b) {{device = "auto", {family_attrs("layer_norm", operands=3)}}} : ({x}, {row}, {row}) -> {x}
      return %0 : {x}
    }}"""
    kernel = lower(text, "mlir-tir", **CUDA)
    kernel = kernel[:kernel.index("_cpu(")]
    filecheck(kernel, """
        CHECK:          block = array<i64: 512, 1, 1>
        CHECK-COUNT-8:  vector.load %arg0
        CHECK-NOT:      vector.load
        CHECK:          "hextir.barrier"()
        CHECK-NOT:      vector.load
        CHECK:          "hextir.barrier"()
        CHECK-NOT:      vector.load %arg0
        CHECK:          vector.load %arg1
        CHECK-NEXT:     vector.extract
        CHECK:          vector.load %arg2
        CHECK:          vector.store %{{.+}}, %arg3
    """)
    assert kernel.count("vector.load %arg1") == kernel.count("vector.load %arg2") == 8
    short = lower(text.replace("16384", "4096"), "mlir-tir", **CUDA)  # 256 threads: registers enough,
    assert short.index("vector.load %arg2") < short.index('"hextir.barrier"')  # all read with x


def test_a_row_of_16384_f64_is_split_over_a_cluster_of_four_blocks():
    """A 128 KiB row in one block takes 1024 threads, one block an SM: its loads, reductions and
    stores in turn. Four blocks of a cluster hold a quarter row each (256 threads of 8 vectors,
    registers capped at 64: four blocks an SM); each warp's lane b stores the warp's result into
    block b's shared memory, one cluster barrier per reduction and no block barrier."""
    text = SOFTMAX.replace("4x6", "3x16384").replace("xf32", "xf64")
    kernel = lower(text, "mlir-tir", **CUDA)
    kernel = kernel[:kernel.index("_cpu(")]
    filecheck(kernel, """
        CHECK:          hextir.launch = {block = array<i64: 256, 1, 1>, grid = ["12", "1", "1"]{{.+}}nvvm.cluster_dim = array<i32: 4, 1, 1>, nvvm.minctasm = 4 : i32
        CHECK:          scf.for %[[B:arg[0-9]+]] = %c0 to %c12 step %c1 {
        CHECK:            %[[PART:[0-9]+]] = arith.remui %[[B]], %c4 : index
        CHECK:            nvvm.cluster.arrive.relaxed {aligned}
        CHECK:            arith.muli %[[PART]], %c4096 : index
        CHECK-COUNT-8:    vector.load %arg0
        CHECK:            nvvm.cluster.wait {aligned}
        CHECK:            "hextir.alloc_local"() {space = "shared"} : () -> memref<32xf64, #gpu.address_space<workgroup>>
        CHECK:              nvvm.mapa %{{.+}}, %{{.+}} : !llvm.ptr<3> -> !llvm.ptr<7>
        CHECK-NEXT:         llvm.store %{{.+}}, %{{.+}} : f64, !llvm.ptr<7>
        CHECK:            nvvm.cluster.arrive {aligned}
        CHECK-NEXT:       nvvm.cluster.wait {aligned}
        CHECK:            nvvm.cluster.arrive {aligned}
    """)
    assert '"hextir.barrier"' not in kernel and kernel.count("nvvm.mapa") == 2
    ptx = lower(text, "ptx", **CUDA)
    assert ".maxntid 256, 1, 1" in ptx and ".minnctapersm 4" in ptx and ".reqnctapercluster 4, 1, 1" in ptx
    older = lower(text, "mlir-tir", placement=CUDA["placement"], target=parse_target("cpu:x86-64,cuda:sm_80"))
    assert "block = array<i64: 1024, 1, 1>" in older and "nvvm" not in older  # no clusters before sm_90
    f32 = lower(text.replace("xf64", "xf32"), "mlir-tir", **CUDA)  # 64 KiB: one block of 512 threads
    assert "block = array<i64: 512, 1, 1>" in f32 and "nvvm" not in f32


def test_argmax_writes_the_first_largest_index_as_i64():
    text = f"""
    func.func @main(%x: {X}) -> tensor<4xi64> {{
      %0 = "hexir.argmax"(%x) {{device = "auto", {family_attrs("argmax")}}} : ({X}) -> tensor<4xi64>
      return %0 : tensor<4xi64>
    }}"""
    filecheck(lower(text, "mlir-tir", **CPU), """
        CHECK:      func.func public @argmax_{{[0-9]+}}(%arg0: memref<4x6xf32>, %arg1: memref<4xi64>)
        CHECK:      scf.for %[[ROW:arg[0-9]+]] = %c0 to %c4 step %c1 {
        CHECK:        %[[BEST:[0-9]+]]:2 = scf.for %[[J:arg[0-9]+]] = %c0 to %c6 step %c1 iter_args(%[[V:arg[0-9]+]] = %{{.+}}, %{{.+}} = %c0_i64) -> (f32, i64) {
        CHECK:          %[[X:[0-9]+]] = "hextir.load"(%arg0, %[[ROW]], %[[J]])
        CHECK-NEXT:     arith.cmpf ogt, %[[X]], %[[V]] : f32
        CHECK:          arith.index_cast %[[J]] : index to i64
        CHECK:          scf.yield %{{.+}}, %{{.+}} : f32, i64
        CHECK:        "hextir.store"(%[[BEST]]#1, %arg1, %[[ROW]]) : (i64, memref<4xi64>, index) -> ()
    """)
    data = lower(text, "hxb")
    assert [a["dtype"] for a in manifest(data)["kernels"][0]["args"]] == ["float32", "int64"]
    x = np.array([[0, 3, 3, 1, 0, 0], [5, 1, 1, 1, 1, 9], [-1, -2, -3, -4, -5, -6], [0, 0, 0, 0, 0, 7]], np.float32)
    np.testing.assert_array_equal(load(data, "cpu").main(x), [1, 5, 0, 5])


def test_a_pointwise_prologue_is_part_of_every_pass_of_its_reduction():
    """softmax(x * 0.5 + 1): one kernel reading x, the prologue's tree in both reductions and the output."""
    prologue = ["add", ["mul", A0, ["const", 0.5]], ["const", 1.0]]
    text = f"""
    func.func @main(%x: {X}) -> {OUT} {{
      %0 = "hexir.mul"(%x) {attrs(["mul", A0, ["const", 0.5]])} : ({X}) -> {X}
      %1 = "hexir.add"(%0) {attrs(["add", A0, ["const", 1.0]])} : ({X}) -> {X}
      %2 = "hexir.softmax"(%1) {{device = "auto", {family_attrs("softmax")}}} : ({X}) -> {OUT}
      return %2 : {OUT}
    }}"""
    program = {"axis": 1, "reductions": [["max", prologue], ["sum", ["exp", ["sub", prologue, ["red", 0]]]]],
               "out": ["div", ["exp", ["sub", prologue, ["red", 0]]], ["red", 1]]}
    filecheck(fused(text), f"""
        CHECK-LABEL: func.func @main
        CHECK-NEXT:  %[[S:.+]] = "hexir.softmax"(%arg0) {{device = "cpu", expr = {pattern(program)}
        CHECK-NEXT:  return %[[S]]
    """)
    tir = lower(text, "mlir-tir", **CPU)
    assert tir.count('"hexir.call"') == 1 and tir.count("func.func public") == 1
    kernel = tir[:tir.index("func.func @main")]
    # each pass reads x; each reduction twice (16 elements at a time, then the rest one by one)
    assert kernel.count("arith.mulf") == 5 and kernel.count('"hextir.load"(%arg0') == 3
    assert kernel.count("vector.load %arg0") == 2


# ---- contract: the linear's epilogue ------------------------------------------------------------

GELU_OF_LINEAR = f"""
func.func @main(%x: tensor<3x5xf32>) -> tensor<3x7xf32> {{
  %w = "hexir.constant"() {{device = "auto", name = "W", value = dense<0.5> : tensor<5x7xf32>}} : () -> tensor<5x7xf32>
  %0 = "hexir.linear"(%x, %w) {{device = "auto", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>}} : (tensor<3x5xf32>, tensor<5x7xf32>) -> tensor<3x7xf32>
  %1 = "hexir.gelu"(%0) {{device = "auto", {family_attrs("gelu")}}} : (tensor<3x7xf32>) -> tensor<3x7xf32>
  return %1 : tensor<3x7xf32>
}}
"""


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_gelu_of_a_linear_is_its_epilogue_with_the_erf_in_the_linear_kernel(device):
    options = CUDA if device == "cuda" else CPU
    graph = fused(GELU_OF_LINEAR, **options)
    filecheck(graph, f"""
        CHECK:      %[[Y:.+]] = "hexir.linear"(%{{{{.+}}}}, %{{{{.+}}}}) {{device = "{device}", hexir.epilogue = {pattern(ops.REGISTRY["gelu"].tree())}, operandSegmentSizes = array<i32: 1, 1,
        CHECK-SAME: 0, 0, 0, 0>}}
        CHECK-NOT:  hexir.gelu
    """)
    text = lower(GELU_OF_LINEAR, "mlir-tir", **options)
    kernel = text[:text.index("func.func @main")]
    filecheck(kernel, f"""
        CHECK:      func.func public @linear_{{{{[0-9]+}}}}(
        CHECK-SAME: hextir.expr = "[\\22mul\\22,{{{{[^"]*}}}}\\22erf\\22{{{{[^"]*}}}}"
        CHECK-SAME: hextir.kernel = #hextir.kernel<"{device}", "linear">
        CHECK:      math.erf
        CHECK:      {"vector.store" if device == "cpu" else '"hextir.store"'}
    """)
    assert text.count("func.func public") == (1 if device == "cpu" else 2)  # the linear (and its cpu twin)
    x = np.linspace(-2, 2, 15, dtype=np.float32).reshape(3, 5)
    y = x.astype(np.float64) @ np.full((5, 7), 0.5)
    expected = y * 0.5 * (1 + np.vectorize(math.erf)(y / np.sqrt(2)))
    host = parse_target("cpu:host,cuda:sm_90" if device == "cuda" else "cpu:host")
    got = load(lower(GELU_OF_LINEAR, "hxb", **{**options, "target": host}), "cpu").main(x)
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-6)


RESIDUAL_OF_LINEAR = f"""
func.func @main(%x: tensor<3x5xf32>, %r: tensor<3x7xf32>) -> tensor<3x7xf32> {{
  %w = "hexir.constant"() {{device = "auto", name = "W", value = dense<0.5> : tensor<5x7xf32>}} : () -> tensor<5x7xf32>
  %0 = "hexir.linear"(%x, %w) {{device = "auto", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>}} : (tensor<3x5xf32>, tensor<5x7xf32>) -> tensor<3x7xf32>
  %1 = "hexir.add"(%0, %r) {attrs(SHIFTED, 2)} : (tensor<3x7xf32>, tensor<3x7xf32>) -> tensor<3x7xf32>
  return %1 : tensor<3x7xf32>
}}
"""


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_residual_add_after_a_linear_is_its_epilogue_reading_the_residual(device):
    """linear(x, W) + r: the add becomes the linear's epilogue with r as its extra input (the
    linear's first epilogue group, read as arg 1), one kernel of x, W, r and the output."""
    options = CUDA if device == "cuda" else CPU
    filecheck(fused(RESIDUAL_OF_LINEAR, **options), f"""
        CHECK:      %[[Y:.+]] = "hexir.linear"(%{{{{.+}}}}, %{{{{.+}}}}, %{{{{.+}}}}) {{device = "{device}", hexir.epilogue = {pattern(SHIFTED)}, operandSegmentSizes = array<i32: 1, 1, 0, 1, 0, 0, 0>}} : (tensor<3x5xf32>, tensor<5x7xf32>, tensor<3x7xf32>) -> tensor<3x7xf32>
        CHECK-NOT:  hexir.add
    """)
    tir = lower(RESIDUAL_OF_LINEAR, "mlir-tir", **options)
    filecheck(tir, f"""
        CHECK:      func.func public @[[K:linear_[0-9]+]](%arg0: memref<3x5xf32>, %arg1: memref<5x7xf32>, %arg2: memref<3x7xf32>, %arg3: memref<3x7xf32>)
        CHECK-SAME: hextir.expr = {pattern(SHIFTED)}
        CHECK-SAME: hextir.kernel = #hextir.kernel<"{device}", "linear">
        CHECK-NOT:  #hextir.kernel<"{device}", "pointwise">
        CHECK-LABEL: func.func @main
        CHECK:      "hexir.call"(%{{{{.+}}}}, %{{{{.+}}}}, %{{{{.+}}}}) {{callee = @[[K]], device = "{device}"
        CHECK-NOT:  "hexir.call"
    """)
    host = parse_target("cpu:host,cuda:sm_90" if device == "cuda" else "cpu:host")
    data = lower(RESIDUAL_OF_LINEAR, "hxb", **{**options, "target": host})
    (kernel,) = manifest(data)["kernels"]
    assert (kernel["op"], kernel["device"], kernel["expr"]) == ("linear", device, SHIFTED)
    assert [(arg["shape"], arg["access"]) for arg in kernel["args"]] == [
        ([3, 5], "read"), ([5, 7], "read"), ([3, 7], "read"), ([3, 7], "write")]  # x, w, r, out
    x = np.linspace(-2, 2, 15, dtype=np.float32).reshape(3, 5)
    r = np.arange(21, dtype=np.float32).reshape(3, 7) - 10
    got = load(data, "cpu").main(x, r)  # cuda: its kernel's cpu twin
    np.testing.assert_allclose(got, x.astype(np.float64) @ np.full((5, 7), 0.5) + r, rtol=1e-6, atol=1e-6)


# ---- what must not fuse -------------------------------------------------------------------------

def test_a_value_used_twice_is_not_fused_into_either_user():
    text = f"""
    func.func @main(%x: {X}) -> ({OUT}, {OUT}) {{
      %0 = "hexir.exp"(%x) {attrs(["exp", A0])} : ({X}) -> {X}
      %1 = "hexir.neg"(%0) {attrs(["neg", A0])} : ({X}) -> {X}
      %2 = "hexir.softmax"(%0) {{device = "auto", {family_attrs("softmax")}}} : ({X}) -> {OUT}
      return %1, %2 : {OUT}, {OUT}
    }}"""
    filecheck(fused(text), f"""
        CHECK:      %[[E:.+]] = "hexir.exp"(%arg0) {{device = "cpu", expr = {pattern(["exp", A0])}
        CHECK-NEXT: %[[N:.+]] = "hexir.neg"(%[[E]]) {{device = "cpu", expr = {pattern(["neg", A0])}
        CHECK-NEXT: %[[S:.+]] = "hexir.softmax"(%[[E]]) {{device = "cpu", expr = {pattern({"axis": 1, "reductions": [["max", A0], ["sum", ["exp", ["sub", A0, ["red", 0]]]]], "out": ["div", ["exp", ["sub", A0, ["red", 0]]], ["red", 1]]})}
        CHECK-NEXT: return %[[N]], %[[S]]
    """)
    assert lower(text, "mlir-tir", **CPU).count('"hexir.call"') == 3


def test_ops_on_two_devices_are_not_fused():
    placement = {"placement": (("hexir.exp", "cuda"), ("hexir.neg", "cpu"))}
    text = f"""
    func.func @main(%x: {X}) -> {OUT} {{
      %0 = "hexir.exp"(%x) {attrs(["exp", A0])} : ({X}) -> {X}
      %1 = "hexir.neg"(%0) {attrs(["neg", A0])} : ({X}) -> {X}
      return %1 : {OUT}
    }}"""
    filecheck(fused(text, **placement), """
        CHECK:      %[[E:.+]] = "hexir.exp"(%{{.+}}) {device = "cuda"
        CHECK-NEXT: %[[BACK:.+]] = "hexir.transfer"(%[[E]]) {source = "cuda", target = "cpu"}
        CHECK-NEXT: "hexir.neg"(%[[BACK]]) {device = "cpu"
    """)


# ---- .mlir input: the verifier checks each family op's expr and result ----------------------------

def _one_op(op: str, attributes: str, result: str = OUT) -> str:
    return f"""
    func.func @main(%x: {X}) -> {result} {{
      %0 = "hexir.{op}"(%x) {attributes} : ({X}) -> {result}
      return %0 : {result}
    }}"""


@pytest.mark.parametrize(("op", "attributes", "result", "message"), [
    ("exp", attrs(["expo", A0]), OUT, r"^-:3:8: exp: expr: unknown op 'expo'; expected one of arg, const, "),
    ("exp", attrs(["exp", A1]), OUT, r"^-:3:8: exp: expr\[1\]\[1\]: expected an arg index below 1, got 1$"),
    ("exp", '{device = "auto", expr = "[nope", operandSegmentSizes = array<i32: 1, 0, 0, 0, 0, 0, 0, 0>}', OUT, r"^-:3:8: exp: expr is not JSON: "),
    ("exp", attrs(["exp", A0]), "tensor<4x7xf32>", r"^-:3:8: exp: result type is float32\[4, 7\], expected float32\[4, 6\]$"),
    ("softmax", attrs(["exp", A0]), OUT, r"^-:3:8: softmax: expr: expected an object, got an array$"),
    ("sum", f'{{device = "auto", {family_attrs("sum")}}}', OUT, r"^-:3:8: sum: result type is float32\[4, 6\], expected float32\[4\] or float32\[4, 1\]$"),
    ("argmax", f'{{device = "auto", {family_attrs("argmax")}}}', "tensor<4xf32>", r"^-:3:8: argmax: result type is float32\[4\], expected int64\[4\] or int64\[4, 1\]$"),
], ids=["unknown op", "arg out of range", "not json", "pointwise shape", "reduce without a program", "reduce shape", "argmax dtype"])
def test_a_family_op_in_an_mlir_file_is_verified(op, attributes, result, message):
    with pytest.raises(TraceError, match=message):
        lower(_one_op(op, attributes, result), "mlir")


def test_a_family_op_in_an_mlir_file_runs_through_every_stage(tmp_path):
    from hexir.cli import main
    path = tmp_path / "chain.mlir"
    path.write_text(POINTWISE_CHAIN)
    assert main([str(path), "-emit=hxb", "-o", str(tmp_path / "chain.hxb")]) == 0
    (kernel,) = manifest((tmp_path / "chain.hxb").read_bytes())["kernels"]
    assert (kernel["op"], kernel["expr"]) == ("pointwise", CHAIN)
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    y = np.random.default_rng(1).standard_normal(6).astype(np.float32)
    got = load(str(tmp_path / "chain.hxb"), "cpu").main(x, y)
    np.testing.assert_allclose(got, np.exp(x * 2 + y) - x, rtol=1e-5, atol=1e-6)
