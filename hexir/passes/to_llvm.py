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
from mlir.dialects import arith

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


def cpu_kernels_to_llvm(module: ir.Module, level: str | None = None, twins: bool | None = None) -> ir.Module:
    """Clone the cpu kernels of one x86-64 level (default: the best one, whose kernels carry
    their own names) into a fresh module, under their own names, and lower it to LLVM; `twins`
    True or False: only the cuda kernels' cpu twins (built at the lowest level), or none of them."""
    with module.context, ir.Location.unknown():
        lowered = ir.Module.create()
        kernels = [k for k in ht.generated_kernels(module, "cpu") if twins is None or ht.identity_of(k).twin == twins]
        level = level or next((ht.level_of(k) for k in sorted(kernels, key=lambda k: ht.identity_of(k).twin)
                               if ht.identity_of(k).best), None)  # the best level's; a twins' module: theirs
        with ir.InsertionPoint(lowered.body):
            for kernel in (k for k in kernels if ht.level_of(k) == level):
                clone = kernel.clone()
                clone.attributes["sym_name"] = ir.StringAttr.get(ht.identity_of(kernel).symbol)
                for attribute in [name for name in clone.attributes if name.startswith("hextir.")]:
                    del clone.attributes[attribute]
                _mark_noalias(clone)
        _approximate_math(lowered)
        _expand_halves(lowered)
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


def _expand_halves(module: ir.Module) -> None:
    """Each extf/truncf between float32 and bfloat16 or float16 as integer ops (round to nearest
    even, NaN kept a NaN), scalar or vector alike: LLVM would call compiler-rt (__truncsfbf2,
    and __truncsfhf2 below x86-64-v3), which a kernel library does not link."""
    found: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name in ("arith.extf", "arith.truncf") and _half(op.results[0].type if op.name == "arith.truncf"
                                                               else op.operands[0].type):
            found.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    for op in found:
        with ir.InsertionPoint(op), op.location:
            value = (_widen if op.name == "arith.extf" else _narrow)(op.operands[0], op.results[0].type)
        op.results[0].replace_all_uses_with(value)
        op.erase()


def _half(type_: ir.Type) -> ir.Type | None:
    element = ir.VectorType(type_).element_type if isinstance(type_, ir.VectorType) else type_
    return element if isinstance(element, (ir.BF16Type, ir.F16Type)) else None


def _like(type_: ir.Type, element: ir.Type) -> ir.Type:
    return ir.VectorType.get(ir.VectorType(type_).shape, element) if isinstance(type_, ir.VectorType) else element


def _ints(type_: ir.Type, width: int) -> tuple[ir.Type, callable]:
    """The int type of `type_`'s shape and a maker of its constants (splats for a vector)."""
    int_type = _like(type_, ir.IntegerType.get_signless(width))

    def const(value: int) -> ir.Value:
        if isinstance(int_type, ir.VectorType):
            attribute = ir.IntegerAttr.get(ir.IntegerType.get_signless(width), value)
            return arith.ConstantOp(int_type, ir.DenseElementsAttr.get_splat(int_type, attribute)).result
        return arith.ConstantOp(int_type, value).result
    return int_type, const


def _widen(x: ir.Value, f32: ir.Type) -> ir.Value:
    """bf16: its bits are f32's high half; f16: rebias the exponent, subnormals renormalised by a
    float subtraction, inf and NaN given f32's exponent."""
    i32, c = _ints(f32, 32)
    bits = arith.extui(i32, arith.bitcast(_ints(f32, 16)[0], x))
    if isinstance(_half(x.type), ir.BF16Type):
        return arith.bitcast(f32, arith.shli(bits, c(16)))
    shifted = arith.shli(arith.andi(bits, c(0x7FFF)), c(13))
    exponent = arith.andi(shifted, c(0x7C00 << 13))
    normal = arith.addi(shifted, c(112 << 23))
    special = arith.addi(normal, c(112 << 23))
    tiny = arith.subf(arith.bitcast(f32, arith.addi(normal, c(1 << 23))), arith.bitcast(f32, c(113 << 23)))
    eq = arith.CmpIPredicate.eq
    magnitude = arith.select(arith.cmpi(eq, exponent, c(0x7C00 << 13)), special, normal)
    magnitude = arith.select(arith.cmpi(eq, exponent, c(0)), arith.bitcast(i32, tiny), magnitude)
    return arith.bitcast(f32, arith.ori(magnitude, arith.shli(arith.andi(bits, c(0x8000)), c(16))))


def _narrow(x: ir.Value, half: ir.Type) -> ir.Value:
    """Round to nearest even: bf16 adds 0x7FFF plus the kept lowest bit and drops 16 bits; f16
    (F. Giesen's float_to_half_fast3_rtne) saturates to inf, rounds subnormals by adding a magic
    float, normals as bf16 does."""
    i32, c = _ints(x.type, 32)
    i16 = _ints(x.type, 16)[0]
    bits = arith.bitcast(i32, x)
    nan = arith.cmpf(arith.CmpFPredicate.UNO, x, x)
    ult, ugt, uge = arith.CmpIPredicate.ult, arith.CmpIPredicate.ugt, arith.CmpIPredicate.uge
    if isinstance(_half(half), ir.BF16Type):
        odd = arith.andi(arith.shrui(bits, c(16)), c(1))
        rounded = arith.shrui(arith.addi(arith.addi(bits, c(0x7FFF)), odd), c(16))
        result = arith.select(nan, arith.ori(arith.shrui(bits, c(16)), c(0x40)), rounded)
        return arith.bitcast(half, arith.trunci(i16, result))
    sign = arith.andi(bits, c(0x80000000))
    a = arith.xori(bits, sign)
    big = arith.select(arith.cmpi(ugt, a, c(255 << 23)), c(0x7E00), c(0x7C00))
    magic = c(((127 - 15) + (23 - 10) + 1) << 23)
    small = arith.subi(arith.bitcast(i32, arith.addf(arith.bitcast(x.type, a), arith.bitcast(x.type, magic))), magic)
    odd = arith.andi(arith.shrui(a, c(13)), c(1))
    normal = arith.shrui(arith.addi(arith.addi(a, c(((15 - 127) << 23) + 0xFFF)), odd), c(13))
    result = arith.select(arith.cmpi(ult, a, c(113 << 23)), small, normal)
    result = arith.select(arith.cmpi(uge, a, c((127 + 16) << 23)), big, result)
    result = arith.ori(result, arith.shrui(sign, c(16)))
    return arith.bitcast(half, arith.trunci(i16, result))
