"""What the demos share: their config, their output, waiting on their workers, a throwaway
redis-server, SIGKILLing a worker whole, and passes until the killed workers' jobs are
decided."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from reconciler.config.loader import Config, config_from
from reconciler.core.passes import run_pass
from reconciler.errors import ConfigError
from reconciler.root.cli import assemble_cli


class MissingPrerequisiteError(ConfigError):
    """What a demo needs is not installed: PostgreSQL binaries, or the system it runs
    (exit 2)."""


def demo_config(*, source: Mapping[str, Any] | None = None,
                kinds: Mapping[str, Any] | None = None,
                **settings: Any) -> Config:
    """A demo's config through the one loader: its ``[source]`` and ``[kinds]`` tables as a
    config file would hold them, its settings as flags (so the demo shows the same story
    whatever ``RECONCILER_CONFIG`` its caller has set)."""
    tables = {name: table for name, table in (("source", source), ("kinds", kinds))
              if table is not None}
    return config_from(tables, "the demo's config", **settings)


def say(text: str) -> None:
    """One line of the demo's story, shown at once (workers run beside it)."""
    print(text, flush=True)


def wait(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``condition`` until it holds; one ``ConfigError`` line naming ``what`` once
    ``timeout`` seconds have passed without it."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise ConfigError(f"demo: timed out waiting for {what}")
        time.sleep(0.1)


def pass_until_decided(config: Config, tasks: set[str], due: str, noun: str = "task"
                       ) -> bool:
    """Passes, for up to 30 s, until each task is decided (each once it is due), saying each
    decision with the seconds since the kill and ``due`` (what made it due); whether all
    were. ``noun``: what the system calls its work (RQ: a job)."""
    started = time.monotonic()
    decided: set[str] = set()
    with assemble_cli(config) as cli:
        while time.monotonic() - started < 30 and decided != tasks:
            report = run_pass(cli.passes, cli.pass_config("demo"))
            for d in report.decisions:
                say(f"pass {report.pass_id}, {time.monotonic() - started:.1f} s after the "
                    f"kill ({due}): {noun} {d.job_id}: {d.disposition.value} "
                    f"({d.reason.value})")
                decided.add(str(d.job_id))
            time.sleep(0.3)
    if decided != tasks:
        say(f"no pass decided both {noun}s within 30 s")
    return decided == tasks


def run_over_redis(name: str, packages: tuple[str, ...], extra: str, role: str,
                   demo: Callable[[Path, str], int]) -> int:
    """A demo over a throwaway redis-server: ``demo(sqlite_path, redis_url)``, once its
    packages and redis-server are there (each missing one is one line naming how to get
    it); its folder removed after."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        raise MissingPrerequisiteError(
            f"the {name} demo needs {', '.join(missing)}: pip install "
            f"'stale-claim-reconciler[{extra}]'")
    binary = shutil.which("redis-server")
    if binary is None:
        raise MissingPrerequisiteError(
            f"the {name} demo needs redis-server ({role}): apt-get install redis-server")
    folder = Path(tempfile.mkdtemp(prefix=f"reconciler-demo-{extra}-"))
    try:
        with redis_server(binary, folder) as url:
            return demo(folder / "demo.db", url)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def redis_server(binary: str, folder: Path) -> Iterator[str]:
    """A throwaway redis-server on a free port, its files in ``folder``; its URL. Stopped
    on the way out. The ``redis`` package must be importable (the caller checked)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save",
                               "", "--appendonly", "no", "--dir", str(folder)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis  # noqa: PLC0415 - optional, checked by the caller

        client = redis.Redis.from_url(f"redis://127.0.0.1:{port}/0")
        wait(lambda: _answers(client), "redis-server to start", timeout=20)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait(timeout=10)


def _answers(client: Any) -> bool:
    try:
        return bool(client.ping())
    except Exception:
        return False


def kill_tree(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the worker's children (its pool, its work horse), then the worker: nothing
    of it records an end."""
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    for child in children.read_text().split() if children.exists() else []:
        os.kill(int(child), signal.SIGKILL)
    process.kill()
    process.wait(timeout=10)
