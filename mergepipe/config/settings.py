"""Parameter settings as mergekit writes them: a scalar, a gradient over the layers, or a list of
`{filter, value}` conditions. Pure functions: parsing (with checks that name what is wrong) and
evaluation for one tensor at one layer position.

Semantics follow mergekit 0.1.5's `evaluate_setting`:
- a numeric list is a gradient, interpolated piecewise-linearly at t in [0, 1];
- a list of booleans or strings selects `values[int(t * (n - 1))]`;
- conditions are tried in order: no filter or "*" matches every tensor, otherwise the filter is
  a plain substring of the tensor name; the first match's value is evaluated; no match gives
  None, and the caller falls through to the next precedence level.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Literal

Kind = Literal["float", "bool"]
# A parsed setting is plain JSON data (it enters the spec's digest): a float or bool, a list of
# them, or a list of {"filter": str | None, "value": scalar | list}.
Setting = Any


def _scalar(v: Any, kind: Kind, check: Callable[[float], None] | None) -> float | bool:
    if kind == "bool":
        if not isinstance(v, bool):
            raise ValueError(f"expected true or false, got {v!r}")
        return v
    if isinstance(v, bool):
        raise ValueError(f"expected a number, got {v!r}")
    if isinstance(v, str):  # YAML reads 1e-3 (no dot) as a string; mergekit takes it as a number
        try:
            v = float(v)
        except ValueError:
            raise ValueError(f"expected a number, got {v!r}") from None
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"expected a finite number, got {v!r}")
    v = float(v)
    if check is not None:
        check(v)
    return v


def _values(v: Any, kind: Kind, check) -> float | bool | list:
    if isinstance(v, list):
        if not v:
            raise ValueError("an empty list")
        return [_scalar(e, kind, check) for e in v]
    return _scalar(v, kind, check)


def parse_setting(raw: Any, kind: Kind, check: Callable[[float], None] | None = None) -> Setting:
    """Check and normalise one parameter's setting (numbers become floats).

    `check` validates each number; because interpolation stays between neighbouring entries,
    a range that every entry satisfies holds for every resolved value too."""
    if raw is None:
        return None
    if isinstance(raw, dict):  # a single condition
        raw = [raw]
    if isinstance(raw, list) and any(isinstance(e, dict) for e in raw):
        out = []
        for i, cond in enumerate(raw):
            if not isinstance(cond, dict):
                raise ValueError(f"[{i}]: mixes conditions ({{filter, value}}) with plain values")
            unknown = set(cond) - {"filter", "value"}
            if unknown:
                raise ValueError(f"[{i}].{sorted(unknown)[0]}: unknown key (a condition has `filter` and `value`)")
            if "value" not in cond:
                raise ValueError(f"[{i}].value: required key is missing")
            f = cond.get("filter")
            if f is not None and not isinstance(f, str):
                raise ValueError(f"[{i}].filter: expected a substring of tensor names, got {f!r}")
            try:
                value = _values(cond["value"], kind, check)
            except ValueError as err:
                raise ValueError(f"[{i}].value: {err}") from None
            out.append({"filter": f, "value": value})
        return out
    return _values(raw, kind, check)


def _interpolate(values: list, t: float) -> float | bool:
    n = len(values)
    if isinstance(values[0], bool):
        return values[int(t * (n - 1))]
    scaled = t * (n - 1)
    i0 = int(scaled)
    i1 = min(n - 1, i0 + 1)
    frac = scaled - i0
    return (1 - frac) * values[i0] + frac * values[i1]


def filters_of(setting: Setting) -> list[str]:
    """The substrings a setting's conditions test tensor names for: evaluate depends on the
    tensor's name through these alone."""
    if isinstance(setting, list) and setting and isinstance(setting[0], dict):
        return [c["filter"] for c in setting if c["filter"] not in (None, "*")]
    return []


def evaluate(setting: Setting, tensor: str, t: float) -> float | bool | None:
    """The value of a parsed setting for one tensor at layer position t; None if no condition
    matches (resolution then falls through to the next precedence level)."""
    if setting is None:
        return None
    if isinstance(setting, list) and setting and isinstance(setting[0], dict):
        for cond in setting:
            f = cond["filter"]
            if f is None or f == "*" or (tensor and f in tensor):
                return evaluate(cond["value"], tensor, t)
        return None
    if isinstance(setting, list):
        return _interpolate(setting, t)
    return setting
