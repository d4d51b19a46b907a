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

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.evidence import PlanStep, StepFacts, StepRows
from reconciler.core.kinds import KindPolicy, KindRules
from reconciler.core.policy import reclaimed_attempt_outcome
from reconciler.core.ports import Candidate, Cursor, Fence, JobKey, PlannedChange
from reconciler.core.vocabulary import AttemptOutcome, Disposition, Reason, StepState
from reconciler.errors import ConfigError
from reconciler.storage.audit import AuditHistory


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
              activity_age_seconds: float | None = None) -> Candidate:
    """A foreign candidate: the job's own plan and step results when its system keeps them
    (``own_plan``: raw plan text, possibly None, and step records), else the ledger's
    steps, else one step named after its kind. ``activity_age_seconds`` is the system's own
    activity; without one, the ledger's last write."""
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
        position=Cursor((job_id,)) if position else None,
    )


def lost_in_a_row_resumed(attempt: int, resumes: Sequence[tuple[str, Any]], *,
                          counted: bool = True) -> int:
    """The crash-loop count of a foreign job in its ``attempt``-th attempt: this attempt
    (its worker is gone when the rule reads it), then each earlier attempt the reconciler
    took back from a dead worker and resumed, newest first (``resumes``: the reason and the
    recorded ``attempts_used`` of the job's applied resumes, newest first).

    As the native count, it stops at an attempt that ended any other way: a gap in the
    system's attempt counter (a run in between ended by its own worker, whose failure the
    system retried), a counter that went back (an operator's retry), a resume that did not
    end a lost attempt, the same count again (a job id used anew: its history is another
    job's). A terminalization is never counted: only someone's retry runs the job again
    after one, and a retry starts the count afresh. ``counted=False``: the system counts no
    attempts (a table without ``attempts_column``), its counter never moves, and each resume
    is counted, which is all the history it has.
    """
    count, later = 1, attempt
    for reason, used in resumes:
        try:
            lost = reclaimed_attempt_outcome(Reason(reason)) is AttemptOutcome.LOST
        except ValueError:
            break
        if not lost or isinstance(used, bool) or not isinstance(used, int) \
                or used != (later - 1 if counted else later):
            break
        count, later = count + 1, used
    return count


def with_lost_attempts(audit: AuditHistory, found: list[Candidate], *,
                       counted: bool = True) -> list[Candidate]:
    """The candidates with ``lost_attempts_in_a_row`` counted from the audit: the applied
    (not shadow) resumes of each job under this source, in one read for the batch
    (``counted``: whether the system counts attempts, see ``lost_in_a_row_resumed``)."""
    texts = sorted({str(c.job_id) for c in found})
    if not texts:
        return found
    history = audit.applied_resumes(texts)
    return [dataclasses.replace(c, lost_attempts_in_a_row=lost_in_a_row_resumed(
                c.attempt_count, history.get(str(c.job_id), ()), counted=counted))
            for c in found]


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
    per transaction (a source lives for one); nothing to do on SQLite."""

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


def require_columns(conn: Connection, source: str, table: str, schema: str | None,
                    columns: Mapping[str, str]) -> dict[str, Any]:
    """Each named column of the table, or one ``ConfigError`` line naming what is missing.

    ``columns`` maps the config key (or the system's own name) to the column name.
    """
    inspector = sa.inspect(conn)
    where = f"schema {schema!r}" if schema else "the default schema"
    if not inspector.has_table(table, schema=schema):
        raise ConfigError(f"source {source}: table {table!r} not found in {where}")
    found = {c["name"]: c for c in inspector.get_columns(table, schema=schema)}
    for key, column in columns.items():
        if column not in found:
            label = f" ({key})" if key != column else ""
            raise ConfigError(f"source {source}: column {column!r}{label} not found in "
                              f"table {table!r}")
    return found


_FUNCTION_EXISTS = sa.text(
    "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
    "WHERE p.proname = :name AND (n.nspname = CAST(:schema AS text) OR "
    "(CAST(:schema AS text) IS NULL AND n.nspname = ANY (current_schemas(false))))")


def require_functions(conn: Connection, source: str, schema: str | None,
                      names: Sequence[str]) -> None:
    """Each named SQL function exists (PostgreSQL), or one line naming the first missing."""
    for name in names:
        if not conn.execute(_FUNCTION_EXISTS, {"name": name, "schema": schema}).scalar():
            where = f"schema {schema!r}" if schema else "the search path"
            raise ConfigError(f"source {source}: function {name}() not found in {where}")


def require_postgresql(conn: Connection, source: str) -> None:
    """Foreign job systems live in PostgreSQL; anything else is one line."""
    if conn.dialect.name != "postgresql":
        raise ConfigError(f"source {source} needs PostgreSQL (the database_url is "
                          f"{conn.dialect.name})")
