"""The `hexir` dialect: the graph level — what to compute, on tensors with value semantics.

Ops (generic form, as IRDL prints them):

    %w = "hexir.constant"() {name = "W1", value = dense<...> : tensor<8x16xf32>, device = "auto"}
    %y = "hexir.linear"(%x, %w[, %b]) {device = "cuda"}   // x[M,K] @ w[K,N] (+ b[N])
    %r = "hexir.relu"(%y) {device = "auto"}               // max(y, 0)
    "hexir.print"(%r)                                      // host I/O, always on the cpu
    %t = "hexir.transfer"(%y) {source = "cuda", target = "cpu"}  // inserted by partition
    %z = "hexir.call"(%x, %w) {callee = @linear_0, device = "cpu"} // after lower-to-tir (1-4 args)
    %c = "hexir.custom_call"(%x) {kernel = "relu6", objects = {cuda = "/abs/relu6.cu"},
                                  grid = array<i64: 4, 1, 1>, block = array<i64: 256, 1, 1>, device = "auto"}

The compute ops (linear, relu, ...) are not written here: each is defined by its registration
in `hexir/ops.py` (`define_op` adds its IRDL definition), so adding one touches one place.
`device` is "auto" until the partition pass decides "cpu" or "cuda".

A symbolic extent (a size known only at run time) is `?` in the tensor type, and the type's
encoding names each, in order: `tensor<?x?x64xf32, "batch,seq">`. Any axis may be symbolic.
Two tensors with the same symbol have the same extent there, and the types compare equal only
when their symbols do.

Every attribute name of the graph level, and its accessor, is here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import ml_dtypes  # noqa: F401 - gives numpy the name "bfloat16"
import numpy as np
from mlir import ir

from hexir.dialects.irdl_text import call_operands, one_of
from hexir.errors import CompileError, TraceError

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "float64", "bfloat16", "float16")
#: The 16-bit floats: stored in 16 bits, computed in float32 (as torch does).
HALVES = ("bfloat16", "float16")
#: IRDL gives every operand of a variadic group one type, so calls (and pointwise and reduce
#: ops) take up to eight operands of their own types, as one required and seven optional groups.
MAX_CALL_ARGS = 8
#: What an op may produce: floats; int64 as an argmax's result; int32 and int64 moved by layout ops.
RESULT_DTYPES = (*DTYPES, "int32", "int64")

# Attribute names of the graph level.
ARG_NAMES = "hexir.arg_names"      # on @main: the traced function's parameter names
RESULT_FORM = "hexir.result_form"  # on @main: how the function returned ("none", "single", "tuple", "list")
EXPR = "expr"                      # on a pointwise or reduce op: its tree (or program) as JSON
EPILOGUE = "hexir.epilogue"        # on a linear: the tree applied to its sums (+ bias) as they are stored
W_PANELS = "hexir.w_panels"        # on a cpu linear: its w is a constant packed in panels (pack-weights)
W_KMAJOR = "hexir.w_kmajor"        # on a cuda TF32 linear: its w is a constant given transposed, [N, K] (pack-weights)

_DEVICE = one_of("device", ("auto", *DEVICES))
_compute_ops: dict[str, tuple[str, ...]] = {}
_family_ops: set[str] = set()


def define_op(name: str, operands: Sequence[str], family: str = "contract") -> None:
    """Add the compute op `hexir.<name>` to the dialect: named tensor operands (a trailing `?`
    marks an optional one), one tensor result, a `device` attribute; a pointwise or reduce op
    takes 1 to MAX_CALL_ARGS tensors (numbers are folded into its tree) and an `expr`."""
    _compute_ops[name] = tuple(operands)
    if family != "contract":
        _family_ops.add(name)


def compute_ops() -> tuple[str, ...]:
    """The full names of the defined compute ops ("hexir.linear", ...)."""
    return tuple(f"hexir.{name}" for name in _compute_ops)


def _compute_irdl(name: str, operands: tuple[str, ...]) -> str:
    if name in _family_ops:
        return "\n".join([f"  irdl.operation @{name} {{", call_operands(MAX_CALL_ARGS), _DEVICE,
                          '    %expr = irdl.base "#builtin.string"',
                          '    irdl.attributes {"device" = %device, "expr" = %expr}', "  }"])
    lines = [f"  irdl.operation @{name} {{"]
    lines += [f'    %{o.rstrip("?")} = irdl.base "!builtin.tensor"' for o in operands]
    listed = ", ".join(f"{o.rstrip('?')}: {'optional ' if o.endswith('?') else ''}%{o.rstrip('?')}" for o in operands)
    lines += ['    %result = irdl.base "!builtin.tensor"', f"    irdl.operands({listed})",
              "    irdl.results(result: %result)", _DEVICE, '    irdl.attributes {"device" = %device}', "  }"]
    return "\n".join(lines)


def irdl() -> str:
    """The dialect's IRDL text: the fixed ops and every defined compute op."""
    compute = "\n".join(_compute_irdl(name, operands) for name, operands in _compute_ops.items())
    return f"""
irdl.dialect @hexir {{
  irdl.operation @constant {{
    %value = irdl.base "#builtin.dense_int_or_fp_elements"
    %name = irdl.base "#builtin.string"
{_DEVICE}
    irdl.attributes {{"value" = %value, "name" = %name, "device" = %device}}
    %tensor = irdl.base "!builtin.tensor"
    irdl.results(result: %tensor)
  }}
{compute}
  irdl.operation @print {{
    %tensor = irdl.base "!builtin.tensor"
    irdl.operands(x: %tensor)
  }}
  irdl.operation @transfer {{
    %tensor = irdl.base "!builtin.tensor"
    irdl.operands(x: %tensor)
    irdl.results(result: %tensor)
{one_of("source", DEVICES)}
{one_of("target", DEVICES)}
    irdl.attributes {{"source" = %source, "target" = %target}}
  }}
  irdl.operation @call {{
{call_operands(MAX_CALL_ARGS)}
    %callee = irdl.base "#builtin.symbol_ref"
{one_of("device", DEVICES)}
    irdl.attributes {{"callee" = %callee, "device" = %device}}
  }}
  irdl.operation @custom_call {{
{call_operands(MAX_CALL_ARGS)}
    %kernel = irdl.base "#builtin.string"
    %objects = irdl.base "#builtin.dictionary"
    %grid = irdl.base "#builtin.dense_array"
    %block = irdl.base "#builtin.dense_array"
{_DEVICE}
    irdl.attributes {{"kernel" = %kernel, "objects" = %objects, "grid" = %grid, "block" = %block,
                     "device" = %device}}
  }}
}}
"""


