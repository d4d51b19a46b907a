"""The bulk form over this project's own jobs, a chunk at a time, on SQLite and PostgreSQL:
700 jobs a pass ended retried in two chunks, each job fenced and recorded, resuming
where its steps left it; jobs that moved between the count and the act refused, the rest
applied; and a bulk interrupted mid-way, by SIGINT and by its PostgreSQL restarting under
it, that leaves every job either retried and recorded or untouched, finished by the same
command run again."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
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
from reconciler.storage.engines import create_engine
from reconciler.storage.schema import upgrade
from reconciler.storage.sql import actions, attempts, jobs, steps
from reconciler.storage.sql_store import SqlStore
from reconciler.worker import JobClient, Step
from tests.cli_runner import settings_env
from tests.conftest import REPO_ROOT, run_cli
from tests.helpers import wait_for
from tests.pg_server import ThrowawayPostgres

PACKAGE_DIR = Path(reconciler.__file__).parent

pytestmark = pytest.mark.integration

DIED = "worker_died_mid_step"
PLAN = [Step("fetch", "idempotent"), Step("charge", "effectful")]


def died_in_bulk(client: JobClient, engine: Engine, count: int, *,
                 fetched: bool = False) -> list[int]:
    """``count`` jobs enqueued through the client, then left as a claim whose worker died
    inside the effectful ``charge`` leaves them (``fetched``: after ``fetch`` succeeded)
    (processing, generation 1, the lease gone five minutes ago, the steps after the claim,
    the attempt open), in a few statements, not a claim each; ended
    ``worker_died_mid_step`` by one real pass."""
    plan = PLAN if fetched else PLAN[1:]
    with engine.begin() as conn:
        ids = [client.enqueue("billing.charge", steps=plan, connection=conn)
               for _ in range(count)]
        mine = jobs.c.job_id.in_(ids)
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


BULK_RETRY = ("jobs", "retry", "--reason", DIED, "--limit", "5000", "--note", "checked",
              "--yes", "--as", "alice")


def interrupted_bulk(url: str, engine: Engine,
                     interrupt: Callable[[subprocess.Popen[str]], None]) -> tuple[int, str]:
    """``BULK_RETRY`` as a process of its own on ``url``, ``interrupt``ed once its first
    chunk is recorded: its exit status and its stderr."""
    bulk = subprocess.Popen([sys.executable, "-m", "reconciler.cli", *BULK_RETRY],
                            env=settings_env(url), cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: recorded(engine) or bulk.poll() is not None,
                 "the first chunk to commit")
        interrupt(bulk)
        _, err = bulk.communicate(timeout=120)
    finally:
        if bulk.poll() is None:
            bulk.kill()
    return bulk.returncode, err


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


def test_an_interrupted_bulk_leaves_each_job_retried_and_recorded_or_untouched(
        client: JobClient, engine: Engine, db_url: str) -> None:
    """SIGINT once the first chunk is in: each job queued exactly when its retry is
    recorded; the same command again retries the rest."""
    ids = died_in_bulk(client, engine, 3 * BULK_CHUNK)
    _, err = interrupted_bulk(db_url, engine, lambda bulk: bulk.send_signal(signal.SIGINT))
    assert not ours_failed(err), err
    with engine.connect() as conn:
        queued = set(conn.execute(sa.select(jobs.c.job_id)
                                  .where(jobs.c.job_status == "queued")).scalars())
        retried = set(conn.execute(sa.select(actions.c.job_id)
                                   .where(actions.c.operator_action == "retry",
                                          actions.c.action_outcome == "applied")).scalars())
    assert queued == retried
    assert len(queued) % BULK_CHUNK == 0 or len(queued) == len(ids)

    again = run_cli(db_url, *BULK_RETRY)
    assert again.returncode == 0, again.stderr
    assert statuses(engine) == {"queued": len(ids)}
    assert recorded(engine) == {("retry", "applied"): len(ids)}


def test_a_bulk_whose_database_restarts_under_it_leaves_no_job_half_done(
        own_postgres: ThrowawayPostgres) -> None:
    """PostgreSQL restarted (crash-like) once the first chunk is in: the command ends
    with one line and exit 3, every job is queued exactly when its retry is recorded, and
    the same command, run again, retries the rest."""
    own_postgres.create_database("bulk")
    url = own_postgres.url("bulk")
    engine = create_engine(url)
    try:
        upgrade(engine)
        with JobClient(engine, settings=Settings(database_url=url)) as client:
            ids = died_in_bulk(client, engine, 4 * BULK_CHUNK)

        def restart(_: subprocess.Popen[str]) -> None:
            engine.dispose()  # the test's own connections go with the server
            own_postgres.restart()

        code, err = interrupted_bulk(url, engine, restart)
        assert not ours_failed(err), err
        with engine.connect() as conn:
            queued = set(conn.execute(sa.select(jobs.c.job_id)
                                      .where(jobs.c.job_status == "queued")).scalars())
            retried = set(conn.execute(sa.select(actions.c.job_id).where(
                actions.c.operator_action == "retry",
                actions.c.action_outcome == "applied")).scalars())
        assert queued == retried
        if len(queued) < len(ids):  # the restart cut it short, as meant
            assert code == 3, err
            assert len(err.strip().splitlines()) == 1, err
        again = run_cli(url, *BULK_RETRY)
        assert again.returncode == 0, again.stderr
        assert statuses(engine) == {"queued": len(ids)}
        assert recorded(engine) == {("retry", "applied"): len(ids)}
    finally:
        engine.dispose()
