"""``reconciler run``: scheduled passes and chores, /metrics /healthz /readyz, signals.

The scheduler only calls ``run_pass`` and the chores, logs and updates metrics. Every
replica passes: a tick runs batches back to back while they come back full, and a tick
that stops with its last batch full (backlog left) is followed by the next at once, not at
the next fire, so a mass outage drains at the pass's own speed. A tick never overlaps the
next (``max_instances=1``; the next is started only once the scheduler counts the last
one finished), a paused process does not fire a burst on wake (``coalesce``), and a tick
longer than the interval is reported. The leader lease only decides which replica runs
the once-only chores (retention, artifact sweeps); correctness comes from each job's
compare-and-swap.

The service holds no engine and opens nothing: it takes its parts, assembled once by
``reconciler.root.sidecar.assemble_sidecar``, so its own logic runs without a database too.
"""

from __future__ import annotations

import json
import logging
import random
import signal
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol

from apscheduler.events import EVENT_JOB_EXECUTED, EVENT_JOB_MAX_INSTANCES, JobExecutionEvent
from apscheduler.schedulers.background import BackgroundScheduler
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

from reconciler.console.server import serve as serve_console
from reconciler.core.passes import PassConfig, PassReport, run_pass
from reconciler.core.ports import Cursor, PassStore
from reconciler.core.stuck import merged
from reconciler.core.vocabulary import DatabaseErrorCode, Disposition
from reconciler.errors import ConfigError
from reconciler.redaction import redact
from reconciler.sidecar.chores import Chore, Housekeeping
from reconciler.sidecar.http import HTTP_REQUEST_TIMEOUT_SECONDS, BoundedHTTPServer
from reconciler.sidecar.liveness_watch import LivenessWatch
from reconciler.sidecar.metrics import Metrics
from reconciler.sidecar.parts import SidecarParts
from reconciler.sidecar.probe import DatabaseProbe

log = logging.getLogger("reconciler.sidecar.service")

# The lease of the replica that runs the once-only chores.
LEADER_LEASE_NAME = "reconciler"
# The scheduler job that runs the ticks.
TICK_CHORE = "pass"
JITTER_FRACTION = 0.1
HEALTH_CHECK_SECONDS = 5.0
# A tick stops after this share of its interval, so it ends before its next fire and a
# draining replica is not reported as overrunning; backlog left goes on in a tick started
# at once.
TICK_BUDGET_FRACTION = 0.5
# And after this many batches: one tick_finished line and tick metric per 10,000 jobs at
# the default batch size, however long the interval.
TICK_MAX_BATCHES = 20

class PassRunner(Protocol):
    """What runs one pass: ``core.passes.run_pass``'s shape."""

    def __call__(self, store: PassStore, config: PassConfig, *,
                 after: Cursor | None = None) -> PassReport:
        """One pass (one batch) from ``after``; its report."""


