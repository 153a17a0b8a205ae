"""Signed modules (issue 28): `load(..., trusted_keys=...)` and `hexir-run --trust` run only a
module signed by a trusted key, checked before its manifest is parsed or any code is mapped;
without keys a signed module loads as any other; key files that cannot be used are named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

try:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
except ImportError:  # CI has it (hexir's dev extra; tests/compiler/test_signing.py needs it); a copy elsewhere may not
    pytest.skip('needs cryptography: pip install "hexir-runtime[sign]"', allow_module_level=True)
from hexir_runtime import HxbFormatError, KeyFileError, UntrustedModuleError, load, signing
from hexir_runtime import cpu as cpu_device
from hexir_runtime import format as hxb
from hexir_runtime import module as module_code
from hexir_runtime.cli import main

RUNTIME = str(Path(__file__).parents[2] / "runtime")
X = np.arange(16, dtype=np.float32).reshape(2, 8) / 7


def write_pair(folder: Path, name: str) -> tuple[Path, Path]:
    """A fresh Ed25519 key pair as `name.pem` (PKCS8) and `name.pub.pem` (SubjectPublicKeyInfo)."""
    key = Ed25519PrivateKey.generate()
    private, public = folder / f"{name}.pem", folder / f"{name}.pub.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    folder = tmp_path_factory.mktemp("keys")
    return {name: write_pair(folder, name) for name in ("alice", "bob")}


@pytest.fixture(scope="module")
def unsigned(modules, c_library) -> bytes:
    return hxb.encode(*modules.mlp(c_library))


@pytest.fixture(scope="module")
def signed(unsigned, keys) -> bytes:
    return signing.sign(unsigned, signing.signing_key(keys["alice"][0]))


def key_id(public_pem: Path) -> str:
    return signing.trusted_keys(public_pem)[0].id


def untrusted(data, trusted, source=None) -> UntrustedModuleError:
    with pytest.raises(UntrustedModuleError) as caught:
        load(data if source is None else source, "cpu", trusted_keys=trusted)
    assert caught.value.field == "signature"
    return caught.value


def test_round_trip(unsigned, signed, keys, tmp_path, modules):
    expected = modules.mlp_numpy(X, modules.weights())
    assert signed[:8] == unsigned[:8] and len(signed) == len(unsigned) + signing.RECORD.size
    assert signing.signer(signed) == key_id(keys["alice"][1]) and signing.signer(unsigned) is None
    path = tmp_path / "signed.hxb"
    path.write_bytes(signed)
    public = keys["alice"][1]
    key_object = serialization.load_pem_public_key(public.read_bytes())
    for source, trusted in [(path, [public]), (signed, public), (hxb.decode(signed), [key_object]),
                            (bytearray(signed), [keys["bob"][1], str(public)]), (signed, None)]:
        with load(source, "cpu", trusted_keys=trusted) as module:
            np.testing.assert_allclose(module.layers(X)[1], expected, rtol=1e-5)
    assert hxb.decode(signed).json == hxb.decode(unsigned).json
    assert signing.sign(signed, signing.signing_key(keys["alice"][0])) == signed  # Ed25519 is deterministic
    resigned = signing.sign(signed, signing.signing_key(keys["bob"][0]))  # replaces the signature
    assert len(resigned) == len(signed) and signing.signer(resigned) == key_id(keys["bob"][1])
    load(resigned, "reference", trusted_keys=[keys["bob"][1]]).close()


def test_unsigned_refused_when_keys_are_given(unsigned, keys):
    error = untrusted(unsigned, [keys["alice"][1]])
    assert "the module is not signed" in error.reason and key_id(keys["alice"][1]) in error.reason


def test_wrong_key_names_the_signer_and_every_key_tried(signed, keys):
    error = untrusted(signed, [keys["bob"][1]])
    alice, bob = key_id(keys["alice"][1]), key_id(keys["bob"][1])
    assert f"signed by key {alice}, which is not trusted (trusted: {bob} ({keys['bob'][1]}))" in str(error)


def test_an_hxb_whose_manifest_is_not_the_signed_one_is_refused(signed, unsigned, keys, modules, c_library):
    other = hxb.decode(hxb.encode(*modules.batched(c_library)))
    forged = hxb.Hxb(other.manifest, other.json, signed, other.version)  # signed bytes, another manifest
    with load(forged, "cpu", trusted_keys=[keys["alice"][1]]) as module:
        assert module.entries == ("main", "layers", "matmul")  # the signed bytes' manifest, not the forged one


def test_every_flipped_byte_is_refused_before_the_manifest_is_read(signed, keys, monkeypatch):
    """Flip bits of one byte at many positions (all of the header and the record, every 7th elsewhere):
    each is refused, and neither the manifest decoder nor the library loader runs."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a module with a bad signature reached the decoder or the library loader")
    monkeypatch.setattr(module_code, "decode", forbidden)
    monkeypatch.setattr(cpu_device, "open_library", forbidden)
    trusted = signing.trusted_keys([keys["alice"][1]])
    record = len(signed) - signing.RECORD.size
    edges = {*range(64), *range(record - 8, len(signed))}  # the header and the record: their low and high bits too
    flips = [(position, mask) for position in sorted({*edges, *range(64, record, 7)})
             for mask in {1 << position % 8, *((1, 0x80) if position in edges else ())}]
    seen = set()
    for position, mask in flips:
        flipped = bytearray(signed)
        flipped[position] ^= mask
        with pytest.raises(HxbFormatError) as caught:
            load(bytes(flipped), "cpu", trusted_keys=trusted)
        error = caught.value
        if isinstance(error, UntrustedModuleError):
            seen.add(next(why for why in ("not signed", "not trusted", "does not verify") if why in error.reason))
        else:
            seen.add(error.field)
    assert len(flips) > 1000
    assert seen == {"header.magic", "signature.magic", "signature.algorithm", "signature.reserved", "not signed",
                    "not trusted", "does not verify"}


