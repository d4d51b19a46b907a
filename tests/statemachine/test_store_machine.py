"""A Hypothesis state machine over the real store on SQLite with a controllable clock.

Every rule is a real call through ``JobClient``, ``Claim``, ``SqlStore`` or ``run_pass`` on
a fresh migrated SQLite file per run, and again on MariaDB (``TestStoreMachineOnMariaDB``:
one database emptied per run; see harness.py); time passes only through the frozen database clock
(``freeze_sqlite_clock``). Beside the database the machine keeps a small model: each
job's status, generation, attempts used and budget, resume point, hold, step records,
attempt rows and artifacts; which claim object is current; the worker sessions; the leader
lease. The model predicts every rule's outcome.

Time is virtual (``harness.DbClock``): it moves on a half-second grid, the database clock is
frozen on it for each call (calls at one instant 25 ms apart), and a call never runs on an
instant where one of the model's boundaries lies (a lease expiry, activity plus a
threshold, an availability, a session or leader timeout): the clock steps half a second
past it. Each comparison is therefore at least half a second from its boundary, and a run
is repeatable, as Hypothesis needs to replay and shrink it, however slow the machine.
Should a comparison still fall within a call's window, the model accepts either answer and
adopts what the database did (see ``harness.Window``).

Rules. Producers: ``enqueue`` (1-3 steps of random effect kinds, budget 1-3, with or
without an idempotency key). Workers: ``claim`` (10 s lease, with or without a worker
session), ``heartbeat``, ``report_progress``, ``start_step`` / ``finish_step`` /
``fail_step`` / ``wait_step`` at the worker's next step, ``stage_artifact``, ``complete``,
``fail``, ``release``; ``crash`` forgets a claim object without a write; ``stale_write``
calls any write through a superseded claim. Sessions: ``register_session`` (a restart
replaces the previous one), ``heartbeat_session``, ``stop_session``. Operators, through
the native desk as the command line and the console take it: ``operator`` (hold, unhold,
retry or cancel one job, with an actor and a note or none) and ``operator_bulk`` (the bulk
retry or cancel over a decision reason, capped). The reconciler: ``reconcile`` (two
replicas, batch 1, 2 or 50; no leader in front of a pass), ``lead`` (the chores' leader
lease: take, renew, give up), ``dry_run``. Time: ``time_passes`` (0.5 s to 120 s). A few
rules string these together the way real processes do, so short runs reach deep states:
``work`` (run steps in order, maybe leave one running), ``die_mid_step``, ``worker_alive``
(time passes while the heart beats, with or without progress: a wedged handler),
``heart_stops`` (progress without heartbeats, then a pass), ``taken_over`` (a stalled
worker's job is reclaimed by another: the stalled claim becomes a zombie) and
``sidecar_tick`` (time passes, then a pass).

After every step the invariants are checked against the database, read with SQL:

- every job's status is one of the six; a processing job has a lease token, a lease expiry
  and an activity time; a queued or terminal job has no lease; a terminal job has a finish
  time and a live one has none;
- ``claim_generation`` never decreases; ``attempt_count`` stays within 0..max_attempts;
- at most one open ``job_attempts`` row per job, and an open one exactly when the job is
  processing, of the job's current generation;
- every generation of every job was made by exactly one writer: a claim (its attempt
  row), an applied operator action, or a reconciler decision (``resume``/``terminalize``
  with ``generation_after = generation_before + 1``); skips record no generation after;
- a completed job stays completed, at its generation, with its finish time; only the
  completing generation's artifacts are published;
- an idempotency key names exactly one job;
- every row of every table agrees with the model.

And in the rules themselves: a write through a superseded claim raises ``LeaseLost`` and
changes no row of any table; a claim takes the oldest available job; a pass decides only
what the decision table allows for the evidence (so it never changes a job whose lease is
live and whose activity is recent), takes the oldest expired leases first, and records
exactly what it did; an effectful step that started and never finished is never started
again after the reconciler requeued its job; a job ended ``worker_died_mid_step`` is never
claimed again (unless an operator retries it); a dry run, a refused write, a repeated
enqueue and a refused leader lease write nothing; every operator action, applied or
refused, is recorded once with the native source, the job's key, who, the note and the
state before and after; the bulk form picks exactly the jobs whose latest decision matches
and whose state allows the action, newest decision first, up to its cap.

What it cannot see: races between two processes inside one pass's transaction (SQLite
serialises them); those belong to the chaos harness.

CI runs a modest number of examples (``RECONCILER_STATEMACHINE_EXAMPLES``, default 60, of
``RECONCILER_STATEMACHINE_STEPS`` steps, default 40; a third of them on MariaDB,
``RECONCILER_STATEMACHINE_MARIADB_EXAMPLES``). The full run is::

    RECONCILER_STATEMACHINE_EXAMPLES=10000 python -m pytest tests/statemachine

and prints a progress bar of the examples run at least every 10 s (past pytest's capture).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from models import (
    JobArtifact,
    JobAttempt,
    JobRun,
    OperatorAction,
    ReconcilerLease,
    ReconciliationDecision,
    ReconciliationPass,
    StepRun,
    WorkerSession,
)
from reconciler.config.settings import Settings
from reconciler.core.decisions import Thresholds
from reconciler.core.passes import PassConfig, PassReport, run_pass
from reconciler.core.vocabulary import OperatorAction as Act
from reconciler.sidecar.service import LEADER_LEASE_NAME
from reconciler.storage.claims import StepNotStartedError
from reconciler.storage.desks import NativeDesk
from reconciler.storage.operator import NATIVE
from reconciler.storage.sql_store import SqlStore
from reconciler.worker import Claim, JobClient, LeaseLost, Step
from tests.progress import Progress
from tests.statemachine.harness import DATABASE, DbClock, Window, rows, snapshot

EXAMPLES = int(os.environ.get("RECONCILER_STATEMACHINE_EXAMPLES", "60"))
STEPS_PER_EXAMPLE = int(os.environ.get("RECONCILER_STATEMACHINE_STEPS", "40"))
MARIADB_EXAMPLES = int(os.environ.get("RECONCILER_STATEMACHINE_MARIADB_EXAMPLES",
                                      str(max(1, EXAMPLES // 3))))

JOBS = cast(sa.Table, JobRun.__table__)
STEP_RUNS = cast(sa.Table, StepRun.__table__)
ATTEMPTS = cast(sa.Table, JobAttempt.__table__)
DECISIONS = cast(sa.Table, ReconciliationDecision.__table__)
PASSES = cast(sa.Table, ReconciliationPass.__table__)
LEASES = cast(sa.Table, ReconcilerLease.__table__)
SESSIONS = cast(sa.Table, WorkerSession.__table__)
ARTIFACTS = cast(sa.Table, JobArtifact.__table__)
ACTIONS = cast(sa.Table, OperatorAction.__table__)

EFFECT_KINDS = ("pure", "idempotent", "effectful")
STATUSES = frozenset({"queued", "processing", "waiting", "completed", "failed", "cancelled"})
TERMINAL = frozenset({"completed", "failed", "cancelled"})
IDEMPOTENCY_KEYS = ("order-1", "order-2", "order-3")
WORKERS = ("w1", "w2")
ERROR_CODES = ("boom", "timeout")
ARTIFACT_NAMES = ("report.pdf", "summary.csv")
ACTORS = ("alice", "bob")
NOTES = st.none() | st.sampled_from(("refund checked", "<b>not charged</b>"))
BULK_REASONS = ("worker_died_mid_step", "resume_exhausted", "crash_loop", "operator_hold")

LEASE_SECONDS = 10.0
STALE_AFTER_SECONDS = 5.0
WEDGED_AFTER_SECONDS = 60.0
LEADER_LEASE_SECONDS = 90.0
SESSION_TIMEOUT_SECONDS = 30.0
BACKOFF_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 8.0
CRASH_LOOP_AFTER = 2
THRESHOLDS = Thresholds(STALE_AFTER_SECONDS, WEDGED_AFTER_SECONDS, CRASH_LOOP_AFTER)
BACKOFF_DELAYS = tuple(min(BACKOFF_SECONDS * 2 ** n, BACKOFF_MAX_SECONDS) for n in range(4))

PLANS = st.lists(st.sampled_from(EFFECT_KINDS), min_size=1, max_size=3)
KEYS = st.none() | st.sampled_from(IDEMPOTENCY_KEYS)
BUDGETS = st.integers(1, 3)
DURATIONS = (st.sampled_from((1.0, 3.0, 5.0, 10.0, 30.0, 61.0))
             | st.integers(1, 24).map(lambda halves: halves / 2)
             | st.integers(1, 240).map(lambda halves: halves / 2))
"""Seconds, 0.5 s to 120 s on the clock's half-second grid."""

