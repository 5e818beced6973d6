"""A real S3 endpoint for the tests: moto's server on loopback, and a proxy in front of it that
fails, delays or cuts the requests a test asks it to."""

from __future__ import annotations

import http.client
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# Headers that belong to one connection, never forwarded.
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "te", "upgrade"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Fault:
    """What to do to the next request matching ``method`` (any method when None)."""

    kind: str  # "status" (an S3 error response) or "reset" (cut the connection)
    status: int = 503
    code: str = "SlowDown"
    method: str | None = None


@dataclass
class Seen:
    method: str
    path: str
    outcome: str  # "forwarded", "status 503", "reset"


class FaultProxy:
    """An HTTP/1.1 reverse proxy to ``upstream`` (host, port) that injects queued faults."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.faults: deque[Fault] = deque()
        self.seen: list[Seen] = []
        self.copy_delay = 0.0  # seconds to hold each server-side copy (x-amz-copy-source)
        self._lock = threading.Lock()
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)

    def fail(
        self, times: int, status: int = 503, code: str = "SlowDown", method: str | None = None
    ) -> None:
        with self._lock:
            self.faults.extend(Fault("status", status, code, method) for _ in range(times))

    def reset(self, times: int, method: str | None = None) -> None:
        with self._lock:
            self.faults.extend(Fault("reset", method=method) for _ in range(times))

    def take(self, method: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.method in (None, method):
                    self.faults.remove(fault)
                    return fault
            return None

    def record(self, method: str, path: str, outcome: str) -> None:
        with self._lock:
            self.seen.append(Seen(method, path, outcome))

    def outcomes(self) -> list[str]:
        with self._lock:
            return [seen.outcome for seen in self.seen]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: FaultProxy

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._relay()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(data)
                data += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _relay(self) -> None:
        proxy = self.owner
        body = self._body()
        fault = proxy.take(self.command)
        if fault is not None and fault.kind == "reset":
            proxy.record(self.command, self.path, "reset")
            # SO_LINGER 0: closing sends a RST, as a crashed server or a dropped link would.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        if fault is not None:
            proxy.record(self.command, self.path, f"status {fault.status}")
            payload = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{fault.code}</Code><Message>injected {fault.code}</Message>"
                "<RequestId>proxy</RequestId></Error>"
            ).encode()
            self.send_response(fault.status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
            return
        if proxy.copy_delay and "x-amz-copy-source" in self.headers:
            time.sleep(proxy.copy_delay)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers["Content-Length"] = str(len(body))
        connection = http.client.HTTPConnection(*proxy.upstream, timeout=60)
        try:
            connection.request(self.command, self.path, body=body, headers=headers)
            response = connection.getresponse()
            data = response.read()
        finally:
            connection.close()
        proxy.record(self.command, self.path, "forwarded")
        self.send_response(response.status)
        for key, value in response.getheaders():
            if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                self.send_header(key, value)
        length = response.getheader("Content-Length") if self.command == "HEAD" else None
        self.send_header("Content-Length", length or str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
