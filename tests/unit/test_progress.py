"""Long runs say what they are doing: a status line at least every interval, a bar where
the total is known, and nothing more for runs shorter than one interval."""

from __future__ import annotations

import time

from tests.progress import Progress, bar


def test_a_long_phase_prints_a_bar_at_least_every_interval() -> None:
    """A phase with a total gets status lines with its bar, one per interval or more."""
    lines: list[str] = []
    with Progress("run", every_seconds=0.2, write=lines.append) as progress:
        progress.phase("examples", total=10, detail=lambda: "kills 3/5")
        for n in range(1, 8):
            progress.advance(n)
            time.sleep(0.1)
    assert lines[0] == "run: examples"
    status = [line for line in lines[1:] if "[" in line]
    assert len(status) >= 2, lines
    assert all(line.startswith("run: examples [") and "kills 3/5" in line for line in status)
    assert lines[-1].startswith("run: done in")


def test_a_short_run_says_only_its_phases() -> None:
    """Shorter than one interval: the phase line, no status line, no "done" line."""
    lines: list[str] = []
    with Progress("run", every_seconds=10, write=lines.append) as progress:
        progress.phase("quick")
    assert lines == ["run: quick"]


def test_disabled_progress_prints_nothing() -> None:
    """enabled=False (CI's short runs, --quiet) prints nothing at all."""
    lines: list[str] = []
    with Progress("run", every_seconds=0.05, write=lines.append, enabled=False) as progress:
        progress.phase("quiet", total=3)
        time.sleep(0.2)
    assert lines == []


def test_the_bar_shows_share_and_counts() -> None:
    """Half done is half a bar, with the counts."""
    assert bar(5, 10) == "[############............]  50% 5/10"
    assert bar(12, 10).endswith("100% 12/10")
