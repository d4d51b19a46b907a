"""The checks of a foreign chaos run: four invariant counts (all must be 0) and the facts
of what late writers did, from the system's own rows, the reconciler's audit trail and the
tasks' marker files (the effect ledger: ``started`` before the work, ``done`` after it).

Times compare the database's clock (``decided_at``, a system's completion time) with the
markers' modification times: one machine, one clock (a file's time is the kernel's coarse
clock, a few milliseconds behind at most, never ahead).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.chaos.foreign.database import Database
from tests.chaos.foreign.processes import Marker
from tests.chaos.foreign.systems import TERMINAL, JobSpec, JobState, System

EXAMPLES = 3
LATE_EXAMPLES = 6


@dataclass(frozen=True)
class AuditRow:
    """One applied (non-skip) decision of the audit trail, or a skip."""

    job: str
    decided_at: float
    disposition: str
    reason: str
    attempts_used: int | None


@dataclass
class FaultLog:
    """What the fault phase did to which worker process."""

    stopped: set[int] = field(default_factory=set)
    """Pids of the workers SIGSTOPped (and later continued)."""
    killed_at: dict[int, float] = field(default_factory=dict)
    """Epoch of each worker's SIGKILL, by pid."""
    live_at_end: set[int] = field(default_factory=set)
    """Pids of the workers still running after the drain."""
    killed_mid_task: set[int] = field(default_factory=set)
    """Pids of the workers SIGKILLed while inside a task."""


@dataclass
class Checks:
    """Invariant counts (each must be 0), facts, and a few job ids per non-zero count."""

    counts: dict[str, int]
    facts: dict[str, Any]
    examples: dict[str, list[str]] = field(default_factory=dict)


def read_audit(db: Database, source: str) -> list[AuditRow]:
    """The audit trail of this source, oldest first."""
    rows = db.query(
        "SELECT job_id, extract(epoch FROM decided_at), disposition, decision_reason, "
        "decision_evidence ->> 'attempts_used' FROM reconciliation_decisions "
        "WHERE job_source = %(source)s AND NOT shadow_mode ORDER BY decision_id",
        {"source": source})
    return [AuditRow(str(job), float(at), disposition, reason,
                     None if used is None else int(used))
            for job, at, disposition, reason, used in rows]


def run_checks(db: Database, system: System, specs: Mapping[str, JobSpec],
               markers: Sequence[Marker], faults: FaultLog) -> Checks:
    """Every count and fact of the run, after its drain."""
    audit = read_audit(db, system.name)
    states = system.states(db, specs)
    acting = [a for a in audit if a.disposition != "skip"]
    by_job: dict[str, list[Marker]] = defaultdict(list)
    for marker in markers:
        by_job[marker.job].append(marker)
    decided: dict[str, list[AuditRow]] = defaultdict(list)
    for row in acting:
        decided[row.job].append(row)

    bad: dict[str, list[str]] = {name: [] for name in (
        "effect_started_twice", "jobs_not_terminal", "attempts_over_budget",
        "decisions_per_attempt_over_one")}
    # A job left behind that its system may have lost where no reconciler could see it:
    # counted as lost once the system confirms it holds no copy of it any more.
    maybe_lost: dict[str, str] = {}
    for job, spec in specs.items():
        state = states.get(job)
        if _effect_started_twice(system, spec, decided[job], by_job[job]):
            bad["effect_started_twice"].append(job)
        if state is None or state.status not in TERMINAL:
            how = _how_maybe_lost(state, by_job[job], decided[job], faults.live_at_end)
            if how is None:
                bad["jobs_not_terminal"].append(job)
            else:
                maybe_lost[job] = how
        if _over_budget(system, spec, state, by_job[job]):
            bad["attempts_over_budget"].append(job)
    vanished = system.vanished(db, list(maybe_lost)) if maybe_lost else set()
    lost: dict[str, list[str]] = {"after_acknowledgement": [], "in_delivery": []}
    for job, how in maybe_lost.items():
        (lost[how] if job in vanished else bad["jobs_not_terminal"]).append(job)
    per_attempt = Counter((a.job, a.attempts_used) for a in acting
                          if not _put_back_unstarted(system, a, by_job[a.job]))
    bad["decisions_per_attempt_over_one"] = sorted({job for (job, _), n in per_attempt.items()
                                                    if n > 1})

    late, late_examples = _late_writes(system, states, decided, by_job, faults.stopped)
    facts: dict[str, Any] = {
        "jobs": len(specs),
        "final": dict(Counter(s.status for s in states.values())),
        "decisions": dict(Counter(f"{a.disposition}/{a.reason}" for a in acting)),
        "fence_lost": sum(1 for a in audit if a.reason == "fence_lost"),
        "crash_loop": sum(1 for a in acting if a.reason == "crash_loop"),
        "runs_started": sum(1 for m in markers if m.event == "started"),
        "late_starts": _late_starts(system, decided, by_job),
        "kill_to_decision_seconds": _kill_to_decision(system, decided, by_job,
                                                      faults.killed_at),
        "late_finishes": sum(sum(c.values()) for c in late.values()),
        "late_writes": {fault: dict(c) for fault, c in late.items()},
        "late_write_examples": late_examples,
        "lost_by_the_system": {how: len(jobs) for how, jobs in lost.items()},
        "lost_by_the_system_examples": {how: jobs[:EXAMPLES] for how, jobs in lost.items()
                                        if jobs},
    }
    return Checks({name: len(jobs) for name, jobs in bad.items()}, facts,
                  {name: jobs[:EXAMPLES] for name, jobs in bad.items() if jobs})


