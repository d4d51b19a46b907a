"""What a foreign source declares: one frozen ``System``, its ``Shape`` and its own SQL.

A system's package builds its ``System`` from its config alone (no database read), once
per process; the kit (``kit.source.DeclaredSource``) binds it to one transaction. Every
function here takes what it needs as arguments (a ``Scope``: the connection, the ports
of this project's tables, the liveness verdict read for the transaction; the kinds'
policies; a ``Batch``) and returns SQL, facts or the jobs it changed: none calls the kit
back, and none keeps state of its own between calls.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.evidence import StepFacts
from reconciler.core.kinds import KindPolicy, KindRules
from reconciler.core.ports import Candidate, JobKey, LivenessUnknown, StuckWork, Unjudged
from reconciler.core.vocabulary import JobStatus
from reconciler.sources.kit.batches import Batch
from reconciler.sources.kit.shapes import Shape
from reconciler.storage.audit import AuditHistory
from reconciler.storage.step_ledger import PassLedger

Policies = Mapping[str, KindPolicy]
Changed = dict[JobKey, int | None]
"""The jobs a swap changed, each with its generation after."""


@dataclass(frozen=True, slots=True)
class Scope:
    """What a declared function is given for one transaction: made by the kit per call."""

    conn: Connection
    """The pass's transaction (or an operator's read): its dialect, and where to execute."""
    ledger: PassLedger
    """The step ledger's reads and fences for this source (its own store writes them)."""
    history: AuditHistory
    """The audit's past resumes of this source's jobs."""
    verdict: Any = None
    """The declared liveness's verdict for this transaction (None: it has none, or the
    call reads no job's liveness)."""

    @property
    def postgres(self) -> bool:
        """Whether the connection is PostgreSQL's (else SQLite's or MySQL's: a statement
        per change, judged by its affected rows)."""
        return self.conn.dialect.name == "postgresql"


@dataclass(frozen=True, slots=True)
class Loaded:
    """What a liveness verdict put where the declared SQL reads the running jobs."""

    rows: int | None
    """How many running jobs it loaded (None: they are the system's own rows, read by the
    SQL itself): none loaded, a pass reads nothing more."""
    counted: int = 0
    """The live jobs it counted without loading them, which the brake's count of running
    jobs adds (no expired scan reads a live job)."""
    every: bool = True
    """Whether a later read needs no more of it: it loaded every running job (or read
    nothing, its outside end unanswering), else only those the scans can find."""


Silent = Callable[[Sequence[str]], Collection[str]]
"""Of some running jobs' keys, those whose step ledger went silent long enough that the
wedged scan reads them."""

NOT_LOADED = Loaded(rows=None)
"""A source without a declared liveness: its running jobs are its own rows."""


class Liveness(Protocol):
    """Owner liveness kept outside the system's tables (a broker): one object per process,
    which may remember what it saw across passes; its verdict is read once per
    transaction and handed to the declared functions in their ``Scope``."""

    def judge(self, conn: Connection, kinds: KindRules, *, every: bool,
              silent: Silent | None) -> object:
        """The verdict of one transaction (never None). ``every``: over every running job
        (an operator's read); else it may leave out the live ones, which no expired scan
        reads, and only count them (``loaded``), but for those ``silent`` keeps (the live
        jobs the wedged scan may find; None: it does not run)."""

    def loaded(self, verdict: Any) -> Loaded:
        """What of the running jobs the verdict loaded and what it only counted."""

    def unknown(self, verdict: Any) -> LivenessUnknown | None:
        """Why the verdict was not trusted (None: it was)."""

    def stuck(self, verdict: Any) -> StuckWork:
        """Running jobs no pass decides, by reason, beside the kit's expired count."""

    def check(self) -> None:
        """One ``ConfigError`` line when its outside end cannot be reached at all."""


@dataclass(frozen=True, slots=True)
class Wanted:
    """What an operator's read wants of a system's listing: the newest ``limit`` jobs
    (only of the system's own ``statuses`` when given), or the one job ``job_id``."""

    limit: int | None = None
    statuses: frozenset[str] | None = None
    job_id: str | None = None


Running = Callable[[Scope, Policies], sa.Select[Any]]
Predicate = Callable[[Scope, Policies], sa.ColumnElement[bool]]


@dataclass(frozen=True, slots=True)
class System:
    """A foreign system, declared: plain values and its own SQL, read by the kit."""

    shape: Shape
    """Key, kind, lock target, scan order, kind catalogue, activity and flags."""
    running: Running
    """Every running job, unfiltered by lease, with ``job_id``, ``job_kind`` and
    ``lease_expired_seconds`` (seconds past the lease's end under the policies, negative
    while it runs, NULL when it has none) labelled, the rest its own."""
    expired: Predicate
    """True for a running job whose owner is gone or whose lease ran out (never NULL for a
    job of a kind in the policies)."""
    candidate: Callable[[Scope, sa.Row[Any], KindPolicy, StepFacts | None, bool], Candidate]
    """One row of ``running`` as candidate facts with its fence snapshot (the last
    argument: whether it carries its place in the scan)."""
    swap: Callable[[Scope, Batch], Changed]
    """A batch of changes written as the system's own functions write them, repeating
    each row's fence and the batch's time predicate, and fencing the ledger of each job
    changed (``batch.ledger``); the jobs changed."""
    check_schema: Callable[[Connection], None]
    """One ``ConfigError`` line for what of the system's schema is missing."""
    listing: Callable[[Connection], sa.Select[Any]]
    """Every job for operators, with ``job_id``, ``job_kind``, ``source_status``,
    ``attempts``, ``max_attempts``, ``reason``, ``created_at``, ``updated_at`` and
    ``finished_at`` (when an ended job ended, by the system's own record; NULL where it
    keeps none: the audit's time of the move that ended it stands in); and, where the
    system keeps its own, ``resume_step`` (else the step ledger's first unfinished step
    stands in), and ``own_plan`` and ``own_steps``: its plan and step results (``{"<index>":
    state}``), read instead of the step ledger's."""
    status_words: Mapping[str, JobStatus]
    """The system's statuses (``source_status``) in this project's words."""
    wedge_guard: Predicate | None = None
    """What else must hold before a live job counts as wedged (None: nothing)."""
    after_apply: Callable[[Connection, Changed], None] | None = None
    """What the system's workers are told once a pass's swaps are done (a nudge)."""
    listing_order: Callable[[sa.Subquery], list[sa.ColumnElement[Any]]] | None = None
    """``jobs list``'s order over ``listing`` (None: newest created first, then by id)."""
    unjudged: Callable[[Connection, JobKey | None], Unjudged | None] | None = None
    """Running jobs whose rows lack what a pass reads (None: every running row is judged)."""
    liveness: Liveness | None = None
    """Owner liveness outside its tables (None: read with its jobs, in ``expired``)."""
    listing_for: Callable[[Connection, Wanted], sa.Select[Any]] | None = None
    """``listing`` narrowed to what a read wants, for a system whose jobs live outside
    SQL and are copied in for each read, so that ``jobs list --limit 50`` copies few
    (None: ``listing``, narrowed in SQL)."""
