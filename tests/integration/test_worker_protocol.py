"""The worker protocol as a worker and a producer see it (docs/lease-contract.md).

Every test runs on SQLite and on PostgreSQL through the shared fixtures. Nothing here mocks
the database: leases expire on the database's clock, races are real threads and real
processes, and "changes nothing" is checked against a full snapshot of the job's rows.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from models import JobAttempt, JobRun, StepRun
from reconciler.config.settings import Settings
from reconciler.core.decisions import Thresholds
from reconciler.core.passes import PassConfig, PassReport, run_pass
from reconciler.core.vocabulary import Disposition, Reason, StepState
from reconciler.storage.claims import StepNotStartedError
from reconciler.storage.clock import db_now, now_plus
from reconciler.storage.sql_store import SqlStore
from reconciler.views import job_view
from reconciler.worker import Claim, JobClient, LeaseLost, Step
from tests.conftest import run_cli, run_forked, run_python
from tests.helpers import job_row, wait_for

JOBS = cast(sa.Table, JobRun.__table__)
STEP_RUNS = cast(sa.Table, StepRun.__table__)
ATTEMPTS = cast(sa.Table, JobAttempt.__table__)

PLAN = (Step("fetch", "idempotent"), Step("render", "pure"), Step("publish", "effectful"))
# A reconciler that judges every expired lease at once and never sees a wedged worker.
RECONCILE_NOW = Thresholds(stale_after_seconds=0, wedged_after_seconds=3600)
DEADLINE_SECONDS = 10.0


# -- helpers: read the database directly, poll it, run a real pass ---------------------------


def attempt_rows(engine: Engine, job_id: int) -> list[dict[str, Any]]:
    """The job's ``job_attempts`` rows in claim order."""
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(
            sa.select(ATTEMPTS).where(ATTEMPTS.c.job_id == job_id)
            .order_by(ATTEMPTS.c.claim_generation))]


def snapshot(engine: Engine, job_id: int) -> dict[str, Any]:
    """Everything the worker protocol may write about one job."""
    with engine.connect() as conn:
        step_rows = [dict(r._mapping) for r in conn.execute(
            sa.select(STEP_RUNS).where(STEP_RUNS.c.job_id == job_id)
            .order_by(STEP_RUNS.c.step_index))]
    return {"job": job_row(engine, job_id), "steps": step_rows,
            "attempts": attempt_rows(engine, job_id)}


def database_now(engine: Engine) -> datetime:
    """The database's clock, as the lease arithmetic reads it."""
    with engine.connect() as conn:
        return cast(datetime, conn.execute(sa.select(db_now())).scalar_one())


def set_job(engine: Engine, job_id: int, **values: Any) -> None:
    """Test setup by plain SQL UPDATE (operator hold, availability, resume point)."""
    with engine.begin() as conn:
        conn.execute(JOBS.update().where(JOBS.c.job_id == job_id).values(**values))


def count_jobs(engine: Engine) -> int:
    """How many job rows exist at all."""
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(JOBS)).scalar_one())


def wait_until_leases_expired(engine: Engine) -> None:
    """Wait until no processing job holds a live lease by the database's clock."""
    def all_expired() -> bool:
        with engine.connect() as conn:
            live = conn.execute(
                sa.select(sa.func.count()).select_from(JOBS).where(
                    JOBS.c.job_status == "processing", JOBS.c.lease_expires_at > db_now())
            ).scalar_one()
        return live == 0

    wait_for(all_expired, "every processing lease to expire")


def wait_for_db_clock_past(engine: Engine, instant: datetime) -> None:
    """Wait until the database's clock reads later than ``instant``."""
    wait_for(lambda: database_now(engine) > instant, "the database clock to move on")


def reconcile(engine: Engine) -> PassReport:
    """One real reconciliation pass that treats every expired lease as dead at once."""
    config = PassConfig(batch_size=100, thresholds=RECONCILE_NOW,
                        instance="worker-protocol-tests")
    return run_pass(SqlStore(engine), config)


def expire_and_reconcile(engine: Engine) -> PassReport:
    """Let every claimed lease run out, then run a pass over the dead claims."""
    wait_until_leases_expired(engine)
    return reconcile(engine)


def claim_when_available(client: JobClient, worker: str, lease_seconds: float = 30) -> Claim:
    """Claim as soon as a job becomes available (after a backoff, for instance)."""
    return cast(Claim, wait_for(lambda: client.claim(worker, lease_seconds=lease_seconds),
                                "a job to become claimable"))


def seconds(delta: timedelta) -> float:
    """A timedelta in seconds."""
    return delta.total_seconds()


# -- enqueue ---------------------------------------------------------------------------------



def assert_failed_for_good(client: JobClient, engine: Engine, job_id: int, reason: str,
                           code: str) -> None:
    """The job ended failed by its worker, its claim gone as a requeue would leave it (no
    lease, no owner, no session), and nobody can claim it again."""
    row = job_row(engine, job_id)
    assert (row["job_status"], row["status_reason"], row["last_error_code"]) == (
        "failed", reason, code)
    assert row["finished_at"] is not None
    assert (row["lease_token"], row["lease_expires_at"], row["lease_owner"],
            row["worker_session_id"]) == (None, None, None, None)
    [attempt] = attempt_rows(engine, job_id)
    assert (attempt["attempt_outcome"], attempt["ended_by"]) == ("failed", "worker")
    assert client.claim("w2", lease_seconds=5) is None

