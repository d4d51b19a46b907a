"""What every foreign source shares: kinds, the one-step plan, the step ledger's evidence.

A foreign job without step records is one step named after its kind, with the kind's
``effect``, ``started`` while the job runs: unknown progress is judged as a step that may
have happened. A job whose task records its steps through the step ledger
(``reconciler.ledger``) is judged step by step instead, and the ledger's last write is its
activity. Ledger reads are one indexed query per batch.

A foreign system keeps no history of lost attempts, but the audit does: the attempts lost
in a row (the crash-loop rule's count) are read from the reconciler's own resumes of the
job, one indexed query per batch (``with_lost_attempts``). Both are read through ports of
this project's own tables (``storage.step_ledger.PassLedger``, ``storage.audit.AuditHistory``):
no statement here names them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.evidence import PlanStep, StepFacts, StepRows
from reconciler.core.kinds import KindPolicy, KindRules
from reconciler.core.ports import Candidate, Cursor, Fence, JobKey, PlannedChange
from reconciler.core.vocabulary import Disposition, Reason, StepState


def constant(value: str) -> sa.BindParameter[Any]:
    """A fixed value (a status) written into the SQL text as a quoted literal, so the
    database types it from where it is used (an enum status refuses a VARCHAR) and a
    partial index on it still applies to a prepared statement."""
    return sa.literal(value, literal_execute=True)


def one_step(policy: KindPolicy) -> StepFacts:
    """A job with no step records: one step named after its kind, started, of unknown end."""
    return StepFacts((PlanStep(policy.kind or "job", policy.effect),),
                     ((0, StepState.STARTED.value, None),), None)


SCAN_KEYS = ("reconcile", "max_run_seconds", "wedged_after_seconds")
"""The ``[kinds]`` keys a foreign scan's SQL reads (the rest are judged in Python)."""


class AllKinds(Mapping[str, KindPolicy]):
    """Every kind, each resolved when asked, for a source whose ``[kinds]`` give every
    kind the same ``SCAN_KEYS`` (``alike``): its scans need no list of the running kinds
    first, which on a system without a catalogue of kinds is one more read of its job
    table. Iterates over no kind: SQL reads ``alike`` (``by_kind``), never a list."""

    def __init__(self, rules: KindRules, alike: KindPolicy) -> None:
        self._rules = rules
        self.alike = alike

    @classmethod
    def of(cls, rules: KindRules) -> AllKinds | None:
        """Every kind, when no table but ``[kinds."*"]`` sets a ``SCAN_KEYS`` key (else
        None: the kinds must be read to tell them apart)."""
        if any(rule.pattern != "*" and any(getattr(rule, key) is not None for key in SCAN_KEYS)
               for rule in rules.rules):
            return None
        return cls(rules, rules.resolve("*"))

    def __getitem__(self, kind: str) -> KindPolicy:
        return self._rules.resolve(kind)

    def __contains__(self, kind: object) -> bool:
        return isinstance(kind, str)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __bool__(self) -> bool:
        return True


def by_kind(kind_column: sa.ColumnElement[Any], policies: Mapping[str, KindPolicy],
            value: Callable[[KindPolicy], float | None]) -> sa.ColumnElement[Any]:
    """A policy's value in SQL: one for every kind (``AllKinds``), else ``per_kind``."""
    if isinstance(policies, AllKinds):
        alike = value(policies.alike)
        return sa.null() if alike is None else sa.literal(float(alike), sa.Float())
    return per_kind(kind_column, {kind: value(p) for kind, p in policies.items()})


def per_kind(kind_column: sa.ColumnElement[Any], values: Mapping[str, float | None],
             ) -> sa.ColumnElement[Any]:
    """A SQL value chosen by the job's kind (``CASE kind WHEN ... END``; NULL otherwise)."""
    known = {kind: value for kind, value in values.items() if value is not None}
    if not known:
        return sa.null()
    return sa.case({kind: sa.literal(float(value), sa.Float()) for kind, value in known.items()},
                   value=kind_column, else_=sa.null())


def candidate(*, job_id: JobKey, kind: str, policy: KindPolicy, fence: Fence,
              attempt_count: int, max_attempts: int, lease_live: bool,
              lease_expired_seconds: float | None, steps: StepFacts | None,
              session_gone: bool = False, position: bool = False,
              own_plan: tuple[str | None, StepRows] | None = None,
              activity_age_seconds: float | None = None,
              lost_to_system: bool = False,
              owner: tuple[tuple[str, bool | float | None], ...] = ()) -> Candidate:
    """A foreign candidate: the job's own plan and step results when its system keeps them
    (``own_plan``: raw plan text, possibly None, and step records), else the ledger's
    steps, else one step named after its kind. ``activity_age_seconds`` is the system's own
    activity; without one, the ledger's last write. ``lost_to_system`` and ``owner``: see
    ``Candidate``."""
    plan: str | tuple[PlanStep, ...] | None
    if own_plan is not None:
        plan, step_rows = own_plan
        activity = activity_age_seconds
    else:
        facts = steps or one_step(policy)
        plan, step_rows = facts.plan, facts.step_rows
        activity = (activity_age_seconds if activity_age_seconds is not None
                    else facts.activity_age_seconds)
    return Candidate(
        job_id=job_id, job_kind=kind, fence=fence, attempt_count=attempt_count,
        max_attempts=max_attempts, operator_hold=False, lease_live=lease_live,
        lease_expired_seconds=lease_expired_seconds, activity_age_seconds=activity,
        plan=plan, step_rows=step_rows, session_gone=session_gone,
        position=Cursor((job_id,)) if position else None, lost_to_system=lost_to_system,
        owner=owner,
    )


