"""MergeSpec: the merge configuration, in mergekit's YAML shape plus mergepipe's own keys.

Strict by design: an unknown key anywhere is an error that names it (mergekit silently
ignores misspelled keys, which is a common source of wrong merges). Parameters are checked
against what the operators declare (operators/base.py: Parameter): a parameter's name, value
type and range come from its declaration, and which ones a merge method takes from its own.
Sizes and the budget are parsed once, at validation.
"""

from __future__ import annotations

import difflib
import keyword
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal, NamedTuple

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from mergepipe.config.settings import parse_setting
from mergepipe.config.sizes import Budget, parse_budget, parse_size
from mergepipe.config.stages import NAME, stage_documents, stage_names
from mergepipe.config.templates import check_chat_template
from mergepipe.config.vocabulary import BASE, UNION, TokenSource, VocabularySpec
from mergepipe.errors import BadInput
from mergepipe.operators import OPERATORS, declared_parameters, get_operator
from mergepipe.storage.hub import HUB as HUB_SCHEME
from mergepipe.storage.location import is_remote, join, normalize, split
from mergepipe.storage.model_files import INDEX_FILE, SINGLE_FILE
from mergepipe.storage.reader import read_small_file, stat

# What a config's model entries must name (said wherever one does not).
MODEL_LOCATION = (
    f"a model location is a folder (local or s3://) holding {SINGLE_FILE} or {INDEX_FILE} and its shards, "
    "or a single .safetensors file that holds the whole model"
)

DTypeName = Literal["float32", "float16", "bfloat16", "float64"]


def expert_label(i: int) -> str:
    """How expert i (its position among the experts) is named in plans, ledgers and digests."""
    return f"expert-{i}"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def _field(name: str) -> str:
    return name + "_" if keyword.iskeyword(name) else name


def _parameters_model(model_name: str, names: list[str]) -> type[BaseModel]:
    """A strict model with one optional field per parameter name (aliased where the name is a
    Python keyword, as `lambda`); each value is parsed as its declaration says (settings.py)."""
    declared = declared_parameters()

    def _setting(cls, v: Any, info) -> Any:
        p = declared[cls.model_fields[info.field_name].alias or info.field_name]
        return parse_setting(v, p.kind, p.check)

    fields = {_field(n): (Any, Field(default=None, alias=n if _field(n) != n else None)) for n in sorted(names)}
    return create_model(
        model_name,
        __base__=_Strict,
        __validators__={"_setting": field_validator("*", mode="before")(_setting)},
        **fields,
    )


# The per-model block takes what any operator sets per model; `parameters:` takes every name
# (a per-model one there is every model's default).
ModelParameters = _parameters_model("ModelParameters", [n for n, p in declared_parameters().items() if p.per_model])
GlobalParameters = _parameters_model("GlobalParameters", list(declared_parameters()))

# The parameter names the spec's content held before parameters were declared by operators: they
# always enter digests (null when unset), so earlier merges' digests hold; a name declared later
# enters only where it is set.
_DIGEST_MODEL_KEYS = frozenset({"weight", "density", "gamma", "epsilon"})
_DIGEST_GLOBAL_KEYS = _DIGEST_MODEL_KEYS | {
    "lambda",
    "normalize",
    "rescale",
    "t",
    "filter_wise",
    "nuslerp_flatten",
    "nuslerp_row_wise",
    "int8_mask",
}


def parameter_values(params: BaseModel) -> dict[str, Any]:
    """A parameters block as {mergekit name: parsed setting or None}."""
    return params.model_dump(by_alias=True)


def _digest_form(params: BaseModel, always: frozenset[str]) -> dict[str, Any]:
    return {k: v for k, v in parameter_values(params).items() if k in always or v is not None}


LORA_JOIN = "+"


def lora_parts(ref: str) -> tuple[str, str | None]:
    """A model reference's model and LoRA adapter (mergekit's MODEL+ADAPTER), or (ref, None)."""
    model, plus, adapter = ref.partition(LORA_JOIN)
    return (model, adapter) if plus else (ref, None)


