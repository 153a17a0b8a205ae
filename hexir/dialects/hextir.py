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
`parallel` outermost loop is split across host threads) or `blockIdx.{x,y,z}` /
`threadIdx.{x,y,z}` (the loop *is* that GPU index). `hextir.alloc_local` makes a
kernel-local buffer (`space` "private" or "shared" by a GPU block), `hextir.barrier`
synchronizes a GPU block.

Why `scf.for` and not a `hextir.for` op: IRDL cannot give an op the terminator trait, so an
IRDL loop's body could not end in a yield of its own. The loop structure is upstream's; the
schedule — the part that is ours — is an IRDL attribute that the verifier checks.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from mlir import ir
from mlir.dialects import arith, scf

from hexir.dialects.irdl_text import one_of

LOOP_KINDS = ("serial", "parallel", "unrolled")
BINDINGS = ("", "blockIdx.x", "blockIdx.y", "blockIdx.z", "threadIdx.x", "threadIdx.y", "threadIdx.z")
KERNEL_OPS = ("linear", "linear_bias", "linear_relu", "linear_bias_relu", "relu", "custom")


IRDL = f"""
irdl.dialect @hextir {{
  irdl.attribute @loop {{
{one_of("kind", LOOP_KINDS)}
{one_of("bind", BINDINGS)}
    irdl.parameters(kind: %kind, bind: %bind)
  }}
  irdl.attribute @kernel {{
{one_of("device", ("cpu", "cuda"))}
{one_of("op", KERNEL_OPS)}
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
  irdl.operation @alloc_local {{
    %buffer = irdl.base "!builtin.memref"
{one_of("space", ("private", "shared"))}
    irdl.attributes {{"space" = %space}}
    irdl.results(buffer: %buffer)
  }}
}}
"""

SCHEDULE = "hextir.schedule"
KERNEL = "hextir.kernel"


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
def loop(lower: int | ir.Value, upper: int | ir.Value, kind: str, bind: str = "") -> Iterator[ir.Value]:
    """Build a scheduled loop; the `with` body builds the loop body at the induction variable."""
    for_op = scf.ForOp(index(lower), index(upper), index(1))
    for_op.operation.attributes[SCHEDULE] = schedule(kind, bind)
    with ir.InsertionPoint(for_op.body):
        yield for_op.induction_variable
        scf.YieldOp([])


def load(buffer: ir.Value, indices: Sequence[ir.Value]) -> ir.Value:
    element = ir.MemRefType(buffer.type).element_type
    return ir.Operation.create("hextir.load", results=[element], operands=[buffer, *indices]).result


def store(value: ir.Value, buffer: ir.Value, indices: Sequence[ir.Value]) -> None:
    ir.Operation.create("hextir.store", operands=[value, buffer, *indices])


def alloc_local(shape: Sequence[int], element: ir.Type, space: str = "private") -> ir.Value:
    """A kernel-local buffer: "private" to a thread, or "shared" by a GPU block (its memref
    type then carries the GPU workgroup address space, as upstream's gpu dialect spells it)."""
    memory_space = ir.Attribute.parse("#gpu.address_space<workgroup>") if space == "shared" else None
    op = ir.Operation.create("hextir.alloc_local",
                             results=[ir.MemRefType.get(list(shape), element, memory_space=memory_space)],
                             attributes={"space": ir.StringAttr.get(space)})
    return op.result


def barrier() -> None:
    """Every thread of a GPU block waits here until all have arrived (shared buffers)."""
    ir.Operation.create("hextir.barrier")
