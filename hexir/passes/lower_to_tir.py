"""lower-to-tir: turn each compute op into a hextir kernel with an explicit schedule (or, for a
custom kernel, a declaration of the user's code).

Input: a partitioned hexir module (every op has a device). Output: one kernel function per
`hexir.linear` / `hexir.relu`, over memrefs in destination-passing style, and the graph op
replaced by `hexir.call @kernel(...)`. constant, transfer and print stay: they are the host
program's business.

The schedule is chosen here and written on each loop:
  (a linear with a fused relu, `hexir.epilogue = "relu"`, applies max(., 0) before it is done:
   kernel op `linear_relu` / `linear_bias_relu`)
  cpu  linear  for each block of 4 rows, parallel (split across host threads) {
                 out[rows,:] = bias or 0
                 for k serial { for i in rows serial { a = x[i,k]
                   for j serial { out[i,j] += a * w[k,j] } } } }
               (the innermost loop walks w and out contiguously, so LLVM vectorizes it; a
               row of w, loaded once, serves the block's 4 rows from the L1 cache)
       relu    outermost axis parallel, the others serial
  custom  a declaration `func.func private @relu6_0` tagged `#hextir.kernel<device, "custom">`
          and `hextir.custom = {symbol, file, grid, block}`: the user's file is the body.
  cuda see `gpu_schedule.py`; each cuda kernel also gets a cpu twin `<name>_cpu`
       (`hextir.fallback_of = @<name>`), so a GPU module still runs on a machine without one.

    %y = "hexir.linear"(%x, %w) {device = "cpu"}
  =>
    func.func @linear_0(%x: memref<2x8xf32>, %w: memref<8x4xf32>, %out: memref<2x4xf32>)
        attributes {hextir.kernel = #hextir.kernel<"cpu", "linear">} {
      scf.for %b = %c0 to %c1 step %c1 { ... } {hextir.schedule = #hextir.loop<"parallel", "">}
    }
    %y = "hexir.call"(%x, %w) {callee = @linear_0, device = "cpu"}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mlir import ir
from mlir.dialects import arith, func

from hexir.dialects import hexir as hx
from hexir.dialects import hextir as ht
from hexir.passes import gpu_schedule
from hexir.passes.common import main_function
from hexir.passes.fuse import epilogue_of

#: Each cuda kernel gets a cpu twin, `<name>_cpu`, tagged with the kernel it stands in for.
FALLBACK_SUFFIX = "_cpu"
FALLBACK_OF = "hextir.fallback_of"
#: On a custom kernel's declaration: {symbol, file, grid, block}.
CUSTOM = "hextir.custom"


def lower_to_tir(module: ir.Module) -> None:
    """Replace every hexir.linear / hexir.relu with a call to a freshly built kernel, and every
    hexir.custom_call with a call to a declaration of the user's kernel."""
    main = main_function(module)
    counter = 0
    for op in list(main.regions[0].blocks[0].operations):
        if op.name not in ("hexir.linear", "hexir.relu", "hexir.custom_call"):
            continue
        device = hx.device_of(op)
        kind = hx.string_attr(op, "kernel") if op.name == "hexir.custom_call" else op.name.split(".")[1]
        name = f"{kind}_{counter}"
        counter += 1
        arg_types = [_memref(v.type) for v in op.operands] + [_memref(op.result.type)]
        with ir.InsertionPoint(main), op.location:
            if op.name == "hexir.custom_call":
                _custom_kernels(op, name, arg_types, device)
            else:
                relu = epilogue_of(op) == "relu"
                kernel_op = kind + ("_bias" if len(op.operands) == 3 else "") + ("_relu" if relu else "")
                _kernel(name, arg_types, device, kind, kernel_op, relu)
                if device == "cuda":  # the cpu variant that lets `hexir-run --device=cpu` run it
                    fallback = _kernel(name + FALLBACK_SUFFIX, arg_types, "cpu", kind, kernel_op, relu)
                    fallback.attributes[FALLBACK_OF] = ir.FlatSymbolRefAttr.get(name)
        with ir.InsertionPoint(op), op.location:
            result = hx.call(name, list(op.operands), op.result.type, device)
        op.result.replace_all_uses_with(result)
        op.erase()


