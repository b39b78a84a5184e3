"""Local output folders: checked, staged, written in place, published atomically; the file
writes and hashes every output shares.

A local output is staged next to its destination and published by one rename, after every
shard is written, hashed and synced and the manifest is in the staging folder. (An output in
an object store is staged in the store: storage.store_staging.)"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

from mergepipe.errors import BadInput, MergepipeError
from mergepipe.storage import remote
from mergepipe.storage.ledger import ByteLedger
from mergepipe.storage.location import fs_path, inside, is_remote, normalize, protocol
from mergepipe.storage.marks import mark_files, read_mark
from mergepipe.storage.model_files import ACCESS_FILE, INDEX_FILE, MANIFEST_FILE, SIDECAR_FILES
from mergepipe.storage.reader import read_small_file, stat

STAGING_MARK = ".mergepipe-staging-"
# Every name mergepipe writes into an output; a prefix holding only these and no manifest is
# an unfinished upload that a new merge may complete.
_OUTPUT_NAME = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
_OUTPUT_FILES = {INDEX_FILE, MANIFEST_FILE, ACCESS_FILE, *SIDECAR_FILES}


def is_output_name(name: str) -> bool:
    return name in _OUTPUT_FILES or bool(_OUTPUT_NAME.fullmatch(name))


def _overlap(out: str, uri: str) -> str | None:
    if is_remote(out) != is_remote(uri):
        return None
    if is_remote(out):
        root = normalize(uri)
        root = root.rsplit("/", 1)[0] if root.endswith(".safetensors") else root
        if inside(out, root):
            return f"{out}: output lies inside the input model folder {root}"
        if inside(root, out):
            return f"{out}: the input model {root} lies inside the output folder"
        return None
    root = Path(uri).resolve()
    root = root.parent if root.is_file() else root
    o = Path(out)
    if o == root or root in o.parents:
        return f"{out}: output folder lies inside the input model folder {root}"
    if o in root.parents:
        return f"{out}: the input model {root} lies inside the output folder"
    return None


def check_destination(out: str | Path, overwrite: bool, inputs: list[str]) -> str:
    """Refuse, before any work, an output that exists (without overwrite) or overlaps an input.
    Returns the destination in its normal form."""
    out = normalize(str(out)) if is_remote(str(out)) else str(Path(out).expanduser().resolve())
    for uri in inputs:
        problem = _overlap(out, uri)
        if problem:
            raise BadInput(problem)
    if is_remote(out):
        _check_remote_destination(out, overwrite)
        return out
    path = Path(out)
    if path.exists() and not overwrite:
        raise BadInput(f"{out}: output already exists (pass --overwrite to replace it)")
    if path.exists() and not path.is_dir():
        raise BadInput(f"{out}: exists and is not a folder")
    return out


def _check_remote_destination(out: str, overwrite: bool) -> None:
    # Staging in the store joins shards with S3's multipart copies, and lies beside the output.
    if protocol(out) not in ("s3", "s3a"):
        raise BadInput(f"{out}: an output goes to a local folder or to s3:// (not {protocol(out)}://)")
    if "/" not in fs_path(out):
        raise BadInput(f"{out}: an output in a bucket needs a prefix (s3://bucket/NAME), not the bucket itself")
    remote.check_bucket(out)
    if stat(out) is not None:
        raise BadInput(f"{out}: is an object, not a prefix")
    if overwrite:
        return
    names = remote.list_tree(out)
    if MANIFEST_FILE in names:
        raise BadInput(f"{out}: output already exists (pass --overwrite to replace it)")
    foreign = [n for n in names if not is_output_name(n)]
    if foreign:
        raise BadInput(
            f"{out}: holds objects that are not part of a mergepipe output (such as {foreign[0]!r}) "
            "and no manifest; choose an empty prefix or pass --overwrite to replace them"
        )


def staging_dir(out: str, key: str) -> Path:
    """Where a local output is staged, named by `key` (the plan digest), so a merge run again
    after a crash finds the bytes its first run wrote: a hidden folder beside it (same file
    system, so the rename is atomic)."""
    return Path(out).parent / f".{Path(out).name}{STAGING_MARK}{key[:16]}"


GROUPS_DIR = ".mergepipe-groups"  # in staging: which layer groups are written, and their records


class LocalWriter:
    """One layer group's writes into the staged shards, each at its offset."""

    def __init__(self, folder: Path, ledger: ByteLedger) -> None:
        self.folder, self.ledger = folder, ledger

    def write(self, shard: str, offset: int, data: bytes | memoryview) -> None:
        write_at(self.folder / shard, offset, data, self.ledger)

    def close(self) -> dict:
        """What the group's mark keeps of its writes besides their hash: nothing here."""
        return {}

    def abort(self) -> None:
        pass


