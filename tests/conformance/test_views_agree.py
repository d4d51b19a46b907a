"""Every view of a job tells what the pass saw and decided, on every source.

After one pass over a job in each situation the source can express, ``jobs show`` and
``jobs list`` read each job alike (one read model), with the status, the reason, the step
it resumes at and the decision the pass made; a job the pass left alone is explained as
the pass decided it, with the budget the pass counted; the console's job page says the
same status, reason, budget, step, hold and verdict. Then an operator's retry and cancel,
where the source takes them, change the reason every view shows (in the same case: a
database per source and engine, not two).
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from reconciler.console import Console
from reconciler.core.job_story import ENDED, JobDetail
from reconciler.core.passes import explain_by_kind
from reconciler.core.ports import RecordedDecision
from reconciler.core.vocabulary import Disposition, OperatorAction, OperatorStatusReason
from reconciler.root.console import assemble_console
from reconciler.views import job_view, verdict_view
from tests.conformance.fixtures import Situation, SourceFixture, SourceJob
from tests.conformance.test_source_conformance import (
    RESUMED,
    SKIPPED,
    TERMINALIZED,
    expected_in,
    make_all,
)

pytestmark = pytest.mark.integration

WORDS = {"runnable": "queued", "running": "processing", "failed": "failed",
         "completed": "completed"}
"""The suite's neutral outcomes in the views' status words."""


def shown_and_listed(source: SourceFixture, job: SourceJob) -> JobDetail:
    """The job as ``jobs show`` reads it, checked equal to its line of ``jobs list``."""
    jobs = source.operator().jobs
    shown = jobs.get_job(job.key)
    assert shown is not None
    [listed] = [j for j in jobs.list_jobs(None, 1000) if str(j.job_id) == str(job.key)]
    assert job_view(listed) == job_view(shown)
    return shown


def on_its_page(console: Console, source: SourceFixture, job: SourceJob, shown: JobDetail,
                verdict: dict[str, Any] | None) -> None:
    """The console's job page says what ``jobs show`` says of the job (status, reason,
    attempts and budget, the step it resumes at, a hold) and, for a job the pass left
    alone, what ``jobs explain`` says a pass would decide."""
    kind = source.operator().config.source_entry.kind
    reply = console.handle("GET", f"/jobs/{kind}/{job.key}", {})
    assert reply.status == 200, reply.body
    body = reply.body.decode()
    found = re.search(r'<section class="job">\s*<p>(.*?)</p>', body, re.S)
    assert found is not None, body
    line = found.group(1)
    assert f'<strong class="status">{shown.job_status}</strong>' in line
    assert (f" ({shown.status_reason});" in line) == (shown.status_reason is not None), line
    used = "?" if shown.attempt_count is None else shown.attempt_count
    assert f"attempts {used}/{shown.max_attempts}<" in line, line
    resumes = shown.job_status in ("queued", "processing") \
        and shown.resume_step_index is not None
    assert (f", resumes at step {shown.resume_step_index}" in line) == resumes, line
    assert ("held by an operator" in line) == shown.operator_hold, line
    if verdict is not None:
        assert (f'<strong>{verdict["disposition"]}</strong> ({verdict["reason"]})'
                in body), body


def test_show_list_and_explain_tell_what_the_pass_decided(source: SourceFixture) -> None:
    """Resumed, terminalized and skipped jobs, one pass: each view agrees with it; then a
    retry and a cancel of a terminalized one, where the source takes them."""
    situations: list[Situation] = [*RESUMED, *TERMINALIZED, *SKIPPED]
    jobs = make_all(source, situations)
    assert jobs, f"{source.source_name} expresses none of the situations"
    report = source.run_pass()
    decided = {str(d.job_id): d for d in report.decisions}
    parts = source.operator()
    console = assemble_console(parts.config, parts.config.pass_config("conformance-console"))
    try:
        for situation, job in jobs.items():
            agree(source, console, situation, job, decided)
    finally:
        console.close()

    # Then an operator's retry and cancel change the reason every view shows, where the
    # source takes them (one database for both: the cases run on every source).
    ended = [job for situation, job in jobs.items() if situation in TERMINALIZED
             and expected_in(source, situation).outcome == "failed"]
    actions = source.operator().config.source_entry.capabilities.actions
    if ended and OperatorAction.RETRY in actions:
        retried_then_cancelled(source, ended[0])


def agree(source: SourceFixture, console: Console, situation: Situation, job: SourceJob,
          decided: dict[str, RecordedDecision]) -> None:
    """One job's views against the pass's decision about it."""
    parts = source.operator()
    expected = expected_in(source, situation)
    decision = decided[str(job.key)]
    shown = shown_and_listed(source, job)
    assert shown.job_status == WORDS[expected.outcome], situation
    history = parts.jobs.decisions_about(job.key, 5)[0]
    assert (history["disposition"], history["reason"], history["resume_step_index"]) \
        == (decision.disposition.value, decision.reason.value, decision.resume_step_index)
    verdict = None
    if decision.disposition is Disposition.RESUME:
        # Queued again by the decision: its reason is the decision's, as it is queued.
        assert (shown.status_reason, shown.resume_step_index) \
            == (decision.reason.value, decision.resume_step_index), situation
    elif decision.disposition is Disposition.TERMINALIZE:
        assert (shown.status_reason, shown.resume_step_index) \
            == (decision.reason.value, None), situation
        assert shown.finished_at is not None
        assert shown.finished_at.tzinfo is not None
    else:
        [explained] = explain_by_kind(parts.passes, [job.key],
                                      parts.config.pass_config("conformance"))
        verdict = verdict_view(explained, None)
        assert (verdict["disposition"], verdict["reason"]) \
            == (decision.disposition.value, decision.reason.value), situation
        # The budget every view shows is the one the pass counted (where it read one:
        # unreadable evidence has none).
        counted = verdict["evidence"].get("max_attempts", shown.max_attempts)
        assert shown.max_attempts == counted, situation
        assert shown.status_reason is None
        assert shown.operator_hold == (decision.reason.value == "operator_hold")
    on_its_page(console, source, job, shown, verdict)

def retried_then_cancelled(source: SourceFixture, job: SourceJob) -> None:
    """A terminalized job retried: queued for ``operator_retry`` (the terminal reason is
    history), updated no earlier than before; cancelled then (where the source takes
    both): ended with ``operator_cancel``."""
    desk = source.operator().desk
    assert desk is not None
    before = shown_and_listed(source, job)

    retried = desk.act(OperatorAction.RETRY, str(job.key), actor="alice", note="checked")
    assert retried.applied, retried.line
    after = shown_and_listed(source, job)
    assert (after.job_status, after.status_reason) \
        == ("queued", OperatorStatusReason.OPERATOR_RETRY.value)
    assert after.resume_step_index is not None
    assert before.updated_at is None or (after.updated_at is not None
                                         and after.updated_at >= before.updated_at)

    if OperatorAction.CANCEL not in desk.allowed(str(job.key)):
        return
    cancelled = desk.act(OperatorAction.CANCEL, str(job.key), actor="alice", note="not needed")
    assert cancelled.applied, cancelled.line
    ended = shown_and_listed(source, job)
    assert ended.job_status in ENDED
    assert ended.status_reason == OperatorStatusReason.OPERATOR_CANCEL.value
    assert ended.resume_step_index is None