def _kernel(name: str, arg_types: list[ir.Type], device: str, kind: str, kernel_op: str,
            relu: bool = False) -> ir.Operation:
    kernel = func.FuncOp(name, ir.FunctionType.get(arg_types, []))
    kernel.operation.attributes[ht.KERNEL] = ht.kernel_attr(device, kernel_op)
    kernel.sym_visibility = ir.StringAttr.get("public")
    block = kernel.add_entry_block()
    with ir.InsertionPoint(block):
        build = _builder(device, kind)
        build(list(block.arguments), relu=True) if relu else build(list(block.arguments))
        func.ReturnOp([])
    return kernel.operation


def _custom_kernels(op: ir.Operation, name: str, arg_types: list[ir.Type], device: str) -> None:
    """Declarations (no body: the user wrote it) carrying what the backend needs to build it;
    a cuda custom kernel with a cpu file gets a cpu twin, as the generated ones do."""
    objects = hx.objects_of(op)
    for kernel_device, kernel_name in ((device, name), ("cpu", name + FALLBACK_SUFFIX)):
        if kernel_name != name and (device != "cuda" or "cpu" not in objects):
            continue
        declaration = func.FuncOp(kernel_name, ir.FunctionType.get(arg_types, []), visibility="private")
        declaration.operation.attributes[ht.KERNEL] = ht.kernel_attr(kernel_device, "custom")
        declaration.operation.attributes[CUSTOM] = ir.DictAttr.get({
            "symbol": op.attributes["kernel"], "file": ir.StringAttr.get(objects[kernel_device]),
            "grid": op.attributes["grid"], "block": op.attributes["block"]})
        if kernel_name != name:
            declaration.operation.attributes[FALLBACK_OF] = ir.FlatSymbolRefAttr.get(name)


def _memref(tensor: ir.Type) -> ir.MemRefType:
    shaped = ir.ShapedType(tensor)
    return ir.MemRefType.get(shaped.shape, shaped.element_type)


def _builder(device: str, kind: str) -> Callable[[Sequence[ir.Value]], None]:
    if device == "cuda":
        return {"linear": gpu_schedule.linear, "relu": gpu_schedule.relu}[kind]
    return {"linear": cpu_linear, "relu": cpu_relu}[kind]


def _zero(element: ir.Type) -> ir.Value:
    return arith.ConstantOp(element, ir.FloatAttr.get(element, 0.0)).result


#: Rows of `out` a cpu linear computes together: each row of w it loads from memory serves
#: them all from the L1 cache.
CPU_ROWS = 4


def cpu_linear(args: Sequence[ir.Value], relu: bool = False) -> None:
    x, w, out = args[0], args[1], args[-1]
    bias = args[2] if len(args) == 4 else None
    (m, k_extent), n = ir.MemRefType(x.type).shape, ir.MemRefType(w.type).shape[1]
    element = ir.MemRefType(out.type).element_type
    with ht.loop(0, -(-m // CPU_ROWS), "parallel") as block:
        first = arith.MulIOp(block, ht.index(CPU_ROWS)).result
        rows = arith.MinUIOp(ht.index(CPU_ROWS), arith.SubIOp(ht.index(m), first).result).result
        with ht.loop(0, rows, "serial") as r, ht.loop(0, n, "serial") as j:
            i = arith.AddIOp(first, r).result
            ht.store(ht.load(bias, [j]) if bias is not None else _zero(element), out, [i, j])
        with ht.loop(0, k_extent, "serial") as k, ht.loop(0, rows, "serial") as r:
            i = arith.AddIOp(first, r).result
            a = ht.load(x, [i, k])
            with ht.loop(0, n, "serial") as j:
                product = arith.MulFOp(a, ht.load(w, [k, j])).result
                ht.store(arith.AddFOp(ht.load(out, [i, j]), product).result, out, [i, j])
        if relu:  # the fused epilogue, while the block's rows are still in the cache
            with ht.loop(0, rows, "serial") as r, ht.loop(0, n, "serial") as j:
                i = arith.AddIOp(first, r).result
                ht.store(arith.MaximumFOp(ht.load(out, [i, j]), _zero(element)).result, out, [i, j])


def cpu_relu(args: Sequence[ir.Value]) -> None:
    x, out = args
    shape = ir.MemRefType(x.type).shape
    element = ir.MemRefType(x.type).element_type

    def nest(axis: int, indices: list[ir.Value]) -> None:
        if axis == len(shape):
            value = arith.MaximumFOp(ht.load(x, indices), _zero(element)).result
            ht.store(value, out, indices)
            return
        with ht.loop(0, shape[axis], "parallel" if axis == 0 else "serial") as index:
            nest(axis + 1, [*indices, index])

    nest(0, [])
