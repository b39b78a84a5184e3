"""Block statistics: the one full pass over each expert, streamed in runs of blocks.

Per (expert, block): bytes, delta_sq = sum((x - b)^2) in fp64, max |delta|, the number of
elements that differ (as values, or as signed zeros), and the block's content hash (XXH3-128:
it identifies a block's bytes, it guards nothing, and a cryptographic hash here cost more than
the statistics). Per base block: its energy sum(b^2), for plans that rank a delta against the
weights it changes. With a calibration of the base, per (expert, block) of each tensor it
reached: the delta's activation-weighted energy (weighted_energy). The same pass hashes every
tensor with SHA-256, which gives each model a content digest that does not depend on where the
files live or on the block size.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from mergepipe import torch
from mergepipe.catalog.calibration import ACTIVATION_SCHEMA, TensorWeights
from mergepipe.config.spec import expert_label
from mergepipe.errors import BadInput
from mergepipe.index.blocks import block_rows, layer_group, row_elems
from mergepipe.index.family import Family
from mergepipe.operators.ranges import chunk_blocks, strips
from mergepipe.storage.canonical import json_bytes, sha256_hex
from mergepipe.storage.location import ContextPool
from mergepipe.storage.model_files import ModelFiles
from mergepipe.storage.reader import RangeReader, ReadRequest
from mergepipe.storage.safetensors_format import DTYPES, decode

STATS_SCHEMA = pa.schema(
    [
        ("expert_fp", pa.string()),
        ("tensor", pa.string()),
        ("block", pa.int32()),
        ("bytes", pa.int64()),
        ("delta_sq", pa.float64()),
        ("max_abs_delta", pa.float64()),
        ("nnz_delta", pa.int64()),
        ("content_hash", pa.string()),
    ]
)
BLOCKS_SCHEMA = pa.schema(
    [
        ("tensor", pa.string()),
        ("block", pa.int32()),
        ("layer", pa.string()),
        ("row_start", pa.int64()),
        ("row_end", pa.int64()),
        ("base_bytes", pa.int64()),
        ("base_sq", pa.float64()),  # sum(b^2) in fp64: the base block's energy (rank_by: delta_over_sqrt_base)
    ]
)


_INT_OF_WIDTH = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


class _Scratch(threading.local):
    """Each thread's fp64 work arrays, kept from strip to strip: a fresh array per strip costs
    more in page faults (the kernel zeroing its pages) than the statistics cost."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def get(self, slot: str, n: int) -> np.ndarray:
        a = self.arrays.get(slot)
        if a is None or a.size < n:
            a = self.arrays[slot] = np.empty(n, dtype=np.float64)
        return a[:n]


_SCRATCH = _Scratch()


def _widen(t: torch.Tensor, out: np.ndarray) -> np.ndarray:
    """`t` in fp64, written into `out` (flat, of t's size): the values `t.double()` gives."""
    view = out.reshape(t.shape)
    torch.from_numpy(view).copy_(t)
    return view


