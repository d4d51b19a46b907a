"""Fixtures for Procrastinate, graphile-worker and pg-boss: their real schemas on PostgreSQL.

Each is built on the phase-1 factory of tests/sources/factories.py, which makes jobs through
the system's own functions (defer and fetch, ``add_job`` and its lock, ``create_queue`` and
its fetch) and moves the claim's clock. Steps are recorded through the real step ledger
(``reconciler.ledger``), as a task of that system would record them; the fewest direct
writes move the ledger's clock or store what its API never writes (a failure that may not
be retried).

The systems' schemas are installed once per session (tests/sources/conftest.py: Procrastinate
from PyPI, graphile-worker and pg-boss from npm) into one shared database; each test
empties their job tables, the step ledger and the audit.

What none of the three can express is declared, with the reason: an operator hold (none
has one), a step waiting on a gate (the ledger has no such state), a resume step or a
generation of their own (the ledger, not the system, says where a run continues; their
attempt counters move with their own claims), a stored plan that cannot be read or a step
record outside its plan (the ledger keeps plan and records in one row per step, so neither
can exist). graphile-worker and pg-boss have no worker heartbeat, so neither a silent owner
nor a late heartbeat exists for them; for Procrastinate a lease that ran out is a silent
heartbeat, so recent activity never protects (the table's session-gone rule).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa

from reconciler.core.ports import JobKey
from reconciler.core.vocabulary import EffectKind
from tests.conformance.fixtures import (
    PLAN_LENGTH,
    REBORN_STATES,
    TIMING,
    Capability,
    Feature,
    Interference,
    Outcome,
    RegisteredSource,
    Situation,
    SourceJob,
    State,
)
from tests.conformance.foreign import ForeignFixture, clear_audit, kind_for
from tests.sources.factories import (
    GraphileWorkerFactory,
    PgBossFactory,
    ProcrastinateFactory,
    StepSpec,
    SystemFactory,
    record_steps,
)

OUTCOMES: dict[str, Outcome] = {"queued": "runnable", "running": "running",
                                "failed": "failed", "completed": "completed",
                                # graphile-worker deletes a job when it completes
                                "absent": "completed"}


def _every(state: State, reason: str) -> dict[Capability, str]:
    return {Situation(state, step, effect): reason
            for step in range(PLAN_LENGTH) for effect in EffectKind}


def _no_reused_names(system: str, why: str) -> dict[Capability, str]:
    """The reborn-owner situations, for a source whose owner no later process can be
    (``why``: what its liveness names)."""
    return {situation: f"{system}'s liveness names {why}: a later process never takes it"
            for state in REBORN_STATES for situation in _every(state, "")}


def _common_gaps(system: str) -> dict[Capability, str]:
    return {
        **_every(State.HELD, f"{system} has no operator hold"),
        **_every(State.GATED, f"{system}'s steps live in the step ledger, which has no "
                 "step waiting on an external gate"),
        **_every(State.PLAN_UNREADABLE, f"{system}'s steps live in the step ledger, which "
                 "refuses a plan it cannot read"),
        **_every(State.EVIDENCE_UNREADABLE, f"{system}'s steps live in the step ledger, one "
                 "row per planned step: no record can lie outside its plan"),
        Feature.RESUME_STEP: f"{system} keeps no resume step: the step ledger says where a "
                             "run continues",
        Feature.GENERATION: f"{system}'s attempt counter moves with its own claims, not "
                            "with each of our transitions",
    }


class SystemFixture(ForeignFixture):
    """A real job system's schema as a source under test (see ``SourceFixture``)."""

    ledger_attempt_offset = -1
    """The ledger attempt of a job in its ``attempts_used``-th attempt, minus that count
    (the factories' conventions: Procrastinate and pg-boss count from 0)."""

    def __init__(self, factory: SystemFactory) -> None:
        self.factory = factory
        self.source_name = factory.source_name
        super().__init__(factory.db.engine, factory.config)
        self._serial = itertools.count(1)

    # -- making situations --------------------------------------------------------------------

    def make(self, situation: Situation) -> SourceJob:
        """A job claimed through the system's own functions, steps through the ledger."""
        state, n = situation.state, situation.step
        kind = kind_for(situation.effect, next(self._serial))
        specs = _specs(situation)
        if state is State.LIVE:
            job = self.factory.live(kind)
        elif state is State.WEDGED:
            job = self.factory.live(kind)
            record_steps(self.factory.db, self.source_name, job, 1 + self.ledger_attempt_offset,
                         specs, age=TIMING.wedged_after_seconds + 60)
        elif state is State.OWNER_GONE:
            job = self._owner_gone(kind)
            record_steps(self.factory.db, self.source_name, job, 1 + self.ledger_attempt_offset,
                         specs)
        else:
            used = self.factory.default_max_attempts if state is State.OUT_OF_ATTEMPTS else 1
            job = self.factory.died(kind, attempts_used=used, steps=specs)
            if state is State.STEP_FAILED:
                self._ledger(job, {"failure_retryable": False}, step=n)
            elif state is State.RECENTLY_ACTIVE:
                self._ledger(job, {"updated_at": sa.text(
                    f"now() - interval '{TIMING.recent_seconds} seconds'")})
        return SourceJob(job, self._generation(job))

    def _owner_gone(self, kind: str) -> JobKey:
        raise NotImplementedError  # declared unsupported where the system has no owners

    def _ledger(self, job: JobKey, values: dict[str, Any], step: int | None = None) -> None:
        """Direct SQL on the job's ledger rows: what the ledger API never writes."""
        sets = ", ".join(f"{k} = {v.text if isinstance(v, sa.TextClause) else ':' + k}"
                         for k, v in values.items())
        params = {k: v for k, v in values.items() if not isinstance(v, sa.TextClause)}
        where = "source_name = :s AND job_key = :k" + ("" if step is None else
                                                        " AND step_index = :i")
        self.factory.db.execute(f"UPDATE step_ledger_entries SET {sets} WHERE {where}",
                                {**params, "s": self.source_name, "k": str(job), "i": step})

    def _generation(self, job: JobKey) -> int | None:
        """The fence generation the source reads for the job now (its attempt counter)."""
        with self.store.pass_transaction(dry_run=True) as tx:
            [row] = tx.jobs.evidence_for([job])
        return row.fence.generation

    def interfere(self, job: SourceJob, change: Interference) -> None:
        """The slow worker's late write, or another replica and worker taking the job."""
        if change is Interference.LATE_PROGRESS:
            self._ledger(job.key, {"updated_at": sa.text("now()")})
        elif change is Interference.LATE_COMPLETION:
            self._complete(job.key)
        elif change is Interference.LATE_HEARTBEAT:
            self._heartbeat(job.key)
        elif change is Interference.RECLAIM:
            recovered = self.run_pass()
            assert [d.job_id for d in recovered.decisions] == [job.key]
            assert self.status(job) == "runnable"
            self._reclaim(job.key)
        else:  # pragma: no cover - every member is handled above
            raise AssertionError(change)

    def _complete(self, job: JobKey) -> None:
        raise NotImplementedError

    def _heartbeat(self, job: JobKey) -> None:
        raise NotImplementedError  # declared unsupported where the system has no heartbeat

    def _reclaim(self, job: JobKey) -> None:
        raise NotImplementedError

    # -- observing ----------------------------------------------------------------------------

    def status(self, job: SourceJob) -> Outcome:
        """The system's status in neutral words."""
        return OUTCOMES[self.factory.status(job.key)]

    def reason(self, job: SourceJob) -> str | None:
        """Our reason code where the system keeps an error field."""
        return self.factory.error_text(job.key)

    def resume_step(self, job: SourceJob) -> int | None:
        """Never asked (declared): the system keeps no resume step."""
        return None

    def generation(self, job: SourceJob) -> int | None:
        """Never asked (declared)."""
        return None

    def snapshot(self, job: SourceJob) -> object:
        """The job's row as the system stores it, and its ledger rows."""
        return (self._job_row(job.key), self.factory.db.execute(
            "SELECT * FROM step_ledger_entries WHERE source_name = :s AND job_key = :k "
            "ORDER BY step_index", {"s": self.source_name, "k": str(job.key)}))

    def _job_row(self, job: JobKey) -> object:
        raise NotImplementedError


