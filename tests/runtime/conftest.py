"""Shared pieces of the runtime tests: modules assembled with `hexir_runtime.format.encode`, the
way the compiler does, and a C shared object with their kernels, compiled once per session.

Nothing here needs MLIR or the compiler. Fixtures:
- `modules`: the `Builder` class and factories of ready-made modules (see `Modules`);
- `compile_c`: builds C source into the bytes of a .so (skips without `cc`);
- `c_library`: the bytes of a .so holding every kernel of `KERNELS`;
- `mlp_file`: the MLP module with the real library, written to a temporary .hxb file.
"""

from __future__ import annotations

import copy
import json
import math
import platform
import shutil
import subprocess
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hexir_runtime import format as hxb

C_TYPES = {"float32": "float", "float64": "double"}

# The test kernels' names (as version 1 spelled them) for their (op, expr).
RELU = ["max", ["arg", 0], ["const", 0]]
BIAS = ["add", ["arg", 0], ["arg", 1]]
OPS = {"linear": ("linear", ["arg", 0]), "linear_bias": ("linear", BIAS),
       "linear_relu": ("linear", RELU), "linear_bias_relu": ("linear", ["max", BIAS, ["const", 0]]),
       "relu": ("pointwise", RELU)}

# Every kernel the C library implements: (op, argument shapes, dtype). A symbol in a shape (only
# ever the first dimension here) is an int64_t parameter of the kernel, before first and last.
KERNELS = [
    ("linear_bias", [[2, 8], [8, 16], [16], [2, 16]], "float32"),
    ("relu", [[2, 16], [2, 16]], "float32"),
    ("linear", [[2, 16], [16, 4], [2, 4]], "float32"),
    ("linear", [[2, 2], [2, 2], [2, 2]], "float32"),
    ("relu", [[2, 3, 4], [2, 3, 4]], "float32"),
    ("linear_bias", [[300, 96], [96, 64], [64], [300, 64]], "float64"),
    ("relu", [[300, 64], [300, 64]], "float64"),
    ("linear_bias", [["batch", 8], [8, 16], [16], ["batch", 16]], "float32"),
    ("relu", [["batch", 16], ["batch", 16]], "float32"),
    ("linear", [["batch", 16], [16, 4], ["batch", 4]], "float32"),
    ("linear_bias", [["batch", 96], [96, 64], [64], ["batch", 64]], "float64"),
]


def sizes_of(shapes: list[list[Any]]) -> list[str]:
    """The distinct symbols of a kernel's shapes in order: its `sizes`."""
    return list(dict.fromkeys(dim for shape in shapes for dim in shape if isinstance(dim, str)))


def symbol(op: str, shapes: list[list[int]], dtype: str) -> str:
    """The C name of a kernel: op, the shape of each argument, dtype."""
    return "_".join([op, *("x".join(map(str, shape)) for shape in shapes), dtype])


def c_source(op: str, shapes: list[list[int]], dtype: str) -> str:
    """A kernel in the runtime's calling convention: pointers, its sizes, then the [first, last) rows."""
    t = C_TYPES[dtype]
    head = f"void {symbol(op, shapes, dtype)}("
    sizes = "".join(f"int64_t {name}, " for name in sizes_of(shapes))
    if op == "relu":
        inner = math.prod(shapes[0][1:])
        return f"""{head}const {t} *x, {t} *out, {sizes}int64_t first, int64_t last) {{
  for (int64_t i = first * {inner}; i < last * {inner}; ++i) out[i] = x[i] < 0 ? 0 : x[i]; /* NaN stays NaN */
}}
"""
    (_, k), (_, n) = shapes[0], shapes[1]
    bias = op == "linear_bias"
    return f"""{head}const {t} *x, const {t} *w, {"const " + t + " *bias, " if bias else ""}{t} *out,
    {sizes}int64_t first, int64_t last) {{
  for (int64_t i = first; i < last; ++i)
    for (int64_t j = 0; j < {n}; ++j) {{
      {t} sum = 0;
      for (int64_t p = 0; p < {k}; ++p) sum += x[i * {k} + p] * w[p * {n} + j];
      out[i * {n} + j] = sum{" + bias[j]" if bias else ""};
    }}
}}
"""


# What the test libraries are built for, as the manifest says and their kernel table records it.
CPU_BUILD = {"cpu": "generic", "features": ["sse", "sse2"] if platform.machine().lower() in ("x86_64", "amd64") else []}


