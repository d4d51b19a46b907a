"""The ``native`` source's fixture: this project's own ``job_runs``, on SQLite and PostgreSQL.

Situations are made the way a worker makes them, with the public worker API (``JobClient``:
enqueue, claim, start/finish/fail/wait a step, heartbeat, complete) and the operator hold
of the store. Direct SQL is used only where no API may go: to move the clock (a lease that
ran out, activity or an owner heartbeat long ago: one UPDATE each) and to store evidence the
API refuses (an unreadable plan, a step record outside the plan).

Workers write through an engine of their own, so every write that stands for a worker or
another replica arrives on a different connection from the pass's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import sqlalchemy as sa

from models import JobAttempt, JobRun, ReconciliationDecision, StepRun, WorkerSession
from reconciler.config.loader import Config, parse_kinds
from reconciler.config.settings import Settings
from reconciler.core.brake import BrakeLimits
from reconciler.core.decisions import Decision, Thresholds
from reconciler.core.passes import PassConfig, PassReport, apply_and_record, plan_change, run_pass
from reconciler.core.ports import Cursor, PassStore
from reconciler.core.vocabulary import Disposition, PassOutcome, StepState
from reconciler.root.cli import CliParts, assemble_cli
from reconciler.storage.clock import db_now, now_plus
from reconciler.storage.engines import create_engine
from reconciler.storage.sql_store import SqlStore
from reconciler.worker import Claim, JobClient
from tests.conformance.fixtures import (
    PLAN_LENGTH,
    REBORN_STATES,
    TIMING,
    AuditEntry,
    Capability,
    Interference,
    InterruptedPass,
    Outcome,
    RegisteredSource,
    Situation,
    SourceJob,
    State,
)
from tests.helpers import job_row, rows_of
from tests.integration.test_pass import corrupt_plan, finish, set_operator_hold

JOBS = cast(sa.Table, JobRun.__table__)
STEPS = cast(sa.Table, StepRun.__table__)
ATTEMPTS = cast(sa.Table, JobAttempt.__table__)
DECISIONS = cast(sa.Table, ReconciliationDecision.__table__)
SESSIONS = cast(sa.Table, WorkerSession.__table__)

INSTANCE = "conformance-reconciler"
WORKER = "conformance-worker"
UNREADABLE_PLAN = '[{"step_name": "x", "effect_kind": "nuclear"}]'
"""Valid JSON (PostgreSQL's json column refuses anything else) naming no known effect."""

OUTCOMES: dict[str, Outcome] = {
    "processing": "running", "queued": "runnable", "failed": "failed", "completed": "completed",
}
EXPIRED_STATES = frozenset({
    State.DIED_BEFORE_STEP, State.DIED_MID_STEP, State.STEP_FAILED,
    State.STEP_FAILED_RETRYABLY, State.COMPLETION_UNRECORDED, State.HELD, State.GATED,
    State.OUT_OF_ATTEMPTS, State.PLAN_UNREADABLE, State.EVIDENCE_UNREADABLE,
})


class NativeSource:
    """This project's own tables as a source under test (see ``SourceFixture``)."""

    source_name = "native"

    def __init__(self, database_url: str) -> None:
        # The reconciler and the workers are different processes in production: each
        # gets its own engine, so their writes never share a connection.
        self.reconciler_engine = create_engine(database_url)
        self.store = SqlStore(self.reconciler_engine)
        settings = Settings(
            database_url=database_url, stale_after_seconds=TIMING.stale_after_seconds,
            wedged_after_seconds=TIMING.wedged_after_seconds,
            session_timeout_seconds=TIMING.session_timeout_seconds)
        self.parts = assemble_cli(Config(settings=settings, kinds=parse_kinds(None, settings)),
                                  engine=self.reconciler_engine)
        self.worker_engine = create_engine(database_url)
        self.client = JobClient(self.worker_engine, settings=Settings(database_url=database_url))
        self._claims: dict[int, Claim] = {}
        self._kinds: dict[int, str] = {}
        self._serial = itertools.count(1)

    def operator(self) -> CliParts:
        """A command's parts on this database, under the suite's settings."""
        return self.parts

    def close(self) -> None:
        """Release both engines' connections."""
        self.worker_engine.dispose()
        self.reconciler_engine.dispose()

    # -- what the source can express --------------------------------------------------------

    def supports(self, what: Capability) -> bool:
        """The native source keeps every fact the table reads: it expresses everything but
        an owner's name taken by a later process (its owner is a worker session)."""
        return not (isinstance(what, Situation) and what.state in REBORN_STATES)

    def why_unsupported(self, what: Capability) -> str:
        """Only the reborn-owner situations."""
        return ("native's liveness names a worker session, whose id a new process never "
                "takes: it opens a session of its own")

    # -- making situations --------------------------------------------------------------------

    def make(self, situation: Situation) -> SourceJob:
        """Enqueue, claim, work up to the situation's step, then move the clock."""
        state, n = situation.state, situation.step
        kind = f"conformance-{next(self._serial)}"  # one kind per job: each claim is exact
        job_id = self.client.enqueue(
            kind, steps=situation.plan, payload={"situation": str(situation)},
            max_attempts=1 if state is State.OUT_OF_ATTEMPTS else 3,
        )
        session = (self.client.store.register_session(WORKER, kind, 1)
                   if state is State.OWNER_GONE else None)
        claim = self.client.claim(WORKER, TIMING.lease_seconds, [kind], session_id=session)
        assert claim is not None
        assert claim.job_id == job_id, "one kind per job: the claim takes this job"
        self._claims[job_id], self._kinds[job_id] = claim, kind

        finish(*range(n))(claim)
        if state in (State.LIVE, State.DIED_MID_STEP, State.STEP_FAILED,
                     State.STEP_FAILED_RETRYABLY, State.GATED, State.WEDGED):
            claim.start_step(n)
        if state in (State.STEP_FAILED, State.STEP_FAILED_RETRYABLY):
            claim.fail_step(n, "card_declined", retryable=state is State.STEP_FAILED_RETRYABLY)
        elif state is State.GATED:
            claim.wait_step(n)
        elif state is State.COMPLETION_UNRECORDED:
            finish(*range(n, PLAN_LENGTH))(claim)
        elif state is State.HELD:
            set_operator_hold(self.store, self.worker_engine, job_id)
        elif state is State.PLAN_UNREADABLE:
            corrupt_plan(self.worker_engine, job_id, UNREADABLE_PLAN)
        elif state is State.EVIDENCE_UNREADABLE:
            self._record_step_outside_plan(job_id, claim.generation)

        if state in EXPIRED_STATES:
            self._age_job(job_id, TIMING.idle_seconds, TIMING.lease_expired_seconds)
        elif state is State.RECENTLY_ACTIVE:
            self._age_job(job_id, TIMING.recent_seconds, TIMING.recent_seconds / 2)
        elif state is State.WEDGED:
            self._age_job(job_id, TIMING.wedged_after_seconds + 60, None)
        elif state is State.OWNER_GONE:
            assert session is not None
            self._silence_session(session)
        return SourceJob(job_id, claim.generation)

    def _age_job(self, job_id: int, idle_seconds: float,
                 lease_expired_seconds: float | None) -> None:
        """Direct SQL, moving time: the last progress (and the lease's end) lie in the past."""
        values: dict[str, Any] = {"last_activity_at": now_plus(-idle_seconds)}
        if lease_expired_seconds is not None:
            values["lease_expires_at"] = now_plus(-lease_expired_seconds)
        with self.worker_engine.begin() as conn:
            conn.execute(JOBS.update().where(JOBS.c.job_id == job_id).values(**values))

    def _silence_session(self, session_id: int) -> None:
        """Direct SQL, moving time: the owner's last session heartbeat lies past the timeout."""
        with self.worker_engine.begin() as conn:
            conn.execute(SESSIONS.update().where(SESSIONS.c.session_id == session_id).values(
                heartbeat_at=now_plus(-(TIMING.session_timeout_seconds + 30))))

    def _record_step_outside_plan(self, job_id: int, generation: int) -> None:
        """Direct SQL: a step record the worker API refuses (its index lies past the plan)."""
        with self.worker_engine.begin() as conn:
            conn.execute(STEPS.insert().values(
                job_id=job_id, step_index=PLAN_LENGTH + 4, step_name="ghost",
                effect_kind="pure", step_state=StepState.SUCCEEDED.value,
                claim_generation=generation, started_at=db_now(),
            ))

    def interfere(self, job: SourceJob, change: Interference) -> None:
        """The slow owner's late write, or another replica and worker taking the job over."""
        key = cast(int, job.key)
        claim = self._claims[key]
        if change is Interference.LATE_HEARTBEAT:
            claim.heartbeat()
        elif change is Interference.LATE_PROGRESS:
            claim.report_progress()
        elif change is Interference.LATE_COMPLETION:
            claim.complete()
        elif change is Interference.RECLAIM:
            recovered = self.run_pass()
            assert [(d.job_id, d.disposition) for d in recovered.decisions] == [
                (key, Disposition.RESUME)], "a reclaim needs a job the pass resumes"
            again = self.client.claim("conformance-second-worker", TIMING.lease_seconds,
                                      [self._kinds[key]])
            assert again is not None
            assert again.job_id == key
            self._claims[key] = again
            self._age_job(key, TIMING.idle_seconds, TIMING.lease_expired_seconds)
        else:  # pragma: no cover - every member is handled above
            raise AssertionError(change)

    # -- observing ----------------------------------------------------------------------------

    def status(self, job: SourceJob) -> Outcome:
        """``job_status`` in neutral words."""
        return OUTCOMES[job_row(self.reconciler_engine, cast(int, job.key))["job_status"]]

    def reason(self, job: SourceJob) -> str | None:
        """``status_reason``."""
        return cast(str | None, job_row(self.reconciler_engine, cast(int, job.key))[
            "status_reason"])

    def resume_step(self, job: SourceJob) -> int | None:
        """``resume_step_index``."""
        return int(job_row(self.reconciler_engine, cast(int, job.key))["resume_step_index"])

    def generation(self, job: SourceJob) -> int | None:
        """``claim_generation``."""
        return int(job_row(self.reconciler_engine, cast(int, job.key))["claim_generation"])

    def snapshot(self, job: SourceJob) -> object:
        """The job's row (less the pass's own parking mark, which is bookkeeping, not the
        job's state), its step records and its attempts, every column."""
        key = cast(int, job.key)
        return (
            [{k: v for k, v in row.items() if k != "reconcile_parked"}
             for row in rows_of(self.reconciler_engine, JOBS, JOBS.c.job_id == key)],
            rows_of(self.reconciler_engine, STEPS, STEPS.c.job_id == key,
                    order=STEPS.c.step_index),
            rows_of(self.reconciler_engine, ATTEMPTS, ATTEMPTS.c.job_id == key,
                    order=ATTEMPTS.c.claim_generation),
        )

    def audit(self, job: SourceJob) -> list[AuditEntry]:
        """The job's ``reconciliation_decisions`` rows, oldest first; the audit keeps ids as
        text and this source's ids are integers."""
        return [
            AuditEntry(r["pass_id"], int(r["job_id"]), r["disposition"], r["decision_reason"],
                       r["generation_before"], r["generation_after"])
            for r in rows_of(self.reconciler_engine, DECISIONS,
                             (DECISIONS.c.job_source == "native")
                             & (DECISIONS.c.job_id == job.key),
                             order=DECISIONS.c.decision_id)
        ]

    # -- the pass -----------------------------------------------------------------------------

    def run_pass(self, *, batch_size: int = 50, dry_run: bool = False,
                 after: object | None = None, brake: BrakeLimits | None = None) -> PassReport:
        """One pass, as the sidecar runs it."""
        return _reconcile(self.store, batch_size, dry_run=dry_run, after=after,
                          brake=brake)[1]

    def run_interrupted_pass(self, between: Callable[[], None], *,
                             batch_size: int = 50) -> InterruptedPass:
        """One pass with ``between`` run after its decisions and before their apply."""
        decided, report = _reconcile(self.store, batch_size, between=between)
        return InterruptedPass(decided, report)


def _reconcile(store: PassStore, batch_size: int, *, dry_run: bool = False,
               after: object | None = None, between: Callable[[], None] | None = None,
               brake: BrakeLimits | None = None,
               ) -> tuple[tuple[Decision, ...], PassReport]:
    """The suite's one call into the reconciler: a pass on the current store.

    Without ``between`` it is ``run_pass`` itself. With it, the pass is split at its seam
    (decide in one transaction, ``between``, apply in the next), which a single
    transaction's row locks would otherwise make impossible to interleave: that is how the
    suite shows each compare-and-swap repeats the evidence it decided on. Swap this
    function, and only this one, for the composition root's pass.
    """
    config = PassConfig(
        batch_size=batch_size,
        thresholds=Thresholds(TIMING.stale_after_seconds, TIMING.wedged_after_seconds,
                              TIMING.crash_loop_after),
        instance=INSTANCE, session_timeout_seconds=TIMING.session_timeout_seconds,
        brake=brake,
    )
    if between is None:
        report = run_pass(store, config, dry_run=dry_run, after=cast(Cursor | None, after))
        return tuple(), report
    with store.pass_transaction(dry_run=False) as tx:
        tx.jobs.expire_gone_owners(config.session_timeout_seconds)
        planned = [plan_change(row, config.thresholds)
                   for row in tx.jobs.candidates(batch_size, config.thresholds, None)]
    between()
    with store.pass_transaction(dry_run=False) as tx:
        pass_id, recorded = apply_and_record(tx, config.instance, planned)
    decided = tuple(p.decision for p in planned)
    return decided, PassReport(pass_id, PassOutcome.OK, tuple(recorded))


@contextmanager
def open_native(database_url: str) -> Iterator[NativeSource]:
    """The native fixture on a migrated database, closed afterwards."""
    source = NativeSource(database_url)
    try:
        yield source
    finally:
        source.close()


NATIVE = RegisteredSource("native", ("sqlite", "postgresql", "mysql"), open_native)

