"""partition (-emit=mlir-hetero): every op gets a device, values crossing devices get a transfer.

CUDA code generation is still in progress, so cuda placements are only compiled this far."""

# IR lines are checked as printed: wrapping them would change what they check.
# ruff: noqa: E501

from __future__ import annotations

import pytest

from hexir.driver import parse_placement
from hexir.errors import PlacementError

from .conftest import family_attrs, filecheck, lower, manifest

RELU = family_attrs("relu")

# x -> linear(x, W) -> relu -> print, return; the devices are filled in per test
MLP = """
func.func @main(%arg0: tensor<2x8xf32>) -> tensor<2x4xf32> {{
  %0 = "hexir.constant"() {{device = "auto", name = "W", value = dense<0.5> : tensor<8x4xf32>}} : () -> tensor<8x4xf32>
  %1 = "hexir.linear"(%arg0, %0) {{device = "{linear}", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>}} : (tensor<2x8xf32>, tensor<8x4xf32>) -> tensor<2x4xf32>
  %2 = "hexir.relu"(%1) {{device = "{relu}", """ + RELU.replace("{", "{{").replace("}", "}}") + """}} : (tensor<2x4xf32>) -> tensor<2x4xf32>
  "hexir.print"(%2) : (tensor<2x4xf32>) -> ()
  return %2 : tensor<2x4xf32>
}}
"""


def test_auto_defaults_to_cpu_without_transfers():
    filecheck(lower(MLP.format(linear="auto", relu="auto"), "mlir-hetero"), """
        CHECK:     "hexir.constant"() {device = "cpu", name = "W"
        CHECK:     "hexir.linear"(%arg0, %{{.+}}) {device = "cpu", operandSegmentSizes = array<i32: 1, 1,
        CHECK-SAME: 0, 0, 0, 0>}
        CHECK:     "hexir.relu"(%{{.+}}) {device = "cpu", expr = "
        CHECK-NOT: hexir.transfer
        CHECK-NOT: "auto"
    """)


def test_device_from_on_block_is_kept_and_transfers_are_inserted():
    filecheck(lower(MLP.format(linear="cuda", relu="cuda"), "mlir-hetero"), """
        CHECK:      %[[W:.+]] = "hexir.constant"() {device = "cuda", name = "W"
        CHECK-NEXT: %[[X:.+]] = "hexir.transfer"(%arg0) {source = "cpu", target = "cuda"} : (tensor<2x8xf32>) -> tensor<2x8xf32>
        CHECK-NEXT: %[[Y:.+]] = "hexir.linear"(%[[X]], %[[W]]) {device = "cuda", operandSegmentSizes = array<i32: 1, 1,
        CHECK-SAME: 0, 0, 0, 0>}
        CHECK-NEXT: %[[R:.+]] = "hexir.relu"(%[[Y]]) {device = "cuda", expr = "
        CHECK-NEXT: %[[BACK:.+]] = "hexir.transfer"(%[[R]]) {source = "cuda", target = "cpu"}
        CHECK-NEXT: "hexir.print"(%[[BACK]])
        CHECK-NEXT: return %[[BACK]] : tensor<2x4xf32>
    """)


def test_split_placement_transfers_between_the_ops():
    filecheck(lower(MLP.format(linear="cuda", relu="cpu"), "mlir-hetero"), """
        CHECK:      %[[W:.+]] = "hexir.constant"() {device = "cuda"
        CHECK-NEXT: %[[X:.+]] = "hexir.transfer"(%arg0) {source = "cpu", target = "cuda"}
        CHECK-NEXT: %[[Y:.+]] = "hexir.linear"(%[[X]], %[[W]]) {device = "cuda", operandSegmentSizes = array<i32: 1, 1,
        CHECK-SAME: 0, 0, 0, 0>}
        CHECK-NEXT: %[[YH:.+]] = "hexir.transfer"(%[[Y]]) {source = "cuda", target = "cpu"}
        CHECK-NEXT: %[[R:.+]] = "hexir.relu"(%[[YH]]) {device = "cpu", expr = "
        CHECK-NEXT: "hexir.print"(%[[R]])
        CHECK-NEXT: return %[[R]]
    """)


def test_placement_option_overrides_the_op_device():
    text = lower(MLP.format(linear="cuda", relu="cuda"), "mlir-hetero", placement=parse_placement("hexir.linear=cpu"))
    filecheck(text, """
        CHECK:      %[[W:.+]] = "hexir.constant"() {device = "cpu"
        CHECK-NEXT: %[[Y:.+]] = "hexir.linear"(%arg0, %[[W]]) {device = "cpu", operandSegmentSizes = array<i32: 1, 1,
        CHECK-SAME: 0, 0, 0, 0>}
        CHECK-NEXT: %[[YD:.+]] = "hexir.transfer"(%[[Y]]) {source = "cpu", target = "cuda"}
        CHECK-NEXT: %[[R:.+]] = "hexir.relu"(%[[YD]]) {device = "cuda", expr = "
        CHECK-NEXT: %[[RH:.+]] = "hexir.transfer"(%[[R]]) {source = "cuda", target = "cpu"}
    """)


def test_placement_option_moves_auto_ops_to_cuda():
    text = lower(MLP.format(linear="auto", relu="auto"), "mlir-hetero",
                 placement=parse_placement("hexir.linear=cuda,hexir.relu=cuda"))
    filecheck(text, """
        CHECK: "hexir.linear"(%{{.+}}, %{{.+}}) {device = "cuda", operandSegmentSizes = array<i32: 1, 1,
        CHECK-SAME: 0, 0, 0, 0>}
        CHECK: "hexir.relu"(%{{.+}}) {device = "cuda", expr = "
    """)


