"""Each system's own shapes after a swap: queues unlocked, unique indexes and partitions
respected, dead-letter copies, Procrastinate's constraints and events."""

from __future__ import annotations

import pytest

from reconciler.core.kinds import KindRule, KindRules
from reconciler.core.vocabulary import Disposition, EffectKind, Reason
from tests.sources.conftest import SourcesDatabase
from tests.sources.factories import GraphileWorkerFactory, PgBossFactory, ProcrastinateFactory
from tests.sources.support import by_job, reconcile_once

KINDS = KindRules([KindRule("idem.*", effect=EffectKind.IDEMPOTENT)],
                  stale_after_seconds=60.0, wedged_after_seconds=3600.0, max_attempts=3)


def run(factory: GraphileWorkerFactory | PgBossFactory | ProcrastinateFactory
        ) -> dict[object, object]:
    return by_job(reconcile_once(factory.db.engine, factory.config, KINDS))


class TestGraphileWorker:
    """graphile-worker: named queues and its own failure function."""

    @pytest.fixture
    def graphile(self, graphile_db: SourcesDatabase, graphile_schema: str
                 ) -> GraphileWorkerFactory:
        return GraphileWorkerFactory(graphile_db, graphile_schema)

    def test_resume_unlocks_the_named_queue(self, graphile: GraphileWorkerFactory) -> None:
        """A dead job held its queue: resumed, the job and the queue are free, and the
        queue's next job is claimable by graphile-worker's own claim query."""
        job = graphile.died("idem.report", queue="reports")
        assert graphile.queue_locked(job)
        waiting = graphile.add("idem.report", queue="reports")
        assert run(graphile)[job].applied
        assert not graphile.queue_locked(job)
        after = graphile.row(job)
        assert after is not None
        assert (after["locked_at"], after["locked_by"], after["runnable"]) == (None, None, True)
        claimable = graphile._sql(
            "SELECT id FROM _private_jobs j WHERE j.is_available AND j.run_at <= now() AND "
            "(j.job_queue_id IS NULL OR j.job_queue_id IN (SELECT id FROM _private_job_queues "
            "WHERE is_available)) ORDER BY id")
        assert [r.id for r in claimable] == [job, waiting]

    def test_terminalize_unlocks_the_queue_and_fails_for_good(
            self, graphile: GraphileWorkerFactory) -> None:
        """Failed by permanently_fail_jobs: attempts = max_attempts, never available again."""
        job = graphile.died("mail.send", queue="mail")
        outcome = run(graphile)[job]
        assert outcome.reason is Reason.WORKER_DIED_MID_STEP
        assert outcome.generation_after == graphile.default_max_attempts
        after = graphile.row(job)
        assert after is not None
        assert after["attempts"] == after["max_attempts"]
        assert after["last_error"] == "worker_died_mid_step"
        assert not graphile.queue_locked(job)
        [(available,)] = graphile._sql("SELECT is_available FROM _private_jobs WHERE id = :id",
                                       {"id": job})
        assert available is False

    def test_queue_locked_by_another_pool_stays_locked(
            self, graphile: GraphileWorkerFactory) -> None:
        """Only the dead pool's lock on the queue is lifted, never someone else's."""
        job = graphile.died("idem.report", queue="reports")
        graphile._sql("UPDATE _private_job_queues SET locked_by = 'a-live-pool'")
        assert run(graphile)[job].applied
        assert graphile.queue_locked(job)


