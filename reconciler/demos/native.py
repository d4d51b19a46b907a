"""``reconciler demo``: real worker processes crash; the reconciler recovers their jobs.

On a fresh SQLite file: worker processes are SIGKILLed at different points of a
three-step job (between steps, mid effectful step, mid idempotent step, mid pure step,
and once with the attempt budget spent). Their leases expire, a reconciliation pass
decides each job from evidence, and a surviving worker finishes what was resumed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from reconciler.core.decisions import Thresholds
from reconciler.core.passes import PassConfig, run_pass
from reconciler.core.ports import JobKey, OperatorStore, RecordedDecision
from reconciler.core.vocabulary import Disposition
from reconciler.demos.support import demo_config
from reconciler.failpoints import ENV as FAILPOINTS_ENV
from reconciler.root.cli import assemble_cli
from reconciler.root.migrations import migrate
from reconciler.worker import JobClient, Step, StepContext, Worker

LEASE_SECONDS = 1.0
STALE_AFTER_SECONDS = 0.5
STEP_SECONDS = 0.05
PLAN = (Step("fetch", "idempotent"), Step("render", "pure"), Step("publish", "effectful"))


@dataclass(frozen=True)
class Scenario:
    """One job of the demo and how its first worker dies (if it does)."""

    label: str
    failpoint: str | None
    max_attempts: int = 3


SCENARIOS = (
    Scenario("killed between fetch and render", "between_steps"),
    Scenario("killed mid effectful step (publish)", "after_step_start:effectful"),
    Scenario("killed mid idempotent step (fetch)", "after_step_start:idempotent"),
    Scenario("killed mid pure step (render)", "after_step_start:pure"),
    Scenario("killed between steps, budget spent", "between_steps", max_attempts=1),
    Scenario("healthy", None),
    Scenario("healthy", None),
)


def _step(ctx: StepContext) -> None:
    time.sleep(STEP_SECONDS)


def worker_main(url: str, name: str, max_jobs: int) -> None:
    """A demo worker process: the real Worker runtime with the demo's handlers."""
    settings = demo_config(database_url=url, session_heartbeat_seconds=0.5,
                           session_timeout_seconds=5, poll_interval_seconds=0.1).settings
    client = JobClient(url, settings=settings)
    worker = Worker(client, name, concurrency=4, lease_seconds=LEASE_SECONDS,
                    max_run_seconds=30, artifact_root=Path(url.removeprefix("sqlite:///")).parent)
    worker.register("report", {step.step_name: _step for step in PLAN})
    worker.run(max_jobs=max_jobs)


def _start_worker(url: str, name: str, max_jobs: int, failpoint: str | None
                  ) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.pop(FAILPOINTS_ENV, None)
    if failpoint:
        env[FAILPOINTS_ENV] = failpoint
    return subprocess.Popen(
        [sys.executable, "-m", "reconciler.demos.native", url, name, str(max_jobs)], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def _crash_workers(client: JobClient, url: str) -> dict[int, Scenario]:
    """Enqueue one job per crash scenario; a fresh worker process claims it and dies."""
    jobs: dict[int, Scenario] = {}
    for number, scenario in enumerate(SCENARIOS, start=1):
        if scenario.failpoint is None:
            continue
        job_id = client.enqueue("report", steps=PLAN, max_attempts=scenario.max_attempts,
                                idempotency_key=f"demo-{number}")
        jobs[job_id] = scenario
        code = _start_worker(url, f"crasher-{number}", 1, scenario.failpoint).wait(timeout=60)
        how = "SIGKILL" if code == -signal.SIGKILL else f"exit {code}"
        print(f"   job {job_id}: worker crasher-{number} {scenario.label}: {how}")
    for number, scenario in enumerate(SCENARIOS, start=1):
        if scenario.failpoint is None:
            jobs[client.enqueue("report", steps=PLAN, idempotency_key=f"demo-{number}")] = (
                scenario)
    return jobs


def _print_outcomes(store: OperatorStore, jobs: dict[int, Scenario],
                    decided: dict[JobKey, RecordedDecision]) -> None:
    print(f"\n{'job':>4}  {'what happened':<38} {'reconciler decision':<36} "
          f"{'final status':<32} attempts")
    for job_id, scenario in sorted(jobs.items()):
        job = store.get_job(job_id)
        if job is None:
            continue
        d = decided.get(job_id)
        decision = "-" if d is None else d.reason.value + (
            f" @ step {d.resume_step_index}" if d.disposition is Disposition.RESUME else "")
        final = job.job_status + (f" ({job.status_reason})" if job.job_status == "failed"
                                  else "")
        print(f"{job_id:>4}  {scenario.label:<38} {decision:<36} {final:<32} "
              f"{job.attempt_count}/{job.max_attempts}")


def run_demo(keep: bool = False) -> int:
    """Run the demo and print what happened to each job and why; the exit code."""
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="reconciler-demo-"))
    url = f"sqlite:///{workdir / 'demo.db'}"
    config = demo_config(database_url=url)
    settings = config.settings
    migrate(config)
    cli = assemble_cli(config)
    store = cli.store
    client = JobClient(url, settings=settings)
    try:
        print("1. crash workers: each worker process claims one job and is SIGKILLed")
        jobs = _crash_workers(client, url)

        print(f"2. wait for the dead workers' leases ({LEASE_SECONDS:.0f}s) to expire")
        time.sleep(LEASE_SECONDS + STALE_AFTER_SECONDS + 0.2)

        print("3. reconcile: one pass decides every stale job from its evidence")
        pass_config = PassConfig(batch_size=100,
                                 thresholds=Thresholds(STALE_AFTER_SECONDS, 3600.0),
                                 instance="demo-reconciler")
        report = run_pass(cli.passes, pass_config)
        for d in report.decisions:
            at = f" at step {d.resume_step_index}" if d.resume_step_index is not None else ""
            print(f"   job {d.job_id}: {d.disposition.value} ({d.reason.value}){at}")

        queued = len(store.list_jobs("queued", 1000))
        print(f"4. a surviving worker runs the {queued} queued jobs (resumed and new)")
        _start_worker(url, "survivor", queued, None).wait(timeout=60)

        _print_outcomes(store, jobs, {d.job_id: d for d in report.decisions})
        print(f"\ndemo finished in {time.monotonic() - started:.1f}s")
        if keep:
            print(f"kept: reconciler decisions --database-url {url}")
    finally:
        client.close()
        cli.close()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    worker_main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
