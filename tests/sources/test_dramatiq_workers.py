"""Real ``dramatiq`` worker processes over a real Redis, SIGKILLed mid-message, recovered
by the dramatiq source with the reconciler's own tables on SQLite and PostgreSQL.

A killed worker's heartbeat stands still from its death, and each pass times it on
Redis's clock: the source decides once it has seen it still for the session timeout (2 s
here), so every test passes until the decision it waits for is recorded
(``reconcile_until``). Dramatiq's own maintenance would put the message back 60 s after the
worker's last heartbeat (its default ``heartbeat_timeout``), later than any of these.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from reconciler.core.kinds import KindRule, KindRules
from reconciler.core.vocabulary import Disposition, EffectKind, LivenessDoubt, Reason
from reconciler.root.cli import assemble_cli
from tests.sources.celery_support import worker_tree
from tests.sources.dramatiq_support import (
    DramatiqProject,
    dramatiq_project,
    reconcile_until,
    result_after,
    result_of,
    sigkill,
    start_worker,
    wait_started,
)
from tests.sources.support import (
    Markers,
    Outcome,
    Processes,
    by_job,
    config_for,
    explain,
    reconcile_once,
    wait_until,
)

__all__ = ["dramatiq_project"]

KINDS = KindRules([KindRule("idem_*", effect=EffectKind.IDEMPOTENT)],
                  stale_after_seconds=0.5, wedged_after_seconds=3600.0, max_attempts=3,
                  crash_loop_after=2)


@pytest.fixture
def markers(tmp_path: Path) -> Markers:
    return Markers(tmp_path / "markers")


def decided(message_id: str) -> object:
    """A ``reconcile_until`` condition: the message decided (not skipped)."""
    def check(outcomes: Sequence[Outcome]) -> bool:
        found = by_job(outcomes).get(message_id)
        return found is not None and found.disposition is not Disposition.SKIP
    return check


class TestKilledWorker:
    def test_idempotent_message_is_resumed_and_finished_by_a_new_worker(
            self, dramatiq_project: DramatiqProject, processes: Processes,
            markers: Markers) -> None:
        message = dramatiq_project.send("idem_work", hang=[3600, 0])
        first = start_worker(processes, dramatiq_project, markers, "worker-a")
        wait_started(markers, message.message_id, first)
        sigkill(first)
        outcomes = reconcile_until(dramatiq_project, KINDS, decided(message.message_id),
                                   "the killed worker's message to be decided")
        outcome = by_job(outcomes)[message.message_id]
        assert (outcome.disposition, outcome.reason) == (Disposition.RESUME,
                                                         Reason.RESUMED_IDEMPOTENT_STEP)
        [stored] = dramatiq_project.messages().values()
        assert stored["options"]["retries"] == 1  # a resume counts, as a failure would
        second = start_worker(processes, dramatiq_project, markers, "worker-b")
        assert result_after(markers, message, 2) == "done on attempt 2"
        assert markers.of(message.message_id) == {"started-1", "started-2", "done-2"}
        del second

    def test_effectful_message_is_dead_lettered_with_our_reason_and_its_result_raises(
            self, dramatiq_project: DramatiqProject, processes: Processes,
            markers: Markers) -> None:
        from dramatiq.results import ResultFailure  # noqa: PLC0415

        message = dramatiq_project.send("effect_work")
        first = start_worker(processes, dramatiq_project, markers, "worker-a")
        wait_started(markers, message.message_id, first)
        sigkill(first)
        outcomes = reconcile_until(dramatiq_project, KINDS, decided(message.message_id),
                                   "the killed worker's message to be decided")
        outcome = by_job(outcomes)[message.message_id]
        assert (outcome.disposition, outcome.reason) == (Disposition.TERMINALIZE,
                                                         Reason.WORKER_DIED_MID_STEP)
        [dead] = dramatiq_project.dead_lettered().values()
        assert dead["message_id"] == message.message_id
        assert dead["options"]["reconciler_reason"] == "worker_died_mid_step"
        assert dramatiq_project.messages() == {}
        with pytest.raises(ResultFailure, match="worker_died_mid_step"):
            message.get_result(block=True, timeout=1_000)
        # A new worker runs what comes after it, never it again.
        start_worker(processes, dramatiq_project, markers, "worker-b")
        after = dramatiq_project.send("idem_work", hang=[0])
        assert result_after(markers, after, 1) == "done on attempt 1"
        assert markers.of(message.message_id) == {"started-1"}

    def test_a_prefetched_message_that_never_started_is_put_back_and_runs_once(
            self, dramatiq_project: DramatiqProject, processes: Processes,
            markers: Markers) -> None:
        """One thread, a prefetch of two: the second message waits in the worker's acks
        set, fetched and never started, when the worker dies; effectful, it still goes
        back as it was and runs once."""
        running = dramatiq_project.send("effect_work")
        waiting = dramatiq_project.send("effect_work", hang=[0])
        first = start_worker(processes, dramatiq_project, markers, "worker-a", threads=1,
                             prefetch=2)
        wait_started(markers, running.message_id, first)
        wait_until(lambda: dramatiq_project.queued() == [], "the second to be prefetched")
        sigkill(first)
        outcomes = reconcile_until(dramatiq_project, KINDS, decided(waiting.message_id),
                                   "the prefetched message to be decided")
        put_back = by_job(outcomes)[waiting.message_id]
        assert (put_back.disposition, put_back.reason) == (
            Disposition.RESUME, Reason.RESUMED_FROM_UNSTARTED_STEP)
        assert by_job(outcomes)[running.message_id].reason is Reason.WORKER_DIED_MID_STEP
        [stored] = dramatiq_project.messages().values()
        assert stored["options"].get("retries", 0) == 0  # it never ran: nothing counted
        start_worker(processes, dramatiq_project, markers, "worker-b")
        assert result_after(markers, waiting, 1) == "done on attempt 1"
        assert markers.of(waiting.message_id) == {"started-1", "done-1"}

    def test_a_poison_message_ends_crash_loop_after_killing_two_workers(
            self, dramatiq_project: DramatiqProject, processes: Processes,
            markers: Markers) -> None:
        message = dramatiq_project.send("idem_poison")
        for attempt, name in ((1, "worker-a"), (2, "worker-b")):
            worker = start_worker(processes, dramatiq_project, markers, name)
            wait_started(markers, message.message_id, worker, attempt=attempt)
            sigkill(worker)  # what is left of it: the message killed its worker process
            outcomes = reconcile_until(dramatiq_project, KINDS, decided(message.message_id),
                                       f"the message to be decided after kill {attempt}")
        outcome = by_job(outcomes)[message.message_id]
        assert (outcome.disposition, outcome.reason) == (Disposition.TERMINALIZE,
                                                         Reason.CRASH_LOOP)
        [dead] = dramatiq_project.dead_lettered().values()
        assert dead["options"]["reconciler_reason"] == "crash_loop"
        assert markers.of(message.message_id) == {"started-1", "started-2"}


class TestLiveWorker:
    def test_a_long_message_with_its_prefetch_full_is_left_alone(
            self, dramatiq_project: DramatiqProject, processes: Processes,
            markers: Markers) -> None:
        """One thread on a long message and its prefetch full: the worker still sends
        commands (its delay queue's polls), so passes over many session timeouts decide
        nothing."""
        running = dramatiq_project.send("effect_work", hang=[3600])
        dramatiq_project.send("effect_work", hang=[0])
        worker = start_worker(processes, dramatiq_project, markers, "worker-a", threads=1,
                              prefetch=2)
        wait_started(markers, running.message_id, worker)
        wait_until(lambda: dramatiq_project.queued() == [], "the second to be prefetched")
        redis = dramatiq_project.redis()
        start = float(redis.time()[0])
        passes = 0
        while float(redis.time()[0]) - start < 5 * 2.0:  # five session timeouts, on Redis
            assert [o for o in reconcile_once(dramatiq_project.engine,
                                          dramatiq_project.config(), KINDS)
                if o.disposition is not Disposition.SKIP] == []
            passes += 1
        assert passes >= 2
        assert worker.alive()


class TestWithoutTheMiddleware:
    def test_nothing_is_decided_and_the_pass_says_why_in_one_line(
            self, dramatiq_project: DramatiqProject, processes: Processes,
            markers: Markers) -> None:
        message = dramatiq_project.send("effect_work")
        worker = start_worker(processes, dramatiq_project, markers, "worker-a",
                              middleware=False)
        wait_started(markers, message.message_id, worker)
        sigkill(worker)
        config = config_for(dramatiq_project.engine, dramatiq_project.config(), KINDS)
        passes = assemble_cli(config, engine=dramatiq_project.engine).passes

        def doubted() -> bool:
            from reconciler.config.loader import pass_config  # noqa: PLC0415
            from reconciler.core.passes import run_pass  # noqa: PLC0415

            report = run_pass(passes, pass_config(config.settings, "t", KINDS))
            assert report.decisions == ()
            unknown = report.liveness
            return unknown is not None and unknown.code is LivenessDoubt.MIDDLEWARE_MISSING

        wait_until(doubted, "the pass to doubt the gone worker's messages")
        assert len(dramatiq_project.messages()) == 1  # left where Dramatiq keeps it


class TestDramatiqsOwnMaintenance:
    def test_a_message_its_maintenance_put_back_first_is_left_alone_fence_lost(
            self, dramatiq_project: DramatiqProject, processes: Processes,
            markers: Markers) -> None:
        """Decided, then Dramatiq's own maintenance (its real broker, every command
        maintaining, the dead worker past its heartbeat_timeout) puts the message back
        before the move: the move changes nothing and is recorded ``fence_lost``."""
        from dramatiq.brokers.redis import MAINTENANCE_SCALE, RedisBroker  # noqa: PLC0415

        from tests.conformance.foreign import ForeignFixture  # noqa: PLC0415

        message = dramatiq_project.send("effect_work")
        worker = start_worker(processes, dramatiq_project, markers, "worker-a")
        wait_started(markers, message.message_id, worker)
        sigkill(worker)
        race = ForeignFixture(dramatiq_project.engine, dramatiq_project.config())
        race.kinds = KINDS

        def maintenance() -> None:
            broker = RedisBroker(url=dramatiq_project.redis_url, heartbeat_timeout=1,
                                 maintenance_chance=MAINTENANCE_SCALE)
            broker.do_qsize("default")

        def due() -> bool:
            found = explain(dramatiq_project.engine, dramatiq_project.config(), KINDS,
                            [message.message_id]).get(message.message_id)
            return found is not None and found.disposition is not Disposition.SKIP

        wait_until(due, "the killed worker's message to be due")
        interrupted = race.run_interrupted_pass(maintenance)
        assert [(str(d.job_id), d.reason) for d in interrupted.decided] == [
            (message.message_id, Reason.WORKER_DIED_MID_STEP)]
        assert [(str(d.job_id), d.reason) for d in interrupted.report.decisions] == [
            (message.message_id, Reason.FENCE_LOST)]
        assert dramatiq_project.dead_lettered() == {}
        assert len(dramatiq_project.queued()) == 1  # where Dramatiq's maintenance put it


class TestPausedWorker:
    def test_a_prefetched_message_put_back_is_skipped_when_its_paused_worker_wakes(
            self, dramatiq_project: DramatiqProject, processes: Processes,
            markers: Markers) -> None:
        """A worker SIGSTOPped (a frozen VM) past the timeout with one message running and
        one prefetched: the running one is dead-lettered, the prefetched one put back and
        run by another worker; the paused worker, woken, finishes its run (the late
        writer) and skips the message taken back: it ran once."""
        import signal  # noqa: PLC0415

        running = dramatiq_project.send("effect_work", hang=[4.0])
        waiting = dramatiq_project.send("effect_work", hang=[0])
        paused = start_worker(processes, dramatiq_project, markers, "worker-a", threads=1,
                              prefetch=2)
        wait_started(markers, running.message_id, paused)
        wait_until(lambda: dramatiq_project.queued() == [], "the second to be prefetched")
        for pid in worker_tree(paused):
            os.kill(pid, signal.SIGSTOP)
        try:
            reconcile_until(dramatiq_project, KINDS, decided(waiting.message_id),
                            "the paused worker's messages to be decided")
            other = start_worker(processes, dramatiq_project, markers, "worker-b")
            wait_until(lambda: markers.has(f"{waiting.message_id}-done-1"),
                       "the put-back message to run", process=other)
        finally:
            for pid in worker_tree(paused):
                os.kill(pid, signal.SIGCONT)
        wait_until(lambda: markers.has(f"{running.message_id}-done-1"),
                   "the woken worker to finish its run", process=paused)
        # The skip is the event: the running message's mark can be cleared before the
        # woken worker reaches its prefetched one (seen under load).
        wait_until(lambda: "skipped" in paused.output() or "taken back" in paused.output(),
                   "the woken worker to skip the message taken back", process=paused)
        wait_until(lambda: dramatiq_project.redis().hlen("dramatiq:__reconciler__.marks")
                   == 0, "the woken worker to be done with both")
        runs = [n for n in markers.names() if n.startswith(f"run-{waiting.message_id}-")]
        assert len(runs) == 1, runs


class TestPutBackThenLost:
    def test_a_put_back_is_no_lost_attempt_for_the_crash_loop_count(
            self, dramatiq_project: DramatiqProject, processes: Processes,
            markers: Markers) -> None:
        """A message prefetched by a worker that dies is put back; its first real run then
        dies too: one lost attempt, resumed, not ``crash_loop`` (found by the chaos long
        run: the put-back was read as the lost attempt before it)."""
        running = dramatiq_project.send("effect_work", hang=[3600])
        waiting = dramatiq_project.send("idem_work", hang=[3600, 0])
        first = start_worker(processes, dramatiq_project, markers, "worker-a", threads=1,
                             prefetch=2)
        wait_started(markers, running.message_id, first)
        wait_until(lambda: dramatiq_project.queued() == [], "the second to be prefetched")
        sigkill(first)
        put_back = by_job(reconcile_until(dramatiq_project, KINDS,
                                          decided(waiting.message_id),
                                          "the prefetched message to be put back"))
        assert put_back[waiting.message_id].reason is Reason.RESUMED_FROM_UNSTARTED_STEP
        second = start_worker(processes, dramatiq_project, markers, "worker-b")
        wait_started(markers, waiting.message_id, second)
        sigkill(second)
        lost = by_job(reconcile_until(dramatiq_project, KINDS, decided(waiting.message_id),
                                      "its first run's loss to be decided"))
        assert lost[waiting.message_id].reason is Reason.RESUMED_IDEMPOTENT_STEP
        third = start_worker(processes, dramatiq_project, markers, "worker-c")
        # The run's own end first (a worker starting under load can outlast a socket's
        # read), then its result, stored as the actor returns.
        wait_until(lambda: markers.has(f"{waiting.message_id}-done-2"),
                   "the resumed run to finish", timeout=60, process=third)
        assert result_of(waiting) == "done on attempt 2"


class TestDelayQueueCopy:
    """What a worker's delay-queue consumer does with a due message, done here with
    Dramatiq's own broker and consumer and the middleware's hooks as the worker calls them:
    fetch it, copy it onto its queue under a new Redis id, then die before acknowledging
    the original. Whichever comes first, the copy's start or the reconciler's decision on
    the original, the message runs once."""

    @staticmethod
    def copied_by_a_dying_worker(project: DramatiqProject) -> Any:
        from dramatiq.brokers.redis import RedisBroker  # noqa: PLC0415

        from reconciler.integrations.dramatiq import ReconcilerMiddleware  # noqa: PLC0415

        message = project.app().effect_work.send_with_options(kwargs={"hang": [0]},
                                                              delay=1)
        dying = RedisBroker(url=project.redis_url)
        dying.add_middleware(ReconcilerMiddleware())
        dying.emit_before("worker_boot", None)
        consumer = dying.consume("default.DQ", prefetch=10, timeout=100)
        fetched = wait_until(lambda: next(consumer), "the delayed message to be fetched")
        dying.emit_before("delay_message", fetched)  # the worker's handle_message
        copy = fetched.copy(queue_name="default")  # the worker's handle_delayed_messages
        del copy.options["eta"]
        dying.enqueue(copy)  # ... and the worker dies before acknowledging the original
        assert len(project.redis().hgetall("dramatiq:default.DQ.msgs")) == 1
        assert len(project.queued()) == 1
        return message

    def test_a_copy_enqueued_again_from_storage_is_an_original_of_its_own(
            self, dramatiq_project: DramatiqProject) -> None:
        """A dead-lettered copy requeued by hand carries its original's id in its stored
        bytes; enqueued again, it is an original of its own (never skipped as a second
        copy of that original): only a worker's copy of a delayed message it holds names
        one."""
        from dramatiq import Message  # noqa: PLC0415
        from dramatiq.brokers.redis import RedisBroker  # noqa: PLC0415

        from reconciler.integrations.dramatiq import ReconcilerMiddleware  # noqa: PLC0415

        broker = RedisBroker(url=dramatiq_project.redis_url)
        broker.add_middleware(ReconcilerMiddleware())
        broker.enqueue(Message(queue_name="default", actor_name="effect_work", args=(),
                               kwargs={}, options={"reconciler_copy_of": "an-original"}))
        [stored] = dramatiq_project.messages().values()
        assert "reconciler_copy_of" not in stored["options"]

    def test_an_original_whose_copy_started_is_dropped_not_put_back(
            self, dramatiq_project: DramatiqProject, processes: Processes,
            markers: Markers) -> None:
        message = self.copied_by_a_dying_worker(dramatiq_project)
        worker = start_worker(processes, dramatiq_project, markers, "worker-a")
        assert result_after(markers, message, 1) == "done on attempt 1"
        outcomes = reconcile_until(dramatiq_project, KINDS, decided(message.message_id),
                                   "the original to be decided")
        assert by_job(outcomes)[message.message_id].reason is (
            Reason.RESUMED_FROM_UNSTARTED_STEP)
        redis = dramatiq_project.redis()
        assert redis.hgetall("dramatiq:default.DQ.msgs") == {}
        assert redis.lrange("dramatiq:default.DQ", 0, -1) == []
        assert worker.alive()
        runs = [n for n in markers.names() if n.startswith(f"run-{message.message_id}-")]
        assert len(runs) == 1, runs

    def test_an_original_put_back_before_its_copy_started_runs_once(
            self, dramatiq_project: DramatiqProject, processes: Processes,
            markers: Markers) -> None:
        """The original put back (its copy's start not seen yet) is copied again by the next
        worker: of the two copies, the first to start runs, the other is skipped, and the
        message's result is the run's."""
        message = self.copied_by_a_dying_worker(dramatiq_project)
        outcomes = reconcile_until(dramatiq_project, KINDS, decided(message.message_id),
                                   "the original to be decided")
        assert by_job(outcomes)[message.message_id].reason is (
            Reason.RESUMED_FROM_UNSTARTED_STEP)
        assert len(dramatiq_project.queued("default.DQ")) == 1  # put back on its delay queue
        worker = start_worker(processes, dramatiq_project, markers, "worker-a")
        assert result_after(markers, message, 1) == "done on attempt 1"
        wait_until(lambda: dramatiq_project.messages() == {} and not
                   dramatiq_project.messages("default.DQ"),
                   "both copies and the original to be acknowledged", timeout=60,
                   process=worker)
        runs = [n for n in markers.names() if n.startswith(f"run-{message.message_id}-")]
        assert len(runs) == 1, runs
        assert message.get_result() == "done on attempt 1"  # not the skipped copy's None
