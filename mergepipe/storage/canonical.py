"""Canonical JSON and digests: the same content gives the same bytes on any machine."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any


def canonical_json(value: Any) -> bytes:
    """Sorted keys, fixed separators, shortest round-trip floats (Python's repr).

    Keys are compared as the strings JSON writes them (an int key 10 sorts before 9), so the
    value first goes through JSON once: in C, where a walk in Python cost seconds on the
    content digests of 100k-tensor checkpoints. Floats survive it exactly (repr round-trips);
    a non-finite one is refused, as it has no JSON form."""
    try:
        plain = json.loads(json.dumps(value, ensure_ascii=True, allow_nan=False))
    except ValueError as err:
        raise ValueError(f"a digest needs finite floats ({err})") from None
    return plain_json(plain)


def plain_json(value: Any) -> bytes:
    """canonical_json of a value whose every dict key is already a str (as JSON would write
    it): the same bytes without the normalising round trip, for values of 100k entries."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest_of(value: Any) -> str:
    return sha256_hex(canonical_json(value))


def round_sig(x: float, digits: int = 12) -> float:
    """Round to `digits` significant digits so last-bit noise never changes a digest."""
    if x == 0 or not math.isfinite(x):
        return float(x)
    return float(f"{x:.{digits}g}")
