"""The wedged rule on RQ once the step ledger is in use: a pass reads every live entry of
the watched started registries at most once a ``SILENT_REREAD_SECONDS`` (shortened here),
keeps those whose job's ledger went silent, and reads only them again in the passes
between. RQ's keys in a real redis-server; the reconciler's own tables on SQLite and
PostgreSQL (the conformance suite's ``RqFixture``)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from reconciler.sources.rq import snapshot
from tests.conformance.fixtures import TIMING, Situation, State
from tests.conformance.rq import RQ, RqFixture, open_rq
from tests.conformance.systems import _specs
from tests.sources.django_tasks_support import record_steps

REREAD_SECONDS = 2.0
WEDGED = Situation(State.WEDGED, 1)


@pytest.fixture(params=[(RQ, "sqlite"), (RQ, "postgresql")], ids=lambda p: p[1])
def rq_source(request: pytest.FixtureRequest) -> Iterator[RqFixture]:
    with open_rq(request) as fixture:
        yield fixture


def test_a_job_gone_silent_after_a_read_of_every_live_entry_waits_for_the_next_read(
        rq_source: RqFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first pass reads every live entry and finds the wedged job; a live job whose
    ledger goes silent just after is not read by the next pass (only the first job is read
    again, and still found), and is found by the first pass after the period."""
    monkeypatch.setattr(snapshot, "SILENT_REREAD_SECONDS", REREAD_SECONDS)
    wedged = rq_source.make(WEDGED)
    later = rq_source.make(Situation(State.LIVE, 1))

    first = rq_source.run_pass(dry_run=True)
    record_steps(rq_source.engine, rq_source.source_name, str(later.key), 1, _specs(WEDGED),
                 age=TIMING.wedged_after_seconds + 60)
    between = rq_source.run_pass(dry_run=True)
    time.sleep(REREAD_SECONDS)
    after = rq_source.run_pass(dry_run=True)

    assert [d.job_id for d in first.decisions] == [wedged.key]
    assert [d.job_id for d in between.decisions] == [wedged.key]
    assert sorted(str(d.job_id) for d in after.decisions) == sorted([str(wedged.key),
                                                                      str(later.key)])
