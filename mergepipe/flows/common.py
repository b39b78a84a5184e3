"""Steps shared by the flows: index a family, execute a saved plan and publish it."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone

from mergepipe import torch
from mergepipe.catalog.calibration import CalibrationRow
from mergepipe.config.environment import CatalogLocation, worker_count
from mergepipe.config.request import MergeRequest
from mergepipe.config.spec import MergeSpec, expert_label
from mergepipe.config.views import input_views
from mergepipe.errors import BadInput, DeterminedError
from mergepipe.execute.group import GroupResult, finished_group
from mergepipe.execute.memory import MemoryPlan, output_buffer, plan_memory
from mergepipe.flows.artifacts import summary_artifact
from mergepipe.flows.executor import run_groups
from mergepipe.flows.orchestration import in_process, run_task
from mergepipe.flows.runners import describe
from mergepipe.index.family import Family
from mergepipe.index.first_merge import check_recorded_plan, count_unchanged_as_index, tap_stats
from mergepipe.index.stats import StatsResult, first_nonfinite
from mergepipe.plan import saved
from mergepipe.plan.choose import reads_every_block
from mergepipe.plan.params import resolve_tensor_params
from mergepipe.plan.ranking import choose_calibration
from mergepipe.plan.record import Plan
from mergepipe.publish.manifest import MANIFEST_FILE, load_manifest, versions
from mergepipe.storage.hub import commit_roots
from mergepipe.storage.ledger import ByteLedger, request_counts
from mergepipe.storage.location import join
from mergepipe.storage.staging import staging_at
from mergepipe.tasks import progress
from mergepipe.tasks.calibrate import ingest_activation_stats, load_calibration
from mergepipe.tasks.declare import freeze_long_lived
from mergepipe.tasks.index import (
    claiming,
    compute_block_stats,
    ingest_block_stats,
    look_up_family,
    read_family_headers,
    wait_for_others,
)
from mergepipe.tasks.merge import finish_output, publish_output, record_run, stage_output
from mergepipe.tasks.plan import plan_merge

log = logging.getLogger("mergepipe.flows")


@contextmanager
def torch_threads_per_worker(workers: int) -> Iterator[None]:
    """Give each of `workers` concurrent merge tasks in this process its share of the cores for
    torch's own threads: with every task at the full count, tasks on a small machine spend their
    time handing work over (docs/benchmarks.md). Results do not depend on it (the operators'
    reductions are fixed whatever the thread count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // max(1, workers)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def now() -> str:
    return datetime.now(timezone.utc).isoformat()


@dataclass
class IndexOutcome:
    family: Family
    content: dict[str, str]
    indexed: list[int]  # expert positions indexed in this run
    ledger: ByteLedger = field(default_factory=ByteLedger)
    seconds: float = 0.0
    # The experts at `indexed` are left for the merge to index on the way (run_index's first_merge),
    # claimed for it in a shared catalog until `held` is closed (after their statistics land).
    deferred: bool = False
    held: ExitStack = field(default_factory=ExitStack)


def run_index(
    spec: MergeSpec, catalog: CatalogLocation, *, first_merge: bool = False, planned: bool = True
) -> IndexOutcome:
    """Read the headers and index the experts the catalog lacks. With first_merge (a merge),
    experts not yet indexed are left to the merge when its plan reads every block anyway
    (plan.choose.reads_every_block): it indexes them from the bytes it reads, so no expert byte
    is read twice. Their claims are then held (the outcome's `held`, which the caller closes)
    until the merge has recorded their statistics. `planned`: whether a plan is chosen next (a
    replay's comes from its manifest, so it needs no calibration to rank by)."""
    t0 = time.perf_counter()
    ledger = ByteLedger()
    family, rows = run_task(read_family_headers, input_views(spec))
    freeze_long_lived()
    ledger.merge(rows)
    # Parameters that depend on tensor names (filters, gradients) are checked now, before any
    # statistics pass, so a config that cannot merge fails fast.
    resolve_tensor_params(spec, family.base.tensors)
    bs = spec.block_size_bytes
    known, content, energies, calibrations = run_task(look_up_family, family, bs, catalog)
    calibrated = _calibration(spec, family, calibrations, planned)  # rank_by: activation without one stops here
    loaded: list = []

    def calibration_weights() -> tuple[dict | None, set[str]]:
        """The calibration's weights and the experts weighed by it already (read once, when needed)."""
        if not loaded:
            found = run_task(load_calibration, catalog, family, bs, calibrated.data_digest) if calibrated else None
            loaded.append(found or (None, set()))
        return loaded[0]

    # An expert needs its pass unless its statistics and content digest are both known; each
    # distinct file set is read once even if the config lists it twice.
    missing, seen = [], set()
    for i, fp in enumerate(family.expert_fps()):
        if (fp not in known or fp not in content) and fp not in seen:
            missing.append(i)
            seen.add(fp)
    if (missing or family.base_fp not in content) and first_merge and reads_every_block(spec, family):
        held = ExitStack()
        _, others = held.enter_context(claiming(catalog, family, missing, bs))
        if not others:
            return IndexOutcome(family, content, missing, ledger, time.perf_counter() - t0, deferred=True, held=held)
        held.close()  # another client is indexing some of them: wait for it, and index the rest first

    indexed: list[int] = []

    def index_pass(positions: list[int]) -> None:
        nonlocal content, energies
        # With a calibration of the base, the pass weighs each delta block by it too.
        weights, with_activation = calibration_weights() if positions else (None, set())
        result = _block_stats(family, positions, bs, ledger, weights)
        problem = None if spec.allow_nonfinite else first_nonfinite(result, family)
        if problem:  # refused before ingestion: bad input leaves the catalog as it was
            raise BadInput(problem)
        run_task(ingest_block_stats, family, positions, bs, result, catalog)
        if result.activation is not None:
            run_task(ingest_activation_stats, catalog, family, positions, bs, calibrated.data_digest, result.activation)
            with_activation.update(family.expert_fps()[i] for i in positions)
        content = {**content, **result.content}
        energies = True  # a pass records the base's block energies too
        indexed.extend(positions)

    # Each missing expert is claimed first: one that another client is indexing now is waited
    # for and its statistics read from the catalog; one whose client died is indexed here.
    todo, waited = missing, False
    while todo:
        with claiming(catalog, family, todo, bs) as (mine, others):
            if mine:
                index_pass(mine)
        todo = wait_for_others(catalog, family, others, bs) if others else []
        waited = waited or bool(others)
    if waited:
        known, content, energies, _ = run_task(look_up_family, family, bs, catalog)
        fps = family.expert_fps()
        unknown = [i for i in missing if fps[i] not in known or fps[i] not in content]
        if unknown:  # indexed by a client that recorded less than this one needs
            index_pass(unknown)
    # A catalog from before schema 3 lacks the base's block energies: a plan ranked on them
    # reads the base once more (and no expert) to fill them in.
    if family.base_fp not in content or (spec.rank_by_needs_base and not energies):
        index_pass([])
    if planned and spec.rank_by == "activation":
        _weigh_indexed(family, calibrated, *calibration_weights(), bs, catalog, ledger)
    return IndexOutcome(family, content, indexed, ledger, time.perf_counter() - t0)


def _calibration(spec: MergeSpec, family: Family, rows: list[CalibrationRow], planned: bool) -> CalibrationRow | None:
    """The calibration the index pass weighs deltas by: the one the spec's ranking uses (none
    there: BadInput naming the command to run), else the base's newest, if any."""
    if planned and spec.rank_by == "activation":
        return choose_calibration(rows, spec.calibration, family.base.uri)
    return rows[0] if rows else None


def _weigh_indexed(
    family: Family,
    calibrated: CalibrationRow,
    weights: dict,
    done: set[str],
    block_size: int,
    catalog: CatalogLocation,
    ledger: ByteLedger,
) -> None:
    """Experts indexed before the calibration lack their activation energies under it: one more
    statistics pass over them (and the base), which reads them whole once; later plans of this
    base and calibration need none."""
    fps, seen, todo = family.expert_fps(), set(), []
    for i, fp in enumerate(fps):
        if fp not in done and fp not in seen:
            todo.append(i)
            seen.add(fp)
    if not todo:
        return
    log.info("weighing %d expert(s) by the calibration %s: one more pass over them", len(todo), calibrated.data_uri)
    result = _block_stats(family, todo, block_size, ledger, weights)
    run_task(ingest_activation_stats, catalog, family, todo, block_size, calibrated.data_digest, result.activation)
    done.update(fps[i] for i in todo)


def _block_stats(
    family: Family, positions: list[int], block_size: int, ledger: ByteLedger, weights: dict | None = None
) -> StatsResult:
    """The statistics pass over these experts (and the base), its reads counted in `ledger`."""
    result, rows = run_task(compute_block_stats, family, positions, block_size, weights)
    ledger.merge(rows)
    return result


def flow_run_id() -> str | None:
    """The Prefect flow run's id; None in process (without importing Prefect)."""
    if in_process():
        return None
    try:
        from prefect.runtime import flow_run

        return str(flow_run.id) if flow_run.id else None
    except Exception:
        return None


@dataclass
class FirstMerge:
    """A first merge that indexes experts on the way: the family, the positions it indexes and
    the content digests known before it."""

    family: Family
    positions: list[int]
    content: dict[str, str]


@dataclass
class Execution:
    """One execution of a saved plan: the request it serves, the plan and where it is saved,
    what ran before it (the index ledger, timings so far), for a replay the digest it must
    reproduce, and for a first merge what it indexes on the way (its plan is then
    plan.choose.full_read_plan, and the merge is recorded under the plan chosen afterwards)."""

    request: MergeRequest
    plan: Plan
    saved_plan: saved.PlanRef  # where the plan is saved, for the tasks
    kind: str  # "merge" or "replay"
    index_ledger: ByteLedger
    timings: dict
    started_at: str
    t0: float
    expected_digest: str | None = None
    first: FirstMerge | None = None
    memory: MemoryPlan | None = None  # made by the flow where it decided on it; else by execute_plan


class _GroupResults:
    """What the layer groups read, wrote and resumed, and who wrote them, as they finish."""

    def __init__(self, rep) -> None:
        self.ledger = ByteLedger()  # what this run read and wrote
        self.resumed = ByteLedger()  # what the runs before it read for the groups it found finished
        self.resumed_groups: list[str] = []
        self.workers: dict[str, str] = {}  # layer group -> host:pid of the process that wrote it
        self.kernels: set[str] = set()  # the CPU kernel sets the groups were merged under
        self.index: list[tuple[dict, bool]] = []  # what the groups of a first merge indexed, resumed or not
        self.rep = rep

    def add(self, group: str, result: GroupResult) -> None:
        rows, resumed = result.rows, result.resumed
        self.workers[group] = result.worker
        if result.kernels:
            self.kernels.add(result.kernels)
        if result.index is not None:
            self.index.append((result.index, resumed))
        if resumed:
            self.resumed.merge(rows)
            self.resumed_groups.append(group)
        else:
            self.ledger.merge(rows)
        self.rep.advance("merge", 1)
        self.rep.advance("read", sum(r["bytes"] for r in rows if r["role"] in ("base", "expert")))


def _merge_groups(ex: Execution, staging: str, results: _GroupResults, memory: MemoryPlan) -> None:
    """Every layer group as its own task; a group an earlier run of this plan finished (a crash
    left its staging folder) is taken over while its mark and staged bytes are intact."""
    _, layout = saved.load(ex.saved_plan)
    rep = results.rep
    groups = list(layout.groups)
    rep.start("merge", len(groups), "groups")
    rep.start("read", ex.plan.base_tensor_bytes + ex.plan.expert_bytes_planned, "B")
    try:
        todo, where = [], staging_at(staging)
        for g in groups:
            done = finished_group(layout, g, where)
            if done is not None:
                results.add(g, done)
            else:
                todo.append(g)
        if results.resumed_groups:
            rep.note(
                f"resuming: {len(results.resumed_groups)} of {len(groups)} layer groups taken over from an earlier "
                f"run of this plan ({', '.join(results.resumed_groups)})"
            )
        params = [
            {
                "saved_plan": ex.saved_plan,
                "group": g,
                "staging": staging,
                "options_from": ex.request.options_from,
                "memory": memory,
                "index": ex.first.positions if ex.first else None,
            }
            for g in todo
        ]
        with (
            torch_threads_per_worker(memory.workers),
            run_groups(params, ex.request.runner, memory.workers) as finished,
        ):
            for group, result in finished:
                results.add(group, result)
    finally:
        rep.finish("read")
        rep.finish("merge")


def index_from_merge(ex: Execution, results: _GroupResults) -> dict:
    """A first merge's statistics (what its groups' taps measured) into the catalog; then the
    plan the merge is recorded under, put in `ex`: the one a merge of the indexed family chooses
    (index.first_merge.check_recorded_plan), whose expert bytes the merge read once the blocks
    found unchanged count as index reads. Returns the run's `indexed_in_merge` record."""
    first, spec, executed = ex.first, ex.request.spec, ex.plan
    result = tap_stats([part for part, _ in results.index], first.family, first.positions)
    problem = None if spec.allow_nonfinite else first_nonfinite(result, first.family)
    if problem:  # refused before ingestion, as the statistics pass refuses it
        raise BadInput(problem)
    run_task(ingest_block_stats, first.family, first.positions, spec.block_size_bytes, result, ex.request.catalog)
    ex.plan, _, ex.saved_plan, _ = run_task(
        plan_merge, spec, first.family, {**first.content, **result.content}, ex.request.catalog
    )
    check_recorded_plan(executed.access, ex.plan.access, result.stats, first.family.expert_fps())
    unchanged = sum(
        count_unchanged_as_index(part["stats"], executed.inputs, results.resumed if resumed else results.ledger)
        for part, resumed in results.index
    )
    read = results.ledger.total("expert") + results.resumed.total("expert")
    if read != ex.plan.expert_bytes_planned:
        raise DeterminedError(
            f"the merge read {read} bytes of changed blocks but the plan chosen after indexing has "
            f"{ex.plan.expert_bytes_planned}; not publishing"
        )
    return {
        "experts": [expert_label(i) for i in first.positions],
        "expert_bytes_executed": executed.expert_bytes_planned,
        "unchanged_bytes_read": unchanged,
        "index_bytes": results.ledger.total("index") + results.resumed.total("index"),
    }


def execute_plan(ex: Execution) -> dict:
    """Stage, merge every layer group, hash, write the manifest, publish, record the run.

    The execution ledger is kept apart from the index ledger (headers, and an index pass run
    before it) so realized bytes compare one to one with planned bytes; a first merge's reads
    for the index alone count as `index` in the execution ledger."""
    plan, request, out = ex.plan, ex.request, ex.request.out
    # Refused before anything is staged or read when even one group at a time cannot fit. Made
    # once per merge, and passed down to every group unchanged.
    memory = ex.memory or plan_memory(
        plan,
        saved.load(ex.saved_plan)[1],
        request.memory,
        worker_count(),
        request.memory_given,
        ex.first is not None,
        output_buffer(out),
    )
    if memory.warning:
        log.warning(memory.warning)
    freeze_long_lived()  # the plan and its layout
    staging = run_task(stage_output, ex.saved_plan, out)
    results = _GroupResults(progress.reporter())
    ledger, resumed = results.ledger, results.resumed
    runner = describe(request.runner, memory.workers)
    try:
        t_merge = time.perf_counter()
        _merge_groups(ex, staging, results, memory)
        ex.timings["merge"] = time.perf_counter() - t_merge
        expert_read = ledger.total("expert")
        if expert_read + resumed.total("expert") != plan.expert_bytes_planned:
            raise DeterminedError(
                f"read {expert_read} expert bytes (and {resumed.total('expert')} in resumed groups) "
                f"but the plan has {plan.expert_bytes_planned}; not publishing"
            )
        if ex.first is not None:
            t_index = time.perf_counter()
            indexed = index_from_merge(ex, results)
            plan, expert_read = ex.plan, ledger.total("expert")
            ex.timings["index_in_merge"] = time.perf_counter() - t_index
        t_finish = time.perf_counter()
        output, outside, rows = run_task(finish_output, ex.saved_plan, staging)
        ledger.merge(rows)
        ex.timings["finish"] = time.perf_counter() - t_finish
        run = {
            "kind": ex.kind,
            "started_at": ex.started_at,
            "finished_at": now(),
            "wall_seconds": time.perf_counter() - ex.t0,
            "flow_run_id": flow_run_id(),
            "versions": versions(),
            # for the record: the bytes are the same under every kernel set (operators/kernels.py)
            "cpu_kernels": sorted(results.kernels),
            # the Hub commits read (replay reads the same ones or refuses), and where each input's
            # files were read
            "commits": commit_roots([i.root for i in plan.inputs] + [f for i in plan.inputs for f in i.files]),
            "inputs": [
                {"role": i.role, "uri": i.uri, "root": i.root, "files": i.files, "model_fp": i.model_fp}
                for i in plan.inputs
            ],
            "spec": plan.spec,
            "bytes": ledger.by_role(),
            "requests": request_counts(ledger, ex.index_ledger),
            "ledger": ledger.rows(),
            "index_bytes": ex.index_ledger.by_role(),
            "expert_bytes_planned": plan.expert_bytes_planned,
            "expert_bytes_read": expert_read,
            "resumed": {"groups": sorted(results.resumed_groups), "bytes": resumed.by_role()},
            "runner": runner,
            "workers": dict(sorted(results.workers.items())),
            "timings": ex.timings,
            "memory": memory.as_json(),
            # outside the digest: the card names where the inputs were read; a built tokenizer's
            # files depend on the transformers version that saved them
            **outside,
        }
        if request.stage_inputs:  # the earlier stages of a multi-document config this one read
            run["stages"] = [
                {"stage": name, "manifest": join(where, MANIFEST_FILE), "digest": load_manifest(where)["digest"]}
                for name, where in request.stage_inputs
            ]
        if ex.first is not None:
            run["indexed_in_merge"] = indexed
        for key, value in (request.record or {}).items():
            run.setdefault(key, value)
        manifest, rows = run_task(
            publish_output, ex.saved_plan, staging, out, request.overwrite, output, run, ex.expected_digest
        )
        ledger.merge(rows)
    except (BadInput, DeterminedError):  # running it again would fail the same way
        staging_at(staging).discard()
        raise
    except BaseException as err:
        # A crash (SystemExit, KeyboardInterrupt, a lost worker) or an error that outlasted its
        # retries: the finished groups stay staged, and the same merge run again resumes them.
        log.warning(
            "merge stopped (%s); its staging %s is kept for a run of the same merge", type(err).__name__, staging
        )
        raise
    run_task(
        record_run,
        request.catalog,
        {
            "run_id": flow_run_id() or f"{plan.plan_digest[:12]}-{ex.started_at}",
            "kind": ex.kind,
            "plan_digest": plan.plan_digest,
            "merge_digest": manifest["digest"],
            "out_uri": out,
            "started_at": datetime.fromisoformat(ex.started_at),
            "finished_at": datetime.fromisoformat(run["finished_at"]),
            "wall_seconds": run["wall_seconds"],
            "expert_bytes_planned": plan.expert_bytes_planned,
            "expert_bytes_read": expert_read,
            "base_bytes_read": ledger.total("base"),
            "header_bytes_read": ex.index_ledger.total("header"),
            "output_bytes_written": ledger.total("output"),
            "flow_run_id": flow_run_id(),
        },
        json.dumps(manifest, sort_keys=True),
    )
    result = {
        "kind": ex.kind,
        "digest": manifest["digest"],
        "plan_digest": plan.plan_digest,
        "plan_key": ex.saved_plan.key,
        "out": out,
        "manifest": join(out, MANIFEST_FILE),
        "merge_method": plan.merge_method,
        "budget_bytes": plan.budget_bytes,
        "full_expert_bytes": plan.full_expert_bytes,
        "expert_bytes_planned": plan.expert_bytes_planned,
        "expert_bytes_read": expert_read,
        "bytes": ledger.by_role(),
        "index_bytes": ex.index_ledger.by_role(),
        "requests": run["requests"],
        "resumed_groups": sorted(results.resumed_groups),
        "runner": runner,
        "workers": sorted(set(results.workers.values())),
        "cpu_kernels": run["cpu_kernels"],
        "error_bound": plan.error_bound,
        "bound_guaranteed": plan.bound_guaranteed,
        "ranking": plan.ranking,
        "pairs": plan.n_pairs,
        "wall_seconds": time.perf_counter() - ex.t0,
        "timings": ex.timings,
        "memory": memory.as_json(),
        "flow_run_id": flow_run_id(),
    }
    if ex.first is not None:
        result["indexed_in_merge"] = indexed
    summary_artifact(result, request.out_as_given)
    return result
