"""Streamed runs (Form.STREAMED): an elementwise operator's merge of a tensor too large for its
group's share, a run of elements at a time. A run holds the base's elements of it, each
expert's planned elements within it, and the merged bytes, written at the run's place in the
output. Also the elementwise step both this form and a batch of small tensors take
(merge_run): the base's own bits where no expert was read, the operator elsewhere."""

from __future__ import annotations

import math
from typing import Iterator, NamedTuple

import numpy as np

from mergepipe import torch
from mergepipe.execute.context import GroupContext, TensorReads
from mergepipe.execute.experts import LazyExperts
from mergepipe.execute.memory import slab_elements
from mergepipe.operators import TensorContext
from mergepipe.operators.ranges import covering, element_runs
from mergepipe.operators.rows import ExpertRows, as_rows
from mergepipe.storage.reader import ReadRequest
from mergepipe.storage.safetensors_format import DTYPES, decode, encode

# Elements an elementwise merge takes through the operator at once: its fp32 temporaries stay in
# the CPU's cache (each whole-run operation would stream the run through memory), and are reused
# rather than mapped afresh for each run. The same element operations, so the same bytes.
ELEMENT_STEP = 1 << 16


class Run(NamedTuple):
    """One run of a streamed tensor: its elements [e0, e1), each expert's planned elements
    within it, and its reads (the base's, then each of those experts')."""

    e0: int
    e1: int
    pieces: dict[int, list[tuple[int, int]]]
    requests: list[ReadRequest]


def runs_of(g: GroupContext, reads: TensorReads) -> list[Run]:
    """The runs a streamed tensor is merged in (execute.memory.slab_elements elements each), in
    order, with their reads."""
    name = reads.name
    t = g.base.tensors[name]
    itemsize = DTYPES[t.dtype].itemsize
    slab = slab_elements(g.need(name), g.per_group)
    n_rows = t.shape[0] if t.shape else 1
    width = math.prod(t.shape[1:])
    planned = {k: [(r0 * width, r1 * width) for r0, r1 in rr] for k, rr in reads.runs.items()}
    out = []
    for e0, e1 in element_runs(n_rows, width, slab):
        pieces: dict[int, list[tuple[int, int]]] = {}
        requests = [g.base_request(name, [(t.start + e0 * itemsize, t.start + e1 * itemsize)])]
        for k, runs in planned.items():
            inside = [(max(a, e0), min(b, e1)) for a, b in runs if a < e1 and b > e0]
            if inside:
                x = g.expert_tensor(k, name)
                size = DTYPES[x.dtype].itemsize
                pieces[k] = inside
                requests.append(
                    ReadRequest(
                        reads.experts[k].path,
                        [(x.start + a * size, x.start + b * size) for a, b in inside],
                        "expert",
                        g.experts[k].role,
                        x.file,
                    )
                )
        out.append(Run(e0, e1, pieces, requests))
    return out


def merge_streamed(g: GroupContext, reads: TensorReads) -> None:
    """Merge a large tensor a run of elements at a time (runs_of): the base's elements of the
    run, each expert's planned elements within it, merged and written at the run's place in the
    output. Each element goes through the same operations as in the whole-tensor merge, so the
    bytes are the same."""
    name = reads.name
    t = g.base.tensors[name]
    width = math.prod(t.shape[1:])
    params = g.params.for_tensor(name)
    plain = g.plain(t.dtype)
    for e0, e1, pieces, requests in runs_of(g, reads):
        view = width if width <= e1 - e0 else e1 - e0  # whole rows, or a piece of one row
        (raw,), *expert_raws = g.reader.read_batch(requests)
        values = {
            k: [
                decode(r, g.expert_tensor(k, name).dtype, ((b - a) // view, view)) for (a, b), r in zip(pieces[k], raws)
            ]
            for k, raws in zip(pieces, expert_raws)
        }
        for s0, data in merge_run(g, name, raw, e0, e1, view, pieces, values, params, plain):
            g.write(name, s0, data)
        g.reader.release()  # the run is written: its buffers serve the next one


def merge_run(
    g: GroupContext,
    name: str,
    raw: bytearray | memoryview,
    e0: int,
    e1: int,
    view: int,
    pieces: dict[int, list[tuple[int, int]]],
    values: dict[int, list[torch.Tensor]],
    params,
    plain: bool,
) -> Iterator[tuple[int, memoryview]]:
    """An elementwise merge of elements [e0, e1) of the base (stored as `raw`, in rows of
    `view`) with each expert's pieces [a, b) inside them (their values as stored, in rows of
    `view`): (first element, merged bytes) of each stretch, in order."""
    t = g.base.tensors[name]
    dt = DTYPES[t.dtype]
    stored = as_rows(decode(raw, t.dtype, ((e1 - e0) // view, view)))
    # Elements no expert was read in are the base's own bytes where the operator adds a zero
    # there: only zeros, subnormals and NaN go through the formula (base_bits).
    shortcut = g.op.base_where_no_delta and plain and g.layout.tensors[name].dtype == t.dtype
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
            data = merge_elements(g, name, stored[lo:hi], {k: r for k, r in rows.items() if r}, params, plain)
        else:
            data = base_bits(
                memoryview(raw)[(s0 - e0) * dt.itemsize : (s1 - e0) * dt.itemsize],
                t.dtype,
                lambda sub: merge_elements(g, name, sub, {}, params, plain),
            )
        yield s0, data


def merge_elements(
    g: GroupContext, name: str, stored: torch.Tensor, rows: dict[int, ExpertRows], params, plain: bool
) -> memoryview:
    """The merged bytes of some base rows (stored) and the experts' rows read within them, a
    step of rows at a time (ELEMENT_STEP elements), each step's result written over its own
    base rows when the output has the base's dtype (they are not read again)."""
    out_dtype = DTYPES[g.layout.tensors[name].dtype].torch
    n, width = stored.shape
    out = stored if stored.dtype == out_dtype else torch.empty((n, width), dtype=out_dtype)
    step = max(1, ELEMENT_STEP // max(1, width))
    steps = {k: _RowSteps(r) for k, r in rows.items()}
    for c0 in range(0, n, step):
        c1 = min(n, c0 + step)
        within = {k: part for k, s in steps.items() if (part := s.within(c0, c1))}
        base = stored[c0:c1]
        experts = LazyExperts(g.to_compute(base), within.get, len(g.experts), g.to_compute, base, widens=plain)
        ctx = TensorContext(name, ((0, c1 - c0),), g.seed, base_reusable=True)
        out[c0:c1] = g.op.merge(experts.base, experts, params, ctx)
    return encode(out)


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
