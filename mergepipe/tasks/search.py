"""Tasks of a merge search: evaluate a candidate, and record a trial in the catalog."""

from __future__ import annotations

from mergepipe.catalog import db, records
from mergepipe.config.environment import CatalogLocation
from mergepipe.config.search import Evaluation
from mergepipe.tasks.declare import STORAGE_RETRIES, declare_task


@declare_task("evaluate-candidate", task_run_name="evaluate[{label}]")
def evaluate_candidate(setting: Evaluation, model_dir: str, label: str) -> dict:
    """The candidate's score (a failed evaluation is a result, with its error, not a failure of
    the task: the search records it and goes on)."""
    from mergepipe.evaluate import evaluate

    return evaluate(setting, model_dir).as_json()


@declare_task("record-trial", **STORAGE_RETRIES)
def record_trial(catalog: CatalogLocation, row: dict) -> None:
    with db.connect(catalog) as con:
        records.record_trial(con, row)


@declare_task("read-trials", **STORAGE_RETRIES)
def read_trials(catalog: CatalogLocation, search: str) -> list[dict]:
    with db.connect(catalog) as con:  # made if missing: a catalog from before searches lacks the table
        return records.search_trials(con, search)
