"""Block statistics taken from bytes a merge reads anyway: a new family's first merge that reads
every block indexes it in the same pass (no second read of any expert byte).

The tap is handed each batch of bytes as it is read and computes what the statistics pass
(index.stats) computes with the same functions, in strips of equal blocks as that pass does, so
the rows, hashes and content digests are the same as that pass's. A tensor whose bytes come
whole for every model in one batch (the usual case: the merge reads a tensor, or a run of small
ones, from every model at once, and models saved alike share one layout) is hashed and measured
straight from the batch's buffers. Any other tensor's bytes are streamed: they must come in
order within each (model, tensor), bytes seen before (a pass over windows read again) are
skipped, a block is measured once the base's bytes and every indexed expert's bytes of it have
arrived, and only the bytes of blocks not yet complete are kept between batches.
"""

from __future__ import annotations

import hashlib
import math
import threading
from bisect import bisect_left, bisect_right
from itertools import accumulate, chain
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from mergepipe.errors import BadInput, MergepipeError
from mergepipe.index.blocks import block_rows, layer_group, row_elems
from mergepipe.index.stats import (
    BLOCKS_SCHEMA,
    STATS_SCHEMA,
    base_strip,
    block_hash,
    buffer_differs_message,
    delta_strip,
    strip_bytes,
)
from mergepipe.operators.ranges import strips
from mergepipe.storage.location import join
from mergepipe.storage.reader import RangeReader, ReadRequest
from mergepipe.storage.safetensors_format import DTYPES

HASHES_SCHEMA = pa.schema([("role", pa.string()), ("tensor", pa.string()), ("sha256", pa.string())])

_NONE, _STREAMED, _DONE = 0, 1, 2  # a tensor's state: no bytes yet, streamed, hashed and measured


class _Stream:
    """One model's bytes of one tensor, as they arrive: hashed, and held from the first block
    not yet measured (views of this batch's buffers, and a copy of what earlier batches left)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.seen = 0
        self.sha = hashlib.sha256()
        self.pieces: list[tuple[int, memoryview]] = []  # (offset in the tensor, bytes), in order

    def offer(self, offset: int, view: memoryview) -> None:
        if offset > self.seen:
            raise MergepipeError(f"bytes {self.seen}..{offset} were skipped")
        skip = self.seen - offset
        if skip >= len(view):
            return
        view = view[skip:]
        self.sha.update(view)
        self.pieces.append((self.seen, view))
        self.seen += len(view)

    def take(self, a: int, b: int):
        """Bytes [a, b), all arrived: a view where one piece holds them, else a (writable) copy."""
        for o, v in self.pieces:
            if o <= a and b <= o + len(v):
                return v[a - o : b - o]
        return bytearray().join(
            v[max(a, o) - o : min(b, o + len(v)) - o] for o, v in self.pieces if o < b and o + len(v) > a
        )

    def release(self, upto: int) -> None:
        """Drop the bytes before `upto`; a copy of those after it outlives the batch's buffers."""
        tail = [v[max(upto, o) - o :] for o, v in self.pieces if o + len(v) > upto]
        self.pieces = [(max(upto, self.pieces[0][0]), memoryview(bytearray().join(tail)))] if tail else []


class _Kind(NamedTuple):
    """What tensors of one shape and one dtype per model share."""

    kind: tuple[str, ...]  # each model's dtype: what the statistics pass groups strips by
    is_float: bool
    rows: list[tuple[int, int]]  # the blocks' rows
    nbytes: tuple[int, ...]  # per model, in the tap's order (base first)
    row_bytes: tuple[int, ...]

    @classmethod
    def of(cls, shape: tuple[int, ...], kind: tuple[str, ...], block_size: int) -> "_Kind":
        width, sizes = row_elems(shape), [DTYPES[d].itemsize for d in kind]
        return cls(
            kind,
            DTYPES[kind[0]].is_float,
            block_rows(shape, sizes[0], block_size),
            tuple(math.prod(shape) * n for n in sizes),
            tuple(width * n for n in sizes),
        )


class _Streamed:
    """A tensor whose bytes are streamed: each model's stream, and the first block not yet measured."""

    def __init__(self, kind: _Kind) -> None:
        self.streams = [_Stream(n) for n in kind.nbytes]
        self.next = 0


class TappedReader:
    """A RangeReader whose reads also feed a StatsTap."""

    def __init__(self, reader: RangeReader, tap: "StatsTap") -> None:
        self.reader, self.tap = reader, tap

    def read_batch(self, requests: list[ReadRequest]) -> list[list[bytearray]]:
        out = self.reader.read_batch(requests)
        self.tap.feed(requests, out)
        return out

    def prefetch(self, requests: list[ReadRequest]) -> None:
        self.reader.prefetch(requests)

    def read_ahead(self, requests: list[ReadRequest], first: bool = False) -> None:
        self.reader.read_ahead(requests, first)

    def release(self, buffers=None) -> None:
        self.reader.release(buffers)

    def close(self) -> None:
        self.reader.close()