def kernel_table(kernels: list[dict[str, Any]], gpu: bool = False, build: dict[str, Any] | None = None) -> str:
    """The kernel table (JSON) that the compiler embeds in its code, for manifest `kernels`
    (docs/hxb-format.md, "Kernel tables"): the host code of the module's CPU library (cpu kernels
    and cuda kernels' cpu_fallbacks, without a library of their own), or with `gpu` the cuda
    kernels. Tables of hand-built and compiled modules are made the same way: from the manifest."""
    entries: dict[str, dict[str, Any]] = {}
    for kernel in kernels:
        code = kernel if kernel["device"] == ("cuda" if gpu else "cpu") else None if gpu else kernel.get("cpu_fallback")
        if code is None or "library" in code:
            continue
        entry = {"symbol": code["symbol"], "args": [{"shape": arg["shape"], "dtype": arg["dtype"]}
                                                    for arg in kernel["args"]]}
        if kernel["op"] != "custom":  # what the code computes (an older table: epilogues): a manifest cannot relabel it
            entry.update(op=kernel["op"], **{key: kernel[key] for key in ("expr", "epilogues") if key in kernel})
        entry["scalars" if kernel["op"] == "custom" else "sizes"] = kernel["scalars" if kernel["op"] == "custom"
                                                                          else "sizes"]
        if gpu:
            entry["launch"] = kernel["launch"]
        elif kernel["op"] != "custom":
            entry["work"] = code["work"]
        entries.setdefault(code["symbol"], entry)
    return json.dumps({"kernels": list(entries.values()), **({} if gpu else build or CPU_BUILD)})


def table_c(kernels: list[dict[str, Any]], build: dict[str, Any] | None = None) -> str:
    """`kernel_table(kernels)` as the C definition of `hexir_kernels` (JSON escapes are C escapes for ASCII)."""
    return f"const char hexir_kernels[] = {json.dumps(kernel_table(kernels, build=build))};\n"


KERNELS_CODE = "\n".join(c_source(*kernel) for kernel in KERNELS)


class Builder:
    """Assembles a manifest (without `blobs`) and its blob list, as the compiler's packager does."""

    def __init__(self) -> None:
        self.blobs: list[tuple[str, bytes]] = []
        self.constants: list[dict[str, Any]] = []
        self.kernels: list[dict[str, Any]] = []
        self.entries: list[dict[str, Any]] = []
        self.library: int | None = None

    def blob(self, name: str, data: bytes) -> int:
        self.blobs.append((name, data))
        return len(self.blobs) - 1

    def constant(self, name: str, array: np.ndarray) -> int:
        blob = self.blob(f"constant:{name}", np.ascontiguousarray(array).tobytes())
        self.constants.append({"name": name, "shape": list(array.shape), "dtype": array.dtype.name, "blob": blob})
        return len(self.constants) - 1

    def kernel(self, op: str, shapes: list[list[int]], dtype: str = "float32", device: str = "cpu",
               fallback: bool = True) -> int:
        """A kernel from KERNELS; a CUDA kernel gets fake images and (with `fallback`) the C
        kernel as its cpu_fallback."""
        args = [{"shape": shape, "dtype": dtype, "access": "read"} for shape in shapes]
        args[-1]["access"] = "write"
        kernel = {"name": f"k{len(self.kernels)}_{op}", "op": OPS[op][0], "expr": OPS[op][1], "device": device,
                  "symbol": symbol(op, shapes, dtype), "args": args, "sizes": sizes_of(shapes)}
        rows = shapes[0][0] if shapes[0] else 1
        work = {"extent": rows, "grain": 1}
        if device == "cpu":
            kernel["work"] = work
        else:
            grid = rows if isinstance(rows, str) else max(1, rows)
            kernel["launch"] = {"grid": [grid, 1, 1], "block": [32, 1, 1], "shared_bytes": 0}
            cubin, ptx = self.blob("cubin", b"\x7fELF cubin"), self.blob("ptx", b".version")
            kernel["images"] = {"sm_90": cubin, "compute_90": ptx}
            if fallback:
                kernel["cpu_fallback"] = {"symbol": kernel["symbol"], "work": work}
        self.kernels.append(kernel)
        return len(self.kernels) - 1

    def custom(self, symbol: str, specs: list[tuple[list[int], str]], device: str = "cpu", **keys: Any) -> int:
        """A custom kernel calling `symbol` on args of (shape, dtype), the last one written; `keys`
        adds or replaces manifest keys (library, images, cpu_fallback, launch...)."""
        args = [{"shape": list(shape), "dtype": dtype, "access": "read"} for shape, dtype in specs]
        args[-1]["access"] = "write"
        kernel = {"name": f"k{len(self.kernels)}_{symbol}", "op": "custom", "device": device, "symbol": symbol,
                  "args": args, "scalars": [size for shape, _ in specs for size in shape],
                  "source": f"{symbol}.{'c' if device == 'cpu' else 'cu'}"}
        if device == "cuda":
            kernel["launch"] = {"grid": [1, 1, 1], "block": [256, 1, 1], "shared_bytes": 0}
        kernel.update(keys)
        self.kernels.append(kernel)
        return len(self.kernels) - 1

    def entry(self, name: str = "main") -> Entry:
        entry = Entry(self, name)
        self.entries.append(entry.manifest)
        return entry

    def build(self, library: bytes | None = None) -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
        """The (manifest, blobs) pair for `hxb.encode`; `library` is the CPU .so, if any. A module
        with cuda kernels gets their kernel table as a blob."""
        manifest: dict[str, Any] = {"producer": "hexir-tests"}
        blobs = list(self.blobs)
        if any(uses_cpu_library(kernel) for kernel in self.kernels):
            blobs.append(("cpu.so", library if library is not None else b"\x7fELF not a real library"))
            manifest["cpu"] = {"arch": platform.machine(), "libraries": [{
                "cpu": CPU_BUILD["cpu"], "features": list(CPU_BUILD["features"]), "library": len(blobs) - 1}]}
        if any(kernel["device"] == "cuda" for kernel in self.kernels):
            blobs.append(("cuda-kernels.json", kernel_table(self.kernels, gpu=True).encode()))
            manifest["cuda"] = {"table": len(blobs) - 1}
        manifest.update(constants=self.constants, kernels=self.kernels, entries=self.entries)
        return manifest, blobs


