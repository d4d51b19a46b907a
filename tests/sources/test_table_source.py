"""A home-grown job table mapped column by column (``kind = "table"``), SQLite and PostgreSQL."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from reconciler.core.kinds import KindRule, KindRules
from reconciler.core.vocabulary import Disposition, EffectKind, Reason
from reconciler.errors import ConfigError
from reconciler.sources.table import DECLARATION as TABLE
from reconciler.sources.table import TableFence
from reconciler.sources.table.config import TableConfig
from reconciler.storage.clock import now_plus
from tests.sources.actions_support import forget_source
from tests.sources.support import by_job, explain, plan_changes, reconcile_once

FULL = TableConfig(
    table="jobs", id_column="id", status_column="status", processing="processing",
    queued="pending", failed="failed", kind_column="job_type", reason_column="status_reason",
    activity_column="last_activity_at", lease_expires_column="lease_until",
    owner_column="claimed_by", attempts_column="attempts", max_attempts_column="max_attempts",
    generation_column="generation", resume_column="resume_step", plan_column="step_plan",
    steps_column="step_results")
MINIMAL = TableConfig(table="jobs", id_column="id", status_column="status",
                      processing="processing", queued="pending", failed="failed",
                      kind_column="job_type", activity_column="last_activity_at",
                      reason_column="status_reason")
PLAN = [{"step_name": "fetch", "effect_kind": "idempotent"},
        {"step_name": "charge", "effect_kind": "effectful"},
        {"step_name": "notify", "effect_kind": "pure"}]
KINDS = KindRules([KindRule("idem.*", effect=EffectKind.IDEMPOTENT),
                   KindRule("timed.*", effect=EffectKind.IDEMPOTENT, max_run_seconds=30.0),
                   KindRule("skip.*", reconcile=False)],
                  stale_after_seconds=60.0, wedged_after_seconds=600.0, max_attempts=3)



def jobs_table(schema: str | None) -> sa.Table:
    """The home-grown table, as such tables are: a status, times, attempts, JSON steps."""
    return sa.Table(
        "jobs", sa.MetaData(schema=schema),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_type", sa.String(100)),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("status_reason", sa.String(64)),
        sa.Column("last_activity_at", sa.DateTime(timezone=True)),
        sa.Column("lease_until", sa.DateTime(timezone=True)),
        sa.Column("claimed_by", sa.String(100)),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("max_attempts", sa.Integer),
        sa.Column("generation", sa.Integer, nullable=False, server_default="0"),
        sa.Column("resume_step", sa.Integer),
        sa.Column("step_plan", sa.JSON),
        sa.Column("step_results", sa.JSON),
    )


@dataclass(frozen=True)
class Home:
    """A test's home-grown table: its engine, the table, and both mappings of it."""

    engine: Engine
    jobs: sa.Table
    full: TableConfig
    minimal: TableConfig


@pytest.fixture
def home(reconciler_engine: Engine) -> Iterator[Home]:
    """The reconciler's database on each engine, with a home-grown ``jobs`` table in it (in
    a PostgreSQL schema of the test's own)."""
    schema = None
    if reconciler_engine.dialect.name == "postgresql":
        schema = f"home_{uuid.uuid4().hex[:8]}"
        with reconciler_engine.begin() as conn:
            conn.execute(sa.schema.CreateSchema(schema))
        # The reconciler's tables are the session's there, and every test's table counts
        # from 1: an earlier test's hold, action or decision about job 1 is not this test's.
        forget_source(reconciler_engine, "table")
    jobs = jobs_table(schema)
    jobs.metadata.create_all(reconciler_engine)
    try:
        yield Home(reconciler_engine, jobs, replace(FULL, schema=schema),
                   replace(MINIMAL, schema=schema))
    finally:
        if schema is not None:
            with reconciler_engine.begin() as conn:
                conn.execute(sa.schema.DropSchema(schema, cascade=True))


