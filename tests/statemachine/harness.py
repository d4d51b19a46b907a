"""What the state machine and its regression tests share: databases, the clock, snapshots.

Each machine run (and each regression test) gets its own migrated SQLite file, copied from
one template migrated once per process (``tests.helpers.fresh_database``), so a run starts
in milliseconds. Where the engines chosen for the tests are MariaDB without SQLite
(``RECONCILER_TEST_ENGINES=mariadb``), or for a test class whose ``machine_engine`` is
``"mariadb"``, the machine runs there instead: one migrated database for the test, emptied
at the start of each run (``MachineDatabase``).

Time moves only by ``freeze_sqlite_clock``: ``DbClock`` freezes the database clock at a
virtual instant before each call, and ``Window`` brackets a call: every database instant
inside the call lies within ``SLACK`` of that instant (it is the instant itself, to the
millisecond). On MariaDB every session follows the frozen instant with ``SET timestamp``,
the session's clock that ``UTC_TIMESTAMP(6)`` reads (``follow_frozen_clock``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from hypothesis import event
from hypothesis.control import currently_in_test_context
from sqlalchemy.engine import Engine

from models import Base
from reconciler.storage.clock import freeze_sqlite_clock, frozen_clock
from reconciler.storage.engines import create_engine, read_only
from tests.conftest import ENGINES
from tests.helpers import fresh_database

SLACK = timedelta(milliseconds=10)
"""How far a database instant may sit from the frozen instant of its call."""
GRID_SECONDS = 0.5
"""Virtual time moves in steps of this; every threshold of the machine is a multiple."""
CALLS_PER_INSTANT = 10
"""Calls at one virtual instant before the clock steps on by itself (keeps each timestamp
well under a step past its instant)."""
ORDER_GAP_SECONDS = 0.025
"""Between two calls at one instant: more than twice ``SLACK``, so the later call's
timestamps sort after the earlier's."""

DEFAULT_MACHINE_ENGINE = ("mariadb" if "mariadb" in ENGINES and "sqlite" not in ENGINES
                          else "sqlite")
"""Where a machine test runs unless its class names ``machine_engine``: SQLite, or MariaDB
where the tests' engines include it and not SQLite (``RECONCILER_TEST_ENGINES=mariadb``);
its clock is frozen per session there. PostgreSQL's ``statement_timestamp()`` cannot be
frozen: not there."""
_PINNED = "statemachine_pinned_timestamp"

T = TypeVar("T")


def follow_frozen_clock(engine: Engine) -> None:
    """Make a MySQL engine's sessions read the frozen clock (``frozen_clock``).

    Before a statement, a session whose ``timestamp`` is not the frozen instant gets it
    (``DEFAULT``, the real clock, when nothing is frozen): ``UTC_TIMESTAMP(6)``, which every
    clock expression reads there, is then that instant for the whole statement.
    """
    @sa.event.listens_for(engine, "before_cursor_execute")
    def _pin(conn: sa.Connection, cursor: Any, *_args: Any) -> None:
        frozen = frozen_clock()
        if conn.info.get(_PINNED, None) == frozen:
            return
        if frozen is None:
            cursor.execute("SET timestamp = DEFAULT")
        else:
            cursor.execute(f"SET timestamp = {frozen:.3f}")
        conn.info[_PINNED] = frozen


@dataclass
class MachineDatabase:
    """Where each machine run gets its database: a fresh SQLite file, or the test's
    MariaDB database (``mariadb_url``, set by the test's fixture) emptied."""

    mariadb_url: str | None = None

    def engine(self, folder: Path) -> Engine:
        """An engine on an empty, migrated database for one run."""
        if self.mariadb_url is None:
            return create_engine(fresh_database(folder))
        engine = create_engine(self.mariadb_url)
        follow_frozen_clock(engine)
        with engine.begin() as conn:
            # The previous run's rows, whatever refers to what (keys keep counting up).
            conn.exec_driver_sql("SET foreign_key_checks = 0")
            for table in reversed(Base.metadata.sorted_tables):
                conn.execute(table.delete())
            conn.exec_driver_sql("SET foreign_key_checks = 1")
        return engine


DATABASE = MachineDatabase()