# The test kernels (by name) as versions 2 and 3 wrote them, (op, epilogues); version 1 wrote the name as the op.
OLD_OPS = {"linear": ("linear", []), "linear_bias": ("linear", ["bias"]), "linear_relu": ("linear", ["relu"]),
           "linear_bias_relu": ("linear", ["bias", "relu"]), "relu": ("relu", [])}


def older(manifest: dict[str, Any], version: int) -> dict[str, Any]:
    """The manifest of a version-4 module of test kernels as a writer of `version` spelled it."""
    manifest = copy.deepcopy(manifest)
    names = {(op, json.dumps(expr)): name for name, (op, expr) in OPS.items()}
    for kernel in manifest["kernels"]:
        if kernel["op"] == "custom":
            continue
        name = names.get((kernel["op"], json.dumps(kernel.pop("expr", None))), kernel["op"])
        if version == 1:
            kernel["op"] = name
        else:
            kernel["op"], kernel["epilogues"] = OLD_OPS.get(name, (name, []))
    return manifest


def encode_as(manifest: dict[str, Any], blobs: list[tuple[str, bytes]], version: int) -> bytes:
    """A version-4 module of test kernels written as a writer of `version` would have (unchecked)."""
    original = hxb.container.decode
    hxb.container.decode = lambda data: None  # what encode calls to check its output
    try:
        data = hxb.encode(older(manifest, version), blobs)
    finally:
        hxb.container.decode = original
    return data[:8] + version.to_bytes(4, "little") + data[12:]


def _standard_kernels() -> list[dict[str, Any]]:
    builder = Builder()
    for op, shapes, dtype in KERNELS:
        builder.kernel(op, shapes, dtype)
    return builder.kernels


KERNELS_SOURCE = KERNELS_CODE + table_c(_standard_kernels())


def uses_cpu_library(kernel: dict[str, Any]) -> bool:
    """Whether a kernel has cpu code in the module's library (not in a `library` blob of its own)."""
    code = kernel if kernel["device"] == "cpu" else kernel.get("cpu_fallback")
    return code is not None and "library" not in code


