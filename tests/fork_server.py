"""A fork server for the suite's own Python processes: a new interpreter in milliseconds.

The chaos harness kills a process every second or so, and the integration tests start
workers, racers and replicas by the hundred; a fresh interpreter costs about 0.6 s of CPU
importing SQLAlchemy, psycopg, pydantic, Alembic and APScheduler, which on a small
machine starves the very processes under test. This server imports those libraries once
and forks a child per request: a real process with its own pid, its own standard streams
and environment, killed with a real SIGKILL. The child sets its environment, then
imports the project's own modules and runs the requested module as ``__main__`` (the
harness) or a script as ``python -c`` runs it (the tests). The project's modules are never
imported here: ``reconciler.failpoints`` reads ``RECONCILER_FAILPOINTS`` at import, so each
child imports them after its environment is set, exactly as a fresh interpreter would.
A child ends as an interpreter does: non-daemon threads joined, ``atexit`` handlers run
(coverage saves what it traced there), streams flushed.

Protocol: JSON lines on stdin (``spawn``, ``kill``, ``exit``), JSON lines on stdout
(``spawned`` with the pid, ``exited`` with the exit code, negative for a signal as in
``subprocess``). A ``spawn`` either names a ``log`` file for both output streams, or
carries ``fds``: the child's stdin, stdout and stderr, sent just before it over a Unix
socket (``SCM_RIGHTS``), so a test reads a child's output through a pipe as it would a
``Popen``'s. Kills go through the server so a signal only ever reaches a child it has not
reaped yet: a pid is never reused under the caller's feet. On ``exit``, or at the end of
its input (the caller died, even by SIGKILL), it SIGKILLs and reaps every child it still
has and, when started with ``--cleanup DIR``, removes that folder.
"""

from __future__ import annotations

import atexit
import builtins
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
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Mapping, Sequence
from typing import IO, Any

PRELOAD = (
    "sqlalchemy", "sqlalchemy.orm", "sqlalchemy.ext.compiler", "sqlalchemy.dialects.sqlite",
    "sqlalchemy.dialects.postgresql", "psycopg", "sqlalchemy.dialects.mysql", "pymysql",
    "pydantic",
    "alembic.config", "alembic.script", "alembic.runtime.migration", "alembic.command",
    "apscheduler.schedulers.background", "prometheus_client",
)
REAP_INTERVAL_SECONDS = 0.02
SPAWN_TIMEOUT_SECONDS = 30.0
STREAMS = 3  # a child's stdin, stdout, stderr


def _reply(message: dict[str, Any]) -> None:
    # OSError: the caller stopped reading; it is going away, and so are we.
    with contextlib.suppress(OSError):
        os.write(1, (json.dumps(message) + "\n").encode())


def _streams(request: dict[str, Any], fds: list[int]) -> None:
    """The child's standard streams: the caller's three, or its log file for both outputs."""
    if not fds:
        out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        fds = [null, out, out]
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)


