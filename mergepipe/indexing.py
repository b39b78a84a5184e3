"""Block statistics: the one full pass over each expert, streamed block by block.

Per (expert, block): bytes, delta_sq = sum((x - b)^2) in fp64, max |delta|, the number of
elements that differ (as values, or as signed zeros), and the block's content hash. The same
pass hashes every tensor, which gives each model a content digest that does not depend on
where the files live or on the block size.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pyarrow as pa
import torch

from .canonical import digest_of
from .errors import BadInput
from .family import Family, expert_label
from .layout import block_rows, byte_range, layer_group
from .storage.model_files import ModelFiles
from .storage.reader import RangeReader
from .storage.safetensors_format import DTYPES, decode

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
    ]
)


def delta_stats(base: torch.Tensor, expert: torch.Tensor) -> tuple[float, float, int]:
    """(sum of squares, max abs, count of differing elements) of expert - base, in fp64.

    numpy's pairwise sum is single-threaded, so the statistics (and the plans ranked on them)
    do not depend on the machine's thread count."""
    if expert.numel() == 0:
        return 0.0, 0.0, 0
    d = expert.double().numpy() - base.double().numpy()
    differs = (d != 0) | (torch.signbit(expert) != torch.signbit(base)).numpy()
    return float(np.square(d).sum()), float(np.abs(d).max()), int(differs.sum())


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


def _read_block(
    reader: RangeReader, model: ModelFiles, label: str, role: str, name: str, rows: tuple[int, int]
) -> tuple[torch.Tensor, bytes]:
    loc = model.tensors[name]
    info = loc.info
    s, e = byte_range(info.start, info.shape, DTYPES[info.dtype].itemsize, *rows)
    raw = reader.read(model.path(loc.file), s, e, role=role, model=label, file=loc.file)
    shape = (rows[1] - rows[0], *info.shape[1:]) if info.shape else ()
    return decode(raw, info.dtype, shape), bytes(raw)


def compute_stats(
    family: Family,
    expert_positions: list[int],
    block_size: int,
    reader: RangeReader,
    *,
    progress: Callable[[int], None] | None = None,
) -> StatsResult:
    """Stream the base once and each listed expert once; return their block statistics."""
    cols: dict[str, list] = {f.name: [] for f in STATS_SCHEMA}
    layout: dict[str, list] = {f.name: [] for f in BLOCKS_SCHEMA}
    experts = [(i, family.experts[i], family.expert_fps()[i]) for i in expert_positions]
    base_hashers = {n: hashlib.sha256() for n in family.base.tensors}
    expert_hashers = {i: {n: hashlib.sha256() for n in family.base.tensors} for i, _, _ in experts}
    # Read in file order so a cold disk sees near-sequential access.
    order = sorted(family.base.tensors, key=lambda n: (family.base.tensors[n].file, family.base.tensors[n].info.start))
    for name in order:
        info = family.base.tensors[name].info
        dt = DTYPES[info.dtype]
        is_float = dt.is_float
        blocks = block_rows(info.shape, dt.itemsize, block_size)
        for b, rows in enumerate(blocks):
            base_t, base_raw = _read_block(reader, family.base, "base", "base", name, rows)
            base_hashers[name].update(base_raw)
            if is_float:
                for col, value in zip(BLOCKS_SCHEMA.names, (name, b, layer_group(name), rows[0], rows[1], len(base_raw))):
                    layout[col].append(value)
            for i, model, fp in experts:
                x, raw = _read_block(reader, model, expert_label(i), "expert", name, rows)
                expert_hashers[i][name].update(raw)
                if progress:
                    progress(len(raw))
                if not is_float:
                    if raw != base_raw:
                        raise BadInput(
                            f"expert {i} ({model.uri}): tensor {name!r} is a {info.dtype} buffer that differs "
                            "from the base; non-float tensors must be identical across the family"
                        )
                    continue
                sq, mx, nnz = delta_stats(base_t, x)
                if not (math.isfinite(sq) and math.isfinite(mx)):
                    raise BadInput(f"expert {i} ({model.uri}): tensor {name!r} block {b} has a non-finite delta (NaN or Inf)")
                cols["expert_fp"].append(fp)
                cols["tensor"].append(name)
                cols["block"].append(b)
                cols["bytes"].append(len(raw))
                cols["delta_sq"].append(sq)
                cols["max_abs_delta"].append(mx)
                cols["nnz_delta"].append(nnz)
                cols["content_hash"].append(hashlib.blake2b(raw, digest_size=16).hexdigest())
    result = StatsResult(pa.table(cols, schema=STATS_SCHEMA), pa.table(layout, schema=BLOCKS_SCHEMA))
    result.content[family.base_fp] = content_digest({n: h.hexdigest() for n, h in base_hashers.items()}, family.base)
    for i, model, fp in experts:
        result.content[fp] = content_digest({n: h.hexdigest() for n, h in expert_hashers[i].items()}, model)
    return result
