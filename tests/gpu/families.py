"""The GPU ≡ CPU suite's op-family cases (#23): every registered pointwise and reduce op, and
fused chains, built here (hexir) and run there (hexir_runtime and numpy only).

Each chain is written once, as a function of a namespace `F` and its inputs: the build calls it
with `F = hexir` (traced, fused and compiled), the run with `F = NUMPY` below (the same formula
in float64 numpy, written independently of hexir's trees), so a fusion that composes trees
wrongly shows. An op of the registry that NUMPY does not know (one registered after this file
was written) is checked against the runtime's reference device instead (numpy evaluating the
kernel's own tree), on cuda and on the cpu twins alike. To keep the build small, each module
holds a group of outputs (every unary op of a dtype, say), each its own kernel or fused chain.

Tolerances (`|got - expected| <= atol + rtol * |expected|`, expected in float64): rtol is TOL
by dtype (float32 math 1e-5 relative, float64 1e-12) times the op's factor in RTOL; atol is
TOL times the op's scale in ATOL of the reduced length n (sums: sqrt(n), inputs are unit
normals). int64 results (argmax) must be equal. Layout ops (LAYOUTS) move values: exact. Ids
inputs ({"ids": rows, "shape": ...}) are drawn in [0, rows).
"""

from __future__ import annotations

import inspect
import math

import numpy as np

TOL = {"float32": 1e-5, "float64": 1e-12, "bfloat16": 2**-7, "float16": 2**-10}
#: The 16-bit dtypes (#26: computed in float32, each result rounded once to 16 bits, so TOL is
#: about two of its ulps: 2^-8 and 2^-11 relative, one for the rounding of the result and one
#: for an unfused op's rounded input; a contract's sums add atol TOL * sqrt(K)); their groups
#: leave out the layout ops and the sequence chains (moving bits, and the float32 path's).
HALVES = ("bfloat16", "float16")
#: atol / TOL by op (n: the reduced length; a linear's K): sums grow as sqrt(n).
ATOL = {"sum": math.sqrt, "mean": lambda n: 1 / math.sqrt(n), "softmax": lambda n: 1 / n,
        "log_softmax": lambda n: 1 + math.log(n), "layer_norm": lambda n: 1.0, "linear": math.sqrt,
        "matmul": math.sqrt}
#: rtol / TOL where an op's result is not within TOL of the rounded exact one (f32 pow x**3: 3 roundings)
RTOL = {"pow": 4.0}
POSITIVE = {"log", "sqrt", "rsqrt", "pow"}  # drawn as |x| + 0.5
PARAMS = {"pow": {"exponent": 3.0}}
BATCHES = [0, 1, 7, 129, 1000]  # a symbolic case runs at each (long rows: the first four)
COLUMNS = 257  # no block size divides it


def _erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _layer_norm(x, weight=None, bias=None, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    y = (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)
    return y * (1 if weight is None else weight) + (0 if bias is None else bias)


class NUMPY:  # noqa: N801 - stands where the module `hexir` stands in a chain
    """hexir's functions as float64 numpy (torch's meanings of gelu, layer_norm, softmax)."""

    add, sub, mul, div = np.add, np.subtract, np.multiply, np.divide
    maximum, minimum, neg, abs, exp, log, tanh, sqrt = (np.maximum, np.minimum, np.negative, np.abs, np.exp,
                                                        np.log, np.tanh, np.sqrt)
    erf = staticmethod(_erf)
    relu = staticmethod(lambda x: np.maximum(x, 0))
    rsqrt = staticmethod(lambda x: 1 / np.sqrt(x))
    sigmoid = staticmethod(lambda x: 1 / (1 + np.exp(-x)))
    silu = staticmethod(lambda x: x / (1 + np.exp(-x)))
    gelu_tanh = staticmethod(lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))))
    pow = staticmethod(lambda x, exponent: np.power(x, exponent))
    softmax = staticmethod(_softmax)
    log_softmax = staticmethod(lambda x, axis=-1: np.log(_softmax(x, axis)))
    layer_norm = staticmethod(_layer_norm)

    @staticmethod
    def gelu(x, approximate="none"):
        return NUMPY.gelu_tanh(x) if approximate == "tanh" else x * 0.5 * (1 + _erf(x / math.sqrt(2)))

    @staticmethod
    def linear(x, w, b=None):
        return x @ w + (0 if b is None else b)

    concat = staticmethod(lambda xs, axis=0: np.concatenate(xs, axis))
    take = staticmethod(lambda table, ids: np.take(table, ids, axis=0))
    sum = staticmethod(lambda x, axis=-1, keepdims=False: x.sum(axis, keepdims=keepdims))
    mean = staticmethod(lambda x, axis=-1, keepdims=False: x.mean(axis, keepdims=keepdims))
    max = staticmethod(lambda x, axis=-1, keepdims=False: x.max(axis, keepdims=keepdims))
    argmax = staticmethod(lambda x, axis=-1, keepdims=False: x.argmax(axis, keepdims=keepdims))