def add(home: Home, **values: Any) -> int:
    """A job row; ``lease_in`` / ``activity_ago`` set times by the database clock."""
    lease_in = values.pop("lease_in", None)
    activity_ago = values.pop("activity_ago", None)
    row: dict[str, Any] = {"job_type": "idem.report", "status": "processing",
                           "claimed_by": "host-a:1", "attempts": 1, **values}
    if lease_in is not None:
        row["lease_until"] = now_plus(lease_in)
    if activity_ago is not None:
        row["last_activity_at"] = now_plus(-activity_ago)
    jobs = home.jobs
    with home.engine.begin() as conn:
        return int(conn.execute(jobs.insert().values(row).returning(jobs.c.id)).scalar_one())


def dead(home: Home, **values: Any) -> int:
    """Claimed, its lease run out five minutes ago, no activity for ten."""
    return add(home, lease_in=-300, activity_ago=600, **values)


def row(home: Home, job: int) -> dict[str, Any]:
    with home.engine.connect() as conn:
        return dict(conn.execute(sa.select(home.jobs).where(home.jobs.c.id == job)
                                 ).one()._mapping)


def run(home: Home, config: TableConfig | None = None, kinds: KindRules = KINDS,
        **kw: Any) -> dict[Any, Any]:
    """One reconcile step over the table (the full mapping unless another is given)."""
    mapping = config or home.full
    return by_job(reconcile_once(home.engine, mapping, kinds, **kw))


def steps(*states: str | None) -> dict[str, Any]:
    """The plan and the results of its first steps (None: never started)."""
    results = {str(i): s for i, s in enumerate(states) if s is not None}
    return {"step_plan": PLAN, "step_results": results}


class TestStepLevel:
    """With plan and step results mapped, the full decision table applies."""

    def test_died_between_steps_resumes_at_the_unstarted_step(self, home: Home) -> None:
        """fetch succeeded, charge never started: pending again, at step 1, fenced anew."""
        job = dead(home, job_type="mail.send", **steps("succeeded"))
        outcome = run(home)[job]
        assert (outcome.reason, outcome.resume_step_index) == (
            Reason.RESUMED_FROM_UNSTARTED_STEP, 1)
        assert outcome.generation_after == 1
        after = row(home, job)
        assert (after["status"], after["resume_step"], after["generation"],
                after["status_reason"]) == ("pending", 1, 1, "resumed_from_unstarted_step")
        # The job system's own columns are left as they were.
        assert (after["claimed_by"], after["attempts"]) == ("host-a:1", 1)

    def test_died_inside_an_effectful_step_is_failed(self, home: Home) -> None:
        """charge started and never ended: failed with our reason, generation bumped."""
        job = dead(home, **steps("succeeded", "started"))
        assert run(home)[job].reason is Reason.WORKER_DIED_MID_STEP
        after = row(home, job)
        assert (after["status"], after["status_reason"], after["generation"]) == (
            "failed", "worker_died_mid_step", 1)

    def test_idempotent_step_started_is_resumed_at_it(self, home: Home) -> None:
        """fetch started (idempotent): resumed at step 0."""
        job = dead(home, **steps("started"))
        outcome = run(home)[job]
        assert (outcome.reason, outcome.resume_step_index) == (
            Reason.RESUMED_IDEMPOTENT_STEP, 0)
        assert row(home, job)["resume_step"] == 0

    def test_out_of_attempts(self, home: Home) -> None:
        """attempts = max_attempts: resume_exhausted, failed."""
        job = dead(home, attempts=4, max_attempts=4, **steps("started"))
        assert run(home)[job].reason is Reason.RESUME_EXHAUSTED
        assert row(home, job)["status"] == "failed"

    def test_budget_from_kinds_when_the_table_has_none(self, home: Home) -> None:
        """No max_attempts value: the kind's (3) applies."""
        job = dead(home, attempts=3, **steps("started"))
        assert run(home)[job].reason is Reason.RESUME_EXHAUSTED

    def test_missing_plan_is_unresumable(self, home: Home) -> None:
        """A plan column left empty: nothing can be resumed safely."""
        job = dead(home)
        assert run(home)[job].reason is Reason.UNRESUMABLE_PLAN
        assert row(home, job)["status"] == "failed"

    def test_unreadable_results_are_a_reconcile_error(self, home: Home) -> None:
        """Step results that are not an object of index -> state: skipped, untouched."""
        job = dead(home, step_plan=PLAN, step_results=["succeeded"])
        outcome = run(home)[job]
        assert (outcome.disposition, outcome.reason) == (Disposition.SKIP,
                                                         Reason.RECONCILE_ERROR)
        assert outcome.evidence == {"error": "EvidenceError",
                                    "error_code": "unreadable_step_results",
                                    "column": "step_results"}
        assert row(home, job)["status"] == "processing"


