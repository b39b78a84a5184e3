"""A Hub-shaped HTTP server on loopback for the tests: models under the Hub's URL layout
(`/ORG/NAME/resolve/REVISION/FILE`, with Range requests, ETags and the commit header), the
API answer `huggingface_hub.HfApi.model_info` asks for, and the same files as a plain folder
(`/mirror/ORG/NAME/FILE`, an https:// mirror's shape). It counts the body bytes it sends per
request (what crossed the wire, not what mergepipe says it read), can fail a share of the
file requests (503 with Retry-After, connections reset, bodies cut short), and keeps private
models behind a token."""

from __future__ import annotations

import hashlib
import json
import random
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

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


class HubServer:
    def __init__(self, rate: float | None = None, latency: float = 0.0) -> None:
        """rate: the link's bandwidth in bytes per second, shared by every connection (None:
        as fast as loopback goes). latency: seconds before each answer starts (a round trip to
        a distant server; each request waits it, whatever else is in flight)."""
        self.rate = rate
        self.latency = latency
        self._hashes: dict[tuple[int, str], tuple[bytes, str]] = {}  # (id(bytes), algorithm) -> (bytes, digest)
        self._tokens, self._at = float(BURST), time.monotonic()  # the capped link's token bucket
        self.repos: dict[str, Repo] = {}
        self.log: list[Sent] = []
        self.fail_share = 0.0
        self.failed = 0
        self._rng = random.Random(1234)
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                server._serve(self, head=True)

            def do_GET(self) -> None:
                server._serve(self, head=False)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
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
        """Body bytes sent for file requests whose path matches."""
        with self._lock:
            return sum(s.body for s in self.log if re.search(pattern, s.path))

    def reset_log(self) -> None:
        with self._lock:
            self.log.clear()
            self.failed = 0

    # ------------------------------------------------------------------ serving

    def _authorized(self, h: BaseHTTPRequestHandler, repo: Repo) -> bool:
        return not repo.private or h.headers.get("Authorization") == f"Bearer {TOKEN}"

    def _record(self, h, status: int, body: int) -> None:
        with self._lock:
            self.log.append(Sent(h.command, urlsplit(h.path).path, status, body, h.headers.get("Range")))

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

    def _error(self, h, status: int, code: str, head: bool = False) -> None:
        body = json.dumps({"error": code}).encode()
        self._reply(h, status, body, {"X-Error-Code": code, "Content-Type": "application/json"}, head)

    def _serve(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        if path == "/_log":  # for a client in another process (benchmarks/hub_merge.py)
            with self._lock:
                body = json.dumps([[s.path, s.body] for s in self.log]).encode()
                self.log.clear()
            h.send_response(200)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
            return
        m = re.match(r"^/api/models/([^/]+/[^/]+)/revision/(.+)$", path)
        if m:
            return self._api(h, m.group(1), m.group(2), head)
        m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)$", path)
        if m:  # what snapshot_download lists (one page)
            return self._api(h, m.group(1), m.group(2), head, tree=True)
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path) or re.match(
            r"^/mirror/([^/]+/[^/]+)()/(.+)$", path
        )
        if m:
            return self._file(h, m.group(1), m.group(2) or "main", m.group(3), head)
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

    def _file(self, h, repo_id: str, rev: str, name: str, head: bool) -> None:
        repo = self.repos.get(repo_id)
        if repo is None or not self._authorized(h, repo):
            return self._error(h, 401, "RepoNotFound", head)
        sha = repo.commit(rev)
        data = repo.commits.get(sha, {}).get(name) if sha else None
        if data is None:
            return self._error(h, 404, "EntryNotFound", head)
        etag = self._hash(data) if name.endswith(".safetensors") else self._hash(data, "sha1")
        headers = {"ETag": f'"{etag}"', "X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
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


def main() -> None:
    """Serve model folders as Hub repositories from a process of its own (so that the server
    does not share an interpreter with the client it measures): `python -m tests.hub_server
    RATE[:LATENCY] REPO=FOLDER ...` (bytes per second, 0 for no cap; seconds before each
    answer); prints the endpoint, then serves until killed. GET /_log returns the [path, body
    bytes] of each request since the last call, and forgets them."""
    import sys

    rate, _, latency = sys.argv[1].partition(":")
    server = HubServer(rate=float(rate) or None, latency=float(latency or 0))
    for arg in sys.argv[2:]:
        repo, folder = arg.split("=", 1)
        server.publish(repo, Path(folder))
    print(server.endpoint, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