# ---- fused chains: (function of F and the inputs, input shapes, the op setting the tolerance, n) ----
# "B" is the symbolic batch. A number operand is a scalar of the trace.
CHAINS = {
    # pointwise chains with broadcasting: a row [N], a column [B, 1], numbers
    "bcast_row_col": (lambda F, x, r, c: F.tanh(x * r + c) * 0.5 - F.sigmoid(x - c),
                      [("B", COLUMNS), (COLUMNS,), ("B", 1)], "pointwise", 1),
    "bcast_gelu_ab": (lambda F, x, a, b: F.gelu(x * a + b), [("B", COLUMNS), (COLUMNS,), (COLUMNS,)], "pointwise", 1),
    "bcast_outer": (lambda F, c, r: F.maximum(c * r, F.exp(-F.abs(r - c))), [("B", 1), (1, COLUMNS)], "pointwise", 1),
    "bcast_rank3": (lambda F, x, r: F.silu(x + r) / (1.5 + F.abs(x)), [("B", 5, 33), (33,)], "pointwise", 1),
    # linear + pointwise epilogue (one kernel), residual add after a linear
    "linear_gelu": (lambda F, x, w, b: F.gelu(F.linear(x, w, b)), [("B", 96), (96, 130), (130,)], "linear", 96),
    "linear_gelu_tanh": (lambda F, x, w: F.gelu(F.linear(x, w), approximate="tanh"), [("B", 300), (300, 97)],
                         "linear", 300),
    "linear_silu": (lambda F, x, w, b: F.silu(F.linear(x, w, b)), [("B", 64), (64, 200), (200,)], "linear", 64),
    "linear_scale": (lambda F, x, w: F.linear(x, w) * 0.125, [("B", 1031), (1031, 33)], "linear", 1031),
    "linear_residual": (lambda F, x, w, b: x + F.linear(x, w, b), [("B", 128), (128, 128), (128,)], "linear", 128),
    "linear_relu_residual": (lambda F, x, w: F.relu(F.linear(x, w)) * 0.5 + x, [("B", 65), (65, 65)],
                             "linear", 65),
    # reductions with a fused prologue
    "softmax_prologue": (lambda F, x, a: F.softmax(x * a - 0.5), [("B", COLUMNS), (COLUMNS,)], "softmax", COLUMNS),
    "log_softmax_prologue": (lambda F, x: F.log_softmax(F.tanh(x) * 3.0), [("B", COLUMNS)], "log_softmax",
                             COLUMNS),
    "layer_norm_prologue": (lambda F, x, r, w, b: F.layer_norm(x + r, w, b), [("B", COLUMNS), (COLUMNS,),
                                                                               (COLUMNS,), (COLUMNS,)],
                            "layer_norm", COLUMNS),
    "argmax_prologue": (lambda F, x: F.argmax(x * 2.0), [("B", COLUMNS)], "argmax", COLUMNS),
    "sum_mid_axis": (lambda F, x: F.sum(x * 0.5 + 0.25, axis=1), [("B", 33, 65)], "sum", 33),
    "max_mid_axis_keep": (lambda F, x: F.max(x * 2.0, axis=1, keepdims=True), [("B", 33, 65)], "max", 33),
    "mean_rank3_keep": (lambda F, x: F.mean(F.abs(x), axis=-1, keepdims=True), [("B", 7, 513)], "mean", 513),
    "argmax_mid_axis": (lambda F, x: F.argmax(x, axis=1), [("B", 33, 65)], "argmax", 33),
    "softmax_then_scale": (lambda F, x: F.softmax(x) * 2.0 + 1.0, [("B", 1000)], "softmax", 1000),
    # matmul between inputs (#24): symbolic rows, batches broadcast, a 1-D operand, epilogues; attention
    # (the scale and mask the scores' epilogue) at sequence lengths 1, 7, 129, the batch symbolic
    "matmul_rows": (lambda F, a, b: a @ b, [("B", 67), (67, 33)], "matmul", 67),
    "matmul_bcast_gelu": (lambda F, a, b: F.gelu(a @ b), [("B", 3, 7, 16), (3, 16, 9)], "matmul", 16),
    "matmul_vector_residual": (lambda F, v, m, r: v @ m + r, [(33,), ("B", 33, 5), (5,)], "matmul", 33),
    **{f"attention_{s}": (lambda F, q, kt, v, mask: F.softmax(q @ kt * 0.125 + mask) @ v,
                          [("B", s, d), ("B", d, s), ("B", s, d), (s, s)], "matmul", max(s, d))
       for s, d in ((1, 8), (7, 16), (129, 64))},
    # attention of 3 heads whose sequence is the symbol (q[3, seq, 64]), run at SEQUENCES' lengths
    "attention_seq": (lambda F, q, kt, v, mask: F.softmax(q @ kt * 0.125 + mask) @ v,
                      [(3, "B", 64), (3, 64, "B"), (3, "B", 64), ("B", "B")], "matmul", 1000),
}
#: Chains whose symbol is a sequence length (a module of their own, run at these lengths).
SEQUENCE_CHAINS, SEQUENCES = ("attention_seq",), [1, 7, 129, 1000]
#: Layout ops (#24), alone and around compute ops; an ids input is {"ids": rows, "shape": ...}
#: (int32 in the float32 group, int64 in the float64 one), drawn in [0, rows).
IDS = {"ids": 11, "shape": ("B", 3)}
LAYOUTS = {
    "transpose_rank3": (lambda F, x: x.transpose(0, 2, 1), [("B", 5, 33)], "pointwise", 1),
    "reshape_heads": (lambda F, x: x.reshape(x.shape[0], 4, 33).transpose(0, 2, 1) * 2.0, [("B", 132)],
                      "pointwise", 1),
    "slices_qkv": (lambda F, x: F.concat([x[:, 66:99], x[:, 0:33:2], x[:, -1:, None][:, :, 0]], axis=1),
                   [("B", 99)], "pointwise", 1),
    "index_reverse": (lambda F, x: x[:, 3] + x[..., ::-1][:, 0], [("B", 33)], "pointwise", 1),
    "concat_many": (lambda F, x, y: F.concat([x, y, x * 2.0, y, x, y, x, y, x, y], axis=1), [("B", 33), ("B", 7)],
                    "pointwise", 1),
    "take_rows": (lambda F, table, ids: F.take(table, ids), [(11, 257), IDS], "pointwise", 1),
    "take_softmax": (lambda F, table, ids: F.softmax(F.take(table, ids).reshape(ids.shape[0], 3 * 257)),
                     [(11, 257), IDS], "softmax", 771),
}
CHAINS.update(LAYOUTS)
#: Chains also built alone with a placement that splits them between cuda and cpu (float64).
MIXES = {"linear_gelu": {"hexir.linear": "cuda", "hexir.gelu": "cpu"},
         "linear_residual": {"hexir.linear": "cpu", "*": "cuda"},
         "softmax_prologue": {"hexir.mul": "cpu", "*": "cuda"},
         "bcast_row_col": {"hexir.tanh": "cpu", "*": "cuda"}}