def _exit_code(exc: SystemExit) -> int:
    """What the interpreter makes of ``SystemExit``: a message is printed and exits 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _run_child(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: take the streams and the environment, run the module or the
    script, and end as an interpreter ends."""
    code = 1
    try:
        _streams(request, fds)
        os.environ.clear()
        os.environ.update(request["env"])
        time.tzset()  # TZ, as an interpreter reads it when it starts
        if request.get("cwd"):
            os.chdir(request["cwd"])
        if "code" in request:
            sys.argv = ["-c", *request["args"]]
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = builtins
            sys.modules["__main__"] = main
            exec(compile(request["code"], "<string>", "exec"), main.__dict__)  # noqa: S102
        else:
            sys.argv = [request["module"], *request["args"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize calls
            atexit._run_exitfuncs()
        except BaseException:
            traceback.print_exc()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(cleanup: str | None, fd_socket: socket.socket | None,
          preload: Sequence[str] = PRELOAD) -> None:
    # No death signal here: the end of input says the caller is gone, and this server
    # outlives it just long enough to kill its children and remove the run's folder.
    for name in preload:
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
                    if not _handle(json.loads(line), live, fd_socket):
                        return
            _reap(live, block=False)
    finally:
        for pid in live:
            os.kill(pid, signal.SIGKILL)
        _reap(live, block=True)
        if cleanup:
            shutil.rmtree(cleanup, ignore_errors=True)


def _handle(request: dict[str, Any], live: set[int], fd_socket: socket.socket | None) -> bool:
    """Serve one request; False for ``exit``."""
    if request["op"] == "exit":
        return False
    if request["op"] == "kill":
        if request["pid"] in live:
            os.kill(request["pid"], request["sig"])
    elif request["op"] == "spawn":
        fds: list[int] = []
        if request.get("fds"):
            assert fd_socket is not None, "spawn with fds on a server without its socket"
            _, fds, _, _ = socket.recv_fds(fd_socket, 1, STREAMS)
        pid = os.fork()
        if pid == 0:
            _run_child(request, fds)
        for fd in fds:
            os.close(fd)
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
    """A caller's handle on a running fork server (standard library only); safe to use
    from several threads."""

    def __init__(self, *, cwd: str, env: Mapping[str, str], log: str,
                 cleanup: str | None = None, preload: Sequence[str] = PRELOAD) -> None:
        self._fds, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [sys.executable, "-m", "tests.fork_server", "--fds", str(theirs.fileno()),
                "--preload", ",".join(preload)]
        if cleanup:
            argv += ["--cleanup", cleanup]
        with open(log, "ab") as errors:
            self.popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=errors, cwd=cwd, env=dict(env),
                                          pass_fds=[theirs.fileno()])
        theirs.close()
        self.log = log
        self.pid = self.popen.pid
        self._requests = threading.Lock()
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._exits: queue.Queue[tuple[int, int]] = queue.Queue()
        self._codes: dict[int, int] = {}
        self._ended = threading.Condition()
        self._ids = itertools.count()
        self._reader = threading.Thread(target=self._read, daemon=True, name="fork-server")
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            message = json.loads(line)
            if message["op"] == "exited":
                self._exits.put((message["pid"], message["code"]))
                with self._ended:
                    self._codes[message["pid"]] = message["code"]
                    self._ended.notify_all()
            else:
                self._replies.put(message)
        self._replies.put(None)

    def _send(self, message: dict[str, Any]) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write((json.dumps(message) + "\n").encode())
        self.popen.stdin.flush()

    def _spawn(self, request: dict[str, Any], fds: list[int] | None = None) -> int:
        with self._requests:
            number = next(self._ids)
            if fds is not None:
                socket.send_fds(self._fds, [b"f"], fds)
            self._send({**request, "op": "spawn", "id": number, "fds": fds is not None})
            reply = self._replies.get(timeout=SPAWN_TIMEOUT_SECONDS)
        if reply is None or reply.get("id") != number:
            raise RuntimeError(f"fork server answered {reply!r} to spawn request {number}")
        return int(reply["pid"])

    def spawn(self, module: str, args: list[str], env: Mapping[str, str], log: str,
              cwd: str | None = None) -> int:
        """Fork a child running ``python -m module args...`` with exactly ``env``, both its
        output streams appended to ``log``; its pid."""
        return self._spawn({"module": module, "args": args, "env": dict(env), "log": log,
                            "cwd": cwd})

    def start(self, program: Mapping[str, str], args: list[str], env: Mapping[str, str],
              streams: tuple[int, int, int], cwd: str | None = None) -> int:
        """Fork a child running ``program`` (``{"code": script}``, as ``python -c``, or
        ``{"module": name}``, as ``python -m``) with ``args``, exactly ``env``, and these
        three file descriptors as its stdin, stdout and stderr (the caller keeps its own
        copies); its pid."""
        return self._spawn({**program, "args": args, "env": dict(env), "cwd": cwd},
                           list(streams))

    def kill(self, pid: int, sig: int) -> None:
        """Signal a child the server has not reaped yet (otherwise nothing happens)."""
        with self._requests:
            self._send({"op": "kill", "pid": pid, "sig": int(sig)})

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit code once it ended (negative: the signal that ended it); None
        if it is still running after ``timeout`` seconds (0: do not wait)."""
        with self._ended:
            self._ended.wait_for(lambda: pid in self._codes, timeout)
            return self._codes.get(pid)

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
        self._fds.close()
        with contextlib.suppress(OSError):
            if os.path.getsize(self.log) == 0:  # nothing went wrong: no file left behind
                os.remove(self.log)


class ForkedProcess:
    """A child of a fork server, handled as a ``subprocess.Popen``: ``pid``, ``stdout``
    and ``stderr`` (text pipes, when asked for), ``poll``, ``wait``, ``send_signal``,
    ``kill``, ``returncode``."""

    def __init__(self, server: ForkServer, pid: int, stdout: IO[str] | None,
                 stderr: IO[str] | None) -> None:
        self._server = server
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self._server.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


Stream = int | IO[Any] | None
"""A child's output as ``Popen`` takes it: ``subprocess.PIPE`` (read back as text), an open
file, or None (the caller's own)."""


def start_script(server: ForkServer, script: str, args: list[str], env: Mapping[str, str], *,
                 stdout: Stream = None, stderr: Stream = None,
                 cwd: str | None = None) -> ForkedProcess:
    """``python -c script args...`` as a child of ``server``."""
    return _start(server, {"code": script}, args, env, stdout=stdout, stderr=stderr, cwd=cwd)


def _start(server: ForkServer, program: Mapping[str, str], args: list[str],
           env: Mapping[str, str], *, stdout: Stream, stderr: Stream,
           cwd: str | None) -> ForkedProcess:
    mine: list[IO[str] | None] = []
    theirs: list[int] = [os.open(os.devnull, os.O_RDONLY)]
    opened: list[int] = [theirs[0]]
    for target, own in ((stdout, 1), (stderr, 2)):
        if target == subprocess.PIPE:
            read, write = os.pipe()
            mine.append(open(read, encoding="utf-8", errors="replace"))  # noqa: SIM115
            theirs.append(write)
            opened.append(write)
        else:
            mine.append(None)
            theirs.append(own if target is None else
                          target if isinstance(target, int) else target.fileno())
    try:
        pid = server.start(program, args, env, (theirs[0], theirs[1], theirs[2]), cwd)
    finally:
        for fd in opened:
            os.close(fd)
    return ForkedProcess(server, pid, mine[0], mine[1])


_shared: dict[str, ForkServer] = {}
_shared_lock = threading.Lock()


def shared_server(name: str, *, env: Mapping[str, str],
                  preload: Sequence[str] = PRELOAD) -> ForkServer:
    """This process's fork server ``name``, started on first use (again if it died) in
    the repository's root with ``env`` and ``preload``; it ends with this process."""
    with _shared_lock:
        server = _shared.get(name)
        if server is None or server.popen.poll() is not None:
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            log = os.path.join(tempfile.gettempdir(),
                               f"reconciler-forks-{name}-{os.getpid()}.log")
            server = ForkServer(cwd=root, env=env, log=log, preload=preload)
            atexit.register(server.close)
            _shared[name] = server
        return server


def suite_server() -> ForkServer:
    """The fork server for the tests' own scripts, with this process's environment
    (coverage's included: its children are measured as fresh interpreters would be)."""
    return shared_server("suite", env=os.environ)


def run_script(script: str, *args: str, env: Mapping[str, str], timeout: float,
               cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([python, "-c", script, *args], capture_output=True, text=True)``
    through the suite's fork server: the finished process, or ``TimeoutExpired`` (it is
    killed first)."""
    return run(suite_server(), {"code": script}, list(args), env=env, timeout=timeout, cwd=cwd)


def run(server: ForkServer, program: Mapping[str, str], args: list[str], *,
        env: Mapping[str, str], timeout: float,
        cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """``program`` (as ``ForkServer.start`` takes it) run to its end as ``subprocess.run``
    with ``capture_output=True, text=True`` does, or ``TimeoutExpired`` (it is killed
    first)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = _start(server, program, args, env, stdout=out, stderr=err, cwd=cwd)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(SPAWN_TIMEOUT_SECONDS)
            raise
        out.seek(0)
        err.seek(0)
        argv = ["-c" if "code" in program else "-m", *program.values(), *args]
        return subprocess.CompletedProcess(argv, code, out.read(), err.read())


if __name__ == "__main__":
    options = sys.argv[1:]
    fd_socket = (socket.socket(fileno=int(options[options.index("--fds") + 1]))
                 if "--fds" in options else None)
    serve(options[options.index("--cleanup") + 1] if "--cleanup" in options else None,
          fd_socket, [m for m in options[options.index("--preload") + 1].split(",") if m])
