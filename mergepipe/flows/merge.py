"""Flows: plan a merge, and merge (index → plan → per-layer execution → publish)."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Literal

from mergepipe.config.environment import worker_count
from mergepipe.config.request import MergeRequest, build_request
from mergepipe.config.spec import MergeSpec
from mergepipe.config.views import input_views
from mergepipe.errors import BadInput
from mergepipe.execute.memory import output_buffer, plan_memory
from mergepipe.flows.artifacts import plan_artifact
from mergepipe.flows.automations import begin_attempt
from mergepipe.flows.common import Execution, FirstMerge, execute_plan, flow_run_id, now, run_index
from mergepipe.flows.orchestration import declare_flow, in_process, run_task
from mergepipe.plan import saved
from mergepipe.plan.output import output_layout_of
from mergepipe.plan.ranking import compare_access
from mergepipe.tasks.merge import holding_output
from mergepipe.tasks.plan import plan_first_merge, plan_merge


def run_names() -> tuple[datetime | None, str | None]:
    """The flow run's scheduled start and name, for the templates of an output location
    (config.request.with_run_names); (None, None) outside a flow run, without importing Prefect."""
    if in_process():
        return None, None
    from prefect.runtime import flow_run

    return flow_run.scheduled_start_time, flow_run.name


@declare_flow("plan-merge")
def plan(
    config: str,
    budget: str | None = None,
    max_error: float | None = None,
    catalog: str | None = None,
    allow_empty: bool = False,
    memory: str | None = None,
    rank_by: Literal["delta", "delta_over_sqrt_base", "activation"] | None = None,
    compare: Literal["delta", "delta_over_sqrt_base", "activation"] | None = None,
) -> dict:
    """Plan a merge without running it: what it would read, its error bound and memory. A budget
    that admits no expert block is a warning here (a merge refuses it), and so is a memory budget
    too small for the merge.

    Args:
        config: Path or URI of the merge config (YAML in mergekit's shape).
        budget: I/O budget with a unit: a share of the expert bytes (25%) or a size (512MiB, 2GB).
            Default: the config's `budget`, else 100%.
        max_error: Instead of a budget, the largest error bound to accept (the cheapest plan
            within it).
        catalog: The catalog: a DuckDB file, or postgresql://user@host:port/dbname for one that
            many machines share (default: MERGEPIPE_CATALOG, else $MERGEPIPE_HOME/catalog.duckdb).
        allow_empty: Plan even when the budget admits no expert block.
        memory: The merge process's memory budget, a size such as 8GiB (default: the config's
            `memory`, else half the machine's memory).
        rank_by: How pairs are valued (default: the config's `rank_by`, else delta): delta,
            delta_over_sqrt_base, or activation (needs `mergepipe calibrate` of the base).
        compare: Another ranking to plan the same budget by: the result's `compare` gives, per
            tensor kind, the bytes each access set reads and those only one of them reads.
    """
    request = build_request(
        config,
        budget=budget,
        max_error=max_error,
        catalog=catalog,
        allow_empty=allow_empty,
        memory=memory,
        rank_by=rank_by,
    )
    outcome = run_index(request.spec, request.catalog)
    p, explain, saved_plan, warnings = run_task(
        plan_merge, request.spec, outcome.family, outcome.content, request.catalog, refuse_empty=False
    )
    try:  # a merge refuses a budget its largest tensor cannot fit; a plan says so
        mem = plan_memory(p, output_layout_of(p), request.memory, worker_count(), request.memory_given).as_json()
        warnings = [*warnings, mem["warning"]] if mem["warning"] else warnings
    except BadInput as err:
        mem, warnings = {"memory_budget": request.memory}, [*warnings, str(err)]
    result = {**plan_result(p, request.spec, explain, saved_plan), "memory": mem, "warnings": warnings}
    if compare is not None:
        other = request.spec.model_copy(update={"rank_by": compare})
        if compare == "activation":
            run_index(other, request.catalog)  # its calibration, and the experts weighed by it
        q, *_ = run_task(plan_merge, other, outcome.family, outcome.content, request.catalog, refuse_empty=False)
        result["compare"] = {
            "rank_by": [request.spec.rank_by, compare],
            "ranking": q.ranking,
            "error_bound": q.error_bound,
            "expert_bytes_planned": q.expert_bytes_planned,
            "by_kind": compare_access(p.access, q.access),
        }
    plan_artifact(result)
    return result


def plan_result(p, spec: MergeSpec, explain: list[dict], saved_plan: saved.PlanRef) -> dict:
    names = {row["expert"]: row["name"] for row in explain}
    experts = input_views(spec).expert_names
    return {
        "plan_digest": p.plan_digest,
        "plan_key": saved_plan.key,
        "merge_method": spec.merge_method,
        "experts": experts,
        # display names (catalog models.name), by position
        "expert_names": [names.get(i, uri) for i, uri in enumerate(experts)],
        "budget": p.budget,
        "budget_bytes": p.budget_bytes,
        "full_expert_bytes": p.full_expert_bytes,
        "expert_bytes_planned": p.expert_bytes_planned,
        "planned_bytes_per_expert": p.planned_bytes,
        "error_bound": p.error_bound,
        "bound_guaranteed": p.bound_guaranteed,
        "ranking": p.ranking,
        "pairs": p.n_pairs,
        "explain": explain,
    }


@declare_flow("merge", thread_pool=True)
def merge(
    config: str,
    out: str,
    budget: str | None = None,
    max_error: float | None = None,
    overwrite: bool = False,
    catalog: str | None = None,
    runner: Literal["thread", "dask"] = "thread",
    dask_address: str | None = None,
    allow_empty: bool = False,
    memory: str | None = None,
    model_card: bool = True,
    stage: str | None = None,
    intermediate_dir: str | None = None,
    record: dict | None = None,
    rank_by: Literal["delta", "delta_over_sqrt_base", "activation"] | None = None,
) -> dict:
    """Index what is missing, plan under the budget, merge layer group by layer group, publish
    the output with its manifest and model card, and record the run.

    Args:
        config: Path or URI of the merge config (YAML in mergekit's shape).
        out: Where the output goes: a local folder or s3://bucket/prefix. `{date}` becomes the
            run's scheduled date (YYYY-MM-DD), `{datetime}` its scheduled time
            (YYYYMMDDTHHMMSSZ) and `{flow_run_name}` the flow run's name.
        budget: I/O budget with a unit: a share of the expert bytes (25%) or a size (512MiB, 2GB).
            Default: the config's `budget`, else 100%.
        max_error: Instead of a budget, the largest error bound to accept (the cheapest plan
            within it).
        overwrite: Replace an output already published at `out`.
        catalog: The catalog: a DuckDB file, or postgresql://user@host:port/dbname for one that
            many machines share (default: MERGEPIPE_CATALOG, else $MERGEPIPE_HOME/catalog.duckdb).
        runner: Where layer groups run: "thread" (the flow's thread pool) or "dask" (the Dask
            cluster at dask_address, or a local cluster).
        dask_address: With runner "dask": the scheduler, such as tcp://scheduler:8786.
        allow_empty: Merge even when the budget admits no expert block (the output is the base).
        memory: The merge process's memory budget, a size such as 8GiB (default: the config's
            `memory`, else half the machine's memory).
        model_card: Write the output's README.md model card (false: none, as the config's
            `write_model_card: false`).
        stage: Of a multi-document config, the stage to merge (none: the final one); its models
            named as stages are their outputs under intermediate_dir (flows.stages runs them all).
        intermediate_dir: Where a multi-document config's named stages are written.
        record: Facts recorded in the manifest's run beside the merge's own, under their keys
            (a merge search records its study, trial and scores so).
        rank_by: How the planner values pairs (default: the config's `rank_by`, else delta):
            delta, delta_over_sqrt_base, or activation (needs `mergepipe calibrate` of the base).
    """
    begin_attempt()
    t0 = time.perf_counter()
    started = now()
    run_time, run_name = run_names() if "{" in out else (None, None)
    request = build_request(
        config,
        out=out,
        budget=budget,
        max_error=max_error,
        overwrite=overwrite,
        catalog=catalog,
        runner=runner,
        dask_address=dask_address,
        run_time=run_time,
        run_name=run_name,
        allow_empty=allow_empty,
        memory=memory,
        model_card=model_card,
        stage=stage,
        intermediate_dir=intermediate_dir,
        record=record,
        rank_by=rank_by,
    )
    with holding_output(request.out, flow_run_id()):  # one run at a time works on an output
        return _index_plan_and_merge(request, started, t0)


def _index_plan_and_merge(request: MergeRequest, started: str, t0: float) -> dict:
    outcome = run_index(request.spec, request.catalog, first_merge=True)
    with outcome.held:  # a first merge's claims on the experts it indexes, until their statistics land
        t_plan = time.perf_counter()
        first = mem = None
        if outcome.deferred:  # indexed on the way (flows.common.index_from_merge); the plan reads every block
            p, saved_plan = run_task(
                plan_first_merge, request.spec, outcome.family, outcome.content, request.catalog, outcome.indexed
            )
            try:
                layout, buffer = saved.load(saved_plan)[1], output_buffer(request.out)
                mem = plan_memory(
                    p, layout, request.memory, worker_count(), request.memory_given, indexing=True, out_buffer=buffer
                )
            except BadInput:  # too small for the statistics beside the merge: the two passes may fit
                mem = None
            if mem is not None and mem.reread_max == 0:
                first = FirstMerge(outcome.family, outcome.indexed, outcome.content)
            else:  # tensors merged in passes over windows would be read again (or it cannot fit): index first
                outcome.held.close()
                headers = outcome.ledger
                outcome = run_index(request.spec, request.catalog)
                outcome.ledger.merge(headers.rows())  # the headers were read twice
                t_plan = time.perf_counter()
        if first is None:
            p, explain, saved_plan, _ = run_task(
                plan_merge, request.spec, outcome.family, outcome.content, request.catalog
            )
            plan_artifact(plan_result(p, request.spec, explain, saved_plan), request.out_as_given)
        timings = {"index": outcome.seconds, "plan": time.perf_counter() - t_plan}
        memory = mem if first is not None else None  # the plan the decision was made on
        return execute_plan(
            Execution(request, p, saved_plan, "merge", outcome.ledger, timings, started, t0, first=first, memory=memory)
        )
