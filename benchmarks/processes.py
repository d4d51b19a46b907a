"""The processes of the recovery measurements: ``reconciler run`` replicas and orphan
workers (benchmarks/orphans.py) started beside each other, their logs, their readiness and
what their own log lines and /proc say they did.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
# The workers' claims: long enough to outlast the claim phase on a slow machine.
CLAIM_LEASE_SECONDS = 3600.0
PROGRESS_SECONDS = 5.0
START_TIMEOUT_SECONDS = 120.0
STOP_TIMEOUT_SECONDS = 40.0


def say(text: str) -> None:
    """A progress line on stderr (stdout keeps the table or the JSON lines)."""
    print(f"# {time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _child_env(url: str, settings: dict[str, float], **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECONCILER_")}
    env["RECONCILER_DATABASE_URL"] = url
    env.update({f"RECONCILER_{k.upper()}": str(v) for k, v in settings.items()})
    env.update(extra)
    return env


class Children:
    """The processes of one scenario; whatever is still running at the end is killed."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="reconciler-recovery-"))
        self.processes: list[subprocess.Popen[bytes]] = []
        self.logs: dict[int, Path] = {}

    def start(self, argv: list[str], env: dict[str, str], name: str,
              stdout: int | None = None) -> subprocess.Popen[bytes]:
        log = self.folder / f"{name}.log"
        with log.open("ab") as err:
            process = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stderr=err,
                                       stdout=stdout if stdout is not None else err)
        self.processes.append(process)
        self.logs[process.pid] = log
        return process

    def tail(self, process: subprocess.Popen[bytes], lines: int = 15) -> str:
        text = self.logs[process.pid].read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def close(self, *, keep_logs: bool) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        if keep_logs:
            say(f"logs kept in {self.folder}")
        else:
            shutil.rmtree(self.folder, ignore_errors=True)


@contextmanager
def children() -> Iterator[Children]:
    """Processes that never outlive the measurement; logs kept only when it failed."""
    group = Children()
    failed = True
    try:
        yield group
        failed = False
    finally:
        group.close(keep_logs=failed)


@dataclass
class Replica:
    """A ``reconciler run`` process and the port of its /readyz."""

    name: str
    port: int
    process: subprocess.Popen[bytes]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz",
                                        timeout=1) as reply:
                return int(reply.status) == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        """SIGTERM, as an orchestrator would; SIGKILL if it does not end in time."""
        stop(self.process, STOP_TIMEOUT_SECONDS)


def stop(process: subprocess.Popen[bytes], timeout_seconds: float) -> None:
    """SIGTERM, as an orchestrator would; SIGKILL if it does not end in
    ``timeout_seconds``."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_seconds)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def start_replicas(group: Children, url: str, settings: dict[str, float], count: int,
                   tag: str) -> list[Replica]:
    """Start ``count`` replicas (``wait_ready`` waits for them)."""
    replicas = []
    for i in range(count):
        name, port = f"bench-{tag}-replica-{i}", _free_port()
        env = _child_env(url, settings, RECONCILER_INSTANCE_NAME=name,
                         RECONCILER_METRICS_PORT=str(port),
                         RECONCILER_METRICS_HOST="127.0.0.1")
        process = group.start([sys.executable, "-m", "reconciler.cli", "run"], env, name)
        replicas.append(Replica(name, port, process))
    return replicas


def wait_ready(group: Children, replicas: list[Replica]) -> None:
    """Wait until every replica answers /readyz (it has passed at least once)."""
    count = len(replicas)
    started, last_said = time.monotonic(), time.monotonic()
    waiting = list(replicas)
    while waiting:
        for replica in list(waiting):
            if replica.process.poll() is not None:
                raise SystemExit(f"replica {replica.name} exited with "
                                 f"{replica.process.returncode}:\n{group.tail(replica.process)}")
            if replica.ready():
                waiting.remove(replica)
        if time.monotonic() - started > START_TIMEOUT_SECONDS:
            raise SystemExit(f"{len(waiting)} replicas not ready after "
                             f"{START_TIMEOUT_SECONDS:.0f} s")
        if waiting and time.monotonic() - last_said > PROGRESS_SECONDS:
            last_said = time.monotonic()
            say(f"{count - len(waiting)}/{count} replicas ready")
        time.sleep(0.2)


def shares_of(jobs: int, workers: int) -> list[int]:
    """How many jobs each worker claims."""
    return [jobs // workers + (1 if i < jobs % workers else 0) for i in range(workers)]


def start_orphan_workers(group: Children, url: str, settings: dict[str, float], jobs: int,
                         *, workers: int, tag: str) -> list[subprocess.Popen[bytes]]:
    """Start workers that claim ``jobs`` between them (``wait_claimed`` waits for them)."""
    return [
        group.start([sys.executable, "-m", "benchmarks.orphans", url,
                     f"bench-{tag}-worker-{i}", str(share), str(CLAIM_LEASE_SECONDS)],
                    _child_env(url, settings), f"worker-{i}", stdout=subprocess.PIPE)
        for i, share in enumerate(shares_of(jobs, workers))
    ]


def cpu_seconds(replicas: list[Replica]) -> float | None:
    """The CPU seconds (user and system) the replicas have used so far, from Linux's
    /proc; None elsewhere."""
    total = 0.0
    for replica in replicas:
        try:
            stat = Path(f"/proc/{replica.process.pid}/stat").read_text()
        except OSError:
            return None
        # The fields after the command's closing parenthesis; utime and stime are 14 and 15.
        fields = stat.rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def replica_work(group: Children, replicas: list[Replica], span_seconds: float
                  ) -> dict[str, Any]:
    """What the replicas did, from their own log lines: passes that decided something,
    their median length, batches per tick (a tick runs full batches back to back, and the
    next starts at once when one stops with backlog left) and ``busy``, the share of the
    drain's span a replica spent in those passes (1.0: never idle). The pass rows cannot
    tell: a row starts after its scan."""
    lengths: list[float] = []
    ticks: list[int] = []
    for replica in replicas:
        for line in group.logs[replica.process.pid].read_text(errors="replace").splitlines():
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            if fields.get("event") == "pass_finished" and fields.get("candidates", "0") != "0":
                lengths.append(float(fields["seconds"]))
            elif fields.get("event") == "tick_finished" and fields.get("decisions") != "0":
                ticks.append(int(fields["batches"]))
    if not lengths or span_seconds <= 0:
        return {}
    return {"passes": len(lengths), "pass_ms": round(statistics.median(lengths) * 1000),
            "batches_per_tick": round(statistics.mean(ticks), 1) if ticks else None,
            "busy": round(sum(lengths) / (span_seconds * len(replicas)), 2)}
