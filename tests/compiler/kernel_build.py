"""Build one cuda schedule's kernel on its own, for dtypes and shapes the frontend need not
trace: `cuda_kernel(builder, shapes, dtype, request fields)` -> (the lowered module, its launch).
The kernel is built as lower-to-tir builds it, then run through tir-to-loops and to-gpu."""

from __future__ import annotations

from dataclasses import replace

from mlir import ir
from mlir.dialects import func

from hexir.dialects import hextir as ht
from hexir.dialects import make_context
from hexir.passes.lower_to_tir import _kernel
from hexir.passes.tir_to_loops import tir_to_loops
from hexir.passes.to_gpu import cuda_kernels_to_gpu
from hexir.schedules import Request
from hexir.target import Target

ELEMENTS = {"float32": ir.F32Type.get, "float64": ir.F64Type.get, "bfloat16": ir.BF16Type.get,
            "float16": ir.F16Type.get}


def cuda_kernel(build, shapes, dtype: str, name: str = "k", archs: tuple[str, ...] = ("sm_90",), **fields):
    """The module (after to-gpu) holding kernel `name` built by `build` over buffers of `shapes`
    (ints, or a symbol name for a `?` extent) in `dtype` (fields: Request's, e.g. bias=True)."""
    context = make_context()
    with context, ir.Location.unknown():
        module = ir.Module.create()
        element = ELEMENTS[dtype]()
        symbols = tuple(dict.fromkeys(d for shape in shapes for d in shape if isinstance(d, str)))
        types = [ir.MemRefType.get([d if isinstance(d, int) else ir.ShapedType.get_dynamic_size() for d in shape],
                                   element) for shape in shapes] + [ir.IndexType.get()] * len(symbols)
        request = Request("linear", dtype, Target(cuda_archs=archs), symbols, shapes=tuple(map(tuple, shapes)))
        request = replace(request, **fields)
        with ir.InsertionPoint(module.body):
            _kernel(ht.KernelId(name, "cuda"), types, build, request, None)
            main = func.FuncOp("main", ir.FunctionType.get([], []))
            with ir.InsertionPoint(main.add_entry_block()):
                func.ReturnOp([])
        tir_to_loops(module)
        cuda_kernels_to_gpu(module)
    return module, context
