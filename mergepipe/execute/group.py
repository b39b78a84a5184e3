"""Merging one layer group: read the base tensors and only the planned expert blocks, merge
each tensor in the form execute.memory.merge_form gives it (execute.whole, batched, streamed,
windowed), and write the result at its precomputed place in the staged output."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from mergepipe.execute import batched, streamed, whole, windowed
from mergepipe.execute.context import GroupContext, TensorReads
from mergepipe.execute.memory import Form, MemoryPlan
from mergepipe.index.tap import StatsTap, TappedReader
from mergepipe.operators.kernels import kernel_set
from mergepipe.operators.ranges import coalesce
from mergepipe.plan.output import OutputLayout
from mergepipe.plan.record import Plan
from mergepipe.storage.ledger import ByteLedger
from mergepipe.storage.location import ContextPool
from mergepipe.storage.reader import ReadRequest
from mergepipe.storage.safetensors_format import DTYPES
from mergepipe.storage.staging import OutputWriter, Staging

# How many tensors ahead of the merge the kernel is asked to read (the first of them is the
# one being merged). Bounded so that prefetched pages are used before memory pressure could
# evict them.
PREFETCH_TENSORS = 2


@dataclass
class GroupResult:
    """What merging one group gives: the ledger rows of what it read and wrote, the SHA-256 of
    the bytes it wrote (in layout order), the process that wrote them and, for a first merge,
    the statistics its tap measured (index.tap.StatsTap.result), and the CPU kernel set that
    process's torch dispatched to (for the record: the bytes do not depend on it). Its record
    is the group's mark (the staging's mark_done), from which a resumed run takes it over."""

    rows: list[dict]
    sha256: str
    worker: str = ""
    index: dict | None = None
    resumed: bool = field(default=False, compare=False)  # taken over from an earlier run's mark
    # what the staging keeps of the written bytes (an object-store staging: the pieces)
    staged: dict = field(default_factory=dict, compare=False)
    kernels: str = field(default="", compare=False)

    def as_record(self) -> dict:
        record = {
            "rows": self.rows,
            "sha256": self.sha256,
            "worker": self.worker,
            "kernels": self.kernels,
            **self.staged,
        }
        if self.index is not None:
            record["index"] = self.index
        return record

    @classmethod
    def from_record(cls, record: dict, resumed: bool = True) -> "GroupResult":
        rows, sha, worker, index = record["rows"], record["sha256"], record.get("worker", ""), record.get("index")
        staged = {k: v for k, v in record.items() if k not in ("rows", "sha256", "worker", "index", "kernels")}
        return cls(rows, sha, worker, index, resumed, staged, record.get("kernels", ""))


class GroupMerger:
    """Merges the tensors of one group. One instance per task; not shared across threads.

    The group's loop: each tensor's reads, the kernel asked to read ahead, each tensor (or
    batch) merged in its form, and with `index` (expert positions: a new family's first merge,
    whose plan reads every block of theirs) a tap that measures those experts' blocks from the
    bytes the merge reads."""

    def __init__(
        self,
        plan: Plan,
        layout: OutputLayout,
        out: OutputWriter,
        ledger: ByteLedger,
        memory: MemoryPlan | None = None,
        index: list[int] | None = None,
    ) -> None:
        self.g = GroupContext(plan, layout, out, ledger, memory)
        self.index = index  # None: no tap; [] a tap of the base alone (its content digest)
        self.tap: StatsTap | None = None
        self.index_result: dict | None = None

    def run(self, group: str) -> int:
        g = self.g
        names = g.layout.groups[group]
        g.group = group
        if self.index is not None:
            self.tap = StatsTap(g.plan.inputs, [k + 1 for k in self.index], g.plan.block_size, names)
            g.reader = TappedReader(g.reader, self.tap)
        reads = self._reads(names)
        # The kernel reads the next tensors' local ranges while these merge: one thread asks for
        # them (POSIX_FADV_WILLNEED), at most PREFETCH_TENSORS tensors (or batches) ahead. A
        # tensor merged in passes over windows asks for its next window itself.
        units = [b if len(b) > 1 else [_alone(g, b[0])] for b in batched.batches(g, reads)]
        planned = [batched.batch_reads(g, b) if len(b) > 1 else None for b in units]
        ahead = [p.requests if p else self._ahead(b[0]) for b, p in zip(units, planned)]
        windowed_at = [p is None and g.form(b[0].name) is Form.WINDOWED for b, p in zip(units, planned)]

        def read_ahead_from(i: int) -> None:
            """Remote ranges are fetched ahead in the order the merge reads them, as far ahead as
            the reader's bound allows, up to a tensor merged in passes over windows: that one
            reads its next window ahead itself, with the bound to itself."""
            stop = windowed_at.index(True, i) if True in windowed_at[i:] else len(units)
            g.reader.read_ahead([r for requests in ahead[i:stop] for r in requests])

        read_ahead_from(0)
        with ContextPool(max_workers=1, thread_name_prefix="prefetch") as prefetch:
            try:
                for requests in ahead[:PREFETCH_TENSORS]:
                    prefetch.submit(g.reader.prefetch, requests)
                for i, unit in enumerate(units):
                    if i + PREFETCH_TENSORS < len(units):
                        prefetch.submit(g.reader.prefetch, ahead[i + PREFETCH_TENSORS])
                    if len(unit) > 1:
                        batched.merge_batch(g, unit, planned[i])
                    else:
                        self._merge_tensor(unit[0])
                    g.reader.release()  # its bytes are written: what it read goes back to the pool
                    if windowed_at[i]:
                        read_ahead_from(i + 1)
                if self.tap is not None:
                    self.index_result = self.tap.finish(g.reader, names)
            finally:
                prefetch.shutdown(wait=True, cancel_futures=True)
                g.reader.close()
        return len(names)

    def _reads(self, names: list[str]) -> list[TensorReads]:
        """The ranges each tensor needs: the whole base tensor and, for a float tensor, each
        expert's planned blocks, coalesced into runs of rows (the requests come with _alone,
        for a tensor merged alone)."""
        g = self.g
        wanted: dict[str, dict[int, list[tuple[int, int]]]] = {}
        access = g.plan.access.filter(pc.is_in(g.plan.access["tensor"], value_set=pa.array(list(names))))
        for e, t, r0, r1 in zip(*(access[c].to_pylist() for c in ("expert", "tensor", "row_start", "row_end"))):
            wanted.setdefault(t, {}).setdefault(e, []).append((r0, r1))
        out = []
        for name in names:
            planned = wanted.get(name) if DTYPES[g.base.tensors[name].dtype].is_float else None
            # an expert with nothing planned (a zero delta) reads nothing
            runs = {k: r if len(r) == 1 else coalesce(r) for k, r in sorted(planned.items())} if planned else {}
            out.append(TensorReads(name, None, runs, {}))
        return out

    def _ahead(self, reads: TensorReads) -> list[ReadRequest]:
        """The reads of a tensor merged alone, in order, as they are asked to be read ahead (or
        prefetched): a tensor merged in passes over windows asks for its next window itself."""
        form = self.g.form(reads.name)
        if form is Form.WINDOWED:
            return []
        if form is Form.STREAMED:
            return [r for run in streamed.runs_of(self.g, reads) for r in run.requests]
        return reads.all_requests()

    def _merge_tensor(self, reads: TensorReads) -> None:
        form = self.g.form(reads.name)
        if form is Form.STREAMED:
            streamed.merge_streamed(self.g, reads)
        elif form is Form.WINDOWED:
            windowed.merge_windowed(self.g, reads)
        else:  # indexing on the way measures each block from every model's bytes of it at once
            whole.merge_whole(self.g, reads, up_front=self.tap is not None)


def _alone(g: GroupContext, reads: TensorReads) -> TensorReads:
    """A tensor merged alone reads its base bytes, and each expert's runs, with requests of its
    own (a batch builds its requests for all its tensors at once)."""
    return reads._replace(
        base=g.base_request(reads.name),
        experts={k: g.expert_request(k, reads.name, r) for k, r in reads.runs.items()},
    )


def group_regions(layout: OutputLayout, group: str) -> list[tuple[str, int, int]]:
    """(shard, start, end) of each tensor of a group in the output, in the order it is written."""
    return [(layout.tensors[n].file, layout.tensors[n].start, layout.tensors[n].end) for n in layout.groups[group]]


def merge_group(
    plan: Plan,
    layout: OutputLayout,
    group: str,
    staging: Staging,
    memory: MemoryPlan | None = None,
    index: list[int] | None = None,
    worker: str = "",
) -> GroupResult:
    """Merge one group into the staged output within the memory plan's share for a group (None:
    no limit); with `index` (expert positions), measure those experts' statistics on the way."""
    ledger = ByteLedger()
    out = staging.writer(ledger)
    merger = GroupMerger(plan, layout, out, ledger, memory, index)
    try:
        merger.run(group)
        staged = out.close()
    except BaseException:
        out.abort()
        raise
    index_result = merger.index_result if index is not None else None
    return GroupResult(
        ledger.rows(), merger.g.written.hexdigest(), worker, index_result, staged=staged, kernels=kernel_set()
    )


def finished_group(layout: OutputLayout, group: str, staging: Staging) -> GroupResult | None:
    """What merging a group an earlier run finished gave, if its mark is there and its staged
    bytes are still exactly those it wrote (a resumed merge takes it over); else None."""
    record = staging.record(group, group_regions(layout, group))
    return None if record is None else GroupResult.from_record(record)
