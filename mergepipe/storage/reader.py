"""Ranged reads that fetch exactly the bytes asked for, and count them.

Local files are read with os.preadv into preallocated buffers after
posix_fadvise(POSIX_FADV_RANDOM): mmap page faults and sequential read() calls let the kernel's
read-ahead pull in megabytes nobody planned. Reading ahead is asked for
explicitly instead (prefetch: POSIX_FADV_WILLNEED on exactly the planned ranges). Ranges of a
megabyte or more bypass the page cache (O_DIRECT, rounded out to pages: DIRECT_MIN_BYTES).
Remote objects are read with one ranged GET per range (storage.remote), and fetched ahead of
the reads that want them (read_ahead), within a bound on the bytes held so. All count into the
same ledger, which counts the bytes asked for.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass

from mergepipe import torch
from mergepipe.errors import BadInput, MergepipeError
from mergepipe.storage import adapters, cache, remote, virtual
from mergepipe.storage.adapters import ADAPTER_WEIGHTS
from mergepipe.storage.fingerprints import FileFingerprint
from mergepipe.storage.ledger import ByteLedger
from mergepipe.storage.location import ContextPool, is_remote
from mergepipe.storage.safetensors_format import decode, encode

# What a read returns: a writable buffer of exactly the bytes asked for (a view, for a range read
# with O_DIRECT).
Buffer = bytearray | memoryview


@dataclass(frozen=True)
class ReadRequest:
    path: str
    ranges: list[tuple[int, int]]
    role: str
    model: str
    file: str

    @property
    def key(self) -> tuple:
        """What a read ahead is matched by: the same bytes of the same file, whatever role."""
        return (self.path, tuple(self.ranges))

    @property
    def size(self) -> int:
        return sum(e - s for s, e in self.ranges if e > s)


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


def list_folder(uri: str, names: tuple[str, ...] = ()) -> list[str] | None:
    """Names of the files directly in a folder (or under a prefix); None if there is none. An
    http(s) folder, which cannot be listed, answers for `names` only."""
    if is_remote(uri):
        return remote.list_folder(uri, names)
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


class _Tally(remote.Events):
    """What a fetch met besides its bytes, in the ledger under the request it was for."""

    def __init__(self, ledger: ByteLedger, wanted: list[tuple[str, int, int]], owner: list[ReadRequest]) -> None:
        self.ledger, self.wanted, self.owner = ledger, wanted, owner

    def retried(self, positions: list[int]) -> None:
        for i in positions:
            self.ledger.add("retry", self.owner[i].model, self.owner[i].file, self.wanted[i][2] - self.wanted[i][1])

    def resolved(self, at: int) -> None:
        self.ledger.add("resolve", self.owner[at].model, self.owner[at].file, 0)

    def rate_limited(self, at: int | None, seconds: float) -> None:
        req = self.owner[at] if at is not None else None
        self.ledger.add("rate_limit", req.model if req else "", req.file if req else "", 0, seconds=seconds)


# Batches of remote reads fetched ahead at once by one reader (each with its ranges in flight
# together): enough to keep a link busy while one batch waits on its slowest range.
AHEAD_BATCHES = 4


class RangeReader:
    """Reads byte ranges of files and records them in a ledger. Safe to share across threads.

    Ranges read with O_DIRECT come back as views of mappings lent by DIRECT_BUFFERS: the reader
    holds them until release() (or close) says their views are no longer used.

    Remote requests given to read_ahead are fetched in the background, in the order given, while
    the bytes fetched and not yet read stay within `read_ahead` bytes; a read_batch of the very
    same request takes them instead of fetching."""

    def __init__(self, ledger: ByteLedger | None = None, read_ahead: int = 0) -> None:
        self.ledger = ledger if ledger is not None else ByteLedger()
        self._ahead_limit = read_ahead
        self._ahead_held = 0  # bytes of the requests fetched ahead (or being fetched), not read yet
        self._ahead_queue: deque[ReadRequest] = deque()  # given to read_ahead, not fetched yet
        self._ahead: dict[tuple, tuple[Future, int, ReadRequest]] = {}  # key -> (its batch, position)
        self._taken: set[tuple] = set()  # keys read without a read ahead: never fetched ahead after
        self._ahead_pool: ContextPool | None = None
        self._fds: dict[str, int] = {}
        self._direct_fds: dict[str, int | None] = {}
        self._lock = threading.Lock()
        self._open = True
        self._lent: dict[int, mmap.mmap] = {}  # the mappings of direct reads not given back yet
        # kept per input while open: LoRA factors read whole (_whole_factor), mean rows (_mean_row)
        self._factors: dict[tuple, torch.Tensor] = {}
        self._factor_lock = threading.Lock()
        DIRECT_BUFFERS.reader_opened()

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

    def _direct_fd(self, path: str) -> int | None:
        """The file opened with O_DIRECT, or None where its file system refuses that."""
        with self._lock:
            if path in self._direct_fds:
                return self._direct_fds[path]
            fd = None
            if O_DIRECT:
                try:
                    fd = os.open(path, os.O_RDONLY | O_DIRECT)
                except OSError:
                    pass  # no O_DIRECT on this file system (EINVAL); the buffered fd reports real errors
            self._direct_fds[path] = fd
            return fd

    def read(self, path: str, start: int, end: int, *, role: str, model: str, file: str) -> Buffer:
        return self.read_many(path, [(start, end)], role=role, model=model, file=file)[0]

    def read_many(self, path: str, ranges: list[tuple[int, int]], *, role: str, model: str, file: str) -> list[Buffer]:
        return self.read_batch([ReadRequest(path, ranges, role, model, file)])[0]

    def read_batch(
        self, requests: list[ReadRequest], read_with: Iterable[tuple[ReadRequest, list[Buffer]]] = ()
    ) -> list[list[Buffer]]:
        """Every request's ranges; remote ones are fetched together, concurrently, or taken from
        what read_ahead fetched; those of made tensors (storage.virtual) made from what they
        need, a LoRA-changed weight's model rows taken from the batch's own ranges or from
        `read_with` (requests read before, with their buffers, still held by the caller) where
        those hold them."""
        if any(virtual.is_virtual(req.file) for req in requests):
            made = [k for k, req in enumerate(requests) if virtual.is_virtual(req.file)]
            real = [k for k in range(len(requests)) if k not in made]
            got = dict(zip(real, self.read_batch([requests[k] for k in real])))
            # The batch's own ranges (the base's, read with its experts') serve the model rows
            # a change is added to, where they hold them.
            pairs = [(requests[k], got[k]) for k in real] + list(read_with)
            held = [(req.path, s, e, b) for req, bufs in pairs for (s, e), b in zip(req.ranges, bufs)]
            lora = [k for k in made if isinstance(virtual.recipe(requests[k].file), adapters.LoraTensor)]
            got.update(zip(lora, self._read_changed([requests[k] for k in lora], held)))
            vocab = [k for k in made if k not in lora]
            got.update(zip(vocab, self._read_vocab_rows([requests[k] for k in vocab])))
            return [got[k] for k in range(len(requests))]
        ahead: dict[int, tuple[Future, int, ReadRequest]] = {}
        with self._lock:
            for k, req in enumerate(requests):
                if is_remote(req.path):
                    got = self._ahead.pop(req.key, None)
                    if got is not None:
                        ahead[k] = got
                    else:
                        self._taken.add(req.key)
        now = [k for k, req in enumerate(requests) if is_remote(req.path) and k not in ahead]
        fetched: dict[int, list[Buffer]] = dict(zip(now, self._fetch_requests([requests[k] for k in now])))
        try:
            for k, (batch, i, req) in ahead.items():
                got = batch.result()
                fetched[k], got[i] = got[i], None  # the batch no longer holds its buffers
        finally:
            if ahead:
                with self._lock:
                    self._ahead_held -= sum(req.size for _, _, req in ahead.values())
                    self._pump()
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

    def _whole_factor(self, t: adapters.LoraTensor, role: str, model: str) -> torch.Tensor:
        """The factor every row of a changed weight needs, read once by this reader for each
        input reading it (the plan counts it once per weight and expert, even where two experts
        share an adapter) and kept while the reader is open."""
        key = (model, t.adapter, t.whole.start)
        with self._factor_lock:
            got = self._factors.get(key)
            if got is None:
                w = t.whole
                (buf,) = self.read_batch([ReadRequest(t.adapter, [(w.start, w.end)], role, model, ADAPTER_WEIGHTS)])[0]
                got = self._factors[key] = decode(bytearray(buf), w.dtype, w.shape)
                self.release([buf])
        return got

    def _read_changed(self, requests: list[ReadRequest], held: list[tuple] = ()) -> list[list[Buffer]]:
        """The ranges of LoRA-changed weights (storage.adapters): for each range, the rows it
        covers of the model's tensor, taken from `held` (path, start, end, buffer: what the same
        batch read) where it holds them, else read (counted as `lora_base`), and the rows of the
        factor indexed by rows (counted in the request's role); the other factor once per
        reader; then the rows computed and the range cut from them."""
        parts: list[ReadRequest] = []
        wanted = []
        for req in requests:
            t = virtual.recipe(req.file)
            size = t.row_bytes
            whole = self._whole_factor(t, req.role, req.model)
            for s, e in req.ranges:
                r0, r1 = s // size, -(-e // size)
                a, b = t.place.start + r0 * size, t.place.start + r1 * size
                home = next(
                    (
                        memoryview(buf)[a - hs : b - hs]
                        for p, hs, he, buf in held
                        if p == t.home and hs <= a and b <= he
                    ),
                    None,
                )
                if home is None:
                    parts.append(ReadRequest(t.home, [(a, b)], "lora_base", req.model, t.place.file))
                parts.append(ReadRequest(t.adapter, t.factor_ranges(r0, r1), req.role, req.model, ADAPTER_WEIGHTS))
                wanted.append((t, whole, r0, r1, s, e, home))
        got = iter(self.read_batch(parts))
        out: list[list[Buffer]] = [[] for _ in requests]
        at = 0
        for k, req in enumerate(requests):
            for _ in req.ranges:
                t, whole, r0, r1, s, e, home = wanted[at]
                at += 1
                mine = [] if home is not None else next(got)  # read here: given back once used
                factor = next(got)
                rows = adapters.changed_rows(t, home if home is not None else mine[0], factor, whole, r0, r1)
                self.release([*mine, *factor])
                offset = r0 * t.row_bytes
                out[k].append(bytearray(encode(rows)[s - offset : e - offset]))
        return out

    def _read_vocab_rows(self, requests: list[ReadRequest]) -> list[list[Buffer]]:
        """The ranges of vocabulary-indexed tensors on the output's rows (storage.vocab_rows):
        for each range, the source rows of the output rows it covers, read (in the request's
        role) and made into those rows, and the range cut from them."""
        parts: list[ReadRequest] = []
        wanted = []
        for req in requests:
            t = virtual.recipe(req.file)
            for s, e in req.ranges:
                r0, r1 = s // t.row_bytes, -(-e // t.row_bytes)
                needs = t.needs(r0, r1)
                parts.extend(self._source_requests(t, needs, req.role, req.model))
                mean = self._mean_row(t, req.role, req.model) if r1 > t.n else None
                wanted.append((t, r0, r1, s, e, len(needs), mean))
        got = iter(self.read_batch(parts) if parts else ())
        out: list[list[Buffer]] = [[] for _ in requests]
        at = 0
        for k, req in enumerate(requests):
            for _ in req.ranges:
                t, r0, r1, s, e, n, mean = wanted[at]
                at += 1
                bufs = [next(got)[0] for _ in range(n)]
                rows = t.rows(r0, r1, bufs, mean)
                self.release(bufs)
                offset = r0 * t.row_bytes
                out[k].append(bytearray(encode(rows)[s - offset : e - offset]))
        return out

    @staticmethod
    def _source_requests(t, needs: list[tuple[int, int, int]], role: str, model: str) -> list[ReadRequest]:
        out = []
        for m, first, rows in needs:
            path, place = t.sources[m]
            out.append(ReadRequest(path, [t.source_range(m, first, rows)], role, model, place.file))
        return out

    def _mean_row(self, t, role: str, model: str) -> torch.Tensor:
        """A padded vocabulary's mean row (storage.vocab_rows), made once by this reader for each
        input reading it from every row below the padding (the plan counts those rows once per
        tensor and expert, as a LoRA factor read whole) and kept while the reader is open."""
        key = (model, t.name)
        with self._factor_lock:
            got = self._factors.get(key)
            if got is None:
                total = torch.zeros(t.width, dtype=torch.float64)
                for r0, r1 in t.slabs():  # a slab at a time: an embedding's rows are not held at once
                    bufs = [b[0] for b in self.read_batch(self._source_requests(t, t.needs(r0, r1), role, model))]
                    t.add_rows(total, r0, r1, bufs)
                    self.release(bufs)
                got = self._factors[key] = t.mean_of(total)
        return got

    def _fetch_requests(self, requests: list[ReadRequest]) -> list[list[bytearray]]:
        """The ranges of these remote requests, fetched concurrently (storage.remote.fetch
        serves each host with its own credentials)."""
        items = [(k, req.path, s, e) for k, req in enumerate(requests) for s, e in req.ranges]
        fetched: list[list[bytearray]] = [[] for _ in requests]
        for (k, *_), data in zip(items, self._fetch(items, requests)):
            fetched[k].append(data)
        return fetched

    def read_ahead(self, requests: list[ReadRequest], first: bool = False) -> None:
        """Fetch these remote requests in the background, in this order, ahead of the reads that
        will ask for them, while what is fetched and not yet read fits the reader's bound; with
        `first`, before those given earlier (they are the very next reads). Local requests are
        left to prefetch. Counted when read (or, never read, as `reread` at close)."""
        with self._lock:
            if not self._open or self._ahead_limit <= 0:
                return
            remote_requests = [r for r in requests if is_remote(r.path) and r.size and not virtual.is_virtual(r.file)]
            if first:
                self._ahead_queue.extendleft(reversed(remote_requests))
            else:
                self._ahead_queue.extend(remote_requests)
            self._pump()

    def _pump(self) -> None:
        """Under the lock: start fetching the queued requests that fit the bound, as one batch.
        One larger than the whole bound is never fetched ahead (its read fetches it)."""
        batch: dict[tuple, ReadRequest] = {}
        while self._ahead_queue:
            req = self._ahead_queue[0]
            if req.key in self._ahead or req.key in self._taken or req.key in batch or req.size > self._ahead_limit:
                self._ahead_queue.popleft()
                continue
            if self._ahead_held + req.size > self._ahead_limit:
                break
            self._ahead_queue.popleft()
            self._ahead_held += req.size
            batch[req.key] = req
        if not batch:
            return
        if self._ahead_pool is None:
            self._ahead_pool = ContextPool(AHEAD_BATCHES, thread_name_prefix="read-ahead")
        future = self._ahead_pool.submit(self._fetch_requests, list(batch.values()))
        for i, (key, req) in enumerate(batch.items()):
            self._ahead[key] = (future, i, req)

    def _fetch(self, items: list[tuple[int, str, int, int]], requests: list[ReadRequest]) -> list[bytearray]:
        """The remote ranges (request k, path, start, end), through the local cache of pinned
        commits where there is one (storage.cache): only the parts it does not hold go over the
        network, and what they bring is kept. Counted apart, beside their own role: the bytes
        the cache served (`cache`), the ranges asked for again after a failure or a refusal
        (`retry`), the Hub files resolved (`resolve`) and the rate limits met (`rate_limit`)."""
        root = cache.cache_dir()
        if root is None:
            return self._fetch_through(None, items, requests)
        with cache.reading(root):
            return self._fetch_through(root, items, requests)

    def _fetch_through(
        self, root, items: list[tuple[int, str, int, int]], requests: list[ReadRequest]
    ) -> list[bytearray]:
        entries = {} if root is None else {p: cache.Entry(root, p) for _, p, _, _ in items if cache.cacheable(p)}
        parts = [cache.missing(entries[p].held(), s, e) if p in entries else [(s, e)] for _, p, s, e in items]
        wanted = [(p, a, b) for (_, p, _, _), ps in zip(items, parts) for a, b in ps]
        owner = [requests[k] for (k, *_), ps in zip(items, parts) for _ in ps]

        got = iter(remote.fetch(wanted, _Tally(self.ledger, wanted, owner)))
        out = []
        for (k, p, s, e), ps in zip(items, parts):
            new = [(a, next(got)) for a, _ in ps]
            if p not in entries:
                out.append(new[0][1])
                continue
            if new:
                entries[p].add(new)
            whole = len(new) == 1 and new[0][0] == s and len(new[0][1]) == e - s
            out.append(new[0][1] if whole else bytearray(entries[p].read(s, e)))
            served = (e - s) - sum(len(d) for _, d in new)
            if served:
                self.ledger.add("cache", requests[k].model, requests[k].file, served, requests=0)
        return out

    def prefetch(self, requests: list[ReadRequest]) -> None:
        """Ask the kernel to start reading the local ranges now (POSIX_FADV_WILLNEED), so that
        the preads that follow find them in the page cache. It reads exactly these pages, as
        the preads would: nothing beyond the plan. Remote ranges are left to read_batch. Neither
        counted (the preads count) nor required: a failure here only loses the head start."""
        for req in requests:
            if is_remote(req.path) or virtual.is_virtual(req.file):
                continue
            try:
                fd = self._fd(req.path)
                for start, end in req.ranges:
                    if end > start and not direct_applies(start, end):
                        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
            except (MergepipeError, OSError):
                return

    def _pread_all(self, path: str, ranges: list[tuple[int, int]]) -> list[Buffer]:
        fd = self._fd(path)
        out: list[Buffer] = []
        for start, end in ranges:
            if direct_applies(start, end):
                dfd = self._direct_fd(path)
                if dfd is not None:
                    view = _read_direct(path, dfd, start, end)
                    with self._lock:
                        self._lent[id(view.obj)] = view.obj
                    out.append(view)
                    continue
            buf = bytearray(end - start)
            _read_into(path, fd, memoryview(buf), start, end - start)
            out.append(buf)
        return out

    def release(self, buffers: Iterable[Buffer] | None = None) -> None:
        """The mappings under these buffers (what read_batch returned), or under every buffer
        read so far, given back for other reads: the caller keeps no view or array of them."""
        with self._lock:
            if buffers is None:
                maps = list(self._lent.values())
                self._lent.clear()
            else:
                maps = [
                    self._lent.pop(id(b.obj)) for b in buffers if isinstance(b, memoryview) and id(b.obj) in self._lent
                ]
        DIRECT_BUFFERS.give_back(maps)

    def _end_read_ahead(self) -> None:
        """Stop reading ahead: what is queued is dropped, fetches under way finish, and what was
        fetched and never read is counted as `reread` (bytes read beyond what the reads used)."""
        with self._lock:
            self._ahead_limit = 0
            self._ahead_queue.clear()
            pool, self._ahead_pool = self._ahead_pool, None
            left = list(self._ahead.values())
            self._ahead.clear()
            self._ahead_held = 0
        if pool is None:
            return
        pool.shutdown(wait=True, cancel_futures=True)
        for batch, _, req in left:
            if not batch.cancelled() and batch.exception() is None:
                self.ledger.add("reread", req.model, req.file, req.size, requests=len(req.ranges))

    def close(self) -> None:
        self._end_read_ahead()
        self.release()
        with self._lock:
            for fd in [*self._fds.values(), *self._direct_fds.values()]:
                if fd is not None:
                    os.close(fd)
            self._fds.clear()
            self._direct_fds.clear()
            was_open, self._open = self._open, False
        if was_open:
            DIRECT_BUFFERS.reader_closed()

    def __enter__(self) -> "RangeReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# Ranges at least this long are read with O_DIRECT: the device writes them straight into the
# buffer. Through the page cache, a large read costs the kernel far more CPU than the copy (each
# page allocated, filled, mapped and later reclaimed), and with POSIX_FADV_RANDOM it is also read
# a few pages at a time. Shorter ranges keep the page cache, and what it already holds.
DIRECT_MIN_BYTES = 1 << 20
O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux and the BSDs; elsewhere every read goes through the cache
# O_DIRECT wants the buffer, the offset and the length aligned to the device's logical block;
# a page covers every device here. The range is read rounded out to pages and returned as a view.
DIRECT_ALIGN = mmap.PAGESIZE
# The view of a range starts where the range lies in its first page; a range whose start is not
# 8-aligned (safetensors aligns its data so) is read through the page cache, so every tensor view is aligned.
VIEW_ALIGN = 8


def direct_applies(start: int, end: int) -> bool:
    return end - start >= DIRECT_MIN_BYTES and start % VIEW_ALIGN == 0


def _read_direct(path: str, fd: int, start: int, end: int) -> memoryview:
    """Bytes [start, end) read with O_DIRECT: the pages around them into an anonymous mapping
    (page-aligned), returned as a writable view of just the range."""
    a0 = start - start % DIRECT_ALIGN
    a1 = -(-end // DIRECT_ALIGN) * DIRECT_ALIGN
    # The mapping may be longer than the pages asked for (a reused one): read only those.
    view = memoryview(DIRECT_BUFFERS.take(a1 - a0))[: a1 - a0]
    _read_into(path, fd, view, a0, end - a0)
    return view[start - a0 : end - a0]


class DirectBuffers:
    """The anonymous mappings direct reads fill, lent to the readers that read into them and
    given back by those readers (RangeReader.release) once their callers use no view of them.

    The kernel zeroes a fresh mapping's pages as they are first touched, which costs more CPU
    than the read itself; a mapping given back is lent again with its pages already there. A
    read takes the smallest free mapping that holds it. Memory stays within what the reads held
    at their peak: a new mapping is made only when every free one is shorter, and free ones at
    least as large in all are dropped first, least recently given back first. All free ones go
    when the last open RangeReader closes."""

    # Long mappings are made in whole huge pages, so that slabs of about one size share them;
    # short ones in pages, so that rounding never adds more than a sixteenth.
    GRAIN = 2 << 20
    GRAIN_FROM = 16 * GRAIN

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []  # least recently given back first
        self._lent: dict[int, mmap.mmap] = {}
        self._readers = 0

    def take(self, size: int) -> mmap.mmap:
        """A mapping of at least `size` bytes, lent until given back."""
        grain = self.GRAIN if size >= self.GRAIN_FROM else mmap.PAGESIZE
        size = -(-size // grain) * grain
        with self._lock:
            fits = [m for m in self._free if len(m) >= size]
            if fits:  # the smallest that holds it: its pages beyond `size` stay as they are
                buf = min(fits, key=len)
                self._free.remove(buf)
            else:  # every free one is shorter: drop enough of them to make room for this one
                dropped = 0
                while self._free and dropped < size:
                    old = self._free.pop(0)
                    dropped += len(old)
                    _unmap(old)
                buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                if hasattr(mmap, "MADV_HUGEPAGE"):
                    buf.madvise(mmap.MADV_HUGEPAGE)  # a fault per 2 MiB, not per 4 KiB page
            self._lent[id(buf)] = buf
            return buf

    def give_back(self, maps: list[mmap.mmap]) -> None:
        with self._lock:
            for m in maps:
                if self._lent.pop(id(m), None) is not None:
                    self._free.append(m)

    def held(self) -> tuple[int, int]:
        """Bytes mapped, and bytes of them free."""
        with self._lock:
            free = sum(len(m) for m in self._free)
            return free + sum(len(m) for m in self._lent.values()), free

    def reader_opened(self) -> None:
        with self._lock:
            self._readers += 1

    def reader_closed(self) -> None:
        with self._lock:
            self._readers -= 1
            if self._readers:
                return
            for m in self._free:
                _unmap(m)
            self._free = []


def _unmap(m: mmap.mmap) -> None:
    """Unmap now, or, where a view is still alive (a caller gave back too early), when it goes."""
    try:
        m.close()
    except BufferError:
        pass


DIRECT_BUFFERS = DirectBuffers()


def _read_into(path: str, fd: int, view: memoryview, start: int, need: int) -> None:
    """Fill view from byte `start` of the file until at least `need` bytes are in (the view may
    be longer: an O_DIRECT read rounded out, which ends short at the end of the file)."""
    got = 0
    while got < need:
        try:
            n = os.preadv(fd, [view[got:]], start + got)
        except OSError as err:
            raise MergepipeError(f"{path}: read error at byte {start + got} ({err.strerror or err})") from err
        if n == 0:
            raise MergepipeError(
                f"{path}: short read at byte {start + got} (wanted {need} bytes from {start}); "
                "the file changed or was truncated"
            )
        got += n
