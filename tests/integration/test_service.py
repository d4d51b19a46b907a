"""``reconciler run`` as operators run it: real processes, real signals, real databases.

Each reconciler here is a separate ``python -m reconciler.cli run`` process configured
through ``RECONCILER_*`` variables (a ``run`` that must refuse to start is called in this
process, tests/cli_runner.py). It binds ``metrics_port=0`` and the test reads the port
it got from its ``event=http_listening`` log line, so there is no free-port race. Tests
look only at what an operator can see: /metrics, /healthz, /readyz, stderr, exit codes and
the database.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import Connection, Engine

from models import JobRun, ReconcilerLease, ReconciliationDecision, ReconciliationPass
from reconciler.config.settings import Settings
from reconciler.core.vocabulary import PassOutcome
from reconciler.storage.clock import db_now
from reconciler.storage.engines import create_engine, is_postgresql, read_only
from reconciler.storage.schema import upgrade
from reconciler.worker import JobClient, Step
from tests.conftest import REPO_ROOT, PostgresForTests, run_cli
from tests.helpers import sidecar_service
from tests.pg_server import INSTALL_HINT, ThrowawayPostgres

jobs: sa.Table = cast(sa.Table, JobRun.__table__)
passes: sa.Table = cast(sa.Table, ReconciliationPass.__table__)
decisions: sa.Table = cast(sa.Table, ReconciliationDecision.__table__)
leader_leases: sa.Table = cast(sa.Table, ReconcilerLease.__table__)

STEPS = [Step("fetch", "idempotent"), Step("render", "pure"), Step("publish", "effectful")]
PLAN_JSON = [{"step_name": s.step_name, "effect_kind": s.kind.value} for s in STEPS]
LEADER_LEASE_NAME = "reconciler"

INTERVAL_SECONDS = 0.3
LEADER_LEASE_SECONDS = 1.5
WORKER_LEASE_SECONDS = 0.5
START_TIMEOUT_SECONDS = 60.0  # a start on a loaded 2-core machine took over 20 s
EXIT_BOUND_SECONDS = 10.0
UNREACHABLE_URL = "postgresql+psycopg://postgres@127.0.0.1:1/nope"

# docs/metrics.md: sample name -> the label names it carries (histograms by their parts).
DESIGN_METRICS: dict[str, set[str]] = {
    "reconciler_passes_total": {"outcome"},
    "reconciler_pass_duration_seconds_bucket": {"le"},
    "reconciler_pass_duration_seconds_count": set(),
    "reconciler_pass_duration_seconds_sum": set(),
    "reconciler_decisions_total": {"disposition", "reason"},
    "reconciler_stale_claims": {"reason"},
    "reconciler_oldest_stale_claim_age_seconds": {"reason"},
    "reconciler_last_successful_pass_timestamp_seconds": set(),
    "reconciler_is_leader": set(),
}
DESIGN_TYPES = {
    "reconciler_passes": "counter",
    "reconciler_pass_duration_seconds": "histogram",
    "reconciler_decisions": "counter",
    "reconciler_stale_claims": "gauge",
    "reconciler_oldest_stale_claim_age_seconds": "gauge",
    "reconciler_last_successful_pass_timestamp_seconds": "gauge",
    "reconciler_is_leader": "gauge",
}
# Labels whose values are numbers by definition (bucket bounds), not identifiers.
NUMERIC_LABELS = {"le", "quantile"}

RESUMED_FROM_UNSTARTED = {"disposition": "resume", "reason": "resumed_from_unstarted_step"}

CRASHING_WORKER = """
import os, signal, sys
from reconciler.worker import JobClient
client = JobClient(sys.argv[1])
claim = client.claim(worker="doomed-worker", lease_seconds=float(sys.argv[2]),
                     kinds=[sys.argv[3]])
