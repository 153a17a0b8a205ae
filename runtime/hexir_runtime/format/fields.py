"""The field checks of the manifest: each takes a JSON value and the path of its field, and
returns the value checked or raises `HxbFormatError` naming the path (`kernels[2].args[1].dtype`)."""

from __future__ import annotations

import json
import math
import re
from typing import Any, NoReturn

from ..errors import HxbFormatError
from .types import DTYPES, Dim, TensorType

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _fail(path: str, reason: str) -> NoReturn:
    raise HxbFormatError(path or "manifest", reason)


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "an object" if value else "an empty object"
    if isinstance(value, list):
        return "an array" if value else "an empty array"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _object(value: Any, path: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    for key in _is_object(value, path):
        if key not in required and key not in optional:
            allowed = ", ".join(required + optional) or "none"
            _fail(f"{path}.{key}" if path else key, f"unknown key (allowed: {allowed})")
    for key in required:
        if key not in value:
            _fail(f"{path}.{key}" if path else key, "missing")
    return value


def _is_object(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        _fail(path, f"expected an object, got {_describe(value)}")
    return value


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        _fail(path, f"expected an array, got {_describe(value)}")
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        _fail(path, f"expected a string, got {_describe(value)}")
    return value


def _identifier(value: Any, path: str) -> str:
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
        _fail(path, f"expected an identifier ([A-Za-z_][A-Za-z0-9_]*), got {_describe(value)}")
    return value


def _int(value: Any, path: str, minimum: int = 0, alternative: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(path, f"expected an integer >= {minimum}{alternative}, got {_describe(value)}")
    if value >= 2**63:  # every count and offset is an int64 somewhere (ctypes, numpy, the kernels)
        _fail(path, f"{value} does not fit in int64")
    return value


def _choice(value: Any, path: str, options: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in options:
        _fail(path, f"expected one of {', '.join(options)}, got {_describe(value)}")
    return value


def _index(value: Any, path: str, count: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
        _fail(path, f"expected a {what} index in [0, {count}), got {_describe(value)}")
    return value


def _json(value: Any) -> str:
    return json.dumps(value)


def _dim(value: Any, path: str, symbolic: bool) -> Dim:
    if symbolic and isinstance(value, str):
        return _identifier(value, path)
    return _int(value, path, 0, " or a symbol" if symbolic else "")


def _tensor(value: Any, path: str, extra: tuple[str, ...] = (), symbolic: bool = True) -> TensorType:
    _object(value, path, ("shape", "dtype", *extra))
    shape = _list(value["shape"], f"{path}.shape")
    tensor = TensorType(tuple(_dim(size, f"{path}.shape[{i}]", symbolic) for i, size in enumerate(shape)),
                        _choice(value["dtype"], f"{path}.dtype", tuple(DTYPES)))
    # Every extent, and the bytes the shape makes with each 0 counted as 1: a 0 elsewhere must not
    # hide an extent that overflows int64 (ctypes, numpy and the kernels all count in int64).
    nbytes = math.prod(dim or 1 for dim in tensor.shape if isinstance(dim, int)) * tensor.itemsize
    if nbytes >= 2**63:
        _fail(f"{path}.shape", f"{tensor} is too large (2^63 bytes or more, even with its zero extents as 1)")
    return tensor


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            _fail("manifest", f"duplicate key {key!r}")
        result[key] = value
    return result


def _no_constant(name: str) -> NoReturn:
    _fail("manifest", f"{name} is not allowed in the manifest")
