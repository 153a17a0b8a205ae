"""lower-to-tir: turn each compute op into a hextir kernel built by its schedule (or, for a
custom kernel, a declaration of the user's code).

Input: a partitioned, fused hexir module. Output: one kernel function per compute op, over
memrefs in destination-passing style (inputs, then the destination, then one `index` per size
symbol its buffers use), and the graph op replaced by `hexir.call @kernel(...)`. constant,
transfer and print stay: they are the host program's business.

This pass only dispatches (a linear whose w pack-weights packed gets the op `linear_panels`
and a request saying so; a cpu linear whose w comes at run time, where the cpu schedule's
`packs_w` says so, gets a `pack_panels` kernel called on w before it, and reads its result as
`linear_panels`): the op's registration (`hexir/ops.py`) names a schedule per device
(`hexir/schedules/`), which builds the body and returns the kernel's work (cpu) or launch
(cuda) record, kept on the kernel as `hextir.work` / `hextir.launch` for the packager. Each
cuda kernel also gets a cpu twin `<name>_cpu` (`hextir.fallback_of = @<name>`), so a GPU
module still runs on a machine without one. A custom kernel becomes a declaration
`func.func private @relu6_0` tagged `#hextir.kernel<device, "custom">` with
`hextir.custom = {symbol, file}` and its launch record: the user's file is the body.
A cpu kernel is built once per x86-64 level of the target (`hextir.level`), the best level's
under the kernel's own name and the others' as `<name>@<level>`: each level's set becomes one
library of the module, its kernels under their own names. A cpu twin is built for the lowest
level alone (a fallback: the backend links its one build into every level's library).

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

import json
from dataclasses import replace

import numpy as np
from hexir_runtime.format import exprs, scalars
from mlir import ir
from mlir.dialects import func

from hexir import ops
from hexir.dialects import hexir as hx
from hexir.dialects import hextir as ht
from hexir.errors import CompileError
from hexir.passes import fuse
from hexir.passes.attention import VIEWS
from hexir.schedules import Builder, Request, cpu
from hexir.schedules.cuda_tiles import variant_arch
from hexir.target import Target, check_launch


def lower_to_tir(module: ir.Module, target: Target, precision: str = "highest") -> None:
    """Replace every compute op with a call to a freshly built kernel, and every
    hexir.custom_call with a call to a declaration of the user's kernel."""
    main = hx.main_function(module)
    counter = -1
    free = _free_reshapes(main)
    for op in [o.operation for o in main.regions[0].blocks[0].operations]:
        definition = ops.lookup(op.name)
        if definition is None and op.name != "hexir.custom_call" or any(op == f for f in free):
            continue
        counter += 1  # kernels are numbered in program order: linear_0, relu_1, ...
        device = hx.device_of(op)
        kind = hx.string_attr(op, "kernel") if definition is None else definition.name
        name = f"{kind}_{counter}"
        operands, packed = list(op.operands), _packs_at_run_time(op, device)
        if packed:  # w packed by a kernel of its own, launched first
            operands[1] = _pack_call(main, op, counter, target)
        values = [*operands, op.result]
        symbols = tuple(dict.fromkeys(d for v in values for d in hx.shape_of(v.type) if isinstance(d, str)))
        shapes = [hx.shape_of(v.type) for v in values]
        if definition is not None and definition.family == "contract" and getattr(definition, "rows", False):
            shapes = _as_rows(shapes, hx.operand_groups(op))
        views = {int(i): {**view, "buffer": list(hx.shape_of(values[int(i)].type))} for i, view in json.loads(
            hx.string_attr(op, VIEWS)).items()} if VIEWS in op.attributes else {}  # (strided: attention's)
        shapes = [tuple(views[i]["shape"]) if i in views else shape for i, shape in enumerate(shapes)]
        arg_types = [_memref(v.type, shape, i in views) for i, (v, shape) in enumerate(zip(values, shapes,
                                                                                          strict=True))]
        arg_types += [ir.IndexType.get()] * len(symbols)
        # an operand a free reshape made: the kernel reads the reshape's source as its view
        for i, value in enumerate(operands if definition is not None else ()):
            while (owner := _owner(value)) is not None and any(owner == f for f in free):
                value = owner.operands[0]
            if value != operands[i]:
                operands[i], views[i] = value, hx.shape_of(operands[i].type)
        with ir.InsertionPoint(main), op.location:
            if definition is None:
                _custom_kernels(op, name, arg_types, device)
            else:
                request, record = _request(op, definition, target, symbols, packed)
                request = replace(request, shapes=tuple(map(tuple, shapes)),
                                  precision=precision if definition.family == "contract" else "highest")
                schedules = ops.schedules_of(definition)
                if device == "cuda":
                    kernel = _kernel(ht.KernelId(name, device), arg_types, schedules[device], request, record)
                    launch = ht.record_of(kernel)  # what can be checked before run time: the static axes
                    check_launch(name, [g if isinstance(g, int) else None for g in launch.grid], list(launch.block))
                    variants = getattr(definition, "variants", {}).get(device, lambda *_: [])(arg_types[:len(values)],
                                                                                              request)
                    others = [ht.KernelId(name, device, variant=variant) for variant, _ in variants]
                    for other in others:  # the schedule's other kernels, chosen per call (or per image)
                        arch = variant_arch(other.variant)
                        chosen = replace(request, variant=other.variant, target=replace(
                            request.target, cuda_archs=(arch,))) if arch else replace(request, variant=other.variant)
                        built = _kernel(other, arg_types, schedules[device], chosen, record)
                        ht.set_variant_of(built, name)
                        if arch:
                            built.attributes[ht.ARCH] = ir.StringAttr.get(arch)
                    if variants:
                        ht.set_variants(kernel, [(o.function, below) for o, (_, below) in zip(others, variants,
                                                                                              strict=True)])
                for kernel in [] if request.w_kmajor else _cpu_kernels(
                        name, device == "cuda", arg_types, schedules["cpu"], request, record):
                    # (the cpu twin lets `hexir-run --device=cpu` run it; the cpu kernels read no w^T)
                    if device == "cuda":
                        ht.set_fallback_of(kernel, name)
        for kernel in ht.kernels(module) if views else ():
            if ht.identity_of(kernel).name == name:
                ht.set_views(kernel, views)
        with ir.InsertionPoint(op), op.location:
            result = hx.call(name, operands, op.result.type, device)
        op.result.replace_all_uses_with(result)
        op.erase()
    for op in reversed(free):  # (a chain's last first: nothing reads them now)
        op.erase()


