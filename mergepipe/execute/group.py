"""Merging one layer group: read the base tensors and only the planned expert blocks, apply the
operator in fp32, and write the result at its precomputed place in the staged output."""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mergepipe import torch
from mergepipe.errors import BadInput
from mergepipe.execute.experts import LazyExperts
from mergepipe.execute.memory import (
    WHOLE_BASE_BYTES,
    TensorNeed,
    most_per_element,
    slab_elements,
    tensor_need,
    window_plan,
)
from mergepipe.execute.windows import StoredWindows
from mergepipe.index.blocks import block_rows, byte_range
from mergepipe.index.stats import buffer_differs_message
from mergepipe.index.tap import StatsTap
from mergepipe.operators import TensorContext, get_operator
from mergepipe.operators.rows import ExpertRows, as_rows
from mergepipe.operators.slabs import SLAB_ELEMENTS
from mergepipe.plan.output import OutputLayout
from mergepipe.plan.record import Plan
from mergepipe.ranges import Gather, adjacent, coalesce, covering, element_runs, gather, slabs_of, windows_of
from mergepipe.storage.ledger import ByteLedger
from mergepipe.storage.location import is_remote, join
from mergepipe.storage.reader import RangeReader, ReadRequest
from mergepipe.storage.safetensors_format import CONFIG_DTYPES, DTYPES, decode, encode
from mergepipe.storage.writer import group_record, write_at

# How many tensors ahead of the merge the kernel is asked to read (the first of them is the
# one being merged). Bounded so that prefetched pages are used before memory pressure could
# evict them.
PREFETCH_TENSORS = 2

# Float tensors of at most BATCH_TENSOR_ELEMENTS elements are merged by an elementwise operator
# in batches of up to BATCH_ELEMENTS (execute.group._merge_batch): per tensor, a read, an
# operator call and a write cost more than the arithmetic on a few thousand elements.
BATCH_TENSOR_ELEMENTS = 1 << 18
BATCH_ELEMENTS = 1 << 22

# Elements an elementwise merge takes through the operator at once: its fp32 temporaries stay in
# the CPU's cache (each whole-run operation would stream the run through memory), and are reused
# rather than mapped afresh for each run. The same element operations, so the same bytes.
ELEMENT_STEP = 1 << 16

# A base tensor up to WHOLE_BASE_BYTES in fp32 is widened once for its merge. A larger one (an
# embedding) stays as stored when the operator has a slab form (merge_into): each slab is
# widened in each pass instead, which cost no time and saves the fp32 copy and the output's.


def _compute(t: torch.Tensor, compute_dtype: torch.dtype | None) -> torch.Tensor:
    """fp32 values, first rounded to the config's `dtype` if one was given (mergekit casts
    inputs to it on load)."""
    if compute_dtype is not None and t.dtype != compute_dtype:
        t = t.to(compute_dtype)
    return t.to(torch.float32)


class TensorReads(NamedTuple):
    """What one tensor's merge reads: the base tensor, and each expert's planned runs of rows,
    with the requests that read them (filled in for a tensor merged alone; a batch reads its
    tensors' bytes with requests of its own)."""

    name: str
    base: ReadRequest | None
    runs: dict[int, list[tuple[int, int]]]
    experts: dict[int, ReadRequest]

    def all_requests(self) -> list[ReadRequest]:
        return [self.base, *self.experts.values()]

    def again(self) -> "TensorReads":
        """The same reads, each counted as read again (`reread` in the ledger)."""
        return self._replace(
            base=replace(self.base, role="reread"),
            experts={k: replace(r, role="reread") for k, r in self.experts.items()},
        )


class _TappedReader:
    """A RangeReader whose reads also feed an index tap (index.tap)."""

    def __init__(self, reader: RangeReader, tap: StatsTap) -> None:
        self.reader, self.tap = reader, tap

    def read_batch(self, requests: list[ReadRequest]) -> list[list[bytearray]]:
        out = self.reader.read_batch(requests)
        self.tap.feed(requests, out)
        return out

    def prefetch(self, requests: list[ReadRequest]) -> None:
        self.reader.prefetch(requests)

    def close(self) -> None:
        self.reader.close()