class TestPgBoss:
    """pg-boss: queue policies' unique indexes, partitions, dead letters."""

    @pytest.fixture
    def pgboss(self, pgboss_db: SourcesDatabase, pgboss_schema: str) -> PgBossFactory:
        return PgBossFactory(pgboss_db, pgboss_schema)

    def test_resume_is_retry_runnable_now(self, pgboss: PgBossFactory) -> None:
        """retry, start_after now; the next fetch counts the attempt (retry_count + 1)."""
        job = pgboss.died("idem.report")
        assert run(pgboss)[job].applied
        after = pgboss.row(job)
        assert after is not None
        assert (after["state"], after["retry_count"], after["runnable"]) == ("retry", 0, True)
        # pg-boss's own fetch statement, as plans.js writes it.
        [(fetched, retries)] = pgboss._sql(
            "UPDATE job j SET state = 'active', started_on = now(), retry_count = CASE WHEN "
            "started_on IS NOT NULL THEN retry_count + 1 ELSE retry_count END "
            "WHERE name = 'idem.report' AND state < 'active' AND start_after < now() "
            "RETURNING id::text, retry_count")
        assert (fetched, retries) == (job, 1)

    def test_stately_queue_with_retry_taken_goes_back_to_created(
            self, pgboss: PgBossFactory) -> None:
        """A stately queue holds one job per state and key: retry taken, so created."""
        pgboss.queue("idem.stately", policy="stately")
        job = pgboss.send("idem.stately", singleton_key="k")
        pgboss.claim(job, age=6 * 3600)
        other = pgboss.send("idem.stately", singleton_key="k")
        pgboss._sql("UPDATE job SET state = 'retry' WHERE id = CAST(:id AS uuid)", {"id": other})
        assert run(pgboss)[job].applied
        after = pgboss.row(job)
        assert after is not None
        assert after["state"] == "created"

    def test_stately_queue_with_both_taken_is_left_alone(self, pgboss: PgBossFactory) -> None:
        """retry and created both held for the key: no swap (recorded fence_lost), no error."""
        pgboss.queue("idem.stately", policy="stately")
        job = pgboss.send("idem.stately", singleton_key="k")
        pgboss.claim(job, age=6 * 3600)
        retrying = pgboss.send("idem.stately", singleton_key="k")
        pgboss._sql("UPDATE job SET state = 'retry' WHERE id = CAST(:id AS uuid)",
                    {"id": retrying})
        pgboss.send("idem.stately", singleton_key="k")
        outcome = run(pgboss)[job]
        assert (outcome.disposition, outcome.reason) == (Disposition.SKIP, Reason.FENCE_LOST)
        assert pgboss.status(job) == "running"

    def test_terminalize_copies_into_the_dead_letter_queue(self, pgboss: PgBossFactory) -> None:
        """As pg-boss's own fail: the job failed with our reason, a copy in its dead letter."""
        # Queues of this test's own: queues outlive a test's jobs in the session's schema.
        pgboss.queue("letters.dead")
        pgboss.queue("letters.send", dead_letter="letters.dead")
        job = pgboss.send("letters.send", {"to": "someone"})
        pgboss.claim(job, age=6 * 3600)
        assert run(pgboss)[job].reason is Reason.WORKER_DIED_MID_STEP
        after = pgboss.row(job)
        assert after is not None
        assert after["state"] == "failed"
        assert after["output"] == {"reason": "worker_died_mid_step",
                                   "message": "worker_died_mid_step"}
        [(name, data, output)] = pgboss._sql(
            "SELECT name, data, output FROM job WHERE name = 'letters.dead'")
        assert (name, data, output["reason"]) == ("letters.dead", {"to": "someone"},
                                                  "worker_died_mid_step")


class TestProcrastinate:
    """Procrastinate: its functions keep its constraints; a gone worker row counts."""

    @pytest.fixture
    def procrastinate(self, procrastinate_db: SourcesDatabase, procrastinate_schema: str
                      ) -> ProcrastinateFactory:
        return ProcrastinateFactory(procrastinate_db, procrastinate_schema)

    def test_pruned_worker_row_is_a_gone_owner(self, procrastinate: ProcrastinateFactory
                                               ) -> None:
        """worker_id NULL (its row deleted by a pruning worker): decided at once."""
        job = procrastinate.died_unregistered("idem.report")
        assert run(procrastinate)[job].reason is Reason.RESUMED_IDEMPOTENT_STEP
        assert procrastinate.status(job) == "queued"

    def test_lock_held_by_a_doing_job_is_released_by_the_resume(
            self, procrastinate: ProcrastinateFactory) -> None:
        """A dead job holding a lock frees it for the next job of the lock (its own unique
        index: one doing job per lock)."""
        job = procrastinate.defer("idem.report")
        procrastinate._sql("UPDATE procrastinate_jobs SET lock = 'customer-7' WHERE id = :id",
                           {"id": job})
        procrastinate.claim(job, heartbeat_age=3600)
        assert run(procrastinate)[job].applied
        [(status, lock)] = procrastinate._sql(
            "SELECT status::text, lock FROM procrastinate_jobs WHERE id = :id", {"id": job})
        assert (status, lock) == ("todo", "customer-7")

    def test_heartbeat_just_inside_the_timeout_is_alive(
            self, procrastinate: ProcrastinateFactory) -> None:
        """A heartbeat younger than session_timeout_seconds keeps the job."""
        job = procrastinate.defer("idem.report")
        procrastinate.claim(job, heartbeat_age=procrastinate.config.session_timeout_seconds / 2)
        assert run(procrastinate) == {}

    def test_abort_requested_job_is_failed_by_its_retry_function(
            self, procrastinate: ProcrastinateFactory) -> None:
        """Resuming a job whose abort was requested goes through Procrastinate's retry
        function, which fails it instead: the abort wins, as in Procrastinate."""
        job = procrastinate.died("idem.report")
        procrastinate._sql("UPDATE procrastinate_jobs SET abort_requested = true "
                           "WHERE id = :id", {"id": job})
        outcome = run(procrastinate)[job]
        assert outcome.disposition is Disposition.RESUME
        assert outcome.generation_after == 0  # its attempts, untouched by the abort path
        assert procrastinate.status(job) == "failed"
        assert procrastinate.events(job)[-2:] == ["abort_requested", "failed"]
