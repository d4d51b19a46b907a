"""Issue 14: broken and hostile environments, tried as a new user and an attacker would.

A database that stops answering (a listener that never replies, a PostgreSQL frozen with
SIGSTOP), passwords in every URL form, failing passes that must say why, tracebacks where
one line is promised, settings that overflow later, job kinds that drive the terminal,
engines that disagree, and the smaller traps. Each test looks only at what a user sees:
output, exit codes, /metrics, /readyz, log lines and the database.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import psycopg
import pytest
import sqlalchemy as sa
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine, make_url

from models import ReconciliationPass
from reconciler.config.settings import Settings
from reconciler.storage.engines import create_engine, is_postgresql
from reconciler.storage.schema import upgrade
from reconciler.worker import JobClient, Step
from tests.cli_runner import run_main
from tests.conftest import REPO_ROOT, PostgresForTests, run_cli
from tests.helpers import fresh_database, sidecar_service
from tests.integration.test_cli import assert_one_line_error
from tests.integration.test_service import (
    Launcher,
    ReconcilerProcess,
    _start_server,
    _stop_server,
    child_env,
    fetch,
    http_get,
    launcher,  # noqa: F401 - the fixture, used by name
    wait_until,
    write_lock,
)
from tests.pg_server import ThrowawayPostgres

passes: sa.Table = cast(sa.Table, ReconciliationPass.__table__)

STEPS = [Step("fetch", "idempotent"), Step("publish", "effectful")]
# A PostgreSQL URL nothing listens on: a command that gets as far as the database ends 3.
NO_DATABASE = "postgresql+psycopg://rec@127.0.0.1:1/db"
SECRET = "Hunter2Secret"  # noqa: S105 - the password the tests make sure never shows


def one_line(proc: subprocess.CompletedProcess[str], exit_code: int, *expected: str) -> str:
    """The documented exit code, nothing on stdout, one line on stderr, no traceback."""
    assert proc.returncode == exit_code, (proc.returncode, proc.stderr)
    return assert_one_line_error(proc, *expected)


def answering(get: Any, status: int) -> Any:
    """A wait_until check: the (status, body) of ``get()`` once it has ``status``."""
    def check() -> tuple[int, str] | None:
        answer: tuple[int, str] = get()
        return answer if answer[0] == status else None
    return check


def migrated(url: str) -> str:
    engine = create_engine(url)
    try:
        upgrade(engine)
    finally:
        engine.dispose()
    return url


# --------------------------------------------------------------------------------------------
# 1. A database that stops answering
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def silent_listener() -> Iterator[int]:
    """A TCP port that accepts connections and never says a word; its port."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                accepted.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        for conn in accepted:
            conn.close()
        server.close()


