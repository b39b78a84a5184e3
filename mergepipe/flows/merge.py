"""Flows: plan a merge, and merge (index → plan → per-layer execution → publish)."""

from __future__ import annotations

import time

from mergepipe.config.environment import worker_count
from mergepipe.config.request import build_request
from mergepipe.config.spec import MergeSpec
from mergepipe.errors import BadInput
from mergepipe.execute.memory import output_buffer, plan_memory
from mergepipe.flows.artifacts import plan_artifact
from mergepipe.flows.common import Execution, FirstMerge, execute_plan, now, run_index
from mergepipe.flows.orchestration import declare_flow, run_task
from mergepipe.plan import saved
from mergepipe.plan.output import output_layout_of
from mergepipe.tasks.plan import plan_first_merge, plan_merge


def scheduled_date():
    """The flow run's scheduled start (for `{date}` in an output), or None outside a flow run."""
    from prefect.runtime import flow_run

    return flow_run.scheduled_start_time


@declare_flow("plan-merge")
def plan(
    config: str,
    budget: str | None = None,
    max_error: float | None = None,
    catalog: str | None = None,
    allow_empty: bool = False,
    memory: str | None = None,
) -> dict:
    """A budget that admits no expert block is a warning here (a merge refuses it), and so is a
    memory budget too small for the merge. `memory`: the merge process's budget (a size)."""
    request = build_request(
        config, budget=budget, max_error=max_error, catalog=catalog, allow_empty=allow_empty, memory=memory
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
    plan_artifact(result)
    return result


def plan_result(p, spec: MergeSpec, explain: list[dict], saved_plan: saved.PlanRef) -> dict:
    names = {row["expert"]: row["name"] for row in explain}
    return {
        "plan_digest": p.plan_digest,
        "plan_key": saved_plan.key,
        "merge_method": spec.merge_method,
        "experts": spec.expert_uris,
        # display names (catalog models.name), by position
        "expert_names": [names.get(i, uri) for i, uri in enumerate(spec.expert_uris)],
        "budget": p.budget,
        "budget_bytes": p.budget_bytes,
        "full_expert_bytes": p.full_expert_bytes,
        "expert_bytes_planned": p.expert_bytes_planned,
        "planned_bytes_per_expert": p.planned_bytes,
        "error_bound": p.error_bound,
        "bound_guaranteed": p.bound_guaranteed,
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
    runner: str = "thread",
    dask_address: str | None = None,
    allow_empty: bool = False,
    memory: str | None = None,
) -> dict:
    """runner: "thread" (the flow's thread pool) or "dask" (layer groups on the Dask cluster at
    dask_address, or on a local cluster). `{date}` in out becomes the run's scheduled date.
    allow_empty: merge even when the budget admits no expert block (the output is the base).
    memory: the process's memory budget, a size such as 8GiB (default: the config's `memory`,
    else half the machine's memory)."""
    t0 = time.perf_counter()
    started = now()
    request = build_request(
        config,
        out=out,
        budget=budget,
        max_error=max_error,
        overwrite=overwrite,
        catalog=catalog,
        runner=runner,
        dask_address=dask_address,
        run_date=scheduled_date() if "{date}" in out else None,
        allow_empty=allow_empty,
        memory=memory,
    )
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
            plan_artifact(plan_result(p, request.spec, explain, saved_plan))
        timings = {"index": outcome.seconds, "plan": time.perf_counter() - t_plan}
        memory = mem if first is not None else None  # the plan the decision was made on
        return execute_plan(
            Execution(request, p, saved_plan, "merge", outcome.ledger, timings, started, t0, first=first, memory=memory)
        )
