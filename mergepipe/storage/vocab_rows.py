"""A model's vocabulary-indexed tensor (its embedding, its head) on the output vocabulary's rows,
made when read from the source rows each output row needs (index/vocabulary decides them, as
mergekit's PermutedVocabulary does): copies of rows (the model's own, or another model's for a
token it lacks), averages of several models' rows, zero rows, and padding rows that are the mean
of the first `n` rows."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mergepipe import torch
from mergepipe.storage.canonical import digest_of
from mergepipe.storage.safetensors_format import DTYPES, TensorPlace, decode

PREFIX = "vocab:"
# The rows read at once to make the mean row: it needs every row below the padding.
SLAB_BYTES = 64 << 20


@dataclass(frozen=True)
class VocabTensor:
    """place: the view's tensor (the output's rows; the dtype the models' promote to);
    sources[m]: model m's tensor (its shard's location, its place); copies: (output row, model,
    source row, rows) runs copied; averages: (output row, ((model, row), ...)) summed in that
    order in the place's dtype and divided by their number; rows below n that neither covers are
    zero, and rows from n on are the mean of rows [0, n)."""

    place: TensorPlace
    sources: tuple[tuple[str, TensorPlace], ...]
    copies: tuple[tuple[int, int, int, int], ...]
    averages: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]
    n: int

    @property
    def name(self) -> str:
        return f"{PREFIX}{digest_of(self.as_json())[:24]}"

    @property
    def width(self) -> int:
        return math.prod(self.place.shape[1:])

    @property
    def row_bytes(self) -> int:
        return self.width * DTYPES[self.place.dtype].itemsize

    @property
    def whole_bytes(self) -> int:
        """What the padding rows' mean is made from (every row below n), read once by a reader
        that reads any padding row."""
        return self.whole_cost([(0, self.place.shape[0])])

    def whole_cost(self, rows: list[tuple[int, int]]) -> int:
        """What reading these row ranges reads once besides their cost(): the rows below n,
        where one of them reaches a padding row."""
        return self.cost(0, self.n) if any(r1 > self.n for _, r1 in rows) else 0

    def needs(self, r0: int, r1: int) -> list[tuple[int, int, int]]:
        """The source rows that output rows [r0, r1) below n are made from, as (model, first
        row, rows) in the order read: the copies, then the averages' rows. (Padding rows, from
        n on, take the mean row, made once from needs(0, n), a slab at a time.)"""
        out = []
        top = min(r1, self.n)
        for o, m, s, length in self.copies:
            a, b = max(o, r0), min(o + length, top)
            if a < b:
                out.append((m, s + a - o, b - a))
        for o, pairs in self.averages:
            if r0 <= o < top:
                out.extend((m, row, 1) for m, row in pairs)
        return out

    def source_range(self, m: int, first: int, rows: int) -> tuple[int, int]:
        place = self.sources[m][1]
        size = math.prod(place.shape[1:]) * DTYPES[place.dtype].itemsize
        return place.start + first * size, place.start + (first + rows) * size

    def cost(self, r0: int, r1: int) -> int:
        """Bytes read to make output rows [r0, r1), the mean row aside (the plan's pair bytes)."""
        return sum(b - a for a, b in (self.source_range(m, s, k) for m, s, k in self.needs(r0, r1)))

    def rows(self, r0: int, r1: int, buffers: list, mean: torch.Tensor | None = None) -> torch.Tensor:
        """Output rows [r0, r1) from the buffers of needs(r0, r1), in its order; `mean` (from
        mean_of) fills the padding rows among them."""
        dtype = DTYPES[self.place.dtype].torch
        got = iter(buffers)

        def source(m: int, k: int) -> torch.Tensor:
            return decode(next(got), self.sources[m][1].dtype, (k, self.width))

        out = torch.zeros((r1 - r0, self.width), dtype=dtype)
        top = min(r1, self.n)
        for o, m, s, length in self.copies:
            a, b = max(o, r0), min(o + length, top)
            if a < b:
                out[a - r0 : b - r0] = source(m, b - a)
        for o, pairs in self.averages:
            if r0 <= o < top:
                acc = torch.zeros(self.width, dtype=dtype)
                for m, _ in pairs:
                    acc = acc + source(m, 1)[0]
                out[o - r0] = acc / len(pairs)
        if r1 > self.n:
            out[max(self.n, r0) - r0 :] = mean
        return out

    def slabs(self) -> list[tuple[int, int]]:
        """Rows [0, n) in slabs of about SLAB_BYTES, the order the mean row sums them in."""
        step = max(1, SLAB_BYTES // self.row_bytes)
        return [(r0, min(r0 + step, self.n)) for r0 in range(0, self.n, step)]

    def add_rows(self, total: torch.Tensor, r0: int, r1: int, buffers: list) -> None:
        """Rows [r0, r1) (from the buffers of needs(r0, r1)) added into `total`, fp64, a row at
        a time in order: the mean row's bits depend on the rows alone, not on the CPU's
        reduction kernels (mergekit: torch.mean)."""
        for row in self.rows(r0, r1, buffers):
            total += row.to(torch.float64)

    def mean_of(self, total: torch.Tensor) -> torch.Tensor:
        """The padding rows' value: the sum of rows [0, n) (add_rows over slabs()) over n."""
        return (total / self.n).to(DTYPES[self.place.dtype].torch)

    def as_json(self) -> dict:
        return {
            "kind": "vocab",
            "place": list(self.place),
            "sources": [[p, list(t)] for p, t in self.sources],
            "copies": [list(c) for c in self.copies],
            "averages": [[o, [list(p) for p in pairs]] for o, pairs in self.averages],
            "n": self.n,
        }

    @classmethod
    def from_json(cls, data: dict) -> "VocabTensor":
        def place(v) -> TensorPlace:
            f, d, s, a, e = v
            return TensorPlace(f, d, tuple(s), a, e)

        return cls(
            place(data["place"]),
            tuple((p, place(t)) for p, t in data["sources"]),
            tuple(tuple(c) for c in data["copies"]),
            tuple((o, tuple(tuple(p) for p in pairs)) for o, pairs in data["averages"]),
            data["n"],
        )