def postgres_processes(server: ThrowawayPostgres) -> list[int]:
    """The postmaster and every process it started (backends, checkpointer, ...)."""
    postmaster = int((server.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
    found = [postmaster]
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rpartition(")")[2].split()[1]) == postmaster:
                found.append(int(stat.parent.name))
    return found


@contextlib.contextmanager
def frozen(server: ThrowawayPostgres) -> Iterator[None]:
    """The whole PostgreSQL server stopped with SIGSTOP (connections stay open, nothing
    answers, not even the kernel's refusal), thawed with SIGCONT at exit."""
    pids = postgres_processes(server)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def test_a_listener_that_never_answers_ends_jobs_list_within_the_connect_timeout() -> None:
    """`jobs list` against a port that accepts TCP and never answers gives up after
    `connect_timeout_seconds` with one line and exit 3 (it used to hang forever)."""
    with silent_listener() as port:
        url = f"postgresql+psycopg://u:{SECRET}@127.0.0.1:{port}/db"
        started = time.monotonic()
        proc = run_cli(url, "jobs", "list", timeout=60, connect_timeout_seconds=2)
        took = time.monotonic() - started

    line = one_line(proc, 3, "cannot reach the database", "timeout")
    assert SECRET not in line
    assert took < 20, took


@pytest.fixture
def frozen_ready_service(own_postgres: ThrowawayPostgres, launcher: Launcher  # noqa: F811
                         ) -> tuple[ThrowawayPostgres, ReconcilerProcess]:
    """A leading `reconciler run` on a PostgreSQL of the test's own, with short timeouts."""
    own_postgres.create_database("frozen")
    url = migrated(own_postgres.url("frozen"))
    service = launcher.start(
        url, interval_seconds=0.3, leader_lease_seconds=60, statement_timeout_seconds=1,
        pass_statement_timeout_seconds=1, connect_timeout_seconds=2,
        shutdown_timeout_seconds=3)
    wait_until(service.is_leader, "leadership")
    return own_postgres, service


def test_a_frozen_postgresql_fails_passes_drops_readiness_and_leadership(
    frozen_ready_service: tuple[ThrowawayPostgres, ReconcilerProcess],
) -> None:
    """PostgreSQL stopped with SIGSTOP under a running service: every /readyz answers
    within a second and says 503, `reconciler_is_leader` drops to 0, passes fail and are
    counted (with a code), and SIGTERM still ends the process within its shutdown timeout
    (a pass stuck in the driver does not keep it alive)."""
    server, service = frozen_ready_service
    with frozen(server):
        froze_at = time.monotonic()

        def timed_readyz() -> tuple[int, str]:
            asked = time.monotonic()
            answer = http_get(service.port, "/readyz", timeout=5)
            assert time.monotonic() - asked < 1.0, "a /readyz took a second or more"
            return answer

        _, why = wait_until(answering(timed_readyz, 503), "/readyz 503", timeout=5)
        not_ready_after = time.monotonic() - froze_at
        assert "did not answer" in why or "cannot reach the database" in why, why
        for _ in range(5):
            assert timed_readyz()[0] == 503
        wait_until(lambda: service.metric("reconciler_is_leader") == 0.0, "is_leader 0",
                   timeout=10)
        wait_until(lambda: (service.metric("reconciler_passes_total", outcome="error") or 0)
                   >= 1, "a failed pass to be counted", timeout=30)
        by_code = {code: service.metric("reconciler_pass_errors_total", code=code) or 0
                   for code in ("no_answer", "unreachable")}
        assert sum(by_code.values()) >= 1, by_code
        failed = [line for line in service.stderr_lines() if "event=pass_failed" in line]
        assert failed
        assert any(" code=no_answer " in line or " code=unreachable " in line
                   for line in failed), failed

        def stuck_again() -> bool:
            """A pass is in flight, waiting on the frozen database: the scheduler skipped a
            tick (an overrun) after the last failure. A SIGTERM that lands between one failed
            pass and the next finds nothing stuck and exits 0, which is not under test here."""
            lines = service.stderr_lines()
            last = max(i for i, line in enumerate(lines) if "event=pass_failed" in line)
            return any("event=pass_overrun" in line for line in lines[last + 1:])

        wait_until(stuck_again, "a pass stuck again after the last failure", timeout=30)
        sent = time.monotonic()
        service.send(signal.SIGTERM)
        code = service.wait_exit(timeout=15)
        took = time.monotonic() - sent
    print(f"\nfrozen database: /readyz 503 after {not_ready_after:.2f}s, "
          f"SIGTERM to exit {took:.2f}s (shutdown_timeout_seconds=3)")
    assert code == 1, service.stderr()[-2000:]
    assert took < 3 + 2, took
    assert "event=shutdown_timeout" in service.stderr()
    assert "Traceback" not in service.stderr()


def test_a_worker_heartbeat_on_a_frozen_postgresql_fails_instead_of_hanging(
    own_postgres: ThrowawayPostgres,
) -> None:
    """A claim's heartbeat against a frozen PostgreSQL raises after the statement timeout
    plus a margin instead of holding the lease thread until the database wakes."""
    own_postgres.create_database("worker")
    url = migrated(own_postgres.url("worker"))
    settings = Settings(database_url=url, statement_timeout_seconds=1,
                        connect_timeout_seconds=2)
    with JobClient(url, settings=settings) as client:
        client.enqueue("report", steps=STEPS)
        claim = client.claim(worker="w1", lease_seconds=30)
        assert claim is not None
        outcome: list[BaseException | None] = []

        def beat() -> None:
            try:
                claim.heartbeat()
                outcome.append(None)
            except BaseException as exc:  # the outcome under test
                outcome.append(exc)

        with frozen(own_postgres):
            started = time.monotonic()
            thread = threading.Thread(target=beat, daemon=True)
            thread.start()
            thread.join(20)
            took = time.monotonic() - started
            assert not thread.is_alive(), "the heartbeat still hangs after 20 s"
        (error,) = outcome
        assert isinstance(error, sa.exc.OperationalError), error
        # The pool's ping gets no answer (3 s), then a new connection none (2 s).
        assert "did not answer within 3s" in str(error) or "connection timeout" in str(error)
        assert took < 10, took


def test_a_pass_stuck_behind_a_lock_is_an_error_pass_and_the_next_tick_goes_on(
    db_url: str, engine: Engine, launcher: Launcher,  # noqa: F811
) -> None:
    """Issue 12: a pass that waits on a lock longer than its lock timeout (PostgreSQL
    `lock_timeout`, SQLite's busy timeout) fails with code lock_timeout, is counted and
    logged (and recorded as an error pass on PostgreSQL), and passes resume afterwards."""
    service = launcher.start(db_url, interval_seconds=0.3, leader_lease_seconds=30,
                             pass_lock_timeout_seconds=0.5, sqlite_busy_timeout_seconds=0.5)
    with write_lock(engine):
        wait_until(lambda: (service.metric("reconciler_pass_errors_total",
                                           code="lock_timeout") or 0) >= 1,
                   "a pass to fail with lock_timeout")
        status, why = service.get("/readyz")
        assert status == 503
        assert "(lock_timeout)" in why, why
    ok_before = service.metric("reconciler_passes_total", outcome="ok") or 0
    wait_until(lambda: (service.metric("reconciler_passes_total", outcome="ok") or 0)
               > ok_before, "the next pass to succeed")
    Launcher.wait_ready(service)
    failed = [line for line in service.stderr_lines() if "event=pass_failed" in line]
    assert any(" code=lock_timeout " in line for line in failed), failed
    if is_postgresql(engine):
        error = "error"
        recorded = fetch(engine, sa.select(passes.c.pass_outcome, passes.c.error_code)
                         .where(passes.c.pass_outcome == error))
        assert (error, "lock_timeout") in [tuple(r) for r in recorded], recorded
    assert service.alive()


# --------------------------------------------------------------------------------------------
# 2. The database password never shows
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("url", "exit_code"), [
    (f"postgresql+psycopg://rec@127.0.0.1:1/db?password={SECRET}", 3),
    (f"postgresql+psycopg://rec:{SECRET}@127.0.0.1:1/db", 3),
    (f"postgresql+psycopg:/rec:{SECRET}@h/db", 2),
    (f"postgresql+psycopg://rec:pa@ss#{SECRET}@127.0.0.1:1/db", 2),
    (f"postgresql+psycopg://rec:{SECRET}@h:notaport/db", 2),
    (f"postgresql+psycopg://rec@/db?host=/nonexistent&password={SECRET}", 3),
], ids=["query-password", "userinfo", "malformed", "unescaped-at", "bad-port", "libpq-host"])
def test_no_url_form_shows_the_password_in_an_error(url: str, exit_code: int) -> None:
    """Every URL form a password can hide in gives one line, the documented exit code,
    and no password."""
    for args in (("jobs", "list"), ("db", "upgrade")):
        proc = run_cli(url, *args, timeout=60, connect_timeout_seconds=2)
        line = one_line(proc, exit_code)
        assert SECRET not in line, line
        assert "ss#" not in line, line


