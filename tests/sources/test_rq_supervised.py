"""RQ workers deployed as teams deploy them: each under a supervisor that starts it again
under its fixed name (``rq worker -n NAME``, systemd ``Restart=always`` with
``RestartSec=10``, ``RestartSteps=2``, ``RestartMaxDelaySec=40``; a pod's container under
Kubernetes' CrashLoopBackOff), ten seconds after it exits, then twenty, then forty while
its starts keep exiting. Real workers over a real Redis, on every engine for the
reconciler's tables.

RQ refuses a worker under a name whose key still exists, so after a SIGKILL the
supervisor's starts fail until the dead worker's key expires (its last heartbeat plus
``job_monitoring_interval`` plus 60 s); the start that then succeeds runs RQ's own
cleanup over the dead worker's started entries first, which fails its jobs
(``AbandonedJobError``), or requeues those with a ``Retry`` left, an effectful one
included. The pass decides on the dead worker's silence, a minute before that: it wins.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from reconciler.core.vocabulary import Disposition, Reason
from tests.sources.rq_support import (
    EFFECTFUL,
    IDEMPOTENT,
    REPO,
    RqProject,
    rq_project,
    sigkill,
    wait_started,
    wait_status,
    worker_argv,
)
from tests.sources.support import (
    Markers,
    Process,
    Processes,
    reconcile_once,
    record_finding,
    wait_until,
)
from tests.sources.test_rq_workers import KINDS, redis_now

__all__ = ["rq_project"]

RESTART_DELAYS = (10.0, 20.0, 40.0)
"""How long a supervisor waits after its worker's exit before it starts it again: the
first delay after a start that ran, the next after each start that exited at once, the
last from then on (systemd's ``RestartSteps``, Kubernetes' CrashLoopBackOff doubling from
10 s, both capped here at 40 s). After a SIGKILL the starts at about 10 s and 30 s are
refused (RQ refuses the name for about 61 s) and the one at about 70 s serves it: two
refused starts per name, each a whole Python interpreter, where a start every 10 s made
six (the chaos run's fixed-name slot restarts every 1.5 s and meets many more)."""
WATCH_SECONDS = 0.5
"""How often a supervisor looks whether its worker has exited (``Popen.poll``)."""
RAN_SECONDS = 15.0
"""A start alive this long counts as one that ran: the delays begin again from the first."""
NAMES = 10
"""Supervised workers, each SIGKILLed once mid-job: ten kills in one minute of waiting."""


@pytest.fixture
def markers(tmp_path: Path) -> Markers:
    return Markers(tmp_path / "markers")


class Supervisor:
    """Keeps ``rq worker -n <name>`` running: starts it again, under the same name,
    ``RESTART_DELAYS`` after each exit (each refused start exits)."""

    def __init__(self, processes: Processes, project: RqProject, markers: Markers,
                 name: str) -> None:
        self.processes, self.project, self.markers, self.name = processes, project, markers, name
        self.current: Process | None = None
        self.starts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"supervise-{name}", daemon=True)

    def start(self) -> Supervisor:
        """The worker's first start, then its restarts after each exit."""
        self._start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        step = 0  # the next delay's index in RESTART_DELAYS
        started = time.monotonic()
        while not self._stop.wait(WATCH_SECONDS):
            current = self.current
            assert current is not None
            if current.alive():
                continue
            ran = time.monotonic() - started >= RAN_SECONDS
            step = 0 if ran else step
            if self._stop.wait(RESTART_DELAYS[step]):
                return
            step = min(step + 1, len(RESTART_DELAYS) - 1)
            started = time.monotonic()
            self._start()

    def _start(self) -> None:
        self.starts += 1
        self.current = self.processes.start(
            f"{self.name}-start-{self.starts}",
            worker_argv(self.project, self.name, (self.name,)),
            {"SOURCES_MARKERS": str(self.markers.folder)}, cwd=REPO)

    def running(self) -> Process:
        """The start that is up now (after a kill: the successor under the same name)."""
        current = self.current
        assert current is not None
        return current


def successor_registered(project: RqProject, supervisor: Supervisor, killed: Process) -> bool:
    """Whether RQ lists a worker under the supervisor's name whose pid is a later start's,
    alive: the name is served again (a refused start exits, so a start that is merely
    alive for an instant does not count)."""
    current = supervisor.running()
    if current is killed or not current.alive():
        return False
    key = f"rq:worker:{supervisor.name}"
    return project.redis().hget(key, "pid") == str(current.pid).encode()


