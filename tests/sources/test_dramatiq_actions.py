"""Operator actions on Dramatiq messages, with real ``dramatiq`` workers over a real
Redis and the reconciler's own tables on SQLite and PostgreSQL: a dead letter retried is
run again by a worker with a fresh budget; a queued message cancelled is dead-lettered
``operator_cancel`` and never run; a fetched one is refused; a held message whose worker
died is left alone until it is unheld. A chunk (the bulk form's) is read in two Redis
round trips and moved in one, each message fenced as one message's action is."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from models import OperatorAction as ActionRow
from reconciler.core.operator_desk import OperatorDesk
from reconciler.core.vocabulary import Disposition, JobKey, OperatorAction, Reason
from reconciler.sources.dramatiq.actions import DramatiqActions
from tests.sources.actions_support import (
    Move,
    desk_for,
    desk_moving_after_read,
    forget_source,
)
from tests.sources.dramatiq_support import (
    DramatiqProject,
    dramatiq_project,
    reconcile_until,
    result_after,
    sigkill,
    start_worker,
    wait_started,
)
from tests.sources.support import Markers, Processes, by_job, reconcile_once, wait_until
from tests.sources.test_dramatiq_workers import KINDS, decided

__all__ = ["dramatiq_project"]

ACTIONS = cast(sa.Table, ActionRow.__table__)
UNKNOWN = "no-such-message"
CHUNK_ROUND_TRIPS = 3
"""A chunk's Redis round trips, whatever its size: its read's two, its moves' one."""


@pytest.fixture
def project(dramatiq_project: DramatiqProject) -> DramatiqProject:
    forget_source(dramatiq_project.engine, "dramatiq")
    return dramatiq_project


@pytest.fixture
def markers(tmp_path: Path) -> Markers:
    return Markers(tmp_path / "markers")


def desk_of(project: DramatiqProject) -> OperatorDesk:
    return desk_for(project.engine, project.config(), KINDS)


def test_a_dead_letter_retried_runs_again_with_a_fresh_budget(
        project: DramatiqProject, processes: Processes, markers: Markers) -> None:
    message = project.send("effect_work", hang=[3600])
    first = start_worker(processes, project, markers, "worker-a")
    wait_started(markers, message.message_id, first)
    sigkill(first)
    reconcile_until(project, KINDS, decided(message.message_id), "the dead letter")
    assert list(project.dead_lettered()) != []
    desk = desk_of(project)
    assert OperatorAction.RETRY in desk.allowed(message.message_id)
    report = desk.act(OperatorAction.RETRY, message.message_id, actor="alice",
                      note="charge checked: not taken")
    assert report.applied, report.line
    assert project.dead_lettered() == {}
    [stored] = project.messages().values()
    assert stored["options"]["retries"] == 0
    assert "reconciler_reason" not in stored["options"]
    # The effect was checked: a new worker runs it again, from its first attempt.
    second = start_worker(processes, project, markers, "worker-b")
    wait_until(lambda: len([n for n in markers.names()
                            if n.startswith(f"run-{message.message_id}-")]) == 2,
               "the retried run to start", process=second)
    assert markers.of(message.message_id) == {"started-1"}


def test_a_queued_message_cancelled_is_dead_lettered_and_never_runs(
        project: DramatiqProject, processes: Processes, markers: Markers) -> None:
    cancelled = project.send("effect_work", hang=[0])
    desk = desk_of(project)
    report = desk.act(OperatorAction.CANCEL, cancelled.message_id, actor="alice",
                      note="not wanted")
    assert report.applied, report.line
    [dead] = project.dead_lettered().values()
    assert dead["options"]["reconciler_reason"] == "operator_cancel"
    after = project.send("idem_work", hang=[0])
    start_worker(processes, project, markers, "worker-a")
    assert result_after(markers, after, 1) == "done on attempt 1"
    assert markers.of(cancelled.message_id) == set()


def test_a_fetched_message_is_not_cancelled(
        project: DramatiqProject, processes: Processes, markers: Markers) -> None:
    message = project.send("effect_work")
    worker = start_worker(processes, project, markers, "worker-a")
    wait_started(markers, message.message_id, worker)
    report = desk_of(project).act(OperatorAction.CANCEL, message.message_id,
                                  actor="alice", note="stop it")
    assert (report.applied, report.refusal) == (False, "dramatiq_fetched")
    assert worker.alive()
    assert project.dead_lettered() == {}


def test_a_held_message_whose_worker_died_waits_for_its_unhold(
        project: DramatiqProject, processes: Processes, markers: Markers) -> None:
    message = project.send("effect_work")
    worker = start_worker(processes, project, markers, "worker-a")
    wait_started(markers, message.message_id, worker)
    desk = desk_of(project)
    assert desk.act(OperatorAction.HOLD, message.message_id, actor="alice",
                    note="looking").applied
    sigkill(worker)
    held = by_job(reconcile_until(
        project, KINDS, lambda found: message.message_id in by_job(found),
        "the held message to be judged"))[message.message_id]
    assert (held.disposition, held.reason) == (Disposition.SKIP, Reason.OPERATOR_HOLD)
    assert desk.act(OperatorAction.UNHOLD, message.message_id, actor="alice",
                    note="done").applied
    outcome = by_job(reconcile_once(project.engine, project.config(), KINDS))[
        message.message_id]
    assert outcome.reason is Reason.WORKER_DIED_MID_STEP


