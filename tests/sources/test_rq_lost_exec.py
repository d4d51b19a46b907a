"""A connection to Redis lost after a batch's ``EXEC`` reached Redis and before its answer
came back. redis-py raises a ``WatchError`` for it, as for a late worker's write; but the
writes may have run, so the pass fails (as with Redis gone in the middle of its writes)
and records nothing, rather than record a lost fence for jobs it did resume.

A TCP relay in front of the real redis-server passes the first ``EXEC`` on once armed,
drops Redis's answer and closes that client's connection. RQ's jobs are the conformance
suite's (``RqFixture``); the reconciler's own tables on SQLite and PostgreSQL.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
import sqlalchemy as sa

from tests.conformance.fixtures import Situation, State
from tests.conformance.rq import RQ, RqFixture, open_rq
from tests.sources.support import DECISIONS

EXEC = b"\r\n$4\r\nEXEC\r\n"
"""``EXEC`` as redis-py sends it (RESP), closing the pipeline of a ``MULTI``."""
DIED = Situation(State.DIED_BEFORE_STEP, 1)


class ExecCutter:
    """A relay to Redis; once ``armed``, the first ``EXEC`` reaches Redis, its answer never
    reaches the client, and the client's connection is closed."""

    def __init__(self, redis_url: str) -> None:
        parts = urlsplit(redis_url)
        self._target = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self._listener = socket.create_server(("127.0.0.1", 0))
        port = self._listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{port}{parts.path}"
        self.armed = threading.Event()
        self.cut = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            muted = threading.Event()
            threading.Thread(target=self._to_redis, args=(client, server, muted),
                             daemon=True).start()
            threading.Thread(target=self._to_client, args=(server, client, muted),
                             daemon=True).start()

    def _to_redis(self, client: socket.socket, server: socket.socket,
                  muted: threading.Event) -> None:
        tail = b""
        while chunk := _recv(client):
            seen, tail = tail + chunk, (tail + chunk)[-len(EXEC):]
            if self.armed.is_set() and not self.cut.is_set() and EXEC in seen:
                muted.set()
                server.sendall(chunk)
                time.sleep(0.3)  # Redis runs the transaction; its answer is dropped
                self.cut.set()
                client.shutdown(socket.SHUT_RDWR)
                break
            server.sendall(chunk)
        client.close()
        server.close()

    @staticmethod
    def _to_client(server: socket.socket, client: socket.socket,
                   muted: threading.Event) -> None:
        while chunk := _recv(server):
            if muted.is_set():
                continue
            try:
                client.sendall(chunk)
            except OSError:
                return


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


@pytest.fixture(params=[(RQ, "sqlite"), (RQ, "postgresql")], ids=lambda p: p[1])
def cut_rq(request: pytest.FixtureRequest) -> Iterator[tuple[RqFixture, ExecCutter]]:
    """The rq source's fixture reaching its Redis through an ``ExecCutter``."""
    cutter = ExecCutter(request.getfixturevalue("redis_url"))
    try:
        with open_rq(request, cutter.url) as fixture:
            yield fixture, cutter
    finally:
        cutter.close()


def test_a_connection_lost_after_exec_fails_the_pass_and_records_no_lost_fence(
        cut_rq: tuple[RqFixture, ExecCutter]) -> None:
    rq, cutter = cut_rq
    jobs = [rq.make(DIED) for _ in range(2)]

    cutter.armed.set()
    import redis  # noqa: PLC0415 - the rq source's tests have it

    with pytest.raises(redis.ConnectionError):
        rq.run_pass()
    assert cutter.cut.is_set(), "the relay never saw the batch's EXEC"

    # The EXEC ran: both jobs were resumed in Redis, and the pass recorded nothing.
    assert [rq.status(job) for job in jobs] == ["runnable", "runnable"]
    with rq.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(DECISIONS)
                            ).scalar_one() == 0
    # The next pass finds them no longer started: nothing to decide, no lost fence.
    assert rq.run_pass().decisions == ()
    assert [rq.status(job) for job in jobs] == ["runnable", "runnable"]
