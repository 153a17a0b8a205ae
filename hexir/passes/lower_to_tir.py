"""lower-to-tir: turn each compute op into a hextir kernel built by its schedule (or, for a
custom kernel, a declaration of the user's code).

Input: a partitioned, fused hexir module. Output: one kernel function per compute op, over
memrefs in destination-passing style (inputs, then the destination, then one `index` per size
symbol its buffers use), and the graph op replaced by `hexir.call @kernel(...)`. constant,
transfer and print stay: they are the host program's business.

This pass only dispatches (a linear whose w pack-weights packed gets the op `linear_panels`
and a request saying so): the op's registration (`hexir/ops.py`) names a schedule per device
(`hexir/schedules/`), which builds the body and returns the kernel's work (cpu) or launch
(cuda) record, kept on the kernel as `hextir.work` / `hextir.launch` for the packager. Each
cuda kernel also gets a cpu twin `<name>_cpu` (`hextir.fallback_of = @<name>`), so a GPU
module still runs on a machine without one. A custom kernel becomes a declaration
`func.func private @relu6_0` tagged `#hextir.kernel<device, "custom">` with
`hextir.custom = {symbol, file}` and its launch record: the user's file is the body.
A cpu kernel is built once per x86-64 level of the target (`hextir.level`), the best level's
under the kernel's own name and the others' as `<name>@<level>`: each level's set becomes one
library of the module, its kernels under their own names.

    %y = "hexir.linear"(%x, %w) {device = "cpu"}     (x: tensor<?x8xf32, "batch">)
  =>
    func.func @linear_0(%x: memref<?x8xf32>, %w: memref<8x4xf32>, %out: memref<?x4xf32>, %batch: index)
        attributes {hextir.kernel = #hextir.kernel<"cpu", "linear">, hextir.sizes = ["batch"],
                    hextir.work = {extent = "ceildiv(batch, 4)", grain = 1 : i64}, ...} {
      scf.for %b = %c0 to %blocks step %c1 { ... } {hextir.schedule = #hextir.loop<"parallel", "">}
    }
    %y = "hexir.call"(%x, %w) {callee = @linear_0, device = "cpu"}
"""

from __future__ import annotations

from dataclasses import replace

from mlir import ir
from mlir.dialects import func

from hexir import ops
from hexir.dialects import hexir as hx
from hexir.dialects import hextir as ht
from hexir.schedules import Request
from hexir.target import Target, check_launch


def lower_to_tir(module: ir.Module, target: Target) -> None:
    """Replace every compute op with a call to a freshly built kernel, and every
    hexir.custom_call with a call to a declaration of the user's kernel."""
    main = hx.main_function(module)
    counter = -1
    for op in [o.operation for o in main.regions[0].blocks[0].operations]:
        definition = ops.lookup(op.name)
        if definition is None and op.name != "hexir.custom_call":
            continue
        counter += 1  # kernels are numbered in program order: linear_0, relu_1, ...
        device = hx.device_of(op)
        kind = hx.string_attr(op, "kernel") if definition is None else definition.name
        name = f"{kind}_{counter}"
        values = [*op.operands, op.result]
        symbols = tuple(dict.fromkeys(d for v in values for d in hx.shape_of(v.type) if isinstance(d, str)))
        arg_types = [_memref(v.type) for v in values] + [ir.IndexType.get()] * len(symbols)
        with ir.InsertionPoint(main), op.location:
            if definition is None:
                _custom_kernels(op, name, arg_types, device)
            else:
                # the optional operands it was given (linear's bias) come first among its epilogues
                optional = [o.rstrip("?") for o in definition.operands[:len(op.operands)] if o.endswith("?")]
                epilogues = (*optional, *hx.epilogues_of(op))
                scalars = {n: ops.REGISTRY[n].scalar for n in (definition.name, *epilogues)
                           if n in ops.REGISTRY and ops.REGISTRY[n].scalar is not None}
                request = Request(definition.name, epilogues, hx.dtype_of(op.result.type), target, symbols, scalars,
                                  panels=hx.has_w_panels(op))
                if device == "cuda":
                    kernel = _kernel(name, arg_types, device, definition, request)
                    launch = ht.record_of(kernel)  # what can be checked before run time: the static axes
                    check_launch(name, [g if isinstance(g, int) else None for g in launch.grid], list(launch.block))
                    variants = definition.variants.get(device, lambda *_: [])(arg_types[:len(values)], request)
                    for variant, _ in variants:  # the schedule's other kernels, chosen per call
                        other = _kernel(f"{name}__{variant}", arg_types, device, definition,
                                        replace(request, variant=variant))
                        ht.set_variant_of(other, name)
                    if variants:
                        ht.set_variants(kernel, [(f"{name}__{variant}", below) for variant, below in variants])
                for level in target.cpu_levels:  # a cpu kernel (or the cuda one's cpu twin) per x86-64 level
                    cpu_name = name if device == "cpu" else name + ht.FALLBACK_SUFFIX
                    at_level = replace(request, target=replace(target, cpu_levels=(level,)))
                    kernel = _kernel(ht.level_name(cpu_name, level, target), arg_types, "cpu", definition, at_level)
                    ht.set_level(kernel, level)
                    if device == "cuda":  # the cpu variant that lets `hexir-run --device=cpu` run it
                        ht.set_fallback_of(kernel, name)
        with ir.InsertionPoint(op), op.location:
            result = hx.call(name, list(op.operands), op.result.type, device)
        op.result.replace_all_uses_with(result)
        op.erase()


def _kernel(name: str, arg_types: list[ir.Type], device: str, definition: ops.OpDef,
            request: Request) -> ir.Operation:
    kernel = func.FuncOp(name, ir.FunctionType.get(arg_types, []))
    op = definition.name + ("_panels" if request.panels else "")  # (linear_panels: docs/hxb-format.md)
    ht.tag_kernel(kernel.operation, device, op, request.epilogues, request.symbols)
    kernel.sym_visibility = ir.StringAttr.get("public")
    block = kernel.add_entry_block()
    buffers = list(block.arguments)[:len(arg_types) - len(request.symbols)]
    symbols = dict(zip(request.symbols, list(block.arguments)[len(buffers):], strict=True))
    with ir.InsertionPoint(block):
        record = definition.schedules[device](buffers, symbols, request)
        func.ReturnOp([])
    ht.set_record(kernel.operation, record)
    return kernel.operation


def _custom_kernels(op: ir.Operation, name: str, arg_types: list[ir.Type], device: str) -> None:
    """Declarations (no body: the user wrote it) carrying what the backend needs to build it;
    a cuda custom kernel with a cpu file gets a cpu twin, as the generated ones do."""
    objects = hx.objects_of(op)
    grid, block = hx.launch_of(op)
    for kernel_device, kernel_name in ((device, name), ("cpu", name + ht.FALLBACK_SUFFIX)):
        if kernel_name != name and (device != "cuda" or "cpu" not in objects):
            continue
        declaration = func.FuncOp(kernel_name, ir.FunctionType.get(arg_types, []), visibility="private")
        ht.tag_kernel(declaration.operation, kernel_device, "custom")
        ht.set_custom(declaration.operation, hx.string_attr(op, "kernel"), objects[kernel_device])
        if kernel_device == "cuda":
            ht.set_record(declaration.operation, ht.Launch(tuple(grid), tuple(block)))
        if kernel_name != name:
            ht.set_fallback_of(declaration.operation, name)


def _memref(tensor: ir.Type) -> ir.MemRefType:
    shaped = ir.ShapedType(tensor)
    return ir.MemRefType.get(shaped.shape, shaped.element_type)