def _owner(value: ir.Value) -> ir.Operation | None:
    owner = value.owner
    return None if isinstance(owner, ir.Block) else (owner.operation if hasattr(owner, "operation") else owner)


def _free_reshapes(main: ir.Operation) -> list[ir.Operation]:
    """The reshapes no kernel needs: each of their users is a generated kernel's op (or another
    free reshape) on their device, which reads the reshape's source in place as its view."""
    reshapes = [o.operation for o in main.regions[0].blocks[0].operations if o.operation.name == "hexir.reshape"]
    free: list[ir.Operation] = []
    for op in reversed(reshapes):  # a chain's users before it
        uses = [(_owner(use.owner.results[0]) if use.owner.results else use.owner, use.operand_number)
                for use in op.result.uses]
        if uses and all((any(u == f for f in free) or ops.lookup(u.name) is not None and u.name != "hexir.reshape")
                        and hx.device_of(u) == hx.device_of(op) and (u.name, n) != ("hexir.linear", 1)
                        and VIEWS not in u.attributes  # (a strided view's strides are the buffer's own)
                        for u, n in uses):  # (a linear's w may be packed by a kernel of its own)
            free.append(op)
    return free[::-1]


def _packs_at_run_time(op: ir.Operation, device: str) -> bool:
    """Whether a cpu linear's w, known only at run time (pack-weights packed the constant ones),
    is packed in panels by a kernel launched before it (the cpu schedule's `packs_w`)."""
    if not ops.reads_weights(op) or device != "cpu" or hx.has_w_panels(op):
        return False
    return cpu.packs_w(rows(hx.shape_of(op.operands[0].type)), hx.shape_of(op.operands[1].type)[1],
                       hx.dtype_of(op.result.type))


