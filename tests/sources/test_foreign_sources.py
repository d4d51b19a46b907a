"""Procrastinate, graphile-worker and pg-boss sources on their real schemas: one suite for all.

Jobs are put in states by the fixture factories (tests/sources/factories.py) through each
system's own functions; the source is judged with the real decision table
(``reconcile_once``), and the rows are checked in the shape the system itself reads.
"""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa

from reconciler.core.kinds import KindRule, KindRules
from reconciler.core.ports import Cursor
from reconciler.core.vocabulary import Disposition, EffectKind, Reason, StuckReason
from reconciler.errors import ConfigError
from reconciler.ledger import LeaseLost, Step, StepLedger
from tests.sources.conftest import SourcesDatabase
from tests.sources.factories import (
    GraphileWorkerFactory,
    PgBossFactory,
    ProcrastinateFactory,
    SystemFactory,
)
from tests.sources.support import by_job, explain, plan_changes, reconcile_once

SYSTEMS = ("procrastinate", "graphile-worker", "pg-boss")


def kind_rules(*rules: KindRule) -> KindRules:
    return KindRules([KindRule("idem.*", effect=EffectKind.IDEMPOTENT),
                      KindRule("pure.*", effect=EffectKind.PURE),
                      KindRule("skip.*", reconcile=False), *rules],
                     stale_after_seconds=60.0, wedged_after_seconds=3600.0, max_attempts=3)


@pytest.fixture(params=SYSTEMS)
def system(request: pytest.FixtureRequest) -> SystemFactory:
    """Each system's fixture factory, on empty job tables."""
    if request.param == "procrastinate":
        db: SourcesDatabase = request.getfixturevalue("procrastinate_db")
        return ProcrastinateFactory(db, request.getfixturevalue("procrastinate_schema"))
    if request.param == "graphile-worker":
        db = request.getfixturevalue("graphile_db")
        return GraphileWorkerFactory(db, request.getfixturevalue("graphile_schema"))
    db = request.getfixturevalue("pgboss_db")
    return PgBossFactory(db, request.getfixturevalue("pgboss_schema"))


def run(system: SystemFactory, kinds: KindRules | None = None, **kw: object
        ) -> dict[object, object]:
    rules = kinds or kind_rules()
    return by_job(reconcile_once(system.db.engine, system.config, rules, **kw))


class TestDeadOwner:
    """A claimed job whose worker died is decided from its kind's effect and its attempts."""

    def test_idempotent_kind_is_requeued_the_systems_way(self, system: SystemFactory) -> None:
        """Resumed: queued again in the system's own state, the attempt counted."""
        job = system.died("idem.report")
        outcome = run(system)[job]
        assert (outcome.disposition, outcome.reason) == (Disposition.RESUME,
                                                         Reason.RESUMED_IDEMPOTENT_STEP)
        assert outcome.applied
        assert system.status(job) == "queued"

    def test_effectful_by_default_is_failed_not_rerun(self, system: SystemFactory) -> None:
        """A kind nobody configured is effectful: the job ends failed, with our reason."""
        job = system.died("mail.send")
        outcome = run(system)[job]
        assert outcome.reason is Reason.WORKER_DIED_MID_STEP
        assert outcome.applied
        assert system.status(job) == "failed"
        if system.source_name != "procrastinate":  # Procrastinate keeps no error text
            assert system.error_text(job) == "worker_died_mid_step"

    def test_out_of_attempts_ends_failed(self, system: SystemFactory) -> None:
        """An idempotent job on its last attempt is not resumed into another."""
        job = system.exhausted("idem.report")
        outcome = run(system)[job]
        assert outcome.reason is Reason.RESUME_EXHAUSTED
        assert system.status(job) == "failed"

    def test_resume_and_terminalize_are_each_decided_once(self, system: SystemFactory) -> None:
        """After the swap the job is no longer running: the next pass finds nothing."""
        system.died("idem.report")
        system.died("mail.send")
        assert len(run(system)) == 2
        assert run(system) == {}


