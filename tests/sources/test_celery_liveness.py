"""Liveness the celery source cannot trust decides nothing, and says so: real Celery
workers and a real redis-server, on SQLite and PostgreSQL.

- the reconciler pointed at another database number of the app's Redis (a wrong URL):
  no decision over several silence timeouts, nothing published there, the doubt visible;
- a port where nothing listens: the same;
- a broker where no worker answers at all: nothing decided on silence until a worker of
  the app answers again, then the dead worker's task decided after a full timeout;
- Redis stopped and started under a running ``reconciler run``: ``/readyz``, the log
  lines and the metrics flip and flip back, and the dead worker's task is decided after
  the broker returns.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reconciler.config.loader import pass_config
from reconciler.core.passes import PassReport, run_pass
from reconciler.core.ports import StuckWork
from reconciler.core.vocabulary import Disposition, LivenessDoubt, PassOutcome, StuckReason
from reconciler.root.cli import assemble_cli
from reconciler.sources.celery import CeleryConfig
from reconciler.sources.celery.broker import CeleryBroker
from tests.cli_runner import run_main
from tests.conftest import REPO_ROOT
from tests.integration.test_service import Launcher, free_port
from tests.sources.celery_support import CeleryProject, kill_worker, worker_argv
from tests.sources.support import (
    PASS_GAP_SECONDS,
    RECOVERY_POLL_SECONDS,
    Markers,
    Processes,
    config_for,
    wait_until,
)
from tests.sources.test_celery_workers import (
    KINDS,
    TIMEOUT_SECONDS,
    config,
    start_worker,
    started,
)


@pytest.fixture
def markers(tmp_path: Path) -> Markers:
    return Markers(tmp_path / "markers")


def on_database(url: str, number: int) -> str:
    """The same Redis server's database ``number``."""
    return f"{url.rsplit('/', 1)[0]}/{number}"


def observe(project: CeleryProject, source: CeleryConfig) -> tuple[PassReport, StuckWork]:
    """One real pass through the composition root, and the stuck work the gauges read."""
    config = config_for(project.engine, source, KINDS)
    store = assemble_cli(config, engine=project.engine).passes
    report = run_pass(store, dataclasses.replace(
        pass_config(config.settings, "liveness", KINDS), brake=None))
    return report, store.stuck_work()


def doubted_over_timeouts(project: CeleryProject, source: CeleryConfig,
                          code: LivenessDoubt) -> StuckWork:
    """Passes over three silence timeouts: each decides nothing and names the doubt."""
    deadline = time.monotonic() + 3 * TIMEOUT_SECONDS
    stuck: StuckWork = {}
    while time.monotonic() < deadline:
        report, stuck = observe(project, source)
        assert report.decisions == (), report.decisions
        assert report.outcome is PassOutcome.LIVENESS_UNKNOWN
        assert report.liveness is not None
        assert report.liveness.code is code
        time.sleep(PASS_GAP_SECONDS)
    return stuck