class Entry:
    """One entry's signature, buffers and host program; each method appends a command."""

    def __init__(self, builder: Builder, name: str) -> None:
        self.builder = builder
        self.manifest: dict[str, Any] = {"name": name, "inputs": [], "outputs": [], "buffers": [], "program": []}

    def _buffer(self, shape: list[int], dtype: str, device: str) -> int:
        self.manifest["buffers"].append({"shape": list(shape), "dtype": dtype, "device": device})
        return len(self.manifest["buffers"]) - 1

    def input(self, name: str, shape: list[int], dtype: str = "float32") -> int:
        self.manifest["inputs"].append({"name": name, "shape": list(shape), "dtype": dtype})
        dst = self._buffer(shape, dtype, "cpu")
        self.manifest["program"].append({"op": "input", "index": len(self.manifest["inputs"]) - 1, "dst": dst})
        return dst

    def constant(self, index: int, device: str = "cpu") -> int:
        spec = self.builder.constants[index]
        dst = self._buffer(spec["shape"], spec["dtype"], device)
        self.manifest["program"].append({"op": "constant", "constant": index, "dst": dst})
        return dst

    def call(self, kernel: int, *args: int) -> int:
        spec = self.builder.kernels[kernel]
        out = spec["args"][-1]
        dst = self._buffer(out["shape"], out["dtype"], spec["device"])
        self.manifest["program"].append({"op": "call", "kernel": kernel, "args": [*args, dst]})
        return dst

    def transfer(self, src: int, device: str) -> int:
        spec = self.manifest["buffers"][src]
        dst = self._buffer(spec["shape"], spec["dtype"], device)
        self.manifest["program"].append({"op": "transfer", "src": src, "dst": dst})
        return dst

    def print(self, src: int) -> None:
        self.manifest["program"].append({"op": "print", "src": src})

    def ret(self, *srcs: int) -> None:
        for src in srcs:
            spec = self.manifest["buffers"][src]
            self.manifest["outputs"].append({"shape": spec["shape"], "dtype": spec["dtype"]})
        self.manifest["program"].append({"op": "return", "srcs": list(srcs)})


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    generator = np.random.default_rng(seed)
    shapes = {"W1": (8, 16), "b1": (16,), "W2": (16, 4)}
    return {name: generator.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def mlp_numpy(x: np.ndarray, weights: dict[str, np.ndarray]) -> np.ndarray:
    """What the MLP module computes, in numpy."""
    return np.maximum(x @ weights["W1"] + weights["b1"], 0) @ weights["W2"]


def mlp(library: bytes | None = None) -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
    """Entries `main(x: float32[2, 8]) -> float32[2, 4]` (prints y), `layers(x) -> (h, y)` (no
    print) and `matmul(a, b) -> a @ b` for float32[2, 2] (prints it)."""
    builder, w = Builder(), weights()
    w1, b1, w2 = (builder.constant(name, array) for name, array in w.items())
    layer1 = builder.kernel("linear_bias", [[2, 8], [8, 16], [16], [2, 16]])
    relu = builder.kernel("relu", [[2, 16], [2, 16]])
    layer2 = builder.kernel("linear", [[2, 16], [16, 4], [2, 4]])
    for name in ("main", "layers"):
        entry = builder.entry(name)
        x = entry.input("x", [2, 8])
        h = entry.call(relu, entry.call(layer1, x, entry.constant(w1), entry.constant(b1)))
        y = entry.call(layer2, h, entry.constant(w2))
        if name == "main":
            entry.print(y)
            entry.ret(y)
        else:
            entry.ret(h, y)
    entry = builder.entry("matmul")
    product = entry.call(builder.kernel("linear", [[2, 2]] * 3), entry.input("a", [2, 2]), entry.input("b", [2, 2]))
    entry.print(product)
    entry.ret(product)
    return builder.build(library)


def batched(library: bytes | None = None) -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
    """`main(x: float32[batch, 8]) -> float32[batch, 4]`, the MLP of `mlp` on any number of rows."""
    builder, w = Builder(), weights()
    w1, b1, w2 = (builder.constant(name, array) for name, array in w.items())
    layer1 = builder.kernel("linear_bias", [["batch", 8], [8, 16], [16], ["batch", 16]])
    relu = builder.kernel("relu", [["batch", 16], ["batch", 16]])
    layer2 = builder.kernel("linear", [["batch", 16], [16, 4], ["batch", 4]])
    entry = builder.entry()
    h = entry.call(relu, entry.call(layer1, entry.input("x", ["batch", 8]), entry.constant(w1), entry.constant(b1)))
    entry.ret(entry.call(layer2, h, entry.constant(w2)))
    return builder.build(library)


def big(library: bytes | None = None) -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
    """`main(x: float64[300, 96]) -> relu(x @ W + b)`: big enough to be split over threads."""
    builder, generator = Builder(), np.random.default_rng(1)
    w = builder.constant("W", generator.standard_normal((96, 64)))
    b = builder.constant("b", generator.standard_normal(64))
    layer = builder.kernel("linear_bias", [[300, 96], [96, 64], [64], [300, 64]], "float64")
    relu = builder.kernel("relu", [[300, 64], [300, 64]], "float64")
    entry = builder.entry()
    x = entry.input("x", [300, 96], "float64")
    entry.ret(entry.call(relu, entry.call(layer, x, entry.constant(w), entry.constant(b))))
    return builder.build(library)


def cuda(library: bytes | None = None, fallback: bool = True) -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
    """`main(x: float32[2, 3, 4]) -> relu(x)`, the relu a CUDA kernel between two transfers,
    with (if `fallback`) the C relu as its cpu_fallback."""
    builder = Builder()
    relu = builder.kernel("relu", [[2, 3, 4], [2, 3, 4]], device="cuda", fallback=fallback)
    entry = builder.entry()
    on_gpu = entry.call(relu, entry.transfer(entry.input("x", [2, 3, 4]), "cuda"))
    back = entry.transfer(on_gpu, "cpu")
    entry.print(back)
    entry.ret(back)
    return builder.build(library)


@pytest.fixture(scope="session")
def modules() -> SimpleNamespace:
    """The module factories (`mlp`, `batched`, `big`, `cuda`, `weights`, `mlp_numpy`), the `Builder`, and the C
    source of every kernel of KERNELS (`kernels_source`, with their kernel table; `kernels_code`
    without), and `kernel_table`/`table_c`, which make the tables of any manifest's kernels."""
    return SimpleNamespace(Builder=Builder, mlp=mlp, batched=batched, big=big, cuda=cuda, weights=weights,
                           mlp_numpy=mlp_numpy, kernels_source=KERNELS_SOURCE, kernels_code=KERNELS_CODE,
                           kernel_table=kernel_table, table_c=table_c, older=older, encode_as=encode_as,
                           standard_kernels=_standard_kernels)


@pytest.fixture(scope="session")
def compile_c(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], bytes]:
    """`compile_c(source, name)`: the bytes of a shared object built from C `source` with `cc`, as
    hexir links its libraries (`-nostartfiles`: no constructor, which the runtime refuses) (skips
    without `cc`; fails with the compiler's stderr and command)."""
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler (cc) on PATH to build the test kernels")
    directory = tmp_path_factory.mktemp("kernels")

    def compile_shared_object(source: str, name: str) -> bytes:
        (directory / f"{name}.c").write_text("#include <stdint.h>\n\n" + source)
        command = [compiler, "-O2", "-shared", "-fPIC", "-nostartfiles", "-o", str(directory / f"{name}.so"),
                   str(directory / f"{name}.c")]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            pytest.fail(f"{' '.join(command)} failed:\n{result.stderr}")
        return (directory / f"{name}.so").read_bytes()

    return compile_shared_object


