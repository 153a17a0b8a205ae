"""`hexir`: compile a traced Python function or a hexir `.mlir` file to any stage.

    hexir examples/mlp.py:mlp -spec=x=2x8xf32 -emit=mlir-tir
    hexir prog.mlir -emit=hxb -o prog.hxb -placement=hexir.linear=cuda -target=cuda:sm_90

Exit codes: 0 success; 1 the input could not be compiled (trace, verification or code
generation error; cannot read the input or write -o); 2 bad arguments (unknown stage,
placement, target or spec; a -sign-with key that cannot sign).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import sys
import traceback
from dataclasses import replace
from pathlib import Path

from hexir_runtime import KeyFileError, signing
from mlir import ir

from hexir.dialects import make_context
from hexir.driver import MATMUL_PRECISIONS, STAGE_NAMES, Options, parse_placement, run_stage
from hexir.errors import ArgumentError, HexirError, InputFileError, PlacementError, TargetError, TraceError
from hexir.explain import placed_dot
from hexir.frontend.tensor import TensorSpec
from hexir.jit import JitFunction
from hexir.target import parse_target
from hexir.version import __version__

#: What -emit takes: the pipeline's stages, and the placement picture.
EMIT_NAMES = (*STAGE_NAMES, *(() if "dot" in STAGE_NAMES else ("dot",)))
#: Constants with more elements than this are elided in printed IR (unless --keep-constants).
ELIDE = 16


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hexir", description=__doc__.split("\n\n")[0],
        epilog="every option takes -flag or --flag; exit codes: 0 success, 1 compile or I/O failure, 2 bad arguments",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help="FILE.py:FUNCTION (a @hexir.jit or plain function) or FILE.mlir")
    for spelling in ("-emit", "--emit"):  # two actions, so that messages name the spelling used
        parser.add_argument(spelling, dest="emit", choices=EMIT_NAMES, help=argparse.SUPPRESS if spelling == "--emit"
                            else "how far to compile, and what to print (dot: the placed graph in Graphviz DOT)")
    parser.add_argument("-o", "--output", "-output", dest="output",
                        help="write the result here (default: stdout; out.hxb for hxb)")
    parser.add_argument("-placement", "--placement", default="",
                        help="op=device,... e.g. hexir.linear=cuda,hexir.relu=cpu")
    parser.add_argument("-target", "--target", default="", help="cpu:x86-64[-v2|-v3|-v4], cuda:sm_XX (comma separated)")
    parser.add_argument("-matmul-precision", "--matmul-precision", dest="matmul_precision", default=None,
                        choices=MATMUL_PRECISIONS, help="float32 linears and matmuls: highest (float32, the default) "
                        "or tf32 (cuda tensor cores, inputs rounded to TF32; the cpu computes float32)")
    parser.add_argument("--kernel-search-path", "-kernel-search-path", action="append", default=[],
                        metavar="DIR", help="where custom kernels' files are looked for (repeatable)")
    parser.add_argument("-spec", "--spec", action="append", default=[],
                        help="one per argument of a Python function: a tensor [name=]2x8xf32 (the first extent may "
                        "be a symbol: x=batchx8xf32, or ? for batch) or a static value name=3.0, name='fast'")
    parser.add_argument("--keep-constants", "-keep-constants", action="store_true",
                        help=f"print every constant of IR text on stdout (by default those over {ELIDE} "
                        "elements are elided; -o files keep them all, so that they can be compiled further)")
    parser.add_argument("-sign-with", "--sign-with", dest="sign_with", metavar="KEYFILE",
                        help="-emit=hxb: sign the module with this Ed25519 private key (PKCS8 PEM)")
    parser.add_argument("--version", "-version", action="version", version=f"hexir {__version__}")
    return parser


def _parse_spec(text: str) -> tuple[str | None, TensorSpec | object]:
    """`[name=]DIMSxDTYPE`: DIMS are ints or symbols (names without an x; ? first for batch)
    joined by x (`batchxseqx64xf32`); DTYPE is f32, f64, bf16, f16, i32, i64 or a numpy name (as TensorSpec
    spells them). Anything else after `name=` is a static value, a Python literal (3.0, 'fast',
    (1, 2), None)."""
    name, _, spec = text.partition("=") if re.match(r"[A-Za-z_][A-Za-z0-9_]*=", text) else ("", "", text)
    dim = r"(?:\?|\d+|[A-Za-wyzA-Z_][A-Za-wyzA-Z0-9_]*)"
    dtype = "f32|f64|bf16|f16|i32|i64|float32|float64|bfloat16|float16|int32|int64"
    match = re.fullmatch(rf"({dim}(?:x{dim})*)x({dtype})", spec)
    if not match:
        try:
            return name or None, ast.literal_eval(spec)
        except (ValueError, SyntaxError):
            raise ArgumentError(f"-spec {text!r}: expected [name=]DIMSxDTYPE, e.g. x=2x8xf32 or "
                                "x=batchxseqx64xf32 (symbols: names without an x), or name=VALUE for a static "
                                "argument (a Python literal: 3.0, 'fast')") from None
    dims = match.group(1).split("x")
    shape = tuple(None if d == "?" and i == 0 else int(d) if d.isdigit() else d for i, d in enumerate(dims))
    try:
        return name or None, TensorSpec(shape, match.group(2))
    except HexirError as error:
        raise ArgumentError(f"-spec {text!r}: {error.message}") from None


def _check_input(path: Path) -> None:
    """Say what is wrong with an input file before any work: missing, a folder, empty, an .hxb."""
    if not path.exists():
        raise InputFileError(f"cannot read '{path}': no such file")
    if path.is_dir():
        raise InputFileError(f"cannot read '{path}': it is a folder, not a file")
    with path.open("rb") as file:
        head = file.read(8)
    if not head:
        raise InputFileError(f"cannot read '{path}': the file is empty")
    if head == b"\x89HXB\r\n\x1a\n":
        raise InputFileError(f"'{path}' is a compiled module (.hxb), not a program: run it with hexir-run")


def _load_function(target: str) -> object:
    """The object FILE.py:NAME names, the file run as a script would be (its folder on the path)."""
    path_text, _, function_name = target.rpartition(":")
    path = Path(path_text)
    _check_input(path)
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
    positional = [value for name, value in parsed if name is None]
    named = {name: value for name, value in parsed if name is not None}
    required = [p.name for p in jitted.signature.parameters.values() if p.default is p.empty]
    if len(parsed) > len(jitted.arg_names) or len(positional) + len(named) < len(required):
        raise ArgumentError(f"{function_name} takes {len(jitted.arg_names)} argument(s) "
                            f"({', '.join(jitted.arg_names)}); give one -spec for each, e.g. "
                            f"-spec={jitted.arg_names[0] if jitted.arg_names else 'x'}=2x8xf32")
    for position, name in enumerate(named):
        if name not in jitted.arg_names:
            expected = jitted.arg_names[len(positional) + position] if len(positional) + position < len(
                jitted.arg_names) else ", ".join(jitted.arg_names)
            raise ArgumentError(f"-spec names {name!r} where {function_name} has argument {expected!r}")
    try:
        return jitted.trace(*positional, **named)
    except TraceError as error:
        if error.message.startswith(f"{fn.__qualname__}()"):  # the binding of the specs, not the trace
            raise ArgumentError(f"-spec: {error.message}") from None
        raise


def _load_mlir(path_text: str) -> ir.Module:
    try:
        _check_input(Path(path_text))  # MLIR would say only "could not open"; the OS says why
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
                   kernel_search_path=(*base.kernel_search_path, *args.kernel_search_path),
                   matmul_precision=args.matmul_precision or base.matmul_precision)


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
        if Path(args.input).exists():
            _check_input(Path(args.input))  # a folder, an empty file, an .hxb: say so first
        raise ArgumentError(f"input {args.input!r}: expected FILE.mlir or FILE.py:FUNCTION")
    if args.emit == "dot":
        return placed_dot(module, options)
    return run_stage(module, args.emit, options)


def _text(result: ir.Module | str, keep_constants: bool) -> str:
    """The text of a stage's result; a module's constants over ELIDE elements elided unless kept."""
    if not isinstance(result, ir.Module):
        return str(result)
    text = result.operation.get_asm(large_elements_limit=None if keep_constants else ELIDE)
    if "dense_resource<__elided__>" in text:
        text = (f"// hexir: constants over {ELIDE} elements are elided (dense_resource<__elided__>): this text "
                "cannot be parsed back; --keep-constants prints them\n" + text)
    return text


def _error(message: str, code: int) -> int:
    """Say what went wrong (on stderr) and give the exit code."""
    print(f"hexir: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.emit is None:
        parser.error("the following argument is required: -emit (or --emit)")
    if args.sign_with is not None and args.emit != "hxb":
        parser.error(f"-sign-with signs modules: it needs -emit=hxb, not -emit={args.emit}")
    output = Path(args.output or ("out.hxb" if args.emit == "hxb" else "."))
    if args.output and output.is_dir() or not output.parent.is_dir():  # before the work, not after it
        return _error(f"cannot write {output}: " + ("is a folder" if output.is_dir() else
                                                    f"the folder {output.parent} does not exist"), 1)
    for folder in args.kernel_search_path:
        if not Path(folder).is_dir():
            return _error(f"--kernel-search-path {folder}: no such folder", 1)
    try:
        key = None if args.sign_with is None else signing.signing_key(args.sign_with)
    except KeyFileError as error:
        return _error(f"-sign-with {error}", 2)
    try:
        result = compile_input(args)
    except HexirError as error:
        return _error(str(error), 2 if isinstance(error, (ArgumentError, PlacementError, TargetError)) else 1)
    if isinstance(result, bytes):
        data = result if key is None else signing.sign(result, key)
    else:
        text = _text(result, args.keep_constants or bool(args.output))  # a file is for resuming: complete
        if not args.output:
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
            return 0
        data = text.encode()
    try:
        output.write_bytes(data)
    except OSError as error:
        return _error(f"cannot write {output}: {error.strerror}", 1)
    if isinstance(result, bytes):
        print(f"wrote {output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