class TestDoubtedBroker:
    """A broker the source cannot trust: nothing decided that depends on ping."""

    def test_a_wrong_database_number_decides_nothing_and_publishes_nothing(
            self, celery_project: CeleryProject, processes: Processes,
            markers: Markers) -> None:
        import redis  # noqa: PLC0415 - celery[redis] is installed with the tests

        # A queue each: a prefork worker reserves one task beyond the one it runs.
        caller = celery_project.caller()
        idem = caller.send_task("idem.work", queue="celery")
        effect = caller.send_task("effect.work", queue="second")
        workers = [processes.start(f"worker-{q}", worker_argv(f"worker-{q}", "prefork", q),
                                   celery_project.env(markers.folder), cwd=REPO_ROOT)
                   for q in ("celery", "second")]
        wait_until(lambda: markers.has(f"{idem.id}-started-1")
                   and markers.has(f"{effect.id}-started-1"), "both tasks to start",
                   process=workers[1])
        wrong = on_database(celery_project.broker_url, 1)
        stuck = doubted_over_timeouts(celery_project, config(celery_project, wrong),
                                      LivenessDoubt.QUEUES_MISSING)
        assert stuck[StuckReason.LIVENESS_UNKNOWN].count == 2
        assert {celery_project.status(idem.id), celery_project.status(effect.id)} == {
            "STARTED"}
        there = redis.Redis.from_url(wrong, decode_responses=True)
        assert [k for k in there.scan_iter() if not k.startswith("reconciler:")] == [], \
            "nothing published to, or declared on, the wrong database"
        assert all(w.alive() for w in workers)

    def test_a_port_where_nothing_listens_decides_nothing(
            self, celery_project: CeleryProject, processes: Processes,
            markers: Markers) -> None:
        result, first = started(celery_project, processes, markers, "idem.work")
        kill_worker(first)
        nobody = config(celery_project, f"redis://127.0.0.1:{free_port()}/0")
        stuck = doubted_over_timeouts(celery_project, nobody,
                                      LivenessDoubt.BROKER_UNREACHABLE)
        assert stuck[StuckReason.LIVENESS_UNKNOWN].count == 1
        assert celery_project.status(result.id) == "STARTED"

    def test_no_worker_answering_at_all_decides_nothing_until_one_does(
            self, celery_project: CeleryProject, processes: Processes,
            markers: Markers) -> None:
        """The whole fleet down (on a database of its own: the session's live worker is
        not there): silence proves nothing. Once a worker of the app answers again, the
        dead worker's silence is counted from then, and its task is resumed."""
        alone = dataclasses.replace(celery_project,
                                    broker_url=on_database(celery_project.broker_url, 2))
        result, first = started(alone, processes, markers, "idem.work")
        kill_worker(first)
        stuck = doubted_over_timeouts(alone, config(alone), LivenessDoubt.NO_WORKER_ANSWERS)
        assert stuck[StuckReason.LIVENESS_UNKNOWN].count == 1
        second = start_worker(processes, alone, markers, "worker-b")
        broker = CeleryBroker(alone.broker_url)
        wait_until(lambda: broker.answers(["worker-b@tests"], ()).answering,
                   "a worker of the app to answer", process=second)
        trusted_at = time.monotonic()

        def decided() -> PassReport | None:
            report, _ = observe(alone, config(alone))
            assert report.liveness is None
            return report if report.decisions else None

        report = wait_until(decided, "the dead worker's task decided", process=second,
                            every=RECOVERY_POLL_SECONDS)
        assert time.monotonic() - trusted_at >= TIMEOUT_SECONDS
        assert [d.disposition for d in report.decisions] == [Disposition.RESUME]
        assert result.get(timeout=30) == "done on attempt 2"


class RedisServer:
    """A redis-server of the test's own, on a fixed port, that can be stopped and started."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import redis  # noqa: PLC0415

        binary = shutil.which("redis-server")
        assert binary is not None, "redis-server: apt-get install -y redis-server"
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.folder)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        wait_until(answers, "redis-server to start", timeout=20)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=10)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_redis_stopped_and_started_under_a_running_sidecar(
        celery_project: CeleryProject, own_redis: RedisServer, processes: Processes,
        markers: Markers, tmp_path: Path) -> None:
    project = dataclasses.replace(celery_project, broker_url=own_redis.url)
    result, doomed = started(project, processes, markers, "idem.work")
    start_worker(processes, project, markers, "worker-b")  # survives; idle until resumed
    settings = tmp_path / "reconciler.toml"
    settings.write_text(f"""
[source]
kind = "celery"
broker_url = "{own_redis.url}"
result_table = "{project.table}"

