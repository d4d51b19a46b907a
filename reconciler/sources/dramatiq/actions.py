"""Operator retry and cancel on Dramatiq, written in Redis as Dramatiq's own moves write
them, each fenced on the message as read (one Lua script, atomic in Redis).

- **retry** of a dead-lettered message (ours, or Dramatiq's own after its retries ran
  out): out of the dead-letter set onto the end of its queue, runnable now, the same
  Redis id, a fresh budget (``retries`` 0) and our reason and traceback dropped from its
  options, as a message first enqueued; a delayed one's ``eta`` dropped.
- **cancel** of a queued or delayed message: off its list into its queue's dead-letter
  set, as Dramatiq's ``nack`` puts one, reason ``operator_cancel``. A message a worker has
  fetched is refused (``dramatiq_fetched``): Dramatiq cannot take back what a worker holds
  in memory, started or not, and that worker would still run it.

A message found anywhere else than where it was read (a worker fetched it, Dramatiq's
maintenance or another operator moved it) is refused ``fence_lost`` and nothing changes.
Reading one message looks for its ``message_id`` through the watched queues' stored
messages (``listing``): an operator's action, not a pass's. A bulk chunk
(``BatchActions``) is read in two round trips (``located_many``: one SCAN page per
thousand keys of the namespace, then one transaction) and moved in one: every
message's own ``MOVE``, fenced as one job's is, in one pipelined MULTI/EXEC.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from reconciler.core.kinds import KindRules
from reconciler.core.vocabulary import JobKey, OperatorAction, OperatorStatusReason
from reconciler.sources.dramatiq.config import DramatiqConfig
from reconciler.sources.dramatiq.keys import BUDGET_OPTION, COPY_OPTION, Keys, canonical, digest
from reconciler.sources.dramatiq.listing import STATUS_WORDS, answering, located, located_many
from reconciler.sources.dramatiq.writes import exc_text
from reconciler.sources.kit.actions import ForeignJob

FETCHED_REFUSAL = "dramatiq_fetched"
_DROPPED = ("reconciler_reason", "traceback", "eta", BUDGET_OPTION, COPY_OPTION)

MOVE = """
-- KEYS: from (a list, or the dead-letter set), its msgs, to (a list, or the dead-letter
--       set), its msgs
-- ARGV: 'retry' or 'cancel', redis id, sha1 as read, new data
local there
if ARGV[1] == 'retry' then
  there = redis.call('zrem', KEYS[1], ARGV[2])
else
  there = redis.call('lrem', KEYS[1], 1, ARGV[2])
end
if there == 0 then return 0 end
local data = redis.call('hget', KEYS[2], ARGV[2])
if (not data) or redis.sha1hex(data) ~= ARGV[3] then
  -- Changed under us: put it back where it was, as it was, and change nothing.
  if ARGV[1] == 'retry' then
    local t = redis.call('time')
    redis.call('zadd', KEYS[1], tonumber(t[1]) * 1000, ARGV[2])
  else
    redis.call('lpush', KEYS[1], ARGV[2])
  end
  return 0
end
redis.call('hdel', KEYS[2], ARGV[2])
redis.call('hset', KEYS[4], ARGV[2], ARGV[4])
if ARGV[1] == 'retry' then
  redis.call('rpush', KEYS[3], ARGV[2])
else
  local t = redis.call('time')
  redis.call('zadd', KEYS[3], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000),
             ARGV[2])
end
return 1
"""
MOVE_SHA = digest(MOVE.encode())
"""``MOVE``'s name in Redis's script cache (its SHA-1), computed once: every move is an
``EVALSHA``, the script loaded only where Redis answers it has not got it."""


@dataclass(frozen=True, slots=True)
class Located:
    """Where a message was read: its status, the queue whose ``.msgs`` holds it, its Redis
    id and its bytes."""

    status: str
    queue: str
    redis_id: str
    data: bytes


@dataclass(frozen=True, slots=True)
class _Move:
    """One message's ``MOVE``: its keys, its arguments, and its state once moved."""

    keys: list[str]
    args: list[str | bytes]
    after: str