def _reference(v: Any) -> Any:
    """A model reference as mergekit takes one: a location, LOCATION+ADAPTER, or the mapping
    {model: LOCATION, lora: ADAPTER}; kept as a string, LOCATION+ADAPTER."""
    if isinstance(v, dict):
        unknown = sorted(set(v) - {"model", "lora"})
        if unknown:
            raise ValueError(f"a model reference takes `model` and `lora`, not {unknown[0]!r}")
        model, lora = v.get("model"), v.get("lora")
        if not isinstance(model, str) or not (lora is None or isinstance(lora, str)):
            raise ValueError("a model reference is {model: LOCATION, lora: ADAPTER}, both strings")
        v = model if lora is None else f"{model}{LORA_JOIN}{lora}"
    if isinstance(v, str) and (v.count(LORA_JOIN) > 1 or any(not p for p in v.split(LORA_JOIN))):
        raise ValueError(f"{v!r}: a model reference is MODEL or MODEL+ADAPTER (one +, a location each side)")
    return v


class ModelEntry(_Strict):
    model: str
    parameters: ModelParameters = ModelParameters()

    @model_validator(mode="before")
    @classmethod
    def _lora_beside(cls, data: Any) -> Any:
        if isinstance(data, dict) and "lora" in data:  # mergekit ignores it there: refused, not ignored
            raise ValueError(
                "lora: belongs inside the model reference (model: {model: BASE, lora: ADAPTER}, or "
                "model: BASE+ADAPTER), not beside it"
            )
        return data

    @field_validator("model", mode="before")
    @classmethod
    def _model_reference(cls, v: Any) -> Any:
        return _reference(v)


class SliceSource(_Strict):
    """One model's layers [start, end) in an output slice (mergekit's InputSliceDefinition)."""

    model: str
    layer_range: tuple[int, int]
    parameters: ModelParameters = ModelParameters()

    @field_validator("model", mode="before")
    @classmethod
    def _no_lora(cls, v: Any) -> Any:
        v = _reference(v)
        if isinstance(v, str) and LORA_JOIN in v:
            raise ValueError(f"{v!r}: LoRA adapters are merged in the `models:` form, not in slices (yet)")
        return v

    @field_validator("layer_range")
    @classmethod
    def _range(cls, v: tuple[int, int]) -> tuple[int, int]:
        if not 0 <= v[0] < v[1]:
            raise ValueError(f"layer_range must be [start, end) with 0 <= start < end, got {list(v)}")
        return v

    @property
    def length(self) -> int:
        return self.layer_range[1] - self.layer_range[0]


class SliceRoles(NamedTuple):
    """Which of a slice's sources is the base (its position), and which are the experts."""

    base: int
    experts: tuple[int, ...]


class OutputSlice(_Strict):
    """Output layers merged from the same number of layers of each source (mergekit's
    OutputSliceDefinition): its parameters come between a source's own and the global ones."""

    sources: list[SliceSource] = Field(min_length=1)
    base_model: str | None = None
    parameters: GlobalParameters = GlobalParameters()

    @model_validator(mode="before")
    @classmethod
    def _refuse_residual(cls, data: Any) -> Any:
        if isinstance(data, dict) and "residual_weight" in data:
            raise ValueError("residual_weight: not supported by mergepipe (mergekit 0.1.5's merge methods ignore it)")
        return data

    @model_validator(mode="after")
    def _same_length(self) -> "OutputSlice":
        lengths = {s.length for s in self.sources}
        if len(lengths) > 1:
            raise ValueError(f"every source of a slice takes the same number of layers, got {sorted(lengths)}")
        models = [s.model for s in self.sources]
        twice = next((m for m in models if models.count(m) > 1), None)
        if twice is not None:  # mergekit keys a slice's tensors by model: one would silently vanish
            raise ValueError(f"model {twice!r} is a source of this slice twice")
        return self

    @property
    def length(self) -> int:
        return self.sources[0].length


_UNSUPPORTED_KEYS = {
    "modules": "it merges whole models; use the `models:` or `slices:` form",
}


