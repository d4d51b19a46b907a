"""What any job source must do under the pass.

Every test runs unchanged against every registered source on every engine it runs on. It
makes jobs only through the source's fixture, and says what a user would see: the job's
status in neutral words, the step a resumed job starts again at, the reason a failed job
carries, and the audit trail. A situation a source cannot express is skipped with the
source's own reason.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from reconciler.core.brake import BrakeLimits
from reconciler.core.vocabulary import Disposition, EffectKind, Reason
from tests.conformance.fixtures import (
    AuditEntry,
    Capability,
    Feature,
    Interference,
    Outcome,
    Situation,
    SourceFixture,
    SourceJob,
    State,
)

pytestmark = pytest.mark.integration

RESUME, TERMINALIZE, SKIP = Disposition.RESUME, Disposition.TERMINALIZE, Disposition.SKIP
PURE, IDEMPOTENT, EFFECTFUL = EffectKind.PURE, EffectKind.IDEMPOTENT, EffectKind.EFFECTFUL


@dataclass(frozen=True, slots=True)
class Expected:
    """What one pass decides about a job in a situation, and the job's status after it."""

    disposition: Disposition
    reason: Reason
    outcome: Outcome
    resume_step: int | None = None


# The decision table (docs/decision-table.md) as a user meets it, written out here rather than
# computed with the code under test, so a wrong rule in either place fails a test.
RESUMED: dict[Situation, Expected] = {
    Situation(State.DIED_BEFORE_STEP, 0): Expected(
        RESUME, Reason.RESUMED_FROM_UNSTARTED_STEP, "runnable", 0),
    Situation(State.DIED_BEFORE_STEP, 1): Expected(
        RESUME, Reason.RESUMED_FROM_UNSTARTED_STEP, "runnable", 1),
    Situation(State.OWNER_GONE, 1): Expected(
        RESUME, Reason.RESUMED_FROM_UNSTARTED_STEP, "runnable", 1),
    Situation(State.OWNER_REBORN, 1): Expected(
        RESUME, Reason.RESUMED_FROM_UNSTARTED_STEP, "runnable", 1),
    Situation(State.STEP_FAILED_RETRYABLY, 1): Expected(
        RESUME, Reason.RESUMED_FROM_UNSTARTED_STEP, "runnable", 1),
    Situation(State.DIED_MID_STEP, 1, PURE): Expected(
        RESUME, Reason.RESUMED_IDEMPOTENT_STEP, "runnable", 1),
    Situation(State.DIED_MID_STEP, 1, IDEMPOTENT): Expected(
        RESUME, Reason.RESUMED_IDEMPOTENT_STEP, "runnable", 1),
}
TERMINALIZED: dict[Situation, Expected] = {
    Situation(State.DIED_MID_STEP, 0, EFFECTFUL): Expected(
        TERMINALIZE, Reason.WORKER_DIED_MID_STEP, "failed"),
    Situation(State.DIED_MID_STEP, 1, EFFECTFUL): Expected(
        TERMINALIZE, Reason.WORKER_DIED_MID_STEP, "failed"),
    Situation(State.STEP_FAILED, 1): Expected(TERMINALIZE, Reason.STEP_FAILED, "failed"),
    Situation(State.COMPLETION_UNRECORDED): Expected(
        TERMINALIZE, Reason.COMPLETION_UNRECORDED, "failed"),
    Situation(State.OUT_OF_ATTEMPTS, 1): Expected(
        TERMINALIZE, Reason.RESUME_EXHAUSTED, "failed"),
    Situation(State.WEDGED, 1, IDEMPOTENT): Expected(
        TERMINALIZE, Reason.WORKER_WEDGED, "failed"),
    Situation(State.PLAN_UNREADABLE, 1): Expected(
        TERMINALIZE, Reason.UNRESUMABLE_PLAN, "failed"),
}
SKIPPED: dict[Situation, Expected] = {
    Situation(State.HELD, 1): Expected(SKIP, Reason.OPERATOR_HOLD, "running"),
    Situation(State.GATED, 1): Expected(SKIP, Reason.WAITING_ON_GATE, "running"),
    Situation(State.RECENTLY_ACTIVE, 1): Expected(SKIP, Reason.RECENT_ACTIVITY, "running"),
    Situation(State.EVIDENCE_UNREADABLE, 1): Expected(SKIP, Reason.RECONCILE_ERROR, "running"),
}
TABLE: dict[Situation, Expected] = {**RESUMED, **TERMINALIZED, **SKIPPED}
LIVE = Situation(State.LIVE, 1)
"""Claimed by a live owner: never a candidate, so no decision at all."""
REBORN_HOLDING = Situation(State.OWNER_REBORN_HOLDING, 1)
"""Held again by a later process under its dead owner's name: live, like ``LIVE``."""


