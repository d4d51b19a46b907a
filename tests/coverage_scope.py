"""Which of the suite's subprocesses coverage measures: this project's own processes (the
CLI, ``reconciler run``, the chaos workers and replicas), not a job system's own workers.

Coverage follows every Python subprocess (``[tool.coverage.run] patch = ["subprocess"]``,
through ``COVERAGE_PROCESS_CONFIG`` in the environment). This project's code runs in a
Celery, RQ, Django or Procrastinate worker only through the step ledger, which its own
tests measure in process; tracing those interpreters from start to kill cost the source
tests a third more CPU. The chaos runs' processes are left out too: every one ends by
SIGKILL (or ``os._exit`` in the fork server's children), so coverage never saves what it
traced in them, and tracing them cost a chaos run a quarter more CPU.
"""

from __future__ import annotations

COVERAGE_ENV = "COVERAGE_PROCESS_CONFIG"


def unmeasured(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a job system's own worker: coverage left out."""
    return {k: v for k, v in env.items() if k != COVERAGE_ENV}
