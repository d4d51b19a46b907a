"""Four replicas racing over one backlog (issue 12).

Every replica passes; on PostgreSQL candidates are taken ``FOR UPDATE SKIP LOCKED``, on
SQLite the write lock serialises the passes. Whatever the interleaving, the audit must show
one non-skip decision per job and generation, and every orphan decided. The backlog is
made through the worker API (real claims whose workers never come back); the replicas are
four real processes: loops of passes started together, and ``reconciler run``. The orphans'
leases all run out at one moment, when their worker's session ends, so the replicas meet
the whole backlog together.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from models import JobAttempt, JobRun, ReconciliationDecision, ReconciliationPass
from reconciler.storage.clock import db_now
from reconciler.worker import JobClient, Step
from tests.conftest import REPO_ROOT
from tests.fork_server import start_script, suite_server
from tests.helpers import wait_for
from tests.integration.test_service import Launcher

JOBS = cast(sa.Table, JobRun.__table__)
ATTEMPTS = cast(sa.Table, JobAttempt.__table__)
DECISIONS = cast(sa.Table, ReconciliationDecision.__table__)
PASSES = cast(sa.Table, ReconciliationPass.__table__)

PLAN = [Step("fetch", "idempotent"), Step("publish", "effectful")]
ORPHANS = 300
REPLICAS = 4
BATCH_SIZE = 10  # 30 full batches for four replicas to share
DRAIN_SECONDS = 90.0

# One replica: passes back to back until three in a row find nothing, started together
# with the others by a file appearing. Every replica passes; a
# PassConfig that still gates passes on the leader lease is told not to.
PASS_LOOP = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from reconciler.core.decisions import Thresholds
    from reconciler.core.passes import PassConfig, run_pass
    from reconciler.storage.engines import create_engine
    from reconciler.storage.sql_store import SqlStore

    url, name, go = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    ungated = ({"use_leader_lease": False}
               if "use_leader_lease" in PassConfig.__dataclass_fields__ else {})
    config = PassConfig(batch_size=int(sys.argv[4]), instance=name,
                        thresholds=Thresholds(stale_after_seconds=0, wedged_after_seconds=3600),
                        **ungated)
    store = SqlStore(create_engine(url))
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.002)
    passes = decided = empty = 0
    while empty < 3:
        report = run_pass(store, config)
        passes += 1
        acted = sum(1 for d in report.decisions if d.disposition.value != "skip")
        decided += acted
        empty = 0 if report.decisions else empty + 1
    print(json.dumps({"passes": passes, "decided": decided}), flush=True)
""")


def make_orphans(client: JobClient, engine: Engine, count: int) -> dict[int, str]:
    """Jobs claimed by one worker session that then ends: every lease runs out at once.

    A third of the jobs stopped mid effectful step, the rest before any step. Returns
    what each job must end as: ``failed`` (terminalized) or ``queued`` (resumed).
    """
    with engine.begin() as conn:
        for _ in range(count):
            client.enqueue("race", steps=PLAN, max_attempts=3, connection=conn)
    session = client.store.register_session("doomed", socket.gethostname(), os.getpid())
    expected: dict[int, str] = {}
    for i in range(count):
        # As a worker does: its session heartbeats while it claims (a loaded machine can take
        # longer than the replicas' session timeout over these claims, and a session they
        # declared gone claims nothing), and it polls again when a replica's pass holds the
        # queued rows' locks for a moment (MariaDB; the claim skips locked rows).
        def claimed() -> Any:
            assert client.store.heartbeat_session(session), "the doomed session ended early"
            return client.claim("doomed", lease_seconds=120, session_id=session)

        claim = wait_for(claimed, "a queued job to claim")
        if i % 3 == 0:
            claim.start_step(0)
            claim.finish_step(0)
            claim.start_step(1)
            expected[claim.job_id] = "failed"
        else:
            expected[claim.job_id] = "queued"
    client.store.stop_session(session)

    def all_expired() -> bool:
        with engine.connect() as conn:
            return conn.execute(sa.select(sa.func.count()).select_from(JOBS).where(
                JOBS.c.job_status == "processing",
                JOBS.c.lease_expires_at > db_now())).scalar_one() == 0
    wait_for(all_expired, "every orphan's lease to run out")
    return expected


def still_processing(engine: Engine) -> int:
    """How many jobs are still ``processing``."""
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(JOBS)
                                .where(JOBS.c.job_status == "processing")).scalar_one())


def acting_decisions(engine: Engine) -> list[dict[str, Any]]:
    """Every non-skip decision of the audit, with the replica that made it."""
    with engine.connect() as conn:
        # The audit keeps job ids as text; this project's own ids are integers.
        return [{**r._mapping, "job_id": int(r.job_id)} for r in conn.execute(
            sa.select(DECISIONS.c.job_id, DECISIONS.c.disposition,
                      DECISIONS.c.generation_before, DECISIONS.c.generation_after,
                      PASSES.c.reconciler_instance)
            .join(PASSES, PASSES.c.pass_id == DECISIONS.c.pass_id)
            .where(DECISIONS.c.disposition != "skip"))]


