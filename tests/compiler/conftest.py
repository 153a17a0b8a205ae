"""Shared pieces of the compiler tests: IR text in, a pipeline stage run, printed IR checked.

- `filecheck(ir_text, checks)`: runs the LLVM wheel's FileCheck; `checks` holds the `CHECK:`
  lines, the way a lit test's comments would.
- `parse(ir_text)`: a module in a fresh hexir context (raises `ir.MLIRError` on bad IR).
- `lower(ir_text, stage, **options)`: parse, run the pipeline up to `stage`, return the
  printed IR (or the bytes of an .hxb).
- `manifest(data)`: the manifest of .hxb bytes, decoded and checked by the runtime's reader.
- `family_attrs(name, operands)`: the attributes a registered pointwise or reduce op carries in
  IR text (its own tree as `expr`, its operand groups), for writing `.mlir` inputs.
- `line_of(path, tag)`: the number of the one line of a file that ends in the comment `# tag`.
"""

# IR lines are checked as printed: wrapping them would change what they check.
# ruff: noqa: E501

from __future__ import annotations

import json
import subprocess
import tempfile
import textwrap
from pathlib import Path

import llvm
import pytest
from hexir_runtime import format as hxb
from mlir import ir

from hexir import ops
from hexir.dialects import make_context
from hexir.dialects.hexir import MAX_CALL_ARGS
from hexir.driver import Options, run_stage
from hexir.ops import scalar

LLVM_BIN = Path(llvm.__file__).parent / "bin"
FILECHECK = LLVM_BIN / "FileCheck"
REPO = Path(__file__).resolve().parents[2]
MLP = REPO / "examples" / "mlp.py"


def filecheck(ir_text: str, checks: str) -> None:
    """Fail the test, showing FileCheck's report and the IR, unless `ir_text` matches `checks`."""
    checks = textwrap.dedent(checks).strip()
    assert "CHECK" in checks, "a FileCheck pattern without a CHECK line checks nothing"
    with tempfile.NamedTemporaryFile("w", suffix=".check") as check_file:
        check_file.write(checks + "\n")
        check_file.flush()
        result = subprocess.run([str(FILECHECK), check_file.name, "--dump-input=never"],
                                input=str(ir_text), capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"FileCheck failed:\n{result.stderr}\n--- input ---\n{ir_text}", pytrace=False)


def parse(ir_text: str) -> ir.Module:
    """The module of `ir_text` in a fresh context with hexir's dialects."""
    with make_context():
        return ir.Module.parse(textwrap.dedent(ir_text))


def lower(ir_text: str, stage: str, **options) -> str | bytes:
    """Parse `ir_text`, run the pipeline up to `stage`, return the printed result (or bytes)."""
    result = run_stage(parse(ir_text), stage, Options(**options))
    return result if isinstance(result, bytes) else str(result)


def linear_program(m: int, k: int, n: int, dtype: str = "f32") -> str:
    """`main(x[m, k], w[k, n])`, one hexir.linear of the two, as IR text."""
    x, w, y = (f"tensor<{a}x{b}x{dtype}>" for a, b in ((m, k), (k, n), (m, n)))
    return f"""
    func.func @main(%x: {x}, %w: {w}) -> {y} {{
      %y = "hexir.linear"(%x, %w) {{device = "auto", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>}} : ({x}, {w}) -> {y}
      return %y : {y}
    }}"""


def family_attrs(name: str, operands: int = 1, axis: int = 1, **params: object) -> str:
    """`expr = "...", operandSegmentSizes = array<i32: ...>` of a `hexir.<name>` op of `operands`
    tensors, as the tracer writes them: a pointwise op's own tree over its operands, a reduce
    op's program over `axis` of its first operand."""
    definition = ops.REGISTRY[name]
    if definition.family == "reduce":
        args = [scalar.Scalar.arg(i) for i in range(operands)]
        tree = scalar.reduce_program(name, definition.function, args, axis, **params).to_json()
    else:
        tree = definition.tree(**params)
    text = json.dumps(tree, separators=(",", ":")).replace('"', "\\22")
    groups = ", ".join(["1"] * operands + ["0"] * (MAX_CALL_ARGS - operands))
    return f'expr = "{text}", operandSegmentSizes = array<i32: {groups}>'


def manifest(data: bytes) -> dict:
    """The manifest of an .hxb, read (and checked) the way the runtime reads it."""
    return hxb.decode(data).json


#: The cpu linear's parallel work items, as its schedule documents them (hexir/schedules/cpu.py):
#: tiles of 192, 96, 48, 24 or 12 rows, the most that leave 32 items (else 12; with a symbolic
#: batch CPU_TILE_ROWS) x 512 bytes of columns (128 float32, 64 float64), on every x86-64 level.
CPU_TILE_ROWS, CPU_TILE_BYTES = 24, 512


