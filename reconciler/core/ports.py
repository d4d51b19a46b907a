"""The ports the pass needs, declared here in the core and implemented outside it.

A pass reads candidates from a **job source**, decides each with the table, and applies
its decisions through the same source as compare-and-swaps; it records the pass and every
decision in an **audit log**; where replicas keep a leader for once-only chores, a
**lease** says who leads. A ``PassStore`` opens one unit of work binding the three to one
transaction, so a source's changes and their audit commit together when they share a
database.

Job ids are opaque to the core (``JobKey``: an integer for this project's own jobs, a UUID
string for pg-boss): it compares them for equality and never computes with them. The fence
is opaque too: a source snapshots what its swap must repeat (``Fence.snapshot``, a frozen
dataclass of its own) and the core only carries it back. A source is supported when it
passes the conformance suite in tests/conformance, which runs unchanged against every
source on every engine it supports.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from reconciler.core.decisions import Decision, Thresholds
from reconciler.core.evidence import PlanStep
from reconciler.core.job_story import JobDetail
from reconciler.core.vocabulary import (
    Disposition,
    JobKey,
    LivenessDoubt,
    PassOutcome,
    Reason,
    StuckReason,
)

__all__ = [
    "AuditLog", "Candidate", "ClaimedJob", "Cursor", "Fence", "FenceSnapshot", "JobDetail",
    "JobKey", "JobSource", "Lease", "LivenessUnknown", "OperatorStore",
    "PassStore", "PassUnit", "PlannedChange", "RecordedDecision",
    "SourceJobs", "StuckCount", "StuckWork", "Unjudged",
]


@dataclass(frozen=True, slots=True)
class FenceSnapshot:
    """The base of a source's fence snapshot: a frozen dataclass of what its swap repeats
    (status, owner, claim time...), one class per source, read back only by that source."""


@dataclass(frozen=True, slots=True)
class Fence:
    """The snapshot a decision relied on, which the source's compare-and-swap repeats.

    ``generation`` is what the audit records as ``generation_before``: this project's
    ``claim_generation``, or a foreign system's nearest monotonic counter (its attempts),
    None where it keeps none. ``snapshot`` holds whatever else the source's swap compares
    (None: the generation is the whole fence, as for the native source); the core never
    reads it.
    """

    generation: int | None
    snapshot: FenceSnapshot | None = None


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where a source's next scans continue, paging by key; opaque to the pass.

    ``position``: after this row of the expired-lease scan (None: from its start).
    ``wedged``: after this row of the wedged scan (None: from its start). A row of a scan
    carries a cursor with its own place set.
    """

    position: tuple[Any, ...] | None
    wedged: tuple[Any, ...] | None = None

    def in_wedged_scan(self) -> Cursor:
        """The same place, as a row of the wedged scan."""
        return Cursor(None, self.position)


@dataclass(frozen=True, slots=True)
class Candidate:
    """Raw facts about one running job, read in the pass's transaction.

    Ages are measured by the database's clock. ``plan`` is raw text when the source stores
    one (parsing it, and judging it unreadable, is the evidence module's job, so one bad
    row cannot fail a read), or a plan the source built (a foreign job without step
    records is one step named after its kind). ``position`` is set on rows of the expired
    scan, so the pass can say where the next scan continues.
    """

    job_id: JobKey
    job_kind: str
    fence: Fence
    attempt_count: int
    max_attempts: int
    operator_hold: bool
    lease_live: bool
    lease_expired_seconds: float | None
    activity_age_seconds: float | None
    plan: str | tuple[PlanStep, ...] | None
    step_rows: tuple[tuple[int, str, bool | None], ...]
    session_gone: bool = False
    position: Cursor | None = None
    lost_attempts_in_a_row: int = 0
    """The attempt being judged plus the attempts right before it that ended lost."""
    completion_recoverable: bool = False
    """The source can record the completion itself (see Reason.COMPLETION_RECOVERED)."""
    unreadable: tuple[tuple[str, str | int], ...] = ()
    """What the source found it cannot read about the job (an ``error_code`` and the
    column it is in): the job is then a ``reconcile_error`` with this as its evidence."""
    owner: tuple[tuple[str, bool | float | None], ...] = ()
    """What the source saw of the job's owner, for the evidence (``owner``): plain facts,
    never an identity (whether its named worker answers, whether a process holds the job,
    how long that process has been up, how long none has held it)."""
    lost_to_system: bool = False
    """The job system's own recovery (an expiry, a sweep) took back an earlier attempt of
    the job from a worker that never ended it, as its own record says: that attempt counts
    as lost in a row where the reconciler's audit has none of its own."""


@dataclass(frozen=True, slots=True)
class PlannedChange:
    """A decision, the fence its swap repeats, the thresholds its time predicate uses, and
    the privacy-safe evidence recorded beside it."""

    decision: Decision
    fence: Fence
    thresholds: Thresholds
    evidence: dict[str, Any]

    @property
    def generation_before(self) -> int | None:
        """The fence's generation, as the audit records it."""
        return self.fence.generation


