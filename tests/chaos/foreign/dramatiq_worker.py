"""One Dramatiq worker in one process (``python -m tests.chaos.foreign.dramatiq_worker``):
Dramatiq's own ``Worker`` over the chaos app's broker, one thread, its default prefetch,
so the pid a marker names is the process the run kills or stops (the ``dramatiq`` command
forks its workers from a main process; a stop of that main process would stop no actor).
SIGTERM stops it as the command's workers stop."""

from __future__ import annotations

import signal
import threading

import dramatiq

from tests.chaos.foreign.dramatiq_chaos_app import broker


def main() -> None:
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    worker.start()
    stopping.wait()
    worker.stop()


if __name__ == "__main__":
    main()