class TestEnqueue:
    def test_enqueue_returns_a_new_integer_id_per_job(self, client: JobClient) -> None:
        """Each enqueue without a key creates its own job and returns its integer id."""
        first = client.enqueue("report", steps=PLAN, payload={"n": 1})
        second = client.enqueue("report", steps=PLAN, payload={"n": 2})
        assert isinstance(first, int)
        assert isinstance(second, int)
        assert first != second
        assert [j.job_id for j in client.store.list_jobs(None, 100)] == [second, first]

    def test_same_idempotency_key_returns_the_existing_job_without_a_second_row(
        self, client: JobClient, db_url: str
    ) -> None:
        """Enqueueing twice with one idempotency key gives one job id and one job row."""
        first = client.enqueue("report", steps=PLAN, idempotency_key="req-42", max_attempts=3)
        again = client.enqueue("report", steps=PLAN, idempotency_key="req-42", max_attempts=5,
                               payload={"different": True})
        other = client.enqueue("report", steps=PLAN, idempotency_key="req-43")
        assert again == first
        assert other != first
        assert sorted(j.job_id for j in client.store.list_jobs(None, 100)) == sorted(
            [first, other])
        assert client.store.get_job(first).max_attempts == 3  # type: ignore[union-attr]
        assert client.store.get_job(other).max_attempts == (  # type: ignore[union-attr]
            client.settings.default_max_attempts)
        listed = run_cli(db_url, "jobs", "list", "--json")
        assert listed.returncode == 0, listed.stderr
        assert sorted(j["job_id"] for j in json.loads(listed.stdout)) == sorted([first, other])

    def test_invalid_jobs_are_refused_with_value_error_and_nothing_is_written(
        self, client: JobClient, engine: Engine
    ) -> None:
        """A job with no steps, an unknown effect kind or no attempts raises ValueError."""
        invalid: dict[str, dict[str, Any]] = {
            "empty steps": {"steps": []},
            "bad effect kind": {"steps": [("fetch", "explosive")]},
            "empty step name": {"steps": [("", "pure")]},
            "empty job kind": {"steps": PLAN, "job_kind": ""},
            "zero max_attempts": {"steps": PLAN, "max_attempts": 0},
            "negative max_attempts": {"steps": PLAN, "max_attempts": -1},
        }
        accepted = []
        for case, arguments in invalid.items():
            job_kind = arguments.pop("job_kind", "report")
            try:
                client.enqueue(job_kind, **arguments)
            except ValueError:
                continue
            accepted.append(case)
        assert accepted == []
        assert count_jobs(engine) == 0

    def test_concurrent_enqueues_with_one_idempotency_key_create_one_job(
        self, client: JobClient, engine: Engine, db_url: str, settings: Settings
    ) -> None:
        """Producers racing with the same idempotency key all get the one job id."""
        producers = [JobClient(db_url, settings=settings) for _ in range(RACE_THREADS)]
        start = threading.Barrier(RACE_THREADS)

        def produce(producer: JobClient) -> int:
            start.wait(timeout=DEADLINE_SECONDS)
            return producer.enqueue("report", steps=PLAN, idempotency_key="race-key")

        try:
            with ThreadPoolExecutor(RACE_THREADS) as pool:
                ids = set(pool.map(produce, producers))
        finally:
            for producer in producers:
                producer.close()
        assert len(ids) == 1
        assert count_jobs(engine) == 1

    def test_a_step_with_an_unknown_effect_kind_cannot_be_built(self) -> None:
        """``Step`` itself refuses an effect kind outside pure, idempotent, effectful."""
        with pytest.raises(ValueError, match="effect_kind"):
            Step("fetch", "explosive")

    def test_enqueue_in_a_caller_transaction_that_rolls_back_leaves_no_job(
        self, client: JobClient, engine: Engine
    ) -> None:
        """A job enqueued on the caller's connection disappears when the caller rolls back."""
        with engine.connect() as conn:
            tx = conn.begin()
            job_id = client.enqueue("report", steps=PLAN, idempotency_key="tx-1",
                                    connection=conn)
            assert isinstance(job_id, int)
            tx.rollback()
        assert client.store.get_job(job_id) is None
        assert count_jobs(engine) == 0
        assert client.claim("w1", lease_seconds=5) is None
        # The key is free again: the rolled-back job never existed.
        assert client.enqueue("report", steps=PLAN, idempotency_key="tx-1") is not None
        assert count_jobs(engine) == 1

    def test_enqueue_in_a_caller_transaction_that_commits_keeps_the_job(
        self, client: JobClient, engine: Engine
    ) -> None:
        """A job enqueued on the caller's connection exists once, and only once, it commits."""
        with engine.begin() as conn:
            job_id = client.enqueue("report", steps=PLAN, connection=conn)
            # Not visible to anyone else before the caller commits.
            assert client.store.get_job(job_id) is None
        assert client.store.get_job(job_id) is not None
        claim = client.claim("w1", lease_seconds=5)
        assert claim is not None
        assert claim.job_id == job_id


# -- claim -----------------------------------------------------------------------------------


