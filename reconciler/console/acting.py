"""The console's actions, behind the checks ``Console`` makes first (an operator's session,
this console's origin, the session's CSRF token): one job's hold, unhold, retry or cancel,
and the decisions list's "retry these" / "cancel these", previewed, then confirmed.

Each goes through the ``OperatorDesk`` port, which fences and records every action; an
action answers with where to redirect (303) and the short code the page then shows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from reconciler.console.pages import MAX_JOB_ID_TEXT, NotFoundPageError, Page
from reconciler.console.params import (
    APPLIED,
    BadRequestError,
    Outcome,
    job_address,
    job_path,
    parse_decision_query,
)
from reconciler.console.port import ConsoleReads
from reconciler.core.operator_desk import OperatorDesk
from reconciler.core.vocabulary import OperatorAction

log = logging.getLogger("reconciler.console")

BULK_LIMIT = 100
"""The most jobs one bulk form acts on (the command line's ``--limit`` default)."""
MAX_NOTE = 1000
NOTE_REQUIRED = frozenset({OperatorAction.RETRY, OperatorAction.CANCEL})
BULK_ACTIONS = (OperatorAction.RETRY, OperatorAction.CANCEL)

Form = dict[str, list[str]]


@dataclass(frozen=True, slots=True)
class Redirect:
    """A 303 to ``location`` (a path on this console)."""

    location: str


class Acting:
    """The action forms of one operator desk (the configured source's)."""

    def __init__(self, desk: OperatorDesk, reads: ConsoleReads) -> None:
        self.desk = desk
        self.reads = reads

    def post(self, path: str, form: Form, actor: str) -> Page | Redirect:
        """Answer one action form, posted by ``actor``."""
        if path == "/decisions/bulk":
            return self._bulk(form, actor)
        if path.startswith("/jobs/"):
            return self._one(*job_address(path), form, actor)
        raise NotFoundPageError("no such form")

    def _one(self, source: str, job_id: str, form: Form, actor: str) -> Redirect:
        if source != self.desk.source:
            raise BadRequestError(f"this console acts on {self.desk.source} jobs only")
        if not job_id or len(job_id) > MAX_JOB_ID_TEXT:
            raise NotFoundPageError("no such job")
        action = _action(form, tuple(OperatorAction))
        report = self.desk.act(action, job_id, actor=actor, note=_note(form, action))
        _log(actor, action, self.desk.source, job_id, report.refusal)
        code = APPLIED if report.applied else report.refusal or "refused"
        return Redirect(Outcome(action.value, code).on(job_path(source, job_id)))

    def _bulk(self, form: Form, actor: str) -> Page | Redirect:
        query = parse_decision_query(form)
        if query.source not in (None, self.desk.source) or query.shadow:
            raise BadRequestError(f"this console acts on {self.desk.source} jobs only, "
                                  "on real decisions")
        action = _action(form, BULK_ACTIONS)
        note = _note(form, action)
        if _field(form, "confirm") != "1":
            now, _ = self.reads.now()
            targets = self.desk.bulk_targets(
                action, reason=query.reason, kind=query.kind, since=query.since_time(now),
                limit=BULK_LIMIT)
            return Page("bulk.html", {"query": query, "action": action.value, "note": note,
                                      "targets": targets, "limit": BULK_LIMIT,
                                      "source": self.desk.source})
        # Acts on the jobs the preview listed, each fenced on its state now: a job that
        # moved since is refused and counted, never overwritten.
        chosen = list(dict.fromkeys(j for j in form.get("job", [])
                                    if 0 < len(j) <= MAX_JOB_ID_TEXT))
        if len(chosen) > BULK_LIMIT:
            raise BadRequestError(f"a bulk form acts on at most {BULK_LIMIT} jobs")
        applied = 0
        for report in self.desk.act_on_chunk(action, chosen, actor=actor, note=note):
            _log(actor, action, self.desk.source, report.job_id, report.refusal)
            applied += report.applied
        outcome = Outcome(action.value, applied=applied, refused=len(chosen) - applied)
        return Redirect(outcome.on(query.link()))


def _field(form: Form, name: str) -> str:
    values = form.get(name)
    return values[-1] if values else ""


def _action(form: Form, offered: tuple[OperatorAction, ...]) -> OperatorAction:
    given = _field(form, "action")
    for action in offered:
        if given == action.value:
            return action
    raise BadRequestError(f"action must be one of {', '.join(a.value for a in offered)}")


def _note(form: Form, action: OperatorAction) -> str | None:
    note = _field(form, "note").strip()
    if len(note) > MAX_NOTE:
        raise BadRequestError(f"a note is at most {MAX_NOTE} characters")
    if not note and action in NOTE_REQUIRED:
        raise BadRequestError(f"{action} needs a note: why it is safe (it is kept)")
    return note or None


def _log(actor: str, action: OperatorAction, source: str, job_id: str,
         refusal: str | None) -> None:
    # The note stays in the record: a log line carries codes and names only.
    log.info("event=console_action actor=%s action=%s source=%s job=%r outcome=%s",
             actor, action, source, job_id[:MAX_JOB_ID_TEXT], refusal or "applied")
