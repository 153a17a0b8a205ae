"""Fused attention (#25 target 2): `softmax(q @ k.transpose(..) * scale + mask) @ v` becomes one
`attention` op and kernel (passes/attention.py), checked on the fused IR and the kernels built;
what must stay three kernels stays so; end to end against numpy (float64) at sequences 1, 7, 129
and 300 of one module (the sequence symbolic), head sizes 64, 128 and 40, with and without a
mask, a row masked whole (NaN, as the unfused softmax gives), on the cpu kernel and on the cuda
kernel's cpu twin (placement "*=cuda"); the cuda kernel itself is compiled to CUBIN here and run
by the GPU suite (tests/gpu/)."""

from __future__ import annotations

import numpy as np
import pytest
from hexir_runtime import format as hxb
from hexir_runtime import load

import hexir
from hexir import TensorSpec
from hexir.driver import Options, parse_placement, run_stage
from hexir.jit import JitFunction
from hexir.passes.fuse import fuse
from hexir.schedules import cuda_attention
from hexir.target import parse_target

from .conftest import filecheck

RNG = np.random.default_rng(25)


def _options(device: str) -> Options:
    return Options(placement=parse_placement("*=cuda" if device == "cuda" else None),
                   target=parse_target("cpu:host,cuda:sm_90" if device == "cuda" else "cpu:host"))


def _fused(function, specs, device="cpu") -> str:
    """The printed graph after partition and fuse."""
    module = run_stage(JitFunction(function, _options(device)).trace(*specs), "mlir-hetero", _options(device))
    with module.context:
        fuse(module)
        assert module.operation.verify()
    return str(module)


def _compile(function, specs, device):
    data = JitFunction(function, _options(device)).compile(*specs)
    return load(data, "cpu"), [k for k in hxb.decode(data).json["kernels"] if not k["name"].endswith("_cpu")]


def attention(q, k, v, mask):
    return hexir.softmax(q @ k.transpose(0, 1, 3, 2) * 0.125 + mask, axis=-1) @ v


def numpy_attention(q, k, v, mask, scale):
    scores = q.astype(np.float64) @ np.swapaxes(k, -1, -2) * scale + mask
    with np.errstate(invalid="ignore"):
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        return weights / weights.sum(-1, keepdims=True) @ v


SPECS = [TensorSpec(s, "float32") for s in ((2, 4, "seq", 16), (2, 4, "seq", 16), (2, 4, "seq", 16), ("seq", "seq"))]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_users_attention_is_one_op_reading_k_untransposed(device):
    names = {"Q": "%arg0", "K": "%arg1", "V": "%arg2", "M": "%arg3"}
    if device == "cuda":  # (each argument is transferred first)
        operands = "\n".join(f'CHECK-DAG: %[[{n}:[0-9]+]] = "hexir.transfer"({a})' for n, a in names.items())
    else:
        operands = ("CHECK: func.func @main(%[[Q:arg0]]: {{.+}}, %[[K:arg1]]: {{.+}}, %[[V:arg2]]: {{.+}}, "
                    "%[[M:arg3]]:")
    filecheck(_fused(attention, SPECS, device), f"""
        {operands}
        CHECK-NOT:  hexir.transpose
        CHECK:      "hexir.attention"(%[[Q]], %[[K]], %[[V]], %[[M]]) {{device = "{device}", hexir.epilogue = "[\\22add\\22,[\\22mul\\22,[\\22arg\\22,0],[\\22const\\22,0.125]],[\\22arg\\22,1]]"}}
        CHECK-NOT:  hexir.matmul
        CHECK-NOT:  hexir.softmax
    """)  # noqa: E501


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_kernel_records_q_k_v_the_mask_and_the_scores_tree(device):
    _, kernels = _compile(attention, SPECS, device)
    assert [(k["op"], k["device"], k["sizes"]) for k in kernels] == [("attention", device, ["seq"])]
    (kernel,) = kernels
    assert [a["shape"] for a in kernel["args"]] == [[2, 4, "seq", 16]] * 3 + [["seq", "seq"], [2, 4, "seq", 16]]
    assert kernel["expr"] == ["add", ["mul", ["arg", 0], ["const", 0.125]], ["arg", 1]]
    if device == "cuda":  # a block of 16 x 16 threads per 128 query rows of a batch index (8 a thread)
        assert kernel["launch"]["grid"] == [["mul", 8, ["ceildiv", "seq", 128]], 1, 1]
        assert kernel["launch"]["block"] == [16, 16, 1]


def _scores_returned(q, k, v, mask):
    scores = q @ k.transpose(0, 1, 3, 2) * 0.125 + mask
    return hexir.softmax(scores) @ v, scores


