"""Canonical JSON and digests: the same content gives the same bytes on any machine."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any


def _normalise(value: Any) -> Any:
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"non-finite float {value!r} cannot be part of a digest")
        # Integral floats print the same as ints would not; keep the type visible but stable.
        return value
    if isinstance(value, dict):
        return {str(k): _normalise(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    return value


def canonical_json(value: Any) -> bytes:
    """Sorted keys, fixed separators, shortest round-trip floats (Python's repr)."""
    return json.dumps(
        _normalise(value), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest_of(value: Any) -> str:
    return sha256_hex(canonical_json(value))


def round_sig(x: float, digits: int = 12) -> float:
    """Round to `digits` significant digits so last-bit noise never changes a digest."""
    if x == 0 or not math.isfinite(x):
        return float(x)
    return float(f"{x:.{digits}g}")
