"""to-gpu: outline the cuda kernels into one `gpu.module` of `gpu.func` kernels.

Input: a module after tir-to-loops whose cuda kernels still carry their GPU schedules.
Output: the module marked `gpu.container_module`, holding `gpu.module @hexir_cuda` with one
`gpu.func ... kernel` per cuda kernel. Each loop bound to `blockIdx.*` / `threadIdx.*` is
replaced by `gpu.block_id` / `gpu.thread_id` (the schedule's launch record, `hextir.launch`,
already says how many of each the launch has: the loop's trip count, whether constant or an
expression of a size argument); shared `hextir.alloc_local` buffers become workgroup
attributions (static shared memory, 16-byte aligned) or, past the 48 KiB a block gets without
opting in, views of its dynamic shared memory (`gpu.dynamic_shared_memory` + `memref.view`, the
bytes written into the launch record, which the runtime opts the kernel into at load); and
`hextir.barrier` a `gpu.barrier`; a "global" `hextir.alloc_local` becomes a zeroed
`memref.global` of the gpu.module (`@<kernel>_global<i>`), read through `memref.get_global`
(device memory that lives as long as the loaded module). The kernel takes exactly the arguments of
the kernel function, no more (so the runtime launches it with those pointers and sizes):
nothing is captured from outside, unlike `gpu-kernel-outlining`.

    func.func @relu_1(%x: memref<5xf32>, %out: memref<5xf32>) {hextir.kernel = ...}
      scf.for %b = %c0 to %c1 { scf.for %t = %c0 to %c256 { <guarded body> }
        {#hextir.loop<"parallel", "threadIdx.x">} } {#hextir.loop<"parallel", "blockIdx.x">}
  =>
    gpu.module @hexir_cuda {
      gpu.func @relu_1(%x: memref<5xf32>, %out: memref<5xf32>) kernel
          attributes {hextir.launch = {grid = ["1", "1", "1"], block = array<i64: 256, 1, 1>, ...}} {
        %b = gpu.block_id x
        %t = gpu.thread_id x
        <guarded body>
        gpu.return
      }
    }
"""

from __future__ import annotations

import math

from hexir_runtime.cuda import DEFAULT_SHARED_BYTES  # what a block gets without opting in
from mlir import ir
from mlir.dialects import arith, gpu, memref

from hexir.dialects import hexir as hx
from hexir.dialects import hextir as ht
from hexir.passes.common import walk

_DIMENSIONS = {"x": gpu.Dimension.x, "y": gpu.Dimension.y, "z": gpu.Dimension.z}


def _bytes(type_: ir.Type) -> int:
    shaped = ir.MemRefType(type_)
    element = shaped.element_type
    width = element.width if isinstance(element, ir.IntegerType) else ir.FloatType(element).width
    return math.prod(shaped.shape) * width // 8


def cuda_kernels_to_gpu(module: ir.Module) -> None:
    """Move every cuda kernel into `gpu.module @hexir_cuda` as a bound `gpu.func`."""
    cuda_kernels = [k for k in ht.generated_kernels(module, "cuda") if k.name == "func.func"]
    if not cuda_kernels:
        return
    with module.context, ir.Location.unknown():
        module.operation.attributes["gpu.container_module"] = ir.UnitAttr.get()
        with ir.InsertionPoint(hx.main_function(module)):
            gpu_module = gpu.GPUModuleOp(ht.GPU_MODULE)
        body = gpu_module.regions[0].blocks.append()
        for kernel in cuda_kernels:
            with ir.InsertionPoint(body), kernel.location:
                _outline(kernel)


