"""What the conformance suite asks of a job source's test fixture.

The suite never touches a source's tables. It makes situations only through the source's
fixture (``SourceFixture.make``: a factory that puts a job in any state), runs the pass
through it, and observes the outcome in neutral words (``running``, ``runnable``,
``failed``, ``completed``) that every source maps from its own statuses. A source is
supported when this suite passes against it on every engine it runs on; a situation the
source cannot express is declared (``supports``) and skipped with a reason naming it.

Time is part of a situation: a fixture ages what its source stores (lease, activity,
owner heartbeat) relative to ``TIMING``, the thresholds every pass of the suite runs with,
so no test waits for a clock.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, NamedTuple, Protocol

from reconciler.core.brake import BrakeLimits
from reconciler.core.decisions import Decision
from reconciler.core.evidence import PlanStep
from reconciler.core.passes import PassReport
from reconciler.core.vocabulary import EffectKind
from reconciler.root.cli import CliParts

JobKey = int | str
"""A job's id as its source spells it (an integer for ``native``, a UUID text for pg-boss)."""

Outcome = Literal["running", "runnable", "failed", "completed"]
"""A job's status in neutral words: claimed and not finished; waiting for a worker to take
it (a resume); ended failed; ended done. Each source maps its own statuses onto these."""

PLAN_LENGTH = 3
"""Steps in every plan the suite asks for, so step 1 has a step before and after it."""


@dataclass(frozen=True, slots=True)
class Timing:
    """The thresholds of every pass the suite runs, and the clock ages a fixture gives
    its situations relative to them (seconds, on the database's clock)."""

    stale_after_seconds: float = 60.0
    wedged_after_seconds: float = 3600.0
    session_timeout_seconds: float = 30.0
    lease_seconds: float = 300.0
    """A live lease: longer than any test, so it never runs out while a test runs."""
    lease_expired_seconds: float = 90.0
    """How long ago a dead owner's lease ran out."""
    idle_seconds: float = 120.0
    """How long ago a dead owner last made progress: more than ``stale_after_seconds``."""
    recent_seconds: float = 10.0
    """How long ago a recently active job made progress: less than ``stale_after_seconds``."""
    crash_loop_after: int = 2
    """Attempts lost in a row that end a job ``crash_loop`` (the setting's default)."""

    def __post_init__(self) -> None:
        # Each age must sit on its intended side of the threshold it is judged by.
        assert self.recent_seconds < self.stale_after_seconds < self.idle_seconds
        assert self.lease_expired_seconds < self.idle_seconds < self.wedged_after_seconds
        assert self.session_timeout_seconds < self.lease_seconds


TIMING = Timing()


class State(StrEnum):
    """The situations a fixture can put a job in. Step ``N`` is ``Situation.step``."""

    LIVE = "live"
    """Claimed by a live owner: its lease is live and it made progress just now."""
    DIED_BEFORE_STEP = "died_before_step"
    """Steps before N succeeded, step N never started; the lease expired long ago."""
    DIED_MID_STEP = "died_mid_step"
    """Steps before N succeeded, step N started (of ``Situation.effect``); lease expired."""
    OWNER_GONE = "owner_gone"
    """Died before step N, the lease still live but its owner silent past
    ``TIMING.session_timeout_seconds`` (the source's owner liveness says it is gone)."""
    STEP_FAILED = "step_failed"
    """Step N failed, not retryable, then the owner died (lease expired)."""
    STEP_FAILED_RETRYABLY = "step_failed_retryably"
    """Step N failed retryably (nothing of it applied), then the owner died."""
    COMPLETION_UNRECORDED = "completion_unrecorded"
    """Every step succeeded, the owner died before recording completion."""
    HELD = "held"
    """Died before step N, and held by an operator."""
    GATED = "gated"
    """Steps before N succeeded, step N waits on an external gate; lease expired."""
    OUT_OF_ATTEMPTS = "out_of_attempts"
    """Died before step N on its last allowed attempt."""
    WEDGED = "wedged"
    """In step N under a live lease, no progress for more than ``wedged_after_seconds``."""
    RECENTLY_ACTIVE = "recently_active"
    """Died before step N, lease expired, but progress younger than ``stale_after_seconds``."""
    PLAN_UNREADABLE = "plan_unreadable"
    """Died before step N, and its stored step plan cannot be read."""
    EVIDENCE_UNREADABLE = "evidence_unreadable"
    """Died before step N, and its stored facts contradict each other (a step record
    outside its plan): the pass cannot evaluate it."""
    OWNER_REBORN = "owner_reborn"
    """Died before step N, and a later process answers under its owner's name (restarted
    under the same name) without holding the job: an orphan, decided like any other."""
    OWNER_REBORN_HOLDING = "owner_reborn_holding"
    """A later process under the owner's old name holds the job again (it took it anew,
    after its predecessor died): its owner is alive."""


REBORN_STATES = (State.OWNER_REBORN, State.OWNER_REBORN_HOLDING)
"""The situations of an owner's name taken by a later process: only a source whose
liveness names an owner by a name a new process can take expresses them."""


@dataclass(frozen=True, slots=True)
class Situation:
    """A state, the step it is at, and the effect kind of that step."""

    state: State
    step: int = 1
    effect: EffectKind = EffectKind.EFFECTFUL

    @property
    def plan(self) -> tuple[PlanStep, ...]:
        """``PLAN_LENGTH`` steps; step N has ``effect``, the others are idempotent."""
        return tuple(
            PlanStep(f"step{i}", self.effect if i == self.step else EffectKind.IDEMPOTENT)
            for i in range(PLAN_LENGTH)
        )

    def __str__(self) -> str:
        return f"{self.state.value}@{self.step}:{self.effect.value}"


