"""The byte ledger: every read and write is counted per (role, model, file)."""

from __future__ import annotations

import threading
from collections import defaultdict

# reread: bytes read again by a merge in passes over windows (execute.windowed), beyond the
# base and expert bytes the plan counts once. index: bytes a first merge that indexes on the
# way reads only for the index (blocks found unchanged, the experts' non-float buffers).
# upload: bytes published into an object-store output; compose: staged bytes read back there to
# be sent again, where a multipart part would be under the store's minimum size. retry: ranges
# asked for again after a transient failure of an object store or HTTP server (beside the
# bytes their role counts once). cache: bytes of pinned Hub commits, or of objects at the ETag
# seen, served by the local cache (storage.cache) rather than the network (beside their role too). resolve: Hub files looked up
# for where their bytes are (no bytes; `requests` counts the lookups, refreshes of expired URLs
# among them). rate_limit: answers that asked to wait (no bytes; `seconds` the waits they added).
# lora_base: a model's rows read to apply a LoRA adapter's change to them (storage.adapters),
# beside the factor rows its expert role counts.
ROLES = (
    "header",
    "base",
    "expert",
    "reread",
    "index",
    "output",
    "checksum",
    "sidecar",
    "upload",
    "compose",
    "retry",
    "cache",
    "resolve",
    "rate_limit",
    "lora_base",
)
# Roles whose requests are reads of the inputs' bytes (the rest count lookups, waits, the output).
READ_ROLES = ("header", "base", "expert", "reread", "index", "sidecar", "retry", "lora_base")


class ByteLedger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[tuple[str, str, str], int] = defaultdict(int)
        self._requests: dict[tuple[str, str, str], int] = defaultdict(int)
        self._seconds: dict[tuple[str, str, str], float] = defaultdict(float)

    def add(self, role: str, model: str, file: str, nbytes: int, requests: int = 1, seconds: float = 0.0) -> None:
        assert role in ROLES, role
        with self._lock:
            self._bytes[(role, model, file)] += nbytes
            self._requests[(role, model, file)] += requests
            if seconds:
                self._seconds[(role, model, file)] += seconds

    def merge(self, rows: list[dict]) -> None:
        for r in rows:
            self.add(r["role"], r["model"], r["file"], r["bytes"], r["requests"], r.get("seconds", 0.0))

    def rows(self) -> list[dict]:
        with self._lock:
            return [
                {"role": k[0], "model": k[1], "file": k[2], "bytes": v, "requests": self._requests[k]}
                | ({"seconds": round(self._seconds[k], 3)} if k in self._seconds else {})
                for k, v in sorted(self._bytes.items())
            ]

    def requests_by_role(self) -> dict[str, int]:
        with self._lock:
            count: dict[str, int] = defaultdict(int)
            for (role, _, _), n in self._requests.items():
                count[role] += n
            return dict(count)

    def seconds(self, role: str) -> float:
        with self._lock:
            return sum(v for (r, _, _), v in self._seconds.items() if r == role)

    def total(self, role: str, model: str | None = None) -> int:
        with self._lock:
            return sum(v for (r, m, _), v in self._bytes.items() if r == role and (model is None or m == model))

    def by_role(self) -> dict[str, int]:
        return {role: self.total(role) for role in ROLES}


def request_counts(*ledgers: ByteLedger) -> dict:
    """A run's requests over its ledgers: reads of input bytes beside the Hub files resolved,
    the rate-limited answers and the seconds they made it wait."""
    count: dict[str, int] = defaultdict(int)
    for ledger in ledgers:
        for role, n in ledger.requests_by_role().items():
            count[role] += n
    return {
        "reads": sum(count[r] for r in READ_ROLES),
        "resolves": count["resolve"],
        "rate_limited": count["rate_limit"],
        "rate_limit_wait_seconds": round(sum(ledger.seconds("rate_limit") for ledger in ledgers), 3),
    }
