"""What the worker side needs of storage, as protocols; storage implements them.

The client and runtime hold a ``WorkerStore``, never a concrete adapter: the composition
root (``reconciler.root.worker``) builds the store from a database URL. Declared here, in
the core, so the worker package and the composition root both depend on the core and never on each
other's insides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from reconciler.core.evidence import PlanStep
from reconciler.core.ports import ClaimedJob
from reconciler.core.vocabulary import StepState


class ArtifactRecords(Protocol):
    """The rows that say which generation's artifact set is the real one."""

    def published_artifact_names(self, job_id: int, generation: int) -> list[str]:
        """Names in the published set of one generation."""

    def settle_artifacts(self, job_id: int, generation: int) -> None:
        """Record that a published set's files are in place."""

    def unpublishable_artifacts(self, limit: int) -> list[tuple[int, int, str]]:
        """Staged artifacts whose attempt is over: (job, generation, name)."""

    def unsettled_published_artifacts(self, limit: int) -> list[tuple[int, int, str]]:
        """Published artifacts whose files were not confirmed moved into place."""

    def discard_artifact(self, job_id: int, generation: int, artifact_name: str) -> bool:
        """Mark one stale staged artifact discarded (after its file is gone)."""


class WorkerStore(ArtifactRecords, Protocol):
    """Enqueue, claim, the fenced writes of a claim, and worker sessions."""

    def enqueue(self, job_kind: str, plan: Sequence[PlanStep], *, max_attempts: int,
                idempotency_key: str | None, singleton_key: str | None, payload: Any,
                connection: Any = None) -> int:
        """Insert a queued job, or return the job already holding ``idempotency_key``;
        with ``connection`` (a SQLAlchemy connection), in the caller's transaction."""

    def claim(self, worker: str, lease_seconds: float, kinds: Sequence[str] | None = None,
              session_id: int | None = None) -> ClaimedJob | None:
        """Atomically take the oldest available queued job; None when there is none."""

    def heartbeat(self, job_id: int, token: str, lease_seconds: float) -> None:
        """Renew this claim's lease only."""

    def report_progress(self, job_id: int, token: str) -> None:
        """Record that the handler moved."""

    def record_step(self, job_id: int, token: str, step_index: int, spec: PlanStep,
                    state: StepState, *, error_code: str | None = None,
                    retryable: bool | None = None) -> None:
        """Fenced step record."""

    def stage_artifact(self, job_id: int, token: str, artifact_name: str) -> int:
        """Fenced: record an artifact staged by this claim; its generation."""

    def complete(self, job_id: int, token: str) -> int:
        """Fenced completion; the completing generation."""

    def fail(self, job_id: int, token: str, error_code: str, *, retryable: bool,
             backoff_seconds: float, backoff_max_seconds: float,
             status_reason: str | None = None) -> bool:
        """Fenced failure; True when requeued."""

    def release(self, job_id: int, token: str) -> None:
        """Fenced graceful release."""

    def register_session(self, worker_name: str, host_name: str, process_id: int) -> int:
        """Start a worker session, replacing a live one of the same name on the same host."""

    def heartbeat_session(self, session_id: int) -> bool:
        """Renew a session; False when it was already declared gone."""

    def stop_session(self, session_id: int) -> None:
        """End a session; its claims expire at once."""


class WorkWaiter(Protocol):
    """Blocks an idle worker until work may be there."""

    def wait(self, timeout: float) -> None:
        """Return on a wake-up, an interrupt, or after ``timeout`` seconds."""

    def close(self) -> None:
        """Release what the waiter holds."""
