"""Tasks of execution and publishing: stage the output, merge one layer group, write the output
files, publish, record the run. Each is a thin wrapper over the stages' plain functions."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

from mergepipe.catalog import db, records
from mergepipe.config.environment import CatalogLocation, claim_stale_seconds
from mergepipe.config.spec import storage_options_of
from mergepipe.errors import BadInput, DeterminedError
from mergepipe.execute.group import GroupResult, merge_group
from mergepipe.execute.memory import MemoryPlan
from mergepipe.plan import saved
from mergepipe.publish.checks import changed_inputs
from mergepipe.publish.manifest import build_manifest, write_manifest, write_output_files
from mergepipe.storage.lease import Holder, OutputBusy, OutputLease
from mergepipe.storage.ledger import ByteLedger
from mergepipe.storage.location import is_remote, storage_options
from mergepipe.storage.staging import staging_at, staging_for
from mergepipe.tasks import progress
from mergepipe.tasks.declare import STORAGE_RETRIES, declare_task, freeze_long_lived
from mergepipe.tasks.heartbeat import beating

log = logging.getLogger("mergepipe.merge")


@contextmanager
def holding_output(out: str, run_id: str | None) -> Iterator[None]:
    """The output's lease (storage.lease) while the block runs, renewed by a heartbeat thread
    and given back however the block ends: a second run to the same output stops with
    OutputBusy before reading anything. A lease whose holder died is taken over after
    MERGEPIPE_CLAIM_STALE_SECONDS, as index claims are."""
    stale = claim_stale_seconds()
    owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
    lease = OutputLease(out, Holder(owner, run_id, time.time()), stale)
    lease.acquire()

    def beat() -> bool:
        try:
            lease.beat()
        except OutputBusy as err:  # taken over: nothing left to renew
            log.error("%s", err)
            return False
        return True

    try:
        with beating(beat, stale / 6, "output-lease"):
            yield
    finally:
        lease.release()


@declare_task("stage-output", **STORAGE_RETRIES)
def stage_output(saved_plan: saved.PlanRef, out: str) -> str:
    """The staging's location (storage.staging), named by the plan: a merge run again after a
    crash, on any machine, keeps what its first run staged."""
    plan, layout = saved.load(saved_plan)
    staging = staging_for(out, plan.plan_digest)
    staging.open([(s.name, s.header, s.size) for s in layout.shards])
    return staging.location


@declare_task("merge-layer-group", task_run_name="merge-layer-group[{group}]", **STORAGE_RETRIES)
def merge_layer_group(
    saved_plan: saved.PlanRef,
    group: str,
    staging: str,
    options_from: str | None = None,
    memory: MemoryPlan | None = None,
    index: list[int] | None = None,
) -> GroupResult:
    """Merge one group of tensors into the staged output and mark it done with its result
    (execute.group.GroupResult). A run resumed after a crash takes the result from the mark
    (execute.group.finished_group) instead of running the group again.

    `options_from`: the config whose storage_options the group reads with (a Dask worker has
    not loaded it); its path travels, never the options. Only that key is read, for this task
    alone: a worker serving several merges reads for each with its own options.
    `memory`: the merge's memory plan (execute.memory.plan_memory), made once by the flow.
    `index`: expert positions indexed from the bytes the merge reads (a first merge)."""
    with storage_options(storage_options_of(options_from) if options_from is not None else None):
        plan, layout = saved.load(saved_plan)
        freeze_long_lived()
        where = staging_at(staging)
        result = merge_group(plan, layout, group, where, memory, index, f"{socket.gethostname()}:{os.getpid()}")
        where.mark_done(group, result.as_record())
        return result


@declare_task("write-output-files", **STORAGE_RETRIES)
def finish_output(saved_plan: saved.PlanRef, staging: str) -> tuple[dict, dict, list[dict]]:
    """Index, sidecars, access set, model card and checksums; first, a check that no input
    changed while its bytes were being read (a merge of two versions of a file is never
    published). Returns the manifest's output section, its run entries (the card's, a built
    tokenizer's files) and the ledger rows."""
    plan, layout = saved.load(saved_plan)
    changed = changed_inputs(plan)
    if changed:
        raise BadInput(
            f"{changed[0]}: input changed during the merge (its fingerprint differs from the plan's); not publishing"
        )
    where = staging_at(staging)
    where.clear_marks()
    ledger = ByteLedger()
    output, outside = write_output_files(plan, layout, where, ledger)
    return output, outside, ledger.rows()


@declare_task("publish-output", **STORAGE_RETRIES)
def publish_output(
    saved_plan: saved.PlanRef,
    staging: str,
    out: str,
    overwrite: bool,
    output: dict,
    run: dict,
    expected_digest: str | None = None,
) -> tuple[dict, list[dict]]:
    """Write the manifest into staging and publish (a rename; in an object store, shards
    joined from their staged pieces and the manifest last).
    With expected_digest (replay), a merge that does not reproduce it is never published.
    Returns the manifest and the ledger rows of the upload."""
    plan, _ = saved.load(saved_plan)
    manifest = build_manifest(plan, output, run)
    if expected_digest is not None and manifest["digest"] != expected_digest:
        raise DeterminedError(f"replay produced digest {manifest['digest']}, the manifest records {expected_digest}")
    where = staging_at(staging)
    write_manifest(where, manifest)
    ledger = ByteLedger()
    rep = progress.reporter()
    if is_remote(out):
        rep.start("upload", where.size(), "B")
    try:
        where.publish(out, overwrite, ledger, progress=lambda n: rep.advance("upload", n))
    finally:
        rep.finish("upload")
    return manifest, ledger.rows()


@declare_task("record-run")
def record_run(catalog: CatalogLocation, run_row: dict, manifest_json: str) -> None:
    with db.connect(catalog) as con:
        records.record_run(con, run_row, manifest_json)
