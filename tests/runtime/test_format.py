"""The .hxb contract (docs/hxb-format.md): round trips, then one test per rule a reader checks."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from hexir_runtime import HxbFormatError
from hexir_runtime import format as hxb


def raw(manifest_text: bytes, tail: bytes = b"") -> bytes:
    """A file with a correct header around any manifest bytes (no checks)."""
    header = hxb.HEADER.pack(hxb.MAGIC, 2, 40, 40, len(manifest_text), zlib.crc32(manifest_text), 0)
    return header + manifest_text + tail


def patch(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new) :]


def assert_format_error(data: bytes, field: str, text: str = "") -> HxbFormatError:
    with pytest.raises(HxbFormatError) as caught:
        hxb.decode(data)
    assert caught.value.field == field, str(caught.value)
    assert text in str(caught.value)
    return caught.value


# --- writing and reading back ----------------------------------------------------------------


def test_round_trip(parts, data):
    manifest, blobs = parts
    module = hxb.decode(data)
    assert module.version == 5
    assert {key: module.json[key] for key in manifest} == manifest
    assert module.manifest.kernels[0].expr == ["add", ["arg", 0], ["arg", 1]]
    assert module.manifest.constants[0].name == "W1"
    assert [blob["name"] for blob in module.json["blobs"]] == [name for name, _ in blobs]
    for i, (_, payload) in enumerate(blobs):
        assert bytes(module.blob(i)) == payload
        entry = module.json["blobs"][i]
        assert entry["offset"] % 64 == 0
        assert entry["sha256"] == hashlib.sha256(payload).hexdigest()


def test_header_layout(data):
    magic, version, header_size, offset, size, crc, reserved = struct.unpack_from("<8sIIQQII", data)
    assert (magic, version, header_size, offset, reserved) == (b"\x89HXB\r\n\x1a\n", 5, 40, 40, 0)
    assert zlib.crc32(data[40 : 40 + size]) == crc
    json.loads(data[40 : 40 + size])  # the manifest is plain JSON


def test_encode_is_deterministic_and_write_read(parts, data, tmp_path):
    assert hxb.encode(*parts) == data
    hxb.write(tmp_path / "m.hxb", *parts)
    assert hxb.read(tmp_path / "m.hxb").data == data


def test_encode_checks_what_it_writes(parts):
    manifest = copy.deepcopy(parts[0])
    manifest["kernels"][0]["op"] = "conv 2d"
    message = r"kernels\[0\]\.op: expected an identifier"
    with pytest.raises(HxbFormatError, match=message):
        hxb.encode(manifest, parts[1])
    with pytest.raises(HxbFormatError, match="encode computes the blob table"):
        hxb.encode({**parts[0], "blobs": []}, parts[1])


def test_encode_hashes_each_blob_once_and_its_self_check_once_more(parts, monkeypatch):
    hashed, original = [], hashlib.sha256

    def sha256(data):
        hashed.append(bytes(data))
        return original(data)
    monkeypatch.setattr(hashlib, "sha256", sha256)
    manifest, blobs = parts
    hxb.encode(manifest, blobs)
    assert sorted(hashed) == sorted(2 * [data for _, data in blobs])


def test_empty_blobs_and_no_blobs(modules):
    builder = modules.Builder()
    entry = builder.entry()
    entry.ret(entry.input("x", [0, 3]))
    data = hxb.encode(*builder.build())
    assert hxb.decode(data).json["blobs"] == [] and hxb.decode(data).manifest.blobs == ()
    builder.constant("nothing", modules.weights()["b1"][:0])
    assert hxb.decode(hxb.encode(*builder.build())).json["blobs"][0]["size"] == 0


# --- structure -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "foreign",
    [b"", b"\x89PNG\r\n\x1a\n" + bytes(100), b"hello, world\n" * 10, b"\x7fELF" + bytes(60), b"{}"],
    ids=["empty", "png", "text", "elf", "json"],
)
def test_foreign_files_have_bad_magic(foreign):
    error = assert_format_error(foreign, "header.magic")
    assert str(error) == "header.magic: not a hexir module (bad magic)"


def test_unknown_version(data):
    for version in (0, 6):
        error = assert_format_error(patch(data, 8, struct.pack("<I", version)), "header.version")
        assert error.reason == f"version {version} is not supported; this runtime reads versions 1, 2, 3, 4 and 5"
    # a version-3 manifest has epilogues where version 4 has expr: this one's expr is an unknown key
    assert_format_error(patch(data, 8, struct.pack("<I", 3)), "kernels[0].expr", "unknown key in a version-3 file")


def test_work_spans(parts):
    """A work record's optional `spans` (version 3): true, or no key; anything else is refused."""
    manifest, blobs = copy.deepcopy(parts)
    kernel = next(k for k in manifest["kernels"] if "work" in k)
    assert hxb.decode(hxb.encode(manifest, blobs)).manifest.kernels[0].cpu_code.work.spans is False
    kernel["work"]["spans"] = True
    index = manifest["kernels"].index(kernel)
    assert hxb.decode(hxb.encode(manifest, blobs)).manifest.kernels[index].cpu_code.work.spans is True
    for bad in (False, 1, "yes", None):
        kernel["work"]["spans"] = bad
        with pytest.raises(HxbFormatError) as caught:
            hxb.encode(manifest, blobs)
        assert caught.value.field == f"kernels[{index}].work.spans", str(caught.value)
        assert caught.value.reason.startswith("expected true (or no key), got"), str(caught.value)


