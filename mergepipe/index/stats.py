"""Block statistics: the one full pass over each expert, streamed in runs of blocks.

Per (expert, block): bytes, delta_sq = sum((x - b)^2) in fp64, max |delta|, the number of
elements that differ (as values, or as signed zeros), and the block's content hash (XXH3-128:
it identifies a block's bytes, it guards nothing, and a cryptographic hash here cost more than
the statistics). Per base block: its energy sum(b^2), for plans that rank a delta against the
weights it changes. The same pass hashes every tensor with SHA-256, which gives each model a
content digest that does not depend on where the files live or on the block size.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from mergepipe import torch
from mergepipe.config.spec import expert_label
from mergepipe.errors import BadInput
from mergepipe.index.blocks import block_rows, byte_range, layer_group, row_elems
from mergepipe.index.family import Family
from mergepipe.storage.canonical import digest_of
from mergepipe.storage.model_files import ModelFiles
from mergepipe.storage.reader import RangeReader, ReadRequest
from mergepipe.storage.safetensors_format import DTYPES, decode

# Changes when the pass's result changes shape (2: base block energies), so cached results of
# an earlier release are not reused.
STATS_FORMAT = 2
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


_INT_OF_WIDTH = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def delta_stats(base: torch.Tensor, expert: torch.Tensor, base64: np.ndarray | None = None) -> tuple[float, float, int]:
    """(sum of squares, max abs, count of differing elements) of expert - base, in fp64.

    `base64` is the base block in fp64 (flat), converted once and shared by every expert.
    numpy's pairwise sum is single-threaded, so the statistics (and the plans ranked on them)
    do not depend on the machine's thread count. An element differs when its bits differ
    (so +0 against -0 counts, as reading it changes the output's bits)."""
    if expert.numel() == 0:
        return 0.0, 0.0, 0
    if base64 is None:
        base64 = base.double().numpy().reshape(-1)
    d = expert.double().numpy().reshape(-1)  # a fresh array: the steps below work in place
    np.subtract(d, base64, out=d)
    if expert.dtype == base.dtype:
        width = getattr(torch, _INT_OF_WIDTH[expert.element_size()])
        differs = int(np.count_nonzero(expert.view(width).numpy() != base.view(width).numpy()))
    else:  # stored in another dtype: compare values (and signs of zeros)
        differs = int(((d != 0) | (torch.signbit(expert) != torch.signbit(base)).numpy().reshape(-1)).sum())
    max_abs = max(abs(float(d.max())), abs(float(d.min())))  # NaN in, NaN out (numpy's max and min propagate it)
    return float(np.square(d, out=d).sum()), max_abs, differs


def content_digest(tensor_hashes: dict[str, str], model: ModelFiles) -> str:
    return digest_of(
        {
            name: [loc.info.dtype, list(loc.info.shape), tensor_hashes[name]]
            for name, loc in sorted(model.tensors.items())
        }
    )


@dataclass
class StatsResult:
    """Statistics of the experts that were indexed, and the content digests learnt on the way."""

    stats: pa.Table
    blocks: pa.Table  # the base's block layout
    content: dict[str, str] = field(default_factory=dict)  # model fingerprint -> content digest


# The pass reads every byte anyway: it fetches runs of whole blocks of about this size at once
# (one request per model per run, concurrent on object stores) and cuts them into blocks in memory.
READ_CHUNK = 8 * 1024 * 1024
# Runs read ahead of the one being measured, each on its own thread.
READ_AHEAD = 3


def chunk_blocks(blocks: list[tuple[int, int]], row_bytes: int, chunk: int = READ_CHUNK) -> list[list[int]]:
    """Consecutive block numbers grouped into runs of at most `chunk` bytes (at least one block)."""
    runs: list[list[int]] = []
    size = 0
    for b, (r0, r1) in enumerate(blocks):
        n = (r1 - r0) * row_bytes
        if runs and size + n <= chunk:
            runs[-1].append(b)
            size += n
        else:
            runs.append([b])
            size = n
    return runs


def _block_ranges(model: ModelFiles, name: str, blocks: list[tuple[int, int]]) -> list[tuple[int, int]]:
    info = model.tensors[name].info
    return [byte_range(info.start, info.shape, DTYPES[info.dtype].itemsize, r0, r1) for r0, r1 in blocks]


def decode_block(dtype: str, shape: tuple[int, ...], rows: tuple[int, int], raw) -> torch.Tensor:
    """Rows [r0, r1) of a tensor of `shape`, stored as `raw` (writable: decoded in place)."""
    return decode(raw, dtype, (rows[1] - rows[0], *shape[1:]) if shape else ())


def _decode_block(model: ModelFiles, name: str, rows: tuple[int, int], raw: bytearray) -> torch.Tensor:
    info = model.tensors[name].info
    return decode_block(info.dtype, tuple(info.shape), rows, raw)


def base_block(base_t: torch.Tensor) -> tuple[np.ndarray, float]:
    """A base block in fp64 (flat, shared by every expert's statistics) and its energy sum(b^2)."""
    base64 = base_t.double().numpy().reshape(-1)
    return base64, float(np.square(base64).sum())  # pairwise, single-threaded: as delta_sq


def expert_block_row(
    fp: str, name: str, b: int, raw, expert_t: torch.Tensor, base_t: torch.Tensor, base64: np.ndarray
) -> tuple:
    """One (expert, block) row of STATS_SCHEMA from the block's stored bytes and its values."""
    sq, mx, nnz = delta_stats(base_t, expert_t, base64)
    if not (math.isfinite(sq) and math.isfinite(mx)):
        # NaN or Inf: the block's delta has no finite norm. Recorded as +inf so the planner
        # can never leave it out; the config decides (allow_nonfinite) whether such a
        # family may be merged at all.
        sq, mx, nnz = math.inf, math.inf, max(nnz, 1)
    return (fp, name, b, len(raw), sq, mx, nnz, xxhash.xxh3_128_hexdigest(raw))


def _expert_rows(
    model: ModelFiles,
    fp: str,
    name: str,
    run: list[int],
    rows: list[tuple[int, int]],
    chunk: bytearray,
    ranges: list[tuple[int, int]],
    bases: list[tuple[torch.Tensor, np.ndarray]],
    hasher,
) -> list[tuple]:
    """One expert's statistics rows for one run of blocks of a float tensor (hashing as it
    goes). Runs in a worker thread: hashlib, xxhash and numpy release the GIL on large buffers."""
    out = []
    for j, (b, block) in enumerate(zip(run, rows)):
        # A view, not a copy: writable (the chunk is a bytearray), so decode views it in place.
        raw = memoryview(chunk)[ranges[j][0] - ranges[0][0] : ranges[j][1] - ranges[0][0]]
        hasher.update(raw)
        base_t, base64 = bases[j]
        out.append(expert_block_row(fp, name, b, raw, _decode_block(model, name, block, raw), base_t, base64))
    return out


def _expert_batch(model: ModelFiles, fp: str, jobs: list, position: int, hashers: dict) -> list[list[tuple]]:
    """One expert's statistics rows for every float run of a batch, in order."""
    return [
        _expert_rows(
            model, fp, run.name, run.run, run.rows, chunks[position], run.per_model[position], bases, hashers[run.name]
        )
        for run, chunks, bases in jobs
    ]


def compute_stats(
    family: Family,
    expert_positions: list[int],
    block_size: int,
    reader: RangeReader,
    *,
    progress: Callable[[int], None] | None = None,
) -> StatsResult:
    """Stream the base once and each listed expert once; return their block statistics.

    Each run of blocks is read for all models at once, consecutive runs of small tensors
    together (one read per model per batch); the experts' statistics and hashes are then
    computed in parallel threads, one job per expert and batch, and their rows gathered in a
    fixed order."""
    cols: dict[str, list] = {f.name: [] for f in STATS_SCHEMA}
    layout: dict[str, list] = {f.name: [] for f in BLOCKS_SCHEMA}
    fps = family.expert_fps()
    experts = [(i, family.experts[i], fps[i]) for i in expert_positions]
    models = [("base", "base", family.base)] + [(expert_label(i), "expert", m) for i, m, _ in experts]
    hashers = [{n: hashlib.sha256() for n in family.base.tensors} for _ in models]
    batches = list(_batches(list(_block_runs(family, models, block_size))))
    # The next batches are read while this one is measured: a cold disk needs several requests in
    # flight to approach its sequential rate.
    with (
        ThreadPoolExecutor(max_workers=max(1, len(os.sched_getaffinity(0)))) as pool,
        ThreadPoolExecutor(READ_AHEAD) as ahead,
    ):
        pending = deque(ahead.submit(reader.read_batch, b.requests) for b in batches[:READ_AHEAD])
        for i, batch in enumerate(batches):
            batch_chunks = [bufs[0] for bufs in pending.popleft().result()]
            if i + READ_AHEAD < len(batches):
                pending.append(ahead.submit(reader.read_batch, batches[i + READ_AHEAD].requests))
            jobs = []  # (run, its chunks, the base blocks) of each float tensor's run in the batch
            for run in batch.runs:
                chunks = [
                    memoryview(c)[r.ranges[0][0] - b.ranges[0][0] : r.ranges[0][1] - b.ranges[0][0]]
                    for c, r, b in zip(batch_chunks, run.requests, batch.requests)
                ]
                name, dt, per_model = run.name, run.dt, run.per_model
                base_raws = [chunks[0][r0 - per_model[0][0][0] : r1 - per_model[0][0][0]] for r0, r1 in per_model[0]]
                for raw in base_raws:
                    hashers[0][name].update(raw)
                if not dt.is_float:
                    _check_buffers(experts, name, run.info.dtype, chunks[0], chunks[1:], hashers[1:])
                    continue
                bases = []
                for b, block, raw in zip(run.run, run.rows, base_raws):
                    base_t = _decode_block(family.base, name, block, raw)
                    base64, base_sq = base_block(base_t)
                    bases.append((base_t, base64))
                    for col, value in zip(
                        BLOCKS_SCHEMA.names, (name, b, layer_group(name), block[0], block[1], len(raw), base_sq)
                    ):
                        layout[col].append(value)
                jobs.append((run, chunks, bases))
            # One job per expert for the whole batch (a batch of many small tensors would
            # otherwise cost a thread hand-off per tensor and expert).
            futures = [
                pool.submit(_expert_batch, model, fp, jobs, e + 1, hashers[e + 1])
                for e, (_, model, fp) in enumerate(experts)
            ]
            per_expert = [f.result() for f in futures]
            for j, (run, _, _) in enumerate(jobs):
                for b in range(len(run.run)):
                    for expert_rows in per_expert:
                        for col, value in zip(STATS_SCHEMA.names, expert_rows[j][b]):
                            cols[col].append(value)
            if progress:
                progress(sum(len(c) for c in batch_chunks[1:]))
    result = StatsResult(pa.table(cols, schema=STATS_SCHEMA), pa.table(layout, schema=BLOCKS_SCHEMA))
    result.content[family.base_fp] = content_digest({n: h.hexdigest() for n, h in hashers[0].items()}, family.base)
    for (i, model, fp), h in zip(experts, hashers[1:]):
        result.content[fp] = content_digest({n: x.hexdigest() for n, x in h.items()}, model)
    return result


class BlockRun(NamedTuple):
    name: str
    info: object  # the base's TensorInfo
    dt: object  # its DTYPES entry
    run: list[int]  # block numbers
    requests: list[ReadRequest]  # one range per model: base first, then the experts
    rows: list[tuple[int, int]]  # each block's rows
    per_model: list[list[tuple[int, int]]]  # each model's byte range per block


class Batch(NamedTuple):
    runs: list[BlockRun]
    requests: list[ReadRequest]  # one range per model, spanning every run of the batch


def _batches(runs: list[BlockRun], limit: int = READ_CHUNK) -> Iterator[Batch]:
    """Consecutive runs (of small tensors, typically) read together: while every model's next
    run starts in the same file where its last one ended, up to `limit` bytes of the base."""
    group: list[BlockRun] = []
    size = 0
    for run in runs:
        n = run.requests[0].ranges[0][1] - run.requests[0].ranges[0][0]
        adjacent = group and all(
            r.path == last.path and r.ranges[0][0] == last.ranges[0][1]
            for r, last in zip(run.requests, group[-1].requests)
        )
        if group and adjacent and size + n <= limit:
            group.append(run)
            size += n
            continue
        if group:
            yield _batch(group)
        group, size = [run], n
    if group:
        yield _batch(group)


def _batch(runs: list[BlockRun]) -> Batch:
    requests = [
        ReadRequest(first.path, [(first.ranges[0][0], last.ranges[0][1])], first.role, first.model, first.file)
        for first, last in zip(runs[0].requests, runs[-1].requests)
    ]
    return Batch(runs, requests)


def _block_runs(family: Family, models: list, block_size: int) -> Iterator[BlockRun]:
    """Every run of blocks to read, tensor by tensor in file order (near-sequential on a cold
    disk)."""
    order = sorted(family.base.tensors, key=lambda n: (family.base.tensors[n].file, family.base.tensors[n].info.start))
    for name in order:
        info = family.base.tensors[name].info
        dt = DTYPES[info.dtype]
        blocks = block_rows(info.shape, dt.itemsize, block_size)
        for run in chunk_blocks(blocks, row_elems(info.shape) * dt.itemsize):
            rows = [blocks[b] for b in run]
            per_model = [_block_ranges(m, name, rows) for _, _, m in models]
            requests = [
                ReadRequest(m.path(m.tensors[name].file), [(r[0][0], r[-1][1])], role, label, m.tensors[name].file)
                for (label, role, m), r in zip(models, per_model)
            ]
            yield BlockRun(name, info, dt, run, requests, rows, per_model)


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