class TestLiveness:
    """Lease, activity and the kind's max_run_seconds decide who is a candidate."""

    def test_live_lease_is_left_alone(self, home: Home) -> None:
        """A lease in the future: not read as a candidate; explain says lease_live."""
        job = add(home, lease_in=30, activity_ago=1, **steps("started"))
        assert run(home) == {}
        decision = explain(home.engine, home.full, KINDS, [job])
        assert decision[job].reason is Reason.LEASE_LIVE
        # As the command line gives it: text, compared as the key column's own type.
        typed = explain(home.engine, home.full, KINDS, [str(job), "not-a-number"])
        assert [(d.job_id, d.reason) for d in typed.values()] == [(job, Reason.LEASE_LIVE)]

    def test_recent_activity_protects_an_expired_lease(self, home: Home) -> None:
        """Lease run out but progress 5 s ago: skip recent_activity, nothing written."""
        job = add(home, lease_in=-10, activity_ago=5, **steps("started"))
        outcome = run(home)[job]
        assert outcome.reason is Reason.RECENT_ACTIVITY
        assert row(home, job)["generation"] == 0

    def test_live_lease_without_progress_is_wedged(self, home: Home) -> None:
        """Lease renewed, no activity for longer than wedged_after_seconds: failed."""
        job = add(home, lease_in=30, activity_ago=700, **steps("started"))
        assert run(home)[job].reason is Reason.WORKER_WEDGED
        assert row(home, job)["status"] == "failed"

    def test_activity_plus_max_run_is_the_lease_without_a_lease_column(
            self, home: Home) -> None:
        """No lease column: a kind promising 30 s is reclaimed after 30 s of silence, a kind
        promising nothing never is, however old."""
        promised = add(home, job_type="timed.report", activity_ago=120)
        fresh = add(home, job_type="timed.report", activity_ago=10)
        unpromised = add(home, job_type="idem.report", activity_ago=86400)
        outcomes = run(home, home.minimal)
        assert set(outcomes) == {promised}
        assert outcomes[promised].reason is Reason.RESUMED_IDEMPOTENT_STEP
        assert row(home, promised)["status"] == "pending"
        assert row(home, promised)["status_reason"] == "resumed_idempotent_step"
        assert row(home, fresh)["status"] == row(home, unpromised)["status"] == "processing"

    def test_one_step_named_after_the_kind_with_its_effect(self, home: Home) -> None:
        """Without plan columns a job is one started step: effectful by default."""
        rules = KindRules([KindRule("*", max_run_seconds=30.0)], stale_after_seconds=60.0,
                          wedged_after_seconds=600.0, max_attempts=3)
        job = add(home, job_type="mail.send", activity_ago=120)
        outcome = run(home, home.minimal, rules)[job]
        assert outcome.reason is Reason.WORKER_DIED_MID_STEP
        assert outcome.evidence["effect_kinds"] == ["effectful"]
        assert row(home, job)["status"] == "failed"

    def test_table_name_is_the_kind_without_a_kind_column(self, home: Home) -> None:
        """No kind column: [kinds."jobs"] applies to every row."""
        rules = KindRules([KindRule("jobs", effect=EffectKind.PURE, max_run_seconds=30.0)],
                          stale_after_seconds=60.0, wedged_after_seconds=600.0,
                          max_attempts=3)
        job = add(home, job_type="whatever", activity_ago=120)
        config = replace(home.minimal, kind_column=None)
        assert run(home, config, rules)[job].reason is Reason.RESUMED_IDEMPOTENT_STEP

    def test_neither_lease_nor_activity_never_reclaims(self, home: Home) -> None:
        """With no time column at all nothing is reclaimed on time."""
        add(home, activity_ago=86400)
        bare = TableConfig(table="jobs", id_column="id", status_column="status",
                           processing="processing", queued="pending", failed="failed",
                           schema=home.full.schema)
        assert run(home, bare) == {}

    def test_kind_with_reconcile_false(self, home: Home) -> None:
        """Never touched."""
        job = dead(home, job_type="skip.report", **steps("started"))
        assert run(home) == {}
        assert row(home, job)["status"] == "processing"


