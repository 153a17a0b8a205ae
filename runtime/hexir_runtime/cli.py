"""`hexir-run`: run an entry of a compiled hexir module (.hxb) from the command line.

Prints a header (module, version, entry, device), a `--` line, what the program prints, then
each output: `output0: float32[3, 4]` and its values as numpy summarises them (`--full`: all).
`--quiet` prints only what the program prints. `--info` describes the module (describe.py)
after checking its format, without loading any code. `--trust KEYFILE` (repeatable) accepts
only a module signed by one of the keys, checked before anything else reads it (signing.py).

Every path is checked before any work (the module is read once, inputs are loaded, the output's
folder must exist), and a file that is not what it should be is named for what it is (an empty
file, a .hxb, an .npz, pickled data). Every failure is one line on stderr, its text from the file
escaped (describe.safe), and exit code 1; bad arguments exit 2. When the reader of stdout goes
away (`hexir-run m.hxb | head -1`), it stops quietly with exit code 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
import zipfile

import numpy as np

from . import __version__, signing
from .describe import describe, field, safe
from .errors import HexirRuntimeError, HxbFormatError, InputError, KeyFileError
from .format import MAGIC, decode, numpy_dtype
from .module import DEVICE_NAMES, load

EXIT_CODES = """exit codes:
  0  success
  1  the module could not be read, checked, loaded or run, or the inputs do not fit the entry
     (one line `hexir-run: <what>` on stderr); or, silently, stdout was closed before the run
     finished (as by `hexir-run m.hxb | head -1`)
  2  bad command-line arguments (usage on stderr), or a --trust key file that cannot be used"""


def main(argv: list[str] | None = None) -> int:
    """Run `hexir-run` with `argv` (default: sys.argv[1:]); return the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # `hexir-run serve MODEL.hxb ...` (a module file named serve: ./serve)
        from .serving.command import main as serve

        return serve(argv[1:])
    args = _parser().parse_args(argv)
    try:
        keys = signing.trusted_keys(args.trust) if args.trust else None
    except KeyFileError as error:  # a key the user named: a bad argument, found before any work
        print(f"hexir-run: error: --trust {safe(str(error))}", file=sys.stderr)
        return 2
    try:
        data = _read_module(args.module)
        verified = signing.verify(data, keys) if keys else None  # before anything else reads the file
        if args.info:
            sys.stdout.write(describe(decode(data), args.module, verified))
        else:
            _run(args, data)
        sys.stdout.flush()  # a closed pipe fails here, not after main has returned
    except BrokenPipeError:  # the reader of stdout is gone (`| head`): stop quietly, as Unix tools do
        _discard_stdout()
        return 1
    except HxbFormatError as error:
        return _fail(f"{args.module}: {error}")
    except HexirRuntimeError as error:
        return _fail(str(error))
    except OSError as error:
        return _fail(f"{error.filename or args.module}: {error.strerror or error}")
    except (MemoryError, RecursionError) as error:  # a module too big for this machine: still one line
        return _fail(f"{args.module}: {type(error).__name__} {error}".rstrip())
    return 0


def _fail(message: str) -> int:
    print(f"hexir-run: {safe(message)}", file=sys.stderr)
    return 1


def _read_module(path: str) -> bytes:
    with open(path, "rb") as file:
        data = file.read()
    if not data:
        raise InputError(f"{path}: empty file (not a hexir module)")
    return data


def _run(args: argparse.Namespace, data: bytes) -> None:
    """Check the paths, load the module, print the header, run the entry, print and save its outputs."""
    given = _load_inputs(args.input)
    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise InputError(f"--output {args.output}: the folder {os.path.dirname(args.output) or '.'} does not exist")
    with warnings.catch_warnings(record=True) as notices:
        warnings.simplefilter("always", RuntimeWarning)
        module = load(data, args.device)
    for notice in notices:  # e.g. --device=auto found no GPU: say so in one line
        print(f"hexir-run: note: {safe(str(notice.message))}", file=sys.stderr)
    signature = module.signature(args.entry)
    names = [name for name, _ in signature.inputs]
    for name in given:
        if name not in names:
            known = ", ".join(names) or "none"
            raise InputError(f"{signature.name}(): no argument named {name!r} (arguments: {known})")
    missing = [name for name in names if name not in given]
    if missing:
        raise InputError(f"{signature.name}(): missing --input for {', '.join(missing)}")
    for name, tensor in signature.inputs:  # np.save writes ml_dtypes' bfloat16 as raw 2-byte values
        array = given[name]
        if array.dtype.kind == "V" and array.dtype.itemsize == 2 and array.dtype.names is None:
            if tensor.dtype != "bfloat16":
                raise InputError(f"--input {name}: the file holds raw 2-byte values (how np.save writes "
                                 f"ml_dtypes' bfloat16), but {name} is {tensor}")
            given[name] = array.view(numpy_dtype("bfloat16"))
    if not args.quiet:
        header = [("module", safe(args.module)), ("version", module.hxb.version), ("entry", args.entry)]
        for label, value in [*header, ("device", module.device_name)]:
            print(field(label, value))
        print("--", flush=True)
    outputs = module.run(args.entry, *(given[name] for name in names))
    if not isinstance(outputs, tuple):
        outputs = () if outputs is None else (outputs,)
    sys.stdout.flush()  # the program's prints first
    if not args.quiet:
        threshold = sys.maxsize if args.full else 1000  # numpy's own summarising threshold
        for i, output in enumerate(outputs):
            print(f"output{i}: {output.dtype}[{', '.join(map(str, output.shape))}]")
            print(np.array2string(output, threshold=threshold, max_line_width=100))
    if args.output:
        with open(args.output, "wb") as file:  # np.savez would append .npz to a name
            np.savez(file, **{f"output{i}": output for i, output in enumerate(outputs)})


