"""Exports of decisions and jobs, as CSV and JSON, on SQLite and PostgreSQL: from the command
line (``decisions --format csv``, ``jobs list --format csv``) and from the console's
decisions page (its CSV and JSON links, streamed over the sidecar's HTTP server). Each CSV
is read back row by row against the JSON of the same list; what a spreadsheet would run
as a formula is written inert; worker identities and payloads stay out."""

from __future__ import annotations

import csv
import io
import json
import re
from html import unescape
from typing import Any

import pytest
from sqlalchemy.engine import Engine

from reconciler.exports import DECISION_COLUMNS, JOB_COLUMNS, csv_cell
from reconciler.storage.sql_store import SqlStore
from reconciler.worker import JobClient
from tests.conftest import run_cli
from tests.console_support import HOSTILE_KIND, Seeded, die, fetch, seed, served

pytestmark = pytest.mark.integration

FORMULA_KIND = "=HYPERLINK(\"http://attacker.example\",\"x\")"


@pytest.fixture
def seeded(engine: Engine, client: JobClient) -> Seeded:
    die(client, FORMULA_KIND, "effectful")  # decided by seed's passes with the rest
    return seed(engine, client)


def rows_of(text: str) -> list[dict[str, str]]:
    """A CSV export as a reader (a spreadsheet's import) reads it."""
    return list(csv.DictReader(io.StringIO(text, newline="")))


def as_cells(records: list[dict[str, Any]], columns: tuple[str, ...]) -> list[dict[str, str]]:
    """JSON records as the CSV writes their cells."""
    return [{c: csv_cell(r.get(c)) for c in columns} for r in records]


def test_decisions_export_as_csv_row_for_row_with_the_json(db_url: str, seeded: Seeded
                                                            ) -> None:
    """``decisions --format csv`` and ``--format json`` give the same records, filters
    applied alike; a formula-like kind is written with a leading quote; no worker
    identity or payload anywhere."""
    csv_out = run_cli(db_url, "decisions", "--format", "csv")
    json_out = run_cli(db_url, "decisions", "--format", "json")
    assert (csv_out.returncode, json_out.returncode) == (0, 0), csv_out.stderr
    records = json.loads(json_out.stdout)
    assert records == json.loads(run_cli(db_url, "decisions", "--json").stdout)
    rows = rows_of(csv_out.stdout)
    assert csv_out.stdout.splitlines()[0] == ",".join(DECISION_COLUMNS)
    assert rows == as_cells(records, DECISION_COLUMNS)
    assert len(rows) == 5
    assert {r["job_kind"] for r in rows} >= {"'" + FORMULA_KIND, HOSTILE_KIND}
    for text in (csv_out.stdout, json_out.stdout):
        assert "worker-marker-42" not in text
        assert "payload-marker-42" not in text
    filtered = rows_of(run_cli(db_url, "decisions", "--format", "csv", "--reason",
                               "worker_died_mid_step", "--limit", "2").stdout)
    assert [r["decision_id"] for r in filtered] == [
        r["decision_id"] for r in rows if r["decision_reason"] == "worker_died_mid_step"][:2]


def test_an_export_reads_a_page_at_a_time_and_sees_each_decision_once(
        engine: Engine, seeded: Seeded) -> None:
    """Pages of two: every decision once, newest first, as one read gives them."""
    store = SqlStore(engine)
    whole = store.list_decisions(None, None, 100)
    pages = list(store.decision_pages(None, None, 100, page_size=2))
    assert [len(p) for p in pages] == [2, 2, 1]
    assert [r["decision_id"] for p in pages for r in p] == [r["decision_id"] for r in whole]
    capped = list(store.decision_pages(None, None, 3, page_size=2))
    assert [len(p) for p in capped] == [2, 1]


def test_jobs_list_exports_as_csv_row_for_row_with_the_json(db_url: str, seeded: Seeded
                                                             ) -> None:
    csv_out = run_cli(db_url, "jobs", "list", "--format", "csv")
    assert csv_out.returncode == 0, csv_out.stderr
    records = json.loads(run_cli(db_url, "jobs", "list", "--json").stdout)
    assert rows_of(csv_out.stdout) == as_cells(records, JOB_COLUMNS)
    assert "payload-marker-42" not in csv_out.stdout
    both = run_cli(db_url, "jobs", "list", "--json", "--format", "csv")
    assert both.returncode == 2
    assert "not allowed with argument" in both.stderr


def test_the_console_exports_what_its_filters_match(db_url: str, seeded: Seeded) -> None:
    """The decisions page links its filtered list as CSV and JSON; each is streamed as a
    download, the CSV row for row the JSON, every matching decision (not one page)."""
    with served(db_url) as base:
        page = fetch(base + "/decisions?disposition=terminalize")
        links = {m.group(1): unescape(m.group(2)) for m in re.finditer(
            r'id="export-(csv|json)" href="([^"]+)"', page.body)}
        assert links == {"csv": "/decisions.csv?disposition=terminalize",
                         "json": "/decisions.json?disposition=terminalize"}
        exported = fetch(base + links["csv"])
        as_json = fetch(base + links["json"])
        bad = fetch(base + "/decisions.csv?disposition=nonsense")
    assert exported.status == 200
    assert exported.headers["content-type"] == "text/csv; charset=utf-8"
    assert exported.headers["content-disposition"] == 'attachment; filename="decisions.csv"'
    records = json.loads(as_json.body)
    assert {r["disposition"] for r in records} == {"terminalize"}
    assert rows_of(exported.body) == as_cells(records, DECISION_COLUMNS)
    assert len(records) == 3
    assert "worker-marker-42" not in exported.body + as_json.body
    assert bad.status == 400
