"""Operator actions on a mapped table (``kind = "table"``), SQLite and PostgreSQL: retry and
cancel in the mapping's statuses, the reconciler's own hold, the fence, the record.

The desk is the one the composition root builds for the configured source; the passes are
real passes; "changes nothing" is checked against the whole row.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, cast

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Connection

from models import OperatorAction as ActionRow
from models import OperatorHold, ReconciliationDecision
from reconciler.config.loader import pass_config
from reconciler.core.brake import BrakeLimits
from reconciler.core.operator_desk import OperatorDesk
from reconciler.core.passes import run_pass
from reconciler.core.vocabulary import Disposition, JobKey, OperatorAction, Reason
from reconciler.root.cli import assemble_cli
from reconciler.sidecar.metrics import Metrics
from reconciler.sources.table.actions import TableActions
from reconciler.sources.table.config import TableConfig
from reconciler.storage.clock import now_plus
from reconciler.storage.pass_store import SqlPassStore, SqlPassUnit
from tests.sources.actions_support import desk_for, desk_moving_after_read
from tests.sources.support import config_for
from tests.sources.test_table_source import KINDS, Home, add, dead, home, row, run, steps

__all__ = ["home"]  # the fixture, found by name

ACTIONS = cast(sa.Table, ActionRow.__table__)
HOLDS = cast(sa.Table, OperatorHold.__table__)
DECISIONS = cast(sa.Table, ReconciliationDecision.__table__)
SOURCE = "table"


@pytest.fixture
def table_home(home: Home) -> Home:
    """The home-grown table, with no record of an earlier test's table jobs (on PostgreSQL
    the reconciler's tables are the session's, and every test's table counts from 1)."""
    with home.engine.begin() as conn:
        for table in (ACTIONS, HOLDS, DECISIONS):
            conn.execute(table.delete().where(table.c.job_source == SOURCE))
    return home


def desk_of(home: Home, config: TableConfig | None = None) -> OperatorDesk:
    """The desk the composition root builds for the mapping."""
    return desk_for(home.engine, config or home.full, KINDS)


def recorded(home: Home, job: int) -> list[dict[str, Any]]:
    """The job's recorded actions, oldest first."""
    with home.engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(
            sa.select(ACTIONS).where(ACTIONS.c.job_source == SOURCE,
                                     ACTIONS.c.job_key == str(job))
            .order_by(ACTIONS.c.action_id))]


def terminalized(home: Home) -> int:
    """A job whose worker died inside its effectful step: a pass fails it."""
    job = dead(home, job_type="mail.send", generation=4, **steps("succeeded", "started"))
    assert run(home)[job].disposition is Disposition.TERMINALIZE
    assert row(home, job)["status"] == "failed"
    return job


def test_retry_of_a_terminalized_job_queues_it_at_its_first_unfinished_step(
        table_home: Home) -> None:
    """The mapping's queued status, the resume column at the first step not succeeded, a
    fresh attempt budget, a bumped generation; recorded with who, why, before and after."""
    job = terminalized(table_home)
    report = desk_of(table_home).act(OperatorAction.RETRY, str(job), actor="alice",
                                     note="checked: not charged")
    assert report.applied, report.line
    after = row(table_home, job)
    assert (after["status"], after["resume_step"], after["attempts"], after["generation"],
            after["status_reason"]) == ("pending", 1, 0, 6, None)
    [action] = recorded(table_home, job)
    assert (action["operator_action"], action["action_outcome"], action["acted_by"],
            action["operator_note"], action["state_before"], action["state_after"],
            action["job_id"]) == ("retry", "applied", "alice", "checked: not charged",
                                  "failed", "pending", None)


