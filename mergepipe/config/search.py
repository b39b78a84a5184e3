"""A search config (`mergepipe search`): a mergekit config whose values may be ranges
(`{search: [LOW, HIGH]}`) or choices (`{choice: [A, B, …]}`), and its `search:` section,
validated once into a SearchSpec. A candidate is the config with one value put in each place."""

from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from mergepipe.config.sizes import parse_budget
from mergepipe.config.spec import MergeSpec, check_parameters, load_spec, read_documents
from mergepipe.errors import BadInput
from mergepipe.operators import OPERATORS
from mergepipe.storage.location import is_remote

SECTION = "search"
RANGE = "search"
CHOICE = "choice"
SAMPLERS = ("tpe", "cmaes", "random", "grid")
DIRECTIONS = ("minimize", "maximize")
# Where a range may stand: under a `parameters` mapping (global, a model's, a slice's or a source's).
PARAMETERS = "parameters"

Path_ = tuple[str | int, ...]


@dataclass(frozen=True)
class Range:
    """Numbers from low to high: on a log scale (`log`), or on a grid of `step`; whole numbers
    when low, high and step are all written as integers."""

    low: float
    high: float
    log: bool = False
    step: float | None = None

    @property
    def integer(self) -> bool:
        return all(isinstance(v, int) and not isinstance(v, bool) for v in (self.low, self.high, self.step))

    def grid(self) -> list[float]:
        """The values of a stepped range, low first (a grid sampler's axis)."""
        assert self.step is not None
        n = int(math.floor((self.high - self.low) / self.step + 1e-9))
        values = [self.low + i * self.step for i in range(n + 1)]
        return [int(v) for v in values] if self.integer else [round(v, 12) for v in values]


@dataclass(frozen=True)
class Choice:
    options: tuple[Any, ...]

    @property
    def primitive(self) -> bool:
        """Whether Optuna can hold the options themselves (else their positions)."""
        return all(o is None or isinstance(o, (bool, int, float, str)) for o in self.options)


@dataclass(frozen=True)
class SearchParam:
    """One searched place: its path in the document, its name (the dotted key, as messages,
    Optuna's study and the trial records name it) and its domain."""

    path: Path_
    name: str
    domain: Range | Choice


@dataclass(frozen=True)
class CommandEvaluation:
    """Run `command` with {model} replaced by the candidate's folder; its last output line is
    the score (a number, or a JSON object with `score` and other metrics)."""

    command: str
    timeout: float | None = None


@dataclass(frozen=True)
class PerplexityEvaluation:
    """The built-in evaluator: the mean token loss of the candidate on the texts in `data`."""

    data: str
    field: str = "text"
    samples: int | None = None
    max_length: int = 512


Evaluation = CommandEvaluation | PerplexityEvaluation


@dataclass(frozen=True)
class SearchSettings:
    evaluate: Evaluation
    trials: int = 50
    budget: str = "10%"
    final_budget: str = "100%"
    sampler: Literal["tpe", "cmaes", "random", "grid"] = "tpe"
    seed: int = 0
    direction: Literal["minimize", "maximize"] = "minimize"
    parallel: int = 1
    top_k: int = 5


