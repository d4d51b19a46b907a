"""The Python systems ``benchmarks.foreign`` measures: Django's tasks (django-tasks-db) and
Celery (its database result backend, a Redis broker); and every system's name.

Each is built as the others are (benchmarks/foreign_systems.py): its table made by its
own code (Django's ``migrate`` of the test project tests/sources/django_app; Celery's own
SQLAlchemy models of ``celery_taskmeta``), then filled with set-based SQL.

Neither system has a stalled-job mechanism of its own (which is why the reconciler has
these sources), so each **peer** is the hand-written sweep a team runs instead, a
baseline and not the system's own:

- django-tasks: one ``UPDATE ... SET status = 'READY' WHERE status = 'RUNNING' AND
  started_at < now() - <max_run_seconds>``, the lease the source judges by.
- Celery: a ``STARTED`` row has no timestamp, so no ``UPDATE`` can tell a dead claim from a
  live one by time. The sweep a team writes asks the broker: the workers named by the
  ``STARTED`` rows, Celery's own control ``ping`` to them, then one ``UPDATE ... SET status =
  'FAILURE' WHERE status = 'STARTED' AND worker = ANY(<the silent ones>)``. It fails the
  tasks; it does not run them again (the reconciler's resume re-publishes each through
  Celery's ``send_task``), and it takes one silence for death.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

from benchmarks.celery_holders import start_holding
from benchmarks.foreign_base import REPO, Size, System, bounds, execute, vacuum
from benchmarks.foreign_systems import SYSTEMS as OTHER_SYSTEMS
from benchmarks.foreign_systems import OneStatementSweep, libpq_url

DJANGO_TABLE = "django_tasks_database_dbtaskresult"
MAX_RUN_SECONDS = 600
ORPHAN_IDS = "SELECT md5(n::text)::uuid FROM generate_series(1, %(orphans)s::bigint) AS s(n)"
"""The orphans' ids: the first ``orphans`` of the running jobs (ids are ``md5(n)``)."""


class DjangoTasks(OneStatementSweep):
    """django-tasks-db 0.13 (Django 5.2 with the backport, or Django 6): one backend, one
    task path, every kind leased by ``max_run_seconds`` (the only liveness it has)."""

    name = "django-tasks"
    user_index: str | None = None  # docs/sources.md suggests none: its scan reads the table
    source_toml = ('[source]\nkind = "django-tasks"\n[kinds."*"]\neffect = "idempotent"\n'
                   f'max_run_seconds = {MAX_RUN_SECONDS}\n')
    sweep = (f"UPDATE {DJANGO_TABLE} SET status = 'READY' WHERE status = 'RUNNING' AND "
             f"started_at < now() - interval '{MAX_RUN_SECONDS} seconds'")

    def build(self, conninfo: str, size: Size) -> None:
        env = {**os.environ, "SOURCES_DJANGO_DB": libpq_url(conninfo),
               "DJANGO_SETTINGS_MODULE": "tests.sources.django_app.settings"}
        done = subprocess.run([sys.executable, "-m", "tests.sources.django_app.manage",
                               "migrate", "-v0"], capture_output=True, text=True, env=env,
                              cwd=REPO, timeout=600, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"django migrate: {done.stderr[-800:]}")
        # As the backend writes them: enqueue's row, claim's status, started_at and
        # worker_ids; a finished one's finished_at and return value.
        execute(
            conninfo,
            f"""INSERT INTO {DJANGO_TABLE} (id, status, enqueued_at, started_at, finished_at,
                    args_kwargs, priority, task_path, worker_ids, queue_name, backend_name,
                    run_after, return_value, exception_class_path, traceback)
               SELECT md5(n::text)::uuid,
                   CASE WHEN n <= %(running)s THEN 'RUNNING' WHEN n <= %(waiting_end)s
                   THEN 'READY' ELSE 'SUCCESSFUL' END,
                   now() - interval '1 hour',
                   CASE WHEN n <= %(running)s OR n > %(waiting_end)s THEN now() END,
                   CASE WHEN n > %(waiting_end)s THEN now() END,
                   '{{"args": [], "kwargs": {{}}}}'::jsonb, 0, 'app.tasks.report',
                   CASE WHEN n > %(running)s AND n <= %(waiting_end)s THEN '[]'::jsonb
                   ELSE '["worker-live"]'::jsonb END,
                   'default', 'default', '9999-01-01 00:00:00+00',
                   CASE WHEN n > %(waiting_end)s THEN '"done"'::jsonb END, '', ''
               FROM generate_series(1, %(jobs)s::bigint) AS s(n)""",
            params=bounds(size))
        vacuum(conninfo, DJANGO_TABLE)

    def keep_alive(self, conninfo: str) -> None:
        """No heartbeats: the live claims started at the build, within their lease."""

    def kill(self, conninfo: str, size: Size) -> None:
        execute(conninfo, f"UPDATE {DJANGO_TABLE} SET status = 'RUNNING', worker_ids = "
                          "'[\"worker-dead\"]', started_at = now() - make_interval(secs => "
                          f"%(dead)s) WHERE id IN ({ORPHAN_IDS})", params=bounds(size))