class TestClaim:
    def test_claim_on_an_empty_queue_returns_none(self, client: JobClient) -> None:
        """With nothing queued, claim returns None instead of blocking or raising."""
        assert client.claim("w1", lease_seconds=5) is None

    def test_claim_refuses_a_nameless_worker_or_a_non_positive_lease(
        self, client: JobClient, engine: Engine
    ) -> None:
        """A claim needs a worker name and a positive lease; a refused claim takes nothing."""
        job_id = client.enqueue("report", steps=PLAN)
        before = snapshot(engine, job_id)
        for worker, lease in (("", 5.0), ("w1", 0.0), ("w1", -1.0)):
            with pytest.raises(ValueError, match=r"worker|lease"):
                client.claim(worker, lease_seconds=lease)
        assert snapshot(engine, job_id) == before

    def test_claim_starts_an_attempt_and_exposes_the_plan_and_payload(
        self, client: JobClient, engine: Engine
    ) -> None:
        """A claim bumps the generation, counts the attempt and hands over steps and payload."""
        job_id = client.enqueue("report", steps=PLAN, max_attempts=3,
                                payload={"any": ["json", 1, None]})
        before = job_row(engine, job_id)
        claim = client.claim("host-a:1", lease_seconds=5)
        assert claim is not None
        row = job_row(engine, job_id)
        assert claim.job_id == job_id
        assert claim.job_kind == "report"
        assert claim.generation == before["claim_generation"] + 1 == row["claim_generation"]
        assert claim.attempt == 1 == row["attempt_count"]
        assert claim.max_attempts == 3
        assert claim.next_step_index == 0
        assert claim.steps == PLAN
        assert claim.payload == {"any": ["json", 1, None]}
        assert row["job_status"] == "processing"
        assert row["lease_token"]
        assert row["lease_expires_at"] > row["claimed_at"]
        assert row["last_activity_at"] is not None
        [attempt] = attempt_rows(engine, job_id)
        assert attempt["attempt_number"] == 1
        assert attempt["claim_generation"] == claim.generation
        assert attempt["ended_at"] is None
        assert attempt["attempt_outcome"] is None
        # A second claim of the same queue finds nothing: the job is held.
        assert client.claim("host-b:2", lease_seconds=5) is None

    def test_each_new_claim_gets_a_new_generation_and_token(
        self, client: JobClient, engine: Engine
    ) -> None:
        """Reclaiming a released job bumps the generation again and issues a fresh token."""
        job_id = client.enqueue("report", steps=PLAN)
        first = client.claim("w1", lease_seconds=5)
        assert first is not None
        first_token = job_row(engine, job_id)["lease_token"]
        first.release()
        second = client.claim("w2", lease_seconds=5)
        assert second is not None
        assert second.generation > first.generation
        assert job_row(engine, job_id)["lease_token"] not in (None, first_token)

    def test_claim_starts_at_the_jobs_resume_step_index(
        self, client: JobClient, engine: Engine
    ) -> None:
        """A claim's next_step_index is the job's resume_step_index."""
        job_id = client.enqueue("report", steps=PLAN)
        set_job(engine, job_id, resume_step_index=2)
        claim = client.claim("w1", lease_seconds=5)
        assert claim is not None
        assert claim.next_step_index == 2

    def test_held_and_not_yet_available_jobs_are_not_claimed(
        self, client: JobClient, engine: Engine
    ) -> None:
        """A job under operator hold or with available_at in the future stays queued."""
        held = client.enqueue("report", steps=PLAN)
        later = client.enqueue("report", steps=PLAN)
        ready = client.enqueue("report", steps=PLAN)
        set_job(engine, held, operator_hold=True)
        set_job(engine, later, available_at=now_plus(3600))
        claim = client.claim("w1", lease_seconds=5)
        assert claim is not None
        assert claim.job_id == ready
        assert client.claim("w1", lease_seconds=5) is None
        assert job_row(engine, held)["job_status"] == "queued"
        assert job_row(engine, later)["job_status"] == "queued"
        set_job(engine, held, operator_hold=False)
        released = client.claim("w1", lease_seconds=5)
        assert released is not None
        assert released.job_id == held

    def test_jobs_are_claimed_oldest_first(self, client: JobClient) -> None:
        """Claims hand out jobs in the order they became available."""
        ids = [client.enqueue("report", steps=PLAN) for _ in range(4)]
        claimed = []
        while (claim := client.claim("w1", lease_seconds=5)) is not None:
            claimed.append(claim.job_id)
        assert claimed == ids

    def test_claim_can_be_limited_to_some_job_kinds(self, client: JobClient) -> None:
        """``kinds`` restricts a claim to jobs of those kinds."""
        client.enqueue("email", steps=PLAN)
        report = client.enqueue("report", steps=PLAN)
        claim = client.claim("w1", lease_seconds=5, kinds=["report"])
        assert claim is not None
        assert claim.job_id == report
        assert client.claim("w1", lease_seconds=5, kinds=["report"]) is None

    def test_an_empty_kind_list_claims_nothing_while_none_claims_any_kind(
        self, client: JobClient, engine: Engine
    ) -> None:
        """``kinds=[]`` names no kind: the client and the store claim nothing with it."""
        job_id = client.enqueue("email", steps=PLAN)
        assert client.claim("w1", lease_seconds=5, kinds=[]) is None
        assert client.store.claim("w1", 5.0, [], None) is None
        row = job_row(engine, job_id)
        assert (row["job_status"], row["attempt_count"], row["claim_generation"]) == (
            "queued", 0, 0)
        claim = client.claim("w1", lease_seconds=5, kinds=None)
        assert claim is not None
        assert claim.job_id == job_id


# -- atomic claim under a race ---------------------------------------------------------------

RACE_JOBS = 40
RACE_THREADS = 8
RACE_PROCESSES = 4

CLAIM_LOOP = """
import json, sys, time
from pathlib import Path
from reconciler.config.settings import Settings
from reconciler.worker import JobClient

url, name, gate = sys.argv[1], sys.argv[2], Path(sys.argv[3])
with JobClient(url, settings=Settings(database_url=url)) as client:
    (gate / f"ready-{name}").touch()
    deadline = time.monotonic() + 30
    while not (gate / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    ids = []
    while (claim := client.claim(name, lease_seconds=60)) is not None:
        ids.append(claim.job_id)
print(json.dumps(ids))
"""


def assert_claimed_exactly_once(engine: Engine, expected: set[int],
                                claimed: list[int]) -> None:
    """Every job was claimed once: no duplicates, none lost, one attempt each."""
    assert len(claimed) == len(set(claimed)), "a job was claimed twice"
    assert set(claimed) == expected, "a job was never claimed"
    with engine.connect() as conn:
        rows = conn.execute(sa.select(JOBS.c.job_status, JOBS.c.claim_generation,
                                      JOBS.c.attempt_count)).all()
        attempts = conn.execute(sa.select(sa.func.count()).select_from(ATTEMPTS)).scalar_one()
    assert {tuple(r) for r in rows} == {("processing", 1, 1)}
    assert attempts == len(expected)