@dataclass(frozen=True, slots=True)
class LivenessUnknown:
    """A source could not read its owners' liveness, or has reason to doubt what it read:
    nothing that depends on it is decided. ``where`` names what was asked (a broker's URL,
    its password hidden), for the log line and ``/readyz``; never a metric label."""

    code: LivenessDoubt
    where: str


@dataclass(frozen=True, slots=True)
class StuckCount:
    """Running jobs past their threshold held back for one reason: how many, and the
    oldest one's seconds past it (None where the source cannot tell)."""

    count: int
    oldest_seconds: float | None = None


StuckWork = dict[StuckReason, StuckCount]
"""The stuck work of a source by what held it back; a reason not present counts none."""


@dataclass(frozen=True, slots=True)
class RecordedDecision:
    """A decision as it was applied (or not) and written to the audit trail."""

    job_id: JobKey
    disposition: Disposition
    reason: Reason
    resume_step_index: int | None
    generation_before: int | None
    generation_after: int | None
    repeated: bool = False
    """A skip the audit already held (the same job, reason and generation, by an earlier
    pass: a held job skipped by every pass): not recorded again, and not counted again."""


class JobSource(Protocol):
    """Where a pass reads candidates and applies its decisions, bound to one transaction."""

    source_name: str
    """The source's kind as its registry entry names it (``reconciler.config.registry``),
    recorded beside every decision."""

    def expire_gone_owners(self, timeout_seconds: float) -> int:
        """Declare owners (worker sessions) silent for ``timeout_seconds`` gone, so their
        jobs are candidates at once; how many were declared. Zero where the source has no
        owner liveness of its own."""

    def candidates(
        self, limit: int, thresholds: Thresholds, after: Cursor | None
    ) -> list[Candidate]:
        """Running jobs whose lease expired (paged after ``after``), then jobs without
        activity for ``thresholds.wedged_after_seconds`` under a live lease; at most
        ``limit``, locked against other replicas where the engine can."""

    def evidence_for(self, job_ids: Sequence[JobKey]) -> list[Candidate]:
        """The same facts for named running jobs, whatever their lease (for explain)."""

    def apply(self, changes: Sequence[PlannedChange]) -> dict[JobKey, int | None]:
        """Compare-and-swap every change (none is a skip), each repeating its fence and its
        rule's time predicate on the database clock. Returns the jobs changed, each with
        its generation after (None where the source keeps none); a change missing from the
        result lost its race and changed nothing."""

    def park(self, skipped: Sequence[PlannedChange]) -> int:
        """Leave these recorded held or gated jobs out of later scans until something about
        them changes (each fenced on its generation); how many were parked. A source with
        nowhere to keep the mark parks none and rescans them, recorded once all the same."""

    def stuck_work(self) -> StuckWork:
        """Running jobs past their threshold that no pass has acted on, by what the source
        itself knows held them back (its holds and gates, rows it cannot judge, owners
        whose liveness is unknown); the rest are ``awaiting_decision``."""

    def liveness_unknown(self) -> LivenessUnknown | None:
        """Why the owners' liveness read in this transaction is not trusted; None when it
        was read and is trusted, or the source judges by time alone."""

    def leases_own(self) -> bool:
        """Whether a running job carries a lease or an owner's liveness of its own; False:
        only its kind's ``max_run_seconds`` ends one (a kind without it is never
        reclaimed)."""

    def running_count(self) -> int:
        """Every running job (for the mass-staleness brake)."""

    def running_kinds(self) -> list[str]:
        """The kinds of the running jobs, each once, sorted (``reconciler kinds``)."""

    def kind_read(self, job_id: JobKey) -> str | None:
        """The kind of a job this transaction's scans read (None: none read): the audit
        records it beside the job's decision, so every source's decisions show a kind."""

    def stale_count(self, limit: int) -> int:
        """Running jobs the pass would act on whose lease expired (held ones left out),
        counted up to ``limit`` (for the mass-staleness brake)."""


class AuditLog(Protocol):
    """Passes and decisions, in the pass's transaction."""

    def start_pass(self, instance: str) -> int:
        """Insert this pass's row; its counts are filled in by ``finish_pass``."""

    def record_quiet_pass(self, instance: str, outcome: PassOutcome) -> int:
        """Insert a pass that decided nothing (not leader, or nothing stale)."""

    def held_among(self, source_name: str, job_ids: Sequence[JobKey]) -> set[str]:
        """Those of ``job_ids`` (as text) an operator holds by the reconciler's own hold
        (a foreign job's; a native job's hold is its row's, read with it)."""

    def finish_pass(self, pass_id: int, source_name: str,
                    decisions: Sequence[tuple[RecordedDecision, dict[str, Any]]], *,
                    shadow: bool = False, outcome: PassOutcome = PassOutcome.OK
                    ) -> set[tuple[str, str]]:
        """Record every decision with its evidence, and the pass's counts and outcome. A
        skip already recorded for the same job, reason and generation is not recorded
        again: those are returned, as (job id as text, reason)."""


