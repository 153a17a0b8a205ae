"""cuda schedules for lower-to-tir: every loop bound to a GPU index, every shape guarded.

linear (x[M,K] @ w[K,N] (+ bias)): a 2-D grid of 32x8-thread blocks; threadIdx.x walks
the N axis, so a warp reads 32 consecutive elements of w and writes 32 consecutive
elements of out (coalesced) while all its lanes read the same x[i,k] (a broadcast). Each
thread keeps its sum in a private local buffer (a register after NVVM's mem2reg).

    for bi in [0, ceil(M/8))  bind blockIdx.y        i = bi*8 + ti
      for bj in [0, ceil(N/32)) bind blockIdx.x      j = bj*32 + tj
        for ti in [0, 8)  bind threadIdx.y           if i < M and j < N:
          for tj in [0, 32) bind threadIdx.x            acc = bias[j] or 0; for k serial: acc += x[i,k]*w[k,j]
                                                         out[i,j] = acc
relu: the tensor as one flat axis of 256-thread blocks, guarded by the element count.
The guards make any shape work: 1, primes, sizes that no block size divides.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlir import ir
from mlir.dialects import arith, memref, scf

from hexir.dialects import hextir as ht

LINEAR_BLOCK = (32, 8)      # threads along (N, M)
ELEMENTWISE_BLOCK = 256


def _ceil_div(a: int, b: int) -> int:
    return max(1, -(-a // b))


def _global_index(block: ir.Value, thread: ir.Value, size: int) -> ir.Value:
    return arith.AddIOp(arith.MulIOp(block, ht.index(size)).result, thread).result


def _less(a: ir.Value, bound: int) -> ir.Value:
    return arith.CmpIOp(arith.CmpIPredicate.ult, a, ht.index(bound)).result


def linear(args: Sequence[ir.Value]) -> None:
    x, w, out = args[0], args[1], args[-1]
    bias = args[2] if len(args) == 4 else None
    (m, k_extent), n = ir.MemRefType(x.type).shape, ir.MemRefType(w.type).shape[1]
    element = ir.MemRefType(out.type).element_type
    bx, by = LINEAR_BLOCK
    with ht.loop(0, _ceil_div(m, by), "parallel", "blockIdx.y") as bi, \
            ht.loop(0, _ceil_div(n, bx), "parallel", "blockIdx.x") as bj, \
            ht.loop(0, by, "parallel", "threadIdx.y") as ti, \
            ht.loop(0, bx, "parallel", "threadIdx.x") as tj:
        i, j = _global_index(bi, ti, by), _global_index(bj, tj, bx)
        inside = arith.AndIOp(_less(i, m), _less(j, n)).result
        guard = scf.IfOp(inside)
        with ir.InsertionPoint(guard.then_block):
            acc = ht.alloc_local([1], element)
            zero = ht.index(0)
            initial = ht.load(bias, [j]) if bias is not None else \
                arith.ConstantOp(element, ir.FloatAttr.get(element, 0.0)).result
            ht.store(initial, acc, [zero])
            with ht.loop(0, k_extent, "serial") as k:
                product = arith.MulFOp(ht.load(x, [i, k]), ht.load(w, [k, j])).result
                ht.store(arith.AddFOp(ht.load(acc, [zero]), product).result, acc, [zero])
            ht.store(ht.load(acc, [zero]), out, [i, j])
            scf.YieldOp([])


def relu(args: Sequence[ir.Value]) -> None:
    x, out = args
    shape = ir.MemRefType(x.type).shape
    element = ir.MemRefType(x.type).element_type
    total = 1
    for extent in shape:
        total *= extent
    flat_type = ir.MemRefType.get([total], element)
    reassociation = ir.ArrayAttr.get([ir.ArrayAttr.get(
        [ir.IntegerAttr.get(ir.IntegerType.get_signless(64), d) for d in range(len(shape))])])
    flat_x = memref.CollapseShapeOp(flat_type, x, reassociation).result if len(shape) > 1 else x
    flat_out = memref.CollapseShapeOp(flat_type, out, reassociation).result if len(shape) > 1 else out
    size = ELEMENTWISE_BLOCK
    with ht.loop(0, _ceil_div(total, size), "parallel", "blockIdx.x") as block, \
            ht.loop(0, size, "parallel", "threadIdx.x") as thread:
        position = _global_index(block, thread, size)
        guard = scf.IfOp(_less(position, total))
        with ir.InsertionPoint(guard.then_block):
            zero = arith.ConstantOp(element, ir.FloatAttr.get(element, 0.0)).result
            ht.store(arith.MaximumFOp(ht.load(flat_x, [position]), zero).result, flat_out, [position])
            scf.YieldOp([])
