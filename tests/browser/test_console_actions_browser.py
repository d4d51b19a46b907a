"""The console's actions in a real browser (headless chromium, no script of ours: plain
forms under the strict CSP): an operator retries a terminalized job and sees the outcome
and the record; the read-only token sees no form and a forged one is 403; bulk retry is
previewed, then confirmed; a hostile note runs nothing; and at incident scale, 2,500 jobs
retried on one count and one confirmation, their export and a job's timeline; and a job's
timeline after two crashes, a resume, a terminalization and an operator's retry, read
entry by entry."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import Select, WebDriverWait
from sqlalchemy.engine import Engine

from reconciler.exports import DECISION_COLUMNS
from reconciler.worker import JobClient
from tests.console_support import Seeded, fetch, seed, served
from tests.helpers import job_row
from tests.integration.test_bulk_chunks import DIED, died_in_bulk, recorded, statuses
from tests.integration.test_exports import as_cells, rows_of
from tests.integration.test_timeline import crashed_retried_job

READER = "browser-reader-0123456789"
ALICE = "browser-alice-0123456789"
HOSTILE_NOTE = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'


@pytest.fixture
def seeded(engine: Engine, client: JobClient) -> Seeded:
    return seed(engine, client)


@pytest.fixture
def tokens(tmp_path: Path) -> dict[str, str]:
    """The read-only token and a tokens file naming alice."""
    path = tmp_path / "operators"
    path.write_text(f"alice {ALICE}\n")
    return {"console_token": READER, "console_operator_tokens_file": str(path)}


def _wait_for(browser: Any, condition: Any) -> None:
    WebDriverWait(browser, 30).until(condition)


def sign_in(browser: Any, base: str, token: str) -> None:
    """Through the login form, as a person would."""
    browser.delete_all_cookies()
    browser.get(base + "/login")
    browser.find_element(By.NAME, "token").send_keys(token)
    browser.find_element(By.CSS_SELECTOR, "main form button").click()
    _wait_for(browser, expected_conditions.title_contains("Overview"))


def test_an_operator_retries_a_terminalized_job_and_sees_the_outcome_and_the_record(
    browser: Any, db_url: str, engine: Engine, seeded: Seeded, tokens: dict[str, str]
) -> None:
    """Sign in as alice, open the job a mid-step death terminalized, retry it with a
    note: the page comes back saying it was applied, with the action in its history."""
    job = seeded.died_mid_step
    with served(db_url, **tokens) as base:
        sign_in(browser, base, ALICE)
        assert browser.find_element(By.ID, "signed-in-as").text == \
            "signed in as alice (operator)"
        browser.get(base + f"/jobs/native/{job}")
        form = browser.find_element(By.CSS_SELECTOR, "form.action.retry")
        form.find_element(By.NAME, "note").send_keys("refund checked, not charged")
        form.find_element(By.TAG_NAME, "button").click()
        _wait_for(browser, expected_conditions.url_contains("outcome=applied"))
        assert browser.find_element(By.ID, "outcome").text == "retry applied."
        record = browser.find_element(By.CSS_SELECTOR, "article.action-record")
        assert "operator retry applied" in record.text
        assert "State failed → queued" in record.text
        assert "refund" not in browser.current_url
        assert "signed in as alice" in browser.find_element(By.ID, "signed-in-as").text
    assert job_row(engine, job)["job_status"] == "queued"


def test_the_read_only_token_sees_no_form_and_a_forged_one_is_refused(
    browser: Any, db_url: str, engine: Engine, seeded: Seeded, tokens: dict[str, str]
) -> None:
    """Signed in read-only: the job page and the filtered list offer no action; a form
    built in the page and posted anyway (same origin, no CSRF token) answers 403."""
    job = seeded.died_mid_step
    with served(db_url, **tokens) as base:
        sign_in(browser, base, READER)
        assert browser.find_element(By.ID, "signed-in-as").text == "signed in read-only"
        # Each page waited for by its title: on a loaded machine the driver may hand back
        # before the page is there, and a missing form would then prove nothing.
        browser.get(base + "/decisions?reason=worker_died_mid_step")
        _wait_for(browser, expected_conditions.title_contains("Decisions"))
        assert not browser.find_elements(By.CSS_SELECTOR, "form.action")
        browser.get(base + f"/jobs/native/{job}")
        _wait_for(browser, expected_conditions.title_contains(f"native job {job}"))
        assert "worker_died_mid_step" in browser.page_source
        assert not browser.find_elements(By.CSS_SELECTOR, "form.action, #actions")
        # The test's own script (the driver's, not the page's) forges the form.
        browser.execute_script(
            "const f = document.createElement('form'); f.method = 'post';"
            "f.action = location.pathname;"
            "for (const [k, v] of [['action', 'retry'], ['note', 'forged']]) {"
            "  const i = document.createElement('input'); i.name = k; i.value = v;"
            "  f.appendChild(i); }"
            "document.body.appendChild(f); f.submit();")
        _wait_for(browser, expected_conditions.title_contains("403"))
        assert "only reads" in browser.find_element(By.ID, "error-line").text
    assert job_row(engine, job)["job_status"] == "failed"


def test_bulk_retry_is_previewed_then_confirmed(
    browser: Any, db_url: str, engine: Engine, seeded: Seeded, tokens: dict[str, str]
) -> None:
    """Filter the list to mid-step deaths, "Retry these" with a note (a hostile one: it
    shows as text), read the preview's jobs and count, confirm: the list says 2 applied."""
    died = {seeded.died_mid_step, seeded.hostile}
    with served(db_url, **tokens) as base:
        sign_in(browser, base, ALICE)
        browser.get(base + "/decisions")
        Select(browser.find_element(By.NAME, "reason")).select_by_visible_text(
            "worker_died_mid_step")
        browser.find_element(By.CSS_SELECTOR, "form.filters button").click()
        _wait_for(browser, expected_conditions.url_contains("reason=worker_died_mid_step"))
        form = browser.find_element(By.CSS_SELECTOR, "#bulk form.action.retry")
        form.find_element(By.NAME, "note").send_keys(HOSTILE_NOTE)
        form.find_element(By.TAG_NAME, "button").click()
        _wait_for(browser, expected_conditions.title_contains("Retry these"))
        assert browser.find_element(By.ID, "bulk-count").text.startswith(
            "2 jobs are in a state to retry now: every job these filters match, counted at ")
        assert browser.find_element(By.CSS_SELECTOR, "q.operator-note").text == HOSTILE_NOTE
        assert browser.execute_script("return window.__pwned === undefined")
        listed = {a.get_attribute("pathname")
                  for a in browser.find_elements(By.CSS_SELECTOR, "ul.targets a.job")}
        assert listed == {f"/jobs/native/{j}" for j in died}
        assert {job_row(engine, j)["job_status"] for j in died} == {"failed"}
        browser.find_element(By.CSS_SELECTOR, "form.confirm button").click()
        _wait_for(browser, expected_conditions.url_contains("applied=2"))
        assert browser.find_element(By.ID, "outcome").text == \
            "retry these: 2 applied, 0 refused (each job's page says why)."
    assert {job_row(engine, j)["job_status"] for j in died} == {"queued"}


