"""What each page shows: the reads it makes (a fixed, small number, each bounded) and the
redacted views it draws, as a template name and its context. No SQL and no HTML here."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from reconciler.config.registry import DEFAULT_SOURCE, SOURCES, integer_keyed
from reconciler.console.chart import reason_chart
from reconciler.console.params import SINCE_CHOICES, BadRequestError, DecisionQuery, Outcome
from reconciler.console.port import ConsoleReads, Explain, Workers
from reconciler.console.rules import BY_REASON, rule_for
from reconciler.core.decisions import RULES
from reconciler.core.operator_desk import OperatorDesk
from reconciler.core.ports import SourceJobs
from reconciler.core.vocabulary import Disposition, JobKey, OperatorAction, PassOutcome, Reason
from reconciler.views import decision_view, iso_time, job_view

log = logging.getLogger("reconciler.console")

PAGE_DECISIONS = 50
EXPORT_DECISIONS = 1000
"""Decisions per read of an export (``/decisions.csv``, ``/decisions.json``)."""
OVERVIEW_DECISIONS = 20
OVERVIEW_SHADOW_DECISIONS = 10
OVERVIEW_PASSES = 60
JOB_DECISIONS = 200
JOB_ACTIONS = 200
HELD_JOBS = 100
CHART_HOURS = 24
CHART_COUNT_CAP = 10_000
MAX_JOB_ID_TEXT = 200
# The columns of an operator action's record a page shows; everything else it holds
# stays unread.
ACTION_FIELDS = ("action_id", "operator_action", "action_outcome", "refusal_reason",
                 "acted_at", "state_before", "state_after", "actor", "note")
# What each refusal the desks report means, as the job page says it after a redirect.
REFUSALS = {
    "no_such_job": "there is no such job",
    "job_terminal": "the job has ended",
    "already_ended": "the job has already ended",
    "already_held": "it is already held",
    "not_held": "it is not held",
    "job_not_failed_or_cancelled": "only a job that failed or was cancelled is retried",
    "fence_lost": "the job changed since it was read; nothing was overwritten",
    "not_supported": "this source takes no such action from the console",
}
# The reasons a pass records for jobs it leaves alone on purpose.
WAITING_REASONS = (Reason.OPERATOR_HOLD.value, Reason.WAITING_ON_GATE.value)


class NotFoundPageError(LookupError):
    """No such page or job; its message is the line shown."""


@dataclass(frozen=True, slots=True)
class ConsoleState:
    """What the running service knows that the database does not: its source and modes."""

    source: str
    shadow: bool
    brake_hold_seconds: float | None


@dataclass(frozen=True, slots=True)
class Page:
    """A template and what it draws."""

    template: str
    context: dict[str, Any]


class Pages:
    """The console's pages over its port, the configured source's explain and state."""

    def __init__(self, reads: ConsoleReads, explain: Explain, state: ConsoleState,
                 jobs: SourceJobs, desk: OperatorDesk, *, workers: Workers) -> None:
        self.reads = reads
        self.explain = explain
        self.workers = workers
        """The source's running jobs and whether none has a live worker (the front
        page's first line)."""
        self.state = state
        self.jobs = jobs
        """The configured source's jobs as ``reconciler jobs show`` reads them."""
        self.desk = desk
        """The configured source's operator actions (offered to operators only)."""

    def reading(self) -> AbstractContextManager[None]:
        """One connection and read-only transaction for a page's reads."""
        return self.reads.reading()

    def overview(self) -> Page:
        """``/``: brake and shadow state, last passes, the chart, latest decisions."""
        now, brake_since = self.reads.now()
        counts, shadow_counted = self.reads.reason_counts(now - timedelta(hours=CHART_HOURS),
                                                          CHART_COUNT_CAP)
        latest = self._decisions(DecisionQuery(), OVERVIEW_DECISIONS, now)
        shadow = self._decisions(DecisionQuery(shadow=True), OVERVIEW_SHADOW_DECISIONS, now)
        return Page("overview.html", {
            "now": now, "workers": self._workers(), "state": self.state,
            "brake": self._brake(now, brake_since),
            "passes": fold_quiet_passes(self.reads.recent_passes(OVERVIEW_PASSES)),
            "chart": reason_chart(counts, CHART_COUNT_CAP), "chart_hours": CHART_HOURS,
            "chart_shadow": shadow_counted,
            "latest": latest, "shadow_latest": shadow, "reasons": [r.value for r in Reason],
            "terminalized_last_hour": DecisionQuery(disposition=Disposition.TERMINALIZE.value,
                                                    since="1h").link(),
        })

    def decisions(self, query: DecisionQuery, *, acting: bool = False,
                  outcome: Outcome | None = None) -> Page:
        """``/decisions``: a filtered page, newest first, and the link to the next one;
        for an operator (``acting``), a filtered page of real decisions of the configured
        source offers its jobs to a bulk retry or cancel (``outcome``: of the last one)."""
        now, _ = self.reads.now()
        rows = self._decisions(query, PAGE_DECISIONS + 1, now)
        more = len(rows) > PAGE_DECISIONS
        rows = rows[:PAGE_DECISIONS]
        return Page("decisions.html", {
            "query": query, "rows": rows, "now": now,
            "next_page": query.link(before=rows[-1]["decision_id"]) if more else None,
            "first_page": query.link(before=None) if query.before is not None else None,
            "dispositions": [d.value for d in Disposition],
            "reasons": [r.value for r in Reason], "sources": list(SOURCES),
            "since_choices": SINCE_CHOICES, "outcome": outcome,
            "bulk": acting and not query.shadow and query.source in (None, self.desk.source)
            and bool(query.bulk_filters()),
        })

    def job(self, source: str, job_id: str, *, acting: bool = False,
            outcome: Outcome | None = None) -> Page:
        """``/jobs/<source>/<job id>``: its decisions with evidence and rule and the
        operators' actions, in time order, its current state (this project's jobs, and the
        configured source's: kind and the system's own status) and what a pass would decide
        now (while running); for an operator (``acting``), the actions its state allows,
        and ``outcome``, what the last one did."""
        if source not in SOURCES:
            raise NotFoundPageError(f"no job source {source[:40]!r}")
        if not job_id or len(job_id) > MAX_JOB_ID_TEXT:
            raise NotFoundPageError("no such job")
        history = [_with_rule(decision_view(r))
                   for r in self.reads.job_decisions(source, job_id, JOB_DECISIONS)]
        history += [_action_view(r)
                    for r in self.reads.job_actions(source, job_id, JOB_ACTIONS)]
        history.sort(key=lambda e: datetime.fromisoformat(e.get("decided_at") or e["acted_at"]),
                     reverse=True)
        job = None
        if source == DEFAULT_SOURCE and job_id.isdigit() and len(job_id) < 19:
            job = self.reads.get_job(int(job_id))
        elif source == self.state.source:
            key = self._key(source, job_id)
            job = None if key is None else self.jobs.get_job(key)
        detail = None if job is None else job_view(job)
        # The job's whole story, where its source's records are this console's to read.
        timeline = [] if job is None or source not in (self.state.source, DEFAULT_SOURCE) \
            else self._timeline(source, job.job_id)
        explained = self._explain(source, job_id)
        if not history and detail is None and explained is None:
            raise NotFoundPageError(f"no decision or job for {source} job {job_id[:60]!r}")
        allowed: frozenset[OperatorAction] = frozenset()
        if acting and source == self.desk.source:
            allowed = self.desk.allowed(job_id)
        return Page("job.html", {
            "source": source, "job_id": job_id, "history": history, "job": detail,
            "explained": explained, "configured_source": self.state.source,
            "timeline": timeline,
            "actions": [a.value for a in OperatorAction if a in allowed],
            "outcome": outcome, "refusals": REFUSALS,
        })

    def held(self) -> Page:
        """Held, parked and gated jobs: this project's from its rows, the holds on other
        systems' jobs from the reconciler's own, every source's as its passes last
        recorded them."""
        held, parked = self.reads.held_and_parked(HELD_JOBS)
        recorded = [decision_view(r) for r in
                    self.reads.latest_by_reason(WAITING_REASONS, HELD_JOBS)]
        return Page("held.html", {"held": [job_view(j) for j in held],
                                  "foreign_held": self.reads.foreign_holds(HELD_JOBS),
                                  "parked": [job_view(j) for j in parked],
                                  "recorded": recorded})

    def rules(self) -> Page:
        """The decision table, as the job pages link to it."""
        return Page("rules.html", {"rules": RULES, "outcomes": [
            (reason, text) for reason, text in BY_REASON.items() if text.number is None]})

    def export_pages(self, query: DecisionQuery) -> Iterator[list[dict[str, Any]]]:
        """Every decision ``query`` matches, newest first, a page at a time: each page in
        a read of its own (an export to a slow reader holds no transaction open), the next
        one after the last id read, the time window fixed at the first."""
        now: datetime | None = None
        while True:
            with self.reads.reading():
                if now is None:
                    now, _ = self.reads.now()
                rows = self._decisions(query, EXPORT_DECISIONS, now)
            if rows:
                yield rows
            if len(rows) < EXPORT_DECISIONS:
                return
            query = replace(query, before=rows[-1]["decision_id"])

    def _decisions(self, query: DecisionQuery, limit: int, now: datetime
                   ) -> list[dict[str, Any]]:
        records = self.reads.decisions(
            disposition=query.disposition, reason=query.reason, kind=query.kind,
            source=query.source, since=query.since_time(now), shadow=query.shadow,
            before_id=query.before, limit=limit)
        return [decision_view(r) for r in records]

    def _timeline(self, source: str, job_id: JobKey) -> list[dict[str, Any]]:
        if source == self.state.source:
            return self.jobs.timeline(job_id, JOB_DECISIONS)
        return self.reads.timeline(int(job_id), JOB_DECISIONS)

    def _workers(self) -> dict[str, Any] | None:
        """The source's running jobs and whether none has a live worker; None when the
        source could not be read (the page still shows the audit)."""
        try:
            running, none_alive = self.workers()
        except Exception as exc:
            log.warning("event=console_workers_unread error=%s", type(exc).__name__)
            return None
        return {"running": running, "none_alive": none_alive}

    def _brake(self, now: datetime, since: datetime | None) -> dict[str, Any]:
        hold = self.state.brake_hold_seconds
        if since is None or hold is None:
            return {"engaged": False, "since": None, "until": None}
        until = since + timedelta(seconds=hold)
        return {"engaged": now < until, "since": since, "until": until}

    @staticmethod
    def _key(source: str, job_id: str) -> JobKey | None:
        """The id as the source spells it (None: no job of the source can have it)."""
        if not integer_keyed(source):
            return job_id
        return int(job_id) if job_id.isdigit() and len(job_id) < 19 else None

    def _explain(self, source: str, job_id: str) -> dict[str, Any] | None:
        if source != self.state.source:
            return None
        key = self._key(source, job_id)
        if key is None:
            return None
        verdict = self.explain(key)
        return None if verdict is None else {**verdict, "rule": rule_for(verdict["reason"])}


def _action_view(record: dict[str, Any]) -> dict[str, Any]:
    view = {key: record.get(key) for key in ACTION_FIELDS}
    view["acted_at"] = iso_time(record["acted_at"])
    return view


def _with_rule(view: dict[str, Any]) -> dict[str, Any]:
    return {**view, "rule": rule_for(str(view.get("decision_reason")))}


def fold_quiet_passes(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Passes newest first, each run of quiet ones (ok, nothing examined) folded into one
    line with its count and its span of time."""
    lines: list[dict[str, Any]] = []
    for row in rows:
        quiet = row["pass_outcome"] == PassOutcome.OK.value and not row["candidates_seen"]
        if quiet and lines and lines[-1]["quiet"]:
            lines[-1]["count"] += 1
            lines[-1]["first_started_at"] = row["started_at"]
            continue
        lines.append({**row, "quiet": quiet, "count": 1, "first_started_at": row["started_at"],
                      "seconds": _seconds_between(row["started_at"], row["finished_at"])})
    return lines


def _seconds_between(start: datetime | None, end: datetime | None) -> float | None:
    return None if start is None or end is None else (end - start).total_seconds()


__all__ = ["BadRequestError", "ConsoleState", "NotFoundPageError", "Page", "Pages"]
