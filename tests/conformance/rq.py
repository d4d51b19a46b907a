"""The ``rq`` source's fixture: RQ's own jobs in a real Redis, the reconciler's tables on
SQLite and PostgreSQL.

A job is enqueued through RQ's own ``Queue.enqueue`` (its function named after its kind,
never imported) and started as a worker starts it (``Job.prepare_for_execution`` and
``Execution.create`` in one pipeline); steps go through the real step ledger. A live
owner is a worker key with a fresh heartbeat and an entry renewed far ahead; a dead one
has no key (Redis expired it) and an entry ``TIMING.lease_expired_seconds`` past its
score, the way the minute after its death would have left them.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy.engine import Engine

from reconciler.core.ports import JobKey
from reconciler.sources.rq import RqConfig
from reconciler.sources.rq.keys import HEARTBEAT_GRACE_SECONDS
from reconciler.storage.engines import create_engine
from tests.conformance.fixtures import (
    TIMING,
    Capability,
    Interference,
    Outcome,
    RegisteredSource,
    Situation,
    SourceJob,
    State,
)
from tests.conformance.foreign import ALIKE_KINDS, ForeignFixture, clear_audit, kind_for
from tests.conformance.systems import _common_gaps, _every, _specs
from tests.helpers import fresh_database, rows_of
from tests.sources.conftest import SourcesDatabase, clear_ledger
from tests.sources.django_tasks_support import LEDGER, record_steps, set_ledger

QUEUE = "default"
OUTCOMES: dict[str, Outcome] = {"started": "running", "queued": "runnable",
                                "failed": "failed", "finished": "completed"}
RQ_TIME = "%Y-%m-%dT%H:%M:%S.%fZ"


class RqFixture(ForeignFixture):
    """RQ's keys in Redis as a source under test (see ``SourceFixture``)."""

    source_name = "rq"
    gaps: dict[Capability, str] = _common_gaps("rq") | {
        **_every(State.RECENTLY_ACTIVE, "rq's lease is the started registry's entry: a "
                 "worker gone past its entry's expiry is the lease run out, and then recent "
                 "activity protects nothing"),
    }

    # What a team writes: RQ's passes then load only the expired entries of its registries.
    kinds = ALIKE_KINDS

    def __init__(self, engine: Engine, redis_url: str) -> None:
        super().__init__(engine, RqConfig(
            redis_url=redis_url, session_timeout_seconds=TIMING.session_timeout_seconds))
        import redis  # noqa: PLC0415 - the rq source's tests have it

        self.redis = redis.Redis.from_url(redis_url)
        self._serial = itertools.count(1)

    def key_of(self, text: str) -> JobKey:
        return text

    # -- making situations --------------------------------------------------------------------

    def _now(self) -> datetime:
        seconds, micros = self.redis.time()
        return datetime.fromtimestamp(seconds + micros / 1e6, UTC)

    def _worker(self, name: str, *, live: bool, born: datetime | None = None) -> None:
        """A live worker's key (a fresh heartbeat; born an hour ago unless ``born``), or
        none at all (a dead one's expired)."""
        key = f"rq:worker:{name}"
        if not live:
            self.redis.delete(key)
            return
        now = self._now()
        birth = now - timedelta(hours=1) if born is None else born
        self.redis.hset(key, mapping={"last_heartbeat": now.strftime(RQ_TIME),
                                      "birth": birth.strftime(RQ_TIME),
                                      "version": "2.12.0", "queues": QUEUE})
        self.redis.sadd("rq:workers", key)
        self.redis.expire(key, int(TIMING.lease_seconds))

    def _start(self, job_id: str, worker: str, *, live: bool, overdue: bool = False,
               born: datetime | None = None) -> None:
        """The job taken off its queue and started as a worker starts it; a dead worker's
        entry expired long since, or (``overdue``) still live but its heartbeat overdue
        past the session timeout."""
        from rq.executions import Execution  # noqa: PLC0415
        from rq.job import Job  # noqa: PLC0415

        job = Job.fetch(job_id, connection=self.redis)
        self.redis.lrem(f"rq:queue:{QUEUE}", 1, job_id)
        self._worker(worker, live=live, born=born)
        with self.redis.pipeline() as pipe:
            job.prepare_for_execution(worker, pipe)
            execution = Execution.create(job, int(TIMING.lease_seconds), pipeline=pipe,
                                         worker_name=worker)
            pipe.execute()
        if not live:
            member = f"{job_id}:{execution.id}"
            # RQ scores an entry its next heartbeat plus 60 s: an overdue one is scored
            # less than 60 s past the session timeout ahead, an expired one behind now.
            ahead = ((HEARTBEAT_GRACE_SECONDS - TIMING.session_timeout_seconds) / 2
                     if overdue else -TIMING.lease_expired_seconds)
            self.redis.zadd(f"rq:wip:{QUEUE}", {member: self._now().timestamp() + ahead})

    def make(self, situation: Situation) -> SourceJob:
        """A job started by a live or a dead worker, its steps recorded in the ledger."""
        from rq import Queue  # noqa: PLC0415

        state, n = situation.state, situation.step
        kind = kind_for(situation.effect, next(self._serial))
        specs = _specs(situation)
        job_id = str(Queue(QUEUE, connection=self.redis).enqueue(kind).id)
        attempt = 3 if state is State.OUT_OF_ATTEMPTS else 1
        if attempt > 1:
            self.redis.hset(f"rq:job:{job_id}", "reconciler_attempt", attempt)
        live = state in (State.LIVE, State.WEDGED, State.OWNER_REBORN_HOLDING)
        name = f"{'live' if live else 'dead'}-{job_id[:8]}"
        # A worker that came back under its dead predecessor's name, then took the job
        # again: born just before this start.
        born = (self._now() - timedelta(seconds=1)
                if state is State.OWNER_REBORN_HOLDING else None)
        self._start(job_id, name, live=live, overdue=state is State.OWNER_GONE, born=born)
        if state is State.OWNER_REBORN:
            # A successor under the dead worker's name: born after the job started.
            started = datetime.strptime(self._hash(job_id)["started_at"], RQ_TIME)
            self._worker(name, live=True, born=started.replace(tzinfo=UTC)
                         + timedelta(seconds=1))
        if state is State.WEDGED:
            record_steps(self.engine, self.source_name, job_id, 1, specs,
                         age=TIMING.wedged_after_seconds + 60)
            return SourceJob(job_id, 1)
        if state is not State.LIVE:
            # As old as the worker's death: younger than ``wedged_after_seconds``, so the
            # passes load only the expired entries unless a wedged job is made too.
            record_steps(self.engine, self.source_name, job_id, attempt, specs,
                         age=TIMING.idle_seconds)
        if state is State.STEP_FAILED:
            set_ledger(self.engine, self.source_name, job_id, step=n, failure_retryable=False)
        return SourceJob(job_id, attempt)

    def interfere(self, job: SourceJob, change: Interference) -> None:
        """The slow worker's late write, or another replica and worker taking the job."""
        key = str(job.key)
        [(member, _)] = self._entries(key)
        if change is Interference.LATE_PROGRESS:
            set_ledger(self.engine, self.source_name, key, updated_at=datetime.now(UTC))
        elif change is Interference.LATE_HEARTBEAT:
            # ``Worker.maintain_heartbeats``: its key, the job's hash and the entry renewed.
            worker = self._hash(key)["worker_name"]
            self._worker(worker, live=True)
            with self.redis.pipeline() as pipe:
                pipe.hset(f"rq:job:{key}", "last_heartbeat", self._now().strftime(RQ_TIME))
                pipe.zadd(f"rq:wip:{QUEUE}", {member: self._now().timestamp()
                                              + TIMING.lease_seconds})
                pipe.execute()
        elif change is Interference.LATE_COMPLETION:
            # The worker's ``handle_job_success``: finished, out of the started registry.
            with self.redis.pipeline() as pipe:
                pipe.hset(f"rq:job:{key}", mapping={
                    "status": "finished", "ended_at": self._now().strftime(RQ_TIME)})
                pipe.zrem(f"rq:wip:{QUEUE}", member)
                pipe.delete(f"rq:execution:{member}")
                pipe.zadd(f"rq:finished:{QUEUE}", {key: self._now().timestamp() + 500})
                pipe.execute()
        elif change is Interference.RECLAIM:
            recovered = self.run_pass()
            assert [d.job_id for d in recovered.decisions] == [key]
            assert self.status(job) == "runnable"
            # A new worker takes the requeued job, then dies as well.
            self._start(key, f"dead-again-{key[:8]}", live=False)
        else:  # pragma: no cover - every member is handled above
            raise AssertionError(change)

    # -- observing ----------------------------------------------------------------------------

    def _hash(self, key: str) -> dict[str, Any]:
        raw = self.redis.hgetall(f"rq:job:{key}")
        found = {k.decode(): v for k, v in raw.items()}
        if found.get("exc_info"):
            found["exc_info"] = zlib.decompress(found["exc_info"])
        return {k: v.decode(errors="replace") if isinstance(v, bytes) else v
                for k, v in found.items()}

    def _entries(self, key: str) -> list[tuple[str, float]]:
        return [(m.decode(), s) for m, s in self.redis.zrange(f"rq:wip:{QUEUE}", 0, -1,
                                                              withscores=True)
                if m.decode().startswith(f"{key}:")]

    def status(self, job: SourceJob) -> Outcome:
        return OUTCOMES[self._hash(str(job.key))["status"]]

    def reason(self, job: SourceJob) -> str | None:
        """Our reason code, from the ``exc_info`` the reconciler wrote."""
        text = self._hash(str(job.key)).get("exc_info", "")
        if not text.startswith("reconciler: "):
            return None
        return text.removeprefix("reconciler: ").split(" ", 1)[0]

    def resume_step(self, job: SourceJob) -> int | None:
        return None

    def generation(self, job: SourceJob) -> int | None:
        return None

    def snapshot(self, job: SourceJob) -> object:
        """The job's hash, its entries, where it is queued or failed, and its ledger."""
        key = str(job.key)
        return (self._hash(key), self._entries(key),
                key.encode() in self.redis.lrange(f"rq:queue:{QUEUE}", 0, -1),
                self.redis.zscore(f"rq:failed:{QUEUE}", key),
                rows_of(self.engine, LEDGER, LEDGER.c.source_name == self.source_name,
                        LEDGER.c.job_key == key, order=LEDGER.c.step_index))


@contextmanager
def open_rq(request: pytest.FixtureRequest, via: str | None = None) -> Iterator[RqFixture]:
    """On the test's engine: a fresh SQLite file, or the session's PostgreSQL database with
    the ledger and audit emptied; the session's Redis emptied (reached at ``via``, a relay
    to it, where given)."""
    redis_url = request.getfixturevalue("redis_url") if via is None else via
    if request.param[1] == "sqlite":
        engine = create_engine(fresh_database(request.getfixturevalue("tmp_path")))
        try:
            yield RqFixture(engine, redis_url)
        finally:
            engine.dispose()
        return
    db: SourcesDatabase = request.getfixturevalue("sources_db")
    clear_ledger(db)
    clear_audit(db.engine)
    yield RqFixture(db.engine, redis_url)


RQ = RegisteredSource("rq", ("sqlite", "postgresql"), open_rq, shared=True)
