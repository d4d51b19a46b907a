"""A worker process for ``--measure time_to_recovery``: it claims jobs and dies holding them.

    python -m benchmarks.orphans DATABASE_URL WORKER_NAME COUNT LEASE_SECONDS

Like a real worker it registers a session and renews it from a thread (every
``session_heartbeat_seconds`` of the settings in its environment), then claims its share.
A live worker renews each claim's lease every third of it; thousands of claims cannot be
renewed that way here, so the claims are taken under a lease long enough to outlast the
claim phase, and the worker's death is noticed as a real one is noticed first: its session
falls silent. It dies before starting a step. Once it holds its share it prints
``ready <claimed>`` and waits for the benchmark's SIGKILL; nothing here handles a signal,
so its death leaves exactly what a dead worker leaves.
"""

from __future__ import annotations

import os
import socket
import sys
import threading

from reconciler.config.settings import load_settings
from reconciler.worker import JobClient


def main(argv: list[str]) -> int:
    """Claim up to COUNT jobs, say how many, then hold them until killed."""
    url, name, count, lease_seconds = argv[0], argv[1], int(argv[2]), float(argv[3])
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
    while (claimed < count
           and client.claim(name, lease_seconds, session_id=session) is not None):
        claimed += 1
    print(f"ready {claimed}", flush=True)
    never.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
