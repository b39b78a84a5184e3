"""Merge operators: pure torch functions over fp32 tensors, no I/O, in a registry by mergekit name.

An operator (operators/base.py: Operator) gets the base tensor and the experts through an
ExpertSource (an omitted block holds the base's values, i.e. a zero delta) and returns the
merged fp32 tensor. A new method is one file with an Operator subclass plus its line below.
"""

from __future__ import annotations

from mergepipe.operators.arcee_fusion import ArceeFusion
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
from mergepipe.operators.karcher import Karcher
from mergepipe.operators.linear import Linear
from mergepipe.operators.model_stock import ModelStock
from mergepipe.operators.multislerp import MultiSlerp
from mergepipe.operators.nearswap import NearSwap
from mergepipe.operators.nuslerp import NuSlerp
from mergepipe.operators.passthrough import Passthrough
from mergepipe.operators.ram import Ram, RamPlusTL
from mergepipe.operators.sce import Sce
from mergepipe.operators.slerp import Slerp

OPERATORS: dict[str, Operator] = {
    op.name: op
    for op in (
        Linear(),
        *GTA_OPERATORS,
        Slerp(),
        NuSlerp(),
        ModelStock(),
        NearSwap(),
        Ram(),
        RamPlusTL(),
        Karcher(),
        MultiSlerp(),
        Sce(),
        ArceeFusion(),
        Passthrough(),
    )
}


def get_operator(name: str) -> Operator:
    return OPERATORS[name]


def declared_parameters() -> dict[str, Parameter]:
    """Every parameter name any operator takes, with its declaration: what a config may name.
    Operators that share a name declare the same kind and range; whether it is set per model is
    each operator's (della's epsilon is, ram's is not), and check_parameters holds a config to it."""
    found: dict[str, Parameter] = {}
    for op in OPERATORS.values():
        for p in op.parameters:
            seen = found.setdefault(p.name, p)
            if p.per_model and not seen.per_model:  # the per-model block takes the name
                found[p.name] = seen = p
            if (seen.kind, seen.check) != (p.kind, p.check):
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
