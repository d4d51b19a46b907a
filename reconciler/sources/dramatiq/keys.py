"""Dramatiq's keys in Redis, the middleware's beside them, and the versions read.

Read from Dramatiq's own code (``brokers/redis.py`` and ``brokers/redis/dispatch.lua``,
the same from 2.0.0 to 2.2.1), under the broker's ``namespace`` (``ns``, default
``dramatiq``):

- ``{ns}:{queue}``: the queue, a list of Redis message ids (``redis_message_id``, a fresh
  uuid4 per enqueue: a retry is a new id, the message's own ``message_id`` stays);
  ``{ns}:{queue}.msgs``: a hash, id -> the encoded message (JSON by default);
- ``{ns}:{queue}.DQ`` (and ``.DQ.msgs``): the delay queue, whose messages a worker moves
  to ``{queue}`` once their ``eta`` is past;
- ``{ns}:{queue}.XQ``: the dead-letter queue, a sorted set scored by when (ms), with
  ``{ns}:{queue}.XQ.msgs``; a ``.DQ`` queue dead-letters into its base queue's;
- ``{ns}:__acks__.{broker_id}.{queue}``: the ids a worker fetched and has not acknowledged
  (prefetched or running: Redis alone cannot tell which);
- ``{ns}:__heartbeats__``: a sorted set, ``broker_id`` -> the milliseconds (the sender's
  clock) of its last broker command. ``broker_id`` is a uuid4 per broker object, so a
  worker process started again, under any name, is a new id.

The middleware (``reconciler.integrations.dramatiq``) adds, in the same namespace:

- ``{ns}:__reconciler__.workers``: a hash, ``broker_id`` -> the worker process's Dramatiq
  version, written as it boots and with its first started mark: a gone broker holding
  messages without an entry ran without the middleware;
- ``{ns}:__reconciler__.marks``: a hash, Redis message id -> what its worker said of it
  (``Mark``): started, then finished, removed once the message is acknowledged;
- ``{ns}:__reconciler__.copy.{redis id}``: a delayed original's claim, the Redis id of
  the one copy of it that started (a copy names its original in its ``reconciler_copy_of``
  option), or ``open`` where the reconciler put the original back; kept
  ``COPY_CLAIM_SECONDS``, and written only while another copy could still be made (the
  original not yet acknowledged, or put back), so an app's ordinary delayed messages leave
  none behind;
- ``{ns}:__reconciler__.beats`` (with ``.beats.last`` and ``.beats.at``): written by the
  reconciler, not the middleware: the heartbeats as the last pass read them and when, and
  each still broker's value and when (Redis's clock) it was first seen, so silence is
  measured on Redis's clock across passes, replicas and restarts (``silence``).

Dramatiq 3 is outside the range: a version outside it is refused in one line.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
from dataclasses import dataclass

from reconciler.errors import ConfigError

SUPPORTED = ((2, 0), (3, 0))
SUPPORTED_TEXT = "dramatiq>=2.0,<3.0"
EXTRA_HINT = "pip install 'stale-claim-reconciler[dramatiq]'"
MIDDLEWARE_VERSION = 1
"""The layout of the middleware's marks; a sidecar refuses a worker that writes another."""
DELAY_SUFFIX = ".DQ"
COPY_OPTION = "reconciler_copy_of"
"""The option a worker's copy of a due delayed message names its original's Redis id in."""
COPY_CLAIM_SECONDS = 7 * 24 * 3600
"""How long an original's copy claim is kept: Dramatiq's longest delay and its dead
letters' time to live, both seven days."""
BUDGET_OPTION = "reconciler_max_retries"
"""The option a message the reconciler moved keeps its worker's ``max_retries`` in, so its
budget stays readable once the mark is gone (Dramatiq reads only its own options)."""


