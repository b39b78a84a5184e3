"""Output leases: at most one run works on a given output at a time. The lease is a small file
(or object) beside the output, created only if absent; its holder rewrites it as a heartbeat and
removes it when done. A lease whose heartbeat stopped (its holder died) is taken over, by a
swap that only one taker can win: a rename on local disk, a PUT conditional on the stale
object's ETag in an object store."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from mergepipe.errors import MergepipeError
from mergepipe.storage.location import filesystem, fs_path, is_remote, join, split

LEASE_MARK = ".mergepipe-lease"


class OutputBusy(MergepipeError):
    """Another live run holds the output's lease."""


@dataclass(frozen=True)
class Holder:
    owner: str  # host:pid:token of the process
    run: str | None  # its flow run id, when it is one
    since: float  # when it took the lease (epoch seconds)


def lease_location(out: str) -> str:
    parent, name = split(out)
    return join(parent, f".{name}{LEASE_MARK}")


def _body(holder: Holder, beat: float) -> bytes:
    return json.dumps({"owner": holder.owner, "run": holder.run, "since": holder.since, "heartbeat": beat}).encode()


def _parse(data: bytes) -> tuple[Holder, float] | None:
    try:
        d = json.loads(data)
        return Holder(d["owner"], d.get("run"), float(d["since"])), float(d["heartbeat"])
    except (ValueError, KeyError, TypeError):
        return None


class OutputLease:
    """The lease on `out` for `holder`: acquire() once, beat() every so often, release() at the end."""

    def __init__(self, out: str, holder: Holder, stale_seconds: float) -> None:
        self.out, self.holder, self.stale = out, holder, stale_seconds
        self.location = lease_location(out)
        self._etag: str | None = None  # of our object, in a store

    # -- one implementation per kind of location: create if absent, read, replace, remove --

    def _create(self, data: bytes) -> bool:
        if is_remote(self.location):
            fs = filesystem(self.location)
            try:
                with fs.open(fs_path(self.location), "xb") as f:  # a PUT with If-None-Match: *
                    f.write(data)
            except (FileExistsError, OSError) as err:
                if isinstance(err, FileExistsError) or _precondition_failed(err):
                    return False
                raise
            self._etag = _etag(fs, self.location)
            return True
        path = Path(self.location)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True

    def _read(self) -> tuple[bytes, str | None] | None:
        """The lease's bytes and version (ETag, or the file's inode and mtime); None if absent."""
        if is_remote(self.location):
            fs = filesystem(self.location)
            # The version first: if the lease is replaced before its bytes are read, a swap
            # conditioned on the older version fails, as it should. Either read finds it gone
            # when its holder releases it in between.
            try:
                version = _etag(fs, self.location)
                data = fs.cat_file(fs_path(self.location))
            except FileNotFoundError:
                return None
            return data, version
        try:
            with open(self.location, "rb") as f:
                st = os.fstat(f.fileno())
                return f.read(), f"{st.st_ino}:{st.st_mtime_ns}"
        except FileNotFoundError:
            return None

    def _swap(self, version: str | None, data: bytes) -> bool:
        """Replace the lease if it is still at `version`; False when another process got there first."""
        if is_remote(self.location):
            fs = filesystem(self.location)
            bucket, key = fs_path(self.location).split("/", 1)
            try:
                fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfMatch=version)
            except Exception as err:  # another process replaced or removed it first
                if isinstance(err, FileNotFoundError) or _precondition_failed(err):
                    return False
                raise
            fs.invalidate_cache(fs_path(self.location))
            self._etag = _etag(fs, self.location)
            return True
        # Local: move the stale lease aside (one process wins the rename), then create ours.
        aside = f"{self.location}.stale-{self.holder.owner.replace(':', '-')}"
        try:
            os.rename(self.location, aside)
        except FileNotFoundError:
            return False
        os.unlink(aside)
        return self._create(data)

    def _remove(self) -> None:
        if is_remote(self.location):
            fs = filesystem(self.location)
            try:
                fs.rm_file(fs_path(self.location))
            except FileNotFoundError:
                pass
            return
        try:
            os.unlink(self.location)
        except FileNotFoundError:
            pass

    # -- the protocol --

    def acquire(self) -> None:
        """Take the lease, or take over one whose holder is gone: a process of this host that
        no longer runs at once, any other once its heartbeat is `stale` seconds old. OutputBusy
        when a live run holds it: one that beat within a third of `stale` (it beats six times
        as often). A lease whose heartbeat is older than that (its holder most likely died, as
        when a crashed run is retried at once) is waited for until it is stale."""
        for _ in range(1000):
            now = time.time()
            if self._create(_body(self.holder, now)):
                return
            found = self._read()
            if found is None:
                continue  # released meanwhile: try again
            data, version = found
            parsed = _parse(data)
            if parsed is not None and not _gone(parsed[0]) and now - parsed[1] < self.stale:
                holder, beat = parsed
                if now - beat < self.stale / 3:
                    raise OutputBusy(
                        f"{self.out}: another run is merging to this output ({_describe(holder)}, last seen "
                        f"{now - beat:.0f} s ago); stopping before reading anything. Run it again when that "
                        f"run has finished (a lease unrenewed for {self.stale:g} s is taken over)"
                    )
                time.sleep(min(1.0, self.stale - (now - beat)))
                continue
            if self._swap(version, _body(self.holder, now)):
                return
        raise OutputBusy(f"{self.out}: could not take the output's lease ({self.location}): other runs keep taking it")

    def beat(self) -> None:
        """Renew the lease (a heartbeat)."""
        data = _body(self.holder, time.time())
        if is_remote(self.location):
            if not self._swap(self._etag, data):
                raise OutputBusy(f"{self.out}: the output's lease was taken over by another run")
            return
        found = self._read()
        parsed = _parse(found[0]) if found else None
        if parsed is None or parsed[0].owner != self.holder.owner:
            raise OutputBusy(f"{self.out}: the output's lease was taken over by another run")
        tmp = f"{self.location}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self.location)

    def release(self) -> None:
        """Give the lease back, if it is still ours."""
        found = self._read()
        parsed = _parse(found[0]) if found else None
        if parsed is not None and parsed[0].owner == self.holder.owner:
            self._remove()


def _precondition_failed(err: BaseException) -> bool:
    """S3's 412 (a conditional write refused), as s3fs reports it."""
    text = str(err).lower()
    return "precondition" in text or "pre-condition" in text or "412" in text


def _gone(holder: Holder) -> bool:
    """Whether the holder was a process of this host that no longer runs."""
    host, pid, _ = (holder.owner.rsplit(":", 2) + ["", ""])[:3]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _etag(fs, location: str) -> str | None:
    fs.invalidate_cache(fs_path(location))
    info = fs.info(fs_path(location))
    return (info.get("ETag") or info.get("etag") or "").strip('"') or None


def _describe(holder: Holder) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.since))
    run = f"flow run {holder.run}, " if holder.run else ""
    return f"{run}process {holder.owner}, since {since}"