class TokenEntry(_Strict):
    """A `tokenizer.tokens` entry (mergekit's TokenEmbeddingConfig): `source` is a model
    reference, {kind: zero}, or {kind: model_token, model: M, token: T | token_id: N}."""

    source: str | dict[str, Any] | None = None
    force: bool = False

    @field_validator("source", mode="before")
    @classmethod
    def _source(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, dict):
            raise ValueError("a token's source is a model, {kind: zero} or {kind: model_token, model: M, token: T}")
        kind = v.get("kind")
        allowed = {"zero": {"kind"}, "model_token": {"kind", "model", "token", "token_id"}}.get(kind)
        if allowed is None:
            raise ValueError(f"kind: `zero` or `model_token`, got {kind!r}")
        unknown = sorted(set(v) - allowed)
        if unknown:
            raise ValueError(f"{unknown[0]}: not a key of a {kind} source")
        if kind == "model_token":
            if not isinstance(v.get("model"), str):
                raise ValueError("a model_token source names its model")
            if (v.get("token") is None) == (v.get("token_id") is None):
                raise ValueError("a model_token source takes one of token and token_id")
            if v.get("token_id") is not None and (
                isinstance(v["token_id"], bool) or not isinstance(v["token_id"], int)
            ):
                raise ValueError("token_id: a whole number")
        return v

    def typed(self) -> TokenSource:
        s = self.source
        if s is None:
            return TokenSource(force=self.force)
        if isinstance(s, str):
            return TokenSource("model", s, force=self.force)
        if s["kind"] == "zero":
            return TokenSource("zero", force=self.force)
        return TokenSource("model_token", s["model"], s.get("token"), s.get("token_id"), self.force)


class TokenizerSection(_Strict):
    """mergekit's `tokenizer:` section. `tokens` is kept as (token, entry) pairs in the
    config's order (the order tokens are added in), which a mapping recorded as JSON with
    sorted keys would lose; a recorded spec gives it back as such pairs."""

    source: str = UNION
    tokens: list[tuple[str, TokenEntry]] | None = None
    pad_to_multiple_of: int | None = Field(default=None, gt=0)

    @field_validator("tokens", mode="before")
    @classmethod
    def _tokens(cls, v: Any) -> Any:
        return list(v.items()) if isinstance(v, dict) else v


