"""``reconciler demo``, the README's first command, run as a new user would run it."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO_ROOT
from tests.integration.test_service import child_env

# How long the demo may take before the test gives up: a bound on hanging, not a speed
# claim (it takes about 10 s on an idle machine; CI runs it beside other tests).
DEMO_TIMEOUT_SECONDS = 120.0
EXPECTED_REASONS = ("resumed_from_unstarted_step", "worker_died_mid_step",
                    "resumed_idempotent_step", "resume_exhausted")
# A row of the final table: job id, then the story, the decision, the final status.
TABLE_ROW = re.compile(r"^\s*(\d+)\s{2}(.*)$")


def test_demo_recovers_crashed_workers_and_prints_why(tmp_path: Path) -> None:
    """`reconciler demo` exits 0 and prints a table in which every expected reason
    appears, resumed jobs end completed and the others end as their reason says."""
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "reconciler.cli", "demo"], cwd=REPO_ROOT,
        env=child_env(TMPDIR=str(tmp_path)), capture_output=True, text=True,
        timeout=DEMO_TIMEOUT_SECONDS, check=False,
    )
    took = time.monotonic() - started
    print(f"\n{proc.stdout}\n`reconciler demo` took {took:.1f}s")

    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if "reconciler decision" in line)
    rows = [m.group(2) for line in lines[header + 1:] if (m := TABLE_ROW.match(line))]
    assert len(rows) >= len(EXPECTED_REASONS)
    table = "\n".join(rows)
    for reason in EXPECTED_REASONS:
        assert reason in table, f"{reason} missing from:\n{table}"
    resumed = [row for row in rows if " resumed_" in row]
    assert len(resumed) >= 2
    for row in resumed:
        assert re.search(r"\scompleted\s", row), row
    for row in rows:
        for reason in ("worker_died_mid_step", "resume_exhausted"):
            if f" {reason} " in row:
                assert f"failed ({reason})" in row, row
    # Nothing of the demo is left behind in the temporary directory.
    assert not list(tmp_path.glob("reconciler-demo-*"))