# ---- types ---------------------------------------------------------------------------
# A shape is a tuple of dims; a dim is an int or a symbol (str).

Shape = tuple


_FLOAT_TYPES = {"float32": ir.F32Type, "float64": ir.F64Type, "bfloat16": ir.BF16Type, "float16": ir.F16Type}


def element_type(dtype: str) -> ir.Type:
    """The MLIR element type of a numpy dtype name (float32, float64, bfloat16, float16, int32, int64)."""
    if dtype in ("int32", "int64"):
        return ir.IntegerType.get_signless(int(dtype[3:]))
    return _FLOAT_TYPES[dtype].get()


def tensor_type(shape: Sequence[int | str], dtype: str) -> ir.RankedTensorType:
    symbols = [d for d in shape if isinstance(d, str)]
    dims = [ir.ShapedType.get_dynamic_size() if isinstance(d, str) else d for d in shape]
    encoding = ir.StringAttr.get(",".join(symbols)) if symbols else None
    return ir.RankedTensorType.get(dims, element_type(dtype), encoding=encoding)


def dtype_of(type_: ir.Type) -> str:
    """The numpy dtype name of a tensor/memref type or an element type."""
    try:
        element = ir.ShapedType(type_).element_type
    except ValueError:
        element = type_
    # isinstance, not `== ir.F32Type.get()`, which needs an active context
    for name, kind in _FLOAT_TYPES.items():
        if isinstance(element, kind):
            return name
    if isinstance(element, ir.IntegerType) and ir.IntegerType(element).width in (32, 64):
        return f"int{ir.IntegerType(element).width}"
    raise TraceError(f"element type {element} is not supported; expected f32, f64, bf16, f16, i32 or i64")


