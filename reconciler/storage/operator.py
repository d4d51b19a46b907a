"""Operator actions on native jobs (hold, unhold, retry, cancel): the core's state machine,
written as one compare-and-swap on the status and generation read in the same transaction
(``transitions.operator_change``), and recorded either way with who acted and why."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from reconciler.core.policy import OperatorChange, Refusal, operator_change
from reconciler.core.vocabulary import JobKey, JobStatus, OperatorAction
from reconciler.storage import transitions
from reconciler.storage.deadlocks import deadlock_retried
from reconciler.storage.engines import read_only
from reconciler.storage.native_source import NativeSource
from reconciler.storage.operator_record import (
    ActionRecord,
    actions_about,
    is_held,
    record_action,
)
from reconciler.storage.sql import PLAN_TEXT, for_update, jobs

NATIVE = NativeSource.source_name
"""The native source's name in the record (``reconciler.config.registry.DEFAULT_SOURCE``)."""


class OperatorSql:
    """Operator actions on one engine."""

    engine: Engine

    @deadlock_retried
    def operator_action(self, job_id: int, action: str, *, actor: str | None = None,
                        note: str | None = None) -> tuple[bool, str | None]:
        """Apply hold, unhold, retry or cancel with the same fences; record it either way,
        with ``actor`` and ``note``.

        Returns (applied, refusal reason). ValueError for an unknown action.
        """
        act = OperatorAction(action)
        with self.engine.begin() as conn:
            current = sa.select(
                jobs.c.job_status, jobs.c.claim_generation, jobs.c.operator_hold, PLAN_TEXT,
            ).where(jobs.c.job_id == job_id)
            row = conn.execute(for_update(conn.dialect.name, current, lock=True,
                                          skip_locked=False)).one_or_none()
            if row is None:
                return False, Refusal.NO_SUCH_JOB.value
            status, generation = JobStatus(row.job_status), int(row.claim_generation)
            held = bool(row.operator_hold)
            change = operator_change(act, status, held)
            status_after, generation_after, held_after = status, generation, held
            refusal: Refusal | None = change if isinstance(change, Refusal) else None
            if isinstance(change, OperatorChange):
                if not transitions.operator_change(conn, job_id, change, status=status,
                                                   generation=generation,
                                                   plan_text=row.plan_text):
                    refusal = Refusal.FENCE_LOST
                else:
                    status_after = change.new_status or status
                    generation_after = generation + int(change.bumps_generation)
                    held_after = held if change.hold is None else change.hold
            record_action(conn, ActionRecord(
                source=NATIVE, job_key=job_id, job_id=job_id, action=act, actor=actor,
                note=note, refusal=refusal.value if refusal else None,
                state_before=native_state(status, held),
                state_after=native_state(status_after, held_after),
                status_before=status.value, status_after=status_after.value,
                generation_before=generation, generation_after=generation_after))
            return refusal is None, refusal.value if refusal else None

    def actions_about(self, source: str, job_key: JobKey, limit: int
                      ) -> list[dict[str, Any]]:
        """The operator actions on one job of ``source``, newest first."""
        with self.engine.connect() as conn:
            found = actions_about(read_only(conn), source, job_key, limit)
            conn.rollback()
            return found

    def held_by_operator(self, source: str, job_key: JobKey) -> bool:
        """Whether an operator holds this job of a foreign ``source`` (the reconciler's
        own hold; a native job's hold is its row's)."""
        with self.engine.connect() as conn:
            held = is_held(read_only(conn), source, job_key)
            conn.rollback()
            return held


def native_state(status: JobStatus, held: bool) -> str:
    """A native job's state as the record keeps it: its status, and whether it is held."""
    return f"{status.value} (held)" if held else status.value
