"""Operator actions (hold, unhold, retry, cancel): the core's state machine, written as one
compare-and-swap on the status and generation read in the same transaction
(``transitions.operator_change``), and recorded either way."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from reconciler.core.policy import OperatorChange, Refusal, operator_change
from reconciler.core.vocabulary import ActionOutcome, JobStatus, OperatorAction
from reconciler.storage import transitions
from reconciler.storage.clock import db_now
from reconciler.storage.engines import is_postgresql
from reconciler.storage.sql import PLAN_TEXT, actions, for_update, jobs


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
                if not transitions.operator_change(conn, job_id, change, status=status,
                                                   generation=generation,
                                                   plan_text=row.plan_text):
                    refusal = Refusal.FENCE_LOST
                else:
                    status_after = change.new_status or status
                    generation_after = generation + int(change.bumps_generation)
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
