"""Prometheus metrics on the service's own registry. Label values come only from enums."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from reconciler.config.registry import SOURCES
from reconciler.core.decisions import RULES
from reconciler.core.passes import PassReport
from reconciler.core.ports import LivenessUnknown, StuckCount, StuckWork
from reconciler.core.vocabulary import (
    ActionOutcome,
    DatabaseErrorCode,
    Disposition,
    LivenessDoubt,
    OperatorAction,
    PassOutcome,
    Reason,
    StuckReason,
)

PASS_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                         5.0, 10.0, 30.0)
# Passes one scheduled tick ran: 1 unless a full batch was followed at once by another
# (a backlog drains within one interval). With batch_size 500, 20 covers an outage of 10,000 jobs.
TICK_BATCHES_BUCKETS = (1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0, 100.0)

# Reasons a pass records that no rule gives; with the rules' own, every label pair a
# decision counter can carry.
PASS_OUTCOME_REASONS = (Reason.FENCE_LOST, Reason.RECONCILE_ERROR, Reason.MASS_STALENESS_BRAKE)


def decision_labels(*, shadow: bool = False) -> tuple[tuple[Disposition, Reason], ...]:
    """Every (disposition, reason) a pass can record; a shadow pass applies nothing, so it
    never loses a compare-and-swap (no ``fence_lost``)."""
    pairs = [(rule.disposition, rule.reason) for rule in RULES]
    pairs += [(Disposition.SKIP, reason) for reason in PASS_OUTCOME_REASONS
              if not (shadow and reason is Reason.FENCE_LOST)]
    return tuple(pairs)


class Metrics:
    """The service's metrics, each documented in docs/metrics.md."""

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
        self.stale_claims = Gauge(
            "reconciler_stale_claims",
            "Running jobs past their threshold that no pass acted on, by what held them back",
            ["reason"], registry=r)
        self.oldest_stale_age = Gauge(
            "reconciler_oldest_stale_claim_age_seconds",
            "Seconds the oldest of them is past its threshold (0 where the source cannot "
            "tell)", ["reason"], registry=r)
        self.no_live_workers = Gauge(
            "reconciler_no_live_workers",
            "1 while the source has running jobs and none of them has a live owner (every "
            "one past its threshold); 0 otherwise, and while liveness is unknown",
            registry=r)
        self.liveness_unknown = Gauge(
            "reconciler_liveness_unknown",
            "1 while the source's liveness evidence cannot be read or is doubted, by why; "
            "nothing that depends on it is decided meanwhile", ["code"], registry=r)
        self.last_success = Gauge("reconciler_last_successful_pass_timestamp_seconds",
                                  "Unix time of the last pass that finished ok", registry=r)
        self.is_leader = Gauge("reconciler_is_leader",
                               "1 while this instance holds the chores' leader lease",
                               registry=r)
        self.artifact_sweep_failures = Counter(
            "reconciler_artifact_sweep_failures", "Stale artifacts the sweep could not remove",
            registry=r)
        self.artifacts_discarded = Counter(
            "reconciler_artifacts_discarded", "Stale staged artifacts deleted and discarded",
            registry=r)
        self.retention_deleted = Counter(
            "reconciler_audit_rows_deleted", "Old pass and decision rows removed by retention",
            registry=r)
        self.job_rows_deleted = Counter(
            "reconciler_job_rows_deleted",
            "Finished jobs (with their steps, attempts and artifact records) removed by "
            "retention", registry=r)
        self.shadow_decisions = Counter(
            "reconciler_shadow_decisions",
            "Decisions of shadow passes (recorded, nothing changed) by disposition and reason",
            ["disposition", "reason"], registry=r)
        self.brake_engaged = Gauge(
            "reconciler_brake_engaged",
            "1 while the mass-staleness brake holds this instance's passes", registry=r)
        self.tick_batches = Histogram(
            "reconciler_tick_batches",
            "Passes (batches) one scheduled tick ran; more than 1 when full batches followed",
            buckets=TICK_BATCHES_BUCKETS, registry=r)
        self.operator_actions = Counter(
            "reconciler_operator_actions",
            "Operator actions (hold, unhold, retry, cancel) by source and outcome",
            ["action", "source", "outcome"], registry=r)
        # Every bounded label value exists from the start, so rates and alerts see zeros.
        for outcome in PassOutcome:
            self.passes.labels(outcome=outcome.value)
        for disposition, reason in decision_labels():
            self.decisions.labels(disposition=disposition.value, reason=reason.value)
        for disposition, reason in decision_labels(shadow=True):
            self.shadow_decisions.labels(disposition=disposition.value, reason=reason.value)
        for code in DatabaseErrorCode:
            self.pass_errors.labels(code=code.value)
        for action in OperatorAction:
            for source in SOURCES:
                for result in ActionOutcome:
                    self.operator_actions.labels(action=action.value, source=source,
                                                 outcome=result.value)
        self.observe_stuck({})
        self.observe_liveness(None)

    def observe_pass(self, report: PassReport, seconds: float, now_unix: float, *,
                     shadow: bool = False) -> None:
        """Count one pass and its decisions; a shadow pass's decisions count apart, so
        nothing it only pretended to do moves ``reconciler_decisions_total`` or its alerts."""
        self.passes.labels(outcome=report.outcome.value).inc()
        self.pass_duration.observe(seconds)
        # A pass whose source's liveness was doubted still ran to its end: its own alert
        # (on ``reconciler_liveness_unknown``) says what it could not decide.
        if report.outcome in (PassOutcome.OK, PassOutcome.LIVENESS_UNKNOWN):
            self.last_success.set(now_unix)
        counter = self.shadow_decisions if shadow else self.decisions
        # As the audit counts them: a skip it already held (a held job, every pass) once.
        for decision in (d for d in report.decisions if not d.repeated):
            counter.labels(disposition=decision.disposition.value,
                           reason=decision.reason.value).inc()

    def observe_stuck(self, work: StuckWork) -> None:
        """Set the stale-claim gauges, every reason (one not in ``work`` counts none)."""
        for reason in StuckReason:
            count = work.get(reason, StuckCount(0))
            self.stale_claims.labels(reason=reason.value).set(count.count)
            self.oldest_stale_age.labels(reason=reason.value).set(
                count.oldest_seconds or 0.0 if count.count else 0.0)

    def observe_workers(self, none_alive: bool) -> None:
        """Whether the source's running jobs have no live owner at all."""
        self.no_live_workers.set(int(none_alive))

    def observe_liveness(self, unknown: LivenessUnknown | None) -> None:
        """1 on the code of the current doubt about the source's liveness, 0 elsewhere."""
        for code in LivenessDoubt:
            self.liveness_unknown.labels(code=code.value).set(
                int(unknown is not None and unknown.code is code))

    def observe_action(self, action: OperatorAction, source: str,
                       outcome: ActionOutcome) -> None:
        """Count one operator action (the desk's ``ActionCounter``); ``source`` is a
        registry kind, so every label is bounded (a note never is a label)."""
        self.operator_actions.labels(action=action.value, source=source,
                                     outcome=outcome.value).inc()

    def observe_tick(self, batches: int) -> None:
        """Count one scheduled tick and the passes (batches) it ran."""
        self.tick_batches.observe(batches)

    def observe_brake(self, engaged: bool) -> None:
        """Show whether the mass-staleness brake held the last pass."""
        self.brake_engaged.set(1 if engaged else 0)

    def observe_failed_pass(self, seconds: float,
                            code: DatabaseErrorCode = DatabaseErrorCode.OTHER) -> None:
        """Count a pass that raised, and why (a bounded code, never the message)."""
        self.passes.labels(outcome=PassOutcome.ERROR.value).inc()
        self.pass_errors.labels(code=code.value).inc()
        self.pass_duration.observe(seconds)