class MergeSpec(_Strict):
    merge_method: str
    # mergekit's linear takes no base; a config without one, for a method that needs none, uses
    # its first model as the reference that deltas are taken against (the _default_base validator).
    base_model: str
    # Set by _default_base where a method whose base is optional (multislerp) was given none: the
    # first model is then the reference and an input, and no base is subtracted (mergekit passes
    # no base tensor). Recorded with the spec, so that a replay merges the same way.
    implicit_base: bool = False
    models: list[ModelEntry] = Field(default_factory=list)
    # mergekit's other form: the output's layers as a sequence of slices of the models' layers
    # (config/views.py turns them into what each input of the merge reads).
    slices: list[OutputSlice] | None = Field(default=None, min_length=1)
    parameters: GlobalParameters = GlobalParameters()
    dtype: DTypeName | None = None
    out_dtype: DTypeName | None = None
    # The output's vocabulary (config/vocabulary.py): `base`, `union` or a model's location; or
    # the `tokenizer:` section, which adds `tokens` and `pad_to_multiple_of` (not both keys).
    tokenizer_source: str | None = None
    tokenizer: TokenizerSection | None = None
    # The output tokenizer's chat template (config/templates.py): `auto` (the inputs' most
    # common), a built-in template's name, or a Jinja template; saved as chat_template.jinja.
    chat_template: str | None = None
    # mergepipe's own keys
    budget: str | int | None = None
    max_error: float | None = None
    block_size: str | int = "1MiB"
    out_shard_size: str | int = "5GB"
    seed: int = 0
    # How the planner values reading an (expert, block) pair, per byte: `delta` is |c|·‖Δ‖, the
    # pair's term in the error bound; `delta_over_sqrt_base` divides it by √‖θ₀‖ of the base
    # block, which kept the held-out loss lower on real fine-tunes (docs/benchmarks.md);
    # `activation` is |c|·√(Σ Δ[r,j]²·(E[x_j²] + f_r)), the energy the delta adds to the layer's
    # output on a calibration's texts (`mergepipe calibrate`). Either way the bound is computed
    # on what the plan leaves out, so it holds.
    rank_by: Literal["delta", "delta_over_sqrt_base", "activation"] = "delta"
    # With rank_by: activation, which calibration of the base: its data's location as calibrated,
    # or a prefix of its digest (default: the base's one calibration).
    calibration: str | None = None
    # Merge experts whose deltas hold NaN or Inf (refused by default). Their blocks are always
    # read, whatever the budget. A permission, not a parameter: it never changes the output.
    allow_nonfinite: bool = False
    # Merge even when the budget admits no expert block (the output is then the base, cast): a
    # budget without room for one block is refused by default, as a mistake. A permission too.
    allow_empty: bool = False
    # The merge process's memory budget (a size; default: config.environment.default_memory).
    # Tensors are merged in row slabs sized from it. It changes no byte of the output.
    memory: str | int | None = None
    # Model ids as mergekit users write them (ORG/NAME, ORG/NAME@REVISION) name Hub models
    # (hf://ORG/NAME) where no local folder of that name lies beside the config.
    hub: bool = False
    # A model card (README.md) in the output, as mergekit writes one by default. It lies outside
    # the digest (it names where the inputs were read), so turning it off changes no digest.
    write_model_card: bool = True
    # fsspec options for object stores (credentials, endpoint_url, …): never shown, saved or hashed.
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False)

    # Parsed once, at validation.
    _budget: Budget = PrivateAttr()
    _block_size: int = PrivateAttr()
    _out_shard_size: int = PrivateAttr()
    _memory: int | None = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        """mergekit keys mergepipe does not implement: refused by name, never ignored."""
        if isinstance(data, dict):
            for key, why in _UNSUPPORTED_KEYS.items():
                if key in data:
                    raise BadInput(f"{key}: not supported by mergepipe ({why})")
            if data.get("tokenizer_source") is not None and data.get("tokenizer") is not None:
                raise BadInput("tokenizer_source and tokenizer: give one of them (tokenizer.source is the same thing)")
        return data

    @field_validator("base_model", mode="before")
    @classmethod
    def _base_reference(cls, v: Any) -> Any:
        return _reference(v)

    @model_validator(mode="before")
    @classmethod
    def _default_base(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("base_model") is None and data.get("merge_method") in OPERATORS:
            models = data.get("models")
            slices = data.get("slices")
            if not models and isinstance(slices, list) and slices and isinstance(slices[0], dict):
                models = slices[0].get("sources")  # mergekit takes the first source as the reference
            first = models[0] if isinstance(models, list) and models else None
            op = OPERATORS[data["merge_method"]]
            if not op.needs_base and isinstance(first, dict) and "model" in first:
                try:
                    reference = _reference(first["model"])
                except ValueError:
                    return data  # the entry's own validation names it
                data = {**data, "base_model": reference} | ({"implicit_base": True} if op.base_optional else {})
        return data

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, v: str | None) -> str | None:
        return None if v is None else check_chat_template(v)

    @field_validator("merge_method")
    @classmethod
    def _known_method(cls, v: str) -> str:
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
        if bool(self.models) == bool(self.slices):
            raise ValueError("give either models or slices (one of them, not both)")
        if self.budget is not None and self.max_error is not None:
            raise ValueError("give either budget or max_error, not both")
        self._budget = parse_budget(self.budget)
        self._block_size = parse_size(self.block_size, key="block_size")
        self._out_shard_size = parse_size(self.out_shard_size, key="out_shard_size")
        self._memory = None if self.memory is None else parse_size(self.memory, key="memory")
        if self._block_size <= 0:
            raise ValueError("block_size must be positive")
        if self._out_shard_size <= 0:
            raise ValueError("out_shard_size must be positive")
        return self

    @property
    def io_budget(self) -> Budget:
        """The byte budget (100% when none was given); max_error, when set, decides instead."""
        return self._budget

    @property
    def block_size_bytes(self) -> int:
        return self._block_size

    @property
    def memory_bytes(self) -> int | None:
        """The config's memory budget, if it gives one."""
        return self._memory

    @property
    def out_shard_size_bytes(self) -> int:
        return self._out_shard_size

    @property
    def budget_label(self) -> str:
        """The budget as the catalog's plans table shows it."""
        return self._budget.describe() if self.max_error is None else f"max_error={self.max_error}"

    @property
    def budget_record(self) -> dict:
        """The budget as a plan records it."""
        return self._budget.as_json() if self.max_error is None else {"kind": "max_error", "value": self.max_error}

    @property
    def rank_by_needs_base(self) -> bool:
        """Whether the ranking needs the base's block energies from the catalog."""
        return self.rank_by == "delta_over_sqrt_base"

    @property
    def vocabulary(self) -> VocabularySpec | None:
        """The output vocabulary the config asks for (None: the base's files, as they are)."""
        if self.tokenizer is not None:
            t = self.tokenizer
            tokens = {k: e.typed() for k, e in t.tokens or ()}
            return VocabularySpec(t.source, tokens, t.pad_to_multiple_of)
        return None if self.tokenizer_source is None else VocabularySpec(self.tokenizer_source)

    @property
    def base_entry(self) -> ModelEntry | None:
        """The base's own entry among `models:`, if the config lists it (mergekit's examples
        often do): its parameters count only where the operator takes the base as an input."""
        return next((m for m in self.models if m.model == self.base_model), None)

    @property
    def expert_entries(self) -> list[tuple[int, ModelEntry]]:
        """(position in `models:`, entry) of each expert, in config order."""
        return [(i, m) for i, m in enumerate(self.models) if m.model != self.base_model]

    @property
    def expert_uris(self) -> list[str]:
        """Each expert's location (the `models:` form; config.views names a slices form's)."""
        return [m.model for _, m in self.expert_entries]

    @property
    def model_uris(self) -> list[str]:
        """Every model location the config names, each once, in order of appearance."""
        named = [self.base_model, *(m.model for m in self.models)]
        named += [s.model for sl in self.slices or () for s in sl.sources] + [
            sl.base_model for sl in self.slices or () if sl.base_model
        ]
        return list(dict.fromkeys(named))

    def slice_roles(self) -> list["SliceRoles"]:
        """Per slice, which source is the base and which are the experts, in order: the k-th
        expert of the merge is each slice's k-th source besides its base. The base of a slice is
        its base_model, else the config's; a method that needs no base takes the slice's first
        source where the config's base is not among them. passthrough copies one source per
        slice, which is then its base."""
        op = get_operator(self.merge_method)
        roles: list[SliceRoles] = []
        for i, sl in enumerate(self.slices or ()):
            models = [s.model for s in sl.sources]
            if op.max_experts == 0:
                if len(models) != 1:
                    raise BadInput(
                        f"slices[{i}].sources: merge_method {self.merge_method!r} copies one source per slice, got {len(models)}"
                    )
                roles.append(SliceRoles(0, ()))
                continue
            base = sl.base_model or self.base_model
            if base not in models:
                if op.needs_base:
                    raise BadInput(
                        f"slices[{i}]: its base model {base} is not among its sources (mergekit merges a slice's sources only)"
                    )
                base = models[0]
            at = models.index(base)
            roles.append(SliceRoles(at, tuple(j for j in range(len(models)) if j != at)))
            if len(roles[-1].experts) != len(roles[0].experts):
                raise BadInput(
                    f"slices[{i}]: {len(roles[-1].experts)} source(s) besides its base, slices[0] has "
                    f"{len(roles[0].experts)} (the k-th of each slice are the same input of the merge)"
                )
        return roles

    def content(self) -> dict:
        """The spec as it enters digests: no model locations (inputs are identified by content),
        no storage options (they may hold credentials), no allow_nonfinite, allow_empty, memory,
        tokenizer_source (they change no byte: the base's tokenizer files are copied either way)
        or write_model_card (the card lies outside the digest). rank_by, chat_template and
        implicit_base enter only when set, so digests from before they existed still hold."""
        exclude = {
            "storage_options",
            "allow_nonfinite",
            "allow_empty",
            "memory",
            "tokenizer_source",
            "tokenizer",
            "hub",
            "write_model_card",
            "calibration",  # a location; the plan records the calibration's digest and its access set
        }
        # Keys that enter only when set, so that digests from before they existed still hold.
        exclude |= {"rank_by"} if self.rank_by == "delta" else set()
        exclude |= {"chat_template"} if self.chat_template is None else set()
        exclude |= set() if self.implicit_base else {"implicit_base"}
        exclude |= {"models"} if self.slices else {"slices"}  # a models: spec's digest is as before slices
        data = self.model_dump(by_alias=True, exclude=exclude)
        data["base_model"] = "base"
        vocabulary = self.vocabulary
        if vocabulary is not None and (vocabulary.source != BASE or vocabulary.tokens or vocabulary.pad_to_multiple_of):
            data["vocabulary"] = self._vocabulary_content(vocabulary)
        data["parameters"] = _digest_form(self.parameters, _DIGEST_GLOBAL_KEYS)
        if self.slices:  # models named by their place among those the config names
            label = {u: "base" if u == self.base_model else f"model-{i}" for i, u in enumerate(self.model_uris)}
            data["slices"] = [
                {
                    "sources": [
                        {
                            "model": label[s.model],
                            "layer_range": list(s.layer_range),
                            "parameters": _digest_form(s.parameters, frozenset()),
                        }
                        for s in sl.sources
                    ],
                    "base_model": label.get(sl.base_model),
                    "parameters": _digest_form(sl.parameters, frozenset()),
                }
                for sl in self.slices
            ]
            data["block_size"] = self.block_size_bytes
            data["out_shard_size"] = self.out_shard_size_bytes
            return data
        experts = iter(range(len(self.models)))
        data["models"] = [
            {
                "model": "base" if m.model == self.base_model else expert_label(next(experts)),
                "parameters": _digest_form(m.parameters, _DIGEST_MODEL_KEYS),
            }
            for m in self.models
        ]
        data["block_size"] = self.block_size_bytes
        data["out_shard_size"] = self.out_shard_size_bytes
        return data

    def _vocabulary_content(self, v: VocabularySpec) -> dict:
        """The vocabulary as it enters digests: models named by their place among the config's."""
        label = {u: "base" if u == self.base_model else f"model-{i}" for i, u in enumerate(self.model_uris)}
        label |= {lora_parts(u)[0]: label[u] for u in self.model_uris if lora_parts(u)[0] not in label}

        def entry(t: TokenSource) -> dict:
            return {**asdict(t), "model": label.get(t.model, t.model)}

        return {
            "source": label.get(v.source, v.source),
            "tokens": [[token, entry(t)] for token, t in v.tokens.items()],
            "pad_to_multiple_of": v.pad_to_multiple_of,
        }

    def recorded(self) -> dict:
        """The spec as plans and manifests record it: model locations, no storage options."""
        return self.model_dump(by_alias=True, exclude={"storage_options", "models" if self.slices else "slices"})