def acting(changes: Sequence[PlannedChange]) -> list[PlannedChange]:
    """The changes that change something (skips are recorded, never applied)."""
    return [c for c in changes if c.decision.disposition is not Disposition.SKIP]


def is_wedged(change: PlannedChange) -> bool:
    """True for a terminalization of a hung run under a live lease (its own time predicate)."""
    return change.decision.reason is Reason.WORKER_WEDGED


class UtcTimes:
    """Makes PostgreSQL read and write ``timestamp`` (without time zone) columns as UTC for
    the rest of the connection's transaction, whatever the role's TimeZone: called before
    the first time is read or written by a source whose system stores naive UTC. Set once
    per transaction (the kit keeps one in each transaction's state); nothing to do on
    SQLite, nor on MySQL, whose ``DATETIME`` columns are never converted and whose
    sessions the engine sets to ``time_zone = '+00:00'`` (``TIMESTAMP`` columns read as
    UTC, beside ``UTC_TIMESTAMP(6)``)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._set = False

    def __call__(self) -> None:
        if self._conn.dialect.name == "postgresql" and not self._set:
            self._conn.execute(sa.select(sa.func.set_config("TimeZone", "UTC", True)))
            self._set = True


def reason_text(change: PlannedChange) -> str:
    """Our reason code, as written into a foreign system's error field."""
    return change.decision.reason.value


@dataclass(frozen=True, slots=True)
class Shape:
    """What a system is, as plain values the kit reads (it never calls back for them):
    built once by the system's declaration from its config alone."""

    key: sa.ColumnElement[Any]
    """The job's id, in the scan's FROM; pages and cursors follow it."""
    kind: sa.ColumnElement[Any]
    """The job's kind, in the scan's FROM."""
    locks: Any
    """The table ``FOR UPDATE OF`` names (the job table, not an outer-joined one)."""
    scan_order: sa.ColumnElement[Any] | None = None
    """The wedged scan's order where the key's own is the wrong one for the system's
    indexes; None: the kit's (``default_order``)."""
    kind_catalogue: sa.Select[Any] | None = None
    """Every kind a job can have, from a small table of the system's own (its queues or
    tasks), so reading the kinds costs no read of the job table; None: read from the
    running jobs."""
    activity: sa.ColumnElement[Any] | None = None
    """The job's own last-activity time, if the system keeps one (else the ledger's last
    write is its activity)."""
    steps_in_ledger: bool = True
    """Whether jobs' steps are read from the step ledger (False: the system keeps its own
    plan and results, and the ledger is neither read nor checked)."""
    leases_own: bool = True
    """Whether a running job carries a lease or an owner's liveness of its own (False:
    only its kind's ``max_run_seconds`` ends one, so a kind without it is never
    reclaimed)."""
    counts_attempts: bool = True
    """Whether the system counts a job's attempts (each run one more): the crash-loop
    count chains the audit's resumes on that counter."""
    scans_all_kinds: bool = False
    """Whether the scans may judge every kind alike unread (``AllKinds``): its SQL reads
    policies only through ``by_kind`` and the kit's kind filter, never iterating over
    them."""
    naive_utc: Literal["scan", "swap"] | None = None
    """Where its timestamps are naive UTC, when the kit first sets the transaction's
    TimeZone to UTC: before the scans read (and the swaps write), or before the swaps
    only; None: never (``UtcTimes``)."""
    lock_by: Callable[[Sequence[Any]], sa.ColumnElement[bool]] | None = None
    """The scanned rows of some keys (job ids as the scan read them) by the lock target's
    primary key, where ``key`` is an expression no index answers: MySQL locks the rows it
    finds so, reading those rows only (None: ``key IN (...)``)."""
    judged_first: bool = False
    """Whether its liveness's verdict loads what ``running`` reads (a snapshot of a store
    outside SQL, in a temporary table): the verdict is then read before any read of its
    jobs, the list of the running kinds included."""

    def order(self, postgres: bool) -> sa.ColumnElement[Any]:
        """The scans' order: the declared one, else on PostgreSQL the key in its own
        order but not its index's (``coalesce(id, id)``). Else PostgreSQL walks the key's
        index under ``LIMIT``, expecting a third of the running rows expired, every heap
        tuple read when none is; so ordered, it reads the running rows by its cheapest
        path and sorts the few."""
        if self.scan_order is not None:
            return self.scan_order
        return sa.func.coalesce(self.key, self.key) if postgres else self.key


def step_results(raw: Any) -> StepRows | None:
    """A system's own step results, ``{"<index>": "started" | ...}`` (JSON text or
    the object), as step records; None for what cannot be read."""
    if raw is None:
        return ()
    try:
        data = json.loads(raw) if isinstance(raw, str | bytes) else raw
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    rows = []
    for key, state in data.items():
        try:
            index = int(key)
        except (TypeError, ValueError):
            return None
        if not isinstance(state, str):
            return None
        rows.append((index, state, None))
    return tuple(sorted(rows))
