"""The operator console's parts: the console on an engine of its own, and the operator
desk of the configured source it acts through (``root.desk``)."""

from __future__ import annotations

from dataclasses import replace

from reconciler.config.loader import Config
from reconciler.console import PAGE_STATEMENT_SECONDS, Console, open_console
from reconciler.core.operator_desk import ActionCounter, not_counted
from reconciler.core.passes import PassConfig
from reconciler.errors import ConfigError
from reconciler.root.checks import source_factory
from reconciler.root.desk import open_desk
from reconciler.root.jobs import open_jobs
from reconciler.storage.console_views import ConsoleViewsSql
from reconciler.storage.diagnosis import error_code
from reconciler.storage.engines import DatabaseTimeouts, create_engine
from reconciler.storage.sql_store import SqlStore

__all__ = ["assemble_console"]


def assemble_console(config: Config, passes: PassConfig,
                     counted: ActionCounter = not_counted) -> Console:
    """The console on an engine of its own (a page never waits for a pass's connection, nor
    a pass for a page's), whose statements give up sooner than a pass's; its operators act
    through the source's desk, each action counted by ``counted``."""
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
    desk = open_desk(engine, config, explaining, counted)
    if desk is None:
        engine.dispose()
        raise ConfigError(f"source {config.source_entry.kind} takes no operator action; "
                          "set console = false")
    return open_console(ConsoleViewsSql(engine), explaining, jobs, config, passes, desk=desk,
                        classify=lambda exc: error_code(exc).value, close=engine.dispose)
