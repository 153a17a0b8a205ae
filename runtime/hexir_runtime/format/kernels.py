"""The meaning of one kernel: its keys by (device, custom), its args and `expr` by its op's
family (families.py), its size expressions, its host code, launch and variants; builds the
frozen `Kernel`."""

from __future__ import annotations

import math
import re
from typing import Any

from .attention import check_view
from .exprs import Expr, _expr, parse, to_json
from .families import FAMILIES, check_args, check_family
from .fields import _choice, _describe, _dim, _fail, _identifier, _index, _int, _is_object, _json, _list, _object, _str
from .layouts import groups
from .types import DEVICES, DTYPES, Code, GpuCode, Kernel, Launch, TensorMap, TensorType, Variant, Work

MAX_SHARED_BYTES = 232448  # 227 KiB: the most dynamic shared memory a block can have (sm_90)
_IMAGE = re.compile(r"(sm|compute)_[0-9]+a?|fatbin")
_ARCH = re.compile(r"sm_[0-9]+a?")
# A kernel's keys beyond name, op, device, symbol and args, by (device, custom): (required, optional).
_KERNEL_KEYS = {
    ("cpu", False): (("sizes", "work"), ("expr",)),  # (expr: its family says whether it has one)
    ("cpu", True): (("scalars", "source"), ("library",)),
    ("cuda", False): (("sizes", "launch", "images"), ("expr", "cpu_fallback", "variants", "tensor_maps")),
    ("cuda", True): (("scalars", "source", "launch", "images"), ("cpu_fallback",)),
}
_OPTIONAL_KERNEL_KEYS = tuple(dict.fromkeys(key for keys in _KERNEL_KEYS.values() for key in sum(keys, ())))


def _check_kernel(kernel: Any, path: str, blob_count: int) -> Kernel:
    _object(kernel, path, ("name", "op", "device", "symbol", "args"), _OPTIONAL_KERNEL_KEYS)
    name = _str(kernel["name"], f"{path}.name")
    op = _identifier(kernel["op"], f"{path}.op")
    if op != "custom" and op not in FAMILIES:
        _fail(f"{path}.op", f"unknown op {op!r}: expected custom or a generated kernel's family, "
                            f"{', '.join(FAMILIES)}")
    device = _choice(kernel["device"], f"{path}.device", DEVICES)
    custom = op == "custom"
    required, optional = _KERNEL_KEYS[device, custom]
    for key in _OPTIONAL_KERNEL_KEYS:
        if key in kernel and key not in required + optional:
            _fail(f"{path}.{key}", f"only {_kernels_with(key)} have this key")
        if key in required and key not in kernel:
            _fail(f"{path}.{key}", f"missing ({_kernels_with(key)} need it)")
    symbol = _identifier(kernel["symbol"], f"{path}.symbol")
    specs = _list(kernel["args"], f"{path}.args")
    args = check_args(op, [{k: v for k, v in s.items() if k != "view"} if isinstance(s, dict) else s for s in specs],
                      path)
    views = _views(specs, args, op, path)
    meaning = None if custom else check_family(op, tuple(v or a for v, a in zip(views, args, strict=True)), kernel,
                                               path)
    symbols = list(dict.fromkeys(dim for arg in args for dim in arg.symbols))
    if custom:  # its code takes every dimension of every arg, in order, after the pointers
        dims = [dim for arg in args for dim in arg.shape]
        integers = tuple(_expr(scalar, f"{path}.scalars[{j}]", symbols)
                         for j, scalar in enumerate(_list(kernel["scalars"], f"{path}.scalars")))
        if list(integers) != dims:
            _fail(f"{path}.scalars", f"expected the dimensions of every arg in order, {_json(dims)}, "
                                     f"got {_json(kernel['scalars'])}")
        own = _custom_code(kernel, symbol, path, blob_count) if device == "cpu" else None
    else:  # generated: it takes one int64 per distinct symbol of its args
        integers = tuple(_list(kernel["sizes"], f"{path}.sizes"))
        if list(integers) != symbols:
            _fail(f"{path}.sizes", f"expected the distinct symbols of the args in order, {_json(symbols)}, "
                                   f"got {_json(kernel['sizes'])}")
        own = Code(symbol, _work(kernel["work"], f"{path}.work", symbols)) if device == "cpu" else None
    if device == "cpu":
        return Kernel(name, op, device, args, meaning, integers, own, None, own.source, views)
    images = kernel["images"]
    if not isinstance(images, dict) or not images:  # (before the variants, whose arch is looked up in it)
        _fail(f"{path}.images", f"expected an object of sm_NN/compute_NN images, got {_describe(images)}")
    variants = []
    for j, variant in enumerate(_list(kernel.get("variants", []), f"{path}.variants")):
        where = f"{path}.variants[{j}]"
        _object(variant, where, ("symbol", "launch"), ("below", "arch", "tensor_maps"))
        below = _is_object(variant.get("below", {}), f"{where}.below")
        arch = variant.get("arch")
        if arch is not None and (not isinstance(arch, str) or not _ARCH.fullmatch(arch) or arch not in images):
            _fail(f"{where}.arch", f"expected an sm_<number>[a] architecture among the images, got {_describe(arch)}")
        if not below and arch is None:
            _fail(f"{where}.below", "expected a bound for at least one of the kernel's sizes (or an arch)")
        variants.append(Variant(_identifier(variant["symbol"], f"{where}.symbol"),
                                _launch(variant["launch"], f"{where}.launch", symbols),
                                {_below_key(key, f"{where}.below.{key}", symbols):
                                 _int(bound, f"{where}.below.{key}", 1) for key, bound in below.items()}, arch,
                                _tensor_maps(variant.get("tensor_maps", []), f"{where}.tensor_maps", args)))
    for arch, blob in images.items():
        if not _IMAGE.fullmatch(arch):
            _fail(f"{path}.images.{arch}", "expected sm_<number> (CUBIN), compute_<number> (PTX), either with "
                                           "an a suffix (sm_90a), or fatbin")
        if arch == "fatbin" and not custom:
            _fail(f"{path}.images.fatbin", "only custom kernels have a fatbin image")
        _index(blob, f"{path}.images.{arch}", blob_count, "blob")
    fallback = None
    if "cpu_fallback" in kernel:
        where = f"{path}.cpu_fallback"
        keys = (("symbol", "source"), ("library",)) if custom else (("symbol", "work"), ())
        spec = _object(kernel["cpu_fallback"], where, *keys)
        fallback_symbol = _identifier(spec["symbol"], f"{where}.symbol")
        fallback = (_custom_code(spec, fallback_symbol, where, blob_count) if custom
                    else Code(fallback_symbol, _work(spec["work"], f"{where}.work", symbols)))
    maps = _tensor_maps(kernel.get("tensor_maps", []), f"{path}.tensor_maps", args)
    gpu = GpuCode(symbol, _launch(kernel["launch"], f"{path}.launch", symbols), dict(images), tuple(variants), maps)
    return Kernel(name, op, device, args, meaning, integers, fallback, gpu, kernel.get("source"), views)


