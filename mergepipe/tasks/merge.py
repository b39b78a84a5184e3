"""Tasks of execution and publishing: stage the output, merge one layer group, write the output
files, publish, record the run. Each is a thin wrapper over the stages' plain functions."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from mergepipe.catalog import db, records
from mergepipe.config.environment import CatalogLocation, spool_dir
from mergepipe.config.spec import storage_options_of
from mergepipe.errors import BadInput, MergepipeError
from mergepipe.execute.group import GroupResult, merge_group
from mergepipe.execute.memory import MemoryPlan
from mergepipe.plan import saved
from mergepipe.publish.checks import changed_inputs
from mergepipe.publish.manifest import build_manifest, write_manifest, write_output_files
from mergepipe.storage import writer
from mergepipe.storage.ledger import ByteLedger
from mergepipe.storage.location import is_remote, set_storage_options, storage_options_set
from mergepipe.tasks import progress
from mergepipe.tasks.declare import STORAGE_RETRIES, declare_task, freeze_long_lived


@declare_task("stage-output", **STORAGE_RETRIES)
def stage_output(plan_dir: str, out: str) -> str:
    """The staging folder, named by the plan: a merge run again after a crash keeps what its
    first run staged."""
    plan, layout = saved.load(plan_dir)
    shards = [(s.name, s.header, s.size) for s in layout.shards]
    staging, _ = writer.open_staging(out, plan.plan_digest, shards, spool=spool_dir())
    return str(staging)


@declare_task("merge-layer-group", task_run_name="merge-layer-group[{group}]", **STORAGE_RETRIES)
def merge_layer_group(
    plan_dir: str,
    group: str,
    staging: str,
    options_from: str | None = None,
    memory: MemoryPlan | None = None,
    index: list[int] | None = None,
) -> GroupResult:
    """Merge one group of tensors into the staged output and mark it done with its result
    (execute.group.GroupResult). A run resumed after a crash takes the result from the mark
    (execute.group.finished_group) instead of running the group again.

    `options_from`: the config whose storage_options this process needs (a Dask worker has
    not loaded it); its path travels, never the options. Read once per process, and only that key.
    `memory`: the merge's memory plan (execute.memory.plan_memory), made once by the flow.
    `index`: expert positions indexed from the bytes the merge reads (a first merge)."""
    if options_from is not None and not storage_options_set():
        set_storage_options(storage_options_of(options_from))
    plan, layout = saved.load(plan_dir)
    freeze_long_lived()
    result = merge_group(plan, layout, group, Path(staging), memory, index, f"{socket.gethostname()}:{os.getpid()}")
    writer.mark_group_done(Path(staging), group, result.as_record())
    return result


@declare_task("write-output-files", **STORAGE_RETRIES)
def finish_output(plan_dir: str, staging: str) -> tuple[dict, list[dict]]:
    """Index, sidecars, access set and checksums; first, a check that no input changed while
    its bytes were being read (a merge of two versions of a file is never published)."""
    plan, layout = saved.load(plan_dir)
    changed = changed_inputs(plan)
    if changed:
        raise BadInput(
            f"{changed[0]}: input changed during the merge (its fingerprint differs from the plan's); not publishing"
        )
    writer.clear_group_marks(Path(staging))
    ledger = ByteLedger()
    output = write_output_files(plan, layout, Path(staging), ledger)
    return output, ledger.rows()


@declare_task("publish-output", **STORAGE_RETRIES)
def publish_output(
    plan_dir: str, staging: str, out: str, overwrite: bool, output: dict, run: dict, expected_digest: str | None = None
) -> tuple[dict, list[dict]]:
    """Write the manifest into staging and publish (rename, or upload with the manifest last).
    With expected_digest (replay), a merge that does not reproduce it is never published.
    Returns the manifest and the ledger rows of the upload."""
    plan, _ = saved.load(plan_dir)
    manifest = build_manifest(plan, output, run)
    if expected_digest is not None and manifest["digest"] != expected_digest:
        raise MergepipeError(f"replay produced digest {manifest['digest']}, the manifest records {expected_digest}")
    write_manifest(Path(staging), manifest)
    ledger = ByteLedger()
    rep = progress.reporter()
    if is_remote(out):
        rep.start("upload", sum(p.stat().st_size for p in Path(staging).iterdir()), "B")
    try:
        writer.publish(Path(staging), out, overwrite, ledger, progress=lambda n: rep.advance("upload", n))
    finally:
        rep.finish("upload")
    return manifest, ledger.rows()


@declare_task("record-run")
def record_run(catalog: CatalogLocation, run_row: dict, manifest_json: str) -> None:
    with db.connect(catalog) as con:
        records.record_run(con, run_row, manifest_json)
