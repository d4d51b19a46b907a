"""Start a throwaway PostgreSQL server for the test suite.

Usage as a library::

    with ThrowawayPostgres() as pg:
        pg.create_database("t1")
        engine = create_engine(pg.url("t1"))

Usage as a wrapper (exports ``RECONCILER_TEST_PG_DSN`` for the command)::

    python -m tests.pg_server -- pytest -q

Only the standard library plus psycopg (readiness check and
``create_database``/``drop_database``) is used.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType, TracebackType
from typing import Literal

import psycopg
from psycopg import sql

__all__ = [
    "DSN_ENV",
    "INSTALL_HINT",
    "PG_BIN_ENV",
    "ThrowawayPostgres",
    "find_pg_bin",
    "main",
]

PG_BIN_ENV = "RECONCILER_PG_BIN"
DSN_ENV = "RECONCILER_TEST_PG_DSN"

INSTALL_HINT = (
    "PostgreSQL server binaries (initdb, pg_ctl, postgres) not found: on Debian/Ubuntu run "
    "`apt-get install -y postgresql` (provides /usr/lib/postgresql/<ver>/bin), "
    f"or set {PG_BIN_ENV} to the directory holding them."
)

_REQUIRED = ("initdb", "pg_ctl", "postgres")
_HOST = "127.0.0.1"
_SERVER_USER = "postgres"  # OS user used when we run as root
_DB_SUPERUSER = "postgres"  # database superuser created by initdb -U
_CMD_TIMEOUT = 180.0
# How long pg_ctl waits for the server to start or restart: crash recovery after an
# immediate restart took more than 30 s on a 2-core machine at a load of 14; a healthy
# start still returns in about a second.
PG_CTL_WAIT_SECONDS = "120"
_RAM_DIR = Path("/dev/shm")  # noqa: S108 - a tmpfs on Linux; skipped where it is missing
_RAM_DIR_MIN_FREE_BYTES = 2 * 1024**3

ShutdownMode = Literal["smart", "fast", "immediate"]

# Run in a separate process (own session, so Ctrl-C to the test's process
# group does not reach it).  It blocks on a pipe from the owning process; EOF
# means the owner is gone -- even by SIGKILL, which atexit cannot cover -- so
# it stops the server and removes the temp dir.  After a normal stop() the dir
# is already gone and it just exits.
_WATCHDOG = """
import os, shutil, subprocess, sys
pg_ctl, data, base, uid, gid = sys.argv[1:6]
sys.stdin.buffer.read()
if os.path.exists(os.path.join(data, "postmaster.pid")):
    kw = {} if uid == "-" else {"user": int(uid), "group": int(gid), "extra_groups": []}
    subprocess.run([pg_ctl, "stop", "-D", data, "-m", "immediate", "-w", "-t", "30"],
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, cwd="/", check=False, **kw)
shutil.rmtree(base, ignore_errors=True)
"""


# --------------------------------------------------------------------------- #
# Locating binaries
# --------------------------------------------------------------------------- #


def _has_binaries(directory: Path) -> bool:
    return all(os.access(directory / name, os.X_OK) for name in _REQUIRED)


def _version_key(path: Path) -> tuple[int, ...]:
    parts = re.findall(r"\d+", path.parent.name)
    return tuple(int(p) for p in parts) if parts else (-1,)


def find_pg_bin() -> Path | None:
    """Return the directory holding initdb/pg_ctl/postgres, or None.

    Order: ``$RECONCILER_PG_BIN`` (authoritative when set), ``pg_config
    --bindir``, the highest ``/usr/lib/postgresql/*/bin``, then the directory
    of ``initdb`` on PATH (symlinks resolved).
    """
    explicit = os.environ.get(PG_BIN_ENV)
    if explicit:
        path = Path(explicit).expanduser()
        return path if _has_binaries(path) else None

    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.strip()
            if out and _has_binaries(Path(out)):
                return Path(out)

    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version_key, reverse=True)
    for candidate in debian:
        if _has_binaries(candidate):
            return candidate

    initdb = shutil.which("initdb")
    if initdb:
        candidate = Path(initdb).resolve().parent
        if _has_binaries(candidate):
            return candidate
    return None


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_HOST, 0))
        port: int = s.getsockname()[1]
        return port


def _world_traversable(path: Path) -> bool:
    """True if every component of ``path`` is searchable by other users."""
    for p in (path, *path.parents):
        try:
            mode = p.stat().st_mode
        except OSError:
            return False
        if not mode & stat.S_IXOTH:
            return False
    return True


def _is_gone(pid: int) -> bool:
    """True if ``pid`` no longer exists or is a zombie awaiting its (foreign) reaper."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat_line.rpartition(")")[2].split()[:1] == ["Z"]


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<no server log: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


# --------------------------------------------------------------------------- #
# The server
# --------------------------------------------------------------------------- #


class ThrowawayPostgres:
    """A private PostgreSQL cluster in a temp dir, listening on 127.0.0.1.

    Use as a context manager (or call :meth:`start` / :meth:`stop`).  When
    running as root, the cluster is owned by and run as the ``postgres`` OS
    user, since initdb and postgres refuse to run as root.

    Durability: ``fsync`` and ``full_page_writes`` are off (only an OS crash
    could lose data), but ``synchronous_commit`` stays *on* by default: with it
    off, :meth:`restart` in ``"immediate"`` mode (a simulated crash) silently
    loses recently committed transactions, which would make crash tests flaky.
    With fsync off it costs nothing measurable.
    """

    host: str = _HOST

    def __init__(
        self,
        bin_dir: Path | str | None = None,
        *,
        max_connections: int = 200,
        synchronous_commit: bool = True,
    ) -> None:
        resolved = Path(bin_dir) if bin_dir is not None else find_pg_bin()
        if resolved is None or not _has_binaries(resolved):
            raise RuntimeError(INSTALL_HINT)
        self.bin_dir: Path = resolved
        self.max_connections = max_connections
        self.synchronous_commit = synchronous_commit
        self.port: int = 0
        self.base_dir: Path | None = None
        self._running = False
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._as_root = os.geteuid() == 0
        self._user: pwd.struct_passwd | None = pwd.getpwnam(_SERVER_USER) if self._as_root else None

    # -- paths / connection info ------------------------------------------ #

    def _base(self) -> Path:
        if self.base_dir is None:
            raise RuntimeError("server not started")
        return self.base_dir

    @property
    def data_dir(self) -> Path:
        return self._base() / "data"

    @property
    def log_file(self) -> Path:
        return self._base() / "log"

    @property
    def socket_dir(self) -> Path:
        return self._base()

    @property
    def dsn(self) -> str:
        """libpq key=value connection string (no dbname)."""
        return f"host={self.host} port={self.port} user={_DB_SUPERUSER}"

    def url(self, dbname: str) -> str:
        """SQLAlchemy URL for ``dbname`` using the psycopg (v3) driver."""
        return f"postgresql+psycopg://{_DB_SUPERUSER}@{self.host}:{self.port}/{dbname}"

    @property
    def running(self) -> bool:
        return self._running

    # -- process helpers ---------------------------------------------------- #

    def _run(
        self, args: list[str], *, timeout: float = _CMD_TIMEOUT
    ) -> subprocess.CompletedProcess[str]:
        """Run a PostgreSQL tool, dropping privileges to ``postgres`` if root."""
        env = dict(os.environ)
        env.pop("PGDATA", None)
        env["LC_ALL"] = "C"
        if self._user is None:
            return subprocess.run(
                args,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                cwd=self._base(),
                env=env,
            )
        env.update(HOME=self._user.pw_dir, USER=self._user.pw_name, LOGNAME=self._user.pw_name)
        # subprocess does setgroups/setgid/setuid in the child natively
        # (no preexec_fn, so it is thread-safe and needs no runuser/su).
        return subprocess.run(
            args,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=self._base(),
            env=env,
            user=self._user.pw_uid,
            group=self._user.pw_gid,
            extra_groups=[],
        )

    def _server_options(self) -> str:
        return " ".join(
            [
                f"-p {self.port}",
                f"-k {self.socket_dir}",
                f"-c listen_addresses={self.host}",
                "-c fsync=off",
                f"-c synchronous_commit={'on' if self.synchronous_commit else 'off'}",
                "-c full_page_writes=off",
                f"-c max_connections={self.max_connections}",
            ]
        )

    def _pg_ctl(self, action: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return self._run([str(self.bin_dir / "pg_ctl"), action, "-D", str(self.data_dir), *extra])

    def _fail(self, what: str, proc: subprocess.CompletedProcess[str] | None) -> RuntimeError:
        parts = [f"{what} failed"]
        if proc is not None:
            parts.append(f"(exit {proc.returncode})")
            output = (proc.stdout + proc.stderr).strip()
            if output:
                parts.append(f"\n--- output ---\n{output}")
        if self.base_dir is not None and self.log_file.exists():
            parts.append(f"\n--- server log (last lines) ---\n{_tail(self.log_file)}")
        return RuntimeError(" ".join(parts))

    def _wait_ready(self, timeout: float = 60.0) -> None:
        """pg_ctl -w already waits; double-check that TCP connections work."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(f"{self.dsn} dbname=postgres connect_timeout=2"):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    # -- lifecycle ---------------------------------------------------------- #

    def start(self) -> ThrowawayPostgres:
        if self._running:
            return self
        if self.base_dir is None:
            self.base_dir = Path(tempfile.mkdtemp(prefix="reconciler-pg-", dir=self._parent()))
            atexit.register(self.stop)
            if self._user is not None:
                os.chown(self.base_dir, self._user.pw_uid, self._user.pw_gid)
            self._start_watchdog()
        try:
            if not (self.data_dir / "PG_VERSION").exists():
                self._initdb()
            self._start_server()
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _parent(self) -> str:
        """Where the cluster lives: in memory when the machine has a RAM-backed folder with
        room to spare (a container's default /dev/shm of 64 MiB has not).

        Every test creates and drops a database. On the disk here that is file creation,
        unlinks and discards: 0.2 to 1.2 s per database on a busy machine, against about
        0.1 s in memory, measured side by side. Durability is off anyway (see the class).
        """
        for candidate in (_RAM_DIR, Path(tempfile.gettempdir())):
            usable = candidate.is_dir() and os.access(candidate, os.W_OK | os.X_OK)
            if candidate == _RAM_DIR and usable:
                room = os.statvfs(candidate)
                usable = room.f_bavail * room.f_frsize >= _RAM_DIR_MIN_FREE_BYTES
            if usable and (not self._as_root or _world_traversable(candidate)):
                return str(candidate)
        return "/tmp"  # noqa: S108 - must be traversable by the postgres user

    def _start_watchdog(self) -> None:
        uid, gid = ("-", "-") if self._user is None else (self._user.pw_uid, self._user.pw_gid)
        self._watchdog = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WATCHDOG,
                str(self.bin_dir / "pg_ctl"),
                str(self.data_dir),
                str(self._base()),
                str(uid),
                str(gid),
            ],
            stdin=subprocess.PIPE,
            # Never hold the caller's stdout/stderr pipes open after we exit.
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
            start_new_session=True,
        )

    def _stop_watchdog(self) -> None:
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is None:
            return
        with contextlib.suppress(OSError):
            if watchdog.stdin is not None:
                watchdog.stdin.close()
        try:
            watchdog.wait(timeout=10)
        except subprocess.TimeoutExpired:
            watchdog.kill()
            watchdog.wait()

    def _initdb(self) -> None:
        proc = self._run(
            [
                str(self.bin_dir / "initdb"),
                "-D",
                str(self.data_dir),
                "-U",
                _DB_SUPERUSER,
                "--auth=trust",
                "--encoding=UTF8",
                "--no-locale",
                "--no-sync",
            ]
        )
        if proc.returncode != 0:
            raise self._fail("initdb", proc)

    def _start_server(self, attempts: int = 3) -> None:
        for attempt in range(attempts):
            self.port = _free_port()
            proc = self._pg_ctl(
                "start", "-w", "-t", PG_CTL_WAIT_SECONDS, "-o", self._server_options(),
                "-l", str(self.log_file),
            )
            if proc.returncode == 0:
                self._running = True
                return
            # Lost the race for the port to someone else: try another one.
            if attempt + 1 < attempts and "already in use" in _tail(self.log_file, 10):
                self._kill_leftover()
                continue
            raise self._fail("pg_ctl start", proc)

    def restart(self, mode: ShutdownMode = "immediate") -> None:
        """Restart the server (same port and options); default is a crash-like restart."""
        if not self._running:
            raise RuntimeError("server not running")
        proc = self._pg_ctl(
            "restart",
            "-m",
            mode,
            "-w",
            "-t",
            PG_CTL_WAIT_SECONDS,
            "-o",
            self._server_options(),
            "-l",
            str(self.log_file),
        )
        if proc.returncode != 0:
            # The old server may or may not be gone; make sure nothing is left.
            err = self._fail(f"pg_ctl restart -m {mode}", proc)
            self.stop()
            raise err
        self._wait_ready()

    def _kill_leftover(self) -> None:
        """SIGKILL the postmaster recorded in postmaster.pid, if any (last resort)."""
        pid_file = self.data_dir / "postmaster.pid"
        try:
            pid = int(pid_file.read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return
        # Guard against a stale pid file whose pid was reused by something else.
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            cmdline = b""
        if Path("/proc/self").exists() and str(self.data_dir).encode() not in cmdline:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            # Children notice the postmaster is gone and exit on their own.
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not _is_gone(pid):
                time.sleep(0.02)

    def stop(self) -> None:
        """Stop the server (immediate) and remove the temp dir. Idempotent."""
        if self.base_dir is None:
            return
        try:
            if self._running or (self.data_dir / "postmaster.pid").exists():
                proc: subprocess.CompletedProcess[str] | None
                try:
                    proc = self._pg_ctl("stop", "-m", "immediate", "-w", "-t", "30")
                except (OSError, subprocess.SubprocessError):
                    proc = None
                if proc is None or proc.returncode != 0:
                    self._kill_leftover()
        finally:
            self._running = False
            shutil.rmtree(self.base_dir, ignore_errors=True)
            self.base_dir = None
            self._stop_watchdog()
            atexit.unregister(self.stop)

    def __enter__(self) -> ThrowawayPostgres:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- databases ---------------------------------------------------------- #

    def _admin_execute(self, statement: str, name: str) -> None:
        query = sql.SQL(statement).format(sql.Identifier(name))
        with psycopg.connect(f"{self.dsn} dbname=postgres", autocommit=True) as conn:
            conn.execute(query)

    def create_database(self, name: str) -> None:
        self._admin_execute("CREATE DATABASE {}", name)

    def drop_database(self, name: str) -> None:
        self._admin_execute("DROP DATABASE IF EXISTS {} WITH (FORCE)", name)

    def add_password_role(self, role: str, password: str) -> None:
        """A login role that must give its password over TCP (``scram-sha-256``); every
        other role is still trusted. For the tests of a password refused."""
        hba = self.data_dir / "pg_hba.conf"
        # The first matching line wins: this one goes before initdb's "trust" lines.
        hba.write_text(f"host all {role} 127.0.0.1/32 scram-sha-256\n{hba.read_text()}")
        with psycopg.connect(f"{self.dsn} dbname=postgres", autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(password)))
            conn.execute("SELECT pg_reload_conf()")


# --------------------------------------------------------------------------- #
# python -m tests.pg_server -- CMD ARGS...
# --------------------------------------------------------------------------- #


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        print("usage: python -m tests.pg_server -- CMD [ARGS...]", file=sys.stderr)
        return 2
    bin_dir = find_pg_bin()
    if bin_dir is None:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    # Turn SIGTERM/SIGHUP into SystemExit so the server is always stopped.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_exit)
    with ThrowawayPostgres(bin_dir) as pg:
        env = dict(os.environ)
        env[DSN_ENV] = pg.dsn
        try:
            proc = subprocess.Popen(args, env=env)
        except OSError as exc:
            print(f"pg_server: cannot run {args[0]!r}: {exc}", file=sys.stderr)
            return 127
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            with contextlib.suppress(BaseException):
                proc.terminate()
                proc.wait(timeout=30)
            return 130
        except BaseException:
            # Interrupted (Ctrl-C / SIGTERM): let the child finish, then clean up.
            with contextlib.suppress(BaseException):
                proc.terminate()
                proc.wait(timeout=30)
            raise
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
