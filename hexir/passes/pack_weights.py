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


def pack_weights(module: ir.Module) -> None:
    """Give every cpu linear with a constant w a packed copy of it (see the module's docstring);
    linears sharing a weight share its copy."""
    packed: dict[ir.Operation, ir.Value | None] = {}  # constant -> its panels (None: left as it is)
    for op in list(hx.main_function(module).regions[0].blocks[0].operations):
        op = op.operation
        if not ops.reads_weights(op) or hx.device_of(op) != "cpu" or isinstance(op.operands[1].owner, ir.Block):
            continue
        source = op.operands[1].owner.operation
        if source.name != "hexir.constant":
            continue
        if source not in packed:
            packed[source] = _panels(source)
        if packed[source] is None:
            continue
        op.operands[1] = packed[source]
        hx.set_w_panels(op)
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


def _one_row_only(constant: ir.Operation) -> bool:
    """Whether every cpu linear reading `constant` as its w (the readers of its panels) has one (static) row."""
    readers = [use.owner for use in constant.result.uses
               if ops.reads_weights(use.owner) and use.operand_number == 1
               and hx.device_of(use.owner) == "cpu"]
    return all(ir.RankedTensorType(reader.operands[0].type).shape[0] == 1 for reader in readers)
