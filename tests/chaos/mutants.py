"""Deliberately broken copies of the product's fences, one per peer bug (mutation checks).

Each is a copy of the real function with the one predicate that guards against the bug
removed, so a test can swap it in (``monkeypatch.setattr``) and show that the chaos checks
catch what the peer project shipped. Nothing here is used outside tests/chaos.

- River #1302, a rescuer overwrote a job completed after its fetch:
  ``swap_without_evidence`` (NativeSource._swap without the generation, status and
  staleness predicates: River's rescue UPDATE did not repeat its evidence).
- Solid Queue #589, a finished job later marked failed: ``fence_without_lease``
  (SqlStore._fence without the lease-token and status predicates).
- DBOS #716, a Postgres restart stranded recovery forever: ``pass_loop_that_dies``
  (Service.run_one_pass whose loop ends at the first database error).
- Celery #5935, duplicated long tasks: ``claim_redelivering_expired`` (SqlStore._claim_once
  that also takes a processing job whose lease expired: a visibility timeout, with no
  reconciler judging whether its step may run again).
- ``heartbeat_without_renewal`` (SqlStore.heartbeat that renews nothing): on its own it
  duplicates nothing here, which test_mutations shows as well.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.passes import PassReport, run_pass
from reconciler.core.ports import ClaimedJob, JobKey, PlannedChange
from reconciler.core.vocabulary import JobStatus
from reconciler.errors import LeaseLost
from reconciler.sidecar.service import Service
from reconciler.storage.clock import db_now, now_plus
from reconciler.storage.native_source import NativeSource, planned_rows
from reconciler.storage.sql import PROCESSING, attempts, jobs, json_rows, plan_steps
from reconciler.storage.sql_store import SqlStore
from reconciler.storage.transitions import PLANNED_COLUMNS, swap_changes


def swap_without_evidence(self: NativeSource, acting: Sequence[PlannedChange]
                          ) -> dict[JobKey, int | None]:
    """``_swap`` matching the job by id alone: whatever happened since the read is lost."""
    values = json_rows(self.dialect, "planned", PLANNED_COLUMNS)
    stmt = (
        jobs.update()
        .where(jobs.c.job_id == values.c.job_id)  # MUTATION: no generation/status/time
        .values(swap_changes(values))
        .returning(jobs.c.job_id, jobs.c.claim_generation)
    )
    return {int(job_id): int(generation) for job_id, generation in self.conn.execute(
        stmt, {"planned_rows": planned_rows(acting)})}


def fence_without_lease(self: SqlStore, conn: Connection, job_id: int, token: str,
                        *extra: Any, **changes: Any) -> sa.Row[Any]:
    """``_fence`` that forgets whose lease it is: any holder's write lands."""
    row = conn.execute(
        jobs.update()
        .where(jobs.c.job_id == job_id, *extra)  # MUTATION: no lease_token, no status
        .values(**changes)
        .returning(jobs.c.claim_generation, jobs.c.attempt_count, jobs.c.max_attempts,
                   sa.cast(jobs.c.step_plan, sa.Text).label("plan_text"))
    ).one_or_none()
    if row is None:
        raise LeaseLost(job_id)
    return row


def claim_redelivering_expired(self: SqlStore, worker: str, lease_seconds: float,
                               kinds: Sequence[str] | None, session_id: int | None
                               ) -> ClaimedJob | None:
    """``_claim_once`` that redelivers a processing job once its lease has expired."""
    token = uuid.uuid4().hex
    available = sa.or_(
        sa.and_(jobs.c.job_status == JobStatus.QUEUED.value, jobs.c.available_at <= db_now()),
        # MUTATION: a visibility timeout; the reconciler's judgment is skipped.
        sa.and_(jobs.c.job_status == PROCESSING, jobs.c.lease_expires_at <= db_now()),
    )
    with self.engine.begin() as conn:
        pick = (sa.select(jobs.c.job_id)
                .where(available, jobs.c.operator_hold.is_(False))
                .order_by(jobs.c.available_at, jobs.c.job_id).limit(1))
        if kinds:
            pick = pick.where(jobs.c.job_kind.in_(list(kinds)))
        row = conn.execute(
            jobs.update()
            .where(jobs.c.job_id == pick.scalar_subquery(), available)
            .values(
                job_status=PROCESSING, status_reason=None,
                claim_generation=jobs.c.claim_generation + 1,
                attempt_count=jobs.c.attempt_count + 1,
                lease_token=token, lease_owner=worker, worker_session_id=session_id,
                lease_expires_at=now_plus(lease_seconds),
                claimed_at=db_now(), last_activity_at=db_now(), updated_at=db_now(),
            )
            .returning(
                jobs.c.job_id, jobs.c.job_kind, jobs.c.claim_generation,
                jobs.c.attempt_count, jobs.c.max_attempts, jobs.c.resume_step_index,
                sa.cast(jobs.c.step_plan, sa.Text).label("plan_text"), jobs.c.job_payload,
            )
        ).one_or_none()
        if row is None:
            return None
        conn.execute(attempts.insert().values(
            job_id=row.job_id, claim_generation=row.claim_generation,
            attempt_number=row.attempt_count, lease_owner=worker, claimed_at=db_now(),
        ))
    return ClaimedJob(
        job_id=int(row.job_id), job_kind=row.job_kind,
        claim_generation=int(row.claim_generation), attempt_count=int(row.attempt_count),
        max_attempts=int(row.max_attempts), lease_token=token,
        resume_step_index=int(row.resume_step_index), plan=plan_steps(row.plan_text),
        payload=row.job_payload,
    )


def heartbeat_without_renewal(self: SqlStore, job_id: int, token: str,
                              lease_seconds: float) -> None:
    """``heartbeat`` that checks its fence but never moves the lease."""
    with self.engine.begin() as conn:
        self._fence(conn, job_id, token, updated_at=db_now())  # MUTATION: no new expiry


def pass_loop_that_dies(self: Service) -> PassReport | None:
    """``run_one_pass`` whose loop ends at its first error: the pass is never tried again."""
    if getattr(self, "_loop_died", False):
        return None
    started = time.monotonic()
    try:
        report = run_pass(self.passes, self.config, after=self.cursor)
    except Exception:
        self.metrics.observe_failed_pass(time.monotonic() - started)
        self._loop_died = True  # type: ignore[attr-defined]  # MUTATION: never again
        return None
    self.cursor = report.next_cursor
    self.metrics.observe_pass(report, time.monotonic() - started, time.time())
    if report.outcome.value == "ok":
        self.last_pass_finished = time.monotonic()
    return report