def counting_client(url: str) -> tuple[Any, list[int]]:
    """A client of ``url``, connected, and the count (the list's one item, from 0 now) of
    its round trips: every packed send on its connection, one command or a whole
    pipeline."""
    import redis  # noqa: PLC0415 - the tests of the dramatiq source have it

    sends = [0]

    class Counting(redis.Connection):
        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            sends[0] += 1
            super().send_packed_command(command, check_health)

    client = redis.Redis.from_url(url, connection_class=Counting)
    client.ping()
    sends[0] = 0
    return client, sends


def other_operator(project: DramatiqProject, moves: Mapping[str, Sequence[OperatorAction]]
                   ) -> Move:
    """Another operator's actions (``moves``: each message's, in order), each one message's
    on its own client, landing between the chunk's read and its swap."""
    actions = DramatiqActions(project.config(), project.redis())

    def move(conn: Connection, key: JobKey) -> None:
        for action in moves.get(str(key), ()):
            job = actions.read(key, lock=True)
            assert job is not None
            swap = actions.retry if action is OperatorAction.RETRY else actions.cancel
            assert swap(key, job) is not None

    return move


def chunk_desk(project: DramatiqProject, actions: DramatiqActions, move: Move
               ) -> OperatorDesk:
    """The dramatiq desk over ``actions`` (a chunk's read and swap set-based), ``move``
    after its reads."""
    return desk_moving_after_read(project.engine, "dramatiq", project.config(), KINDS,
                                  actions=lambda conn, config, kinds: actions, move=move)


def recorded(project: DramatiqProject, actor: str
             ) -> dict[str, tuple[str | None, str | None, str | None]]:
    """Each message's record by ``actor``: refusal, state before, state after."""
    with project.engine.connect() as conn:
        return {r.job_key: (r.refusal_reason, r.state_before, r.state_after)
                for r in conn.execute(sa.select(ACTIONS).where(
                    ACTIONS.c.job_source == "dramatiq", ACTIONS.c.acted_by == actor))}


def redis_ids(project: DramatiqProject, queue: str = "default") -> dict[str, str]:
    """Each stored message's Redis id by its message id (its queue's and dead letters')."""
    stored = {**project.messages(queue), **project.dead_lettered(queue)}
    return {message["message_id"]: redis_id for redis_id, message in stored.items()}


def dead_set(project: DramatiqProject, queue: str = "default") -> set[str]:
    """The Redis ids in the queue's dead-letter sorted set (its hash aside)."""
    return {m.decode() for m in project.redis().zrange(f"dramatiq:{queue}.XQ", 0, -1)}


def test_a_chunk_retry_moves_dead_letters_in_one_round_trip_and_a_worker_runs_them(
        project: DramatiqProject, processes: Processes, markers: Markers) -> None:
    """Five messages a pass dead-lettered (their worker SIGKILLed mid-run), a queued one
    and an id no message has, retried as one chunk: between its read and its swap another
    operator retries one (moved off the dead-letter set) and retries then cancels another
    (back in the set under the same Redis id, rewritten). Those two are ``fence_lost``
    and stay as that operator left them, the queued one is refused, the unknown id names
    no message, the three others are queued with a fresh budget, all recorded; the chunk
    costs three Redis round trips, its batch read finds what the one-message read finds,
    and a real worker runs the retried ones and the other operator's to the end."""
    sent = [project.send("effect_once", hang=[3600]) for _ in range(5)]
    first = start_worker(processes, project, markers, "worker-a")
    for message in sent:
        wait_started(markers, message.message_id, first)
    sigkill(first)
    reconcile_until(project, KINDS, lambda _: len(project.dead_lettered()) == len(sent),
                    "the dead letters")
    assert {m["options"]["reconciler_reason"] for m in project.dead_lettered().values()} \
        == {Reason.WORKER_DIED_MID_STEP.value}
    failed, gone, changed = sent[:3], sent[3], sent[4]
    waiting = project.send("idem_work", hang=[0])
    ids = [m.message_id for m in (*failed, gone, changed, waiting)]
    client, sends = counting_client(project.redis_url)
    actions = DramatiqActions(project.config(), client)
    assert actions.read_many([*ids, UNKNOWN], lock=True) == {
        i: job for i in ids if (job := actions.read(i, lock=True)) is not None}
    sends[0] = 0
    desk = chunk_desk(project, actions, other_operator(project, {
        gone.message_id: [OperatorAction.RETRY],
        changed.message_id: [OperatorAction.RETRY, OperatorAction.CANCEL]}))
    reports = desk.act_on_chunk(OperatorAction.RETRY, [*ids, UNKNOWN], actor="alice",
                                note="charges checked: not taken")
    assert sends == [CHUNK_ROUND_TRIPS]
    assert [(r.job_id, r.refusal) for r in reports] == [
        *((m.message_id, None) for m in failed), (gone.message_id, "fence_lost"),
        (changed.message_id, "fence_lost"),
        (waiting.message_id, "job_not_failed_or_cancelled"), (UNKNOWN, "no_such_job")]
    stored = redis_ids(project)
    assert sorted(project.queued()) == sorted(
        stored[m.message_id] for m in (*failed, gone, waiting))
    assert dead_set(project) == set(project.dead_lettered()) == {stored[changed.message_id]}
    [dead] = project.dead_lettered().values()
    assert dead["options"]["reconciler_reason"] == "operator_cancel"
    for message in failed:
        options = project.messages()[stored[message.message_id]]["options"]
        assert options["retries"] == 0
        assert "reconciler_reason" not in options
    assert recorded(project, "alice") == {
        **{m.message_id: (None, "dead", "queued") for m in failed},
        gone.message_id: ("fence_lost", "dead", "dead"),
        changed.message_id: ("fence_lost", "dead", "dead"),
        waiting.message_id: ("job_not_failed_or_cancelled", "queued", "queued")}
    start_worker(processes, project, markers, "worker-b")
    for message in (*failed, gone, waiting):
        assert result_after(markers, message, 1) == "done on attempt 1"
    assert markers.of(changed.message_id) == {"started-1"}


