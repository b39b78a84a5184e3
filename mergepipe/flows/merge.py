"""Flows: plan a merge, and merge (index → plan → per-layer execution → publish)."""

from __future__ import annotations

import time

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from mergepipe.config.spec import MergeSpec
from mergepipe.storage.writer import check_destination
from mergepipe.tasks.plan import plan_merge
from mergepipe.flows.artifacts import plan_artifact
from mergepipe.flows.common import execute_plan, load_config, now, run_index, worker_count
from mergepipe.flows.orchestration import run_task
from mergepipe.flows.runners import check_runner


def with_run_date(out: str) -> str:
    """`{date}` in an output location becomes the run's scheduled date (UTC), so a scheduled
    deployment writes each night's merge to its own folder."""
    if "{date}" not in out:
        return out
    from prefect.runtime import flow_run

    when = flow_run.scheduled_start_time
    return out.replace("{date}", when.strftime("%Y-%m-%d"))


def spec_with_overrides(config: str, budget: str | None, max_error: float | None) -> MergeSpec:
    spec = load_config(config)
    if budget is not None:
        spec = spec.with_overrides(budget=budget, max_error=None)
    elif max_error is not None:
        spec = spec.with_overrides(budget=None, max_error=max_error)
    return spec


@flow(name="plan-merge")
def plan(config: str, budget: str | None = None, max_error: float | None = None, catalog: str | None = None) -> dict:
    spec = spec_with_overrides(config, budget, max_error)
    outcome = run_index(spec, catalog)
    p, explain, plan_dir = run_task(plan_merge, spec, outcome.family, outcome.content, catalog)
    result = plan_result(p, spec, explain, plan_dir)
    plan_artifact(result)
    return result


def plan_result(p, spec: MergeSpec, explain: list[dict], plan_dir: str) -> dict:
    return {
        "plan_digest": p.plan_digest,
        "plan_dir": plan_dir,
        "merge_method": spec.merge_method,
        "experts": spec.expert_uris,
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


@flow(name="merge", task_runner=ThreadPoolTaskRunner(max_workers=worker_count()))
def merge(
    config: str,
    out: str,
    budget: str | None = None,
    max_error: float | None = None,
    overwrite: bool = False,
    catalog: str | None = None,
    runner: str = "thread",
    dask_address: str | None = None,
) -> dict:
    """runner: "thread" (the flow's thread pool) or "dask" (layer groups on the Dask cluster at
    dask_address, or on a local cluster)."""
    t0 = time.perf_counter()
    started = now()
    check_runner(runner, dask_address)
    spec = spec_with_overrides(config, budget, max_error)
    out = with_run_date(out)
    out_path = check_destination(out, overwrite, [spec.base_model, *spec.expert_uris])
    outcome = run_index(spec, catalog)
    t_plan = time.perf_counter()
    p, explain, plan_dir = run_task(plan_merge, spec, outcome.family, outcome.content, catalog)
    plan_artifact(plan_result(p, spec, explain, plan_dir))
    timings = {"index": outcome.seconds, "plan": time.perf_counter() - t_plan}
    return execute_plan(
        p, plan_dir, out_path, overwrite=overwrite, catalog=catalog, kind="merge",
        index_ledger=outcome.ledger, timings=timings, started_at=started, t0=t0,
        runner=runner, dask_address=dask_address, options_from=config if spec.storage_options else None,
    )
