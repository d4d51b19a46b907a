"""The wedged rule on RQ once the step ledger is in use: a pass reads every live entry of
the watched started registries at most once a ``SILENT_REREAD_SECONDS`` (set by hand
here), keeps those whose job's ledger went silent, and reads only them again in the
passes between. RQ's keys in a real redis-server; the reconciler's own tables on SQLite
and PostgreSQL (the conformance suite's ``RqFixture``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from reconciler.core.passes import explain_jobs
from reconciler.sources.rq import snapshot
from tests.conformance.fixtures import TIMING, Situation, State
from tests.conformance.rq import RQ, RqFixture, open_rq
from tests.conformance.systems import _specs
from tests.sources.django_tasks_support import record_steps

WEDGED = Situation(State.WEDGED, 1)


@pytest.fixture(params=[(RQ, "sqlite"), (RQ, "postgresql")], ids=lambda p: p[1])
def rq_source(request: pytest.FixtureRequest) -> Iterator[RqFixture]:
    with open_rq(request) as fixture:
        yield fixture


def test_a_job_gone_silent_after_a_read_of_every_live_entry_waits_for_the_next_read(
        rq_source: RqFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first pass reads every live entry and finds the wedged job; a live job whose
    ledger goes silent just after is not read by the next pass within the period (only the
    first job is read again, and still found), and is found by the first pass after it."""
    monkeypatch.setattr(snapshot, "SILENT_REREAD_SECONDS", 3600.0)
    wedged = rq_source.make(WEDGED)
    later = rq_source.make(Situation(State.LIVE, 1))

    first = rq_source.run_pass(dry_run=True)
    record_steps(rq_source.engine, rq_source.source_name, str(later.key), 1, _specs(WEDGED),
                 age=TIMING.wedged_after_seconds + 60)
    between = rq_source.run_pass(dry_run=True)
    monkeypatch.setattr(snapshot, "SILENT_REREAD_SECONDS", 0.0)  # the period is over
    after = rq_source.run_pass(dry_run=True)

    assert [d.job_id for d in first.decisions] == [wedged.key]
    assert [d.job_id for d in between.decisions] == [wedged.key]
    assert sorted(str(d.job_id) for d in after.decisions) == sorted([str(wedged.key),
                                                                      str(later.key)])


def test_a_pass_after_an_explain_in_the_same_process_reads_the_silent_job_again(
        rq_source: RqFixture) -> None:
    """``explain`` reads every entry and remembers each execution; the pass after it in
    the same process loads the wedged job, reads it again and decides it."""
    wedged = rq_source.make(WEDGED)
    rq_source.make(Situation(State.LIVE, 1))

    explained = explain_jobs(rq_source.store, [wedged.key], rq_source.pass_config())
    decided = rq_source.run_pass(dry_run=True)

    assert [change.decision.job_id for change in explained] == [wedged.key]
    assert [d.job_id for d in decided.decisions] == [wedged.key]
