"""pg-boss's own expiry beside the reconciler: real pg-boss workers (Node) with pg-boss's
maintenance on (every second), SIGKILLed mid-job.

pg-boss's maintenance takes back an ``active`` job ``expire_in`` after it started (to
``retry`` while its retries last, else ``failed``), blindly: an effectful job runs again.
An operator's hold holds that back too (the job's expiry pushed back in pg-boss's own
column), and where pg-boss won the race (a kind without ``max_run_seconds``: its lease is
that same expiry), the attempt it took back counts towards the crash-loop rule.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from reconciler.core.kinds import KindRule, KindRules
from reconciler.core.vocabulary import Disposition, EffectKind, OperatorAction, Reason
from tests.sources.actions_support import desk_for, forget_source
from tests.sources.factories import PgBossFactory
from tests.sources.support import Markers, Process, Processes, by_job, reconcile_once, wait_until
from tests.sources.test_node_workers import NodeSystem

SOURCE = "pg-boss"
EXPIRE_SECONDS = 2
MAINTAINED = {"SOURCES_PGBOSS_MAINTENANCE_SECONDS": "1"}
KINDS = KindRules([KindRule("idem.*", effect=EffectKind.IDEMPOTENT)],
                  stale_after_seconds=60.0, wedged_after_seconds=3600.0, max_attempts=3,
                  crash_loop_after=2)
"""No ``max_run_seconds``: the lease is pg-boss's own expiry, as in a new user's trial."""


@pytest.fixture
def boss(request: pytest.FixtureRequest, node_modules: Path, tmp_path: Path) -> NodeSystem:
    factory = PgBossFactory(request.getfixturevalue("pgboss_db"),
                            request.getfixturevalue("pgboss_schema"))
    forget_source(factory.db.engine, SOURCE)
    return NodeSystem(SOURCE, factory, node_modules, Markers(tmp_path / "markers"))


def factory_of(system: NodeSystem) -> PgBossFactory:
    assert isinstance(system.factory, PgBossFactory)
    return system.factory


def maintained_after(system: NodeSystem, job: str, seconds: float, worker: Process) -> None:
    """Until pg-boss's maintenance (its ``maintained_on``) has run ``seconds`` after the
    job's expiry: whatever its expiry was going to do, it has had the chance to."""
    row = system.row(job)
    assert row is not None
    due = row["started_on"] + timedelta(seconds=EXPIRE_SECONDS + seconds)
    engine = system.factory.db.engine

    def maintained() -> bool:
        with engine.connect() as conn:
            stamp = conn.execute(sa.text("SELECT maintained_on FROM pgboss.version")).scalar()
        return stamp is not None and stamp > due

    wait_until(maintained, "pg-boss's maintenance to run past the job's expiry",
               timeout=60, process=worker)


def test_a_held_job_is_not_taken_back_by_pgboss_while_held(
        boss: NodeSystem, processes: Processes) -> None:
    """An operator holds a running effectful job, then its worker dies: pg-boss's
    maintenance runs past its expiry again and again and neither fails nor retries it, and
    no other worker runs it; the pass records the hold; the unhold gives pg-boss back the
    job's own expiry."""
    factory = factory_of(boss)
    job = factory.send("effect.work", {}, expire_seconds=EXPIRE_SECONDS)
    first = boss.start(processes, "worker-a", **MAINTAINED)
    wait_until(lambda: boss.markers.has(f"{job}-started-0"), "the job to start",
               process=first)
    desk = desk_for(boss.factory.db.engine, boss.factory.config, KINDS)
    held = desk.act(OperatorAction.HOLD, job, actor="dana", note="checking the charge")
    assert held.applied, held.line
    assert "expiry is pushed back while held" in held.line
    first.kill()
    second = boss.start(processes, "worker-b", **MAINTAINED)
    maintained_after(boss, job, 3.0, second)
    [outcome] = [o for o in reconcile_once(boss.factory.db.engine, boss.factory.config, KINDS)
                 if str(o.job_id) == job]
    assert (outcome.disposition, outcome.reason) == (Disposition.SKIP, Reason.OPERATOR_HOLD)
    row = boss.row(job)
    assert row is not None
    assert (row["state"], row["retry_count"]) == ("active", 0)
    assert boss.markers.of(job) == {"started-0"}
    lifted = desk.act(OperatorAction.UNHOLD, job, actor="dana", note="not charged")
    assert lifted.applied, lifted.line
    with boss.factory.db.engine.connect() as conn:
        expire = conn.execute(sa.text("SELECT extract(epoch FROM expire_in) FROM pgboss.job "
                                      "WHERE id = :id"), {"id": job}).scalar_one()
    assert float(expire) == EXPIRE_SECONDS


def test_an_attempt_pgboss_took_back_counts_towards_the_crash_loop(
        boss: NodeSystem, processes: Processes) -> None:
    """pg-boss's expiry wins the race for a killed worker's job (no pass ran) and retries
    it; the next worker dies on it too: the pass counts both lost attempts and ends the
    job ``crash_loop``, where it used to resume it into a third victim."""
    factory = factory_of(boss)
    job = factory.send("idem.work", {"hang": [3600, 3600, 3600]}, retry_limit=2,
                       expire_seconds=EXPIRE_SECONDS)
    first = boss.start(processes, "worker-a", **MAINTAINED)
    wait_until(lambda: boss.markers.has(f"{job}-started-0"), "the job to start",
               process=first)
    first.kill()
    second = boss.start(processes, "worker-b", **MAINTAINED)
    wait_until(lambda: boss.markers.has(f"{job}-started-1"),
               "pg-boss's expiry to retry the job and a worker to take it", process=second)
    second.kill()
    third = boss.start(processes, "worker-c")  # no maintenance: only the pass acts now
    decided = wait_until(lambda: by_job(reconcile_once(
        boss.factory.db.engine, boss.factory.config, KINDS)).get(job),
        "a decision on the job", process=third)
    assert (decided.disposition, decided.reason) == (Disposition.TERMINALIZE,
                                                     Reason.CRASH_LOOP)
    assert decided.evidence["lost_attempts_in_a_row"] == 2
    later = factory.send("pure.work", {"hang": []}, expire_seconds=3600)
    wait_until(lambda: boss.done(later), "a later job to run", process=third)
    assert boss.markers.of(job) == {"started-0", "started-1"}
    assert factory.status(job) == "failed"
