"""The composition root: each kind of process assembled once, from one config.

One function per process role: ``assemble_cli`` (a ``reconciler`` command),
``assemble_sidecar`` (``reconciler run``), ``assemble_worker`` (a ``JobClient``), and
``migrate`` (``reconciler db upgrade``). Each opens the engines its role needs with that
role's timeouts, runs the schema and source checks once, and returns its parts typed by
the ports their callers use. Nothing else in the package imports a concrete storage
adapter (a test of the import graph keeps it so); nothing downstream reaches back here
for a factory.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import TracebackType

from sqlalchemy.engine import Connection, Engine

from reconciler.config import Config, load_config
from reconciler.console import PAGE_STATEMENT_SECONDS, Console, open_console
from reconciler.core.kinds import KindRules
from reconciler.core.passes import PassConfig
from reconciler.core.ports import JobRetention, JobSource, OperatorStore, PassStore, SourceJobs
from reconciler.core.worker_ports import ArtifactRecords, WorkerStore, WorkWaiter
from reconciler.errors import DatabaseUnavailableError
from reconciler.redaction import display_url
from reconciler.settings import Settings
from reconciler.sources import open_foreign_source
from reconciler.sources.jobs import open_jobs
from reconciler.sources.registry import is_native
from reconciler.storage.console_views import ConsoleViewsSql
from reconciler.storage.diagnosis import database_answers, error_code, error_line
from reconciler.storage.engines import DatabaseTimeouts, create_engine
from reconciler.storage.pass_store import SourceFactory
from reconciler.storage.retention import JobRetentionSql
from reconciler.storage.schema import require_current, upgrade
from reconciler.storage.sql_store import SqlStore
from reconciler.storage.step_ledger import LedgerRun
from reconciler.storage.step_ledger import StepLedger as SqlStepLedger
from reconciler.storage.wakeups import NotifyWaiter

__all__ = [
    "CliParts",
    "DatabaseCheck",
    "LedgerRun",
    "SidecarParts",
    "StepLedger",
    "WorkerParts",
    "assemble_cli",
    "assemble_console",
    "assemble_sidecar",
    "assemble_worker",
    # Reading a database error (a bounded code and one redacted line, for logs, metrics,
    # /readyz and the CLI's one error line): the storage's diagnosis.
    "database_answers",
    "error_code",
    "error_line",
    "migrate",
    "pass_config",
]

# /readyz must answer within half a second: its probe gives up on the database quickly.
PROBE_TIMEOUTS = DatabaseTimeouts(
    connect_seconds=2, statement_seconds=1.0, lock_seconds=1.0, sqlite_busy_seconds=0.5,
    pass_statement_seconds=None, pass_lock_seconds=None)
START_RETRY_PAUSE_SECONDS = 0.5


# --------------------------------------------------------------------------- #
# The parts of each role
# --------------------------------------------------------------------------- #


@dataclass(frozen=True, slots=True)
class CliParts:
    """What one CLI command works with: one engine, with the settings' timeouts, checked
    once (schema at head, the configured source's tables there)."""

    config: Config
    store: OperatorStore
    """This project's own tables: jobs, decisions, operator actions."""
    passes: PassStore
    """The configured ``[source]`` with the audit and the lease (the same store)."""
    jobs: SourceJobs
    """The configured source's jobs as operators list, show and act on them."""
    close: Callable[[], None]
    """Release the engine."""

    def pass_config(self, instance: str) -> PassConfig:
        """The pass configuration of this config for ``instance``."""
        return pass_config(self.config.settings, instance, self.config.kinds)

    def __enter__(self) -> CliParts:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class DatabaseCheck:
    """What ``/readyz`` asks of the database, on an engine of its own with short timeouts:
    the start-up's schema and source check, again."""

    run: Callable[[], None]
    """Raise (a ``ReconcilerError`` naming it) unless the database is ready."""
    close: Callable[[], None]
    """Release the check's engine."""


@dataclass(frozen=True, slots=True)
class SidecarParts:
    """What ``reconciler run`` works with: one engine whose sessions carry the pass
    timeouts, one store on it, and the probe's own engine."""

    settings: Settings
    instance: str
    """This replica's name in the audit trail and the leader lease."""
    pass_config: PassConfig
    passes: PassStore
    """The configured ``[source]`` with the audit and the lease."""
    artifacts: ArtifactRecords
    """This project's artifact records (the sweep's), on the same store."""
    job_retention: JobRetention
    database_check: DatabaseCheck
    console: Console | None
    """The read-only operator console (None: ``console = false``); it closes its own
    engine."""
    close: Callable[[], None]
    """Release the engine (the probe and the console close their own)."""


@dataclass(frozen=True, slots=True)
class WorkerParts:
    """What a ``JobClient`` works with: an engine with the settings' timeouts, checked."""

    settings: Settings
    engine: Engine
    """Producers may enqueue in a transaction of their own on it (``connection=``)."""
    store: WorkerStore
    work_waiter: Callable[[threading.Event], WorkWaiter]
    """What an idle worker waits on: LISTEN/NOTIFY on PostgreSQL, polling elsewhere."""
    owns_engine: bool
    """Whether the engine was opened here (from a URL) and is to be disposed of."""


# --------------------------------------------------------------------------- #
# Assembly
# --------------------------------------------------------------------------- #


def assemble_cli(config: Config, *, engine: Engine | None = None) -> CliParts:
    """A CLI command's parts: ``config``'s database, checked (schema and source) once.

    A missing SQLite file is an error naming it, not a new empty database. ``engine``: use
    this one (a test's, a tool's) as it is, instead of opening ``database_url``; its owner
    disposes of it.
    """
    settings = config.settings
    timeouts = DatabaseTimeouts.from_settings(settings)
    owned = engine is None
    if engine is None:
        engine = create_engine(settings.database_url, timeouts=timeouts, must_exist=True)
    close = engine.dispose if owned else _keep
    try:
        _check(engine, config)
    except BaseException:
        close()
        raise
    store = SqlStore(engine, source_factory(config), timeouts=timeouts)
    return CliParts(config, store, store, open_jobs(engine, config.source, config.kinds, store),
                    close)


def assemble_sidecar(config: Config, *, instance: str | None = None) -> SidecarParts:
    """The sidecar's parts, from ``config``.

    Every session carries the pass timeouts (derived from the interval), so a pass needs
    no ``SET LOCAL`` of its own (one round trip fewer on every pass, most of which find
    nothing) and a frozen database fails a pass instead of hanging it. The schema and the
    source are checked once here, retrying a database that is unavailable for a moment (a
    restart, a lock) for ``start_retry_seconds``; ``/readyz`` runs the same check.
    """
    settings = config.settings
    name = instance or settings.instance_name or f"{socket.gethostname()}-{os.getpid()}"
    timeouts = DatabaseTimeouts.for_passes(settings)
    engine = create_engine(settings.database_url, timeouts=timeouts, must_exist=True)
    try:
        _check_at_start(engine, config, settings.start_retry_seconds)
        # One connection is all a probe at a time needs; a second replaces one left stuck.
        probe = create_engine(settings.database_url, timeouts=PROBE_TIMEOUTS, pool_size=1,
                              max_overflow=1)
    except BaseException:
        engine.dispose()
        raise
    store = SqlStore(engine, source_factory(config), timeouts=timeouts)
    passes = pass_config(settings, name, config.kinds)
    return SidecarParts(
        settings=settings, instance=name, pass_config=passes,
        passes=store, artifacts=store, job_retention=JobRetentionSql(engine),
        database_check=DatabaseCheck(lambda: _check(probe, config), probe.dispose),
        console=assemble_console(config, passes) if settings.console else None,
        close=engine.dispose)


def assemble_console(config: Config, passes: PassConfig) -> Console:
    """The console on an engine of its own (a page never waits for a pass's connection, nor
    a pass for a page's), whose statements give up sooner than a pass's."""
    settings = config.settings
    base = DatabaseTimeouts.from_settings(settings)
    limit = min(settings.statement_timeout_seconds, PAGE_STATEMENT_SECONDS)
    # Explain opens a (read-only) pass transaction: the same limits, so none is set twice.
    timeouts = replace(base, statement_seconds=limit, pass_statement_seconds=limit,
                       pass_lock_seconds=base.lock_seconds)
    engine = create_engine(settings.database_url, timeouts=timeouts, must_exist=True)
    explaining = SqlStore(engine, source_factory(config), timeouts=timeouts)
    # The job page shows any job the configured source lists, decided or not.
    jobs = open_jobs(engine, config.source, config.kinds, explaining)
    return open_console(ConsoleViewsSql(engine), explaining, jobs, config, passes,
                        classify=lambda exc: error_code(exc).value, close=engine.dispose)


def assemble_worker(database: str | Engine | None = None, *,
                    settings: Settings | None = None) -> WorkerParts:
    """A worker's or producer's parts: ``database`` (a URL, or an engine used as it is),
    else the database the config names (``RECONCILER_CONFIG``, ``RECONCILER_<SETTING>``);
    ``settings``, else the config's.

    With a URL, the engine carries the settings' timeouts: a database that stops
    answering fails a heartbeat instead of holding the lease thread forever.
    """
    settings = settings or load_config().settings
    if isinstance(database, Engine):
        engine, owned = database, False
    else:
        engine = create_engine(database or settings.database_url,
                               timeouts=DatabaseTimeouts.from_settings(settings),
                               must_exist=True)
        owned = True
    try:
        require_current(engine)
    except BaseException:
        if owned:
            engine.dispose()
        raise

    def waiter(interrupt: threading.Event) -> WorkWaiter:
        return NotifyWaiter(engine, interrupt)

    return WorkerParts(settings, engine, SqlStore(engine), waiter, owned)


class StepLedger(SqlStepLedger):
    """The step ledger (``reconciler.ledger``) on ``database`` (a URL or an engine), else
    on the database the config names (``RECONCILER_CONFIG``, ``RECONCILER_<SETTING>``),
    with its timeouts."""

    __slots__ = ()

    def __init__(self, database: str | Engine | None = None) -> None:
        if database is None:
            settings = load_config().settings
            super().__init__(settings.database_url,
                             timeouts=DatabaseTimeouts.from_settings(settings))
        else:
            super().__init__(database)


def migrate(config: Config) -> str:
    """``db upgrade``: apply this project's migrations (only its own tables; a foreign
    schema is never altered), then check the configured foreign source's schema is
    there. Returns the database, as it may be shown."""
    settings = config.settings
    engine = create_engine(settings.database_url,
                           timeouts=DatabaseTimeouts.from_settings(settings))
    try:
        upgrade(engine)
        _check_source(engine, config)
        return display_url(engine.url.render_as_string(hide_password=True))
    finally:
        engine.dispose()


# --------------------------------------------------------------------------- #
# Shared steps
# --------------------------------------------------------------------------- #


def _keep() -> None:
    """Closing parts on an engine someone else owns releases nothing."""


def _check(engine: Engine, config: Config) -> None:
    """Refuse an unreachable database, one whose schema is not at this release's head, or
    (for a foreign ``[source]``) one without that system's tables: one line naming it."""
    require_current(engine)
    _check_source(engine, config)


def _check_at_start(engine: Engine, config: Config, retry_seconds: float) -> None:
    """``_check``, retrying a database that is unavailable for a moment for
    ``retry_seconds``, so a transient error is neither an old schema nor an exit at once."""
    deadline = time.monotonic() + retry_seconds
    while True:
        try:
            _check(engine, config)
            return
        except DatabaseUnavailableError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(START_RETRY_PAUSE_SECONDS)


def _check_source(engine: Engine, config: Config) -> None:
    """Refuse a foreign ``[source]`` whose tables, columns or functions are not there."""
    if is_native(config.source):
        return
    with engine.connect() as conn:
        open_foreign_source(conn, config.source, config.kinds, lock=False).check_schema()
        conn.rollback()


def source_factory(config: Config) -> SourceFactory:
    """How a pass's transaction gets its job source: the configured ``[source]`` (native,
    the default, honours ``[kinds]`` too), opened as its registry entry says."""
    open_source, source, kinds = config.source_entry.open, config.source, config.kinds

    def opened(conn: Connection, lock: bool) -> JobSource:
        return open_source(conn, source, kinds, lock=lock)

    return opened


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
