"""The memory a merge holds, predicted from its plan, and how it is kept under a budget: how
many layer groups run at once, and how each tensor is merged (merge_form: whole, batched with
its neighbours, streamed in runs, or in passes over windows), which the prediction and the
executor both ask.

The prediction counts the buffers the executor and the operators allocate per element of a
tensor merged at once (the stored base and its fp32 form, the operator's fp32 work buffers, the
experts' stored rows, the output), plus a fixed allowance for the process itself. It is an
estimate, checked against measurements in docs/benchmarks.md, not a limit the allocator enforces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from mergepipe.errors import BadInput
from mergepipe.operators import ParamTable, get_operator
from mergepipe.plan.output import OutputLayout
from mergepipe.plan.record import Plan
from mergepipe.storage import remote
from mergepipe.storage.location import is_remote
from mergepipe.storage.safetensors_format import DTYPES

# A base tensor up to this many fp32 bytes is widened whole by the slab forms (execute.whole).
WHOLE_BASE_BYTES = 64 << 20
# Float tensors of at most this many elements are merged by an elementwise operator in batches
# (execute.batched): per tensor, a read, an operator call and a write cost more than the
# arithmetic on a few thousand elements.
BATCH_TENSOR_ELEMENTS = 1 << 18
# The interpreter, torch, DuckDB, Arrow and their pools, before any tensor is held.
PROCESS_BYTES = 768 << 20
# The part of the budget a merge that indexes on the way (index.tap) leaves to the statistics:
# measured beside the layer groups, not counted per element (docs/benchmarks.md, first merges).
INDEXING_SHARE = 0.125
# The most of a group's share that remote ranges fetched ahead of its merge may hold (the rest
# is the merge's): a tight budget keeps tensors whole rather than reading far ahead.
READ_AHEAD_SHARE = 0.25
# The smallest run of elements a streamed tensor is merged in: below it, per-run overheads
# (a read per expert, a write) dominate.
MIN_SLAB_ELEMENTS = 1 << 16


class Form(Enum):
    """How one tensor is merged (merge_form)."""

    WHOLE = "whole"  # read whole, merged in one call (or slab by slab into the stored base)
    BATCHED = "batched"  # read, merged and written with its small neighbours as one run
    STREAMED = "streamed"  # a run of elements at a time, each written where it belongs
    WINDOWED = "windowed"  # a window of rows at a time, in passes over the windows


# How a tensor too large for its share may be cut (TensorNeed.parts).
RUNS, WINDOWS = "runs", "windows"


class TensorNeed(NamedTuple):
    # A tuple: a plan of 100k tensors builds one per tensor.
    name: str
    group: str
    numel: int
    per_element: int  # bytes held per element merged at once
    parts: str = ""  # RUNS or WINDOWS: how the operator may merge it in parts ("": only whole)
    read_per_element: int = 0  # bytes read per element in one pass (the base and every expert)
    passes: int = 1  # passes over its windows when it is merged a window at a time
    batchable: bool = False  # small and elementwise: may be merged with its neighbours

    @property
    def streams(self) -> bool:
        """The operator may merge it a run of elements, or a window of rows, at a time."""
        return bool(self.parts)

    @property
    def whole(self) -> int:
        return self.numel * self.per_element

    @property
    def least(self) -> int:
        """The least this tensor's merge can hold."""
        return min(self.numel, MIN_SLAB_ELEMENTS) * self.per_element if self.streams else self.whole


@dataclass(frozen=True)
class MemoryPlan:
    budget: int
    workers: int  # layer groups merged at once
    per_group: int  # bytes one group's merge may hold
    predicted_peak: int  # the process, with `workers` groups at their largest tensors
    largest: TensorNeed | None  # the tensor that needs the most when merged as it will be
    warning: str | None = None  # the prediction exceeds a budget that was not given explicitly
    reread_max: int = 0  # the most bytes read again by merges in passes over windows
    read_ahead: int = 0  # bytes of remote ranges one group fetches ahead and holds (read_ahead)

    def as_json(self) -> dict:
        return {
            "memory_budget": self.budget,
            "workers": self.workers,
            "per_group_bytes": self.per_group,
            "predicted_peak": self.predicted_peak,
            "largest_tensor": self.largest.name if self.largest else None,
            "warning": self.warning,
            "reread_bytes_max": self.reread_max,
            "read_ahead_bytes": self.read_ahead,
        }


