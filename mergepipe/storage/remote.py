"""Object-store I/O through fsspec (s3fs): exact ranged reads, listings, uploads, retries.

Reads use `cat_ranges` (no read-ahead cache, each range one GET with a Range header), a bounded
number in flight. Every call is retried on transient failures (5xx, throttling, resets,
timeouts, short bodies) with exponential backoff and full jitter; a body shorter than its
range is never accepted. Missing objects and denied access are not transient.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

from mergepipe.errors import BadInput, MergepipeError
from mergepipe.storage import cache, hub
from mergepipe.storage.fingerprints import FileFingerprint
from mergepipe.storage.location import HTTP, ContextPool, filesystem, fs_path, hub_token, protocol

log = logging.getLogger("mergepipe.storage")

T = TypeVar("T")

ATTEMPTS = int(os.environ.get("MERGEPIPE_REMOTE_ATTEMPTS", "6"))
CONCURRENCY = int(os.environ.get("MERGEPIPE_REMOTE_CONCURRENCY", "8"))
BACKOFF_BASE_S = float(os.environ.get("MERGEPIPE_REMOTE_BACKOFF_S", "0.2"))
BACKOFF_CAP_S = 10.0
HASH_CHUNK = 8 * 1024 * 1024
# Parts of the uploads open_writer makes (s3fs takes no part under 5 MiB); less goes in one PUT.
PART_SIZE = int(os.environ.get("MERGEPIPE_UPLOAD_PART_SIZE", str(64 * 1024 * 1024)))
# The store's smallest part of a multipart upload but the last (S3's rule: 5 MiB), and its
# largest (5 GiB). Settable for stores with other rules, and for tests on small objects.
MIN_PART_SIZE = int(os.environ.get("MERGEPIPE_MIN_PART_SIZE", str(5 * 1024 * 1024)))
MAX_PART_SIZE = 5 * 1024**3
MAX_PARTS = 10_000
# Fetched ahead per layer group by default: a fraction of a second of a fast link, so that the
# link stays busy while the group merges what it read before.
READ_AHEAD = 64 * 1024 * 1024
# A rate limit's wait: at least a moment (a 429 that names none), at most ten minutes (the Hub's
# windows are five), and at most so many in a row for one call before it gives up.
RATE_LIMIT_WAIT_MIN_S = 0.5
RATE_LIMIT_WAIT_CAP_S = 600.0
RATE_LIMIT_WAITS = 20
# A signed URL is resolved again this long before it says it expires (or a tenth of its life);
# a range refused by a storage host is read from so many fresh URLs at most.
STALE_MARGIN_S = 10.0
REFRESHES = 4


class ShortRead(OSError):
    """A body shorter (or longer) than the range asked for."""


# errno values s3fs gives to S3 errors that a retry cannot fix (bad request, too large,
# redirect, not allowed, …); 5xx and throttling map to EBUSY/EREMOTEIO and stay retryable.
_PERMANENT_ERRNOS = {
    errno.EINVAL,
    errno.ENAMETOOLONG,
    errno.EMSGSIZE,
    errno.ENOSYS,
    errno.EPERM,
    errno.ENOTEMPTY,
    getattr(errno, "EREMCHG", errno.ENOENT),
}


def _botocore_permanent(exc: BaseException) -> bool:
    """botocore's own errors (no credentials, bad parameters, no region, …) are permanent;
    its connection, timeout and body-streaming errors are not."""
    try:
        from botocore import exceptions as bx
    except ImportError:
        return False
    retryable = (bx.HTTPClientError, bx.IncompleteReadError, bx.ResponseStreamingError)
    return isinstance(exc, bx.BotoCoreError) and not isinstance(exc, retryable)


def _http_status(exc: BaseException) -> int | None:
    """The status of an HTTP error response: aiohttp's (fsspec's HTTP filesystem raises it) or
    huggingface_hub's (its error keeps the response)."""
    status = getattr(exc, "status", None)
    if type(exc).__name__ == "ClientResponseError" and isinstance(status, int):
        return status
    status = getattr(getattr(exc, "response", None), "status_code", None)
    hub_error = any(c.__name__ == "HfHubHTTPError" for c in type(exc).__mro__)
    return status if hub_error and isinstance(status, int) else None


