"""The console's GET parameters: the decisions page's filters, parsed, checked against
the vocabularies and turned back into links, and the short codes an action's redirect
leaves for the page to show. A bad filter is one line on a 400 page, never a traceback."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from datetime import datetime, timedelta
from urllib.parse import quote, unquote, urlencode

from reconciler.config.registry import SOURCES
from reconciler.core.vocabulary import Disposition, OperatorAction, Reason

MAX_KIND_PATTERN = 100
MAX_DECISION_ID = 2**63 - 1
_DURATION = re.compile(r"^(\d{1,6})([smhd])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_CODE = re.compile(r"^[a-z_]{1,40}$")
_COUNT = re.compile(r"^\d{1,6}$")
APPLIED = "applied"
# What the page's "since" menu offers; any duration in the same syntax is accepted.
SINCE_CHOICES = ("15m", "1h", "24h", "7d", "30d")
BULK_FILTERS = ("disposition", "reason", "kind", "since")
"""The filters a bulk retry or cancel acts on (the command line's bulk form takes the same
ones); any one of them given offers it."""


class BadRequestError(ValueError):
    """A parameter the console cannot use; its message is the line shown."""


@dataclass(frozen=True, slots=True)
class DecisionQuery:
    """The decisions page's filters and its place (``before``: a decision id)."""

    disposition: str | None = None
    reason: str | None = None
    kind: str | None = None
    source: str | None = None
    since: str | None = None
    shadow: bool = False
    before: int | None = None

    def link(self, **changes: object) -> str:
        """This page's URL with ``changes`` applied (None drops a parameter)."""
        query = replace(self, **changes)  # type: ignore[arg-type]
        params = {f.name: getattr(query, f.name) for f in fields(query)}
        params["shadow"] = "1" if query.shadow else None
        return "/decisions" + _query_string(params)

    def export_link(self, fmt: str) -> str:
        """Every decision these filters match (from the newest, whatever page is shown),
        as ``fmt`` (``csv`` or ``json``)."""
        link = self.link(before=None)
        return link.replace("/decisions", f"/decisions.{fmt}", 1)

    def bulk_filters(self) -> dict[str, str]:
        """The ``BULK_FILTERS`` given, by name: what a bulk form's preview shows and its
        hidden fields carry from the page to the preview and on to the confirmation."""
        return {name: value for name in BULK_FILTERS if (value := getattr(self, name))}

    def since_time(self, now: datetime) -> datetime | None:
        """The oldest decision time this query shows, on the database's clock."""
        return None if self.since is None else now - timedelta(seconds=seconds(self.since))


def _query_string(params: dict[str, object]) -> str:
    given = {key: str(value) for key, value in params.items() if value not in (None, "")}
    return "?" + urlencode(given) if given else ""


def seconds(duration: str) -> int:
    """``90s``, ``15m``, ``2h``, ``7d`` in seconds."""
    match = _DURATION.match(duration)
    if match is None:
        raise BadRequestError(f"since must be a duration such as 15m, 1h or 7d, not "
                              f"{duration[:40]!r}")
    return int(match[1]) * _UNIT_SECONDS[match[2]]


def parse_decision_query(params: dict[str, list[str]]) -> DecisionQuery:
    """The filters from a query string's parameters (``parse_qs`` form)."""
    def one(name: str) -> str | None:
        values = params.get(name)
        return values[-1] if values and values[-1] != "" else None

    disposition, reason, source = one("disposition"), one("reason"), one("source")
    _known("disposition", disposition, [d.value for d in Disposition])
    _known("reason", reason, [r.value for r in Reason])
    _known("source", source, list(SOURCES))
    kind = one("kind")
    if kind is not None and len(kind) > MAX_KIND_PATTERN:
        raise BadRequestError(f"kind patterns are at most {MAX_KIND_PATTERN} characters")
    since = one("since")
    if since is not None:
        seconds(since)
    before_text = one("before")
    before = None
    if before_text is not None:
        if not before_text.isdigit() or int(before_text) > MAX_DECISION_ID:
            raise BadRequestError("before must be a decision id")
        before = int(before_text)
    return DecisionQuery(disposition, reason, kind, source, since,
                         one("shadow") in ("1", "true", "yes"), before)


def _known(name: str, value: str | None, allowed: list[str]) -> None:
    if value is not None and value not in allowed:
        raise BadRequestError(f"unknown {name} {value[:40]!r}; one of {', '.join(allowed)}")


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the action a redirect comes from did: one job's (``code``: ``applied`` or why
    it was refused) or a bulk form's counts. Short codes only: never the note's text."""

    action: str
    code: str | None = None
    applied: int | None = None
    refused: int | None = None

    def on(self, link: str) -> str:
        """``link`` (a page's path, with or without a query) carrying this outcome."""
        params: dict[str, object] = {"acted": self.action, "outcome": self.code,
                                     "applied": self.applied, "refused": self.refused}
        return link + ("&" if "?" in link else "?") + _query_string(params).removeprefix("?")


def parse_outcome(params: dict[str, list[str]]) -> Outcome | None:
    """The outcome a redirect left in the query, or None (absent or not well formed: a
    hand-made link shows nothing rather than an error)."""
    def one(name: str) -> str:
        values = params.get(name)
        return values[-1] if values else ""

    action, code, applied, refused = one("acted"), one("outcome"), one("applied"), one("refused")
    if action not in {a.value for a in OperatorAction}:
        return None
    if _CODE.match(code):
        return Outcome(action, code)
    if _COUNT.match(applied) and _COUNT.match(refused):
        return Outcome(action, applied=int(applied), refused=int(refused))
    return None


def job_path(source: object, job_id: object) -> str:
    """The job page's path; the id quoted whole (a UUID, a number, any text)."""
    return f"/jobs/{quote(str(source), safe='')}/{quote(str(job_id), safe='')}"


def job_address(path: str) -> tuple[str, str]:
    """The source and job id of a job page's path (``job_path`` read back)."""
    source, _, job_id = path.removeprefix("/jobs/").partition("/")
    return unquote(source), unquote(job_id)
