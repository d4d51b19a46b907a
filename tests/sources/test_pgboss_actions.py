"""Operator actions on pg-boss (PostgreSQL), as its own retry, resume and cancel write them,
with real pg-boss workers (Node): a retried job is run to the end by one, a cancelled one
is read ``cancelled`` and never run, a held stale job waits for its unhold, and a job that
moved meanwhile is refused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from reconciler.cli.explain_view import explain_lines, explain_view
from reconciler.core.operator_desk import OperatorDesk
from reconciler.core.passes import explain_by_kind, run_pass
from reconciler.core.vocabulary import Disposition, OperatorAction, Reason
from reconciler.root.cli import assemble_cli
from reconciler.root.console import assemble_console
from reconciler.sidecar.metrics import Metrics
from reconciler.sources.pgboss.actions import PgBossActions
from reconciler.views import job_list_lines, job_view
from tests.sources.actions_support import (
    chunk_with_statements,
    desk_for,
    desk_moving_after_read,
    forget_source,
)
from tests.sources.factories import PgBossFactory
from tests.sources.support import (
    Markers,
    Processes,
    by_job,
    config_for,
    reconcile_once,
    wait_until,
)
from tests.sources.test_node_workers import KINDS, NodeSystem

SOURCE = "pg-boss"
LONG_AGO = 3600.0


@pytest.fixture
def boss(request: pytest.FixtureRequest, node_modules: Path, tmp_path: Path) -> NodeSystem:
    """pg-boss on empty tables, with no record of an earlier test's pg-boss jobs."""
    factory = PgBossFactory(request.getfixturevalue("pgboss_db"),
                            request.getfixturevalue("pgboss_schema"))
    forget_source(factory.db.engine, SOURCE)
    return NodeSystem(SOURCE, factory, node_modules, Markers(tmp_path / "markers"))


def factory_of(system: NodeSystem) -> PgBossFactory:
    assert isinstance(system.factory, PgBossFactory)
    return system.factory


def desk_of(system: NodeSystem) -> OperatorDesk:
    engine = system.factory.db.engine
    return desk_for(engine, system.factory.config, KINDS)


def died(system: NodeSystem, kind: str) -> str:
    """A job whose worker died long ago; it runs at once when run again."""
    factory = factory_of(system)
    job = factory.send(kind, {"hang": []}, expire_seconds=3600)
    factory.claim(job, age=LONG_AGO)
    return job


def test_retry_of_a_terminalized_job_is_finished_by_a_pgboss_worker(
        boss: NodeSystem, processes: Processes) -> None:
    """Failed by a pass, retried with a note: ``retry``, runnable now, its retry count
    from 0; a real pg-boss worker runs it to the end."""
    job = died(boss, "effect.work")
    engine = boss.factory.db.engine
    outcome = by_job(reconcile_once(engine, boss.factory.config, KINDS))[job]
    assert outcome.reason is Reason.WORKER_DIED_MID_STEP
    desk = desk_of(boss)
    report = desk.act(OperatorAction.RETRY, job, actor="alice", note="not charged")
    assert report.applied, report.line
    row = boss.row(job)
    assert row is not None
    assert (row["state"], row["retry_count"], row["runnable"], row["started_on"]) == (
        "retry", 0, True, None)
    worker = boss.start(processes, "worker")
    wait_until(lambda: boss.done(job), "the retried job to finish", process=worker)
    assert boss.markers.has(f"{job}-done-0")


def test_cancel_is_read_cancelled_and_never_run_and_retry_resumes_it(
        boss: NodeSystem, processes: Processes) -> None:
    """pg-boss's cancel: ``cancelled``, never fetched; a retry is its resume (``created``),
    and a worker then runs it."""
    factory = factory_of(boss)
    job = factory.send("pure.work", {"hang": []}, expire_seconds=3600)
    desk = desk_of(boss)
    report = desk.act(OperatorAction.CANCEL, job, actor="bob", note="duplicate")
    assert report.applied, report.line
    assert factory.status(job) == "cancelled"
    worker = boss.start(processes, "worker")
    later = factory.send("pure.work", {"hang": []}, expire_seconds=3600)
    wait_until(lambda: boss.done(later), "a later job to run", process=worker)
    assert boss.markers.of(job) == set()
    assert desk.act(OperatorAction.CANCEL, job, actor="bob", note="again").refusal == \
        "job_terminal"
    resumed = desk.act(OperatorAction.RETRY, job, actor="bob", note="wanted after all")
    assert resumed.applied, resumed.line
    assert resumed.line.endswith("cancelled -> created")
    wait_until(lambda: boss.done(job), "the resumed job to run", process=worker)


