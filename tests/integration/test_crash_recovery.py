"""Crash recovery with real processes and real SIGKILL, on SQLite and PostgreSQL.

Workers are separate interpreters that claim jobs and are killed from outside while they
block; racing reconcilers are separate interpreters too (a lone `reconciler pass` is the
command called in this process, tests/cli_runner.py). The test only watches the database.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from models import JobAttempt, JobRun, ReconciliationDecision, ReconciliationPass
from reconciler.storage.clock import db_now
from reconciler.storage.engines import read_only
from reconciler.worker import JobClient, Step
from tests.conftest import REPO_ROOT, run_cli, run_forked
from tests.fork_server import ForkedProcess, start_script, suite_server

jobs: sa.Table = cast(sa.Table, JobRun.__table__)
attempts: sa.Table = cast(sa.Table, JobAttempt.__table__)
decisions: sa.Table = cast(sa.Table, ReconciliationDecision.__table__)
passes: sa.Table = cast(sa.Table, ReconciliationPass.__table__)

STEPS = [Step("fetch", "idempotent"), Step("render", "pure"), Step("publish", "effectful")]
LEASE_SECONDS = 0.4
PROCESS_TIMEOUT_SECONDS = 60.0
RACERS = 4

WORKER_PRELUDE = """
import json, os, sys, time
from reconciler.worker import JobClient, LeaseLost, Step
URL = sys.argv[1]
ARGS = sys.argv[2:]
client = JobClient(URL)

def say(**facts):
    print(json.dumps(facts), flush=True)

def block_until_killed(**facts):
    say(event="ready", **facts)
    time.sleep(600)
    raise SystemExit("this worker was supposed to be killed")
"""

RACER_SCRIPT = """
import json, os, sys, time
from reconciler.storage.engines import create_engine
from reconciler.core.decisions import Thresholds
from reconciler.core.passes import PassConfig, run_pass
from reconciler.storage.sql_store import SqlStore

url, instance, batch_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
gates = sys.argv[4:]
store = SqlStore(create_engine(url))
with store.engine.connect() as conn:  # connect now, so the race starts at the gate
    conn.exec_driver_sql("SELECT 1")
config = PassConfig(batch_size=batch_size, thresholds=Thresholds(0.0, 3600.0),
                    instance=instance)
for round_number, gate in enumerate(gates):
    print(json.dumps({"event": "ready", "round": round_number}), flush=True)
    while not os.path.exists(gate):
        time.sleep(0.002)
    report = run_pass(store, config)
    print(json.dumps({
        "event": "done", "round": round_number, "instance": instance,
        "outcome": report.outcome.value, "pass_id": report.pass_id,
        "decisions": [[d.job_id, d.disposition.value, d.reason.value]
                      for d in report.decisions],
    }), flush=True)
