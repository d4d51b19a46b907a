"""A fork server for the chaos harness: new worker and replica processes in milliseconds.

A run kills a process every second or so; starting each with a fresh interpreter costs
about 0.6 s of CPU importing SQLAlchemy, psycopg, pydantic, Alembic and APScheduler, which
on a small machine starves the very processes under test. This server imports those
libraries once and forks a child per request; the child (a real process with its own
pid, killed with a real SIGKILL) sets its environment, then imports the project's own
modules and runs the requested module as ``__main__``. The project's modules are never
imported here: ``reconciler.failpoints`` reads ``RECONCILER_FAILPOINTS`` at import, so each
child imports them after its environment is set, exactly as a fresh interpreter would.

Protocol: JSON lines on stdin (``spawn``, ``kill``, ``exit``), JSON lines on stdout
(``spawned`` with the pid, ``exited`` with the exit code, negative for a signal as in
``subprocess``). Kills go through the server so a signal only ever reaches a child it has
not reaped yet: a pid is never reused under the harness's feet. On ``exit``, or at the
end of its input (the harness died, even by SIGKILL), it SIGKILLs and reaps every child
it still has and, when started with ``--cleanup DIR``, removes the run's folder. Its
children die with it (tests/chaos/lifeline.py).
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import os
import queue
import runpy
import select
import shutil
import signal
import subprocess
import sys
import threading
import traceback
from typing import Any

PRELOAD = (
    "sqlalchemy", "sqlalchemy.orm", "sqlalchemy.ext.compiler", "sqlalchemy.dialects.sqlite",
    "sqlalchemy.dialects.postgresql", "psycopg", "sqlalchemy.dialects.mysql", "pymysql",
    "pydantic",
    "alembic.config", "alembic.script", "alembic.runtime.migration", "alembic.command",
    "apscheduler.schedulers.background", "prometheus_client",
)
REAP_INTERVAL_SECONDS = 0.02
SPAWN_TIMEOUT_SECONDS = 30.0


def _reply(message: dict[str, Any]) -> None:
    # OSError: the harness stopped reading; it is going away, and so are we.
    with contextlib.suppress(OSError):
        os.write(1, (json.dumps(message) + "\n").encode())


def _run_child(module: str, args: list[str], env: dict[str, str], log: str) -> None:
    """In the forked child: redirect output, take the environment, run ``module``."""
    code: int = 1
    try:
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(cleanup: str | None) -> None:
    # No death signal here: the end of input says the harness is gone, and this server
    # outlives it just long enough to kill its children and remove the run's folder.
    for name in PRELOAD:
        importlib.import_module(name)
    live: set[int] = set()
    pending = b""
    try:
        while True:
            ready, _, _ = select.select([0], [], [], REAP_INTERVAL_SECONDS)
            if ready:
                chunk = os.read(0, 65536)
                if not chunk:
                    return
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    if not _handle(json.loads(line), live):
                        return
            _reap(live, block=False)
    finally:
        for pid in live:
            os.kill(pid, signal.SIGKILL)
        _reap(live, block=True)
        if cleanup:
            shutil.rmtree(cleanup, ignore_errors=True)


def _handle(request: dict[str, Any], live: set[int]) -> bool:
    """Serve one request; False for ``exit``."""
    if request["op"] == "exit":
        return False
    if request["op"] == "kill":
        if request["pid"] in live:
            os.kill(request["pid"], request["sig"])
    elif request["op"] == "spawn":
        pid = os.fork()
        if pid == 0:
            _run_child(request["module"], request["args"], request["env"], request["log"])
        live.add(pid)
        _reply({"op": "spawned", "id": request["id"], "pid": pid})
    return True


def _reap(live: set[int], *, block: bool) -> None:
    while live:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            live.clear()
            return
        if pid == 0:
            return
        if pid in live:
            live.discard(pid)
            _reply({"op": "exited", "pid": pid, "code": os.waitstatus_to_exitcode(status)})



class ForkServer:
    """The harness's handle on a running fork server (standard library only)."""

    def __init__(self, *, cwd: str, env: dict[str, str], log: str,
                 cleanup: str | None = None) -> None:
        argv = [sys.executable, "-m", "tests.chaos.spawner"]
        if cleanup:
            argv += ["--cleanup", cleanup]
        with open(log, "ab") as errors:
            self.popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=errors, cwd=cwd, env=env)
        self.pid = self.popen.pid
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._exits: queue.Queue[tuple[int, int]] = queue.Queue()
        self._ids = itertools.count()
        self._reader = threading.Thread(target=self._read, daemon=True, name="fork-server")
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            message = json.loads(line)
            if message["op"] == "exited":
                self._exits.put((message["pid"], message["code"]))
            else:
                self._replies.put(message)
        self._replies.put(None)

    def _send(self, message: dict[str, Any]) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write((json.dumps(message) + "\n").encode())
        self.popen.stdin.flush()

    def spawn(self, module: str, args: list[str], env: dict[str, str], log: str) -> int:
        """Fork a child running ``python -m module args...`` with exactly ``env``; its pid."""
        number = next(self._ids)
        self._send({"op": "spawn", "id": number, "module": module, "args": args, "env": env,
                    "log": log})
        reply = self._replies.get(timeout=SPAWN_TIMEOUT_SECONDS)
        if reply is None or reply.get("id") != number:
            raise RuntimeError(f"fork server answered {reply!r} to spawn request {number}")
        return int(reply["pid"])

    def kill(self, pid: int, sig: int) -> None:
        """Signal a child the server has not reaped yet (otherwise nothing happens)."""
        self._send({"op": "kill", "pid": pid, "sig": int(sig)})

    def exits(self, timeout: float = 0.0) -> list[tuple[int, int]]:
        """(pid, exit code) of children that ended; waits up to ``timeout`` for the first."""
        found: list[tuple[int, int]] = []
        try:
            found.append(self._exits.get(timeout=timeout) if timeout else
                         self._exits.get_nowait())
            while True:
                found.append(self._exits.get_nowait())
        except queue.Empty:
            pass
        return found

    def close(self) -> None:
        """Stop the server; it SIGKILLs and reaps whatever children it still has."""
        with contextlib.suppress(OSError, ValueError):
            self._send({"op": "exit"})
        with contextlib.suppress(OSError, ValueError):
            assert self.popen.stdin is not None
            self.popen.stdin.close()
        try:
            self.popen.wait(timeout=SPAWN_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        self._reader.join(timeout=SPAWN_TIMEOUT_SECONDS)
        if self.popen.stdout is not None:
            self.popen.stdout.close()


if __name__ == "__main__":
    serve(sys.argv[2] if sys.argv[1:2] == ["--cleanup"] else None)
