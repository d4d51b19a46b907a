"""One operator action on a chunk of this project's own jobs, set-based: the chunk's rows
read and locked in one statement, the operator state machine asked of each
(``core.policy.operator_change``), each kind of change written in one UPDATE that repeats
every job's fence (its status and generation as read) inside the statement, the attempts
a cancel takes away closed in one more, and every action, applied or refused, recorded in
one multi-row insert. A job that moved meanwhile is refused ``fence_lost`` and the rest of
its chunk applied; the chunk commits or rolls back whole, so an interrupted bulk leaves
each job acted on and recorded, or untouched.

What one job's action does is ``storage.operator.OperatorSql.operator_action``'s, the
same changes in the same words; this is its batch, as a pass's swap is one job's
decision's batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.policy import (
    OperatorChange,
    Refusal,
    first_unfinished_step,
    operator_change,
)
from reconciler.core.vocabulary import (
    AttemptOutcome,
    EndedBy,
    JobStatus,
    OperatorAction,
)
from reconciler.storage.clock import db_now
from reconciler.storage.operator import NATIVE, native_state
from reconciler.storage.operator_record import ActionRecord, record_actions
from reconciler.storage.sql import (
    PLAN_TEXT,
    batch_params,
    for_update,
    jobs,
    json_rows,
    plan_steps,
    steps,
    unindexed,
    update_returning,
    wake_workers,
)
from reconciler.storage.transitions import by_key, end_attempts_statement, ended

OPERATED_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("job_id", sa.BigInteger()), ("generation_before", sa.BigInteger()),
    ("status_before", sa.String()), ("resume_at", sa.Integer()),
)


@dataclass(frozen=True, slots=True)
class Acted:
    """What one action did to one job of the chunk."""

    job_id: int
    refusal: str | None
    """None: applied; else the refusal's code (``no_such_job`` is not recorded)."""


def act_on_chunk(conn: Connection, job_ids: Sequence[int], action: OperatorAction, *,
                 actor: str | None, note: str | None) -> list[Acted]:
    """``action`` on each of ``job_ids`` in this transaction (see the module's docstring),
    in the order given."""
    dialect = conn.dialect.name
    rows = {int(r.job_id): r for r in conn.execute(for_update(dialect, sa.select(
        jobs.c.job_id, jobs.c.job_status, jobs.c.claim_generation, jobs.c.operator_hold,
        PLAN_TEXT).where(jobs.c.job_id.in_(sorted(set(job_ids)))).order_by(jobs.c.job_id),
        lock=True, skip_locked=False))}
    refused: dict[int, str] = {}
    groups: dict[OperatorChange, list[sa.Row[Any]]] = {}
    for job_id, row in rows.items():
        change = operator_change(action, JobStatus(row.job_status), bool(row.operator_hold))
        if isinstance(change, Refusal):
            refused[job_id] = change.value
        else:
            groups.setdefault(change, []).append(row)
    applied: dict[int, tuple[OperatorChange, int]] = {}
    for change, members in groups.items():
        swapped = _swap(conn, change, members)
        applied.update({job_id: (change, generation) for job_id, generation in swapped.items()})
        refused.update({int(r.job_id): Refusal.FENCE_LOST.value for r in members
                        if int(r.job_id) not in swapped})
    _close_taken_attempts(conn, rows, applied)
    if any(change.restart_budget for change, _ in applied.values()):
        wake_workers(conn)
    _record(conn, action, rows, applied, refused, actor=actor, note=note)
    return [Acted(job_id, refused.get(job_id) if job_id in rows
                  else Refusal.NO_SUCH_JOB.value) for job_id in job_ids]


