"""MergeSpec: the merge configuration, in mergekit's YAML shape plus mergepipe's own keys.

Strict by design: an unknown key anywhere is an error that names it (mergekit silently
ignores misspelled keys, which is a common source of wrong merges).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mergepipe.errors import BadInput
from mergepipe.index.blocks import layer_count, layer_position
from mergepipe.config.settings import evaluate, parse_setting
from mergepipe.config.sizes import Budget, parse_budget, parse_size
from mergepipe.storage.location import is_remote, join, normalize, split
from mergepipe.storage.reader import read_small_file, stat

DTypeName = Literal["float32", "float16", "bfloat16", "float64"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def _in_density_range(v: float) -> None:
    if not (0.0 < v <= 1.0):
        raise ValueError(f"density must be in (0, 1], got {v}")


def _in_share_range(v: float) -> None:
    if not (0.0 <= v < 1.0):
        raise ValueError(f"must be in [0, 1), got {v}")


# Each parameter's value type and range. A value may be a scalar, a gradient over the layers or
# a list of {filter, value} conditions (settings.py); every number in it is checked.
PARAMETER_KINDS: dict[str, tuple[str, object]] = {
    "weight": ("float", None),
    "density": ("float", _in_density_range),
    "gamma": ("float", _in_share_range),  # breadcrumbs*
    "epsilon": ("float", _in_share_range),  # della*
    "lambda": ("float", None),
    "t": ("float", None),  # slerp
    "normalize": ("bool", None),
    "rescale": ("bool", None),
    "filter_wise": ("bool", None),  # model_stock
    "nuslerp_flatten": ("bool", None),
    "nuslerp_row_wise": ("bool", None),
    "int8_mask": ("bool", None),  # accepted for mergekit configs; changes nothing here
}


class _Parameters(_Strict):
    @field_validator("*", mode="before")
    @classmethod
    def _setting(cls, v: Any, info) -> Any:
        kind, check = PARAMETER_KINDS[cls.model_fields[info.field_name].alias or info.field_name]
        return parse_setting(v, kind, check)


class ModelParameters(_Parameters):
    weight: Any = None
    density: Any = None
    gamma: Any = None
    epsilon: Any = None


class GlobalParameters(ModelParameters):
    lambda_: Any = Field(default=None, alias="lambda")
    normalize: Any = None
    rescale: Any = None
    t: Any = None
    filter_wise: Any = None
    nuslerp_flatten: Any = None
    nuslerp_row_wise: Any = None
    int8_mask: Any = None


class ModelEntry(_Strict):
    model: str
    parameters: ModelParameters = ModelParameters()


_UNSUPPORTED_KEYS = {
    "slices": "it merges whole models with the same layers; use the `models:` form",
    "modules": "it merges whole models; use the `models:` form",
    "tokenizer": "the output takes the base's tokenizer, as with `tokenizer_source: base`",
    "chat_template": "the output takes the base's tokenizer files as they are",
}


class MergeSpec(_Strict):
    merge_method: str
    # mergekit's linear takes no base; a linear config without one uses its first model as the
    # reference that deltas are taken against (the _default_base validator).
    base_model: str
    models: list[ModelEntry] = Field(min_length=1)
    parameters: GlobalParameters = GlobalParameters()
    dtype: DTypeName | None = None
    out_dtype: DTypeName | None = None
    # Only "base": the base's tokenizer files are copied with its other sidecar files.
    tokenizer_source: Literal["base"] | None = None
    # mergepipe's own keys
    budget: str | int | None = None
    max_error: float | None = None
    block_size: str | int = "1MiB"
    out_shard_size: str | int = "5GB"
    seed: int = 0
    # How the planner values reading an (expert, block) pair, per byte: `delta` is |c|·‖Δ‖, the
    # pair's term in the error bound; `delta_over_sqrt_base` divides it by √‖θ₀‖ of the base
    # block, which kept the held-out loss lower on real fine-tunes (docs/benchmarks.md). Either
    # way the bound is computed on what the plan leaves out, so it holds.
    rank_by: Literal["delta", "delta_over_sqrt_base"] = "delta"
    # Merge experts whose deltas hold NaN or Inf (refused by default). Their blocks are always
    # read, whatever the budget. A permission, not a parameter: it never changes the output.
    allow_nonfinite: bool = False
    # fsspec options for object stores (credentials, endpoint_url, …): never shown, saved or hashed.
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        """mergekit keys mergepipe does not implement: refused by name, never ignored."""
        if isinstance(data, dict):
            for key, why in _UNSUPPORTED_KEYS.items():
                if key in data:
                    raise BadInput(f"{key}: not supported by mergepipe ({why})")
            source = data.get("tokenizer_source")
            if source is not None and source != "base":
                raise BadInput(
                    f"tokenizer_source: only `base` is supported (the base's tokenizer files are copied), got {source!r}"
                )
        return data

    @model_validator(mode="before")
    @classmethod
    def _default_base(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("base_model") is None and data.get("merge_method") == "linear":
            models = data.get("models")
            if isinstance(models, list) and models and isinstance(models[0], dict) and "model" in models[0]:
                data = {**data, "base_model": models[0]["model"]}
        return data

    @field_validator("merge_method")
    @classmethod
    def _known_method(cls, v: str) -> str:
        from mergepipe.operators import OPERATORS

        if v not in OPERATORS:
            raise ValueError(f"unknown merge_method {v!r}; known: {', '.join(sorted(OPERATORS))}")
        return v

    @field_validator("max_error")
    @classmethod
    def _max_error_non_negative(cls, v: float | None) -> float | None:
        if v is not None and not (v >= 0):
            raise ValueError(f"max_error must be >= 0, got {v}")
        return v

    @model_validator(mode="after")
    def _check(self) -> "MergeSpec":
        if self.budget is not None and self.max_error is not None:
            raise ValueError("give either budget or max_error, not both")
        parse_budget(self.budget)
        if self.block_size_bytes <= 0:
            raise ValueError("block_size must be positive")
        if self.out_shard_size_bytes <= 0:
            raise ValueError("out_shard_size must be positive")
        return self

    @property
    def block_size_bytes(self) -> int:
        return parse_size(self.block_size, key="block_size")

    @property
    def out_shard_size_bytes(self) -> int:
        return parse_size(self.out_shard_size, key="out_shard_size")

    @property
    def rank_by_needs_base(self) -> bool:
        """Whether the ranking needs the base's block energies from the catalog."""
        return self.rank_by == "delta_over_sqrt_base"

    def budget_obj(self) -> Budget:
        return parse_budget(self.budget)

    @property
    def base_entry(self) -> ModelEntry | None:
        """The base's own entry among `models:`, if the config lists it (mergekit's examples
        often do): its parameters count only where the operator takes the base as an input."""
        return next((m for m in self.models if m.model == self.base_model), None)

    @property
    def expert_entries(self) -> list[ModelEntry]:
        return [m for m in self.models if m.model != self.base_model]

    @property
    def expert_uris(self) -> list[str]:
        return [m.model for m in self.expert_entries]

    def with_overrides(self, **changes: Any) -> "MergeSpec":
        """A copy with some keys replaced (CLI flags such as --budget), validated again."""
        data = self.model_dump(by_alias=True)
        data.update(changes)
        return validate_spec(data, source="command line")

    def content(self) -> dict:
        """The spec as it enters digests: no model locations (inputs are identified by content),
        no storage options (they may hold credentials), no allow_nonfinite or tokenizer_source
        (they change no byte: the base's tokenizer files are copied either way). rank_by enters
        only when it is not the default, so digests from before it existed still hold."""
        exclude = {"storage_options", "allow_nonfinite", "tokenizer_source"} | ({"rank_by"} if self.rank_by == "delta" else set())
        data = self.model_dump(by_alias=True, exclude=exclude)
        data["base_model"] = "base"
        experts = iter(range(len(self.models)))
        data["models"] = [
            {
                "model": "base" if m.model == self.base_model else f"expert-{next(experts)}",
                "parameters": m.parameters.model_dump(by_alias=True),
            }
            for m in self.models
        ]
        data["block_size"] = self.block_size_bytes
        data["out_shard_size"] = self.out_shard_size_bytes
        return data