class Lease(Protocol):
    """The leader lease, for chores that must run on one replica only."""

    def take(self, lease_name: str, holder_id: str, ttl_seconds: float) -> int | None:
        """Acquire or renew; the fencing token, or None when another holder has it."""

    def release(self, lease_name: str, holder_id: str) -> None:
        """Give the lease up at once, if this holder has it."""

    def brake_state(self) -> tuple[datetime | None, datetime]:
        """When the current mass-staleness event's brake first engaged (None: no event),
        shared by every replica, and the database's now."""

    def keep_brake(self, engaged_since: datetime | None) -> None:
        """Remember (or, with None, forget) when the current event's brake engaged."""


class PassUnit(Protocol):
    """One pass's unit of work: a source, the audit and the lease on one transaction."""

    @property
    def jobs(self) -> JobSource:
        """The job source, bound to this transaction."""

    @property
    def audit(self) -> AuditLog:
        """The audit log, bound to this transaction."""

    @property
    def lease(self) -> Lease:
        """The leader lease, bound to this transaction."""


class PassStore(Protocol):
    """Opens units of work for passes; what the pass and the sidecar need of storage."""

    def pass_transaction(self, *, dry_run: bool) -> AbstractContextManager[PassUnit]:
        """One transaction; a dry run reads without locks and never commits."""

    def record_failed_pass(self, instance: str, error_code: str) -> int:
        """Record a pass that failed before it could record itself, in its own transaction."""

    def release_leadership(self, lease_name: str, holder_id: str) -> None:
        """Give the leader lease up in its own transaction."""

    def try_lead(self, lease_name: str, holder_id: str, ttl_seconds: float) -> int | None:
        """Acquire or renew the leader lease in its own transaction; the token or None."""

    def stuck_work(self) -> StuckWork:
        """The source's stuck work (``JobSource.stuck_work``), in a transaction of its own."""

    def backlog(self) -> tuple[StuckWork, int]:
        """The source's stuck work and its running jobs' count, in one transaction."""

    def delete_audit_before(self, days: float, limit: int) -> int:
        """Delete finished passes older than ``days`` with their decisions, at most
        ``limit``; how many rows went."""


class OperatorStore(Protocol):
    """What operators read and do through the CLI: jobs, the audit trail, actions."""

    def list_jobs(self, status: str | None, limit: int) -> list[JobDetail]:
        """Newest first, optionally of one status."""

    def get_job(self, job_id: int) -> JobDetail | None:
        """One job with its step states, or None."""

    def list_decisions(self, reason: str | None, since_seconds: float | None,
                       limit: int, *, shadow_only: bool = False) -> list[dict[str, Any]]:
        """Decision records as stored, newest first (``shadow_only``: of shadow passes)."""

    def decision_pages(self, reason: str | None, since_seconds: float | None,
                       limit: int, *, shadow_only: bool = False
                       ) -> Iterator[list[dict[str, Any]]]:
        """``list_decisions`` a page at a time, each page read on its own (exports)."""

    def operator_action(self, job_id: int, action: str, *, actor: str | None = None,
                        note: str | None = None) -> tuple[bool, str | None]:
        """Apply hold, unhold, retry or cancel, recorded with who and why; (applied,
        refusal reason)."""

    def actions_about(self, source: str, job_key: JobKey, limit: int
                      ) -> list[dict[str, Any]]:
        """The operator actions on one job of ``source``, newest first."""

    def held_by_operator(self, source: str, job_key: JobKey) -> bool:
        """Whether an operator holds this job of a foreign ``source``."""


class SourceJobs(Protocol):
    """Jobs as operators see them through the configured source (``reconciler jobs``)."""

    def list_jobs(self, status: str | None, limit: int) -> list[JobDetail]:
        """Newest first, optionally of one status (this project's status words)."""

    def get_job(self, job_id: JobKey) -> JobDetail | None:
        """One job as its source spells its id, or None."""

    def decisions_about(self, job_id: JobKey, limit: int) -> list[dict[str, Any]]:
        """The audit's decisions about one job, newest first."""

    def timeline(self, job_id: JobKey, limit: int) -> list[dict[str, Any]]:
        """The job's timeline, oldest first (``reconciler.core.timeline``), of at most
        ``limit`` decisions and as many actions."""

    def operator_action(self, job_id: JobKey, action: str) -> tuple[bool, str | None]:
        """Apply hold, unhold, retry or cancel; (applied, refusal reason)."""

    def unjudged(self, job_id: JobKey | None = None) -> Unjudged | None:
        """The running jobs (``job_id``: only that one) no pass can judge, and why; None
        when there is none."""


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
class Unjudged:
    """Running jobs no pass can judge, because their rows lack what the source reads (a
    Celery ``STARTED`` row written without ``result_extended`` has no task name): they
    are left alone, and operators are told which setting of their system is missing."""

    count: int
    missing_setting: str
    """The system's setting that would have written what is missing (``result_extended``)."""
    why: str
    """What the rows lack, in a sentence (no job's data)."""
    fix: str
    """What to set, in a sentence."""