@dataclass(frozen=True)
class SearchSpec:
    """A validated search: the config's location and document (without `search:`), the
    searched places, the settings, and the study's name for a destination (`study_name`)."""

    location: str
    document: dict = field(repr=False)
    params: tuple[SearchParam, ...]
    settings: SearchSettings

    def first_values(self) -> dict[str, Any]:
        """Each searched place at its first value (a range's low, a choice's first option)."""
        return {p.name: p.domain.low if isinstance(p.domain, Range) else p.domain.options[0] for p in self.params}

    def values_at(self, params: dict[str, Any]) -> dict[str, Any]:
        """Optuna's parameter values as the candidate's: a choice held by position, by its option."""
        out = {}
        for p in self.params:
            v = params[p.name]
            out[p.name] = p.domain.options[v] if isinstance(p.domain, Choice) and not p.domain.primitive else v
        return out

    def candidate(self, values: dict[str, Any]) -> dict:
        """The config document with each searched place given its value (by parameter name)."""
        doc = copy.deepcopy(self.document)
        for p in self.params:
            _put(doc, p.path, copy.deepcopy(values[p.name]))
        return doc

    def candidate_spec(self, values: dict[str, Any]) -> MergeSpec:
        """The candidate validated as a merge config is (models relative to the search config)."""
        return load_spec_document(self.candidate(values), self.location)

    def study_name(self, out: str) -> str:
        """The same search config and destination name the same study, so a run again resumes
        it; the trial count and parallelism may change between runs."""
        s = self.settings
        key = {  # not the storage options: credentials may change between runs of one search
            "document": {k: v for k, v in self.document.items() if k != "storage_options"},
            "params": [[p.name, repr(p.domain)] for p in self.params],
            "settings": [s.budget, s.sampler, s.seed, s.direction, repr(s.evaluate)],
            "out": out,
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
        return f"mergepipe-search-{digest[:16]}"


def load_spec_document(doc: dict, location: str) -> MergeSpec:
    """A config document validated and resolved as if it were the file at `location`."""
    return load_spec(location, document=doc)


def candidate_yaml(doc: dict) -> str:
    """A candidate's config as YAML for the record: without its credentials."""
    shown = {k: v for k, v in doc.items() if k != "storage_options"}
    return yaml.safe_dump(shown, sort_keys=False)


def _put(doc: Any, path: Path_, value: Any) -> None:
    for part in path[:-1]:
        doc = doc[part]
    doc[path[-1]] = value


def _name(path: Path_) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _marker(value: Any) -> str | None:
    if isinstance(value, dict) and len(value) >= 1:
        if RANGE in value and set(value) <= {RANGE, "log", "step"}:
            return RANGE
        if CHOICE in value and set(value) == {CHOICE}:
            return CHOICE
    return None


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _range(value: dict, name: str) -> Range:
    bounds = value[RANGE]
    if not (isinstance(bounds, list) and len(bounds) == 2 and all(_number(b) for b in bounds)):
        raise BadInput(f"{name}: search: give [LOW, HIGH], two numbers")
    low, high = bounds
    if low > high:
        raise BadInput(f"{name}: search: low {low} is above high {high}")
    log, step = value.get("log", False), value.get("step")
    if not isinstance(log, bool):
        raise BadInput(f"{name}: log: true or false")
    if step is not None and not (_number(step) and step > 0):
        raise BadInput(f"{name}: step: a positive number")
    if log and step is not None:
        raise BadInput(f"{name}: log and step: give one (a log scale has no fixed step)")
    if log and low <= 0:
        raise BadInput(f"{name}: log: true needs a low above 0, got {low}")
    return Range(low, high, log, step)


def _find(value: Any, path: Path_, under_parameters: bool, found: list[SearchParam]) -> None:
    kind = _marker(value)
    name = _name(path)
    if kind == RANGE:
        if not under_parameters:
            raise BadInput(f"{name}: a range is for a numeric merge parameter (under `parameters`); use choice: here")
        found.append(SearchParam(path, name, _range(value, name)))
        return
    if kind == CHOICE:
        options = value[CHOICE]
        if not isinstance(options, list) or not options:
            raise BadInput(f"{name}: choice: give a non-empty list of values")
        for i, option in enumerate(options):
            if _marker(option) or _holds_marker(option):
                raise BadInput(f"{name}: choice[{i}]: a choice's values are plain values (no ranges inside)")
        found.append(SearchParam(path, name, Choice(tuple(options))))
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _find(v, (*path, k), under_parameters or k == PARAMETERS, found)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _find(v, (*path, i), under_parameters, found)


def _holds_marker(value: Any) -> bool:
    if _marker(value):
        return True
    if isinstance(value, dict):
        return any(_holds_marker(v) for v in value.values())
    if isinstance(value, list):
        return any(_holds_marker(v) for v in value)
    return False


_SETTINGS = {"trials", "budget", "final_budget", "sampler", "seed", "direction", "parallel", "top_k", "evaluate"}


def _positive_int(section: dict, key: str, default: int, name: str) -> int:
    v = section.get(key, default)
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        raise BadInput(f"{name}.{key}: a whole number of at least 1, got {v!r}")
    return v


def _evaluation(value: Any, name: str) -> Evaluation:
    if not isinstance(value, dict) or len(value) != 1 and "command" not in value:
        raise BadInput(f"{name}: give {{command: ..., timeout: SECONDS}} or {{perplexity: {{data: FILE}}}}")
    if "command" in value:
        extra = set(value) - {"command", "timeout"}
        if extra:
            raise BadInput(f"{name}.{sorted(extra)[0]}: unknown key (command and timeout)")
        command, timeout = value["command"], value.get("timeout")
        if not isinstance(command, str) or not command.strip():
            raise BadInput(f"{name}.command: a command line")
        if "{model}" not in command:
            raise BadInput(f"{name}.command: name the candidate's folder as {{model}} in it")
        if timeout is not None and not (_number(timeout) and timeout > 0):
            raise BadInput(f"{name}.timeout: seconds above 0, got {timeout!r}")
        return CommandEvaluation(command, None if timeout is None else float(timeout))
    if "perplexity" in value:
        p = value["perplexity"]
        where = f"{name}.perplexity"
        if not isinstance(p, dict) or "data" not in p:
            raise BadInput(f"{where}: give data: FILE (JSON Lines or text, local or s3://)")
        extra = set(p) - {"data", "field", "samples", "max_length"}
        if extra:
            raise BadInput(f"{where}.{sorted(extra)[0]}: unknown key (data, field, samples, max_length)")
        if not isinstance(p["data"], str):
            raise BadInput(f"{where}.data: a file location")
        samples = p.get("samples")
        if samples is not None:
            samples = _positive_int(p, "samples", 1, where)
        return PerplexityEvaluation(
            p["data"], str(p.get("field", "text")), samples, _positive_int(p, "max_length", 512, where)
        )
    raise BadInput(f"{name}.{next(iter(value))}: unknown evaluator (command or perplexity)")


def _settings(section: Any, source: str, trials: int | None, parallel: int | None) -> SearchSettings:
    name = f"{source}: {SECTION}"
    if not isinstance(section, dict):
        raise BadInput(f"{name}: a mapping with at least `evaluate`")
    extra = set(section) - _SETTINGS
    if extra:
        raise BadInput(f"{name}.{sorted(extra)[0]}: unknown key (one of: {', '.join(sorted(_SETTINGS))})")
    if "evaluate" not in section:
        raise BadInput(f"{name}.evaluate: required: {{command: ...}} or {{perplexity: {{data: FILE}}}}")
    budget = str(section.get("budget", "10%"))
    final = str(section.get("final_budget", "100%"))
    parse_budget(budget, key=f"{name}.budget")
    parse_budget(final, key=f"{name}.final_budget")
    sampler = section.get("sampler", "tpe")
    if sampler not in SAMPLERS:
        raise BadInput(f"{name}.sampler: unknown {sampler!r} (one of: {', '.join(SAMPLERS)})")
    direction = section.get("direction", "minimize")
    if direction not in DIRECTIONS:
        raise BadInput(f"{name}.direction: minimize or maximize, got {direction!r}")
    seed = section.get("seed", 0)
    if not (isinstance(seed, int) and not isinstance(seed, bool)):
        raise BadInput(f"{name}.seed: a whole number")
    given = dict(section)
    if trials is not None:
        given["trials"] = trials
    if parallel is not None:
        given["parallel"] = parallel
    return SearchSettings(
        evaluate=_evaluation(section["evaluate"], f"{name}.evaluate"),
        trials=_positive_int(given, "trials", 50, name),
        budget=budget,
        final_budget=final,
        sampler=sampler,
        seed=seed,
        direction=direction,
        parallel=_positive_int(given, "parallel", 1, name),
        top_k=_positive_int(section, "top_k", 5, name),
    )


def _corners(spec: SearchSpec) -> list[tuple[str, dict[str, Any]]]:
    """Candidates that together put every searched place at each of its ends (a range's low and
    high, each option of a choice), the others at their first: what validation tries."""
    first = spec.first_values()
    out = [("", first)]
    for p in spec.params:
        ends = [p.domain.low, p.domain.high] if isinstance(p.domain, Range) else list(p.domain.options)
        out += [(p.name, {**first, p.name: v}) for v in ends[1:]]
    return out


def _beside(path: str, location: str) -> str:
    if is_remote(location) and not Path(path).is_absolute():
        from mergepipe.storage.location import join, split

        return join(split(location)[0], path)
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else (Path(location).resolve().parent / p).resolve())


