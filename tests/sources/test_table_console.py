"""The console acts on a foreign source (issue 27): a named operator retries and cancels a
mapped table's jobs from their job pages, over HTTP, on SQLite and PostgreSQL; the record
says who and why, and the table's rows end in the mapping's queued and cancelled statuses.

The console is the one ``reconciler run`` serves for a ``[source] kind = "table"``,
assembled by the composition root; the job that is retried was failed by a real pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from urllib.parse import quote_plus

from reconciler.config.loader import Config
from reconciler.config.settings import Settings
from reconciler.root.jobs import open_jobs
from reconciler.root.sidecar import assemble_sidecar
from reconciler.sidecar.service import Service
from reconciler.storage.sql_store import SqlStore
from reconciler.views import job_list_lines, job_view
from tests.console_support import fetch, serving
from tests.integration.test_console_actions import csrf_of, offered, post, sign_in
from tests.sources.test_table_actions import (
    SOURCE,
    recorded,
    table_home,
    terminalized,
)
from tests.sources.test_table_source import KINDS, Home, add, home, row

__all__ = ["home", "table_home"]  # the fixtures, found by name

ALICE = "alice-token-0123456789"
READER = "reader-token-0123456789"


@contextmanager
def served(home: Home, tmp_path: Path) -> Iterator[str]:
    """``reconciler run``'s HTTP server (no scheduled passes) over the mapped table, with
    alice as the one operator; its base URL."""
    tokens = tmp_path / "operators"
    tokens.write_text(f"alice {ALICE}\n")
    settings = Settings(database_url=home.engine.url.render_as_string(hide_password=False),
                        metrics_port=0, console_token=READER,
                        console_operator_tokens_file=str(tokens))
    mapping = replace(home.full, cancelled="cancelled")
    with serving(Service(assemble_sidecar(Config(settings=settings, source=mapping,
                                                 kinds=KINDS)))) as base:
        yield base


def _act(base: str, cookie: str, job: int, action: str, note: str) -> str:
    """One action from the job page's form; the page it redirects to."""
    page = fetch(base + f"/jobs/{SOURCE}/{job}", headers={"Cookie": cookie})
    assert page.status == 200, page.body
    assert action in offered(page.body)
    acted = post(base, f"/jobs/{SOURCE}/{job}", cookie,
                 f"csrf={csrf_of(page)}&action={action}&note={quote_plus(note)}")
    assert acted.status == 303, acted.body
    assert acted.headers["location"] == (
        f"/jobs/{SOURCE}/{job}?acted={action}&outcome=applied")
    return fetch(base + acted.headers["location"], headers={"Cookie": cookie}).body


def test_an_operator_retries_and_cancels_table_jobs_from_their_pages(
        table_home: Home, tmp_path: Path) -> None:
    """A job a pass failed offers retry; retried, its row is in the mapping's queued
    status at its first unfinished step. A queued job offers cancel; cancelled, its row
    is in the mapped cancelled status. Each page then says applied, and the record keeps
    alice and her note, with the row's state before and after."""
    failed = terminalized(table_home)
    waiting = add(table_home, status="pending", claimed_by=None, attempts=0,
                  job_type="mail.send")
    with served(table_home, tmp_path) as base:
        cookie = sign_in(base, ALICE)
        retried = _act(base, cookie, failed, "retry", "refund checked, not charged")
        cancelled = _act(base, cookie, waiting, "cancel", "customer asked")
    for page, action in ((retried, "retry"), (cancelled, "cancel")):
        assert f'id="outcome">{action} applied' in page
        assert "signed in as <strong>alice</strong>" in page
    assert "refund checked, not charged" in retried
    assert "customer asked" in cancelled
    assert (row(table_home, failed)["status"], row(table_home, failed)["resume_step"]) == (
        "pending", 1)
    assert row(table_home, waiting)["status"] == "cancelled"
    [retry] = recorded(table_home, failed)
    [cancel] = recorded(table_home, waiting)
    assert (retry["operator_action"], retry["action_outcome"], retry["acted_by"],
            retry["operator_note"]) == ("retry", "applied", "alice",
                                        "refund checked, not charged")
    assert (cancel["operator_action"], cancel["action_outcome"], cancel["acted_by"],
            cancel["operator_note"]) == ("cancel", "applied", "alice", "customer asked")
    assert (retry["state_before"], cancel["state_after"]) == ("failed", "cancelled")


def test_holds_on_table_jobs_are_listed_marked_and_liftable_after_the_job_ends(
        table_home: Home, tmp_path: Path) -> None:
    """Alice holds two jobs of the table from their pages: the held page lists both with
    who held them (never "none"), ``jobs list`` marks both held; one then ends in its
    system (the app's worker finished it) and its hold is still lifted, from its page."""
    running = add(table_home, status="processing", job_type="mail.send")
    waiting = add(table_home, status="pending", claimed_by=None, attempts=0,
                  job_type="mail.send")
    mapping = replace(table_home.full, cancelled="cancelled")
    with served(table_home, tmp_path) as base:
        cookie = sign_in(base, ALICE)
        for job in (running, waiting):
            assert 'id="outcome">hold applied' in _act(base, cookie, job, "hold", "look")
        held_page = fetch(base + "/held", headers={"Cookie": cookie}).body
        section = held_page[held_page.index('id="foreign-holds"'):]
        section = section[:section.index("</section>")]
        # Each of the two jobs' rows names alice (the shared database may hold other
        # sources' holds: only this source's rows are read).
        rows = [row for row in section.split("<tr>")
                if any(f'href="/jobs/{SOURCE}/{job}"' in row for job in (running, waiting))]
        assert len(rows) == 2
        assert all("<td>alice</td>" in row for row in rows)
        jobs = open_jobs(table_home.engine, mapping, KINDS, SqlStore(table_home.engine))
        listed = {str(d.job_id): d.operator_hold for d in jobs.list_jobs(None, 10)}
        assert (listed[str(running)], listed[str(waiting)]) == (True, True)
        lines = job_list_lines([job_view(d) for d in jobs.list_jobs(None, 10)])
        assert sum("(held)" in line for line in lines) == 2
        with table_home.engine.begin() as conn:  # the app's own worker finishes it
            conn.execute(table_home.jobs.update().where(table_home.jobs.c.id == running)
                         .values(status="done"))
        page = _act(base, cookie, running, "unhold", "done anyway")
        assert 'id="outcome">unhold applied' in page
        assert f'href="/jobs/{SOURCE}/{running}"' not in fetch(
            base + "/held", headers={"Cookie": cookie}).body
