"""The IR of a scalar expression: `emit(tree, args)` builds, at the insertion point, the
arith/math ops computing a tree of the runtime's scalar-expression language
(`hexir_runtime.format.scalars`) from values already loaded — scalars or vectors alike, so
the cpu linear's epilogue applies it to a vector of sums and the element-wise kernels to one
element. The math ops are lowered per device by the backends (libm/approximations on the cpu,
libdevice on cuda: docs/math.md).

    emit(["max", ["add", ["arg", 0], ["arg", 1]], ["const", 0]], [x, b])
  =>
    %0 = arith.addf %x, %b : f32
    %1 = arith.maximumf %0, %cst_0 : f32
"""

from __future__ import annotations

from collections.abc import Sequence

from hexir_runtime.format import scalars
from mlir import ir
from mlir.dialects import arith, math

from hexir.errors import CompileError

_BINARY = {"add": arith.AddFOp, "sub": arith.SubFOp, "mul": arith.MulFOp, "div": arith.DivFOp,
           "max": arith.MaximumFOp, "min": arith.MinimumFOp}
_UNARY = {"neg": arith.NegFOp, "abs": math.AbsFOp, "exp": math.ExpOp, "log": math.LogOp, "tanh": math.TanhOp,
          "sqrt": math.SqrtOp, "rsqrt": math.RsqrtOp, "erf": math.ErfOp}


def compute_type(*types: ir.Type) -> ir.Type:
    """The float type a kernel over buffers of `types` (its inputs and output; element types, or
    memrefs of them) computes in: f64 if any is f64, else f32 (16-bit floats are widened after
    each load and narrowed before each store, as torch computes them; ints are converted)."""
    elements = [ir.ShapedType(t).element_type if isinstance(t, ir.ShapedType) else t for t in types]
    return ir.F64Type.get() if any(isinstance(e, ir.F64Type) for e in elements) else ir.F32Type.get()


def convert(value: ir.Value, element: ir.Type) -> ir.Value:
    """`value` (a scalar or a vector) as `element`s: extf/truncf between floats (rounding to
    nearest even), sitofp from an int; itself when it already is."""
    source = ir.VectorType(value.type).element_type if isinstance(value.type, ir.VectorType) else value.type
    if source == element:
        return value
    target = ir.VectorType.get(ir.VectorType(value.type).shape, element) \
        if isinstance(value.type, ir.VectorType) else element
    if isinstance(source, ir.IntegerType):
        return arith.SIToFPOp(target, value).result
    if ir.FloatType(source).width == ir.FloatType(element).width:  # bf16 <-> f16: through f32
        return convert(convert(value, ir.F32Type.get()), element)
    if ir.FloatType(source).width < ir.FloatType(element).width:
        return arith.ExtFOp(target, value).result
    return arith.TruncFOp(target, value).result


def constant(value: float, type_: ir.Type) -> ir.Value:
    """`value` as a float of `type_` (a float type, or a vector of one: a splat)."""
    if isinstance(type_, ir.VectorType):
        element = ir.VectorType(type_).element_type
        return arith.ConstantOp(type_, ir.DenseElementsAttr.get_splat(type_, ir.FloatAttr.get(element, value))).result
    return arith.ConstantOp(type_, ir.FloatAttr.get(type_, value)).result


def emit(tree: scalars.Tree, args: Sequence[ir.Value], reds: Sequence[ir.Value] = (),
         length: ir.Value | None = None, type_: ir.Type | None = None) -> ir.Value:
    """The value of `tree` with `["arg", i]` = args[i], `["red", i]` = reds[i] and `["len"]` =
    `length` (a float of the same type), computed in `type_` (an element type: each arg is
    converted to it first, a vector staying one; default: the first arg's type)."""
    if type_ is not None and args:
        args = [convert(a, type_) for a in args]
        type_ = args[0].type
    type_ = type_ or (args[0].type if args else reds[0].type)
    cache: dict[str, ir.Value] = {}

    def value(node: scalars.Tree) -> ir.Value:
        op = node[0]
        if op == "arg":
            return args[node[1]]
        if op == "red":
            return reds[node[1]]
        if op == "len":
            if length is None:
                raise CompileError("['len'] outside a reduce kernel")
            return length
        if op == "const":
            key = repr(node)
            if key not in cache:
                cache[key] = constant(float(node[1]), type_)
            return cache[key]
        if op == "pow":
            return _power(value(node[1]), float(node[2][1]), type_)
        operands = [value(child) for child in node[1:]]
        if op in _UNARY:
            return _UNARY[op](operands[0]).result
        if op in _BINARY:
            return _BINARY[op](*operands).result
        raise CompileError(f"scalar op {op!r} has no IR")

    return value(tree)


def _power(x: ir.Value, exponent: float, type_: ir.Type) -> ir.Value:
    """x ** exponent: products for small integer exponents (numpy's square is x * x), sqrt and
    rsqrt for halves, math.powf otherwise."""
    if exponent == 0.5:
        return math.SqrtOp(x).result
    if exponent == -0.5:
        return math.RsqrtOp(x).result
    if exponent.is_integer() and 0 < abs(exponent) <= 4:
        result = x
        for _ in range(int(abs(exponent)) - 1):
            result = arith.MulFOp(result, x).result
        return result if exponent > 0 else arith.DivFOp(constant(1.0, type_), result).result
    if exponent == 0:
        return constant(1.0, type_)
    return math.PowFOp(x, constant(exponent, type_)).result
