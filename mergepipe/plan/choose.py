"""Choosing the access set: rank every (expert, block) pair in the catalog's SQL, take what the
budget (or the error target) allows, and assemble the plan; the plan is recorded in the catalog."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from mergepipe.catalog import calibration, planner, records
from mergepipe.config.spec import MergeSpec
from mergepipe.errors import BadInput, MergepipeError
from mergepipe.index.blocks import block_rows, row_elems
from mergepipe.index.family import Family
from mergepipe.index.stats import nonfinite_message
from mergepipe.operators import get_operator
from mergepipe.plan.params import resolve_tensor_params
from mergepipe.plan.ranking import choose_calibration
from mergepipe.plan.record import (
    ACCESS_SCHEMA,
    Plan,
    all_rows,
    build_plan,
    error_bound,
    full_expert_bytes,
    whole_factor_bytes,
    whole_factors_read,
)
from mergepipe.storage.safetensors_format import DTYPES

# Tensors of at least this many stored bytes (per expert) carry bounds on their deltas' nonzero
# counts in the plan: those an operator may merge a window at a time, where the bound can spare
# TIES a pass over the windows (a threshold of 0 needs no search).
NONZERO_BOUND_BYTES = 32 << 20


def check_nonfinite(
    spec: MergeSpec, family: Family, budget_bytes: int, first, n: int, omitted: int, nbytes: int
) -> None:
    """Blocks whose delta is NaN or Inf: refused unless allow_nonfinite, and then never left
    out (the error of omitting one has no bound)."""
    if first is None:
        return
    expert, tensor, block = first
    if not spec.allow_nonfinite:
        raise BadInput(nonfinite_message(expert, family.experts[expert].uri, tensor, block))
    if omitted:
        raise BadInput(
            f"budget: {budget_bytes} bytes leave out {omitted} of the {n} blocks whose delta is NaN or Inf "
            f"(first: expert {expert}, tensor {tensor!r} block {block}); with allow_nonfinite every one is read, "
            f"which takes at least {nbytes} bytes"
        )


def empty_plan_problem(spec: MergeSpec, budget_bytes: int, smallest: int | None, n_candidates: int) -> str | None:
    """What is wrong with a byte budget that admits no expert block while some are worth
    reading (the merge would publish the base): None when it admits one, or allow_empty."""
    if spec.allow_empty or spec.max_error is not None or smallest is None:
        return None
    return (
        f"budget: {spec.budget_label} ({budget_bytes} bytes) admits no expert block (the smallest of the "
        f"{n_candidates} blocks worth reading takes {smallest} bytes), so the merge would only copy the base; "
        "raise the budget, or pass --allow-empty (allow_empty: true) to merge anyway"
    )


def ranking_of(spec: MergeSpec, family: Family, con) -> dict:
    """How the plan ranks pairs: the spec's rank_by, and for `activation` the calibration it
    uses (its digest, data and texts)."""
    if spec.rank_by != "activation":
        return {"rank_by": spec.rank_by}
    chosen = choose_calibration(calibration.calibrations_of(con, family.base_fp), spec.calibration, family.base.uri)
    return {
        "rank_by": spec.rank_by,
        "calibration": chosen.data_digest,
        "calibration_data": chosen.data_uri,
        "calibration_tokens": chosen.tokens,
        "calibration_gradients": chosen.gradients,
    }


def _rank_candidates(con, spec: MergeSpec, family: Family, op, table, per_set: list[list[float]], ranking: dict) -> int:
    """planner.rank_candidates with each tensor's coefficients (per_set: each parameter set's)."""
    coefficients = {name: per_set[table.by_tensor.get(name, 0)] for name in family.base.tensors}
    return planner.rank_candidates(
        con,
        family.base_fp,
        spec.block_size_bytes,
        family.expert_fps(),
        coefficients,
        skip_zero=op.zero_coefficient_unused,
        rank_by=spec.rank_by,
        calibration=ranking.get("calibration", ""),
        energy_share=op.ranks_by_energy_share,
    )


def choose_plan(
    spec: MergeSpec,
    family: Family,
    content: dict[str, str],
    con,
    *,
    refuse_empty: bool = True,
) -> tuple[Plan, list[dict], list[str]]:
    """The plan, its explain rows (per layer and expert: bytes selected, energy captured) and its
    warnings, chosen and recorded over the catalog connection `con`. A byte budget that admits no
    expert block is refused (refuse_empty, as a merge does) or only warned about (as `plan`
    does), unless the spec allows it."""
    op = get_operator(spec.merge_method)
    table = resolve_tensor_params(spec, family.base.tensors)
    per_set = [op.coefficients(p) for p in table.sets]
    expert_fps = family.expert_fps()
    full = full_expert_bytes(family)
    ranking = ranking_of(spec, family, con)
    n = _rank_candidates(con, spec, family, op, table, per_set, ranking)
    # Views read some bytes once per tensor besides the pairs' (a LoRA factor whole, the rows
    # a padded vocabulary's mean row is made from): the budget keeps room for all of them
    # before it is spent on pairs.
    reserve = sum(whole_factor_bytes(e, all_rows(e)) for e in family.experts if e.virtual)
    if spec.max_error is not None:
        budget_bytes = planner.select_within_error(con, spec.max_error, n)
    else:
        budget_bytes = spec.io_budget.resolve(full)
        planner.select_within_bytes(con, max(0, budget_bytes - reserve))
    check_nonfinite(spec, family, budget_bytes, *planner.nonfinite_candidates(con))
    access = planner.selected_pairs(con)
    if spec.max_error is not None:
        budget_bytes += sum(whole_factors_read(family, access))
    warnings = []
    problem = (
        empty_plan_problem(spec, budget_bytes, planner.smallest_candidate(con), n) if not access.num_rows else None
    )
    if problem and refuse_empty:
        raise BadInput(problem)
    if problem:
        warnings.append(problem)
    plan = build_plan(
        spec,
        family,
        content,
        access,
        budget_bytes=budget_bytes,
        bound=error_bound(planner.omitted_pairs(con)),
        params=table,
        nonzero_bounds=planner.nonzero_bounds(
            con, family.base_fp, spec.block_size_bytes, expert_fps, NONZERO_BOUND_BYTES
        )
        if op.windowed
        else {},
        ranking=ranking
        if "calibration" not in ranking
        else {**ranking, "omitted_output_energy": planner.omitted_output_energy(con)},
    )
    # Budget soundness is a property of the plan, checked before any expert byte is read.
    if plan.expert_bytes_planned > budget_bytes:
        raise MergepipeError(
            f"planner bug: {plan.expert_bytes_planned} planned bytes exceed the budget of {budget_bytes}"
        )
    records.save_plan(
        con,
        {
            "plan_digest": plan.plan_digest,
            "base_fp": family.base_fp,
            "block_size": plan.block_size,
            "merge_method": spec.merge_method,
            "budget": spec.budget_label,
            "budget_bytes": budget_bytes,
            "full_expert_bytes": full,
            "planned_bytes": plan.expert_bytes_planned,
            "error_bound": plan.error_bound,
            "bound_guaranteed": plan.bound_guaranteed,
            "n_pairs": plan.n_pairs,
        },
        [
            # The largest |c_k| over tensors: filters and gradients may vary it per tensor.
            {
                "plan_digest": plan.plan_digest,
                "expert": i,
                "expert_fp": fp,
                "coefficient": max((abs(c[i]) for c in per_set), default=0.0),
                "planned_bytes": plan.planned_bytes[i],
            }
            for i, fp in enumerate(expert_fps)
        ],
        access.select(["expert", "tensor", "block", "bytes", "score"]),
    )
    explain = records.explain(con, plan.plan_digest, family.base_fp, plan.block_size)
    return plan, explain, warnings


def reads_every_block(spec: MergeSpec, family: Family) -> bool:
    """Whether this spec's plan reads every block whose delta is not zero, whatever the
    statistics: a byte budget of every expert byte, and no coefficient that leaves a pair
    unread. Then a family not yet indexed can be indexed by its first merge (full_read_plan)."""
    full = full_expert_bytes(family)
    if spec.max_error is not None or spec.io_budget.resolve(full) < full:
        return False
    if family.base.virtual or any(e.virtual for e in family.experts):
        return False  # indexed first: a made tensor's blocks cost what they are made from
    op = get_operator(spec.merge_method)
    if not op.zero_coefficient_unused:
        return True
    table = resolve_tensor_params(spec, family.base.tensors)
    return all(c != 0 for p in table.sets for c in op.coefficients(p))


def full_read_plan(spec: MergeSpec, family: Family, content: dict[str, str], con, unindexed: list[int]) -> Plan:
    """The plan of a first merge that indexes the experts at positions `unindexed` (and any
    position listing the same files) on the way: every block of theirs, and what the full
    budget selects of the indexed experts'. It is executed, never published: once the
    statistics it gathered are in the catalog, choose_plan gives the plan the merge is
    recorded under, which is this one less the blocks found unchanged (flows.common).
    Content digests not known yet (theirs, the base's) are named by fingerprint."""
    op = get_operator(spec.merge_method)
    table = resolve_tensor_params(spec, family.base.tensors)
    expert_fps = family.expert_fps()
    full = full_expert_bytes(family)
    # Every pair is read, so the ranking is moot: no calibration is looked for.
    _rank_candidates(con, spec, family, op, table, [op.coefficients(p) for p in table.sets], {})
    planner.select_within_bytes(con, full)
    known = planner.selected_pairs(con).select(ACCESS_SCHEMA.names).cast(ACCESS_SCHEMA)
    new = {fp for i, fp in enumerate(expert_fps) if i in unindexed}
    # Every nonempty block of every float tensor, once; then each new expert's rows of them.
    names, numbers, starts, ends, widths = [], [], [], [], []
    for name in sorted(family.base.tensors):
        info = family.base.tensors[name]
        if not DTYPES[info.dtype].is_float:
            continue
        width = row_elems(info.shape)
        for b, (r0, r1) in enumerate(block_rows(info.shape, DTYPES[info.dtype].itemsize, spec.block_size_bytes)):
            if r1 > r0:
                names.append(name)
                numbers.append(b)
                starts.append(r0)
                ends.append(r1)
                widths.append(width)
    rows = np.asarray(ends, dtype=np.int64) - np.asarray(starts, dtype=np.int64)
    rows *= np.asarray(widths, dtype=np.int64)
    parts = [known]
    for i, fp in enumerate(expert_fps):
        if fp in new:
            tensors = family.experts[i].tensors
            itemsize = np.fromiter((DTYPES[tensors[n].dtype].itemsize for n in names), np.int64, len(names))
            columns = [np.full(len(names), i, dtype=np.int32), names, numbers, starts, ends, rows * itemsize]
            parts.append(pa.table(dict(zip(ACCESS_SCHEMA.names, columns)), schema=ACCESS_SCHEMA))
    access = pa.concat_tables(parts)
    pending = {fp: f"unindexed:{fp}" for fp in [family.base_fp, *new] if fp not in content}
    return build_plan(spec, family, {**content, **pending}, access, budget_bytes=full, bound=0.0, params=table)
