"""One claim's run: its steps in order, a heartbeat thread and a lifetime.

``JobRunner`` runs one claimed job; ``StepContext`` is what each step callable gets. The
``Worker`` loop (runtime.py) starts runners and hears when one ends; a runner knows only
the ``RunnerShared`` the worker hands it (its limits, its stop signals, the artifact
records), never the worker itself. A hung handler cannot be killed inside a thread: past
``max_run_seconds`` the runner abandons it and ends the job ``failed`` with
``handler_lifetime_exceeded`` (never requeued: the hung copy may still run).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from reconciler import failpoints
from reconciler.core.vocabulary import short_code
from reconciler.core.worker_ports import ArtifactRecords
from reconciler.errors import LeaseLost
from reconciler.worker.artifacts import move_published, staging_path, write_atomically

if TYPE_CHECKING:
    from reconciler.worker.client import Claim

log = logging.getLogger("reconciler.worker")

Handler = Callable[["StepContext"], object]

LIFETIME_EXCEEDED = "handler_lifetime_exceeded"
HANDLER_MISSING = "handler_missing"


@dataclass(frozen=True, slots=True)
class RunnerShared:
    """What every runner of one worker shares: its limits, its stop signals, its store."""

    lease_seconds: float
    max_run_seconds: float
    artifact_root: Path
    artifacts: ArtifactRecords
    stopping: threading.Event
    """Set at a graceful stop: a runner releases its job before its next step."""
    aborting: threading.Event
    """Set when the worker aborts (second signal, grace spent): no further writes."""


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


class JobRunner:
    """Runs one claim's steps in order, with a heartbeat thread and a lifetime."""

    def __init__(self, shared: RunnerShared, claim: Claim, handlers: Mapping[str, Handler],
                 on_finished: Callable[[JobRunner], None]) -> None:
        self.shared = shared
        self.claim = claim
        self.handlers = handlers
        """The step handlers of this job's kind, by step name."""
        self._on_finished = on_finished
        self.done = threading.Event()
        self.outcome = "running"
        self.move_failed = False
        self._beating = threading.Event()

    def check_writable(self) -> None:
        """Refuse writes once the worker aborts (second signal or grace spent)."""
        if self.shared.aborting.is_set():
            raise WorkerStopped

    def _heartbeat_loop(self) -> None:
        interval = self.shared.lease_seconds / 3
        while not self._beating.wait(interval):
            if self.shared.aborting.is_set():
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
            self._on_finished(self)

    def _run_steps(self) -> str:
        claim, shared, handlers = self.claim, self.shared, self.handlers
        deadline = time.monotonic() + shared.max_run_seconds
        for index in range(claim.next_step_index, len(claim.steps)):
            self.check_writable()
            if claim.lease_lost.is_set():
                return "lost"
            if shared.stopping.is_set():
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
            context = StepContext(self, claim, index, shared.artifact_root)
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
        self._move_published(generation)
        return "completed"

    def _move_published(self, generation: int) -> None:
        """Move the completed job's files into place; a failure here is not the job's.

        The job completed (its artifacts were published in the same transaction), so a
        filesystem or database error now is logged and counted, never turned into an error
        outcome; the sidecar's artifact sweep finishes the move.
        """
        try:
            move_published(self.shared.artifacts, self.shared.artifact_root,
                           self.claim.job_id, generation)
        except Exception as exc:
            self.move_failed = True
            log.warning("event=artifact_move_failed job_id=%s generation=%s error=%s",
                        self.claim.job_id, generation, type(exc).__name__)


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


__all__ = ["HANDLER_MISSING", "LIFETIME_EXCEEDED", "Handler", "JobRunner", "RunnerShared",
           "StepContext", "WorkerStopped", "error_code_of"]
