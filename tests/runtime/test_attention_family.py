"""The `attention` family (#25): the reference device computes softmax(tree(q @ kᵀ, mask)) @ v
from the manifest (batch broadcast, a mask broadcast to the scores, a symbolic sequence, a row
masked whole is NaN as numpy's softmax makes it); a crafted kernel whose shapes or tree are not
attention's is refused at load, naming the field. Modules built by hand, as the compiler's
packager builds them (test_kernel_families.py's helpers)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hexir_runtime import HxbFormatError, load
from hexir_runtime import format as hxb
from test_kernel_families import A0, A1, generated, one_kernel, reference

F32 = "float32"
SCALED = ["add", ["mul", A0, ["const", 0.125]], A1]


def numpy_attention(q, k, v, mask, scale):
    scores = q.astype(np.float64) @ np.swapaxes(k, -1, -2) * scale + mask
    with np.errstate(invalid="ignore"):
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        return weights / weights.sum(-1, keepdims=True) @ v


@pytest.mark.parametrize("q, k, mask, out, sizes", [
    ([2, 3, 7, 16], [2, 3, 9, 16], [7, 9], [2, 3, 7, 16], {}),
    ([2, 1, 5, 8], [3, 300, 8], [2, 1, 1, 300], [2, 3, 5, 8], {}),        # heads broadcast, a padding mask
    (["b", 4, "s", 8], ["b", 4, "s", 8], ["s", "s"], ["b", 4, "s", 8], {"b": 2, "s": 260}),
])
def test_the_reference_computes_softmax_of_the_scores_times_v(modules, q, k, mask, out, sizes):
    v = k
    module = reference(modules, "attention", SCALED, [(q, F32), (k, F32), (v, F32), (mask, F32)], (out, F32))
    rng = np.random.default_rng(len(q))
    q_, k_, v_, mask_ = (rng.standard_normal([sizes.get(d, d) for d in s]).astype(F32) for s in (q, k, v, mask))
    if mask[-2] == 1:
        mask_[0, ..., 5:] = -np.inf  # batch index 0's keys past 5
    else:
        mask_[..., 0, :] = -np.inf  # the first row masked whole: NaN
    got = module.main(q_, k_, v_, mask_)
    want = numpy_attention(q_, k_, v_, mask_, 0.125)
    assert (np.isnan(got) == np.isnan(want)).all() and np.isnan(want).any() == (mask[-2] != 1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_without_a_mask_the_tree_reads_the_product_only(modules):
    module = reference(modules, "attention", ["mul", A0, ["const", 0.5]], [([3, 5, 4], F32), ([3, 6, 4], F32),
                                                                         ([3, 6, 2], F32)], ([3, 5, 2], F32))
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(s).astype(F32) for s in ((3, 5, 4), (3, 6, 4), (3, 6, 2)))
    np.testing.assert_allclose(module.main(q, k, v), numpy_attention(q, k, v, 0, 0.5), rtol=1e-5, atol=1e-6)


def test_no_keys_give_nan_rows_as_the_kernels_running_sums_do(modules):
    """A sequence of keys bound to 0 at run time: 0 / 0 in every row, not numpy's empty-max error."""
    module = reference(modules, "attention", ["mul", A0, ["const", 0.5]], [([2, 4], F32), (["s", 4], F32),
                                                                         (["s", 3], F32)], ([2, 3], F32))
    got = module.main(np.ones((2, 4), F32), np.ones((0, 4), F32), np.ones((0, 3), F32))
    assert got.shape == (2, 3) and np.isnan(got).all()


