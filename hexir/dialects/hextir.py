"""The `hextir` dialect: the kernel level — how one device computes one op.

A kernel is a `func.func` over memrefs in destination-passing style (inputs first, the
destination last), tagged `hextir.kernel = #hextir.kernel<"cpu", "linear">`. Its loops are
`scf.for` loops that carry their schedule as a verified hextir attribute, so a scheduling
decision is written in the IR, not implied by which pass ran:

    scf.for %i = %c0 to %c2 step %c1 {
      %a = "hextir.load"(%x, %i, %k) : (memref<2x8xf32>, index, index) -> f32
      "hextir.store"(%v, %out, %i, %j) : (f32, memref<2x4xf32>, index, index) -> ()
    } {hextir.schedule = #hextir.loop<"parallel", "">}

Schedules: kind `serial` | `parallel` | `unrolled`, and bind "" (no binding: on the cpu a
`parallel` outermost loop is split across host threads), `chunk` (a cpu `parallel` loop whose
body runs once per thread's chunk of it: its induction variable is the chunk's first iteration,
`hextir.chunk_end` its end; a 1-row product then streams one thread's whole column range) or
`blockIdx.{x,y,z}` / `threadIdx.{x,y,z}` (the loop *is* that GPU index). `hextir.alloc_local` makes a
kernel-local buffer (`space` "private", "shared" by a GPU block, or "global": device memory
that every block of every launch of a GPU kernel shares, zeroed when the module loads — split-K's
partial sums and counters), `hextir.barrier` synchronizes a GPU block.

Why `scf.for` and not a `hextir.for` op: IRDL cannot give an op the terminator trait, so an
IRDL loop's body could not end in a yield of its own. The loop structure is upstream's; the
schedule — the part that is ours — is an IRDL attribute that the verifier checks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from hexir_runtime.format import exprs
from mlir import ir
from mlir.dialects import arith, scf

from hexir.dialects.irdl_text import one_of

LOOP_KINDS = ("serial", "parallel", "unrolled")
BINDINGS = ("", "chunk", "blockIdx.x", "blockIdx.y", "blockIdx.z", "threadIdx.x", "threadIdx.y", "threadIdx.z")


IRDL = f"""
irdl.dialect @hextir {{
  irdl.attribute @loop {{
{one_of("kind", LOOP_KINDS)}
{one_of("bind", BINDINGS)}
    irdl.parameters(kind: %kind, bind: %bind)
  }}
  irdl.attribute @kernel {{
{one_of("device", ("cpu", "cuda"))}
    %op = irdl.base "#builtin.string"
    irdl.parameters(device: %device, op: %op)
  }}
  irdl.operation @load {{
    %buffer = irdl.base "!builtin.memref"
    %index = irdl.is index
    %value = irdl.any
    irdl.operands(buffer: %buffer, indices: variadic %index)
    irdl.results(value: %value)
  }}
  irdl.operation @store {{
    %value = irdl.any
    %buffer = irdl.base "!builtin.memref"
    %index = irdl.is index
    irdl.operands(value: %value, buffer: %buffer, indices: variadic %index)
  }}
  irdl.operation @barrier {{
  }}
  irdl.operation @chunk_end {{
    %end = irdl.is index
    irdl.results(end: %end)
  }}
  irdl.operation @alloc_local {{
    %buffer = irdl.base "!builtin.memref"
{one_of("space", ("private", "shared", "global"))}
    irdl.attributes {{"space" = %space}}
    irdl.results(buffer: %buffer)
  }}
}}
"""

# Attribute names of the kernel level.
SCHEDULE = "hextir.schedule"        # on a loop: #hextir.loop<kind, bind>
KERNEL = "hextir.kernel"            # on a kernel: #hextir.kernel<device, op>
EXPR = "hextir.expr"               # on a kernel: what it computes per element, as the manifest's `expr` (JSON)
SIZES = "hextir.sizes"              # on a kernel: the symbols it takes as trailing index arguments
DIMS = "hextir.dims"                # on a kernel: each buffer's `?` extents, as size expressions (text)
VIEWS = "hextir.views"              # on a kernel: {arg: shape} for inputs read reshaped in place, or strided
TENSOR_MAPS = "hextir.tensor_maps"  # on a cuda kernel: TMA tensor maps it takes after its sizes (below)
ARCH = "hextir.arch"                # on a cuda kernel variant: the one architecture it is built for (sm_90a)
WORK = "hextir.work"                # on a cpu kernel: its work record (below)
LAUNCH = "hextir.launch"            # on a cuda kernel: its launch record (below)
FALLBACK_OF = "hextir.fallback_of"  # on a cpu twin: @the cuda kernel it stands in for
CUSTOM = "hextir.custom"            # on a custom kernel's declaration: {symbol, file}
LEVEL = "hextir.level"              # on a cpu kernel: the x86-64 level it is built for
VARIANT = "hextir.variant"          # on a kernel: which of its schedule's kernels it is (e.g. "dmma")
VARIANTS = "hextir.variants"        # on a kernel: [{symbol = @k__t32, below = {batch = 1024}}], chosen per call
VARIANT_OF = "hextir.variant_of"    # on such an other kernel: @the kernel it is a variant of
#: Each cuda kernel gets a cpu twin, `<name>_cpu`.
FALLBACK_SUFFIX = "_cpu"
IDENTITY = "hextir.id"             # on a kernel: its KernelId (name, best, variant, twin)
#: The gpu.module that holds the outlined cuda kernels.
GPU_MODULE = "hexir_cuda"


# ---- attributes ------------------------------------------------------------------------
# IRDL attributes have no Python class: they are built by the parser from their parameters
# (each quoted by StringAttr itself, so no value is spliced into syntax unescaped) and read
# back from their printed form. These four functions are the only places that do either.

def _dynamic_attr(mnemonic: str, *params: str) -> ir.Attribute:
    quoted = ", ".join(str(ir.StringAttr.get(p)) for p in params)
    return ir.Attribute.parse(f"#hextir.{mnemonic}<{quoted}>")


def _params(attr: ir.Attribute) -> list[str]:
    return re.findall(r'"((?:[^"\\]|\\.)*)"', str(attr))


def schedule(kind: str, bind: str = "") -> ir.Attribute:
    """`#hextir.loop<kind, bind>`; the verifier rejects unknown kinds and bindings."""
    return _dynamic_attr("loop", kind, bind)


def schedule_of(op: ir.Operation) -> tuple[str, str] | None:
    """(kind, bind) of a scheduled loop, or None for a loop with no schedule."""
    if SCHEDULE not in op.attributes:
        return None
    kind, bind = _params(op.attributes[SCHEDULE])
    return kind, bind


def kernel_attr(device: str, op: str) -> ir.Attribute:
    return _dynamic_attr("kernel", device, op)


def kernel_of(func_op: ir.Operation) -> tuple[str, str] | None:
    """(device, op) of a kernel function, or None for any other function."""
    if KERNEL not in func_op.attributes:
        return None
    device, op = _params(func_op.attributes[KERNEL])
    return device, op


# ---- builders --------------------------------------------------------------------------

def index(value: int | ir.Value) -> ir.Value:
    if isinstance(value, ir.Value):
        return value
    return arith.ConstantOp(ir.IndexType.get(), value).result


@contextmanager
def loop(lower: int | ir.Value, upper: int | ir.Value, kind: str, bind: str = "",
         step: int | ir.Value = 1) -> Iterator[ir.Value]:
    """Build a scheduled loop; the `with` body builds the loop body at the induction variable."""
    for_op = scf.ForOp(index(lower), index(upper), index(step))
    for_op.operation.attributes[SCHEDULE] = schedule(kind, bind)
    with ir.InsertionPoint(for_op.body):
        yield for_op.induction_variable
        scf.YieldOp([])


def fold(lower: int | ir.Value, upper: int | ir.Value, step: int | ir.Value, carried: Sequence[ir.Value],
         body: Callable[[ir.Value, list[ir.Value]], Sequence[ir.Value]]) -> list[ir.Value]:
    """A serial loop carrying values (in registers): carried = body(j, carried) for j in
    range(lower, upper, step); the last carried."""
    walk = scf.ForOp(index(lower), index(upper), index(step), list(carried))
    walk.operation.attributes[SCHEDULE] = schedule("serial")
    with ir.InsertionPoint(walk.body):
        scf.YieldOp(list(body(walk.induction_variable, list(walk.inner_iter_args))))
    return list(walk.results)


@contextmanager
def when(condition: ir.Value) -> Iterator[None]:
    """Build the body of `if condition` (no else, no results) in the `with` block."""
    with ir.InsertionPoint(scf.IfOp(condition).then_block):
        yield
        scf.YieldOp([])


def choose(condition: ir.Value, then: Callable[[], Sequence[ir.Value] | None],
           otherwise: Callable[[], Sequence[ir.Value] | None], types: Sequence[ir.Type] = ()) -> list[ir.Value]:
    """`if condition` with an else: then() or otherwise() builds its branch and gives the values
    it yields (of `types`; None: no values); the if's results."""
    choice = scf.IfOp(condition, list(types), has_else=True)
    for block, build in ((choice.then_block, then), (choice.else_block, otherwise)):
        with ir.InsertionPoint(block):
            scf.YieldOp(list(build() or ()))
    return list(choice.results)


