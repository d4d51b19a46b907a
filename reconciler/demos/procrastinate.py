"""``reconciler demo --source procrastinate``: a real Procrastinate worker is SIGKILLed
mid-task, and one pass recovers its jobs the Procrastinate way.

On a throwaway PostgreSQL (started here from the machine's PostgreSQL binaries, removed at
the end): Procrastinate's own schema, this project's tables beside it, two jobs deferred
through Procrastinate's own function, one worker that takes both and is killed. Once its
heartbeat is silent past ``session_timeout_seconds``, a pass (configured as a config file
with ``[source] kind = "procrastinate"`` would configure it) resumes the idempotent job
through ``procrastinate_retry_job`` and fails the effectful one through
``procrastinate_finish_job``; a new Procrastinate worker then finishes the resumed job.

Without PostgreSQL binaries, or without Procrastinate (``pip install
'stale-claim-reconciler[peers]'``), it says so in one line and exits 2.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

from reconciler.core.passes import run_pass
from reconciler.demos.support import MissingPrerequisiteError, demo_config, say, wait
from reconciler.errors import ConfigError
from reconciler.root.cli import assemble_cli
from reconciler.root.migrations import migrate

SESSION_TIMEOUT_SECONDS = 2.0
# A report is safe to run again; every other task is effectful (the default).
KINDS = {"reports.*": {"effect": "idempotent"}}


def find_pg_bin() -> Path | None:
    """The directory of ``initdb`` and ``pg_ctl``: ``$RECONCILER_PG_BIN`` (only it, when
    set), ``pg_config --bindir``, the newest ``/usr/lib/postgresql/*/bin``, else
    ``initdb`` on PATH."""
    def usable(path: Path) -> bool:
        return (path / "initdb").exists() and (path / "pg_ctl").exists()

    if os.environ.get("RECONCILER_PG_BIN"):  # authoritative when set
        explicit = Path(os.environ["RECONCILER_PG_BIN"])
        return explicit if usable(explicit) else None
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            candidates.append(Path(subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10,
                check=True).stdout.strip()))
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True,
                         key=lambda p: [int(x) for x in p.parent.name.split(".")
                                        if x.isdigit()])
    if shutil.which("initdb"):
        candidates.append(Path(str(shutil.which("initdb"))).resolve().parent)
    return next((p for p in candidates if usable(p)), None)


@contextlib.contextmanager
def throwaway_postgres(bin_dir: Path) -> Iterator[str]:
    """A PostgreSQL server in a temporary folder, on a Unix socket; its libpq conninfo.

    As root it runs as the ``postgres`` user (PostgreSQL refuses root)."""
    user = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
    base = Path(tempfile.mkdtemp(prefix="reconciler-demo-pg-", dir="/tmp"))
    os.chmod(base, 0o755)  # noqa: S103 - the postgres user must reach its folder
    if user is not None:
        os.chown(base, user.pw_uid, user.pw_gid)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def run(*args: str) -> None:
        extra: dict[str, Any] = {} if user is None else {
            "user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=60,
                              check=False, cwd=base, env={**os.environ, "LC_ALL": "C"},
                              **extra)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
            raise ConfigError(f"{Path(args[0]).name} failed: {' '.join(tail)}")

    data = base / "data"
    try:
        run(str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
            "--no-locale", "--encoding=UTF8", "--no-sync")
        run(str(bin_dir / "pg_ctl"), "start", "-w", "-t", "30", "-D", str(data),
            "-l", str(base / "log"), "-o",
            f"-p {port} -k {base} -c listen_addresses='' -c fsync=off")
        yield f"host={base} port={port} user=postgres dbname=postgres"
    finally:
        with contextlib.suppress(Exception):
            run(str(bin_dir / "pg_ctl"), "stop", "-m", "immediate", "-D", str(data))
        shutil.rmtree(base, ignore_errors=True)


def run_procrastinate_demo() -> int:
    """The demo; 0 when the killed worker's jobs were recovered as the table says."""
    try:
        from procrastinate.schema import SchemaManager  # noqa: PLC0415 - optional (peers)
    except ImportError:
        raise MissingPrerequisiteError(
            "the Procrastinate demo needs Procrastinate: pip install "
            "'stale-claim-reconciler[peers]'") from None
    bin_dir = find_pg_bin()
    if bin_dir is None:
        raise MissingPrerequisiteError(
            "the Procrastinate demo needs PostgreSQL's server binaries (initdb, pg_ctl): "
            "apt-get install postgresql, or set RECONCILER_PG_BIN")
    say(f"starting a throwaway PostgreSQL from {bin_dir} ...")
    with throwaway_postgres(bin_dir) as conninfo:
        parts = dict(p.split("=", 1) for p in conninfo.split())
        url = (f"postgresql+psycopg://postgres@/postgres?host={parts['host']}"
               f"&port={parts['port']}")
        # The demo's own statements on Procrastinate's tables (defer, watch); the pass gets
        # its parts from the composition root like `reconciler pass --config` does.
        engine = sa.create_engine(url)
        try:
            return _demo(engine, url, conninfo, SchemaManager.get_schema())
        finally:
            engine.dispose()


def _demo(engine: sa.Engine, url: str, conninfo: str, schema_sql: str) -> int:
    config = demo_config(source={"kind": "procrastinate"}, kinds=KINDS, database_url=url,
                         session_heartbeat_seconds=0.5,
                         session_timeout_seconds=SESSION_TIMEOUT_SECONDS,
                         stale_after_seconds=1.0)
    # Procrastinate's schema, as its own ``procrastinate schema --apply`` applies it (one
    # script, through psycopg directly: its text is not a parameterised statement).
    with psycopg.connect(conninfo, autocommit=True) as raw:
        raw.execute(schema_sql.encode())
    migrate(config)
    say("Procrastinate's schema and the reconciler's tables are in place")
    with engine.begin() as conn:
        jobs = {task: int(conn.execute(sa.text(
            "SELECT unnest(procrastinate_defer_jobs_v1(ARRAY[ROW('default', :task, 0, NULL, "
            "NULL, '{}'::jsonb, NULL)::procrastinate_job_to_defer_v1]))"), {"task": task}
            ).scalar_one()) for task in ("reports.render", "payments.charge")}
    say(f"deferred job {jobs['reports.render']} (reports.render, configured idempotent) and "
        f"job {jobs['payments.charge']} (payments.charge, effectful by default)")

    def statuses() -> dict[str, str]:
        with engine.connect() as conn:
            return {task: str(conn.execute(sa.text(
                "SELECT status::text FROM procrastinate_jobs WHERE id = :id"),
                {"id": job}).scalar_one()) for task, job in jobs.items()}

    env = {**os.environ, "DEMO_PG_CONNINFO": conninfo}
    argv = [sys.executable, "-m", "reconciler.demos.procrastinate_app"]
    first = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    second: subprocess.Popen[bytes] | None = None
    try:
        wait(lambda: set(statuses().values()) == {"doing"}, "the worker to take both jobs")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        say(f"worker {first.pid} SIGKILLed mid-task: both jobs stay 'doing' in Procrastinate")
        started = time.monotonic()
        report = None
        with assemble_cli(config) as cli:
            while time.monotonic() - started < 30:
                report = run_pass(cli.passes, cli.pass_config("demo"))
                if report.decisions:
                    break
                time.sleep(0.3)
        if report is None or not report.decisions:
            say("no pass decided anything within 30 s")
            return 1
        say(f"pass {report.pass_id}, {time.monotonic() - started:.1f} s after the kill "
            f"(heartbeat silent past {SESSION_TIMEOUT_SECONDS:g} s):")
        for d in report.decisions:
            say(f"  job {d.job_id}: {d.disposition.value} ({d.reason.value})")
        second = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        wait(lambda: statuses()["reports.render"] == "succeeded",
             "a new Procrastinate worker to finish the resumed job")
        final = statuses()
        say(f"a new Procrastinate worker finished job {jobs['reports.render']}: "
            f"{final['reports.render']}; job {jobs['payments.charge']} stays "
            f"{final['payments.charge']} (an effectful run of unknown progress is never "
            "repeated)")
        with engine.connect() as conn:
            audited = conn.execute(sa.text(
                "SELECT count(*) FROM reconciliation_decisions WHERE job_source = "
                "'procrastinate'")).scalar_one()
        say(f"audit: {audited} decisions recorded under job_source 'procrastinate'")
        ok = final == {"reports.render": "succeeded", "payments.charge": "failed"}
        return 0 if ok else 1
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(timeout=10)
