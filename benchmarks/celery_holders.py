"""Real Celery workers holding the benchmark's running tasks, as a worker holds what it
runs and what it prefetched: the celery source judges a task live only while a worker
process holds it (reconciler/sources/celery/holders.py), so the rows the benchmark writes
``STARTED`` are held by real workers of the test app (tests/sources/celery_app.py).

Each worker runs a thread pool of one with a prefetch as large as its share: one task
runs (``conformance.hold``, which holds while its key is in Redis), every other one waits
reserved in the worker's process, and Celery's own ``query_task`` lists them all.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.foreign_base import REPO

HOLD_PREFIX = "conformance:hold:"  # tests/sources/celery_app.py's
QUEUE_SUFFIX = "-held"


def start_holding(stack: contextlib.ExitStack, broker_url: str, hostname: str,
                  task_ids: list[str], folder: Path) -> subprocess.Popen[bytes]:
    """A worker named ``hostname`` holding every one of ``task_ids`` (sent to a queue of
    its own with those ids); returns once Celery's ``query_task`` says it holds them."""
    import redis  # noqa: PLC0415 - optional, with celery[redis]
    from celery import Celery  # noqa: PLC0415 - optional

    queue = hostname.split("@", maxsplit=1)[0] + QUEUE_SUFFIX
    client = redis.Redis.from_url(broker_url)
    with client.pipeline(transaction=False) as pipe:
        for task_id in task_ids:
            pipe.set(HOLD_PREFIX + task_id, 1)
        pipe.execute()
    sender = Celery("bench-holder", broker=broker_url, set_as_current=False)
    sender.conf.update(task_serializer="json")
    with contextlib.closing(sender), sender.producer_or_acquire() as producer:
        for task_id in task_ids:
            sender.send_task("conformance.hold", task_id=task_id, queue=queue,
                             producer=producer)
    log = stack.enter_context((folder / f"{hostname}.log").open("ab"))
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.sources.celery_app", "worker",
         "--pool=threads", "--concurrency=1", f"--prefetch-multiplier={len(task_ids) + 1}",
         f"--hostname={hostname}", "--without-mingle", "--without-gossip", "-Q", queue,
         "--loglevel=WARNING"],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        env={**os.environ, "SOURCES_BROKER_URL": broker_url, "SOURCES_MARKERS": str(folder)})
    deadline = time.monotonic() + 300
    while _held_count(broker_url, hostname, task_ids) < len(task_ids):
        if time.monotonic() > deadline or worker.poll() is not None:
            worker.kill()
            raise RuntimeError(f"{hostname} never held its {len(task_ids)} tasks: "
                               f"{(folder / f'{hostname}.log').read_text()[-800:]}")
        time.sleep(0.5)
    return worker


def _held_count(broker_url: str, hostname: str, task_ids: list[str]) -> int:
    """How many of ``task_ids`` the worker says it holds (Celery's own ``query_task``)."""
    from celery import Celery  # noqa: PLC0415 - optional

    app = Celery("bench-probe", broker=broker_url, set_as_current=False)
    with contextlib.closing(app):
        replies = app.control.broadcast("query_task", arguments={"ids": task_ids},
                                        destination=[hostname], reply=True, timeout=2.0)
    return sum(len(tasks) for reply in replies or [] for tasks in reply.values()
               if isinstance(tasks, dict))