class StatsTap:
    """Statistics of the indexed experts (input positions `experts`, 1-based as in plan.inputs)
    over the tensors `names`, from bytes fed in as they are read."""

    def __init__(self, inputs: list, experts: list[int], block_size: int, names: list[str]) -> None:
        self.inputs = inputs
        self.models = [0, *experts]  # input positions; the tap's own order (p) is this list's
        self._lock = threading.Lock()
        self.names = list(names)
        self._number = {n: i for i, n in enumerate(self.names)}
        self._position = {inp.role: self.models.index(i) for i, inp in enumerate(inputs) if i in self.models}
        # Every tapped model's tensors lie where the base's do (one Layout): one model's file
        # index serves all, and their bytes line up.
        self.one_layout = all(inputs[m].layout is inputs[0].layout for m in self.models)
        kinds: dict[tuple, _Kind] = {}
        self.kinds: list[_Kind] = []
        for name in self.names:
            entries = [inputs[m].tensors[name] for m in self.models]
            key = (entries[0].shape, *[e.dtype for e in entries])
            kind = kinds.get(key)
            if kind is None:
                kind = kinds[key] = _Kind.of(entries[0].shape, key[1:], block_size)
            self.kinds.append(kind)
        self.state = [_NONE] * len(self.names)
        self.hashes: list[list[str | None]] = [[None] * len(self.names) for _ in self.models]
        self._streamed: dict[int, _Streamed] = {}
        for i, kind in enumerate(self.kinds):
            if not any(kind.nbytes):  # nothing will be read: hashed now, and no blocks
                self.state[i] = _DONE
                for p in range(len(self.models)):
                    self.hashes[p][i] = hashlib.sha256().hexdigest()
        # Per (tap position, file): tensor starts and ends in order, and their numbers, to find
        # the tensors a range spans. Zero-size tensors share their start with the next tensor:
        # sorted by end too, so the last tensor starting at or before a range's start holds it.
        self._files: dict[tuple[int, str], tuple[list[int], list[int], list[int]]] = {}
        for p, m in enumerate(self.models):
            if p and self.one_layout:  # the base's index serves every model
                self._files.update({(p, file): index for (q, file), index in self._files.items() if q == 0})
                continue
            by_file: dict[str, list[tuple[int, int, int]]] = {}
            for i, name in enumerate(self.names):
                e = inputs[m].tensors[name]
                by_file.setdefault(e.file, []).append((e.start, e.start + self.kinds[i].nbytes[p], i))
            for file, spans in by_file.items():
                spans.sort()
                self._files[(p, file)] = ([s for s, _, _ in spans], [e for _, e, _ in spans], [i for _, _, i in spans])
        self.stats: dict[str, list] = {f: [] for f in STATS_SCHEMA.names}
        self.blocks: dict[str, list] = {f: [] for f in BLOCKS_SCHEMA.names}

    def feed(self, requests: list, buffers: list[list]) -> None:
        """One batch of reads (storage.reader.ReadRequest and the buffers read for its ranges)."""
        with self._lock:
            mine = []
            for req, bufs in zip(requests, buffers):
                p = self._position.get(req.model)
                index = self._files.get((p, req.file)) if p is not None else None
                if index is not None:
                    mine.append((p, req, bufs, index))
            # range number -> the tensors [lo, hi) taken whole, and those among them still streamed
            taken = self._whole_tensors(mine)
            touched: dict[int, _Streamed] = {}
            for p, req, bufs, (starts, _, numbers) in mine:
                m = self.models[p]
                for r, ((a, b), buf) in enumerate(zip(req.ranges, bufs)):
                    view = memoryview(buf)
                    first, end = max(0, bisect_right(starts, a) - 1), bisect_left(starts, b)
                    if r in taken:
                        lo, hi, rest = taken[r]
                        spans = chain(range(first, lo), rest, range(hi, end))
                    else:
                        spans = range(first, end)
                    for j in spans:
                        i = numbers[j]
                        if self.state[i] == _DONE:
                            continue
                        kind = self.kinds[i]
                        lo, hi = max(a, starts[j]), min(b, starts[j] + kind.nbytes[p])
                        if lo >= hi:
                            continue
                        t = self._streamed.get(i)
                        if t is None:
                            t = self._streamed[i] = _Streamed(kind)
                            self.state[i] = _STREAMED
                        try:
                            t.streams[p].offer(lo - starts[j], view[lo - a : hi - a])
                        except MergepipeError as err:
                            raise MergepipeError(
                                f"indexing in the merge: tensor {self.names[i]!r} of {self.inputs[m].role}: {err}"
                            )
                        touched[i] = t
            ready: list[tuple[int, int, list]] = []
            for i, t in touched.items():
                self._measure(i, t, ready)
            self._measure_ready(ready)

    def _whole_tensors(self, mine: list) -> dict[int, tuple[int, int, list[int]]]:
        """Where every tapped model's request covers the same ranges of one shared layout: the
        tensors no byte of which has come before and that lie wholly in one range are hashed and
        measured here, from the ranges' buffers (no copy). Per range: the span [lo, hi) of tensor
        positions (in file order) looked at, and those in it left to stream."""
        if not self.one_layout or sorted(p for p, *_ in mine) != list(range(len(self.models))):
            return {}
        mine = sorted(mine, key=lambda x: x[0])
        first = mine[0][1]
        if any(req.file != first.file or req.ranges != first.ranges for _, req, _, _ in mine):
            return {}
        starts, ends, numbers = mine[0][3]
        taken: dict[int, tuple[int, int, list[int]]] = {}
        for r, (a, b) in enumerate(first.ranges):
            lo, hi = bisect_left(starts, a), bisect_right(ends, b)
            if lo >= hi:
                continue
            at = [(i, s - a) for i, s in zip(numbers[lo:hi], starts[lo:hi]) if self.state[i] == _NONE]
            streamed = [j for j in range(lo, hi) if self.state[numbers[j]] == _STREAMED] if self._streamed else []
            taken[r] = lo, hi, streamed
            if not at:
                continue
            views = [memoryview(bufs[r]) for _, _, bufs, _ in mine]
            for p, view in enumerate(views):
                column = self.hashes[p]
                for i, o in at:
                    column[i] = hashlib.sha256(view[o : o + self.kinds[i].nbytes[0]]).hexdigest()
            tensors, numbers_, bounds, kinds = [], [], [], []
            for i, o in at:
                self.state[i] = _DONE
                kind = self.kinds[i]
                if not kind.is_float:
                    continue
                rb = kind.row_bytes[0]
                for block, (r0, r1) in enumerate(kind.rows):
                    tensors.append(i)
                    numbers_.append(block)
                    bounds.append((o + r0 * rb, o + r1 * rb))
                    kinds.append(kind.kind)
            for s, e in strips(bounds, kinds, lambda kind: strip_bytes(kind[0])):
                x0, x1 = bounds[s][0], bounds[e - 1][1]
                cut = [(x - x0, y - x0) for x, y in bounds[s:e]]
                self._strip(tensors[s:e], numbers_[s:e], [v[x0:x1] for v in views], [cut] * len(views), kinds[s])
        return taken

    def _measure(self, i: int, t: _Streamed, ready: list) -> None:
        """Every block of streamed tensor `i` whose bytes have all arrived goes to `ready` with its
        bytes of each model; then only what follows them is kept."""
        kind = self.kinds[i]
        rb, rows = kind.row_bytes, kind.rows
        if kind.is_float:
            while t.next < len(rows) and all(s.seen >= rows[t.next][1] * n for s, n in zip(t.streams, rb)):
                r0, r1 = rows[t.next]
                ready.append((i, t.next, [s.take(r0 * n, r1 * n) for s, n in zip(t.streams, rb)]))
                t.next += 1
        for s, n in zip(t.streams, rb):
            # a float tensor keeps from its first unmeasured block; any other needs only its hash
            upto = min(rows[t.next][0] * n, s.seen) if kind.is_float and t.next < len(rows) else s.seen
            s.release(upto)

    def _measure_ready(self, ready: list) -> None:
        """The ready blocks of streamed tensors in order, grouped into strips as the statistics
        pass groups its blocks (their bytes joined where a strip has several)."""
        bounds, at = [], 0
        for _, _, raws in ready:
            bounds.append((at, at + len(raws[0])))
            at += len(raws[0])
        kinds = [self.kinds[i].kind for i, _, _ in ready]
        for first, end in strips(bounds, kinds, lambda kind: strip_bytes(kind[0])):
            group = ready[first:end]
            joined, cuts = [], []
            for p in range(len(self.models)):
                pieces = [raws[p] for _, _, raws in group]
                joined.append(pieces[0] if len(pieces) == 1 else bytearray().join(pieces))
                ends = list(accumulate(len(x) for x in pieces))
                cuts.append(list(zip([0, *ends[:-1]], ends)))
            self._strip([i for i, _, _ in group], [b for _, b, _ in group], joined, cuts, kinds[first])

    def _strip(self, tensors: list[int], numbers: list[int], raws: list, bounds: list, dtypes: tuple) -> None:
        """One strip: blocks `numbers` of tensors `tensors` (by number); each model's bytes of the
        strip in `raws`, its blocks at `bounds` in them. Rows block by block, the experts in turn."""
        raws = [memoryview(r) for r in raws]
        base_raw = raws[0]
        base64, base_sq = base_strip(base_raw, dtypes[0], len(tensors))
        experts = range(1, len(self.models))
        measured = [delta_strip(base_raw, dtypes[0], base64, raws[p], dtypes[p]) for p in experts]
        names = [self.names[i] for i in tensors]
        rows = [self.kinds[i].rows[b] for i, b in zip(tensors, numbers)]
        for col, values in zip(
            BLOCKS_SCHEMA.names,
            (
                names,
                numbers,
                [layer_group(n) for n in names],
                [r0 for r0, _ in rows],
                [r1 for _, r1 in rows],
                [y - x for x, y in bounds[0]],
                base_sq.tolist(),
            ),
        ):
            self.blocks[col].extend(values)
        if not measured:
            return
        per_block = list(zip(*(bounds[p] for p in experts)))  # each block's (x, y) per expert
        for col, values in zip(
            STATS_SCHEMA.names,
            (
                [self.inputs[self.models[p]].model_fp for p in experts] * len(tensors),
                [n for n in names for _ in experts],
                [b for b in numbers for _ in experts],
                [y - x for block in per_block for x, y in block],
                *(np.column_stack([m[c] for m in measured]).reshape(-1).tolist() for c in range(3)),
                [block_hash(raws[p][x:y]) for block in per_block for p, (x, y) in zip(experts, block)],
            ),
        ):
            self.stats[col].extend(values)

    def finish(self, reader, names: list[str]) -> dict:
        """The result, once the experts' non-float buffers (which a merge copies from the base
        and never reads) are read through `reader` (a TappedReader over this tap) for their
        hashes, and found identical to the base's."""
        kept = [n for n in names if not DTYPES[self.inputs[0].tensors[n].dtype].is_float]
        experts = self.models[1:]
        for name in kept:
            for m in experts:
                x = self.inputs[m].tensors[name]
                path = join(self.inputs[m].root, x.file)
                reader.read_batch(
                    [ReadRequest(path, [(x.start, x.start + x.nbytes)], "index", self.inputs[m].role, x.file)]
                )
        result = self.result()
        for name in kept:
            for m in experts:
                if self.sha256(m, name) != self.sha256(0, name):
                    dtype = self.inputs[0].tensors[name].dtype
                    raise BadInput(buffer_differs_message(m - 1, self.inputs[m].uri, name, dtype))
        return result

    def sha256(self, position: int, name: str) -> str | None:
        """A model's (input position) SHA-256 of tensor `name`, once every byte of it has come."""
        p, i = self.models.index(position), self._number[name]
        if self.state[i] == _DONE:
            return self.hashes[p][i]
        t = self._streamed.get(i)
        s = t.streams[p] if t is not None else None
        return s.sha.hexdigest() if s is not None and s.seen == s.nbytes else None

    def result(self) -> dict:
        """What a layer group's task returns: the statistics rows, the base's block rows and each
        model's SHA-256 per tensor, as Arrow tables. Every byte of every tensor must have come by now."""
        with self._lock:
            for i, name in enumerate(self.names):
                if self.state[i] == _DONE:
                    continue
                t = self._streamed.get(i)
                for p, n in enumerate(self.kinds[i].nbytes):
                    seen = t.streams[p].seen if t is not None else 0
                    if seen != n:
                        raise MergepipeError(
                            f"indexing in the merge: tensor {name!r} of {self.inputs[self.models[p]].role}: "
                            f"{seen} of its {n} bytes were read"
                        )
                for p in range(len(self.models)):
                    self.hashes[p][i] = t.streams[p].sha.hexdigest()
                self.state[i] = _DONE
                del self._streamed[i]
            roles = [self.inputs[m].role for m in self.models]
            return {
                "stats": pa.table(self.stats, schema=STATS_SCHEMA),
                "blocks": pa.table(self.blocks, schema=BLOCKS_SCHEMA),
                "sha256": pa.table(
                    [
                        pa.array(np.repeat(np.array(roles, dtype=object), len(self.names))),
                        pa.array(self.names * len(roles)),
                        pa.array([h for column in self.hashes for h in column]),
                    ],
                    schema=HASHES_SCHEMA,
                ),
            }
