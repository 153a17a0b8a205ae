"""Adding an op is one registration (hexir/ops.py): this module adds `neg` and nothing else,
then uses it everywhere an op goes — tracing, verification, placement, fusion into a linear,
both devices' schedules, packaging and the runtime."""

from __future__ import annotations

import numpy as np
import pytest
from hexir_runtime import KernelError, load
from mlir.dialects import arith

import hexir
from hexir import ops
from hexir.driver import Options, run_stage
from hexir.jit import JitFunction

neg = hexir.register_op(hexir.OpDef(
    "neg", ("x",), shape=ops.elementwise_rule("neg"), reference=np.negative, schedules=ops.ELEMENTWISE,
    scalar=lambda value: arith.NegFOp(value).result))

W = np.arange(12, dtype=np.float32).reshape(3, 4) / 7


def model(x):
    return neg(hexir.linear(neg(x), W))


def test_a_registered_op_runs_on_the_cpu_against_its_reference():
    x = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    expected = ops.REGISTRY["neg"].reference(ops.REGISTRY["linear"].reference(np.negative(x), W))
    np.testing.assert_allclose(hexir.jit(model)(x), expected, rtol=1e-5)


def test_a_registered_element_wise_op_fuses_into_a_linear_and_gets_both_schedules():
    jitted = JitFunction(model, Options(placement=(("hexir.linear", "cuda"), ("hexir.neg", "cuda"))))
    text = str(run_stage(jitted.trace(hexir.TensorSpec((5, 3), "float32")), "mlir-tir", jitted.options))
    assert 'hextir.kernel = #hextir.kernel<"cuda", "linear">' in text
    assert 'hextir.epilogues = ["neg"]' in text                     # the second neg, fused
    assert 'hextir.kernel = #hextir.kernel<"cuda", "neg">' in text  # the first one, alone
    kernels = [f for f in text.split("func.func")[1:] if "hextir.kernel" in f.split("{")[0] + f[:600]]
    # each cuda kernel and its cpu twin, one per x86-64 level of the target
    levels = len(jitted.options.target.cpu_levels)
    assert len(kernels) == 2 * (1 + levels) and all("arith.negf" in k for k in kernels)
    module = load(jitted.compile(hexir.TensorSpec((5, 3), "float32")), "cpu")
    kinds = sorted((k.op, tuple(k.epilogues)) for k in module.hxb.manifest.kernels)
    assert kinds == [("linear", ("neg",)), ("neg", ())]
    x = np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32)
    np.testing.assert_allclose(module.main(x), -((-x) @ W), rtol=1e-5)


def test_the_reference_device_refuses_an_op_it_has_no_numpy_for():
    data = hexir.jit(model).compile(hexir.TensorSpec((2, 3), "float32"))
    with pytest.raises(KernelError, match="neg"):
        load(data, "reference")


def test_a_registration_is_checked():
    with pytest.raises(hexir.TraceError, match="taken"):
        hexir.register_op(hexir.OpDef("neg", ("x",), ops.elementwise_rule("neg"), np.negative, ops.ELEMENTWISE))
    with pytest.raises(hexir.TraceError, match="a schedule for each of cpu, cuda"):
        hexir.register_op(hexir.OpDef("half", ("x",), ops.elementwise_rule("half"), np.negative,
                                      {"cpu": ops.ELEMENTWISE["cpu"]}))
