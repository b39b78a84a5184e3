"""Each tensor's operator parameters, resolved from the spec with mergekit's precedence and the
operator's declared defaults, as a ParamTable (each distinct set once)."""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

from mergepipe.config.settings import evaluate, filters_of
from mergepipe.config.spec import MergeSpec, check_parameters, parameter_values
from mergepipe.errors import BadInput
from mergepipe.index.blocks import layer_count, layer_position
from mergepipe.operators import MergeParams, ParamTable, get_operator
from mergepipe.operators.base import BASE_AT


def _where(tensor: str) -> str:
    return f" for tensor {tensor!r}" if tensor else ""


def resolve_params(spec: MergeSpec, tensor: str = "", t: float = 0.0) -> MergeParams:
    """The parameters of one tensor at layer position t (see _resolve), after check_parameters."""
    check_parameters(spec)
    return _resolve(spec, _Settings.of(spec), tensor, t)


class _Settings(NamedTuple):
    """The spec's parameter blocks as plain mappings, read once for all of a model's tensors."""

    shared: dict[str, Any]
    experts: list[dict[str, Any]]  # in the order of spec.expert_entries
    base: dict[str, Any] | None  # the base's own entry among `models:`, if listed

    @classmethod
    def of(cls, spec: MergeSpec) -> "_Settings":
        base = spec.base_entry
        return cls(
            parameter_values(spec.parameters),
            [parameter_values(entry.parameters) for _, entry in spec.expert_entries],
            parameter_values(base.parameters) if base is not None else None,
        )

    def filters(self) -> tuple[str, ...]:
        """Every substring a condition of any level tests tensor names for."""
        levels = [self.shared, *self.experts] + ([self.base] if self.base is not None else [])
        return tuple(sorted({f for level in levels for s in level.values() for f in filters_of(s)}))


def _resolve(spec: MergeSpec, settings: _Settings, tensor: str, t: float) -> MergeParams:
    """The parameters of one tensor at layer position t, with the operator's defaults.

    Precedence as in mergekit: a model's own setting, then the global `parameters`; a setting
    whose filters do not match the tensor falls through to the next level. Where the operator
    weighs the base as an input (linear), the base's entry among `models:` gets its own values;
    a config that does not list the base weighs it with a global value if there is one (as
    mergekit adds it as an input), and leaves it out otherwise."""
    op = get_operator(spec.merge_method)

    def value(name: str, own: dict[str, Any] | None) -> Any:
        v = evaluate(own[name], tensor, t) if own is not None else None
        return evaluate(settings.shared[name], tensor, t) if v is None else v

    resolved: dict[str, Any] = {}
    experts = spec.expert_entries
    for p in op.parameters:
        if p.per_model:
            values = []
            for (i, entry), own in zip(experts, settings.experts):
                v = value(p.name, own)
                if v is None and p.required:
                    raise BadInput(
                        f"models[{i}].parameters.{p.name}: required by merge_method {spec.merge_method!r}"
                        f"{_where(tensor)} (model {entry.model}); no value, no matching filter and no global {p.name}"
                    )
                values.append(
                    float(p.default if v is None else v) if p.kind == "float" else bool(p.default if v is None else v)
                )
            resolved[p.name] = tuple(values)
        else:
            v = value(p.name, None)
            if v is None and p.required:
                raise BadInput(
                    f"parameters.{p.name}: required by merge_method {spec.merge_method!r}{_where(tensor)}; no filter matched"
                )
            resolved[p.name] = p.default if v is None else (float(v) if p.kind == "float" else v)
    base_values = None
    if op.base_weighted:
        entry = spec.base_entry
        base_values = {p.name: value(p.name, settings.base) for p in op.parameters if p.per_model}
        for p in op.parameters:
            if p.per_model and p.required and entry is not None and base_values[p.name] is None:
                raise BadInput(
                    f"models[{spec.models.index(entry)}].parameters.{p.name}: required by merge_method {spec.merge_method!r}"
                    f"{_where(tensor)} (the base, model {entry.model})"
                )
        if all(v is None for v in base_values.values()):
            base_values = None  # not listed and no global value: the base is not an input
        else:
            base_values = {k: None if v is None else float(v) for k, v in base_values.items()}
    if op.base_among_inputs and (base_values is not None or not op.base_weighted):
        # where mergekit puts the base among the inputs: at its own entry, else after the
        # models; first is the default, left out so that such plans keep their digests
        entry = spec.base_entry
        at = len(experts) if entry is None else spec.models.index(entry)
        if at:
            resolved[BASE_AT] = at
    params = MergeParams.of(len(experts), resolved, base_values)
    problem = op.check(params)
    if problem is not None:
        name, position, why = problem
        raise BadInput(f"models[{experts[position][0]}].parameters.{name}: {why}{_where(tensor)}")
    return params


# The last resolution, with the spec and the names it was made for: the stages of one merge
# (the config check, the planner, the plan) ask for the same table, which costs time per tensor.
_last: tuple | None = None
_last_lock = threading.Lock()


def resolve_tensor_params(spec: MergeSpec, tensor_names) -> ParamTable:
    """Parameters for every tensor of the base, as a ParamTable (each distinct set once).

    Gradients run over the layers: t = layer / (layers - 1), 0 outside the layers. Asked again
    for the same spec and names objects, it returns the same table."""
    global _last
    with _last_lock:
        if _last is not None and _last[0] is spec and _last[1] is tensor_names:
            return _last[2]
    check_parameters(spec)
    names = sorted(tensor_names)
    n_layers = layer_count(names)
    settings = _Settings.of(spec)
    # A tensor's parameters depend on its name through its layer position and the filters it
    # matches: each distinct (position, matches) is resolved once, for the first tensor (in
    # name order) that has it, so a refusal names the same tensor as resolving each would.
    filters = settings.filters()
    resolved: dict[tuple, MergeParams] = {}
    distinct: dict[MergeParams, MergeParams] = {}
    per_tensor = {}
    for name in names:
        t = layer_position(name, n_layers)
        key = (t, *(f in name for f in filters))
        params = resolved.get(key)
        if params is None:  # one object for equal sets: the table then compares them by identity
            params = resolved[key] = distinct.setdefault(p := _resolve(spec, settings, name, t), p)
        per_tensor[name] = params
    table = ParamTable.build(per_tensor)
    with _last_lock:
        _last = (spec, tensor_names, table)
    return table
