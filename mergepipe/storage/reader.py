"""Ranged reads that fetch exactly the bytes asked for, and count them.

Local files are read with os.preadv into preallocated buffers after
posix_fadvise(POSIX_FADV_RANDOM): mmap page faults and sequential read() calls let the kernel's
read-ahead pull in megabytes nobody planned. Reading ahead is asked for
explicitly instead (prefetch: POSIX_FADV_WILLNEED on exactly the planned ranges). Remote objects are read
with one ranged GET per range (storage.remote); both count into the same ledger.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from dataclasses import dataclass

from mergepipe.errors import BadInput, MergepipeError
from mergepipe.storage import remote
from mergepipe.storage.fingerprints import FileFingerprint
from mergepipe.storage.ledger import ByteLedger
from mergepipe.storage.location import is_remote, protocol


@dataclass(frozen=True)
class ReadRequest:
    path: str
    ranges: list[tuple[int, int]]
    role: str
    model: str
    file: str


def stat(uri: str) -> FileFingerprint | None:
    """The file's fingerprint, or None when no file is there."""
    if is_remote(uri):
        return remote.stat(uri)
    try:
        st = os.stat(uri)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not os.path.isfile(uri):
        return None
    return FileFingerprint(st.st_size, mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns, inode=st.st_ino)


def fingerprint(uri: str) -> FileFingerprint:
    fp = stat(uri)
    if fp is None:
        raise BadInput(f"{uri}: file not found")
    return fp


def list_folder(uri: str) -> list[str] | None:
    """Names of the files directly in a folder (or under a prefix); None if there is none."""
    if is_remote(uri):
        return remote.list_folder(uri)
    if not os.path.isdir(uri):
        return None
    return sorted(e.name for e in os.scandir(uri) if e.is_file())


def read_small_file(uri: str) -> bytes:
    """Whole small files (index json, config, tokenizer, manifest)."""
    if is_remote(uri):
        return remote.read_all(uri)
    try:
        with open(uri, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise BadInput(f"{uri}: file not found") from None


class RangeReader:
    """Reads byte ranges of files and records them in a ledger. Safe to share across threads."""

    def __init__(self, ledger: ByteLedger | None = None) -> None:
        self.ledger = ledger if ledger is not None else ByteLedger()
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    raise BadInput(f"{path}: file not found") from None
                except OSError as err:
                    raise MergepipeError(f"{path}: cannot open ({err.strerror or err})") from err
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                self._fds[path] = fd
            return fd

    def read(self, path: str, start: int, end: int, *, role: str, model: str, file: str) -> bytearray:
        return self.read_many(path, [(start, end)], role=role, model=model, file=file)[0]

    def read_many(
        self, path: str, ranges: list[tuple[int, int]], *, role: str, model: str, file: str
    ) -> list[bytearray]:
        return self.read_batch([ReadRequest(path, ranges, role, model, file)])[0]

    def read_batch(self, requests: list[ReadRequest]) -> list[list[bytearray]]:
        """Every request's ranges; remote ones are fetched together, concurrently."""
        by_protocol: dict[str, list[tuple[int, str, int, int]]] = defaultdict(list)
        for k, req in enumerate(requests):
            if is_remote(req.path):
                by_protocol[protocol(req.path)].extend((k, req.path, s, e) for s, e in req.ranges)
        fetched: dict[int, list[bytearray]] = defaultdict(list)
        for items in by_protocol.values():
            for (k, *_), data in zip(items, remote.fetch([(p, s, e) for _, p, s, e in items])):
                fetched[k].append(data)
        out = []
        for k, req in enumerate(requests):
            bufs = fetched[k] if is_remote(req.path) else self._pread_all(req.path, req.ranges)
            self.ledger.add(
                req.role,
                req.model,
                req.file,
                sum(len(b) for b in bufs),
                requests=sum(1 for s, e in req.ranges if e > s),
            )
            out.append(bufs)
        return out

    def prefetch(self, requests: list[ReadRequest]) -> None:
        """Ask the kernel to start reading the local ranges now (POSIX_FADV_WILLNEED), so that
        the preads that follow find them in the page cache. It reads exactly these pages, as
        the preads would: nothing beyond the plan. Remote ranges are left to read_batch. Neither
        counted (the preads count) nor required: a failure here only loses the head start."""
        for req in requests:
            if is_remote(req.path):
                continue
            try:
                fd = self._fd(req.path)
                for start, end in req.ranges:
                    if end > start:
                        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
            except (MergepipeError, OSError):
                return

    def _pread_all(self, path: str, ranges: list[tuple[int, int]]) -> list[bytearray]:
        fd = self._fd(path)
        out = []
        for start, end in ranges:
            buf = bytearray(end - start)
            view = memoryview(buf)
            got = 0
            while got < len(buf):
                try:
                    n = os.preadv(fd, [view[got:]], start + got)
                except OSError as err:
                    raise MergepipeError(f"{path}: read error at byte {start + got} ({err.strerror or err})") from err
                if n == 0:
                    raise MergepipeError(
                        f"{path}: short read at byte {start + got} (wanted {end - start} bytes from {start}); "
                        "the file changed or was truncated"
                    )
                got += n
            out.append(buf)
        return out

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> "RangeReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
