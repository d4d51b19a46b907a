"""End to end with a real Prometheus: it scrapes ``reconciler run`` and sees a resume.

Debian's ``prometheus`` package provides the server. Without it the test is skipped, except
under ``CI=true``, where a missing server is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from reconciler.storage.engines import create_engine
from reconciler.storage.schema import upgrade
from tests.integration.test_service import (
    RESUMED_FROM_UNSTARTED,
    Launcher,
    crash_a_worker,
    enqueue_job,
    free_port,
    http_get,
    wait_until,
)

SCRAPE_INTERVAL = "1s"
RESUME_QUERY = 'reconciler_decisions_total{disposition="resume"}'
INSTALL_HINT = "Prometheus not found: on Debian/Ubuntu run `apt-get install -y prometheus`"


def prometheus_binary() -> str:
    found = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None)
    if found is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {INSTALL_HINT}", pytrace=False)
        pytest.skip(INSTALL_HINT)
    return found


@dataclass
class Prometheus:
    """A Prometheus server on loopback, queried through its HTTP API."""

    popen: subprocess.Popen[bytes]
    port: int
    log_path: Path

    def query(self, promql: str) -> list[dict[str, Any]]:
        status, body = http_get(self.port,
                                "/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        assert status == 200, body
        answer = json.loads(body)
        assert answer["status"] == "success", answer
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result


@pytest.fixture
def reconciler_db(tmp_path: Path) -> str:
    """A migrated SQLite database (one engine is enough end to end)."""
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    engine = create_engine(url)
    upgrade(engine)
    engine.dispose()
    return url


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    """Start reconciler processes; any left running at teardown are killed."""
    started = Launcher(tmp_path)
    try:
        yield started
    finally:
        started.close()


@pytest.fixture
def start_prometheus(tmp_path: Path) -> Iterator[Callable[[int], Prometheus]]:
    """Start Prometheus scraping a target every second; it is killed at teardown."""
    binary = prometheus_binary()
    servers: list[subprocess.Popen[bytes]] = []

    def start(target_port: int) -> Prometheus:
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n"
            f"  scrape_interval: {SCRAPE_INTERVAL}\n"
            f"  evaluation_interval: {SCRAPE_INTERVAL}\n"
            "scrape_configs:\n"
            "  - job_name: reconciler\n"
            "    static_configs:\n"
            f"      - targets: ['127.0.0.1:{target_port}']\n"
        )
        for attempt in range(3):  # the free port can be taken before Prometheus binds it
            port = free_port()
            log_path = tmp_path / f"prometheus-{attempt}.log"
            with log_path.open("wb") as log:
                popen = subprocess.Popen(
                    [binary, f"--config.file={config}",
                     f"--storage.tsdb.path={tmp_path / f'tsdb-{attempt}'}",
                     f"--web.listen-address=127.0.0.1:{port}"],
                    cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                )
            servers.append(popen)
            server = Prometheus(popen, port, log_path)

            def ready(server: Prometheus = server) -> bool:
                if server.popen.poll() is not None:
                    return True
                try:
                    return http_get(server.port, "/-/ready", timeout=1)[0] == 200
                except OSError:
                    return False

            wait_until(ready, "Prometheus to be ready", timeout=30, every=0.1)
            if popen.poll() is None:
                return server
        pytest.fail(f"Prometheus did not start:\n{log_path.read_text()[-3000:]}")

    try:
        yield start
    finally:
        for popen in servers:
            if popen.poll() is None:
                popen.terminate()
                try:
                    popen.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    popen.kill()
                    popen.wait(timeout=10)


def resumes_in(result: list[dict[str, Any]]) -> float:
    """How many resumes for resumed_from_unstarted_step a query result shows."""
    return sum(float(series["value"][1]) for series in result
               if series["metric"].get("reason") == RESUMED_FROM_UNSTARTED["reason"])


def test_prometheus_sees_the_resume_of_a_crashed_workers_job(
    reconciler_db: str, launcher: Launcher, start_prometheus: Callable[[int], Prometheus]
) -> None:
    """A real Prometheus scraping `reconciler run` on loopback shows
    reconciler_decisions_total{disposition="resume"} go to 1 after a worker is SIGKILLed."""
    reconciler = launcher.start(reconciler_db)
    prometheus = start_prometheus(reconciler.port)
    # Scraping works before the crash: the zero-valued resume series are already there.
    wait_until(lambda: prometheus.query('up{job="reconciler"}') and prometheus.query(
        RESUME_QUERY), "Prometheus to scrape the reconciler", timeout=30, every=0.2)
    assert resumes_in(prometheus.query(RESUME_QUERY)) == 0.0

    job_id = enqueue_job(reconciler_db)
    assert crash_a_worker(reconciler_db) == job_id
    killed_at = time.monotonic()
    seen: dict[str, float] = {}

    def visible() -> bool:
        if "metrics" not in seen and reconciler.metric(
                "reconciler_decisions_total", **RESUMED_FROM_UNSTARTED) == 1.0:
            seen["metrics"] = time.monotonic() - killed_at
        if resumes_in(prometheus.query(RESUME_QUERY)) == 1.0:
            seen["prometheus"] = time.monotonic() - killed_at
        return "prometheus" in seen

    wait_until(visible, "Prometheus to show the resume", timeout=30, every=0.1)
    print(f"\nSIGKILL -> resume in the reconciler's /metrics: {seen.get('metrics', -1):.2f}s; "
          f"-> visible in Prometheus: {seen['prometheus']:.2f}s (worker lease 0.5s, "
          f"pass interval 0.3s, scrape interval {SCRAPE_INTERVAL})")
    up = prometheus.query('up{job="reconciler"}')
    assert [float(series["value"][1]) for series in up] == [1.0]