#: What a TMA tensor map may describe: element bytes by dtype (runtime/hexir_runtime/tensormap.py).
_MAP_BYTES = {dtype: DTYPES[dtype] for dtype in ("bfloat16", "float16", "float32", "float64")}


def _tensor_maps(specs: Any, path: str, args: tuple[TensorType, ...]) -> tuple[TensorMap, ...]:
    """Each `{arg, box}`: a matrix argument whose rows are a static multiple of 16 bytes, a box of
    [columns, rows] of at most 256 each, its rows at most 128 bytes (128-byte swizzle) and a
    multiple of 16."""
    maps = []
    for j, spec in enumerate(_list(specs, path)):
        where = f"{path}[{j}]"
        _object(spec, where, ("arg", "box"))
        arg = _int(spec["arg"], f"{where}.arg")
        if arg >= len(args):
            _fail(f"{where}.arg", f"the kernel has {len(args)} args")
        tensor = args[arg]
        size = _MAP_BYTES.get(tensor.dtype)
        if size is None or len(tensor.shape) != 2 or not isinstance(tensor.shape[1], int) \
                or tensor.shape[1] * size % 16:
            _fail(f"{where}.arg", f"a tensor map reads a matrix of {', '.join(_MAP_BYTES)} whose rows are a static "
                                  f"multiple of 16 bytes, not {tensor}")
        box = tuple(_int(b, f"{where}.box[{i}]", 1) for i, b in enumerate(_list(spec["box"], f"{where}.box")))
        if len(box) != 2 or max(box) > 256 or box[0] * size > 128 or box[0] * size % 16:
            _fail(f"{where}.box", f"expected [columns, rows] of at most 256 each, the columns' bytes a multiple of "
                                  f"16 up to 128, got {_json(spec['box'])}")
        maps.append(TensorMap(arg, box))
    return tuple(maps)


