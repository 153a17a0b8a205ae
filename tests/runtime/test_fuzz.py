"""Fuzzing the reader: whatever happens to a file's bytes or its manifest, the only error that
escapes is HxbFormatError, and a manifest that passes the checks runs on the reference device."""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import pytest
from hexir_runtime import HexirRuntimeError, HxbFormatError, KernelError, load
from hexir_runtime import format as hxb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(st.data())
def test_changed_bytes_are_always_caught(data, draw):
    """Every byte is covered by a check (header fields, CRC, zero padding, sha256)."""
    changed = bytearray(data)
    for _ in range(draw.draw(st.integers(1, 4))):
        position = draw.draw(st.integers(0, len(data) - 1))
        changed[position] = draw.draw(st.integers(0, 255).filter(lambda value, p=position: value != data[p]))
    with pytest.raises(HxbFormatError):
        hxb.decode(bytes(changed))


@FUZZ
@given(st.data())
def test_truncated_inserted_or_deleted_bytes_are_caught(data, draw):
    position = draw.draw(st.integers(0, len(data)))
    how = draw.draw(st.sampled_from(["truncate", "insert", "delete"]))
    if how == "truncate":
        changed = data[:position]
    elif how == "insert":
        changed = data[:position] + draw.draw(st.binary(min_size=1, max_size=8)) + data[position:]
    else:
        changed = data[:position] + data[position + draw.draw(st.integers(1, 8)) :]
    if changed != data:
        with pytest.raises(HxbFormatError):
            hxb.decode(changed)


JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2, 40), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
    st.sampled_from(["", "float64", "cpu", "cuda", "relu", "linear", "main", "x", "sm_90", "read", "write", "return"]),
    st.lists(st.integers(-1, 20), max_size=3), st.just({}), st.just([]),
)


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every position in a JSON value, as a tuple of keys and indices."""
    found = [prefix]
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for key, child in children:
        found += paths(child, (*prefix, key))
    return found


@pytest.mark.parametrize("factory", ["mlp", "cuda"])
@FUZZ
@given(st.data())
def test_mutated_manifests_fail_cleanly_or_run(modules, factory, draw):
    parts = getattr(modules, factory)()
    manifest = copy.deepcopy(parts[0])
    for _ in range(draw.draw(st.integers(1, 3))):
        path = draw.draw(st.sampled_from(paths(manifest)[1:]))
        parent = manifest
        for key in path[:-1]:
            parent = parent[key]
        how = draw.draw(st.sampled_from(["replace", "delete", "add"]))
        if how == "replace":
            parent[path[-1]] = draw.draw(JSON_VALUES)
        elif how == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw.draw(st.sampled_from(["extra", "name", "op", "dst", "srcs"]))] = draw.draw(JSON_VALUES)
        else:
            parent.insert(path[-1], draw.draw(JSON_VALUES))
    try:
        data = hxb.encode(manifest, parts[1])
    except HxbFormatError:
        return
    if any(kernel.custom for kernel in hxb.decode(data).manifest.kernels):  # the user's code: no numpy version
        with pytest.raises(KernelError, match="the reference device has no numpy version of it"):
            load(data, "reference")
        return
    module = load(data, "reference")  # a manifest that passes every check must run
    for entry in module.entries:
        signature = module.signature(entry)
        arrays = [np.ones([2 if isinstance(dim, str) else dim for dim in tensor.shape], tensor.dtype)
                  for _, tensor in signature.inputs]
        try:
            module.run(entry, *arrays)
        except HexirRuntimeError as error:
            pytest.fail(f"a checked module failed to run: {error}")


# --- issue 12: real modules (their C library and kernel table), edited and re-encoded ----------


def _blob_edit(draw, manifest: dict[str, Any], blobs: list, c_library: bytes) -> None:
    names = [name for name, _ in blobs]
    how = draw.draw(st.sampled_from(["constant", "library", "table"]))
    constants = [i for i, name in enumerate(names) if name.startswith("constant")]
    if how == "constant" and constants:
        i = draw.draw(st.sampled_from(constants))
        data = bytearray(blobs[i][1])
        data[draw.draw(st.integers(0, len(data) - 1))] = draw.draw(st.integers(0, 255))
        blobs[i] = (names[i], bytes(data) if draw.draw(st.booleans()) else bytes(data[: len(data) // 2]))
    elif how == "library" and "cpu.so" in names:
        i = names.index("cpu.so")
        blobs[i] = ("cpu.so", draw.draw(st.sampled_from([c_library[: len(c_library) // 2], c_library[:64], b""])))
    elif isinstance(manifest.get("cuda"), dict) and manifest["cuda"].get("table") in range(len(blobs)):
        i = manifest["cuda"]["table"]  # (an earlier edit of the manifest may have changed or removed it)
        try:
            table = json.loads(blobs[i][1])
            entry = table["kernels"][0]
        except (ValueError, TypeError, KeyError, IndexError):
            return  # not the table any more
        if not isinstance(entry, dict) or not entry:
            return
        key = draw.draw(st.sampled_from(sorted(entry)))
        entry[key] = draw.draw(JSON_VALUES)
        blobs[i] = (names[i], json.dumps(table).encode())


@pytest.mark.parametrize("factory", ["mlp", "batched", "cuda"])
@FUZZ
@given(st.data())
def test_edited_real_modules_refuse_cleanly_or_agree_with_the_reference(modules, c_library, factory, draw):
    manifest, blobs = getattr(modules, factory)(c_library)
    manifest = copy.deepcopy(manifest)
    for _ in range(draw.draw(st.integers(1, 2))):
        if draw.draw(st.booleans()):
            _blob_edit(draw, manifest, blobs, c_library)
            continue
        path = draw.draw(st.sampled_from(paths(manifest)[1:]))
        parent = manifest
        for key in path[:-1]:
            parent = parent[key]
        if draw.draw(st.booleans()):
            parent[path[-1]] = draw.draw(JSON_VALUES)
        else:
            del parent[path[-1]]
    try:
        data = hxb.encode(manifest, blobs)
        module = load(data, "cpu")
        rng = np.random.default_rng(0)
        arrays = {entry: [rng.standard_normal([3 if isinstance(d, str) else d for d in tensor.shape]).astype(
            tensor.dtype) for _, tensor in module.signature(entry).inputs] for entry in module.entries}
        results = {entry: module.run(entry, *arrays[entry]) for entry in module.entries}
    except HexirRuntimeError:
        return  # a documented refusal
    try:
        reference = load(data, "reference")
    except KernelError:
        return  # an op with no numpy version: nothing to compare with
    for entry, result in results.items():
        expected = reference.run(entry, *arrays[entry])
        for got, want in zip(*(r if isinstance(r, tuple) else (r,) for r in (result, expected)), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)


# --- issue 28: a manifest relabelling, downgrading or re-levelling the code it carries ----------


@pytest.mark.parametrize("factory", ["mlp", "batched", "cuda"])
@FUZZ
@given(st.data())
def test_relabelled_downgraded_or_relevelled_modules_refuse_or_agree(modules, c_library, factory, draw):
    """The audit's manifest-only doors, combined at random: a kernel made `custom` (its library the
    module's own, another blob, or none), written as version 1, 2 or 3, a build's features or cpu
    changed. Each file is refused with a documented error or computes what the reference does."""
    manifest, blobs = getattr(modules, factory)(c_library)
    manifest = copy.deepcopy(manifest)
    for kernel in draw.draw(st.lists(st.sampled_from(manifest["kernels"]), max_size=2, unique_by=id)):
        kernel.update(op="custom", source="k.c", scalars=[d for arg in kernel["args"] for d in arg["shape"]])
        for key in ("expr", "sizes", "work"):
            kernel.pop(key, None)
        code = kernel if kernel["device"] == "cpu" else kernel["cpu_fallback"]
        code.pop("work", None)
        code["source"] = "k.c"
        library = draw.draw(st.sampled_from([None, *range(len(blobs))]))
        if library is not None:
            code["library"] = library
    build = manifest["cpu"]["libraries"][0]
    build.update(draw.draw(st.sampled_from([{}, {"features": ["sse2"]}, {"features": [*build["features"], "avx512f"]},
                                            {"cpu": "x86-64-v4"}])))
    try:
        hxb.encode(manifest, blobs)
    except HxbFormatError:
        return
    data = modules.encode_as(manifest, blobs, draw.draw(st.sampled_from([1, 2, 3])))
    try:
        module = load(data, "cpu")
        x = np.random.default_rng(0).standard_normal([3 if isinstance(d, str) else d for d in
                                                     module.signature("main").inputs[0][1].shape]).astype(np.float32)
        result = module.main(x)
    except HexirRuntimeError:
        return  # a documented refusal
    np.testing.assert_allclose(result, load(data, "reference").main(x), rtol=1e-4, atol=1e-4)