def test_retry_of_a_queued_or_running_job_is_refused_and_changes_nothing(
        table_home: Home) -> None:
    """Only a failed (or cancelled) job is retried; the refusal is recorded too."""
    job = dead(table_home, **steps("succeeded"))
    before = row(table_home, job)
    report = desk_of(table_home).act(OperatorAction.RETRY, str(job), actor="bob", note="n")
    assert (report.applied, report.refusal) == (False, "job_not_failed_or_cancelled")
    assert row(table_home, job) == before
    assert [a["action_outcome"] for a in recorded(table_home, job)] == ["refused"]


def test_cancel_writes_the_mapped_cancelled_status(table_home: Home) -> None:
    """With ``cancelled`` mapped, a running job ends in it; cancelling again is refused."""
    mapping = replace(table_home.full, cancelled="cancelled")
    job = dead(table_home, **steps("succeeded"))
    desk = desk_of(table_home, mapping)
    assert desk.allowed(str(job)) == {OperatorAction.HOLD, OperatorAction.CANCEL}
    report = desk.act(OperatorAction.CANCEL, str(job), actor="carol", note="duplicate")
    assert report.applied, report.line
    assert "worker is not stopped" in report.line
    assert row(table_home, job)["status"] == "cancelled"
    assert desk.allowed(str(job)) == {OperatorAction.RETRY}
    again = desk.act(OperatorAction.CANCEL, str(job), actor="carol", note="again")
    assert again.refusal == "job_terminal"
    # The cancelled job retries like a failed one.
    assert desk.act(OperatorAction.RETRY, str(job), actor="carol", note="after all").applied
    assert row(table_home, job)["status"] == "pending"


def test_cancel_without_a_cancelled_status_fails_it_with_operator_cancel(
        table_home: Home) -> None:
    """No ``cancelled`` in the mapping: its failed status, reason ``operator_cancel``."""
    job = dead(table_home, status="pending")
    report = desk_of(table_home).act(OperatorAction.CANCEL, str(job), actor="d", note="n")
    assert report.applied, report.line
    after = row(table_home, job)
    assert (after["status"], after["status_reason"]) == ("failed", "operator_cancel")


def test_a_status_the_mapping_does_not_name_is_refused(table_home: Home) -> None:
    """A row in a status of its own (``archived``) is neither retried nor cancelled."""
    job = dead(table_home, status="archived")
    before = row(table_home, job)
    desk = desk_of(table_home)
    assert desk.allowed(str(job)) == frozenset()
    for action in (OperatorAction.RETRY, OperatorAction.CANCEL, OperatorAction.HOLD):
        report = desk.act(action, str(job), actor="e", note="n")
        assert report.refusal == "status_not_mapped", report.line
    assert row(table_home, job) == before


