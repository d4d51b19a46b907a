"""What the real-system tests share: one real pass, worker processes, markers.

``reconcile_once`` runs the real pass (``run_pass``) over a source built by the
composition root from a ``[source]`` config and ``[kinds]`` rules, so the audit rows are
written, and checks them: one per decision, with the source's name and the job id as the
system spells it.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from models import ReconciliationDecision
from reconciler.config.loader import Config, SourceConfig, pass_config
from reconciler.config.settings import Settings
from reconciler.core.decisions import Decision
from reconciler.core.kinds import KindRules
from reconciler.core.passes import explain_jobs, plan_change, run_pass
from reconciler.core.ports import Candidate, JobKey, PlannedChange
from reconciler.core.vocabulary import Disposition, Reason
from reconciler.root.cli import assemble_cli
from tests.coverage_scope import unmeasured
from tests.fork_server import ForkedProcess, ForkServer, run, shared_server

DECISIONS = cast(sa.Table, ReconciliationDecision.__table__)

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Outcome:
    """One decision of a pass as its audit row recorded it, and whether its swap changed
    the job."""

    job_id: JobKey
    disposition: Disposition
    reason: Reason
    resume_step_index: int | None
    applied: bool
    generation_after: int | None
    evidence: dict[str, Any] = field(default_factory=dict)


def plan_changes(candidates: Sequence[Candidate], kinds: KindRules) -> list[PlannedChange]:
    """Decide each candidate under its kind's thresholds, as the pass does."""
    return [plan_change(c, kinds.resolve(c.job_kind).thresholds) for c in candidates]


def config_for(engine: Engine, source: SourceConfig, kinds: KindRules, *,
               limit: int = 100) -> Config:
    """What a config file naming ``source`` and these ``[kinds]`` would give the pass."""
    settings = Settings(database_url=engine.url.render_as_string(hide_password=False),
                        batch_size=limit,
                        stale_after_seconds=kinds.resolve_defaults().thresholds
                        .stale_after_seconds,
                        wedged_after_seconds=kinds.resolve_defaults().thresholds
                        .wedged_after_seconds)
    return Config(settings=settings, source=source, kinds=kinds)


PASS_GAP_SECONDS = 0.1
"""Between the passes of a test that passes again and again over a window to show a job is
left alone: each pass asks the system afresh (a broadcast, a query) and the silence it
measures spans passes, so the window still holds dozens of them; back to back, they only
burned a core (as a sidecar never would: its interval is seconds)."""


def reconcile_once(engine: Engine, source: SourceConfig, kinds: KindRules, *,
                   limit: int = 100, dry_run: bool = False) -> list[Outcome]:
    """One real pass (``run_pass`` through the composition root) over the source; every
    decision is checked against its audit row (the source's name, the job id as the
    system spells it) and returned as the audit recorded it."""
    config = config_for(engine, source, kinds, limit=limit)
    # Killed workers' jobs go stale together on purpose: the mass-staleness brake (tested
    # on its own) would hold them all back.
    report = run_pass(assemble_cli(config, engine=engine).passes,
                      replace(pass_config(config.settings, "sources-test", kinds), brake=None),
                      dry_run=dry_run)
    if dry_run:
        assert report.pass_id is None
        return [Outcome(d.job_id, d.disposition, d.reason, d.resume_step_index, False, None)
                for d in report.decisions]
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(DECISIONS).where(DECISIONS.c.pass_id == report.pass_id)
            .order_by(DECISIONS.c.decision_id)).mappings().all()
    assert [(r["job_source"], r["job_id"]) for r in rows] == [
        (source.kind, str(d.job_id)) for d in report.decisions], "audit rows != decisions"
    outcomes = []
    for d, row in zip(report.decisions, rows, strict=True):
        assert (row["disposition"], row["decision_reason"]) == (d.disposition.value,
                                                                d.reason.value)
        evidence = row["decision_evidence"]
        outcomes.append(Outcome(
            d.job_id, d.disposition, d.reason, d.resume_step_index,
            d.disposition is not Disposition.SKIP, d.generation_after,
            evidence if isinstance(evidence, dict) else {}))
    return outcomes


def explain(engine: Engine, source: SourceConfig, kinds: KindRules,
            job_ids: Sequence[JobKey]) -> dict[JobKey, Decision]:
    """What the table decides now for named running jobs (reads only), as
    ``reconciler jobs explain`` asks it."""
    config = config_for(engine, source, kinds)
    planned = explain_jobs(assemble_cli(config, engine=engine).passes, job_ids,
                           pass_config(config.settings, "sources-test", kinds))
    return {p.decision.job_id: p.decision for p in planned}


def by_job(outcomes: Sequence[Outcome]) -> dict[JobKey, Outcome]:
    """Outcomes keyed by job id."""
    return {o.job_id: o for o in outcomes}


# --------------------------------------------------------------------------- #
# Processes
# --------------------------------------------------------------------------- #


def _die_with_parent() -> None:
    # In the child before exec: SIGKILL it if the test process dies, even by SIGKILL.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


_DATABASE_LIBRARIES = ("sqlalchemy", "sqlalchemy.orm", "psycopg", "pymysql", "pydantic")
_DJANGO = ("django", "django.conf", "django.apps", "django.core.management",
           "django.core.management.base", "django.db.models", "django.db.migrations",
           "django.db.backends.sqlite3.base", "django.db.backends.postgresql.base",
           "django.utils.timezone", *_DATABASE_LIBRARIES)
