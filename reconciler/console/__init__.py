"""The operator console: read-only pages served by ``reconciler run`` beside /metrics.

``open_console`` assembles it from the settings: its own engine (so a page never waits for
a pass's connection, nor a pass for a page's), the bounded reads, the configured source's
explain, and the token.
"""

from __future__ import annotations

from dataclasses import replace

from reconciler.config import Config
from reconciler.console.app import Console, Reply
from reconciler.console.pages import ConsoleState, Pages
from reconciler.core.passes import PassConfig, explain_jobs
from reconciler.core.ports import JobKey, PlannedChange
from reconciler.settings import Settings
from reconciler.sources.registry import DEFAULT_SOURCE
from reconciler.wiring import DatabaseTimeouts, open_console_reads, open_engine, open_pass_store

__all__ = ["Console", "Reply", "open_console"]

# A page's statements give up after this (PostgreSQL): the sidecar's few HTTP threads also
# answer /metrics and /readyz, and a page stuck on a slow database must not hold them.
PAGE_STATEMENT_SECONDS = 5.0


def open_console(settings: Settings, config: Config | None, passes: PassConfig
                 ) -> Console | None:
    """The console these settings ask for, or None with ``console = false``."""
    if not settings.console:
        return None
    limit = min(settings.statement_timeout_seconds, PAGE_STATEMENT_SECONDS)
    base = DatabaseTimeouts.from_settings(settings)
    # Explain opens a (read-only) pass transaction: the same limits, so none is set twice.
    timeouts = replace(base, statement_seconds=limit, pass_statement_seconds=limit,
                       pass_lock_seconds=base.lock_seconds)
    engine = open_engine(settings.database_url, timeouts=timeouts, must_exist=True)
    explaining = open_pass_store(engine, config)

    def explain(job_id: JobKey) -> list[PlannedChange]:
        return explain_jobs(explaining, [job_id], passes)

    source = DEFAULT_SOURCE if config is None else config.source.kind
    state = ConsoleState(source=str(source), shadow=settings.shadow,
                         brake_hold_seconds=None if passes.brake is None
                         else passes.brake.hold_seconds)
    return Console(Pages(open_console_reads(engine), explain, state), settings.console_token,
                   close=engine.dispose)
