"""lower-to-tir (-emit=mlir-tir), tir-to-loops (-emit=mlir-linalg) and to-llvm (-emit=llvm),
each checked on the printed IR of small cpu graphs."""

# IR lines are checked as printed: wrapping them would change what they check.
# ruff: noqa: E501

from __future__ import annotations

import re

import hexir_runtime
import numpy as np
import pytest
from hexir_runtime import format as hxb
from hexir_runtime.cpu import CpuDevice

import hexir
from hexir.dialects import hexir as hx
from hexir.driver import run_stage
from hexir.errors import CompileError
from hexir.schedules import cpu as cpu_schedule
from hexir.schedules import cpu_families
from hexir.schedules.cpu import NC_BYTES, PANEL_BYTES
from hexir.target import parse_target

from .conftest import CPU_TILE_ROWS, cpu_linear_tiles, cpu_tile_rows, family_attrs, filecheck, linear_program, lower

LINEAR_OF_M = """
func.func @main(%arg0: tensor<{m}x8xf32>, %w: tensor<8x4xf32>) -> tensor<{m}x4xf32> {{
  %1 = "hexir.linear"(%arg0, %w) {{device = "auto", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>}} : (tensor<{m}x8xf32>, tensor<8x4xf32>) -> tensor<{m}x4xf32>
  return %1 : tensor<{m}x4xf32>
}}
"""
LINEAR = LINEAR_OF_M.format(m=2)

# The linear's result is printed as well as fed to the relu, so the relu is not fused into the
# linear (tests/compiler/test_fuse.py has the fused pair): two kernels, linear_bias then relu.
LINEAR_BIAS_RELU = """
func.func @main(%arg0: tensor<3x5xf64>) -> tensor<3x7xf64> {
  %w = "hexir.constant"() {device = "auto", name = "W", value = dense<0.5> : tensor<5x7xf64>} : () -> tensor<5x7xf64>
  %b = "hexir.constant"() {device = "auto", name = "b", value = dense<-1.0> : tensor<7xf64>} : () -> tensor<7xf64>
  %1 = "hexir.linear"(%arg0, %w, %b) {device = "auto", operandSegmentSizes = array<i32: 1, 1, 1, 0, 0, 0, 0>} : (tensor<3x5xf64>, tensor<5x7xf64>, tensor<7xf64>) -> tensor<3x7xf64>
  %2 = "hexir.relu"(%1) {device = "auto", RELU_ATTRS} : (tensor<3x7xf64>) -> tensor<3x7xf64>
  "hexir.print"(%1) : (tensor<3x7xf64>) -> ()
  return %2 : tensor<3x7xf64>
}
""".replace("RELU_ATTRS", family_attrs("relu"))

RELU = """
func.func @main(%arg0: {type}) -> {type} {{
  %1 = "hexir.relu"(%arg0) {{device = "cpu", RELU_ATTRS}} : ({type}) -> {type}
  return %1 : {type}
}}
""".replace("RELU_ATTRS", family_attrs("relu"))


# ---- lower-to-tir ----------------------------------------------------------------------

def test_linear_becomes_a_kernel_and_a_call():
    filecheck(lower(LINEAR, "mlir-tir"), """
        CHECK-LABEL: func.func public @linear_0(%arg0: memref<2x8xf32>, %arg1: memref<8x4xf32>, %arg2: memref<2x4xf32>)
        CHECK-SAME:      hextir.expr = "[\\22arg\\22,0]"
        CHECK-SAME: hextir.kernel = #hextir.kernel<"cpu", "linear">, hextir.level = "x86-64-v4", hextir.sizes = [], hextir.work = {extent = "1", grain = 1 : i64, spans = true}}
        CHECK-NOT:   hexir.linear
        CHECK-LABEL: func.func @main(%arg0: tensor<2x8xf32>, %arg1: tensor<8x4xf32>)
        CHECK-NEXT:    %[[Y:.+]] = "hexir.call"(%arg0, %arg1) {callee = @linear_0, device = "cpu", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0, 0>}
        CHECK-SAME:      : (tensor<2x8xf32>, tensor<8x4xf32>) -> tensor<2x4xf32>
        CHECK-NEXT:    return %[[Y]]
    """)


WIDE = """
func.func @main(%arg0: tensor<{m}x300xf32{enc}>, %w: tensor<300x300xf32>) -> tensor<{m}x300xf32{enc}> {{
  %1 = "hexir.linear"(%arg0, %w) {{device = "auto", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>}} : (tensor<{m}x300xf32{enc}>, tensor<300x300xf32>) -> tensor<{m}x300xf32{enc}>
  return %1 : tensor<{m}x300xf32{enc}>
}}
"""