def shape_of(type_: ir.Type) -> Shape:
    """The dims of a tensor type, a symbol for each `?` (named by the type's encoding)."""
    shaped = ir.ShapedType(type_)
    dims = list(shaped.shape)
    dynamic = [i for i in range(len(dims)) if shaped.is_dynamic_dim(i)]
    if not dynamic:
        return tuple(dims)
    encoding = type_.encoding if isinstance(type_, ir.RankedTensorType) else None
    names = encoding.value.split(",") if isinstance(encoding, ir.StringAttr) else []
    if len(names) != len(dynamic):
        raise TraceError(f"{type_}: each ? extent needs a name in the type's encoding, e.g. tensor<?x8xf32, \"batch\">")
    for i, name in zip(dynamic, names, strict=True):
        dims[i] = name
    return tuple(dims)


def describe(shape: Sequence[int | str], dtype: str) -> str:
    return f"{dtype}[{', '.join(str(d) for d in shape)}]"


# ---- shape rules (shared by the tracer and the verifier) ------------------------------

def check_dtype(op: str, argument: str, dtype: str) -> None:
    if dtype not in DTYPES:
        raise TraceError(f"{op}: argument '{argument}' has dtype {dtype}; expected float32, float64, bfloat16 "
                         "or float16")


def check_extents(op: str, argument: str, shape: Sequence[int | str], dtype: str, static: bool = False) -> None:
    """Only the first axis may be statically empty (a buffer whose inner axis is 0 has no stride
    the bare-pointer calling convention can express; a symbolic one is re-viewed per call); a
    weight (`static`) has no symbolic extent."""
    if any(extent == 0 for extent in shape[1:]):
        raise TraceError(f"{op}: argument '{argument}' is {describe(shape, dtype)}; only the first axis "
                         "of a tensor may be empty")
    if static and any(isinstance(d, str) for d in shape):
        raise TraceError(f"{op}: argument '{argument}' is {describe(shape, dtype)}; a weight's extents "
                         "must be static")


def elementwise_shape(op: str, x: tuple) -> Shape:
    """The shape of a transfer's or print's operand, checked (any dtype a tensor may have)."""
    shape, dtype = x
    if dtype not in RESULT_DTYPES:
        raise TraceError(f"{op}: argument 'x' has dtype {dtype}; expected one of {', '.join(RESULT_DTYPES)}")
    if len(shape) < 1:
        raise TraceError(f"{op}: argument 'x' must have rank >= 1, got a scalar")
    check_extents(op, "x", shape, dtype)
    return tuple(shape)


# ---- typed builders ------------------------------------------------------------------

def _str(value: str) -> ir.StringAttr:
    return ir.StringAttr.get(value)


def constant(array: np.ndarray, name: str, device: str = "auto") -> ir.Value:
    native = np.ascontiguousarray(array.astype(array.dtype.newbyteorder("="), copy=False))  # MLIR: native order
    if array.dtype.name == "bfloat16":  # not a buffer format MLIR reads: its bits, typed bf16
        value = ir.DenseElementsAttr.get(native.view(np.uint16), type=ir.BF16Type.get())
    else:
        value = ir.DenseElementsAttr.get(native)
    op = ir.Operation.create(
        "hexir.constant", results=[value.type],
        attributes={"value": value, "name": _str(name), "device": _str(device)})
    return op.result


def compute(name: str, operands: Sequence[ir.Value], result: ir.Type, device: str = "auto",
            expr: str | None = None, groups: Sequence[int] | None = None) -> ir.Value:
    """A defined compute op `hexir.<name>` (optional operands left out at the end, or `groups`:
    how many operands each of its groups gets); a pointwise or reduce op takes its tree as `expr`
    (JSON)."""
    expected = _compute_ops[name]
    attributes = {"device": _str(device)}
    if name in _family_ops:
        attributes["expr"] = _str(expr)
        attributes["operandSegmentSizes"] = _segments(f"hexir.{name}", operands)
    elif sum(o.endswith("?") for o in expected) > 1:  # one optional group is inferred from the count
        attributes["operandSegmentSizes"] = ir.DenseI32ArrayAttr.get(
            list(groups) if groups is not None else [int(i < len(operands)) for i in range(len(expected))])
    return ir.Operation.create(f"hexir.{name}", results=[result], operands=list(operands),
                               attributes=attributes).result


