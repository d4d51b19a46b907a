"""The console's routes: GET (and HEAD) pages; POST for the login form, sign-out and an
operator's action forms only, each checked for this console's origin (and the actions for
an operator's session and its CSRF token) before anything is read; every answer with a
strict Content-Security-Policy.

Requests come in as (method, target, headers, body) and leave as a ``Reply``, so the
routing is tested without a socket and the sidecar's server only copies bytes.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.resources import files
from typing import Any
from urllib.parse import parse_qs, urlsplit

from jinja2 import Environment, PackageLoader, StrictUndefined

from reconciler.console.acting import Acting, Redirect
from reconciler.console.auth import Access, Viewer, csrf_holds
from reconciler.console.pages import BadRequestError, NotFoundPageError, Page, Pages
from reconciler.console.params import (
    job_address,
    job_path,
    parse_decision_query,
    parse_outcome,
)
from reconciler.exports import DECISION_COLUMNS, csv_chunks, json_chunks
from reconciler.redaction import redact
from reconciler.views import printable

log = logging.getLogger("reconciler.console")

# A form carries a note of at most 1,000 characters and a few fields beside it.
MAX_FORM_BYTES = 16384
# No script at all, styles and images only from this origin, forms only to it, never
# framed: an injected tag can neither run nor load anything.
SECURITY_HEADERS: tuple[tuple[str, str], ...] = (
    ("Content-Security-Policy", "default-src 'none'; style-src 'self'; img-src 'self'; "
     "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    # Not no-referrer: with it Chromium sends ``Origin: null`` on the console's own forms.
    ("Referrer-Policy", "same-origin"),
    ("X-Frame-Options", "DENY"),
    ("Cache-Control", "no-store"),
)
HTML = "text/html; charset=utf-8"
STATIC = {"/static/console.css": "text/css; charset=utf-8"}


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole HTTP answer, or (``stream``) one written as it is read."""

    status: int
    body: bytes
    content_type: str = HTML
    headers: tuple[tuple[str, str], ...] = ()
    stream: Iterable[bytes] | None = None
    """The body in chunks, instead of ``body``: sent without a length, the connection
    closed at its end (an export)."""


EXPORTS = {"/decisions.csv": "text/csv; charset=utf-8",
           "/decisions.json": "application/json"}
"""The decisions page's exports: every decision its filters match."""