class TestCrashLoop:
    """Attempts lost in a row come from the reconciler's own audit: the table keeps none."""

    RULES = KindRules([KindRule("idem.*", effect=EffectKind.IDEMPOTENT,
                                max_run_seconds=30.0)],
                      stale_after_seconds=60.0, wedged_after_seconds=600.0, max_attempts=10,
                      crash_loop_after=3)

    def claimed_and_killed(self, home: Home, job: int, **values: Any) -> None:
        """The job system's next worker claims the resumed job, then dies in it too."""
        with home.engine.begin() as conn:
            conn.execute(home.jobs.update().where(home.jobs.c.id == job).values(
                status="processing", last_activity_at=now_plus(-120), **values))

    def test_without_an_attempts_column_the_third_loss_in_a_row_is_a_crash_loop(
            self, home: Home) -> None:
        """Killed three times in a row: resumed twice, then ended crash_loop, not resumed a
        third time (the count is the audit's resumes plus the attempt judged)."""
        # Ids of their own: the audit (in the reconciler's database) outlives each test's
        # table, and a job's history is its id's.
        job = add(home, id=7001, job_type="idem.report", activity_ago=120)
        seen = []
        for _ in range(3):
            outcome = run(home, home.minimal, self.RULES)[job]
            seen.append((outcome.reason, outcome.evidence["lost_attempts_in_a_row"]))
            self.claimed_and_killed(home, job)
        assert seen == [(Reason.RESUMED_IDEMPOTENT_STEP, 1), (Reason.RESUMED_IDEMPOTENT_STEP, 2),
                        (Reason.CRASH_LOOP, 3)]
        assert row(home, job)["status_reason"] == "crash_loop"

    def test_an_attempt_its_own_worker_ended_breaks_the_count(self, home: Home) -> None:
        """With an attempts column, a run in between that the job system retried itself (its
        counter moved by two) starts the count again, as the native count does."""
        mapping = replace(home.minimal, attempts_column="attempts")
        job = add(home, id=7002, job_type="idem.report", activity_ago=120, attempts=1)
        assert run(home, mapping, self.RULES)[job].reason is Reason.RESUMED_IDEMPOTENT_STEP
        self.claimed_and_killed(home, job, attempts=2)
        assert run(home, mapping, self.RULES)[job].evidence["lost_attempts_in_a_row"] == 2
        self.claimed_and_killed(home, job, attempts=4)  # attempt 3 failed and was retried
        outcome = run(home, mapping, self.RULES)[job]
        assert (outcome.reason, outcome.evidence["lost_attempts_in_a_row"]) == (
            Reason.RESUMED_IDEMPOTENT_STEP, 1)


