"""Who moves a dead Dramatiq worker's messages first: Dramatiq's own maintenance or the
reconciler, both at their defaults.

    python -m benchmarks.dramatiq_race [--runs N] [--dead N] [--live N] [--json]

Dramatiq's Redis broker puts a dead worker's fetched messages back once its heartbeat is
``heartbeat_timeout`` (60 s) old, in a maintenance step that a broker command on the same
queue runs with a chance of ``maintenance_chance`` in a million (1,000); the reconciler
moves them once its passes, every ``interval_seconds`` (30 s), have seen the heartbeat
still for ``session_timeout_seconds`` (30 s), unless its mass-staleness brake holds them
(``brake_min_jobs`` 20, ``brake_stale_fraction`` 0.5, ``brake_hold_seconds`` 120). The
docs say which wins at the defaults and which ``heartbeat_timeout`` leaves recovery to
the reconciler; this measures it, with every one of those settings at its default.

One run, over a redis-server of its own (emptied between runs):

- ``--dead`` real ``dramatiq`` worker processes (this module's app, the reconciler's
  middleware added, Dramatiq's default 8 threads and prefetch of 16), each the only
  consumer of a queue of its own, are sent 16 messages that sleep for an hour: 8 start, 8
  wait prefetched. A queue each, because maintenance on one queue moves only that queue's
  acks: each dead worker is a race of its own;
- ``--live`` idle ``dramatiq`` workers of the same app consume every queue, polling as
  idle Dramatiq workers do (a fetch per queue and per delay queue every 0.5 to 1 s): each
  command rolls Dramatiq's maintenance chance at its default. They run what is put back
  at once (the hour-long sleep is the dead workers' only);
- the dead workers are SIGKILLed together (main and worker process): a node lost. With
  the default ``--dead`` 7 their 112 messages are all the fleet's running work, over the
  brake's limits (20 stale jobs and half the running): the passes hold them for
  ``brake_hold_seconds``, and maintenance has that long to run. ``--dead 1`` (16
  messages, under ``brake_min_jobs``) is one worker lost, which no brake holds;
- the reconciler is started as a real ``reconciler run`` sidecar over SQLite with its
  default settings (the metrics port excepted: any free one) at a random offset within
  one ``interval_seconds`` after the kill, as a sidecar already running is at a random
  phase of its interval when a worker dies;
- every 0.5 s the dead workers' acks sets are read: a message gone from them was moved.
  Once all are gone (or ``--deadline`` seconds after the kill) the sidecar stops and its
  audit (``reconciliation_decisions``) says which it moved: an applied decision is the
  reconciler's; a message moved without one was Dramatiq's maintenance's, recorded
  ``fence_lost`` where a pass had decided it and lost the race to the move.

``--control`` adds a run with the reconciler down for ``--control-down`` (90) seconds after
the kill: every message maintenance moves in that time is maintenance's, which shows the
count sees maintenance win.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.processes import stop

APP_ENV = "RECONCILER_RACE_APP"
"""Set in the worker processes: importing this module then builds the app's broker."""
HANG_ENV = "RECONCILER_RACE_HANG"
"""Set in the dead workers: the actor sleeps an hour (it never ends before the kill)."""
QUEUES_ENV = "RECONCILER_RACE_QUEUES"
NAMESPACE = "dramatiq"
THREADS = 8
PREFETCH = 2 * THREADS
"""Dramatiq's default: twice the threads."""
POLL_SECONDS = 0.5
DEFAULT_INTERVAL = 30.0
REPO = Path(__file__).parents[1]


def _queue(k: int) -> str:
    return f"q{k}"


def _app_broker() -> Any:
    """The app the worker processes run: a ``RedisBroker`` at Dramatiq's defaults with
    the reconciler's middleware, one actor per queue."""
    import dramatiq  # noqa: PLC0415 - only in the worker processes
    from dramatiq.brokers.redis import RedisBroker  # noqa: PLC0415

    from reconciler.integrations.dramatiq import ReconcilerMiddleware  # noqa: PLC0415

    app = RedisBroker(url=os.environ["DRAMATIQ_REDIS_URL"])  # type: ignore[no-untyped-call]
    app.add_middleware(ReconcilerMiddleware())
    dramatiq.set_broker(app)

    def work() -> None:
        if os.environ.get(HANG_ENV):
            time.sleep(3600)

    for k in range(int(os.environ[QUEUES_ENV])):
        dramatiq.actor(actor_name=f"race_{k}", queue_name=_queue(k), broker=app)(work)
    return app


