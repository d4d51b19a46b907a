"""The bulk form over this project's own jobs, a chunk at a time, on every engine: 700
jobs a pass ended retried in two chunks, each job fenced and recorded, resuming where its
steps left it; jobs that moved between the count and the act (a second operator, a
worker, a pass deciding one anew) refused, the rest applied; and a bulk of 10,000
interrupted mid-way, by SIGINT and by its database (PostgreSQL, MariaDB) crash-restarted
under it, that leaves every job either retried and recorded or untouched, finished by the
same command run again."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

import reconciler
from reconciler.config.loader import Config, parse_kinds
from reconciler.config.settings import Settings
from reconciler.core.decisions import Thresholds
from reconciler.core.operator_desk import BULK_CHUNK
from reconciler.core.passes import PassConfig, run_pass
from reconciler.core.vocabulary import OperatorAction
from reconciler.root.desk import open_desk
from reconciler.storage.clock import now_plus
from reconciler.storage.engines import create_engine, read_only
from reconciler.storage.schema import upgrade
from reconciler.storage.sql import actions, attempts, jobs, steps
from reconciler.storage.sql_store import SqlStore
from reconciler.worker import JobClient, Step
from tests.cli_runner import settings_env
from tests.conftest import ENGINES, REPO_ROOT, run_cli
from tests.helpers import require_mariadb_bin, require_pg_bin, wait_for
from tests.mariadb_server import ThrowawayMariaDB
from tests.pg_server import ThrowawayPostgres

PACKAGE_DIR = Path(reconciler.__file__).parent

pytestmark = pytest.mark.integration

DIED = "worker_died_mid_step"
PLAN = [Step("fetch", "idempotent"), Step("charge", "effectful")]


def died_in_bulk(client: JobClient, engine: Engine, count: int, *,
                 fetched: bool = False) -> list[int]:
    """``count`` jobs enqueued (one through the client, the rest copies of its row as
    the client wrote it, in one multi-row insert: 10,000 enqueues one by one took 8 s of
    a 9 s set-up), then left as a claim whose worker died inside the effectful
    ``charge`` leaves them (``fetched``: after ``fetch`` succeeded) (processing,
    generation 1, the lease gone five minutes ago, the steps after the claim, the attempt
    open), in a few statements, not a claim each; ended ``worker_died_mid_step`` by one
    real pass."""
    plan = PLAN if fetched else PLAN[1:]
    with engine.begin() as conn:
        first = client.enqueue("billing.charge", steps=plan, connection=conn)
        written = conn.execute(sa.select(jobs).where(jobs.c.job_id == first)).one()._asdict()
        del written["job_id"]
        if count > 1:
            conn.execute(jobs.insert(), [written] * (count - 1))
        ids = list(conn.execute(sa.select(jobs.c.job_id).where(jobs.c.job_id >= first)
                                .order_by(jobs.c.job_id)).scalars())
        assert len(ids) == count
        mine = jobs.c.job_id >= first  # every test here starts on a database of no jobs
        conn.execute(jobs.update().where(mine).values(
            job_status="processing", attempt_count=1, claim_generation=1,
            lease_token=sa.literal("dead-") + sa.cast(jobs.c.job_id, sa.String()),
            lease_owner="w-dead", lease_expires_at=now_plus(-300), claimed_at=now_plus(-600),
            last_activity_at=now_plus(-580)))
        for index, step in enumerate(plan):
            done = fetched and index == 0
            conn.execute(steps.insert().from_select(
                ["job_id", "step_index", "step_name", "effect_kind", "step_state",
                 "claim_generation", "started_at", "finished_at"],
                sa.select(jobs.c.job_id, sa.literal(index), sa.literal(step.step_name),
                          sa.literal(str(step.effect_kind)), sa.literal("succeeded" if done
                                                              else "started"),
                          sa.literal(1), now_plus(-590 + index),
                          now_plus(-589) if done else sa.null()).where(mine)))
        conn.execute(attempts.insert().from_select(
            ["job_id", "claim_generation", "attempt_number", "lease_owner", "claimed_at"],
            sa.select(jobs.c.job_id, sa.literal(1), sa.literal(1), sa.literal("w-dead"),
                      now_plus(-600)).where(mine)))
    report = run_pass(SqlStore(engine), PassConfig(batch_size=count,
                                                   thresholds=Thresholds(0.0, 3600.0),
                                                   instance="bulk-test"))
    assert Counter(d.reason.value for d in report.decisions) == {DIED: count}
    return ids


BULK_RETRY = ("jobs", "retry", "--reason", DIED, "--note", "checked", "--yes", "--as",
              "alice")
"""The bulk form as an operator types it: no ``--limit``, so every match, however many."""

INTERRUPTED_JOBS = 10_000
"""The issue's interrupted bulk: 20 chunks, cut after the 9th or 10th (each test 3 s on
SQLite, 4-8 s on PostgreSQL or MariaDB on the two-core machine, the jobs and their dead
claims built in a few statements)."""


def progress(engine: Engine) -> int:
    """How far the bulk has visibly got: the more of the jobs it left queued and the
    retries on record. A whole chunk shows both at once; a bulk that committed one
    before the other would be frozen between the two, where the test catches it. Read
    as a reader (on SQLite a plain ``BEGIN``, not the writers' ``BEGIN IMMEDIATE``,
    which would queue behind the bulk's chunks for the write lock and see them late)."""
    with engine.connect() as conn:
        reader = read_only(conn)
        queued = reader.execute(sa.select(sa.func.count()).select_from(jobs).where(
            jobs.c.job_status == "queued", jobs.c.status_reason == "operator_retry"))
        on_record = reader.execute(sa.select(sa.func.count()).select_from(actions).where(
            actions.c.action_outcome == "applied"))
        return max(int(queued.scalar_one()), int(on_record.scalar_one()))


@contextmanager
def stopped(process: subprocess.Popen[str]) -> Iterator[None]:
    """``process`` frozen (SIGSTOP) while inside, then let go on (SIGCONT): a signal sent
    meanwhile is handled when it runs again, before it can take another step; a chunk
    in flight stays uncommitted (or, stopped inside its commit, committed)."""
    process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        process.send_signal(signal.SIGCONT)


def interrupted_bulk(url: str, engine: Engine, total: int,
                     interrupt: Callable[[subprocess.Popen[str]], None]) -> tuple[int, str]:
    """``BULK_RETRY`` as a process of its own on ``url``, ``interrupt``ed mid-way: once
    about half of ``total``'s chunks show (``progress``: an event, not a time),
    the bulk is frozen, interrupted and let go on, so the interrupt lands at the point
    it was frozen, with at least one chunk still to do however fast the bulk runs (at
    most the chunk in flight at the event commits). Its exit status and stderr."""
    chunks = -(-total // BULK_CHUNK)
    assert chunks >= 3, "cut mid-way needs a chunk after the one in flight at the event"
    halfway = max(1, (chunks - 1) // 2) * BULK_CHUNK
    bulk = subprocess.Popen([sys.executable, "-m", "reconciler.cli", *BULK_RETRY],
                            env=settings_env(url), cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: progress(engine) >= halfway or bulk.poll() is not None,
                 f"{halfway} jobs retried")
        with stopped(bulk):
            interrupt(bulk)
        _, err = bulk.communicate(timeout=120)
    finally:
        if bulk.poll() is None:
            bulk.kill()
    return bulk.returncode, err


PAUSED_BULK = """
import signal, sys
# SIGINT as at an operator's terminal: a child inherits an ignored SIGINT from a test
# process that ignores it (in the full suite, all three engines' runs exited 0), and then
# Python never raises KeyboardInterrupt.
signal.signal(signal.SIGINT, signal.default_int_handler)
from reconciler.cli.main import main
from reconciler.storage.desks import NativeDesk
act, halfway, done = NativeDesk.act_on_chunk, int(sys.argv[1]), [0]
def paced(self, *args, **kwargs):
    reports = act(self, *args, **kwargs)
    done[0] += 1
    if done[0] == halfway:
        print("reconciler-test: halfway", file=sys.stderr, flush=True)
        sys.stdin.readline()
    return reports
NativeDesk.act_on_chunk = paced
sys.argv[1:] = sys.argv[2:]
sys.exit(main())
"""
"""The real command line, its native desk's chunk wrapped to wait on stdin once its
``halfway``-th chunk has committed: the test's SIGINT lands there, however fast the bulk
runs and however late the test is scheduled (on a loaded machine a bulk of twenty 40 ms
chunks outran a test that watched the database for its halfway point)."""


def bulk_interrupted_halfway(url: str, total: int) -> tuple[int, str]:
    """``BULK_RETRY`` as a process of its own on ``url``, SIGINTed once about half of
    ``total``'s chunks have committed, while it waits before the next: its exit status and
    stderr."""
    chunks = -(-total // BULK_CHUNK)
    assert chunks >= 2, "cut mid-way needs a chunk after the halfway one"
    bulk = subprocess.Popen([sys.executable, "-c", PAUSED_BULK, str(chunks // 2), *BULK_RETRY],
                            env=settings_env(url), cwd=REPO_ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert bulk.stderr is not None
        seen = []
        for line in bulk.stderr:
            seen.append(line)
            if line.startswith("reconciler-test: halfway"):
                break
        else:
            raise AssertionError(f"the bulk ended before its halfway chunk: {''.join(seen)}")
        bulk.send_signal(signal.SIGINT)
        _, err = bulk.communicate(timeout=120)
    finally:
        if bulk.poll() is None:
            bulk.kill()
    return bulk.returncode, "".join(seen) + err


def ours_failed(err: str) -> bool:
    """Whether ``err`` holds a traceback through this project's code. A signal that lands
    once the command has returned, while the interpreter exits, can make Python report an
    interrupted exit hook (coverage's, under the suite); that is not the command's."""
    return f'File "{PACKAGE_DIR}' in err or (
        "Traceback" in err and "atexit" not in err)


def statuses(engine: Engine) -> Counter[str]:
    with engine.connect() as conn:
        return Counter(conn.execute(sa.select(jobs.c.job_status)).scalars())


def recorded(engine: Engine) -> Counter[tuple[str, str]]:
    with engine.connect() as conn:
        return Counter((r.operator_action, r.action_outcome) for r in conn.execute(
            sa.select(actions.c.operator_action, actions.c.action_outcome)))


def test_a_bulk_retry_of_700_jobs_runs_in_chunks_each_job_fenced_and_recorded(
        client: JobClient, engine: Engine, db_url: str) -> None:
    ids = died_in_bulk(client, engine, BULK_CHUNK + 200, fetched=True)
    done = run_cli(db_url, "jobs", "retry", "--reason", DIED, "--limit", "5000",
                   "--note", "charges checked", "--yes", "--json", "--as", "alice")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["counts"] == {"matched": len(ids), "applied": len(ids), "refused": 0}
    assert statuses(engine) == {"queued": len(ids)}
    assert recorded(engine) == {("retry", "applied"): len(ids)}
    with engine.connect() as conn:
        resumed = Counter(conn.execute(sa.select(jobs.c.resume_step_index,
                                                 jobs.c.attempt_count, jobs.c.status_reason)))
    # Each resumes after the step it finished, with a fresh budget, for operator_retry.
    assert resumed == {(1, 0, "operator_retry"): len(ids)}


def test_jobs_that_moved_between_the_count_and_the_act_are_refused_the_rest_applied(
        client: JobClient, engine: Engine, db_url: str) -> None:
    """Chosen, then one retried by a second operator and claimed by a worker at once: it is
    refused (it runs now), the rest applied, every one recorded."""
    ids = died_in_bulk(client, engine, 6)
    settings = Settings(database_url=db_url)
    desk = open_desk(engine, Config(settings=settings, kinds=parse_kinds(None, settings)),
                     SqlStore(engine))
    assert desk is not None
    targets = desk.bulk_targets(OperatorAction.RETRY, reason=DIED, kind=None, since=None,
                                limit=100)
    assert sorted(int(t) for t in targets) == sorted(ids)
    first = targets[0]
    assert desk.act(OperatorAction.RETRY, first, actor="bob", note="mine").applied
    claim = client.claim("w-live", lease_seconds=60)  # a worker takes it at once
    assert claim is not None
    assert str(claim.job_id) == first
    reports = desk.act_on_chunk(OperatorAction.RETRY, targets, actor="alice", note="bulk")
    assert [(r.job_id, r.refusal) for r in reports] == [
        (first, "job_not_failed_or_cancelled"), *((t, None) for t in targets[1:])]
    assert statuses(engine) == {"processing": 1, "queued": 5}
    assert recorded(engine) == {("retry", "applied"): 6, ("retry", "refused"): 1}


def test_a_job_a_pass_decided_anew_between_the_count_and_the_act_is_refused(
        client: JobClient, engine: Engine, db_url: str) -> None:
    """Six jobs a pass failed, retried by an operator; one claimed again, its worker dead
    inside ``charge`` once more. A bulk cancel counts all six (queued or running: each
    cancellable); before it acts, a real pass fails the dead one again (a decision of its
    own): the cancel refuses it (``job_terminal``, in words), cancels the five, and every
    action is recorded."""
    ids = died_in_bulk(client, engine, 6)
    settings = Settings(database_url=db_url)
    desk = open_desk(engine, Config(settings=settings, kinds=parse_kinds(None, settings)),
                     SqlStore(engine))
    assert desk is not None
    for job_id in ids:
        assert desk.act(OperatorAction.RETRY, str(job_id), actor="bob", note="fixed").applied
    claim = client.claim("w-again", lease_seconds=60)
    assert claim is not None
    claim.start_step(claim.next_step_index)  # inside the effectful charge again
    with engine.begin() as conn:  # and the worker dies: its lease runs out unrenewed
        conn.execute(jobs.update().where(jobs.c.job_id == claim.job_id)
                     .values(lease_expires_at=now_plus(-60)))
    targets = desk.bulk_targets(OperatorAction.CANCEL, reason=DIED, kind=None, since=None,
                                limit=100)
    assert sorted(int(t) for t in targets) == sorted(ids)
    report = run_pass(SqlStore(engine), PassConfig(batch_size=100,
                                                   thresholds=Thresholds(0.0, 3600.0),
                                                   instance="between-count-and-act"))
    assert [(d.job_id, d.reason.value) for d in report.decisions] == [(claim.job_id, DIED)]
    reports = desk.act_on_chunk(OperatorAction.CANCEL, targets, actor="alice", note="bulk")
    ended = str(claim.job_id)
    assert {r.job_id: r.refusal for r in reports} == {
        t: "job_terminal" if t == ended else None for t in targets}
    [refused] = [r for r in reports if not r.applied]
    assert "the job has ended" in refused.line
    assert statuses(engine) == {"failed": 1, "cancelled": 5}
    assert recorded(engine) == {("retry", "applied"): 6, ("cancel", "applied"): 5,
                                ("cancel", "refused"): 1}


def job_rows(engine: Engine) -> dict[int, tuple[object, ...]]:
    """Every job's whole row, by id."""
    with engine.connect() as conn:
        return {int(r.job_id): tuple(r) for r in conn.execute(sa.select(jobs))}


def split_by_outcome(engine: Engine, before: dict[int, tuple[object, ...]]
                     ) -> tuple[set[int], set[int]]:
    """The jobs retried (queued, ``operator_retry``, one retry applied on record), and
    those half done: neither retried nor untouched (the row as it was, nothing on
    record)."""
    with engine.connect() as conn:
        queued = {int(r.job_id) for r in conn.execute(
            sa.select(jobs.c.job_id).where(jobs.c.job_status == "queued",
                                           jobs.c.status_reason == "operator_retry"))}
        acted = Counter(int(j) for j in conn.execute(sa.select(actions.c.job_id)).scalars())
        outcomes = Counter(conn.execute(sa.select(actions.c.action_outcome)).scalars())
    after = job_rows(engine)
    retried = {j for j in queued if acted[j] == 1}
    untouched = {j for j, row in before.items() if after[j] == row and not acted[j]}
    assert set(outcomes) <= {"applied"}, outcomes  # nothing refused: no job moved
    return retried, set(before) - retried - untouched


def finished_by_a_second_run(url: str, engine: Engine, ids: list[int],
                             retried: set[int]) -> None:
    """The same command again: it counts the jobs the first left, retries each of them,
    and every job ends retried once."""
    again = run_cli(url, *BULK_RETRY, "--json", timeout=300)
    assert again.returncode == 0, again.stderr
    rest = len(ids) - len(retried)
    assert json.loads(again.stdout)["counts"] == {"matched": rest, "applied": rest,
                                                  "refused": 0}
    assert statuses(engine) == {"queued": len(ids)}
    assert recorded(engine) == {("retry", "applied"): len(ids)}


def test_an_interrupted_bulk_leaves_each_job_retried_and_recorded_or_untouched(
        client: JobClient, engine: Engine, db_url: str) -> None:
    """SIGINT once half the chunks are in: exit 130, each job either queued with its
    retry recorded or as it was with nothing recorded; the same command again retries
    the rest."""
    ids = died_in_bulk(client, engine, INTERRUPTED_JOBS)
    before = job_rows(engine)
    code, err = bulk_interrupted_halfway(db_url, len(ids))
    assert not ours_failed(err), err
    retried, half_done = split_by_outcome(engine, before)
    assert half_done == set()
    # Cut mid-way (``interrupted_bulk``): some chunks retried, the rest untouched, a
    # chunk never split between them.
    assert code == 130, err
    assert 0 < len(retried) < len(ids)
    assert len(retried) % BULK_CHUNK == 0
    finished_by_a_second_run(db_url, engine, ids, retried)


@dataclass(frozen=True)
class RestartableDatabase:
    """A migrated database on a server of the test's own, and how to crash-restart it."""

    url: str
    restart: Callable[[], None]


@pytest.fixture(params=[e for e in ("postgresql", "mariadb") if e in ENGINES])
def restartable(request: pytest.FixtureRequest) -> Iterator[RestartableDatabase]:
    """PostgreSQL restarted ``-m immediate``, or MariaDB SIGKILLed and started again on
    its data (``ThrowawayMariaDB.restart``): each a server of this test's own, never the
    session's, which other tests' databases live on."""
    server: ThrowawayPostgres | ThrowawayMariaDB
    if request.param == "postgresql":
        require_pg_bin()
        server = ThrowawayPostgres()
    else:
        require_mariadb_bin()
        server = ThrowawayMariaDB()
    with server:
        server.create_database("bulk")
        url = server.url("bulk")
        engine = create_engine(url)
        upgrade(engine)
        engine.dispose()
        yield RestartableDatabase(url, server.restart)


def test_a_bulk_whose_database_restarts_under_it_leaves_no_job_half_done(
        restartable: RestartableDatabase) -> None:
    """The database crash-restarted once about half the chunks are in: every job is
    queued with its retry recorded or as it was with nothing recorded; the command ends
    with one line and exit 3 when the restart cut a chunk (it goes on where it landed
    between two: the pool's next connection is a new one), and the same command, run
    again, retries the rest."""
    url = restartable.url
    engine = create_engine(url)
    try:
        with JobClient(engine, settings=Settings(database_url=url)) as client:
            ids = died_in_bulk(client, engine, INTERRUPTED_JOBS)
        before = job_rows(engine)

        def restart(_: subprocess.Popen[str]) -> None:
            engine.dispose()  # the test's own connections go with the server
            restartable.restart()

        code, err = interrupted_bulk(url, engine, len(ids), restart)
        assert not ours_failed(err), err
        retried, half_done = split_by_outcome(engine, before)
        assert half_done == set()
        if len(retried) < len(ids):  # the restart cut it (frozen inside a chunk's work)
            assert len(retried) % BULK_CHUNK == 0
            assert code == 3, err
            [line] = err.strip().splitlines()
            assert line.startswith("reconciler: error: database error"), line
        else:  # it landed where no chunk was in flight: the pool checks a connection
            # before it hands it out, so the next chunk ran on a new one
            assert code == 0, err
        finished_by_a_second_run(url, engine, ids, retried)
    finally:
        engine.dispose()