class TestFence:
    """The swap repeats status, owner, attempts, generation and the lease it read."""

    @pytest.mark.parametrize("change", [
        {"claimed_by": "host-b:2"}, {"attempts": 2}, {"generation": 5},
        {"status": "completed"},
    ])
    def test_a_changed_row_is_not_swapped(self, home: Home, change: dict[str, Any]) -> None:
        """Between read and apply the row moved: nothing is written."""
        job = dead(home, **steps("started"))
        with home.engine.connect() as conn:
            [found] = TABLE.open(conn, home.full, KINDS, lock=False).candidates(
                10, KINDS.resolve("").thresholds, None)
            conn.rollback()
        [planned] = plan_changes([found], KINDS)
        with home.engine.begin() as conn:
            conn.execute(home.jobs.update().where(home.jobs.c.id == job).values(**change))
        before = row(home, job)
        with home.engine.begin() as conn:
            assert TABLE.open(conn, home.full, KINDS).apply([planned]) == {}
        assert row(home, job) == before

    def test_renewed_lease_is_not_swapped(self, home: Home) -> None:
        """The worker renewed its lease after the read: the time predicate fails."""
        job = dead(home, **steps("started"))
        with home.engine.connect() as conn:
            [found] = TABLE.open(conn, home.full, KINDS, lock=False).candidates(
                10, KINDS.resolve("").thresholds, None)
            conn.rollback()
        [planned] = plan_changes([found], KINDS)
        fence = planned.fence.snapshot
        assert isinstance(fence, TableFence)
        with home.engine.begin() as conn:
            jobs = home.jobs
            conn.execute(jobs.update().where(jobs.c.id == job).values(lease_until=now_plus(60)))
            lease = conn.execute(sa.select(jobs.c.lease_until).where(jobs.c.id == job)).scalar()
        # Same lease value in the snapshot, so only the time predicate can refuse it.
        renewed = replace(planned, fence=replace(planned.fence, snapshot=replace(fence, columns=(
            tuple((k, lease if k == "lease_expires_column" else v) for k, v in fence.columns)))))
        with home.engine.begin() as conn:
            assert TABLE.open(conn, home.full, KINDS).apply([renewed]) == {}
        assert row(home, job)["status"] == "processing"


class TestTimestamps:
    """Time columns as home-grown tables store them."""

    def test_iso_text_with_t_and_z(self, home: Home) -> None:
        """'2024-01-01T10:00:00.123456Z' text (SQLite) or timestamptz (PostgreSQL) ages alike."""
        old = datetime.now(UTC) - timedelta(seconds=600)
        job = add(home, last_activity_at=old, lease_until=old, **steps("started"))
        if home.engine.dialect.name == "sqlite":
            with home.engine.begin() as conn:
                # Raw text, as a home-grown worker would have written it (no SQLAlchemy type).
                conn.execute(sa.text("UPDATE jobs SET last_activity_at = :t, lease_until = :t"),
                             {"t": old.strftime("%Y-%m-%dT%H:%M:%S.%fZ")})
        outcome = run(home)[job]
        assert outcome.reason is Reason.RESUMED_IDEMPOTENT_STEP
        assert 590 < outcome.evidence["activity_age_seconds"] < 700

    @pytest.mark.parametrize("reconciler_engine", ["postgresql"], indirect=True)
    def test_timestamp_without_time_zone_is_utc(self, home: Home) -> None:
        """A PostgreSQL ``timestamp`` column holds UTC: ages come out right whatever the
        session's time zone."""
        with home.engine.begin() as conn:
            conn.execute(sa.text(f"SET LOCAL search_path TO {home.full.schema}"))
            conn.execute(sa.text("ALTER TABLE jobs ALTER COLUMN last_activity_at TYPE timestamp "
                                 "USING last_activity_at AT TIME ZONE 'UTC'"))
            conn.execute(sa.text("ALTER TABLE jobs ALTER COLUMN lease_until TYPE timestamp "
                                 "USING lease_until AT TIME ZONE 'UTC'"))
        naive = (datetime.now(UTC) - timedelta(seconds=600)).replace(tzinfo=None)
        with home.engine.begin() as conn:
            conn.execute(sa.text(f"SET LOCAL search_path TO {home.full.schema}"))
            conn.execute(sa.text("INSERT INTO jobs (job_type, status, attempts, generation, "
                                 "last_activity_at, lease_until, step_plan, step_results) "
                                 "VALUES ('idem.x', 'processing', 1, 0, :t, :t, :p, '{}')"),
                         {"t": naive, "p": json.dumps(PLAN)})
        with home.engine.connect() as conn:
            conn.execute(sa.text("SET TimeZone = 'Pacific/Auckland'"))
            [found] = TABLE.open(conn, home.full, KINDS, lock=False).candidates(
                10, KINDS.resolve("").thresholds, None)
            conn.rollback()
        assert found.activity_age_seconds is not None
        assert 590 < found.activity_age_seconds < 700


