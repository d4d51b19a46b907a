"""What the console reads, as a narrow port: bounded, read-only queries on the audit and
this project's job rows. Storage implements it (``reconciler.storage.console_views``); the
pages hold it by this port, so no page holds SQL."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from typing import Any, Protocol

from reconciler.core.job_story import JobDetail
from reconciler.core.vocabulary import JobKey

Explain = Callable[[JobKey], dict[str, Any] | None]
"""What a pass of the configured source would decide for one running job now (read only),
as ``reconciler.views.verdict_view`` tells it; None when the job is not running."""


Workers = Callable[[], tuple[int, bool]]
"""The configured source's running jobs now, and whether none of them has a live worker
(``reconciler.core.stuck.no_live_workers``)."""


class ConsoleReads(Protocol):
    """The console's queries; each an indexed range and a LIMIT, in a short read-only
    transaction of its own."""

    def reading(self) -> AbstractContextManager[None]:
        """Every read inside on one connection and read-only transaction (one page)."""

    def now(self) -> tuple[datetime, datetime | None]:
        """The database's now, and when the mass-staleness brake engaged (None: not)."""

    def recent_passes(self, limit: int) -> list[dict[str, Any]]:
        """The latest passes, newest first."""

    def reason_counts(self, since: datetime, cap: int) -> tuple[dict[str, int], int]:
        """Decisions per reason since ``since`` and how many of them are shadow ones,
        each counted up to ``cap``."""

    def decisions(self, *, disposition: str | None, reason: str | None, kind: str | None,
                  source: str | None, since: datetime | None, shadow: bool,
                  before_id: int | None, limit: int) -> list[dict[str, Any]]:
        """Matching decision records, newest first, ids below ``before_id``."""

    def job_decisions(self, source: str, job_id: str, limit: int) -> list[dict[str, Any]]:
        """One job's decisions, newest first."""

    def job_actions(self, source: str, job_id: str, limit: int) -> list[dict[str, Any]]:
        """The operator actions recorded on one job, newest first."""

    def timeline(self, job_id: int, limit: int) -> list[dict[str, Any]]:
        """One of this project's jobs' timeline, oldest first."""

    def held_and_parked(self, limit: int) -> tuple[list[JobDetail], list[JobDetail]]:
        """This project's held jobs and parked jobs, newest first."""

    def foreign_holds(self, limit: int) -> list[dict[str, Any]]:
        """The holds on other systems' jobs, newest first (source, key, by whom, since)."""

    def latest_by_reason(self, reasons: Sequence[str], limit: int) -> list[dict[str, Any]]:
        """The latest real decisions of these reasons, newest first."""

    def get_job(self, job_id: int) -> JobDetail | None:
        """One of this project's jobs with its step states, or None."""
