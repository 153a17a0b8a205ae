"""The Open Inference Protocol (KServe v2) for a hexir module, engine-neutral: numpy and json only.

What a server needs, whatever runs it (serving/ray.py is one engine):
- `metadata(name, signature)`: the model's metadata, `GET /v2/models/{name}`; a symbol in a shape is -1.
- `decode_request(body, signature, header_length)`: an inference request (JSON, or the binary tensor
  extension: a JSON header of `header_length` bytes, then each binary input's raw little-endian
  bytes) checked against the signature (names, datatype, shape, data length, shared symbols)
  before it can join a batch: a request that would break a batch's concatenation is refused here,
  alone, with a `ProtocolError` (status 400) naming the input and what was expected.
- `run_batched(call, requests, symbol)`: requests whose inputs all lead with one symbol
  (`batch_symbol`) are concatenated along it, run in one call and split again; one that fails
  fails alone.
- `encode_response(...)`: outputs as JSON data, or binary where the request asked for it
  (`parameters.binary_data_output`, or `outputs[i].parameters.binary_data`).
- `encode_request` / `decode_response`: the client's side of the same (tests, bench/serve.py).

    request:  {"id": "7", "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 8], "data": [...16 numbers]}]}
    response: {"model_name": "mlp", "id": "7", "outputs": [{"name": "output0", "datatype": "FP32",
               "shape": [2, 4], "data": [...8 numbers]}]}
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import HexirRuntimeError, InputError
from ..executor import bind
from ..format import numpy_dtype
from ..module import Signature

# numpy dtype name -> the protocol's datatype (BYTES, strings, has no numpy twin here)
DATATYPES = {"bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32", "uint64": "UINT64",
             "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64",
             "float16": "FP16", "bfloat16": "BF16", "float32": "FP32", "float64": "FP64"}
NUMPY_DTYPES = {datatype: name for name, datatype in DATATYPES.items()}
# which kinds of JSON numbers (as numpy reads a list of them) each dtype kind takes: 1.5 is not rounded to an int
JSON_KINDS = {"f": "fiu", "V": "fiu", "i": "iu", "u": "iu", "b": "b"}  # (V: ml_dtypes' bfloat16)
HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_EXTENSION = "binary_tensor_data"


class ProtocolError(InputError):
    """A request (or response) the protocol or the model's signature refuses; `status` is the HTTP status."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Request:
    """A checked inference request: its arrays in the signature's order, which outputs it wants
    (positions; all by default) and which of those go back as binary data."""

    id: str | None
    arrays: tuple[np.ndarray, ...]
    outputs: tuple[int, ...]
    binary: frozenset[int]


def output_names(signature: Signature) -> list[str]:
    """The names of an entry's outputs: output0, output1, ..."""
    return [f"output{i}" for i in range(len(signature.outputs))]


def metadata(name: str, signature: Signature, platform: str = "hexir") -> dict[str, Any]:
    """The model metadata response of the protocol for the entry `signature` of model `name`."""
    def tensor(tensor_name: str, tensor_type: Any) -> dict[str, Any]:
        shape = [-1 if isinstance(dim, str) else dim for dim in tensor_type.shape]
        return {"name": tensor_name, "datatype": DATATYPES[tensor_type.dtype], "shape": shape}
    return {"name": name, "versions": ["1"], "platform": platform,
            "inputs": [tensor(input_name, tensor_type) for input_name, tensor_type in signature.inputs],
            "outputs": [tensor(output, tensor_type)
                        for output, tensor_type in zip(output_names(signature), signature.outputs, strict=True)]}


def batch_symbol(signature: Signature) -> str | None:
    """The symbol every input and output leads with and that appears nowhere else, along which
    requests can be concatenated; None if there is none (each request then runs alone)."""
    tensors = [tensor for _, tensor in signature.inputs] + list(signature.outputs)
    if not signature.inputs or any(not tensor.shape for tensor in tensors):
        return None
    symbol = tensors[0].shape[0]
    if not isinstance(symbol, str):
        return None
    if all(tensor.shape[0] == symbol and symbol not in tensor.shape[1:] for tensor in tensors):
        return symbol
    return None