@pytest.mark.parametrize(
    "offset, value, field",
    [(12, struct.pack("<I", 48), "header.header_size"), (16, struct.pack("<Q", 64), "header.manifest_offset"),
     (24, struct.pack("<Q", 10**9), "header.manifest_size"), (36, struct.pack("<I", 2), "header.flags")],
)
def test_header_fields(data, offset, value, field):
    assert_format_error(patch(data, offset, value), field)


def test_truncated_anywhere(data):
    blob_edges = [edge for blob in hxb.decode(data).json["blobs"] for edge in (blob["offset"], blob["offset"] + 1)]
    cuts = {*range(0, 48), *range(48, len(data), 97), *blob_edges, len(data) - 1}
    for cut in sorted(cuts):
        with pytest.raises(HxbFormatError) as caught:
            hxb.decode(data[:cut])
        if cut >= 8:
            assert "truncated" in str(caught.value) or caught.value.field == "header.manifest_crc32", cut


def test_trailing_bytes(data):
    assert_format_error(data + b"\0", "file", "1 unexpected bytes")


def test_corrupted_manifest_fails_its_crc(data):
    assert_format_error(patch(data, 100, bytes([data[100] ^ 0x20])), "header.manifest_crc32", "checksum mismatch")


def test_corrupted_blob_fails_its_checksum(data):
    blob = hxb.decode(data).json["blobs"][1]
    corrupted = patch(data, blob["offset"] + 5, bytes([data[blob["offset"] + 5] ^ 1]))
    assert_format_error(corrupted, "blobs[1].sha256", "checksum mismatch")


def test_padding_must_be_zero(modules):
    builder = modules.Builder()
    for name in "ab":  # 4 bytes each: 60 bytes of padding after the first
        builder.constant(name, np.ones(1, np.float32))
    entry = builder.entry()
    entry.ret(entry.input("x", [1]))
    data = hxb.encode(*builder.build())
    blob = hxb.decode(data).manifest.blobs[1]
    assert_format_error(patch(data, blob.offset - 1, b"\1"), "blobs[1].offset", "padding")