BASE = ([([2, 3, 4, 8], F32), ([3, 6, 8], F32), ([3, 6, 5], F32), ([4, 6], F32)], ([2, 3, 4, 5], F32))
REFUSED = {  # the kernel's args (q, k, v, mask, out) edited -> (field, part of the message)
    "head sizes differ": ({1: [3, 6, 7]}, "kernels[0].args", "attention expects q[..., Sq, D]"),
    "keys of v differ": ({2: [3, 5, 5]}, "kernels[0].args", "attention expects"),
    "out's rows": ({4: [2, 3, 5, 5]}, "kernels[0].args", "attention expects"),
    "batch not broadcasting": ({1: [2, 6, 8]}, "kernels[0].args", "attention expects"),
    "a symbolic head size": ({0: [2, 3, 4, "d"], 1: [3, 6, "d"]}, "kernels[0].args", "D, Dv static"),
    "a vector q": ({0: [8]}, "kernels[0].args", "attention expects"),
    "mask too big": ({3: [5, 6]}, "kernels[0].args[3].shape", "does not broadcast to the scores' [2, 3, 4, 6]"),
    "mixed dtypes": ({}, "kernels[0].args[2].dtype", "expected float32 like args[0]"),
    "a tree reading no such input": ({}, "kernels[0].expr[2][1]", "an arg index below 2"),
    "an infinite scale": ({}, "kernels[0].expr[2]", "finite"),
    "no out": ({}, "kernels[0].args", "at least 4 args"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_a_crafted_attention_kernel_is_refused(modules, name):
    shapes, field, text = REFUSED[name]
    manifest, blobs = copy.deepcopy(one_kernel(modules, "attention", SCALED, *BASE))
    kernel = manifest["kernels"][0]
    for arg, shape in shapes.items():
        kernel["args"][arg]["shape"] = shape
    if name == "mixed dtypes":
        kernel["args"][2]["dtype"] = "float64"
    if name == "a tree reading no such input":
        kernel["expr"] = ["add", A0, ["arg", 2]]
    if name == "an infinite scale":
        kernel["expr"] = ["mul", A0, ["const", 10**400]]  # (JSON has no inf: an int no float holds)
    if name == "no out":
        kernel["args"] = kernel["args"][:3]
        kernel["args"][-1]["access"] = "write"
    kernel["sizes"] = list(dict.fromkeys(d for arg in kernel["args"] for d in arg["shape"] if isinstance(d, str)))
    for arg, buffer in zip(kernel["args"], manifest["entries"][0]["buffers"], strict=False):
        buffer.update(shape=arg["shape"], dtype=arg["dtype"])  # (the entry agrees: only the kernel is wrong)
    with pytest.raises(HxbFormatError) as caught:
        hxb.encode(manifest, blobs)
    assert caught.value.field == field, str(caught.value)
    assert text in caught.value.reason, str(caught.value)


def test_the_base_is_valid(modules):
    hxb.decode(hxb.encode(*one_kernel(modules, "attention", SCALED, *BASE)))


def heads(h: int, d: int, at: int) -> dict:
    """q[b, h, s, d] of a buffer [b, s, W]: head j's row at column at + j * d."""
    return {"shape": ["b", h, "s", d], "axes": [[0, 1], [2, d], [1, 1], [2, 1]], "start": [0, 0, at]}


def strided(modules, views: dict, widths=(24, 24, 24, 8)):
    """attention of q, k, v read from one buffer a0[b, s, 24] (heads of 4 at columns 0, 8, 16, or
    `views`), out written as [b, s, 8]: the compiler's view of a transformer's qkv."""
    builder = modules.Builder()
    specs = [(["b", "s", w], F32) for w in widths]
    kernel = generated(builder, "attention", ["mul", A0, ["const", 0.5]], specs)
    for arg, view in views.items():
        builder.kernels[kernel]["args"][arg]["view"] = view
    entry = builder.entry()
    qkv = entry.input("a0", ["b", "s", 24], F32)
    entry.ret(entry.call(kernel, qkv, qkv, qkv))
    return builder.build()


VIEWS = {0: heads(2, 4, 0), 1: heads(2, 4, 8), 2: heads(2, 4, 16), 3: heads(2, 4, 0)}


def test_the_reference_reads_q_k_v_and_writes_out_through_strided_views(modules):
    module = load(hxb.encode(*strided(modules, VIEWS)), "reference")
    qkv = np.random.default_rng(3).standard_normal((2, 5, 24)).astype(F32)
    q, k, v = (qkv[..., j * 8:(j + 1) * 8].reshape(2, 5, 2, 4).transpose(0, 2, 1, 3) for j in range(3))
    want = numpy_attention(q, k, v, 0, 0.5).transpose(0, 2, 1, 3).reshape(2, 5, 8)
    np.testing.assert_allclose(module.main(qkv), want, rtol=1e-5, atol=1e-6)


BAD_VIEWS = {  # arg -> view, the field, part of the message
    "past the row": ({1: heads(2, 4, 20)}, "kernels[0].args[1].view.axes", "reaches past axis 2"),
    "a symbol from elsewhere": ({0: {**heads(2, 4, 0), "start": [0, 1, 0]}}, "kernels[0].args[0].view.axes",
                                "reaches past axis 1"),
    "a static axis over a symbol": ({0: {**heads(2, 4, 0), "shape": [2, 2, "s", 4]}}, "kernels[0].args[0].view.axes",
                                    "reaches past axis 0"),
    "the last axis strided": ({0: {**heads(2, 4, 0), "axes": [[0, 1], [2, 4], [1, 1], [2, 2]]}},
                              "kernels[0].args[0].view", "the last [2, 1]"),
    "no such buffer axis": ({0: {**heads(2, 4, 0), "axes": [[0, 1], [3, 4], [1, 1], [2, 1]]}},
                            "kernels[0].args[0].view", "an [axis, step] per axis"),
    "a start missing": ({2: {**heads(2, 4, 0), "start": [0, 0]}}, "kernels[0].args[2].view", "a start per axis"),
    "a negative start": ({2: {**heads(2, 4, 0), "start": [0, 0, -1]}}, "kernels[0].args[2].view.start[2]",
                         "expected an integer >= 0"),
    "out written twice": ({3: {**heads(2, 4, 0), "axes": [[0, 1], [2, 2], [1, 1], [2, 1]]}},
                          "kernels[0].args[3].view.axes", "writes twice to axis 2"),
    "out written in part": ({3: heads(1, 4, 0)}, "kernels[0].args[3].view.shape", "leaves elements of its buffer"),
    "the mask strided": ({}, "kernels[0].args[3].view", "expected an array"),  # (a reshape's, if any)
    "the view not attention's": ({0: {**heads(2, 4, 0), "shape": ["b", 2, "s", 5]}}, "kernels[0].args",
                                 "attention expects"),
}


@pytest.mark.parametrize("name", BAD_VIEWS)
def test_a_crafted_strided_view_is_refused(modules, name):
    views, field, text = BAD_VIEWS[name]
    manifest, blobs = strided(modules, {**VIEWS, **views})
    if name == "the mask strided":  # (q, k, v, mask, out: a view on the mask, the one arg that has none)
        args = manifest["kernels"][0]["args"]
        args.insert(3, {**args[0], "view": heads(2, 4, 0)})
    with pytest.raises(HxbFormatError) as caught:
        hxb.encode(manifest, blobs)
    assert caught.value.field == field, str(caught.value)
    assert text in caught.value.reason, str(caught.value)


def test_a_view_the_cuda_kernel_cannot_copy_16_bytes_at_a_time_is_named():
    """The cuda device refuses (at load, before a launch could fault) a strided view whose rows
    do not start on 16 bytes; the format itself accepts it (the cpu reads it in place)."""
    from hexir_runtime.format.attention import misaligned_view
    from hexir_runtime.format.types import TensorType

    buffer = TensorType(("b", "s", 24), F32)
    def view(spec):
        return hxb.attention.check_view(spec, buffer, "view", False)
    assert misaligned_view((buffer,) * 3, tuple(view(heads(2, 4, at)) for at in (0, 8, 16))) is None
    shifted = view(heads(2, 4, 2))  # (inside its buffer: columns 2-9)
    assert "args[1]: its view's rows do not all start on 16 bytes (start [0, 0, 2]" in \
        misaligned_view((buffer,) * 2, (view(heads(2, 4, 0)), shifted))
    narrow = TensorType(("b", "s", 18), F32)  # (rows of 72 bytes)
    assert "args[0]" in misaligned_view((narrow,), (hxb.attention.check_view(heads(2, 4, 0), narrow, "view", False),))
    assert "args[0]" in misaligned_view((buffer,), (view(heads(3, 2, 0)),))  # (heads 8 bytes apart)
