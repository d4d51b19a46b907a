"""The worker protocol: ``JobClient``, ``Claim``, ``Step`` and ``LeaseLost``.

Every write after a claim is fenced on (job, lease token, processing) in the database; a
write that matches no row raises ``LeaseLost`` and changes nothing. All lease arithmetic
uses the database's clock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from reconciler.config.settings import Settings
from reconciler.connect import Database, ProducerConnection, assemble_worker
from reconciler.core.evidence import PlanStep
from reconciler.core.ports import ClaimedJob
from reconciler.core.vocabulary import StepState, short_code
from reconciler.core.worker_ports import WorkerStore, WorkWaiter
from reconciler.errors import LeaseLost
from reconciler.worker import validation
from reconciler.worker.artifacts import check_name

Step = PlanStep
"""One step of a job's plan: ``Step("fetch", "idempotent")``."""

__all__ = ["Claim", "JobClient", "LeaseLost", "Step"]


class Claim:
    """One attempt at one job, held under a lease. Every method is a fenced write."""

    __slots__ = (
        "_closed",
        "_job",
        "_lease_seconds",
        "_settings",
        "_store",
        "_token",
        "lease_lost",
    )

    def __init__(self, store: WorkerStore, job: ClaimedJob, lease_seconds: float,
                 settings: Settings) -> None:
        self._store = store
        self._job = job
        self._token = job.lease_token
        self._lease_seconds = lease_seconds
        self._settings = settings
        self._closed = False
        self.lease_lost = threading.Event()
        """Set once any write of this claim was refused: stop working on the job."""

    def __repr__(self) -> str:
        return f"Claim(job_id={self.job_id}, generation={self.generation})"

    @property
    def job_id(self) -> int:
        """The public job id."""
        return self._job.job_id

    @property
    def job_kind(self) -> str:
        """The job's kind, as enqueued."""
        return self._job.job_kind

    @property
    def generation(self) -> int:
        """This claim's fencing generation."""
        return self._job.claim_generation

    @property
    def attempt(self) -> int:
        """Attempts used, this one included."""
        return self._job.attempt_count

    @property
    def max_attempts(self) -> int:
        """The job's attempt budget, shared by retries and resumes."""
        return self._job.max_attempts

    @property
    def next_step_index(self) -> int:
        """Where this attempt starts: the first step that never finished."""
        return self._job.resume_step_index

    @property
    def steps(self) -> tuple[Step, ...]:
        """The job's step plan."""
        return self._job.plan

    @property
    def payload(self) -> Any:
        """The job's opaque payload."""
        return self._job.payload

    def _guard(self, action: Any, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            self.lease_lost.set()
            raise LeaseLost(self.job_id)
        try:
            return action(self.job_id, self._token, *args, **kwargs)
        except LeaseLost:
            self.lease_lost.set()
            raise

    def _step(self, index: int) -> Step:
        if not isinstance(index, int) or not 0 <= index < len(self.steps):
            raise IndexError(f"job {self.job_id} has no step {index}")
        return self.steps[index]

    def heartbeat(self) -> None:
        """Renew this claim's lease (and only this claim's). Not progress."""
        self._guard(self._store.heartbeat, self._lease_seconds)

    def report_progress(self) -> None:
        """Tell the reconciler the handler is moving (``last_activity_at``)."""
        self._guard(self._store.report_progress)

    def start_step(self, index: int) -> None:
        """Record that step ``index`` started: from now its effects may have happened."""
        self._guard(self._store.record_step, index, self._step(index), StepState.STARTED)

    def finish_step(self, index: int) -> None:
        """Record that step ``index`` succeeded."""
        self._guard(self._store.record_step, index, self._step(index), StepState.SUCCEEDED)

    def fail_step(self, index: int, error_code: str, retryable: bool = False) -> None:
        """Record that step ``index`` failed, with a short error code (never a message)."""
        self._guard(self._store.record_step, index, self._step(index), StepState.FAILED,
                    error_code=short_code(error_code), retryable=retryable)

    def wait_step(self, index: int) -> None:
        """Record that step ``index`` waits on an external gate (the reconciler skips it)."""
        self._guard(self._store.record_step, index, self._step(index), StepState.WAITING)

    def complete(self) -> int:
        """Finish the job. Fenced: a stale claim can never complete a reclaimed job.

        Publishes this attempt's staged artifacts in the same transaction; returns the
        completing generation.
        """
        generation = int(self._guard(self._store.complete))
        self._closed = True
        return generation

    def fail(self, error_code: str, retryable: bool = True, *,
             status_reason: str | None = None) -> bool:
        """Fail this attempt; requeued with backoff while attempts remain. True if requeued.

        ``status_reason`` (a short code) replaces the default reason of a final failure.
        """
        requeued = bool(self._guard(
            self._store.fail, short_code(error_code), retryable=retryable,
            backoff_seconds=self._settings.retry_backoff_seconds,
            backoff_max_seconds=self._settings.retry_backoff_max_seconds,
            status_reason=None if status_reason is None else short_code(status_reason),
        ))
        self._closed = True
        return requeued

    def stage_artifact(self, name: str) -> None:
        """Record a staged artifact of this attempt (the runtime writes the file first)."""
        self._guard(self._store.stage_artifact, check_name(name))

    def release(self) -> None:
        """Give the job back (graceful stop): requeued now, attempt returned, resume kept."""
        self._guard(self._store.release)
        self._closed = True


class JobClient:
    """The worker's and producer's handle on the job database."""

    def __init__(self, database: Database | None = None, *,
                 settings: Settings | None = None) -> None:
        """``database``: a URL, or a SQLAlchemy engine used as it is; None: the database the
        config names (``RECONCILER_CONFIG``, ``RECONCILER_DATABASE_URL``, ...).
        ``settings``: None reads them from the config file and the environment, like the
        reconciler does. The composition root assembles the parts
        (``reconciler.connect``)."""
        parts = assemble_worker(database, settings=settings)
        self.settings = parts.settings
        self.engine = parts.engine
        self.store: WorkerStore = parts.store
        self._work_waiter = parts.work_waiter
        self._owns_engine = parts.owns_engine

    def __enter__(self) -> JobClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def work_waiter(self, interrupt: threading.Event) -> WorkWaiter:
        """What an idle worker of this client waits on until work may be there."""
        return self._work_waiter(interrupt)

    def close(self) -> None:
        """Release the connection pool (only when this client created the engine)."""
        if self._owns_engine:
            self.engine.dispose()

    def enqueue(
        self,
        job_kind: str,
        steps: Sequence[Step],
        *,
        idempotency_key: str | None = None,
        max_attempts: int | None = None,
        payload: Any = None,
        singleton_key: str | None = None,
        connection: ProducerConnection | None = None,
    ) -> int:
        """Queue a job; with an ``idempotency_key`` already used, return that job's id.

        With ``connection`` (a SQLAlchemy ``Connection``), the job is written in the
        caller's transaction and exists only if the caller commits. Every value is checked
        first, the same way on both engines: a ``ValueError`` names the limit it breaks (see
        ``reconciler.worker.validation``).
        """
        validation.text_value("job_kind", job_kind, validation.KIND_MAX_LENGTH)
        plan = validation.plan([s if isinstance(s, Step) else Step(*s) for s in steps])
        validation.text_value("idempotency_key", idempotency_key, validation.KEY_MAX_LENGTH,
                              optional=True)
        validation.text_value("singleton_key", singleton_key, validation.SINGLETON_MAX_LENGTH,
                              optional=True)
        validation.payload(payload)
        attempts = validation.attempts(
            self.settings.default_max_attempts if max_attempts is None else max_attempts)
        return self.store.enqueue(
            job_kind, plan, max_attempts=attempts, idempotency_key=idempotency_key,
            singleton_key=singleton_key, payload=payload, connection=connection,
        )

    def claim(self, worker: str, lease_seconds: float | None = None,
              kinds: Sequence[str] | None = None, *, session_id: int | None = None
              ) -> Claim | None:
        """Atomically claim the next available job, or None when there is none.

        ``kinds`` limits the claim to those job kinds (None: any kind; an empty list names
        none and claims nothing); ``session_id`` ties the claim to a worker session (the
        ``Worker`` runtime passes its own).
        """
        validation.text_value("worker", worker, validation.WORKER_MAX_LENGTH)
        seconds = validation.seconds(
            "lease_seconds", self.settings.lease_seconds if lease_seconds is None
            else lease_seconds)
        if kinds is not None:
            for kind in kinds:
                validation.text_value("kinds[]", kind, validation.KIND_MAX_LENGTH)
        job = self.store.claim(worker, seconds, kinds, session_id)
        return None if job is None else Claim(self.store, job, seconds, self.settings)