def _outline(kernel: ir.Operation) -> None:
    old_block = kernel.regions[0].blocks[0]
    arg_types = [a.type for a in old_block.arguments]
    name = ir.StringAttr(kernel.attributes["sym_name"]).value
    ops = walk(kernel, "hextir.alloc_local", "hextir.barrier", "scf.for")  # (one walk: each visits every op)
    barriers, loops = ([op for op in ops if op.name == name] for name in ("hextir.barrier", "scf.for"))
    shared, globals_ = ([op for op in ops if op.name == "hextir.alloc_local" and
                         ir.StringAttr(op.attributes["space"]).value == space] for space in ("shared", "global"))
    for index, op in enumerate(globals_):
        shaped = ir.MemRefType(op.result.type)
        zero = ir.FloatAttr.get(shaped.element_type, 0.0) if not isinstance(shaped.element_type, ir.IntegerType) \
            else ir.IntegerAttr.get(shaped.element_type, 0)
        memref.GlobalOp(f"{name}_global{index}", ir.TypeAttr.get(shaped), sym_visibility="private",
                        initial_value=ir.DenseElementsAttr.get_splat(ir.RankedTensorType.get(shaped.shape,
                                                                                            shaped.element_type), zero),
                        alignment=16)
        with ir.InsertionPoint(op), op.location:
            op.result.replace_all_uses_with(memref.GetGlobalOp(shaped, f"{name}_global{index}").result)
        op.erase()
    function = gpu.GPUFuncOp(ir.FunctionType.get(arg_types, []), sym_name=name, kernel=True)
    for attribute in (ht.KERNEL, ht.EXPR, ht.SIZES, ht.LAUNCH, ht.VARIANT, ht.VARIANTS, ht.VARIANT_OF, ht.IDENTITY,
                      ht.VIEWS, ht.TENSOR_MAPS, ht.ARCH, "nvvm.cluster_dim", "nvvm.minctasm"):
        if attribute in kernel.attributes:
            function.operation.attributes[attribute] = kernel.attributes[attribute]
    # Shared buffers become workgroup attributions: extra entry-block arguments after the
    # kernel's own, counted by `workgroup_attributions` (static shared memory, at most
    # DEFAULT_SHARED_BYTES); more than that become views of the block's dynamic shared memory,
    # whose size the launch record then asks for.
    offsets = [0]
    for op in shared:  # 16-byte aligned, for the 128-bit loads the schedules read them with
        offsets.append(offsets[-1] + -(-_bytes(op.result.type) // 16) * 16)
    dynamic = offsets[-1] > DEFAULT_SHARED_BYTES
    attributions = [] if dynamic else shared
    block = function.regions[0].blocks.append(*arg_types, *(op.result.type for op in attributions))
    function.operation.attributes["workgroup_attributions"] = ir.IntegerAttr.get(
        ir.IntegerType.get_signless(64), len(attributions))
    if attributions:
        function.operation.attributes["workgroup_attrib_attrs"] = ir.ArrayAttr.get(
            [ir.Attribute.parse("{llvm.align = 16 : i64}")] * len(attributions))
    with ir.InsertionPoint(block):
        if dynamic:
            base = gpu.DynamicSharedMemoryOp(ir.MemRefType.get(
                [ir.ShapedType.get_dynamic_size()], ir.IntegerType.get_signless(8),
                memory_space=ir.Attribute.parse("#gpu.address_space<workgroup>"))).result
            views = [memref.ViewOp(op.result.type, base, arith.ConstantOp(ir.IndexType.get(), at).result, []).result
                     for op, at in zip(shared, offsets[:-1], strict=True)]
            record = ht.record_of(function.operation)
            ht.set_record(function.operation, ht.Launch(record.grid, record.block, offsets[-1]))
        terminator = gpu.ReturnOp([])
    for old, new in zip(old_block.arguments, block.arguments[:len(arg_types)], strict=True):
        old.replace_all_uses_with(new)
    for op, buffer in zip(shared, views if dynamic else list(block.arguments)[len(arg_types):], strict=True):
        op.result.replace_all_uses_with(buffer)
        op.erase()
    for op in barriers:
        with ir.InsertionPoint(op), op.location:
            gpu.BarrierOp()
        op.erase()
    for op in list(old_block.operations):
        if op.name == "func.return":
            continue
        op.move_before(terminator)
    kernel.erase()
    _bind_loops(loops)
    block_size = list(ht.record_of(function.operation).block)
    function.operation.attributes["known_block_size"] = ir.DenseI32ArrayAttr.get(block_size)


def _bind_loops(loops: list[ir.Operation]) -> None:
    """Replace each bound loop of `loops` (pre-order) by its GPU index; the others lose their schedule."""
    for loop in loops:
        schedule = ht.schedule_of(loop)
        if schedule is None or not schedule[1]:
            if schedule is not None:
                del loop.attributes[ht.SCHEDULE]
            continue
        space, axis = schedule[1].split(".")
        with ir.InsertionPoint(loop), loop.location:
            make = gpu.BlockIdOp if space == "blockIdx" else gpu.ThreadIdOp
            position = make(_DIMENSIONS[axis]).result
        body = loop.regions[0].blocks[0]
        body.arguments[0].replace_all_uses_with(position)
        for op in list(body.operations):
            if op.name != "scf.yield":
                op.move_before(loop)
        loop.erase()