def snapshot(engine: Engine) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, in key order: 'nothing changed' is equality of two of these."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    with engine.connect() as conn:
        reader = read_only(conn)
        for table in Base.metadata.sorted_tables:
            query = sa.select(table).order_by(*table.primary_key.columns)
            out[table.name] = [tuple(row) for row in reader.execute(query)]
    return out


def rows(engine: Engine, table: sa.Table, *where: Any) -> list[dict[str, Any]]:
    """Every column of the matching rows of ``table``, in key order."""
    query = sa.select(table).where(*where).order_by(*table.primary_key.columns)
    with engine.connect() as conn:
        return [dict(r._mapping) for r in read_only(conn).execute(query)]


@dataclass(frozen=True, slots=True)
class Window:
    """The interval of database time in which a call's statements ran."""

    lo: datetime
    hi: datetime

    def contains(self, value: datetime | None, offset_seconds: float = 0.0) -> bool:
        """True when ``value`` is a database 'now + offset' taken inside this window."""
        if value is None:
            return False
        offset = timedelta(seconds=offset_seconds)
        return self.lo + offset <= value <= self.hi + offset

    def reached(self, instant: datetime) -> set[bool]:
        """The possible truth values of ``instant <= now`` for a now inside this window."""
        if instant <= self.lo:
            return {True}
        if instant > self.hi:
            return {False}
        if currently_in_test_context():
            event("a time comparison fell inside a call's window")
        return {True, False}

    def after(self, seconds: float) -> Window:
        """This window moved ``seconds`` later."""
        delta = timedelta(seconds=seconds)
        return Window(self.lo + delta, self.hi + delta)


class DbClock:
    """A repeatable database clock: virtual time on a half-second grid.

    Before each call the database clock is frozen at the virtual instant plus
    ``ORDER_GAP_SECONDS`` for every earlier call at that instant: within one instant
    timestamps follow the order of the calls, whatever the calls cost in real time. After
    ``CALLS_PER_INSTANT`` calls the clock steps on by itself. ``bracket`` also steps the
    clock past any instant in ``avoid``: the machine passes every boundary its model knows
    (lease expiries, activity plus a threshold, availability, session and leader
    timeouts), so no comparison lands near its boundary. Runs are then repeatable, as
    Hypothesis needs to replay and shrink them, even on a loaded machine.
    """

    def __init__(self) -> None:
        self.origin = float(int(time.time()))
        self.ticks = 0
        self._calls = 0
        self.pin()

    @property
    def virtual(self) -> float:
        """The virtual instant, as a POSIX timestamp."""
        return self.origin + self.ticks * GRID_SECONDS

    def pin(self) -> None:
        """Freeze the database's 'now' for the next call."""
        self._frozen = self.virtual + self._calls * ORDER_GAP_SECONDS
        freeze_sqlite_clock(self._frozen)

    def now(self) -> datetime:
        """The database's 'now' (to within ``SLACK``)."""
        return datetime.fromtimestamp(self._frozen, UTC)

    def tick_of(self, instant: datetime) -> int:
        """The grid instant a database timestamp was taken at (or lies on).

        Timestamps fall at or just after their instant (a few milliseconds before, at
        worst), so this rounds down with a little room.
        """
        return math.floor((instant.timestamp() - self.origin) / GRID_SECONDS + 0.05)

    def _step(self, ticks: int) -> None:
        self.ticks += ticks
        self._calls = 0

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` (rounded to the grid, at least one step) pass for every connection."""
        self._step(max(1, round(seconds / GRID_SECONDS)))
        self.pin()

    def reset(self) -> None:
        """Back to the real clock (always, at the end of a run)."""
        freeze_sqlite_clock(None)

    def bracket(self, call: Callable[[], T], avoid: Collection[int] = ()) -> tuple[T, Window]:
        """Run ``call`` at the first grid instant not in ``avoid``, with its window."""
        if self._calls >= CALLS_PER_INSTANT:
            self._step(1)
        while self.ticks in avoid:
            self._step(1)
        self.pin()
        instant = self.now()
        result = call()
        self._calls += 1
        return result, Window(instant - SLACK, instant + SLACK)
