"""widen: a contract (linear, matmul) on 16-bit floats computes in float32, between casts.

Input: a partitioned hexir module. Output: each contract whose operands are bfloat16 or
float16 reads them through `hexir.cast` ops to float32 (a constant operand converted here, once:
pack-weights then packs the float32 weight) and makes float32, cast back to the 16-bit dtype
after it; so the float32 GEMM of each device runs as it is (products and sums in float32, as
torch's), and the cast back, a pointwise op, fuses with the element-wise ops after it (the
epilogue in float32, rounded once as it is stored). A cuda contract is left alone where
`schedules/cuda.py: native_16bit(request)` says its kernels take 16-bit operands themselves.

    %y = "hexir.linear"(%x, %w) : (tensor<?x8xbf16>, tensor<8x4xbf16>) -> tensor<?x4xbf16>
  =>
    %w32 = "hexir.constant"() {name = "W.float32", value = dense<...> : tensor<8x4xf32>}
    %x32 = "hexir.cast"(%x) {expr = "[\"arg\",0]"} : (tensor<?x8xbf16>) -> tensor<?x8xf32>
    %s = "hexir.linear"(%x32, %w32) : (...) -> tensor<?x4xf32>
    %y = "hexir.cast"(%s) {expr = "[\"arg\",0]"} : (tensor<?x4xf32>) -> tensor<?x4xbf16>
"""

from __future__ import annotations

from mlir import ir

from hexir import ops
from hexir.dialects import hexir as hx
from hexir.schedules import Request, cuda
from hexir.target import Target

_IDENTITY = '["arg",0]'


def widen(module: ir.Module, target: Target, precision: str = "highest") -> None:
    main = hx.main_function(module)
    converted: dict[tuple[str, str], ir.Value] = {}  # a constant (name, device) -> its float32 copy
    originals: dict[tuple[str, str], ir.Operation] = {}
    for op in [o.operation for o in main.regions[0].blocks[0].operations]:
        if ops.family_of(op) != "contract" or hx.dtype_of(op.result.type) not in hx.HALVES:
            continue
        dtype, device = hx.dtype_of(op.result.type), hx.device_of(op)
        if device == "cuda" and cuda.native_16bit(Request(op.name.removeprefix("hexir."), dtype, target,
                                                          precision=precision)):
            continue
        with ir.InsertionPoint(op), op.location:
            for position, value in enumerate(list(op.operands)):
                op.operands[position] = _to_float32(value, device, converted)
                owner = value.owner
                if not isinstance(owner, ir.Block) and owner.name == "hexir.constant":
                    owner = owner.operation if hasattr(owner, "operation") else owner
                    originals[hx.string_attr(owner, "name"), hx.device_of(owner)] = owner
        op.result.set_type(_retyped(op.result.type, "float32"))
        with ir.InsertionPoint.at_block_terminator(op.operation.block), op.location:  # (then moved after op)
            back = hx.compute("cast", [op.result], _retyped(op.result.type, dtype), device, _IDENTITY)
        cast = back.owner.operation if hasattr(back.owner, "operation") else back.owner
        cast.move_after(op)
        op.result.replace_all_uses_except(back, cast)
    for original in originals.values():  # a 16-bit constant nothing reads now
        if not list(original.result.uses):
            original.erase()


def _retyped(type_: ir.Type, dtype: str) -> ir.Type:
    return hx.tensor_type(hx.shape_of(type_), dtype)


def _to_float32(value: ir.Value, device: str, converted: dict[tuple[str, str], ir.Value]) -> ir.Value:
    owner = value.owner
    owner = None if isinstance(owner, ir.Block) else (owner.operation if hasattr(owner, "operation") else owner)
    if owner is not None and owner.name == "hexir.constant":
        key = (hx.string_attr(owner, "name"), hx.device_of(owner))
        if key not in converted:
            converted[key] = hx.constant(hx.constant_array(owner).astype("float32"), f"{key[0]}.float32", key[1])
        return converted[key]
    return hx.compute("cast", [value], _retyped(value.type, "float32"), device, _IDENTITY)
