"""Canonical JSON and digests: the same content gives the same bytes on any machine."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import orjson


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
    return json_bytes(plain)


def json_bytes(value: Any, *, sort_keys: bool = True, floats: bool = True) -> bytes:
    """The JSON text Python's json writes for a value whose dict keys are all str: compact
    (separators "," and ":"), ASCII (\\u escapes), no NaN, keys sorted unless told not to.

    floats=False: the caller vouches that the value holds no float (only dicts, lists, tuples,
    str, int, bool and None, as a content digest's entries or a safetensors header do). orjson
    writes the same text for such a value whenever that text is printable ASCII, far faster on
    100k entries; a value it cannot write (an int past 64 bits, another type) or whose text
    holds other characters goes through json. Floats it writes in another shortest form than Python's repr
    ("1e-7" for "1e-07"), so a value with floats always goes through json."""
    if not floats:
        try:
            out = orjson.dumps(value, option=orjson.OPT_SORT_KEYS if sort_keys else 0)
            if out.isascii() and b"\x7f" not in out:  # json escapes DEL too
                return out
        except TypeError:
            pass
    return json.dumps(value, sort_keys=sort_keys, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode(
        "ascii"
    )


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest_of(value: Any) -> str:
    return sha256_hex(canonical_json(value))


def round_sig(x: float, digits: int = 12) -> float:
    """Round to `digits` significant digits so last-bit noise never changes a digest."""
    if x == 0 or not math.isfinite(x):
        return float(x)
    return float(f"{x:.{digits}g}")