@pytest.fixture(scope="session")
def c_library(compile_c: Callable[[str, str], bytes]) -> bytes:
    """The bytes of a shared object implementing every kernel of KERNELS, built with `cc`."""
    return compile_c(KERNELS_SOURCE, "kernels")


@pytest.fixture
def mlp_file(tmp_path, c_library: bytes):
    """The MLP module (real kernels) written to a .hxb file."""
    path = tmp_path / "mlp.hxb"
    hxb.write(path, *mlp(c_library))
    return path


@pytest.fixture(scope="module")
def parts(modules):
    """The manifest and blobs of the small mlp module (format and fuzz tests)."""
    return modules.mlp()


@pytest.fixture(scope="module")
def data(parts) -> bytes:
    """The encoded bytes of `parts`."""
    from hexir_runtime import format as hxb

    return hxb.encode(*parts)


@pytest.fixture
def no_gpu(monkeypatch):
    """This process sees no usable GPU, whatever the machine has."""
    import hexir_runtime.module
    from hexir_runtime.errors import DeviceError

    def refuse():
        raise DeviceError("no CUDA device (made unusable by the test)")
    monkeypatch.setattr(hexir_runtime.module, "_cuda_device", refuse)


@pytest.fixture(autouse=True)
def fresh_notices(monkeypatch):
    """Each test starts in a process that has given no notice yet (they are said once per process)."""
    import hexir_runtime.module

    monkeypatch.setattr(hexir_runtime.module, "_notices", set())


@pytest.fixture
def concurrently() -> Callable[..., list[tuple[int, BaseException]]]:
    """`concurrently(work, threads=8)`: work(seed) on `threads` threads at once, seeds 0, 1, ...;
    the (seed, error) of each thread that raised."""
    def run(work: Callable[[int], None], threads: int = 8) -> list[tuple[int, BaseException]]:
        failures: list[tuple[int, BaseException]] = []
        recording = threading.Lock()  # (list.append is atomic under the GIL; not on a free-threaded build)

        def guarded(seed: int) -> None:
            try:
                work(seed)
            except Exception as error:  # noqa: BLE001 - returned, with the thread's seed
                with recording:
                    failures.append((seed, error))
        started = [threading.Thread(target=guarded, args=(seed,)) for seed in range(threads)]
        for thread in started:
            thread.start()
        for thread in started:
            thread.join()
        return failures
    return run