class GroupMerger:
    """Merges the tensors of one group. One instance per task; not shared across threads.

    `index`: expert positions to index from the bytes the merge reads (a new family's first
    merge, whose plan reads every block of theirs): their block statistics and tensor hashes
    come back in `index_result`."""

    def __init__(
        self,
        plan: Plan,
        layout: OutputLayout,
        staging: Path,
        ledger: ByteLedger,
        per_group: int | None = None,
        index: list[int] | None = None,
    ) -> None:
        self.plan = plan
        # bytes this group's merge may hold (execute.memory); None: every tensor merged whole
        self.per_group = per_group
        self.layout = layout
        self.staging = staging
        self.ledger = ledger
        self.reader = RangeReader(ledger)
        self.op = get_operator(plan.merge_method)
        self.params = plan.param_table()
        self.seed = plan.seed
        self.compute_dtype = DTYPES[CONFIG_DTYPES[plan.dtype]].torch if plan.dtype else None
        # SHA-256 of the bytes this group writes, in layout order: what a resumed merge checks
        # the staged bytes against before it trusts them.
        self.written = hashlib.sha256()
        self._needs: dict[str, TensorNeed] = {}
        self._kinds: dict = {}  # tensor_need's, shared by tensors alike
        self._paths: dict[tuple[int, str], str] = {}
        inputs = plan.inputs
        self._one_table = all(m.tensors is inputs[0].tensors for m in inputs[1:])  # plan.record.describe_inputs
        # A tensor under per_group at this rate needs no closer look.
        self._most_per_element = most_per_element(len(inputs))
        self.index = index or []
        self.tap: StatsTap | None = None
        self.index_result: dict | None = None

    def _path(self, model_index: int, file: str) -> str:
        key = (model_index, file)
        path = self._paths.get(key)
        if path is None:
            path = self._paths[key] = join(self.plan.inputs[model_index].root, file)
        return path

    def run(self, group: str) -> int:
        names = self.layout.groups[group]
        self.group = group
        if self.index:
            self.tap = StatsTap(self.plan.inputs, [k + 1 for k in self.index], self.plan.block_size, names)
            self.reader = _TappedReader(self.reader, self.tap)
        # tensor -> expert -> the planned blocks' rows
        wanted: dict[str, dict[int, list[tuple[int, int]]]] = {}
        access = self.plan.access.filter(pc.is_in(self.plan.access["tensor"], value_set=pa.array(list(names))))
        for e, t, r0, r1 in zip(*(access[c].to_pylist() for c in ("expert", "tensor", "row_start", "row_end"))):
            wanted.setdefault(t, {}).setdefault(e, []).append((r0, r1))
        reads = [self._tensor_reads(name, wanted) for name in names]
        # The kernel reads the next tensors' ranges while these merge: one thread asks for them
        # (POSIX_FADV_WILLNEED), at most PREFETCH_TENSORS tensors (or batches) ahead. A tensor
        # merged in passes over windows asks for its next window itself.
        batches = [b if len(b) > 1 else [self._with_requests(b[0])] for b in self._batches(reads)]
        batch_reads = [self._batch_requests(b) if len(b) > 1 else None for b in batches]
        ahead = [
            planned[0] if planned else [] if self.op.windowed and self._too_large(b[0].name) else b[0].all_requests()
            for b, planned in zip(batches, batch_reads)
        ]
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch") as prefetch:
            try:
                for requests in ahead[:PREFETCH_TENSORS]:
                    prefetch.submit(self.reader.prefetch, requests)
                for i, batch in enumerate(batches):
                    if i + PREFETCH_TENSORS < len(batches):
                        prefetch.submit(self.reader.prefetch, ahead[i + PREFETCH_TENSORS])
                    if len(batch) == 1:
                        self._merge_tensor(batch[0])
                    else:
                        self._merge_batch(batch, batch_reads[i])
                if self.tap is not None:
                    self.index_result = self._finish_index(names)
            finally:
                prefetch.shutdown(wait=True, cancel_futures=True)
                self.reader.close()
        return len(names)

    def _finish_index(self, names: list[str]) -> dict:
        """The tap's result, once the experts' non-float buffers (which a merge copies from the
        base and never reads) are read for their hashes, and found identical to the base's."""
        for name in names:
            t = self.plan.inputs[0].tensors[name]
            if DTYPES[t.dtype].is_float:
                continue
            for k in self.index:
                x = self.plan.inputs[k + 1].tensors[name]
                self.reader.read_batch(
                    [
                        ReadRequest(
                            self._path(k + 1, x.file),
                            [(x.start, x.start + x.nbytes)],
                            "index",
                            self.plan.inputs[k + 1].role,
                            x.file,
                        )
                    ]
                )
        result = self.tap.result()
        for name in names:
            t = self.plan.inputs[0].tensors[name]
            if DTYPES[t.dtype].is_float:
                continue
            for k in self.index:
                if self.tap.sha256(k + 1, name) != self.tap.sha256(0, name):
                    raise BadInput(buffer_differs_message(k, self.plan.inputs[k + 1].uri, name, t.dtype))
        return result

    def _batches(self, reads: list[TensorReads]) -> Iterator[list[TensorReads]]:
        """The group's tensors in order, consecutive small ones of an elementwise merge together
        (_merge_batch) where they lie one after another in the output and share their dtypes,
        files and parameters; every other tensor alone."""
        batch: list[TensorReads] = []
        key = None
        held = cap = 0
        for r in reads:
            k, size = self._batch_key(r)
            if batch and (k is None or k != key or held + size > cap or not self._follows(batch[-1], r)):
                yield batch
                batch, held = [], 0
            if k is None:
                yield [r]
                continue
            if not batch:  # a batch holds what its elements need, within the group's share
                per_element = self._need(r.name).per_element
                cap = BATCH_ELEMENTS if self.per_group is None else min(BATCH_ELEMENTS, self.per_group // per_element)
            batch.append(r)
            key, held = k, held + size
        if batch:
            yield batch

    def _batch_key(self, r: TensorReads) -> tuple[tuple | None, int]:
        """What tensors merged in one batch must share (None: this one is merged alone), and
        its element count."""
        t = self.plan.inputs[0].tensors[r.name]
        numel = math.prod(t.shape)
        if not self.op.elementwise or not DTYPES[t.dtype].is_float or not 0 < numel <= BATCH_TENSOR_ELEMENTS:
            return None, numel
        if self.per_group is not None and numel * self._most_per_element > self.per_group:
            if self._too_large(r.name) is not None:
                return None, numel
        out = self.layout.tensors[r.name]
        # (file, dtype) of each expert's tensor: the base's where they share its table
        experts = None if self._one_table else tuple([m.tensors[r.name][:2] for m in self.plan.inputs[1:]])
        params = self.params.by_tensor.get(r.name, 0)
        return (t.file, t.dtype, out.shard, out.dtype, experts, params), numel

    def _follows(self, before: TensorReads, r: TensorReads) -> bool:
        return self.layout.tensors[r.name].start == self.layout.tensors[before.name].end

    def _batch_requests(
        self, batch: list[TensorReads]
    ) -> tuple[list[ReadRequest], list[Gather], dict[int, list[tuple[int, int]]], list[int]]:
        """A batch's reads: the base's bytes, then each expert's planned bytes (experts in
        order), each read in file order with touching ranges joined, and gathered back into
        the batch's order; each expert's pieces, as ranges of elements of the batch's tensors
        laid end to end; and where each tensor starts among them."""
        first = batch[0].name
        tensors = [self.plan.inputs[0].tensors[r.name] for r in batch]
        offsets = [0]
        for t in tensors:
            offsets.append(offsets[-1] + math.prod(t.shape))
        gathers = [gather([(t.start, t.start + t.nbytes) for t in tensors])]
        requests = [ReadRequest(self._path(0, tensors[0].file), gathers[0].reads, "base", "base", tensors[0].file)]
        pieces: dict[int, list[tuple[int, int]]] = defaultdict(list)
        byte_ranges: dict[int, list[tuple[int, int]]] = defaultdict(list)
        inputs = self.plan.inputs
        # A batch's tensors share each expert's dtype (_batch_key).
        sizes = [DTYPES[m.tensors[first].dtype].itemsize for m in inputs[1:]]
        for r, off, t in zip(batch, offsets, tensors):
            width = math.prod(t.shape[1:])
            for k, runs in r.runs.items():
                start = t.start if self._one_table else inputs[k + 1].tensors[r.name].start
                step, pk, bk = width * sizes[k], pieces[k], byte_ranges[k]
                for r0, r1 in runs:
                    pk.append((off + r0 * width, off + r1 * width))
                    bk.append((start + r0 * step, start + r1 * step))
        for k in sorted(pieces):
            gathers.append(gather(byte_ranges[k]))
            requests.append(
                ReadRequest(
                    self._path(k + 1, self.plan.inputs[k + 1].tensors[first].file),
                    gathers[-1].reads,
                    "expert",
                    self.plan.inputs[k + 1].role,
                    self.plan.inputs[k + 1].tensors[first].file,
                )
            )
        return requests, gathers, dict(pieces), offsets

    def _merge_batch(self, batch: list[TensorReads], planned: tuple) -> None:
        """Small tensors of an elementwise merge, one after another in the output, merged as one
        run of elements (`planned`: their _batch_requests): one read request for their base
        bytes and one for each expert's planned bytes in them, then merged and written as one
        tensor's run is (_merge_run). Each element goes through the operations it would go
        through alone, so the bytes are the same as tensor by tensor."""
        first = batch[0].name
        tensors = [self.plan.inputs[0].tensors[r.name] for r in batch]
        requests, gathers, pieces, offsets = planned
        pieces, order = dict(pieces), sorted(pieces)
        raws = self.reader.read_batch(requests)
        raw = gathers[0].join(raws[0])
        values = {}
        for k, bufs, g in zip(order, raws[1:], gathers[1:]):
            # The pieces' bytes lie in `joined` in their order: adjacent pieces (whole tensors
            # one after another in the output) become one, so the operator steps over few long runs.
            joined = memoryview(g.join(bufs))
            dtype = self.plan.inputs[k + 1].tensors[first].dtype
            size, at, values[k] = DTYPES[dtype].itemsize, 0, []
            pieces[k] = adjacent(pieces[k])
            for a, b in pieces[k]:
                values[k].append(decode(joined[at : at + (b - a) * size], dtype, (b - a, 1)))
                at += (b - a) * size
        out = self.layout.tensors[first]
        out_path, out_size = self.staging / out.shard, DTYPES[out.dtype].itemsize
        params = self.params.for_tensor(first)
        plain = self.compute_dtype in (None, DTYPES[tensors[0].dtype].torch)
        for s0, data in self._merge_run(first, raw, 0, offsets[-1], 1, dict(pieces), values, params, plain):
            self.written.update(data)
            write_at(out_path, out.start + s0 * out_size, data, self.ledger)

    def _tensor_reads(self, name: str, wanted: dict) -> TensorReads:
        """The ranges one tensor needs: the whole base tensor and, for a float tensor, each
        expert's planned blocks, coalesced into runs of rows (the requests come with
        _with_requests, for a tensor merged alone)."""
        planned = wanted.get(name) if DTYPES[self.plan.inputs[0].tensors[name].dtype].is_float else None
        # an expert with nothing planned (a zero delta) reads nothing
        runs = {k: rows if len(rows) == 1 else coalesce(rows) for k, rows in sorted(planned.items())} if planned else {}
        return TensorReads(name, None, runs, {})

    def _with_requests(self, reads: TensorReads) -> TensorReads:
        """A tensor merged alone reads its base bytes, and each expert's runs, with requests of
        its own (a batch builds its requests for all its tensors at once)."""
        t = self.plan.inputs[0].tensors[reads.name]
        return reads._replace(
            base=ReadRequest(self._path(0, t.file), [(t.start, t.start + t.nbytes)], "base", "base", t.file),
            experts={k: self._expert_request(k, reads.name, r) for k, r in reads.runs.items()},
        )

    def _merge_tensor(self, reads: TensorReads) -> None:
        """Read the base tensor, then each expert's planned rows, and merge.

        Expert rows are read when the operator reaches that expert, so a group holds one
        expert's bytes at a time. They are read up front, in one concurrent batch, when the
        inputs are in an object store (where latency, not memory, is the cost) or when the
        operator walks the experts twice (TIES-style elections), so no byte is read twice."""
        need = self._too_large(reads.name)
        if need is not None:
            if self.op.elementwise:
                return self._merge_streamed(reads, slab_elements(need, self.per_group))
            windows = self._windows(reads, need)
            if self._merge_windowed(windows):
                return
            if windows.read_any:  # whatever the whole-tensor merge reads now is read again
                reads = reads.again()
        name, runs, requests = reads.name, reads.runs, reads.experts
        _, dtype, shape, _ = self.plan.inputs[0].tensors[name]
        dt = DTYPES[dtype]
        out = self.layout.tensors[name]
        out_path = self.staging / out.shard
        # Indexing on the way (self.tap) measures each block from the base's and every expert's
        # bytes of it at once.
        up_front = (
            self.tap is not None or self.op.expert_passes > 1 or any(is_remote(r.path) for r in requests.values())
        )
        order = list(requests) if up_front else []
        (raw,), *expert_raws = self.reader.read_batch([reads.base] + [requests[k] for k in order])
        if not dt.is_float:
            self.written.update(raw)
            write_at(out_path, out.start, raw, self.ledger)
            return
        stored = decode(raw, dtype, shape)
        fetched = dict(zip(order, expert_raws))
        width = as_rows(stored).shape[1]

        def planned_rows(k: int) -> ExpertRows | None:
            if k not in runs:
                return None
            raws = fetched[k] if k in fetched else self.reader.read_batch([requests[k]])[0]
            return self._expert_rows(k, name, width, runs[k], raws)

        ctx = self._context(name, base_reusable=True)
        params = self.params.for_tensor(name)
        out_dtype = DTYPES[out.dtype].torch
        # A large base is left as stored for an operator that can widen it a slab at a time.
        slab_form = self.op.has_slab_form
        widened = None if slab_form and 4 * stored.numel() > WHOLE_BASE_BYTES else self._to_compute(stored)
        # With the stored base the operator can compare stored bits, when to_compute only widens.
        plain = self.compute_dtype in (None, stored.dtype)
        experts = LazyExperts(widened, planned_rows, len(self.plan.inputs) - 1, self._to_compute, stored, widens=plain)
        merged = None
        if slab_form:
            # Into the stored base's own buffer when it has the output's dtype: a slab's base
            # rows are not read again once the slab is merged.
            target = stored if stored.dtype == out_dtype else torch.empty(shape, dtype=out_dtype)
            if self.op.merge_into(target, experts, params, ctx):
                merged = target
        if merged is None:
            merged = self.op.merge(experts.base, experts, params, ctx).to(out_dtype)
        data = encode(merged)
        assert len(data) == out.end - out.start, (name, len(data), out)
        self.written.update(data)
        write_at(out_path, out.start, data, self.ledger)

    def _too_large(self, name: str) -> TensorNeed | None:
        """The tensor's need, where it is too large for this group's share and the operator can
        merge it in parts (runs of elements, windows of rows); else None."""
        if self.per_group is None or not (self.op.elementwise or self.op.windowed):
            return None
        need = self._need(name)
        return need if need.streams and need.whole > self.per_group else None

    def _need(self, name: str) -> TensorNeed:
        """tensor_need, once per tensor (batching, prefetch and the merge each ask)."""
        need = self._needs.get(name)
        if need is None:
            need = self._needs[name] = tensor_need(self.plan, self.layout, self.group, name, self.params, self._kinds)
        return need

    def _windows(self, reads: TensorReads, need: TensorNeed) -> StoredWindows:
        t = self.plan.inputs[0].tensors[reads.name]
        width = math.prod(t.shape[1:])
        elements, keep = window_plan(need, self.per_group)
        slabs = slabs_of(self._context(reads.name).block_rows, width, SLAB_ELEMENTS)
        return StoredWindows(
            self.plan,
            reads.name,
            self.reader,
            (reads.base, reads.experts),
            reads.runs,
            windows_of(slabs, max(1, elements // max(1, width))),
            keep,
            self._to_compute,
            self.compute_dtype in (None, DTYPES[t.dtype].torch),
        )

    def _merge_windowed(self, windows: StoredWindows) -> bool:
        """A large tensor merged a window of rows at a time (Operator.merge_windows), each
        window's result written at its place in the output. False, with nothing written, where
        the operator needs the whole tensor."""
        name = windows.name
        out = self.layout.tensors[name]
        out_path, row_bytes = self.staging / out.shard, windows.width * DTYPES[out.dtype].itemsize

        def write(first_row: int, rows: torch.Tensor) -> None:
            data = encode(rows)
            self.written.update(data)
            write_at(out_path, out.start + first_row * row_bytes, data, self.ledger)

        ctx = self._context(name, nonzero_at_most=tuple(self.plan.nonzero_bounds.get(name, ())))
        return self.op.merge_windows(windows, self.params.for_tensor(name), ctx, DTYPES[out.dtype].torch, write)

    def _context(self, name: str, **kw) -> TensorContext:
        _, dtype, shape, _ = self.plan.inputs[0].tensors[name]
        return TensorContext(
            name, tuple(block_rows(shape, DTYPES[dtype].itemsize, self.plan.block_size)), self.seed, **kw
        )

    def _merge_streamed(self, reads: TensorReads, slab: int) -> None:
        """An elementwise operator's merge of a large tensor, a run of at most `slab` elements
        at a time: the base's elements of the run, each expert's planned elements within it,
        merged and written at the run's place in the output. Each element goes through the same
        operations as in the whole-tensor merge, so the bytes are the same."""
        name = reads.name
        t = self.plan.inputs[0].tensors[name]
        dt = DTYPES[t.dtype]
        out = self.layout.tensors[name]
        out_path, out_size = self.staging / out.shard, DTYPES[out.dtype].itemsize
        n_rows = t.shape[0] if t.shape else 1
        width = math.prod(t.shape[1:])
        params = self.params.for_tensor(name)
        plain = self.compute_dtype in (None, dt.torch)
        planned = {k: [(r0 * width, r1 * width) for r0, r1 in rr] for k, rr in reads.runs.items()}
        for e0, e1 in element_runs(n_rows, width, slab):
            view = width if width <= e1 - e0 else e1 - e0  # whole rows, or a piece of one row
            base = ReadRequest(
                reads.base.path, [(t.start + e0 * dt.itemsize, t.start + e1 * dt.itemsize)], "base", "base", t.file
            )
            pieces: dict[int, list[tuple[int, int]]] = {}
            requests = []
            for k, runs in planned.items():
                inside = [(max(a, e0), min(b, e1)) for a, b in runs if a < e1 and b > e0]
                if inside:
                    x = self.plan.inputs[k + 1].tensors[name]
                    size = DTYPES[x.dtype].itemsize
                    pieces[k] = inside
                    requests.append(
                        ReadRequest(
                            reads.experts[k].path,
                            [(x.start + a * size, x.start + b * size) for a, b in inside],
                            "expert",
                            self.plan.inputs[k + 1].role,
                            x.file,
                        )
                    )
            (raw,), *expert_raws = self.reader.read_batch([base, *requests])
            values = {
                k: [
                    decode(r, self.plan.inputs[k + 1].tensors[name].dtype, ((b - a) // view, view))
                    for (a, b), r in zip(pieces[k], raws)
                ]
                for k, raws in zip(pieces, expert_raws)
            }
            for s0, data in self._merge_run(name, raw, e0, e1, view, pieces, values, params, plain):
                self.written.update(data)
                write_at(out_path, out.start + s0 * out_size, data, self.ledger)

    def _merge_run(
        self,
        name: str,
        raw: bytearray,
        e0: int,
        e1: int,
        view: int,
        pieces: dict[int, list[tuple[int, int]]],
        values: dict[int, list[torch.Tensor]],
        params,
        plain: bool,
    ) -> Iterator[tuple[int, memoryview]]:
        """An elementwise merge of elements [e0, e1) of the base (stored as `raw`, in rows of
        `view`) with each expert's pieces [a, b) inside them (their values as stored, in rows
        of `view`): (first element, merged bytes) of each stretch, in order."""
        t = self.plan.inputs[0].tensors[name]
        dt = DTYPES[t.dtype]
        stored = as_rows(decode(raw, t.dtype, ((e1 - e0) // view, view)))
        # Elements no expert was read in are the base's own bytes where the operator adds a
        # zero there: only zeros, subnormals and NaN go through the formula (base_bits).
        shortcut = self.op.base_where_no_delta and plain and self.layout.tensors[name].dtype == t.dtype
        every = [iv for ivs in pieces.values() for iv in ivs]
        for s0, s1, covered in covering(e0, e1, every) if shortcut else [(e0, e1, True)]:
            lo, hi = (s0 - e0) // view, (s1 - e0) // view
            if covered:
                rows: dict[int, ExpertRows] = {
                    k: [
                        (((a - s0) // view, (b - s0) // view), v)
                        for (a, b), v in zip(pieces[k], values[k])
                        if s0 <= a and b <= s1
                    ]
                    for k in pieces
                }
                data = self._merge_elements(name, stored[lo:hi], {k: r for k, r in rows.items() if r}, params, plain)
            else:
                data = base_bits(
                    memoryview(raw)[(s0 - e0) * dt.itemsize : (s1 - e0) * dt.itemsize],
                    t.dtype,
                    lambda sub: self._merge_elements(name, sub, {}, params, plain),
                )
            yield s0, data

    def _merge_elements(
        self, name: str, stored: torch.Tensor, rows: dict[int, ExpertRows], params, plain: bool
    ) -> memoryview:
        """The merged bytes of some base rows (stored) and the experts' rows read within them,
        a step of rows at a time (ELEMENT_STEP elements), each step's result written over its
        own base rows when the output has the base's dtype (they are not read again)."""
        out_dtype = DTYPES[self.layout.tensors[name].dtype].torch
        n, width = stored.shape
        out = stored if stored.dtype == out_dtype else torch.empty((n, width), dtype=out_dtype)
        step = max(1, ELEMENT_STEP // max(1, width))
        steps = {k: _RowSteps(r) for k, r in rows.items()}
        for c0 in range(0, n, step):
            c1 = min(n, c0 + step)
            within = {k: part for k, s in steps.items() if (part := s.within(c0, c1))}
            base = stored[c0:c1]
            experts = LazyExperts(
                self._to_compute(base), within.get, len(self.plan.inputs) - 1, self._to_compute, base, widens=plain
            )
            ctx = TensorContext(name, ((0, c1 - c0),), self.seed, base_reusable=True)
            out[c0:c1] = self.op.merge(experts.base, experts, params, ctx)
        return encode(out)

    def _expert_request(self, k: int, name: str, row_runs: list[tuple[int, int]]) -> ReadRequest:
        """Adjacent planned blocks were coalesced into runs of rows: one range per run."""
        inp = self.plan.inputs[k + 1]
        t = inp.tensors[name]
        ranges = [byte_range(t.start, t.shape, DTYPES[t.dtype].itemsize, r0, r1) for r0, r1 in row_runs]
        return ReadRequest(self._path(k + 1, t.file), ranges, "expert", inp.role, t.file)

    def _expert_rows(
        self, k: int, name: str, width: int, row_runs: list[tuple[int, int]], raws: list[bytearray]
    ) -> ExpertRows:
        """The expert's planned rows as stored (rows of the tensor's 2-D view over the read
        buffers, no copy); the operator converts them with to_compute, piece by piece."""
        dtype = self.plan.inputs[k + 1].tensors[name].dtype
        return [((r0, r1), decode(raw, dtype, (r1 - r0, width))) for (r0, r1), raw in zip(row_runs, raws)]

    def _to_compute(self, t: torch.Tensor) -> torch.Tensor:
        return _compute(t, self.compute_dtype)


class _RowSteps:
    """An expert's planned rows (in order, as ExpertRows), cut to consecutive steps of rows."""

    def __init__(self, rows: ExpertRows) -> None:
        self.rows, self.at = rows, 0

    def within(self, c0: int, c1: int) -> ExpertRows:
        """The parts of the rows inside [c0, c1), counted from c0; steps must come in order."""
        rows = self.rows
        while self.at < len(rows) and rows[self.at][0][1] <= c0:
            self.at += 1
        part, i = [], self.at
        while i < len(rows) and rows[i][0][0] < c1:
            (a, b), values = rows[i]
            lo, hi = max(a, c0), min(b, c1)
            part.append(((lo - c0, hi - c0), values[lo - a : hi - a]))
            i += 1
        return part


def group_regions(layout: OutputLayout, group: str) -> list[tuple[str, int, int]]:
    """(shard, start, end) of each tensor of a group in the output, in the order it is written."""
    return [(layout.tensors[n].shard, layout.tensors[n].start, layout.tensors[n].end) for n in layout.groups[group]]


def merge_group(
    plan: Plan,
    layout: OutputLayout,
    group: str,
    staging: Path,
    per_group: int | None = None,
    index: list[int] | None = None,
) -> dict:
    """Merge one group into the staged output, holding at most about per_group bytes (None: no
    limit). Returns the ledger rows of what it read and wrote, the SHA-256 of the bytes it
    wrote and, with `index` (expert positions), those experts' statistics (GroupMerger)."""
    ledger = ByteLedger()
    merger = GroupMerger(plan, layout, staging, ledger, per_group, index)
    merger.run(group)
    result = {"rows": ledger.rows(), "sha256": merger.written.hexdigest()}
    if index:
        result["index"] = merger.index_result
    return result


def finished_group(layout: OutputLayout, group: str, staging: Path) -> dict | None:
    """What merging a group an earlier run finished returned, if its mark is there and its staged
    bytes are still exactly those it wrote (a resumed merge takes it over); else None."""
    return group_record(staging, group, group_regions(layout, group))


# Exponent and mantissa bits of each float dtype as stored.
_FLOAT_BITS = {
    "BF16": (np.uint16, 0x7F80, 0x007F),
    "F16": (np.uint16, 0x7C00, 0x03FF),
    "F32": (np.uint32, 0x7F800000, 0x007FFFFF),
    "F64": (np.uint64, 0x7FF0000000000000, 0x000FFFFFFFFFFFFF),
}


def special_positions(bits: np.ndarray, dtype: str) -> np.ndarray:
    """Where `bits` (a float dtype's stored bits) hold a zero, a subnormal or a NaN. Without
    its sign an element is one of those exactly when it lies outside [smallest normal,
    infinity], which one unsigned subtraction and compare test (below the range it wraps).
    A step at a time, in work arrays allocated once, as an elementwise merge steps."""
    uint, exponent, mantissa = _FLOAT_BITS[dtype]
    magnitude, lowest, span = uint(np.iinfo(uint).max >> 1), uint(mantissa + 1), uint(exponent - mantissa - 1)
    n = min(bits.size, ELEMENT_STEP)
    work, flags = np.empty(n, dtype=uint), np.empty(n, dtype=bool)
    found = []
    for c0 in range(0, bits.size, ELEMENT_STEP):
        part = bits[c0 : c0 + ELEMENT_STEP]
        w, f = work[: part.size], flags[: part.size]
        np.bitwise_and(part, magnitude, out=w)
        np.subtract(w, lowest, out=w)
        np.greater(w, span, out=f)
        if f.any():
            found.append(np.flatnonzero(f) + c0)
    return np.concatenate(found) if found else np.empty(0, dtype=np.intp)


def base_bits(raw: memoryview, dtype: str, formula) -> memoryview:
    """What base + a zero gives, cast back to the base's dtype, for elements stored as `raw`:
    the same bits, except for zeros (-0 + +0 is +0), subnormals and NaN (whose payload the
    casts may change: torch's depend on how many elements are cast at once), which `formula`
    computes from their stored values (a 1-row tensor). Those are written over `raw` where it
    is writable (a read's own buffer, not read again), so no slab is copied."""
    uint = _FLOAT_BITS[dtype][0]
    bits = np.frombuffer(raw, dtype=uint)
    special = special_positions(bits, dtype)
    if special.size == 0:
        return raw
    stored = decode(bytearray(bits[special].tobytes()), dtype, (1, special.size))
    out = bits if bits.flags.writeable else bits.copy()
    out[special] = np.frombuffer(formula(stored), dtype=uint)
    return memoryview(out).cast("B")
