"""to-llvm: the cpu kernels of a module, as a module of the LLVM dialect.

Input: a module after tir-to-loops. Output: a new module (same context) holding only the
cpu kernels, lowered by upstream passes to the LLVM dialect with bare-pointer memref
arguments, so each kernel is `void name(T*, ..., T*, i64 size..., i64 first, i64 last)` — the .hxb cpu
calling convention. The host program is not lowered: it becomes the manifest's command list.

    func.func @relu_0(%x: memref<5xf32>, %out: memref<5xf32>, %first: index, %last: index)
  =>
    llvm.func @relu_0(%x: !llvm.ptr, %out: !llvm.ptr, %first: i64, %last: i64)
"""

from __future__ import annotations

from mlir import ir, passmanager

from hexir.dialects import hextir as ht

UPSTREAM = ("builtin.module(canonicalize, cse, convert-scf-to-cf, convert-vector-to-llvm, "
            "expand-strided-metadata, finalize-memref-to-llvm, convert-arith-to-llvm, "
            "convert-func-to-llvm{use-bare-ptr-memref-call-conv=1}, convert-cf-to-llvm, reconcile-unrealized-casts)")


def cpu_kernels_to_llvm(module: ir.Module, level: str | None = None) -> ir.Module:
    """Clone the cpu kernels of one x86-64 level (default: the best one, whose kernels carry
    their own names) into a fresh module, under their own names, and lower it to LLVM."""
    with module.context, ir.Location.unknown():
        lowered = ir.Module.create()
        kernels = ht.generated_kernels(module, "cpu")
        level = level or next((ht.level_of(k) for k in kernels if "@" not in ht.name_of(k)), None)
        with ir.InsertionPoint(lowered.body):
            for kernel in (k for k in kernels if ht.level_of(k) == level):
                clone = kernel.clone()
                clone.attributes["sym_name"] = ir.StringAttr.get(ht.name_of(kernel).partition("@")[0])
                for attribute in [name for name in clone.attributes if name.startswith("hextir.")]:
                    del clone.attributes[attribute]
                _mark_noalias(clone)
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