def test_a_held_stale_job_is_left_alone_until_unheld(boss: NodeSystem) -> None:
    """Held: skipped ``operator_hold``, unchanged; unheld, the next pass decides it."""
    job = died(boss, "idem.work")
    desk = desk_of(boss)
    assert desk.act(OperatorAction.HOLD, job, actor="d", note=None).applied
    engine = boss.factory.db.engine
    held = by_job(reconcile_once(engine, boss.factory.config, KINDS))[job]
    assert (held.disposition, held.reason) == (Disposition.SKIP, Reason.OPERATOR_HOLD)
    assert factory_of(boss).status(job) == "running"
    assert desk.act(OperatorAction.UNHOLD, job, actor="d", note=None).applied
    resumed = by_job(reconcile_once(engine, boss.factory.config, KINDS))[job]
    assert resumed.disposition is Disposition.RESUME


def test_an_action_on_a_job_that_moved_meanwhile_is_refused(boss: NodeSystem) -> None:
    """``fence_lost``, recorded; the job is as the system left it."""
    factory = factory_of(boss)
    job = factory.live("idem.work")

    desk = desk_moving_after_read(
        factory.db.engine, SOURCE, factory.config, KINDS, actions=PgBossActions,
        move=lambda conn, key: conn.execute(sa.text(
            "UPDATE pgboss.job SET retry_count = retry_count + 1 "
            "WHERE id = CAST(:id AS uuid)"), {"id": key}))
    before = boss.row(job)
    assert before is not None
    report = desk.act(OperatorAction.CANCEL, job, actor="e", note="n")
    assert (report.applied, report.refusal) == (False, "fence_lost")
    assert boss.row(job) == {**before, "retry_count": before["retry_count"] + 1}


def test_an_id_that_is_no_uuid_names_no_job(boss: NodeSystem) -> None:
    """``no_such_job``, nothing recorded."""
    assert desk_of(boss).act(OperatorAction.RETRY, "job-7", actor="f", note="n").refusal \
        == "no_such_job"


def test_a_chunk_is_retried_in_one_statement_and_a_real_worker_runs_them(
        boss: NodeSystem, processes: Processes) -> None:
    """Three jobs a pass failed, one retried meanwhile by another operator, one cancelled
    by an operator, an id no job has: the chunk's retry puts the failed ones in ``retry``
    and the cancelled one in ``created`` (pg-boss's resume), refuses the queued one, names
    no job for the unknown id; a real pg-boss worker then runs all four to the end."""
    engine = boss.factory.db.engine
    failed = [died(boss, "effect.work") for _ in range(3)]
    moved = died(boss, "effect.work")
    decided = by_job(reconcile_once(engine, boss.factory.config, KINDS))
    assert {decided[j].reason for j in (*failed, moved)} == {Reason.WORKER_DIED_MID_STEP}
    waiting = factory_of(boss).send("idem.work", {"hang": []}, expire_seconds=3600)
    desk = desk_of(boss)
    assert desk.act(OperatorAction.RETRY, moved, actor="bob", note="mine").applied
    assert desk.act(OperatorAction.CANCEL, waiting, actor="bob", note="later").applied
    unknown = "00000000-0000-0000-0000-000000000000"
    reports = desk.act_on_chunk(OperatorAction.RETRY, [*failed, moved, waiting, unknown],
                                actor="alice", note="bulk")
    assert [(r.job_id, r.refusal) for r in reports] == [
        *((j, None) for j in failed), (moved, "job_not_failed_or_cancelled"),
        (waiting, None), (unknown, "no_such_job")]
    states = {j: (row := boss.row(j)) and row["state"] for j in (*failed, waiting)}
    assert states == {**dict.fromkeys(failed, "retry"), waiting: "created"}
    worker = boss.start(processes, "worker")
    for job in (*failed, moved, waiting):
        wait_until(lambda job=job: boss.done(job), f"job {job} to finish", process=worker)


