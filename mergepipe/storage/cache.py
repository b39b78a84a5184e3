"""A local cache of the byte ranges read from pinned Hub commits (`--cache DIR`, or
MERGEPIPE_CACHE): a later merge, at a larger budget or of another config over the same models,
fetches only the ranges it has not read before.

A commit's file never changes, so its bytes are kept by URL (which names the commit): one
sparse file per remote file, holding what was read at the same offsets, and beside it the
ranges it holds. Writers of one entry take turns on a lock file; what a reader finds listed is
there in full (bytes are written before their range is listed). Other locations (an https://
folder, S3) can change under the same name and are never cached.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path

from mergepipe.storage.hub import commit_of

ENV = "MERGEPIPE_CACHE"


def cache_dir() -> Path | None:
    where = os.environ.get(ENV)
    return Path(where) if where else None


def cacheable(uri: str) -> bool:
    return commit_of(uri) is not None


def _merge(ranges: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def missing(held: list[list[int]], start: int, end: int) -> list[tuple[int, int]]:
    """The parts of [start, end) that `held` (merged, sorted) does not cover."""
    gaps, at = [], start
    for a, b in held:
        if b <= at:
            continue
        if a >= end:
            break
        if a > at:
            gaps.append((at, a))
        at = max(at, b)
    if at < end:
        gaps.append((at, end))
    return gaps


class Entry:
    """One remote file's cached bytes."""

    def __init__(self, root: Path, uri: str) -> None:
        key = hashlib.sha256(uri.encode()).hexdigest()
        self.folder = root / key[:2]
        self.data = self.folder / f"{key}.data"
        self.index = self.folder / f"{key}.ranges"

    def held(self) -> list[list[int]]:
        try:
            return json.loads(self.index.read_text())
        except (FileNotFoundError, ValueError):
            return []

    def read(self, start: int, end: int) -> bytes:
        with open(self.data, "rb") as f:
            return os.pread(f.fileno(), end - start, start)

    @contextmanager
    def _locked(self):
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"{self.data.stem}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def add(self, pieces: list[tuple[int, bytes]]) -> None:
        """Bytes read at these offsets: written, then listed."""
        with self._locked():
            fd = os.open(self.data, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                for offset, data in pieces:
                    os.pwrite(fd, data, offset)
            finally:
                os.close(fd)
            held = _merge(self.held() + [[o, o + len(d)] for o, d in pieces])
            tmp = self.index.with_suffix(".tmp")
            tmp.write_text(json.dumps(held))
            os.replace(tmp, self.index)
