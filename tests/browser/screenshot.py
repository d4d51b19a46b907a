"""The README's pictures of the console, from a real run: ``reconciler demo --keep`` (real
worker processes SIGKILLed mid-job, a pass deciding each), then ``reconciler run`` over
that database with a read-only token and an operator's; headless chromium signs in as
each and saves the job page of the job whose worker died mid-publish.

    python -m tests.browser.screenshot docs/console.png docs/console-readonly.png
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

from tests.browser.conftest import open_browser

WIDTH = 1280
READER = "screenshot-reader-token"
OPERATOR = ("dana", "screenshot-operator-token")
NOTE = "publish checked in the CMS: the report never went out"
RECONCILER = [sys.executable, "-m", "reconciler.cli"]


def main(argv: list[str]) -> int:
    """Run the demo and the sidecar, save the operator's and the reader's job page."""
    operator_png = Path(argv[0] if argv else "docs/console.png")
    reader_png = Path(argv[1] if len(argv) > 1 else "docs/console-readonly.png")
    demo = subprocess.run([*RECONCILER, "demo", "--keep"], check=True, capture_output=True,
                          text=True).stdout
    found = re.search(r"--database-url (sqlite:///\S+)", demo)
    assert found is not None, demo
    url = found[1]
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
            job = _died_mid_publish(base)
            _sign_in(browser, base, OPERATOR[1])
            browser.get(f"{base}/jobs/native/{job}")
            browser.find_element(By.CSS_SELECTOR, "form.action.retry textarea").send_keys(NOTE)
            _save(browser, operator_png)
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
    print(f"saved {operator_png} and {reader_png} (job {job})")
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


def _died_mid_publish(base: str) -> str:
    """The job the demo's pass terminalized because its worker died mid-publish."""
    request = urllib.request.Request(  # noqa: S310 - the run's own address
        base + "/decisions?reason=worker_died_mid_step",
        headers={"Authorization": f"Bearer {READER}"})
    with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310
        found = re.search(r'href="/jobs/native/(\d+)"', answer.read().decode())
    assert found is not None
    return found[1]


def _sign_in(browser: Any, base: str, token: str) -> None:
    browser.get(base + "/login")
    browser.find_element(By.NAME, "token").send_keys(token)
    browser.find_element(By.CSS_SELECTOR, "main form button").click()
    deadline = time.monotonic() + 30
    while "Sign in" in browser.title and time.monotonic() < deadline:
        time.sleep(0.1)


def _save(browser: Any, out: Path) -> None:
    browser.set_window_size(WIDTH, 900)
    for _ in range(3):  # the height settles once the width is final
        height = browser.execute_script("return document.documentElement.scrollHeight")
        browser.set_window_size(WIDTH, int(height) + 140)
    browser.save_screenshot(str(out))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
