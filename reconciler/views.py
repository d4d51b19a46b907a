"""Public, redacted projections for the CLI and the console. Privacy lives here: nothing
else renders jobs or decisions.

Never shown: worker identities (``lease_owner``), lease tokens, payloads, paths, messages.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import TYPE_CHECKING, Any

from reconciler.config.registry import integer_keyed
from reconciler.core.evidence import parse_plan
from reconciler.core.job_story import WILL_RUN, aware
from reconciler.core.vocabulary import Disposition, Reason
from reconciler.redaction import redact

if TYPE_CHECKING:
    # Types only: the command line's parser imports this module (``printable``) and
    # should not pay for the pass machinery to print --help.
    from reconciler.core.job_story import JobDetail
    from reconciler.core.passes import Explained, PassReport

NOT_STARTED = "not_started"

# C0 and C1 controls, DEL, and the Unicode line separators and bidirectional overrides that
# can make a terminal show something other than what is stored.
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e"
                          r"\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` safe to print to a terminal: control characters become visible escapes.

    A job kind or step name holding ``\\n``, ``\\x1b[31m`` or ``\\x07`` is data, not a
    command to the operator's terminal. Every human (non-JSON) line goes through here;
    JSON output escapes by itself and is left as it is.
    """
    return _UNPRINTABLE.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def iso_time(value: datetime | None) -> str | None:
    """A time as every view writes it, with its offset (one a database gave back without
    one is UTC)."""
    moment = aware(value)
    return None if moment is None else moment.isoformat()


def job_view(job: JobDetail, decisions: list[dict[str, Any]] | None = None
             ) -> dict[str, Any]:
    """The ``jobs show --json`` shape; ``decisions``: the audit's about a foreign job."""
    plan = parse_plan(job.plan)
    if plan is None:
        step_list = [
            {"index": i, "name": None, "state": s} for i, s in sorted(job.step_states.items())
        ]
    else:
        step_list = [
            {"index": i, "name": step.step_name, "effect_kind": step.kind.value,
             "state": job.step_states.get(i, NOT_STARTED)}
            for i, step in enumerate(plan)
        ]
    return {
        "job_id": job.job_id,
        "job_kind": job.job_kind,
        "status": job.job_status,
        "reason": job.status_reason,
        "attempts_used": job.attempt_count,
        "max_attempts": job.max_attempts,
        "max_attempts_from": job.max_attempts_from,
        "resume_step_index": job.resume_step_index,
        "operator_hold": job.operator_hold,
        "last_error_code": job.last_error_code,
        "steps": step_list,
        "created_at": iso_time(job.created_at),
        "updated_at": iso_time(job.updated_at),
        "finished_at": iso_time(job.finished_at),
        # A foreign job: its system's own status beside ours.
        **({} if job.source_status is None else {"source_status": job.source_status}),
        **({} if decisions is None else {"decisions": [_isos(d) for d in decisions]}),
    }


def _isos(record: dict[str, Any]) -> dict[str, Any]:
    return {key: iso_time(value) if isinstance(value, datetime) else value
            for key, value in record.items()}


def with_history(view: dict[str, Any], decisions: list[dict[str, Any]],
                 actions: list[dict[str, Any]]) -> dict[str, Any]:
    """``view`` with the operator actions on the job and, in time order (oldest first),
    its ``history``: the decisions and the actions together. A note is the operator's
    text, kept as written: ``--json`` escapes it, the human lines go through
    ``printable``."""
    entries = [(d["decided_at"], {"type": "decision", "at": d["decided_at"],
                                  **{k: v for k, v in d.items() if k != "decided_at"}})
               for d in decisions]
    entries += [(a["acted_at"], {"type": "action", "at": a["acted_at"],
                                 **{k: v for k, v in a.items() if k != "acted_at"}})
                for a in actions]
    entries.sort(key=lambda entry: entry[0])
    return {**view, "decisions": [_isos(d) for d in decisions],
            "actions": [_isos(a) for a in actions],
            "history": [_isos(entry) for _, entry in entries]}


def decision_words(disposition: str, reason: str, resume_step_index: int | None) -> str:
    """A decision as every line shows it: ``resume at step 2 (worker_died_mid_step)``."""
    step = (f" at step {resume_step_index}" if disposition == Disposition.RESUME.value
            and resume_step_index is not None else "")
    return f"{disposition}{step} ({reason})"