class TestAtomicClaim:
    def test_concurrent_threads_with_their_own_clients_claim_each_job_exactly_once(
        self, client: JobClient, engine: Engine, db_url: str, settings: Settings
    ) -> None:
        """Eight threads, each with its own JobClient and engine, never share or lose a job."""
        expected = {client.enqueue("race", steps=PLAN) for _ in range(RACE_JOBS)}
        own_clients = [JobClient(db_url, settings=settings) for _ in range(RACE_THREADS)]
        start = threading.Barrier(RACE_THREADS)

        def claim_all(index: int) -> list[int]:
            worker = own_clients[index]
            start.wait(timeout=DEADLINE_SECONDS)
            ids = []
            while (claim := worker.claim(f"thread-{index}", lease_seconds=60)) is not None:
                ids.append(claim.job_id)
            return ids

        try:
            with ThreadPoolExecutor(RACE_THREADS) as pool:
                results = list(pool.map(claim_all, range(RACE_THREADS)))
        finally:
            for own in own_clients:
                own.close()
        assert_claimed_exactly_once(engine, expected, [j for ids in results for j in ids])

    def test_concurrent_processes_claim_each_job_exactly_once(
        self, client: JobClient, engine: Engine, db_url: str, tmp_path: Path
    ) -> None:
        """Separate worker processes claiming in a loop never share or lose a job."""
        expected = {client.enqueue("race", steps=PLAN) for _ in range(RACE_JOBS)}
        gate = tmp_path / "gate"
        gate.mkdir()

        def worker_process(index: int) -> list[int]:
            done = run_forked(CLAIM_LOOP, db_url, f"process-{index}", str(gate), timeout=60)
            assert done.returncode == 0, done.stderr
            return cast(list[int], json.loads(done.stdout))

        with ThreadPoolExecutor(RACE_PROCESSES) as pool:
            running = pool.map(worker_process, range(RACE_PROCESSES))
            # Every process is connected and waiting: let them all claim at once.
            wait_for(lambda: len(list(gate.glob("ready-*"))) == RACE_PROCESSES,
                     "every worker process to be ready", timeout=30)
            (gate / "go").touch()
            results = list(running)
        assert_claimed_exactly_once(engine, expected, [j for ids in results for j in ids])


# -- lease and activity ----------------------------------------------------------------------


class TestLeaseAndActivity:
    def test_heartbeat_renews_the_lease_but_is_not_activity(
        self, client: JobClient, engine: Engine
    ) -> None:
        """A heartbeat moves lease_expires_at forward on the database clock, not activity."""
        job_id = client.enqueue("report", steps=PLAN)
        claim = client.claim("w1", lease_seconds=0.5)
        assert claim is not None
        before = job_row(engine, job_id)
        wait_for_db_clock_past(engine, before["claimed_at"] + timedelta(seconds=0.05))
        beat_window = database_now(engine)
        claim.heartbeat()
        beat_window_end = database_now(engine)
        after = job_row(engine, job_id)
        assert after["lease_expires_at"] > before["lease_expires_at"]
        # The new expiry is the database's now at the beat plus the claim's lease.
        lease = timedelta(seconds=0.5)
        rounding = timedelta(milliseconds=2)
        assert beat_window + lease - rounding <= after["lease_expires_at"]
        assert after["lease_expires_at"] <= beat_window_end + lease + rounding
        assert after["last_activity_at"] == before["last_activity_at"]
        assert after["claim_generation"] == before["claim_generation"]
        assert after["lease_token"] == before["lease_token"]
        assert after["job_status"] == "processing"

    def test_heartbeat_keeps_an_otherwise_expiring_lease_alive(
        self, client: JobClient, engine: Engine
    ) -> None:
        """Heartbeats past the original lease keep the job out of the reconciler's hands."""
        job_id = client.enqueue("report", steps=PLAN)
        claim = client.claim("w1", lease_seconds=0.6)
        assert claim is not None
        first_expiry = job_row(engine, job_id)["lease_expires_at"]
        while database_now(engine) < first_expiry + timedelta(seconds=0.1):
            claim.heartbeat()
            time.sleep(0.05)
        claim.heartbeat()
        report = reconcile(engine)
        assert report.decisions == ()
        assert job_row(engine, job_id)["job_status"] == "processing"
        claim.complete()

    def test_heartbeat_renews_only_its_own_lease(
        self, client: JobClient, engine: Engine
    ) -> None:
        """One claim's heartbeat leaves another job's lease where it was."""
        mine = client.enqueue("report", steps=PLAN)
        theirs = client.enqueue("report", steps=PLAN)
        my_claim = client.claim("w1", lease_seconds=5)
        their_claim = client.claim("w2", lease_seconds=5)
        assert my_claim is not None
        assert their_claim is not None
        assert (my_claim.job_id, their_claim.job_id) == (mine, theirs)
        theirs_before = snapshot(engine, theirs)
        wait_for_db_clock_past(engine, job_row(engine, mine)["claimed_at"])
        my_claim.heartbeat()
        assert snapshot(engine, theirs) == theirs_before

    def test_report_progress_moves_last_activity(
        self, client: JobClient, engine: Engine
    ) -> None:
        """report_progress moves last_activity_at to the database's now, lease untouched."""
        job_id = client.enqueue("report", steps=PLAN)
        claim = client.claim("w1", lease_seconds=5)
        assert claim is not None
        before = job_row(engine, job_id)
        wait_for_db_clock_past(engine, before["last_activity_at"])
        claim.report_progress()
        after = job_row(engine, job_id)
        assert after["last_activity_at"] > before["last_activity_at"]
        assert after["last_activity_at"] <= database_now(engine)
        assert after["lease_expires_at"] == before["lease_expires_at"]
        assert after["claim_generation"] == before["claim_generation"]

    def test_step_records_move_last_activity(
        self, client: JobClient, engine: Engine
    ) -> None:
        """Recording a step's start, success, failure or wait is activity."""
        job_id = client.enqueue("report", steps=PLAN)
        claim = client.claim("w1", lease_seconds=5)
        assert claim is not None
        records: list[tuple[str, Callable[[], None]]] = [
            ("start_step", lambda: claim.start_step(0)),
            ("finish_step", lambda: claim.finish_step(0)),
            ("start_step", lambda: claim.start_step(1)),
            ("fail_step", lambda: claim.fail_step(1, "upstream_down", retryable=True)),
            ("wait_step", lambda: claim.wait_step(2)),
        ]
        still = []
        for name, record in records:
            before = job_row(engine, job_id)
            wait_for_db_clock_past(engine, before["last_activity_at"])
            record()
            after = job_row(engine, job_id)
            if after["last_activity_at"] <= before["last_activity_at"]:
                still.append(name)
            assert after["lease_expires_at"] == before["lease_expires_at"], name
        assert still == []


# -- fencing ---------------------------------------------------------------------------------