def _specs(situation: Situation) -> list[StepSpec]:
    """The situation's plan with each step's ledger state."""
    state, n = situation.state, situation.step
    states: list[str | None] = [None] * PLAN_LENGTH
    if state is State.COMPLETION_UNRECORDED:
        states = ["succeeded"] * PLAN_LENGTH
    else:
        states[:n] = ["succeeded"] * n
        if state in (State.DIED_MID_STEP, State.WEDGED):
            states[n] = "started"
        elif state in (State.STEP_FAILED, State.STEP_FAILED_RETRYABLY):
            states[n] = "failed"
    return [(s.step_name, s.effect_kind.value, st) for s, st in zip(situation.plan, states,
                                                                    strict=True)]


# --------------------------------------------------------------------------- #
# The three systems
# --------------------------------------------------------------------------- #


class ProcrastinateFixture(SystemFixture):
    """Procrastinate: workers heartbeat in ``procrastinate_workers``; the fence is the
    job's worker and attempts."""

    gaps = _common_gaps("Procrastinate") | _no_reused_names(
        "Procrastinate", "a worker row, whose id a new worker never takes") | {
        **_every(State.RECENTLY_ACTIVE, "Procrastinate's lease is its worker's heartbeat: a "
                 "lease that ran out means the owner is gone, and then recent activity "
                 "protects nothing"),
        Feature.REASON: "Procrastinate keeps no error field on a job"}

    def __init__(self, factory: ProcrastinateFactory) -> None:
        super().__init__(factory)
        self.procrastinate = factory

    def _owner_gone(self, kind: str) -> JobKey:
        job = self.procrastinate.defer(kind)
        self.procrastinate.claim(job, heartbeat_age=TIMING.session_timeout_seconds + 30)
        return job

    def _complete(self, job: JobKey) -> None:
        self.procrastinate._sql(
            "SELECT procrastinate_finish_job_v1(:id, 'succeeded', false)", {"id": job})

    def _heartbeat(self, job: JobKey) -> None:
        self.procrastinate._sql(
            "UPDATE procrastinate_workers w SET last_heartbeat = now() FROM procrastinate_jobs"
            " j WHERE j.id = :id AND w.id = j.worker_id", {"id": job})

    def _reclaim(self, job: JobKey) -> None:
        # The next worker fetches it and dies too.
        self.procrastinate.claim(int(job), heartbeat_age=TIMING.idle_seconds + 3600,
                                 attempts_before=int(self.procrastinate.row(job)["attempts"]))

    def _job_row(self, job: JobKey) -> object:
        return self.procrastinate._sql("SELECT * FROM procrastinate_jobs WHERE id = :id",
                                       {"id": job})