#: Long rows: for each width, softmax, log_softmax, layer_norm (and at 16384: sum, max, argmax)
#: in one module, float32 and float64, run at 1, 7, 129 rows.
LONG = {1024: ("softmax", "log_softmax", "layer_norm"), 4096: ("softmax", "log_softmax", "layer_norm"),
        16384: ("softmax", "log_softmax", "layer_norm", "sum", "max", "argmax")}


def _long(F, op):  # noqa: N803
    if op == "layer_norm":
        return lambda x, w, b: F.layer_norm(x * 0.5 + 1.0, w, b)
    if op == "argmax":  # (an exact prologue: a rounded one may tie values float64 tells apart)
        return lambda x: F.argmax(x * 2.0)
    return lambda x: getattr(F, op)(x * 0.5 + 0.25)


def _op(F, output):  # noqa: N803
    """An `op` output's function of its inputs, with F = hexir's pointwise/reduce or NUMPY."""
    name = output["op"]
    if output["family"] == "pointwise":
        return lambda *xs: F.pointwise(name, xs, **output["params"])
    return lambda x, *more: F.reduce(name, x * 2.0 if output["prologue"] else x, more, axis=output["axis"],
                                     keepdims=output["keepdims"])


def function_of(F, output):  # noqa: N803
    """What one output of a group computes from its inputs (output["uses"])."""
    if output["what"] == "chain":
        return lambda *xs: CHAINS[output["name"]][0](F, *xs)
    if output["what"] == "long":
        return _long(F, output["op"])
    return _op(F, output)


