"""Steps shared by the flows: index a family, execute a saved plan and publish it."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from prefect.futures import as_completed, wait

from .. import progress
from ..errors import BadInput, MergepipeError
from ..family import Family
from ..indexing import first_nonfinite
from ..manifest import MANIFEST_FILE, versions
from ..planning import Plan
from ..spec import MergeSpec, load_spec, resolve_tensor_params
from ..storage import writer
from ..storage.location import join, set_storage_options
from ..storage.ledger import ByteLedger
from ..tasks.index_tasks import compute_block_stats, ingest_block_stats, look_up_family, read_family_headers
from ..tasks.merge_tasks import (
    finish_output, group_is_intact, load_plan, merge_layer_group, publish_output, record_run, results_dir, stage_output,
)
from .artifacts import summary_artifact
from .runners import describe, layer_task_runner


def worker_count() -> int:
    return max(1, int(os.environ.get("MERGEPIPE_WORKERS", "2")))


def now() -> str:
    return datetime.now(timezone.utc).isoformat()


@dataclass
class IndexOutcome:
    family: Family
    content: dict[str, str]
    indexed: list[int]  # expert positions indexed in this run
    ledger: ByteLedger = field(default_factory=ByteLedger)
    seconds: float = 0.0


def load_config(config: str) -> MergeSpec:
    """The config, read with the environment's credentials (not options a previous run in this
    process left), whose storage options then apply to this process."""
    set_storage_options(None)
    spec = load_spec(config)
    set_storage_options(spec.storage_options)
    return spec


def run_index(spec: MergeSpec, catalog: str | None) -> IndexOutcome:
    t0 = time.perf_counter()
    ledger = ByteLedger()
    family, rows = read_family_headers(spec.base_model, spec.expert_uris)
    ledger.merge(rows)
    # Parameters that depend on tensor names (filters, gradients) are checked now, before any
    # statistics pass, so a config that cannot merge fails fast.
    resolve_tensor_params(spec, family.base.tensors)
    bs = spec.block_size_bytes
    known, content = look_up_family(family, bs, catalog)
    # An expert needs its pass unless its statistics and content digest are both known; each
    # distinct file set is read once even if the config lists it twice.
    missing, seen = [], set()
    for i, fp in enumerate(family.expert_fps()):
        if (fp not in known or fp not in content) and fp not in seen:
            missing.append(i)
            seen.add(fp)
    if missing or family.base_fp not in content:
        state = compute_block_stats.with_options(result_storage=results_dir())(family, missing, bs, return_state=True)
        result, rows = state.result()
        if state.name != "Cached":  # a cached pass read nothing now
            ledger.merge(rows)
        problem = None if spec.allow_nonfinite else first_nonfinite(result, family)
        if problem:  # refused before ingestion: bad input leaves the catalog as it was
            raise BadInput(problem)
        ingest_block_stats(family, missing, bs, result, catalog)
        content = {**content, **result.content}
    return IndexOutcome(family, content, missing, ledger, time.perf_counter() - t0)


def flow_run_id() -> str | None:
    try:
        from prefect.runtime import flow_run

        return str(flow_run.id) if flow_run.id else None
    except Exception:
        return None


def _collect(
    futures: dict, ledger: ByteLedger, resumed: ByteLedger, resumed_groups: list[str], workers: dict, rep
) -> None:
    """Wait for every group; a group taken from the cache counts as resumed, not as read."""
    try:
        for fut in as_completed(list(futures)):
            result = fut.result()
            rows = result["rows"]
            workers[futures[fut]] = result["worker"]
            if fut.state.name == "Cached":
                resumed.merge(rows)
                resumed_groups.append(futures[fut])
            else:
                ledger.merge(rows)
            rep.advance("merge", 1)
            rep.advance("read", sum(r["bytes"] for r in rows if r["role"] in ("base", "expert")))
    finally:
        wait(list(futures))  # on failure, let running groups stop writing before staging goes
        rep.finish("read")
        rep.finish("merge")


def execute_plan(
    plan: Plan,
    plan_dir: str,
    out: str,
    *,
    overwrite: bool,
    catalog: str | None,
    kind: str,
    index_ledger: ByteLedger,
    timings: dict,
    started_at: str,
    t0: float,
    expected_digest: str | None = None,
    runner: str = "thread",
    dask_address: str | None = None,
    options_from: str | None = None,
) -> dict:
    """Stage, merge every layer group as its own task, hash, write the manifest, publish.

    The execution ledger is kept apart from the index ledger (headers, and statistics of
    experts indexed on the way) so realized bytes compare one to one with planned bytes."""
    _, layout = load_plan(plan_dir)
    ledger = ByteLedger()  # what this run read and wrote
    resumed = ByteLedger()  # what the runs before it read for the groups it found finished
    resumed_groups: list[str] = []
    workers: dict[str, str] = {}  # layer group -> host:pid of the process that wrote it
    staging = stage_output(plan_dir, out)
    rep = progress.reporter()
    try:
        t_merge = time.perf_counter()
        groups = list(layout.groups)
        rep.start("merge", len(groups), "groups")
        rep.start("read", plan.base_tensor_bytes + plan.expert_bytes_planned, "B")
        task = merge_layer_group.with_options(result_storage=results_dir())
        with layer_task_runner(runner, dask_address, worker_count()) as pool:
            futures = {}
            for g in groups:
                # A cached result is used only while the staged bytes it describes are intact.
                t = task.with_options(refresh_cache=not group_is_intact(plan_dir, g, staging))
                params = {"plan_dir": plan_dir, "group": g, "staging": staging, "options_from": options_from}
                futures[pool.submit(t, parameters=params) if pool else t.submit(**params)] = g
            _collect(futures, ledger, resumed, resumed_groups, workers, rep)
        timings["merge"] = time.perf_counter() - t_merge
        t_finish = time.perf_counter()
        output, rows = finish_output(plan_dir, staging)
        ledger.merge(rows)
        timings["finish"] = time.perf_counter() - t_finish
        expert_read = ledger.total("expert")
        if expert_read + resumed.total("expert") != plan.expert_bytes_planned:
            raise MergepipeError(
                f"read {expert_read} expert bytes (and {resumed.total('expert')} in resumed groups) "
                f"but the plan has {plan.expert_bytes_planned}; not publishing"
            )
        run = {
            "kind": kind,
            "started_at": started_at,
            "finished_at": now(),
            "wall_seconds": time.perf_counter() - t0,
            "flow_run_id": flow_run_id(),
            "versions": versions(),
            "inputs": [{"role": i.role, "uri": i.uri, "files": i.files, "model_fp": i.model_fp} for i in plan.inputs],
            "spec": plan.spec,
            "bytes": ledger.by_role(),
            "ledger": ledger.rows(),
            "index_bytes": index_ledger.by_role(),
            "expert_bytes_planned": plan.expert_bytes_planned,
            "expert_bytes_read": expert_read,
            "resumed": {"groups": sorted(resumed_groups), "bytes": resumed.by_role()},
            "runner": describe(runner, dask_address, worker_count()),
            "workers": dict(sorted(workers.items())),
            "timings": timings,
        }
        manifest, rows = publish_output(plan_dir, staging, out, overwrite, output, run, expected_digest)
        ledger.merge(rows)
    except BaseException:
        writer.discard(Path(staging))
        raise
    manifest_json = json.dumps(manifest, sort_keys=True)
    record_run(
        catalog,
        {
            "run_id": flow_run_id() or f"{plan.plan_digest[:12]}-{started_at}",
            "kind": kind,
            "plan_digest": plan.plan_digest,
            "merge_digest": manifest["digest"],
            "out_uri": out,
            "started_at": datetime.fromisoformat(started_at),
            "finished_at": datetime.fromisoformat(run["finished_at"]),
            "wall_seconds": run["wall_seconds"],
            "expert_bytes_planned": plan.expert_bytes_planned,
            "expert_bytes_read": expert_read,
            "base_bytes_read": ledger.total("base"),
            "header_bytes_read": index_ledger.total("header"),
            "output_bytes_written": ledger.total("output"),
            "flow_run_id": flow_run_id(),
        },
        manifest_json,
    )
    result = {
        "kind": kind,
        "digest": manifest["digest"],
        "plan_digest": plan.plan_digest,
        "out": out,
        "manifest": join(out, MANIFEST_FILE),
        "merge_method": plan.spec["merge_method"],
        "budget_bytes": plan.budget_bytes,
        "full_expert_bytes": plan.full_expert_bytes,
        "expert_bytes_planned": plan.expert_bytes_planned,
        "expert_bytes_read": expert_read,
        "bytes": ledger.by_role(),
        "index_bytes": index_ledger.by_role(),
        "resumed_groups": sorted(resumed_groups),
        "runner": describe(runner, dask_address, worker_count()),
        "workers": sorted(set(workers.values())),
        "error_bound": plan.error_bound,
        "bound_guaranteed": plan.bound_guaranteed,
        "pairs": plan.n_pairs,
        "wall_seconds": time.perf_counter() - t0,
        "timings": timings,
        "flow_run_id": flow_run_id(),
    }
    summary_artifact(result)
    return result