class TestLeftAlone:
    """What the reconciler must never touch."""

    def test_live_owner_is_not_a_candidate(self, system: SystemFactory) -> None:
        """A job whose worker is alive (or inside its lease) is not even read as a candidate."""
        job = system.live("idem.report")
        assert run(system) == {}
        assert system.status(job) == "running"

    def test_explain_says_lease_live(self, system: SystemFactory) -> None:
        """Asked about a live job, the table says lease_live and the job stays running."""
        job = system.live("idem.report")
        rules = kind_rules()
        decision = explain(system.db.engine, system.config, rules, [job])[job]
        assert decision.reason is Reason.LEASE_LIVE
        assert system.status(job) == "running"

    def test_kind_with_reconcile_false_is_never_touched(self, system: SystemFactory) -> None:
        """reconcile = false: a dead job of that kind stays as it is."""
        job = system.died("skip.report")
        assert run(system) == {}
        assert system.status(job) == "running"

    def test_queued_jobs_are_not_candidates(self, system: SystemFactory) -> None:
        """Only running jobs are read."""
        system.queued("idem.report")
        assert run(system) == {}

    def test_dry_run_changes_nothing(self, system: SystemFactory) -> None:
        """Deciding without applying leaves the job running."""
        job = system.died("idem.report")
        assert run(system, dry_run=True)[job].disposition is Disposition.RESUME
        assert system.status(job) == "running"


JOB_TABLES = {"procrastinate": "procrastinate_jobs", "graphile-worker": "_private_jobs",
              "pg-boss": "job"}


def every_kind(**keys: object) -> KindRules:
    """``[kinds."*"]`` only: every kind judged alike, so the kinds need not be read."""
    return KindRules([KindRule("*", **keys)],  # type: ignore[arg-type]
                     stale_after_seconds=60.0, wedged_after_seconds=3600.0, max_attempts=3)


class TestEveryKindAlike:
    """With ``[kinds]`` setting the scan's keys only under ``"*"``, no list of the running
    kinds is read first, and each job is still judged by its own kind."""

    def test_dead_jobs_of_any_kind_are_decided_by_their_kind(self,
                                                             system: SystemFactory) -> None:
        """An idempotent rule for every kind resumes both; the live job is left alone."""
        first, second = system.died("report.daily"), system.died("mail.send")
        live = system.live("report.daily")
        outcomes = run(system, every_kind(effect=EffectKind.IDEMPOTENT))
        assert {job: o.disposition for job, o in outcomes.items()} == {
            first: Disposition.RESUME, second: Disposition.RESUME}
        assert (system.status(first), system.status(second), system.status(live)) == (
            "queued", "queued", "running")

    def test_reconcile_false_for_every_kind_touches_nothing(self,
                                                             system: SystemFactory) -> None:
        """``[kinds."*"] reconcile = false``: a dead job stays as it is."""
        job = system.died("report.daily")
        assert run(system, every_kind(reconcile=False)) == {}
        assert system.status(job) == "running"

    def test_a_quiet_pass_reads_the_job_table_once(self, system: SystemFactory) -> None:
        """Nothing to recover: one statement of the pass names the job table."""
        system.live("report.daily")
        schema = str(system.config.schema)
        table = re.compile(rf"\b{re.escape(schema)}\.{JOB_TABLES[system.source_name]}\b")
        sent: list[str] = []

        def count(*args: object) -> None:
            sent.append(str(args[2]))

        sa.event.listen(system.db.engine, "before_cursor_execute", count)
        try:
            assert run(system, every_kind(effect=EffectKind.IDEMPOTENT)) == {}
        finally:
            sa.event.remove(system.db.engine, "before_cursor_execute", count)
        reads = [s for s in sent if table.search(s)]
        assert len(reads) == 1, reads


