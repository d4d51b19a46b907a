"""Real Dramatiq over a real Redis for the source tests: ``dramatiq`` worker processes
(its CLI: a main process and one worker process, its default threads and prefetch unless
a test says otherwise) running the tests' own actors (tests/sources/dramatiq_app.py),
messages sent through Dramatiq's own ``Actor.send``.

``redis_url`` (tests/sources/celery_support.py): Debian's ``redis-server`` for the session,
emptied for each test. The reconciler's own tables are ``reconciler_engine``
(tests/sources/conftest.py), on SQLite and PostgreSQL. A dead worker's heartbeat stands
still from its death; the source decides once it has seen it still for
``session_timeout_seconds`` (2 s here) of Redis's clock, so a test passes until a decision
is recorded (``reconcile_until``), bounded by that event, not by a sleep.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine

from reconciler.core.kinds import KindRules
from reconciler.sources.dramatiq import DramatiqConfig
from tests.sources.celery_support import kill_worker
from tests.sources.support import (
    RECOVERY_POLL_SECONDS,
    Markers,
    Outcome,
    Process,
    Processes,
    reconcile_once,
    wait_until,
)

REPO = Path(__file__).parents[2]
APP = "tests.sources.dramatiq_app"


@dataclass(frozen=True)
class DramatiqProject:
    """The app's Redis and the reconciler's database (either engine)."""

    redis_url: str
    engine: Engine

    def config(self, **overrides: Any) -> DramatiqConfig:
        """The dramatiq source's ``[source]`` over this Redis."""
        return DramatiqConfig(**{"redis_url": self.redis_url, "session_timeout_seconds": 2.0,
                                 **overrides})

    def redis(self) -> Any:
        import redis  # noqa: PLC0415 - the tests of the dramatiq source have it

        return redis.Redis.from_url(self.redis_url)

    def app(self) -> Any:
        """The test app's module, its broker on this Redis (imported once per process:
        every test's Redis is the session's, emptied)."""
        import os  # noqa: PLC0415

        os.environ["DRAMATIQ_REDIS_URL"] = self.redis_url
        from tests.sources import dramatiq_app  # noqa: PLC0415

        return dramatiq_app

    def send(self, actor: str, **kwargs: Any) -> Any:
        """The message sent through Dramatiq's own ``Actor.send``."""
        return getattr(self.app(), actor).send(**kwargs)

    def queued(self, queue: str = "default") -> list[str]:
        """The Redis ids on the queue, in order."""
        return [m.decode() for m in self.redis().lrange(f"dramatiq:{queue}", 0, -1)]

    def dead_lettered(self, queue: str = "default") -> dict[str, dict[str, Any]]:
        """The dead-letter queue's messages, decoded, by Redis id."""
        import json  # noqa: PLC0415

        raw = self.redis().hgetall(f"dramatiq:{queue}.XQ.msgs")
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    def messages(self, queue: str = "default") -> dict[str, dict[str, Any]]:
        """The queue's stored messages, decoded, by Redis id."""
        import json  # noqa: PLC0415

        raw = self.redis().hgetall(f"dramatiq:{queue}.msgs")
        return {k.decode(): json.loads(v) for k, v in raw.items()}


def start_worker(processes: Processes, project: DramatiqProject, markers: Markers,
                 name: str, *, threads: int = 8, prefetch: int | None = None,
                 middleware: bool = True) -> Process:
    """One ``dramatiq`` worker of the app (one worker process, ``threads`` threads)."""
    env = {"SOURCES_MARKERS": str(markers.folder), "DRAMATIQ_REDIS_URL": project.redis_url,
           "RECONCILER_DATABASE_URL": project.engine.url.render_as_string(
               hide_password=False)}
    if prefetch is not None:
        env["dramatiq_queue_prefetch"] = str(prefetch)
    if not middleware:
        env["DRAMATIQ_NO_RECONCILER"] = "1"
    return processes.start(name, [sys.executable, "-m", "dramatiq", APP, "--processes", "1",
                                  "--threads", str(threads), "--path", str(REPO)],
                           env, cwd=REPO)


def wait_started(markers: Markers, message_id: str, worker: Process, attempt: int = 1,
                 timeout: float = 60) -> None:
    """Until the message's ``attempt`` started on a worker."""
    wait_until(lambda: markers.has(f"{message_id}-started-{attempt}"),
               f"message {message_id} attempt {attempt} to start", timeout=timeout,
               process=worker)


def result_after(markers: Markers, message: Any, attempt: int) -> Any:
    """The message's result once its ``attempt`` ended (its end marker first: a worker
    starting under load can outlast one blocking socket read), stored as the actor
    returns."""
    wait_until(lambda: markers.has(f"{message.message_id}-done-{attempt}"),
               f"message {message.message_id} attempt {attempt} to end", timeout=60)
    # A failure stored before this run (the reconciler's, of a message an operator then
    # retried) stays, as Dramatiq keeps one, until the run stores its own result.
    return result_of(message, replacing_a_failure=True)


def result_of(message: Any, timeout: float = 60, *, replacing_a_failure: bool = False
              ) -> Any:
    """The message's result once stored, read every 0.1 s: a blocking ``get_result``
    outlasts redis-py's default socket timeout (5 s) on a loaded machine
    (``replacing_a_failure``: a failed result read is an earlier run's, waited past)."""
    from dramatiq.results import ResultFailure, ResultMissing  # noqa: PLC0415

    found: list[Any] = []

    def stored() -> bool:
        try:
            found.append(message.get_result())
        except ResultMissing:
            return False
        except ResultFailure:
            if replacing_a_failure:
                return False
            raise
        return True

    wait_until(stored, f"message {message.message_id}'s result", timeout=timeout)
    return found[0]


def sigkill(worker: Process) -> None:
    """SIGKILL the whole worker (main and worker processes): a node lost, an OOM kill."""
    kill_worker(worker)
    wait_until(lambda: not worker.alive(), f"{worker.name} to die")


def reconcile_until(project: DramatiqProject, kinds: KindRules,
                    done: Callable[[Sequence[Outcome]], bool], what: str,
                    timeout: float = 60) -> list[Outcome]:
    """Passes one after another until one's outcomes satisfy ``done`` (a dead worker's
    heartbeat must be seen still for the session timeout first); that pass's outcomes."""
    found: list[Outcome] = []

    def passed() -> bool:
        nonlocal found
        found = reconcile_once(project.engine, project.config(), kinds)
        return done(found)

    wait_until(passed, what, timeout=timeout, every=RECOVERY_POLL_SECONDS)
    return found


@pytest.fixture
def dramatiq_project(reconciler_engine: Engine, redis_url: str) -> DramatiqProject:
    """Redis emptied, and the reconciler's database on each engine."""
    return DramatiqProject(redis_url, reconciler_engine)
