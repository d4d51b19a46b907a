"""RQ's started jobs, read from Redis once per transaction into a temporary table.

The kit judges jobs in SQL; RQ keeps them in Redis. So the source's declared liveness
(``RqLiveness.judge``) reads, once per transaction, each watched queue's started registry
(never RQ's own ``get_job_ids``, which would run its cleanup first), with Redis's
``TIME`` as the clock: for a pass, only its silent entries (``ZRANGEBYSCORE`` up to the
score of an entry whose heartbeat is ``session_timeout_seconds`` overdue: what RQ's own
cleanup reads, and the minute before it) and, once the step ledger is in use, the live
ones whose ledger went silent (the wedged scan's), the other live ones counted
(``ZCOUNT``) for the brake; for an operator's read, every entry. It reads the hash fields
of each job it loads and the worker keys of the silent ones, pipelined, and loads them
into a temporary table on the pass's own connection (its own ``MetaData``: not one of
this project's tables, invisible to migrations). ``running``, ``expired`` and the
candidates are then plain SQL over it, and the kit's paging, holds, ledger, audit,
brake, explain, dry run and shadow mode work on it.

A job is stale when its worker is gone (its key expired, marked dead, silent past
``session_timeout_seconds``, or born after the job started: a new worker under the same
name) and its entry went unrenewed: its worker's next heartbeat (the entry's score less
RQ's grace, ``keys.HEARTBEAT_GRACE_SECONDS``) is ``session_timeout_seconds`` overdue. So a
dead worker's job is decided about a minute before its entry expires, and before a
successor under its name can start and run RQ's own cleanup over it (which would fail the
job, or run an effectful one again through its ``Retry``). A Redis that cannot be
reached, or that holds no RQ key at all (a wrong URL or database number), loads nothing:
the pass decides nothing and says which store (``unknown``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
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
from reconciler.sources.kit.shapes import AllKinds
from reconciler.sources.kit.system import Loaded, Silent
from reconciler.sources.rq import keys
from reconciler.sources.rq.config import RqConfig
from reconciler.sources.rq.kinds import UNREADABLE_LABEL, func_name
from reconciler.sources.rq.silence import silent_at, silent_over, utc_seconds, worker_gone
from reconciler.storage.sql import encode_rows, json_rows

log = logging.getLogger("reconciler.sources.rq")

JOB_ID = sa.Text().with_variant(sa.String(768), "mysql")
"""An RQ job id as a key: MySQL keys no TEXT column, and 768 characters of utf8mb4 is
InnoDB's longest key (3,072 bytes)."""

STARTED = sa.Table(
    "reconciler_rq_started", sa.MetaData(),
    sa.Column("job_id", JOB_ID, primary_key=True),
    sa.Column("job_kind", sa.Text(), nullable=False),
    sa.Column("unreadable", sa.Boolean(), nullable=False),
    sa.Column("queue", sa.Text(), nullable=False),
    sa.Column("execution_id", sa.Text(), nullable=False),
    sa.Column("score", sa.Double(), nullable=False),
    sa.Column("entry_over", sa.Double(), nullable=False),
    sa.Column("silent_over", sa.Double(), nullable=False),
    sa.Column("status", sa.Text()),
    sa.Column("worker", sa.Text()),
    sa.Column("worker_gone", sa.Boolean(), nullable=False),
    sa.Column("run_seconds", sa.Double()),
    sa.Column("retries_left", sa.Integer()),
    sa.Column("attempt", sa.Integer(), nullable=False),
    prefixes=["TEMPORARY"], postgresql_on_commit="DELETE ROWS",
)
"""One row per entry of a watched started registry loaded this transaction (the expired
ones and the silent live ones, or every one):
``entry_over`` is Redis's clock minus the entry's score (seconds past its expiry,
negative while renewed), ``silent_over`` the seconds past the worker's next heartbeat being
``session_timeout_seconds`` overdue (negative before), ``run_seconds`` since the job's
``started_at``, ``attempt`` the reconciler's count (``ATTEMPT_FIELD``, else 1)."""

def _load_statement(dialect: str) -> sa.Insert:
    """``INSERT INTO STARTED SELECT ... FROM`` the rows given as one JSON parameter."""
    rows = json_rows(dialect, "started", [(c.name, c.type) for c in STARTED.columns])
    return STARTED.insert().from_select([c.name for c in STARTED.columns],
                                        sa.select(*(rows.c[c.name] for c in STARTED.columns)))


_LOAD = {dialect: _load_statement(dialect) for dialect in ("postgresql", "mysql")}
_CREATE: dict[str, str] = {}
"""The temporary table's DDL by dialect, compiled once (every pass runs it, and a DDL is
compiled each time it is executed)."""


