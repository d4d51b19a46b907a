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

The fence: each job's move is one Lua script (``SWAP_SCRIPT``), atomic in Redis, that
reads the job as the action's read did (``SNAPSHOT_LUA``: its status, worker, times,
retries, attempt and TTL, its registry entry and its executions), compares it with that
read and writes only when nothing changed: a job its worker took, ended or requeued
meanwhile is refused (``fence_lost``) and nothing written. A queued job's cancel also
writes only while its id is still on its queue's list (a worker pops the id a moment
before it writes the hash, so the hash alone cannot show it taken).

A chunk (the bulk form's, ``kit.actions.BatchActions``) costs two round trips whatever its
size: its read (both scripts registered, then one read script per job) and its swap (one
swap script per job), each one pipeline; a single action is a chunk of one. A started
job's stop then waits for its worker, polling the chunk's stopped jobs together.
"""

from __future__ import annotations

import hashlib
import json
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
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

STOP_WAIT_SECONDS = 5.0
"""How long a cancel of a started job waits for its worker to end it ``stopped`` (a
work horse is killed and the job written within a second; the action's transaction on
the reconciler's own database stays open meanwhile)."""
STOP_POLL_SECONDS = 0.1
"""How often that wait reads the stopped jobs' statuses again (one pipeline for all)."""
STOP_CHANNEL = "rq:pubsub:{}"
"""A worker's command channel (``rq.command.PUBSUB_CHANNEL_TEMPLATE``)."""
STOP_SENT = "started (stop sent to its worker)"
"""A started job's state after its cancel when its worker has not ended it in time."""
CANCELED_KEY = REGISTRY_KEYS["canceled"]
EMPTY_EXC_INFO = zlib.compress(b"")
"""``exc_info`` as RQ's requeue leaves it: compressed empty text."""

FENCED = tuple(f for f in (*FIELDS, "ttl") if f not in ("data", "exc_info"))
"""The job's hash fields a fence compares (its payload and traceback are RQ's to keep)."""


def _lua(value: str) -> str:
    """A Lua string literal of a key prefix or field name (ASCII: JSON's quoting is
    Lua's)."""
    return json.dumps(value)


SNAPSHOT_LUA = f"""
local FENCED = {{{", ".join(_lua(f) for f in FENCED)}}}
local REGISTRIES = {{{", ".join(f"[{_lua(s)}] = {_lua(k.format(''))}"
                                for s, k in REGISTRY_KEYS.items() if s != "started")}}}
local function snapshot(id)
  local values = redis.call('HMGET', {_lua(job_key(''))} .. id, unpack(FENCED))
  local status, origin = values[{FENCED.index("status") + 1}], \
values[{FENCED.index("origin") + 1}]
  local entry = false
  local registry = status and REGISTRIES[status]
  if registry and origin then entry = redis.call('ZSCORE', registry .. origin, id) end
  local executions = redis.call('ZRANGE', {_lua(executions_key(''))} .. id, 0, -1)
  table.sort(executions)
  return cjson.encode({{values, entry, executions}})
end
"""
"""What a fence compares, read inside Redis: the job's ``FENCED`` fields (false where
absent), its entry in its status's registry (a started job's entry is its execution's,
compared through its executions) and its executions, sorted; as one JSON text, so that
the swap compares the very reading the action's read returned."""

READ_SCRIPT = SNAPSHOT_LUA + "return snapshot(ARGV[1])\n"
"""One job's reading (ARGV: its id)."""

SWAP_SCRIPT = SNAPSHOT_LUA + f"""
local id = ARGV[1]
if snapshot(id) ~= ARGV[2] then return false end
if ARGV[3] == 'retry' then
  redis.call('ZREM', KEYS[3], id)
  redis.call('HSET', KEYS[1], 'status', 'queued', 'started_at', '', 'ended_at', '',
             'exc_info', ARGV[4], 'enqueued_at', ARGV[5])
  if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'retries_left', ARGV[6]) end
  redis.call('HDEL', KEYS[1], {_lua(ATTEMPT_FIELD)})
  if ARGV[7] ~= '' then redis.call('EXPIRE', KEYS[1], ARGV[7]) end
  redis.call('RPUSH', KEYS[2], id)
  return 'queued'
end
if ARGV[6] ~= '' and redis.call('PUBLISH', ARGV[6], ARGV[7]) > 0 then return 'stopping' end
local removed = redis.call('LREM', KEYS[2], 1, id)
if ARGV[4] == 'queued' and removed == 0 then return false end
redis.call('HSET', KEYS[1], 'status', 'canceled')
redis.call('ZREM', KEYS[3], id)
redis.call('ZADD', KEYS[4], ARGV[5], id)
for i = 8, #ARGV do
  redis.call('ZREM', KEYS[5], id .. ':' .. ARGV[i])
  redis.call('DEL', KEYS[i - 1])
  redis.call('ZREM', KEYS[6], ARGV[i])
end
return 'canceled'
"""
"""One job's fenced move: nothing written (false) unless the job reads as ``ARGV[2]``.

KEYS: the job's hash, its queue's list, its status's registry, the canceled registry,
the started registry, its executions, then each execution's hash. ARGV: its id, its
reading, ``retry`` or ``cancel``; for a retry the emptied ``exc_info``, ``enqueued_at``,
``retries_left`` (empty: unchanged) and the TTL to keep (empty: none); for a cancel its
status, the canceled registry's score, its worker's command channel and the stop-job
message (a started job's; empty: none), then its executions. A started job whose worker
hears the stop is ``stopping``; one nobody hears for is written canceled like a waiting
one, in the same step."""

READ_SHA = hashlib.sha1(READ_SCRIPT.encode(), usedforsecurity=False).hexdigest()
SWAP_SHA = hashlib.sha1(SWAP_SCRIPT.encode(), usedforsecurity=False).hexdigest()
"""The scripts' names in Redis (``EVALSHA``: the SHA-1 of their text, as ``SCRIPT LOAD``
answers), so that a chunk sends each script's text once, not once per job."""
STOPPING = "stopping"
"""``SWAP_SCRIPT``'s answer for a started job whose worker heard the stop-job command."""


class RqActions:
    """Retry and cancel on RQ's Redis, a chunk of jobs at a time (a single action is a
    chunk of one; the actions' connection to this project's database is the kit's: the
    record and the hold)."""

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
        """The job as the actions compare it, or None (gone, or of a queue not watched).
        Redis locks nothing: the swap's script is the fence."""
        return self.read_many([job_key_], lock=lock).get(job_key_)

    def read_many(self, job_keys: Sequence[JobKey], *, lock: bool
                  ) -> dict[JobKey, ForeignJob]:
        """The jobs RQ has of these, in one round trip: both scripts registered (a
        restarted Redis forgets them; ``SCRIPT LOAD`` of a known one changes nothing),
        then each job's reading."""
        with (answering(self._config.url, "the action was not recorded"),
              self._redis.pipeline(transaction=False) as pipe):
            pipe.script_load(READ_SCRIPT)
            pipe.script_load(SWAP_SCRIPT)
            for key in job_keys:
                pipe.evalsha(READ_SHA, 0, str(key))
            readings = pipe.execute()[2:]
        found: dict[JobKey, ForeignJob] = {}
        for key, reading in zip(job_keys, readings, strict=True):
            read = self._parsed(reading)
            if read is not None:
                found[key] = ForeignJob(read["status"], STATUS_WORDS.get(read["status"]),
                                        read)
        return found

    def _parsed(self, reading: bytes) -> dict[str, Any] | None:
        """A reading as the writes use it (the reading itself kept for the fence); None
        for a job gone or of a queue not watched."""
        values, entry, executions = json.loads(reading.decode("utf-8", "replace"))
        read: dict[str, Any] = {
            field: text(value or None) for field, value in zip(FENCED, values, strict=True)}
        status, origin = read["status"], read["origin"]
        if status is None or origin is None or not self._config.watches(origin):
            return None
        read["entry"] = text(entry or None)
        # cjson writes an empty Lua table as an object: no executions.
        read["executions"] = tuple(sorted(text(e) or "" for e in executions or ()))
        read["reading"] = reading
        return read

    def refuses(self, action: OperatorAction, job: ForeignJob) -> str | None:
        """Nothing of RQ's own beyond the operator state machine."""
        return None

    def retry(self, job_key_: JobKey, job: ForeignJob) -> str | None:
        """RQ's requeue of a failed (or stopped, or canceled) job, with a fresh budget."""
        return self.swap_many(OperatorAction.RETRY, {job_key_: job}, {}).get(job_key_)

    def cancel(self, job_key_: JobKey, job: ForeignJob) -> str | None:
        """RQ's cancel of a waiting job; RQ's stop-job command to a started job's worker."""
        return self.swap_many(OperatorAction.CANCEL, {job_key_: job}, {}).get(job_key_)

    def swap_many(self, action: OperatorAction, jobs: Mapping[JobKey, ForeignJob],
                  refused: dict[JobKey, str]) -> dict[JobKey, str]:
        """Each job's retry or cancel, fenced on it as read, in one round trip; the state
        after of each job changed (one that moved meanwhile is absent). RQ has no refusal
        of its own (``refused`` stays as given). Started jobs being stopped are then
        waited for together."""
        with answering(self._config.url, "the action was not recorded; read the job again"):
            with self._redis.pipeline(transaction=False) as pipe:
                for key, job in jobs.items():
                    self._swap(pipe, action, str(key), job.fence)
                replies = pipe.execute()
            after: dict[JobKey, str | None] = {
                key: state for key, reply in zip(jobs, replies, strict=True)
                if (state := text(reply)) is not None}
            stopping = [key for key, state in after.items() if state == STOPPING]
            after.update(self._stopped(stopping))
        return {key: state for key, state in after.items() if state is not None}

    def _swap(self, pipe: Any, action: OperatorAction, job_id: str,
              read: Mapping[str, Any]) -> None:
        """One job's ``SWAP_SCRIPT`` queued on ``pipe``: its keys, as RQ names them, and
        what the action writes."""
        origin, status = read["origin"], read["status"]
        registry = REGISTRY_KEYS.get(status, REGISTRY_KEYS["deferred"]).format(origin)
        executions = read["executions"]
        keys = [job_key(job_id), queue_key(origin), registry, CANCELED_KEY.format(origin),
                started_key(origin), executions_key(job_id),
                *(execution_key(job_id, e) for e in executions)]
        if action is OperatorAction.RETRY:
            attempt = number(read[ATTEMPT_FIELD]) or 1
            left = number(read["retries_left"])
            ttl = number(read["ttl"])
            # RQ keeps no Retry(max): the retries the reconciler's resumes used are given
            # back (its own requeue gives none back). The attempt count starts again (the
            # script drops it): the pass counts from 1, the ledger from 0. A queued job
            # keeps its own TTL, as ``Job.cleanup`` sets it.
            args: list[Any] = [
                "retry", EMPTY_EXC_INFO, utcformat(datetime.now(UTC)),
                "" if left is None else left + attempt - 1,
                ttl if ttl is not None and ttl > 0 else ""]
        else:
            started = status == "started"
            channel = STOP_CHANNEL.format(read["worker_name"]) if started else ""
            payload = json.dumps({"command": "stop-job", "job_id": job_id}) if started \
                else ""
            args = ["cancel", status, int(time.time()), channel, payload, *executions]
        pipe.evalsha(SWAP_SHA, len(keys), *keys, job_id, read["reading"], *args)

    def _stopped(self, keys: Iterable[JobKey]) -> dict[JobKey, str | None]:
        """Each started job sent RQ's stop: ``stopped`` once its worker ended it so;
        that the stop was sent if it has not within ``STOP_WAIT_SECONDS``; None when the
        job ended some other way first (its worker ignores a stop for a job it no longer
        runs: nothing was changed)."""
        waiting = list(keys)
        ended: dict[JobKey, str | None] = {}
        deadline = time.monotonic() + STOP_WAIT_SECONDS
        while waiting and time.monotonic() < deadline:
            with self._redis.pipeline(transaction=False) as pipe:
                for key in waiting:
                    pipe.hget(job_key(str(key)), "status")
                statuses = [text(s) for s in pipe.execute()]
            for key, status in zip(waiting, statuses, strict=True):
                if status != "started":
                    ended[key] = status if status == "stopped" else None
            waiting = [key for key in waiting if key not in ended]
            if waiting:
                time.sleep(STOP_POLL_SECONDS)
        return {**ended, **dict.fromkeys(waiting, STOP_SENT)}


def open_actions(connection: Connection, config: RqConfig, kinds: KindRules) -> RqActions:
    """RQ's actions (``kit.actions.ActionsOpener``); ``connection`` is the kit's."""
    return RqActions(connect(config.url), config)
