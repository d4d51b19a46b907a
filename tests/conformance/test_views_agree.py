"""Every view of a job tells what the pass saw and decided, on every source.

After one pass over a job in each situation the source can express, ``jobs show`` and
``jobs list`` read each job alike (one read model), with the status, the reason, the step
it resumes at and the decision the pass made; ``jobs show --json`` lists the steps the
pass's evidence recorded; ``jobs explain --json`` of a job the pass left alone gives the
pass's verdict, rule and budget, and of a job it moved, refuses naming the status every
view shows; the console's job page says the
same status, reason, budget, step, hold and verdict. Then an operator's retry and cancel,
where the source takes them, change the reason every view shows (in the same case: a
database per source and engine, not two).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from reconciler.cli.commands import explained_view, json_text, show_view
from reconciler.console import Console
from reconciler.core.job_story import ENDED, JobDetail
from reconciler.core.ports import RecordedDecision
from reconciler.core.vocabulary import Disposition, OperatorAction, OperatorStatusReason
from reconciler.errors import ActionRefusedError
from reconciler.root.cli import CliParts
from reconciler.root.console import assemble_console
from reconciler.views import job_view
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


def printed(view: dict[str, Any]) -> dict[str, Any]:
    """A view as its command's ``--json`` prints it, read back."""
    loaded: dict[str, Any] = json.loads(json_text(view))
    return loaded


def shown_json(parts: CliParts, job: SourceJob) -> dict[str, Any]:
    """``jobs show --json`` of the job."""
    return printed(show_view(parts, job.key, str(job.key)))


def explained_json(parts: CliParts, job: SourceJob) -> dict[str, Any] | str:
    """``jobs explain --json`` of the job, or the line it refuses with (exit 6)."""
    try:
        return printed(explained_view(parts, job.key, str(job.key)))
    except ActionRefusedError as refused:
        return str(refused)


def steps_as_recorded(shown: dict[str, Any], evidence: dict[str, Any]) -> None:
    """``jobs show --json``'s steps are the ones the pass judged: each step's state and
    effect kind as its evidence recorded them (the plan's length where the facts could
    not be evaluated; none named where the plan could not be read)."""
    steps = shown["steps"]
    if evidence.get("step_states") is not None:
        assert [s["state"] for s in steps] == evidence["step_states"], (steps, evidence)
        assert [s.get("effect_kind") for s in steps] == evidence["effect_kinds"], steps
    elif evidence.get("plan_readable") is False:
        assert all(s["name"] is None and "effect_kind" not in s for s in steps), steps
    else:
        # Evidence the pass could not evaluate (reconcile_error) keeps the plan's length.
        assert len(steps) == evidence["plan_length"], (steps, evidence)


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
    # ``jobs show --json``: the read model as printed, the pass's one decision in its
    # timeline, and its steps as that decision's evidence recorded them.
    printed_show = shown_json(parts, job)
    assert {key: printed_show[key] for key in ("status", "reason", "resume_step_index",
                                               "max_attempts", "max_attempts_from")} \
        == {key: printed(job_view(shown))[key] for key in (
            "status", "reason", "resume_step_index", "max_attempts", "max_attempts_from")}
    [recorded] = [e for e in printed_show["timeline"] if e["type"] == "decision"]
    assert (recorded["disposition"], recorded["reason"], recorded["resume_step_index"]) \
        == (decision.disposition.value, decision.reason.value, decision.resume_step_index)
    steps_as_recorded(printed_show, recorded["evidence"])
    explained = explained_json(parts, job)
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
        # Left alone: ``jobs explain --json`` gives the pass's verdict, its rule, the
        # evidence it recorded, and the budget it counted, from where ``jobs show`` says.
        assert isinstance(explained, dict), explained
        assert (explained["disposition"], explained["reason"], explained["rule"],
                explained["resume_step_index"], explained["liveness_unknown"]) == (
            decision.disposition.value, decision.reason.value, recorded["rule"], None,
            None), situation
        assert explained["evidence"].get("step_states") \
            == recorded["evidence"].get("step_states"), situation
        # The budget every view shows is the one the pass counted (where it read one:
        # unreadable evidence has none).
        counted = recorded["evidence"].get("max_attempts", shown.max_attempts)
        assert (explained["max_attempts"], explained["max_attempts_from"]) \
            == (counted, shown.max_attempts_from), situation
        assert shown.max_attempts == counted, situation
        assert shown.status_reason is None
        assert shown.operator_hold == (decision.reason.value == "operator_hold")
        verdict = explained
    if decision.disposition is not Disposition.SKIP:
        # Moved by the pass: no pass judges it now, and ``jobs explain`` says it is in
        # the status every other view shows (exit 6), not a verdict of its own.
        assert explained == (f"job {job.key} is {shown.job_status}, not processing: the "
                             "reconciler only judges processing jobs"), situation
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
