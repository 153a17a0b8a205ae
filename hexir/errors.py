"""The errors hexir raises: one class per kind, each naming what went wrong and where.

Every error a user can provoke is a `HexirError`; a traceback from inside MLIR is a bug.
Errors that come from a traced op carry the user's source line (`where`).
"""

from __future__ import annotations


class HexirError(Exception):
    """Base class of every error hexir reports to a user."""

    def __init__(self, message: str, where: str | None = None):
        self.message = message
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


class TraceError(HexirError):
    """An op was used with operands it cannot take (rank, shape, dtype, type)."""


class PlacementError(HexirError):
    """A placement names an unknown op or device, or one an op cannot run on."""


class TargetError(HexirError):
    """A compile target (`-target=`) is malformed or unsupported."""


class CompileError(HexirError):
    """Lowering or code generation failed; the message carries the tool's output."""


class InputFileError(HexirError):
    """A `.mlir` or Python input to the `hexir` command could not be used."""