def header_length(text: str | None) -> int | None:
    """The byte count an `Inference-Header-Content-Length` header gives (None: no header); a
    header that is not a plain decimal count (ASCII digits, at most 18) is a ProtocolError."""
    if text is None:
        return None
    digits = text.strip()
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 18):
        raise ProtocolError(f"{HEADER_LENGTH} is not a byte count: {text!r}")
    return int(digits)


def decode_request(body: bytes, signature: Signature, header_length: int | None = None) -> Request:
    """An inference request checked against `signature`; ProtocolError (400) naming what is wrong."""
    if header_length is not None and not 0 <= header_length <= len(body):
        raise ProtocolError(f"{HEADER_LENGTH} is {header_length}, but the body has {len(body)} bytes")
    end = len(body) if header_length is None else header_length
    try:
        request = json.loads(bytes(body[:end]))
    except (ValueError, RecursionError) as error:
        raise ProtocolError(f"the request is not JSON ({error})") from None
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list):
        raise ProtocolError('the request must be a JSON object with a list "inputs"')
    given: dict[str, np.ndarray] = {}
    expected = dict(signature.inputs)
    offset = end
    for position, item in enumerate(request["inputs"]):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ProtocolError(f'inputs[{position}] must be an object with a "name"')
        name = item["name"]
        if name not in expected:
            raise ProtocolError(f"no input named {name!r} (inputs: {', '.join(expected) or 'none'})")
        if name in given:
            raise ProtocolError(f"input {name!r} is given twice")
        given[name], offset = _decode_input(item, expected[name], body, offset)
    if offset != len(body):
        raise ProtocolError(f"the binary inputs' binary_data_size add up to {offset - end} bytes, but "
                            f"{len(body) - end} follow the JSON header")
    missing = [name for name in expected if name not in given]
    if missing:
        raise ProtocolError(f"missing input(s) {', '.join(map(repr, missing))}: expects {signature}")
    arrays = tuple(given[name] for name in expected)
    try:
        bind(signature, [array.shape for array in arrays])  # one size per symbol across inputs
    except InputError as error:
        raise ProtocolError(str(error)) from None
    outputs, binary = _wanted_outputs(request, signature)
    identifier = request.get("id")
    return Request(identifier if isinstance(identifier, str) else None, arrays, outputs, binary)


def _decode_input(item: dict[str, Any], expected: Any, body: bytes, offset: int) -> tuple[np.ndarray, int]:
    """One input's array (JSON `data`, or binary bytes from `offset`) and the offset after it."""
    name, datatype, shape = item["name"], item.get("datatype"), item.get("shape")
    want = f"{DATATYPES[expected.dtype]} {[-1 if isinstance(d, str) else d for d in expected.shape]}"
    what = f"input {name!r} (expects {want}, that is {expected})"
    if datatype != DATATYPES[expected.dtype]:
        raise ProtocolError(f"{what}: datatype is {datatype!r}")
    if not isinstance(shape, list) or not all(type(size) is int and size >= 0 for size in shape):
        raise ProtocolError(f"{what}: shape must be a list of non-negative integers, got {shape!r}")
    if len(shape) != len(expected.shape) or any(
            not isinstance(dim, str) and dim != size for dim, size in zip(expected.shape, shape, strict=True)):
        raise ProtocolError(f"{what}: shape is {shape}")
    count = math.prod(shape)
    dtype = numpy_dtype(expected.dtype).newbyteorder("<")
    parameters = item.get("parameters") or {}
    size = parameters.get("binary_data_size") if isinstance(parameters, dict) else None
    if size is not None:
        if type(size) is not int or size != count * dtype.itemsize:
            raise ProtocolError(f"{what}: binary_data_size is {size!r}, {count * dtype.itemsize} bytes expected "
                                f"for shape {shape}")
        if offset + size > len(body):
            raise ProtocolError(f"{what}: binary_data_size is {size}, but only {len(body) - offset} bytes are left")
        array = np.frombuffer(body, dtype, count, offset).reshape(shape)
        return array.astype(expected.dtype, copy=False), offset + size
    if "data" not in item:
        raise ProtocolError(f'{what}: no "data" and no parameters.binary_data_size')
    try:
        array = np.array(item["data"])
    except (ValueError, TypeError, RecursionError):
        raise ProtocolError(f"{what}: data is not a (nested) list of numbers") from None
    if array.size and array.dtype.kind not in JSON_KINDS[dtype.kind]:
        raise ProtocolError(f"{what}: data holds {_kind(array)}, not {expected.dtype} values")
    if array.size != count:
        raise ProtocolError(f"{what}: data has {array.size} values, shape {shape} needs {count}")
    if array.size and dtype.kind in "iu":  # no silent wrap-around of an out-of-range integer
        limits = np.iinfo(dtype)
        if array.min() < limits.min or array.max() > limits.max:
            raise ProtocolError(f"{what}: data holds integers outside {expected.dtype}'s range")
    return array.astype(expected.dtype).reshape(shape), offset


