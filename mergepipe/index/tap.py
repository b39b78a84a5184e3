"""Block statistics taken from bytes a merge reads anyway: a new family's first merge that reads
every block indexes it in the same pass (no second read of any expert byte).

The tap is handed each batch of bytes as it is read, tensor by tensor, and computes what the
statistics pass (index.stats) computes with the same functions, in strips of equal blocks as
that pass does, so the rows, hashes and content digests are the same as that pass's. Bytes must
come in order within each (model, tensor); bytes seen before (a pass over windows read again)
are skipped. A block is measured once the base's bytes and every indexed expert's bytes of it
have arrived; only the bytes of blocks not yet complete are kept between batches.
"""

from __future__ import annotations

import hashlib
import math
import threading
from bisect import bisect_right
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from mergepipe.config.spec import expert_label
from mergepipe.errors import MergepipeError
from mergepipe.index.blocks import block_rows, layer_group, row_elems
from mergepipe.index.family import Family
from mergepipe.index.stats import (
    BLOCKS_SCHEMA,
    STATS_SCHEMA,
    StatsResult,
    base_strip,
    block_hash,
    content_digest,
    delta_strip,
    strips,
)
from mergepipe.storage.safetensors_format import DTYPES


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
    nbytes: dict[int, int]  # per model
    row_bytes: dict[int, int]

    @classmethod
    def of(cls, shape: tuple[int, ...], kind: tuple[str, ...], models: list[int], block_size: int) -> "_Kind":
        width, sizes = row_elems(shape), [DTYPES[d].itemsize for d in kind]
        return cls(
            kind,
            DTYPES[kind[0]].is_float,
            block_rows(shape, sizes[0], block_size),
            {m: math.prod(shape) * n for m, n in zip(models, sizes)},
            {m: width * n for m, n in zip(models, sizes)},
        )


class _Tensor:
    def __init__(self, name: str, entries: dict, kind: _Kind) -> None:
        self.name = name
        self.layer = layer_group(name)
        self.entries = entries  # input positions: 0 (the base), then each indexed expert
        self.kind, self.is_float, self.rows, self.nbytes, self.row_bytes = kind
        self.streams = {m: _Stream(n) for m, n in self.nbytes.items()}
        self.next = 0  # the first block not yet measured