def test_at_incident_scale_one_filter_one_count_one_confirmation(
    browser: Any, db_url: str, engine: Engine, client: JobClient, tokens: dict[str, str]
) -> None:
    """2,500 jobs a pass ended: the filtered list's "Retry these" counts all 2,500 (a
    sample listed), one confirmation retries and records every one; the list's CSV export
    link, followed with the browser's session, matches its JSON export row for row; a
    job's page shows its timeline, the retry last."""
    ids = died_in_bulk(client, engine, 2500)
    with served(db_url, **tokens) as base:
        sign_in(browser, base, ALICE)
        browser.get(base + f"/decisions?reason={DIED}")
        # The page's own export links, followed with the browser's session (the console's
        # CSP lets no script of the page fetch them; a click would save a download).
        cookie = "; ".join(f"{c['name']}={c['value']}" for c in browser.get_cookies())
        exports = [fetch(browser.find_element(By.ID, link).get_attribute("href"),
                         headers={"Cookie": cookie}).body
                   for link in ("export-csv", "export-json")]
        form = browser.find_element(By.CSS_SELECTOR, "#bulk form.action.retry")
        form.find_element(By.NAME, "note").send_keys("charges checked: none made")
        form.find_element(By.TAG_NAME, "button").click()
        _wait_for(browser, expected_conditions.title_contains("Retry these"))
        assert browser.find_element(By.ID, "bulk-count").text.startswith(
            "2500 jobs are in a state to retry now")
        assert len(browser.find_elements(By.CSS_SELECTOR, "ul.targets a.job")) == 20
        assert {job_row(engine, j)["job_status"] for j in ids[:3]} == {"failed"}
        browser.find_element(By.CSS_SELECTOR, "form.confirm button").click()
        _wait_for(browser, expected_conditions.url_contains("applied=2500"))
        assert browser.find_element(By.ID, "outcome").text == \
            "retry these: 2500 applied, 0 refused (each job's page says why)."
        browser.get(base + f"/jobs/native/{ids[0]}")
        timeline = [li.get_attribute("class") for li in
                    browser.find_elements(By.CSS_SELECTOR, "#timeline li")]
    assert statuses(engine) == {"queued": 2500}
    assert recorded(engine) == {("retry", "applied"): 2500}
    csv_text, json_text = exports
    records = json.loads(json_text)
    assert len(records) == 2500
    assert rows_of(csv_text) == as_cells(records, DECISION_COLUMNS)
    assert timeline[0] == "claimed"
    assert timeline[-3:] == ["decision", "attempt_ended", "action"]


