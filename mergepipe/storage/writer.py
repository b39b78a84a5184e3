"""Output folders: staged next to the destination, written in place, published by rename.

Nothing is visible at the destination until the final rename, which happens only after every
shard is written, hashed and synced and the manifest is in the staging folder."""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from pathlib import Path

from ..errors import BadInput, MergepipeError
from .ledger import ByteLedger

STAGING_MARK = ".mergepipe-staging-"
HASH_CHUNK = 8 * 1024 * 1024


def check_destination(out: str | Path, overwrite: bool, inputs: list[str]) -> Path:
    """Refuse, before any work, an output that exists (without overwrite) or lies inside an input."""
    out = Path(out).expanduser().resolve()
    for uri in inputs:
        if "://" in uri:
            continue
        root = Path(uri).resolve()
        root = root.parent if root.is_file() else root
        if out == root or root in out.parents:
            raise BadInput(f"{out}: output folder lies inside the input model folder {root}")
    if out.exists() and not overwrite:
        raise BadInput(f"{out}: output already exists (pass --overwrite to replace it)")
    if out.exists() and not out.is_dir():
        raise BadInput(f"{out}: exists and is not a folder")
    return out


def new_staging_dir(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}{STAGING_MARK}{secrets.token_hex(6)}"
    staging.mkdir()
    return staging


def create_shard(path: Path, header: bytes, size: int) -> None:
    """The shard file at its final size with its header in place; tensors are written later."""
    try:
        with open(path, "wb") as f:
            f.write(header)
            f.truncate(size)
    except OSError as err:
        raise MergepipeError(f"{path}: cannot create output shard ({err.strerror or err})") from err


def write_at(path: Path, offset: int, data: bytes, ledger: ByteLedger, *, model: str = "output") -> None:
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            view = memoryview(data)
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
        finally:
            os.close(fd)
    except OSError as err:
        raise MergepipeError(f"{path}: cannot write {len(data)} bytes at offset {offset} ({err.strerror or err})") from err
    ledger.add("output", model, path.name, len(data))


def sha256_file(path: Path, ledger: ByteLedger | None = None, role: str = "checksum") -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    if ledger is not None:
        ledger.add(role, "output", path.name, size)
    return h.hexdigest(), size


def write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def copy_file(src: str, dst: Path, ledger: ByteLedger) -> None:
    shutil.copyfile(src, dst)
    ledger.add("sidecar", "base", dst.name, os.path.getsize(dst))


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(staging: Path, out: Path, overwrite: bool) -> None:
    """Make the staged folder visible at `out` in one rename (after syncing it)."""
    for p in staging.iterdir():
        _fsync_path(p)
    _fsync_path(staging, directory=True)
    if out.exists():
        if not overwrite:
            raise BadInput(f"{out}: output already exists (pass --overwrite to replace it)")
        trash = out.parent / f".{out.name}.mergepipe-old-{secrets.token_hex(6)}"
        os.rename(out, trash)
        os.rename(staging, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        try:
            os.rename(staging, out)
        except OSError as err:
            raise MergepipeError(f"{out}: could not publish ({err.strerror})") from None
    _fsync_path(out.parent, directory=True)


def discard(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)