def rows(shape: hx.Shape) -> exprs.Expr:
    """The rows of x[..., K] seen as a matrix: the product of its leading extents."""
    product: exprs.Expr = 1
    for dim in shape[:-1]:
        product = exprs.mul(product, dim)
    return product


def _as_rows(shapes: list[hx.Shape], groups: list[list[ir.Value]]) -> list[tuple]:
    """A linear's buffers as its kernel sees them: x[..., K] as [rows, K], its output and an
    epilogue input of the output's leading axes as [rows, N], one whose leading axes are 1 as
    [1, N] (fuse.rows_alike); w and the bias as they are."""
    out = shapes[-1]
    if len(out) == 2:
        return shapes
    first_extra = len(shapes) - 1 - sum(len(g) for g in groups[3:])
    flat = [(rows(shapes[0]), shapes[0][-1]), *shapes[1:first_extra]]
    for shape in shapes[first_extra:-1]:
        if not fuse.rows_alike(shape, out):
            raise CompileError(f"linear: an epilogue input of shape {list(shape)} cannot be read as rows of "
                               f"the output {list(out)}")
        lead = rows(shape) if tuple(shape[:-1]) == tuple(out[:-1]) else 1
        flat.append(shape if len(shape) < 2 else (lead, shape[-1]))
    return [*flat, (rows(out), out[-1])]