def decide_all(project: RqProject, jobs: set[str]) -> dict[str, tuple[Disposition, Reason,
                                                                       float]]:
    """Passes every half second until each of ``jobs`` is decided: how, and when on
    Redis's clock."""
    decided: dict[str, tuple[Disposition, Reason, float]] = {}
    deadline = time.monotonic() + 120
    while set(decided) != jobs:
        assert time.monotonic() < deadline, f"undecided: {jobs - set(decided)}"
        for outcome in reconcile_once(project.engine, project.config(), KINDS):
            if outcome.applied:
                decided[str(outcome.job_id)] = (outcome.disposition, outcome.reason,
                                                redis_now(project))
        time.sleep(0.5)
    return decided


def test_a_supervised_fixed_name_worker_never_gets_its_dead_predecessors_jobs(
        rq_project: RqProject, processes: Processes, markers: Markers) -> None:
    """Ten supervised workers, each SIGKILLed with its work horse mid-job (five effectful
    jobs and five idempotent ones, every one with a ``Retry(max=2)``): each job is decided
    before its entry expires; the effectful ones fail with our reason and never run again
    (RQ's cleanup in the successor finds nothing to requeue), the idempotent ones are
    resumed and finished by the successor under the same name."""
    names = [f"fixed-{i}-{time.monotonic_ns() % 10**6}" for i in range(NAMES)]
    jobs = {name: rq_project.enqueue(EFFECTFUL if i % 2 == 0 else IDEMPOTENT, queue=name,
                                     retry=2, hang=[3600, 0])
            for i, name in enumerate(names)}
    effectful = {jobs[n] for i, n in enumerate(names) if i % 2 == 0}
    supervisors = {name: Supervisor(processes, rq_project, markers, name).start()
                   for name in names}
    try:
        for name, job_id in jobs.items():
            wait_started(markers, job_id, supervisors[name].running())
        killed = {name: supervisors[name].running() for name in names}
        for worker in killed.values():
            sigkill(worker)
        expiry = {job_id: rq_project.entry_score(job_id, name) for name, job_id in jobs.items()}

        decided = decide_all(rq_project, set(jobs.values()))
        for job_id, (_, _, at) in decided.items():
            left = expiry[job_id]
            assert left is not None
            assert at < left, f"{job_id} was decided after RQ's own entry expired"
        assert {j: d[:2] for j, d in decided.items()} == {
            j: ((Disposition.TERMINALIZE, Reason.WORKER_DIED_MID_STEP) if j in effectful
                else (Disposition.RESUME, Reason.RESUMED_IDEMPOTENT_STEP))
            for j in jobs.values()}

        # The supervisors' starts succeed once the dead workers' keys expire; each
        # successor runs RQ's cleanup, then the resumed job of its queue.
        for name, job_id in jobs.items():
            if job_id not in effectful:
                wait_status(rq_project, job_id, "finished", timeout=150,
                            worker=supervisors[name].running())
        # Each name is served again by a later start, the one RQ now lists under it.
        for name in names:
            wait_until(lambda name=name: successor_registered(rq_project, supervisors[name],
                                                                killed[name]),
                       f"a successor registered as {name}", timeout=150)
    finally:
        for supervisor in supervisors.values():
            supervisor.stop()

    for job_id in jobs.values():
        job = rq_project.job(job_id)
        results = [r.exc_string or "" for r in job.results()]
        assert not any("AbandonedJobError" in r for r in results), (job_id, results)
        if job_id in effectful:
            assert job.get_status().value == "failed"
            assert job.retries_left == 2  # RQ's cleanup never used its Retry
            assert "reconciler: worker_died_mid_step" in results[0]
            assert markers.of(job_id) == {"started-1"}
        else:
            assert job.return_value() == "done on attempt 2"
            assert markers.of(job_id) == {"started-1", "started-2", "done-2"}
    record_finding("rq", "supervised_fixed_names", engine=rq_project.engine.dialect.name,
                   kills=NAMES,
                   refused_starts=sum(s.starts for s in supervisors.values()) - 2 * NAMES,
                   seconds_before_rqs_expiry=sorted(round(float(expiry[j] or 0) - d[2], 1)
                                                    for j, d in decided.items()))