if os.environ.get(APP_ENV):  # imported by the dramatiq CLI in a worker process
    broker = _app_broker()


@dataclass
class Run:
    """One run's count: each of the dead workers' messages and who moved it."""

    run: int
    reconciler_down_seconds: float
    dead_workers: int
    live_workers: int
    messages: int = 0
    started: int = 0
    moved_by_reconciler: int = 0
    moved_by_maintenance: int = 0
    fence_lost_recorded: int = 0
    not_moved: int = 0
    workers_lost_to_maintenance: int = 0
    braked_skips: int = 0
    reconciler_move_s: list[float] = field(default_factory=list)
    maintenance_move_s: list[float] = field(default_factory=list)
    last_heartbeat_age_s: float = 0.0

    def row(self) -> dict[str, Any]:
        """The run as printed: move times as their range."""
        found = asdict(self)
        for name in ("reconciler_move_s", "maintenance_move_s"):
            times = found.pop(name)
            found[name] = ([round(min(times), 1), round(max(times), 1)] if times else None)
        return found


class Fleet:
    """The worker processes of one run, each in a process group of its own."""

    def __init__(self, folder: Path, url: str, queues: int) -> None:
        self.folder = folder
        self.url = url
        self.queues = queues
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *, hang: bool, queue: str | None) -> subprocess.Popen[bytes]:
        """One ``dramatiq`` worker (a main process and one worker process)."""
        env = {**os.environ, APP_ENV: "1", QUEUES_ENV: str(self.queues),
               "DRAMATIQ_REDIS_URL": self.url}
        env.pop(HANG_ENV, None)
        if hang:
            env[HANG_ENV] = "1"
        argv = [sys.executable, "-m", "dramatiq", "benchmarks.dramatiq_race:broker",
                "--processes", "1", "--threads", str(THREADS), "--path", str(REPO)]
        if queue is not None:
            argv += ["--queues", queue]
        with (self.folder / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=env, cwd=REPO,
                                       start_new_session=True)
        self.processes.append(process)
        return process

    @staticmethod
    def kill(process: subprocess.Popen[bytes]) -> None:
        """SIGKILL its whole group: the main process and its worker process together."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def close(self) -> None:
        for process in self.processes:
            self.kill(process)


def _wait(condition: Any, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.25)


def _reconciler() -> str:
    found = shutil.which("reconciler", path=str(Path(sys.executable).parent))
    if found is None:
        raise SystemExit("the reconciler's console script is not installed beside python")
    return found


def _audit(database: Path) -> list[tuple[str, str, str]]:
    """Every recorded decision of the dramatiq source: message id, disposition, reason."""
    with contextlib.closing(sqlite3.connect(database)) as conn:
        return list(conn.execute(
            "SELECT job_id, disposition, decision_reason FROM reconciliation_decisions "
            "WHERE job_source = 'dramatiq'"))


@dataclass
class Held:
    """The dead workers' messages as the kill found them."""

    acks: dict[str, set[str]]
    """Each dead worker's acks set (its key) and the Redis ids in it."""
    message_ids: dict[str, str]
    """Dramatiq's message id of each Redis id (the audit's job id)."""
    started: int

    @property
    def ids(self) -> dict[str, str]:
        """Each Redis id and the acks set holding it."""
        return {m: key for key, members in self.acks.items() for m in members}