STALE_WRITES: dict[str, Callable[[Claim], Any]] = {
    "heartbeat": lambda c: c.heartbeat(),
    "report_progress": lambda c: c.report_progress(),
    "start_step": lambda c: c.start_step(2),
    "finish_step": lambda c: c.finish_step(1),
    "fail_step": lambda c: c.fail_step(1, "upstream_down", retryable=True),
    "complete": lambda c: c.complete(),
    "fail": lambda c: c.fail("upstream_down", retryable=True),
    "release": lambda c: c.release(),
}


@pytest.fixture
def stale_claims(client: JobClient, engine: Engine) -> dict[str, Claim]:
    """One claim per kind of write, each mid-step, whose job a real pass then requeued."""
    for _ in STALE_WRITES:
        client.enqueue("report", steps=PLAN, max_attempts=5)
    claims: dict[str, Claim] = {}
    for write in STALE_WRITES:
        claim = client.claim("stale-worker", lease_seconds=0.3)
        assert claim is not None
        claim.start_step(0)
        claim.finish_step(0)
        claim.start_step(1)  # "render" is pure: the pass may resume at it
        claims[write] = claim
    report = expire_and_reconcile(engine)
    assert {(d.disposition, d.reason) for d in report.decisions} == {
        (Disposition.RESUME, Reason.RESUMED_IDEMPOTENT_STEP)}
    assert len(report.decisions) == len(STALE_WRITES)
    for claim in claims.values():
        assert job_row(engine, claim.job_id)["job_status"] == "queued"
        assert not claim.lease_lost.is_set()
    return claims


class TestFencing:
    def test_stale_claim_of_a_requeued_job_cannot_write(
        self, stale_claims: dict[str, Claim], engine: Engine
    ) -> None:
        """After a pass requeued the job, every write of the old claim raises LeaseLost."""
        broken: list[str] = []
        for write, stale in stale_claims.items():
            before = snapshot(engine, stale.job_id)
            try:
                STALE_WRITES[write](stale)
            except LeaseLost as lost:
                if lost.job_id != stale.job_id:
                    broken.append(f"{write}: LeaseLost names job {lost.job_id}")
            else:
                broken.append(f"{write}: no LeaseLost")
            if snapshot(engine, stale.job_id) != before:
                broken.append(f"{write}: changed the job's rows")
            if not stale.lease_lost.is_set():
                broken.append(f"{write}: lease_lost event not set")
        assert broken == []

    def test_stale_claim_of_a_reclaimed_job_cannot_write_and_the_new_owner_can(
        self, stale_claims: dict[str, Claim], client: JobClient, engine: Engine
    ) -> None:
        """Once a second worker holds the job, no write of the old claim touches its run."""
        new_owners: dict[int, Claim] = {}
        for _ in stale_claims:
            owner = client.claim("new-worker", lease_seconds=30)
            assert owner is not None
            assert owner.next_step_index == 1
            new_owners[owner.job_id] = owner
        for write, stale in stale_claims.items():
            owner = new_owners[stale.job_id]
            assert owner.generation > stale.generation
            before = snapshot(engine, stale.job_id)
            with pytest.raises(LeaseLost):
                STALE_WRITES[write](stale)
            assert snapshot(engine, stale.job_id) == before, write
            assert stale.lease_lost.is_set(), write
            assert job_row(engine, stale.job_id)["job_status"] == "processing", write
            # The new owner's lease is untouched and fully usable.
            owner.heartbeat()
            owner.start_step(1)
            owner.finish_step(1)
            owner.start_step(2)
            owner.finish_step(2)
            owner.complete()
            done = snapshot(engine, stale.job_id)
            assert done["job"]["job_status"] == "completed"
            assert [s["step_state"] for s in done["steps"]] == ["succeeded"] * 3
            assert [(a["attempt_outcome"], a["ended_by"]) for a in done["attempts"]] == [
                ("lost", "reconciler"), ("completed", "worker")]
            assert not owner.lease_lost.is_set()

    def test_stale_complete_does_not_finish_the_new_owners_run(
        self, client: JobClient, engine: Engine
    ) -> None:
        """A reclaimed job's old worker cannot complete it; the new worker still can."""
        job_id = client.enqueue("report", steps=PLAN)
        stale = client.claim("old", lease_seconds=0.3)
        assert stale is not None
        expire_and_reconcile(engine)
        owner = client.claim("new", lease_seconds=30)
        assert owner is not None
        assert owner.job_id == job_id
        before = snapshot(engine, job_id)
        with pytest.raises(LeaseLost):
            stale.complete()
        assert stale.lease_lost.is_set()
        assert snapshot(engine, job_id) == before
        assert before["job"]["job_status"] == "processing"
        assert before["job"]["finished_at"] is None
        owner.complete()
        assert job_row(engine, job_id)["job_status"] == "completed"


# -- step records ----------------------------------------------------------------------------


