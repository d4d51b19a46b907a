"""``ReconcilerMiddleware``: what a Dramatiq app adds to its broker so that the
reconciler's ``dramatiq`` source can tell a message its dead worker started from one it
only prefetched (Redis alone cannot: both sit in the worker's acks set)::

    from reconciler.integrations.dramatiq import ReconcilerMiddleware
    broker.add_middleware(ReconcilerMiddleware())

It writes only to the app's own Redis, through the broker's own client (no connection of
its own), under the broker's namespace (``reconciler.sources.dramatiq.keys``): as a worker
process boots, its broker id and Dramatiq version; as a message runs, a mark (started, then
finished), removed once the message is acknowledged. A message is marked, and started,
only while it is still in its worker's acks set (one Lua script): a message put back from
a worker that looked dead but was only paused is skipped by that worker when it wakes, so
only the copy put back runs. A due delayed message is copied onto its queue under a new
Redis id before its original is acknowledged; the copy carries the original's id
(``reconciler_copy_of``) and at most one copy of an original starts: a worker that dies
between the two leaves the original to be put back and copied again, and the second copy
is skipped where the first started (``AnotherCopyStartedError``). A mark that cannot be
written fails the message's run before its actor starts (Dramatiq then retries it as any
failure): a run the reconciler cannot see is never let through. Add it last, so that its
mark is written after every other middleware has let the message through.

Imports only Dramatiq and the standard library, with ``reconciler.sources.dramatiq.keys``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import dramatiq
from dramatiq.middleware import Middleware, MiddlewareError, Retries, SkipMessage
from dramatiq.results import Results

from reconciler.sources.dramatiq.keys import (
    COPY_CLAIM_SECONDS,
    COPY_OPTION,
    DELAY_SUFFIX,
    MIDDLEWARE_VERSION,
    Keys,
    Mark,
)

log = logging.getLogger("reconciler.integrations.dramatiq")

__all__ = ["AnotherCopyStartedError", "MarkNotWrittenError", "ReconcilerMiddleware",
           "TakenBackError"]


class MarkNotWrittenError(MiddlewareError):
    """The started mark could not be written: the message fails this run unstarted."""


class TakenBackError(SkipMessage):
    """The message left this worker's acks set before it started (the reconciler or
    Dramatiq's maintenance put it back, its worker having looked dead): it is skipped, so
    that only the copy put back runs."""


class AnotherCopyStartedError(SkipMessage):
    """Another copy of the same delayed original started first (its worker copied it
    onto the queue, then died before acknowledging the original, which was put back and
    copied again): this copy is skipped, so that the message runs once."""


MARK = """
-- KEYS: the worker's acks set for the message's queue, the marks, the workers,
--       the original's copy claim and its delay queue's messages (the marks twice: none)
-- ARGV: redis id, mark, broker id, registration, original's redis id ('' none),
--       claim seconds, '1' when started
if redis.call('sismember', KEYS[1], ARGV[1]) == 0 then return 0 end
if ARGV[7] == '1' and ARGV[5] ~= '' then
  local claim = redis.call('get', KEYS[4])
  if claim and claim ~= 'open' and claim ~= ARGV[1] then return 2 end
  -- Claimed only while another copy could still be made: the original not yet
  -- acknowledged (its worker about to, or dead) or put back by the reconciler ('open').
  if claim or redis.call('hexists', KEYS[5], ARGV[5]) == 1 then
    redis.call('set', KEYS[4], ARGV[1], 'EX', ARGV[6])
  end
