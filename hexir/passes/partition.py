"""partition: give every hexir op a device and insert the transfers between devices.

Input: a hexir module straight from the tracer (or a .mlir file); ops carry
`device = "auto" | "cpu" | "cuda"`. Output: every op carries "cpu" or "cuda", and every
value used on a device other than the one that made it goes through `hexir.transfer`.

Rules, in order of precedence, for the placeable ops (the compute ops and custom_call):
  1. `-placement=hexir.linear=cuda` (the `placement` option) names the op's kind;
  2. the op's own device, recorded by a `with hexir.on(...)` block;
  3. `-placement=*=cuda`: every other op;
  4. "cpu" (a custom kernel with no cpu file: "cuda").
A custom kernel placed on a device it has no file for is a PlacementError at its line.
Function arguments arrive on the host and results return to it; print runs on the host.
A constant lives on the device of its users (one upload of the weights); users on several
devices get a copy of it each.

    %y = "hexir.linear"(%x, %w) {device = "auto"}       %w = "hexir.constant"() {device = "cuda", ...}
    %r = "hexir.relu"(%y) {device = "auto"}       =>    %t = "hexir.transfer"(%x) {source = "cpu", target = "cuda"}
    (placement hexir.linear=cuda)                       %y = "hexir.linear"(%t, %w) {device = "cuda"}
                                                        %u = "hexir.transfer"(%y) {source = "cuda", target = "cpu"}
                                                        %r = "hexir.relu"(%u) {device = "cpu"}
"""

from __future__ import annotations

from collections.abc import Mapping

from mlir import ir

from hexir.dialects import hexir as hx
from hexir.errors import PlacementError
from hexir.passes.common import location_of


def placeable_ops() -> tuple[str, ...]:
    """Ops a `-placement=` or an `on()` block may move between devices."""
    return (*hx.compute_ops(), "hexir.custom_call")


def partition(module: ir.Module, placement: Mapping[str, str]) -> None:
    """Decide every op's device and insert `hexir.transfer` where values cross devices."""
    body = hx.main_function(module).regions[0].blocks[0]
    ops = list(body.operations)
    placeable = placeable_ops()
    for op in ops:
        if op.name in placeable:
            hx.set_device(op, _choose(op, placement.get(op.name) or _own(op) or placement.get("*") or "auto"))
    for op in ops:
        if op.name == "hexir.constant":
            _place_constant(op)

    transfers: dict[tuple[int, str], ir.Value] = {}
    for op in ops:
        wanted = _consumer_device(op)
        for position, operand in enumerate(op.operands):
            have = _producer_device(operand)
            if have == wanted:
                continue
            key = (hash(operand), wanted)
            if key not in transfers:
                with ir.InsertionPoint(op), op.location:
                    transfers[key] = hx.transfer(operand, have, wanted)
            op.operands[position] = transfers[key]


def _own(op: ir.Operation) -> str | None:
    """The device an `on()` block gave the op, None for "auto"."""
    device = hx.device_of(op)
    return None if device == "auto" else device


def _place_constant(op: ir.Operation) -> None:
    """A weight lives where its users run; users on several devices get a copy each (one blob
    in the module, one upload per device), so no weight crosses devices on every call."""
    uses: dict[str, list[tuple[ir.Operation, int]]] = {}
    for use in op.result.uses:
        uses.setdefault(_consumer_device(use.owner), []).append((use.owner, use.operand_number))
    devices = sorted(uses) or ["cpu"]
    hx.set_device(op, devices[0])
    for device in devices[1:]:
        with ir.InsertionPoint(op):
            copy = op.clone()
        hx.set_device(copy, device)
        for user, position in uses[device]:
            user.operands[position] = copy.result


def _choose(op: ir.Operation, wanted: str) -> str:
    """The device for a placeable op: a custom kernel can only run where it has a file."""
    if op.name != "hexir.custom_call":
        return "cpu" if wanted == "auto" else wanted
    available = hx.objects_of(op)
    if wanted == "auto":
        return "cpu" if "cpu" in available else "cuda"
    if wanted not in available:
        kernel = hx.string_attr(op, "kernel")
        raise PlacementError(f"custom kernel {kernel} is placed on {wanted} but has no {wanted} file "
                             f"(it has: {', '.join(available)}); it can only run on {' or '.join(available)}",
                             location_of(op))
    return wanted


def _consumer_device(op: ir.Operation) -> str:
    """Where an op needs its operands: the host for print and return, its source device for
    a transfer (so partitioning a partitioned module adds nothing)."""
    if op.name in ("hexir.print", "func.return"):
        return "cpu"
    if op.name == "hexir.transfer":
        return hx.string_attr(op, "source")
    return hx.device_of(op)


def _producer_device(value: ir.Value) -> str:
    owner = value.owner
    if isinstance(owner, ir.Block):
        return "cpu"
    return hx.device_of(owner.operation if hasattr(owner, "operation") else owner)