def _headers_of(exc: BaseException | None) -> dict | None:
    headers = getattr(exc, "headers", None) or getattr(getattr(exc, "response", None), "headers", None)
    return dict(headers) if headers else None


def retry_after(exc: BaseException | None) -> float:
    """Seconds a 429 or 503 answer asked the client to wait (Retry-After, or a RateLimit
    header's reset), at most RATE_LIMIT_WAIT_CAP_S."""
    return min(RATE_LIMIT_WAIT_CAP_S, hub.rate_limit_wait(_headers_of(exc)) or 0.0)


def is_transient(exc: BaseException) -> bool:
    status = _http_status(exc)
    if status is not None:
        return status == 429 or status == 408 or status >= 500
    if isinstance(
        exc, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError, BadInput)
    ):
        return False
    if isinstance(exc, OSError) and exc.errno in _PERMANENT_ERRNOS:
        return False
    if _botocore_permanent(exc):
        return False
    return isinstance(exc, Exception)


def _is_credentials_error(exc: BaseException) -> bool:
    return type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError")


def final_error(exc: BaseException, uri: str, what: str) -> Exception:
    """The error a user sees, naming the object."""
    if isinstance(exc, FileNotFoundError):
        return BadInput(f"{uri}: object not found")
    status = _http_status(exc)
    if status in (401, 403):
        return BadInput(f"{uri}: access denied ({status}, {what}); a token with access to it is needed")
    if status is not None and status < 500 and status not in (408, 429):
        return BadInput(f"{uri}: {what} refused by the server ({status})")
    if isinstance(exc, PermissionError):
        return BadInput(f"{uri}: access denied ({what})")
    if _is_credentials_error(exc):
        return BadInput(
            f"{uri}: no usable credentials ({exc}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or the config's storage_options"
        )
    if isinstance(exc, BadInput):
        return exc
    tried = f" after {ATTEMPTS} attempts" if is_transient(exc) else ""
    return MergepipeError(f"{uri}: {what} failed{tried}: {type(exc).__name__}: {exc}")


def backoff(attempt: int) -> float:
    return random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt))


class Gate:
    """A host's rate limit, shared by every request this process sends it: a 429 closes the
    gate for as long as the answer asks, and every request waits for it to open again, rather
    than each one trying (and being refused) on its own."""

    def __init__(self, host: str) -> None:
        self.host = host
        self._lock = threading.Lock()
        self._until = 0.0

    def wait(self) -> None:
        while True:
            with self._lock:
                left = self._until - time.monotonic()
            if left <= 0:
                return
            time.sleep(left)

    def hold(self, seconds: float) -> float:
        """Close the gate for `seconds` from now; returns the wait this adds (0 when the gate
        was already closed as long), so that the wait is told and counted once."""
        seconds = min(RATE_LIMIT_WAIT_CAP_S, max(seconds, RATE_LIMIT_WAIT_MIN_S))
        with self._lock:
            now = time.monotonic()
            added = now + seconds - max(self._until, now)
            if added <= 0:
                return 0.0
            self._until = now + seconds
        who = "the Hub" if hub.on_endpoint(f"{self.host}/") else self.host
        log.warning("rate-limited by %s: resuming in %.0f s", who, seconds)
        return added


_gates: dict[str, Gate] = {}
_gates_lock = threading.Lock()


def gate(uri: str) -> Gate:
    """The rate-limit gate of a URL's host (scheme and authority)."""
    parts = urlsplit(uri)
    host = f"{parts.scheme}://{parts.netloc}"
    with _gates_lock:
        return _gates.setdefault(host, Gate(host))


