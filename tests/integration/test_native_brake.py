"""The mass-staleness brake on the native source weighs only jobs a pass could act on.

Kinds a config leaves unreconciled (``reconcile = false``) are never touched by a pass, so
they count neither as stale nor as running, as on the foreign sources (``core.brake``).
"""

from __future__ import annotations

from typing import cast

import sqlalchemy as sa

from models import JobRun
from reconciler.core.brake import BrakeLimits
from reconciler.core.decisions import Thresholds
from reconciler.core.kinds import KindRule, KindRules
from reconciler.core.passes import PassConfig, PassReport, run_pass
from reconciler.core.vocabulary import Disposition, EffectKind, Reason
from reconciler.storage.clock import now_plus
from reconciler.storage.native_kinds import kinded_native
from reconciler.storage.sql_store import SqlStore
from reconciler.worker import JobClient, Step

JOBS = cast(sa.Table, JobRun.__table__)
THRESHOLDS = Thresholds(stale_after_seconds=60, wedged_after_seconds=3600)
KINDS = KindRules([KindRule("legacy.*", reconcile=False)], stale_after_seconds=60,
                  wedged_after_seconds=3600, max_attempts=3)
LIMITS = BrakeLimits(min_jobs=5, stale_fraction=0.5, hold_seconds=120)


def running(client: JobClient, kind: str, count: int, *, stale: bool) -> list[int]:
    """``count`` claimed jobs of ``kind`` in their first (idempotent) step; ``stale``: idle
    for 15 minutes, their lease run out 10 minutes ago (else a live lease, active now)."""
    ids = []
    for _ in range(count):
        job = client.enqueue(kind, steps=[Step("work", EffectKind.IDEMPOTENT)])
        claim = client.claim("worker-1", 300, [kind])
        assert claim is not None
        claim.start_step(0)
        ids.append(job)
    if stale:
        with client.store.engine.begin() as conn:
            conn.execute(JOBS.update().where(JOBS.c.job_id.in_(ids)).values(
                last_activity_at=now_plus(-900), lease_expires_at=now_plus(-600)))
    return ids


def one_pass(client: JobClient) -> PassReport:
    store = SqlStore(client.store.engine, kinded_native(KINDS))
    return run_pass(store, PassConfig(batch_size=100, thresholds=THRESHOLDS,
                                      instance="brake-kinds", kinds=KINDS, brake=LIMITS))


def test_dead_jobs_of_an_unreconciled_kind_do_not_brake_a_real_death(
        client: JobClient) -> None:
    """Ten dead ``legacy`` jobs (never reconciled) and one dead job among four live ones of
    a reconciled kind: one stale job of five is no outage, so it is resumed, not braked."""
    running(client, "legacy.export", 10, stale=True)
    running(client, "mail.digest", 4, stale=False)
    [dead] = running(client, "mail.digest", 1, stale=True)

    report = one_pass(client)

    assert not report.braked
    assert [(d.job_id, d.disposition) for d in report.decisions] == [
        (dead, Disposition.RESUME)]


def test_live_jobs_of_an_unreconciled_kind_do_not_hide_an_outage(client: JobClient) -> None:
    """Every reconciled job went stale at once: an outage, braked, however many live
    ``legacy`` jobs run beside them."""
    running(client, "legacy.export", 30, stale=False)
    stale = running(client, "mail.digest", 6, stale=True)

    report = one_pass(client)

    assert report.braked
    assert sorted((d.job_id, d.reason) for d in report.decisions) == [
        (job, Reason.MASS_STALENESS_BRAKE) for job in stale]