def test_constant_shared_by_two_devices_gets_a_copy_on_each():
    text = """
    func.func @main(%arg0: tensor<2x8xf32>) -> (tensor<2x4xf32>, tensor<2x4xf32>) {
      %0 = "hexir.constant"() {device = "auto", name = "W", value = dense<0.5> : tensor<8x4xf32>} : () -> tensor<8x4xf32>
      %1 = "hexir.linear"(%arg0, %0) {device = "cpu", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>} : (tensor<2x8xf32>, tensor<8x4xf32>) -> tensor<2x4xf32>
      %2 = "hexir.linear"(%arg0, %0) {device = "cuda", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>} : (tensor<2x8xf32>, tensor<8x4xf32>) -> tensor<2x4xf32>
      return %1, %2 : tensor<2x4xf32>, tensor<2x4xf32>
    }
    """
    # no weight crosses devices on each call: each device has its own copy (one blob, one upload)
    filecheck(lower(text, "mlir-hetero"), """
        CHECK:      %[[WD:.+]] = "hexir.constant"() {device = "cuda", name = "W"
        CHECK-NEXT: %[[W:.+]] = "hexir.constant"() {device = "cpu", name = "W"
        CHECK-NEXT: %[[A:.+]] = "hexir.linear"(%arg0, %[[W]]) {device = "cpu", operandSegmentSizes = array<i32: 1, 1,
        CHECK-SAME: 0, 0, 0, 0>}
        CHECK-NEXT: %[[X:.+]] = "hexir.transfer"(%arg0) {source = "cpu", target = "cuda"}
        CHECK-NEXT: %[[B:.+]] = "hexir.linear"(%[[X]], %[[WD]]) {device = "cuda", operandSegmentSizes = array<i32: 1, 1,
        CHECK-SAME: 0, 0, 0, 0>}
        CHECK-NEXT: %[[BH:.+]] = "hexir.transfer"(%[[B]]) {source = "cuda", target = "cpu"}
        CHECK-NEXT: return %[[A]], %[[BH]]
        CHECK-NOT: hexir.transfer
    """)
    blobs = manifest(lower(text, "hxb"))
    assert [c["name"] for c in blobs["constants"]] == ["W"]  # the two copies share one stored weight


def test_one_transfer_serves_every_user_on_a_device():
    text = """
    func.func @main(%arg0: tensor<4x4xf32>) -> tensor<4x4xf32> {
      %1 = "hexir.relu"(%arg0) {device = "cuda", RELU} : (tensor<4x4xf32>) -> tensor<4x4xf32>
      %2 = "hexir.linear"(%arg0, %1) {device = "cuda", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>} : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
      %3 = "hexir.linear"(%2, %2) {device = "cuda", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>} : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
      "hexir.print"(%3) : (tensor<4x4xf32>) -> ()
      return %3 : tensor<4x4xf32>
    }
    """
    filecheck(lower(text.replace("RELU", RELU), "mlir-hetero"), """
        CHECK:      %[[X:.+]] = "hexir.transfer"(%arg0) {source = "cpu", target = "cuda"}
        CHECK-NOT:  hexir.transfer
        CHECK:      %[[R:.+]] = "hexir.relu"(%[[X]])
        CHECK-NOT:  hexir.transfer
        CHECK:      %[[Y:.+]] = "hexir.linear"(%[[X]], %[[R]])
        CHECK-NOT:  hexir.transfer
        CHECK:      %[[Z:.+]] = "hexir.linear"(%[[Y]], %[[Y]])
        CHECK-NEXT: %[[ZH:.+]] = "hexir.transfer"(%[[Z]]) {source = "cuda", target = "cpu"}
        CHECK-NEXT: "hexir.print"(%[[ZH]])
        CHECK-NEXT: return %[[ZH]]
    """)


def test_function_argument_returned_directly_needs_no_transfer():
    text = """
    func.func @main(%arg0: tensor<3xf64>) -> tensor<3xf64> {
      "hexir.print"(%arg0) : (tensor<3xf64>) -> ()
      return %arg0 : tensor<3xf64>
    }
    """
    filecheck(lower(text, "mlir-hetero"), """
        CHECK:     "hexir.print"(%arg0)
        CHECK-NOT: hexir.transfer
        CHECK:     return %arg0
    """)


@pytest.mark.parametrize("text, message", [
    ("hexir.conv=cuda", r"placement: unknown op 'hexir.conv'; placeable ops are \* \(all\) and hexir.linear, "),
    ("hexir.print=cuda", r"placement: unknown op 'hexir.print'"),
    ("hexir.linear=tpu", r"placement: unknown device 'tpu' for hexir.linear; expected one of cpu, cuda"),
    ("hexir.linear=auto", r"placement: unknown device 'auto' for hexir.linear"),
    ("hexir.linear", r"placement: unknown device None for hexir.linear"),
])
def test_bad_placement_is_a_placement_error(text, message):
    with pytest.raises(PlacementError, match=message):
        parse_placement(text)


def test_placement_text_and_dict_agree():
    assert parse_placement("hexir.relu=cpu, hexir.linear=cuda") == parse_placement(
        {"hexir.linear": "cuda", "hexir.relu": "cpu"}) == (("hexir.linear", "cuda"), ("hexir.relu", "cpu"))


def test_partitioning_a_cpu_graph_twice_changes_nothing():
    once = lower(MLP.format(linear="auto", relu="auto"), "mlir-hetero")
    assert lower(once, "mlir-hetero") == once


def test_partitioning_a_split_graph_twice_changes_nothing():
    once = lower(MLP.format(linear="cuda", relu="cpu"), "mlir-hetero")
    assert lower(once, "mlir-hetero") == once