class StatsTap:
    """Statistics of the indexed experts (input positions `experts`, 1-based as in plan.inputs)
    over the tensors `names`, from bytes fed in as they are read."""

    def __init__(self, inputs: list, experts: list[int], block_size: int, names: list[str]) -> None:
        self.inputs = inputs
        self.experts = experts
        self.models = [0, *experts]
        self._lock = threading.Lock()
        self.tensors: dict[str, _Tensor] = {}
        # Per (input position, file): tensor starts in order, to find the tensors a range spans.
        self._files: dict[tuple[int, str], tuple[list[int], list[str]]] = {}
        self._position = {inp.role: i for i, inp in enumerate(inputs)}
        kinds: dict[tuple, _Kind] = {}
        for name in names:
            entries = {m: inputs[m].tensors[name] for m in self.models}
            key = (entries[0].shape, *[e.dtype for e in entries.values()])
            kind = kinds.get(key)
            if kind is None:
                kind = kinds[key] = _Kind.of(entries[0].shape, key[1:], self.models, block_size)
            self.tensors[name] = _Tensor(name, entries, kind)
        for m in self.models:
            by_file: dict[str, list[tuple[int, int, str]]] = {}
            for name in names:
                e = inputs[m].tensors[name]
                by_file.setdefault(e.file, []).append((e.start, e.start + self.tensors[name].nbytes[m], name))
            for file, starts in by_file.items():
                # Zero-size tensors share their start with the next tensor: by end too, so the
                # last tensor starting at or before a range's start is the one that holds it.
                starts.sort()
                self._files[(m, file)] = ([s for s, _, _ in starts], [n for _, _, n in starts])
        self.stats: dict[str, list] = {f: [] for f in STATS_SCHEMA.names}
        self.blocks: dict[str, list] = {f: [] for f in BLOCKS_SCHEMA.names}

    def feed(self, requests: list, buffers: list[list]) -> None:
        """One batch of reads (storage.reader.ReadRequest and the buffers read for its ranges)."""
        with self._lock:
            touched: dict[str, _Tensor] = {}
            for req, bufs in zip(requests, buffers):
                m = self._position.get(req.model)
                index = self._files.get((m, req.file)) if m is not None else None
                if index is None:
                    continue
                starts, names = index
                for (a, b), buf in zip(req.ranges, bufs):
                    view = memoryview(buf)
                    j = max(0, bisect_right(starts, a) - 1)
                    while j < len(starts) and starts[j] < b:
                        t = self.tensors[names[j]]
                        e = t.entries[m]
                        lo, hi = max(a, e.start), min(b, e.start + t.nbytes[m])
                        if lo < hi:
                            try:
                                t.streams[m].offer(lo - e.start, view[lo - a : hi - a])
                            except MergepipeError as err:
                                raise MergepipeError(f"indexing in the merge: tensor {t.name!r} of {req.model}: {err}")
                            touched[t.name] = t
                        j += 1
            ready: list[tuple[_Tensor, int, list]] = []
            for t in touched.values():
                self._measure(t, ready)
            self._measure_strips(ready)

    def _measure(self, t: _Tensor, ready: list) -> None:
        """Every block of `t` whose bytes have all arrived goes to `ready` with its bytes of
        each model; then only what follows them is kept."""
        rb = t.row_bytes
        if t.is_float:
            while t.next < len(t.rows) and all(s.seen >= t.rows[t.next][1] * rb[m] for m, s in t.streams.items()):
                r0, r1 = t.rows[t.next]
                raws = [t.streams[m].take(r0 * rb[m], r1 * rb[m]) for m in self.models]
                ready.append((t, t.next, raws))
                t.next += 1
        for m, s in t.streams.items():
            # a float tensor keeps from its first unmeasured block; any other needs only its hash
            upto = min(t.rows[t.next][0] * rb[m], s.seen) if t.is_float and t.next < len(t.rows) else s.seen
            s.release(upto)

    def _measure_strips(self, ready: list) -> None:
        """The ready blocks in order, grouped into strips as the statistics pass groups its
        blocks (their bytes joined where a strip has several): rows block by block, the
        experts in turn."""
        ranges, at = [], 0
        for _, _, raws in ready:
            ranges.append((at, at + len(raws[0])))
            at += len(raws[0])
        kinds = [t.kind for t, _, _ in ready]
        for first, end in strips(ranges, [k[0] for k in kinds], kinds):
            self._strip(ready[first:end], kinds[first])

    def _strip(self, group: list, dtypes: tuple) -> None:
        def joined(p: int):
            return group[0][2][p] if len(group) == 1 else bytearray().join(raws[p] for _, _, raws in group)

        base_raw = joined(0)
        base64, base_sq = base_strip(base_raw, dtypes[0], len(group))
        experts = range(1, len(self.models))
        measured = [delta_strip(base_raw, dtypes[0], base64, joined(p), dtypes[p]) for p in experts]
        # Columns extended a strip at a time: block by block, the experts in turn.
        rows = [t.rows[b] for t, b, _ in group]
        for col, values in zip(
            BLOCKS_SCHEMA.names,
            (
                [t.name for t, _, _ in group],
                [b for _, b, _ in group],
                [t.layer for t, _, _ in group],
                [r0 for r0, _ in rows],
                [r1 for _, r1 in rows],
                [len(raws[0]) for _, _, raws in group],
                base_sq.tolist(),
            ),
        ):
            self.blocks[col].extend(values)
        if not measured:
            return
        fps = [self.inputs[self.models[p]].model_fp for p in experts]
        for col, values in zip(
            STATS_SCHEMA.names,
            (
                fps * len(group),
                [t.name for t, _, _ in group for _ in experts],
                [b for _, b, _ in group for _ in experts],
                [len(raws[p]) for _, _, raws in group for p in experts],
                *(np.column_stack([m[c] for m in measured]).reshape(-1).tolist() for c in range(3)),
                [block_hash(raws[p]) for _, _, raws in group for p in experts],
            ),
        ):
            self.stats[col].extend(values)

    def result(self) -> dict:
        """What a layer group's task returns (JSON): the statistics rows, the base's block rows,
        and each model's SHA-256 per tensor. Every byte of every tensor must have come by now."""
        with self._lock:
            for t in self.tensors.values():
                for m, s in t.streams.items():
                    if s.seen != s.nbytes:
                        raise MergepipeError(
                            f"indexing in the merge: tensor {t.name!r} of {self.inputs[m].role}: "
                            f"{s.seen} of its {s.nbytes} bytes were read"
                        )
            return {
                "stats": self.stats,
                "blocks": self.blocks,
                "sha256": {
                    self.inputs[m].role: {n: t.streams[m].sha.hexdigest() for n, t in self.tensors.items()}
                    for m in self.models
                },
            }


def tap_stats(parts: list[dict], family: Family, positions: list[int]) -> StatsResult:
    """The statistics pass's result (index.stats.compute_stats) from every layer group's tap
    result, for the experts at `positions`: the same rows, layout and content digests."""
    stats: dict[str, list] = {f: [] for f in STATS_SCHEMA.names}
    blocks: dict[str, list] = {f: [] for f in BLOCKS_SCHEMA.names}
    hashes: dict[str, dict[str, str]] = {}
    for part in parts:
        for col in stats:
            stats[col].extend(part["stats"][col])
        for col in blocks:
            blocks[col].extend(part["blocks"][col])
        for role, by_tensor in part["sha256"].items():
            hashes.setdefault(role, {}).update(by_tensor)
    result = StatsResult(pa.table(stats, schema=STATS_SCHEMA), pa.table(blocks, schema=BLOCKS_SCHEMA))
    result.content[family.base_fp] = content_digest(hashes["base"], family.base)
    fps = family.expert_fps()
    for i in positions:
        result.content[fps[i]] = content_digest(hashes[expert_label(i)], family.experts[i])
    return result