def load(buffer: ir.Value, indices: Sequence[ir.Value]) -> ir.Value:
    element = ir.MemRefType(buffer.type).element_type
    return ir.Operation.create("hextir.load", results=[element], operands=[buffer, *indices]).result


def store(value: ir.Value, buffer: ir.Value, indices: Sequence[ir.Value]) -> None:
    ir.Operation.create("hextir.store", operands=[value, buffer, *indices])


def alloc_local(shape: Sequence[int], element: ir.Type, space: str = "private") -> ir.Value:
    """A kernel-local buffer: "private" to a thread, "shared" by a GPU block (its memref type
    then carries the GPU workgroup address space, as upstream's gpu dialect spells it), or
    "global" to a GPU kernel (a module global: it lives across launches, zeroed at load)."""
    memory_space = ir.Attribute.parse("#gpu.address_space<workgroup>") if space == "shared" else None
    op = ir.Operation.create("hextir.alloc_local",
                             results=[ir.MemRefType.get(list(shape), element, memory_space=memory_space)],
                             attributes={"space": ir.StringAttr.get(space)})
    return op.result


def chunk_end() -> ir.Value:
    """In a cpu `parallel` loop bound to `chunk`: the end of the chunk the body runs for."""
    return ir.Operation.create("hextir.chunk_end", results=[ir.IndexType.get()]).result


