"""The Dramatiq app of the source tests, run by real ``dramatiq`` worker processes
(``dramatiq_support``): a ``RedisBroker`` on ``DRAMATIQ_REDIS_URL`` with Dramatiq's default
middleware, its Results middleware on the same Redis, and the reconciler's middleware
added last, as docs/sources.md says (left out where ``DRAMATIQ_NO_RECONCILER`` is set: an
app that has not added it).

Each actor writes marker files as it goes (``<message id>-started-<attempt>``, then
``<message id>-done-<attempt>``; the attempt is Dramatiq's ``retries`` + 1; and
``run-<message id>-<pid>-<ns>`` for each run, two runs in one process included) into
``SOURCES_MARKERS`` and sleeps ``hang[attempt - 1]`` seconds between (default: the first
attempt, an hour). ``poison`` SIGKILLs its own worker process, as an input that runs it
out of memory would.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from pathlib import Path

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import CurrentMessage
from dramatiq.results import Results
from dramatiq.results.backends import RedisBackend

from reconciler.integrations.dramatiq import ReconcilerMiddleware
from reconciler.ledger import Step, StepLedger

PR_SET_PDEATHSIG = 1
if os.environ.get("SOURCES_MARKERS"):
    # In a worker process (forked by the dramatiq main process the test started): it dies
    # with its main process, as in a container, so a test's teardown leaves no worker
    # consuming the next test's messages.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

broker = RedisBroker(url=os.environ.get("DRAMATIQ_REDIS_URL", "redis://127.0.0.1:6379/0"))
broker.add_middleware(CurrentMessage())
broker.add_middleware(Results(backend=RedisBackend(client=broker.client)))
if not os.environ.get("DRAMATIQ_NO_RECONCILER"):
    broker.add_middleware(ReconcilerMiddleware())
dramatiq.set_broker(broker)


def _work(hang: list[float] | None) -> str:
    message = CurrentMessage.get_current_message()
    assert message is not None
    attempt = int(message.options.get("retries", 0)) + 1
    folder = Path(os.environ["SOURCES_MARKERS"])
    (folder / f"{message.message_id}-started-{attempt}").write_text(str(os.getpid()))
    # One more per run, whatever its attempt (an operator's retry starts the count again).
    (folder / f"run-{message.message_id}-{os.getpid()}-{time.monotonic_ns()}").write_text("")
    seconds = [3600.0] if hang is None else hang
    if attempt - 1 < len(seconds):
        time.sleep(seconds[attempt - 1])
    (folder / f"{message.message_id}-done-{attempt}").write_text(str(os.getpid()))
    return f"done on attempt {attempt}"


@dramatiq.actor(max_retries=3, store_results=True)
def idem_work(hang: list[float] | None = None) -> str:
    """Idempotent (``[kinds]`` say so): safe to run again from the start."""
    return _work(hang)


@dramatiq.actor(max_retries=3, store_results=True)
def effect_work(hang: list[float] | None = None) -> str:
    """Effectful: a run of unknown progress is never repeated."""
    return _work(hang)


@dramatiq.actor(max_retries=3, store_results=True)
def effect_once(hang: list[float] | None = None) -> str:
    """Effectful, and hangs (``hang``) on a message's first run only: a later run (an
    operator's retry starts the attempts again, so ``effect_work`` would hang again) ends."""
    message = CurrentMessage.get_current_message()
    assert message is not None
    ran = any(Path(os.environ["SOURCES_MARKERS"]).glob(f"run-{message.message_id}-*"))
    return _work([] if ran else hang)


@dramatiq.actor(max_retries=10)
def idem_poison() -> None:
    """Idempotent, and kills whichever worker process runs it."""
    message = CurrentMessage.get_current_message()
    assert message is not None
    attempt = int(message.options.get("retries", 0)) + 1
    folder = Path(os.environ["SOURCES_MARKERS"])
    (folder / f"{message.message_id}-started-{attempt}").write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)


PLAN = [Step("fetch", "idempotent"), Step("charge", "effectful"),
        Step("notify", "idempotent")]


@dramatiq.actor(max_retries=3, store_results=True)
def ledger_charge(hang: str = "") -> str:
    """Three steps recorded in the reconciler's step ledger (``RECONCILER_DATABASE_URL``);
    the first attempt hangs where ``hang`` says (``between``: after ``fetch``)."""
    message = CurrentMessage.get_current_message()
    assert message is not None
    attempt = int(message.options.get("retries", 0)) + 1
    folder = Path(os.environ["SOURCES_MARKERS"])
    with StepLedger(os.environ["RECONCILER_DATABASE_URL"]) as ledger:
        run = ledger.run("dramatiq", message.message_id, attempt, PLAN)
        for index in run.pending():
            name = PLAN[index].step_name
            with run.step(index):
                (folder / f"{message.message_id}-step-{name}-{attempt}").write_text("")
                if attempt == 1 and hang == name:
                    time.sleep(3600)
            if attempt == 1 and hang == "between" and name == "fetch":
                (folder / f"{message.message_id}-between-{attempt}").write_text("")
                time.sleep(3600)
    return f"done on attempt {attempt}"