def assert_each_orphan_decided_once(engine: Engine, expected: dict[int, str]) -> set[str]:
    """One non-skip decision per job and generation, for every orphan and nothing else;
    each job in the state its decision says. Returns the replicas that decided."""
    decided = acting_decisions(engine)
    per_generation = Counter((d["job_id"], d["generation_before"]) for d in decided)
    twice = {key: n for key, n in per_generation.items() if n > 1}
    assert twice == {}, f"decided more than once: {twice}"
    assert sorted(d["job_id"] for d in decided) == sorted(expected)
    with engine.connect() as conn:
        jobs = {int(r.job_id): r for r in conn.execute(
            sa.select(JOBS.c.job_id, JOBS.c.job_status, JOBS.c.claim_generation))}
        lost = Counter(int(j) for j in conn.execute(
            sa.select(ATTEMPTS.c.job_id).where(ATTEMPTS.c.attempt_outcome == "lost"))
            .scalars())
    for d in decided:
        job = jobs[d["job_id"]]
        assert d["generation_after"] == d["generation_before"] + 1 == job.claim_generation
        assert d["disposition"] == ("terminalize" if expected[d["job_id"]] == "failed"
                                    else "resume")
        assert job.job_status == expected[d["job_id"]]
    assert lost == dict.fromkeys(expected, 1), "each orphan's attempt closed once, as lost"
    return {d["reconciler_instance"] for d in decided}


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    """``reconciler run`` processes; any left running at teardown are killed."""
    started = Launcher(tmp_path)
    try:
        yield started
    finally:
        started.close()


def test_four_pass_loops_racing_over_one_backlog_decide_each_orphan_exactly_once(
    client: JobClient, engine: Engine, db_url: str, tmp_path: Path
) -> None:
    """Four processes pass back to back from the same instant: each orphan is decided once,
    by whichever got it; on PostgreSQL the backlog is shared (more than one replica
    decided)."""
    expected = make_orphans(client, engine, ORPHANS)
    go = tmp_path / "go"
    errors = [tmp_path / f"replica-{i}.stderr" for i in range(REPLICAS)]
    loops = []
    for i, error in enumerate(errors):
        with error.open("w") as stderr:
            loops.append(start_script(
                suite_server(), PASS_LOOP, [db_url, f"replica-{i}", str(go), str(BATCH_SIZE)],
                os.environ, stdout=subprocess.PIPE, stderr=stderr, cwd=str(REPO_ROOT)))
    try:
        for loop, error in zip(loops, errors, strict=True):
            assert loop.stdout is not None
            assert loop.stdout.readline().strip() == "ready", error.read_text()
        go.touch()
        results = []
        for loop, error in zip(loops, errors, strict=True):
            assert loop.wait(DRAIN_SECONDS) == 0, error.read_text()
            assert loop.stdout is not None
            results.append(json.loads(loop.stdout.read().strip().splitlines()[-1]))
    finally:
        for loop in loops:
            if loop.poll() is None:
                loop.kill()
                loop.wait(DRAIN_SECONDS)
            if loop.stdout is not None:
                loop.stdout.close()

    assert still_processing(engine) == 0
    deciders = assert_each_orphan_decided_once(engine, expected)
    assert sum(r["decided"] for r in results) == ORPHANS
    if engine.dialect.name == "postgresql":
        # SKIP LOCKED lets passes run side by side. SQLite's single write lock is not fair:
        # a replica passing back to back may keep it to the end, and that is allowed.
        assert len(deciders) >= 2, f"one replica decided everything: {results}"


def test_four_reconciler_run_replicas_over_one_backlog_decide_each_orphan_exactly_once(
    client: JobClient, engine: Engine, db_url: str, launcher: Launcher
) -> None:
    """Four ``reconciler run`` processes over one backlog: every orphan decided, none twice."""
    # brake_hold_seconds=0: every orphan goes stale at once, which the brake would hold.
    replicas = [launcher.spawn(db_url, instance_name=f"replica-{i}", batch_size=BATCH_SIZE,
                               brake_hold_seconds=0,
                               interval_seconds=0.2)
                for i in range(REPLICAS)]
    for replica in replicas:
        launcher.wait_listening(replica)
        launcher.wait_ready(replica)
    # Claimed under live leases while the replicas pass, then orphaned all at once.
    expected = make_orphans(client, engine, ORPHANS)
    deadline = time.monotonic() + DRAIN_SECONDS
    while still_processing(engine) and time.monotonic() < deadline:
        assert all(r.alive() for r in replicas), [r.stderr()[-2000:] for r in replicas]
        time.sleep(0.1)
    assert still_processing(engine) == 0, "orphans left undecided"
    assert_each_orphan_decided_once(engine, expected)