@pytest.mark.parametrize("action", [OperatorAction.RETRY, OperatorAction.CANCEL])
def test_a_chunk_costs_as_many_statements_for_six_jobs_as_for_two(
        boss: NodeSystem, action: OperatorAction) -> None:
    """A chunk's statements do not grow with its size: each job's fence travels as a row
    of one parameter, not as a clause of its own (a chunk of 500 built 500 clauses)."""
    def job() -> str:  # failed by the pass below to be retried, queued to be cancelled
        if action is OperatorAction.RETRY:
            return died(boss, "effect.work")
        return factory_of(boss).send("idem.work", {"hang": []}, expire_seconds=3600)

    chunks = [job() for _ in range(2)], [job() for _ in range(6)]
    reconcile_once(boss.factory.db.engine, boss.factory.config, KINDS)
    desk = desk_of(boss)
    counts = []
    for chunk in chunks:
        reports, statements = chunk_with_statements(desk, action, chunk)
        assert [r.refusal for r in reports] == [None] * len(chunk)
        expected = "retry" if action is OperatorAction.RETRY else "cancelled"
        assert {(row := boss.row(j)) and row["state"] for j in chunk} == {expected}
        counts.append((len(statements), max(len(s) for s in statements)))
    assert counts[0] == counts[1], counts


def test_every_view_reads_a_pgboss_jobs_own_budget_and_the_reason_that_applies_now(
        boss: NodeSystem) -> None:
    """Issue 41, findings 4 and 5, on pg-boss: ``jobs explain`` of a job sent with
    ``retryLimit`` 0 counts its own budget (1, from the job), as its evidence and the
    pass do, not the settings' default of 3. A job a pass failed and an operator retried
    is shown queued for ``operator_retry`` (pg-boss keeps the old reason in ``output``),
    with no finish time and an updated time no earlier than before the retry (pg-boss
    clears ``completed_on``)."""
    factory = factory_of(boss)
    engine = factory.db.engine
    parts = assemble_cli(config_for(engine, factory.config, KINDS), engine=engine)
    own = factory.send("idem.work", {"hang": []}, retry_limit=0, expire_seconds=3600)
    factory.claim(own, age=LONG_AGO)
    [explained] = explain_by_kind(parts.passes, [own], parts.config.pass_config("test"))
    view = explain_view(explained, parts.config.kinds, parts.jobs.get_job(own))
    assert (view["disposition"], view["reason"]) == ("terminalize", "resume_exhausted")
    assert (view["max_attempts"], view["max_attempts_from"],
            view["evidence"]["max_attempts"]) == (1, "job", 1)
    lines = explain_lines(view)
    assert "  attempt budget: 1 (the job's own, set in its system)" in lines
    assert "  max_attempts: 3 (the settings' default); the job's own budget applies " \
        "instead" in lines
    shown = parts.jobs.get_job(own)
    assert shown is not None
    assert (shown.max_attempts, shown.max_attempts_from) == (1, "job")

    job = died(boss, "effect.work")
    outcome = by_job(reconcile_once(engine, factory.config, KINDS))[job]
    assert outcome.reason is Reason.WORKER_DIED_MID_STEP
    ended = parts.jobs.get_job(job)
    assert ended is not None
    assert (ended.job_status, ended.status_reason) == ("failed", "worker_died_mid_step")
    assert ended.finished_at is not None
    assert ended.updated_at is not None
    assert desk_of(boss).act(OperatorAction.RETRY, job, actor="alice", note="checked").applied
    row = factory.row(job)
    assert row is not None
    assert row["output"]["reason"] == "worker_died_mid_step"  # pg-boss keeps it
    retried = parts.jobs.get_job(job)
    assert retried is not None
    assert (retried.job_status, retried.status_reason, retried.finished_at) == (
        "queued", "operator_retry", None)
    assert retried.updated_at is not None
    assert retried.updated_at >= ended.updated_at
    [line] = [v for v in job_list_lines([job_view(j) for j in parts.jobs.list_jobs(None, 10)])
              if job in v]
    assert line.split()[-1] == "operator_retry"