def test_a_held_stale_job_is_left_alone_until_unheld(table_home: Home) -> None:
    """Held, a dead worker's job is skipped ``operator_hold`` (recorded once over two
    passes) and nothing about it changes; unheld, the next pass decides it."""
    job = dead(table_home, job_type="mail.send", **steps("succeeded"))
    desk = desk_of(table_home)
    held = desk.act(OperatorAction.HOLD, str(job), actor="f", note="looking")
    assert held.applied
    assert "workers are not stopped" in held.line
    assert desk.act(OperatorAction.HOLD, str(job), actor="f", note=None).refusal == \
        "already_held"
    before = row(table_home, job)
    first = run(table_home)[job]
    assert (first.disposition, first.reason) == (Disposition.SKIP, Reason.OPERATOR_HOLD)
    config = config_for(table_home.engine, table_home.full, KINDS)
    again = run_pass(assemble_cli(config, engine=table_home.engine).passes,
                     replace(pass_config(config.settings, "actions-test", KINDS), brake=None))
    assert [(d.job_id, d.reason, d.repeated) for d in again.decisions] == [
        (job, Reason.OPERATOR_HOLD, True)]
    with table_home.engine.connect() as conn:
        reasons = conn.execute(sa.select(DECISIONS.c.decision_reason).where(
            DECISIONS.c.job_source == SOURCE, DECISIONS.c.job_id == str(job))).scalars()
        assert list(reasons) == ["operator_hold"]  # recorded once
    # The counter counts as the audit does: a second job held now is counted on the next
    # pass; the first, skipped again, is not (its skip is on record from the first pass).
    other = dead(table_home, job_type="mail.send", **steps("succeeded"))
    assert desk.act(OperatorAction.HOLD, str(other), actor="f", note=None).applied
    metrics = Metrics(CollectorRegistry())
    third = run_pass(assemble_cli(config, engine=table_home.engine).passes,
                     replace(pass_config(config.settings, "actions-test", KINDS), brake=None))
    for report in (again, third):
        metrics.observe_pass(report, 0.01, 0.0)
    assert sorted((d.job_id, d.repeated) for d in third.decisions) == [
        (job, True), (other, False)]
    skipped = metrics.decisions.labels(disposition="skip", reason="operator_hold")
    assert skipped._value.get() == 1.0
    assert desk.act(OperatorAction.UNHOLD, str(other), actor="f", note=None).applied
    assert row(table_home, job) == before
    assert desk.act(OperatorAction.UNHOLD, str(job), actor="f", note=None).applied
    assert desk.act(OperatorAction.UNHOLD, str(job), actor="f", note=None).refusal == \
        "not_held"
    decided = run(table_home)[job]
    assert decided.disposition is Disposition.RESUME
    assert row(table_home, job)["status"] == "pending"


@pytest.mark.parametrize(("action", "status", "change"), [
    (OperatorAction.CANCEL, "processing", {"attempts": 2, "claimed_by": "host-b:2"}),
    (OperatorAction.RETRY, "failed", {"generation": 9}),
])
def test_an_action_on_a_job_that_moved_meanwhile_is_refused(
        table_home: Home, action: OperatorAction, status: str, change: dict[str, Any]
) -> None:
    """A worker (or a pass) changed the job after the action read it: ``fence_lost``,
    recorded, and the row is what the worker wrote, not what the operator would have."""
    job = dead(table_home, status=status, generation=3, **steps("succeeded"))
    desk = desk_moving_after_read(
        table_home.engine, SOURCE, table_home.full, KINDS, actions=TableActions,
        move=lambda conn, key: conn.execute(table_home.jobs.update().where(
            table_home.jobs.c.id == key).values(**change)))
    before = row(table_home, job)
    report = desk.act(action, str(job), actor="g", note="n")
    assert (report.applied, report.refusal) == (False, "fence_lost")
    assert row(table_home, job) == {**before, **change}
    assert [a["refusal_reason"] for a in recorded(table_home, job)] == ["fence_lost"]


def test_an_unknown_job_is_neither_acted_on_nor_recorded(table_home: Home) -> None:
    """No row with that id: ``no_such_job``, and no record."""
    report = desk_of(table_home).act(OperatorAction.RETRY, "999", actor="h", note="n")
    assert report.refusal == "no_such_job"
    assert recorded(table_home, 999) == []


def test_bulk_targets_are_the_jobs_whose_latest_decision_matches(table_home: Home) -> None:
    """The terminalized jobs of a reason, newest first, only those a retry applies to now,
    capped at the limit; a kind glob narrows them."""
    first = dead(table_home, job_type="mail.send", **steps("succeeded", "started"))
    second = dead(table_home, job_type="sms.send", **steps("succeeded", "started"))
    outcomes = run(table_home)
    reason = outcomes[first].reason
    desk = desk_of(table_home)
    assert desk.bulk_targets(OperatorAction.RETRY, reason=reason, kind=None, since=None,
                             limit=10) == [str(second), str(first)]
    assert desk.bulk_targets(OperatorAction.RETRY, reason=reason, kind="mail.*", since=None,
                             limit=10) == [str(first)]
    assert desk.bulk_targets(OperatorAction.RETRY, reason=reason, kind=None, since=None,
                             limit=1) == [str(second)]
    assert desk.act(OperatorAction.RETRY, str(first), actor="i", note="n").applied
    # Retried, it is queued: a retry no longer applies.
    assert desk.bulk_targets(OperatorAction.RETRY, reason=reason, kind=None, since=None,
                             limit=10) == [str(second)]