def _how_maybe_lost(state: JobState | None, markers: Sequence[Marker],
                    decisions: Sequence[AuditRow], live_pids: set[int]) -> str | None:
    """How the system may have lost this unfinished job where no reconciler could see it
    (None: it cannot have). ``after_acknowledgement``: below. ``in_delivery``: no worker
    ever began it and the reconciler never decided on it; a Celery worker killed after
    Redis handed it the message (``BRPOP``) and before kombu recorded it unacknowledged
    leaves no trace of it anywhere."""
    if _lost_after_acknowledgement(state, markers, live_pids):
        return "after_acknowledgement"
    if not markers and not decisions:
        return "in_delivery"
    return None


def _lost_after_acknowledgement(state: JobState | None, markers: Sequence[Marker],
                                live_pids: set[int]) -> bool:
    """A job its system may have lost after handing it to a worker, where no reconciler
    can see it: its latest attempt was accepted (an ``accepted`` marker, Celery's) by a
    worker that died before starting it, and no row says it runs. Lost once the system
    also holds no copy of it (``System.vanished``).

    A Celery worker that accepted a task and stops before writing its ``STARTED`` row (a
    result write that failed) acknowledges the message on its way out: no message to
    redeliver and no running row, whether the message was the first or one the reconciler
    re-published (then the row stays ``RETRY``). A SIGKILLed one leaves the message
    unacknowledged in Redis, for kombu to put back: not lost."""
    accepted = [m for m in markers if m.event == "accepted"]
    if not accepted or (state is not None and state.status in (*TERMINAL, "running")):
        return False
    latest = max(accepted, key=lambda m: (m.attempt, m.at))
    started = {m.attempt for m in markers if m.event == "started"}
    return (latest.attempt not in started and latest.attempt >= max(started, default=0)
            and latest.pid is not None and latest.pid not in live_pids)


def _effect_started_twice(system: System, spec: JobSpec, decisions: Sequence[AuditRow],
                          markers: Sequence[Marker]) -> bool:
    """An effectful job resumed, or a later attempt of it started after a decision of ours
    (the decided attempt's own start, written late by a worker stopped before its task
    began, is one start: counted in ``late_starts``)."""
    if not spec.kind.startswith("effect."):
        return False
    if any(d.disposition == "resume" and not _put_back_unstarted(system, d, markers)
           for d in decisions):
        return True
    return any(m.event == "started" and m.at > d.decided_at
               and (d.attempts_used is None or system.used_of(m.attempt) > d.attempts_used)
               for d in decisions if not _put_back_unstarted(system, d, markers)
               for m in markers)


def _put_back_unstarted(system: System, decision: AuditRow, markers: Sequence[Marker]
                        ) -> bool:
    """A message a worker had only prefetched, put back as it was (Dramatiq: its attempts
    used stay, nothing of it ran): a resume from the unstarted step at the attempts used,
    with no start of the run after them marked before the decision. It resumes no effect,
    and a message prefetched by several workers that died is put back once by each.

    Or a delayed original dropped because its copy had started (Dramatiq: recorded as the
    same resume, the job going on as that copy): the run after them started before the
    decision, and that was its only start."""
    if decision.reason != "resumed_from_unstarted_step" or decision.attempts_used is None:
        return False
    following = decision.attempts_used + 1
    starts = [m for m in markers
              if m.event == "started" and system.used_of(m.attempt) == following]
    before = [m for m in starts if m.at <= decision.decided_at]
    return not before or len(starts) == 1