def barrier() -> None:
    """Every thread of a GPU block waits here until all have arrived (shared buffers)."""
    ir.Operation.create("hextir.barrier")


# ---- work and launch records -------------------------------------------------------------
# Written once, by the schedule that builds the kernel (from the same size expressions as its
# loops), and read once, by the packager, which copies them into the manifest.

@dataclass(frozen=True)
class Work:
    """A cpu kernel's parallel loop: `extent` iterations, split across threads in chunks of
    at least `grain`; with `spans`, at most one chunk a thread (the loop is bound to `chunk`:
    the kernel walks its chunk as one span)."""

    extent: exprs.Expr
    grain: int = 1
    spans: bool = False


@dataclass(frozen=True)
class Launch:
    """A cuda kernel's launch: grid (expressions), block (threads) and dynamic shared bytes."""

    grid: tuple
    block: tuple[int, int, int]
    shared_bytes: int = 0


def _i64(value: int) -> ir.IntegerAttr:
    return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), value)


def set_record(kernel: ir.Operation, record: Work | Launch) -> None:
    if isinstance(record, Work):
        kernel.attributes[WORK] = ir.DictAttr.get({
            "extent": ir.StringAttr.get(exprs.to_text(record.extent)), "grain": _i64(record.grain),
            **({"spans": ir.BoolAttr.get(True)} if record.spans else {})})
    else:
        kernel.attributes[LAUNCH] = ir.DictAttr.get({
            "grid": ir.ArrayAttr.get([ir.StringAttr.get(exprs.to_text(e)) for e in record.grid]),
            "block": ir.DenseI64ArrayAttr.get(list(record.block)), "shared_bytes": _i64(record.shared_bytes)})


