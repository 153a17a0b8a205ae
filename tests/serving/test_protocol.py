"""The engine-neutral serving layer (hexir_runtime.serving.protocol): metadata, request checks
before batching, batching along the leading symbol, the JSON and binary encodings. No Ray."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hexir_runtime.errors import InputError
from hexir_runtime.format import TensorType
from hexir_runtime.module import Signature
from hexir_runtime.serving import (
    ProtocolError,
    batch_symbol,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
    metadata,
    run_batched,
)
from hexir_runtime.serving.protocol import HEADER_LENGTH, header_length

MLP = Signature("main", (("x", TensorType(("batch", 8), "float32")),), (TensorType(("batch", 4), "float32"),))
PAIR = Signature("main", (("a", TensorType(("batch", 3), "float64")), ("b", TensorType(("batch", "n"), "float64"))),
                 (TensorType(("batch", 3), "float64"), TensorType(("n",), "float64")))
COUNTS = Signature("main", (("ids", TensorType((4,), "int64")),), (TensorType((4,), "int64"),))


def request(*inputs: dict, **extra) -> bytes:
    return json.dumps({"inputs": list(inputs), **extra}).encode()


def x_input(shape=(2, 8), datatype="FP32", **fields) -> dict:
    data = fields.pop("data", list(range(int(np.prod(shape)))))
    return {"name": "x", "datatype": datatype, "shape": list(shape), "data": data, **fields}


def test_metadata_names_every_tensor_with_symbols_as_minus_one():
    assert metadata("mlp", MLP) == {
        "name": "mlp", "versions": ["1"], "platform": "hexir",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 8]}],
        "outputs": [{"name": "output0", "datatype": "FP32", "shape": [-1, 4]}]}
    assert [t["datatype"] for t in metadata("c", COUNTS)["inputs"]] == ["INT64"]


@pytest.mark.parametrize("signature, symbol", [
    (MLP, "batch"),
    (PAIR, None),  # output1 does not lead with batch
    (COUNTS, None),  # static
    (Signature("main", (("x", TensorType(("batch", "batch"), "float32")),), (TensorType(("batch",), "float32"),)),
     None),  # batch twice in one input: concatenation would break it
    (Signature("main", (("x", TensorType(("batch", 2), "float32")),), (TensorType((2,), "float32"),)), None),
])
def test_batch_symbol(signature, symbol):
    assert batch_symbol(signature) == symbol


def test_json_request_nested_or_flat():
    flat = decode_request(request(x_input(), id="7"), MLP)
    nested = decode_request(request(x_input(data=np.arange(16).reshape(2, 8).tolist())), MLP)
    for decoded in (flat, nested):
        (x,) = decoded.arrays
        assert x.dtype == np.float32 and x.shape == (2, 8)
        np.testing.assert_array_equal(x, np.arange(16).reshape(2, 8))
    assert (flat.id, flat.outputs, flat.binary) == ("7", (0,), frozenset())


def test_binary_request_round_trip():
    a, b = np.random.rand(5, 3), np.random.rand(5, 2)
    body, headers = encode_request({"b": b, "a": a}, identifier="r1")
    decoded = decode_request(body, PAIR, int(headers[HEADER_LENGTH]))
    np.testing.assert_array_equal(decoded.arrays[0], a)
    np.testing.assert_array_equal(decoded.arrays[1], b)
    assert decoded.binary == frozenset({0, 1}) and decoded.id == "r1"
    json_body, json_headers = encode_request({"a": a, "b": b}, binary=False)
    assert HEADER_LENGTH not in json_headers
    assert decode_request(json_body, PAIR).binary == frozenset()


@pytest.mark.parametrize("body, header, message", [
    (b"{nope", None, "not JSON"),
    (b'{"inputs": 3}', None, 'list "inputs"'),
    (request({"datatype": "FP32"}), None, 'inputs[0] must be an object with a "name"'),
    (request(x_input(), {**x_input(), "name": "y"}), None, "no input named 'y' (inputs: x)"),
    (request(x_input(), x_input()), None, "input 'x' is given twice"),
    (request(), None, "missing input(s) 'x': expects main(x: float32[batch, 8])"),
    (request(x_input(datatype="FP64")), None, "input 'x' (expects FP32 [-1, 8], that is float32[batch, 8]): "
                                              "datatype is 'FP64'"),
    (request(x_input(shape=(2, 7))), None, "input 'x' (expects FP32 [-1, 8], that is float32[batch, 8]): "
                                           "shape is [2, 7]"),
    (request(x_input(shape=(16,))), None, "shape is [16]"),
    (request(x_input(shape=(-1, 8), data=[])), None, "shape must be a list of non-negative integers"),
    (request(x_input(shape=(2, 8), data=[1.0] * 15)), None, "input 'x' (expects FP32 [-1, 8], that is "
                                                           "float32[batch, 8]): data has 15 values, shape [2, 8] "
                                                           "needs 16"),
    (request(x_input(shape=(1, 8), data=["1"] * 8)), None, "data holds strings, not float32 values"),
    (request(x_input(shape=(1, 8), data=[[1, 2], [3]])), None, "data is not a (nested) list of numbers"),
    (request(x_input(shape=(1, 8), data=None, parameters={"binary_data_size": 31})) + bytes(32), 69,
     "binary_data_size is 31, 32 bytes expected"),
    (request(x_input(shape=(1, 8), data=None, parameters={"binary_data_size": 32})) + bytes(16), 69,
     "binary_data_size is 32, but only 16 bytes are left"),
    (request(x_input(shape=(1, 8), data=None, parameters={"binary_data_size": 32})) + bytes(40), 69,
     "add up to 32 bytes, but 40 follow the JSON header"),
    (b"{}", 99, f"{HEADER_LENGTH} is 99, but the body has 2 bytes"),
    (request({k: v for k, v in x_input().items() if k != "data"}), None, 'no "data" and no parameters.binary'),
    (request(x_input(), outputs=[{"name": "output3"}]), None, "no output named 'output3' (outputs: output0)"),
])
def test_bad_requests_are_refused_naming_the_input(body, header, message):
    if header == 69:  # the JSON header's own length, whatever json.dumps made of it
        header = body.index(b"}]}") + 3
    with pytest.raises(ProtocolError) as caught:
        decode_request(body, MLP, header)
    assert message in str(caught.value) and caught.value.status == 400
    assert isinstance(caught.value, InputError)


def test_inputs_must_agree_on_a_shared_symbol():
    body, _ = encode_request({"a": np.zeros((2, 3)), "b": np.zeros((3, 1))}, binary=False)
    with pytest.raises(ProtocolError, match="input 'b' has batch = 3 .axis 0., but input 'a' has batch = 2"):
        decode_request(body, PAIR)


def test_integers_take_no_floats():
    good = decode_request(request({"name": "ids", "datatype": "INT64", "shape": [4], "data": [1, 2, 3, 2**40]}),
                          COUNTS)
    assert good.arrays[0].dtype == np.int64 and good.arrays[0][3] == 2**40
    with pytest.raises(ProtocolError, match="data holds floats, not int64 values"):
        decode_request(request({"name": "ids", "datatype": "INT64", "shape": [4], "data": [1, 2, 3, 1.5]}), COUNTS)
    with pytest.raises(ProtocolError, match="data holds integers outside int64's range"):
        decode_request(request({"name": "ids", "datatype": "INT64", "shape": [4], "data": [2**64 - 1] * 4}),
                       COUNTS)


def mlp_numpy(x: np.ndarray) -> np.ndarray:
    return x[:, :4] * 2


def test_run_batched_concatenates_runs_once_and_splits():
    calls = []

    def call(x):
        calls.append(x.shape)
        return mlp_numpy(x)
    requests = [(np.random.rand(rows, 8).astype(np.float32),) for rows in (1, 3, 0, 2)]
    results = run_batched(call, requests, "batch")
    assert calls == [(6, 8)]
    for (x,), (y,) in zip(requests, results, strict=True):
        np.testing.assert_array_equal(y, mlp_numpy(x))


def test_run_batched_groups_by_the_other_extents_and_without_a_symbol_runs_each_alone():
    calls = []

    def call(a, b):
        calls.append((a.shape, b.shape))
        return a * 2, b * 3
    requests = [(np.ones((1, 3)), np.ones((1, 2))), (np.ones((2, 3)), np.ones((2, 5))),
                (np.ones((4, 3)), np.ones((4, 2)))]
    results = run_batched(call, requests, "batch")
    assert sorted(calls) == [((2, 3), (2, 5)), ((5, 3), (5, 2))]
    assert results[1][0].shape == (2, 3)
    calls.clear()
    run_batched(call, requests, None)
    assert len(calls) == 3


def test_one_failing_request_fails_alone():
    def call(x):
        if (x < 0).any():  # what a kernel might refuse: only the request holding it is to blame
            raise InputError("negative values")
        return mlp_numpy(x)
    requests = [(np.full((rows, 8), value, np.float32),) for rows, value in ((2, 1), (1, -1), (3, 2))]
    results = run_batched(call, requests, "batch")
    assert isinstance(results[1], InputError)
    np.testing.assert_array_equal(results[0][0], mlp_numpy(requests[0][0]))
    np.testing.assert_array_equal(results[2][0], mlp_numpy(requests[2][0]))


@pytest.mark.parametrize("binary", [False, True])
def test_response_round_trip(binary):
    outputs = (np.random.rand(5, 3), np.random.rand(2))
    wanted = {"outputs": [{"name": "output1", "parameters": {"binary_data": binary}}, {"name": "output0"}]}
    decoded = decode_request(request({"name": "a", "datatype": "FP64", "shape": [5, 3], "data": [0.0] * 15},
                                     {"name": "b", "datatype": "FP64", "shape": [5, 2], "data": [0.0] * 10},
                                     id="q", **wanted), PAIR)
    body, headers = encode_response("pair", PAIR, decoded, outputs)
    header = headers.get(HEADER_LENGTH)
    assert (header is not None) == binary
    response = json.loads(body[:int(header)] if binary else body)
    assert (response["model_name"], response["id"]) == ("pair", "q")
    assert [tensor["name"] for tensor in response["outputs"]] == ["output1", "output0"]
    arrays = decode_response(body, int(header) if header else None)
    np.testing.assert_array_equal(arrays["output0"], outputs[0])
    np.testing.assert_array_equal(arrays["output1"], outputs[1])


@pytest.mark.parametrize("binary", [False, True])
def test_an_int64_output_is_int64_both_ways(binary):
    """An argmax's int64 output (issue #23): datatype INT64 in the metadata and the response,
    integers in JSON (2**40 kept exact), 8 little-endian bytes each in binary."""
    argmax = Signature("main", (("x", TensorType(("batch", 4), "float32")),), (TensorType(("batch",), "int64"),))
    assert metadata("argmax", argmax)["outputs"] == [{"name": "output0", "datatype": "INT64", "shape": [-1]}]
    wanted = {"parameters": {"binary_data_output": True}} if binary else {}
    decoded = decode_request(request(x_input((2, 4)), **wanted), argmax)
    indices = np.int64([3, 2**40])
    body, headers = encode_response("argmax", argmax, decoded, (indices,))
    header = headers.get(HEADER_LENGTH)
    response = json.loads(body[:int(header)] if binary else body)
    assert response["outputs"][0]["datatype"] == "INT64"
    assert ("data" in response["outputs"][0]) != binary
    arrays = decode_response(body, int(header) if header else None)
    assert arrays["output0"].dtype == np.int64 and arrays["output0"].tolist() == [3, 2**40]


def test_an_error_response_is_raised_by_the_client():
    with pytest.raises(ProtocolError, match="input 'x' is bad"):
        decode_response(b'{"error": "input \'x\' is bad"}')
    with pytest.raises(ProtocolError, match="malformed response"):
        decode_response(b'{"outputs": [{"name": "y"}]}')


@pytest.mark.parametrize("text", ["12x", "-1", "\xb2", "9" * 5000, "1e3", ""])
def test_a_header_length_that_is_not_a_plain_count_is_a_400(text):
    with pytest.raises(ProtocolError, match=f"^{HEADER_LENGTH} is not a byte count") as caught:
        header_length(text)
    assert caught.value.status == 400


def test_a_header_length_is_read_as_a_decimal_count():
    assert header_length(None) is None and header_length(" 42 ") == 42