def cpu_tile_rows(m: int, n: int, dtype: str, panels: bool = False) -> int:
    """The rows of a static cpu linear's tiles, for an [m, n] output (w in panels: at most 48)."""
    columns = -(-n // (CPU_TILE_BYTES // (4 if dtype == "float32" else 8)))
    return next((rows for rows in ((48, 24, 12) if panels else (192, 96, 48, 24, 12))
                 if -(-m // rows) * columns >= 32), 12)


def cpu_linear_tiles(m: int, n: int, dtype: str, panels: bool = False) -> int:
    """The work extent of a static cpu linear with an [m, n] output: its row tiles times its column
    tiles (up to 16 rows of a w in rows, streamed: one row tile; w in panels is always tiled)."""
    columns = CPU_TILE_BYTES // (4 if dtype == "float32" else 8)
    return (1 if m <= 16 and not panels else -(-m // cpu_tile_rows(m, n, dtype, panels))) * -(-n // columns)


def cuda_linear_launch(m: int, n: int, dtype: str = "float32", archs: tuple[str, ...] = ("sm_90",), k: int = 1) -> dict:
    """The launch of a cuda linear with an [m, n] output over k, as the schedule documents its
    kernels (hexir/schedules/cuda.py): up to 16 static rows stream w, 32 columns per block of 32
    lanes x 32 warps (16 where a thread's M sums take more than 32 bytes); float64 on sm_80 and
    newer runs on the tensor cores, blocks of 4 x 2 warps computing 128x128 tiles when that makes
    512 blocks and K and N are even, else of 2 x 2 warps computing 128x64 tiles when that makes
    264 blocks, else 64x64 when 256, else 64x32 when 128, else 32x32; the rest in 16x16-thread
    blocks of 128x128 tiles when that still makes 128 blocks (about one per SM of a 132-SM GPU),
    else 64x64 ones when they make 256 and 32x32 when 128 (both counting K's splits), else 16x16.
    K splits (grid z) where k >= 256 and the tiles make fewer than 256 blocks (tensor cores: k >=
    512 and 128): into as many parts as bring them there, at most 8, each at least 64 k's (4
    slices of 16), the parts' sums at most 64 KiB per tile, each part a whole number of slices."""
    def ceil(a: int, b: int) -> int:
        return -(-a // b)

    def splits(blocks: int, tile_bytes: int, fill: int = 256, least: int = 256) -> int:
        if blocks >= fill or k < least:
            return 1
        parts = min(ceil(fill, blocks), 8, k // 64, 65536 // tile_bytes)
        return 1 if parts <= 1 else ceil(k, ceil(ceil(k, parts), 16) * 16)
    itemsize = 4 if dtype == "float32" else 8
    if m <= 16:
        warps = 32 if max(m, 1) * itemsize <= 32 else 16
        return {"grid": [ceil(n, 32), 1, 1], "block": [32, warps, 1], "shared_bytes": 0}
    if dtype == "float64" and all(int(arch[3:]) >= 80 for arch in archs):
        wide = ((128, 128, 512),) if k % 2 == 0 and n % 2 == 0 else ()
        table = (*wide, (128, 64, 264), (64, 64, 256), (64, 32, 128), (32, 32, 0))
        rows, columns = next((r, c) for r, c, fewest in table if ceil(m, r) * ceil(n, c) >= fewest)
        blocks = ceil(m, rows) * ceil(n, columns)
        return {"grid": [ceil(n, columns), ceil(m, rows), splits(blocks, rows * columns * 8, 128, 512)],
                "block": [256 if columns == 128 else 128, 1, 1], "shared_bytes": 0}
    tile = next((t for t, fewest in ((128, 128), (64, 256), (32, 128))
                 if ceil(m, t) * ceil(n, t) * splits(ceil(m, t) * ceil(n, t), t * t * itemsize) >= fewest), 16)
    blocks = ceil(m, tile) * ceil(n, tile)
    return {"grid": [ceil(n, tile), ceil(m, tile), splits(blocks, tile * tile * itemsize)], "block": [16, 16, 1],
            "shared_bytes": 0}


def line_of(path: str | Path, tag: str) -> int:
    """The 1-based number of the only line of `path` that ends in the comment `# tag`."""
    lines = [n for n, text in enumerate(Path(path).read_text().splitlines(), 1)
             if text.rstrip().endswith(f"# {tag}")]
    assert len(lines) == 1, f"'# {tag}' ends lines {lines} of {path}, expected exactly one"
    return lines[0]