def _create(conn: Connection) -> None:
    """``STARTED`` made on the connection's session, where it is not yet."""
    name = conn.dialect.name
    if name not in _CREATE:
        _CREATE[name] = str(CreateTable(STARTED, if_not_exists=True)
                            .compile(dialect=conn.dialect))
    conn.exec_driver_sql(_CREATE[name])
_COLUMNS = [c.name for c in STARTED.columns]
_SQLITE_LOAD = str(STARTED.insert().compile(dialect=sqlite.dialect()))
"""``INSERT ... VALUES (?, ...)`` in ``_COLUMNS``' order, for the driver's executemany."""

ATTEMPT_FIELD = "reconciler_attempt"
"""A field of the job's hash the reconciler writes on resume: the attempt the resumed run
is (RQ reads only its own fields and never deletes others), so a task's step ledger run
and the next pass know it, whatever became of the pass's own commit."""
JOB_FIELDS = ("status", "worker_name", "started_at", "retries_left", ATTEMPT_FIELD, "data")
WORKER_FIELDS = ("last_heartbeat", "death", "birth", "version")
SILENT_REREAD_SECONDS = 60.0
"""How long the live entries found silent are read again by themselves before every live
entry is read again to find those that went silent since: a wedged job is found at most
this long after its ``wedged_after_seconds`` (minutes, usually hours), and a quiet pass
costs its Redis a read of every live entry once a minute, not once a pass."""

Entry = tuple[str, str, float]
"""A started registry's entry: its queue, its member ``<job id>:<execution id>``, its
score (when it expires, Redis's clock)."""


@dataclass(frozen=True, slots=True)
class Execution:
    """What one execution's job said when first read (its kind read from ``data``)."""

    status: str | None
    worker: str | None
    started_at: float | None
    retries_left: int | None
    attempt: int
    kind: str | None


NOTHING_LOADED = Loaded(rows=0)
"""A snapshot that loaded no entry (Redis unread, or nothing started or expired)."""


@dataclass(frozen=True, slots=True)
class SilentEntries:
    """The live entries whose job's step ledger was found silent, and when (Redis's
    clock), by the last read of every live entry."""

    read_at: float
    members: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One transaction's view of Redis, loaded into ``STARTED``: why it was not trusted
    (None: it was), and how many live entries it counted without loading them."""

    doubt: LivenessDoubt | None
    loaded: Loaded = NOTHING_LOADED

    @property
    def may_swap(self) -> bool:
        """Whether Redis may be written: it answered and holds RQ's keys."""
        return self.doubt is None


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("utf-8", errors="replace")


