"""The invariants a chaos run (or a mutation test) must keep, checked after the fact.

Inputs: the job database (jobs, step records, attempts, decisions, operator actions) and
the chaos ledger (tests/chaos/ledger.py: handler begins, effects, the write log). Every
count must be 0. Each count gathers a few rules; a violation names its rule and job, so a
failure says what broke, not only that something did.

- ``jobs_lost``: a job not terminal after the drain.
- ``effects_repeated``: an effectful step whose effect the ledger shows more than once.
- ``stale_generation_writes``: a write that landed for a generation that was already over:
  a completed attempt whose job was later overwritten; a reconciler decision applied to an
  attempt its worker had already ended; a fenced worker write that started after its
  attempt had ended and still landed; a step record of an unknown generation; a job
  completed with a step that never succeeded.
- ``attempts_over_budget``: more attempts than ``max_attempts`` (counter, claims, or a
  resume decided on a spent budget).
- ``unexplained_transitions``: a generation bump with no claim (attempt row), applied
  decision or operator action; a final state no record explains; an attempt closed by
  the reconciler without a decision, or left open after its job ended.
- ``evidence_contradicting_ledger``: a decision whose recorded evidence says a step never
  started while the ledger shows it began (or was recorded started); evidence of a step
  record no write ever made; an effectful step recorded succeeded (or a job completed)
  without its effect in the ledger.
- ``poison_not_contained``: a poison job (its step SIGKILLs every worker that runs it) not
  ended ``failed`` ``crash_loop``, or begun by more workers than ``crash_loop_after``.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from models import JobAttempt, JobRun, OperatorAction, ReconciliationDecision, StepRun
from reconciler.config.settings import Settings
from reconciler.core.vocabulary import Reason
from tests.chaos.chaos_worker import POISON_KIND
from tests.chaos.ledger import FENCED_OPS, LedgerData, read_ledger

jobs_table = cast(sa.Table, JobRun.__table__)
steps_table = cast(sa.Table, StepRun.__table__)
attempts_table = cast(sa.Table, JobAttempt.__table__)
decisions_table = cast(sa.Table, ReconciliationDecision.__table__)
actions_table = cast(sa.Table, OperatorAction.__table__)

STALE = "stale_generation_writes"
EVIDENCE = "evidence_contradicting_ledger"
COUNTS = (
    "jobs_lost",
    "effects_repeated",
    STALE,
    "attempts_over_budget",
    "unexplained_transitions",
    EVIDENCE,
    "poison_not_contained",
)
# The replicas run with the default, so a poison job may take this many workers down.
CRASH_LOOP_AFTER = int(Settings.model_fields["crash_loop_after"].default)
TERMINAL = frozenset({"completed", "failed", "cancelled"})
RECONCILER_REASONS = frozenset(r.value for r in Reason)
# SQLite's clock ticks in milliseconds (truncated), so an attempt's recorded end may be up
# to 1 ms before the real one; a write must start later than this to be called stale.
WRITE_MARGIN_SECONDS = 0.002
EXAMPLES_PER_RULE = 3


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken invariant: which count, which rule, which job, what was seen."""

    check: str
    rule: str
    job_id: int
    detail: str


@dataclass(frozen=True, slots=True)
class Job:
    kind: str
    status: str
    reason: str | None
    generation: int
    attempt_count: int
    max_attempts: int
    effect_kinds: tuple[str, ...] | None


@dataclass(frozen=True, slots=True)
class Attempt:
    outcome: str | None
    ended_by: str | None
    ended_at: float | None


@dataclass(frozen=True, slots=True)
class AppliedDecision:
    job_id: int
    disposition: str
    reason: str
    generation_before: int
    generation_after: int
    evidence: dict[str, Any]


@dataclass
class Database:
    """The rows the checks read, loaded once."""

    jobs: dict[int, Job] = field(default_factory=dict)
    steps: dict[tuple[int, int], tuple[str, int]] = field(default_factory=dict)
    attempts: dict[tuple[int, int], Attempt] = field(default_factory=dict)
    decisions: list[AppliedDecision] = field(default_factory=list)
    action_generations: list[tuple[int, int]] = field(default_factory=list)
    decision_reasons: Counter[str] = field(default_factory=Counter)