def _group(F, outputs):  # noqa: N803
    """The group's module: every output's function of its own inputs, as one function."""
    def model(*xs):
        results = tuple(function_of(F, o)(*[xs[i] for i in o["uses"]]) for o in outputs)
        return results if len(results) > 1 else results[0]
    return model


def groups() -> list[dict]:
    """Every family module to build: its inputs, outputs and placement (no hexir needed)."""
    from hexir import ops  # the registry: what the build covers

    found = []
    for dtype in ("float32", "float64", *HALVES):
        unary = [n for n, d in sorted(ops.REGISTRY.items()) if d.family == "pointwise" and d.arity == 1]
        binary = [n for n, d in sorted(ops.REGISTRY.items()) if d.family == "pointwise" and d.arity == 2]
        other = [d for d in ops.REGISTRY.values() if d.family == "pointwise" and d.arity > 2]
        # each op alone, all ops of a kind in one module (one kernel each): unit normals, then
        # |x| + 0.5 for the ops of positive arguments, then two operands: a row (f32) or a column (f64)
        for names, positive in (([n for n in unary if n not in POSITIVE], False), ([n for n in unary if n in POSITIVE],
                                                                                  True)):
            found.append({"label": "pointwise ops" + (" (positive x)" if positive else ""), "dtype": dtype,
                          "inputs": [("B", COLUMNS)], "positive": positive,
                          "outputs": [_output_op(n, "pointwise", [0]) for n in names]})
        second = (COLUMNS,) if dtype == "float32" else ("B", 1)
        found.append({"label": "binary pointwise ops", "dtype": dtype, "inputs": [("B", COLUMNS), second],
                      "outputs": [_output_op(n, "pointwise", [0, 1]) for n in binary]})
        for definition in other:  # an op of more operands: each a full tensor
            found.append({"label": f"pointwise {definition.name}", "dtype": dtype,
                          "inputs": [("B", COLUMNS)] * definition.arity,
                          "outputs": [_output_op(definition.name, "pointwise", list(range(definition.arity)))]})
        reductions = [d for n, d in sorted(ops.REGISTRY.items()) if d.family == "reduce"]
        extras = max(len(d.operands) - 1 for d in reductions)
        found.append({"label": "reduce ops, axis -1, prologue x*2", "dtype": dtype,
                      "inputs": [("B", COLUMNS)] + [(COLUMNS,)] * extras,
                      "outputs": [_output_op(d.name, "reduce", list(range(len(d.operands))), axis=-1, n=COLUMNS,
                                             keepdims=False, prologue=True) for d in reductions]})
        found.append({"label": "reduce ops, middle axis of rank 3, keepdims", "dtype": dtype,
                      "inputs": [("B", 33, 65)],
                      "outputs": [_output_op(d.name, "reduce", [0], axis=1, n=33, keepdims=True, prologue=False)
                                  for d in reductions if len(d.operands) == 1]})
        for kind in ("pointwise", "linear", "matmul", "reduce"):  # the fused chains, a module of each kind
            names = [n for n, c in CHAINS.items() if n not in SEQUENCE_CHAINS and n not in LAYOUTS
                     and (c[2] if c[2] in ("pointwise", "linear", "matmul") else "reduce") == kind]
            found.append(_chains(names, dtype, "*=cuda"))
        for n, long_ops in LONG.items():
            found.append({"label": f"long rows of {n}", "dtype": dtype, "inputs": [("B", n), (n,), (n,)],
                          "batches": [1, 7, 129],
                          "outputs": [{"what": "long", "op": op, "tol_op": op, "n": n,
                                       "uses": [0, 1, 2] if op == "layer_norm" else [0]} for op in long_ops]})
        if dtype not in HALVES:
            found.append({**_chains(list(SEQUENCE_CHAINS), dtype, "*=cuda"), "batches": SEQUENCES})
            found.append({**_chains(list(LAYOUTS), dtype, "*=cuda"), "label": "layout ops"})
    for name, placement in MIXES.items():
        found.append(_chains([name], "float64", placement))
    found.append({**_chains(["take_rows"], "float32", "*=cuda"), "label": "take, an id out of range", "bad_id": 1})
    return found


def _dtype_of(shape, dtype):
    """An input's dtype in a group of `dtype`: ids are int32 beside float32, int64 beside float64."""
    return ("int32" if dtype == "float32" else "int64") if isinstance(shape, dict) else dtype