def _load(client: Any, keys: Any, url: str, dead: int) -> Held:
    """Each dead worker's queue sent 16 messages, until it holds them (8 started)."""
    from dramatiq import Message  # noqa: PLC0415 - optional
    from dramatiq.brokers.redis import RedisBroker  # noqa: PLC0415

    # Sent by a broker of this process, at Dramatiq's defaults (its enqueue is a command
    # like any other); 16 a queue: each dead worker starts 8 and prefetches 8.
    sender = RedisBroker(url=url)  # type: ignore[no-untyped-call]
    for k in range(dead):
        for n in range(PREFETCH):
            sender.enqueue(Message(queue_name=_queue(k), actor_name=f"race_{k}",
                                   args=(), kwargs={}, options={"n": n}))

    def acks() -> dict[str, set[str]]:
        return {key.decode(): {m.decode() for m in client.smembers(key)}
                for key in client.scan_iter(match=keys.acks_pattern, count=1000)}

    _wait(lambda: sum(map(len, acks().values())) == dead * PREFETCH
          and client.hlen(keys.marks) == dead * THREADS,
          "every message fetched and 8 a worker started")
    message_ids = {redis_id.decode(): json.loads(data)["message_id"]
                   for k in range(dead)
                   for redis_id, data in client.hgetall(keys.messages(_queue(k))).items()}
    return Held(acks(), message_ids, client.hlen(keys.marks))


def _follow(client: Any, held: Held, folder: Path, url: str, *, offset: float,
            deadline: float, killed: float) -> tuple[dict[str, float], Path]:
    """The sidecar started ``offset`` seconds after the kill; when each message left its
    acks set (seconds after the kill), until all did or ``deadline``; the audit's file."""
    database = folder / "reconciler.db"
    config = folder / "reconciler.toml"
    config.write_text(f'[source]\nkind = "dramatiq"\nredis_url = "{url}"\n'
                      '[kinds."*"]\neffect = "idempotent"\n')
    env = {**os.environ, "RECONCILER_CONFIG": str(config),
           "RECONCILER_DATABASE_URL": f"sqlite:///{database}",
           "RECONCILER_METRICS_PORT": "0"}
    subprocess.run([_reconciler(), "db", "upgrade"], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sidecar: subprocess.Popen[bytes] | None = None
    ids = held.ids
    moved_at: dict[str, float] = {}
    try:
        while len(moved_at) < len(ids) and time.monotonic() - killed < deadline:
            if sidecar is None and time.monotonic() - killed >= offset:
                with (folder / "sidecar.log").open("ab") as out:
                    sidecar = subprocess.Popen([_reconciler(), "run"], env=env, stdout=out,
                                               stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL)
            with client.pipeline(transaction=False) as pipe:
                for key in held.acks:
                    pipe.smembers(key)
                still = {m.decode() for found in pipe.execute() for m in found}
            at = time.monotonic() - killed
            for redis_id in ids:
                if redis_id not in still and redis_id not in moved_at:
                    moved_at[redis_id] = at
            time.sleep(POLL_SECONDS)
    finally:
        if sidecar is not None:
            stop(sidecar, 60)
    return moved_at, database


def _count(run: Run, held: Held, moved_at: dict[str, float], database: Path) -> Counter[str]:
    """Who moved each message, from the audit; the passes' skips by reason."""
    applied: set[str] = set()
    fence_lost: set[str] = set()
    skips: Counter[str] = Counter()
    for job_id, disposition, reason in (_audit(database) if database.exists() else []):
        if disposition != "skip":
            applied.add(job_id)
            continue
        skips[reason] += 1
        if reason == "fence_lost":
            fence_lost.add(job_id)
    run.braked_skips = skips["mass_staleness_brake"]
    lost_workers: set[str] = set()
    for redis_id, key in held.ids.items():
        message_id = held.message_ids[redis_id]
        if redis_id not in moved_at:
            run.not_moved += 1
        elif message_id in applied:
            run.moved_by_reconciler += 1
            run.reconciler_move_s.append(moved_at[redis_id])
        else:
            run.moved_by_maintenance += 1
            run.fence_lost_recorded += message_id in fence_lost
            run.maintenance_move_s.append(moved_at[redis_id])
            lost_workers.add(key)
    run.workers_lost_to_maintenance = len(lost_workers)
    return skips


def one_run(number: int, url: str, args: argparse.Namespace, down: float | None,
            log: Any) -> Run:
    """Dead workers killed, the reconciler started after ``down`` seconds (None: a random
    offset within one interval), the messages followed until every one moved."""
    import redis  # noqa: PLC0415 - optional, with dramatiq

    from reconciler.sources.dramatiq.keys import Keys  # noqa: PLC0415

    keys = Keys(NAMESPACE)
    client = redis.Redis.from_url(url)
    client.flushall()
    offset = random.uniform(0, DEFAULT_INTERVAL) if down is None else down
    run = Run(number, round(offset, 1), args.dead, args.live)
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="reconciler-race-")))
        fleet = Fleet(folder, url, args.dead)
        stack.callback(fleet.close)

        dead = [fleet.start(f"dead{k}", hang=True, queue=_queue(k)) for k in range(args.dead)]
        _wait(lambda: client.hlen(keys.workers) >= args.dead, "the dead workers to boot")
        held = _load(client, keys, url, args.dead)
        run.messages, run.started = len(held.ids), held.started

        registered = client.hlen(keys.workers)
        for k in range(args.live):
            fleet.start(f"live{k}", hang=False, queue=None)
        _wait(lambda: client.hlen(keys.workers) >= registered + args.live,
              "the live workers to boot")
        time.sleep(3)  # their consumers polling

        seconds, micros = client.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        dead_brokers = {key[len(keys.acks_prefix):].rsplit(".", 1)[0] for key in held.acks}
        beats = [client.zscore(keys.heartbeats, b) or 0.0 for b in dead_brokers]
        run.last_heartbeat_age_s = round((now_ms - min(beats)) / 1000, 2)
        for process in dead:
            fleet.kill(process)
        killed = time.monotonic()
        log(f"run {number}: {run.messages} messages on {args.dead} dead workers killed; "
            f"the reconciler starts in {offset:.1f} s")

        deadline = args.deadline if down is None else max(args.deadline, down + 180)
        moved_at, database = _follow(client, held, folder, url, offset=offset,
                                     deadline=deadline, killed=killed)
        skips = _count(run, held, moved_at, database)
        if skips:
            log(f"run {number}: the passes' skips by reason {dict(skips)}")
    return run