@dataclass
class CheckReport:
    """Violations found, plus facts about the run that are not invariants."""

    violations: list[Violation]
    facts: dict[str, Any]

    @property
    def counts(self) -> dict[str, int]:
        """Violations per count; every count present, all must be 0."""
        found = Counter(v.check for v in self.violations)
        return {name: found.get(name, 0) for name in COUNTS}

    @property
    def by_rule(self) -> dict[str, int]:
        """Violations per rule (``check/rule``), for saying which rule caught a mutation."""
        return dict(sorted(Counter(f"{v.check}/{v.rule}" for v in self.violations).items()))

    @property
    def ok(self) -> bool:
        return not self.violations

    def examples(self) -> list[Violation]:
        """A few violations of each rule."""
        shown: Counter[str] = Counter()
        out = []
        for v in self.violations:
            key = f"{v.check}/{v.rule}"
            if shown[key] < EXAMPLES_PER_RULE:
                shown[key] += 1
                out.append(v)
        return out

    def render(self) -> str:
        """The counts, then examples of what broke, as text."""
        width = max(len(name) for name in COUNTS)
        lines = ["invariant counts (all must be 0):"]
        lines += [f"  {name:<{width}}  {count}" for name, count in self.counts.items()]
        if self.violations:
            lines.append("violations by rule:")
            lines += [f"  {rule}: {count}" for rule, count in self.by_rule.items()]
            lines.append("examples:")
            lines += [f"  job {v.job_id}: {v.check}/{v.rule}: {v.detail}"
                      for v in self.examples()]
        return "\n".join(lines)


def _timestamp(value: Any) -> float | None:
    return None if value is None else float(value.timestamp())