class TestStepRecords:
    def test_finishing_a_step_that_was_never_started_is_refused(
        self, client: JobClient, engine: Engine
    ) -> None:
        """finish_step of an unstarted step raises StepNotStartedError and changes nothing."""
        job_id = client.enqueue("report", steps=PLAN)
        claim = client.claim("w1", lease_seconds=5)
        assert claim is not None
        before = snapshot(engine, job_id)
        wait_for_db_clock_past(engine, before["job"]["last_activity_at"])
        with pytest.raises(StepNotStartedError):
            claim.finish_step(0)
        assert issubclass(StepNotStartedError, ValueError)
        assert snapshot(engine, job_id) == before
        assert not claim.lease_lost.is_set()
        # The claim is still good: the refused write left nothing half-done.
        claim.start_step(0)
        claim.finish_step(0)
        assert snapshot(engine, job_id)["steps"][0]["step_state"] == "succeeded"

    def test_finishing_a_step_started_by_an_earlier_attempt_is_refused(
        self, client: JobClient, engine: Engine
    ) -> None:
        """A claim cannot finish a step that another attempt of the job started."""
        job_id = client.enqueue("report", steps=PLAN)
        first = client.claim("w1", lease_seconds=5)
        assert first is not None
        first.start_step(0)
        first.release()
        second = client.claim("w2", lease_seconds=5)
        assert second is not None
        assert second.next_step_index == 0
        before = snapshot(engine, job_id)
        with pytest.raises(StepNotStartedError):
            second.finish_step(0)
        assert snapshot(engine, job_id) == before

    def test_a_step_index_outside_the_plan_raises_index_error(
        self, client: JobClient, engine: Engine
    ) -> None:
        """Every step write with an index outside the plan raises IndexError, writing nothing."""
        job_id = client.enqueue("report", steps=PLAN)
        claim = client.claim("w1", lease_seconds=5)
        assert claim is not None
        before = snapshot(engine, job_id)
        for index in (len(PLAN), -1, 99):
            for write in (claim.start_step, claim.finish_step, claim.wait_step,
                          lambda i: claim.fail_step(i, "boom")):
                with pytest.raises(IndexError):
                    write(index)
        assert snapshot(engine, job_id) == before
        assert not claim.lease_lost.is_set()

    def test_step_records_keep_state_name_kind_and_generation(
        self, client: JobClient, engine: Engine
    ) -> None:
        """Step rows carry the plan's name and kind, their state and the writing generation."""
        job_id = client.enqueue("report", steps=PLAN)
        claim = client.claim("w1", lease_seconds=5)
        assert claim is not None
        claim.start_step(0)
        claim.finish_step(0)
        claim.start_step(1)
        claim.fail_step(1, "render_timeout", retryable=True)
        rows = snapshot(engine, job_id)["steps"]
        assert [(r["step_index"], r["step_name"], r["effect_kind"], r["step_state"])
                for r in rows] == [(0, "fetch", "idempotent", "succeeded"),
                                   (1, "render", "pure", "failed")]
        assert {r["claim_generation"] for r in rows} == {claim.generation}
        assert rows[1]["error_code"] == "render_timeout"
        assert rows[1]["failure_retryable"] is True
        assert rows[0]["finished_at"] >= rows[0]["started_at"]
        assert rows[1]["finished_at"] >= rows[1]["started_at"]


# -- complete --------------------------------------------------------------------------------


class TestComplete:
    def test_complete_finishes_the_job_and_closes_the_attempt(
        self, client: JobClient, engine: Engine
    ) -> None:
        """complete sets completed with finished_at and ends the attempt as the worker's."""
        job_id = client.enqueue("report", steps=PLAN)
        claim = client.claim("w1", lease_seconds=5)
        assert claim is not None
        for index in range(len(PLAN)):
            claim.start_step(index)
            claim.finish_step(index)
        claim.complete()
        row = job_row(engine, job_id)
        assert row["job_status"] == "completed"
        assert row["status_reason"] is None
        assert row["finished_at"] is not None
        assert row["finished_at"] >= row["claimed_at"]
        assert row["lease_token"] is None
        assert row["lease_expires_at"] is None
        [attempt] = attempt_rows(engine, job_id)
        assert attempt["attempt_outcome"] == "completed"
        assert attempt["ended_by"] == "worker"
        assert attempt["ended_at"] is not None
        assert client.claim("w2", lease_seconds=5) is None

    def test_a_second_complete_raises_lease_lost_and_changes_nothing(
        self, client: JobClient, engine: Engine
    ) -> None:
        """Completing twice is refused with LeaseLost the second time."""
        job_id = client.enqueue("report", steps=PLAN)
        claim = client.claim("w1", lease_seconds=5)
        assert claim is not None
        claim.complete()
        before = snapshot(engine, job_id)
        with pytest.raises(LeaseLost):
            claim.complete()
        assert claim.lease_lost.is_set()
        assert snapshot(engine, job_id) == before
        for write in (claim.heartbeat, claim.report_progress, claim.release,
                      lambda: claim.fail("late")):
            with pytest.raises(LeaseLost):
                write()
        assert snapshot(engine, job_id) == before


# -- fail ------------------------------------------------------------------------------------


def assert_backoff(engine: Engine, job_id: int, delay: float) -> None:
    """The job is queued and becomes available ``delay`` seconds later by the database clock.

    ``updated_at`` was written just before the requeue, so ``available_at`` is at least
    ``delay`` after it; any database "now" read later is at most ``delay`` before it.
    """
    row = job_row(engine, job_id)
    assert row["job_status"] == "queued"
    waited = seconds(row["available_at"] - row["updated_at"])
    assert delay - 0.005 <= waited <= delay + 0.25, (delay, waited)
    left = seconds(row["available_at"] - database_now(engine))
    assert left <= delay + 0.005, (delay, left)


