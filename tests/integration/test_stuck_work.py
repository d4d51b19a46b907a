"""Stuck work on the native source, as the stale-claim gauges count it, on SQLite and
PostgreSQL: expired jobs awaiting a decision, held ones, gated ones, and those the last
pass held back with the mass-staleness brake, each under its own reason."""

from __future__ import annotations

from typing import cast

import sqlalchemy as sa

from models import JobRun
from reconciler.core.brake import BrakeLimits
from reconciler.core.decisions import Thresholds
from reconciler.core.passes import PassConfig, PassReport, run_pass
from reconciler.core.ports import StuckCount
from reconciler.core.stuck import stuck_work
from reconciler.core.vocabulary import EffectKind, Reason, StuckReason
from reconciler.storage.clock import now_plus
from reconciler.storage.sql_store import SqlStore
from reconciler.worker import JobClient, Step

JOBS = cast(sa.Table, JobRun.__table__)
THRESHOLDS = Thresholds(stale_after_seconds=60, wedged_after_seconds=3600)
LIMITS = BrakeLimits(min_jobs=5, stale_fraction=0.5, hold_seconds=120)


def expired(client: JobClient, count: int, *, gate: bool = False) -> list[int]:
    """``count`` claimed jobs whose lease ran out 10 minutes ago (``gate``: waiting on one)."""
    ids = []
    for _ in range(count):
        job = client.enqueue("mail.digest", steps=[Step("work", EffectKind.IDEMPOTENT)])
        claim = client.claim("worker-1", 300, ["mail.digest"])
        assert claim is not None
        (claim.wait_step if gate else claim.start_step)(0)
        ids.append(job)
    with client.store.engine.begin() as conn:
        conn.execute(JOBS.update().where(JOBS.c.job_id.in_(ids)).values(
            last_activity_at=now_plus(-900), lease_expires_at=now_plus(-600)))
    return ids


def one_pass(store: SqlStore, brake: BrakeLimits | None) -> PassReport:
    return run_pass(store, PassConfig(batch_size=100, thresholds=THRESHOLDS,
                                      instance="stuck", brake=brake))


def test_each_reason_counts_the_jobs_it_holds_back(client: JobClient) -> None:
    store = SqlStore(client.store.engine)
    [held] = expired(client, 1)
    assert store.operator_action(held, "hold") == (True, None)
    expired(client, 2, gate=True)
    braked = expired(client, 6)
    # Before any pass: the hold and the gates the source sees; the rest await a decision.
    before = stuck_work(store.stuck_work(), {})
    assert before[StuckReason.OPERATOR_HOLD].count == 1
    assert before[StuckReason.AWAITING_DECISION].count == 8
    report = one_pass(store, LIMITS)
    assert report.braked
    assert {d.reason for d in report.decisions} == {
        Reason.OPERATOR_HOLD, Reason.WAITING_ON_GATE, Reason.MASS_STALENESS_BRAKE}
    after = stuck_work(store.stuck_work(), report.held)
    counts = {reason: count.count for reason, count in after.items() if count.count}
    assert counts == {StuckReason.OPERATOR_HOLD: 1, StuckReason.WAITING_ON_GATE: 2,
                      StuckReason.MASS_STALENESS_BRAKE: len(braked)}
    oldest = after[StuckReason.MASS_STALENESS_BRAKE].oldest_seconds
    assert oldest is not None
    assert oldest >= 600


def test_nothing_stuck_once_the_pass_acted(client: JobClient) -> None:
    store = SqlStore(client.store.engine)
    expired(client, 3)
    report = one_pass(store, None)
    assert len(report.decisions) == 3
    assert not report.held
    assert stuck_work(store.stuck_work(), report.held)[StuckReason.AWAITING_DECISION] == \
        StuckCount(0)
