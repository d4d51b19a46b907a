"""Worker sessions: one row per worker process, renewed by its heartbeat (docs/lease-contract.md).

A session that stopped, went silent or was replaced by a restart is gone; ending it
expires its claims' leases at once, so the next pass takes them.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from reconciler.core.vocabulary import SessionEndReason
from reconciler.storage.clock import db_now
from reconciler.storage.deadlocks import deadlock_retried
from reconciler.storage.sql import insert_id, sessions
from reconciler.storage.transitions import end_sessions


class SessionsSql:
    """Register, renew and end worker sessions, on one engine."""

    engine: Engine

    @deadlock_retried
    def register_session(self, worker_name: str, host_name: str, process_id: int) -> int:
        """Start a session; a live session of the same worker on the same host is replaced."""
        with self.engine.begin() as conn:
            previous = [int(i) for i in conn.execute(
                sa.select(sessions.c.session_id).where(
                    sessions.c.worker_name == worker_name, sessions.c.host_name == host_name,
                    sessions.c.stopped_at.is_(None))
            ).scalars()]
            if previous:
                end_sessions(conn, previous, SessionEndReason.REPLACED)
            return insert_id(conn, sessions.insert().values(
                worker_name=worker_name, host_name=host_name, process_id=process_id,
                started_at=db_now(), heartbeat_at=db_now(),
            ))

    @deadlock_retried
    def heartbeat_session(self, session_id: int) -> bool:
        """Renew a session; False when it was already declared gone."""
        with self.engine.begin() as conn:
            done = conn.execute(
                sessions.update()
                .where(sessions.c.session_id == session_id, sessions.c.stopped_at.is_(None))
                .values(heartbeat_at=db_now())
            )
            return done.rowcount == 1

    @deadlock_retried
    def stop_session(self, session_id: int) -> None:
        """End a session on a graceful stop; any claim it still holds expires at once."""
        with self.engine.begin() as conn:
            end_sessions(conn, [session_id], SessionEndReason.STOPPED)
