"""tir-to-loops: lower hextir kernels into upstream scf / memref / arith.

Input: kernels from lower-to-tir (`hextir.load`/`store`/`alloc_local`, loops scheduled with
`#hextir.loop`). Output: the same loops over `memref.load` / `memref.store`, and two changes
to the kernels' signatures that make the .hxb calling convention (bare pointers, then int64s):

- a buffer with a symbolic extent (`memref<?x?x8xf32>`) is passed as its base pointer
  (`memref<f32>`) and re-viewed inside the kernel with the extents its size arguments give
  (`hextir.dims`: `seq`, or `mul(batch, seq)` for the rows of x[batch, seq, K]), row-major
  (`memref.reinterpret_cast`, then `memref.cast` to the identity layout the kernel was built
  on), since a bare pointer carries no sizes;
- a cpu kernel's outermost `parallel` loop becomes the kernel's work range: two trailing
  `index` arguments `first`, `last` replace its bounds, so the runtime can hand `[first, last)`
  slices of it to host threads. A loop bound to `chunk` steps by `last - first` (its body runs
  once) and its `hextir.chunk_end` is `last`.

Schedules of cuda kernels stay, with their shared buffers and barriers: `to_gpu` turns those
into GPU indices, workgroup memory and `gpu.barrier`.

    func.func @relu_0(%x: memref<?x4xf32>, %out: memref<?x4xf32>, %batch: index) {
      scf.for %i = %c0 to %batch step %c1 {...} {hextir.schedule = #hextir.loop<"parallel", "">}
  =>
    func.func @relu_0(%x: memref<f32>, %out: memref<f32>, %batch: index, %first: index, %last: index) {
      %v = memref.reinterpret_cast %x to offset: [0], sizes: [%batch, 4], strides: [4, 1]
      %xs = memref.cast %v : memref<?x4xf32, strided<[4, 1]>> to memref<?x4xf32>
      scf.for %i = %first to %last step %c1 { %v = memref.load %xs[%i, %j] ... }
"""

from __future__ import annotations

from hexir_runtime.format import exprs
from mlir import ir
from mlir.dialects import arith, memref

from hexir.dialects import hextir as ht
from hexir.errors import CompileError
from hexir.passes.common import walk


def tir_to_loops(module: ir.Module) -> None:
    """Lower hextir memory ops everywhere and give kernels the .hxb calling convention."""
    for kernel in ht.generated_kernels(module):
        ops = walk(kernel, "scf.for", "hextir.chunk_end", "hextir.load", "hextir.store", "hextir.alloc_local")
        loops, ends = ([op for op in ops if op.name == name] for name in ("scf.for", "hextir.chunk_end"))
        if not any(ht.SCHEDULE in op.attributes for op in loops):
            continue  # lowered already
        memory = [op for op in ops if op.name not in ("scf.for", "hextir.chunk_end")]
        _pass_symbolic_buffers_as_pointers(kernel)
        if ht.kernel_of(kernel)[0] == "cpu":
            _add_work_range(kernel, loops, ends)
        _lower_memory_ops(memory)


def _set_signature(kernel: ir.Operation) -> None:
    types = [argument.type for argument in kernel.regions[0].blocks[0].arguments]
    kernel.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(types, []))


