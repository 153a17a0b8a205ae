"""Signing on the compiler's side (issue 28): `hexir.export(..., sign_with=KEY)` and
`hexir ... -emit=hxb -sign-with=KEY` write modules that `load(trusted_keys=...)` accepts; a key
that cannot sign is a bad argument, found before the compile."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hexir_runtime import UntrustedModuleError, load, signing

import hexir
from hexir.cli import main
from hexir.jit import JitFunction

from .conftest import MLP

W = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)
SPEC = hexir.TensorSpec((2, 8), "float32")


def layer(x):
    return hexir.relu(hexir.linear(x, W))


@pytest.fixture(scope="module")
def key_files(tmp_path_factory) -> tuple[Path, Path]:
    """An Ed25519 private key (PKCS8 PEM) and its public key (SubjectPublicKeyInfo PEM)."""
    folder, key = tmp_path_factory.mktemp("keys"), Ed25519PrivateKey.generate()
    private, public = folder / "signing.pem", folder / "signing.pub.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def test_export_signs(key_files, tmp_path):
    private, public = key_files
    x = np.linspace(-2, 2, 16, dtype=np.float32).reshape(2, 8)
    path = hexir.export(layer, tmp_path / "layer.hxb", SPEC, target="cpu:x86-64", sign_with=private)
    assert signing.signer(path.read_bytes()) == signing.trusted_keys(public)[0].id
    with load(path, "cpu", trusted_keys=[public]) as module:
        np.testing.assert_allclose(module.main(x), np.maximum(x @ W, 0), rtol=1e-6)
    key_object = serialization.load_pem_private_key(private.read_bytes(), None)
    again = hexir.export(layer, tmp_path / "again.hxb", SPEC, target="cpu:x86-64", sign_with=key_object)
    assert again.read_bytes() == path.read_bytes()  # the same module, the same key: the same bytes
    unsigned = hexir.export(layer, tmp_path / "plain.hxb", SPEC, target="cpu:x86-64")
    with pytest.raises(UntrustedModuleError, match="the module is not signed"):
        load(unsigned, "cpu", trusted_keys=public)


def test_export_with_a_key_that_cannot_sign(key_files, tmp_path, monkeypatch):
    def no_compile(*args, **kwargs):
        raise AssertionError("compiled before the key was checked")
    monkeypatch.setattr(JitFunction, "compile", no_compile)
    missing = tmp_path / "missing.pem"
    for key, text in [(missing, f"{missing}: No such file or directory"),
                      (key_files[1], f"{key_files[1]}: holds a public key; signing needs the private key"),
                      (42, "expected the path of a PEM file or an Ed25519 private key, got int")]:
        with pytest.raises(hexir.ArgumentError) as caught:
            hexir.export(layer, tmp_path / "out.hxb", SPEC, sign_with=key)
        assert caught.value.message.startswith(f"hexir.export: sign_with: {text}"), caught.value.message
        assert caught.value.where and caught.value.where.startswith(__file__)  # the user's line
    assert not (tmp_path / "out.hxb").exists()


def test_cli_sign_with(key_files, tmp_path, capsys):
    private, public = key_files
    output = tmp_path / "mlp.hxb"
    assert main([f"{MLP}:mlp", "-spec=x=2x8xf32", "-emit=hxb", f"-sign-with={private}", "-o", str(output),
                 "-target=cpu:x86-64"]) == 0
    load(output, "cpu", trusted_keys=[public]).close()
    capsys.readouterr()
    for key, text in [(tmp_path / "nothing.pem", "No such file or directory"), (public, "holds a public key")]:
        assert main([f"{MLP}:mlp", "-spec=x=2x8xf32", "-emit=hxb", "--sign-with", str(key),
                     "-o", str(tmp_path / "bad.hxb")]) == 2
        assert capsys.readouterr().err.startswith(f"hexir: error: -sign-with {key}: {text}")
    assert not (tmp_path / "bad.hxb").exists()
    with pytest.raises(SystemExit) as exited:
        main([f"{MLP}:mlp", "-spec=x=2x8xf32", "-emit=mlir", f"-sign-with={private}"])
    assert exited.value.code == 2
    assert "-sign-with signs modules: it needs -emit=hxb, not -emit=mlir" in capsys.readouterr().err