@pytest.mark.parametrize(
    "table, field, text",
    [
        ([{"name": "a", "offset": 130, "size": 1}], "blobs[0].offset", "not a multiple of 64"),
        ([{"name": "a", "offset": 0, "size": 1}], "blobs[0].offset", "inside the header or manifest"),
        ([{"name": "a", "offset": 1 << 20, "size": 1}], "blobs[0]", "past the end of the file"),
        ([{"name": "a", "offset": "x", "size": 1}], "blobs[0].offset", "expected an integer >= 0, got 'x'"),
        ([{"name": "a", "offset": 0, "size": -1}], "blobs[0].size", "expected an integer >= 0, got -1"),
        ([{"name": "a", "size": 1}], "blobs[0].offset", "missing"),
        ("no", "blobs", "expected an array, got 'no'"),
    ],
)
def test_blob_table(table, field, text):
    for blob in table if isinstance(table, list) else []:
        blob.setdefault("sha256", "0" * 64)
    text_bytes = json.dumps({"producer": "t", "blobs": table}).encode()
    assert_format_error(raw(text_bytes, bytes(1024)), field, text)


def test_overlapping_blobs(parts, data):
    manifest = json.loads(data[40 : 40 + struct.unpack_from("<Q", data, 24)[0]])
    manifest["blobs"][1]["offset"] = manifest["blobs"][0]["offset"]
    text = json.dumps(manifest).encode()
    text += b" " * (manifest["blobs"][0]["offset"] - 40 - len(text))  # keep the blobs where they are
    assert_format_error(raw(text, data[manifest["blobs"][0]["offset"] :]), "blobs[1].offset", "overlaps")


@pytest.mark.parametrize(
    "text, reason",
    [(b"[1, 2]", "expected an object, got an array"), (b"{", "not valid UTF-8 JSON"), (b"\xff{}", "not valid UTF-8"),
     (b'{"producer": "a", "producer": "b"}', "duplicate key 'producer'"), (b'{"a": NaN}', "NaN is not allowed"),
     (b"{}", "missing")],
)
def test_manifest_must_be_a_json_object(text, reason):
    error = assert_format_error(raw(text), "blobs" if reason == "missing" else "manifest")
    assert reason in error.reason


# --- meaning: each mutation of a valid manifest names its field ------------------------------


def _drop(container, key):
    del container[key]


