"""The errors hexir raises: one class per kind, each naming what went wrong and where.

Every error a user can provoke is a `HexirError`; a traceback from inside MLIR is a bug.
Errors that come from a traced op carry the user's line (`where`, `file:line`) and its
source text (`source`); errors from a `.mlir` file carry `file:line:column`.
"""

from __future__ import annotations

import inspect
import linecache
import os

import numpy as np

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# numpy's own frames are not the user's line either (np.sum(x) on a tensor goes through them)
_SKIPPED = (_PACKAGE_DIR + os.sep, os.path.dirname(os.path.abspath(np.__file__)) + os.sep)


def user_frame() -> inspect.FrameInfo | None:
    """The innermost frame outside the hexir package: the line the user wrote."""
    frame = inspect.currentframe()
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        # a dataclass's generated __init__ (hexir.Pointwise(...) checks its fields) is no user line
        generated = frame.f_code.co_filename == "<string>" and frame.f_code.co_name == "__init__"
        if not path.startswith(_SKIPPED) and "typeguard" not in path and not generated:
            return inspect.getframeinfo(frame, context=0)
        frame = frame.f_back
    return None


def user_where() -> tuple[str | None, str | None]:
    """`file:line` of the user's line and its source text (None for what cannot be found);
    an error takes both: `TraceError(message, *user_where())`."""
    info = user_frame()
    if info is None:
        return None, None
    source = linecache.getline(info.filename, info.lineno).strip()
    return f"{info.filename}:{info.lineno}", source or None


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
