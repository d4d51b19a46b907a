"""Resume and terminalize in RQ's own shapes, each job fenced on itself as read.

A batch of a pass's changes is one ``MULTI``/``EXEC`` under one ``WATCH`` of its jobs'
own keys only: each job's hash (every heartbeat of its own worker writes
``last_heartbeat`` there, in the same transaction that renews its registry entry; a
worker that finishes or fails it writes its ``status`` there) and its execution's hash.
Before ``MULTI`` the jobs are read again, pipelined, and each compared with its fence:
its status, worker, attempt, retries left and its entry in the started registry with the
same score. The registry itself is never watched, so a heartbeat on another job of the
same queue (which rewrites that sorted set) never fails a fence. A job whose fence no
longer holds is left out and changes nothing: the pass records ``fence_lost``. A batch
whose ``WATCH`` broke (one of its jobs written after the read: a worker that woke up) is
written again a job at a time, so one late writer costs its batch a few round trips and
loses only its own job. A connection lost under ``WATCH`` (which redis-py also raises as a
``WatchError``) fails the pass instead: its ``EXEC`` may have run.

- **Resume** (RQ's requeue, ``StartedJobRegistry.requeue`` and ``Job.retry``): out of
  the started registry and its execution record, ``status`` ``queued``, ``started_at``
  and ``ended_at`` cleared, ``enqueued_at`` now, one retry used where it has a
  ``Retry``, the attempt counted (``ATTEMPT_FIELD``), its id pushed on its own queue
  (at the front where its ``Retry`` says so); same id, same ``data``.
- **Terminalize** (a worker's ``handle_job_failure``): out of the started registry and
  its execution record, ``status`` ``failed``, ``ended_at`` now, ``exc_info`` naming our
  reason, in the queue's failed registry for its ``failure_ttl``, and a failed
  ``Result`` (RQ's own class) naming it, so ``latest_result()`` reads it; never retried.
  Then its dependents as RQ's ``enqueue_dependents`` leaves them after a failure
  (``release_dependents``).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from reconciler.sources.kit.fences import ForeignFence
from reconciler.sources.rq import keys
from reconciler.sources.rq.snapshot import ATTEMPT_FIELD

DEFAULT_FAILURE_TTL = 31_536_000
"""RQ's ``DEFAULT_FAILURE_TTL`` (a year), for a job without its own ``failure_ttl``."""
_READ = ("status", "worker_name", "retries_left", ATTEMPT_FIELD, "origin",
         "enqueue_at_front_on_retry", "ttl", "failure_ttl")


@dataclass(frozen=True, slots=True)
class RqFence(ForeignFence):
    """The job as its decision read it, repeated by its write."""

    queue: str
    execution_id: str
    score: float
    status: str
    worker: str | None
    retries_left: int | None
    attempt: int


def exc_text(reason: str) -> str:
    """The ``exc_info`` and failed result of a job the reconciler terminalized."""
    return (f"reconciler: {reason} (stale-claim-reconciler: the worker running this job is "
            "gone; the job is not retried)")


def utcformat(moment: datetime) -> str:
    """A time as RQ writes one (``rq.utils.utcformat``)."""
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True, slots=True)
class Held:
    """The job's fields as read again under ``WATCH``."""

    values: dict[str, str | None]

    def int(self, name: str) -> int | None:
        value = self.values.get(name)
        try:
            return None if value in (None, "") else int(str(value))
        except ValueError:
            return None


Write = Callable[[Any, str, RqFence, Held, datetime], None]
"""One job's writes (``job_id``, its fence, its fields as read again, Redis's time),
queued on a pipeline inside the batch's ``MULTI``."""


def fenced_writes(client: Any, jobs: Sequence[tuple[str, RqFence]], write: Write
                  ) -> list[str]:
    """``write`` for each job still as its fence read it, the batch in one transaction;
    the ids written. A batch whose ``WATCH`` broke (one of its jobs written meanwhile:
    a late worker) is written again a job at a time, each under its own fence."""
    import redis  # noqa: PLC0415 - only the rq source needs it

    if not jobs:
        return []
    try:
        return _transaction(client, jobs, write)
    except redis.WatchError as error:
        _unless_connection_lost(error)
        if len(jobs) == 1:
            return []
    written: list[str] = []
    for job in jobs:
        try:
            written += _transaction(client, [job], write)
        except redis.WatchError as error:
            _unless_connection_lost(error)
    return written


