"""tir-to-loops: lower hextir kernels into upstream scf / memref / arith.

Input: kernels from lower-to-tir (`hextir.load`/`store`/`alloc_local`, loops scheduled with
`#hextir.loop`). Output: the same loops over `memref.load` / `memref.store`, and each cpu
kernel's outermost `parallel` loop turned into the kernel's work range: two trailing
`index` arguments `first`, `last` replace its bounds, so the runtime can hand
`[first, last)` slices of it to host threads (the .hxb calling convention). Schedules of
cuda kernels stay, with their shared buffers and barriers: `to_gpu` turns those into GPU
indices, workgroup memory and `gpu.barrier`.

    func.func @relu_0(%x: memref<5xf32>, %out: memref<5xf32>) {
      scf.for %i = %c0 to %c5 step %c1 {        func.func @relu_0(%x: memref<5xf32>, %out: memref<5xf32>,
        %v = "hextir.load"(%x, %i)         =>                      %first: index, %last: index) {
        ...                                       scf.for %i = %first to %last step %c1 {
      } {hextir.schedule =                          %v = memref.load %x[%i] : memref<5xf32>
           #hextir.loop<"parallel", "">}            ...
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import memref

from hexir.dialects import hextir as ht
from hexir.errors import CompileError
from hexir.passes.common import generated_kernels, walk

#: The trip count of a cpu kernel's work range, recorded for the manifest.
WORK_ITEMS = "hextir.work_items"

def tir_to_loops(module: ir.Module) -> None:
    """Lower hextir memory ops everywhere and give cpu kernels their work-range arguments."""
    for kernel in generated_kernels(module):
        if ht.kernel_of(kernel)[0] == "cpu" and WORK_ITEMS not in kernel.attributes:  # not yet lowered
            _add_work_range(kernel)
        _lower_memory_ops(kernel)


def _add_work_range(kernel: ir.Operation) -> None:
    block = kernel.regions[0].blocks[0]
    outer = [op for op in block.operations
             if op.name == "scf.for" and ht.schedule_of(op) == ("parallel", "")]
    if len(outer) != 1:
        raise CompileError(f"cpu kernel {_name(kernel)} needs exactly one outermost parallel loop, "
                           f"found {len(outer)}")
    loop = outer[0]
    extent = ir.IntegerAttr(loop.operands[1].owner.attributes["value"]).value
    kernel.attributes[WORK_ITEMS] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), extent)
    index = ir.IndexType.get()
    first = block.add_argument(index, kernel.location)
    last = block.add_argument(index, kernel.location)
    loop.operands[0] = first
    loop.operands[1] = last
    function_type = ir.FunctionType(ir.TypeAttr(kernel.attributes["function_type"]).value)
    kernel.attributes["function_type"] = ir.TypeAttr.get(
        ir.FunctionType.get([*function_type.inputs, index, index], []))
    for op in walk(kernel, "scf.for"):
        del op.attributes[ht.SCHEDULE]


def _lower_memory_ops(kernel: ir.Operation) -> None:
    for op in walk(kernel, "hextir.load", "hextir.store", "hextir.alloc_local"):
        if op.name == "hextir.alloc_local" and ir.StringAttr(op.attributes["space"]).value == "shared":
            continue  # a GPU block's buffer: to_gpu makes it a workgroup attribution
        with ir.InsertionPoint(op), op.location:
            if op.name == "hextir.load":
                value = memref.LoadOp(op.operands[0], list(op.operands)[1:]).result
                op.result.replace_all_uses_with(value)
            elif op.name == "hextir.store":
                memref.StoreOp(op.operands[0], op.operands[1], list(op.operands)[2:])
            else:
                value = memref.AllocaOp(op.result.type, [], []).result
                op.result.replace_all_uses_with(value)
        op.erase()


def _name(kernel: ir.Operation) -> str:
    return ir.StringAttr(kernel.attributes["sym_name"]).value
