"""Staging in an object store: an output bound for s3:// is staged under a prefix beside it,
where each layer group writes its own bytes from whichever process runs it, with no local copy.

A staged shard is a run of pieces, each an object named by the shard offset it starts at: the
header's piece (written when staging opens) and, per layer group, one piece for the group's
tensors in that shard (a group's tensors lie together in a shard). The group marks and the
small files lie beside them, so a run on any machine resumes from what is there. Publishing
makes each shard from its pieces in one multipart upload of server-side copies (the bytes do
not pass through the publisher, except where a part would be under the store's minimum part
size), then copies the small files, and writes the manifest last: the commit marker.

    <prefix>/parts/<shard>/<offset>    <prefix>/groups/<mark files>    <prefix>/files/<name>
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from mergepipe.errors import BadInput, DeterminedError, MergepipeError
from mergepipe.storage import remote
from mergepipe.storage.fingerprints import FileFingerprint
from mergepipe.storage.ledger import ByteLedger
from mergepipe.storage.location import join, split
from mergepipe.storage.marks import mark_files, read_mark
from mergepipe.storage.model_files import MANIFEST_FILE
from mergepipe.storage.reader import read_small_file
from mergepipe.storage.writer import STAGING_MARK, upload_order

PARTS, GROUPS, FILES = "parts", "groups", "files"


def staging_prefix(out: str, key: str) -> str:
    """Beside the output (so a listing of the output never shows it), named by `key` (the plan
    digest), so a merge run again after a crash, on any machine, finds what its first run wrote."""
    parent, name = split(out)
    return join(parent, f".{name}{STAGING_MARK}{key[:16]}")


def piece_key(shard: str, offset: int) -> str:
    return f"{PARTS}/{shard}/{offset:016d}"


def part_plan(
    pieces: list[tuple[str, int]], min_part: int, max_part: int, max_parts: int = remote.MAX_PARTS
) -> list[tuple[bool, list[tuple[str, int, int]]]]:
    """The parts of a multipart upload that joins `pieces` ((object, size), in order): (True,
    [(object, start, end)]) copies a range server-side; (False, ranges) sends ranges read back.
    Every part but the last is at least `min_part` and at most `max_part` bytes. A piece with
    at least `min_part` bytes left is copied; smaller pieces are gathered with what follows
    them up to `min_part` bytes."""
    if max_part < 2 * min_part:
        raise ValueError("the largest part must be at least twice the smallest")
    total = sum(size for _, size in pieces)
    parts: list[tuple[bool, list[tuple[str, int, int]]]] = []
    i, off, pos = 0, 0, 0
    while pos < total:
        while off == pieces[i][1]:  # at the end of a piece (or an empty one): the next
            i, off = i + 1, 0
        src, size = pieces[i]
        left = size - off
        if left >= min_part:
            n = min(left, max_part)
            if 0 < left - n < min_part:  # leave the piece's rest large enough to copy too
                n = left - min_part
            parts.append((True, [(src, off, off + n)]))
            off, pos = off + n, pos + n
            continue
        want, ranges = min(min_part, total - pos), []
        while want:
            while off == pieces[i][1]:
                i, off = i + 1, 0
            src, size = pieces[i]
            n = min(want, size - off)
            ranges.append((src, off, off + n))
            off, pos, want = off + n, pos + n, want - n
        parts.append((False, ranges))
    if len(parts) > max_parts:
        raise MergepipeError(f"{pieces[0][0]}: {len(parts)} parts, more than the store's {max_parts}")
    return parts


class StoreWriter:
    """One layer group's writes: each run of contiguous writes into a shard is one piece,
    uploaded as it is written (storage.remote.open_writer), its ETag kept for the mark."""

    def __init__(self, prefix: str, ledger: ByteLedger) -> None:
        self.prefix, self.ledger = prefix, ledger
        self.pieces: list[list] = []  # [shard, start, end, etag]
        self._file = None
        self._at: tuple[str, int, int] | None = None  # shard, start, position of the open piece

    def write(self, shard: str, offset: int, data: bytes | memoryview) -> None:
        if self._at is None or self._at[0] != shard or self._at[2] != offset:
            self._finish_piece()
            self._file = remote.open_writer(join(self.prefix, piece_key(shard, offset)))
            self._at = (shard, offset, offset)
        n = len(memoryview(data).cast("B"))
        try:
            self._file.write(data)
        except Exception as exc:
            raise remote.final_error(exc, join(self.prefix, piece_key(shard, self._at[1])), "write") from exc
        self._at = (shard, self._at[1], self._at[2] + n)
        self.ledger.add("output", "output", shard, n)

    def _finish_piece(self) -> None:
        if self._file is None:
            return
        shard, start, end = self._at
        uri = join(self.prefix, piece_key(shard, start))
        try:
            self._file.close()
        except Exception as exc:
            raise remote.final_error(exc, uri, "write") from exc
        self._file = self._at = None
        fp = remote.stat(uri)
        if fp is None or fp.size != end - start:
            raise MergepipeError(f"{uri}: the staged piece is not there with its {end - start} bytes after writing")
        self.pieces.append([shard, start, end, fp.etag])

    def close(self) -> dict:
        """What the group's mark keeps of its writes: its pieces, by which a resumed run knows
        them intact."""
        self._finish_piece()
        return {"pieces": self.pieces}

    def abort(self) -> None:
        if self._file is not None:
            self._file.discard()  # aborts its multipart upload
            self._file = self._at = None


class StoreStaging:
    """An object-store output's staging prefix (see the module's docstring)."""

    def __init__(self, prefix: str) -> None:
        self.location = prefix
        self._listed: dict[str, FileFingerprint] | None = None

    def _listing(self, fresh: bool = False) -> dict[str, FileFingerprint]:
        if self._listed is None or fresh:
            self._listed = remote.list_objects(self.location)
        return self._listed

    def open(self, shards: list[tuple[str, bytes, int]]) -> bool:
        """Every shard's header piece in place; True when a run before this one marked groups
        done here (a resumed merge)."""
        listing = self._listing(fresh=True)
        for name, header, _ in shards:
            fp = listing.get(piece_key(name, 0))
            if fp is None or fp.size != len(header):
                remote.put_bytes(join(self.location, piece_key(name, 0)), header)
        self._listed = None
        return any(k.startswith(f"{GROUPS}/") for k in listing)

    def writer(self, ledger: ByteLedger) -> StoreWriter:
        return StoreWriter(self.location, ledger)

    def mark_done(self, group: str, record: dict) -> None:
        for name, data in mark_files(group, record):
            remote.put_bytes(join(self.location, GROUPS, name), data)

    def _mark_file(self, name: str) -> bytes:
        data = remote.read_if_present(join(self.location, GROUPS, name))
        if data is None:
            raise FileNotFoundError(name)
        return data

    def record(self, group: str, regions: list[tuple[str, int, int]]) -> dict | None:
        """The record of a group marked done whose pieces are still those it wrote (the
        regions it covers, and each piece's size and ETag as written); else None."""
        if f"{GROUPS}/{group}" not in self._listing():
            return None
        record = read_mark(group, self._mark_file)
        if record is None or not isinstance(record.get("pieces"), list):
            return None
        if [tuple(p[:3]) for p in record["pieces"]] != _runs(regions):
            return None
        listing = self._listing()
        for shard, start, end, etag in record["pieces"]:
            fp = listing.get(piece_key(shard, start))
            if fp is None or fp.size != end - start or fp.etag != etag:
                return None
        return record

    def clear_marks(self) -> None:
        remote.delete_tree(join(self.location, GROUPS))
        self._listed = None

    def put(self, name: str, data: bytes) -> None:
        remote.put_bytes(join(self.location, FILES, name), data)

    def copy_in(self, src: str, name: str, ledger: ByteLedger) -> None:
        data = read_small_file(src)
        self.put(name, data)
        ledger.add("sidecar", "base", name, len(data))

    def _pieces(self, shard: str, listing: dict[str, FileFingerprint]) -> list[tuple[str, int]]:
        """The shard's pieces in order, checked to join up from byte 0 without a gap."""
        found = sorted(
            (int(key.rsplit("/", 1)[1]), fp.size) for key, fp in listing.items() if key.startswith(f"{PARTS}/{shard}/")
        )
        at = 0
        for offset, size in found:
            if offset != at:
                raise DeterminedError(f"{self.location}: staged pieces of {shard} leave a gap at byte {at}")
            at += size
        return [(join(self.location, piece_key(shard, offset)), size) for offset, size in found]

    def sha256(self, name: str, ledger: ByteLedger | None = None) -> tuple[str, int]:
        """SHA-256 and size of a staged shard (its pieces read back in order) or small file.
        The pieces are listed once per staging object: every group is done by then."""
        pieces = self._pieces(name, self._listing())
        if not pieces:
            data = read_small_file(join(self.location, FILES, name))
            return hashlib.sha256(data).hexdigest(), len(data)
        h, size = hashlib.sha256(), 0
        for uri, n in pieces:
            for start in range(0, n, remote.HASH_CHUNK):
                (chunk,) = remote.read_ranges(uri, [(start, min(n, start + remote.HASH_CHUNK))])
                h.update(chunk)
            size += n
        if ledger is not None:
            ledger.add("checksum", "output", name, size)
        return h.hexdigest(), size

    def size(self) -> int:
        return sum(fp.size for key, fp in self._listing(fresh=True).items() if not key.startswith(f"{GROUPS}/"))

    def publish(
        self, out: str, overwrite: bool, ledger: ByteLedger, progress: Callable[[int], None] | None = None
    ) -> None:
        """Shards (each joined from its pieces), then the small files, then the manifest, into
        `out`; then the staging prefix goes. An earlier output at `out` (with overwrite) stops
        being one first: its manifest goes before anything is replaced."""
        listing = self._listing(fresh=True)
        shards = sorted({key.split("/")[1] for key in listing if key.startswith(f"{PARTS}/")})
        files = sorted(key.split("/", 1)[1] for key in listing if key.startswith(f"{FILES}/"))
        if MANIFEST_FILE not in files:
            raise MergepipeError(f"{self.location}: no manifest staged; not publishing")
        before = remote.list_tree(out)
        if MANIFEST_FILE in before:
            if not overwrite:
                raise BadInput(f"{out}: output already exists (pass --overwrite to replace it)")
            remote.delete([join(out, MANIFEST_FILE)])
        names = shards + files
        for name in upload_order(names):
            if name == MANIFEST_FILE:  # objects of an earlier output that this one lacks go before the commit
                remote.delete([join(out, n) for n in before if n not in names])
            if name in shards:
                pieces = self._pieces(name, listing)
                parts = part_plan(pieces, remote.MIN_PART_SIZE, remote.MAX_PART_SIZE)
                sent = remote.compose(join(out, name), parts)
                size = sum(n for _, n in pieces)
                if sent:
                    ledger.add("compose", "output", name, sent)
            else:
                remote.copy(join(self.location, FILES, name), join(out, name))
                size = listing[f"{FILES}/{name}"].size
            ledger.add("upload", "output", name, size)
            if progress:
                progress(size)
        self.discard()

    def discard(self) -> None:
        remote.delete_tree(self.location)
        self._listed = None


def _runs(regions: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Regions (shard, start, end) joined where one ends where the next starts: the pieces a
    group writing them in order makes."""
    out: list[tuple[str, int, int]] = []
    for shard, start, end in regions:
        if out and out[-1][0] == shard and out[-1][2] == start:
            out[-1] = (shard, out[-1][1], end)
        else:
            out.append((shard, start, end))
    return out