# What a reader sees of the job ``crashed_retried_job`` builds, one pattern per timeline
# entry (its time cut off), in the order the page lists them: pass ids are the database's,
# so only their form is fixed.
TIMELINE = [
    ("claimed", r"attempt 1 claimed"),
    ("step_started", r"step 0 fetch \[idempotent\] started \(attempt 1\)"),
    ("step_finished", r"step 0 fetch succeeded \(attempt 1\)"),
    ("lease_expired", r"lease ran out, as pass \d+ saw it"),
    ("decision", r"decided resume at step 1 \(resumed_from_unstarted_step\), rule 14"),
    ("attempt_ended", r"attempt 1 ended lost \(by reconciler\)"),
    ("claimed", r"attempt 2 claimed"),
    ("step_started", r"step 1 charge \[effectful\] started \(attempt 2\)"),
    ("lease_expired", r"lease ran out, as pass \d+ saw it"),
    ("decision", r"decided terminalize \(worker_died_mid_step\), rule 10"),
    ("attempt_ended", r"attempt 2 ended lost \(by reconciler\)"),
    ("action", r"operator retry applied by alice: not charged: checked"),
]


def test_a_jobs_timeline_after_two_crashes_a_resume_a_terminalization_and_a_retry(
    browser: Any, db_url: str, engine: Engine, client: JobClient, tokens: dict[str, str]
) -> None:
    """The job ``jobs show``'s test builds (attempt 1 dies after ``fetch`` and is resumed,
    attempt 2 dies inside ``charge`` and is ended, alice retries it with a note), on its
    page as an operator reads it: every entry, in time order, each decision linking its
    rule, and no trace of the worker that claimed it."""
    job = crashed_retried_job(engine, client)
    with served(db_url, **tokens) as base:
        sign_in(browser, base, ALICE)
        browser.get(base + f"/jobs/native/{job}")
        _wait_for(browser, expected_conditions.title_contains(f"native job {job}"))
        entries = browser.find_elements(By.CSS_SELECTOR, "#timeline li")
        read = [(li.get_attribute("class"), li.find_element(By.TAG_NAME, "time").text,
                 " ".join(li.text.split())) for li in entries]
        rules = [a.get_attribute("pathname") + a.get_attribute("hash") for a in
                 browser.find_elements(By.CSS_SELECTOR, "#timeline li.decision a")]
        # The decisions recorded, newest first, each naming the pass that made it.
        deciders = [re.findall(r"^Pass (\d+);", p.text)[0] for p in browser.find_elements(
            By.CSS_SELECTOR, "article.decision p.note")]
        page = browser.page_source
    shown = [(kind, text.removeprefix(at).strip()) for kind, at, text in read]
    assert len(shown) == len(TIMELINE), shown
    for (kind, text), (want_kind, pattern) in zip(shown, TIMELINE, strict=True):
        assert kind == want_kind, shown
        assert re.fullmatch(pattern, text), (text, pattern)
    # Each lease running out is credited to the pass that then decided about it.
    passes = [text.split()[-3] for kind, text in shown if kind == "lease_expired"]
    assert passes == deciders[::-1], (passes, deciders)
    assert rules == ["/rules#rule-14", "/rules#rule-10"]
    # Time order as the page prints it (to the second, UTC): an attempt a pass ended is
    # listed right after the decision that ended it, whenever its row says it closed.
    times = [datetime.strptime(at, "%Y-%m-%d %H:%M:%S")
             for kind, at, _ in read if kind != "attempt_ended"]
    assert times == sorted(times), read
    # The name both claims gave as their worker: the console keeps worker identities out.
    assert "worker-marker-7" not in page
