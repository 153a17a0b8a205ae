"""Serving hexir modules over the Open Inference Protocol (KServe v2).

`protocol` is engine-neutral (numpy only): metadata, request checks, batching, JSON and binary
encodings. `hexir_runtime.serving.ray` runs it on Ray Serve (the `serve` extra); importing this
package does not import Ray. `hexir-run serve MODEL.hxb` is the command (serving/command.py).
"""

from .protocol import (
    ProtocolError,
    Request,
    batch_symbol,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
    metadata,
    run_batched,
)

__all__ = [
    "ProtocolError",
    "Request",
    "batch_symbol",
    "decode_request",
    "decode_response",
    "encode_request",
    "encode_response",
    "metadata",
    "run_batched",
]