def test_db_upgrade_success_line_hides_a_query_password(postgres: PostgresForTests | None
                                                        ) -> None:
    """`db upgrade` with `?password=` prints `password=***` in its success line."""
    if postgres is None:
        pytest.skip("PostgreSQL not available")
    name = postgres.new_database(migrated=False)
    try:
        url = f"{postgres.url(name)}?password={SECRET}"
        proc = run_cli(url, "db", "upgrade")
        assert proc.returncode == 0, proc.stderr
        assert SECRET not in proc.stdout + proc.stderr
        assert "password=***" in proc.stdout
    finally:
        postgres.drop(name)


def test_readyz_and_logs_hide_the_password_while_the_database_is_down(
    own_postgres: ThrowawayPostgres, launcher: Launcher  # noqa: F811
) -> None:
    """With the database down, /readyz (bound to every interface in the Kubernetes example)
    and the log lines name the database without its `?password=`."""
    own_postgres.create_database("secret")
    url = migrated(own_postgres.url("secret")) + f"?password={SECRET}"
    service = launcher.start(url, interval_seconds=0.3)
    _stop_server(own_postgres)
    try:
        def naming_the_database() -> str | None:
            status, why = service.get("/readyz")
            return why if status == 503 and "cannot reach the database at" in why else None

        why = wait_until(naming_the_database, "/readyz naming the database")
        wait_until(lambda: "event=pass_failed" in service.stderr(), "a failed pass")
    finally:
        _start_server(own_postgres)
    assert "?password=***" in why, why
    assert SECRET not in why
    assert SECRET not in service.stderr()


