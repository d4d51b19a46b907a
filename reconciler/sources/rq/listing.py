"""RQ's jobs as operators read them (``reconciler jobs list|show|explain``, the console):
every job of the watched queues, in every status RQ keeps, copied from Redis into a
temporary table on the reconciler's own database for the one read that asked.

Where RQ keeps a job of each status (rq 2.x): ``queued`` on its queue's list
(``rq:queue:<q>``), ``started`` in the started registry (``rq:wip:<q>``, members
``<job id>:<execution id>``), ``deferred``, ``scheduled``, ``finished``, ``failed`` (and
``stopped``) and ``canceled`` in their registries (sorted sets); the job itself is the hash
``rq:job:<id>``, whose ``status`` is the truth (a registry entry whose hash expired is not
listed).

Bounded: a read never copies more than it can show. ``jobs list --limit N`` takes, from
each registry (and queue list) of each watched queue that can hold the statuses asked for,
its ``N`` most recent entries (the tail of the list, the highest scores of a registry),
reads those jobs' hashes in one pipeline and lets SQL order them newest created first and
keep ``N``: a 100,000-job Redis costs a ``jobs list --limit 50`` at most 50 hashes per
registry and queue. Since a registry orders by its own score (an expiry, a schedule),
the list is the newest of each registry's most recent entries, not a scan of every job.
``jobs show ID`` reads that one hash. Nothing here unpickles anything: the kind is read
from the pickled call's opcodes (``kinds.func_name``), never loaded.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
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
from reconciler.sources.kit.system import Wanted
from reconciler.sources.rq.config import RqConfig
from reconciler.sources.rq.keys import (
    QUEUE_PREFIX,
    QUEUES,
    WORKERS,
    job_key,
    queue_key,
    started_key,
)
from reconciler.sources.rq.kinds import UNREADABLE_LABEL, func_name
from reconciler.sources.rq.snapshot import ATTEMPT_FIELD, JOB_ID
from reconciler.sources.rq.writes import exc_text

STATUS_WORDS: Mapping[str, JobStatus] = {
    "created": JobStatus.QUEUED, "queued": JobStatus.QUEUED, "deferred": JobStatus.QUEUED,
    "scheduled": JobStatus.QUEUED, "started": JobStatus.PROCESSING,
    "finished": JobStatus.COMPLETED, "failed": JobStatus.FAILED,
    "stopped": JobStatus.CANCELLED, "canceled": JobStatus.CANCELLED,
}
"""RQ's job statuses in this project's words: a job not yet enqueued or waiting on its
dependencies or its time is queued; a job its worker stopped on request
(``send_stop_job_command``: an operator's cancel of a running job; RQ keeps it in the
failed registry but never retries it) is cancelled."""

REGISTRY_KEYS: Mapping[str, str] = {
    "started": "rq:wip:{}", "deferred": "rq:deferred:{}", "scheduled": "rq:scheduled:{}",
    "finished": "rq:finished:{}", "failed": "rq:failed:{}", "stopped": "rq:failed:{}",
    "canceled": "rq:canceled:{}",
}
"""Where RQ keeps a job of each status but ``queued`` (its queue's list), per queue."""
FIELDS = ("status", "origin", "data", "created_at", "enqueued_at", "started_at",
          "ended_at", "worker_name", "retries_left", ATTEMPT_FIELD, "exc_info")
"""What a listing and an action read of a job's hash."""
TIMESTAMP = "%Y-%m-%dT%H:%M:%S.%fZ"
"""How RQ writes its times (``rq.utils.utcformat``), always UTC."""

Client = Callable[[], Any]
"""The app's Redis, as a ``redis.Redis`` (typed loosely: redis is imported lazily)."""


@contextmanager
def answering(url: str, what: str) -> Iterator[None]:
    """One line naming the store when the app's Redis does not answer (``what``: what
    was left undone), never a traceback."""
    import redis  # noqa: PLC0415 - only the rq source needs it

    try:
        yield
    except redis.RedisError as exc:
        raise DatabaseUnavailableError(
            f"source rq: its Redis at {redact(url)} did not answer ({type(exc).__name__}); "
            f"{what}") from None


def foreign_keys_only(redis: Any) -> bool:
    """Whether this Redis database holds keys but none of RQ's: another app's, a wrong
    database number. (An empty one is a deployment whose app has not run yet: RQ writes
    ``rq:queues`` at the first job enqueued and ``rq:workers`` at a worker's start, and
    keeps both.)"""
    with redis.pipeline(transaction=False) as pipe:
        pipe.exists(QUEUES, WORKERS)
        pipe.dbsize()
        ours, keys = pipe.execute()
    return not ours and bool(keys)


def connect(url: str) -> Any:
    """A client of the app's Redis at ``url`` (answers as bytes, as RQ's own client)."""
    import redis  # noqa: PLC0415 - only the rq source needs it

    return redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0)


def text(value: bytes | str | None) -> str | None:
    """A hash field as text (None when absent or empty)."""
    if value is None:
        return None
    decoded = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return decoded or None


def moment(value: bytes | str | None) -> datetime | None:
    """One of RQ's times, or None."""
    written = text(value)
    if written is None:
        return None
    try:
        return datetime.strptime(written, TIMESTAMP).replace(tzinfo=UTC)
    except ValueError:
        return None


