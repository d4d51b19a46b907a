"""A job's timeline (``reconciler.core.timeline``), pure: records in, entries out, in the
order things happened, with what each pass saw of the worker, and never a worker's name."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from reconciler.core.timeline import ORDER, RULE_OF, timeline

pytestmark = pytest.mark.fast

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def decision(seconds: float, reason: str, **evidence: object) -> dict[str, object]:
    return {"decided_at": at(seconds), "pass_id": 7, "disposition": "terminalize",
            "decision_reason": reason, "resume_step_index": None,
            "decision_evidence": evidence, "shadow_mode": False}


def test_every_record_in_time_order_with_what_the_pass_saw() -> None:
    entries = timeline(
        attempts=[{"attempt_number": 1, "claimed_at": at(0), "ended_at": at(30),
                   "attempt_outcome": "lost", "ended_by": "reconciler",
                   "lease_owner": "worker-secret"}],
        steps=[{"step_index": 0, "step_name": "fetch", "effect_kind": "idempotent",
                "step_state": "succeeded", "attempt_number": 1, "started_at": at(1),
                "finished_at": at(2)},
               {"step_index": 1, "step_name": "charge", "effect_kind": "effectful",
                "step_state": "started", "attempt_number": 1, "started_at": at(3),
                "finished_at": None}],
        decisions=[decision(30, "worker_died_mid_step", lease_expired_seconds=20.0)],
        actions=[{"acted_at": at(40), "action": "retry", "outcome": "applied",
                  "refusal": None, "actor": "alice", "note": "checked",
                  "state_before": "failed", "state_after": "queued"}])
    assert [(e["type"], e["at"]) for e in entries] == [
        ("claimed", at(0)), ("step_started", at(1)), ("step_finished", at(2)),
        ("step_started", at(3)), ("lease_expired", at(10)), ("decision", at(30)),
        ("attempt_ended", at(30)), ("action", at(40))]
    assert entries[5]["rule"] == RULE_OF["worker_died_mid_step"]
    assert "worker-secret" not in repr(entries)


def test_an_attempt_a_pass_ended_follows_the_decision_that_ended_it() -> None:
    """SQLite stamps the attempt's end a little before the decision of the same
    transaction: it is shown after it all the same."""
    entries = timeline(
        attempts=[{"attempt_number": 1, "claimed_at": at(0), "ended_at": at(29.998),
                   "attempt_outcome": "lost", "ended_by": "reconciler"},
                  {"attempt_number": 2, "claimed_at": at(31), "ended_at": at(40),
                   "attempt_outcome": "completed", "ended_by": "worker"}],
        decisions=[decision(30, "resumed_idempotent_step")])
    assert [e["type"] for e in entries] == [
        "claimed", "decision", "attempt_ended", "claimed", "attempt_ended"]


def test_a_gone_worker_is_seen_when_the_pass_decided_and_a_shadow_decision_saw_nothing() -> None:
    gone = timeline(decisions=[decision(30, "worker_died_mid_step", session_gone=True,
                                        lease_expired_seconds=5.0)])
    assert [(e["type"], e["at"]) for e in gone] == [("owner_gone", at(30)),
                                                     ("decision", at(30))]
    shadow = timeline(decisions=[{**decision(30, "worker_died_mid_step",
                                             lease_expired_seconds=5.0), "shadow_mode": True}])
    assert [(e["type"], e["shadow"]) for e in shadow] == [("decision", True)]
    outcome = timeline(decisions=[decision(30, "reconcile_error", lease_expired_seconds=True)])
    assert [(e["type"], e["rule"]) for e in outcome] == [("decision", None)]


def test_every_type_has_its_place_at_one_instant() -> None:
    assert ORDER == ("claimed", "step_started", "step_finished", "lease_expired",
                     "owner_gone", "decision", "attempt_ended", "action")
