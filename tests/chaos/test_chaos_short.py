"""The short chaos run, on each engine: hundreds of jobs, dozens of kills, every count 0.

The CI-sized version of ``python -m tests.chaos`` (see README.md in this folder for the
full run). PostgreSQL needs its own server (the run restarts it): without PostgreSQL
binaries the PostgreSQL run is skipped, except under ``CI=true``, where that fails. MariaDB
runs on its own throwaway server too, killed and started again once, where the engines
are chosen to include it (``RECONCILER_TEST_ENGINES=mariadb``, as .ci/run does).
"""

from __future__ import annotations

import pytest

from tests.chaos.harness import PASS_FAILPOINTS, ChaosParams, run_chaos
from tests.conftest import ENGINES
from tests.helpers import require_mariadb_bin, require_pg_bin

pytestmark = pytest.mark.chaos

# The drain ends as soon as every job is terminal; its bound only has to outlast a busy
# machine (CI runs these beside other tests), so it is generous.
SHORT_RUNS = {
    "sqlite": ChaosParams(engine="sqlite", jobs=300, kills=40, replicas=2, seconds=30,
                          drain_seconds=240),
    "postgresql": ChaosParams(engine="postgresql", jobs=300, kills=40, replicas=2,
                              db_restarts=1, seconds=30, drain_seconds=240),
    "mariadb": ChaosParams(engine="mariadb", jobs=300, kills=40, replicas=2,
                           db_restarts=1, seconds=30, drain_seconds=240),
}
MIN_KILLS = 30


@pytest.mark.parametrize("engine", [e for e in SHORT_RUNS if e in ENGINES])
def test_short_chaos_run_keeps_every_invariant(engine: str) -> None:
    """Workers and replicas die at failpoints and at random; no job, effect or write goes wrong."""
    if engine == "postgresql":
        require_pg_bin()
    if engine == "mariadb":
        require_mariadb_bin()
    params = SHORT_RUNS[engine]
    result = run_chaos(params)
    print(result.render())

    assert result.checks.counts == dict.fromkeys(result.checks.counts, 0), result.render()
    assert result.stats.drained, result.render()
    assert result.stats.kills >= MIN_KILLS, result.render()
    assert result.stats.db_restarts == params.db_restarts
    assert result.checks.facts["jobs"] == params.jobs + params.poison
    assert result.checks.facts["poison_runs"] > 0, result.render()  # the poison did kill
    # The kills reached workers at failpoints, workers at random and replicas.
    assert result.stats.kills_by_failpoint, result.render()
    assert result.stats.killer_kills["worker"] > 0, result.render()
    replica_deaths = result.stats.killer_kills["replica"] + sum(
        n for point, n in result.stats.kills_by_failpoint.items() if point in PASS_FAILPOINTS)
    assert replica_deaths > 0, result.render()