class Service:
    """One reconciler instance: passes, chores, HTTP endpoints.

    ``run``: the pass itself (``core.passes.run_pass``; a test may hand in its own to
    exercise the tick without a database).
    """

    def __init__(self, parts: SidecarParts, *, run: PassRunner = run_pass) -> None:
        self.parts = parts
        self.settings = parts.settings
        self.instance = parts.instance
        self.config: PassConfig = parts.pass_config
        self.passes: PassStore = parts.passes
        self._run_pass = run
        self.errors = parts.errors
        self.probe = DatabaseProbe(parts.database_check, parts.errors.code)
        self.metrics = Metrics()
        self.pass_overruns = Counter("reconciler_pass_overruns",
                                     "Scheduled passes skipped because the previous one ran on",
                                     registry=self.metrics.registry)
        self.console = (parts.console(self.metrics.observe_action)
                        if parts.console is not None else None)
        self.housekeeping = Housekeeping(self.settings, parts.passes, parts.artifacts,
                                         parts.job_retention, self.metrics)
        self.cursor: Cursor | None = None
        self.leading = False
        self.last_pass_finished: float | None = None
        self.last_pass_failure: tuple[DatabaseErrorCode, str] | None = None
        self.backlog_left = False
        """True when the last tick stopped at its budget with its last batch full."""
        self.liveness = LivenessWatch(self.metrics, self.instance)
        self.stopping = threading.Event()
        self.stuck = False
        """True once a stop gave up on a thread still blocked in the database driver."""
        self.scheduler = BackgroundScheduler(timezone="UTC")
        self.http: BoundedHTTPServer | None = None

    def chores(self) -> list[Chore]:
        """Everything the scheduler runs, declared: the pass, leadership and the probe on
        every replica, then the housekeeping (some of it on the leader only)."""
        interval = self.settings.interval_seconds
        lead_every = self.settings.leader_lease_seconds / 3
        return [
            Chore(TICK_CHORE, interval, False, self.run_tick),
            # Renewed at start() already: the first scheduled renewal is one period later.
            Chore("leadership", lead_every, False, self.renew_leadership,
                  first_after_seconds=lead_every),
            Chore("health", min(interval, HEALTH_CHECK_SECONDS), False, self.check_health),
            *self.housekeeping.chores(),
        ]

    def run_chore(self, name: str) -> None:
        """Run one chore now, as the scheduler does: a leader-only chore does nothing on a
        replica that does not lead."""
        chore = next(c for c in self.chores() if c.name == name)
        self._runner(chore)()

    def _runner(self, chore: Chore) -> Callable[[], object]:
        if not chore.leader_only:
            return chore.run

        def on_the_leader() -> object:
            return chore.run() if self.leading else None

        return on_the_leader

    # -- the jobs the scheduler runs ---------------------------------------------------------

    def run_tick(self) -> list[PassReport]:
        """Batches back to back while they come back full and make progress, up to
        ``TICK_MAX_BATCHES`` or half an interval; each batch is its own pass (transaction
        and pass row). ``backlog_left`` says whether it stopped with work left, for
        ``next_tick_at_once``. Never raises."""
        deadline = time.monotonic() + self.settings.interval_seconds * TICK_BUDGET_FRACTION
        reports: list[PassReport] = []
        self.backlog_left = False
        while True:
            report = self.run_one_pass()
            if report is None:
                break
            reports.append(report)
            if not self._full_and_progressed(report) or self.stopping.is_set():
                break
            if len(reports) >= TICK_MAX_BATCHES or time.monotonic() >= deadline:
                self.backlog_left = True
                break
        if reports:
            self.housekeeping.held = merged(r.held for r in reports)
            self.metrics.observe_tick(len(reports))
            braked = any(r.braked for r in reports)
            self.metrics.observe_brake(braked)
            log.info("event=tick_finished instance=%s batches=%d decisions=%d braked=%d "
                     "shadow=%d backlog_left=%d", self.instance, len(reports),
                     sum(len(r.decisions) for r in reports), braked, self.config.shadow,
                     self.backlog_left)
        return reports

    def _full_and_progressed(self, report: PassReport) -> bool:
        # A full batch of skips with nowhere further to page would only repeat itself
        # (a braked batch, a shadow pass, held jobs): the next scheduled tick tries again.
        progressed = report.next_cursor is not None or (not report.shadow and any(
            d.disposition is not Disposition.SKIP for d in report.decisions))
        return len(report.decisions) >= self.config.batch_size and progressed

    def next_tick_at_once(self) -> None:
        """After a tick that stopped with backlog left, the next one starts now instead of
        at the next fire; after any other tick (a short or quiet batch, a failure, a stop)
        the interval stands. Called once the scheduler counts the tick finished, so the
        next one never overlaps it."""
        if self.backlog_left and not self.stopping.is_set() and self.scheduler.running:
            self.scheduler.modify_job(TICK_CHORE, next_run_time=datetime.now(UTC))

    def run_one_pass(self) -> PassReport | None:
        """One pass (one batch) with its logging and metrics; never raises."""
        started = time.monotonic()
        try:
            report = self._run_pass(self.passes, self.config, after=self.cursor)
        except Exception as exc:
            elapsed = time.monotonic() - started
            code, line = self.errors.code(exc), self.errors.line(exc)
            self.metrics.observe_failed_pass(elapsed, code)
            self.last_pass_failure = (code, line)
            log.error("event=pass_failed instance=%s error=%s code=%s seconds=%.3f reason=%s",
                      self.instance, type(exc).__name__, code.value, elapsed, json.dumps(line))
            if code.database_answered:
                self._record_failure(code)
            return None
        elapsed = time.monotonic() - started
        self.cursor = report.next_cursor
        self.metrics.observe_pass(report, elapsed, time.time(), shadow=report.shadow)
        self.last_pass_finished = time.monotonic()
        self.last_pass_failure = None
        self.liveness.observe(report.liveness)
        log.info(
            "event=pass_finished instance=%s pass_id=%s outcome=%s candidates=%d resumed=%d "
            "terminalized=%d skipped=%d shadow=%d seconds=%.3f", self.instance, report.pass_id,
            report.outcome.value, len(report.decisions), report.count(Disposition.RESUME),
            report.count(Disposition.TERMINALIZE), report.count(Disposition.SKIP),
            report.shadow, elapsed)
        return report

    def _record_failure(self, code: DatabaseErrorCode) -> None:
        try:
            self.passes.record_failed_pass(self.instance, code.value)
        except Exception as exc:  # the database is down: the metric and the log carry it
            log.debug("event=failed_pass_not_recorded error=%s", type(exc).__name__)

    def check_health(self) -> None:
        """Probe the database between passes: one that stops answering ends leadership
        (as far as anyone scraping can tell, and for the chores) at once, not when a
        renewal finally gives up; the next renewal that succeeds restores it."""
        if not self.probe.check().ok:
            self.leading = False
            self.metrics.is_leader.set(0)

    def renew_leadership(self) -> None:
        """Keep the chores' leader lease and say whether this instance leads."""
        try:
            token = self.passes.try_lead(LEADER_LEASE_NAME, self.instance,
                                         self.settings.leader_lease_seconds)
        except Exception as exc:
            self.leading = False
            self.metrics.is_leader.set(0)
            log.warning("event=leader_renewal_failed error=%s", type(exc).__name__)
            return
        self.leading = token is not None
        self.metrics.is_leader.set(int(self.leading))

    # -- HTTP -------------------------------------------------------------------------------

    def readiness(self) -> tuple[bool, str]:
        """Ready when the database answers, the schema is current and a pass ran lately.

        Never blocks on the database for more than the probe's wait (half a second): the
        probe runs on its own thread, and one that is not back in time is the answer.
        """
        probe = self.probe.check()
        if not probe.ok:
            return False, probe.line
        if self.last_pass_failure is not None:
            code, line = self.last_pass_failure
            return False, f"the last pass failed ({code.value}): {line}"
        if self.last_pass_finished is None:
            return False, "no pass has finished yet"
        if self.liveness.unknown is not None:
            return False, self.liveness.why()
        age = time.monotonic() - self.last_pass_finished
        if age > 3 * self.settings.interval_seconds + 10:
            return False, f"last successful pass {age:.0f}s ago"
        return True, "ready"

    def start_http(self) -> None:
        """Serve /metrics, /healthz, /readyz and the console on metrics_host:metrics_port."""
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._reply(200, generate_latest(service.metrics.registry),
                                CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._reply(200, b"ok\n")
                elif path == "/readyz":
                    ready, why = service.readiness()
                    self._reply(200 if ready else 503, (redact(why) + "\n").encode())
                else:
                    serve_console(self, service.console, "GET")

            def do_HEAD(self) -> None:
                serve_console(self, service.console, "HEAD")

            def do_POST(self) -> None:
                serve_console(self, service.console, "POST")

            def _reply(self, status: int, body: bytes,
                       content_type: str = "text/plain; charset=utf-8") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return

            # An idle or trickling client is cut off instead of holding a worker.
            timeout = HTTP_REQUEST_TIMEOUT_SECONDS

        address = (self.settings.metrics_host, self.settings.metrics_port)
        try:
            self.http = BoundedHTTPServer(address, Handler)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {address[0]}:{address[1]}: "
                              f"{exc.strerror or type(exc).__name__} (set metrics_host / "
                              "metrics_port)") from None
        threading.Thread(target=self.http.serve_forever, daemon=True, name="http").start()
        log.info("event=http_listening host=%s port=%d", self.settings.metrics_host,
                 self.http.server_address[1])

    # -- lifecycle --------------------------------------------------------------------------

    def _schedule(self, chore: Chore) -> None:
        seconds = chore.period_seconds
        first = (_soon() if chore.first_after_seconds is None
                 else datetime.now(UTC) + timedelta(seconds=chore.first_after_seconds))
        self.scheduler.add_job(
            self._runner(chore), "interval", seconds=seconds,
            jitter=seconds * JITTER_FRACTION, id=chore.name, name=chore.name,
            # APScheduler 3 wants whole seconds here.
            max_instances=1, coalesce=True, misfire_grace_time=max(int(seconds), 1),
            next_run_time=first)

    def observe_overrun(self, chore_name: str) -> None:
        """A scheduled run was skipped because the previous one still ran: counted and
        logged for the pass (a tick longer than the interval)."""
        if chore_name == TICK_CHORE:
            self.pass_overruns.inc()
            log.warning("event=pass_overrun instance=%s interval_seconds=%s", self.instance,
                        self.settings.interval_seconds)

    def _on_max_instances(self, event: JobExecutionEvent) -> None:
        self.observe_overrun(event.job_id)

    def _on_executed(self, event: JobExecutionEvent) -> None:
        # Dispatched once the executor counts the run finished: from the pool's thread, or,
        # when the tick was over before the scheduler attached its callback to the future,
        # from the scheduler's own thread inside its job-store lock, just before it writes
        # the job's next fire time over any change made here (a lost "at once", seen in 7
        # of 30 runs of a tick of stand-in batches). A thread of its own waits for that
        # lock, so the change always lands after the scheduler's write.
        if event.job_id == TICK_CHORE and self.backlog_left:
            threading.Thread(target=self.next_tick_at_once, name="next-tick",
                             daemon=True).start()

    def start(self) -> None:
        """Start HTTP and the scheduler (non-blocking)."""
        self.start_http()
        # Leadership is known before the first tick, so /metrics never shows a pass
        # finished by a replica that does not yet know it leads.
        self.renew_leadership()
        for chore in self.chores():
            self._schedule(chore)
        self.scheduler.add_listener(self._on_max_instances, EVENT_JOB_MAX_INSTANCES)
        self.scheduler.add_listener(self._on_executed, EVENT_JOB_EXECUTED)
        self.scheduler.start()
        log.info("event=service_started instance=%s interval_seconds=%s", self.instance,
                 self.settings.interval_seconds)

    def stop(self) -> None:
        """Finish the pass in flight, give up leadership, stop serving."""
        # The tick in flight ends after its batch, and no next one is started at once.
        self.stopping.set()
        self.scheduler.shutdown(wait=True)
        self.metrics.is_leader.set(0)
        try:
            self.passes.release_leadership(LEADER_LEASE_NAME, self.instance)
        except Exception as exc:
            log.warning("event=leader_release_failed error=%s code=%s", type(exc).__name__,
                        self.errors.code(exc).value)
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
        self.close()
        log.info("event=service_stopped instance=%s", self.instance)

    def close(self) -> None:
        """Release the probe and the engines (``stop`` does; a service never started
        needs only this)."""
        self.probe.close()
        if self.console is not None:
            self.console.close()
        self.parts.close()

    def run_until_signalled(self) -> int:
        """Run until SIGTERM or SIGINT, then stop cleanly; the exit code.

        A stop that takes longer than ``shutdown_timeout_seconds`` (a pass blocked in the
        database driver) is given up: the result is 1 and ``stuck`` is set, and the caller
        must end the process without waiting for that thread (``os._exit``).
        """
        def on_signal(signum: int, _frame: object) -> None:
            log.info("event=signal signal=%s", signal.Signals(signum).name)
            self.stopping.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        self.start()
        self.stopping.wait()
        stopper = threading.Thread(target=self.stop, daemon=True, name="stop")
        stopper.start()
        timeout = self.settings.shutdown_timeout_seconds
        stopper.join(timeout)
        if stopper.is_alive():
            self.stuck = True
            log.error("event=shutdown_timeout seconds=%s", timeout)
            return 1
        return 0


def _soon() -> datetime:
    # A little jitter on the first run too, so replicas started together do not collide.
    return datetime.now(UTC) + timedelta(seconds=random.uniform(0, 0.2))
