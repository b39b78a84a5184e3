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
import time
from collections.abc import Callable
from typing import TypeVar

from mergepipe.errors import BadInput, MergepipeError
from mergepipe.storage import hub
from mergepipe.storage.fingerprints import FileFingerprint
from mergepipe.storage.location import HTTP, filesystem, fs_path, hub_token, protocol

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
    """The status of an HTTP error response (aiohttp's, as fsspec's HTTP filesystem raises)."""
    status = getattr(exc, "status", None)
    return status if type(exc).__name__ == "ClientResponseError" and isinstance(status, int) else None


def retry_after(exc: BaseException | None) -> float:
    """Seconds a 429 or 503 answer asked the client to wait (Retry-After), at most a minute."""
    headers = getattr(exc, "headers", None) or {}
    try:
        return min(60.0, max(0.0, float(headers.get("Retry-After", 0))))
    except (TypeError, ValueError):
        return 0.0


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


def retrying(uri: str, what: str, call: Callable[[], T]) -> T:
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return call()
        except Exception as exc:
            if not is_transient(exc) or attempt == ATTEMPTS:
                raise final_error(exc, uri, what) from exc
            log.info("%s: %s: transient %s, retrying", uri, what, type(exc).__name__)
            time.sleep(max(backoff(attempt), retry_after(exc)))
    raise AssertionError("unreachable")


def fetch(items: list[tuple[str, int, int]], on_retry: Callable[[list[int]], None] | None = None) -> list[bytearray]:
    """The bytes of each (uri, start, end) range, fetched concurrently (at most CONCURRENCY in
    flight); ranges that fail are fetched again, whole, each time told to `on_retry` (their
    positions in `items`). All URIs share one protocol."""
    if not items:
        return []
    fs = filesystem(items[0][0])
    out: list[bytearray | None] = [bytearray() if e <= s else None for _, s, e in items]
    todo = [i for i, v in enumerate(out) if v is None]
    last: BaseException | None = None
    for attempt in range(1, ATTEMPTS + 1):
        if not todo:
            break
        got = fs.cat_ranges(
            [fs_path(items[i][0]) for i in todo],
            [items[i][1] for i in todo],
            [items[i][2] for i in todo],
            on_error="return",
            batch_size=CONCURRENCY,
        )
        failed = []
        for i, data in zip(todo, got):
            uri, start, end = items[i]
            if isinstance(data, BaseException):
                if not is_transient(data):
                    raise final_error(data, uri, f"read of bytes {start}-{end}") from data
                last = data
                failed.append(i)
            elif len(data) != end - start:
                last = ShortRead(f"got {len(data)} bytes for the {end - start}-byte range {start}-{end}")
                failed.append(i)
            else:
                out[i] = bytearray(data)
        todo = failed
        if todo and attempt < ATTEMPTS:
            log.info("%s: %d ranged reads failed (%s), retrying", items[todo[0]][0], len(todo), type(last).__name__)
            if on_retry:
                on_retry(todo)
            time.sleep(max(backoff(attempt), retry_after(last)))
    if todo:
        uri, start, end = items[todo[0]]
        raise final_error(last, uri, f"read of bytes {start}-{end}")
    return out  # type: ignore[return-value]


def pin(uri: str) -> str:
    """The root URL of the commit a Hub location (hf://ORG/NAME[@REVISION]) names now."""
    return retrying(uri, "revision lookup", lambda: hub.lookup(uri, hub_token()))


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

    return retrying(uri, "stat", call)


def list_folder(uri: str, names: tuple[str, ...] = ()) -> list[str] | None:
    """Names of the objects directly under a prefix; None when nothing is there. An http(s)
    folder cannot be listed: those of `names` that are there (a pinned Hub commit is listed)."""
    if protocol(uri) in HTTP:
        return hub.list_folder(uri, names, lambda n: stat(f"{uri.rstrip('/')}/{n}") is not None)
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