def base_strip(raw, dtype: str, count: int, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`count` base blocks of one size stored one after another as `raw`: in fp64, as a
    (count, elements) array shared by every expert's statistics (written into `out` where
    given, else into this thread's scratch), and each block's energy sum(b^2). numpy sums
    along a row pairwise and single-threaded, as it sums one block, so the statistics (and
    the plans ranked on them) depend neither on how blocks are grouped nor on the machine's
    thread count."""
    t = decode(raw, dtype, (count, -1))
    base64 = _widen(t, _SCRATCH.get("base", t.numel()) if out is None else out)
    return base64, np.square(base64, out=_SCRATCH.get("square", t.numel()).reshape(t.shape)).sum(axis=1)


def delta_strip(
    base_raw,
    base_dtype: str,
    base64: np.ndarray,
    raw,
    dtype: str,
    weigh: Callable[[np.ndarray], None] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per block of a strip (the expert's bytes `raw` of the blocks of `base64`, one after
    another): the sum of squares, max abs and count of differing elements of expert - base,
    in fp64. An element differs when its bits differ (so +0 against -0 counts, as reading it
    changes the output's bits). A block whose delta is NaN or Inf has no finite norm: it is
    recorded as +inf (at least one element differing), so the planner can never leave it out;
    the config decides (allow_nonfinite) whether such a family may be merged at all. `weigh`,
    where given, is handed the blocks' squared deltas (count, n) before they are summed."""
    count, n = base64.shape
    expert = decode(raw, dtype, (count, n))
    d = _widen(expert, _SCRATCH.get("delta", count * n))  # the steps below work in place
    np.subtract(d, base64, out=d)
    if dtype == base_dtype:
        width = _INT_OF_WIDTH[DTYPES[dtype].itemsize]
        differs = np.count_nonzero(
            np.frombuffer(raw, width).reshape(count, n) != np.frombuffer(base_raw, width).reshape(count, n), axis=1
        )
    else:  # stored in another dtype: compare values (and signs of zeros)
        signs = torch.signbit(expert) != torch.signbit(decode(base_raw, base_dtype, (count, n)))
        differs = np.count_nonzero((d != 0) | signs.numpy(), axis=1)
    max_abs = np.maximum(np.abs(d.max(axis=1)), np.abs(d.min(axis=1)))  # NaN in, NaN out
    np.square(d, out=d)
    if weigh is not None:
        weigh(d)
    sq = d.sum(axis=1)
    bad = ~(np.isfinite(sq) & np.isfinite(max_abs))
    if bad.any():
        sq[bad], max_abs[bad] = math.inf, math.inf
        differs = np.where(bad, np.maximum(differs, 1), differs)
    return sq, max_abs, differs.astype(np.int64)


def weighted_energy(
    squares: np.ndarray, names: list[str], rows: list[tuple[int, int]], weights: dict[str, TensorWeights]
) -> np.ndarray:
    """Per block (a row of `squares`: the squared delta of rows [r0, r1) of its tensor): the
    sum over its rows r and columns j of delta[r, j]^2 * (E[x_j^2] * o_r + t_r), the expected
    energy its delta adds to the layer's output per token (its columns weighted where a linear
    layer reads the tensor, its rows where an embedding looks them up: t_r the token's
    frequency), each output channel scaled by its relative gradient moment o_r where the
    calibration took gradients (1 where not). NaN where the calibration did not reach the
    tensor, or its weights do not fit the block's shape. Summed by numpy elementwise and
    pairwise, never through BLAS: the same bits on every CPU."""
    out = np.full(len(names), np.nan)
    for i, (name, (r0, r1)) in enumerate(zip(names, rows)):
        w = weights.get(name)
        if w is None or r1 <= r0:
            continue
        block = squares[i].reshape(r1 - r0, -1)
        if (
            (w.columns is not None and w.columns.size != block.shape[1])
            or (w.rows is not None and w.rows.size < r1)
            or (w.outputs is not None and w.outputs.size < r1)
        ):
            continue
        energy = 0.0
        if w.columns is not None:
            per_row = np.multiply(block, w.columns).sum(axis=1)
            if w.outputs is not None:
                per_row = np.multiply(per_row, w.outputs[r0:r1])
            energy += float(per_row.sum())
        if w.rows is not None:
            energy += float(np.multiply(block.sum(axis=1), w.rows[r0:r1]).sum())
        out[i] = energy
    return out


def block_hash(raw) -> str:
    """The content hash of a block's stored bytes."""
    return xxhash.xxh3_128_hexdigest(raw)


def content_digest(tensor_hashes: dict[str, str], model: ModelFiles) -> str:
    """SHA-256 of json_bytes({name: [dtype, shape, tensor hash]}) over the model's tensors."""
    entries = {name: (loc.dtype, loc.shape, tensor_hashes[name]) for name, loc in model.tensors.items()}
    return sha256_hex(json_bytes(entries, floats=False))


@dataclass
class StatsResult:
    """Statistics of the experts that were indexed, and the content digests learnt on the way."""

    stats: pa.Table
    blocks: pa.Table  # the base's block layout
    content: dict[str, str] = field(default_factory=dict)  # model fingerprint -> content digest
    # With a calibration's weights: (expert_fp, tensor, block, act_sq) of the blocks it reached.
    activation: pa.Table | None = None


# The pass reads every byte anyway: it fetches runs of whole blocks of about this size at once
# (one request per model per run, concurrent on object stores) and cuts them into blocks in memory.
READ_CHUNK = 8 * 1024 * 1024
# Runs read ahead of the one being measured, each on its own thread.
READ_AHEAD = 3


# A strip's fp64 arrays hold about this many elements at most (2 MiB each, at least one block):
# larger ones fall out of the CPU's cache between the steps that sweep them.
STRIP_ELEMENTS = 1 << 18


def strip_bytes(dtype: str) -> int:
    """The most bytes of a strip of blocks of this dtype (ranges.strips)."""
    return STRIP_ELEMENTS * DTYPES[dtype].itemsize


class _Blocks:
    """The float blocks of one batch, in file order: each one's tensor, number and rows, and
    its byte range in each model's chunk of the batch (base first)."""

    def __init__(self, models: int) -> None:
        self.names: list[str] = []
        self.numbers: list[int] = []
        self.rows: list[tuple[int, int]] = []
        self.ranges: list[list[tuple[int, int]]] = [[] for _ in range(models)]
        self.tensor_bytes: list[list[tuple[str, memoryview]]] = [[] for _ in range(models)]  # each run's bytes

    def add(self, run: "BlockRun", batch: "Batch", chunks: list[memoryview]) -> None:
        self.names.extend([run.name] * len(run.run))
        self.numbers.extend(run.run)
        self.rows.extend(run.rows)
        for p, (per_block, request) in enumerate(zip(run.per_model, batch.requests)):
            origin = request.ranges[0][0]
            self.ranges[p].extend((a - origin, b - origin) for a, b in per_block)
            self.tensor_bytes[p].append((run.name, chunks[p]))


def _expert_stats(
    model: ModelFiles,
    chunk: memoryview,
    blocks: _Blocks,
    p: int,
    base_strips: list,
    hashers: dict,
    weights: dict[str, TensorWeights] | None,
) -> tuple:
    """One expert's statistics of every float block of a batch (and its tensors' hashes).
    Runs in a worker thread: hashlib, xxhash and numpy release the GIL on large buffers."""
    for name, view in blocks.tensor_bytes[p]:
        hashers[name].update(view)
    ranges = blocks.ranges[p]
    dtypes = [model.tensors[n].dtype for n in blocks.names]
    n = len(ranges)
    sq, mx, nnz = np.empty(n), np.empty(n), np.empty(n, dtype=np.int64)
    act = np.full(n, np.nan) if weights else None

    def weigher(at: slice) -> Callable[[np.ndarray], None] | None:
        if act is None or not any(name in weights for name in blocks.names[at]):
            return None

        def weigh(squares: np.ndarray) -> None:
            act[at] = weighted_energy(squares, blocks.names[at], blocks.rows[at], weights)

        return weigh

    for first, end, base_dtype, base_raw, base64 in base_strips:
        size = len(base_raw) // (end - first)
        for g, h in strips(ranges[first:end], dtypes[first:end], strip_bytes):
            at = slice(first + g, first + h)
            sq[at], mx[at], nnz[at] = delta_strip(
                base_raw[g * size : h * size],
                base_dtype,
                base64[g:h],
                chunk[ranges[first + g][0] : ranges[first + h - 1][1]],
                dtypes[first + g],
                weigh=weigher(at),
            )
    if act is not None:
        act[np.isinf(sq) & ~np.isnan(act)] = math.inf  # a non-finite delta: never left out
    hashes = [block_hash(chunk[a:b]) for a, b in ranges]
    sizes = [b - a for a, b in ranges]
    if model.virtual:  # a made tensor's block costs what it is made from (storage.virtual)
        for i, name in enumerate(blocks.names):
            recipe = model.virtual.get(model.tensors[name].file)
            if recipe is not None:
                sizes[i] = recipe.cost(*blocks.rows[i])
    return sizes, sq, mx, nnz, hashes, act


def _measure_batch(
    family: Family,
    experts: list,
    blocks: _Blocks,
    chunks: list[memoryview],
    hashers: list,
    pool,
    weights: dict[str, TensorWeights] | None,
) -> tuple[pa.RecordBatch, pa.RecordBatch | None, pa.RecordBatch | None]:
    """The base's layout rows of one batch's float blocks, and the experts' statistics rows
    (block by block, the experts in turn)."""
    base_dtypes = [family.base.tensors[n].dtype for n in blocks.names]
    base_strips, base_sq = [], []
    # The batch's base in fp64, held while the experts' jobs use it (the next batch reuses it).
    elements = [(b - a) // DTYPES[dt].itemsize for (a, b), dt in zip(blocks.ranges[0], base_dtypes)]
    held, at = _SCRATCH.get("batch", sum(elements)), 0
    for first, end in strips(blocks.ranges[0], base_dtypes, strip_bytes):
        raw = chunks[0][blocks.ranges[0][first][0] : blocks.ranges[0][end - 1][1]]
        n = sum(elements[first:end])
        base64, energy = base_strip(raw, base_dtypes[first], end - first, held[at : at + n])
        at += n
        base_strips.append((first, end, base_dtypes[first], raw, base64))
        base_sq.append(energy)
    futures = [
        pool.submit(_expert_stats, model, chunks[p], blocks, p, base_strips, hashers[p], weights)
        for p, (_, model, _) in enumerate(experts, start=1)
    ]
    layout = pa.record_batch(
        [
            blocks.names,
            blocks.numbers,
            [layer_group(n) for n in blocks.names],
            [r0 for r0, _ in blocks.rows],
            [r1 for _, r1 in blocks.rows],
            [b - a for a, b in blocks.ranges[0]],
            np.concatenate(base_sq),
        ],
        schema=BLOCKS_SCHEMA,
    )
    per_expert = [f.result() for f in futures]
    if not per_expert:
        return layout, None, None
    k = len(per_expert)
    fps = [fp for _, _, fp in experts] * len(blocks.names)
    names = np.repeat(np.array(blocks.names, dtype=object), k)
    numbers = np.repeat(np.array(blocks.numbers, dtype=np.int32), k)
    stats = pa.record_batch(
        [
            fps,
            names,
            numbers,
            *(np.column_stack([e[c] for e in per_expert]).reshape(-1) for c in range(4)),
            [h for row in zip(*(e[4] for e in per_expert)) for h in row],
        ],
        schema=STATS_SCHEMA,
    )
    if weights is None:
        return layout, stats, None
    act = np.column_stack([e[5] for e in per_expert]).reshape(-1)
    reached = ~np.isnan(act)
    activation = pa.record_batch(
        [pa.array(fps).filter(reached), names[reached], numbers[reached], act[reached]], schema=ACTIVATION_SCHEMA
    )
    return layout, stats, activation


def compute_stats(
    family: Family,
    expert_positions: list[int],
    block_size: int,
    reader: RangeReader,
    *,
    progress: Callable[[int], None] | None = None,
    planned: Callable[[], None] | None = None,
    weights: dict[str, TensorWeights] | None = None,
) -> StatsResult:
    """Stream the base once and each listed expert once; return their block statistics (and,
    given a calibration's weights, their activation energies). `planned` is called once the
    reads are planned, before any is made.

    Each run of blocks is read for all models at once, consecutive runs of small tensors
    together (one read per model per batch). The base's blocks are converted once per batch,
    in strips of equal blocks; each expert's statistics and hashes are then computed in
    parallel threads, one job per expert and batch, strip by strip (a batch of many small
    tensors would otherwise cost numpy calls and a thread hand-off per tensor), and their rows
    gathered in a fixed order: block by block, the experts in turn."""
    stats: list[pa.RecordBatch] = []
    layout: list[pa.RecordBatch] = []
    activation: list[pa.RecordBatch] = []
    fps = family.expert_fps()
    experts = [(i, family.experts[i], fps[i]) for i in expert_positions]
    models = [("base", "base", family.base)] + [(expert_label(i), "expert", m) for i, m, _ in experts]
    hashers = [{n: hashlib.sha256() for n in family.base.tensors} for _ in models]
    batches = list(_batches(list(_block_runs(family, models, block_size)), models))
    if planned:
        planned()
    # The next batches are read while this one is measured: a cold disk needs several requests in
    # flight to approach its sequential rate.
    with (
        ContextPool(max_workers=max(1, len(os.sched_getaffinity(0)))) as pool,
        ContextPool(READ_AHEAD) as ahead,
    ):
        pending = deque(ahead.submit(b.read, reader) for b in batches[:READ_AHEAD])
        for i, batch in enumerate(batches):
            read = pending.popleft().result()
            batch_chunks = [memoryview(bufs[0]) for bufs in read]
            if i + READ_AHEAD < len(batches):
                pending.append(ahead.submit(batches[i + READ_AHEAD].read, reader))
            blocks = _Blocks(len(models))
            for run in batch.runs:
                chunks = [
                    c[a - b.ranges[0][0] : e - b.ranges[0][0]]
                    for c, (_, a, e), b in zip(batch_chunks, run.spans, batch.requests)
                ]
                hashers[0][run.name].update(chunks[0])
                if run.dt.is_float:
                    blocks.add(run, batch, chunks)
                else:
                    _check_buffers(experts, run.name, run.info.dtype, chunks[0], chunks[1:], hashers[1:])
            if blocks.names:
                rows, measured, weighed = _measure_batch(family, experts, blocks, batch_chunks, hashers, pool, weights)
                layout.append(rows)
                if measured is not None:
                    stats.append(measured)
                if weighed is not None:
                    activation.append(weighed)
            if progress:
                progress(sum(len(c) for c in batch_chunks[1:]))
            reader.release([bufs[0] for bufs in read])  # measured: the mappings serve later batches
    _SCRATCH.arrays.clear()  # the pool's threads took theirs with them
    result = StatsResult(
        pa.Table.from_batches(stats, schema=STATS_SCHEMA).combine_chunks(),
        pa.Table.from_batches(layout, schema=BLOCKS_SCHEMA).combine_chunks(),
        activation=None
        if weights is None
        else pa.Table.from_batches(activation, schema=ACTIVATION_SCHEMA).combine_chunks(),
    )
    result.content[family.base_fp] = content_digest({n: h.hexdigest() for n, h in hashers[0].items()}, family.base)
    for (i, model, fp), h in zip(experts, hashers[1:]):
        result.content[fp] = content_digest({n: x.hexdigest() for n, x in h.items()}, model)
    return result


class BlockRun(NamedTuple):
    name: str
    info: object  # the base's TensorPlace
    dt: object  # its DTYPES entry
    run: tuple[int, ...]  # block numbers
    spans: tuple[tuple[str, int, int], ...]  # per model (base first, then the experts): file, start, end
    rows: tuple[tuple[int, int], ...]  # each block's rows
    per_model: tuple[tuple[tuple[int, int], ...], ...]  # each model's byte range per block


class Batch(NamedTuple):
    runs: list[BlockRun]
    requests: list[ReadRequest]  # one range per model, spanning every run of the batch

    def read(self, reader: RangeReader) -> list[list]:
        """The batch's bytes, each model's; a model whose range is the base's own bytes (a LoRA
        view's unchanged tensors, its model being the base) takes the base's, read once."""
        base = self.requests[0]
        unique = [k for k, r in enumerate(self.requests) if k == 0 or (r.path, r.ranges) != (base.path, base.ranges)]
        got = dict(zip(unique, reader.read_batch([self.requests[k] for k in unique])))
        return [got.get(k, got[0]) for k in range(len(self.requests))]


def _batches(runs: list[BlockRun], models: list, limit: int = READ_CHUNK) -> Iterator[Batch]:
    """Consecutive runs (of small tensors, typically) read together: while every model's next
    run starts in the same file where its last one ended, up to `limit` bytes of the base."""
    group: list[BlockRun] = []
    size = 0
    for run in runs:
        n = run.spans[0][2] - run.spans[0][1]
        if (
            group
            and size + n <= limit
            and all(f == last[0] and a == last[2] for (f, a, _), last in zip(run.spans, group[-1].spans))
        ):
            group.append(run)
            size += n
            continue
        if group:
            yield _batch(group, models)
        group, size = [run], n
    if group:
        yield _batch(group, models)


def _batch(runs: list[BlockRun], models: list) -> Batch:
    requests = [
        ReadRequest(m.path(file), [(start, last[2])], role, label, file)
        for (label, role, m), (file, start, _), last in zip(models, runs[0].spans, runs[-1].spans)
    ]
    return Batch(runs, requests)


def _block_runs(family: Family, models: list, block_size: int) -> Iterator[BlockRun]:
    """Every run of blocks to read, tensor by tensor in file order (near-sequential on a cold
    disk)."""
    order = sorted(family.base.tensors, key=lambda n: (family.base.tensors[n].file, family.base.tensors[n].start))
    for name in order:
        info = family.base.tensors[name]
        dt = DTYPES[info.dtype]
        blocks = block_rows(info.shape, dt.itemsize, block_size)
        locations = [m.tensors[name] for _, _, m in models]
        per_row = [row_elems(info.shape) * DTYPES[loc.dtype].itemsize for loc in locations]
        for run in chunk_blocks(blocks, per_row[0], READ_CHUNK):
            # Tuples of ints and strings throughout: the cycle collector stops tracking them at
            # its first look, so a plan of 100k tensors does not keep it rescanning them.
            rows = tuple([blocks[b] for b in run])
            per_model = tuple(
                [
                    tuple([(loc.start + r0 * n, loc.start + r1 * n) for r0, r1 in rows])
                    for loc, n in zip(locations, per_row)
                ]
            )
            spans = tuple([(loc.file, r[0][0], r[-1][1]) for loc, r in zip(locations, per_model)])
            yield BlockRun(name, info, dt, tuple(run), spans, rows, per_model)


def _check_buffers(experts, name: str, dtype: str, base_chunk: bytearray, chunks: list[bytearray], hashers) -> None:
    """Non-float tensors (int buffers) must be identical across the family; they are hashed
    but have no statistics."""
    for (i, model, _), chunk, h in zip(experts, chunks, hashers):
        h[name].update(chunk)
        if chunk != base_chunk:
            raise BadInput(buffer_differs_message(i, model.uri, name, dtype))


def buffer_differs_message(expert: int, uri: str, name: str, dtype: str) -> str:
    return (
        f"expert {expert} ({uri}): tensor {name!r} is a {dtype} buffer that differs "
        "from the base; non-float tensors must be identical across the family"
    )


def first_nonfinite(result: StatsResult, family: Family) -> str | None:
    """A message naming the first (expert, tensor, block) whose delta is NaN or Inf, if any."""
    stats = result.stats.filter(pc.is_inf(result.stats["delta_sq"]))
    if stats.num_rows == 0:
        return None
    position = {fp: i for i, fp in reversed(list(enumerate(family.expert_fps())))}
    fp, tensor, block = min(
        zip(stats["expert_fp"].to_pylist(), stats["tensor"].to_pylist(), stats["block"].to_pylist()),
        key=lambda r: (position[r[0]], r[1], r[2]),
    )
    return nonfinite_message(position[fp], family.experts[position[fp]].uri, tensor, block)


def nonfinite_message(expert: int, uri: str, tensor: str, block: int) -> str:
    return (
        f"expert {expert} ({uri}): tensor {tensor!r} block {block} has a non-finite delta (NaN or Inf); "
        "set allow_nonfinite: true in the config to merge it anyway"
    )