def tensor_need(
    plan: Plan,
    layout: OutputLayout,
    group: str,
    name: str,
    table: ParamTable | None = None,
    kinds: dict | None = None,
) -> TensorNeed:
    """What merging one tensor holds; `table`: the plan's parameters, when the caller has them;
    `kinds`: a dict the caller keeps, where tensors alike (dtypes, shape, parameters) share
    what they need."""
    t = plan.inputs[0].tensors[name]
    table = table or plan.param_table()
    out_dtype = layout.tensors[name].dtype
    key = (t.dtype, t.shape, out_dtype, table.by_tensor.get(name, 0), *[m.tensors[name].dtype for m in plan.inputs[1:]])
    kind = None if kinds is None else kinds.get(key)
    if kind is None:
        kind = _need_of(plan.merge_method, t.dtype, t.shape, key[4:], out_dtype, table.for_tensor(name))
        if kinds is not None:
            kinds[key] = kind
    return TensorNeed(name, group, *kind)


def _need_of(method: str, dtype: str, shape: tuple[int, ...], expert_dtypes, out_dtype: str, params) -> tuple:
    """TensorNeed's fields after name and group, for a tensor of this kind."""
    op = get_operator(method)
    dt = DTYPES[dtype]
    numel = math.prod(shape)
    if not dt.is_float:  # copied as stored
        return numel, dt.itemsize
    # Every form holds the stored base, the experts' stored rows and the output.
    read = dt.itemsize + sum(DTYPES[d].itemsize for d in expert_dtypes)
    per = read + DTYPES[out_dtype].itemsize
    if op.elementwise:  # the fp32 base, an accumulator and one expert's widened rows
        per += 4 * (3 + op.elementwise_temporaries)
    elif op.has_slab_form:  # fp32 only per slab (slabs.py), the fp32 base when it is small
        per += 4 if 4 * numel <= WHOLE_BASE_BYTES else 0
    else:  # whole fp32 tensors: the base, a few work buffers, each expert's values and delta
        per += 4 * (3 + op.work_buffers_per_expert * len(expert_dtypes))
    if op.elementwise:
        return numel, per, RUNS, read, 1, 0 < numel <= BATCH_TENSOR_ELEMENTS
    if op.windows_apply(params, tuple(shape)):
        return numel, per, WINDOWS, read, op.window_passes(params)
    return numel, per, "", read


def tensor_needs(plan: Plan, layout: OutputLayout) -> list[TensorNeed]:
    table, kinds = plan.param_table(), {}
    return [tensor_need(plan, layout, g, name, table, kinds) for g, names in layout.groups.items() for name in names]


def merge_form(need: TensorNeed, per_group: int | None) -> Form:
    """How a tensor is merged when its group may hold per_group bytes (None: no limit): whole,
    or with its neighbours when it is small and elementwise, while it fits; else in the parts
    its operator allows. A tensor that fits in no part is merged whole: plan_memory has refused
    the budget by then, or warned where the budget was the default."""
    if per_group is None or need.whole <= per_group or not need.parts:
        return Form.BATCHED if need.batchable else Form.WHOLE
    return Form.STREAMED if need.parts == RUNS else Form.WINDOWED


def held(need: TensorNeed, per_group: int) -> int:
    """What merging this tensor holds when a group may hold per_group bytes."""
    if merge_form(need, per_group) in (Form.WHOLE, Form.BATCHED):
        return need.whole
    return slab_elements(need, per_group) * need.per_element


