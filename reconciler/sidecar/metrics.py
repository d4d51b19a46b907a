"""Prometheus metrics on the service's own registry. Label values come only from enums."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from reconciler.core.decisions import RULES
from reconciler.core.passes import PassReport
from reconciler.core.vocabulary import DatabaseErrorCode, Disposition, PassOutcome, Reason

PASS_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                         5.0, 10.0, 30.0)


class Metrics:
    """Every metric of DESIGN.md §7, plus the chores' own counters."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.passes = Counter("reconciler_passes", "Reconciliation passes by outcome",
                              ["outcome"], registry=r)
        self.pass_errors = Counter("reconciler_pass_errors",
                                   "Passes that failed, by what the database said (a code)",
                                   ["code"], registry=r)
        self.pass_duration = Histogram("reconciler_pass_duration_seconds",
                                       "Wall time of one pass", buckets=PASS_DURATION_BUCKETS,
                                       registry=r)
        self.decisions = Counter("reconciler_decisions", "Decisions by disposition and reason",
                                 ["disposition", "reason"], registry=r)
        self.stale_claims = Gauge("reconciler_stale_claims",
                                  "Processing jobs whose lease has expired", registry=r)
        self.oldest_stale_age = Gauge("reconciler_oldest_stale_claim_age_seconds",
                                      "Seconds since the oldest expired lease expired",
                                      registry=r)
        self.last_success = Gauge("reconciler_last_successful_pass_timestamp_seconds",
                                  "Unix time of the last pass that finished ok", registry=r)
        self.is_leader = Gauge("reconciler_is_leader",
                               "1 while this instance holds the leader lease", registry=r)
        self.artifact_sweep_failures = Counter(
            "reconciler_artifact_sweep_failures", "Stale artifacts the sweep could not remove",
            registry=r)
        self.artifacts_discarded = Counter(
            "reconciler_artifacts_discarded", "Stale staged artifacts deleted and discarded",
            registry=r)
        self.retention_deleted = Counter(
            "reconciler_audit_rows_deleted", "Old pass and decision rows removed by retention",
            registry=r)
        # Every bounded label value exists from the start, so rates and alerts see zeros.
        for outcome in PassOutcome:
            self.passes.labels(outcome=outcome.value)
        for code in DatabaseErrorCode:
            self.pass_errors.labels(code=code.value)
        for rule in RULES:
            self.decisions.labels(disposition=rule.disposition.value, reason=rule.reason.value)
        for reason in (Reason.FENCE_LOST, Reason.RECONCILE_ERROR):
            self.decisions.labels(disposition=Disposition.SKIP.value, reason=reason.value)

    def observe_pass(self, report: PassReport, seconds: float, now_unix: float) -> None:
        """Count one pass and its decisions."""
        self.passes.labels(outcome=report.outcome.value).inc()
        self.pass_duration.observe(seconds)
        self.is_leader.set(1 if report.outcome is not PassOutcome.NOT_LEADER else 0)
        if report.outcome is PassOutcome.OK:
            self.last_success.set(now_unix)
        for decision in report.decisions:
            self.decisions.labels(disposition=decision.disposition.value,
                                  reason=decision.reason.value).inc()

    def observe_failed_pass(self, seconds: float,
                            code: DatabaseErrorCode = DatabaseErrorCode.OTHER) -> None:
        """Count a pass that raised, and why (a bounded code, never the message)."""
        self.passes.labels(outcome=PassOutcome.ERROR.value).inc()
        self.pass_errors.labels(code=code.value).inc()
        self.pass_duration.observe(seconds)
