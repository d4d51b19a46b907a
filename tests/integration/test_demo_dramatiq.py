"""``reconciler demo --source dramatiq``: a real ``dramatiq`` worker killed mid-message, its
messages recovered, over a redis-server and a SQLite file the demo starts and makes
itself."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.helpers import demo_process

pytestmark = pytest.mark.integration


def demo(*blocked: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    """The dramatiq demo in a process of its own (``demo_process``)."""
    return demo_process("dramatiq", *blocked, path=path)


def test_the_killed_workers_messages_are_recovered_the_dramatiq_way() -> None:
    """The idempotent message is resumed and a new worker finishes it on its second
    attempt; the effectful one is dead-lettered, and its result raises our reason."""
    if shutil.which("redis-server") is None:
        pytest.skip("apt-get install -y redis-server")
    pytest.importorskip("dramatiq", reason="pip install -e '.[test]'")
    done = demo()
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "SIGKILLed mid-message" in out
    assert "resume (resumed_idempotent_step)" in out
    assert "terminalize (worker_died_mid_step)" in out
    assert "get_result() = 'done on attempt 2'" in out
    assert "get_result() raises ResultFailure" in out


@pytest.mark.parametrize(("blocked", "path", "named"), [
    (("dramatiq",), None, "dramatiq"),
    ((), "/nonexistent", "redis-server"),
])
def test_without_dramatiq_or_redis_it_says_so_in_one_line_and_exits_2(
        blocked: tuple[str, ...], path: str | None, named: str) -> None:
    """One line naming what is missing; no traceback."""
    done = demo(*blocked, path=path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert named in lines[0]
    assert "Traceback" not in done.stderr