def _keys_at(loc: tuple) -> list[str]:
    """The keys a config may hold where `loc` points (the model at the location's parent)."""
    model: type[BaseModel] | None = MergeSpec
    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        inner = getattr(annotation, "__args__", (annotation,))[0] if annotation is not None else None
        model = inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None
    if model is None:
        return []
    return [f.alias or name for name, f in model.model_fields.items()]


def _format_error(err: ValidationError, source: str) -> str:
    """One line for the first problem; an unknown key comes before a missing one (a misspelled
    required key is both), with the closest known key."""
    errors = err.errors()
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        close = difflib.get_close_matches(str(first["loc"][-1]), _keys_at(first["loc"]), n=1, cutoff=0.6)
        msg = "unknown key" + (f" (did you mean {close[0]}?)" if close else "")
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


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@\S+)?$")


def _resolve_location(uri: str, base_dir: str, hub: bool = False) -> str:
    if "://" in uri:
        return uri
    if hub and _HUB_ID.match(uri) and not is_remote(base_dir) and not (Path(base_dir) / uri.split("@")[0]).exists():
        return HUB_SCHEME + uri
    if is_remote(base_dir):  # a config in an object store: relative models sit beside it
        return normalize(join(base_dir, uri))
    path = Path(uri).expanduser()
    if not path.is_absolute():
        path = Path(base_dir) / path
    return str(path.resolve())


