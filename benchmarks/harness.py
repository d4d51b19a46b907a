"""What every benchmark module shares: the report's rows, fresh databases, the drain.

Kept out of ``__main__`` so that the measurement modules (``recovery``, ``peers``,
``breakdown``) and the command line import it alike, with no cycle through ``__main__``.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from reconciler.core.decisions import Thresholds
from reconciler.core.passes import PassConfig, PassReport, run_pass
from reconciler.core.ports import PassStore
from reconciler.storage.engines import UNLIMITED_TIMEOUTS, create_engine
from reconciler.storage.schema import downgrade, upgrade
from reconciler.storage.sql_store import SqlStore
from tests.progress import Progress

THRESHOLDS = Thresholds(stale_after_seconds=60.0, wedged_after_seconds=3600.0)
BATCH_SIZES = (100, 500, 2000)
QUIET_PASSES = 50
# What the run is doing, on stderr at least every 10 s (the table or JSON stays on stdout).
PROGRESS = Progress("benchmark", enabled=False)


@dataclass
class Measurement:
    """One row of the report; ``as_json`` is one line of ``--json`` output."""

    measurement: str
    engine: str
    jobs: int
    stale: int
    value: float
    unit: str
    extra: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> str:
        return json.dumps({"measurement": self.measurement, "engine": self.engine,
                           "jobs": self.jobs, "stale": self.stale, "value": self.value,
                           "unit": self.unit, **self.extra})


class Databases:
    """Fresh, migrated databases on one engine."""

    def __init__(self, engine_name: str, base_url: str | None) -> None:
        self.engine_name = engine_name
        self.base_url = base_url
        self._server: Any = None
        self._tmp = Path(tempfile.mkdtemp(prefix="reconciler-bench-"))
        self._created: list[str] = []

    @contextmanager
    def fresh(self) -> Iterator[Engine]:
        """A migrated database: a new one (a SQLite file removed afterwards), or the one
        ``--database-url`` names."""
        if self.engine_name == "sqlite":
            path = self._tmp / f"{uuid.uuid4().hex[:8]}.db"
            url = f"sqlite:///{path}"
        else:
            url = self.server_database()
        # Datasets of a million rows take longer than a session's statement timeout.
        engine = create_engine(url, timeouts=UNLIMITED_TIMEOUTS)
        upgrade(engine)
        try:
            yield engine
        finally:
            if self.engine_name != "sqlite" and self.base_url is not None:
                # Every dataset uses the one named database: leave it empty for the next.
                downgrade(engine)
            engine.dispose()
            if self.engine_name == "sqlite":
                for suffix in ("", "-wal", "-shm"):
                    Path(f"{path}{suffix}").unlink(missing_ok=True)

    def server_database(self) -> str:
        """The URL of a new empty database on the throwaway server (PostgreSQL or
        MariaDB), or ``--database-url``."""
        if self.base_url is not None:
            return self.base_url
        if self._server is None:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
            self._server = _throwaway_server(self.engine_name)
        name = f"bench_{uuid.uuid4().hex[:8]}"
        self._server.create_database(name)
        return str(self._server.url(name))

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()


MARIADB_BUFFER_POOL = "2G"
"""The benchmark's MariaDB holds a million jobs in memory, as PostgreSQL's page cache does
(the test server's 64 MiB pool would measure the disk instead)."""


def _throwaway_server(engine_name: str) -> Any:
    """A started throwaway server of the engine: tests/pg_server.py or tests/mariadb_server.py."""
    if engine_name == "mariadb":
        from tests.mariadb_server import ThrowawayMariaDB  # noqa: PLC0415 - only for MariaDB

        return ThrowawayMariaDB(buffer_pool=MARIADB_BUFFER_POOL).start()
    from tests.pg_server import ThrowawayPostgres  # noqa: PLC0415 - only for PostgreSQL

    return ThrowawayPostgres().start()


def store_on(engine: Engine) -> SqlStore:
    """The store on an engine of ``Databases.fresh``, told the engine's timeouts (none but
    the connection's): a pass then adds no ``SET LOCAL`` of its own, as before."""
    return SqlStore(engine, timeouts=UNLIMITED_TIMEOUTS)


def timed(func: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = func()
    return time.perf_counter() - started, result


def bench_config(batch_size: int) -> PassConfig:
    return PassConfig(batch_size=batch_size, thresholds=THRESHOLDS, instance="bench")


def drain(store: PassStore, batch_size: int, progress: Progress = PROGRESS,
          stale: int | None = None) -> tuple[int, int]:
    """Run passes until nothing is stale; (jobs decided, passes)."""
    decided = passes = 0
    config = bench_config(batch_size)
    progress.phase(f"draining {stale or 'the'} stale jobs, {batch_size} a pass", total=stale,
                   announce=False)
    while True:
        report: PassReport = run_pass(store, config)
        passes += 1
        decided += len(report.decisions)
        progress.advance(decided)
        if len(report.decisions) < batch_size:
            return decided, passes


def job_table_reads(statements: list[str], table: str) -> int:
    """The statements that read ``table``: any but a write whose FROM or JOIN names it
    (a swap's ``UPDATE ... FROM`` writes it, and is not counted)."""
    named = re.compile(rf'\b(FROM|JOIN)\s+("?\w+"?\.)?"?{re.escape(table)}"?(\s|$|\))')
    return sum(1 for text in statements
               if not text.lstrip().upper().startswith(("UPDATE", "INSERT", "DELETE"))
               and named.search(text))


@contextmanager
def counting_statements(engine: Engine) -> Iterator[list[str]]:
    """Every statement sent to the database while the block runs."""
    statements: list[str] = []

    def count(*args: Any) -> None:
        statements.append(str(args[2]))

    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        yield statements
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)


def row_printer(as_json: bool, source_width: int) -> Callable[[dict[str, Any]], None]:
    """Print a measurement row: one JSON object a line, or aligned columns (source,
    measurement, value, unit, then the rest as ``key=value``)."""
    def emit(row: dict[str, Any]) -> None:
        if as_json:
            print(json.dumps(row), flush=True)
            return
        extra = " ".join(f"{k}={v}" for k, v in row.items()
                         if k not in ("source", "measurement", "value", "unit"))
        print(f"{row['source']:<{source_width}} {row['measurement']:<12} "
              f"{row['value']:>10} {row['unit']:<7} {extra}", flush=True)

    return emit
