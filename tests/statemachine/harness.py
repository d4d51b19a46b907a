"""What the state machine and its regression tests share: databases, the clock, snapshots.

Each machine run (and each regression test) gets its own migrated SQLite file, copied from
one template migrated once per process, so a run starts in milliseconds. Time moves only by
``set_sqlite_clock_offset``; ``DbClock`` reads the same clock from Python, and ``Window``
brackets a call: every database instant inside the call lies between the clock read just
before it and the clock read just after it (widened by ``SLACK`` for SQLite's millisecond
ticks).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from models import Base
from reconciler.clock import set_sqlite_clock_offset
from reconciler.db import create_engine, read_only
from reconciler.schema import upgrade

SLACK = timedelta(milliseconds=50)
"""How far a database instant may sit outside the Python clock reads around its call."""

T = TypeVar("T")


@functools.cache
def _template() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="reconciler-statemachine-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = folder / "template.db"
    engine = create_engine(f"sqlite:///{path}")
    upgrade(engine)
    engine.dispose()  # the last connection checkpoints the WAL: the file alone is the database
    return path


def fresh_database(folder: Path) -> str:
    """A URL of a freshly migrated SQLite database in ``folder`` (a copy of the template)."""
    target = folder / "jobs.db"
    shutil.copyfile(_template(), target)
    return f"sqlite:///{target}"


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
        return {True, False}

    def after(self, seconds: float) -> Window:
        """This window moved ``seconds`` later."""
        delta = timedelta(seconds=seconds)
        return Window(self.lo + delta, self.hi + delta)


class DbClock:
    """The SQLite database clock of this process, as Python sees it, and its offset."""

    def __init__(self) -> None:
        self.offset_seconds = 0.0
        set_sqlite_clock_offset(0.0)

    def now(self) -> datetime:
        """The database's 'now' (to within SQLite's millisecond tick)."""
        return datetime.fromtimestamp(time.time() + self.offset_seconds, UTC)

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass for every connection in this process."""
        self.offset_seconds += seconds
        set_sqlite_clock_offset(self.offset_seconds)

    def reset(self) -> None:
        """Back to the real clock (always, at the end of a run)."""
        self.offset_seconds = 0.0
        set_sqlite_clock_offset(0.0)

    def bracket(self, call: Callable[[], T]) -> tuple[T, Window]:
        """Run ``call`` and return its result with the window its statements ran in."""
        lo = self.now() - SLACK
        result = call()
        return result, Window(lo, self.now() + SLACK)
