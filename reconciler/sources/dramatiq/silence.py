"""How long each Dramatiq broker's heartbeat has stood still, on Redis's clock.

A broker writes its heartbeat (``__heartbeats__``) with its own clock, which the
reconciler never reads against another: it times each value by when it was first seen,
on Redis's clock, and keeps that in Redis (``__reconciler__.beats``: ``broker id`` ->
``"<value> <seconds>"``), so every pass, replica and one-shot ``reconciler pass`` reads the
same silence, and a sidecar started afresh does not begin counting from zero. A silence so
measured is a lower bound: the value was written before it was first seen.

One Lua script does it in Redis, atomically (two replicas never both time a value): it
keeps a copy of the heartbeats as the last pass saw them and when, finds the brokers whose
value has not moved since in C (``ZUNIONSTORE`` of the two, weighted 1 and -1: a score of
0 is a value unchanged), and times only those. A pass beside a thousand live workers thus
does no work per live worker but Redis's own set arithmetic, and reads back only the
brokers still for at least the silence asked for. The brokers Dramatiq forgot (its
maintenance removes a dead one without acks) are forgotten too. Needs Redis 6.2 or later
(``COPY``, ``ZMSCORE``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reconciler.sources.dramatiq.keys import Keys

STILL = """
-- KEYS: heartbeats, beats, the last copy of the heartbeats, when it was taken, scratch
-- ARGV: the least silence returned (seconds); '1' to return every broker
local t = redis.call('time')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local stamp = string.format('%.6f', now)
local at = tonumber(redis.call('get', KEYS[4]) or '')
local least = tonumber(ARGV[1])
local still, timed = {}, {}
if at then
  redis.call('zunionstore', KEYS[5], 2, KEYS[1], KEYS[3], 'WEIGHTS', 1, -1)
  local same = redis.call('zrangebyscore', KEYS[5], 0, 0)
  redis.call('del', KEYS[5])
  for first = 1, #same, 1000 do
    local brokers = {unpack(same, first, math.min(first + 999, #same))}
    local values = redis.call('zmscore', KEYS[1], unpack(brokers))
    local seen = redis.call('hmget', KEYS[2], unpack(brokers))
    local moved = {}
    for j, broker in ipairs(brokers) do
      local value, since = values[j], at
      local was, first_seen = string.match(seen[j] or '', '^(%S+) (%S+)$')
      if was and tonumber(was) == tonumber(value) and tonumber(first_seen) then
        since = tonumber(first_seen)
      else
        table.insert(moved, broker)
        table.insert(moved, value .. ' ' .. string.format('%.6f', at))
      end
      timed[broker] = true
      local silence = math.max(0, now - since)
      if silence >= least then
        table.insert(still, broker)
        table.insert(still, value)
        table.insert(still, string.format('%.6f', silence))
      end
    end
    if #moved > 0 then redis.call('hset', KEYS[2], unpack(moved)) end
  end
  if redis.call('hlen', KEYS[2]) > #same then
    for _, broker in ipairs(redis.call('hkeys', KEYS[2])) do
      if not timed[broker] then redis.call('hdel', KEYS[2], broker) end
    end
  end
end
local count = redis.call('zcard', KEYS[1])
if ARGV[2] == '1' then
  local every = redis.call('zrange', KEYS[1], 0, -1, 'WITHSCORES')
  for i = 1, #every, 2 do
    if not timed[every[i]] then
      table.insert(still, every[i])
      table.insert(still, every[i + 1])
      table.insert(still, '0')
    end
  end
end
if count > 0 then
  redis.call('copy', KEYS[1], KEYS[3], 'REPLACE')
else
  redis.call('del', KEYS[3])
end
redis.call('set', KEYS[4], stamp)
return {stamp, count, still}
"""


@dataclass(frozen=True, slots=True)
class Beats:
    """The heartbeats read at ``now`` (Redis's clock, seconds): how many brokers there
    are, and those still for at least the silence asked for, each with its value as
    written (milliseconds, its own clock) and its silence (seconds)."""

    now: float
    brokers: int
    still: dict[str, tuple[float, float]]

    @classmethod
    def read(cls, client: Any, keys: Keys, least_silence: float, *, every: bool = False
             ) -> Beats:
        """Every heartbeat timed, in one script; those still ``least_silence`` or more
        (``every``: and every other broker, still for 0 s)."""
        now, brokers, found = client.register_script(STILL)(
            keys=[keys.heartbeats, keys.beats, keys.beats_copy, keys.beats_at,
                  keys.beats_scratch],
            args=[repr(float(least_silence)), "1" if every else "0"])
        still = {found[i].decode(): (float(found[i + 1]), float(found[i + 2]))
                 for i in range(0, len(found), 3)}
        return cls(float(now), int(brokers), still)
