"""Telling a person watching a long run what it is doing: a line at least every 10 seconds.

The full chaos runs (ten minutes), the 10,000-example state machine (most of an hour) and
the benchmarks on a million jobs used to print nothing until the end. ``Progress`` prints
the current phase when it starts and then, from a thread of its own, a status line
whenever ``every_seconds`` pass without one, with a bar when the total is known. Short
runs (CI's) finish before the first status line, so they stay quiet.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

BAR_WIDTH = 24


def bar(done: int, total: int) -> str:
    """``[#########...............]  37% 3700/10000``."""
    share = 0.0 if total <= 0 else min(max(done / total, 0.0), 1.0)
    filled = round(share * BAR_WIDTH)
    return f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {share:4.0%} {done}/{total}"


class Progress:
    """Status lines for one long run, on stderr (or ``write``), at least every interval."""

    def __init__(self, name: str, *, every_seconds: float = 10.0,
                 write: Callable[[str], None] | None = None, enabled: bool = True) -> None:
        self.name = name
        self.every_seconds = every_seconds
        self.enabled = enabled
        self._write = write or _to_stderr
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._phase = "starting"
        self._phase_started = self._started
        self._done = 0
        self._total: int | None = None
        self._detail: Callable[[], str] | None = None
        self._last_line = self._started
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __enter__(self) -> Progress:
        if self.enabled:
            self._ticker = threading.Thread(target=self._tick, daemon=True, name="progress")
            self._ticker.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=2)
        if self.enabled and time.monotonic() - self._started >= self.every_seconds:
            self._emit(f"{self.name}: done in {time.monotonic() - self._started:.0f}s")

    def phase(self, text: str, *, total: int | None = None,
              detail: Callable[[], str] | None = None, announce: bool = True) -> None:
        """Start a phase (said at once unless ``announce`` is false); ``total`` gives it a
        bar, ``detail`` adds a line of counters to each status line."""
        with self._lock:
            self._phase, self._total, self._done, self._detail = text, total, 0, detail
            self._phase_started = time.monotonic()
        if announce and self.enabled:
            self._emit(f"{self.name}: {text}")

    def advance(self, done: int) -> None:
        """How much of the phase's total is done."""
        with self._lock:
            self._done = done

    def status(self) -> str:
        """The line the ticker prints: phase, bar, counters, time in phase."""
        with self._lock:
            parts = [f"{self.name}: {self._phase}"]
            if self._total is not None:
                parts.append(bar(self._done, self._total))
            detail = self._detail
            started = self._phase_started
        if detail is not None:
            parts.append(detail())
        parts.append(f"({time.monotonic() - started:.0f}s)")
        return " ".join(p for p in parts if p)

    def _tick(self) -> None:
        while not self._stop.wait(min(1.0, self.every_seconds)):
            if time.monotonic() - self._last_line >= self.every_seconds:
                self._emit(self.status())

    def _emit(self, line: str) -> None:
        self._last_line = time.monotonic()
        self._write(line)


def _to_stderr(line: str, stream: TextIO | None = None) -> None:
    print(line, file=stream or sys.stderr, flush=True)
