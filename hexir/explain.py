"""The placement picture: the placed graph (after partition and fusion) in Graphviz DOT.

    print(hexir.explain(mlp, hexir.TensorSpec(("batch", 8), "float32"), placement="hexir.linear=cuda"))
    hexir examples/split.py:mlp -spec=x=batchx8xf32 -emit=dot | dot -Tsvg > split.svg

One node per op (a linear with fused element-wise ops is one node, "linear+relu", with the
weights it reads), coloured by device; the inputs and outputs are the host's. An edge that
crosses devices is a transfer, drawn red and labelled with the bytes it moves per call (an
expression in the batch symbol when the batch is symbolic: "batch × 64 B"). A transfer read by
several ops is still one copy, so one labelled edge: into a red point, from which red edges
fan out to its readers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from hexir_runtime.format import scalars
from mlir import ir

from hexir.dialects import hexir as hx
from hexir.driver import Options, run_stage
from hexir.jit import with_options
from hexir.passes.fuse import fuse
from hexir.passes.widen import widen

COLORS = {"cpu": "#cfe2f3", "cuda": "#c9e6b8"}
TRANSFER = "#cc0000"


def explain(fn: Callable, *args: Any, placement: str | dict | None = None, target: str | None = None,
            kernel_search_path: Sequence[str | os.PathLike] = (), **static: Any) -> str:
    """The DOT text of `fn` traced for `args` (TensorSpecs or arrays, and static values), placed
    with these options (as `hexir.export` takes them); what `hexir -emit=dot` prints."""
    jitted = with_options(fn, placement, target, kernel_search_path)
    return placed_dot(jitted.trace(*args, **static), jitted.options)


def placed_dot(module: ir.Module, options: Options) -> str:
    """Partition, widen (16-bit contracts) and fuse a traced module (in place), then draw it."""
    run_stage(module, "mlir-hetero", options)
    with module.context, ir.Location.unknown():
        widen(module, options.target, options.matmul_precision)
        fuse(module)
    return dot(module)


def _bytes(type_: ir.Type) -> str:
    shape, size = hx.shape_of(type_), np.dtype(hx.dtype_of(type_)).itemsize
    symbols = [d for d in shape if isinstance(d, str)]
    for d in shape:
        size *= 1 if isinstance(d, str) else d
    return " × ".join([*symbols, f"{size:,} B"])


def _moved(type_: ir.Type) -> str:
    """The style of a transfer's edge: red, labelled with the bytes it moves."""
    return f' [label="{_bytes(type_)}", color="{TRANSFER}", fontcolor="{TRANSFER}", penwidth=2]'


def _spec(type_: ir.Type) -> str:
    return hx.describe(hx.shape_of(type_), hx.dtype_of(type_))


def dot(module: ir.Module) -> str:
    """The DOT text of a partitioned (and fused) hexir module's @main."""
    main = hx.main_function(module)
    block = main.regions[0].blocks[0]
    lines = ["digraph hexir {", '  node [shape=box, style="rounded,filled", fontname="Helvetica"];',
             '  edge [fontname="Helvetica", fontsize=10];',
             '  label="blue: cpu   green: cuda   red edges: transfers (bytes per call)"; fontname="Helvetica";']
    nodes: dict[int, str] = {}        # hash(value) -> the node that makes it
    constants: dict[int, str] = {}    # hash(value) -> the constant's name
    transfers: dict[int, ir.Value] = {}  # hash(transfer result) -> the value it moves
    users: dict[int, int] = {}  # hash(value) -> how many ops read it
    points: set[str] = set()  # the nodes a transfer read by several ops fans out from
    for op in block.operations:
        for operand in op.operation.operands:
            users[hash(operand)] = users.get(hash(operand), 0) + 1
    for i, (name, arg) in enumerate(zip(hx.argument_names(main), block.arguments, strict=True)):
        nodes[hash(arg)] = f"in{i}"
        lines.append(f'  in{i} [label="{name}\\n{_spec(arg.type)}", shape=ellipse, fillcolor="{COLORS["cpu"]}"];')
    for index, op in enumerate(block.operations):
        op = op.operation
        if op.name == "hexir.constant":
            constants[hash(op.result)] = hx.string_attr(op, "name")
            continue
        if op.name == "hexir.transfer" and users.get(hash(op.result), 0) > 1:
            # one copy however many read it: one edge with its bytes, into a point they fan out from
            lines.append(f'  op{index} [shape=point, width=0.08, color="{TRANSFER}"];')
            lines.append(f"  {nodes[hash(op.operands[0])]} -> op{index}{_moved(op.result.type)};")
            nodes[hash(op.result)] = f"op{index}"
            points.add(f"op{index}")
            continue
        if op.name == "hexir.transfer":
            transfers[hash(op.result)] = op.operands[0]
            continue
        node, operands = f"op{index}", list(op.operands)
        if op.name in ("func.return", "hexir.print"):
            label, device, shape = op.name.removeprefix("func.").removeprefix("hexir."), "cpu", "ellipse"
        else:
            kind = hx.string_attr(op, "kernel") if op.name == "hexir.custom_call" else op.name.removeprefix("hexir.")
            weights = [constants[hash(o)] for o in operands if hash(o) in constants]
            fused = hx.expr_of(op) if hx.EPILOGUE in op.attributes else None  # a linear's epilogue, as a formula
            label = kind + (f" → {scalars.text(fused)}" if fused else "")
            label += f" ({', '.join(weights)})" if weights else ""
            label += f"\\n{_spec(op.result.type)}"
            device, shape = hx.device_of(op), "box"
        lines.append(f'  {node} [label="{label}", shape={shape}, fillcolor="{COLORS[device]}"];')
        for operand in operands:
            if hash(operand) in constants:
                continue
            moved = transfers.get(hash(operand))
            source = nodes[hash(moved if moved is not None else operand)]
            style = _moved(operand.type) if moved is not None else \
                f' [color="{TRANSFER}", penwidth=2]' if source in points else ""
            lines.append(f"  {source} -> {node}{style};")
        if len(op.results) == 1:
            nodes[hash(op.result)] = node
    return "\n".join([*lines, "}"]) + "\n"
