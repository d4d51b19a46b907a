"""The service's view of its database for ``/readyz``: probed on a thread of its own.

An HTTP probe must never hang on the database (a frozen server would hang it for as long
as it stays frozen). The probe runs on its own thread with short timeouts; a caller gets
the last known state, and when that is older than ``fresh_seconds`` it waits for a new
probe at most ``wait_seconds``, after which a probe still in flight is itself the answer:
the database did not answer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from reconciler.core.vocabulary import DatabaseErrorCode
from reconciler.errors import ReconcilerError
from reconciler.sidecar.parts import DatabaseCheck


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What one probe found: ok, or a bounded code and the one line to show."""

    ok: bool
    line: str
    code: DatabaseErrorCode | None
    at: float  # time.monotonic() when it finished


class DatabaseProbe:
    """Runs the database check ("reachable, schema current, the configured source's tables
    there") on its own thread; the check runs on an engine of its own."""

    def __init__(self, check: DatabaseCheck,
                 classify: Callable[[BaseException], DatabaseErrorCode], *,
                 wait_seconds: float = 0.5, fresh_seconds: float = 1.0) -> None:
        self.database_check = check
        self.classify = classify
        self.wait_seconds = wait_seconds
        self.fresh_seconds = fresh_seconds
        self._changed = threading.Condition()
        self._last: ProbeResult | None = None
        self._running_since: float | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="db-probe")
        self._thread.start()

    def check(self) -> ProbeResult:
        """The database's state, never taking much longer than ``wait_seconds``."""
        with self._changed:
            now = time.monotonic()
            last = self._last
            if self._running_since is None and (last is None
                                                or now - last.at > self.fresh_seconds):
                self._running_since = now
                self._changed.notify_all()
            started = self._running_since
            if started is None and last is not None:
                return last
            deadline = (started or now) + self.wait_seconds
            while self._running_since == started and started is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return ProbeResult(
                        False, f"the database did not answer within {self.wait_seconds:g}s",
                        DatabaseErrorCode.NO_ANSWER, time.monotonic())
                self._changed.wait(left)
            assert self._last is not None
            return self._last

    def close(self) -> None:
        """Stop probing and release the probe's connections (a stuck one is left behind)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join(timeout=0.5)
        if not self._thread.is_alive():
            self.database_check.close()

    def _loop(self) -> None:
        while True:
            with self._changed:
                while self._running_since is None and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
            result = self._probe()
            with self._changed:
                self._last = result
                self._running_since = None
                self._changed.notify_all()

    def _probe(self) -> ProbeResult:
        try:
            self.database_check.run()
        except ReconcilerError as exc:
            return ProbeResult(False, str(exc), self.classify(exc), time.monotonic())
        except Exception as exc:  # never let the probe thread die
            return ProbeResult(False, f"database probe failed: {type(exc).__name__}",
                               self.classify(exc), time.monotonic())
        return ProbeResult(True, "ready", None, time.monotonic())