def _swap(conn: Connection, change: OperatorChange, members: list[sa.Row[Any]]
          ) -> dict[int, int]:
    """One kind of change written to its jobs, each fenced on its status and generation
    as read; the jobs changed, with their generation after."""
    dialect = conn.dialect.name
    resume_at = _resume_points(conn, members) if change.restart_budget else {}
    planned = [{"job_id": int(r.job_id), "generation_before": int(r.claim_generation),
                "status_before": str(r.job_status), "resume_at": resume_at.get(int(r.job_id))}
               for r in members]
    values = json_rows(dialect, "operated", OPERATED_COLUMNS)
    statement = by_key(dialect, jobs.update().where(
        jobs.c.job_id == values.c.job_id,
        unindexed(jobs.c.claim_generation) == values.c.generation_before,
        unindexed(jobs.c.job_status) == values.c.status_before,
    ).values(_changes(change, values)), jobs.c.job_id)
    return {int(r.job_id): int(r.claim_generation) for r in update_returning(
        conn, statement, jobs.c.job_id, jobs.c.claim_generation,
        params=batch_params(dialect, "operated_rows", planned))}


def _changes(change: OperatorChange, values: Any) -> dict[str, Any]:
    """What ``transitions.operator_change`` writes, with each job's own resume point."""
    written: dict[str, Any] = {"updated_at": db_now(), "reconcile_parked": False}
    if change.hold is not None:
        written["operator_hold"] = change.hold
    if change.new_status is JobStatus.QUEUED:
        written.update(job_status=JobStatus.QUEUED.value,
                       status_reason=None if change.status_reason is None
                       else change.status_reason.value, finished_at=None)
    elif change.new_status is not None:
        written.update(ended(change.new_status, None if change.status_reason is None
                             else change.status_reason.value))
    if change.bumps_generation:
        written["claim_generation"] = jobs.c.claim_generation + 1
    if change.restart_budget:
        written.update(attempt_count=0, available_at=db_now(),
                       resume_step_index=values.c.resume_at)
    return written


def _resume_points(conn: Connection, members: list[sa.Row[Any]]) -> dict[int, int]:
    """Each job's first step not succeeded, from its step records, in one read."""
    done: dict[int, set[int]] = {}
    for job_id, index in conn.execute(sa.select(steps.c.job_id, steps.c.step_index).where(
            steps.c.job_id.in_([int(r.job_id) for r in members]),
            steps.c.step_state == "succeeded")):
        done.setdefault(int(job_id), set()).add(int(index))
    return {int(r.job_id): first_unfinished_step(len(plan_steps(r.plan_text)),
                                                 done.get(int(r.job_id), set()))
            for r in members}


def _close_taken_attempts(conn: Connection, rows: dict[int, sa.Row[Any]],
                          applied: dict[int, tuple[OperatorChange, int]]) -> None:
    """The attempts of running jobs a cancel took away, closed ``lost`` by the operator
    (their workers are fenced out and never say so), in one statement."""
    taken = [{"job_id": job_id, "generation": int(rows[job_id].claim_generation),
              "outcome": AttemptOutcome.LOST.value}
             for job_id, (change, _) in applied.items()
             if change.drop_lease and rows[job_id].job_status == JobStatus.PROCESSING.value]
    if taken:
        dialect = conn.dialect.name
        conn.execute(end_attempts_statement(dialect, EndedBy.OPERATOR),
                     batch_params(dialect, "ended_rows", taken))


def _record(conn: Connection, action: OperatorAction, rows: dict[int, sa.Row[Any]],
            applied: dict[int, tuple[OperatorChange, int]], refused: dict[int, str], *,
            actor: str | None, note: str | None) -> None:
    """Every action on a job that exists, applied or refused, in one insert."""
    records = []
    for job_id, row in rows.items():
        status, held, generation = (JobStatus(row.job_status), bool(row.operator_hold),
                                    int(row.claim_generation))
        status_after, held_after, generation_after = status, held, generation
        if job_id in applied:
            change, generation_after = applied[job_id]
            status_after = change.new_status or status
            held_after = held if change.hold is None else change.hold
        records.append(ActionRecord(
            source=NATIVE, job_key=job_id, job_id=job_id, action=action, actor=actor,
            note=note, refusal=refused.get(job_id),
            state_before=native_state(status, held),
            state_after=native_state(status_after, held_after),
            status_before=status.value, status_after=status_after.value,
            generation_before=generation, generation_after=generation_after))
    record_actions(conn, records)
