"""Flow: re-execute a manifest's access set, without re-planning, and reproduce its digest."""

from __future__ import annotations

import time

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from mergepipe.errors import BadInput
from mergepipe.publish.manifest import load_access_set, load_manifest, manifest_uri
from mergepipe.plan.record import build_plan
from mergepipe.config.spec import MergeSpec
from mergepipe.storage.location import set_storage_options
from mergepipe.storage.writer import check_destination
from mergepipe.tasks.plan import plans_dir
from mergepipe.flows.common import execute_plan, now, run_index, worker_count
from mergepipe.flows.runners import check_runner


@flow(name="replay", task_runner=ThreadPoolTaskRunner(max_workers=worker_count()))
def replay(
    manifest: str,
    out: str,
    overwrite: bool = False,
    catalog: str | None = None,
    runner: str = "thread",
    dask_address: str | None = None,
) -> dict:
    t0 = time.perf_counter()
    started = now()
    check_runner(runner, dask_address)
    # Manifests never hold storage options: object stores are reached with the environment's
    # credentials and endpoint (AWS_* variables, profiles).
    set_storage_options(None)
    recorded = load_manifest(manifest)
    content, run = recorded["content"], recorded["run"]
    spec = MergeSpec.model_validate(run["spec"])
    out_path = check_destination(out, overwrite, [spec.base_model, *spec.expert_uris])
    outcome = run_index(spec, catalog)
    fps = [outcome.family.base_fp, *outcome.family.expert_fps()]
    for want, fp, uri in zip(content["plan"]["inputs"], fps, [spec.base_model, *spec.expert_uris]):
        have = outcome.content[fp]
        if have != want["content_sha256"]:
            raise BadInput(
                f"{uri}: input {want['role']} changed since the merge "
                f"(content sha256 {have}, the manifest records {want['content_sha256']}); refusing to replay"
            )
    access = load_access_set(manifest, recorded)
    plan_content = content["plan"]
    p = build_plan(
        spec, outcome.family, outcome.content, access,
        budget_bytes=plan_content["budget_bytes"], bound=plan_content["error_bound"],
    )
    if p.plan_digest != plan_content["plan_digest"]:
        raise BadInput(f"{manifest_uri(manifest)}: the access set and spec give plan {p.plan_digest}, the manifest records {plan_content['plan_digest']}")
    plan_dir = plans_dir(p)
    p.save(plan_dir)
    return execute_plan(
        p, plan_dir, out_path, overwrite=overwrite, catalog=catalog, kind="replay",
        index_ledger=outcome.ledger, timings={"index": outcome.seconds}, started_at=started, t0=t0,
        expected_digest=recorded["digest"], runner=runner, dask_address=dask_address,
    )
