"""Older manifests, upgraded to the version-2 JSON before any check, so that nothing downstream
knows version 1 existed: a file of any version is held to every check."""

from __future__ import annotations

import copy
from typing import Any

from .fields import _is_object, _list, _str

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
