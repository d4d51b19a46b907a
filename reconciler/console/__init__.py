"""The operator console: read-only pages served by ``reconciler run`` beside /metrics.

``open_console`` assembles it from the settings: its own engine (so a page never waits for
a pass's connection, nor a pass for a page's), the bounded reads, the configured source's
explain, and the token.
"""

from __future__ import annotations

from reconciler.config import Config
from reconciler.console.app import Console, Reply
from reconciler.console.pages import ConsoleState, Pages
from reconciler.core.passes import PassConfig, explain_jobs
from reconciler.core.ports import JobKey, PlannedChange
from reconciler.settings import Settings
from reconciler.wiring import DatabaseTimeouts, open_console_reads, open_engine, open_pass_store

__all__ = ["Console", "Reply", "open_console"]


def open_console(settings: Settings, config: Config | None, passes: PassConfig
                 ) -> Console | None:
    """The console these settings ask for, or None with ``console = false``."""
    if not settings.console:
        return None
    engine = open_engine(settings.database_url,
                         timeouts=DatabaseTimeouts.from_settings(settings), must_exist=True)
    explaining = open_pass_store(engine, config)

    def explain(job_id: JobKey) -> list[PlannedChange]:
        return explain_jobs(explaining, [job_id], passes)

    source = "native" if config is None else config.source.kind
    state = ConsoleState(source=str(source), shadow=settings.shadow,
                         brake_hold_seconds=None if passes.brake is None
                         else passes.brake.hold_seconds)
    return Console(Pages(open_console_reads(engine), explain, state), settings.console_token,
                   close=engine.dispose)
