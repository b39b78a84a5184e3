"""Ranged reads that fetch exactly the bytes asked for, and count them.

Local files are read with os.preadv into preallocated buffers after
posix_fadvise(POSIX_FADV_RANDOM): mmap page faults and sequential read() calls let the kernel's
read-ahead pull in megabytes nobody planned (DESIGN.md, byte ledger).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from ..errors import BadInput, MergepipeError
from .ledger import ByteLedger


@dataclass(frozen=True)
class FileFingerprint:
    """What says a local file may have changed. mtime alone can be set back (rsync -t, touch
    -d); the inode and ctime change whenever the file is replaced or written."""

    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int

    def as_json(self) -> dict:
        return {"size": self.size, "mtime_ns": self.mtime_ns, "ctime_ns": self.ctime_ns, "inode": self.inode}


def fingerprint(path: str) -> FileFingerprint:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise BadInput(f"{path}: file not found") from None
    return FileFingerprint(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def read_small_file(path: str) -> bytes:
    """Whole small files (index json, config, tokenizer)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise BadInput(f"{path}: file not found") from None


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
        fd = self._fd(path)
        out = []
        total = 0
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
            total += len(buf)
        self.ledger.add(role, model, file, total, requests=len(ranges))
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
