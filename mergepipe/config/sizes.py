"""Parsing of byte sizes ("512MiB", "5GB", 1048576) and budgets ("10%", "512MiB", "4096B": a
budget always has a unit)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from mergepipe.errors import BadInput

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
    "T": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")
_BARE = re.compile(r"^\s*[0-9]+(?:\.[0-9]+)?\s*$")
_PERCENT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*%\s*$")


def format_size(n: int) -> str:
    """A byte count in the largest binary unit it reaches (GiB, MiB, KiB), two decimals."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def parse_size(value: str | int, *, key: str) -> int:
    """Bytes from an int or a string with a decimal (KB, MB) or binary (KiB, MiB) unit."""
    if isinstance(value, bool):
        raise BadInput(f"{key}: expected a size such as 512MiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise BadInput(f"{key}: size must not be negative, got {value}")
        return value
    if isinstance(value, float):
        raise BadInput(f"{key}: expected a whole number of bytes or a size such as 512MiB, got {value!r}")
    m = _SIZE.match(str(value))
    if not m or m.group(2).upper() not in _UNITS or (not m.group(2) and "." in m.group(1)):
        raise BadInput(f"{key}: expected a size such as 512MiB, 2GB or 1048576, got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


@dataclass(frozen=True)
class Budget:
    """An I/O budget for expert reads: bytes, a fraction of the full expert bytes, or none."""

    kind: str  # "bytes" | "fraction" | "full"
    value: float  # bytes, or a fraction in [0, 1]

    @property
    def is_full(self) -> bool:
        """Whether every expert byte may be read, whatever the family's size."""
        return self.kind == "full" or (self.kind == "fraction" and self.value >= 1.0)

    def resolve(self, full_expert_bytes: int) -> int:
        if self.kind == "bytes":
            return int(self.value)
        if self.kind == "fraction":
            # Floor, so a fractional budget never exceeds its share by rounding up.
            return int(self.value * full_expert_bytes)
        return full_expert_bytes

    def describe(self) -> str:
        if self.kind == "bytes":
            return f"{int(self.value)} bytes"
        if self.kind == "fraction":
            return f"{self.value * 100:g}%"
        return "100%"

    def as_json(self) -> dict:
        return {"kind": self.kind, "value": self.value}


def parse_budget(value: str | int | float | None, *, key: str = "budget") -> Budget:
    if value is None:
        return Budget("full", 1.0)
    if isinstance(value, str):
        m = _PERCENT.match(value)
        if m:
            pct = float(m.group(1))
            if pct > 100:
                raise BadInput(f"{key}: {value!r} is above 100%")
            return Budget("fraction", pct / 100.0)
        if value.strip().startswith("-"):
            raise BadInput(f"{key}: budget must not be negative, got {value!r}")
    if isinstance(value, float) and not isinstance(value, bool):
        raise BadInput(f"{key}: give a size (512MiB) or a percentage (10%), got {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        raise BadInput(f"{key}: budget must not be negative, got {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) or (isinstance(value, str) and _BARE.match(value)):
        # A bare 25 read as 25 bytes plans nothing and publishes the base: always say the unit.
        raise BadInput(
            f"{key}: {value!r} has no unit; write {value}% for a share of the expert bytes, "
            f"or {value}MiB (or {value}B) for bytes"
        )
    return Budget("bytes", float(parse_size(value, key=key)))
