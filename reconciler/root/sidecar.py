"""``reconciler run``'s parts: one engine whose sessions carry the pass timeouts, one store
on it, the probe's own engine, and the console on another."""

from __future__ import annotations

import os
import socket

from reconciler.config.loader import Config
from reconciler.root.checks import check, check_at_start, source_factory
from reconciler.root.console import assemble_console
from reconciler.sidecar.parts import DatabaseCheck, ErrorReading, SidecarParts
from reconciler.storage.diagnosis import error_code, error_line
from reconciler.storage.engines import DatabaseTimeouts, create_engine
from reconciler.storage.retention import JobRetentionSql
from reconciler.storage.sql_store import SqlStore

__all__ = ["PROBE_TIMEOUTS", "assemble_sidecar"]

# /readyz must answer within half a second: its probe gives up on the database quickly.
PROBE_TIMEOUTS = DatabaseTimeouts(
    connect_seconds=2, statement_seconds=1.0, lock_seconds=1.0, sqlite_busy_seconds=0.5,
    pass_statement_seconds=None, pass_lock_seconds=None)


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
        check_at_start(engine, config, settings.start_retry_seconds)
        # One connection is all a probe at a time needs; a second replaces one left stuck.
        probe = create_engine(settings.database_url, timeouts=PROBE_TIMEOUTS, pool_size=1,
                              max_overflow=1)
    except BaseException:
        engine.dispose()
        raise
    store = SqlStore(engine, source_factory(config), timeouts=timeouts)
    passes = config.pass_config(name)
    return SidecarParts(
        settings=settings, instance=name, pass_config=passes,
        passes=store, artifacts=store, job_retention=JobRetentionSql(engine),
        database_check=DatabaseCheck(lambda: check(probe, config), probe.dispose),
        errors=ErrorReading(code=error_code, line=error_line),
        console=((lambda counted: assemble_console(config, passes, counted))
                 if settings.console else None),
        close=engine.dispose)