Outcome = tuple[str, str, int | None] | None
"""A pass's verdict on one job: (disposition, reason, resume index), or None (not seen)."""
FENCE_LOST: Outcome = ("skip", "fence_lost", None)


@dataclass
class StepModel:
    """The expected ``step_runs`` row of one step."""

    state: str
    generation: int
    retryable: bool | None = None
    error_code: str | None = None


@dataclass
class AttemptModel:
    """The expected ``job_attempts`` row of one claim."""

    number: int
    outcome: str | None = None
    ended_by: str | None = None


@dataclass
class JobModel:
    """The expected ``job_runs`` row of one job, and what the invariants remember of it."""

    job_id: int
    plan: tuple[str, ...]
    max_attempts: int
    key: str | None
    available_at: datetime
    status: str = "queued"
    reason: str | None = None
    generation: int = 0
    attempts: int = 0
    resume_at: int = 0
    hold: bool = False
    lease_expires_at: datetime | None = None
    last_activity_at: datetime | None = None
    session_id: int | None = None
    last_error: str | None = None
    steps: dict[int, StepModel] = field(default_factory=dict)
    attempt_rows: dict[int, AttemptModel] = field(default_factory=dict)
    artifacts: dict[tuple[int, str], str] = field(default_factory=dict)
    requeued: list[tuple[int, str]] = field(default_factory=list)
    """(generation that ended, by whom) for every requeue: worker, operator, reconciler."""
    died_mid_step: bool = False
    parked: bool = False
    """Recorded held or gated by a pass: out of the scans until a write about the job."""

    def first_unfinished(self) -> int | None:
        """The first step that has not succeeded, or None when all have."""
        return next((i for i in range(len(self.plan))
                     if (s := self.steps.get(i)) is None or s.state != "succeeded"), None)

    def lost_in_a_row(self) -> int:
        """Attempts lost in a row, newest first: the open one, then each earlier one (by its
        number, one less each time) the reconciler ended lost. An operator's retry restarts
        the numbering, which ends the count."""
        newest = [self.attempt_rows[g] for g in sorted(self.attempt_rows, reverse=True)]
        if not newest or newest[0].outcome is not None:
            return 0
        count, number = 1, newest[0].number
        for earlier in newest[1:]:
            if (earlier.number, earlier.outcome, earlier.ended_by) != (
                    number - 1, "lost", "reconciler"):
                break
            count, number = count + 1, earlier.number
        return count

    def requeue_index(self) -> int:
        """Where a requeued attempt starts: the first unfinished step (or past the end)."""
        first = self.first_unfinished()
        return len(self.plan) if first is None else first


@dataclass
class ClaimRef:
    """What the machine knows about one claim object its (living) worker holds."""

    claim: Claim
    job_id: int
    generation: int
    cursor: int
    """The step this worker works on next: it goes through the plan in order."""


@dataclass
class SessionModel:
    """The expected ``worker_sessions`` row."""

    session_id: int
    worker: str
    heartbeat_at: datetime
    stop_reason: str | None = None


@dataclass
class LeaderModel:
    """The expected ``reconciler_leases`` row."""

    holder: str
    token: int
    expires_at: datetime


