"""Each tensor's operator parameters, resolved from the spec with mergekit's precedence and the
operator's declared defaults, as a ParamTable (each distinct set once)."""

from __future__ import annotations

import threading
from bisect import bisect_right
from typing import Any, NamedTuple

from mergepipe.config.settings import evaluate, filters_of
from mergepipe.config.spec import MergeSpec, check_parameters, parameter_values
from mergepipe.errors import BadInput
from mergepipe.index.blocks import before_layers, layer_count, layer_index, layer_position, with_layer
from mergepipe.operators import MergeParams, ParamTable, get_operator
from mergepipe.operators.base import BASE_AT


def _where(tensor: str) -> str:
    return f" for tensor {tensor!r}" if tensor else ""


def resolve_params(spec: MergeSpec, tensor: str = "", t: float = 0.0) -> MergeParams:
    """The parameters of one tensor at layer position t (see _resolve), after check_parameters."""
    check_parameters(spec)
    return _resolve(spec, _Settings.of(spec), tensor, t)


class _Settings(NamedTuple):
    """The parameter blocks that apply to a tensor, as plain mappings, read once for all of a
    model's tensors (or of a slice's). Each value is looked up in a model's own block, then in
    `shared` in turn (a slice's parameters, then the global ones)."""

    shared: tuple[dict[str, Any], ...]
    experts: list[dict[str, Any]]  # in the order of the merge's experts
    base: dict[str, Any] | None  # the base's own entry among the inputs, if listed
    expert_where: list[str]  # where each expert's block is, for messages: models[2], slices[1].sources[0]
    expert_models: list[str]
    base_where: str | None
    base_model: str  # the base's location (in a slice: its source's)
    base_at: int  # the base's place among the inputs in mergekit's order: its entry, else last
    # A slice's source layer less the output layer it becomes, per expert and for the base: a
    # model's settings test their filters against its own tensor's name, as mergekit's do.
    expert_shifts: tuple[int, ...]
    base_shift: int = 0

    @classmethod
    def of(cls, spec: MergeSpec) -> "_Settings":
        base = spec.base_entry
        experts = spec.expert_entries
        return cls(
            (parameter_values(spec.parameters),),
            [parameter_values(entry.parameters) for _, entry in experts],
            parameter_values(base.parameters) if base is not None else None,
            [f"models[{i}]" for i, _ in experts],
            [entry.model for _, entry in experts],
            None if base is None else f"models[{spec.models.index(base)}]",
            spec.base_model,
            len(experts) if base is None else spec.models.index(base),
            (0,) * len(experts),
        )

    @classmethod
    def of_slices(cls, spec: MergeSpec) -> list["_Settings"]:
        """One per slice: its sources' blocks, its own parameters before the global ones."""
        out, first_layer = [], 0
        for i, (sl, roles) in enumerate(zip(spec.slices, spec.slice_roles())):
            shift = [src.layer_range[0] - first_layer for src in sl.sources]
            out.append(
                cls(
                    (parameter_values(sl.parameters), parameter_values(spec.parameters)),
                    [parameter_values(sl.sources[j].parameters) for j in roles.experts],
                    parameter_values(sl.sources[roles.base].parameters),
                    [f"slices[{i}].sources[{j}]" for j in roles.experts],
                    [sl.sources[j].model for j in roles.experts],
                    f"slices[{i}].sources[{roles.base}]",
                    sl.sources[roles.base].model,
                    roles.base,
                    tuple(shift[j] for j in roles.experts),
                    shift[roles.base],
                )
            )
            first_layer += sl.length
        return out

    def input_names(self, tensor: str) -> tuple[str, ...]:
        """The tensor's name in each expert's source, then in the base's (its name in the
        output for a tensor outside the layers, and in the `models:` form)."""
        shifts = (*self.expert_shifts, self.base_shift)
        i = layer_index(tensor) if tensor and any(shifts) else None  # most configs shift nothing
        return tuple(tensor if i is None or not d else with_layer(tensor, i + d) for d in shifts)

    def filters(self) -> tuple[str, ...]:
        """Every substring a condition of any level tests tensor names for."""
        levels = [*self.shared, *self.experts] + ([self.base] if self.base is not None else [])
        return tuple(sorted({f for level in levels for s in level.values() for f in filters_of(s)}))


