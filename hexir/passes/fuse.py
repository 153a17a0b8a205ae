"""fuse: an element-wise op that alone uses a linear on its own device becomes that linear's
epilogue.

Input: a partitioned hexir module. Output: each such chain is one `hexir.linear` carrying
`hexir.epilogues = ["relu", ...]` (the fused ops, in the order they apply), so lower-to-tir
makes one kernel that applies them as it stores each result: no intermediate buffer and one
pass over memory fewer. A linear whose result is used by anything else (a print, a second op,
the return) is left alone, and so is a pair on two devices (the transfer between them needs
the unfused value). Any registered op with a per-element function (`OpDef.scalar`) fuses.

    %y = "hexir.linear"(%x, %w) {device = "cuda"}         %y = "hexir.linear"(%x, %w)
    %r = "hexir.relu"(%y) {device = "cuda"}         =>         {device = "cuda", hexir.epilogues = ["relu"]}
    return %r                                             return %y
"""

from __future__ import annotations

from mlir import ir

from hexir import ops
from hexir.dialects import hexir as hx


def fuse(module: ir.Module) -> None:
    """Fold every element-wise op that is the only user of a linear on the same device into it."""
    for op in list(hx.main_function(module).regions[0].blocks[0].operations):
        definition = ops.lookup(op.name)
        if definition is None or definition.scalar is None or isinstance(op.operands[0].owner, ir.Block):
            continue
        linear = op.operands[0].owner
        linear = linear.operation if hasattr(linear, "operation") else linear
        if (linear.name != "hexir.linear" or hx.device_of(linear) != hx.device_of(op)
                or len(list(linear.result.uses)) != 1):
            continue
        hx.set_epilogues(linear, [*hx.epilogues_of(linear), definition.name])
        op.result.replace_all_uses_with(linear.result)
        op.erase()
