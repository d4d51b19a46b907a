"""The sidecar's chores besides the pass: what each runs, how often, on which replica.

A ``Chore`` is declared once (name, period, leader-only, what it runs); the service
schedules the list as it is. The bodies here each log and count what they did and never
raise: a chore that fails is tried again at its next period.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from reconciler.config.settings import Settings
from reconciler.core.job_retention import JobRetention
from reconciler.core.ports import PassStore, StuckWork
from reconciler.core.stuck import no_live_workers, stuck_work
from reconciler.core.worker_ports import ArtifactRecords
from reconciler.sidecar.artifact_sweep import sweep_artifacts
from reconciler.sidecar.metrics import Metrics

# The service's logger: the chores' lines were always the service's, and log filters rely on it.
log = logging.getLogger("reconciler.sidecar.service")

RETENTION_INTERVAL_SECONDS = 600.0
RETENTION_BATCH_ROWS = 5000
# Job retention: jobs per transaction, and transactions per run (10,000 jobs a run).
JOB_RETENTION_BATCH_JOBS = 500
JOB_RETENTION_MAX_BATCHES = 20
BACKLOG_MAX_PERIOD_SECONDS = 15.0


@dataclass(frozen=True, slots=True)
class Chore:
    """One scheduled job of the service."""

    name: str
    period_seconds: float
    leader_only: bool
    """Run only on the replica that holds the leader lease (once-only work)."""
    run: Callable[[], object]
    first_after_seconds: float | None = None
    """When the first run is due; None: at once (with a little jitter)."""


class Housekeeping:
    """The chores that keep the database and the gauges tidy (see ``chores``)."""

    def __init__(self, settings: Settings, passes: PassStore, artifacts: ArtifactRecords,
                 job_retention: JobRetention, metrics: Metrics) -> None:
        self.held: StuckWork = {}
        """The expired jobs the last tick read and held back, by reason (set by the
        service after each tick): what the source's own counts cannot tell."""
        self.settings = settings
        self.passes = passes
        self.artifacts = artifacts
        self.job_retention = job_retention
        self.metrics = metrics

    def chores(self) -> list[Chore]:
        """These chores, declared: every replica refreshes its gauges; the leader alone
        deletes and sweeps."""
        interval = self.settings.interval_seconds
        return [
            Chore("backlog", min(interval, BACKLOG_MAX_PERIOD_SECONDS), False,
                  self.refresh_backlog),
            Chore("artifacts", interval, True, self.sweep_artifacts),
            Chore("retention", RETENTION_INTERVAL_SECONDS, True, self.apply_retention),
            Chore("job_retention", RETENTION_INTERVAL_SECONDS, True,
                  self.apply_job_retention),
        ]

    def refresh_backlog(self) -> None:
        """The stale-claim gauges: the source's stuck work, with what the last tick held
        back."""
        try:
            source, running = self.passes.backlog()
        except Exception as exc:
            log.warning("event=backlog_refresh_failed error=%s", type(exc).__name__)
            return
        self.metrics.observe_stuck(stuck_work(source, self.held))
        self.metrics.observe_workers(no_live_workers(source, running))

    def apply_retention(self) -> None:
        """Delete audit rows older than ``audit_retention_days``, a bounded chunk per run."""
        try:
            deleted = self.passes.delete_audit_before(self.settings.audit_retention_days,
                                                     RETENTION_BATCH_ROWS)
        except Exception as exc:
            log.warning("event=retention_failed error=%s", type(exc).__name__)
            return
        self.metrics.retention_deleted.inc(deleted)
        if deleted:
            log.info("event=retention_deleted rows=%d", deleted)

    def apply_job_retention(self) -> None:
        """Delete finished jobs older than ``job_retention_days`` with their rows, in
        bounded batches."""
        try:
            report = self.job_retention.delete_finished_jobs(
                self.settings.job_retention_days, JOB_RETENTION_BATCH_JOBS,
                JOB_RETENTION_MAX_BATCHES)
        except Exception as exc:
            log.warning("event=job_retention_failed error=%s", type(exc).__name__)
            return
        self.metrics.job_rows_deleted.inc(report.rows_deleted)
        if report.rows_deleted:
            log.info("event=job_retention_deleted jobs=%d rows=%d batches=%d",
                     report.jobs_deleted, report.rows_deleted, report.batches)

    def sweep_artifacts(self) -> None:
        """Discard stale staged artifacts; failures are counted and retried next run."""
        try:
            result = sweep_artifacts(self.artifacts, Path(self.settings.artifact_root))
        except Exception as exc:
            self.metrics.artifact_sweep_failures.inc()
            log.warning("event=artifact_sweep_failed error=%s", type(exc).__name__)
            return
        self.metrics.artifacts_discarded.inc(result.discarded)
        self.metrics.artifact_sweep_failures.inc(result.failures)
