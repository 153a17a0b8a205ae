"""lower-to-tir (-emit=mlir-tir), tir-to-loops (-emit=mlir-linalg) and to-llvm (-emit=llvm),
each checked on the printed IR of small cpu graphs."""

# IR lines are checked as printed: wrapping them would change what they check.
# ruff: noqa: E501

from __future__ import annotations

import pytest

from hexir.errors import CompileError

from .conftest import filecheck, lower

LINEAR = """
func.func @main(%arg0: tensor<2x8xf32>, %w: tensor<8x4xf32>) -> tensor<2x4xf32> {
  %1 = "hexir.linear"(%arg0, %w) {device = "auto"} : (tensor<2x8xf32>, tensor<8x4xf32>) -> tensor<2x4xf32>
  return %1 : tensor<2x4xf32>
}
"""

LINEAR_BIAS_RELU = """
func.func @main(%arg0: tensor<3x5xf64>) -> tensor<3x7xf64> {
  %w = "hexir.constant"() {device = "auto", name = "W", value = dense<0.5> : tensor<5x7xf64>} : () -> tensor<5x7xf64>
  %b = "hexir.constant"() {device = "auto", name = "b", value = dense<-1.0> : tensor<7xf64>} : () -> tensor<7xf64>
  %1 = "hexir.linear"(%arg0, %w, %b) {device = "auto"} : (tensor<3x5xf64>, tensor<5x7xf64>, tensor<7xf64>) -> tensor<3x7xf64>
  %2 = "hexir.relu"(%1) {device = "auto"} : (tensor<3x7xf64>) -> tensor<3x7xf64>
  "hexir.print"(%2) : (tensor<3x7xf64>) -> ()
  return %2 : tensor<3x7xf64>
}
"""

RELU = """
func.func @main(%arg0: {type}) -> {type} {{
  %1 = "hexir.relu"(%arg0) {{device = "cpu"}} : ({type}) -> {type}
  return %1 : {type}
}}
"""


# ---- lower-to-tir ----------------------------------------------------------------------

def test_linear_becomes_a_kernel_and_a_call():
    filecheck(lower(LINEAR, "mlir-tir"), """
        CHECK-LABEL: func.func public @linear_0(%arg0: memref<2x8xf32>, %arg1: memref<8x4xf32>, %arg2: memref<2x4xf32>)
        CHECK-SAME:      attributes {hextir.kernel = #hextir.kernel<"cpu", "linear">}
        CHECK-NOT:   hexir.linear
        CHECK-LABEL: func.func @main(%arg0: tensor<2x8xf32>, %arg1: tensor<8x4xf32>)
        CHECK-NEXT:    %[[Y:.+]] = "hexir.call"(%arg0, %arg1) {callee = @linear_0, device = "cpu", operandSegmentSizes = array<i32: 1, 1, 0>}
        CHECK-SAME:      : (tensor<2x8xf32>, tensor<8x4xf32>) -> tensor<2x4xf32>
        CHECK-NEXT:    return %[[Y]]
    """)


def test_linear_schedule_is_parallel_outside_serial_inside():
    filecheck(lower(LINEAR, "mlir-tir"), """
        CHECK-LABEL: func.func public @linear_0
        CHECK:       scf.for %[[I:.+]] = %c0 to %c2 step %c1 {
        CHECK:         scf.for %[[J:.+]] = %c0 to %c4 step %c1 {
        CHECK:           "hextir.store"(%{{.+}}, %arg2, %[[I]], %[[J]]) : (f32, memref<2x4xf32>, index, index) -> ()
        CHECK-NEXT:    } {hextir.schedule = #hextir.loop<"serial", "">}
        CHECK:         scf.for %[[K:.+]] = %c0 to %c8 step %c1 {
        CHECK-NEXT:      %[[A:.+]] = "hextir.load"(%arg0, %[[I]], %[[K]]) : (memref<2x8xf32>, index, index) -> f32
        CHECK:           scf.for %[[J2:.+]] = %c0 to %c4 step %c1 {
        CHECK-NEXT:        %[[B:.+]] = "hextir.load"(%arg1, %[[K]], %[[J2]])
        CHECK-NEXT:        %[[P:.+]] = arith.mulf %[[A]], %[[B]] : f32
        CHECK-NEXT:        %[[O:.+]] = "hextir.load"(%arg2, %[[I]], %[[J2]])
        CHECK-NEXT:        %[[S:.+]] = arith.addf %[[O]], %[[P]] : f32
        CHECK-NEXT:        "hextir.store"(%[[S]], %arg2, %[[I]], %[[J2]])
        CHECK-NEXT:      } {hextir.schedule = #hextir.loop<"serial", "">}
        CHECK-NEXT:    } {hextir.schedule = #hextir.loop<"serial", "">}
        CHECK-NEXT:  } {hextir.schedule = #hextir.loop<"parallel", "">}
        CHECK-NEXT:  return
    """)


