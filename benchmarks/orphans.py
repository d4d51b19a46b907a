"""A worker process for ``--measure time_to_recovery``: it claims jobs and dies holding them.

    python -m benchmarks.orphans DATABASE_URL WORKER_NAME COUNT

Like a real worker it registers a session and renews it from a thread, and claims with its
lease (``lease_seconds`` of the settings in its environment: the worker default). It dies
before starting a step (one write per job keeps the claim phase short beside the lease).
Once it holds its share it prints ``ready <claimed>`` and waits for the benchmark's
SIGKILL. Nothing here handles a signal: its death leaves exactly what a dead worker leaves.
"""

from __future__ import annotations

import os
import socket
import sys
import threading

from reconciler.settings import load_settings
from reconciler.worker import JobClient


def main(argv: list[str]) -> int:
    """Claim up to COUNT jobs, say how many, then hold them until killed."""
    url, name, count = argv[0], argv[1], int(argv[2])
    settings = load_settings(database_url=url)
    client = JobClient(url, settings=settings)
    store = client.store
    session = store.register_session(name, socket.gethostname(), os.getpid())
    never = threading.Event()

    def beat() -> None:
        while not never.wait(settings.session_heartbeat_seconds):
            try:
                store.heartbeat_session(session)
            except Exception as exc:  # a busy database: the session has slack, beat again
                print(f"session heartbeat failed: {type(exc).__name__}", file=sys.stderr)

    threading.Thread(target=beat, daemon=True, name="session-heartbeat").start()
    claimed = 0
    while claimed < count and client.claim(name, session_id=session) is not None:
        claimed += 1
    print(f"ready {claimed}", flush=True)
    never.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