def read_documents(path: str | Path) -> list[Any]:
    """The YAML documents of a config (a local file or an s3:// object, read with the
    environment's credentials): one, or a multi-document config's stages."""
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
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as err:
        raise BadInput(f"{path}: not valid YAML: {err}") from None
    return docs or [None]


def _document(docs: list[Any], path: str, stage: str | None, staged: bool) -> Any:
    """A config's document; of a multi-document one (`staged`), the stage's (None: the final,
    unnamed one), without its `name`."""
    if len(docs) == 1 and stage is None and not (staged and isinstance(docs[0], dict) and NAME in docs[0]):
        return docs[0]
    if not staged:
        raise BadInput(
            f"{path}: a multi-document config (stages, as mergekit-multi runs them): merge it with "
            "--intermediate-dir, where the named stages' outputs go"
        )
    stages = stage_documents(docs, str(path))
    if stage not in stages:
        raise BadInput(f"{path}: no stage named {stage!r} (stages: {', '.join(sorted(stage_names(stages)))})")
    return stages[stage]


def load_spec(
    path: str | Path,
    overrides: dict[str, Any] | None = None,
    stage: str | None = None,
    intermediate_dir: str | None = None,
    document: dict | None = None,
) -> MergeSpec:
    """Read and validate a config, with `overrides` (command-line values such as the budget)
    replacing its keys first; relative model paths are taken relative to the config's folder.
    With `intermediate_dir`, the config may hold stages: `stage`'s document (None: the final
    one), whose models named as stages are those stages' outputs there. With `document`, that
    document is validated as if it were the file at `path` (a search's candidate)."""
    path = str(path)
    docs = read_documents(path) if document is None else [document]
    data = _document(docs, path, stage, staged=intermediate_dir is not None)
    earlier: set[str] = set()
    if intermediate_dir is not None:
        earlier = stage_names(stage_documents(docs, path))
        shared = _shared_options(docs, path)
        if shared and isinstance(data, dict) and "storage_options" not in data:
            data = {**data, "storage_options": shared}
    if overrides and isinstance(data, dict):
        data = {**data, **overrides}
    spec = validate_spec(data, source=path)
    base_dir = split(path)[0] if is_remote(path) else str(Path(path).resolve().parent)
    named = [("base_model", spec.base_model)] + [(f"models[{i}].model", m.model) for i, m in enumerate(spec.models)]
    for i, sl in enumerate(spec.slices or ()):
        named += [(f"slices[{i}].sources[{j}].model", s.model) for j, s in enumerate(sl.sources)]
        named += [(f"slices[{i}].base_model", sl.base_model)] if sl.base_model else []
    for key, ref in named:
        if ref in earlier:
            continue
        where = _resolve_location(lora_parts(ref)[0], base_dir, spec.hub)
        if where.endswith(".safetensors") and stat(join(split(where)[0], INDEX_FILE)) is not None:
            raise BadInput(f"{path}: {key}: {ref!r} is one shard of a sharded model; {MODEL_LOCATION}")

    def at(ref: str) -> str:
        if ref in earlier:  # an earlier stage's output
            return stage_output(intermediate_dir, ref)
        model, adapter = lora_parts(ref)
        if adapter is not None:
            return f"{at(model)}{LORA_JOIN}{_resolve_location(adapter, base_dir, spec.hub)}"
        return _resolve_location(ref, base_dir, spec.hub)

    slices = [
        sl.model_copy(
            update={
                "sources": [s.model_copy(update={"model": at(s.model)}) for s in sl.sources],
                "base_model": sl.base_model and at(sl.base_model),
            }
        )
        for sl in spec.slices or ()
    ]
    resolved = spec.model_copy(
        update={
            "base_model": at(spec.base_model),
            "models": [m.model_copy(update={"model": at(m.model)}) for m in spec.models],
            "slices": slices or None,
        }
    )
    return _resolve_vocabulary(resolved, at, path)