def _rate_limited(exc: BaseException, uri: str, events: Events | None, at: int | None) -> bool:
    """A 429: the host's gate closed as the answer asks, the answer and the wait it added told
    to `events`; False for any other error."""
    if _http_status(exc) != 429:
        return False
    added = gate(uri).hold(hub.rate_limit_wait(_headers_of(exc)) or RATE_LIMIT_WAIT_MIN_S)
    if events is not None:
        events.rate_limited(at, added)
    return True


def retrying(uri: str, what: str, call: Callable[[], T], events: Events | None = None, at: int | None = None) -> T:
    """`call`, tried again on transient failures (with backoff) and after rate limits (as long
    as the server asks, not counted as failures); `events` hears of the rate limits."""
    attempt = waits = 0
    while True:
        if protocol(uri) in HTTP:
            gate(uri).wait()
        try:
            return call()
        except Exception as exc:
            if waits < RATE_LIMIT_WAITS and _rate_limited(exc, uri, events, at):
                waits += 1  # a wait the server asked for, not a failure
                continue
            attempt += 1
            if not is_transient(exc) or attempt >= ATTEMPTS:
                raise final_error(exc, uri, what) from exc
            log.info("%s: %s: transient %s, retrying", uri, what, type(exc).__name__)
            time.sleep(max(backoff(attempt), retry_after(exc)))


class Events:
    """What fetch tells its caller besides the bytes, by the position of the item concerned:
    ranges asked for again after a failure, Hub files resolved (a first time or again), and
    waits a rate limit imposed. The defaults ignore them."""

    def retried(self, positions: list[int]) -> None: ...

    def resolved(self, at: int) -> None: ...

    def rate_limited(self, at: int | None, seconds: float) -> None: ...


@dataclass(frozen=True)
class Located:
    """Where a Hub file's bytes are read now: `url` (a signed URL when `redirected`), until
    `stale_at` (time.time(); None when the URL states no expiry)."""

    url: str
    redirected: bool
    stale_at: float | None

    def stale(self) -> bool:
        return self.stale_at is not None and time.time() >= self.stale_at


