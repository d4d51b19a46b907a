"""Counterexamples the state machine found, shrunk and kept as plain tests.

Each test is the machine's shrunk sequence of calls, on a fresh database (SQLite, or
MariaDB as the machine's own: harness.DEFAULT_MACHINE_ENGINE) with the
controllable database clock, asserting what the docs promise, so the bug stays fixed
whatever becomes of the machine's rules.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.config.settings import Settings
from reconciler.core.decisions import Thresholds
from reconciler.core.passes import PassConfig, run_pass
from reconciler.worker import JobClient, LeaseLost, Step
from tests.statemachine.harness import DATABASE, DbClock

PASS = PassConfig(batch_size=50, thresholds=Thresholds(stale_after_seconds=5.0,
                                                        wedged_after_seconds=60.0),
                  instance="regression")


@pytest.fixture
def clock() -> Iterator[DbClock]:
    """The SQLite database clock, back at real time after the test whatever happens."""
    clock = DbClock()
    yield clock
    clock.reset()


@pytest.fixture
def client(tmp_path: Path) -> Iterator[JobClient]:
    """A client on a fresh migrated database (SQLite, or the test's MariaDB emptied)."""
    engine = DATABASE.engine(tmp_path)
    with JobClient(engine, settings=Settings()) as c:
        yield c
    engine.dispose()


def test_claim_under_a_gone_session_is_taken_back_at_once(client: JobClient,
                                                          clock: DbClock) -> None:
    """A claim made under a session already gone is not left to wait out its lease.

    A session that stopped (or stopped heartbeating, or was replaced) is gone,
    and the reconciler treats its claims as expired at once. The worker runtime can claim
    under its old session id in the seconds before its session loop notices the session
    is gone. The machine found ``claim`` accepting the gone session: the job got a live
    lease that no heartbeat could renew (heartbeat is fenced on the session being alive),
    and passes left it alone until that lease ran out (shrunk: register w1, stop its
    session, claim under it, one second, a pass). Either fix keeps the promise: ``claim``
    refuses a gone session (the fix taken), or the next pass takes the job back.
    """
    store = client.store
    session = store.register_session("w1", "host-a", 4242)
    store.stop_session(session)
    job_id = client.enqueue("report", [Step("step0", "pure")], max_attempts=3)
    try:
        claim = client.claim("w1", lease_seconds=10, session_id=session)
    except LeaseLost:
        return
    if claim is None:
        return
    clock.advance(1.0)

    report = run_pass(store, PASS)

    assert [(d.job_id, d.disposition.value, d.reason.value) for d in report.decisions] == [
        (job_id, "resume", "resumed_from_unstarted_step")]
    detail = store.get_job(job_id)
    assert detail is not None
    assert detail.job_status == "queued"
