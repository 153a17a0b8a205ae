"""The compile cache on disk (hexir/cache.py): a second process gets the module without
compiling, a corrupt entry is rebuilt, the key holds what changes the code (weights, options,
custom kernels and the headers they include, the compiler's C parts and C compiler, registered
ops' definitions), the cache can be turned off, and the folder stays within its size bound.
What the cache refuses to trust is tests/compiler/test_cache_trust.py."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import hexir
from hexir import cache, ops
from hexir.driver import Options
from hexir.errors import CompileError

REPO = Path(__file__).resolve().parents[2]

# one process: the README's MLP, called once; prints how many compiles ran, then the result
PROGRAM = textwrap.dedent("""
    import sys, numpy as np, hexir, hexir.cache as cache
    compiles = []
    original = cache.compile_module
    cache.compile_module = lambda *a: compiles.append(1) or original(*a)
    rng = np.random.default_rng(0)
    W1, W2 = rng.random((8, 16), dtype=np.float32), rng.random((16, 4), dtype=np.float32)

    @hexir.jit(cache=sys.argv[1] == "on")
    def mlp(x):
        return hexir.linear(hexir.relu(hexir.linear(x, W1)), W2)

    y = mlp(np.ones((2, 8), np.float32))
    print(len(compiles), float(y.sum()))
