"""Operator actions (hold, unhold, retry, cancel): the core's state machine, written as one
compare-and-swap on the status and generation read in the same transaction, and recorded
either way."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from reconciler.core.policy import OperatorChange, Refusal, operator_change
from reconciler.core.vocabulary import (
    ActionOutcome,
    AttemptOutcome,
    EndedBy,
    JobStatus,
    OperatorAction,
)
from reconciler.storage.claims import first_unfinished
from reconciler.storage.clock import db_now
from reconciler.storage.engines import is_postgresql
from reconciler.storage.sql import (
    PLAN_TEXT,
    actions,
    attempts,
    for_update,
    jobs,
    wake_workers,
)


def _columns(change: OperatorChange, conn: Connection, job_id: int,
             plan_text: str | None) -> dict[str, Any]:
    """The column values of an applied change."""
    # Whatever an operator changes may end what a pass parked the job on (its hold).
    values: dict[str, Any] = {"updated_at": db_now(), "reconcile_parked": False}
    if change.hold is not None:
        values["operator_hold"] = change.hold
    if change.new_status is not None:
        values["job_status"] = change.new_status.value
        values["status_reason"] = change.status_reason
        values["claim_generation"] = jobs.c.claim_generation + 1
        terminal = change.new_status is not JobStatus.QUEUED
        values["finished_at"] = db_now() if terminal else None
    if change.restart_budget:
        values.update(attempt_count=0, available_at=db_now(),
                      resume_step_index=first_unfinished(conn, job_id, plan_text))
    if change.drop_lease:
        values.update(lease_token=None, lease_expires_at=None)
    return values


class OperatorSql:
    """Operator actions on one engine."""

    engine: Engine

    def operator_action(self, job_id: int, action: str) -> tuple[bool, str | None]:
        """Apply hold, unhold, retry or cancel with the same fences; record it either way.

        Returns (applied, refusal reason). ValueError for an unknown action.
        """
        act = OperatorAction(action)
        with self.engine.begin() as conn:
            current = sa.select(
                jobs.c.job_status, jobs.c.claim_generation, jobs.c.operator_hold, PLAN_TEXT,
            ).where(jobs.c.job_id == job_id)
            row = conn.execute(for_update(is_postgresql(conn), current, lock=True,
                                          skip_locked=False)).one_or_none()
            if row is None:
                return False, Refusal.NO_SUCH_JOB.value
            status, generation = JobStatus(row.job_status), int(row.claim_generation)
            change = operator_change(act, status, bool(row.operator_hold))
            status_after, generation_after = status, generation
            refusal: Refusal | None = change if isinstance(change, Refusal) else None
            if isinstance(change, OperatorChange):
                done = conn.execute(
                    jobs.update()
                    .where(jobs.c.job_id == job_id, jobs.c.job_status == status.value,
                           jobs.c.claim_generation == generation)
                    .values(_columns(change, conn, job_id, row.plan_text))
                )
                if done.rowcount != 1:
                    refusal = Refusal.FENCE_LOST
                else:
                    status_after = change.new_status or status
                    generation_after = generation + int(change.bumps_generation)
                    self._after(conn, job_id, generation, act, status)
            conn.execute(actions.insert().values(
                job_id=job_id, operator_action=act.value,
                action_outcome=(ActionOutcome.REFUSED if refusal else ActionOutcome.APPLIED
                                ).value,
                refusal_reason=refusal.value if refusal else None,
                acted_at=db_now(), status_before=status.value,
                status_after=status_after.value,
                generation_before=generation, generation_after=generation_after,
            ))
            return refusal is None, refusal.value if refusal else None

    def _after(self, conn: Connection, job_id: int, generation: int, action: OperatorAction,
               status: JobStatus) -> None:
        """What an applied action implies beyond the job row."""
        if action is OperatorAction.CANCEL and status is JobStatus.PROCESSING:
            # The worker is fenced out: its attempt is over, though it never said so.
            conn.execute(
                attempts.update()
                .where(attempts.c.job_id == job_id, attempts.c.claim_generation == generation,
                       attempts.c.ended_at.is_(None))
                .values(ended_at=db_now(), attempt_outcome=AttemptOutcome.LOST.value,
                        ended_by=EndedBy.OPERATOR.value)
            )
        elif action is OperatorAction.RETRY:
            wake_workers(conn)