class LocalStaging:
    """A local output's staging folder: the shards at their final sizes, written in place by
    the groups; the group marks; the small files. Published by one rename."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.location = str(folder)

    def open(self, shards: list[tuple[str, bytes, int]]) -> bool:
        """Every shard (name, header, size) in place. An existing folder whose shards have their
        sizes and headers is kept (True: a resumed merge); anything else there is wiped and the
        shards are created afresh."""
        staging = self.folder
        if staging.is_dir() and all(_shard_in_place(staging / name, header, size) for name, header, size in shards):
            return True
        shutil.rmtree(staging, ignore_errors=True)
        staging.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        for name, header, size in shards:
            create_shard(staging / name, header, size)
        return False

    def writer(self, ledger: ByteLedger) -> LocalWriter:
        return LocalWriter(self.folder, ledger)

    def mark_done(self, group: str, record: dict) -> None:
        """Mark a group finished with its record (storage.marks): the SHA-256 of the bytes it
        wrote ("sha256") and whatever else a resumed run needs to account for it."""
        folder = self.folder / GROUPS_DIR
        folder.mkdir(exist_ok=True)
        for name, data in mark_files(group, record):
            tmp = folder / f"{name}.tmp"
            write_file(tmp, data)
            os.replace(tmp, folder / name)

    def record(self, group: str, regions: list[tuple[str, int, int]]) -> dict | None:
        """The record of a group marked done whose staged bytes still hash to what it wrote; else None."""
        folder = self.folder / GROUPS_DIR
        record = read_mark(group, lambda name: (folder / name).read_bytes())
        if record is None:
            return None
        h = hashlib.sha256()
        try:
            for shard, start, end in regions:
                with open(self.folder / shard, "rb") as f:
                    f.seek(start)
                    data = f.read(end - start)
                if len(data) != end - start:
                    return None
                h.update(data)
        except OSError:
            return None
        return record if h.hexdigest() == record.get("sha256") else None

    def clear_marks(self) -> None:
        shutil.rmtree(self.folder / GROUPS_DIR, ignore_errors=True)

    def put(self, name: str, data: bytes) -> None:
        write_file(self.folder / name, data)

    def copy_in(self, src: str, name: str, ledger: ByteLedger) -> None:
        copy_file(src, self.folder / name, ledger)

    def sha256(self, name: str, ledger: ByteLedger | None = None) -> tuple[str, int]:
        return sha256_file(self.folder / name, ledger)

    def size(self) -> int:
        return sum(p.stat().st_size for p in self.folder.iterdir() if p.is_file())

    def publish(
        self, out: str, overwrite: bool, ledger: ByteLedger, progress: Callable[[int], None] | None = None
    ) -> None:
        """Make the staged folder (manifest included) visible at `out` by one rename, after
        syncing every file in it."""
        staging, out_path = self.folder, Path(out)
        for p in staging.iterdir():
            _fsync_path(p)
        _fsync_path(staging, directory=True)
        if out_path.exists():
            if not overwrite:
                raise BadInput(f"{out}: output already exists (pass --overwrite to replace it)")
            trash = out_path.parent / f".{out_path.name}.mergepipe-old-{secrets.token_hex(6)}"
            os.rename(out_path, trash)
            os.rename(staging, out_path)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            try:
                os.rename(staging, out_path)
            except OSError as err:
                raise MergepipeError(f"{out}: could not publish ({err.strerror})") from None
        _fsync_path(out_path.parent, directory=True)

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _shard_in_place(path: Path, header: bytes, size: int) -> bool:
    try:
        if path.stat().st_size != size:
            return False
        with open(path, "rb") as f:
            return f.read(len(header)) == header
    except OSError:
        return False


def create_shard(path: Path, header: bytes, size: int) -> None:
    """The shard file at its final size with its header in place; tensors are written later."""
    try:
        with open(path, "wb") as f:
            f.write(header)
            f.truncate(size)
    except OSError as err:
        raise MergepipeError(f"{path}: cannot create output shard ({err.strerror or err})") from err


def write_at(path: Path, offset: int, data: bytes | memoryview, ledger: ByteLedger, *, model: str = "output") -> None:
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
        raise MergepipeError(
            f"{path}: cannot write {len(data)} bytes at offset {offset} ({err.strerror or err})"
        ) from err
    ledger.add("output", model, path.name, len(data))


def sha256_file(path: Path, ledger: ByteLedger | None = None, role: str = "checksum") -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    # One buffer read into again and again: a fresh chunk per read is fresh pages to zero.
    buf = memoryview(bytearray(remote.HASH_CHUNK))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(buf[:n])
            size += n
    if ledger is not None:
        ledger.add(role, "output", path.name, size)
    return h.hexdigest(), size


def sha256_uri(uri: str) -> tuple[str, int] | None:
    """SHA-256 and size of a local file or an object; None if it is not there."""
    if not is_remote(uri):
        return sha256_file(Path(uri)) if os.path.isfile(uri) else None
    fp = stat(uri)
    if fp is None:
        return None
    return remote.sha256(uri, fp.size), fp.size


def write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def copy_file(src: str, dst: Path, ledger: ByteLedger) -> None:
    """A whole small file (config, tokenizer) from a local folder or an object store."""
    if is_remote(src):
        write_file(dst, read_small_file(src))
    else:
        shutil.copyfile(src, dst)
    ledger.add("sidecar", "base", dst.name, os.path.getsize(dst))


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def upload_order(names: list[str]) -> list[str]:
    """Shards, then the small files, then the manifest: whatever is visible before the
    manifest is, by the commit rule, not a published output."""
    rest = sorted(n for n in names if n != MANIFEST_FILE)
    shards = [n for n in rest if n.endswith(".safetensors")]
    return shards + [n for n in rest if n not in shards] + ([MANIFEST_FILE] if MANIFEST_FILE in names else [])
