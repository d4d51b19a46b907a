"""Dramatiq at a hundred thousand messages, beside Dramatiq's own maintenance.

    python -m benchmarks --source dramatiq [--engine sqlite|postgresql|both] [--smoke]

A throwaway redis-server is the broker, written in pipelines in Dramatiq's own layout
(``Message.encode``, ``dispatch.lua``'s ``enqueue`` and ``fetch``, the middleware's marks
and registrations): ``--jobs`` messages over four queues, ``--running`` of them fetched
and started by live worker processes (ten a broker, as threads and prefetch hold them),
``--orphans`` of those on brokers that die, the rest queued. The reconciler's own tables are
on ``--engine``, as a sidecar keeps them.

Neither side can tell a broker dead at once: Dramatiq's maintenance waits until its
heartbeat is ``heartbeat_timeout`` (60 s) old, the reconciler until it has seen it still
for ``session_timeout_seconds``. The benchmark does not wait: ``kill`` ages the dead
brokers' heartbeats past Dramatiq's timeout and records them in the beats hash as still
since then (what passes watching them would have written), the same brokers for both
sides; ``keep_alive`` moves the live brokers' heartbeats, as their commands do.

In one run, per engine:

- ``quiet_pass``: median of ``--runs`` real passes through the ``dramatiq`` source with
  nothing to recover (the live brokers' heartbeats moved before each, as they move every
  second); ``peer_value``: median of Dramatiq's maintenance over every queue, nothing dead
  (one broker command per queue with ``maintenance_chance`` at its maximum: what the 1 in
  1,000 commands that run it cost).
- ``recovery``: the orphans' brokers die; Dramatiq's maintenance over every queue puts
  their messages back (``peer_value``, jobs/s, effectful or not, no retry counted); the
  dataset is built again, they die again, and the reconciler's passes decide them
  (``value``, jobs/s, every decision recorded; every kind idempotent, so all resumed).

``redis_commands`` and ``redis_usec``: what Redis counted per quiet pass or per recovered
message for each side (``INFO commandstats``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.foreign_base import Size
from benchmarks.foreign_python import start_redis
from benchmarks.harness import Databases, row_printer
from reconciler.config.loader import load_config, pass_config
from reconciler.core.passes import PassConfig, run_pass
from reconciler.root.cli import assemble_cli
from reconciler.sources.dramatiq.keys import Keys, Mark

FULL = Size(jobs=100_000, running=10_000, orphans=1_000)
SMOKE = Size(jobs=10_000, running=100, orphans=10)
BATCH_SIZE = 500
QUEUES = ("q0", "q1", "q2", "q3")
PER_BROKER = 10
KEYS = Keys("dramatiq")


class DramatiqMessages:
    """The dataset in a Redis, in Dramatiq's layout."""

    def __init__(self, url: str, size: Size) -> None:
        import redis  # noqa: PLC0415 - optional, with dramatiq

        self.client = redis.Redis.from_url(url)
        self.url = url
        self.size = size
        self.live: list[str] = []
        self.dead: list[str] = []
        self.orphans: set[str] = set()

    def build(self) -> None:
        """Every message stored, queued or fetched and marked, its brokers registered."""
        from dramatiq import Message  # noqa: PLC0415 - optional

        self.client.flushdb()
        self.live, self.dead, self.orphans = [], [], set()
        now_ms = self._now_ms()
        registration = json.dumps({"v": 1, "version": "2.2.1"})
        pipe = self.client.pipeline(transaction=False)
        broker = ""
        for n in range(self.size.jobs):
            queue = QUEUES[n % len(QUEUES)]
            redis_id = str(uuid.uuid4())
            data = Message(queue_name=queue, actor_name=f"work_{queue}", args=(n,),
                           kwargs={}, options={"redis_message_id": redis_id}).encode()
            pipe.hset(KEYS.messages(queue), redis_id, data)
            if n < self.size.running:
                if n % PER_BROKER == 0:
                    broker = str(uuid.uuid4())
                    dead = n < self.size.orphans
                    (self.dead if dead else self.live).append(broker)
                    pipe.zadd(KEYS.heartbeats, {broker: now_ms})
                    pipe.hset(KEYS.workers, broker, registration)
                if n < self.size.orphans:
                    self.orphans.add(redis_id)
                pipe.sadd(KEYS.acks(broker, queue), redis_id)
                pipe.hset(KEYS.marks, redis_id, Mark(broker, False, None, None, None).encode())
            else:
                pipe.rpush(KEYS.queue(queue), redis_id)
            if n % 5000 == 4999:
                pipe.execute()
        pipe.execute()

    def _now_ms(self) -> int:
        seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def keep_alive(self) -> None:
        """Every broker but the dead ones sends a command: its heartbeat moves."""
        now_ms = self._now_ms()
        self.client.zadd(KEYS.heartbeats, dict.fromkeys(self.live, now_ms))

    def kill(self) -> None:
        """The dead brokers' heartbeats past Dramatiq's timeout, and still, as passes
        watching them since would have recorded."""
        seconds, _ = self.client.time()
        old_ms = (int(seconds) - 120) * 1000
        with self.client.pipeline(transaction=False) as pipe:
            pipe.zadd(KEYS.heartbeats, dict.fromkeys(self.dead, old_ms))
            pipe.zadd(KEYS.beats_copy, dict.fromkeys(self.dead, old_ms))
            pipe.hset(KEYS.beats, mapping={b: f"{float(old_ms)!r} {float(seconds) - 120!r}"
                                           for b in self.dead})
            pipe.set(KEYS.beats_at, repr(float(seconds)), nx=True)
            pipe.execute()

    def maintenance(self) -> None:
        """Dramatiq's own maintenance over every queue, through its real broker."""
        from dramatiq.brokers.redis import MAINTENANCE_SCALE, RedisBroker  # noqa: PLC0415

        broker = RedisBroker(url=self.url, maintenance_chance=MAINTENANCE_SCALE)
        for queue in QUEUES:
            broker.do_qsize(queue)
        self.client.zrem(KEYS.heartbeats, broker.broker_id)

    def orphans_queued(self) -> int:
        """How many of the orphans are back on their queues."""
        with self.client.pipeline(transaction=False) as pipe:
            for queue in QUEUES:
                pipe.lrange(KEYS.queue(queue), 0, -1)
            queued = {m.decode() for found in pipe.execute() for m in found}
        return len(self.orphans & queued)

    @contextlib.contextmanager
    def counting(self) -> Iterator[list[int]]:
        """Redis's own count of the commands it served, and their time (µs)."""
        self.client.config_resetstat()
        found = [0, 0]
        try:
            yield found
        finally:
            stats = self.client.info("commandstats")
            for name, row in stats.items():
                if name not in ("cmdstat_config", "cmdstat_info"):
                    found[0] += int(row["calls"])
                    found[1] += int(row["usec"])


