"""lower-to-tir: turn each compute op into a hextir kernel with an explicit schedule.

Input: a partitioned hexir module (every op has a device). Output: one kernel function per
`hexir.linear` / `hexir.relu`, over memrefs in destination-passing style, and the graph op
replaced by `hexir.call @kernel(...)`. constant, transfer and print stay: they are the host
program's business.

The schedule is chosen here and written on each loop:
  cpu  linear  for i parallel (split across host threads) { out[i,:] = bias or 0;
                 for k serial { a = x[i,k]; for j serial { out[i,j] += a * w[k,j] } } }
               (the innermost loop walks w and out contiguously, so LLVM vectorizes it)
       relu    outermost axis parallel, the others serial
  cuda see `gpu_schedule.py`; each cuda kernel also gets a cpu twin `<name>_cpu`
       (`hextir.fallback_of = @<name>`), so a GPU module still runs on a machine without one.

    %y = "hexir.linear"(%x, %w) {device = "cpu"}
  =>
    func.func @linear_0(%x: memref<2x8xf32>, %w: memref<8x4xf32>, %out: memref<2x4xf32>)
        attributes {hextir.kernel = #hextir.kernel<"cpu", "linear">} {
      scf.for %i = %c0 to %c2 step %c1 { ... } {hextir.schedule = #hextir.loop<"parallel", "">}
    }
    %y = "hexir.call"(%x, %w) {callee = @linear_0, device = "cpu"}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mlir import ir
from mlir.dialects import arith, func

from hexir.dialects import hexir as hx
from hexir.dialects import hextir as ht
from hexir.passes.common import main_function

#: Each cuda kernel gets a cpu twin, `<name>_cpu`, tagged with the kernel it stands in for.
FALLBACK_SUFFIX = "_cpu"
FALLBACK_OF = "hextir.fallback_of"


def lower_to_tir(module: ir.Module) -> None:
    """Replace every hexir.linear / hexir.relu with a call to a freshly built kernel."""
    main = main_function(module)
    counter = 0
    for op in list(main.regions[0].blocks[0].operations):
        if op.name not in ("hexir.linear", "hexir.relu"):
            continue
        device = hx.device_of(op)
        kind = op.name.split(".")[1]
        kernel_op = "linear_bias" if kind == "linear" and len(op.operands) == 3 else kind
        name = f"{kind}_{counter}"
        counter += 1
        arg_types = [_memref(v.type) for v in op.operands] + [_memref(op.result.type)]
        with ir.InsertionPoint(main), op.location:
            _kernel(name, arg_types, device, kind, kernel_op)
            if device == "cuda":  # the cpu variant that lets `hexir-run --device=cpu` run it
                fallback = _kernel(name + FALLBACK_SUFFIX, arg_types, "cpu", kind, kernel_op)
                fallback.attributes[FALLBACK_OF] = ir.FlatSymbolRefAttr.get(name)
        with ir.InsertionPoint(op), op.location:
            result = hx.call(name, list(op.operands), op.result.type, device)
        op.result.replace_all_uses_with(result)
        op.erase()


def _kernel(name: str, arg_types: list[ir.Type], device: str, kind: str, kernel_op: str) -> ir.Operation:
    kernel = func.FuncOp(name, ir.FunctionType.get(arg_types, []))
    kernel.operation.attributes[ht.KERNEL] = ht.kernel_attr(device, kernel_op)
    kernel.sym_visibility = ir.StringAttr.get("public")
    block = kernel.add_entry_block()
    with ir.InsertionPoint(block):
        _builder(device, kind)(list(block.arguments))
        func.ReturnOp([])
    return kernel.operation


def _memref(tensor: ir.Type) -> ir.MemRefType:
    shaped = ir.ShapedType(tensor)
    return ir.MemRefType.get(shaped.shape, shaped.element_type)


def _builder(device: str, kind: str) -> Callable[[Sequence[ir.Value]], None]:
    if device == "cuda":
        from hexir.passes import gpu_schedule
        return {"linear": gpu_schedule.linear, "relu": gpu_schedule.relu}[kind]
    return {"linear": cpu_linear, "relu": cpu_relu}[kind]


def _zero(element: ir.Type) -> ir.Value:
    return arith.ConstantOp(element, ir.FloatAttr.get(element, 0.0)).result


def cpu_linear(args: Sequence[ir.Value]) -> None:
    x, w, out = args[0], args[1], args[-1]
    bias = args[2] if len(args) == 4 else None
    (m, k_extent), n = ir.MemRefType(x.type).shape, ir.MemRefType(w.type).shape[1]
    element = ir.MemRefType(out.type).element_type
    with ht.loop(0, m, "parallel") as i:
        with ht.loop(0, n, "serial") as j:
            ht.store(ht.load(bias, [j]) if bias is not None else _zero(element), out, [i, j])
        with ht.loop(0, k_extent, "serial") as k:
            a = ht.load(x, [i, k])
            with ht.loop(0, n, "serial") as j:
                product = arith.MulFOp(a, ht.load(w, [k, j])).result
                ht.store(arith.AddFOp(ht.load(out, [i, j]), product).result, out, [i, j])


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
