"""fuse: a relu that alone uses a linear on its own device becomes that linear's epilogue.

Input: a partitioned hexir module. Output: each such pair is one `hexir.linear` carrying
`hexir.epilogue = "relu"`, so lower-to-tir makes one kernel that applies the relu as it
stores each result: no intermediate buffer and one pass over memory fewer. A linear whose
result is used by anything else (a print, a second op, the return) is left alone, and so is
a pair on two devices (the transfer between them needs the unfused value).

    %y = "hexir.linear"(%x, %w) {device = "cuda"}         %y = "hexir.linear"(%x, %w)
    %r = "hexir.relu"(%y) {device = "cuda"}         =>         {device = "cuda", hexir.epilogue = "relu"}
    return %r                                             return %y
"""

from __future__ import annotations

from mlir import ir

from hexir.dialects import hexir as hx
from hexir.passes.common import main_function

EPILOGUE = "hexir.epilogue"


def fuse(module: ir.Module) -> None:
    """Fold every relu that is the only user of a linear on the same device into it."""
    for op in list(main_function(module).regions[0].blocks[0].operations):
        if op.name != "hexir.relu" or isinstance(op.operands[0].owner, ir.Block):
            continue
        linear = op.operands[0].owner
        linear = linear.operation if hasattr(linear, "operation") else linear
        if (linear.name != "hexir.linear" or EPILOGUE in linear.attributes
                or hx.device_of(linear) != hx.device_of(op) or len(list(linear.result.uses)) != 1):
            continue
        linear.attributes[EPILOGUE] = ir.StringAttr.get("relu")
        op.result.replace_all_uses_with(linear.result)
        op.erase()


def epilogue_of(op: ir.Operation) -> str | None:
    """The op fused into a linear ("relu"), or None."""
    return ir.StringAttr(op.attributes[EPILOGUE]).value if EPILOGUE in op.attributes else None
