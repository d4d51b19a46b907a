"""Real ``rq worker`` processes over a real Redis, SIGKILLed mid-job, recovered by the rq
source with the reconciler's own tables on SQLite and PostgreSQL; another live worker of
the same queue runs beside them (RQ's own maintenance included).

RQ's started-registry entry of a dead worker expires about 61 s after its last renewal
(``--job-monitoring-interval 1``, plus the fixed 60 s RQ adds). One scenario per engine
waits for that in real time (``TestRealExpiry``); the others age the entry's score and
drop the dead worker's key in Redis, as that minute would (``expire_as_time_would``), and
say so.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.core.kinds import KindRule, KindRules
from reconciler.core.vocabulary import Disposition, EffectKind, Reason
from tests.sources.rq_support import (
    EFFECTFUL,
    IDEMPOTENT,
    RqProject,
    rq_project,
    sigkill,
    start_worker,
    wait_started,
    wait_status,
)
from tests.sources.support import Markers, Processes, by_job, reconcile_once

__all__ = ["rq_project"]

KINDS = KindRules([KindRule("tests.sources.rq_tasks.idem_*", effect=EffectKind.IDEMPOTENT)],
                  stale_after_seconds=0.5, wedged_after_seconds=3600.0, max_attempts=3)


@pytest.fixture
def markers(tmp_path: Path) -> Markers:
    return Markers(tmp_path / "markers")


class TestKilledWorker:
    """A whole worker (and its work horse) SIGKILLed mid-job: RQ leaves the job started."""

    def test_idempotent_job_is_resumed_and_finished_by_a_new_worker(
            self, rq_project: RqProject, processes: Processes, markers: Markers) -> None:
        job_id = rq_project.enqueue(IDEMPOTENT, hang=[3600, 0])
        first = start_worker(processes, rq_project, markers, "worker-a")
        wait_started(markers, job_id, first)
        sigkill(first)
        rq_project.expire_as_time_would(job_id, first)
        outcome = by_job(reconcile_once(rq_project.engine, rq_project.config(), KINDS))[job_id]
        assert (outcome.disposition, outcome.reason) == (Disposition.RESUME,
                                                         Reason.RESUMED_IDEMPOTENT_STEP)
        assert rq_project.status(job_id) == "queued"
        second = start_worker(processes, rq_project, markers, "worker-b")
        wait_status(rq_project, job_id, "finished", worker=second)
        assert rq_project.job(job_id).return_value() == "done on attempt 2"
        assert markers.of(job_id) == {"started-1", "started-2", "done-2"}

    def test_effectful_job_fails_with_our_reason_as_rq_reads_it(
            self, rq_project: RqProject, processes: Processes, markers: Markers) -> None:
        job_id = rq_project.enqueue(EFFECTFUL, retry=2)
        first = start_worker(processes, rq_project, markers, "worker-a")
        wait_started(markers, job_id, first)
        sigkill(first)
        rq_project.expire_as_time_would(job_id, first)
        outcome = by_job(reconcile_once(rq_project.engine, rq_project.config(), KINDS))[job_id]
        assert (outcome.disposition, outcome.reason) == (Disposition.TERMINALIZE,
                                                         Reason.WORKER_DIED_MID_STEP)
        job = rq_project.job(job_id)
        assert job.get_status().value == "failed"
        assert "reconciler: worker_died_mid_step" in (job.exc_info or "")
        result = job.latest_result()
        assert result is not None
        assert result.type.name == "FAILED"
        assert "reconciler: worker_died_mid_step" in (result.exc_string or "")
        assert job_id in rq_project.queue().failed_job_registry.get_job_ids()
        assert job.retries_left == 2  # never retried, retries left or not
        # A new worker of the queue never runs it again.
        start_worker(processes, rq_project, markers, "worker-b")
        assert markers.of(job_id) == {"started-1"}
