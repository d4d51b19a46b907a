"""The sidecar's HTTP server: /metrics, /healthz and /readyz on a fixed set of threads."""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, cast

log = logging.getLogger("reconciler.sidecar.http")

HTTP_WORKERS = 4  # requests served at once
HTTP_WAITING = 16  # requests queued for a worker beyond those; more are closed at once
HTTP_IDLE_LIMIT = 512  # connections that have not sent their request yet
HTTP_REQUEST_TIMEOUT_SECONDS = 2.0  # an idle or slow client is cut off after this


class BoundedHTTPServer(HTTPServer):
    """An HTTP server with a fixed set of threads, never one per connection.

    A new connection waits, on one watcher thread, until it has sent something (at most
    ``HTTP_REQUEST_TIMEOUT_SECONDS``; then it is closed), so idle clients cost a file
    descriptor and no thread, and never keep a scrape waiting. A connection that has sent
    its request goes to one of ``HTTP_WORKERS`` threads. Beyond ``HTTP_IDLE_LIMIT`` idle
    connections the one idle longest is closed to make room (so a flood of idle
    connections cannot lock a scrape out); beyond ``HTTP_WAITING`` requests queued for a
    worker, a connection is closed at once.
    """

    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]
                 ) -> None:
        # Before binding: a bind that fails calls server_close(), which needs them.
        self._pool = ThreadPoolExecutor(max_workers=HTTP_WORKERS, thread_name_prefix="http")
        self._queued = threading.BoundedSemaphore(HTTP_WORKERS + HTTP_WAITING)
        self._idle = selectors.DefaultSelector()
        self._idle_lock = threading.Lock()
        self._closed = threading.Event()
        super().__init__(address, handler)
        threading.Thread(target=self._watch_idle, daemon=True, name="http-idle").start()

    def process_request(self, request: Any, client_address: Any) -> None:
        """Park the new connection until it sends its request (or times out)."""
        deadline = time.monotonic() + HTTP_REQUEST_TIMEOUT_SECONDS
        with self._idle_lock:
            idle = self._idle.get_map()
            if len(idle) >= HTTP_IDLE_LIMIT:
                oldest = min(idle.values(), key=lambda key: float(key.data[1]))
                self._idle.unregister(oldest.fileobj)
                self.shutdown_request(_socket_of(oldest))
            self._idle.register(request, selectors.EVENT_READ, (client_address, deadline))

    def _watch_idle(self) -> None:
        while not self._closed.is_set():
            events = self._idle.select(timeout=0.2)
            now = time.monotonic()
            ready = []
            with self._idle_lock:
                for key, _ in events:
                    if key.fileobj not in self._idle.get_map():
                        continue  # closed to make room since select() saw it
                    self._idle.unregister(key.fileobj)
                    ready.append(key)
                for key in list(self._idle.get_map().values()):
                    if key.data[1] < now:
                        self._idle.unregister(key.fileobj)
                        self.shutdown_request(_socket_of(key))
            for key in ready:
                if not self._queued.acquire(blocking=False):
                    self.shutdown_request(_socket_of(key))
                    continue
                self._pool.submit(self._serve, key.fileobj, key.data[0])

    def _serve(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._queued.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that goes away mid-reply is not the service's error; no traceback."""
        log.debug("event=http_request_failed")

    def server_close(self) -> None:
        """Stop listening, close the idle connections, let the workers go."""
        super().server_close()
        self._closed.set()
        with self._idle_lock:
            for key in list(self._idle.get_map().values()):
                self._idle.unregister(key.fileobj)
                self.shutdown_request(_socket_of(key))
        self._pool.shutdown(wait=False, cancel_futures=True)


def _socket_of(key: selectors.SelectorKey) -> socket.socket:
    return cast(socket.socket, key.fileobj)


