"""The worker runtime: a claim loop with slots, heartbeats and lifetimes.

Failure modes it is built against:

- A hung handler cannot be killed inside a thread. Past ``max_run_seconds`` the runner
  (runner.py) abandons it, ends the job ``failed`` with ``handler_lifetime_exceeded``
  (never requeued: the hung copy may still run) and frees the slot.
- A lost lease stops the claim's writes at once (every write is fenced in the database).
- SIGTERM stops claiming, lets running steps finish within ``shutdown_grace_seconds``, then
  releases what is left between steps. A second signal, or the grace running out, ends
  without further writes to its jobs; its one last write marks its session stopped (best
  effort, bounded by ``SESSION_END_TIMEOUT_SECONDS``), so the next pass takes those jobs at
  once instead of waiting out their leases. ``run()`` returns right after: a handler still
  running in an abandoned thread ends when the process does.
- A failure to move published files after ``complete()`` is not the job's failure: the job
  is completed, the failure is logged and counted, and the sidecar's sweep finishes the move.
- A restart under the same name on the same host replaces the previous session, whose
  claims the next pass takes back at once.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from reconciler.worker.runner import (
    LIFETIME_EXCEEDED,
    Handler,
    JobRunner,
    RunnerShared,
    StepContext,
)

if TYPE_CHECKING:
    from reconciler.core.worker_ports import WorkWaiter
    from reconciler.worker.client import JobClient

log = logging.getLogger("reconciler.worker")

# How long a worker that aborts waits for its last write (its session's end) before exiting
# anyway: a database that hangs must not hold a process its supervisor is about to kill.
SESSION_END_TIMEOUT_SECONDS = 2.0


@dataclass
class WorkerStats:
    """What a worker's run did, by outcome.

    ``artifact_move_failures`` counts completed jobs whose published files could not be
    moved into place (the sidecar's sweep finishes those moves); they count as completed.
    """

    claimed: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    artifact_move_failures: int = 0

    def add(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


class Worker:
    """A claim loop over registered handlers, ``concurrency`` jobs at a time."""

    def __init__(
        self,
        client: JobClient,
        name: str,
        *,
        concurrency: int = 4,
        lease_seconds: float | None = None,
        max_run_seconds: float | None = None,
        shutdown_grace_seconds: float | None = None,
        poll_interval_seconds: float | None = None,
        artifact_root: str | Path | None = None,
    ) -> None:
        if not name:
            raise ValueError("a worker needs a name")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        settings = client.settings
        self.client = client
        self.name = name
        self.host_name = socket.gethostname()
        self.concurrency = concurrency
        self.lease_seconds = lease_seconds or settings.lease_seconds
        self.max_run_seconds = max_run_seconds or settings.max_run_seconds
        self.shutdown_grace_seconds = (settings.shutdown_grace_seconds
                                       if shutdown_grace_seconds is None
                                       else shutdown_grace_seconds)
        self.poll_interval_seconds = poll_interval_seconds or settings.poll_interval_seconds
        self.artifact_root = Path(artifact_root or settings.artifact_root)
        self.handlers: dict[str, dict[str, Handler]] = {}
        self.stopping = threading.Event()
        self.aborting = threading.Event()
        self.session_id: int | None = None
        self._slots = threading.Semaphore(concurrency)
        self._lock = threading.Lock()
        self._running: set[JobRunner] = set()
        self._wake = threading.Event()
        self.stats = WorkerStats()

    def register(self, kind: str, handlers: Mapping[str, Handler]) -> None:
        """Handle jobs of ``kind``: a mapping of step name to callable."""
        if not handlers:
            raise ValueError(f"no handlers given for job kind {kind!r}")
        self.handlers[kind] = dict(handlers)

    def stop(self) -> None:
        """Ask for a graceful stop (what SIGTERM does); a second call aborts."""
        if self.stopping.is_set():
            self.aborting.set()
        self.stopping.set()
        self._wake.set()

    def _on_signal(self, signum: int) -> None:
        log.warning("event=signal signal=%s stopping=%s", signal.Signals(signum).name,
                    self.stopping.is_set())
        self.stop()

    def _runner_finished(self, runner: JobRunner) -> None:
        """Called by a runner when it ends: count it and free its slot."""
        with self._lock:
            if runner in self._running:
                self._running.discard(runner)
                self.stats.add(runner.outcome)
                if runner.move_failed:
                    self.stats.artifact_move_failures += 1
                self._slots.release()
        self._wake.set()

    def run(self, max_jobs: int | None = None) -> WorkerStats:
        """Claim and run jobs until stopped (SIGTERM/SIGINT) or ``max_jobs`` were claimed.

        Refuses to start (ValueError) with no handlers registered: such a worker could run
        nothing it claims.
        """
        if not self.handlers:
            raise ValueError(f"worker {self.name!r} has no handlers: call "
                             "worker.register(kind, {step_name: handler}) before run()")
        store = self.client.store
        shared = RunnerShared(self.lease_seconds, self.max_run_seconds, self.artifact_root,
                              store, self.stopping, self.aborting)
        self.session_id = self._register_session()
        # Handlers first: once the line says started, SIGTERM is a graceful stop.
        restore = self._install_signal_handlers()
        log.info("event=worker_started worker=%s session=%s", self.name, self.session_id)
        session_beat = threading.Thread(target=self._session_loop, daemon=True,
                                        name="session-heartbeat")
        session_beat.start()
        try:
            self._claim_loop(max_jobs, shared)
            self._drain()
        finally:
            self.stopping.set()
            restore()
        if self.aborting.is_set():
            self._end_session_on_abort(self.session_id)
        else:
            store.stop_session(self.session_id)
        log.info("event=worker_stopped worker=%s outcomes=%s", self.name, self.stats.outcomes)
        return self.stats

    def _end_session_on_abort(self, session_id: int) -> None:
        """Mark the session stopped on the way out of an abort: one write, best effort.

        Jobs still held (their handlers outlived the grace) are then taken by the next pass
        at once, instead of waiting out their leases or ``session_timeout_seconds``. The
        write runs in its own thread so that a database that hangs holds the exit for at
        most ``SESSION_END_TIMEOUT_SECONDS``; if it fails, the reconciler notices the
        silent session later, as it would after a SIGKILL.
        """
        ended = threading.Event()

        def end() -> None:
            try:
                self.client.store.stop_session(session_id)
                ended.set()
            except Exception as exc:
                log.warning("event=session_stop_failed session=%s error=%s", session_id,
                            type(exc).__name__)

        writer = threading.Thread(target=end, daemon=True, name="session-end")
        writer.start()
        writer.join(SESSION_END_TIMEOUT_SECONDS)
        if ended.is_set():
            log.warning("event=session_stopped_on_abort session=%s", session_id)
        elif writer.is_alive():
            log.warning("event=session_stop_timed_out session=%s seconds=%s", session_id,
                        SESSION_END_TIMEOUT_SECONDS)

    def _register_session(self) -> int:
        """Register this process's session, waiting out a database that is not there yet."""
        while True:
            try:
                return self.client.store.register_session(self.name, self.host_name,
                                                          os.getpid())
            except Exception as exc:
                if self.stopping.is_set():
                    raise
                log.warning("event=session_register_failed error=%s", type(exc).__name__)
                self.stopping.wait(self.poll_interval_seconds)

    def _claim_loop(self, max_jobs: int | None, shared: RunnerShared) -> None:
        kinds = list(self.handlers)
        waiter = self.client.work_waiter(self._wake)
        try:
            self._claim_until_stopped(kinds, max_jobs, waiter, shared)
        finally:
            waiter.close()

    def _claim_until_stopped(self, kinds: list[str], max_jobs: int | None,
                             waiter: WorkWaiter, shared: RunnerShared) -> None:
        while not self.stopping.is_set():
            if max_jobs is not None and self.stats.claimed >= max_jobs:
                return
            if not self._slots.acquire(timeout=self.poll_interval_seconds):
                continue
            claim = None
            try:
                claim = self.client.claim(self.name, self.lease_seconds, kinds=kinds,
                                          session_id=self.session_id)
            except Exception as exc:
                log.warning("event=claim_failed error=%s", type(exc).__name__)
            if claim is None:
                self._slots.release()
                self._wake.clear()
                waiter.wait(self.poll_interval_seconds)
                continue
            self.stats.claimed += 1
            runner = JobRunner(shared, claim, self.handlers.get(claim.job_kind, {}),
                               self._runner_finished)
            with self._lock:
                self._running.add(runner)
            threading.Thread(target=runner.run, daemon=True,
                             name=f"job-{claim.job_id}").start()

    def _drain(self) -> None:
        """Wait for running jobs: unbounded for max_jobs runs, else within the grace."""
        deadline = (time.monotonic() + self.shutdown_grace_seconds
                    if self.stopping.is_set() else None)
        while True:
            with self._lock:
                running = list(self._running)
            if not running or self.aborting.is_set():
                break
            if deadline is not None and time.monotonic() >= deadline:
                log.warning("event=grace_expired running=%s", len(running))
                self.aborting.set()
                break
            if deadline is None and self.stopping.is_set():
                deadline = time.monotonic() + self.shutdown_grace_seconds
            running[0].done.wait(0.05)

    def _session_loop(self) -> None:
        interval = self.client.settings.session_heartbeat_seconds
        while not self.stopping.wait(interval):
            if self.session_id is None:
                continue
            try:
                if not self.client.store.heartbeat_session(self.session_id):
                    # Declared gone (silent too long): its claims are being taken back and
                    # their heartbeats refused. New claims go under a new session.
                    old = self.session_id
                    self.session_id = self.client.store.register_session(
                        self.name, self.host_name, os.getpid())
                    log.error("event=session_replaced old=%s new=%s", old, self.session_id)
            except Exception as exc:
                log.warning("event=session_heartbeat_failed error=%s", type(exc).__name__)

    def _install_signal_handlers(self) -> Callable[[], None]:
        """SIGTERM/SIGINT call ``stop()``, from a thread of their own.

        A Python signal handler runs in the main thread between two of its bytecodes,
        possibly while that thread holds an Event's internal lock (``_wake.clear()`` in the
        claim loop); ``stop()`` setting that Event there would wait on itself forever, as
        a second signal soon after the first did. The handler only writes the signal's
        number to a pipe (no lock taken); a watcher thread reads it and stops the worker.
        """
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        read_fd, write_fd = os.pipe()

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            os.write(write_fd, bytes([signum]))

        def watch() -> None:
            try:
                while signums := os.read(read_fd, 16):
                    for signum in signums:
                        self._on_signal(signum)
            finally:
                os.close(read_fd)

        threading.Thread(target=watch, daemon=True, name="signal-watcher").start()
        previous = {sig: signal.signal(sig, on_signal)
                    for sig in (signal.SIGTERM, signal.SIGINT)}

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            os.close(write_fd)  # the watcher reads the end of the pipe and returns

        return restore


__all__ = ["LIFETIME_EXCEEDED", "StepContext", "Worker", "WorkerStats"]
