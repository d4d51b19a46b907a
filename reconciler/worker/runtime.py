"""The worker runtime (DESIGN.md §3a): a claim loop with slots, heartbeats and lifetimes.

Failure modes it is built against:

- A hung handler cannot be killed inside a thread. Past ``max_run_seconds`` the runner
  abandons it, ends the job ``failed`` with ``handler_lifetime_exceeded`` (never requeued:
  the hung copy may still run) and frees the slot.
- A lost lease stops the claim's writes at once (every write is fenced in the database).
- SIGTERM stops claiming, lets running steps finish within ``shutdown_grace_seconds``, then
  releases what is left between steps. A second signal, or the grace running out, ends
  without further writes: the leases expire and the reconciler takes over.
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

from reconciler import failpoints
from reconciler.core.vocabulary import short_code
from reconciler.errors import LeaseLost
from reconciler.worker.artifacts import move_published, staging_path, write_atomically

if TYPE_CHECKING:
    from reconciler.core.worker_ports import WorkWaiter
    from reconciler.worker.client import Claim, JobClient

log = logging.getLogger("reconciler.worker")

Handler = Callable[["StepContext"], object]

LIFETIME_EXCEEDED = "handler_lifetime_exceeded"
HANDLER_MISSING = "handler_missing"


class WorkerStopped(Exception):  # noqa: N818 - a state, not a failure
    """The worker is shutting down without further writes."""


def error_code_of(exc: BaseException) -> str:
    """The short code stored for a handler's exception: its type name, never its message."""
    try:
        return short_code(type(exc).__name__)
    except ValueError:
        return "HandlerError"


class StepContext:
    """What a step callable gets: ids, payload, the lease-lost event, artifact staging."""

    __slots__ = ("_claim", "_root", "_runner", "attempt", "generation", "job_id",
                 "lease_lost", "payload", "step_index", "step_name")

    def __init__(self, runner: JobRunner, claim: Claim, step_index: int, root: Path) -> None:
        self._runner = runner
        self._claim = claim
        self._root = root
        self.job_id = claim.job_id
        self.payload = claim.payload
        self.step_index = step_index
        self.step_name = claim.steps[step_index].step_name
        self.attempt = claim.attempt
        # The claim's fencing token: unique per attempt, for handlers that hand it on to
        # systems of their own (attempt numbers repeat after a release).
        self.generation = claim.generation
        self.lease_lost = claim.lease_lost

    def stage_artifact(self, name: str, data: bytes | str) -> Path:
        """Stage a file for this attempt; it is published only if this attempt completes."""
        self._runner.check_writable()
        path = staging_path(self._root, self.job_id, self._claim.generation, name)
        write_atomically(path, data.encode() if isinstance(data, str) else data)
        try:
            self._claim.stage_artifact(name)
        except LeaseLost:
            path.unlink(missing_ok=True)
            raise
        return path

    def report_progress(self) -> None:
        """Tell the reconciler this handler is moving."""
        self._runner.check_writable()
        self._claim.report_progress()