def test_held_pgboss_jobs_are_listed_on_the_held_page_and_marked_held(
        boss: NodeSystem) -> None:
    """Issue 41, finding 6, on pg-boss: two jobs alice holds (one whose worker died, one
    still waiting for a worker) are both on the console's held page with who held them,
    where "none" was shown, and ``jobs list`` marks both held."""
    factory = factory_of(boss)
    stale, waiting = died(boss, "idem.work"), factory.send("idem.work", {"hang": []})
    desk = desk_of(boss)
    for job in (stale, waiting):
        assert desk.act(OperatorAction.HOLD, job, actor="alice", note="looking").applied
    config = config_for(factory.db.engine, factory.config, KINDS)
    console = assemble_console(config, config.pass_config("held-page"))
    try:
        page = console.handle("GET", "/held", {})
    finally:
        console.close()
    assert page.status == 200, page.body
    body = page.body.decode()
    section = body[body.index('id="foreign-holds"'):]
    section = section[:section.index("</section>")]
    # Each job's row names who held it (other tests' holds on other sources may share
    # the session's database: only these two rows are read).
    rows = {job: [r for r in section.split("<tr>") if f'href="/jobs/{SOURCE}/{job}"' in r]
            for job in (stale, waiting)}
    assert {job: len(found) for job, found in rows.items()} == {stale: 1, waiting: 1}, section
    assert all("<td>alice</td>" in found[0] for found in rows.values()), section
    assert 'class="empty">none<' not in section
    parts = assemble_cli(config, engine=factory.db.engine)
    lines = job_list_lines([job_view(j) for j in parts.jobs.list_jobs(None, 10)])
    assert {job: any(job in line and "(held)" in line for line in lines)
            for job in (stale, waiting)} == {stale: True, waiting: True}, lines


def test_the_skip_counter_counts_what_the_audit_records_of_held_pgboss_jobs(
        boss: NodeSystem) -> None:
    """Issue 41, finding 7, on pg-boss: a held stale job is skipped by every pass but
    recorded once, and ``reconciler_decisions_total{skip,operator_hold}`` as a scrape
    reads it counts as the audit does (it reached 6 for one record): one for it over
    three passes, one more for a second stale job held before the third."""
    first = died(boss, "idem.work")
    desk = desk_of(boss)
    assert desk.act(OperatorAction.HOLD, first, actor="alice", note=None).applied
    engine = factory_of(boss).db.engine
    config = config_for(engine, boss.factory.config, KINDS)
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    held = [first]
    for number in range(3):
        if number == 2:
            held.append(died(boss, "idem.work"))
            assert desk.act(OperatorAction.HOLD, held[-1], actor="alice", note=None).applied
        # A pass and its observation, as ``reconciler run`` makes them.
        report = run_pass(assemble_cli(config, engine=engine).passes,
                          replace(config.pass_config("counter-test"), brake=None))
        metrics.observe_pass(report, 0.01, 0.0)
        assert {str(d.job_id): d.reason for d in report.decisions} \
            == dict.fromkeys(held, Reason.OPERATOR_HOLD)
    with engine.connect() as conn:
        audited = conn.execute(sa.text(
            "SELECT job_id FROM reconciliation_decisions WHERE job_source = :source "
            "AND decision_reason = 'operator_hold' ORDER BY decision_id"),
            {"source": SOURCE}).scalars().all()
    assert audited == held  # each held job's skip recorded once
    assert registry.get_sample_value("reconciler_decisions_total", {
        "disposition": "skip", "reason": "operator_hold"}) == len(audited)