""")


def run(folder: Path | str, tmp_path: Path, switch: str = "on") -> tuple[int, float]:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    path = os.pathsep.join([str(REPO), str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(script), switch], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": path, "HEXIR_CACHE_DIR": str(folder)})
    assert done.returncode == 0, done.stderr
    compiles, total = done.stdout.split()
    return int(compiles), float(total)


def entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.hxc"))


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    folder = tmp_path / "cache"
    first = run(folder, tmp_path)
    assert first[0] == 1 and len(entries(folder)) == 1
    assert run(folder, tmp_path) == (0, first[1])
    assert not list(folder.glob(".tmp-*"))


@pytest.mark.parametrize("damage", [b"", b"not a module", b"\x89HXB\r\n\x1a\n" + b"\0" * 40], ids=["empty", "foreign",
                                                                                                  "truncated"])
def test_a_corrupt_entry_is_rebuilt(tmp_path, damage):
    folder = tmp_path / "cache"
    compiles, total = run(folder, tmp_path)
    [entry] = entries(folder)
    entry.write_bytes(damage)
    assert run(folder, tmp_path) == (1, total)
    assert entry.read_bytes()[32:].startswith(b"\x89HXB") and len(entry.read_bytes()) > 100  # tag, module
    assert run(folder, tmp_path) == (0, total)


def test_processes_filling_one_folder_at_once(tmp_path):
    folder = tmp_path / "cache"
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    path = os.pathsep.join([str(REPO), str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "HEXIR_CACHE_DIR": str(folder)}
    runs = [subprocess.Popen([sys.executable, str(script), "on"], stdout=subprocess.PIPE, text=True, env=env)
            for _ in range(4)]
    totals = {run.communicate(timeout=300)[0].split()[1] for run in runs}
    assert all(run.returncode == 0 for run in runs) and len(totals) == 1
    assert len(entries(folder)) == 1 and not list(folder.glob(".tmp-*"))


def test_the_cache_turned_off(tmp_path):
    assert run("", tmp_path)[0] == 1                   # HEXIR_CACHE_DIR= (empty)
    folder = tmp_path / "cache"
    assert run(folder, tmp_path, switch="off")[0] == 1  # hexir.jit(cache=False)
    assert run(folder, tmp_path, switch="off")[0] == 1
    assert not folder.exists()


def test_the_default_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("HEXIR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.directory() == tmp_path / "hexir"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.directory() == Path.home() / ".cache" / "hexir"
    monkeypatch.setenv("HEXIR_CACHE_DIR", "")
    assert cache.directory() is None


def _key(weight: np.ndarray, **options) -> str:
    fn = hexir.jit(lambda x: hexir.linear(x, weight), **options)
    return cache.key(fn.trace(hexir.TensorSpec((2, 4), "float32")), fn.options)


def test_the_key_holds_the_weights_values_and_the_options():
    # more than 16 values, not all one (a splat is printed): the key's IR text elides them
    weight = np.arange(20, dtype=np.float32).reshape(4, 5)
    assert _key(weight) == _key(weight.copy())
    changed = weight.copy()
    changed[3, 4] = 2  # the printed text elides it: the bytes are hashed
    assert _key(changed) != _key(weight)
    assert _key(weight, target="cpu:x86-64-v3") != _key(weight)
    assert _key(weight, placement="hexir.linear=cuda") != _key(weight)


def test_two_functions_of_the_same_code_and_other_weights_get_their_own_results(tmp_path, monkeypatch):
    """Same code, same shapes, weights that differ in one value the key's IR text elides: two
    entries, and each function computes with its own weights (a key without the constants'
    bytes would hand the second function the first one's module: silently wrong)."""
    monkeypatch.setenv("HEXIR_CACHE_DIR", str(tmp_path))
    rng = np.random.default_rng(5)
    first = rng.standard_normal((8, 16)).astype(np.float32)
    second = first.copy()
    second[7, 15] += 1
    x = rng.standard_normal((3, 8)).astype(np.float32)
    def layer(weight):  # a captured weight: a constant of the module
        return hexir.jit(lambda x: hexir.linear(x, weight))
    for weight in (first, second):
        np.testing.assert_allclose(layer(weight)(x), x @ weight, rtol=1e-5, atol=1e-5)
    assert len(entries(tmp_path)) == 2


def test_the_key_holds_a_custom_kernels_bytes(tmp_path):
    source = tmp_path / "k.c"
    source.write_text("void k(float *x, float *y, long a, long b, long c, long d) {}\n")
    kernel = hexir.kernel("k", cpu=source, out=lambda x: x)
    fn = hexir.jit(lambda x: kernel(x))
    spec = hexir.TensorSpec((2, 4), "float32")
    before = cache.key(fn.trace(spec), fn.options)
    source.write_text(source.read_text() + "/* changed */\n")
    assert cache.key(fn.trace(spec), fn.options) != before


def test_least_recently_used_entries_go_first(tmp_path):
    for name in ("new", "old", "middle"):
        (tmp_path / f"{name}.hxc").write_bytes(b"x" * 100)
    now = time.time()
    for name, seconds in (("new", 0), ("middle", 100), ("old", 200)):
        os.utime(tmp_path / f"{name}.hxc", (now - seconds, now - seconds))
    (tmp_path / ".tmp-dead").write_bytes(b"x")
    os.utime(tmp_path / ".tmp-dead", (now - 7200, now - 7200))
    (tmp_path / ".tmp-alive").write_bytes(b"x")  # a writer at work
    cache.evict(tmp_path, limit=250)
    assert [p.name for p in sorted(tmp_path.iterdir())] == [".tmp-alive", "middle.hxc", "new.hxc"]


def test_a_hit_touches_the_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("HEXIR_CACHE_DIR", str(tmp_path))
    fn = hexir.jit(lambda x: hexir.relu(x))
    spec = hexir.TensorSpec((2, 4), "float32")
    data = cache.compile_cached(fn.trace(spec), Options())
    [entry] = entries(tmp_path)
    os.utime(entry, (0, 0))
    assert cache.compile_cached(fn.trace(spec), Options()) == data
    assert entry.stat().st_mtime > 0


def test_a_header_a_custom_kernel_includes_is_in_the_key_and_its_edit_recompiles(tmp_path, monkeypatch):
    monkeypatch.setenv("HEXIR_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "scale.h").write_text('#include "factor.h"\n#define SCALE FACTOR\n')
    (tmp_path / "factor.h").write_text("#define FACTOR 2.0f\n")
    source = tmp_path / "scale.c"
    source.write_text('#include <stdint.h>\n#include "scale.h"\n'
                      "void scale(const float *x, float *y, int64_t a, int64_t b, int64_t c, int64_t d) {\n"
                      "    for (int64_t i = 0; i < a * b; ++i) y[i] = x[i] * SCALE;\n}\n")
    kernel = hexir.kernel("scale", cpu=source, out=lambda x: x)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(hexir.jit(lambda x: kernel(x))(x), 2 * x)
    (tmp_path / "factor.h").write_text("#define FACTOR 3.0f\n")  # two includes deep
    np.testing.assert_array_equal(hexir.jit(lambda x: kernel(x))(x), 3 * x)
    assert len(entries(tmp_path / "cache")) == 2


def test_a_missing_header_is_the_compiles_own_error_with_the_cache_on(tmp_path, monkeypatch):
    """The key cannot list a kernel's headers when one is missing: the module compiles without the
    cache, so the user sees the C compiler's error about the file, not the key's."""
    monkeypatch.setenv("HEXIR_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "broken.c"
    source.write_text('#include <stdint.h>\n#include "missing.h"\n'
                      "void broken(const float *x, float *y, int64_t a, int64_t b, int64_t c, int64_t d) {}\n")
    kernel = hexir.kernel("broken", cpu=source, out=lambda x: x)
    with pytest.raises(CompileError, match=r"(?s)compiling custom kernel broken \(broken\.c\).*missing\.h") as caught:
        hexir.jit(lambda x: kernel(x))(np.ones((2, 4), np.float32))
    assert "listing the headers" not in str(caught.value)


def test_a_cuda_kernels_quoted_includes_are_followed(tmp_path):
    (tmp_path / "include").mkdir()
    (tmp_path / "k.cu").write_text('#include "a.cuh"\nextern "C" __global__ void k(const float *x, float *y, '
                                   "long long a, long long b, long long c, long long d) {}\n")
    (tmp_path / "a.cuh").write_text('#pragma once\n  #  include "b.cuh"\n#include <cstdint>\n')
    (tmp_path / "include" / "b.cuh").write_text("#define B 1\n")  # found on the kernel search path
    kernel = hexir.kernel("k", cuda=tmp_path / "k.cu", out=lambda x: x, grid=(1, 1, 1), block=(32, 1, 1))
    fn = hexir.jit(lambda x: kernel(x), kernel_search_path=[tmp_path / "include"])
    spec = hexir.TensorSpec((2, 4), "float32")
    before = cache.key(fn.trace(spec), fn.options)
    assert cache.key(fn.trace(spec), fn.options) == before
    (tmp_path / "include" / "b.cuh").write_text("#define B 2\n")
    assert cache.key(fn.trace(spec), fn.options) != before


@pytest.fixture
def fresh_fingerprint():
    cache._compiler_fingerprint.cache_clear()
    yield lambda: cache._compiler_fingerprint.cache_clear()
    cache._compiler_fingerprint.cache_clear()  # after monkeypatch's undo: the real compiler again


def test_the_compilers_c_source_is_in_the_key(tmp_path, monkeypatch, fresh_fingerprint):
    copy = tmp_path / "hexir"
    shutil.copytree(cache.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(cache, "PACKAGE", copy)
    weight = np.ones((4, 4), np.float32)
    before = _key(weight)
    pool = copy / "backend" / "pool.c"
    stat = pool.stat()
    pool.write_bytes(pool.read_bytes().replace(b"hexir", b"HEXIR", 1))
    os.utime(pool, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the same size and time: its bytes are read
    fresh_fingerprint()
    assert _key(weight) != before


def test_the_c_compilers_version_is_in_the_key(tmp_path, monkeypatch, fresh_fingerprint):
    compiler = tmp_path / "cc"
    compiler.write_text("#!/bin/sh\necho 'cc (hexir test) 1.0'\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    weight = np.ones((4, 4), np.float32)
    before = _key(weight)
    compiler.write_text("#!/bin/sh\necho 'cc (hexir test) 1.1'\n")
    fresh_fingerprint()
    assert _key(weight) != before


# one process: registers the op `myop` with the definition named by argv[1], calls it with the
# cache on, prints the compiles, the result and the key
REGISTERING = textwrap.dedent("""
    import sys, numpy as np, hexir, hexir.cache as cache
    compiles = []
    original = cache.compile_module
    cache.compile_module = lambda *a: compiles.append(1) or original(*a)
    function = {"add": lambda x: x + x, "mul": lambda x: x * x}[sys.argv[1]]
    myop = hexir.register_op(hexir.Pointwise("myop", function))
    fn = hexir.jit(lambda x: myop(x))
    y = fn(np.full((2, 4), 3, np.float32))
    print(len(compiles), float(y.sum()), cache.key(fn.trace(hexir.TensorSpec((2, 4), "float32")), fn.options))
""")


def test_two_processes_registering_one_op_name_differently_get_their_own_code(tmp_path):
    """The issue's case: the op's tree is in the module's text, so the key differs with it."""
    script = tmp_path / "program.py"
    script.write_text(REGISTERING)
    path = os.pathsep.join([str(REPO), str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "HEXIR_CACHE_DIR": str(tmp_path / "cache")}

    def run_with(definition: str) -> list[str]:
        done = subprocess.run([sys.executable, str(script), definition], capture_output=True, text=True, timeout=300,
                              env=env)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    add, mul, add_again = run_with("add"), run_with("mul"), run_with("add")
    assert add[:2] == ["1", "48.0"] and mul[:2] == ["1", "72.0"]  # 3 + 3 and 3 * 3, 8 elements
    assert add[2] != mul[2]
    assert add_again == ["0", "48.0", add[2]]  # a definition's key is the same in every process


def _digest(value) -> str:
    digest = hashlib.sha256()
    cache._describe(digest, value, {})
    return digest.hexdigest()


def _defined(source: str, **namespace):
    exec(textwrap.dedent(source), namespace)  # no source file: what a REPL or a notebook makes
    return namespace["f"]


def test_an_ops_functions_are_described_by_what_they_compute():
    scaled = "def make(c):\n    return lambda v: v * c\nf = make(C)\n"
    assert _digest(_defined(scaled, C=2.0)) == _digest(_defined(scaled, C=2.0))
    assert _digest(_defined(scaled, C=2.0)) != _digest(_defined(scaled, C=3.0))                # a closure's value
    glob = "def f(v):\n    return v * SCALE\n"
    assert _digest(_defined(glob, SCALE=2.0)) != _digest(_defined(glob, SCALE=3.0))            # a global's value
    assert _digest(_defined("f = lambda v: max(v)")) != _digest(_defined("f = lambda v: min(v)"))  # a name
    assert _digest(_defined("def f(v, k=2): return v")) != _digest(_defined("def f(v, k=3): return v"))
    helper = "def f(v):\n    return helper(v)\n"
    assert (_digest(_defined(helper, helper=_defined("def f(v): return v + 1")))
            != _digest(_defined(helper, helper=_defined("def f(v): return v + 2"))))      # a function it calls
    weights = "f = lambda v: v * W\n"
    assert (_digest(_defined(weights, W=np.ones(3))) != _digest(_defined(weights, W=np.array([1.0, 1, 2]))))
    assert _digest(functools.partial(max, 2)) != _digest(functools.partial(max, 3))
    scale = _defined("class Scale:\n    def __init__(self, c): self.c = c\n"
                     "    def __call__(self, v): return v * self.c\nf = Scale", __name__="notebook")
    assert _digest(scale(2)) == _digest(scale(2)) != _digest(scale(3))                       # a callable's state
    linear = ops.REGISTRY["linear"]  # a contract op is keyed by its code (pointwise/reduce ops: their trees)
    assert _digest(linear.schedules) == _digest(linear.schedules)  # hexir's own: named, the same each time
