"""pack-weights: a cpu linear whose weights are a constant reads them in panels, packed here
once, so that its kernel neither copies nor strides through w at run time.

Input: a partitioned, fused hexir module. Each `hexir.linear` on the cpu whose `w[K, N]` is a
`hexir.constant` takes instead a constant of w's columns cut in panels of `PANEL_BYTES` (the
widest micro-kernel's NR, on every x86-64 level: 32 float32 or 16 float64 columns), each one
K-major: panels[p, k, j] = w[k, p * L + j], zeros past N. A micro-kernel of NR columns (NR
divides L) then streams its slice of a panel contiguously, 128 bytes a k; no tile copies w's
block any more. The linear is marked `hexir.w_panels`, and lower-to-tir makes its kernel's op
`linear_panels` (docs/hxb-format.md). A weight that only 1-row products read comes in panels of a
column tile's width instead (`NC_BYTES`, 512 bytes): a tile's share of w is then one contiguous
stream, where its four 128-byte panels were four (it reads each panel once: there are no row
groups to share its slices, which a wider panel would spread over more cache sets); products
of more rows were slower with it, so they keep 128 (docs/tuning.md, "CPU panels for 1-row
weights"). (A w known only at run time is packed in the same panels by a kernel that
lower-to-tir adds: schedules/cpu.py's `pack_panels`.) A weight no other op uses is dropped; a cuda linear's
(its cpu twin's too) stays as it is, and so does a weight of L columns or fewer: its rows,
at most a panel's width (128 bytes; 512 for one only 1-row products read), are one contiguous
stream already, which panels would only pad (an N = 1 weight 32 times over, in f32).

    %w = "hexir.constant"() {name = "W1", value = dense<...> : tensor<784x512xf64>, device = "cpu"}
    %y = "hexir.linear"(%x, %w) {device = "cpu"}
  =>
    %p = "hexir.constant"() {name = "W1.panels", value = dense<...> : tensor<32x784x16xf64>, device = "cpu"}
    %y = "hexir.linear"(%x, %p) {device = "cpu", hexir.w_panels}
"""

from __future__ import annotations

import numpy as np
from mlir import ir

from hexir import ops
from hexir.dialects import hexir as hx
from hexir.schedules.cpu import NC_BYTES, PANEL_BYTES
from hexir.target import Target


def pack_weights(module: ir.Module, target: Target | None = None, precision: str = "highest") -> None:
    """Give every cpu linear with a constant w a packed copy of it (see the module's docstring),
    and every cuda TF32 linear one transposed for wgmma, where sm_90a is a target; linears sharing
    a weight share its copy."""
    packed: dict[ir.Operation, ir.Value | None] = {}  # constant -> its panels (None: left as it is)
    for op in list(hx.main_function(module).regions[0].blocks[0].operations):
        op = op.operation
        if not ops.reads_weights(op) or isinstance(op.operands[1].owner, ir.Block):
            continue
        source, device = op.operands[1].owner.operation, hx.device_of(op)
        kmajor = device == "cuda" and target is not None and _kmajor(op, target, precision)
        if source.name != "hexir.constant" or device != "cpu" and not kmajor:
            continue
        if source not in packed:
            packed[source] = _transposed(source) if kmajor else _panels(source)
        if packed[source] is None:
            continue
        op.operands[1] = packed[source]
        hx.set_w_panels(op, hx.W_KMAJOR if kmajor else hx.W_PANELS)
        if not list(source.result.uses):
            del packed[source]
            source.erase()


def _panels(source: ir.Operation) -> ir.Value | None:
    """A constant of `source`'s panels, placed where it is (the program keeps its order); None for
    a weight of one panel's columns or fewer, whose rows lie side by side already."""
    _, n = hx.shape_of(source.result.type)
    lanes = (NC_BYTES if _one_row_only(source) else PANEL_BYTES) // np.dtype(hx.dtype_of(source.result.type)).itemsize
    if n <= lanes:
        return None
    w = hx.constant_array(source)
    count = -(-n // lanes)
    panels = np.zeros((w.shape[0], count * lanes), w.dtype)
    panels[:, :n] = w
    with ir.InsertionPoint(source), source.location:
        return hx.constant(panels.reshape(w.shape[0], count, lanes).transpose(1, 0, 2),
                           hx.string_attr(source, "name") + ".panels", "cpu")


def _kmajor(op: ir.Operation, target: Target, precision: str) -> bool:
    """A cuda linear in TF32 whose wgmma (sm_90a) reads w K-major: rows of 16 bytes for TMA."""
    return op.name == "hexir.linear" and precision == "tf32" and "sm_90a" in target.cuda_archs and \
        hx.dtype_of(op.result.type) == "float32" and hx.shape_of(op.operands[1].type)[0] % 4 == 0


def _transposed(source: ir.Operation) -> ir.Value:
    """w^T [N, K], rounded to TF32 as the tensor cores' inputs are (to nearest, ties away: cvt.rna)."""
    w = hx.constant_array(source)
    bits = w.view(np.uint32)
    rounded = np.where(np.isfinite(w), (bits + 0x1000) & 0xFFFFE000, bits).view(np.float32)
    with ir.InsertionPoint(source), source.location:
        return hx.constant(np.ascontiguousarray(rounded.T), hx.string_attr(source, "name") + ".tf32t", "cuda")


def _one_row_only(constant: ir.Operation) -> bool:
    """Whether every cpu linear reading `constant` as its w (the readers of its panels) has one (static) row."""
    readers = [use.owner for use in constant.result.uses
               if ops.reads_weights(use.owner) and use.operand_number == 1
               and hx.device_of(use.owner) == "cpu"]
    return all(ir.RankedTensorType(reader.operands[0].type).shape[0] == 1 for reader in readers)
