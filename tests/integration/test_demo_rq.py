"""``reconciler demo --source rq``: real ``rq worker``s killed, their jobs recovered by one
pass, over a redis-server and a SQLite file the demo starts and makes itself."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from tests.helpers import demo_process

pytestmark = pytest.mark.integration


def demo(*blocked: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    """The rq demo in a process of its own (``demo_process``)."""
    return demo_process("rq", *blocked, path=path)


def test_the_killed_workers_jobs_are_recovered_the_rq_way() -> None:
    """RQ's own cleanup in the new worker leaves both; the idempotent job is resumed and the
    new worker finishes it on its second attempt; the effectful one is failed with our
    reason, read through ``Job.fetch``; and the demo does not wait out RQ's minute."""
    if shutil.which("redis-server") is None:
        pytest.skip("apt-get install -y redis-server")
    pytest.importorskip("rq", reason="pip install -e '.[test]'")
    started = time.monotonic()
    done = demo()
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "both rq workers (and their work horses) SIGKILLed mid-job" in out
    assert "left both: 'started', 'started' (not expired yet)" in out
    assert "resume (resumed_idempotent_step)" in out
    assert "terminalize (worker_died_mid_step)" in out
    assert "return_value() = 'done on attempt 2'" in out
    assert "get_status() = 'failed', latest_result(): " in out
    assert "worker_died_mid_step" in out.rsplit("latest_result(): ", 1)[1]
    assert seconds < 50, f"the demo took {seconds:.0f} s: did it wait out RQ's expiry?"


@pytest.mark.parametrize(("blocked", "path", "named"), [
    (("rq",), None, "rq"),
    ((), "/nonexistent", "redis-server"),
])
def test_without_rq_or_redis_it_says_so_in_one_line_and_exits_2(
        blocked: tuple[str, ...], path: str | None, named: str) -> None:
    """One line naming what is missing; no traceback."""
    done = demo(*blocked, path=path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert named in lines[0]
    assert "Traceback" not in done.stderr