def test_stripped_moved_and_grafted_signatures(signed, unsigned, keys, modules, c_library):
    trusted, size = [keys["alice"][1]], signing.RECORD.size
    record = signed[-size:]
    stripped = signed[:-size]  # the flag still says signed: refused even without keys
    for data, field in [(stripped, "signature.magic"), (signed + b"\0" * 64, "signature.magic"),
                        (signed[:44] + record + signed[44:-size], "signature.magic"),
                        (signed[:60], "signature")]:
        with pytest.raises(HxbFormatError) as caught:
            hxb.decode(data)
        assert caught.value.field == field, str(caught.value)
        with pytest.raises(HxbFormatError):
            load(data, "cpu", trusted_keys=trusted)
    unflagged = stripped[:36] + bytes(4) + stripped[40:]  # the record dropped and the flag cleared: unsigned
    assert unflagged == unsigned
    untrusted(unflagged, trusted)
    # Another module (other weights) with this record grafted on, or with a record of its own by the
    # same key swapped with this one's: neither verifies.
    other = hxb.encode(*_other_weights(modules, c_library))
    grafted = other[:36] + (1).to_bytes(4, "little") + other[40:] + record
    hxb.decode(grafted)  # well formed: only the signature tells
    assert "does not verify" in untrusted(grafted, trusted).reason
    other_signed = signing.sign(other, signing.signing_key(keys["alice"][0]))
    assert "does not verify" in untrusted(signed[:-size] + other_signed[-size:], trusted).reason


def _other_weights(modules, c_library):
    manifest, blobs = modules.mlp(c_library)
    return manifest, [(name, bytes(len(data)) if name.startswith("constant") else data) for name, data in blobs]