class Locations:
    """Each Hub file resolved once per process (per token: a signed URL got with one token
    is never lent to a merge without it), and again when its URL goes stale or is refused.
    Threads that need the same file at once wait for one resolve."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], Located] = {}
        self._resolving: dict[tuple[str, str], threading.Lock] = {}

    @staticmethod
    def _key(uri: str, tok: str | None) -> tuple[str, str]:
        return uri, hashlib.sha256((tok or "").encode()).hexdigest()

    def get(self, uri: str, tok: str | None, events: Events, at: int, refused: Located | None = None) -> Located:
        """Where to read `uri`; `refused`: the location just refused, resolved again (unless
        another thread has done so meanwhile)."""
        key = self._key(uri, tok)
        with self._lock:
            held = self._held.get(key)
            if held is not None and held != refused and not held.stale():
                return held
            single = self._resolving.setdefault(key, threading.Lock())
        with single:
            with self._lock:
                held = self._held.get(key)
            if held is not None and held != refused and not held.stale():
                return held
            url = retrying(uri, "resolve", lambda: hub.resolve(uri, tok), events, at)
            events.resolved(at)
            expires = hub.expiry(url) if url != uri else None
            # Refreshed a little before it expires: a tenth of its life, at most STALE_MARGIN_S.
            margin = 0.0 if expires is None else min(STALE_MARGIN_S, max(0.0, expires - time.time()) / 10)
            located = Located(url, url != uri, None if expires is None else expires - margin)
            with self._lock:
                self._held[key] = located
            return located


LOCATIONS = Locations()


def _backend(uri: str) -> tuple:
    """What one filesystem may serve together: the same scheme, and for HTTP the same host with
    the same credentials (the Hub's token goes to its endpoint only)."""
    proto = protocol(uri)
    if proto in HTTP:
        return proto, urlsplit(uri).netloc, hub.on_endpoint(uri)
    return (proto,)


def fetch(items: list[tuple[str, int, int]], events: Events | None = None) -> list[bytearray]:
    """The bytes of each (uri, start, end) range, fetched concurrently (at most CONCURRENCY in
    flight per host and credentials). Hub files are read from where they resolve to (Locations);
    a signed URL refused by its storage host (expired) is resolved again, once per range, and
    read again. Ranges that fail are fetched again, whole, each time told to `events`."""
    events = events or Events()
    if not items:
        return []
    out: list[bytearray | None] = [bytearray() if e <= s else None for _, s, e in items]
    todo = [i for i, v in enumerate(out) if v is None]
    tok = hub.token(hub_token()) if any(hub.resolvable(u) for u, _, _ in items) else None
    located: dict[str, Located] = {}
    refused: dict[str, Located] = {}
    refreshes: dict[int, int] = defaultdict(int)  # per range: URLs resolved anew after a refusal
    last: BaseException | None = None
    attempt = waits = 0
    while todo:
        for i in todo:
            uri = items[i][0]
            if hub.resolvable(uri) and (uri not in located or uri in refused or located[uri].stale()):
                located[uri] = LOCATIONS.get(uri, tok, events, i, refused.pop(uri, None))
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i in todo:
            groups[_backend(_target(items[i][0], located))].append(i)
        failed, again, limited = [], [], False

        def cat(idx: list[int]) -> list:
            first = _target(items[idx[0]][0], located)
            if protocol(first) in HTTP:
                gate(first).wait()
            return filesystem(first).cat_ranges(
                [fs_path(_target(items[i][0], located)) for i in idx],
                [items[i][1] for i in idx],
                [items[i][2] for i in idx],
                on_error="return",
                batch_size=CONCURRENCY,
            )

        if len(groups) == 1:
            answers = [cat(next(iter(groups.values())))]
        else:  # each host at once (a Hub's storage host beside a mirror's)
            with ContextPool(len(groups)) as pool:
                answers = list(pool.map(cat, groups.values()))
        for idx, got in zip(groups.values(), answers):
            for i, data in zip(idx, got):
                uri, start, end = items[i]
                where = located.get(uri)
                if isinstance(data, BaseException):
                    status = _http_status(data)
                    refusal = where is not None and where.redirected and status in (400, 403)
                    # Expired (by its clock), or refused: a new resolve gives a fresh URL. Once; again
                    # only where the fresh one has expired meanwhile (a slow read of short-lived URLs).
                    if refusal and (not refreshes[i] or (where.stale() and refreshes[i] < REFRESHES)):
                        refreshes[i] += 1
                        refused[uri] = where
                        again.append(i)
                        continue
                    if refusal:  # not the user's input: the Hub gave a URL its storage host refuses
                        raise MergepipeError(
                            f"{uri}: the storage host it redirects to refused a freshly resolved URL "
                            f"({status}, read of bytes {start}-{end})"
                        ) from data
                    if _rate_limited(data, _target(uri, located), events, i):
                        limited = True
                        again.append(i)
                        continue
                    if not is_transient(data):
                        raise final_error(data, uri, f"read of bytes {start}-{end}") from data
                    last = data
                    failed.append(i)
                elif len(data) != end - start:
                    last = ShortRead(f"got {len(data)} bytes for the {end - start}-byte range {start}-{end}")
                    failed.append(i)
                else:
                    out[i] = bytearray(data)
        if again:
            events.retried(again)
        if limited:
            waits += 1
            if waits > RATE_LIMIT_WAITS:
                raise MergepipeError(f"{items[again[0]][0]}: still rate-limited after {RATE_LIMIT_WAITS} waits")
        if failed:
            attempt += 1
            if attempt >= ATTEMPTS:
                uri, start, end = items[failed[0]]
                raise final_error(last, uri, f"read of bytes {start}-{end}")
            log.info("%s: %d ranged reads failed (%s), retrying", items[failed[0]][0], len(failed), type(last).__name__)
            events.retried(failed)
            time.sleep(max(backoff(attempt), retry_after(last)))
        todo = sorted(again + failed)
    return out  # type: ignore[return-value]


def _target(uri: str, located: dict[str, Located]) -> str:
    where = located.get(uri)
    return uri if where is None else where.url


def pin(uri: str) -> str:
    """The root URL of the commit a Hub location (hf://ORG/NAME[@REVISION]) names now (or, in a
    run that pins once, named when the run first looked: hub.one_commit_per_run)."""
    return hub.pinned(uri, lambda: retrying(uri, "revision lookup", lambda: hub.lookup(uri, hub_token())))


def read_ranges(uri: str, ranges: list[tuple[int, int]]) -> list[bytearray]:
    return fetch([(uri, s, e) for s, e in ranges])


def read_all(uri: str) -> bytes:
    """A whole small object (index json, config, manifest)."""
    fs = filesystem(uri)
    return retrying(uri, "read", lambda: fs.cat_file(fs_path(uri)))


def stat(uri: str) -> FileFingerprint | None:
    """The object's fingerprint, or None when there is no object at that key."""
    if protocol(uri) in HTTP:
        known = hub.stat(uri)
        if known is not False:
            return known
    fs = filesystem(uri)

    def call():
        try:
            info = fs.info(fs_path(uri))
        except FileNotFoundError:
            return None
        if info.get("type") != "file":
            return None
        etag = (info.get("ETag") or info.get("etag") or "").strip('"') or None
        return FileFingerprint(size=int(info["size"]), etag=etag, version_id=info.get("VersionId") or None)

    fp = retrying(uri, "stat", call)
    if fp is not None:
        cache.pin(uri, fp.version_id or fp.etag)  # the version a cache keeps this object's bytes under
    return fp


def list_folder(uri: str, names: tuple[str, ...] = ()) -> list[str] | None:
    """Names of the objects directly under a prefix; None when nothing is there. An http(s)
    folder cannot be listed: those of `names` that are there (a pinned Hub commit is listed)."""
    if protocol(uri) in HTTP:
        listed = hub.list_commit(uri)
        if listed is not False:
            return listed  # type: ignore[return-value]
        with ContextPool(8) as pool:  # asked for by name, in parallel
            there = list(pool.map(lambda n: stat(f"{uri.rstrip('/')}/{n}") is not None, names))
        return sorted(n for n, found in zip(names, there) if found) or None
    fs = filesystem(uri)
    path = fs_path(uri).rstrip("/")

    def call():
        try:
            entries = fs.ls(path, detail=True)
        except FileNotFoundError:
            return None
        return sorted(e["name"].rsplit("/", 1)[-1] for e in entries if e.get("type") == "file")

    names = retrying(uri, "list", call)
    return names or None


def check_bucket(uri: str) -> None:
    """Fail early, and clearly, when the bucket of a URI is not there."""
    fs = filesystem(uri)
    bucket = fs_path(uri).split("/", 1)[0]
    if not retrying(uri, "bucket check", lambda: fs.exists(bucket)):
        raise BadInput(f"{uri}: bucket {bucket!r} not found (or not accessible with these credentials)")


def list_tree(uri: str) -> list[str]:
    """Every object under a prefix, as paths relative to it."""
    return sorted(list_objects(uri))


def sha256(uri: str, size: int, progress: Callable[[int], None] | None = None) -> str:
    """Hash an object by streaming it in ranged reads of HASH_CHUNK bytes."""
    h = hashlib.sha256()
    for start in range(0, size, HASH_CHUNK):
        (chunk,) = read_ranges(uri, [(start, min(size, start + HASH_CHUNK))])
        h.update(chunk)
        if progress:
            progress(len(chunk))
    return h.hexdigest()


def put_bytes(uri: str, data: bytes) -> None:
    """A small object, written in one PUT."""
    fs = filesystem(uri)
    retrying(uri, "write", lambda: fs.pipe_file(fs_path(uri), data))


def read_if_present(uri: str) -> bytes | None:
    """A whole small object, or None when there is none at that key."""
    fs = filesystem(uri)

    def call():
        try:
            return fs.cat_file(fs_path(uri))
        except FileNotFoundError:
            return None

    return retrying(uri, "read", call)


def read_ahead_bytes() -> int:
    """The most bytes of remote ranges one layer group fetches ahead of its merge and holds
    until read (storage.reader.RangeReader.read_ahead): MERGEPIPE_READ_AHEAD, 0 for none."""
    return max(0, int(os.environ.get("MERGEPIPE_READ_AHEAD", str(READ_AHEAD))))


def write_part_size() -> int:
    """The part size of open_writer's uploads."""
    return max(PART_SIZE, 5 << 20)


def open_writer(uri: str):
    """A file object whose writes go to the object in parts of write_part_size() (a multipart
    upload, or one PUT for less), the object appearing at close(); discard() drops it instead.
    At most one part is held in memory, besides the one being sent."""
    fs = filesystem(uri)
    return retrying(uri, "open for writing", lambda: fs.open(fs_path(uri), "wb", block_size=write_part_size()))


def list_objects(uri: str) -> dict[str, FileFingerprint]:
    """Every object under a prefix (by path relative to it), with its size and ETag."""
    fs = filesystem(uri)
    path = fs_path(uri).rstrip("/")

    def call():
        try:
            found = fs.find(path, detail=True)
        except FileNotFoundError:
            return {}
        return {
            name[len(path) + 1 :]: FileFingerprint(
                size=int(info["size"]), etag=(info.get("ETag") or info.get("etag") or "").strip('"') or None
            )
            for name, info in found.items()
            if name.startswith(path + "/") and info.get("type", "file") == "file"
        }

    return retrying(uri, "list", call)


def copy(src: str, dst: str) -> None:
    """A server-side copy of one object (multipart above the store's single-copy limit)."""
    fs = filesystem(dst)
    retrying(dst, "copy", lambda: fs.copy(fs_path(src), fs_path(dst)))


def compose(uri: str, parts: list[tuple[bool, list[tuple[str, int, int]]]]) -> int:
    """Make the object at `uri` from `parts` in order, in one multipart upload: a part (True,
    [(src, start, end)]) is a server-side copy of that range of `src`; a part (False, ranges)
    is those ranges read here and sent (so that every part but the last is at least
    MIN_PART_SIZE). Returns the bytes read and sent. An upload that fails is aborted."""
    fs = filesystem(uri)
    bucket, key = fs_path(uri).split("/", 1)
    mpu = retrying(uri, "start upload", lambda: fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key))
    upload_id = mpu["UploadId"]
    sent, done = 0, []
    try:
        for number, (server_side, ranges) in enumerate(parts, start=1):
            kw = {"Bucket": bucket, "Key": key, "UploadId": upload_id, "PartNumber": number}
            if server_side:
                ((src, start, end),) = ranges
                out = retrying(
                    uri,
                    f"copy of part {number}",
                    lambda kw=kw, src=src, start=start, end=end: fs.call_s3(
                        "upload_part_copy", CopySource=fs_path(src), CopySourceRange=f"bytes={start}-{end - 1}", **kw
                    ),
                )
                etag = out["CopyPartResult"]["ETag"]
            else:
                body = b"".join(fetch(ranges))
                out = retrying(
                    uri, f"upload of part {number}", lambda kw=kw, body=body: fs.call_s3("upload_part", Body=body, **kw)
                )
                etag = out["ETag"]
                sent += len(body)
            done.append({"PartNumber": number, "ETag": etag})
        retrying(
            uri,
            "completing the upload",
            lambda: fs.call_s3(
                "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done}
            ),
        )
    except BaseException:
        try:
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception:  # the store drops it by its own lifecycle rules
            log.info("%s: could not abort the multipart upload %s", uri, upload_id)
        raise
    fs.invalidate_cache(fs_path(uri))
    return sent


def delete_tree(uri: str) -> None:
    """Every object under a prefix."""
    fs = filesystem(uri)
    path = fs_path(uri).rstrip("/")

    def call():
        try:
            fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    retrying(uri, "delete", call)


def delete(uris: list[str]) -> None:
    for uri in uris:
        fs = filesystem(uri)

        def call(fs=fs, uri=uri):
            try:
                fs.rm_file(fs_path(uri))
            except FileNotFoundError:
                pass

        retrying(uri, "delete", call)