def main(argv: list[str] | None = None) -> int:
    """Runs of the race; a table, or one JSON object per run."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dramatiq_race",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs at the defaults")
    parser.add_argument("--dead", type=int, default=7, help="dead workers a run (16 "
                        "messages each; 2 or more engage the reconciler's brake)")
    parser.add_argument("--live", type=int, default=3, help="idle live workers a run")
    parser.add_argument("--deadline", type=float, default=240.0,
                        help="seconds after the kill a run gives up waiting")
    parser.add_argument("--control", action="store_true",
                        help="and one run with the reconciler down after the kill")
    parser.add_argument("--control-down", type=float, default=90.0)
    parser.add_argument("--json", action="store_true", help="one JSON object per run")
    args = parser.parse_args(argv)
    if shutil.which("dramatiq", path=str(Path(sys.executable).parent)) is None:
        raise SystemExit("the race needs dramatiq: pip install '.[dramatiq]'")
    from benchmarks.foreign_python import start_redis  # noqa: PLC0415

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    plan: list[float | None] = [None] * args.runs
    if args.control:
        plan.append(args.control_down)
    runs = []
    with contextlib.ExitStack() as stack:
        url = start_redis(stack, "dramatiq race")
        for number, down in enumerate(plan, 1):
            run = one_run(number, url, args, down, log)
            runs.append(run)
            print(json.dumps(run.row()) if args.json else _line(run), flush=True)
    measured = [r for r, down in zip(runs, plan, strict=True) if down is None]
    if measured and not args.json:
        total = sum(r.messages for r in measured)
        lost = sum(r.moved_by_maintenance for r in measured)
        times = [t for r in measured for t in r.reconciler_move_s]
        print(f"defaults, {len(measured)} runs: {total} messages, maintenance first on "
              f"{lost} ({100 * lost / total:.1f} %), the reconciler's moves "
              f"{min(times, default=0):.0f}-{max(times, default=0):.0f} s after the kill "
              f"(median {statistics.median(times) if times else 0:.0f} s)")
    return 0


def _line(run: Run) -> str:
    row = run.row()
    return " ".join(f"{k}={v}" for k, v in row.items())


if __name__ == "__main__":
    sys.exit(main())