def test_linear_with_bias_starts_each_row_from_the_bias():
    filecheck(lower(LINEAR_BIAS_RELU, "mlir-tir"), """
        CHECK-LABEL: func.func public @linear_0(%arg0: memref<3x5xf64>, %arg1: memref<5x7xf64>, %arg2: memref<7xf64>, %arg3: memref<3x7xf64>)
        CHECK-SAME:      attributes {hextir.kernel = #hextir.kernel<"cpu", "linear_bias">}
        CHECK:       scf.for %[[I:.+]] = %c0 to %c3 step %c1 {
        CHECK:         scf.for %[[J:.+]] = %c0 to %c7 step %c1 {
        CHECK-NEXT:      %[[B:.+]] = "hextir.load"(%arg2, %[[J]]) : (memref<7xf64>, index) -> f64
        CHECK-NEXT:      "hextir.store"(%[[B]], %arg3, %[[I]], %[[J]])
        CHECK-LABEL: func.func public @relu_1(%arg0: memref<3x7xf64>, %arg1: memref<3x7xf64>)
        CHECK-SAME:      attributes {hextir.kernel = #hextir.kernel<"cpu", "relu">}
        CHECK-LABEL: func.func @main
        CHECK:         %[[W:.+]] = "hexir.constant"() {device = "cpu", name = "W"
        CHECK:         %[[BIAS:.+]] = "hexir.constant"() {device = "cpu", name = "b"
        CHECK:         %[[Y:.+]] = "hexir.call"(%arg0, %[[W]], %[[BIAS]]) {callee = @linear_0, device = "cpu", operandSegmentSizes = array<i32: 1, 1, 1>}
        CHECK-NEXT:    %[[R:.+]] = "hexir.call"(%[[Y]]) {callee = @relu_1, device = "cpu", operandSegmentSizes = array<i32: 1, 0, 0>}
        CHECK-NEXT:    "hexir.print"(%[[R]])
        CHECK-NEXT:    return %[[R]]
    """)


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