MLP_MUTATIONS = {  # mutation of mlp()'s manifest -> (field, part of the message)
    "dtype name": (lambda m: m["kernels"][0]["args"][1].update(dtype="int8"),
                   "kernels[0].args[1].dtype",
                   "expected one of float32, float64, bfloat16, float16, int32, int64, got 'int8'"),
    "unknown top key": (lambda m: m.update(extra=1), "extra", "unknown key"),
    "unknown kernel key": (lambda m: m["kernels"][1].update(color="red"), "kernels[1].color", "unknown key"),
    "missing key": (lambda m: _drop(m["kernels"][2], "symbol"), "kernels[2].symbol", "missing"),
    "producer type": (lambda m: m.update(producer=3), "producer", "expected a string"),
    "constant blob index": (lambda m: m["constants"][0].update(blob=99), "constants[0].blob", "blob index in [0, "),
    "constant size": (lambda m: m["constants"][0].update(shape=[8, 15]), "constants[0].blob",
                      "blob 0 has 512 bytes; float32[8, 15] needs 480"),
    "negative dim": (lambda m: m["constants"][1].update(shape=[-16]), "constants[1].shape[0]", "integer >= 0"),
    "bool dim": (lambda m: m["constants"][1].update(shape=[True]), "constants[1].shape[0]", "got True"),
    "huge shape": (lambda m: m["entries"][0]["buffers"][0].update(shape=[2**40, 2**40]),
                   "entries[0].buffers[0].shape", "too large"),
    "kernel op": (lambda m: m["kernels"][0].update(op="conv-2d"), "kernels[0].op", "got 'conv-2d'"),
    "unknown op": (lambda m: m["kernels"][1].update(op="relu"), "kernels[1].op",
                   "unknown op 'relu': expected custom or a generated kernel's family"),
    "epilogues": (lambda m: m["kernels"][0].update(epilogues=["bias"]), "kernels[0].epilogues", "unknown key"),
    "no expr": (lambda m: _drop(m["kernels"][0], "expr"), "kernels[0].expr", "missing (a linear kernel"),
    "bias without its arg": (lambda m: m["kernels"][2].update(expr=["add", ["arg", 0], ["arg", 1]]),
                             "kernels[2].expr[2][1]", "expected an arg index below 1, got 1"),
    "sizes": (lambda m: m["kernels"][1].update(sizes=["n"]), "kernels[1].sizes",
              'expected the distinct symbols of the args in order, [], got ["n"]'),
    "extent symbol": (lambda m: m["kernels"][1]["work"].update(extent="n"), "kernels[1].work.extent",
                      "symbol 'n' is no dimension of the kernel's args (none)"),
    "grain": (lambda m: m["kernels"][1]["work"].update(grain=0), "kernels[1].work.grain", "integer >= 1"),
    "symbolic constant": (lambda m: m["constants"][1].update(shape=["n"]), "constants[1].shape[0]",
                          "expected an integer >= 0, got 'n'"),
    "unbound symbol": (lambda m: m["entries"][0]["buffers"][6].update(shape=["n", 4]),
                       "entries[0].buffers[6].shape", "symbol 'n' is bound by no input"),
    "unbound output symbol": (lambda m: m["entries"][0]["outputs"][0].update(shape=[2, "n"]),
                              "entries[0].outputs[0].shape", "symbol 'n' is bound by no input"),
    "symbol not an identifier": (lambda m: m["entries"][0]["inputs"][0].update(shape=["2x", 8]),
                                 "entries[0].inputs[0].shape[0]", "expected an identifier"),
    "linear shapes": (lambda m: m["kernels"][2]["args"][1].update(shape=[15, 4]), "kernels[2].args",
                      "linear expects x[..., K], w[K, N], out[..., N], got float32[2, 16], float32[15, 4]"),
    "bias shape": (lambda m: m["kernels"][0]["args"][2].update(shape=[15]), "kernels[0].args[2].shape",
                   "[15] does not broadcast to out's shape [2, 16]"),
    "relu shapes": (lambda m: m["kernels"][1]["args"][1].update(shape=[2, 15]), "kernels[1].args[0].shape",
                    "[2, 16] does not broadcast to out's shape [2, 15]"),
    "arity": (lambda m: m["kernels"][1]["args"].pop(0),
              "kernels[1].args", "pointwise takes at least 2 args, got 1"),
    "mixed dtypes": (lambda m: m["kernels"][0]["args"][1].update(dtype="float64"), "kernels[0].args[1].dtype",
                     "expected float32 like args[0]"),
    "access": (lambda m: m["kernels"][1]["args"][1].update(access="read"), "kernels[1].args[1].access",
               "expected one of write"),
    "symbol": (lambda m: m["kernels"][1].update(symbol="relu; rm -rf"), "kernels[1].symbol", "identifier"),
    "extent": (lambda m: m["kernels"][1]["work"].update(extent=-1), "kernels[1].work.extent", ">= 0"),
    "v1 extent": (lambda m: m["kernels"][1].update(parallel_extent=2), "kernels[1].parallel_extent", "unknown key"),
    "launch on cpu": (lambda m: m["kernels"][1].update(launch={}), "kernels[1].launch", "only cuda kernels"),
    "no work": (lambda m: _drop(m["kernels"][1], "work"), "kernels[1].work", "missing"),
    "no sizes": (lambda m: _drop(m["kernels"][1], "sizes"), "kernels[1].sizes", "missing (generated kernels need it)"),
    "cpu section missing": (lambda m: _drop(m, "cpu"), "cpu", "missing, but kernels[0] has cpu code"),
    "fallback on a cpu kernel": (lambda m: m["kernels"][1].update(cpu_fallback={}), "kernels[1].cpu_fallback",
                                 "only cuda kernels have this key"),
    "cpu library": (lambda m: m["cpu"]["libraries"][0].update(library=-1), "cpu.libraries[0].library", "blob index"),
    "cpu features": (lambda m: m["cpu"]["libraries"][0].update(features=["sse", 2]), "cpu.libraries[0].features[1]",
                     "expected a string"),
    "no cpu library": (lambda m: m["cpu"].update(libraries=[]), "cpu.libraries", "empty"),
    "old and new cpu keys": (lambda m: m["cpu"].update(cpu="x86-64"), "cpu.cpu", "unknown key"),
    "no entries": (lambda m: m.update(entries=[]), "entries", "at least one entry"),
    "entry name": (lambda m: m["entries"][0].update(name="not valid"), "entries[0].name", "identifier"),
    "same entry name": (lambda m: m["entries"][1].update(name="main"), "entries[1].name", "a second entry"),
    "same input name": (lambda m: m["entries"][2]["inputs"][1].update(name="a"), "entries[2].inputs[1].name",
                        "a second input"),
    "buffer device": (lambda m: m["entries"][0]["buffers"][0].update(device="tpu"),
                      "entries[0].buffers[0].device", "expected one of cpu, cuda"),
    "command op": (lambda m: m["entries"][0]["program"][0].update(op="jump"), "entries[0].program[0].op",
                   "expected one of input, constant, call, transfer, print, return, got 'jump'"),
    "command key": (lambda m: m["entries"][0]["program"][0].update(src=1), "entries[0].program[0].src",
                    "unknown key (allowed: op, index, dst)"),
    "input index": (lambda m: m["entries"][0]["program"][0].update(index=1), "entries[0].program[0].index",
                    "input index in [0, 1), got 1"),
    "input twice": (lambda m: m["entries"][2]["program"][1].update(index=0), "entries[2].program[1].index",
                    "bound a second time"),
    "input never bound": (lambda m: m["entries"][0]["inputs"].append({"name": "z", "shape": [], "dtype": "float32"}),
                          "entries[0].inputs[1]", "never bound"),
    "input shape": (lambda m: m["entries"][0]["inputs"][0].update(shape=[3, 8]), "entries[0].program[0].dst",
                    "buffer 0 is float32[2, 8] but input 0 is float32[3, 8]"),
    "call arg shape": (lambda m: m["entries"][0]["program"][3]["args"].__setitem__(0, 2),
                       "entries[0].program[3].args[0]", "buffer 2 is float32[16] but kernels[0].args[0]"),
    "call arg count": (lambda m: m["entries"][0]["program"][3]["args"].pop(0), "entries[0].program[3].args",
                       "kernels[0] takes 4 args, got 3"),
    "read before written": (lambda m: m["entries"][0]["program"].insert(0, m["entries"][0]["program"].pop(3)),
                            "entries[0].program[0].args[0]", "buffer 0 is read before it is written"),
    "written twice": (lambda m: m["entries"][0]["program"][2].update(dst=1), "entries[0].program[2].dst",
                      "buffer 1 is written a second time"),
    "never written": (lambda m: m["entries"][0]["buffers"].append({"shape": [1], "dtype": "float32", "device": "cpu"}),
                      "entries[0].buffers[7]", "never written"),
    "transfer same device": (lambda m: m["entries"][0]["program"].insert(-2, {"op": "transfer", "src": 6, "dst": 7})
                             or m["entries"][0]["buffers"].append(dict(m["entries"][0]["buffers"][6])),
                             "entries[0].program[7]", "must change device"),
    "kernel index": (lambda m: m["entries"][0]["program"][3].update(kernel=7), "entries[0].program[3].kernel",
                     "kernel index in [0, 4), got 7"),
    "return not last": (lambda m: m["entries"][0]["program"].append({"op": "print", "src": 6}),
                        "entries[0].program[8]", "return must be the last command"),
    "no return": (lambda m: m["entries"][0]["program"].pop(), "entries[0].program",
                  "the last command must be a return"),
    "output count": (lambda m: m["entries"][0]["outputs"].append(m["entries"][0]["outputs"][0]),
                     "entries[0].program[8].srcs", "returns 1 values, but the entry has 2 outputs"),
    "output shape": (lambda m: m["entries"][0]["outputs"][0].update(shape=[4, 2]), "entries[0].program[8].srcs[0]",
                     "buffer 6 is float32[2, 4] but output 0 is float32[4, 2]"),
}