def _int(value: bytes | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


@dataclass
class RqLiveness:
    """The rq source's declared liveness, made once per process from its config: its
    Redis client and the kinds already read are kept across passes."""

    config: RqConfig
    seen: dict[str, Execution] = field(default_factory=dict)
    silent_found: SilentEntries | None = None
    _redis: Any = None

    def client(self) -> Any:
        """The app's Redis (a pass gives up on a silent one after 5 s)."""
        if self._redis is None:
            import redis  # noqa: PLC0415 - only the rq source needs it

            self._redis = redis.Redis.from_url(self.config.url, socket_timeout=5,
                                               socket_connect_timeout=5)
        return self._redis

    def where(self) -> str:
        """The Redis URL with any password hidden."""
        return redact(self.config.url)

    def judge(self, conn: Connection, kinds: KindRules, *, every: bool,
              silent: Silent | None) -> Snapshot:
        """Redis read once, loaded into ``STARTED`` on ``conn`` (``load``). Only the
        expired entries are loaded, and the live ones ``silent`` keeps, the rest counted,
        unless ``every`` asks for them or the kinds are told apart (``[kinds]`` sets a
        scan's key for some kind but ``"*"``: the brake then counts the reconciled kinds'
        jobs only, read by kind)."""
        return self.load(conn, every=every or AllKinds.of(kinds) is None, silent=silent)

    def loaded(self, verdict: Snapshot) -> Loaded:
        """The entries the snapshot loaded, and the live ones it only counted."""
        return verdict.loaded

    def load(self, conn: Connection, *, every: bool, silent: Silent | None = None
             ) -> Snapshot:
        """Redis read once, loaded into ``STARTED`` on ``conn`` (emptied first): every
        watched started entry, or (not ``every``) the expired ones and the live ones
        ``silent`` keeps, the rest counted. A read of some entries that found none leaves
        the table as it was: the kit reads nothing of a verdict that loaded no row, and a
        quiet pass costs no statement of it."""
        import redis  # noqa: PLC0415 - only the rq source needs it

        try:
            rows, unloaded, doubt = self._read(every=every, silent=silent)
        except redis.RedisError:
            rows, unloaded, doubt = [], 0, LivenessDoubt.BROKER_UNREACHABLE
        if rows or every:  # an operator's read of every job reads the table, rows or not
            _create(conn)
            conn.execute(STARTED.delete())
        if doubt is LivenessDoubt.BROKER_UNREACHABLE:
            # Not ``NOTHING_LOADED``: a later read of every job in this transaction must
            # still make its table.
            return Snapshot(doubt, Loaded(0, every=every))
        if rows and conn.dialect.name == "sqlite":
            # In process: the driver's own loop over plain tuples is the fastest (a JSON
            # parameter costs SQLite a json_extract for each value, and SQLAlchemy's
            # executemany a bind processor for each).
            conn.exec_driver_sql(_SQLITE_LOAD, [tuple(row[c] for c in _COLUMNS) for row in rows])
        elif rows:
            # Over the network: one statement, the rows as one JSON parameter, so ten
            # thousand started jobs cost one round trip.
            conn.execute(_LOAD[conn.dialect.name], {"started_rows": encode_rows(rows)})
        return Snapshot(doubt, Loaded(len(rows), unloaded, every=every))

    def _read(self, *, every: bool, silent: Silent | None
              ) -> tuple[list[dict[str, Any]], int, LivenessDoubt | None]:
        """Every watched started registry's entries (``every``), else its expired ones
        and the live ones ``silent`` keeps; the jobs read (all of them, but an every
        read's live entries seen before), and the workers of the expired ones; the rows,
        and the live entries counted but not loaded."""
        client = self.client()
        with client.pipeline(transaction=False) as pipe:
            pipe.time()
            pipe.smembers(keys.QUEUES)
            (seconds, micros), queue_keys = pipe.execute()
        now = float(seconds) + float(micros) / 1e6
        if not queue_keys and not client.scard(keys.WORKERS):
            # No RQ key: an empty database is an app that has not run yet (nothing to
            # decide, nothing in doubt); one holding others' keys is not the app's.
            doubt = LivenessDoubt.QUEUES_MISSING if client.dbsize() else None
            return [], 0, doubt
        names = sorted(k.decode().removeprefix(keys.QUEUE_PREFIX) for k in queue_keys)
        watched = [q for q in names if self.config.watches(q)]
        cut = silent_at(now, self.config.session_timeout_seconds)
        entries, unloaded = self._entries(client, watched, now, every=every, silent=silent)
        if every:
            # Executions are kept across such reads (by ``<job id>:<execution id>``, the
            # registry's member) while their entries last: what a pass reads of a job, but
            # for its heartbeat, does not change while one execution runs (its worker,
            # start, retries left, attempt and kind), so a live entry seen before costs
            # no read but its registry's. (A pass of expired entries alone leaves them:
            # it cannot tell which have ended.)
            current = {member for _, member, _ in entries}
            self.seen = {m: job for m, job in self.seen.items() if m in current}
        if not entries:
            return [], unloaded, None
        # A fence is built from what a silent entry's job says now, never from memory;
        # and a pass reads every job it loads (only an every read remembers).
        read = self._read_jobs(client, [member for _, member, score in entries
                                        if not every or score <= cut
                                        or member not in self.seen])
        if every:
            self.seen.update(read)
        executions = {**self.seen, **read} if every else read
        overdue = [member for _, member, score in entries if score <= cut]
        worker_names = sorted({str(executions[m].worker) for m in overdue
                               if executions[m].worker})
        with client.pipeline(transaction=False) as pipe:
            for name in worker_names:
                pipe.hmget(keys.worker_key(name), WORKER_FIELDS)
            workers_read = dict(zip(worker_names, pipe.execute(), strict=True))
        for name, (_, _, _, version) in workers_read.items():
            if version:
                keys.require_supported(version.decode(), f"worker {name}")
        return ([self._row(now, cut, entry, executions[entry[1]], workers_read)
                 for entry in entries], unloaded, None)

    def _entries(self, client: Any, watched: Sequence[str], now: float, *, every: bool,
                 silent: Silent | None) -> tuple[list[Entry], int]:
        """The watched registries' entries to load: every one, or the silent ones (their
        heartbeat ``session_timeout_seconds`` overdue, on Redis's clock: the expired ones
        RQ's own cleanup reads among them) and the live ones whose job's step ledger
        ``silent`` says went silent (the wedged scan's); and how many live ones were left
        out, for the brake's count."""
        if every:
            return _range(client, watched, "-inf", "+inf"), 0
        cut = silent_at(now, self.config.session_timeout_seconds)
        expired = _range(client, watched, "-inf", repr(cut))
        # An entry renewed between two reads would be in both: it is loaded once, expired.
        read_expired = {member for _, member, _ in expired}
        live_loaded: list[Entry] = []
        if silent is not None:
            found = self.silent_found
            if found is None or now - found.read_at >= SILENT_REREAD_SECONDS:
                alive = [e for e in _range(client, watched, f"({cut!r}", "+inf")
                         if e[1] not in read_expired]
                kept = set(silent([m.rpartition(":")[0] for _, m, _ in alive])) if alive else ()
                loaded = [e for e in alive if e[1].rpartition(":")[0] in kept]
                self.silent_found = SilentEntries(now, tuple((q, m) for q, m, _ in loaded))
                return expired + loaded, len(alive) - len(loaded)
            # Between such reads: the entries found silent, read again (still live, and
            # as they are now: the wedged scan and its fence judge them afresh).
            with client.pipeline(transaction=False) as pipe:
                for queue, member in found.members:
                    pipe.zscore(keys.started_key(queue), member)
                scores = pipe.execute()
            live_loaded = [(queue, member, float(score)) for (queue, member), score
                           in zip(found.members, scores, strict=True)
                           if score is not None and float(score) > cut
                           and member not in read_expired]
        if not expired and not live_loaded:
            return [], 0  # the brake's count is read only by a pass with candidates
        # The live entries counted as such (never the registry's size less those read,
        # which a job leaving the registry between the two reads would count off twice).
        with client.pipeline(transaction=False) as pipe:
            for queue in watched:
                pipe.zcount(keys.started_key(queue), f"({cut!r}", "+inf")
            live = sum(pipe.execute())
        return expired + live_loaded, max(live - len(live_loaded), 0)

    def _read_jobs(self, client: Any, members: Sequence[str]) -> dict[str, Execution]:
        """Each execution's job read (pipelined); its kind read from its payload without
        unpickling it, only where it is not remembered."""
        if not members:
            return {}
        known = [m in self.seen and self.seen[m].kind is not None for m in members]
        with client.pipeline(transaction=False) as pipe:
            for member, kind_known in zip(members, known, strict=True):
                fields = JOB_FIELDS[:-1] if kind_known else JOB_FIELDS
                pipe.hmget(keys.job_key(member.rpartition(":")[0]), fields)
            read = pipe.execute()
        found = {}
        for member, kind_known, job in zip(members, known, read, strict=True):
            status, worker, started, retries_left, attempt = job[:5]
            kind = (self.seen[member].kind if kind_known
                    else func_name(job[5], self.config.serializer))
            found[member] = Execution(_text(status), _text(worker), utc_seconds(started),
                                      _int(retries_left), _int(attempt) or 1, kind)
        return found

    def _row(self, now: float, cut: float, entry: tuple[str, str, float], job: Execution,
             workers: dict[str, Sequence[bytes | None]]) -> dict[str, Any]:
        """One registry entry (queue, ``<job id>:<execution id>``, score) and its job as a
        row; ``cut``: ``silent_at`` now."""
        queue, member, score = entry
        job_id, _, execution_id = member.rpartition(":")
        return {
            "job_id": job_id, "job_kind": job.kind or UNREADABLE_LABEL,
            "unreadable": job.kind is None, "queue": queue, "execution_id": execution_id,
            "score": score, "entry_over": now - score,
            "silent_over": silent_over(now, score, self.config.session_timeout_seconds),
            "status": job.status, "worker": job.worker,
            # Only a silent entry's worker is read: a renewed entry's job is live whatever
            # its worker (``RqSql._over`` needs the entry silent first).
            "worker_gone": score <= cut and worker_gone(
                now, workers.get(job.worker or ""), job.started_at,
                self.config.session_timeout_seconds),
            "run_seconds": None if job.started_at is None else now - job.started_at,
            "retries_left": job.retries_left, "attempt": job.attempt,
        }

    def unknown(self, verdict: Snapshot) -> LivenessUnknown | None:
        """Why Redis's view was not trusted this transaction (None: it was)."""
        return None if verdict.doubt is None else LivenessUnknown(verdict.doubt, self.where())

    def stuck(self, verdict: Snapshot) -> StuckWork:
        """Nothing beside the kit's count: every expired entry is in ``STARTED`` (one whose
        kind cannot be read is a candidate, held back as ``reconcile_error``), and while
        Redis is not read none is known to be running."""
        return {}

    def check(self) -> None:
        """RQ installed, in the range read (not that Redis answers now: a pass says so)."""
        keys.installed()


def _range(client: Any, watched: Sequence[str], low: str, high: str) -> list[Entry]:
    """The entries of the watched registries scored from ``low`` to ``high``, pipelined."""
    with client.pipeline(transaction=False) as pipe:
        for queue in watched:
            pipe.zrangebyscore(keys.started_key(queue), low, high, withscores=True)
        return [(queue, member.decode(), float(score))
                for queue, found in zip(watched, pipe.execute(), strict=True)
                for member, score in found]