class TestFence:
    """Every swap repeats the snapshot it decided on."""

    def test_job_that_changed_since_the_read_is_not_swapped(self,
                                                            system: SystemFactory) -> None:
        """The job finished by its worker between read and apply: fence lost, untouched."""
        job = system.died("idem.report")
        rules = kind_rules()
        engine = system.db.engine
        with engine.connect() as conn:
            source = system.open_source(conn, rules, lock=False)
            [found] = source.candidates(10, rules.resolve("").thresholds, None)
            conn.rollback()
        [change] = plan_changes([found], rules)
        # The owner comes back and moves the job on: a new claim of the same job.
        finish_elsewhere(system, job)
        with engine.begin() as conn:
            assert system.open_source(conn, rules).apply([change]) == {}

    def test_reclaimed_run_cannot_write_its_steps(self, system: SystemFactory) -> None:
        """After a resume, the dead attempt's step ledger writes raise LeaseLost."""
        steps = [("fetch", "idempotent", "succeeded"), ("render", "idempotent", "started")]
        job = system.died("idem.report", steps=steps)
        attempt = ledger_attempt(system, job)
        assert run(system)[job].applied
        with StepLedger(system.db.engine) as ledger, pytest.raises(LeaseLost):
            ledger.run(system.source_name, job, attempt,
                       [Step("fetch", "idempotent"), Step("render", "idempotent")])


class TestSteps:
    """A task that records its steps through the ledger is judged step by step."""

    def test_died_between_steps_resumes_at_the_unstarted_step(self,
                                                              system: SystemFactory) -> None:
        """fetch succeeded, charge (effectful) never started: resumed at charge."""
        job = system.died("mail.send", steps=[("fetch", "idempotent", "succeeded"),
                                              ("charge", "effectful", None)])
        outcome = run(system)[job]
        assert (outcome.reason, outcome.resume_step_index) == (
            Reason.RESUMED_FROM_UNSTARTED_STEP, 1)
        assert system.status(job) == "queued"

    def test_died_inside_an_effectful_step_is_failed(self, system: SystemFactory) -> None:
        """charge started and never ended: it may have charged; failed, not rerun."""
        job = system.died("idem.report", steps=[("fetch", "idempotent", "succeeded"),
                                                ("charge", "effectful", "started")])
        assert run(system)[job].reason is Reason.WORKER_DIED_MID_STEP
        assert system.status(job) == "failed"

    def test_every_step_succeeded(self, system: SystemFactory) -> None:
        """All steps done, completion never recorded: completion_unrecorded."""
        job = system.died("idem.report", steps=[("fetch", "idempotent", "succeeded")])
        assert run(system)[job].reason is Reason.COMPLETION_UNRECORDED

    def test_live_owner_with_silent_steps_is_wedged(self, system: SystemFactory) -> None:
        """Recorded steps silent past the kind's wedged time, owner alive: worker_wedged."""
        job = system.live("idem.report")
        record_live_step(system, job)
        rules = kind_rules(KindRule("idem.report", stale_after_seconds=0.1,
                                    wedged_after_seconds=0.2))
        age_ledger(system, seconds=5)
        outcome = run(system, rules)[job]
        assert outcome.reason is Reason.WORKER_WEDGED
        assert system.status(job) == "failed"


class TestScans:
    """Scans page by key, are bounded, and count the backlog."""

    def test_cursor_pages_by_id(self, system: SystemFactory) -> None:
        """Two pages of one job each cover two dead jobs, in id order."""
        first, second = system.died("idem.a"), system.died("idem.b")
        rules = kind_rules()
        with system.db.engine.connect() as conn:
            source = system.open_source(conn, rules, lock=False)
            [page1] = source.candidates(1, rules.resolve("").thresholds, None)
            assert page1.position is not None
            [page2] = source.candidates(1, rules.resolve("").thresholds, page1.position)
            assert source.candidates(1, rules.resolve("").thresholds, page2.position) == []
            assert sorted([str(page1.job_id), str(page2.job_id)]) == sorted(
                [str(first), str(second)])
            assert source.candidates(0, rules.resolve("").thresholds, None) == []
            assert source.candidates(5, rules.resolve("").thresholds,
                                     Cursor((page1.job_id,)))[0].job_id == page2.job_id

    def test_stuck_work(self, system: SystemFactory) -> None:
        """Dead jobs count as awaiting a decision; live, queued and never-reconciled ones do
        not; a foreign system keeps no hold or gate of ours to count."""
        system.died("idem.a")
        system.died("mail.b")
        system.live("idem.c")
        system.queued("idem.d")
        system.died("skip.e")
        rules = kind_rules()
        with system.db.engine.connect() as conn:
            stuck = system.open_source(conn, rules).stuck_work()
        awaiting = stuck[StuckReason.AWAITING_DECISION]
        assert awaiting.count == 2
        assert awaiting.oldest_seconds is not None
        assert awaiting.oldest_seconds > 0
        assert set(stuck) == {StuckReason.AWAITING_DECISION}


