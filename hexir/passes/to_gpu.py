"""to-gpu: outline the cuda kernels into one `gpu.module` of `gpu.func` kernels.

Input: a module after tir-to-loops whose cuda kernels still carry their GPU schedules.
Output: the module marked `gpu.container_module`, holding `gpu.module @hexir_cuda` with one
`gpu.func ... kernel` per cuda kernel. Each loop bound to `blockIdx.*` / `threadIdx.*` is
replaced by `gpu.block_id` / `gpu.thread_id`, its trip count becoming the launch geometry,
recorded on the kernel as `hextir.grid` / `hextir.block` for the manifest; shared
`hextir.alloc_local` buffers become workgroup attributions and `hextir.barrier` a
`gpu.barrier`. The kernel takes
exactly the buffers of the graph op, no more (so the runtime launches it with those
pointers): nothing is captured from outside, unlike `gpu-kernel-outlining`.

    func.func @relu_1(%x: memref<5xf32>, %out: memref<5xf32>) {hextir.kernel = ...}
      scf.for %b = %c0 to %c1 { scf.for %t = %c0 to %c256 { <guarded body> }
        {#hextir.loop<"parallel", "threadIdx.x">} } {#hextir.loop<"parallel", "blockIdx.x">}
  =>
    gpu.module @hexir_cuda {
      gpu.func @relu_1(%x: memref<5xf32>, %out: memref<5xf32>) kernel
          attributes {hextir.grid = array<i64: 1, 1, 1>, hextir.block = array<i64: 256, 1, 1>} {
        %b = gpu.block_id x
        %t = gpu.thread_id x
        <guarded body>
        gpu.return
      }
    }
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import gpu

from hexir.dialects import hextir as ht
from hexir.errors import CompileError
from hexir.passes.common import generated_kernels, main_function, walk

GPU_MODULE = "hexir_cuda"
_DIMENSIONS = {"x": gpu.Dimension.x, "y": gpu.Dimension.y, "z": gpu.Dimension.z}


def cuda_kernels_to_gpu(module: ir.Module) -> None:
    """Move every cuda kernel into `gpu.module @hexir_cuda` as a bound `gpu.func`."""
    cuda_kernels = [k for k in generated_kernels(module, "cuda") if k.name == "func.func"]
    if not cuda_kernels:
        return
    with module.context, ir.Location.unknown():
        module.operation.attributes["gpu.container_module"] = ir.UnitAttr.get()
        with ir.InsertionPoint(main_function(module)):
            gpu_module = gpu.GPUModuleOp(GPU_MODULE)
        body = gpu_module.regions[0].blocks.append()
        for kernel in cuda_kernels:
            with ir.InsertionPoint(body), kernel.location:
                _outline(kernel)


def _outline(kernel: ir.Operation) -> None:
    old_block = kernel.regions[0].blocks[0]
    arg_types = [a.type for a in old_block.arguments]
    name = ir.StringAttr(kernel.attributes["sym_name"]).value
    shared = [op for op in walk(kernel, "hextir.alloc_local")
              if ir.StringAttr(op.attributes["space"]).value == "shared"]
    function = gpu.GPUFuncOp(ir.FunctionType.get(arg_types, []), sym_name=name, kernel=True)
    function.operation.attributes[ht.KERNEL] = kernel.attributes[ht.KERNEL]
    # Shared buffers become workgroup attributions: extra entry-block arguments after the
    # kernel's own, counted by `workgroup_attributions`.
    block = function.regions[0].blocks.append(*arg_types, *(op.result.type for op in shared))
    function.operation.attributes["workgroup_attributions"] = ir.IntegerAttr.get(
        ir.IntegerType.get_signless(64), len(shared))
    with ir.InsertionPoint(block):
        terminator = gpu.ReturnOp([])
    for old, new in zip(old_block.arguments, block.arguments[:len(arg_types)], strict=True):
        old.replace_all_uses_with(new)
    for op, attribution in zip(shared, list(block.arguments)[len(arg_types):], strict=True):
        op.result.replace_all_uses_with(attribution)
        op.erase()
    for op in walk(kernel, "hextir.barrier"):
        with ir.InsertionPoint(op), op.location:
            gpu.BarrierOp()
        op.erase()
    for op in list(old_block.operations):
        if op.name == "func.return":
            continue
        op.move_before(terminator)
    kernel.erase()
    grid, threads = _bind_loops(function.operation, name)
    check_launch(name, grid, threads)
    i64 = ir.DenseI64ArrayAttr.get
    function.operation.attributes["hextir.grid"] = i64(grid)
    function.operation.attributes["hextir.block"] = i64(threads)
    function.operation.attributes["known_block_size"] = ir.DenseI32ArrayAttr.get(threads)


def _bind_loops(function: ir.Operation, name: str) -> tuple[list[int], list[int]]:
    """Replace each bound loop by its GPU index; return (grid, block) sizes."""
    bound: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        schedule = ht.schedule_of(op) if op.name == "scf.for" else None
        if schedule is not None and schedule[1]:
            bound.append(op)
        return ir.WalkResult.ADVANCE

    function.walk(visit, ir.WalkOrder.PRE_ORDER)
    sizes = {"blockIdx": [1, 1, 1], "threadIdx": [1, 1, 1]}
    for loop in bound:
        space, axis = ht.schedule_of(loop)[1].split(".")
        sizes[space]["xyz".index(axis)] = _trip_count(loop, name)
        with ir.InsertionPoint(loop), loop.location:
            make = gpu.BlockIdOp if space == "blockIdx" else gpu.ThreadIdOp
            position = make(_DIMENSIONS[axis]).result
        body = loop.regions[0].blocks[0]
        body.arguments[0].replace_all_uses_with(position)
        for op in list(body.operations):
            if op.name != "scf.yield":
                op.move_before(loop)
        loop.erase()
    for op in walk(function, "scf.for"):
        if ht.SCHEDULE in op.attributes:
            del op.attributes[ht.SCHEDULE]
    return sizes["blockIdx"], sizes["threadIdx"]


#: CUDA's limits on a launch: blocks per grid axis, threads per block.
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_BLOCK_THREADS = 1024


def check_launch(kernel: str, grid: list[int], block: list[int]) -> None:
    """CompileError unless CUDA can launch `grid` x `block` (checked here, not at run time)."""
    for axis, (blocks, limit) in enumerate(zip(grid, MAX_GRID, strict=True)):
        if blocks > limit:
            raise CompileError(f"cuda kernel {kernel}: its launch needs {blocks} blocks along "
                               f"{'xyz'[axis]}, more than CUDA's {limit}; the tensor is too large for one launch")
    if block[0] * block[1] * block[2] > MAX_BLOCK_THREADS:
        raise CompileError(f"cuda kernel {kernel}: a block of {block} has more than {MAX_BLOCK_THREADS} threads")


def _trip_count(loop: ir.Operation, name: str) -> int:
    bounds = []
    for operand in list(loop.operands)[:3]:
        owner = operand.owner
        if not isinstance(owner, ir.Block) and owner.name == "arith.constant":
            bounds.append(ir.IntegerAttr(owner.attributes["value"]).value)
        else:
            raise CompileError(f"cuda kernel {name}: a bound loop needs constant bounds to set the launch size")
    lower, upper, step = bounds
    if lower != 0 or step != 1:
        raise CompileError(f"cuda kernel {name}: a bound loop must run from 0 with step 1")
    return upper
