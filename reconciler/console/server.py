"""The console on the sidecar's HTTP server: copy a request in and its reply out."""

from __future__ import annotations

import logging
from http.server import BaseHTTPRequestHandler

from reconciler.console.app import MAX_FORM_BYTES, SECURITY_HEADERS, Console, Reply

log = logging.getLogger("reconciler.console")


def serve(handler: BaseHTTPRequestHandler, console: Console | None, method: str) -> None:
    """Answer ``handler``'s request from the console (404 when it is off)."""
    if console is None:
        _reply(handler, method, Reply(404, b"not found\n", "text/plain; charset=utf-8"))
        return
    length = handler.headers.get("Content-Length", "0")
    size = int(length) if length.isdigit() else 0
    body = b""
    if method == "POST" and size > MAX_FORM_BYTES:
        body = bytes(MAX_FORM_BYTES + 1)  # refused unread; the connection then closes
    elif method == "POST" and size:
        body = handler.rfile.read(size)
    headers = {name.lower(): value for name, value in handler.headers.items()}
    reply = console.handle(method, handler.path, headers, body)
    _reply(handler, method, reply)


def _reply(handler: BaseHTTPRequestHandler, method: str, reply: Reply) -> None:
    handler.send_response(reply.status)
    handler.send_header("Content-Type", reply.content_type)
    if reply.stream is None:
        handler.send_header("Content-Length", str(len(reply.body)))
    for name, value in (*SECURITY_HEADERS, *reply.headers):
        handler.send_header(name, value)
    if method == "POST" or reply.stream is not None:
        # A streamed body ends when the connection does.
        handler.send_header("Connection", "close")
        handler.close_connection = True
    handler.end_headers()
    if method == "HEAD":
        return
    if reply.stream is None:
        handler.wfile.write(reply.body)
        return
    try:
        for chunk in reply.stream:
            handler.wfile.write(chunk)
    except OSError:
        log.info("event=console_export_abandoned")  # the reader went away
    except Exception as exc:
        # Headers are sent: the body stops short, and the log says why (no job's data).
        log.warning("event=console_export_failed error=%s", type(exc).__name__)
