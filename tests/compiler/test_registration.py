"""Adding an op is one registration (`hexir.register_op`, hexir/ops/__init__.py): this module
adds a user's own gelu written with math ops (`hexir.Pointwise`) and a log-sum-exp
(`hexir.Reduce`), and nothing else, then uses them everywhere an op goes: tracing,
verification, placement, fusion (into a linear, into a chain, as a reduction's prologue), both
devices' kernels, packaging, and the runtime's cpu and reference devices (which read the op's
tree from the manifest: no device knows the op by name)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hexir_runtime import format as hxb
from hexir_runtime import load

import hexir
from hexir.driver import Options, parse_placement, run_stage
from hexir.jit import JitFunction
from hexir.target import parse_target


def _my_gelu(x):
    return 0.5 * x * (1 + hexir.scalar.erf(x * 0.7071067811865476))


def _logsumexp(x):
    top = hexir.scalar.row_max(x)
    return top + hexir.scalar.log(hexir.scalar.row_sum(hexir.scalar.exp(x - top)))


my_gelu = hexir.register_op(hexir.Pointwise("my_gelu", _my_gelu))
logsumexp = hexir.register_op(hexir.Reduce("logsumexp", _logsumexp))

W = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
_erf = np.vectorize(math.erf, otypes=[np.float64])


def gelu(x):
    """torch's exact gelu, written apart from the op's definition."""
    return x * 0.5 * (1 + _erf(x / math.sqrt(2)))


def model(x):
    return my_gelu(hexir.linear(my_gelu(x), W))  # the first alone, the second fused into the linear


def chain(x):
    return my_gelu(x * 2.0 + 1.0) - x  # one pointwise kernel


def reduced(x):
    return logsumexp(x * 0.5)  # the scale fused into the reduce kernel


def jitted(function, device: str) -> JitFunction:
    """`function` with every op on `device` ("cuda": here the cuda kernels' cpu twins run)."""
    return JitFunction(function, Options(
        placement=parse_placement("*=cuda" if device == "cuda" else None),
        target=parse_target("cpu:host,cuda:sm_90" if device == "cuda" else "cpu:host")))


def kernels(function, device: str, spec: hexir.TensorSpec) -> tuple[list[tuple[str, str]], bytes]:
    """(device, op) of each kernel in the manifest of `function` compiled for `device`, and the module."""
    data = jitted(function, device).compile(spec)
    return [(k["device"], k["op"]) for k in hxb.decode(data).json["kernels"]], data


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_registered_op_runs_alone_and_fused_into_a_linear_against_numpy(device):
    x = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    found, data = kernels(model, device, hexir.TensorSpec((5, 3), "float32"))
    assert found == [(device, "pointwise"), (device, "linear")]  # the second my_gelu is the linear's epilogue
    expected = gelu(gelu(x.astype(np.float64)) @ W)
    for runtime_device in ("cpu", "reference"):
        np.testing.assert_allclose(load(data, runtime_device).main(x), expected, rtol=2e-5, atol=1e-6,
                                   err_msg=runtime_device)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_registered_op_fuses_into_a_chain_of_pointwise_ops(device):
    x = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float64)
    found, data = kernels(chain, device, hexir.TensorSpec((4, 6), "float64"))
    assert found == [(device, "pointwise")]
    (kernel,) = hxb.decode(data).json["kernels"]
    assert '"erf"' in str(kernel["expr"]).replace("'", '"')  # the user's tree, composed into the chain's
    np.testing.assert_allclose(load(data, "cpu").main(x), gelu(x * 2 + 1) - x, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_registered_reduce_op_runs_with_its_prologue_fused(device):
    x = np.random.default_rng(2).standard_normal((3, 7)).astype(np.float32)
    found, data = kernels(reduced, device, hexir.TensorSpec((3, 7), "float32"))
    assert found == [(device, "reduce")]
    expected = np.log(np.exp(x.astype(np.float64) * 0.5).sum(-1))
    for runtime_device in ("cpu", "reference"):
        y = load(data, runtime_device).main(x)
        assert y.shape == (3,)
        np.testing.assert_allclose(y, expected, rtol=2e-6, atol=1e-6, err_msg=runtime_device)


def test_a_registered_op_gets_both_devices_kernels_with_its_math():
    fn = jitted(model, "cuda")
    text = str(run_stage(fn.trace(hexir.TensorSpec((5, 3), "float32")), "mlir-tir", fn.options))
    assert 'hextir.kernel = #hextir.kernel<"cuda", "linear">' in text
    assert 'hextir.kernel = #hextir.kernel<"cuda", "pointwise">' in text
    # each cuda kernel and its cpu twin (one per x86-64 level of the target), each with the erf
    bodies = [f for f in text.split("func.func")[1:] if "hextir.kernel" in f.split("{", 1)[1][:1500]]
    levels = len(fn.options.target.cpu_levels)
    assert len(bodies) == 2 * (1 + levels) and all("math.erf" in body for body in bodies)
    assert text.count("hextir.expr") == len(bodies)


def test_a_registration_is_checked():
    with pytest.raises(hexir.TraceError, match="'my_gelu' is taken"):
        hexir.register_op(hexir.Pointwise("my_gelu", lambda x: x))
    with pytest.raises(hexir.TraceError, match="an op's name must be an identifier, got 'not a name'"):
        hexir.register_op(hexir.Pointwise("not a name", lambda x: x))
    with pytest.raises(hexir.TraceError, match="expected a Pointwise, Reduce or Contract, got function"):
        hexir.register_op(_my_gelu)
    with pytest.raises(hexir.TraceError, match="an op's element function got 'a'"):
        hexir.register_op(hexir.Pointwise("glue", lambda x: x + "a"))
    with pytest.raises(hexir.TraceError, match="op wide takes 1 to 8 operands, got 9"):
        hexir.register_op(hexir.Pointwise("wide", lambda *xs: xs[0], arity=9))
    with pytest.raises(hexir.TraceError, match="needs a schedule for each of cpu, cuda"):
        hexir.register_op(hexir.Contract("half", ("x",), lambda x: x[0], {"cpu": None}))
    assert not {"glue", "wide", "half"} & set(hexir.ops.REGISTRY)  # a refused op is not registered


@pytest.mark.parametrize(("name", "definition"), [
    ("math_exp", hexir.Pointwise("math_exp", lambda x: math.exp(x) - 1)),
    ("branchy", hexir.Pointwise("branchy", lambda x: x if x > 0 else -x)),
    ("floated", hexir.Pointwise("floated", lambda x: x * float(x))),
], ids=["math.exp", "a branch", "float()"])
def test_an_element_used_as_a_number_names_the_scalar_function_to_use(name, definition):
    """math.exp, float(), `if`: an element has no value while its tree is written; the error says
    what to write instead (it was a TypeError from inside math before), and nothing is registered."""
    with pytest.raises(hexir.TraceError, match=r"Scalar\(a0\) is an op's element, not a number: .*use "
                                               r"hexir\.scalar\.exp .*not math\.exp") as caught:
        hexir.register_op(definition)
    assert isinstance(caught.value, hexir.TraceError) and name not in hexir.ops.REGISTRY
