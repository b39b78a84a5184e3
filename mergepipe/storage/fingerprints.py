"""What says a stored file may have changed since it was indexed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FileFingerprint:
    """Local files: size, mtime, ctime and inode. mtime alone can be set back (rsync -t,
    touch -d); the inode and ctime change whenever the file is replaced or written.
    Objects: size, ETag, and the version id where the bucket is versioned."""

    size: int
    mtime_ns: int | None = None
    ctime_ns: int | None = None
    inode: int | None = None
    etag: str | None = None
    version_id: str | None = None

    def as_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}
