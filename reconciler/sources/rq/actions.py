"""Operator retry and cancel on RQ (2.x), written in Redis as RQ's own functions write
them, each fenced on the job as read.

- **retry** (``failed``, ``stopped`` or ``canceled``, a terminalization of ours included):
  RQ's ``FailedJobRegistry.requeue`` shape: out of its registry, ``status = queued``,
  ``started_at``, ``ended_at`` and ``exc_info`` emptied, ``enqueued_at`` now, and its id
  pushed on its own queue, so the app's next ``rq worker`` runs it under the same id and
  data. A fresh budget: the reconciler's attempt count (``reconciler_attempt``) starts
  again, and a job enqueued with a ``Retry`` gets back the retries the reconciler's
  resumes used (RQ keeps no ``Retry(max)``, so those its own retries used after an
  exception stay used, as RQ's own requeue leaves them).
- **cancel** of a ``queued``, ``deferred`` or ``scheduled`` job: RQ's ``Job.cancel``
  shape: ``status = canceled``, off its queue's list and its registry, into the canceled
  registry; its dependents stay deferred, as RQ's cancel leaves them.
- **cancel** of a ``started`` job: RQ's own way to stop a running job,
  ``send_stop_job_command``'s message to its worker, whose work horse is killed and which
  ends the job ``stopped`` in the failed registry (RQ never retries a stopped job). RQ's
  ``Job.cancel`` of a running job would leave its work horse running and the worker would
  write its end over it. A worker that does not hear the message (gone: nobody listens on
  its channel) cannot write anything later, so the job is then written ``canceled`` as
  above, out of the started registry and its execution record.

The fence: a ``WATCH`` on the job's hash, then the fields read compared with the action's
read (status, worker, times, retries, attempt, registry entry, executions), then the
writes in one ``MULTI``: a job its worker took, ended or requeued meanwhile is refused
(``fence_lost``) and nothing written. A queued job's cancel is one script inside it that
writes only while the id is still on its queue's list (a worker pops the id a moment
before it writes the hash). A worker's heartbeat on the job breaks the ``WATCH`` without
changing what is compared: the check runs again, a few times.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.engine import Connection

from reconciler.core.kinds import KindRules
from reconciler.core.vocabulary import JobKey, OperatorAction
from reconciler.sources.kit.actions import ForeignJob
from reconciler.sources.rq.config import RqConfig
from reconciler.sources.rq.keys import (
    execution_key,
    executions_key,
    job_key,
    queue_key,
    started_key,
)
from reconciler.sources.rq.listing import (
    FIELDS,
    REGISTRY_KEYS,
    STATUS_WORDS,
    answering,
    connect,
    number,
    text,
)
from reconciler.sources.rq.snapshot import ATTEMPT_FIELD
from reconciler.sources.rq.writes import utcformat

WATCH_TRIES = 5
"""How often a fenced write tries again after a ``WATCH`` broke with nothing compared
changed (a heartbeat of the job's worker)."""
STOP_WAIT_SECONDS = 5.0
"""How long a cancel of a started job waits for its worker to end it ``stopped`` (a
work horse is killed and the job written within a second; the action's transaction on
the reconciler's own database stays open meanwhile)."""
STOP_CHANNEL = "rq:pubsub:{}"
"""A worker's command channel (``rq.command.PUBSUB_CHANNEL_TEMPLATE``)."""
CANCELED_KEY = REGISTRY_KEYS["canceled"]

Write = Callable[[Any], None]
"""The writes of one action, queued on a pipeline inside its ``MULTI``."""


CANCEL_SCRIPT = """
local removed = redis.call('LREM', KEYS[2], 1, ARGV[1])
if ARGV[2] == 'queued' and removed == 0 then return 0 end
redis.call('HSET', KEYS[1], 'status', 'canceled')
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1])
return 1
"""
"""RQ's ``Job.cancel`` of a job, in one step: a queued job only while its id is still on
its queue's list (a worker that popped it sets its status a moment later: the hash's
``WATCH`` cannot see that yet); 0: nothing written."""


def canceled_shape(pipe: Any, job_id: str, read: Mapping[str, Any]) -> None:
    """RQ's ``Job.cancel``: canceled, off its queue and its registry (for a started job
    its executions too), into the canceled registry; the script's reply comes first."""
    origin, status = read["origin"], read["status"]
    registry = REGISTRY_KEYS.get(status, REGISTRY_KEYS["deferred"]).format(origin)
    pipe.eval(CANCEL_SCRIPT, 4, job_key(job_id), queue_key(origin), registry,
              CANCELED_KEY.format(origin), job_id, status, int(time.time()))
    for execution in read["executions"]:
        pipe.zrem(started_key(origin), f"{job_id}:{execution}")
        pipe.delete(execution_key(job_id, execution))
        pipe.zrem(executions_key(job_id), execution)


class RqActions:
    """Retry and cancel on RQ's Redis, one job at a time (the actions' connection to this
    project's database is the kit's: the record and the hold)."""

    limits: Mapping[OperatorAction, str] = {
        OperatorAction.HOLD: "RQ's own cleanup fails a started job, or requeues it while "
                             "its Retry has retries left, once its registry entry expires "
                             "(about a minute after its worker's last heartbeat)",
        OperatorAction.CANCEL: "as RQ cancels: a waiting job ends canceled and never "
                               "runs; a started one is stopped through its worker (RQ's "
                               "stop-job command) and ends stopped; dependents stay "
                               "deferred",
        OperatorAction.RETRY: "runs again from its start unless it records steps in the "
                              "step ledger",
    }

    def __init__(self, redis: Any, config: RqConfig) -> None:
        self._redis = redis
        self._config = config

    def read(self, job_key_: JobKey, *, lock: bool) -> ForeignJob | None:
        """The job's hash as the actions compare it, or None (gone, or of a queue not
        watched). Redis locks nothing: the swap's ``WATCH`` is the fence."""
        with answering(self._config.url, "the action was not recorded"):
            read = self._snapshot(self._redis, str(job_key_))
        if read is None:
            return None
        return ForeignJob(read["status"], STATUS_WORDS.get(read["status"]), read)

    def _snapshot(self, redis: Any, job_id: str) -> dict[str, Any] | None:
        """What a fence compares: the job's fields, its registry entry and its
        executions."""
        names = (*FIELDS, "ttl")
        values = dict(zip(names, redis.hmget(job_key(job_id), *names), strict=True))
        status, origin = text(values["status"]), text(values["origin"])
        if status is None or origin is None or not self._config.watches(origin):
            return None
        read: dict[str, Any] = {f: text(values[f]) for f in names
                                if f not in ("data", "exc_info")}
        registry = REGISTRY_KEYS.get(status)
        read["entry"] = None if registry is None or status == "started" else \
            redis.zscore(registry.format(origin), job_id)
        read["executions"] = tuple(sorted(
            text(e) or "" for e in redis.zrange(executions_key(job_id), 0, -1)))
        return read

    def refuses(self, action: OperatorAction, job: ForeignJob) -> str | None:
        """Nothing of RQ's own beyond the operator state machine."""
        return None

    def retry(self, job_key_: JobKey, job: ForeignJob) -> str | None:
        """RQ's requeue of a failed (or stopped, or canceled) job, with a fresh budget."""
        job_id, read = str(job_key_), job.fence
        origin = read["origin"]

        def requeue(pipe: Any) -> None:
            pipe.zrem(REGISTRY_KEYS[read["status"]].format(origin), job_id)
            fields: dict[str, Any] = {
                "status": "queued", "started_at": "", "ended_at": "",
                "exc_info": zlib.compress(b""), "enqueued_at": utcformat(datetime.now(UTC))}
            attempt = number(read[ATTEMPT_FIELD]) or 1
            left = number(read["retries_left"])
            if left is not None:
                # RQ keeps no Retry(max): the retries the reconciler's resumes used are
                # given back (its own requeue gives none back).
                fields["retries_left"] = left + attempt - 1
            pipe.hset(job_key(job_id), mapping=fields)
            # The attempt count starts again: the pass counts from 1, the ledger from 0.
            pipe.hdel(job_key(job_id), ATTEMPT_FIELD)
            ttl = number(read["ttl"])
            if ttl is not None and ttl > 0:  # ``Job.cleanup`` with a queued job's own TTL
                pipe.expire(job_key(job_id), ttl)
            pipe.rpush(queue_key(origin), job_id)

        with answering(self._config.url, "the action was not recorded; read the job again"):
            done = self._fenced(job_id, read, requeue)
        return None if done is None else "queued"

    def cancel(self, job_key_: JobKey, job: ForeignJob) -> str | None:
        """RQ's cancel of a waiting job; RQ's stop-job command to a started job's worker."""
        with answering(self._config.url, "the action was not recorded; read the job again"):
            return self._cancel(str(job_key_), job.fence)

    def _cancel(self, job_id: str, read: Mapping[str, Any]) -> str | None:
        if read["status"] != "started":
            return self._canceled(job_id, read)
        payload = json.dumps({"command": "stop-job", "job_id": job_id})
        channel = STOP_CHANNEL.format(read["worker_name"])
        heard = self._fenced(job_id, read, lambda p: p.publish(channel, payload))
        if heard is None:
            return None
        if heard[0]:
            return self._stopped(job_id)
        # Nobody listens on the worker's channel: it is gone and will write nothing more.
        return self._canceled(job_id, read)

    def _canceled(self, job_id: str, read: Mapping[str, Any]) -> str | None:
        """RQ's canceled shape, fenced; None when the job moved (nothing written)."""
        done = self._fenced(job_id, read, lambda p: canceled_shape(p, job_id, read))
        return None if done is None or not done[0] else "canceled"

    def _stopped(self, job_id: str) -> str | None:
        """``stopped`` once the job's worker ended it so; that the stop was sent if it has
        not within ``STOP_WAIT_SECONDS``; None when the job ended some other way first
        (its worker ignores a stop for a job it no longer runs: nothing was changed)."""
        deadline = time.monotonic() + STOP_WAIT_SECONDS
        while time.monotonic() < deadline:
            status = text(self._redis.hget(job_key(job_id), "status"))
            if status != "started":
                return status if status == "stopped" else None
            time.sleep(0.1)
        return "started (stop sent to its worker)"

    def _fenced(self, job_id: str, read: Mapping[str, Any], write: Write
                ) -> list[Any] | None:
        """``write`` in one ``MULTI`` while the job is still as ``read`` (``WATCH`` on its
        hash); the ``EXEC``'s replies, or None when the job moved (nothing written)."""
        from redis.exceptions import WatchError  # noqa: PLC0415 - the rq source's package

        with self._redis.pipeline() as pipe:
            for _ in range(WATCH_TRIES):
                try:
                    pipe.watch(job_key(job_id))
                    if self._snapshot(pipe, job_id) != read:
                        pipe.unwatch()
                        return None
                    pipe.multi()
                    write(pipe)
                    return list(pipe.execute())
                except WatchError:
                    continue
        return None


def open_actions(connection: Connection, config: RqConfig, kinds: KindRules) -> RqActions:
    """RQ's actions (``kit.actions.ActionsOpener``); ``connection`` is the kit's."""
    return RqActions(connect(config.url), config)