_OURS = {exc_text(r.value): r.value for r in Reason}


def our_reason(exc_info: bytes | None) -> str | None:
    """The reason code of a reconciler's terminalization (its ``exc_info`` is ours word
    for word); never any text of a job's own error."""
    if not exc_info:
        return None
    try:
        written = zlib.decompress(exc_info).decode("utf-8", "replace")
    except zlib.error:
        return None
    return _OURS.get(written)


def number(value: bytes | str | None) -> int | None:
    """A whole-number field, or None."""
    written = text(value)
    try:
        return None if written is None else int(written)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class RqListing:
    """The listing of the watched queues' jobs, declared once per process."""

    config: RqConfig
    client: Client

    def watched(self, queue: str | None) -> bool:
        """Whether the source watches ``queue``."""
        return queue is not None and self.config.watches(queue)

    def queue_names(self, redis: Any) -> list[str]:
        """The watched queues RQ knows (its ``rq:queues`` set)."""
        names = ((text(k) or "").removeprefix(QUEUE_PREFIX) for k in redis.smembers(QUEUES))
        return sorted(n for n in names if self.watched(n))

    def every(self, conn: Connection) -> sa.Select[Any]:
        """Every job of the watched queues (``System.listing``)."""
        return self.narrowed(conn, Wanted())

    def narrowed(self, conn: Connection, wanted: Wanted) -> sa.Select[Any]:
        """What ``wanted`` asks for, copied into a temporary table (``System.listing_for``)."""
        with answering(self.config.url, "no job of it can be listed"):
            redis = self.client()
            if foreign_keys_only(redis):
                raise ConfigError(
                    f"source rq: the Redis at {redact(self.config.url)} holds keys, but none "
                    "of RQ's (no rq:queues, no rq:workers): not the app's Redis? Check the "
                    "database number in redis_url; nothing was listed")
            if wanted.job_id is not None:
                ids = [wanted.job_id]
            else:
                ids = self._recent_ids(redis, wanted.limit, wanted.statuses)
            rows = self._rows(redis, ids)
        return copied(conn, rows)

    def _recent_ids(self, redis: Any, limit: int | None, statuses: frozenset[str] | None
                    ) -> list[str]:
        """The ids of each registry's ``limit`` most recent entries (every entry without
        a limit), of the registries that can hold ``statuses``."""
        last = -1 if limit is None else limit - 1
        pipe = redis.pipeline(transaction=False)
        executions: list[bool] = []
        for queue in self.queue_names(redis):
            if statuses is None or "queued" in statuses:
                pipe.lrange(queue_key(queue), 0 if limit is None else -limit, -1)
                executions.append(False)
            keys = {template.format(queue) for status, template in REGISTRY_KEYS.items()
                    if statuses is None or status in statuses}
            for key in sorted(keys):
                pipe.zrevrange(key, 0, last)
                executions.append(key == started_key(queue))
        ids: dict[str, None] = {}
        for started, members in zip(executions, pipe.execute(), strict=True):
            for member in members:
                # A started registry's member is "<job id>:<execution id>"; elsewhere the
                # id alone, taken whole.
                job_id = text(member) or ""
                ids.setdefault(job_id.rpartition(":")[0] if started else job_id, None)
        return [i for i in ids if i]

    def _rows(self, redis: Any, ids: Iterable[str]) -> list[dict[str, Any]]:
        """Each job's hash as a listing row (a job whose hash is gone, or of a queue not
        watched, is left out)."""
        ids = list(ids)
        pipe = redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(job_key(job_id), *FIELDS)
        rows = []
        for job_id, values in zip(ids, pipe.execute(), strict=True):
            read = dict(zip(FIELDS, values, strict=True))
            if read["status"] is None or not self.watched(text(read["origin"])):
                continue
            attempt, left = number(read[ATTEMPT_FIELD]) or 1, number(read["retries_left"])
            times = [moment(read[f]) for f in ("ended_at", "started_at", "enqueued_at",
                                                "created_at")]
            rows.append({
                "job_id": job_id,
                "job_kind": func_name(read["data"], self.config.serializer) or UNREADABLE_LABEL,
                "source_status": text(read["status"]), "attempts": attempt,
                # RQ's own budget where the job has a Retry (as the pass counts it), else
                # the kind's (None here).
                "max_attempts": None if left is None else attempt + left,
                "reason": our_reason(read["exc_info"]),
                "created_at": moment(read["created_at"]),
                "updated_at": next((t for t in times if t is not None), None),
                "finished_at": times[0]})
        return rows


INSTANT = sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql")
"""RQ's instants to the microsecond (MySQL's plain DATETIME drops the fraction, and the
listing's order with it)."""

LISTED = sa.Table(
    "reconciler_rq_listed", sa.MetaData(),
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
"""The jobs one operator's read copied from Redis, on its own connection only."""


def copied(conn: Connection, rows: Sequence[Mapping[str, Any]]) -> sa.Select[Any]:
    """``rows`` in the connection's temporary table (emptied first: a pooled connection
    keeps it), selected as a listing."""
    conn.execute(CreateTable(LISTED, if_not_exists=True))
    conn.execute(LISTED.delete())
    if rows:
        conn.execute(LISTED.insert(), list(rows))
    return sa.select(*LISTED.c)