FORKED_SYSTEMS: dict[str, tuple[str, ...]] = {
    # ``python -m <module>`` commands started as children of a fork server that imported
    # these libraries ahead (tests/fork_server.py), never a module that reads its settings
    # from the environment when imported (the tests' apps; checked for each library):
    # from the module's own main on, the child is the system's real command, at a third
    # of the CPU (0.55 CPU-s a Celery worker's start against 0.2).
    "celery": ("celery", "celery.bin.celery", "celery.worker", "celery.apps.worker",
               "celery.concurrency.prefork", "kombu.transport.redis", "redis",
               "celery.backends.database", "sqlalchemy", "billiard", "click_repl"),
    "rq.cli": ("rq", "rq.cli", "rq.worker", "redis", "click"),
    # Not Dramatiq's own modules: they read their settings from the environment at import
    # (``dramatiq_queue_prefetch``), which each worker sets its own.
    "dramatiq": ("redis", "asyncio", *_DATABASE_LIBRARIES),
    "tests.sources.procrastinate_app": ("procrastinate", *_DATABASE_LIBRARIES),
    "tests.sources.django_app.manage": _DJANGO,
    "tests.sources.celery_django.manage": (*_DJANGO, "celery", "celery.backends.database",
                                           "kombu.transport.redis", "redis"),
}
def _system_server(module: str) -> ForkServer:
    """This process's fork server for ``module``'s commands; without coverage
    (tests/coverage_scope.py), like every job system's process."""
    return shared_server(module, env=unmeasured(dict(os.environ)),
                         preload=FORKED_SYSTEMS[module])


def _forked_module(argv: Sequence[str]) -> str | None:
    """The module of a ``python -m <module>`` command in ``FORKED_SYSTEMS``, else None."""
    if list(argv[:2]) == [sys.executable, "-m"] and argv[2] in FORKED_SYSTEMS:
        return argv[2]
    return None


def run_command(argv: Sequence[str], env: dict[str, str], cwd: Path,
                timeout: float) -> subprocess.CompletedProcess[str]:
    """A system's command (``manage.py migrate``, ``enqueue``...) run to its end as
    ``subprocess.run`` with ``capture_output=True, text=True`` does: forked where the
    command is in ``FORKED_SYSTEMS``."""
    module = _forked_module(argv)
    if module is None:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=cwd, check=False)
    return run(_system_server(module), {"module": module}, list(argv[3:]), env=env,
               timeout=timeout, cwd=str(cwd))


@dataclass
class Process:
    """A worker process of a real job system, started by a test."""

    name: str
    popen: subprocess.Popen[bytes] | ForkedProcess
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def signal(self, sig: signal.Signals) -> None:
        """Send a signal (SIGKILL, SIGSTOP, SIGCONT) to the process itself."""
        self.popen.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL and reap."""
        self.signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class Processes:
    """Starts worker processes and kills every one at the end of the test."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.started: list[Process] = []

    def start(self, name: str, argv: Sequence[str], env: dict[str, str],
              cwd: Path | None = None) -> Process:
        log = self.folder / f"{name}.log"
        popen: subprocess.Popen[bytes] | ForkedProcess
        environment = unmeasured({**os.environ, **env})
        module = _forked_module(argv)
        if module is not None:
            server = _system_server(module)
            log.touch()
            pid = server.spawn(module, list(argv[3:]), environment, str(log),
                               cwd=None if cwd is None else str(cwd))
            popen = ForkedProcess(server, pid, None, None)
        else:
            with log.open("ab") as handle:
                popen = subprocess.Popen(list(argv), stdout=handle, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=environment, cwd=cwd,
                                         preexec_fn=_die_with_parent)  # noqa: PLW1509
        process = Process(name, popen, log)
        self.started.append(process)
        return process

    def close(self) -> None:
        for process in self.started:
            if process.alive():
                process.signal(signal.SIGCONT)
                process.kill()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    """Worker processes of the test; all SIGKILLed at its end."""
    started = Processes(tmp_path)
    try:
        yield started
    finally:
        started.close()


RECOVERY_POLL_SECONDS = 0.25
"""Between the passes of a test waiting for a decision (a killed worker's job, once its
silence or lease runs out): each pass asks the system afresh, and every live worker of the
app answers a broadcast ping, so a pass every 50 ms cost the source tests 7 % more CPU
than one every quarter second, for a decision seen at most 0.2 s sooner."""


def wait_until(condition: Callable[[], Any], what: str, timeout: float = 30.0,
               process: Process | None = None, every: float = 0.05) -> Any:
    """Poll ``condition`` every ``every`` seconds until it is truthy; fail naming ``what``
    (and a log) at the end."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            log = f"\n--- {process.name} log ---\n{process.output()[-3000:]}" if process else ""
            pytest.fail(f"timed out after {timeout}s waiting for {what}{log}")
        time.sleep(every)


class Markers:
    """Files a worker's task writes as it goes (``<job>-started-<attempt>`` and so on)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def has(self, name: str) -> bool:
        return (self.folder / name).exists()

    def names(self) -> set[str]:
        return {p.name for p in self.folder.iterdir()}

    def of(self, job_id: JobKey) -> set[str]:
        prefix = f"{job_id}-"
        return {n.removeprefix(prefix) for n in self.names() if n.startswith(prefix)}


FINDINGS_ENV = "RECONCILER_SOURCES_FINDINGS"


def record_finding(system: str, test: str, **facts: Any) -> None:
    """Append what a real system did to ``$RECONCILER_SOURCES_FINDINGS`` (JSON lines), when
    set: the evidence docs/sources.md and the issue's closing note cite."""
    path = os.environ.get(FINDINGS_ENV)
    if not path:
        return
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"system": system, "test": test, **facts}, default=str) + "\n")