def require(source: SourceFixture, *needed: Capability) -> None:
    """Skip, with the source's own reason, when it cannot express what the test needs."""
    for what in needed:
        if not source.supports(what):
            pytest.skip(source.why_unsupported(what))


def make_all(source: SourceFixture, situations: list[Situation]) -> dict[Situation, SourceJob]:
    """One job in each situation the source can express."""
    return {s: source.make(s) for s in situations if source.supports(s)}


def decided(entries: list[AuditEntry]) -> list[tuple[str, str]]:
    """The (disposition, reason) of audit entries."""
    return [(e.disposition, e.reason) for e in entries]


def in_another_thread(action: Callable[[], None]) -> None:
    """Run ``action`` on a thread of its own (its own connection) and wait for it."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            action()
        except BaseException as exc:  # handed to the test thread below
            errors.append(exc)

    thread = threading.Thread(target=run, name="concurrent-writer")
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the concurrent change did not finish"
    if errors:
        raise errors[0]


def assert_acted_on(source: SourceFixture, job: SourceJob, entry: AuditEntry) -> None:
    """A resume or terminalize moved the job's fence on, and the audit says from where to
    where."""
    assert entry.generation_before == job.generation
    if source.supports(Feature.GENERATION):
        after = source.generation(job)
        assert after is not None
        assert job.generation is not None
        assert after > job.generation
        assert entry.generation_after == after


# -- every situation gets the table's decision and outcome ----------------------------------


@pytest.mark.parametrize("situation", list(RESUMED), ids=str)
def test_a_dead_owners_job_is_resumed_at_its_first_unfinished_step(
    source: SourceFixture, situation: Situation
) -> None:
    """A job whose owner died where rerunning is safe becomes runnable again at that step."""
    require(source, situation)
    expected = RESUMED[situation]
    job = source.make(situation)

    report = source.run_pass()

    assert source.status(job) == "runnable"
    if source.supports(Feature.RESUME_STEP):
        assert source.resume_step(job) == expected.resume_step
    [entry] = source.audit(job)
    assert (entry.disposition, entry.reason) == (RESUME, expected.reason)
    assert [(d.job_id, d.disposition, d.reason, d.resume_step_index)
            for d in report.decisions] == [(job.key, RESUME, expected.reason, expected.resume_step)]
    assert_acted_on(source, job, entry)


def terminalized(source: SourceFixture, situation: Situation) -> Expected:
    """What the table's terminalization of a situation is for this source: a source that
    can record a completion itself finishes a completed-but-unrecorded job."""
    expected = TERMINALIZED[situation]
    if (expected.reason is Reason.COMPLETION_UNRECORDED
            and source.supports(Feature.RECOVERS_COMPLETION)):
        return Expected(TERMINALIZE, Reason.COMPLETION_RECOVERED, "completed")
    return expected


def expected_in(source: SourceFixture, situation: Situation) -> Expected:
    """The table's expectation of a situation, as this source carries it out."""
    return terminalized(source, situation) if situation in TERMINALIZED else TABLE[situation]


@pytest.mark.parametrize("situation", list(TERMINALIZED), ids=str)
def test_a_job_that_cannot_be_resumed_safely_ends_with_the_precise_reason(
    source: SourceFixture, situation: Situation
) -> None:
    """A job the table terminalizes ends failed (or completed, where the source recovers
    the completion), carrying the rule's reason code."""
    require(source, situation)
    expected = terminalized(source, situation)
    job = source.make(situation)

    report = source.run_pass()

    assert source.status(job) == expected.outcome
    if source.supports(Feature.REASON):
        assert source.reason(job) == expected.reason
    [entry] = source.audit(job)
    assert (entry.disposition, entry.reason) == (TERMINALIZE, expected.reason)
    assert [(d.job_id, d.disposition, d.reason, d.resume_step_index)
            for d in report.decisions] == [(job.key, TERMINALIZE, expected.reason, None)]
    assert_acted_on(source, job, entry)


