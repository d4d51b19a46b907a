"""The operator console: pages served by ``reconciler run`` beside /metrics, and the
forms through which a named operator acts on the jobs they show.

``open_console`` composes it from parts the composition root builds
(``reconciler.root.console`` gives it an engine of its own, so a page never waits for a
pass's connection, nor a pass for a page's): the bounded reads, the configured source's
explain, its operator desk, and the tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reconciler.config.loader import Config
from reconciler.console.acting import Acting
from reconciler.console.app import Console, Reply
from reconciler.console.auth import Access
from reconciler.console.pages import ConsoleState, Pages
from reconciler.console.port import ConsoleReads
from reconciler.core.operator_desk import OperatorDesk
from reconciler.core.passes import PassConfig, explain_by_kind
from reconciler.core.ports import JobKey, PassStore, SourceJobs
from reconciler.core.stuck import no_live_workers
from reconciler.views import verdict_view

__all__ = ["PAGE_STATEMENT_SECONDS", "Console", "Reply", "open_console"]

PAGE_STATEMENT_SECONDS = 5.0
"""A page's statements give up after this (PostgreSQL): the sidecar's few HTTP threads also
answer /metrics and /readyz, and a page stuck on a slow database must not hold them."""


def open_console(reads: ConsoleReads, explaining: PassStore, jobs: SourceJobs,
                 config: Config, passes: PassConfig, *, desk: OperatorDesk,
                 classify: Callable[[BaseException], str],
                 close: Callable[[], None]) -> Console:
    """The console over ``reads``, explaining running jobs through ``explaining`` (the
    configured source, read only) as ``passes`` would decide them, showing that source's
    jobs as ``jobs`` reads them, and acting on them through ``desk`` for the operators
    the settings name; ``classify`` names a database error by its bounded code; ``close``
    releases its engine."""

    def explain(job_id: JobKey) -> dict[str, Any] | None:
        found = explain_by_kind(explaining, [job_id], passes)
        if not found:
            return None
        return verdict_view(found[0], config.kinds.resolve(found[0].job_kind).max_run_seconds)

    def workers() -> tuple[int, bool]:
        work, running = explaining.backlog()
        return running, no_live_workers(work, running)

    settings = config.settings
    state = ConsoleState(source=str(config.source.kind), shadow=settings.shadow,
                         brake_hold_seconds=None if passes.brake is None
                         else passes.brake.hold_seconds)
    access = Access(settings.console_token, settings.operator_tokens)
    pages = Pages(reads, explain, state, jobs, desk, workers=workers)
    return Console(pages, access, classify, close=close, acting=Acting(desk, reads))
