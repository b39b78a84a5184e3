"""Flow: a merge search. Many candidate configs, each a budgeted merge into a scratch folder
scored by the user's evaluation, asked of and told to an Optuna study kept beside the catalog;
then the best trials merged again at the final budget, the best of those published with its
manifest, and a report of the whole search."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, as_completed, wait
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import yaml

from mergepipe.catalog import study as studies
from mergepipe.config.environment import CatalogLocation, catalog_location, default_memory
from mergepipe.config.request import Runner
from mergepipe.config.search import SearchSpec, candidate_yaml, load_search, load_spec_document
from mergepipe.config.sizes import parse_budget, parse_size
from mergepipe.config.spec import LORA_JOIN, MergeSpec
from mergepipe.errors import BadInput, MergepipeError
from mergepipe.flows.artifacts import artifact_key, create_table_artifact
from mergepipe.flows.merge import merge
from mergepipe.flows.orchestration import call_in_process, declare_flow, publish_artifact, run_flow, run_task
from mergepipe.flows.runners import layer_task_runner
from mergepipe.publish.manifest import load_manifest, verified_digest
from mergepipe.publish.search_report import search_report, summary_rows
from mergepipe.storage import cache
from mergepipe.storage.lease import Holder, OutputBusy, OutputLease
from mergepipe.storage.ledger import READ_ROLES
from mergepipe.storage.location import ContextPool, is_remote, join
from mergepipe.storage.writer import check_destination, write_file
from mergepipe.tasks import progress
from mergepipe.tasks.declare import declare_task
from mergepipe.tasks.heartbeat import beating
from mergepipe.tasks.search import evaluate_candidate, read_trials, record_trial

log = logging.getLogger("mergepipe.search")

SEARCH_KEY = "merge-search"
BASE_SCORE = "base_score"  # the study's record of the evaluation of the base model
POLL_S = 2.0  # how often a process waiting on others' trials looks again


@dataclass
class Search:
    """One run of a search: what it searches, where, and its study."""

    spec: SearchSpec
    out: str
    catalog: CatalogLocation
    name: str
    scratch: Path
    runner: str
    dask_address: str | None
    memory: int  # the memory budget of the trials in flight, together
    catalog_arg: str | None = None  # the catalog as given (a flow parameter never holds a password)
    cache: Path | None = None  # the block cache, and the size it is trimmed to between trials
    cache_bound: int = 0
    study: Any = field(repr=False, default=None)

    def __getstate__(self) -> dict:
        # Sent to a Dask worker with each of its trials: the study stays in the search's
        # process, which alone asks and tells it.
        return {**self.__dict__, "study": None}


def _now() -> datetime:
    return datetime.now(timezone.utc)


@declare_flow("merge-search")
def merge_search(
    config: str,
    out: str,
    trials: int | None = None,
    parallel: int | None = None,
    report: str | None = None,
    scratch: str | None = None,
    overwrite: bool = False,
    catalog: str | None = None,
    runner: Literal["thread", "dask"] = "thread",
    dask_address: str | None = None,
    memory: str | None = None,
    cache_size: str | None = None,
) -> dict:
    """Search a merge config's ranges and choices: each trial a merge at the search's budget
    into a scratch folder, scored by its evaluation; the best trials merged again at the final
    budget, and the best of those published to `out` with a manifest that records the search.
    Running it again with the same config and `out` resumes the search.

    Args:
        config: The search config: a merge config (YAML in mergekit's shape) whose values may be
            {search: [LOW, HIGH]} or {choice: [...]}, with a `search:` section.
        out: Where the best candidate goes: a local folder or s3://bucket/prefix.
        trials: How many trials in all (default: the config's search.trials, else 50).
        parallel: Trials run at once (default: the config's search.parallel, else 1).
        report: Folder for search.md, search.json and search.png (default: OUT-search beside
            a local OUT, else ./mergepipe-search).
        scratch: Local folder for the candidates while they are evaluated (default: the
            machine's temporary folder).
        overwrite: Replace an output already published at `out`.
        catalog: The catalog (default: MERGEPIPE_CATALOG, else $MERGEPIPE_HOME/catalog.duckdb);
            the search's Optuna study lives beside it.
        runner: Where trials run: "thread" (this process's threads, each merge a subflow) or
            "dask" (each trial, its merge and its evaluation one task run on a Dask worker).
        dask_address: With runner "dask": the scheduler, such as tcp://scheduler:8786 (default:
            a local cluster of `parallel` worker processes).
        memory: Memory for the trials in flight, all together (default: half the machine's).
        cache_size: The bound of the block cache that serves remote inputs' bytes read by one
            trial to the next (MERGEPIPE_CACHE, else SCRATCH/cache), a size such as 20GiB
            (default: half the free space on its disk at the start).
    """
    s = _open(config, out, trials, parallel, scratch, overwrite, catalog, runner, dask_address, memory)
    rep = progress.reporter()
    with _block_cache(s, cache_size), _trial_pool(s) as submit:
        _check_base(s, rep)
        _run_trials(s, rep, submit)
        result = _finish(s, overwrite, rep, submit)
    shutil.rmtree(s.scratch, ignore_errors=True)  # each candidate's folder went when it was scored
    folder = Path(report) if report else default_report(s.out)
    folder.mkdir(parents=True, exist_ok=True)
    title = f"search of {Path(str(config)).name}"
    for name, data in search_report(result, title).items():
        write_file(folder / name, data)
    result["report"] = str(folder)
    publish_artifact(
        create_table_artifact,
        key=artifact_key(SEARCH_KEY, out),
        table=summary_rows(result),
        description=f"merge search of {config} into {s.out}",
    )
    return result


def default_report(out: str) -> Path:
    """Beside a local output (never in it: its files are the manifest's), else here."""
    return Path("mergepipe-search") if is_remote(out) else Path(out).with_name(Path(out).name + "-search")


@contextmanager
def _block_cache(s: Search, size: str | None) -> Iterator[None]:
    """The block cache of remote inputs while the block runs: the one configured, else one under
    the scratch root, made the process's meanwhile (storage.cache reads MERGEPIPE_CACHE); with its
    bound (by default half its disk's free space), trimmed to it at the end."""
    root, given = cache.cache_dir(), os.environ.get(cache.ENV)
    if root is None:
        root = s.scratch.parent / "cache"
        os.environ[cache.ENV] = str(root.resolve())
    try:
        root.mkdir(parents=True, exist_ok=True)
        s.cache = root
        s.cache_bound = parse_size(size, key="--cache-size") if size else shutil.disk_usage(root).free // 2
        yield
        cache.trim(root, s.cache_bound, wait=True)
    finally:
        if given is None:
            os.environ.pop(cache.ENV, None)


def _open(
    config: str,
    out: str,
    trials: int | None,
    parallel: int | None,
    scratch: str | None,
    overwrite: bool,
    catalog: str | None,
    runner: str,
    dask_address: str | None,
    memory: str | None,
) -> Search:
    spec = load_search(config, trials=trials, parallel=parallel)
    first = spec.candidate_spec(spec.first_values())
    destination = check_destination(out, True, first.model_uris)
    location = catalog_location(catalog)
    name = spec.study_name(destination)
    if not overwrite and _searched_by(destination) != name:  # not this search's own output
        check_destination(out, False, first.model_uris)
    root = Path(scratch).expanduser() if scratch else Path(tempfile.gettempdir()) / "mergepipe-search"
    total_memory = parse_size(memory, key="--memory") if memory else (first.memory_bytes or default_memory())
    s = Search(spec, destination, location, name, root / name, runner, dask_address, total_memory, catalog)
    s.scratch.mkdir(parents=True, exist_ok=True)
    s.study = studies.open_study(spec, location, name)
    return s


def _searched_by(out: str) -> str | None:
    try:
        return (load_manifest(out)["run"].get("search") or {}).get("study")
    except (BadInput, KeyError, TypeError, OSError):
        return None


# The base model, evaluated before the first trial ----------------------------------------------


def _check_base(s: Search, rep) -> None:
    """Run the evaluation on the base model once per study: an evaluation that fails there would
    fail every trial, so the search stops (exit 2) with its message."""
    if BASE_SCORE in s.study.user_attrs:
        return
    base = s.spec.candidate_spec(s.spec.first_values()).base_model
    rep.note(f"search {s.name}: checking the evaluation on the base model {base}")
    where = s.scratch / "base"
    if is_remote(base) or LORA_JOIN in base or not Path(base).is_dir():
        # Not a local folder: the base as a merge that reads no expert writes one.
        folder = str(where / "model")
        _merge_candidate(
            s, s.spec.candidate(s.spec.first_values()), "0%", folder, where / "candidate.yml", allow_empty=True
        )
    else:
        folder = base
    score = run_task(evaluate_candidate, s.spec.settings.evaluate, folder, "base")
    shutil.rmtree(where, ignore_errors=True)
    if score["error"] is not None or score["score"] is None:
        raise BadInput(f"search.evaluate: fails on the base model {base}: {score['error']}")
    s.study.set_user_attr(BASE_SCORE, score["score"])
    rep.note(f"base model: score {score['score']:.6g}")


# Trials ------------------------------------------------------------------------------------------

Submit = Callable[[int, dict, str, bool], "Future[dict]"]


@contextmanager
def _trial_pool(s: Search) -> Iterator[Submit]:
    """Where trials run, `parallel` at a time: on threads of this process (each merge a subflow,
    each evaluation a task run, under Prefect), or with runner "dask" each trial one task run on
    a Dask worker. A submit(number, params, budget, final) returns a future of the trial's row."""
    parallel = s.spec.settings.parallel
    with ExitStack() as stack:
        dask = None
        if s.runner == "dask":
            dask = stack.enter_context(layer_task_runner(Runner("dask", s.dask_address), parallel))
        pool = stack.enter_context(ContextPool(parallel, thread_name_prefix="trial"))

        def submit(number: int, params: dict, budget: str, final: bool) -> Future[dict]:
            if dask is None:
                return pool.submit(run_candidate, s, number, params, budget, final)
            return pool.submit(_on_dask, dask, s, number, params, budget, final)

        yield submit


@declare_task("search-trial", task_run_name="trial[{label}]")
def search_trial(s: Search, number: int, params: dict, budget: str, final: bool, label: str) -> dict:
    """A trial as one task run on a Dask worker: its merge (layer groups on the worker's threads)
    and its evaluation run here without Prefect. The block cache is the worker's MERGEPIPE_CACHE,
    else the search's folder (the same path on the worker's disk)."""
    given = os.environ.get(cache.ENV)
    if given is None and s.cache is not None:
        os.environ[cache.ENV] = str(s.cache)
    try:
        here = dataclasses.replace(s, runner="thread", dask_address=None)
        return call_in_process(run_candidate, here, number, params, budget, final)
    finally:
        if given is None:
            os.environ.pop(cache.ENV, None)


def _on_dask(dask: Any, s: Search, number: int, params: dict, budget: str, final: bool) -> dict:
    label = f"{number}{'-final' if final else ''}"
    given = {"s": s, "number": number, "params": params, "budget": budget, "final": final, "label": label}
    try:
        return dask.submit(search_trial.prefect, parameters=given).result()
    except Exception as err:  # noqa: BLE001 - a worker lost or a task that could not run fails its trial
        row = _new_row(s, number, params, budget, final)
        row["error"] = f"worker: {type(err).__name__}: {err}"
        return _recorded(s, row, s.scratch / _folder_name(number, final))


def _memory_share(s: Search) -> str:
    return f"{max(1, s.memory // s.spec.settings.parallel)}B"


def _merge_candidate(s: Search, doc: dict, budget: str, out: str, config: Path, **options: Any) -> dict:
    """A candidate config merged into `out` (a trial's: replaced if there, a model card-less
    output within a share of the memory): its config is written to `config` with every model
    location resolved (as the search config's are), for the merge subflow to read."""
    spec: MergeSpec = load_spec_document(doc, s.spec.location)
    config.parent.mkdir(parents=True, exist_ok=True)
    config.touch(mode=0o600)  # it may hold the search config's storage options
    config.write_text(yaml.safe_dump({**spec.recorded(), "storage_options": spec.storage_options}, sort_keys=False))
    given = {"overwrite": True, "model_card": False, "memory": _memory_share(s), **options}
    return run_flow(
        merge,
        config=str(config),
        out=out,
        budget=budget,
        catalog=s.catalog_arg,
        runner=s.runner,
        dask_address=s.dask_address,
        **given,
    )


def run_candidate(s: Search, number: int, params: dict, budget: str, final: bool) -> dict:
    """One candidate: merged at `budget` into the scratch, evaluated, deleted; its row recorded
    in the catalog. A merge or an evaluation that fails makes a failed row, never an error."""
    doc = s.spec.candidate(s.spec.values_at(params))
    folder = s.scratch / _folder_name(number, final)
    row = _new_row(s, number, params, budget, final)
    t0 = time.perf_counter()
    try:
        merged = _merge_candidate(s, doc, budget, str(folder / "model"), folder / "candidate.yml")
    except Exception as err:  # noqa: BLE001 - a candidate that cannot merge fails its trial, not the search
        what = str(err) if isinstance(err, MergepipeError) else f"{type(err).__name__}: {err}"
        row.update(error=f"merge: {what}", merge_seconds=time.perf_counter() - t0)
        return _recorded(s, row, folder)
    run, index = merged.get("bytes", {}), merged.get("index_bytes", {})
    served = run.get("cache", 0) + index.get("cache", 0)
    row.update(
        plan_key=merged["plan_key"],
        budget_bytes=merged["budget_bytes"],
        expert_bytes_read=merged["expert_bytes_read"],
        cache_bytes=served,
        # read roles count what the cache served too (beside its own role): what storage sent is the rest
        input_bytes_read=sum(run.get(r, 0) + index.get(r, 0) for r in READ_ROLES) - served,
        error_bound=merged["error_bound"],
        merge_digest=merged["digest"],
        merge_seconds=time.perf_counter() - t0,
    )
    try:
        score = run_task(evaluate_candidate, s.spec.settings.evaluate, str(folder / "model"), f"{s.name}:{number}")
    except Exception as err:  # noqa: BLE001 - the evaluator's own failure fails the trial
        score = {"score": None, "metrics": {}, "seconds": 0.0, "error": f"{type(err).__name__}: {err}"}
    row.update(eval_seconds=score["seconds"], metrics_json=json.dumps(score["metrics"], sort_keys=True))
    if score["error"] is not None or score["score"] is None or not math.isfinite(score["score"]):
        row["error"] = f"evaluate: {score['error'] or 'no score'}"
    else:
        row.update(state="complete", score=float(score["score"]))
    return _recorded(s, row, folder)


def _new_row(s: Search, number: int, params: dict, budget: str, final: bool) -> dict[str, Any]:
    values = s.spec.values_at(params)
    return {
        "search": s.name,
        "trial": number,
        "final": final,
        "state": "failed",
        "params_json": json.dumps(values, sort_keys=True, default=str),
        "config_yaml": candidate_yaml(s.spec.candidate(values)),
        "budget": budget,
        "worker": studies.this_process(),
    }


def _folder_name(number: int, final: bool) -> str:
    return f"{'final' if final else 'trial'}-{number}"


def _recorded(s: Search, row: dict, folder: Path) -> dict:
    shutil.rmtree(folder, ignore_errors=True)
    row["finished_at"] = _now()
    run_task(record_trial, s.catalog, row)
    root = cache.cache_dir()  # this process's (a Dask worker's own), kept to the bound between trials
    if root is not None:
        cache.trim(root, s.cache_bound)  # skipped while another trial reads through it
    return row


def _run_trials(s: Search, rep, submit: Submit) -> None:
    """Ask the study for trials while fewer than the total have been asked for (by any process),
    `parallel` at a time, and tell it each result; then wait for the other processes' trials."""
    from optuna.trial import TrialState

    settings, study = s.spec.settings, s.study
    total, parallel = settings.trials, settings.parallel
    if settings.sampler == "grid":
        total = min(total, studies.grid_size(s.spec))  # each point once
    inflight: dict[Future, Any] = {}
    stats = {"done": 0, "failed": 0, "bytes": 0}
    rep.start("trials", total, "trials")
    rep.advance("trials", sum(1 for t in studies.counted(study) if t.state.is_finished()))

    def beat() -> None:
        for trial in list(inflight.values()):
            trial.set_user_attr(studies.HEARTBEAT, time.time())

    try:
        with beating(beat, studies.HEARTBEAT_S, "trial"):
            while True:
                requeued = studies.requeue_stale(study, lambda n: _recorded_row(s, n))
                if requeued:
                    rep.note(f"trials {requeued}: left running by a process that died; queued to run again")
                while len(inflight) < parallel and _may_ask(study, total):
                    trial = study.ask()
                    if not studies.claim(study, trial, total):
                        break
                    params = studies.suggest(trial, s.spec)
                    inflight[submit(trial.number, params, settings.budget, False)] = trial
                if not inflight:
                    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING))
                    if not running:
                        break
                    time.sleep(POLL_S)  # another process's trials: their results are part of this search
                    continue
                finished, _ = wait(list(inflight), timeout=POLL_S * 5, return_when=FIRST_COMPLETED)
                for f in finished:
                    trial = inflight.pop(f)
                    row = f.result()
                    _tell(study, trial, row)
                    stats["done"] += 1
                    stats["failed"] += row["state"] != "complete"
                    stats["bytes"] += row.get("expert_bytes_read") or 0
                    rep.advance("trials", 1)
                    rep.note(_progress_line(s, row, stats))
    finally:
        rep.finish("trials")


def _recorded_row(s: Search, number: int) -> dict | None:
    """A trial's row, when it was recorded (its process died before telling the study)."""
    return next((r for r in run_task(read_trials, s.catalog, s.name) if r["trial"] == number and not r["final"]), None)


def _may_ask(study: Any, total: int) -> bool:
    """Whether a trial is there to run: one queued again, or fewer asked for than the total."""
    from optuna.trial import TrialState

    counted = studies.counted(study)
    return any(t.state == TrialState.WAITING for t in counted) or len(counted) < total


def _tell(study: Any, trial: Any, row: dict) -> None:
    from optuna.trial import TrialState

    for key in ("expert_bytes_read", "budget_bytes", "error_bound", "merge_seconds", "eval_seconds"):
        if row.get(key) is not None:
            trial.set_user_attr(key, row[key])
    if row["state"] != "complete":
        trial.set_user_attr("error", (row.get("error") or "")[-2000:])
    try:
        if row["state"] == "complete":
            study.tell(trial, row["score"])
        else:
            study.tell(trial, state=TrialState.FAIL)
    except RuntimeError as err:
        # The grid sampler stops an optimize loop once its grid is done; there is none here
        # (the total was capped at the grid's size), and the trial's result is stored first.
        if "Study.stop" not in str(err):
            raise


def _progress_line(s: Search, row: dict, stats: dict) -> str:
    best = _best(s.study)
    what = f"score {row['score']:.6g}" if row["state"] == "complete" else f"failed ({row.get('error', '')[:200]})"
    return (
        f"trial {row['trial']}: {what}; {stats['done']} done here, {stats['failed']} failed; best so far "
        f"{'–' if best is None else f'{best.value:.6g} (trial {best.number})'}; "
        f"{stats['bytes'] / 2**20:,.1f} MiB of expert bytes read"
    )


def _best(study: Any) -> Any:
    try:
        return study.best_trial
    except ValueError:  # no trial completed yet
        return None


# Final merges, the published output -------------------------------------------------------------


def _finish(s: Search, overwrite: bool, rep, submit: Submit) -> dict:
    """Merge the top_k trials again at the final budget, evaluate them, and publish the best to
    `out`; one process does it while others wait (the lease beside the output's), and those
    find it done."""
    lease = OutputLease(f"{s.out}.search", Holder(f"{studies.this_process()}:search", None, time.time()), 600.0)
    while True:
        try:
            lease.acquire()
            break
        except OutputBusy:
            time.sleep(POLL_S)
    try:
        with beating(lease.beat, 60.0, "search-lease"):
            return _finals(s, overwrite, rep, submit)
    finally:
        lease.release()


def _finals(s: Search, overwrite: bool, rep, submit: Submit) -> dict:
    settings = s.spec.settings
    rows = run_task(read_trials, s.catalog, s.name)
    trials = [r for r in rows if not r["final"]]
    complete = [r for r in trials if r["state"] == "complete"]
    if not complete:
        first = next((r["error"] for r in trials if r.get("error")), "no trial ran")
        raise MergepipeError(f"search {s.name}: no trial completed; the first error: {first}")
    sign = -1 if settings.direction == "maximize" else 1
    order = lambda r: (sign * r["score"], r["trial"])  # best first; ties to the earlier trial
    top = sorted(complete, key=order)[: settings.top_k]
    finals = {r["trial"]: r for r in rows if r["final"]}
    rep.start("final", len(top), "merges")
    try:
        rep.advance("final", sum(r["trial"] in finals for r in top))
        todo = [r for r in top if r["trial"] not in finals]
        if _same_budget(settings.budget, settings.final_budget):
            for r in todo:  # the trial's own merge was at the final budget: the same bytes, the same score
                finals[r["trial"]] = {**r, "final": True, "finished_at": _now()}
                run_task(record_trial, s.catalog, finals[r["trial"]])
                rep.advance("final", 1)
        else:  # `parallel` at a time, as the trials ran
            running = {
                submit(r["trial"], s.study.trials[r["trial"]].params, settings.final_budget, True): r["trial"]
                for r in todo
            }
            for f in as_completed(running):
                finals[running[f]] = f.result()
                rep.advance("final", 1)
    finally:
        rep.finish("final")
    ok = [finals[r["trial"]] for r in top if finals[r["trial"]]["state"] == "complete"]
    if not ok:
        raise MergepipeError(
            f"search {s.name}: every final merge failed; the first: {finals[top[0]['trial']]['error']}"
        )
    best = min(ok, key=order)
    budgeted = next(r for r in trials if r["trial"] == best["trial"])
    record = {
        "search": {
            "study": s.name,
            "config": s.spec.location,
            "trial": best["trial"],
            "params": json.loads(best["params_json"]),
            "budget": settings.budget,
            "final_budget": settings.final_budget,
            "score": budgeted["score"],
            "final_score": best["score"],
            "direction": settings.direction,
            "trials": len(trials),
        }
    }
    published = verified_digest(s.out)
    if published is not None and _searched_by(s.out) == s.name and published == best["merge_digest"]:
        merged = {"digest": published, "out": s.out, "manifest": join(s.out, "manifest.json")}
    else:
        rep.note(f"publishing trial {best['trial']} (final score {best['score']:.6g}) to {s.out}")
        merged = _merge_candidate(
            s,
            s.spec.candidate(s.spec.values_at(s.study.trials[best["trial"]].params)),
            settings.final_budget,
            s.out,
            s.scratch / "published.yml",
            overwrite=overwrite or (published is not None and _searched_by(s.out) == s.name),
            model_card=True,
            memory=f"{s.memory}B",
            record=record,
        )
    rows = run_task(read_trials, s.catalog, s.name)
    return {
        "search": s.name,
        "study_storage": studies.journal_of(s.catalog),
        "out": s.out,
        "digest": merged["digest"],
        "manifest": merged["manifest"],
        "best": record["search"],
        "base_score": s.study.user_attrs.get(BASE_SCORE),
        "direction": settings.direction,
        "sampler": settings.sampler,
        "budget": settings.budget,
        "final_budget": settings.final_budget,
        "top_k": settings.top_k,
        "trials": [_plain(r) for r in rows if not r["final"]],
        "finals": [_plain(r) for r in rows if r["final"]],
    }


def _same_budget(a: str, b: str) -> bool:
    x, y = parse_budget(a), parse_budget(b)
    return x == y or (x.is_full and y.is_full)


def _plain(row: dict) -> dict:
    out = dict(row)
    out["params"] = json.loads(out.pop("params_json"))
    out["metrics"] = json.loads(out.pop("metrics_json") or "{}")
    out.pop("config_yaml", None)
    out["finished_at"] = out["finished_at"].isoformat() if out.get("finished_at") else None
    return out