print(claim.job_id if claim is not None else "none", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


# --------------------------------------------------------------------------------------------
# Helpers shared with test_prometheus_e2e.py
# --------------------------------------------------------------------------------------------


def wait_until(check: Callable[[], Any], what: str, timeout: float = 15.0,
               every: float = 0.05) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def http_get(port: int, path: str, timeout: float = 3.0) -> tuple[int, str]:
    """GET http://127.0.0.1:port/path; the status and body (no exception for 4xx/5xx)."""
    url = f"http://127.0.0.1:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_samples(exposition: str) -> Samples:
    """Every sample of a Prometheus text exposition, keyed by name and sorted labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    """The value of one sample, or None when it is not exported."""
    return samples.get((name, tuple(sorted(labels.items()))))


def free_port() -> int:
    """A port nobody listened on a moment ago (for servers that cannot bind port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def child_env(**settings: Any) -> dict[str, str]:
    """This environment without any RECONCILER_* variable, plus the given settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECONCILER_")}
    env.update({f"RECONCILER_{k.upper()}": str(v) for k, v in settings.items()})
    return env


_LISTENING = re.compile(r"event=http_listening host=(\S+) port=(\d+)")
_LOG_TS = re.compile(r"^ts=(\S+)Z ")


@dataclass
class ReconcilerProcess:
    """One running ``reconciler run`` and what an operator can observe of it."""

    popen: subprocess.Popen[bytes]
    stderr_path: Path
    instance: str
    host: str = ""
    port: int = 0

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stderr_lines(self) -> list[str]:
        return self.stderr().splitlines()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def get(self, path: str) -> tuple[int, str]:
        return http_get(self.port, path)

    def samples(self) -> Samples:
        status, body = self.get("/metrics")
        assert status == 200, body
        return parse_samples(body)

    def metric(self, name: str, **labels: str) -> float | None:
        return sample(self.samples(), name, **labels)

    def is_leader(self) -> bool:
        return self.metric("reconciler_is_leader") == 1.0

    def send(self, signum: int) -> None:
        self.popen.send_signal(signum)

    def wait_exit(self, timeout: float = EXIT_BOUND_SECONDS) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.instance} still running {timeout}s after the signal:\n"
                        f"{self.stderr()[-3000:]}")

    def sigkill(self) -> None:
        self.popen.kill()
        assert self.popen.wait(timeout=10) == -signal.SIGKILL


class Launcher:
    """Starts ``reconciler run`` processes; every one still running is killed on close."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[ReconcilerProcess] = []

    def spawn(self, database_url: str, **settings: Any) -> ReconcilerProcess:
        """Start one reconciler with test-speed settings; do not wait for it."""
        instance = settings.pop("instance_name", f"reconciler-{len(self.started)}")
        config = {
            "database_url": database_url, "interval_seconds": INTERVAL_SECONDS,
            "metrics_port": 0, "leader_lease_seconds": LEADER_LEASE_SECONDS,
            "stale_after_seconds": 0, "instance_name": instance,
            "artifact_root": self.workdir / "artifacts",
            # These tests make whole backlogs stale at once, which the mass-staleness brake
            # (tested on its own) would hold back.
            "brake_hold_seconds": 0,
        } | settings
        stderr_path = self.workdir / f"{instance}.stderr"
        with stderr_path.open("wb") as stderr:
            popen = subprocess.Popen(
                [sys.executable, "-m", "reconciler.cli", "run"], cwd=REPO_ROOT,
                env=child_env(**config), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=stderr,
            )
        process = ReconcilerProcess(popen, stderr_path, instance)
        self.started.append(process)
        return process

    @staticmethod
    def wait_listening(process: ReconcilerProcess) -> None:
        """Until the process logs its HTTP port and answers /healthz."""

        def listening() -> bool:
            if not process.alive():
                pytest.fail(f"`reconciler run` exited {process.popen.returncode} at start:\n"
                            f"{process.stderr()[-3000:]}")
            found = _LISTENING.search(process.stderr())
            if found:
                process.host, process.port = found.group(1), int(found.group(2))
            return found is not None

        def healthy() -> bool:
            try:
                return process.get("/healthz")[0] == 200
            except OSError:
                if not process.alive():
                    pytest.fail(f"`reconciler run` exited {process.popen.returncode} at "
                                f"start:\n{process.stderr()[-3000:]}")
                return False

        wait_until(listening, f"{process.instance} to log event=http_listening",
                   START_TIMEOUT_SECONDS)
        wait_until(healthy, f"{process.instance} /healthz")

    def start(self, database_url: str, *, wait_ready: bool = True,
              **settings: Any) -> ReconcilerProcess:
        """Start one reconciler; wait for /healthz and, unless told not to, /readyz."""
        process = self.spawn(database_url, **settings)
        self.wait_listening(process)
        if wait_ready:
            self.wait_ready(process)
        return process

    @staticmethod
    def wait_ready(process: ReconcilerProcess, timeout: float = START_TIMEOUT_SECONDS) -> None:
        def ready() -> bool:
            if not process.alive():
                pytest.fail(f"{process.instance} exited {process.popen.returncode}:\n"
                            f"{process.stderr()[-3000:]}")
            return process.get("/readyz")[0] == 200

        wait_until(ready, f"{process.instance} /readyz 200", timeout)

    def close(self) -> None:
        for process in self.started:
            if process.alive():
                process.popen.kill()
                process.popen.wait(timeout=10)


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    """Start reconciler processes; any left running at teardown are killed."""
    started = Launcher(tmp_path)
    try:
        yield started
    finally:
        started.close()


def crash_a_worker(database_url: str, kind: str = "report",
                   lease_seconds: float = WORKER_LEASE_SECONDS) -> int:
    """A worker process claims the oldest queued job of ``kind`` and SIGKILLs itself; its id."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CRASHING_WORKER), database_url,
         str(lease_seconds), kind],
        cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=60,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return int(proc.stdout.strip())


def enqueue_job(database_url: str, kind: str = "report") -> int:
    """One three-step job, queued."""
    with JobClient(database_url) as client:
        return client.enqueue(kind, steps=STEPS, max_attempts=3,
                              idempotency_key=f"req-{uuid.uuid4().hex}")


def fetch(engine: Engine, query: sa.Select[Any]) -> list[sa.Row[Any]]:
    with engine.connect() as conn:
        return list(read_only(conn).execute(query))


def stale_job_rows(count: int, kind: str) -> list[dict[str, Any]]:
    """``count`` processing jobs whose dead worker's lease expired a minute ago (generation 1)."""
    long_ago = datetime.now(UTC) - timedelta(seconds=120)
    expired = datetime.now(UTC) - timedelta(seconds=60)
    return [
        {
            "job_kind": kind, "job_status": "processing", "step_plan": PLAN_JSON,
            "resume_step_index": 0, "attempt_count": 1, "max_attempts": 3,
            "claim_generation": 1, "lease_token": uuid.uuid4().hex,
            "lease_owner": "dead-worker", "lease_expires_at": expired,
            "claimed_at": long_ago, "last_activity_at": long_ago, "available_at": long_ago,
            "idempotency_key": f"{kind}-{uuid.uuid4().hex}", "created_at": long_ago,
            "updated_at": long_ago,
        }
        for _ in range(count)
    ]


def insert_stale_jobs(engine: Engine, count: int, kind: str = "bulk") -> list[int]:
    """Insert ``stale_job_rows``; the ids of every job of ``kind``."""
    with engine.begin() as conn:
        conn.execute(jobs.insert(), stale_job_rows(count, kind))
    return [int(r.job_id) for r in fetch(engine, sa.select(jobs.c.job_id)
                                             .where(jobs.c.job_kind == kind))]


def decisions_for(engine: Engine, job_id: int) -> list[sa.Row[Any]]:
    """A job's decision rows with the instance whose pass made each."""
    return fetch(engine, sa.select(decisions, passes.c.reconciler_instance)
                 .join(passes, passes.c.pass_id == decisions.c.pass_id)
                 .where(decisions.c.job_id == job_id).order_by(decisions.c.decision_id))


def leader_lease(engine: Engine) -> sa.Row[Any] | None:
    """The leader lease row, with whether it has expired by the database's clock."""
    rows = fetch(engine, sa.select(leader_leases,
                                   (leader_leases.c.lease_expires_at <= db_now()).label("expired"))
                 .where(leader_leases.c.lease_name == LEADER_LEASE_NAME))
    return rows[0] if rows else None


@contextmanager
def write_lock(engine: Engine) -> Iterator[Connection]:
    """Hold what every pass needs to write first, so a pass started now blocks until exit.

    SQLite: the database write lock (``BEGIN IMMEDIATE``). PostgreSQL: an ACCESS EXCLUSIVE
    lock on ``worker_sessions``, which a pass's first statement (the silent-session sweep)
    reads. MySQL: a WRITE table lock on it (and on ``job_runs``, which the caller may write
    while holding it), released at exit. The transaction rolls back at exit unless the
    caller commits it.
    """
    with engine.connect() as conn:
        mysql = conn.dialect.name == "mysql"
        if mysql:  # on the driver's connection: SQLAlchemy's would begin a transaction
            conn.connection.dbapi_connection.cursor().execute(  # type: ignore[union-attr]
                "LOCK TABLES worker_sessions WRITE, job_runs WRITE")
        tx = conn.begin()
        try:
            if is_postgresql(conn):
                conn.exec_driver_sql("LOCK TABLE worker_sessions IN ACCESS EXCLUSIVE MODE")
            yield conn
        finally:
            if tx.is_active:
                tx.rollback()
            if mysql:
                conn.connection.dbapi_connection.cursor().execute(  # type: ignore[union-attr]
                    "UNLOCK TABLES")


@dataclass(frozen=True)
class LoggedPass:
    """One ``event=pass_finished`` log line: when it ended, how long it took, what it did."""

    ended: float
    seconds: float
    outcome: str
    resumed: int


def logged_passes(lines: list[str]) -> list[LoggedPass]:
    found = []
    for line in lines:
        if "event=pass_finished" not in line:
            continue
        facts = dict(part.split("=", 1) for part in line.split() if "=" in part)
        ts = datetime.fromisoformat(_LOG_TS.match(line).group(1)).replace(  # type: ignore[union-attr]
            tzinfo=UTC).timestamp()
        found.append(LoggedPass(ts, float(facts["seconds"]), facts["outcome"],
                                int(facts["resumed"])))
    return found


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *expected: str) -> None:
    """Non-zero exit, one line on stderr, no traceback."""
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for text in expected:
        assert text in lines[0], lines[0]


# --------------------------------------------------------------------------------------------
# /metrics, /healthz, /readyz
# --------------------------------------------------------------------------------------------


def test_run_serves_every_design_metric_and_health_on_loopback(
    db_url: str, launcher: Launcher
) -> None:
    """`reconciler run` binds 127.0.0.1, answers /healthz, becomes ready after a pass and
    exports every documented metric with its type and labels."""
    reconciler = launcher.start(db_url)

    assert reconciler.host == "127.0.0.1"
    assert_listens_only_on_loopback(reconciler.port)
    assert reconciler.get("/healthz") == (200, "ok\n")
    assert reconciler.get("/readyz")[0] == 200
    assert reconciler.get("/nope")[0] == 404
    wait_until(lambda: (reconciler.metric("reconciler_passes_total", outcome="ok") or 0) >= 1,
               "a successful pass")

    status, body = reconciler.get("/metrics")
    assert status == 200
    families = {f.name: f.type for f in text_string_to_metric_families(body)}
    for name, kind in DESIGN_TYPES.items():
        assert families.get(name) == kind, (name, families.get(name))
    samples = parse_samples(body)
    for name, label_names in DESIGN_METRICS.items():
        present = [dict(labels) for (n, labels) in samples if n == name]
        assert present, f"{name} is not exported"
        assert all(set(labels) == label_names for labels in present), (name, present)
    outcomes = {dict(labels)["outcome"] for (n, labels) in samples
                if n == "reconciler_passes_total"}
    assert outcomes == {"ok", "error", "not_leader", "liveness_unknown"}
    assert sample(samples, "reconciler_is_leader") == 1.0
    last_success = sample(samples, "reconciler_last_successful_pass_timestamp_seconds")
    assert last_success is not None
    assert abs(last_success - time.time()) < 30
    assert sample(samples, "reconciler_decisions_total", **RESUMED_FROM_UNSTARTED) == 0.0


def assert_listens_only_on_loopback(port: int) -> None:
    """The kernel's socket table shows the port bound to 127.0.0.1 and nothing wider."""
    tables = [Path("/proc/net/tcp"), Path("/proc/net/tcp6")]
    if not tables[0].exists():
        pytest.skip("no /proc/net/tcp on this platform to check the bound address")
    listening = []
    for table in tables:
        if not table.exists():
            continue
        for line in table.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.rsplit(":", 1)
            if state == "0A" and int(port_hex, 16) == port:  # 0A = LISTEN
                listening.append(address)
    assert listening == ["0100007F"], listening  # 127.0.0.1, little-endian hex


def test_crashed_worker_is_resumed_and_counted_without_job_ids_in_labels(
    db_url: str, engine: Engine, launcher: Launcher
) -> None:
    """A worker that claims and is SIGKILLed gets its job resumed by the running service,
    `reconciler_decisions_total{resume,resumed_from_unstarted_step}` goes to 1, and no
    label value anywhere is a job id."""
    reconciler = launcher.start(db_url)
    queued_ids = [enqueue_job(db_url) for _ in range(3)]
    job_id = crash_a_worker(db_url)
    assert job_id == queued_ids[0]

    wait_until(lambda: reconciler.metric("reconciler_decisions_total",
                                         **RESUMED_FROM_UNSTARTED) == 1.0,
               "the resume to be counted")
    (decision,) = decisions_for(engine, job_id)
    assert (decision.disposition, decision.decision_reason, decision.resume_step_index) == (
        "resume", "resumed_from_unstarted_step", 0)
    assert decision.reconciler_instance == reconciler.instance
    (job,) = fetch(engine, sa.select(jobs).where(jobs.c.job_id == job_id))
    assert (job.job_status, job.claim_generation, job.lease_token) == ("queued", 2, None)

    passes_so_far = reconciler.metric("reconciler_passes_total", outcome="ok") or 0
    wait_until(lambda: (reconciler.metric("reconciler_passes_total", outcome="ok") or 0)
               >= passes_so_far + 3, "three more passes, which must not count it again")
    status, body = reconciler.get("/metrics")
    assert status == 200
    samples = parse_samples(body)
    assert sample(samples, "reconciler_decisions_total", **RESUMED_FROM_UNSTARTED) == 1.0
    resumed_total = sum(v for (n, labels), v in samples.items()
                        if n == "reconciler_decisions_total" and ("disposition", "resume")
                        in labels)
    assert resumed_total == 1.0
    all_ids = {str(i) for i in queued_ids}
    for (name, labels), _ in samples.items():
        for label, value in labels:
            if label in NUMERIC_LABELS:
                continue
            assert not re.fullmatch(r"\d+", value), (name, label, value)
            assert value not in all_ids, (name, label, value)


# --------------------------------------------------------------------------------------------
# Signals
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_exits_zero_quickly_and_releases_the_leader_lease(
    db_url: str, engine: Engine, launcher: Launcher, signum: int
) -> None:
    """SIGTERM or SIGINT ends `reconciler run` with exit 0 within 10 s and leaves the leader
    lease expired, so a successor need not wait it out."""
    reconciler = launcher.start(db_url, leader_lease_seconds=60)
    wait_until(reconciler.is_leader, "leadership")
    held = leader_lease(engine)
    assert held is not None
    assert (held.holder_id, held.expired) == (reconciler.instance, False)

    sent = time.monotonic()
    reconciler.send(signum)
    code = reconciler.wait_exit()
    took = time.monotonic() - sent

    assert code == 0, reconciler.stderr()[-3000:]
    assert took < EXIT_BOUND_SECONDS
    released = leader_lease(engine)
    assert released is not None
    assert (released.holder_id, released.expired) == (reconciler.instance, True)
    log = reconciler.stderr()
    assert "Traceback" not in log
    assert f"event=signal signal={signal.Signals(signum).name}" in log
    assert "event=service_stopped" in log


def test_sigterm_during_a_pass_finishes_it_and_loses_no_decision(
    db_url: str, engine: Engine, launcher: Launcher
) -> None:
    """SIGTERM while a pass is in flight over 2000 stale jobs: the pass completes, the
    process exits 0, and every changed job has exactly its one decision record and every
    recorded change its job change, with pass counts equal to their decision rows."""
    insert_stale_jobs(engine, 1000, kind="first")
    reconciler = launcher.start(db_url, interval_seconds=0.05, batch_size=500,
                                leader_lease_seconds=30, wait_ready=False)

    def some_recorded() -> bool:
        return bool(fetch(engine, sa.select(decisions.c.decision_id).limit(1)))

    wait_until(some_recorded, "the first pass to record decisions", START_TIMEOUT_SECONDS)
    with write_lock(engine) as conn:
        # Passes run back to back (interval 0.05 s); the next one blocks on this lock.
        conn.execute(jobs.insert(), stale_job_rows(1000, "second"))
        time.sleep(0.5)
        reconciler.send(signal.SIGTERM)
        wait_until(lambda: "event=signal signal=SIGTERM" in reconciler.stderr(),
                   "the signal to be logged")
        time.sleep(0.5)
        assert reconciler.alive(), "exited with a pass still in flight"
        resumed_at_signal = sum(p.resumed for p in logged_passes(reconciler.stderr_lines()))
        conn.commit()  # the blocked pass now finds the second 1000 stale jobs
    code = reconciler.wait_exit()

    assert code == 0, reconciler.stderr()[-3000:]
    lines = reconciler.stderr_lines()
    signal_at = next(i for i, line in enumerate(lines) if "event=signal" in line)
    after_signal = logged_passes(lines[signal_at:])
    assert [(p.outcome, p.resumed) for p in after_signal] == [("ok", 500)], lines[signal_at:]
    assert "Traceback" not in reconciler.stderr()

    job_ids = [int(r.job_id) for r in fetch(engine, sa.select(jobs.c.job_id))]
    assert len(job_ids) == 2000
    job_rows = {r.job_id: r for r in fetch(engine, sa.select(jobs))}
    decision_rows = fetch(engine, sa.select(decisions))
    pass_rows = fetch(engine, sa.select(passes))
    bumped = {job_id for job_id in job_ids if job_rows[job_id].claim_generation != 1}
    per_job = Counter(int(d.job_id) for d in decision_rows)
    acted = [d for d in decision_rows if d.disposition in ("resume", "terminalize")]
    print(f"\nresumed {len(bumped)} of {len(job_ids)} jobs; "
          f"{resumed_at_signal} before SIGTERM, {after_signal[0].resumed} by the pass in flight")

    assert len(bumped) == resumed_at_signal + 500 < len(job_ids)
    # No change without its record: every bumped job has exactly one decision, a resume.
    for job_id in bumped:
        row = job_rows[job_id]
        assert (row.claim_generation, row.job_status, row.lease_token) == (2, "queued", None)
        assert per_job[job_id] == 1, job_id
    # No record without its change: every resume/terminalize row matches a bumped job.
    assert {int(d.job_id) for d in acted} == bumped
    for d in acted:
        assert (d.disposition, d.generation_before, d.generation_after) == ("resume", 1, 2)
        assert job_rows[int(d.job_id)].claim_generation == d.generation_after
    for job_id in set(job_ids) - bumped:
        assert job_rows[job_id].job_status == "processing"
        assert per_job[job_id] == 0
    # Each pass row's counts equal its decision rows, and no pass is left half-recorded.
    by_pass: dict[int, Counter[str]] = {}
    for d in decision_rows:
        by_pass.setdefault(d.pass_id, Counter())[d.disposition] += 1
    for p in pass_rows:
        assert p.pass_outcome == PassOutcome.OK.value, p
        assert p.finished_at is not None, p
        counted = by_pass.get(p.pass_id, Counter())
        assert (p.candidates_seen, p.resumed_count, p.terminalized_count, p.skipped_count) == (
            sum(counted.values()), counted["resume"], counted["terminalize"],
            counted["skip"]), p
    lease = leader_lease(engine)
    assert lease is not None
    assert lease.expired


# --------------------------------------------------------------------------------------------
# Several replicas
# --------------------------------------------------------------------------------------------


@pytest.fixture
def pg_url(postgres: PostgresForTests | None) -> Iterator[str]:
    """A freshly migrated PostgreSQL database (replicas need a shared server)."""
    if postgres is None:
        pytest.skip(f"PostgreSQL not available: {INSTALL_HINT}")
    name = postgres.new_database(migrated=True)
    try:
        yield postgres.url(name)
    finally:
        postgres.drop(name)


def leaders(replicas: list[ReconcilerProcess]) -> list[str]:
    """The instances whose /metrics say reconciler_is_leader 1, polled one after another."""
    return [r.instance for r in replicas if r.is_leader()]


def test_every_replica_passes_and_is_ready_while_one_leads_the_chores(
    db_url: str, launcher: Launcher
) -> None:
    """Two replicas: both run ok passes (no leader gates recovery) and both are ready, while
    exactly one holds the chores' leader lease."""
    replicas = [launcher.spawn(db_url, instance_name=f"replica-{n}") for n in range(2)]
    for replica in replicas:
        launcher.wait_listening(replica)
    (leader_name,) = wait_until(lambda: leaders(replicas), "one replica to lead")
    (follower,) = [r for r in replicas if r.instance != leader_name]
    wait_until(lambda: (follower.metric("reconciler_passes_total", outcome="ok")
                        or 0) >= 2, "the follower to run passes of its own")

    assert follower.metric("reconciler_passes_total", outcome="error") == 0.0
    assert follower.metric("reconciler_passes_total", outcome="not_leader") == 0.0
    assert follower.get("/healthz")[0] == 200
    status, why = follower.get("/readyz")
    assert (status, why) == (200, "ready\n")


def test_a_replica_sigkilled_with_its_node_costs_no_failover(
    pg_url: str, launcher: Launcher
) -> None:
    """Three `reconciler run` processes on one PostgreSQL database all pass. SIGKILL the
    one leading the chores: a job crashed right after is decided by a survivor within a
    few intervals, without waiting out the dead replica's leader lease; the chores' lease
    passes to a survivor once it runs out; each crashed job is resumed once."""
    engine = create_engine(pg_url)
    try:
        replicas = [launcher.spawn(pg_url, instance_name=f"replica-{n}",
                                   leader_lease_seconds=30) for n in range(3)]
        for replica in replicas:
            launcher.wait_listening(replica)
        (leader_name,) = wait_until(lambda: leaders(replicas), "one replica to lead")

        before = enqueue_job(pg_url, "before")
        assert crash_a_worker(pg_url, "before") == before
        wait_until(lambda: decisions_for(engine, before), "the first crashed job's decision")

        old = next(r for r in replicas if r.instance == leader_name)
        old.sigkill()
        killed_at = time.monotonic()
        after = enqueue_job(pg_url, "after")
        assert crash_a_worker(pg_url, "after") == after
        wait_until(lambda: decisions_for(engine, after), "the second crashed job's decision",
                   timeout=15)
        decided_seconds = time.monotonic() - killed_at
        print(f"\norphan decided {decided_seconds:.2f}s after its replica's SIGKILL "
              "(leader lease 30 s)")
        assert decided_seconds < 10, "recovery waited for the dead replica's lease"
        lease = leader_lease(engine)
        assert lease is not None
        assert (lease.holder_id, lease.expired) == (leader_name, False)

        survivors = [r for r in replicas if r is not old]
        by_instance = Counter(
            (r.reconciler_instance, r.pass_outcome)
            for r in fetch(engine, sa.select(passes.c.reconciler_instance,
                                             passes.c.pass_outcome)))
        for replica in replicas:
            assert by_instance[(replica.instance, "ok")] > 0, by_instance
            assert by_instance[(replica.instance, "error")] == 0, by_instance
        for job_id in (before, after):
            (decision,) = decisions_for(engine, job_id)
            assert (decision.disposition, decision.decision_reason) == (
                "resume", "resumed_from_unstarted_step")
            (job,) = fetch(engine, sa.select(jobs).where(jobs.c.job_id == job_id))
            assert (job.job_status, job.claim_generation) == ("queued", 2)

        for replica in survivors:
            replica.send(signal.SIGTERM)
        assert [r.wait_exit() for r in survivors] == [0, 0]
    finally:
        engine.dispose()


# --------------------------------------------------------------------------------------------
# Resilience of the service itself
# --------------------------------------------------------------------------------------------


def _stop_server(server: ThrowawayPostgres) -> None:
    # ThrowawayPostgres.stop() also deletes the cluster; an outage needs it kept, so this
    # drives pg_ctl directly with the server's own options (same port, same data).
    proc = server._pg_ctl("stop", "-m", "fast", "-w", "-t", "30")
    assert proc.returncode == 0, proc.stderr


def _start_server(server: ThrowawayPostgres) -> None:
    proc = server._pg_ctl("start", "-w", "-t", "30", "-o", server._server_options(),
                          "-l", str(server.log_file))
    assert proc.returncode == 0, proc.stderr
    server._wait_ready()


def test_service_survives_database_restart_and_outage(
    own_postgres: ThrowawayPostgres, launcher: Launcher
) -> None:
    """While its PostgreSQL crash-restarts or is down for seconds, `reconciler run` keeps
    running, counts and logs failed passes, reports not ready, and passes again by itself
    once the database is back."""
    own_postgres.create_database("resilience")
    url = own_postgres.url("resilience")
    engine = create_engine(url)
    upgrade(engine)
    engine.dispose()
    reconciler = launcher.start(url)

    def last_success() -> float:
        return reconciler.metric("reconciler_last_successful_pass_timestamp_seconds") or 0.0

    def errors() -> float:
        return reconciler.metric("reconciler_passes_total", outcome="error") or 0.0

    # A crash-like restart: the pooled connections die under the service.
    own_postgres.restart(mode="immediate")
    restarted = time.time()
    wait_until(lambda: last_success() > restarted, "a successful pass after the restart")
    assert reconciler.alive()

    # An outage of a few seconds.
    errors_before = errors()
    _stop_server(own_postgres)
    stopped = time.monotonic()
    try:
        wait_until(lambda: errors() >= errors_before + 2, "failed passes to be counted")
        failed_lines = wait_until(
            lambda: [line for line in reconciler.stderr_lines() if "event=pass_failed" in line],
            "an event=pass_failed log line")
        assert reconciler.get("/healthz")[0] == 200
        # The probe keeps its last answer for up to a second: two fast failed passes can
        # come before it looks again, and until then readiness names the failed pass.
        status, why = wait_until(
            lambda: (answer := reconciler.get("/readyz"))[1].startswith("cannot reach")
            and answer, "/readyz to name the unreachable database")
        assert status == 503, why
        assert "cannot reach the database" in why
        stale_success = last_success()
        time.sleep(max(0.0, 3.0 - (time.monotonic() - stopped)))
        assert last_success() == stale_success
        assert reconciler.alive()
    finally:
        _start_server(own_postgres)
    back = time.time()

    wait_until(lambda: last_success() > back, "a successful pass after the outage")
    Launcher.wait_ready(reconciler)
    assert reconciler.alive()
    for line in failed_lines:
        assert line.startswith("ts="), line
        assert " level=error " in line, line
        assert re.search(r" error=\w+ ", line), line
    assert "Traceback" not in reconciler.stderr()
    reconciler.send(signal.SIGTERM)
    assert reconciler.wait_exit() == 0


# --------------------------------------------------------------------------------------------
# Overruns
# --------------------------------------------------------------------------------------------


def test_a_pass_longer_than_the_interval_is_reported_and_never_overlaps(
    db_url: str, engine: Engine, launcher: Launcher
) -> None:
    """A pass held up for over a second with a 0.1 s interval is reported as an overrun
    (metric and log line) and no second pass runs beside it."""
    reconciler = launcher.start(db_url, interval_seconds=0.1, leader_lease_seconds=30)

    with write_lock(engine):
        time.sleep(1.5)  # the pass started meanwhile waits for the lock
    wait_until(lambda: (reconciler.metric("reconciler_pass_overruns_total") or 0) > 0,
               "an overrun to be counted")
    wait_until(lambda: "event=pass_overrun" in reconciler.stderr(), "an event=pass_overrun line")
    wait_until(lambda: any(p.seconds > 1.0 for p in logged_passes(reconciler.stderr_lines())),
               "the long pass to finish")
    time.sleep(0.5)

    logged = sorted(logged_passes(reconciler.stderr_lines()), key=lambda p: p.ended)
    assert logged
    for earlier, later in itertools.pairwise(logged):
        # Log timestamps have millisecond precision.
        assert later.ended - later.seconds >= earlier.ended - 0.005, (earlier, later)
    assert (reconciler.metric("reconciler_pass_duration_seconds_bucket", le="1.0") or 0) < (
        reconciler.metric("reconciler_pass_duration_seconds_count") or 0)
    assert reconciler.alive()


def test_a_backlog_of_several_ticks_drains_without_waiting_for_the_interval(
    db_url: str, engine: Engine, launcher: Launcher
) -> None:
    """1,000 stale jobs in batches of 10 are five ticks' worth (a tick stops at 20 batches):
    with a 30 s interval the replica runs the five back to back, each started as the last
    one stopped with a full batch, and the drain is over long before a second scheduled
    tick could start. Then a tick that finds nothing left waits for the interval."""
    insert_stale_jobs(engine, 1000)
    reconciler = launcher.start(db_url, interval_seconds=30, batch_size=10,
                                leader_lease_seconds=30, wait_ready=False)
    started = time.monotonic()

    def ticks() -> list[tuple[int, int, int]]:
        lines = [dict(part.split("=", 1) for part in line.split() if "=" in part)
                 for line in reconciler.stderr_lines() if "event=tick_finished" in line]
        return [(int(t["batches"]), int(t["decisions"]), int(t["backlog_left"]))
                for t in lines]

    logged = wait_until(lambda: len(ticks()) >= 6 and ticks(), "six ticks", timeout=25)
    assert time.monotonic() - started < 30
    assert logged == [(20, 200, 1)] * 5 + [(1, 0, 0)]
    assert not fetch(engine, sa.select(jobs.c.job_id).where(jobs.c.job_status == "processing"))
    assert reconciler.metric("reconciler_pass_overruns_total") == 0.0
    reconciler.send(signal.SIGTERM)
    assert reconciler.wait_exit() == 0


# --------------------------------------------------------------------------------------------
# Retention
# --------------------------------------------------------------------------------------------


def test_retention_deletes_old_audit_rows_and_keeps_new_ones(
    db_url: str, engine: Engine
) -> None:
    """The retention chore deletes passes and decisions older than audit_retention_days
    and keeps newer ones; jobs are untouched."""
    retention_days = 0.00001  # 0.864 s
    service = sidecar_service(Settings(
        database_url=db_url, audit_retention_days=retention_days, stale_after_seconds=0,
        leader_lease_seconds=30), instance="retention-test")
    try:
        service.renew_leadership()  # retention is a chore of the leading replica
        (old_job,) = insert_stale_jobs(engine, 1, kind="old")
        old_report = service.run_one_pass()
        assert old_report is not None
        assert old_report.pass_id is not None
        time.sleep(retention_days * 86400 + 0.5)
        (new_job,) = insert_stale_jobs(engine, 1, kind="new")
        new_report = service.run_one_pass()
        assert new_report is not None
        assert new_report.pass_id is not None

        service.run_chore("retention")

        kept_passes = [r.pass_id for r in fetch(engine, sa.select(passes.c.pass_id))]
        kept_decisions = [(r.pass_id, int(r.job_id))
                          for r in fetch(engine, sa.select(decisions.c.pass_id,
                                                           decisions.c.job_id))]
        assert kept_passes == [new_report.pass_id]
        assert kept_decisions == [(new_report.pass_id, new_job)]
        exported = parse_samples(generate_latest(service.metrics.registry).decode())
        # One pass row and its one decision.
        assert sample(exported, "reconciler_audit_rows_deleted_total") == 2.0
        job_statuses = {r.job_id: r.job_status for r in fetch(engine, sa.select(jobs))}
        assert job_statuses == {old_job: "queued", new_job: "queued"}
    finally:
        service.close()


# --------------------------------------------------------------------------------------------
# Start-up refusals
# --------------------------------------------------------------------------------------------


def test_run_refuses_an_unmigrated_database_in_one_line(empty_db_url: str) -> None:
    """`reconciler run` on a database without the schema exits non-zero with one line."""
    proc = run_cli(empty_db_url, "run", timeout=30, process=False, metrics_port=0)
    assert_one_line_error(proc, "reconciler db upgrade")


@pytest.mark.parametrize(("setting", "value", "named"), [
    ("interval_seconds", "-1", "interval_seconds"),
    ("batch_size", "many", "batch_size"),
    ("metrics_port", "70000", "metrics_port"),
    ("database_url", "oracle://nope/nope", "database_url"),
])
def test_run_refuses_a_bad_setting_in_one_line(
    tmp_path: Path, setting: str, value: str, named: str
) -> None:
    """`reconciler run` with an invalid setting exits non-zero with one line naming it."""
    settings: dict[str, Any] = {"metrics_port": 0, setting: value}
    url = str(settings.pop("database_url", f"sqlite:///{tmp_path / 'jobs.db'}"))
    proc = run_cli(url, "run", timeout=30, process=False, **settings)
    assert_one_line_error(proc, named)


@pytest.mark.parametrize("url", [UNREACHABLE_URL, "sqlite:////nonexistent-dir/sub/jobs.db"],
                         ids=["postgresql", "sqlite"])
def test_run_refuses_an_unreachable_database_in_one_line(url: str) -> None:
    """`reconciler run` against a database it cannot reach exits 3 with one error line,
    after its start-up retries (one second of them here), each a log line saying what it
    waits for."""
    proc = run_cli(url, "run", timeout=30, process=False, metrics_port=0,
                   start_retry_seconds=1)
    assert proc.returncode == 3, proc.stderr
    *waits, last = proc.stderr.strip().splitlines()
    assert last.startswith("reconciler: error: cannot reach the database"), last
    # A SQLite folder that is not there is refused before any connection, without waiting.
    assert bool(waits) == url.startswith("postgresql"), proc.stderr
    assert all("event=database_wait code=unreachable" in line for line in waits), waits


def test_run_refuses_a_metrics_port_in_use_in_one_line(tmp_path: Path) -> None:
    """`reconciler run` whose metrics port is taken exits non-zero with one line naming it."""
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    engine = create_engine(url)
    upgrade(engine)
    engine.dispose()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_cli(url, "run", timeout=30, metrics_port=port)
    assert_one_line_error(proc, str(port))