"""


class Process:
    """A child interpreter whose stdout lines are JSON events, read without blocking."""

    def __init__(self, popen: ForkedProcess, stderr_path: Path) -> None:
        self.popen = popen
        self.stderr_path = stderr_path
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def next_event(self, timeout: float = PROCESS_TIMEOUT_SECONDS) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no event from pid {self.popen.pid} within {timeout}s")
        if line is None:
            code = self.popen.wait(timeout=10)
            pytest.fail(f"pid {self.popen.pid} exited {code} early:\n{self.stderr()}")
        event: dict[str, Any] = json.loads(line)
        return event

    def sigkill(self) -> None:
        """SIGKILL from outside, as the OOM killer or a node loss would."""
        self.popen.send_signal(signal.SIGKILL)
        assert self.popen.wait(timeout=10) == -signal.SIGKILL

    def wait_exit(self) -> int:
        return self.popen.wait(timeout=PROCESS_TIMEOUT_SECONDS)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Process]]:
    """Start child processes (`python -c` scripts, forked by tests/fork_server.py); any
    still running at teardown are killed."""
    started: list[Process] = []

    def start(script: str, *args: str) -> Process:
        stderr_path = tmp_path / f"child-{len(started)}.stderr"
        with stderr_path.open("w") as stderr:
            popen = start_script(suite_server(), script, list(args), os.environ,
                                 stdout=subprocess.PIPE, stderr=stderr, cwd=str(REPO_ROOT))
        process = Process(popen, stderr_path)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.popen.poll() is None:
            process.popen.kill()
            process.popen.wait(timeout=10)


def worker_script(body: str) -> str:
    return textwrap.dedent(WORKER_PRELUDE) + textwrap.dedent(body)


def run_worker(db: str, body: str, *args: str) -> dict[str, Any]:
    """Run a worker to its end in a process of its own; its last stdout line is its report."""
    proc = run_forked(worker_script(body), db, *args)
    assert proc.returncode == 0, proc.stderr
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report


def cli_json(db: str, *args: str, **settings: Any) -> Any:
    proc = run_cli(db, *args, "--json", **settings)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def wait_until(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def wait_for_expiry(engine: Engine, job_ids: Sequence[int]) -> None:
    """Until every listed lease has expired by the database's clock."""

    def expired() -> bool:
        with engine.connect() as conn:
            live = read_only(conn).execute(
                sa.select(sa.func.count()).select_from(jobs)
                .where(jobs.c.job_id.in_(list(job_ids)), jobs.c.lease_expires_at > db_now())
            ).scalar_one()
        return live == 0

    wait_until(expired, f"the leases of jobs {list(job_ids)} to expire")


def fetch(engine: Engine, query: sa.Select[Any]) -> list[sa.Row[Any]]:
    with engine.connect() as conn:
        return list(read_only(conn).execute(query))


def job_row(engine: Engine, job_id: int) -> sa.Row[Any]:
    (row,) = fetch(engine, sa.select(jobs).where(jobs.c.job_id == job_id))
    return row


def attempt_rows(engine: Engine, job_id: int) -> list[sa.Row[Any]]:
    return fetch(engine, sa.select(attempts).where(attempts.c.job_id == job_id)
                 .order_by(attempts.c.attempt_number))


def test_killed_after_a_step_resumes_the_same_job_at_the_next_step(
    db_url: str, client: JobClient, engine: Engine, spawn: Callable[..., Process]
) -> None:
    """SIGKILL after step 0: the pass requeues the same job at step 1; a new worker ends it."""
    job_id = client.enqueue("report", steps=STEPS, max_attempts=3)
    doomed = spawn(worker_script("""
        claim = client.claim(worker="doomed-worker", lease_seconds=float(ARGS[0]))
        claim.start_step(0)
        claim.finish_step(0)
        block_until_killed(job_id=claim.job_id, generation=claim.generation)
    """), db_url, str(LEASE_SECONDS))
    ready = doomed.next_event()
    assert ready["job_id"] == job_id

    doomed.sigkill()
    assert job_row(engine, job_id).job_status == "processing"
    wait_for_expiry(engine, [job_id])
    report = cli_json(db_url, "pass", stale_after_seconds=0)

    assert [(d["job_id"], d["disposition"], d["reason"], d["resume_step_index"])
            for d in report["decisions"]] == [
        (job_id, "resume", "resumed_from_unstarted_step", 1)]
    resumed = job_row(engine, job_id)
    assert (resumed.job_status, resumed.resume_step_index) == ("queued", 1)
    assert resumed.claim_generation == ready["generation"] + 1
    assert resumed.lease_token is None

    second = run_worker(db_url, """
        claim = client.claim(worker="second-worker", lease_seconds=30)
        seen = dict(job_id=claim.job_id, next_step=claim.next_step_index,
                    attempt=claim.attempt, generation=claim.generation)
        for index in range(claim.next_step_index, len(claim.steps)):
            claim.start_step(index)
            claim.finish_step(index)
        claim.complete()
        say(**seen)
    """)

    assert second == {"job_id": job_id, "next_step": 1, "attempt": 2,
                      "generation": ready["generation"] + 2}
    shown = cli_json(db_url, "jobs", "show", str(job_id))
    assert (shown["status"], shown["attempts_used"]) == ("completed", 2)
    assert [s["state"] for s in shown["steps"]] == ["succeeded"] * 3
    assert [(a.attempt_number, a.attempt_outcome, a.ended_by)
            for a in attempt_rows(engine, job_id)] == [
        (1, "lost", "reconciler"), (2, "completed", "worker")]


