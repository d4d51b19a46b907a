"""A Celery worker that comes back under its old node name (systemd, ``docker restart``,
``celery multi restart``, a container restarted in its pod: the default ``celery@%h``
does not change) answers for the name but never ran its predecessor's tasks: real prefork
workers over a real Redis, on every engine for the reconciler's tables.

The dead process's tasks are orphans, decided after the same silence rules as a silent
worker's; a task the new process took again (a redelivered ``task_acks_late`` message) is
its own, and left alone.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from reconciler.core.vocabulary import Disposition, Reason
from reconciler.sources.celery.broker import CeleryBroker
from tests.sources.celery_support import CeleryProject, kill_worker, worker_argv
from tests.sources.support import (
    PASS_GAP_SECONDS,
    Markers,
    Process,
    Processes,
    reconcile_once,
    record_finding,
    wait_until,
)
from tests.sources.test_celery_workers import KINDS, TIMEOUT_SECONDS, config, send

VISIBILITY_SECONDS = 2.0
NAME = "w1"


@pytest.fixture
def markers(tmp_path: Path) -> Markers:
    return Markers(tmp_path / "markers")


def start(processes: Processes, project: CeleryProject, markers: Markers, name: str,
          queues: str = "celery", **env: str) -> Process:
    """A prefork worker of two processes named ``<name>@tests`` (``-n``, as deployed)."""
    return processes.start(f"{name}-{time.monotonic_ns()}",
                           worker_argv(name, queues=queues, concurrency=2),
                           {**project.env(markers.folder), **env},
                           cwd=Path(__file__).parents[2])


def answering(project: CeleryProject, name: str, process: Process) -> None:
    """Wait until the node name answers (a new incarnation is up under it)."""
    broker = CeleryBroker(project.broker_url)
    wait_until(lambda: broker.answers([f"{name}@tests"], ()).answering,
               f"{name}@tests to answer", process=process)


def test_the_dead_incarnations_tasks_are_decided_though_its_name_answers(
        celery_project: CeleryProject, processes: Processes, markers: Markers) -> None:
    """w1 SIGKILLed with its pool and started again as w1: its effectful task fails for the
    caller with our reason and never runs again, its idempotent task is resumed and run by
    the new w1; a task on a second, live worker is never decided and succeeds once."""
    project = celery_project
    effect = send(project, "effect.work")
    idem = send(project, "idem.work", hang=[3600, 0])
    first = start(processes, project, markers, NAME)
    for task in (effect, idem):
        wait_until(lambda t=task: markers.has(f"{t.id}-started-1"), "w1's tasks to start",
                   process=first)
    other = project.caller().send_task("idem.work", kwargs={"hang": [6.0]}, queue="other")
    live = start(processes, project, markers, "w2", queues="other")
    wait_until(lambda: markers.has(f"{other.id}-started-1"), "w2's task to start",
               process=live)

    kill_worker(first)
    again = start(processes, project, markers, NAME)
    answering(project, NAME, again)

    decided: dict[str, tuple[Disposition, Reason]] = {}
    evidence: dict[str, dict[str, object]] = {}
    passes = 0

    def both_decided() -> bool:
        nonlocal passes
        passes += 1
        for outcome in reconcile_once(project.engine, config(project), KINDS):
            assert str(outcome.job_id) != other.id, "the live worker's task was decided"
            if outcome.applied:
                decided[str(outcome.job_id)] = (outcome.disposition, outcome.reason)
                evidence[str(outcome.job_id)] = outcome.evidence
        return {effect.id, idem.id} <= decided.keys()

    wait_until(both_decided, "both of the dead w1's tasks to be decided", timeout=60,
               process=again)
    assert decided == {effect.id: (Disposition.TERMINALIZE, Reason.WORKER_DIED_MID_STEP),
                       idem.id: (Disposition.RESUME, Reason.RESUMED_IDEMPOTENT_STEP)}
    # What the pass saw, in the audit: the name answered, no process held the task.
    owner = evidence[effect.id]["owner"]
    assert isinstance(owner, dict)
    assert (owner["worker_answers"], owner["a_process_holds_it"]) == (True, False)
    assert owner["held_by_none_seconds"] >= TIMEOUT_SECONDS
    assert NAME not in str(evidence[effect.id])  # no worker identity in the evidence
    with pytest.raises(Exception, match="worker_died_mid_step"):
        effect.get(timeout=5)
    assert idem.get(timeout=30) == "done on attempt 2"
    assert markers.of(idem.id) == {"started-1", "started-2", "done-2"}
    assert other.get(timeout=30) == "done on attempt 1"
    assert markers.of(other.id) == {"started-1", "done-1"}
    # The passes go on while the new w1 and w2 work: nothing of theirs is decided.
    for _ in range(3):
        assert [o for o in reconcile_once(project.engine, config(project), KINDS)
                if o.applied] == []
    assert markers.of(effect.id) == {"started-1"}
    assert project.status(effect.id) == "FAILURE"
    assert again.alive()
    assert live.alive()
    record_finding("celery", "reborn_worker", engine=project.engine.dialect.name,
                   passes=passes, decided=sorted(r.value for _, r in decided.values()))


def test_a_task_redelivered_to_the_new_incarnation_is_its_own(
        celery_project: CeleryProject, processes: Processes, markers: Markers) -> None:
    """The control: under ``task_acks_late`` the killed run's message goes back on its queue
    and the new w1 takes it and runs it: the task is held, so no pass decides it."""
    project = celery_project
    late = {"SOURCES_ACKS_LATE": "1", "SOURCES_VISIBILITY_TIMEOUT": str(VISIBILITY_SECONDS)}
    task = send(project, "idem.work")
    first = start(processes, project, markers, NAME, **late)
    wait_until(lambda: markers.has(f"{task.id}-started-1"), "the task to start",
               process=first)
    (markers.folder / f"{task.id}-started-1").unlink()
    kill_worker(first)
    # A pass while the name is silent: the task is noted as held by nobody.
    assert [o for o in reconcile_once(project.engine, config(project), KINDS)
            if o.applied] == []
    again = start(processes, project, markers, NAME, **late)
    answering(project, NAME, again)
    time.sleep(VISIBILITY_SECONDS)  # the message is older than the visibility timeout
    project.restore_unacked(VISIBILITY_SECONDS)
    wait_until(lambda: markers.has(f"{task.id}-started-1"), "the redelivered run to start",
               process=again)
    deadline = time.monotonic() + 3 * TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        assert reconcile_once(project.engine, config(project), KINDS) == []
        time.sleep(PASS_GAP_SECONDS)
    assert project.status(task.id) == "STARTED"
    assert task.id in CeleryBroker(project.broker_url).answers(
        (), (), {task.id: f"{NAME}@tests"}).held