@pytest.mark.parametrize("situation", list(SKIPPED), ids=str)
def test_a_held_gated_or_unreadable_job_is_skipped_and_left_untouched(
    source: SourceFixture, situation: Situation
) -> None:
    """A job the table skips is recorded with the skip's reason and not changed at all."""
    require(source, situation)
    expected = SKIPPED[situation]
    job = source.make(situation)
    before = source.snapshot(job)

    report = source.run_pass()

    assert source.snapshot(job) == before
    assert source.status(job) == "running"
    assert report.pass_id is not None
    assert source.audit(job) == [AuditEntry(
        report.pass_id, job.key, SKIP, expected.reason, job.generation, None)]
    assert [(d.job_id, d.disposition, d.reason) for d in report.decisions] == [
        (job.key, SKIP, expected.reason)]


@pytest.mark.parametrize("situation", [Situation(State.HELD, 1), Situation(State.GATED, 1)],
                         ids=str)
def test_a_held_or_gated_job_is_recorded_once_however_many_passes_meet_it(
    source: SourceFixture, situation: Situation
) -> None:
    """Three passes leave one audit row; a source that parks does not even read the job
    again (held and gated jobs fill no batch)."""
    require(source, situation)
    job = source.make(situation)

    reports = [source.run_pass() for _ in range(3)]

    assert [(e.reason, e.generation_before) for e in source.audit(job)] == [
        (SKIPPED[situation].reason, job.generation)]
    later = [[d.reason for d in r.decisions if d.job_id == job.key] for r in reports[1:]]
    if source.supports(Feature.PARKS):
        assert later == [[], []]
    else:
        assert later == [[SKIPPED[situation].reason]] * 2


@pytest.mark.parametrize("live", [LIVE, REBORN_HOLDING], ids=str)
def test_a_job_with_a_live_owner_is_never_a_candidate(source: SourceFixture,
                                                      live: Situation) -> None:
    """A job whose owner holds a live lease and makes progress is not even looked at,
    also when its owner is a later process under a dead one's name that took it again."""
    require(source, live)
    job = source.make(live)
    before = source.snapshot(job)

    reports = [source.run_pass(), source.run_pass()]

    assert source.snapshot(job) == before
    assert source.status(job) == "running"
    assert source.audit(job) == []
    assert [d for report in reports for d in report.decisions] == []


# -- the audit, and the pass as a whole ------------------------------------------------------


def test_one_pass_records_one_decision_per_job_under_the_sources_own_id(
    source: SourceFixture,
) -> None:
    """A pass over every situation at once records exactly one decision per candidate,
    under the job id the source spells, and none for the live job."""
    jobs = make_all(source, list(TABLE))
    live = source.make(LIVE) if source.supports(LIVE) else None

    report = source.run_pass()

    assert report.pass_id is not None
    assert sorted(map(str, (d.job_id for d in report.decisions))) == sorted(
        str(job.key) for job in jobs.values())
    for situation, job in jobs.items():
        entries = source.audit(job)
        expected = expected_in(source, situation)
        assert decided(entries) == [(expected.disposition, expected.reason)], situation
        [entry] = entries
        assert (entry.pass_id, entry.job_id) == (report.pass_id, job.key), situation
        assert type(entry.job_id) is type(job.key), situation
        assert source.status(job) == expected.outcome, situation
    if live is not None:
        assert source.audit(live) == []


def test_a_second_pass_right_after_decides_nothing_new_for_resumed_or_failed_jobs(
    source: SourceFixture,
) -> None:
    """Jobs a pass resumed or terminalized are not decided again by the next pass."""
    jobs = make_all(source, [*RESUMED, *TERMINALIZED])
    first = source.run_pass()
    assert len(first.decisions) == len(jobs)
    after_first = {s: (source.snapshot(job), source.audit(job)) for s, job in jobs.items()}

    second = source.run_pass()

    assert [d.job_id for d in second.decisions] == []
    for situation, job in jobs.items():
        assert (source.snapshot(job), source.audit(job)) == after_first[situation], situation


