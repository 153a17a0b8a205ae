"""The errors hexir raises: one class per kind, each naming what went wrong and where.

Every error a user can provoke is a `HexirError`; a traceback from inside MLIR is a bug.
Errors that come from a traced op carry the user's line (`where`, `file:line`) and its
source text (`source`); errors from a `.mlir` file carry `file:line:column`.
"""

from __future__ import annotations


class HexirError(Exception):
    """Base class of every error hexir reports to a user, printed as

        file:line: message
            the user's source line
    """

    def __init__(self, message: str, where: str | None = None, source: str | None = None):
        self.message = message
        self.where = where
        self.source = source
        text = f"{where}: {message}" if where else message
        super().__init__(f"{text}\n    {source}" if source else text)


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


class ArgumentError(HexirError):
    """A command-line argument or API option is malformed (the `hexir` command exits 2)."""
