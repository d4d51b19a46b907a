"""Resume and terminalize in Dramatiq's own shapes, each message fenced on itself as read.

Each move is one Lua script (atomic in Redis), as Dramatiq's own ``requeue`` and ``nack``
are: it acts only while the message is still in the acks set it was read from, its worker's
heartbeat where it was read (a worker that was only slow has moved it), its encoded form
unchanged (SHA-1 of the bytes read) and the middleware's mark as read. A
message that Dramatiq's maintenance put back, that its worker acknowledged or that another
pass moved first is left alone, and the pass records ``fence_lost``. A batch is one
pipeline of scripts: one round trip.

- **Resume** (Dramatiq's ``requeue``): out of the acks set, back at the end of its queue
  (a delay queue's message back on its delay queue, its ``eta`` kept), same Redis id; one
  that started counts a retry (``options.retries`` + 1, as Dramatiq's Retries middleware
  counts a failure), one that never started is put back as it was, or dropped where a
  copy of it started (the middleware's copy claim: its worker copied it off its delay
  queue and died before acknowledging it); a delayed original put back opens its claim,
  so that of the copies then made of it (the one its worker may have enqueued, the next
  worker's) only the first to start runs.
- **Terminalize** (Dramatiq's ``nack``): out of the acks set into its queue's dead-letter
  set, scored now (Redis's clock), the reason in its options (``reconciler_reason``, and
  ``traceback`` naming it, where Dramatiq's own dead letters carry theirs); where its
  worker's Results middleware stores results on this Redis, a failed result there, as
  Dramatiq's ``store_exception`` writes one, so ``message.get_result()`` raises with our
  reason instead of waiting. Never retried.

Either way the middleware's mark goes with the move.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from reconciler.sources.dramatiq.keys import (
    BUDGET_OPTION,
    COPY_CLAIM_SECONDS,
    DELAY_SUFFIX,
    Keys,
    Mark,
)
from reconciler.sources.kit.fences import ForeignFence

FAILED_RESULT_TYPE = "WorkerDied"
"""The exception type a failed result names (``ResultFailure.orig_exc_type``)."""
_RESULT_CANARY = "dramatiq.results.Result"

MOVE = """
-- KEYS: acks, msgs, queue, dead, dead msgs, marks, result (the marks again: none),
--       heartbeats, its copy claim
-- ARGV: action, redis id, sha1 as read, mark as read, new data, result, result ttl ms,
--       broker id, heartbeat as read, claim seconds, '1' when it only was fetched,
--       '1' when it is a delayed original
if redis.call('sismember', KEYS[1], ARGV[2]) == 0 then return 0 end
if tonumber(redis.call('zscore', KEYS[8], ARGV[8]) or '-1') ~= tonumber(ARGV[9]) then
  return 0
end
local data = redis.call('hget', KEYS[2], ARGV[2])
if (not data) or redis.sha1hex(data) ~= ARGV[3] then return 0 end
if (redis.call('hget', KEYS[6], ARGV[2]) or '') ~= ARGV[4] then return 0 end
redis.call('srem', KEYS[1], ARGV[2])
redis.call('hdel', KEYS[6], ARGV[2])
if ARGV[1] == 'resume' and ARGV[11] == '1' and ARGV[12] == '1' then
  local claim = redis.call('get', KEYS[9])
  if claim and claim ~= 'open' then
    -- A copy of it started (its worker copied it off its delay queue, then died before
    -- acknowledging this one): dropped, as an acknowledgement.
    redis.call('hdel', KEYS[2], ARGV[2])
    return 1
  end
  redis.call('set', KEYS[9], 'open', 'EX', ARGV[10])
end
if ARGV[1] == 'terminalize' then
  local t = redis.call('time')
  redis.call('hdel', KEYS[2], ARGV[2])
  redis.call('zadd', KEYS[4], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000),
             ARGV[2])
  redis.call('hset', KEYS[5], ARGV[2], ARGV[5])
  if ARGV[6] ~= '' then
    redis.call('del', KEYS[7])
    redis.call('lpush', KEYS[7], ARGV[6])
    redis.call('pexpire', KEYS[7], ARGV[7])
  end
else
  redis.call('hset', KEYS[2], ARGV[2], ARGV[5])
  redis.call('rpush', KEYS[3], ARGV[2])