def _resolve_vocabulary(spec: MergeSpec, at, path: str) -> MergeSpec:
    """The vocabulary's model references resolved as the models' are, each one a model of the
    merge (a tokenizer comes from the model, not from an adapter on it)."""
    homes = {lora_parts(u)[0] for u in spec.model_uris} | set(spec.model_uris)
    v = spec.vocabulary
    if spec.slices and v is not None and (v.source != BASE or v.tokens or v.pad_to_multiple_of):
        raise BadInput(f"{path}: a `slices:` merge takes the base's vocabulary (tokenizer_source: base)")

    def model(key: str, ref: str) -> str:
        where = at(ref)
        if where not in homes:
            raise BadInput(f"{path}: {key}: {ref!r} is not among the merge's models")
        return where

    if spec.tokenizer_source not in (None, UNION, BASE):
        return spec.model_copy(update={"tokenizer_source": model("tokenizer_source", spec.tokenizer_source)})
    t = spec.tokenizer
    if t is None:
        return spec
    tokens = []
    for token, e in t.tokens or ():
        key = f"tokenizer.tokens.{token}.source"
        if isinstance(e.source, str):
            e = e.model_copy(update={"source": model(key, e.source)})
        elif isinstance(e.source, dict) and "model" in e.source:
            e = e.model_copy(update={"source": {**e.source, "model": model(key + ".model", e.source["model"])}})
        tokens.append((token, e))
    source = t.source if t.source in (UNION, BASE) else model("tokenizer.source", t.source)
    return spec.model_copy(update={"tokenizer": t.model_copy(update={"source": source, "tokens": tokens or t.tokens})})