def test_tiles_cover_every_output_once():
    """Row counts around the tile's 24 rows (and its micro-kernel's row groups), 300 columns (two
    full column tiles and a narrower one) and K = 300 (two k blocks), split across threads by the
    work record: the product is numpy's, every element once. One module serves them all: its
    row count is the symbol `batch`."""
    data = lower(WIDE.format(m="?", enc=', "batch"'), "hxb")
    (kernel,) = hxb.decode(data).json["kernels"]
    assert kernel["sizes"] == ["batch"]
    assert kernel["work"] == {"extent": ["mul", ["ceildiv", "batch", CPU_TILE_ROWS], 3], "grain": 1}
    rng = np.random.default_rng(7)
    w = rng.standard_normal((300, 300)).astype(np.float32)
    modules = [hexir_runtime.load(data, device=CpuDevice(threads=threads, split_bytes=0)) for threads in (1, 3)]
    for m in (1, 2, 3, 5, 6, 7, 13, 23, 24, 25, 47, 48, 49, 95, 97, 100):
        x = rng.standard_normal((m, 300)).astype(np.float32)
        for module in modules:
            np.testing.assert_allclose(module.main(x, w), x @ w, rtol=2e-5, atol=2e-4, err_msg=f"m={m}")


def test_linear_schedule_is_parallel_over_output_tiles():
    """out[100, 300] in tiles of 12 rows (none of 24 or more leaves 32 items: the smallest) x 128
    float32 columns: 9 x 3 = 27 work items, in column order; item t covers rows [12 (t % 9),
    min(12 (t % 9) + 12, 100)) and columns from 128 (t / 9)."""
    assert cpu_linear_tiles(100, 300, "float32") == 27
    filecheck(lower(WIDE.format(m=100, enc=""), "mlir-tir"), """
        CHECK-LABEL: func.func public @linear_0(
        CHECK-SAME:      hextir.work = {extent = "27", grain = 1 : i64}
        CHECK:       scf.for %[[T:.+]] = %c0 to %c27 step %c1 {
        CHECK-NEXT:    %[[TR:.+]] = arith.remui %[[T]], %c9 : index
        CHECK-NEXT:    %c12 = arith.constant 12 : index
        CHECK-NEXT:    %[[R0:.+]] = arith.muli %[[TR]], %c12 : index
        CHECK-NEXT:    %[[TC:.+]] = arith.divui %[[T]], %c9 : index
        CHECK-NEXT:    %c128 = arith.constant 128 : index
        CHECK-NEXT:    %[[C0:.+]] = arith.muli %[[TC]], %c128 : index
        CHECK-NEXT:    %[[R1A:.+]] = arith.addi %[[R0]], %c12 : index
        CHECK-NEXT:    %[[R1:.+]] = arith.minui %[[R1A]], %c100 : index
        CHECK:         vector.fma
        CHECK:         vector.store %{{.+}}, %arg2[%{{.+}}, %{{.+}}] : memref<100x300xf32>
        CHECK:       } {hextir.schedule = #hextir.loop<"parallel", "">}
        CHECK-NEXT:  return
    """)


