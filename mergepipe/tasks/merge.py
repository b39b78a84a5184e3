"""Tasks of execution: stage the output, merge one layer group, publish."""

from __future__ import annotations

import os
import socket
from functools import lru_cache
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergepipe.catalog import db, records
from mergepipe.tasks import progress
from mergepipe.errors import BadInput, MergepipeError
from mergepipe.execute.group import changed_inputs, group_regions, merge_group, output_layout_of
from mergepipe.config.environment import home
from mergepipe.publish.manifest import build_manifest, write_manifest, write_output_files
from mergepipe.plan.output import OutputLayout
from mergepipe.plan.record import Plan
from mergepipe.storage import writer
from mergepipe.storage.ledger import ByteLedger
from mergepipe.config.spec import load_spec
from mergepipe.storage.location import is_remote, set_storage_options, storage_options_set
from mergepipe.tasks import STORAGE_RETRIES


@lru_cache(maxsize=4)
def load_plan(plan_dir: str) -> tuple[Plan, OutputLayout]:
    """A saved plan and its output layout, loaded once per process."""
    plan = Plan.load(plan_dir)
    return plan, output_layout_of(plan)


@task(name="stage-output", cache_policy=NO_CACHE, **STORAGE_RETRIES)
def stage_output(plan_dir: str, out: str) -> str:
    """The staging folder, named by the plan: a merge run again after a crash keeps what its
    first run staged."""
    plan, layout = load_plan(plan_dir)
    staging, _ = writer.open_staging(out, plan.plan_digest, [(s.name, s.header, s.size) for s in layout.shards])
    return str(staging)


def results_dir() -> Path:
    """Where task results are persisted (the statistics pass's cache)."""
    return home() / "results"


@task(name="merge-layer-group", cache_policy=NO_CACHE, **STORAGE_RETRIES)
def merge_layer_group(plan_dir: str, group: str, staging: str, options_from: str | None = None) -> dict:
    """Merge one group of tensors into the staged output and mark it done with its result: the
    ledger rows, the hash of the bytes written and the worker. A run resumed after a crash takes
    the result from the mark (`finished_group`) instead of running the group again.

    `options_from`: the config whose storage_options this process needs (a Dask worker has
    not loaded it); its path travels, never the options."""
    if options_from is not None and not storage_options_set():
        set_storage_options(load_spec(options_from).storage_options)
    plan, layout = load_plan(plan_dir)
    result = {**merge_group(plan, layout, group, Path(staging)), "worker": f"{socket.gethostname()}:{os.getpid()}"}
    writer.mark_group_done(Path(staging), group, result)
    return result


def finished_group(plan_dir: str, group: str, staging: str) -> dict | None:
    """What merge_layer_group returned for a group an earlier run finished, if its mark is there
    and its staged bytes are still exactly those it wrote; else None."""
    _, layout = load_plan(plan_dir)
    return writer.group_record(Path(staging), group, group_regions(layout, group))


@task(name="write-output-files", cache_policy=NO_CACHE, **STORAGE_RETRIES)
def finish_output(plan_dir: str, staging: str) -> tuple[dict, list[dict]]:
    """Index, sidecars, access set and checksums; first, a check that no input changed while
    its bytes were being read (a merge of two versions of a file is never published)."""
    plan, layout = load_plan(plan_dir)
    changed = changed_inputs(plan)
    if changed:
        raise BadInput(f"{changed[0]}: input changed during the merge (its fingerprint differs from the plan's); not publishing")
    writer.clear_group_marks(Path(staging))
    ledger = ByteLedger()
    output = write_output_files(plan, layout, Path(staging), ledger)
    return output, ledger.rows()


@task(name="publish-output", cache_policy=NO_CACHE, **STORAGE_RETRIES)
def publish_output(
    plan_dir: str, staging: str, out: str, overwrite: bool, output: dict, run: dict, expected_digest: str | None = None
) -> tuple[dict, list[dict]]:
    """Write the manifest into staging and publish (rename, or upload with the manifest last).
    With expected_digest (replay), a merge that does not reproduce it is never published.
    Returns the manifest and the ledger rows of the upload."""
    plan, _ = load_plan(plan_dir)
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


@task(name="record-run", cache_policy=NO_CACHE)
def record_run(catalog: str | None, run_row: dict, manifest_json: str) -> None:
    with db.connect(catalog) as con:
        records.record_run(con, run_row, manifest_json)
