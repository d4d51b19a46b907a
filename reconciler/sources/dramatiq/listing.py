"""Dramatiq's messages as operators read them (``reconciler jobs list|show|explain``, the
console): every stored message of the watched queues, copied from Redis into a temporary
table on the reconciler's own database for the one read that asked.

Where Dramatiq keeps a message (``keys``): queued on its queue's list, delayed on its
delay queue's, fetched in a worker's acks set (started or finished as the middleware marks
it, else only prefetched), dead-lettered in its queue's ``.XQ``; each in the ``.msgs`` hash
beside. A message acknowledged is deleted (its result, where kept, is the Results
middleware's), so nothing completed is listed. The queues are found by their ``.msgs``
hashes (Dramatiq keeps no list of queues); nothing is decoded but JSON, and no error
message of a message's own is read (the reason listed is ours, from its options).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Connection
from sqlalchemy.schema import CreateTable

from reconciler.core.vocabulary import JobStatus, Reason
from reconciler.errors import ConfigError, DatabaseUnavailableError
from reconciler.redaction import redact
from reconciler.sources.dramatiq.config import DramatiqConfig
from reconciler.sources.dramatiq.keys import BUDGET_OPTION, DELAY_SUFFIX, Keys, Mark
from reconciler.sources.dramatiq.snapshot import JOB_ID, UNREADABLE_LABEL, read_message
from reconciler.sources.kit.system import Wanted

STATUS_WORDS: Mapping[str, JobStatus] = {
    "queued": JobStatus.QUEUED, "delayed": JobStatus.QUEUED, "fetched": JobStatus.QUEUED,
    "started": JobStatus.PROCESSING, "finished": JobStatus.PROCESSING,
    "dead": JobStatus.FAILED,
}
"""Where a message is, in this project's words: only prefetched it is still waiting;
finished but not yet acknowledged it is still its worker's."""
DEAD_SUFFIX = ".XQ"
_REASONS = frozenset(r.value for r in Reason)

INSTANT = sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql")
LISTED = sa.Table(
    "reconciler_dramatiq_listed", sa.MetaData(),
    sa.Column("job_id", JOB_ID, primary_key=True),
    sa.Column("job_kind", sa.Text()),
    sa.Column("source_status", sa.Text()),
    sa.Column("attempts", sa.Integer()),
    sa.Column("max_attempts", sa.Integer()),
    sa.Column("reason", sa.Text()),
    sa.Column("created_at", INSTANT),
    sa.Column("updated_at", INSTANT),
    sa.Column("finished_at", INSTANT),
    prefixes=["TEMPORARY"], postgresql_on_commit="DELETE ROWS",
)
"""The messages one operator's read copied from Redis, on its own connection only."""


@contextmanager
def answering(url: str) -> Iterator[None]:
    """One line naming the store when the app's Redis does not answer."""
    import redis  # noqa: PLC0415 - only the dramatiq source needs it

    try:
        yield
    except redis.RedisError as exc:
        raise DatabaseUnavailableError(
            f"source dramatiq: its Redis at {redact(url)} did not answer "
            f"({type(exc).__name__}); no message of it can be listed") from None


def _moment(ms: float | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC)


def connect(url: str) -> Any:
    """A client of the app's Redis at ``url`` (answers as bytes)."""
    import redis  # noqa: PLC0415 - only the dramatiq source needs it

    return redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0)


def watched_stores(redis: Any, keys: Keys, config: DramatiqConfig) -> list[tuple[str, bool]]:
    """Each watched queue holding messages (a delay queue apart), and whether it is a
    dead-letter set; from the ``.msgs`` hashes."""
    return _watched(redis.scan_iter(match=keys.stores_pattern, count=1000), keys, config)


def _watched(names: Iterable[bytes], keys: Keys, config: DramatiqConfig
             ) -> list[tuple[str, bool]]:
    """The watched stores among ``.msgs`` hash names, sorted (the order messages are
    looked for in)."""
    found = []
    prefix = f"{keys.namespace}:"
    for raw in names:
        name = raw.decode().removeprefix(prefix).removesuffix(".msgs")
        dead = name.endswith(DEAD_SUFFIX)
        queue = name.removesuffix(DEAD_SUFFIX)
        if config.watches(queue):
            found.append((queue, dead))
    return sorted(found)


Stored = tuple[str, str, str, bytes, float | None, Mark | None]
"""A stored message: its status, the queue whose ``.msgs`` holds it, its Redis id, its
bytes, when it was dead-lettered (ms) and the middleware's mark."""


def stored_messages(redis: Any, keys: Keys, stored: Sequence[tuple[str, bool]]
                    ) -> Iterator[Stored]:
    """Every message of the stores given, where it is."""
    fetched: set[str] = set()
    for raw in redis.scan_iter(match=keys.acks_pattern, count=1000):
        fetched.update(m.decode() for m in redis.smembers(raw))
    marks = {k.decode(): Mark.decode(v) for k, v in redis.hgetall(keys.marks).items()}
    for queue, dead in stored:
        hashed = keys.dead_messages(queue) if dead else keys.messages(queue)
        died = ({m.decode(): s for m, s in redis.zrange(keys.dead(queue), 0, -1,
                                                         withscores=True)}
                if dead else {})
        for raw_id, data in redis.hscan_iter(hashed, count=1000):
            redis_id = raw_id.decode()
            mark = marks.get(redis_id) if redis_id in fetched else None
            yield (_status(redis_id, queue, dead, fetched, mark), queue, redis_id, data,
                   died.get(redis_id), mark)


