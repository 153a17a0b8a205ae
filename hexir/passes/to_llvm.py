"""to-llvm: the cpu kernels of a module, as a module of the LLVM dialect.

Input: a module after tir-to-loops. Output: a new module (same context) holding only the
cpu kernels, lowered by upstream passes to the LLVM dialect with bare-pointer memref
arguments, so each kernel is `void name(T*, ..., T*, i64 size..., i64 first, i64 last)` — the .hxb cpu
calling convention. The host program is not lowered: it becomes the manifest's command list.

    func.func @relu_0(%x: memref<5xf32>, %out: memref<5xf32>, %first: index, %last: index)
  =>
    llvm.func @relu_0(%x: !llvm.ptr, %out: !llvm.ptr, %first: i64, %last: i64)

Math ops (docs/math.md): exp, log, tanh, erf (float32 and float64, scalar or vector) and
float32 rsqrt are first written as arith ops by hexir/schedules/mathlib.py, so they stay
vectorised; the rest go to LLVM intrinsics (sqrt, absf, float64 rsqrt as 1 / sqrt: vector
instructions; pow, sin...: libm calls, a vector one element at a time) or, without an
intrinsic (erfc...), to glibc's libm. No fast-math flag is added.

    %e = math.exp %v : vector<16xf32>   =>  arith ops on vector<16xf64>, arith.truncf
    %e = math.powf %x, %y : f64         =>  llvm.intr.pow (LLVM: a call to libm's pow)
"""

from __future__ import annotations

from mlir import ir, passmanager

from hexir.dialects import hextir as ht
from hexir.errors import CompileError
from hexir.schedules import mathlib

# After mathlib, convert-math-to-llvm first: it takes what LLVM lowers well (sqrt, absf,
# copysign, fma as instructions; pow, sin... as intrinsics that become libm calls);
# convert-math-to-libm then takes what LLVM has no intrinsic for (erfc...). The reverse order
# would send sqrt to libm, one element at a time, and rsqrt to a `rsqrtf` that libm lacks.
UPSTREAM = ("builtin.module(canonicalize, cse, convert-math-to-llvm, convert-math-to-libm, "
            "convert-scf-to-cf, convert-vector-to-llvm, "
            "expand-strided-metadata, lower-affine, finalize-memref-to-llvm, convert-arith-to-llvm, "
            "convert-func-to-llvm{use-bare-ptr-memref-call-conv=1}, convert-cf-to-llvm, reconcile-unrealized-casts)")


def cpu_kernels_to_llvm(module: ir.Module, level: str | None = None) -> ir.Module:
    """Clone the cpu kernels of one x86-64 level (default: the best one, whose kernels carry
    their own names) into a fresh module, under their own names, and lower it to LLVM."""
    with module.context, ir.Location.unknown():
        lowered = ir.Module.create()
        kernels = ht.generated_kernels(module, "cpu")
        level = level or next((ht.level_of(k) for k in kernels if ht.identity_of(k).best), None)
        with ir.InsertionPoint(lowered.body):
            for kernel in (k for k in kernels if ht.level_of(k) == level):
                clone = kernel.clone()
                clone.attributes["sym_name"] = ir.StringAttr.get(ht.identity_of(kernel).symbol)
                for attribute in [name for name in clone.attributes if name.startswith("hextir.")]:
                    del clone.attributes[attribute]
                _mark_noalias(clone)
        _approximate_math(lowered)
        passmanager.PassManager.parse(UPSTREAM).run(lowered.operation)
    return lowered


def _mark_noalias(kernel: ir.Operation) -> None:
    """Every buffer argument is `noalias`: the runtime gives each call a fresh destination
    that no input shares (inputs may share a buffer, but are only read). Without this LLVM
    must assume a store to `out` can change `x` or `w`, and cannot keep their loads in
    registers or vectorize without run-time overlap checks."""
    inputs = ir.FunctionType(ir.TypeAttr(kernel.attributes["function_type"]).value).inputs
    noalias = ir.DictAttr.get({"llvm.noalias": ir.UnitAttr.get()})
    kernel.attributes["arg_attrs"] = ir.ArrayAttr.get(
        [noalias if isinstance(t, ir.MemRefType) else ir.DictAttr.get({}) for t in inputs])


# convert-math-to-llvm writes these as exp(x) - 1 and log(1 + x), which lose all accuracy near 0.
_INACCURATE = ("math.expm1", "math.log1p")


def _approximate_math(module: ir.Module) -> None:
    """Replace each math op mathlib writes as arith ops (exp, log, tanh, erf, rsqrt) by them."""
    found: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name.startswith("math."):
            found.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    for op in found:
        if op.name in _INACCURATE:
            raise CompileError(f"'{op.name}' at {op.location} has no accurate cpu lowering; "
                               "write it with math.exp or math.log")
        with ir.InsertionPoint(op), op.location:
            value = mathlib.emit(op.name, op.operands[0]) if len(op.operands) == 1 else None
        if value is not None:
            op.results[0].replace_all_uses_with(value)
            op.erase()