def _pass_symbolic_buffers_as_pointers(kernel: ir.Operation) -> None:
    block = kernel.regions[0].blocks[0]
    symbols = ht.sizes_of(kernel)
    arguments = list(block.arguments)[:len(block.arguments) - len(ht.tensor_maps_of(kernel))]
    buffers = arguments[:len(arguments) - len(symbols)]
    dims, views = ht.dims_of(kernel), ht.views_of(kernel)
    strided = {i: view for i, view in views.items() if isinstance(view, dict)}  # (a layout of its own)
    dynamic = [i for i, a in enumerate(buffers) if not ir.MemRefType(a.type).has_static_shape or i in strided]
    if not dynamic:
        return
    if len(dims) != len(buffers):
        raise CompileError(f"kernel {ht.name_of(kernel)}: symbolic buffers need their extents (hextir.dims)")
    values = dict(zip(symbols, arguments[len(buffers):], strict=True))
    first_op = block.operations[0]
    for position in dynamic:
        argument = buffers[position]
        shaped = ir.MemRefType(argument.type)
        with ir.InsertionPoint(first_op), kernel.location:
            sizes = iter([ht.size_value(d, values) for d in dims[position]])
            extents = [next(sizes) if shaped.is_dynamic_dim(i) else d for i, d in enumerate(shaped.shape)]
            strides: list = [1]  # row-major, an int while every extent to the right is
            for e in reversed(extents[1:]):
                inner = strides[0]
                strides.insert(0, inner * e if isinstance(inner, int) and isinstance(e, int) else
                               arith.MulIOp(ht.index(inner), ht.index(e)).result)
            offset: int | ir.Value = 0
            if position in strided:  # each axis steps along one of the buffer's (row-major) axes
                record, rows = strided[position], [1]
                for e in reversed(record["buffer"][1:]):
                    rows.insert(0, exprs.mul(rows[0], e))
                strides = [ht.size_value(exprs.mul(rows[a], c), values) for a, c in record["axes"][:-1]] + [1]
                offset = ht.index(0)
                for j, first in enumerate(record["start"]):
                    offset = arith.AddIOp(offset, ht.size_value(exprs.mul(rows[j], first), values)).result
            dynamic_size, dynamic = ir.ShapedType.get_dynamic_size(), ir.ShapedType.get_dynamic_stride_or_offset()
            static_strides = [s if isinstance(s, int) else dynamic for s in strides]
            strided_type = ir.MemRefType.get(shaped.shape, shaped.element_type, ir.StridedLayoutAttr.get(
                0 if isinstance(offset, int) else dynamic, static_strides))
            cast = memref.ReinterpretCastOp(
                strided_type, argument, [] if isinstance(offset, int) else [offset],
                [e for e in extents if not isinstance(e, int)], [s for s in strides if not isinstance(s, int)],
                static_offsets=[offset if isinstance(offset, int) else dynamic],
                static_sizes=[dynamic_size if not isinstance(e, int) else e for e in extents],
                static_strides=static_strides).operation
            # the layout the kernel was built on: the identity, or the view's own
            view = cast.result if position in strided else memref.CastOp(shaped, cast.result).result
        argument.replace_all_uses_with(view)
        cast.operands[0] = argument
        argument.set_type(ir.MemRefType.get([], shaped.element_type))
    _set_signature(kernel)


def _add_work_range(kernel: ir.Operation, loops: list[ir.Operation], ends: list[ir.Operation]) -> None:
    block = kernel.regions[0].blocks[0]
    outer = [op for op in block.operations
             if op.name == "scf.for" and ht.schedule_of(op) in (("parallel", ""), ("parallel", "chunk"))]
    if len(outer) != 1:
        raise CompileError(f"cpu kernel {ht.name_of(kernel)} needs exactly one outermost parallel loop, "
                           f"found {len(outer)}")
    loop = outer[0]
    index = ir.IndexType.get()
    first = block.add_argument(index, kernel.location)
    last = block.add_argument(index, kernel.location)
    loop.operands[0] = first
    loop.operands[1] = last
    if ht.schedule_of(loop)[1] == "chunk":  # the body once, for the whole [first, last)
        with ir.InsertionPoint(loop), loop.location:
            loop.operands[2] = arith.MaxUIOp(arith.SubIOp(last, first).result, ht.index(1)).result
        for op in ends:
            op.result.replace_all_uses_with(last)
            op.erase()
    elif ends:
        raise CompileError(f"cpu kernel {ht.name_of(kernel)} uses hextir.chunk_end outside a chunk loop")
    _set_signature(kernel)
    for op in loops:
        if ht.SCHEDULE in op.attributes:
            del op.attributes[ht.SCHEDULE]


def _lower_memory_ops(ops: list[ir.Operation]) -> None:
    for op in ops:
        if op.name == "hextir.alloc_local" and ir.StringAttr(op.attributes["space"]).value != "private":
            continue  # a GPU block's or kernel's buffer: to_gpu makes it an attribution or a global
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