def _status(redis_id: str, queue: str, dead: bool, fetched: set[str],
            mark: Mark | None) -> str:
    if dead:
        return "dead"
    if redis_id in fetched:
        return "fetched" if mark is None else ("finished" if mark.finished else "started")
    return "delayed" if queue.endswith(DELAY_SUFFIX) else "queued"


def located(redis: Any, keys: Keys, config: DramatiqConfig, message_id: str
            ) -> tuple[str, str, str, bytes] | None:
    """Where the message ``message_id`` is stored now: status, queue, Redis id, bytes."""
    for status, queue, redis_id, data, _, _ in stored_messages(
            redis, keys, watched_stores(redis, keys, config)):
        message = read_message(data, redis_id)
        if message is not None and message.job_id == message_id:
            return status, queue, redis_id, data
    return None


def located_many(redis: Any, keys: Keys, config: DramatiqConfig,
                 message_ids: Collection[str]) -> dict[str, tuple[str, str, str, bytes]]:
    """Where each of ``message_ids`` is stored now, as ``located`` finds it (the first
    watched store holding it), for those stored at all; whatever their number, one SCAN of
    the namespace's names (a page per thousand keys), then every store and acks set read."""
    wanted = set(message_ids)
    # SCAN, never KEYS: an operator's bulk must not block the app's Redis while it walks
    # every key; one walk finds both the stores and the acks sets.
    store_names: list[bytes] = []
    acks_names: list[bytes] = []
    for raw in redis.scan_iter(match=keys.everything_pattern, count=1000):
        if raw.startswith(keys.acks_prefix.encode()):
            acks_names.append(raw)
        elif raw.endswith(b".msgs"):
            store_names.append(raw)
    stored = _watched(store_names, keys, config)
    # One transaction: the acks sets, the marks and the messages as of one instant, so a
    # message a worker fetches meanwhile is not read stored but not yet fetched.
    with redis.pipeline(transaction=True) as reads:
        for raw in acks_names:
            reads.smembers(raw)
        reads.hgetall(keys.marks)
        for queue, dead in stored:
            reads.hgetall(keys.dead_messages(queue) if dead else keys.messages(queue))
        answers = reads.execute()
    fetched = {m.decode() for members in answers[:len(acks_names)] for m in members}
    marks = {k.decode(): Mark.decode(v) for k, v in answers[len(acks_names)].items()}
    found: dict[str, tuple[str, str, str, bytes]] = {}
    for (queue, dead), hashed in zip(stored, answers[len(acks_names) + 1:], strict=True):
        for raw_id, data in hashed.items():
            redis_id = raw_id.decode()
            message = read_message(data, redis_id)
            if message is None or message.job_id not in wanted or message.job_id in found:
                continue
            mark = marks.get(redis_id) if redis_id in fetched else None
            found[message.job_id] = (_status(redis_id, queue, dead, fetched, mark), queue,
                                     redis_id, data)
    return found


@dataclass(frozen=True, slots=True)
class DramatiqListing:
    """The listing of the watched queues' messages, declared once per process."""

    config: DramatiqConfig
    client: Callable[[], Any]

    def every(self, conn: Connection) -> sa.Select[Any]:
        """Every message of the watched queues (``System.listing``)."""
        return self.narrowed(conn, Wanted())

    def narrowed(self, conn: Connection, wanted: Wanted) -> sa.Select[Any]:
        """What ``wanted`` asks for (one message, or every one), copied into a temporary
        table (``System.listing_for``)."""
        keys = Keys(self.config.namespace)
        with answering(self.config.url):
            redis = self.client()
            stored = watched_stores(redis, keys, self.config)
            if not stored and redis.dbsize() and not redis.exists(keys.heartbeats):
                raise ConfigError(
                    f"source dramatiq: the Redis at {redact(self.config.url)} holds keys, "
                    f"but none of Dramatiq's under the namespace {self.config.namespace!r}: "
                    "not the app's Redis? Check the database number in redis_url and the "
                    "namespace; nothing was listed")
            rows = self._rows(redis, keys, stored, wanted.job_id)
        conn.execute(CreateTable(LISTED, if_not_exists=True))
        conn.execute(LISTED.delete())
        if rows:
            conn.execute(LISTED.insert(), rows)
        return sa.select(*LISTED.c)

    def _rows(self, redis: Any, keys: Keys, stored: Sequence[tuple[str, bool]],
              job_id: str | None) -> list[dict[str, Any]]:
        rows: dict[str, dict[str, Any]] = {}
        for status, _, redis_id, data, died, mark in stored_messages(redis, keys, stored):
            message = read_message(data, redis_id)
            if message is None or (job_id is not None and message.job_id != job_id):
                continue
            options = _options(data)
            # The budget as the pass counts it: the message's own, else its worker's
            # Retries middleware's (the mark carries it while the message runs, the
            # message itself once the reconciler moved it).
            most = options.get("max_retries", options.get(
                BUDGET_OPTION, None if mark is None else mark.max_retries))
            reason = options.get("reconciler_reason")
            ended = _moment(died)
            rows[message.job_id] = {
                "job_id": message.job_id, "job_kind": message.kind or UNREADABLE_LABEL,
                "source_status": status,
                "attempts": message.retries + (1 if status in ("started", "finished",
                                                               "dead") else 0),
                "max_attempts": most + 1 if isinstance(most, int) else None,
                "reason": reason if reason in _REASONS else None,
                "created_at": _moment(message.enqueued_ms),
                "updated_at": ended, "finished_at": ended}
        return list(rows.values())


def _options(data: bytes) -> dict[str, Any]:
    try:
        found = json.loads(data).get("options", {})
    except (ValueError, AttributeError, UnicodeDecodeError):
        return {}
    return found if isinstance(found, dict) else {}