class GraphileWorkerFixture(SystemFixture):
    """graphile-worker: no heartbeat; the lease is ``locked_at`` plus ``max_run_seconds``."""

    ledger_attempt_offset = 0
    gaps = _common_gaps("graphile-worker") | _no_reused_names(
        "graphile-worker", "no owner") | {
        **_every(State.OWNER_GONE, "graphile-worker has no worker liveness: only its lock's "
                 "age tells"),
        Interference.LATE_HEARTBEAT: "graphile-worker has no heartbeat",
    }

    def __init__(self, factory: GraphileWorkerFactory) -> None:
        super().__init__(factory)
        self.graphile = factory

    def _complete(self, job: JobKey) -> None:
        # Its worker's completion: the job row is deleted (complete_jobs).
        self.graphile._sql("DELETE FROM _private_jobs WHERE id = :id", {"id": job})

    def _reclaim(self, job: JobKey) -> None:
        row = self.graphile.row(job)
        assert row is not None
        self.graphile.claim(int(job), age=6 * 3600, attempts_before=int(row["attempts"]))

    def _job_row(self, job: JobKey) -> object:
        return self.graphile._sql("SELECT * FROM _private_jobs WHERE id = :id", {"id": job})


class PgBossFixture(SystemFixture):
    """pg-boss: no heartbeat; the lease is ``started_on`` plus its expiry or
    ``max_run_seconds``; job ids are UUIDs."""

    gaps = _common_gaps("pg-boss") | _no_reused_names("pg-boss", "no owner") | {
        **_every(State.OWNER_GONE, "pg-boss has no worker liveness: only a job's expiry "
                 "tells"),
        Interference.LATE_HEARTBEAT: "pg-boss has no heartbeat",
    }

    def __init__(self, factory: PgBossFactory) -> None:
        super().__init__(factory)
        self.pgboss = factory

    def key_of(self, text: str) -> JobKey:
        return text

    def _complete(self, job: JobKey) -> None:
        self.pgboss._sql("UPDATE job SET state = 'completed', completed_on = now() "
                         "WHERE id = CAST(:id AS uuid)", {"id": job})

    def _reclaim(self, job: JobKey) -> None:
        row = self.pgboss.row(job)
        assert row is not None
        # pg-boss 10's fetch counts a run of a job that started before (plans.js:
        # retry_count + 1 WHEN started_on IS NOT NULL).
        retries = int(row["retry_count"]) + (row["started_on"] is not None)
        self.pgboss.claim(str(job), age=6 * 3600, retries_before=retries)

    def _job_row(self, job: JobKey) -> object:
        return self.pgboss._sql("SELECT * FROM job WHERE id = CAST(:id AS uuid)", {"id": job})


# --------------------------------------------------------------------------- #
# Registration: each opens on the session's shared database, emptied for the test
# --------------------------------------------------------------------------- #


def _opener(fixture_name: str, build: Any) -> Any:
    @contextmanager
    def open_system(request: pytest.FixtureRequest) -> Iterator[SystemFixture]:
        db = request.getfixturevalue(f"{fixture_name}_db")
        schema = request.getfixturevalue(f"{fixture_name}_schema")
        clear_audit(db.engine)
        yield build(db, schema)

    return open_system


def _procrastinate(db: Any, schema: str) -> SystemFixture:
    return ProcrastinateFixture(ProcrastinateFactory(
        db, schema, session_timeout_seconds=TIMING.session_timeout_seconds))


PROCRASTINATE = RegisteredSource("procrastinate", ("postgresql",),
                                 _opener("procrastinate", _procrastinate), shared=True)
GRAPHILE_WORKER = RegisteredSource("graphile-worker", ("postgresql",), _opener(
    "graphile", lambda db, schema: GraphileWorkerFixture(GraphileWorkerFactory(db, schema))),
    shared=True)
PG_BOSS = RegisteredSource("pg-boss", ("postgresql",), _opener(
    "pgboss", lambda db, schema: PgBossFixture(PgBossFactory(db, schema))), shared=True)
