"""Dramatiq's fetched messages, read from Redis once per transaction into a temporary
table, as the kit judges jobs in SQL (the rq source's way: ``running``, ``expired`` and the
candidates are then plain SQL, and paging, holds, ledger, audit, brake, explain, dry run
and shadow mode work on it).

A worker is gone when its heartbeat (``__heartbeats__``, written with the worker's own
clock on each of its broker commands) has not moved for ``session_timeout_seconds`` of
Redis's clock. Each value is timed by when it was first seen (``silence``): silence is a
lower bound, never a worker clock read against Redis's. Only a gone worker's acks sets are
read (one ``SCAN`` for the new ones, remembered while their heartbeat stays still: a gone
worker fetches nothing more), with its messages and the middleware's marks; an operator's
read of every job reads every acks set. A broker id is one process: a worker started again
is a new id, so a live successor never vouches for its predecessor's messages.

What is not trusted decides nothing (``LivenessDoubt``): a Redis that does not answer
(``broker_unreachable``); one holding keys but no Dramatiq heartbeat (``queues_missing``:
a wrong URL, database or namespace); a gone worker holding messages that booted without
the middleware (``middleware_missing``: a started message cannot be told from one only
prefetched).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.schema import CreateTable

from reconciler.core.kinds import KindRules
from reconciler.core.ports import LivenessUnknown, StuckWork
from reconciler.core.vocabulary import LivenessDoubt
from reconciler.redaction import redact
from reconciler.sources.dramatiq import keys as layout
from reconciler.sources.dramatiq.config import DramatiqConfig
from reconciler.sources.dramatiq.keys import Keys, Mark, digest, whole
from reconciler.sources.dramatiq.silence import Beats
from reconciler.sources.kit.shapes import AllKinds
from reconciler.sources.kit.system import Loaded, Silent
from reconciler.storage.sql import encode_rows, json_rows

UNREADABLE_LABEL = "<unreadable>"
"""The kind of a message whose encoded form cannot be read (no actor is named so)."""
UNREADABLE_MESSAGE = "unreadable_message"
JOB_ID = sa.Text().with_variant(sa.String(768), "mysql")

FETCHED = sa.Table(
    "reconciler_dramatiq_fetched", sa.MetaData(),
    sa.Column("job_id", JOB_ID, primary_key=True),
    sa.Column("job_kind", sa.Text(), nullable=False),
    sa.Column("unreadable", sa.Boolean(), nullable=False),
    sa.Column("queue", sa.Text(), nullable=False),
    sa.Column("redis_id", sa.Text(), nullable=False),
    sa.Column("broker_id", sa.Text(), nullable=False),
    sa.Column("data_sha1", sa.Text(), nullable=False),
    sa.Column("mark", sa.Text(), nullable=False),
    sa.Column("started", sa.Boolean(), nullable=False),
    sa.Column("finished", sa.Boolean(), nullable=False),
    sa.Column("retries", sa.Integer(), nullable=False),
    sa.Column("max_retries", sa.Integer()),
    sa.Column("heartbeat", sa.Double(), nullable=False),
    sa.Column("silent_over", sa.Double(), nullable=False),
    sa.Column("enqueued_ms", sa.BigInteger()),
    prefixes=["TEMPORARY"], postgresql_on_commit="DELETE ROWS",
)
"""One row per fetched message loaded this transaction: ``job_id`` is Dramatiq's
``message_id`` (the same across its retries), ``redis_id`` its id in Redis, ``queue`` the
queue of the acks set holding it, ``mark`` the middleware's mark as read ('' none),
``heartbeat`` its worker's heartbeat as read (the fence repeats it: a worker that was only
slow moves it), ``silent_over`` the seconds that heartbeat has been still past
``session_timeout_seconds`` (negative before)."""

_COLUMNS = [c.name for c in FETCHED.columns]
_SQLITE_LOAD = str(FETCHED.insert().compile(dialect=sqlite.dialect()))
_CREATE: dict[str, str] = {}


def _load_statement(dialect: str) -> sa.Insert:
    rows = json_rows(dialect, "fetched", [(c.name, c.type) for c in FETCHED.columns])
    return FETCHED.insert().from_select(_COLUMNS, sa.select(*(rows.c[c] for c in _COLUMNS)))


_LOAD = {dialect: _load_statement(dialect) for dialect in ("postgresql", "mysql")}


def _create(conn: Connection) -> None:
    name = conn.dialect.name
    if name not in _CREATE:
        _CREATE[name] = str(CreateTable(FETCHED, if_not_exists=True)
                            .compile(dialect=conn.dialect))
    conn.exec_driver_sql(_CREATE[name])

NOTHING_LOADED = Loaded(rows=0)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One transaction's view of Redis: why it was not trusted (None: it was), what it
    loaded, and the time it was read (Redis's, seconds)."""

    doubt: LivenessDoubt | None
    loaded: Loaded = NOTHING_LOADED

    @property
    def may_swap(self) -> bool:
        return self.doubt is None