def _evidence(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        value = json.loads(value)
    return value if isinstance(value, dict) else {}


def _effect_kinds(plan: Any) -> tuple[str, ...] | None:
    if isinstance(plan, str):
        plan = json.loads(plan)
    if not isinstance(plan, list):
        return None
    return tuple(str(step.get("effect_kind")) for step in plan)


def load_database(engine: Engine) -> Database:
    """Read what the checks need from the job database."""
    db = Database()
    with engine.connect() as conn:
        for r in conn.execute(sa.select(
            jobs_table.c.job_id, jobs_table.c.job_kind, jobs_table.c.job_status,
            jobs_table.c.status_reason,
            jobs_table.c.claim_generation, jobs_table.c.attempt_count,
            jobs_table.c.max_attempts, jobs_table.c.step_plan,
        )):
            db.jobs[int(r.job_id)] = Job(
                r.job_kind, r.job_status, r.status_reason, int(r.claim_generation),
                int(r.attempt_count), int(r.max_attempts), _effect_kinds(r.step_plan))
        for r in conn.execute(sa.select(
            steps_table.c.job_id, steps_table.c.step_index, steps_table.c.step_state,
            steps_table.c.claim_generation,
        )):
            db.steps[(int(r.job_id), int(r.step_index))] = (r.step_state,
                                                            int(r.claim_generation))
        for r in conn.execute(sa.select(
            attempts_table.c.job_id, attempts_table.c.claim_generation,
            attempts_table.c.attempt_outcome, attempts_table.c.ended_by,
            attempts_table.c.ended_at,
        )):
            db.attempts[(int(r.job_id), int(r.claim_generation))] = Attempt(
                r.attempt_outcome, r.ended_by, _timestamp(r.ended_at))
        for r in conn.execute(
            sa.select(decisions_table.c.decision_reason, sa.func.count())
            .group_by(decisions_table.c.decision_reason)
        ):
            db.decision_reasons[str(r[0])] = int(r[1])
        for r in conn.execute(sa.select(
            decisions_table.c.job_id, decisions_table.c.disposition,
            decisions_table.c.decision_reason, decisions_table.c.generation_before,
            decisions_table.c.generation_after, decisions_table.c.decision_evidence,
        ).where(decisions_table.c.generation_after.is_not(None))):
            db.decisions.append(AppliedDecision(
                int(r.job_id), r.disposition, r.decision_reason, int(r.generation_before),
                int(r.generation_after), _evidence(r.decision_evidence)))
        for r in conn.execute(sa.select(
            actions_table.c.job_id, actions_table.c.generation_after,
        ).where(actions_table.c.action_outcome == "applied",
                actions_table.c.generation_after > actions_table.c.generation_before)):
            db.action_generations.append((int(r.job_id), int(r.generation_after)))
    return db


class _Checker:
    def __init__(self, db: Database, ledger: LedgerData, margin: float) -> None:
        self.db = db
        self.ledger = ledger
        self.margin = margin
        self.actions = set(db.action_generations)
        self.violations: list[Violation] = []

    def add(self, check: str, rule: str, job_id: int, detail: str) -> None:
        self.violations.append(Violation(check, rule, job_id, detail))

    def kind_of(self, job_id: int, step_index: int) -> str | None:
        job = self.db.jobs.get(job_id)
        if job is not None and job.effect_kinds is not None:
            if 0 <= step_index < len(job.effect_kinds):
                return job.effect_kinds[step_index]
            return None
        return self.ledger.effect_kinds.get((job_id, step_index))

    def run(self) -> None:
        self.jobs_lost()
        self.effects_repeated()
        self.stale_generation_writes()
        self.attempts_over_budget()
        self.unexplained_transitions()
        self.evidence_contradicting_ledger()
        self.poison_not_contained()

    # -- the counts ------------------------------------------------------------------------

    def poison_not_contained(self) -> None:
        begun: Counter[int] = Counter(job_id for job_id, _, _ in self.ledger.began)
        for job_id, job in self.db.jobs.items():
            if job.kind != POISON_KIND:
                continue
            if (job.status, job.reason) != ("failed", Reason.CRASH_LOOP.value):
                self.add("poison_not_contained", "not_quarantined", job_id,
                         f"{job.status} ({job.reason})")
            if begun[job_id] > CRASH_LOOP_AFTER:
                self.add("poison_not_contained", "fed_too_many_workers", job_id,
                         f"begun by {begun[job_id]} workers, crash_loop_after "
                         f"{CRASH_LOOP_AFTER}")

    def jobs_lost(self) -> None:
        for job_id, job in self.db.jobs.items():
            if job.status not in TERMINAL:
                self.add("jobs_lost", "not_terminal", job_id, f"status {job.status}")

    def effects_repeated(self) -> None:
        for (job_id, step_index), generations in self.ledger.effects.items():
            if len(generations) > 1 and self.kind_of(job_id, step_index) == "effectful":
                self.add("effects_repeated", "effect_ran_twice", job_id,
                         f"step {step_index} effect done in generations {generations}")

    def stale_generation_writes(self) -> None:
        self._completed_attempts_overwritten()
        self._decisions_on_ended_attempts()
        self._writes_after_attempt_ended()
        self._step_rows_of_unknown_generations()
        self._completed_with_unfinished_steps()

    def _completed_attempts_overwritten(self) -> None:
        for (job_id, generation), attempt in self.db.attempts.items():
            job = self.db.jobs.get(job_id)
            # A completion the reconciler recorded (completion_recovered) ends the attempt
            # completed and moves the job one generation past it.
            final = generation + (attempt.ended_by == "reconciler")
            if attempt.outcome == "completed" and job is not None and (
                job.generation != final or job.status != "completed"
            ):
                self.add(STALE, "completed_attempt_overwritten", job_id,
                         f"attempt {generation} completed, job is {job.status} at "
                         f"generation {job.generation}")

    def _decisions_on_ended_attempts(self) -> None:
        for d in self.db.decisions:
            attempt = self.db.attempts.get((d.job_id, d.generation_before))
            if attempt is not None and attempt.ended_by == "worker":
                self.add(STALE, "decision_on_ended_attempt", d.job_id,
                         f"{d.reason} applied to generation {d.generation_before}, whose "
                         f"worker had ended it ({attempt.outcome})")

    def _writes_after_attempt_ended(self) -> None:
        for call in self.ledger.calls:
            if call.outcome != "ok" or call.op not in FENCED_OPS or call.generation is None:
                continue
            attempt = self.db.attempts.get((call.job_id, call.generation))
            if attempt is None or attempt.ended_at is None:
                continue
            late = call.started - attempt.ended_at
            if late > self.margin:
                self.add(STALE, "write_after_attempt_ended", call.job_id,
                         f"{call.op} of generation {call.generation} started {late:.3f}s "
                         f"after that attempt ended ({attempt.outcome}) and landed")

    def _step_rows_of_unknown_generations(self) -> None:
        for (job_id, step_index), (state, generation) in self.db.steps.items():
            job = self.db.jobs.get(job_id)
            if (job_id, generation) not in self.db.attempts or (
                    job is not None and generation > job.generation):
                self.add(STALE, "step_row_unknown_generation", job_id,
                         f"step {step_index} ({state}) written by generation {generation}")

    def _completed_with_unfinished_steps(self) -> None:
        for job_id, job in self.db.jobs.items():
            if job.status != "completed" or job.effect_kinds is None:
                continue
            for step_index in range(len(job.effect_kinds)):
                row = self.db.steps.get((job_id, step_index))
                if row is None or row[0] != "succeeded":
                    self.add(STALE, "completed_with_unfinished_step", job_id,
                             f"step {step_index} is {row[0] if row else 'not started'}")

    def attempts_over_budget(self) -> None:
        db, check = self.db, "attempts_over_budget"
        claims: Counter[int] = Counter(
            job_id for (job_id, _), a in db.attempts.items() if a.outcome != "released")
        for job_id, job in db.jobs.items():
            if job.attempt_count > job.max_attempts:
                self.add(check, "attempt_count_above_max", job_id,
                         f"{job.attempt_count} of {job.max_attempts}")
            if claims[job_id] > job.max_attempts:
                self.add(check, "claims_above_max", job_id,
                         f"{claims[job_id]} claims, max_attempts {job.max_attempts}")
        for d in db.decisions:
            used, budget = d.evidence.get("attempts_used"), d.evidence.get("max_attempts")
            if d.disposition == "resume" and isinstance(used, int) and isinstance(budget, int) \
                    and used >= budget:
                self.add(check, "resumed_past_budget", d.job_id,
                         f"resumed with {used} of {budget} attempts used")

    def unexplained_transitions(self) -> None:
        db, check = self.db, "unexplained_transitions"
        explained: dict[int, Counter[int]] = defaultdict(Counter)
        for job_id, generation in db.attempts:
            explained[job_id][generation] += 1
        decided_at: dict[tuple[int, int], AppliedDecision] = {}
        for d in db.decisions:
            explained[d.job_id][d.generation_after] += 1
            decided_at[(d.job_id, d.generation_before)] = d
            if d.generation_after != d.generation_before + 1:
                self.add(check, "decision_skipped_generation", d.job_id,
                         f"{d.generation_before} -> {d.generation_after}")
        for job_id, generation in db.action_generations:
            explained[job_id][generation] += 1
        for job_id, job in db.jobs.items():
            seen = explained.get(job_id, Counter())
            for generation in range(1, job.generation + 1):
                if seen[generation] == 0:
                    self.add(check, "generation_unexplained", job_id,
                             f"nothing recorded the bump to generation {generation}")
                elif seen[generation] > 1:
                    self.add(check, "generation_explained_twice", job_id,
                             f"{seen[generation]} records bumped to generation {generation}")
            why = self._final_state_unexplained(job_id, job, decided_at)
            if why:
                self.add(check, "final_state_unexplained", job_id, why)
        for (job_id, generation), attempt in db.attempts.items():
            job = db.jobs.get(job_id)
            if attempt.ended_at is None and job is not None and job.status in TERMINAL:
                self.add(check, "attempt_left_open", job_id,
                         f"attempt {generation} open, job {job.status}")
            if attempt.ended_by == "reconciler" and (job_id, generation) not in decided_at:
                self.add(check, "attempt_closed_without_decision", job_id,
                         f"attempt {generation} ended by the reconciler, no decision")

    def _final_state_unexplained(self, job_id: int, job: Job,
                                 decided_at: dict[tuple[int, int], AppliedDecision]) -> str:
        final = self.db.attempts.get((job_id, job.generation))
        recovered = decided_at.get((job_id, job.generation - 1))
        if job.status == "completed" and recovered is not None:
            # The reconciler recorded a completion the worker did the work of: the attempt
            # it ended (the generation before) ended completed.
            before = self.db.attempts.get((job_id, job.generation - 1))
            if recovered.reason != "completion_recovered" or before is None \
                    or before.outcome != "completed":
                return (f"completed by a {recovered.reason} decision, attempt "
                        f"{before.outcome if before else 'missing'}")
        elif job.status == "completed":
            if final is None or final.outcome != "completed":
                return (f"completed, but the attempt of generation {job.generation} is "
                        f"{final.outcome if final else 'missing'}")
        elif job.status == "failed" and job.reason in RECONCILER_REASONS:
            d = decided_at.get((job_id, job.generation - 1))
            if d is None or d.disposition != "terminalize" or d.reason != job.reason:
                return f"failed ({job.reason}) with no such decision at generation " \
                       f"{job.generation}"
        elif job.status == "failed":
            if final is None or final.outcome != "failed":
                return (f"failed ({job.reason}), but the attempt of generation "
                        f"{job.generation} is {final.outcome if final else 'missing'}")
        elif job.status == "cancelled" and (job_id, job.generation) not in self.actions:
            return "cancelled with no operator action"
        return ""

    def evidence_contradicting_ledger(self) -> None:
        self._decision_evidence_against_ledger()
        self._effects_missing()

    def _step_history(self) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int]]:
        """Per step: the first generation it surely began in (a handler began, or its start
        record landed), and the first in which any start record may have been written."""
        surely_began: dict[tuple[int, int], int] = {}
        maybe_recorded: dict[tuple[int, int], int] = {}

        def lowest(into: dict[tuple[int, int], int], key: tuple[int, int], g: int) -> None:
            into[key] = min(g, into.get(key, g))

        for job_id, step_index, generation in self.ledger.began:
            lowest(surely_began, (job_id, step_index), generation)
        for call in self.ledger.calls:
            if call.op != "record_step" or call.step_index is None:
                continue
            key = (call.job_id, call.step_index)
            generation = call.generation if call.generation is not None else 0
            lowest(maybe_recorded, key, generation)
            if call.outcome == "ok" and call.state == "started":
                lowest(surely_began, key, generation)
        return surely_began, maybe_recorded

    def _decision_evidence_against_ledger(self) -> None:
        surely_began, maybe_recorded = self._step_history()
        for d in self.db.decisions:
            states = d.evidence.get("step_states")
            for step_index, state in enumerate(states if isinstance(states, list) else ()):
                key = (d.job_id, step_index)
                if state == "not_started":
                    began = surely_began.get(key)
                    if began is not None and began <= d.generation_before:
                        self.add(EVIDENCE, "unstarted_step_had_begun", d.job_id,
                                 f"{d.reason} at generation {d.generation_before} says step "
                                 f"{step_index} never started; it began in generation "
                                 f"{began}")
                    continue
                recorded = maybe_recorded.get(key)
                if recorded is None or recorded > d.generation_before:
                    self.add(EVIDENCE, "recorded_step_never_written", d.job_id,
                             f"{d.reason} at generation {d.generation_before} saw step "
                             f"{step_index} {state}; no worker ever recorded it")

    def _effects_missing(self) -> None:
        for (job_id, step_index), (state, generation) in self.db.steps.items():
            if state == "succeeded" and self.kind_of(job_id, step_index) == "effectful" \
                    and generation not in self.ledger.effect_generations(job_id, step_index):
                self.add(EVIDENCE, "succeeded_without_effect", job_id,
                         f"step {step_index} recorded succeeded by generation {generation}; "
                         "the ledger has no effect of that generation")
        for job_id, job in self.db.jobs.items():
            if job.status != "completed" or job.effect_kinds is None:
                continue
            for step_index, kind in enumerate(job.effect_kinds):
                if kind == "effectful" and not self.ledger.effect_generations(job_id,
                                                                              step_index):
                    self.add(EVIDENCE, "completed_with_effect_missing", job_id,
                             f"completed, but effectful step {step_index} never took effect")