def stage_output(intermediate_dir: str, name: str) -> str:
    """Where a multi-document config's stage `name` is written: intermediate_dir/NAME."""
    if is_remote(intermediate_dir):
        return normalize(join(intermediate_dir, name))
    return str(Path(intermediate_dir, name).resolve())


def _shared_options(docs: list[Any], path: str) -> dict[str, Any]:
    """The storage_options of a config's documents: the stages of a multi-document one read
    with one set, given in one document or the same in each."""
    given = [d["storage_options"] for d in docs if isinstance(d, dict) and isinstance(d.get("storage_options"), dict)]
    given = [g for g in given if g]
    if any(g != given[0] for g in given):
        raise BadInput(f"{path}: storage_options: the stages give different ones; give them once (any stage)")
    return dict(given[0]) if given else {}


def storage_options_of(path: str | Path) -> dict[str, Any]:
    """The storage_options of a config that a flow has validated already, for a process that has
    not loaded it (a Dask worker): only that key is read, nothing is validated again."""
    return _shared_options(read_documents(path), str(path))


def check_parameters(spec: MergeSpec) -> None:
    """What can be checked before the tensor names are known: the model count, and that every
    parameter given is one the operator declares (mergekit ignores the others), per model where
    it is set per model (a model's entry, or a source of a slice)."""
    op = get_operator(spec.merge_method)
    if spec.slices:
        k, counted = len(spec.slice_roles()[0].experts), "slices[0].sources"
        shared = [("parameters", spec.parameters)]
        shared += [(f"slices[{i}].parameters", sl.parameters) for i, sl in enumerate(spec.slices)]
        own = [
            (f"slices[{i}].sources[{j}]", s.parameters)
            for i, sl in enumerate(spec.slices)
            for j, s in enumerate(sl.sources)
        ]
    else:
        k, counted = len(spec.expert_entries), "models"
        shared = [("parameters", spec.parameters)]
        own = [(f"models[{i}]", entry.parameters) for i, entry in enumerate(spec.models)]
    if k < op.min_experts or (op.max_experts is not None and k > op.max_experts):
        wanted = str(op.min_experts) if op.max_experts == op.min_experts else f"at least {op.min_experts}"
        raise BadInput(
            f"{counted}: merge_method {spec.merge_method!r} takes {wanted} model(s) besides the base, got {k}"
        )
    per_model = {p.name for p in op.parameters if p.per_model}
    for where, params in shared:
        for name, value in parameter_values(params).items():
            if value is not None and op.declared(name) is None:
                raise BadInput(f"{where}.{name}: not a parameter of merge_method {spec.merge_method!r}")
    for where, params in own:
        for name, value in parameter_values(params).items():
            if value is not None and name not in per_model:
                raise BadInput(f"{where}.parameters.{name}: not a parameter of merge_method {spec.merge_method!r}")
    for p in op.parameters:
        # a slice's value serves its own layers: the global one is needed unless every slice has one
        if p.required and not p.per_model and parameter_values(spec.parameters)[p.name] is None:
            if not spec.slices or any(parameter_values(sl.parameters)[p.name] is None for sl in spec.slices):
                raise BadInput(f"parameters.{p.name}: required by merge_method {spec.merge_method!r}")
