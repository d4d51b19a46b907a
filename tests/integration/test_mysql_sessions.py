"""What every MySQL or MariaDB session of the reconciler is set to, and a transaction's own
limits (MySQL has no ``SET LOCAL``) ending with its checkout."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import Connection

from reconciler.storage.engines import create_engine, limit_transaction
from reconciler.storage.mysql import NO_LOCK_LIMIT

pytestmark = pytest.mark.integration

SESSION = "SELECT @@time_zone, @@innodb_lock_wait_timeout, @@max_statement_time"


@pytest.fixture(autouse=True)
def _mysql_only(db_url: str) -> None:
    if not db_url.startswith("mysql"):
        pytest.skip("MySQL's and MariaDB's sessions")


def session(conn: Connection) -> tuple[str, str, int, float]:
    """The session's time zone, isolation, lock wait and statement limit."""
    zone, lock, statement = conn.exec_driver_sql(SESSION).one()
    # The isolation as the server says it (its variable's name differs: MariaDB, MySQL 8).
    return str(zone), conn.get_isolation_level(), int(lock), float(statement)


def test_every_session_is_utc_read_committed_with_the_settings_limits(db_url: str) -> None:
    """UTC (the database clock's DATETIME(6) columns hold UTC), READ COMMITTED (no gap
    locks between claims), and the lock and statement timeouts of the settings (10 s, 30 s
    by default)."""
    engine = create_engine(db_url)
    with engine.connect() as conn:
        assert session(conn) == ("+00:00", "READ COMMITTED", 10, 30.0)
    engine.dispose()


def test_a_transactions_own_limits_end_when_its_connection_returns(db_url: str) -> None:
    """``db upgrade`` runs without limits; the next user of its connection has the
    engine's again."""
    engine = create_engine(db_url, pool_size=1, max_overflow=0)
    with engine.connect() as conn, conn.begin():
        limit_transaction(conn, statement_seconds=None, lock_seconds=None)
        _, _, lock, statement = session(conn)
        assert statement == 0.0  # no limit
        assert lock == NO_LOCK_LIMIT
    with engine.connect() as conn:
        assert session(conn)[2:] == (10, 30.0)
    engine.dispose()