def operand_groups(op: ir.Operation) -> list[list[ir.Value]]:
    """A compute op's operands by its groups (named operands, optional ones empty when absent)."""
    operands = list(op.operands)
    count = len(_compute_ops[op.name.removeprefix("hexir.")]) if op.name.removeprefix("hexir.") in _compute_ops \
        else MAX_CALL_ARGS
    if "operandSegmentSizes" in op.attributes:
        sizes = list(ir.DenseI32ArrayAttr(op.attributes["operandSegmentSizes"]))
    else:
        sizes = [1] * len(operands) + [0] * (count - len(operands))
    groups, start = [], 0
    for size in sizes:
        groups.append(operands[start:start + size])
        start += size
    return groups


def print_(x: ir.Value) -> ir.Operation:
    return ir.Operation.create("hexir.print", operands=[x])


def transfer(x: ir.Value, source: str, target: str) -> ir.Value:
    op = ir.Operation.create("hexir.transfer", results=[x.type], operands=[x],
                             attributes={"source": _str(source), "target": _str(target)})
    return op.result


def _segments(op: str, args: Sequence[ir.Value]) -> ir.Attribute:
    if not 1 <= len(args) <= MAX_CALL_ARGS:
        raise TraceError(f"{op} takes 1 to {MAX_CALL_ARGS} tensors, got {len(args)}")
    return ir.DenseI32ArrayAttr.get([1] + [int(len(args) > i) for i in range(1, MAX_CALL_ARGS)])


def call(callee: str, args: Sequence[ir.Value], result_type: ir.Type, device: str) -> ir.Value:
    op = ir.Operation.create(
        "hexir.call", results=[result_type], operands=list(args),
        attributes={"callee": ir.FlatSymbolRefAttr.get(callee), "device": _str(device),
                    "operandSegmentSizes": _segments("hexir.call", args)})
    return op.result


def custom_call(kernel: str, args: Sequence[ir.Value], result_type: ir.Type, objects: dict[str, str],
                grid: Sequence[int], block: Sequence[int], device: str = "auto") -> ir.Value:
    """A user-supplied kernel: `objects` maps each device it can run on to its source/object file."""
    op = ir.Operation.create(
        "hexir.custom_call", results=[result_type], operands=list(args),
        attributes={"kernel": _str(kernel), "device": _str(device),
                    "objects": ir.DictAttr.get({d: _str(path) for d, path in objects.items()}),
                    "grid": ir.DenseI64ArrayAttr.get(list(grid)), "block": ir.DenseI64ArrayAttr.get(list(block)),
                    "operandSegmentSizes": _segments(f"custom kernel {kernel}", args)})
    return op.result


# ---- accessors -----------------------------------------------------------------------

def objects_of(op: ir.Operation) -> dict[str, str]:
    """device -> file of a hexir.custom_call."""
    objects = ir.DictAttr(op.attributes["objects"])
    return {named.name: ir.StringAttr(named.attr).value for named in objects}


def launch_of(op: ir.Operation) -> tuple[list[int], list[int]]:
    """(grid, block) of a hexir.custom_call."""
    return list(ir.DenseI64ArrayAttr(op.attributes["grid"])), list(ir.DenseI64ArrayAttr(op.attributes["block"]))


def device_of(op: ir.Operation) -> str:
    """The device an op runs on ("auto" before partitioning); print runs on the host."""
    if op.name == "hexir.print":
        return "cpu"
    if op.name == "hexir.transfer":
        return ir.StringAttr(op.attributes["target"]).value
    return ir.StringAttr(op.attributes["device"]).value


def set_device(op: ir.Operation, device: str) -> None:
    op.attributes["device"] = _str(device)