def test_a_job_whose_evidence_cannot_be_read_is_recorded_and_the_pass_goes_on(
    source: SourceFixture,
) -> None:
    """An unreadable job is recorded reconcile_error and left alone; the others are decided."""
    unreadable = Situation(State.EVIDENCE_UNREADABLE, 1)
    resumable = Situation(State.DIED_BEFORE_STEP, 1)
    doomed = Situation(State.DIED_MID_STEP, 1, EFFECTFUL)
    require(source, unreadable, resumable, doomed)
    broken = source.make(unreadable)
    before = source.snapshot(broken)
    others = {s: source.make(s) for s in (resumable, doomed)}

    report = source.run_pass()

    assert decided(source.audit(broken)) == [(SKIP, Reason.RECONCILE_ERROR)]
    assert source.snapshot(broken) == before
    for situation, job in others.items():
        assert decided(source.audit(job)) == [(expected_in(source, situation).disposition,
                                               expected_in(source, situation).reason)]
        assert source.status(job) == expected_in(source, situation).outcome
    assert len(report.decisions) == 3


def test_a_dry_run_decides_like_a_pass_and_changes_nothing(source: SourceFixture) -> None:
    """A dry run reports the decision a pass would make for every job, and writes nothing."""
    situations = [s for s in TABLE if s.state is not State.OWNER_GONE]
    jobs = make_all(source, [*situations, LIVE])
    before = {s: source.snapshot(job) for s, job in jobs.items()}

    preview = source.run_pass(dry_run=True)

    assert preview.dry_run is True
    assert {(d.job_id, d.disposition, d.reason) for d in preview.decisions} == {
        (job.key, expected_in(source, s).disposition, expected_in(source, s).reason)
        for s, job in jobs.items() if s in TABLE}
    for situation, job in jobs.items():
        assert source.snapshot(job) == before[situation], situation
        assert source.audit(job) == [], situation

    real = source.run_pass()
    assert {(d.job_id, d.disposition, d.reason) for d in real.decisions} == {
        (d.job_id, d.disposition, d.reason) for d in preview.decisions}


OWNERS_EXPIRED_BY_WRITE = frozenset({"native"})
"""Sources that declare silent owners gone with a write (``expire_gone_owners``), which a
dry run does not make; the others judge an owner's liveness as they read."""


def test_a_dry_run_previews_the_jobs_of_an_owner_that_went_silent(
    source: SourceFixture, request: pytest.FixtureRequest,
) -> None:
    """A dry run shows the resume a pass would make for a job whose owner went silent."""
    if source.source_name in OWNERS_EXPIRED_BY_WRITE:
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "a dry run does not declare silent worker sessions gone (that is a write), so "
            "it neither sees nor previews the jobs of a dead owner whose lease is still "
            "live, which the next real pass resumes")))
    situation = Situation(State.OWNER_GONE, 1)
    require(source, situation)
    job = source.make(situation)

    preview = source.run_pass(dry_run=True)

    assert [(d.job_id, d.disposition, d.reason) for d in preview.decisions] == [
        (job.key, RESUME, Reason.RESUMED_FROM_UNSTARTED_STEP)]


def test_consecutive_passes_cover_a_backlog_larger_than_the_batch_once_each(
    source: SourceFixture,
) -> None:
    """Nine stale jobs and a batch of three: consecutive passes, each continuing where the
    last stopped as the sidecar does, decide every job exactly once."""
    mix = [Situation(State.DIED_BEFORE_STEP, 1), Situation(State.HELD, 1),
           Situation(State.DIED_MID_STEP, 1, EFFECTFUL), Situation(State.GATED, 1),
           Situation(State.RECENTLY_ACTIVE, 1), Situation(State.DIED_MID_STEP, 1, IDEMPOTENT),
           Situation(State.WEDGED, 1, IDEMPOTENT), Situation(State.OWNER_GONE, 1),
           Situation(State.STEP_FAILED, 1)]
    backlog = [source.make(s) for s in mix if source.supports(s)]
    require(source, LIVE)
    live = source.make(LIVE)

    seen: list[list[object]] = []
    cursor: object | None = None
    while True:
        report = source.run_pass(batch_size=3, after=cursor)
        seen.append([d.job_id for d in report.decisions])
        cursor = report.next_cursor
        if cursor is None:
            break
        assert len(seen) < 2 * len(mix), "the passes never reached the end of the backlog"

    assert all(len(batch) <= 3 for batch in seen), seen
    flat = [key for batch in seen for key in batch]
    assert sorted(map(str, flat)) == sorted(str(job.key) for job in backlog), seen
    assert source.audit(live) == []


