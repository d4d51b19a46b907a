"""The processes of a foreign chaos run: real workers of the system and ``reconciler run``
replicas, each dying with the harness (Linux's parent-death signal), and the marker files
the workers' tasks leave."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.coverage_scope import unmeasured

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the harness dies, even by SIGKILL."""
    # The harness starts children from its main thread only (the signal follows that
    # thread).
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass
class Child:
    """One process the run started."""

    role: str  # "worker" | "replica"
    slot: int
    popen: subprocess.Popen[bytes]
    log: Path
    stopped_until: float | None = None  # SIGSTOPped until then (monotonic)
    killed: bool = False  # SIGKILLed by the run
    reaped: bool = False  # its death seen by the run (counted, aged, respawned) once

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, sig)


UNREACHABLE_AT_START = "replica:database_unreachable_at_start"
"""A replica started while PostgreSQL restarted: ``reconciler run`` refuses to start on a
database it cannot use (one line naming the database, exit 3: not reached, not answering
in time, or "the database system is starting up"), as it does for a user; the harness
starts it again, as an orchestrator would."""


NAME_TAKEN = "worker:name_taken"
"""A worker started under a fixed name while its dead predecessor's is still registered:
RQ refuses it (``There exists an active worker named ...``) until that name's key expires;
the harness starts it again, as a supervisor would."""


def exit_cause(child: Child) -> str:
    """Why a child exited that the run did not kill: ``role:exit_CODE``, or
    ``UNREACHABLE_AT_START`` or ``NAME_TAKEN`` when its last lines say so."""
    code = child.popen.returncode
    lines = child.log.read_bytes().decode(errors="replace").strip().splitlines()
    if (child.role == "replica" and code == 3 and lines
            and lines[-1].startswith("reconciler: error:") and "database" in lines[-1]):
        return UNREACHABLE_AT_START
    if child.role == "worker" and any("There exists an active worker named" in line
                                      for line in lines[-3:]):
        return NAME_TAKEN
    return f"{child.role}:exit_{code}"


@dataclass
class Children:
    """Starts and signals children; every one is killed and reaped at the end."""

    folder: Path
    started: list[Child] = field(default_factory=list)

    def start(self, role: str, slot: int, argv: Sequence[str], env: dict[str, str],
              cwd: Path) -> Child:
        log = self.folder / f"{role}-{slot}.log"
        # Unmeasured (tests/coverage_scope.py): every child here ends by SIGKILL.
        environment = unmeasured({**os.environ, **env})
        with log.open("ab") as handle:
            popen = subprocess.Popen(
                list(argv), stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=environment, cwd=cwd, start_new_session=True,
                preexec_fn=die_with_parent)  # noqa: PLW1509 - no threads start children
        child = Child(role, slot, popen, log)
        self.started.append(child)
        return child

    def live(self, role: str) -> list[Child]:
        """The role's children still running (stopped ones included)."""
        return [c for c in self.started if c.role == role and c.alive()]

    def kill(self, child: Child) -> None:
        """SIGKILL (a stopped process dies too) and reap."""
        child.killed = True
        child.signal(signal.SIGKILL)
        child.popen.wait(timeout=10)

    def close(self) -> None:
        for child in self.started:
            if child.alive():
                self.kill(child)


@dataclass(frozen=True)
class Marker:
    """``<job>-<event>-<attempt>``, written by the process ``pid`` at ``at`` (epoch)."""

    job: str
    event: str  # "started" | "done" | "accepted" (Celery: accepted, not yet started)
    attempt: int
    pid: int | None
    at: float


def read_markers(folder: Path) -> list[Marker]:
    """Every task marker in the folder (``worker-ready-*`` and half-written ones left out)."""
    markers = []
    for path in folder.iterdir():
        parts = path.name.rsplit("-", 2)  # a pg-boss job id is a UUID, dashes and all
        if len(parts) != 3:
            continue
        job, event, attempt = parts
        if event not in ("started", "done", "accepted") or not attempt.isdigit():
            continue
        try:
            text, at = path.read_text(), path.stat().st_mtime
        except OSError:
            continue
        markers.append(Marker(job, event, int(attempt),
                              int(text) if text.isdigit() else None, at))
    return markers


def mid_task(markers: Sequence[Marker]) -> set[int]:
    """Pids of the workers inside a task now (started, not done)."""
    done = {(m.job, m.attempt) for m in markers if m.event == "done"}
    return {m.pid for m in markers
            if m.event == "started" and (m.job, m.attempt) not in done and m.pid is not None}