def test_linear_with_bias_starts_each_row_from_the_bias():
    """The sums of a row start as the bias row (bias[j0:j0+width], not zeros), through the k
    loop as loop-carried vectors, and are stored to out[i, j0:...]. Three rows stream w: one
    chunk loop, its end from hextir.chunk_end; each k block of x first copied to a local buffer
    (the whole of K = 5, one vector a row), which the FMAs' broadcasts read; the 7 columns a
    narrow vector of the last chunk, w's row k + 8 prefetched at each k (a few-row f64 product).
    (w, a constant of 7 columns, stays as it is: pack-weights leaves weights of one panel or less.)"""
    filecheck(lower(LINEAR_BIAS_RELU, "mlir-tir"), f"""
        CHECK:       func.func public @[[LINEAR:linear_[0-9]+]](%arg0: memref<3x5xf64>, %arg1: memref<5x7xf64>, %arg2: memref<7xf64>, %arg3: memref<3x7xf64>)
        CHECK-SAME:      hextir.expr = "[\\22add\\22,[\\22arg\\22,0],[\\22arg\\22,1]]"
        CHECK-SAME: hextir.kernel = #hextir.kernel<"cpu", "linear">, hextir.level = "{{{{.+}}}}", hextir.sizes = [], hextir.work = {{extent = "{cpu_linear_tiles(3, 7, "float64")}", grain = 1 : i64, spans = true}}}}
        CHECK-NEXT:  %[[XS:[0-9]+]] = "hextir.alloc_local"() {{space = "private"}} : () -> memref<3x5xf64>
        CHECK:       %[[END:[0-9]+]] = "hextir.chunk_end"() : () -> index
        CHECK:       %[[C1:[0-9]+]] = arith.minui %{{{{[0-9]+}}}}, %c7 : index
        CHECK:       %[[ROW0:[0-9]+]] = vector.load %arg0[%c0, %[[K0:[0-9]+]]] : memref<3x5xf64>, vector<5xf64>
        CHECK-NEXT:  vector.store %[[ROW0]], %[[XS]][%c0, %c0] : memref<3x5xf64>, vector<5xf64>
        CHECK:       %[[LAST:[0-9]+]] = arith.cmpi eq, %{{{{[0-9]+}}}}, %c7 : index
        CHECK-NEXT:  scf.if %[[LAST]] {{
        CHECK:         %[[J0:[0-9]+]] = arith.addi %{{{{[0-9]+}}}}, %{{{{[0-9]+}}}} : index
        CHECK:         %[[I1:[0-9]+]] = arith.addi %c0, %c1 : index
        CHECK:         %[[B:[0-9]+]] = vector.load %arg2[%[[J0]]] : memref<7xf64>, vector<7xf64>
        CHECK:         %[[U:[0-9]+]]:3 = scf.for %{{{{arg[0-9]+}}}} = %[[K0]] to %{{{{[0-9]+}}}} step %c4 iter_args(%{{{{arg[0-9]+}}}} = %[[B]], %{{{{arg[0-9]+}}}} = %[[B]], %{{{{arg[0-9]+}}}} = %[[B]]) -> (vector<7xf64>, vector<7xf64>, vector<7xf64>) {{
        CHECK:         %[[S:[0-9]+]]:3 = scf.for %[[K:arg[0-9]+]] = %{{{{[0-9]+}}}} to %{{{{[0-9]+}}}} step %c1 iter_args(%[[A0:arg[0-9]+]] = %[[U]]#0, %[[A1:arg[0-9]+]] = %[[U]]#1, %{{{{arg[0-9]+}}}} = %[[U]]#2) -> (vector<7xf64>, vector<7xf64>, vector<7xf64>) {{
        CHECK-NEXT:      %[[WV:[0-9]+]] = vector.load %arg1[%[[K]], %[[J0]]] : memref<5x7xf64>, vector<7xf64>
        CHECK-NEXT:      %[[AHEAD:[0-9]+]] = arith.addi %[[K]], %c8 : index
        CHECK-NEXT:      %[[ROW:[0-9]+]] = arith.minui %[[AHEAD]], %c4 : index
        CHECK-NEXT:      memref.prefetch %arg1[%[[ROW]], %[[J0]]], read, locality<2>, data : memref<5x7xf64>
        CHECK-NEXT:      %[[KK:[0-9]+]] = arith.subi %[[K]], %[[K0]] : index
        CHECK-NEXT:      %[[X0:[0-9]+]] = "hextir.load"(%[[XS]], %c0, %[[KK]]) : (memref<3x5xf64>, index, index) -> f64
        CHECK-NEXT:      %[[X1:[0-9]+]] = "hextir.load"(%[[XS]], %[[I1]], %[[KK]]) : (memref<3x5xf64>, index, index) -> f64
        CHECK-NEXT:      %{{{{[0-9]+}}}} = "hextir.load"(%[[XS]], %{{{{[0-9]+}}}}, %[[KK]])
        CHECK-NEXT:      %[[XB:[0-9]+]] = vector.broadcast %[[X0]] : f64 to vector<7xf64>
        CHECK-NEXT:      %[[F0:[0-9]+]] = vector.fma %[[XB]], %[[WV]], %[[A0]] : vector<7xf64>
        CHECK-NEXT:      %[[XB1:[0-9]+]] = vector.broadcast %[[X1]] : f64 to vector<7xf64>
        CHECK-NEXT:      %[[F1:[0-9]+]] = vector.fma %[[XB1]], %[[WV]], %[[A1]] : vector<7xf64>
        CHECK:           scf.yield %[[F0]], %[[F1]], %{{{{[0-9]+}}}} : vector<7xf64>, vector<7xf64>, vector<7xf64>
        CHECK-NEXT:    }} {{hextir.schedule = #hextir.loop<"serial", "">}}
        CHECK-NEXT:    vector.store %[[S]]#0, %arg3[%c0, %[[J0]]] : memref<3x7xf64>, vector<7xf64>
    """)


SHARED_WEIGHT = """
func.func @main(%arg0: tensor<768x8xf32>) -> (tensor<768x40xf32>, tensor<768x40xf32>) {
  %w = "hexir.constant"() {device = "auto", name = "W", value = dense<0.5> : tensor<8x40xf32>} : () -> tensor<8x40xf32>
  %1 = "hexir.linear"(%arg0, %w) {device = "cpu", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>} : (tensor<768x8xf32>, tensor<8x40xf32>) -> tensor<768x40xf32>
  %2 = "hexir.linear"(%arg0, %w) {device = "cuda", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>} : (tensor<768x8xf32>, tensor<8x40xf32>) -> tensor<768x40xf32>
  return %1, %2 : tensor<768x40xf32>, tensor<768x40xf32>
}
"""