def record_of(kernel: ir.Operation) -> Work | Launch | None:
    if WORK in kernel.attributes:
        work = ir.DictAttr(kernel.attributes[WORK])
        return Work(exprs.parse(ir.StringAttr(work["extent"]).value), ir.IntegerAttr(work["grain"]).value,
                    "spans" in work)
    if LAUNCH in kernel.attributes:
        launch = ir.DictAttr(kernel.attributes[LAUNCH])
        grid = tuple(exprs.parse(ir.StringAttr(e).value) for e in ir.ArrayAttr(launch["grid"]))
        return Launch(grid, tuple(ir.DenseI64ArrayAttr(launch["block"])), ir.IntegerAttr(launch["shared_bytes"]).value)
    return None


def size_value(expr: exprs.Expr, symbols: dict[str, ir.Value]) -> ir.Value:
    """The index value of a size expression, built from the kernel's size arguments."""
    if isinstance(expr, int):
        return index(expr)
    if isinstance(expr, str):
        return symbols[expr]
    op, a, b = expr
    a, b = size_value(a, symbols), size_value(b, symbols)
    if op == "ceildiv":
        return arith.CeilDivUIOp(a, b).result
    make = {"mul": arith.MulIOp, "add": arith.AddIOp, "min": arith.MinUIOp, "max": arith.MaxUIOp}[op]
    return make(a, b).result


# ---- kernel attributes and finders -------------------------------------------------------

def _strings(values: Sequence[str]) -> ir.ArrayAttr:
    return ir.ArrayAttr.get([ir.StringAttr.get(v) for v in values])


def _read_strings(op: ir.Operation, name: str) -> tuple[str, ...]:
    if name not in op.attributes:
        return ()
    return tuple(ir.StringAttr(a).value for a in ir.ArrayAttr(op.attributes[name]))


def tag_kernel(kernel: ir.Operation, device: str, op: str, expr: object = None,
               symbols: Sequence[str] = ()) -> None:
    """Tag a kernel with its device and family op, its `expr` (a JSON value: a tree, a reduce
    program; None for none) and its size symbols."""
    kernel.attributes[KERNEL] = kernel_attr(device, op)
    if expr is not None:
        kernel.attributes[EXPR] = ir.StringAttr.get(json.dumps(expr, separators=(",", ":")))
    kernel.attributes[SIZES] = _strings(symbols)


def set_dims(kernel: ir.Operation, shapes: Sequence[Sequence[exprs.Expr]]) -> None:
    """Record each buffer argument's symbolic extents (`mul(batch, seq)` where a kernel views
    [batch, seq, K] as rows): tir-to-loops re-views its bare pointers with them."""
    kernel.attributes[DIMS] = ir.ArrayAttr.get(
        [_strings([exprs.to_text(d) for d in shape if not isinstance(d, int)]) for shape in shapes])


def dims_of(kernel: ir.Operation) -> list[list[exprs.Expr]]:
    """Per buffer argument, its symbolic extents in order (`set_dims`)."""
    if DIMS not in kernel.attributes:
        return []
    return [[exprs.parse(ir.StringAttr(d).value) for d in ir.ArrayAttr(shape)]
            for shape in ir.ArrayAttr(kernel.attributes[DIMS])]


def set_views(kernel: ir.Operation, views: dict[int, Sequence[int | str] | dict]) -> None:
    """The args a kernel reads as another shape of their buffer (a free reshape): arg -> shape, or
    reads or writes strided (attention's q, k, v, out): arg -> {shape, axes, start} (JSON)."""
    kernel.attributes[VIEWS] = ir.StringAttr.get(json.dumps(views, separators=(",", ":")))


