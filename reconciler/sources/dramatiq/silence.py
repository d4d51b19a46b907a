"""How long each Dramatiq broker's heartbeat has stood still, on Redis's clock.

A broker writes its heartbeat (``__heartbeats__``) with its own clock, which the
reconciler never reads against another: it times each value by when it was first seen,
on Redis's clock, and keeps that in Redis (``__reconciler__.beats``: ``broker id`` ->
``"<value> <seconds>"``), so every pass, replica and one-shot ``reconciler pass`` reads the
same silence, and a sidecar started afresh does not begin counting from zero. A silence so
measured is a lower bound: the value was written before it was first seen. Two replicas
that see a new value at once each write it; the later time wins, a shorter silence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reconciler.sources.dramatiq.keys import Keys


@dataclass(frozen=True, slots=True)
class Beats:
    """The heartbeats read at ``now`` (Redis's clock, seconds), and each one's silence."""

    now: float
    values: dict[str, float]
    """Each broker's heartbeat value as written (milliseconds, its own clock)."""
    seen: dict[str, tuple[float, float]]
    """What the beats hash held: each broker's value and when it was first seen."""

    @classmethod
    def read(cls, client: Any, keys: Keys) -> Beats:
        """``TIME``, the heartbeats and the beats hash, in one round trip."""
        with client.pipeline(transaction=False) as pipe:
            pipe.time()
            pipe.zrange(keys.heartbeats, 0, -1, withscores=True)
            pipe.hgetall(keys.beats)
            (seconds, micros), heartbeats, seen = pipe.execute()
        return cls(float(seconds) + float(micros) / 1e6,
                   {b.decode(): float(v) for b, v in heartbeats},
                   {b.decode(): parsed for b, raw in seen.items()
                    if (parsed := _parse(raw)) is not None})

    @property
    def silence(self) -> dict[str, float]:
        """Seconds each broker's heartbeat has stood still (0: it moved since last read)."""
        found = {}
        for broker, value in self.values.items():
            seen = self.seen.get(broker)
            found[broker] = (max(0.0, self.now - seen[1])
                             if seen is not None and seen[0] == value else 0.0)
        return found

    def remember(self, client: Any, keys: Keys) -> None:
        """The values not seen before, timed now; the brokers Dramatiq removed, forgotten."""
        moved = {b: f"{v!r} {self.now!r}" for b, v in self.values.items()
                 if self.seen.get(b, (None, 0.0))[0] != v}
        gone = [b for b in self.seen if b not in self.values]
        if not moved and not gone:
            return
        with client.pipeline(transaction=False) as pipe:
            if moved:
                pipe.hset(keys.beats, mapping=moved)
            if gone:
                pipe.hdel(keys.beats, *gone)
            pipe.execute()


def _parse(raw: bytes) -> tuple[float, float] | None:
    try:
        value, seen = raw.decode().split()
        return float(value), float(seen)
    except ValueError:
        return None