def _dims(shape, batch="batch"):
    return tuple(batch if d in ("B", "batch") else d for d in (shape["shape"] if isinstance(shape, dict) else shape))


def _output_op(name, family, uses, **more):
    return {"what": "op", "op": name, "family": family, "params": PARAMS.get(name, {}), "uses": uses,
            "tol_op": name, "n": more.pop("n", 1), **more}


def _chains(names, dtype, placement):
    inputs, outputs = [], []
    for name in names:
        shapes = CHAINS[name][1]
        outputs.append({"what": "chain", "name": name, "tol_op": CHAINS[name][2], "n": CHAINS[name][3],
                        "uses": list(range(len(inputs), len(inputs) + len(shapes)))})
        inputs += shapes
    return {"label": f"chains {', '.join(names)}", "dtype": dtype, "inputs": inputs, "outputs": outputs,
            "placement": placement}


class _Traced:
    """`F` at build time: hexir's functions, and its pointwise/reduce by op name."""

    def __init__(self):
        import hexir
        from hexir.frontend.functions import pointwise, reduce

        self.hexir, self.pointwise, self.reduce = hexir, pointwise, reduce

    def __getattr__(self, name):
        return getattr(self.hexir, name)


def build(out, add_case, dtypes=()) -> None:
    """Compile every group (of `dtypes`, when given) into `out`: `add_case(record, function, specs, placement)`."""
    import hexir

    traced = _Traced()
    for group in (g for g in groups() if not dtypes or g["dtype"] in dtypes):
        specs = [hexir.TensorSpec(_dims(shape), _dtype_of(shape, group["dtype"])) for shape in group["inputs"]]
        model = _group(traced, group["outputs"])
        model.__signature__ = inspect.Signature([inspect.Parameter(f"x{i}", inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                                 for i in range(len(specs))])
        add_case(group, model, specs, group.get("placement", "*=cuda"))


def draw(case, rng, batch):
    """The case's inputs at this batch size."""
    arrays = []
    for shape in case["inputs"]:
        if isinstance(shape, dict):  # ids, in range
            arrays.append(rng.integers(0, shape["ids"], _dims(shape, batch)).astype(_dtype_of(shape, case["dtype"])))
            continue
        value = rng.standard_normal(_dims(shape, batch))
        arrays.append((np.abs(value) + 0.5 if case.get("positive") else value).astype(case["dtype"]))
    return arrays


class _Numpy(NUMPY):
    """`F` at run time, float64 numpy: an op by name, None for one NUMPY does not know."""

    @staticmethod
    def pointwise(name, xs, **params):
        function = getattr(NUMPY, name, None)
        return None if function is None else function(*xs, **params)

    @staticmethod
    def reduce(name, x, more, axis, keepdims):
        function = getattr(NUMPY, name, None)
        if function is None:
            return None
        if name in ("softmax", "log_softmax"):
            return function(x, axis)
        return function(x, *more) if name == "layer_norm" else function(x, axis, keepdims)


def expected(output, arrays):
    """float64 numpy's value of one output, or None where NUMPY does not know its op."""
    wide = [arrays[i].astype(np.float64) if arrays[i].dtype.kind not in "iu" else arrays[i] for i in output["uses"]]
    return function_of(_Numpy, output)(*wide)


def compare(output, dtype, got, want) -> str | None:
    """Why `got` is not `want` within the output's tolerance, or None."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"shape {list(got.shape)}, expected {list(want.shape)}"
    if want.dtype.kind in "iu" or got.dtype.kind in "iu":
        wrong = int((got != want).sum())
        return f"{wrong} of {got.size} indices differ" if wrong else None
    rtol, atol = tolerance(output, dtype)
    bad = ~(np.abs(got.astype(np.float64) - want) <= atol + rtol * np.abs(want))
    if not bad.any():
        return None
    where = np.unravel_index(int(np.argmax(bad)), bad.shape)
    return (f"{int(bad.sum())} of {bad.size} values off (rtol {rtol:.0e}, atol {atol:.1e}), first at "
            f"{list(map(int, where))}: {float(got[where])!r} vs {float(want[where])!r}")


def tolerance(output, dtype) -> tuple[float, float]:
    tol = TOL[dtype]
    return tol * RTOL.get(output["tol_op"], 1.0), tol * ATOL.get(output["tol_op"], lambda n: 1.0)(output["n"])


def label(output) -> str:
    what = output.get("name") or output["op"]
    if output.get("axis") is not None:
        what += f" axis={output['axis']}{' keepdims' if output['keepdims'] else ''}"
    return f"{output['what']} {what}"