def _late_starts(system: System, decided: Mapping[str, Sequence[AuditRow]],
                 by_job: Mapping[str, list[Marker]]) -> int:
    """Attempts whose task started only after the reconciler had decided that attempt."""
    return sum(1 for job, markers in by_job.items() for m in markers
               if m.event == "started" and any(
                   d.attempts_used == system.used_of(m.attempt) and d.decided_at < m.at
                   for d in decided.get(job, ())))


def _kill_to_decision(system: System, decided: Mapping[str, Sequence[AuditRow]],
                      by_job: Mapping[str, list[Marker]], killed_at: Mapping[int, float]
                      ) -> dict[str, float]:
    """From a worker's SIGKILL to the decision on the attempt it was running: how many,
    the median and the longest (the limit is the system's wait, plus one interval)."""
    waits = []
    for job, markers in by_job.items():
        done = {m.attempt for m in markers if m.event == "done"}
        for m in markers:
            killed = killed_at.get(m.pid) if m.pid is not None else None
            if m.event != "started" or m.attempt in done or killed is None:
                continue
            after = [d.decided_at - killed for d in decided.get(job, ())
                     if d.attempts_used == system.used_of(m.attempt) and d.decided_at > killed]
            if after:
                waits.append(min(after))
    waits.sort()
    return {"attempts": len(waits),
            "median": round(waits[len(waits) // 2], 2) if waits else 0.0,
            "max": round(waits[-1], 2) if waits else 0.0}


def _over_budget(system: System, spec: JobSpec, state: JobState | None,
                 markers: Sequence[Marker]) -> bool:
    """More attempts than the budget, by the system's counters or by the runs started."""
    budget = spec.max_attempts if state is None or state.max_attempts is None \
        else state.max_attempts
    started = max((system.used_of(m.attempt) for m in markers if m.event == "started"),
                  default=0)
    used = 0 if state is None or state.attempts_used is None else state.attempts_used
    return max(started, used) > budget


def _late_writes(system: System, states: Mapping[str, JobState],
                 decided: Mapping[str, Sequence[AuditRow]], by_job: Mapping[str, list[Marker]],
                 stopped_pids: set[int]) -> tuple[dict[str, Counter[str]], list[str]]:
    """Runs that finished after the reconciler had decided their attempt, by fault (their
    worker was SIGSTOPped, or not: slow under load or across the restart) and by what
    landed in the system's row; and a few of them (``job:fault:landed``)."""
    late: dict[str, Counter[str]] = {"stopped": Counter(), "not_stopped": Counter()}
    seen: list[str] = []
    for job, markers in by_job.items():
        state = states.get(job)
        for done in (m for m in markers if m.event == "done"):
            used = system.used_of(done.attempt)
            decision = next((d for d in decided.get(job, ())
                             if d.attempts_used == used and d.decided_at < done.at), None)
            if decision is None or state is None:
                continue
            fault = "stopped" if done.pid in stopped_pids else "not_stopped"
            landed = _landed(system, state, decision, done, markers)
            late[fault][landed] += 1
            seen.append(f"{job}:{fault}:{landed}")
    return late, seen[:LATE_EXAMPLES]


def _landed(system: System, state: JobState, decision: AuditRow, late: Marker,
            markers: Sequence[Marker]) -> str:
    """What the late completion did to the row, after our decision (``failed/`` or
    ``resumed/``): ``overwrote`` (our terminalization became a completion),
    ``overwrote_new_run`` / ``overwrote_queued`` (the resumed job completed by the old run
    while a new run ran it / before one started), ``refused`` (the row kept another
    outcome: the system's fence refused the write), ``lost`` (the row was already gone,
    or the write never reached it)."""
    after = "failed" if decision.disposition == "terminalize" else "resumed"
    later = [m for m in markers if m.attempt > late.attempt]
    if state.status != "completed":  # ended failed: our failure (or a later one) stood
        return f"{after}/{'refused' if system.completion_fenced else 'lost'}"
    if state.completed_at is not None:
        # A task writes its marker before its worker's completion starts its transaction
        # (whose now() the system records), and a file's time never runs ahead of the
        # clock: the completion is the latest run's that had finished by then.
        finishes = [m for m in markers if m.event == "done" and m.at <= state.completed_at]
        landed = bool(finishes) and max(finishes, key=lambda m: m.at) == late
    else:  # the row is gone (graphile-worker deletes): the first completion deleted it
        landed = not any(m.event == "done" and m.at < late.at for m in later)
    if not landed:
        return f"{after}/{'refused' if state.completed_at is not None else 'lost'}"
    if after == "failed":
        return "failed/overwrote"
    new_run = any(m.event == "started" and m.at < late.at for m in later)
    return "resumed/overwrote_new_run" if new_run else "resumed/overwrote_before_rerun"