def _timed_ms(func: Callable[[], Any], before: Callable[[], None], runs: int) -> list[float]:
    before()
    func()  # warm: connections, statement caches, the pass row's first insert
    samples = []
    for _ in range(runs):
        before()
        started = time.perf_counter()
        func()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def _drain(store: Any, config: PassConfig) -> int:
    """Passes until one decides less than a batch; the messages acted on."""
    acted = 0
    while True:
        report = run_pass(store, config)
        acted += sum(1 for d in report.decisions if d.disposition.value != "skip")
        if len(report.decisions) < config.batch_size:
            return acted


def _quiet(store: Any, config: PassConfig) -> None:
    if run_pass(store, config).decisions:
        raise RuntimeError("the quiet pass found messages to decide")


def measure(engine_name: str, size: Size, runs: int,
            emit: Callable[[dict[str, Any]], None]) -> None:
    """Quiet pass and recovery on one engine, each beside Dramatiq's maintenance."""
    with contextlib.ExitStack() as stack:
        url = start_redis(stack, "dramatiq")
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        dbs = Databases(engine_name, None)
        stack.callback(dbs.close)
        engine = stack.enter_context(dbs.fresh())
        messages = DramatiqMessages(url, size)
        messages.build()
        path = tmp / "reconciler.toml"
        path.write_text(f'[source]\nkind = "dramatiq"\nredis_url = "{url}"\n'
                        '[kinds."*"]\neffect = "idempotent"\n')
        config = load_config(path, database_url=str(engine.url), batch_size=BATCH_SIZE)
        store = assemble_cli(config, engine=engine).passes
        pass_cfg = pass_config(config.settings, "bench", config.kinds)
        base = {"source": "dramatiq", "engine": engine_name, "jobs": size.jobs,
                "running": size.running}

        with messages.counting() as peer_sent:
            peer = statistics.median(_timed_ms(messages.maintenance, messages.keep_alive,
                                               runs))
        with messages.counting() as ours_sent:
            ours = statistics.median(_timed_ms(lambda: _quiet(store, pass_cfg),
                                               messages.keep_alive, runs))
        emit({**base, "measurement": "quiet_pass", "orphans": 0, "value": round(ours, 2),
              "unit": "ms", "peer_value": round(peer, 2), "ratio_to_peer": round(ours / peer, 2),
              "runs": runs, "redis_commands": round(ours_sent[0] / (runs + 1), 1),
              "peer_redis_commands": round(peer_sent[0] / (runs + 1), 1),
              "redis_usec": round(ours_sent[1] / (runs + 1), 1),
              "peer_redis_usec": round(peer_sent[1] / (runs + 1), 1)})

        messages.keep_alive()
        messages.kill()
        with messages.counting() as peer_sent:
            started = time.perf_counter()
            messages.maintenance()
            peer_seconds = time.perf_counter() - started
        peer_recovered = messages.orphans_queued()
        if peer_recovered != size.orphans:
            raise RuntimeError(f"Dramatiq's maintenance took {peer_recovered} of "
                               f"{size.orphans} orphans")
        messages.build()
        messages.keep_alive()
        messages.kill()
        with messages.counting() as ours_sent:
            started = time.perf_counter()
            acted = _drain(store, pass_cfg)
            seconds = time.perf_counter() - started
        if acted != size.orphans or messages.orphans_queued() != size.orphans:
            raise RuntimeError(f"the reconciler recovered {acted} of {size.orphans} orphans")
        emit({**base, "measurement": "recovery", "orphans": size.orphans,
              "value": round(acted / seconds), "unit": "jobs/s",
              "peer_value": round(peer_recovered / peer_seconds),
              "ratio_to_peer": round((acted / seconds) / (peer_recovered / peer_seconds), 3),
              "seconds": round(seconds, 3), "peer_seconds": round(peer_seconds, 3),
              "redis_commands_per_job": round(ours_sent[0] / acted, 1),
              "peer_redis_commands_per_job": round(peer_sent[0] / peer_recovered, 1),
              "redis_usec_per_job": round(ours_sent[1] / acted, 1),
              "peer_redis_usec_per_job": round(peer_sent[1] / peer_recovered, 1)})


def main(argv: list[str] | None = None) -> int:
    """Measure the dramatiq source on the chosen engines; a table, or JSON lines."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks --source dramatiq",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("sqlite", "postgresql", "both"),
                        default="sqlite", help="where the reconciler's own tables are")
    parser.add_argument("--jobs", type=int, default=FULL.jobs)
    parser.add_argument("--running", type=int, default=FULL.running)
    parser.add_argument("--orphans", type=int, default=FULL.orphans)
    parser.add_argument("--runs", type=int, default=15, help="quiet passes per side")
    parser.add_argument("--smoke", action="store_true", help="10k messages: checks it runs")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    size = SMOKE if args.smoke else Size(args.jobs, args.running, args.orphans)
    if not 0 < size.orphans <= size.running <= size.jobs:
        parser.error("need 0 < --orphans <= --running <= --jobs")
    emit = row_printer(args.json, 8)
    engines = ("sqlite", "postgresql") if args.engine == "both" else (args.engine,)
    for engine_name in engines:
        measure(engine_name, size, 3 if args.smoke else args.runs, emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
