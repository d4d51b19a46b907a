"""The Procrastinate app the ``reconciler demo --source procrastinate`` worker runs.

Run as ``python -m reconciler.demos.procrastinate_app`` with ``DEMO_PG_CONNINFO`` (libpq)
set: one Procrastinate worker with a fast heartbeat. Each task hangs on its first attempt
(so the demo can SIGKILL the worker mid-task) and returns at once on a later one.
"""

from __future__ import annotations

import os
import time

from procrastinate import App, JobContext, PsycopgConnector

HEARTBEAT_SECONDS = 0.3
TASKS = ("reports.render", "payments.charge")
"""An idempotent kind (resumed) and one nobody configured (effectful: failed, not rerun)."""

app = App(connector=PsycopgConnector(conninfo=os.environ.get("DEMO_PG_CONNINFO", "")))


def work(context: JobContext) -> None:
    """Hang on the first attempt; finish on a later one."""
    if context.job.attempts == 0:
        time.sleep(3600)


for task_name in TASKS:
    app.task(name=task_name, pass_context=True)(work)


def main() -> None:
    """One worker taking both jobs at once, heartbeating every 0.3 s."""
    app.run_worker(concurrency=len(TASKS), wait=True, fetch_job_polling_interval=0.1,
                   update_heartbeat_interval=HEARTBEAT_SECONDS, listen_notify=False)


if __name__ == "__main__":
    main()