def _pack_call(main: ir.Operation, op: ir.Operation, counter: int, target: Target) -> ir.Value:
    """Build `pack_panels_<counter>` (per x86-64 level) and call it on the linear's w, before
    the linear: the result is w in panels of PANEL_BYTES, as pack-weights lays out a constant."""
    w = op.operands[1]
    (k, n), dtype = hx.shape_of(w.type), hx.dtype_of(w.type)
    lanes = cpu.PANEL_BYTES // np.dtype(dtype).itemsize
    panels = ir.RankedTensorType.get([-(-n // lanes), k, lanes], ir.RankedTensorType(w.type).element_type)
    name = f"pack_panels_{counter}"
    with ir.InsertionPoint(main), op.location:
        _cpu_kernels(name, False, [_memref(w.type), _memref(panels)], cpu.pack_panels,
                     Request("pack_panels", dtype, target, shapes=((k, n), tuple(panels.shape))))
    with ir.InsertionPoint(op), op.location:
        return hx.call(name, [w], panels, "cpu")


def _request(op: ir.Operation, definition: ops.OpDef, target: Target, symbols: tuple[str, ...],
             packed: bool) -> tuple[Request, object]:
    """What the op's schedule builds, and the kernel's `expr` as the manifest records it."""
    dtype = hx.dtype_of(op.operands[0].type)
    expr = hx.expr_of(op)
    if definition.family in ("pointwise", "layout"):  # (a layout's expr is its record)
        return Request(definition.family, dtype, target, symbols, expr), expr
    if definition.family == "reduce":
        program = scalars.Program(expr["axis"], tuple((k, t) for k, t in expr["reductions"]), expr["out"])
        return Request("reduce", dtype, target, symbols, program), expr
    # a contract (linear, matmul): its epilogue is a tree over its sums, bias added (["arg", 0]), and
    # its other inputs (["arg", i]); the manifest's is over the product (arg 0), the bias, the others
    groups, named = hx.operand_groups(op), len(definition.operands)
    bias, extras = definition.operands[2:] == ("bias?",) and len(groups[2]) == 1, sum(len(g) for g in groups[named:])
    sums = ["add", ["arg", 0], ["arg", 1]] if bias else ["arg", 0]
    record = sums if expr is None else \
        scalars.substitute(expr, [sums, *(["arg", 1 + bias + i] for i in range(extras))])
    return Request(definition.name, dtype, target, symbols, expr, bias, extras,
                   panels=hx.has_w_panels(op) or packed, w_kmajor=hx.has_w_panels(op, hx.W_KMAJOR)), record


def _cpu_kernels(name: str, twin: bool, arg_types: list[ir.Type], build: Builder, request: Request,
                 record: object = None) -> list[ir.Operation]:
    """A cpu kernel per x86-64 level of the target; the cpu `twin` of the cuda kernel `name` at its
    baseline (lowest) level alone: a fallback, built once and linked into every level's library."""
    kernels = []
    levels = request.target.cpu_levels[-1:] if twin else request.target.cpu_levels
    for level in levels:
        at_level = replace(request, target=replace(request.target, cpu_levels=(level,)))
        identity = ht.KernelId(name, "cpu", level, twin or level == request.target.cpu, twin=twin)
        kernels.append(_kernel(identity, arg_types, build, at_level, record))
    return kernels


def _kernel(identity: ht.KernelId, arg_types: list[ir.Type], build: Builder, request: Request,
            record: object) -> ir.Operation:
    kernel = func.FuncOp(identity.function, ir.FunctionType.get(arg_types, []))
    op = request.op + ("_panels" if request.panels else "_t" if request.w_kmajor else "")  # (docs/hxb-format.md)
    ht.tag_kernel(kernel.operation, identity.device, op, record, request.symbols)
    ht.set_dims(kernel.operation, request.shapes)
    ht.set_identity(kernel.operation, identity)
    kernel.sym_visibility = ir.StringAttr.get("public")
    block = kernel.add_entry_block()
    buffers = list(block.arguments)[:len(arg_types) - len(request.symbols)]
    symbols = dict(zip(request.symbols, list(block.arguments)[len(buffers):], strict=True))
    with ir.InsertionPoint(block):
        record = build(buffers, symbols, request)
        func.ReturnOp([])
    ht.set_record(kernel.operation, record)
    return kernel.operation


def _custom_kernels(op: ir.Operation, name: str, arg_types: list[ir.Type], device: str) -> None:
    """Declarations (no body: the user wrote it) carrying what the backend needs to build it;
    a cuda custom kernel with a cpu file gets a cpu twin, as the generated ones do."""
    objects = hx.objects_of(op)
    grid, block = hx.launch_of(op)
    for identity in (ht.KernelId(name, device), ht.KernelId(name, "cpu", twin=True)):
        if identity.twin and (device != "cuda" or "cpu" not in objects):
            continue
        kernel_device, kernel_name = identity.device, identity.function
        declaration = func.FuncOp(kernel_name, ir.FunctionType.get(arg_types, []), visibility="private")
        ht.tag_kernel(declaration.operation, kernel_device, "custom")
        ht.set_identity(declaration.operation, identity)
        ht.set_custom(declaration.operation, hx.string_attr(op, "kernel"), objects[kernel_device])
        if kernel_device == "cuda":
            ht.set_record(declaration.operation, ht.Launch(tuple(grid), tuple(block)))
        if kernel_name != name:
            ht.set_fallback_of(declaration.operation, name)


def _memref(tensor: ir.Type, shape: tuple | None = None, strided: bool = False) -> ir.MemRefType:
    """The kernel's view of a tensor: its `shape` (default: the tensor's), `?` for a symbolic extent;
    `strided`: its strides and offset those tir-to-loops gives it (the last stride 1)."""
    shaped = ir.ShapedType(tensor)
    dims = shaped.shape if shape is None else [d if isinstance(d, int) else ir.ShapedType.get_dynamic_size()
                                               for d in shape]
    dynamic = ir.ShapedType.get_dynamic_stride_or_offset()
    layout = ir.StridedLayoutAttr.get(dynamic, [dynamic] * (len(dims) - 1) + [1]) if strided else None
    return ir.MemRefType.get(dims, shaped.element_type, layout)