class TestFail:
    def test_retryable_failure_requeues_with_backoff_at_the_first_unfinished_step(
        self, client: JobClient, engine: Engine
    ) -> None:
        """fail(retryable=True) with attempts left requeues after retry_backoff_seconds."""
        job_id = client.enqueue("report", steps=PLAN, max_attempts=3)
        claim = client.claim("w1", lease_seconds=5)
        assert claim is not None
        claim.start_step(0)
        claim.finish_step(0)
        claim.start_step(1)
        claim.fail_step(1, "render_timeout", retryable=True)
        assert claim.fail("render_timeout", retryable=True) is True
        assert_backoff(engine, job_id, client.settings.retry_backoff_seconds)
        row = job_row(engine, job_id)
        assert row["resume_step_index"] == 1
        assert row["status_reason"] is None
        assert row["last_error_code"] == "render_timeout"
        assert row["lease_token"] is None
        assert row["finished_at"] is None
        assert row["attempt_count"] == 1
        [attempt] = attempt_rows(engine, job_id)
        assert (attempt["attempt_outcome"], attempt["ended_by"]) == ("retrying", "worker")
        assert attempt["ended_at"] is not None
        # Claimable only once the backoff is over (database clock), at the resume point.
        retry = claim_when_available(client, "w2")
        assert job_row(engine, job_id)["claimed_at"] >= row["available_at"]
        assert retry.job_id == job_id
        assert retry.attempt == 2
        assert retry.next_step_index == 1
        assert retry.generation > claim.generation

    def test_backoff_doubles_on_the_next_failure(
        self, client: JobClient, engine: Engine
    ) -> None:
        """The second retryable failure waits twice the first delay."""
        job_id = client.enqueue("report", steps=PLAN, max_attempts=3)
        base = client.settings.retry_backoff_seconds
        first = client.claim("w1", lease_seconds=5)
        assert first is not None
        assert first.fail("flaky", retryable=True) is True
        assert_backoff(engine, job_id, base)
        second = claim_when_available(client, "w1")
        assert second.fail("flaky", retryable=True) is True
        assert_backoff(engine, job_id, 2 * base)

    def test_backoff_is_capped_by_retry_backoff_max_seconds(
        self, engine: Engine, db_url: str
    ) -> None:
        """Doubling stops at retry_backoff_max_seconds."""
        settings = Settings(database_url=db_url, retry_backoff_seconds=0.1,
                            retry_backoff_max_seconds=0.15)
        with JobClient(engine, settings=settings) as client:
            job_id = client.enqueue("report", steps=PLAN, max_attempts=5)
            # Uncapped, these would be 0.1, 0.2, 0.4 and 0.8 seconds.
            for delay in (0.1, 0.15, 0.15, 0.15):
                claim = claim_when_available(client, "w1")
                assert claim.fail("flaky", retryable=True) is True
                assert_backoff(engine, job_id, delay)

    def test_retryable_failure_without_attempts_left_fails_as_retries_exhausted(
        self, client: JobClient, engine: Engine
    ) -> None:
        """When the budget is spent, fail(retryable=True) ends the job retries_exhausted."""
        job_id = client.enqueue("report", steps=PLAN, max_attempts=1)
        claim = client.claim("w1", lease_seconds=5)
        assert claim is not None
        assert claim.fail("flaky", retryable=True) is False
        assert_failed_for_good(client, engine, job_id, "retries_exhausted", "flaky")

    def test_non_retryable_failure_fails_the_job_at_once(
        self, client: JobClient, engine: Engine
    ) -> None:
        """fail(retryable=False) ends the job job_failed even with attempts left."""
        job_id = client.enqueue("report", steps=PLAN, max_attempts=5)
        claim = client.claim("w1", lease_seconds=5)
        assert claim is not None
        assert claim.fail("bad_input", retryable=False) is False
        assert_failed_for_good(client, engine, job_id, "job_failed", "bad_input")

    def test_error_codes_must_be_short_codes(
        self, client: JobClient, engine: Engine
    ) -> None:
        """A message instead of a short code raises ValueError and changes nothing."""
        job_id = client.enqueue("report", steps=PLAN)
        claim = client.claim("w1", lease_seconds=5)
        assert claim is not None
        claim.start_step(0)
        before = snapshot(engine, job_id)
        for code in ("some message with spaces", "", "9starts_with_digit", "/etc/passwd",
                     "x" * 65):
            with pytest.raises(ValueError, match="short"):
                claim.fail(code, retryable=True)
            with pytest.raises(ValueError, match="short"):
                claim.fail_step(0, code)
            with pytest.raises(ValueError, match="short"):
                claim.fail(code, retryable=False)
        assert snapshot(engine, job_id) == before
        assert not claim.lease_lost.is_set()
        claim.complete()  # the claim was not spent by the refused writes
        assert job_row(engine, job_id)["job_status"] == "completed"


# -- release ---------------------------------------------------------------------------------


class TestRelease:
    def test_release_requeues_now_gives_the_attempt_back_and_keeps_the_resume_point(
        self, client: JobClient, engine: Engine
    ) -> None:
        """release requeues at once at the first unfinished step and returns the attempt."""
        job_id = client.enqueue("report", steps=PLAN, max_attempts=2)
        claim = client.claim("w1", lease_seconds=5)
        assert claim is not None
        claim.start_step(0)
        claim.finish_step(0)
        claim.start_step(1)
        claim.release()
        row = job_row(engine, job_id)
        assert row["job_status"] == "queued"
        assert row["status_reason"] is None
        assert row["attempt_count"] == 0
        assert row["resume_step_index"] == 1
        assert row["lease_token"] is None
        assert row["available_at"] <= database_now(engine)
        [attempt] = attempt_rows(engine, job_id)
        assert (attempt["attempt_outcome"], attempt["ended_by"]) == ("released", "worker")
        assert attempt["ended_at"] is not None
        again = client.claim("w2", lease_seconds=5)
        assert again is not None
        assert again.job_id == job_id
        assert again.attempt == 1
        assert again.next_step_index == 1
        with pytest.raises(LeaseLost):
            claim.heartbeat()

    def test_released_attempts_do_not_spend_the_budget(
        self, client: JobClient, engine: Engine
    ) -> None:
        """A job released more times than its budget can still be claimed and completed."""
        job_id = client.enqueue("report", steps=PLAN, max_attempts=1)
        for _ in range(3):
            claim = client.claim("w1", lease_seconds=5)
            assert claim is not None
            assert claim.attempt == 1
            claim.release()
        final = client.claim("w1", lease_seconds=5)
        assert final is not None
        final.complete()
        assert job_row(engine, job_id)["job_status"] == "completed"
        assert [a["attempt_outcome"] for a in attempt_rows(engine, job_id)] == [
            "released", "released", "released", "completed"]


# -- the shared attempt budget ---------------------------------------------------------------


class TestAttemptBudget:
    def test_retries_and_crash_resumes_share_one_attempt_budget(
        self, client: JobClient, engine: Engine
    ) -> None:
        """A retry plus a crash resume spend two of three attempts; the third crash ends it."""
        job_id = client.enqueue("report", steps=PLAN, max_attempts=3)
        first = client.claim("w1", lease_seconds=30)
        assert first is not None
        assert first.fail("flaky", retryable=True) is True

        second = claim_when_available(client, "w2", lease_seconds=0.3)
        assert second.attempt == 2
        report = expire_and_reconcile(engine)
        assert [(d.job_id, d.disposition, d.reason) for d in report.decisions] == [
            (job_id, Disposition.RESUME, Reason.RESUMED_FROM_UNSTARTED_STEP)]
        assert job_row(engine, job_id)["attempt_count"] == 2

        third = client.claim("w3", lease_seconds=0.3)
        assert third is not None
        assert third.attempt == 3
        report = expire_and_reconcile(engine)
        assert [(d.job_id, d.disposition, d.reason) for d in report.decisions] == [
            (job_id, Disposition.TERMINALIZE, Reason.RESUME_EXHAUSTED)]
        row = job_row(engine, job_id)
        assert row["job_status"] == "failed"
        assert row["status_reason"] == "resume_exhausted"
        assert [(a["attempt_number"], a["attempt_outcome"], a["ended_by"])
                for a in attempt_rows(engine, job_id)] == [
            (1, "retrying", "worker"), (2, "lost", "reconciler"), (3, "lost", "reconciler")]
        assert client.claim("w4", lease_seconds=5) is None
        with pytest.raises(LeaseLost):
            third.complete()