def test_killed_inside_an_effectful_step_is_failed_and_never_rerun(
    db_url: str, client: JobClient, engine: Engine, spawn: Callable[..., Process]
) -> None:
    """SIGKILL mid effectful step: worker_died_mid_step, failed, nothing left to claim."""
    job_id = client.enqueue("report", steps=STEPS, max_attempts=3)
    doomed = spawn(worker_script("""
        claim = client.claim(worker="doomed-worker", lease_seconds=float(ARGS[0]))
        for index in (0, 1):
            claim.start_step(index)
            claim.finish_step(index)
        claim.start_step(2)
        block_until_killed(job_id=claim.job_id, generation=claim.generation)
    """), db_url, str(LEASE_SECONDS))
    ready = doomed.next_event()

    doomed.sigkill()
    wait_for_expiry(engine, [job_id])
    report = cli_json(db_url, "pass", stale_after_seconds=0)

    assert [(d["job_id"], d["disposition"], d["reason"], d["resume_step_index"])
            for d in report["decisions"]] == [
        (job_id, "terminalize", "worker_died_mid_step", None)]
    second = run_worker(db_url, """
        claim = client.claim(worker="second-worker", lease_seconds=30)
        say(claimed=None if claim is None else claim.job_id)
    """)
    assert second == {"claimed": None}
    shown = cli_json(db_url, "jobs", "show", str(job_id))
    assert (shown["status"], shown["reason"], shown["attempts_used"]) == (
        "failed", "worker_died_mid_step", 1)
    assert [s["state"] for s in shown["steps"]] == ["succeeded", "succeeded", "started"]
    row = job_row(engine, job_id)
    assert (row.job_status, row.claim_generation) == ("failed", ready["generation"] + 1)
    assert row.lease_token is None
    assert [(a.attempt_outcome, a.ended_by) for a in attempt_rows(engine, job_id)] == [
        ("lost", "reconciler")]


def _kill_a_worker_holding(db_url: str, spawn: Callable[..., Process], count: int,
                           kind: str) -> dict[int, int]:
    """One worker process claims ``count`` jobs of ``kind`` and is SIGKILLed.

    Of every three jobs one never started, one started step 0 (idempotent), one finished
    it; all three are resumable. Returns job id -> generation at the crash.
    """
    doomed = spawn(worker_script("""
        held = []
        for n in range(int(ARGS[1])):
            claim = client.claim(worker="doomed-worker", lease_seconds=float(ARGS[0]),
                                 kinds=[ARGS[2]])
            if n % 3 >= 1:
                claim.start_step(0)
            if n % 3 == 2:
                claim.finish_step(0)
            held.append([claim.job_id, claim.generation])
        block_until_killed(held=held)
    """), db_url, str(LEASE_SECONDS), str(count), kind)
    held = {job_id: generation for job_id, generation in doomed.next_event()["held"]}
    doomed.sigkill()
    assert len(held) == count
    return held


def _start_racers(db_url: str, spawn: Callable[..., Process], gates: Sequence[Path],
                  *, batch_size: int = 100) -> list[Process]:
    return [
        spawn(RACER_SCRIPT, db_url, f"racer-{n}", str(batch_size), *(str(g) for g in gates))
        for n in range(RACERS)
    ]


def _race_round(racers: Sequence[Process], gate: Path, round_number: int) -> list[dict[str, Any]]:
    """Wait until every racer is connected and waiting, open the gate, collect reports."""
    for racer in racers:
        assert racer.next_event() == {"event": "ready", "round": round_number}
    gate.touch()
    reports = [racer.next_event() for racer in racers]
    assert {r["round"] for r in reports} == {round_number}
    return reports