def test_held_stale_jobs_do_not_engage_the_mass_staleness_brake(table_home: Home) -> None:
    """Four of ten running jobs are stale and held, two stale and not, four live: the brake
    (engaged at half the running jobs stale) counts the held ones as a native source does,
    not at all, so the pass decides the two unheld dead jobs instead of braking."""
    held = [dead(table_home, job_type="mail.send", **steps("succeeded")) for _ in range(4)]
    loose = [dead(table_home, job_type="mail.send", **steps("succeeded")) for _ in range(2)]
    for _ in range(4):
        add(table_home, job_type="mail.send", lease_in=300, activity_ago=1)
    desk = desk_of(table_home)
    for job in held:
        assert desk.act(OperatorAction.HOLD, str(job), actor="f", note=None).applied
    config = config_for(table_home.engine, table_home.full, KINDS)
    limits = BrakeLimits(min_jobs=3, stale_fraction=0.5, hold_seconds=120)
    report = run_pass(assemble_cli(config, engine=table_home.engine).passes,
                      replace(pass_config(config.settings, "brake-test", KINDS), brake=limits))
    decided = {d.job_id: (d.disposition, d.reason) for d in report.decisions}
    assert {job: decided[job] for job in held} == {
        job: (Disposition.SKIP, Reason.OPERATOR_HOLD) for job in held}
    assert {decided[job][0] for job in loose} == {Disposition.RESUME}
    assert {row(table_home, job)["status"] for job in loose} == {"pending"}


def test_a_chunk_is_retried_in_one_statement_each_job_fenced_and_recorded(
        table_home: Home) -> None:
    """Three terminalized jobs and one another operator retried after the count: the
    chunk's retry queues the three at their own first unfinished steps, refuses the
    fourth (queued now), records all four, and an unknown id is neither acted on nor
    recorded."""
    jobs = [terminalized(table_home) for _ in range(3)]
    moved = terminalized(table_home)
    desk = desk_of(table_home)
    assert desk.act(OperatorAction.RETRY, str(moved), actor="bob", note="mine").applied
    reports = desk.act_on_chunk(OperatorAction.RETRY, [*map(str, jobs), str(moved), "999"],
                                actor="alice", note="bulk")
    assert [(r.job_id, r.refusal) for r in reports] == [
        *((str(j), None) for j in jobs), (str(moved), "job_not_failed_or_cancelled"),
        ("999", "no_such_job")]
    for job in jobs:
        after = row(table_home, job)
        assert (after["status"], after["resume_step"], after["attempts"],
                after["generation"]) == ("pending", 1, 0, 6)
        [action] = recorded(table_home, job)
        assert (action["action_outcome"], action["acted_by"], action["state_after"]) == (
            "applied", "alice", "pending")
    assert [a["action_outcome"] for a in recorded(table_home, moved)] == [
        "applied", "refused"]
    assert recorded(table_home, 999) == []


def test_a_chunk_with_a_job_that_moved_inside_it_is_swapped_job_by_job(
        table_home: Home) -> None:
    """A job whose fenced columns changed after the chunk read them (a worker's write on
    an engine without row locks for a look): the one statement matches fewer rows, the
    chunk is swapped row by row, the moved job refused ``fence_lost``, the rest applied."""
    first, second = terminalized(table_home), terminalized(table_home)
    with table_home.engine.begin() as conn:
        system = TableActions(conn, table_home.full, KINDS)
        read = system.read_many([first, second], lock=True)
        conn.execute(table_home.jobs.update().where(table_home.jobs.c.id == second)
                     .values(generation=9))
        after = system.swap_many(OperatorAction.RETRY, read, {})
    assert after == {first: "pending"}
    assert (row(table_home, first)["status"], row(table_home, second)["status"]) == (
        "pending", "failed")


