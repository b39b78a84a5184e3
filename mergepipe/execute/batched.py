"""Batches of small tensors (Form.BATCHED): consecutive small float tensors of an elementwise
merge that lie one after another in the output and share their dtypes, files and parameters,
read, merged and written as one run of elements. A batch holds its tensors' base bytes, each
expert's planned bytes in them and the merged bytes: at most BATCH_ELEMENTS elements, within
the group's share."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterator, NamedTuple

from mergepipe.execute.context import GroupContext, TensorReads
from mergepipe.execute.memory import Form
from mergepipe.execute.streamed import merge_run
from mergepipe.operators.ranges import Gather, adjacent, gather
from mergepipe.storage.reader import ReadRequest
from mergepipe.storage.safetensors_format import DTYPES, decode

# The most elements one batch merges at once.
BATCH_ELEMENTS = 1 << 22


class BatchReads(NamedTuple):
    """A batch's reads (batch_reads): the base's bytes, then each expert's planned bytes
    (experts in order), each read in file order with touching ranges joined and gathered back
    into the batch's order; each expert's pieces, as ranges of elements of the batch's tensors
    laid end to end; and where each tensor starts among them."""

    requests: list[ReadRequest]
    gathers: list[Gather]
    pieces: dict[int, list[tuple[int, int]]]
    offsets: list[int]


def batches(g: GroupContext, reads: list[TensorReads]) -> Iterator[list[TensorReads]]:
    """The group's tensors in order, consecutive ones merged as batches together where they lie
    one after another in the output and share their dtypes, files and parameters; every other
    tensor alone."""
    batch: list[TensorReads] = []
    key = None
    held = cap = 0
    for r in reads:
        k = _batch_key(g, r.name) if g.form(r.name) is Form.BATCHED else None
        size = g.need(r.name).numel
        if batch and (k is None or k != key or held + size > cap or not _follows(g, batch[-1], r)):
            yield batch
            batch, held = [], 0
        if k is None:
            yield [r]
            continue
        if not batch:  # a batch holds what its elements need, within the group's share
            per_element = g.need(r.name).per_element
            cap = BATCH_ELEMENTS if g.per_group is None else min(BATCH_ELEMENTS, g.per_group // per_element)
        batch.append(r)
        key, held = k, held + size
    if batch:
        yield batch


def _batch_key(g: GroupContext, name: str) -> tuple:
    """What tensors merged in one batch must share."""
    t = g.base.tensors[name]
    out = g.layout.tensors[name]
    # (file, dtype) of each expert's tensor: the base's where they share its table
    experts = None if g.one_layout else tuple([m.tensors[name][:2] for m in g.experts])
    return (t.file, t.dtype, out.file, out.dtype, experts, g.params.by_tensor.get(name, 0))


def _follows(g: GroupContext, before: TensorReads, r: TensorReads) -> bool:
    return g.layout.tensors[r.name].start == g.layout.tensors[before.name].end


def batch_reads(g: GroupContext, batch: list[TensorReads]) -> BatchReads:
    first = batch[0].name
    tensors = [g.base.tensors[r.name] for r in batch]
    offsets = [0]
    for t in tensors:
        offsets.append(offsets[-1] + math.prod(t.shape))
    gathers = [gather([(t.start, t.start + t.nbytes) for t in tensors])]
    requests = [g.base_request(first, gathers[0].reads)]
    pieces: dict[int, list[tuple[int, int]]] = defaultdict(list)
    byte_ranges: dict[int, list[tuple[int, int]]] = defaultdict(list)
    # A batch's tensors share each expert's dtype (_batch_key).
    sizes = [DTYPES[m.tensors[first].dtype].itemsize for m in g.experts]
    for r, off, t in zip(batch, offsets, tensors):
        width = math.prod(t.shape[1:])
        for k, runs in r.runs.items():
            start = t.start if g.one_layout else g.expert_tensor(k, r.name).start
            step, pk, bk = width * sizes[k], pieces[k], byte_ranges[k]
            for r0, r1 in runs:
                pk.append((off + r0 * width, off + r1 * width))
                bk.append((start + r0 * step, start + r1 * step))
    for k in sorted(pieces):
        gathers.append(gather(byte_ranges[k]))
        x = g.expert_tensor(k, first)
        requests.append(ReadRequest(g.path(k + 1, x.file), gathers[-1].reads, "expert", g.experts[k].role, x.file))
    return BatchReads(requests, gathers, dict(pieces), offsets)


def merge_batch(g: GroupContext, batch: list[TensorReads], planned: BatchReads) -> None:
    """Small tensors of an elementwise merge, one after another in the output, merged as one
    run of elements (`planned`: their batch_reads): one read request for their base bytes and
    one for each expert's planned bytes in them, then merged and written as one tensor's run is
    (streamed.merge_run). Each element goes through the operations it would go through alone,
    so the bytes are the same as tensor by tensor."""
    first = batch[0].name
    pieces, order = dict(planned.pieces), sorted(planned.pieces)
    raws = g.reader.read_batch(planned.requests)
    raw = planned.gathers[0].join(raws[0])
    values = {}
    for k, bufs, gath in zip(order, raws[1:], planned.gathers[1:]):
        # The pieces' bytes lie in `joined` in their order: adjacent pieces (whole tensors one
        # after another in the output) become one, so the operator steps over few long runs.
        joined = memoryview(gath.join(bufs))
        dtype = g.expert_tensor(k, first).dtype
        size, at, values[k] = DTYPES[dtype].itemsize, 0, []
        pieces[k] = adjacent(pieces[k])
        for a, b in pieces[k]:
            values[k].append(decode(joined[at : at + (b - a) * size], dtype, (b - a, 1)))
            at += (b - a) * size
    params = g.params.for_tensor(first)
    plain = g.plain(g.base.tensors[first].dtype)
    for s0, data in merge_run(g, first, raw, 0, planned.offsets[-1], 1, pieces, values, params, plain):
        g.write(first, s0, data)