def views_of(kernel: ir.Operation) -> dict[int, list[int | str] | dict]:
    return {int(i): view for i, view in json.loads(ir.StringAttr(kernel.attributes[VIEWS]).value).items()} \
        if VIEWS in kernel.attributes else {}


def set_tensor_maps(kernel: ir.Operation, maps: Sequence[tuple[int, Sequence[int]]]) -> None:
    """The TMA tensor maps a cuda kernel takes as pointer parameters after its sizes, in order:
    (buffer argument, box extents innermost first); the runtime encodes each per call for the
    buffer's address and extents (128-byte swizzle, out-of-bounds elements read as zeros)."""
    kernel.attributes[TENSOR_MAPS] = ir.StringAttr.get(json.dumps([{"arg": a, "box": list(box)} for a, box in maps]))


def arch_of(kernel: ir.Operation) -> str | None:
    """The one architecture a cuda kernel variant is for (its image alone holds it), or None."""
    return ir.StringAttr(kernel.attributes[ARCH]).value if ARCH in kernel.attributes else None


def tensor_maps_of(kernel: ir.Operation) -> list[dict]:
    return json.loads(ir.StringAttr(kernel.attributes[TENSOR_MAPS]).value) if TENSOR_MAPS in kernel.attributes else []


def expr_of(kernel: ir.Operation) -> object:
    """A kernel's `expr` as JSON, or None."""
    return json.loads(ir.StringAttr(kernel.attributes[EXPR]).value) if EXPR in kernel.attributes else None


def sizes_of(kernel: ir.Operation) -> tuple[str, ...]:
    """The symbols a kernel takes as index arguments after its buffers, in order."""
    return _read_strings(kernel, SIZES)


def name_of(kernel: ir.Operation) -> str:
    return ir.StringAttr(kernel.attributes["sym_name"]).value


def fallback_of(kernel: ir.Operation) -> str | None:
    """The cuda kernel a cpu twin stands in for, or None."""
    return ir.FlatSymbolRefAttr(kernel.attributes[FALLBACK_OF]).value if FALLBACK_OF in kernel.attributes else None


def set_fallback_of(kernel: ir.Operation, name: str) -> None:
    kernel.attributes[FALLBACK_OF] = ir.FlatSymbolRefAttr.get(name)


def set_variant(variant: str) -> None:
    """Name the variant of the kernel being built (called by a schedule inside its body)."""
    kernel = ir.InsertionPoint.current.block.owner
    kernel.attributes[VARIANT] = ir.StringAttr.get(variant)


def set_variants(kernel: ir.Operation, variants: Sequence[tuple[str, dict[str, int]]]) -> None:
    kernel.attributes[VARIANTS] = ir.ArrayAttr.get([ir.DictAttr.get({
        "symbol": ir.FlatSymbolRefAttr.get(symbol),
        "below": ir.DictAttr.get({name: _i64(bound) for name, bound in below.items()})}) for symbol, below in variants])


def variants_of(kernel: ir.Operation) -> list[tuple[str, dict[str, int]]]:
    """A kernel's other kernels and the sizes below which each runs instead of it."""
    if VARIANTS not in kernel.attributes:
        return []
    found = []
    for entry in ir.ArrayAttr(kernel.attributes[VARIANTS]):
        entry = ir.DictAttr(entry)
        below = {named.name: ir.IntegerAttr(named.attr).value for named in ir.DictAttr(entry["below"])}
        found.append((ir.FlatSymbolRefAttr(entry["symbol"]).value, below))
    return found


def variant_of(kernel: ir.Operation) -> str | None:
    return ir.FlatSymbolRefAttr(kernel.attributes[VARIANT_OF]).value if VARIANT_OF in kernel.attributes else None


def set_variant_of(kernel: ir.Operation, name: str) -> None:
    kernel.attributes[VARIANT_OF] = ir.FlatSymbolRefAttr.get(name)


