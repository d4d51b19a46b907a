"""The operator console's parts: the console on an engine of its own."""

from __future__ import annotations

from dataclasses import replace

from reconciler.config.loader import Config
from reconciler.console import PAGE_STATEMENT_SECONDS, Console, open_console
from reconciler.core.passes import PassConfig
from reconciler.root.checks import source_factory
from reconciler.root.jobs import open_jobs
from reconciler.storage.console_views import ConsoleViewsSql
from reconciler.storage.diagnosis import error_code
from reconciler.storage.engines import DatabaseTimeouts, create_engine
from reconciler.storage.sql_store import SqlStore

__all__ = ["assemble_console"]


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
