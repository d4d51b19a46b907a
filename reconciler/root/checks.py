"""What the process roles share: the start-up checks and how a pass opens its source."""

from __future__ import annotations

import logging
import time

from sqlalchemy.engine import Connection, Engine

from reconciler.config.loader import Config
from reconciler.config.registry import ENGINE_NAMES, entry_of, is_native
from reconciler.config.tables import SourceSettings
from reconciler.core.kinds import KindRules
from reconciler.core.vocabulary import DatabaseErrorCode
from reconciler.errors import ConfigError, DatabaseUnavailableError
from reconciler.sources.kit.source import DeclaredSource
from reconciler.storage.engines import database_host
from reconciler.storage.pass_store import SourceFactory
from reconciler.storage.schema import require_current

START_RETRY_PAUSE_SECONDS = 0.5

log = logging.getLogger("reconciler.start")


def keep() -> None:
    """Closing parts on an engine someone else owns releases nothing."""


def check(engine: Engine, config: Config) -> None:
    """Refuse an unreachable database, one whose schema is not at this release's head, or
    (for a foreign ``[source]``) one without that system's tables: one line naming it."""
    require_current(engine)
    check_source(engine, config)


def check_at_start(engine: Engine, config: Config, retry_seconds: float) -> None:
    """``check``, retrying a database that is unavailable for a moment (a restart, a
    server still starting) for ``retry_seconds``, one log line per retry, so a transient
    error is neither an old schema nor an exit at once. An error that waiting cannot
    clear (no such database or role, a password refused) is raised at once."""
    deadline = time.monotonic() + retry_seconds
    attempt = 0
    while True:
        try:
            check(engine, config)
        except DatabaseUnavailableError as exc:
            if DatabaseErrorCode(exc.code).lasting or time.monotonic() >= deadline:
                raise
            attempt += 1
            log.warning("event=database_wait code=%s host=%s attempt=%d retry_in_seconds=%s "
                        "gives_up_in_seconds=%.1f", exc.code, database_host(engine), attempt,
                        START_RETRY_PAUSE_SECONDS, max(0.0, deadline - time.monotonic()))
            time.sleep(START_RETRY_PAUSE_SECONDS)
        else:
            if attempt:
                log.info("event=database_reached host=%s attempts=%d", database_host(engine),
                         attempt + 1)
            return


def check_source(engine: Engine, config: Config) -> None:
    """Refuse a foreign ``[source]`` on an engine it does not run on, or whose tables,
    columns or functions are not there."""
    if is_native(config.source):
        return
    engines, dialect = entry_of(config.source).engines, engine.dialect.name
    if dialect not in engines:
        needs = " or ".join(ENGINE_NAMES[name] for name in ENGINE_NAMES if name in engines)
        raise ConfigError(f"source {config.source.kind} needs {needs} (the database_url is "
                          f"{dialect})")
    with engine.connect() as conn:
        open_foreign_source(conn, config.source, config.kinds, lock=False).check_schema()
        conn.rollback()


def open_foreign_source(connection: Connection, config: SourceSettings, kinds: KindRules, *,
                        lock: bool = True) -> DeclaredSource:
    """The foreign source a ``[source]`` table names, bound to ``connection``.

    ``lock=False`` for dry runs and explain: candidates are read without row locks. The
    native source is not built here (``ValueError``): it is the store's.
    """
    if is_native(config):
        raise ValueError(f"source kind {config.kind!r} is not a foreign source")
    source = entry_of(config).open(connection, config, kinds, lock=lock)
    if not isinstance(source, DeclaredSource):  # pragma: no cover - a registry mistake
        raise TypeError(f"source kind {config.kind!r} opens no declared source")
    return source


def source_factory(config: Config) -> SourceFactory:
    """How a pass's transaction gets its job source: the configured ``[source]`` (native,
    the default, honours ``[kinds]`` too), declared once for the process as its registry
    entry says (importing only that source) and bound to each transaction."""
    return config.source_entry.bind(config.source, config.kinds)
