"""Flow: re-execute a manifest's access set, without re-planning, and reproduce its digest."""

from __future__ import annotations

import time
from typing import Literal

from mergepipe.config.request import MergeRequest, build_request
from mergepipe.config.spec import validate_spec
from mergepipe.errors import BadInput
from mergepipe.flows.automations import begin_attempt
from mergepipe.flows.common import Execution, execute_plan, flow_run_id, now, run_index
from mergepipe.flows.orchestration import declare_flow, run_flow
from mergepipe.plan import saved
from mergepipe.plan.record import build_plan
from mergepipe.publish.checks import check_commits
from mergepipe.publish.manifest import load_access_set, load_manifest, manifest_uri, verified_digest
from mergepipe.storage.location import set_storage_options, split
from mergepipe.tasks.merge import holding_output


@declare_flow("replay", thread_pool=True)
def replay(
    manifest: str,
    out: str,
    overwrite: bool = False,
    catalog: str | None = None,
    runner: Literal["thread", "dask"] = "thread",
    dask_address: str | None = None,
    memory: str | None = None,
) -> dict:
    """Re-execute a manifest's access set without planning again, and publish it only if it
    reproduces the manifest's digest. The final output of a multi-document config names the
    stages it read (run.stages): those whose outputs no longer verify are replayed first, into
    their own places.

    Args:
        manifest: A published output (its folder or prefix) or its mergepipe-manifest.json.
        out: Where the replayed output goes: a local folder or s3://bucket/prefix.
        overwrite: Replace an output already published at `out`.
        catalog: The catalog: a DuckDB file, or postgresql://user@host:port/dbname for one that
            many machines share (default: MERGEPIPE_CATALOG, else $MERGEPIPE_HOME/catalog.duckdb).
        runner: Where layer groups run: "thread" (the flow's thread pool) or "dask" (the Dask
            cluster at dask_address, or a local cluster).
        dask_address: With runner "dask": the scheduler, such as tcp://scheduler:8786.
        memory: The process's memory budget, a size such as 8GiB (default: half the machine's
            memory).
    """
    begin_attempt()
    t0 = time.perf_counter()
    started = now()
    # Manifests never hold storage options: object stores are reached with the environment's
    # credentials and endpoint (AWS_* variables, profiles).
    set_storage_options(None)
    recorded = load_manifest(manifest)
    stages = _replay_stages(recorded, catalog, runner, dask_address, memory)
    spec = validate_spec(recorded["run"]["spec"], source=manifest_uri(manifest))
    request = build_request(
        spec, out=out, overwrite=overwrite, catalog=catalog, runner=runner, dask_address=dask_address, memory=memory
    )
    with holding_output(request.out, flow_run_id()):  # one run at a time works on an output
        result = _replay(request, recorded, manifest, started, t0)
    return {**result, "stages": stages} if stages else result


def _replay_stages(
    recorded: dict, catalog: str | None, runner: str, dask_address: str | None, memory: str | None
) -> list[dict]:
    """The earlier stages of a multi-document config that the merge read (its run.stages),
    replayed first, into their own places, where their outputs no longer verify: a replay of
    the final output replays the chain."""
    rows = []
    for stage in recorded["run"].get("stages") or []:
        where = split(stage["manifest"])[0]
        if verified_digest(where) == stage["digest"]:
            rows.append({"stage": stage["stage"], "out": where, "digest": stage["digest"], "replayed": False})
            continue
        try:
            digest = load_manifest(where)["digest"]
        except BadInput:
            raise BadInput(
                f"{where}: the output of stage {stage['stage']!r} is gone with its manifest; "
                "merge the config's stages again"
            ) from None
        if digest != stage["digest"]:
            raise BadInput(
                f"{where}: holds another merge of stage {stage['stage']!r} (digest {digest}, the merge read {stage['digest']})"
            )
        r = run_flow(
            replay,
            manifest=where,
            out=where,
            overwrite=True,
            catalog=catalog,
            runner=runner,
            dask_address=dask_address,
            memory=memory,
        )
        rows.append({"stage": stage["stage"], "out": where, "digest": r["digest"], "replayed": True})
    return rows


def _replay(request: MergeRequest, recorded: dict, manifest: str, started: str, t0: float) -> dict:
    spec, content = request.spec, recorded["content"]
    check_commits(spec.model_uris, recorded["run"].get("commits", []))  # before any byte is read
    outcome = run_index(spec, request.catalog, planned=False)  # the access set is the manifest's
    fps = [outcome.family.base_fp, *outcome.family.expert_fps()]
    for want, fp, uri in zip(
        content["plan"]["inputs"], fps, [m.uri for m in [outcome.family.base, *outcome.family.experts]]
    ):
        have = outcome.content[fp]
        if have != want["content_sha256"]:
            raise BadInput(
                f"{uri}: input {want['role']} changed since the merge "
                f"(content sha256 {have}, the manifest records {want['content_sha256']}); refusing to replay"
            )
    access = load_access_set(manifest, recorded)
    plan_content = content["plan"]
    p = build_plan(
        spec,
        outcome.family,
        outcome.content,
        access,
        budget_bytes=plan_content["budget_bytes"],
        bound=plan_content["error_bound"],
    )
    if p.plan_digest != plan_content["plan_digest"]:
        raise BadInput(
            f"{manifest_uri(manifest)}: the access set and spec give plan {p.plan_digest}, the manifest records {plan_content['plan_digest']}"
        )
    saved_plan = saved.save(p, request.catalog)
    return execute_plan(
        Execution(
            request,
            p,
            saved_plan,
            "replay",
            outcome.ledger,
            {"index": outcome.seconds},
            started,
            t0,
            recorded["digest"],
        )
    )
