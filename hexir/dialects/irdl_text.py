"""Pieces of IRDL text that several op definitions repeat (static text: no IR is built here)."""

from __future__ import annotations

from collections.abc import Sequence


def one_of(name: str, values: Sequence[str]) -> str:
    """`%name` constrained to one of the string attributes `values`."""
    lines = [f'    %{name}{i} = irdl.is "{v}"' for i, v in enumerate(values)]
    lines.append(f"    %{name} = irdl.any_of({', '.join(f'%{name}{i}' for i in range(len(values)))})")
    return "\n".join(lines)


def call_operands(groups: int) -> str:
    """A result and 1 + (groups - 1) optional tensor operand groups, each with its own
    constraint (IRDL binds one variable to one type, so a variadic group has one type)."""
    lines = [f'    %arg{i} = irdl.base "!builtin.tensor"' for i in range(groups)]
    lines.append('    %result = irdl.base "!builtin.tensor"')
    operands = ", ".join(f"arg{i}: {'optional ' if i else ''}%arg{i}" for i in range(groups))
    lines += [f"    irdl.operands({operands})", "    irdl.results(result: %result)"]
    return "\n".join(lines)