@pytest.mark.parametrize("name", MLP_MUTATIONS)
def test_manifest_rule(parts, name):
    mutate, field, text = MLP_MUTATIONS[name]
    manifest = copy.deepcopy(parts[0])
    mutate(manifest)
    with pytest.raises(HxbFormatError) as caught:
        hxb.encode(manifest, parts[1])
    assert caught.value.field == field, str(caught.value)
    assert text in caught.value.reason, str(caught.value)


CUDA_MUTATIONS = {  # mutation of cuda()'s manifest -> (field, part of the message)
    "print a device buffer": (lambda m: m["entries"][0]["program"][4].update(src=2), "entries[0].program[4].src",
                              "buffer 2 is on cuda, but a printed buffer must be on cpu"),
    "return a device buffer": (lambda m: m["entries"][0]["program"][5]["srcs"].__setitem__(0, 2),
                               "entries[0].program[5].srcs[0]", "must be on cpu"),
    "input on device": (lambda m: m["entries"][0]["buffers"][0].update(device="cuda"), "entries[0].program[0].dst",
                        "must be on cpu"),
    "call on the wrong device": (lambda m: m["kernels"][0].update(device="cpu", work={"extent": 2, "grain": 1}) or
                                 [m["kernels"][0].pop(key) for key in ("launch", "images", "cpu_fallback")],
                                 "entries[0].program[2].args[0]",
                                 "buffer 1 is on cuda, but kernels[0].args[0] must be on cpu"),
    "cpu section without cpu code": (lambda m: _drop(m["kernels"][0], "cpu_fallback"), "cpu",
                                     "present, but no kernel has cpu code"),
    "fallback symbol": (lambda m: m["kernels"][0]["cpu_fallback"].update(symbol=""), "kernels[0].cpu_fallback.symbol",
                        "identifier"),
    "fallback work": (lambda m: _drop(m["kernels"][0]["cpu_fallback"], "work"),
                      "kernels[0].cpu_fallback.work", "missing"),
    "missing launch": (lambda m: _drop(m["kernels"][0], "launch"), "kernels[0].launch", "missing (cuda kernels"),
    "work on cuda": (lambda m: m["kernels"][0].update(work={"extent": 2, "grain": 1}), "kernels[0].work",
                     "only generated cpu kernels"),
    "grid": (lambda m: m["kernels"][0]["launch"].update(grid=[1, -1, 1]), "kernels[0].launch.grid[1]", ">= 0"),
    "grid expression": (lambda m: m["kernels"][0]["launch"].update(grid=[["div", 2, 1], 1, 1]),
                        "kernels[0].launch.grid[0][0]", "expected one of ceildiv, mul, add, min, max, got 'div'"),
    "block": (lambda m: m["kernels"][0]["launch"].update(block=[32, 0, 1]), "kernels[0].launch.block[1]", ">= 1"),
    "block size": (lambda m: m["kernels"][0]["launch"].update(block=[64, 32, 1]), "kernels[0].launch.block",
                   "64 x 32 x 1 threads: a block has at most 1024"),
    "shared bytes": (lambda m: m["kernels"][0]["launch"].update(shared_bytes=232449),
                     "kernels[0].launch.shared_bytes", "232449 bytes: a block has at most 232448"),
    "block rank": (lambda m: m["kernels"][0]["launch"].update(block=[32]), "kernels[0].launch.block", "[x, y, z]"),
    "image name": (lambda m: m["kernels"][0]["images"].update(sm90=0), "kernels[0].images.sm90", "sm_<number>"),
    "ptx is compute_NN": (lambda m: m["kernels"][0]["images"].update(ptx=1), "kernels[0].images.ptx",
                          "compute_<number> (PTX)"),
    "image blob": (lambda m: m["kernels"][0]["images"].update(compute_90=9), "kernels[0].images.compute_90",
                   "blob index in [0, 4)"),
    "cuda table blob": (lambda m: m["cuda"].update(table=4), "cuda.table", "blob index in [0, 4)"),
    "cuda table key": (lambda m: m["cuda"].update(tables=0), "cuda.tables", "unknown key"),
    "no images": (lambda m: m["kernels"][0].update(images={}), "kernels[0].images", "got an empty object"),
    "tensor map arg": (lambda m: m["kernels"][0].update(tensor_maps=[{"arg": 2, "box": [4, 4]}]),
                       "kernels[0].tensor_maps[0].arg", "the kernel has 2 args"),
    "tensor map of no matrix": (lambda m: m["kernels"][0].update(tensor_maps=[{"arg": 0, "box": [4, 4]}]),
                                "kernels[0].tensor_maps[0].arg", "a tensor map reads a matrix"),
    "tensor map keys": (lambda m: m["kernels"][0].update(tensor_maps=[{"arg": 0}]), "kernels[0].tensor_maps[0].box",
                        "missing"),
    "variant arch": (lambda m: m["kernels"][0].update(variants=[{"symbol": "v", "launch": m["kernels"][0]["launch"],
                                                                  "arch": "sm_90a"}]),
                     "kernels[0].variants[0].arch", "architecture among the images"),
    "images not an object, a variant's arch": (  # (checked before the variant looks its arch up in them)
        lambda m: m["kernels"][0].update(images=5, variants=[{"symbol": "v", "launch": m["kernels"][0]["launch"],
                                                              "arch": "sm_90"}]),
        "kernels[0].images", "expected an object of sm_NN/compute_NN images, got 5"),
    "variant without a bound": (lambda m: m["kernels"][0].update(variants=[{"symbol": "v",
                                                                             "launch": m["kernels"][0]["launch"]}]),
                                "kernels[0].variants[0].below", "(or an arch)"),
    "tensor maps on the cpu": (lambda m: m["kernels"][0]["cpu_fallback"].update(tensor_maps=[]),
                               "kernels[0].cpu_fallback.tensor_maps", "unknown key"),
}


