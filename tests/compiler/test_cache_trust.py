"""What the compile cache (hexir/cache.py) refuses to trust: a folder others can write to or
that is not the user's, a secret that is not the user's alone, and any entry that is not a
regular file of the user bound to its key by the folder's secret. Each is rebuilt or
bypassed (with one warning), never run, never followed, never a hang or a raw error."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import numpy as np
import pytest

import hexir
from hexir import cache
from hexir.driver import Options
from hexir.target import Target

OPTIONS = Options(target=Target(cpu_levels=("x86-64",)))  # one library: the quickest compile


def traced(scale: float):
    """linear with the weights `scale` * ones: one code, other weights for another scale."""
    weight = np.full((4, 4), scale, np.float32)
    return hexir.jit(lambda x: hexir.linear(x, weight)).trace(hexir.TensorSpec((2, 4), "float32"))


class Folder:
    def __init__(self, path: Path):
        self.path, self.compiles = path, 0

    def compile(self, scale: float = 1.0) -> bytes:
        return cache.compile_cached(traced(scale), OPTIONS)

    def entry(self, scale: float = 1.0) -> Path:
        return self.path / f"{cache.key(traced(scale), OPTIONS)}.hxc"


@pytest.fixture
def folder(tmp_path, monkeypatch) -> Folder:
    """The cache in a fresh folder, counting the compiles; each warning said afresh."""
    store = Folder(tmp_path / "cache")
    monkeypatch.setenv("HEXIR_CACHE_DIR", str(store.path))
    original = cache.compile_module

    def counted(*args):
        store.compiles += 1
        return original(*args)
    monkeypatch.setattr(cache, "compile_module", counted)
    cache._warn_once.cache_clear()
    yield store
    cache._warn_once.cache_clear()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_the_folder_is_the_users_alone_and_a_hit_does_not_compile(folder):
    data = folder.compile()
    assert folder.compile() == data and folder.compiles == 1
    assert mode(folder.path) == 0o700
    secret = folder.path / ".secret"
    assert mode(secret) == 0o600 and len(secret.read_bytes()) == 32
    assert mode(folder.entry()) == 0o600 and folder.entry().read_bytes()[32:] == data


def test_a_symbolic_link_entry_is_not_followed_nor_its_target_touched(folder, tmp_path):
    folder.compile()
    target = tmp_path / "elsewhere.hxc"
    folder.entry().rename(target)  # a valid entry, tag and all, only behind a link
    folder.entry().symlink_to(target)
    os.utime(target, (0, 0))
    with pytest.warns(RuntimeWarning, match="symbolic link; it is rebuilt, not used"):
        folder.compile()
    assert folder.compiles == 2 and target.stat().st_mtime == 0
    assert not folder.entry().is_symlink() and folder.entry().read_bytes() == target.read_bytes()


def test_an_entry_linked_to_dev_zero_is_rebuilt_without_reading_it(folder):
    folder.entry().parent.mkdir(mode=0o700)
    folder.entry().symlink_to("/dev/zero")
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        data = folder.compile()
    assert folder.compiles == 1 and folder.entry().read_bytes()[32:] == data


def test_a_fifo_entry_does_not_hang_the_call(folder):
    folder.entry().parent.mkdir(mode=0o700)
    os.mkfifo(folder.entry(), 0o600)
    results = []
    call = threading.Thread(target=lambda: results.append(folder.compile()), daemon=True)
    with pytest.warns(RuntimeWarning, match="not a regular file"):
        call.start()
        call.join(timeout=600)  # generous: a hang is forever, a slow compile is not
    assert not call.is_alive() and folder.compiles == 1
    assert stat.S_ISREG(folder.entry().lstat().st_mode) and folder.entry().read_bytes()[32:] == results[0]


def test_an_oversize_entry_is_rebuilt_without_reading_it(folder):
    folder.entry().parent.mkdir(mode=0o700)
    with open(folder.entry(), "wb") as entry:
        entry.truncate(cache.MAX_BYTES + 33)  # sparse: no disk, but reading it would take 512 MiB
    os.chmod(folder.entry(), 0o600)
    with pytest.warns(RuntimeWarning, match="over MAX_BYTES"):
        data = folder.compile()
    assert folder.compiles == 1 and folder.entry().read_bytes()[32:] == data


def test_a_planted_entry_with_a_wrong_tag_is_rebuilt(folder):
    other = cache.compile_module(traced(2.0), OPTIONS)  # a real module: the same code, other weights
    folder.entry().parent.mkdir(mode=0o700)
    folder.entry().write_bytes(bytes(32) + other)
    with pytest.warns(RuntimeWarning, match="its tag does not match"):
        data = folder.compile()
    assert folder.compiles == 2 and data != other
    assert folder.compile() == data and folder.compiles == 2  # the rebuilt entry is a hit


def test_an_entry_renamed_to_another_key_is_rebuilt(folder):
    mine, other = folder.compile(1.0), folder.compile(2.0)
    folder.entry(2.0).replace(folder.entry(1.0))  # a valid entry, tag and all, under another name
    with pytest.warns(RuntimeWarning, match="its tag does not match"):
        assert folder.compile(1.0) != other
    assert folder.compiles == 3 and folder.entry(1.0).read_bytes()[32:] != other
    del mine


def test_an_entry_of_another_secret_is_rebuilt(folder):
    folder.compile()
    (folder.path / ".secret").unlink()  # a folder copied from elsewhere: another secret
    with pytest.warns(RuntimeWarning, match="its tag does not match"):
        folder.compile()
    assert folder.compiles == 2


@pytest.mark.parametrize("folder_mode", [0o777, 0o770, 0o1777, 0o720])
def test_a_folder_others_can_write_to_is_not_used(folder, folder_mode):
    folder.compile()
    folder.path.chmod(folder_mode)
    with pytest.warns(RuntimeWarning, match="can be written by others.*compiling without it"):
        folder.compile()
    folder.compile()  # one warning, and still no hit
    assert folder.compiles == 3


def test_a_folder_owned_by_someone_else_is_not_used(folder, monkeypatch):
    folder.compile()
    if os.geteuid() == 0:
        os.chown(folder.path, 4242, -1)
    else:  # the folder stays ours; the cache is told we are someone else
        uid = os.geteuid() + 1
        monkeypatch.setattr(os, "geteuid", lambda: uid)
    with pytest.warns(RuntimeWarning, match="belongs to uid .*, not to this user"):
        folder.compile()
    assert folder.compiles == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_an_entry_owned_by_someone_else_is_rebuilt(folder):
    folder.compile()
    os.chown(folder.entry(), 4242, -1)
    with pytest.warns(RuntimeWarning, match="owned by uid 4242"):
        folder.compile()
    assert folder.compiles == 2 and folder.entry().stat().st_uid == 0


@pytest.mark.parametrize("damage", ["readable", "link", "short"])
def test_a_secret_that_is_not_the_users_alone_is_refused(folder, tmp_path, damage):
    folder.compile()
    secret = folder.path / ".secret"
    if damage == "readable":
        secret.chmod(0o644)
    elif damage == "link":
        (tmp_path / "secret").write_bytes(secret.read_bytes())
        (tmp_path / "secret").chmod(0o600)
        secret.unlink()
        secret.symlink_to(tmp_path / "secret")
    else:
        secret.write_bytes(b"x")
    with pytest.warns(RuntimeWarning, match="secret that is not a regular 0600 file of this user"):
        folder.compile()
    assert folder.compiles == 2


def test_a_folder_that_is_a_file_gives_a_warning_not_an_error(folder):
    folder.path.write_bytes(b"")
    with pytest.warns(RuntimeWarning, match="compiling without it"):
        folder.compile()
    assert folder.compiles == 1