def _assert_each_job_resumed_exactly_once(engine: Engine, held: dict[int, int]) -> None:
    ids = list(held)
    resumes = Counter(int(row.job_id) for row in fetch(engine, sa.select(decisions.c.job_id).where(
        decisions.c.job_id.in_(ids), decisions.c.disposition == "resume")))
    assert resumes == dict.fromkeys(ids, 1), "exactly one resume decision per job"
    for row in fetch(engine, sa.select(jobs).where(jobs.c.job_id.in_(ids))):
        assert row.job_status == "queued", row.job_id
        assert row.claim_generation == held[row.job_id] + 1, "bumped exactly once"
    history = fetch(engine, sa.select(attempts).where(attempts.c.job_id.in_(ids)))
    assert sorted(a.job_id for a in history) == sorted(ids), "one attempt per job"
    assert {(a.attempt_outcome, a.ended_by) for a in history} == {("lost", "reconciler")}


def test_racing_reconcilers_resume_each_killed_job_exactly_once(
    db_url: str, client: JobClient, engine: Engine, spawn: Callable[..., Process],
    tmp_path: Path,
) -> None:
    """Four processes run a pass at the same instant (every replica passes): one resume per
    job, and the audit shows one non-skip decision per job and generation."""
    for _ in range(20):
        client.enqueue("race", steps=STEPS, max_attempts=3)
    held = _kill_a_worker_holding(db_url, spawn, 20, "race")
    gate = tmp_path / "go"
    racers = _start_racers(db_url, spawn, [gate])
    wait_for_expiry(engine, list(held))

    reports = _race_round(racers, gate, 0)

    assert {r["outcome"] for r in reports} == {"ok"}
    resumed_by: Counter[int] = Counter()
    for report in reports:
        for job_id, disposition, reason in report["decisions"]:
            assert (disposition, reason) in {
                ("resume", "resumed_from_unstarted_step"), ("resume", "resumed_idempotent_step"),
                ("skip", "fence_lost"),
            }, (job_id, disposition, reason)
            if disposition == "resume":
                resumed_by[job_id] += 1
    assert resumed_by == dict.fromkeys(held, 1)
    _assert_each_job_resumed_exactly_once(engine, held)
    recorded = fetch(engine, sa.select(passes.c.pass_outcome, passes.c.resumed_count))
    assert len(recorded) == RACERS
    assert {r.pass_outcome for r in recorded} == {"ok"}
    assert sum(r.resumed_count for r in recorded) == 20
    for racer in racers:
        assert racer.wait_exit() == 0, racer.stderr()


def test_racing_replicas_share_a_backlog_instead_of_waiting_for_each_other(
    db_url: str, client: JobClient, engine: Engine, spawn: Callable[..., Process],
    tmp_path: Path,
) -> None:
    """Four replicas each run one pass of 5 at the same instant over 20 orphans: together
    they decide all 20, each once. On PostgreSQL SKIP LOCKED hands each a different 5 (a
    plain row lock would make three wait and then find their rows taken); on SQLite the
    write lock serialises them and each finds the next 5."""
    for _ in range(20):
        client.enqueue("share", steps=STEPS, max_attempts=3)
    held = _kill_a_worker_holding(db_url, spawn, 20, "share")
    gate = tmp_path / "go"
    racers = _start_racers(db_url, spawn, [gate], batch_size=5)
    wait_for_expiry(engine, list(held))

    reports = _race_round(racers, gate, 0)

    decided = sorted(job_id for r in reports for job_id, disposition, _ in r["decisions"]
                     if disposition == "resume")
    assert decided == sorted(held)
    assert [len(r["decisions"]) for r in reports] == [5] * RACERS
    _assert_each_job_resumed_exactly_once(engine, held)
    for racer in racers:
        assert racer.wait_exit() == 0, racer.stderr()
    for racer in racers:
        assert racer.wait_exit() == 0, racer.stderr()


