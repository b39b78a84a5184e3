"""Merge operators: pure torch functions over fp32 tensors, no I/O, in a registry by mergekit name.

An operator (operators/base.py: Operator) gets the base tensor and the experts through an
ExpertSource (an omitted block holds the base's values, i.e. a zero delta) and returns the
merged fp32 tensor. A new method is one file with an Operator subclass plus its line below.
"""

from __future__ import annotations

from mergepipe.operators.base import (
    ExpertSource,
    MergeParams,
    Operator,
    Parameter,
    ParamTable,
    TensorContext,
    WholeTensors,
)
from mergepipe.operators.gta import GTA_OPERATORS
from mergepipe.operators.linear import Linear
from mergepipe.operators.model_stock import ModelStock
from mergepipe.operators.nuslerp import NuSlerp
from mergepipe.operators.slerp import Slerp

OPERATORS: dict[str, Operator] = {
    op.name: op
    for op in (
        Linear(),
        *GTA_OPERATORS,
        Slerp(),
        NuSlerp(),
        ModelStock(),
    )
}


def get_operator(name: str) -> Operator:
    return OPERATORS[name]


def declared_parameters() -> dict[str, Parameter]:
    """Every parameter name any operator takes, with its declaration: what a config may name.
    Operators that share a name declare the same kind, range and per-model form."""
    found: dict[str, Parameter] = {}
    for op in OPERATORS.values():
        for p in op.parameters:
            seen = found.setdefault(p.name, p)
            if (seen.kind, seen.per_model, seen.check) != (p.kind, p.per_model, p.check):
                raise AssertionError(f"operators declare parameter {p.name!r} differently ({op.name})")
    return found


__all__ = [
    "OPERATORS",
    "ExpertSource",
    "MergeParams",
    "Operator",
    "Parameter",
    "ParamTable",
    "TensorContext",
    "WholeTensors",
    "declared_parameters",
    "get_operator",
]