# -- a fresh client or process sees the same lease -------------------------------------------

FRESH_PROCESS = """
import json, sys
import sqlalchemy as sa
from models import JobRun
from reconciler.config.settings import Settings
from reconciler.worker import JobClient, LeaseLost

url, job_id = sys.argv[1], int(sys.argv[2])
jobs = JobRun.__table__
with JobClient(url, settings=Settings(database_url=url)) as client:
    with client.engine.connect() as conn:
        row = conn.execute(sa.select(jobs).where(jobs.c.job_id == job_id)).one()
    refused = []
    for name, write in [
        ("heartbeat", lambda: client.store.heartbeat(job_id, "made-up-token", 30)),
        ("complete", lambda: client.store.complete(job_id, "made-up-token")),
        ("release", lambda: client.store.release(job_id, "made-up-token")),
    ]:
        try:
            write()
        except LeaseLost:
            refused.append(name)
print(json.dumps({
    "lease_expires_at": row.lease_expires_at.isoformat(),
    "claim_generation": row.claim_generation,
    "job_status": row.job_status,
    "refused": refused,
}))
"""


def forged_writes(store: SqlStore, job_id: int) -> dict[str, Callable[[], Any]]:
    """Every worker write, attempted with a token nobody was given."""
    token = "0123456789abcdef0123456789abcdef"  # noqa: S105 - a forged lease token
    return {
        "heartbeat": lambda: store.heartbeat(job_id, token, 30),
        "report_progress": lambda: store.report_progress(job_id, token),
        "start_step": lambda: store.record_step(job_id, token, 1, PLAN[1], StepState.STARTED),
        "complete": lambda: store.complete(job_id, token),
        "fail": lambda: store.fail(job_id, token, "forged", retryable=True,
                                   backoff_seconds=1, backoff_max_seconds=1),
        "release": lambda: store.release(job_id, token),
    }


class TestFreshClient:
    def test_a_fresh_client_sees_the_same_lease_and_cannot_forge_a_token(
        self, client: JobClient, engine: Engine, db_url: str, settings: Settings
    ) -> None:
        """A new JobClient on the same URL reads the lease as written and cannot write to it."""
        job_id = client.enqueue("report", steps=PLAN)
        claim = client.claim("w1", lease_seconds=30)
        assert claim is not None
        claim.start_step(0)
        before = snapshot(engine, job_id)
        with JobClient(db_url, settings=settings) as fresh:
            assert fresh.engine is not engine
            seen = snapshot(fresh.engine, job_id)
            assert seen == before
            assert seen["job"]["claim_generation"] == claim.generation
            assert seen["job"]["job_status"] == "processing"
            for name, write in forged_writes(fresh.store, job_id).items():
                with pytest.raises(LeaseLost):
                    write()
                assert snapshot(fresh.engine, job_id) == before, name
        claim.finish_step(0)
        claim.complete()

    def test_a_fresh_process_sees_the_same_lease_and_cannot_forge_a_token(
        self, client: JobClient, engine: Engine, db_url: str
    ) -> None:
        """Another process, in another time zone, reads the same lease and is fenced."""
        job_id = client.enqueue("report", steps=PLAN)
        claim = client.claim("w1", lease_seconds=30)
        assert claim is not None
        before = snapshot(engine, job_id)
        # The other process lives in UTC+14 (and so does its PostgreSQL session).
        far_east = {"TZ": "Pacific/Kiritimati", "PGTZ": "Pacific/Kiritimati"}
        done = run_python(FRESH_PROCESS, db_url, str(job_id), env=far_east)
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        assert seen["lease_expires_at"] == before["job"]["lease_expires_at"].isoformat()
        assert seen["lease_expires_at"].endswith("+00:00")
        assert seen["claim_generation"] == claim.generation
        assert seen["job_status"] == "processing"
        assert seen["refused"] == ["heartbeat", "complete", "release"]
        assert snapshot(engine, job_id) == before


# -- timestamps ------------------------------------------------------------------------------


class TestTimestamps:
    def test_timestamps_are_aware_utc_with_sub_second_precision(
        self, client: JobClient, engine: Engine
    ) -> None:
        """The store and view give timezone-aware UTC timestamps that keep fractions of seconds."""
        job_id = client.enqueue("report", steps=PLAN)
        created = client.store.get_job(job_id)
        assert created is not None
        wait_for_db_clock_past(engine, created.created_at + timedelta(seconds=0.05))
        claim = client.claim("w1", lease_seconds=5)
        assert claim is not None
        claim.start_step(0)
        claim.finish_step(0)
        claim.complete()
        detail = client.store.get_job(job_id)
        assert detail is not None
        stamps = [detail.created_at, detail.updated_at, detail.finished_at]
        for stamp in stamps:
            assert stamp is not None
            assert stamp.tzinfo is not None
            assert stamp.utcoffset() == timedelta(0)
        elapsed = seconds(detail.updated_at - detail.created_at)
        assert 0.04 <= elapsed < 5
        assert elapsed != int(elapsed)  # fractions of a second survive the round trip
        row = job_row(engine, job_id)
        fractions = [row[c].microsecond for c in ("created_at", "claimed_at",
                                                  "last_activity_at", "finished_at")]
        assert any(fractions), fractions
        view = job_view(detail)
        for key in ("created_at", "updated_at", "finished_at"):
            parsed = datetime.fromisoformat(view[key])
            assert parsed.utcoffset() == timedelta(0)
            assert parsed == getattr(detail, key)
        wall = datetime.now(UTC)
        assert abs(seconds(wall - database_now(engine))) < 60
