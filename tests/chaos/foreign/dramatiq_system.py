"""Dramatiq in the foreign chaos runs: a redis-server of the run's own (append-only, fsynced
at every write), one-process Dramatiq workers (``dramatiq_worker``: Dramatiq's own
``Worker``, one thread, its default prefetch, the reconciler's middleware), messages sent
through Dramatiq's ``send_with_options`` with ``max_retries = budget - 1`` and a delay
(``dramatiq_chaos_app``), so they become runnable spread over the fault phase.

Nothing is compressed: a dead worker's heartbeat stands still from its death, and the
replicas decide once they have seen it still for ``SESSION_TIMEOUT_SECONDS`` of Redis's
clock; Dramatiq's own maintenance would put its messages back only after its default
``heartbeat_timeout`` (60 s), past the run. A message acknowledged is deleted by Dramatiq,
so a message found nowhere is one a worker completed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.chaos.foreign.database import Database
from tests.chaos.foreign.processes import die_with_parent
from tests.chaos.foreign.python_systems import REDIS_HINT, _free_port, stop_redis
from tests.chaos.foreign.systems import JobSpec, JobState, SystemBase, UnavailableError

SESSION_TIMEOUT_SECONDS = 2.0
"""A live worker sends a broker command at least every 100 ms (``worker_timeout``, its
delay queue's polls while its thread is busy): two seconds of stillness is a dead or
stopped one, with room for a loaded machine."""
STATES = {"queued": "queued", "delayed": "queued", "fetched": "queued",
          "started": "running", "finished": "running", "dead": "failed"}


class Dramatiq(SystemBase):
    """Dramatiq 2.x over Redis: attempts ``retries + 1``; an acknowledgement of a message no
    longer in its worker's acks set deletes nothing (a late finish is refused)."""

    name = "dramatiq"
    completion_fenced = True

    def __init__(self) -> None:
        self.reclaim_after_seconds = SESSION_TIMEOUT_SECONDS + 1.0
        self.redis: subprocess.Popen[bytes] | None = None
        self.redis_dir: Path | None = None
        self.url = ""
        self.port = 0

    def prepare(self, db: Database) -> None:
        if shutil.which("redis-server") is None:
            raise UnavailableError(REDIS_HINT.replace("Celery", "Dramatiq"))
        try:
            import dramatiq  # noqa: F401, PLC0415 - only a presence check
        except ImportError as exc:
            raise UnavailableError("dramatiq is not installed: pip install -e '.[test]'"
                                   ) from exc
        self.redis_dir = Path(tempfile.mkdtemp(prefix="chaos-dramatiq-redis-"))
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        binary = shutil.which("redis-server")
        assert binary is not None
        self.redis = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.redis_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent)  # noqa: PLW1509 - started from the main thread
        deadline = time.monotonic() + 20
        while not self._ping():
            if time.monotonic() > deadline or self.redis.poll() is not None:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def _client(self) -> Any:
        import redis  # noqa: PLC0415 - optional (with dramatiq)

        return redis.Redis.from_url(self.url)

    def _ping(self) -> bool:
        import redis  # noqa: PLC0415 - optional (with dramatiq)

        try:
            return bool(self._client().ping())
        except (redis.ConnectionError, redis.exceptions.BusyLoadingError):
            return False

    def close(self) -> None:
        stop_redis(self.redis, self.redis_dir)

    def source_table(self) -> dict[str, str]:
        return {"redis_url": self.url}

    def settings(self) -> dict[str, float]:
        return {"session_timeout_seconds": SESSION_TIMEOUT_SECONDS}

    def kind_rule(self) -> dict[str, float]:
        return {}  # each message's budget is its own max_retries

    def kind_pattern(self, pattern: str) -> str:
        return pattern.replace(".", "_")  # idem.* is the actor idem_*

    def enqueue(self, db: Database, jobs: Sequence[JobSpec]) -> list[str]:
        import os  # noqa: PLC0415

        os.environ["DRAMATIQ_REDIS_URL"] = self.url
        from tests.chaos.foreign import dramatiq_chaos_app as app  # noqa: PLC0415

        ids = []
        for spec in jobs:
            actor = getattr(app, spec.kind.replace(".", "_"))
            message = actor.send_with_options(
                kwargs={"hang": list(spec.hang), "budget": spec.max_attempts},
                delay=int(spec.delay_seconds * 1000), max_retries=spec.max_attempts - 1)
            ids.append(message.message_id)
        return ids

    def worker_command(self, db: Database, markers: Path, slot: int = 0
                       ) -> tuple[list[str], dict[str, str]]:
        return ([sys.executable, "-m", "tests.chaos.foreign.dramatiq_worker"],
                {"SOURCES_MARKERS": str(markers), "DRAMATIQ_REDIS_URL": self.url})

    def used_of(self, marker_attempt: int) -> int:
        return marker_attempt

    def states(self, db: Database, specs: Mapping[str, JobSpec]) -> dict[str, JobState]:
        from reconciler.sources.dramatiq.config import DramatiqConfig  # noqa: PLC0415
        from reconciler.sources.dramatiq.keys import Keys  # noqa: PLC0415
        from reconciler.sources.dramatiq.listing import (  # noqa: PLC0415
            stored_messages,
            watched_stores,
        )
        from reconciler.sources.dramatiq.snapshot import read_message  # noqa: PLC0415

        client, keys = self._client(), Keys("dramatiq")
        config = DramatiqConfig(redis_url=self.url)
        found: dict[str, JobState] = {}
        for status, _, redis_id, data, _, _ in stored_messages(
                client, keys, watched_stores(client, keys, config)):
            message = read_message(data, redis_id)
            if message is None or message.job_id not in specs:
                continue
            state = STATES[status]
            ran = state in ("running", "failed")
            found[message.job_id] = JobState(state, message.retries + (1 if ran else 0),
                                             specs[message.job_id].max_attempts)
        return {job: found.get(job, JobState("completed", None, spec.max_attempts))
                for job, spec in specs.items()}
