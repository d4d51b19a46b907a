"""The actors of the dramatiq chaos run, on a ``RedisBroker`` at ``DRAMATIQ_REDIS_URL``
with the reconciler's middleware added last (``dramatiq_worker`` runs them).

Each message carries ``max_retries = budget - 1`` and ``budget`` among its keyword
arguments; its attempt is Dramatiq's ``retries`` + 1 (a resume counts one). Each writes
``<message>-started-<attempt>`` before its work and ``<message>-done-<attempt>`` after it
(``SOURCES_MARKERS``; the pid is the worker process's own), sleeping ``hang[attempt - 1]``
seconds in between.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import CurrentMessage

from reconciler.integrations.dramatiq import ReconcilerMiddleware

broker = RedisBroker(url=os.environ.get("DRAMATIQ_REDIS_URL", "redis://127.0.0.1:6379/0"))
broker.add_middleware(CurrentMessage())
broker.add_middleware(ReconcilerMiddleware())
dramatiq.set_broker(broker)
QUEUE = "chaos"


def _work(hang: list[float], budget: int) -> str:
    message = CurrentMessage.get_current_message()
    assert message is not None
    attempt = int(message.options.get("retries", 0)) + 1
    markers = Path(os.environ["SOURCES_MARKERS"])
    (markers / f"{message.message_id}-started-{attempt}").write_text(str(os.getpid()))
    if attempt - 1 < len(hang):
        time.sleep(hang[attempt - 1])
    (markers / f"{message.message_id}-done-{attempt}").write_text(str(os.getpid()))
    return f"done on attempt {attempt}"


@dramatiq.actor(queue_name=QUEUE)
def idem_work(hang: list[float], budget: int) -> str:
    return _work(hang, budget)


@dramatiq.actor(queue_name=QUEUE)
def pure_work(hang: list[float], budget: int) -> str:
    return _work(hang, budget)


@dramatiq.actor(queue_name=QUEUE)
def effect_work(hang: list[float], budget: int) -> str:
    return _work(hang, budget)