class StoreMachine(RuleBasedStateMachine):
    """Workers, producers, operators and the reconciler against one real SQLite database."""

    jobs = Bundle("jobs")
    claims = Bundle("claims")

    def __init__(self) -> None:
        super().__init__()
        self.clock = DbClock()
        self.folder = Path(tempfile.mkdtemp(prefix="store-machine-"))
        self.engine = DATABASE.engine(self.folder)
        self.client = JobClient(self.engine, settings=Settings(
            retry_backoff_seconds=BACKOFF_SECONDS,
            retry_backoff_max_seconds=BACKOFF_MAX_SECONDS))
        self.store: SqlStore = self.client.store
        self.desk = NativeDesk(self.engine, self.store)
        self.model: dict[int, JobModel] = {}
        self.keys: dict[str, int] = {}
        self.refs: dict[int, ClaimRef] = {}
        self.sessions: dict[int, SessionModel] = {}
        self.worker_session: dict[str, int] = {}
        self.leader: LeaderModel | None = None
        # (job, reason, generation) of every skip on record: the audit writes each once.
        self.recorded_skips: set[tuple[int, str, int | None]] = set()
        self.seen_generation: dict[int, int] = {}
        self.completed: dict[int, tuple[int, Any]] = {}

    progress: Progress | None = None
    """Set by the test's fixture for long runs; counts examples as they end."""
    examples_run = 0

    def teardown(self) -> None:
        self.clock.reset()
        self.client.close()
        self.engine.dispose()
        shutil.rmtree(self.folder, ignore_errors=True)
        StoreMachine.examples_run += 1
        if StoreMachine.progress is not None:
            StoreMachine.progress.advance(StoreMachine.examples_run)

    # -- helpers ----------------------------------------------------------------------------

    def _call(self, fn: Any, *args: Any, **kwargs: Any
              ) -> tuple[Any, BaseException | None, Window]:
        def attempt() -> tuple[Any, BaseException | None]:
            try:
                return fn(*args, **kwargs), None
            except (LeaseLost, StepNotStartedError) as exc:
                return None, exc

        (result, error), window = self.clock.bracket(attempt, self._boundaries())
        return result, error, window

    def _boundaries(self) -> set[int]:
        """Every grid instant at which some comparison the store makes changes its answer."""
        instants: list[datetime] = []
        for job in self.model.values():
            if job.status == "queued":
                # Also every instant from which a retry's backoff would land on it: two jobs
                # available at one instant would be claimed in an order set by milliseconds.
                instants += [job.available_at - timedelta(seconds=delay)
                             for delay in (0.0, *BACKOFF_DELAYS)]
            elif job.status == "processing":
                assert job.lease_expires_at is not None
                assert job.last_activity_at is not None
                instants += [job.lease_expires_at,
                             job.last_activity_at + timedelta(seconds=STALE_AFTER_SECONDS),
                             job.last_activity_at + timedelta(seconds=WEDGED_AFTER_SECONDS)]
        instants += [s.heartbeat_at + timedelta(seconds=SESSION_TIMEOUT_SECONDS)
                     for s in self.sessions.values() if s.stop_reason is None]
        if self.leader is not None:
            instants.append(self.leader.expires_at)
        return {self.clock.tick_of(instant) for instant in instants}

    def _job_row(self, job_id: int) -> dict[str, Any]:
        [row] = rows(self.engine, JOBS, JOBS.c.job_id == job_id)
        return row

    def _adopt(self, job: JobModel, window: Window, **moved: float | None) -> None:
        """Check the job's timestamps that moved lie in ``window`` (+offset) and adopt them.

        ``None`` means the column was cleared.
        """
        row = self._job_row(job.job_id)
        for column, offset in moved.items():
            if offset is None:
                assert row[column] is None, f"job {job.job_id}: {column} not cleared"
            else:
                assert window.contains(row[column], offset), (
                    f"job {job.job_id}: {column}={row[column]} outside the call's window "
                    f"{window} + {offset}s")
            setattr(job, column, row[column])

    def _current(self, ref: ClaimRef) -> bool:
        job = self.model[ref.job_id]
        return job.status == "processing" and job.generation == ref.generation

    def _session_gone(self, job: JobModel) -> bool:
        if job.session_id is None:
            return False
        return self.sessions[job.session_id].stop_reason is not None

    def _end_attempt(self, job: JobModel, outcome: str, by: str) -> None:
        attempt = job.attempt_rows[job.generation]
        assert attempt.outcome is None, f"job {job.job_id}: attempt ended twice"
        attempt.outcome, attempt.ended_by = outcome, by

    def _stale_refs(self) -> list[ClaimRef]:
        return sorted((r for r in self.refs.values() if not self._current(r)),
                      key=lambda r: (r.job_id, r.generation))

    def _write(self, claim: Claim, method: str, *args: Any,
               step_not_started: bool = False, **kwargs: Any) -> tuple[Any, Window] | None:
        """Call a fenced write; None when it was (correctly) refused and changed nothing."""
        ref = self.refs[id(claim)]
        job = self.model[ref.job_id]
        fenced_out = not self._current(ref) or (method == "heartbeat"
                                                and self._session_gone(job))
        before = snapshot(self.engine) if fenced_out or step_not_started else None
        result, error, window = self._call(getattr(claim, method), *args, **kwargs)
        if fenced_out:
            event(f"write refused: {method}")
            assert isinstance(error, LeaseLost), (
                f"{method} through a superseded claim of job {ref.job_id} (generation "
                f"{ref.generation}, job at {job.generation}, {job.status}) was not refused: "
                f"{error!r}")
            assert claim.lease_lost.is_set()
            assert snapshot(self.engine) == before, f"a refused {method} changed the database"
            return None
        if step_not_started:
            event("finish_step of a step not started: refused")
            assert isinstance(error, StepNotStartedError), f"finish_step gave {error!r}"
            assert snapshot(self.engine) == before, "a refused finish_step changed the database"
            return None
        assert error is None, f"{method} through the current claim raised {error!r}"
        event(f"write: {method}")
        job.parked = False  # any write of the job's worker may have opened its gate
        return result, window

    def _expire_session_claims(self, session_id: int, window: Window) -> None:
        """A session ended: its processing jobs' live leases were cut to now."""
        for job in self.model.values():
            if job.status == "processing" and job.session_id == session_id:
                assert job.lease_expires_at is not None
                before = job.lease_expires_at
                row = self._job_row(job.job_id)
                live = {not r for r in window.reached(before)}
                if row["lease_expires_at"] == before:
                    assert False in live, f"job {job.job_id}: live lease of a gone session kept"
                else:
                    assert True in live, f"job {job.job_id}: expired lease moved"
                    assert window.contains(row["lease_expires_at"]), (
                        f"job {job.job_id}: lease moved to {row['lease_expires_at']}")
                job.lease_expires_at = row["lease_expires_at"]

    # -- producers --------------------------------------------------------------------------

    @initialize(target=jobs, kinds=PLANS, key=KEYS, max_attempts=BUDGETS)
    def first_job(self, kinds: list[str], key: str | None, max_attempts: int) -> int:
        """Every run starts with work to do."""
        return self._enqueue(kinds, key, max_attempts)

    @initialize(target=claims, kinds=PLANS, max_attempts=BUDGETS)
    def first_claim(self, kinds: list[str], max_attempts: int) -> Any:
        """...and a worker already at work on something."""
        self._enqueue(kinds, None, max_attempts)
        return self.claim("w1", with_session=False)

    @rule(target=jobs, kinds=PLANS, key=KEYS, max_attempts=BUDGETS)
    def enqueue(self, kinds: list[str], key: str | None, max_attempts: int) -> int:
        """A producer queues a job (a known idempotency key gives back the same job)."""
        return self._enqueue(kinds, key, max_attempts)

    def _enqueue(self, kinds: list[str], key: str | None, max_attempts: int) -> int:
        plan = [Step(f"step{i}", kind) for i, kind in enumerate(kinds)]
        known = key is not None and key in self.keys
        before = snapshot(self.engine) if known else None
        job_id, _, window = self._call(self.client.enqueue, "report", plan,
                                       idempotency_key=key, max_attempts=max_attempts,
                                       payload={"secret": "never shown"})
        if known:
            assert key is not None
            assert job_id == self.keys[key], "an idempotency key named a second job"
            assert snapshot(self.engine) == before, "a repeated enqueue changed the database"
            return int(job_id)
        assert job_id not in self.model
        row = self._job_row(job_id)
        assert window.contains(row["available_at"])
        self.model[job_id] = JobModel(job_id, tuple(kinds), max_attempts, key,
                                      row["available_at"])
        if key is not None:
            self.keys[key] = job_id
        return int(job_id)

    # -- workers ----------------------------------------------------------------------------

    def _claimable(self, job: JobModel, window: Window) -> set[bool]:
        if job.status != "queued" or job.hold:
            return {False}
        return window.reached(job.available_at)

    @rule(target=claims, worker=st.sampled_from(WORKERS), with_session=st.booleans())
    def claim(self, worker: str, with_session: bool) -> Any:
        session_id = self.worker_session.get(worker) if with_session else None
        # A session already gone claims nothing (test_regressions.py keeps the case that
        # found it): its lease could never be renewed, nor would a pass take it back early.
        gone = session_id is not None and self.sessions[session_id].stop_reason is not None
        before = snapshot(self.engine) if gone else None
        claim, _, window = self._call(self.client.claim, worker, LEASE_SECONDS,
                                      session_id=session_id)
        ordered = sorted(self.model.values(), key=lambda j: (j.available_at, j.job_id))
        if gone:
            assert claim is None, f"a gone worker session took job {claim.job_id}"
            assert snapshot(self.engine) == before, "a refused claim changed the database"
            event("claim: refused to a gone session")
            return multiple()
        instants = Counter(self.clock.tick_of(at) for at in {
            j.available_at for j in ordered if self._claimable(j, window) == {True}})
        if any(n > 1 for n in instants.values()):
            event("claim: jobs available at one instant, milliseconds apart")
        if claim is None:
            for job in ordered:
                assert self._claimable(job, window) != {True}, (
                    f"job {job.job_id} was claimable but claim returned None")
            event("claim: nothing available")
            return multiple()
        event("claim: got a job")
        job = self.model[claim.job_id]
        assert True in self._claimable(job, window), f"claimed unclaimable job {job.job_id}"
        for other in ordered:
            if other is job:
                break
            assert self._claimable(other, window) != {True}, (
                f"claimed job {job.job_id} before the older available job {other.job_id}")
        assert not job.died_mid_step, (
            f"job {job.job_id} was claimed again after worker_died_mid_step")
        job.status, job.reason = "processing", None
        job.generation += 1
        job.attempts += 1
        job.session_id = session_id
        assert claim.generation == job.generation
        assert claim.attempt == job.attempts <= job.max_attempts == claim.max_attempts, (
            f"job {job.job_id}: attempt {claim.attempt} of {claim.max_attempts}")
        assert claim.next_step_index == job.resume_at
        assert tuple(s.kind.value for s in claim.steps) == job.plan
        job.attempt_rows[job.generation] = AttemptModel(job.attempts)
        self._adopt(job, window, lease_expires_at=LEASE_SECONDS, last_activity_at=0.0)
        self.refs[id(claim)] = ClaimRef(claim, job.job_id, job.generation,
                                        claim.next_step_index)
        return claim

    @rule(claim=claims)
    def heartbeat(self, claim: Claim) -> None:
        """The claim's heartbeat thread renews its lease (and only its lease)."""
        done = self._write(claim, "heartbeat")
        if done is not None:
            job = self.model[self.refs[id(claim)].job_id]
            self._adopt(job, done[1], lease_expires_at=LEASE_SECONDS)

    @rule(claim=claims)
    def report_progress(self, claim: Claim) -> None:
        done = self._write(claim, "report_progress")
        if done is not None:
            job = self.model[self.refs[id(claim)].job_id]
            self._adopt(job, done[1], last_activity_at=0.0)

    @rule(claim=claims)
    def start_step(self, claim: Claim) -> None:
        ref = self.refs[id(claim)]
        job = self.model[ref.job_id]
        if ref.cursor >= len(job.plan):
            return
        index = ref.cursor
        prior = job.steps.get(index)
        done = self._write(claim, "start_step", index)
        if done is None:
            return
        if (job.plan[index] == "effectful" and prior is not None and prior.state == "started"
                and prior.generation < ref.generation):
            assert any(generation >= prior.generation and by != "reconciler"
                       for generation, by in job.requeued), (
                f"job {job.job_id}: effectful step {index}, started by generation "
                f"{prior.generation} and never finished, was run again by generation "
                f"{ref.generation} after the reconciler requeued the job")
        job.steps[index] = StepModel("started", ref.generation)
        self._adopt(job, done[1], last_activity_at=0.0)

    @rule(claim=claims)
    def finish_step(self, claim: Claim) -> None:
        ref = self.refs[id(claim)]
        job = self.model[ref.job_id]
        if ref.cursor >= len(job.plan):
            return
        index = ref.cursor
        prior = job.steps.get(index)
        started = (prior is not None and prior.state in ("started", "waiting")
                   and prior.generation == ref.generation)
        done = self._write(claim, "finish_step", index, step_not_started=not started)
        if done is None:
            return
        job.steps[index] = StepModel("succeeded", ref.generation)
        ref.cursor += 1
        self._adopt(job, done[1], last_activity_at=0.0)

    @rule(claim=claims, steps=st.integers(0, 3), leave_in_flight=st.booleans())
    def work(self, claim: Claim, steps: int, leave_in_flight: bool) -> None:
        """The worker's loop: run up to ``steps`` steps in order, maybe leave one running."""
        for _ in range(steps):
            if not self._current(self.refs[id(claim)]):
                break
            self.start_step(claim)
            self.finish_step(claim)
        if leave_in_flight:
            self.start_step(claim)

    @rule(claim=claims, retryable=st.booleans(), code=st.sampled_from(ERROR_CODES))
    def fail_step(self, claim: Claim, retryable: bool, code: str) -> None:
        ref = self.refs[id(claim)]
        job = self.model[ref.job_id]
        if ref.cursor >= len(job.plan):
            return
        done = self._write(claim, "fail_step", ref.cursor, code, retryable=retryable)
        if done is None:
            return
        job.steps[ref.cursor] = StepModel("failed", ref.generation, retryable, code)
        self._adopt(job, done[1], last_activity_at=0.0)

    @rule(claim=claims)
    def wait_step(self, claim: Claim) -> None:
        ref = self.refs[id(claim)]
        job = self.model[ref.job_id]
        if ref.cursor >= len(job.plan):
            return
        done = self._write(claim, "wait_step", ref.cursor)
        if done is None:
            return
        job.steps[ref.cursor] = StepModel("waiting", ref.generation)
        self._adopt(job, done[1], last_activity_at=0.0)

    @rule(claim=claims, name=st.sampled_from(ARTIFACT_NAMES))
    def stage_artifact(self, claim: Claim, name: str) -> None:
        done = self._write(claim, "stage_artifact", name)
        if done is None:
            return
        ref = self.refs[id(claim)]
        job = self.model[ref.job_id]
        assert done[0] is None  # Claim.stage_artifact returns nothing
        job.artifacts[(ref.generation, name)] = "staged"
        self._adopt(job, done[1], last_activity_at=0.0)

    @rule(claim=claims)
    def complete(self, claim: Claim) -> None:
        done = self._write(claim, "complete")
        if done is None:
            return
        ref = self.refs[id(claim)]
        job = self.model[ref.job_id]
        assert done[0] == ref.generation
        job.status, job.reason = "completed", None
        for (generation, name), state in list(job.artifacts.items()):
            if generation == ref.generation and state == "staged":
                job.artifacts[(generation, name)] = "published"
        self._end_attempt(job, "completed", "worker")
        self._adopt(job, done[1], lease_expires_at=None, last_activity_at=0.0)

    @rule(claim=claims, retryable=st.booleans(), code=st.sampled_from(ERROR_CODES))
    def fail(self, claim: Claim, retryable: bool, code: str) -> None:
        done = self._write(claim, "fail", code, retryable=retryable)
        if done is None:
            return
        requeued, window = done
        ref = self.refs[id(claim)]
        job = self.model[ref.job_id]
        expected = retryable and job.attempts < job.max_attempts
        assert requeued == expected, f"fail(retryable={retryable}) requeued={requeued}"
        job.last_error = code
        if expected:
            delay = min(BACKOFF_SECONDS * 2 ** max(job.attempts - 1, 0), BACKOFF_MAX_SECONDS)
            job.status, job.reason = "queued", None
            job.resume_at = job.requeue_index()
            job.requeued.append((job.generation, "worker"))
            self._end_attempt(job, "retrying", "worker")
            self._adopt(job, window, available_at=delay, lease_expires_at=None)
        else:
            job.status = "failed"
            job.reason = "retries_exhausted" if retryable else "job_failed"
            self._end_attempt(job, "failed", "worker")
            self._adopt(job, window, lease_expires_at=None)

    @rule(claim=claims)
    def release(self, claim: Claim) -> None:
        done = self._write(claim, "release")
        if done is None:
            return
        job = self.model[self.refs[id(claim)].job_id]
        job.status, job.reason = "queued", None
        job.attempts -= 1
        job.resume_at = job.requeue_index()
        job.requeued.append((job.generation, "worker"))
        self._end_attempt(job, "released", "worker")
        self._adopt(job, done[1], available_at=0.0, lease_expires_at=None)

    @rule(claim=consumes(claims))
    def crash(self, claim: Claim) -> None:
        """The worker process died: its claim object is gone and nothing was written."""
        del self.refs[id(claim)]

    @rule(claim=consumes(claims))
    def die_mid_step(self, claim: Claim) -> None:
        """The worker starts its next step, and its process dies inside it."""
        self.start_step(claim)
        self.crash(claim)

    @precondition(lambda self: bool(self._stale_refs()))
    @rule(data=st.data(), method=st.sampled_from((
        "heartbeat", "report_progress", "start_step", "finish_step", "fail_step",
        "wait_step", "stage_artifact", "complete", "fail", "release")))
    def stale_write(self, data: st.DataObject, method: str) -> None:
        """A slow worker writes through a claim that was superseded: refused, no change."""
        ref = data.draw(st.sampled_from(self._stale_refs()), label="superseded claim")
        args: tuple[Any, ...] = {
            "start_step": (0,), "finish_step": (0,), "fail_step": (0, "late"),
            "wait_step": (0,), "stage_artifact": ("late.bin",), "fail": ("late",),
        }.get(method, ())
        self._write(ref.claim, method, *args)

    # -- worker sessions --------------------------------------------------------------------

    @rule(worker=st.sampled_from(WORKERS))
    def register_session(self, worker: str) -> None:
        """A worker process starts (or restarts, replacing its previous session)."""
        session_id, _, window = self._call(self.store.register_session, worker, "host-a", 4242)
        for session in self.sessions.values():
            if session.worker == worker and session.stop_reason is None:
                session.stop_reason = "replaced"
                self._expire_session_claims(session.session_id, window)
        [row] = rows(self.engine, SESSIONS, SESSIONS.c.session_id == session_id)
        assert window.contains(row["heartbeat_at"])
        self.sessions[session_id] = SessionModel(session_id, worker, row["heartbeat_at"])
        self.worker_session[worker] = session_id

    @precondition(lambda self: bool(self.worker_session))
    @rule(data=st.data())
    def heartbeat_session(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from(sorted(self.worker_session)), label="worker")
        session = self.sessions[self.worker_session[worker]]
        alive, _, window = self._call(self.store.heartbeat_session, session.session_id)
        assert alive == (session.stop_reason is None)
        if alive:
            [row] = rows(self.engine, SESSIONS, SESSIONS.c.session_id == session.session_id)
            assert window.contains(row["heartbeat_at"])
            session.heartbeat_at = row["heartbeat_at"]

    @precondition(lambda self: bool(self.worker_session))
    @rule(data=st.data())
    def stop_session(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from(sorted(self.worker_session)), label="worker")
        session = self.sessions[self.worker_session[worker]]
        _, _, window = self._call(self.store.stop_session, session.session_id)
        if session.stop_reason is None:
            session.stop_reason = "stopped"
        self._expire_session_claims(session.session_id, window)

    # -- operators --------------------------------------------------------------------------

    @rule(job_id=jobs, action=st.sampled_from(tuple(Act)),
          actor=st.sampled_from(ACTORS), note=NOTES)
    def operator(self, job_id: int, action: Act, actor: str,
                 note: str | None) -> None:
        self._act(job_id, action, actor, note)

    @rule(action=st.sampled_from((Act.RETRY, Act.CANCEL)),
          reason=st.none() | st.sampled_from(BULK_REASONS), limit=st.integers(1, 3),
          actor=st.sampled_from(ACTORS))
    def operator_bulk(self, action: Act, reason: str | None, limit: int,
                      actor: str) -> None:
        """The bulk form: the jobs whose latest decision matches, whose state allows the
        action now, newest decision first, capped; then each acted on, fenced, alone."""
        (targets, _, _) = self._call(self.desk.bulk_targets, action, reason=reason,
                                     kind=None, since=None, limit=limit)
        latest: dict[int, tuple[int, str]] = {}
        for d in rows(self.engine, DECISIONS, DECISIONS.c.shadow_mode == sa.false()):
            latest[int(d["job_id"])] = (int(d["decision_id"]), d["decision_reason"])
        matching = sorted((j for j, (_, r) in latest.items() if reason in (None, r)),
                          key=lambda j: latest[j][0], reverse=True)
        expected = [str(j) for j in matching
                    if self._refusal(self.model[j], action) is None][:limit]
        assert targets == expected, f"bulk {action} over {reason}: {targets} != {expected}"
        event(f"bulk {action}: {len(targets)} jobs")
        for key in targets:
            self._act(int(key), action, actor, "bulk")

    def _refusal(self, job: JobModel, action: Act) -> str | None:
        """What the operator state machine refuses ``action`` on ``job`` for, or None."""
        if action is Act.UNHOLD:  # a hold is lifted as long as it exists, ended or not
            return None if job.hold else "not_held"
        if action is Act.HOLD:
            if job.status in TERMINAL:
                return "job_terminal"
            return "already_held" if job.hold else None
        if action is Act.RETRY:
            return (None if job.status in ("failed", "cancelled")
                    else "job_not_failed_or_cancelled")
        return "job_terminal" if job.status in TERMINAL else None

    def _act(self, job_id: int, action: Act, actor: str, note: str | None) -> None:
        """One action through the native desk, as the CLI and the console take it."""
        job = self.model[job_id]
        status_before, generation_before, held_before = job.status, job.generation, job.hold
        refusal = self._refusal(job, action)
        report, _, window = self._call(self.desk.act, action, str(job_id), actor=actor,
                                       note=note)
        event(f"operator {action}: {'applied' if refusal is None else refusal}")
        assert (report.applied, report.refusal) == (refusal is None, refusal), (
            f"{action} on a {job.status} job: got {report}, expected refusal {refusal}")
        assert report.job_id == str(job_id)
        if refusal is None:
            job.parked = False
            if action in (Act.HOLD, Act.UNHOLD):
                job.hold = action is Act.HOLD
            elif action is Act.RETRY:
                job.status, job.reason = "queued", "operator_retry"
                job.attempts = 0
                job.requeued.append((job.generation, "operator"))
                job.generation += 1
                job.resume_at = job.requeue_index()
                job.died_mid_step = False
                self._adopt(job, window, available_at=0.0)
            else:
                if job.status == "processing":
                    self._end_attempt(job, "lost", "operator")
                job.status, job.reason = "cancelled", "operator_cancel"
                job.generation += 1
                self._adopt(job, window, lease_expires_at=None)
        [*_, last] = rows(self.engine, ACTIONS, ACTIONS.c.job_id == job_id)

        def state(status: str, held: bool) -> str:
            return f"{status} (held)" if held else status

        assert (last["job_source"], last["job_key"], last["acted_by"], last["operator_note"],
                last["operator_action"], last["action_outcome"], last["refusal_reason"],
                last["status_before"], last["status_after"], last["state_before"],
                last["state_after"], last["generation_before"],
                last["generation_after"]) == (
            NATIVE, str(job_id), actor, note, action.value,
            "applied" if refusal is None else "refused", refusal, status_before, job.status,
            state(status_before, held_before), state(job.status, job.hold),
            generation_before, job.generation), f"the record of {action} on job {job_id}"

    # -- the reconciler ---------------------------------------------------------------------

    def _decide(self, job: JobModel, live: bool, wedged_age: bool, recent: bool,
                gone: bool) -> Outcome:
        """The decision table (docs/decision-table.md), written again from the contract."""
        if job.hold:
            return ("skip", "operator_hold", None)
        if live and not gone and wedged_age:
            return ("terminalize", "worker_wedged", None)
        if live and not gone:
            return ("skip", "lease_live", None)
        if recent and not gone:
            return ("skip", "recent_activity", None)
        index = job.first_unfinished()
        record = None if index is None else job.steps.get(index)
        if record is not None and record.state == "waiting":
            return ("skip", "waiting_on_gate", None)
        if index is None:
            # The native source records the completion itself when that generation's
            # artifacts are all still staged (a status flip plus publishing them).
            recoverable = all(state == "staged" for (generation, _), state
                              in job.artifacts.items() if generation == job.generation)
            return ("terminalize", "completion_recovered" if recoverable
                    else "completion_unrecorded", None)
        if record is not None and record.state == "failed" and not record.retryable:
            return ("terminalize", "step_failed", None)
        if record is not None and record.state == "started" and job.plan[index] == "effectful":
            return ("terminalize", "worker_died_mid_step", None)
        if job.lost_in_a_row() >= CRASH_LOOP_AFTER:
            return ("terminalize", "crash_loop", None)
        if job.attempts >= job.max_attempts:
            return ("terminalize", "resume_exhausted", None)
        if record is not None and record.state == "started":
            return ("resume", "resumed_idempotent_step", index)
        return ("resume", "resumed_from_unstarted_step", index)

    def _pass_outcomes(self, job: JobModel, window: Window, gone: bool, cut: bool,
                       apply: bool) -> set[Outcome]:
        """Every verdict the contract allows a pass in ``window`` to reach on ``job``.

        ``cut``: the job's session was declared gone by this very pass (its lease with it).
        Each time predicate is read afresh by each statement, so each may go either way
        when it is within the window of its boundary.
        """
        assert job.lease_expires_at is not None
        assert job.last_activity_at is not None
        if job.parked:
            return {None}  # held and gated jobs, once recorded, fill no batch
        live = {False} if cut else {not r for r in window.reached(job.lease_expires_at)}
        wedged = window.reached(job.last_activity_at + timedelta(seconds=WEDGED_AFTER_SECONDS))
        recent = {not r for r in window.reached(
            job.last_activity_at + timedelta(seconds=STALE_AFTER_SECONDS))}
        outcomes: set[Outcome] = set()
        combos = [(lv, wd, rc) for lv in live for wd in wedged for rc in recent
                  if not (wd and rc)]  # stale_after < wedged_after: never both
        # Candidates are expired leases, gone sessions, and live leases
        # without activity for wedged_after.
        if any(lv and not wd and not gone for lv, wd, _ in combos):
            outcomes.add(None)
        if not any((not lv) or wd or gone for lv, wd, _ in combos):
            return outcomes
        for lv, wd, rc in combos:
            verdict = self._decide(job, lv, wd, rc, gone)
            assert verdict is not None
            if not apply or verdict[0] == "skip":
                outcomes.add(verdict)
                continue
            # The compare-and-swap repeats the rule's time predicate at its own instant.
            if verdict[1] == "worker_wedged":
                holds = wedged
            else:
                holds = {(not lv2) and ((not rc2) or gone) for lv2, _, rc2 in combos}
            outcomes |= {verdict if ok else FENCE_LOST for ok in holds}
        return outcomes

    def _check_verdicts(self, report: PassReport, window: Window, *, batch_size: int,
                        gone: dict[int, bool], cut: set[int], apply: bool) -> None:
        processing = {j.job_id: j for j in self.model.values() if j.status == "processing"}
        decided = {d.job_id: d for d in report.decisions}
        assert len(decided) == len(report.decisions), "a pass decided one job twice"
        assert len(decided) <= batch_size
        for job_id in decided:
            assert job_id in processing, f"a pass decided on job {job_id}, not processing"
        full = len(decided) == batch_size
        for job_id, job in processing.items():
            assert job.lease_expires_at is not None
            assert job.last_activity_at is not None
            if (job.lease_expires_at > window.hi and not gone[job_id] and job_id not in cut
                    and job.last_activity_at + timedelta(seconds=WEDGED_AFTER_SECONDS)
                    > window.hi):
                assert job_id not in decided, (
                    f"a pass touched job {job_id}, whose lease is live and activity recent")
            allowed = self._pass_outcomes(job, window, gone[job_id], job_id in cut, apply)
            d = decided.get(job_id)
            actual: Outcome = None if d is None else (
                d.disposition.value, d.reason.value, d.resume_step_index)
            if actual is None:
                assert None in allowed or full, (
                    f"job {job_id} should have been a candidate: {sorted(map(str, allowed))}")
                continue
            assert actual in allowed, (
                f"job {job_id}: the pass decided {actual}; the contract allows "
                f"{sorted(map(str, allowed))}")
            assert d is not None
            assert d.generation_before == job.generation
        expected = self._selection(processing, window, batch_size, cut)
        if expected is not None:
            assert [d.job_id for d in report.decisions] == expected, (
                "the pass did not take the oldest expired leases first, then the longest "
                f"silent live ones: {[d.job_id for d in report.decisions]} != {expected}")

    def _selection(self, processing: dict[int, JobModel], window: Window, batch_size: int,
                   cut: set[int]) -> list[int] | None:
        """The candidates a pass must take, in order; None when a time is too close to call.

        Expired leases by (expiry, job), then live leases silent for ``wedged_after`` by
        (activity, job), ``batch_size`` in all. A job whose lease was live and active is
        never among them.
        """
        if cut:
            return None
        expired: list[tuple[datetime, int]] = []
        silent: list[tuple[datetime, int]] = []
        for job in processing.values():
            assert job.lease_expires_at is not None
            assert job.last_activity_at is not None
            if job.parked:
                continue
            live = {not r for r in window.reached(job.lease_expires_at)}
            old = window.reached(job.last_activity_at
                                 + timedelta(seconds=WEDGED_AFTER_SECONDS))
            if len(live) > 1 or len(old) > 1:
                return None
            if live == {False}:
                expired.append((job.lease_expires_at, job.job_id))
            elif old == {True}:
                silent.append((job.last_activity_at, job.job_id))
        chosen = [job_id for _, job_id in sorted(expired)[:batch_size]]
        return chosen + [job_id for _, job_id in sorted(silent)[:batch_size - len(chosen)]]

    @rule(instance=st.sampled_from(("r1", "r2")), batch_size=st.sampled_from((1, 2, 50)))
    def reconcile(self, instance: str = "solo", batch_size: int = 50) -> None:
        """One pass by one of two replicas; no replica waits for a leader."""
        config = PassConfig(batch_size=batch_size, thresholds=THRESHOLDS, instance=instance,
                            session_timeout_seconds=SESSION_TIMEOUT_SECONDS)
        report, _, window = self._call(run_pass, self.store, config)
        assert isinstance(report, PassReport)
        assert report.outcome.value == "ok"
        cut = self._sessions_ended_by(window)
        gone = {j.job_id: self._session_gone(j) for j in self.model.values()}
        self._check_verdicts(report, window, batch_size=batch_size, gone=gone, cut=cut,
                             apply=True)
        self._check_pass_records(report)
        self._apply_verdicts(report, window, cut)

    @rule(instance=st.sampled_from(("r1", "r2")), release_after=st.booleans())
    def lead(self, instance: str, release_after: bool) -> None:
        """The chores' leader lease: taken, renewed or refused, and maybe given up."""
        before = snapshot(self.engine)
        token, _, window = self._call(self.store.try_lead, LEADER_LEASE_NAME, instance,
                                      LEADER_LEASE_SECONDS)
        if self.leader is None or self.leader.holder == instance:
            may_lead = {True}
        else:
            may_lead = window.reached(self.leader.expires_at)
        if token is None:
            assert False in may_lead, f"{instance} was refused a lease it could take"
            assert snapshot(self.engine) == before, "a refused lease changed something"
            return
        assert True in may_lead, f"{instance} led while {self.leader} held a live lease"
        expected = 1 if self.leader is None else (
            self.leader.token + (self.leader.holder != instance))
        [lease] = rows(self.engine, LEASES, LEASES.c.lease_name == LEADER_LEASE_NAME)
        assert (token, lease["holder_id"], lease["fencing_token"]) == (
            expected, instance, expected)
        assert window.contains(lease["lease_expires_at"], LEADER_LEASE_SECONDS)
        if release_after:
            _, _, window = self._call(self.store.release_leadership, LEADER_LEASE_NAME,
                                      instance)
            [lease] = rows(self.engine, LEASES, LEASES.c.lease_name == LEADER_LEASE_NAME)
            assert window.contains(lease["lease_expires_at"], 0.0)
        self.leader = LeaderModel(instance, expected, lease["lease_expires_at"])

    def _sessions_ended_by(self, window: Window) -> set[int]:
        """Sessions silent for the timeout were declared gone first; their jobs, cut."""
        cut: set[int] = set()
        for session in self.sessions.values():
            if session.stop_reason is not None:
                continue
            may_end = window.after(-SESSION_TIMEOUT_SECONDS).reached(session.heartbeat_at)
            [row] = rows(self.engine, SESSIONS, SESSIONS.c.session_id == session.session_id)
            ended = row["stopped_at"] is not None
            assert ended in may_end, f"session {session.session_id}: ended={ended}"
            if ended:
                session.stop_reason = "heartbeat_lost"
                cut |= {j.job_id for j in self.model.values()
                        if j.status == "processing" and j.session_id == session.session_id}
        return cut

    def _check_pass_records(self, report: PassReport) -> None:
        """The pass row and its decision rows say exactly what the report says."""
        assert report.pass_id is not None
        [record] = rows(self.engine, PASSES, PASSES.c.pass_id == report.pass_id)
        recorded = rows(self.engine, DECISIONS, DECISIONS.c.pass_id == report.pass_id)
        expected = []
        for d in report.decisions:
            key = (int(d.job_id), d.reason.value, d.generation_before)
            if d.disposition.value == "skip":
                if key in self.recorded_skips:
                    continue  # the same skip at the same generation is on record already
                self.recorded_skips.add(key)
            expected.append((d.job_id, d.disposition.value, d.reason.value,
                             d.generation_before, d.generation_after, d.resume_step_index))
        assert [(int(r["job_id"]), r["disposition"], r["decision_reason"],
                 r["generation_before"], r["generation_after"], r["resume_step_index"])
                for r in recorded] == expected
        counts = Counter(d.disposition.value for d in report.decisions)
        assert (record["pass_outcome"], record["candidates_seen"], record["resumed_count"],
                record["terminalized_count"], record["skipped_count"]) == (
            "ok", len(report.decisions), counts["resume"], counts["terminalize"],
            counts["skip"])

    def _apply_verdicts(self, report: PassReport, window: Window, cut: set[int]) -> None:
        for job_id in cut:
            job = self.model[job_id]
            row = self._job_row(job_id)
            if row["lease_expires_at"] != job.lease_expires_at and row["job_status"] == (
                    "processing"):
                assert window.contains(row["lease_expires_at"])
            job.lease_expires_at = row["lease_expires_at"]
        for d in report.decisions:
            job = self.model[d.job_id]
            event(f"pass: {d.disposition.value} {d.reason.value}")
            if d.disposition.value == "skip":
                assert d.generation_after is None
                job.parked = d.reason.value in ("operator_hold", "waiting_on_gate")
                continue
            assert d.generation_after == job.generation + 1
            job.requeued.append((job.generation, "reconciler"))
            recovered = d.reason.value == "completion_recovered"
            outcome = {"worker_wedged": "abandoned", "completion_recovered": "completed"}
            self._end_attempt(job, outcome.get(d.reason.value, "lost"), "reconciler")
            if recovered:
                for (generation, name), state in list(job.artifacts.items()):
                    if generation == job.generation and state == "staged":
                        job.artifacts[(generation, name)] = "published"
            job.generation += 1
            job.reason = d.reason.value
            if recovered:
                job.status = "completed"
                self._adopt(job, window, lease_expires_at=None)
            elif d.disposition.value == "resume":
                job.status = "queued"
                assert d.resume_step_index is not None
                job.resume_at = d.resume_step_index
                self._adopt(job, window, available_at=0.0, lease_expires_at=None)
            else:
                job.status = "failed"
                job.died_mid_step = d.reason.value == "worker_died_mid_step"
                self._adopt(job, window, lease_expires_at=None)

    @rule(batch_size=st.sampled_from((1, 2, 50)))
    def dry_run(self, batch_size: int) -> None:
        config = PassConfig(batch_size=batch_size, thresholds=THRESHOLDS, instance="preview")
        before = snapshot(self.engine)
        report, _, window = self._call(run_pass, self.store, config, dry_run=True)
        assert snapshot(self.engine) == before, "a dry run wrote to the database"
        assert report.dry_run
        assert report.pass_id is None
        gone = {j.job_id: self._session_gone(j) for j in self.model.values()}
        self._check_verdicts(report, window, batch_size=batch_size, gone=gone, cut=set(),
                             apply=False)

    # -- time -------------------------------------------------------------------------------

    @rule(seconds=DURATIONS)
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(claim=claims, seconds=DURATIONS, progress=st.booleans(), then_pass=st.booleans())
    def worker_alive(self, claim: Claim, seconds: float, progress: bool,
                     then_pass: bool) -> None:
        """Time passes while a living worker's heart beats every few seconds.

        With ``progress`` its handler moves too; without, it hangs (a wedged worker).
        ``then_pass``: the sidecar looks at once.
        """
        remaining = seconds
        while remaining > 0:
            tick = min(remaining, 3.0)
            self.clock.advance(tick)
            remaining -= tick
            self.heartbeat(claim)
            if progress:
                self.report_progress(claim)
        if then_pass:
            self.reconcile()

    @rule(claim=claims, seconds=st.integers(20, 40).map(lambda halves: halves / 2))
    def heart_stops(self, claim: Claim, seconds: float) -> None:
        """The heartbeat thread dies while the handler keeps reporting progress; a pass."""
        remaining = seconds
        while remaining > 0:
            tick = min(remaining, 2.0)
            self.clock.advance(tick)
            remaining -= tick
            self.report_progress(claim)
        self.reconcile()

    @rule(target=claims, claim=claims)
    def taken_over(self, claim: Claim) -> Any:
        """The worker stalls silently past its lease, a pass takes the job back, and
        another worker claims: the stalled claim lives on as a zombie."""
        self.clock.advance(LEASE_SECONDS + STALE_AFTER_SECONDS + 1.0)
        self.reconcile()
        return self.claim("w2", with_session=False)

    @rule(seconds=DURATIONS)
    def sidecar_tick(self, seconds: float) -> None:
        """The sidecar's schedule: time passes, then a pass."""
        self.clock.advance(seconds)
        self.reconcile()

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def database_keeps_its_promises(self) -> None:
        job_rows = {r["job_id"]: r for r in rows(self.engine, JOBS)}
        attempt_rows = rows(self.engine, ATTEMPTS)
        assert set(job_rows) == set(self.model), "a job appeared or vanished"
        keys = Counter(r["idempotency_key"] for r in job_rows.values()
                       if r["idempotency_key"] is not None)
        assert all(n == 1 for n in keys.values()), f"an idempotency key names two jobs: {keys}"
        made_by = self._generation_makers(job_rows, attempt_rows)
        open_attempts: dict[int, list[int]] = {job_id: [] for job_id in job_rows}
        for a in attempt_rows:
            if a["ended_at"] is None:
                open_attempts[a["job_id"]].append(a["claim_generation"])
        for job_id, row in job_rows.items():
            self._job_row_keeps_promises(row, open_attempts[job_id], made_by[job_id])
            self._matches_model(self.model[job_id], row)
        self._children_match_model(job_rows, attempt_rows)
        self._sessions_and_leader_match_model()

    def _generation_makers(self, job_rows: dict[int, dict[str, Any]],
                           attempt_rows: list[dict[str, Any]]) -> dict[int, Counter[int]]:
        """For each job, how many writers claim to have made each generation."""
        made_by: dict[int, Counter[int]] = {job_id: Counter() for job_id in job_rows}
        for a in attempt_rows:
            made_by[a["job_id"]][a["claim_generation"]] += 1
        for act in rows(self.engine, ACTIONS):
            if act["action_outcome"] == "applied" and (
                    act["generation_after"] != act["generation_before"]):
                assert act["generation_after"] == act["generation_before"] + 1
                made_by[act["job_id"]][act["generation_after"]] += 1
        for d in rows(self.engine, DECISIONS):
            if d["disposition"] == "skip":
                assert d["generation_after"] is None, f"skip with a generation: {d}"
            else:
                assert d["generation_after"] == d["generation_before"] + 1, f"decision {d}"
                made_by[int(d["job_id"])][d["generation_after"]] += 1
        return made_by

    def _job_row_keeps_promises(self, row: dict[str, Any], open_attempts: list[int],
                                made_by: Counter[int]) -> None:
        job_id, status, generation = row["job_id"], row["job_status"], row["claim_generation"]
        assert status in STATUSES
        if status == "processing":
            assert None not in (row["lease_token"], row["lease_expires_at"],
                                row["last_activity_at"]), f"job {job_id}: lease missing"
            assert open_attempts == [generation], (
                f"job {job_id}: open attempts {open_attempts} at generation {generation}")
        else:
            assert row["lease_token"] is None, f"job {job_id}: {status} with a lease token"
            assert row["lease_expires_at"] is None, f"job {job_id}: {status} with a lease"
            assert open_attempts == [], f"job {job_id}: {status} with an open attempt"
        assert (row["finished_at"] is not None) == (status in TERMINAL), (
            f"job {job_id}: {status} with finished_at {row['finished_at']}")
        assert 0 <= row["attempt_count"] <= row["max_attempts"], (
            f"job {job_id}: attempts {row['attempt_count']} of {row['max_attempts']}")
        assert generation >= self.seen_generation.get(job_id, 0), "a generation went back"
        self.seen_generation[job_id] = generation
        assert made_by == Counter(range(1, generation + 1)), (
            f"job {job_id}: generations 1..{generation} made by {dict(made_by)}")
        if job_id in self.completed:
            assert status == "completed", f"completed job {job_id} became {status}"
            assert (generation, row["finished_at"]) == self.completed[job_id], (
                f"completed job {job_id} changed")
        elif status == "completed":
            self.completed[job_id] = (generation, row["finished_at"])

    def _children_match_model(self, job_rows: dict[int, dict[str, Any]],
                              attempt_rows: list[dict[str, Any]]) -> None:
        """Step, attempt and artifact rows are exactly the model's."""
        steps_by_job: dict[int, dict[int, StepModel]] = {job_id: {} for job_id in job_rows}
        for s in rows(self.engine, STEP_RUNS):
            steps_by_job[s["job_id"]][s["step_index"]] = StepModel(
                s["step_state"], s["claim_generation"], s["failure_retryable"], s["error_code"])
        artifacts_by_job: dict[int, dict[tuple[int, str], str]] = {j: {} for j in job_rows}
        for a in rows(self.engine, ARTIFACTS):
            artifacts_by_job[a["job_id"]][(a["claim_generation"], a["artifact_name"])] = (
                a["artifact_state"])
            if a["artifact_state"] == "published":
                owner = job_rows[a["job_id"]]
                assert owner["job_status"] == "completed", "artifact of an unfinished job published"
                # A completion the reconciler recorded moved the job one generation on.
                recovered = owner["status_reason"] == "completion_recovered"
                assert a["claim_generation"] == owner["claim_generation"] - recovered, (
                    f"artifact of generation {a['claim_generation']} published, job completed "
                    f"at {owner['claim_generation']}")
        attempts_by_job: dict[int, dict[int, AttemptModel]] = {j: {} for j in job_rows}
        for a in attempt_rows:
            attempts_by_job[a["job_id"]][a["claim_generation"]] = AttemptModel(
                a["attempt_number"], a["attempt_outcome"], a["ended_by"])
        for job_id, job in self.model.items():
            assert steps_by_job[job_id] == job.steps, f"job {job_id}: step rows"
            assert attempts_by_job[job_id] == job.attempt_rows, f"job {job_id}: attempt rows"
            assert artifacts_by_job[job_id] == job.artifacts, f"job {job_id}: artifacts"

    def _sessions_and_leader_match_model(self) -> None:
        session_rows = {r["session_id"]: r for r in rows(self.engine, SESSIONS)}
        assert set(session_rows) == set(self.sessions)
        for session_id, session in self.sessions.items():
            r = session_rows[session_id]
            assert (r["worker_name"], r["stop_reason"], r["heartbeat_at"]) == (
                session.worker, session.stop_reason, session.heartbeat_at), (
                f"session {session_id}")
            assert (r["stopped_at"] is None) == (session.stop_reason is None)
        lease_rows = rows(self.engine, LEASES)
        if self.leader is None:
            assert lease_rows == []
        else:
            [lease] = lease_rows
            assert (lease["holder_id"], lease["fencing_token"], lease["lease_expires_at"]) == (
                self.leader.holder, self.leader.token, self.leader.expires_at)

    def _matches_model(self, job: JobModel, row: dict[str, Any]) -> None:
        actual = {
            "status": row["job_status"], "reason": row["status_reason"],
            "generation": row["claim_generation"], "attempts": row["attempt_count"],
            "max_attempts": row["max_attempts"], "resume_at": row["resume_step_index"],
            "hold": bool(row["operator_hold"]), "lease_expires_at": row["lease_expires_at"],
            "available_at": row["available_at"], "last_error": row["last_error_code"],
            "plan": tuple(s["effect_kind"] for s in row["step_plan"]),
            "key": row["idempotency_key"], "parked": bool(row["reconcile_parked"]),
        }
        expected = {name: getattr(job, name) for name in actual}
        assert actual == expected, f"job {job.job_id}: database {actual} != model {expected}"
        if job.status == "processing":
            assert row["last_activity_at"] == job.last_activity_at, f"job {job.job_id}: activity"


StoreMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS_PER_EXAMPLE,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.machine_engine = "sqlite"  # type: ignore[attr-defined]


class TestStoreMachineOnMariaDB(TestStoreMachine):  # type: ignore[misc, valid-type]
    """The same machine on MariaDB, its clock frozen with ``SET timestamp``: a third of
    the examples (each step is a round trip to a server, about three times SQLite's
    cost), enough to meet each rule on that engine's statements; the full run sets
    ``RECONCILER_STATEMACHINE_MARIADB_EXAMPLES``."""

    machine_engine = "mariadb"
    settings = settings(TestStoreMachine.settings, max_examples=MARIADB_EXAMPLES)


@pytest.fixture(autouse=True)
def example_progress(request: pytest.FixtureRequest,
                     capsys: pytest.CaptureFixture[str]) -> Iterator[None]:
    """A progress bar of the examples run, every 10 s, on the terminal (pytest's capture
    suspended for each line), for runs long enough to need one."""
    examples = request.cls.settings.max_examples if request.cls is not None else EXAMPLES

    def to_terminal(line: str) -> None:
        with capsys.disabled():
            print(line, flush=True)

    StoreMachine.examples_run = 0
    with Progress("state machine", write=to_terminal) as progress:
        progress.phase(f"{examples} examples of up to {STEPS_PER_EXAMPLE} steps",
                       total=examples, announce=False)
        StoreMachine.progress = progress
        try:
            yield
        finally:
            StoreMachine.progress = None
