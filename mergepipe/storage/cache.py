"""A local cache of the byte ranges read from remote inputs (`--cache DIR`, or MERGEPIPE_CACHE;
a merge search keeps one by default): a later merge, at a larger budget or of another config over
the same models (a search's next trial), fetches only the ranges it has not read before.

A pinned Hub commit's file never changes, so its bytes are kept by URL (which names the commit).
An object in an object store can change under the same name, so its bytes are kept by URL and
the ETag (or version id) this process last saw when it read the object's fingerprint (pin):
a changed object is a new entry, never the old bytes. An https:// folder, which has neither,
is never cached. Each entry is one sparse file holding what was read at the same offsets, and
beside it the ranges it holds. Writers of one entry take turns on a lock file; what a reader
finds listed is there in full (bytes are written before their range is listed). A size bound
(trim) drops the entries least recently read, never while a reader holds the cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mergepipe.storage.hub import commit_of

ENV = "MERGEPIPE_CACHE"


def cache_dir() -> Path | None:
    where = os.environ.get(ENV)
    return Path(where) if where else None


# Object-store objects by URL: the version (ETag or version id) this process last saw.
_pins: dict[str, str] = {}
_pins_lock = threading.Lock()


def pin(uri: str, version: str | None) -> None:
    """The version of an object read now (its fingerprint's ETag or version id): its cached
    bytes are those of this version."""
    if version:
        with _pins_lock:
            _pins[uri] = version


def cacheable(uri: str) -> bool:
    return commit_of(uri) is not None or uri in _pins


def _key(uri: str) -> str:
    if commit_of(uri) is not None:
        return uri
    with _pins_lock:
        return f"{uri}\0{_pins[uri]}"


LOCK = ".lock"


@contextmanager
def reading(root: Path) -> Iterator[None]:
    """Held by a reader while it uses the cache: a trim waits for no reader."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def held_bytes(root: Path) -> int:
    return sum(_entry_size(p) for p in root.glob("*/*.ranges"))


def _entry_size(index: Path) -> int:
    try:
        return sum(b - a for a, b in json.loads(index.read_text()))
    except (OSError, ValueError):
        return 0


def trim(root: Path, max_bytes: int, wait: bool = False) -> int | None:
    """Drop the entries read least recently until the cache holds at most max_bytes; returns
    what it holds then. With wait false, gives up (None) while a reader holds the cache."""
    if not root.is_dir():
        return 0
    with open(root / LOCK, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return None
        try:
            entries = []
            for index in root.glob("*/*.ranges"):
                try:
                    entries.append((index.stat().st_mtime, index, _entry_size(index)))
                except FileNotFoundError:
                    continue
            total = sum(size for _, _, size in entries)
            for _, index, size in sorted(entries, key=lambda e: (e[0], str(e[1]))):
                if total <= max_bytes:
                    break
                for path in (index, index.with_suffix(".data"), index.with_suffix(".lock")):
                    path.unlink(missing_ok=True)
                total -= size
            return total
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


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
        key = hashlib.sha256(_key(uri).encode()).hexdigest()
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
            data = os.pread(f.fileno(), end - start, start)
        os.utime(self.index)  # read recently: the last to go when the cache is trimmed
        return data

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