@dataclass(frozen=True, slots=True)
class Keys:
    """Every key of one namespace."""

    namespace: str

    @property
    def heartbeats(self) -> str:
        return f"{self.namespace}:__heartbeats__"

    @property
    def acks_pattern(self) -> str:
        """``SCAN`` match for every acks set of the namespace."""
        return f"{_glob_escape(self.namespace)}:__acks__.*"

    @property
    def everything_pattern(self) -> str:
        """``SCAN`` match for every key of the namespace."""
        return f"{_glob_escape(self.namespace)}:*"

    @property
    def stores_pattern(self) -> str:
        """``SCAN`` match for every ``.msgs`` hash of the namespace."""
        return f"{_glob_escape(self.namespace)}:*.msgs"

    @property
    def acks_prefix(self) -> str:
        return f"{self.namespace}:__acks__."

    @property
    def workers(self) -> str:
        return f"{self.namespace}:__reconciler__.workers"

    @property
    def marks(self) -> str:
        return f"{self.namespace}:__reconciler__.marks"

    def copy_claim(self, original: str) -> str:
        """A delayed original's claim: which of its copies started (or ``open``)."""
        return f"{self.namespace}:__reconciler__.copy.{original}"

    @property
    def beats(self) -> str:
        return f"{self.namespace}:__reconciler__.beats"

    @property
    def beats_copy(self) -> str:
        """The heartbeats as the last pass read them."""
        return f"{self.namespace}:__reconciler__.beats.last"

    @property
    def beats_at(self) -> str:
        """When (Redis's clock) the last pass read them."""
        return f"{self.namespace}:__reconciler__.beats.at"

    @property
    def beats_scratch(self) -> str:
        return f"{self.namespace}:__reconciler__.beats.scratch"

    def queue(self, queue: str) -> str:
        """A queue's list (a delay queue's too: ``name.DQ``)."""
        return f"{self.namespace}:{queue}"

    def messages(self, queue: str) -> str:
        return f"{self.namespace}:{queue}.msgs"

    def dead(self, queue: str) -> str:
        """The dead-letter set a message of ``queue`` goes to (a delay queue's base's)."""
        return f"{self.namespace}:{canonical(queue)}.XQ"

    def dead_messages(self, queue: str) -> str:
        return f"{self.dead(queue)}.msgs"

    def acks(self, broker_id: str, queue: str) -> str:
        return f"{self.acks_prefix}{broker_id}.{queue}"

    def split_acks(self, key: str) -> tuple[str, str] | None:
        """An acks key's broker id and queue (None: not one of this namespace's)."""
        if not key.startswith(self.acks_prefix):
            return None
        broker_id, dot, queue = key.removeprefix(self.acks_prefix).partition(".")
        return (broker_id, queue) if dot and broker_id and queue else None


def canonical(queue: str) -> str:
    """A delay queue's base queue (``default.DQ`` -> ``default``); else the queue."""
    return queue.removesuffix(DELAY_SUFFIX)


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


@dataclass(frozen=True, slots=True)
class Mark:
    """What the middleware wrote of a fetched message as its worker ran it."""

    broker_id: str
    finished: bool
    max_retries: int | None
    """The retries its actor allows (``max_retries``: the message's, the actor's, else the
    Retries middleware's); None where the app runs without Retries."""
    result_key: str | None
    """Where its result goes (the Results middleware's key on this Redis), else None."""
    result_ttl_ms: int | None

    def encode(self) -> str:
        return json.dumps({"v": MIDDLEWARE_VERSION, "b": self.broker_id,
                           "f": self.finished, "m": self.max_retries,
                           "r": self.result_key, "t": self.result_ttl_ms},
                          separators=(",", ":"), sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str | None) -> Mark | None:
        """The mark as written (None: absent or not one the middleware writes)."""
        if raw is None:
            return None
        try:
            found = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(found, dict) or found.get("v") != MIDDLEWARE_VERSION:
            return None
        broker_id, max_retries = found.get("b"), found.get("m")
        key, ttl = found.get("r"), found.get("t")
        if not isinstance(broker_id, str) or (
                max_retries is not None and not whole(max_retries)):
            return None
        return cls(broker_id, found.get("f") is True, max_retries,
                   key if isinstance(key, str) else None, ttl if whole(ttl) else None)


def whole(value: object) -> bool:
    """Whether a value read from a message or a mark is a count (a non-negative int)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def digest(data: bytes) -> str:
    """A stored message's fingerprint, as the fences' Lua reads it (``redis.sha1hex``)."""
    return hashlib.sha1(data, usedforsecurity=False).hexdigest()


def supported(version: str) -> bool:
    """Whether a Dramatiq version (``2.2.1``) is in the range read."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        return False
    return SUPPORTED[0] <= (int(found[1]), int(found[2])) < SUPPORTED[1]


def require_supported(version: str, where: str) -> None:
    """One ``ConfigError`` line for a version outside the range (``where``: whose)."""
    if not supported(version):
        raise ConfigError(f"source dramatiq: {where} runs dramatiq {version}, outside the "
                          f"versions this source reads ({SUPPORTED_TEXT}); it does not "
                          "guess at another layout")


def installed() -> None:
    """One ``ConfigError`` line naming the extra when the Redis client is missing."""
    try:
        importlib.metadata.version("redis")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"source dramatiq needs the redis package beside the reconciler: "
                          f"{EXTRA_HINT}") from None