def test_a_restarted_process_sees_every_lease_exactly_as_it_was(
    db_url: str, client: JobClient, engine: Engine
) -> None:
    """A worker that exits without finishing leaves its lease intact; a pass leaves it be."""
    job_id = client.enqueue("report", steps=STEPS, max_attempts=3)
    gone = run_worker(db_url, """
        claim = client.claim(worker="exiting-worker", lease_seconds=60)
        claim.start_step(0)
        say(job_id=claim.job_id, generation=claim.generation)
    """)
    assert gone["job_id"] == job_id
    before = job_row(engine, job_id)
    assert (before.job_status, before.claim_generation) == ("processing", gone["generation"])
    assert before.lease_token is not None
    assert before.lease_owner == "exiting-worker"

    fresh = run_worker(db_url, """
        import sqlalchemy as sa
        job = client.store.get_job(int(ARGS[0]))
        with client.engine.connect() as conn:
            generation = conn.execute(sa.text(
                "SELECT claim_generation FROM job_runs WHERE job_id = :j"),
                {"j": int(ARGS[0])}).scalar_one()
        stolen = client.claim(worker="fresh-worker", lease_seconds=30)
        say(status=job.job_status, generation=generation, attempts=job.attempt_count,
            steps=job.step_states, stolen=None if stolen is None else stolen.job_id)
    """, str(job_id))
    shown = cli_json(db_url, "jobs", "show", str(job_id))
    report = cli_json(db_url, "pass", stale_after_seconds=0)

    assert fresh == {"status": "processing", "generation": gone["generation"], "attempts": 1,
                     "steps": {"0": "started"}, "stolen": None}
    assert (shown["status"], shown["attempts_used"]) == ("processing", 1)
    assert [s["state"] for s in shown["steps"]] == ["started", "not_started", "not_started"]
    assert report["candidates"] == 0
    assert report["decisions"] == []
    after = job_row(engine, job_id)
    assert after._asdict() == before._asdict(), "nothing touched the live lease"


def test_enqueue_with_the_same_key_returns_the_same_job_across_crash_and_recovery(
    db_url: str, client: JobClient, engine: Engine, spawn: Callable[..., Process]
) -> None:
    """The idempotency key names one public job before the crash, after the resume, after."""
    plan = [Step("fetch", "idempotent"), Step("publish", "effectful")]
    job_id = client.enqueue("report", steps=plan, idempotency_key="req-42", max_attempts=3)
    enqueue = textwrap.dedent("""
        job_id = client.enqueue("report", steps=[Step("fetch", "idempotent"),
                                Step("publish", "effectful")], idempotency_key=ARGS[-1],
                                max_attempts=3)
    """)
    doomed = spawn(worker_script(enqueue + textwrap.dedent("""
        claim = client.claim(worker="doomed-worker", lease_seconds=float(ARGS[0]))
        claim.start_step(0)
        claim.finish_step(0)
        block_until_killed(job_id=job_id, claimed=claim.job_id)
    """)), db_url, str(LEASE_SECONDS), "req-42")
    assert doomed.next_event() == {"event": "ready", "job_id": job_id, "claimed": job_id}
    doomed.sigkill()
    wait_for_expiry(engine, [job_id])
    report = cli_json(db_url, "pass", stale_after_seconds=0)
    assert [(d["job_id"], d["disposition"]) for d in report["decisions"]] == [
        (job_id, "resume")]

    after = run_worker(db_url, enqueue + textwrap.dedent("""
        claim = client.claim(worker="second-worker", lease_seconds=30)
        claim.start_step(1)
        claim.finish_step(1)
        claim.complete()
        again = client.enqueue("report", steps=[Step("fetch", "idempotent")],
                               idempotency_key=ARGS[-1])
        say(after_resume=job_id, claimed=claim.job_id, after_completion=again)
    """), "req-42")

    assert after == {"after_resume": job_id, "claimed": job_id, "after_completion": job_id}
    all_jobs = fetch(engine, sa.select(jobs.c.job_id, jobs.c.job_status))
    assert [tuple(r) for r in all_jobs] == [(job_id, "completed")]
