"""The actors the ``reconciler demo --source dramatiq`` workers run, on a ``RedisBroker``
at ``DRAMATIQ_REDIS_URL`` with the Results middleware and the reconciler's middleware
added last, as an app adds them (docs/sources.md).

Each hangs on its first attempt (so the demo can SIGKILL its worker mid-message) and
returns at once on a later one (its attempt is Dramatiq's ``retries`` + 1).
"""

from __future__ import annotations

import os
import time

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import CurrentMessage
from dramatiq.results import Results
from dramatiq.results.backends import RedisBackend

from reconciler.integrations.dramatiq import ReconcilerMiddleware

broker = RedisBroker(  # type: ignore[no-untyped-call]
    url=os.environ.get("DRAMATIQ_REDIS_URL", "redis://127.0.0.1:6379/0"))
broker.add_middleware(CurrentMessage())
broker.add_middleware(Results(  # type: ignore[no-untyped-call]
    backend=RedisBackend(client=broker.client)))
broker.add_middleware(ReconcilerMiddleware())
dramatiq.set_broker(broker)


def _work() -> str:
    message = CurrentMessage.get_current_message()
    attempt = 1 if message is None else int(message.options.get("retries", 0)) + 1
    if attempt == 1:
        time.sleep(3600)
    return f"done on attempt {attempt}"


@dramatiq.actor(queue_name="reports", store_results=True)
def render() -> str:
    """Configured idempotent in the demo: resumed."""
    return _work()


@dramatiq.actor(queue_name="payments", store_results=True)
def charge() -> str:
    """Configured by nobody, so effectful: dead-lettered, never run twice."""
    return _work()
