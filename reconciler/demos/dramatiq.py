"""``reconciler demo --source dramatiq``: a real ``dramatiq`` worker is SIGKILLed in the
middle of two messages, and the reconciler recovers them the Dramatiq way.

A throwaway redis-server (started here on a free port, stopped at the end) is the app's
broker; a fresh SQLite file holds the reconciler's tables. Two messages are sent through
Dramatiq, a worker (one process, two threads, with the reconciler's middleware) starts
both, and the whole worker is killed. Nothing is faked: the reconciler sees the worker's
heartbeat stand still on Redis's clock for ``session_timeout_seconds``, then resumes the
idempotent message onto its queue (``retries`` + 1; a new worker finishes it) and
dead-letters the effectful one with our reason, so ``message.get_result()`` raises it,
where Dramatiq's own maintenance would have run both again a minute later.

Without redis-server or dramatiq (``pip install 'stale-claim-reconciler[dramatiq]'``) it
says so in one line and exits 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from reconciler.demos.support import (
    demo_config,
    kill_tree,
    pass_until_decided,
    run_over_redis,
    say,
    wait,
)
from reconciler.root.migrations import migrate

APP = "reconciler.demos.dramatiq_app"
SESSION_TIMEOUT_SECONDS = 2.0
# A report is safe to run again; every other message is effectful (the default).
KINDS = {"render": {"effect": "idempotent"}}


def run_dramatiq_demo() -> int:
    """The demo; 0 when the killed worker's messages were recovered as the table says."""
    return run_over_redis("Dramatiq", ("dramatiq", "redis"), "dramatiq", "Dramatiq's broker",
                          _demo)


def _demo(path: Path, redis_url: str) -> int:
    os.environ["DRAMATIQ_REDIS_URL"] = redis_url
    from dramatiq.results import ResultFailure  # noqa: PLC0415 - optional, checked above

    from reconciler.demos import dramatiq_app  # noqa: PLC0415 - imports dramatiq

    url = f"sqlite:///{path}"
    config = demo_config(source={"kind": "dramatiq", "redis_url": redis_url}, kinds=KINDS,
                         database_url=url, session_timeout_seconds=SESSION_TIMEOUT_SECONDS,
                         session_heartbeat_seconds=0.5, stale_after_seconds=1.0)
    migrate(config)
    say(f"redis-server at {redis_url} is the app's Dramatiq broker; the reconciler's tables "
        "are in a SQLite file")
    client = dramatiq_app.broker.client
    render, charge = dramatiq_app.render.send(), dramatiq_app.charge.send()
    say(f"sent {render.message_id} (render, configured idempotent) and {charge.message_id} "
        "(charge, effectful by default)")
    first = _worker(redis_url)
    second: subprocess.Popen[bytes] | None = None
    try:
        wait(lambda: client.hlen("dramatiq:__reconciler__.marks") == 2,
             "the worker to start both messages")
        kill_tree(first)
        say("the dramatiq worker (its main and worker processes) SIGKILLed mid-message: "
            "both messages stay in its acks sets, marked started by the middleware")
        if not pass_until_decided(config, {render.message_id, charge.message_id},
                                  f"its heartbeat still for {SESSION_TIMEOUT_SECONDS:g} s "
                                  "of Redis's clock", noun="message"):
            return 1
        second = _worker(redis_url)
        done = _result(render, 60)
        say(f"a new worker finished {render.message_id}: get_result() = {done!r}")
        try:
            _result(charge, 5)
        except ResultFailure as failure:
            say(f"{charge.message_id}: get_result() raises {type(failure).__name__}: "
                f"{str(failure)[:80]!r}; it waits in the payments dead-letter queue")
            return 0 if "worker_died_mid_step" in str(failure) else 1
        return 1
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                kill_tree(process)


def _result(message: Any, seconds: float) -> Any:
    """The message's result, read every 0.2 s: a blocking read (``block=True``) outlasts
    redis-py's default socket timeout (5 s) and fails on a slow machine."""
    from dramatiq.results import ResultMissing  # noqa: PLC0415 - optional, checked first

    deadline = time.monotonic() + seconds
    while True:
        try:
            return message.get_result()
        except ResultMissing:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _worker(redis_url: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "dramatiq", APP, "--processes", "1", "--threads", "2"]
    env = {**os.environ, "DRAMATIQ_REDIS_URL": redis_url}
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