# --------------------------------------------------------------------------- #
# Celery: its result table, a real Redis, a real live worker
# --------------------------------------------------------------------------- #

LIVE_WORKER = "live@bench"
ORPHANS_WORKER = "orphans@bench"
"""The worker that holds the orphans' tasks until ``kill`` SIGKILLs it whole."""
SESSION_TIMEOUT_SECONDS = 1.0
PING_TIMEOUT_SECONDS = 1.0  # the source's own (reconciler/sources/celery/broker.py)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class CeleryTasks:
    """Celery 5.7's database result backend (``celery_taskmeta``, ``result_extended``) and a
    throwaway redis-server as its broker. The running tasks' rows name real workers of the
    test app that hold them (``benchmarks.celery_holders``): ``live@bench`` the live ones,
    ``orphans@bench`` the orphans' until ``kill`` SIGKILLs it whole."""

    name = "celery"
    user_index: str | None = None  # the scan reads the STARTED rows, the sweep the same
    silence_seconds = SESSION_TIMEOUT_SECONDS

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self.broker_url = ""
        self.source_toml = ""
        self._orphans: subprocess.Popen[bytes] | None = None

    def build(self, conninfo: str, size: Size) -> None:
        self._start_broker()
        # Resumed tasks go to their row's queue, where no worker listens: each run is
        # measured on the rows as ``kill`` leaves them. The queue is declared on the broker,
        # as the app's workers declare theirs: the source trusts silence only on a broker
        # that holds the app's queues.
        from kombu import Connection, Exchange, Queue  # noqa: PLC0415 - optional, with celery

        with Connection(self.broker_url) as connection:
            Queue("bench", Exchange("bench"), routing_key="bench")(
                connection.default_channel).declare()
        self.source_toml = (
            f"session_timeout_seconds = {SESSION_TIMEOUT_SECONDS}\n"
            f"session_heartbeat_seconds = {SESSION_TIMEOUT_SECONDS / 2}\n"
            f'[source]\nkind = "celery"\nbroker_url = "{self.broker_url}"\n'
            '[kinds."*"]\neffect = "idempotent"\n')
        from celery.backends.database.models import TaskExtended  # noqa: PLC0415 - optional

        engine = sa.create_engine(libpq_url(conninfo).replace("postgresql://",
                                                              "postgresql+psycopg://"))
        TaskExtended.metadata.create_all(engine)
        engine.dispose()
        # As the backend writes them with result_extended: a STARTED row (date_done NULL
        # until a ready state, result the worker's pid and hostname), a finished one.
        # A waiting task has no row: it is a message in the broker.
        execute(
            conninfo,
            """INSERT INTO celery_taskmeta (id, task_id, status, result, date_done, name,
                    args, kwargs, worker, retries, queue)
               SELECT n, md5(n::text)::uuid::text,
                   CASE WHEN n <= %(running)s THEN 'STARTED' ELSE 'SUCCESS' END,
                   convert_to(CASE WHEN n <= %(running)s
                       THEN '{"pid": 1, "hostname": "live@bench"}' ELSE '"done"' END, 'UTF8'),
                   CASE WHEN n > %(running)s THEN now() AT TIME ZONE 'utc' END,
                   'app.tasks.report', convert_to('[]', 'UTF8'), convert_to('{}', 'UTF8'),
                   CASE WHEN n <= %(orphans)s THEN 'orphans@bench' ELSE 'live@bench' END,
                   0, 'bench'
               FROM generate_series(1, %(jobs)s::bigint) AS s(n)""",
            "SELECT setval('task_id_sequence', %(jobs)s)",
            params=bounds(size))
        vacuum(conninfo, "celery_taskmeta")
        self._start_holders(size)

    def _start_broker(self) -> None:
        self.broker_url = start_redis(self._stack, "celery")

    def _start_holders(self, size: Size) -> None:
        """The two workers, each holding its share of the running tasks."""
        folder = Path(tempfile.mkdtemp(prefix="reconciler-bench-celery-"))
        self._stack.callback(shutil.rmtree, folder, ignore_errors=True)
        ids = [str(uuid.UUID(hashlib.md5(str(n).encode()).hexdigest()))  # noqa: S324 - the rows' ids
               for n in range(1, size.running + 1)]
        live = start_holding(self._stack, self.broker_url, LIVE_WORKER, ids[size.orphans:],
                             folder)
        self._stack.callback(_stop, live)
        self._orphans = start_holding(self._stack, self.broker_url, ORPHANS_WORKER,
                                      ids[:size.orphans], folder)
        self._stack.callback(_stop, self._orphans)

    def _answering(self, hosts: list[str]) -> set[str]:
        """Celery's own control ping, as a team's script sends it."""
        from celery import Celery  # noqa: PLC0415 - optional

        app = Celery("bench-sweep", broker=self.broker_url, set_as_current=False)
        with contextlib.closing(app):
            replies = app.control.ping(destination=hosts, timeout=PING_TIMEOUT_SECONDS)
        return {host for reply in replies for host in reply}

    def keep_alive(self, conninfo: str) -> None:
        """The live worker answers ping all along."""

    def kill(self, conninfo: str, size: Size) -> None:
        """The orphans' worker SIGKILLed whole (once); their rows ``STARTED`` again."""
        if self._orphans is not None and self._orphans.poll() is None:
            self._orphans.kill()
            self._orphans.wait(timeout=30)
        execute(conninfo, "UPDATE celery_taskmeta SET status = 'STARTED', worker = "
                          f"'{ORPHANS_WORKER}', retries = 0, date_done = NULL, "
                          "traceback = NULL, result = convert_to('{\"pid\": 1, \"hostname\": "
                          "\"orphans@bench\"}', 'UTF8') WHERE task_id IN (SELECT id::text FROM "
                          f"({ORPHAN_IDS}) AS o(id))", params=bounds(size))

    def _sweep(self, conn: psycopg.Connection[Any]) -> int:
        """The team's sweep: ping the workers the STARTED rows name, fail the silent ones'."""
        hosts = [row[0] for row in conn.execute(
            "SELECT DISTINCT worker FROM celery_taskmeta WHERE status = 'STARTED'")]
        silent = sorted(set(hosts) - self._answering(hosts)) if hosts else []
        if not silent:
            return 0
        return conn.execute(
            "UPDATE celery_taskmeta SET status = 'FAILURE', date_done = now() AT TIME ZONE "
            "'utc', result = convert_to('{\"exc_type\": \"WorkerLostError\", \"exc_module\": "
            "\"billiard.exceptions\", \"exc_message\": [\"worker lost\"]}', 'UTF8') "
            "WHERE status = 'STARTED' AND worker = ANY(%(silent)s)", {"silent": silent}
        ).rowcount

    def peer_quiet(self, conninfo: str, runs: int) -> list[float]:
        samples = []
        with psycopg.connect(conninfo, autocommit=True) as conn:
            for _ in range(runs + 1):
                started = time.perf_counter()
                if self._sweep(conn):
                    raise RuntimeError("celery's quiet sweep found silent workers")
                samples.append((time.perf_counter() - started) * 1000)
        return samples[1:]

    def peer_recover(self, conninfo: str, size: Size) -> tuple[float, int]:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            started = time.perf_counter()
            recovered = self._sweep(conn)
            return time.perf_counter() - started, recovered

    def close(self) -> None:
        """Stop the live worker and the broker."""
        self._stack.close()


def start_redis(stack: contextlib.ExitStack, system: str) -> str:
    """A throwaway redis-server on a free port, stopped when ``stack`` closes; its URL.
    ``system`` names the benchmark that needs it in the one line said when it is missing."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit(f"the {system} benchmark needs redis-server: "
                         "apt-get install redis-server")
    import redis  # noqa: PLC0415 - optional, with celery[redis] or rq

    folder = Path(tempfile.mkdtemp(prefix="reconciler-bench-redis-"))
    stack.callback(shutil.rmtree, folder, ignore_errors=True)
    port = _free_port()
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no", "--dir", str(folder)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack.callback(_stop, server)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 20
    while True:
        with contextlib.suppress(redis.ConnectionError):
            if client.ping():
                return url
        if time.monotonic() > deadline or server.poll() is not None:
            raise RuntimeError("redis-server did not start")
        time.sleep(0.05)


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


SYSTEMS: dict[str, type[System]] = {
    **OTHER_SYSTEMS,
    "django-tasks": DjangoTasks,
    "celery": CeleryTasks,
}
"""Every system ``--source`` names."""
