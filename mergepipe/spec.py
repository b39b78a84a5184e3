"""MergeSpec: the merge configuration, in mergekit's YAML shape plus mergepipe's own keys.

Strict by design: an unknown key anywhere is an error that names it (mergekit silently
ignores misspelled keys, which is a common source of wrong merges).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import BadInput
from .sizes import Budget, parse_budget, parse_size
from .storage.location import is_remote, join, normalize, split
from .storage.reader import read_small_file, stat

DTypeName = Literal["float32", "float16", "bfloat16", "float64"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class ModelParameters(_Strict):
    weight: float | None = None
    density: float | None = None
    gamma: float | None = None  # breadcrumbs*
    epsilon: float | None = None  # della*

    @field_validator("density")
    @classmethod
    def _density_range(cls, v: float | None) -> float | None:
        if v is not None and not (0.0 < v <= 1.0):
            raise ValueError(f"density must be in (0, 1], got {v}")
        return v

    @field_validator("gamma", "epsilon")
    @classmethod
    def _share(cls, v: float | None) -> float | None:
        if v is not None and not (0.0 <= v < 1.0):
            raise ValueError(f"must be in [0, 1), got {v}")
        return v


class GlobalParameters(ModelParameters):
    lambda_: float | None = Field(default=None, alias="lambda")
    normalize: bool | None = None
    rescale: bool | None = None
    t: float | None = None  # slerp
    filter_wise: bool | None = None  # model_stock
    nuslerp_flatten: bool | None = None
    nuslerp_row_wise: bool | None = None
    int8_mask: bool | None = None  # accepted for mergekit configs; changes nothing here


class ModelEntry(_Strict):
    model: str
    parameters: ModelParameters = ModelParameters()


class MergeSpec(_Strict):
    merge_method: str
    base_model: str
    models: list[ModelEntry] = Field(min_length=1)
    parameters: GlobalParameters = GlobalParameters()
    dtype: DTypeName | None = None
    out_dtype: DTypeName | None = None
    # mergepipe's own keys
    budget: str | int | None = None
    max_error: float | None = None
    block_size: str | int = "1MiB"
    out_shard_size: str | int = "5GB"
    seed: int = 0
    # Merge experts whose deltas hold NaN or Inf (refused by default). Their blocks are always
    # read, whatever the budget. A permission, not a parameter: it never changes the output.
    allow_nonfinite: bool = False
    # fsspec options for object stores (credentials, endpoint_url, …): never shown, saved or hashed.
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False)

    @field_validator("merge_method")
    @classmethod
    def _known_method(cls, v: str) -> str:
        from .operators import OPERATORS

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

    def budget_obj(self) -> Budget:
        return parse_budget(self.budget)

    @property
    def expert_uris(self) -> list[str]:
        return [m.model for m in self.models]

    def with_overrides(self, **changes: Any) -> "MergeSpec":
        """A copy with some keys replaced (CLI flags such as --budget), validated again."""
        data = self.model_dump(by_alias=True)
        data.update(changes)
        return validate_spec(data, source="command line")

    def content(self) -> dict:
        """The spec as it enters digests: no model locations (inputs are identified by content),
        no storage options (they may hold credentials), no allow_nonfinite (it changes no byte)."""
        data = self.model_dump(by_alias=True, exclude={"storage_options", "allow_nonfinite"})
        data["base_model"] = "base"
        data["models"] = [
            {"model": f"expert-{i}", "parameters": m.parameters.model_dump(by_alias=True)}
            for i, m in enumerate(self.models)
        ]
        data["block_size"] = self.block_size_bytes
        data["out_shard_size"] = self.out_shard_size_bytes
        return data


def _format_error(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
    msg = first["msg"]
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


def resolve_params(spec: MergeSpec):
    """Per-expert parameters and shared ones, with the operator's defaults.

    Precedence as in mergekit: a model's own parameters, then the global `parameters`. A
    parameter the operator does not take is an error naming it (mergekit ignores it)."""
    from .operators import MergeParams, get_operator

    op = get_operator(spec.merge_method)
    g = spec.parameters
    k = len(spec.models)
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
    per_expert: dict[str, list[float]] = {n: [] for n in ("weight", "density", "gamma", "epsilon")}
    for i, entry in enumerate(spec.models):
        for name in per_expert:
            v = getattr(entry.parameters, name)
            v = getattr(g, name) if v is None else v
            if v is None and name == "weight" and "weight" in op.expert_parameters:
                raise BadInput(
                    f"models[{i}].parameters.weight: required by merge_method {spec.merge_method!r} "
                    f"(model {entry.model})"
                )
            per_expert[name].append(float(_EXPERT_DEFAULTS.get(name, 1.0) if v is None else v))
        d, e = per_expert["density"][-1], per_expert["epsilon"][-1]
        if "epsilon" in op.expert_parameters and d < 1 and not (0 < d - e and d + e < 1):
            raise BadInput(f"models[{i}].parameters.epsilon: density ± epsilon must lie in (0, 1), got {d} ± {e}")
    if "t" in getattr(op, "required_shared", ()) and g.t is None:
        raise BadInput(f"parameters.t: required by merge_method {spec.merge_method!r}")
    return MergeParams(
        weights=tuple(per_expert["weight"]),
        densities=tuple(per_expert["density"]),
        lam=1.0 if g.lambda_ is None else float(g.lambda_),
        normalize=op.default_normalize if g.normalize is None else g.normalize,
        rescale=op.default_rescale if g.rescale is None else g.rescale,
        gammas=tuple(per_expert["gamma"]) if "gamma" in op.expert_parameters else (),
        epsilons=tuple(per_expert["epsilon"]) if "epsilon" in op.expert_parameters else (),
        t=g.t,
        filter_wise=bool(g.filter_wise),
        nuslerp_flatten=True if g.nuslerp_flatten is None else g.nuslerp_flatten,
        nuslerp_row_wise=bool(g.nuslerp_row_wise),
    )
