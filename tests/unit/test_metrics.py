"""The service's metrics as /metrics shows them: shadow decisions apart, the brake, ticks."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from reconciler.core.decisions import RULES
from reconciler.core.passes import PassReport
from reconciler.core.ports import RecordedDecision
from reconciler.core.vocabulary import (
    ActionOutcome,
    Disposition,
    OperatorAction,
    PassOutcome,
    Reason,
    StuckReason,
)
from reconciler.sidecar.metrics import Metrics

RESUMED = RecordedDecision(1, Disposition.RESUME, Reason.RESUMED_FROM_UNSTARTED_STEP, 0, 3, 4)
CRASH_LOOP = RecordedDecision(2, Disposition.TERMINALIZE, Reason.CRASH_LOOP, None, 5, 6)
BRAKED = RecordedDecision(3, Disposition.SKIP, Reason.MASS_STALENESS_BRAKE, None, 7, 7)


def samples(metrics: Metrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample /metrics would serve, keyed by name and labels."""
    text = generate_latest(metrics.registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    """One sample's value, or None when it is not exported."""
    return samples(metrics).get((name, frozenset(labels.items())))


def report(*decisions: RecordedDecision) -> PassReport:
    """A successful pass with these decisions."""
    return PassReport(pass_id=1, outcome=PassOutcome.OK, decisions=decisions)


class TestShadowDecisions:
    """A shadow pass's decisions count in their own counter, never in the live one."""

    def test_shadow_pass_counts_apart(self) -> None:
        """reconciler_shadow_decisions_total moves; reconciler_decisions_total does not."""
        metrics = Metrics()
        metrics.observe_pass(report(RESUMED, CRASH_LOOP), 0.01, 1000.0, shadow=True)
        labels = {"disposition": "terminalize", "reason": "crash_loop"}
        assert value(metrics, "reconciler_shadow_decisions_total", **labels) == 1.0
        assert value(metrics, "reconciler_decisions_total", **labels) == 0.0
        assert value(metrics, "reconciler_passes_total", outcome="ok") == 1.0

    def test_live_pass_leaves_the_shadow_counter_alone(self) -> None:
        """A pass that acts counts only in reconciler_decisions_total."""
        metrics = Metrics()
        metrics.observe_pass(report(RESUMED, BRAKED), 0.01, 1000.0)
        resumed = {"disposition": "resume", "reason": "resumed_from_unstarted_step"}
        braked = {"disposition": "skip", "reason": "mass_staleness_brake"}
        assert value(metrics, "reconciler_decisions_total", **resumed) == 1.0
        assert value(metrics, "reconciler_decisions_total", **braked) == 1.0
        assert value(metrics, "reconciler_shadow_decisions_total", **resumed) == 0.0

    def test_every_label_pair_exists_from_the_start(self) -> None:
        """Every rule and pass outcome is exported at 0 in both counters before any pass
        (a shadow pass applies nothing, so it has no fence_lost)."""
        exported = samples(Metrics())
        rules = {(r.disposition.value, r.reason.value) for r in RULES}
        outcomes = {("skip", r) for r in ("fence_lost", "reconcile_error", "mass_staleness_brake")}

        def pairs(name: str) -> set[tuple[str, str]]:
            return {(dict(labels)["disposition"], dict(labels)["reason"])
                    for (n, labels), v in exported.items() if n == name and v == 0.0}

        assert pairs("reconciler_decisions_total") == rules | outcomes
        assert pairs("reconciler_shadow_decisions_total") == (
            rules | outcomes) - {("skip", "fence_lost")}

    def test_label_values_are_enum_values(self) -> None:
        """Every disposition and reason label is a member of its enum: no job id, no text
        (the stale-claim gauges' reasons are what held stuck work back)."""
        reasons, dispositions = {r.value for r in Reason}, {d.value for d in Disposition}
        stuck = {r.value for r in StuckReason}
        labelled = [(name, dict(labels)) for (name, labels) in samples(Metrics())
                    if dict(labels)]
        assert labelled
        for name, found in labelled:
            allowed = stuck if "stale_claim" in name else reasons
            assert found.get("reason", "operator_hold") in allowed, (name, found)
            assert found.get("disposition", "skip") in dispositions, found


class TestBrakeAndTicks:
    """The brake gauge, the tick histogram and the retention counter."""

    def test_brake_gauge_follows_the_last_pass(self) -> None:
        """reconciler_brake_engaged is 0, 1 while braked, and 0 again once released."""
        metrics = Metrics()
        readings = [value(metrics, "reconciler_brake_engaged")]
        for engaged in (True, False):
            metrics.observe_brake(engaged)
            readings.append(value(metrics, "reconciler_brake_engaged"))
        assert readings == [0.0, 1.0, 0.0]

    def test_ticks_count_their_batches(self) -> None:
        """A tick of one pass and a tick of three full batches: two ticks, four passes."""
        metrics = Metrics()
        metrics.observe_tick(1)
        metrics.observe_tick(3)
        assert value(metrics, "reconciler_tick_batches_count") == 2.0
        assert value(metrics, "reconciler_tick_batches_sum") == 4.0
        assert value(metrics, "reconciler_tick_batches_bucket", le="1.0") == 1.0
        assert value(metrics, "reconciler_tick_batches_bucket", le="3.0") == 2.0

    def test_job_retention_counts_apart_from_the_audit(self) -> None:
        """Deleted finished jobs and deleted audit rows are two counters."""
        metrics = Metrics()
        metrics.job_rows_deleted.inc(7)
        assert value(metrics, "reconciler_job_rows_deleted_total") == 7.0
        assert value(metrics, "reconciler_audit_rows_deleted_total") == 0.0


class TestOperatorActions:
    """reconciler_operator_actions_total: every label pair from the start, counted by the
    desk's counter."""

    def test_actions_are_counted_by_action_source_and_outcome(self) -> None:
        """Zero before; one applied retry on the table moves only its own series."""
        metrics = Metrics()
        name = "reconciler_operator_actions_total"
        assert value(metrics, name, action="cancel", source="pg-boss", outcome="refused") == 0
        metrics.observe_action(OperatorAction.RETRY, "table", ActionOutcome.APPLIED)
        assert value(metrics, name, action="retry", source="table", outcome="applied") == 1
        assert value(metrics, name, action="retry", source="table", outcome="refused") == 0
