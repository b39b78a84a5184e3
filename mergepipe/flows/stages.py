"""Flow: a multi-document config's stages (mergekit-multi's), in dependency order, each a merge
subflow; a named stage's output goes to INTERMEDIATE_DIR/NAME and is an input of the stages that
name it, the final stage's goes to `out`. A stage whose output is there and verifies against its
manifest is skipped, so a run that failed resumes at the stage that failed."""

from __future__ import annotations

from typing import Literal

from mergepipe.config.spec import read_documents, stage_output, validate_spec
from mergepipe.config.stages import stage_documents, stage_order
from mergepipe.flows.merge import merge
from mergepipe.flows.orchestration import declare_flow, run_flow
from mergepipe.publish.manifest import verified_digest
from mergepipe.storage.hub import one_commit_per_run
from mergepipe.storage.location import normalize


@declare_flow("merge-stages")
def merge_stages(
    config: str,
    out: str,
    intermediate_dir: str,
    budget: str | None = None,
    max_error: float | None = None,
    overwrite: bool = False,
    catalog: str | None = None,
    runner: Literal["thread", "dask"] = "thread",
    dask_address: str | None = None,
    memory: str | None = None,
    model_card: bool = True,
) -> dict:
    """Merge a multi-document config's stages in the order they need each other, and publish the
    final (unnamed) stage to `out`. Each stage runs as a merge subflow; the Hub revisions are
    looked up once for all of them.

    Args:
        config: Path or URI of the multi-document config (stages separated by `---`, each named
            by `name:` but the final one; a stage names an earlier one as a model).
        out: Where the final stage's output goes (a local folder or s3://bucket/prefix).
        intermediate_dir: Where each named stage's output goes, as INTERMEDIATE_DIR/NAME (local or
            s3://). A stage whose output there verifies against its manifest is not merged again.
        budget: An I/O budget for every stage, replacing each one's own (default: each stage's
            `budget`, else 100%).
        max_error: Instead of a budget, the largest error bound each stage accepts.
        overwrite: Replace an output already published at `out`.
        catalog: The catalog (default: MERGEPIPE_CATALOG, else $MERGEPIPE_HOME/catalog.duckdb).
        runner: Where layer groups run: "thread" or "dask".
        dask_address: With runner "dask": the scheduler, such as tcp://scheduler:8786.
        memory: The merge process's memory budget, a size such as 8GiB.
        model_card: Write each output's README.md model card.
    """
    stages = stage_documents(read_documents(config), config)
    named = {
        name: validate_spec(doc, source=f"{config}, stage {name or '(final)'}").model_uris
        for name, doc in stages.items()
    }
    rows, final = [], None
    with one_commit_per_run():  # every stage reads the same commits of a Hub model
        for name in stage_order(named, config):
            where = normalize(out) if name is None else stage_output(intermediate_dir, name)
            if name is not None and (digest := verified_digest(where)) is not None:
                rows.append({"stage": name, "out": where, "digest": digest, "skipped": True})
                continue
            result = run_flow(
                merge,
                config=config,
                out=where,
                budget=budget,
                max_error=max_error,
                # A named stage's output that does not verify (a run killed while publishing it
                # never leaves one; an edited one does) is merged again over it.
                overwrite=overwrite if name is None else True,
                catalog=catalog,
                runner=runner,
                dask_address=dask_address,
                memory=memory,
                model_card=model_card,
                stage=name,
                intermediate_dir=intermediate_dir,
            )
            rows.append({"stage": name, "out": result["out"], "digest": result["digest"], "skipped": False})
            final = result
    assert final is not None  # the final stage is never skipped
    return {**final, "stages": rows}
