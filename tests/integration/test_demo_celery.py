"""``reconciler demo --source celery``: real Celery workers killed, their tasks recovered by
one pass, over a redis-server and a SQLite file the demo starts and makes itself."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.helpers import demo_process

pytestmark = pytest.mark.integration


def demo(*blocked: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    """The celery demo in a process of its own (``demo_process``)."""
    return demo_process("celery", *blocked, path=path)


def test_the_killed_workers_tasks_are_recovered_the_celery_way() -> None:
    """The idempotent task is re-published and the caller's get() returns; the effectful
    one's get() raises WorkerLostError at once."""
    if shutil.which("redis-server") is None:
        pytest.skip("apt-get install -y redis-server")
    pytest.importorskip("celery", reason="pip install -e '.[test]'")
    done = demo()
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "both Celery workers SIGKILLed mid-task" in out
    assert "resume (resumed_idempotent_step)" in out
    assert "terminalize (worker_died_mid_step)" in out
    assert "AsyncResult.get() = 'done on attempt 2'" in out
    assert "raised at once: WorkerLostError('worker_died_mid_step' ...)" in out


@pytest.mark.parametrize(("blocked", "path", "named"), [
    (("celery",), None, "celery"),
    ((), "/nonexistent", "redis-server"),
])
def test_without_celery_or_redis_it_says_so_in_one_line_and_exits_2(
        blocked: tuple[str, ...], path: str | None, named: str) -> None:
    """One line naming what is missing; no traceback."""
    done = demo(*blocked, path=path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert named in lines[0]
    assert "Traceback" not in done.stderr