def test_a_constant_weight_comes_in_panels_to_a_cpu_linear_only():
    """pack-weights: the cpu linear reads its constant w as 2 panels of 32 columns (40 of them
    w's) and copies no block of it (768 rows: 24-row tiles, which would pack w on their stack);
    the cuda linear, and its cpu twin, read W as it is; so does a cpu linear whose weight has no
    more columns than a panel (32 f32)."""
    filecheck(lower(SHARED_WEIGHT, "mlir-tir"), """
        CHECK-LABEL: func.func public @linear_0(%arg0: memref<768x8xf32>, %arg1: memref<2x8x32xf32>, %arg2: memref<768x40xf32>)
        CHECK-SAME:      hextir.kernel = #hextir.kernel<"cpu", "linear_panels">
        CHECK-NOT:   hextir.alloc_local
        CHECK:       vector.load %arg1[%{{[0-9]+}}, %{{arg[0-9]+}}, %{{[0-9]+}}] : memref<2x8x32xf32>, vector<32xf32>
        CHECK-LABEL: func.func public @linear_1(%arg0: memref<768x8xf32>, %arg1: memref<8x40xf32>, %arg2: memref<768x40xf32>)
        CHECK-SAME:      hextir.kernel = #hextir.kernel<"cuda", "linear">
        CHECK-LABEL: func.func public @linear_1_cpu(%arg0: memref<768x8xf32>, %arg1: memref<8x40xf32>, %arg2: memref<768x40xf32>)
        CHECK-SAME:      hextir.kernel = #hextir.kernel<"cpu", "linear">
        CHECK-LABEL: func.func @main
        CHECK:       %[[WD:.+]] = "hexir.constant"() {device = "cuda", name = "W", value = dense<5.000000e-01> : tensor<8x40xf32>}
        CHECK-NEXT:  %[[W:.+]] = "hexir.constant"() {device = "cpu", name = "W.panels", value = dense<{{.+}}> : tensor<2x8x32xf32>}
        CHECK-NEXT:  "hexir.call"(%arg0, %[[W]]) {callee = @linear_0, device = "cpu"
        CHECK:       "hexir.call"(%{{.+}}, %[[WD]]) {callee = @linear_1, device = "cuda"
    """)
    both_cpu = lower(SHARED_WEIGHT.replace('device = "cuda"', 'device = "cpu"'), "mlir-tir")
    assert both_cpu.count('name = "W.panels"') == 1 and 'name = "W"' not in both_cpu  # one copy, shared
    narrow = lower(SHARED_WEIGHT.replace("40", "32"), "mlir-tir")
    assert "W.panels" not in narrow and "linear_panels" not in narrow and "memref<8x32xf32>" in narrow


TALL_W_ARGUMENT = """
func.func @main(%arg0: tensor<40x300xf32>, %w: tensor<300x70xf32>) -> tensor<40x70xf32> {
  %1 = "hexir.linear"(%arg0, %w) {device = "auto", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>} : (tensor<40x300xf32>, tensor<300x70xf32>) -> tensor<40x70xf32>
  return %1 : tensor<40x70xf32>
}
"""


def test_packing_a_weight_known_at_run_time_is_chosen_by_dtype_and_rows():
    """The tuned rule (`PACK_ROWS`): f64 products of 1024 rows and more pack w once; f32 never."""
    assert cpu_schedule.packs_w(1024, 1024, "float64") and not cpu_schedule.packs_w(1023, 1024, "float64")
    assert not cpu_schedule.packs_w(4096, 4096, "float32") and not cpu_schedule.packs_w("batch", 4096, "float64")
    assert not cpu_schedule.packs_w(2048, 16, "float64")  # one panel wide: w's rows are contiguous already


def test_a_weight_known_at_run_time_is_packed_once_by_a_kernel_of_its_own(monkeypatch):
    """A cpu linear too tall to stream w (40 rows; packing from 17 rows for this test), w an
    argument of 70 columns: a pack_panels kernel, launched first, lays w out in 3 panels of 32
    columns (the last one 6 of w's, then zeros), its work items each panel's 2 blocks of 256 k's;
    the linear reads those panels as it reads a constant's (`linear_panels`: no copy on its
    stack). The host program calls both."""
    monkeypatch.setitem(cpu_schedule.PACK_ROWS, "float32", 17)
    filecheck(lower(TALL_W_ARGUMENT, "mlir-tir"), """
        CHECK-LABEL: func.func public @pack_panels_0(%arg0: memref<300x70xf32>, %arg1: memref<3x300x32xf32>)
        CHECK-SAME:      hextir.kernel = #hextir.kernel<"cpu", "pack_panels">, {{.+}}, hextir.work = {extent = "6", grain = 1 : i64}
        CHECK:       scf.for %[[ITEM:.+]] = %c0 to %c6 step %c1 {
        CHECK:         %[[PANEL:.+]] = arith.divui %[[ITEM]], %c2 : index
        CHECK-NEXT:    %[[BLOCK:.+]] = arith.remui %[[ITEM]], %c2 : index
        CHECK:         %[[K0:.+]] = arith.muli %[[BLOCK]], %c256 : index
        CHECK:         %[[J0:.+]] = arith.muli %[[PANEL]], %c32 : index
        CHECK-NEXT:    %[[LAST:.+]] = arith.cmpi eq, %[[PANEL]], %c2 : index
        CHECK-NEXT:    scf.if %[[LAST]] {
        CHECK:           scf.for %[[K:.+]] = %[[K0]] to %{{.+}} step %c1 {
        CHECK-NEXT:        %[[ROW:.+]] = vector.load %arg0[%[[K]], %[[J0]]] : memref<300x70xf32>, vector<6xf32>
        CHECK-NEXT:        vector.store %[[ROW]], %arg1[%[[PANEL]], %[[K]], %c0] : memref<3x300x32xf32>, vector<6xf32>
        CHECK-NEXT:        %[[ZEROS:.+]] = arith.constant dense<0.000000e+00> : vector<26xf32>
        CHECK-NEXT:        vector.store %[[ZEROS]], %arg1[%[[PANEL]], %[[K]], %c6] : memref<3x300x32xf32>, vector<26xf32>
        CHECK:         } else {
        CHECK:             vector.load %arg0[%{{.+}}, %[[J0]]] : memref<300x70xf32>, vector<32xf32>
        CHECK:       } {hextir.schedule = #hextir.loop<"parallel", "">}
        CHECK-LABEL: func.func public @linear_0(%arg0: memref<40x300xf32>, %arg1: memref<3x300x32xf32>, %arg2: memref<40x70xf32>)
        CHECK-SAME:      hextir.kernel = #hextir.kernel<"cpu", "linear_panels">
        CHECK-NOT:   hextir.alloc_local
        CHECK:       vector.load %arg1[%{{[0-9]+}}, %{{arg[0-9]+}}, %{{[0-9]+}}] : memref<3x300x32xf32>, vector<32xf32>
        CHECK-LABEL: func.func @main(%arg0: tensor<40x300xf32>, %arg1: tensor<300x70xf32>)
        CHECK-NEXT:    %[[P:.+]] = "hexir.call"(%arg1) {callee = @pack_panels_0, device = "cpu"
        CHECK-SAME:      : (tensor<300x70xf32>) -> tensor<3x300x32xf32>
        CHECK-NEXT:    %[[Y:.+]] = "hexir.call"(%arg0, %[[P]]) {callee = @linear_0, device = "cpu"
        CHECK-NEXT:    return %[[Y]]
    """)
    streamed = lower(TALL_W_ARGUMENT.replace("40x", "16x"), "mlir-tir")  # few rows stream w: no pack
    assert "pack_panels" not in streamed and "linear_panels" not in streamed
    symbolic = lower(TALL_W_ARGUMENT.replace("40x300xf32>", '?x300xf32, "batch">').replace(
        "40x70xf32>", '?x70xf32, "batch">'), "mlir-tir")  # each tile's own copy, as before
    assert "pack_panels" not in symbolic and "hextir.alloc_local" in symbolic


