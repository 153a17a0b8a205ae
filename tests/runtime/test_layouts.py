"""Layout kernels (#24) in hand-built manifests: each record's contract (format/layouts.py) as
untrusted input, the reference device's numpy meaning, int32 through the format, and where a
take's ids may come from (inputs checked per call, constants at load, argmaxes by their axis;
anything else refused)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hexir_runtime import HxbFormatError, InputError, load
from hexir_runtime import format as hxb
from hexir_runtime.cli import main as hexir_run
from hexir_runtime.dlpack import CPU, DLPackArray, unpack
from hexir_runtime.executor import format_tensor
from hexir_runtime.serving import protocol
from test_kernel_families import ARGMAX, generated, one_kernel, reference


def test_each_record_computes_its_numpy_meaning_on_the_reference_device(modules):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 5)).astype(np.float32)
    cases = [({"kind": "transpose", "perm": [2, 0, 1]}, [5, 3, 4], x.transpose(2, 0, 1)),
             ({"kind": "reshape"}, [12, 5], x.reshape(12, 5)),
             ({"kind": "slice", "start": [2, 0, 1], "step": [-1, 2, 3]}, [3, 2, 2], x[::-1, ::2, 1::3])]
    for record, shape, want in cases:
        module = reference(modules, "layout", record, [([3, 4, 5], "float32")], (shape, "float32"))
        np.testing.assert_array_equal(module.main(x), want)
    ints = np.arange(6, dtype=np.int32).reshape(2, 3)
    module = reference(modules, "layout", {"kind": "concat", "axis": 1}, [([2, 3], "int32"), ([2, 3], "int32")],
                       ([2, 6], "int32"))
    np.testing.assert_array_equal(module.main(ints, ints * 2), np.concatenate([ints, ints * 2], 1))
    table = rng.standard_normal((7, 4))
    ids = np.array([[6, 0], [3, 3]], np.int64)
    module = reference(modules, "layout", {"kind": "take"}, [([7, 4], "float64"), ([2, 2], "int64")],
                       ([2, 2, 4], "float64"))
    np.testing.assert_array_equal(module.main(table, ids), np.take(table, ids, axis=0))


@pytest.mark.parametrize("record, inputs, out, field, text", [
    ({"kind": "spin"}, [([2, 3], "float32")], ([3, 2], "float32"), ".expr.kind", "expected one of"),
    ({"kind": "transpose"}, [([2, 3], "float32")], ([3, 2], "float32"), ".expr.perm", "missing"),
    ({"kind": "transpose", "perm": [0, 0]}, [([2, 3], "float32")], ([2, 2], "float32"), ".expr.perm",
     "expected a permutation of the 2 axes of [2, 3], got [0, 0]"),
    ({"kind": "transpose", "perm": [1, 0]}, [([2, 3], "float32")], ([2, 3], "float32"), ".expr",
     "a transpose of [2, 3] makes [3, 2], but its output is [2, 3]"),
    ({"kind": "reshape"}, [([2, 3], "float32")], ([7], "float32"), ".expr",
     "cannot reshape [2, 3] to [7]: the sizes differ"),
    ({"kind": "reshape"}, [(["batch", 3], "float32")], ([3, "batch"], "float32"), ".expr",
     "cannot reshape [batch, 3] to [3, batch]: the sizes differ"),
    ({"kind": "reshape"}, [(["batch", "seq", 4], "float32")], (["seq", "batch", 4], "float32"), ".expr",
     "its symbols differ (a symbolic dimension may only map to itself"),
    ({"kind": "slice", "start": [0, 2], "step": [1, 1]}, [([2, 3], "float32")], ([2, 2], "float32"), ".expr.start[1]",
     "2 elements from 2 in steps of 1 leave axis 1 of [2, 3]"),
    ({"kind": "slice", "start": [0, 0], "step": [1, 0]}, [([2, 3], "float32")], ([2, 1], "float32"), ".expr.start[1]",
     "a non-zero int step"),
    ({"kind": "slice", "start": [1, 0], "step": [1, 1]}, [(["batch", 3], "float32")], (["batch", 3], "float32"),
     ".expr.start[0]", "a symbolic axis (batch) is taken whole"),
    ({"kind": "concat", "axis": 1}, [([2, 3], "float32"), ([3, 3], "float32")], ([2, 6], "float32"), ".expr",
     "cannot concatenate [2, 3], [3, 3] along axis 1"),
    ({"kind": "concat", "axis": 0}, [([2, 3], "float32"), ([2, 3], "float64")], ([4, 3], "float32"), ".expr",
     "args have one dtype"),
    ({"kind": "take"}, [([5, 2], "float32"), ([3], "float32")], ([3, 2], "float32"), ".expr",
     "take's ids are int32 or int64"),
    ({"kind": "take"}, [(["batch", 2], "float32"), ([3], "int32")], ([3, 2], "float32"), ".expr",
     "static, non-empty first axis"),
    ({"kind": "take"}, [([5, 2], "float32"), ([3], "int32")], ([3, 5], "float32"), ".expr",
     "a take of [5, 2], [3] makes [3, 2], but its output is [3, 5]"),
    ({"kind": "take"}, [([5, 2], "float32")], ([3, 5], "float32"), ".expr", "a take takes 2 input(s), got 1"),
], ids=["kind", "no perm", "perm", "transpose shape", "reshape size", "reshape moved symbol", "reshape symbols",
        "slice bounds", "slice step", "slice symbolic", "concat dims", "concat dtypes", "take float ids",
        "take symbolic rows", "take shape", "take arity"])
def test_a_layout_kernel_breaking_its_contract_is_refused(modules, record, inputs, out, field, text):
    with pytest.raises(HxbFormatError) as caught:
        hxb.encode(*one_kernel(modules, "layout", record, inputs, out))
    assert caught.value.field == f"kernels[0]{field}", str(caught.value)
    assert text in caught.value.reason, str(caught.value)


def test_int32_travels_through_the_format_the_module_and_print(modules, capsys):
    module = reference(modules, "layout", {"kind": "transpose", "perm": [1, 0]}, [([2, 3], "int32")],
                       ([3, 2], "int32"))
    assert str(module.signature("main")) == "main(a0: int32[2, 3]) -> int32[3, 2]"
    ids = np.arange(6, dtype=np.int32).reshape(2, 3)
    result = module.main(ids)
    assert result.dtype == np.int32
    np.testing.assert_array_equal(result, ids.T)
    with pytest.raises(InputError, match=r"argument 'a0' expects int32\[2, 3\], got int64\[2, 3\]"):
        module.main(ids.astype(np.int64))
    assert format_tensor(ids) == "0 1 2 \n3 4 5 \n"


def _take_module(modules, ids_from: str, rows: int = 5):
    """main(...) -> take(table[rows, 2], ids) with ids from an input (through a reshape), a
    constant or an argmax over 4 values."""
    builder = modules.Builder()
    table = builder.constant("table", np.arange(rows * 2, dtype=np.float32).reshape(rows, 2))
    take = generated(builder, "layout", {"kind": "take"}, [([rows, 2], "float32"), ([4], "int64"),
                                                            ([4, 2], "float32")])
    entry = builder.entry()
    if ids_from == "input":
        flat = generated(builder, "layout", {"kind": "reshape"}, [([2, 2], "int64"), ([4], "int64")])
        ids = entry.call(flat, entry.input("ids", [2, 2], "int64"))
    elif ids_from == "constant":
        ids = entry.constant(builder.constant("ids", np.array([0, 1, rows, 2], np.int64)))
    else:
        argmax = generated(builder, "reduce", ARGMAX, [([4, 4], "float32"), ([4], "int64")])
        ids = entry.call(argmax, entry.input("x", [4, 4], "float32"))
    entry.ret(entry.call(take, entry.constant(table), ids))
    return builder.build()


def test_ids_from_an_input_are_checked_per_call_naming_the_input(modules):
    module = load(hxb.encode(*_take_module(modules, "input")), "reference")
    table = np.arange(10, dtype=np.float32).reshape(5, 2)
    ids = np.array([[4, 0], [2, 2]], np.int64)
    np.testing.assert_array_equal(module.main(ids), np.take(table, ids.reshape(4), axis=0))
    for bad, where in ((5, "[1, 0]"), (-1, "[1, 0]")):
        wrong = ids.copy()
        wrong[1, 0] = bad
        with pytest.raises(InputError, match=rf"main\(\): input 'ids' holds the id {bad} at \{where}, out of range "
                                             r"for k0_layout's table of 5 rows"):
            module.main(wrong)


def test_ids_from_a_constant_or_an_argmax_are_bounded_when_the_module_loads(modules):
    with pytest.raises(HxbFormatError, match=r"constants\[1\]: holds the id 5, out of range for k0_layout's table "
                                             "of 5 rows"):
        load(hxb.encode(*_take_module(modules, "constant")), "reference")
    x = np.random.default_rng(1).standard_normal((4, 4)).astype(np.float32)
    module = load(hxb.encode(*_take_module(modules, "argmax")), "reference")  # 4 values < 5 rows
    np.testing.assert_array_equal(module.main(x), np.take(np.arange(10, dtype=np.float32).reshape(5, 2),
                                                          x.argmax(1), axis=0))
    with pytest.raises(InputError, match="the ids of k0_layout are an argmax over 4 values, but its table has "
                                         "3 rows"):
        load(hxb.encode(*_take_module(modules, "argmax", rows=3)), "reference")


def test_int32_through_dlpack_hexir_run_and_info(modules, tmp_path, capsys):
    memory = np.arange(6, dtype=np.int32).reshape(2, 3)
    array = DLPackArray(memory.ctypes.data, (2, 3), np.int32, (CPU, 0))
    taken = np.from_dlpack(array)  # our export says kDLInt, 32 bits
    assert taken.dtype == np.int32 and taken.tolist() == memory.tolist()
    assert unpack(memory.__dlpack__()).dtype == np.int32
    module = reference(modules, "layout", {"kind": "transpose", "perm": [1, 0]}, [([2, 3], "int32")],
                       ([3, 2], "int32"))
    np.testing.assert_array_equal(module.main(array), memory.T)  # a host DLPack int32 tensor as an input
    hxb.write(tmp_path / "t.hxb", *one_kernel(modules, "layout", {"kind": "transpose", "perm": [1, 0]},
                                              [([2, 3], "int32")], ([3, 2], "int32")))
    np.save(tmp_path / "ids.npy", memory)
    assert hexir_run([str(tmp_path / "t.hxb"), "--device=reference", "--input", f"a0={tmp_path / 'ids.npy'}"]) == 0
    assert "output0: int32[3, 2]\n[[0 3]\n [1 4]\n [2 5]]\n" in capsys.readouterr().out
    assert hexir_run([str(tmp_path / "t.hxb"), "--info"]) == 0
    info = capsys.readouterr().out
    assert ("[0] k0_layout: cpu layout(read int32[2, 3], write int32[3, 2])\n"
            "      computes transpose perm=[1, 0]\n") in info


def test_serving_speaks_int32(modules):
    module = reference(modules, "layout", {"kind": "transpose", "perm": [1, 0]}, [([2, 3], "int32")],
                       ([3, 2], "int32"))
    signature = module.signature("main")
    described = protocol.metadata("t", signature)
    assert described["inputs"] == [{"name": "a0", "datatype": "INT32", "shape": [2, 3]}]
    assert described["outputs"][0]["datatype"] == "INT32"
    body = json.dumps({"inputs": [{"name": "a0", "datatype": "INT32", "shape": [2, 3], "data": [0, 1, 2, 3, 4, 5]}]})
    request = protocol.decode_request(body.encode(), signature)
    assert request.arrays[0].dtype == np.int32
    np.testing.assert_array_equal(module.main(*request.arrays), np.arange(6).reshape(2, 3).T)
