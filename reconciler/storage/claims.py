"""Enqueue, claim, and every fenced write a claim makes afterwards (docs/lease-contract.md).

Every write after a claim is an UPDATE fenced on (job, lease token, processing); no row
means the claim was lost, and ``LeaseLost`` is raised before anything else is written.
The state changes themselves (claim, complete, fail, release) are ``transitions``'.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from reconciler.core.evidence import PlanStep
from reconciler.core.ports import ClaimedJob
from reconciler.core.vocabulary import (
    ArtifactState,
    DatabaseErrorCode,
    JobStatus,
    StepState,
)
from reconciler.storage import transitions
from reconciler.storage.clock import db_now, now_plus
from reconciler.storage.deadlocks import deadlock_retried
from reconciler.storage.diagnosis import error_code
from reconciler.storage.engines import lock_wait
from reconciler.storage.sql import (
    MYSQL,
    artifacts,
    insert_into,
    jobs,
    session_gone,
    steps,
    upsert,
    wake_workers,
)

SINGLETON_RETRIES = 5
CLAIM_LOCK_WAIT_SECONDS = 1.0
"""How long a claim waits for SQLite's write lock before it claims nothing this time."""


class StepNotStartedError(ValueError):
    """``finish_step`` for a step this claim never started."""


class ClaimsSql:
    """Enqueue, claim and the fenced writes of a claim, on one engine."""

    engine: Engine

    def enqueue(
        self,
        job_kind: str,
        plan: Sequence[PlanStep],
        *,
        max_attempts: int,
        idempotency_key: str | None,
        singleton_key: str | None,
        payload: Any,
        connection: Connection | None = None,
    ) -> int:
        """Insert a queued job, or return the job already holding ``idempotency_key``."""
        row = {
            "job_kind": job_kind, "job_status": JobStatus.QUEUED.value,
            "step_plan": [{"step_name": s.step_name, "effect_kind": s.kind.value}
                          for s in plan],
            "max_attempts": max_attempts, "idempotency_key": idempotency_key,
            "singleton_key": singleton_key, "job_payload": payload,
            "available_at": db_now(), "created_at": db_now(), "updated_at": db_now(),
        }
        if connection is not None:
            return self._enqueue_on(connection, row, idempotency_key)
        return self._enqueue_alone(row, idempotency_key)

    @deadlock_retried
    def _enqueue_alone(self, row: dict[str, Any], key: str | None) -> int:
        with self.engine.begin() as conn:
            return self._enqueue_on(conn, row, key)

    def _enqueue_on(self, conn: Connection, row: dict[str, Any], key: str | None) -> int:
        stmt = insert_into(conn.dialect.name, jobs).values(**row)
        if conn.dialect.name == MYSQL:
            # No RETURNING on MySQL 8: the job's id is the insert id, and for a key already
            # taken the existing job's, made the insert id by LAST_INSERT_ID(job_id) (the
            # documented idiom). Idle workers poll there: nobody to wake.
            if key is not None:
                stmt = stmt.on_duplicate_key_update(
                    job_id=sa.func.last_insert_id(jobs.c.job_id))
            return int(conn.execute(stmt).lastrowid)
        if key is not None:
            stmt = stmt.on_conflict_do_nothing(index_elements=[jobs.c.idempotency_key])
        job_id = conn.execute(stmt.returning(jobs.c.job_id)).scalar_one_or_none()
        if job_id is not None:
            wake_workers(conn)
        if job_id is None:
            job_id = conn.execute(
                sa.select(jobs.c.job_id).where(jobs.c.idempotency_key == key)
            ).scalar_one()
        return int(job_id)

    def claim(self, worker: str, lease_seconds: float, kinds: Sequence[str] | None = None,
              session_id: int | None = None) -> ClaimedJob | None:
        """Atomically take the oldest available queued job and start a new attempt on it.

        ``kinds=None`` claims any kind; an empty list names no kind and claims nothing.
        On PostgreSQL two claims can still race past the singleton check onto two jobs of
        one key; the unique partial index refuses the loser, which then simply tries again.
        """
        if kinds is not None and len(kinds) == 0:
            return None
        for _ in range(SINGLETON_RETRIES):
            try:
                return self._claim_once(worker, lease_seconds, kinds, session_id)
            except sa.exc.IntegrityError as exc:
                if "singleton" not in str(exc.orig):
                    raise
        return None

    @deadlock_retried
    def _claim_once(self, worker: str, lease_seconds: float, kinds: Sequence[str] | None,
                    session_id: int | None) -> ClaimedJob | None:
        # A claim is a poll: on a SQLite database whose write lock another writer holds, it
        # gives up after CLAIM_LOCK_WAIT_SECONDS (nothing claimed) instead of the busy
        # timeout, so a worker told to stop is never kept in a claim for half a minute.
        with self.engine.connect() as conn:
            claiming = lock_wait(conn, CLAIM_LOCK_WAIT_SECONDS)
            try:
                with claiming.begin():
                    return transitions.claim(claiming, worker, uuid.uuid4().hex,
                                             lease_seconds=lease_seconds, kinds=kinds,
                                             session_id=session_id)
            except sa.exc.OperationalError as exc:
                if error_code(exc) is DatabaseErrorCode.LOCK_TIMEOUT:
                    return None
                raise

    def _fence(self, conn: Connection, job_id: int, token: str, *extra: Any,
               **changes: Any) -> sa.Row[Any]:
        """The fenced write every post-claim operation starts with (``transitions.fence``)."""
        return transitions.fence(conn, job_id, token, *extra, **changes)

    @deadlock_retried
    def heartbeat(self, job_id: int, token: str, lease_seconds: float) -> None:
        """Renew this claim's lease only; activity does not move (a beat is not progress)."""
        with self.engine.begin() as conn:
            # A gone session's lease was expired on purpose; its beats must not revive it.
            self._fence(conn, job_id, token, ~session_gone(),
                        lease_expires_at=now_plus(lease_seconds))

    @deadlock_retried
    def report_progress(self, job_id: int, token: str) -> None:
        """Record that the handler moved: ``last_activity_at`` becomes now."""
        with self.engine.begin() as conn:
            self._fence(conn, job_id, token, last_activity_at=db_now(), updated_at=db_now())

    @deadlock_retried
    def record_step(
        self, job_id: int, token: str, step_index: int, spec: PlanStep, state: StepState,
        *, error_code: str | None = None, retryable: bool | None = None,
    ) -> None:
        """Fenced step record: the job's activity and the step's row move together."""
        with self.engine.begin() as conn:
            fenced = self._fence(conn, job_id, token,
                                 last_activity_at=db_now(), updated_at=db_now())
            generation = fenced.claim_generation
            if state is StepState.SUCCEEDED:
                done = conn.execute(
                    steps.update()
                    .where(steps.c.job_id == job_id, steps.c.step_index == step_index,
                           steps.c.claim_generation == generation,
                           steps.c.step_state.in_([StepState.STARTED.value,
                                                   StepState.WAITING.value]))
                    .values(step_state=state.value, finished_at=db_now(),
                            error_code=None, failure_retryable=None)
                )
                if done.rowcount != 1:
                    conn.rollback()
                    raise StepNotStartedError(
                        f"step {step_index} was not started by this claim")
                return
            keep_start = state is not StepState.STARTED
            conn.execute(upsert(conn.dialect.name, steps, {
                "job_id": job_id, "step_index": step_index, "step_name": spec.step_name,
                "effect_kind": spec.kind.value, "step_state": state.value,
                "claim_generation": generation, "started_at": db_now(),
                "finished_at": db_now() if state is StepState.FAILED else None,
                "error_code": error_code, "failure_retryable": retryable,
            }, keys=[steps.c.job_id, steps.c.step_index], changes=lambda new: {
                # A failure or a wait keeps the start time of the same attempt's start
                # (first: it reads the generation the row had).
                "started_at": sa.case(
                    (sa.and_(sa.literal(keep_start),
                             steps.c.claim_generation == new.claim_generation),
                     steps.c.started_at),
                    else_=new.started_at,
                ),
                "step_name": new.step_name,
                "effect_kind": new.effect_kind,
                "step_state": new.step_state,
                "claim_generation": new.claim_generation,
                "finished_at": new.finished_at,
                "error_code": new.error_code,
                "failure_retryable": new.failure_retryable,
            }))

    @deadlock_retried
    def complete(self, job_id: int, token: str) -> int:
        """Fenced completion: the job, its attempt and its staged artifacts, together.

        Returns the completing generation, whose artifact files the caller moves into place.
        """
        with self.engine.begin() as conn:
            row = self._fence(conn, job_id, token, **transitions.COMPLETING)
            transitions.completed(conn, job_id, row.claim_generation)
            return int(row.claim_generation)

    @deadlock_retried
    def fail(
        self, job_id: int, token: str, error_code: str, *, retryable: bool,
        backoff_seconds: float, backoff_max_seconds: float, status_reason: str | None = None,
    ) -> bool:
        """Fenced failure; requeues with backoff while attempts remain. True when requeued."""
        with self.engine.begin() as conn:
            row = self._fence(conn, job_id, token, last_error_code=error_code,
                              updated_at=db_now())
            return transitions.failed(
                conn, job_id, row, retryable=retryable, backoff_seconds=backoff_seconds,
                backoff_max_seconds=backoff_max_seconds, status_reason=status_reason)

    @deadlock_retried
    def release(self, job_id: int, token: str) -> None:
        """Fenced graceful release: requeue now, give the attempt back, keep the resume point."""
        with self.engine.begin() as conn:
            row = self._fence(conn, job_id, token, updated_at=db_now(),
                              attempt_count=jobs.c.attempt_count - 1)
            transitions.released(conn, job_id, row)

    @deadlock_retried
    def stage_artifact(self, job_id: int, token: str, artifact_name: str) -> int:
        """Fenced: record an artifact staged by this claim; returns its generation."""
        with self.engine.begin() as conn:
            row = self._fence(conn, job_id, token, last_activity_at=db_now(),
                              updated_at=db_now())
            conn.execute(upsert(conn.dialect.name, artifacts, {
                "job_id": job_id, "claim_generation": row.claim_generation,
                "artifact_name": artifact_name,
                "artifact_state": ArtifactState.STAGED.value, "staged_at": db_now(),
            }, keys=[artifacts.c.job_id, artifacts.c.claim_generation,
                     artifacts.c.artifact_name],
                changes=lambda new: {"staged_at": new.staged_at}))
            return int(row.claim_generation)
