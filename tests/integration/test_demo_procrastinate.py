"""``reconciler demo --source procrastinate``: a real Procrastinate worker killed, its jobs
recovered by one pass, on a throwaway PostgreSQL the demo starts itself."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import require_pg_bin

pytestmark = pytest.mark.integration


def demo(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "reconciler.cli", "demo", "--source", "procrastinate"],
        capture_output=True, text=True, timeout=180, check=False, env={**os.environ, **env})


def test_the_killed_workers_jobs_are_recovered_the_procrastinate_way() -> None:
    """The idempotent job is retried and finished by a new worker; the effectful one is
    failed through Procrastinate's own function; both decisions are audited."""
    require_pg_bin()
    pytest.importorskip("procrastinate", reason="pip install -e '.[peers]'")
    done = demo()
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "SIGKILLed mid-task" in out
    assert "resume (resumed_idempotent_step)" in out
    assert "terminalize (worker_died_mid_step)" in out
    assert "finished job 1: succeeded; job 2 stays failed" in out
    assert "audit: 2 decisions recorded under job_source 'procrastinate'" in out


def test_without_postgresql_binaries_it_says_so_and_exits_non_zero(tmp_path) -> None:
    """One line naming what is missing; no traceback."""
    done = demo(RECONCILER_PG_BIN=str(tmp_path / "no-postgres-here"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "PostgreSQL" in lines[0]
    assert "Traceback" not in done.stderr
