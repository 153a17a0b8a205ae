"""The .hxb module format, version 4: read, check and write (docs/hxb-format.md).

A file is checked twice before anything uses it: first its structure (header, manifest bytes,
the blob table against the file's bytes: container.py), then its meaning (keys, types, indices,
shapes, size expressions, the host programs: checks.py, kernels.py, entries.py). The first rule
broken raises `HxbFormatError` naming the field, e.g. `kernels[2].args[1].dtype: expected one of
float32, float64, bfloat16, float16, int32, int64, got 'int8'` (fields.py). The compiler writes
through `encode`, which runs the same checks on its own output. A generated kernel is checked by its op's family
contract (families.py); what it computes is its `expr`, a tree of the scalar-expression
language (scalars.py), which the reference device evaluates.

The meaning pass does not only check the JSON: it builds the frozen `Manifest` (types.py) that
the rest of the runtime reads. That is also where each kernel's code is decided once:
`Kernel.cpu_code` is what runs it on the host (its own code, its `cpu_fallback`, or None) and
`Kernel.gpu_code` what runs it on a GPU, so no device re-derives it from dicts. A manifest of
versions 1 to 3 is upgraded to the version-4 JSON before the checks (upgrade.py; version 4 reads as
version 5, which only adds to it), so nothing
downstream knows older versions existed: a file of any version is held to every check (its code's kernel tables
included: tables.py), and one too old to be checked is refused.

Shapes may hold symbols (`"batch"`), sizes bound per call from the inputs' shapes; launch grids
and parallel extents are size expressions over them (exprs.py: an int, a symbol, or
`(op, expr, expr)`), evaluated per call by `evaluate` and printed by `to_text`.

This module names what the rest of the runtime, the compiler and the tests use.
"""

from ..errors import HxbFormatError
from .container import HEADER, MAGIC, SIGNED, VERSION, Hxb, decode, encode, read, write
from .exprs import Expr, evaluate, to_text
from .tables import check_build, check_table, parse_table
from .types import Code, Cpu, CpuLibrary, Entry, Kernel, Launch, TensorType, Work, numpy_dtype

__all__ = ["HEADER", "MAGIC", "SIGNED", "VERSION", "Code", "Cpu", "CpuLibrary", "Entry", "Expr", "Hxb",
           "HxbFormatError", "Kernel", "Launch", "TensorType", "Work", "check_build", "check_table", "decode",
           "encode", "evaluate", "numpy_dtype", "parse_table", "read", "to_text", "write"]