def _unless_connection_lost(error: Exception) -> None:
    """Raise the connection error redis-py turned into this ``WatchError``. A connection
    lost under ``WATCH`` leaves unknown whether the ``EXEC`` ran: the pass fails, as with
    Redis gone in the middle of its writes, rather than record a lost fence for writes that
    may have landed (a batch written again would find its own writes and lose its fences)."""
    import redis  # noqa: PLC0415 - only the rq source needs it

    lost = error.__context__
    if isinstance(lost, redis.ConnectionError | redis.TimeoutError):
        raise lost


def _transaction(client: Any, jobs: Sequence[tuple[str, RqFence]], write: Write
                 ) -> list[str]:
    """One ``WATCH`` of the jobs' own keys, one pipelined read of them, one ``MULTI``
    of the writes of those whose fence holds: three round trips, however many jobs."""
    with client.pipeline() as pipe:
        pipe.watch(*(key for job_id, fence in jobs for key in (
            keys.job_key(job_id), keys.execution_key(job_id, fence.execution_id))))
        # Read on another connection: under ``WATCH`` the first one sends each command
        # as it comes, and a change after the ``WATCH`` still fails the ``EXEC``.
        with client.pipeline(transaction=False) as reads:
            for job_id, fence in jobs:
                reads.hmget(keys.job_key(job_id), _READ)
                reads.zscore(keys.started_key(fence.queue), f"{job_id}:{fence.execution_id}")
            reads.time()
            *read, (seconds, micros) = reads.execute()
        holding = []
        for (job_id, fence), raw, score in zip(jobs, read[::2], read[1::2], strict=True):
            held = Held({name: None if v is None else v.decode() for name, v in
                         zip(_READ, raw, strict=True)})
            if _holds(fence, held, score):
                holding.append((job_id, fence, held))
        if not holding:
            pipe.unwatch()
            return []
        now = datetime.fromtimestamp(int(seconds) + int(micros) / 1e6, UTC)
        pipe.multi()
        for job_id, fence, held in holding:
            _leave_started(pipe, job_id, fence)
            write(pipe, job_id, fence, held, now)
        pipe.execute()
    return [job_id for job_id, _, _ in holding]


def _holds(fence: RqFence, held: Held, score: float | None) -> bool:
    """Whether the job is as its decision read it: its entry, status, worker, retries
    left and attempt."""
    return (score == fence.score and held.values["status"] == fence.status
            and (held.values["worker_name"] or None) == fence.worker
            and held.int("retries_left") == fence.retries_left
            and (held.int(ATTEMPT_FIELD) or 1) == fence.attempt)


def _leave_started(pipe: Any, job_id: str, fence: RqFence) -> None:
    """Out of the started registry, its execution record deleted (``Execution.delete``)."""
    pipe.zrem(keys.started_key(fence.queue), f"{job_id}:{fence.execution_id}")
    pipe.delete(keys.execution_key(job_id, fence.execution_id))
    pipe.zrem(keys.executions_key(job_id), fence.execution_id)


def _requeue(pipe: Any, job_id: str, fence: RqFence, held: Held, now: datetime) -> None:
    """One job requeued on its own queue as RQ's own retry does."""
    queue = held.values["origin"] or fence.queue
    fields: dict[str, Any] = {"status": "queued", "started_at": "", "ended_at": "",
                              "enqueued_at": utcformat(now),
                              ATTEMPT_FIELD: fence.attempt + 1}
    if fence.retries_left is not None:
        fields["retries_left"] = max(fence.retries_left - 1, 0)
    pipe.hset(keys.job_key(job_id), mapping=fields)
    ttl = held.int("ttl")
    if ttl is not None and ttl > 0:  # ``Job.cleanup``: a queued job's own TTL
        pipe.expire(keys.job_key(job_id), ttl)
    at_front = held.values["enqueue_at_front_on_retry"] == "1"
    (pipe.lpush if at_front else pipe.rpush)(keys.queue_key(queue), job_id)


def resume(client: Any, jobs: Sequence[tuple[str, RqFence]]) -> list[str]:
    """The jobs requeued on their own queues as RQ's own retry does; the ids written (the
    others' fences were lost)."""
    return fenced_writes(client, jobs, _requeue)


