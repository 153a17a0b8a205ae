"""`hexir-run`: run an entry of a compiled hexir module (.hxb) from the command line.

Prints a header (module, version, entry, device), a `--` line, then what the program prints.
`--info` describes the module (describe.py) after checking its format, without loading any
code. When the reader of stdout goes away (`hexir-run m.hxb | head -1`), it stops quietly with exit code 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import numpy as np

from .describe import describe, field
from .errors import HexirRuntimeError, HxbFormatError, InputError
from .format import read
from .module import DEVICE_NAMES, Signature, load

EXIT_CODES = """exit codes:
  0  success
  1  the module could not be read, checked, loaded or run, or the inputs do not fit the entry
     (one line `hexir-run: <what>` on stderr); or, silently, stdout was closed before the run
     finished (as by `hexir-run m.hxb | head -1`)
  2  bad command-line arguments (usage on stderr)"""


def main(argv: list[str] | None = None) -> int:
    """Run `hexir-run` with `argv` (default: sys.argv[1:]); return the exit code."""
    args = _parser().parse_args(argv)
    try:
        if args.info:
            sys.stdout.write(describe(read(args.module), args.module))
        else:
            _run(args)
        sys.stdout.flush()  # a closed pipe fails here, not after main has returned
    except BrokenPipeError:  # the reader of stdout is gone (`| head`): stop quietly, as Unix tools do
        _discard_stdout()
        return 1
    except HxbFormatError as error:
        print(f"hexir-run: {args.module}: {error}", file=sys.stderr)
        return 1
    except HexirRuntimeError as error:
        print(f"hexir-run: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"hexir-run: {error.filename or args.module}: {error.strerror or error}", file=sys.stderr)
        return 1
    return 0


def _run(args: argparse.Namespace) -> None:
    """Load the module, print the header, run the entry and save its outputs."""
    with warnings.catch_warnings(record=True) as notices:
        warnings.simplefilter("always", RuntimeWarning)
        module = load(args.module, args.device)
    for notice in notices:  # e.g. --device=auto found no GPU: say so in one line
        print(f"hexir-run: note: {notice.message}", file=sys.stderr)
    arrays = _inputs(module.signature(args.entry), args.input)
    if not args.quiet:
        header = [("module", args.module), ("version", module.hxb.version), ("entry", args.entry)]
        for label, value in [*header, ("device", module.device_name)]:
            print(field(label, value))
        print("--", flush=True)
    outputs = module.run(args.entry, *arrays)
    if args.output:
        if not isinstance(outputs, tuple):
            outputs = () if outputs is None else (outputs,)
        np.savez(args.output, **{f"output{i}": output for i, output in enumerate(outputs)})


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
        description="Run an entry of a compiled hexir module (.hxb).",
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
        help="the value of input NAME, a .npy file (once per input)",
    )
    parser.add_argument("--output", metavar="FILE.npz", help="save the outputs as output0, output1, ...")
    parser.add_argument("--quiet", action="store_true", help="print only what the program prints")
    parser.add_argument("--info", action="store_true", help="check the file and describe it; load and run nothing")
    return parser


def _input_argument(text: str) -> tuple[str, str]:
    name, separator, path = text.partition("=")
    if not separator or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=FILE.npy, got {text!r}")
    return name, path


def _inputs(signature: Signature, pairs: list[tuple[str, str]]) -> list[np.ndarray]:
    names = [name for name, _ in signature.inputs]
    given = {}
    for name, path in pairs:
        if name not in names:
            known = ", ".join(names) or "none"
            raise InputError(f"{signature.name}(): no argument named {name!r} (arguments: {known})")
        if name in given:
            raise InputError(f"--input {name} is given twice")
        try:
            given[name] = np.load(path, allow_pickle=False)
        except (ValueError, EOFError) as error:
            raise InputError(f"--input {name}: {path} is not a .npy file ({error})") from None
    missing = [name for name in names if name not in given]
    if missing:
        raise InputError(f"{signature.name}(): missing --input for {', '.join(missing)}")
    return [given[name] for name in names]


if __name__ == "__main__":
    sys.exit(main())