def test_key_file_errors_name_the_file(keys, tmp_path, signed):
    garbage, empty, folder = tmp_path / "garbage.pem", tmp_path / "empty.pem", tmp_path / "folder"
    garbage.write_text("-----BEGIN PUBLIC KEY-----\nnot base64\n-----END PUBLIC KEY-----\n")
    empty.write_bytes(b"")
    folder.mkdir()
    ec_key = ec.generate_private_key(ec.SECP256R1())
    ec_public = tmp_path / "ec.pub.pem"
    ec_public.write_bytes(ec_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                           serialization.PublicFormat.SubjectPublicKeyInfo))
    encrypted = tmp_path / "encrypted.pem"
    encrypted.write_bytes(Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")))
    raw = tmp_path / "raw.key"
    raw.write_bytes(bytes(32))
    for path, text in [(tmp_path / "missing.pub.pem", "No such file"), (folder, "Is a directory"),
                       (garbage, "not a PEM public key"), (empty, "not a PEM public key"),
                       (raw, "not a PEM public key"), (keys["alice"][0], "holds a private key; trust the public key"),
                       (ec_public, "holds a key of another kind"), (encrypted, "holds a private key")]:
        with pytest.raises(KeyFileError) as caught:
            load(signed, "cpu", trusted_keys=[keys["alice"][1], path])
        assert str(caught.value).startswith(f"{path}: ") and text in str(caught.value), str(caught.value)
    for path, text in [(keys["alice"][1], "holds a public key; signing needs the private key"),
                       (encrypted, "the private key is encrypted"), (raw, "not a PEM private key")]:
        with pytest.raises(KeyFileError) as caught:
            signing.signing_key(path)
        assert str(caught.value).startswith(f"{path}: ") and text in str(caught.value), str(caught.value)
    with pytest.raises(ValueError, match="trusted_keys is empty"):
        load(signed, "cpu", trusted_keys=[])
    with pytest.raises(TypeError, match=r"Ed25519 public key, got \w*(EC|EllipticCurve)PublicKey"):
        load(signed, "cpu", trusted_keys=[ec_key.public_key()])


def test_hexir_run_trust(capsys, signed, unsigned, keys, tmp_path):
    signed_path, unsigned_path = tmp_path / "signed.hxb", tmp_path / "unsigned.hxb"
    signed_path.write_bytes(signed)
    unsigned_path.write_bytes(unsigned)
    np.save(tmp_path / "x.npy", X)
    alice, bob = (keys[name][1] for name in ("alice", "bob"))
    run = ["--quiet", "--input", f"x={tmp_path / 'x.npy'}"]

    def hexir_run(*argv) -> tuple[int, str, str]:
        code = main([str(arg) for arg in argv])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, err = hexir_run(signed_path, "--trust", bob, "--trust", alice, *run)
    assert (code, err) == (0, "") and len(out.splitlines()) == 2
    code, out, err = hexir_run(signed_path, "--trust", bob, *run)
    assert code == 1 and out == "" and f"signed by key {key_id(alice)}, which is not trusted" in err
    code, _, err = hexir_run(unsigned_path, "--trust", alice, *run)
    assert code == 1 and err.startswith(f"hexir-run: {unsigned_path}: signature: the module is not signed")
    code, _, err = hexir_run(signed_path, "--trust", tmp_path / "nothing.pem", *run)
    assert code == 2 and err == f"hexir-run: error: --trust {tmp_path / 'nothing.pem'}: No such file or directory\n"
    code, _, err = hexir_run(signed_path, "--trust", keys["alice"][0], "--info")
    assert code == 2 and "holds a private key" in err
    code, out, _ = hexir_run(signed_path, "--info")
    assert f"signed by     : key {key_id(alice)} (Ed25519, not verified: no --trust key given)\n" in out
    code, out, _ = hexir_run(signed_path, "--info", "--trust", alice)
    assert code == 0 and f"signed by     : key {key_id(alice)} (Ed25519, verified with {alice})\n" in out
    code, out, err = hexir_run(unsigned_path, "--info")
    assert code == 0 and "signed by     : nobody (unsigned)\n" in out
    assert hexir_run(unsigned_path, "--info", "--trust", alice)[0] == 1
    with pytest.raises(SystemExit) as exited:
        main([str(signed_path), "--trust"])
    assert exited.value.code == 2


# Run in a fresh Python: which cryptography modules get imported, and what a missing one says.
PROGRAM = """
import sys
if sys.argv[1] == "blocked":
    sys.modules["cryptography"] = None  # every import of it now fails
import numpy as np, hexir_runtime
from hexir_runtime import cli, describe, format, signing
signed, unsigned, public = sys.argv[2:5]
x = np.ones((2, 8), np.float32)
for path in (signed, unsigned):
    with hexir_runtime.load(path, "cpu") as module:
        module.layers(x)
print(describe.describe(format.read(signed), signed).splitlines()[4])
assert cli.main([signed, "--info"]) == 0
assert not [name for name in sys.modules if name.startswith("cryptography") and sys.modules[name]], "imported"
try:
    hexir_runtime.load(signed, "cpu", trusted_keys=[public]).close()
except hexir_runtime.KeyFileError as error:
    print("KeyFileError:", error)
else:
    print("verified:", "cryptography" in sys.modules)
print("exit", cli.main([signed, "--trust", public, "--info"]))
"""


@pytest.mark.parametrize("cryptography", ["installed", "blocked"])
def test_cryptography_is_imported_only_to_check_signatures(signed, unsigned, keys, tmp_path, cryptography):
    paths = [tmp_path / "signed.hxb", tmp_path / "unsigned.hxb"]
    for path, data in zip(paths, (signed, unsigned), strict=True):
        path.write_bytes(data)
    environment = {**os.environ, "PYTHONPATH": RUNTIME + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-c", PROGRAM, cryptography, *map(str, paths), str(keys["alice"][1])],
                            capture_output=True, text=True, env=environment)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"signed by     : key {key_id(keys['alice'][1])} (Ed25519, not verified: no --trust key given)"
    install = 'signed modules need the cryptography package: pip install "hexir-runtime[sign]"'
    if cryptography == "installed":
        assert "verified: True" in lines and lines[-1] == "exit 0"
    else:
        assert f"KeyFileError: {keys['alice'][1]}: {install}" in lines and lines[-1] == "exit 2"
        assert f"hexir-run: error: --trust {keys['alice'][1]}: {install}" in result.stderr
