"""The operator console in a real browser (headless chromium): pages load, filters narrow
the list, a job page shows its evidence, a hostile kind runs no script, the token holds."""

from __future__ import annotations

from typing import Any

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import Select, WebDriverWait
from sqlalchemy.engine import Engine

from reconciler.worker import JobClient
from tests.console_support import HOSTILE_KIND, Seeded, seed, served

TOKEN = "browser-token-7"  # noqa: S105 - a test's own token


@pytest.fixture
def seeded(engine: Engine, client: JobClient) -> Seeded:
    return seed(engine, client)


def _wait_for(browser: Any, condition: Any) -> None:
    """Until the page the last click loads shows ``condition`` (a form posts, then loads)."""
    WebDriverWait(browser, 30).until(condition)


def _job_links(browser: Any) -> set[str]:
    return {a.get_attribute("pathname") for a in browser.find_elements(By.CSS_SELECTOR, "a.job")}


def test_the_pages_load_and_link_to_each_other(browser: Any, db_url: str, seeded: Seeded
                                               ) -> None:
    """/ shows the state, the chart and the latest decisions; its links lead on."""
    with served(db_url) as base:
        browser.get(base + "/")
        assert browser.title == "Overview · reconciler console"
        assert "not engaged" in browser.find_element(By.ID, "brake-state").text
        assert browser.find_elements(By.CSS_SELECTOR, "svg.chart rect.bar")
        assert f"/jobs/native/{seeded.died_mid_step}" in _job_links(browser)
        for link_text, title in (("Held, parked, gated", "Held, parked and gated jobs"),
                                 ("Decision table", "Decision table"),
                                 ("Decisions", "Decisions")):
            browser.find_element(By.LINK_TEXT, link_text).click()
            _wait_for(browser, expected_conditions.title_is(f"{title} · reconciler console"))
        browser.get(base + "/held")
        assert f"/jobs/native/{seeded.held}" in _job_links(browser)


def test_filters_narrow_the_list(browser: Any, db_url: str, seeded: Seeded) -> None:
    """Choosing a reason and submitting the form (plain HTML, no script) narrows the rows."""
    with served(db_url) as base:
        browser.get(base + "/decisions")
        everything = _job_links(browser)
        Select(browser.find_element(By.NAME, "reason")).select_by_visible_text(
            "resumed_idempotent_step")
        browser.find_element(By.CSS_SELECTOR, "form.filters button").click()
        _wait_for(browser, expected_conditions.url_contains("reason=resumed_idempotent_step"))
        assert _job_links(browser) == {f"/jobs/native/{seeded.resumed}"}
        assert len(everything) > 1


def test_an_operator_reaches_the_evidence_and_rule_of_a_mid_step_death(
    browser: Any, db_url: str, seeded: Seeded
) -> None:
    """From /: the last hour's mid-step deaths, one job, its evidence and deciding rule."""
    with served(db_url) as base:
        browser.get(base + "/")
        browser.find_element(By.LINK_TEXT, "Died mid-step in the last hour").click()
        _wait_for(browser, expected_conditions.title_contains("Decisions"))
        browser.find_element(By.CSS_SELECTOR,
                             f'a.job[href="/jobs/native/{seeded.died_mid_step}"]').click()
        _wait_for(browser, expected_conditions.title_contains("native job"))
        decision = browser.find_element(By.CSS_SELECTOR, "article.decision")
        assert "worker_died_mid_step" in decision.text
        assert "rule 10" in decision.text
        assert "first unfinished step started, effectful" in decision.text
        evidence = {row.find_element(By.TAG_NAME, "th").text:
                    row.find_element(By.TAG_NAME, "td").text
                    for row in decision.find_elements(By.CSS_SELECTOR, "table.evidence tr")}
        assert evidence["step_states"] == "succeeded, started"
        assert evidence["effect_kinds"] == "pure, effectful"
        assert evidence["lease_live"] == "false"  # as JSON and `jobs explain` say it


def test_a_hostile_kind_runs_no_script(browser: Any, db_url: str, seeded: Seeded) -> None:
    """A kind holding <script> and an onerror handler shows as text; the flag either
    would set stays unset."""
    with served(db_url) as base:
        for path in (f"/jobs/native/{seeded.hostile}", "/decisions", "/"):
            browser.get(base + path)
            assert browser.title.endswith("reconciler console")  # the page is there
            assert browser.execute_script("return window.__pwned === undefined")
        browser.get(base + f"/jobs/native/{seeded.hostile}")
        assert browser.find_element(By.CSS_SELECTOR, "strong.kind").text == HOSTILE_KIND
        assert not browser.find_elements(By.CSS_SELECTOR, "main script, main img")


def test_the_token_is_required_and_the_login_form_lets_the_operator_in(
    browser: Any, db_url: str, seeded: Seeded
) -> None:
    """Without the token only the login form shows; a wrong token is refused; the right
    one opens every page for the rest of the visit."""
    with served(db_url, console_token=TOKEN) as base:
        browser.delete_all_cookies()
        browser.get(base + f"/jobs/native/{seeded.died_mid_step}")
        assert browser.title.startswith("Sign in")
        assert "worker_died_mid_step" not in browser.page_source
        browser.find_element(By.NAME, "token").send_keys("not-it")
        browser.find_element(By.CSS_SELECTOR, "main form button").click()
        _wait_for(browser, expected_conditions.presence_of_element_located(
            (By.ID, "login-failed")))
        browser.find_element(By.NAME, "token").send_keys(TOKEN)
        browser.find_element(By.CSS_SELECTOR, "main form button").click()
        _wait_for(browser, expected_conditions.title_contains(
            f"native job {seeded.died_mid_step}"))
        browser.get(base + "/decisions")
        assert browser.title.startswith("Decisions")
        browser.delete_all_cookies()
