"""share-kernels: calls of identical kernels call one kernel.

Input: a module after lower-to-tir (and cse). Output: the same module in which each set of
kernels that only their names tell apart is one: the later op instances' kernels (the kernel,
its variants, its cpu twin, its other levels' copies) are erased and their `hexir.call`s call
the first's. A transformer's layers are the same shapes over and over: each distinct kernel is
then lowered, optimised and assembled once, and the manifest lists it once (its calls name it).

Two op instances share when their kernels' text is equal with the instance's name taken out
(bodies, records, `hextir.*` attributes: everything the backends and the packager read) and
their calls' types are equal (the manifest's args come from those: symbolic extents by name).
Custom kernels' declarations are left alone (their code is the user's, stored once already).

    func.func @relu_0(%x: memref<4xf32>, %out: memref<4xf32>) attributes {...} { ... }
    func.func @relu_1(%x: memref<4xf32>, %out: memref<4xf32>) attributes {...} { ... }  (the same)
    %1 = "hexir.call"(%0) {callee = @relu_0, ...}
    %2 = "hexir.call"(%1) {callee = @relu_1, ...}
  =>
    func.func @relu_0(...) { ... }
    %1 = "hexir.call"(%0) {callee = @relu_0, ...}
    %2 = "hexir.call"(%1) {callee = @relu_0, ...}
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter

from mlir import ir

from hexir.dialects import hexir as hx
from hexir.dialects import hextir as ht


def share_kernels(module: ir.Module) -> None:
    """Point every call of a kernel set equal to an earlier one at the earlier one; erase it."""
    groups: dict[str, list[ir.Operation]] = {}
    for kernel in ht.kernels(module):
        if ht.custom_of(kernel) is None:
            groups.setdefault(ht.identity_of(kernel).name, []).append(kernel)
    calls: dict[str, list[ir.Operation]] = {}
    for op in hx.main_function(module).regions[0].blocks[0].operations:
        if op.operation.name == "hexir.call":
            calls.setdefault(hx.callee_of(op.operation), []).append(op.operation)
    # what equal sets share, cheap to see: their calls' types and their kernels' signatures (only
    # sets that share it with another are printed: printing is most of this pass's time)
    signatures = {name: repr(([[str(v.type) for v in (*call.operands, *call.results)] for call in calls.get(name, [])],
                              sorted(str(k.attributes["function_type"]) for k in kernels)))
                  for name, kernels in groups.items()}
    alike = Counter(signatures.values())
    first: dict[str, str] = {}  # the set's text, name taken out -> the first instance's name
    for name, kernels in groups.items():
        if alike[signatures[name]] < 2:
            continue
        own = re.compile(re.escape(name) + r"(?!\d)")  # linear_1 in linear_1_cpu@..., not in linear_12
        text = "\n".join(sorted(own.sub("@", kernel.get_asm(use_local_scope=True, assume_verified=True))
                                for kernel in kernels))  # (local scope: str() prints the whole module)
        key = hashlib.sha256(repr((text, signatures[name])).encode()).hexdigest()
        if key not in first:
            first[key] = name
            continue
        for call in calls.get(name, []):
            call.attributes["callee"] = ir.FlatSymbolRefAttr.get(first[key])
        for kernel in kernels:
            kernel.erase()
