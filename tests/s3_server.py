"""A real S3-compatible server on loopback (moto's server mode) behind a counting, fault-injecting
HTTP proxy.

The proxy sees every request the S3 client sends: it records method, key, Range header,
status, body bytes and wire bytes of each response (the server side of the byte ledger), and
can fail a share of requests the way object stores do: 503 SlowDown, a connection dropped
before any response, or a GET body cut short after its headers promised more.
"""

from __future__ import annotations

import http.client
import random
import re
import socket
import threading
import time
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

# The access key id in a SigV4 signature: the Authorization header's Credential=, or a presigned
# URL's X-Amz-Credential=.
_CREDENTIAL = re.compile(r"(?:Credential|X-Amz-Credential)=([^/&,\s]+)/")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}
SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


@dataclass
class Exchange:
    method: str
    key: str  # bucket/key, unquoted
    range: str | None
    status: int  # 0 when the connection was dropped
    body_bytes: int  # response body bytes sent
    wire_bytes: int  # response bytes sent, status line and headers included
    fault: str | None = None
    access_key: str | None = None  # the access key id the request was signed with (SigV4's Credential=)


class _CountingWriter:
    def __init__(self, raw):
        self.raw = raw
        self.count = 0

    def write(self, data):
        self.count += len(data)
        return self.raw.write(data)

    def flush(self):
        return self.raw.flush()

    def __getattr__(self, name):
        return getattr(self.raw, name)


class S3Proxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.fault_rate = 0.0
        self.kinds: list[str] | None = None  # which faults to draw from (None: all that apply)
        self.rng = random.Random(0)
        self.exchanges: list[Exchange] = []
        self.in_flight = 0
        self.active = 0  # handlers not done recording (a client may have its answer already)
        self.peak_in_flight = 0  # most requests being served at once since the last reset
        self.hook = None  # called with (method, key) before a request is forwarded
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                self.wfile = _CountingWriter(self.wfile)

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _handle(self):
                with proxy._lock:
                    proxy.in_flight += 1
                    proxy.active += 1
                    proxy.peak_in_flight = max(proxy.peak_in_flight, proxy.in_flight)
                self._held = True
                try:
                    self._forward()
                finally:
                    self._release()
                    with proxy._lock:
                        proxy.active -= 1

            def _release(self):
                """Called before the last bytes of a response go out: once the client has its
                answer it may send the next request, which must not count as overlapping."""
                if self._held:
                    self._held = False
                    with proxy._lock:
                        proxy.in_flight -= 1

            def _forward(self):
                method = self.command
                body = self._body()
                key = unquote(urlsplit(self.path).path).lstrip("/")
                start = self.wfile.count
                if proxy.hook is not None:
                    proxy.hook(method, key)
                fault = proxy._draw_fault(method, key)
                if fault == "drop":
                    self._release()
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    proxy._record(
                        Exchange(method, key, self.headers.get("Range"), 0, 0, 0, fault), self.headers, self.path
                    )
                    return
                if fault == "503":
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self._release()
                    self.end_headers()
                    if method != "HEAD":
                        self.wfile.write(SLOW_DOWN)
                    self.wfile.flush()
                    proxy._record(
                        Exchange(
                            method, key, self.headers.get("Range"), 503, len(SLOW_DOWN), self.wfile.count - start, fault
                        ),
                        self.headers,
                        self.path,
                    )
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                    if body or method in ("PUT", "POST"):
                        headers["Content-Length"] = str(len(body))
                    conn.request(method, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP_BY_HOP | {"content-length", "server", "date"}:
                        self.send_header(k, v)
                length = resp.getheader("Content-Length") if method == "HEAD" else str(len(data))
                self.send_header("Content-Length", length or "0")
                self._release()
                self.end_headers()
                sent = data if method != "HEAD" else b""
                if fault == "truncate" and len(sent) > 1:
                    sent = sent[: len(sent) // 2]
                    self.close_connection = True
                self.wfile.write(sent)
                self.wfile.flush()
                proxy._record(
                    Exchange(
                        method, key, self.headers.get("Range"), resp.status, len(sent), self.wfile.count - start, fault
                    ),
                    self.headers,
                    self.path,
                )

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def _draw_fault(self, method: str, key: str) -> str | None:
        if key.startswith("moto-api"):
            return None
        with self._lock:
            if self.rng.random() >= self.fault_rate:
                return None
            kinds = ["503", "drop", "truncate"] if method == "GET" else ["503", "drop"]
            kinds = [k for k in kinds if self.kinds is None or k in self.kinds]
            return self.rng.choice(kinds) if kinds else None

    def _record(self, exchange: Exchange, headers=None, path: str = "") -> None:
        signed = (headers.get("Authorization") if headers is not None else None) or path
        found = _CREDENTIAL.search(unquote(signed or ""))
        exchange = replace(exchange, access_key=found.group(1) if found else None)
        with self._lock:
            self.exchanges.append(exchange)

    def reset(self, fault_rate: float = 0.0, seed: int = 0, kinds: list[str] | None = None) -> None:
        """Starts a fresh record. Waits first for handlers still recording: a client has its
        answer before the handler records it, and a late record would land in the new one."""
        self._wait_recorded()
        with self._lock:
            self.exchanges = []
            self.peak_in_flight = self.in_flight
            self.fault_rate = fault_rate
            self.kinds = kinds
            self.rng = random.Random(seed)
            self.hook = None

    def taken(self) -> list[Exchange]:
        """What was exchanged so far, once every handler has recorded its exchange."""
        self._wait_recorded()
        with self._lock:
            return list(self.exchanges)

    def _wait_recorded(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if self.active == 0 or time.monotonic() > deadline:
                    return
            time.sleep(0.01)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# The smallest multipart part but the last, on the server and in mergepipe
# (MERGEPIPE_MIN_PART_SIZE): S3's 5 MiB would make every part of the tests' small objects the
# last, and so never exercise copies of parts.
MIN_PART_SIZE = 16 * 1024


class S3Server:
    """moto's S3 in server mode on a random loopback port, with the proxy in front."""

    def __init__(self) -> None:
        import logging

        import moto.s3.models
        from moto.server import ThreadedMotoServer

        moto.s3.models.S3_UPLOAD_PART_MIN_SIZE = MIN_PART_SIZE

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.moto.start()
        self.direct = "http://%s:%d" % self.moto.get_host_and_port()
        self.proxy = S3Proxy(self.moto.get_host_and_port())

    @property
    def endpoint(self) -> str:
        """Where mergepipe is pointed: through the proxy."""
        return self.proxy.endpoint

    def client(self):
        """A boto3 client straight to the server (set-up and inspection, not counted)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.direct,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def close(self) -> None:
        self.proxy.close()
        self.moto.stop()
