"""The `matmul` family (#24): the reference device computes numpy's a @ b (batch broadcast,
1-D operands) and its epilogue tree from the manifest; a crafted kernel whose shapes are not
numpy's matmul shapes is refused at load, naming the field. Modules built by hand, as the
compiler's packager builds them (test_kernel_families.py's helpers)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hexir_runtime import HxbFormatError
from hexir_runtime import format as hxb
from test_kernel_families import A0, A1, one_kernel, reference

F32 = "float32"


@pytest.mark.parametrize("a, b, out", [
    ([2, 1, 5, 8], [3, 8, 6], [2, 3, 5, 6]), (["n", 4, 3], [3, 2], ["n", 4, 2]), ([7], [2, 7, 3], [2, 3]),
    ([2, 4, 7], [7], [2, 4]), ([1, 9], [9, 1], [1, 1]),
])
def test_the_reference_computes_numpys_matmul(modules, a, b, out):
    module = reference(modules, "matmul", A0, [(a, F32), (b, F32)], (out, F32))
    rng = np.random.default_rng(len(a) * 10 + len(b))
    x, y = (rng.standard_normal([3 if d == "n" else d for d in shape]).astype(F32) for shape in (a, b))
    np.testing.assert_allclose(module.main(x, y), np.matmul(x, y), rtol=1e-5, atol=1e-6)


def test_the_epilogue_reads_its_inputs_broadcast_to_the_product(modules):
    tree = ["add", ["mul", A0, ["const", 0.25]], A1]  # (q @ kT) * 0.25 + mask
    module = reference(modules, "matmul", tree, [([2, 3, 4, 5], F32), ([2, 3, 5, 4], F32), ([4, 4], F32)],
                       ([2, 3, 4, 4], F32))
    rng = np.random.default_rng(3)
    q, kt, mask = (rng.standard_normal(s).astype(F32) for s in ((2, 3, 4, 5), (2, 3, 5, 4), (4, 4)))
    np.testing.assert_allclose(module.main(q, kt, mask), q @ kt * 0.25 + mask, rtol=1e-5, atol=1e-6)


BASE = ([([2, 3, 4, 5], F32), ([3, 5, 6], F32), ([4, 6], F32)], ([2, 3, 4, 6], F32))
REFUSED = {  # the kernel's args (a, b, mask, out) edited -> (field, part of the message)
    "inner dimensions": ({1: [3, 4, 6]}, "kernels[0].args", "numpy's matmul shapes"),
    "batch not broadcasting": ({1: [2, 5, 6]}, "kernels[0].args", "matmul expects a[..., M, K], b[..., K, N]"),
    "out of another shape": ({2: [1, 7], 3: [2, 3, 4, 7]}, "kernels[0].args", "(here [2, 3, 4, 6])"),
    "out missing the batch": ({3: [4, 6]}, "kernels[0].args", "numpy's matmul shapes"),
    "a symbol for a number": ({3: ["n", 3, 4, 6]}, "kernels[0].args", "numpy's matmul shapes"),
    "two vectors": ({0: [5], 1: [5], 2: [1], 3: [1]}, "kernels[0].args", "numpy's matmul shapes"),
    "a scalar operand": ({0: []}, "kernels[0].args", "numpy's matmul shapes"),
    "epilogue too big": ({2: [5, 4, 6]}, "kernels[0].args[2].shape", "does not broadcast to out's shape"),
    "mixed dtypes": ({}, "kernels[0].args[1].dtype", "expected float32 like args[0]"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_a_crafted_matmul_with_inconsistent_shapes_is_refused(modules, name):
    shapes, field, text = REFUSED[name]
    manifest, blobs = copy.deepcopy(one_kernel(modules, "matmul", ["add", A0, A1], *BASE))
    kernel = manifest["kernels"][0]
    for arg, shape in shapes.items():
        kernel["args"][arg]["shape"] = shape
    if name == "mixed dtypes":
        kernel["args"][1]["dtype"] = "float64"
    kernel["sizes"] = list(dict.fromkeys(d for arg in kernel["args"] for d in arg["shape"] if isinstance(d, str)))
    for arg, buffer in zip(kernel["args"], manifest["entries"][0]["buffers"], strict=False):
        buffer.update(shape=arg["shape"], dtype=arg["dtype"])  # (the entry agrees: only the kernel is wrong)
    with pytest.raises(HxbFormatError) as caught:
        hxb.encode(manifest, blobs)
    assert caught.value.field == field, str(caught.value)
    assert text in caught.value.reason, str(caught.value)


def test_the_base_is_valid(modules):
    hxb.decode(hxb.encode(*one_kernel(modules, "matmul", ["add", A0, A1], *BASE)))
