"""One command's validated input, built by one function for the CLI and for every flow: the
spec (with command-line overrides applied before validation), the budget, the destination,
the catalog and the runner. Nothing below re-parses any of it."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mergepipe.config.environment import CatalogLocation, catalog_location, default_memory
from mergepipe.config.sizes import parse_budget, parse_size
from mergepipe.config.spec import MergeSpec, check_parameters, load_spec, read_documents, stage_output
from mergepipe.config.stages import stage_documents, stage_names
from mergepipe.errors import BadInput
from mergepipe.storage.location import set_storage_options, storage_options
from mergepipe.storage.writer import check_destination

RUNNERS = ("thread", "dask")


@dataclass(frozen=True)
class Runner:
    """Where layer-group tasks run: the flow's threads, or a Dask cluster (an address, or a
    local cluster when None)."""

    kind: str = "thread"
    dask_address: str | None = None


def check_runner(runner: str, dask_address: str | None) -> Runner:
    if runner not in RUNNERS:
        raise BadInput(f"runner: unknown {runner!r} (one of: {', '.join(RUNNERS)})")
    if dask_address and runner != "dask":
        raise BadInput("dask_address: only with runner 'dask'")
    if runner == "dask" and importlib.util.find_spec("prefect_dask") is None:
        raise BadInput("runner 'dask' needs prefect-dask: install mergepipe[dask]")
    return Runner(runner, dask_address)


@dataclass(frozen=True)
class MergeRequest:
    """config: the config's location (None for a replay, whose spec comes from a manifest);
    out: the destination in its normal form (None for index and plan)."""

    spec: MergeSpec
    config: str | None
    catalog: CatalogLocation
    out: str | None = None
    overwrite: bool = False
    runner: Runner = Runner()
    memory: int = 0  # the memory budget in bytes (--memory, the config's memory, or the default)
    memory_given: bool = False  # by --memory or the config, not the default
    out_as_given: str | None = None  # `out` before its templates ({date}, …) were filled in
    # Of a stage of a multi-document config: the earlier stages it reads, (name, output location).
    stage_inputs: tuple[tuple[str, str], ...] = ()
    # Facts its caller records in the manifest's run beside the merge's own (a search's trial
    # and scores), under their keys; outside the digest, like the rest of the run.
    record: dict | None = None

    @property
    def options_from(self) -> str | None:
        """The config whose storage_options a process that has not loaded it needs (a Dask
        worker); its location travels, never the options."""
        return self.config if self.spec.storage_options else None


def with_run_names(out: str, when: datetime | None, run_name: str | None) -> str:
    """An output location's templates filled in: `{date}` (YYYY-MM-DD) and `{datetime}`
    (YYYYMMDDTHHMMSSZ) with the run's scheduled time (UTC; now when not given), and
    `{flow_run_name}` with the flow run's name ("local-" and the time outside a flow run), so
    that scheduled runs write each merge to a folder of its own."""
    if "{" not in out:
        return out
    when = (when or datetime.now(timezone.utc)).astimezone(timezone.utc)
    stamp = when.strftime("%Y%m%dT%H%M%SZ")
    names = {"{date}": when.strftime("%Y-%m-%d"), "{datetime}": stamp, "{flow_run_name}": run_name or f"local-{stamp}"}
    for template, value in names.items():
        out = out.replace(template, value)
    return out


def build_request(
    config: str | MergeSpec,
    *,
    out: str | None = None,
    budget: str | None = None,
    max_error: float | None = None,
    overwrite: bool = False,
    catalog: str | Path | None = None,
    runner: str = "thread",
    dask_address: str | None = None,
    run_time: datetime | None = None,
    run_name: str | None = None,
    allow_empty: bool = False,
    memory: str | None = None,
    model_card: bool = True,
    stage: str | None = None,
    intermediate_dir: str | None = None,
    record: dict | None = None,
    rank_by: str | None = None,
) -> MergeRequest:
    """Validate a command's input once: `config` is a config location (local or s3://) or an
    already validated spec (a replay's, from its manifest). The spec's storage options are set
    for the calling context (each flow runs in a context of its own: flows.orchestration).
    `budget` or `max_error` replaces the config's; `allow_empty` (--allow-empty) sets the
    config's allow_empty; `model_card=False` (--no-model-card) sets its write_model_card to
    false; `rank_by` replaces the config's. With `intermediate_dir` the config may hold stages (config/stages.py): `stage`'s
    document (None: the final one) is the merge. With `out`, the destination is checked (not
    existing unless `overwrite`, not overlapping an input) with the config's storage options."""
    if budget is not None and max_error is not None:
        raise BadInput("--budget and --max-error: give one, not both")
    if budget is not None:
        parse_budget(budget, key="--budget")
    memory_bytes = None if memory is None else parse_size(memory, key="--memory")
    resolved_runner = check_runner(runner, dask_address)
    if isinstance(config, MergeSpec):
        spec, location = config, None
        set_storage_options(None)  # a manifest holds no storage options: the environment's credentials
    else:
        overrides: dict[str, Any] = {}
        if budget is not None:
            overrides = {"budget": budget, "max_error": None}
        elif max_error is not None:
            overrides = {"budget": None, "max_error": max_error}
        if allow_empty:
            overrides["allow_empty"] = True
        if not model_card:
            overrides["write_model_card"] = False
        if rank_by is not None:
            overrides["rank_by"] = rank_by
        with storage_options(None):  # the config itself is read with the environment's credentials
            spec, location = load_spec(config, overrides, stage, intermediate_dir), str(config)
        set_storage_options(spec.storage_options)
    check_parameters(spec)  # values that depend on tensor names are resolved once headers are read
    destination = None
    if out is not None:
        destination = check_destination(with_run_names(str(out), run_time, run_name), overwrite, spec.model_uris)
    stage_inputs: tuple[tuple[str, str], ...] = ()
    if intermediate_dir is not None and location is not None:
        models = set(spec.model_uris)
        stage_inputs = tuple(
            (name, where)
            for name in sorted(stage_names(stage_documents(read_documents(location), location)))
            if (where := stage_output(intermediate_dir, name)) in models
        )
    given = memory_bytes is not None or spec.memory_bytes is not None
    if memory_bytes is None:
        memory_bytes = spec.memory_bytes if spec.memory_bytes is not None else default_memory()
    return MergeRequest(
        spec,
        location,
        catalog_location(catalog),
        destination,
        overwrite,
        resolved_runner,
        memory_bytes,
        given,
        None if out is None else str(out),
        stage_inputs,
        record or None,
    )
