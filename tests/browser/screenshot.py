"""The README's picture of the console: ``/`` over a small demo audit, in headless chromium.

    python -m tests.browser.screenshot docs/console.png
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from reconciler.config.settings import Settings
from reconciler.core.decisions import Thresholds
from reconciler.core.passes import PassConfig, run_pass
from reconciler.storage.engines import create_engine
from reconciler.storage.schema import upgrade
from reconciler.storage.sql_store import SqlStore
from reconciler.worker import JobClient
from tests.browser.conftest import open_browser
from tests.console_support import die, seed, served

WIDTH = 1280
QUIET_PASSES = 12


def main(argv: list[str]) -> int:
    """Seed a database, serve it, save a full-page screenshot of ``/`` to ``argv[0]``."""
    out = Path(argv[0] if argv else "docs/console.png")
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{folder}/console.db"
        engine = create_engine(url)
        upgrade(engine)
        with JobClient(engine, settings=Settings(database_url=url)) as client:
            for kind in ("payments.charge", "emails.send", "payments.charge"):
                die(client, kind, "effectful")
            seed(engine, client)
        store = SqlStore(engine)
        for _ in range(QUIET_PASSES):  # nothing stale: folded into one line on the page
            run_pass(store, PassConfig(batch_size=100, thresholds=Thresholds(60.0, 3600.0)))
        browser: Any = open_browser(Path(folder) / "profile")
        try:
            with served(url) as base:
                browser.set_window_size(WIDTH, 900)
                browser.get(base + "/")
                for _ in range(3):  # the height settles once the width is final
                    height = browser.execute_script(
                        "return document.documentElement.scrollHeight")
                    browser.set_window_size(WIDTH, int(height) + 140)
                browser.save_screenshot(str(out))
        finally:
            browser.quit()
        engine.dispose()
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