class DramatiqActions:
    """Retry and cancel of Dramatiq messages for one action's transaction: one message
    (``SystemActions``) or a bulk chunk (``BatchActions``), every move the same ``MOVE``."""

    limits: Mapping[OperatorAction, str] = {
        OperatorAction.HOLD: "Dramatiq's own maintenance still puts a gone worker's "
                             "messages back once its heartbeat_timeout has passed",
        OperatorAction.CANCEL: "a message a worker has fetched is not cancelled: Dramatiq "
                               "cannot take it back from the worker",
    }

    def __init__(self, config: DramatiqConfig, client: Any) -> None:
        self.config = config
        self.client = client
        self.keys = Keys(config.namespace)

    def read(self, job_key: JobKey, *, lock: bool) -> ForeignJob | None:
        """The message as it is now (Redis has no lock to take: the move is fenced)."""
        with answering(self.config.url):
            found = located(self.client, self.keys, self.config, str(job_key))
        return None if found is None else _job(found)

    def read_many(self, job_keys: Sequence[JobKey], *, lock: bool
                  ) -> dict[JobKey, ForeignJob]:
        """The chunk's messages as they are now, located and read in two round trips
        (``located_many``; a SCAN page more per thousand keys); no lock, as ``read``."""
        with answering(self.config.url):
            found = located_many(self.client, self.keys, self.config,
                                 [str(key) for key in job_keys])
        return {key: _job(found[str(key)]) for key in job_keys if str(key) in found}

    def refuses(self, action: OperatorAction, job: ForeignJob) -> str | None:
        """A fetched message cannot be cancelled (its worker holds it)."""
        if action is OperatorAction.CANCEL and job.state in ("fetched", "started",
                                                             "finished"):
            return FETCHED_REFUSAL
        return None

    def retry(self, job_key: JobKey, job: ForeignJob) -> str | None:
        """The dead letter back on its queue, a fresh budget."""
        return self._swap_one(OperatorAction.RETRY, job)

    def cancel(self, job_key: JobKey, job: ForeignJob) -> str | None:
        """The queued or delayed message dead-lettered, reason ``operator_cancel``."""
        return self._swap_one(OperatorAction.CANCEL, job)

    def swap_many(self, action: OperatorAction, jobs: Mapping[JobKey, ForeignJob],
                  refused: dict[JobKey, str]) -> dict[JobKey, str]:
        """Each message's retry or cancel, the moves of the chunk in one round trip; a
        message that moved meanwhile is absent (Dramatiq's own rules refuse nothing here:
        a fetched message was refused before, by ``refuses``)."""
        moves = {key: self._planned(action, job) for key, job in jobs.items()}
        done = self._run(list(moves.values()))
        return {key: move.after for (key, move), moved in zip(moves.items(), done,
                                                               strict=True) if moved}

    def _swap_one(self, action: OperatorAction, job: ForeignJob) -> str | None:
        """One message's retry or cancel: its state after, or None when it moved."""
        move = self._planned(action, job)
        [moved] = self._run([move])
        return move.after if moved else None

    def _planned(self, action: OperatorAction, job: ForeignJob) -> _Move:
        """The ``MOVE`` of a message as read: a retry from its dead-letter set to the end
        of its queue, a fresh budget; a cancel from its list into its dead-letter set."""
        found: Located = job.fence
        if action is OperatorAction.RETRY:
            queue = canonical(json.loads(found.data).get("queue_name") or found.queue)
            new = _rewritten(found.data, queue_name=queue, options={"retries": 0})
            return _Move([self.keys.dead(found.queue), self.keys.dead_messages(found.queue),
                          self.keys.queue(queue), self.keys.messages(queue)],
                         ["retry", found.redis_id, digest(found.data), new], "queued")
        reason = OperatorStatusReason.OPERATOR_CANCEL.value
        new = _rewritten(found.data, options={"reconciler_reason": reason,
                                              "traceback": exc_text(reason)})
        return _Move([self.keys.queue(found.queue), self.keys.messages(found.queue),
                      self.keys.dead(found.queue), self.keys.dead_messages(found.queue)],
                     ["cancel", found.redis_id, digest(found.data), new], "dead")

    def _run(self, moves: Sequence[_Move]) -> list[bool]:
        """Whether each move applied: every ``MOVE`` by its digest in one transaction's
        pipeline, one round trip. Where Redis lost the script (restarted, flushed) those
        moves ran nothing: the script is loaded and they are sent again."""
        from redis.exceptions import NoScriptError  # noqa: PLC0415 - the source's extra

        with answering(self.config.url):
            done = self._pipelined(moves)
            missing = [i for i, answer in enumerate(done) if isinstance(answer, NoScriptError)]
            if missing:
                self.client.script_load(MOVE)
                again = self._pipelined([moves[i] for i in missing])
                for i, answer in zip(missing, again, strict=True):
                    done[i] = answer
            for answer in done:
                if isinstance(answer, Exception):
                    raise answer
        return [bool(answer) for answer in done]

    def _pipelined(self, moves: Sequence[_Move]) -> list[Any]:
        """Each move's answer (an error in its place), in one MULTI/EXEC: a connection
        lost before EXEC moves none of them."""
        with self.client.pipeline(transaction=True) as pipe:
            for move in moves:
                pipe.evalsha(MOVE_SHA, len(move.keys), *move.keys, *move.args)
            return list(pipe.execute(raise_on_error=False))


def _job(found: tuple[str, str, str, bytes]) -> ForeignJob:
    """A message where ``located`` found it, as the desk reads a job."""
    status, queue, redis_id, data = found
    return ForeignJob(status, STATUS_WORDS.get(status), Located(status, queue, redis_id, data))


def _rewritten(data: bytes, *, queue_name: str | None = None,
               options: Mapping[str, Any]) -> bytes:
    """The message with ``options`` set (our own and ``eta`` dropped first on a retry)."""
    message = json.loads(data)
    kept = {k: v for k, v in (message.get("options") or {}).items()
            if queue_name is None or k not in _DROPPED}
    message["options"] = {**kept, **options}
    if queue_name is not None:
        message["queue_name"] = queue_name
    return json.dumps(message, separators=(",", ":")).encode("utf-8")


def open_actions(conn: Connection, config: DramatiqConfig, kinds: KindRules
                 ) -> DramatiqActions:
    """The dramatiq source's actions (the reconciler's connection is not used: the
    message lives in Redis)."""
    from reconciler.sources.dramatiq.listing import connect  # noqa: PLC0415

    return DramatiqActions(config, connect(config.url))