@pytest.mark.parametrize("name", CUDA_MUTATIONS)
def test_cuda_manifest_rule(modules, name):
    manifest, blobs = modules.cuda()
    mutate, field, text = CUDA_MUTATIONS[name]
    mutate(manifest)
    with pytest.raises(HxbFormatError) as caught:
        hxb.encode(manifest, blobs)
    assert caught.value.field == field, str(caught.value)
    assert text in caught.value.reason, str(caught.value)


def test_the_example_in_the_format_document():
    document = (Path(__file__).parents[2] / "docs" / "hxb-format.md").read_text()
    example = json.loads(re.search(r"```json\n(.*?)```", document, re.S).group(1).replace("…", "0" * 64))
    sizes = {blob["name"]: blob["size"] for blob in example.pop("blobs")}
    data = hxb.encode(example, [(name, bytes(size)) for name, size in sizes.items()])
    assert [blob["offset"] for blob in hxb.decode(data).json["blobs"]][1] % 64 == 0


def test_a_variant_of_one_architecture_runs_only_from_its_image(modules):
    """A variant with an `arch` (an sm_90a kernel beside the plain sm_90 one) is kept when that
    image is the one loaded, dropped otherwise; its tensor maps are its own."""
    manifest, blobs = modules.cuda()
    kernel = manifest["kernels"][0]
    kernel["variants"] = [{"symbol": "relu_wgmma", "launch": kernel["launch"], "arch": "sm_90",
                           "tensor_maps": []}]
    code = hxb.decode(hxb.encode(manifest, blobs)).manifest.kernels[0].gpu_code
    assert [v.symbol for v in code.for_image("sm_90").variants] == ["relu_wgmma"]
    assert code.for_image("sm_90").pick({})[0] == "relu_wgmma"
    assert code.for_image("compute_90").variants == () and code.for_image("compute_90").pick({})[0] == kernel["symbol"]
    assert code.maps_of("relu_wgmma") == () and code.maps_of(kernel["symbol"]) == ()