def _format_error(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif first["type"] == "missing":
        msg = "required key is missing"
    return f"{source}: {loc}: {msg}"


def validate_spec(data: Any, *, source: str) -> MergeSpec:
    if not isinstance(data, dict):
        raise BadInput(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return MergeSpec.model_validate(data)
    except ValidationError as err:
        raise BadInput(_format_error(err, source)) from None
    except BadInput as err:
        raise BadInput(f"{source}: {err}") from None


def _resolve_location(uri: str, base_dir: str) -> str:
    if "://" in uri:
        return uri
    if is_remote(base_dir):  # a config in an object store: relative models sit beside it
        return normalize(join(base_dir, uri))
    path = Path(uri).expanduser()
    if not path.is_absolute():
        path = Path(base_dir) / path
    return str(path.resolve())


def load_spec(path: str | Path) -> MergeSpec:
    """Read a YAML config (a local file or an s3:// object, read with the environment's
    credentials); relative model paths are taken relative to the config's folder."""
    path = str(path)
    if stat(path) is None and not Path(path).is_dir():
        raise BadInput(f"{path}: config file not found")
    try:
        text = read_small_file(path).decode()
    except UnicodeDecodeError:
        raise BadInput(f"{path}: config is not UTF-8 text") from None
    except IsADirectoryError:
        raise BadInput(f"{path}: is a folder, not a config file") from None
    except OSError as err:
        raise BadInput(f"{path}: cannot read config: {err.strerror or err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise BadInput(f"{path}: not valid YAML: {err}") from None
    spec = validate_spec(data, source=path)
    base_dir = split(path)[0] if is_remote(path) else str(Path(path).resolve().parent)
    for key, ref in [("base_model", spec.base_model)] + [(f"models[{i}].model", m.model) for i, m in enumerate(spec.models)]:
        where = _resolve_location(ref, base_dir)
        if "+" in ref and not is_remote(where) and not Path(where).exists():
            raise BadInput(
                f"{path}: {key}: {ref!r} is a LoRA reference (model+adapter), which mergepipe does not merge; "
                "merge the adapter into its model first"
            )
    return spec.model_copy(
        update={
            "base_model": _resolve_location(spec.base_model, base_dir),
            "models": [
                m.model_copy(update={"model": _resolve_location(m.model, base_dir)}) for m in spec.models
            ],
        }
    )


# mergekit's defaults for per-model parameters an operator declares but the config leaves out.
_EXPERT_DEFAULTS = {"density": 1.0, "gamma": 0.01, "epsilon": 0.15}
_PER_EXPERT = ("weight", "density", "gamma", "epsilon")


def check_parameters(spec: MergeSpec) -> None:
    """What can be checked before the tensor names are known: the model count and that every
    parameter given is one the operator takes (mergekit ignores the others)."""
    from mergepipe.operators import get_operator

    op = get_operator(spec.merge_method)
    g = spec.parameters
    k = len(spec.expert_entries)
    if k < op.min_experts or (op.max_experts is not None and k > op.max_experts):
        wanted = str(op.min_experts) if op.max_experts == op.min_experts else f"at least {op.min_experts}"
        raise BadInput(f"models: merge_method {spec.merge_method!r} takes {wanted} model(s) besides the base, got {k}")
    allowed_shared = op.shared_parameters | op.expert_parameters
    for name, value in g.model_dump(by_alias=True).items():
        if value is not None and name not in allowed_shared:
            raise BadInput(f"parameters.{name}: not a parameter of merge_method {spec.merge_method!r}")
    for i, entry in enumerate(spec.models):
        for name, value in entry.parameters.model_dump().items():
            if value is not None and name not in op.expert_parameters:
                raise BadInput(f"models[{i}].parameters.{name}: not a parameter of merge_method {spec.merge_method!r}")
    if "t" in getattr(op, "required_shared", ()) and g.t is None:
        raise BadInput(f"parameters.t: required by merge_method {spec.merge_method!r}")


def _where(tensor: str) -> str:
    return f" for tensor {tensor!r}" if tensor else ""


def resolve_params(spec: MergeSpec, tensor: str = "", t: float = 0.0):
    """The parameters of one tensor at layer position t (see _resolve), after check_parameters."""
    check_parameters(spec)
    return _resolve(spec, tensor, t)


def _resolve(spec: MergeSpec, tensor: str, t: float):
    """The parameters of one tensor at layer position t, with the operator's defaults.

    Precedence as in mergekit: a model's own setting, then the global `parameters`; a setting
    whose filters do not match the tensor falls through to the next level. The base's entry
    among `models:` counts only for linear, where the base is a weighted input; a linear config
    that does not list the base weighs it with a global weight if there is one (as mergekit
    adds it as an input), and leaves it out otherwise."""
    from mergepipe.operators import MergeParams, get_operator

    op = get_operator(spec.merge_method)
    g = spec.parameters

    def shared(name: str, default):
        v = evaluate(getattr(g, name), tensor, t)
        return default if v is None else v

    per_expert: dict[str, list[float]] = {n: [] for n in _PER_EXPERT}
    for i, entry in enumerate(spec.models):
        if entry.model == spec.base_model:
            continue
        for name in _PER_EXPERT:
            v = evaluate(getattr(entry.parameters, name), tensor, t)
            v = evaluate(getattr(g, name), tensor, t) if v is None else v
            if v is None and name == "weight" and "weight" in op.expert_parameters:
                raise BadInput(
                    f"models[{i}].parameters.weight: required by merge_method {spec.merge_method!r}"
                    f"{_where(tensor)} (model {entry.model}); no value, no matching filter and no global weight"
                )
            per_expert[name].append(float(_EXPERT_DEFAULTS.get(name, 1.0) if v is None else v))
        d, e = per_expert["density"][-1], per_expert["epsilon"][-1]
        if "epsilon" in op.expert_parameters and d < 1 and not (0 < d - e and d + e < 1):
            raise BadInput(
                f"models[{i}].parameters.epsilon: density ± epsilon must lie in (0, 1){_where(tensor)}, got {d} ± {e}"
            )
    base_weight = None
    if op.name == "linear":
        base = spec.base_entry
        base_weight = evaluate(base.parameters.weight, tensor, t) if base is not None else None
        base_weight = evaluate(g.weight, tensor, t) if base_weight is None else base_weight
        if base is not None and base_weight is None:
            raise BadInput(
                f"models[{spec.models.index(base)}].parameters.weight: required by merge_method 'linear'"
                f"{_where(tensor)} (the base, model {base.model})"
            )
    if "t" in getattr(op, "required_shared", ()) and shared("t", None) is None:
        raise BadInput(f"parameters.t: required by merge_method {spec.merge_method!r}{_where(tensor)}; no filter matched")
    return MergeParams(
        weights=tuple(per_expert["weight"]),
        densities=tuple(per_expert["density"]),
        lam=float(shared("lambda_", 1.0)),
        normalize=shared("normalize", op.default_normalize),
        rescale=shared("rescale", op.default_rescale),
        gammas=tuple(per_expert["gamma"]) if "gamma" in op.expert_parameters else (),
        epsilons=tuple(per_expert["epsilon"]) if "epsilon" in op.expert_parameters else (),
        t=shared("t", None),
        base_weight=None if base_weight is None else float(base_weight),
        filter_wise=shared("filter_wise", False),
        nuslerp_flatten=shared("nuslerp_flatten", True),
        nuslerp_row_wise=shared("nuslerp_row_wise", False),
    )


def resolve_tensor_params(spec: MergeSpec, tensor_names):
    """Parameters for every tensor of the base, as a ParamTable (each distinct set once).

    Gradients run over the layers: t = layer / (layers - 1), 0 outside the layers."""
    from mergepipe.operators import ParamTable

    check_parameters(spec)
    names = sorted(tensor_names)
    n_layers = layer_count(names)
    return ParamTable.build({name: _resolve(spec, name, layer_position(name, n_layers)) for name in names})