def _facts(db: Database, ledger: LedgerData) -> dict[str, Any]:
    statuses = Counter(
        job.status if job.status != "failed" else f"failed:{job.reason}"
        for job in db.jobs.values())
    writes = Counter(f"{c.op}:{c.outcome or 'died'}" for c in ledger.calls)
    reruns = sum(len(g) - 1 for g in ledger.effects.values() if len(g) > 1)
    return {
        "jobs": len(db.jobs),
        "jobs_by_final_state": dict(sorted(statuses.items())),
        # Each begun run of a poison step is a worker it killed (armed or not).
        "poison_runs": sum(1 for job_id, _, _ in ledger.began
                           if (job := db.jobs.get(job_id)) is not None
                           and job.kind == POISON_KIND),
        "claims": len(db.attempts),
        "attempts_by_outcome": dict(sorted(Counter(
            a.outcome or "open" for a in db.attempts.values()).items())),
        "decisions_by_reason": dict(sorted(db.decision_reasons.items())),
        "decisions_applied": len(db.decisions),
        "effects_done": sum(len(g) for g in ledger.effects.values()),
        "effects_rerun_any_kind": reruns,
        "fenced_writes_refused": sum(1 for c in ledger.calls if c.outcome == "lost"),
        "fenced_writes_by_outcome": dict(sorted(writes.items())),
        "ledger_unreadable_lines": ledger.unreadable_lines,
    }


def run_checks(engine: Engine, ledger_dir: Path | str, *,
               margin_seconds: float = WRITE_MARGIN_SECONDS) -> CheckReport:
    """Check every invariant against the database behind ``engine`` and the ledger."""
    db = load_database(engine)
    ledger = read_ledger(ledger_dir)
    checker = _Checker(db, ledger, margin_seconds)
    checker.run()
    return CheckReport(checker.violations, _facts(db, ledger))
