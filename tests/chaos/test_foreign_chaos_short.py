"""The short chaos run with each real job system: its workers SIGKILLed and SIGSTOPped
inside their tasks, a replica killed, PostgreSQL restarted once; every count 0.

The CI-sized version of ``python -m tests.chaos.foreign`` (README.md in this folder has the
longer runs). Without PostgreSQL binaries, node or Procrastinate a system's run is skipped
with the reason, except under ``CI=true``, where that fails.
"""

from __future__ import annotations

import pytest

from tests.chaos.foreign.run import ForeignParams, run_foreign_chaos
from tests.chaos.foreign.systems import SYSTEMS, UnavailableError
from tests.helpers import require_pg_bin
from tests.sources.conftest import unavailable

pytestmark = pytest.mark.chaos


@pytest.mark.parametrize("system", SYSTEMS)
def test_short_foreign_chaos_run_keeps_every_invariant(system: str) -> None:
    """No effectful task started twice because of us, no job left running, no budget
    overrun, one decision per attempt; and the faults did happen."""
    require_pg_bin()
    params = ForeignParams(system=system, jobs=45, kills=8, stops=3, seconds=20,
                           hang_max_seconds=0.6, drain_seconds=60)
    try:
        result = run_foreign_chaos(params)
    except UnavailableError as exc:
        unavailable(str(exc))
        return
    print(result.render())

    assert result.checks.counts == dict.fromkeys(result.checks.counts, 0), result.render()
    assert result.stats.drained, result.render()
    assert result.checks.facts["jobs"] == params.jobs
    assert result.stats.worker_kills > 0, result.render()
    assert result.stats.stops > 0, result.render()
    assert result.stats.replica_kills > 0, result.render()
    assert result.stats.db_restarts == 1
