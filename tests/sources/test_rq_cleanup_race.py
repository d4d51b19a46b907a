"""Why the rq source decides before RQ's own cleanup can read a dead worker's entry: the
cause of the chaos runs' one ``effect_started_twice`` (issue 36).

RQ's ``StartedJobRegistry.cleanup`` reads the expired entries, then, for each job, fails
it or requeues it through its ``Retry`` in a pipeline that never looks at the job's
status. A pass that fails the job between the two has its failure undone: the effectful
job is queued again, and the next worker runs it a second time. The steps below are RQ's
own calls, in that order (its cleanup cannot be paused between them otherwise). Since the
source decides once the dead worker's heartbeat is ``session_timeout_seconds`` overdue, a
minute before the entry expires, the cleanup's read finds nothing of it.

RQ's jobs are the conformance suite's (``RqFixture``); the reconciler's own tables on
SQLite and PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from reconciler.core.vocabulary import Reason
from reconciler.sources.rq.keys import HEARTBEAT_GRACE_SECONDS
from tests.conformance.fixtures import TIMING, Situation, State
from tests.conformance.rq import QUEUE, RQ, RqFixture, open_rq


@pytest.fixture(params=[(RQ, "sqlite"), (RQ, "postgresql")], ids=lambda p: p[1])
def rq_jobs(request: pytest.FixtureRequest) -> Iterator[RqFixture]:
    with open_rq(request) as fixture:
        yield fixture


def cleanup_read(fixture: RqFixture) -> list[str]:
    """The first half of RQ's cleanup: the expired entries' job ids."""
    from rq.registry import StartedJobRegistry  # noqa: PLC0415

    return list(StartedJobRegistry(QUEUE, connection=fixture.redis).get_expired_job_ids())


def cleanup_write(fixture: RqFixture, job_ids: list[str]) -> None:
    """The second half, as ``StartedJobRegistry.cleanup`` writes: each job with retries
    left requeued (``job.retry``), whatever its status now."""
    from rq import Queue  # noqa: PLC0415
    from rq.job import Job  # noqa: PLC0415

    queue = Queue(QUEUE, connection=fixture.redis)
    with fixture.redis.pipeline() as pipeline:
        for job_id in job_ids:
            job = Job.fetch(job_id, connection=fixture.redis)
            if job.retries_left and job.retries_left > 0:
                job.retry(queue, pipeline)
        pipeline.execute()


def effectful_with_retries(fixture: RqFixture, *, expired: bool) -> str:
    """A job its dead worker died in, inside an effectful step, with a ``Retry`` left; its
    entry expired, or (not ``expired``) its heartbeat overdue past the session timeout but
    the entry still a few seconds from expiring."""
    job = str(fixture.make(Situation(State.DIED_MID_STEP, 0)).key)
    fixture.redis.hset(f"rq:job:{job}", "retries_left", 2)
    if not expired:
        [(member, _)] = fixture._entries(job)
        seconds, micros = fixture.redis.time()
        overdue = (HEARTBEAT_GRACE_SECONDS - TIMING.session_timeout_seconds) / 2
        fixture.redis.zadd(f"rq:wip:{QUEUE}", {member: seconds + micros / 1e6 + overdue})
    return job


def test_a_failure_made_between_rqs_cleanup_read_and_write_is_undone(
        rq_jobs: RqFixture) -> None:
    """The race, at the entry's expiry: RQ requeues the job a pass failed."""
    job = effectful_with_retries(rq_jobs, expired=True)
    read = cleanup_read(rq_jobs)
    assert job in read
    decided = {str(d.job_id): d.reason for d in rq_jobs.run_pass().decisions}
    assert decided[job] is Reason.WORKER_DIED_MID_STEP
    cleanup_write(rq_jobs, read)
    assert rq_jobs.redis.hget(f"rq:job:{job}", "status") == b"queued"  # to run again


def test_a_job_decided_on_its_workers_silence_is_out_of_the_cleanups_reach(
        rq_jobs: RqFixture) -> None:
    """Decided while the entry has not expired yet (its heartbeat overdue): RQ's cleanup
    reads nothing of it, then or later, and the failure stands."""
    job = effectful_with_retries(rq_jobs, expired=False)
    assert job not in cleanup_read(rq_jobs)
    decided = {str(d.job_id): d.reason for d in rq_jobs.run_pass().decisions}
    assert decided[job] is Reason.WORKER_DIED_MID_STEP
    read = cleanup_read(rq_jobs)
    assert job not in read
    cleanup_write(rq_jobs, read)
    assert rq_jobs.redis.hget(f"rq:job:{job}", "status") == b"failed"