@pytest.mark.parametrize(("dtype", "n"), [("float32", 40), ("float64", 17), ("float32", 600)])
def test_the_panels_padding_past_n_is_zeros(monkeypatch, dtype, n):
    """pack-weights: panels[p, k, j] = w[k, p * L + j], zeros past N (N not a multiple of the
    panel's L columns; 600 f32 with one row: panels of a 512-byte column tile). Whatever memory
    the pass's arrays start with: np.empty here hands out arrays full of NaN (its contents are
    unspecified), so a padding left as allocated is seen, not hidden by a fresh zero page."""
    empty = np.empty

    def garbage(*args, **keys):
        array = empty(*args, **keys)
        array.view(np.uint8).fill(0xFF)
        return array
    weight = np.random.default_rng(n).standard_normal((8, n)).astype(dtype)
    rows = 1 if n == 600 else 4
    jitted = hexir.jit(lambda x: hexir.linear(x, weight), placement="hexir.linear=cpu")
    module = jitted.trace(hexir.TensorSpec((rows, 8), dtype))
    monkeypatch.setattr(np, "empty", garbage)
    run_stage(module, "mlir-tir", jitted.options)
    monkeypatch.undo()
    (panels,) = [hx.constant_array(op.operation) for op in hx.main_function(module).regions[0].blocks[0].operations
                 if op.operation.name == "hexir.constant" and hx.string_attr(op.operation, "name") == "weight.panels"]
    count, k, lanes = panels.shape
    assert k == 8 and lanes in (PANEL_BYTES // weight.itemsize, NC_BYTES // weight.itemsize) and count == -(-n // lanes)
    columns = panels.transpose(1, 0, 2).reshape(8, count * lanes)
    np.testing.assert_array_equal(columns[:, :n], weight)
    assert not columns[:, n:].any(), "the padding past N is not zeros"


def test_relu_of_rank_1_is_one_parallel_loop():
    filecheck(lower(RELU.format(type="tensor<6xf32>"), "mlir-tir"), """
        CHECK-LABEL: func.func public @relu_0(%arg0: memref<6xf32>, %arg1: memref<6xf32>)
        CHECK:       scf.for %[[I:.+]] = %c0 to %c6 step %c1 {
        CHECK-NEXT:    %[[X:.+]] = "hextir.load"(%arg0, %[[I]]) : (memref<6xf32>, index) -> f32
        CHECK:         %[[M:.+]] = arith.maximumf %[[X]], %{{.+}} : f32
        CHECK-NEXT:    "hextir.store"(%[[M]], %arg1, %[[I]]) : (f32, memref<6xf32>, index) -> ()
        CHECK-NEXT:  } {hextir.schedule = #hextir.loop<"parallel", "">}
        CHECK-NEXT:  return
    """)


def test_relu_of_rank_3_is_one_parallel_loop_over_its_rows_then_its_last_axis():
    filecheck(lower(RELU.format(type="tensor<2x3x5xf64>"), "mlir-tir"), """
        CHECK-LABEL: func.func public @relu_0(%arg0: memref<2x3x5xf64>, %arg1: memref<2x3x5xf64>)
        CHECK:       scf.for %[[R:.+]] = %c0 to %c6 step %c1 {
        CHECK-DAG:     %[[J:.+]] = arith.remui %[[R]], %c3 : index
        CHECK-DAG:     %[[I:.+]] = arith.divui %[[R]], %c3 : index
        CHECK:         scf.for %[[K:.+]] = %c0 to %c5 step %c1 {
        CHECK-NEXT:      "hextir.load"(%arg0, %[[I]], %[[J]], %[[K]])
        CHECK:           arith.maximumf
        CHECK-NEXT:      "hextir.store"(%{{.+}}, %arg1, %[[I]], %[[J]], %[[K]])
        CHECK-NEXT:    } {hextir.schedule = #hextir.loop<"serial", "">}
        CHECK-NEXT:  } {hextir.schedule = #hextir.loop<"parallel", "">}
    """)


def test_one_trip_loops_keep_their_schedule():
    filecheck(lower(RELU.format(type="tensor<1x1xf32>"), "mlir-tir"), """
        CHECK: scf.for
        CHECK: scf.for
        CHECK: } {hextir.schedule = #hextir.loop<"serial", "">}
        CHECK: } {hextir.schedule = #hextir.loop<"parallel", "">}
    """)


def test_kernels_are_numbered_in_program_order():
    filecheck(lower(LINEAR_BIAS_RELU, "mlir-tir"), """
        CHECK:     @linear_0
        CHECK:     @relu_1
        CHECK-NOT: hexir.linear
        CHECK-NOT: hexir.relu
    """)


# ---- tir-to-loops ----------------------------------------------------------------------

def test_loops_use_memref_and_take_a_work_range():
    """A tiled linear's parallel loop runs [first, last) of its tiles, one at a time."""
    filecheck(lower(LINEAR_OF_M.format(m=20), "mlir-linalg"), f"""
        CHECK:       func.func public @linear_0(%arg0: memref<20x8xf32>, %arg1: memref<8x4xf32>, %arg2: memref<20x4xf32>, %[[FIRST:.+]]: index, %[[LAST:.+]]: index)
        CHECK-SAME:      hextir.expr = "[\\22arg\\22,0]"
        CHECK-SAME: hextir.kernel = #hextir.kernel<"cpu", "linear">, hextir.level = "{{{{.+}}}}", hextir.sizes = [], hextir.work = {{extent = "{cpu_linear_tiles(20, 4, "float32")}", grain = 1 : i64}}}}
        CHECK:       scf.for %[[T:.+]] = %[[FIRST]] to %[[LAST]] step %c1 {{
        CHECK:         %[[ROW0:.+]] = arith.muli %{{{{.+}}}}, %c{cpu_tile_rows(20, 4, "float32")} : index
        CHECK:         memref.load %arg0[%[[I:.+]], %[[K:.+]]] : memref<20x8xf32>
        CHECK:         vector.fma
        CHECK:         vector.store %{{{{.+}}}}, %arg2[%{{{{.+}}}}, %{{{{.+}}}}] : memref<20x4xf32>, vector<4xf32>
        CHECK-LABEL: func.func @main
    """)


def test_a_chunk_loop_runs_its_body_once_for_the_whole_range():
    """Few rows stream w: the parallel loop steps by last - first (at least 1), and the body's
    chunk end is `last`."""
    filecheck(lower(LINEAR, "mlir-linalg"), f"""
        CHECK:       func.func public @linear_0(%arg0: memref<2x8xf32>, %arg1: memref<8x4xf32>, %arg2: memref<2x4xf32>, %[[FIRST:.+]]: index, %[[LAST:.+]]: index)
        CHECK-SAME:      hextir.work = {{extent = "{cpu_linear_tiles(2, 4, "float32")}", grain = 1 : i64, spans = true}}
        CHECK:       %[[N:.+]] = arith.subi %[[LAST]], %[[FIRST]] : index
        CHECK:       %[[STEP:.+]] = arith.maxui %[[N]], %c1{{{{.*}}}} : index
        CHECK-NEXT:  scf.for %[[T:.+]] = %[[FIRST]] to %[[LAST]] step %[[STEP]] {{
        CHECK:         arith.muli %[[LAST]], %c
        CHECK:         vector.fma
        CHECK-NOT:   hextir.chunk_end
        CHECK-LABEL: func.func @main
    """)


def test_loops_leave_no_hextir_ops_or_schedules_in_cpu_kernels():
    filecheck(lower(LINEAR_BIAS_RELU, "mlir-linalg"), """
        CHECK-NOT: hextir.load
        CHECK-NOT: hextir.store
        CHECK-NOT: hextir.schedule
        CHECK:     func.func @main
    """)


@pytest.mark.parametrize("m", [17, 23, 24, 25, 12 * 32, 12 * 32 + 1, 137, 24 * 32 + 1, 50_000])
def test_linear_work_items_are_the_output_tiles(m):
    """One column tile: rows in tiles of the most rows that leave 32 items, else 12."""
    rows = {17: 12, 23: 12, 24: 12, 25: 12, 384: 12, 385: 12, 137: 12, 769: 24, 50_000: 192}[m]
    assert cpu_tile_rows(m, 4, "float32") == rows
    filecheck(lower(LINEAR_OF_M.format(m=m), "mlir-linalg"), f"""
        CHECK:      func.func public @linear_0(%arg0: memref<{m}x8xf32>, %arg1: memref<8x4xf32>, %arg2: memref<{m}x4xf32>, %arg3: index, %arg4: index)
        CHECK-SAME: hextir.work = {{extent = "{-(-m // rows)}", grain = 1 : i64}}
        CHECK:      scf.for %[[T:.+]] = %arg3 to %arg4 step %c1
        CHECK:      arith.divui %[[T]], %{{{{.+}}}} : index
        CHECK:      arith.minui
    """)


@pytest.mark.parametrize("type_, items", [("tensor<6xf32>", 6), ("tensor<2x3x5xf64>", 6), ("tensor<1x9xf32>", 1)])
def test_work_items_is_the_outer_loop_trip_count(type_, items):
    """A pointwise kernel's work items are its rows (every axis but the last); a thread takes
    CHUNK_ELEMENTS' worth."""
    row = int(type_[7:-5].split("x")[-1]) if "x" in type_[7:-5] else 1
    filecheck(lower(RELU.format(type=type_), "mlir-linalg"), f"""
        CHECK: func.func public @relu_0(%arg0: memref<{type_[7:-1]}>, %arg1: memref<{type_[7:-1]}>, %arg2: index, %arg3: index)
        CHECK-SAME: hextir.work = {{extent = "{items}", grain = {-(-cpu_families.CHUNK_ELEMENTS // row)} : i64}}
        CHECK: scf.for %{{{{.+}}}} = %arg2 to %arg3 step %c1
    """)


def _relu_kernel(body: str, schedule: str) -> str:
    """A hand-written cpu relu kernel over 4 elements, its loop `body` (the element index %i;
    %v = the value stored) scheduled `schedule`, and the main that calls it."""
    return f"""
    func.func public @relu_0(%x: memref<4xf32>, %out: memref<4xf32>) attributes {{hextir.kernel = #hextir.kernel<"cpu", "pointwise">}} {{
      %c0 = arith.constant 0 : index
      %c4 = arith.constant 4 : index
      %c1 = arith.constant 1 : index
      scf.for %i = %c0 to %c4 step %c1 {{
        {body}
        "hextir.store"(%v, %out, %i) : (f32, memref<4xf32>, index) -> ()
      }} {{hextir.schedule = #hextir.loop<"{schedule}", "">}}
      return
    }}
    func.func @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {{
      %0 = "hexir.call"(%arg0) {{callee = @relu_0, device = "cpu", operandSegmentSizes = array<i32: 1, 0, 0, 0, 0, 0, 0, 0>}} : (tensor<4xf32>) -> tensor<4xf32>
      return %0 : tensor<4xf32>
    }}
    """


def test_kernel_without_an_outer_parallel_loop_is_refused():
    text = _relu_kernel('%v = "hextir.load"(%x, %i) : (memref<4xf32>, index) -> f32', "serial")
    with pytest.raises(CompileError, match=r"cpu kernel relu_0 needs exactly one outermost parallel loop, found 0"):
        lower(text, "mlir-linalg")


def test_a_chunk_end_outside_a_chunk_loop_is_refused():
    """hextir.chunk_end means the end of the thread's chunk: only a loop bound to `chunk` has one."""
    text = _relu_kernel('%end = "hextir.chunk_end"() : () -> index\n'
                        '        %v = "hextir.load"(%x, %end) : (memref<4xf32>, index) -> f32', "parallel")
    with pytest.raises(CompileError, match=r"cpu kernel relu_0 uses hextir.chunk_end outside a chunk loop"):
        lower(text, "mlir-linalg")


# ---- to-llvm -----------------------------------------------------------------------------

def test_llvm_kernel_takes_bare_pointers_and_a_work_range():
    filecheck(lower(LINEAR, "llvm"), """
        CHECK: define void @linear_0(ptr noalias %0, ptr noalias %1, ptr noalias %2, i64 %3, i64 %4)
        CHECK: call <4 x float> @llvm.fmuladd.v4f32(
    """)


def test_llvm_has_one_function_per_kernel_and_no_host_program():
    filecheck(lower(LINEAR_BIAS_RELU, "llvm"), """
        CHECK:     define void @linear_{{[0-9]+}}(ptr noalias %0, ptr noalias %1, ptr noalias %2, ptr noalias %3, i64 %4, i64 %5)
        CHECK:     @llvm.fmuladd.v{{[0-9]+}}f64
        CHECK:     define void @relu_{{[0-9]+}}(ptr noalias %0, ptr noalias %1, i64 %2, i64 %3)
        CHECK:     @llvm.maximum.f64
        CHECK-NOT: @main
    """)


DEFINE = re.compile(r"^define void @(\w+)\((.*)\)", re.MULTILINE)


@pytest.mark.parametrize("placement", [(), (("hexir.linear", "cuda"), ("hexir.relu", "cuda"))], ids=["cpu", "cuda fallbacks"])
def test_llvm_buffer_arguments_are_noalias_and_the_work_range_is_not(placement):
    """The runtime gives every call a fresh output buffer, so each pointer may be noalias; the
    two i64s (first, last) are plain integers."""
    text = lower(LINEAR_BIAS_RELU, "llvm", placement=placement)
    suffix = "_cpu" if placement else ""
    buffers = {"linear": 4, "relu": 2}  # x, w, b, out / x, out
    defines = {name: [p.strip() for p in params.split(",")] for name, params in DEFINE.findall(text)}
    kinds = {re.fullmatch(rf"(linear|relu)_[0-9]+{suffix}", name).group(1) for name in defines}
    assert len(defines) == 2 and kinds == set(buffers), text
    for name, params in defines.items():
        count = buffers[name.split("_")[0]]
        assert len(params) == count + 2, (name, params)
        assert params[:count] == [f"ptr noalias %{i}" for i in range(count)], (name, params)
        assert params[count:] == [f"i64 %{count}", f"i64 %{count + 1}"], (name, params)
        assert not any("noalias" in p for p in params[count:])


def test_llvm_of_a_graph_without_kernels_says_so():
    text = """
    func.func @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
      return %arg0 : tensor<4xf32>
    }
    """
    assert lower(text, "llvm") == "; no cpu kernels\n"


@pytest.mark.parametrize(("target", "n", "together"), [
    ("cpu:x86-64-v4", 33, True), ("cpu:x86-64-v4", 47, False), ("cpu:x86-64-v3", 17, False)])
def test_a_narrow_last_panel_runs_with_the_last_full_one_where_the_registers_hold_both(target, n, together):
    """out[100, n] f32: the 33rd column's lane is summed in the same k loop as columns 1-32 (one
    broadcast of x a row), 6 rows x 3 vectors of sums in AVX-512's 32 registers; 47 columns (15
    lanes: 8 + 4 + 2 + 1 vectors) or AVX2's 16 registers keep the narrow panel's own loop."""
    nr = {"cpu:x86-64-v4": 32, "cpu:x86-64-v3": 16}[target]
    loops = re.findall(r"-> \((vector<[^)]*)\)", lower(linear_program(100, 64, n), "mlir-tir",
                                                        target=parse_target(target)))
    # the k loops' sums: a row's full panel then its narrow one, six rows over, in one loop
    merged = ", ".join([f"vector<{nr}xf32>, vector<{n % nr}xf32>"] * 6)
    assert (merged in loops) == together, loops
    assert f"vector<{n % nr}xf32>" in ", ".join(loops)  # (apart: a loop of its own)


def test_a_tiles_k_loop_takes_unroll_ks_a_trip_then_the_rest_one_by_one():
    """A tiled product's micro-kernel (6 rows x 32 f32 columns: 6 vectors of sums): a loop
    stepping UNROLL k's (UNROLL copies of the broadcasts and FMAs), then one for the k's left,
    both carrying the sums; a streamed product's calls (4 rows x 4 vectors) too, each k
    prefetching (an f32 product of few rows) row k + 32 of w at each of its vectors."""
    tiled = lower(linear_program(100, 64, 64), "mlir-tir", target=parse_target("cpu:x86-64-v4"))
    unroll = cpu_schedule.UNROLL
    filecheck(tiled, f"""
        CHECK-LABEL: func.func public @linear_0(
        CHECK:       %[[W:[0-9]+]] = arith.muli %{{{{[0-9]+}}}}, %c{unroll} : index
        CHECK-NEXT:  %[[MID:[0-9]+]] = arith.addi %[[K0:[0-9]+]], %[[W]] : index
        CHECK-NEXT:  %[[U:[0-9]+]]:6 = scf.for %{{{{arg[0-9]+}}}} = %[[K0]] to %[[MID]] step %c{unroll} iter_args(
        CHECK-COUNT-{6 * unroll}: vector.fma
        CHECK:       scf.yield
        CHECK-NEXT:  }} {{hextir.schedule = #hextir.loop<"serial", "">}}
        CHECK-NEXT:  %{{{{[0-9]+}}}}:6 = scf.for %{{{{arg[0-9]+}}}} = %[[MID]] to %{{{{[0-9]+}}}} step %c1 iter_args(%{{{{arg[0-9]+}}}} = %[[U]]#0,
        CHECK-COUNT-6: vector.fma
        CHECK:       scf.yield
    """)
    assert unroll > 1
    streamed = lower(linear_program(4, 64, 64), "mlir-tir", target=parse_target("cpu:x86-64-v4"))
    filecheck(streamed, f"""
        CHECK-LABEL: func.func public @linear_0(
        CHECK:       %[[U:[0-9]+]]:16 = scf.for %{{{{arg[0-9]+}}}} = %{{{{[0-9]+}}}} to %{{{{[0-9]+}}}} step %c{unroll} iter_args(
        CHECK:       %[[ROW:[0-9]+]] = arith.minui %{{{{[0-9]+}}}}, %c63 : index
        CHECK-COUNT-4: memref.prefetch %arg1[%[[ROW]], %{{{{[0-9]+}}}}], read, locality<2>, data : memref<64x64xf32>
        CHECK-COUNT-{16 * unroll}: vector.fma
        CHECK:       scf.yield
        CHECK:       %{{{{[0-9]+}}}}:16 = scf.for %{{{{arg[0-9]+}}}} = %{{{{[0-9]+}}}} to %{{{{[0-9]+}}}} step %c1 iter_args(%{{{{arg[0-9]+}}}} = %[[U]]#0,
    """)
