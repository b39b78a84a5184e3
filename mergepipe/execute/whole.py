"""Whole tensors (Form.WHOLE): a tensor that fits its group's share, or whose operator needs
all of it. It holds the base tensor as stored (and in fp32, unless the operator widens it a
slab at a time), each expert's planned rows as stored, and the merged output. Tensors that are
not floats are copied as stored."""

from __future__ import annotations

from mergepipe import torch
from mergepipe.execute.context import GroupContext, TensorReads
from mergepipe.execute.experts import LazyExperts
from mergepipe.execute.memory import WHOLE_BASE_BYTES
from mergepipe.operators.rows import ExpertRows
from mergepipe.storage.location import is_remote
from mergepipe.storage.safetensors_format import DTYPES, decode, encode


def merge_whole(g: GroupContext, reads: TensorReads, up_front: bool = False) -> None:
    """Read the base tensor, then each expert's planned rows, and merge.

    Expert rows are read when the operator reaches that expert, so a group holds one expert's
    bytes at a time. They are read up front, in one concurrent batch, when asked (`up_front`:
    a tap measures each block from every model's bytes of it at once), when the inputs are in
    an object store (where latency, not memory, is the cost) or when the operator walks the
    experts twice (TIES-style elections), so no byte is read twice."""
    name, runs, requests = reads.name, reads.runs, reads.experts
    t = g.base.tensors[name]
    up_front = up_front or g.op.expert_passes > 1 or any(is_remote(r.path) for r in requests.values())
    order = list(requests) if up_front else []
    (raw,), *expert_raws = g.reader.read_batch([reads.base] + [requests[k] for k in order])
    if not DTYPES[t.dtype].is_float:
        g.write(name, 0, raw)
        return
    stored = decode(raw, t.dtype, t.shape)
    fetched = dict(zip(order, expert_raws))

    def planned_rows(k: int) -> ExpertRows | None:
        if k not in runs:
            return None
        raws = fetched[k] if k in fetched else g.reader.read_batch([requests[k]], read_with=[(reads.base, [raw])])[0]
        return g.expert_rows(k, name, runs[k], raws)

    ctx = g.tensor_context(name, base_reusable=True)
    params = g.params.for_tensor(name)
    out = g.layout.tensors[name]
    out_dtype = DTYPES[out.dtype].torch
    # A large base is left as stored for an operator that can widen it a slab at a time.
    slab_form = g.op.has_slab_form
    widened = None if slab_form and 4 * stored.numel() > WHOLE_BASE_BYTES else g.to_compute(stored)
    # With the stored base the operator can compare stored bits, when to_compute only widens.
    experts = LazyExperts(widened, planned_rows, len(g.experts), g.to_compute, stored, widens=g.plain(t.dtype))
    merged = None
    if slab_form:
        # Into the stored base's own buffer when it has the output's dtype: a slab's base rows
        # are not read again once the slab is merged.
        target = stored if stored.dtype == out_dtype else torch.empty(t.shape, dtype=out_dtype)
        if g.op.merge_into(target, experts, params, ctx):
            merged = target
    if merged is None:
        merged = g.op.merge(experts.base, experts, params, ctx).to(out_dtype)
    data = encode(merged)
    assert len(data) == out.end - out.start, (name, len(data), out)
    g.write(name, 0, data)
