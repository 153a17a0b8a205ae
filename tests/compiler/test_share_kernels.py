"""share-kernels (part of -emit=mlir-tir): op instances whose kernels are the same call one kernel.
(The relus are printed, so that they stay apart rather than fuse.)"""

from __future__ import annotations

import hexir_runtime
import numpy as np

import hexir
from hexir.target import Target

from .conftest import family_attrs, filecheck, lower, manifest

TWICE_AND_ANOTHER = """
func.func @main(%x: tensor<4x8xf32>, %y: tensor<8x4xf32>) -> tensor<8x4xf32> {
  %1 = "hexir.relu"(%x) {device = "cpu", RELU} : (tensor<4x8xf32>) -> tensor<4x8xf32>
  %2 = "hexir.relu"(%1) {device = "cpu", RELU} : (tensor<4x8xf32>) -> tensor<4x8xf32>
  %3 = "hexir.relu"(%y) {device = "cpu", RELU} : (tensor<8x4xf32>) -> tensor<8x4xf32>
  "hexir.print"(%1) : (tensor<4x8xf32>) -> ()
  "hexir.print"(%2) : (tensor<4x8xf32>) -> ()
  return %3 : tensor<8x4xf32>
}
""".replace("RELU", family_attrs("relu"))


def test_calls_of_the_same_kernel_call_the_first_and_its_copies_are_erased():
    ir_text = lower(TWICE_AND_ANOTHER, "mlir-tir", target=Target(cpu_levels=("x86-64-v3", "x86-64")))
    filecheck(ir_text, """
        CHECK: func.func public @relu_0(%{{.*}}: memref<4x8xf32>
        CHECK: func.func public @"relu_0@x86-64"(
        CHECK-NOT: @relu_1
        CHECK: func.func public @relu_2(%{{.*}}: memref<8x4xf32>
        CHECK: func.func public @"relu_2@x86-64"(
        CHECK: hexir.call"(%{{.*}}) {callee = @relu_0
        CHECK: hexir.call"(%{{.*}}) {callee = @relu_0
        CHECK: hexir.call"(%{{.*}}) {callee = @relu_2
    """)
    assert "relu_1" not in ir_text


W = np.linspace(-1, 1, 36, dtype=np.float32).reshape(6, 6)


def _layers(x):
    for i in range(3):  # three layers of the same shapes: one kernel, called three times
        x = hexir.relu(hexir.linear(x, W * (i + 1)))
    return x


def _want(x):
    for i in range(3):
        x = np.maximum(x @ (W * (i + 1)), 0)
    return x


def test_repeated_layers_compile_each_kernel_once_and_compute_the_same(tmp_path):
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(4, 6)
    path = hexir.export(_layers, tmp_path / "layers.hxb", x, target="cpu:x86-64")
    kernels = manifest(path.read_bytes())["kernels"]
    program = manifest(path.read_bytes())["entries"][0]["program"]
    calls = [step["kernel"] for step in program if step["op"] == "call"]
    assert len(kernels) == 1 and calls == [0, 0, 0]
    np.testing.assert_allclose(hexir_runtime.load(path, "cpu").main(x), _want(x), rtol=1e-5)


def test_cuda_kernels_share_with_their_cpu_twins(tmp_path):
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(4, 6)
    path = hexir.export(_layers, tmp_path / "layers.hxb", x, placement="*=cuda", target="cpu:x86-64,cuda:sm_90")
    read = manifest(path.read_bytes())
    (kernel,) = read["kernels"]
    assert kernel["device"] == "cuda" and kernel["cpu_fallback"]["symbol"] == kernel["name"] + "_cpu"
    assert [step["kernel"] for step in read["entries"][0]["program"] if step["op"] == "call"] == [0, 0, 0]
    np.testing.assert_allclose(hexir_runtime.load(path, "cpu").main(x), _want(x), rtol=1e-5)  # the twin, here


def test_kernels_over_differently_named_extents_are_not_shared():
    f = hexir.jit(lambda x, y: (hexir.relu(x), hexir.relu(y)), target="cpu:x86-64", cache=False)
    data = f.compile(hexir.TensorSpec(("batch", 4), "float32"), hexir.TensorSpec(("seq", 4), "float32"))
    assert [k["sizes"] for k in manifest(data)["kernels"]] == [["batch"], ["seq"]]