class PassInTransaction(SqlPassStore):
    """The composition root's pass store, its pass run in a savepoint of ``conn`` (an
    action's transaction) instead of a transaction of its own: a pass that committed
    just before the action's swap, as the swap's fence sees it. A pass of its own would
    wait on the rows the chunk's read locked (SQLite: on its write lock) until the
    action ends."""

    def __init__(self, store: SqlPassStore, conn: Connection) -> None:
        super().__init__(store.engine, store.source, timeouts=store.timeouts)
        self._conn = conn

    @contextmanager
    def pass_transaction(self, *, dry_run: bool) -> Iterator[SqlPassUnit]:
        with self._conn.begin_nested():
            yield self._unit(self._conn, lock=not dry_run)


def test_a_job_a_pass_decided_anew_inside_a_bulk_cancel_is_refused_the_rest_applied(
        table_home: Home) -> None:
    """Four dead workers' jobs a pass resumed; one claimed again and its worker dead
    again. The bulk cancel counts the four; between the chunk's read and its swap a real
    pass (the composition root's, over the mapping) resumes the dead one anew (pending,
    its generation bumped): the chunk's swap refuses it ``fence_lost`` and leaves it as
    the pass wrote it, cancels the other three, and records all four."""
    jobs = [dead(table_home, job_type="mail.send", **steps("succeeded")) for _ in range(4)]
    resumed = run(table_home)
    assert {resumed[j].disposition for j in jobs} == {Disposition.RESUME}
    reason = resumed[jobs[0]].reason
    moved = jobs[1]
    with table_home.engine.begin() as conn:  # claimed again; that worker dies too
        conn.execute(table_home.jobs.update().where(table_home.jobs.c.id == moved).values(
            status="processing", claimed_by="host-b:7", attempts=2,
            lease_until=now_plus(-300), last_activity_at=now_plus(-600)))
    targets = desk_of(table_home).bulk_targets(OperatorAction.CANCEL, reason=reason,
                                               kind=None, since=None, limit=10)
    assert sorted(targets) == sorted(map(str, jobs))
    config = config_for(table_home.engine, table_home.full, KINDS)
    passes = assemble_cli(config, engine=table_home.engine).passes
    assert isinstance(passes, SqlPassStore)
    decided: list[Any] = []

    def a_pass(conn: Connection, key: JobKey) -> None:
        if str(key) == str(moved):
            report = run_pass(PassInTransaction(passes, conn), replace(
                pass_config(config.settings, "between-read-and-swap", KINDS), brake=None))
            decided.extend((d.job_id, d.disposition) for d in report.decisions)

    before = row(table_home, moved)
    desk = desk_moving_after_read(table_home.engine, SOURCE, table_home.full, KINDS,
                                  actions=TableActions, move=a_pass)
    reports = desk.act_on_chunk(OperatorAction.CANCEL, targets, actor="alice",
                                note="bad deploy")
    assert decided == [(moved, Disposition.RESUME)]
    assert {r.job_id: r.refusal for r in reports} == {
        t: "fence_lost" if t == str(moved) else None for t in targets}
    after = row(table_home, moved)
    assert (after["status"], after["resume_step"], after["generation"]) == (
        "pending", 1, before["generation"] + 1)
    for job in jobs:
        if job != moved:
            assert (row(table_home, job)["status"], row(table_home, job)["status_reason"]) \
                == ("failed", "operator_cancel")
    assert {job: [(a["operator_action"], a["action_outcome"], a["refusal_reason"])
                  for a in recorded(table_home, job)] for job in jobs} == {
        job: [("cancel", "refused" if job == moved else "applied",
               "fence_lost" if job == moved else None)] for job in jobs}
