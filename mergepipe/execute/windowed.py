"""Passes over windows (Form.WINDOWED): an operator that merges in passes over windows of rows
(operators.slabs.Windows: TIES, DARE and the rest of the GTA family) merging a tensor too large
for its group's share. It holds two windows' rows at a time (the one in use, the next being
read) and the first windows kept between passes, within the share (execute.memory.window_plan);
each window's merged rows are written at their place in the output."""

from __future__ import annotations

import math
from typing import Sequence

from mergepipe import torch
from mergepipe.execute.context import GroupContext, TensorReads
from mergepipe.execute.memory import window_plan
from mergepipe.execute.whole import merge_whole
from mergepipe.index.blocks import byte_range
from mergepipe.operators.ranges import slabs_of, windows_of
from mergepipe.operators.slabs import SLAB_ELEMENTS
from mergepipe.storage.reader import ReadRequest
from mergepipe.storage.safetensors_format import DTYPES, decode, encode


def merge_windowed(g: GroupContext, reads: TensorReads) -> None:
    """Merge a large tensor in passes over windows of rows, or whole where the operator needs
    the whole tensor after all (what that reads again counts as `reread`)."""
    name = reads.name
    width = math.prod(g.base.tensors[name].shape[1:])
    elements, keep = window_plan(g.need(name), g.per_group)
    slabs = slabs_of(g.tensor_context(name).block_rows, width, SLAB_ELEMENTS)
    windows = StoredWindows(g, reads, windows_of(slabs, max(1, elements // max(1, width))), keep)
    if merge_windows(g, windows):
        return
    merge_whole(g, reads.again() if windows.read_any else reads)


def merge_windows(g: GroupContext, windows: "StoredWindows") -> bool:
    """A large tensor merged a window of rows at a time (Operator.merge_windows), each window's
    result written at its place in the output. False, with nothing written, where the operator
    needs the whole tensor."""
    name = windows.name
    out_dtype = DTYPES[g.layout.tensors[name].dtype].torch

    def write(first_row: int, rows: torch.Tensor) -> None:
        g.write(name, first_row * windows.width, encode(rows))

    ctx = g.tensor_context(name, nonzero_at_most=tuple(g.plan.nonzero_bounds.get(name, ())))
    return g.op.merge_windows(windows, g.params.for_tensor(name), ctx, out_dtype, write)


# Key of the base's rows among a window's pieces (experts are 0..K-1).
BASE = -1


class StoredWindows:
    """A tensor's base rows and each expert's planned rows, window by window.

    A pass walks the windows in order, so the first windows are kept once read, while they fit
    `keep_bytes` (dropping the least recently used would drop each window just before the next
    pass wants it); the others are read again in each pass. A piece's first read counts in the
    ledger under its role (base, expert), as the plan counted it; any later read of it counts
    as `reread`."""

    def __init__(self, g: GroupContext, reads: TensorReads, rows: list[tuple[int, int]], keep_bytes: int) -> None:
        self.plan, self.name, self.reader = g.plan, reads.name, g.reader
        self.base_request, self.expert_requests = reads.base, reads.experts
        self.runs = reads.runs
        self.rows = rows
        t = g.base.tensors[reads.name]
        self.shape = tuple(t.shape)
        self.k = len(g.experts)
        self.width = math.prod(self.shape[1:])
        self.to_compute = g.to_compute
        self.widens = g.plain(t.dtype)
        self._keep_left = keep_bytes
        self._kept: dict[tuple[int, int], object] = {}  # their buffers go back when the tensor is merged
        self._transient: list = []  # the buffers of the last window's pieces not kept
        self._seen: set[tuple[int, int]] = set()

    @property
    def read_any(self) -> bool:
        return bool(self._seen)

    def load(self, w: int, experts: Sequence[int]) -> tuple[torch.Tensor, dict[int, list]]:
        """Window w's rows of the base and of these experts. What the window loaded before
        this one read and did not keep is no longer used (an operator walks one window at a
        time): its buffers go back to the reader's pool first."""
        self.reader.release(self._transient)
        self._transient = []
        wanted = [BASE, *experts]
        missing = [key for key in wanted if (w, key) not in self._kept]
        got, raws = self._read(w, missing)
        got = dict(zip(missing, got))
        if w + 1 < len(self.rows):  # the next window is read ahead while this one is used
            ahead = [
                self._request(w + 1, key, True)
                for key in wanted
                if (key == BASE or key in self.runs) and (w + 1, key) not in self._kept
            ]
            self.reader.prefetch(ahead)
            self.reader.read_ahead(ahead, first=True)
        for key, value in got.items():
            size = _nbytes(value)
            if size <= self._keep_left:
                self._kept[(w, key)] = value
                self._keep_left -= size
            else:
                self._transient.extend(raws.get(key, ()))
        pieces = {key: self._kept[(w, key)] if (w, key) in self._kept else got[key] for key in wanted}
        return pieces[BASE], {k: pieces[k] for k in experts}

    def _request(self, w: int, key: int, first: bool) -> ReadRequest:
        """The byte ranges of a piece of window w: the base's rows, or an expert's planned rows
        within the window."""
        r0, r1 = self.rows[w]
        model = 0 if key == BASE else key + 1
        t = self.plan.inputs[model].tensors[self.name]
        size = DTYPES[t.dtype].itemsize
        if key == BASE:
            ranges, req = [byte_range(t.start, t.shape, size, r0, r1)], self.base_request
        else:
            ranges = [byte_range(t.start, t.shape, size, a, b) for a, b in self._inside(key, w)]
            req = self.expert_requests[key]
        role = req.role if first else "reread"
        return ReadRequest(req.path, ranges, role, req.model, req.file)

    def _inside(self, k: int, w: int) -> list[tuple[int, int]]:
        r0, r1 = self.rows[w]
        return [(max(a, r0), min(b, r1)) for a, b in self.runs.get(k, ()) if a < r1 and b > r0]

    def _read(self, w: int, keys: list[int]) -> tuple[list[object], dict[int, list]]:
        """The pieces of window w for these keys, and the buffers read for each."""
        keys_read = [key for key in keys if key == BASE or self._inside(key, w)]
        requests = []
        for key in keys_read:
            requests.append(self._request(w, key, first=(w, key) not in self._seen))
            self._seen.add((w, key))
        raws = dict(zip(keys_read, self.reader.read_batch(requests)))
        out = []
        for key in keys:
            if key == BASE:
                r0, r1 = self.rows[w]
                out.append(decode(raws[key][0], self.plan.inputs[0].tensors[self.name].dtype, (r1 - r0, self.width)))
                continue
            dtype = self.plan.inputs[key + 1].tensors[self.name].dtype
            runs = self._inside(key, w)
            out.append(
                [((a, b), decode(raw, dtype, (b - a, self.width))) for (a, b), raw in zip(runs, raws.get(key, ()))]
            )
        return out, raws


def _nbytes(value) -> int:
    if isinstance(value, list):
        return sum(v.numel() * v.element_size() for _, v in value)
    return value.numel() * value.element_size()
