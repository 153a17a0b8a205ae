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
from pathlib import Path

from mlir import ir

from hexir.dialects import make_context
from hexir.errors import CompileError, HexirError, InputFileError, PlacementError, TargetError
from hexir.frontend.jit import JitFunction
from hexir.frontend.tensor import TensorSpec
from hexir.passes.pipeline import STAGES, Options, parse_placement, parse_target, run_stage

_DTYPES = {"f32": "float32", "f64": "float64"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hexir", description=__doc__.split("\n\n")[0],
        epilog="exit codes: 0 success, 1 compile or I/O failure, 2 bad arguments",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help="FILE.py:FUNCTION (a @hexir.jit or plain function) or FILE.mlir")
    parser.add_argument("-emit", required=True, choices=STAGES, help="how far to compile, and what to print")
    parser.add_argument("-o", dest="output", help="write the result here (default: stdout; out.hxb for hxb)")
    parser.add_argument("-placement", default="", help="op=device,... e.g. hexir.linear=cuda,hexir.relu=cpu")
    parser.add_argument("-target", default="", help="cpu:x86-64[-v2|-v3|-v4], cuda:sm_XX (comma separated)")
    parser.add_argument("--kernel-search-path", "-kernel-search-path", action="append", default=[],
                        metavar="DIR", help="where custom kernels' files are looked for (repeatable)")
    parser.add_argument("-spec", action="append", default=[],
                        help="argument shapes of a Python function: [name=]2x8xf32 (repeat per argument)")
    return parser


def _parse_spec(text: str) -> tuple[str | None, TensorSpec]:
    name, _, spec = text.rpartition("=")
    match = re.fullmatch(r"((?:\d+x)*\d+)x(f32|f64)", spec)
    if not match:
        raise PlacementError(f"-spec {text!r}: expected [name=]DIMSxDTYPE, e.g. x=2x8xf32")
    shape = tuple(int(d) for d in match.group(1).split("x"))
    return name or None, TensorSpec(shape, _DTYPES[match.group(2)])


def _load_python(target: str, specs: list[str], options: Options) -> ir.Module:
    path_text, _, function_name = target.rpartition(":")
    path = Path(path_text)
    if not path.is_file():
        raise InputFileError(f"cannot read {path_text!r}: no such file")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    namespace = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        spec.loader.exec_module(namespace)
    finally:
        sys.path.pop(0)
    fn = getattr(namespace, function_name, None)
    if fn is None:
        raise InputFileError(f"{path_text} defines no function {function_name!r}")
    jitted = JitFunction(fn.fn if isinstance(fn, JitFunction) else fn, options)
    parsed = [_parse_spec(s) for s in specs]
    if len(parsed) != len(jitted.arg_names):
        raise PlacementError(f"{function_name} takes {len(jitted.arg_names)} argument(s) "
                             f"({', '.join(jitted.arg_names)}); give one -spec for each, e.g. "
                             f"-spec={jitted.arg_names[0] if jitted.arg_names else 'x'}=2x8xf32")
    for (name, _), expected in zip(parsed, jitted.arg_names, strict=True):
        if name is not None and name != expected:
            raise PlacementError(f"-spec names {name!r} where {function_name} has argument {expected!r}")
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


def compile_input(args: argparse.Namespace) -> ir.Module | str | bytes:
    options = parse_target(args.target, Options(placement=parse_placement(args.placement),
                                                kernel_search_path=tuple(args.kernel_search_path)))
    if args.input.endswith(".mlir"):
        module = _load_mlir(args.input)
    elif ":" in args.input:
        module = _load_python(args.input, args.spec, options)
    else:
        raise PlacementError(f"input {args.input!r}: expected FILE.mlir or FILE.py:FUNCTION")
    return run_stage(module, args.emit, options)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        result = compile_input(args)
    except (PlacementError, TargetError) as error:
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

__all__ = ["main", "CompileError"]
