"""`hexir`: compile a traced Python function or a hexir `.mlir` file to any stage.

    hexir examples/mlp.py:mlp -spec=x=2x8xf32 -emit=mlir-tir
    hexir prog.mlir -emit=hxb -o prog.hxb -placement=hexir.linear=cuda -target=cuda:sm_90

Exit codes: 0 success; 1 the input could not be compiled (trace, verification or code
generation error; cannot read the input or write -o); 2 bad arguments (unknown stage,
placement, target or spec).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import traceback
from dataclasses import replace
from pathlib import Path

from mlir import ir

from hexir.dialects import make_context
from hexir.driver import STAGE_NAMES, Options, parse_placement, run_stage
from hexir.errors import ArgumentError, HexirError, InputFileError, PlacementError, TargetError
from hexir.frontend.tensor import TensorSpec
from hexir.jit import JitFunction
from hexir.target import parse_target


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hexir", description=__doc__.split("\n\n")[0],
        epilog="exit codes: 0 success, 1 compile or I/O failure, 2 bad arguments",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help="FILE.py:FUNCTION (a @hexir.jit or plain function) or FILE.mlir")
    parser.add_argument("-emit", required=True, choices=STAGE_NAMES, help="how far to compile, and what to print")
    parser.add_argument("-o", dest="output", help="write the result here (default: stdout; out.hxb for hxb)")
    parser.add_argument("-placement", default="", help="op=device,... e.g. hexir.linear=cuda,hexir.relu=cpu")
    parser.add_argument("-target", default="", help="cpu:x86-64[-v2|-v3|-v4], cuda:sm_XX (comma separated)")
    parser.add_argument("--kernel-search-path", "-kernel-search-path", action="append", default=[],
                        metavar="DIR", help="where custom kernels' files are looked for (repeatable)")
    parser.add_argument("-spec", action="append", default=[],
                        help="argument shapes of a Python function: [name=]2x8xf32, the first extent may be "
                        "a symbol: x=batchx8xf32 or x=?x8xf32 (? is batch) (repeat per argument)")
    return parser


def _parse_spec(text: str) -> tuple[str | None, TensorSpec]:
    """`[name=]DIMSxDTYPE`: DIMS are ints joined by x, the first may be a symbol (a name, or ?
    for batch); DTYPE is f32, f64, float32 or float64 (as TensorSpec spells them)."""
    name, _, spec = text.rpartition("=")
    match = re.fullmatch(r"(\?|[A-Za-z_][A-Za-z0-9_]*?|\d+)((?:x\d+)*)x(f32|f64|float32|float64)", spec)
    if not match:
        raise ArgumentError(f"-spec {text!r}: expected [name=]DIMSxDTYPE, e.g. x=2x8xf32 or x=batchx8xf32")
    first = match.group(1)
    shape = (None if first == "?" else int(first) if first.isdigit() else first,
             *(int(d) for d in match.group(2).split("x")[1:]))
    try:
        return name or None, TensorSpec(shape, match.group(3))
    except HexirError as error:
        raise ArgumentError(f"-spec {text!r}: {error.message}") from None


def _load_function(target: str) -> object:
    """The object FILE.py:NAME names, the file run as a script would be (its folder on the path)."""
    path_text, _, function_name = target.rpartition(":")
    path = Path(path_text)
    if not path.is_file():
        raise InputFileError(f"cannot read {path_text!r}: no such file")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    namespace = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        spec.loader.exec_module(namespace)
    except HexirError:
        raise
    except Exception as error:  # the user's file failed to run: say where, without our frames
        where = traceback.extract_tb(error.__traceback__)[-1]
        raise InputFileError(f"{path_text} failed to load: {type(error).__name__}: {error}",
                             f"{where.filename}:{where.lineno}") from None
    finally:
        sys.path.pop(0)
    fn = getattr(namespace, function_name, None)
    if fn is None:
        raise InputFileError(f"{path_text} defines no function {function_name!r}")
    if not callable(fn):
        raise InputFileError(f"{path_text}: {function_name!r} is a {type(fn).__name__}, not a function")
    return fn


def _trace_python(fn: object, function_name: str, specs: list[str], options: Options) -> ir.Module:
    jitted = JitFunction(fn, options)
    parsed = [_parse_spec(s) for s in specs]
    if len(parsed) != len(jitted.arg_names):
        raise ArgumentError(f"{function_name} takes {len(jitted.arg_names)} argument(s) "
                            f"({', '.join(jitted.arg_names)}); give one -spec for each, e.g. "
                            f"-spec={jitted.arg_names[0] if jitted.arg_names else 'x'}=2x8xf32")
    for (name, _), expected in zip(parsed, jitted.arg_names, strict=True):
        if name is not None and name != expected:
            raise ArgumentError(f"-spec names {name!r} where {function_name} has argument {expected!r}")
    return jitted.trace(*(s for _, s in parsed))


def _load_mlir(path_text: str) -> ir.Module:
    try:
        Path(path_text).open("rb").close()  # MLIR would say only "could not open"; the OS says why
    except OSError as error:
        raise InputFileError(f"cannot read {path_text!r}: {error.strerror}") from None
    context = make_context()
    with context:
        try:
            return ir.Module.parseFile(path_text)  # so locations, and errors, name the file
        except ir.MLIRError as error:
            raise InputFileError(f"{path_text}: not valid hexir IR:\n{error}") from None


def _options(args: argparse.Namespace, base: Options) -> Options:
    """`base` (a @hexir.jit's own options, or the defaults) with the command line's on top."""
    placement = parse_placement(args.placement) or base.placement
    return replace(base, placement=placement, target=parse_target(args.target, base.target),
                   kernel_search_path=(*base.kernel_search_path, *args.kernel_search_path))


def compile_input(args: argparse.Namespace) -> ir.Module | str | bytes:
    """Compile the command line's input to its -emit stage."""
    if args.input.endswith(".mlir"):
        options = _options(args, Options())
        module = _load_mlir(args.input)
    elif ":" in args.input:
        fn = _load_function(args.input)
        options = _options(args, fn.options if isinstance(fn, JitFunction) else Options())
        module = _trace_python(fn.fn if isinstance(fn, JitFunction) else fn, args.input.rpartition(":")[2],
                               args.spec, options)
    else:
        raise ArgumentError(f"input {args.input!r}: expected FILE.mlir or FILE.py:FUNCTION")
    return run_stage(module, args.emit, options)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        result = compile_input(args)
    except (ArgumentError, PlacementError, TargetError) as error:
        print(f"hexir: error: {error}", file=sys.stderr)
        return 2
    except HexirError as error:
        print(f"hexir: error: {error}", file=sys.stderr)
        return 1
    if isinstance(result, bytes):
        output = Path(args.output or "out.hxb")
        try:
            output.write_bytes(result)
        except OSError as error:
            print(f"hexir: error: cannot write {output}: {error.strerror}", file=sys.stderr)
            return 1
        print(f"wrote {output}", file=sys.stderr)
        return 0
    text = str(result)
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as error:
            print(f"hexir: error: cannot write {args.output}: {error.strerror}", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
