"""Pure arithmetic over tensor shapes: blocks (runs of whole rows), layer groups, byte ranges."""

from __future__ import annotations

import math
import re
from functools import lru_cache

_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.")


def row_elems(shape: tuple[int, ...]) -> int:
    return math.prod(shape[1:]) if len(shape) >= 1 else 1


def block_rows(shape: tuple[int, ...], itemsize: int, block_size: int) -> list[tuple[int, int]]:
    """Row ranges along dim 0 of about `block_size` bytes each; a 0-d or 1-D tensor is one block,
    a zero-size tensor has none. Rows are whole, so each block is one contiguous byte range."""
    if len(shape) == 0:
        return [(0, 1)]
    if math.prod(shape) == 0:
        return []
    rows = shape[0]
    if len(shape) == 1:
        return [(0, rows)]
    per_block = max(1, block_size // (row_elems(shape) * itemsize))
    return [(r, min(r + per_block, rows)) for r in range(0, rows, per_block)]


def byte_range(start: int, shape: tuple[int, ...], itemsize: int, r0: int, r1: int) -> tuple[int, int]:
    """Absolute byte range of rows [r0, r1) of a tensor stored at `start`."""
    n = row_elems(shape) * itemsize
    return start + r0 * n, start + r1 * n


@lru_cache(maxsize=1 << 18)  # the stages of a merge ask for each tensor in turn
def layer_index(name: str) -> int | None:
    """The transformer layer a tensor belongs to, from its name; None outside the layers."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def with_layer(name: str, i: int) -> str:
    """The tensor's name in layer i (a slice's source layer renamed to the output's)."""
    m = _LAYER.search(name)
    return name[: m.start(1)] + str(i) + name[m.end(1) :]


def before_layers(name: str) -> bool:
    """Whether a tensor outside the layers comes before them (embeddings) rather than after
    (final norm, head, the rest), as mergekit's pre- and post-weights."""
    return layer_group(name) == "embeddings"


def layer_count(names) -> int:
    """How many layers a model has: one more than the highest layer index among its tensors."""
    return max((i for i in map(layer_index, names) if i is not None), default=-1) + 1


def layer_position(name: str, n_layers: int) -> float:
    """Where a tensor sits for gradients, as mergekit computes it: layer / (n_layers - 1), 1 when
    there is one layer, and 0 for tensors outside the layers (embeddings, final norm, head)."""
    i = layer_index(name)
    if i is None:
        return 0.0
    return i / (n_layers - 1) if n_layers > 1 else 1.0


@lru_cache(maxsize=1 << 18)
def layer_group(name: str) -> str:
    """The execution group of a tensor: its transformer layer, or embeddings / head / other."""
    i = layer_index(name)
    if i is not None:
        return f"layer.{i:05d}"
    lowered = name.lower()
    if "embed" in lowered or "wte" in lowered or "wpe" in lowered:
        return "embeddings"
    if "lm_head" in lowered or lowered.startswith("head.") or ".head." in lowered or lowered.startswith("cls."):
        return "head"
    return "other"
