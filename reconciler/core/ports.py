"""The store capability: what the pass, the worker client and the views need from a database.

A backend is supported when it implements ``Store`` with ``capability_version`` equal to
``STORE_CAPABILITY_VERSION`` and passes the conformance suite in tests/integration, which
runs unchanged on every engine. The only implementation is ``sql_store.SqlStore``.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from reconciler.core.decisions import Decision, Thresholds
from reconciler.core.evidence import PlanStep
from reconciler.core.vocabulary import Disposition, PassOutcome, Reason

# Bump when the semantics below change: a backend declaring another version is refused.
STORE_CAPABILITY_VERSION = 1


@dataclass(frozen=True, slots=True)
class CandidateRow:
    """Raw facts about one candidate, as read in the pass's transaction.

    Ages are measured by the database's clock. The plan is raw text: parsing it (and
    judging it unreadable) is the evidence module's job, so one bad row cannot fail a read.
    """

    job_id: int
    claim_generation: int
    attempt_count: int
    max_attempts: int
    operator_hold: bool
    lease_live: bool
    lease_expired_seconds: float | None
    activity_age_seconds: float | None
    plan_text: str | None
    step_rows: tuple[tuple[int, str, bool | None], ...]
    lease_expires_at: datetime | None
    session_gone: bool = False


@dataclass(frozen=True, slots=True)
class PlannedChange:
    """A decision with what its compare-and-swap must repeat, and its recorded evidence."""

    decision: Decision
    generation_before: int
    evidence: dict[str, Any]


@dataclass(frozen=True, slots=True)
class RecordedDecision:
    """A decision as it was applied (or not) and written to the audit trail."""

    job_id: int
    disposition: Disposition
    reason: Reason
    resume_step_index: int | None
    generation_before: int | None
    generation_after: int | None


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where the next pass continues its scan of expired leases (paging by key)."""

    lease_expires_at: datetime
    job_id: int


class PassTransaction(Protocol):
    """One pass's transaction: leadership, candidates, and the atomic apply."""

    def take_leadership(self, lease_name: str, holder_id: str, ttl_seconds: float) -> int | None:
        """Acquire or renew the leader lease; the fencing token, or None if another holds it."""

    def start_pass_record(self, instance: str) -> int:
        """Insert the pass row and return its id."""

    def record_finished_pass(self, instance: str, outcome: PassOutcome) -> int:
        """Insert a pass row that decided nothing (``not_leader``, or ``ok`` when quiet)."""

    def expire_gone_sessions(self, timeout_seconds: float) -> int:
        """Declare silent worker sessions gone; their claims' leases expire at once."""

    def candidates(
        self, limit: int, thresholds: Thresholds, after: Cursor | None
    ) -> list[CandidateRow]:
        """Expired-lease and wedged processing jobs, at most ``limit``, locked where possible."""

    def evidence_for(self, job_ids: Sequence[int]) -> list[CandidateRow]:
        """The candidate facts of named processing jobs, whatever their lease."""

    def apply(
        self, pass_id: int, changes: Sequence[PlannedChange], thresholds: Thresholds
    ) -> list[RecordedDecision]:
        """Compare-and-swap every non-skip change; record every decision and the counts."""


class Store(Protocol):
    """The capability every backend provides."""

    capability_version: int

    def pass_transaction(self, *, dry_run: bool) -> AbstractContextManager[PassTransaction]:
        """A transaction for one pass; a dry run reads without locks and never commits."""

    def record_failed_pass(self, instance: str, error_code: str) -> int:
        """Record a pass that failed before it could record itself."""

    def release_leadership(self, lease_name: str, holder_id: str) -> None:
        """Give the leader lease up at once, if this holder has it."""


@dataclass(frozen=True, slots=True)
class ClaimedJob:
    """What a successful claim returns to the client."""

    job_id: int
    job_kind: str
    claim_generation: int
    attempt_count: int
    max_attempts: int
    lease_token: str
    resume_step_index: int
    plan: tuple[PlanStep, ...]
    payload: Any


@dataclass(frozen=True, slots=True)
class JobDetail:
    """Every column a public view may draw from (the view decides what to show)."""

    job_id: int
    job_kind: str
    job_status: str
    status_reason: str | None
    attempt_count: int
    max_attempts: int
    resume_step_index: int
    plan_text: str | None
    operator_hold: bool
    last_error_code: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    step_states: dict[int, str]