def _resolve(spec: MergeSpec, settings: _Settings, tensor: str, t: float) -> MergeParams:
    """The parameters of one tensor at layer position t, with the operator's defaults.

    Precedence as in mergekit: a model's own setting, then a slice's, then the global
    `parameters`; a setting whose filters do not match the tensor falls through to the next
    level. Where the operator weighs the base as an input (linear), the base's entry among the
    inputs gets its own values; a config that does not list the base weighs it with a global
    value if there is one (as mergekit adds it as an input), and leaves it out otherwise."""
    op = get_operator(spec.merge_method)
    *expert_names, base_name = settings.input_names(tensor)

    def value(name: str, own: dict[str, Any] | None, as_named: str = tensor) -> Any:
        """The first level that gives a value: a model's setting (`own`) and those below it are
        tested against that model's tensor name (`as_named`), as mergekit tests them."""
        for level in ((own,) if own is not None else ()) + settings.shared:
            v = evaluate(level[name], as_named, t)
            if v is not None:
                return v
        return None

    resolved: dict[str, Any] = {}
    for p in op.parameters:
        if p.per_model:
            values = []
            for where, model, own, named in zip(
                settings.expert_where, settings.expert_models, settings.experts, expert_names
            ):
                v = value(p.name, own, named)
                if v is None and p.required:
                    raise BadInput(
                        f"{where}.parameters.{p.name}: required by merge_method {spec.merge_method!r}"
                        f"{_where(tensor)} (model {model}); no value, no matching filter and no global {p.name}"
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
    n_experts = len(settings.experts)
    implicit = op.base_optional and spec.implicit_base
    if op.base_weighted or implicit:
        base_values = {p.name: value(p.name, settings.base, base_name) for p in op.parameters if p.per_model}
        for p in op.parameters:
            if p.per_model and p.required and settings.base is not None and base_values[p.name] is None:
                raise BadInput(
                    f"{settings.base_where}.parameters.{p.name}: required by merge_method {spec.merge_method!r}"
                    f"{_where(tensor)} (the base, model {settings.base_model})"
                )
        if all(v is None for v in base_values.values()):
            base_values = None  # not listed and no global value: the base is not an input
        else:
            base_values = {k: None if v is None else float(v) for k, v in base_values.items()}
    if (op.base_among_inputs or implicit) and (base_values is not None or not op.base_weighted):
        # where mergekit puts the base among the inputs: at its own entry, else after the
        # models; first is the default, left out so that such plans keep their digests
        if settings.base_at:
            resolved[BASE_AT] = settings.base_at
    params = MergeParams.of(n_experts, resolved, base_values)
    problem = op.check(params)
    if problem is not None:
        name, position, why = problem
        raise BadInput(f"{settings.expert_where[position]}.parameters.{name}: {why}{_where(tensor)}")
    return params


def _slice_positions(spec: MergeSpec, names: list[str]):
    """name -> (slice, t) as mergekit places a tensor: in the slice whose output layers hold it,
    at t = its layer within the slice / (the slice's layers - 1), 1 in a slice of one layer; the
    tensors before the layers in the first slice and those after in the last, at t = 0. The
    `models:` form is one slice of every layer."""
    if not spec.slices:
        n_layers = layer_count(names)
        return lambda name: (0, layer_position(name, n_layers))
    starts = [0]
    for sl in spec.slices:
        starts.append(starts[-1] + sl.length)

    def where(name: str) -> tuple[int, float]:
        i = layer_index(name)
        if i is None:
            return (0 if before_layers(name) else len(spec.slices) - 1), 0.0
        s = bisect_right(starts, i) - 1
        n = spec.slices[s].length
        return s, (i - starts[s]) / (n - 1) if n > 1 else 1.0

    return where


# The last resolution, with the spec and the names it was made for: the stages of one merge
# (the config check, the planner, the plan) ask for the same table, which costs time per tensor.
_last: tuple | None = None
_last_lock = threading.Lock()


def resolve_tensor_params(spec: MergeSpec, tensor_names) -> ParamTable:
    """Parameters for every tensor of the base, as a ParamTable (each distinct set once).

    Gradients run over the layers (of each slice, for `slices:`): t = layer / (layers - 1), 0
    outside the layers. Asked again for the same spec and names objects, it returns the same
    table."""
    global _last
    with _last_lock:
        if _last is not None and _last[0] is spec and _last[1] is tensor_names:
            return _last[2]
    check_parameters(spec)
    names = sorted(tensor_names)
    where = _slice_positions(spec, names)
    all_settings = _Settings.of_slices(spec) if spec.slices else [_Settings.of(spec)]
    # A tensor's parameters depend on its name through its slice, its layer position and the
    # filters its names (in the output, in each input) match: each distinct (slice, position,
    # matches) is resolved once, for the first tensor (in name order) that has it, so a refusal
    # names the same tensor as resolving each would.
    filters = tuple(sorted({f for settings in all_settings for f in settings.filters()}))
    resolved: dict[tuple, MergeParams] = {}
    distinct: dict[MergeParams, MergeParams] = {}
    per_tensor = {}
    for name in names:
        s, t = where(name)
        inputs = all_settings[s].input_names(name)
        key = (s, t, *(f in n for n in (name, *inputs) for f in filters))
        params = resolved.get(key)
        if params is None:  # one object for equal sets: the table then compares them by identity
            params = resolved[key] = distinct.setdefault(p := _resolve(spec, all_settings[s], name, t), p)
        per_tensor[name] = params
    table = ParamTable.build(per_tensor)
    with _last_lock:
        _last = (spec, tensor_names, table)
    return table
