"""Signed modules: an Ed25519 signature over every byte of a .hxb before it (docs/hxb-format.md, Signatures).

A signed file is a module whose header has the `signed` flag and whose last 112 bytes are a
signature record: magic, algorithm, the signer's raw public key, and the signature of the
file's bytes before the signature itself (header, manifest, blobs, padding and the record's
head). So no byte can change, no blob move, vanish or be re-pointed, and no record be swapped
without the signature failing; dropping the record means clearing the flag, which leaves an
unsigned module, refused wherever keys are required.

`load(..., trusted_keys=...)` verifies with `verify` before anything parses the manifest, let
alone maps code. `cryptography` (the `hexir-runtime[sign]` extra) is imported only where keys
are read: splitting off and describing a record, and loading a signed module without keys,
need numpy alone.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from .errors import HxbFormatError, KeyFileError, UntrustedModuleError
from .format import HEADER, MAGIC, SIGNED, decode

RECORD = struct.Struct("<8sII32s64s")  # magic, algorithm, reserved, public key, signature
RECORD_MAGIC = b"\x89HXBSIG\n"
ED25519 = 1  # the record's algorithm: Ed25519 over CONTEXT + SHA-256(the signed bytes)
CONTEXT = b"hexir .hxb signature 1\0"  # so that no other protocol's signature is a module's
SIGNATURE_SIZE = 64
_FLAGS = struct.Struct("<I")
_FLAGS_OFFSET = HEADER.size - _FLAGS.size
_KEY_FILE_LIMIT = 64 * 1024  # a PEM key is a few hundred bytes; do not read a wrong path's gigabytes
_INSTALL = 'signed modules need the cryptography package: pip install "hexir-runtime[sign]"'


def key_id(public_key: bytes) -> str:
    """A public key's short name: the first 8 bytes of the SHA-256 of its 32 raw bytes, in hex."""
    return hashlib.sha256(public_key).hexdigest()[:16]


@dataclass(frozen=True)
class Record:
    """A file's signature record: who signed (a raw Ed25519 public key) and the signature."""

    public_key: bytes
    signature: bytes

    @property
    def key_id(self) -> str:
        return key_id(self.public_key)


@dataclass(frozen=True)
class Key:
    """A key read for signing (`private` set) or trust: the key object, its raw public bytes and
    where it came from (a file name, or "a key object")."""

    public: Any  # Ed25519PublicKey
    raw: bytes
    source: str
    private: Any = None  # Ed25519PrivateKey

    @property
    def id(self) -> str:
        return key_id(self.raw)

    def __str__(self) -> str:
        return f"{self.id} ({self.source})"


def split(data: bytes) -> tuple[bytes, Record | None]:
    """The module without its signature record, and the record (None: not signed). Checks the
    record's form only; a header too broken to say is left whole for the format checks."""
    if len(data) < HEADER.size or not data.startswith(MAGIC) or not _flags(data) & SIGNED:
        return data, None
    if len(data) < HEADER.size + RECORD.size:
        raise HxbFormatError("signature", f"the header says the module is signed, but the file has only "
                                          f"{len(data)} bytes: truncated?")
    magic, algorithm, reserved, public_key, signature = RECORD.unpack_from(data, len(data) - RECORD.size)
    if magic != RECORD_MAGIC:
        raise HxbFormatError("signature.magic", "the header says the module is signed, but the file does not "
                                                "end with a signature record: truncated, or bytes appended?")
    if algorithm != ED25519:
        raise HxbFormatError("signature.algorithm", f"expected {ED25519} (Ed25519), got {algorithm}")
    if reserved:
        raise HxbFormatError("signature.reserved", f"expected 0, got {reserved}")
    return data[: len(data) - RECORD.size], Record(public_key, signature)


def signer(data: bytes) -> str | None:
    """The key id a (decoded) module says signed it, unverified; None if it is unsigned."""
    record = split(data)[1]
    return record.key_id if record else None


def verify(data: bytes, keys: Any) -> Key:
    """Check that `data` is signed by one of `keys` (as `trusted_keys` takes them) and unchanged
    since; return that key.

    Reads only the header's flag and the record: nothing of the manifest is parsed before the
    signature holds. Raises UntrustedModuleError (HxbFormatError for a file that is no module)."""
    keys = trusted_keys(keys)  # (keys read before pass through as they are)
    if not data.startswith(MAGIC):
        raise HxbFormatError("header.magic", "not a hexir module (bad magic)")
    record = split(data)[1]
    tried = ", ".join(map(str, keys))
    if record is None:
        raise UntrustedModuleError("signature", f"the module is not signed, and only modules signed by a trusted "
                                                f"key are loaded (trusted: {tried})")
    key = next((key for key in keys if key.raw == record.public_key), None)
    if key is None:
        raise UntrustedModuleError("signature", f"signed by key {record.key_id}, which is not trusted (trusted: "
                                                f"{tried})")
    from cryptography.exceptions import InvalidSignature  # present: `key` was read with it

    try:
        key.public.verify(record.signature, _message(memoryview(data)[:-SIGNATURE_SIZE]))
    except InvalidSignature:
        raise UntrustedModuleError("signature", f"the signature by key {key} does not verify: the file was "
                                                f"changed after it was signed") from None
    return key