end
redis.call('hsetnx', KEYS[3], ARGV[3], ARGV[4])
redis.call('hset', KEYS[2], ARGV[1], ARGV[2])
return 1
"""


class ReconcilerMiddleware(Middleware):
    """Marks each message a worker runs (started, finished) in the broker's Redis."""

    def before_worker_boot(self, broker: Any, worker: Any) -> None:
        """The worker process's broker id, as one that marks its messages (again with
        each started mark, which a message may reach before its worker finished booting)."""
        found = _redis(broker)
        if found is None:
            log.warning("ReconcilerMiddleware needs a RedisBroker; it marks nothing")
            return
        client, keys = found
        client.hset(keys.workers, broker.broker_id, _registration())

    def before_process_message(self, broker: Any, message: Any) -> None:
        """Started: from here the actor may have had effects."""
        self._mark(broker, message, finished=False)

    def after_process_message(self, broker: Any, message: Any, *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        """Finished (succeeded or failed: Dramatiq's own middleware handles which)."""
        self._mark(broker, message, finished=True)

    def after_skip_message(self, broker: Any, message: Any) -> None:
        """Skipped counts as finished: the actor did not run past this point (a message
        taken back is no longer this worker's, and is left unmarked)."""
        self._mark(broker, message, finished=True)

    def __init__(self) -> None:
        # The delayed originals this process holds, by (message id, Redis id): only a copy
        # this process makes of one of them names its original.
        self._delayed: set[tuple[str, str]] = set()

    def before_delay_message(self, broker: Any, message: Any) -> None:
        """A due delayed message is copied onto its queue by this worker (Dramatiq's own
        ``copy`` keeps its options): the copy names its original (the original's stored
        bytes are left as they are)."""
        redis_id = message.options.get("redis_message_id")
        if redis_id is not None:
            message.options[COPY_OPTION] = redis_id
            self._delayed.add((message.message_id, redis_id))

    def before_enqueue(self, broker: Any, message: Any, delay: int | None) -> None:
        """Only this worker's copy of a delayed original it holds keeps the original's
        id: a message enqueued with a delay (a retry's backoff, a delayed send), or one
        enqueued again from storage (a dead-lettered copy requeued by hand carries the
        option in its bytes), is an original of its own."""
        original = message.options.pop(COPY_OPTION, None)
        held = (message.message_id, original)
        if delay is None and held in self._delayed:
            self._delayed.discard(held)
            message.options[COPY_OPTION] = original

    def after_ack(self, broker: Any, message: Any) -> None:
        self._delayed.discard((message.message_id, message.options.get("redis_message_id")))
        self._forget(broker, message)

    def after_nack(self, broker: Any, message: Any) -> None:
        self._forget(broker, message)

    def _mark(self, broker: Any, message: Any, *, finished: bool) -> None:
        found = _redis(broker)
        redis_id = message.options.get("redis_message_id")
        if found is None or redis_id is None:
            return
        client, keys = found
        result_key, ttl = _result_target(broker, message)
        mark = Mark(broker.broker_id, finished, _max_retries(broker, message), result_key, ttl)
        original = message.options.get(COPY_OPTION)
        original = original if isinstance(original, str) else ""
        try:
            # Only while the message is still this worker's: one the reconciler or
            # Dramatiq's maintenance took back from a worker that looked dead (paused
            # past the timeout) is never started, nor marked, by that worker.
            held = client.register_script(MARK)(
                keys=[keys.acks(broker.broker_id, message.queue_name), keys.marks,
                      keys.workers,
                      keys.copy_claim(original) if original else keys.marks,
                      keys.messages(message.queue_name + DELAY_SUFFIX)],
                args=[redis_id, mark.encode(), broker.broker_id, _registration(), original,
                      COPY_CLAIM_SECONDS, "0" if finished else "1"])
        except Exception as error:
            if finished:
                # Its effects are done: the started mark stays, and a worker dying before
                # its acknowledgement is then judged as one that died while running it.
                log.warning("could not mark message %s finished: %s", message.message_id,
                            type(error).__name__)
                return
            raise MarkNotWrittenError(f"could not mark message {message.message_id} started: "
                                 f"{type(error).__name__}") from error
        if finished or held == 1:
            return
        # Not this message's run: the Results middleware would store None for a skipped
        # message under the message's id, over (or under) the result of the run that counts.
        message.options["store_results"] = False
        if held == 2:
            raise AnotherCopyStartedError(f"another copy of message {message.message_id} "
                                          "started first")
        raise TakenBackError(f"message {message.message_id} was taken back from this "
                             "worker before it started")

    def _forget(self, broker: Any, message: Any) -> None:
        found = _redis(broker)
        redis_id = message.options.get("redis_message_id")
        if found is None or redis_id is None:
            return
        client, keys = found
        try:
            client.hdel(keys.marks, redis_id)
        except Exception as error:  # a leftover mark of an acknowledged message is inert
            log.warning("could not clear the mark of message %s: %s", message.message_id,
                        type(error).__name__)


def _registration() -> str:
    return json.dumps({"v": MIDDLEWARE_VERSION, "version": dramatiq.__version__})


def _redis(broker: Any) -> tuple[Any, Keys] | None:
    """The broker's Redis client and keys (None: not a RedisBroker)."""
    client, namespace = getattr(broker, "client", None), getattr(broker, "namespace", None)
    if client is None or not isinstance(namespace, str) or not hasattr(broker, "broker_id"):
        return None
    return client, Keys(namespace)


def _option(broker: Any, message: Any, name: str, default: Any) -> Any:
    """A message option, else its actor's, else ``default`` (as Dramatiq reads them)."""
    if name in message.options:
        return message.options[name]
    actor = broker.get_actor(message.actor_name)
    return actor.options.get(name, default)


def _max_retries(broker: Any, message: Any) -> int | None:
    """The retries the message is allowed, as the Retries middleware reads them (None:
    no Retries, or a ``retry_when`` that decides by itself)."""
    for middleware in broker.middleware:
        if isinstance(middleware, Retries):
            if _option(broker, message, "retry_when", middleware.retry_when) is not None:
                return None
            found = _option(broker, message, "max_retries", middleware.max_retries)
            return found if isinstance(found, int) and found >= 0 else None
    return None


def _result_target(broker: Any, message: Any) -> tuple[str | None, int | None]:
    """Where the Results middleware stores this message's result, when it does and on the
    broker's own Redis in JSON (so the reconciler can store a failure there); else None."""
    for middleware in broker.middleware:
        if not isinstance(middleware, Results):
            continue
        if not _option(broker, message, "store_results", middleware.store_results):
            return None, None
        backend = middleware.backend
        if not _same_redis(getattr(backend, "client", None), broker.client) or not isinstance(
                backend.encoder, dramatiq.JSONEncoder):
            return None, None
        ttl = _option(broker, message, "result_ttl", middleware.result_ttl)
        return backend.build_message_key(message), int(ttl)
    return None, None


def _same_redis(one: Any, other: Any) -> bool:
    try:
        a, b = (c.connection_pool.connection_kwargs for c in (one, other))
    except AttributeError:
        return False
    fields = ("host", "port", "db", "path")
    return all(a.get(f) == b.get(f) for f in fields)