def _launch(spec: Any, path: str, symbols: list[str]) -> Launch:
    launch = _object(spec, path, ("grid", "block", "shared_bytes"))
    grid = tuple(_expr(size, f"{path}.grid[{j}]", symbols) for j, size in enumerate(_triple(launch, "grid", path)))
    block = tuple(_int(size, f"{path}.block[{j}]", 1) for j, size in enumerate(_triple(launch, "block", path)))
    if math.prod(block) > 1024:
        _fail(f"{path}.block", f"{block[0]} x {block[1]} x {block[2]} threads: a block has at most 1024")
    shared = _int(launch["shared_bytes"], f"{path}.shared_bytes")
    if shared > MAX_SHARED_BYTES:
        _fail(f"{path}.shared_bytes", f"{shared} bytes: a block has at most {MAX_SHARED_BYTES}")
    return Launch(grid, block, shared)


def _triple(launch: dict[str, Any], key: str, path: str) -> list[Any]:
    sizes = _list(launch[key], f"{path}.{key}")
    if len(sizes) != 3:
        _fail(f"{path}.{key}", f"expected [x, y, z], got {len(sizes)} numbers")
    return sizes


def _work(work: Any, path: str, symbols: list[str]) -> Work:
    _object(work, path, ("extent", "grain"), ("spans",))
    if work.get("spans", True) is not True:
        _fail(f"{path}.spans", f"expected true (or no key), got {_describe(work['spans'])}")
    return Work(_expr(work["extent"], f"{path}.extent", symbols), _int(work["grain"], f"{path}.grain", 1),
                "spans" in work)


def _kernels_with(key: str) -> str:
    """Which kernels have `key`, in words: "cuda kernels", "custom kernels", "generated cpu kernels"."""
    kinds = [kind for kind, keys in _KERNEL_KEYS.items() if key in sum(keys, ())]
    devices, customs = {device for device, _ in kinds}, {custom for _, custom in kinds}
    words = []
    if len(customs) == 1:
        words.append("custom" if customs.pop() else "generated")
    if len(devices) == 1:
        words.append(devices.pop())
    return " ".join([*words, "kernels"])


def _custom_code(code: dict[str, Any], symbol: str, path: str, blob_count: int) -> Code:
    """The host code of a custom kernel (or of its cpu_fallback): `source` and its own `library`, if any."""
    if not isinstance(code["source"], str) or not code["source"]:
        _fail(f"{path}.source", f"expected a file name (a non-empty string), got {_describe(code['source'])}")
    library = _index(code["library"], f"{path}.library", blob_count, "blob") if "library" in code else None
    return Code(symbol, None, library, code["source"])


def _views(specs: list[Any], args: tuple[TensorType, ...], op: str, path: str) -> tuple[TensorType | None, ...]:
    """Each arg's `view`, if it has one: the shape a generated kernel reads an input as (the
    buffer reshaped in place: the same symbols in the same order, the static extents between them
    regrouped with their product unchanged), or an attention's q, k, v or out strided
    (attention.check_view); its family's contract holds for the views."""
    views: list[TensorType | None] = []
    for j, (spec, arg) in enumerate(zip(specs, args, strict=True)):
        if "view" not in spec:
            views.append(None)
            continue
        where = f"{path}.args[{j}].view"
        if op == "attention" and isinstance(spec["view"], dict) and j in (0, 1, 2, len(args) - 1):
            views.append(check_view(spec["view"], arg, where, j == len(args) - 1))
            continue
        if op == "custom" or j == len(args) - 1:
            _fail(where, "only a generated kernel's inputs have a view")
        view = TensorType(tuple(_dim(d, f"{where}[{i}]", True) for i, d in enumerate(_list(spec["view"], where))),
                          arg.dtype)
        if not view.shape or groups(view.shape) != groups(arg.shape):
            _fail(where, f"{view} is no reshape of {arg} (a symbol stays itself, in order; the static extents "
                         "between symbols keep their product)")
        views.append(view)
    return tuple(views)


def _below_key(text: str, path: str, symbols: list[str]) -> Expr:
    """A variant's bound is on a size: a symbol, or a size expression's text (`mul(batch, seq)`)."""
    try:
        parsed = parse(text)
    except ValueError:
        _fail(path, f"expected a symbol or a size expression, got {_describe(text)}")
    return _expr(to_json(parsed), path, symbols)