def timeline_view(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A job's timeline (``reconciler.core.timeline``) as ``jobs show --json`` gives it."""
    return [_isos(entry) for entry in entries]


def _timeline_line(entry: dict[str, Any]) -> str:
    kind, at = entry["type"], entry["at"]
    attempt = f" (attempt {entry['attempt']})" if entry.get("attempt") is not None else ""
    if kind == "claimed":
        return f"  {at} attempt {entry['attempt']} claimed"
    if kind == "attempt_ended":
        return (f"  {at} attempt {entry['attempt']} ended {entry['outcome'] or '?'}"
                + (f" (by {entry['ended_by']})" if entry.get("ended_by") else ""))
    if kind == "step_started":
        return (f"  {at} step {entry['step']} {entry['name']} "
                f"[{entry.get('effect_kind') or '?'}] started{attempt}")
    if kind == "step_finished":
        return (f"  {at} step {entry['step']} {entry['name']} {entry.get('state') or '?'}"
                + (f" ({entry['error_code']})" if entry.get("error_code") else "") + attempt)
    if kind == "lease_expired":
        return f"  {at} lease ran out (as pass {entry['pass_id']} saw it)"
    if kind == "owner_gone":
        return f"  {at} worker gone (seen by pass {entry['pass_id']})"
    line = _history_line(entry)
    if kind == "decision":
        line += f", rule {entry['rule']}" if entry.get("rule") else ""
        line += " [shadow: nothing changed]" if entry.get("shadow") else ""
    return line


def _history_line(entry: dict[str, Any]) -> str:
    if entry["type"] == "decision":
        return (f"  {entry['at']} decided: "
                + decision_words(entry["disposition"], entry["reason"],
                                 entry.get("resume_step_index")))
    outcome = entry["outcome"] + (f" ({entry['refusal']})" if entry["refusal"] else "")
    line = (f"  {entry['at']} {entry['action']} by {entry['actor'] or 'unknown'}: {outcome}"
            f"; {entry['state_before']} -> {entry['state_after']}")
    return line + (f"; note: {entry['note']}" if entry["note"] else "")


LIST_ID_WIDTH = (3, 36)
"""The JOB column's width: as wide as the longest id listed, within these (a Celery or
pg-boss UUID is 36 characters; a longer id overflows its column rather than being cut)."""
LIST_KIND_WIDTH = (4, 40)
"""The KIND column's width, likewise; a longer kind is cut to fit."""


def _width(values: list[str], header: str, bounds: tuple[int, int]) -> int:
    low, high = bounds
    return min(max([low, len(header), *(len(v) for v in values)]), high)


def job_list_lines(views: list[dict[str, Any]]) -> list[str]:
    """``jobs list`` for people: a header and one line per job, in aligned columns."""
    if not views:
        return ["no jobs"]
    ids = [printable(str(v["job_id"])) for v in views]
    kinds = [printable(v["job_kind"]) for v in views]
    # A held job says so beside its status: passes leave it alone until it is lifted.
    statuses = [printable(v["status"]) + (" (held)" if v.get("operator_hold") else "")
                for v in views]
    attempts = [_attempts(v) for v in views]
    steps = [str(v["resume_step_index"]) if _resumes(v) else "-" for v in views]
    wide = (_width(ids, "JOB", LIST_ID_WIDTH), _width(kinds, "KIND", LIST_KIND_WIDTH),
            _width(statuses, "STATUS", (6, 18)), _width(attempts, "ATTEMPTS", (8, 12)))
    # Numbers right-aligned, text left-aligned; the header aligned as its column.
    row = "{:>{}}  {:<{}}  {:<{}}  {:>{}}  {:>4}  {}"
    lines = [row.format("JOB", wide[0], "KIND", wide[1], "STATUS", wide[2],
                        "ATTEMPTS", wide[3], "STEP", "REASON").rstrip()]
    lines += [row.format(i, wide[0], k[:wide[1]], wide[1], s, wide[2], a, wide[3], step,
                         v["reason"] or "-")
              for i, k, s, a, step, v in zip(ids, kinds, statuses, attempts, steps, views,
                                             strict=True)]
    return lines


def _attempts(view: dict[str, Any]) -> str:
    """Attempts used of the budget; ``?`` where the system keeps no count."""
    used = view["attempts_used"]
    return f"{'?' if used is None else used}/{view['max_attempts']}"


def _budget_from(view: dict[str, Any]) -> str:
    """Where the budget comes from, in words."""
    source = view.get("max_attempts_from", "job")
    if source == "job":
        return "the job's own budget"
    return "the settings' default budget" if source == "default" else f"budget from {source}"


def _resumes(view: dict[str, Any]) -> bool:
    # Only a job that will run again has a step it resumes at.
    return view["resume_step_index"] is not None and view["status"] in WILL_RUN


def job_lines(view: dict[str, Any], source_kind: str) -> list[str]:
    """``jobs show`` for people: the job, its steps, our decisions about a foreign one. A
    job that ended names no step it resumes at."""
    own = (f" [{view['source_status']} in {source_kind}]" if "source_status" in view
           else "")
    lines = [f"job {view['job_id']} ({view['job_kind']}): {view['status']}"
             + (f" ({view['reason']})" if view["reason"] else "") + own,
             f"  attempts {_attempts(view)} ({_budget_from(view)})"
             + (f", resumes at step {view['resume_step_index']}" if _resumes(view) else "")
             + (", held by an operator" if view["operator_hold"] else "")]
    lines += [f"  step {s['index']}: {s['name']} [{s.get('effect_kind', '?')}] {s['state']}"
              for s in view["steps"]]
    if "timeline" in view:
        lines += [_timeline_line(entry) for entry in view["timeline"]]
    elif "history" in view:
        lines += [_history_line(entry) for entry in view["history"]]
    else:
        lines += [f"  decided {d['decided_at']}: "
                  + decision_words(d["disposition"], d["reason"], d.get("resume_step_index"))
                  for d in view.get("decisions", [])]
    return lines


LIVENESS_UNKNOWN = "liveness_unknown"
"""The verdict's reason for a job the table finds live while its source's liveness is
unknown: a pass leaves it alone because the silence proves nothing, not because its owner
is alive."""


def verdict_view(explained: Explained, max_run_seconds: float | None) -> dict[str, Any]:
    """What a pass would decide of one running job now, as every view tells it (``jobs
    explain``, the console's job page): the table's disposition, reason, rule and step,
    the evidence, the liveness doubt's code (null: trusted), and whether nothing will ever
    reclaim the job (``never_reclaimed``: no lease of its own and no ``max_run_seconds``
    for its kind)."""
    decision = explained.change.decision
    # Through JSON and back: enum members become their plain values.
    evidence = json.loads(json.dumps(explained.change.evidence))
    doubt = explained.liveness
    view: dict[str, Any] = {
        "disposition": decision.disposition.value, "reason": decision.reason.value,
        "rule": decision.rule_number, "resume_step_index": decision.resume_step_index,
        "liveness_unknown": None if doubt is None else doubt.code.value,
        "never_reclaimed": False, "evidence": evidence}
    if decision.reason is Reason.LEASE_LIVE:
        if doubt is not None:
            # The owner may be dead or alive: no evidence says "alive".
            view.update(reason=LIVENESS_UNKNOWN, rule=None)
            evidence["lease_live"] = None
        elif not explained.leases_own and max_run_seconds is None:
            view["never_reclaimed"] = True
    return view


def decision_view(record: dict[str, Any]) -> dict[str, Any]:
    """A stored decision record; evidence holds only privacy-safe facts by construction.

    The audit keeps job ids as text (a pg-boss id is a UUID); a source whose ids are
    integers gets them back as numbers.
    """
    view = {key: iso_time(value) if isinstance(value, datetime) else value
            for key, value in record.items() if key != "shadow_mode"}
    # Recorded by a shadow pass: decided, nothing changed. Public name ``shadow``.
    view["shadow"] = bool(record.get("shadow_mode", False))
    job_id = view.get("job_id")
    if integer_keyed(str(view.get("job_source"))) and isinstance(job_id, str) \
            and job_id.lstrip("-").isdigit():
        view["job_id"] = int(job_id)
    return view


def pass_view(report: PassReport) -> dict[str, Any]:
    """The ``pass --json`` shape."""
    return {
        "pass_id": report.pass_id,
        "outcome": report.outcome.value,
        "dry_run": report.dry_run,
        "shadow": report.shadow,
        "braked": report.braked,
        "candidates": len(report.decisions),
        "resumed": report.count(Disposition.RESUME),
        "terminalized": report.count(Disposition.TERMINALIZE),
        "skipped": report.count(Disposition.SKIP),
        # Why nothing that depends on liveness was decided (null: it was trusted).
        "liveness_unknown": None if report.liveness is None else {
            "code": report.liveness.code.value, "where": redact(report.liveness.where)},
        "decisions": [
            {"job_id": d.job_id, "disposition": d.disposition.value, "reason": d.reason.value,
             "resume_step_index": d.resume_step_index}
            for d in report.decisions
        ],
    }
