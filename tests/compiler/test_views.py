"""Free reshapes: a reshape whose users are all generated kernels on its device is no kernel;
each user reads the reshape's source in place as its `view` (the manifest's), on the cpu, the
cuda kernels' cpu twins and the reference device alike; a crafted view is refused."""

from __future__ import annotations

import json

import hexir_runtime
import numpy as np
import pytest
from hexir_runtime import HxbFormatError
from hexir_runtime.format import decode, encode

import hexir
from hexir import TensorSpec

RNG = np.random.default_rng(7)
W = RNG.standard_normal((16, 48)).astype(np.float32)


def heads(x):
    batch, seq, _ = x.shape
    q = hexir.linear(x, W)[..., :16].reshape(batch, seq, 4, 4)
    y = (q * 2.0).reshape(batch, seq, 16)              # returned: a copy kernel of its own
    return hexir.softmax(y.reshape(batch, seq, 4, 4)), y  # the softmax reads y in place


def expected(x):
    q = (x @ W)[..., :16].reshape(*x.shape[:2], 4, 4) * 2.0
    e = np.exp(q - q.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True), q.reshape(*x.shape[:2], 16)


@pytest.mark.parametrize("placement", [None, "*=cuda"])
def test_a_reshape_read_by_kernels_is_no_kernel_and_each_reads_its_view(placement):
    data = hexir.jit(heads, placement=placement).compile(TensorSpec(("batch", "seq", 16), "float32"))
    kernels = [k for k in decode(data).manifest.kernels if not k.name.endswith("_cpu")]
    assert [k.name.split("_")[0] for k in kernels] == ["linear", "slice", "mul", "reshape", "softmax"]
    views = {k.name.split("_")[0]: [str(v) for v in k.views if v] for k in kernels}
    assert views["mul"] == views["softmax"] == ["float32[batch, seq, 4, 4]"]
    for device in ("cpu", "reference"):
        module = hexir_runtime.load(data, device)
        for shape in [(2, 3, 16), (1, 1, 16), (3, 0, 16)]:
            x = RNG.standard_normal(shape).astype(np.float32)
            for got, want in zip(module.main(x), expected(x), strict=True):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("view", "reason"), [
    (["seq", "batch", 4, 4], "is no reshape of"),
    (["batch", "seq", 4, 5], "is no reshape of"),
    (["batch", "seq", "heads", 4], "is no reshape of"),
])
def test_a_crafted_view_is_refused(view, reason):
    read = decode(hexir.jit(heads).compile(TensorSpec(("batch", "seq", 16), "float32")))
    blobs = [(b["name"], bytes(read.blob(i))) for i, b in enumerate(read.json["blobs"])]
    crafted = {k: v for k, v in json.loads(json.dumps(read.json)).items() if k != "blobs"}
    arg = next(a for k in crafted["kernels"] for a in k["args"] if "view" in a)
    arg["view"], good = view, arg["view"]
    with pytest.raises(HxbFormatError, match=reason):
        encode(crafted, blobs)
    arg["view"] = good
    out = next(k for k in crafted["kernels"] if any("view" in a for a in k["args"]))["args"][-1]
    out["view"] = out["shape"]
    with pytest.raises(HxbFormatError, match="only a generated kernel's inputs have a view"):
        encode(crafted, blobs)
