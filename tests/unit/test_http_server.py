"""The sidecar's bounded HTTP server: idle connections cost no thread and lock no one out."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from reconciler.sidecar import http
from reconciler.sidecar.http import BoundedHTTPServer

IDLE_LIMIT = 8


class Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"ok\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[BoundedHTTPServer]:
    """A server on a free local port that parks at most IDLE_LIMIT idle connections."""
    monkeypatch.setattr(http, "HTTP_IDLE_LIMIT", IDLE_LIMIT)
    bound = BoundedHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=bound.serve_forever, daemon=True).start()
    yield bound
    bound.shutdown()
    bound.server_close()


def get(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
        return b"".join(iter(lambda: conn.recv(4096), b""))


def closed_by_peer(conn: socket.socket, wait_seconds: float = 1.0) -> bool:
    conn.settimeout(wait_seconds)
    try:
        return conn.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_idle_connections_past_the_limit_close_the_oldest_not_the_newcomer(
    server: BoundedHTTPServer,
) -> None:
    """With more idle connections than it parks, the server closes the one idle longest;
    a request that comes after them is served, and the newest idle ones stay open."""
    port = server.server_address[1]
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(IDLE_LIMIT * 2)]
    try:
        assert get(port).startswith(b"HTTP/1.0 200")
        assert closed_by_peer(idle[0])
        assert not closed_by_peer(idle[-1], wait_seconds=0.2)  # well within its 2 s
    finally:
        for conn in idle:
            conn.close()
