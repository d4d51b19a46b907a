"""``--peers``: Procrastinate's own stalled-job recovery, on the same PostgreSQL, in the same run.

Procrastinate 3.x documents one route for jobs whose worker died ("Retry stalled jobs"): a
periodic task awaits ``app.job_manager.get_stalled_jobs()``, which returns the ``doing`` jobs of
workers whose row in ``procrastinate_workers`` has not heartbeated for ``seconds_since_heartbeat``
(30 s by default; workers heartbeat every 10 s), then ``app.job_manager.retry_job(job)`` for each,
which puts it back in ``todo`` with one call of ``procrastinate_retry_job_v2`` (and its event
triggers) per job. Both are async-only methods: they run here on an ``App`` opened with a
``PsycopgConnector``, exactly as that recipe does.

The data has our dataset's shape (benchmarks/dataset.py), written in bulk SQL straight into the
schema Procrastinate applies itself: S jobs ``doing`` on a worker last heard from 10 minutes ago
(one tenth with 3 attempts: Procrastinate's recovery does not look at attempts), N/100 ``doing``
on a worker whose heartbeat is fresh, the rest half ``todo`` and half ``succeeded``, with the
event history each would have. Each measurement gets its own PostgreSQL schema, dropped after.

- ``peer_recovery``: one run of the recipe over all S stalled jobs, in jobs/s.
- ``peer_quiet_pass``: median time of ``get_stalled_jobs()`` when nothing is stalled.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from typing import TYPE_CHECKING

import psycopg
import sqlalchemy as sa
from psycopg import sql
from psycopg.conninfo import make_conninfo

from benchmarks.dataset import Shape
from benchmarks.harness import QUIET_PASSES, Databases, Measurement

if TYPE_CHECKING:
    from procrastinate import App

NEEDS_PROCRASTINATE = "--peers needs Procrastinate: pip install -e '.[peers]'"
DEAD_HEARTBEAT_AGE = 600  # seconds; as old as our stale jobs' last activity
STALLED_AFTER = 30  # seconds_since_heartbeat passed to get_stalled_jobs (its default)

WORKERS = """
    WITH w AS (INSERT INTO procrastinate_workers (last_heartbeat)
               VALUES (now() - make_interval(secs => %s)), (now()) RETURNING id, last_heartbeat)
    SELECT id FROM w ORDER BY last_heartbeat"""
JOBS = """
    INSERT INTO procrastinate_jobs (id, queue_name, task_name, status, attempts, worker_id)
    SELECT n, 'default', 'report',
        (CASE WHEN n <= %(live_end)s THEN 'doing' WHEN n <= %(todo_end)s THEN 'todo'
              ELSE 'succeeded' END)::procrastinate_job_status,
        CASE WHEN n <= %(stale)s AND n %% 10 = 0 THEN 3
             WHEN n > %(live_end)s AND n <= %(todo_end)s THEN 0 ELSE 1 END,
        CASE WHEN n <= %(stale)s THEN %(dead)s WHEN n <= %(live_end)s THEN %(live)s END
    FROM generate_series(1, %(jobs)s::bigint) AS s(n)"""
EVENTS = """
    INSERT INTO procrastinate_events (job_id, type)
    SELECT id, e.type FROM procrastinate_jobs CROSS JOIN LATERAL unnest((CASE status
        WHEN 'todo' THEN '{deferred}' WHEN 'doing' THEN '{deferred,started}'
        ELSE '{deferred,started,succeeded}' END)::procrastinate_job_event_type[]) AS e(type)"""
CHECK = """
    SELECT count(*) FILTER (WHERE id <= %(stale)s AND status = 'todo'
                              AND attempts = CASE WHEN id %% 10 = 0 THEN 4 ELSE 2 END),
           count(*) FILTER (WHERE status = 'doing'),
           count(*) FILTER (WHERE id > %(stale)s AND id <= %(live_end)s AND status = 'doing'
                              AND attempts = 1 AND worker_id = %(live)s)
    FROM procrastinate_jobs"""


@contextmanager
def _own_schema(dbs: Databases) -> Iterator[str]:
    """Conninfo of a new PostgreSQL schema, dropped afterwards: it never meets our tables."""
    url = sa.engine.make_url(dbs.server_database()).set(drivername="postgresql")
    base = make_conninfo(url.render_as_string(hide_password=False))
    name = f"peer_procrastinate_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    try:
        yield make_conninfo(base, options=f"-c search_path={name}")
    finally:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


async def _build(app: App, conninfo: str, shape: Shape) -> dict[str, int]:
    """Apply Procrastinate's schema, fill it with ``shape``; the ids and bounds to check by.

    The insert triggers are off while building: they would queue one NOTIFY per ``todo`` job
    in a single transaction. The event history they and the worker would have written is
    inserted in bulk instead.
    """
    await app.schema_manager.apply_schema_async()
    live_end = shape.stale + shape.live
    async with await psycopg.AsyncConnection.connect(conninfo) as conn:
        (dead,), (live,) = await (await conn.execute(WORKERS, [DEAD_HEARTBEAT_AGE])).fetchall()
        bounds = {"stale": shape.stale, "live_end": live_end, "jobs": shape.jobs,
                  "todo_end": live_end + (shape.jobs - live_end) // 2, "dead": dead, "live": live}
        await conn.execute("ALTER TABLE procrastinate_jobs DISABLE TRIGGER USER")
        await conn.execute(JOBS, bounds)
        await conn.execute(EVENTS)
        await conn.execute("ALTER TABLE procrastinate_jobs ENABLE TRIGGER USER")
        await conn.commit()
        # As our tables get after their build (dataset.analyze): hint bits set, visibility
        # map current, statistics fresh.
        await conn.set_autocommit(True)
        await conn.execute(
            "VACUUM ANALYZE procrastinate_jobs, procrastinate_events, procrastinate_workers")
    return bounds


async def _recovery(app: App, conninfo: str, shape: Shape) -> tuple[float, int]:
    """Seconds for one run of the documented recipe over all S stalled jobs; jobs retried."""
    async with app.open_async():
        bounds = await _build(app, conninfo, shape)
        await app.job_manager.update_heartbeat(bounds["live"])  # as the live worker does
        started = time.perf_counter()
        stalled = list(await app.job_manager.get_stalled_jobs(
            seconds_since_heartbeat=STALLED_AFTER))
        for job in stalled:
            await app.job_manager.retry_job(job)
        seconds = time.perf_counter() - started
    async with await psycopg.AsyncConnection.connect(conninfo) as conn:
        row = await (await conn.execute(CHECK, bounds)).fetchone()
    expected = (shape.stale, shape.live, shape.live)
    if {job.id for job in stalled} != set(range(1, shape.stale + 1)) or row != expected:
        raise RuntimeError(f"Procrastinate's recovery found {len(stalled)} stalled jobs and "
                           f"left (retried, doing, live intact) = {row}, not {expected}")
    return seconds, len(stalled)


async def _quiet(app: App, conninfo: str, shape: Shape, passes: int) -> list[float]:
    """Milliseconds of ``get_stalled_jobs`` with nothing stalled, after one warm-up call."""
    samples = []
    async with app.open_async():
        bounds = await _build(app, conninfo, shape)
        for _ in range(passes + 1):
            await app.job_manager.update_heartbeat(bounds["live"])
            started = time.perf_counter()
            stalled = list(await app.job_manager.get_stalled_jobs(
                seconds_since_heartbeat=STALLED_AFTER))
            samples.append((time.perf_counter() - started) * 1000)
            if stalled:
                raise RuntimeError("the peer quiet-pass measurement found stalled jobs")
    return samples[1:]


def measure_procrastinate(dbs: Databases, shape: Shape) -> list[Measurement]:
    """Procrastinate's recovery of ``shape`` and its quiet query, each in a schema of its own."""
    try:
        import procrastinate  # noqa: PLC0415 - an optional extra, needed only here
    except ImportError:
        raise SystemExit(NEEDS_PROCRASTINATE) from None
    peer = f"procrastinate {version('procrastinate')}"

    def app(conninfo: str) -> App:
        return procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=conninfo))

    with _own_schema(dbs) as conninfo:
        seconds, recovered = asyncio.run(_recovery(app(conninfo), conninfo, shape))
    quiet = Shape(shape.jobs, 0)
    with _own_schema(dbs) as conninfo:
        samples = asyncio.run(_quiet(app(conninfo), conninfo, quiet, QUIET_PASSES))
    return [
        Measurement("peer_recovery", "postgresql", shape.jobs, shape.stale,
                           round(recovered / seconds), "jobs/s",
                           {"peer": peer, "seconds": round(seconds, 3), "recovered": recovered}),
        Measurement("peer_quiet_pass", "postgresql", shape.jobs, 0,
                           round(statistics.median(samples), 3), "ms",
                           {"peer": peer, "live_running": quiet.live, "samples": len(samples)}),
    ]
