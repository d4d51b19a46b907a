"""Real ``rq worker`` processes over a real Redis, SIGKILLed mid-job, recovered by the rq
source with the reconciler's own tables on SQLite and PostgreSQL; another live worker of
the same queue runs beside them (RQ's own maintenance included).

A dead worker's heartbeat is overdue a second after its last renewal
(``--job-monitoring-interval 1``), its started-registry entry expires 60 s after that
(the fixed 60 s RQ adds), and the source decides in between, once the heartbeat is
``session_timeout_seconds`` (2 s here) overdue: ``TestRealSilence`` waits for that in real
time, decisions made before RQ's entries expire. The others age the entry's score and
drop the dead worker's key in Redis, as the minute would (``expire_as_time_would``), and
say so.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import zlib
from dataclasses import replace
from pathlib import Path

import pytest

from reconciler.config.loader import pass_config
from reconciler.core.kinds import KindRule, KindRules
from reconciler.core.passes import PassReport, apply_and_record, plan_changes, run_pass
from reconciler.core.ports import RecordedDecision
from reconciler.core.vocabulary import Disposition, EffectKind, LivenessDoubt, Reason
from reconciler.root.cli import assemble_cli
from reconciler.sources.rq import RqConfig
from tests.cli_runner import run_main
from tests.sources.celery_support import worker_tree
from tests.sources.rq_support import (
    EFFECTFUL,
    IDEMPOTENT,
    REPO,
    RqProject,
    rq_project,
    sigkill,
    start_worker,
    wait_started,
    wait_status,
)
from tests.sources.support import (
    Markers,
    Outcome,
    Process,
    Processes,
    by_job,
    config_for,
    reconcile_once,
    record_finding,
    wait_until,
)

__all__ = ["rq_project"]

KINDS = KindRules([KindRule("tests.sources.rq_tasks.idem_*", effect=EffectKind.IDEMPOTENT)],
                  stale_after_seconds=0.5, wedged_after_seconds=3600.0, max_attempts=3,
                  crash_loop_after=2)


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
        # A new worker of the queue runs what comes after it, never it again.
        second = start_worker(processes, rq_project, markers, "worker-b")
        after = rq_project.enqueue(IDEMPOTENT, hang=[0])
        wait_status(rq_project, after, "finished", worker=second)
        assert markers.of(job_id) == {"started-1"}


class TestDependents:
    def test_a_failed_jobs_dependents_are_left_as_rq_leaves_them(
            self, rq_project: RqProject, processes: Processes, markers: Markers) -> None:
        """One that allows its dependency to fail is queued and run by the next worker;
        one that does not stays deferred (RQ's ``enqueue_dependents`` after a failure)."""
        from rq.job import Dependency  # noqa: PLC0415

        job_id = rq_project.enqueue(EFFECTFUL)
        queue = rq_project.queue()
        allowed = queue.enqueue(IDEMPOTENT, kwargs={"hang": [0]}, depends_on=Dependency(
            jobs=[job_id], allow_failure=True)).id
        waiting = queue.enqueue(IDEMPOTENT, kwargs={"hang": [0]}, depends_on=job_id).id
        worker = start_worker(processes, rq_project, markers, "worker-a")
        wait_started(markers, job_id, worker)
        sigkill(worker)
        rq_project.expire_as_time_would(job_id, worker)
        outcome = by_job(reconcile_once(rq_project.engine, rq_project.config(), KINDS))[job_id]
        assert outcome.reason is Reason.WORKER_DIED_MID_STEP
        assert (rq_project.status(allowed), rq_project.status(waiting)) == ("queued",
                                                                            "deferred")
        assert waiting in queue.deferred_job_registry.get_job_ids()
        second = start_worker(processes, rq_project, markers, "worker-b")
        wait_status(rq_project, allowed, "finished", worker=second)
        assert rq_project.status(waiting) == "deferred"
        assert markers.of(job_id) == {"started-1"}


def live_job(project: RqProject, processes: Processes, markers: Markers,
             name: str = "worker-live") -> tuple[str, Process]:
    """A job running on a live worker of the same queue (its entry renewed every second),
    started before the job under test so that worker is busy with it."""
    job_id = project.enqueue(IDEMPOTENT)
    worker = start_worker(processes, project, markers, name)
    wait_started(markers, job_id, worker)
    return job_id, worker


def decide_then_apply(project: RqProject, kinds: KindRules, wait: float
                      ) -> list[RecordedDecision]:
    """One pass's transaction that decides, waits ``wait`` seconds (other workers go on
    renewing their entries meanwhile), then applies and records."""
    config = config_for(project.engine, project.config(), kinds)
    settings = replace(pass_config(config.settings, "rq-test", kinds), brake=None)
    store = assemble_cli(config, engine=project.engine).passes
    with store.pass_transaction(dry_run=False) as tx:
        planned = plan_changes(tx.jobs.candidates(100, settings.thresholds, None), settings)
        time.sleep(wait)
        _, recorded = apply_and_record(tx, settings.instance, planned)
    return recorded


def a_pass(project: RqProject, source: RqConfig | None = None) -> PassReport:
    """One real pass, its report (the brake left out, as in ``reconcile_once``)."""
    config = config_for(project.engine, source or project.config(), KINDS)
    return run_pass(assemble_cli(config, engine=project.engine).passes,
                    replace(pass_config(config.settings, "rq-test", KINDS), brake=None))


class TestBesideLiveWorkers:
    """A live worker of the same queue keeps running (RQ's own maintenance ran at its
    start and runs again every 10 minutes) while a dead worker's job is recovered."""

    def test_a_live_job_is_untouched_and_its_heartbeats_never_fail_anothers_fence(
            self, rq_project: RqProject, processes: Processes, markers: Markers) -> None:
        running, live = live_job(rq_project, processes, markers)
        job_id = rq_project.enqueue(IDEMPOTENT, hang=[3600, 0])
        dead = start_worker(processes, rq_project, markers, "worker-a")
        wait_started(markers, job_id, dead)
        sigkill(dead)
        rq_project.expire_as_time_would(job_id, dead)
        renewed = rq_project.entry_score(running)
        # Decided, then applied 2.5 s later: the live worker renewed its own entry in the
        # same started registry (a sorted set both entries share) at least twice.
        recorded = {d.job_id: d for d in decide_then_apply(rq_project, KINDS, wait=2.5)}
        assert rq_project.entry_score(running) != renewed
        assert (recorded[job_id].disposition, recorded[job_id].reason) == (
            Disposition.RESUME, Reason.RESUMED_IDEMPOTENT_STEP)
        assert running not in recorded
        assert rq_project.status(running) == "started"
        assert live.alive()
        assert rq_project.status(job_id) == "queued"

    def test_a_renewed_entry_fails_the_fence_and_changes_nothing(
            self, rq_project: RqProject, processes: Processes, markers: Markers) -> None:
        """The job's own worker renews it between the decision and the write (as a
        paused worker that wakes does): fence lost, the job as its worker left it."""
        job_id = rq_project.enqueue(IDEMPOTENT, hang=[3600, 0])
        worker = start_worker(processes, rq_project, markers, "worker-a")
        wait_started(markers, job_id, worker)
        worker.signal(signal.SIGSTOP)
        for process in worker_tree(worker)[:-1]:
            os.kill(process, signal.SIGSTOP)
        client = rq_project.redis()
        seconds, _ = client.time()
        [(member, _)] = [(m, s) for m, s in client.zrange("rq:wip:default", 0, -1,
                                                          withscores=True)
                         if m.decode().startswith(job_id)]
        client.zadd("rq:wip:default", {member: float(seconds) - 1})
        client.delete(f"rq:worker:{worker.name}")
        config = config_for(rq_project.engine, rq_project.config(), KINDS)
        settings = replace(pass_config(config.settings, "rq-test", KINDS), brake=None)
        store = assemble_cli(config, engine=rq_project.engine).passes
        with store.pass_transaction(dry_run=False) as tx:
            planned = plan_changes(tx.jobs.candidates(100, settings.thresholds, None),
                                   settings)
            assert [p.decision.disposition for p in planned] == [Disposition.RESUME]
            worker.signal(signal.SIGCONT)  # it wakes and renews its entry at once
            for process in worker_tree(worker)[:-1]:
                os.kill(process, signal.SIGCONT)
            wait_until(lambda: (rq_project.entry_score(job_id) or 0) > seconds,
                       "the woken worker to renew its entry", process=worker)
            _, recorded = apply_and_record(tx, settings.instance, planned)
        assert [(d.disposition, d.reason) for d in recorded] == [(Disposition.SKIP,
                                                                   Reason.FENCE_LOST)]
        assert rq_project.status(job_id) == "started"
        assert markers.of(job_id) == {"started-1"}


def pause(worker: Process, sig: signal.Signals) -> None:
    """SIGSTOP or SIGCONT the worker and its work horse (a frozen VM, a long pause)."""
    for pid in [*worker_tree(worker)[:-1], worker.pid]:
        os.kill(pid, sig)


class TestLateWriter:
    def test_a_paused_worker_that_wakes_after_the_decision(
            self, rq_project: RqProject, processes: Processes, markers: Markers) -> None:
        """Workers paused mid-job past their entries' expiry (aged here as that minute
        would), decided, then woken: RQ's own end of the run lands over our decision (it
        fences on nothing): the failed job reads ``finished``; the resumed one runs a
        second time."""
        failed = rq_project.enqueue(EFFECTFUL, hang=[2])
        resumed = rq_project.enqueue(IDEMPOTENT, queue="other", hang=[2, 0])
        first = start_worker(processes, rq_project, markers, "worker-a")
        second = start_worker(processes, rq_project, markers, "worker-b", ("other",))
        wait_started(markers, failed, first)
        wait_started(markers, resumed, second)
        for worker, queue in ((first, "default"), (second, "other")):
            pause(worker, signal.SIGSTOP)
            client = rq_project.redis()
            seconds, _ = client.time()
            for member, _ in client.zrange(f"rq:wip:{queue}", 0, -1, withscores=True):
                client.zadd(f"rq:wip:{queue}", {member: float(seconds) - 1})
            client.delete(f"rq:worker:{worker.name}")
        decided = by_job(reconcile_once(rq_project.engine, rq_project.config(), KINDS))
        assert decided[failed].reason is Reason.WORKER_DIED_MID_STEP
        assert decided[resumed].reason is Reason.RESUMED_IDEMPOTENT_STEP
        pause(first, signal.SIGCONT)
        pause(second, signal.SIGCONT)
        wait_status(rq_project, failed, "finished", worker=first)
        # The woken worker ends its own run, then pops the resumed job off its queue and
        # runs it again: twice in all (the paused run and the resumed one), never more.
        wait_until(lambda: markers.has(f"{resumed}-done-2"), "the resumed run", process=second)
        wait_status(rq_project, resumed, "finished", worker=second)
        record_finding("rq", "late_writer", engine=rq_project.engine.dialect.name,
                       failed_reads=rq_project.status(failed),
                       resumed_runs=sorted(markers.of(resumed)))
        assert markers.of(failed) == {"started-1", "done-1"}
        assert markers.of(resumed) == {"started-1", "done-1", "started-2", "done-2"}
        assert rq_project.job(resumed).return_value() == "done on attempt 2"


class TestCrashLoop:
    def test_a_job_lost_twice_ends_crash_loop(
            self, rq_project: RqProject, processes: Processes, markers: Markers) -> None:
        job_id = rq_project.enqueue(IDEMPOTENT, hang=[3600, 3600, 0])
        for attempt, name in ((1, "worker-a"), (2, "worker-b")):
            worker = start_worker(processes, rq_project, markers, name)
            wait_started(markers, job_id, worker, attempt)
            sigkill(worker)
            rq_project.expire_as_time_would(job_id, worker)
            outcome = by_job(reconcile_once(rq_project.engine, rq_project.config(),
                                            KINDS))[job_id]
        assert (outcome.disposition, outcome.reason) == (Disposition.TERMINALIZE,
                                                         Reason.CRASH_LOOP)
        job = rq_project.job(job_id)
        assert job.get_status().value == "failed"
        assert "reconciler: crash_loop" in (job.latest_result().exc_string or "")
        assert markers.of(job_id) == {"started-1", "started-2"}


class TestUndecidable:
    def test_a_job_whose_kind_cannot_be_read_is_a_reconcile_error(
            self, rq_project: RqProject, processes: Processes, markers: Markers) -> None:
        """A payload that is not RQ's tuple in the app's serializer (here: bytes no
        serializer wrote) is never unpickled: reconcile_error, the job left alone."""
        job_id = rq_project.enqueue(EFFECTFUL)
        worker = start_worker(processes, rq_project, markers, "worker-a")
        wait_started(markers, job_id, worker)
        sigkill(worker)
        rq_project.expire_as_time_would(job_id, worker)
        rq_project.redis().hset(f"rq:job:{job_id}", "data", zlib.compress(b"\x80\x05K\x01."))
        outcome = by_job(reconcile_once(rq_project.engine, rq_project.config(), KINDS))[job_id]
        assert (outcome.disposition, outcome.reason) == (Disposition.SKIP,
                                                         Reason.RECONCILE_ERROR)
        assert outcome.evidence.get("error_code") == "unreadable_kind"
        assert rq_project.status(job_id) == "started"

    def test_redis_down_decides_nothing_and_says_which_store(
            self, rq_project: RqProject, processes: Processes, markers: Markers) -> None:
        job_id = rq_project.enqueue(EFFECTFUL)
        worker = start_worker(processes, rq_project, markers, "worker-a")
        wait_started(markers, job_id, worker)
        sigkill(worker)
        rq_project.expire_as_time_would(job_id, worker)
        with socket.socket() as unused:
            unused.bind(("127.0.0.1", 0))
            port = unused.getsockname()[1]
        down = a_pass(rq_project, rq_project.config(
            redis_url=f"redis://:secret@127.0.0.1:{port}/0"))
        assert down.decisions == ()
        assert down.liveness is not None
        assert down.liveness.code is LivenessDoubt.BROKER_UNREACHABLE
        assert f"127.0.0.1:{port}" in down.liveness.where
        assert "secret" not in down.liveness.where
        # Another database number: holding another app's keys, not the app's Redis; empty,
        # an app that has not run yet there, with nothing to decide and nothing in doubt.
        other = replace(rq_project, redis_url=rq_project.redis_url.rsplit("/", 1)[0] + "/5")
        other.redis().set("session:someone-else", "1")
        wrong = a_pass(rq_project, other.config())
        assert wrong.liveness is not None
        assert wrong.liveness.code is LivenessDoubt.QUEUES_MISSING
        other.redis().flushdb()
        empty = a_pass(rq_project, other.config())
        assert (empty.liveness, empty.decisions) == (None, ())
        assert rq_project.status(job_id) == "started"
        # The next pass, on the app's Redis, carries on.
        back = a_pass(rq_project)
        assert back.liveness is None
        assert [(d.job_id, d.reason) for d in back.decisions] == [
            (job_id, Reason.WORKER_DIED_MID_STEP)]


class TestRealSilence:
    """Nothing aged by hand: two workers SIGKILLed at once beside a live one, and passes
    every second until the dead workers' heartbeats are ``session_timeout_seconds`` overdue,
    which is a minute before RQ's own entries expire (and before a successor under the same
    name could start and run RQ's cleanup over them)."""

    def test_all_outcomes_before_rqs_own_expiry(
            self, rq_project: RqProject, processes: Processes, markers: Markers) -> None:
        running, live = live_job(rq_project, processes, markers)
        idem = rq_project.enqueue(IDEMPOTENT, retry=2, hang=[3600, 0])
        effect = rq_project.enqueue(EFFECTFUL, queue="other")
        first = start_worker(processes, rq_project, markers, "worker-a")
        wait_started(markers, idem, first)
        second = start_worker(processes, rq_project, markers, "worker-b", ("other",))
        wait_started(markers, effect, second)
        sigkill(first)
        sigkill(second)
        # When RQ's own entries expire (nothing renews them now), on Redis's clock.
        expiry = {idem: rq_project.entry_score(idem),
                  effect: rq_project.entry_score(effect, "other")}
        decided: dict[str, Outcome] = {}
        decided_at: dict[str, float] = {}

        def both() -> bool:
            for outcome in reconcile_once(rq_project.engine, rq_project.config(), KINDS):
                if outcome.applied:
                    decided[str(outcome.job_id)] = outcome
                    decided_at.setdefault(str(outcome.job_id), redis_now(rq_project))
            time.sleep(0.5)
            return {idem, effect} <= set(decided)

        wait_until(both, "the dead workers' heartbeats to be overdue", timeout=150)
        for job_id, at in decided_at.items():
            left = expiry[job_id]
            assert left is not None
            assert at < left, f"{job_id} was decided only after RQ's own entry expired"
        assert (decided[idem].disposition, decided[idem].reason) == (
            Disposition.RESUME, Reason.RESUMED_IDEMPOTENT_STEP)
        assert (decided[effect].disposition, decided[effect].reason) == (
            Disposition.TERMINALIZE, Reason.WORKER_DIED_MID_STEP)
        assert running not in decided
        assert rq_project.status(running) == "started"
        assert live.alive()
        assert rq_project.job(idem).retries_left == 1  # one of its Retry(max=2) used
        failed = rq_project.job(effect)
        assert failed.get_status().value == "failed"
        assert "reconciler: worker_died_mid_step" in (failed.latest_result().exc_string or "")
        third = start_worker(processes, rq_project, markers, "worker-c")
        wait_status(rq_project, idem, "finished", worker=third)
        assert rq_project.job(idem).return_value() == "done on attempt 2"
        assert markers.of(effect) == {"started-1"}
        record_finding("rq", "decided_before_expiry", engine=rq_project.engine.dialect.name,
                       seconds_before_rqs_expiry=sorted(
                           round(float(expiry[j] or 0) - at, 1) for j, at in decided_at.items()))


def redis_now(project: RqProject) -> float:
    """Redis's clock (``TIME``), the one RQ scores its entries on."""
    seconds, micros = project.redis().time()
    return float(seconds) + float(micros) / 1e6


def test_the_command_line_reads_rq(rq_project: RqProject, processes: Processes,
                                   markers: Markers, tmp_path: Path) -> None:
    """``reconciler kinds``, ``jobs explain`` and ``pass --json`` over a config file, as an
    operator runs them: the kinds running, what a pass would decide, then the pass."""
    job_id = rq_project.enqueue(EFFECTFUL)
    worker = start_worker(processes, rq_project, markers, "worker-a")
    wait_started(markers, job_id, worker)
    sigkill(worker)
    rq_project.expire_as_time_would(job_id, worker)
    config = tmp_path / "reconciler.toml"
    config.write_text(
        f'database_url = "{rq_project.engine.url.render_as_string(hide_password=False)}"\n'
        f'session_timeout_seconds = 2\nsession_heartbeat_seconds = 0.5\n'
        f'stale_after_seconds = 0.5\n\n'
        f'[source]\nkind = "rq"\nredis_url = "{rq_project.redis_url}"\n'
        f'queues = ["default"]\n')

    def cli(*argv: str) -> str:
        done = run_main([*argv, "--config", str(config)], cwd=REPO, timeout=120)
        assert done.returncode in (0, 6), done.stderr
        return done.stdout

    assert EFFECTFUL in cli("kinds")
    assert "worker_died_mid_step" in cli("jobs", "explain", job_id)
    report = json.loads(cli("pass", "--json"))
    assert [(d["job_id"], d["reason"]) for d in report["decisions"]] == [
        (job_id, "worker_died_mid_step")]
    assert rq_project.status(job_id) == "failed"