# -- a stale decision loses to a concurrent change -------------------------------------------


@dataclass(frozen=True, slots=True)
class Race:
    """A situation, what the pass decides about it, the change that beats the apply, and
    the job's status once the late apply has been refused."""

    situation: Situation
    disposition: Disposition
    reason: Reason
    change: Interference
    outcome: Outcome


RACES = [
    Race(Situation(State.DIED_BEFORE_STEP, 1), RESUME, Reason.RESUMED_FROM_UNSTARTED_STEP,
         Interference.LATE_HEARTBEAT, "running"),
    Race(Situation(State.DIED_BEFORE_STEP, 1), RESUME, Reason.RESUMED_FROM_UNSTARTED_STEP,
         Interference.LATE_PROGRESS, "running"),
    Race(Situation(State.WEDGED, 1, IDEMPOTENT), TERMINALIZE, Reason.WORKER_WEDGED,
         Interference.LATE_PROGRESS, "running"),
    Race(Situation(State.COMPLETION_UNRECORDED), TERMINALIZE, Reason.COMPLETION_UNRECORDED,
         Interference.LATE_COMPLETION, "completed"),
    Race(Situation(State.DIED_BEFORE_STEP, 1), RESUME, Reason.RESUMED_FROM_UNSTARTED_STEP,
         Interference.RECLAIM, "running"),
]


@pytest.mark.parametrize("race", RACES, ids=lambda r: f"{r.change}-{r.situation}")
def test_a_decision_overtaken_by_a_concurrent_change_is_fence_lost_and_changes_nothing(
    source: SourceFixture, race: Race
) -> None:
    """A change made by another connection between decide and apply wins: the apply is
    recorded skip fence_lost and leaves the job as that change left it."""
    require(source, race.situation, race.change)
    job = source.make(race.situation)
    after_change: list[object] = []

    def concurrent_change() -> None:
        in_another_thread(lambda: source.interfere(job, race.change))
        after_change.append(source.snapshot(job))

    interrupted = source.run_interrupted_pass(concurrent_change)

    reason = race.reason
    if race.situation in TERMINALIZED:
        reason = terminalized(source, race.situation).reason
    assert [(d.job_id, d.disposition, d.reason) for d in interrupted.decided] == [
        (job.key, race.disposition, reason)]
    assert [(d.job_id, d.disposition, d.reason, d.generation_before, d.generation_after)
            for d in interrupted.report.decisions] == [
        (job.key, SKIP, Reason.FENCE_LOST, job.generation, None)]
    assert source.snapshot(job) == after_change[0]
    assert source.status(job) == race.outcome
    assert interrupted.report.pass_id is not None
    assert source.audit(job)[-1] == AuditEntry(
        interrupted.report.pass_id, job.key, SKIP, Reason.FENCE_LOST, job.generation, None)



# -- a job that keeps killing its workers ----------------------------------------------------


