"""A real browser for the console's tests: Debian's chromium, driven by its chromedriver
through Selenium. Without them the tests skip with the install line, except under
``CI=true``, where that is a failure (``.ci/run`` installs them)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALL_HINT = "apt-get install -y chromium chromium-driver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         "--window-size=1280,1000")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/browser" in str(item.path):
            item.add_marker(pytest.mark.browser)


def open_browser(profile: Path) -> object:
    """Headless chromium with a fresh profile, as the tests and the screenshot use it."""
    from selenium import webdriver  # noqa: PLC0415 - only when a browser is wanted
    from selenium.webdriver.chrome.service import Service  # noqa: PLC0415

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))


@pytest.fixture(scope="session")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One headless chromium for the session (a fresh profile), or a skip naming the fix."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {', '.join(missing)} missing: {INSTALL_HINT}",
                        pytrace=False)
        pytest.skip(f"no browser ({', '.join(missing)} missing): {INSTALL_HINT}")
    driver = open_browser(tmp_path_factory.mktemp("chromium-profile"))
    yield driver
    driver.quit()  # type: ignore[attr-defined]
