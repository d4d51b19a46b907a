"""A ``reconciler`` command's parts: one engine with the settings' timeouts, checked once.

Also how the command line reads a database error: the exceptions that are one (the
driver's, through SQLAlchemy) and their bounded code and one redacted line, so that the
commands name no driver themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, OperationalError

from reconciler.config.loader import Config
from reconciler.core.operator_desk import OperatorDesk
from reconciler.core.passes import PassConfig
from reconciler.core.ports import OperatorStore, PassStore, SourceJobs
from reconciler.root.checks import check, keep, source_factory
from reconciler.root.desk import open_desk
from reconciler.root.jobs import open_jobs
from reconciler.storage.diagnosis import error_code, error_line
from reconciler.storage.engines import DatabaseTimeouts, create_engine
from reconciler.storage.sql_store import SqlStore

__all__ = ["DATABASE_ERRORS", "CliParts", "assemble_cli", "error_code", "error_line"]

DATABASE_ERRORS: tuple[type[Exception], ...] = (OperationalError, DBAPIError)
"""What a command may raise when the database fails it (the driver's errors, wrapped)."""


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
    """The configured source's jobs as operators list and show them."""
    desk: OperatorDesk | None
    """The operator actions on the configured source (None: it takes none)."""
    close: Callable[[], None]
    """Release the engine."""

    def pass_config(self, instance: str) -> PassConfig:
        """The pass configuration of this config for ``instance``."""
        return self.config.pass_config(instance)

    def __enter__(self) -> CliParts:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


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
    close = engine.dispose if owned else keep
    try:
        check(engine, config)
    except BaseException:
        close()
        raise
    store = SqlStore(engine, source_factory(config), timeouts=timeouts)
    return CliParts(config, store, store, open_jobs(engine, config.source, config.kinds, store),
                    open_desk(engine, config, store), close)
