"""Resume and terminalize in RQ's own shapes, each fenced on the job as read.

Each write is one ``MULTI``/``EXEC`` under a ``WATCH`` of the job's own keys only: its
hash (every heartbeat of its own worker writes ``last_heartbeat`` there, in the same
transaction that renews its registry entry; a worker that finishes or fails it writes
its ``status`` there) and its execution's hash. Before ``MULTI`` the job is read again
and compared with the fence: its status, worker, attempt, retries left and its entry in
the started registry with the same score. The registry itself is never watched, so a
heartbeat on another job of the same queue (which rewrites that sorted set) never fails
the fence. A fence that no longer holds changes nothing: the pass records
``fence_lost``.

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
from collections.abc import Callable
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


def fenced_write(client: Any, job_id: str, fence: RqFence,
                 write: Callable[[Any, Held, datetime], None]) -> bool:
    """``write`` queued in one transaction, if the job is still as ``fence`` read it."""
    import redis  # noqa: PLC0415 - only the rq source needs it

    member = f"{job_id}:{fence.execution_id}"
    with client.pipeline() as pipe:
        try:
            pipe.watch(keys.job_key(job_id), keys.execution_key(job_id, fence.execution_id))
            raw = pipe.hmget(keys.job_key(job_id), _READ)
            held = Held({name: None if v is None else v.decode() for name, v in
                         zip(_READ, raw, strict=True)})
            score = pipe.zscore(keys.started_key(fence.queue), member)
            seconds, micros = pipe.time()
            if (score != fence.score or held.values["status"] != fence.status
                    or (held.values["worker_name"] or None) != fence.worker
                    or held.int("retries_left") != fence.retries_left
                    or (held.int(ATTEMPT_FIELD) or 1) != fence.attempt):
                pipe.unwatch()
                return False
            pipe.multi()
            now = datetime.fromtimestamp(int(seconds) + int(micros) / 1e6, UTC)
            _leave_started(pipe, job_id, fence)
            write(pipe, held, now)
            pipe.execute()
        except redis.WatchError:
            return False
    return True


def _leave_started(pipe: Any, job_id: str, fence: RqFence) -> None:
    """Out of the started registry, its execution record deleted (``Execution.delete``)."""
    pipe.zrem(keys.started_key(fence.queue), f"{job_id}:{fence.execution_id}")
    pipe.delete(keys.execution_key(job_id, fence.execution_id))
    pipe.zrem(keys.executions_key(job_id), fence.execution_id)


def resume(client: Any, job_id: str, fence: RqFence) -> bool:
    """The job requeued on its own queue as RQ's own retry does; False: fence lost."""
    def write(pipe: Any, held: Held, now: datetime) -> None:
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

    return fenced_write(client, job_id, fence, write)


def terminalize(client: Any, job_id: str, fence: RqFence, reason: str) -> bool:
    """The job failed into its queue's failed registry with our reason; False: fence
    lost."""
    from rq.results import Result  # noqa: PLC0415 - RQ's own record of a failure

    def write(pipe: Any, held: Held, now: datetime) -> None:
        text = exc_text(reason)
        queue = held.values["origin"] or fence.queue
        ttl = held.int("failure_ttl")
        ttl = DEFAULT_FAILURE_TTL if ttl is None else ttl
        pipe.hset(keys.job_key(job_id), mapping={
            "status": "failed", "ended_at": utcformat(now),
            "exc_info": zlib.compress(text.encode())})
        # ``FailedJobRegistry.add`` and ``Job.cleanup`` with the failure TTL.
        pipe.zadd(keys.failed_key(queue), {job_id: ttl if ttl < 0 else now.timestamp() + ttl})
        if ttl > 0:
            for key in (keys.job_key(job_id), keys.dependents_key(job_id),
                        keys.dependencies_key(job_id)):
                pipe.expire(key, ttl)
        Result(job_id, Result.Type.FAILED, connection=client, exc_string=text,
               worker_name=fence.worker or "", execution_id=fence.execution_id,
               execution_ended_at=now).save(ttl=ttl, pipeline=pipe)  # type: ignore[no-untyped-call]

    return fenced_write(client, job_id, fence, write)


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