def _parameter_name(path: Path_) -> str | None:
    """The merge parameter a place under `parameters` sets (a gradient's entry or a filter's
    value sets the parameter it lies under)."""
    at = max((i for i, part in enumerate(path) if part == PARAMETERS), default=None)
    return None if at is None or at + 1 >= len(path) else str(path[at + 1])


def _check_numeric(doc: dict, params: tuple[SearchParam, ...], location: str) -> None:
    """A range only on a parameter that every method the config may use takes as a number."""
    method = next((p for p in params if p.path == ("merge_method",)), None)
    methods = list(method.domain.options) if method else [doc.get("merge_method")]
    for p in params:
        name = _parameter_name(p.path)
        if not isinstance(p.domain, Range) or name is None:
            continue
        for m in methods:
            declared = OPERATORS[m].declared(name) if m in OPERATORS else None
            if declared is not None and declared.kind != "float":
                raise BadInput(f"{location}: {p.name}: {name} of {m} is not numeric ({declared.kind}); use choice:")


def load_search(location: str | Path, *, trials: int | None = None, parallel: int | None = None) -> SearchSpec:
    """Read and check a search config before any trial: the `search:` section, every range and
    choice, and the config at each end of each of them (a method that does not take a
    parameter, a range on a key that is not numeric): exit 2 naming the key."""
    location = str(location)
    docs = read_documents(location)
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise BadInput(f"{location}: a search config is one YAML mapping (a merge config with a `search:` section)")
    doc = dict(docs[0])
    if SECTION not in doc:
        raise BadInput(f"{location}: {SECTION}: required (the search's trials, budget and evaluate)")
    settings = _settings(doc.pop(SECTION), location, trials, parallel)
    if isinstance(settings.evaluate, PerplexityEvaluation) and not is_remote(settings.evaluate.data):
        # a relative data file lies beside the config, as relative models do
        data = _beside(settings.evaluate.data, location)
        settings = replace(settings, evaluate=replace(settings.evaluate, data=data))
    if "budget" in doc or "max_error" in doc:
        key = "budget" if "budget" in doc else "max_error"
        raise BadInput(f"{location}: {key}: a search's trials read search.budget (final merges search.final_budget)")
    found: list[SearchParam] = []
    try:
        _find(doc, (), False, found)
    except BadInput as err:
        raise BadInput(f"{location}: {err}") from None
    params = tuple(found)
    if not params:
        raise BadInput(f"{location}: nothing to search: give a value as {{search: [LOW, HIGH]}} or {{choice: [...]}}")
    if settings.sampler == "grid":
        for p in params:
            if isinstance(p.domain, Range) and p.domain.step is None:
                raise BadInput(f"{location}: {p.name}: sampler grid needs a step on every range")
    _check_numeric(doc, params, location)
    spec = SearchSpec(location if is_remote(location) else str(Path(location).resolve()), doc, params, settings)
    for name, values in _corners(spec):
        try:
            check_parameters(spec.candidate_spec(values))
        except BadInput as err:
            at = f"{name} = {values[name]!r}: " if name else ""
            raise BadInput(f"{location}: {at}{str(err).removeprefix(f'{spec.location}: ')}") from None
    return spec