class Interference(StrEnum):
    """A change another process makes to a job between a pass's decision and its apply."""

    LATE_HEARTBEAT = "late_heartbeat"
    """The owner was only slow: it renews its lease (no progress, no new generation)."""
    LATE_PROGRESS = "late_progress"
    """The owner was only slow: it reports progress."""
    LATE_COMPLETION = "late_completion"
    """The owner was only slow: it records the job completed."""
    RECLAIM = "reclaim"
    """Another replica recovered the job and another worker claimed it, then died as well,
    so only the fence (not the lease's expiry) tells the late decision apart."""


class Feature(StrEnum):
    """What a source may or may not keep about a job."""

    RESUME_STEP = "resume_step"
    """A resumed job records the step its next run starts at."""
    REASON = "reason"
    """A terminalized job keeps the reconciler's reason code in a field of its own."""
    GENERATION = "generation"
    """A monotonic counter every claim and every transition bumps (the audit's
    ``generation_before`` / ``generation_after``)."""
    RECOVERS_COMPLETION = "recovers_completion"
    """A job whose every step succeeded but whose completion was never recorded is
    finished ``completed`` (``completion_recovered``) instead of failed
    (``completion_unrecorded``): the source can record the completion itself."""
    PARKS = "parks"
    """A held or gated job, once recorded, is left out of later scans (it fills no batch)
    until something about it changes; a source that cannot park rescans it."""


Capability = Situation | Interference | Feature


class AuditEntry(NamedTuple):
    """One row of the audit trail (``reconciliation_decisions``) about one job."""

    pass_id: int
    job_id: JobKey
    disposition: str
    reason: str
    generation_before: int | None
    generation_after: int | None


@dataclass(frozen=True, slots=True)
class SourceJob:
    """A job a fixture made: its key as the source spells it, and its fence's generation
    when it was made (None where the source keeps none)."""

    key: JobKey
    generation: int | None


@dataclass(frozen=True, slots=True)
class InterruptedPass:
    """A pass split at its seam: what it decided, then what it recorded after the
    interference ran between the two."""

    decided: tuple[Decision, ...]
    report: PassReport


class SourceFixture(Protocol):
    """A source under test: makes situations, runs the pass, observes outcomes.

    Every method works on the database the fixture was opened on; writes that stand for
    another process (a worker, another replica) go through connections of their own, never
    the pass's.
    """

    source_name: str
    """The source's name in the configuration: ``native``, ``procrastinate``, ..."""

    def supports(self, what: Capability) -> bool:
        """Whether the source can express this situation, interference or feature."""

    def why_unsupported(self, what: Capability) -> str:
        """One line naming the source and the gap, e.g. "pg-boss has no operator hold"."""

    def make(self, situation: Situation) -> SourceJob:
        """Enqueue a job and put it in ``situation`` through the source's own worker API
        (and the fewest direct writes that move its clock)."""

    def interfere(self, job: SourceJob, change: Interference) -> None:
        """Make ``change`` to the job as the other process would, on its own connection."""

    def status(self, job: SourceJob) -> Outcome:
        """The job's status, in neutral words."""

    def reason(self, job: SourceJob) -> str | None:
        """The reason code the job carries (``Feature.REASON``), else None."""

    def resume_step(self, job: SourceJob) -> int | None:
        """The step the job's next run starts at (``Feature.RESUME_STEP``), else None."""

    def generation(self, job: SourceJob) -> int | None:
        """The job's fence generation now (``Feature.GENERATION``), else None."""

    def snapshot(self, job: SourceJob) -> object:
        """Everything the source stores about the job, comparable with ``==``: a job left
        untouched has an equal snapshot before and after."""

    def audit(self, job: SourceJob) -> list[AuditEntry]:
        """Every audit record about the job, oldest first."""

    def operator(self) -> CliParts:
        """What a ``reconciler`` command works with on this database, under the suite's
        settings: ``jobs show`` and ``jobs list`` (``jobs``), ``jobs explain``
        (``passes``) and the operator actions (``desk``)."""

    def run_pass(self, *, batch_size: int = 50, dry_run: bool = False,
                 after: object | None = None, brake: BrakeLimits | None = None) -> PassReport:
        """One pass with ``TIMING``'s thresholds, continuing after a previous pass's
        ``next_cursor`` as the sidecar does; with the mass-staleness brake only when
        ``brake`` is given (the suite's situations go stale together on purpose)."""

    def run_interrupted_pass(self, between: Callable[[], None], *,
                             batch_size: int = 50) -> InterruptedPass:
        """One pass whose decide and apply are separated by ``between`` (a concurrent
        change), as a slower replica's would be: the apply repeats the fences it decided
        on and records what it finds."""


@dataclass(frozen=True, slots=True)
class RegisteredSource:
    """A source the suite runs against: its name, the engines it runs on, and how to open
    its fixture on a migrated database of one of them (closed when the test ends)."""

    name: str
    engines: tuple[str, ...]
    open: Callable[[Any], AbstractContextManager[SourceFixture]]
    shared: bool = False
    """False: ``open`` takes a fresh migrated database's URL. True: ``open`` takes the
    test's ``pytest.FixtureRequest`` and opens on a database shared by the session (a real
    system's schema, installed once), emptied for the test."""
    label: str | None = None
    """The cases' name where one source has several fixtures (else the source's name)."""