def _weights_returned(q, k, v, mask):
    weights = hexir.softmax(q @ k.transpose(0, 1, 3, 2) + mask)
    return weights @ v, weights


UNFUSED = {  # name -> function of (q, k, v, mask): each keeps its matmuls and its softmax
    "the scores also returned": _scores_returned,
    "the weights also returned": _weights_returned,
    "kT given, not a transpose": lambda q, k, v, mask: hexir.softmax(q @ hexir.reshape(k, (2, 4, 16, -1))) @ v,
    "a softmax over the queries": lambda q, k, v, mask: hexir.softmax(q @ k.transpose(0, 1, 3, 2), axis=-2) @ v,
    "two epilogue inputs": lambda q, k, v, mask: hexir.softmax(q @ k.transpose(0, 1, 3, 2) + mask + mask * 2) @ v,
    "a log_softmax": lambda q, k, v, mask: hexir.log_softmax(q @ k.transpose(0, 1, 3, 2)) @ v,
    "an epilogue after @ v": lambda q, k, v, mask: (hexir.softmax(q @ k.transpose(0, 1, 3, 2)) @ v) * 2,
}


@pytest.mark.parametrize("name", UNFUSED)
def test_what_is_not_the_pattern_stays_unfused(name):
    specs = [TensorSpec(s, "float32") for s in ((2, 4, 9, 16),) * 3 + ((9, 9),)]
    printed = _fused(UNFUSED[name], specs)
    assert "hexir.attention" not in printed and printed.count("hexir.matmul") == 2, printed


def test_a_head_past_256_stays_unfused():
    specs = [TensorSpec(s, "float32") for s in ((2, 9, 16), (2, 9, 16), (2, 9, 300))]
    printed = _fused(lambda q, k, v: hexir.softmax(q @ k.transpose(0, 2, 1)) @ v, specs)
    assert "hexir.attention" not in printed and printed.count("hexir.matmul") == 2, printed


