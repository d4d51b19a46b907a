"""The ``dramatiq`` source's fixture: Dramatiq's own messages in a real Redis, the
reconciler's tables on SQLite and PostgreSQL.

A message is Dramatiq's own ``Message`` (its actor named after its kind, never declared),
stored and fetched as ``dispatch.lua`` stores and fetches one (``{ns}:{queue}.msgs``, the
worker's acks set), marked started as the app's ``ReconcilerMiddleware`` marks it; steps
go through the real step ledger. A live worker's heartbeat is one no pass has seen yet (a
pass first sees it now: still for no time); a dead one's is recorded as passes watching it
would have left it (in their last copy of the heartbeats, unchanged, and timed in the
beats hash from ``session_timeout_seconds + TIMING.lease_expired_seconds`` ago).
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy.engine import Engine

from reconciler.core.ports import JobKey
from reconciler.sources.dramatiq import DramatiqConfig
from reconciler.sources.dramatiq.keys import Keys, Mark
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
from tests.conformance.systems import _common_gaps, _every, _no_reused_names, _specs
from tests.helpers import fresh_database, rows_of
from tests.sources.conftest import SourcesDatabase, clear_ledger
from tests.sources.django_tasks_support import LEDGER, record_steps, set_ledger

QUEUE = "default"
KEYS = Keys("dramatiq")


class DramatiqFixture(ForeignFixture):
    """Dramatiq's keys in Redis as a source under test (see ``SourceFixture``)."""

    source_name = "dramatiq"
    gaps: dict[Capability, str] = _common_gaps("dramatiq") | _no_reused_names(
        "dramatiq", "a broker id, a uuid4 per worker process") | {
        **_every(State.RECENTLY_ACTIVE, "dramatiq's lease is its worker's heartbeat: a "
                 "worker still past the session timeout is gone, and then recent activity "
                 "protects nothing"),
    }
    kinds = ALIKE_KINDS

    def __init__(self, engine: Engine, redis_url: str) -> None:
        super().__init__(engine, DramatiqConfig(
            redis_url=redis_url, session_timeout_seconds=TIMING.session_timeout_seconds))
        import redis  # noqa: PLC0415 - the dramatiq source's tests have it

        self.redis = redis.Redis.from_url(redis_url)
        self._serial = itertools.count(1)
        self._where: dict[str, tuple[str, str]] = {}
        """Each message's Redis id and the broker holding it, by message id."""

    def key_of(self, text: str) -> JobKey:
        return text

    # -- making situations --------------------------------------------------------------------

    def _now(self) -> float:
        seconds, micros = self.redis.time()
        return float(seconds) + float(micros) / 1e6

    def _worker(self, *, live: bool, silent_for: float = 0.0) -> str:
        """A worker process's broker: registered by the middleware, its heartbeat written
        now; a dead one's recorded as still for ``silent_for`` seconds."""
        broker_id = str(uuid.uuid4())
        now = self._now()
        beat = float(int(now * 1000))
        with self.redis.pipeline() as pipe:
            pipe.zadd(KEYS.heartbeats, {broker_id: beat})
            pipe.hset(KEYS.workers, broker_id, json.dumps({"v": 1, "version": "2.2.1"}))
            if not live:
                # What passes watching it since would have left: their last copy of the
                # heartbeats holds it unchanged, timed from ``silent_for`` ago.
                pipe.zadd(KEYS.beats_copy, {broker_id: beat})
                pipe.hset(KEYS.beats, broker_id, f"{beat!r} {now - silent_for!r}")
                pipe.set(KEYS.beats_at, repr(now), nx=True)
            pipe.execute()
        return broker_id

    def _fetch(self, message_id: str, broker_id: str) -> None:
        """The message taken off its queue into the broker's acks set, and marked started
        (``dispatch.lua``'s ``fetch``, then the middleware's mark)."""
        redis_id, _ = self._where[message_id]
        with self.redis.pipeline() as pipe:
            pipe.lrem(KEYS.queue(QUEUE), 1, redis_id)
            pipe.sadd(KEYS.acks(broker_id, QUEUE), redis_id)
            pipe.hset(KEYS.marks, redis_id, Mark(broker_id, False, None, None, None).encode())
            pipe.execute()
        self._where[message_id] = (redis_id, broker_id)

    def _enqueue(self, kind: str, retries: int) -> str:
        """A message as ``RedisBroker.enqueue`` stores it; its message id."""
        from dramatiq import Message  # noqa: PLC0415

        redis_id = str(uuid.uuid4())
        message = Message(queue_name=QUEUE, actor_name=kind, args=(), kwargs={},
                          options={"redis_message_id": redis_id, "retries": retries})
        with self.redis.pipeline() as pipe:
            pipe.hset(KEYS.messages(QUEUE), redis_id, message.encode())
            pipe.rpush(KEYS.queue(QUEUE), redis_id)
            pipe.execute()
        self._where[message.message_id] = (redis_id, "")
        return message.message_id

    def make(self, situation: Situation) -> SourceJob:
        """A message started by a live or a dead worker, its steps in the ledger."""
        state = situation.state
        kind = kind_for(situation.effect, next(self._serial))
        attempt = 3 if state is State.OUT_OF_ATTEMPTS else 1
        message_id = self._enqueue(kind, attempt - 1)
        live = state in (State.LIVE, State.WEDGED)
        silent_for = TIMING.session_timeout_seconds + (
            1.0 if state is State.OWNER_GONE else TIMING.lease_expired_seconds)
        self._fetch(message_id, self._worker(live=live, silent_for=silent_for))
        specs = _specs(situation)
        if state is State.WEDGED:
            record_steps(self.engine, self.source_name, message_id, 1, specs,
                         age=TIMING.wedged_after_seconds + 60)
        elif state is not State.LIVE:
            record_steps(self.engine, self.source_name, message_id, attempt, specs,
                         age=TIMING.idle_seconds)
        if state is State.STEP_FAILED:
            set_ledger(self.engine, self.source_name, message_id, step=situation.step,
                       failure_retryable=False)
        return SourceJob(message_id, attempt)

    def interfere(self, job: SourceJob, change: Interference) -> None:
        """The slow worker's late write, or another replica and worker taking the job."""
        key = str(job.key)
        redis_id, broker_id = self._where[key]
        if change is Interference.LATE_PROGRESS:
            set_ledger(self.engine, self.source_name, key, updated_at=datetime.now(UTC))
        elif change is Interference.LATE_HEARTBEAT:
            # Any broker command of the worker (``dispatch.lua``'s first line).
            self.redis.zadd(KEYS.heartbeats, {broker_id: float(int(self._now() * 1000) + 1)})
        elif change is Interference.LATE_COMPLETION:
            # The worker's ``ack`` (``dispatch.lua``), then the middleware's ``after_ack``.
            with self.redis.pipeline() as pipe:
                pipe.srem(KEYS.acks(broker_id, QUEUE), redis_id)
                pipe.hdel(KEYS.messages(QUEUE), redis_id)
                pipe.hdel(KEYS.marks, redis_id)
                pipe.execute()
        elif change is Interference.RECLAIM:
            recovered = self.run_pass()
            assert [d.job_id for d in recovered.decisions] == [key]
            assert self.status(job) == "runnable"
            # A new worker fetches the message put back, then dies as well.
            self._fetch(key, self._worker(live=False, silent_for=(
                TIMING.session_timeout_seconds + TIMING.lease_expired_seconds)))
        else:  # pragma: no cover - every member is handled above
            raise AssertionError(change)

    # -- observing ----------------------------------------------------------------------------

    def _dead(self, redis_id: str) -> dict[str, Any] | None:
        raw = self.redis.hget(KEYS.dead_messages(QUEUE), redis_id)
        return None if raw is None else dict(json.loads(raw))

    def status(self, job: SourceJob) -> Outcome:
        redis_id, broker_id = self._where[str(job.key)]
        if self._dead(redis_id) is not None:
            return "failed"
        if self.redis.sismember(KEYS.acks(broker_id, QUEUE), redis_id):
            return "running"
        if redis_id.encode() in self.redis.lrange(KEYS.queue(QUEUE), 0, -1):
            return "runnable"
        return "completed"

    def reason(self, job: SourceJob) -> str | None:
        """Our reason code, from the dead letter's options."""
        dead = self._dead(self._where[str(job.key)][0])
        return None if dead is None else dead.get("options", {}).get("reconciler_reason")

    def resume_step(self, job: SourceJob) -> int | None:
        return None

    def generation(self, job: SourceJob) -> int | None:
        return None

    def snapshot(self, job: SourceJob) -> object:
        """The message where it is stored, queued, fetched or dead-lettered, its mark and
        its ledger."""
        key = str(job.key)
        redis_id, broker_id = self._where[key]
        return (self.redis.hget(KEYS.messages(QUEUE), redis_id),
                redis_id.encode() in self.redis.lrange(KEYS.queue(QUEUE), 0, -1),
                self.redis.sismember(KEYS.acks(broker_id, QUEUE), redis_id),
                self._dead(redis_id), self.redis.hget(KEYS.marks, redis_id),
                rows_of(self.engine, LEDGER, LEDGER.c.source_name == self.source_name,
                        LEDGER.c.job_key == key, order=LEDGER.c.step_index))


@contextmanager
def open_dramatiq(request: pytest.FixtureRequest) -> Iterator[DramatiqFixture]:
    """On the test's engine: a fresh SQLite file, or the session's PostgreSQL database with
    the ledger and audit emptied; the session's Redis emptied."""
    redis_url = request.getfixturevalue("redis_url")
    if request.param[1] == "sqlite":
        engine = create_engine(fresh_database(request.getfixturevalue("tmp_path")))
        try:
            yield DramatiqFixture(engine, redis_url)
        finally:
            engine.dispose()
        return
    db: SourcesDatabase = request.getfixturevalue("sources_db")
    clear_ledger(db)
    clear_audit(db.engine)
    yield DramatiqFixture(db.engine, redis_url)


DRAMATIQ = RegisteredSource("dramatiq", ("sqlite", "postgresql"), open_dramatiq, shared=True)
