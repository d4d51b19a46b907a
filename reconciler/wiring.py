"""The one composition root: engines, stores and the pass's job source, built from settings.

Nothing else in the package imports a concrete storage adapter (a test of the import
graph keeps it so): the CLI, the sidecar and the worker client ask here, and get back
objects typed by the ports they use.
"""

from __future__ import annotations

import threading
from typing import Any

from sqlalchemy.engine import Connection, Engine

from reconciler.config import Config
from reconciler.core.kinds import KindRules
from reconciler.core.passes import PassConfig
from reconciler.core.ports import JobSource, PassStore, SourceJobs
from reconciler.core.worker_ports import WorkWaiter
from reconciler.settings import Settings
from reconciler.sources import open_foreign_source
from reconciler.sources.jobs import open_jobs
from reconciler.sources.registry import is_native
from reconciler.storage.console_views import ConsoleViewsSql
from reconciler.storage.diagnosis import database_answers, error_code, error_line
from reconciler.storage.engines import DatabaseTimeouts, create_engine
from reconciler.storage.pass_store import SourceFactory, native_source
from reconciler.storage.retention import JobRetentionSql
from reconciler.storage.schema import require_current, upgrade
from reconciler.storage.sql_store import SqlStore
from reconciler.storage.step_ledger import LedgerRun, StepLedger
from reconciler.storage.wakeups import NotifyWaiter

__all__ = [
    # What callers need to ask for timeouts and to read a database error: the engine's
    # timeouts (a value built from settings) and the storage's diagnosis (a bounded code
    # and one redacted line, for logs, metrics and /readyz).
    "DatabaseTimeouts",
    # The step ledger is public API (reconciler.ledger); its store is handed out from here.
    "LedgerRun",
    "StepLedger",
    "check_schema",
    "database_answers",
    "error_code",
    "error_line",
    "open_console_reads",
    "open_engine",
    "open_job_retention",
    "open_pass_store",
    "open_source_jobs",
    "open_store",
    "pass_config",
    "source_factory",
    "upgrade_schema",
    "work_waiter",
]


def open_engine(database: str | Engine, *, timeouts: DatabaseTimeouts | None = None,
                must_exist: bool = False, **kwargs: Any) -> Engine:
    """An engine for a database URL (an engine is passed through, as it is).

    ``timeouts``: how long any wait on the database may last (default: the settings'
    defaults). ``must_exist``: a missing SQLite file is an error naming it, not a new empty
    database (every command but ``db upgrade``).
    """
    if not isinstance(database, str):
        return database
    return create_engine(database, timeouts=timeouts, must_exist=must_exist, **kwargs)


def check_schema(engine: Engine, config: Config | None = None) -> None:
    """Refuse an unreachable database, one whose schema is not at this release's head, or
    (for a foreign ``[source]``) one without that system's tables: one line naming it."""
    require_current(engine)
    check_source(engine, config)


def open_job_retention(engine: Engine) -> JobRetentionSql:
    """Retention of finished jobs in this project's own tables (a sidecar chore)."""
    return JobRetentionSql(engine)


def check_source(engine: Engine, config: Config | None) -> None:
    """Refuse a foreign ``[source]`` whose tables, columns or functions are not there."""
    if config is None or is_native(config.source):
        return
    with engine.connect() as conn:
        open_foreign_source(conn, config.source, config.kinds, lock=False).check_schema()
        conn.rollback()


def upgrade_schema(engine: Engine, config: Config | None = None) -> None:
    """Apply this project's migrations (only its own tables; a foreign schema is never
    altered), then check the configured foreign source's schema is there."""
    upgrade(engine)
    check_source(engine, config)


def open_store(engine: Engine) -> SqlStore:
    """Every operation on this project's own tables: claims, sessions, artifacts, operator
    actions, read views, and passes over the native source."""
    return SqlStore(engine)


def open_source_jobs(engine: Engine, config: Config) -> SourceJobs:
    """The configured source's jobs as operators list, show and act on them."""
    return open_jobs(engine, config.source, config.kinds, SqlStore(engine))


def source_factory(config: Config | None) -> SourceFactory:
    """How a pass's transaction gets its job source: the configured ``[source]`` (native,
    the default, honours ``[kinds]`` too), opened as its registry entry says."""
    if config is None:
        return native_source
    open_source, source, kinds = config.source_entry.open, config.source, config.kinds

    def opened(conn: Connection, lock: bool) -> JobSource:
        return open_source(conn, source, kinds, lock=lock)

    return opened


def open_console_reads(engine: Engine) -> ConsoleViewsSql:
    """The operator console's bounded, read-only queries (give it an engine of its own)."""
    return ConsoleViewsSql(engine)


def open_pass_store(engine: Engine, config: Config | None = None) -> PassStore:
    """Where passes read and apply: the configured job source with the audit and lease."""
    return SqlStore(engine, source_factory(config))


def work_waiter(engine: Engine, interrupt: threading.Event) -> WorkWaiter:
    """What an idle worker waits on: LISTEN/NOTIFY on PostgreSQL, polling elsewhere."""
    return NotifyWaiter(engine, interrupt)


def pass_config(settings: Settings, instance: str, kinds: KindRules | None = None
                ) -> PassConfig:
    """The pass configuration these settings (and ``[kinds]``) give an instance.

    With ``[kinds]``, the scan's thresholds are the defaults with the shortest wedged time
    any kind has (so a kind wedged sooner is found) and each job is decided under its own
    kind's thresholds.
    """
    return PassConfig(
        batch_size=settings.batch_size,
        thresholds=settings.thresholds() if kinds is None else kinds.scan_thresholds(),
        instance=instance,
        session_timeout_seconds=settings.session_timeout_seconds,
        shadow=settings.shadow,
        brake=settings.brake_limits(),
        kinds=kinds,
    )