end
return 1
"""


@dataclass(frozen=True, slots=True)
class DramatiqFence(ForeignFence):
    """The message as its decision read it, repeated by its move."""

    queue: str
    redis_id: str
    broker_id: str
    data_sha1: str
    mark: str
    started: bool
    heartbeat: float


def exc_text(reason: str) -> str:
    """The dead letter's ``traceback`` and the failed result's message."""
    return (f"reconciler: {reason} (stale-claim-reconciler: the worker running this message "
            "is gone; the message is not retried)")


def _reencoded(raw: bytes, **options: Any) -> bytes:
    """The message with ``options`` set, encoded as Dramatiq's JSON encoder writes."""
    message = json.loads(raw)
    message["options"] = {**message.get("options", {}), **options}
    return json.dumps(message, separators=(",", ":")).encode("utf-8")


def resume(client: Any, keys: Keys, messages: Sequence[tuple[str, DramatiqFence]]
           ) -> list[str]:
    """Each message back on its queue (a retry counted where it started); the ids moved."""
    return _moves(client, keys, messages, "resume", None)


def terminalize(client: Any, keys: Keys, messages: Sequence[tuple[str, DramatiqFence]],
                reason: str) -> list[str]:
    """Each message dead-lettered with ``reason`` (and its result failed); the ids moved."""
    return _moves(client, keys, messages, "terminalize", reason)


def _moves(client: Any, keys: Keys, messages: Sequence[tuple[str, DramatiqFence]],
           action: str, reason: str | None) -> list[str]:
    if not messages:
        return []
    with client.pipeline(transaction=False) as pipe:
        for _, fence in messages:
            pipe.hget(keys.messages(fence.queue), fence.redis_id)
        datas = pipe.execute()
    script = client.register_script(MOVE)
    tried: list[str] = []
    with client.pipeline(transaction=False) as pipe:
        for (job_id, fence), raw in zip(messages, datas, strict=True):
            if raw is None:
                continue  # acknowledged or moved since it was read: its fence is lost
            args = _args(action, fence, raw, reason)
            if args is None:
                continue
            new, result_key, result, ttl = args
            script(keys=[keys.acks(fence.broker_id, fence.queue), keys.messages(fence.queue),
                         keys.queue(fence.queue), keys.dead(fence.queue),
                         keys.dead_messages(fence.queue), keys.marks,
                         result_key or keys.marks, keys.heartbeats,
                         keys.copy_claim(fence.redis_id)],
                   args=[action, fence.redis_id, fence.data_sha1, fence.mark, new, result,
                         ttl, fence.broker_id, repr(fence.heartbeat), COPY_CLAIM_SECONDS,
                         "0" if fence.started else "1",
                         "1" if fence.queue.endswith(DELAY_SUFFIX) else "0"], client=pipe)
            tried.append(job_id)
        done = pipe.execute()
    return [job_id for job_id, moved in zip(tried, done, strict=True) if moved == 1]


def _args(action: str, fence: DramatiqFence, raw: bytes, reason: str | None
          ) -> tuple[bytes, str | None, str, int] | None:
    """The new encoded message, and the result to store, for one move (None: the message
    as stored now cannot be re-encoded; its fence cannot hold either)."""
    mark = Mark.decode(fence.mark)
    # The budget the decision counted stays readable once the mark is gone.
    budget = ({} if mark is None or mark.max_retries is None
              else {BUDGET_OPTION: mark.max_retries})
    try:
        if action == "resume":
            if not fence.started:
                return raw, None, "", 0
            retries = json.loads(raw).get("options", {}).get("retries", 0)
            return _reencoded(raw, retries=int(retries) + 1, **budget), None, "", 0
        text = exc_text(str(reason))
        new = _reencoded(raw, reconciler_reason=str(reason), traceback=text, **budget)
    except (ValueError, TypeError, AttributeError):
        return None
    if mark is None or mark.result_key is None or mark.result_ttl_ms is None:
        return new, None, "", 0
    result = json.dumps({"__t": _RESULT_CANARY,
                         "exn": {"type": FAILED_RESULT_TYPE, "msg": text}},
                        separators=(",", ":"))
    return new, mark.result_key, result, mark.result_ttl_ms