class TestSchemaCheck:
    """A missing table or column is one line naming it."""

    def test_present(self, home: Home) -> None:
        """The full mapping of the design example passes on the real table."""
        with home.engine.connect() as conn:
            TABLE.open(conn, home.full, KINDS).check_schema()

    def test_missing_column(self, home: Home) -> None:
        """A mapped column that is not there is named with its key."""
        config = replace(home.full, lease_expires_column="lease_expiry")
        with home.engine.connect() as conn, pytest.raises(ConfigError) as caught:
            TABLE.open(conn, config, KINDS).check_schema()
        assert "lease_expiry" in str(caught.value)
        assert "lease_expires_column" in str(caught.value)
        assert "\n" not in str(caught.value)

    def test_missing_table(self, home: Home) -> None:
        """A table that is not there is named."""
        with home.engine.connect() as conn, pytest.raises(ConfigError, match="job_queue"):
            TABLE.open(conn, replace(home.full, table="job_queue"), KINDS).check_schema()


class TestNothingStranded:
    """A mapped table whose rows or mapping are off is seen and refused, never silent."""

    def test_a_null_kind_is_the_tables_name(self, home: Home) -> None:
        """A running job whose kind column is NULL is judged as kind ``jobs`` (the table's
        name) by the dry run, the pass and explain, not dropped."""
        rules = KindRules([KindRule("jobs", effect=EffectKind.IDEMPOTENT, max_run_seconds=30.0)],
                          stale_after_seconds=60.0, wedged_after_seconds=600.0,
                          max_attempts=3)
        job = dead(home, job_type=None)
        assert run(home, home.minimal, rules, dry_run=True)[job].reason is \
            Reason.RESUMED_IDEMPOTENT_STEP
        assert explain(home.engine, home.minimal, rules, [job])[job].reason is \
            Reason.RESUMED_IDEMPOTENT_STEP
        assert run(home, home.minimal, rules)[job].reason is Reason.RESUMED_IDEMPOTENT_STEP
        assert row(home, job)["status"] == "pending"

    @pytest.mark.parametrize(("key", "value"), [("queued", "pendng"), ("failed", "faild"),
                                                ("processing", "running"),
                                                ("cancelled", "canceled")])
    def test_a_status_value_a_check_constraint_forbids_is_refused(
            self, home: Home, key: str, value: str) -> None:
        """With ``CHECK (status IN (...))`` a misspelt value is one line naming it."""
        checked = self.checked_table(home)
        config = replace(home.full, table=checked, **{key: value})
        with home.engine.connect() as conn, pytest.raises(ConfigError) as caught:
            TABLE.open(conn, config, KINDS).check_schema()
        assert f"{key} = {value!r}" in str(caught.value)
        assert "CHECK" in str(caught.value)
        assert "\n" not in str(caught.value)
        with home.engine.connect() as conn:  # the right values pass
            TABLE.open(conn, replace(home.full, table=checked), KINDS).check_schema()

    @pytest.mark.parametrize("reconciler_engine", ["postgresql"], indirect=True)
    def test_a_status_value_outside_the_enum_is_refused(self, home: Home) -> None:
        """A PostgreSQL enum status column names the values it allows."""
        with home.engine.begin() as conn:
            conn.execute(sa.text(f"SET LOCAL search_path TO {home.full.schema}"))
            conn.execute(sa.text("CREATE TYPE job_state AS ENUM "
                                 "('processing', 'pending', 'failed', 'done')"))
            conn.execute(sa.text("ALTER TABLE jobs ALTER COLUMN status TYPE job_state "
                                 "USING status::job_state"))
        with home.engine.connect() as conn, pytest.raises(ConfigError, match="'pendng'"):
            TABLE.open(conn, replace(home.full, queued="pendng"), KINDS).check_schema()
        with home.engine.connect() as conn, pytest.raises(
                ConfigError, match="cancelled = 'cancelled' is not a value of column"):
            TABLE.open(conn, replace(home.full, cancelled="cancelled"), KINDS).check_schema()
        with home.engine.connect() as conn:
            TABLE.open(conn, home.full, KINDS).check_schema()

    def test_a_status_value_no_row_holds_is_warned_about(
            self, home: Home, caplog: pytest.LogCaptureFixture) -> None:
        """``processing = "running"`` on a table whose workers write ``processing``: one
        warning line naming the value (it would find no job, for ever)."""
        dead(home)
        add(home, status="failed")
        add(home, status="pending")
        with caplog.at_level("WARNING", logger="reconciler.sources"), \
                home.engine.connect() as conn:
            # No row is cancelled yet, as on any table before an operator's first cancel:
            # the mapped value draws no warning.
            TABLE.open(conn, replace(home.full, processing="running", cancelled="cancelled"),
                       KINDS).check_schema()
        unseen = [r.getMessage() for r in caplog.records if "status_value_unseen" in
                  r.getMessage()]
        assert len(unseen) == 1
        assert "key=processing value='running' column=status" in unseen[0]

    @staticmethod
    def checked_table(home: Home) -> str:
        """A copy of the jobs table whose status column has a CHECK of its values."""
        metadata = sa.MetaData(schema=home.full.schema)
        table = home.jobs.to_metadata(metadata, name="checked_jobs")
        table.append_constraint(sa.CheckConstraint(
            "status IN ('processing', 'pending', 'failed', 'done')", name="status_known"))
        metadata.create_all(home.engine)
        return table.name

    @pytest.mark.parametrize("reconciler_engine", ["sqlite"], indirect=True)
    @pytest.mark.parametrize("written", [1700000000, "yesterday"])
    def test_a_time_sqlite_cannot_read_is_a_reconcile_error_naming_the_column(
            self, home: Home, written: object) -> None:
        """An epoch integer or 'yesterday' in the lease column is never a live lease: the
        job is skipped ``reconcile_error`` with the column in its evidence, in explain and
        in the pass, and left as it is."""
        job = add(home, activity_ago=3600, **steps("started"))
        with home.engine.begin() as conn:
            conn.execute(sa.text("UPDATE jobs SET lease_until = :t WHERE id = :id"),
                         {"t": written, "id": job})
        explained = explain(home.engine, home.full, KINDS, [job])[job]
        outcome = run(home)[job]
        assert (explained.reason, outcome.disposition, outcome.reason) == (
            Reason.RECONCILE_ERROR, Disposition.SKIP, Reason.RECONCILE_ERROR)
        assert outcome.evidence == {"error": "EvidenceError",
                                    "error_code": "unreadable_timestamp",
                                    "column": "lease_until"}
        with home.engine.connect() as conn:
            assert conn.execute(sa.text("SELECT status, lease_until FROM jobs")).one() == (
                "processing", written)
