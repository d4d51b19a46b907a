"""The operator console's parts: the console on an engine of its own, and the operator
desk it acts through."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime

from reconciler.config.loader import Config
from reconciler.config.registry import SourceEntry
from reconciler.console import PAGE_STATEMENT_SECONDS, Console, open_console
from reconciler.core.operator_desk import ActionReport
from reconciler.core.passes import PassConfig
from reconciler.core.policy import OperatorChange, Refusal, operator_change
from reconciler.core.ports import SourceJobs
from reconciler.core.vocabulary import JobStatus, OperatorAction
from reconciler.root.checks import source_factory
from reconciler.sources.jobs import open_jobs
from reconciler.storage.console_views import ConsoleViewsSql
from reconciler.storage.diagnosis import error_code
from reconciler.storage.engines import DatabaseTimeouts, create_engine
from reconciler.storage.sql_store import SqlStore

__all__ = ["assemble_console"]

# A bulk preview reads at most this many pages of matching decisions to find its jobs.
BULK_SCAN_PAGES = 20
BULK_SCAN_PAGE = 200
# How far back in a job's audit its latest real decision is looked for (past shadow ones).
LATEST_DECISIONS = 20


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
    reads = ConsoleViewsSql(engine)
    desk = JobsDesk(config.source_entry, jobs, reads)
    return open_console(reads, explaining, jobs, config, passes, desk=desk,
                        classify=lambda exc: error_code(exc).value, close=engine.dispose)


class JobsDesk:
    """The operator desk over the configured source's ``operator_action`` (what ``reconciler
    jobs hold`` uses): the actions its registry entry takes, fenced and recorded by the
    source's store. The record of today keeps neither the actor nor the note; the desk of
    every source, with that richer record, takes this one's place here."""

    def __init__(self, entry: SourceEntry, jobs: SourceJobs, reads: ConsoleViewsSql) -> None:
        self.entry = entry
        self.source = entry.kind
        self.jobs = jobs
        self.reads = reads

    def allowed(self, job_id: str) -> frozenset[OperatorAction]:
        """The actions the source takes whose change the job's state allows now."""
        try:
            job = self.jobs.get_job(self.entry.parse_job_key(job_id))
        except ValueError:
            return frozenset()
        if job is None:
            return frozenset()
        status = JobStatus(job.job_status)
        return frozenset(
            action for action in self.entry.capabilities.actions
            if isinstance(operator_change(action, status, job.operator_hold), OperatorChange))

    def act(self, action: OperatorAction, job_id: str, *, actor: str,
            note: str | None) -> ActionReport:
        """One action through the source's store, which fences and records it."""
        del actor, note  # the record of today has no place for them (see the class)
        if action not in self.entry.capabilities.actions:
            return self._report(action, job_id, "not_supported")
        try:
            key = self.entry.parse_job_key(job_id)
        except ValueError:
            return self._report(action, job_id, Refusal.NO_SUCH_JOB.value)
        applied, refusal = self.jobs.operator_action(key, action)
        return self._report(action, job_id, None if applied else refusal or "refused")

    def bulk_targets(self, action: OperatorAction, *, reason: str | None, kind: str | None,
                     since: datetime | None, limit: int) -> list[str]:
        """The jobs whose latest real decision matches, newest first, that ``action``
        applies to now (a job already retried is queued: not listed again)."""
        found: list[str] = []
        seen: set[str] = set()
        before: int | None = None
        for _ in range(BULK_SCAN_PAGES):
            rows = self.reads.decisions(disposition=None, reason=reason, kind=kind,
                                        source=self.source, since=since, shadow=False,
                                        before_id=before, limit=BULK_SCAN_PAGE)
            for row in rows:
                job_id = str(row["job_id"])
                if job_id in seen:
                    continue
                seen.add(job_id)
                if self._latest(job_id) == row["decision_id"] and action in self.allowed(job_id):
                    found.append(job_id)
                    if len(found) == limit:
                        return found
            if len(rows) < BULK_SCAN_PAGE:
                break
            before = int(rows[-1]["decision_id"])
        return found

    def _latest(self, job_id: str) -> int | None:
        """The id of the job's latest real decision."""
        for row in self.reads.job_decisions(self.source, job_id, LATEST_DECISIONS):
            if not row["shadow_mode"]:
                return int(row["decision_id"])
        return None

    def _report(self, action: OperatorAction, job_id: str, refusal: str | None
                ) -> ActionReport:
        line = f"job {job_id}: {action} " + ("applied" if refusal is None
                                             else f"refused ({refusal})")
        return ActionReport(action, job_id, refusal is None, refusal, line)