[kinds."idem.*"]
effect = "idempotent"
""")
    launcher = Launcher(tmp_path)
    try:
        sidecar = launcher.start(project.database_url, config=settings, interval_seconds=1,
                                 session_timeout_seconds=TIMEOUT_SECONDS,
                                 session_heartbeat_seconds=1, brake_hold_seconds=0,
                                 stale_after_seconds=0.5)
        unknown = ("reconciler_liveness_unknown", {"code": "broker_unreachable"})

        own_redis.stop()
        kill_worker(doomed)  # dies while the broker is away: its silence is not seen yet
        # The broker's absence, not a readiness probe's database check that a loaded
        # machine made late (also a 503, for another reason).
        _, why = wait_until(lambda: _readyz(sidecar, 503, "broker_unreachable"),
                            "/readyz 503 broker_unreachable")
        assert "broker_unreachable" in why, why
        wait_until(lambda: sidecar.metric(unknown[0], **unknown[1]) == 1.0, "the metric")
        assert "event=liveness_unknown" in sidecar.stderr()
        time.sleep(3 * TIMEOUT_SECONDS)
        assert project.status(result.id) == "STARTED", "nothing decided while it is away"

        own_redis.start()
        wait_until(lambda: _readyz(sidecar, 200), "/readyz 200 again", timeout=60)
        assert sidecar.metric(unknown[0], **unknown[1]) == 0.0
        assert "event=liveness_restored" in sidecar.stderr()
        decided = _waited(lambda: project.status(result.id) != "STARTED", 60)
        assert decided, sidecar.stderr()[-4000:]
        assert result.get(timeout=60) == "done on attempt 2"
        lines = [line for line in sidecar.stderr_lines() if "event=liveness_" in line]
        events = [line.split("event=")[1].split()[0] for line in lines]
        # One line when it began, one per change of why (a broker back before the workers
        # are: no_worker_answers, queues_missing), one when it ended; a worker reconnecting
        # to the new broker may miss a pass's broadcast, and the doubt begins again, said
        # again: every end follows a beginning.
        assert "code=broker_unreachable" in lines[0], lines
        assert events[0] == "liveness_unknown", lines
        assert events[-1] == "liveness_restored", lines
        assert all(before == "liveness_unknown" for before, now in itertools.pairwise(events)
                   if now == "liveness_restored"), lines
        assert all("s3cret" not in line for line in lines)
    finally:
        launcher.close()


def _waited(check: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _readyz(sidecar: Any, status: int, saying: str = "") -> tuple[int, str] | None:
    answer = sidecar.get("/readyz")
    return answer if answer[0] == status and saying in answer[1] else None


def test_explain_says_the_liveness_is_unknown(celery_project: CeleryProject,
                                              processes: Processes, markers: Markers,
                                              tmp_path: Path) -> None:
    """``jobs explain`` through a broker that cannot be reached: liveness unknown."""
    result, _ = started(celery_project, processes, markers, "idem.work")
    settings = tmp_path / "reconciler.toml"
    settings.write_text(f"""
database_url = "{celery_project.database_url}"
[source]
kind = "celery"
broker_url = "redis://127.0.0.1:{free_port()}/0"
result_table = "{celery_project.table}"
""")
    done = run_main(["jobs", "explain", result.id, "--config", str(settings)], timeout=120)
    assert done.returncode == 0, done.stderr
    assert "liveness unknown (broker_unreachable)" in done.stdout, done.stdout
    assert "lease_live" not in done.stdout.splitlines()[0]
    # The JSON agrees with the pass: no verdict that its worker is alive.
    done = run_main(["jobs", "explain", result.id, "--json", "--config", str(settings)],
                    timeout=120)
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert (view["disposition"], view["reason"], view["rule"]) == (
        "skip", "liveness_unknown", None)
    assert (view["liveness_unknown"], view["evidence"]["lease_live"]) == (
        "broker_unreachable", None)


def test_explain_on_another_database_number_says_the_queues_are_missing(
        celery_project: CeleryProject, processes: Processes, markers: Markers,
        tmp_path: Path) -> None:
    """Issue 41, finding 1, as it was seen: the broker URL names the app's Redis but
    another database number, which answers and holds keys (another app's), but none of
    the app's queues. ``jobs explain`` of a task its live worker runs says liveness
    unknown (``queues_missing``), as every pass does, never that its worker is alive
    (``lease_live``, rule 3, ``evidence.lease_live: true``)."""
    import redis  # noqa: PLC0415 - celery[redis] is installed with the tests

    result, _ = started(celery_project, processes, markers, "idem.work")
    wrong = on_database(celery_project.broker_url, 3)
    redis.Redis.from_url(wrong).set("another-app:session", "x")
    settings = tmp_path / "reconciler.toml"
    settings.write_text(f"""
database_url = "{celery_project.database_url}"
[source]
kind = "celery"
broker_url = "{wrong}"
result_table = "{celery_project.table}"
""")
    done = run_main(["jobs", "explain", result.id, "--json", "--config", str(settings)],
                    timeout=120)
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert (view["disposition"], view["reason"], view["rule"], view["liveness_unknown"]) \
        == ("skip", "liveness_unknown", None, "queues_missing")
    assert view["evidence"]["lease_live"] is None
    done = run_main(["jobs", "explain", result.id, "--config", str(settings)], timeout=120)
    assert done.returncode == 0, done.stderr
    assert "liveness unknown (queues_missing)" in done.stdout, done.stdout
    assert "lease_live" not in done.stdout.splitlines()[0], done.stdout
