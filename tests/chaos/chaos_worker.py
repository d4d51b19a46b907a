"""A chaos worker process: the real ``Worker`` runtime, instrumented, with ledger handlers.

    python -m tests.chaos.chaos_worker URL NAME LEDGER_DIR SEED [CONCURRENCY]

``RECONCILER_FAILPOINTS`` (set by the harness, or not) makes it SIGKILL itself at one
protocol point. Its store is instrumented (tests/chaos/ledger.py) so every fenced write
lands in the write log, and its handlers write the effect ledger: ``begin`` first, then,
after a short sleep (the work), ``effect`` for every step kind; a few executions fail
before their effect, retryably or not, to exercise ``fail``. It exits with its parent.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
import time
from pathlib import Path

from reconciler.config.settings import Settings
from reconciler.worker import JobClient, Step, StepContext, Worker  # not .runtime: see README
from tests.chaos.ledger import Ledger, instrument
from tests.chaos.lifeline import die_with_parent

JOB_KIND = "chaos"
PLANS: tuple[tuple[Step, ...], ...] = (
    (Step("fetch", "idempotent"), Step("render", "pure"), Step("publish", "effectful")),
    (Step("charge", "effectful"),),
    (Step("load", "idempotent"), Step("reserve", "effectful"), Step("shape", "pure"),
     Step("notify", "effectful")),
    (Step("parse", "pure"), Step("index", "idempotent")),
)
STEP_NAMES = sorted({step.step_name for plan in PLANS for step in plan})
# A poison job: its one step kills whatever process runs it (an OOM, a segfault), so the
# reconciler must quarantine it (crash_loop) instead of feeding it worker after worker.
POISON_KIND = "chaos-poison"
POISON_PLAN: tuple[Step, ...] = (Step("swallow", "idempotent"),)

LEASE_SECONDS = 1.0
SESSION_HEARTBEAT_SECONDS = 0.3
SESSION_TIMEOUT_SECONDS = 1.5
POLL_INTERVAL_SECONDS = 0.1
RETRY_BACKOFF_SECONDS = 0.1
RETRY_BACKOFF_MAX_SECONDS = 1.0
MAX_RUN_SECONDS = 60.0
SHUTDOWN_GRACE_SECONDS = 2.0

# How a step execution behaves: mostly short, sometimes long enough for heartbeats (and
# the in_heartbeat failpoint) to matter, occasionally failing before its effect.
SHORT_STEP_SECONDS = (0.005, 0.04)
LONG_STEP_SECONDS = (0.4, 0.9)
LONG_STEP_CHANCE = 0.04
RETRYABLE_FAILURE_CHANCE = 0.02
PERMANENT_FAILURE_CHANCE = 0.004


class Flaky(Exception):  # noqa: N818 - the class name is the stored error code
    """A retryable handler failure (before any effect)."""

    retryable = True


class Broken(Exception):  # noqa: N818 - the class name is the stored error code
    """A permanent handler failure (before any effect)."""

    retryable = False


def generation_of(ctx: StepContext) -> int:
    """The fencing generation of the claim a step runs under.

    StepContext does not expose it publicly (see the chaos README: a product gap); the
    attempt number is not unique once a release gives an attempt back.
    """
    public = getattr(ctx, "generation", None)
    return int(public if public is not None else ctx._claim.generation)


def make_handler(ledger: Ledger, effect_kind: str, rng: random.Random):
    """A step handler that records its begin and its effect in the ledger."""

    def handler(ctx: StepContext) -> None:
        generation = generation_of(ctx)
        ledger.began(ctx.job_id, ctx.step_index, generation, effect_kind)
        roll = rng.random()
        if roll < PERMANENT_FAILURE_CHANCE:
            raise Broken
        if roll < PERMANENT_FAILURE_CHANCE + RETRYABLE_FAILURE_CHANCE:
            raise Flaky
        span = LONG_STEP_SECONDS if rng.random() < LONG_STEP_CHANCE else SHORT_STEP_SECONDS
        time.sleep(rng.uniform(*span))
        ledger.effect(ctx.job_id, ctx.step_index, generation, effect_kind)

    return handler


def poison_handler(ledger: Ledger):
    """The poison step: recorded as begun (fsynced), then the process dies by SIGKILL."""

    def handler(ctx: StepContext) -> None:
        ledger.began(ctx.job_id, ctx.step_index, generation_of(ctx), "idempotent")
        os.kill(os.getpid(), signal.SIGKILL)

    return handler


def worker_settings(url: str, artifact_root: Path) -> Settings:
    """The worker's settings: short everything, so a run sees many leases come and go."""
    return Settings(
        database_url=url, lease_seconds=LEASE_SECONDS,
        session_heartbeat_seconds=SESSION_HEARTBEAT_SECONDS,
        session_timeout_seconds=SESSION_TIMEOUT_SECONDS,
        poll_interval_seconds=POLL_INTERVAL_SECONDS,
        retry_backoff_seconds=RETRY_BACKOFF_SECONDS,
        retry_backoff_max_seconds=RETRY_BACKOFF_MAX_SECONDS,
        artifact_root=str(artifact_root),
    )


def build_worker(url: str, name: str, ledger_dir: Path, seed: int, concurrency: int
                 ) -> tuple[Worker, Ledger]:
    """The real runtime with an instrumented store and ledger-writing handlers."""
    ledger = Ledger(ledger_dir, f"worker-{name}")
    settings = worker_settings(url, ledger_dir.parent / "artifacts")
    client = JobClient(url, settings=settings)
    instrument(client.store, ledger)
    worker = Worker(client, name, concurrency=concurrency, lease_seconds=LEASE_SECONDS,
                    max_run_seconds=MAX_RUN_SECONDS,
                    shutdown_grace_seconds=SHUTDOWN_GRACE_SECONDS,
                    poll_interval_seconds=POLL_INTERVAL_SECONDS)
    rng = random.Random(seed)
    kinds = {step.step_name: step.kind.value for plan in PLANS for step in plan}
    worker.register(JOB_KIND, {name: make_handler(ledger, kinds[name], rng)
                               for name in STEP_NAMES})
    worker.register(POISON_KIND, {"swallow": poison_handler(ledger)})
    return worker, ledger


def main(argv: list[str]) -> int:
    die_with_parent()
    url, name, ledger_dir, seed = argv[0], argv[1], Path(argv[2]), int(argv[3])
    concurrency = int(argv[4]) if len(argv) > 4 else 4
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s {name}[{os.getpid()}] %(name)s %(message)s")
    worker, ledger = build_worker(url, name, ledger_dir, seed, concurrency)
    try:
        worker.run()
    finally:
        ledger.close()
        worker.client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
