"""The operator contract: what every merge method declares and what the executor calls.

A merge method is one subclass of `Operator` (in its own file) plus a line in the registry
(operators/__init__.py). It declares its parameters with `Parameter` (name, kind, per model or
shared, default, range), and the config is validated against those declarations generically.
It reads experts through an `ExpertSource`: the executor's lazy view of the planned rows, or
`WholeTensors` over plain tensors (tests, parity checks).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal

from mergepipe import torch
from mergepipe.operators.draws import default_keep, default_sample
from mergepipe.operators.rows import ExpertRows, as_rows

Kind = Literal["float", "bool"]


@dataclass(frozen=True)
class Parameter:
    """One parameter an operator takes, in mergekit's name.

    per_model: set per model (a value under `parameters:` is every model's default), else set
    once under `parameters:`. default None with required False: the operator reads None.
    check: validates each number (a range); a gradient between valid numbers stays valid."""

    name: str
    kind: Kind = "float"
    per_model: bool = False
    default: Any = None
    required: bool = False
    check: Callable[[float], None] | None = field(default=None, compare=False)


def _density_range(v: float) -> None:
    if not (0.0 < v <= 1.0):
        raise ValueError(f"density must be in (0, 1], got {v}")


def _share_range(v: float) -> None:
    if not (0.0 <= v < 1.0):
        raise ValueError(f"must be in [0, 1), got {v}")


# Declarations several operators share (mergekit's names and defaults).
WEIGHT = Parameter("weight", per_model=True, required=True)
DENSITY = Parameter("density", per_model=True, default=1.0, check=_density_range)
GAMMA = Parameter(
    "gamma", per_model=True, default=0.01, check=_share_range
)  # breadcrumbs: share of the largest |delta| dropped
EPSILON = Parameter("epsilon", per_model=True, default=0.15, check=_share_range)  # della: spread of keep probabilities
LAMBDA = Parameter("lambda", default=1.0)
# The resolved value that places the base among the inputs (Operator.base_among_inputs): set by
# the planner, not by a config.
BASE_AT = "base_at"
# Accepted for mergekit configs; changes nothing here (merges run in fp32).
INT8_MASK = Parameter("int8_mask", "bool", default=False)


def flag(name: str, default: bool) -> Parameter:
    """A shared true/false parameter."""
    return Parameter(name, "bool", default=default)


@dataclass(frozen=True)
class MergeParams:
    """One tensor's resolved parameters, by mergekit name: a per-model parameter as a tuple over
    the experts (config order), a shared one as its value. `base` holds the base's own per-model
    values where the base is a weighted input (linear), else None. Hashable: a ParamTable keeps
    each distinct set once."""

    n_experts: int
    values: tuple[tuple[str, Any], ...] = ()
    base: tuple[tuple[str, Any], ...] | None = None

    @classmethod
    def of(cls, n_experts: int, values: dict[str, Any], base: dict[str, Any] | None = None) -> "MergeParams":
        def freeze(d: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
            return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))

        return cls(n_experts, freeze(values), None if base is None else freeze(base))

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", dict(self.values))  # slab loops look values up often
        # A table of 100k tensors hashes its sets once per tensor.
        object.__setattr__(self, "_hash", hash((self.n_experts, self.values, self.base)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # Rebuilt from the fields where unpickled: str hashes differ from process to process.
        return (MergeParams, (self.n_experts, self.values, self.base))

    def __getitem__(self, name: str) -> Any:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"parameter {name!r} was not resolved for this operator") from None

    def get(self, name: str, default: Any = None) -> Any:
        return self._by_name.get(name, default)

    def base_value(self, name: str) -> Any:
        """The base's own value of a per-model parameter; None when the base is not an input."""
        return None if self.base is None else dict(self.base).get(name)

    def as_json(self) -> dict:
        return {
            "n_experts": self.n_experts,
            "values": {k: list(v) if isinstance(v, tuple) else v for k, v in self.values},
            "base": None if self.base is None else dict(self.base),
        }

    @classmethod
    def from_json(cls, data: dict) -> "MergeParams":
        return cls.of(data["n_experts"], data["values"], data["base"])


@dataclass(frozen=True)
class ParamTable:
    """Parameters per tensor (filters and gradients make them differ): each distinct set once,
    and for each tensor the index of its set. Tensors not listed take set 0, so a config
    without filters or gradients is one set and an empty map."""

    sets: tuple[MergeParams, ...]
    by_tensor: dict[str, int] = field(default_factory=dict)

    @classmethod
    def build(cls, per_tensor: dict[str, MergeParams]) -> "ParamTable":
        counts: dict[MergeParams, int] = {}
        for p in per_tensor.values():
            counts[p] = counts.get(p, 0) + 1
        # The most common set first (ties: first seen), so the map lists only the exceptions.
        sets = sorted(counts, key=lambda p: -counts[p])
        index = {p: i for i, p in enumerate(sets)}
        return cls(tuple(sets), {n: index[p] for n, p in sorted(per_tensor.items()) if index[p]})

    def for_tensor(self, name: str) -> MergeParams:
        return self.sets[self.by_tensor.get(name, 0)]

    def as_json(self) -> dict:
        return {"sets": [p.as_json() for p in self.sets], "by_tensor": dict(self.by_tensor)}

    @classmethod
    def from_json(cls, data: dict) -> "ParamTable":
        return cls(tuple(MergeParams.from_json(p) for p in data["sets"]), dict(data["by_tensor"]))


@dataclass(frozen=True)
class TensorContext:
    """What an operator may know about the tensor besides its values.

    block_rows: the (row_start, row_end) ranges of the tensor's blocks along dim 0, so that
    stochastic operators can seed per block and never depend on scheduling.
    keep: draws a keep-mask for an expert from per-element keep probabilities (a tensor of the
    delta's shape, or a 0-d one); by default from generators seeded per block. Tests replace it
    to replay masks another implementation drew.
    sample: draws positions of a flattened tensor with replacement (n, size), seeded by the
    spec's seed and the tensor's name; tests replace it too.
    base_reusable: merge() may overwrite `base` with its result (one tensor-sized buffer fewer).
    nonzero_at_most: per expert, at most how many elements of its delta are nonzero (None or
    missing: unknown), from the index's statistics, so that a search can end before a pass."""

    name: str
    block_rows: tuple[tuple[int, int], ...]
    seed: int
    keep: Callable[[int, torch.Tensor, "TensorContext"], torch.Tensor] = field(default=default_keep, compare=False)
    sample: Callable[[int, int, "TensorContext"], torch.Tensor] = field(default=default_sample, compare=False)
    base_reusable: bool = field(default=False, compare=False)
    nonzero_at_most: tuple[int | None, ...] = field(default=(), compare=False)


class ExpertSource(Sequence):
    """The experts of one tensor as an operator reads them.

    source[k] is expert k's whole tensor in fp32 (the base's values where it was not read);
    rows(k) its planned rows as stored (None: nothing read, a zero delta), which to_compute
    converts to fp32. base is the fp32 base, made when first asked for; widened is it once made
    (or None); base_stored the base as stored, when the source holds it. widens: to_compute only
    widens the stored dtype (no rounding to a config dtype), so equal stored bits mean equal fp32
    values. slab_ready: rows have the base's shape and to_compute makes them the base's dtype, so
    the slab forms may run on them."""

    widened: torch.Tensor | None
    base_stored: torch.Tensor | None
    widens: bool
    slab_ready: bool

    @property
    @abstractmethod
    def base(self) -> torch.Tensor: ...

    @abstractmethod
    def rows(self, k: int) -> ExpertRows | None: ...

    @abstractmethod
    def to_compute(self, t: torch.Tensor) -> torch.Tensor: ...


class WholeTensors(ExpertSource):
    """Plain tensors as an ExpertSource: each expert is read everywhere (its rows are the whole
    tensor) and used as it is."""

    base_stored = None
    widens = False

    def __init__(self, base: torch.Tensor, experts: Sequence[torch.Tensor]) -> None:
        self.widened = base
        self._experts = list(experts)
        self.slab_ready = all(x.dtype == base.dtype and x.shape == base.shape for x in self._experts)

    @property
    def base(self) -> torch.Tensor:
        return self.widened

    def __len__(self) -> int:
        return len(self._experts)

    def __getitem__(self, k: int) -> torch.Tensor:
        return self._experts[k]

    def rows(self, k: int) -> ExpertRows:
        x = as_rows(self._experts[k])
        return [((0, x.shape[0]), x)]

    def to_compute(self, t: torch.Tensor) -> torch.Tensor:
        return t


class Operator(ABC):
    """A merge method. Subclasses set the class attributes and implement merge_source (and, for a
    slab form, merge_into); the executor calls merge or merge_into."""

    name: ClassVar[str]
    parameters: ClassVar[tuple[Parameter, ...]]
    # The result is linear in each delta with fixed coefficients: the plan's error bound holds.
    additive: ClassVar[bool] = False
    # mergekit requires a base_model (without one, the first model is the reference).
    needs_base: ClassVar[bool] = True
    # The base's own entry among `models:` is a weighted input (linear).
    base_weighted: ClassVar[bool] = False
    # mergekit's base is optional (multislerp's base_tensor): a config without base_model merges
    # every model as an input, weighted by its entry, the first one at BASE_AT (spec.implicit_base),
    # and the method works on the tensors themselves (params.base is set then, else None).
    base_optional: ClassVar[bool] = False
    # A zero coefficient makes the expert's delta contribute exactly nothing (a signed zero at
    # most), so the planner never reads such a pair: e.g. mergekit's `weight: 0` catch-alls.
    zero_coefficient_unused: ClassVar[bool] = False
    # How many times merge walks the experts: with 1, each expert's bytes are read only when
    # merge reaches it; with more, they are read once, up front, and kept.
    expert_passes: ClassVar[int] = 1
    # merge_into can merge from a stored (not widened) base, slab by slab.
    has_slab_form: ClassVar[bool] = False
    # Each output element depends only on the same element of the base and of each expert (no
    # tensor-wide quantity, no per-block draw): the executor may merge any run of elements on
    # its own, and streams large tensors through memory that way.
    elementwise: ClassVar[bool] = False
    # Where every delta is zero the result is the base plus a zero (task arithmetic's
    # base + lambda * 0): the executor copies the base's bytes there, and computes only zeros,
    # subnormals and NaN by the formula (the cast back may change those).
    base_where_no_delta: ClassVar[bool] = False
    # merge_windows can merge a tensor too large to hold a window of rows at a time, read from
    # storage in passes: first its tensor-wide quantities, then the merge.
    windowed: ClassVar[bool] = False
    # The planner weighs each coefficient by the expert's share of the tensor's delta energy,
    # from the catalog's block statistics (sce's per-tensor weights).
    ranks_by_energy_share: ClassVar[bool] = False
    # The base is one of the method's inputs, in mergekit's order of them (karcher): its
    # position, params[BASE_AT], is where the config lists it among `models:`, else last.
    base_among_inputs: ClassVar[bool] = False
    # fp32 buffers the size of the tensor that merge() holds per expert at its peak, besides the
    # base and a few of its own: the memory plan's estimate for operators merged whole.
    work_buffers_per_expert: ClassVar[int] = 2
    # The same for an elementwise operator: fp32 temporaries per element beyond the base, one
    # accumulator and one expert's values.
    elementwise_temporaries: ClassVar[int] = 0
    min_experts: ClassVar[int] = 1
    max_experts: ClassVar[int | None] = None

    def declared(self, name: str) -> Parameter | None:
        return next((p for p in self.parameters if p.name == name), None)

    def params(self, n_experts: int, base: dict[str, Any] | None = None, **values: Any) -> MergeParams:
        """MergeParams from values by name (`lambda_` for lambda), the declared defaults for the
        rest; a scalar given for a per-model parameter applies to every expert."""
        resolved = {}
        for p in self.parameters:
            v = values.pop(p.name + "_" if p.name == "lambda" else p.name, p.default)
            if p.per_model and not isinstance(v, (list, tuple)):
                v = (v,) * n_experts
            resolved[p.name] = v
        if values:
            raise TypeError(f"{self.name}: no parameter {sorted(values)[0]!r}")
        return MergeParams.of(n_experts, resolved, base)

    def check(self, params: MergeParams) -> tuple[str, int, str] | None:
        """A combination of values the operator refuses: (parameter, expert position, why), or
        None. `why` ends where the caller may name the tensor."""
        return None

    @abstractmethod
    def coefficients(self, params: MergeParams) -> list[float]:
        """|c_k| per expert: the planner ranks (expert, block) pairs by |c_k|·‖Δ_k,b‖ (exact in the
        bound when additive, a proxy otherwise)."""

    def merge(
        self,
        base: torch.Tensor,
        experts: ExpertSource | Sequence[torch.Tensor],
        params: MergeParams,
        ctx: TensorContext,
    ) -> torch.Tensor:
        """The merged fp32 tensor. `experts` may be plain tensors (then read whole)."""
        source = experts if isinstance(experts, ExpertSource) else WholeTensors(base, experts)
        return self.merge_source(base, source, params, ctx)

    @abstractmethod
    def merge_source(
        self, base: torch.Tensor, experts: ExpertSource, params: MergeParams, ctx: TensorContext
    ) -> torch.Tensor: ...

    def merge_into(self, out: torch.Tensor, experts: ExpertSource, params: MergeParams, ctx: TensorContext) -> bool:
        """merge() written into `out`, slab by slab from the stored base (has_slab_form). False,
        with nothing written, where only merge() can do it."""
        return False

    def windows_apply(self, params: MergeParams, shape: tuple[int, ...]) -> bool:
        """Whether merge_windows can merge a tensor of this shape with these parameters (windowed
        operators; the memory plan holds the others whole)."""
        return self.windowed

    def window_passes(self, params: MergeParams) -> int:
        """The most passes merge_windows makes over a tensor's windows, the merge's included."""
        return 1

    def merge_windows(
        self, windows: Any, params: MergeParams, ctx: TensorContext, out_dtype: torch.dtype, write: Callable
    ) -> bool:
        """merge() over slabs.Windows: each window's merged rows in `out_dtype` handed to
        write(first row, rows), in order (windowed). False, with nothing written, where it
        cannot be done that way (then merge() on the whole tensor must)."""
        return False
