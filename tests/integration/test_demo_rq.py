"""``reconciler demo --source rq``: real ``rq worker``s killed, their jobs recovered by one
pass, over a redis-server and a SQLite file the demo starts and makes itself."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.integration

DEMO = ["reconciler", "demo", "--source", "rq"]


def demo(*blocked: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    """The demo in a process of its own, with ``blocked`` packages made unimportable."""
    body = (f"import sys; sys.modules.update(dict.fromkeys({list(blocked)!r})); "
            f"sys.argv = {DEMO!r}; from reconciler.cli import main; sys.exit(main())")
    env = {**os.environ, **({"PATH": path} if path is not None else {})}
    return subprocess.run([sys.executable, "-c", body], capture_output=True, text=True,
                          timeout=240, check=False, env=env)


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