def slab_elements(need: TensorNeed, per_group: int) -> int:
    """Elements merged at once for a tensor streamed under per_group bytes."""
    return max(MIN_SLAB_ELEMENTS, per_group // need.per_element)


def window_plan(need: TensorNeed, per_group: int) -> tuple[int, int]:
    """(elements per window, bytes of windows kept between passes) for a tensor merged a window
    of rows at a time under per_group bytes: a quarter of the share for each of the two windows
    alive at once (the one in use, the next being read), the rest for windows kept."""
    window = max(MIN_SLAB_ELEMENTS, per_group // (4 * need.per_element))
    return window, max(0, per_group - 2 * window * need.per_element)


def reread_bytes(need: TensorNeed, per_group: int) -> int:
    """The most a tensor merged a window at a time reads again: every pass after the first
    reads what was not kept (the windows past the kept ones)."""
    if need.passes <= 1 or merge_form(need, per_group) is not Form.WINDOWED:
        return 0
    _, keep = window_plan(need, per_group)
    return (need.passes - 1) * max(0, need.numel * need.read_per_element - keep)


def output_buffer(out: str | None) -> int:
    """What a group holds to write its output besides its tensors: to an object store, a part
    of its upload being filled and one being sent (storage.remote.open_writer); nothing when it
    writes in place to a local file (or when no output is known yet, as for `plan`)."""
    return 2 * remote.write_part_size() if out is not None and is_remote(out) else 0


def read_ahead(plan: Plan) -> int:
    """What a group holds of remote ranges fetched ahead of its merge (storage.reader's
    read_ahead): the configured bound where any input is remote, else nothing."""
    remote_inputs = any(is_remote(m.root) or any(is_remote(f) for f in m.files) for m in plan.inputs)
    return remote.read_ahead_bytes() if remote_inputs else 0


def plan_memory(
    plan: Plan,
    layout: OutputLayout,
    budget: int,
    workers: int,
    given: bool = True,
    indexing: bool = False,
    out_buffer: int = 0,
) -> MemoryPlan:
    """The most groups at once (up to `workers`) whose merges fit the budget together. Where
    even one group cannot fit: BadInput naming the tensor when the budget was given (--memory,
    the config, a deployment parameter), a warning when it is the default (the prediction is
    an estimate, and a merge that fits today is not refused on it). With `indexing` (a first
    merge that indexes on the way) the groups share the budget less INDEXING_SHARE of it.
    `out_buffer`: what each group holds to write its output (output_buffer). A group reading
    remote inputs also holds what it fetches ahead (read_ahead): at most READ_AHEAD_SHARE of its
    share, and never so much that a merge which fits without it would not."""
    usable = budget - int(budget * INDEXING_SHARE) if indexing else budget
    needs = tensor_needs(plan, layout)
    wanted_ahead = read_ahead(plan)
    if not needs:
        return MemoryPlan(budget, 1, budget, PROCESS_BYTES, None, read_ahead=wanted_ahead)
    hardest = max(needs, key=lambda n: n.least)
    warning = None
    if PROCESS_BYTES + out_buffer + hardest.least > usable:
        how = "in windows of rows" if hardest.streams else f"whole ({plan.merge_method} holds the whole tensor)"
        problem = (
            f"memory budget {_gib(budget)} is too small: tensor {hardest.name!r} merged {how} needs "
            f"{_gib(hardest.least)} besides the process's {_gib(PROCESS_BYTES + out_buffer)}"
        )
        if given:
            need = PROCESS_BYTES + out_buffer + hardest.least
            raise BadInput(f"{problem}; give --memory {_gib(need, up=True)} or more")
        warning = f"{problem} (the default budget, half of this machine's memory; the merge goes ahead)"
    workers = max(1, min(workers, len(layout.groups)))
    while True:
        share = (usable - PROCESS_BYTES) // workers - out_buffer
        ahead = max(0, min(wanted_ahead, int(share * READ_AHEAD_SHARE), share - hardest.least))
        per_group = share - ahead
        if workers == 1 or all(n.parts or n.whole <= per_group for n in needs):
            break
        workers -= 1
    by_group: dict[str, int] = {}
    for n in needs:
        by_group[n.group] = max(by_group.get(n.group, 0), held(n, per_group))
    peaks = sorted(by_group.values(), reverse=True)[:workers]
    largest = max(needs, key=lambda n: held(n, per_group))
    reread = sum(reread_bytes(n, per_group) for n in needs)
    peak = PROCESS_BYTES + sum(peaks) + len(peaks) * (out_buffer + ahead) + budget - usable
    return MemoryPlan(budget, workers, max(0, per_group), peak, largest, warning, reread, ahead)


def _gib(n: int, up: bool = False) -> str:
    """A size for a message: MiB below a GiB, else GiB to a tenth (rounded up with `up`)."""
    if n < 2**30:
        return f"{math.ceil(n / 2**20)}MiB" if up else f"{n / 2**20:.1f}MiB"
    gib = math.ceil(n / 2**30 * 10) / 10 if up else n / 2**30
    return f"{gib:.1f}GiB"