def test_relu_of_rank_3_is_parallel_over_the_first_axis_only():
    filecheck(lower(RELU.format(type="tensor<2x3x5xf64>"), "mlir-tir"), """
        CHECK-LABEL: func.func public @relu_0(%arg0: memref<2x3x5xf64>, %arg1: memref<2x3x5xf64>)
        CHECK:       scf.for %[[I:.+]] = %c0 to %c2 step %c1 {
        CHECK:         scf.for %[[J:.+]] = %c0 to %c3 step %c1 {
        CHECK:           scf.for %[[K:.+]] = %c0 to %c5 step %c1 {
        CHECK-NEXT:        "hextir.load"(%arg0, %[[I]], %[[J]], %[[K]])
        CHECK:             arith.maximumf
        CHECK-NEXT:        "hextir.store"(%{{.+}}, %arg1, %[[I]], %[[J]], %[[K]])
        CHECK-NEXT:      } {hextir.schedule = #hextir.loop<"serial", "">}
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
    filecheck(lower(LINEAR, "mlir-linalg"), """
        CHECK:       func.func public @linear_0(%arg0: memref<2x8xf32>, %arg1: memref<8x4xf32>, %arg2: memref<2x4xf32>, %[[FIRST:.+]]: index, %[[LAST:.+]]: index)
        CHECK-SAME:      attributes {hextir.kernel = #hextir.kernel<"cpu", "linear">, hextir.work_items = 2 : i64}
        CHECK:       scf.for %[[I:.+]] = %[[FIRST]] to %[[LAST]] step %c1 {
        CHECK:         memref.store %{{.+}}, %arg2[%[[I]], %{{.+}}] : memref<2x4xf32>
        CHECK:         memref.load %arg0[%[[I]], %{{.+}}] : memref<2x8xf32>
        CHECK:         memref.load %arg1[%{{.+}}, %{{.+}}] : memref<8x4xf32>
        CHECK-LABEL: func.func @main
    """)


def test_loops_leave_no_hextir_ops_or_schedules_in_cpu_kernels():
    filecheck(lower(LINEAR_BIAS_RELU, "mlir-linalg"), """
        CHECK-NOT: hextir.load
        CHECK-NOT: hextir.store
        CHECK-NOT: hextir.schedule
        CHECK:     func.func @main
    """)


@pytest.mark.parametrize("type_, items", [("tensor<6xf32>", 6), ("tensor<2x3x5xf64>", 2), ("tensor<1x9xf32>", 1)])
def test_work_items_is_the_outer_loop_trip_count(type_, items):
    filecheck(lower(RELU.format(type=type_), "mlir-linalg"), f"""
        CHECK: func.func public @relu_0(%arg0: memref<{type_[7:-1]}>, %arg1: memref<{type_[7:-1]}>, %arg2: index, %arg3: index)
        CHECK-SAME: hextir.work_items = {items} : i64
        CHECK: scf.for %{{{{.+}}}} = %arg2 to %arg3 step %c1
    """)


def test_kernel_without_an_outer_parallel_loop_is_refused():
    text = """
    func.func public @relu_0(%x: memref<4xf32>, %out: memref<4xf32>) attributes {hextir.kernel = #hextir.kernel<"cpu", "relu">} {
      %c0 = arith.constant 0 : index
      %c4 = arith.constant 4 : index
      %c1 = arith.constant 1 : index
      scf.for %i = %c0 to %c4 step %c1 {
        %v = "hextir.load"(%x, %i) : (memref<4xf32>, index) -> f32
        "hextir.store"(%v, %out, %i) : (f32, memref<4xf32>, index) -> ()
      } {hextir.schedule = #hextir.loop<"serial", "">}
      return
    }
    func.func @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
      %0 = "hexir.call"(%arg0) {callee = @relu_0, device = "cpu", operandSegmentSizes = array<i32: 1, 0, 0>} : (tensor<4xf32>) -> tensor<4xf32>
      return %0 : tensor<4xf32>
    }
    """
    with pytest.raises(CompileError, match=r"cpu kernel relu_0 needs exactly one outermost parallel loop, found 0"):
        lower(text, "mlir-linalg")


# ---- to-llvm -----------------------------------------------------------------------------

def test_llvm_kernel_takes_bare_pointers_and_a_work_range():
    filecheck(lower(LINEAR, "llvm"), """
        CHECK: define void @linear_0(ptr %0, ptr %1, ptr %2, i64 %3, i64 %4)
        CHECK: fmul float
        CHECK: fadd float
    """)


def test_llvm_has_one_function_per_kernel_and_no_host_program():
    filecheck(lower(LINEAR_BIAS_RELU, "llvm"), """
        CHECK:     define void @linear_0(ptr %0, ptr %1, ptr %2, ptr %3, i64 %4, i64 %5)
        CHECK:     fmul double
        CHECK:     define void @relu_1(ptr %0, ptr %1, i64 %2, i64 %3)
        CHECK:     @llvm.maximum.f64
        CHECK-NOT: @main
    """)


def test_llvm_of_a_graph_without_kernels_says_so():
    text = """
    func.func @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
      return %arg0 : tensor<4xf32>
    }
    """
    assert lower(text, "llvm") == "; no cpu kernels\n"