def test_a_transpose_used_elsewhere_stays_for_its_other_user():
    def both(q, k, v, mask):
        kt = k.transpose(0, 1, 3, 2)
        return hexir.softmax(q @ kt + mask) @ v, kt * 2

    printed = _fused(both, [TensorSpec(s, "float32") for s in ((2, 4, 9, 16),) * 3 + ((9, 9),)])
    assert printed.count("hexir.attention") == 1 and printed.count("hexir.transpose") == 1


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("d, masked", [(64, True), (64, False), (128, True), (40, False)])
def test_attention_is_numpys_at_any_sequence(device, d, masked):
    """One module (the sequence symbolic) at 1, 7, 129 and 300; a masked row whole is NaN."""
    def function(q, k, v, mask=None):
        scores = q @ k.transpose(0, 1, 3, 2) * (1 / np.sqrt(d))
        return hexir.softmax(scores if mask is None else scores + mask, axis=-1) @ v

    shapes = [(2, 3, "seq", d)] * 3 + ([("seq", "seq")] if masked else [])
    module, kernels = _compile(function, [TensorSpec(s, "float32") for s in shapes], device)
    assert [k["op"] for k in kernels] == ["attention"]
    for seq in (1, 7, 129, 300):
        q, k, v = (RNG.standard_normal((2, 3, seq, d)).astype(np.float32) for _ in range(3))
        mask = np.triu(np.full((seq, seq), -np.inf, np.float32), k=1)
        if seq > 2:
            mask[1] = -np.inf
        got = module.main(q, k, v, *([mask] if masked else []))
        want = numpy_attention(q, k, v, mask if masked else 0, 1 / np.sqrt(d))
        assert (np.isnan(got) == np.isnan(want)).all() and np.isnan(want).any() == (masked and seq > 2)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_float64_batch_and_heads_broadcast_and_a_padding_mask(device):
    """q of one head against k and v of 3, a mask per batch index broadcast over heads and rows."""
    shapes = [(2, 1, 5, 24), (3, 70, 24), (3, 70, 8), (2, 1, 1, 70)]

    def function(q, k, v, mask):
        return hexir.softmax(mask + q @ k.transpose(0, 2, 1) / 4.0) @ v

    module, kernels = _compile(function, [TensorSpec(s, "float64") for s in shapes], device)
    assert [k["op"] for k in kernels] == ["attention"]
    q, k, v = (RNG.standard_normal(s) for s in shapes[:3])
    mask = np.zeros(shapes[3])
    mask[0, ..., 40:] = -1e9
    np.testing.assert_allclose(module.main(q, k, v, mask), numpy_attention(q, k, v, mask, 0.25), rtol=1e-12,
                               atol=1e-13)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_heads_of_a_qkv_are_read_and_the_result_written_in_place(device):
    """A transformer's q, k, v (slices of qkv[b, s, 3 h d], split into heads, transposed) and its
    result (transposed back, heads merged) become strided views of qkv and of the [b, s, h d]
    result (#25): one kernel, no copy, numpy's answer at any batch and sequence."""
    heads, head = 3, 8
    width = heads * head

    def block(qkv, mask):
        batch, seq, _ = qkv.shape
        q, k, v = (qkv[..., j * width:(j + 1) * width].reshape(batch, seq, heads, head).transpose(0, 2, 1, 3)
                   for j in range(3))
        attended = hexir.softmax(q @ k.transpose(0, 1, 3, 2) * 0.5 + mask, axis=-1) @ v
        return attended.transpose(0, 2, 1, 3).reshape(batch, seq, width) * 2

    specs = [TensorSpec(("batch", "seq", 3 * width), "float32"), TensorSpec(("seq", "seq"), "float32")]
    filecheck(_fused(block, specs, device), """
        CHECK-NOT: hexir.transpose
        CHECK: "hexir.attention"([[QKV:%[a-z0-9]+]], [[QKV]], [[QKV]], %{{[a-z0-9]+}})
        CHECK-SAME: \\22axes\\22:{{\\[\\[0,1\\],\\[2,8\\],\\[1,1\\],\\[2,1\\]\\]}},\\22start\\22:{{\\[}}0,0,24]}
        CHECK-SAME: tensor<?x?x24xf32, "batch,seq">
        CHECK-NOT: hexir.transpose
        CHECK-NOT: hexir.reshape
        CHECK-NOT: hexir.slice
    """)
    module, kernels = _compile(block, specs, device)
    assert [k["op"] for k in kernels] == ["attention", "pointwise"]
    assert kernels[0]["args"][1]["view"] == {"shape": ["batch", heads, "seq", head], "start": [0, 0, width],
                                             "axes": [[0, 1], [2, head], [1, 1], [2, 1]]}
    for batch, seq in ((2, 7), (1, 70)):
        qkv = RNG.standard_normal((batch, seq, 3 * width)).astype(np.float32)
        mask = np.triu(np.full((seq, seq), -np.inf, np.float32), k=1)
        q, k, v = (qkv[..., j * width:(j + 1) * width].reshape(batch, seq, heads, head).transpose(0, 2, 1, 3)
                   for j in range(3))
        want = numpy_attention(q, k, v, mask, 0.5).transpose(0, 2, 1, 3).reshape(batch, seq, width) * 2
        np.testing.assert_allclose(module.main(qkv, mask), want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_heads_whose_rows_miss_16_bytes_stay_copies_on_cuda(device):
    """Heads of 6 float32s (24 bytes): the cuda kernel copies rows 16 bytes at a time from where
    each starts, so there the layout ops stay kernels; the cpu reads them in place."""
    def block(qkv):
        q, k, v = (qkv[..., j * 12:(j + 1) * 12].reshape(2, 5, 2, 6).transpose(0, 2, 1, 3) for j in range(3))
        return hexir.softmax(q @ k.transpose(0, 1, 3, 2)) @ v

    printed = _fused(block, [TensorSpec((2, 5, 36), "float32")], device)
    assert printed.count("hexir.attention") == 1
    assert ("hexir.views" in printed) == (device == "cpu") and ("hexir.transpose" in printed) == (device == "cuda")


@pytest.mark.parametrize("element_bytes", [4, 8])
@pytest.mark.parametrize("d", [8, 16, 40, 64, 96, 128, 256])
def test_the_cuda_tiles_rows_are_each_one_threads_and_a_warps_q_loads_hit_distinct_banks(d, element_bytes):
    """Every query row of a block's tile is one thread's (INTERLEAVE's or not), a thread's rows in
    runs of 16 bytes (its 16-byte weights stores and loads), and the rows a warp's two half-warps
    read at once (threads ty and ty + 1) lie in distinct 16-byte banks of q's tile (QPAD)."""
    width = 16 // element_bytes
    rm, _, ty, padded, _ = cuda_attention._plan(d, d, width, element_bytes)
    apart, offsets = cuda_attention._rows(rm, ty, width)
    rows = [t // 2 * 2 * rm + t % 2 * apart + offset for t in range(ty) for offset in offsets]
    assert sorted(rows) == list(range(rm * ty))
    runs = [offsets[r0:r0 + width] for r0 in range(0, rm, width)]
    assert all(run[0] % width == 0 and run == list(range(run[0], run[0] + len(run))) for run in runs)
    if rm * ty > 1:
        assert apart * cuda_attention._q_row(rm, ty, padded, width) // width % 8 != 0