@dataclass(frozen=True, slots=True)
class Message:
    """A fetched message as read: what the decision and the fence need."""

    job_id: str
    kind: str | None
    retries: int
    max_retries: int | None
    enqueued_ms: int | None


def read_message(raw: bytes | None, redis_id: str) -> Message | None:
    """The encoded message's facts (None: gone); its kind None where unreadable."""
    if raw is None:
        return None
    try:
        found = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        found = None
    if not isinstance(found, dict):
        return Message(redis_id, None, 0, None, None)
    actor, options = found.get("actor_name"), found.get("options")
    message_id = found.get("message_id")
    options = options if isinstance(options, dict) else {}
    retries = options.get("retries", 0)
    most = options.get("max_retries", options.get(layout.BUDGET_OPTION))
    stamp = found.get("message_timestamp")
    readable = (isinstance(actor, str) and 0 < len(actor) <= 255 and actor.isprintable()
                and isinstance(message_id, str) and bool(message_id)
                and whole(retries))
    return Message(str(message_id) if readable else redis_id, actor if readable else None,
                   retries if readable else 0, most if whole(most) else None,
                   stamp if whole(stamp) else None)


@dataclass
class DramatiqLiveness:
    """The dramatiq source's declared liveness, one per process: its Redis client and the
    acks keys of the gone workers already found are kept across passes."""

    config: DramatiqConfig
    found_acks: dict[str, tuple[float, tuple[str, ...]]] = field(default_factory=dict)
    """A gone broker's acks keys, by the heartbeat value they were found at."""
    _redis: Any = None

    @property
    def keys(self) -> Keys:
        return Keys(self.config.namespace)

    def client(self) -> Any:
        """The app's Redis (a pass gives up on a silent one after 5 s)."""
        if self._redis is None:
            import redis  # noqa: PLC0415 - only the dramatiq source needs it

            self._redis = redis.Redis.from_url(self.config.url, socket_timeout=5,
                                               socket_connect_timeout=5)
        return self._redis

    def where(self) -> str:
        """The Redis URL with any password hidden."""
        return redact(self.config.url)

    def judge(self, conn: Connection, kinds: KindRules, *, every: bool,
              silent: Silent | None) -> Snapshot:
        """Redis read once and loaded into ``FETCHED`` (``load``): every worker's messages
        where the wedged scan runs (``silent``: live ones may be wedged) or the kinds are
        told apart (``[kinds]`` sets a scan's key for some kind but ``"*"``: the kit reads
        the running kinds, and the brake counts the reconciled kinds' messages only), else
        the gone workers' only."""
        return self.load(conn, every=every or silent is not None
                         or AllKinds.of(kinds) is None)

    def loaded(self, verdict: Snapshot) -> Loaded:
        return verdict.loaded

    def load(self, conn: Connection, *, every: bool) -> Snapshot:
        """The gone workers' fetched messages (``every``: every worker's) in ``FETCHED``,
        emptied first."""
        import redis  # noqa: PLC0415 - only the dramatiq source needs it

        try:
            rows, live, doubt = self._read(every=every)
        except redis.RedisError:
            rows, live, doubt = [], 0, LivenessDoubt.BROKER_UNREACHABLE
        if rows or every:
            _create(conn)
            conn.execute(FETCHED.delete())
        if rows and conn.dialect.name == "sqlite":
            conn.exec_driver_sql(_SQLITE_LOAD, [tuple(r[c] for c in _COLUMNS) for r in rows])
        elif rows:
            conn.execute(_LOAD[conn.dialect.name], {"fetched_rows": encode_rows(rows)})
        return Snapshot(doubt, Loaded(len(rows), live, every=every))

    def _read(self, *, every: bool) -> tuple[list[dict[str, Any]], int, LivenessDoubt | None]:
        """The rows to load; the started messages of live workers, counted for the brake
        (every mark, less those loaded); why Redis is not trusted."""
        rows, doubt = self._rows(every=every)
        if doubt is not None:
            return [], 0, doubt
        marked = sum(1 for row in rows if row["mark"])
        return rows, 0 if every else max(self.client().hlen(self.keys.marks) - marked, 0), None

    def _rows(self, *, every: bool) -> tuple[list[dict[str, Any]], LivenessDoubt | None]:
        client, keys = self.client(), self.keys
        timeout = self.config.session_timeout_seconds
        beats = Beats.read(client, keys, 0.0 if every else timeout, every=every)
        if not beats.brokers:
            # No Dramatiq broker ever spoke here: an empty database is an app that has not
            # run yet; one holding other keys is not the app's (or not its namespace).
            return [], (LivenessDoubt.QUEUES_MISSING if client.dbsize() else None)
        gone = {b for b, (_, silence) in beats.still.items() if silence >= timeout}
        watched = set(beats.still)
        acks = self._acks(client, keys, beats, watched, every=every)
        if not acks:
            return [], None
        with client.pipeline(transaction=False) as pipe:
            for key in acks:
                pipe.smembers(key)
            members = dict(zip(acks, pipe.execute(), strict=True))
        fetched = [(broker_id, queue, member.decode())
                   for key, (broker_id, queue) in acks.items() for member in members[key]]
        if not fetched:
            return [], None
        workers = client.hgetall(keys.workers)
        unmarked = {b for b, _, _ in fetched if b in gone and b.encode() not in workers}
        if unmarked:
            return [], LivenessDoubt.MIDDLEWARE_MISSING
        _check_versions(workers[b.encode()] for b in {b for b, _, _ in fetched if b in gone})
        with client.pipeline(transaction=False) as pipe:
            for _, queue, redis_id in fetched:
                pipe.hget(keys.messages(queue), redis_id)
            pipe.hmget(keys.marks, [redis_id for _, _, redis_id in fetched])
            *datas, marks = pipe.execute()
        rows: dict[str, dict[str, Any]] = {}
        for (broker_id, queue, redis_id), raw, mark_raw in zip(fetched, datas, marks,
                                                               strict=True):
            message = read_message(raw, redis_id)
            if message is None or message.job_id in rows:
                continue  # acknowledged meanwhile; or a retry's copy beside its original
            mark = Mark.decode(mark_raw)
            rows[message.job_id] = {
                "job_id": message.job_id, "job_kind": message.kind or UNREADABLE_LABEL,
                "unreadable": message.kind is None, "queue": queue, "redis_id": redis_id,
                "broker_id": broker_id,
                "data_sha1": digest(raw),
                "mark": "" if mark_raw is None else mark_raw.decode(),
                "started": mark is not None and not mark.finished,
                "finished": mark is not None and mark.finished,
                "retries": message.retries,
                "max_retries": (mark.max_retries if mark is not None
                                and mark.max_retries is not None else message.max_retries),
                "heartbeat": beats.still[broker_id][0],
                "silent_over": beats.still[broker_id][1] - timeout,
                "enqueued_ms": message.enqueued_ms,
            }
        return list(rows.values()), None

    def _acks(self, client: Any, keys: Keys, beats: Beats, brokers: set[str], *,
              every: bool) -> dict[str, tuple[str, str]]:
        """The watched acks keys of ``brokers``: by ``SCAN`` where one of them is new (or
        ``every``), else as found before at the same heartbeat."""
        self.found_acks = {b: found for b, found in self.found_acks.items()
                           if b in brokers and beats.still[b][0] == found[0]}
        if every or any(b not in self.found_acks for b in brokers):
            scanned: dict[str, list[str]] = {b: [] for b in brokers}
            for raw in client.scan_iter(match=keys.acks_pattern, count=1000):
                key = raw.decode()
                split = keys.split_acks(key)
                if split is not None and split[0] in scanned:
                    scanned[split[0]].append(key)
            self.found_acks = {b: (beats.still[b][0], tuple(sorted(found)))
                               for b, found in scanned.items()}
        found_keys: dict[str, tuple[str, str]] = {}
        for _, keys_of in self.found_acks.values():
            for key in keys_of:
                split = keys.split_acks(key)
                if split is not None and self.config.watches(split[1]):
                    found_keys[key] = split
        return found_keys

    def unknown(self, verdict: Snapshot) -> LivenessUnknown | None:
        """Why Redis's view was not trusted this transaction (None: it was)."""
        return None if verdict.doubt is None else LivenessUnknown(verdict.doubt, self.where())

    def stuck(self, verdict: Snapshot) -> StuckWork:
        """Nothing beside the kit's count: every gone worker's message is in ``FETCHED``."""
        return {}

    def check(self) -> None:
        """The Redis client installed (not that Redis answers now: a pass says so)."""
        layout.installed()


def _check_versions(registered: Iterable[bytes]) -> None:
    """One ``ConfigError`` line for a worker that booted with a Dramatiq outside the range
    read."""
    for raw in registered:
        try:
            version = str(json.loads(raw).get("version", ""))
        except (ValueError, AttributeError):
            version = ""
        layout.require_supported(version, "a worker")
