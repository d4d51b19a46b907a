"""The frozen database clock the state machine stands on (reconciler.storage.clock's test hook).

On SQLite, or on MariaDB where the machine runs there (``SET timestamp``, harness.py).

The machine is repeatable only if the database's 'now' is the instant it froze, however
long a call takes on a loaded machine; a run that drifted failed with
FlakyStrategyDefinition before the clock was frozen per statement.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from reconciler.storage.clock import db_now, freeze_sqlite_clock
from tests.statemachine.harness import DATABASE

FROZEN = datetime(2031, 5, 17, 8, 30, 0, 250000, tzinfo=UTC)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = DATABASE.engine(tmp_path)
    yield engine
    freeze_sqlite_clock(None)
    engine.dispose()


def _database_now(engine: Engine) -> datetime:
    with engine.connect() as conn:
        value = conn.execute(sa.select(db_now())).scalar_one()
    assert isinstance(value, datetime)
    return value


def test_a_frozen_clock_does_not_run_while_calls_take_time(engine: Engine) -> None:
    freeze_sqlite_clock(FROZEN.timestamp())
    first = _database_now(engine)
    time.sleep(0.3)
    later = _database_now(engine)
    assert first == later == FROZEN


def test_unfrozen_the_database_follows_the_real_clock(engine: Engine) -> None:
    freeze_sqlite_clock(FROZEN.timestamp())
    freeze_sqlite_clock(None)
    seen = _database_now(engine)
    assert abs(seen.timestamp() - time.time()) < 1.0, seen