class Console:
    """Routes requests to pages, behind the tokens when any is set."""

    def __init__(self, pages: Pages, access: Access, classify: Callable[[BaseException], str],
                 close: Callable[[], None] = lambda: None, acting: Acting | None = None
                 ) -> None:
        self.pages = pages
        self.classify = classify
        """The bounded code of a database error (the storage's diagnosis)."""
        self.close = close
        """Release what the console holds (its engine's connections)."""
        self.access = access
        self.acting = acting if access.operators else None
        """The action forms (None: no operator token is configured, so none is offered)."""
        self.templates = Environment(
            loader=PackageLoader("reconciler.console", "templates"), autoescape=True,
            undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
        self.templates.filters.update(shown=_shown, when=_when)
        self.templates.globals["job_path"] = job_path
        self.static = {path: files("reconciler.console").joinpath(
            "static", path.rsplit("/", 1)[1]).read_bytes() for path in STATIC}

    def handle(self, method: str, target: str, headers: Mapping[str, str],
               body: bytes = b"") -> Reply:
        """Answer one request; ``headers`` with lower-case names. Never raises."""
        parts = urlsplit(target)
        path = parts.path
        if path in self.static:
            return self._only_get(method) or Reply(200, self.static[path], STATIC[path])
        if path == "/login":
            return self._login(method, parts.query, headers, body)
        viewer = self.access.viewer(headers)
        if viewer is None:
            return self._render(Page("login.html", {"next": _local(target), "failed": False}),
                                Viewer(), 401, (("WWW-Authenticate", 'Bearer realm="console"'),))
        if method == "POST" and (path in ("/logout", "/decisions/bulk")
                                 or path.startswith("/jobs/")):
            return self._post(path, viewer, headers, body)
        refused = self._only_get(method)
        if refused is not None:
            return refused
        if path in EXPORTS:
            return self._export(path, parse_qs(parts.query), viewer)
        return self._guarded(viewer, lambda: self._route(path, parse_qs(parts.query), viewer))

    def _guarded(self, viewer: Viewer, answer: Callable[[], Page | Redirect], *,
                 reading: bool = True) -> Reply:
        """A page (``reading``: its reads in one read-only transaction) or a redirect; a
        bad request, a missing page or a database failure as one line."""
        try:
            with self.pages.reading() if reading else nullcontext():
                page = answer()
        except BadRequestError as exc:
            return self._error(400, str(exc), viewer)
        except NotFoundPageError as exc:
            return self._error(404, str(exc), viewer)
        except Exception as exc:
            code = self.classify(exc)
            log.warning("event=console_failed error=%s code=%s", type(exc).__name__, code)
            return self._error(503, f"the database could not answer ({code})", viewer)
        if isinstance(page, Redirect):
            return Reply(303, b"", HTML, (("Location", page.location),))
        return self._render(page, viewer)

    def _route(self, path: str, query: dict[str, list[str]], viewer: Viewer) -> Page:
        acting = self.acting is not None and viewer.may_act
        if path == "/":
            return self.pages.overview()
        if path == "/decisions":
            return self.pages.decisions(parse_decision_query(query), acting=acting,
                                        outcome=parse_outcome(query))
        if path == "/held":
            return self.pages.held()
        if path == "/rules":
            return self.pages.rules()
        if path.startswith("/jobs/"):
            return self.pages.job(*job_address(path), acting=acting,
                                  outcome=parse_outcome(query))
        raise NotFoundPageError("no such page")

    def _export(self, path: str, query: dict[str, list[str]], viewer: Viewer) -> Reply:
        """Every decision the filters match, streamed as CSV or JSON (the records the page
        shows, redacted alike); a bad filter is a 400 before anything is sent."""
        try:
            filters = parse_decision_query(query)
        except BadRequestError as exc:
            return self._error(400, str(exc), viewer)
        pages = self.pages.export_pages(filters)
        try:
            # The first page read before the answer starts: a database that cannot answer
            # is a 503 line, not an empty export.
            first = next(pages, [])
        except Exception as exc:
            code = self.classify(exc)
            log.warning("event=console_failed error=%s code=%s", type(exc).__name__, code)
            return self._error(503, f"the database could not answer ({code})", viewer)
        pages = itertools.chain([first], pages)
        fmt = path.rsplit(".", 1)[1]
        chunks = (json_chunks(pages) if fmt == "json"
                  else csv_chunks(DECISION_COLUMNS, pages))
        return Reply(200, b"", EXPORTS[path],
                     (("Content-Disposition", f'attachment; filename="decisions.{fmt}"'),),
                     stream=(chunk.encode() for chunk in chunks))

    def _post(self, path: str, viewer: Viewer, headers: Mapping[str, str],
              body: bytes) -> Reply:
        """A form: refused (403, logged, never recorded as an action) unless it comes from
        this console's own page, and, for an action, from an operator's session with its
        CSRF token."""
        if len(body) > MAX_FORM_BYTES:
            return self._error(413, "the form is too large", viewer)
        if viewer.bearer:
            # Said before the origin check: a script sends no Origin, and that is not why.
            return self._forbidden(viewer, "bearer_token",
                                   "a bearer token reads only: acting needs an operator "
                                   "signed in at /login (the forms carry its session)")
        if not _same_origin(headers):
            return self._forbidden(viewer, "foreign_origin",
                                   "this form was not sent from this console's own page")
        if path == "/logout":
            return Reply(303, b"", HTML, (("Location", "/login"),
                                          ("Set-Cookie", self.access.sign_out())))
        acting = self.acting
        if acting is None or viewer.operator is None or not viewer.may_act:
            return self._forbidden(viewer, "read_only",
                                   "this token only reads: acting needs an operator's token "
                                   "(console_operator_tokens_file), signed in at /login")
        form = parse_qs(body.decode("utf-8", "replace"))
        if not csrf_holds(viewer, form.get("csrf", [""])[-1]):
            return self._forbidden(viewer, "csrf",
                                   "the form is not from this session: reload the page")
        actor = viewer.operator
        # Outside a page's read transaction: an action writes (SQLite has one writer).
        return self._guarded(viewer, lambda: acting.post(path, form, actor), reading=False)

    def _forbidden(self, viewer: Viewer, why: str, line: str) -> Reply:
        log.warning("event=console_post_refused why=%s", why)
        return self._error(403, line, viewer)

    def _login(self, method: str, query: str, headers: Mapping[str, str],
               body: bytes) -> Reply:
        target = _local(parse_qs(query).get("next", ["/"])[-1])
        anonymous = Viewer()
        if method in ("GET", "HEAD"):
            # Someone signed in still sees who they are, as on every page.
            return self._render(Page("login.html", {"next": target, "failed": False}),
                                self.access.viewer(headers) or anonymous)
        if method != "POST":
            return self._only_get(method) or self._error(405, "method not allowed", anonymous)
        if len(body) > MAX_FORM_BYTES:
            return self._error(413, "the form is too large", anonymous)
        if not _same_origin(headers):
            return self._forbidden(anonymous, "foreign_origin",
                                   "this form was not sent from this console's own page")
        form = parse_qs(body.decode("utf-8", "replace"))
        target = _local(form.get("next", [target])[-1])
        cookie = self.access.sign_in(form.get("token", [""])[-1])
        if cookie is not None:
            return Reply(303, b"", HTML, (("Location", target), ("Set-Cookie", cookie)))
        return self._render(Page("login.html", {"next": target, "failed": True}), anonymous,
                            401)

    def _only_get(self, method: str) -> Reply | None:
        if method in ("GET", "HEAD"):
            return None
        return Reply(405, b"GET and HEAD only (and POST for the forms)\n",
                     "text/plain; charset=utf-8", (("Allow", "GET, HEAD, POST"),))

    def _render(self, page: Page, viewer: Viewer, status: int = 200,
                headers: tuple[tuple[str, str], ...] = ()) -> Reply:
        template = self.templates.get_template(page.template)
        html = template.render(**page.context, token_required=self.access.required,
                               viewer=viewer)
        return Reply(status, html.encode(), HTML, headers)

    def _error(self, status: int, line: str, viewer: Viewer) -> Reply:
        return self._render(Page("error.html", {"status": status, "line": redact(line)}),
                            viewer, status)


def _same_origin(headers: Mapping[str, str]) -> bool:
    """The form came from a page of this console: its ``Origin`` (or, without one, its
    ``Referer``) names the host the request was sent to."""
    host = headers.get("host", "")
    sent_from = headers.get("origin") or headers.get("referer", "")
    parts = urlsplit(sent_from)
    return bool(host) and parts.scheme in ("http", "https") and parts.netloc == host


def _local(target: str) -> str:
    """A path on this console to return to after login; anything else is ``/``."""
    if not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def _shown(value: Any) -> str:
    """Text from the database as shown: control and direction characters made visible
    (autoescaping then makes markup inert); a boolean as JSON and `jobs explain` say it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return printable("" if value is None else str(value))


def _when(value: Any) -> str:
    """A timestamp to the second, in UTC."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if not isinstance(value, datetime):
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
