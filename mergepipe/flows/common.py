"""Steps shared by the flows: index a family, execute a saved plan and publish it."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import as_completed as futures_completed
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from prefect.futures import as_completed, wait

from mergepipe.tasks import progress
from mergepipe.errors import BadInput, MergepipeError
from mergepipe.index.family import Family
from mergepipe.index.stats import first_nonfinite
from mergepipe.publish.manifest import MANIFEST_FILE, versions
from mergepipe.plan.record import Plan
from mergepipe.config.spec import MergeSpec, load_spec, resolve_tensor_params
from mergepipe.storage import writer
from mergepipe.storage.location import join, set_storage_options
from mergepipe.storage.ledger import ByteLedger
from mergepipe.tasks.index import compute_block_stats, ingest_block_stats, look_up_family, read_family_headers
from mergepipe.tasks.merge import (
    finish_output, finished_group, load_plan, merge_layer_group, publish_output, record_run, results_dir, stage_output,
)
from mergepipe.flows.artifacts import summary_artifact
from mergepipe.flows.orchestration import call_with_retries, in_process, run_task
from mergepipe.flows.runners import describe, layer_task_runner


def worker_count() -> int:
    return max(1, int(os.environ.get("MERGEPIPE_WORKERS", "2")))


@contextmanager
def torch_threads_per_worker(workers: int) -> Iterator[None]:
    """Give each of `workers` concurrent merge tasks in this process its share of the cores for
    torch's own threads. With every task at the full count, two tasks on 2 cores ran four
    threads and spent their time handing work over: a K=8 dare_ties merge took 65 s (16 s of
    it system time) against 56 s (9 s) with one thread each. Results do not depend on it (the
    operators' reductions are fixed whatever the thread count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // max(1, workers)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
    family, rows = run_task(read_family_headers, spec.base_model, spec.expert_uris)
    ledger.merge(rows)
    # Parameters that depend on tensor names (filters, gradients) are checked now, before any
    # statistics pass, so a config that cannot merge fails fast.
    resolve_tensor_params(spec, family.base.tensors)
    bs = spec.block_size_bytes
    known, content, energies = run_task(look_up_family, family, bs, catalog)
    # An expert needs its pass unless its statistics and content digest are both known; each
    # distinct file set is read once even if the config lists it twice.
    missing, seen = [], set()
    for i, fp in enumerate(family.expert_fps()):
        if (fp not in known or fp not in content) and fp not in seen:
            missing.append(i)
            seen.add(fp)
    # A catalog from before schema 3 lacks the base's block energies: a plan ranked on them
    # reads the base once more (and no expert) to fill them in.
    if missing or family.base_fp not in content or (spec.rank_by_needs_base and not energies):
        if in_process():
            result, rows = call_with_retries(compute_block_stats, family, missing, bs)
            ledger.merge(rows)
        else:
            state = compute_block_stats.with_options(result_storage=results_dir())(family, missing, bs, return_state=True)
            result, rows = state.result()
            if state.name != "Cached":  # a cached pass read nothing now
                ledger.merge(rows)
        problem = None if spec.allow_nonfinite else first_nonfinite(result, family)
        if problem:  # refused before ingestion: bad input leaves the catalog as it was
            raise BadInput(problem)
        run_task(ingest_block_stats, family, missing, bs, result, catalog)
        content = {**content, **result.content}
    return IndexOutcome(family, content, missing, ledger, time.perf_counter() - t0)


def flow_run_id() -> str | None:
    try:
        from prefect.runtime import flow_run

        return str(flow_run.id) if flow_run.id else None
    except Exception:
        return None


class _GroupResults:
    """What the layer groups read, wrote and resumed, and who wrote them, as they finish."""

    def __init__(self, rep) -> None:
        self.ledger = ByteLedger()  # what this run read and wrote
        self.resumed = ByteLedger()  # what the runs before it read for the groups it found finished
        self.resumed_groups: list[str] = []
        self.workers: dict[str, str] = {}  # layer group -> host:pid of the process that wrote it
        self.rep = rep

    def add(self, group: str, result: dict, resumed: bool) -> None:
        rows = result["rows"]
        self.workers[group] = result["worker"]
        if resumed:
            self.resumed.merge(rows)
            self.resumed_groups.append(group)
        else:
            self.ledger.merge(rows)
        self.rep.advance("merge", 1)
        self.rep.advance("read", sum(r["bytes"] for r in rows if r["role"] in ("base", "expert")))


def _run_groups_with_prefect(plan_dir, groups, staging, options_from, runner, dask_address, results) -> None:
    """One Prefect task per group, on the flow's threads or on Dask."""
    with layer_task_runner(runner, dask_address, worker_count()) as pool:
        futures = {}
        for g in groups:
            params = {"plan_dir": plan_dir, "group": g, "staging": staging, "options_from": options_from}
            futures[pool.submit(merge_layer_group, parameters=params) if pool else merge_layer_group.submit(**params)] = g
        try:
            for fut in as_completed(list(futures)):
                results.add(futures[fut], fut.result(), False)
        finally:
            wait(list(futures))  # on failure, let running groups stop writing before staging goes


def _run_groups_in_process(plan_dir, groups, staging, results) -> None:
    """The groups' plain functions on a thread pool."""
    with ThreadPoolExecutor(worker_count()) as pool:
        futures = {pool.submit(call_with_retries, merge_layer_group, plan_dir, g, staging): g for g in groups}
        try:
            for fut in futures_completed(futures):
                results.add(futures[fut], fut.result(), False)
        except BaseException:
            for fut in futures:  # groups not started stay so; running ones finish writing first
                fut.cancel()
            raise


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
    staging = run_task(stage_output, plan_dir, out)
    rep = progress.reporter()
    results = _GroupResults(rep)
    ledger, resumed, resumed_groups, workers = results.ledger, results.resumed, results.resumed_groups, results.workers
    try:
        t_merge = time.perf_counter()
        groups = list(layout.groups)
        rep.start("merge", len(groups), "groups")
        rep.start("read", plan.base_tensor_bytes + plan.expert_bytes_planned, "B")
        try:
            # Resume: a group an earlier run of this plan finished (a crash left its staging
            # folder) is taken over while its mark and staged bytes are intact.
            todo = []
            for g in groups:
                done = finished_group(plan_dir, g, staging)
                if done is not None:
                    results.add(g, done, True)
                else:
                    todo.append(g)
            with torch_threads_per_worker(worker_count()):
                if in_process():
                    _run_groups_in_process(plan_dir, todo, staging, results)
                else:
                    _run_groups_with_prefect(plan_dir, todo, staging, options_from, runner, dask_address, results)
        finally:
            rep.finish("read")
            rep.finish("merge")
        timings["merge"] = time.perf_counter() - t_merge
        t_finish = time.perf_counter()
        output, rows = run_task(finish_output, plan_dir, staging)
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
        manifest, rows = run_task(publish_output, plan_dir, staging, out, overwrite, output, run, expected_digest)
        ledger.merge(rows)
    except BaseException:
        writer.discard(Path(staging))
        raise
    manifest_json = json.dumps(manifest, sort_keys=True)
    run_task(
        record_run,
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