def test_a_chunk_cancel_dead_letters_queued_messages_in_one_round_trip(
        project: DramatiqProject, processes: Processes, markers: Markers) -> None:
    """Five queued messages, one a worker is running and an id no message has, cancelled
    as one chunk: between its read and its swap another operator cancels one (moved off
    its queue) and cancels then retries another (back on the queue under the same Redis
    id, rewritten). Those two are ``fence_lost`` and stay as that operator left them, the
    running one is refused ``dramatiq_fetched`` and its worker keeps it, the unknown id
    names no message, the three others are dead-lettered ``operator_cancel``, all
    recorded; the chunk costs three Redis round trips and two more where Redis lost the
    move's script meanwhile, and a real worker runs the one the other operator put back to
    the end and none of the cancelled."""
    running = project.send("effect_work", hang=[3600])
    # One thread and a prefetch of one: the worker holds the running message only, and
    # leaves the chunk's messages on the queue.
    first = start_worker(processes, project, markers, "worker-a", threads=1, prefetch=1)
    wait_started(markers, running.message_id, first)
    queued = [project.send("effect_work", hang=[0]) for _ in range(3)]
    gone, changed = (project.send("effect_work", hang=[0]) for _ in range(2))
    ids = [m.message_id for m in (*queued, gone, changed, running)]
    client, sends = counting_client(project.redis_url)
    actions = DramatiqActions(project.config(), client)
    assert actions.read_many([*ids, UNKNOWN], lock=True) == {
        i: job for i in ids if (job := actions.read(i, lock=True)) is not None}
    sends[0] = 0
    other = other_operator(project, {
        gone.message_id: [OperatorAction.CANCEL],
        changed.message_id: [OperatorAction.CANCEL, OperatorAction.RETRY]})

    def other_then_scripts_lost(conn: Connection, key: JobKey) -> None:
        # Redis loses its scripts after each move (as a restart would): the next move, the
        # other operator's and the chunk's, is refused NOSCRIPT, loads it and runs again.
        other(conn, key)
        project.redis().script_flush()

    desk = chunk_desk(project, actions, other_then_scripts_lost)
    reports = desk.act_on_chunk(OperatorAction.CANCEL, [*ids, UNKNOWN], actor="alice",
                                note="not wanted")
    assert sends == [CHUNK_ROUND_TRIPS + 2]  # the script loaded, the moves sent again
    assert [(r.job_id, r.refusal) for r in reports] == [
        *((m.message_id, None) for m in queued), (gone.message_id, "fence_lost"),
        (changed.message_id, "fence_lost"), (running.message_id, "dramatiq_fetched"),
        (UNKNOWN, "no_such_job")]
    stored = redis_ids(project)
    dead = {stored[m.message_id] for m in (*queued, gone)}
    assert dead_set(project) == set(project.dead_lettered()) == dead
    assert {m["options"]["reconciler_reason"] for m in project.dead_lettered().values()} \
        == {"operator_cancel"}
    assert project.queued() == [stored[changed.message_id]]
    assert first.alive()
    assert recorded(project, "alice") == {
        **{m.message_id: (None, "queued", "dead") for m in queued},
        gone.message_id: ("fence_lost", "queued", "queued"),
        changed.message_id: ("fence_lost", "queued", "queued"),
        running.message_id: ("dramatiq_fetched", "started", "started")}
    start_worker(processes, project, markers, "worker-b")
    assert result_after(markers, changed, 1) == "done on attempt 1"
    for message in (*queued, gone):
        assert markers.of(message.message_id) == set()
