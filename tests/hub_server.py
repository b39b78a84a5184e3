"""A Hub-shaped HTTP server on loopback for the tests: models under the Hub's URL layout
(`/ORG/NAME/resolve/REVISION/FILE`, with Range requests, ETags and the commit header), the
API answer `huggingface_hub.HfApi.model_info` asks for, and the same files as a plain folder
(`/mirror/ORG/NAME/FILE`, an https:// mirror's shape). It counts the body bytes it sends per
request (what crossed the wire, not what mergepipe says it read), can fail a share of the
file requests (503 with Retry-After, connections reset, bodies cut short), and keeps private
models behind a token.

As the real Hub does for large files, it can answer a resolve of an LFS file with a 302 to a
storage server on another origin (`redirect`): a signed URL that expires (`url_ttl`) and that
refuses a request carrying an Authorization header, as S3 and CloudFront do. It can also rate
limit the resolves (`resolve_limit` per `resolve_window`: 429 with Retry-After and RateLimit
headers), as the Hub's "resolvers" quota does."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import random
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

TOKEN = "hf_test_secret_token_0123456789"
CHUNK = 64 * 1024  # paced writes, when the link is capped
BURST = 512 * 1024


@dataclass
class Repo:
    private: bool = False
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)

    def commit(self, rev: str) -> str | None:
        return rev if rev in self.commits else self.refs.get(rev)


@dataclass
class Sent:
    method: str
    path: str
    status: int
    body: int  # bytes of body written to the socket
    range: str | None
    headers: dict[str, str] = field(default_factory=dict)  # the request's
    host: str = "hub"  # or "storage"
    file: str = ""  # storage: the resolve path the signed URL was issued for (the blob's path says no name)


def _handler(serve, host: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self.file = ""  # one handler answers every request of a kept-alive connection
            serve(self, head=True)

        def do_GET(self) -> None:
            self.file = ""
            serve(self, head=False)

    Handler.host = host
    return Handler


def _start(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


class HubServer:
    def __init__(
        self,
        rate: float | None = None,
        latency: float = 0.0,
        *,
        redirect: bool = False,
        url_ttl: float = 3600.0,
        resolve_limit: int | None = None,
        resolve_window: float = 300.0,
    ) -> None:
        """rate: the link's bandwidth in bytes per second, shared by every connection (None:
        as fast as loopback goes). latency: seconds before each answer starts (a round trip to
        a distant server; each request waits it, whatever else is in flight). redirect: resolves
        of LFS files answer 302 to `self.storage` (a URL signed for url_ttl seconds).
        resolve_limit: resolves (GET or HEAD) allowed per fixed window of resolve_window
        seconds, past which they get 429 (None: no limit). All four may be changed later."""
        self.rate = rate
        self.latency = latency
        self.redirect = redirect
        self.url_ttl = url_ttl
        self.resolve_limit = resolve_limit
        self.resolve_window = resolve_window
        self.rate_limited = 0
        self._resolves = 0  # not in the log alone: GET /_log forgets the log, /_resolves must not
        self._window: tuple[float, int] | None = None  # (start, resolves counted in it)
        self._hashes: dict[tuple[int, str], tuple[bytes, str]] = {}  # (id(bytes), algorithm) -> (bytes, digest)
        self._tokens, self._at = float(BURST), time.monotonic()  # the capped link's token bucket
        self.repos: dict[str, Repo] = {}
        self.log: list[Sent] = []
        self.fail_share = 0.0
        self.failed = 0
        self._rng = random.Random(1234)
        self._lock = threading.Lock()
        self.httpd, self.endpoint = _start(_handler(self._serve, "hub"))
        # Always running, so that `redirect` may be turned on after construction.
        self.storage = StorageServer(self)

    def close(self) -> None:
        self.storage.close()
        self.httpd.shutdown()
        self.httpd.server_close()

    # ------------------------------------------------------------------ content

    def publish(self, repo: str, folder: Path, *, branch: str = "main", private: bool = False) -> str:
        """A commit holding the folder's files, on `branch`; returns its sha."""
        files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
        sha = hashlib.sha1(
            json.dumps({n: self._hash(d) for n, d in files.items()}, sort_keys=True).encode()
        ).hexdigest()
        r = self.repos.setdefault(repo, Repo(private=private))
        r.private = private
        r.commits[sha] = files
        r.refs[branch] = sha
        for name, data in files.items():
            if name.endswith(".safetensors"):
                self.storage.keep(self._hash(data), data, f"/{repo}/resolve/{branch}/{name}")
        return sha

    def _hash(self, data: bytes, algorithm: str = "sha256") -> str:
        """A published file's digest, computed once: a Hub serves its stored hashes, and hashing a
        large shard on every request would make the server, not the link, the bound."""
        key = (id(data), algorithm)
        with self._lock:
            held = self._hashes.get(key)
        if held is not None and held[0] is data:
            return held[1]
        digest = hashlib.new(algorithm, data).hexdigest()
        with self._lock:
            self._hashes[key] = (data, digest)  # holding the bytes keeps their id from being reused
        return digest

    def wire_bytes(self, pattern: str = r"\.safetensors$") -> int:
        """Body bytes sent for file requests whose path matches, by either host (a storage
        request matches by the resolve path that redirected to it)."""
        with self._lock:
            return sum(s.body for s in self.log if re.search(pattern, s.file or s.path))

    def resolves(self) -> int:
        """Requests (GET or HEAD, any answer) to a /resolve/ path since reset_log."""
        with self._lock:
            return self._resolves

    def storage_requests(self) -> list[Sent]:
        with self._lock:
            return [s for s in self.log if s.host == "storage"]

    def reset_log(self) -> None:
        """Forgets the log and the counters, and starts the resolve limit's window afresh."""
        with self._lock:
            self.log.clear()
            self.failed = 0
            self.rate_limited = 0
            self._resolves = 0
            self._window = None

    # ------------------------------------------------------------------ serving

    def _authorized(self, h: BaseHTTPRequestHandler, repo: Repo) -> bool:
        return not repo.private or h.headers.get("Authorization") == f"Bearer {TOKEN}"

    def _record(self, h, status: int, body: int) -> None:
        path, headers = urlsplit(h.path).path, dict(h.headers.items())
        sent = Sent(h.command, path, status, body, h.headers.get("Range"), headers, h.host, h.file)
        with self._lock:
            self.log.append(sent)

    def _reply(self, h, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        if self.latency:
            time.sleep(self.latency)
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            self._send(h, body)
        self._record(h, status, 0 if head else len(body))

    def _send(self, h, body: bytes) -> None:
        """The body, paced to the link's rate when there is one: a token bucket shared by every
        connection (a burst of BURST bytes at most), so concurrent requests share the bandwidth
        and a thread that wakes late loses the link no time."""
        if not self.rate:
            h.wfile.write(body)
            return
        view = memoryview(body)
        for at in range(0, len(body), CHUNK):
            chunk = view[at : at + CHUNK]
            with self._lock:
                now = time.monotonic()
                self._tokens = min(BURST, self._tokens + (now - self._at) * self.rate) - len(chunk)
                self._at = now
                wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
            if wait:
                time.sleep(wait)
            h.wfile.write(chunk)

    def _error(self, h, status: int, code: str, head: bool = False, headers: dict | None = None) -> None:
        body = json.dumps({"error": code}).encode()
        self._reply(h, status, body, {"X-Error-Code": code, "Content-Type": "application/json"} | (headers or {}), head)

    def _limited(self) -> int | None:
        """Counts a resolve in the current fixed window (one starts at the first resolve after
        the last ended); past the limit, the seconds until the window ends."""
        with self._lock:
            now = time.monotonic()
            if self._window is None or now >= self._window[0] + self.resolve_window:
                self._window = (now, 0)
            start, n = self._window
            self._window = (start, n + 1)
            if self.resolve_limit is None or n < self.resolve_limit:
                return None
            self.rate_limited += 1
            return max(1, math.ceil(start + self.resolve_window - now))

    def _serve(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        if path in ("/_log", "/_resolves"):  # for a client in another process (benchmarks/hub_merge.py)
            with self._lock:
                if path == "/_resolves":
                    body = json.dumps(self._resolves).encode()
                else:  # a storage request under the resolve path that sent it there, for patterns
                    body = json.dumps([[s.file or s.path, s.body] for s in self.log]).encode()
                    self.log.clear()
            h.send_response(200)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
            return
        if "/resolve/" in path:
            with self._lock:  # on arrival: a client that reads the count next must find its request in it
                self._resolves += 1
            wait = self._limited()
            if wait is not None:
                return self._error(
                    h,
                    429,
                    "RateLimited",
                    head,
                    {
                        "Retry-After": str(wait),
                        "RateLimit": f'"resolvers";r=0;t={wait}',
                        "RateLimit-Policy": f'"fixed window";"resolvers";q={self.resolve_limit};'
                        f"w={math.ceil(self.resolve_window)}",
                    },
                )
        m = re.match(r"^/api/models/([^/]+/[^/]+)/revision/(.+)$", path)
        if m:
            return self._api(h, m.group(1), m.group(2), head)
        m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)$", path)
        if m:  # what snapshot_download lists (one page)
            return self._api(h, m.group(1), m.group(2), head, tree=True)
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if m:
            return self._file(h, m.group(1), m.group(2), m.group(3), head, resolve=True)
        m = re.match(r"^/mirror/([^/]+/[^/]+)/(.+)$", path)
        if m:  # a plain folder: never redirected
            return self._file(h, m.group(1), "main", m.group(2), head)
        self._error(h, 404, "EntryNotFound", head)

    def _api(self, h, repo_id: str, rev: str, head: bool, tree: bool = False) -> None:
        repo = self.repos.get(repo_id)
        if repo is None or not self._authorized(h, repo):
            return self._error(h, 401, "RepoNotFound", head)
        sha = repo.commit(rev)
        if sha is None:
            return self._error(h, 404, "RevisionNotFound", head)
        siblings = []
        for name, data in repo.commits[sha].items():
            entry = {"rfilename": name, "size": len(data), "blobId": self._hash(data, "sha1")}
            if name.endswith(".safetensors"):
                entry["lfs"] = {"size": len(data), "sha256": self._hash(data), "pointerSize": 134}
            siblings.append(entry)
        if tree:
            entries = [
                {"type": "file", "path": e["rfilename"], "size": e["size"], "oid": e["blobId"]}
                | ({"lfs": {"oid": e["lfs"]["sha256"], "size": e["size"], "pointerSize": 134}} if "lfs" in e else {})
                for e in siblings
            ]
            return self._reply(h, 200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, head)
        body = json.dumps({"id": repo_id, "sha": sha, "private": repo.private, "siblings": siblings}).encode()
        self._reply(h, 200, body, {"Content-Type": "application/json"}, head)

    def _file(self, h, repo_id: str, rev: str, name: str, head: bool, resolve: bool = False) -> None:
        repo = self.repos.get(repo_id)
        if repo is None or not self._authorized(h, repo):
            return self._error(h, 401, "RepoNotFound", head)
        sha = repo.commit(rev)
        data = repo.commits.get(sha, {}).get(name) if sha else None
        if data is None:
            return self._error(h, 404, "EntryNotFound", head)
        lfs = name.endswith(".safetensors")
        etag = self._hash(data) if lfs else self._hash(data, "sha1")
        if resolve and lfs and self.redirect:  # the Hub sends LFS files' bodies from elsewhere
            headers = {
                "Location": self.storage.url(etag, data, urlsplit(h.path).path, self.url_ttl),
                "X-Repo-Commit": sha,
                "ETag": f'"{etag}"',
                "X-Linked-Etag": f'"{etag}"',
                "X-Linked-Size": str(len(data)),
            }
            return self._reply(h, 302, b"", headers, head)
        headers = {"ETag": f'"{etag}"', "X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
        self._ranged(h, data, headers, head)

    def _ranged(self, h, data: bytes, headers: dict, head: bool) -> None:
        """The file, or the range asked for (206), failed now and then when fail_share says."""
        start, end = 0, len(data)
        status = 200
        rng = h.headers.get("Range")
        if rng:
            m = re.match(r"^bytes=(\d+)-(\d*)$", rng)
            if not m:
                return self._error(h, 416, "BadRange", head)
            start = int(m.group(1))
            end = min(len(data), int(m.group(2)) + 1) if m.group(2) else len(data)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        body = data[start:end]
        if not head and self._fail_now():
            return self._fail(h, headers, body)
        self._reply(h, status, body, headers, head)

    def _fail_now(self) -> bool:
        with self._lock:
            if self.fail_share and self._rng.random() < self.fail_share:
                self.failed += 1
                return True
        return False

    def _fail(self, h, headers: dict, body: bytes) -> None:
        with self._lock:
            kind = self._rng.choice(["busy", "reset", "cut"])
        if kind == "busy":
            return self._reply(h, 503, b"busy", {"Retry-After": "0"})
        if kind == "reset":
            self._record(h, 0, 0)
            h.close_connection = True
            h.connection.shutdown(2)
            return
        h.send_response(206 if "Content-Range" in headers else 200)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        half = body[: len(body) // 2]
        h.wfile.write(half)
        h.wfile.flush()
        self._record(h, -1, len(half))
        h.close_connection = True
        h.connection.shutdown(2)


class StorageServer:
    """Where the Hub keeps LFS files: another origin (loopback, another port), reached by the
    signed URL of a resolve's 302 (`/blobs/SHA256?Expires=EPOCH&Signature=HMAC&file=PATH`), that
    answers as S3 and CloudFront do: 400 to a request that also carries an Authorization
    header, 403 to a bad signature or an expired URL. It answers over the Hub's link (the
    same token bucket, latency and fail_share), and logs into the Hub's log as host "storage"."""

    def __init__(self, hub: HubServer) -> None:
        self.hub = hub
        self.secret = secrets.token_bytes(32)
        self.blobs: dict[str, bytes] = {}  # sha256 -> bytes
        self._files: dict[str, str] = {}  # sha256 -> the resolve path it was first published under
        self.httpd, self.endpoint = _start(_handler(self._serve, "storage"))

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def keep(self, sha256: str, data: bytes, file: str) -> None:
        with self.hub._lock:
            self.blobs[sha256] = data
            self._files.setdefault(sha256, file)

    def sign(self, sha256: str, expires: int) -> str:
        return hmac.new(self.secret, f"{sha256}:{expires}".encode(), hashlib.sha256).hexdigest()

    def url(self, sha256: str, data: bytes, file: str, ttl: float) -> str:
        """A URL for the blob, good until `ttl` seconds from now. Its requests are logged under
        `file` (the resolve path that issued it, unsigned, as the CDN's content-disposition is),
        so that wire_bytes' patterns still match: repos share blobs (a LoRA expert's untouched
        shard is its base's), and a blob's hash cannot say which repo's read it was."""
        expires = math.ceil(time.time() + ttl)
        with self.hub._lock:
            self.blobs[sha256] = data  # a commit's files may have been put in place by hand
        query = urlencode({"Expires": expires, "Signature": self.sign(sha256, expires), "file": file})
        return f"{self.endpoint}/blobs/{sha256}?{query}"

    def _error(self, h, status: int, code: str, message: str, head: bool) -> None:
        body = f"<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()
        self.hub._reply(h, status, body, {"Content-Type": "application/xml"}, head)

    def _serve(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        url = urlsplit(h.path)
        m = re.match(r"^/blobs/([0-9a-f]{64})$", url.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        signature, expires = query.get("Signature", ""), query.get("Expires", "")
        with self.hub._lock:
            h.file = query.get("file") or (self._files.get(m.group(1), "") if m else "")
            data = self.blobs.get(m.group(1)) if m else None
        if "Authorization" in h.headers:  # a client that forwards the Hub's token across origins
            return self._error(h, 400, "InvalidArgument", "Only one auth mechanism allowed", head)
        if not m or not signature or not expires.isdigit():
            return self._error(h, 403, "AccessDenied", "Signature and Expires are required", head)
        if not hmac.compare_digest(signature, self.sign(m.group(1), int(expires))):
            return self._error(h, 403, "SignatureDoesNotMatch", "The request signature does not match", head)
        if time.time() > int(expires):
            return self._error(h, 403, "AccessDenied", "Request has expired", head)
        if data is None:
            return self._error(h, 404, "NoSuchKey", "The specified key does not exist.", head)
        headers = {"ETag": f'"{m.group(1)}"', "Accept-Ranges": "bytes"}
        self.hub._ranged(h, data, headers, head)


def main() -> None:
    """Serve model folders as Hub repositories from a process of its own (so that the server
    does not share an interpreter with the client it measures): `python -m tests.hub_server
    RATE[:LATENCY] [--redirect] [--ttl SECONDS] [--resolve-limit N] [--resolve-window SECONDS]
    REPO=FOLDER ...` (bytes per second, 0 for no cap; seconds before each answer); prints the
    endpoint, then serves until killed. GET /_log returns the [path, body bytes] of each request
    since the last call, to either host (a storage request under the resolve path that sent it
    there), and forgets them; GET /_resolves returns the number of resolves so far."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tests.hub_server")
    ap.add_argument("link", help="RATE[:LATENCY]")
    ap.add_argument("repos", nargs="*", metavar="REPO=FOLDER")
    ap.add_argument("--redirect", action="store_true", help="LFS resolves answer 302 to the storage host")
    ap.add_argument("--ttl", type=float, default=3600.0, help="seconds a signed storage URL lasts")
    ap.add_argument("--resolve-limit", type=int, default=None, help="resolves allowed per window")
    ap.add_argument("--resolve-window", type=float, default=300.0, help="seconds")
    args = ap.parse_intermixed_args()
    rate, _, latency = args.link.partition(":")
    server = HubServer(
        rate=float(rate) or None,
        latency=float(latency or 0),
        redirect=args.redirect,
        url_ttl=args.ttl,
        resolve_limit=args.resolve_limit,
        resolve_window=args.resolve_window,
    )
    for arg in args.repos:
        repo, folder = arg.split("=", 1)
        server.publish(repo, Path(folder))
    print(server.endpoint, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
