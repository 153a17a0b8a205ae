"""The compile cache on disk (hexir/cache.py): a second process gets the module without
compiling, a corrupt entry is rebuilt, the key holds what changes the code, the cache can be
turned off, and the folder stays within its size bound."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import hexir
from hexir import cache
from hexir.driver import Options

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
    return sorted(folder.glob("*.hxb"))


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
    assert entry.read_bytes().startswith(b"\x89HXB") and len(entry.read_bytes()) > 100
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
        (tmp_path / f"{name}.hxb").write_bytes(b"x" * 100)
    now = time.time()
    for name, seconds in (("new", 0), ("middle", 100), ("old", 200)):
        os.utime(tmp_path / f"{name}.hxb", (now - seconds, now - seconds))
    (tmp_path / ".tmp-dead").write_bytes(b"x")
    os.utime(tmp_path / ".tmp-dead", (now - 7200, now - 7200))
    cache.evict(tmp_path, limit=250)
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["middle.hxb", "new.hxb"]


def test_a_hit_touches_the_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("HEXIR_CACHE_DIR", str(tmp_path))
    fn = hexir.jit(lambda x: hexir.relu(x))
    spec = hexir.TensorSpec((2, 4), "float32")
    data = cache.compile_cached(fn.trace(spec), Options())
    [entry] = entries(tmp_path)
    os.utime(entry, (0, 0))
    assert cache.compile_cached(fn.trace(spec), Options()) == data
    assert entry.stat().st_mtime > 0
