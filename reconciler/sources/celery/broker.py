"""What the celery source asks of the app's broker (Redis): liveness, memory, redelivery.

- **Liveness is about a process, not a name**: which worker process holds each running
  task (``holders``: Celery's own ``stats`` and ``query_task``; a worker restarted under its
  old node name is another process). Silence is evidence only on the app's own broker
  while it answers: a broker that cannot be reached, one that holds none of the app's
  queues (kombu keeps its bindings in Redis: a wrong URL or database number holds none),
  and one where no worker at all answers are each a doubt (``LivenessDoubt``), and nothing
  that depends on the answers is decided.
- **Memory across passes**, in the broker itself and on its clock (Redis ``TIME``): which
  process was seen holding each task, when each was first found held by no worker
  (``holders``), and when each task was first seen ``STARTED`` (a task of a kind with
  ``max_run_seconds``: the only ones judged by it): a ``STARTED`` row has no timestamp.
  Every replica and every one-shot ``reconciler pass`` reads the same memory.
- **Redelivery**: kombu's Redis transport keeps a delivered, unacknowledged message in the
  ``unacked`` hash and puts it back on its queue after ``visibility_timeout``. Taking it out
  (``HDEL``, atomic) is what keeps the broker from running the task again after the
  reconciler decided it.
- **Re-publishing** through Celery's own ``send_task`` (same id, name, args, kwargs and
  queue), and Celery's own ``revoke`` for the live workers.

Celery and redis are imported when the source is used, not with the package: a config
naming the source without them is one line naming the ``celery`` extra, before any import
(``reconciler.config.registry``: the entry's ``imports``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reconciler.core.vocabulary import LivenessDoubt
from reconciler.errors import ConfigError
from reconciler.redaction import redact
from reconciler.sources.celery.holders import Holding, forget, holding, remember

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
"""The brokers the celery source supports: Redis (see docs/sources.md, Celery)."""
FIRST_SEEN_KEY = "reconciler:celery:first-seen"
"""Hash: task id -> when the reconciler first saw its row STARTED (broker seconds)."""
UNACKED_KEY = "unacked"
UNACKED_INDEX_KEY = "unacked_index"
BINDINGS_MATCH = "*_kombu.binding.*"
"""kombu's Redis transport keeps each exchange's bindings in a set named so (behind the
app's ``global_keyprefix``, if any), members ``routing_key SEP pattern SEP queue``."""
BINDINGS_KEY = "_kombu.binding.{}"
"""The bindings of the exchange named so (without a ``global_keyprefix``)."""
BINDING_SEPARATOR = "\x06\x16"


def _bound_queue(member: bytes | str) -> str:
    """The queue of one binding (``routing_key SEP pattern SEP queue``)."""
    text = member.decode() if isinstance(member, bytes) else str(member)
    return text.rsplit(BINDING_SEPARATOR, 1)[-1]


@dataclass(frozen=True, slots=True)
class Publication:
    """A task as ``send_task`` publishes it again: the same id, name, call and queue."""

    task_id: str
    name: str
    args: list[Any]
    kwargs: dict[str, Any]
    queue: str | None
    retries: int


@dataclass(frozen=True, slots=True)
class Answers:
    """What one look at the broker found: the named workers that answered, and who holds
    the running tasks (``holders``), or why the silence of the others proves nothing
    (then both are empty)."""

    answering: frozenset[str]
    doubt: LivenessDoubt | None = None
    holding: Holding | None = None
    now: float = 0.0
    """The broker's clock when the workers were asked."""

    @property
    def held(self) -> frozenset[str]:
        """The tasks some worker process holds."""
        return frozenset(() if self.holding is None else self.holding.held)


class CeleryBroker:
    """The app's broker, as the celery source uses it."""

    def __init__(self, broker_url: str) -> None:
        self.broker_url = broker_url
        self._app: Any = None
        self._second: Any = None
        self._redis: Any = None

    def _client(self) -> Any:
        if self._redis is None:
            import redis  # noqa: PLC0415 - only the celery source needs it

            if not self.broker_url.startswith(REDIS_SCHEMES):
                raise ConfigError("source celery: broker_url must be a Redis URL (redis://...);"
                                  " other brokers are not supported")
            self._redis = redis.Redis.from_url(self.broker_url, socket_timeout=5,
                                               socket_connect_timeout=5)
        return self._redis

    def app(self) -> Any:
        """A Celery app on the broker, knowing no task code (it only asks and publishes)."""
        if self._app is None:
            self._app = self._new_app()
        return self._app

    def _second_app(self) -> Any:
        """Another such app, for a broadcast made at the same time as one of ``app``'s
        (each app collects the replies of its own broadcasts on a queue of its own)."""
        if self._second is None:
            self._second = self._new_app()
        return self._second

    def _new_app(self) -> Any:
        from celery import Celery  # noqa: PLC0415 - only the celery source needs it

        app = Celery("stale-claim-reconciler", broker=self.broker_url, set_as_current=False)
        app.conf.update(broker_connection_retry=False, broker_connection_max_retries=0,
                        broker_connection_timeout=5, task_serializer="json")
        return app

    def check(self) -> None:
        """The URL is a Redis one (not that it answers now)."""
        self._client()
        self.app()

    def now(self) -> float:
        """The broker's clock, in seconds."""
        seconds, micros = self._client().time()
        return float(seconds) + float(micros) / 1e6

    def where(self) -> str:
        """The broker's URL with any password hidden, for log lines and ``/readyz``."""
        return redact(self.broker_url)

    def answers(self, hostnames: Iterable[str], queues: Iterable[str],
                owners: Mapping[str, str] | None = None) -> Answers:
        """Which worker process holds each task of ``owners`` (task id -> the worker its
        row names, ``holders.holding``), the workers among ``hostnames`` asked too;
        whether silence can be trusted.

        Trusted only on a broker that answers, holds at least one of ``queues`` (the queues
        the running tasks were sent to) and where some worker answers at all: with none
        answering, the broker is not the app's or its whole fleet cannot answer now, and
        silence is no evidence of death.
        """
        owned = dict(owners or {})
        names, wanted = sorted(set(hostnames) | set(owned.values())), set(queues)
        client, app = self._client(), self.app()  # a URL not Redis's is a ConfigError
        try:
            client.ping()
            if wanted and not self._holds_any(client, wanted):
                return Answers(frozenset(), LivenessDoubt.QUEUES_MISSING)
            now = self.now()
            found = holding(app, self._second_app(), client, now, names=names, owners=owned)
            if not found.anyone:
                return Answers(frozenset(), LivenessDoubt.NO_WORKER_ANSWERS)
        except Exception:
            return Answers(frozenset(), LivenessDoubt.BROKER_UNREACHABLE)
        return Answers(frozenset(found.answering), holding=found, now=now)

    def answers_at_all(self) -> Answers:
        """Whether the broker answers (with no running task, no worker needs asking)."""
        client = self._client()
        try:
            client.ping()
        except Exception:
            return Answers(frozenset(), LivenessDoubt.BROKER_UNREACHABLE)
        return Answers(frozenset())

    @staticmethod
    def _holds_any(client: Any, queues: set[str]) -> bool:
        """Whether some exchange is bound to one of ``queues`` on this broker. Celery names
        a queue's exchange after it, so its bindings are read first (one round trip); only
        when none is there (a wrong broker, or exchanges named otherwise) is every binding
        looked for, by a scan of the keyspace."""
        named = sorted(queues)
        pipe = client.pipeline()
        for queue in named:
            pipe.smembers(BINDINGS_KEY.format(queue))
        if any(_bound_queue(member) == queue for queue, members in zip(
                named, pipe.execute(), strict=True) for member in members):
            return True
        return any(_bound_queue(member) in queues
                   for key in client.scan_iter(match=BINDINGS_MATCH, count=1000)
                   for member in client.smembers(key))

    def remember(self, found: Holding, running: Iterable[str]) -> dict[str, float]:
        """What a trusted read found, kept in the broker for the next pass; seconds each
        running task no worker holds has been held by none (``holders.remember``)."""
        return remember(self._client(), found, running, self.now())

    def forget_holders(self) -> None:
        """What was seen of who holds the tasks, forgotten (``holders.forget``)."""
        forget(self._client())

    def first_seen(self, task_ids: Sequence[str]) -> dict[str, float]:
        """Seconds since the reconciler first saw each of these tasks ``STARTED``; tasks no
        longer listed are forgotten."""
        client, now = self._client(), self.now()
        known = {k.decode() if isinstance(k, bytes) else k for k in client.hkeys(FIRST_SEEN_KEY)}
        pipe = client.pipeline()
        for gone in known - set(task_ids):
            pipe.hdel(FIRST_SEEN_KEY, gone)
        for task_id in set(task_ids) - known:  # a known one's HSETNX would change nothing
            pipe.hsetnx(FIRST_SEEN_KEY, task_id, repr(now))
        pipe.execute()
        seen = client.hmget(FIRST_SEEN_KEY, list(task_ids)) if task_ids else []
        return {t: now - float(first) for t, first in zip(task_ids, seen, strict=True)
                if first is not None}

    def unacked(self, task_ids: Iterable[str]) -> dict[str, str]:
        """Delivery tags of unacknowledged messages of these tasks (the broker would put
        them back on their queue after ``visibility_timeout``), by task id."""
        wanted = set(task_ids)
        found: dict[str, str] = {}
        if not wanted:
            return found
        for tag, raw in self._client().hscan_iter(UNACKED_KEY):
            try:
                message = json.loads(raw)[0]
                task_id = message["headers"]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                continue
            if task_id in wanted:
                found[task_id] = tag.decode() if isinstance(tag, bytes) else str(tag)
        return found

    def take_unacked(self, tag: str) -> bool:
        """Remove one unacknowledged message so the broker never redelivers it; False when
        it was gone already (acknowledged, or restored to its queue)."""
        removed = self._client().pipeline().zrem(UNACKED_INDEX_KEY, tag).hdel(
            UNACKED_KEY, tag).execute()
        return bool(removed[1])

    def publish(self, task_id: str, name: str, *, args: list[Any], kwargs: dict[str, Any],
                queue: str | None, retries: int) -> None:
        """Celery's own ``send_task``: the same id, so the caller's AsyncResult completes."""
        self.publish_many([Publication(task_id, name, args=args, kwargs=kwargs, queue=queue,
                                       retries=retries)])

    def publish_many(self, tasks: Sequence[Publication]) -> None:
        """Each task through Celery's own ``send_task`` (``publish``), their messages pushed
        in one pipeline: kombu's producer batch (kombu 5.7), which sends ``max_size``
        (1,000) pushes at a time; an older kombu has none and sends one message at a time.
        A queue's first message on this app's connection declares it first, as any
        ``send_task`` does."""
        if not tasks:
            return
        app = self.app()
        with app.producer_or_acquire() as producer:
            batch = getattr(producer, "batch", None)
            with batch() if batch is not None else contextlib.nullcontext():
                for task in tasks:
                    app.send_task(task.name, args=task.args, kwargs=task.kwargs,
                                  task_id=task.task_id, queue=task.queue,
                                  retries=task.retries, producer=producer)

    def take_queued(self, queued: Mapping[str, Collection[str]]) -> None:
        """Remove these tasks' messages from their Redis queues (queue -> task ids; kombu
        keeps a queue as a list of JSON messages): the queues read in one round trip, the
        messages found removed in another, each by its own text (a message pushed or
        taken meanwhile is not another's)."""
        if not queued:
            return
        client, queues = self._client(), sorted(queued)
        reading = client.pipeline(transaction=False)
        for queue in queues:
            reading.lrange(queue, 0, -1)
        found = [(queue, raw) for queue, messages in zip(queues, reading.execute(), strict=True)
                 for raw in messages if _task_of(raw) in queued[queue]]
        if found:
            removing = client.pipeline(transaction=False)
            for queue, raw in found:
                removing.lrem(queue, 1, raw)
            removing.execute()

    def revoke(self, *task_ids: str) -> None:
        """Celery's own revoke of these tasks, to the live workers in one broadcast (a best
        effort: it reaches no one else)."""
        if not task_ids:
            return
        # Revoking only helps (the message is out of the broker already): a failure is not
        # a reason to undo the swap.
        with contextlib.suppress(Exception):
            self.app().control.revoke(list(task_ids))


def _task_of(raw: bytes | str) -> str | None:
    """The task id of a queued kombu message (None: not a Celery task's)."""
    try:
        task_id = json.loads(raw)["headers"]["id"]
    except (ValueError, KeyError, TypeError):
        return None
    return task_id if isinstance(task_id, str) else None