@dataclass(frozen=True)
class KernelId:
    """Who a kernel is: the op instance it computes (`name`, linear_0), its device, the x86-64
    `level` a cpu kernel is built for (`best`: the target's best one), the schedule's `variant`
    (one of the kernels the runtime picks from per call) and whether it is the cpu `twin` of the
    cuda kernel `name`. Its names are made here and nowhere else: `symbol` in its library or
    image, `function` in the module (a level other than the best one's copy has its own)."""

    name: str
    device: str
    level: str | None = None
    best: bool = True
    variant: str | None = None
    twin: bool = False

    @property
    def symbol(self) -> str:
        return self.name + (f"__{self.variant}" if self.variant else "") + (FALLBACK_SUFFIX if self.twin else "")

    @property
    def function(self) -> str:
        return self.symbol if self.best else f"{self.symbol}@{self.level}"


def set_identity(kernel: ir.Operation, identity: KernelId) -> None:
    """Record `identity` on the kernel (its level as `hextir.level`, which the backends read)."""
    fields = {"name": ir.StringAttr.get(identity.name), "best": ir.BoolAttr.get(identity.best),
              "twin": ir.BoolAttr.get(identity.twin)}
    if identity.variant:
        fields["variant"] = ir.StringAttr.get(identity.variant)
    kernel.attributes[IDENTITY] = ir.DictAttr.get(fields)
    if identity.level:
        kernel.attributes[LEVEL] = ir.StringAttr.get(identity.level)


def identity_of(kernel: ir.Operation) -> KernelId:
    """A kernel's KernelId (one with none, written by hand, is its own name at the best level)."""
    if IDENTITY not in kernel.attributes:
        return KernelId(name_of(kernel), kernel_of(kernel)[0], level_of(kernel))
    fields = ir.DictAttr(kernel.attributes[IDENTITY])
    return KernelId(ir.StringAttr(fields["name"]).value, kernel_of(kernel)[0], level_of(kernel),
                    ir.BoolAttr(fields["best"]).value,
                    ir.StringAttr(fields["variant"]).value if "variant" in fields else None,
                    ir.BoolAttr(fields["twin"]).value)


def level_of(kernel: ir.Operation) -> str | None:
    """The x86-64 level a cpu kernel is built for (None: a cuda kernel or a custom declaration)."""
    return ir.StringAttr(kernel.attributes[LEVEL]).value if LEVEL in kernel.attributes else None


def set_custom(kernel: ir.Operation, symbol: str, file: str) -> None:
    kernel.attributes[CUSTOM] = ir.DictAttr.get({"symbol": ir.StringAttr.get(symbol), "file": ir.StringAttr.get(file)})


def custom_of(kernel: ir.Operation) -> tuple[str, str] | None:
    """(symbol, file) of a custom kernel's declaration, or None for a generated kernel."""
    if CUSTOM not in kernel.attributes:
        return None
    info = ir.DictAttr(kernel.attributes[CUSTOM])
    return ir.StringAttr(info["symbol"]).value, ir.StringAttr(info["file"]).value


def kernels(module: ir.Module, device: str | None = None) -> list[ir.Operation]:
    """The kernel functions of a module (tagged hextir.kernel), optionally of one device:
    `func.func`s at the top level and, once outlined, `gpu.func`s inside `gpu.module`s."""
    candidates = []
    for op in module.body.operations:
        if op.operation.name == "func.func":
            candidates.append(op.operation)
        elif op.operation.name == "gpu.module":
            candidates.extend(inner.operation for inner in op.regions[0].blocks[0].operations)
    found = []
    for op in candidates:
        tag = kernel_of(op) if op.name in ("func.func", "gpu.func") else None
        if tag is not None and (device is None or tag[0] == device):
            found.append(op)
    return found


def generated_kernels(module: ir.Module, device: str | None = None) -> list[ir.Operation]:
    """The kernels hexir writes the body of (not the declarations of custom kernels)."""
    return [k for k in kernels(module, device) if len(k.regions[0].blocks) > 0]
