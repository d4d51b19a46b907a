"""The README's pictures of the console, from a real run: ``reconciler demo --keep`` (real
worker processes SIGKILLed mid-job, a pass deciding each), then, in the same database, the
job whose timeline ``jobs show``'s test tells (two crashes, a resume, a terminalization,
an operator's retry) and 2,500 jobs a pass ended mid-charge, as the incident-scale test
makes them; then ``reconciler run`` over that database with a read-only token and an
operator's. Headless chromium signs in as each and saves the job page of the job whose
worker died mid-publish; as the operator, also the timeline job's page and the "Retry
these" confirmation of the 2,500.

    python -m tests.browser.screenshot docs/console.png docs/console-readonly.png \
        docs/console-timeline.png docs/console-bulk-confirmation.png
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

from reconciler.config.settings import Settings
from reconciler.storage.engines import create_engine
from reconciler.worker import JobClient
from tests.browser.conftest import open_browser
from tests.integration.test_bulk_chunks import DIED, died_in_bulk
from tests.integration.test_timeline import crashed_retried_job

WIDTH = 1280
READER = "screenshot-reader-token"
OPERATOR = ("dana", "screenshot-operator-token")
NOTE = "publish checked in the CMS: the report never went out"
RECONCILER = [sys.executable, "-m", "reconciler.cli"]
BULK = 2500
BULK_NOTE = "charges checked in the PSP: none of these was charged"


def main(argv: list[str]) -> int:
    """Run the demo, add the timeline job and the 2,500, run the sidecar, save the
    operator's and the reader's job page, the timeline and the bulk confirmation."""
    operator_png, reader_png, timeline_png, bulk_png = (
        Path(argv[i] if len(argv) > i else default) for i, default in enumerate((
            "docs/console.png", "docs/console-readonly.png", "docs/console-timeline.png",
            "docs/console-bulk-confirmation.png")))
    demo = subprocess.run([*RECONCILER, "demo", "--keep"], check=True, capture_output=True,
                          text=True).stdout
    found = re.search(r"--database-url (sqlite:///\S+)", demo)
    assert found is not None, demo
    url = found[1]
    # Read from the demo's own table: once the 2,500 are there, the decisions list's newest
    # worker_died_mid_step is one of them, not the demo's.
    publish = re.search(r"^\s*(\d+)\s+killed mid effectful step \(publish\)", demo, re.M)
    assert publish is not None, demo
    job = publish[1]
    timeline_job = _add_incident(url)
    with tempfile.TemporaryDirectory() as folder:
        tokens = Path(folder) / "operators"
        tokens.write_text(f"{OPERATOR[0]} {OPERATOR[1]}\n")
        port = _free_port()
        env = {**os.environ, "RECONCILER_CONSOLE_TOKEN": READER,
               "RECONCILER_CONSOLE_OPERATOR_TOKENS_FILE": str(tokens)}
        run = subprocess.Popen([*RECONCILER, "run", "--database-url", url,
                                "--metrics-port", str(port), "--interval-seconds", "60"],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        browser: Any = open_browser(Path(folder) / "profile")
        try:
            _wait_ready(base)
            _sign_in(browser, base, OPERATOR[1])
            browser.get(f"{base}/jobs/native/{job}")
            browser.find_element(By.CSS_SELECTOR, "form.action.retry textarea").send_keys(NOTE)
            _save(browser, operator_png)
            browser.get(f"{base}/jobs/native/{timeline_job}")
            assert len(browser.find_elements(By.CSS_SELECTOR, "#timeline li")) == 12
            _save(browser, timeline_png, until="#timeline")
            _bulk_confirmation(browser, base)
            _save(browser, bulk_png)
            browser.find_element(By.CSS_SELECTOR, "form.who button").click()
            _sign_in(browser, base, READER)
            browser.get(f"{base}/jobs/native/{job}")
            _save(browser, reader_png)
        finally:
            browser.quit()
            run.send_signal(signal.SIGTERM)
            run.wait(timeout=60)
    # The demo's own temporary folder, which --keep left behind.
    shutil.rmtree(Path(url.removeprefix("sqlite:///")).parent)
    print(f"saved {operator_png} and {reader_png} (job {job}), {timeline_png} (job "
          f"{timeline_job}) and {bulk_png} ({BULK} jobs)")
    return 0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_ready(base: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(base + "/healthz", timeout=5):  # noqa: S310 - ours
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _add_incident(url: str) -> int:
    """The timeline job and the 2,500 (kind ``billing.charge``, which no demo job has), made
    before the sidecar runs so that only these helpers' passes decide them; the id of the
    timeline job, which its operator's retry left queued, outside the 2,500's count."""
    engine = create_engine(url)
    try:
        with JobClient(engine, settings=Settings(database_url=url)) as client:
            job = crashed_retried_job(engine, client)
            died_in_bulk(client, engine, BULK)
    finally:
        engine.dispose()
    return job


def _bulk_confirmation(browser: Any, base: str) -> None:
    """The 2,500's list, filtered by reason and kind, and its "Retry these…" with a note:
    the page that asks to confirm that count (left unconfirmed)."""
    browser.get(f"{base}/decisions?reason={DIED}&kind=billing.charge")
    form = browser.find_element(By.CSS_SELECTOR, "#bulk form.action.retry")
    form.find_element(By.NAME, "note").send_keys(BULK_NOTE)
    form.find_element(By.TAG_NAME, "button").click()
    WebDriverWait(browser, 60).until(expected_conditions.title_contains("Retry these"))
    count = browser.find_element(By.ID, "bulk-count").text
    assert count.startswith(f"{BULK} jobs are in a state to retry now"), count


def _sign_in(browser: Any, base: str, token: str) -> None:
    browser.get(base + "/login")
    browser.find_element(By.NAME, "token").send_keys(token)
    browser.find_element(By.CSS_SELECTOR, "main form button").click()
    deadline = time.monotonic() + 30
    while "Sign in" in browser.title and time.monotonic() < deadline:
        time.sleep(0.1)


def _save(browser: Any, out: Path, until: str | None = None) -> None:
    """The whole page, or its top down to the element ``until`` names (the timeline above
    the job's long evidence tables, legible at the width the docs show it)."""
    browser.set_window_size(WIDTH, 900)
    for _ in range(3):  # the height settles once the width is final
        height = browser.execute_script("return document.documentElement.scrollHeight")
        browser.set_window_size(WIDTH, int(height) + 140)
    if until is not None:
        bottom = browser.execute_script(
            "return arguments[0].getBoundingClientRect().bottom",
            browser.find_element(By.CSS_SELECTOR, until))
        # The window's chrome takes some of its height; with a cut page the scrollbar
        # would show, so the driver (not the page, whose CSP allows no script) hides it.
        browser.execute_script("document.documentElement.style.overflow = 'hidden'")
        inner = browser.execute_script("return window.innerHeight")
        outer = browser.get_window_size()["height"]
        browser.set_window_size(WIDTH, int(bottom) + 24 + int(outer) - int(inner))
    browser.save_screenshot(str(out))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