def string_attr(op: ir.Operation, name: str) -> str:
    return ir.StringAttr(op.attributes[name]).value


def callee_of(op: ir.Operation) -> str:
    return ir.FlatSymbolRefAttr(op.attributes["callee"]).value


def expr_of(op: ir.Operation) -> object:
    """The JSON of a pointwise or reduce op's `expr`, or of a linear's epilogue (None: none)."""
    name = EXPR if EXPR in op.attributes else EPILOGUE if EPILOGUE in op.attributes else None
    if name is None:
        return None
    try:
        return json.loads(ir.StringAttr(op.attributes[name]).value)
    except (ValueError, TypeError) as error:
        raise TraceError(f"{op.name.removeprefix('hexir.')}: {name} is not JSON: {error}") from None


def set_expr(op: ir.Operation, tree: object, name: str = EXPR) -> None:
    """Set a pointwise or reduce op's `expr` (or, name=EPILOGUE, a linear's epilogue) to `tree`."""
    op.attributes[name] = _str(json.dumps(tree, separators=(",", ":")))


def set_w_panels(op: ir.Operation, layout: str = W_PANELS) -> None:
    op.attributes[layout] = ir.UnitAttr.get()


def has_w_panels(op: ir.Operation, layout: str = W_PANELS) -> bool:
    return layout in op.attributes


def constant_array(op: ir.Operation) -> np.ndarray:
    """The numpy value of a hexir.constant (a copy, C-contiguous, its own dtype)."""
    attr = ir.DenseElementsAttr(op.attributes["value"])
    shape = shape_of(op.result.type)
    dtype = np.dtype(dtype_of(op.result.type))
    if attr.is_splat:
        return np.full(shape, ir.FloatAttr(attr.get_splat_value()).value, dtype=dtype)
    if dtype.name == "bfloat16":  # MLIR gives bf16 no buffer: read the printed form
        return _bf16_values(str(attr)).reshape(shape)
    return np.array(attr, dtype=dtype).reshape(shape)


def _bf16_values(text: str) -> np.ndarray:
    """The elements of a printed bf16 dense attribute: hex bytes (`dense<"0x...">`, a large one)
    or numbers, a non-finite one as its bits (`0x7FC0`)."""
    if text.startswith('dense<"0x'):
        return np.frombuffer(bytes.fromhex(text[9:text.index('"', 9)]), "<u2").view(np.dtype("bfloat16")).copy()
    body = text[text.index("<") + 1:text.index(">")]  # (then " : tensor<...>")
    tokens = re.findall(r"0x[0-9A-Fa-f]+|[-+0-9.eE]+", body.replace("[", " ").replace("]", " "))
    bits = [int(t, 16) if t.startswith("0x") else np.array(float(t), "bfloat16").view(np.uint16).item()
            for t in tokens]
    return np.array(bits, np.uint16).view(np.dtype("bfloat16"))


def main_function(module: ir.Module) -> ir.Operation:
    """The host program: the module's `func.func @main`."""
    for op in module.body.operations:
        if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
            return op.operation
    raise CompileError("the module has no func.func @main (the host program)")


def set_main_attributes(main: ir.Operation, arg_names: Sequence[str], result_form: str) -> None:
    main.attributes[ARG_NAMES] = ir.ArrayAttr.get([_str(n) for n in arg_names])
    main.attributes[RESULT_FORM] = _str(result_form)


def argument_names(main: ir.Operation) -> list[str]:
    """The names of @main's arguments: its `hexir.arg_names` (the traced function's
    parameters) when it has one name per argument, else arg0, arg1, ..."""
    count = len(ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value).inputs)
    if ARG_NAMES in main.attributes:
        names = [ir.StringAttr(name).value for name in ir.ArrayAttr(main.attributes[ARG_NAMES])]
        if len(names) == count:
            return names
    return [f"arg{i}" for i in range(count)]


def result_form(module: ir.Module) -> str:
    """The form of a traced function's results, so a call can return them the same way."""
    main = main_function(module)
    return ir.StringAttr(main.attributes[RESULT_FORM]).value if RESULT_FORM in main.attributes else "single"
