"""A job's timeline in ``jobs show`` (text and ``--json``) on SQLite and PostgreSQL: two
crashes, a resume, a terminalization and an operator's retry, in the order they happened,
with what each pass saw of the worker; no worker identity anywhere."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import Engine

from reconciler.core.decisions import Thresholds
from reconciler.core.passes import PassConfig, run_pass
from reconciler.storage.sql_store import SqlStore
from reconciler.worker import JobClient, Step
from tests.helpers import wait_for
from tests.integration.test_cli import cli_json, run_cli

pytestmark = pytest.mark.integration

LEASE_SECONDS = 0.3
"""Long enough that a dead worker's steps come before its lease runs out, as in life."""


def crashed_retried_job(engine: Engine, client: JobClient) -> int:
    """Attempt 1 finishes ``fetch`` and dies before ``charge``: resumed at step 1. Attempt
    2 dies inside the effectful ``charge``: ended ``worker_died_mid_step``. An operator
    retries it with a note."""
    job_id = client.enqueue("billing.charge", steps=[Step("fetch", "idempotent"),
                                                     Step("charge", "effectful")])
    store = SqlStore(engine)
    config = PassConfig(batch_size=10, thresholds=Thresholds(0.0, 3600.0),
                        instance="timeline-test")
    first = client.claim(worker="worker-marker-7", lease_seconds=LEASE_SECONDS)
    assert first is not None
    first.start_step(0)
    first.finish_step(0)
    assert decided(store, config) == ["resumed_from_unstarted_step"]
    second = client.claim(worker="worker-marker-7", lease_seconds=LEASE_SECONDS)
    assert second is not None
    second.start_step(1)
    assert decided(store, config) == ["worker_died_mid_step"]
    assert store.operator_action(job_id, "retry", actor="alice", note="not charged: checked")
    return job_id


def decided(store: SqlStore, config: PassConfig) -> list[str]:
    """The reasons of the first pass that decides anything, once the lease runs out."""
    return [d.reason.value for d in wait_for(
        lambda: run_pass(store, config).decisions, "the dead worker's lease to run out")]


def test_jobs_show_tells_the_jobs_whole_story_in_time_order(
        db_url: str, engine: Engine, client: JobClient) -> None:
    job_id = crashed_retried_job(engine, client)
    shown = cli_json(db_url, "jobs", "show", str(job_id))
    kinds = [(e["type"], e.get("attempt") or e.get("reason") or e.get("action"))
             for e in shown["timeline"]]
    assert kinds == [
        ("claimed", 1), ("step_started", 1), ("step_finished", 1), ("lease_expired", None),
        ("decision", "resumed_from_unstarted_step"), ("attempt_ended", 1),
        ("claimed", 2), ("step_started", 2), ("lease_expired", None),
        ("decision", "worker_died_mid_step"), ("attempt_ended", 2), ("action", "retry")]
    # In time order; an attempt a pass ended shows right after the decision that ended it.
    times = [e["at"] for e in shown["timeline"] if e["type"] != "attempt_ended"]
    assert times == sorted(times)
    assert all(t.endswith("+00:00") for t in times)
    decisions = [e for e in shown["timeline"] if e["type"] == "decision"]
    assert [(d["rule"], d["resume_step_index"]) for d in decisions] == [(14, 1), (10, None)]
    assert decisions[1]["evidence"]["step_states"] == ["succeeded", "started"]
    [retry] = [e for e in shown["timeline"] if e["type"] == "action"]
    assert (retry["actor"], retry["note"], retry["outcome"]) == (
        "alice", "not charged: checked", "applied")
    ended = [e for e in shown["timeline"] if e["type"] == "attempt_ended"]
    assert [(e["outcome"], e["ended_by"]) for e in ended] == [
        ("lost", "reconciler"), ("lost", "reconciler")]

    text = run_cli(db_url, "jobs", "show", str(job_id))
    assert text.returncode == 0, text.stderr
    assert "worker-marker-7" not in text.stdout + str(shown)
    lines = text.stdout.splitlines()
    assert any(" attempt 1 claimed" in line for line in lines)
    assert any("decided: resume at step 1 (resumed_from_unstarted_step), rule 14" in line
               for line in lines)
    assert any("retry by alice: applied" in line and "note: not charged: checked" in line
               for line in lines)