def test_the_database_url_can_come_from_a_file(db_url: str, tmp_path: Path) -> None:
    """RECONCILER_DATABASE_URL_FILE (a Kubernetes secret, a systemd credential) gives the
    URL, so it need not sit in `ps` or the environment."""
    secret = tmp_path / "database-url"
    secret.write_text(db_url + "\n")
    proc = run_main(["jobs", "list", "--json"], env=child_env(database_url_file=secret))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_password_given_as_a_flag_draws_a_warning(tmp_path: Path) -> None:
    """`--database-url` with a password works but warns that `ps` shows it to everyone,
    naming the file setting to use instead; the password itself is never printed."""
    url = f"postgresql+psycopg://rec:{SECRET}@127.0.0.1:1/db"
    proc = run_cli(f"sqlite:///{tmp_path / 'unused.db'}", "jobs", "list", "--database-url",
                   url)
    assert proc.returncode == 3, proc.stderr
    warning, error = proc.stderr.strip().splitlines()
    assert error.startswith("reconciler: error: cannot reach the database")
    assert "event=password_on_command_line" in warning
    assert "RECONCILER_DATABASE_URL_FILE" in warning
    assert SECRET not in proc.stderr


# --------------------------------------------------------------------------------------------
# 3. A failing pass says why
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def unwritable_url(db_url: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """The same database, as the service would see it through a read-only SQLite handle or
    a PostgreSQL role or MySQL user that may only SELECT."""
    if db_url.startswith("sqlite"):
        yield f"sqlite:///file:{db_url.removeprefix('sqlite:///')}?mode=ro&uri=true"
        return
    role = f"reader_{uuid.uuid4().hex[:8]}"
    dbname = make_url(db_url).database
    if db_url.startswith("mysql"):
        server = request.getfixturevalue("mariadb").server
        server.admin(f"CREATE USER '{role}'@'%'")
        server.admin(f"GRANT SELECT ON `{dbname}`.* TO '{role}'@'%'")
        try:
            yield db_url.replace("root@", f"{role}@", 1)
        finally:
            server.admin(f"DROP USER '{role}'@'%'")
        return
    postgres: PostgresForTests | None = request.getfixturevalue("postgres")
    assert postgres is not None
    with psycopg.connect(f"{postgres.dsn} dbname={dbname}", autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
    try:
        yield db_url.replace("postgres@", f"{role}@", 1)
    finally:
        with psycopg.connect(f"{postgres.dsn} dbname={dbname}", autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


def test_a_pass_that_cannot_write_says_why_in_its_log_readyz_and_metrics(
    db_url: str, request: pytest.FixtureRequest, launcher: Launcher  # noqa: F811
) -> None:
    """On a read-only SQLite handle or a SELECT-only PostgreSQL role or MySQL user, `reconciler run`
    logs `code=read_only` / `code=permission_denied` with the driver's reason, /readyz
    says the same instead of "no pass has finished yet", and
    `reconciler_pass_errors_total{code}` counts it; `reconciler pass` ends in one line."""
    expected = "read_only" if db_url.startswith("sqlite") else "permission_denied"
    with unwritable_url(db_url, request) as url:
        service = launcher.start(url, interval_seconds=0.3, wait_ready=False)
        wait_until(lambda: (service.metric("reconciler_pass_errors_total", code=expected)
                            or 0) >= 1, f"a pass failing with {expected}")
        status, why = service.get("/readyz")
        by_hand = run_cli(url, "pass")
    assert status == 503
    assert f"the last pass failed ({expected})" in why, why
    line = next(line for line in service.stderr_lines() if "event=pass_failed" in line)
    assert f" code={expected} " in line, line
    reason = {"sqlite": "readonly", "postgresql": "permission denied", "mysql": "command denied"}
    assert reason[sa.engine.make_url(db_url).get_backend_name()] in line, line
    one_line(by_hand, 3, f"({expected})")


def test_readiness_never_reads_the_migration_scripts_of_a_database_at_head(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 10: /readyz does not re-read the migration scripts on every probe; a database
    at head is checked against the recorded head revision, with no script read at all."""
    reads: list[int] = []
    original = ScriptDirectory.from_config
    probing = threading.get_ident()  # not the fixture's thread migrating the next database

    def counting(*args: Any, **kwargs: Any) -> ScriptDirectory:
        if threading.get_ident() == probing:
            reads.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(ScriptDirectory, "from_config", staticmethod(counting))
    service = sidecar_service(Settings(database_url=db_url))
    service.probe.fresh_seconds = 0.05  # every call below probes the database again
    try:
        for _ in range(4):
            service.readiness()
            time.sleep(0.1)
        ready, why = service.readiness()
    finally:
        service.close()
    assert (ready, why) == (False, "no pass has finished yet")
    assert reads == []


# --------------------------------------------------------------------------------------------
# 4. One line where one line is promised
# --------------------------------------------------------------------------------------------


def test_a_reader_that_stops_reading_ends_the_listing_quietly(db_url: str, client: JobClient
                                                              ) -> None:
    """`reconciler jobs list --json | head -1`: the reader goes away after a line; the
    command ends 0 with nothing on stderr (it used to print a BrokenPipeError traceback)."""
    for n in range(300):  # well over a pipe's 64 KiB of JSON: the writer must block
        client.enqueue(f"kind-{n}", steps=STEPS)
    env = child_env(database_url=db_url)
    proc = subprocess.Popen(
        [sys.executable, "-m", "reconciler.cli", "jobs", "list", "--json", "--limit", "300"],
        cwd=REPO_ROOT,
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stderr is not None
    assert proc.stdout.readline().strip() == b"["
    proc.stdout.close()
    code = proc.wait(timeout=60)
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    assert (code, stderr) == (0, "")


@pytest.mark.parametrize("args", [
    ("jobs", "show", "9223372036854775808"),
    ("jobs", "hold", "99999999999999999999"),
    ("jobs", "show", "0"),
    ("jobs", "list", "--limit", "9223372036854775808"),
])
def test_a_number_no_bigint_can_hold_is_a_usage_error(args: tuple[str, ...]) -> None:
    """A job id or limit beyond what the database can hold: one line, exit 2 (it was an
    OverflowError on SQLite and "database error", exit 3, on PostgreSQL). It is refused
    before any database is opened, whichever the engine: the URL here reaches none, so a
    number that got through would end in exit 3 instead."""
    proc = run_cli(NO_DATABASE, *args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_explain_of_an_id_no_bigint_can_hold_finds_no_job(db_url: str) -> None:
    """`jobs explain` takes an id as its source spells it (a UUID for pg-boss), so an id
    beyond a BIGINT is not a usage error there: it is no job, one line, exit 5, on both
    engines (never an OverflowError or a database error)."""
    one_line(run_cli(db_url, "jobs", "explain", "9223372036854775808"), 5,
             "no job with id 9223372036854775808")


def test_a_database_from_a_newer_release_is_refused_alike_by_run_and_upgrade(
    db_url: str, engine: Engine
) -> None:
    """A database stamped by a newer release: `db upgrade` and `run` both end in one line
    with exit 4 saying a newer release migrated it (run no longer sends the user to
    `db upgrade`, which then failed with a traceback)."""
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = 'ffffffffffff'"))
    upgrade_proc = run_cli(db_url, "db", "upgrade")
    run_proc = run_cli(db_url, "run", timeout=60, process=False, metrics_port=0)
    for proc in (upgrade_proc, run_proc):
        line = one_line(proc, 4, "ffffffffffff", "newer release")
        assert "run `reconciler db upgrade`" not in line


# --------------------------------------------------------------------------------------------
# 5. Settings that would overflow later
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("command", "flag", "value"), [
    ("run", "--interval-seconds", "inf"),
    ("run", "--leader-lease-seconds", "1e300"),
    ("run", "--wedged-after-seconds", "inf"),
    ("run", "--stale-after-seconds", "nan"),
    ("pass", "--wedged-after-seconds", "inf"),
])
def test_a_setting_that_would_overflow_is_refused_before_anything_starts(
    command: str, flag: str, value: str
) -> None:
    """`run` (or `pass`) with an infinite or astronomical duration ends in one line naming
    the setting with exit 2 (`run` crashed with OverflowError; `pass` on PostgreSQL ended
    "interval out of range" with exit 3). It is refused before any database is opened (the
    URL here reaches none: a value that got through would end in exit 3)."""
    setting = flag.removeprefix("--").replace("-", "_")
    one_line(run_cli(NO_DATABASE, command, flag, value, process=False, metrics_port=0), 2,
             setting)


def test_a_misspelled_variable_is_named_with_the_closest_setting(tmp_path: Path) -> None:
    """RECONCILER_BATCHSIZE=10 is not silently ignored: a warning names it and the setting
    it was probably meant to be; the command still works (settings are read before any
    engine, so one engine shows it)."""
    proc = run_cli(fresh_database(tmp_path), "jobs", "list", "--json", batchsize=10)
    assert proc.returncode == 0, proc.stderr
    (warning,) = proc.stderr.strip().splitlines()
    assert "RECONCILER_BATCHSIZE" in warning
    assert "did you mean RECONCILER_BATCH_SIZE?" in warning


# --------------------------------------------------------------------------------------------
# 6. Stored text cannot drive the operator's terminal
# --------------------------------------------------------------------------------------------


def test_control_characters_are_escaped_in_human_output_and_kept_in_json(
    db_url: str, client: JobClient
) -> None:
    """A kind holding a newline, an escape sequence and a bell is shown escaped by `jobs
    list` and `jobs show` (no raw control character reaches the terminal); `--json` keeps
    the stored value exactly."""
    kind = "evil\n\x1b[31mred\x07\u202e"
    job_id = client.enqueue(kind, steps=[Step("fetch\x1b[2J", "idempotent")])

    shown = ""
    for args in (("jobs", "list"), ("jobs", "show", str(job_id))):
        proc = run_cli(db_url, *args)
        assert proc.returncode == 0, proc.stderr
        assert not any(ord(ch) < 32 and ch != "\n" for ch in proc.stdout), repr(proc.stdout)
        assert "\x7f" not in proc.stdout
        assert "\u202e" not in proc.stdout
        assert "\\x1b[31m" in proc.stdout
        shown = proc.stdout
    assert shown.splitlines()[0].startswith(f"job {job_id} (evil\\x0a\\x1b[31mred\\x07\\u202e)")
    assert "fetch\\x1b[2J" in shown
    as_json = run_cli(db_url, "jobs", "show", str(job_id), "--json")
    import json  # noqa: PLC0415 - only here

    assert json.loads(as_json.stdout)["job_kind"] == kind


# --------------------------------------------------------------------------------------------
# 7. Both engines accept and refuse the same values
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("call", "limit"), [
    ({"job_kind": "k" * 101}, "limit is 100"),
    ({"job_kind": "k\x00"}, "NUL"),
    ({"idempotency_key": "key\x00"}, "NUL"),
    ({"idempotency_key": "x" * 201}, "limit is 200"),
    ({"singleton_key": "s" * 201}, "limit is 200"),
    ({"steps": [Step("s" * 201, "pure")]}, "limit is 200"),
    ({"steps": [Step("s\x00", "pure")]}, "NUL"),
    ({"payload": {"x": float("nan")}}, "NaN"),
    ({"payload": [float("inf")]}, "Infinity"),
    ({"payload": {"k\x00": 1}}, "NUL"),
    ({"payload": {"x": object()}}, "JSON"),
    ({"max_attempts": 10**12}, "2147483647"),
    ({"max_attempts": 0}, "from 1"),
    ({"max_attempts": 2.5}, "whole number"),
], ids=lambda v: str(v)[:30])
def test_values_postgresql_cannot_store_are_refused_alike_on_both_engines(
    client: JobClient, engine: Engine, call: dict[str, Any], limit: str
) -> None:
    """What PostgreSQL rejects with a raw DataError and SQLite stored silently is refused on
    both before the database is touched: a ValueError naming the limit, nothing written."""
    arguments: dict[str, Any] = {"job_kind": "report", "steps": STEPS} | call
    kind = arguments.pop("job_kind")
    with pytest.raises(ValueError, match=limit.replace("(", r"\(")):
        client.enqueue(kind, **arguments)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM job_runs")).scalar_one() == 0


def test_the_limits_themselves_are_accepted_on_both_engines(client: JobClient) -> None:
    """A kind of exactly 100 characters, keys of 200, 2**31-1 attempts: stored alike."""
    job_id = client.enqueue("k" * 100, steps=[Step("s" * 200, "pure")],
                            idempotency_key="i" * 200, singleton_key="s" * 200,
                            max_attempts=2**31 - 1, payload={"x": "\u00e9"})
    claim = client.claim(worker="w" * 200, kinds=["k" * 100])
    assert claim is not None
    assert claim.job_id == job_id
    with pytest.raises(ValueError, match="limit is 200"):
        client.claim(worker="w" * 201)
    with pytest.raises(ValueError, match="lease_seconds"):
        client.claim(worker="w", lease_seconds=float("inf"))


# --------------------------------------------------------------------------------------------
# 8. Smaller traps
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [
    ("jobs", "list"), ("jobs", "show", "1"), ("decisions",), ("pass", "--dry-run"),
    ("pass",), ("jobs", "hold", "1"),
])
def test_commands_never_create_a_missing_sqlite_database(tmp_path: Path,
                                                         args: tuple[str, ...]) -> None:
    """With no database where the URL points (the default `./reconciler.db` in a fresh
    folder), a command says so in one line, exit 4, and leaves no empty file behind."""
    proc = run_main(args, env=child_env(), cwd=tmp_path)
    one_line(proc, 4, "no database at", "reconciler db upgrade")
    assert list(tmp_path.iterdir()) == []


def test_retry_of_a_held_job_says_it_stays_held(db_url: str, client: JobClient) -> None:
    """`jobs retry` on a failed job that is also held is applied but says, in the same
    line, that the hold keeps it from running and how to release it."""
    held = client.enqueue("report", steps=STEPS, max_attempts=1)
    plain = client.enqueue("report", steps=STEPS, max_attempts=1)
    for _ in range(2):
        claim = client.claim(worker="w")
        assert claim is not None
        if claim.job_id == held:
            assert run_cli(db_url, "jobs", "hold", str(held)).returncode == 0
        claim.fail("boom", retryable=False)

    retried = run_cli(db_url, "jobs", "retry", str(held), "--note", "checked")
    assert retried.returncode == 0, retried.stderr
    assert "status queued" in retried.stdout
    assert f"still held and will not run until `reconciler jobs unhold {held}`" in \
        retried.stdout
    not_held = run_cli(db_url, "jobs", "retry", str(plain), "--note", "checked")
    assert not_held.returncode == 0, not_held.stderr
    assert "still held" not in not_held.stdout


def process_threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads: line")


def test_idle_connections_to_metrics_do_not_each_take_a_thread(
    db_url: str, launcher: Launcher  # noqa: F811
) -> None:
    """600 connections that never send a request, opened at once (more than the server
    parks idle: it makes room by closing the one idle longest, see
    tests/unit/test_http_server.py) leave the service's thread count where it was (a
    bounded server, sockets that time out), and /metrics asked right after them still
    answers at once."""
    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc to count threads")
    service = launcher.start(db_url)
    before = process_threads(service.popen.pid)
    idle = []
    try:
        for _ in range(600):
            conn = socket.create_connection(("127.0.0.1", service.port))
            idle.append(conn)
        asked = time.monotonic()
        status, _ = service.get("/metrics")
        answered_in = time.monotonic() - asked
        during = process_threads(service.popen.pid)
    finally:
        for conn in idle:
            conn.close()
    print(f"\nthreads: {before} before, {during} with 600 idle connections; /metrics "
          f"answered in {answered_in:.2f}s")
    assert status == 200
    assert answered_in < 2.0
    assert during <= before + 8, (before, during)


def test_a_database_down_at_start_is_waited_for_and_never_read_as_an_old_schema(
    own_postgres: ThrowawayPostgres, launcher: Launcher  # noqa: F811
) -> None:
    """A database that drops the service's first connections at start (a restart in
    progress) and is back moments later: the service retries and starts; the transient
    error is neither an exit nor taken for "schema out of date"."""
    own_postgres.create_database("late")
    url = migrated(own_postgres.url("late"))
    _stop_server(own_postgres)
    # In the server's place, a listener that hangs up on whoever connects: the service's
    # first attempts fail, and we know when it has made two of them.
    refuser = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    refuser.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    refuser.bind(("127.0.0.1", own_postgres.port))
    refuser.listen(8)
    refuser.settimeout(60)
    try:
        service = launcher.spawn(url)
        for _ in range(2):
            refuser.accept()[0].close()
    finally:
        refuser.close()
        _start_server(own_postgres)
    Launcher.wait_listening(service)
    Launcher.wait_ready(service)
    logged = service.stderr()
    assert "schema" not in logged
    # Each retry said so in one line (the code, where), then that the database answered.
    waits = [line for line in logged.splitlines() if "event=database_wait" in line]
    assert len(waits) >= 2, logged
    assert all(f"code=unreachable host=127.0.0.1:{own_postgres.port} " in line
               for line in waits), waits
    assert "event=database_reached" in logged


def test_a_database_that_stays_down_at_start_is_exit_3_not_4(tmp_path: Path) -> None:
    """A SQLite database locked by someone else for longer than the start-up retries
    (`start_retry_seconds`, shortened here): exit 3 (unavailable), never exit 4 (schema
    out of date)."""
    url = migrated(f"sqlite:///{tmp_path / 'jobs.db'}")
    import sqlite3  # noqa: PLC0415 - only here

    holder = sqlite3.connect(tmp_path / "jobs.db", isolation_level=None)
    try:
        holder.execute("PRAGMA locking_mode = EXCLUSIVE")
        holder.execute("BEGIN EXCLUSIVE")
        holder.execute("CREATE TABLE held (x)")
        proc = run_cli(url, "run", process=False, metrics_port=0, sqlite_busy_timeout_seconds=0.2,
                       start_retry_seconds=1)
    finally:
        holder.close()
    assert proc.returncode == 3, proc.stderr
    *waits, last = proc.stderr.strip().splitlines()
    assert "database is locked" in last
    # Each retry said what it waited for, in one line: the code and where, nothing more.
    assert waits, proc.stderr
    assert all("event=database_wait code=lock_timeout" in line
               and f"host={tmp_path / 'jobs.db'}" in line for line in waits), waits


@pytest.mark.parametrize("refusal", ["database", "role"])
def test_an_error_waiting_cannot_clear_is_exit_3_at_once(
        postgres: PostgresForTests | None, refusal: str) -> None:
    """No such database, no such role: `reconciler run` exits 3 on its first attempt with
    one line naming it, however long `start_retry_seconds` would let it retry (no
    `database_wait` line: it did not wait)."""
    if postgres is None:
        pytest.skip("PostgreSQL is not among the test engines")
    url = postgres.url("no_such_db_here")
    if refusal == "role":
        url = postgres.url("postgres").replace("postgres@", "no_such_role@", 1)
    proc = run_cli(url, "run", process=False, metrics_port=0, start_retry_seconds=3600)
    line = one_line(proc, 3, "cannot reach the database")
    assert f'{refusal} "no_such_' in line, line
    assert "does not exist" in line, line
    assert "database_wait" not in proc.stderr


def test_a_password_refused_is_exit_3_at_once_and_never_printed(
        own_postgres: ThrowawayPostgres) -> None:
    """A role whose password is wrong: exit 3 at once (waiting cannot clear it), one line
    saying authentication failed, the password in it nowhere."""
    own_postgres.add_password_role("app", "right-one")
    url = own_postgres.url("postgres").replace("postgres@", "app:wrong-one@", 1)
    proc = run_cli(url, "run", process=False, metrics_port=0, start_retry_seconds=3600)
    line = one_line(proc, 3, "password authentication failed")
    assert "wrong-one" not in proc.stderr + proc.stdout
    assert "database_wait" not in proc.stderr, line