def test_a_job_whose_workers_keep_dying_ends_crash_loop_instead_of_a_third_victim(
    source: SourceFixture,
) -> None:
    """A resumed job whose next worker dies too has lost two attempts in a row, the one
    judged included: with ``crash_loop_after = 2`` (the default) the next pass, and the
    dry run before it, end it crash_loop instead of handing it to a third worker."""
    situation = Situation(State.DIED_BEFORE_STEP, 1)
    require(source, situation, Interference.RECLAIM)
    job = source.make(situation)
    source.interfere(job, Interference.RECLAIM)  # resumed, claimed again, died again

    preview = source.run_pass(dry_run=True)
    report = source.run_pass()

    assert [(d.job_id, d.disposition, d.reason) for d in report.decisions] == [
        (job.key, TERMINALIZE, Reason.CRASH_LOOP)]
    assert [(d.job_id, d.reason) for d in preview.decisions] == [(job.key, Reason.CRASH_LOOP)]
    assert source.status(job) == "failed"
    assert decided(source.audit(job)) == [(RESUME, Reason.RESUMED_FROM_UNSTARTED_STEP),
                                          (TERMINALIZE, Reason.CRASH_LOOP)]


# -- the dry run tells what the pass would do, brake included --------------------------------


def test_a_dry_run_applies_the_mass_staleness_brake_as_the_pass_right_after_does(
    source: SourceFixture,
) -> None:
    """Three jobs stale at once with ``brake_min_jobs = 2``: the dry run says the brake
    holds every change back (``mass_staleness_brake``), and so does the pass after it."""
    situations = [Situation(State.DIED_BEFORE_STEP, 1),
                  Situation(State.DIED_MID_STEP, 1, EFFECTFUL),
                  Situation(State.DIED_MID_STEP, 1, IDEMPOTENT)]
    require(source, *situations)
    jobs = [source.make(s) for s in situations]
    limits = BrakeLimits(min_jobs=2, stale_fraction=0.5, hold_seconds=3600.0)

    preview = source.run_pass(dry_run=True, brake=limits)
    real = source.run_pass(brake=limits)

    held = {(job.key, SKIP, Reason.MASS_STALENESS_BRAKE) for job in jobs}
    assert (preview.braked, real.braked) == (True, True)
    assert {(d.job_id, d.disposition, d.reason) for d in preview.decisions} == held
    assert {(d.job_id, d.disposition, d.reason) for d in real.decisions} == held
    assert all(source.status(job) == "running" for job in jobs)


def test_the_brake_counts_the_live_jobs_beside_the_stale_ones(source: SourceFixture) -> None:
    """Two jobs stale among seven running, against a brake at half of them: the five live
    jobs are counted (a source that loads only its expired jobs counts the rest), so
    the brake stays off and both dead owners' jobs are decided; the live ones untouched."""
    situations = [Situation(State.DIED_BEFORE_STEP, 1), Situation(State.DIED_BEFORE_STEP, 2)]
    require(source, *situations, LIVE)
    dead = [source.make(s) for s in situations]
    live = [source.make(LIVE) for _ in range(5)]
    limits = BrakeLimits(min_jobs=2, stale_fraction=0.5, hold_seconds=3600.0)

    report = source.run_pass(brake=limits)

    assert not report.braked
    assert {(d.job_id, d.disposition) for d in report.decisions} == {
        (job.key, RESUME) for job in dead}
    assert all(source.status(job) == "running" for job in live)


@pytest.mark.parametrize("race", [r for r in RACES if r.change is not Interference.RECLAIM],
                         ids=lambda r: f"{r.change}-{r.situation}")
def test_a_lost_fence_costs_only_its_own_job_in_a_batch(
    source: SourceFixture, race: Race
) -> None:
    """Two jobs decided alike and swapped in one batch: the one a concurrent change beat
    is recorded fence_lost and left as that change left it; the other is applied. (A
    reclaim is another pass, which would take both.)"""
    require(source, race.situation, race.change)
    beaten, kept = source.make(race.situation), source.make(race.situation)
    after_change: list[object] = []

    def concurrent_change() -> None:
        in_another_thread(lambda: source.interfere(beaten, race.change))
        after_change.append(source.snapshot(beaten))

    interrupted = source.run_interrupted_pass(concurrent_change)

    reason = race.reason
    if race.situation in TERMINALIZED:
        reason = terminalized(source, race.situation).reason
    assert {d.job_id: (d.disposition, d.reason) for d in interrupted.report.decisions} == {
        beaten.key: (SKIP, Reason.FENCE_LOST), kept.key: (race.disposition, reason)}
    assert source.snapshot(beaten) == after_change[0]
    assert source.status(beaten) == race.outcome
    assert source.status(kept) != "running"