def sign(data: bytes, key: Key) -> bytes:
    """`data`, a valid module (signed or not), signed with `key` (from `signing_key`)."""
    if key.private is None:
        raise TypeError(f"sign() needs a private key, got the public key {key}")
    body = bytearray(split(bytes(data))[0])  # signing again replaces the old signature
    if len(body) >= HEADER.size:
        body[_FLAGS_OFFSET:HEADER.size] = _FLAGS.pack(_flags(body) & ~SIGNED)
    decode(bytes(body))  # only a valid module is signed (HxbFormatError otherwise)
    body[_FLAGS_OFFSET:HEADER.size] = _FLAGS.pack(_flags(body) | SIGNED)
    body += RECORD.pack(RECORD_MAGIC, ED25519, 0, key.raw, bytes(SIGNATURE_SIZE))[:-SIGNATURE_SIZE]
    body += key.private.sign(_message(body))
    return bytes(body)


def trusted_keys(keys: Iterable[Any] | str | os.PathLike[str]) -> list[Key]:
    """Public keys to trust: paths of PEM files (SubjectPublicKeyInfo), Ed25519PublicKey objects
    or `Key`s read before (one, or an iterable of them). KeyFileError names a file that cannot be used."""
    single = isinstance(keys, (str, os.PathLike)) or not isinstance(keys, Iterable)  # a path, a key object
    result = [_key(item, private=False) for item in ([keys] if single else keys)]
    if not result:
        raise ValueError("trusted_keys is empty: give at least one key, or None to load modules unchecked")
    return result


def signing_key(key: Any) -> Key:
    """A private key to sign with: the path of a PEM file (PKCS8, `-----BEGIN PRIVATE KEY-----`)
    or an Ed25519PrivateKey. KeyFileError names a file that cannot be used."""
    return _key(key, private=True)


def _message(signed: bytes | bytearray | memoryview) -> bytes:
    return CONTEXT + hashlib.sha256(signed).digest()


def _flags(data: bytes | bytearray) -> int:
    return _FLAGS.unpack_from(data, _FLAGS_OFFSET)[0]


def _key(item: Any, private: bool) -> Key:
    kind = "private" if private else "public"
    if isinstance(item, Key) and (item.private is not None or not private):  # read before: reuse it
        return item
    if isinstance(item, (str, os.PathLike)) and isinstance(os.fspath(item), str):
        path = os.fspath(item)
        text = _read_key_file(path)
        crypto = _cryptography(path)
        key = _parse_pem(crypto, text, path, private)
        if not isinstance(key, crypto.private if private else crypto.public):
            raise KeyFileError(f"{path}: holds {_describe_key(key)}; hexir signs modules with Ed25519 keys "
                               f"(openssl genpkey -algorithm ed25519 -out KEY.pem)")
        source = path
    else:
        crypto = _cryptography("a key object")
        if not isinstance(item, crypto.private if private else crypto.public):
            raise TypeError(f"expected the path of a PEM file or an Ed25519 {kind} key, got {type(item).__name__}")
        key, source = item, "a key object"
    public = key.public_key() if private else key
    raw = public.public_bytes(crypto.Encoding.Raw, crypto.PublicFormat.Raw)
    return Key(public, raw, source, key if private else None)


def _read_key_file(path: str) -> bytes:
    try:
        with open(path, "rb") as file:
            text = file.read(_KEY_FILE_LIMIT + 1)
    except OSError as error:
        raise KeyFileError(f"{path}: {error.strerror or error}") from None
    if len(text) > _KEY_FILE_LIMIT:
        raise KeyFileError(f"{path}: {_KEY_FILE_LIMIT} bytes or more: not a key file")
    return text


def _parse_pem(crypto: SimpleNamespace, text: bytes, path: str, private: bool) -> Any:
    """The key in PEM `text`, with what is wrong said plainly: the other kind of key, an
    encrypted key, no PEM at all."""
    if private and b"PUBLIC KEY-----" in text:
        raise KeyFileError(f"{path}: holds a public key; signing needs the private key (PKCS8 PEM, "
                           f"-----BEGIN PRIVATE KEY-----)")
    if not private and b"PRIVATE KEY-----" in text:
        raise KeyFileError(f"{path}: holds a private key; trust the public key instead "
                           f"(openssl pkey -in {path} -pubout -out PUBLIC.pem)")
    try:
        if private:
            return crypto.serialization.load_pem_private_key(text, password=None)
        return crypto.serialization.load_pem_public_key(text)
    except TypeError:  # cryptography's word for an encrypted key read without a password
        raise KeyFileError(f"{path}: the private key is encrypted; hexir reads unencrypted PKCS8 PEM "
                           f"(openssl pkey -in {path} -out PLAIN.pem)") from None
    except (ValueError, crypto.UnsupportedAlgorithm):
        header = "PRIVATE KEY" if private else "PUBLIC KEY"
        raise KeyFileError(f"{path}: not a PEM {'private' if private else 'public'} key "
                           f"(-----BEGIN {header}-----)") from None


def _describe_key(key: Any) -> str:
    name = type(key).__name__.removeprefix("_").replace("PrivateKey", "").replace("PublicKey", "")
    return f"a key of another kind ({name or 'unknown'})"


def _cryptography(where: str) -> SimpleNamespace:
    """The parts of `cryptography` that keys need, imported on first use."""
    try:
        from cryptography.exceptions import UnsupportedAlgorithm
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
    except ImportError:
        raise KeyFileError(f"{where}: {_INSTALL}") from None
    return SimpleNamespace(serialization=serialization, Encoding=serialization.Encoding,
                           PublicFormat=serialization.PublicFormat, UnsupportedAlgorithm=UnsupportedAlgorithm,
                           private=Ed25519PrivateKey, public=Ed25519PublicKey)
