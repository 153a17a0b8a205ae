"""End to end: trace -> compile -> .hxb -> run with hexir_runtime, compared with numpy.

Both ways in: calling the @hexir.jit function, and exporting an .hxb that
`hexir_runtime.load(path).main(x)` runs. The numpy `reference` device of the runtime is the
second oracle; a multi-threaded cpu device checks the kernels' [first, last) work ranges."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import hexir_runtime
import numpy as np
import pytest
from hexir_runtime import cpu as cpu_runtime
from hexir_runtime.cpu import CpuDevice
from hexir_runtime.executor import IN_PLACE_BYTES
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import hexir
from hexir.driver import run_stage

from .conftest import cuda_linear_launch

TOLERANCE = {"float32": {"rtol": 2e-5, "atol": 1e-5}, "float64": {"rtol": 1e-12, "atol": 1e-12}}


def two_layers(dtype: str, k: int = 8, hidden: int = 16, n: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((k, hidden)).astype(dtype)
    b1 = rng.standard_normal(hidden).astype(dtype)
    w2 = rng.standard_normal((hidden, n)).astype(dtype)

    @hexir.jit
    def mlp(x):
        h = hexir.relu(hexir.linear(x, w1, b1))
        return hexir.linear(h, w2)

    def expected(x):
        return np.maximum(x @ w1 + b1, 0) @ w2

    return mlp, expected


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_jit_call_matches_numpy(dtype):
    mlp, expected = two_layers(dtype)
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(dtype)
    y = mlp(x)
    assert y.dtype == np.dtype(dtype) and y.shape == (3, 4)
    np.testing.assert_allclose(y, expected(x), **TOLERANCE[dtype])
    np.testing.assert_allclose(mlp(-x), expected(-x), **TOLERANCE[dtype])
    assert mlp.trace_count == 1


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_exported_module_matches_numpy(dtype, tmp_path):
    mlp, expected = two_layers(dtype, seed=2)
    x = np.random.default_rng(3).standard_normal((5, 8)).astype(dtype)
    path = hexir.export(mlp, tmp_path / "mlp.hxb", hexir.TensorSpec((5, 8), dtype))
    module = hexir_runtime.load(path)
    np.testing.assert_allclose(module.main(x), expected(x), **TOLERANCE[dtype])
    reference = hexir_runtime.load(path, device="reference")
    np.testing.assert_allclose(module.main(x), reference.main(x), **TOLERANCE[dtype])


def test_threads_split_the_rows_correctly(tmp_path):
    mlp, expected = two_layers("float64", k=5, hidden=130, n=3, seed=4)
    x = np.random.default_rng(5).standard_normal((101, 5))
    path = hexir.export(mlp, tmp_path / "mlp.hxb", x)
    # 101 rows x 130 float64 columns: 9 x 3 tiles of 12 rows and 64 columns, the last ones short;
    # the second layer's 3 columns: 9 tiles of 12 rows
    assert [k["work"]["extent"] for k in hexir_runtime.load(path, "reference").hxb.json["kernels"]] == [9 * 3, 9]
    # split_bytes=0: split every launch, however small (by default only launches of 1 MiB or more
    # are, and these are a few KiB), here unevenly over 4 threads
    module = hexir_runtime.load(path, device=CpuDevice(threads=4, split_bytes=0))
    np.testing.assert_allclose(module.main(x), expected(x), **TOLERANCE["float64"])


def test_the_native_pool_splits_launches_and_serves_callers_on_many_threads(tmp_path, monkeypatch):
    """A compiled library brings a thread pool (hexir/backend/pool.c): a split launch runs its
    chunks there, with the result of one thread; callers on 8 threads at once (one holds the pool,
    the others run their launch in one piece) all get theirs. (Python's pool, which tests run
    before this one may have started, is set aside: this test's launches must not start it.)"""
    monkeypatch.setattr(cpu_runtime, "_pool", None)
    mlp, expected = two_layers("float64", k=64, hidden=300, n=40, seed=6)
    x = np.random.default_rng(7).standard_normal((200, 64))
    path = hexir.export(mlp, tmp_path / "mlp.hxb", x)
    whole = hexir_runtime.load(path, device=CpuDevice(threads=1)).main(x)
    modules = [hexir_runtime.load(path, device=CpuDevice(threads=threads, split_bytes=0)) for threads in range(2, 10)]
    np.testing.assert_array_equal(modules[0].main(x), whole)
    assert cpu_runtime._native is not None and cpu_runtime._pool is None  # the native pool, not Python's
    workers = [t for t in threading.enumerate() if t.name.startswith("hexir-cpu-")]
    assert len(workers) == len(os.sched_getaffinity(0)) - 1  # a worker per core but the caller's
    with ThreadPoolExecutor(8) as callers:
        for results in callers.map(lambda module: [module.main(x) for _ in range(30)], modules):
            for result in results:
                np.testing.assert_array_equal(result, whole)
    np.testing.assert_allclose(whole, expected(x), **TOLERANCE["float64"])


def test_a_forked_child_runs_split_launches_without_the_parents_workers(tmp_path):
    """The child has none of the parent's threads: a plan made before the fork runs its chunks on
    the calling thread, a module loaded after it on Python's pool; both give the answer."""
    mlp, expected = two_layers("float64", k=32, hidden=200, n=20, seed=8)
    x = np.random.default_rng(9).standard_normal((150, 32))
    path = hexir.export(mlp, tmp_path / "mlp.hxb", x)
    before = hexir_runtime.load(path, device=CpuDevice(threads=4, split_bytes=0))
    whole = before.main(x)  # planned, on the native pool
    assert cpu_runtime._native
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through its exit status
        try:
            after = hexir_runtime.load(path, device=CpuDevice(threads=4, split_bytes=0))
            same = np.array_equal(before.main(x), whole) and np.array_equal(after.main(x), whole)
            os._exit(0 if same and cpu_runtime._native is False else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    np.testing.assert_allclose(whole, expected(x), **TOLERANCE["float64"])


def test_a_host_program_runs_its_kernels_in_one_foreign_call(tmp_path):
    """A call shape whose kernels are all host kernels runs them in one call of pool.c's
    hexir_pool_sequence (split launches on the pool): a small input copied into its buffer, a big
    contiguous one read where it is (its buffer never written), a strided one copied; while
    another thread holds the pool, the call runs its Python steps instead. Each gives the answer."""
    mlp, expected = two_layers("float64", k=64, hidden=300, n=40, seed=10)
    path = hexir.export(mlp, tmp_path / "mlp.hxb", hexir.TensorSpec(("batch", 64), "float64"))
    module = hexir_runtime.load(path, device=CpuDevice(threads=4, split_bytes=0))
    executor = module._executors["main"]
    buffer = next(command.dst for command in executor.entry.program if command.op == "input")
    rng = np.random.default_rng(11)
    for rows in (1, 3, 150):  # 512 bytes a row: from 32 rows on, read in place
        x = rng.standard_normal((rows, 64))
        whole = hexir_runtime.load(path, device=CpuDevice(threads=1)).main(x)
        plan = executor.plans.get((((rows, 64),), False)) or executor._plan((((rows, 64),), False))
        assert plan.fast is not None
        executor.allocations[buffer][0][:] = np.nan  # (only the call shape's part of it is read)
        steps, plan.steps = plan.steps, []  # the batch alone computes the answer
        np.testing.assert_array_equal(module.main(x), whole)
        plan.steps = steps
        assert np.isnan(executor.allocations[buffer][0]).all() == (x.nbytes >= IN_PLACE_BYTES)
        np.testing.assert_array_equal(module.main(np.asfortranarray(x)), whole)
        out = np.empty((rows, 40))
        assert module.main(x, out=out) is out
        np.testing.assert_array_equal(out, whole)
        with cpu_runtime._native.busy:  # another thread's launch: the steps run, in one piece each
            np.testing.assert_array_equal(module.main(x), whole)
        np.testing.assert_allclose(whole, expected(x), **TOLERANCE["float64"])


def test_a_result_the_caller_holds_is_not_overwritten_by_the_next_call():
    """The batched path's outputs are the caller's own arrays, not views of the module's
    buffers: the next call, which rewrites those buffers, leaves a held result as it was."""
    mlp, expected = two_layers("float32", seed=12)
    module = hexir_runtime.load(mlp.compile(hexir.TensorSpec((3, 8), "float32")), "cpu")
    rng = np.random.default_rng(13)
    xs = [rng.standard_normal((3, 8)).astype(np.float32) for _ in range(3)]
    held = [module.main(x) for x in xs]
    assert [plan.fast is not None for plan in module._executors["main"].plans.values()] == [True]
    for x, y in zip(xs, held, strict=True):
        np.testing.assert_allclose(y, expected(x), **TOLERANCE["float32"])
    assert not np.shares_memory(held[0], held[1])
    jitted = [mlp(x) for x in xs]  # the jit call path, too
    for x, y in zip(xs, jitted, strict=True):
        np.testing.assert_allclose(y, expected(x), **TOLERANCE["float32"])


def test_launches_of_one_chunk_are_batched_without_starting_the_pool(tmp_path):
    """Unsplit launches run in one call of the module's own library: loading and calling it (in a
    fresh process) starts no worker thread; a split launch then starts the pool."""
    mlp, expected = two_layers("float32")
    path = hexir.export(mlp, tmp_path / "mlp.hxb", hexir.TensorSpec((3, 8), "float32"))
    big = hexir.export(two_layers("float64", k=64, hidden=300, n=40)[0], tmp_path / "big.hxb",
                       hexir.TensorSpec((200, 64), "float64"))
    script = tmp_path / "call.py"
    script.write_text(f"""
import json, threading, numpy as np, hexir_runtime
from hexir_runtime.cpu import CpuDevice
module, x = hexir_runtime.load({str(path)!r}, "cpu"), np.arange(24, dtype=np.float32).reshape(3, 8)
y, plan = module.main(x), module._executors["main"].plans[(((3, 8),), False)]
alone = threading.active_count()
hexir_runtime.load({str(big)!r}, CpuDevice(threads=2, split_bytes=0)).main(np.ones((200, 64)))
print(json.dumps([alone, plan.fast is not None, threading.active_count() > 1, y.tolist()]))
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True, timeout=300)
    alone, batched, pooled, y = json.loads(done.stdout)
    assert (alone, batched, pooled) == (1, True, True)
    np.testing.assert_allclose(y, expected(np.arange(24, dtype=np.float32).reshape(3, 8)), **TOLERANCE["float32"])


def test_a_program_that_prints_is_not_batched(capfd):
    w = np.eye(2, dtype=np.float32)

    @hexir.jit
    def f(x):
        hexir.print(x)
        return hexir.linear(x, w)

    module = hexir_runtime.load(f.compile(np.ones((1, 2), np.float32)))
    assert [plan.fast for plan in module._executors["main"].plans.values()] == [None]
    np.testing.assert_array_equal(module.main(np.ones((1, 2), np.float32)), np.ones((1, 2)))
    assert capfd.readouterr().out == "1.000000 1.000000 \n"


def test_print_uses_the_c_format(capfd):
    w = np.array([[1.0, -2.0], [0.5, 0.25]], dtype=np.float32)

    @hexir.jit
    def f(x):
        y = hexir.relu(hexir.linear(x, w))
        hexir.print(y)
        return y

    f(np.array([[1.0, 2.0], [-3.0, 4.0]], dtype=np.float32))
    assert capfd.readouterr().out == "2.000000 0.000000 \n0.000000 7.000000 \n"


finite = {"float32": st.floats(-100, 100, width=32), "float64": st.floats(-1e6, 1e6)}
SPLIT_BYTES = 1 << 20  # the cpu device splits a launch across threads from this many argument bytes on


@st.composite
def problems(draw):
    """x, w, b: small ones with values hypothesis picks (edge values included), or, one draw in
    four, large ones (up to 300 per axis, random values) whose launch reaches the thread split."""
    dtype = draw(st.sampled_from(["float32", "float64"]))
    if draw(st.integers(0, 3)) == 0:
        m, k, n = (draw(st.integers(150, 300)) for _ in range(3))
        rng = np.random.default_rng(draw(st.integers(0, 2**16)))
        x, w = (rng.uniform(-100, 100, shape).astype(dtype) for shape in ((m, k), (k, n)))
        b = rng.uniform(-100, 100, n).astype(dtype) if draw(st.booleans()) else None
        return x, w, b
    m, k, n = (draw(st.integers(1, 24)) for _ in range(3))
    x = draw(hnp.arrays(dtype, (m, k), elements=finite[dtype]))
    w = draw(hnp.arrays(dtype, (k, n), elements=finite[dtype]))
    b = draw(st.none() | hnp.arrays(dtype, (n,), elements=finite[dtype]))
    return x, w, b


def _big(dtype: str, m: int, k: int, n: int, bias: bool):
    rng = np.random.default_rng(m + k + n)
    x, w, b = rng.standard_normal((m, k)), rng.standard_normal((k, n)), rng.standard_normal(n) if bias else None
    return x.astype(dtype), w.astype(dtype), None if b is None else b.astype(dtype)


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(problems())
@example(_big("float32", 300, 300, 300, bias=True))   # 1.08 MB of arguments: split across threads
@example(_big("float64", 210, 210, 210, bias=False))  # 1.06 MB
@example(_big("float32", 1, 1, 1, bias=True))
def test_linear_relu_matches_numpy_for_any_shape_and_values(problem):
    x, w, b = problem

    @hexir.jit(target="cpu:host")  # one cpu library, the one this machine runs: a third of the compile
    def layer(x):
        return hexir.relu(hexir.linear(x, w, b))

    expected = np.maximum(x.astype(np.float64) @ w.astype(np.float64) + (0 if b is None else b), 0)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64) + (0 if b is None else np.abs(b)) + 1
    epsilon = np.finfo(x.dtype).eps
    (m, k), n = x.shape, w.shape[1]
    split = (x.nbytes + w.nbytes + (0 if b is None else b.nbytes) + m * n * x.itemsize) >= SPLIT_BYTES
    results = [layer(x)]  # the jit's own device: the machine's threads, the default split
    if split:  # and split over 3 threads, unevenly (a cpu linear's work items are its row blocks)
        data = layer.compile(x)
        results.append(hexir_runtime.load(data, device=CpuDevice(threads=3)).main(x))
    for result in results:
        assert result.dtype == x.dtype and result.shape == (m, n)
        error = np.abs(result.astype(np.float64) - expected)
        assert (error <= 4 * k * epsilon * scale).all()


def _launch(text: str, kernel: str) -> tuple[list[int], list[int]]:
    """grid and block of the `hextir.launch` record of the cuda kernel whose name starts with `kernel`."""
    found = re.search(rf'func\.func public @{kernel}_[0-9]+\(.*hextir\.launch = '
                      r'\{block = array<i64: (\d+), (\d+), (\d+)>, '
                      r'grid = \["(\d+)", "(\d+)", "(\d+)"\]', text)
    assert found, text[:2000]
    numbers = [int(v) for v in found.groups()]
    return numbers[3:], numbers[:3]


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(m=st.sampled_from([1, 127, 128, 129, 1920, 2047, 2048, 2049, 4095]) | st.integers(1, 4096),
       n=st.sampled_from([1, 127, 128, 129, 1920, 2047, 2048, 2049, 4095]) | st.integers(1, 4096),
       k=st.integers(1, 40) | st.sampled_from([255, 256, 784, 3001]), rank=st.integers(1, 3))
@example(m=64, n=512, k=784, rank=1)    # 32x32 tiles, K split 7 ways (the MLP's first layer)
@example(m=64, n=10, k=512, rank=1)     # 16x16 tiles, K split 8 ways
@example(m=4096, n=33, k=1024, rank=1)  # 64x64 tiles, K split 4 ways
@example(m=2048, n=2048, k=3, rank=2)  # 16 x 16 = 256 large tiles: the large tiling, just
@example(m=2048, n=1920, k=3, rank=2)  # 240: the 64x64 tiling
@example(m=960, n=1000, k=3, rank=2)   # 15 x 16 = 240 of 64x64: the 32x32 tiling
@example(m=8, n=1000, k=3, rank=2)     # the row-streaming kernel
@example(m=9, n=1000, k=3, rank=1)
def test_cuda_launches_cover_any_output_at_compile_level(m, n, k, rank):
    """The launch records of a cuda linear and relu, from the shapes alone (the linear's rule is
    `cuda_linear_launch`: the kernel and tiling its shape gets, e.g. 128x128 tiles only where they
    still make 256 blocks); a relu's elements in blocks of 256 threads (over all its axes), a
    thread per element, or per 4 (16 bytes) where its rows are a multiple of 4 float32s."""
    relu_shape = (m, n) if rank == 2 else (m * n,) if rank == 1 else (m, 1, n)
    linear = hexir.jit(lambda x, w: hexir.linear(x, w), placement="hexir.linear=cuda")
    relu = hexir.jit(lambda x: hexir.relu(x), placement="hexir.relu=cuda")
    specs = hexir.TensorSpec((m, k), "float32"), hexir.TensorSpec((k, n), "float32")
    grid, block = _launch(str(run_stage(linear.trace(*specs), "mlir-tir", linear.options)), "linear")
    expected = cuda_linear_launch(m, n, k=k)
    assert (grid, block) == (expected["grid"], expected["block"])
    grid, block = _launch(str(run_stage(relu.trace(hexir.TensorSpec(relu_shape, "float32")), "mlir-tir",
                                        relu.options)), "relu")
    lanes = 4 if relu_shape[-1] % 4 == 0 else 1
    assert (grid, block) == ([math.ceil(m * n / lanes / 256), 1, 1], [256, 1, 1])
