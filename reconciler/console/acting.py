"""The console's actions, behind the checks ``Console`` makes first (an operator's session,
this console's origin, the session's CSRF token): one job's hold, unhold, retry or cancel,
and the decisions list's "retry these" / "cancel these", previewed, then confirmed.

Each goes through the ``OperatorDesk`` port, which fences and records every action; an
action answers with where to redirect (303) and the short code the page then shows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

from reconciler.console.pages import MAX_JOB_ID_TEXT, NotFoundPageError, Page
from reconciler.console.params import (
    APPLIED,
    BadRequestError,
    DecisionQuery,
    Outcome,
    job_address,
    job_path,
    parse_decision_query,
)
from reconciler.console.port import ConsoleReads
from reconciler.core.operator_desk import OperatorDesk, act_in_chunks
from reconciler.core.vocabulary import OperatorAction

log = logging.getLogger("reconciler.console")

BULK_LIMIT = 1_000_000
"""The most jobs one bulk form acts on: every match of its filters, short of a runaway."""
BULK_SAMPLE = 20
"""The jobs a bulk form's preview lists, beside the count it acts on."""
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
            targets = self._matching(action, query, now)
            return Page("bulk.html", {"query": query, "action": action.value, "note": note,
                                      "count": len(targets), "sample": targets[:BULK_SAMPLE],
                                      "as_of": now.isoformat(), "limit": BULK_LIMIT,
                                      "source": self.desk.source})
        # What the filters matched as the preview counted it (decided no later than its
        # instant), in a state to act on now; a job that moved since no longer matches and
        # is not acted on, and a match the preview did not count is left for the next.
        confirmed, as_of = _count(form), _instant(form)
        targets = self._matching(action, query, as_of)[:confirmed]
        applied = refused = 0
        for chunk in act_in_chunks(self.desk, action, targets, actor=actor, note=note):
            applied += sum(report.applied for report in chunk)
            refused += sum(not report.applied for report in chunk)
        refused += confirmed - len(targets)
        log.info("event=console_bulk actor=%s action=%s source=%s confirmed=%d applied=%d "
                 "refused=%d", actor, action, self.desk.source, confirmed, applied, refused)
        outcome = Outcome(action.value, applied=applied, refused=refused)
        return Redirect(outcome.on(query.link()))

    def _matching(self, action: OperatorAction, query: DecisionQuery, as_of: datetime
                  ) -> list[str]:
        """Every job whose latest decision the filters match as of ``as_of`` (the window
        ``since`` counted back from it) and whose state allows ``action`` now."""
        return self.desk.bulk_targets(
            action, limit=BULK_LIMIT, reason=query.reason, disposition=query.disposition,
            kind=query.kind, since=query.since_time(as_of), until=as_of)


def _count(form: Form) -> int:
    """The count the operator confirmed."""
    text = _field(form, "count")
    if not (text.isascii() and text.isdigit()) or int(text) > BULK_LIMIT:
        raise BadRequestError("the confirmation carries no count of jobs")
    return int(text)


def _instant(form: Form) -> datetime:
    """The instant the preview counted at."""
    try:
        moment = datetime.fromisoformat(_field(form, "as_of"))
    except ValueError:
        raise BadRequestError("the confirmation carries no time of its count") from None
    if moment.tzinfo is None:
        raise BadRequestError("the confirmation carries no time of its count")
    return moment


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
