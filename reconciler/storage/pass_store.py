"""Units of work for passes: a job source, the audit and the lease on one transaction.

The source is built per transaction by a factory (the composition root chooses which),
so a foreign system's tables and this project's audit commit together when they share a
database.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy.engine import Connection, Engine

from reconciler.core.ports import JobSource, StuckWork
from reconciler.storage.audit import (
    SqlAudit,
    SqlLease,
    delete_audit_before,
    record_failed_pass,
)
from reconciler.storage.deadlocks import conflicts_raised, deadlock_retried
from reconciler.storage.engines import (
    DEFAULT_TIMEOUTS,
    DatabaseTimeouts,
    limit_pass_transaction,
    read_only,
)
from reconciler.storage.native_source import NativeSource

SourceFactory = Callable[[Connection, bool], JobSource]
"""Builds a source on a pass's connection; the flag says whether to lock what it scans."""


def native_source(conn: Connection, lock: bool) -> JobSource:
    """The default source: this project's own jobs."""
    return NativeSource(conn, lock=lock)


@dataclass(frozen=True, slots=True)
class SqlPassUnit:
    """One pass's unit of work (see ``ports.PassUnit``)."""

    jobs: JobSource
    audit: SqlAudit
    lease: SqlLease


class SqlPassStore:
    """Opens pass transactions on one engine (see ``ports.PassStore``).

    ``timeouts``: those the engine was created with; a pass narrows its transaction to
    their pass timeouts unless the sessions carry them already.
    """

    def __init__(self, engine: Engine, source: SourceFactory = native_source, *,
                 timeouts: DatabaseTimeouts = DEFAULT_TIMEOUTS) -> None:
        self.engine = engine
        self.source = source
        self.timeouts = timeouts

    @contextmanager
    def pass_transaction(self, *, dry_run: bool) -> Iterator[SqlPassUnit]:
        """A transaction for one pass; a dry run reads without locks and rolls back.

        On PostgreSQL it carries the pass timeouts (derived from the interval), unless its
        sessions already do: a pass stuck behind a lock fails and is recorded as an error
        pass, and the next tick goes on. A deadlock (MySQL) ends it in a
        ``TransactionConflict``: it was rolled back whole, and the pass runs again.
        """
        with conflicts_raised(), self.engine.connect() as conn:
            if dry_run:
                with read_only(conn).begin() as tx:
                    limit_pass_transaction(conn, self.timeouts)
                    yield self._unit(conn, lock=False)
                    tx.rollback()
            else:
                with conn.begin():
                    limit_pass_transaction(conn, self.timeouts)
                    yield self._unit(conn, lock=True)

    def _unit(self, conn: Connection, *, lock: bool) -> SqlPassUnit:
        source = self.source(conn, lock)
        # The audit records each decision's kind as the source read it.
        return SqlPassUnit(source, SqlAudit(conn, source.kind_read), SqlLease(conn))

    @deadlock_retried
    def record_failed_pass(self, instance: str, error_code: str) -> int:
        """Record a pass that failed before it could record itself."""
        with self.engine.begin() as conn:
            return record_failed_pass(conn, instance, error_code)

    @deadlock_retried
    def release_leadership(self, lease_name: str, holder_id: str) -> None:
        """Expire the leader lease now if this holder has it, so a successor need not wait."""
        with self.engine.begin() as conn:
            SqlLease(conn).release(lease_name, holder_id)

    @deadlock_retried
    def try_lead(self, lease_name: str, holder_id: str, ttl_seconds: float) -> int | None:
        """Acquire or renew the leader lease in its own transaction; the token or None."""
        with self.engine.begin() as conn:
            return SqlLease(conn).take(lease_name, holder_id, ttl_seconds)

    def stuck_work(self) -> StuckWork:
        """The source's stuck work (``JobSource.stuck_work``), in a transaction of its own."""
        return self.backlog()[0]

    def backlog(self) -> tuple[StuckWork, int]:
        """The source's stuck work and its running jobs' count, in one transaction."""
        with self.pass_transaction(dry_run=True) as tx:
            return tx.jobs.stuck_work(), tx.jobs.running_count()

    @deadlock_retried
    def delete_audit_before(self, days: float, limit: int) -> int:
        """Delete finished passes older than ``days`` with their decisions, at most ``limit``."""
        with self.engine.begin() as conn:
            return delete_audit_before(conn, days, limit)