class TestSchemaCheck:
    """A foreign schema that is not there is one line naming it."""

    def test_missing_schema(self, system: SystemFactory) -> None:
        """A config naming a schema that does not exist is refused before any pass."""
        rules = kind_rules()
        with system.db.engine.connect() as conn:
            source = type(system)(system.db, "no_such_schema").open_source(  # type: ignore[call-arg,attr-defined]
                conn, rules)
            with pytest.raises(ConfigError) as caught:
                source.check_schema()
        assert "no_such_schema" in str(caught.value)
        assert "\n" not in str(caught.value)

    def test_present_schema_passes(self, system: SystemFactory) -> None:
        """The real schema passes the check."""
        with system.db.engine.connect() as conn:
            system.open_source(conn, kind_rules()).check_schema()


# --------------------------------------------------------------------------- #
# Helpers per system
# --------------------------------------------------------------------------- #


def finish_elsewhere(system: SystemFactory, job: object) -> None:
    """The job's run moves on without us (a new claim of the same job)."""
    if isinstance(system, ProcrastinateFactory):
        system._sql("UPDATE procrastinate_jobs SET attempts = attempts + 1 WHERE id = :id",
                    {"id": job})
    elif isinstance(system, GraphileWorkerFactory):
        system._sql("UPDATE _private_jobs SET locked_at = now() - interval '5 hours', "
                    "locked_by = 'another-pool' WHERE id = :id", {"id": job})
    else:
        assert isinstance(system, PgBossFactory)
        system._sql("UPDATE job SET started_on = started_on + interval '1 second' "
                    "WHERE id = CAST(:id AS uuid)", {"id": job})


def ledger_attempt(system: SystemFactory, job: object) -> int:
    """The attempt number the running attempt's task passes to the ledger."""
    used = system.attempts_used(job)  # type: ignore[arg-type]
    return used if isinstance(system, GraphileWorkerFactory) else used - 1


def record_live_step(system: SystemFactory, job: object) -> None:
    with StepLedger(system.db.engine) as ledger:
        run_ = ledger.run(system.source_name, job, ledger_attempt(system, job),  # type: ignore[arg-type]
                          [Step("fetch", "idempotent")])
        run_.step(0).__enter__()


def age_ledger(system: SystemFactory, seconds: float) -> None:
    with system.db.engine.begin() as conn:
        conn.execute(sa.text("UPDATE step_ledger_entries SET updated_at = updated_at - "
                             "make_interval(secs => :s)"), {"s": seconds})


def test_procrastinate_job_with_an_abort_requested_is_failed_not_retried(
        procrastinate_db: SourcesDatabase, procrastinate_schema: str) -> None:
    """As Procrastinate's own retry does: a dead job whose abort was requested is resumed
    as failed, its attempts kept, with its own ``failed`` event; a job beside it in the
    same batch is retried as usual."""
    system = ProcrastinateFactory(procrastinate_db, procrastinate_schema)
    aborting, plain = system.died("idem.report"), system.died("idem.report")
    with procrastinate_db.engine.begin() as conn:  # as its own cancel(abort=True) asks
        conn.execute(sa.text("SELECT set_config('search_path', :p, true)"),
                     {"p": f"{procrastinate_schema}, public"})
        conn.execute(sa.text("SELECT procrastinate_cancel_job_v1(:id, true, false)"),
                     {"id": aborting})
    finished = system.row(aborting)["attempts"]  # type: ignore[index]
    outcomes = run(system)
    assert all(outcomes[job].applied for job in (aborting, plain))
    row = system.row(aborting)
    assert row is not None
    assert (row["status"], row["attempts"]) == ("failed", finished)
    assert system.events(aborting)[-1] == "failed"
    assert system.status(plain) == "queued"
    assert system.events(plain)[-1] == "deferred_for_retry"