def _kind(array: np.ndarray) -> str:
    return {"f": "floats", "i": "integers", "u": "integers", "b": "booleans", "U": "strings"}.get(
        array.dtype.kind, "values of mixed or unknown types")


def _wanted_outputs(request: dict[str, Any], signature: Signature) -> tuple[tuple[int, ...], frozenset[int]]:
    """Which outputs the request wants (all by default) and which of them as binary data."""
    names = output_names(signature)
    parameters = request.get("parameters") or {}
    all_binary = isinstance(parameters, dict) and parameters.get("binary_data_output") is True
    wanted = request.get("outputs")
    if wanted is None:
        positions = tuple(range(len(names)))
        return positions, frozenset(positions if all_binary else ())
    if not isinstance(wanted, list):
        raise ProtocolError('"outputs" must be a list of {"name": ...} objects')
    positions, binary = [], set()
    for item in wanted:
        name = item.get("name") if isinstance(item, dict) else None
        if name not in names:
            raise ProtocolError(f"no output named {name!r} (outputs: {', '.join(names)})")
        position = names.index(name)
        positions.append(position)
        options = item.get("parameters") or {}
        if all_binary or (isinstance(options, dict) and options.get("binary_data") is True):
            binary.add(position)
    return tuple(positions), frozenset(binary)


def run_batched(call: Callable[..., Any], requests: Sequence[Sequence[np.ndarray]],
                symbol: str | None) -> list[tuple[np.ndarray, ...] | BaseException]:
    """Each request's outputs (a tuple), or the error it alone met. Requests agreeing on every
    extent but the leading `symbol` run as one call on their concatenation, split afterwards;
    if that call fails, each runs alone, so that only a failing request fails."""
    results: list[tuple[np.ndarray, ...] | BaseException | None] = [None] * len(requests)
    groups: dict[tuple, list[int]] = {}
    for index, arrays in enumerate(requests):
        key = tuple(array.shape[1:] for array in arrays) if symbol is not None else (index,)
        groups.setdefault(key, []).append(index)
    for members in groups.values():
        if len(members) > 1:
            try:
                parts = _split(_outputs(call(*(np.concatenate(column) for column in zip(
                    *(requests[i] for i in members), strict=True)))), [len(requests[i][0]) for i in members])
            except HexirRuntimeError:
                parts = None  # run each alone below: the error is one request's
            if parts is not None:
                for index, outputs in zip(members, parts, strict=True):
                    results[index] = outputs
                continue
        for index in members:
            try:
                results[index] = _outputs(call(*requests[index]))
            except HexirRuntimeError as error:
                results[index] = error
    return results  # type: ignore[return-value]


def _outputs(result: Any) -> tuple[np.ndarray, ...]:
    return () if result is None else result if isinstance(result, tuple) else (result,)


