"""The runtime's errors: one base class, one subclass per kind of failure.

Every message says what was expected and what was found, so `hexir-run` can print it as is.
"""


class HexirRuntimeError(Exception):
    """Base class of every error the runtime raises on purpose."""


class HxbFormatError(HexirRuntimeError):
    """A .hxb file breaks a rule of docs/hxb-format.md; `field` is the path of the culprit."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class UntrustedModuleError(HxbFormatError):
    """Trusted keys were given and the module is unsigned, signed by a key not among them, or its
    signature does not verify (a byte changed after signing); `field` is "signature"."""


class KeyFileError(HexirRuntimeError):
    """A signing or trusted key cannot be used: its file is unreadable or holds no Ed25519 key of
    the right kind (the message names the file), or the `cryptography` package is missing."""


class InputError(HexirRuntimeError):
    """An entry was called with the wrong number, type, dtype or shape of arguments."""


class DeviceError(HexirRuntimeError):
    """The requested device cannot run this module (missing, wrong arch, CPU features...)."""


class KernelError(HexirRuntimeError):
    """A kernel cannot be found or launched."""
