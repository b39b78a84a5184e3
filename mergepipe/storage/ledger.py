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
# bytes their role counts once). cache: bytes of pinned Hub commits served by the local cache
# (storage.cache) rather than the network (beside their role too).
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
)


class ByteLedger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[tuple[str, str, str], int] = defaultdict(int)
        self._requests: dict[tuple[str, str, str], int] = defaultdict(int)

    def add(self, role: str, model: str, file: str, nbytes: int, requests: int = 1) -> None:
        assert role in ROLES, role
        with self._lock:
            self._bytes[(role, model, file)] += nbytes
            self._requests[(role, model, file)] += requests

    def merge(self, rows: list[dict]) -> None:
        for r in rows:
            self.add(r["role"], r["model"], r["file"], r["bytes"], r["requests"])

    def rows(self) -> list[dict]:
        with self._lock:
            return [
                {"role": k[0], "model": k[1], "file": k[2], "bytes": v, "requests": self._requests[k]}
                for k, v in sorted(self._bytes.items())
            ]

    def total(self, role: str, model: str | None = None) -> int:
        with self._lock:
            return sum(v for (r, m, _), v in self._bytes.items() if r == role and (model is None or m == model))

    def by_role(self) -> dict[str, int]:
        return {role: self.total(role) for role in ROLES}