def _split(outputs: tuple[np.ndarray, ...], rows: list[int]) -> list[tuple[np.ndarray, ...]] | None:
    """The batch's outputs cut into each request's rows; None if an output is not `sum(rows)` long."""
    if any(len(output) != sum(rows) for output in outputs):
        return None
    bounds = np.cumsum(rows)[:-1]
    return list(zip(*(np.split(output, bounds) for output in outputs), strict=True)) if outputs else [()] * len(rows)


def encode_response(model: str, signature: Signature, request: Request,
                    outputs: Sequence[np.ndarray]) -> tuple[bytes, dict[str, str]]:
    """The response body for `request` and its headers (binary: the JSON header's length)."""
    names, blobs = output_names(signature), []
    tensors = [_tensor(names[position], outputs[position], position in request.binary, blobs)
               for position in request.outputs]
    response: dict[str, Any] = {"model_name": model, "model_version": "1", "outputs": tensors}
    if request.id is not None:
        response["id"] = request.id
    return _message(response, blobs)


def encode_request(inputs: Mapping[str, np.ndarray], *, binary: bool = True, binary_outputs: bool | None = None,
                   identifier: str | None = None) -> tuple[bytes, dict[str, str]]:
    """A client's request body for `inputs` and its headers; outputs come back binary when
    `binary_outputs` (default: as `binary`)."""
    blobs: list[bytes] = []
    tensors = [_tensor(name, np.asarray(array), binary, blobs) for name, array in inputs.items()]
    request: dict[str, Any] = {"inputs": tensors}
    if identifier is not None:
        request["id"] = identifier
    if binary if binary_outputs is None else binary_outputs:
        request["parameters"] = {"binary_data_output": True}
    return _message(request, blobs)


def _tensor(name: str, array: np.ndarray, binary: bool, blobs: list[bytes]) -> dict[str, Any]:
    """The protocol's tensor for `array`: its data in JSON, or (`binary`) its bytes appended to `blobs`."""
    if array.dtype.name not in DATATYPES:
        raise ProtocolError(f"{name}: the protocol has no datatype for {array.dtype}", 500)
    tensor: dict[str, Any] = {"name": name, "datatype": DATATYPES[array.dtype.name], "shape": list(array.shape)}
    if not binary:
        tensor["data"] = array.ravel().tolist()
        return tensor
    blobs.append(np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes())
    tensor["parameters"] = {"binary_data_size": len(blobs[-1])}
    return tensor


def _message(header: dict[str, Any], blobs: list[bytes]) -> tuple[bytes, dict[str, str]]:
    text = json.dumps(header, separators=(",", ":")).encode()
    if not blobs:
        return text, {"Content-Type": "application/json"}
    return b"".join([text, *blobs]), {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(text))}


def decode_response(body: bytes, header_length: int | None = None) -> dict[str, np.ndarray]:
    """A response's outputs by name (the client's side); ProtocolError for an error response or a
    malformed one."""
    end = len(body) if header_length is None else header_length
    try:
        response = json.loads(bytes(body[:end]))
    except ValueError as error:
        raise ProtocolError(f"the response is not JSON ({error})", 502) from None
    if isinstance(response, dict) and "error" in response:
        raise ProtocolError(str(response["error"]), 502)
    arrays, offset = {}, end
    try:
        for tensor in response["outputs"]:
            dtype = numpy_dtype(NUMPY_DTYPES[tensor["datatype"]]).newbyteorder("<")
            size = (tensor.get("parameters") or {}).get("binary_data_size")
            if size is None:
                arrays[tensor["name"]] = np.array(tensor["data"], dtype.name).reshape(tensor["shape"])
                continue
            count = size // dtype.itemsize
            arrays[tensor["name"]] = np.frombuffer(body, dtype, count, offset).reshape(tensor["shape"])
            offset += size
    except (KeyError, TypeError, ValueError) as error:
        raise ProtocolError(f"a malformed response ({type(error).__name__}: {error})", 502) from None
    return arrays
