"""Kernel tables: what the code says it holds (each kernel's args, sizes, work or launch), and a
CPU library's record of what it was built for, checked against the manifest."""

from __future__ import annotations

import json
from typing import Any

from ..errors import HxbFormatError
from .container import Hxb
from .fields import _fail, _no_constant, _unique_keys
from .types import CpuLibrary
from .upgrade import upgraded_op


def parse_table(text: bytes, where: str) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """A kernel table (`{"kernels": [{"symbol": ..., ...}, ...], ...}`, UTF-8 JSON, one trailing NUL
    allowed): its entries by symbol, and its other keys (a CPU library's record of the level it was
    built for: `cpu`, `features`); HxbFormatError naming `where` if it is malformed."""
    try:
        table = json.loads(text.removesuffix(b"\0").decode("utf-8"), object_pairs_hook=_unique_keys,
                           parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError, HxbFormatError) as error:
        _fail(where, f"the kernel table is not valid UTF-8 JSON ({error})")
    if not isinstance(table, dict) or not isinstance(table.get("kernels"), list):
        _fail(where, "the kernel table is not an object with a list of kernels")
    entries: dict[str, dict[str, Any]] = {}
    for i, kernel in enumerate(table["kernels"]):
        if not isinstance(kernel, dict) or not isinstance(kernel.get("symbol"), str):
            _fail(where, f"the kernel table's kernels[{i}] is not an object with a symbol")
        if kernel["symbol"] in entries:
            _fail(where, f"the kernel table lists symbol {kernel['symbol']!r} twice")
        entries[kernel["symbol"]] = kernel
    return entries, {key: value for key, value in table.items() if key != "kernels"}


def check_build(record: dict[str, Any], build: CpuLibrary, path: str, where: str) -> None:
    """Check that a CPU library's own record of what it was built for (its kernel table's `cpu` and
    `features`) is what the manifest says of it at `path` (`cpu.libraries[i]`): the host's features
    were checked against the manifest's, so the code must need no other. HxbFormatError if not."""
    for key, value in (("cpu", build.cpu), ("features", list(build.features))):
        if key not in record:
            _fail(f"{path}.{key}", f"the kernel table of {where} does not record the CPU it was built for: "
                                   "built by an older compiler? (rebuild the module)")
        if _canonical(record[key]) != _canonical(value):
            _fail(f"{path}.{key}", f"the manifest says {_canonical(value)}, the kernel table of {where} says "
                                   f"{_canonical(record[key])}")


def check_table(hxb: Hxb, table: dict[str, dict[str, Any]], kernels: list[int], gpu: bool, where: str) -> None:
    """Check that the code's `table` describes `kernels` (indices) exactly as the manifest does:
    their args (shape, dtype, view), sizes or scalars, work (host code) or launch (`gpu`), and a
    generated kernel's op and expr (a file older than version 4: the table's op and epilogues,
    upgraded as the manifest's were). The host code of a CUDA kernel is its cpu_fallback.
    HxbFormatError names the kernel and field."""
    for index in kernels:
        spec, kernel = hxb.json["kernels"][index], hxb.manifest.kernels[index]
        code = kernel.gpu_code if gpu else kernel.cpu_code
        expected = {"args": [{key: arg[key] for key in ("shape", "dtype", "view") if key in arg}
                             for arg in spec["args"]]}
        expected["scalars" if kernel.custom else "sizes"] = spec["scalars" if kernel.custom else "sizes"]
        if gpu:
            expected["launch"] = spec["launch"]
        elif not kernel.custom:
            expected["work"] = (spec if kernel.device == "cpu" else spec["cpu_fallback"])["work"]
        if not kernel.custom:  # what the code computes: the reference device's input, so it must agree
            expected["op"], expected["expr"] = spec["op"], spec.get("expr")
        path = f"kernels[{index}]" if gpu or kernel.device == "cpu" else f"kernels[{index}].cpu_fallback"
        checks = [(path, code.symbol, expected)]
        for j, variant in enumerate(spec.get("variants", []) if gpu else []):  # the same, launched otherwise
            checks.append((f"{path}.variants[{j}]", variant["symbol"], {**expected, "launch": variant["launch"]}))
        for field_path, symbol, wanted in checks:
            entry = table.get(symbol)
            if entry is None:
                _fail(f"{field_path}.symbol", f"{kernel.name}: symbol {symbol!r} is not in the kernel table of {where}")
            if hxb.version < 4 and not kernel.custom and isinstance(entry.get("op"), str):
                entry = _upgraded_entry(entry, field_path, hxb.version)
            for key, value in wanted.items():
                if _canonical(entry.get(key)) != _canonical(value):
                    _fail(f"{field_path}.{key}", f"{kernel.name}: the manifest says {_canonical(value)}, the kernel "
                                                 f"table of {where} says {_canonical(entry.get(key))}")


def _upgraded_entry(entry: dict[str, Any], field_path: str, version: int) -> dict[str, Any]:
    """An older table's entry in version-4 terms: its op and epilogues upgraded as the manifest's
    were (epilogues that do not upgrade: refused, naming the manifest's field)."""
    if "epilogues" not in entry:
        return entry
    upgraded = {key: value for key, value in entry.items() if key != "epilogues"}
    try:
        upgraded["op"], expr = upgraded_op(entry["op"], entry["epilogues"], field_path, version)
    except HxbFormatError as error:
        _fail(f"{field_path}.expr", f"the kernel table's epilogues do not upgrade: {error}")
    if expr is not None:
        upgraded["expr"] = expr
    return upgraded


def _canonical(value: Any) -> str:
    """JSON text that tells 1, 1.0 and true apart, and ignores key order."""
    return json.dumps(value, sort_keys=True)
