"""Older manifests, upgraded to the version-4 JSON before any check, so that nothing downstream
knows older versions existed: a file of any version is held to every check. Version 1 becomes
version 2 (`_upgrade_v1`), versions 1 to 3 become version 4 (`_upgrade_epilogues`: what a kernel
computes, once a list of names, becomes its `expr`)."""

from __future__ import annotations

import copy
from typing import Any

from .fields import _fail, _is_object, _json, _list, _str

_V1_OPS = {"linear": [], "linear_bias": ["bias"], "linear_relu": ["relu"], "linear_bias_relu": ["bias", "relu"]}


def _upgrade_v1(manifest: dict[str, Any]) -> dict[str, Any]:
    """The version-2 JSON of a version-1 manifest: fused linear ops become `linear` with
    epilogues, generated kernels get `epilogues` and `sizes` (v1 shapes are static, so none),
    and `parallel_extent: n` becomes `work: {extent: n, grain: 1}`. A field it reads that is
    malformed is refused here, naming it; the rest is left for the version-2 checks to name."""
    manifest = copy.deepcopy(manifest)
    for i, kernel in enumerate(_list(manifest.get("kernels"), "kernels")):
        path = f"kernels[{i}]"
        _is_object(kernel, path)
        op = _str(kernel.get("op"), f"{path}.op")
        if op == "custom":
            continue
        if op in _V1_OPS:
            kernel["epilogues"] = list(_V1_OPS[op])
            kernel["op"] = "linear"
        else:
            kernel.setdefault("epilogues", [])
        kernel.setdefault("sizes", [])
        for code, where in ((kernel, path), (kernel.get("cpu_fallback"), f"{path}.cpu_fallback")):
            if code is not None and "parallel_extent" in _is_object(code, where):
                code["work"] = {"extent": code.pop("parallel_extent"), "grain": 1}
    return manifest


def _upgrade_cpu(manifest: dict[str, Any]) -> dict[str, Any]:
    """A single-library `cpu` ({arch, cpu, features, library}: version 1 and early version 2)
    becomes `{arch, libraries: [{cpu, features, library}]}`; anything else is left as it is."""
    cpu = manifest.get("cpu")
    if isinstance(cpu, dict) and "libraries" not in cpu and {"cpu", "features", "library"} <= cpu.keys():
        manifest = dict(manifest)
        rest = {key: value for key, value in cpu.items() if key not in ("cpu", "features", "library")}
        manifest["cpu"] = {**rest, "libraries": [{key: cpu[key] for key in ("cpu", "features", "library")}]}
    return manifest


def _upgrade_epilogues(manifest: dict[str, Any], version: int) -> dict[str, Any]:
    """The version-4 JSON of a version-2 (or upgraded version-1) or version-3 manifest: each
    generated kernel's `epilogues` becomes its `expr`, and `relu` a pointwise kernel."""
    manifest = copy.deepcopy(manifest)
    for i, kernel in enumerate(_list(manifest.get("kernels"), "kernels")):
        path = f"kernels[{i}]"
        if "expr" in _is_object(kernel, path):
            _fail(f"{path}.expr", f"unknown key in a version-{version} file (version 4 has it)")
        if _str(kernel.get("op"), f"{path}.op") != "custom" and "epilogues" in kernel:
            kernel["op"], expr = upgraded_op(kernel["op"], kernel.pop("epilogues"), path, version)
            if expr is not None:
                kernel["expr"] = expr
    return manifest


def upgraded_op(op: str, epilogues: Any, path: str, version: int) -> tuple[str, Any]:
    """The version-4 (op, expr) of a version-`version` generated kernel's op and `epilogues`
    (the field at `path.epilogues`): a linear's ["bias"?, then fused ops] become a tree over
    a0 = x @ w and a1 = the bias; `relu` becomes max(a0, 0). Refused where it has no meaning."""
    where = f"{path}.epilogues"
    names = _list(epilogues, where)
    if op not in ("linear", "linear_panels"):
        if names:
            _fail(where, f"a {op} kernel has no epilogues, got {_json(names)}")
        return ("pointwise", _relu(["arg", 0])) if op == "relu" else (op, None)
    tree: list[Any] = ["arg", 0]
    for j, name in enumerate(names):
        if name == "bias" and j == 0:
            tree = ["add", tree, ["arg", 1]]
        elif name == "relu":
            tree = _relu(tree)
        else:
            _fail(f"{where}[{j}]", f"a version-{version} epilogue {_json(name)[:40]} has no meaning this runtime "
                                   "knows (only bias, first, and relu): rebuild the module")
    return op, tree


def _relu(tree: list[Any]) -> list[Any]:
    return ["max", tree, ["const", 0]]
