"""The console's routes: GET (and HEAD) pages, a POST only for the login form; the token
checked before any page; every answer with a strict Content-Security-Policy.

Requests come in as (method, target, headers, body) and leave as a ``Reply``, so the
routing is tested without a socket and the sidecar's server only copies bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.resources import files
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from jinja2 import Environment, PackageLoader, StrictUndefined

from reconciler.console.auth import TokenCheck
from reconciler.console.pages import BadRequestError, NotFoundPageError, Page, Pages
from reconciler.console.params import parse_decision_query
from reconciler.redaction import redact
from reconciler.views import printable

log = logging.getLogger("reconciler.console")

MAX_FORM_BYTES = 4096
# No script at all, styles and images only from this origin, forms only to it, never
# framed: an injected tag can neither run nor load anything.
SECURITY_HEADERS: tuple[tuple[str, str], ...] = (
    ("Content-Security-Policy", "default-src 'none'; style-src 'self'; img-src 'self'; "
     "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("X-Frame-Options", "DENY"),
    ("Cache-Control", "no-store"),
)
HTML = "text/html; charset=utf-8"
STATIC = {"/static/console.css": "text/css; charset=utf-8"}


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole HTTP answer."""

    status: int
    body: bytes
    content_type: str = HTML
    headers: tuple[tuple[str, str], ...] = ()


class Console:
    """Routes requests to pages, behind the token when one is set."""

    def __init__(self, pages: Pages, token: str, classify: Callable[[BaseException], str],
                 close: Callable[[], None] = lambda: None) -> None:
        self.pages = pages
        self.classify = classify
        """The bounded code of a database error (the storage's diagnosis)."""
        self.close = close
        """Release what the console holds (its engine's connections)."""
        self.auth = TokenCheck(token)
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
            return self._login(method, parts.query, body)
        if not self.auth.allows(headers):
            return self._render(Page("login.html", {"next": _local(target), "failed": False}),
                                401, (("WWW-Authenticate", 'Bearer realm="console"'),))
        refused = self._only_get(method)
        if refused is not None:
            return refused
        try:
            with self.pages.reading():
                page = self._route(path, parse_qs(parts.query))
            return self._render(page)
        except BadRequestError as exc:
            return self._error(400, str(exc))
        except NotFoundPageError as exc:
            return self._error(404, str(exc))
        except Exception as exc:
            code = self.classify(exc)
            log.warning("event=console_failed error=%s code=%s", type(exc).__name__, code)
            return self._error(503, f"the page could not be read from the database ({code})")

    def _route(self, path: str, query: dict[str, list[str]]) -> Page:
        if path == "/":
            return self.pages.overview()
        if path == "/decisions":
            return self.pages.decisions(parse_decision_query(query))
        if path == "/held":
            return self.pages.held()
        if path == "/rules":
            return self.pages.rules()
        if path.startswith("/jobs/"):
            source, _, job_id = path.removeprefix("/jobs/").partition("/")
            return self.pages.job(unquote(source), unquote(job_id))
        raise NotFoundPageError("no such page")

    def _login(self, method: str, query: str, body: bytes) -> Reply:
        target = _local(parse_qs(query).get("next", ["/"])[-1])
        if method in ("GET", "HEAD"):
            return self._render(Page("login.html", {"next": target, "failed": False}))
        if method != "POST":
            return self._only_get(method) or self._error(405, "method not allowed")
        if len(body) > MAX_FORM_BYTES:
            return self._error(413, "the form is too large")
        form = parse_qs(body.decode("utf-8", "replace"))
        target = _local(form.get("next", [target])[-1])
        if self.auth.matches(form.get("token", [""])[-1]):
            return Reply(303, b"", HTML, (("Location", target),
                                          ("Set-Cookie", self.auth.set_cookie())))
        return self._render(Page("login.html", {"next": target, "failed": True}), 401)

    def _only_get(self, method: str) -> Reply | None:
        if method in ("GET", "HEAD"):
            return None
        return Reply(405, b"the console changes nothing: GET and HEAD only\n",
                     "text/plain; charset=utf-8", (("Allow", "GET, HEAD"),))

    def _render(self, page: Page, status: int = 200,
                headers: tuple[tuple[str, str], ...] = ()) -> Reply:
        template = self.templates.get_template(page.template)
        html = template.render(**page.context, token_required=self.auth.required)
        return Reply(status, html.encode(), HTML, headers)

    def _error(self, status: int, line: str) -> Reply:
        return self._render(Page("error.html", {"status": status, "line": redact(line)}),
                            status)


def job_path(source: object, job_id: object) -> str:
    """The job page's path; the id quoted whole (a UUID, a number, any text)."""
    return f"/jobs/{quote(str(source), safe='')}/{quote(str(job_id), safe='')}"


def _local(target: str) -> str:
    """A path on this console to return to after login; anything else is ``/``."""
    if not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def _shown(value: Any) -> str:
    """Text from the database as shown: control and direction characters made visible
    (autoescaping then makes markup inert)."""
    return printable("" if value is None else str(value))


def _when(value: Any) -> str:
    """A timestamp to the second, in UTC."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if not isinstance(value, datetime):
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
