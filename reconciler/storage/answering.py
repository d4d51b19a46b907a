"""The psycopg connection every PostgreSQL engine opens: it gives up on a server that
does not answer (``reconciler.storage.engines`` explains the timeouts).

A module of its own so that only a PostgreSQL engine imports the driver: ``create_engine``
imports it for a ``postgresql+psycopg://`` URL, and a command on SQLite never does.
"""

from __future__ import annotations

from typing import Any, Final, TypeVar

import psycopg
from psycopg.abc import PQGen

RV = TypeVar("RV")


class _Unset:
    """Not given: the connection's own answer limit applies."""


UNSET: Final = _Unset()


class AnsweringConnection(psycopg.Connection[Any]):
    """A psycopg connection that gives up on a server that does not answer.

    Every exchange with the server (execute, fetch, commit, rollback, the pool's ping)
    goes through ``wait``; it gets ``answer_seconds`` unless the caller set its own limit.
    On expiry the connection is closed (SQLAlchemy then discards it) and the error says
    how long it waited.
    """

    answer_seconds: float | None = None
    """The limit for every exchange, set when the engine connects."""
    transaction_answer_seconds: float | _Unset | None = UNSET
    """A limit for the open transaction only (``limit_transaction``)."""

    def wait(self, gen: PQGen[RV], interval: float = 0.1,
             timeout: float | _Unset | None = UNSET) -> RV:
        """Consume ``gen``; a reply later than the answer limit breaks the connection.

        A caller's explicit ``timeout`` (None included: psycopg's own notification wait)
        is kept as given.
        """
        if not isinstance(timeout, _Unset):
            return super().wait(gen, interval, timeout)
        limit = self.transaction_answer_seconds
        if isinstance(limit, _Unset):
            limit = self.answer_seconds
        if limit is None:
            return super().wait(gen, interval)
        try:
            return super().wait(gen, interval, limit)
        except psycopg.OperationalError as exc:
            if type(exc).__name__ != "_WaitTimeout":
                raise
            # Mid-exchange: the connection's state is unknown, so it is not reused.
            self.pgconn.finish()
            raise DatabaseNotAnsweringError(
                f"the database did not answer within {limit:g}s") from None

    def commit(self) -> None:
        """Commit; a transaction's own answer limit ends with it."""
        try:
            super().commit()
        finally:
            self.transaction_answer_seconds = UNSET

    def rollback(self) -> None:
        """Roll back; a transaction's own answer limit ends with it."""
        try:
            super().rollback()
        finally:
            self.transaction_answer_seconds = UNSET


class DatabaseNotAnsweringError(psycopg.OperationalError):
    """The server did not reply in time; the connection was closed."""