def _load_inputs(pairs: list[tuple[str, str]]) -> dict[str, np.ndarray]:
    """The arrays of `--input NAME=FILE.npy` (or NAME=FILE.npz:KEY), by name."""
    given: dict[str, np.ndarray] = {}
    for name, path in pairs:
        if name in given:
            raise InputError(f"--input {name} is given twice")
        key = None
        if not os.path.exists(path) and ":" in path and os.path.exists(path.rpartition(":")[0]):
            path, _, key = path.rpartition(":")
        given[name] = _load_array(name, path, key)
    return given


def _load_array(name: str, path: str, key: str | None) -> np.ndarray:
    with open(path, "rb") as file:
        head = file.read(8)
    what = f"--input {name}: {path}"
    if not head:
        raise InputError(f"{what}: empty file (expected a .npy array)")
    if head.startswith(MAGIC[:4]):
        raise InputError(f"{what} is a hexir module (.hxb), not a .npy array")
    if head.startswith(b"PK\x03\x04"):  # a zip: .npz
        try:
            with np.load(path, allow_pickle=False) as archive:
                if key is None or key not in archive.files:
                    keys = ", ".join(archive.files) or "none"
                    advice = f"no array {key!r} in it" if key is not None else f"use {name}=FILE.npz:KEY"
                    raise InputError(f"{what} is an .npz archive (arrays: {keys}): {advice}")
                return archive[key]
        except (ValueError, OSError, zipfile.BadZipFile, EOFError) as error:
            raise InputError(f"{what}: not a readable .npz archive ({error})") from None
    if key is not None:
        raise InputError(f"{what}: only an .npz archive has arrays by KEY")
    if head[:1] == b"\x80":
        raise InputError(f"{what} holds pickled Python data, not a .npy array")
    if not head.startswith(b"\x93NUMPY"):
        raise InputError(f"{what} is not a .npy file (it starts with {head!r})")
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as error:
        if "pickle" in str(error):
            raise InputError(f"{what} holds an object array (pickled data), which hexir-run does not load") from None
        raise InputError(f"{what} is not a valid .npy file ({error})") from None
    except EOFError as error:
        raise InputError(f"{what} is a truncated .npy file ({error})") from None


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that what is still buffered does not fail again at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is no file (captured, replaced): nothing is flushed at exit
        pass


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hexir-run",
        description="Run an entry of a compiled hexir module (.hxb). To serve modules over HTTP: "
                    "hexir-run serve --help.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("module", help="the .hxb file")
    parser.add_argument(
        "--device", choices=DEVICE_NAMES, default="auto",
        help="where kernels run: cpu (CUDA kernels as their cpu fallbacks), cuda, auto (cuda if "
        "the module has CUDA kernels and a GPU is usable, else cpu) or reference (numpy, the oracle); "
        "default auto",
    )
    parser.add_argument("--entry", default="main", help="the entry to run (default main)")
    parser.add_argument(
        "--input", action="append", default=[], type=_input_argument, metavar="NAME=FILE.npy",
        help="the value of input NAME: a .npy file, or NAME=FILE.npz:KEY (once per input)",
    )
    parser.add_argument("--output", metavar="FILE", help="save the outputs (output0, output1, ...) to this .npz file")
    parser.add_argument("--quiet", action="store_true", help="print only what the program prints")
    parser.add_argument("--full", action="store_true", help="print every value of the outputs (not a summary)")
    parser.add_argument("--info", action="store_true", help="check the file and describe it; load and run nothing")
    parser.add_argument(
        "--trust", action="append", default=[], metavar="KEYFILE",
        help="load the module only if it is signed by this key (an Ed25519 public key in PEM; repeat to trust "
        "several); the signature is checked before anything else",
    )
    parser.add_argument("--version", action="version", version=f"hexir-run (hexir_runtime) {__version__}")
    return parser


def _input_argument(text: str) -> tuple[str, str]:
    name, separator, path = text.partition("=")
    if not separator or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=FILE.npy, got {text!r}")
    return name, path


if __name__ == "__main__":
    sys.exit(main())