@dataclass
class WorkerStats:
    """What a worker's run did, by outcome."""

    claimed: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)

    def add(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


class JobRunner:
    """Runs one claim's steps in order, with a heartbeat thread and a lifetime."""

    def __init__(self, worker: Worker, claim: Claim) -> None:
        self.worker = worker
        self.claim = claim
        self.done = threading.Event()
        self.outcome = "running"
        self._beating = threading.Event()

    def check_writable(self) -> None:
        """Refuse writes once the worker aborts (second signal or grace spent)."""
        if self.worker.aborting.is_set():
            raise WorkerStopped

    def _heartbeat_loop(self) -> None:
        interval = self.worker.lease_seconds / 3
        while not self._beating.wait(interval):
            if self.worker.aborting.is_set():
                return
            try:
                failpoints.hit("in_heartbeat")
                self.claim.heartbeat()
            except LeaseLost:
                log.warning("event=lease_lost job_id=%s generation=%s", self.claim.job_id,
                            self.claim.generation)
                return
            except Exception as exc:  # a database blip: the lease has slack, try again
                log.warning("event=heartbeat_failed job_id=%s error=%s", self.claim.job_id,
                            type(exc).__name__)

    def run(self) -> None:
        beat = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                name=f"heartbeat-{self.claim.job_id}")
        beat.start()
        try:
            self.outcome = self._run_steps()
        except LeaseLost:
            self.outcome = "lost"
            log.warning("event=lease_lost job_id=%s", self.claim.job_id)
        except WorkerStopped:
            self.outcome = "abandoned_on_stop"
        except Exception as exc:
            # The store failed (database down): leave the claim; its lease will expire.
            self.outcome = "error"
            log.error("event=runner_failed job_id=%s error=%s", self.claim.job_id,
                      type(exc).__name__)
        finally:
            self._beating.set()
            self.done.set()
            self.worker.runner_finished(self)

    def _run_steps(self) -> str:
        claim, worker = self.claim, self.worker
        handlers = worker.handlers.get(claim.job_kind, {})
        deadline = time.monotonic() + worker.max_run_seconds
        for index in range(claim.next_step_index, len(claim.steps)):
            self.check_writable()
            if claim.lease_lost.is_set():
                return "lost"
            if worker.stopping.is_set():
                claim.release()
                return "released"
            if index > claim.next_step_index:
                failpoints.hit("between_steps")
            name = claim.steps[index].step_name
            handler = handlers.get(name)
            if handler is None:
                claim.fail_step(index, HANDLER_MISSING, retryable=False)
                claim.fail(HANDLER_MISSING, retryable=False)
                return "failed"
            kind = claim.steps[index].kind.value
            failpoints.hit("before_step_start", kind)
            claim.start_step(index)
            failpoints.hit("after_step_start", kind)
            context = StepContext(self, claim, index, worker.artifact_root)
            finished, error = _call_with_deadline(handler, context, deadline)
            failpoints.hit("after_step_effect", kind)
            self.check_writable()
            if not finished:
                log.error("event=handler_lifetime_exceeded job_id=%s step=%s",
                          claim.job_id, index)
                claim.fail(LIFETIME_EXCEEDED, retryable=False, status_reason=LIFETIME_EXCEEDED)
                return "lifetime_exceeded"
            if error is not None:
                code = error_code_of(error)
                retryable = bool(getattr(error, "retryable", True))
                claim.fail_step(index, code, retryable=retryable)
                requeued = claim.fail(code, retryable=retryable)
                log.warning("event=step_failed job_id=%s step=%s error=%s requeued=%s",
                            claim.job_id, index, code, requeued)
                return "retrying" if requeued else "failed"
            claim.finish_step(index)
        self.check_writable()
        failpoints.hit("before_complete")
        generation = claim.complete()
        failpoints.hit("after_complete")
        move_published(worker.client.store, worker.artifact_root, claim.job_id, generation)
        return "completed"


def _call_with_deadline(handler: Handler, context: StepContext, deadline: float
                        ) -> tuple[bool, BaseException | None]:
    """Run a handler in its own thread; (finished, error). An overdue thread is abandoned."""
    result: list[BaseException | None] = []

    def target() -> None:
        try:
            handler(context)
            result.append(None)
        except BaseException as exc:  # the handler's failure is data for the job record
            result.append(exc)

    thread = threading.Thread(target=target, daemon=True,
                              name=f"handler-{context.job_id}-{context.step_index}")
    thread.start()
    thread.join(max(deadline - time.monotonic(), 0))
    if thread.is_alive():
        return False, None
    return True, result[0] if result else None


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

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        log.warning("event=signal signal=%s stopping=%s", signal.Signals(signum).name,
                    self.stopping.is_set())
        self.stop()

    def runner_finished(self, runner: JobRunner) -> None:
        """Called by a runner when it ends: count it and free its slot."""
        with self._lock:
            if runner in self._running:
                self._running.discard(runner)
                self.stats.add(runner.outcome)
                self._slots.release()
        self._wake.set()

    def run(self, max_jobs: int | None = None) -> WorkerStats:
        """Claim and run jobs until stopped (SIGTERM/SIGINT) or ``max_jobs`` were claimed."""
        store = self.client.store
        self.session_id = self._register_session()
        log.info("event=worker_started worker=%s session=%s", self.name, self.session_id)
        restore = self._install_signal_handlers()
        session_beat = threading.Thread(target=self._session_loop, daemon=True,
                                        name="session-heartbeat")
        session_beat.start()
        try:
            self._claim_loop(max_jobs)
            self._drain()
        finally:
            self.stopping.set()
            restore()
        if not self.aborting.is_set():
            store.stop_session(self.session_id)
        log.info("event=worker_stopped worker=%s outcomes=%s", self.name, self.stats.outcomes)
        return self.stats

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

    def _claim_loop(self, max_jobs: int | None) -> None:
        kinds = list(self.handlers)
        waiter = self.client.work_waiter(self._wake)
        try:
            self._claim_until_stopped(kinds, max_jobs, waiter)
        finally:
            waiter.close()

    def _claim_until_stopped(self, kinds: list[str], max_jobs: int | None,
                             waiter: WorkWaiter) -> None:
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
            runner = JobRunner(self, claim)
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
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {sig: signal.signal(sig, self._on_signal)
                    for sig in (signal.SIGTERM, signal.SIGINT)}

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

        return restore


__all__ = ["StepContext", "Worker", "WorkerStats"]