def terminalize(client: Any, jobs: Sequence[tuple[str, RqFence]], reason: str) -> list[str]:
    """The jobs failed into their queues' failed registries with our reason; the ids
    written (the others' fences were lost)."""
    from rq.results import Result  # noqa: PLC0415 - RQ's own record of a failure

    text = exc_text(reason)
    exc_info = zlib.compress(text.encode())

    def fail(pipe: Any, job_id: str, fence: RqFence, held: Held, now: datetime) -> None:
        queue = held.values["origin"] or fence.queue
        ttl = held.int("failure_ttl")
        ttl = DEFAULT_FAILURE_TTL if ttl is None else ttl
        pipe.hset(keys.job_key(job_id), mapping={
            "status": "failed", "ended_at": utcformat(now), "exc_info": exc_info})
        # ``FailedJobRegistry.add`` and ``Job.cleanup`` with the failure TTL.
        pipe.zadd(keys.failed_key(queue), {job_id: ttl if ttl < 0 else now.timestamp() + ttl})
        if ttl > 0:
            for key in (keys.job_key(job_id), keys.dependents_key(job_id),
                        keys.dependencies_key(job_id)):
                pipe.expire(key, ttl)
        Result(job_id, Result.Type.FAILED, connection=client, exc_string=text,
               worker_name=fence.worker or "", execution_id=fence.execution_id,
               execution_ended_at=now).save(ttl=ttl, pipeline=pipe)  # type: ignore[no-untyped-call]

    return fenced_writes(client, jobs, fail)


def release_all_dependents(client: Any, job_ids: Sequence[str]) -> None:
    """``release_dependents`` for each failed job that has dependents (which one
    pipelined read finds)."""
    with client.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.exists(keys.dependents_key(job_id))
        waited_on = pipe.execute()
    for job_id, waited in zip(job_ids, waited_on, strict=True):
        if waited:
            release_dependents(client, job_id)


def release_dependents(client: Any, job_id: str) -> None:
    """After a failure, as RQ's ``Queue.enqueue_dependents`` does, without loading any
    job (RQ's would unpickle theirs): each dependent declared with
    ``allow_dependency_failures`` (not cancelled) whose other dependencies are finished or
    failed leaves its deferred registry and is queued on its own queue; the others stay
    deferred. One transaction under a ``WATCH`` of the dependents set, again if it moved."""
    import redis  # noqa: PLC0415 - only the rq source needs it

    with client.pipeline() as pipe:
        while True:
            try:
                pipe.watch(keys.dependents_key(job_id))
                waiting = sorted(m.decode() for m in pipe.smembers(keys.dependents_key(job_id)))
                ready = [found for found in (_ready(pipe, job_id, d) for d in waiting) if found]
                if not ready:
                    pipe.unwatch()
                    return
                seconds, micros = pipe.time()
                now = datetime.fromtimestamp(int(seconds) + int(micros) / 1e6, UTC)
                pipe.multi()
                for dependent, queue, at_front in ready:
                    pipe.zrem(keys.deferred_key(queue), dependent)
                    pipe.hset(keys.job_key(dependent), mapping={
                        "status": "queued", "enqueued_at": utcformat(now)})
                    (pipe.lpush if at_front else pipe.rpush)(keys.queue_key(queue), dependent)
                if len(ready) == len(waiting):
                    pipe.delete(keys.dependents_key(job_id))
                else:
                    pipe.srem(keys.dependents_key(job_id), *(d for d, _, _ in ready))
                pipe.execute()
                return
            except redis.WatchError:
                continue


def _ready(pipe: Any, failed: str, dependent: str) -> tuple[str, str, bool] | None:
    """The dependent, its queue and whether it goes to the front, when RQ would enqueue
    it after ``failed`` failed (``Job.dependencies_are_met``)."""
    allowed, status, origin, at_front = pipe.hmget(
        keys.job_key(dependent), "allow_dependency_failures", "status", "origin",
        "enqueue_at_front")
    if allowed != b"1" or status in (None, b"canceled") or not origin:
        return None
    others = sorted(m.decode() for m in pipe.smembers(keys.dependencies_key(dependent))
                    if m.decode() != failed)
    statuses = [pipe.hget(keys.job_key(other), "status") for other in others]
    if not all(s is None or s in (b"finished", b"failed") for s in statuses):
        return None
    return dependent, origin.decode(), at_front == b"1"
