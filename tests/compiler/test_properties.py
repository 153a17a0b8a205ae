"""Property: linear (+ bias) + relu compiles to an .hxb for any shape up to 40 (1 and odd sizes
included), the manifest's kernels, buffers and signature match those shapes, and the module
computes what numpy does on the cpu (its rows split over threads), whether the relu is fused into
the linear (it is the linear's only user) or stays a kernel of its own (the linear's result is
printed too)."""

from __future__ import annotations

from unittest import mock

import hexir_runtime
import numpy as np
import pytest
from hexir_runtime import DeviceError
from hexir_runtime.cpu import CpuDevice
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import hexir
from hexir.driver import Options, compile_module
from hexir.schedules import cpu as cpu_schedule
from hexir.schedules import cpu_families
from hexir.target import parse_target

from .conftest import cpu_linear_tiles, manifest

dims = st.integers(min_value=1, max_value=40)


@settings(max_examples=12, deadline=None)
@given(m=dims, k=dims, n=dims, bias=st.booleans(), dtype=st.sampled_from(["float32", "float64"]),
       fused=st.booleans())
@example(m=1, k=1, n=1, bias=True, dtype="float32", fused=True)
@example(m=1, k=1, n=1, bias=True, dtype="float32", fused=False)
@example(m=37, k=13, n=1, bias=False, dtype="float64", fused=True)
@example(m=37, k=13, n=1, bias=False, dtype="float64", fused=False)
def test_linear_relu_compiles_for_any_shape(m, k, n, bias, dtype, fused):
    rng = np.random.default_rng(m * 10_000 + k * 100 + n)
    w = rng.standard_normal((k, n)).astype(dtype)
    b = rng.standard_normal(n).astype(dtype) if bias else None

    @hexir.jit
    def layer(x):
        y = hexir.linear(x, w, b)
        if not fused:
            hexir.print(y)  # a second user of the linear's result: the relu stays a kernel of its own
        return hexir.relu(y)

    # one cpu library, the one this machine runs: a third of the compile
    data = compile_module(layer.trace(hexir.TensorSpec((m, k), dtype)), Options(target=parse_target("cpu:host")))
    found = manifest(data)

    kernels = found["kernels"]
    linear = kernels[0]
    # w, a constant wider than a panel, comes in panels (a column tile wide for a 1-row product)
    lanes = (cpu_schedule.NC_BYTES if m == 1 else cpu_schedule.PANEL_BYTES) // np.dtype(dtype).itemsize
    panels = [-(-n // lanes), k, lanes] if n > lanes else [k, n]
    expected_linear = [[m, k], panels] + ([[n]] if bias else []) + [[m, n]]
    assert linear["op"] == ("linear_panels" if n > lanes else "linear")
    sums = ["add", ["arg", 0], ["arg", 1]] if bias else ["arg", 0]  # what the linear stores: sums (+ bias)
    assert linear["expr"] == (["max", sums, ["const", 0.0]] if fused else sums)  # (relu'd)
    assert [a["shape"] for a in linear["args"]] == expected_linear
    # linear runs in tiles of its output (24 rows up to 40 and 512 bytes of columns), relu by rows
    streamed = {"spans": True} if m <= 16 and n <= lanes else {}  # a thread's chunk is the span it streams
    assert linear["work"] == {"extent": cpu_linear_tiles(m, n, dtype, n > lanes), "grain": 1, **streamed}
    assert len(kernels) == (1 if fused else 2)
    if not fused:
        relu = kernels[1]
        assert (relu["op"], relu["expr"]) == ("pointwise", ["max", ["arg", 0], ["const", 0.0]])
        assert [a["shape"] for a in relu["args"]] == [[m, n], [m, n]]
        assert relu["work"] == {"extent": m, "grain": -(-cpu_families.CHUNK_ELEMENTS // n)}  # rows: a chunk's worth
    for kernel in kernels:
        assert kernel["device"] == "cpu"
        assert {a["dtype"] for a in kernel["args"]} == {dtype}
        assert [a["access"] for a in kernel["args"]][-1] == "write"
    entry = found["entries"][0]
    assert entry["inputs"] == [{"name": "x", "shape": [m, k], "dtype": dtype}]
    assert entry["outputs"] == [{"shape": [m, n], "dtype": dtype}]
    assert [c["shape"] for c in found["constants"]] == [panels] + ([[n]] if bias else [])
    calls = [c for c in entry["program"] if c["op"] == "call"]
    assert [c["kernel"] for c in calls] == list(range(len(kernels)))
    assert [entry["buffers"][call["args"][-1]]["shape"] for call in calls] == [[m, n]] * len(kernels)
    # and it computes what numpy does, split over three threads (every row block once)
    x = rng.standard_normal((m, k)).astype(dtype)
    expected = np.maximum(x.astype(np.float64) @ w + (0 if b is None else b), 0)
    tolerance = {"float32": 1e-5, "float64": 1e-12}[dtype]
    actual = hexir_runtime.load(data, device=CpuDevice(threads=3, split_bytes=0)).main(x)
    assert actual.dtype == np.dtype(dtype) and actual.shape == (m, n)
    np.testing.assert_allclose(actual, expected, rtol=tolerance, atol=tolerance * np.sqrt(k))


def _edges(*sizes: int) -> list[int]:
    return sorted({size + d for size in sizes for d in (-1, 0, 1) if size + d >= 1})


# Every size where a cpu linear's loops change shape: its micro-kernel's rows (MR 4 or 6) and
# columns (NR 4 to 32), the streamed products' rows (few, a group of 12 or 16, the row limit), k
# blocks and sub-block of columns, the tiles' rows (24, 48, 96) and k block (256), a tile's columns (512
# bytes: 64 or 128), and primes in between.
KS, FEW_KS = cpu_schedule.STREAM_KS, cpu_schedule.STREAM_FEW_KS
M_EDGES = _edges(1, 4, 6, cpu_schedule.STREAM_FEW, 12, cpu_schedule.STREAM_ROWS, 24, 48, 96) + [29, 53]
K_EDGES = _edges(1, FEW_KS, 2 * FEW_KS, KS, 2 * KS, cpu_schedule.KC) + [37, 131]
N_EDGES = _edges(1, 4, 8, 16, 32, 64, 128, cpu_schedule.STREAM_COLUMNS, 512) + [61, 389]


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(m=st.sampled_from(M_EDGES), k=st.sampled_from(K_EDGES), n=st.sampled_from(N_EDGES),
       dtype=st.sampled_from(["float32", "float64"]), bias=st.booleans(), threads=st.integers(1, 5),
       constant=st.booleans(), level=st.sampled_from(["host", "x86-64-v3", "x86-64"]), symbolic=st.booleans())
# one row: chunks of several tiles; the most streamed rows, KS + 1; the most rows of the smaller
# KS, + 1; the fewest tiled rows; the narrow panel with the last full one, packed per tile,
# unpacked (AVX-512 hosts) and in panels; panels read by narrower NR (AVX2, SSE); one row's
# tile-wide panels (a narrow last one, f64; read by SSE); the most rows that take tiles in panels
@example(m=1, k=257, n=513, dtype="float32", bias=True, threads=3, constant=True, level="host", symbolic=False)
@example(m=1, k=131, n=97, dtype="float64", bias=False, threads=2, constant=True, level="host", symbolic=False)
@example(m=1, k=37, n=389, dtype="float32", bias=True, threads=4, constant=True, level="x86-64", symbolic=False)
@example(m=16, k=257, n=61, dtype="float32", bias=True, threads=3, constant=True, level="host", symbolic=False)
@example(m=16, k=17, n=257, dtype="float64", bias=False, threads=2, constant=False, level="host", symbolic=False)
@example(m=4, k=9, n=129, dtype="float32", bias=True, threads=3, constant=True, level="host", symbolic=False)
@example(m=17, k=255, n=129, dtype="float64", bias=True, threads=4, constant=False, level="host", symbolic=False)
@example(m=769, k=257, n=33, dtype="float32", bias=True, threads=3, constant=False, level="host", symbolic=False)
@example(m=53, k=131, n=17, dtype="float64", bias=False, threads=2, constant=False, level="host", symbolic=False)
@example(m=769, k=257, n=33, dtype="float32", bias=True, threads=3, constant=True, level="host", symbolic=False)
@example(m=29, k=37, n=61, dtype="float64", bias=True, threads=2, constant=True, level="x86-64-v3", symbolic=False)
@example(m=97, k=131, n=47, dtype="float32", bias=False, threads=3, constant=True, level="x86-64", symbolic=False)
# w an argument: packed by its own kernel (a narrow last panel, f32 and f64; read by SSE), or per
# tile (a symbolic batch: the first tile packs, the last has too few rows)
@example(m=100, k=300, n=70, dtype="float64", bias=True, threads=3, constant=False, level="host", symbolic=False)
@example(m=53, k=513, n=389, dtype="float64", bias=False, threads=2, constant=False, level="x86-64", symbolic=False)
@example(m=29, k=257, n=389, dtype="float64", bias=True, threads=2, constant=False, level="host", symbolic=True)
def test_cpu_linear_at_every_tile_edge_matches_numpy(m, k, n, dtype, bias, threads, constant, level, symbolic):
    """The cpu linear (streamed or tiled; w a constant, in panels, or an argument, packed by a
    kernel of its own, per tile (a symbolic batch) or read as it is) on shapes at and around
    every tile size, each launch split in chunks over `threads` threads, built for this host's
    level or a lower one (whose NR is narrower than a panel), against numpy."""
    _check_cpu_linear(m, k, n, dtype, bias, threads, constant, level, symbolic)


@pytest.mark.parametrize(("m", "k", "n", "dtype", "constant", "symbolic", "level"), [
    (100, 300, 70, "float64", False, False, "host"),  # w packed by its kernel; K's last block 44 wide
    (53, 513, 389, "float32", False, False, "x86-64"),  # a narrow last panel, SSE's NR
    (29, 257, 389, "float64", False, True, "host"),  # a symbolic batch: w per tile, the last tile short
    (97, 131, 47, "float32", True, False, "x86-64-v3"),  # w a constant in panels; K within one block
    (769, 257, 33, "float32", False, False, "host"),  # tiles of 192 rows (w per tile) and a narrow panel
    (17, 37, 61, "float64", False, False, "host"),  # the fewest tiled rows, K less than a block
    (300, 1030, 130, "float64", False, True, "host"),  # a symbolic batch over several tiles and k blocks
])
def test_cpu_linear_with_x_copied_per_tile_matches_numpy(m, k, n, dtype, constant, symbolic, level):
    """`PACK_X`: each tile copies its rows of x, a k block at a time, into a buffer of its own and
    its micro-kernels read them there (the rows left over after the MR groups too)."""
    with mock.patch.dict(cpu_schedule.PACK_X, {dtype: True}):
        _check_cpu_linear(m, k, n, dtype, True, 3, constant, level, symbolic)


def _check_cpu_linear(m, k, n, dtype, bias, threads, constant, level, symbolic):
    rng = np.random.default_rng(m * 1_000_000 + k * 1000 + n)
    w = rng.standard_normal((k, n)).astype(dtype)
    b = rng.standard_normal(n).astype(dtype) if bias else None
    options = Options(target=parse_target(f"cpu:{level}"))
    spec = hexir.TensorSpec(("batch" if symbolic else m, k), dtype)
    if constant:
        traced = hexir.jit(lambda x: hexir.relu(hexir.linear(x, w, b))).trace(spec)
    else:
        traced = hexir.jit(lambda x, w: hexir.relu(hexir.linear(x, w, b))).trace(spec, hexir.TensorSpec((k, n), dtype))
    with mock.patch.dict(cpu_schedule.PACK_ROWS, {dtype: 17}):  # the packing kernel from 17 rows, as tuned from 1024
        data = compile_module(traced, options)
    lanes = (cpu_schedule.NC_BYTES if m == 1 and not symbolic else cpu_schedule.PANEL_BYTES) // np.dtype(dtype).itemsize
    packed = n > lanes and (constant or not symbolic and m > cpu_schedule.STREAM_ROWS)  # (at run time: a tall one)
    ops = ["linear_panels"] if constant and packed else ["pack_panels", "linear_panels"] if packed else ["linear"]
    assert [kernel["op"] for kernel in manifest(data)["kernels"]] == ops
    x = rng.standard_normal((m, k)).astype(dtype)
    expected = np.maximum(x.astype(np.float64) @ w + (0 if b is None else b), 0)
    try:
        module = hexir_runtime.load(data, device=CpuDevice(threads=threads, split_bytes=0))
    except DeviceError:  # a level this machine cannot run (x86-64-v3 on an older one)
        assume(False)
    actual = module.main(x) if constant else module.main(x, w)
    tolerance = {"float32": 1e-5, "float64": 1e-12}[dtype]
    np.testing.assert_allclose(actual, expected, rtol=tolerance, atol=tolerance * np.sqrt(k))
